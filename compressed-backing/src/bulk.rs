//! Parallel bulk transfer between a RAM image and a `DiskStore`.
//!
//! Writing: worker threads claim batches of consecutive blocks (4 MiB of image by default),
//! encode them straight from the source's memory where it has any, and append each batch to
//! the store with one write, taking turns on the store's lock: while one appends, the others
//! encode. Each worker keeps one batch buffer for the whole run, so memory stays at one batch
//! per thread whatever the image size. (Appends of 4 MiB rather than 1 MiB: fewer system
//! calls and lock handovers; docs/bench/store.md measures both.) Reading:
//! worker threads decode blocks in parallel and give each to a sink (a file, guest memory).

use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};
use std::thread;

use crate::codec::{BlockKind, Encoder};
use crate::store::{DiskStore, EncodedBatch, StoreError};

/// Where a bulk write reads blocks from. Called from several threads at once.
pub trait BlockSource: Sync {
    /// The bytes of block `block` (exactly `scratch.len()` of them, the block's length):
    /// `Some` slice of the source's own memory, which must stay valid and unchanged for the
    /// whole transfer (a block stored raw is then written from it without a copy), or `None`
    /// after filling `scratch`.
    fn block<'s>(&'s self, block: u64, scratch: &mut [u8]) -> io::Result<Option<&'s [u8]>>;

    /// Called once on each worker thread before its first block, with the block size: a
    /// source with per-thread buffers allocates them here, so that a transfer allocates
    /// nothing once it has begun. Nothing by default.
    fn prepare(&self, _block_bytes: usize) {}
}

/// A RAM image in a file.
#[derive(Debug)]
pub struct FileSource<'a> {
    file: &'a std::fs::File,
    block_size: u64,
}

impl<'a> FileSource<'a> {
    /// Reads blocks of `block_size` bytes from `file`.
    pub fn new(file: &'a std::fs::File, block_size: u64) -> Self {
        Self { file, block_size }
    }
}

impl BlockSource for FileSource<'_> {
    fn block<'s>(&'s self, block: u64, scratch: &mut [u8]) -> io::Result<Option<&'s [u8]>> {
        self.file.read_exact_at(scratch, block * self.block_size)?;
        Ok(None)
    }
}

/// A RAM image in memory.
#[derive(Debug, Clone, Copy)]
pub struct SliceSource<'a> {
    bytes: &'a [u8],
    block_size: usize,
}

impl<'a> SliceSource<'a> {
    /// Reads blocks of `block_size` bytes from `bytes`.
    pub fn new(bytes: &'a [u8], block_size: usize) -> Self {
        Self { bytes, block_size }
    }
}

impl BlockSource for SliceSource<'_> {
    fn block<'s>(&'s self, block: u64, scratch: &mut [u8]) -> io::Result<Option<&'s [u8]>> {
        let start = usize::try_from(block)
            .ok()
            .and_then(|b| b.checked_mul(self.block_size))
            .filter(|&start| start + scratch.len() <= self.bytes.len())
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        Ok(Some(&self.bytes[start..start + scratch.len()]))
    }
}

/// Default image bytes per batch: one append per 4 MiB.
pub const DEFAULT_BATCH_BYTES: usize = 4 << 20;

/// Parallelism and batching of bulk transfers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BulkOptions {
    /// Worker threads (at least 1).
    pub threads: usize,
    /// Image bytes per batch (at least one block): one append per batch when writing; memory
    /// is about one batch per thread.
    pub batch_bytes: usize,
}

