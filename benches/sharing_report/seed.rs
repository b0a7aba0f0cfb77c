//! The seed system's figures for memory sharing, the ones to compare with.
//!
//! From the seed (pvisor), one run per cell: four 512 MiB VMs running a Linux guest, each with
//! 64 MiB of application data; per-instance memory = the VMs' PSS over four. Its unshared
//! baseline was about 133 MiB per instance (a Linux kernel and its page cache beside the data),
//! ours is a few MiB above the data (a 2 KiB workload guest), so savings are compared as
//! percentages, not MiB. KSM was read 60 s after the data was written ("in a 2 s window it
//! saved about 0.5%"); rewrites were read with a short window.

use crate::{Content, Mode};

/// A sharing mechanism of the seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum System {
    /// Copy-on-write restore of one sealed snapshot.
    SnapshotCow,
    /// KSM.
    Ksm,
    /// A memory-pool daemon.
    Pool,
}

impl System {
    pub const ALL: [System; 3] = [System::SnapshotCow, System::Ksm, System::Pool];

    pub fn describe(self) -> &'static str {
        match self {
            System::SnapshotCow => "snapshot COW",
            System::Ksm => "KSM (after 60 s)",
            System::Pool => "memory pool",
        }
    }

    /// Savings per instance, %, by content (`Content::ALL` order): before any rewrite, and
    /// after the 100% rewrite.
    fn savings(self) -> ([f64; 3], [f64; 3]) {
        match self {
            System::SnapshotCow => ([68.6, 67.9, 31.2], [31.3, 30.4, 31.7]),
            System::Ksm => ([63.6, 51.7, 16.0], [15.3, 15.2, 16.9]),
            System::Pool => ([53.7, 39.6, 6.5], [3.5, 2.7, 6.1]),
        }
    }

    /// The seed's saving per instance for `content`, % (`rewritten`: after the 100% rewrite).
    pub fn saving(self, content: Content, rewritten: bool) -> f64 {
        let (initial, after) = self.savings();
        let row = if rewritten { after } else { initial };
        let i = Content::ALL
            .iter()
            .position(|&c| c == content)
            .expect("every content is in Content::ALL");
        row[i]
    }
}

/// The seed's mechanism a mode is compared with, if it had one.
pub fn system(mode: Mode) -> Option<System> {
    match mode {
        Mode::None => None,
        Mode::Ksm => Some(System::Ksm),
        Mode::Snapshot => Some(System::SnapshotCow),
        Mode::Pool => Some(System::Pool),
    }
}

/// The seed's KSM saving in a 2 s window, % (about).
pub const KSM_2S_PCT: f64 = 0.5;

/// The seed's unshared memory per instance, MiB (about).
pub const BASELINE_MIB: f64 = 133.0;
