//! The store's index: geometry, segment table, one slot per block and metadata, serialised
//! into one checksummed file that is replaced atomically on commit.
//!
//! Format (little-endian): magic `PVSTORE1`, version, block size, codec, max ratio, image size,
//! generation, next segment id, segment table (id, committed length), block count, one entry
//! per block (tag, then per-kind fields), metadata (key/value pairs), xxh3-64 of everything
//! before it, end magic `PVSTEND1`. A file that is short, has a bad checksum or a field out
//! of range is rejected as a whole: a partly written index never loads.

use std::collections::BTreeMap;

use xxhash_rust::xxh3::xxh3_64;

use super::segment;
use crate::codec::{BlockKind, Codec, CodecConfig, MaxRatio};
use crate::layout::BlockSize;

const MAGIC: &[u8; 8] = b"PVSTORE1";
const END_MAGIC: &[u8; 8] = b"PVSTEND1";
const VERSION: u32 = 1;
/// The version of an index whose payloads are sealed (encrypted and authenticated, each
/// [`SEAL_OVERHEAD`] bytes longer): `crate::remote` with a key.
const VERSION_SEALED: u32 = 2;
/// Bytes a sealed payload has beyond its plain one: its nonce and its tag.
pub(crate) const SEAL_OVERHEAD: u32 = 28;
const TAG_ABSENT: u8 = 0xFF;

/// Where a block's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Never written or discarded: reads as zeros.
    Absent,
    /// Written as all zeros.
    Zero,
    /// Written as one repeated byte.
    Fill(u8),
    /// Stored in a segment.
    Data(DataRef),
}

impl Slot {
    /// The block's kind, `None` when absent.
    pub(crate) fn kind(&self) -> Option<BlockKind> {
        match self {
            Slot::Absent => None,
            Slot::Zero => Some(BlockKind::Zero),
            Slot::Fill(_) => Some(BlockKind::Fill),
            Slot::Data(data) => Some(data.kind),
        }
    }
}

/// A payload in a segment file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DataRef {
    pub kind: BlockKind,
    pub segment: u32,
    pub len: u32,
    pub offset: u64,
    /// xxh3-64 of the payload as stored.
    pub checksum: u64,
}

/// The whole committed state of a store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Index {
    /// Payloads are sealed (see [`VERSION_SEALED`]).
    pub sealed: bool,
    pub block_size: BlockSize,
    pub codec: CodecConfig,
    pub image_size: u64,
    pub generation: u64,
    pub next_segment: u32,
    /// Segment id → committed length in bytes.
    pub segments: BTreeMap<u32, u64>,
    pub slots: Vec<Slot>,
    pub meta: BTreeMap<String, Vec<u8>>,
}

/// Why an index file was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IndexError {
    /// The file ended before a field.
    #[error("truncated: it ends at byte {len} while reading {what}")]
    Truncated {
        /// The file's length.
        len: usize,
        /// The field being read.
        what: &'static str,
    },
    /// The magic number is wrong: not a store index.
    #[error("not a store index (bad magic)")]
    BadMagic,
    /// The format version is unknown.
    #[error("unsupported format version {0}")]
    Version(u32),
    /// The checksum does not match: the file was changed or partly written.
    #[error("checksum mismatch (stored {stored:#018x}, computed {computed:#018x})")]
    Checksum {
        /// The checksum in the file.
        stored: u64,
        /// The checksum of the bytes read.
        computed: u64,
    },
    /// A field holds a value that cannot be.
    #[error("invalid {what}: {detail}")]
    Invalid {
        /// The field.
        what: &'static str,
        /// What is wrong with it.
        detail: String,
    },
}

fn invalid(what: &'static str, detail: impl Into<String>) -> IndexError {
    IndexError::Invalid {
        what,
        detail: detail.into(),
    }
}

