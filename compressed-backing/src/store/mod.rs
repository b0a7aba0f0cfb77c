//! `DiskStore`: an on-disk store for offloaded RAM.
//!
//! A store is a directory holding append-only segment files of block payloads, one index file
//! and a lock file. Writes (`put`, `discard`) append payloads and change the in-memory slots;
//! `commit` makes them durable: fsync the segments written, write the new index to
//! `index.tmp`, fsync it, rename it over `index` and fsync the directory. A crash at any point
//! leaves either the old index, which references only bytes that were already durable, or the
//! new one. Payloads are never overwritten in place, so the old image stays intact until a
//! commit that no longer references it; only then does compaction delete or rewrite segments.

mod index;
mod reader;
mod segment;

use basics::error_chain;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64;

pub use index::IndexError;
use index::{DataRef, Index, Slot};
pub use reader::StoreReader;
use segment::Segment;

use crate::codec::{BlockKind, CodecConfig, CodecError, Encoded, Encoder};
use crate::file::{self, FileError, PRIVATE_FILE_MODE};
use crate::layout::BlockSize;

const INDEX_FILE: &str = "index";
const INDEX_TMP: &str = "index.tmp";
const LOCK_FILE: &str = "lock";

/// Errors of the on-disk store. Each names the file, block and offset involved.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A system call on a store file failed.
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The system error.
        #[source]
        source: io::Error,
    },
    /// The directory holds no store index.
    #[error("{dir} is not a store (no index file)")]
    NotAStore {
        /// The directory.
        dir: PathBuf,
    },
    /// `create` found a store already there.
    #[error("{dir} already holds a store")]
    AlreadyExists {
        /// The directory.
        dir: PathBuf,
    },
    /// Another process has the store open for writing (or reading, when opening to write).
    #[error("store {dir} is in use by another process")]
    Locked {
        /// The directory.
        dir: PathBuf,
    },
    /// The index file is truncated, corrupt or of an unknown version.
    #[error("index {path} is unusable")]
    IndexCorrupt {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: IndexError,
    },
    /// A segment listed in the index does not exist.
    #[error("segment {path} is missing")]
    SegmentMissing {
        /// The segment file.
        path: PathBuf,
    },
    /// A segment is shorter than the committed index says.
    #[error("segment {path} is truncated: {actual} bytes, the index needs {expected}")]
    SegmentTruncated {
        /// The segment file.
        path: PathBuf,
        /// Committed length.
        expected: u64,
        /// Length found.
        actual: u64,
    },
    /// A block index past the end of the image.
    #[error("block {block} is out of range: the image has {blocks} blocks")]
    BlockOutOfRange {
        /// The block asked for.
        block: u64,
        /// Blocks in the image.
        blocks: u64,
    },
    /// A buffer whose length is not the block's length.
    #[error("block {block} has {expected} bytes, the buffer has {actual}")]
    WrongLength {
        /// The block.
        block: u64,
        /// The block's length.
        expected: usize,
        /// The buffer's length.
        actual: usize,
    },
    /// A stored payload fails its checksum.
    #[error(
        "block {block}: checksum mismatch in {path} at offset {offset} ({len} bytes): \
         stored {stored:#018x}, computed {computed:#018x}"
    )]
    Corrupt {
        /// The block.
        block: u64,
        /// The segment file.
        path: PathBuf,
        /// Byte offset of the payload in the file.
        offset: u64,
        /// Payload length.
        len: u32,
        /// Checksum in the index.
        stored: u64,
        /// Checksum of the bytes read.
        computed: u64,
    },
    /// A payload passes its checksum but does not decode to the block.
    #[error("block {block}: payload in {path} at offset {offset} does not decode")]
    Decode {
        /// The block.
        block: u64,
        /// The segment file.
        path: PathBuf,
        /// Byte offset of the payload in the file.
        offset: u64,
        /// The decoder's complaint.
        #[source]
        source: CodecError,
    },
    /// A write on a store opened read-only.
    #[error("store {dir} is open read-only")]
    ReadOnly {
        /// The directory.
        dir: PathBuf,
    },
    /// A store file is a symbolic link, a FIFO or device, or too large to be an index.
    #[error(transparent)]
    File(FileError),
    /// Every segment id has been used: the store cannot start another segment.
    #[error("store {dir} has used every segment id (up to {max}); pack into a new directory")]
    SegmentIdsExhausted {
        /// The directory.
        dir: PathBuf,
        /// The last id.
        max: u32,
    },
    /// The commit generation would overflow.
    #[error("store {dir} has reached its last generation; pack into a new directory")]
    GenerationsExhausted {
        /// The directory.
        dir: PathBuf,
    },
    /// An image of more blocks than an index can hold.
    #[error(
        "an image of {image_size} bytes is {blocks} blocks, more than the {max} a store holds"
    )]
    ImageTooLarge {
        /// The image's size.
        image_size: u64,
        /// Its blocks.
        blocks: u64,
        /// The most blocks.
        max: u64,
    },
    /// The index about to be committed would not load again (metadata too large, or a bug):
    /// nothing was written.
    #[error("refusing to commit an index that could not be opened again")]
    Unloadable(#[source] IndexError),
    /// The codec could not be set up.
    #[error("codec setup failed")]
    Codec(#[source] CodecError),
    /// The commit is durable, but compacting afterwards failed; the store is consistent.
    #[error("generation {generation} is committed, but compaction failed")]
    CompactionFailed {
        /// The committed generation.
        generation: u64,
        /// Why compaction stopped.
        #[source]
        source: Box<StoreError>,
    },
    /// A bulk write could not read a block from its source.
    #[error("cannot read block {block} from the source")]
    Source {
        /// The block.
        block: u64,
        /// The source's error.
        #[source]
        source: io::Error,
    },
    /// A bulk read could not hand a block to its destination.
    #[error("cannot write block {block} to the destination")]
    Sink {
        /// The block.
        block: u64,
        /// The destination's error.
        #[source]
        source: io::Error,
    },
}

impl StoreError {
    fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { op, path, source }
    }

    /// True when the cause is the disk running out of space.
    pub fn is_no_space(&self) -> bool {
        use std::error::Error;
        let mut cause: Option<&(dyn Error + 'static)> = Some(self);
        while let Some(err) = cause {
            if let Some(io) = err.downcast_ref::<io::Error>() {
                if io.raw_os_error() == Some(libc::ENOSPC) {
                    return true;
                }
            }
            cause = err.source();
        }
        false
    }
}

/// The geometry and codec of a new store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreConfig {
    /// Bytes per block.
    pub block_size: BlockSize,
    /// Codec for new writes (each block records its own kind, so this may change later).
    pub codec: CodecConfig,
    /// Bytes in the RAM image.
    pub image_size: u64,
}

