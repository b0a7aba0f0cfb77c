//! A VM's page-state journal: the pager's per-page state table kept in a sealed memfd instead
//! of the heap, so that it outlives the server process (the keeper holds the memfd, see
//! [`crate::server::keeper`]) and a new server can take the VM over knowing which pages a
//! `REMOVE` event discarded (they must read as zeros, never as the image's bytes).
//!
//! Layout: one header page, then one state byte per page of the image (the table itself:
//! every state change the pager makes is journaled by construction, with no second write).
//! The header carries a *read marker*: set before each `read(2)` of the userfaultfd's events
//! and cleared once that read's `REMOVE`s are applied to the table. The kernel zaps a removed
//! range as soon as its event has been read, so a server killed with the marker set may have
//! lost a discard: whoever finds the marker set cannot prove the table right and must not serve
//! the VM.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use crate::addr::PAGE_SIZE;
use crate::state::PageState;

/// "UPJRNL01", little-endian.
const MAGIC: u64 = u64::from_le_bytes(*b"UPJRNL01");
/// Bytes before the state table.
const HEADER: u64 = PAGE_SIZE;
/// Header words (`AtomicU64`), in order.
const W_MAGIC: usize = 0;
const W_PAGES: usize = 1;
const W_READING: usize = 2;
const W_CLEAN: usize = 3;
const W_GENERATION: usize = 4;
/// The largest image a journal describes (1 TiB of 4 KiB pages).
const MAX_PAGES: u64 = 1 << 28;

