//! The pager: one userfaultfd, its regions, and the threads that serve their faults.
//!
//! Every fault thread polls the userfaultfd. Events are read under the write side of the
//! `layout` lock and `REMOVE` events are applied to the page table before the lock is released;
//! a fault is resolved (state checked, pages installed, state updated) under the read side.
//! Because the kernel zaps a removed range only after its event has been read, no copy of
//! stale data can land after a discard: any copy issued after the event was read re-checks the
//! page's state, which then says `Zero`.
//!
//! A fault on a non-resident page fetches its whole block from the page's source (the restore
//! image or the offload store) outside any lock; if every page of the block that lies in the
//! region is in the same state, the whole block is installed with one `UFFDIO_COPY`, else only
//! the faulting page. Zero content is mapped with `UFFDIO_ZEROPAGE`, MINOR faults (memfd RAM)
//! with `UFFDIO_CONTINUE`.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use compressed_backing::BlockSize;
use parking_lot::{Mutex, RwLock};

use crate::addr::{HostAddr, HostRange, PAGE_SIZE};
use crate::cold::{Cold, ColdConfig, ColdError, ColdStats};
use crate::journal::Journal;
use crate::limit::{HeldHandler, Reservation, ResidentLimit};
use crate::metrics::Metrics;
use crate::source::{Content, PageSource, SourceError, StoreSource};
use crate::state::{PageState, PageStates, StateCounts};
use crate::uffd::{feature, Event, Mode, UffdError, Userfaultfd};

/// How guest RAM is mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RamKind {
    /// Private anonymous memory: dropped with `MADV_DONTNEED`.
    Anon,
    /// A shared memfd mapping: dropped by punching holes; MINOR faults map the page cache.
    Memfd,
    /// A private mapping of a sealed RAM image (a restored snapshot): the image's page cache
    /// serves reads, a write makes a private copy. The kernel cannot register a private file
    /// mapping for MISSING or MINOR faults, so the pager leaves it alone: it is not
    /// registered and not offloaded by the pager (the VMM offloads its private pages).
    Snapshot,
}

/// One range of guest RAM handed to the pager.
#[derive(Debug, Clone)]
pub struct RegionSpec {
    /// How it is mapped.
    pub kind: RamKind,
    /// Where it is mapped in the process that owns the userfaultfd.
    pub range: HostRange,
    /// Its offset in the RAM image (page-aligned; regions are laid end to end in the image).
    pub image_offset: u64,
    /// For memfd RAM: the memfd, to punch holes in on offload.
    pub memfd: Option<Arc<File>>,
    /// For memfd RAM: the offset in the memfd at which the region is mapped.
    pub memfd_offset: u64,
    /// Where the pager can read the region in its own address space: `range.start()` for an
    /// in-process VMM (anonymous RAM is then dropped with `madvise`), the pager's own mapping
    /// of the memfd for memfd RAM of another process (dropped by punching holes), `None` for
    /// memory of another process that is reachable only through its userfaultfd (served, but
    /// never offloaded).
    pub view: Option<HostAddr>,
}

impl RegionSpec {
    /// True if the region is this process's own mapping.
    pub fn in_process(&self) -> bool {
        self.view == Some(self.range.start())
    }

    /// True if the pager can read and drop the region's pages itself.
    pub fn can_offload(&self) -> bool {
        match self.kind {
            RamKind::Anon => self.in_process(),
            RamKind::Memfd => self.view.is_some() && self.memfd.is_some(),
            RamKind::Snapshot => false,
        }
    }
}

/// A region as the pager keeps it.
#[derive(Debug)]
pub(crate) struct Region {
    pub spec: RegionSpec,
    /// Image page index of the region's first page.
    pub first_page: u64,
}

impl Region {
    /// Image pages of the region.
    pub fn pages(&self) -> std::ops::Range<u64> {
        self.first_page..self.first_page + self.spec.range.pages()
    }

    /// Host address of image page `page` (which must be in the region), as the owner of the
    /// userfaultfd sees it.
    pub fn addr_of(&self, page: u64) -> HostAddr {
        self.spec.range.page_addr(page - self.first_page)
    }

    /// Where the pager reads image page `page` in its own address space, if it can.
    pub fn view_of(&self, page: u64) -> Option<HostAddr> {
        self.spec
            .view
            .map(|view| HostAddr(view.0 + (page - self.first_page) * PAGE_SIZE))
    }
}

/// Pager construction parameters.
#[derive(Debug, Clone)]
pub struct PagerConfig {
    /// Fault-serving threads.
    pub threads: usize,
    /// Unit of fetch, install and prefetch.
    pub block_size: BlockSize,
    /// State of every page at start: `Zero` for a fresh VM, `Source` for a restore.
    pub initial: PageState,
    /// Register the regions on the userfaultfd (false when the owner registered them, as
    /// Firecracker does before handing the descriptor over).
    pub register: bool,
    /// Ask for `REMOVE` events (a VMM that discards memory without telling the pager needs
    /// them; one that calls [`Pager::discarded`] first does not, and cold compression, which
    /// zaps page-table entries itself, needs them off).
    pub remove_events: bool,
    /// Track writes to anonymous RAM and allow moving its pages out (`WP_ASYNC` and `MOVE`
    /// features, anon regions registered write-protect too): what cold compression of anon
    /// RAM needs. Linux 6.8 or later.
    pub track_writes: bool,
}

impl Default for PagerConfig {
    fn default() -> Self {
        Self {
            threads: 1,
            block_size: BlockSize::default(),
            initial: PageState::Zero,
            register: true,
            remove_events: true,
            track_writes: false,
        }
    }
}

