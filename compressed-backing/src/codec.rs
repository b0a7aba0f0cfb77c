//! Block codecs: `none`, `lz4` and `zstd`, with zero and same-byte blocks recognised as tags
//! and incompressible blocks stored raw.
//!
//! Encoding never fails on data: a block that a codec cannot shrink below the configured
//! ratio is stored raw, which is always correct. Decoding is strict: a payload that does not
//! decode to exactly one block of bytes is an error, never a silently short or padded block.

use std::fmt;
use std::str::FromStr;

use lz4_flex::block::CompressTable;

/// Default zstd level when `zstd` is given without one.
pub const DEFAULT_ZSTD_LEVEL: i32 = 3;

/// How a stored block is represented. The discriminants are part of the on-disk format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[repr(u8)]
pub enum BlockKind {
    /// All bytes are zero; nothing is stored.
    Zero = 0,
    /// All bytes equal one value; the payload is that one byte.
    Fill = 1,
    /// The block's bytes as they are.
    Raw = 2,
    /// An LZ4 block (no frame).
    Lz4 = 3,
    /// A zstd frame.
    Zstd = 4,
}

impl BlockKind {
    /// Decodes a format tag.
    pub fn from_tag(tag: u8) -> Option<Self> {
        Some(match tag {
            0 => Self::Zero,
            1 => Self::Fill,
            2 => Self::Raw,
            3 => Self::Lz4,
            4 => Self::Zstd,
            _ => return None,
        })
    }

    /// True for kinds whose payload lives in a data file (not a tag in the index).
    pub fn has_data(self) -> bool {
        matches!(self, Self::Raw | Self::Lz4 | Self::Zstd)
    }

    /// True for kinds that were compressed by a codec.
    pub fn is_compressed(self) -> bool {
        matches!(self, Self::Lz4 | Self::Zstd)
    }
}

/// The compression algorithm used for blocks that are neither zero nor same-byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Codec {
    /// Store every data block raw.
    None,
    /// LZ4 block compression (fast; the default).
    #[default]
    Lz4,
    /// zstd at the given level (1..=22, negative levels for faster modes).
    Zstd {
        /// Compression level.
        level: i32,
    },
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::None => f.write_str("none"),
            Self::Lz4 => f.write_str("lz4"),
            Self::Zstd { level } => write!(f, "zstd:{level}"),
        }
    }
}

impl serde::Serialize for Codec {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_string())
    }
}

impl<'de> serde::Deserialize<'de> for Codec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A codec name that is not `none`, `lz4`, `zstd` or `zstd:LEVEL`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown codec `{text}`: expected none, lz4, zstd or zstd:LEVEL (LEVEL from -7 to 22)")]
pub struct UnknownCodec {
    /// The text as given.
    pub text: String,
}

impl FromStr for Codec {
    type Err = UnknownCodec;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let unknown = || UnknownCodec {
            text: text.to_owned(),
        };
        let lower = text.trim().to_ascii_lowercase();
        match lower.as_str() {
            "none" | "raw" => return Ok(Self::None),
            "lz4" => return Ok(Self::Lz4),
            "zstd" => {
                return Ok(Self::Zstd {
                    level: DEFAULT_ZSTD_LEVEL,
                })
            }
            _ => {}
        }
        let level = lower
            .strip_prefix("zstd:")
            .or_else(|| lower.strip_prefix("zstd-"))
            .ok_or_else(unknown)?;
        let level: i32 = level.parse().map_err(|_| unknown())?;
        if !(-7..=22).contains(&level) || level == 0 {
            return Err(unknown());
        }
        Ok(Self::Zstd { level })
    }
}

/// The largest share of a block's size that a compressed payload may take; a payload above it
/// is not worth its decompression cost, and the block is stored raw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxRatio {
    num: u32,
    den: u32,
}

impl MaxRatio {
    /// A ratio `num/den` in (0, 1].
    pub fn new(num: u32, den: u32) -> Option<Self> {
        (den > 0 && num > 0 && num <= den).then_some(Self { num, den })
    }

    /// The ratio as `(num, den)`.
    pub fn parts(self) -> (u32, u32) {
        (self.num, self.den)
    }

