//! Reading ahead along the guest's stride, for RAM of huge pages whose blocks are decoded.
//!
//! A 2 MiB page from a compressed store costs about a millisecond to read and decode and a
//! fifth of that to install; the guest uses it in microseconds and faults on the next. Served
//! one fault at a time, the decode is all on the fault's path. Once three faults in a row have
//! stepped by the same stride (a pass over RAM, forward), the next [`WINDOW`] blocks along it
//! are queued as each fault arrives, before it is resolved, and read and installed by two
//! workers, one per core: the pager's read-ahead thread, and the fault thread itself whenever
//! it has no fault to serve (one block at a time, so a new fault waits at most one block). A
//! guest that goes on along its stride finds its pages installed, or being installed (its
//! fault waits for that claim and never reads the block twice), and the decode of one block
//! overlaps the install and use of others.
//!
//! Only where it pays: huge pages (a base page's block is decoded in microseconds), blocks in
//! the restore image or the offload store (not the memory pool), and sources that must be read
//! to be installed (a raw file is installed straight from its mapping at copy speed). A wrong
//! guess costs at most [`WINDOW`] blocks installed that the guest did not ask for, under the
//! resident limit like any install; a fault off the stride stops it until three faults agree
//! again.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use basics::PageSize;
use parking_lot::{Condvar, Mutex};

use super::Shared;
use crate::addr::{HostAddr, PAGE_SIZE};
use crate::load::Busy;
use crate::source::PageSource;
use crate::state::PageState;

/// Largest stride (blocks) followed: beyond it the faults are taken as unrelated.
const MAX_STRIDE: u64 = 64;

/// Blocks queued ahead of a fault along the stride (16 MiB of 2 MiB pages).
pub(crate) const WINDOW: u64 = 8;

/// The stride seen in the faults, and the blocks queued ahead of them.
#[derive(Debug, Default)]
pub(crate) struct Stride {
    /// Some RAM is of huge pages: read-ahead can serve (else the fault threads skip it all,
    /// with no lock taken on their path).
    enabled: bool,
    seen: Mutex<Seen>,
    work: Mutex<Work>,
    /// Signalled when blocks are queued, when a fill ends, and to stop.
    changed: Condvar,
}

/// The faults seen so far.
#[derive(Debug, Default)]
struct Seen {
    /// The block of the latest fault.
    last: Option<u64>,
    /// The latest step.
    step: u64,
    /// How many steps in a row were `step` (a fault past blocks read ahead counts as one).
    repeats: u32,
}

/// Blocks to read ahead, and who reads them.
#[derive(Debug, Default)]
struct Work {
    queue: VecDeque<(u64, PageState)>,
    /// Blocks being filled now.
    filling: u32,
    /// Read-ahead is held (an offload runs): nothing is queued.
    held: u32,
    stop: bool,
}

impl Stride {
    /// Read-ahead for a pager whose RAM has huge pages if `enabled`, else none.
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            ..Self::default()
        }
    }
}

impl Seen {
    /// Counts a fault at `block`; the stride once three faults in a row agree on it. A fault
    /// further along the stride, past blocks read ahead, agrees too; a second fault on the
    /// latest block changes nothing.
    fn fault(&mut self, block: u64) -> Option<u64> {
        let Some(last) = self.last else {
            self.last = Some(block);
            return None;
        };
        if block == last {
            return (self.repeats >= 2).then_some(self.step);
        }
        let step = block
            .checked_sub(last)
            .filter(|step| (1..=MAX_STRIDE * (WINDOW + 1)).contains(step));
        let along = |step: u64| {
            self.repeats >= 2 && step.is_multiple_of(self.step) && step / self.step <= WINDOW + 1
        };
        match step {
            Some(step) if step == self.step || along(step) => {
                self.repeats = self.repeats.saturating_add(1);
            }
            Some(step) if step <= MAX_STRIDE => {
                self.step = step;
                self.repeats = 1;
            }
            _ => {
                self.step = 0;
                self.repeats = 0;
            }
        }
        self.last = Some(block);
        (self.repeats >= 2).then_some(self.step)
    }
}

/// Holds read-ahead off while an offload runs (see [`Shared::hold_stride`]); let go on drop.
pub(crate) struct StrideHold<'a>(&'a Shared);

impl Drop for StrideHold<'_> {
    fn drop(&mut self) {
        self.0.stride.work.lock().held -= 1;
    }
}

impl Shared {
    /// Whether read-ahead along a stride can serve this pager: some RAM is of huge pages.
    pub(super) fn wants_stride(&self) -> bool {
        self.stride.enabled
    }