/// Errors setting up a pager.
#[derive(Debug, thiserror::Error)]
pub enum PagerError {
    /// A userfaultfd operation failed.
    #[error(transparent)]
    Uffd(#[from] UffdError),
    /// Regions overlap, are misaligned in the image, or exceed the source.
    #[error("invalid regions: {0}")]
    Regions(String),
    /// A thread could not be started.
    #[error("cannot start a pager thread")]
    Thread(#[source] std::io::Error),
    /// The eventfd that stops and wakes the fault threads could not be created.
    #[error("cannot create an eventfd")]
    EventFd(#[source] std::io::Error),
}

/// A fault that could not be served. The faulting thread stays blocked: it is never given
/// zeros or stale bytes for data that exists somewhere.
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    /// The address is in no region.
    #[error("fault at {addr} is outside every region")]
    Outside {
        /// The address.
        addr: HostAddr,
    },
    /// The page's bytes could not be read.
    #[error("fault at {addr}: cannot read its data")]
    Source {
        /// The address.
        addr: HostAddr,
        /// Why.
        #[source]
        source: SourceError,
    },
    /// A page is in the restore-source state but the pager has no restore source.
    #[error("fault at {addr}: no restore source for it")]
    NoSource {
        /// The address.
        addr: HostAddr,
    },
    /// The memory pool could not give the block back.
    #[error("fault at {addr}: the memory pool cannot give its block back")]
    Pool {
        /// The address.
        addr: HostAddr,
        /// Why.
        #[source]
        source: compressed_backing::PoolError,
    },
    /// Installing the page failed.
    #[error("fault at {addr}: cannot install it")]
    Install {
        /// The address.
        addr: HostAddr,
        /// Why.
        #[source]
        source: UffdError,
    },
    /// The same page keeps faulting although the pager holds it resident: its data is gone.
    #[error("fault at {addr}: the page faults again and again although it is resident")]
    Lost {
        /// The address.
        addr: HostAddr,
    },
    /// A `REMOVE` or `UNMAP` event that touches no region: ignored.
    #[error("discard of {start}..{end} is outside every region: ignored")]
    DiscardOutside {
        /// First address.
        start: HostAddr,
        /// One past the last address.
        end: HostAddr,
    },
    /// An event of a kind the pager never enables: ignored.
    #[error("unexpected {kind} event: ignored")]
    Unexpected {
        /// The kind.
        kind: String,
    },
}

impl FaultError {
    /// True for what the pager ignores (events and faults outside its regions, unexpected
    /// event kinds): nothing was served wrong, the owner of the memory misbehaves.
    pub fn is_ignored(&self) -> bool {
        matches!(
            self,
            Self::Outside { .. } | Self::DiscardOutside { .. } | Self::Unexpected { .. }
        )
    }
}

/// Called for every fault that cannot be served (from a fault thread).
pub type ErrorHandler = Box<dyn Fn(&FaultError) + Send + Sync>;

/// State shared by the pager's threads.
pub(crate) struct Shared {
    pub uffd: Userfaultfd,
    /// The userfaultfd reports `REMOVE` events (so the pager's own drops produce them too).
    pub remove_events: bool,
    /// Anon regions are registered write-protect with `WP_ASYNC` and `MOVE` is on.
    pub track_writes: bool,
    pub regions: Vec<Region>,
    pub states: PageStates,
    pub block_size: BlockSize,
    pub image_size: u64,
    pub restore: Option<Arc<dyn PageSource>>,
    pub store: StoreSource,
    /// Write side: reading events and applying discards; read side: resolving faults.
    pub layout: RwLock<()>,
    pub metrics: Metrics,
    /// Faults read and not yet resolved (the prefetcher yields while this is non-zero).
    pub faults_in_flight: AtomicU64,
    /// Faults ever read (the prefetcher grows its chunks while this does not move).
    pub faults_seen: AtomicU64,
    /// The block of the latest fault read (the prefetcher skips ahead of it).
    pub latest_fault_block: AtomicU64,
    /// Blocks fetched by faults, in order, since the last `reset`.
    pub working_set: WorkingSet,
    /// The owner of the memory has exited.
    pub owner_gone: AtomicBool,
    /// Asks the prefetcher to stop.
    pub prefetch_stop: AtomicBool,
    /// The resident limit, and what is held at it.
    pub limit: ResidentLimit,
    /// Signalled to stop the fault threads (with `stopping` set) or to wake them (a raised
    /// limit or a discard may let held faults through).
    signal: OwnedFd,
    /// The pager is being dropped: the fault threads return.
    stopping: AtomicBool,
    /// Cold compression, once started.
    pub cold: OnceLock<Cold>,
    pub on_error: ErrorHandler,
    /// Where `states` lives when it must outlive the process; its read marker brackets every
    /// read of events until the read's discards are in the table.
    pub journal: Option<Arc<Journal>>,
}

/// The order in which blocks were first faulted in.
#[derive(Debug)]
pub(crate) struct WorkingSet {
    seen: Box<[AtomicBool]>,
    order: Mutex<Vec<u64>>,
}

impl WorkingSet {
    fn new(blocks: u64) -> Self {
        Self {
            seen: (0..blocks).map(|_| AtomicBool::new(false)).collect(),
            order: Mutex::new(Vec::new()),
        }
    }

    fn record(&self, block: u64) {
        if let Some(seen) = self.seen.get(block as usize) {
            if !seen.swap(true, Ordering::Relaxed) {
                self.order.lock().push(block);
            }
        }
    }

    /// The recorded order; recording starts afresh.
    pub fn take(&self) -> Vec<u64> {
        for seen in self.seen.iter() {
            seen.store(false, Ordering::Relaxed);
        }
        std::mem::take(&mut *self.order.lock())
    }

    /// Starts recording afresh from `base` (the set saved by earlier resumes), so that the
    /// next saved set is `base` followed by the blocks that fault this time.
    pub fn restart(&self, base: &[u64]) {
        self.take();
        for &block in base {
            self.record(block);
        }
    }
}

/// The lazy memory service for one set of regions. Dropping it stops its threads; pages
/// still stored then fault to the kernel's default (zeros), so stop the VM first.
pub struct Pager {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    prefetcher: Mutex<Option<JoinHandle<()>>>,
    cold_scanner: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Pager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pager")
            .field("regions", &self.shared.regions)
            .field("threads", &self.threads.len())
            .finish_non_exhaustive()
    }
}

/// The userfaultfd features an in-process pager asks for.
pub const FEATURES: u64 = feature::EVENT_REMOVE | feature::MISSING_SHMEM | feature::MINOR_SHMEM;

impl Pager {
    /// Creates a userfaultfd, registers `regions` on it (see [`Pager::with_uffd`]) and starts
    /// serving their faults.
    ///
    /// # Safety
    ///
    /// As [`Userfaultfd::register`]: every region must be mapped in this process and stay
    /// mapped while the pager lives, and nothing may touch it except through the pager.
    pub unsafe fn new(
        regions: Vec<RegionSpec>,
        config: PagerConfig,
        restore: Option<Arc<dyn PageSource>>,
        on_error: ErrorHandler,
    ) -> Result<Self, PagerError> {
        let mut features = if config.remove_events {
            FEATURES
        } else {
            FEATURES & !feature::EVENT_REMOVE
        };
        if config.track_writes {
            features |= feature::WP_ASYNC | feature::MOVE;
        }
        let uffd = Userfaultfd::create(features)?;
        let remove_events = config.remove_events;
        // SAFETY: forwarded from the caller.
        unsafe { Self::with_uffd(uffd, remove_events, regions, config, restore, on_error) }
    }