/// Why a journal cannot be made or used.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// `memfd_create`, sizing or sealing failed.
    #[error("cannot create the journal memfd ({what})")]
    Create {
        /// The failing step.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The journal could not be mapped.
    #[error("cannot map the journal")]
    Map(#[source] std::io::Error),
    /// The descriptor is not a journal this code wrote, or does not fit the VM.
    #[error("not a usable journal: {0}")]
    Invalid(String),
}

/// A journal mapped shared in this process.
#[derive(Debug)]
pub struct Journal {
    file: File,
    map: memmap2::MmapRaw,
    pages: u64,
}

impl Journal {
    /// A fresh journal for `pages` pages, all in `initial`, marker clear.
    pub fn create(pages: u64, initial: PageState) -> Result<Self, JournalError> {
        if pages == 0 || pages > MAX_PAGES {
            return Err(JournalError::Invalid(format!("{pages} pages")));
        }
        let create = |what| move |source| JournalError::Create { what, source };
        // SAFETY: memfd_create with a valid NUL-terminated name; the result is checked.
        let fd = unsafe {
            libc::memfd_create(
                c"uffd-pager-journal".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(create("memfd_create")(std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(HEADER + pages.next_multiple_of(PAGE_SIZE))
            .map_err(create("ftruncate"))?;
        // A fixed size: neither side can ever take SIGBUS on its mapping.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: F_ADD_SEALS on a memfd we own, no memory involved.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(create("F_ADD_SEALS")(std::io::Error::last_os_error()));
        }
        let journal = Self::map(file, pages)?;
        for slot in journal.slots() {
            slot.store(initial as u8, Ordering::Relaxed);
        }
        journal.word(W_PAGES).store(pages, Ordering::Relaxed);
        journal.word(W_MAGIC).store(MAGIC, Ordering::Release);
        Ok(journal)
    }

    /// A journal handed back by the keeper, checked: sealed against resizing, written by this
    /// code (magic), as large as its header says.
    pub fn open(fd: OwnedFd) -> Result<Self, JournalError> {
        let file = File::from(fd);
        // SAFETY: F_GET_SEALS on a descriptor we hold, no memory involved.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(JournalError::Invalid("not a size-sealed memfd".into()));
        }
        let len = file.metadata().map_err(JournalError::Map)?.len();
        if len < HEADER + PAGE_SIZE {
            return Err(JournalError::Invalid(format!("{len} bytes")));
        }
        let probe = Self::map(file, 0)?;
        if probe.word(W_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(JournalError::Invalid("bad magic".into()));
        }
        let pages = probe.word(W_PAGES).load(Ordering::Relaxed);
        if pages == 0 || pages > MAX_PAGES || HEADER + pages > len {
            return Err(JournalError::Invalid(format!(
                "{pages} pages in a {len}-byte journal"
            )));
        }
        Ok(Self { pages, ..probe })
    }

    fn map(file: File, pages: u64) -> Result<Self, JournalError> {
        let map = memmap2::MmapOptions::new()
            .map_raw(&file)
            .map_err(JournalError::Map)?;
        Ok(Self { file, map, pages })
    }

    fn word(&self, index: usize) -> &AtomicU64 {
        debug_assert!((index + 1) * 8 <= HEADER as usize);
        // SAFETY: the mapping is at least HEADER bytes, page-aligned, and lives as long as
        // `self`; the header words are only ever accessed atomically, here and by any other
        // process mapping the memfd.
        unsafe { &*self.map.as_ptr().cast::<AtomicU64>().add(index) }
    }

    /// The state table: one byte per page.
    pub fn slots(&self) -> &[AtomicU8] {
        // SAFETY: the mapping holds HEADER + pages bytes (checked at create/open; the memfd
        // cannot shrink), lives as long as `self`, and the table is only accessed atomically
        // (AtomicU8 has the layout of u8).
        unsafe {
            std::slice::from_raw_parts(
                self.map.as_ptr().add(HEADER as usize).cast::<AtomicU8>(),
                self.pages as usize,
            )
        }
    }

    /// Pages described.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// The memfd, to hand to the keeper.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Sets the read marker (before reading events).
    pub fn begin_read(&self) {
        self.word(W_READING).store(1, Ordering::SeqCst);
    }

    /// Clears the read marker (once the read's discards are in the table).
    pub fn end_read(&self) {
        self.word(W_READING).store(0, Ordering::SeqCst);
    }

    /// True if a read of events may not have been journaled.
    pub fn read_in_progress(&self) -> bool {
        self.word(W_READING).load(Ordering::SeqCst) != 0
    }

    /// Records that the server writing it stopped on purpose with every event applied (a
    /// handover), or clears that record.
    pub fn set_clean(&self, clean: bool) {
        self.word(W_CLEAN).store(u64::from(clean), Ordering::SeqCst);
    }

    /// True if the last server stopped on purpose.
    pub fn clean(&self) -> bool {
        self.word(W_CLEAN).load(Ordering::SeqCst) != 0
    }

    /// Counts a takeover; returns how many servers have taken it over so far.
    pub fn next_generation(&self) -> u64 {
        self.word(W_GENERATION).fetch_add(1, Ordering::SeqCst) + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn journal_reopened_keeps_states_and_marker() {
        let journal = Journal::create(10, PageState::Source).unwrap();
        journal.slots()[3].store(PageState::Zero as u8, Ordering::Relaxed);
        journal.begin_read();
        let fd = journal.fd().try_clone_to_owned().unwrap();
        drop(journal);
        let again = Journal::open(fd).unwrap();
        assert_eq!(again.pages(), 10);
        assert!(again.read_in_progress());
        assert_eq!(
            again.slots()[3].load(Ordering::Relaxed),
            PageState::Zero as u8
        );
        assert_eq!(
            again.slots()[4].load(Ordering::Relaxed),
            PageState::Source as u8
        );
        again.end_read();
        assert!(!again.read_in_progress());
    }

    #[test]
    fn journal_open_foreign_memfd_is_refused() {
        // SAFETY: memfd_create with a valid name; checked below.
        let fd = unsafe { libc::memfd_create(c"other".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(3 * PAGE_SIZE).unwrap();
        assert!(matches!(
            Journal::open(OwnedFd::from(file.try_clone().unwrap())),
            Err(JournalError::Invalid(_))
        ));
        // SAFETY: F_ADD_SEALS on our memfd.
        let rc = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
        assert_eq!(rc, 0);
        assert!(matches!(
            Journal::open(OwnedFd::from(file)),
            Err(JournalError::Invalid(_))
        ));
    }
}
