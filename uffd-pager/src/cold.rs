//! Live cold-RAM compression: while the VM runs, blocks it has not touched for a while are
//! compressed into the in-memory pool and dropped; a touch brings them back.
//!
//! Access tracking (memfd RAM): the compressor zaps the page-table entries of a block
//! (`MADV_DONTNEED` on a shared mapping keeps the page cache), which makes the next guest
//! access a MINOR fault; the fault thread marks the block accessed and maps the whole block
//! back with `UFFDIO_CONTINUE` (nothing is copied). A block probed for at least the cold age
//! without an access is cold: its bytes are read from the memfd (not through the mapping, which
//! would fault), compressed into the pool, and — under the write side of the pager's lock,
//! only if no access completed since the probe, so no write can be lost — its pages become
//! `Pooled` and its hole is punched. A fault on a pooled block decompresses and installs it.
//!
//! Never worse than doing nothing: a block that does not compress is left resident and backs
//! off exponentially before it is looked at again; a block that keeps coming back soon after
//! being compressed is marked hot and left alone for a long while; the pool has a cap and
//! says when it is full; the pool's memory, the tracking table and the scanner's buffers are
//! all in `stats`, and the scanner keeps within a CPU budget.

use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use compressed_backing::{Codec, CodecConfig, MemoryPool, PoolConfig, PoolStats, PutOutcome};

use crate::addr::{HostRange, PAGE_SIZE};
use crate::pagemap::WrittenPages;
use crate::pager::{RamKind, Shared};
use crate::state::PageState;

/// The policy's knobs.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ColdConfig {
    /// A block probed this long without an access is compressed.
    pub cold_age: Duration,
    /// Time between scans.
    pub scan_period: Duration,
    /// Share of one core the scanner may use while the VM runs.
    pub cpu_budget: f64,
    /// Share of one core it may use while the guest reports idle (it scans four times as
    /// often then).
    pub idle_cpu_budget: f64,
    /// Most memory the pool may hold, as a share of guest RAM.
    pub pool_cap_share: f64,
    /// A block is kept compressed only if it shrinks to at most `num/den` of its size.
    pub max_ratio: (u32, u32),
    /// The pool's codec.
    pub codec: Codec,
}

impl Default for ColdConfig {
    fn default() -> Self {
        Self {
            cold_age: Duration::from_secs(2),
            scan_period: Duration::from_millis(500),
            cpu_budget: 0.05,
            idle_cpu_budget: 0.2,
            pool_cap_share: 0.5,
            max_ratio: (7, 8),
            codec: Codec::Lz4,
        }
    }
}

/// Block flags.
const PROBING: u8 = 1;
const ACCESSED: u8 = 2;

/// Hot blocks rest this many cold ages; a block coming back within this many cold ages of
/// being compressed counts towards hot.
const HOT_REST_COLD_AGES: u32 = 60;
const THRASH_WINDOW_COLD_AGES: u32 = 5;
/// Promotions within the window that make a block hot.
const HOT_PROMOTIONS: u8 = 3;
/// The window of `promotion_rate_per_s`.
const RATE_WINDOW: Duration = Duration::from_secs(5);
/// Longest back-off of an incompressible block, in cold ages (2^6).
const MAX_BACKOFF_LEVEL: u8 = 6;

/// Tracking of one block.
#[derive(Debug, Default)]
struct BlockInfo {
    flags: AtomicU8,
    probed_at: AtomicU32,
    compressed_at: AtomicU32,
    backoff_until: AtomicU32,
    backoff_level: AtomicU8,
    promotions: AtomicU8,
}

