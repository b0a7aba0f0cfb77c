//! The page table: one state per 4 KiB page of the image ([`PageStates`], a flat table of
//! atomics) and the layout lock that orders changes of it against faults. This module keeps the
//! pager's page invariants — a page is never mapped with stale bytes, and a page whose bytes
//! exist somewhere never reads as zeros — and its transitions are the only code that changes a
//! page's state. Each says what it means and which side of the lock it needs, and takes the
//! guard as proof:
//!
//! | transition | from → to | lock | who |
//! |---|---|---|---|
//! | [`installed`](PageTable::installed) | its state → `Resident` | read | a fault or a load mapped the pages |
//! | [`mapped`](PageTable::mapped) | any → `Resident` | read | a MINOR fault mapped the page cache |
//! | [`discarded`](PageTable::discarded) | `Dropping` → `Stored`, else → `Zero` | write | a `REMOVE` event, or the VMM's own discard |
//! | [`dropping`](PageTable::dropping), [`drop_failed`](PageTable::drop_failed), [`dropped`](PageTable::dropped) | `Resident` → `Dropping` → `Stored` (or back) | none | an offload dropping pages it made durable |
//! | [`pooled`](PageTable::pooled), [`unpooled`](PageTable::unpooled) | `Resident` ↔ `Pooled` | write | cold compression |
//! | [`retired`](PageTable::retired) | `Pooled` → `Stored` | write | an offload that stored a pooled block |
//!
//! Reads need no lock: what is decided on a read is checked again under the lock before it
//! acts. A fault resolves under the read side, so a discard (under the write side) cannot land
//! between its check of a page's state and its install. An offload's own drops need no lock:
//! only the offload makes pages `Dropping`, and a fault on a `Dropping` page only wakes its
//! thread (the page is still mapped).

use std::ops::Range;

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::state::{PageState, PageStates, StateCounts};

/// The page states and the layout lock.
#[derive(Debug)]
pub(crate) struct PageTable {
    states: PageStates,
    layout: RwLock<()>,
}

/// The read side of the layout lock: faults and loads resolve under it.
#[derive(Debug)]
pub(crate) struct Read<'a>(#[allow(dead_code, reason = "held, not read")] RwLockReadGuard<'a, ()>);

/// The write side of the layout lock: events are read and discards applied under it.
#[derive(Debug)]
pub(crate) struct Write<'a>(
    #[allow(dead_code, reason = "held, not read")] RwLockWriteGuard<'a, ()>,
);

/// Either side of the layout lock, held.
pub(crate) trait Held {}
impl Held for Read<'_> {}
impl Held for Write<'_> {}

impl PageTable {
    pub fn new(states: PageStates) -> Self {
        Self {
            states,
            layout: RwLock::new(()),
        }
    }

