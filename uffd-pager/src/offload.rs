//! Offload of a paused VM's RAM: every block holding a resident page is written to the
//! offload store (zero pages elided, incompressible blocks raw, in parallel), the store is
//! committed durably, and only then are the resident pages dropped (`MADV_DONTNEED` for anon
//! RAM, a punched hole for memfd RAM). Until the commit nothing is dropped, so an offload that
//! fails for any reason leaves the VM's memory resident and intact.

use std::cell::RefCell;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use compressed_backing::bulk::{self, BlockSource, BulkOptions};
use compressed_backing::{
    CodecConfig, DiskStore, StoreConfig, StoreError, StoreReader, StoreStats,
};

use crate::addr::{HostRange, PAGE_SIZE};
use crate::pager::{Pager, RamKind, Shared};
use crate::state::PageState;

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
}

/// What an offload did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct OffloadReport {
    /// Blocks written to the store.
    pub blocks_written: u64,
    /// Resident pages written (and then dropped).
    pub pages_dropped: u64,
    /// Payload bytes written for those blocks.
    pub stored_bytes: u64,
    /// Blocks stored as zero or same-byte tags.
    pub tag_blocks: u64,
    /// Time to write and commit, milliseconds.
    pub write_ms: f64,
    /// Time to drop the pages, milliseconds.
    pub drop_ms: f64,
    /// The store after the offload.
    pub store: StoreStats,
}

/// Why an offload failed. In every case the VM's memory is still resident and intact, or
/// (for `Drop`) durably stored and served on fault.
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
    /// The store could not be opened, written or committed; nothing was dropped.
    #[error("offload to the store failed; the VM's memory is untouched")]
    Store(#[from] StoreError),
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
    /// Dropping pages failed after the data was durable; they stay resident.
    #[error("cannot drop {len} bytes at {range:?} after offload (the data is stored)")]
    Drop {
        /// The range.
        range: HostRange,
        /// Bytes.
        len: u64,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The discard events of the drop did not arrive.
    #[error("{pages} dropped pages were not confirmed by the kernel in time")]
    DropTimeout {
        /// Pages still unconfirmed.
        pages: u64,
    },
}

thread_local! {
    /// Per-thread buffers for the old stored block, the restore block and the pooled block of
    /// a mixed block.
    static COMPOSE: RefCell<(Vec<u8>, Vec<u8>, Vec<u8>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Builds each block to write from its pages' current homes: resident pages from memory,
/// stored pages from the store as it was, restore pages from the restore image, zeros.
struct Composer<'a> {
    shared: &'a Shared,
    stored: &'a StoreReader,
}

impl BlockSource for Composer<'_> {
    fn block<'s>(&'s self, block: u64, buf: &mut [u8]) -> std::io::Result<Option<&'s [u8]>> {
        let shared = self.shared;
        let first = block * shared.block_size.pages() as u64;
        let len = buf.len();
        let pages = len as u64 / PAGE_SIZE;
        // A block that is wholly resident in one region is encoded from guest memory as it is.
        if let Some(region) = shared.region_of_page(first) {
            if region.pages().contains(&(first + pages - 1))
                && shared.states.all(first..first + pages, PageState::Resident)
            {
                let view = region.view_of(first).expect("checked before the offload");
                let start = view.as_ptr().cast::<u8>().cast_const();
                // SAFETY: the region's view is mapped for the pager's lifetime (checked before
                // the offload), which outlives `self`; the pages are resident, so reading them
                // does not fault into the pager, and they stay resident until the offload's
                // write is done (drops come after); the VM is paused, so nothing writes them
                // while the slice lives.
                return Ok(Some(unsafe { std::slice::from_raw_parts(start, len) }));
            }
        }
        COMPOSE.with(|scratch| {
            let (old, restore, pooled) = &mut *scratch.borrow_mut();
            let (mut have_old, mut have_restore, mut have_pooled) = (false, false, false);
            for page in first..first + pages {
                let at = ((page - first) * PAGE_SIZE) as usize;
                let dst = &mut buf[at..at + PAGE_SIZE as usize];
                match shared.states.get(page) {
                    PageState::Resident | PageState::Dropping => {
                        let region = shared
                            .region_of_page(page)
                            .expect("a resident page lies in a region");
                        let view = region.view_of(page).expect("checked before the offload");
                        let src = view.as_ptr().cast::<u8>().cast_const();
                        // SAFETY: the region's view is mapped for the pager's lifetime and the
                        // page is resident, so reading it does not fault into the pager; the
                        // VM is paused, so nothing writes it meanwhile.
                        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
                    }
                    PageState::Stored => {
                        if !have_old {
                            old.resize(len, 0);
                            self.stored.get(block, old).map_err(std::io::Error::other)?;
                            have_old = true;
                        }
                        dst.copy_from_slice(&old[at..at + PAGE_SIZE as usize]);
                    }
                    PageState::Source => {
                        if !have_restore {
                            let source = shared.restore.as_ref().ok_or_else(|| {
                                std::io::Error::other("a restore-state page without a source")
                            })?;
                            restore.resize(len, 0);
                            let offset = block * shared.block_size.bytes_u64();
                            source
                                .read(offset, restore, &mut 0)
                                .map_err(std::io::Error::other)?;
                            have_restore = true;
                        }
                        dst.copy_from_slice(&restore[at..at + PAGE_SIZE as usize]);
                    }
                    PageState::Pooled => {
                        if !have_pooled {
                            let cold = shared.cold.get().ok_or_else(|| {
                                std::io::Error::other("a pooled page without a pool")
                            })?;
                            pooled.resize(len, 0);
                            match cold.pool.get(block, pooled) {
                                Ok(Some(_)) => {}
                                Ok(None) => {
                                    return Err(std::io::Error::other(format!(
                                        "block {block} is pooled but not in the pool"
                                    )))
                                }
                                Err(e) => return Err(std::io::Error::other(e)),
                            }
                            have_pooled = true;
                        }
                        dst.copy_from_slice(&pooled[at..at + PAGE_SIZE as usize]);
                    }
                    PageState::Zero => dst.fill(0),
                }
            }
            Ok::<(), std::io::Error>(())
        })?;
        Ok(None)
    }
}