    /// The largest payload accepted for a block of `len` bytes.
    pub fn limit(self, len: usize) -> usize {
        // Cannot overflow: len is at most 2 MiB and num/den at most u32.
        (len as u64 * u64::from(self.num) / u64::from(self.den)) as usize
    }
}

impl Default for MaxRatio {
    fn default() -> Self {
        Self { num: 7, den: 8 }
    }
}

/// Codec choice plus the ratio above which a block is stored raw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CodecConfig {
    /// The algorithm for data blocks.
    pub codec: Codec,
    /// Payloads larger than this share of the block are stored raw instead.
    pub max_ratio: MaxRatio,
}

impl CodecConfig {
    /// A configuration with the default ratio (7/8).
    pub fn new(codec: Codec) -> Self {
        Self {
            codec,
            max_ratio: MaxRatio::default(),
        }
    }
}

/// Failures of encoding setup and of decoding.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The zstd context could not be created (out of memory, bad level).
    #[error("cannot create a zstd context")]
    ZstdContext(#[source] std::io::Error),
    /// The payload is not valid for its codec.
    #[error("{kind:?} payload of {payload_len} bytes does not decode")]
    Corrupt {
        /// The block's kind.
        kind: BlockKind,
        /// The payload's length.
        payload_len: usize,
        /// What the decoder said.
        reason: String,
    },
    /// The payload decoded, but not to exactly one block of bytes.
    #[error("{kind:?} payload decodes to {actual} bytes, expected {expected}")]
    LengthMismatch {
        /// The block's kind.
        kind: BlockKind,
        /// Bytes the block must have.
        expected: usize,
        /// Bytes the payload produced.
        actual: usize,
    },
}

/// One encoded block: its kind and the bytes to store (empty for zero blocks, the fill byte
/// for same-byte blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Encoded<'a> {
    /// How the block is represented.
    pub kind: BlockKind,
    /// What must be stored to rebuild it.
    pub payload: &'a [u8],
}

/// Returns `Some(byte)` if every byte of `block` equals `byte`.
pub fn uniform_byte(block: &[u8]) -> Option<u8> {
    let (&first, rest) = block.split_first()?;
    if rest.last().is_some_and(|&last| last != first) {
        return None;
    }
    // The block is uniform exactly when it equals itself shifted by one byte; this compiles to
    // one vectorised memcmp that stops at the first difference.
    (block[1..] == block[..block.len() - 1]).then_some(first)
}

/// Blocks at least this large are probed before a full compression attempt.
const PROBE_MIN_BLOCK: usize = 16 << 10;
/// Bytes per probe sample.
const PROBE_SAMPLE: usize = 1 << 10;
/// Samples per probe, spread evenly over the block.
const PROBE_SAMPLES: usize = 4;

/// Compresses blocks. Holds scratch space and codec contexts so that encoding allocates
/// nothing after the first block; one per thread.
pub struct Encoder {
    config: CodecConfig,
    scratch: Vec<u8>,
    lz4_table: CompressTable,
    zstd: Option<zstd::bulk::Compressor<'static>>,
    fill: [u8; 1],
    /// Blocks the probe classified as incompressible (skipped the full attempt).
    pub probe_bailouts: u64,
}

impl fmt::Debug for Encoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Encoder")
            .field("config", &self.config)
            .field("probe_bailouts", &self.probe_bailouts)
            .finish_non_exhaustive()
    }
}

impl Encoder {
    /// Creates an encoder for `config`.
    pub fn new(config: CodecConfig) -> Result<Self, CodecError> {
        let zstd = match config.codec {
            Codec::Zstd { level } => {
                Some(zstd::bulk::Compressor::new(level).map_err(CodecError::ZstdContext)?)
            }
            _ => None,
        };
        Ok(Self {
            config,
            scratch: Vec::new(),
            lz4_table: CompressTable::large(),
            zstd,
            fill: [0],
            probe_bailouts: 0,
        })
    }

    /// The configuration this encoder applies.
    pub fn config(&self) -> CodecConfig {
        self.config
    }

