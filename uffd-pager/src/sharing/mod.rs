//! The memory pool: one copy of the pages that independently started VMs have in common,
//! shared read-only, copied on write.
//!
//! The pool is a daemon (`uffd-pager serve --memory-pool --socket S`) holding one sealed
//! memfd laid out like guest RAM: page `i` of the memfd is a content some VMs hold at guest
//! page `i`. A VM attaches, gets a read-only descriptor of the memfd, and from time to time,
//! while its vCPU is stopped, offers the hashes of the pages it has written. When two VMs offer
//! the same hash at the same page, the daemon reads the page from the VM that offered it
//! (`process_vm_readv`), checks the hash, writes it into the memfd and tells the VM to merge:
//! the VM compares its page with the pool's byte for byte and maps the pool over it
//! (`MAP_PRIVATE | MAP_FIXED` of the memfd, a run of pages at a time). Reads then share the
//! pool's page; a write gives the VM a private copy, which it reports on its next offer so
//! that the daemon can drop pages nobody maps any more.
//!
//! A pool page is written once, into a hole, and never changed while any VM maps it: a VM can
//! never read bytes other than its own. If the daemon dies, the memfd lives on in the VMs'
//! mappings, so they keep running with the right data; they only stop merging.
//!
//! Unique pages never enter the pool: the daemon keeps one (hash, VM) candidate per page
//! index, bounded by [`MAX_CANDIDATES`].
//!
//! - `daemon`: the pool's daemon: its memfd, its candidates, the merges it orders.
//! - `client`: a VM's side of the protocol.

mod client;
mod daemon;

pub use client::PoolClient;
pub use daemon::{run_daemon, run_daemon_with, PoolServer, Running};

use basics::PAGE_SIZE as PAGE;

/// Bytes of the pool's memfd: the largest guest RAM.
pub const POOL_SIZE: u64 = 4 << 30;
/// Candidates (page index → one VM's hash) the daemon remembers at most.
pub const MAX_CANDIDATES: usize = 4 << 20;

/// Errors of the pool.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// A system call failed.
    #[error("memory pool: cannot {op}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The other side broke the protocol or refused.
    #[error("memory pool: {0}")]
    Protocol(String),
}

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> PoolError {
    move |source| PoolError::Io { op, source }
}

fn errno(op: &'static str) -> impl FnOnce(nix::errno::Errno) -> PoolError {
    move |e| PoolError::Io {
        op,
        source: std::io::Error::from(e),
    }
}

/// A set of page indices below a bound, one bit each: 16 KiB for 512 MiB of RAM, where a hash
/// set of 16 Ki pages costs several hundred KiB (what a pool VM holds counts against what the
/// pool saves).
#[derive(Debug, Clone, Default)]
pub struct PageSet {
    words: Vec<u64>,
    bound: u64,
    len: u64,
}

impl PageSet {
    /// An empty set of pages below `pages`.
    pub fn new(pages: u64) -> Self {
        Self {
            words: vec![0; usize::try_from(pages.div_ceil(64)).expect("a page count")],
            bound: pages,
            len: 0,
        }
    }

    fn at(&self, page: u64) -> Option<(usize, u64)> {
        let word = usize::try_from(page / 64).ok()?;
        (page < self.bound).then_some((word, 1 << (page % 64)))
    }

    /// Adds `page`; true if it was not there.
    pub fn insert(&mut self, page: u64) -> bool {
        let Some((word, bit)) = self.at(page) else {
            return false;
        };
        let new = self.words[word] & bit == 0;
        self.words[word] |= bit;
        self.len += u64::from(new);
        new
    }

    /// Removes `page`; true if it was there.
    pub fn remove(&mut self, page: u64) -> bool {
        let Some((word, bit)) = self.at(page) else {
            return false;
        };
        let had = self.words[word] & bit != 0;
        self.words[word] &= !bit;
        self.len -= u64::from(had);
        had
    }

    /// True if `page` is in the set.
    pub fn contains(&self, page: u64) -> bool {
        self.at(page)
            .is_some_and(|(word, bit)| self.words[word] & bit != 0)
    }

    /// Pages in the set.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True if the set is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pages, in order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &word)| {
            (0..64)
                .filter(move |b| word & (1 << b) != 0)
                .map(move |b| i as u64 * 64 + b)
        })
    }
}

/// A request, one JSON line.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Join the pool; the reply carries the memfd, read-only.
    Attach {
        /// Where the VM's guest RAM starts in its address space.
        ram_base: u64,
        /// Bytes of guest RAM.
        memory: u64,
    },
    /// Pages the VM holds privately, `(page index, xxh3-64 of its bytes)`, and pages it
    /// mapped from the pool but no longer does (written since).
    Offer {
        /// Private pages.
        pages: Vec<(u64, u64)>,
        /// Pool pages it stopped using.
        released: Vec<u64>,
    },
    /// The pages of the last reply's `merge` the VM now maps from the pool.
    Merged {
        /// Page indices.
        pages: Vec<u64>,
    },
}

/// A reply, one JSON line.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Reply {
    /// The request failed: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Pages whose content the pool holds with the offered hash: compare, then map.
    #[serde(default)]
    pub merge: Vec<u64>,
    /// The pool's counters after the request.
    #[serde(default)]
    pub stats: PoolStats,
}

/// The daemon's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolStats {
    /// VMs attached now.
    pub vms: u64,
    /// Pages in the pool.
    pub pool_pages: u64,
    /// Mappings of pool pages by VMs (what the pool saves is `references - pool_pages`).
    pub references: u64,
    /// Candidates remembered.
    pub candidates: u64,
    /// Pages read from VMs into the pool.
    pub adopted: u64,
    /// Pages whose bytes did not match the hash offered (changed while read): not pooled.
    pub mismatched: u64,
    /// Pool pages dropped after their last VM let go.
    pub dropped: u64,
    /// Connections refused because the peer's uid or gid is not allowed.
    #[serde(default)]
    pub refused: u64,
    /// Connections closed at once because [`MAX_PEERS`] were open already.
    #[serde(default)]
    pub over_cap: u64,
}

/// Most connections the pool serves at once, each on its own thread: one more is closed at
/// once, so that a flood of connections cannot start threads without end.
pub const MAX_PEERS: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_set_counts_inserts_and_removes_once() {
        let mut set = PageSet::new(130);
        assert!(set.insert(0) && set.insert(64) && set.insert(129));
        assert!(!set.insert(64));
        assert!(!set.insert(130), "beyond the bound");
        assert_eq!(set.len(), 3);
        assert!(set.contains(129) && !set.contains(1));
        assert!(set.remove(0) && !set.remove(0));
        assert_eq!(set.iter().collect::<Vec<_>>(), vec![64, 129]);
        assert_eq!(set.len(), 2);
    }
}
