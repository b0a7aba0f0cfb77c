//! The chart of the report: every ratio as a dot (median) with min–max whiskers and a dashed
//! line at its target, on log scales.

use std::fmt::Write as _;

use crate::common::svg::{document, line, text, LogAxis, Panel};
use crate::common::{Content, IMAGE};
use crate::plan::{
    self, Goal, MemOp, DECODERS, DECODE_SPEED, LZ4, MEMCPY, MEMORY_CONTENTS,
    REPEATED_DISK_PER_64MIB, SIZE_STORES, WRITE_COST,
};
use crate::results::Results;

const SVG_WIDTH: f64 = 980.0;
const PLOT_X: f64 = 420.0;
const PLOT_W: f64 = 470.0;

struct Bar {
    label: String,
    key: String,
    target: Option<Goal>,
}

/// Draws one panel with a log-scale axis that holds every whisker and target of `bars`;
/// returns the y below it.
fn panel(out: &mut String, results: &Results, y0: f64, title: &str, bars: &[Bar]) -> f64 {
    let values = bars.iter().flat_map(|bar| {
        let s = results.summary(&bar.key);
        [s.min, s.max]
            .into_iter()
            .chain(bar.target.map(|goal| goal.value))
    });
    let axis = LogAxis::covering(values, PLOT_X, PLOT_W);
    let ticks = (
        r#"font-size="11" text-anchor="middle""#,
        tick as fn(f64) -> String,
    );
    let panel = Panel::begin(out, y0, title, axis, bars.len(), ticks);
    let x = |v: f64| axis.x(v);
    for (i, bar) in bars.iter().enumerate() {
        let cy = panel.row(out, i, &bar.label);
        let s = results.summary(&bar.key);
        if !(s.min > 0.0 && s.median > 0.0 && s.max > 0.0) {
            continue;
        }
        let color = match bar.target {
            None => "#555",
            Some(goal) if goal.met(s.median) => "#1a7f37",
            Some(_) => "#cf222e",
        };
        if let Some(goal) = bar.target {
            let style = r##"stroke="#cf222e" stroke-width="2" stroke-dasharray="3,2""##;
            let tx = x(goal.value);
            line(out, (tx, cy - 9.0), (tx, cy + 9.0), style);
        }
        let (x1, x2) = (x(s.min), x(s.max));
        let style = format!(r#"stroke="{color}" stroke-width="1.5""#);
        line(out, (x1, cy), (x2, cy), &style);
        for wx in [x1, x2] {
            line(out, (wx, cy - 5.0), (wx, cy + 5.0), &style);
        }
        let _ = writeln!(
            out,
            r#"<circle cx="{:.1}" cy="{cy:.1}" r="4.5" fill="{color}"/>"#,
            x(s.median)
        );
        let value = tick_value(s.median);
        text(
            out,
            PLOT_X + PLOT_W + 12.0,
            cy + 4.0,
            r#"font-size="12""#,
            &value,
        );
    }
    panel.bottom + 24.0
}

fn tick(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        let text = format!("{v:.3}");
        text.trim_end_matches('0').to_owned()
    }
}

fn tick_value(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn speed_bars() -> Vec<Bar> {
    let mut bars = Vec::new();
    for content in MEMORY_CONTENTS {
        for codec in DECODERS {
            for memcpy in MEMCPY {
                // The lz4 target is judged against the per-block copy only.
                let judged = codec == LZ4 && matches!(memcpy, MemOp::MemcpyBlocks);
                let note = if judged { " (judged)" } else { "" };
                bars.push(Bar {
                    label: format!(
                        "{codec} / {}{note}, {}",
                        memcpy.label().replace(", ", " "),
                        content.name()
                    ),
                    key: plan::decode_ratio_key(codec, memcpy, content),
                    target: judged.then_some(DECODE_SPEED),
                });
            }
        }
    }
    bars
}

fn cost_bars() -> Vec<Bar> {
    plan::comparisons()
        .into_iter()
        .map(|(op, case, content)| {
            let judged = matches!(op, plan::Op::Write)
                && content == Content::Random
                && plan::LZ4_CASES.contains(&case);
            Bar {
                label: format!(
                    "store / raw {} time, {}, {}",
                    op.name(),
                    content.name(),
                    case.label()
                ),
                key: op.cost_key(case, content),
                target: judged.then_some(WRITE_COST),
            }
        })
        .collect()
}

fn size_bars() -> Vec<Bar> {
    let repeated = Goal {
        value: IMAGE as f64 / REPEATED_DISK_PER_64MIB,
        higher: true,
    };
    SIZE_STORES
        .into_iter()
        .map(|(case, content)| {
            let store = plan::store_key(case, content);
            Bar {
                label: format!("{}, {}: raw / disk bytes", case.codec, content.name()),
                key: plan::key(&["ratio.raw_per_disk", &store]),
                target: (content == Content::Repeated).then_some(repeated),
            }
        })
        .collect()
}

pub fn svg(results: &Results) -> String {
    let panels = [
        (
            "Decompression speed as a share of memcpy speed, against each memcpy (higher is better)",
            speed_bars(),
        ),
        (
            "Store time / raw file time, 64 MiB write (create+pwrite+fsync) and read from disk (lower is better)",
            cost_bars(),
        ),
        (
            "Compression: logical bytes per allocated disk byte (higher is better)",
            size_bars(),
        ),
    ];
    let mut body = String::new();
    let mut y = 40.0;
    for (title, bars) in &panels {
        y = panel(&mut body, results, y, title, bars);
    }
    let height = y + 10.0;
    let title = format!(
        "Compressed block store, {} runs: dot = median of the per-run ratios, whiskers = \
         min–max, dashed red = target; log scale",
        results.runs
    );
    let mut out = String::new();
    text(&mut out, 10.0, 22.0, r#"font-size="15""#, &title);
    out.push_str(&body);
    document(SVG_WIDTH, height, true, &out)
}
