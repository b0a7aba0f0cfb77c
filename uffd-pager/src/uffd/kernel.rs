//! What the kernel's userfaultfd speaks: the feature bits, the events read from it (parsed
//! from `uffd_msg`), registration modes, what a resolving ioctl did, and the fdinfo line a
//! peer's userfaultfd is checked by.

use linux_raw_sys::general as sys;

use crate::addr::HostAddr;

/// `UFFD_FEATURE_*` bits the pager may ask for, and those it refuses in a peer's userfaultfd.
pub mod feature {
    /// Report `fork()` of the owner as `FORK` events carrying a new userfaultfd that the kernel
    /// installs in the reader's fd table: never accepted from a peer.
    pub const EVENT_FORK: u64 = 1 << 1;
    /// Report `mremap()` of registered ranges as `REMAP` events (the pager does not follow
    /// moves: never accepted from a peer).
    pub const EVENT_REMAP: u64 = 1 << 2;
    /// Report `munmap()` of registered ranges as `UNMAP` events (handled like `REMOVE`).
    pub const EVENT_UNMAP: u64 = 1 << 6;
    /// Every feature bit Linux 6.18 defines (bits 0 to 16).
    pub const KNOWN: u64 = (1 << 17) - 1;
    /// The kernel's internal "API handshake done" bit, shown in `/proc/PID/fdinfo`.
    pub const INITIALIZED: u64 = 1 << 31;
    /// Report `MADV_DONTNEED`/`MADV_REMOVE` of registered ranges as `REMOVE` events.
    pub const EVENT_REMOVE: u64 = 1 << 3;
    /// MISSING registration on hugetlbfs mappings (`MAP_HUGETLB`, `MFD_HUGETLB`).
    pub const MISSING_HUGETLBFS: u64 = 1 << 4;
    /// MINOR registration on hugetlbfs mappings (a shared `MFD_HUGETLB` memfd).
    pub const MINOR_HUGETLBFS: u64 = 1 << 9;
    /// MISSING registration on shmem (memfd) mappings.
    pub const MISSING_SHMEM: u64 = 1 << 5;
    /// MINOR registration on shmem (memfd) mappings.
    pub const MINOR_SHMEM: u64 = 1 << 10;
    /// Write-protect unpopulated anonymous pages too.
    pub const WP_UNPOPULATED: u64 = 1 << 13;
    /// Resolve write-protect faults in the kernel, recording dirtiness (for PAGEMAP_SCAN).
    pub const WP_ASYNC: u64 = 1 << 15;
    /// `UFFDIO_MOVE`: move anonymous pages between registered ranges without copying.
    pub const MOVE: u64 = 1 << 16;
}

/// One event read from a userfaultfd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A thread touched a page that needs resolving.
    Pagefault {
        /// The faulting address (not page-aligned).
        addr: HostAddr,
        /// The access was a write.
        write: bool,
        /// A MINOR fault: the page is in the page cache, only its mapping is missing.
        minor: bool,
        /// A write to a write-protected page.
        write_protect: bool,
    },
    /// `[start, end)` was discarded (`MADV_DONTNEED`/`MADV_REMOVE`): it reads as zeros now.
    Remove {
        /// First address.
        start: HostAddr,
        /// One past the last address.
        end: HostAddr,
    },
    /// `[start, end)` was unmapped.
    Unmap {
        /// First address.
        start: HostAddr,
        /// One past the last address.
        end: HostAddr,
    },
    /// A range moved (`mremap`).
    Remap {
        /// Old start.
        from: HostAddr,
        /// New start.
        to: HostAddr,
        /// Length.
        len: u64,
    },
    /// The owner forked. Never expected: the pager never enables `EVENT_FORK` and refuses
    /// peers that did (see [`Userfaultfd::adopt`]); the descriptor number in the message is
    /// not trusted and not touched.
    Fork,
    /// An event type this pager does not know.
    Unknown(u8),
}

/// The outcome of a resolving ioctl that did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    /// The whole range was filled and mapped.
    Done,
    /// `EEXIST`: part of the range was already mapped; `done` bytes at the start were filled
    /// before the first mapped page. Waiters still need a wake for the rest.
    AlreadyMapped {
        /// Bytes filled before the first already-mapped page.
        done: u64,
    },
}