/// What cold compression has done and costs.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ColdStats {
    /// Scans so far.
    pub scans: u64,
    /// Blocks whose entries were zapped to watch for access.
    pub blocks_probed: u64,
    /// Blocks compressed into the pool and dropped.
    pub blocks_compressed: u64,
    /// Compression attempts refused as incompressible (then backed off).
    pub incompressible: u64,
    /// Blocks that were touched after a probe (found hot by the probe).
    pub touched_after_probe: u64,
    /// Compressions abandoned because the block was touched meanwhile.
    pub raced: u64,
    /// Anon blocks the kernel would not move out (e.g. pages merged by KSM): left resident.
    pub unmovable: u64,
    /// Runs of written anon pages reported by `PAGEMAP_SCAN` (each restarts a cold age).
    pub written_runs: u64,
    /// Blocks brought back from the pool by a fault.
    pub promotions: u64,
    /// Blocks brought back soon enough after compression to count as thrashing.
    pub thrash_promotions: u64,
    /// Promotions per second over the latest window of at least 5 s.
    pub promotion_rate_per_s: f64,
    /// Blocks marked hot (left resident for a long while).
    pub hot_blocks: u64,
    /// Times the pool was at its cap and refused a block.
    pub pool_full_refusals: u64,
    /// The pool is at its cap now.
    pub pool_full: bool,
    /// Pages pooled now.
    pub pooled_pages: u64,
    /// CPU time of the scanner, seconds.
    pub scanner_cpu_seconds: f64,
    /// Bytes of the tracking table and the scanner's buffers.
    pub tracking_bytes: u64,
    /// The pool.
    pub pool: PoolStats,
    /// Memory the pool and the tracking cost, bytes (`pool.held_bytes + tracking_bytes`).
    pub overhead_bytes: u64,
    /// Memory it gave back, bytes (pooled pages) minus what it costs; negative when it costs.
    pub net_saving_bytes: i64,
}

