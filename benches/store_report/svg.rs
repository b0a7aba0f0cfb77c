//! The chart of the report: every ratio as a dot (median) with min–max whiskers and a dashed
//! line at its target, on log scales.

use std::fmt::Write as _;

use crate::common::{Content, IMAGE};
use crate::plan::{
    self, Goal, MemOp, DECODERS, DECODE_SPEED, LZ4, MEMCPY, MEMORY_CONTENTS,
    REPEATED_DISK_PER_64MIB, SIZE_STORES, WRITE_COST,
};
use crate::results::Results;

const SVG_WIDTH: f64 = 980.0;
const PLOT_X: f64 = 420.0;
const PLOT_W: f64 = 470.0;
const ROW_H: f64 = 22.0;

struct Bar {
    label: String,
    key: String,
    target: Option<Goal>,
}

fn esc(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Lower and upper ends of a log axis that holds every whisker and target of `bars`.
fn axis(results: &Results, bars: &[Bar]) -> (f64, f64) {
    let mut lo = f64::INFINITY;
    let mut hi = 0.0f64;
    for bar in bars {
        let s = results.summary(&bar.key);
        let target = bar.target.map(|goal| goal.value);
        for v in [s.min, s.max].into_iter().chain(target) {
            if v.is_finite() && v > 0.0 {
                lo = lo.min(v);
                hi = hi.max(v);
            }
        }
    }
    if !lo.is_finite() || hi <= 0.0 {
        (lo, hi) = (0.1, 10.0);
    }
    let lo = 10f64.powf(lo.log10().floor());
    (lo, 10f64.powf(hi.log10().ceil()).max(lo * 10.0))
}

fn vline(out: &mut String, x: f64, y1: f64, y2: f64, style: &str) {
    let _ = writeln!(
        out,
        r#"<line x1="{x:.1}" y1="{y1:.1}" x2="{x:.1}" y2="{y2:.1}" {style}/>"#
    );
}

fn text(out: &mut String, x: f64, y: f64, attributes: &str, content: &str) {
    let _ = writeln!(
        out,
        r#"<text x="{x:.1}" y="{y:.1}" {attributes}>{}</text>"#,
        esc(content)
    );
}

/// Draws one panel with a log-scale axis; returns the y below it.
fn panel(out: &mut String, results: &Results, y0: f64, title: &str, bars: &[Bar]) -> f64 {
    let (lo, hi) = axis(results, bars);
    let x = |v: f64| PLOT_X + (v.ln() - lo.ln()) / (hi.ln() - lo.ln()) * PLOT_W;
    text(
        out,
        10.0,
        y0 + 16.0,
        r#"font-weight="bold" font-size="14""#,
        title,
    );
    let top = y0 + 28.0;
    let bottom = top + ROW_H * bars.len() as f64;
    // Grid at 1, 2, 5 per decade.
    let mut decade = lo;
    while decade < hi * 1.0001 {
        for v in [1.0, 2.0, 5.0].map(|m| decade * m) {
            if v > hi * 1.0001 {
                break;
            }
            vline(out, x(v), top, bottom, r##"stroke="#ddd""##);
            let anchor = r#"font-size="11" text-anchor="middle""#;
            text(out, x(v), bottom + 14.0, anchor, &tick(v));
        }
        decade *= 10.0;
    }
    for (i, bar) in bars.iter().enumerate() {
        let cy = top + ROW_H * (i as f64 + 0.5);
        let s = results.summary(&bar.key);
        let anchor = r#"font-size="12" text-anchor="end""#;
        text(out, PLOT_X - 8.0, cy + 4.0, anchor, &bar.label);
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
            vline(out, x(goal.value), cy - 9.0, cy + 9.0, style);
        }
        let (x1, x2) = (x(s.min), x(s.max));
        let _ = writeln!(
            out,
            r#"<line x1="{x1:.1}" y1="{cy:.1}" x2="{x2:.1}" y2="{cy:.1}" stroke="{color}" stroke-width="1.5"/>"#
        );
        for wx in [x1, x2] {
            let style = format!(r#"stroke="{color}" stroke-width="1.5""#);
            vline(out, wx, cy - 5.0, cy + 5.0, &style);
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
    bottom + 24.0
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
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{SVG_WIDTH:.0}" height="{height:.0}" viewBox="0 0 {SVG_WIDTH:.0} {height:.0}" font-family="sans-serif">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let title = format!(
        "Compressed block store, {} runs: dot = median of the per-run ratios, whiskers = \
         min–max, dashed red = target; log scale",
        results.runs
    );
    text(&mut out, 10.0, 22.0, r#"font-size="15""#, &title);
    out.push_str(&body);
    out.push_str("</svg>\n");
    out
}
