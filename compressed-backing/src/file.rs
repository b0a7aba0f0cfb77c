//! Opening files that may be hostile: a store file, a memory image, a config or trajectory
//! given on the command line may be a symbolic link to someone else's data, a FIFO whose
//! `open` or `read` blocks forever, a device that never ends, or a sparse file of many GiB.
//!
//! - [`open_regular`] opens with `O_NOFOLLOW` (a symbolic link as the last component is
//!   refused, so a write or truncate can never land in the file it points to) and
//!   `O_NONBLOCK` (opening a FIFO cannot block), then checks with `fstat` on the open
//!   descriptor that it is a regular file (no race between the check and the use).
//! - [`create_private`] creates a new file 0600 with `O_EXCL` (never an existing file, never
//!   through a link): owner-only from the first byte, no `chmod` window.
//! - [`create_private_dir`] makes directories 0700 from the start.
//! - [`read_bounded`] reads a whole file only if it is at most a limit that the caller
//!   derives from what can be legitimate, and never more than the limit plus one byte, even
//!   if the file grows meanwhile.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Mode of every file that holds guest memory or a store of it: owner-only.
pub const PRIVATE_FILE_MODE: u32 = 0o600;
/// Mode of every directory that holds such files.
pub const PRIVATE_DIR_MODE: u32 = 0o700;

/// Why a file was not opened or read.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// `open(2)` failed.
    #[error("cannot open {path}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The system error.
        #[source]
        source: io::Error,
    },
    /// The path is a symbolic link; it is never followed.
    #[error("{path} is a symbolic link: refused (it is never followed)")]
    Symlink {
        /// The file.
        path: PathBuf,
    },
    /// The path is a FIFO, a device, a socket or a directory.
    #[error("{path} is a {kind}, not a regular file: refused")]
    NotRegular {
        /// The file.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// The file is larger than anything legitimate.
    #[error("{path} has {size} bytes, more than the limit of {limit}: refused")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size (at least; it may be growing).
        size: u64,
        /// The most accepted.
        limit: u64,
    },
    /// `fstat`, `fcntl` or `read` failed.
    #[error("cannot {op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The system error.
        #[source]
        source: io::Error,
    },
    /// A text file is not UTF-8.
    #[error("{path} is not UTF-8 text")]
    NotText {
        /// The file.
        path: PathBuf,
    },
}

impl FileError {
    /// True when the file does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Open { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }
}

/// For callers whose errors carry an `io::Error`: the kind says what happened (`NotFound`,
/// `InvalidInput` for a refused file, `FileTooLarge`), the `FileError` stays the source.
impl From<FileError> for io::Error {
    fn from(err: FileError) -> Self {
        let kind = match &err {
            FileError::Open { source, .. } | FileError::Io { source, .. } => source.kind(),
            FileError::TooLarge { .. } => io::ErrorKind::FileTooLarge,
            FileError::NotText { .. } => io::ErrorKind::InvalidData,
            FileError::Symlink { .. } | FileError::NotRegular { .. } => io::ErrorKind::InvalidInput,
        };
        io::Error::new(kind, err)
    }
}

fn kind_name(file_type: std::fs::FileType) -> &'static str {
    if file_type.is_dir() {
        "directory"
    } else if file_type.is_fifo() {
        "FIFO"
    } else if file_type.is_char_device() {
        "character device"
    } else if file_type.is_block_device() {
        "block device"
    } else if file_type.is_socket() {
        "socket"
    } else if file_type.is_symlink() {
        "symbolic link"
    } else {
        "special file"
    }
}