/// Why cold compression cannot start.
#[derive(Debug, thiserror::Error)]
pub enum ColdError {
    /// A region is neither memfd RAM of this process nor anon RAM with write tracking.
    #[error(
        "cold compression needs RAM mapped in this process: memfd RAM, or anon RAM with write \
         tracking (PagerConfig::track_writes); region {range:?} is {kind:?}"
    )]
    Unsupported {
        /// The region.
        range: HostRange,
        /// Its kind.
        kind: RamKind,
    },
    /// The pool could not be created.
    #[error("cannot create the memory pool")]
    Pool(#[source] compressed_backing::PoolError),
    /// Cold compression runs already.
    #[error("cold compression runs already")]
    Running,
    /// The scratch block for anon RAM could not be mapped.
    #[error("cannot map the scratch block")]
    Scratch(#[source] std::io::Error),
    /// The scratch block could not be registered.
    #[error("cannot register the scratch block")]
    Register(#[source] crate::uffd::UffdError),
    /// `/proc/self/pagemap` could not be opened.
    #[error("cannot open /proc/self/pagemap for write tracking")]
    Pagemap(#[source] std::io::Error),
    /// The scanner thread could not start.
    #[error("cannot start the scanner thread")]
    Thread(#[source] std::io::Error),
    /// The knobs are out of range.
    #[error("invalid cold compression setting: {0}")]
    Config(String),
}

/// Cold compression's shared state: the pool, the tracking table, counters.
#[derive(Debug)]
pub(crate) struct Cold {
    pub config: ColdConfig,
    pub pool: MemoryPool,
    blocks: Box<[BlockInfo]>,
    /// Time is kept in ticks of a quarter scan period since `started` (the epoch).
    started: Instant,
    tick: Duration,
    cold_age_ticks: u32,
    pub stop: AtomicBool,
    idle: AtomicBool,
    /// Pauses (offloads in progress); scanning waits while non-zero.
    paused: AtomicU32,
    scans: AtomicU64,
    probed: AtomicU64,
    compressed: AtomicU64,
    incompressible: AtomicU64,
    touched: AtomicU64,
    raced: AtomicU64,
    unmovable: AtomicU64,
    written_runs: AtomicU64,
    /// Anon RAM: its written pages, and where its blocks are checked before they drop.
    written: parking_lot::Mutex<Option<WrittenPages>>,
    scratch: Option<Scratch>,
    /// Reads are not seen (anon RAM): a block brought back within one cold age of being
    /// compressed is taken as in use at once, else each read-hot block would thrash a few
    /// times first. (One brought back later, after an idle spell, is not.)
    blind_reads: bool,
    promotions: AtomicU64,
    /// `promotion_rate_per_s`, as f64 bits.
    promotion_rate: AtomicU64,
    thrash: AtomicU64,
    hot: AtomicU64,
    full_refusals: AtomicU64,
    full: AtomicBool,
    cpu_ns: AtomicU64,
}

impl Cold {
    pub(crate) fn new(shared: &Shared, config: ColdConfig) -> Result<Self, ColdError> {
        if !(config.cpu_budget > 0.0 && config.idle_cpu_budget > 0.0) {
            return Err(ColdError::Config("CPU budgets must be positive".into()));
        }
        if !(0.0..=1.0).contains(&config.pool_cap_share) {
            return Err(ColdError::Config(
                "the pool cap is a share of RAM, 0 to 1".into(),
            ));
        }
        if config.scan_period.is_zero() {
            return Err(ColdError::Config("the scan period must not be zero".into()));
        }
        let max_ratio = compressed_backing::MaxRatio::new(config.max_ratio.0, config.max_ratio.1)
            .ok_or_else(|| ColdError::Config("the ratio must be in (0, 1]".into()))?;
        for region in &shared.regions {
            let supported = region.spec.in_process()
                && match region.spec.kind {
                    RamKind::Memfd => region.spec.memfd.is_some(),
                    RamKind::Anon => shared.track_writes,
                    RamKind::Snapshot => false,
                };
            if !supported {
                return Err(ColdError::Unsupported {
                    range: region.spec.range,
                    kind: region.spec.kind,
                });
            }
        }
        let anon = shared.regions.iter().any(|r| r.spec.kind == RamKind::Anon);
        let (written, scratch) = if anon {
            (
                Some(WrittenPages::open().map_err(ColdError::Pagemap)?),
                Some(Scratch::new(shared)?),
            )
        } else {
            (None, None)
        };
        let blocks = shared.block_size.blocks_for(shared.image_size);
        let tick = (config.scan_period / 4).max(Duration::from_millis(1));
        let cold_age_ticks = u32::try_from(config.cold_age.as_nanos().div_ceil(tick.as_nanos()))
            .map_err(|_| ColdError::Config("the cold age is too long".into()))?
            .max(1);
        #[allow(
            clippy::cast_sign_loss,
            reason = "the share was checked to be in [0, 1]: a non-negative size"
        )]
        let cap_bytes = (shared.image_size as f64 * config.pool_cap_share) as u64;
        let pool = MemoryPool::new(PoolConfig {
            block_size: shared.block_size,
            codec: CodecConfig {
                codec: config.codec,
                max_ratio,
            },
            blocks,
            cap_bytes,
        })
        .map_err(ColdError::Pool)?;
        Ok(Self {
            config,
            pool,
            blocks: (0..blocks).map(|_| BlockInfo::default()).collect(),
            started: Instant::now(),
            tick,
            cold_age_ticks,
            stop: AtomicBool::new(false),
            idle: AtomicBool::new(false),
            paused: AtomicU32::new(0),
            scans: AtomicU64::new(0),
            probed: AtomicU64::new(0),
            compressed: AtomicU64::new(0),
            incompressible: AtomicU64::new(0),
            touched: AtomicU64::new(0),
            raced: AtomicU64::new(0),
            unmovable: AtomicU64::new(0),
            written_runs: AtomicU64::new(0),
            written: parking_lot::Mutex::new(written),
            scratch,
            blind_reads: anon,
            promotions: AtomicU64::new(0),
            promotion_rate: AtomicU64::new(0),
            thrash: AtomicU64::new(0),
            hot: AtomicU64::new(0),
            full_refusals: AtomicU64::new(0),
            full: AtomicBool::new(false),
            cpu_ns: AtomicU64::new(0),
        })
    }

    /// Ticks since the start, from 1.
    fn epoch(&self) -> u32 {
        let ticks = self.started.elapsed().as_nanos() / self.tick.as_nanos();
        u32::try_from(ticks).unwrap_or(u32::MAX - 1) + 1
    }

    /// Holds scanning still until the guard is dropped (an offload is moving RAM).
    pub(crate) fn pause(&self) -> PauseGuard<'_> {
        self.paused.fetch_add(1, Ordering::AcqRel);
        PauseGuard(self)
    }

    /// The guest reports idle (scan harder) or busy.
    pub(crate) fn set_idle(&self, idle: bool) {
        self.idle.store(idle, Ordering::Relaxed);
    }

    /// A fault thread saw an access to `block` (a MINOR fault after a probe).
    pub(crate) fn touched(&self, block: u64) {
        if let Some(info) = self.blocks.get(block as usize) {
            let before = info.flags.fetch_or(ACCESSED, Ordering::AcqRel);
            if before & PROBING != 0 && before & ACCESSED == 0 {
                self.touched.fetch_add(1, Ordering::Relaxed);
                // From now on `probed_at` is when it was touched: it is probed again one cold
                // age later, so a block in use pays one fault per cold age, not one per scan.
                info.probed_at.store(self.epoch(), Ordering::Relaxed);
            }
        }
    }

    /// A fault brought `block` back from the pool.
    pub(crate) fn promoted(&self, block: u64) {
        self.promotions.fetch_add(1, Ordering::Relaxed);
        let Some(info) = self.blocks.get(block as usize) else {
            return;
        };
        info.flags.store(0, Ordering::Release);
        let epoch = self.epoch();
        let window = self.cold_age_ticks.saturating_mul(THRASH_WINDOW_COLD_AGES);
        let since = epoch.saturating_sub(info.compressed_at.load(Ordering::Relaxed));
        if since <= window {
            self.thrash.fetch_add(1, Ordering::Relaxed);
            let promotions = info.promotions.fetch_add(1, Ordering::Relaxed) + 1;
            if promotions >= HOT_PROMOTIONS || (self.blind_reads && since <= self.cold_age_ticks) {
                info.promotions.store(0, Ordering::Relaxed);
                let rest = self.cold_age_ticks.saturating_mul(HOT_REST_COLD_AGES);
                info.backoff_until
                    .store(epoch.saturating_add(rest), Ordering::Relaxed);
                self.hot.fetch_add(1, Ordering::Relaxed);
            }
        } else {
            info.promotions.store(0, Ordering::Relaxed);
        }
    }

    /// Counters, the pool's stats and what it all costs.
    pub(crate) fn stats(&self, pooled_pages: u64) -> ColdStats {
        let pool = self.pool.stats();
        let tracking_bytes = (self.blocks.len() * std::mem::size_of::<BlockInfo>()
            + self.config_scratch_bytes()) as u64;
        let overhead = pool.held_bytes + tracking_bytes;
        ColdStats {
            scans: self.scans.load(Ordering::Relaxed),
            blocks_probed: self.probed.load(Ordering::Relaxed),
            blocks_compressed: self.compressed.load(Ordering::Relaxed),
            incompressible: self.incompressible.load(Ordering::Relaxed),
            touched_after_probe: self.touched.load(Ordering::Relaxed),
            raced: self.raced.load(Ordering::Relaxed),
            unmovable: self.unmovable.load(Ordering::Relaxed),
            written_runs: self.written_runs.load(Ordering::Relaxed),
            promotions: self.promotions.load(Ordering::Relaxed),
            thrash_promotions: self.thrash.load(Ordering::Relaxed),
            promotion_rate_per_s: f64::from_bits(self.promotion_rate.load(Ordering::Relaxed)),
            hot_blocks: self.hot.load(Ordering::Relaxed),
            pool_full_refusals: self.full_refusals.load(Ordering::Relaxed),
            pool_full: self.full.load(Ordering::Relaxed),
            pooled_pages,
            scanner_cpu_seconds: self.cpu_ns.load(Ordering::Relaxed) as f64 / 1e9,
            tracking_bytes,
            overhead_bytes: overhead,
            net_saving_bytes: i64::try_from(pooled_pages * PAGE_SIZE).unwrap_or(i64::MAX)
                - i64::try_from(overhead).unwrap_or(i64::MAX),
            pool,
        }
    }

    /// The scanner's block buffer.
    fn config_scratch_bytes(&self) -> usize {
        self.pool.config().block_size.bytes()
    }
}

/// Scanning resumes when this is dropped.
pub(crate) struct PauseGuard<'a>(&'a Cold);

