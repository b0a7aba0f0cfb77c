//! The ratios derived run by run, and the verdict on each target of issue 3.

use crate::results::{fmt, Results};
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
            results.ratio(
                &format!("ratio.resume.h{head}.first_over_r{later}"),
                &format!("{}.sync_faults", resume::key(head, 1)),
                &format!("{}.sync_faults", resume::key(head, later)),
                "×",
            );
            results.ratio(
                &format!("ratio.resume.h{head}.first_over_r{later}.thread_faults"),
                &format!("{}.thread_faults", resume::key(head, 1)),
                &format!("{}.thread_faults", resume::key(head, later)),
                "×",
            );
        }
    }
}

pub use crate::common::verdict::Verdict;

/// "1.23× (median of 5; min 1.1, max 1.4; 4 of 5 runs meet it)".
fn ratio_figure(results: &Results, key: &str, ok: &dyn Fn(f64) -> bool) -> String {
    let s = results.summary(key);
    format!(
        "{}× (median of {}; min {}, max {}; {} of {} runs meet it)",
        fmt(s.median),
        s.n,
        fmt(s.min),
        fmt(s.max),
        results.count(key, ok),
        s.n
    )
}

fn verdict(
    results: &Results,
    target: String,
    key: &str,
    ok: &dyn Fn(f64) -> bool,
    extra: String,
) -> Verdict {
    let median = results.summary(key).median;
    Verdict {
        target,
        figure: format!("{}{extra}", ratio_figure(results, key, ok)),
        result: if median.is_nan() {
            "NOT MEASURED"
        } else if ok(median) {
            "PASS"
        } else {
            "FAIL"
        },
    }
}

/// Issue 36: the longest a guest's fault may wait across a SIGTERM upgrade, ms.
pub const UPGRADE_STALL_MS: f64 = 10.0;

pub fn verdicts(results: &Results, settings: &Settings) -> Vec<Verdict> {
    let mut out = Vec::new();
    let le = |limit: f64| move |v: f64| v <= limit;
    let ge = |limit: f64| move |v: f64| v >= limit;
    let pager = results.summary("ratio.latency.lz4_over_raw.pager_p50_us");
    out.push(verdict(
        results,
        "lz4-compressed fault p50 ≤ 1.3× raw-file fault p50 (touching thread)".into(),
        "ratio.latency.lz4_over_raw.touch_p50_us",
        &le(1.3),
        format!(
            ", lz4 p50 / raw p50; by the pager's histogram {}× (min {}, max {})",
            fmt(pager.median),
            fmt(pager.min),
            fmt(pager.max)
        ),
    ));
    for (ours, what) in [
        ("ours_raw", "raw file, like for like"),
        ("ours_lz4", "lz4 store"),
        ("ours_raw_huge", "raw file, on 2 MiB pages"),
        ("ours_lz4_huge", "lz4 store, on 2 MiB pages"),
    ] {
        out.push(verdict(
            results,
            format!(
                "full restore of {} MiB ≥ 3× faster than the Firecracker-style handler on 4 KiB \
                 pages (ours from the {what})",
                settings.image >> 20
            ),
            &format!("ratio.restore.full.firecracker_over_{ours}"),
            &ge(3.0),
            ", Firecracker-style time / our time".into(),
        ));
    }
    for (ours, what, limit) in [
        ("ours_raw_huge", "raw file", 1.05),
        ("ours_lz4_huge", "lz4 store", 1.3),
    ] {
        out.push(verdict(
            results,
            format!(
                "full restore of {} MiB on 2 MiB pages ≤ {limit}× the Firecracker-style handler's \
                 on 2 MiB pages (ours from the {what})",
                settings.image >> 20
            ),
            &format!("ratio.restore.full.{ours}_over_firecracker_huge"),
            &le(limit),
            ", our time / Firecracker-style time".into(),
        ));
    }
    // Issue 14: the touching thread's synchronous faults per 64 MiB touched on 2 MiB pages.
    let per_64 = 64.0 * f64::from(1u32 << 20) / settings.lazy_total as f64;
    for who in ["ours_raw_huge", "ours_lz4_huge"] {
        let key = format!("restore.lazy.{who}.faults");
        let faults = results.summary(&key);
        let worst = faults.max * per_64;
        out.push(Verdict {
            target: format!(
                "lazy restore on 2 MiB pages ({}): ≤ 64 synchronous faults per 64 MiB touched",
                who.trim_start_matches("ours_").trim_end_matches("_huge")
            ),
            figure: format!(
                "{} per 64 MiB (min {}, max {}) over {} runs",
                fmt(faults.median * per_64),
                fmt(faults.min * per_64),
                fmt(worst),
                faults.n
            ),
            result: if worst.is_nan() {
                "NOT MEASURED"
            } else if worst <= 64.0 {
                "PASS"
            } else {
                "FAIL"
            },
        });
    }
    let mixed = format!(
        "{} MiB repeated + {} MiB random in {} MiB",
        settings.repeated >> 20,
        settings.random >> 20,
        settings.image >> 20
    );
    let full = format!("{} MiB fully written", settings.image >> 20);
    for (content, what) in [("mixed", mixed.as_str()), ("full", full.as_str())] {
        out.push(verdict(
            results,
            format!("compressed (lz4) offload time ≤ 1.5× raw offload time ({what})"),
            &format!("ratio.offload.{content}.lz4_over_none"),
            &le(1.5),
            ", lz4 time / raw time, write + commit + drop".into(),
        ));
    }
    for head in [settings.head_start_ms, 0] {
        let first = results.summary(&format!("{}.sync_faults", resume::key(head, 1)));
        let second = results.summary(&format!("{}.sync_faults", resume::key(head, 2)));
        out.push(verdict(
            results,
            format!("second resume takes ≥ 2× fewer synchronous faults than the first ({head} ms head start)"),
            &format!("ratio.resume.h{head}.first_over_r2"),
            &ge(2.0),
            format!(
                ", first / second `faults_copy + faults_zero`; median {} vs {} faults. Counting every \
                 fault the touching thread waited for (also those the prefetcher resolved while it \
                 waited): {}×",
                fmt(first.median),
                fmt(second.median),
                fmt(results
                    .summary(&format!("ratio.resume.h{head}.first_over_r2.thread_faults"))
                    .median),
            ),
        ));
    }
    // Issue 36: a SIGTERM upgrade stalls a guest's faults for milliseconds.
    let key = "upgrade.upgrade.longest_read_ms";
    let longest = results.summary(key);
    let baseline = results.summary("upgrade.baseline.longest_read_ms");
    out.push(Verdict {
        target: format!(
            "a SIGTERM upgrade of `uffd-pager serve` stalls the guest's faults ≤ {UPGRADE_STALL_MS} ms \
             (its longest page read across the upgrade)"
        ),
        figure: format!(
            "{} ms (median of {}; min {}, max {}; {} of {} runs meet it); without an upgrade \
             {} ms; the old server exited {} ms after SIGTERM, the new one listened at {} ms \
             (medians)",
            fmt(longest.median),
            longest.n,
            fmt(longest.min),
            fmt(longest.max),
            results.count(key, le(UPGRADE_STALL_MS)),
            longest.n,
            fmt(baseline.median),
            fmt(results.summary("upgrade.upgrade.exit_ms").median),
            fmt(results.summary("upgrade.upgrade.listening_ms").median),
        ),
        result: if longest.median.is_nan() {
            "NOT MEASURED"
        } else if longest.median <= UPGRADE_STALL_MS {
            "PASS"
        } else {
            "FAIL"
        },
    });
    out
}