impl Index {
    /// Serialises the index, checksum and end magic included.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.slots.len() * 26);
        out.extend_from_slice(MAGIC);
        put_u32(&mut out, if self.sealed { VERSION_SEALED } else { VERSION });
        put_u32(&mut out, self.block_size.bytes_u64() as u32);
        let (codec_tag, level) = match self.codec.codec {
            Codec::None => (0u8, 0i32),
            Codec::Lz4 => (1, 0),
            Codec::Zstd { level } => (2, level),
        };
        out.push(codec_tag);
        out.extend_from_slice(&level.to_le_bytes());
        let (num, den) = self.codec.max_ratio.parts();
        put_u32(&mut out, num);
        put_u32(&mut out, den);
        put_u64(&mut out, self.image_size);
        put_u64(&mut out, self.generation);
        put_u32(&mut out, self.next_segment);
        put_u32(&mut out, self.segments.len() as u32);
        for (&id, &len) in &self.segments {
            put_u32(&mut out, id);
            put_u64(&mut out, len);
        }
        put_u64(&mut out, self.slots.len() as u64);
        for slot in &self.slots {
            match *slot {
                Slot::Absent => out.push(TAG_ABSENT),
                Slot::Zero => out.push(BlockKind::Zero as u8),
                Slot::Fill(byte) => {
                    out.push(BlockKind::Fill as u8);
                    out.push(byte);
                }
                Slot::Data(data) => {
                    out.push(data.kind as u8);
                    put_u32(&mut out, data.segment);
                    put_u64(&mut out, data.offset);
                    put_u32(&mut out, data.len);
                    put_u64(&mut out, data.checksum);
                }
            }
        }
        put_u32(&mut out, self.meta.len() as u32);
        for (key, value) in &self.meta {
            put_u32(&mut out, key.len() as u32);
            out.extend_from_slice(key.as_bytes());
            put_u32(&mut out, value.len() as u32);
            out.extend_from_slice(value);
        }
        let checksum = xxh3_64(&out);
        put_u64(&mut out, checksum);
        out.extend_from_slice(END_MAGIC);
        out
    }

    /// Parses and validates an index file's bytes. Every field is range-checked, so that
    /// whatever a checksum-valid file says, a store opened from it can never overflow a
    /// counter or write outside what it owns.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, IndexError> {
        if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
            return if bytes.len() < MAGIC.len() {
                Err(IndexError::Truncated {
                    len: bytes.len(),
                    what: "magic",
                })
            } else {
                Err(IndexError::BadMagic)
            };
        }
        if bytes.len() < MAGIC.len() + 4 + TRAILER_LEN || &bytes[bytes.len() - 8..] != END_MAGIC {
            return Err(IndexError::Truncated {
                len: bytes.len(),
                what: "end marker",
            });
        }
        let body = &bytes[..bytes.len() - TRAILER_LEN];
        let stored = u64::from_le_bytes(
            bytes[body.len()..body.len() + 8]
                .try_into()
                .expect("slice of 8 bytes"),
        );
        let computed = xxh3_64(body);
        if stored != computed {
            return Err(IndexError::Checksum { stored, computed });
        }
        let mut r = Reader {
            bytes: body,
            pos: 0,
        };
        let header = Header::read(&mut r)?;
        let Header {
            sealed,
            block_size,
            codec,
            image_size,
            generation,
            next_segment,
            segment_count,
        } = header;
        let overhead = if sealed { SEAL_OVERHEAD } else { 0 };
        let mut segments = BTreeMap::new();
        for _ in 0..segment_count {
            let id = r.u32("segment id")?;
            let len = r.u64("segment length")?;
            let last = segments.last_key_value().map(|(&last, _)| last);
            check_segment(id, len, last, next_segment)?;
            segments.insert(id, len);
        }
        let block_count = r.u64("block count")?;
        if block_count != header.blocks() {
            return Err(invalid(
                "block count",
                format!("{block_count} blocks for an image of {image_size} bytes"),
            ));
        }
        // Every entry takes at least one byte: a count beyond the file is rejected before
        // allocating for it.
        if block_count > (body.len() - r.pos) as u64 {
            return Err(IndexError::Truncated {
                len: bytes.len(),
                what: "block entries",
            });
        }
        let mut slots = Vec::with_capacity(block_count as usize);
        for block in 0..block_count {
            let tag = r.u8("block tag")?;
            let slot = match tag {
                TAG_ABSENT => Slot::Absent,
                _ => match BlockKind::from_tag(tag) {
                    Some(BlockKind::Zero) => Slot::Zero,
                    Some(BlockKind::Fill) => Slot::Fill(r.u8("fill byte")?),
                    Some(kind) => {
                        let data = DataRef {
                            kind,
                            segment: r.u32("block segment")?,
                            offset: r.u64("block offset")?,
                            len: r.u32("block length")?,
                            checksum: r.u64("block checksum")?,
                        };
                        check_data(block, &data, &segments, block_size, image_size, overhead)?;
                        Slot::Data(data)
                    }
                    None => return Err(invalid("block tag", format!("{tag} at block {block}"))),
                },
            };
            slots.push(slot);
        }
        let meta_count = r.u32("metadata count")?;
        let meta_start = r.pos;
        let mut meta = BTreeMap::new();
        for _ in 0..meta_count {
            let key_len = r.u32("metadata key length")? as usize;
            let key = std::str::from_utf8(r.bytes(key_len, "metadata key")?)
                .map_err(|_| invalid("metadata key", "not UTF-8"))?
                .to_owned();
            let value_len = r.u32("metadata value length")? as usize;
            let value = r.bytes(value_len, "metadata value")?.to_vec();
            let ascending = meta
                .last_key_value()
                .is_none_or(|(last, _): (&String, _)| key > *last);
            if !ascending {
                return Err(invalid(
                    "metadata",
                    format!("key {key:?} out of order or twice"),
                ));
            }
            meta.insert(key, value);
        }
        let meta_bytes = (r.pos - meta_start) as u64;
        if meta_bytes > meta_limit(block_count) {
            return Err(invalid(
                "metadata",
                format!(
                    "{meta_bytes} bytes (at most {} for {block_count} blocks)",
                    meta_limit(block_count)
                ),
            ));
        }
        if r.pos != body.len() {
            return Err(invalid(
                "index",
                format!("{} trailing bytes", body.len() - r.pos),
            ));
        }
        Ok(Self {
            sealed,
            block_size,
            codec,
            image_size,
            generation,
            next_segment,
            segments,
            slots,
            meta,
        })
    }

    /// The most bytes an index file can legitimately have, from its first bytes (at least
    /// [`HEADER_LEN`] of them, or the whole file if shorter): a file longer than this is
    /// refused unread. The size follows from the segment count and the block count, each
    /// entry at its largest, plus the metadata allowed for that many blocks.
    pub(crate) fn size_limit(head: &[u8]) -> Result<u64, IndexError> {
        let mut r = Reader {
            bytes: head,
            pos: 0,
        };
        let header = Header::read(&mut r)?;
        // Cannot overflow: segments are at most MAX_SEGMENT_ID + 1, blocks at most
        // MAX_BLOCKS, so this is about 2.5 GiB at most.
        Ok(HEADER_LEN as u64
            + u64::from(header.segment_count) * SEGMENT_ENTRY_LEN as u64
            + 8
            + header.blocks() * MAX_BLOCK_ENTRY_LEN
            + 4
            + meta_limit(header.blocks())
            + TRAILER_LEN as u64)
    }
}

