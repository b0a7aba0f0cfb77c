//! The flat per-page state table: one byte per 4 KiB page of the RAM image, read and written
//! with atomics from fault threads, the prefetcher and offload. No per-fault map lookups.

use std::sync::atomic::{AtomicI64, AtomicU8, Ordering};
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

/// Number of [`PageState`]s (the size of the counter array).
const STATES: usize = 6;

/// One state byte per page, and live counts of pages per state.
///
/// Every mutation swaps or compare-exchanges the state byte, so the old state is known
/// exactly, and then moves one count from the old state to the new: [`PageStates::counts`] is
/// O(1). The two counter updates are not atomic with the byte: a `counts` taken while another
/// thread mutates may be off by the pages in flight (never below zero); once mutations stop it
/// equals a scan of the table.
#[derive(Debug)]
pub struct PageStates {
    states: Slots,
    /// Pages per state, indexed by `PageState as usize`. Signed: a decrement may land before
    /// the matching increment of another thread.
    counts: [AtomicI64; STATES],
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
        Self::with_slots(Slots::Heap(
            (0..pages).map(|_| AtomicU8::new(initial as u8)).collect(),
        ))
    }

    /// The table kept in `journal`, in the states it holds (counted once, here).
    pub fn journaled(journal: Arc<Journal>) -> Self {
        Self::with_slots(Slots::Journal(journal))
    }

    fn with_slots(states: Slots) -> Self {
        let table = Self {
            states,
            counts: Default::default(),
        };
        let scan = table.scan();
        for (counter, n) in table.counts.iter().zip(scan) {
            counter.store(i64::try_from(n).unwrap_or(i64::MAX), Ordering::Relaxed);
        }
        table
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

    /// Moves one page's count from `from` to `to`.
    fn moved(&self, from: PageState, to: PageState, pages: i64) {
        if from != to && pages != 0 {
            self.counts[to as usize].fetch_add(pages, Ordering::Relaxed);
            self.counts[from as usize].fetch_sub(pages, Ordering::Relaxed);
        }
    }

    /// Sets the state of `page`; returns the state it had.
    pub fn set(&self, page: u64, state: PageState) -> PageState {
        let old =
            PageState::from_u8(self.states[page as usize].swap(state as u8, Ordering::AcqRel));
        self.moved(old, state, 1);
        old
    }

    /// Sets `page` to `to` if it is `from`; true if it did.
    pub fn transition(&self, page: u64, from: PageState, to: PageState) -> bool {
        let done = self.states[page as usize]
            .compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if done {
            self.moved(from, to, 1);
        }
        done
    }

    /// Sets every page of `pages` that is `from` to `to`; returns how many it set (one
    /// counter update for the whole range).
    pub fn transition_range(
        &self,
        pages: std::ops::Range<u64>,
        from: PageState,
        to: PageState,
    ) -> u64 {
        let mut done = 0;
        for page in pages {
            if self.states[page as usize]
                .compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                done += 1;
            }
        }
        self.moved(from, to, i64::try_from(done).unwrap_or(i64::MAX));
        done
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

    /// The live count of pages in `state` (O(1); see the type's documentation).
    pub fn count(&self, state: PageState) -> u64 {
        u64::try_from(self.counts[state as usize].load(Ordering::Relaxed)).unwrap_or(0)
    }

    /// Pages mapped: `Resident` and `Dropping` (O(1)).
    pub fn resident(&self) -> u64 {
        self.count(PageState::Resident) + self.count(PageState::Dropping)
    }

    /// Pages per state (O(1): the live counts).
    pub fn counts(&self) -> StateCounts {
        StateCounts {
            zero: self.count(PageState::Zero),
            source: self.count(PageState::Source),
            stored: self.count(PageState::Stored),
            resident: self.count(PageState::Resident),
            dropping: self.count(PageState::Dropping),
            pooled: self.count(PageState::Pooled),
        }
    }

    /// Pages per state, by reading every state byte (indexed by `PageState as usize`).
    fn scan(&self) -> [u64; STATES] {
        let mut counts = [0; STATES];
        for state in self.states.iter() {
            counts[PageState::from_u8(state.load(Ordering::Relaxed)) as usize] += 1;
        }
        counts
    }

    /// Pages per state, by reading every state byte (O(pages); for checks).
    pub fn scan_counts(&self) -> StateCounts {
        let [zero, source, stored, resident, dropping, pooled] = self.scan();
        StateCounts {
            zero,
            source,
            stored,
            resident,
            dropping,
            pooled,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
        assert_eq!(counts, states.scan_counts());
    }

    #[test]
    fn states_journaled_table_counts_what_the_journal_holds() {
        let journal = Arc::new(Journal::create(16, PageState::Source).unwrap());
        journal.slots()[2].store(PageState::Resident as u8, Ordering::Relaxed);
        journal.slots()[5].store(PageState::Zero as u8, Ordering::Relaxed);
        let states = PageStates::journaled(journal);
        let counts = states.counts();
        assert_eq!((counts.source, counts.resident, counts.zero), (14, 1, 1));
        assert_eq!(states.resident(), 1);
    }

    /// One mutation of the table.
    #[derive(Debug, Clone)]
    enum Op {
        Set(u64, PageState),
        Transition(u64, PageState, PageState),
        SetRange(u64, u64, PageState),
        TransitionRange(u64, u64, PageState, PageState),
    }

    const PAGES: u64 = 64;

    fn state() -> impl Strategy<Value = PageState> {
        (0u8..6).prop_map(PageState::from_u8)
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..PAGES, state()).prop_map(|(p, s)| Op::Set(p, s)),
            (0..PAGES, state(), state()).prop_map(|(p, a, b)| Op::Transition(p, a, b)),
            (0..PAGES, 0..PAGES, state()).prop_map(|(p, n, s)| Op::SetRange(p, n, s)),
            (0..PAGES, 0..PAGES, state(), state())
                .prop_map(|(p, n, a, b)| Op::TransitionRange(p, n, a, b)),
        ]
    }

    fn apply(states: &PageStates, op: &Op) {
        let range = |p: u64, n: u64| p..(p + n).min(PAGES);
        match *op {
            Op::Set(p, s) => {
                states.set(p, s);
            }
            Op::Transition(p, a, b) => {
                states.transition(p, a, b);
            }
            Op::SetRange(p, n, s) => states.set_range(range(p, n), s),
            Op::TransitionRange(p, n, a, b) => {
                states.transition_range(range(p, n), a, b);
            }
        }
    }

    proptest! {
        // Cases from PROPTEST_CASES (256 by default).
        #[test]
        fn states_counts_after_random_mutations_equal_a_scan(
            initial in state(),
            ops in proptest::collection::vec(op(), 0..200),
        ) {
            let states = PageStates::new(PAGES, initial);
            for op in &ops {
                apply(&states, op);
                prop_assert_eq!(states.counts(), states.scan_counts());
            }
        }

        #[test]
        fn states_counts_after_mutations_from_several_threads_equal_a_scan(
            initial in state(),
            ops in proptest::collection::vec(proptest::collection::vec(op(), 0..300), 4),
        ) {
            let states = PageStates::new(PAGES, initial);
            std::thread::scope(|scope| {
                for thread_ops in &ops {
                    let states = &states;
                    scope.spawn(move || {
                        for op in thread_ops {
                            apply(states, op);
                        }
                    });
                }
            });
            prop_assert_eq!(states.counts(), states.scan_counts());
        }
    }
}