/// Tuning of segment size and compaction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StoreOptions {
    /// A new segment is started when the current one would grow past this.
    pub segment_max_bytes: u64,
    /// A segment whose dead share reaches this is rewritten (live payloads moved) or deleted.
    pub compact_dead_ratio: f64,
    /// Segments smaller than this are only deleted when fully dead, never rewritten.
    pub compact_min_bytes: u64,
    /// Run compaction after every commit.
    pub auto_compact: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            segment_max_bytes: 64 << 20,
            compact_dead_ratio: 0.5,
            compact_min_bytes: 1 << 20,
            auto_compact: true,
        }
    }
}

/// Counts and sizes of a store, as `info` prints them.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StoreStats {
    /// Bytes in the RAM image.
    pub image_size: u64,
    /// Bytes per block.
    pub block_size: u64,
    /// Codec for new writes.
    pub codec: String,
    /// Blocks in the image.
    pub blocks: u64,
    /// Blocks written (not absent).
    pub present_blocks: u64,
    /// Blocks stored as the zero tag.
    pub zero_blocks: u64,
    /// Blocks stored as a same-byte tag.
    pub fill_blocks: u64,
    /// Blocks stored uncompressed.
    pub raw_blocks: u64,
    /// Blocks stored compressed.
    pub compressed_blocks: u64,
    /// Logical bytes of present blocks.
    pub raw_bytes: u64,
    /// Payload bytes the current image references.
    pub stored_bytes: u64,
    /// Bytes of all segment files (live and dead payloads).
    pub segment_bytes: u64,
    /// Segment bytes no block references any more (reclaimed by compaction).
    pub dead_bytes: u64,
    /// Bytes allocated on disk for all store files (`st_blocks`).
    pub disk_bytes: u64,
    /// Segment files.
    pub segments: u64,
    /// Commit generation.
    pub generation: u64,
    /// Logical bytes per allocated disk byte (`raw_bytes / disk_bytes`).
    pub ratio: f64,
}

/// One bad block found by `verify`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Problem {
    /// The block.
    pub block: u64,
    /// The segment file holding it.
    pub path: PathBuf,
    /// Byte offset of its payload in that file.
    pub offset: u64,
    /// What is wrong.
    pub reason: String,
}

/// Result of `verify`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct VerifyReport {
    /// Blocks whose payload was read and decoded.
    pub blocks_checked: u64,
    /// Payload bytes read.
    pub bytes_checked: u64,
    /// Every bad block.
    pub problems: Vec<Problem>,
}

/// What a compaction did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactionReport {
    /// Segment files deleted.
    pub segments_removed: u64,
    /// Live payload bytes copied into a new segment.
    pub bytes_moved: u64,
    /// Segment bytes freed.
    pub bytes_freed: u64,
}

/// A batch of encoded blocks, written with one (vectored) append: payloads are copied into
/// `data`, or for raw blocks of a source's own memory, referenced where they are (`'s`).
#[derive(Debug, Default)]
pub(crate) struct EncodedBatch<'s> {
    pub data: BatchBuf,
    pub items: Vec<BatchItem<'s>>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct BatchItem<'s> {
    pub block: u64,
    pub kind: BlockKind,
    /// Fill byte for `Fill`.
    pub fill: u8,
    pub payload: Payload<'s>,
    /// xxh3-64 of the payload, computed by whoever builds the batch (outside the store lock).
    pub checksum: u64,
}

/// Where a batch item's payload is.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Payload<'s> {
    /// A tag: nothing to write.
    None,
    /// In the batch's buffer.
    Buf { offset: usize, len: usize },
    /// In the source's memory.
    Shared(&'s [u8]),
}

/// The payload bytes of a batch: on the heap for one-off puts, or in a mapping of its own
/// for bulk transfers, so that several MiB of buffers are given straight back to the kernel
/// when dropped instead of lingering in the allocator's per-thread arenas (an offloaded VM
/// must cost what it holds, not what it once used).
#[derive(Debug)]
pub(crate) enum BatchBuf {
    Heap(Vec<u8>),
    Mapped { map: memmap2::MmapMut, len: usize },
}

impl Default for BatchBuf {
    fn default() -> Self {
        Self::Heap(Vec::new())
    }
}

impl BatchBuf {
    /// A mapping of `capacity` bytes, touched now so that reusing it never faults; on the
    /// heap if the mapping fails.
    fn mapped(capacity: usize) -> Self {
        match memmap2::MmapMut::map_anon(capacity.max(1)) {
            Ok(mut map) => {
                map.fill(0);
                Self::Mapped { map, len: 0 }
            }
            Err(_) => Self::Heap(Vec::with_capacity(capacity)),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Heap(vec) => vec.len(),
            Self::Mapped { len, .. } => *len,
        }
    }

    fn clear(&mut self) {
        match self {
            Self::Heap(vec) => vec.clear(),
            Self::Mapped { len, .. } => *len = 0,
        }
    }

    fn extend_from_slice(&mut self, bytes: &[u8]) {
        match self {
            Self::Heap(vec) => vec.extend_from_slice(bytes),
            Self::Mapped { map, len } if *len + bytes.len() <= map.len() => {
                map[*len..*len + bytes.len()].copy_from_slice(bytes);
                *len += bytes.len();
            }
            Self::Mapped { map, len } => {
                // Never happens for a batch sized for its blocks; stay correct regardless.
                let mut vec = map[..*len].to_vec();
                vec.extend_from_slice(bytes);
                *self = Self::Heap(vec);
            }
        }
    }
}

impl std::ops::Deref for BatchBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Heap(vec) => vec,
            Self::Mapped { map, len } => &map[..*len],
        }
    }
}

