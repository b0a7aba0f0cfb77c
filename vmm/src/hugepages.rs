//! The host's pool of 2 MiB huge pages, as hugetlb guest RAM needs it: how many it can still
//! give, and the check made before such RAM is mapped.
//!
//! The kernel keeps a pool of huge pages (`nr_hugepages`, reserved at boot or by an operator)
//! and may lend more from ordinary memory while it has them to give (`nr_overcommit_hugepages`
//! surplus pages, freed back to the host when released). Guest RAM is mapped without a
//! reservation, so what one VM may still take is the pool's free pages that nobody has
//! reserved, plus the surplus pages the kernel may still lend. The check is made once, before
//! mapping; VMs that start later share the same pool, so a huge page the guest touches can
//! still fail to come (the fault is then an error the VM's owner sees, never zeros).

use std::path::{Path, PathBuf};

/// Where the kernel shows the 2 MiB pool.
pub const POOL_DIR: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";

/// Why huge-page RAM cannot be mapped.
#[derive(Debug, thiserror::Error)]
pub enum HugePoolError {
    /// A counter of the pool could not be read.
    #[error("cannot read {path} (does this kernel have 2 MiB huge pages?)")]
    Read {
        /// The file.
        path: PathBuf,
        /// The system error, or why its content is not a count.
        #[source]
        source: std::io::Error,
    },
    /// The kernel could not set `needed` huge pages aside (its pool is short, or free memory
    /// is too fragmented for new 2 MiB pages).
    #[error(
        "the host cannot give {needed} huge pages of 2 MiB now (its pool is short, or free \
         memory is too fragmented to make new ones): raise /proc/sys/vm/nr_hugepages (reserved \
         pages) or /proc/sys/vm/nr_overcommit_hugepages, or free memory"
    )]
    Probe {
        /// Pages asked for.
        needed: u64,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// The pool has too few pages free and may lend too few.
    #[error(
        "{needed} huge pages of 2 MiB are needed, the host's pool can give {available} ({free} \
         free, {reserved} of them reserved, {lendable} more as surplus): raise \
         /proc/sys/vm/nr_hugepages (reserved pages) or /proc/sys/vm/nr_overcommit_hugepages \
         (pages lent from free memory and given back when released)"
    )]
    TooFew {
        /// Pages the RAM needs.
        needed: u64,
        /// Pages the pool can give now.
        available: u64,
        /// Free pages in the pool.
        free: u64,
        /// Free pages reserved by mappings.
        reserved: u64,
        /// Surplus pages the kernel may still lend.
        lendable: u64,
    },
}

/// The pool's counters, as read from [`POOL_DIR`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct HugePool {
    /// Pages in the pool (`nr_hugepages`), surplus pages included.
    pub total: u64,
    /// Pages free in it (`free_hugepages`), reserved ones included.
    pub free: u64,
    /// Free pages reserved by mappings (`resv_hugepages`).
    pub reserved: u64,
    /// Pages lent beyond the persistent pool (`surplus_hugepages`).
    pub surplus: u64,
    /// How many surplus pages the kernel may lend (`nr_overcommit_hugepages`).
    pub overcommit: u64,
}

impl HugePool {
    /// Reads the pool's counters now.
    pub fn read() -> Result<Self, HugePoolError> {
        Self::read_in(Path::new(POOL_DIR))
    }

    /// Reads the counters from `dir` (a directory laid out as [`POOL_DIR`]).
    pub fn read_in(dir: &Path) -> Result<Self, HugePoolError> {
        let count = |name: &str| -> Result<u64, HugePoolError> {
            let path = dir.join(name);
            std::fs::read_to_string(&path)
                .and_then(|text| {
                    text.trim()
                        .parse::<u64>()
                        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
                })
                .map_err(|source| HugePoolError::Read { path, source })
        };
        Ok(Self {
            total: count("nr_hugepages")?,
            free: count("free_hugepages")?,
            reserved: count("resv_hugepages")?,
            surplus: count("surplus_hugepages")?,
            overcommit: count("nr_overcommit_hugepages")?,
        })
    }

