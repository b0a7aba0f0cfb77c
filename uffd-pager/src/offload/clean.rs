//! Clean blocks: what the offload store holds already need not be written again.
//!
//! A VM brought back from its offload store and offloaded again mostly holds what it held
//! before: a command that reads its working set (a sandbox's `digest`, an agent's tool step
//! that reads more than it writes) leaves most blocks as the store has them, and writing them
//! again costs the CPU of composing, encoding and writing, the disk's bandwidth, and the
//! offload's time while the VM's memory is wanted elsewhere. So the pager keeps, for every
//! block its own offloads committed, a hash of the bytes committed; an offload hashes each
//! wholly resident block with one and, where the hashes match, only drops its pages (they
//! come back from the store on fault as they would have after a write).
//!
//! The record is exact by construction:
//! - a block's hash is taken from the very bytes its writer composed, and recorded only once
//!   the batch holding it committed (a batch rolled back records nothing);
//! - a block's hash is forgotten before the block is written again by any means (its pooled
//!   copy passed through as it is included), so a failure half-way leaves no stale hash;
//! - it lives in the pager's memory only: a pager that takes over from another, or a store
//!   opened anew, starts with none and writes everything once;
//! - compaction moves payloads without changing them, so hashes survive it;
//! - a stronger durability than the record's commits had ([`Durability::Host`] after
//!   [`Durability::Process`]) forgets everything, so a clean block is always as durable as
//!   the offload asks.
//!
//! The hash is 128-bit xxh3 with a seed drawn at random for each pager: an accidental match
//! of different bytes has a chance of 2⁻¹²⁸, and a guest never sees a hash nor the seed, so
//! it cannot aim for one. (Were it to, it could only bring back its own earlier bytes: the
//! store is the VM's own.)
//!
//! Cost: 16 bytes per block of guest RAM once an offload ran (256 KiB for 1 GiB of 64 KiB
//! blocks), and one hash of each wholly resident block per offload (xxh3 runs at several
//! GB/s: ~10 ms for 64 MiB on this host, against ~100 ms to write it).

use std::hash::BuildHasher;

use compressed_backing::Durability;
use parking_lot::Mutex;

/// The hashes of the blocks committed to the pager's offload store.
#[derive(Debug)]
pub(crate) struct StoredHashes {
    seed: u64,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// The weakest durability of the commits recorded (none recorded: `None`).
    durability: Option<Durability>,
    /// By block: the hash of its committed bytes, 0 where unknown.
    committed: Vec<u128>,
    /// Hashes of blocks composed by the offload under way, not yet committed.
    composed: Vec<(u64, u128)>,
}

impl StoredHashes {
    /// An empty record with a seed of its own.
    pub(crate) fn new() -> Self {
        // `RandomState` draws its keys from the operating system's randomness.
        let seed = std::collections::hash_map::RandomState::new().hash_one(0x5eed_u64);
        Self {
            seed,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn hash(&self, bytes: &[u8]) -> u128 {
        // 0 means unknown: a hash that is 0 is recorded as 1 (one more chance in 2¹²⁸ of a
        // match, never a wrong one).
        xxhash_rust::xxh3::xxh3_128_with_seed(bytes, self.seed).max(1)
    }

    /// An offload at `durability` begins: what an earlier one composed and did not commit is
    /// forgotten, and everything where this one asks for more durability than was recorded.
    pub(crate) fn begin(&self, durability: Durability) {
        let mut inner = self.inner.lock();
        inner.composed.clear();
        if durability == Durability::Host && inner.durability == Some(Durability::Process) {
            inner.committed.clear();
            inner.durability = None;
        }
        inner.durability = match inner.durability {
            Some(Durability::Process) => Some(Durability::Process),
            _ => Some(durability),
        };
    }

    /// Whether the store holds `block` with exactly `bytes` (its resident bytes now).
    pub(crate) fn holds(&self, block: u64, bytes: &[u8]) -> bool {
        let known = {
            let inner = self.inner.lock();
            usize::try_from(block)
                .ok()
                .and_then(|b| inner.committed.get(b).copied())
                .unwrap_or(0)
        };
        known != 0 && self.hash(bytes) == known
    }

    /// `block` is about to be written again: its hash is no longer known.
    pub(crate) fn forget(&self, blocks: &[u64]) {
        let mut inner = self.inner.lock();
        for &block in blocks {
            if let Some(hash) = usize::try_from(block)
                .ok()
                .and_then(|b| inner.committed.get_mut(b))
            {
                *hash = 0;
            }
        }
    }

    /// The offload's writer composed `block` as `bytes` (called from its threads).
    pub(crate) fn composed(&self, block: u64, bytes: &[u8]) {
        let hash = self.hash(bytes);
        self.inner.lock().composed.push((block, hash));
    }

    /// `blocks` are committed: the hashes of their composed bytes are theirs now.
    pub(crate) fn committed(&self, blocks: &[u64]) {
        let mut inner = self.inner.lock();
        let Inner {
            committed,
            composed,
            ..
        } = &mut *inner;
        composed.retain(|&(block, hash)| {
            if blocks.binary_search(&block).is_err() {
                return true;
            }
            let Ok(at) = usize::try_from(block) else {
                return false;
            };
            if committed.len() <= at {
                committed.resize(at + 1, 0);
            }
            committed[at] = hash;
            false
        });
    }

    /// The store was opened anew: nothing in it is known.
    pub(crate) fn clear(&self) {
        *self.inner.lock() = Inner::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_clean_only_once_its_batch_committed_and_until_it_is_written_again() {
        let h = StoredHashes::new();
        let a = vec![7u8; 4096];
        let b = vec![9u8; 4096];
        h.begin(Durability::Process);
        h.composed(3, &a);
        assert!(!h.holds(3, &a), "composed, not committed");
        h.committed(&[3]);
        assert!(h.holds(3, &a));
        assert!(!h.holds(3, &b), "other bytes");
        assert!(!h.holds(4, &a), "another block");
        // Written again: forgotten first; a batch that never commits records nothing.
        h.begin(Durability::Process);
        h.forget(&[3]);
        h.composed(3, &b);
        assert!(!h.holds(3, &a) && !h.holds(3, &b));
        h.begin(Durability::Process);
        h.committed(&[3]);
        assert!(
            !h.holds(3, &b),
            "the rolled-back batch's hash was dropped at begin"
        );
    }

    #[test]
    fn host_durability_after_process_commits_forgets_them() {
        let h = StoredHashes::new();
        let a = vec![1u8; 4096];
        h.begin(Durability::Process);
        h.composed(0, &a);
        h.committed(&[0]);
        h.begin(Durability::Host);
        assert!(!h.holds(0, &a));
        h.composed(0, &a);
        h.committed(&[0]);
        // Host commits serve a process-durable offload.
        h.begin(Durability::Process);
        assert!(h.holds(0, &a));
        h.clear();
        assert!(!h.holds(0, &a));
    }

    #[test]
    fn seeds_differ_between_records() {
        let a = vec![3u8; 4096];
        assert_ne!(StoredHashes::new().hash(&a), StoredHashes::new().hash(&a));
    }
}
