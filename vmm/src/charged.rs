//! The memory a VM is charged for (issue 35): one figure that every report leads with, and the
//! figures beside it.
//!
//! The headline is what the host pays for the VM: its memory cgroup's usage where it runs in
//! one, else `process_memory_bytes` (the process's PSS with guest RAM counted as the RAM the
//! host holds for it, mapped or not). Hugetlb pages are charged to no memory cgroup, so a VM of
//! huge pages adds the pages it holds to its cgroup's usage. (A cgroup v2 hierarchy mounted with
//! `memory_hugetlb_accounting` does charge them, and there this sum would count them twice;
//! these hosts have the memory controller on v1, which never does.) Guest PSS stays as a second
//! figure: it misses memfd RAM that is resident but unmapped (cold compression unmaps the
//! blocks it watches), so it flatters a memfd VM.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::memory::GuestRam;
use crate::stats::{self, MemoryCgroup};

/// Where the headline figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChargedBy {
    /// The VM's memory cgroup's usage, plus its hugetlb pages.
    Cgroup,
    /// `process_memory_bytes`: the VM runs in no memory cgroup (or it could not be read).
    Process,
}

/// What a VM costs the host now, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct MemoryCost {
    /// The headline: the memory charged for the VM (see the module's documentation).
    pub memory_charged_bytes: u64,
    /// Where `memory_charged_bytes` came from.
    pub memory_charged_by: ChargedBy,
    /// PSS of the whole VM process (`smaps_rollup`, hugetlb pages included; 0 where it cannot
    /// be read).
    pub process_pss_bytes: u64,
    /// PSS of the guest-RAM mapping alone. For memfd RAM this misses pages that are in the
    /// memfd but not mapped: see `guest_ram_resident_bytes`.
    pub guest_ram_pss_bytes: u64,
    /// Guest RAM the host really holds: the mapping's PSS for anon RAM, the memfd's allocated
    /// bytes for memfd RAM.
    pub guest_ram_resident_bytes: u64,
    /// What the VM process really holds: its PSS with guest RAM counted as
    /// `guest_ram_resident_bytes`.
    pub process_memory_bytes: u64,
    /// Hugetlb pages of guest RAM the VM holds (no memory cgroup is charged for them).
    pub hugetlb_bytes: u64,
    /// The memory cgroup's usage, when the VM runs in one.
    pub cgroup_memory_bytes: Option<u64>,
}

impl MemoryCost {
    /// Measures the VM of this process whose guest RAM is `ram`, running in the memory cgroup
    /// at `cgroup` if any.
    pub fn measure(ram: &GuestRam, cgroup: Option<&Path>) -> Self {
        let process_pss_bytes = stats::process_pss().unwrap_or(0);
        let (start, len) = ram.span();
        let guest = stats::range_memory_of(None, start, len).unwrap_or_default();
        let guest_ram_pss_bytes = guest.pss + guest.hugetlb;
        let guest_ram_resident_bytes = match ram.memfd() {
            Some(memfd) => memfd.metadata().map_or(0, |m| m.blocks() * 512),
            None => guest_ram_pss_bytes,
        };
        // A hugetlb memfd's allocated bytes are its huge pages, mapped or not.
        let hugetlb_bytes = if ram.kind().is_hugetlb() {
            guest_ram_resident_bytes.max(guest.hugetlb)
        } else {
            guest.hugetlb
        };
        let cgroup_memory_bytes = cgroup.and_then(|dir| MemoryCgroup::at(dir).usage().ok());
        Self::from_parts(
            process_pss_bytes,
            guest_ram_pss_bytes,
            guest_ram_resident_bytes,
            hugetlb_bytes,
            cgroup_memory_bytes,
        )
    }

    /// The figures from what was read.
    pub fn from_parts(
        process_pss_bytes: u64,
        guest_ram_pss_bytes: u64,
        guest_ram_resident_bytes: u64,
        hugetlb_bytes: u64,
        cgroup_memory_bytes: Option<u64>,
    ) -> Self {
        let process_memory_bytes =
            process_pss_bytes.saturating_sub(guest_ram_pss_bytes) + guest_ram_resident_bytes;
        let (memory_charged_bytes, memory_charged_by) = match cgroup_memory_bytes {
            Some(usage) => (usage + hugetlb_bytes, ChargedBy::Cgroup),
            None => (process_memory_bytes, ChargedBy::Process),
        };
        Self {
            memory_charged_bytes,
            memory_charged_by,
            process_pss_bytes,
            guest_ram_pss_bytes,
            guest_ram_resident_bytes,
            process_memory_bytes,
            hugetlb_bytes,
            cgroup_memory_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn charged_is_the_cgroup_plus_huge_pages_where_there_is_one() {
        let cost = MemoryCost::from_parts(70 * MIB, 64 * MIB, 64 * MIB, 0, Some(75 * MIB));
        assert_eq!(cost.memory_charged_bytes, 75 * MIB);
        assert_eq!(cost.memory_charged_by, ChargedBy::Cgroup);
        // Huge pages are charged to no cgroup: added.
        let huge = MemoryCost::from_parts(70 * MIB, 64 * MIB, 64 * MIB, 64 * MIB, Some(11 * MIB));
        assert_eq!(huge.memory_charged_bytes, 75 * MIB);
    }

    #[test]
    fn charged_without_a_cgroup_counts_unmapped_memfd_ram() {
        // A cold-compression VM whose 64 MiB of memfd RAM is resident but unmapped: guest PSS
        // says 0, the process 3 MiB; the host holds 67 MiB.
        let cost = MemoryCost::from_parts(3 * MIB, 0, 64 * MIB, 0, None);
        assert_eq!(cost.memory_charged_by, ChargedBy::Process);
        assert_eq!(cost.process_memory_bytes, 67 * MIB);
        assert_eq!(cost.memory_charged_bytes, 67 * MIB);
    }
}
