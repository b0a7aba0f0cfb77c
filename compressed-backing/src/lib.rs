//! Compressed block store for guest-RAM pages.
//!
//! A RAM image is cut into blocks (64 KiB by default). Each block is stored as a zero tag, a
//! same-byte tag, raw bytes, or a compressed payload, whichever is smallest worth keeping.
//!
//! - [`layout`]: block sizes and size parsing.
//! - [`codec`]: `none`/`lz4`/`zstd` codecs with zero and same-byte tags and an early bail-out
//!   for incompressible blocks.
//! - [`store`]: [`DiskStore`], the durable on-disk store (segments + atomically replaced index).
//! - [`pool`]: [`MemoryPool`], the in-memory compressed pool for cold blocks of running VMs.
//! - [`bulk`]: parallel, bounded-memory transfer of whole images into and out of a store.
//! - [`file`]: opening possibly hostile files: no symbolic links, FIFOs or devices, private
//!   modes from the start, bounded reads.
//! - [`image`]: packing a raw RAM file into a store and unpacking it.

// Library code does not print (clippy.toml's `disallowed-macros`); its tests may.
#![cfg_attr(not(test), warn(clippy::disallowed_macros))]

pub mod bulk;
pub mod codec;
pub mod file;
pub mod fuse;
pub mod image;
pub mod layout;
pub mod pool;
pub mod remote;
pub mod seal;
pub mod store;

pub use bulk::{BlockSource, BulkOptions, BulkReport, FileSource, SliceSource};
pub use codec::{BlockKind, Codec, CodecConfig, CodecError, Decoder, Encoded, Encoder, MaxRatio};
pub use image::{pack_file, unpack_file, ImageError, PackOptions};
pub use layout::{BlockSize, SizeError};
pub use pool::{MemoryPool, PoolConfig, PoolError, PoolStats, PutOutcome};
pub use store::{
    DiskStore, Durability, StoreConfig, StoreError, StoreOptions, StoreReader, StoreStats,
    VerifyReport,
};
