//! The chart: resume + task ratios, PSS after offload and backing (log scales, median dot,
//! min–max whiskers, target dashed, the seed's figure as a diamond), and where the eager
//! resume + task goes (stacked medians).

use crate::common::chart::{
    Figure, Row, Rows, Scale, Stacked, StackedRow, Stroke, BLACK, NAVY, ORANGE, RED,
};
use crate::common::results::Summary;
use crate::common::Res;
use crate::results::Results;
use crate::{Codec, Content, Settings};

/// The seed's figures (pvisor, N=1), by content: resume + task ratio raw, compressed; PSS
/// after offload raw, compressed; backing raw, compressed.
pub fn seed(content: Content) -> [f64; 6] {
    match content {
        Content::Repeated => [432.4 / 276.5, 1730.3 / 276.5, 35.6, 39.8, 186.4, 15.5],
        Content::Random => [498.2 / 320.1, 766.2 / 320.1, 35.8, 39.5, 186.3, 146.0],
    }
}

/// Where the axis starts and its width.
const PLOT: (i32, i32) = (400, 550);

fn label(v: f64) -> String {
    if v >= 1.0 {
        format!("{v}")
    } else {
        format!("{v:.2}").trim_end_matches('0').to_owned()
    }
}

/// The row of the figures under `key` (if measured), with the seed's figure.
fn row(results: &Results, label: String, key: &str, seed: Option<f64>) -> Row {
    Row {
        seed,
        ..Row::new(label, results.summary(key).unwrap_or(Summary::NONE), NAVY)
    }
}

/// A panel of `rows` on a log axis with `target` down it.
fn panel(title: &str, rows: Vec<Row>, target: (f64, &str)) -> Rows {
    Rows {
        tick: label,
        value: None,
        target: Some((target.0, target.1.to_owned())),
        plot: PLOT,
        ..Rows::new(title, Scale::Log, rows)
    }
}

fn med(results: &Results, key: &str) -> f64 {
    results.summary(key).map_or(0.0, |s| s.median)
}

/// Stacked medians of the eager resume + task: load, re-entry, the rest; the never-offloaded
/// task and 1.3× it as marks.
fn stacked(results: &Results) -> Stacked {
    let mut rows = Vec::new();
    for content in Content::ALL {
        let c = content.name();
        for codec in [Codec::Raw, Codec::Lz4] {
            let n = codec.name();
            let total = med(results, &format!("vm.{c}.{n}-eager.resume_task_ms"));
            let load = med(results, &format!("vm.{c}.{n}-eager.resume_ms"));
            let reentry = med(results, &format!("vm.{c}.touch-{n}-eager.touch_extra_ms")).max(0.0);
            let base = med(results, &format!("vm.{c}.base.task_ms"));
            let rest = (total - load - reentry).max(0.0);
            rows.push(StackedRow {
                label: format!("{c}, {n}, eager"),
                segments: vec![(load, ORANGE), (reentry, RED), (rest, NAVY)],
                marks: vec![(base, BLACK), (base * 1.3, RED)],
            });
        }
    }
    let block = |colour| Stroke::solid(colour).width(8);
    Stacked {
        title: "Where eager resume + task goes, in process (medians, ms)".into(),
        legend: vec![
            (block(ORANGE), "eager load".into()),
            (
                block(RED),
                "re-entry (touch after the load − warm touch)".into(),
            ),
            (block(NAVY), "the rest".into()),
            (Stroke::solid(BLACK), "tick: never-offloaded task".into()),
            (Stroke::solid(RED), "tick: 1.3× it".into()),
        ],
        rows,
        plot: PLOT,
    }
}

pub fn svg(results: &Results, settings: &Settings) -> Res<String> {
    let mut ratio = Vec::new();
    let mut pss = Vec::new();
    let mut backing = Vec::new();
    for content in Content::ALL {
        let c = content.name();
        let s = seed(content);
        for codec in [Codec::Raw, Codec::Lz4, Codec::Zstd] {
            let n = codec.name();
            let seed_of = |raw: f64, compressed: f64| match codec {
                Codec::Raw => Some(raw),
                Codec::Lz4 => Some(compressed),
                Codec::Zstd => None,
            };
            ratio.push(row(
                results,
                format!("pvisor process: {c}, {n}, lazy"),
                &format!("pvisor.{c}.{n}.ratio"),
                seed_of(s[0], s[1]),
            ));
            for mode in ["lazy", "eager"] {
                if codec == Codec::Zstd && mode == "eager" {
                    continue;
                }
                ratio.push(row(
                    results,
                    format!("in process: {c}, {n}, {mode}"),
                    &format!("vm.{c}.{n}-{mode}.ratio"),
                    None,
                ));
            }
            pss.push(row(
                results,
                format!("pvisor process: {c}, {n}"),
                &format!("pvisor.{c}.{n}.pss_offloaded_mib"),
                seed_of(s[2], s[3]),
            ));
            pss.push(row(
                results,
                format!("bench process: {c}, {n}"),
                &format!("vm.{c}.{n}-lazy.pss_offloaded_mib"),
                None,
            ));
            backing.push(row(
                results,
                format!("{c}, {n}"),
                &format!("vm.{c}.{n}-lazy.backing_mib"),
                seed_of(s[4], s[5]),
            ));
        }
    }
    let caption = format!(
        "{} MiB VM, {} MiB of data, {} runs. Dot: median, whiskers: min–max, diamond: the seed \
         (N=1), dashed: target.",
        settings.memory >> 20,
        settings.app >> 20,
        settings.runs
    );
    Figure::new(caption)
        .panel(panel(
            "Resume + task ÷ never-offloaded task, same run (lower is better; log scale)",
            ratio,
            (1.3, "target 1.3×"),
        ))
        .panel(panel(
            "Memory charged (whole-process PSS) after offload, MiB (pvisor process = headline; log scale)",
            pss,
            (4.0, "target 4 MiB"),
        ))
        .panel(panel(
            "Backing: allocated blocks of the store after offload, MiB (log scale)",
            backing,
            (1.0, "target 1 MiB (compressed, repeated)"),
        ))
        .panel(stacked(results))
        .svg()
}
