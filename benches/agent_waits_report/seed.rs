//! The seed system's 16-VM agent-wait table (pvisor), the figures to compare with.
//!
//! The seed replayed the qutebrowser-667 case with its waits as recorded (232.7 s of model
//! time per task) in 16 VMs running Linux guests; this bench replays a trajectory of the same
//! shape with its waits × 0.05 and the 2 KiB workload guest, so its GiB·s and minutes are far
//! smaller: the ratios to `off` are what compare.

/// VMs of the seed's table.
pub const VMS: usize = 16;

/// Guest-RAM PSS × time per task without wait management, GiB·s.
pub const OFF_GUEST_PSS_GIB_S: f64 = 162.68;
/// The same with offload, GiB·s.
pub const OFFLOAD_GUEST_PSS_GIB_S: f64 = 57.04;
/// Throughput without wait management, tasks per minute.
pub const OFF_THROUGHPUT: f64 = 2.52;
/// Throughput with offload, tasks per minute.
pub const OFFLOAD_THROUGHPUT: f64 = 2.15;
/// How much longer offload made the batch window, %.
pub const OFFLOAD_WINDOW_CHANGE_PCT: f64 = 17.0;

/// Offload's guest PSS × time as a share of off's, % (35%).
pub fn offload_guest_pct() -> f64 {
    OFFLOAD_GUEST_PSS_GIB_S / OFF_GUEST_PSS_GIB_S * 100.0
}

/// Offload's throughput change against off, % (−15%).
pub fn offload_throughput_change_pct() -> f64 {
    (OFFLOAD_THROUGHPUT / OFF_THROUGHPUT - 1.0) * 100.0
}