    /// A fault at `addr` has arrived (first try): if the faults follow a stride, queues the
    /// next [`WINDOW`] blocks along it that wait in a tier worth reading ahead of.
    pub(super) fn stride_fault(&self, addr: HostAddr) {
        if !self.stride.enabled {
            return;
        }
        let Some(region) = self.locate(addr) else {
            return;
        };
        if region.spec.kind.page_size() == PageSize::BASE {
            return;
        }
        let page = region.first_page + region.spec.range.page_index(addr).expect("located");
        let block = self.block_size.index_of(page * PAGE_SIZE);
        let Some(step) = self.stride.seen.lock().fault(block) else {
            return;
        };
        let per_block = self.block_size.pages() as u64;
        let pages = region.pages();
        let queue: VecDeque<_> = (1..=WINDOW)
            .map(|i| block + i * step)
            .take_while(|b| (b + 1) * per_block <= pages.end)
            .filter_map(|b| {
                let span = b * per_block..(b + 1) * per_block;
                let state = self.table.get(span.start);
                self.decoded_source(state)?;
                self.table.all(span, state).then_some((b, state))
            })
            .collect();
        let mut work = self.stride.work.lock();
        if work.held == 0 && !work.stop {
            work.queue = queue;
            self.stride.changed.notify_all();
        }
    }

    /// The source of pages in `state` if reading ahead of it pays: one that must be read (and
    /// maybe decoded) to be installed.
    fn decoded_source(&self, state: PageState) -> Option<&dyn PageSource> {
        let source: &dyn PageSource = match state {
            PageState::Source => self.restore.as_deref()?,
            PageState::Stored => &self.store,
            _ => return None,
        };
        (!source.maps()).then_some(source)
    }

    /// Whether blocks are queued to read ahead (a fault thread then fills one between polls).
    pub(super) fn stride_queued(&self) -> bool {
        self.stride.enabled && !self.stride.work.lock().queue.is_empty()
    }

    /// Fills the next queued block, if any, into `buf`; whether one was taken.
    pub(super) fn stride_step(&self, buf: &mut [u8]) -> bool {
        if !self.stride.enabled {
            return false;
        }
        let mut work = self.stride.work.lock();
        let Some((block, state)) = work.queue.pop_front() else {
            return false;
        };
        work.filling += 1;
        drop(work);
        // An error is left to the block's own fault, which reports it.
        if let Ok(pages) = self.fill_block(block, state, buf, Busy::Pass, &|| true) {
            if pages > 0 {
                self.metrics
                    .stride_pages
                    .fetch_add(pages, Ordering::Relaxed);
                // Read for the guest's pass as a fault would have been: part of the working
                // set a later resume brings back first.
                self.working_set.record(block);
            }
        }
        self.stride.work.lock().filling -= 1;
        self.stride.changed.notify_all();
        true
    }

    /// The read-ahead thread: fills queued blocks until told to stop.
    pub(super) fn read_ahead(&self) {
        let mut storage = Vec::new();
        let buf = super::fault::aligned_block(&mut storage, self.block_size.bytes());
        loop {
            {
                let mut work = self.stride.work.lock();
                while work.queue.is_empty() && !work.stop {
                    self.stride.changed.wait(&mut work);
                }
                if work.stop {
                    return;
                }
            }
            self.stride_step(buf);
        }
    }

    /// Holds read-ahead off until the guard is dropped, once the blocks being filled are in:
    /// an offload stores newer bytes, which a fill read before it must not follow.
    pub(crate) fn hold_stride(&self) -> StrideHold<'_> {
        let mut work = self.stride.work.lock();
        work.held += 1;
        work.queue.clear();
        while work.filling > 0 {
            self.stride.changed.wait(&mut work);
        }
        StrideHold(self)
    }

    /// Tells the read-ahead thread to return.
    pub(super) fn stop_stride(&self) {
        self.stride.work.lock().stop = true;
        self.stride.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::Seen;

    #[test]
    fn seen_three_faults_in_step_give_the_stride() {
        let mut seen = Seen::default();
        assert_eq!(seen.fault(10), None);
        assert_eq!(seen.fault(14), None);
        assert_eq!(seen.fault(18), Some(4));
        assert_eq!(seen.fault(22), Some(4));
    }

    #[test]
    fn seen_broken_step_starts_over() {
        let mut seen = Seen::default();
        for block in [0, 2, 4] {
            seen.fault(block);
        }
        assert_eq!(seen.fault(7), None);
        assert_eq!(seen.fault(10), Some(3));
        // A second fault on the same block changes nothing.
        assert_eq!(seen.fault(10), Some(3));
        // Backwards, or too far: no stride.
        assert_eq!(seen.fault(2), None);
        assert_eq!(seen.fault(3), None);
        assert_eq!(seen.fault(3 + super::MAX_STRIDE + 1), None);
    }

    #[test]
    fn seen_fault_past_blocks_read_ahead_keeps_the_stride() {
        let mut seen = Seen::default();
        for block in [0, 2, 4] {
            seen.fault(block);
        }
        // The window's blocks were installed ahead: the next fault comes after them.
        let next = 4 + 2 * (super::WINDOW + 1);
        assert_eq!(seen.fault(next), Some(2));
        // Off the stride's steps: it starts over.
        assert_eq!(seen.fault(next + 3), None);
    }
}