impl Drop for PauseGuard<'_> {
    fn drop(&mut self) {
        self.0.paused.fetch_sub(1, Ordering::AcqRel);
    }
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

/// The scanner thread: a scan every period (a quarter of it while the guest is idle), then a
/// sleep long enough to keep its CPU time within the budget.
pub(crate) fn run(shared: &Shared, cold: &Cold) {
    let born = thread_cpu();
    let mut buf = vec![0u8; shared.block_size.bytes()];
    let mut window = (Instant::now(), 0u64);
    while !cold.stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let elapsed = started.duration_since(window.0);
        if elapsed >= RATE_WINDOW {
            let promotions = cold.promotions.load(Ordering::Relaxed);
            let rate = (promotions - window.1) as f64 / elapsed.as_secs_f64();
            cold.promotion_rate.store(rate.to_bits(), Ordering::Relaxed);
            window = (started, promotions);
        }
        let cpu = thread_cpu();
        scan(shared, cold, &mut buf);
        let used = thread_cpu().saturating_sub(cpu);
        // All of the thread's CPU time, its wake-ups between scans included.
        let total = thread_cpu().saturating_sub(born);
        cold.cpu_ns.store(
            u64::try_from(total.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        cold.scans.fetch_add(1, Ordering::Relaxed);
        let idle = cold.idle.load(Ordering::Relaxed);
        let (period, budget) = if idle {
            (cold.config.scan_period / 4, cold.config.idle_cpu_budget)
        } else {
            (cold.config.scan_period, cold.config.cpu_budget)
        };
        // Stay within the budget: the scan's CPU time over the whole cycle.
        let cycle = period.max(used.div_f64(budget));
        // Dropping the pager sets `stop` and unparks this thread.
        let wake = started + cycle;
        while !cold.stop.load(Ordering::Relaxed) {
            let left = wake.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            std::thread::park_timeout(left);
        }
    }
}

/// Anon RAM: blocks written since the last scan start their cold age again.
fn take_written(
    shared: &Shared,
    cold: &Cold,
    written: &mut WrittenPages,
    epoch: u32,
) -> std::io::Result<()> {
    let per_block = shared.block_size.pages() as u64;
    for region in shared
        .regions
        .iter()
        .filter(|r| r.spec.kind == RamKind::Anon)
    {
        written.take(&shared.uffd, region.spec.range, |run| {
            let first =
                region.first_page + region.spec.range.page_index(run.start()).expect("inside");
            let last = first + run.len() / PAGE_SIZE - 1;
            for info in &cold.blocks[(first / per_block) as usize..=(last / per_block) as usize] {
                info.flags.store(PROBING, Ordering::Release);
                info.probed_at.store(epoch, Ordering::Relaxed);
            }
            cold.written_runs.fetch_add(1, Ordering::Relaxed);
        })?;
    }
    Ok(())
}

fn scan(shared: &Shared, cold: &Cold, buf: &mut [u8]) {
    let per_block = shared.block_size.pages() as u64;
    let epoch = cold.epoch();
    let block_len = shared.block_size.bytes();
    let tracking_anon = {
        let mut guard = cold.written.lock();
        if let Some(written) = guard.as_mut() {
            if let Err(e) = take_written(shared, cold, written, epoch) {
                tracing::warn!(
                    "cold compression: write tracking failed, anon RAM is left alone: {e}"
                );
                *guard = None;
            }
        }
        guard.is_some()
    };
    for (block, info) in cold.blocks.iter().enumerate() {
        if cold.stop.load(Ordering::Relaxed) || cold.paused.load(Ordering::Acquire) > 0 {
            return;
        }
        let first = block as u64 * per_block;
        let pages = first..(first + per_block).min(shared.states.len());
        // Whole blocks of one region only (the pool keeps whole blocks).
        let Some(region) = shared.region_of_page(first) else {
            continue;
        };
        if pages.end - pages.start != per_block
            || !region.pages().contains(&(pages.end - 1))
            || info.backoff_until.load(Ordering::Relaxed) > epoch
            || !shared.states.all(pages.clone(), PageState::Resident)
        {
            continue;
        }
        if region.spec.kind == RamKind::Anon && !tracking_anon {
            continue;
        }
        let flags = info.flags.load(Ordering::Acquire);
        let since = epoch.saturating_sub(info.probed_at.load(Ordering::Relaxed));
        if flags & ACCESSED != 0 && since < cold.cold_age_ticks {
            // Touched lately: in use; look again later.
            continue;
        }
        if flags & PROBING == 0 || flags & ACCESSED != 0 {
            // Watch it (again). Anon RAM: its writes show in the next scans.
            info.flags.store(PROBING, Ordering::Release);
            info.probed_at.store(epoch, Ordering::Relaxed);
            if region.spec.kind == RamKind::Memfd {
                let range = HostRange::new(region.addr_of(first), per_block * PAGE_SIZE)
                    .expect("pages of a region");
                // SAFETY: our own shared memfd mapping: the page cache keeps every byte; only
                // the page-table entries go, and the next access is a MINOR fault to the pager.
                unsafe {
                    libc::madvise(
                        range.start().as_ptr(),
                        range.len() as usize,
                        libc::MADV_DONTNEED,
                    )
                };
            }
            cold.probed.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        if since < cold.cold_age_ticks {
            continue;
        }
        compress(
            shared,
            cold,
            region,
            block as u64,
            pages,
            &mut buf[..block_len],
        );
    }
}

fn compress(
    shared: &Shared,
    cold: &Cold,
    region: &crate::pager::Region,
    block: u64,
    pages: std::ops::Range<u64>,
    buf: &mut [u8],
) {
    let info = &cold.blocks[block as usize];
    let at = region.addr_of(pages.start);
    match &region.spec.memfd {
        Some(memfd) => {
            let offset = region.spec.memfd_offset + (pages.start - region.first_page) * PAGE_SIZE;
            // Through the file, not the mapping: reading the mapping would fault to ourselves.
            if memfd.read_exact_at(buf, offset).is_err() {
                return;
            }
        }
        // SAFETY: the block's pages are resident (checked by the caller; only the pager drops
        // them), so reading them faults nowhere. The vCPU may write meanwhile: the copy may be
        // torn, which `drop_anon` detects by comparing it with the bytes it moved out.
        None => unsafe {
            std::ptr::copy_nonoverlapping(at.as_ptr().cast::<u8>(), buf.as_mut_ptr(), buf.len());
        },
    }
    match cold.pool.put(block, buf) {
        Ok(PutOutcome::Stored { .. } | PutOutcome::Zero | PutOutcome::Fill) => {}
        Ok(PutOutcome::Incompressible) => {
            cold.incompressible.fetch_add(1, Ordering::Relaxed);
            back_off(cold, info);
            return;
        }
        Ok(PutOutcome::Full) => {
            cold.full_refusals.fetch_add(1, Ordering::Relaxed);
            cold.full.store(true, Ordering::Relaxed);
            return;
        }
        Err(_) => return,
    }
    cold.full.store(false, Ordering::Relaxed);
    let _write = shared.layout.write();
    if cold.paused.load(Ordering::Acquire) > 0 {
        let _ = cold.pool.remove(block);
        return;
    }
    // No access may have completed since the probe (each one faults and marks the block
    // first), and every page must still be resident: otherwise the pool holds stale bytes.
    if info.flags.load(Ordering::Acquire) != PROBING
        || !shared.states.all(pages.clone(), PageState::Resident)
    {
        let _ = cold.pool.remove(block);
        cold.raced.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let dropped = match &region.spec.memfd {
        Some(memfd) => {
            let offset = region.spec.memfd_offset + (pages.start - region.first_page) * PAGE_SIZE;
            shared.states.set_range(pages.clone(), PageState::Pooled);
            // On failure the block is still in the page cache: it stays resident.
            let punched = crate::offload::punch_hole(memfd, offset, buf.len() as u64).is_ok();
            if !punched {
                shared.states.set_range(pages, PageState::Resident);
            }
            punched
        }
        None => drop_anon(shared, cold, info, at, pages, buf),
    };
    if !dropped {
        let _ = cold.pool.remove(block);
        return;
    }
    info.flags.store(0, Ordering::Release);
    info.backoff_level.store(0, Ordering::Relaxed);
    info.compressed_at.store(cold.epoch(), Ordering::Relaxed);
    cold.compressed.fetch_add(1, Ordering::Relaxed);
}

/// Leaves `info`'s block alone for a cold age, twice as long each time in a row (up to
/// 2^MAX_BACKOFF_LEVEL cold ages).
fn back_off(cold: &Cold, info: &BlockInfo) {
    let level = info
        .backoff_level
        .load(Ordering::Relaxed)
        .min(MAX_BACKOFF_LEVEL);
    info.backoff_level.store(level + 1, Ordering::Relaxed);
    let wait = cold.cold_age_ticks.saturating_mul(1 << level);
    info.backoff_until
        .store(cold.epoch().saturating_add(wait), Ordering::Relaxed);
}

/// Drops a block of anon RAM whose bytes the pool holds as `copy` (read while the guest ran),
/// under the write side of the layout lock. The block's pages are moved out of guest RAM
/// (`UFFDIO_MOVE`: from here on a guest access faults, and the fault waits for the lock), then
/// compared with `copy`: equal means no write slipped in, so the pages become `Pooled` and
/// the moved-out ones are freed; different means the guest wrote meanwhile, and the pages go
/// back where they were, untouched. Returns whether the block was dropped.
fn drop_anon(
    shared: &Shared,
    cold: &Cold,
    info: &BlockInfo,
    at: crate::addr::HostAddr,
    pages: std::ops::Range<u64>,
    copy: &[u8],
) -> bool {
    let scratch = cold
        .scratch
        .as_ref()
        .expect("anon cold compression has its scratch");
    let len = copy.len() as u64;
    // SAFETY: both ranges are private anon mappings registered on the pager's userfaultfd
    // (guest RAM and our scratch, which is empty); nothing holds a reference into either: the
    // guest reaches its RAM only through KVM and the pager, and the scratch is ours alone.
    if let Err(e) = unsafe { shared.uffd.move_pages(scratch.start(), at, len, false) } {
        // E.g. pages shared with another process or merged by KSM: leave the block alone.
        cold.unmovable.fetch_add(1, Ordering::Relaxed);
        let done = match &e {
            crate::uffd::UffdError::MovePartial { done, .. } => *done,
            _ => 0,
        };
        if done > 0 {
            scratch.put_back(shared, at, done);
        }
        back_off(cold, info);
        return false;
    }
    if scratch.bytes() == copy {
        shared.states.set_range(pages, PageState::Pooled);
        scratch.clear();
        true
    } else {
        scratch.put_back(shared, at, len);
        cold.raced.fetch_add(1, Ordering::Relaxed);
        false
    }
}

/// One block of private anon memory registered on the pager's userfaultfd, where blocks of
/// anon guest RAM are moved to be checked before they are dropped. Empty between uses.
#[derive(Debug)]
pub(crate) struct Scratch {
    map: memmap2::MmapMut,
}

impl Scratch {
    fn new(shared: &Shared) -> Result<Self, ColdError> {
        let len = shared.block_size.bytes();
        let map = memmap2::MmapMut::map_anon(len).map_err(ColdError::Scratch)?;
        let range = HostRange::new(crate::addr::HostAddr(map.as_ptr() as u64), len as u64)
            .expect("an anon mapping is page-aligned");
        // SAFETY: the mapping lives as long as `Cold`, which the pager drops before its
        // userfaultfd; only `drop_anon` fills it (with moved pages) and it empties it again.
        // MISSING and WP like guest RAM, so that both have the same page protection, which
        // UFFDIO_MOVE requires.
        unsafe { shared.uffd.register(range, crate::uffd::Mode::MISSING_WP) }
            .map_err(ColdError::Register)?;
        Ok(Self { map })
    }

    fn start(&self) -> crate::addr::HostAddr {
        crate::addr::HostAddr(self.map.as_ptr() as u64)
    }

    /// The moved-in bytes (every page is present after a full move).
    fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Frees the moved-in pages.
    fn clear(&self) {
        // SAFETY: our own scratch mapping; nothing refers to its contents.
        unsafe {
            libc::madvise(
                self.map.as_ptr() as *mut libc::c_void,
                self.map.len(),
                libc::MADV_DONTNEED,
            )
        };
    }

    /// Moves the first `len` bytes (all present here) back to `at` in guest RAM, where they
    /// are missing, and wakes whoever faulted there; what the kernel will not move is copied
    /// instead. Either way the guest's bytes are where they were.
    fn put_back(&self, shared: &Shared, at: crate::addr::HostAddr, len: u64) {
        // SAFETY: as in `drop_anon`; the guest range is empty (moved out under the lock).
        let moved = match unsafe { shared.uffd.move_pages(at, self.start(), len, true) } {
            Ok(_) => len,
            Err(crate::uffd::UffdError::MovePartial { done, .. }) => done,
            Err(_) => 0,
        };
        if moved < len {
            // Only the pages that did not move are still here to read.
            let rest = crate::addr::HostAddr(at.0 + moved);
            let bytes = &self.bytes()[moved as usize..len as usize];
            if let Err(e) = shared.uffd.copy_missing(rest, bytes, true) {
                tracing::error!("cold compression: cannot put a block back at {rest}: {e}");
            }
        }
        self.clear();
    }
}