impl<'s> EncodedBatch<'s> {
    /// An empty batch with room for `blocks` blocks of `block_bytes` each, in a mapping of
    /// its own, touched up front.
    pub(crate) fn with_capacity(blocks: usize, block_bytes: usize) -> Self {
        Self {
            data: BatchBuf::mapped(blocks * block_bytes),
            items: Vec::with_capacity(blocks),
        }
    }

    /// Empties the batch, keeping its memory.
    pub(crate) fn clear(&mut self) {
        self.data.clear();
        self.items.clear();
    }

    /// Adds one encoded block, copying its payload.
    pub(crate) fn push(&mut self, block: u64, encoded: Encoded<'_>) {
        let fill = match encoded.kind {
            BlockKind::Fill => encoded.payload[0],
            _ => 0,
        };
        let (payload, checksum) = if encoded.kind.has_data() {
            let offset = self.data.len();
            self.data.extend_from_slice(encoded.payload);
            let payload = Payload::Buf {
                offset,
                len: encoded.payload.len(),
            };
            (payload, xxh3_64(encoded.payload))
        } else {
            (Payload::None, 0)
        };
        self.items.push(BatchItem {
            block,
            kind: encoded.kind,
            fill,
            payload,
            checksum,
        });
    }

    /// Adds one raw block whose bytes stay where they are until the batch is written.
    pub(crate) fn push_shared(&mut self, block: u64, bytes: &'s [u8]) {
        self.items.push(BatchItem {
            block,
            kind: BlockKind::Raw,
            fill: 0,
            payload: Payload::Shared(bytes),
            checksum: xxh3_64(bytes),
        });
    }

    /// The payload bytes of `item`.
    fn bytes<'a>(&'a self, item: &BatchItem<'a>) -> Option<&'a [u8]> {
        match item.payload {
            Payload::None => None,
            Payload::Buf { offset, len } => Some(&self.data[offset..offset + len]),
            Payload::Shared(bytes) => Some(bytes),
        }
    }
}

/// The state as of the last commit, to roll back to.
#[derive(Debug)]
struct Committed {
    image_size: u64,
    slots: Vec<Slot>,
    meta: BTreeMap<String, Vec<u8>>,
}

/// An on-disk store of one RAM image. See the module documentation.
#[derive(Debug)]
pub struct DiskStore {
    dir: PathBuf,
    writable: bool,
    _lock: File,
    block_size: BlockSize,
    codec: CodecConfig,
    image_size: u64,
    generation: u64,
    next_segment: u32,
    slots: Vec<Slot>,
    meta: BTreeMap<String, Vec<u8>>,
    segments: BTreeMap<u32, Segment>,
    /// Segment receiving appends, if one was started by this process.
    active: Option<u32>,
    /// Segments appended to since the last commit.
    dirty: BTreeSet<u32>,
    committed: Committed,
    options: StoreOptions,
    encoder: Option<Encoder>,
    /// Reads drop the pages they read from the page cache (see `set_drop_behind`).
    drop_behind: bool,
}

impl DiskStore {
    /// Creates a store in `dir` (made if missing); fails if a store is already there.
    pub fn create(dir: impl AsRef<Path>, config: StoreConfig) -> Result<Self, StoreError> {
        Self::create_with(dir, config, StoreOptions::default())
    }

    /// `create` with explicit options.
    pub fn create_with(
        dir: impl AsRef<Path>,
        config: StoreConfig,
        options: StoreOptions,
    ) -> Result<Self, StoreError> {
        let dir = dir.as_ref().to_path_buf();
        check_image_size(config.block_size, config.image_size)?;
        // New directories are 0700, new files 0600: the store holds guest memory.
        file::create_private_dir(&dir).map_err(StoreError::io("create directory", &dir))?;
        let lock = lock_dir(&dir, true)?;
        if fs::symlink_metadata(dir.join(INDEX_FILE)).is_ok() {
            return Err(StoreError::AlreadyExists { dir });
        }
        let blocks = config.block_size.blocks_for(config.image_size);
        let slots = vec![Slot::Absent; blocks as usize];
        let mut store = Self {
            committed: Committed {
                image_size: config.image_size,
                slots: slots.clone(),
                meta: BTreeMap::new(),
            },
            dir,
            writable: true,
            _lock: lock,
            block_size: config.block_size,
            codec: config.codec,
            image_size: config.image_size,
            generation: 0,
            next_segment: 0,
            slots,
            meta: BTreeMap::new(),
            segments: BTreeMap::new(),
            active: None,
            dirty: BTreeSet::new(),
            options,
            encoder: None,
            drop_behind: false,
        };
        store.remove_strays()?;
        store.write_index()?;
        Ok(store)
    }

