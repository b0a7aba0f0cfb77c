//! FUSE view of a store: its RAM image appears as one plain file of the image's size.
//!
//! [`mount`] serves a [`DiskStore`] on a mountpoint as a directory holding one regular file
//! (`ram` by default). Reads decompress blocks, writes compress them; the file can be
//! `mmap`ed `MAP_PRIVATE` or `MAP_SHARED`, so another VMM can use it as a file-backed memory
//! image. The kernel page cache backs the mappings (no `direct_io`); dirty shared pages come
//! back as `WRITE` requests on `msync`, `fsync` and `munmap`.
//!
//! Between the kernel and the store sits a bounded clock cache of decompressed blocks with
//! dirty flags ([`BlockCache`](cache::BlockCache)). A write does read-modify-write of the
//! cached block (a write covering a whole block skips the read). Dirty blocks go to the store
//! with [`DiskStore::put`] when evicted, on `fsync`, on `flush`/`release` of the last open
//! handle and on unmount, followed by [`DiskStore::commit`]. A block whose `put` fails stays
//! dirty and the caller of `fsync`/`flush`/`close` gets `EIO`; a store error during a read is
//! `EIO`, never zeros. Nothing is logged per request: failures are counted in [`FuseStats`].
//!
//! [`mount_reader`] serves a [`StoreReader`] the same way, read-only: the image as it was when
//! the reader was taken, while the store's owner goes on writing it. The mount is `ro` and the
//! file mode 0400, so opening for writing, truncating and `chmod` fail with `EROFS` and a
//! writable `MAP_SHARED` mapping of the read-only descriptor with `EACCES`; `MAP_PRIVATE`
//! mappings work. Reads go through the same cache (never dirty here).

mod backing;
mod cache;
mod view;

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use fuser::{BackgroundSession, Config, Errno, MountOption, Session, SessionACL};

use crate::store::{DiskStore, StoreError, StoreReader};

use self::backing::Backing;
use self::view::{Shared, View};

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
    /// A write to a read-only view (see [`mount_reader`]).
    #[error("cannot write to a read-only view of a store reader")]
    ReadOnly,
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
            Self::ReadOnly => Errno::EROFS,
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
    /// Let users other than the mounting one (root included) reach the mount. Permissions are
    /// still checked by the kernel (`default_permissions`) against the modes: the file 0600
    /// (0400 read-only) and the directory 0700, owned by the mounting user, so only that
    /// user, and root, get in. Without it the kernel refuses every other user outright.
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

/// A store (or store reader) mounted as a file. Unmount with [`MountedStore::unmount`];
/// dropping the handle unmounts the same way and ignores errors.
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
    mount_backing(Backing::Store(Box::new(store)), mountpoint, options)
}

/// Mounts `reader` read-only on `mountpoint` (an existing directory), as [`mount`] does a
/// store: the file shows the image as it was when the reader was taken, whatever the store's
/// owner writes, commits or compacts afterwards. Writes fail with `EROFS`; unmounting has
/// nothing to write back. Take the reader right after a commit: blocks written but not
/// committed when it was taken must not be read once the owner rolls back.
pub fn mount_reader(
    reader: StoreReader,
    mountpoint: &Path,
    options: &FuseOptions,
) -> Result<MountedStore, FuseError> {
    mount_backing(Backing::Reader(reader), mountpoint, options)
}

fn mount_backing(
    backing: Backing,
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
    let access = if backing.is_read_only() {
        MountOption::RO
    } else {
        MountOption::RW
    };
    let shared = Arc::new(Shared::new(backing, options));
    let view = View::new(Arc::clone(&shared));
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("pvisor-store".to_owned()),
        MountOption::Subtype("pvisor-ram".to_owned()),
        MountOption::DefaultPermissions,
        access,
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
    /// threads; the store (or reader) is closed when this returns. A read-only view has
    /// nothing to write back.
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
        // The kernel aborts the connection right after it has the reply to DESTROY; a
        // serving thread that was between two requests then reads ECONNABORTED rather than
        // ENODEV (fs/fuse/dev.c, `fuse_dev_do_read` sees `!fpq->connected`), and fuser ends
        // its loop cleanly only on ENODEV. Nothing a caller waits on is in flight by then
        // (DESTROY comes after the last release), and the write-back below reports anything
        // left uncommitted, so that error is the session's normal end.
        let joined = session
            .join()
            .or_else(|source| match source.raw_os_error() {
                Some(libc::ECONNABORTED) => Ok(()),
                _ => Err(source),
            })
            .map_err(|source| FuseError::Session {
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

    pub(super) const BS: usize = 4096;

    /// Bytes unique to `seed` and position, compressible enough for lz4.
    pub(super) fn pattern(seed: u64, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| ((i as u64 / 8).wrapping_mul(seed | 1) >> 2) as u8 ^ seed as u8)
            .collect()
    }

    /// A committed store of `image_size` bytes with every block written; returns its image.
    pub(super) fn store_with_image(dir: &Path, image_size: u64) -> (DiskStore, Vec<u8>) {
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

    #[test]
    fn mount_reader_missing_mountpoint_is_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 4 * BS as u64);
        let missing = dir.path().join("no-such-dir");

        let err = mount_reader(store.reader(), &missing, &FuseOptions::default()).unwrap_err();

        assert!(matches!(err, FuseError::Mountpoint { .. }), "{err:?}");
        assert!(err.to_string().contains("no-such-dir"), "{err}");
    }

    #[test]
    fn mount_reader_bad_options_are_rejected_before_mounting() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = store_with_image(dir.path(), 4 * BS as u64);
        let options = FuseOptions {
            cache_blocks: 0,
            ..FuseOptions::default()
        };

        let err = mount_reader(store.reader(), dir.path(), &options).unwrap_err();

        assert!(
            matches!(
                err,
                FuseError::InvalidOption {
                    option: "cache_blocks",
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn error_read_only_maps_to_erofs() {
        assert_eq!(FuseError::ReadOnly.errno(), Errno::EROFS);
    }
}
