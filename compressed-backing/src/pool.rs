//! `MemoryPool`: an in-memory compressed pool for cold blocks of running VMs.
//!
//! Compressed payloads are packed end to end into slabs (anonymous mappings of 1 MiB, or one
//! block if larger), zsmalloc-style but log-structured: a payload is appended to the active
//! slab, a removed payload leaves a hole, and a sealed slab whose live share falls below half
//! is compacted (its live payloads moved to the active slab, the slab unmapped). So the memory
//! held stays close to the bytes stored; `stats` reports both. Only blocks that compress are
//! kept: zero and same-byte blocks are tags, an incompressible block is refused (it is better
//! left resident). The pool never grows past its cap.

use std::cell::RefCell;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapMut;
use parking_lot::{Mutex, RwLock};

use crate::codec::{BlockKind, CodecConfig, CodecError, Decoder, Encoded, Encoder};
use crate::layout::BlockSize;
use basics::PageSize;

/// Default slab size.
pub const DEFAULT_SLAB_BYTES: usize = 1 << 20;

/// Geometry, codec and limits of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Bytes per block.
    pub block_size: BlockSize,
    /// Codec for stored blocks (`none` makes every data block incompressible).
    pub codec: CodecConfig,
    /// Number of block keys (guest RAM / block size); keys are `0..blocks`.
    pub blocks: u64,
    /// Most bytes of memory the pool may hold (slabs plus its index).
    pub cap_bytes: u64,
}

/// Errors of the pool.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// A key past the configured number of blocks.
    #[error("block {key} is out of range: the pool has {blocks} keys")]
    KeyOutOfRange {
        /// The key.
        key: u64,
        /// Keys in the pool.
        blocks: u64,
    },
    /// A buffer of the wrong size.
    #[error("block {key}: buffer of {actual} bytes, the block has {expected}")]
    WrongLength {
        /// The key.
        key: u64,
        /// The block's length.
        expected: usize,
        /// The buffer's length.
        actual: usize,
    },
    /// Codec setup failed.
    #[error("codec setup failed")]
    Codec(#[source] CodecError),
    /// A stored payload does not decode (memory corruption).
    #[error("block {key}: pooled payload does not decode")]
    Decode {
        /// The key.
        key: u64,
        /// The decoder's complaint.
        #[source]
        source: CodecError,
    },
    /// A slab could not be mapped.
    #[error("cannot map a {bytes}-byte slab")]
    Map {
        /// Slab size.
        bytes: usize,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
}

/// What `put` did with a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// Stored compressed, taking `payload` bytes.
    Stored {
        /// Payload bytes.
        payload: usize,
    },
    /// Recorded as a zero tag.
    Zero,
    /// Recorded as a same-byte tag.
    Fill,
    /// Not stored: it does not compress below the ratio. Any older entry was removed.
    Incompressible,
    /// Not stored: the pool is at its cap. Any older entry was removed.
    Full,
}

impl PutOutcome {
    /// True if the pool now holds the block.
    pub fn is_stored(self) -> bool {
        matches!(self, Self::Stored { .. } | Self::Zero | Self::Fill)
    }
}

/// Counters and sizes of a pool.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PoolStats {
    /// Blocks held (any kind).
    pub blocks: u64,
    /// Blocks held as zero tags.
    pub zero_blocks: u64,
    /// Blocks held as same-byte tags.
    pub fill_blocks: u64,
    /// Blocks held compressed.
    pub compressed_blocks: u64,
    /// Logical bytes of the blocks held.
    pub logical_bytes: u64,
    /// Payload bytes of the compressed blocks held.
    pub stored_bytes: u64,
    /// Memory the pool holds: touched slab pages plus its index. This is what it costs.
    pub held_bytes: u64,
    /// Address space of all slabs (untouched pages are not resident).
    pub mapped_bytes: u64,
    /// Bytes of the index (slot table and per-slab key lists).
    pub index_bytes: u64,
    /// Slabs mapped.
    pub slabs: u64,
    /// The cap on `held_bytes`.
    pub cap_bytes: u64,
    /// `put`s refused as incompressible.
    pub rejected_incompressible: u64,
    /// `put`s refused because the pool was at its cap.
    pub rejected_full: u64,
    /// Slabs emptied by compaction.
    pub slabs_compacted: u64,
    /// Payload bytes moved by compaction.
    pub bytes_compacted: u64,
}

