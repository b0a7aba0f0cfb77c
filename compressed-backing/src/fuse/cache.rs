//! The decompressed-block cache between the kernel's requests and the store (or reader).

use std::sync::Arc;

use crate::store::StoreError;

use super::backing::Backing;
use super::{bump, Counters, FuseError};

/// `entry_of` value of a block that is not cached.
const NOT_CACHED: u32 = u32::MAX;

/// One cache entry: a decompressed block.
#[derive(Debug)]
struct Entry {
    /// The block held; `None` for a free entry.
    block: Option<u64>,
    /// Block-size bytes; a partial last block uses a prefix.
    data: Box<[u8]>,
    /// Changed since it was loaded or last written back.
    dirty: bool,
    /// Used since the clock hand last passed.
    referenced: bool,
}

/// How a missing block's entry is filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fill {
    /// Read and decode the block from the store.
    Load,
    /// Leave it as is: the caller overwrites the whole block.
    Overwrite,
}

/// A bounded clock cache of decompressed blocks in front of a store, with dirty flags. In
/// front of a reader it only reads: writes are refused and no entry is ever dirty.
#[derive(Debug)]
pub(super) struct BlockCache {
    store: Backing,
    counters: Arc<Counters>,
    capacity: usize,
    /// Per block of the image: its index in `entries`, or `NOT_CACHED`.
    entry_of: Vec<u32>,
    entries: Vec<Entry>,
    /// Clock hand: the next entry considered for eviction.
    hand: usize,
    /// The store holds writes not yet committed.
    uncommitted: bool,
}

/// Index of a block in per-block arrays; blocks are below `Backing::blocks()`, the length
/// of the store's (or reader's) own slot array.
fn block_index(block: u64) -> usize {
    usize::try_from(block).expect("block numbers index an in-memory array")
}

impl BlockCache {
    pub(super) fn new(store: Backing, cache_blocks: usize, counters: Arc<Counters>) -> Self {
        let blocks = block_index(store.blocks());
        let max_entries = usize::try_from(NOT_CACHED).unwrap_or(usize::MAX);
        let capacity = cache_blocks.min(blocks).clamp(1, max_entries);
        Self {
            uncommitted: store.has_pending(),
            entry_of: vec![NOT_CACHED; blocks],
            entries: Vec::with_capacity(capacity),
            store,
            counters,
            capacity,
            hand: 0,
        }
    }

    /// Bytes `[offset, offset + size)` clipped to the image; empty at or past its end. Fails
    /// as a whole if any block cannot be read: a short read would be filled with zeros.
    pub(super) fn read(&mut self, offset: u64, size: u32) -> Result<Vec<u8>, FuseError> {
        let image_size = self.store.image_size();
        let end = offset.saturating_add(u64::from(size)).min(image_size);
        let mut out = Vec::with_capacity(usize::try_from(end.saturating_sub(offset)).unwrap_or(0));
        let mut pos = offset;
        while pos < end {
            let (block, in_block, take) = self.span(pos, end);
            let i = self.entry_for(block, Fill::Load)?;
            out.extend_from_slice(&self.entries[i].data[in_block..in_block + take]);
            pos += take as u64;
        }
        Ok(out)
    }

    /// Writes `data` at `offset`, clipped to the image; returns the bytes written. Fails only
    /// if nothing was written; a failure after some blocks gives a short count. Always fails
    /// in front of a reader.
    pub(super) fn write(&mut self, offset: u64, data: &[u8]) -> Result<usize, FuseError> {
        if self.store.is_read_only() {
            return Err(FuseError::ReadOnly);
        }
        let image_size = self.store.image_size();
        let end = offset.saturating_add(data.len() as u64).min(image_size);
        let mut pos = offset;
        let mut written = 0;
        while pos < end {
            let (block, in_block, take) = self.span(pos, end);
            let fill = if in_block == 0 && take == self.store.block_len(block) {
                Fill::Overwrite
            } else {
                Fill::Load
            };
            let i = match self.entry_for(block, fill) {
                Ok(i) => i,
                Err(err) if written == 0 => return Err(err),
                Err(_) => break,
            };
            let entry = &mut self.entries[i];
            entry.data[in_block..in_block + take].copy_from_slice(&data[written..written + take]);
            entry.dirty = true;
            written += take;
            pos += take as u64;
        }
        Ok(written)
    }

