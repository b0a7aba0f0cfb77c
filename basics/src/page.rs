//! Page arithmetic every crate shares: the page size as a value (4 KiB base pages, 2 MiB huge
//! pages), and the conversions between bytes, page counts and page indices, checked where they
//! can overflow. A crate that needs the base page in a constant uses [`PAGE_SIZE`]; one that
//! may serve huge pages carries a [`PageSize`].

/// A page size: a power of two, 4 KiB or 2 MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageSize {
    shift: u8,
}

/// The base page, bytes.
pub const PAGE_SIZE: u64 = PageSize::BASE.bytes();

impl PageSize {
    /// 4 KiB, the base page of x86-64.
    pub const BASE: Self = Self { shift: 12 };
    /// 2 MiB, a huge page (one PMD).
    pub const HUGE: Self = Self { shift: 21 };

    /// The size in bytes.
    pub const fn bytes(self) -> u64 {
        1 << self.shift
    }

    /// The size in bytes, as a length in memory.
    pub const fn usize(self) -> usize {
        1 << self.shift
    }

    /// log2 of the size.
    pub const fn shift(self) -> u32 {
        self.shift as u32
    }

    /// Whether `x` (an address, an offset or a length) is a whole number of pages.
    pub const fn is_aligned(self, x: u64) -> bool {
        x & (self.bytes() - 1) == 0
    }

    /// The start of the page holding `x`.
    pub const fn align_down(self, x: u64) -> u64 {
        x & !(self.bytes() - 1)
    }

    /// The first page boundary at or above `x`; `None` past the end of 64 bits.
    pub const fn align_up(self, x: u64) -> Option<u64> {
        match x.checked_add(self.bytes() - 1) {
            Some(up) => Some(self.align_down(up)),
            None => None,
        }
    }

    /// The index of the page holding byte `offset`.
    pub const fn index(self, offset: u64) -> u64 {
        offset >> self.shift
    }

    /// The byte offset of page `index`; `None` past the end of 64 bits.
    pub const fn offset(self, index: u64) -> Option<u64> {
        if index > u64::MAX >> self.shift {
            None
        } else {
            Some(index << self.shift)
        }
    }

    /// Pages that `len` bytes touch (the last one may be partial).
    pub const fn pages_in(self, len: u64) -> u64 {
        len.div_ceil(self.bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn page_sizes_are_4_kib_and_2_mib() {
        assert_eq!(PAGE_SIZE, 4096);
        assert_eq!(PageSize::BASE.usize(), 4096);
        assert_eq!(PageSize::HUGE.bytes(), 2 << 20);
        assert_eq!(PageSize::HUGE.shift(), 21);
        assert!(PageSize::BASE < PageSize::HUGE);
    }

    #[test]
    fn page_edges_of_the_address_space_do_not_wrap() {
        let p = PageSize::HUGE;
        assert_eq!(p.align_up(u64::MAX), None);
        assert_eq!(p.align_up(0), Some(0));
        assert_eq!(p.offset(u64::MAX >> 21), Some(p.align_down(u64::MAX)));
        assert_eq!(p.offset((u64::MAX >> 21) + 1), None);
        assert_eq!(p.pages_in(u64::MAX), (u64::MAX >> 21) + 1);
    }

    proptest! {
        #[test]
        fn page_maths_agree_with_each_other(x in any::<u64>(), huge in any::<bool>()) {
            let p = if huge { PageSize::HUGE } else { PageSize::BASE };
            let down = p.align_down(x);
            prop_assert!(down <= x && x - down < p.bytes());
            prop_assert!(p.is_aligned(down));
            prop_assert_eq!(p.offset(p.index(x)), Some(down));
            match p.align_up(x) {
                Some(up) => {
                    prop_assert!(up >= x && up - x < p.bytes() && p.is_aligned(up));
                    prop_assert_eq!(p.pages_in(x), p.index(up));
                }
                None => prop_assert!(x > u64::MAX - (p.bytes() - 1)),
            }
            prop_assert_eq!(p.is_aligned(x), down == x);
        }
    }
}