    /// Encodes one block. The result borrows either `block` (raw) or the encoder's scratch.
    pub fn encode<'a>(&'a mut self, block: &'a [u8]) -> Encoded<'a> {
        if let Some(byte) = uniform_byte(block) {
            if byte == 0 {
                return Encoded {
                    kind: BlockKind::Zero,
                    payload: &[],
                };
            }
            self.fill[0] = byte;
            return Encoded {
                kind: BlockKind::Fill,
                payload: &self.fill,
            };
        }
        let raw = Encoded {
            kind: BlockKind::Raw,
            payload: block,
        };
        if self.config.codec == Codec::None {
            return raw;
        }
        let limit = self.config.max_ratio.limit(block.len());
        if self.probe_says_incompressible(block) {
            self.probe_bailouts += 1;
            return raw;
        }
        match self.compress(block, limit) {
            Some((kind, len)) => Encoded {
                kind,
                payload: &self.scratch[..len],
            },
            None => raw,
        }
    }

    /// Compresses `block` into the scratch buffer; `None` if the result exceeds `limit`.
    fn compress(&mut self, block: &[u8], limit: usize) -> Option<(BlockKind, usize)> {
        match self.config.codec {
            Codec::None => None,
            Codec::Lz4 => {
                let max = lz4_flex::block::get_maximum_output_size(block.len());
                if self.scratch.len() < max {
                    self.scratch.resize(max, 0);
                }
                let len = lz4_flex::block::compress_into_with_table(
                    block,
                    &mut self.scratch,
                    &mut self.lz4_table,
                )
                .ok()?;
                (len <= limit).then_some((BlockKind::Lz4, len))
            }
            Codec::Zstd { .. } => {
                let zstd = self.zstd.as_mut()?;
                if self.scratch.len() < limit {
                    self.scratch.resize(limit, 0);
                }
                // A destination of exactly `limit` bytes makes zstd stop as soon as the output
                // would exceed it: the incompressible case bails out early by itself.
                let len = zstd
                    .compress_to_buffer(block, &mut self.scratch[..limit])
                    .ok()?;
                Some((BlockKind::Zstd, len))
            }
        }
    }

