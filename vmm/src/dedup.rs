//! `--vm-ram-dedup`: guest RAM marked mergeable for KSM, KSM tuned for fast merging while any
//! such VM runs (the host's settings come back when the last one exits), and what KSM merged
//! reported in `stats`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ksm_advisor::process::{self, ProcessError};
use ksm_advisor::sys::{self, SysError};
use ksm_advisor::tune::{Profile, TuneError, Tuning};
use ksm_advisor::{GlobalStats, Ksm};

use crate::memory::GuestRam;

/// How long KSM scans at full speed after a VM ran a command (which may have written memory);
/// after that, ksmd drops to its idle rate (`Profile::idle`). Four VMs × 64 MiB merge in
/// about a second at full speed.
pub const BOOST: Duration = Duration::from_secs(5);

/// How a VM's RAM is deduplicated.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DedupOptions {
    /// Share of one core ksmd may use while it merges.
    pub cpu_budget: f64,
    /// Where the shared tuning lease lives.
    pub state_dir: PathBuf,
}

impl Default for DedupOptions {
    fn default() -> Self {
        Self {
            cpu_budget: 0.5,
            state_dir: ksm_advisor::tune::DEFAULT_STATE_DIR.into(),
        }
    }
}

/// Errors setting dedup up.
#[derive(Debug, thiserror::Error)]
pub enum DedupError {
    /// KSM is missing or its knobs cannot be read.
    #[error("KSM is not usable")]
    Sys(#[from] SysError),
    /// The RAM cannot be advised.
    #[error("guest RAM cannot be made mergeable")]
    Advise(#[from] ProcessError),
    /// The knobs could not be tuned.
    #[error("KSM cannot be tuned")]
    Tune(#[from] TuneError),
}

/// What KSM did for this VM (one VM per process: the process's counters are the VM's).
#[derive(Debug, Clone, serde::Serialize)]
pub struct DedupStats {
    /// Guest RAM marked mergeable (`mg` in smaps).
    pub advised_bytes: u64,
    /// Pages of this VM that KSM maps to a shared page.
    pub merging_pages: u64,
    /// Bytes KSM saves in this VM minus its metadata, as the kernel counts them.
    pub process_profit_bytes: i64,
    /// Pages KSM tracks for this VM.
    pub rmap_items: u64,
    /// Host-wide counters.
    pub global: GlobalStats,
    /// CPU seconds ksmd has used since boot.
    pub ksmd_cpu_seconds: Option<f64>,
}

/// Dedup of one VM's RAM, for as long as it lives.
#[derive(Debug)]
pub struct Dedup {
    ksm: Ksm,
    start: u64,
    len: u64,
    tuning: Tuning,
    /// When the boost this VM asked for ends (it governs KSM until then).
    boosted_until: Option<Instant>,
}

impl Dedup {
    /// Marks all of `ram` mergeable (checking that the kernel shows it), then takes a share of
    /// the KSM tuning.
    pub fn start(ram: &GuestRam, options: &DedupOptions) -> Result<Self, DedupError> {
        let ksm = Ksm::system()?;
        let start = ram.host_base().0;
        process::advise(start, ram.size())?;
        let profile = Profile::for_cpu_share(options.cpu_budget);
        let tuning = Tuning::acquire(&ksm, &options.state_dir, &profile.knobs(&ksm))?
            .with_idle(Profile::idle().knobs(&ksm));
        let mut dedup = Self {
            ksm,
            start,
            len: ram.size(),
            tuning,
            boosted_until: None,
        };
        dedup.wrote();
        Ok(dedup)
    }

    /// The guest ran and may have written: KSM scans at full speed for [`BOOST`].
    pub fn wrote(&mut self) {
        // Best effort: KSM keeps its current settings if the state cannot be written.
        if self.tuning.boost(BOOST).is_ok() {
            self.boosted_until = Some(Instant::now() + BOOST);
        }
    }

    /// How long until [`Dedup::govern`] is due (`None`: nothing to do until the next write).
    pub fn wait(&self) -> Option<Duration> {
        self.boosted_until
            .map(|until| until.saturating_duration_since(Instant::now()))
    }

    /// Once this VM's boost is over, lets KSM drop to its idle rate unless another VM's boost
    /// still runs (then it looks again when that one ends).
    pub fn govern(&mut self) {
        if self.wait() != Some(Duration::ZERO) {
            return;
        }
        self.boosted_until = match self.tuning.govern() {
            Ok(left) if left > Duration::ZERO => Some(Instant::now() + left),
            _ => None,
        };
    }

    /// The current counters (zeros where a file cannot be read).
    pub fn stats(&self) -> DedupStats {
        let own = process::ksm_stat(None).unwrap_or_default();
        DedupStats {
            advised_bytes: process::coverage(None, self.start, self.len)
                .map_or(0, |c| c.advised_bytes),
            merging_pages: own.merging_pages,
            process_profit_bytes: own.process_profit,
            rmap_items: own.rmap_items,
            global: self.ksm.stats().unwrap_or_default(),
            ksmd_cpu_seconds: sys::ksmd_cpu_seconds(),
        }
    }
}
