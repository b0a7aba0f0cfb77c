//! The local read cache of remote stores: one directory per user, private to it, holding a
//! mirror of each remote store read (a store directory whose segment files are sparse, filled
//! by range reads as blocks are needed). Bounded: when what the mirrors hold passes the
//! limit, the segment files filled least recently lose their bytes (holes punched; a block read
//! from one again is fetched again, its checksum tells).

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use parking_lot::Mutex;

use crate::file;

/// Why the cache cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The directory is not private to this user: it would let another read guest memory or
    /// plant bytes.
    #[error(
        "cache directory {path} is not private to this user (owner uid {owner}, mode {mode:o}): \
         it must be a directory owned by uid {uid} with no access for group or others"
    )]
    NotPrivate {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// Its permission bits.
        mode: u32,
        /// This process's effective uid.
        uid: u32,
    },
    /// A file operation failed.
    #[error("cache: cannot {op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> CacheError + 'a {
    move |source| CacheError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// The cache directory and its bound. Shared by every store of a process.
#[derive(Debug)]
pub struct Cache {
    root: PathBuf,
    limit: u64,
    /// Bytes filled since the bound was last enforced.
    filled: AtomicU64,
    enforcing: Mutex<()>,
}

/// What the cache holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheUsage {
    /// Bytes allocated by the mirrors' segment files.
    pub bytes: u64,
    /// Segment files.
    pub files: u64,
}

impl Cache {
    /// Opens (creating, 0700) the cache at `root`, which must be a directory of this user's
    /// with no access for anyone else; `limit` bytes at most are kept.
    pub fn open(root: &Path, limit: u64) -> Result<Self, CacheError> {
        file::create_private_dir(root).map_err(io("create", root))?;
        let meta = fs::symlink_metadata(root).map_err(io("stat", root))?;
        let uid = nix::unistd::geteuid().as_raw();
        if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
            return Err(CacheError::NotPrivate {
                path: root.to_path_buf(),
                owner: meta.uid(),
                mode: meta.mode() & 0o7777,
                uid,
            });
        }
        Ok(Self {
            root: root.to_path_buf(),
            limit,
            filled: AtomicU64::new(0),
            enforcing: Mutex::new(()),
        })
    }

    /// The cache directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The bound, in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The directory of the mirror named `name` (made, 0700, if missing).
    pub(crate) fn mirror_dir(&self, name: &str) -> Result<PathBuf, CacheError> {
        let dir = self.root.join(name);
        file::create_private_dir(&dir).map_err(io("create", &dir))?;
        Ok(dir)
    }

    /// Counts `bytes` just filled; enforces the bound once an eighth of it was filled since
    /// the last time.
    /// A fault that finds another thread enforcing it goes on: one scan at a time, and
    /// no fault waits for it.
    pub(crate) fn filled(&self, bytes: u64) {
        let since = self.filled.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if since >= (self.limit / 8).max(1) {
            if let Some(one) = self.enforcing.try_lock() {
                let _ = self.enforce_locked(one);
            }
        }
    }

    /// Punches holes in the segment files filled least recently until the mirrors hold at
    /// most 7/8 of the bound. Files in use stay valid: a read of a hole fails its checksum and
    /// is fetched again.
    pub fn enforce(&self) -> Result<CacheUsage, CacheError> {
        self.enforce_locked(self.enforcing.lock())
    }

    fn enforce_locked(
        &self,
        _one: parking_lot::MutexGuard<'_, ()>,
    ) -> Result<CacheUsage, CacheError> {
        self.filled.store(0, Ordering::Relaxed);
        let mut files = self.segment_files()?;
        let mut held: u64 = files.iter().map(|f| f.allocated).sum();
        if held > self.limit {
            let target = self.limit - self.limit / 8;
            files.sort_by_key(|f| f.modified);
            for f in &files {
                if held <= target {
                    break;
                }
                if f.allocated == 0 {
                    continue;
                }
                punch_whole(&f.path)?;
                held = held.saturating_sub(f.allocated);
            }
        }
        Ok(CacheUsage {
            bytes: held,
            files: files.len() as u64,
        })
    }

    fn segment_files(&self) -> Result<Vec<CachedFile>, CacheError> {
        let mut out = Vec::new();
        let mirrors = fs::read_dir(&self.root).map_err(io("list", &self.root))?;
        for mirror in mirrors.flatten() {
            let Ok(kind) = mirror.file_type() else {
                continue;
            };
            // Mirrors only: a store being packed, sealed or uploaded in the cache is never
            // punched (its holes would be uploaded).
            let is_mirror = mirror.file_name().to_str().is_some_and(is_mirror_name);
            if !kind.is_dir() || !is_mirror {
                continue;
            }
            let Ok(entries) = fs::read_dir(mirror.path()) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name();
                let is_segment = name
                    .to_str()
                    .is_some_and(crate::store::is_segment_file_name);
                let Ok(meta) = entry.metadata() else {
                    continue;
                };
                if is_segment && meta.is_file() {
                    out.push(CachedFile {
                        path: entry.path(),
                        allocated: meta.blocks() * 512,
                        modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    });
                }
            }
        }
        Ok(out)
    }
}

