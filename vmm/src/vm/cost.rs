//! What `pvisor stats` reports of a VM: what it costs the host, and what each of its parts
//! did.

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use uffd_pager::cold::ColdStats;
use uffd_pager::metrics::MetricsSnapshot;
use uffd_pager::state::StateCounts;

use super::{Vm, VmState};
use crate::charged::MemoryCost;
use crate::dedup::{Dedup, DedupStats};
use crate::governor::client::LinkStats;
use crate::sharing::{PoolLink, PoolLinkStats};

/// What `stats` reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct VmStats {
    /// Lifecycle state.
    pub state: VmState,
    /// Configured guest RAM.
    pub memory_bytes: u64,
    /// What the VM costs the host: `memory_charged_bytes` first (see [`MemoryCost`]).
    #[serde(flatten)]
    pub memory: MemoryCost,
    /// Bytes held by cold compression: the pool's memory plus its tracking (0 without it).
    pub pool_bytes: u64,
    /// Cold compression's counters and costs, when it runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cold: Option<ColdStats>,
    /// What KSM merged, with `--vm-ram-dedup`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dedup: Option<DedupStats>,
    /// What wait management did, with `--vm-wait-management`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait: Option<crate::wait::WaitStats>,
    /// What the guest's downloads and image reads came to, if it did any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io: Option<crate::net::IoStats>,
    /// Its waits by source (model, download, read), if it waited for any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sources: Option<crate::net::BySource>,
    /// What the memory pool did, with `--vm-memory-pool`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolLinkStats>,
    /// The link to the memory governor, with `--vm-governor`: its counters and the resident
    /// limit in force now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub governor: Option<GovernorStats>,
    /// Bytes allocated on disk by the offload store.
    pub backing_disk_bytes: u64,
    /// Bytes allocated on disk by the virtual disk.
    pub disk_bytes: u64,
    /// The memory cgroup's directory, when the VM runs in one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup_dir: Option<PathBuf>,
    /// Where guest RAM is mapped in the VM process (for samplers that read its smaps).
    pub guest_ram_host_base: u64,
    /// Application data filled in the guest.
    pub app_bytes: u64,
    /// Pages per state.
    pub pages: StateCounts,
    /// Pager counters.
    pub pager: MetricsSnapshot,
    /// Faults that could not be served.
    pub fault_errors: u64,
    /// What the guest's phase arenas did, once it reported one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arenas: Option<crate::arena::ArenaStats>,
}

/// A governed VM's side of the governor.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GovernorStats {
    /// The link's counters.
    #[serde(flatten)]
    pub link: LinkStats,
    /// The resident limit in force (`None`: none).
    pub resident_limit_bytes: Option<u64>,
    /// What the faults held now would install.
    pub held_bytes: u64,
}

impl Vm {
    /// What the VM costs and how its pager is doing.
    pub fn stats(&self) -> VmStats {
        let pager = self.machine.pager();
        let store_dir = &self.options.store_dir;
        let backing_disk_bytes = std::fs::read_dir(store_dir)
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .map(|e| compressed_backing::store::allocated_bytes(&e.path()))
                    .sum()
            })
            .unwrap_or(0);
        let cold = self.machine.cold().map(uffd_pager::cold::Cold::stats);
        let ram = self.machine.ram();
        let memory = MemoryCost::measure(ram, self.cgroup_dir());
        VmStats {
            memory,
            pool_bytes: cold.as_ref().map_or(0, |c| c.overhead_bytes),
            cold,
            dedup: self.dedup.as_ref().map(Dedup::stats),
            pool: self.pool.as_ref().map(PoolLink::stats),
            governor: self.machine.governor().map(|link| GovernorStats {
                link: link.stats(),
                resident_limit_bytes: pager.resident_limit(),
                held_bytes: pager.held_bytes(),
            }),
            wait: self.machine.wait_stats(),
            io: self.machine.io_stats(),
            sources: self.machine.source_stats_all(),
            state: self.state,
            memory_bytes: self.options.memory,
            backing_disk_bytes,
            disk_bytes: compressed_backing::store::allocated_bytes(self.machine.disk_path()),
            cgroup_dir: self.cgroup.as_ref().map(|c| c.dir().to_path_buf()),
            guest_ram_host_base: ram.host_base().0,
            app_bytes: self.machine.app_bytes(),
            pages: pager.state_counts(),
            pager: pager.metrics().snapshot(),
            fault_errors: self.fault_errors.load(Ordering::Relaxed),
            arenas: Some(self.machine.arena_stats()).filter(|a| a.reports > 0),
        }
    }
}
