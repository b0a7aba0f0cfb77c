//! Block geometry: the size of a block and how an image is cut into blocks. All block
//! arithmetic of the crate lives here (sizes as people write them: `basics::size`).

use std::fmt;
use std::str::FromStr;

/// Smallest supported block: one page.
pub const MIN_BLOCK_SIZE: u64 = 4 << 10;
/// Largest supported block: one huge page.
pub const MAX_BLOCK_SIZE: u64 = 2 << 20;
/// Default block: 64 KiB, the unit of compression and prefetch.
pub const DEFAULT_BLOCK_SIZE: u64 = 64 << 10;

/// An invalid block size, or one that does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SizeError {
    /// The text is not a size.
    #[error(transparent)]
    Parse(#[from] basics::SizeError),
    /// A block size that is not a power of two between 4 KiB and 2 MiB.
    #[error("block size {bytes} is invalid: it must be a power of two from 4 KiB to 2 MiB")]
    InvalidBlockSize {
        /// The rejected size in bytes.
        bytes: u64,
    },
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
        self.bytes() / basics::PageSize::BASE.usize()
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
        f.write_str(&basics::format_bytes(self.bytes_u64()))
    }
}

impl FromStr for BlockSize {
    type Err = SizeError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::new(basics::parse_size(text)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
