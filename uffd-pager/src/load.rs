//! Bringing offloaded RAM back: `lazy` (faults are served from the store while a background
//! prefetcher installs the rest, recorded working set first, in CRIU-style growing chunks that
//! pause while faults are pending), `eager` (everything installed in parallel before
//! returning) or `faults` (faults only: what the VM does not touch stays in the store). The order of blocks faulted during a resume is recorded and saved with the
//! next offload, so the next lazy load prefetches that working set first (REAP-style), and a
//! warm-up ([`Pager::warm`]) can install just that set while the VM is still stopped (its
//! model answer is arriving), before any load.
//!
//! Loads obey the resident limit ([`crate::limit`]): while one is set, every run of pages is
//! installed only if it fits under the limit, else the load waits for room in steps of
//! [`LIMIT_WAIT`] (until the limit is raised or removed, or pages are discarded or offloaded).
//! The prefetcher also waits while faults are held, so that room goes to them first, and stops
//! waiting as soon as it is stopped or the pager is dropped. An eager load waits the same way
//! (until the owner of the memory exits), and, since no fault of the stopped VM asks for room,
//! it asks itself: while the limit keeps it from its next block it counts the pages it has left
//! as held and reports the shortfall to the limit's owner, as a held fault does (`EagerNeed`).
//! Under a limit that nobody raises it does not return.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::offload::WORKING_SET_KEY;
use crate::pager::{Pager, Shared};
use crate::source::SourceError;
use crate::state::PageState;

/// Smallest prefetch chunk (CRIU starts at 64 KiB).
const MIN_CHUNK_BYTES: u64 = 64 << 10;
/// Largest prefetch chunk (CRIU caps at 4 MiB).
const MAX_CHUNK_BYTES: u64 = 4 << 20;
/// How long a load waiting for room under the resident limit sleeps before it looks again.
pub const LIMIT_WAIT: Duration = Duration::from_millis(1);

/// The longest a prefetch thread waits for the faults in flight to be served before it looks
/// again. It waits on a condition variable the fault threads signal when the last one is
/// served. It used to yield the CPU (`sched_yield`) in a loop instead, a busy wait: with 64
/// sandboxes resuming on 2 cores the prefetch threads spent 16% of all CPU time spinning there
/// (`perf record -a`, 2026-12-07), time the fault threads they waited for needed.
pub const FAULT_WAIT: Duration = Duration::from_millis(1);

/// How to bring offloaded RAM back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadMode {
    /// Serve on fault; prefetch the rest in the background.
    Lazy,
    /// Install everything before returning.
    Eager,
    /// Serve on fault only: nothing is prefetched (a warm-up under way finishes), and what
    /// the VM does not touch stays in the store (the next offload has nothing to write for
    /// it).
    Faults,
}

/// What a load did (for `Lazy`: what it scheduled).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct LoadReport {
    /// Blocks with stored pages when the load started.
    pub blocks: u64,
    /// Of those, blocks in the recorded working set (prefetched first).
    pub working_set_blocks: u64,
    /// Pages installed before returning (eager).
    pub pages_installed: u64,
    /// Milliseconds spent before returning.
    pub elapsed_ms: f64,
}

/// What [`Pager::collapse`] did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Collapse {
    /// 2 MiB ranges now mapped by transparent huge pages.
    pub huge_pages: u64,
    /// Ranges the kernel would not collapse (THP off, memory short, pages it cannot move).
    pub refused: u64,
    /// Milliseconds it took (the kernel copies every page into its huge page).
    pub elapsed_ms: f64,
}

/// Why a load failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A block could not be read (an eager load stops; faults on it report errors).
    #[error("cannot load block {block}")]
    Source {
        /// The block.
        block: u64,
        /// Why.
        #[source]
        source: SourceError,
    },
    /// Installing pages failed.
    #[error("cannot install block {block}")]
    Install {
        /// The block.
        block: u64,
        /// Why.
        #[source]
        source: crate::uffd::UffdError,
    },
    /// The prefetch thread could not be started.
    #[error("cannot start the prefetcher")]
    Thread(#[source] std::io::Error),
}