impl Default for BulkOptions {
    fn default() -> Self {
        Self::with_threads(thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

impl BulkOptions {
    /// Defaults with `threads` workers.
    pub fn with_threads(threads: usize) -> Self {
        let threads = threads.max(1);
        Self {
            threads,
            batch_bytes: DEFAULT_BATCH_BYTES,
        }
    }

    /// Blocks per batch for blocks of `block_size` bytes.
    fn batch_blocks(&self, block_size: usize) -> usize {
        (self.batch_bytes / block_size.max(1)).max(1)
    }
}

/// What a bulk transfer moved.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct BulkReport {
    /// Blocks transferred.
    pub blocks: u64,
    /// Logical bytes transferred.
    pub bytes: u64,
    /// Payload bytes written to or read from segments.
    pub stored_bytes: u64,
    /// Blocks that were all zeros (or absent, when reading).
    pub zero_blocks: u64,
    /// Blocks of one repeated byte.
    pub fill_blocks: u64,
    /// Blocks stored uncompressed.
    pub raw_blocks: u64,
    /// Blocks stored compressed.
    pub compressed_blocks: u64,
}

impl BulkReport {
    fn count(&mut self, kind: Option<BlockKind>, len: usize, stored: usize) {
        self.blocks += 1;
        self.bytes += len as u64;
        self.stored_bytes += stored as u64;
        match kind {
            None | Some(BlockKind::Zero) => self.zero_blocks += 1,
            Some(BlockKind::Fill) => self.fill_blocks += 1,
            Some(BlockKind::Raw) => self.raw_blocks += 1,
            Some(BlockKind::Lz4 | BlockKind::Zstd) => self.compressed_blocks += 1,
        }
    }

    fn merge(&mut self, other: &Self) {
        self.blocks += other.blocks;
        self.bytes += other.bytes;
        self.stored_bytes += other.stored_bytes;
        self.zero_blocks += other.zero_blocks;
        self.fill_blocks += other.fill_blocks;
        self.raw_blocks += other.raw_blocks;
        self.compressed_blocks += other.compressed_blocks;
    }
}

/// Receives blocks read in bulk: index, kind (`None` when absent) and bytes. Called from
/// several threads at once.
pub type BlockSink<'a> = dyn Fn(u64, Option<BlockKind>, &[u8]) -> io::Result<()> + Sync + 'a;

/// All block indices of `store`'s image, in order.
pub fn all_blocks(store: &DiskStore) -> Vec<u64> {
    (0..store.blocks()).collect()
}

/// Reads `blocks` from `source`, encodes them in parallel and writes them to `store`.
/// Nothing is committed: the caller commits, or rolls back on error. `progress` receives the
/// logical bytes of each batch as it lands.
pub fn write_blocks<'s>(
    store: &mut DiskStore,
    source: &'s (dyn BlockSource + 's),
    blocks: &[u64],
    options: &BulkOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<BulkReport, StoreError> {
    let store = Mutex::new(store);
    let turn = || Turn(lock(&store));
    write_groups(
        &turn,
        source,
        blocks,
        options,
        usize::MAX,
        progress,
        |_, _| Ok::<(), StoreError>(()),
    )
}

/// The store of a [`write_blocks`], one writer at a time.
struct Turn<'a, 'b>(std::sync::MutexGuard<'a, &'b mut DiskStore>);

impl std::ops::Deref for Turn<'_, '_> {
    type Target = DiskStore;
    fn deref(&self) -> &DiskStore {
        &self.0
    }
}

impl std::ops::DerefMut for Turn<'_, '_> {
    fn deref_mut(&mut self) -> &mut DiskStore {
        &mut self.0
    }
}

/// Like [`write_blocks`], in groups of `group_blocks` consecutive entries of `blocks`: the
/// workers write one group, then wait while `on_group` runs on the caller's thread with the
/// group's blocks and what was written of them (to make the group durable and act on it),
/// then go on with the next group. The store is reached through `store`, which locks it; it
/// is not locked while `on_group` runs. The workers' buffers are allocated once, before the
/// first write, and [`BlockSource::prepare`] is called on each worker thread first. The first
/// error (of a worker or of `on_group`) ends the transfer after the group being written:
/// groups that `on_group` already took stay as it left them, the rest is not written, or
/// partly written and never committed.
pub fn write_groups<'s, G, E>(
    store: &(dyn Fn() -> G + Sync),
    source: &'s (dyn BlockSource + 's),
    blocks: &[u64],
    options: &BulkOptions,
    group_blocks: usize,
    progress: &(dyn Fn(u64) + Sync),
    mut on_group: impl FnMut(&[u64], &BulkReport) -> Result<(), E>,
) -> Result<BulkReport, E>
where
    G: std::ops::DerefMut<Target = DiskStore>,
    E: From<StoreError>,
{
    let (codec, block_size, image_size) = {
        let store = store();
        if let Some(&block) = blocks.iter().find(|&&b| b >= store.blocks()) {
            return Err(StoreError::BlockOutOfRange {
                block,
                blocks: store.blocks(),
            }
            .into());
        }
        (store.codec(), store.block_size(), store.image_size())
    };
    let batch_blocks = options.batch_blocks(block_size.bytes());
    let threads = options.threads.max(1);
    // The workers and this thread meet at `start` (a group is set, or `quit`) and at `done`
    // (the group is written).
    let start = Barrier::new(threads + 1);
    let done = Barrier::new(threads + 1);
    let quit = AtomicBool::new(false);
    let next = AtomicUsize::new(0);
    let end = AtomicUsize::new(0);
    let abort = AtomicBool::new(false);
    let first_error: Mutex<Option<StoreError>> = Mutex::new(None);
    let panicked: Mutex<Option<Box<dyn std::any::Any + Send>>> = Mutex::new(None);
    let group_report = Mutex::new(BulkReport::default());
    let fail = |e: StoreError| {
        abort.store(true, Ordering::Relaxed);
        lock(&first_error).get_or_insert(e);
    };
    let result = thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let mut worker = match Encoder::new(codec) {
                    Ok(encoder) => Some(Worker {
                        encoder,
                        block_size,
                        scratch: vec![0u8; block_size.bytes()],
                        batch: EncodedBatch::with_capacity(batch_blocks, block_size.bytes()),
                    }),
                    Err(e) => {
                        fail(StoreError::Codec(e));
                        None
                    }
                };
                source.prepare(block_size.bytes());
                loop {
                    start.wait();
                    if quit.load(Ordering::Acquire) {
                        break;
                    }
                    if let Some(worker) = &mut worker {
                        let written =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                let mut report = BulkReport::default();
                                let group = ..end.load(Ordering::Acquire);
                                let result = worker.write(
                                    store,
                                    source,
                                    blocks,
                                    group,
                                    &next,
                                    &abort,
                                    batch_blocks,
                                    image_size,
                                    &mut report,
                                    progress,
                                );
                                lock(&group_report).merge(&report);
                                result
                            }));
                        match written {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => fail(e),
                            Err(payload) => {
                                abort.store(true, Ordering::Relaxed);
                                lock(&panicked).get_or_insert(payload);
                            }
                        }
                    }
                    done.wait();
                }
            });
        }
        // Whatever happens below (an error, a panic of `on_group`), the workers are let go.
        let _release = Release {
            quit: &quit,
            start: &start,
        };
        let mut total = BulkReport::default();
        for (i, group) in blocks.chunks(group_blocks.max(1)).enumerate() {
            let first = i * group_blocks.max(1);
            next.store(first, Ordering::Relaxed);
            end.store(first + group.len(), Ordering::Release);
            start.wait();
            done.wait();
            if abort.load(Ordering::Relaxed) {
                break;
            }
            let report = std::mem::take(&mut *lock(&group_report));
            total.merge(&report);
            on_group(group, &report)?;
        }
        Ok(total)
    });
    if let Some(payload) = panicked.into_inner().unwrap_or_else(|p| p.into_inner()) {
        std::panic::resume_unwind(payload);
    }
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e.into());
    }
    result
}

