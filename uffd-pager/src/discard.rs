//! Discarding guest RAM: the one way every caller frees pages of it (the offload once their
//! bytes are durable, cold compression once a block is in the pool, the VMM for the guest's
//! free-page reports and for a restored VM's private copies).
//!
//! How depends on the RAM's kind: a private mapping (anon RAM, a snapshot image's private
//! copies, private hugetlb RAM) drops its pages with `MADV_DONTNEED`: anon RAM reads as zeros
//! afterwards, a private file mapping as the file's bytes again. memfd RAM (of base or huge
//! pages) frees them from the file with a punched hole (which also unmaps them): it reads as
//! zeros afterwards. Huge pages are discarded whole: a range that is not a whole number of
//! them is refused, never rounded (see [`inward`]). Freed huge pages go back to the kernel's
//! huge-page pool, and from there to the host where they were surplus pages. The page states are the
//! caller's to change, before or after as its own invariant says (`Pager::discarded` first for
//! a discard the pager must not race; `Dropping` first for an offload).

use std::fs::File;
use std::os::fd::AsRawFd;

use crate::addr::HostRange;
use crate::pager::RamKind;

/// Frees the guest RAM pages of `range`, a mapping of RAM of `kind`; `memfd` is memfd RAM's
/// file and the offset in it of `range`'s start.
///
/// # Safety
/// `range` is guest RAM of this process whose current bytes nothing needs any more: after the
/// call they read as zeros (anon, memfd) or as the mapped file's (a snapshot's private copies).
pub unsafe fn discard(
    kind: RamKind,
    range: HostRange,
    memfd: Option<(&File, u64)>,
) -> std::io::Result<()> {
    let page = kind.page_size();
    if !page.is_aligned(range.start().0) || !page.is_aligned(range.len()) {
        // The kernel would round a huge-page range (or refuse it): the caller's page states
        // would no longer say what is mapped.
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "{} RAM is discarded in whole {}-byte pages",
                kind.name(),
                page.bytes()
            ),
        ));
    }
    match (kind, memfd) {
        (RamKind::Memfd | RamKind::HugetlbMemfd, Some((file, offset))) => {
            punch_hole(file, offset, range.len())
        }
        (RamKind::Memfd | RamKind::HugetlbMemfd, None) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "memfd RAM is discarded through its file",
        )),
        // SAFETY: the caller vouches for the range: this process's own guest RAM, whose bytes
        // nothing needs.
        (RamKind::Anon | RamKind::Snapshot | RamKind::Hugetlb, _) => unsafe { dont_need(range) },
    }
}

/// The part of `range` that covers whole pages of `page` bytes (`None` if it covers none):
/// what a free-page report of RAM of that page size can drop without touching bytes it did
/// not report.
pub fn inward(range: HostRange, page: basics::PageSize) -> Option<HostRange> {
    let start = page.align_up(range.start().0)?;
    let end = page.align_down(range.end().0);
    (start < end)
        .then(|| HostRange::new(crate::addr::HostAddr(start), end - start).ok())
        .flatten()
}

/// Unmaps the pages of `range`, a shared mapping of memfd RAM, keeping every byte in the file:
/// the next access is a MINOR fault (cold compression's probe of whether a block is in use).
///
/// # Safety
/// `range` is memfd RAM of this process, shared-mapped.
pub unsafe fn unmap_shared(range: HostRange) -> std::io::Result<()> {
    // SAFETY: the caller vouches for the range; on a shared mapping MADV_DONTNEED drops only
    // the page-table entries, the page cache keeps the bytes.
    unsafe { dont_need(range) }
}

/// `MADV_DONTNEED` of `range`.
///
/// # Safety
/// As [`discard`] or [`unmap_shared`] say of their ranges.
unsafe fn dont_need(range: HostRange) -> std::io::Result<()> {
    let len = usize::try_from(range.len())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: forwarded from the caller.
    let rc = unsafe { libc::madvise(range.start().as_ptr(), len, libc::MADV_DONTNEED) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Frees `len` bytes of `file` at `offset` (memfd RAM, the memory pool's memfd); the size
/// stays.
pub fn punch_hole(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
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
