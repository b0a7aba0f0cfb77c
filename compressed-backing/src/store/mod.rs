//! `DiskStore`: an on-disk store for offloaded RAM.
//!
//! A store is a directory holding append-only segment files of block payloads, one index file
//! and a lock file. Writes (`put`, `discard`) append payloads and change the in-memory slots;
//! `commit` makes them durable: fsync the segments written, write the new index to
//! `index.tmp`, fsync it, rename it over `index` and fsync the directory. A crash at any point
//! leaves either the old index, which references only bytes that were already durable, or the
//! new one. Payloads are never overwritten in place, so the old image stays intact until a
//! commit that no longer references it; only then does compaction delete or rewrite segments.

//!
//! - `error`: what fails, naming the file, block and offset;
//! - `report`: the store's configuration and what it reports (stats, verify, compaction);
//! - `batch`: a batch of encoded blocks, written with one append;
//! - `maintenance`: compaction, verification, statistics;
//! - `files`: the lock, the index file read back, durable writes;
//! - `index`, `segment`, `reader`: the index's format, segment files, concurrent reads.

mod batch;
mod commit;
mod error;
mod files;
mod index;
mod maintenance;
mod reader;
mod report;
mod sealed;
mod segment;

pub(crate) use batch::EncodedBatch;
pub use error::StoreError;
pub use files::allocated_bytes;
use files::{advise_readahead, check_image_size, lock_dir, read_index, sync_dir};
pub use report::{
    CompactionReport, Durability, Problem, StoreConfig, StoreOptions, StoreStats, VerifyReport,
};
pub(crate) use sealed::{
    index_segments, index_size_limit, is_segment_file_name, parse_segment_file_name,
    renumbered_index, segment_file_name, INDEX_HEADER_LEN,
};

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use index::IndexError;
use index::{DataRef, Slot};
use reader::ReadPath;
pub use reader::{SegmentFill, StoreReader};
use segment::Segment;

use crate::codec::{BlockKind, CodecConfig, Encoded, Encoder};
use crate::file;
use crate::layout::BlockSize;

const INDEX_FILE: &str = "index";
const INDEX_TMP: &str = "index.tmp";
const LOCK_FILE: &str = "lock";
/// The metadata key of a sealed store's id (bound into every payload's seal).
pub(crate) const STORE_ID_KEY: &str = "store-id";

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
    /// `fsync`s and `fdatasync`s this handle made (see [`DiskStore::syncs`]).
    syncs: u64,
    /// Reads drop the pages they read from the page cache (see `set_drop_behind`), and fill
    /// missing bytes (see `set_fill`).
    how: ReadPath,
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
            syncs: 0,
            how: ReadPath::default(),
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
            syncs: 0,
            how: ReadPath {
                sealed: index.sealed,
                ..ReadPath::default()
            },
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
        reader::read_block(&self.dir, block, slot, out, &self.how, &|id| {
            self.segment_file(id)
        })
    }

    /// A read-only view of the image as it is now, for other threads while this store goes
    /// on being written (see [`StoreReader`]).
    pub fn reader(&self) -> StoreReader {
        StoreReader {
            how: self.how.clone(),
            meta: Arc::new(self.meta.clone()),
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

    /// Reads fill what the segment files lack through `fill` (a mirror of a remote store:
    /// see [`SegmentFill`]); for this store and the readers taken from it from now on.
    pub fn set_fill(&mut self, fill: Arc<dyn SegmentFill>) {
        self.how.fill = Some(fill);
    }

    /// The segments the image uses, by id, with their committed lengths.
    pub fn segment_lengths(&self) -> BTreeMap<u32, u64> {
        self.segments
            .iter()
            .map(|(&id, seg)| (id, seg.committed_len))
            .collect()
    }

    /// Where block `block`'s payload lies: its segment, offset and length (`None` for a
    /// block stored as a tag, absent, or out of range).
    pub fn payload_location(&self, block: u64) -> Option<(u32, u64, u32)> {
        match self.slot(block) {
            Ok(Slot::Data(data)) => Some((data.segment, data.offset, data.len)),
            _ => None,
        }
    }

    /// What later commits survive (see [`Durability`]; [`Durability::Host`] unless set).
    pub fn set_durability(&mut self, durability: Durability) {
        self.options.durability = durability;
    }

    /// Whether drop-behind reads go around the page cache where they can (on by default; see
    /// [`DiskStore::set_drop_behind`]). For this store and the readers taken from it from now
    /// on.
    pub fn set_direct_reads(&mut self, on: bool) {
        match (on, &self.how.direct) {
            (true, Some(_)) => {}
            (true, None) => self.how.direct = Some(Arc::default()),
            (false, _) => self.how.direct = None,
        }
    }

    /// Segment `id` is deleted: no direct descriptor keeps its file's space.
    fn forget_segment(&self, id: u32) {
        if let Some(direct) = &self.how.direct {
            direct.forget(id);
        }
    }

    /// Payloads read around the page cache (`O_DIRECT`) by this store and its readers.
    pub fn direct_reads(&self) -> u64 {
        self.how.direct.as_ref().map_or(0, |d| d.reads())
    }

    /// What a commit survives now.
    pub fn durability(&self) -> Durability {
        self.options.durability
    }

    /// `fsync`s and `fdatasync`s this handle has made since it was opened: what its
    /// durability cost in syncs (none under [`Durability::Process`]).
    pub fn syncs(&self) -> u64 {
        self.syncs
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
    ///
    /// Where the file system allows it, such reads go around the page cache altogether
    /// (`O_DIRECT`; [`DiskStore::direct_reads`] counts them).
    pub fn set_drop_behind(&mut self, on: bool) {
        self.how.drop_behind = on;
        if on && self.how.direct.is_none() {
            self.how.direct = Some(Arc::default());
        }
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
                    self.forget_segment(id);
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
        reader::read_payload(&self.dir, block, data, buf, &self.how, &|id| {
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
            if self.how.drop_behind {
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

#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod tests;
