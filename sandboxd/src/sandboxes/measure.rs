//! What `GET /metrics` reads of the sandboxes: every record, and what each live sandbox's VM
//! is charged for now (the counters themselves are in [`crate::metrics`]).

use vmm::control::Method;

use super::Sandboxes;
use crate::store::{Record, VmRef};
use crate::vm;

impl Sandboxes {
    /// The live sandboxes (those with a VM) and what each VM is charged for now, asked of
    /// the VMs one after the other (`None`: no answer).
    pub async fn charged(&self) -> Vec<crate::metrics::Charged> {
        let live: Vec<(String, VmRef)> = self
            .table()
            .values()
            .filter(|s| !s.record.state.is_final())
            .filter_map(|s| Some((s.record.id.clone(), s.record.vm.clone()?)))
            .collect();
        tokio::task::spawn_blocking(move || {
            live.into_iter()
                .map(|(id, vm)| {
                    let bytes = vm::call(&vm, Method::Stats).ok().and_then(|v| {
                        let v = v.get("value").unwrap_or(&v);
                        v["memory_charged_bytes"].as_u64()
                    });
                    (id, bytes)
                })
                .collect()
        })
        .await
        .unwrap_or_default()
    }

    /// The memory governor's reading of the budget and its whole status, for `GET /metrics`.
    pub fn governor(&self) -> (crate::governed::Room, vmm::governor::policy::Status) {
        self.governed.reading()
    }

    /// Stops the memory governor as the daemon exits; with `remove` (every VM stopped) its
    /// budget cgroup goes too.
    pub fn stop_governor(&self, remove: bool) {
        self.governed.stop(remove);
    }

    /// Every record, for `GET /metrics`.
    pub fn records(&self) -> Vec<Record> {
        self.table().values().map(|s| s.record.clone()).collect()
    }
}
