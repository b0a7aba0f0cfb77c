//! What goes into the policy and what comes out: a VM's state, readings and pressure in;
//! decisions, with their reasons, out; and their counters.

use std::fmt;
use std::time::Duration;

use super::VmId;

/// What a VM is doing, as it reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// Running a command.
    Running,
    /// Waiting for the model; the coordinator's expected remaining wait, if it has one.
    Waiting {
        /// How much longer the wait is expected to last.
        expected_remaining: Option<Duration>,
    },
    /// Nothing to do.
    Idle,
    /// Its RAM is offloaded (it holds little).
    Offloaded,
}

/// A VM's memory readings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Reading {
    /// Guest RAM resident, bytes.
    pub resident: u64,
    /// Its memory cgroup's usage, bytes, where it has one.
    pub cgroup: Option<u64>,
    /// Its process's PSS, bytes, where read.
    pub pss: Option<u64>,
    /// Bytes its held faults need (0: none held).
    pub held: u64,
}

/// The host's readings, given with each tick.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Pressure {
    /// The VMs' total memory usage, bytes (e.g. the budget cgroup's own usage).
    pub total_usage: Option<u64>,
    /// PSI memory `some avg10`, percent.
    pub psi_some_avg10: Option<f64>,
    /// The budget cgroup's `failcnt` (times usage hit the limit).
    pub failcnt: Option<u64>,
    /// The kernel's memory pressure notifications for the budget cgroup since the last tick
    /// (cgroup v1 `memory.pressure_level`, at the server's level or above).
    pub notifications: u64,
}

/// Why a decision was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// It joined and its initial limit fits.
    Join,
    /// It joined, its initial limit does not fit: its limit is its resident until admitted.
    Queued,
    /// A queued join admitted: room was made.
    Admission,
    /// Its held faults granted, under the high watermark.
    Grant,
    /// Granted beyond the high watermark, within the budget: nothing was left to reclaim.
    LastResort,
    /// A reservation (limit above resident, not needed now) revoked.
    Revoke,
    /// Reclaim: usage over the high watermark.
    OverWatermark,
    /// Reclaim: the kernel's pressure signals.
    Pressure,
    /// Reclaim: the oldest queued request does not fit.
    MakeRoom,
    /// Its cold RAM was compressed: the limit follows it down.
    Compressed,
    /// Reclaim: every VM that could give room runs held at its faults; the youngest is
    /// stopped and offloaded so that the oldest queued request fits.
    Preempt,
    /// Its ordered offload was carried out: its limit is what stays resident.
    Offloaded,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Reason::Join => "joined; its initial limit fits under the high watermark",
            Reason::Queued => {
                "joined; its initial limit does not fit: held at its resident, queued for room"
            }
            Reason::Admission => "queued join admitted: room was made",
            Reason::Grant => "its held faults fit under the high watermark",
            Reason::LastResort => {
                "nothing left to reclaim: granted beyond the high watermark, within the budget"
            }
            Reason::Revoke => "a reservation above its resident, not needed now: free to revoke",
            Reason::OverWatermark => "usage over the high watermark",
            Reason::Pressure => "the kernel signals memory pressure",
            Reason::MakeRoom => "the oldest queued request does not fit",
            Reason::Compressed => "its cold RAM was compressed: the limit follows it down",
            Reason::Preempt => {
                "preempted: the oldest queued request does not fit and every VM that could give \
                 room runs held at its faults: the youngest is stopped in its command and \
                 offloaded"
            }
            Reason::Offloaded => "its offload was carried out: the limit is what stays resident",
        })
    }
}

/// What the server carries out (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "decision")]
pub enum Decision {
    /// Set the VM's resident limit to `limit` bytes (never below its resident).
    SetLimit {
        /// The VM.
        vm: VmId,
        /// The new limit, bytes.
        limit: u64,
        /// Why.
        reason: Reason,
    },
    /// Offload this waiting or idle VM now, cooldown and break-even overridden.
    Offload {
        /// The VM.
        vm: VmId,
        /// Why.
        reason: Reason,
    },
    /// Compress this running VM's RAM colder than `age`.
    ColdCompress {
        /// The VM.
        vm: VmId,
        /// The cold age.
        age: Duration,
        /// Why.
        reason: Reason,
    },
}

impl Decision {
    /// The VM it is for.
    pub fn vm(&self) -> VmId {
        match *self {
            Decision::SetLimit { vm, .. }
            | Decision::Offload { vm, .. }
            | Decision::ColdCompress { vm, .. } => vm,
        }
    }

    /// Why it was taken.
    pub fn reason(&self) -> Reason {
        match *self {
            Decision::SetLimit { reason, .. }
            | Decision::Offload { reason, .. }
            | Decision::ColdCompress { reason, .. } => reason,
        }
    }
}

/// Decisions counted by kind (limits by their reason).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DecisionCounts {
    /// Initial limits given at join.
    pub join: u64,
    /// Joins that did not fit and were queued.
    pub queued: u64,
    /// Queued joins admitted.
    pub admission: u64,
    /// Requests granted under the high watermark.
    pub grant: u64,
    /// Requests granted beyond the high watermark, within the budget.
    pub last_resort: u64,
    /// Reservations revoked.
    pub revoke: u64,
    /// Offloads ordered (preemptions included).
    pub offload: u64,
    /// Offloads ordered of a running VM held at its faults.
    pub preempt: u64,
    /// Cold compressions ordered.
    pub cold_compress: u64,
    /// Limits lowered after a cold compression.
    pub compressed: u64,
    /// Limits set to what an ordered offload left resident.
    pub offloaded: u64,
}

impl DecisionCounts {
    pub(super) fn count(&mut self, decision: &Decision) {
        if let Decision::Offload {
            reason: Reason::Preempt,
            ..
        } = *decision
        {
            self.preempt += 1;
        }
        let field = match *decision {
            Decision::Offload { .. } => &mut self.offload,
            Decision::ColdCompress { .. } => &mut self.cold_compress,
            Decision::SetLimit { reason, .. } => match reason {
                Reason::Join => &mut self.join,
                Reason::Queued => &mut self.queued,
                Reason::Admission => &mut self.admission,
                Reason::Grant => &mut self.grant,
                Reason::LastResort => &mut self.last_resort,
                Reason::Compressed => &mut self.compressed,
                Reason::Offloaded => &mut self.offloaded,
                Reason::Revoke
                | Reason::OverWatermark
                | Reason::Pressure
                | Reason::MakeRoom
                | Reason::Preempt => &mut self.revoke,
            },
        };
        *field += 1;
    }
}

/// Events that are not decisions, counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct EventCounts {
    /// Requests received (held faults).
    pub requests: u64,
    /// Queued requests dropped because their VM became unreachable.
    pub requests_dropped: u64,
    /// Orders reported done.
    pub orders_done: u64,
    /// Orders reported failed.
    pub orders_failed: u64,
    /// Orders not reported within the order timeout.
    pub orders_timed_out: u64,
    /// Times a VM became unreachable.
    pub unreachable: u64,
    /// The kernel's memory pressure notifications received (see [`Pressure::notifications`]).
    pub pressure_notifications: u64,
}

/// The kind of an order a VM carries out and reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OrderKind {
    /// [`Decision::Offload`].
    Offload,
    /// [`Decision::ColdCompress`].
    ColdCompress,
}
