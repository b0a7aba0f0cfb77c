//! Segment files: append-only files of block payloads, named `seg-NNNNNNNN.dat`.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const PREFIX: &str = "seg-";
const SUFFIX: &str = ".dat";

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
    /// Creates a new, empty segment file; fails if it exists.
    pub(crate) fn create(dir: &Path, id: u32) -> io::Result<Self> {
        let path = dir.join(file_name(id));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
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
    ) -> io::Result<(Self, u64)> {
        let path = dir.join(file_name(id));
        let file = OpenOptions::new().read(true).write(writable).open(&path)?;
        let actual = file.metadata()?.len();
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

    /// Writes `bytes` at the end. On error nothing is counted as written: the next append
    /// goes to the same offset and overwrites whatever part landed.
    pub(crate) fn append(&mut self, bytes: &[u8]) -> io::Result<u64> {
        let offset = self.len;
        self.file.write_all_at(bytes, offset)?;
        self.len += bytes.len() as u64;
        Ok(offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
