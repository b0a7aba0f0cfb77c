//! Errors of the on-disk store.

use std::io;
use std::path::PathBuf;

use super::IndexError;
use crate::codec::CodecError;
use crate::file::FileError;

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
    /// A payload's bytes were not on disk and could not be fetched from where the store
    /// mirrors (its object store; see `crate::remote`).
    #[error("block {block}: cannot fetch the payload of {path} at offset {offset}")]
    Fetch {
        /// The block.
        block: u64,
        /// The segment file.
        path: PathBuf,
        /// Byte offset of the payload in the segment.
        offset: u64,
        /// Why the fetch failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The store's payloads are sealed and no key was given.
    #[error("the store in {dir} is encrypted: give its key (--store-key)")]
    Sealed {
        /// The store.
        dir: PathBuf,
    },
    /// A sealed payload does not open with the key.
    #[error("block {block}: the sealed payload in {path} at offset {offset} does not open")]
    Unsealed {
        /// The block.
        block: u64,
        /// The segment file.
        path: PathBuf,
        /// Byte offset of the payload.
        offset: u64,
        /// Why.
        #[source]
        source: crate::seal::SealError,
    },
    /// A key was given for a store that is not sealed, or the sealed store has no id.
    #[error("the store in {dir} {what}")]
    KeyMismatch {
        /// The store.
        dir: PathBuf,
        /// What is wrong.
        what: &'static str,
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
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Self {
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
