//! A store's configuration and what it reports: its counters, the problems `verify` finds,
//! what a compaction did.

use std::path::PathBuf;

use crate::codec::CodecConfig;
use crate::layout::BlockSize;

/// The geometry and codec of a new store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreConfig {
    /// Bytes per block.
    pub block_size: BlockSize,
    /// Codec for new writes (each block records its own kind, so this may change later).
    pub codec: CodecConfig,
    /// Bytes in the RAM image.
    pub image_size: u64,
}

/// Tuning of segment size and compaction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StoreOptions {
    /// A new segment is started when the current one would grow past this.
    pub segment_max_bytes: u64,
    /// A segment whose dead share reaches this is rewritten (live payloads moved) or deleted.
    pub compact_dead_ratio: f64,
    /// Segments smaller than this are only deleted when fully dead, never rewritten.
    pub compact_min_bytes: u64,
    /// Run compaction after every commit.
    pub auto_compact: bool,
    /// What a commit survives.
    pub durability: Durability,
}

/// What a commit survives (`../DESIGN.md`: a store that must outlive its writer's host is
/// synced, one read again only while its host runs is not).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// A crash of the host: a commit syncs the segments it wrote (`fdatasync`), writes the
    /// index to a temporary file, syncs it, renames it over the old one and syncs the
    /// directory. For stores that outlive the process that wrote them: snapshots, packed
    /// images.
    #[default]
    Host,
    /// The end of the writing process, not a crash of the host: a commit writes the index to
    /// a temporary file and renames it over the old one (so that a reader, or a writer taking
    /// over after this one was killed, finds the old commit or the new one, never a mix), and
    /// syncs nothing. For a VM's offload store, whose pages die with the host anyway: the
    /// syncs were most of an offload's time (issue 35).
    Process,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            segment_max_bytes: 64 << 20,
            compact_dead_ratio: 0.5,
            compact_min_bytes: 1 << 20,
            auto_compact: true,
            durability: Durability::Host,
        }
    }
}

/// Counts and sizes of a store, as `info` prints them.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StoreStats {
    /// Bytes in the RAM image.
    pub image_size: u64,
    /// Bytes per block.
    pub block_size: u64,
    /// Codec for new writes.
    pub codec: String,
    /// Blocks in the image.
    pub blocks: u64,
    /// Blocks written (not absent).
    pub present_blocks: u64,
    /// Blocks stored as the zero tag.
    pub zero_blocks: u64,
    /// Blocks stored as a same-byte tag.
    pub fill_blocks: u64,
    /// Blocks stored uncompressed.
    pub raw_blocks: u64,
    /// Blocks stored compressed.
    pub compressed_blocks: u64,
    /// Logical bytes of present blocks.
    pub raw_bytes: u64,
    /// Payload bytes the current image references.
    pub stored_bytes: u64,
    /// Bytes of all segment files (live and dead payloads).
    pub segment_bytes: u64,
    /// Segment bytes no block references any more (reclaimed by compaction).
    pub dead_bytes: u64,
    /// Bytes allocated on disk for all store files (`st_blocks`).
    pub disk_bytes: u64,
    /// Segment files.
    pub segments: u64,
    /// Commit generation.
    pub generation: u64,
    /// Logical bytes per allocated disk byte (`raw_bytes / disk_bytes`).
    pub ratio: f64,
}

/// One bad block found by `verify`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Problem {
    /// The block.
    pub block: u64,
    /// The segment file holding it.
    pub path: PathBuf,
    /// Byte offset of its payload in that file.
    pub offset: u64,
    /// What is wrong.
    pub reason: String,
}

/// Result of `verify`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct VerifyReport {
    /// Blocks whose payload was read and decoded.
    pub blocks_checked: u64,
    /// Payload bytes read.
    pub bytes_checked: u64,
    /// Every bad block.
    pub problems: Vec<Problem>,
}

/// What a compaction did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactionReport {
    /// Segment files deleted.
    pub segments_removed: u64,
    /// Live payload bytes copied into a new segment.
    pub bytes_moved: u64,
    /// Segment bytes freed.
    pub bytes_freed: u64,
}
