//! One reader per block: a block being read from its source (the store or the restore image)
//! by a fault thread or the prefetcher is claimed for the read and its install. A fault on a
//! block that the prefetcher is reading waits for that read instead of reading the block a
//! second time (a 2 MiB block is more than a millisecond of disk), and the prefetcher passes
//! over a block a fault thread is reading.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::Shared;

/// The blocks being read now.
#[derive(Debug)]
pub(crate) struct Fetches {
    busy: Box<[AtomicBool]>,
    /// Faults waiting for another thread's read (their fault threads are woken when a claim
    /// is given back).
    pub waiting: AtomicU64,
}

impl Fetches {
    pub fn new(blocks: u64) -> Self {
        Self {
            busy: (0..blocks).map(|_| AtomicBool::new(false)).collect(),
            waiting: AtomicU64::new(0),
        }
    }
}

/// A claim on a block, given back on drop.
pub(crate) struct Fetch<'a> {
    shared: &'a Shared,
    block: u64,
}

impl Shared {
    /// Claims `block` for a read and its install; `None` if another thread has it (blocks
    /// outside the table are never claimed and never refused).
    pub(crate) fn claim_fetch(&self, block: u64) -> Option<Fetch<'_>> {
        let Some(busy) = self.fetches.busy.get(block as usize) else {
            return Some(Fetch {
                shared: self,
                block: u64::MAX,
            });
        };
        busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Fetch {
                shared: self,
                block,
            })
    }
}

impl Drop for Fetch<'_> {
    fn drop(&mut self) {
        if let Some(busy) = self.shared.fetches.busy.get(self.block as usize) {
            busy.store(false, Ordering::Release);
            if self.shared.fetches.waiting.load(Ordering::Relaxed) > 0 {
                self.shared.signal();
            }
        }
    }
}
