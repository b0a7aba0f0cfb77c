//! Installing pages before the guest faults on them: a block filled from its tier without a
//! fault (the prefetcher's and an eager load's unit, and the two uses below), ranges that come
//! back together, and ranges populated ahead.
//!
//! A range marked [`Pager::restore_together`] (a phase arena the guest closed as `survive`,
//! whose next reader reads all of it) comes back whole once the guest touches it: each fault
//! on one of its blocks is served first, then the fault thread installs up to
//! [`AHEAD_BLOCKS`] more of the range's pooled or stored blocks before it reads the next
//! events. A pass over the range costs one fault per [`AHEAD_BLOCKS`] blocks instead of one
//! per block (a fault is tens of microseconds on a nested host, a block's install a few).
//!
//! [`Pager::populate`] installs the zero pages of a range at once (an arena the guest just
//! opened, which it fills next): one install per block and no fault.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use basics::PageSize;
use parking_lot::Mutex;

use super::{Pager, Shared};
use crate::addr::{HostAddr, HostRange, PAGE_SIZE};
use crate::load::{Busy, LoadError, LIMIT_WAIT};
use crate::source::{Content, PageSource};
use crate::state::PageState;

/// Blocks a fault thread installs ahead after a fault in a range marked to come back together.
pub const AHEAD_BLOCKS: usize = 32;

/// At most this many ranges are marked at once; marking one more forgets the oldest.
const MAX_TOGETHER: usize = 256;

/// The ranges marked to come back together, as block ranges.
#[derive(Debug, Default)]
pub(crate) struct Together {
    /// How many are marked (read without the lock on every fault).
    count: AtomicUsize,
    ranges: Mutex<Vec<Range<u64>>>,
}

impl Together {
    fn mark(&self, blocks: Range<u64>) {
        let mut ranges = self.ranges.lock();
        ranges.retain(|r| r.end <= blocks.start || r.start >= blocks.end);
        if ranges.len() >= MAX_TOGETHER {
            ranges.remove(0);
        }
        ranges.push(blocks);
        self.count.store(ranges.len(), Ordering::Relaxed);
    }

    /// Forgets the ranges that lie wholly inside `blocks` (discarded: nothing to bring back).
    pub(crate) fn forget_inside(&self, blocks: Range<u64>) {
        if self.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut ranges = self.ranges.lock();
        ranges.retain(|r| r.start < blocks.start || r.end > blocks.end);
        self.count.store(ranges.len(), Ordering::Relaxed);
    }

    fn forget(&self, blocks: &Range<u64>) {
        let mut ranges = self.ranges.lock();
        ranges.retain(|r| r != blocks);
        self.count.store(ranges.len(), Ordering::Relaxed);
    }

    /// The marked range holding `block`.
    fn holding(&self, block: u64) -> Option<Range<u64>> {
        if self.count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        self.ranges
            .lock()
            .iter()
            .find(|r| r.contains(&block))
            .cloned()
    }

    /// Ranges marked now.
    pub(crate) fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }
}