    /// The block holding byte `pos`, the offset of `pos` in it, and how many bytes from there
    /// up to `end` lie in that block.
    fn span(&self, pos: u64, end: u64) -> (u64, usize, usize) {
        let block_size = self.store.block_size();
        let block = block_size.index_of(pos);
        let start = block_size
            .offset_of(block)
            .expect("the block holds a byte of the image");
        // Below the block size, which is at most 2 MiB.
        let in_block = (pos - start) as usize;
        let in_range = usize::try_from(end - pos).unwrap_or(usize::MAX);
        let take = (self.store.block_len(block) - in_block).min(in_range);
        (block, in_block, take)
    }

    /// The entry holding `block`, filling a free or evicted one on a miss.
    fn entry_for(&mut self, block: u64, fill: Fill) -> Result<usize, FuseError> {
        let cached = self.entry_of[block_index(block)];
        if cached != NOT_CACHED {
            let i = cached as usize;
            self.entries[i].referenced = true;
            bump(&self.counters.cache_hits, 1);
            return Ok(i);
        }
        bump(&self.counters.cache_misses, 1);
        let i = self.free_entry()?;
        let len = self.store.block_len(block);
        let entry = &mut self.entries[i];
        if fill == Fill::Load {
            self.store
                .get(block, &mut entry.data[..len])
                .map_err(|source| FuseError::Read { block, source })?;
            bump(&self.counters.blocks_decompressed, 1);
        }
        entry.block = Some(block);
        entry.dirty = false;
        entry.referenced = true;
        self.entry_of[block_index(block)] = u32::try_from(i).expect("capacity is below NOT_CACHED");
        Ok(i)
    }

    /// A free entry: a new one while below capacity, else one evicted by the clock (written
    /// back first if dirty; if that fails the entry stays cached and dirty).
    fn free_entry(&mut self) -> Result<usize, FuseError> {
        if self.entries.len() < self.capacity {
            self.entries.push(Entry {
                block: None,
                data: vec![0; self.store.block_size().bytes()].into_boxed_slice(),
                dirty: false,
                referenced: false,
            });
            return Ok(self.entries.len() - 1);
        }
        // Ends within two sweeps: the first clears every referenced bit it passes.
        loop {
            let i = self.hand;
            self.hand = (self.hand + 1) % self.entries.len();
            let entry = &mut self.entries[i];
            let Some(block) = entry.block else {
                return Ok(i);
            };
            if entry.referenced {
                entry.referenced = false;
                continue;
            }
            self.write_entry(i)?;
            self.entry_of[block_index(block)] = NOT_CACHED;
            self.entries[i].block = None;
            return Ok(i);
        }
    }

    /// Puts entry `i` into the store if it is dirty.
    fn write_entry(&mut self, i: usize) -> Result<(), FuseError> {
        let entry = &mut self.entries[i];
        let Some(block) = entry.block.filter(|_| entry.dirty) else {
            return Ok(());
        };
        let len = self.store.block_len(block);
        // A reader's cache refuses writes, so it never has a dirty entry.
        let Some(store) = self.store.writable() else {
            return Err(FuseError::ReadOnly);
        };
        match store.put(block, &entry.data[..len]) {
            Ok(_) => {
                entry.dirty = false;
                self.uncommitted = true;
                bump(&self.counters.blocks_written_back, 1);
                Ok(())
            }
            Err(source) => {
                bump(&self.counters.writeback_errors, 1);
                Err(FuseError::WriteBack { block, source })
            }
        }
    }

