//! The chart of the report: medians as dots with min–max whiskers on log scales, a dashed
//! mark at each target.

use crate::common::chart::{Figure, Row, Rows, Scale, BLUE};
use crate::common::Res;
use crate::latency::Source;
use crate::restore::Who;
use crate::results::{fmt, Results};
use crate::Settings;

/// A row of the figures under `key`, with its target.
fn bar(
    results: &Results,
    label: impl Into<String>,
    key: impl AsRef<str>,
    target: Option<f64>,
) -> Row {
    Row {
        target,
        ..Row::new(label, results.summary(key.as_ref()), BLUE)
    }
}

/// A panel of `rows` on a log axis.
fn panel(title: &str, rows: Vec<Row>) -> Rows {
    Rows {
        tick: fmt,
        value: Some(fmt),
        plot: (430, 470),
        ..Rows::new(title, Scale::Log, rows)
    }
}

pub fn svg(results: &Results, settings: &Settings) -> Res<String> {
    let latency: Vec<Row> = Source::ALL
        .iter()
        .flat_map(|s| {
            let k = format!("latency.{}.t1.c1", s.key());
            [
                bar(
                    results,
                    format!("{}: touching thread p50", s.key()),
                    format!("{k}.touch_p50_us"),
                    None,
                ),
                bar(
                    results,
                    format!("{}: pager histogram p50", s.key()),
                    format!("{k}.pager_p50_us"),
                    None,
                ),
            ]
        })
        .collect();
    let latency = panel(
        "1. Fault latency p50, µs (one fault per 64 KiB block)",
        latency,
    );
    let restore: Vec<Row> = ["lazy", "full"]
        .iter()
        .flat_map(|touch| {
            Who::ALL.iter().map(move |who| {
                bar(
                    results,
                    format!("{touch}: {}", who.key().replace('_', " ")),
                    format!("restore.{touch}.{}.ms", who.key()),
                    None,
                )
            })
        })
        .collect();
    let restore = panel(
        "2. Restore, first touch to last, ms (512 MiB image)",
        restore,
    );
    let h = settings.head_start_ms;
    let ratios = vec![
        bar(
            results,
            "lz4 / raw fault p50 (≤ 1.3)",
            "ratio.latency.lz4_over_raw.touch_p50_us",
            Some(1.3),
        ),
        bar(
            results,
            "full restore: Firecracker-style / ours raw (≥ 3)",
            "ratio.restore.full.firecracker_over_ours_raw",
            Some(3.0),
        ),
        bar(
            results,
            "full restore: Firecracker-style / ours lz4 (≥ 3)",
            "ratio.restore.full.firecracker_over_ours_lz4",
            Some(3.0),
        ),
        bar(
            results,
            "offload lz4 / raw time, mixed (≤ 1.5)",
            "ratio.offload.mixed.lz4_over_none",
            Some(1.5),
        ),
        bar(
            results,
            "offload lz4 / raw time, full (≤ 1.5)",
            "ratio.offload.full.lz4_over_none",
            Some(1.5),
        ),
        bar(
            results,
            format!("resume 1 / 2 sync faults, {h} ms head (≥ 2)"),
            format!("ratio.resume.h{h}.first_over_r2"),
            Some(2.0),
        ),
        bar(
            results,
            "resume 1 / 2 sync faults, no head (≥ 2)",
            "ratio.resume.h0.first_over_r2",
            Some(2.0),
        ),
    ];
    let caption = format!(
        "uffd-pager, {} runs: dot = median, whisker = min–max, log scales",
        results.runs
    );
    Figure::new(caption)
        .panel(latency)
        .panel(restore)
        .panel(panel(
            "Targets: per-run ratios (dashed red: the target)",
            ratios,
        ))
        .svg()
}
