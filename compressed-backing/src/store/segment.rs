//! Segment files: append-only files of block payloads, named `seg-NNNNNNNN.dat`.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::file::{self, FileError};

const PREFIX: &str = "seg-";
const SUFFIX: &str = ".dat";
/// The largest segment id: names have eight digits, so every id has one name and every
/// segment file is recognised (and cleaned up) by [`parse_file_name`].
pub(crate) const MAX_ID: u32 = 99_999_999;

/// The file name of segment `id`.
pub(crate) fn file_name(id: u32) -> String {
    format!("{PREFIX}{id:08}{SUFFIX}")
}

/// The segment id of a file name, if it names a segment.
pub(crate) fn parse_file_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?;
    if digits.len() != 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// One open segment file.
#[derive(Debug)]
pub(crate) struct Segment {
    pub path: PathBuf,
    pub file: Arc<File>,
    /// Bytes written so far, committed or not: the next append goes here.
    pub len: u64,
    /// Bytes covered by the committed index.
    pub committed_len: u64,
    /// Payload bytes that current slots still reference.
    pub live: u64,
}

impl Segment {
    /// Creates a new, empty segment file, 0600; fails if it exists (as anything).
    pub(crate) fn create(dir: &Path, id: u32) -> Result<Self, FileError> {
        let path = dir.join(file_name(id));
        let file = file::create_private(&path)?;
        Ok(Self {
            path,
            file: Arc::new(file),
            len: 0,
            committed_len: 0,
            live: 0,
        })
    }

    /// Opens an existing segment whose committed length is `committed_len`.
    pub(crate) fn open(
        dir: &Path,
        id: u32,
        committed_len: u64,
        writable: bool,
    ) -> Result<(Self, u64), FileError> {
        let path = dir.join(file_name(id));
        // Never through a link: the tail beyond the committed length is cut off when
        // opened to write, which must only ever touch this store's own file.
        let file = file::open_regular(&path, OpenOptions::new().read(true).write(writable))?;
        let actual = file
            .metadata()
            .map_err(|source| FileError::Io {
                op: "stat",
                path: path.clone(),
                source,
            })?
            .len();
        Ok((
            Self {
                path,
                file: Arc::new(file),
                len: committed_len,
                committed_len,
                live: 0,
            },
            actual,
        ))
    }

    /// Writes `pieces` end to end at the end, with as few system calls as the kernel allows.
    /// On error nothing is counted as written: the next append goes to the same offset and
    /// overwrites whatever part landed.
    pub(crate) fn append(&mut self, pieces: &[&[u8]]) -> io::Result<u64> {
        let offset = self.len;
        let written = write_all_vectored_at(&self.file, pieces, offset)?;
        self.len += written;
        Ok(offset)
    }
}

/// `pwritev` of all of `pieces` at `offset`, resuming after partial writes; returns the bytes
/// written.
fn write_all_vectored_at(file: &File, pieces: &[&[u8]], offset: u64) -> io::Result<u64> {
    use std::os::fd::AsRawFd;
    const IOV_MAX: usize = 1024;
    let total: u64 = pieces.iter().map(|p| p.len() as u64).sum();
    let mut done = 0u64;
    // (piece index, bytes of it already written)
    let (mut index, mut skip) = (0usize, 0usize);
    while done < total {
        let iov: Vec<libc::iovec> = pieces[index..]
            .iter()
            .take(IOV_MAX)
            .enumerate()
            .map(|(i, piece)| {
                let piece = if i == 0 { &piece[skip..] } else { piece };
                libc::iovec {
                    iov_base: piece.as_ptr().cast_mut().cast(),
                    iov_len: piece.len(),
                }
            })
            .collect();
        let at = libc::off_t::try_from(offset + done)
            .map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
        let count = libc::c_int::try_from(iov.len()).expect("at most IOV_MAX");
        // SAFETY: every iovec points into a live slice of `pieces` for its length; pwritev
        // only reads them.
        let n = unsafe { libc::pwritev(file.as_raw_fd(), iov.as_ptr(), count, at) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::WriteZero));
        }
        let mut n = n.unsigned_abs();
        done += n as u64;
        while n > 0 {
            let left = pieces[index].len() - skip;
            if n >= left {
                n -= left;
                index += 1;
                skip = 0;
            } else {
                skip += n;
                n = 0;
            }
        }
        // Skip empty pieces so the next iovec starts at real data.
        while index < pieces.len() && pieces[index].len() == skip {
            index += 1;
            skip = 0;
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_vectored_append_writes_every_piece_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut seg = Segment::create(dir.path(), 1).unwrap();
        let a = vec![1u8; 5000];
        let b: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        let many: Vec<Vec<u8>> = (0..2500u32).map(|i| vec![i as u8; 3]).collect();
        let mut pieces: Vec<&[u8]> = vec![&a, &[], &b];
        pieces.extend(many.iter().map(Vec::as_slice));
        assert_eq!(seg.append(&pieces).unwrap(), 0);
        assert_eq!(seg.append(&[&a]).unwrap(), 8000 + 7500);
        let written = std::fs::read(&seg.path).unwrap();
        let expect: Vec<u8> = pieces
            .concat()
            .into_iter()
            .chain(a.iter().copied())
            .collect();
        assert_eq!(written, expect);
    }

    #[test]
    fn segment_names_roundtrip_and_strangers_are_ignored() {
        assert_eq!(parse_file_name(&file_name(0)), Some(0));
        assert_eq!(parse_file_name(&file_name(123_456)), Some(123_456));
        for other in [
            "index",
            "seg-1.dat",
            "seg-0000000a.dat",
            "seg-00000001.tmp",
            "lock",
        ] {
            assert_eq!(parse_file_name(other), None, "{other}");
        }
    }
}