/// How a range is registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mode {
    /// Faults on pages that are not there at all.
    pub missing: bool,
    /// Faults on pages present in the page cache but not mapped (shmem).
    pub minor: bool,
    /// Faults on writes to write-protected pages.
    pub write_protect: bool,
}

impl Mode {
    /// MISSING only.
    pub const MISSING: Mode = Mode {
        missing: true,
        minor: false,
        write_protect: false,
    };
    /// MISSING and write-protect, for anonymous RAM whose writes are tracked.
    pub const MISSING_WP: Mode = Mode {
        missing: true,
        minor: false,
        write_protect: true,
    };
    /// MISSING and MINOR, for memfd-backed RAM.
    pub const MISSING_MINOR: Mode = Mode {
        missing: true,
        minor: true,
        write_protect: false,
    };

    pub(super) fn bits(self) -> u64 {
        let mut mode = 0;
        if self.missing {
            mode |= u64::from(sys::UFFDIO_REGISTER_MODE_MISSING);
        }
        if self.minor {
            mode |= u64::from(sys::UFFDIO_REGISTER_MODE_MINOR);
        }
        if self.write_protect {
            mode |= u64::from(sys::UFFDIO_REGISTER_MODE_WP);
        }
        mode
    }

    pub(super) fn name(self) -> &'static str {
        match (self.missing, self.minor, self.write_protect) {
            (true, false, false) => "missing",
            (true, true, false) => "missing+minor",
            (false, true, false) => "minor",
            (true, false, true) => "missing+wp",
            (false, false, true) => "wp",
            _ => "missing+minor+wp",
        }
    }
}

/// The features in the `API:\t<api>:<features>:<ioctls>` line of a userfaultfd's fdinfo (all
/// hexadecimal), as Linux prints it.
pub fn fdinfo_features(info: &str) -> Option<u64> {
    let line = info.lines().find_map(|l| l.strip_prefix("API:"))?;
    let mut fields = line.trim().split(':');
    let api = u64::from_str_radix(fields.next()?, 16).ok()?;
    let features = u64::from_str_radix(fields.next()?, 16).ok()?;
    u64::from_str_radix(fields.next()?, 16).ok()?;
    (api == u64::from(sys::UFFD_API) && fields.next().is_none()).then_some(features)
}

pub(super) fn parse_event(msg: &sys::uffd_msg) -> Event {
    match u32::from(msg.event) {
        sys::UFFD_EVENT_PAGEFAULT => {
            // SAFETY: the kernel fills the pagefault member for PAGEFAULT events.
            let fault = unsafe { msg.arg.pagefault };
            let flags = fault.flags;
            Event::Pagefault {
                addr: HostAddr(fault.address),
                write: flags & u64::from(sys::UFFD_PAGEFAULT_FLAG_WRITE) != 0,
                minor: flags & u64::from(sys::UFFD_PAGEFAULT_FLAG_MINOR) != 0,
                write_protect: flags & u64::from(sys::UFFD_PAGEFAULT_FLAG_WP) != 0,
            }
        }
        sys::UFFD_EVENT_REMOVE => {
            // SAFETY: the kernel fills the remove member for REMOVE events.
            let remove = unsafe { msg.arg.remove };
            Event::Remove {
                start: HostAddr(remove.start),
                end: HostAddr(remove.end),
            }
        }
        sys::UFFD_EVENT_UNMAP => {
            // SAFETY: UNMAP events use the remove member.
            let remove = unsafe { msg.arg.remove };
            Event::Unmap {
                start: HostAddr(remove.start),
                end: HostAddr(remove.end),
            }
        }
        sys::UFFD_EVENT_REMAP => {
            // SAFETY: the kernel fills the remap member for REMAP events.
            let remap = unsafe { msg.arg.remap };
            Event::Remap {
                from: HostAddr(remap.from),
                to: HostAddr(remap.to),
                len: remap.len,
            }
        }
        // The descriptor number a FORK message carries is never acted on: FORK is never
        // enabled on a userfaultfd the pager reads, so the message is not the kernel's.
        sys::UFFD_EVENT_FORK => Event::Fork,
        other => Event::Unknown(other as u8),
    }
}