impl Shared {
    /// Blocks holding at least one `Stored` page, ascending.
    fn stored_blocks(&self) -> Vec<u64> {
        let per_block = self.block_size.pages() as u64;
        let pages = self.table.len();
        (0..self.block_size.blocks_for(self.image_size))
            .filter(|&b| {
                self.table.any(
                    b * per_block..((b + 1) * per_block).min(pages),
                    PageState::Stored,
                )
            })
            .collect()
    }

    /// What a load or a warm-up starts from: the blocks holding stored pages and the working
    /// set saved with the store. Recording starts afresh for this resume, on top of what the
    /// last ones recorded: blocks the prefetcher installs raise no fault, so a set recorded
    /// from faults alone would lose them and shrink with every resume.
    fn begin_load(&self) -> (Vec<u64>, Vec<u64>) {
        let saved = self.saved_working_set();
        self.working_set.restart(&saved);
        (self.stored_blocks(), saved)
    }

    /// The blocks of the recorded working set `saved` that still hold stored pages (in
    /// `stored`, ascending), in recorded order and each once; and which blocks those are.
    fn working_set_order(&self, stored: &[u64], saved: &[u64]) -> (Vec<u64>, Vec<bool>) {
        let mut in_set = vec![false; self.block_size.blocks_for(self.image_size) as usize];
        let mut order = Vec::new();
        for &block in saved {
            if let Some(seen) = in_set.get_mut(block as usize) {
                if !*seen && stored.binary_search(&block).is_ok() {
                    *seen = true;
                    order.push(block);
                }
            }
        }
        (order, in_set)
    }

    /// The recorded working set saved with the store, if any.
    fn saved_working_set(&self) -> Vec<u64> {
        let guard = self.store.slot().read();
        let Some(bytes) = guard.as_ref().and_then(|s| s.meta(WORKING_SET_KEY)) else {
            return Vec::new();
        };
        bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8")))
            .collect()
    }
}

impl Pager {
    /// Brings offloaded RAM back (see the module documentation). The VM may run during and
    /// after a lazy load; faults are served from the store meanwhile.
    pub fn load(&self, mode: LoadMode, threads: usize) -> Result<LoadReport, LoadError> {
        let started = Instant::now();
        let shared = self.shared();
        let (stored, saved) = shared.begin_load();
        let mut report = LoadReport {
            blocks: stored.len() as u64,
            ..LoadReport::default()
        };
        match mode {
            LoadMode::Eager => {
                report.pages_installed = eager(shared, &stored, threads)?;
            }
            // A warm-up started during the wait (see `warm`) goes on: it installs what the
            // guest is about to touch.
            LoadMode::Faults => {}
            LoadMode::Lazy => {
                let (mut order, in_set) = shared.working_set_order(&stored, &saved);
                report.working_set_blocks = order.len() as u64;
                let hot = order.len();
                order.extend(stored.iter().filter(|&&b| !in_set[b as usize]));
                self.start_prefetch(order, hot, threads)?;
            }
        }
        report.elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
        Ok(report)
    }

    /// Starts bringing the recorded working set of offloaded RAM back in the background while
    /// the VM is still stopped (its answer is arriving, say): `threads` threads install its
    /// blocks that are still stored, in recorded order, and nothing else. The `load` that
    /// follows lets it finish (`faults`), or takes it over (`lazy`, `eager`). Recording starts
    /// afresh as in `load`: the blocks it installs raise no fault, so they stay in the set.
    /// Returns what it scheduled.
    pub fn warm(&self, threads: usize) -> Result<LoadReport, LoadError> {
        let started = Instant::now();
        let shared = self.shared();
        let (stored, saved) = shared.begin_load();
        let (order, _) = shared.working_set_order(&stored, &saved);
        let mut report = LoadReport {
            blocks: stored.len() as u64,
            working_set_blocks: order.len() as u64,
            ..LoadReport::default()
        };
        if !order.is_empty() {
            let hot = order.len();
            self.start_prefetch(order, hot, threads)?;
        }
        report.elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
        Ok(report)
    }

