//! A batch of encoded blocks, written with one (vectored) append, and the buffer its payloads
//! are copied into.

use xxhash_rust::xxh3::xxh3_64;

use crate::codec::{BlockKind, Encoded};

/// A batch of encoded blocks, written with one (vectored) append: payloads are copied into
/// `data`, or for raw blocks of a source's own memory, referenced where they are (`'s`).
#[derive(Debug, Default)]
pub(crate) struct EncodedBatch<'s> {
    pub data: BatchBuf,
    pub items: Vec<BatchItem<'s>>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct BatchItem<'s> {
    pub block: u64,
    pub kind: BlockKind,
    /// Fill byte for `Fill`.
    pub fill: u8,
    pub payload: Payload<'s>,
    /// xxh3-64 of the payload, computed by whoever builds the batch (outside the store lock).
    pub checksum: u64,
}

/// Where a batch item's payload is.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Payload<'s> {
    /// A tag: nothing to write.
    None,
    /// In the batch's buffer.
    Buf { offset: usize, len: usize },
    /// In the source's memory.
    Shared(&'s [u8]),
}

/// The payload bytes of a batch: on the heap for one-off puts, or in a mapping of its own
/// for bulk transfers, so that several MiB of buffers are given straight back to the kernel
/// when dropped instead of lingering in the allocator's per-thread arenas (an offloaded VM
/// must cost what it holds, not what it once used).
#[derive(Debug)]
pub(crate) enum BatchBuf {
    Heap(Vec<u8>),
    Mapped { map: memmap2::MmapMut, len: usize },
}

impl Default for BatchBuf {
    fn default() -> Self {
        Self::Heap(Vec::new())
    }
}

impl BatchBuf {
    /// A mapping of `capacity` bytes, touched now so that reusing it never faults; on the
    /// heap if the mapping fails.
    fn mapped(capacity: usize) -> Self {
        match memmap2::MmapMut::map_anon(capacity.max(1)) {
            Ok(mut map) => {
                map.fill(0);
                Self::Mapped { map, len: 0 }
            }
            Err(_) => Self::Heap(Vec::with_capacity(capacity)),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Heap(vec) => vec.len(),
            Self::Mapped { len, .. } => *len,
        }
    }

    fn clear(&mut self) {
        match self {
            Self::Heap(vec) => vec.clear(),
            Self::Mapped { len, .. } => *len = 0,
        }
    }

    fn extend_from_slice(&mut self, bytes: &[u8]) {
        match self {
            Self::Heap(vec) => vec.extend_from_slice(bytes),
            Self::Mapped { map, len } if *len + bytes.len() <= map.len() => {
                map[*len..*len + bytes.len()].copy_from_slice(bytes);
                *len += bytes.len();
            }
            Self::Mapped { map, len } => {
                // Never happens for a batch sized for its blocks; stay correct regardless.
                let mut vec = map[..*len].to_vec();
                vec.extend_from_slice(bytes);
                *self = Self::Heap(vec);
            }
        }
    }
}

impl std::ops::Deref for BatchBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Heap(vec) => vec,
            Self::Mapped { map, len } => &map[..*len],
        }
    }
}

impl<'s> EncodedBatch<'s> {
    /// An empty batch with room for `blocks` blocks of `block_bytes` each, in a mapping of
    /// its own, touched up front.
    pub(crate) fn with_capacity(blocks: usize, block_bytes: usize) -> Self {
        Self {
            data: BatchBuf::mapped(blocks * block_bytes),
            items: Vec::with_capacity(blocks),
        }
    }

    /// Empties the batch, keeping its memory.
    pub(crate) fn clear(&mut self) {
        self.data.clear();
        self.items.clear();
    }

    /// Adds one encoded block, copying its payload.
    pub(crate) fn push(&mut self, block: u64, encoded: Encoded<'_>) {
        let fill = match encoded.kind {
            BlockKind::Fill => encoded.payload[0],
            _ => 0,
        };
        let (payload, checksum) = if encoded.kind.has_data() {
            let offset = self.data.len();
            self.data.extend_from_slice(encoded.payload);
            let payload = Payload::Buf {
                offset,
                len: encoded.payload.len(),
            };
            (payload, xxh3_64(encoded.payload))
        } else {
            (Payload::None, 0)
        };
        self.items.push(BatchItem {
            block,
            kind: encoded.kind,
            fill,
            payload,
            checksum,
        });
    }

    /// Adds one raw block whose bytes stay where they are until the batch is written.
    pub(crate) fn push_shared(&mut self, block: u64, bytes: &'s [u8]) {
        self.items.push(BatchItem {
            block,
            kind: BlockKind::Raw,
            fill: 0,
            payload: Payload::Shared(bytes),
            checksum: xxh3_64(bytes),
        });
    }

    /// The payload bytes of `item`.
    pub(super) fn bytes<'a>(&'a self, item: &BatchItem<'a>) -> Option<&'a [u8]> {
        match item.payload {
            Payload::None => None,
            Payload::Buf { offset, len } => Some(&self.data[offset..offset + len]),
            Payload::Shared(bytes) => Some(bytes),
        }
    }
}
