//! The chart of the report: every ratio as a dot (median) with min–max whiskers and a dashed
//! line at its target, on log scales.

use crate::common::chart::{Figure, Row, Rows, Scale, GREEN, GREY, RED};
use crate::common::Content;
use crate::common::{Res, IMAGE};
use crate::plan::{
    self, Goal, MemOp, DECODERS, DECODE_SPEED, LZ4, MEMCPY, MEMORY_CONTENTS,
    REPEATED_DISK_PER_64MIB, SIZE_STORES, WRITE_COST,
};
use crate::results::Results;

struct Bar {
    label: String,
    key: String,
    target: Option<Goal>,
}

/// One panel on a log axis: a row per bar, green where its median meets its target, red
/// where it does not, grey without one.
fn panel(results: &Results, title: &str, bars: Vec<Bar>) -> Rows {
    let rows = bars
        .into_iter()
        .map(|bar| {
            let s = results.summary(&bar.key);
            let colour = match bar.target {
                None => GREY,
                Some(goal) if goal.met(s.median) => GREEN,
                Some(_) => RED,
            };
            Row {
                target: bar.target.map(|goal| goal.value),
                ..Row::new(bar.label, s, colour)
            }
        })
        .collect();
    Rows {
        tick,
        value: Some(tick_value),
        plot: (420, 470),
        ..Rows::new(title, Scale::Log, rows)
    }
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

pub fn svg(results: &Results) -> Res<String> {
    let caption = format!(
        "Compressed block store, {} runs: dot = median of the per-run ratios, whiskers = \
         min–max, dashed red = target; log scale",
        results.runs
    );
    Figure::new(caption)
        .panel(panel(
            results,
            "Decompression speed as a share of memcpy speed, against each memcpy (higher is better)",
            speed_bars(),
        ))
        .panel(panel(
            results,
            "Store time / raw file time, 64 MiB write (create+pwrite+fsync) and read from disk (lower is better)",
            cost_bars(),
        ))
        .panel(panel(
            results,
            "Compression: logical bytes per allocated disk byte (higher is better)",
            size_bars(),
        ))
        .svg()
}
