//! Offload of a paused VM's RAM, in batches that free memory as they go, so that an offload
//! under a binding memory budget never needs memory to free memory.
//!
//! The blocks holding a resident or pooled page are cut, in block order, into batches of
//! [`Batching::bytes`] of image (8 MiB by default). For each batch: its blocks are composed
//! and encoded by the bulk writer's threads (zero pages elided, incompressible blocks raw;
//! each thread's buffers allocated once, before the first write) and appended to the
//! store's segment; the appended range is written back and waited for
//! (`sync_file_range`), dropped from the page cache (`POSIX_FADV_DONTNEED`) and committed
//! (the index rewritten to a temporary file and renamed into place; with
//! [`Durability::Host`], the segment, the index and the directory synced too: a VM's own
//! offload store is read again only while its host runs, and does without the syncs, which
//! were 111 of the 198 ms of a 64 MiB offload); only then are the batch's resident pages
//! dropped (`MADV_DONTNEED` for anon RAM, a punched hole for memfd RAM; `Dropping` until they
//! are `Stored`: set here once dropped, or by the kernel's `REMOVE` event where the uffd has
//! them) and its pooled pages retired from the pool.
//! Blocks the memory pool holds compressed with the store's codec go to the store as they
//! are, in batches committed and retired the same way. Compaction, if the store's options
//! ask for it, runs once after the last batch.
//!
//! The memory an offload needs beyond the VM's own is thus one batch of dirty page cache
//! and the writers' buffers (a batch buffer per thread), whatever the size of guest RAM.
//!
//! Failure rule: an offload that fails half-way (a full disk, an I/O error, a drop that
//! fails) leaves every page either resident, as it was, or durably stored in a committed
//! batch and served from the store on fault; the batch being written is rolled back. Nothing
//! is lost and the VM runs on; [`OffloadError::batches`] says how many batches were
//! committed. [`Batching::WHOLE`] runs the offload as one batch (all written and committed,
//! then all dropped), the order before batches.
//!
//! Figures (docs/bench/offload.md, medians of 7 rounds, 72 MiB touched in a 512 MiB region,
//! two threads): 8 MiB batches need 11.2 MiB (raw) and 6.2 MiB (lz4) beyond the VM's memory,
//! against 82.8 and 43.0 MiB as one batch, at 1.01 and 0.80 ms/MiB (one batch 1.12 and 0.63);
//! under a limit of the usage + 24 MiB they take 1.06× and 1.05× the unbudgeted time and never
//! hit it. 2 MiB batches cost 49–66% more time (index commits); 16 and 32 MiB save at most 8%
//! for 1.7× and 3× the memory.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use compressed_backing::bulk::{self, BulkOptions};
use compressed_backing::{CodecConfig, DiskStore, Durability, StoreConfig, StoreError, StoreStats};

use crate::addr::{HostRange, PAGE_SIZE};
use crate::pager::{Pager, RamKind, Region, Shared};
use crate::state::PageState;

mod clean;
mod compose;

pub(crate) use clean::StoredHashes;
use compose::{resident_block, resident_or_zero_block, Composer};

/// Store metadata key of the recorded working set (block indices, little-endian u64).
pub const WORKING_SET_KEY: &str = "working-set";

/// Where and how to offload.
#[derive(Debug, Clone)]
pub struct OffloadConfig {
    /// The store directory (created if needed; it must not be used by another VM).
    pub dir: PathBuf,
    /// Codec: `none` for a raw offload, `lz4`/`zstd` for a compressed one.
    pub codec: CodecConfig,
    /// Parallelism of the write.
    pub bulk: BulkOptions,
    /// What the store's commits survive: [`Durability::Process`] for a VM's own offload store,
    /// read again only while the host runs (each batch is still written back and dropped from
    /// the page cache before its pages are dropped from the VM, and its index renamed into
    /// place, so a pager that takes over after this one was killed finds every batch);
    /// [`Durability::Host`] for a store that must survive a crash of the host.
    pub durability: Durability,
    /// Whether the store is read back around the page cache (`O_DIRECT`, where its file
    /// system allows; `DiskStore::set_drop_behind`). On by default; off reads through the page
    /// cache and drops what was read (the way before, kept to measure against).
    pub direct_reads: bool,
}