/// Lets the workers of a [`write_groups`] go when dropped.
struct Release<'a> {
    quit: &'a AtomicBool,
    start: &'a Barrier,
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.quit.store(true, Ordering::Release);
        self.start.wait();
    }
}

/// One worker's encoder and buffers, kept for the whole transfer.
struct Worker<'s> {
    encoder: Encoder,
    block_size: crate::layout::BlockSize,
    scratch: Vec<u8>,
    batch: EncodedBatch<'s>,
}

impl<'s> Worker<'s> {
    /// Claims batches of `blocks[..group.end]` from `next` and writes them, until none is
    /// left or `abort`.
    #[allow(clippy::too_many_arguments)]
    fn write<G: std::ops::DerefMut<Target = DiskStore>>(
        &mut self,
        store: &(dyn Fn() -> G + Sync),
        source: &'s (dyn BlockSource + 's),
        blocks: &[u64],
        group: std::ops::RangeTo<usize>,
        next: &AtomicUsize,
        abort: &AtomicBool,
        batch_blocks: usize,
        image_size: u64,
        report: &mut BulkReport,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<(), StoreError> {
        while !abort.load(Ordering::Relaxed) {
            let start = next.fetch_add(batch_blocks, Ordering::Relaxed);
            if start >= group.end {
                break;
            }
            self.batch.clear();
            let mut bytes = 0;
            for &block in &blocks[start..(start + batch_blocks).min(group.end)] {
                let len = self.block_size.len_in_image(block, image_size);
                let shared = source
                    .block(block, &mut self.scratch[..len])
                    .map_err(|source| StoreError::Source { block, source })?;
                let encoded = self.encoder.encode(shared.unwrap_or(&self.scratch[..len]));
                let stored = if encoded.kind.has_data() {
                    encoded.payload.len()
                } else {
                    0
                };
                report.count(Some(encoded.kind), len, stored);
                match shared {
                    // Raw bytes of the source's own memory: written from there.
                    Some(bytes) if encoded.kind == BlockKind::Raw => {
                        self.batch.push_shared(block, bytes)
                    }
                    _ => self.batch.push(block, encoded),
                }
                bytes += len as u64;
            }
            store().put_batch(&self.batch)?;
            progress(bytes);
        }
        Ok(())
    }
}