/// An index file's first bytes, checked before the rest is read: the header, then the
/// segment table entry by entry (a hostile header may claim 10^8 segments over a file of
/// zeros: the second entry is refused), then the file's size against what they imply.
#[derive(Debug)]
pub(crate) struct PrefixCheck {
    header: Header,
    /// Entries of the segment table not checked yet.
    segments_left: u32,
    /// The last id checked.
    last_id: Option<u32>,
    /// Whether a listed segment has bytes (else no block can be stored data).
    any_data: bool,
}

impl PrefixCheck {
    /// Checks the header, the file's first [`HEADER_LEN`] bytes.
    pub(crate) fn new(head: &[u8]) -> Result<Self, IndexError> {
        let header = Header::read(&mut Reader {
            bytes: head,
            pos: 0,
        })?;
        Ok(Self {
            header,
            segments_left: header.segment_count,
            last_id: None,
            any_data: false,
        })
    }

    /// Entries of the segment table still to check.
    pub(crate) fn segments_left(&self) -> u32 {
        self.segments_left
    }

    /// Checks the next segment table entry (`entry` holds [`SEGMENT_ENTRY_LEN`] bytes).
    pub(crate) fn segment(&mut self, entry: &[u8]) -> Result<(), IndexError> {
        let mut r = Reader {
            bytes: entry,
            pos: 0,
        };
        let (id, len) = (r.u32("segment id")?, r.u64("segment length")?);
        if self.segments_left == 0 {
            return Err(invalid("segment table", "more entries than its count"));
        }
        check_segment(id, len, self.last_id, self.header.next_segment)?;
        self.segments_left -= 1;
        self.last_id = Some(id);
        self.any_data |= len > 0;
        Ok(())
    }