/// Image bytes of blocks per batch by default: 8 MiB (docs/bench/offload.md measures 2, 8,
/// 16, 32 MiB and one batch: smaller costs time in index commits, larger costs memory and
/// saves no measurable time).
pub const DEFAULT_BATCH_BYTES: u64 = 8 << 20;

/// Most image bytes per append of an offload's writer threads (each holds a buffer of this
/// size, touched up front): 1 MiB, against 4 MiB for other bulk writes, so that the buffers
/// stay small beside a batch's page cache.
const APPEND_BYTES: usize = 1 << 20;

/// How an offload is cut into batches, each written, made durable and committed, its pages
/// then dropped, before the next is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    /// Image bytes of blocks per batch (at least one block per batch). `u64::MAX`
    /// ([`Batching::WHOLE`]): one batch, the whole offload written and committed before
    /// anything is dropped.
    pub bytes: u64,
}

impl Batching {
    /// One batch: every block written, one commit, then every page dropped, with appends of
    /// the configured size (the order and the buffers of the offload before batches, kept to
    /// measure against).
    pub const WHOLE: Self = Self { bytes: u64::MAX };

    /// Batches of `bytes` image bytes.
    pub const fn of(bytes: u64) -> Self {
        Self { bytes }
    }

    fn blocks(self, block_bytes: u64) -> usize {
        usize::try_from(self.bytes / block_bytes.max(1))
            .unwrap_or(usize::MAX)
            .max(1)
    }
}

impl Default for Batching {
    fn default() -> Self {
        Self::of(DEFAULT_BATCH_BYTES)
    }
}

/// What an offload did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct OffloadReport {
    /// Blocks written to the store.
    pub blocks_written: u64,
    /// Blocks the store held already as they were (see `clean`): dropped, not written.
    pub blocks_clean: u64,
    /// Resident pages dropped: those written, and those of clean blocks.
    pub pages_dropped: u64,
    /// Payload bytes written for those blocks.
    pub stored_bytes: u64,
    /// Blocks stored as zero or same-byte tags.
    pub tag_blocks: u64,
    /// Time to write and commit, milliseconds (all batches).
    pub write_ms: f64,
    /// Time to drop the pages, milliseconds (all batches).
    pub drop_ms: f64,
    /// Batches committed (each durable in the store, its pages dropped): all of them.
    pub batches: u64,
    /// The batch size the offload ran with, image bytes (`u64::MAX`: one batch).
    pub batch_bytes: u64,
    /// `fsync`s and `fdatasync`s the offload made (none under [`Durability::Process`]).
    pub syncs: u64,
    /// The store after the offload.
    pub store: StoreStats,
}

