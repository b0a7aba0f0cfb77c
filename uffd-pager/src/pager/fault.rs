//! Fault resolution: the fault threads' loop (poll, read events under the write side of the
//! layout lock, apply `REMOVE` events), and resolving a fault under the read side: the page's
//! state, the resident limit's admission, the block fetched outside any lock, installed with
//! one ioctl where the whole block may be, the state updated, the waiters woken.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::table::{Read, Write};
use super::*;
use crate::addr::{HostAddr, HostRange, PAGE_SIZE};
use crate::limit::Reservation;
use crate::source::{Content, PageSource};
use crate::state::PageState;
use crate::uffd::{Event, UffdError};

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
    /// It waits for another thread's read of its block (counted in `Fetches::waiting`).
    busy: bool,
    /// It has waited for another thread's read (counted once in `fetch_waits`).
    waited: bool,
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
    /// Another thread (the prefetcher) is reading the block: try again once it is done.
    Busy,
}

/// How long a fault thread with only held faults waits for an event before it looks again
/// (a raised limit or a discard wakes it at once; an offload that frees room does not).
const HELD_POLL_MS: i32 = 5;

impl Shared {
    /// A fault thread: poll, read events, resolve, until `stop_fd` is signalled.
    pub(super) fn serve(&self) {
        let mut events = Vec::with_capacity(64);
        let mut pending: Vec<Pending> = Vec::new();
        let mut storage = Vec::new();
        let buf = aligned_block(&mut storage, self.block_size.bytes());
        let mut repeat = (HostAddr(0), 0u32);
        // Held faults: the shortfall last reported, and whether a report is due.
        let mut reported_shortfall = 0;
        let mut report_due = false;
        let mut only_held = false;
        loop {
            let timeout = match (pending.is_empty(), only_held) {
                // Blocks queued to read ahead: filled between polls that do not wait.
                (true, _) if self.stride_queued() => 0,
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
                let write = self.table.write();
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
                            if !minor {
                                self.stride_fault(addr);
                            }
                            pending.push(Pending {
                                addr,
                                minor,
                                since: Instant::now(),
                                held: 0,
                                held_since: None,
                                busy: false,
                                waited: false,
                            });
                        }
                        Event::Remove { start, end } | Event::Unmap { start, end } => {
                            if !self.apply_remove(&write, start, end) {
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
                if std::mem::take(&mut fault.busy) {
                    self.fetches.waiting.fetch_sub(1, Ordering::Relaxed);
                }
                let result = if repeat.1 > 10_000 {
                    Err(FaultError::Lost { addr: fault.addr })
                } else {
                    self.resolve(fault.addr, fault.minor, fault.since, buf)
                };
                match result {
                    Ok(Attempt::Resolved) => {
                        self.fault_done();
                        if let Some(at) = fault.held_since {
                            let us = u64::try_from(at.elapsed().as_micros()).unwrap_or(u64::MAX);
                            self.metrics.held_us.fetch_add(us, Ordering::Relaxed);
                        }
                        if !fault.minor {
                            self.restore_ahead(fault.addr, buf);
                        }
                    }
                    Ok(Attempt::Retry) => {
                        self.metrics.eagain_retries.fetch_add(1, Ordering::Relaxed);
                        retry.push(fault);
                    }
                    Ok(Attempt::Busy) => {
                        if !std::mem::replace(&mut fault.waited, true) {
                            self.metrics.fetch_waits.fetch_add(1, Ordering::Relaxed);
                        }
                        fault.busy = true;
                        self.fetches.waiting.fetch_add(1, Ordering::Relaxed);
                        // Not a repeat: the page is on its way.
                        repeat = (HostAddr(0), 0);
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
                        self.fault_done();
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
                let shortfall = self.limit.shortfall(self.table.resident());
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
            // Nothing left to retry but faults on blocks another thread installs (their
            // install wakes them): one block read ahead, if any is queued, before the next
            // poll (which does not wait while more are).
            if retry.iter().all(|f| f.busy) {
                self.stride_step(buf);
            }
            pending = retry;
        }
    }

    /// Wakes the fault threads (they return if `stopping` is set, else retry held faults).
    pub(super) fn signal(&self) {
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
    pub(crate) fn apply_remove(&self, held: &Write<'_>, start: HostAddr, end: HostAddr) -> bool {
        let mut touched = false;
        for region in &self.regions {
            let Some((lo, hi)) = region.spec.range.clip(start, end) else {
                continue;
            };
            // A discard of huge pages covers whole ones (the kernel's are aligned; the VMM
            // rounds its own inward): the part of one that a range only grazes stays.
            let per_unit = region.spec.kind.page_size().bytes() / PAGE_SIZE;
            let (lo, hi) = (lo.div_ceil(per_unit) * per_unit, hi / per_unit * per_unit);
            if !touched {
                touched = true;
                self.metrics.remove_events.fetch_add(1, Ordering::Relaxed);
            }
            let pages = region.first_page + lo..region.first_page + hi.max(lo);
            let per_block = self.block_size.pages() as u64;
            self.together
                .forget_inside(pages.start.div_ceil(per_block)..pages.end / per_block);
            if self.table.discarded(held, pages.clone()) {
                // An offload waits for these (its own discards' events).
                let _ordered = self.dropped_lock.lock();
                self.dropped.notify_all();
            }
            // Released pooled blocks leave the pool at once.
            if let (Some(pool), false) = (self.pool.get(), pages.is_empty()) {
                for block in pages.start / per_block..=(pages.end - 1) / per_block {
                    let span = self.block_span(region, block * per_block);
                    if !self.table.any(span, PageState::Pooled) {
                        let _ = pool.remove(block);
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
        if minor && self.table.get(page) != PageState::Pooled {
            return self.resolve_minor(region, page, since).map_err(install);
        }
        loop {
            let state = self.table.get(page);
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
                    let one = region.unit_span(page);
                    let one = HostRange::new(region.addr_of(one.start), count_bytes(&one))
                        .expect("one page");
                    self.metrics.fault_latency.record(since.elapsed());
                    self.uffd.wake(one).map_err(install)?;
                    self.metrics.eexist_races.fetch_add(1, Ordering::Relaxed);
                    return Ok(Attempt::Resolved);
                }
                PageState::Zero => {
                    let read = self.table.read();
                    if self.table.get(page) != state {
                        continue;
                    }
                    self.check_unit(region, page, state, addr)?;
                    return self
                        .install(&read, region, page, state, None, since, max_pages)
                        .map_err(install);
                }
                // Every tier is a page source: the restore image, the offload store, the
                // memory pool of cold compression.
                PageState::Source | PageState::Stored | PageState::Pooled => {
                    let source: Option<&dyn PageSource> = match state {
                        PageState::Source => self.restore.as_deref(),
                        PageState::Stored => Some(&self.store),
                        _ => self.pool.get().map(|pool| &**pool as &dyn PageSource),
                    };
                    let source = source.ok_or(FaultError::NoSource { addr })?;
                    let span = self.block_span(region, page);
                    let block = self.block_size.index_of(span.start * PAGE_SIZE);
                    // One reader per block: if the prefetcher reads it now, wait for that.
                    let Some(_fetch) = self.claim_fetch(block) else {
                        return Ok(Attempt::Busy);
                    };
                    self.metrics.blocks_fetched.fetch_add(1, Ordering::Relaxed);
                    let offset = self
                        .block_size
                        .offset_of(block)
                        .expect("block of the image");
                    let len = self.block_size.len_in_image(block, self.image_size);
                    let mut decompressed = 0;
                    // A huge page has no zero page to map (zeros are copied like the rest),
                    // so its bytes need no look: where the source maps them, they are
                    // installed straight from its mapping, with no copy into `buf` first.
                    let mapped = (region.spec.kind.page_size() != PageSize::BASE)
                        .then(|| source.mapped(offset, len))
                        .flatten();
                    let content = match mapped {
                        Some(_) => Content::Data,
                        None => source
                            .read(offset, &mut buf[..len], &mut decompressed)
                            .map_err(|source| FaultError::Source { addr, source })?,
                    };
                    self.metrics
                        .bytes_decompressed
                        .fetch_add(decompressed, Ordering::Relaxed);
                    let read = self.table.read();
                    if self.table.get(page) != state {
                        // Installed by another thread or discarded meanwhile: look again.
                        continue;
                    }
                    self.check_unit(region, page, state, addr)?;
                    let data = match (content, &mapped) {
                        (Content::Zero, _) => None,
                        (Content::Data, Some(window)) => {
                            Some((offset / PAGE_SIZE, window.for_kernel()))
                        }
                        (Content::Data, None) => Some((offset / PAGE_SIZE, &buf[..len])),
                    };
                    if state == PageState::Pooled {
                        let attempt = self
                            .install(&read, region, page, state, data, since, max_pages)
                            .map_err(install)?;
                        // Once none of its pages is pooled, the block leaves the pool.
                        if matches!(attempt, Attempt::Resolved) && !self.table.any(span, state) {
                            if let Some(pool) = self.pool.get() {
                                let _ = pool.remove(block);
                            }
                            if let Some(observer) = self.observer.get() {
                                observer.promoted(block);
                            }
                        }
                        return Ok(attempt);
                    }
                    // A block of a resume's working set. Recorded before the install wakes
                    // the faulting thread, so that an offload right after sees it.
                    self.working_set.record(block);
                    return self
                        .install(&read, region, page, state, data, since, max_pages)
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
        let read = self.table.read();
        // Cold compression may have dropped the block between the caller's look and this
        // lock: its page cache is gone (a CONTINUE would fail), and the pool has its bytes.
        if self.table.get(page) == PageState::Pooled {
            return Ok(Attempt::Retry);
        }
        let span = self.block_span(region, page);
        let unit = region.unit_span(page);
        let pages =
            if self.observer.get().is_some() && self.table.all(span.clone(), PageState::Resident) {
                span
            } else {
                unit.clone()
            };
        // Whatever it maps, the block is in use: cold compression must not take it on the
        // strength of its probe (marked before the pages are reachable, and again after).
        self.touch_blocks(&pages);
        let range = HostRange::new(region.addr_of(pages.start), count_bytes(&pages))
            .expect("pages of a region");
        match self
            .uffd
            .continue_missing(range, region.spec.kind.page_size(), false)
        {
            Ok(_) => {}
            Err(UffdError::Retry { .. }) => return Ok(Attempt::Retry),
            Err(e) => return Err(e),
        }
        // Marked again once mapped, as in `install_run`.
        self.touch_blocks(&pages);
        self.table.mapped(&read, unit);
        self.metrics.faults_minor.fetch_add(1, Ordering::Relaxed);
        self.metrics.fault_latency.record(since.elapsed());
        self.uffd.wake(range)?;
        Ok(Attempt::Resolved)
    }

    /// Reserves room under the resident limit for what a fault on `page` (in `state`, not
    /// resident) installs: its block span if all of the span is in `state`, else the page
    /// alone (its huge page, in hugetlb RAM); if the span does not fit, the page alone.
    /// Without a limit, one relaxed load and an empty reservation. `Err(pages)`: no room for
    /// it, which would install `pages`.
    fn admit(&self, region: &Region, page: u64, state: PageState) -> Result<Reservation<'_>, u64> {
        if !self.limit.is_set() {
            return Ok(Reservation::unlimited());
        }
        let span = self.block_span(region, page);
        let unit = region.unit_span(page);
        let unit = unit.end - unit.start;
        let wanted = if self.table.all(span.clone(), state) {
            span.end - span.start
        } else {
            unit
        };
        let resident = self.table.resident();
        self.limit
            .reserve(resident, wanted)
            .or_else(|| {
                (wanted > unit)
                    .then(|| self.limit.reserve(resident, unit))
                    .flatten()
            })
            .ok_or(wanted)
    }

    /// Checks that the huge page holding `page` (in `state`, not resident) has no page in
    /// another state that is not resident either: its bytes would be overwritten by the
    /// install of the whole huge page. Every install, drop and discard of hugetlb RAM covers
    /// whole huge pages, so this never fails; if it did, the fault is refused, never served
    /// with bytes that are not the page's. Called under the read lock.
    fn check_unit(
        &self,
        region: &Region,
        page: u64,
        state: PageState,
        addr: HostAddr,
    ) -> Result<(), FaultError> {
        let unit = region.unit_span(page);
        if unit.end - unit.start > 1
            && unit.clone().any(|p| {
                let other = self.table.get(p);
                other != state && !other.is_resident()
            })
        {
            return Err(FaultError::Torn { addr });
        }
        Ok(())
    }

    /// Installs the block span of `page` if all its pages are in `state` and it has at most
    /// `max_pages` pages, else the page alone: from `data` (first image page of the buffer,
    /// bytes) or as zero pages. Marks what it installed resident. Called under the read lock.
    #[allow(
        clippy::too_many_arguments,
        reason = "the fault's facts, each of its own kind"
    )]
    fn install(
        &self,
        held: &Read<'_>,
        region: &Region,
        page: u64,
        state: PageState,
        data: Option<(u64, &[u8])>,
        since: Instant,
        max_pages: u64,
    ) -> Result<Attempt, UffdError> {
        let span = self.block_span(region, page);
        let pages = if span.end - span.start <= max_pages && self.table.all(span.clone(), state) {
            span
        } else {
            region.unit_span(page)
        };
        Ok(
            match self.install_run(held, region, pages, state, data, Some(since))? {
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
        held: &Read<'_>,
        region: &Region,
        pages: std::ops::Range<u64>,
        state: PageState,
        data: Option<(u64, &[u8])>,
        fault: Option<Instant>,
    ) -> Result<Option<u64>, UffdError> {
        let count = pages.end - pages.start;
        let range = HostRange::new(region.addr_of(pages.start), count * PAGE_SIZE)
            .expect("pages of a region");
        let page_size = region.spec.kind.page_size();
        // Mapped pages are reached without a fault from now on: to cold compression that is
        // an access of their blocks, said before they are mapped. Otherwise a block probed,
        // then discarded and installed again, would still look untouched since its probe, and
        // a write to it while it is being compressed would be lost.
        self.touch_blocks(&pages);
        // Install without waking, so that states and counters are up to date before the
        // faulting thread runs on (an offload right after must see the page resident).
        let result = match data {
            // Huge pages have no zero page to map: zeros are copied.
            None if page_size != PageSize::BASE => self.uffd.copy_missing(
                range.start(),
                &zeros()[..range.len() as usize],
                page_size,
                false,
            ),
            None => self.uffd.zeropage_missing(range, false),
            Some((buf_page, bytes)) => {
                let from = ((pages.start - buf_page) * PAGE_SIZE) as usize;
                let src = &bytes[from..from + (count * PAGE_SIZE) as usize];
                self.uffd.copy_missing(range.start(), src, page_size, false)
            }
        };
        let filled = match result {
            Ok(filled) => filled / PAGE_SIZE,
            Err(UffdError::Retry { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        // And again once they are mapped: a re-probe that ran meanwhile (it marks the block
        // probed, then unmaps it, without the lock) may have overwritten the first mark before
        // this install mapped the pages; this one it cannot, or its unmapping comes after.
        self.touch_blocks(&pages);
        self.table.installed(held, pages, state);
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

    /// Tells cold compression (if it runs) that the blocks of `pages` are being mapped: an
    /// access. Called under the read side of the layout lock, before and after the mapping.
    fn touch_blocks(&self, pages: &std::ops::Range<u64>) {
        if let (Some(observer), false) = (self.observer.get(), pages.is_empty()) {
            let per_block = self.block_size.pages() as u64;
            for block in pages.start / per_block..=(pages.end - 1) / per_block {
                observer.touched(block);
            }
        }
    }

    /// The region holding image page `page`, if any (the image may have gaps).
    pub(crate) fn region_of_page(&self, page: u64) -> Option<&Region> {
        self.regions.iter().find(|r| r.pages().contains(&page))
    }
}

/// Bytes of the image pages `pages`.
/// A buffer of `len` bytes in `storage`, page-aligned: `UFFDIO_COPY` copies whole pages
/// from it at the kernel's best speed, where a heap block of 2 MiB starts 16 bytes into a page.
pub(super) fn aligned_block(storage: &mut Vec<u8>, len: usize) -> &mut [u8] {
    let align = PAGE_SIZE as usize;
    *storage = vec![0u8; len + align];
    let start = storage.as_ptr().align_offset(align);
    &mut storage[start..start + len]
}

fn count_bytes(pages: &std::ops::Range<u64>) -> u64 {
    (pages.end - pages.start) * PAGE_SIZE
}

/// Zeros to copy into huge pages, as long as the largest block. Untouched, so that its pages
/// stay the kernel's shared zero page: it costs no memory.
fn zeros() -> &'static [u8] {
    static ZEROS: std::sync::OnceLock<Box<[u8]>> = std::sync::OnceLock::new();
    ZEROS.get_or_init(|| {
        vec![0u8; usize::try_from(compressed_backing::layout::MAX_BLOCK_SIZE).expect("2 MiB")]
            .into_boxed_slice()
    })
}