impl Shared {
    /// Installs every page of `block` in state `from` (`Source`, `Stored`, `Pooled` or `Zero`) from its
    /// tier, waiting for room under the resident limit unless `stop` says to give up; returns
    /// the pages filled. A block that a fault thread is reading is left to it (`Busy::Pass`)
    /// or waited for (`Busy::Wait`, an eager load, which returns when everything is in).
    pub(crate) fn fill_block(
        &self,
        block: u64,
        from: PageState,
        buf: &mut [u8],
        busy: Busy,
        stop: &dyn Fn() -> bool,
    ) -> Result<u64, LoadError> {
        let per_block = self.block_size.pages() as u64;
        let first = block * per_block;
        let block_pages = first..(first + per_block).min(self.table.len());
        if !self.table.any(block_pages.clone(), from) {
            return Ok(0);
        }
        let mut _claim = Some(loop {
            match self.claim_fetch(block) {
                Some(fetch) => break fetch,
                None if busy == Busy::Pass || stop() => return Ok(0),
                None => std::thread::sleep(Duration::from_micros(50)),
            }
        });
        // Another thread may have installed it before giving the claim back.
        if !self.table.any(block_pages.clone(), from) {
            return Ok(0);
        }
        let source: Option<&dyn PageSource> = match from {
            PageState::Source => match self.restore.as_deref() {
                Some(restore) => Some(restore),
                None => return Ok(0),
            },
            PageState::Stored => Some(&self.store),
            PageState::Pooled => match self.pool.get() {
                Some(pool) => Some(&**pool),
                None => return Ok(0),
            },
            _ => None,
        };
        let data = match source {
            None => None,
            Some(source) => {
                self.metrics.blocks_fetched.fetch_add(1, Ordering::Relaxed);
                let offset = block * self.block_size.bytes_u64();
                let len = self.block_size.len_in_image(block, self.image_size);
                let mut decompressed = 0;
                let content = source
                    .read(offset, &mut buf[..len], &mut decompressed)
                    .map_err(|source| LoadError::Source { block, source })?;
                self.metrics
                    .bytes_decompressed
                    .fetch_add(decompressed, Ordering::Relaxed);
                match content {
                    Content::Zero => None,
                    Content::Data => Some((first, &buf[..len])),
                }
            }
        };
        let mut filled = 0;
        'retry: loop {
            let read = self.table.read();
            for region in &self.regions {
                let pages = region.pages();
                let (lo, hi) = (
                    block_pages.start.max(pages.start),
                    block_pages.end.min(pages.end),
                );
                let mut page = lo;
                while page < hi {
                    if self.table.get(page) != from {
                        page += 1;
                        continue;
                    }
                    let start = page;
                    while page < hi && self.table.get(page) == from {
                        page += 1;
                    }
                    let Some(_room) = self.limit.reserve(self.table.resident(), page - start)
                    else {
                        drop(read);
                        // Not while holding the block: a fault on it must be able to take it
                        // and be held at the limit itself, which asks for the room.
                        _claim = None;
                        if stop() {
                            return Ok(filled);
                        }
                        std::thread::sleep(LIMIT_WAIT);
                        match self.claim_fetch(block) {
                            Some(again) => _claim = Some(again),
                            // A fault thread reads and installs it now.
                            None => return Ok(filled),
                        }
                        continue 'retry;
                    };
                    match self
                        .install_run(&read, region, start..page, from, data, None)
                        .map_err(|source| LoadError::Install { block, source })?
                    {
                        Some(n) => filled += n,
                        None => {
                            // A discard is pending: let a fault thread read it, then go on.
                            drop(read);
                            std::thread::sleep(Duration::from_micros(50));
                            continue 'retry;
                        }
                    }
                }
            }
            break;
        }
        // Once none of its pages is pooled, the block leaves the pool (as after a fault).
        if from == PageState::Pooled && !self.table.any(block_pages, PageState::Pooled) {
            if let Some(pool) = self.pool.get() {
                let _ = pool.remove(block);
            }
            if let Some(observer) = self.observer.get() {
                observer.promoted(block);
            }
        }
        Ok(filled)
    }

    /// After a fault at `addr` was served: if its block is in a range marked to come back
    /// together, installs up to [`AHEAD_BLOCKS`] more of that range's pooled or stored
    /// blocks (those after it first), and forgets the range once nothing of it is left out.
    /// Never waits: a block another thread reads, or one without room under the resident
    /// limit, is left to its own fault.
    pub(super) fn restore_ahead(&self, addr: HostAddr, buf: &mut [u8]) {
        if self.together.len() == 0 {
            return;
        }
        let Some(region) = self.locate(addr) else {
            return;
        };
        let page = region.first_page + region.spec.range.page_index(addr).expect("located");
        let block = self.block_size.index_of(page * PAGE_SIZE);
        let Some(range) = self.together.holding(block) else {
            return;
        };
        let per_block = self.block_size.pages() as u64;
        let pages = self.table.len();
        let out = |b: u64| {
            let span = b * per_block..((b + 1) * per_block).min(pages);
            [PageState::Pooled, PageState::Stored]
                .into_iter()
                .filter(|&s| self.table.any(span.clone(), s))
                .collect::<Vec<_>>()
        };
        let mut installed = 0;
        let mut left = false;
        for b in (block + 1..range.end).chain(range.start..block) {
            let states = out(b);
            if states.is_empty() {
                continue;
            }
            if installed == AHEAD_BLOCKS {
                left = true;
                break;
            }
            for from in states {
                match self.fill_block(b, from, buf, Busy::Pass, &|| true) {
                    Ok(n) if n > 0 => {
                        self.metrics.ahead_pages.fetch_add(n, Ordering::Relaxed);
                    }
                    Ok(_) => left = true,
                    // Left to its own fault, which reports the error.
                    Err(_) => left = true,
                }
            }
            installed += 1;
        }
        if !left && out(block).is_empty() {
            self.together.forget(&range);
        }
    }
}

impl Pager {
    /// Marks the whole blocks of `range` to come back together: once the guest faults on one
    /// of them, the rest are installed ahead of its next faults (see the module
    /// documentation). The mark goes when all of it is back or discarded, or when a range
    /// overlapping it is marked.
    pub fn restore_together(&self, range: HostRange) {
        let shared = self.shared();
        if let Some((_, blocks)) = shared.whole_blocks(range) {
            if !blocks.is_empty() {
                shared.together.mark(blocks);
            }
        }
    }

    /// Installs the zero pages of `range`'s whole blocks now (as zeros: what a fault would
    /// install), where RAM has base pages; returns the pages installed. Never waits: a block
    /// without room under the resident limit, or one being read, is left to its faults.
    pub fn populate(&self, range: HostRange) -> Result<u64, LoadError> {
        let shared = self.shared();
        let Some((region, blocks)) = shared.whole_blocks(range) else {
            return Ok(0);
        };
        if region.spec.kind.page_size() != PageSize::BASE {
            return Ok(0);
        }
        let mut buf = Vec::new();
        let mut filled = 0;
        for block in blocks {
            filled += shared.fill_block(block, PageState::Zero, &mut buf, Busy::Pass, &|| true)?;
        }
        Ok(filled)
    }
}