/// Why an offload failed. In every case every page of the VM is either resident (as it was)
/// or durably stored in a committed batch and served from the store on fault: nothing is
/// lost and the VM runs on. `batches` says how many batches were committed (their pages
/// dropped) before the failure; the rest is resident.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    /// A region holds resident pages the pager cannot read or drop (anonymous memory of
    /// another process).
    #[error(
        "region {range:?} is anonymous memory of another process: the pager cannot read or drop \
         it (share guest RAM as memfds to offload through the server)"
    )]
    Remote {
        /// The region.
        range: HostRange,
    },
    /// A region is a private mapping of a snapshot image, which the pager does not serve.
    #[error(
        "region {range:?} maps a snapshot image privately: its owner offloads its private pages"
    )]
    Snapshot {
        /// The region.
        range: HostRange,
    },
    /// The store could not be opened, written or committed: the batch being written is
    /// rolled back and its pages stay resident; the `batches` committed before stay stored.
    #[error(
        "offload to the store failed after {batches} committed batches (their pages are \
         stored, the rest resident)"
    )]
    Store {
        /// Batches committed and dropped before the failure.
        batches: u64,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// The store in the directory has another block size than the pager.
    #[error("store {dir} has {found}-byte blocks, the pager uses {expected}")]
    BlockSize {
        /// The store.
        dir: PathBuf,
        /// Its block size.
        found: u64,
        /// The pager's.
        expected: u64,
    },
    /// Dropping pages failed after their batch was durable; they stay resident.
    #[error("cannot drop {len} bytes at {range:?} after offload (the data is stored)")]
    Drop {
        /// Batches committed, that one included.
        batches: u64,
        /// The range.
        range: HostRange,
        /// Bytes.
        len: u64,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The discard events of a batch's drop did not arrive (its data is stored).
    #[error("{pages} dropped pages were not confirmed by the kernel in time")]
    DropTimeout {
        /// Batches committed, that one included.
        batches: u64,
        /// Pages still unconfirmed.
        pages: u64,
    },
}

impl OffloadError {
    /// Batches committed (and their pages dropped) before the failure: those pages are
    /// stored and served from the store, all others resident.
    pub fn batches(&self) -> u64 {
        match self {
            Self::Store { batches, .. }
            | Self::Drop { batches, .. }
            | Self::DropTimeout { batches, .. } => *batches,
            Self::Remote { .. } | Self::Snapshot { .. } | Self::BlockSize { .. } => 0,
        }
    }
}

fn open_store(config: &OffloadConfig, shared: &Shared) -> Result<DiskStore, OffloadError> {
    let mut store = open_or_create(config, shared)?;
    // A store opened anew holds nothing this pager knows of.
    shared.stored_hashes.clear();
    // Every block read back goes into guest RAM: a cached copy of it would only double the
    // memory the offload gave back (and be charged to the VM's memory cgroup).
    store.set_drop_behind(true);
    Ok(store)
}

fn open_or_create(config: &OffloadConfig, shared: &Shared) -> Result<DiskStore, OffloadError> {
    let mut store = match DiskStore::open(&config.dir) {
        Ok(store) => store,
        Err(StoreError::NotAStore { .. }) => {
            return DiskStore::create(
                &config.dir,
                StoreConfig {
                    block_size: shared.block_size,
                    codec: config.codec,
                    image_size: shared.image_size,
                },
            )
            .map_err(before_any_batch)
        }
        Err(e) => return Err(before_any_batch(e)),
    };
    if store.block_size() != shared.block_size {
        return Err(OffloadError::BlockSize {
            dir: config.dir.clone(),
            found: store.block_size().bytes_u64(),
            expected: shared.block_size.bytes_u64(),
        });
    }
    // A store left by an earlier VM: this pager has stored nothing in it yet, so its image is
    // replaced (keeping the recorded working set, which belongs to the image's owner).
    store.reset(shared.image_size).map_err(before_any_batch)?;
    Ok(store)
}

/// A store error before anything was committed.
fn before_any_batch(source: StoreError) -> OffloadError {
    OffloadError::Store { batches: 0, source }
}

/// The store of an offload, locked while a worker appends or a batch commits; unlocked
/// while a batch's pages are dropped (the fault threads may need it to serve a fault).
type StoreTurn<'a> = parking_lot::MappedRwLockWriteGuard<'a, DiskStore>;

/// Where an offload stands: batches committed, pages dropped, time spent dropping.
#[derive(Debug, Default)]
struct Progress {
    batches: u64,
    dropped: u64,
    drop_time: Duration,
}

impl Progress {
    /// `pages` left memory, `clean` (their blocks were in the store as they are) or written:
    /// counted here and in the pager's counters at once, so that an offload failing later
    /// still counts what it dropped.
    fn dropped(&mut self, metrics: &crate::metrics::Metrics, pages: u64, clean: bool) {
        self.dropped += pages;
        let kind = if clean {
            &metrics.pages_clean
        } else {
            &metrics.pages_offloaded
        };
        kind.fetch_add(pages, Ordering::Relaxed);
        metrics.pages_dropped.fetch_add(pages, Ordering::Relaxed);
    }

    fn store_error(&self, source: StoreError) -> OffloadError {
        OffloadError::Store {
            batches: self.batches,
            source,
        }
    }
}

impl Pager {
    /// Offloads the resident pages of a paused VM in batches of the default size (see the
    /// module documentation).
    pub fn offload(&self, config: &OffloadConfig) -> Result<OffloadReport, OffloadError> {
        self.offload_with(config, Batching::default())
    }

    /// Offloads the resident pages of a paused VM in batches of `batching` (see the module
    /// documentation).
    pub fn offload_with(
        &self,
        config: &OffloadConfig,
        batching: Batching,
    ) -> Result<OffloadReport, OffloadError> {
        self.offload_blocks(config, batching, None)
    }

    /// Offloads the resident (and pooled) pages of the blocks wholly inside `range` to the
    /// store, as [`Pager::offload`] does the whole VM's: the guest must not run meanwhile
    /// (a phase arena's close: its vCPU is out of the guest). The rest of RAM stays as it is,
    /// the recorded working set stays for the VM's own offload, and the range comes back on
    /// faults.
    pub fn offload_range(
        &self,
        config: &OffloadConfig,
        range: HostRange,
    ) -> Result<OffloadReport, OffloadError> {
        let blocks = self
            .shared()
            .whole_blocks(range)
            .map_or(0..0, |(_, blocks)| blocks);
        self.offload_blocks(config, Batching::default(), Some(blocks))
    }

    fn offload_blocks(
        &self,
        config: &OffloadConfig,
        batching: Batching,
        only: Option<std::ops::Range<u64>>,
    ) -> Result<OffloadReport, OffloadError> {
        // A prefetcher of an earlier lazy load (or reading ahead along the guest's stride) would
        // install what it read before the offload stored newer bytes: it stops (is held off).
        self.stop_prefetch();
        let shared = self.shared().as_ref();
        let _stride = shared.hold_stride();
        for region in &shared.regions {
            if region.spec.kind == RamKind::Snapshot {
                return Err(OffloadError::Snapshot {
                    range: region.spec.range,
                });
            }
            if !region.spec.can_offload() && shared.table.any(region.pages(), PageState::Resident) {
                return Err(OffloadError::Remote {
                    range: region.spec.range,
                });
            }
        }
        if let Some(only) = &only {
            let per_block = shared.block_size.pages() as u64;
            let pages = only.start * per_block..(only.end * per_block).min(shared.table.len());
            if !shared.table.any(pages.clone(), PageState::Resident)
                && !shared.table.any(pages, PageState::Pooled)
            {
                // Nothing to write: no store opened, nothing committed.
                return Ok(OffloadReport::default());
            }
        }
        let started = Instant::now();
        let mut progress = Progress::default();
        let turn = || {
            parking_lot::RwLockWriteGuard::map(shared.store.slot().write(), |slot| {
                slot.as_mut()
                    .expect("only the offload sets the store, and it opened it first")
            })
        };
        {
            let mut slot = shared.store.slot().write();
            if slot.is_none() {
                *slot = Some(open_store(config, shared)?);
            }
            let store = slot.as_mut().expect("opened above");
            store.set_codec(config.codec);
            store.set_durability(config.durability);
            store.set_direct_reads(config.direct_reads);
        }
        let syncs_before = turn().syncs();
        // Nothing is evicted into the pool while the VM's RAM moves.
        let _held = shared.hold_evictions();
        let per_block = shared.block_size.pages() as u64;
        let total_pages = shared.table.len();
        let pages_of = |b: u64| b * per_block..((b + 1) * per_block).min(total_pages);
        let all = 0..shared.block_size.blocks_for(shared.image_size);
        let mut blocks: Vec<u64> = only
            .clone()
            .unwrap_or(all)
            .filter(|&b| {
                shared.table.any(pages_of(b), PageState::Resident)
                    || shared.table.any(pages_of(b), PageState::Pooled)
            })
            .collect();
        // Blocks the store holds as they are cost only their drop (see `clean`), first.
        shared.stored_hashes.begin(config.durability);
        let mut scratch = Vec::new();
        let clean: Vec<u64> = blocks
            .iter()
            .copied()
            .filter(|&b| {
                let len = shared.block_size.len_in_image(b, shared.image_size);
                // SAFETY: the VM is paused and nothing drops pages until this filter is done;
                // the slice lives only while it is hashed.
                if let Some(bytes) = unsafe { resident_block(shared, b, len) } {
                    return shared.stored_hashes.holds(b, bytes);
                }
                // Resident pages beside never-touched ones, which read as zeros.
                // SAFETY: as above, while the block is copied into `scratch`.
                let composed = unsafe { resident_or_zero_block(shared, b, len, &mut scratch) };
                composed && shared.stored_hashes.holds(b, &scratch)
            })
            .collect();
        if !clean.is_empty() {
            blocks.retain(|b| clean.binary_search(b).is_err());
            self.drop_counted(&clean, &mut progress, true)?;
        }
        shared.stored_hashes.forget(&blocks);
        let batch_blocks = batching.blocks(shared.block_size.bytes_u64());
        // The working set is the VM's, for its own offload.
        let working_set = if only.is_none() {
            shared.working_set.take()
        } else {
            Vec::new()
        };
        if !working_set.is_empty() {
            // Committed with the first batch.
            let bytes = working_set.iter().flat_map(|b| b.to_le_bytes()).collect();
            turn()
                .set_meta(WORKING_SET_KEY, bytes)
                .map_err(|e| progress.store_error(e))?;
        }
        // Blocks compressed whole in the pool with the store's codec go as they are, in
        // batches like the others.
        let mut passed = Vec::new();
        if let Some(pool) = shared.pool.get() {
            if pool.config().codec.codec == config.codec.codec {
                let mut batch = Vec::new();
                for &b in &blocks {
                    if !shared.table.all(pages_of(b), PageState::Pooled) {
                        continue;
                    }
                    let mut store = turn();
                    match pool.with_encoded(b, |encoded| store.put_encoded(b, encoded)) {
                        Ok(Some(Ok(()))) => batch.push(b),
                        Ok(Some(Err(e))) => {
                            let _ = store.rollback();
                            return Err(progress.store_error(e));
                        }
                        // Not passed through: composed like any other block.
                        Ok(None) | Err(_) => {}
                    }
                    drop(store);
                    if batch.len() >= batch_blocks {
                        self.commit_batch(&turn, &batch, &mut progress)?;
                        passed.append(&mut batch);
                    }
                }
                if !batch.is_empty() {
                    self.commit_batch(&turn, &batch, &mut progress)?;
                    passed.append(&mut batch);
                }
            }
        }
        blocks.retain(|b| passed.binary_search(b).is_err());
        let reader = turn().reader();
        let composer = Composer {
            shared,
            stored: &reader,
        };
        // Appends of at most 1 MiB, and of at most a batch shared among the threads: each
        // thread has a share of every batch to write, and their buffers (touched up front)
        // stay small beside the batch's page cache.
        let block_bytes = shared.block_size.bytes();
        let threads = config.bulk.threads.max(1);
        let bulk = if batching == Batching::WHOLE {
            config.bulk
        } else {
            BulkOptions {
                threads,
                batch_bytes: config
                    .bulk
                    .batch_bytes
                    .min(APPEND_BYTES)
                    .min((batch_blocks.saturating_mul(block_bytes) / threads).max(block_bytes)),
            }
        };
        let written = bulk::write_groups(
            &turn,
            &composer,
            &blocks,
            &bulk,
            batch_blocks,
            &|_| {},
            |group, _| {
                self.commit_batch(&turn, group, &mut progress)
                    .map_err(BatchError::Offload)
            },
        );
        let report = match written {
            Ok(report) => report,
            Err(e) => {
                // Forget the batch that was being written (its pages are resident); the
                // first error matters.
                let _ = turn().rollback();
                return Err(match e {
                    BatchError::Store(source) => progress.store_error(source),
                    BatchError::Offload(e) => e,
                });
            }
        };
        {
            let mut store = turn();
            // What is left: the working set of an offload with nothing to write, then the
            // compaction the store's options ask for once all batches are in.
            let finished = if store.has_pending() {
                store.commit().map(drop)
            } else if only.is_none() {
                store.compact_if_auto().map(drop)
            } else {
                // A range's offload (an arena's close) leaves compaction to the VM's own.
                Ok(())
            };
            finished.map_err(|e| progress.store_error(e))?;
            // Whatever compaction wrote is durable: its page cache would only hold on to the
            // memory the offload is meant to give back. (Best effort: the offload has
            // succeeded either way.)
            let _ = store.drop_cache();
        }
        let (stats, syncs) = {
            let store = turn();
            (store.stats(), store.syncs() - syncs_before)
        };
        let elapsed = started.elapsed();
        Ok(OffloadReport {
            blocks_written: report.blocks + passed.len() as u64,
            blocks_clean: clean.len() as u64,
            pages_dropped: progress.dropped,
            stored_bytes: report.stored_bytes,
            tag_blocks: report.zero_blocks + report.fill_blocks,
            write_ms: elapsed.saturating_sub(progress.drop_time).as_secs_f64() * 1e3,
            drop_ms: progress.drop_time.as_secs_f64() * 1e3,
            batches: progress.batches,
            batch_bytes: batching.bytes,
            syncs,
            store: stats,
        })
    }

    /// Makes the blocks written since the last commit (`blocks`, ascending) durable with no
    /// page cache left behind, commits them, then drops their resident pages and retires
    /// their pooled ones.
    fn commit_batch<'a>(
        &self,
        turn: &dyn Fn() -> StoreTurn<'a>,
        blocks: &[u64],
        progress: &mut Progress,
    ) -> Result<(), OffloadError> {
        turn()
            .commit_uncached()
            .map_err(|e| progress.store_error(e))?;
        self.shared().stored_hashes.committed(blocks);
        progress.batches += 1;
        self.drop_counted(blocks, progress, false)?;
        let retired = self.retire_pooled(blocks);
        progress.dropped(&self.shared().metrics, retired, false);
        Ok(())
    }

    /// [`drop_resident`](Self::drop_resident), timed and counted in `progress` (as `clean`
    /// or written).
    fn drop_counted(
        &self,
        blocks: &[u64],
        progress: &mut Progress,
        clean: bool,
    ) -> Result<(), OffloadError> {
        let dropping = Instant::now();
        let dropped = self.drop_resident(blocks, progress.batches);
        progress.drop_time += dropping.elapsed();
        progress.dropped(&self.shared().metrics, dropped?, clean);
        Ok(())
    }

    /// The pooled pages of `blocks` are in the store now: they become stored and their
    /// blocks leave the pool.
    fn retire_pooled(&self, blocks: &[u64]) -> u64 {
        let shared = self.shared().as_ref();
        let Some(pool) = shared.pool.get() else {
            return 0;
        };
        let write = shared.table.write();
        let per_block = shared.block_size.pages() as u64;
        let total = shared.table.len();
        let mut retired = 0;
        for &block in blocks {
            let mut any = false;
            for page in block * per_block..((block + 1) * per_block).min(total) {
                if shared.table.retired(&write, page) {
                    retired += 1;
                    any = true;
                }
            }
            if any {
                let _ = pool.remove(block);
            }
        }
        retired
    }

    /// Drops the resident pages of `blocks` (ascending, durable in the store by now): marks
    /// each run `Dropping`, discards it, and waits until every page is `Stored` (set here, or
    /// by the fault threads as they read the discards' events, where the uffd has them).
    /// `batches`:
    /// committed so far, for the error.
    fn drop_resident(&self, blocks: &[u64], batches: u64) -> Result<u64, OffloadError> {
        let shared = self.shared().as_ref();
        let per_block = shared.block_size.pages() as u64;
        let mut dropped = 0;
        let mut awaiting_events = false;
        let mut at = 0;
        while at < blocks.len() {
            // Consecutive blocks make one range of pages.
            let first = blocks[at];
            let mut last = first;
            at += 1;
            while at < blocks.len() && blocks[at] == last + 1 {
                last = blocks[at];
                at += 1;
            }
            let span = first * per_block..(last + 1) * per_block;
            for region in &shared.regions {
                let pages = region.pages();
                let pages = span.start.max(pages.start)..span.end.min(pages.end);
                let (count, events) = self.drop_runs(region, pages, batches)?;
                dropped += count;
                awaiting_events |= events;
            }
        }
        if awaiting_events {
            // The fault threads turn the pages `Stored` as they read the discards' `REMOVE`
            // events, and say so: checked and waited for under one lock, no signal is missed.
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut ordered = shared.dropped_lock.lock();
            loop {
                let left = shared.table.count(PageState::Dropping);
                if left == 0 {
                    break;
                }
                if shared
                    .dropped
                    .wait_until(&mut ordered, deadline)
                    .timed_out()
                    && shared.table.count(PageState::Dropping) > 0
                {
                    return Err(OffloadError::DropTimeout {
                        batches,
                        pages: shared.table.count(PageState::Dropping),
                    });
                }
            }
        }
        Ok(dropped)
    }

    /// Drops the runs of resident pages among `pages` of `region`; returns how many, and
    /// whether their discard events are to be awaited.
    fn drop_runs(
        &self,
        region: &Region,
        pages: std::ops::Range<u64>,
        batches: u64,
    ) -> Result<(u64, bool), OffloadError> {
        let shared = self.shared().as_ref();
        let mut dropped = 0;
        let mut awaiting_events = false;
        let mut page = pages.start;
        while page < pages.end {
            if shared.table.get(page) != PageState::Resident {
                page += 1;
                continue;
            }
            let start = page;
            while page < pages.end && shared.table.get(page) == PageState::Resident {
                page += 1;
            }
            shared.table.dropping(start..page);
            let run = HostRange::new(region.addr_of(start), (page - start) * PAGE_SIZE)
                .expect("pages of a region");
            let offset = region.spec.memfd_offset + (start - region.first_page) * PAGE_SIZE;
            let memfd = region.spec.memfd.as_deref().map(|file| (file, offset));
            // SAFETY: the range is this process's own guest RAM (`can_offload`) whose bytes are
            // durable in the store; discarding it makes the next touch fault to the pager.
            let result = unsafe { crate::discard::discard(region.spec.kind, run, memfd) };
            if let Err(source) = result {
                shared.table.drop_failed(start..page);
                return Err(OffloadError::Drop {
                    batches,
                    range: run,
                    len: run.len(),
                    source,
                });
            }
            if matches!(region.spec.kind, RamKind::Anon | RamKind::Hugetlb) && shared.remove_events
            {
                // The fault threads turn these into `Stored` when they read the event.
                awaiting_events = true;
            } else {
                shared.table.dropped(start..page);
            }
            dropped += page - start;
        }
        Ok((dropped, awaiting_events))
    }
}

/// What ends a batched write: the store's error, or the offload's own (a drop).
#[derive(Debug)]
enum BatchError {
    Store(StoreError),
    Offload(OffloadError),
}

impl From<StoreError> for BatchError {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}
