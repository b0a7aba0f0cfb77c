//! The policy's knobs ([`Config`], every one a flag of `pvisor serve --memory-governor`) and
//! the watermarks they make of the budget.

use std::time::Duration;

use super::MIB;

/// How many decision lines the log keeps.
pub const LOG_LINES: usize = 256;

/// The policy's knobs.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Config {
    /// The host memory budget, bytes: the hard limit of the VMs' parent cgroup.
    pub budget: u64,
    /// Usage is kept at or under this fraction of the budget.
    pub high_watermark: f64,
    /// A reclaim goes on until usage is at or under this fraction of the budget.
    pub low_watermark: f64,
    /// The least a grant adds to a limit, bytes.
    pub grant: u64,
    /// A grant also raises the limit up to the VM's learned peak, where that fits.
    pub grant_to_peak: bool,
    /// The limit a VM gets when it joins, if it fits (at least its resident).
    pub initial_limit: u64,
    /// A VM's overhead (cgroup usage beyond its resident guest RAM) until a reading says.
    pub default_overhead: u64,
    /// A VM silent this long is unreachable.
    pub stale_after: Duration,
    /// An order not reported in this time stops counting; its bytes are sought elsewhere.
    pub order_timeout: Duration,
    /// The cold age asked of running VMs under pressure; also the least time between two cold
    /// compressions of one VM (RAM gets no colder than that sooner).
    pub pressure_cold_age: Duration,
    /// PSI `some avg10` (percent) above which the host is under pressure.
    pub psi_threshold: f64,
    /// The expected remaining wait of a waiting VM that gives none, for the victim order.
    pub unknown_wait: Duration,
    /// A waiting or idle VM's limit this far above its resident is a reservation to revoke.
    pub revoke_slack: u64,
    /// A last-resort grant keeps usage at or under this share of the budget (0.95): the rest
    /// is for what no VM's accounting sees in time (the kernel's page and shadow tables, a
    /// reading a tick old).
    pub last_resort_watermark: f64,
    /// A VM's overhead is the largest seen over this long (5 s): it grows while the VM
    /// touches memory and its cgroup reading trails its resident figure.
    pub overhead_window: Duration,
    /// While another VM runs unheld (its step goes on towards a wait that frees its RAM), a
    /// held VM is preempted for the queue's head only once the head has waited this long
    /// (1 s).
    pub preempt_wait: Duration,
    /// What an offload is expected to leave resident, bytes (pacing only: the report corrects).
    pub offload_remainder: u64,
    /// The part of a running VM's resident a cold compression is expected to free (pacing
    /// only: the report corrects it; not measured: the cold bench frees 0–95% by content).
    pub cold_expect_fraction: f64,
    /// How many log lines [`Governor::status`] shows (the newest).
    pub status_log_lines: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            budget: 1 << 30,
            high_watermark: 0.90,
            low_watermark: 0.80,
            grant: 16 * MIB,
            grant_to_peak: true,
            initial_limit: 64 * MIB,
            default_overhead: 24 * MIB,
            stale_after: Duration::from_secs(5),
            order_timeout: Duration::from_secs(10),
            pressure_cold_age: Duration::from_millis(500),
            psi_threshold: 10.0,
            unknown_wait: Duration::from_secs(10),
            revoke_slack: 16 * MIB,
            last_resort_watermark: 0.95,
            overhead_window: Duration::from_secs(5),
            preempt_wait: Duration::from_secs(1),
            offload_remainder: 4 * MIB,
            cold_expect_fraction: 0.25,
            status_log_lines: 32,
        }
    }
}

impl Config {
    /// Refuses knobs the rules make no sense with.
    pub fn check(&self) -> Result<(), String> {
        if self.budget == 0 {
            return Err("the memory budget must be above 0".into());
        }
        if !(self.low_watermark > 0.0
            && self.low_watermark < self.high_watermark
            && self.high_watermark <= 1.0)
        {
            return Err(format!(
                "the watermarks must satisfy 0 < low < high <= 1 (low {}, high {})",
                self.low_watermark, self.high_watermark
            ));
        }
        if !(self.high_watermark <= self.last_resort_watermark && self.last_resort_watermark <= 1.0)
        {
            return Err(format!(
                "the last-resort watermark must be between the high watermark and 1 ({})",
                self.last_resort_watermark
            ));
        }
        if self.grant == 0 {
            return Err("the grant must be above 0".into());
        }
        if self.grant > self.budget {
            return Err(format!(
                "the grant ({} bytes) is larger than the budget ({} bytes)",
                self.grant, self.budget
            ));
        }
        if self.stale_after.is_zero() || self.order_timeout.is_zero() {
            return Err("stale_after and order_timeout must be above 0".into());
        }
        if !(self.psi_threshold >= 0.0 && self.psi_threshold <= 100.0) {
            return Err(format!(
                "the PSI threshold must be 0 to 100 (percent), not {}",
                self.psi_threshold
            ));
        }
        if !(0.0..=1.0).contains(&self.cold_expect_fraction) {
            return Err(format!(
                "cold_expect_fraction must be 0 to 1, not {}",
                self.cold_expect_fraction
            ));
        }
        Ok(())
    }

    pub(super) fn high_bytes(&self) -> u64 {
        fraction_of(self.budget, self.high_watermark)
    }

    pub(super) fn low_bytes(&self) -> u64 {
        fraction_of(self.budget, self.low_watermark)
    }

    pub(super) fn last_resort_bytes(&self) -> u64 {
        fraction_of(self.budget, self.last_resort_watermark)
    }
}

/// `fraction × bytes`, for a fraction in 0..=1 (checked by [`Config::check`]; clamped here).
#[allow(clippy::cast_sign_loss)] // clamped to 0..=1 first, so the product is not negative
pub(super) fn fraction_of(bytes: u64, fraction: f64) -> u64 {
    let f = if fraction.is_nan() {
        0.0
    } else {
        fraction.clamp(0.0, 1.0)
    };
    (bytes as f64 * f) as u64
}
