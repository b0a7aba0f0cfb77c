//! The chart of the report: medians as dots with min–max whiskers on log scales, a dashed
//! mark at each target.

use std::fmt::Write as _;

use crate::common::svg::{document, line, text, LogAxis, Panel};
use crate::latency::Source;
use crate::restore::Who;
use crate::results::{fmt, Results};
use crate::Settings;

const WIDTH: f64 = 980.0;
const PLOT_X: f64 = 430.0;
const PLOT_W: f64 = 470.0;

struct Bar {
    label: String,
    key: String,
    target: Option<f64>,
}

fn bar(label: impl Into<String>, key: impl Into<String>, target: Option<f64>) -> Bar {
    Bar {
        label: label.into(),
        key: key.into(),
        target,
    }
}

/// One panel, on decades that hold every finite positive whisker and target of `bars`;
/// returns the y below it.
fn panel(out: &mut String, results: &Results, y0: f64, title: &str, bars: &[Bar]) -> f64 {
    let values = bars.iter().flat_map(|b| {
        let s = results.summary(&b.key);
        [s.min, s.max].into_iter().chain(b.target)
    });
    let axis = LogAxis::covering(values, PLOT_X, PLOT_W).clamped();
    let ticks = (
        r#"font-size="10" text-anchor="middle""#,
        fmt as fn(f64) -> String,
    );
    let panel = Panel::begin(out, y0, title, axis, bars.len(), ticks);
    let x = |v: f64| axis.x(v);
    for (i, b) in bars.iter().enumerate() {
        let cy = panel.row(out, i, &b.label);
        let s = results.summary(&b.key);
        if let Some(target) = b.target {
            let tx = x(target);
            line(
                out,
                (tx, cy - 9.0),
                (tx, cy + 9.0),
                r##"stroke="#c00" stroke-dasharray="3,2""##,
            );
        }
        if s.n == 0 || !s.median.is_finite() {
            text(
                out,
                PLOT_X + 4.0,
                cy + 4.0,
                r##"font-size="11" fill="#888""##,
                "not measured",
            );
            continue;
        }
        line(
            out,
            (x(s.min), cy),
            (x(s.max), cy),
            r##"stroke="#369" stroke-width="2""##,
        );
        let _ = writeln!(
            out,
            r##"<circle cx="{:.1}" cy="{cy:.1}" r="4.5" fill="#369"/>"##,
            x(s.median)
        );
        text(
            out,
            WIDTH - 70.0,
            cy + 4.0,
            r#"font-size="11""#,
            &fmt(s.median),
        );
    }
    panel.bottom + 30.0
}

pub fn svg(results: &Results, settings: &Settings) -> String {
    let mut body = String::new();
    let latency: Vec<Bar> = Source::ALL
        .iter()
        .flat_map(|s| {
            let k = format!("latency.{}.t1.c1", s.key());
            [
                bar(
                    format!("{}: touching thread p50", s.key()),
                    format!("{k}.touch_p50_us"),
                    None,
                ),
                bar(
                    format!("{}: pager histogram p50", s.key()),
                    format!("{k}.pager_p50_us"),
                    None,
                ),
            ]
        })
        .collect();
    let mut y = panel(
        &mut body,
        results,
        30.0,
        "1. Fault latency p50, µs (one fault per 64 KiB block)",
        &latency,
    );
    let restore: Vec<Bar> = ["lazy", "full"]
        .iter()
        .flat_map(|touch| {
            Who::ALL.iter().map(move |who| {
                bar(
                    format!("{touch}: {}", who.key().replace('_', " ")),
                    format!("restore.{touch}.{}.ms", who.key()),
                    None,
                )
            })
        })
        .collect();
    y = panel(
        &mut body,
        results,
        y,
        "2. Restore, first touch to last, ms (512 MiB image)",
        &restore,
    );
    let h = settings.head_start_ms;
    let ratios = vec![
        bar(
            "lz4 / raw fault p50 (≤ 1.3)",
            "ratio.latency.lz4_over_raw.touch_p50_us",
            Some(1.3),
        ),
        bar(
            "full restore: Firecracker-style / ours raw (≥ 3)",
            "ratio.restore.full.firecracker_over_ours_raw",
            Some(3.0),
        ),
        bar(
            "full restore: Firecracker-style / ours lz4 (≥ 3)",
            "ratio.restore.full.firecracker_over_ours_lz4",
            Some(3.0),
        ),
        bar(
            "offload lz4 / raw time, mixed (≤ 1.5)",
            "ratio.offload.mixed.lz4_over_none",
            Some(1.5),
        ),
        bar(
            "offload lz4 / raw time, full (≤ 1.5)",
            "ratio.offload.full.lz4_over_none",
            Some(1.5),
        ),
        bar(
            format!("resume 1 / 2 sync faults, {h} ms head (≥ 2)"),
            format!("ratio.resume.h{h}.first_over_r2"),
            Some(2.0),
        ),
        bar(
            "resume 1 / 2 sync faults, no head (≥ 2)",
            "ratio.resume.h0.first_over_r2",
            Some(2.0),
        ),
    ];
    y = panel(
        &mut body,
        results,
        y,
        "Targets: per-run ratios (dashed red: the target)",
        &ratios,
    );
    let mut out = String::new();
    text(
        &mut out,
        10.0,
        18.0,
        r##"font-size="12" fill="#444""##,
        &format!(
            "uffd-pager, {} runs: dot = median, whisker = min–max, log scales",
            results.runs
        ),
    );
    out.push_str(&body);
    document(WIDTH, y + 10.0, false, &out)
}
