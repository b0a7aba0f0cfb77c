//! Where the block cache's blocks come from: a store the mount owns (read and written), or a
//! detached [`StoreReader`] (read only).

use crate::codec::BlockKind;
use crate::layout::BlockSize;
use crate::store::{DiskStore, StoreError, StoreReader};

/// The source of a mount's blocks, and for a store also where written blocks go.
#[derive(Debug)]
pub(super) enum Backing {
    /// A store owned by the mount: dirty blocks are put into it and committed. Boxed: a
    /// store is far larger than a reader.
    Store(Box<DiskStore>),
    /// A read-only view of a store's image as it was when the reader was taken; the store
    /// itself stays with its owner, who may go on writing it.
    Reader(StoreReader),
}

impl Backing {
    /// True when nothing can be written through the mount.
    pub(super) fn is_read_only(&self) -> bool {
        matches!(self, Self::Reader(_))
    }

    /// Bytes in the image.
    pub(super) fn image_size(&self) -> u64 {
        match self {
            Self::Store(store) => store.image_size(),
            Self::Reader(reader) => reader.image_size(),
        }
    }

    /// Bytes per block.
    pub(super) fn block_size(&self) -> BlockSize {
        match self {
            Self::Store(store) => store.block_size(),
            Self::Reader(reader) => reader.block_size(),
        }
    }

    /// Blocks in the image.
    pub(super) fn blocks(&self) -> u64 {
        match self {
            Self::Store(store) => store.blocks(),
            Self::Reader(reader) => reader.block_size().blocks_for(reader.image_size()),
        }
    }

    /// Length of `block` (the last one may be partial; zero past the end).
    pub(super) fn block_len(&self, block: u64) -> usize {
        match self {
            Self::Store(store) => store.block_len(block),
            Self::Reader(reader) => reader.block_size().len_in_image(block, reader.image_size()),
        }
    }

    /// Reads and decodes `block` into `out` (exactly the block's length).
    pub(super) fn get(&self, block: u64, out: &mut [u8]) -> Result<Option<BlockKind>, StoreError> {
        match self {
            Self::Store(store) => store.get(block, out),
            Self::Reader(reader) => reader.get(block, out),
        }
    }

    /// True if the store holds writes not yet committed; never for a reader.
    pub(super) fn has_pending(&self) -> bool {
        match self {
            Self::Store(store) => store.has_pending(),
            Self::Reader(_) => false,
        }
    }

    /// The store to write to; `None` for a reader.
    pub(super) fn writable(&mut self) -> Option<&mut DiskStore> {
        match self {
            Self::Store(store) => Some(store),
            Self::Reader(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuse::tests::{store_with_image, BS};

    #[test]
    fn backing_reader_has_the_geometry_of_its_store() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 3 * BS as u64 + 100);
        let reader = Backing::Reader(store.reader());

        assert_eq!(reader.image_size(), store.image_size());
        assert_eq!(reader.block_size(), store.block_size());
        assert_eq!(reader.blocks(), store.blocks());
        for block in 0..=store.blocks() {
            assert_eq!(reader.block_len(block), store.block_len(block), "{block}");
        }
    }

    #[test]
    fn backing_reader_is_read_only_and_never_pending() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _) = store_with_image(dir.path(), 2 * BS as u64);
        store.put(0, &[1; BS]).unwrap();
        let mut reader = Backing::Reader(store.reader());

        assert!(reader.is_read_only());
        assert!(!reader.has_pending());
        assert!(reader.writable().is_none());
    }

    #[test]
    fn backing_store_is_writable_and_reports_pending_writes() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _) = store_with_image(dir.path(), 2 * BS as u64);
        store.put(1, &[2; BS]).unwrap();
        let mut backing = Backing::Store(Box::new(store));

        assert!(!backing.is_read_only());
        assert!(backing.has_pending());
        assert!(backing.writable().is_some());
    }
}
