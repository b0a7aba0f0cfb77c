//! What `pvisor replay` says when it is done, in words, read from its JSON summary: the
//! headline, the harness, what wait management did, what the offloads wrote, the waits by
//! source, the governor's decisions and every failure.

use serde_json::Value;

/// Prints the lines of `summary` (as `run_replay` builds it) on standard output; fails only
/// if standard output is closed.
pub(super) fn print(summary: &Value) -> Result<(), basics::output::StdoutClosed> {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    let u = |v: &Value| v.as_u64().unwrap_or(0);
    let sampling = &summary["sampling"];
    basics::say!(
        "replay {}: {} VM(s), {}: window {:.2} s, memory charged×time {:.4} GiB·s per task \
         (guest PSS×time {:.4}), {} samples (largest gap {:.3} s, {} dropped); integrity {}",
        summary["trajectory"].as_str().unwrap_or_default(),
        u(&summary["vms"]),
        summary["strategy"].as_str().unwrap_or_default(),
        f(&summary["completion_window_s"]),
        f(&summary["memory_charged_gib_s_per_task"]),
        f(&summary["guest_pss_gib_s_per_task"]),
        u(&sampling["samples"]),
        f(&sampling["largest_gap_s"]),
        u(&sampling["dropped"]),
        if summary["integrity_passed"].as_bool() == Some(true) {
            "passed"
        } else {
            "FAILED"
        }
    );
    let harness = &summary["harness"];
    basics::say!(
        "  harness: {} sampling threads, a tick {:.2} ms mean, {:.2} ms p99, {:.2} ms max \
         ({} PSS readings), {:.2} s CPU; this process {:.2} s CPU in all, the VMs {:.2} s",
        u(&harness["threads"]),
        f(&harness["tick_mean_ms"]),
        f(&harness["tick_p99_ms"]),
        f(&harness["tick_max_ms"]),
        u(&harness["pss_reads"]),
        f(&harness["cpu_s"]),
        f(&summary["cpu"]["replay_s"]),
        f(&summary["cpu"]["vms_s"]),
    );
    let wait = &summary["wait"];
    if wait.as_object().is_some_and(|w| !w.is_empty()) {
        let n = |k: &str| u(&wait[k]);
        #[allow(clippy::cast_precision_loss, reason = "counts of one run")]
        let delay_ms = n("batch_delay_us") as f64 / 1e3 / n("batches").max(1) as f64;
        basics::say!(
            "  wait management, all VMs: {} pauses, {} offloads ({} ms in all), {} warm-ups, {} \
             batches delivered ({delay_ms:.1} ms after they became deliverable on average, {} \
             over 20 ms), skipped {} for the cooldown, {} for the guest's timer, {} as not \
             paying; {} failed offloads, {} failed loads",
            n("pauses"),
            n("offloads"),
            n("offload_ms"),
            n("warms"),
            n("batches"),
            n("batches_late"),
            n("skipped_for_cooldown"),
            n("skipped_for_timer"),
            n("skipped_for_gain"),
            n("failed_offloads"),
            n("failed_loads"),
        );
    }
    let pages = &summary["offloaded_pages"];
    if let (Some(written), Some(clean)) = (
        pages["pages_offloaded"].as_u64(),
        pages["pages_clean"].as_u64(),
    ) {
        #[allow(clippy::cast_precision_loss, reason = "pages of one run")]
        let mib = |pages: u64| (pages * uffd_pager::addr::PAGE_SIZE) as f64 / f64::from(1 << 20);
        basics::say!(
            "  offloads, all VMs: {:.1} MiB written, {:.1} MiB dropped clean (the store held \
             it as it was)",
            mib(written),
            mib(clean)
        );
    }
    let sources = &summary["sources"];
    if sources.as_object().is_some_and(|s| !s.is_empty()) {
        let part = |name: &str| {
            let s = &sources[name];
            let n = |k: &str| u(&s[k]);
            format!(
                "{name} {} waits, {:.1} s, {} offloads (skipped {} for the cooldown, {} as not \
                 paying), {} parts handed over early ({} over 20 ms)",
                n("waits"),
                f(&s["wait_s"]),
                n("offloads"),
                n("skipped_for_cooldown"),
                n("skipped_for_gain"),
                n("batches"),
                n("batches_late"),
            )
        };
        basics::say!(
            "  waits by source, all VMs: {}; {}; {}",
            part("model"),
            part("download"),
            part("read")
        );
    }
    let governor = &summary["governor"];
    if !governor.is_null() {
        basics::say!(
            "  memory governor: {}",
            governor
                .get("decisions")
                .map_or_else(|| governor.to_string(), ToString::to_string)
        );
    }
    for failure in summary["failures"].as_array().into_iter().flatten() {
        basics::say!("  {}", failure.as_str().unwrap_or_default());
    }
    Ok(())
}