impl PoolStats {
    /// Share of held memory that is not live payload (0 = none wasted).
    pub fn overhead_ratio(&self) -> f64 {
        if self.held_bytes == 0 {
            return 0.0;
        }
        1.0 - self.stored_bytes as f64 / self.held_bytes as f64
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PoolSlot {
    Absent,
    Zero,
    Fill(u8),
    Data {
        kind: BlockKind,
        slab: u32,
        offset: u32,
        len: u32,
    },
}

struct Slab {
    mem: MmapMut,
    /// Append offset.
    used: usize,
    /// Live payload bytes.
    live: usize,
    /// Keys appended to this slab (some may have moved since).
    keys: Vec<u64>,
}

impl Slab {
    fn touched_bytes(&self) -> u64 {
        self.used.next_multiple_of(PageSize::BASE.usize()) as u64
    }
}

struct Inner {
    slots: Vec<PoolSlot>,
    slabs: Vec<Option<Slab>>,
    active: Option<u32>,
    stored: u64,
    stats: PoolStats,
}

/// An in-memory compressed pool. See the module documentation. Safe to share between threads:
/// readers decode concurrently, writers take a short exclusive lock.
pub struct MemoryPool {
    config: PoolConfig,
    slab_bytes: usize,
    inner: RwLock<Inner>,
    encoders: Mutex<Vec<Encoder>>,
    decoded_bytes: AtomicU64,
}

impl fmt::Debug for MemoryPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPool")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

thread_local! {
    static DECODER: RefCell<Decoder> = RefCell::new(Decoder::new());
}

impl MemoryPool {
    /// Creates an empty pool.
    pub fn new(config: PoolConfig) -> Result<Self, PoolError> {
        // Fail early on a codec that cannot be set up.
        let encoder = Encoder::new(config.codec).map_err(PoolError::Codec)?;
        Ok(Self {
            slab_bytes: DEFAULT_SLAB_BYTES.max(config.block_size.bytes()),
            inner: RwLock::new(Inner {
                slots: vec![PoolSlot::Absent; config.blocks as usize],
                slabs: Vec::new(),
                active: None,
                stored: 0,
                stats: PoolStats {
                    cap_bytes: config.cap_bytes,
                    ..PoolStats::default()
                },
            }),
            encoders: Mutex::new(vec![encoder]),
            config,
            decoded_bytes: AtomicU64::new(0),
        })
    }

    /// The pool's configuration.
    pub fn config(&self) -> PoolConfig {
        self.config
    }

    /// Bytes decoded by `get`/`take` so far.
    pub fn decoded_bytes(&self) -> u64 {
        self.decoded_bytes.load(Ordering::Relaxed)
    }

    fn check_key(&self, key: u64) -> Result<usize, PoolError> {
        usize::try_from(key)
            .ok()
            .filter(|&k| (k as u64) < self.config.blocks)
            .ok_or(PoolError::KeyOutOfRange {
                key,
                blocks: self.config.blocks,
            })
    }

    fn check_len(&self, key: u64, actual: usize) -> Result<usize, PoolError> {
        let index = self.check_key(key)?;
        let expected = self.config.block_size.bytes();
        if actual != expected {
            return Err(PoolError::WrongLength {
                key,
                expected,
                actual,
            });
        }
        Ok(index)
    }

    /// Compresses `data` (one block) and keeps it under `key`, replacing any older entry.
    pub fn put(&self, key: u64, data: &[u8]) -> Result<PutOutcome, PoolError> {
        self.check_len(key, data.len())?;
        let mut encoder = match self.encoders.lock().pop() {
            Some(encoder) => encoder,
            None => Encoder::new(self.config.codec).map_err(PoolError::Codec)?,
        };
        let outcome = self.put_encoded(key, encoder.encode(data));
        self.encoders.lock().push(encoder);
        outcome
    }

    /// Keeps an already encoded block under `key` (a raw one is refused as incompressible).
    pub fn put_encoded(&self, key: u64, encoded: Encoded<'_>) -> Result<PutOutcome, PoolError> {
        let index = self.check_key(key)?;
        let mut inner = self.inner.write();
        inner.remove(index);
        let outcome = match encoded.kind {
            BlockKind::Zero => {
                inner.slots[index] = PoolSlot::Zero;
                PutOutcome::Zero
            }
            BlockKind::Fill => {
                inner.slots[index] = PoolSlot::Fill(encoded.payload[0]);
                PutOutcome::Fill
            }
            BlockKind::Raw => {
                inner.stats.rejected_incompressible += 1;
                PutOutcome::Incompressible
            }
            kind @ (BlockKind::Lz4 | BlockKind::Zstd) => {
                let len = encoded.payload.len();
                match inner.allocate(key, len, self.slab_bytes, self.config.cap_bytes)? {
                    Some((slab, offset)) => {
                        let target = inner.slabs[slab as usize]
                            .as_mut()
                            .expect("allocate returns a mapped slab");
                        target.mem[offset..offset + len].copy_from_slice(encoded.payload);
                        inner.slots[index] = PoolSlot::Data {
                            kind,
                            slab,
                            offset: offset as u32,
                            len: len as u32,
                        };
                        inner.stored += len as u64;
                        PutOutcome::Stored { payload: len }
                    }
                    None => {
                        inner.stats.rejected_full += 1;
                        PutOutcome::Full
                    }
                }
            }
        };
        Ok(outcome)
    }

    /// Decodes the block under `key` into `out`; `None` (and `out` untouched) if absent.
    pub fn get(&self, key: u64, out: &mut [u8]) -> Result<Option<BlockKind>, PoolError> {
        let index = self.check_len(key, out.len())?;
        let inner = self.inner.read();
        self.decode_slot(&inner, key, index, out)
    }

    /// Like `get`, then removes the entry: for a block going back to guest RAM.
    pub fn take(&self, key: u64, out: &mut [u8]) -> Result<Option<BlockKind>, PoolError> {
        let index = self.check_len(key, out.len())?;
        let mut inner = self.inner.write();
        let kind = self.decode_slot(&inner, key, index, out)?;
        inner.remove(index);
        Ok(kind)
    }

    fn decode_slot(
        &self,
        inner: &Inner,
        key: u64,
        index: usize,
        out: &mut [u8],
    ) -> Result<Option<BlockKind>, PoolError> {
        match inner.slots[index] {
            PoolSlot::Absent => Ok(None),
            PoolSlot::Zero => {
                out.fill(0);
                Ok(Some(BlockKind::Zero))
            }
            PoolSlot::Fill(byte) => {
                out.fill(byte);
                Ok(Some(BlockKind::Fill))
            }
            PoolSlot::Data {
                kind,
                slab,
                offset,
                len,
            } => {
                let slab = inner.slabs[slab as usize]
                    .as_ref()
                    .expect("a data slot points at a mapped slab");
                let payload = &slab.mem[offset as usize..(offset + len) as usize];
                DECODER
                    .with(|decoder| decoder.borrow_mut().decode(kind, payload, out))
                    .map_err(|source| PoolError::Decode { key, source })?;
                self.decoded_bytes
                    .fetch_add(out.len() as u64, Ordering::Relaxed);
                Ok(Some(kind))
            }
        }
    }

    /// Calls `f` with the stored representation of `key` (to move it to another tier without
    /// recompressing). `None` if absent.
    pub fn with_encoded<R>(
        &self,
        key: u64,
        f: impl FnOnce(Encoded<'_>) -> R,
    ) -> Result<Option<R>, PoolError> {
        let index = self.check_key(key)?;
        let inner = self.inner.read();
        let fill;
        let encoded = match inner.slots[index] {
            PoolSlot::Absent => return Ok(None),
            PoolSlot::Zero => Encoded {
                kind: BlockKind::Zero,
                payload: &[],
            },
            PoolSlot::Fill(byte) => {
                fill = [byte];
                Encoded {
                    kind: BlockKind::Fill,
                    payload: &fill,
                }
            }
            PoolSlot::Data {
                kind,
                slab,
                offset,
                len,
            } => {
                let slab = inner.slabs[slab as usize]
                    .as_ref()
                    .expect("a data slot points at a mapped slab");
                Encoded {
                    kind,
                    payload: &slab.mem[offset as usize..(offset + len) as usize],
                }
            }
        };
        Ok(Some(f(encoded)))
    }

    /// True if the pool holds `key`.
    pub fn contains(&self, key: u64) -> bool {
        self.check_key(key)
            .map(|index| self.inner.read().slots[index] != PoolSlot::Absent)
            .unwrap_or(false)
    }

    /// Drops the entry of `key`, if any.
    pub fn remove(&self, key: u64) -> Result<(), PoolError> {
        let index = self.check_key(key)?;
        self.inner.write().remove(index);
        Ok(())
    }

    /// Compacts every sealed slab that is less than half live.
    pub fn compact(&self) {
        let mut inner = self.inner.write();
        let sparse: Vec<u32> = inner
            .slabs
            .iter()
            .enumerate()
            .filter_map(|(id, slab)| {
                let slab = slab.as_ref()?;
                let id = id as u32;
                (Some(id) != inner.active && slab.live * 2 < slab.used).then_some(id)
            })
            .collect();
        for id in sparse {
            inner.evacuate(id, self.slab_bytes);
        }
    }

    /// Counters and sizes.
    pub fn stats(&self) -> PoolStats {
        let inner = self.inner.read();
        let mut stats = inner.stats.clone();
        stats.stored_bytes = inner.stored;
        for slot in &inner.slots {
            match slot {
                PoolSlot::Absent => continue,
                PoolSlot::Zero => stats.zero_blocks += 1,
                PoolSlot::Fill(_) => stats.fill_blocks += 1,
                PoolSlot::Data { .. } => stats.compressed_blocks += 1,
            }
            stats.blocks += 1;
        }
        stats.logical_bytes = stats.blocks * self.config.block_size.bytes_u64();
        stats.index_bytes = inner.index_bytes();
        for slab in inner.slabs.iter().flatten() {
            stats.slabs += 1;
            stats.mapped_bytes += slab.mem.len() as u64;
        }
        stats.held_bytes = inner.held_bytes();
        stats
    }
}

impl Inner {
    fn index_bytes(&self) -> u64 {
        let keys: usize = self.slabs.iter().flatten().map(|s| s.keys.capacity()).sum();
        (self.slots.capacity() * std::mem::size_of::<PoolSlot>()
            + self.slabs.capacity() * std::mem::size_of::<Option<Slab>>()
            + keys * std::mem::size_of::<u64>()) as u64
    }

    fn held_bytes(&self) -> u64 {
        self.slabs
            .iter()
            .flatten()
            .map(Slab::touched_bytes)
            .sum::<u64>()
            + self.index_bytes()
    }

    fn remove(&mut self, index: usize) {
        let old = std::mem::replace(&mut self.slots[index], PoolSlot::Absent);
        if let PoolSlot::Data { slab, len, .. } = old {
            self.stored -= u64::from(len);
            let id = slab;
            let slab = self.slabs[id as usize]
                .as_mut()
                .expect("a data slot points at a mapped slab");
            slab.live -= len as usize;
            if slab.live == 0 && self.active != Some(id) {
                self.slabs[id as usize] = None;
            }
        }
    }

    /// Finds room for `len` bytes for `key`: in the active slab, else in a new one within the
    /// cap (compacting first if that frees a slab). `None` when the cap leaves no room.
    fn allocate(
        &mut self,
        key: u64,
        len: usize,
        slab_bytes: usize,
        cap: u64,
    ) -> Result<Option<(u32, usize)>, PoolError> {
        if let Some(id) = self.active {
            let slab = self.slabs[id as usize]
                .as_mut()
                .expect("active slab is mapped");
            if slab.used + len <= slab.mem.len() {
                let offset = slab.used;
                let before = slab.touched_bytes();
                slab.used += len;
                let grown = slab.touched_bytes() - before;
                if self.held_bytes() > cap && grown > 0 {
                    // The pages this payload would touch do not fit under the cap.
                    let slab = self.slabs[id as usize]
                        .as_mut()
                        .expect("active slab is mapped");
                    slab.used -= len;
                    return Ok(None);
                }
                let slab = self.slabs[id as usize]
                    .as_mut()
                    .expect("active slab is mapped");
                slab.live += len;
                slab.keys.push(key);
                return Ok(Some((id, offset)));
            }
        }
        // The active slab is full: seal it, then make room for a new one.
        if let Some(id) = self.active.take() {
            if self.slabs[id as usize]
                .as_ref()
                .is_some_and(|s| s.live == 0)
            {
                self.slabs[id as usize] = None;
            }
        }
        let new_slab_cost = len.next_multiple_of(PageSize::BASE.usize()) as u64;
        if self.held_bytes() + new_slab_cost > cap {
            self.compact_sparsest(slab_bytes);
            if self.held_bytes() + new_slab_cost > cap {
                return Ok(None);
            }
        }
        let mem = MmapMut::map_anon(slab_bytes).map_err(|source| PoolError::Map {
            bytes: slab_bytes,
            source,
        })?;
        let slab = Slab {
            mem,
            used: len,
            live: len,
            keys: vec![key],
        };
        let id = match self.slabs.iter().position(Option::is_none) {
            Some(free) => {
                self.slabs[free] = Some(slab);
                free
            }
            None => {
                self.slabs.push(Some(slab));
                self.slabs.len() - 1
            }
        } as u32;
        self.active = Some(id);
        Ok(Some((id, 0)))
    }

    /// Evacuates the sealed slab with the lowest live share, if it is under half live.
    fn compact_sparsest(&mut self, slab_bytes: usize) {
        let sparsest = self
            .slabs
            .iter()
            .enumerate()
            .filter_map(|(id, slab)| Some((id as u32, slab.as_ref()?)))
            .filter(|&(id, slab)| Some(id) != self.active && slab.live * 2 < slab.used)
            .min_by_key(|(_, slab)| slab.live * 1000 / slab.used.max(1))
            .map(|(id, _)| id);
        if let Some(id) = sparsest {
            self.evacuate(id, slab_bytes);
        }
    }

    /// Moves the live payloads of slab `id` into the active slab (a new one if needed) and
    /// unmaps it. Needs no cap check: the result holds less than before.
    fn evacuate(&mut self, id: u32, slab_bytes: usize) {
        let Some(old) = self.slabs[id as usize].as_ref() else {
            return;
        };
        // The payloads still living here (a key may be listed twice or have moved on). The
        // slab stays mapped, so its id cannot be reused, until all of them are copied out.
        let live: Vec<(u64, PoolSlot)> = old
            .keys
            .iter()
            .filter_map(|&key| {
                let slot = self.slots[key as usize];
                matches!(slot, PoolSlot::Data { slab, .. } if slab == id).then_some((key, slot))
            })
            .collect();
        let mut payload = Vec::new();
        let mut moved = 0;
        for (key, slot) in live {
            let PoolSlot::Data {
                kind, offset, len, ..
            } = slot
            else {
                continue;
            };
            if self.slots[key as usize] != slot {
                continue;
            }
            let old = self.slabs[id as usize].as_ref().expect("kept mapped");
            payload.clear();
            payload.extend_from_slice(&old.mem[offset as usize..(offset + len) as usize]);
            let Ok(Some((new_slab, new_offset))) =
                self.allocate(key, len as usize, slab_bytes, u64::MAX)
            else {
                // Mapping a new slab failed: the rest stays where it is, nothing is lost.
                break;
            };
            let target = self.slabs[new_slab as usize]
                .as_mut()
                .expect("allocate returns a mapped slab");
            target.mem[new_offset..new_offset + len as usize].copy_from_slice(&payload);
            self.slots[key as usize] = PoolSlot::Data {
                kind,
                slab: new_slab,
                offset: new_offset as u32,
                len,
            };
            let old = self.slabs[id as usize].as_mut().expect("kept mapped");
            old.live -= len as usize;
            moved += u64::from(len);
        }
        if self.slabs[id as usize]
            .as_ref()
            .is_some_and(|s| s.live == 0)
        {
            self.slabs[id as usize] = None;
            self.stats.slabs_compacted += 1;
        }
        self.stats.bytes_compacted += moved;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Codec;
    use proptest::prelude::*;

    const BS: usize = 64 << 10;

    fn config(blocks: u64, cap: u64) -> PoolConfig {
        PoolConfig {
            block_size: BlockSize::new(BS as u64).unwrap(),
            codec: CodecConfig::new(Codec::Lz4),
            blocks,
            cap_bytes: cap,
        }
    }

    /// Compressible to roughly `1/ratio` with lz4 (each 256-byte chunk starts with
    /// `256/ratio` random bytes, the rest zeros), unique per seed.
    fn block(seed: u64, ratio: usize) -> Vec<u8> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut out = vec![0u8; BS];
        for (i, byte) in out.iter_mut().enumerate() {
            if i % 256 < 256 / ratio {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *byte = state as u8;
            }
        }
        out
    }

    fn random(seed: u64) -> Vec<u8> {
        block(seed, 1)
    }

    #[test]
    fn pool_compressible_block_roundtrips_and_take_removes_it() {
        let pool = MemoryPool::new(config(8, 64 << 20)).unwrap();
        let data = block(1, 8);
        assert!(matches!(
            pool.put(3, &data).unwrap(),
            PutOutcome::Stored { .. }
        ));
        assert!(pool.contains(3));
        let mut out = vec![0; BS];
        assert_eq!(pool.get(3, &mut out).unwrap(), Some(BlockKind::Lz4));
        assert!(out == data);
        out.fill(0);
        assert_eq!(pool.take(3, &mut out).unwrap(), Some(BlockKind::Lz4));
        assert!(out == data);
        assert!(!pool.contains(3));
        assert_eq!(pool.get(3, &mut out).unwrap(), None);
        assert_eq!(pool.stats().stored_bytes, 0);
    }

    #[test]
    fn pool_incompressible_block_is_refused_and_replaces_nothing_stale() {
        let pool = MemoryPool::new(config(4, 64 << 20)).unwrap();
        pool.put(0, &block(1, 8)).unwrap();
        assert_eq!(pool.put(0, &random(2)).unwrap(), PutOutcome::Incompressible);
        assert!(!pool.contains(0), "a stale older entry must not survive");
        let stats = pool.stats();
        assert_eq!(stats.rejected_incompressible, 1);
        assert_eq!(stats.stored_bytes, 0);
    }

    #[test]
    fn pool_zero_and_fill_blocks_cost_no_payload() {
        let pool = MemoryPool::new(config(4, 64 << 20)).unwrap();
        assert_eq!(pool.put(0, &vec![0; BS]).unwrap(), PutOutcome::Zero);
        assert_eq!(pool.put(1, &vec![7; BS]).unwrap(), PutOutcome::Fill);
        let mut out = vec![1; BS];
        assert_eq!(pool.get(0, &mut out).unwrap(), Some(BlockKind::Zero));
        assert!(out.iter().all(|&b| b == 0));
        pool.get(1, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 7));
        let stats = pool.stats();
        assert_eq!(
            (stats.zero_blocks, stats.fill_blocks, stats.slabs),
            (1, 1, 0)
        );
    }

    #[test]
    fn pool_at_cap_refuses_and_says_so() {
        // Room for the index plus about 2 slabs.
        let probe = MemoryPool::new(config(512, u64::MAX)).unwrap();
        let index = probe.stats().index_bytes;
        let cap = index + 2 * DEFAULT_SLAB_BYTES as u64;
        let pool = MemoryPool::new(config(512, cap)).unwrap();
        let mut full = 0;
        for key in 0..512 {
            if pool.put(key, &block(key, 4)).unwrap() == PutOutcome::Full {
                full += 1;
            }
        }
        let stats = pool.stats();
        assert!(full > 0, "{stats:?}");
        assert_eq!(stats.rejected_full, full);
        assert!(stats.held_bytes <= cap, "{stats:?}");
        // Everything it did accept is intact.
        let mut out = vec![0; BS];
        for key in 0..512 {
            if pool.get(key, &mut out).unwrap().is_some() {
                assert!(out == block(key, 4), "key {key}");
            }
        }
    }

    #[test]
    fn pool_fragmentation_stays_bounded_under_churn() {
        let pool = MemoryPool::new(config(1024, u64::MAX)).unwrap();
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        let mut live = vec![None; 1024];
        for round in 0..20_000u64 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let key = rng % 1024;
            if rng.is_multiple_of(3) {
                pool.remove(key).unwrap();
                live[key as usize] = None;
            } else {
                let ratio = 2 + (rng % 30) as usize;
                pool.put(key, &block(round, ratio)).unwrap();
                live[key as usize] = Some((round, ratio));
            }
        }
        pool.compact();
        let stats = pool.stats();
        let slab_waste = stats.held_bytes - stats.index_bytes - stats.stored_bytes;
        assert!(
            slab_waste <= stats.stored_bytes / 2 + 2 * DEFAULT_SLAB_BYTES as u64,
            "{stats:?}"
        );
        let mut out = vec![0; BS];
        for (key, entry) in live.iter().enumerate() {
            let got = pool.get(key as u64, &mut out).unwrap();
            match entry {
                Some((seed, ratio)) => assert!(out == block(*seed, *ratio), "key {key}"),
                None => assert_eq!(got, None),
            }
        }
    }

    #[test]
    fn pool_emptied_slabs_are_unmapped() {
        let pool = MemoryPool::new(config(256, u64::MAX)).unwrap();
        for key in 0..256 {
            pool.put(key, &block(key, 4)).unwrap();
        }
        assert!(pool.stats().slabs > 2);
        for key in 0..256 {
            pool.remove(key).unwrap();
        }
        let stats = pool.stats();
        assert!(stats.slabs <= 1, "{stats:?}");
        assert_eq!(stats.stored_bytes, 0);
    }

    #[test]
    fn pool_with_encoded_moves_blocks_without_recompressing() {
        let pool = MemoryPool::new(config(4, u64::MAX)).unwrap();
        let data = block(5, 16);
        pool.put(2, &data).unwrap();
        let (kind, payload) = pool
            .with_encoded(2, |e| (e.kind, e.payload.to_vec()))
            .unwrap()
            .unwrap();
        let mut out = vec![0; BS];
        Decoder::new().decode(kind, &payload, &mut out).unwrap();
        assert!(out == data);
        assert!(pool.with_encoded(1, |_| ()).unwrap().is_none());
    }

    #[test]
    fn pool_bad_key_and_length_are_errors() {
        let pool = MemoryPool::new(config(4, u64::MAX)).unwrap();
        assert!(matches!(
            pool.put(4, &vec![0; BS]),
            Err(PoolError::KeyOutOfRange { .. })
        ));
        assert!(matches!(
            pool.put(0, &[0; 10]),
            Err(PoolError::WrongLength { .. })
        ));
    }

    #[test]
    fn pool_concurrent_readers_and_writers_agree() {
        let pool = MemoryPool::new(config(64, u64::MAX)).unwrap();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let pool = &pool;
                s.spawn(move || {
                    let mut out = vec![0; BS];
                    for i in 0..200u64 {
                        let key = t * 16 + i % 16;
                        pool.put(key, &block(key * 1000 + i, 8)).unwrap();
                        pool.get(key, &mut out).unwrap();
                        assert!(out == block(key * 1000 + i, 8));
                    }
                });
            }
        });
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn pool_any_bytes_roundtrip_or_are_refused(
            bytes in proptest::collection::vec(any::<u8>(), 1..512),
            repeat in 1usize..256,
            codec in prop_oneof![Just(Codec::Lz4), Just(Codec::Zstd { level: 1 }), Just(Codec::Zstd { level: 9 })],
        ) {
            // Arbitrary bytes, repeated to fill a block: from incompressible to highly
            // compressible depending on the length and repeat count drawn.
            let mut data: Vec<u8> = bytes.iter().copied().cycle().take(bytes.len() * repeat).collect();
            data.resize(BS, 0);
            let pool = MemoryPool::new(PoolConfig {
                codec: CodecConfig::new(codec),
                ..config(1, u64::MAX)
            })
            .unwrap();
            let outcome = pool.put(0, &data).unwrap();
            let mut out = vec![0xEE; BS];
            let got = pool.get(0, &mut out).unwrap();
            if outcome.is_stored() {
                prop_assert!(got.is_some());
                prop_assert!(out == data);
            } else {
                prop_assert_eq!(outcome, PutOutcome::Incompressible);
                prop_assert_eq!(got, None);
            }
        }

        #[test]
        fn pool_matches_a_model(ops in proptest::collection::vec((0u64..16, 0u64..1000, 0u8..4), 1..200)) {
            let pool = MemoryPool::new(config(16, 3 * DEFAULT_SLAB_BYTES as u64)).unwrap();
            let mut model: Vec<Option<Vec<u8>>> = vec![None; 16];
            let mut out = vec![0; BS];
            for (key, seed, op) in ops {
                match op {
                    0 => {
                        pool.remove(key).unwrap();
                        model[key as usize] = None;
                    }
                    1 => {
                        let data = random(seed);
                        prop_assert_eq!(pool.put(key, &data).unwrap(), PutOutcome::Incompressible);
                        model[key as usize] = None;
                    }
                    _ => {
                        let data = block(seed, 2 + (seed % 20) as usize);
                        let stored = pool.put(key, &data).unwrap().is_stored();
                        model[key as usize] = stored.then_some(data);
                    }
                }
                for (k, expect) in model.iter().enumerate() {
                    let got = pool.get(k as u64, &mut out).unwrap();
                    match expect {
                        Some(data) => prop_assert!(&out == data),
                        None => prop_assert_eq!(got, None),
                    }
                }
            }
        }
    }
}
