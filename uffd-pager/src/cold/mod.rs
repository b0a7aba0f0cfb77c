//! Live cold-RAM compression: while the VM runs, blocks it has not touched for a while are
//! compressed into the in-memory pool and dropped; a touch brings them back.
//!
//! Access tracking (memfd RAM): the compressor zaps the page-table entries of a block
//! (`MADV_DONTNEED` on a shared mapping keeps the page cache), which makes the next guest
//! access a MINOR fault; the fault thread marks the block accessed and maps the whole block
//! back with `UFFDIO_CONTINUE` (nothing is copied); any other install of its pages (a fault
//! after the guest freed them, a load) marks it accessed too. A block probed for at least the
//! cold age without an access is cold: its bytes are read from the memfd (not through the
//! mapping, which would fault), compressed into the pool, and — under the write side of the
//! pager's lock, only if no access completed since the probe, so no write can be lost — its
//! pages become `Pooled` and its hole is punched. A fault on a pooled block decompresses and installs it.
//!
//! Never worse than doing nothing: a block that does not compress is left resident and backs
//! off exponentially before it is looked at again; a block that keeps coming back soon after
//! being compressed is marked hot and left alone for a long while; the pool has a cap and
//! says when it is full; the pool's memory, the tracking table and the scanner's buffers are
//! all in `stats`, and the scanner keeps within a CPU budget.
//!
//! It is a layer above the pager ([`Cold::start`]): the pager keeps the pool as the tier of
//! `Pooled` pages (a fault reads it like any page source) and tells this layer of the accesses
//! it sees (`AccessObserver`: a probed block touched, a block brought back); this layer
//! evicts through the page table's transitions, and stops evicting while an offload holds
//! evictions.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use compressed_backing::{Codec, CodecConfig, MemoryPool, PoolConfig, PoolStats};

use crate::addr::{HostRange, PAGE_SIZE};
use crate::pagemap::WrittenPages;
use crate::pager::{AccessObserver, Pager, RamKind, Shared};

mod scan;

use scan::{run, Scratch};

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
    /// Whether the scanner looks for cold blocks (true). Without it the pool holds only
    /// what is sent to it ([`Cold::compress_now`]: survive arenas at their close) and what a
    /// governor's order takes, and nothing is probed, so no access pays a fault for it.
    #[serde(default = "scans")]
    pub scan: bool,
}

fn scans() -> bool {
    true
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
            scan: true,
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

/// A memory governor's order: compress what has been cold for `age_ticks`, until a scan that
/// began that long after the first scan of the order (which probed the blocks) has ended, or
/// at the latest until the epoch `until`.
#[derive(Debug, Clone, Copy)]
struct Ordered {
    age_ticks: u32,
    until: u32,
    first_scan: Option<u32>,
}

/// Longest a governor's order keeps its shorter cold age, whatever the scans do.
const ORDER_LASTS_AT_MOST: Duration = Duration::from_secs(10);

/// Cold compression's shared state: the pool, the tracking table, counters.
#[derive(Debug)]
pub(crate) struct State {
    pub config: ColdConfig,
    /// The pool: the pager's tier of `Pooled` pages, which this layer fills.
    pub pool: Arc<MemoryPool>,
    blocks: Box<[BlockInfo]>,
    /// Time is kept in ticks of a quarter scan period since `started` (the epoch).
    started: Instant,
    tick: Duration,
    cold_age_ticks: u32,
    /// A memory governor's order in force.
    ordered: parking_lot::Mutex<Option<Ordered>>,
    pub stop: AtomicBool,
    idle: AtomicBool,
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
    /// Held while a block is compressed: the scanner and [`Cold::compress_now`] never work on
    /// one block at once.
    compressing: parking_lot::Mutex<()>,
}

impl State {
    fn new(shared: &Shared, config: ColdConfig) -> Result<Self, ColdError> {
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
                    // A huge page of memfd RAM is probed, pooled and dropped whole: the
                    // pager's blocks hold whole huge pages.
                    RamKind::Memfd | RamKind::HugetlbMemfd => region.spec.memfd.is_some(),
                    RamKind::Anon => shared.track_writes,
                    // Private huge pages cannot be moved out (`UFFDIO_MOVE` moves base pages
                    // of anon memory only) to check them before they are dropped.
                    RamKind::Snapshot | RamKind::Hugetlb => false,
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
            pool: Arc::new(pool),
            blocks: (0..blocks).map(|_| BlockInfo::default()).collect(),
            started: Instant::now(),
            tick,
            cold_age_ticks,
            ordered: parking_lot::Mutex::new(None),
            stop: AtomicBool::new(false),
            idle: AtomicBool::new(false),
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
            compressing: parking_lot::Mutex::new(()),
        })
    }

    /// Ticks since the start, from 1.
    fn epoch(&self) -> u32 {
        let ticks = self.started.elapsed().as_nanos() / self.tick.as_nanos();
        u32::try_from(ticks).unwrap_or(u32::MAX - 1) + 1
    }

    /// The cold age in force at `epoch`, in ticks: the configured one, or a governor's shorter
    /// one while its order lasts.
    fn age_ticks(&self, epoch: u32) -> u32 {
        self.in_force(epoch).map_or(self.cold_age_ticks, |o| {
            o.age_ticks.min(self.cold_age_ticks)
        })
    }

    /// The order still being carried out at `epoch`, if any.
    fn in_force(&self, epoch: u32) -> Option<Ordered> {
        let mut ordered = self.ordered.lock();
        if ordered.is_some_and(|o| epoch >= o.until) {
            *ordered = None;
        }
        *ordered
    }

    /// A scan begins at `epoch`: the first of an order's marks its start.
    fn scan_begins(&self, epoch: u32) {
        if let Some(o) = self.ordered.lock().as_mut() {
            o.first_scan.get_or_insert(epoch);
        }
    }

    /// The scan that began at `epoch` has ended: the order is over if the scan began a cold
    /// age (the order's) after the order's first scan, which probed what it then compressed.
    fn scan_ended(&self, began: u32) {
        let mut ordered = self.ordered.lock();
        if ordered.is_some_and(|o| {
            o.first_scan
                .is_some_and(|first| began >= first.saturating_add(o.age_ticks))
        }) {
            *ordered = None;
        }
    }

    /// Whether a memory governor's order is still being carried out.
    pub(crate) fn order_pending(&self) -> bool {
        self.in_force(self.epoch()).is_some()
    }

    /// A memory governor's order under pressure: compress what has been cold for `age` (when
    /// that is shorter than the cold age) for as long as a block takes to be probed by one scan
    /// and found cold still by a later one, after which the configured age is back
    /// ([`State::order_pending`] says when). What stays resident then answers the order.
    pub(crate) fn order(&self, age: Duration) {
        let ticks = |d: Duration| {
            u32::try_from(d.as_nanos().div_ceil(self.tick.as_nanos()))
                .unwrap_or(u32::MAX)
                .max(1)
        };
        *self.ordered.lock() = Some(Ordered {
            age_ticks: ticks(age),
            until: self
                .epoch()
                .saturating_add(ticks(ORDER_LASTS_AT_MOST.max(age * 2))),
            first_scan: None,
        });
    }

    /// The guest reports idle (scan harder) or busy.
    pub(crate) fn set_idle(&self, idle: bool) {
        self.idle.store(idle, Ordering::Relaxed);
    }

    /// Pages of `block` are being mapped (a MINOR fault after a probe, or an install): an
    /// access.
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