    /// The sizes the whole file can have, once the segment table is checked: each block entry
    /// takes one byte at least, and two at most when no segment has bytes.
    pub(crate) fn size_range(&self) -> std::ops::RangeInclusive<u64> {
        let blocks = self.header.blocks();
        let fixed = HEADER_LEN as u64
            + u64::from(self.header.segment_count) * SEGMENT_ENTRY_LEN as u64
            + 8
            + 4
            + TRAILER_LEN as u64;
        let entry = if self.any_data {
            MAX_BLOCK_ENTRY_LEN
        } else {
            2
        };
        // Cannot overflow: see `size_limit`.
        fixed + blocks..=fixed + blocks * entry + meta_limit(blocks)
    }
}

/// Checks a segment table entry: ids ascending (one encoding per index) and below the next
/// id, lengths file offsets.
fn check_segment(
    id: u32,
    len: u64,
    last: Option<u32>,
    next_segment: u32,
) -> Result<(), IndexError> {
    if id >= next_segment || last.is_some_and(|last| id <= last) {
        return Err(invalid(
            "segment table",
            format!("segment {id} out of order, listed twice or beyond next id"),
        ));
    }
    if len > MAX_SEGMENT_LEN {
        return Err(invalid(
            "segment table",
            format!("segment {id} of {len} bytes (at most {MAX_SEGMENT_LEN})"),
        ));
    }
    Ok(())
}

/// Checks an index's checksum and end magic from its bytes fed in order, without holding
/// them: what a large file must pass before it is read into memory.
#[derive(Default)]
pub(crate) struct StreamCheck {
    hasher: xxhash_rust::xxh3::Xxh3Default,
    /// The last [`TRAILER_LEN`] bytes seen, not hashed yet (they may be the trailer).
    tail: Vec<u8>,
}

impl StreamCheck {
    /// Feeds the next bytes.
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.tail.extend_from_slice(bytes);
        let hashed = self.tail.len().saturating_sub(TRAILER_LEN);
        self.hasher.update(&self.tail[..hashed]);
        self.tail.drain(..hashed);
    }

    /// Checks the trailer of the bytes fed (the whole file).
    pub(crate) fn finish(self, len: u64) -> Result<(), IndexError> {
        let truncated = IndexError::Truncated {
            len: usize::try_from(len).unwrap_or(usize::MAX),
            what: "end marker",
        };
        if self.tail.len() < TRAILER_LEN || &self.tail[8..] != END_MAGIC {
            return Err(truncated);
        }
        let stored = u64::from_le_bytes(self.tail[..8].try_into().expect("slice of 8 bytes"));
        let computed = self.hasher.digest();
        if stored != computed {
            return Err(IndexError::Checksum { stored, computed });
        }
        Ok(())
    }
}

/// Bytes of the fixed header: magic, version, block size, codec and level, ratio, image size,
/// generation, next segment, segment count.
pub(crate) const HEADER_LEN: usize = 8 + 4 + 4 + 1 + 4 + 4 + 4 + 8 + 8 + 4 + 4;
/// Checksum and end magic.
const TRAILER_LEN: usize = 8 + 8;
/// Id and length.
pub(crate) const SEGMENT_ENTRY_LEN: usize = 4 + 8;
/// Tag, segment, offset, length, checksum.
const MAX_BLOCK_ENTRY_LEN: u64 = 1 + 4 + 8 + 4 + 8;
/// The most blocks an image may have: 2 TiB of 64 KiB blocks, 128 GiB of 4 KiB blocks; its
/// index is at most 800 MiB. Stores of more are refused when created, so every store that
/// can be written can be opened again.
pub(crate) const MAX_BLOCKS: u64 = 1 << 25;
/// A segment's length must be a file offset (`off_t`).
const MAX_SEGMENT_LEN: u64 = i64::MAX as u64;
/// zstd's levels: its fastest negative level up to 22.
const ZSTD_LEVELS: std::ops::RangeInclusive<i32> = -(1 << 17)..=22;

/// Metadata bytes allowed with `blocks` blocks: 1 MiB for small values, plus 8 bytes per block
/// (a working set lists block numbers of 8 bytes).
pub(crate) fn meta_limit(blocks: u64) -> u64 {
    (1 << 20) + blocks * 8
}