    /// Starts the background prefetcher over `order` (the first `hot` blocks are the
    /// recorded working set, prefetched by `threads` threads), replacing one still running.
    fn start_prefetch(&self, order: Vec<u64>, hot: usize, threads: usize) -> Result<(), LoadError> {
        self.stop_prefetch();
        let shared = std::sync::Arc::clone(self.shared());
        shared.prefetch_stop.store(false, Ordering::Relaxed);
        let handle = std::thread::Builder::new()
            .name("uffd-prefetch".into())
            .spawn(move || prefetch(&shared, &order, hot, threads))
            .map_err(LoadError::Thread)?;
        *self.prefetcher().lock() = Some(handle);
        Ok(())
    }

    /// Waits until the prefetcher has installed everything it was given.
    pub fn wait_prefetch(&self) {
        let handle = self.prefetcher().lock().take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }

    /// Stops the prefetcher (faults still serve everything).
    pub fn stop_prefetch(&self) {
        self.shared().prefetch_stop.store(true, Ordering::Relaxed);
        self.wait_prefetch();
    }
}

impl Pager {
    /// Asks the kernel to map the resident RAM of private anon regions with transparent huge
    /// pages (`MADV_COLLAPSE`, which copies each 2 MiB range into a huge page): RAM the pager
    /// installed is mapped in 4 KiB pages, and each of them costs the guest a shadow-page
    /// fault on its next touch on a host like this one. Only 2 MiB ranges whose every page is
    /// resident are asked for (the kernel refuses ranges of userfaultfd-registered memory
    /// with pages missing); memory registered for write tracking is not (the kernel refuses
    /// it). Call it with the VM stopped, after an eager load. Whether it pays is measured in
    /// docs/bench/vm.md (`thp-raw-eager`).
    pub fn collapse(&self) -> Collapse {
        let started = Instant::now();
        let shared = self.shared();
        let mut report = Collapse::default();
        let huge = basics::PageSize::HUGE;
        for region in &shared.regions {
            if region.spec.kind != crate::pager::RamKind::Anon
                || shared.track_writes
                || !region.spec.in_process()
            {
                continue;
            }
            let range = region.spec.range;
            let Some(mut at) = huge.align_up(range.start().0) else {
                continue;
            };
            while at.saturating_add(huge.bytes()) <= range.end().0 {
                let first = region.first_page + (at - range.start().0) / crate::addr::PAGE_SIZE;
                let pages = first..first + huge.bytes() / crate::addr::PAGE_SIZE;
                if shared.table.all(pages, PageState::Resident) {
                    // SAFETY: a 2 MiB range of this process's own guest RAM, every page of it
                    // mapped: the kernel copies the pages into a huge page and maps it in
                    // their place, bytes unchanged; nothing holds their physical addresses
                    // (KVM follows the change through its MMU notifier).
                    let rc = unsafe {
                        libc::madvise(
                            crate::addr::HostAddr(at).as_ptr(),
                            huge.usize(),
                            libc::MADV_COLLAPSE,
                        )
                    };
                    if rc == 0 {
                        report.huge_pages += 1;
                    } else {
                        report.refused += 1;
                    }
                }
                at += huge.bytes();
            }
        }
        report.elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
        report
    }
}

/// What a load does with a block another thread is reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Busy {
    /// Leave it to that thread.
    Pass,
    /// Wait until it is done, then install what is left.
    Wait,
}

/// An eager load's claim on room under the resident limit. A held fault asks the limit's
/// owner (a governor) for room; an eager load runs with the vCPUs stopped, so no fault would
/// ask for it, and a load waiting under a limit nobody raises would wait forever. So while it
/// waits it counts the stored pages it has yet to install as held and reports the shortfall,
/// as a held fault does; it counts nothing once it is done, or while no limit is set.
struct EagerNeed<'a> {
    shared: &'a Shared,
    /// Pages counted as held now.
    held: parking_lot::Mutex<u64>,
}

impl<'a> EagerNeed<'a> {
    fn new(shared: &'a Shared) -> Self {
        Self {
            shared,
            held: parking_lot::Mutex::new(0),
        }
    }