    /// Surplus pages the kernel may still lend.
    pub fn lendable(&self) -> u64 {
        self.overcommit.saturating_sub(self.surplus)
    }

    /// Pages a mapping without a reservation can still get: free and unreserved, or lent.
    pub fn available(&self) -> u64 {
        self.free.saturating_sub(self.reserved) + self.lendable()
    }

    /// Whether the kernel can set `needed` huge pages aside now, tried for real: a mapping of
    /// them with a reservation (which takes free pages of the pool and makes surplus pages
    /// from free memory, where it may lend them), unmapped at once. Unlike the counters of
    /// [`HugePool::check`], this finds out whether fragmented memory can still make new huge
    /// pages. What it set aside is free again when it returns: a load right after takes them
    /// (another process may take them first).
    pub fn probe(needed: u64) -> Result<(), HugePoolError> {
        if needed == 0 {
            return Ok(());
        }
        let fail = |source| HugePoolError::Probe { needed, source };
        let len = needed
            .checked_mul(2 << 20)
            .and_then(|len| usize::try_from(len).ok())
            .ok_or_else(|| fail(std::io::Error::from_raw_os_error(libc::EOVERFLOW)))?;
        // SAFETY: a new private mapping the kernel places, never touched, unmapped below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_HUGE_2MB,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(fail(std::io::Error::last_os_error()));
        }
        // SAFETY: the mapping made above, of `len` bytes; nothing refers to it.
        unsafe { libc::munmap(addr, len) };
        Ok(())
    }

    /// Whether `needed` pages can come from the pool now.
    pub fn check(&self, needed: u64) -> Result<(), HugePoolError> {
        if self.available() >= needed {
            return Ok(());
        }
        Err(HugePoolError::TooFew {
            needed,
            available: self.available(),
            free: self.free,
            reserved: self.reserved,
            lendable: self.lendable(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(dir: &Path, values: [(&str, u64); 5]) {
        for (name, value) in values {
            std::fs::write(dir.join(name), format!("{value}\n")).unwrap();
        }
    }

    #[test]
    fn pool_available_counts_free_unreserved_and_lendable_pages() {
        let dir = tempfile::tempdir().unwrap();
        pool(
            dir.path(),
            [
                ("nr_hugepages", 10),
                ("free_hugepages", 6),
                ("resv_hugepages", 2),
                ("surplus_hugepages", 3),
                ("nr_overcommit_hugepages", 8),
            ],
        );
        let pool = HugePool::read_in(dir.path()).unwrap();
        assert_eq!(pool.lendable(), 5);
        assert_eq!(pool.available(), 4 + 5);
        assert!(pool.check(9).is_ok());
        let message = pool.check(10).unwrap_err().to_string();
        assert!(message.contains("10 huge pages"), "{message}");
        assert!(message.contains("nr_overcommit_hugepages"), "{message}");
    }

    #[test]
    fn pool_read_names_a_missing_or_bad_counter() {
        let dir = tempfile::tempdir().unwrap();
        let error = HugePool::read_in(dir.path()).unwrap_err().to_string();
        assert!(error.contains("nr_hugepages"), "{error}");
        pool(
            dir.path(),
            [
                ("nr_hugepages", 0),
                ("free_hugepages", 0),
                ("resv_hugepages", 0),
                ("surplus_hugepages", 0),
                ("nr_overcommit_hugepages", 0),
            ],
        );
        std::fs::write(dir.path().join("free_hugepages"), "many\n").unwrap();
        let error = HugePool::read_in(dir.path()).unwrap_err().to_string();
        assert!(error.contains("free_hugepages"), "{error}");
    }

    #[test]
    fn pool_on_this_host_reads() {
        if Path::new(POOL_DIR).exists() {
            let pool = HugePool::read().unwrap();
            assert!(pool.free <= pool.total);
        }
    }
}