    /// Takes the read side of the layout lock.
    pub fn read(&self) -> Read<'_> {
        Read(self.layout.read())
    }

    /// Takes the write side of the layout lock.
    pub fn write(&self) -> Write<'_> {
        Write(self.layout.write())
    }

    /// Pages in the table.
    pub fn len(&self) -> u64 {
        self.states.len()
    }

    /// The state of `page`.
    pub fn get(&self, page: u64) -> PageState {
        self.states.get(page)
    }

    /// True if every page of `pages` is in `state`.
    pub fn all(&self, pages: Range<u64>, state: PageState) -> bool {
        self.states.all(pages, state)
    }

    /// True if any page of `pages` is in `state`.
    pub fn any(&self, pages: Range<u64>, state: PageState) -> bool {
        self.states.any(pages, state)
    }

    /// Pages in `state` now (O(1)).
    pub fn count(&self, state: PageState) -> u64 {
        self.states.count(state)
    }

    /// Pages mapped now: `Resident` and `Dropping` (O(1)).
    pub fn resident(&self) -> u64 {
        self.states.resident()
    }

    /// Pages per state (O(1)).
    pub fn counts(&self) -> StateCounts {
        self.states.counts()
    }

    /// A fault or a load mapped `pages`, which were in `from`: those still in `from` become
    /// `Resident` (another thread may have installed some first); returns how many.
    pub fn installed(&self, _: &impl Held, pages: Range<u64>, from: PageState) -> u64 {
        self.states
            .transition_range(pages, from, PageState::Resident)
    }

    /// A MINOR fault mapped `pages` from the page cache, which holds their bytes.
    pub fn mapped(&self, _: &impl Held, pages: Range<u64>) {
        self.states.set_range(pages, PageState::Resident);
    }

    /// `pages` were discarded (a `REMOVE` event, or the VMM's discard before it makes it):
    /// they read as zeros from now on, except the pager's own drops, whose bytes are stored.
    /// Returns whether any was the pager's own drop (an offload waits for those).
    pub fn discarded(&self, _: &Write<'_>, pages: Range<u64>) -> bool {
        let mut stored = false;
        for page in pages {
            if self
                .states
                .transition(page, PageState::Dropping, PageState::Stored)
            {
                stored = true;
            } else {
                self.states.set(page, PageState::Zero);
            }
        }
        stored
    }

    /// An offload is about to drop `pages`, resident and durable in its store.
    pub fn dropping(&self, pages: Range<u64>) {
        self.states.set_range(pages, PageState::Dropping);
    }

    /// The drop of `pages` failed: they are mapped still.
    pub fn drop_failed(&self, pages: Range<u64>) {
        self.states.set_range(pages, PageState::Resident);
    }

    /// `pages` were dropped (by the offload itself, where no `REMOVE` event says so): their
    /// bytes are in the store.
    pub fn dropped(&self, pages: Range<u64>) {
        self.states
            .transition_range(pages, PageState::Dropping, PageState::Stored);
    }

    /// The bytes of `pages`, resident, are in the memory pool: the pages become `Pooled`
    /// (before they are dropped, or once moved out of guest RAM).
    pub fn pooled(&self, _: &Write<'_>, pages: Range<u64>) {
        self.states.set_range(pages, PageState::Pooled);
    }

    /// `pages`, just made `Pooled`, could not be dropped: they are mapped still.
    pub fn unpooled(&self, _: &Write<'_>, pages: Range<u64>) {
        self.states.set_range(pages, PageState::Resident);
    }

    /// The pooled `page`'s block is in the store now: it becomes `Stored` if it was `Pooled`.
    pub fn retired(&self, _: &Write<'_>, page: u64) -> bool {
        self.states
            .transition(page, PageState::Pooled, PageState::Stored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(states: &[PageState]) -> PageTable {
        let table = PageTable::new(PageStates::new(states.len() as u64, PageState::Zero));
        let write = table.write();
        for (page, &state) in states.iter().enumerate() {
            let page = page as u64;
            match state {
                PageState::Zero => {}
                PageState::Resident => table.mapped(&write, page..page + 1),
                PageState::Dropping => {
                    table.mapped(&write, page..page + 1);
                    table.dropping(page..page + 1);
                }
                PageState::Pooled => {
                    table.mapped(&write, page..page + 1);
                    table.pooled(&write, page..page + 1);
                }
                PageState::Stored => {
                    table.mapped(&write, page..page + 1);
                    table.dropping(page..page + 1);
                    table.dropped(page..page + 1);
                }
                PageState::Source => unreachable!("the tests start from other states"),
            }
        }
        drop(write);
        table
    }

    fn states(table: &PageTable) -> Vec<PageState> {
        (0..table.len()).map(|page| table.get(page)).collect()
    }

    #[test]
    fn table_discard_keeps_the_pagers_own_drops_stored_and_zeroes_the_rest() {
        use PageState::*;
        let table = table(&[Resident, Dropping, Pooled, Stored, Dropping]);
        let write = table.write();
        assert!(table.discarded(&write, 0..4));
        assert_eq!(states(&table), [Zero, Stored, Zero, Zero, Dropping]);
        // No drop of the pager's own among them: nothing for an offload to wait on.
        assert!(!table.discarded(&write, 0..1));
        assert_eq!(table.counts().zero, 3);
        assert_eq!(table.counts().dropping, 1);
    }

    #[test]
    fn table_install_moves_only_the_pages_still_in_their_state() {
        use PageState::*;
        let table = table(&[Zero, Resident, Zero, Stored]);
        let read = table.read();
        // Another thread installed page 1 first; page 3 is in another state.
        assert_eq!(table.installed(&read, 0..4, Zero), 2);
        assert_eq!(states(&table), [Resident, Resident, Resident, Stored]);
        assert_eq!(table.resident(), 3);
    }

    #[test]
    fn table_offload_and_pool_transitions_go_and_come_back() {
        use PageState::*;
        let table = table(&[Resident, Resident, Pooled, Pooled]);
        table.dropping(0..2);
        assert_eq!(table.resident(), 2, "dropping pages are mapped still");
        table.drop_failed(0..1);
        table.dropped(0..2);
        assert_eq!(states(&table)[..2], [Resident, Stored]);
        let write = table.write();
        assert!(table.retired(&write, 2));
        assert!(!table.retired(&write, 2), "retired once");
        table.unpooled(&write, 3..4);
        assert_eq!(states(&table), [Resident, Stored, Stored, Resident]);
    }
}