/// Opens `path` as `options` say, refusing a symbolic link (`O_NOFOLLOW`) and anything that
/// is not a regular file, without blocking on a FIFO. `options` must not set custom flags
/// (they are replaced); a mode set with `OpenOptionsExt::mode` is kept.
pub fn open_regular(path: &Path, options: &OpenOptions) -> Result<File, FileError> {
    let mut options = options.clone();
    // O_NOCTTY: a terminal named where a file was expected is refused below, and opening it
    // must not make it this process's controlling terminal meanwhile.
    options.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY);
    let file = match options.open(path) {
        Ok(file) => file,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            let is_link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
            return Err(if is_link {
                FileError::Symlink {
                    path: path.to_path_buf(),
                }
            } else {
                FileError::Open {
                    path: path.to_path_buf(),
                    source: e,
                }
            });
        }
        // A FIFO opened for writing with no reader.
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
            return Err(not_regular_or(path, e));
        }
        Err(source) => {
            return Err(FileError::Open {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let io_error = |op| {
        let path = path.to_path_buf();
        move |source| FileError::Io { op, path, source }
    };
    let file_type = file.metadata().map_err(io_error("stat"))?.file_type();
    if !file_type.is_file() {
        return Err(FileError::NotRegular {
            path: path.to_path_buf(),
            kind: kind_name(file_type),
        });
    }
    // O_NONBLOCK was only for the open; clear it so the descriptor behaves as usual (it has
    // no effect on regular files, but leases and whoever the file is handed to may look).
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL on a descriptor we own; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: F_SETFL on a descriptor we own with an integer argument.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io_error("clear O_NONBLOCK of")(io::Error::last_os_error()));
    }
    Ok(file)
}

fn not_regular_or(path: &Path, e: io::Error) -> FileError {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_file() => FileError::NotRegular {
            path: path.to_path_buf(),
            kind: kind_name(meta.file_type()),
        },
        _ => FileError::Open {
            path: path.to_path_buf(),
            source: e,
        },
    }
}

/// Opens a regular file read-only (see [`open_regular`]).
pub fn open_read(path: &Path) -> Result<File, FileError> {
    open_regular(path, OpenOptions::new().read(true))
}

/// Creates `path`, which must not exist, read-write and 0600 (see [`open_regular`]).
pub fn create_private(path: &Path) -> Result<File, FileError> {
    open_regular(
        path,
        OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(PRIVATE_FILE_MODE),
    )
}

/// Opens `path` read-write, creating it 0600 if it does not exist; an existing file keeps its
/// contents and mode (see [`open_regular`]: never through a link, never a FIFO or device).
pub fn open_or_create_private(path: &Path) -> Result<File, FileError> {
    open_regular(
        path,
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(PRIVATE_FILE_MODE),
    )
}

/// Creates the directory `dir`, 0700, which must not exist as anything: neither a directory
/// nor a link (to a directory someone else owns, where what is written next would land).
/// Its parent must exist.
pub fn create_private_dir_new(dir: &Path) -> io::Result<()> {
    DirBuilder::new().mode(PRIVATE_DIR_MODE).create(dir)
}

/// Creates `dir` and any missing parents, each new one 0700; an existing directory is left
/// as it is.
pub fn create_private_dir(dir: &Path) -> io::Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(PRIVATE_DIR_MODE)
        .create(dir)
}

/// Checks that `path` is absent or a regular file (not a link, FIFO, device or directory):
/// for an output that is to be replaced by a rename.
pub fn check_absent_or_regular(path: &Path) -> Result<(), FileError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(FileError::Io {
            op: "stat",
            path: path.to_path_buf(),
            source,
        }),
        Ok(meta) if meta.file_type().is_file() => Ok(()),
        Ok(meta) if meta.file_type().is_symlink() => Err(FileError::Symlink {
            path: path.to_path_buf(),
        }),
        Ok(meta) => Err(FileError::NotRegular {
            path: path.to_path_buf(),
            kind: kind_name(meta.file_type()),
        }),
    }
}

