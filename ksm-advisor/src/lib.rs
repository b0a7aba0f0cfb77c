//! KSM for VM memory: advise guest RAM as mergeable and check that the advice took, tune the
//! kernel's global knobs for fast merging under a CPU budget (and give the host its own
//! settings back when the last VM that asked is gone), report what KSM merged, and estimate
//! from page hashes what it would save before switching it on.
//!
//! - [`sys`]: the global knobs and counters under `/sys/kernel/mm/ksm`, ksmd's CPU time.
//! - [`process`]: per-process eligibility, `MADV_MERGEABLE` / `PR_SET_MEMORY_MERGE`, the `mg`
//!   check, `/proc/PID/ksm_stat`.
//! - [`tune`]: fast profiles and the shared, crash-safe lease on the global knobs.
//! - [`estimate`]: content-sampled duplicate estimate of resident memory.

// Library code does not print (clippy.toml's `disallowed-macros`); its tests may.
#![cfg_attr(not(test), warn(clippy::disallowed_macros))]

pub mod estimate;
pub mod process;
pub mod sys;
pub mod tune;

pub use process::{Coverage, ProcessKsm};
pub use sys::{GlobalStats, Ksm};
pub use tune::{Profile, Tuning};
