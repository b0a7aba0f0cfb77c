//! The flat per-page state table: one byte per 4 KiB page of the RAM image, read and written
//! with atomics from fault threads, the prefetcher and offload. No per-fault map lookups.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use crate::journal::Journal;

/// Where a page's bytes are right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[repr(u8)]
pub enum PageState {
    /// Not resident; reads as zeros (never touched, or discarded by the VMM).
    Zero = 0,
    /// Not resident; its bytes are in the image the VM was restored from.
    Source = 1,
    /// Not resident; its bytes are in the pager's offload store.
    Stored = 2,
    /// Mapped in the VM's memory.
    Resident = 3,
    /// Being dropped after a durable offload: resident until the drop completes, then
    /// `Stored`. A discard event for it is the pager's own drop, not a guest discard.
    Dropping = 4,
    /// Not resident; its block is compressed in the memory pool (cold compression).
    Pooled = 5,
}

impl PageState {
    fn from_u8(value: u8) -> Self {
        match value {
            0 => Self::Zero,
            1 => Self::Source,
            2 => Self::Stored,
            3 => Self::Resident,
            4 => Self::Dropping,
            _ => Self::Pooled,
        }
    }

    /// True if the page is mapped (or being dropped, which it still is).
    pub fn is_resident(self) -> bool {
        matches!(self, Self::Resident | Self::Dropping)
    }
}

/// Pages per state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StateCounts {
    /// Pages reading as zeros, not resident.
    pub zero: u64,
    /// Pages in the restore image, not resident.
    pub source: u64,
    /// Pages in the offload store, not resident.
    pub stored: u64,
    /// Pages mapped.
    pub resident: u64,
    /// Pages being dropped.
    pub dropping: u64,
    /// Pages compressed in the memory pool.
    pub pooled: u64,
}

/// One state byte per page.
#[derive(Debug)]
pub struct PageStates {
    states: Slots,
}

/// Where the state bytes live.
#[derive(Debug)]
enum Slots {
    Heap(Box<[AtomicU8]>),
    /// In a journal that outlives the process (see [`crate::journal`]).
    Journal(Arc<Journal>),
}

impl std::ops::Deref for Slots {
    type Target = [AtomicU8];

    fn deref(&self) -> &[AtomicU8] {
        match self {
            Self::Heap(slots) => slots,
            Self::Journal(journal) => journal.slots(),
        }
    }
}

impl PageStates {
    /// A table of `pages` pages, all in `initial`.
    pub fn new(pages: u64, initial: PageState) -> Self {
        Self {
            states: Slots::Heap((0..pages).map(|_| AtomicU8::new(initial as u8)).collect()),
        }
    }

    /// The table kept in `journal`, in the states it holds.
    pub fn journaled(journal: Arc<Journal>) -> Self {
        Self {
            states: Slots::Journal(journal),
        }
    }

    /// Number of pages.
    pub fn len(&self) -> u64 {
        self.states.len() as u64
    }

    /// True if the table has no pages.
    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// The state of `page`.
    pub fn get(&self, page: u64) -> PageState {
        PageState::from_u8(self.states[page as usize].load(Ordering::Acquire))
    }

    /// Sets the state of `page`.
    pub fn set(&self, page: u64, state: PageState) {
        self.states[page as usize].store(state as u8, Ordering::Release);
    }

    /// Sets `page` to `to` if it is `from`; true if it did.
    pub fn transition(&self, page: u64, from: PageState, to: PageState) -> bool {
        self.states[page as usize]
            .compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Sets every page of `pages` to `state`.
    pub fn set_range(&self, pages: std::ops::Range<u64>, state: PageState) {
        for page in pages {
            self.set(page, state);
        }
    }

    /// True if every page of `pages` is in `state`.
    pub fn all(&self, pages: std::ops::Range<u64>, state: PageState) -> bool {
        pages.into_iter().all(|page| self.get(page) == state)
    }

    /// True if any page of `pages` is in `state`.
    pub fn any(&self, pages: std::ops::Range<u64>, state: PageState) -> bool {
        pages.into_iter().any(|page| self.get(page) == state)
    }

    /// Counts pages per state.
    pub fn counts(&self) -> StateCounts {
        let mut counts = StateCounts::default();
        for state in self.states.iter() {
            match PageState::from_u8(state.load(Ordering::Relaxed)) {
                PageState::Zero => counts.zero += 1,
                PageState::Source => counts.source += 1,
                PageState::Stored => counts.stored += 1,
                PageState::Resident => counts.resident += 1,
                PageState::Dropping => counts.dropping += 1,
                PageState::Pooled => counts.pooled += 1,
            }
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_transition_only_from_the_expected_state() {
        let states = PageStates::new(8, PageState::Stored);
        assert!(states.transition(3, PageState::Stored, PageState::Resident));
        assert!(!states.transition(3, PageState::Stored, PageState::Zero));
        assert_eq!(states.get(3), PageState::Resident);
        states.set_range(4..8, PageState::Zero);
        assert!(states.all(4..8, PageState::Zero));
        assert!(states.any(0..4, PageState::Resident));
        let counts = states.counts();
        assert_eq!((counts.stored, counts.resident, counts.zero), (3, 1, 4));
    }
}
