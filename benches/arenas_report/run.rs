//! One run: `pvisor replay TRAJECTORY --vms N --strategy S --memory SIZE --sample-ms MS --json
//! --samples FILE` in the bench's CPU group (`common::replay::Replay`), and its figures.
//!
//! The figures of a run (`KEY` = `STRATEGY.QUANTITY`, see `key`): `charged_gib_s` (memory
//! charged, the headline), `guest_pss_gib_s` and `cgroup_gib_s` (memory × time per task, from
//! the replay's summary), `window_s` (release to the last VM's end), `cpu_s` (user + system of
//! the replay, its VMs and all they start), `exit_status`, `requests_served`, the sampling's
//! `samples` and `largest_gap_s`, wait management's `offloads` (summed over the VMs; NaN
//! without it), and `wall_s` (the whole command, VM starts and stops included); and its
//! integrity, recorded by `common::scenario`.

use std::path::Path;

use crate::common::replay::{Outcome, Replay};
use crate::common::results::Results;
use crate::common::Res;
use crate::{Settings, Strategy};

/// `STRATEGY.QUANTITY`.
pub fn key(strategy: Strategy, quantity: &str) -> String {
    format!("{}.{quantity}", strategy.key())
}

/// Runs `pvisor replay` under `strategy` in the settings' CPU group, its samples written to
/// `samples`. An error only when the command cannot be started or its output read.
pub fn run(settings: &Settings, strategy: Strategy, samples: &Path) -> Res<Outcome> {
    Replay {
        pvisor: &settings.pvisor,
        trajectory: &settings.trajectory,
        vms: settings.vms,
        strategy: strategy.key(),
        config: None,
        budget: None,
        memory: settings.memory,
        sample_ms: settings.sample_ms,
        stagger_ms: 0,
        limit: settings.run_limit,
    }
    .run(samples, settings.cpu.as_ref())
}

/// Records `outcome` as round `round` under `strategy`: the figures every replay bench keeps
/// (`common::replay::SUMMARY_FIGURES`), and the CPU of the replay and all it started.
pub fn record(outcome: &Outcome, strategy: Strategy, round: usize, results: &mut Results) {
    let mut put = |quantity: &str, unit, value| {
        results.put(&key(strategy, quantity), unit, round, value);
    };
    put(
        "cpu_s",
        "CPU s",
        outcome.cpu.map_or(f64::NAN, |c| c.total_s()),
    );
    outcome.figures(&[], put);
}