/// Reads all of `file` (opened from `path`), from where it is, if it holds at most `limit`
/// bytes; reads at most `limit + 1` bytes whatever the file does meanwhile.
pub fn read_to_end_bounded(file: &mut File, path: &Path, limit: u64) -> Result<Vec<u8>, FileError> {
    let io_error = |op| {
        let path = path.to_path_buf();
        move |source| FileError::Io { op, path, source }
    };
    let size = file.metadata().map_err(io_error("stat"))?.len();
    let too_large = |size| FileError::TooLarge {
        path: path.to_path_buf(),
        size,
        limit,
    };
    if size > limit {
        return Err(too_large(size));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io_error("read"))?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Reads a whole regular file of at most `limit` bytes (see [`open_read`]).
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, FileError> {
    read_to_end_bounded(&mut open_read(path)?, path, limit)
}

/// [`read_bounded`] of UTF-8 text.
pub fn read_text_bounded(path: &Path, limit: u64) -> Result<String, FileError> {
    String::from_utf8(read_bounded(path, limit)?).map_err(|_| FileError::NotText {
        path: path.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use testkit::{mkfifo, mode};

    #[test]
    fn open_regular_symlink_is_refused_and_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, b"precious").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = open_regular(
            &link,
            OpenOptions::new().write(true).truncate(true).create(true),
        )
        .unwrap_err();
        assert!(matches!(err, FileError::Symlink { .. }), "{err}");
        assert_eq!(std::fs::read(&target).unwrap(), b"precious");
    }

    #[test]
    fn open_regular_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        // On another thread with a deadline: an open that blocks fails the test, rather
        // than hanging it.
        let (read, write) = testkit::within(Duration::from_secs(5), "opening a FIFO", move || {
            let read = open_read(&fifo).map(drop);
            let write = open_regular(&fifo, OpenOptions::new().write(true)).map(drop);
            (read, write)
        });
        for err in [read.unwrap_err(), write.unwrap_err()] {
            assert!(
                matches!(err, FileError::NotRegular { kind: "FIFO", .. }),
                "{err}"
            );
        }
    }

    #[test]
    fn open_regular_device_and_directory_are_refused() {
        let err = open_read(Path::new("/dev/zero")).unwrap_err();
        assert!(err.to_string().contains("character device"), "{err}");
        let err = open_read(Path::new("/")).unwrap_err();
        assert!(err.to_string().contains("directory"), "{err}");
    }

    #[test]
    fn create_private_makes_0600_and_refuses_an_existing_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        create_private(&path).unwrap();
        assert_eq!(mode(&path), 0o600);
        assert!(create_private(&path).is_err());
    }

    #[test]
    fn open_or_create_private_makes_0600_keeps_an_existing_file_and_refuses_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk");
        open_or_create_private(&path).unwrap();
        assert_eq!(mode(&path), 0o600);
        std::fs::write(&path, b"kept").unwrap();
        drop(open_or_create_private(&path).unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), b"kept");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let err = open_or_create_private(&link).unwrap_err();
        assert!(matches!(err, FileError::Symlink { .. }), "{err}");
    }

    #[test]
    fn create_private_dir_new_makes_0700_and_refuses_a_planted_dir_or_link() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("new");
        create_private_dir_new(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert!(
            create_private_dir_new(&dir).is_err(),
            "an existing directory"
        );
        let elsewhere = root.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        assert!(
            create_private_dir_new(&link).is_err(),
            "a link to a directory"
        );
        // What create_private_dir (create_dir_all) accepts: the link, followed.
        create_private_dir(&link).unwrap();
    }

    #[test]
    fn read_bounded_refuses_a_file_over_the_limit_by_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse");
        let file = File::create(&path).unwrap();
        file.set_len(6 << 30).unwrap();
        let err = read_bounded(&path, 1 << 20).unwrap_err();
        assert!(matches!(err, FileError::TooLarge { .. }), "{err}");
        assert!(err.to_string().contains("sparse"), "{err}");
        std::fs::write(&path, b"small").unwrap();
        assert_eq!(read_bounded(&path, 5).unwrap(), b"small");
        assert!(read_bounded(&path, 4).is_err());
    }

    #[test]
    fn check_absent_or_regular_refuses_links_and_fifos() {
        let dir = tempfile::tempdir().unwrap();
        let absent = dir.path().join("absent");
        check_absent_or_regular(&absent).unwrap();
        std::fs::write(&absent, b"x").unwrap();
        check_absent_or_regular(&absent).unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        assert!(check_absent_or_regular(&fifo).is_err());
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&absent, &link).unwrap();
        assert!(check_absent_or_regular(&link).is_err());
    }
}
