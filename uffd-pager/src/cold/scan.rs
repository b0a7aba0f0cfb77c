//! The scanner: its thread's loop under the CPU budget, and one scan: which blocks are cold
//! (probed and not touched since, for the cold age in force), compressed into the pool and
//! dropped from guest RAM; anon RAM's written pages, tracked and put back when a block will not
//! compress.

use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use compressed_backing::PutOutcome;

use super::*;
use crate::addr::{HostRange, PAGE_SIZE};
use crate::pagemap::WrittenPages;
use crate::pager::{RamKind, Shared};
use crate::state::PageState;

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
pub(crate) fn run(shared: &Shared, cold: &State) {
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
        let began = cold.epoch();
        cold.scan_begins(began);
        if cold.config.scan || cold.order_pending() {
            scan(shared, cold, &mut buf);
        }
        cold.scan_ended(began);
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
        // Stay within the budget: the scan's CPU time over the whole cycle; but a governor's
        // order under memory pressure is carried out at once (CPU is what the host has left).
        let cycle = if cold.order_pending() {
            period
        } else {
            period.max(used.div_f64(budget))
        };
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
    cold: &State,
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

fn scan(shared: &Shared, cold: &State, buf: &mut [u8]) {
    let per_block = shared.block_size.pages() as u64;
    let epoch = cold.epoch();
    let cold_age = cold.age_ticks(epoch);
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
        if cold.stop.load(Ordering::Relaxed) || shared.evictions_held() {
            return;
        }
        let first = block as u64 * per_block;
        let pages = first..(first + per_block).min(shared.table.len());
        // Whole blocks of one region only (the pool keeps whole blocks).
        let Some(region) = shared.region_of_page(first) else {
            continue;
        };
        if pages.end - pages.start != per_block
            || !region.pages().contains(&(pages.end - 1))
            || info.backoff_until.load(Ordering::Relaxed) > epoch
            || !shared.table.all(pages.clone(), PageState::Resident)
        {
            continue;
        }
        if region.spec.kind == RamKind::Anon && !tracking_anon {
            continue;
        }
        let flags = info.flags.load(Ordering::Acquire);
        let since = epoch.saturating_sub(info.probed_at.load(Ordering::Relaxed));
        if flags & ACCESSED != 0 && since < cold_age {
            // Touched lately: in use; look again later.
            continue;
        }
        if flags & PROBING == 0 || flags & ACCESSED != 0 {
            // Watch it (again). Anon RAM: its writes show in the next scans.
            info.flags.store(PROBING, Ordering::Release);
            info.probed_at.store(epoch, Ordering::Relaxed);
            if region.spec.kind.is_memfd() {
                let range = HostRange::new(region.addr_of(first), per_block * PAGE_SIZE)
                    .expect("pages of a region");
                // SAFETY: our own shared memfd mapping: the page cache keeps every byte; only
                // the page-table entries go, and the next access is a MINOR fault to the pager.
                // A block whose probe failed may stay mapped, so its accesses would not be
                // seen: it is marked accessed, which is to say in use.
                if unsafe { crate::discard::unmap_shared(range) }.is_err() {
                    info.flags.store(PROBING | ACCESSED, Ordering::Release);
                }
            }
            cold.probed.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        if since < cold_age {
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

/// See [`super::Cold::compress_now`].
pub(super) fn compress_now(shared: &Shared, cold: &State, range: HostRange) -> u64 {
    let per_block = shared.block_size.pages() as u64;
    let mut buf = vec![0u8; shared.block_size.bytes()];
    let mut pooled = 0;
    let Some((region, blocks)) = shared.whole_blocks(range) else {
        return 0;
    };
    for block in blocks {
        let pages = block * per_block..(block + 1) * per_block;
        if !shared.table.all(pages.clone(), PageState::Resident)
            || (region.spec.kind == RamKind::Anon && cold.scratch.is_none())
        {
            continue;
        }
        let info = &cold.blocks[block as usize];
        if region.spec.kind.is_memfd() {
            // Probed as the scanner probes: an access from here on faults and marks the
            // block, and `compress` then leaves it.
            let at = HostRange::new(region.addr_of(pages.start), per_block * PAGE_SIZE)
                .expect("pages of a region");
            // SAFETY: as in `scan`: our own shared memfd mapping; only its page-table entries
            // go, and the next access is a MINOR fault to the pager.
            if unsafe { crate::discard::unmap_shared(at) }.is_err() {
                continue;
            }
        }
        // Anon RAM: a write meanwhile shows when the moved-out pages are compared.
        info.flags.store(PROBING, Ordering::Release);
        info.probed_at.store(cold.epoch(), Ordering::Relaxed);
        compress(shared, cold, region, block, pages.clone(), &mut buf);
        if shared.table.all(pages, PageState::Pooled) {
            pooled += per_block * PAGE_SIZE;
        }
    }
    pooled
}

fn compress(
    shared: &Shared,
    cold: &State,
    region: &crate::pager::Region,
    block: u64,
    pages: std::ops::Range<u64>,
    buf: &mut [u8],
) {
    // One block at a time, and only a block still wholly resident: the scanner may have
    // checked it before `compress_now` took it (or the other way round).
    let _turn = cold.compressing.lock();
    // And not while a reader holds the block: a fault or a fill that read its pooled bytes
    // before a discard must not find it pooled again, with other bytes, when it installs.
    let Some(_claim) = shared.claim_fetch(block) else {
        return;
    };
    if !shared.table.all(pages.clone(), PageState::Resident) {
        return;
    }
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
    let write = shared.table.write();
    if shared.evictions_held() {
        let _ = cold.pool.remove(block);
        return;
    }
    // No access may have completed since the probe (each one faults and marks the block
    // first), and every page must still be resident: otherwise the pool holds stale bytes.
    if info.flags.load(Ordering::Acquire) != PROBING
        || !shared.table.all(pages.clone(), PageState::Resident)
    {
        let _ = cold.pool.remove(block);
        cold.raced.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let dropped = match &region.spec.memfd {
        Some(memfd) => {
            let offset = region.spec.memfd_offset + (pages.start - region.first_page) * PAGE_SIZE;
            shared.table.pooled(&write, pages.clone());
            // On failure the block is still in the page cache: it stays resident.
            let range = HostRange::new(at, buf.len() as u64).expect("a block of the region");
            // SAFETY: the block's bytes are in the pool, and no access completed since its
            // probe (checked above): the next touch faults and decompresses them.
            let punched = unsafe {
                crate::discard::discard(region.spec.kind, range, Some((memfd.as_ref(), offset)))
            }
            .is_ok();
            if !punched {
                shared.table.unpooled(&write, pages);
            }
            punched
        }
        None => drop_anon(shared, &write, cold, info, at, pages, buf),
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
fn back_off(cold: &State, info: &BlockInfo) {
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
    write: &crate::pager::table::Write<'_>,
    cold: &State,
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
        shared.table.pooled(write, pages);
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
    pub(super) fn new(shared: &Shared) -> Result<Self, ColdError> {
        let len = shared.block_size.bytes();
        let map = memmap2::MmapMut::map_anon(len).map_err(ColdError::Scratch)?;
        let range = HostRange::new(crate::addr::HostAddr(map.as_ptr() as u64), len as u64)
            .expect("an anon mapping is page-aligned");
        // SAFETY: the mapping lives as long as the cold state, which the pager keeps (as its
        // access observer) as long as its userfaultfd; only `drop_anon` fills it (with moved
        // pages) and it empties it again.
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
            if let Err(e) = shared
                .uffd
                .copy_missing(rest, bytes, basics::PageSize::BASE, true)
            {
                tracing::error!("cold compression: cannot put a block back at {rest}: {e}");
            }
        }
        self.clear();
    }
}
