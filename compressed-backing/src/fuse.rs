//! FUSE view of a store: its RAM image appears as one plain file of the image's size.
//!
//! [`mount`] serves a [`DiskStore`] on a mountpoint as a directory holding one regular file
//! (`ram` by default). Reads decompress blocks, writes compress them; the file can be
//! `mmap`ed `MAP_PRIVATE` or `MAP_SHARED`, so another VMM can use it as a file-backed memory
//! image. The kernel page cache backs the mappings (no `direct_io`); dirty shared pages come
//! back as `WRITE` requests on `msync`, `fsync` and `munmap`.
//!
//! Between the kernel and the store sits a bounded clock cache of decompressed blocks with
//! dirty flags ([`BlockCache`]). A write does read-modify-write of the cached block (a write
//! covering a whole block skips the read). Dirty blocks go to the store with
//! [`DiskStore::put`] when evicted, on `fsync`, on `flush`/`release` of the last open handle
//! and on unmount, followed by [`DiskStore::commit`]. A block whose `put` fails stays dirty
//! and the caller of `fsync`/`flush`/`close` gets `EIO`; a store error during a read is `EIO`,
//! never zeros. Nothing is logged per request: failures are counted in [`FuseStats`].

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    BackgroundSession, Config, CopyFileRangeFlags, Errno, FileAttr, FileHandle, FileType,
    Filesystem, FopenFlags, Generation, INodeNo, IoctlFlags, KernelConfig, LockOwner, MountOption,
    OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request,
    Session, SessionACL, TimeOrNow, WriteFlags,
};
use parking_lot::Mutex;

use crate::store::{DiskStore, StoreError};

/// Inode of the root directory.
const ROOT_INO: INodeNo = INodeNo::ROOT;
/// Inode of the image file.
const FILE_INO: INodeNo = INodeNo(2);
/// How long the kernel may cache attributes and names (the file never changes size).
const ATTR_TTL: Duration = Duration::from_secs(1);
/// Largest read and write request asked of the kernel; it may grant less.
const MAX_REQUEST_BYTES: u32 = 1 << 20;
/// Permissions of the image file: it holds guest RAM.
const FILE_PERM: u16 = 0o600;
/// Permissions of the root directory.
const DIR_PERM: u16 = 0o755;
/// `entry_of` value of a block that is not cached.
const NOT_CACHED: u32 = u32::MAX;

