//! Block geometry: the size of a block, how an image is cut into blocks, and parsing of
//! human-readable sizes. All block arithmetic of the crate lives here.

use std::fmt;
use std::str::FromStr;

/// Size of a base page on x86-64.
pub const PAGE_SIZE: usize = 4096;

/// Smallest supported block: one page.
pub const MIN_BLOCK_SIZE: u64 = 4 << 10;
/// Largest supported block: one huge page.
pub const MAX_BLOCK_SIZE: u64 = 2 << 20;
/// Default block: 64 KiB, the unit of compression and prefetch.
pub const DEFAULT_BLOCK_SIZE: u64 = 64 << 10;

/// An invalid block size or an unparsable size string.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SizeError {
    /// The text is not a size such as `65536`, `64K`, `64KiB` or `1MiB`.
    #[error("`{text}` is not a size (examples: 65536, 64KiB, 1MiB)")]
    Unparsable {
        /// The text as given.
        text: String,
    },
    /// The value does not fit in 64 bits.
    #[error("`{text}` is too large")]
    Overflow {
        /// The text as given.
        text: String,
    },
    /// A block size that is not a power of two between 4 KiB and 2 MiB.
    #[error("block size {bytes} is invalid: it must be a power of two from 4 KiB to 2 MiB")]
    InvalidBlockSize {
        /// The rejected size in bytes.
        bytes: u64,
    },
}

/// Parses `N`, `NK`, `NKiB`, `NM`, `NMiB`, `NG`, `NGiB` (binary multiples, case-insensitive).
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let unparsable = || SizeError::Unparsable {
        text: text.to_owned(),
    };
    let trimmed = text.trim();
    let digits_end = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    if digits_end == 0 {
        return Err(unparsable());
    }
    let number: u64 = trimmed[..digits_end]
        .parse()
        .map_err(|_| SizeError::Overflow {
            text: text.to_owned(),
        })?;
    let shift = match trimmed[digits_end..].trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(unparsable()),
    };
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| SizeError::Overflow {
            text: text.to_owned(),
        })
}

/// Formats a byte count with a binary unit, e.g. `64.0 MiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The size of one block: a power of two from 4 KiB to 2 MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockSize(u32);

impl BlockSize {
    /// Validates a block size in bytes.
    pub fn new(bytes: u64) -> Result<Self, SizeError> {
        if !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&bytes) || !bytes.is_power_of_two() {
            return Err(SizeError::InvalidBlockSize { bytes });
        }
        let bytes = u32::try_from(bytes).map_err(|_| SizeError::InvalidBlockSize { bytes })?;
        Ok(Self(bytes))
    }

    /// The block size in bytes.
    pub fn bytes(self) -> usize {
        self.0 as usize
    }

    /// The block size in bytes, as `u64`.
    pub fn bytes_u64(self) -> u64 {
        u64::from(self.0)
    }

    /// log2 of the block size.
    pub fn shift(self) -> u32 {
        self.0.trailing_zeros()
    }

    /// Pages per block.
    pub fn pages(self) -> usize {
        self.bytes() / PAGE_SIZE
    }

    /// Number of blocks that cover `image_size` bytes (the last one may be partial).
    pub fn blocks_for(self, image_size: u64) -> u64 {
        image_size.div_ceil(self.bytes_u64())
    }

    /// Byte offset of block `index` in the image, or `None` on overflow.
    pub fn offset_of(self, index: u64) -> Option<u64> {
        index.checked_mul(self.bytes_u64())
    }

    /// The block that holds byte `offset`.
    pub fn index_of(self, offset: u64) -> u64 {
        offset >> self.shift()
    }

    /// Length of block `index` in an image of `image_size` bytes: the block size, except for
    /// a partial last block. Zero for an index past the end.
    pub fn len_in_image(self, index: u64, image_size: u64) -> usize {
        let Some(start) = self.offset_of(index) else {
            return 0;
        };
        let len = image_size.saturating_sub(start).min(self.bytes_u64());
        // `len` is at most the block size, which fits in usize.
        len as usize
    }
}

impl Default for BlockSize {
    fn default() -> Self {
        Self(DEFAULT_BLOCK_SIZE as u32)
    }
}

impl fmt::Display for BlockSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_bytes(self.bytes_u64()))
    }
}

impl FromStr for BlockSize {
    type Err = SizeError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::new(parse_size(text)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parse_size_units_scale_binary() {
        assert_eq!(parse_size("65536"), Ok(65536));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2 gib"), Ok(2 << 30));
    }

    #[test]
    fn parse_size_garbage_is_rejected_with_the_text() {
        let err = parse_size("512XB").unwrap_err();
        assert!(err.to_string().contains("512XB"), "{err}");
        assert!(parse_size("").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(matches!(
            parse_size("99999999999999999999"),
            Err(SizeError::Overflow { .. })
        ));
        assert!(matches!(
            parse_size("99999999999TiB"),
            Err(SizeError::Overflow { .. })
        ));
    }

    #[test]
    fn block_size_outside_range_or_not_power_of_two_is_rejected() {
        for bad in [0, 512, 2048, 3 << 12, 4 << 20, 96 << 10] {
            assert_eq!(
                BlockSize::new(bad),
                Err(SizeError::InvalidBlockSize { bytes: bad })
            );
        }
        for good in [4 << 10, 8 << 10, 64 << 10, 1 << 20, 2 << 20] {
            assert_eq!(BlockSize::new(good).unwrap().bytes_u64(), good);
        }
    }

    #[test]
    fn block_size_partial_last_block_has_its_true_length() {
        let bs = BlockSize::new(64 << 10).unwrap();
        let image = (64 << 10) * 3 + 100;
        assert_eq!(bs.blocks_for(image), 4);
        assert_eq!(bs.len_in_image(2, image), 64 << 10);
        assert_eq!(bs.len_in_image(3, image), 100);
        assert_eq!(bs.len_in_image(4, image), 0);
    }

    proptest! {
        #[test]
        fn block_index_and_offset_agree(shift in 12u32..=21, offset in 0u64..(1 << 40)) {
            let bs = BlockSize::new(1 << shift).unwrap();
            let index = bs.index_of(offset);
            let start = bs.offset_of(index).unwrap();
            prop_assert!(start <= offset && offset < start + bs.bytes_u64());
        }
    }
}
