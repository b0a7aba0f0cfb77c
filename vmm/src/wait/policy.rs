//! The wait policy's knobs (`--vm-wait-*`) and which wait sources it manages.

use std::time::Duration;

/// The policy's knobs.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WaitPolicy {
    /// Wait (with an idle guest) before pausing.
    pub pause_after: Duration,
    /// Wait before offloading a paused VM.
    pub offload_after: Duration,
    /// Offload only if the guest's next timer is at least this far away.
    pub min_timer_budget: Duration,
    /// Least time between two offloads.
    pub offload_cooldown: Duration,
    /// The strategy offloads at all (else it only pauses).
    pub offload: bool,
    /// Offload only if the wait's expected remaining time is at least this many times what an
    /// offload of this VM takes (0: whenever the other rules allow). An offload costs about
    /// as much again when the RAM comes back, and the memory it frees only pays for the CPU
    /// and the delay if the wait goes on well past both.
    #[serde(default = "default_break_even")]
    pub break_even: f64,
    /// How the RAM comes back after an offload: `faults` (only what the guest touches; the
    /// rest stays in the store and costs the next offload nothing; the default) or `lazy`
    /// (faults, and a prefetcher brings the rest back).
    #[serde(default = "default_reload")]
    pub reload: uffd_pager::load::LoadMode,
    /// When the first bytes of the answer arrive while the VM is offloaded, start bringing its
    /// recorded working set back (the blocks the guest faulted in after its last resumes)
    /// while the rest of the answer streams in, rather than on the guest's faults after it.
    #[serde(default = "default_warm")]
    pub warm: bool,
    /// Which waits are managed (the others the VM only waits through).
    #[serde(default)]
    pub sources: Sources,
}

/// The wait sources of the seed: which of them a policy manages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Sources {
    /// Model answers.
    pub model: bool,
    /// Downloads' chunks.
    pub download: bool,
    /// Image reads.
    pub read: bool,
}

impl Default for Sources {
    fn default() -> Self {
        Self {
            model: true,
            download: true,
            read: true,
        }
    }
}

impl Sources {
    /// Parses `model,download,read` (any of them, at least one; `all` for the three).
    pub fn parse(text: &str) -> Result<Self, String> {
        if text == "all" {
            return Ok(Self::default());
        }
        let mut sources = Self {
            model: false,
            download: false,
            read: false,
        };
        for word in text.split(',').map(str::trim) {
            match word {
                "model" => sources.model = true,
                "download" => sources.download = true,
                "read" => sources.read = true,
                other => {
                    return Err(format!(
                        "wait source `{other}`: expected model, download, read or all"
                    ))
                }
            }
        }
        Ok(sources)
    }
}

fn default_warm() -> bool {
    true
}

fn default_reload() -> uffd_pager::load::LoadMode {
    // Measured on the qutebrowser-667 trajectory (docs/waits.md): half the memory × time of
    // `lazy` for a window under 1% longer.
    uffd_pager::load::LoadMode::Faults
}

fn default_break_even() -> f64 {
    4.0
}

impl WaitPolicy {
    /// Every duration times `factor`: the policy for a replay whose waits were scaled by it.
    pub fn scaled(self, factor: f64) -> Self {
        let scale = |d: Duration| d.mul_f64(factor.max(0.0));
        Self {
            pause_after: scale(self.pause_after),
            offload_after: scale(self.offload_after),
            min_timer_budget: scale(self.min_timer_budget),
            offload_cooldown: scale(self.offload_cooldown),
            offload: self.offload,
            break_even: self.break_even,
            reload: self.reload,
            warm: self.warm,
            sources: self.sources,
        }
    }
}

impl Default for WaitPolicy {
    fn default() -> Self {
        Self {
            pause_after: Duration::from_millis(20),
            offload_after: Duration::from_millis(50),
            min_timer_budget: Duration::from_secs(1),
            offload_cooldown: Duration::from_secs(5),
            offload: true,
            break_even: default_break_even(),
            reload: default_reload(),
            warm: default_warm(),
            sources: Sources::default(),
        }
    }
}
