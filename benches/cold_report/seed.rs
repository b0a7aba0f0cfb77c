//! The seed system's figures for live cold-RAM compression, the ones to beat.
//!
//! From `seeds/004_*.txt` (pvisor, "一台 512 MiB VM" and the paragraph after it): a 512 MiB VM
//! with 2 vCPUs running a Linux guest, 64 MiB of application data, one run per cell (N=1), read
//! 5 seconds after the operation, resident memory = PSS of the VM and its management process;
//! saving = (default − cold) ÷ default. Its pager compressed private anonymous RAM only
//! (`REFERENCE.md`). Later published: live cold compression cost +184–210% memory (no saving).

use crate::Case;

/// The seed's resident MiB of one case: the default VM and the VM with
/// `--vm-cold-ram-compression`.
#[derive(Debug, Clone, Copy)]
pub struct SeedFigure {
    pub default_mib: f64,
    pub cold_mib: f64,
}

impl SeedFigure {
    /// Change of the cold VM over the default one, % (negative: a saving).
    pub fn change_pct(self) -> f64 {
        (self.cold_mib / self.default_mib - 1.0) * 100.0
    }
}

pub fn figure(case: Case) -> SeedFigure {
    let (default_mib, cold_mib) = match case {
        // "重复内容常驻为 147.2 MiB" against the default 181.4: saves 18.9%.
        Case::Repeated => (181.4, 147.2),
        // "随机内容为 212.1 MiB" against 179.4: costs 18.2%.
        Case::Random => (179.4, 212.1),
        // "压缩不同页面为 146.4 MiB … 对应默认常驻为 179.8": saves 18.6%.
        Case::Distinct => (179.8, 146.4),
        // "冷热混合为 158.3 MiB … 177.8": saves 11.0%.
        Case::HotCold => (177.8, 158.3),
    };
    SeedFigure {
        default_mib,
        cold_mib,
    }
}

/// The later published range of the seed's cost, % of the default run's memory.
pub const LATER_COST_PCT: (f64, f64) = (184.0, 210.0);