    /// Opens an existing store for reading and writing (exclusive).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with(dir, true, StoreOptions::default())
    }

    /// Opens an existing store for reading only (shared with other readers).
    pub fn open_read_only(dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with(dir, false, StoreOptions::default())
    }

    /// Opens an existing store.
    pub fn open_with(
        dir: impl AsRef<Path>,
        writable: bool,
        options: StoreOptions,
    ) -> Result<Self, StoreError> {
        let dir = dir.as_ref().to_path_buf();
        let index_path = dir.join(INDEX_FILE);
        if fs::symlink_metadata(&index_path).is_err() {
            return Err(StoreError::NotAStore { dir });
        }
        let lock = lock_dir(&dir, writable)?;
        let index = read_index(&index_path)?;
        let mut segments = BTreeMap::new();
        for (&id, &committed_len) in &index.segments {
            let path = dir.join(segment::file_name(id));
            let (seg, actual) = match Segment::open(&dir, id, committed_len, writable) {
                Ok(opened) => opened,
                Err(e) if e.is_not_found() => return Err(StoreError::SegmentMissing { path }),
                Err(e) => return Err(StoreError::File(e)),
            };
            if actual < committed_len {
                return Err(StoreError::SegmentTruncated {
                    path,
                    expected: committed_len,
                    actual,
                });
            }
            if writable && actual > committed_len {
                // Bytes appended after the last commit by a writer that crashed.
                seg.file
                    .set_len(committed_len)
                    .map_err(StoreError::io("truncate segment tail", &path))?;
            }
            segments.insert(id, seg);
        }
        let mut store = Self {
            committed: Committed {
                image_size: index.image_size,
                slots: index.slots.clone(),
                meta: index.meta.clone(),
            },
            dir,
            writable,
            _lock: lock,
            block_size: index.block_size,
            codec: index.codec,
            image_size: index.image_size,
            generation: index.generation,
            next_segment: index.next_segment,
            slots: index.slots,
            meta: index.meta,
            segments,
            active: None,
            dirty: BTreeSet::new(),
            options,
            encoder: None,
            drop_behind: false,
        };
        store.recount_live();
        if writable {
            store.remove_strays()?;
        }
        Ok(store)
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes per block.
    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    /// Codec for new writes.
    pub fn codec(&self) -> CodecConfig {
        self.codec
    }

    /// Changes the codec for future writes; stored blocks keep theirs.
    pub fn set_codec(&mut self, codec: CodecConfig) {
        if codec != self.codec {
            self.codec = codec;
            self.encoder = None;
        }
    }

    /// Bytes in the image.
    pub fn image_size(&self) -> u64 {
        self.image_size
    }

    /// Blocks in the image.
    pub fn blocks(&self) -> u64 {
        self.slots.len() as u64
    }

    /// Length of block `block` (the last one may be partial).
    pub fn block_len(&self, block: u64) -> usize {
        self.block_size.len_in_image(block, self.image_size)
    }

    /// Generation of the last commit.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// True if there are writes not yet committed.
    pub fn has_pending(&self) -> bool {
        !self.dirty.is_empty()
            || self.slots != self.committed.slots
            || self.meta != self.committed.meta
            || self.image_size != self.committed.image_size
    }

    /// The kind of a block, `None` if absent (reads as zeros).
    pub fn kind(&self, block: u64) -> Result<Option<BlockKind>, StoreError> {
        Ok(self.slot(block)?.kind())
    }

    /// A metadata value committed with the index (e.g. a recorded working set).
    pub fn meta(&self, key: &str) -> Option<&[u8]> {
        self.meta.get(key).map(Vec::as_slice)
    }

    /// Sets a metadata value; durable with the next commit.
    pub fn set_meta(&mut self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        self.check_writable()?;
        self.meta.insert(key.to_owned(), value);
        Ok(())
    }

    /// Empties the image and gives it a new size; durable with the next commit, after which
    /// the old payloads are reclaimed.
    pub fn reset(&mut self, image_size: u64) -> Result<(), StoreError> {
        self.check_writable()?;
        check_image_size(self.block_size, image_size)?;
        self.image_size = image_size;
        self.slots = vec![Slot::Absent; self.block_size.blocks_for(image_size) as usize];
        self.recount_live();
        // The new image goes to fresh segments, so the old ones die whole and are deleted
        // without copying anything.
        self.active = None;
        Ok(())
    }

    /// Encodes and writes one block; returns how it was stored. Durable after `commit`.
    pub fn put(&mut self, block: u64, data: &[u8]) -> Result<BlockKind, StoreError> {
        self.check_writable()?;
        self.check_len(block, data.len())?;
        if self.encoder.is_none() {
            self.encoder = Some(Encoder::new(self.codec).map_err(StoreError::Codec)?);
        }
        let mut encoder = self.encoder.take().expect("created just above");
        let encoded = encoder.encode(data);
        let kind = encoded.kind;
        let result = self.put_encoded_unchecked(block, encoded);
        self.encoder = Some(encoder);
        result.map(|()| kind)
    }

    /// Writes a block that is already encoded (for example a compressed block moved from the
    /// memory pool), without re-encoding it.
    pub fn put_encoded(&mut self, block: u64, encoded: Encoded<'_>) -> Result<(), StoreError> {
        self.check_writable()?;
        self.slot(block)?;
        self.put_encoded_unchecked(block, encoded)
    }

    fn put_encoded_unchecked(
        &mut self,
        block: u64,
        encoded: Encoded<'_>,
    ) -> Result<(), StoreError> {
        let mut batch = EncodedBatch::default();
        batch.push(block, encoded);
        self.put_batch(&batch)
    }

    /// Writes a batch of encoded blocks with one append.
    pub(crate) fn put_batch(&mut self, batch: &EncodedBatch<'_>) -> Result<(), StoreError> {
        let pieces: Vec<&[u8]> = batch.items.iter().filter_map(|i| batch.bytes(i)).collect();
        let location = if pieces.is_empty() {
            None
        } else {
            Some(self.append(&pieces)?)
        };
        let mut at = location.map_or(0, |(_, base)| base);
        for item in &batch.items {
            let slot = match (item.kind, batch.bytes(item)) {
                (BlockKind::Zero, _) => Slot::Zero,
                (BlockKind::Fill, _) => Slot::Fill(item.fill),
                (kind, Some(payload)) => {
                    let (segment, _) = location.expect("data blocks make the batch non-empty");
                    let offset = at;
                    at += payload.len() as u64;
                    Slot::Data(DataRef {
                        kind,
                        segment,
                        len: payload.len() as u32,
                        offset,
                        checksum: item.checksum,
                    })
                }
                (kind, None) => unreachable!("a {kind:?} block always has a payload"),
            };
            self.set_slot(item.block, slot);
        }
        Ok(())
    }

    /// Drops a block's contents: it reads as zeros and its payload is reclaimed after commit.
    pub fn discard(&mut self, block: u64) -> Result<(), StoreError> {
        self.check_writable()?;
        self.slot(block)?;
        self.set_slot(block, Slot::Absent);
        Ok(())
    }

    /// Reads block `block` into `out` (exactly the block's length). Returns its kind, `None`
    /// for an absent block (filled with zeros). Checksums and decoding are always checked.
    pub fn get(&self, block: u64, out: &mut [u8]) -> Result<Option<BlockKind>, StoreError> {
        self.check_len(block, out.len())?;
        let slot = self.slot(block)?;
        reader::read_block(&self.dir, block, slot, out, self.drop_behind, &|id| {
            self.segment_file(id)
        })
    }

    /// A read-only view of the image as it is now, for other threads while this store goes
    /// on being written (see [`StoreReader`]).
    pub fn reader(&self) -> StoreReader {
        StoreReader {
            drop_behind: self.drop_behind,
            dir: self.dir.clone(),
            block_size: self.block_size,
            image_size: self.image_size,
            slots: self.slots.as_slice().into(),
            files: Arc::new(
                self.segments
                    .iter()
                    .map(|(&id, seg)| (id, Arc::clone(&seg.file)))
                    .collect(),
            ),
        }
    }

    fn segment_file(&self, id: u32) -> Option<&File> {
        self.segments.get(&id).map(|seg| seg.file.as_ref())
    }

    /// Reads a block's stored representation without decoding it: its kind and payload
    /// (checksum verified). `None` for an absent block.
    pub fn get_encoded(
        &self,
        block: u64,
        payload: &mut Vec<u8>,
    ) -> Result<Option<BlockKind>, StoreError> {
        let slot = self.slot(block)?;
        payload.clear();
        match slot {
            Slot::Absent | Slot::Zero => {}
            Slot::Fill(byte) => payload.push(byte),
            Slot::Data(data) => self.read_payload(block, &data, payload)?,
        }
        Ok(slot.kind())
    }

    /// Stored payload length of a block (0 for tags and absent blocks).
    pub fn stored_len(&self, block: u64) -> usize {
        match self.slot(block) {
            Ok(Slot::Data(data)) => data.len as usize,
            _ => 0,
        }
    }

    /// Makes all writes since the last commit durable, then compacts if the options say so.
    pub fn commit(&mut self) -> Result<u64, StoreError> {
        self.check_writable()?;
        self.write_index()?;
        if self.options.auto_compact {
            if let Err(source) = self.compact() {
                return Err(StoreError::CompactionFailed {
                    generation: self.generation,
                    source: Box::new(source),
                });
            }
        }
        Ok(self.generation)
    }

    /// Makes the writes since the last commit durable and commits them without compacting,
    /// leaving none of them in the page cache: the pending part of each segment written to
    /// disk was just written is written back and waited for (`sync_file_range`), then dropped
    /// from the page cache (`POSIX_FADV_DONTNEED`), then the index is written as by
    /// [`commit`](Self::commit). For a writer that commits in steps under a memory budget
    /// (the pager's offload): each step leaves no dirty or cached pages behind, and no step
    /// moves data that a later step will replace anyway. Returns the new generation.
    pub fn commit_uncached(&mut self) -> Result<u64, StoreError> {
        use std::os::fd::AsRawFd;
        self.check_writable()?;
        for &id in &self.dirty {
            let seg = &self.segments[&id];
            // From the page holding the first pending byte: that page was left cached by the
            // step before, clean now.
            let from = basics::PageSize::BASE.align_down(seg.committed_len);
            let (Ok(offset), Ok(len)) = (
                libc::off64_t::try_from(from),
                libc::off64_t::try_from(seg.len - from),
            ) else {
                return Err(StoreError::Io {
                    op: "write back",
                    path: seg.path.clone(),
                    source: io::Error::from_raw_os_error(libc::EFBIG),
                });
            };
            let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
                | libc::SYNC_FILE_RANGE_WRITE
                | libc::SYNC_FILE_RANGE_WAIT_AFTER;
            // SAFETY: sync_file_range on our own open descriptor; it only starts and waits
            // for writeback.
            let rc = unsafe { libc::sync_file_range(seg.file.as_raw_fd(), offset, len, flags) };
            if rc != 0 {
                return Err(StoreError::Io {
                    op: "write back",
                    path: seg.path.clone(),
                    source: io::Error::last_os_error(),
                });
            }
            // SAFETY: fadvise on our own open descriptor; it only affects caching.
            let rc = unsafe {
                // Length 0: to the end of the file, its last partial page included.
                libc::posix_fadvise(seg.file.as_raw_fd(), offset, 0, libc::POSIX_FADV_DONTNEED)
            };
            if rc != 0 {
                return Err(StoreError::Io {
                    op: "drop the page cache of",
                    path: seg.path.clone(),
                    source: io::Error::from_raw_os_error(rc),
                });
            }
        }
        self.write_index()?;
        Ok(self.generation)
    }

    /// Runs compaction if the store's options ask for it after every commit
    /// (`auto_compact`): for a writer that committed its steps with
    /// [`commit_uncached`](Self::commit_uncached), once at the end. `None` when the options
    /// say not to.
    pub fn compact_if_auto(&mut self) -> Result<Option<CompactionReport>, StoreError> {
        if !self.options.auto_compact {
            return Ok(None);
        }
        match self.compact() {
            Ok(report) => Ok(Some(report)),
            Err(source) => Err(StoreError::CompactionFailed {
                generation: self.generation,
                source: Box::new(source),
            }),
        }
    }

    /// Whether reads (of this store and of the readers taken from it from now on) drop what
    /// they read from the page cache at once: for a reader that copies each block elsewhere
    /// and will not read it again soon (a pager installing blocks into guest RAM), where a
    /// cached copy would only double the memory. Off by default.
    ///
    /// With it on, the segments are read without readahead (`POSIX_FADV_RANDOM` on their
    /// descriptors, shared with the readers): readahead of one reader's block brings in
    /// blocks another has read and dropped already, and nobody drops them again (measured:
    /// 4016 of 4096 pages stayed cached after two threads read a store this way, 60 of 64 MiB
    /// after a VM's load).
    pub fn set_drop_behind(&mut self, on: bool) {
        self.drop_behind = on;
        for seg in self.segments.values() {
            advise_readahead(&seg.file, on);
        }
    }

    /// Asks the kernel to drop the page cache of the committed segments (they are durable, so
    /// their cached pages are clean): an offloaded image should cost disk, not memory. Reads
    /// afterwards come from the disk. Pending (uncommitted) data is left cached.
    pub fn drop_cache(&self) -> Result<(), StoreError> {
        use std::os::fd::AsRawFd;
        for seg in self.segments.values() {
            let Ok(len) = libc::off_t::try_from(seg.committed_len) else {
                continue;
            };
            // SAFETY: fadvise on our own open descriptor; it only affects caching.
            let rc = unsafe {
                libc::posix_fadvise(seg.file.as_raw_fd(), 0, len, libc::POSIX_FADV_DONTNEED)
            };
            if rc != 0 {
                return Err(StoreError::Io {
                    op: "drop the page cache of",
                    path: seg.path.clone(),
                    source: io::Error::from_raw_os_error(rc),
                });
            }
        }
        Ok(())
    }

    /// Forgets all writes since the last commit.
    pub fn rollback(&mut self) -> Result<(), StoreError> {
        self.check_writable()?;
        self.image_size = self.committed.image_size;
        self.slots = self.committed.slots.clone();
        self.meta = self.committed.meta.clone();
        for id in std::mem::take(&mut self.dirty) {
            if let Some(seg) = self.segments.get_mut(&id) {
                seg.len = seg.committed_len;
                if seg.committed_len == 0 {
                    let path = seg.path.clone();
                    self.segments.remove(&id);
                    if self.active == Some(id) {
                        self.active = None;
                    }
                    fs::remove_file(&path).map_err(StoreError::io("remove segment", path))?;
                }
            }
        }
        self.recount_live();
        Ok(())
    }

    /// Rewrites or deletes segments that are mostly dead: commits pending writes first, moves
    /// live payloads out of the chosen segments, commits again, then deletes the old files.
    pub fn compact(&mut self) -> Result<CompactionReport, StoreError> {
        self.check_writable()?;
        if self.has_pending() {
            self.write_index()?;
        }
        let mut report = CompactionReport::default();
        let candidates: BTreeSet<u32> = self
            .segments
            .iter()
            .filter(|(_, seg)| {
                let dead = seg.committed_len.saturating_sub(seg.live);
                let fully_dead = seg.live == 0 && seg.committed_len == seg.len;
                fully_dead
                    || (seg.committed_len >= self.options.compact_min_bytes
                        && seg.committed_len == seg.len
                        && dead as f64
                            >= self.options.compact_dead_ratio * seg.committed_len as f64)
            })
            .map(|(&id, _)| id)
            .collect();
        if candidates.is_empty() {
            return Ok(report);
        }
        if self.active.is_some_and(|id| candidates.contains(&id)) {
            self.active = None;
        }
        let result = self.move_live_out_of(&candidates, &mut report);
        let retired: Vec<(u32, Segment)> = candidates
            .iter()
            .filter_map(|&id| self.segments.remove(&id).map(|seg| (id, seg)))
            .collect();
        if let Err(e) = result.and_then(|()| self.write_index()) {
            self.segments.extend(retired);
            self.slots = self.committed.slots.clone();
            self.recount_live();
            return Err(e);
        }
        for (_, seg) in retired {
            report.segments_removed += 1;
            report.bytes_freed += seg.committed_len;
            fs::remove_file(&seg.path).map_err(StoreError::io("remove segment", &seg.path))?;
        }
        sync_dir(&self.dir)?;
        Ok(report)
    }

    fn move_live_out_of(
        &mut self,
        candidates: &BTreeSet<u32>,
        report: &mut CompactionReport,
    ) -> Result<(), StoreError> {
        let mut payload = Vec::new();
        for block in 0..self.slots.len() as u64 {
            let Slot::Data(data) = self.slots[block as usize] else {
                continue;
            };
            if !candidates.contains(&data.segment) {
                continue;
            }
            self.read_payload(block, &data, &mut payload)?;
            let (segment, offset) = self.append(&[&payload])?;
            report.bytes_moved += payload.len() as u64;
            self.set_slot(
                block,
                Slot::Data(DataRef {
                    segment,
                    offset,
                    ..data
                }),
            );
        }
        Ok(())
    }

    /// Reads and decodes every stored block; lists each one that fails.
    pub fn verify(&self) -> VerifyReport {
        let mut report = VerifyReport::default();
        let mut out = vec![0u8; self.block_size.bytes()];
        for block in 0..self.blocks() {
            let Slot::Data(data) = self.slots[block as usize] else {
                continue;
            };
            let len = self.block_len(block);
            report.blocks_checked += 1;
            report.bytes_checked += u64::from(data.len);
            if let Err(err) = self.get(block, &mut out[..len]) {
                report.problems.push(Problem {
                    block,
                    path: self.segment_path(data.segment),
                    offset: data.offset,
                    reason: error_chain(&err),
                });
            }
        }
        report
    }

    /// Counts and sizes.
    pub fn stats(&self) -> StoreStats {
        let mut stats = StoreStats {
            image_size: self.image_size,
            block_size: self.block_size.bytes_u64(),
            codec: self.codec.codec.to_string(),
            blocks: self.blocks(),
            generation: self.generation,
            segments: self.segments.len() as u64,
            ..StoreStats::default()
        };
        for (block, slot) in self.slots.iter().enumerate() {
            if matches!(slot, Slot::Absent) {
                continue;
            }
            stats.present_blocks += 1;
            stats.raw_bytes += self.block_len(block as u64) as u64;
            match slot {
                Slot::Absent => {}
                Slot::Zero => stats.zero_blocks += 1,
                Slot::Fill(_) => stats.fill_blocks += 1,
                Slot::Data(data) => {
                    stats.stored_bytes += u64::from(data.len);
                    if data.kind.is_compressed() {
                        stats.compressed_blocks += 1;
                    } else {
                        stats.raw_blocks += 1;
                    }
                }
            }
        }
        let mut live = 0;
        for seg in self.segments.values() {
            stats.segment_bytes += seg.len;
            live += seg.live;
            stats.disk_bytes += allocated_bytes(&seg.path);
        }
        stats.dead_bytes = stats.segment_bytes.saturating_sub(live);
        stats.disk_bytes += allocated_bytes(&self.dir.join(INDEX_FILE));
        stats.ratio = stats.raw_bytes as f64 / stats.disk_bytes.max(1) as f64;
        stats
    }

    fn check_writable(&self) -> Result<(), StoreError> {
        if self.writable {
            Ok(())
        } else {
            Err(StoreError::ReadOnly {
                dir: self.dir.clone(),
            })
        }
    }

    fn slot(&self, block: u64) -> Result<Slot, StoreError> {
        usize::try_from(block)
            .ok()
            .and_then(|i| self.slots.get(i))
            .copied()
            .ok_or(StoreError::BlockOutOfRange {
                block,
                blocks: self.blocks(),
            })
    }

    fn check_len(&self, block: u64, actual: usize) -> Result<(), StoreError> {
        self.slot(block)?;
        let expected = self.block_len(block);
        if expected == actual {
            Ok(())
        } else {
            Err(StoreError::WrongLength {
                block,
                expected,
                actual,
            })
        }
    }

    fn segment_path(&self, id: u32) -> PathBuf {
        self.dir.join(segment::file_name(id))
    }

    fn set_slot(&mut self, block: u64, new: Slot) {
        let old = std::mem::replace(&mut self.slots[block as usize], new);
        if let Slot::Data(data) = old {
            if let Some(seg) = self.segments.get_mut(&data.segment) {
                seg.live -= u64::from(data.len);
            }
        }
        if let Slot::Data(data) = new {
            if let Some(seg) = self.segments.get_mut(&data.segment) {
                seg.live += u64::from(data.len);
            }
        }
    }

    fn recount_live(&mut self) {
        for seg in self.segments.values_mut() {
            seg.live = 0;
        }
        for slot in &self.slots {
            if let Slot::Data(data) = slot {
                if let Some(seg) = self.segments.get_mut(&data.segment) {
                    seg.live += u64::from(data.len);
                }
            }
        }
    }

    /// Reads a payload and checks its checksum.
    fn read_payload(
        &self,
        block: u64,
        data: &DataRef,
        buf: &mut Vec<u8>,
    ) -> Result<(), StoreError> {
        reader::read_payload(&self.dir, block, data, buf, self.drop_behind, &|id| {
            self.segment_file(id)
        })
    }

    /// Appends `pieces`, end to end, to the active segment, starting a new one when needed.
    fn append(&mut self, pieces: &[&[u8]]) -> Result<(u32, u64), StoreError> {
        let len: u64 = pieces.iter().map(|p| p.len() as u64).sum();
        let need_new = match self.active.and_then(|id| self.segments.get(&id)) {
            None => true,
            Some(seg) => seg.len > 0 && seg.len + len > self.options.segment_max_bytes,
        };
        if need_new {
            let id = self.next_segment;
            if id > segment::MAX_ID {
                return Err(StoreError::SegmentIdsExhausted {
                    dir: self.dir.clone(),
                    max: segment::MAX_ID,
                });
            }
            let seg = Segment::create(&self.dir, id).map_err(StoreError::File)?;
            if self.drop_behind {
                advise_readahead(&seg.file, true);
            }
            self.next_segment = id + 1;
            self.segments.insert(id, seg);
            self.active = Some(id);
        }
        let id = self.active.expect("set above");
        let seg = self.segments.get_mut(&id).expect("active segment is open");
        let offset = seg
            .append(pieces)
            .map_err(StoreError::io("write segment", seg.path.clone()))?;
        self.dirty.insert(id);
        Ok((id, offset))
    }

    /// Syncs dirty segments, then atomically replaces the index with the current state.
    fn write_index(&mut self) -> Result<(), StoreError> {
        for &id in &self.dirty {
            let seg = &self.segments[&id];
            seg.file
                .sync_data()
                .map_err(StoreError::io("sync segment", seg.path.clone()))?;
        }
        let generation =
            self.generation
                .checked_add(1)
                .ok_or_else(|| StoreError::GenerationsExhausted {
                    dir: self.dir.clone(),
                })?;
        let index = Index {
            block_size: self.block_size,
            codec: self.codec,
            image_size: self.image_size,
            generation,
            next_segment: self.next_segment,
            segments: self
                .segments
                .iter()
                .map(|(&id, seg)| (id, seg.len))
                .collect(),
            slots: self.slots.clone(),
            meta: self.meta.clone(),
        };
        let bytes = index.encode();
        // Old or new, never neither: an index this build could not open again is not
        // committed (decoding is far cheaper than the fsyncs around it).
        Index::decode(&bytes).map_err(StoreError::Unloadable)?;
        let tmp = self.dir.join(INDEX_TMP);
        let result = write_file_durably(&tmp, &bytes).and_then(|()| {
            fs::rename(&tmp, self.dir.join(INDEX_FILE))
                .map_err(StoreError::io("rename index", &tmp))
        });
        if let Err(e) = result {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        sync_dir(&self.dir)?;
        self.generation = index.generation;
        for seg in self.segments.values_mut() {
            seg.committed_len = seg.len;
        }
        self.dirty.clear();
        self.committed = Committed {
            image_size: index.image_size,
            slots: index.slots,
            meta: index.meta,
        };
        Ok(())
    }

    /// Removes files a crashed writer left behind: a stale `index.tmp` and segments that no
    /// committed index references.
    fn remove_strays(&mut self) -> Result<(), StoreError> {
        let entries = fs::read_dir(&self.dir).map_err(StoreError::io("list", &self.dir))?;
        for entry in entries {
            let entry = entry.map_err(StoreError::io("list", &self.dir))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let stray = name == INDEX_TMP
                || segment::parse_file_name(&name)
                    .is_some_and(|id| !self.segments.contains_key(&id));
            if stray {
                let path = entry.path();
                fs::remove_file(&path).map_err(StoreError::io("remove stray file", &path))?;
                if let Some(id) = segment::parse_file_name(&name) {
                    self.next_segment = self.next_segment.max(id + 1);
                }
            }
        }
        Ok(())
    }
}

/// Takes the store's lock: exclusive for writers, shared for readers.
fn lock_dir(dir: &Path, exclusive: bool) -> Result<File, StoreError> {
    let path = dir.join(LOCK_FILE);
    let file = file::open_regular(
        &path,
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(exclusive)
            .truncate(false)
            .mode(PRIVATE_FILE_MODE),
    );
    let file = match file {
        Ok(file) => file,
        // A store created by an older writer always has its lock file; a reader of a store
        // without one (copied directory, sealed snapshot) locks the index instead.
        Err(e) if e.is_not_found() && !exclusive => {
            file::open_read(&dir.join(INDEX_FILE)).map_err(StoreError::File)?
        }
        Err(e) => return Err(StoreError::File(e)),
    };
    let locked = if exclusive {
        file.try_lock()
    } else {
        file.try_lock_shared()
    };
    match locked {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => Err(StoreError::Locked {
            dir: dir.to_path_buf(),
        }),
        Err(TryLockError::Error(e)) => Err(StoreError::io("lock", path)(e)),
    }
}

/// Reads and decodes the index at `path`: a regular file, no longer than its own header
/// says an index of its geometry can be.
fn read_index(path: &Path) -> Result<Index, StoreError> {
    let mut file = file::open_read(path).map_err(StoreError::File)?;
    let size = file
        .metadata()
        .map_err(StoreError::io("stat index", path))?
        .len();
    load_index(&mut file, size, path)
}

/// Index files up to this size are read whole once their header and segment table are
/// checked; a larger one's checksum is first checked over pieces of [`INDEX_PIECE`] bytes,
/// so that a lying header over a huge (sparse) file never has it all in memory.
const INDEX_READ_WHOLE: u64 = 4 << 20;
/// See [`INDEX_READ_WHOLE`].
const INDEX_PIECE: usize = 1 << 20;

/// [`read_index`] from an open index file of `size` bytes: the header, then the segment table
/// in bounded pieces (each entry checked as read), then the size they imply, then (for a large
/// file) the checksum streamed, and only then the whole file into memory.
fn load_index<F: Read + io::Seek>(
    file: &mut F,
    size: u64,
    path: &Path,
) -> Result<Index, StoreError> {
    let corrupt = |source| StoreError::IndexCorrupt {
        path: path.to_path_buf(),
        source,
    };
    let read_error = |source| StoreError::Io {
        op: "read index",
        path: path.to_path_buf(),
        source,
    };
    let too_large = |size, limit| {
        StoreError::File(FileError::TooLarge {
            path: path.to_path_buf(),
            size,
            limit,
        })
    };
    let mut head = Vec::with_capacity(index::HEADER_LEN);
    (&mut *file)
        .take(index::HEADER_LEN as u64)
        .read_to_end(&mut head)
        .map_err(read_error)?;
    // A file too short for a header is refused here, naming the field it lacks.
    let limit = Index::size_limit(&head).map_err(corrupt)?;
    if size > limit {
        return Err(too_large(size, limit));
    }
    let mut check = index::PrefixCheck::new(&head).map_err(corrupt)?;
    let check_segments = check.segments_left() as usize;
    let mut stream = index::StreamCheck::default();
    stream.update(&head);
    let mut piece = vec![0u8; INDEX_PIECE];
    let per_piece = INDEX_PIECE / index::SEGMENT_ENTRY_LEN;
    while check.segments_left() > 0 {
        let entries = (check.segments_left() as usize).min(per_piece);
        let bytes = &mut piece[..entries * index::SEGMENT_ENTRY_LEN];
        let got = read_full(file, bytes).map_err(read_error)?;
        for entry in bytes[..got].chunks(index::SEGMENT_ENTRY_LEN) {
            check.segment(entry).map_err(corrupt)?;
        }
        if got < bytes.len() {
            return Err(corrupt(index::IndexError::Truncated {
                len: usize::try_from(size).unwrap_or(usize::MAX),
                what: "segment table",
            }));
        }
        stream.update(bytes);
    }
    let range = check.size_range();
    if size > *range.end() {
        return Err(too_large(size, *range.end()));
    }
    if size < *range.start() {
        return Err(corrupt(index::IndexError::Truncated {
            len: usize::try_from(size).unwrap_or(usize::MAX),
            what: "block entries",
        }));
    }
    if size > INDEX_READ_WHOLE {
        // Up to the size checked, even if the file grows meanwhile.
        let consumed = (index::HEADER_LEN + check_segments * index::SEGMENT_ENTRY_LEN) as u64;
        let mut rest = (&mut *file).take(size.saturating_sub(consumed));
        loop {
            let got = read_full(&mut rest, &mut piece).map_err(read_error)?;
            stream.update(&piece[..got]);
            if got < piece.len() {
                break;
            }
        }
        stream.finish(size).map_err(corrupt)?;
    }
    drop(piece);
    // The checks passed: the file (which may have changed since; it is decoded and checked
    // again as a whole) is read into memory, never more than the limit.
    file.rewind().map_err(read_error)?;
    let limit = *range.end();
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    (&mut *file)
        .take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64, limit));
    }
    Index::decode(&bytes).map_err(corrupt)
}

