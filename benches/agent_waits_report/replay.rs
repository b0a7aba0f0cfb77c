//! One run: `pvisor replay TRAJECTORY --vms N --strategy S --memory SIZE --sample-ms MS --json
//! --samples FILE`, as a user would type it, and what it gave: its exit status, the JSON
//! summary on its last stdout line, and its memory samples summed over the VMs.
//!
//! The figures of a run (`KEY` = `nN.STRATEGY.QUANTITY`, see `key`): `guest_pss_gib_s` and
//! `cgroup_gib_s` (memory × time per task), `window_s` (release to the last VM's end),
//! `completion_mean_s` and `completion_min_s` (over the VMs), `throughput_per_min`,
//! `requests_served`, `exit_status`, the sampling's `samples`,
//! `largest_gap_s`, `long_gaps`, `dropped` and `sampling_passed`, wait management's
//! `offloads`, `offload_ms`, `skipped_for_cooldown` and `skipped_for_gain` (summed over the
//! VMs), `wall_s` (the whole command, VM starts and stops included); and its integrity,
//! recorded by `common::scenario` (`integrity_passed`, `sampling_only`, `results_digest.…`).

use std::path::Path;

use crate::common::replay::{Outcome, Replay};
use crate::common::results::Results;
use crate::common::Res;
use crate::{Settings, Strategy};

/// `nN.STRATEGY.QUANTITY`.
pub fn key(vms: usize, strategy: Strategy, quantity: &str) -> String {
    format!("n{vms}.{}.{quantity}", strategy.key())
}

/// Runs `pvisor replay` for `vms` VMs under `strategy`, its samples written to `samples`.
/// An error only when the command cannot be started or its output read.
pub fn run(settings: &Settings, vms: usize, strategy: Strategy, samples: &Path) -> Res<Outcome> {
    let (name, config) = strategy.replay_args();
    Replay {
        pvisor: &settings.pvisor,
        trajectory: &settings.trajectory,
        vms,
        strategy: name,
        config: config.map(|config| (strategy.key(), config)),
        budget: None,
        memory: settings.memory,
        sample_ms: settings.sample_ms,
        stagger_ms: 0,
        limit: settings.run_limit,
    }
    .run(samples, None)
}

/// Records `outcome` as round `round` of `vms` VMs under `strategy`.
pub fn record(
    outcome: &Outcome,
    vms: usize,
    strategy: Strategy,
    round: usize,
    results: &mut Results,
) {
    let mut put = |quantity: &str, unit: &'static str, value: f64| {
        results.put(&key(vms, strategy, quantity), unit, round, value);
    };
    // Besides the figures every replay bench keeps (`common::replay::SUMMARY_FIGURES`): the
    // VM processes' CPU and the replay's own (sampler, model server) apart, the throughput,
    // the sampling's record, what wait management did (summed over the VMs; NaN without
    // it), how soon batches reached the guests, and the waits by source (issue 38).
    let more: [(&str, &'static str, &[&str]); 17] = [
        ("cpu_s", "s", &["cpu", "vms_s"]),
        ("replay_cpu_s", "s", &["cpu", "replay_s"]),
        (
            "throughput_per_min",
            "tasks/min",
            &["throughput_tasks_per_min"],
        ),
        ("long_gaps", "gaps", &["sampling", "long_gaps"]),
        ("dropped", "readings", &["sampling", "dropped"]),
        ("offload_ms", "ms", &["wait", "offload_ms"]),
        (
            "skipped_for_cooldown",
            "waits",
            &["wait", "skipped_for_cooldown"],
        ),
        ("skipped_for_gain", "waits", &["wait", "skipped_for_gain"]),
        ("batches", "batches", &["wait", "batches"]),
        ("batch_delay_us", "µs", &["wait", "batch_delay_us"]),
        ("batches_late", "batches", &["wait", "batches_late"]),
        ("model_wait_s", "s", &["sources", "model", "wait_s"]),
        (
            "model_offloads",
            "offloads",
            &["sources", "model", "offloads"],
        ),
        ("download_wait_s", "s", &["sources", "download", "wait_s"]),
        (
            "download_offloads",
            "offloads",
            &["sources", "download", "offloads"],
        ),
        ("read_wait_s", "s", &["sources", "read", "wait_s"]),
        (
            "read_offloads",
            "offloads",
            &["sources", "read", "offloads"],
        ),
    ];
    outcome.figures(&more, &mut put);
    let passed = outcome
        .summary
        .as_ref()
        .map(|s| s["sampling"]["passed"] == true);
    put(
        "sampling_passed",
        "1 = passed",
        passed.map_or(f64::NAN, |ok| if ok { 1.0 } else { 0.0 }),
    );
    // What one offload took, over all the VMs' offloads.
    let offloads = outcome.number(&["wait", "offloads"]);
    if offloads > 0.0 {
        put(
            "ms_per_offload",
            "ms",
            outcome.number(&["wait", "offload_ms"]) / offloads,
        );
    }
    let completions = outcome.completions();
    if !completions.is_empty() {
        let mean = completions.iter().sum::<f64>() / completions.len() as f64;
        let min = completions.iter().copied().fold(f64::INFINITY, f64::min);
        put("completion_mean_s", "s", mean);
        put("completion_min_s", "s", min);
    }
}
