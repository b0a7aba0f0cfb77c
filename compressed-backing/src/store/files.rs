//! The store's files: its lock, its index read back (bounded, checked), durable writes of
//! whole files and of the directory.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use super::index::{self, Index};
use super::{StoreError, INDEX_FILE, LOCK_FILE};
use crate::file::{self, FileError, PRIVATE_FILE_MODE};
use crate::layout::BlockSize;

/// Takes the store's lock: exclusive for writers, shared for readers.
pub(super) fn lock_dir(dir: &Path, exclusive: bool) -> Result<File, StoreError> {
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
pub(super) fn read_index(path: &Path) -> Result<Index, StoreError> {
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
pub(super) const INDEX_READ_WHOLE: u64 = 4 << 20;
/// See [`INDEX_READ_WHOLE`].
pub(super) const INDEX_PIECE: usize = 1 << 20;

/// [`read_index`] from an open index file of `size` bytes: the header, then the segment table
/// in bounded pieces (each entry checked as read), then the size they imply, then (for a large
/// file) the checksum streamed, and only then the whole file into memory.
pub(super) fn load_index<F: Read + io::Seek>(
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
pub(super) fn read_full(file: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
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
pub(super) fn check_image_size(block_size: BlockSize, image_size: u64) -> Result<(), StoreError> {
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

/// Writes a new file at `path`, 0600 from the start, and syncs it if `sync` says so; whatever
/// was there (a stale temporary file, or a link planted to make this write land elsewhere) is
/// unlinked first, never followed.
pub(super) fn write_private_file(path: &Path, bytes: &[u8], sync: bool) -> Result<(), StoreError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(StoreError::io("remove", path)(e))
        }
        _ => {}
    }
    let mut file = file::create_private(path).map_err(StoreError::File)?;
    file.write_all(bytes)
        .map_err(StoreError::io("write", path))?;
    if sync {
        file.sync_all().map_err(StoreError::io("sync", path))?;
    }
    Ok(())
}

pub(super) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
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

/// Turns readahead off (`random`) or back on for reads through `file`'s open description
/// (see [`DiskStore::set_drop_behind`]). Best effort: it only affects caching.
pub(super) fn advise_readahead(file: &File, random: bool) {
    use std::os::fd::AsRawFd;
    let advice = if random {
        libc::POSIX_FADV_RANDOM
    } else {
        libc::POSIX_FADV_NORMAL
    };
    // SAFETY: fadvise on an open descriptor of ours; it does not touch memory.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, advice) };
}
