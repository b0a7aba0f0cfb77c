//! The ratios derived run by run, and the targets of issues 3, 14 and 36 as data, judged.

use crate::common::results::{sig3, Results};
use crate::common::verdict::{result, Target, Verdict, PASS_FAIL};
use crate::resume::{self, RESUMES};
use crate::Settings;

/// Adds the per-run ratios the targets and the report use.
pub fn derive(results: &mut Results, settings: &Settings) {
    for source in ["lz4", "zstd", "zero"] {
        for what in ["touch_p50_us", "pager_p50_us", "touch_p99_us"] {
            results.ratio(
                &format!("ratio.latency.{source}_over_raw.{what}"),
                &format!("latency.{source}.t1.c1.{what}"),
                &format!("latency.raw.t1.c1.{what}"),
                "×",
            );
        }
    }
    for touch in ["lazy", "full"] {
        for ours in ["ours_raw", "ours_lz4", "ours_raw_huge", "ours_lz4_huge"] {
            results.ratio(
                &format!("ratio.restore.{touch}.firecracker_over_{ours}"),
                &format!("restore.{touch}.firecracker.ms"),
                &format!("restore.{touch}.{ours}.ms"),
                "×",
            );
        }
    }
    // Issue 36: on 2 MiB pages, ours against the example-style handler on 2 MiB pages too.
    for touch in ["lazy", "full"] {
        for ours in ["ours_raw_huge", "ours_lz4_huge"] {
            results.ratio(
                &format!("ratio.restore.{touch}.{ours}_over_firecracker_huge"),
                &format!("restore.{touch}.{ours}.ms"),
                &format!("restore.{touch}.firecracker_huge.ms"),
                "×",
            );
        }
    }
    for content in ["mixed", "full"] {
        results.ratio(
            &format!("ratio.offload.{content}.lz4_over_none"),
            &format!("offload.{content}.lz4.ms"),
            &format!("offload.{content}.none.ms"),
            "×",
        );
    }
    for head in [0, settings.head_start_ms] {
        for later in 2..=RESUMES {
            for (quantity, suffix) in [("sync_faults", ""), ("thread_faults", ".thread_faults")] {
                results.ratio(
                    &format!("ratio.resume.h{head}.first_over_r{later}{suffix}"),
                    &format!("{}.{quantity}", resume::key(head, 1)),
                    &format!("{}.{quantity}", resume::key(head, later)),
                    "×",
                );
            }
        }
    }
}

/// A target of the report: the figure judged against it, its words, and what its figure says
/// after the spread; with a `chart` label, a row of the chart's panel of targets.
pub struct Goal {
    pub target: Target,
    words: String,
    /// The figure's unit after its median (`×`, ` ms`).
    unit: &'static str,
    note: String,
    pub chart: Option<String>,
}

impl Goal {
    fn new(target: Target, words: String, note: String, chart: Option<String>) -> Self {
        let unit = "×";
        Self {
            target,
            words,
            unit,
            note,
            chart,
        }
    }

    /// "1.23× (median of 5; min 1.1, max 1.4; 4 of 5 runs meet it)" and the note.
    fn verdict(&self, results: &Results) -> Verdict {
        let (s, meeting, result) = self.target.judge(results, PASS_FAIL);
        let (median, min, max) = (sig3(s.median), sig3(s.min), sig3(s.max));
        let (unit, n, note) = (self.unit, s.n, &self.note);
        let figure = format!(
            "{median}{unit} (median of {n}; min {min}, max {max}; {meeting} of {n} runs meet \
             it){note}"
        );
        let target = self.words.clone();
        Verdict {
            target,
            figure,
            result,
        }
    }
}

/// Issue 36: the longest a guest's fault may wait across a SIGTERM upgrade, ms.
pub const UPGRADE_STALL_MS: f64 = 10.0;