/// Whether `name` is a mirror's directory name (`BUCKET-` and 32 hex digits).
fn is_mirror_name(name: &str) -> bool {
    name.rsplit_once('-').is_some_and(|(bucket, hash)| {
        !bucket.is_empty() && hash.len() == 32 && hash.bytes().all(|b| b.is_ascii_hexdigit())
    })
}

#[derive(Debug)]
struct CachedFile {
    path: PathBuf,
    allocated: u64,
    modified: SystemTime,
}

/// Frees every byte of a file, keeping its size.
fn punch_whole(path: &Path) -> Result<(), CacheError> {
    let f = file::open_regular(path, fs::OpenOptions::new().write(true)).map_err(|e| {
        CacheError::Io {
            op: "open",
            path: path.to_path_buf(),
            source: std::io::Error::other(e),
        }
    })?;
    let len = f.metadata().map_err(io("stat", path))?.len();
    if len == 0 {
        return Ok(());
    }
    // SAFETY: fallocate on an open descriptor of ours; it touches no memory of ours.
    let rc = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            0,
            libc::off_t::try_from(len).unwrap_or(libc::off_t::MAX),
        )
    };
    if rc != 0 {
        return Err(io("punch holes in", path)(std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_cache_open_to_others_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("cache");
        let cache = Cache::open(&root, 1 << 20).expect("a new cache");
        let mode = fs::metadata(&root).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        drop(cache);
        fs::set_permissions(&root, fs::Permissions::from_mode(0o750)).expect("chmod");
        let err = Cache::open(&root, 1 << 20).expect_err("group-readable");
        assert!(matches!(err, CacheError::NotPrivate { .. }), "{err}");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&root, &link).expect("symlink");
        fs::set_permissions(&root, fs::Permissions::from_mode(0o700)).expect("chmod");
        assert!(Cache::open(&link, 1 << 20).is_err(), "a link is followed");
    }

    #[test]
    fn the_bound_punches_the_oldest_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = Cache::open(&dir.path().join("cache"), 3 << 20).expect("cache");
        let mirror = cache
            .mirror_dir(&format!("bucket-{}", "0".repeat(32)))
            .expect("mirror");
        // A store being uploaded from the cache is never punched.
        let staging = cache.mirror_dir("pack-abc123").expect("staging");
        fs::write(
            staging.join(crate::store::segment_file_name(0)),
            vec![1u8; 1 << 20],
        )
        .expect("write");
        for id in 0..4u32 {
            let path = mirror.join(crate::store::segment_file_name(id));
            fs::write(&path, vec![1u8; 1 << 20]).expect("write");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let usage = cache.enforce().expect("enforce");
        assert!(usage.bytes <= 3 << 20, "{usage:?}");
        let first = mirror.join(crate::store::segment_file_name(0));
        let meta = fs::metadata(&first).expect("stat");
        assert_eq!(meta.len(), 1 << 20, "the size stays");
        assert_eq!(meta.blocks(), 0, "the oldest file lost its bytes");
        let last = mirror.join(crate::store::segment_file_name(3));
        assert!(fs::metadata(last).expect("stat").blocks() > 0);
        let staged = staging.join(crate::store::segment_file_name(0));
        assert!(
            fs::metadata(staged).expect("stat").blocks() > 0,
            "a staging store punched"
        );
    }
}
