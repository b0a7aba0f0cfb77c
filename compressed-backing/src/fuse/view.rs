//! The [`Filesystem`] fuser drives: a root directory holding the image file.

use std::ffi::{OsStr, OsString};
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    CopyFileRangeFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, IoctlFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLseek,
    ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use parking_lot::Mutex;

use super::backing::Backing;
use super::cache::BlockCache;
use super::{bump, Counters, FuseOptions};

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
/// Permissions of the image file of a read-only view.
const READ_ONLY_FILE_PERM: u16 = 0o400;
/// Permissions of the root directory: owner-only, so that even with `allow_other` another
/// user cannot list the mount or learn the image's name and size.
const DIR_PERM: u16 = 0o700;

/// State shared by the request handlers and the [`MountedStore`](super::MountedStore) handle.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) cache: Mutex<BlockCache>,
    pub(super) counters: Arc<Counters>,
    pub(super) file_name: OsString,
    /// A view of a store reader: every change is refused with `EROFS`.
    read_only: bool,
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
    /// The state of a mount of `store` with `options`, as of now.
    pub(super) fn new(store: Backing, options: &FuseOptions) -> Self {
        let counters = Arc::new(Counters::default());
        let now = SystemTime::now();
        Self {
            file_name: OsString::from(&options.file_name),
            read_only: store.is_read_only(),
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
        }
    }

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
            perm: if self.read_only {
                READ_ONLY_FILE_PERM
            } else {
                FILE_PERM
            },
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
pub(super) struct View {
    shared: Arc<Shared>,
}

impl View {
    /// The view of a mount's shared state.
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }
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
        atime: Option<TimeOrNow>,
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
        // The `ro` mount makes the kernel refuse these first; this holds without it.
        let changes = [mode, uid, gid].iter().any(Option::is_some)
            || size.is_some()
            || atime.is_some()
            || mtime.is_some();
        if self.shared.read_only && changes {
            reply.error(Errno::EROFS);
            return;
        }
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

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino != FILE_INO {
            reply.error(not_the_file(ino));
            return;
        }
        let writes = flags.acc_mode() != OpenAccMode::O_RDONLY || flags.0 & libc::O_TRUNC != 0;
        if self.shared.read_only && writes {
            reply.error(Errno::EROFS);
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
        if self.shared.read_only {
            reply.error(Errno::EROFS);
            return;
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuse::tests::{store_with_image, BS};

    #[test]
    fn shared_reader_file_is_read_only_and_sized_as_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 3 * BS as u64 + 5);
        let shared = Shared::new(Backing::Reader(store.reader()), &FuseOptions::default());

        let attr = shared.file_attr();

        assert!(shared.read_only);
        assert_eq!(attr.perm, READ_ONLY_FILE_PERM);
        assert_eq!(attr.size, 3 * BS as u64 + 5);
        assert_eq!(attr.blksize, BS as u32);
    }

    #[test]
    fn shared_store_file_is_owner_read_write() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 2 * BS as u64);
        let shared = Shared::new(Backing::Store(Box::new(store)), &FuseOptions::default());

        let attr = shared.file_attr();

        assert!(!shared.read_only);
        assert_eq!(attr.perm, FILE_PERM);
        assert_eq!(attr.size, 2 * BS as u64);
    }
}
