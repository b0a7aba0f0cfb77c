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

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use basics::PageSize;
use compressed_backing::BlockSize;
use parking_lot::Mutex;

use crate::addr::{HostAddr, HostRange, PAGE_SIZE};
use crate::journal::Journal;
use crate::limit::{HeldHandler, ResidentLimit};
use crate::metrics::Metrics;
use crate::source::{PageSource, SourceError, StoreSource};
use crate::state::{PageState, PageStates, StateCounts};
use crate::uffd::{feature, Mode, UffdError, Userfaultfd};

mod ahead;
mod fault;
mod fetch;
mod region;
mod stride;
pub(crate) mod table;

use table::PageTable;

use region::check_regions;
pub(crate) use region::Region;
pub use region::RegionSpec;

/// How guest RAM is mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
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
    /// Private anonymous memory of 2 MiB huge pages (`MAP_HUGETLB`): every install, drop and
    /// discard covers whole huge pages; dropped with `MADV_DONTNEED`; there is no zero page
    /// to map, so zeros are copied.
    Hugetlb,
    /// A shared memfd of 2 MiB huge pages (`MFD_HUGETLB`): as `Memfd`, in whole huge pages.
    HugetlbMemfd,
}

impl RamKind {
    /// The page size of its mapping: the unit every install, drop and discard covers.
    pub fn page_size(self) -> PageSize {
        match self {
            Self::Anon | Self::Memfd | Self::Snapshot => PageSize::BASE,
            Self::Hugetlb | Self::HugetlbMemfd => PageSize::HUGE,
        }
    }

    /// True for shared memfd RAM (its pages live in the file; dropped by punching holes).
    pub fn is_memfd(self) -> bool {
        matches!(self, Self::Memfd | Self::HugetlbMemfd)
    }

    /// True for RAM of huge pages.
    pub fn is_hugetlb(self) -> bool {
        self.page_size() != PageSize::BASE
    }

    /// Its name on command lines and in JSON (`anon`, `memfd`, `snapshot`, `hugetlb`,
    /// `hugetlb-memfd`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Anon => "anon",
            Self::Memfd => "memfd",
            Self::Snapshot => "snapshot",
            Self::Hugetlb => "hugetlb",
            Self::HugetlbMemfd => "hugetlb-memfd",
        }
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
    /// A page is in a state whose tier the pager does not have (restore-source pages without
    /// a restore source, pooled pages without a pool).
    #[error("fault at {addr}: no source for its state")]
    NoSource {
        /// The address.
        addr: HostAddr,
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
    /// The huge page holding the address has pages in different states that are not
    /// resident: installing it whole could overwrite bytes of one with another's.
    #[error("fault at {addr}: its huge page is torn between page states")]
    Torn {
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
    /// The page states and the layout lock (write side: reading events and applying
    /// discards; read side: resolving faults): the only writer of a page's state.
    pub(crate) table: PageTable,
    pub block_size: BlockSize,
    pub image_size: u64,
    pub restore: Option<Arc<dyn PageSource>>,
    pub store: StoreSource,
    pub metrics: Metrics,
    /// Faults read and not yet resolved (the prefetcher gives way while this is non-zero).
    pub faults_in_flight: AtomicU64,
    /// Signalled when `faults_in_flight` falls to zero (a prefetch thread waits on it;
    /// `no_faults_lock` orders the two).
    pub(crate) no_faults: parking_lot::Condvar,
    pub(crate) no_faults_lock: Mutex<()>,
    /// The blocks being read from a source now, one reader each.
    pub(crate) fetches: fetch::Fetches,
    /// Ranges marked to come back together (see [`ahead`]).
    pub(crate) together: ahead::Together,
    /// The stride of the faults, and the read-ahead thread's work (see [`stride`]).
    pub(crate) stride: stride::Stride,
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
    /// The memory pool, the tier of `Pooled` pages, once cold compression runs above the
    /// pager (`attach_pool`).
    pub(crate) pool: OnceLock<Arc<compressed_backing::MemoryPool>>,
    /// What is told of the guest's accesses that the pager sees (cold compression).
    pub(crate) observer: OnceLock<Arc<dyn AccessObserver>>,
    /// Holds on eviction into the pool (an offload moving RAM): while non-zero, nothing may
    /// make pages `Pooled`.
    evictions_held: std::sync::atomic::AtomicU32,
    /// Signalled when `REMOVE` events have turned `Dropping` pages into `Stored` (an offload
    /// waits on it for the events of its own discards; `dropped_lock` orders the two).
    pub(crate) dropped: parking_lot::Condvar,
    pub(crate) dropped_lock: Mutex<()>,
    pub on_error: ErrorHandler,
    /// Where `states` lives when it must outlive the process; its read marker brackets every
    /// read of events until the read's discards are in the table.
    pub journal: Option<Arc<Journal>>,
    /// What the offload store holds already, block by block (see `offload::clean`).
    pub(crate) stored_hashes: crate::offload::StoredHashes,
}

/// What the pager tells a layer above it (cold compression) of the guest's accesses it sees.
/// Called on fault threads: it must return quickly.
pub(crate) trait AccessObserver: Send + Sync + std::fmt::Debug {
    /// Pages of `block` are about to be mapped (a MINOR fault maps the page cache, a fault or
    /// a load installs pages): from then on they are reached without a fault, so the block is
    /// in use whatever its probe said. Called under the read side of the layout lock.
    fn touched(&self, block: u64);
    /// A fault brought `block` back from the memory pool.
    fn promoted(&self, block: u64);
}

/// An offload's hold on eviction into the pool, given back on drop.
pub(crate) struct EvictionHold<'a>(&'a Shared);

