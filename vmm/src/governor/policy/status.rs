//! Everything the governor knows, as `pvisor governor-status` shows it.

use std::time::Instant;

use super::{millis, DecisionCounts, EventCounts, Governor, OrderKind, QueueKind, VmId, VmState};

impl Governor {
    /// Everything the governor knows, for its status command.
    pub fn status(&self, now: Instant) -> Status {
        let c = &self.config;
        let vms = self
            .vms
            .iter()
            .map(|(&id, v)| VmStatus {
                id,
                name: v.name.clone(),
                state: v.state,
                memory_bytes: v.memory_bytes,
                resident: v.reading.resident,
                cgroup: v.reading.cgroup,
                pss: v.reading.pss,
                held: v.reading.held,
                limit: v.limit,
                charge: v.charge(c),
                overhead: v.overhead(c),
                overhead_learned: v.overhead.is_some(),
                peak: v.peak,
                offloaded_bytes: v.offloaded_bytes,
                reachable: v.reachable,
                silent_ms: millis(now.saturating_duration_since(v.last_heard)),
                order: v.order.map(|o| OrderStatus {
                    kind: o.kind,
                    age_ms: millis(now.saturating_duration_since(o.at)),
                    expect_free: o.expect_free,
                    timed_out: o.timed_out,
                }),
                decisions: v.counts,
            })
            .collect();
        let queue = self
            .queue
            .iter()
            .map(|q| QueueStatus {
                vm: q.vm,
                name: self
                    .vms
                    .get(&q.vm)
                    .map(|v| v.name.clone())
                    .unwrap_or_default(),
                kind: q.kind,
                bytes: q.bytes,
                waited_ms: millis(now.saturating_duration_since(q.since)),
            })
            .collect();
        let skip = self.log.len().saturating_sub(c.status_log_lines);
        Status {
            budget: c.budget,
            high_watermark: c.high_watermark,
            low_watermark: c.low_watermark,
            high_bytes: c.high_bytes(),
            low_bytes: c.low_bytes(),
            projected: self.projected(),
            measured: self.measured(),
            usage: self.usage(),
            reclaiming: self.reclaiming.is_some(),
            psi_some_avg10: self.psi,
            failcnt: self.failcnt,
            outstanding: self.outstanding(),
            queue,
            vms,
            decisions: self.counts,
            events: self.events,
            log: self.log.iter().skip(skip).cloned().collect(),
        }
    }
}

/// The governor's status (see [`Governor::status`]); bytes unless named otherwise.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Status {
    /// The budget.
    pub budget: u64,
    /// The high watermark, a fraction of the budget.
    pub high_watermark: f64,
    /// The low watermark, a fraction of the budget.
    pub low_watermark: f64,
    /// The high watermark in bytes.
    pub high_bytes: u64,
    /// The low watermark in bytes.
    pub low_bytes: u64,
    /// The sum of the VMs' charges.
    pub projected: u64,
    /// The measured usage, where known.
    pub measured: Option<u64>,
    /// The larger of projected and measured.
    pub usage: u64,
    /// A reclaim is under way (usage not yet back under the low watermark).
    pub reclaiming: bool,
    /// The last tick's PSI `some avg10`.
    pub psi_some_avg10: Option<f64>,
    /// The last `failcnt` seen.
    pub failcnt: Option<u64>,
    /// Bytes outstanding orders are expected to free.
    pub outstanding: u64,
    /// Queued requests, oldest first.
    pub queue: Vec<QueueStatus>,
    /// The VMs, by id.
    pub vms: Vec<VmStatus>,
    /// All decisions, counted by kind.
    pub decisions: DecisionCounts,
    /// Other events, counted.
    pub events: EventCounts,
    /// The newest decision log lines, oldest first.
    pub log: Vec<String>,
}

/// A queued request in [`Status`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct QueueStatus {
    /// The VM.
    pub vm: VmId,
    /// Its name.
    pub name: String,
    /// `admission` (a join: `bytes` is the limit wanted) or `grant` (held faults: `bytes` to
    /// add).
    pub kind: QueueKind,
    /// See `kind`.
    pub bytes: u64,
    /// How long it has waited, ms.
    pub waited_ms: u64,
}

/// An outstanding order in [`VmStatus`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct OrderStatus {
    /// `offload` or `cold_compress`.
    pub kind: OrderKind,
    /// Since it was given, ms.
    pub age_ms: u64,
    /// Bytes it is expected to free.
    pub expect_free: u64,
    /// Not reported within the order timeout (no longer counted).
    pub timed_out: bool,
}

/// One VM in [`Status`]; bytes unless named otherwise.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct VmStatus {
    /// Its id.
    pub id: VmId,
    /// Its name.
    pub name: String,
    /// Its state as last reported.
    pub state: VmState,
    /// Its guest RAM size.
    pub memory_bytes: u64,
    /// Guest RAM resident.
    pub resident: u64,
    /// Its cgroup usage, if read.
    pub cgroup: Option<u64>,
    /// Its PSS, if read.
    pub pss: Option<u64>,
    /// Bytes its held faults need.
    pub held: u64,
    /// Its resident limit (none yet: charged at resident).
    pub limit: Option<u64>,
    /// What it is charged: overhead + max(resident, limit).
    pub charge: u64,
    /// Its overhead (cgroup usage beyond resident guest RAM).
    pub overhead: u64,
    /// The overhead comes from a reading (else it is the default).
    pub overhead_learned: bool,
    /// The largest resident seen.
    pub peak: u64,
    /// What its last offload took out of residence.
    pub offloaded_bytes: u64,
    /// It has been heard from within `stale_after`.
    pub reachable: bool,
    /// Since it was last heard from, ms.
    pub silent_ms: u64,
    /// Its outstanding order, if any.
    pub order: Option<OrderStatus>,
    /// Its decisions, counted by kind.
    pub decisions: DecisionCounts,
}