    /// Serves faults of `regions` on an existing userfaultfd (`remove_events`: it reports
    /// `REMOVE`). Registers the regions first if `config.register`.
    ///
    /// # Safety
    ///
    /// If `config.register`, as [`Userfaultfd::register`]. Every region's `view`, if any, must
    /// be mapped readable in this process for the pager's lifetime.
    pub unsafe fn with_uffd(
        uffd: Userfaultfd,
        remove_events: bool,
        regions: Vec<RegionSpec>,
        config: PagerConfig,
        restore: Option<Arc<dyn PageSource>>,
        on_error: ErrorHandler,
    ) -> Result<Self, PagerError> {
        // SAFETY: forwarded from the caller.
        unsafe {
            Self::with_journal(
                uffd,
                remove_events,
                regions,
                config,
                restore,
                on_error,
                None,
            )
        }
    }

    /// As [`Pager::with_uffd`], with the page states kept in `journal` if given (in the
    /// states it holds: `config.initial` is not applied) so that they outlive this process.
    ///
    /// # Safety
    ///
    /// As [`Pager::with_uffd`].
    pub unsafe fn with_journal(
        uffd: Userfaultfd,
        remove_events: bool,
        mut regions: Vec<RegionSpec>,
        config: PagerConfig,
        restore: Option<Arc<dyn PageSource>>,
        on_error: ErrorHandler,
        journal: Option<Arc<Journal>>,
    ) -> Result<Self, PagerError> {
        regions.sort_by_key(|r| r.range.start());
        let image_size = check_regions(&regions, restore.as_deref())?;
        let pages = image_size / PAGE_SIZE;
        if let Some(journal) = &journal {
            if journal.pages() != pages {
                return Err(PagerError::Regions(format!(
                    "the journal describes {} pages, the regions {pages}",
                    journal.pages()
                )));
            }
        }
        if config.register {
            for region in &regions {
                let mode = match region.kind {
                    RamKind::Anon if config.track_writes => Mode::MISSING_WP,
                    RamKind::Anon => Mode::MISSING,
                    RamKind::Memfd => Mode::MISSING_MINOR,
                    RamKind::Snapshot => continue,
                };
                // SAFETY: forwarded from the caller.
                unsafe { uffd.register(region.range, mode)? };
            }
        }
        let blocks = config.block_size.blocks_for(image_size);
        // SAFETY: eventfd with valid flags; the result is checked.
        let signal = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if signal < 0 {
            return Err(PagerError::EventFd(std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor owned by nobody else.
        let signal = unsafe { OwnedFd::from_raw_fd(signal) };
        let shared = Arc::new(Shared {
            uffd,
            remove_events,
            track_writes: config.track_writes,
            regions: regions
                .into_iter()
                .map(|spec| Region {
                    first_page: spec.image_offset / PAGE_SIZE,
                    spec,
                })
                .collect(),
            states: match &journal {
                Some(journal) => PageStates::journaled(Arc::clone(journal)),
                None => PageStates::new(pages, config.initial),
            },
            block_size: config.block_size,
            image_size,
            restore,
            store: StoreSource::empty(),
            layout: RwLock::new(()),
            metrics: Metrics::default(),
            faults_in_flight: AtomicU64::new(0),
            faults_seen: AtomicU64::new(0),
            latest_fault_block: AtomicU64::new(u64::MAX),
            working_set: WorkingSet::new(blocks),
            owner_gone: AtomicBool::new(false),
            prefetch_stop: AtomicBool::new(false),
            limit: ResidentLimit::new(),
            signal,
            stopping: AtomicBool::new(false),
            cold: OnceLock::new(),
            on_error,
            journal,
        });
        let mut threads = Vec::new();
        for index in 0..config.threads.max(1) {
            let shared = Arc::clone(&shared);
            let thread = std::thread::Builder::new()
                .name(format!("uffd-fault-{index}"))
                .spawn(move || shared.serve())
                .map_err(PagerError::Thread)?;
            threads.push(thread);
        }
        Ok(Self {
            shared,
            threads,
            prefetcher: Mutex::new(None),
            cold_scanner: Mutex::new(None),
        })
    }

    /// Counters.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// Pages per state, with every event read so far applied.
    pub fn state_counts(&self) -> StateCounts {
        let _read = self.shared.layout.read();
        self.shared.states.counts()
    }

    /// The state of the page at image offset `offset`, with every event read so far applied
    /// (a discard that has returned to its caller is visible here).
    pub fn page_state(&self, offset: u64) -> PageState {
        let _read = self.shared.layout.read();
        self.shared.states.get(offset / PAGE_SIZE)
    }

    /// Bytes in the RAM image (all regions).
    pub fn image_size(&self) -> u64 {
        self.shared.image_size
    }

    /// The unit of fetch and prefetch.
    pub fn block_size(&self) -> BlockSize {
        self.shared.block_size
    }

    /// A read-only view of the offload store's image as it is now, if anything was offloaded
    /// (see `compressed_backing::StoreReader`).
    pub fn store_reader(&self) -> Option<compressed_backing::StoreReader> {
        self.shared.store.slot().read().as_ref().map(|s| s.reader())
    }

    /// True once the process owning the memory has exited.
    pub fn owner_gone(&self) -> bool {
        self.shared.owner_gone.load(Ordering::Relaxed)
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    pub(crate) fn prefetcher(&self) -> &Mutex<Option<JoinHandle<()>>> {
        &self.prefetcher
    }

    /// Starts live cold-RAM compression ([`crate::cold`]): needs RAM mapped in this process
    /// (memfd, or anon with `track_writes`) and a pager without `REMOVE` events.
    pub fn start_cold(&self, config: ColdConfig) -> Result<(), ColdError> {
        if self.shared.remove_events {
            return Err(ColdError::Config(
                "the pager must be created with remove_events off (the VMM reports discards)"
                    .into(),
            ));
        }
        let cold = Cold::new(&self.shared, config)?;
        self.shared.cold.set(cold).map_err(|_| ColdError::Running)?;
        let shared = Arc::clone(&self.shared);
        let handle = std::thread::Builder::new()
            .name("uffd-cold".into())
            .spawn(move || {
                let cold = shared.cold.get().expect("set before the thread starts");
                crate::cold::run(&shared, cold);
            })
            .map_err(ColdError::Thread)?;
        *self.cold_scanner.lock() = Some(handle);
        Ok(())
    }

    /// What cold compression has done and costs, if it runs.
    pub fn cold_stats(&self) -> Option<ColdStats> {
        let cold = self.shared.cold.get()?;
        Some(cold.stats(self.shared.states.counts().pooled))
    }

    /// The guest reports idle (`true`: cold compression scans harder) or busy.
    pub fn set_idle(&self, idle: bool) {
        if let Some(cold) = self.shared.cold.get() {
            cold.set_idle(idle);
        }
    }

    /// Tells the pager that the VMM discarded `range` itself without a `REMOVE` event (for
    /// userfaultfds without that feature): its pages read as zeros from now on.
    pub fn discarded(&self, range: HostRange) {
        {
            let _write = self.shared.layout.write();
            self.shared.apply_remove(range.start(), range.end());
        }
        self.shared.wake_held();
    }

    /// Sets (`Some(bytes)`) or removes (`None`, the default) the resident limit: while it is
    /// set, a fault or load that would map pages past it waits until there is room (see
    /// [`crate::limit`]). Held faults are retried at once when the limit is raised or removed.
    pub fn set_resident_limit(&self, limit: Option<u64>) {
        self.shared.limit.set(limit);
        self.shared.wake_held();
    }

    /// The resident limit in bytes, if one is set.
    pub fn resident_limit(&self) -> Option<u64> {
        self.shared.limit.get()
    }

    /// Faults held at the resident limit right now (a count of faults, not of pages).
    pub fn held_faults(&self) -> u64 {
        self.shared.metrics.held_now.load(Ordering::Relaxed)
    }

    /// Bytes the faults held right now would install (whole block spans).
    pub fn held_bytes(&self) -> u64 {
        self.shared.limit.held_pages() * PAGE_SIZE
    }

    /// Sets the callback a fault thread calls when faults are held at the resident limit,
    /// with the bytes by which the limit falls short of serving every held fault: when a fault
    /// first becomes held and whenever that figure changes while faults stay held, at most
    /// once per 10 ms. It runs on a fault thread: it must return quickly and must not call
    /// `on_held` itself.
    pub fn on_held(&self, handler: HeldHandler) {
        self.shared.limit.on_held(handler);
    }
}

impl Pager {
    /// A handle on the resident limit that another thread keeps (a governor's link): it
    /// sets the limit and reads what is resident and held, like the pager's own methods.
    pub fn resident_handle(&self) -> ResidentHandle {
        ResidentHandle(Arc::clone(&self.shared))
    }
}

/// See [`Pager::resident_handle`]. It keeps the pager's shared state alive, not its fault
/// threads: once the pager is dropped, a limit set through it holds nothing.
#[derive(Clone)]
pub struct ResidentHandle(Arc<Shared>);

impl std::fmt::Debug for ResidentHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentHandle")
            .field("limit", &self.0.limit.get())
            .finish_non_exhaustive()
    }
}

impl ResidentHandle {
    /// As [`Pager::set_resident_limit`].
    pub fn set_resident_limit(&self, limit: Option<u64>) {
        self.0.limit.set(limit);
        self.0.wake_held();
    }

    /// Guest RAM resident now, bytes (O(1)).
    pub fn resident_bytes(&self) -> u64 {
        self.0.states.resident() * PAGE_SIZE
    }

    /// As [`Pager::held_bytes`].
    pub fn held_bytes(&self) -> u64 {
        self.0.limit.held_pages() * PAGE_SIZE
    }

    /// Bytes by which the limit, as it is now, falls short of serving every held fault (0:
    /// no fault is held, there is no limit, or the last raise covers them and the faults go
    /// through on their next try).
    pub fn shortfall_bytes(&self) -> u64 {
        self.0.limit.shortfall(self.0.states.resident())
    }
}

impl Drop for Pager {
    fn drop(&mut self) {
        self.stop_prefetch();
        if let Some(cold) = self.shared.cold.get() {
            cold.stop.store(true, Ordering::Relaxed);
        }
        if let Some(scanner) = self.cold_scanner.lock().take() {
            scanner.thread().unpark();
            let _ = scanner.join();
        }
        self.shared.stopping.store(true, Ordering::Relaxed);
        self.shared.signal();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Checks that regions do not overlap in memory or in the image and are page-aligned;
/// returns the image size.
fn check_regions(
    regions: &[RegionSpec],
    restore: Option<&dyn PageSource>,
) -> Result<u64, PagerError> {
    if regions.is_empty() {
        return Err(PagerError::Regions("no regions".into()));
    }
    let mut image_size = 0u64;
    for (i, region) in regions.iter().enumerate() {
        if region.image_offset % PAGE_SIZE != 0 {
            return Err(PagerError::Regions(format!(
                "region {:?} has image offset {:#x}, not page-aligned",
                region.range, region.image_offset
            )));
        }
        if region.kind == RamKind::Memfd && region.view.is_some() && region.memfd.is_none() {
            return Err(PagerError::Regions(format!(
                "memfd region {:?} comes without its memfd",
                region.range
            )));
        }
        let end = region
            .image_offset
            .checked_add(region.range.len())
            .ok_or_else(|| PagerError::Regions("image offset overflows".into()))?;
        image_size = image_size.max(end);
        for other in &regions[i + 1..] {
            if region.range.overlaps(&other.range) {
                return Err(PagerError::Regions(format!(
                    "regions {:?} and {:?} overlap",
                    region.range, other.range
                )));
            }
            let other_end = other.image_offset + other.range.len();
            if region.image_offset < other_end && other.image_offset < end {
                return Err(PagerError::Regions(format!(
                    "regions {:?} and {:?} overlap in the image",
                    region.range, other.range
                )));
            }
        }
    }
    if let Some(source) = restore {
        if source.image_size() < image_size {
            return Err(PagerError::Regions(format!(
                "the regions need {image_size} bytes of image, the source has {}",
                source.image_size()
            )));
        }
    }
    Ok(image_size)
}

/// A fault read from the userfaultfd and not yet resolved.
struct Pending {
    addr: HostAddr,
    minor: bool,
    since: Instant,
    /// Pages it was held for at the resident limit when last tried (0: not held).
    held: u64,
    /// When it was first held (counted in `faults_held`); its wait goes to `held_us` once
    /// it is served.
    held_since: Option<Instant>,
}

/// Outcome of one resolution attempt.
enum Attempt {
    Resolved,
    /// EAGAIN: read events, then try again.
    Retry,
    /// Installing would cross the resident limit: try again when there is room.
    Held {
        /// The pages it would install.
        pages: u64,
    },
}

/// How long a fault thread with only held faults waits for an event before it looks again
/// (a raised limit or a discard wakes it at once; an offload that frees room does not).
const HELD_POLL_MS: i32 = 5;

impl Shared {
    /// A fault thread: poll, read events, resolve, until `stop_fd` is signalled.
    fn serve(&self) {
        let mut events = Vec::with_capacity(64);
        let mut pending: Vec<Pending> = Vec::new();
        let mut buf = vec![0u8; self.block_size.bytes()];
        let mut repeat = (HostAddr(0), 0u32);
        // Held faults: the shortfall last reported, and whether a report is due.
        let mut reported_shortfall = 0;
        let mut report_due = false;
        let mut only_held = false;
        loop {
            let timeout = match (pending.is_empty(), only_held) {
                (true, _) => -1,
                (false, true) => HELD_POLL_MS,
                (false, false) => 1,
            };
            // A poll that fails cannot recover: stop this thread.
            let (ready, signalled) = self
                .uffd
                .poll(Some(self.signal.as_raw_fd()), timeout)
                .unwrap_or((false, true));
            if self.stopping.load(Ordering::Relaxed) || self.owner_gone.load(Ordering::Relaxed) {
                return;
            }
            if signalled {
                self.drain_signal();
            }
            if ready || !pending.is_empty() {
                let _write = self.layout.write();
                if let Some(journal) = &self.journal {
                    journal.begin_read();
                }
                match self.uffd.read_events(&mut events) {
                    Ok(_) => {}
                    Err(_) => {
                        // The descriptor is unusable (the owner closed its side).
                        self.owner_gone.store(true, Ordering::Relaxed);
                        return;
                    }
                }
                for event in events.drain(..) {
                    match event {
                        Event::Pagefault { addr, minor, .. } => {
                            self.faults_seen.fetch_add(1, Ordering::Relaxed);
                            self.faults_in_flight.fetch_add(1, Ordering::Relaxed);
                            self.metrics.fault_events.fetch_add(1, Ordering::Relaxed);
                            if let Some(region) = self.locate(addr) {
                                let page = region.first_page
                                    + region.spec.range.page_index(addr).expect("located");
                                self.latest_fault_block.store(
                                    self.block_size.index_of(page * PAGE_SIZE),
                                    Ordering::Relaxed,
                                );
                            }
                            pending.push(Pending {
                                addr,
                                minor,
                                since: Instant::now(),
                                held: 0,
                                held_since: None,
                            });
                        }
                        Event::Remove { start, end } | Event::Unmap { start, end } => {
                            if !self.apply_remove(start, end) {
                                self.metrics.events_ignored.fetch_add(1, Ordering::Relaxed);
                                (self.on_error)(&FaultError::DiscardOutside { start, end });
                            }
                        }
                        Event::Remap { .. } | Event::Fork | Event::Unknown(_) => {
                            self.metrics.events_ignored.fetch_add(1, Ordering::Relaxed);
                            let kind = match event {
                                Event::Remap { .. } => "REMAP".to_string(),
                                Event::Fork => "FORK".to_string(),
                                other => format!("{other:?}"),
                            };
                            (self.on_error)(&FaultError::Unexpected { kind });
                        }
                    }
                }
                // Every discard of this read is in the table now.
                if let Some(journal) = &self.journal {
                    journal.end_read();
                }
            }
            let mut retry = Vec::new();
            let mut newly_held = false;
            for mut fault in pending.drain(..) {
                // A page that keeps faulting although resident has lost its data.
                if repeat.0 == fault.addr.page_down() {
                    repeat.1 += 1;
                } else {
                    repeat = (fault.addr.page_down(), 0);
                }
                // A held fault stops counting as held before it is tried again: if it is
                // served, the install wakes its thread, which must not see it held still.
                let was_held = fault.held > 0;
                if was_held {
                    self.metrics.held_now.fetch_sub(1, Ordering::Relaxed);
                    self.limit.held_changed(fault.held, 0);
                    fault.held = 0;
                }
                let result = if repeat.1 > 10_000 {
                    Err(FaultError::Lost { addr: fault.addr })
                } else {
                    self.resolve(fault.addr, fault.minor, fault.since, &mut buf)
                };
                match result {
                    Ok(Attempt::Resolved) => {
                        self.faults_in_flight.fetch_sub(1, Ordering::Relaxed);
                        if let Some(at) = fault.held_since {
                            let us = u64::try_from(at.elapsed().as_micros()).unwrap_or(u64::MAX);
                            self.metrics.held_us.fetch_add(us, Ordering::Relaxed);
                        }
                    }
                    Ok(Attempt::Retry) => {
                        self.metrics.eagain_retries.fetch_add(1, Ordering::Relaxed);
                        retry.push(fault);
                    }
                    Ok(Attempt::Held { pages }) => {
                        newly_held |= !was_held;
                        self.metrics.held_now.fetch_add(1, Ordering::Relaxed);
                        if fault.held_since.is_none() {
                            fault.held_since = Some(Instant::now());
                            self.metrics.faults_held.fetch_add(1, Ordering::Relaxed);
                        }
                        self.limit.held_changed(fault.held, pages);
                        fault.held = pages;
                        // A held fault is no repeat: the page is not resident.
                        repeat = (HostAddr(0), 0);
                        retry.push(fault);
                    }
                    Err(FaultError::Install {
                        source: UffdError::OwnerGone { .. },
                        ..
                    }) => {
                        self.owner_gone.store(true, Ordering::Relaxed);
                        return;
                    }
                    Err(e) => {
                        self.faults_in_flight.fetch_sub(1, Ordering::Relaxed);
                        let counter = if e.is_ignored() {
                            &self.metrics.events_ignored
                        } else {
                            &self.metrics.fault_errors
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                        (self.on_error)(&e);
                    }
                }
            }
            only_held = !retry.is_empty() && retry.iter().all(|f| f.held > 0);
            if only_held || retry.iter().any(|f| f.held > 0) {
                let shortfall = self.limit.shortfall(self.states.resident());
                report_due |= newly_held || shortfall != reported_shortfall;
                // No shortfall: room was made since the pass; the faults go through next time.
                if report_due && shortfall > 0 && self.limit.report(shortfall) {
                    reported_shortfall = shortfall;
                    report_due = false;
                }
            } else {
                reported_shortfall = 0;
                report_due = false;
            }
            pending = retry;
        }
    }

    /// Wakes the fault threads (they return if `stopping` is set, else retry held faults).
    fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes from a valid u64 to our own eventfd.
        unsafe {
            libc::write(
                self.signal.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    /// Wakes the fault threads if faults are held (room may have been made for them).
    pub(crate) fn wake_held(&self) {
        if self.metrics.held_now.load(Ordering::Relaxed) > 0 {
            self.signal();
        }
    }

    /// Resets the signal after a wake (another fault thread may have reset it first).
    fn drain_signal(&self) {
        let mut count: u64 = 0;
        // SAFETY: reading 8 bytes into a valid u64 from our own non-blocking eventfd; EAGAIN
        // (already drained) is fine.
        unsafe {
            libc::read(
                self.signal.as_raw_fd(),
                (&mut count as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    /// Marks pages of `[start, end)` as discarded: they read as zeros from now on, except
    /// pages the pager is dropping itself, which are stored. Only the parts inside regions
    /// count; returns false if no region was touched. Called under the write lock.
    pub(crate) fn apply_remove(&self, start: HostAddr, end: HostAddr) -> bool {
        let mut touched = false;
        for region in &self.regions {
            let Some((lo, hi)) = region.spec.range.clip(start, end) else {
                continue;
            };
            if !touched {
                touched = true;
                self.metrics.remove_events.fetch_add(1, Ordering::Relaxed);
            }
            let pages = region.first_page + lo..region.first_page + hi;
            for page in pages.clone() {
                if !self
                    .states
                    .transition(page, PageState::Dropping, PageState::Stored)
                {
                    self.states.set(page, PageState::Zero);
                }
            }
            // Released pooled blocks leave the pool at once.
            if let (Some(cold), false) = (self.cold.get(), pages.is_empty()) {
                let per_block = self.block_size.pages() as u64;
                for block in pages.start / per_block..=(pages.end - 1) / per_block {
                    let span = self.block_span(region, block * per_block);
                    if !self.states.any(span, PageState::Pooled) {
                        let _ = cold.pool.remove(block);
                    }
                }
            }
        }
        touched
    }

    /// The region holding `addr`.
    pub(crate) fn locate(&self, addr: HostAddr) -> Option<&Region> {
        let index = self
            .regions
            .partition_point(|r| r.spec.range.start() <= addr)
            .checked_sub(1)?;
        let region = &self.regions[index];
        region.spec.range.contains(addr).then_some(region)
    }

    /// The pages of the block holding `page` that lie in `region`.
    pub(crate) fn block_span(&self, region: &Region, page: u64) -> std::ops::Range<u64> {
        let per_block = self.block_size.pages() as u64;
        let block_start = page / per_block * per_block;
        let pages = region.pages();
        block_start.max(pages.start)..(block_start + per_block).min(pages.end)
    }

    /// Resolves one fault.
    /// Resolves one fault read at `since` (its latency is recorded just before the wake).
    fn resolve(
        &self,
        addr: HostAddr,
        minor: bool,
        since: Instant,
        buf: &mut [u8],
    ) -> Result<Attempt, FaultError> {
        let region = self.locate(addr).ok_or(FaultError::Outside { addr })?;
        let page = region.first_page + region.spec.range.page_index(addr).expect("located");
        let install = |source| FaultError::Install { addr, source };
        // A MINOR fault still pending when cold compression dropped its block finds the
        // block pooled: it is served from the pool like a missing page.
        if minor && self.states.get(page) != PageState::Pooled {
            return self.resolve_minor(region, page, since).map_err(install);
        }
        loop {
            let state = self.states.get(page);
            // Room under the resident limit for what this fault would install, reserved
            // until the install is done (always there without a limit).
            let room = if state.is_resident() {
                None
            } else {
                match self.admit(region, page, state) {
                    Ok(room) => Some(room),
                    Err(pages) => return Ok(Attempt::Held { pages }),
                }
            };
            let max_pages = room.as_ref().map_or(u64::MAX, Reservation::max_pages);
            match state {
                PageState::Resident | PageState::Dropping => {
                    let one = HostRange::new(region.addr_of(page), PAGE_SIZE).expect("one page");
                    self.metrics.fault_latency.record(since.elapsed());
                    self.uffd.wake(one).map_err(install)?;
                    self.metrics.eexist_races.fetch_add(1, Ordering::Relaxed);
                    return Ok(Attempt::Resolved);
                }
                PageState::Zero => {
                    let _read = self.layout.read();
                    if self.states.get(page) != state {
                        continue;
                    }
                    return self
                        .install(region, page, state, None, since, max_pages)
                        .map_err(install);
                }
                PageState::Pooled => {
                    let cold = self.cold.get().ok_or(FaultError::NoSource { addr })?;
                    let span = self.block_span(region, page);
                    let block = self.block_size.index_of(span.start * PAGE_SIZE);
                    let first = block * self.block_size.pages() as u64;
                    let len = self.block_size.bytes();
                    let kind = cold
                        .pool
                        .get(block, &mut buf[..len])
                        .map_err(|source| FaultError::Pool { addr, source })?;
                    let _read = self.layout.read();
                    if self.states.get(page) != state {
                        continue;
                    }
                    let Some(kind) = kind else {
                        // Pooled pages without a pool entry: the bytes are gone. Never zeros.
                        return Err(FaultError::Lost { addr });
                    };
                    if kind.is_compressed() {
                        self.metrics
                            .bytes_decompressed
                            .fetch_add(len as u64, Ordering::Relaxed);
                    }
                    let data =
                        (kind != compressed_backing::BlockKind::Zero).then(|| (first, &buf[..len]));
                    let attempt = self
                        .install(region, page, state, data, since, max_pages)
                        .map_err(install)?;
                    if matches!(attempt, Attempt::Resolved) && !self.states.any(span, state) {
                        let _ = cold.pool.remove(block);
                        cold.promoted(block);
                    }
                    return Ok(attempt);
                }
                PageState::Source | PageState::Stored => {
                    let span = self.block_span(region, page);
                    let block = self.block_size.index_of(span.start * PAGE_SIZE);
                    let offset = self
                        .block_size
                        .offset_of(block)
                        .expect("block of the image");
                    let len = self.block_size.len_in_image(block, self.image_size);
                    let mut decompressed = 0;
                    let content = match state {
                        PageState::Source => self
                            .restore
                            .as_ref()
                            .ok_or(FaultError::NoSource { addr })?
                            .read(offset, &mut buf[..len], &mut decompressed),
                        _ => self.store.read(offset, &mut buf[..len], &mut decompressed),
                    }
                    .map_err(|source| FaultError::Source { addr, source })?;
                    self.metrics
                        .bytes_decompressed
                        .fetch_add(decompressed, Ordering::Relaxed);
                    let _read = self.layout.read();
                    if self.states.get(page) != state {
                        // Installed by another thread or discarded meanwhile: look again.
                        continue;
                    }
                    let data = match content {
                        Content::Zero => None,
                        Content::Data => Some((offset / PAGE_SIZE, &buf[..len])),
                    };
                    // Recorded before the install wakes the faulting thread, so that an
                    // offload right after sees it.
                    self.working_set.record(block);
                    return self
                        .install(region, page, state, data, since, max_pages)
                        .map_err(install);
                }
            }
        }
    }

    /// Resolves a MINOR fault (memfd RAM: the page is in the page cache, its mapping is not).
    /// With cold compression on, the block was probed: it is marked accessed and all its
    /// resident pages are mapped at once, so a probe costs one fault per block.
    fn resolve_minor(
        &self,
        region: &Region,
        page: u64,
        since: Instant,
    ) -> Result<Attempt, UffdError> {
        let _read = self.layout.read();
        let span = self.block_span(region, page);
        let pages = match self.cold.get() {
            Some(cold) if self.states.all(span.clone(), PageState::Resident) => {
                cold.touched(self.block_size.index_of(span.start * PAGE_SIZE));
                span
            }
            _ => page..page + 1,
        };
        let range = HostRange::new(
            region.addr_of(pages.start),
            (pages.end - pages.start) * PAGE_SIZE,
        )
        .expect("pages of a region");
        match self.uffd.continue_missing(range, false) {
            Ok(_) => {}
            Err(UffdError::Retry { .. }) => return Ok(Attempt::Retry),
            Err(e) => return Err(e),
        }
        self.states.set(page, PageState::Resident);
        self.metrics.faults_minor.fetch_add(1, Ordering::Relaxed);
        self.metrics.fault_latency.record(since.elapsed());
        self.uffd.wake(range)?;
        Ok(Attempt::Resolved)
    }

    /// Reserves room under the resident limit for what a fault on `page` (in `state`, not
    /// resident) installs: its block span if all of the span is in `state`, else the page
    /// alone; if the span does not fit, the page alone. Without a limit, one relaxed load and
    /// an empty reservation. `Err(pages)`: no room for it, which would install `pages`.
    fn admit(&self, region: &Region, page: u64, state: PageState) -> Result<Reservation<'_>, u64> {
        if !self.limit.is_set() {
            return Ok(Reservation::unlimited());
        }
        let span = self.block_span(region, page);
        let wanted = if self.states.all(span.clone(), state) {
            span.end - span.start
        } else {
            1
        };
        let resident = self.states.resident();
        self.limit
            .reserve(resident, wanted)
            .or_else(|| {
                (wanted > 1)
                    .then(|| self.limit.reserve(resident, 1))
                    .flatten()
            })
            .ok_or(wanted)
    }

    /// Installs the block span of `page` if all its pages are in `state` and it has at most
    /// `max_pages` pages, else the page alone: from `data` (first image page of the buffer,
    /// bytes) or as zero pages. Marks what it installed resident. Called under the read lock.
    fn install(
        &self,
        region: &Region,
        page: u64,
        state: PageState,
        data: Option<(u64, &[u8])>,
        since: Instant,
        max_pages: u64,
    ) -> Result<Attempt, UffdError> {
        let span = self.block_span(region, page);
        let pages = if span.end - span.start <= max_pages && self.states.all(span.clone(), state) {
            span
        } else {
            page..page + 1
        };
        Ok(
            match self.install_run(region, pages, state, data, Some(since))? {
                Some(_) => Attempt::Resolved,
                None => Attempt::Retry,
            },
        )
    }

    /// Installs the pages `pages` of `region` (all in `state`, not mapped) from `data` (first
    /// image page of the buffer, bytes) or as zero pages, marks them resident and counts them
    /// (as one fault read at `fault`, if it is one), then wakes waiters. Returns the pages it
    /// filled (already-mapped ones are skipped), or `None` on EAGAIN (read events, then
    /// retry). Called under the read lock.
    pub(crate) fn install_run(
        &self,
        region: &Region,
        pages: std::ops::Range<u64>,
        state: PageState,
        data: Option<(u64, &[u8])>,
        fault: Option<Instant>,
    ) -> Result<Option<u64>, UffdError> {
        let count = pages.end - pages.start;
        let range = HostRange::new(region.addr_of(pages.start), count * PAGE_SIZE)
            .expect("pages of a region");
        // Install without waking, so that states and counters are up to date before the
        // faulting thread runs on (an offload right after must see the page resident).
        let result = match data {
            None => self.uffd.zeropage_missing(range, false),
            Some((buf_page, bytes)) => {
                let from = ((pages.start - buf_page) * PAGE_SIZE) as usize;
                let src = &bytes[from..from + (count * PAGE_SIZE) as usize];
                self.uffd.copy_missing(range.start(), src, false)
            }
        };
        let filled = match result {
            Ok(filled) => filled / PAGE_SIZE,
            Err(UffdError::Retry { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        self.states
            .transition_range(pages, state, PageState::Resident);
        let m = &self.metrics;
        let (pages_counter, faults_counter) = match data {
            None => (&m.zero_pages, &m.faults_zero),
            Some(_) => (&m.pages_copied, &m.faults_copy),
        };
        pages_counter.fetch_add(filled, Ordering::Relaxed);
        if let Some(since) = fault {
            m.fault_latency.record(since.elapsed());
            faults_counter.fetch_add(1, Ordering::Relaxed);
            if filled < count {
                m.eexist_races.fetch_add(1, Ordering::Relaxed);
            }
            if data.is_some() && count > 1 {
                m.block_copies.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.uffd.wake(range)?;
        Ok(Some(filled))
    }

    /// The region holding image page `page`, if any (the image may have gaps).
    pub(crate) fn region_of_page(&self, page: u64) -> Option<&Region> {
        self.regions.iter().find(|r| r.pages().contains(&page))
    }
}