/// Errors of the FUSE view.
#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    /// An option is out of range.
    #[error("invalid FUSE view option {option}: {reason}")]
    InvalidOption {
        /// The option.
        option: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The mountpoint cannot be resolved.
    #[error("mountpoint {mountpoint} is unusable")]
    Mountpoint {
        /// The mountpoint as given.
        mountpoint: PathBuf,
        /// The system error.
        #[source]
        source: io::Error,
    },
    /// `mount(2)` or the FUSE handshake failed.
    #[error("cannot mount the store on {mountpoint}")]
    Mount {
        /// The mountpoint.
        mountpoint: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The thread serving requests could not be started.
    #[error("cannot start the FUSE session on {mountpoint}")]
    Spawn {
        /// The mountpoint.
        mountpoint: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `umount(2)` failed; the store is still mounted.
    #[error("cannot unmount {mountpoint}")]
    Unmount {
        /// The mountpoint.
        mountpoint: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The session serving requests ended with an error.
    #[error("the FUSE session on {mountpoint} failed")]
    Session {
        /// The mountpoint.
        mountpoint: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A block could not be read from the store.
    #[error("cannot read block {block} from the store")]
    Read {
        /// The block.
        block: u64,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// A dirty block could not be written to the store; it stays dirty in the cache.
    #[error("cannot write block {block} back to the store")]
    WriteBack {
        /// The block.
        block: u64,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// The store could not commit; the written blocks stay pending.
    #[error("cannot commit the store")]
    Commit {
        /// The store's error.
        #[source]
        source: StoreError,
    },
}

impl FuseError {
    /// The errno a FUSE request failing with this error gets.
    fn errno(&self) -> Errno {
        match self {
            Self::Read { source, .. }
            | Self::WriteBack { source, .. }
            | Self::Commit { source } => {
                if source.is_no_space() {
                    Errno::ENOSPC
                } else {
                    Errno::EIO
                }
            }
            _ => Errno::EIO,
        }
    }
}

/// How a store is mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FuseOptions {
    /// Name of the image file in the mount's root directory.
    pub file_name: String,
    /// Decompressed blocks kept in memory (memory used: this times the block size).
    pub cache_blocks: usize,
    /// Threads serving FUSE requests.
    pub threads: usize,
    /// Let users other than the mounting one (root included) reach the file. Permissions are
    /// still checked by the kernel against the file's mode (0600, owned by the mounting user).
    pub allow_other: bool,
}

impl Default for FuseOptions {
    fn default() -> Self {
        Self {
            file_name: "ram".to_owned(),
            cache_blocks: 256,
            threads: 2,
            allow_other: false,
        }
    }
}

impl FuseOptions {
    /// Rejects options that cannot be mounted.
    fn validate(&self) -> Result<(), FuseError> {
        let invalid = |option, reason| Err(FuseError::InvalidOption { option, reason });
        let name = self.file_name.as_str();
        if name.is_empty() || name == "." || name == ".." {
            return invalid("file_name", "must be a plain file name");
        }
        if name.contains(['/', '\0']) {
            return invalid("file_name", "must not contain '/' or NUL");
        }
        if name.len() > 255 {
            return invalid("file_name", "must be at most 255 bytes");
        }
        if self.cache_blocks == 0 {
            return invalid("cache_blocks", "must be at least 1");
        }
        if self.threads == 0 {
            return invalid("threads", "must be at least 1");
        }
        Ok(())
    }
}

/// Counters of a mounted store, as a snapshot (see [`MountedStore::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct FuseStats {
    /// `READ` requests (page-cache fills and readahead).
    pub reads: u64,
    /// `WRITE` requests (`write(2)` and written-back shared mappings).
    pub writes: u64,
    /// Bytes returned by reads.
    pub bytes_read: u64,
    /// Bytes accepted by writes.
    pub bytes_written: u64,
    /// Blocks read from the store and decoded into the cache.
    pub blocks_decompressed: u64,
    /// Dirty blocks written to the store (`put`).
    pub blocks_written_back: u64,
    /// Store commits.
    pub commits: u64,
    /// Block lookups served from the cache.
    pub cache_hits: u64,
    /// Block lookups that had to fill a cache entry.
    pub cache_misses: u64,
    /// Reads failed with a store error (`EIO`).
    pub read_errors: u64,
    /// Writes failed with a store error.
    pub write_errors: u64,
    /// Failed `put`s or commits of dirty blocks (the blocks stay dirty).
    pub writeback_errors: u64,
    /// Commits that were durable but whose compaction afterwards failed.
    pub compaction_errors: u64,
}

/// The live counters behind [`FuseStats`].
#[derive(Debug, Default)]
struct Counters {
    reads: AtomicU64,
    writes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    blocks_decompressed: AtomicU64,
    blocks_written_back: AtomicU64,
    commits: AtomicU64,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
    read_errors: AtomicU64,
    write_errors: AtomicU64,
    writeback_errors: AtomicU64,
    compaction_errors: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

impl Counters {
    fn snapshot(&self) -> FuseStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        FuseStats {
            reads: get(&self.reads),
            writes: get(&self.writes),
            bytes_read: get(&self.bytes_read),
            bytes_written: get(&self.bytes_written),
            blocks_decompressed: get(&self.blocks_decompressed),
            blocks_written_back: get(&self.blocks_written_back),
            commits: get(&self.commits),
            cache_hits: get(&self.cache_hits),
            cache_misses: get(&self.cache_misses),
            read_errors: get(&self.read_errors),
            write_errors: get(&self.write_errors),
            writeback_errors: get(&self.writeback_errors),
            compaction_errors: get(&self.compaction_errors),
        }
    }
}

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

/// A bounded clock cache of decompressed blocks in front of a store, with dirty flags.
#[derive(Debug)]
struct BlockCache {
    store: DiskStore,
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

/// Index of a block in per-block arrays; blocks are below `DiskStore::blocks()`, the length
/// of the store's own slot array.
fn block_index(block: u64) -> usize {
    usize::try_from(block).expect("block numbers index an in-memory array")
}

impl BlockCache {
    fn new(store: DiskStore, cache_blocks: usize, counters: Arc<Counters>) -> Self {
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
    fn read(&mut self, offset: u64, size: u32) -> Result<Vec<u8>, FuseError> {
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
    /// if nothing was written; a failure after some blocks gives a short count.
    fn write(&mut self, offset: u64, data: &[u8]) -> Result<usize, FuseError> {
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
        match self.store.put(block, &entry.data[..len]) {
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
    fn write_back(&mut self) -> Result<(), FuseError> {
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
        match self.store.commit() {
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

/// State shared by the request handlers and the [`MountedStore`] handle.
#[derive(Debug)]
struct Shared {
    cache: Mutex<BlockCache>,
    counters: Arc<Counters>,
    file_name: OsString,
    image_size: u64,
    block_size: u32,
    uid: u32,
    gid: u32,
    mounted_at: SystemTime,
    /// Time of the last write, in nanoseconds since the epoch.
    modified_ns: AtomicU64,
    /// Open handles of the image file.
    open_files: AtomicU64,
    next_handle: AtomicU64,
}

fn nanos_since_epoch(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl Shared {
    fn file_attr(&self) -> FileAttr {
        let modified = UNIX_EPOCH + Duration::from_nanos(self.modified_ns.load(Ordering::Relaxed));
        FileAttr {
            ino: FILE_INO,
            size: self.image_size,
            blocks: self.image_size.div_ceil(512),
            atime: modified,
            mtime: modified,
            ctime: modified,
            crtime: self.mounted_at,
            kind: FileType::RegularFile,
            perm: FILE_PERM,
            nlink: 1,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: self.block_size,
            flags: 0,
        }
    }

    fn dir_attr(&self) -> FileAttr {
        FileAttr {
            ino: ROOT_INO,
            size: 0,
            blocks: 0,
            atime: self.mounted_at,
            mtime: self.mounted_at,
            ctime: self.mounted_at,
            crtime: self.mounted_at,
            kind: FileType::Directory,
            perm: DIR_PERM,
            nlink: 2,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn attr(&self, ino: INodeNo) -> Option<FileAttr> {
        match ino {
            ROOT_INO => Some(self.dir_attr()),
            FILE_INO => Some(self.file_attr()),
            _ => None,
        }
    }

    fn touch(&self, time: SystemTime) {
        self.modified_ns
            .store(nanos_since_epoch(time), Ordering::Relaxed);
    }

    /// Writes back and commits; the reply to a request that needs durability.
    fn sync(&self) -> Result<(), Errno> {
        self.cache.lock().write_back().map_err(|err| err.errno())
    }
}

/// The error for a file operation on an inode other than the image file.
fn not_the_file(ino: INodeNo) -> Errno {
    if ino == ROOT_INO {
        Errno::EISDIR
    } else {
        Errno::ENOENT
    }
}

/// Implements [`Filesystem`] methods that only reply with an error, one line each.
macro_rules! refuse {
    ($($method:ident($($arg:ty),* $(,)?) -> $reply:ty = $errno:expr;)*) => {
        $(
            fn $method(&self, $(_: $arg,)* reply: $reply) {
                reply.error($errno);
            }
        )*
    };
}

/// The [`Filesystem`] fuser drives.
#[derive(Debug)]
struct View {
    shared: Arc<Shared>,
}

impl Filesystem for View {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        // On refusal each setter names the nearest value it accepts.
        if let Err(nearest) = config.set_max_write(MAX_REQUEST_BYTES) {
            let _ = config.set_max_write(nearest);
        }
        if let Err(nearest) = config.set_max_readahead(MAX_REQUEST_BYTES) {
            let _ = config.set_max_readahead(nearest);
        }
        Ok(())
    }

    fn destroy(&mut self) {
        // Failures are counted; `MountedStore::unmount` retries and reports them.
        let _ = self.shared.cache.lock().write_back();
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent != ROOT_INO {
            reply.error(Errno::ENOTDIR);
        } else if name == self.shared.file_name {
            reply.entry(&ATTR_TTL, &self.shared.file_attr(), Generation(0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.shared.attr(ino) {
            Some(attr) => reply.attr(&ATTR_TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let Some(attr) = self.shared.attr(ino) else {
            reply.error(Errno::ENOENT);
            return;
        };
        let mode_changes = mode.is_some_and(|m| m & 0o7777 != u32::from(attr.perm));
        let owner_changes =
            uid.is_some_and(|u| u != attr.uid) || gid.is_some_and(|g| g != attr.gid);
        if mode_changes || owner_changes {
            reply.error(Errno::EPERM);
            return;
        }
        if let Some(size) = size {
            // The image has a fixed size; truncating to it is a no-op.
            let refusal = if ino != FILE_INO {
                Some(Errno::EISDIR)
            } else if size > attr.size {
                Some(Errno::EFBIG)
            } else if size < attr.size {
                Some(Errno::EINVAL)
            } else {
                None
            };
            if let Some(errno) = refusal {
                reply.error(errno);
                return;
            }
        }
        if ino == FILE_INO {
            match mtime {
                Some(TimeOrNow::SpecificTime(time)) => self.shared.touch(time),
                Some(TimeOrNow::Now) => self.shared.touch(SystemTime::now()),
                None => {}
            }
        }
        match self.shared.attr(ino) {
            Some(attr) => reply.attr(&ATTR_TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if ino != FILE_INO {
            reply.error(not_the_file(ino));
            return;
        }
        self.shared.open_files.fetch_add(1, Ordering::SeqCst);
        let fh = self.shared.next_handle.fetch_add(1, Ordering::Relaxed);
        // Every change goes through the kernel's page cache, so it stays valid across opens.
        reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != FILE_INO {
            reply.error(not_the_file(ino));
            return;
        }
        let counters = &self.shared.counters;
        bump(&counters.reads, 1);
        let result = self.shared.cache.lock().read(offset, size);
        match result {
            Ok(data) => {
                bump(&counters.bytes_read, data.len() as u64);
                reply.data(&data);
            }
            Err(err) => {
                bump(&counters.read_errors, 1);
                reply.error(err.errno());
            }
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino != FILE_INO {
            reply.error(not_the_file(ino));
            return;
        }
        let counters = &self.shared.counters;
        bump(&counters.writes, 1);
        if data.is_empty() {
            reply.written(0);
            return;
        }
        if offset >= self.shared.image_size {
            reply.error(Errno::EFBIG);
            return;
        }
        let result = self.shared.cache.lock().write(offset, data);
        match result {
            Ok(written) => {
                bump(&counters.bytes_written, written as u64);
                self.shared.touch(SystemTime::now());
                reply.written(u32::try_from(written).expect("a write request is below 4 GiB"));
            }
            Err(err) => {
                bump(&counters.write_errors, 1);
                reply.error(err.errno());
            }
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Called on every close(2); write back when the last open handle closes, so the
        // caller learns of write-back failures.
        if self.shared.open_files.load(Ordering::SeqCst) > 1 {
            reply.ok();
            return;
        }
        match self.shared.sync() {
            Ok(()) => reply.ok(),
            Err(errno) => reply.error(errno),
        }
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if ino != FILE_INO {
            reply.ok();
            return;
        }
        let previous = self
            .shared
            .open_files
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .unwrap_or(0);
        if previous > 1 {
            reply.ok();
            return;
        }
        // The last handle, possibly held only by a mapping: write back what it dirtied.
        match self.shared.sync() {
            Ok(()) => reply.ok(),
            Err(errno) => reply.error(errno),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.shared.sync() {
            Ok(()) => reply.ok(),
            Err(errno) => reply.error(errno),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != ROOT_INO {
            reply.error(Errno::ENOTDIR);
            return;
        }
        let entries: [(INodeNo, FileType, &OsStr); 3] = [
            (ROOT_INO, FileType::Directory, OsStr::new(".")),
            (ROOT_INO, FileType::Directory, OsStr::new("..")),
            (FILE_INO, FileType::RegularFile, &self.shared.file_name),
        ];
        let skip = usize::try_from(offset).unwrap_or(usize::MAX);
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(skip) {
            // The offset of an entry is that of the next one.
            if reply.add(ino, i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let block = u64::from(self.shared.block_size);
        let blocks = self.shared.image_size.div_ceil(block);
        let bsize = self.shared.block_size;
        reply.statfs(blocks, 0, 0, 1, 0, bsize, 255, bsize);
    }

    // The rest refuses quietly what makes no sense for a fixed one-file tree (fuser's
    // defaults log a warning per request). ENOSYS makes the kernel stop asking.
    refuse! {
        getxattr(&Request, INodeNo, &OsStr, u32) -> ReplyXattr = Errno::NO_XATTR;
        listxattr(&Request, INodeNo, u32) -> ReplyXattr = Errno::ENOSYS;
        setxattr(&Request, INodeNo, &OsStr, &[u8], i32, u32) -> ReplyEmpty = Errno::ENOTSUP;
        removexattr(&Request, INodeNo, &OsStr) -> ReplyEmpty = Errno::ENOTSUP;
        readlink(&Request, INodeNo) -> ReplyData = Errno::EINVAL;
        mknod(&Request, INodeNo, &OsStr, u32, u32, u32) -> ReplyEntry = Errno::EPERM;
        mkdir(&Request, INodeNo, &OsStr, u32, u32) -> ReplyEntry = Errno::EPERM;
        create(&Request, INodeNo, &OsStr, u32, u32, i32) -> ReplyCreate = Errno::EPERM;
        unlink(&Request, INodeNo, &OsStr) -> ReplyEmpty = Errno::EPERM;
        rmdir(&Request, INodeNo, &OsStr) -> ReplyEmpty = Errno::EPERM;
        symlink(&Request, INodeNo, &OsStr, &Path) -> ReplyEntry = Errno::EPERM;
        link(&Request, INodeNo, INodeNo, &OsStr) -> ReplyEntry = Errno::EPERM;
        rename(&Request, INodeNo, &OsStr, INodeNo, &OsStr, RenameFlags) -> ReplyEmpty =
            Errno::EPERM;
        fallocate(&Request, INodeNo, FileHandle, u64, u64, i32) -> ReplyEmpty = Errno::ENOTSUP;
        lseek(&Request, INodeNo, FileHandle, i64, i32) -> ReplyLseek = Errno::ENOSYS;
        copy_file_range(
            &Request, INodeNo, FileHandle, u64, INodeNo, FileHandle, u64, u64, CopyFileRangeFlags
        ) -> ReplyWrite = Errno::ENOSYS;
        ioctl(&Request, INodeNo, FileHandle, IoctlFlags, u32, &[u8], u32) -> ReplyIoctl =
            Errno::ENOTTY;
    }
}

/// A store mounted as a file. Unmount with [`MountedStore::unmount`]; dropping the handle
/// unmounts the same way and ignores errors.
#[derive(Debug)]
pub struct MountedStore {
    /// `None` once unmounted.
    session: Option<BackgroundSession>,
    shared: Arc<Shared>,
    /// Canonical mountpoint.
    mountpoint: PathBuf,
    /// Device number of the mounted root, to recognize the mount later.
    root_dev: Option<u64>,
}

/// Mounts `store` on `mountpoint` (an existing directory) and serves it from background
/// threads until [`MountedStore::unmount`]. fuser calls `mount(2)` itself where it may
/// (as root) and falls back to the setuid `fusermount3` helper otherwise.
pub fn mount(
    store: DiskStore,
    mountpoint: &Path,
    options: &FuseOptions,
) -> Result<MountedStore, FuseError> {
    options.validate()?;
    let mountpoint = mountpoint
        .canonicalize()
        .map_err(|source| FuseError::Mountpoint {
            mountpoint: mountpoint.to_path_buf(),
            source,
        })?;
    let counters = Arc::new(Counters::default());
    let now = SystemTime::now();
    let shared = Arc::new(Shared {
        file_name: OsString::from(&options.file_name),
        image_size: store.image_size(),
        block_size: u32::try_from(store.block_size().bytes_u64())
            .expect("blocks are at most 2 MiB"),
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
        mounted_at: now,
        modified_ns: AtomicU64::new(nanos_since_epoch(now)),
        open_files: AtomicU64::new(0),
        next_handle: AtomicU64::new(1),
        cache: Mutex::new(BlockCache::new(
            store,
            options.cache_blocks,
            Arc::clone(&counters),
        )),
        counters,
    });
    let view = View {
        shared: Arc::clone(&shared),
    };
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("pvisor-store".to_owned()),
        MountOption::Subtype("pvisor-ram".to_owned()),
        MountOption::DefaultPermissions,
        MountOption::RW,
        MountOption::NoAtime,
    ];
    config.acl = if options.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(options.threads);
    let session = Session::new(view, &mountpoint, &config).map_err(|source| FuseError::Mount {
        mountpoint: mountpoint.clone(),
        source,
    })?;
    let session = session.spawn().map_err(|source| FuseError::Spawn {
        mountpoint: mountpoint.clone(),
        source,
    })?;
    let root_dev = fs::metadata(&mountpoint).ok().map(|m| m.dev());
    Ok(MountedStore {
        session: Some(session),
        shared,
        mountpoint,
        root_dev,
    })
}

impl MountedStore {
    /// The image file: mountpoint/file name.
    pub fn file_path(&self) -> PathBuf {
        self.mountpoint.join(&self.shared.file_name)
    }

    /// The (canonical) mountpoint.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// The counters so far.
    pub fn stats(&self) -> FuseStats {
        self.shared.counters.snapshot()
    }

    /// Writes back dirty blocks, commits the store, unmounts and waits for the serving
    /// threads; the store is closed when this returns.
    ///
    /// If the file is still open or mapped (`EBUSY`), the mount is detached lazily: the
    /// mountpoint is free at once, the remaining users keep working, and this returns after
    /// the last of them closes the file, with their writes committed.
    pub fn unmount(mut self) -> Result<FuseStats, FuseError> {
        let session = self
            .session
            .take()
            .expect("only unmount and drop take the session");
        self.finish(session)
    }

    fn finish(&self, session: BackgroundSession) -> Result<FuseStats, FuseError> {
        // Commit first, so the store is consistent even if unmounting fails. A failure here
        // is retried below, after the last writes have come in.
        let _ = self.shared.cache.lock().write_back();
        self.detach()?;
        let joined = session.join().map_err(|source| FuseError::Session {
            mountpoint: self.mountpoint.clone(),
            source,
        });
        // Writes the kernel flushed while unmounting were committed by `destroy`; this
        // reports what it could not commit.
        self.shared.cache.lock().write_back()?;
        joined.map(|()| self.stats())
    }

    /// Unmounts the mountpoint if it still holds this mount; lazily if it is busy.
    fn detach(&self) -> Result<(), FuseError> {
        let current = fs::metadata(&self.mountpoint).ok().map(|m| m.dev());
        let ours = match (current, self.root_dev) {
            (Some(current), Some(root)) => current == root,
            // Cannot tell: try, `umount` refuses a path that is not a mountpoint.
            _ => true,
        };
        if !ours {
            // Someone unmounted it already (and something else may be mounted there now).
            return Ok(());
        }
        let result = match nix::mount::umount(&self.mountpoint) {
            Err(nix::errno::Errno::EBUSY) => {
                nix::mount::umount2(&self.mountpoint, nix::mount::MntFlags::MNT_DETACH)
            }
            // Not a mountpoint any more: unmounted from outside.
            Err(nix::errno::Errno::EINVAL) => Ok(()),
            other => other,
        };
        result.map_err(|errno| FuseError::Unmount {
            mountpoint: self.mountpoint.clone(),
            source: io::Error::from(errno),
        })
    }
}

impl Drop for MountedStore {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            let _ = self.finish(session);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{Codec, CodecConfig};
    use crate::layout::BlockSize;
    use crate::store::StoreConfig;
    use proptest::prelude::*;
    use std::os::unix::fs::FileExt;

    const BS: usize = 4096;

    /// Bytes unique to `seed` and position, compressible enough for lz4.
    fn pattern(seed: u64, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| ((i as u64 / 8).wrapping_mul(seed | 1) >> 2) as u8 ^ seed as u8)
            .collect()
    }

    /// A committed store of `image_size` bytes with every block written; returns its image.
    fn store_with_image(dir: &Path, image_size: u64) -> (DiskStore, Vec<u8>) {
        let mut store = DiskStore::create(
            dir,
            StoreConfig {
                block_size: BlockSize::new(BS as u64).unwrap(),
                codec: CodecConfig::new(Codec::Lz4),
                image_size,
            },
        )
        .unwrap();
        let mut image = Vec::new();
        for block in 0..store.blocks() {
            let data = pattern(block + 1, store.block_len(block));
            store.put(block, &data).unwrap();
            image.extend_from_slice(&data);
        }
        store.commit().unwrap();
        (store, image)
    }

    fn cache(store: DiskStore, blocks: usize) -> (BlockCache, Arc<Counters>) {
        let counters = Arc::new(Counters::default());
        (
            BlockCache::new(store, blocks, Arc::clone(&counters)),
            counters,
        )
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
        assert_eq!(store_image(&cache.store), image);
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
        assert_ne!(store_image(&cache.store), image);
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

        assert_eq!(cache.store.generation(), generation);
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
    fn options_bad_values_are_rejected() {
        let bad = [
            FuseOptions {
                file_name: String::new(),
                ..FuseOptions::default()
            },
            FuseOptions {
                file_name: "a/b".to_owned(),
                ..FuseOptions::default()
            },
            FuseOptions {
                file_name: "..".to_owned(),
                ..FuseOptions::default()
            },
            FuseOptions {
                cache_blocks: 0,
                ..FuseOptions::default()
            },
            FuseOptions {
                threads: 0,
                ..FuseOptions::default()
            },
        ];

        for options in bad {
            assert!(
                matches!(options.validate(), Err(FuseError::InvalidOption { .. })),
                "{options:?}"
            );
        }
        FuseOptions::default().validate().unwrap();
    }

    #[test]
    fn mount_missing_mountpoint_is_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 4 * BS as u64);
        let missing = dir.path().join("no-such-dir");

        let err = mount(store, &missing, &FuseOptions::default()).unwrap_err();

        assert!(matches!(err, FuseError::Mountpoint { .. }), "{err:?}");
        assert!(err.to_string().contains("no-such-dir"), "{err}");
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
