//! Page arithmetic: host-virtual addresses and page-aligned ranges. Every address computation
//! of the pager goes through here, with checked arithmetic.

use std::fmt;

/// Size of a base page (`basics::page`, where all page arithmetic is).
pub use basics::page::PAGE_SIZE;

/// A host-virtual address (in the process whose memory the pager serves).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HostAddr(pub u64);

impl HostAddr {
    /// The address of a pointer.
    pub fn from_ptr<T>(ptr: *const T) -> Self {
        Self(ptr as u64)
    }

    /// The address as a pointer, for system calls.
    pub fn as_ptr(self) -> *mut libc::c_void {
        self.0 as *mut libc::c_void
    }

    /// The start of the page holding this address.
    pub fn page_down(self) -> Self {
        Self(self.0 & !(PAGE_SIZE - 1))
    }

    /// True if the address starts a page.
    pub fn is_page_aligned(self) -> bool {
        self.0.is_multiple_of(PAGE_SIZE)
    }

    /// `self + len`, or `None` on overflow.
    pub fn checked_add(self, len: u64) -> Option<Self> {
        self.0.checked_add(len).map(Self)
    }
}

impl fmt::Debug for HostAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for HostAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// Why a range was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    /// Start or length is not a multiple of the page size.
    #[error("range {start} + {len:#x} is not page-aligned")]
    Unaligned {
        /// The start.
        start: HostAddr,
        /// The length.
        len: u64,
    },
    /// The length is zero.
    #[error("range at {start} is empty")]
    Empty {
        /// The start.
        start: HostAddr,
    },
    /// The end does not fit in 64 bits.
    #[error("range {start} + {len:#x} overflows the address space")]
    Overflow {
        /// The start.
        start: HostAddr,
        /// The length.
        len: u64,
    },
}

/// A non-empty, page-aligned range of host-virtual addresses.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostRange {
    start: HostAddr,
    len: u64,
}

impl HostRange {
    /// Validates a range.
    pub fn new(start: HostAddr, len: u64) -> Result<Self, RangeError> {
        if len == 0 {
            return Err(RangeError::Empty { start });
        }
        if !start.is_page_aligned() || !len.is_multiple_of(PAGE_SIZE) {
            return Err(RangeError::Unaligned { start, len });
        }
        start
            .checked_add(len)
            .ok_or(RangeError::Overflow { start, len })?;
        Ok(Self { start, len })
    }

    /// First address.
    pub fn start(&self) -> HostAddr {
        self.start
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: ranges are non-empty by construction.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// One past the last address.
    pub fn end(&self) -> HostAddr {
        HostAddr(self.start.0 + self.len)
    }

    /// Number of pages.
    pub fn pages(&self) -> u64 {
        self.len / PAGE_SIZE
    }

    /// True if `addr` lies inside.
    pub fn contains(&self, addr: HostAddr) -> bool {
        self.start <= addr && addr < self.end()
    }

    /// True if the two ranges share an address.
    pub fn overlaps(&self, other: &HostRange) -> bool {
        self.start < other.end() && other.start < self.end()
    }

    /// Index of the page holding `addr`, if inside.
    pub fn page_index(&self, addr: HostAddr) -> Option<u64> {
        self.contains(addr)
            .then(|| (addr.0 - self.start.0) / PAGE_SIZE)
    }

    /// Address of page `index`.
    pub fn page_addr(&self, index: u64) -> HostAddr {
        HostAddr(self.start.0 + index * PAGE_SIZE)
    }

    /// The part of this range that `other` covers, rounded out to whole pages.
    pub fn clip(&self, start: HostAddr, end: HostAddr) -> Option<(u64, u64)> {
        let lo = start.page_down().max(self.start);
        let end = end
            .0
            .checked_next_multiple_of(PAGE_SIZE)
            .unwrap_or(u64::MAX - (PAGE_SIZE - 1));
        let hi = HostAddr(end).min(self.end());
        (lo < hi).then(|| {
            (
                (lo.0 - self.start.0) / PAGE_SIZE,
                (hi.0 - self.start.0) / PAGE_SIZE,
            )
        })
    }
}

impl fmt::Debug for HostRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn range_unaligned_empty_or_overflowing_is_rejected() {
        assert!(matches!(
            HostRange::new(HostAddr(0x1001), 4096),
            Err(RangeError::Unaligned { .. })
        ));
        assert!(matches!(
            HostRange::new(HostAddr(0x1000), 4095),
            Err(RangeError::Unaligned { .. })
        ));
        assert!(matches!(
            HostRange::new(HostAddr(0x1000), 0),
            Err(RangeError::Empty { .. })
        ));
        assert!(matches!(
            HostRange::new(HostAddr(u64::MAX - 4095), 8192),
            Err(RangeError::Overflow { .. })
        ));
    }

    #[test]
    fn range_overlap_is_symmetric_and_touching_is_not_overlap() {
        let a = HostRange::new(HostAddr(0x10000), 0x4000).unwrap();
        let b = HostRange::new(HostAddr(0x14000), 0x1000).unwrap();
        let c = HostRange::new(HostAddr(0x13000), 0x2000).unwrap();
        assert!(!a.overlaps(&b) && !b.overlaps(&a));
        assert!(a.overlaps(&c) && c.overlaps(&a));
    }

    #[test]
    fn range_clip_rounds_out_to_pages() {
        let r = HostRange::new(HostAddr(0x10000), 0x10000).unwrap();
        assert_eq!(r.clip(HostAddr(0x10800), HostAddr(0x12001)), Some((0, 3)));
        assert_eq!(r.clip(HostAddr(0), HostAddr(0x100000)), Some((0, 16)));
        assert_eq!(r.clip(HostAddr(0x20000), HostAddr(0x30000)), None);
    }

    proptest! {
        #[test]
        fn page_index_and_addr_agree(start in 0u64..1 << 40, pages in 1u64..1 << 16, offset in 0u64..1 << 28) {
            let r = HostRange::new(HostAddr(start * PAGE_SIZE), pages * PAGE_SIZE).unwrap();
            let addr = HostAddr(r.start().0 + offset);
            match r.page_index(addr) {
                Some(i) => {
                    prop_assert!(i < pages);
                    prop_assert_eq!(r.page_addr(i), addr.page_down());
                }
                None => prop_assert!(offset >= pages * PAGE_SIZE),
            }
        }
    }
}