/// Every target judged on a median, in the report's order.
pub fn goals(results: &Results, settings: &Settings) -> Vec<Goal> {
    let image = settings.image >> 20;
    let median = |key: &str| sig3(results.summary(key).median);
    let pager = results.summary("ratio.latency.lz4_over_raw.pager_p50_us");
    let mut out = vec![Goal::new(
        Target::at_most("ratio.latency.lz4_over_raw.touch_p50_us", 1.3),
        "lz4-compressed fault p50 ≤ 1.3× raw-file fault p50 (touching thread)".into(),
        format!(
            ", lz4 p50 / raw p50; by the pager's histogram {}× (min {}, max {})",
            sig3(pager.median),
            sig3(pager.min),
            sig3(pager.max)
        ),
        Some("lz4 / raw fault p50".into()),
    )];
    for (ours, what, chart) in [
        ("ours_raw", "raw file, like for like", Some("ours raw")),
        ("ours_lz4", "lz4 store", Some("ours lz4")),
        ("ours_raw_huge", "raw file, on 2 MiB pages", None),
        ("ours_lz4_huge", "lz4 store, on 2 MiB pages", None),
    ] {
        out.push(Goal::new(
            Target::at_least(format!("ratio.restore.full.firecracker_over_{ours}"), 3.0),
            format!(
                "full restore of {image} MiB ≥ 3× faster than the Firecracker-style handler on 4 KiB \
                 pages (ours from the {what})"
            ),
            ", Firecracker-style time / our time".into(),
            chart.map(|c| format!("full restore: Firecracker-style / {c}")),
        ));
    }
    for (ours, what, limit) in [
        ("ours_raw_huge", "raw file", 1.05),
        ("ours_lz4_huge", "lz4 store", 1.3),
    ] {
        out.push(Goal::new(
            Target::at_most(format!("ratio.restore.full.{ours}_over_firecracker_huge"), limit),
            format!(
                "full restore of {image} MiB on 2 MiB pages ≤ {limit}× the Firecracker-style handler's \
                 on 2 MiB pages (ours from the {what})"
            ),
            ", our time / Firecracker-style time".into(),
            None,
        ));
    }
    let mixed = format!(
        "{} MiB repeated + {} MiB random in {image} MiB",
        settings.repeated >> 20,
        settings.random >> 20,
    );
    let full = format!("{image} MiB fully written");
    for (content, what) in [("mixed", mixed), ("full", full)] {
        out.push(Goal::new(
            Target::at_most(format!("ratio.offload.{content}.lz4_over_none"), 1.5),
            format!("compressed (lz4) offload time ≤ 1.5× raw offload time ({what})"),
            ", lz4 time / raw time, write + commit + drop".into(),
            Some(format!("offload lz4 / raw time, {content}")),
        ));
    }
    for head in [settings.head_start_ms, 0] {
        let faults = |r| median(&format!("{}.sync_faults", resume::key(head, r)));
        let ratio = format!("ratio.resume.h{head}.first_over_r2");
        out.push(Goal::new(
            Target::at_least(&ratio, 2.0),
            format!("second resume takes ≥ 2× fewer synchronous faults than the first ({head} ms head start)"),
            format!(
                ", first / second `faults_copy + faults_zero`; median {} vs {} faults. Counting every \
                 fault the touching thread waited for (also those the prefetcher resolved while it \
                 waited): {}×",
                faults(1),
                faults(2),
                median(&format!("{ratio}.thread_faults")),
            ),
            Some(match head {
                0 => "resume 1 / 2 sync faults, no head".to_owned(),
                h => format!("resume 1 / 2 sync faults, {h} ms head"),
            }),
        ));
    }
    // Issue 36: a SIGTERM upgrade stalls a guest's faults for milliseconds.
    out.push(Goal {
        unit: " ms",
        ..Goal::new(
            Target::at_most("upgrade.upgrade.longest_read_ms", UPGRADE_STALL_MS),
            format!(
                "a SIGTERM upgrade of `uffd-pager serve` stalls the guest's faults ≤ {UPGRADE_STALL_MS} ms \
                 (its longest page read across the upgrade)"
            ),
            format!(
                "; without an upgrade {} ms; the old server exited {} ms after SIGTERM, the new one \
                 listened at {} ms (medians)",
                median("upgrade.baseline.longest_read_ms"),
                median("upgrade.upgrade.exit_ms"),
                median("upgrade.upgrade.listening_ms"),
            ),
            None,
        )
    });
    out
}

/// Issue 14, judged on the worst run: the touching thread's synchronous faults per 64 MiB
/// touched in a lazy restore on 2 MiB pages (`who`), at most 64.
fn lazy_huge(results: &Results, settings: &Settings, who: &str) -> Verdict {
    let per_64 = 64.0 * f64::from(1u32 << 20) / settings.lazy_total as f64;
    let faults = results.summary(&format!("restore.lazy.{who}.faults"));
    let worst = faults.max * per_64;
    Verdict {
        target: format!(
            "lazy restore on 2 MiB pages ({}): ≤ 64 synchronous faults per 64 MiB touched",
            who.trim_start_matches("ours_").trim_end_matches("_huge")
        ),
        figure: format!(
            "{} per 64 MiB (min {}, max {}) over {} runs",
            sig3(faults.median * per_64),
            sig3(faults.min * per_64),
            sig3(worst),
            faults.n
        ),
        result: result(!worst.is_nan(), worst <= 64.0, PASS_FAIL),
    }
}

/// The verdicts of the report's table: the goals, issue 14's before the offload's.
pub fn verdicts(results: &Results, settings: &Settings) -> Vec<Verdict> {
    let goals = goals(results, settings);
    let offload = goals
        .iter()
        .position(|g| g.target.key.starts_with("ratio.offload."))
        .unwrap_or(goals.len());
    let mut out: Vec<Verdict> = goals.iter().map(|g| g.verdict(results)).collect();
    let lazy = ["ours_raw_huge", "ours_lz4_huge"].map(|who| lazy_huge(results, settings, who));
    out.splice(offload..offload, lazy);
    out
}