    /// The load waits (for room, or for a block another thread reads): if the limit keeps
    /// it from installing its next block, counts what it has left as held and reports the
    /// shortfall; else counts nothing (a hold that is not one would set off the governor
    /// client's fail-safe for holds that last).
    fn waiting(&self) {
        let limit = &self.shared.limit;
        let resident = self.shared.table.resident();
        let mut held = self.held.lock();
        limit.held_changed(*held, 0);
        let block = self.shared.block_size.pages() as u64;
        let short = limit.shortfall(resident.saturating_add(block)) > 0;
        *held = if short {
            self.shared.table.count(PageState::Stored)
        } else {
            0
        };
        limit.held_changed(0, *held);
        let shortfall = limit.shortfall(resident);
        drop(held);
        if short && shortfall > 0 {
            limit.report(shortfall);
        }
    }
}

impl Drop for EagerNeed<'_> {
    fn drop(&mut self) {
        let held = *self.held.lock();
        self.shared.limit.held_changed(held, 0);
    }
}

/// Installs every stored page of `blocks` with `threads` workers; returns the pages filled.
fn eager(shared: &Shared, blocks: &[u64], threads: usize) -> Result<u64, LoadError> {
    let need = EagerNeed::new(shared);
    let next = AtomicUsize::new(0);
    let results: Vec<Result<u64, LoadError>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                scope.spawn(|| {
                    let mut buf = vec![0u8; shared.block_size.bytes()];
                    let mut filled = 0;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&block) = blocks.get(i) else {
                            return Ok(filled);
                        };
                        filled += shared.fill_block(
                            block,
                            PageState::Stored,
                            &mut buf,
                            Busy::Wait,
                            &|| {
                                need.waiting();
                                shared.owner_gone.load(Ordering::Relaxed)
                            },
                        )?;
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or(Ok(0)))
            .collect()
    });
    let mut total = 0;
    for result in results {
        total += result?;
    }
    Ok(total)
}

/// Lets pending faults go first: sleeps [`LIMIT_WAIT`] while faults are held at the resident
/// limit (the room is theirs), until the others are served (at most [`FAULT_WAIT`]) while
/// they are pending; false if none are.
fn yield_to_faults(shared: &Shared) -> bool {
    if shared.metrics.held_now.load(Ordering::Relaxed) > 0 {
        std::thread::sleep(LIMIT_WAIT);
        true
    } else {
        shared.wait_for_no_faults(FAULT_WAIT)
    }
}

/// The prefetcher. The recorded working set (`order[..hot]`) goes first: it is what the VM
/// needs soonest. The rest goes in chunks that start at 64 KiB and double while no fault
/// arrives (up to 4 MiB). Both phases run on `threads` threads, so that one thread's read
/// overlaps another's install (a 2 MiB block of huge-page RAM is a millisecond of disk and a
/// fraction of one to copy). While faults are pending every prefetch thread yields to them;
/// the rest is taken from one cursor that skips ahead past the block of the latest fault if
/// that block is further along its order (the faulting thread is reading there: installing
/// what comes next helps it, installing behind it does not), and comes back for the skipped
/// blocks at the end. A block a fault thread is reading is left to it.
fn prefetch(shared: &Shared, order: &[u64], hot: usize, threads: usize) {
    let block_bytes = shared.block_size.bytes_u64();
    // Where each block sits in `order`, to find the latest fault's place.
    let mut position = vec![usize::MAX; shared.block_size.blocks_for(shared.image_size) as usize];
    for (i, &block) in order.iter().enumerate() {
        if let Some(slot) = position.get_mut(block as usize) {
            *slot = i;
        }
    }
    let stop = || {
        shared.prefetch_stop.load(Ordering::Relaxed) || shared.owner_gone.load(Ordering::Relaxed)
    };
    let fill = |i: usize, buf: &mut [u8]| match shared.fill_block(
        order[i],
        PageState::Stored,
        buf,
        Busy::Pass,
        &stop,
    ) {
        Ok(0) => {}
        Ok(pages) => {
            shared
                .metrics
                .prefetch_pages
                .fetch_add(pages, Ordering::Relaxed);
            if i < hot {
                shared.metrics.prefetch_hits.fetch_add(1, Ordering::Relaxed);
            }
        }
        // A block that cannot be read is left to faults, which report the error.
        Err(_) => {}
    };
    // Phase one: the working set.
    let next = AtomicUsize::new(0);
    workers(
        shared,
        threads,
        &|| {
            let i = next.fetch_add(1, Ordering::Relaxed);
            (i < hot).then_some(i..i + 1)
        },
        &fill,
    );
    // Phase two: the rest, from one cursor.
    let cursor = parking_lot::Mutex::new(Cursor {
        at: hot,
        chunk: Cursor::chunk_of(MIN_CHUNK_BYTES, block_bytes),
        faults: shared.faults_seen.load(Ordering::Relaxed),
        skipped: Vec::new(),
    });
    workers(
        shared,
        threads,
        &|| cursor.lock().take(shared, &position, order.len()),
        &fill,
    );
}