/// The fixed header, range-checked.
#[derive(Debug, Clone, Copy)]
struct Header {
    sealed: bool,
    block_size: BlockSize,
    codec: CodecConfig,
    image_size: u64,
    generation: u64,
    next_segment: u32,
    segment_count: u32,
}

impl Header {
    fn read(r: &mut Reader<'_>) -> Result<Self, IndexError> {
        if r.array::<8>("magic")? != *MAGIC {
            return Err(IndexError::BadMagic);
        }
        let version = r.u32("version")?;
        if version != VERSION && version != VERSION_SEALED {
            return Err(IndexError::Version(version));
        }
        let block_size = BlockSize::new(u64::from(r.u32("block size")?))
            .map_err(|e| invalid("block size", e.to_string()))?;
        let codec = match (r.u8("codec")?, r.i32("codec level")?) {
            (0, 0) => Codec::None,
            (1, 0) => Codec::Lz4,
            (tag @ (0 | 1), level) => {
                return Err(invalid("codec", format!("level {level} with tag {tag}")))
            }
            (2, level) if ZSTD_LEVELS.contains(&level) => Codec::Zstd { level },
            (2, level) => return Err(invalid("codec", format!("zstd level {level}"))),
            (tag, _) => return Err(invalid("codec", format!("tag {tag}"))),
        };
        let (num, den) = (r.u32("ratio")?, r.u32("ratio")?);
        let max_ratio =
            MaxRatio::new(num, den).ok_or_else(|| invalid("max ratio", format!("{num}/{den}")))?;
        let image_size = r.u64("image size")?;
        let blocks = block_size.blocks_for(image_size);
        if blocks > MAX_BLOCKS {
            return Err(invalid(
                "image size",
                format!("{image_size} bytes is {blocks} blocks (at most {MAX_BLOCKS})"),
            ));
        }
        let generation = r.u64("generation")?;
        // The next commit writes generation + 1.
        if generation == u64::MAX {
            return Err(invalid(
                "generation",
                format!("{generation} (the last one)"),
            ));
        }
        let next_segment = r.u32("next segment")?;
        // The next segment gets this id, and ids are at most MAX_SEGMENT_ID: one past it
        // is allowed (the store then refuses to start a segment), anything beyond is a lie.
        if next_segment > segment::MAX_ID + 1 {
            return Err(invalid(
                "next segment",
                format!("{next_segment} (ids are at most {})", segment::MAX_ID),
            ));
        }
        let segment_count = r.u32("segment count")?;
        if segment_count > next_segment {
            return Err(invalid(
                "segment count",
                format!("{segment_count} segments with ids below {next_segment}"),
            ));
        }
        Ok(Self {
            sealed: version == VERSION_SEALED,
            block_size,
            codec: CodecConfig { codec, max_ratio },
            image_size,
            generation,
            next_segment,
            segment_count,
        })
    }

    fn blocks(&self) -> u64 {
        self.block_size.blocks_for(self.image_size)
    }
}

/// Checks that a block's payload lies inside a listed segment and has a length its kind can
/// have.
fn check_data(
    block: u64,
    data: &DataRef,
    segments: &BTreeMap<u32, u64>,
    block_size: BlockSize,
    image_size: u64,
    overhead: u32,
) -> Result<(), IndexError> {
    let end = data.offset.checked_add(u64::from(data.len));
    match (segments.get(&data.segment), end) {
        (Some(&seg_len), Some(end)) if end <= seg_len => {}
        _ => {
            return Err(invalid(
                "block entry",
                format!(
                    "block {block} points past segment {} ({} bytes at {})",
                    data.segment, data.len, data.offset
                ),
            ))
        }
    }
    let block_len = block_size.len_in_image(block, image_size);
    // A sealed payload is its plain one and the seal's overhead.
    let plain = data.len.checked_sub(overhead);
    let fits = match (data.kind, plain) {
        (_, None) => false,
        (BlockKind::Raw, Some(len)) => len as usize == block_len,
        (_, Some(len)) => len > 0 && len as usize <= block_len,
    };
    if !fits {
        return Err(invalid(
            "block entry",
            format!(
                "block {block} of {block_len} bytes has a {:?} payload of {} bytes",
                data.kind, data.len
            ),
        ));
    }
    Ok(())
}

