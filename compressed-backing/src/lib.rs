//! Compressed block store for guest-RAM pages.
//!
//! - [`layout`]: block sizes and size parsing.
//! - [`codec`]: `none`/`lz4`/`zstd` codecs with zero and same-byte tags.

pub mod codec;
pub mod layout;

pub use codec::{BlockKind, Codec, CodecConfig, CodecError, Decoder, Encoded, Encoder, MaxRatio};
pub use layout::{BlockSize, SizeError, PAGE_SIZE};
pub mod store;

pub use store::{DiskStore, StoreConfig, StoreError, StoreOptions, StoreStats, VerifyReport};