/// Reads into `buf` until it is full or the file ends; returns the bytes read.
fn read_full(file: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Refuses an image of more blocks than an index holds.
fn check_image_size(block_size: BlockSize, image_size: u64) -> Result<(), StoreError> {
    let blocks = block_size.blocks_for(image_size);
    if blocks > index::MAX_BLOCKS {
        return Err(StoreError::ImageTooLarge {
            image_size,
            blocks,
            max: index::MAX_BLOCKS,
        });
    }
    Ok(())
}

/// Writes a new file at `path`, 0600 from the start; whatever was there (a stale temporary
/// file, or a link planted to make this write land elsewhere) is unlinked first, never
/// followed.
fn write_file_durably(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(StoreError::io("remove", path)(e))
        }
        _ => {}
    }
    let mut file = file::create_private(path).map_err(StoreError::File)?;
    file.write_all(bytes)
        .map_err(StoreError::io("write", path))?;
    file.sync_all().map_err(StoreError::io("sync", path))
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(StoreError::io("sync directory", dir))
}

/// Bytes the file system has allocated for `path` (0 if it cannot be read).
pub fn allocated_bytes(path: &Path) -> u64 {
    fs::symlink_metadata(path)
        .map(|m| m.blocks() * 512)
        .unwrap_or(0)
}

#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod tests;

/// Turns readahead off (`random`) or back on for reads through `file`'s open description
/// (see [`DiskStore::set_drop_behind`]). Best effort: it only affects caching.
fn advise_readahead(file: &File, random: bool) {
    use std::os::fd::AsRawFd;
    let advice = if random {
        libc::POSIX_FADV_RANDOM
    } else {
        libc::POSIX_FADV_NORMAL
    };
    // SAFETY: fadvise on an open descriptor of ours; it does not touch memory.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, advice) };
}