impl AccessObserver for State {
    fn touched(&self, block: u64) {
        State::touched(self, block);
    }

    fn promoted(&self, block: u64) {
        State::promoted(self, block);
    }
}

/// Live cold-RAM compression of a pager's RAM: the scanner's thread and what it shares with
/// the pager. Dropping it stops the scanner; drop it before the RAM is unmapped.
pub struct Cold {
    shared: Arc<Shared>,
    state: Arc<State>,
    scanner: Option<JoinHandle<()>>,
}

impl Cold {
    /// Starts cold compression of `pager`'s RAM: needs RAM mapped in this process (memfd,
    /// or anon with `track_writes`) and a pager without `REMOVE` events.
    pub fn start(pager: &Pager, config: ColdConfig) -> Result<Self, ColdError> {
        let shared = Arc::clone(pager.shared());
        if shared.remove_events {
            return Err(ColdError::Config(
                "the pager must be created with remove_events off (the VMM reports discards)"
                    .into(),
            ));
        }
        let state = Arc::new(State::new(&shared, config)?);
        let observer: Arc<dyn AccessObserver> = Arc::clone(&state) as Arc<dyn AccessObserver>;
        if !shared.attach_pool(Arc::clone(&state.pool), observer) {
            return Err(ColdError::Running);
        }
        let scanner = {
            let (shared, state) = (Arc::clone(&shared), Arc::clone(&state));
            std::thread::Builder::new()
                .name("uffd-cold".into())
                .spawn(move || run(&shared, &state))
                .map_err(ColdError::Thread)?
        };
        Ok(Self {
            shared,
            state,
            scanner: Some(scanner),
        })
    }

    /// What it has done and costs.
    pub fn stats(&self) -> ColdStats {
        self.state.stats(self.shared.table.counts().pooled)
    }

    /// Compresses the whole blocks of `range` (guest RAM of this pager) into the pool now,
    /// whatever their age: memory whose owner declared it unused for a while (a closed
    /// arena whose contents must survive). Blocks not wholly resident, incompressible, or
    /// written meanwhile stay as they are. Returns the bytes of `range` now in the pool.
    pub fn compress_now(&self, range: crate::addr::HostRange) -> u64 {
        scan::compress_now(&self.shared, &self.state, range)
    }

    /// Waits for a block being compressed, and keeps any other from starting until the guard
    /// goes: for an offload, which moves pages the scanner would otherwise move under it.
    pub fn hold_compression(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.state.compressing.lock()
    }

    /// The guest reports idle (`true`: scan harder) or busy.
    pub fn set_idle(&self, idle: bool) {
        self.state.set_idle(idle);
    }

    /// A handle on its governor's orders, for another thread.
    pub fn orders(&self) -> ColdOrders {
        ColdOrders(Arc::clone(&self.state))
    }
}

impl std::fmt::Debug for Cold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cold")
            .field("config", &self.state.config)
            .finish_non_exhaustive()
    }
}

impl Drop for Cold {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
        if let Some(scanner) = self.scanner.take() {
            scanner.thread().unpark();
            let _ = scanner.join();
        }
    }
}

/// A memory governor's orders to cold compression (see [`Cold::orders`]).
#[derive(Debug, Clone)]
pub struct ColdOrders(Arc<State>);

impl ColdOrders {
    /// Compress what has been cold for `age` (when that is shorter than its own cold age) for
    /// a while; [`ColdOrders::pending`] says when that is over (what stays resident then
    /// answers the order).
    pub fn compress(&self, age: Duration) {
        self.0.order(age);
    }

    /// Whether an order is still being carried out.
    pub fn pending(&self) -> bool {
        self.0.order_pending()
    }
}