fn open_store(config: &OffloadConfig, shared: &Shared) -> Result<DiskStore, OffloadError> {
    let mut store = open_or_create(config, shared)?;
    // Every block read back goes into guest RAM: a cached copy of it would only double the
    // memory the offload gave back (and be charged to the VM's memory cgroup).
    store.set_drop_behind(true);
    Ok(store)
}

fn open_or_create(config: &OffloadConfig, shared: &Shared) -> Result<DiskStore, OffloadError> {
    let mut store = match DiskStore::open(&config.dir) {
        Ok(store) => store,
        Err(StoreError::NotAStore { .. }) => {
            return Ok(DiskStore::create(
                &config.dir,
                StoreConfig {
                    block_size: shared.block_size,
                    codec: config.codec,
                    image_size: shared.image_size,
                },
            )?)
        }
        Err(e) => return Err(e.into()),
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
    store.reset(shared.image_size)?;
    Ok(store)
}

impl Pager {
    /// Offloads the resident pages of a paused VM (see the module documentation).
    pub fn offload(&self, config: &OffloadConfig) -> Result<OffloadReport, OffloadError> {
        let shared = self.shared().as_ref();
        for region in &shared.regions {
            if region.spec.kind == RamKind::Snapshot {
                return Err(OffloadError::Snapshot {
                    range: region.spec.range,
                });
            }
            if !region.spec.can_offload() && shared.states.any(region.pages(), PageState::Resident)
            {
                return Err(OffloadError::Remote {
                    range: region.spec.range,
                });
            }
        }
        let started = Instant::now();
        let mut slot = shared.store.slot().write();
        if slot.is_none() {
            *slot = Some(open_store(config, shared)?);
        }
        let store = slot.as_mut().expect("opened above");
        store.set_codec(config.codec);
        // Cold compression holds still while the VM's RAM moves.
        let _paused = shared.cold.get().map(|cold| cold.pause());
        let per_block = shared.block_size.pages() as u64;
        let total_pages = shared.states.len();
        let pages_of = |b: u64| b * per_block..((b + 1) * per_block).min(total_pages);
        let mut blocks: Vec<u64> = (0..shared.block_size.blocks_for(shared.image_size))
            .filter(|&b| {
                shared.states.any(pages_of(b), PageState::Resident)
                    || shared.states.any(pages_of(b), PageState::Pooled)
            })
            .collect();
        // Blocks compressed whole in the pool with the store's codec go as they are.
        if let Some(cold) = shared.cold.get() {
            if cold.pool.config().codec.codec == config.codec.codec {
                let mut passed = Vec::new();
                for &b in &blocks {
                    if !shared.states.all(pages_of(b), PageState::Pooled) {
                        continue;
                    }
                    match cold
                        .pool
                        .with_encoded(b, |encoded| store.put_encoded(b, encoded))
                    {
                        Ok(Some(Ok(()))) => passed.push(b),
                        Ok(Some(Err(e))) => {
                            let _ = store.rollback();
                            return Err(e.into());
                        }
                        // Not passed through: composed like any other block.
                        Ok(None) | Err(_) => {}
                    }
                }
                blocks.retain(|b| passed.binary_search(b).is_err());
            }
        }
        let reader = store.reader();
        let composer = Composer {
            shared,
            stored: &reader,
        };
        let working_set = shared.working_set.take();
        let written = bulk::write_blocks(store, &composer, &blocks, &config.bulk, &|_| {})
            .and_then(|report| {
                if !working_set.is_empty() {
                    let bytes = working_set.iter().flat_map(|b| b.to_le_bytes()).collect();
                    store.set_meta(WORKING_SET_KEY, bytes)?;
                }
                store.commit()?;
                Ok(report)
            });
        let report = match written {
            Ok(report) => report,
            Err(e) => {
                // Nothing was dropped; forget the partial write. The first error matters.
                let _ = store.rollback();
                return Err(e.into());
            }
        };
        // The image is durable: its page cache would only hold on to the memory the offload
        // is meant to give back. (Best effort: the offload has succeeded either way.)
        let _ = store.drop_cache();
        let stats = store.stats();
        drop(slot);
        let write_ms = started.elapsed().as_secs_f64() * 1e3;

        let dropping = Instant::now();
        let mut dropped = self.drop_resident()?;
        dropped += self.retire_pooled();
        shared
            .metrics
            .pages_offloaded
            .fetch_add(dropped, Ordering::Relaxed);
        shared
            .metrics
            .pages_dropped
            .fetch_add(dropped, Ordering::Relaxed);
        Ok(OffloadReport {
            blocks_written: report.blocks,
            pages_dropped: dropped,
            stored_bytes: report.stored_bytes,
            tag_blocks: report.zero_blocks + report.fill_blocks,
            write_ms,
            drop_ms: dropping.elapsed().as_secs_f64() * 1e3,
            store: stats,
        })
    }

    /// Pooled pages are in the store now: they become stored and leave the pool.
    fn retire_pooled(&self) -> u64 {
        let shared = self.shared().as_ref();
        let Some(cold) = shared.cold.get() else {
            return 0;
        };
        let _write = shared.layout.write();
        let per_block = shared.block_size.pages() as u64;
        let mut retired = 0;
        for page in 0..shared.states.len() {
            if shared
                .states
                .transition(page, PageState::Pooled, PageState::Stored)
            {
                retired += 1;
                if (page + 1) % per_block == 0 || page + 1 == shared.states.len() {
                    let _ = cold.pool.remove(page / per_block);
                }
            }
        }
        retired
    }

    /// Drops every resident page (all durable in the store by now): marks each run
    /// `Dropping`, discards it, and waits until every page is `Stored`.
    fn drop_resident(&self) -> Result<u64, OffloadError> {
        let shared = self.shared().as_ref();
        let mut dropped = 0;
        let mut awaiting_events = false;
        for region in &shared.regions {
            let pages = region.pages();
            let mut page = pages.start;
            while page < pages.end {
                if shared.states.get(page) != PageState::Resident {
                    page += 1;
                    continue;
                }
                let start = page;
                while page < pages.end && shared.states.get(page) == PageState::Resident {
                    shared.states.set(page, PageState::Dropping);
                    page += 1;
                }
                let run = HostRange::new(region.addr_of(start), (page - start) * PAGE_SIZE)
                    .expect("pages of a region");
                let result = match region.spec.kind {
                    RamKind::Anon => {
                        // SAFETY: the range is this process's own guest RAM (`can_offload`) whose
                        // bytes are durable in the store; discarding it makes the next touch
                        // fault to the pager.
                        let rc = unsafe {
                            libc::madvise(
                                run.start().as_ptr(),
                                run.len() as usize,
                                libc::MADV_DONTNEED,
                            )
                        };
                        if rc == 0 {
                            Ok(())
                        } else {
                            Err(std::io::Error::last_os_error())
                        }
                    }
                    RamKind::Memfd => {
                        let memfd = region.spec.memfd.as_ref().expect("checked at creation");
                        let offset =
                            region.spec.memfd_offset + (start - region.first_page) * PAGE_SIZE;
                        punch_hole(memfd, offset, run.len())
                    }
                    RamKind::Snapshot => unreachable!("refused at the start of the offload"),
                };
                if let Err(source) = result {
                    shared.states.set_range(start..page, PageState::Resident);
                    return Err(OffloadError::Drop {
                        range: run,
                        len: run.len(),
                        source,
                    });
                }
                if region.spec.kind == RamKind::Anon && shared.remove_events {
                    // The fault threads turn these into `Stored` when they read the event.
                    awaiting_events = true;
                } else {
                    for p in start..page {
                        shared
                            .states
                            .transition(p, PageState::Dropping, PageState::Stored);
                    }
                }
                dropped += page - start;
            }
        }
        if awaiting_events {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let left = shared.states.counts().dropping;
                if left == 0 {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(OffloadError::DropTimeout { pages: left });
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        Ok(dropped)
    }
}

/// Frees `len` bytes of `file` at `offset` (memfd RAM, a store's file); the size stays.
pub fn punch_hole(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    };
    // SAFETY: fallocate on our own descriptor with valid flags.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