    /// Puts every dirty block (in block order) and commits. Blocks that fail stay dirty; what
    /// was put is committed anyway. Returns the first failure.
    pub(super) fn write_back(&mut self) -> Result<(), FuseError> {
        let mut dirty: Vec<(u64, usize)> = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, entry)| entry.dirty)
            .filter_map(|(i, entry)| entry.block.map(|block| (block, i)))
            .collect();
        dirty.sort_unstable();
        let mut first_error = None;
        for (_, i) in dirty {
            if let Err(err) = self.write_entry(i) {
                first_error.get_or_insert(err);
            }
        }
        let committed = self.commit();
        match first_error {
            Some(err) => Err(err),
            None => committed,
        }
    }

    /// Commits the store if it holds uncommitted writes.
    fn commit(&mut self) -> Result<(), FuseError> {
        if !self.uncommitted {
            return Ok(());
        }
        // Only a put sets `uncommitted`, and a reader's cache never puts.
        let Some(store) = self.store.writable() else {
            return Err(FuseError::ReadOnly);
        };
        match store.commit() {
            Ok(_) => {}
            // The new generation is durable; only reclaiming space failed.
            Err(StoreError::CompactionFailed { .. }) => {
                bump(&self.counters.compaction_errors, 1);
            }
            Err(source) => {
                bump(&self.counters.writeback_errors, 1);
                return Err(FuseError::Commit { source });
            }
        }
        self.uncommitted = false;
        bump(&self.counters.commits, 1);
        Ok(())
    }

    /// Cached blocks not yet written to the store.
    #[cfg(test)]
    fn dirty_blocks(&self) -> usize {
        self.entries.iter().filter(|entry| entry.dirty).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuse::tests::{pattern, store_with_image, BS};
    use crate::store::{DiskStore, StoreReader};
    use fuser::Errno;
    use proptest::prelude::*;
    use std::fs;
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::Ordering;

    fn cache(store: DiskStore, blocks: usize) -> (BlockCache, Arc<Counters>) {
        let counters = Arc::new(Counters::default());
        (
            BlockCache::new(
                Backing::Store(Box::new(store)),
                blocks,
                Arc::clone(&counters),
            ),
            counters,
        )
    }

    fn reader_cache(reader: StoreReader, blocks: usize) -> (BlockCache, Arc<Counters>) {
        let counters = Arc::new(Counters::default());
        (
            BlockCache::new(Backing::Reader(reader), blocks, Arc::clone(&counters)),
            counters,
        )
    }

    /// The store behind a writable cache.
    fn disk(cache: &BlockCache) -> &DiskStore {
        match &cache.store {
            Backing::Store(store) => store,
            Backing::Reader(_) => panic!("a writable cache is backed by a store"),
        }
    }

    fn store_image(store: &DiskStore) -> Vec<u8> {
        let mut image = Vec::new();
        for block in 0..store.blocks() {
            let mut data = vec![0xEE; store.block_len(block)];
            store.get(block, &mut data).unwrap();
            image.extend_from_slice(&data);
        }
        image
    }

    #[test]
    fn cache_unaligned_read_across_blocks_matches_image() {
        let dir = tempfile::tempdir().unwrap();
        let (store, image) = store_with_image(dir.path(), 8 * BS as u64);
        let (mut cache, _) = cache(store, 4);

        let data = cache.read(BS as u64 - 3, 2 * BS as u32 + 10).unwrap();

        assert_eq!(data, image[BS - 3..3 * BS + 7]);
    }

    #[test]
    fn cache_read_at_or_past_end_is_short_or_empty() {
        let dir = tempfile::tempdir().unwrap();
        let (store, image) = store_with_image(dir.path(), 4 * BS as u64);
        let (mut cache, _) = cache(store, 4);

        let tail = cache.read(4 * BS as u64 - 100, 4096).unwrap();
        let past = cache.read(4 * BS as u64, 4096).unwrap();
        let far = cache.read(u64::MAX - 10, 4096).unwrap();

        assert_eq!(tail, image[4 * BS - 100..]);
        assert!(past.is_empty());
        assert!(far.is_empty());
    }

    #[test]
    fn cache_partial_last_block_reads_and_writes_its_length() {
        let dir = tempfile::tempdir().unwrap();
        let image_size = 3 * BS as u64 + 1000;
        let (store, mut image) = store_with_image(dir.path(), image_size);
        let (mut cache, _) = cache(store, 2);

        let written = cache.write(3 * BS as u64 + 990, &[7; 40]).unwrap();
        image[3 * BS + 990..].fill(7);
        cache.write_back().unwrap();

        assert_eq!(written, 10);
        assert_eq!(cache.read(3 * BS as u64, 4096).unwrap(), image[3 * BS..]);
        assert_eq!(store_image(disk(&cache)), image);
    }

    #[test]
    fn cache_unaligned_write_merges_with_old_bytes_and_stays_dirty() {
        let dir = tempfile::tempdir().unwrap();
        let (store, mut image) = store_with_image(dir.path(), 8 * BS as u64);
        let (mut cache, counters) = cache(store, 8);
        let new = pattern(99, BS + 200);

        let written = cache.write(2 * BS as u64 - 100, &new).unwrap();
        image[2 * BS - 100..3 * BS + 100].copy_from_slice(&new);

        assert_eq!(written, new.len());
        assert_eq!(cache.read(0, 8 * BS as u32).unwrap(), image);
        assert_eq!(cache.dirty_blocks(), 3);
        assert_eq!(counters.blocks_written_back.load(Ordering::Relaxed), 0);
        // Not in the store until written back.
        assert_ne!(store_image(disk(&cache)), image);
    }

    #[test]
    fn cache_write_back_puts_and_commits_dirty_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let (store, mut image) = store_with_image(dir.path(), 8 * BS as u64);
        let generation = store.generation();
        let (mut cache, counters) = cache(store, 8);
        cache.write(5 * BS as u64 + 1, &[0xAB; 10]).unwrap();
        image[5 * BS + 1..5 * BS + 11].fill(0xAB);

        cache.write_back().unwrap();
        let store = cache.store;
        drop(store);
        let reopened = DiskStore::open(dir.path()).unwrap();

        assert_eq!(store_image(&reopened), image);
        assert!(reopened.generation() > generation);
        assert_eq!(counters.blocks_written_back.load(Ordering::Relaxed), 1);
        assert_eq!(counters.commits.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn cache_write_back_without_changes_does_not_commit() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 4 * BS as u64);
        let generation = store.generation();
        let (mut cache, counters) = cache(store, 4);
        cache.read(0, 4 * BS as u32).unwrap();

        cache.write_back().unwrap();

        assert_eq!(disk(&cache).generation(), generation);
        assert_eq!(counters.commits.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn cache_eviction_of_dirty_block_writes_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 8 * BS as u64);
        let (mut cache, counters) = cache(store, 2);

        for block in 0..4u64 {
            cache
                .write(block * BS as u64 + 10, &[block as u8; 5])
                .unwrap();
        }

        assert_eq!(cache.entries.len(), 2);
        assert_eq!(cache.dirty_blocks(), 2);
        assert_eq!(counters.blocks_written_back.load(Ordering::Relaxed), 2);
        let mut block0 = vec![0; BS];
        cache.store.get(0, &mut block0).unwrap();
        assert_eq!(block0[10..15], [0; 5]);
    }

    #[test]
    fn cache_whole_block_write_skips_decompression() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 8 * BS as u64);
        let (mut cache, counters) = cache(store, 8);

        cache.write(BS as u64, &vec![3; 2 * BS]).unwrap();

        assert_eq!(counters.blocks_decompressed.load(Ordering::Relaxed), 0);
        assert_eq!(counters.cache_misses.load(Ordering::Relaxed), 2);
        assert_eq!(
            cache.read(BS as u64, 2 * BS as u32).unwrap(),
            vec![3; 2 * BS]
        );
    }

    #[test]
    fn cache_repeated_reads_hit_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 4 * BS as u64);
        let (mut cache, counters) = cache(store, 4);

        cache.read(0, BS as u32).unwrap();
        cache.read(100, 10).unwrap();

        assert_eq!(counters.cache_misses.load(Ordering::Relaxed), 1);
        assert_eq!(counters.cache_hits.load(Ordering::Relaxed), 1);
        assert_eq!(counters.blocks_decompressed.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn cache_failed_write_back_keeps_block_dirty() {
        let dir = tempfile::tempdir().unwrap();
        let (store, mut image) = store_with_image(dir.path(), 4 * BS as u64);
        drop(store);
        let read_only = DiskStore::open_read_only(dir.path()).unwrap();
        let (mut cache, counters) = cache(read_only, 4);
        cache.write(100, &[9; 3]).unwrap();
        image[100..103].fill(9);

        let err = cache.write_back().unwrap_err();

        assert!(
            matches!(err, FuseError::WriteBack { block: 0, .. }),
            "{err:?}"
        );
        assert_eq!(err.errno(), Errno::EIO);
        assert_eq!(cache.dirty_blocks(), 1);
        assert_eq!(cache.read(0, 4 * BS as u32).unwrap(), image);
        assert_eq!(counters.writeback_errors.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn cache_failed_eviction_keeps_victim_and_fails_the_miss() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 4 * BS as u64);
        drop(store);
        let read_only = DiskStore::open_read_only(dir.path()).unwrap();
        let (mut cache, _) = cache(read_only, 1);
        cache.write(0, &[1]).unwrap();

        let err = cache.read(BS as u64, 1).unwrap_err();

        assert!(
            matches!(err, FuseError::WriteBack { block: 0, .. }),
            "{err:?}"
        );
        assert_eq!(cache.dirty_blocks(), 1);
        assert_eq!(cache.read(0, 1).unwrap(), [1]);
    }

    #[test]
    fn cache_corrupt_block_read_fails_instead_of_returning_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 4 * BS as u64);
        drop(store);
        let segment = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.to_string_lossy().ends_with(".dat"))
            .unwrap();
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&segment)
            .unwrap();
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, 10).unwrap();
        file.write_all_at(&[byte[0] ^ 0xFF], 10).unwrap();
        let (mut cache, _) = cache(DiskStore::open(dir.path()).unwrap(), 4);

        let err = cache.read(0, 100).unwrap_err();

        assert!(matches!(err, FuseError::Read { block: 0, .. }), "{err:?}");
        assert_eq!(err.errno(), Errno::EIO);
        assert!(cache.entries.iter().all(|e| e.block.is_none()));
    }

    #[test]
    fn cache_capacity_is_bounded_by_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 3 * BS as u64);

        let (cache, _) = cache(store, 1000);

        assert_eq!(cache.capacity, 3);
    }

    #[test]
    fn cache_reader_reads_the_image_as_of_the_reader_after_later_writes() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, image) = store_with_image(dir.path(), 6 * BS as u64 + 300);
        let reader = store.reader();
        for block in 0..store.blocks() {
            let data = pattern(block + 1000, store.block_len(block));
            store.put(block, &data).unwrap();
        }
        store.commit().unwrap();
        let (mut cache, counters) = reader_cache(reader, 3);

        let whole = cache.read(0, 8 * BS as u32).unwrap();
        let unaligned = cache.read(2 * BS as u64 - 7, BS as u32 + 20).unwrap();

        assert_eq!(whole, image);
        assert_eq!(unaligned, image[2 * BS - 7..3 * BS + 13]);
        assert_ne!(store_image(&store), image);
        assert!(counters.blocks_decompressed.load(Ordering::Relaxed) >= 7);
        assert!(cache.entries.len() <= 3);
    }

    #[test]
    fn cache_reader_write_is_refused_with_erofs_and_caches_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (store, image) = store_with_image(dir.path(), 4 * BS as u64);
        let (mut cache, counters) = reader_cache(store.reader(), 4);

        let partial = cache.write(10, &[1; 10]).unwrap_err();
        let whole = cache.write(BS as u64, &[2; BS]).unwrap_err();
        let past_end = cache.write(4 * BS as u64, &[3]).unwrap_err();

        for err in [&partial, &whole, &past_end] {
            assert!(matches!(err, FuseError::ReadOnly), "{err:?}");
            assert_eq!(err.errno(), Errno::EROFS);
        }
        assert!(cache.entries.is_empty());
        assert_eq!(counters.cache_misses.load(Ordering::Relaxed), 0);
        assert_eq!(cache.read(0, 4 * BS as u32).unwrap(), image);
    }

    #[test]
    fn cache_reader_write_back_neither_puts_nor_commits() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 4 * BS as u64);
        let generation = store.generation();
        let (mut cache, counters) = reader_cache(store.reader(), 2);
        cache.read(0, 4 * BS as u32).unwrap();
        let _ = cache.write(0, &[1]);

        cache.write_back().unwrap();

        assert_eq!(cache.dirty_blocks(), 0);
        assert_eq!(store.generation(), generation);
        assert_eq!(counters.blocks_written_back.load(Ordering::Relaxed), 0);
        assert_eq!(counters.commits.load(Ordering::Relaxed), 0);
        assert_eq!(counters.writeback_errors.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn cache_reader_eviction_reads_every_block_through_one_entry() {
        let dir = tempfile::tempdir().unwrap();
        let (store, image) = store_with_image(dir.path(), 5 * BS as u64 + 1);
        let (mut cache, counters) = reader_cache(store.reader(), 1);

        let mut read = Vec::new();
        for offset in (0..image.len() as u64).step_by(1000) {
            read.extend(cache.read(offset, 1000).unwrap());
        }

        assert_eq!(read, image);
        assert_eq!(cache.entries.len(), 1);
        assert_eq!(counters.blocks_decompressed.load(Ordering::Relaxed), 6);
    }

    #[test]
    fn cache_reader_corrupt_block_read_fails_instead_of_returning_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (store, image) = store_with_image(dir.path(), 4 * BS as u64);
        let reader = store.reader();
        drop(store);
        let segment = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.to_string_lossy().ends_with(".dat"))
            .unwrap();
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&segment)
            .unwrap();
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, 10).unwrap();
        file.write_all_at(&[byte[0] ^ 0xFF], 10).unwrap();
        let (mut cache, _) = reader_cache(reader, 4);

        let err = cache.read(0, 100).unwrap_err();
        let after = cache.read(BS as u64, BS as u32).unwrap();

        assert!(matches!(err, FuseError::Read { block: 0, .. }), "{err:?}");
        assert_eq!(err.errno(), Errno::EIO);
        assert_eq!(after, image[BS..2 * BS]);
        assert!(cache.entries.iter().all(|e| e.block != Some(0)));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Write { offset: u64, len: usize, seed: u64 },
        Read { offset: u64, len: u32 },
        WriteBack,
    }

    fn op(image_size: u64) -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..image_size + 100, 1..3 * BS, any::<u64>())
                .prop_map(|(offset, len, seed)| Op::Write { offset, len, seed }),
            3 => (0..image_size + 100, 1..3 * BS as u32)
                .prop_map(|(offset, len)| Op::Read { offset, len }),
            1 => Just(Op::WriteBack),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn cache_random_reads_and_writes_match_a_flat_model(
            ops in prop::collection::vec(op(5 * BS as u64 + 1234), 1..40),
            capacity in 1usize..4,
        ) {
            let dir = tempfile::tempdir().unwrap();
            let image_size = 5 * BS as u64 + 1234;
            let (store, mut model) = store_with_image(dir.path(), image_size);
            let (mut cache, _) = cache(store, capacity);

            for op in ops {
                match op {
                    Op::Write { offset, len, seed } => {
                        let data = pattern(seed, len);
                        let written = cache.write(offset, &data).unwrap();
                        let expected = image_size.saturating_sub(offset).min(len as u64) as usize;
                        prop_assert_eq!(written, expected);
                        if written > 0 {
                            let start = offset as usize;
                            model[start..start + written].copy_from_slice(&data[..written]);
                        }
                    }
                    Op::Read { offset, len } => {
                        let data = cache.read(offset, len).unwrap();
                        let start = (offset as usize).min(model.len());
                        let end = (start + len as usize).min(model.len());
                        prop_assert_eq!(&data[..], &model[start..end]);
                    }
                    Op::WriteBack => cache.write_back().unwrap(),
                }
            }
            cache.write_back().unwrap();
            drop(cache);
            let reopened = DiskStore::open(dir.path()).unwrap();
            prop_assert_eq!(store_image(&reopened), model);
        }
    }
}