fn put_u32(out: &mut Vec<u8>, value: u32) {
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, value: u64) {
    out.extend_from_slice(&value.to_le_bytes());
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, len: usize, what: &'static str) -> Result<&'a [u8], IndexError> {
        let end = self
            .pos
            .checked_add(len)
            .filter(|&end| end <= self.bytes.len());
        let end = end.ok_or(IndexError::Truncated {
            len: self.bytes.len(),
            what,
        })?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], IndexError> {
        Ok(self.bytes(N, what)?.try_into().expect("slice of N bytes"))
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, IndexError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, IndexError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn i32(&mut self, what: &'static str) -> Result<i32, IndexError> {
        Ok(i32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, IndexError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Index {
        let block_size = BlockSize::new(64 << 10).unwrap();
        let mut segments = BTreeMap::new();
        segments.insert(0, 1000);
        segments.insert(3, 70_000);
        let mut meta = BTreeMap::new();
        meta.insert("working-set".to_owned(), vec![1, 2, 3]);
        Index {
            sealed: false,
            block_size,
            codec: CodecConfig::new(Codec::Zstd { level: 5 }),
            image_size: 4 * (64 << 10) + 10,
            generation: 9,
            next_segment: 4,
            segments,
            slots: vec![
                Slot::Absent,
                Slot::Zero,
                Slot::Fill(7),
                Slot::Data(DataRef {
                    kind: BlockKind::Lz4,
                    segment: 3,
                    len: 65536,
                    offset: 10,
                    checksum: 0xdead_beef,
                }),
                Slot::Data(DataRef {
                    kind: BlockKind::Raw,
                    segment: 0,
                    len: 10,
                    offset: 990,
                    checksum: 1,
                }),
            ],
            meta,
        }
    }

    #[test]
    fn index_roundtrips() {
        let index = sample();
        assert_eq!(Index::decode(&index.encode()).unwrap(), index);
    }

    #[test]
    fn index_every_truncation_is_rejected() {
        let bytes = sample().encode();
        for len in 0..bytes.len() {
            assert!(
                Index::decode(&bytes[..len]).is_err(),
                "length {len} accepted"
            );
        }
    }

    #[test]
    fn stream_check_in_any_pieces_agrees_with_decode() {
        let bytes = sample().encode();
        for piece in [1, 7, 16, 17, bytes.len()] {
            let mut check = StreamCheck::default();
            bytes.chunks(piece).for_each(|p| check.update(p));
            assert_eq!(
                check.finish(bytes.len() as u64),
                Ok(()),
                "pieces of {piece}"
            );
        }
        let mut bad = bytes.clone();
        bad[20] ^= 1;
        let mut check = StreamCheck::default();
        check.update(&bad);
        assert!(matches!(
            check.finish(bad.len() as u64),
            Err(IndexError::Checksum { .. })
        ));
        let mut check = StreamCheck::default();
        check.update(&bytes[..bytes.len() - 1]);
        assert!(matches!(
            check.finish(bytes.len() as u64 - 1),
            Err(IndexError::Truncated { .. })
        ));
    }

    #[test]
    fn index_flipped_bit_is_rejected_by_checksum() {
        let bytes = sample().encode();
        let mut bad = bytes.clone();
        bad[40] ^= 0x10;
        assert!(matches!(
            Index::decode(&bad),
            Err(IndexError::Checksum { .. })
        ));
    }

    #[test]
    fn index_entry_past_segment_end_is_rejected() {
        let mut index = sample();
        index.segments.insert(0, 999);
        let err = Index::decode(&index.encode()).unwrap_err();
        assert!(err.to_string().contains("points past segment 0"), "{err}");
    }

    fn slot_strategy() -> impl Strategy<Value = Slot> {
        prop_oneof![
            Just(Slot::Absent),
            Just(Slot::Zero),
            any::<u8>().prop_map(Slot::Fill),
            (0u32..3, 0u64..1000, 1u32..=4096, any::<u64>(), 2u8..=4).prop_map(
                |(segment, offset, len, checksum, tag)| {
                    let kind = BlockKind::from_tag(tag).unwrap();
                    Slot::Data(DataRef {
                        kind,
                        segment,
                        // A raw payload is the whole (4 KiB) block.
                        len: if kind == BlockKind::Raw { 4096 } else { len },
                        offset,
                        checksum,
                    })
                }
            ),
        ]
    }

    /// An index of 4 KiB blocks, one per slot, over segments 0 to 2 of 10,000 bytes each
    /// (where [`slot_strategy`]'s payloads lie).
    fn small_index(
        codec: Codec,
        slots: Vec<Slot>,
        generation: u64,
        meta: BTreeMap<String, Vec<u8>>,
    ) -> Index {
        Index {
            sealed: false,
            block_size: BlockSize::new(4096).unwrap(),
            codec: CodecConfig::new(codec),
            image_size: slots.len() as u64 * 4096,
            generation,
            next_segment: 3,
            segments: (0..3).map(|id| (id, 10_000)).collect(),
            slots,
            meta,
        }
    }

    proptest! {
        #[test]
        fn any_index_roundtrips(
            slots in proptest::collection::vec(slot_strategy(), 0..200),
            generation in 0..u64::MAX,
            meta in proptest::collection::btree_map("[a-z]{1,8}", proptest::collection::vec(any::<u8>(), 0..32), 0..4),
        ) {
            let index = small_index(Codec::Lz4, slots, generation, meta);
            prop_assert_eq!(Index::decode(&index.encode()).unwrap(), index);
        }
    }

    // Fuzzing of the decoder (cases from PROPTEST_CASES, 256 by default; the long run is
    // `PROPTEST_CASES=100000 cargo test --release -p compressed-backing fuzz_`).

    /// Replaces the checksum of `bytes` (an encoded index) with the right one, so that a
    /// mutation reaches the field checks instead of stopping at the checksum.
    fn rechecksum(bytes: &mut [u8]) {
        if bytes.len() < TRAILER_LEN {
            return;
        }
        let body = bytes.len() - TRAILER_LEN;
        let checksum = xxh3_64(&bytes[..body]);
        bytes[body..body + 8].copy_from_slice(&checksum.to_le_bytes());
    }

    /// What every index the decoder accepts must satisfy: a store opened from it cannot
    /// overflow a counter, address outside its segments, or write an index it cannot read.
    fn check_accepted(bytes: &[u8], index: &Index) -> Result<(), TestCaseError> {
        prop_assert!(index.generation < u64::MAX);
        prop_assert!(index.next_segment <= segment::MAX_ID + 1);
        prop_assert!(index.slots.len() as u64 <= MAX_BLOCKS);
        prop_assert_eq!(
            index.slots.len() as u64,
            index.block_size.blocks_for(index.image_size)
        );
        for (&id, &len) in &index.segments {
            prop_assert!(id < index.next_segment && len <= MAX_SEGMENT_LEN);
        }
        for (block, slot) in index.slots.iter().enumerate() {
            if let Slot::Data(data) = slot {
                let seg_len = index.segments.get(&data.segment).copied();
                prop_assert!(seg_len.is_some());
                prop_assert!(data.offset + u64::from(data.len) <= seg_len.unwrap_or(0));
                let block_len = index
                    .block_size
                    .len_in_image(block as u64, index.image_size);
                prop_assert!(data.len > 0 && data.len as usize <= block_len);
            }
        }
        prop_assert!(bytes.len() as u64 <= Index::size_limit(bytes).unwrap());
        // What the reader checks before reading it whole lets it through.
        let mut prefix = PrefixCheck::new(bytes).unwrap();
        let table = &bytes[HEADER_LEN..HEADER_LEN + index.segments.len() * SEGMENT_ENTRY_LEN];
        for entry in table.chunks(SEGMENT_ENTRY_LEN) {
            prop_assert!(prefix.segment(entry).is_ok());
        }
        prop_assert_eq!(prefix.segments_left(), 0);
        prop_assert!(prefix.size_range().contains(&(bytes.len() as u64)));
        let mut stream = StreamCheck::default();
        stream.update(bytes);
        prop_assert!(stream.finish(bytes.len() as u64).is_ok());
        // Re-encoding gives the same bytes: what is committed next loads again.
        prop_assert_eq!(&index.encode()[..], bytes);
        Ok(())
    }

    fn index_strategy() -> impl Strategy<Value = Index> {
        (
            proptest::collection::vec(slot_strategy(), 0..40),
            0..u64::MAX,
            proptest::collection::btree_map(
                "[a-z]{1,8}",
                proptest::collection::vec(any::<u8>(), 0..16),
                0..3,
            ),
        )
            .prop_map(|(slots, generation, meta)| {
                small_index(Codec::Zstd { level: 3 }, slots, generation, meta)
            })
    }

    /// A hostile value (little-endian bytes) to overwrite a field with.
    fn hostile_value() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            Just(u32::MAX.to_le_bytes().to_vec()),
            Just(u64::MAX.to_le_bytes().to_vec()),
            Just((segment::MAX_ID + 1).to_le_bytes().to_vec()),
            Just((segment::MAX_ID + 2).to_le_bytes().to_vec()),
            Just((i64::MAX as u64 + 1).to_le_bytes().to_vec()),
            Just(0u32.to_le_bytes().to_vec()),
            Just(vec![0xFF]),
            Just(vec![0]),
            proptest::collection::vec(any::<u8>(), 1..9),
        ]
    }

    proptest! {
        #[test]
        fn fuzz_index_random_bytes_are_rejected_without_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..512),
            prefix_of in proptest::option::of((index_strategy(), any::<prop::sample::Index>())),
        ) {
            let mut bytes = bytes;
            if let Some((index, at)) = prefix_of {
                // A valid index cut anywhere in its body, then the noise, then a right
                // checksum and end magic: the noise reaches every field's parser (noise
                // right after the magic stops at the version nearly always).
                let valid = index.encode();
                let mut framed = valid[..at.index(valid.len() - TRAILER_LEN)].to_vec();
                framed.extend_from_slice(&bytes);
                framed.extend_from_slice(&[0; 8]);
                framed.extend_from_slice(END_MAGIC);
                rechecksum(&mut framed);
                bytes = framed;
            }
            if let Ok(index) = Index::decode(&bytes) {
                check_accepted(&bytes, &index)?;
            }
            let _ = Index::size_limit(&bytes);
        }

        #[test]
        fn fuzz_index_mutated_and_rechecksummed_is_rejected_or_sound(
            index in index_strategy(),
            edits in proptest::collection::vec((any::<prop::sample::Index>(), hostile_value()), 1..4),
            fix_checksum in prop::bool::weighted(0.9),
        ) {
            let mut bytes = index.encode();
            let body = bytes.len() - TRAILER_LEN;
            for (at, value) in &edits {
                let start = at.index(body);
                let end = (start + value.len()).min(body);
                bytes[start..end].copy_from_slice(&value[..end - start]);
            }
            if fix_checksum {
                rechecksum(&mut bytes);
            }
            if let Ok(decoded) = Index::decode(&bytes) {
                check_accepted(&bytes, &decoded)?;
            }
        }

        #[test]
        fn fuzz_index_hostile_fields_are_rejected_or_sound(
            index in index_strategy(),
            next_segment in prop_oneof![Just(u32::MAX), Just(segment::MAX_ID + 1), 0..8u32, any::<u32>()],
            generation in prop_oneof![Just(u64::MAX), any::<u64>()],
            segment_len in prop_oneof![Just(u64::MAX), Just(i64::MAX as u64), 0..20_000u64],
            image_size in prop_oneof![Just(u64::MAX), Just(MAX_BLOCKS * 4096 + 1), 0..200_000u64],
            offset in prop_oneof![Just(u64::MAX), Just(u64::MAX - 10), 0..20_000u64],
            len in prop_oneof![Just(u32::MAX), Just(0u32), 0..5000u32],
            which in 0..6u8,
        ) {
            let mut index = index;
            match which {
                0 => index.next_segment = next_segment,
                1 => index.generation = generation,
                2 => {
                    index.segments.insert(1, segment_len);
                }
                3 => index.image_size = image_size,
                4 | 5 => {
                    let kind = if which == 4 { BlockKind::Lz4 } else { BlockKind::Raw };
                    index.slots.push(Slot::Data(DataRef {
                        kind,
                        segment: 2,
                        offset,
                        len,
                        checksum: 0,
                    }));
                    index.image_size = index.slots.len() as u64 * 4096;
                }
                _ => unreachable!("which is below 6"),
            }
            let bytes = index.encode();
            if let Ok(decoded) = Index::decode(&bytes) {
                check_accepted(&bytes, &decoded)?;
            }
        }
    }
}