impl Drop for EvictionHold<'_> {
    fn drop(&mut self) {
        self.0.evictions_held.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Shared {
    /// A fault read is resolved (or failed): one fewer in flight, and the prefetch threads
    /// waiting for none are woken when that was the last.
    pub(crate) fn fault_done(&self) {
        if self.faults_in_flight.fetch_sub(1, Ordering::Relaxed) == 1 {
            let _ordered = self.no_faults_lock.lock();
            self.no_faults.notify_all();
        }
    }

    /// Waits until no fault is in flight, or `at_most` passed; false if none was.
    pub(crate) fn wait_for_no_faults(&self, at_most: Duration) -> bool {
        if self.faults_in_flight.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let deadline = Instant::now() + at_most;
        let mut ordered = self.no_faults_lock.lock();
        while self.faults_in_flight.load(Ordering::Relaxed) > 0 {
            if self
                .no_faults
                .wait_until(&mut ordered, deadline)
                .timed_out()
            {
                break;
            }
        }
        true
    }

    /// Attaches the memory pool as the tier of `Pooled` pages and `observer` to the accesses
    /// the fault threads see; false if one is attached already.
    pub(crate) fn attach_pool(
        &self,
        pool: Arc<compressed_backing::MemoryPool>,
        observer: Arc<dyn AccessObserver>,
    ) -> bool {
        self.pool.set(pool).is_ok() && self.observer.set(observer).is_ok()
    }

    /// Holds eviction into the pool until the guard is dropped (an offload moves RAM).
    pub(crate) fn hold_evictions(&self) -> EvictionHold<'_> {
        self.evictions_held.fetch_add(1, Ordering::AcqRel);
        EvictionHold(self)
    }

    /// Whether eviction into the pool is held now.
    pub(crate) fn evictions_held(&self) -> bool {
        self.evictions_held.load(Ordering::Acquire) > 0
    }

    /// The region `range` starts in and the blocks that lie wholly inside both (`None`: the
    /// range starts in no region).
    pub(crate) fn whole_blocks(&self, range: HostRange) -> Option<(&Region, std::ops::Range<u64>)> {
        let (region, index) = self
            .regions
            .iter()
            .find_map(|r| Some((r, r.spec.range.page_index(range.start())?)))?;
        let per_block = self.block_size.pages() as u64;
        let first = region.first_page + index;
        let end = (first + range.len() / PAGE_SIZE).min(region.pages().end);
        let blocks = first.div_ceil(per_block)..end / per_block;
        Some((region, blocks.start..blocks.end.max(blocks.start)))
    }
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
        if regions.iter().any(|r| r.kind.is_hugetlb()) {
            features |= feature::MISSING_HUGETLBFS | feature::MINOR_HUGETLBFS;
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
        let image_size = check_regions(&regions, restore.as_deref(), config.block_size)?;
        if config.track_writes && regions.iter().any(|r| r.kind.is_hugetlb()) {
            return Err(PagerError::Regions(
                "write tracking (cold compression of anon RAM) does not cover huge pages".into(),
            ));
        }
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
                    RamKind::Anon | RamKind::Hugetlb => Mode::MISSING,
                    RamKind::Memfd | RamKind::HugetlbMemfd => Mode::MISSING_MINOR,
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
        let huge = regions.iter().any(|r| r.kind.page_size() != PageSize::BASE);
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
            table: PageTable::new(match &journal {
                Some(journal) => PageStates::journaled(Arc::clone(journal)),
                None => PageStates::new(pages, config.initial),
            }),
            block_size: config.block_size,
            image_size,
            restore,
            store: StoreSource::empty(),
            metrics: Metrics::default(),
            faults_in_flight: AtomicU64::new(0),
            no_faults: parking_lot::Condvar::new(),
            no_faults_lock: Mutex::new(()),
            fetches: fetch::Fetches::new(blocks),
            together: ahead::Together::default(),
            stride: stride::Stride::new(huge),
            faults_seen: AtomicU64::new(0),
            latest_fault_block: AtomicU64::new(u64::MAX),
            working_set: WorkingSet::new(blocks),
            owner_gone: AtomicBool::new(false),
            prefetch_stop: AtomicBool::new(false),
            limit: ResidentLimit::new(),
            signal,
            stopping: AtomicBool::new(false),
            pool: OnceLock::new(),
            observer: OnceLock::new(),
            evictions_held: std::sync::atomic::AtomicU32::new(0),
            dropped: parking_lot::Condvar::new(),
            dropped_lock: Mutex::new(()),
            on_error,
            journal,
            stored_hashes: crate::offload::StoredHashes::new(),
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
        if shared.wants_stride() {
            let shared = Arc::clone(&shared);
            let thread = std::thread::Builder::new()
                .name("uffd-ahead".into())
                .spawn(move || shared.read_ahead())
                .map_err(PagerError::Thread)?;
            threads.push(thread);
        }
        Ok(Self {
            shared,
            threads,
            prefetcher: Mutex::new(None),
        })
    }

    /// Counters.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// Pages per state, with every event read so far applied.
    pub fn state_counts(&self) -> StateCounts {
        let _read = self.shared.table.read();
        self.shared.table.counts()
    }

    /// The state of the page at image offset `offset`, with every event read so far applied
    /// (a discard that has returned to its caller is visible here).
    pub fn page_state(&self, offset: u64) -> PageState {
        let _read = self.shared.table.read();
        self.shared.table.get(offset / PAGE_SIZE)
    }

    /// Pages per state in the `len` bytes at image offset `offset` (clipped to the image),
    /// with every event read so far applied. O(pages).
    pub fn counts_in(&self, offset: u64, len: u64) -> StateCounts {
        let _read = self.shared.table.read();
        let end = offset.saturating_add(len).min(self.shared.image_size) / PAGE_SIZE;
        let mut counts = StateCounts::default();
        for page in offset / PAGE_SIZE..end {
            let count = match self.shared.table.get(page) {
                PageState::Zero => &mut counts.zero,
                PageState::Source => &mut counts.source,
                PageState::Stored => &mut counts.stored,
                PageState::Resident => &mut counts.resident,
                PageState::Dropping => &mut counts.dropping,
                PageState::Pooled => &mut counts.pooled,
            };
            *count += 1;
        }
        counts
    }

    /// Bytes in the RAM image (all regions).
    pub fn image_size(&self) -> u64 {
        self.shared.image_size
    }

    /// The unit of fetch and prefetch.
    pub fn block_size(&self) -> BlockSize {
        self.shared.block_size
    }

    /// The blocks (of [`block_size`](Self::block_size)) faulted in from a source since the
    /// last resume, in the order they first faulted: the working set a snapshot carries so
    /// that its next restore can fetch it ahead. Recording goes on.
    pub fn working_set(&self) -> Vec<u64> {
        self.shared.working_set.order.lock().clone()
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

    /// Tells the pager that the VMM discarded `range` itself without a `REMOVE` event (for
    /// userfaultfds without that feature): its pages read as zeros from now on.
    pub fn discarded(&self, range: HostRange) {
        {
            let write = self.shared.table.write();
            self.shared.apply_remove(&write, range.start(), range.end());
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
        self.0.table.resident() * PAGE_SIZE
    }

    /// As [`Pager::held_bytes`].
    pub fn held_bytes(&self) -> u64 {
        self.0.limit.held_pages() * PAGE_SIZE
    }

    /// Bytes by which the limit, as it is now, falls short of serving every held fault (0:
    /// no fault is held, there is no limit, or the last raise covers them and the faults go
    /// through on their next try).
    pub fn shortfall_bytes(&self) -> u64 {
        self.0.limit.shortfall(self.0.table.resident())
    }
}

impl Drop for Pager {
    fn drop(&mut self) {
        self.stop_prefetch();
        self.shared.stopping.store(true, Ordering::Relaxed);
        self.shared.signal();
        self.shared.stop_stride();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}
