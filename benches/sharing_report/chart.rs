//! The chart: per-instance memory of every content, measured mode and stage as horizontal
//! bars (one axis for all, so that the bars compare), then every saving against no sharing
//! with the seed's figure (diamond) and the target (red dashes). Bars are medians, whiskers
//! min–max.

use crate::common::chart::{Colour, Figure, Row, Rows, Scale, BLUE, GREEN, RUST, VIOLET};
use crate::common::Res;
use crate::results::{num, secs, Results};
use crate::seed;
use crate::targets::{key, measured, KSM_2S_SAVING_PCT};
use crate::{Content, Mode, Point, Settings, BASE};

fn colour(mode: Mode) -> Colour {
    match mode {
        Mode::None => BLUE,
        Mode::Ksm => GREEN,
        Mode::Snapshot => VIOLET,
        Mode::Pool => RUST,
    }
}

/// Tick values: whole numbers, or one decimal on a fine axis.
fn tick(v: f64) -> String {
    num(v, if v.fract() == 0.0 { 0 } else { 1 })
}

fn value(v: f64) -> String {
    num(v, 1)
}

/// A titled block of bars from zero on a linear axis.
fn block(title: &str, rows: Vec<Row>) -> Rows {
    Rows {
        tick,
        value: Some(value),
        bars: true,
        ..Rows::new(title, Scale::Linear, rows)
    }
}

pub fn svg(results: &Results, settings: &Settings) -> Res<String> {
    let modes = measured(results);
    let memory: Vec<Row> = Content::ALL
        .into_iter()
        .flat_map(|content| {
            modes.iter().flat_map(move |&mode| {
                settings.stages(mode).into_iter().map(move |point| {
                    Row::new(
                        format!("{}, {}: {}", content.name(), mode.key(), stage(point)),
                        results.summary(&key(content, mode, point, "per_instance_mib")),
                        colour(mode),
                    )
                })
            })
        })
        .collect();
    let first = Point::Filled(settings.ksm_readings[0]);
    let savings: Vec<Row> = Content::ALL
        .into_iter()
        .flat_map(|content| {
            modes.iter().filter(|&&m| m != BASE).flat_map(move |&mode| {
                let initial = mode.initial(settings);
                settings.points(mode).into_iter().map(move |point| Row {
                    seed: seed::system(mode).and_then(|sys| match point {
                        p if p == initial => Some(sys.saving(content, false)),
                        Point::Rewritten(100) => Some(sys.saving(content, true)),
                        _ => None,
                    }),
                    target: (mode.ksm() && content == Content::Repeated && point == first)
                        .then_some(KSM_2S_SAVING_PCT),
                    ..Row::new(
                        format!("{}, {}: {}", content.name(), mode.key(), short(point)),
                        results.summary(&key(content, mode, point, "saving_pct")),
                        colour(mode),
                    )
                })
            })
        })
        .collect();
    let rounds = match settings.runs {
        1 => "1 round".to_owned(),
        n => format!("{n} rounds"),
    };
    let caption = format!(
        "{} VMs × {} MiB, {} MiB of data each, {rounds}. Bar: median, whiskers: min–max, diamond: the seed \
         (N=1), red dashes: target.",
        settings.vms,
        settings.memory >> 20,
        settings.app >> 20,
    );
    let mut figure = Figure::new(caption).panel(block(
        "1. Memory per instance, MiB (PSS of the VM processes ÷ VMs)",
        memory,
    ));
    if !savings.is_empty() {
        figure = figure.panel(block(
            "2. Saving per instance against no sharing, %",
            savings,
        ));
    }
    figure.svg()
}

/// `initial (60 s)`, `25% rewritten`.
fn stage(point: Point) -> String {
    match point {
        Point::Filled(after) => format!("initial ({} s)", secs(after)),
        Point::Rewritten(percent) => format!("{percent}% rewritten"),
    }
}

/// `after 2 s`, `25% rewritten`.
fn short(point: Point) -> String {
    match point {
        Point::Filled(after) => format!("after {} s", secs(after)),
        Point::Rewritten(percent) => format!("{percent}% rewritten"),
    }
}