    /// Compresses a few small samples spread over the block with LZ4; if none of them shrinks
    /// at all, the block is almost surely random (encrypted, already compressed) and the full
    /// attempt is skipped. Misclassifying a compressible block only stores it raw.
    fn probe_says_incompressible(&mut self, block: &[u8]) -> bool {
        if block.len() < PROBE_MIN_BLOCK {
            return false;
        }
        let max = lz4_flex::block::get_maximum_output_size(PROBE_SAMPLE);
        if self.scratch.len() < max {
            self.scratch.resize(max, 0);
        }
        let stride = block.len() / PROBE_SAMPLES;
        for sample in 0..PROBE_SAMPLES {
            let start = sample * stride + (stride - PROBE_SAMPLE) / 2;
            let input = &block[start..start + PROBE_SAMPLE];
            match lz4_flex::block::compress_into_with_table(
                input,
                &mut self.scratch,
                &mut self.lz4_table,
            ) {
                // Any saving of more than 1/32 in a sample: worth a full attempt.
                Ok(len) if len < PROBE_SAMPLE - PROBE_SAMPLE / 32 => return false,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
        true
    }
}

/// Decompresses blocks; one per thread.
pub struct Decoder {
    zstd: Option<zstd::bulk::Decompressor<'static>>,
}

impl fmt::Debug for Decoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decoder").finish_non_exhaustive()
    }
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Decoder {
    /// Creates a decoder; the zstd context is made on first use.
    pub fn new() -> Self {
        Self { zstd: None }
    }

    /// Decodes `payload` of `kind` into `out`, which must be exactly the block's length.
    pub fn decode(
        &mut self,
        kind: BlockKind,
        payload: &[u8],
        out: &mut [u8],
    ) -> Result<(), CodecError> {
        let expected = out.len();
        let corrupt = |reason: String| CodecError::Corrupt {
            kind,
            payload_len: payload.len(),
            reason,
        };
        let actual = match kind {
            BlockKind::Zero => {
                if !payload.is_empty() {
                    return Err(corrupt("zero block with a payload".into()));
                }
                out.fill(0);
                expected
            }
            BlockKind::Fill => {
                let [byte] = payload else {
                    return Err(corrupt("fill block needs exactly one byte".into()));
                };
                out.fill(*byte);
                expected
            }
            BlockKind::Raw => {
                if payload.len() == expected {
                    out.copy_from_slice(payload);
                }
                payload.len()
            }
            BlockKind::Lz4 => lz4_flex::block::decompress_into(payload, out)
                .map_err(|e| corrupt(e.to_string()))?,
            BlockKind::Zstd => {
                if self.zstd.is_none() {
                    self.zstd =
                        Some(zstd::bulk::Decompressor::new().map_err(CodecError::ZstdContext)?);
                }
                let zstd = self.zstd.as_mut().expect("created just above");
                // The frame header states the content size; a frame that claims more than one
                // block would overrun `out`, and zstd reports that as an error.
                zstd.decompress_to_buffer(payload, out)
                    .map_err(|e| corrupt(e.to_string()))?
            }
        };
        if actual != expected {
            return Err(CodecError::LengthMismatch {
                kind,
                expected,
                actual,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn all_configs() -> Vec<CodecConfig> {
        [
            Codec::None,
            Codec::Lz4,
            Codec::Zstd { level: 1 },
            Codec::Zstd { level: 3 },
            Codec::Zstd { level: 19 },
        ]
        .into_iter()
        .map(CodecConfig::new)
        .collect()
    }

    fn roundtrip(config: CodecConfig, block: &[u8]) -> BlockKind {
        let mut enc = Encoder::new(config).unwrap();
        let encoded = enc.encode(block);
        let kind = encoded.kind;
        let payload = encoded.payload.to_vec();
        let mut out = vec![0xEE; block.len()];
        Decoder::new().decode(kind, &payload, &mut out).unwrap();
        assert_eq!(out, block, "{config:?} {kind:?}");
        kind
    }

    fn random_block(len: usize, seed: u64) -> Vec<u8> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect()
    }

    #[test]
    fn encode_zero_block_is_a_tag_without_payload() {
        for config in all_configs() {
            let mut enc = Encoder::new(config).unwrap();
            let encoded = enc.encode(&[0u8; 65536]);
            assert_eq!(encoded.kind, BlockKind::Zero);
            assert!(encoded.payload.is_empty());
        }
    }

    #[test]
    fn encode_same_byte_block_is_a_fill_tag() {
        let mut enc = Encoder::new(CodecConfig::new(Codec::Lz4)).unwrap();
        let encoded = enc.encode(&[0xA5; 4096]);
        assert_eq!(encoded.kind, BlockKind::Fill);
        assert_eq!(encoded.payload, &[0xA5]);
    }

    #[test]
    fn encode_random_block_is_stored_raw() {
        let block = random_block(65536, 7);
        for config in all_configs() {
            assert_eq!(roundtrip(config, &block), BlockKind::Raw);
        }
    }

    #[test]
    fn encode_repeated_pattern_compresses_far_below_limit() {
        let block: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
        let mut enc = Encoder::new(CodecConfig::new(Codec::Lz4)).unwrap();
        let encoded = enc.encode(&block);
        assert_eq!(encoded.kind, BlockKind::Lz4);
        assert!(encoded.payload.len() < 1024, "{}", encoded.payload.len());
        assert_eq!(
            roundtrip(CodecConfig::new(Codec::Zstd { level: 3 }), &block),
            BlockKind::Zstd
        );
    }

    #[test]
    fn encode_half_random_block_respects_the_ratio() {
        // Half random, half zero: compresses to about 50%, which passes 7/8 but not 1/4.
        let mut block = random_block(65536, 3);
        block[32768..].fill(0);
        let strict = CodecConfig {
            codec: Codec::Lz4,
            max_ratio: MaxRatio::new(1, 4).unwrap(),
        };
        assert_eq!(roundtrip(strict, &block), BlockKind::Raw);
        assert_eq!(
            roundtrip(CodecConfig::new(Codec::Lz4), &block),
            BlockKind::Lz4
        );
    }

    #[test]
    fn decode_truncated_payload_is_an_error() {
        let block: Vec<u8> = (0..65536u32).map(|i| (i / 7) as u8).collect();
        for codec in [Codec::Lz4, Codec::Zstd { level: 3 }] {
            let mut enc = Encoder::new(CodecConfig::new(codec)).unwrap();
            let encoded = enc.encode(&block);
            assert!(encoded.kind.is_compressed());
            let cut = &encoded.payload[..encoded.payload.len() / 2];
            let mut out = vec![0; block.len()];
            assert!(Decoder::new().decode(encoded.kind, cut, &mut out).is_err());
        }
    }

    #[test]
    fn decode_into_wrong_length_is_an_error() {
        let block: Vec<u8> = (0..8192u32).map(|i| (i / 3) as u8).collect();
        for codec in [Codec::Lz4, Codec::Zstd { level: 3 }] {
            let mut enc = Encoder::new(CodecConfig::new(codec)).unwrap();
            let encoded = enc.encode(&block);
            let mut longer = vec![0; block.len() + 4096];
            let err = Decoder::new()
                .decode(encoded.kind, encoded.payload, &mut longer)
                .unwrap_err();
            assert!(matches!(err, CodecError::LengthMismatch { .. }), "{err}");
        }
        let mut out = vec![0; 10];
        assert!(Decoder::new()
            .decode(BlockKind::Raw, &[1; 9], &mut out)
            .is_err());
        assert!(Decoder::new()
            .decode(BlockKind::Fill, &[1, 2], &mut out)
            .is_err());
        assert!(Decoder::new()
            .decode(BlockKind::Zero, &[1], &mut out)
            .is_err());
    }

    #[test]
    fn codec_names_parse_and_bad_names_are_rejected() {
        assert_eq!("lz4".parse(), Ok(Codec::Lz4));
        assert_eq!("none".parse(), Ok(Codec::None));
        assert_eq!("zstd".parse(), Ok(Codec::Zstd { level: 3 }));
        assert_eq!("zstd:9".parse(), Ok(Codec::Zstd { level: 9 }));
        for bad in ["gzip", "zstd:99", "zstd:x", "zstd:0", ""] {
            let err = bad.parse::<Codec>().unwrap_err();
            assert!(err.to_string().contains("unknown codec"), "{err}");
        }
    }

    #[test]
    fn block_kind_tags_roundtrip() {
        for kind in [
            BlockKind::Zero,
            BlockKind::Fill,
            BlockKind::Raw,
            BlockKind::Lz4,
            BlockKind::Zstd,
        ] {
            assert_eq!(BlockKind::from_tag(kind as u8), Some(kind));
        }
        assert_eq!(BlockKind::from_tag(5), None);
    }

    fn block_strategy() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            // Arbitrary bytes of any page-multiple length up to 64 KiB.
            (1usize..=16)
                .prop_flat_map(|pages| proptest::collection::vec(any::<u8>(), pages * 4096)),
            // Runs of a few values: compressible with structure.
            (
                1usize..=16,
                proptest::collection::vec((any::<u8>(), 1usize..600), 1..64)
            )
                .prop_map(|(pages, runs)| {
                    let len = pages * 4096;
                    runs.iter()
                        .flat_map(|&(b, n)| std::iter::repeat_n(b, n))
                        .cycle()
                        .take(len)
                        .collect()
                }),
            // Uniform blocks, including zero.
            (1usize..=16, any::<u8>()).prop_map(|(pages, b)| vec![b; pages * 4096]),
        ]
    }

    proptest! {
        #[test]
        fn any_block_roundtrips_through_every_codec(block in block_strategy()) {
            for config in all_configs() {
                roundtrip(config, &block);
            }
        }

        #[test]
        fn uniform_byte_matches_naive_check(block in proptest::collection::vec(0u8..2, 1..64)) {
            let naive = block.iter().all(|&b| b == block[0]).then_some(block[0]);
            prop_assert_eq!(uniform_byte(&block), naive);
        }
    }
}
