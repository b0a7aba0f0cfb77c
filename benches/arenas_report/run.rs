//! One run: `pvisor replay TRAJECTORY --vms N --strategy S --memory SIZE --sample-ms MS --json
//! --samples FILE` in the bench's CPU group (`common::replay::Replay`), and its figures.
//!
//! The figures of a run (`KEY` = `STRATEGY.QUANTITY`, see `key`): `guest_pss_gib_s` and
//! `cgroup_gib_s` (memory × time per task, from the replay's summary), `window_s` (release
//! to the last VM's end), `cpu_s` (user + system of the replay, its VMs and all they start),
//! `integrity_passed` (1 or 0), `exit_status`, `requests_served`, the sampling's `samples` and
//! `largest_gap_s`, wait management's `offloads` (summed over the VMs; NaN without it), and
//! `wall_s` (the whole command, VM starts and stops included).

use std::path::Path;

use crate::common::cpu::CpuGroup;
use crate::common::replay::{Outcome, Replay};
use crate::common::results::Results;
use crate::common::Res;
use crate::{Log, Settings, Strategy};

pub use crate::common::replay::NO_DIGEST;

/// `STRATEGY.QUANTITY`.
pub fn key(strategy: Strategy, quantity: &str) -> String {
    format!("{}.{quantity}", strategy.key())
}

/// Runs `pvisor replay` under `strategy` in `cpu`'s group, its samples written to `samples`.
/// An error only when the command cannot be started or its output read.
pub fn run(
    settings: &Settings,
    strategy: Strategy,
    samples: &Path,
    cpu: &CpuGroup,
) -> Res<Outcome> {
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
    .run(samples, Some(cpu))
}

/// The numbers of the replay's summary the bench keeps: (quantity, unit, path in the summary).
const SUMMARY_NUMBERS: [(&str, &str, &[&str]); 7] = [
    (
        "guest_pss_gib_s",
        "GiB·s per task",
        &["guest_pss_gib_s_per_task"],
    ),
    (
        "cgroup_gib_s",
        "GiB·s per task",
        &["cgroup_mem_gib_s_per_task"],
    ),
    ("window_s", "s", &["completion_window_s"]),
    ("requests_served", "requests", &["model_requests_served"]),
    ("samples", "samples", &["sampling", "samples"]),
    ("largest_gap_s", "s", &["sampling", "largest_gap_s"]),
    ("offloads", "offloads", &["wait", "offloads"]),
];

/// Records `outcome` as round `round` under `strategy`.
pub fn record(
    outcome: Outcome,
    strategy: Strategy,
    round: usize,
    results: &mut Results,
    log: &mut Log,
) {
    let passed = outcome.passed();
    let code = outcome
        .status
        .and_then(|s| s.code())
        .map_or(f64::NAN, f64::from);
    let cpu = outcome.cpu.map_or(f64::NAN, |c| c.total_s());
    let mut figures = vec![
        (
            "integrity_passed",
            "1 = passed",
            f64::from(u8::from(passed)),
        ),
        ("exit_status", "code", code),
        ("wall_s", "s", outcome.wall_s),
        ("cpu_s", "CPU s", cpu),
    ];
    figures.extend(
        SUMMARY_NUMBERS
            .iter()
            .map(|&(quantity, unit, path)| (quantity, unit, outcome.number(path))),
    );
    for (quantity, unit, value) in figures {
        results.put(&key(strategy, quantity), unit, round, value);
    }
    log.sampling_only += usize::from(outcome.sampling_only());
    if !passed {
        log.failures.push(format!(
            "round {}, {}: {}",
            round + 1,
            strategy.key(),
            outcome.failure()
        ));
    }
    *log.digests.entry(outcome.results_digest()).or_default() += 1;
    log.summaries += usize::from(outcome.summary.is_some());
    if let Some(timeline) = outcome.timeline {
        log.timelines.insert((strategy, round), timeline);
    }
}