/// Locks a mutex, ignoring poisoning (a panicking worker aborts the whole transfer anyway).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads `blocks` from `store` in parallel, decoding and checking each, and hands each to
/// `sink` with its kind (`None` for an absent block, which reads as zeros).
pub fn read_blocks(
    store: &DiskStore,
    blocks: &[u64],
    options: &BulkOptions,
    sink: &BlockSink<'_>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<BulkReport, StoreError> {
    let batch_blocks = options.batch_blocks(store.block_size().bytes());
    let next = AtomicUsize::new(0);
    let abort = AtomicBool::new(false);
    let first_error: Mutex<Option<StoreError>> = Mutex::new(None);
    let total = Mutex::new(BulkReport::default());
    thread::scope(|scope| {
        for _ in 0..options.threads.max(1) {
            scope.spawn(|| {
                let mut buf = vec![0u8; store.block_size().bytes()];
                let mut report = BulkReport::default();
                'work: while !abort.load(Ordering::Relaxed) {
                    let start = next.fetch_add(batch_blocks, Ordering::Relaxed);
                    if start >= blocks.len() {
                        break;
                    }
                    let mut bytes = 0;
                    for &block in &blocks[start..(start + batch_blocks).min(blocks.len())] {
                        let len = store.block_len(block);
                        let result = store.get(block, &mut buf[..len]).and_then(|kind| {
                            sink(block, kind, &buf[..len])
                                .map_err(|source| StoreError::Sink { block, source })?;
                            Ok(kind)
                        });
                        match result {
                            Ok(kind) => {
                                report.count(kind, len, store.stored_len(block));
                                bytes += len as u64;
                            }
                            Err(e) => {
                                abort.store(true, Ordering::Relaxed);
                                lock(&first_error).get_or_insert(e);
                                break 'work;
                            }
                        }
                    }
                    progress(bytes);
                }
                lock(&total).merge(&report);
            });
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(total.into_inner().unwrap_or_else(|p| p.into_inner()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{Codec, CodecConfig};
    use crate::layout::BlockSize;
    use crate::store::StoreConfig;

    fn image(len: usize) -> Vec<u8> {
        let mut state = 0x1234_5678_u64;
        (0..len)
            .map(|i| match (i / 65536) % 4 {
                0 => 0,
                1 => (i % 97) as u8,
                2 => {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                }
                _ => 0x5A,
            })
            .collect()
    }

    #[test]
    fn bulk_write_then_read_roundtrips_with_any_thread_count() {
        let len = (64 << 10) * 37 + 4096;
        let data = image(len);
        for threads in [1, 2, 5] {
            let dir = tempfile::tempdir().unwrap();
            let mut store = DiskStore::create(
                dir.path(),
                StoreConfig {
                    block_size: BlockSize::new(64 << 10).unwrap(),
                    codec: CodecConfig::new(Codec::Lz4),
                    image_size: len as u64,
                },
            )
            .unwrap();
            let options = BulkOptions::with_threads(threads);
            let blocks = all_blocks(&store);
            let written = AtomicUsize::new(0);
            let progress = |bytes: u64| {
                written.fetch_add(bytes as usize, Ordering::Relaxed);
            };
            let report = write_blocks(
                &mut store,
                &SliceSource::new(&data, 64 << 10),
                &blocks,
                &options,
                &progress,
            )
            .unwrap();
            store.commit().unwrap();
            assert_eq!(written.load(Ordering::Relaxed), len);
            assert_eq!(report.blocks, 38);
            assert!(
                report.zero_blocks >= 9 && report.fill_blocks >= 9,
                "{report:?}"
            );
            assert!(
                report.raw_blocks >= 9 && report.compressed_blocks >= 9,
                "{report:?}"
            );

            let out = Mutex::new(vec![0xEEu8; len]);
            let read = read_blocks(
                &store,
                &blocks,
                &options,
                &|block, _kind, bytes| {
                    let start = block as usize * (64 << 10);
                    out.lock().unwrap()[start..start + bytes.len()].copy_from_slice(bytes);
                    Ok(())
                },
                &|_| {},
            )
            .unwrap();
            assert_eq!(read.blocks, 38);
            assert_eq!(read.stored_bytes, report.stored_bytes);
            assert!(out.into_inner().unwrap() == data, "threads {threads}");
        }
    }

    struct FailingSource;
    impl BlockSource for FailingSource {
        fn block<'s>(&'s self, block: u64, scratch: &mut [u8]) -> io::Result<Option<&'s [u8]>> {
            if block == 20 {
                return Err(io::Error::other("injected read failure"));
            }
            scratch.fill(block as u8);
            Ok(None)
        }
    }

    #[test]
    fn bulk_write_source_error_stops_and_keeps_the_committed_image() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = DiskStore::create(
            dir.path(),
            StoreConfig {
                block_size: BlockSize::new(4096).unwrap(),
                codec: CodecConfig::new(Codec::Lz4),
                image_size: 64 * 4096,
            },
        )
        .unwrap();
        store.put(20, &[7u8; 4096]).unwrap();
        store.commit().unwrap();
        let blocks = all_blocks(&store);
        let err = write_blocks(
            &mut store,
            &FailingSource,
            &blocks,
            &BulkOptions::with_threads(2),
            &|_| {},
        )
        .unwrap_err();
        assert!(matches!(err, StoreError::Source { block: 20, .. }), "{err}");
        store.rollback().unwrap();
        let mut out = [0u8; 4096];
        store.get(20, &mut out).unwrap();
        assert_eq!(out, [7u8; 4096]);
        assert_eq!(store.kind(21).unwrap(), None);
    }

    fn small_store(dir: &std::path::Path, blocks: u64) -> DiskStore {
        DiskStore::create(
            dir,
            StoreConfig {
                block_size: BlockSize::new(4096).unwrap(),
                codec: CodecConfig::new(Codec::Lz4),
                image_size: blocks * 4096,
            },
        )
        .unwrap()
    }

    #[test]
    fn bulk_write_groups_hands_over_each_group_once_written() {
        let dir = tempfile::tempdir().unwrap();
        let store = Mutex::new(small_store(dir.path(), 38));
        let data = image(38 * 4096);
        let blocks: Vec<u64> = (0..38).collect();
        let mut groups = Vec::new();
        let report = write_groups(
            &|| lock(&store),
            &SliceSource::new(&data, 4096),
            &blocks,
            &BulkOptions::with_threads(3),
            8,
            &|_| {},
            |group, report| {
                // Every block of the group is in the store when it is handed over.
                let mut store = lock(&store);
                for &b in group {
                    let mut out = [0u8; 4096];
                    store.get(b, &mut out).unwrap();
                    assert!(out[..] == data[b as usize * 4096..][..4096], "block {b}");
                }
                assert_eq!(report.blocks, group.len() as u64);
                store.commit_uncached()?;
                groups.push(group.to_vec());
                Ok::<(), StoreError>(())
            },
        )
        .unwrap();
        assert_eq!(report.blocks, 38);
        let want: Vec<Vec<u64>> = blocks.chunks(8).map(<[u64]>::to_vec).collect();
        assert_eq!(groups, want);
    }

    #[test]
    fn bulk_write_groups_error_ends_after_the_groups_already_handed_over() {
        let dir = tempfile::tempdir().unwrap();
        let store = Mutex::new(small_store(dir.path(), 64));
        let blocks: Vec<u64> = (0..64).collect();
        let mut handed = Vec::new();
        let err = write_groups(
            &|| lock(&store),
            &FailingSource,
            &blocks,
            &BulkOptions::with_threads(2),
            8,
            &|_| {},
            |group, _| {
                lock(&store).commit_uncached()?;
                handed.extend_from_slice(group);
                Ok::<(), StoreError>(())
            },
        )
        .unwrap_err();
        assert!(matches!(err, StoreError::Source { block: 20, .. }), "{err}");
        assert_eq!(handed, (0..16).collect::<Vec<u64>>());
        let mut store = store.into_inner().unwrap();
        store.rollback().unwrap();
        let mut out = [0u8; 4096];
        for b in 0..16 {
            store.get(b, &mut out).unwrap();
            assert_eq!(out, [b as u8; 4096], "block {b}");
        }
        assert_eq!(store.kind(20).unwrap(), None);
    }

    #[test]
    fn bulk_write_groups_error_of_the_caller_stops_the_workers() {
        let dir = tempfile::tempdir().unwrap();
        let store = Mutex::new(small_store(dir.path(), 64));
        let data = image(64 * 4096);
        let blocks: Vec<u64> = (0..64).collect();
        let mut calls = 0;
        let err = write_groups(
            &|| lock(&store),
            &SliceSource::new(&data, 4096),
            &blocks,
            &BulkOptions::with_threads(2),
            8,
            &|_| {},
            |_, _| {
                calls += 1;
                Err(StoreError::GenerationsExhausted {
                    dir: std::path::PathBuf::from("x"),
                })
            },
        )
        .unwrap_err();
        assert!(matches!(err, StoreError::GenerationsExhausted { .. }));
        assert_eq!(calls, 1);
        // The second group was never written.
        assert_eq!(lock(&store).kind(8).unwrap(), None);
    }

    #[test]
    fn bulk_read_sink_error_names_the_block() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = DiskStore::create(
            dir.path(),
            StoreConfig {
                block_size: BlockSize::new(4096).unwrap(),
                codec: CodecConfig::new(Codec::Lz4),
                image_size: 8 * 4096,
            },
        )
        .unwrap();
        store.commit().unwrap();
        let blocks = all_blocks(&store);
        let err = read_blocks(
            &store,
            &blocks,
            &BulkOptions::with_threads(1),
            &|block, _, _| {
                if block == 3 {
                    Err(io::Error::other("disk full"))
                } else {
                    Ok(())
                }
            },
            &|_| {},
        )
        .unwrap_err();
        assert!(matches!(err, StoreError::Sink { block: 3, .. }), "{err}");
    }
}