/// Runs `threads` prefetch workers until `next` has no more places (or the prefetcher is
/// stopped): each takes places from it and fills them, yielding while faults are pending.
fn workers(
    shared: &Shared,
    threads: usize,
    next: &(dyn Fn() -> Option<std::ops::Range<usize>> + Sync),
    fill: &(dyn Fn(usize, &mut [u8]) + Sync),
) {
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| {
                let mut buf = vec![0u8; shared.block_size.bytes()];
                loop {
                    if shared.prefetch_stop.load(Ordering::Relaxed) {
                        return;
                    }
                    if yield_to_faults(shared) {
                        continue;
                    }
                    let Some(places) = next() else {
                        return;
                    };
                    for i in places {
                        fill(i, &mut buf);
                    }
                }
            });
        }
    });
}

/// Where the prefetcher's second phase stands in its order.
struct Cursor {
    /// The next place to prefetch.
    at: usize,
    /// Blocks per chunk now.
    chunk: usize,
    /// `faults_seen` when the last chunk was taken.
    faults: u64,
    /// Places passed over to follow a fault, taken at the end.
    skipped: Vec<std::ops::Range<usize>>,
}

impl Cursor {
    fn chunk_of(bytes: u64, block_bytes: u64) -> usize {
        (bytes / block_bytes).max(1) as usize
    }

    /// The next places to prefetch (`None`: all taken): a chunk from the cursor, which skips
    /// ahead past the latest fault's block if a fault came since the last chunk (the chunk
    /// then starts small again; it doubles while none comes), then the skipped places.
    fn take(
        &mut self,
        shared: &Shared,
        position: &[usize],
        len: usize,
    ) -> Option<std::ops::Range<usize>> {
        let block_bytes = shared.block_size.bytes_u64();
        if self.at < len {
            let now = shared.faults_seen.load(Ordering::Relaxed);
            if now != self.faults {
                let latest = shared.latest_fault_block.load(Ordering::Relaxed);
                let place = position.get(latest as usize).copied().unwrap_or(usize::MAX);
                if place != usize::MAX && place >= self.at {
                    self.skipped.push(self.at..place);
                    self.at = place + 1;
                }
                self.chunk = Self::chunk_of(MIN_CHUNK_BYTES, block_bytes);
            } else {
                self.chunk = (self.chunk * 2).min(Self::chunk_of(MAX_CHUNK_BYTES, block_bytes));
            }
            self.faults = now;
            let end = (self.at + self.chunk).min(len);
            let range = self.at..end;
            self.at = end;
            if !range.is_empty() {
                return Some(range);
            }
        }
        // The skipped places, in order, in the largest chunks.
        let most = Self::chunk_of(MAX_CHUNK_BYTES, block_bytes);
        while let Some(first) = self.skipped.first_mut() {
            if first.start >= first.end {
                self.skipped.remove(0);
                continue;
            }
            let end = (first.start + most).min(first.end);
            let range = first.start..end;
            first.start = end;
            return Some(range);
        }
        None
    }
}
