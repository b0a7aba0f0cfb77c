//! The chart: per-instance memory of every content, measured mode and stage as horizontal
//! bars (one axis for all, so that the bars compare), then every saving against no sharing
//! with the seed's figure (ring) and the target (red dashes). Bars are medians, whiskers
//! min–max.

use std::fmt::Write as _;

use crate::common::svg::{document, line, text, Axis, LinearAxis, Panel};
use crate::results::{num, secs, Results, Summary};
use crate::seed;
use crate::targets::{key, measured, KSM_2S_SAVING_PCT};
use crate::{Content, Mode, Point, Settings, BASE};

const WIDTH: f64 = 980.0;
const PLOT_X: f64 = 330.0;
const PLOT_W: f64 = 560.0;
const ORANGE: &str = "#e80";

fn colour(mode: Mode) -> &'static str {
    match mode {
        Mode::None => "#369",
        Mode::Ksm => "#283",
        Mode::Snapshot => "#a4c",
        Mode::Pool => "#c63",
    }
}

/// One bar: its label, the key of its figures, its colour, the seed's figure and a target.
struct Bar {
    label: String,
    key: String,
    colour: &'static str,
    seed: Option<f64>,
    target: Option<f64>,
}

/// Tick values: whole numbers, or one decimal on a fine axis.
fn tick(v: f64) -> String {
    num(v, if v.fract() == 0.0 { 0 } else { 1 })
}

/// A titled block of bars on `axis`; returns the y below it.
fn block(
    out: &mut String,
    results: &Results,
    y0: f64,
    title: &str,
    axis: LinearAxis,
    bars: &[Bar],
) -> f64 {
    let ticks = (
        r#"font-size="10" text-anchor="middle""#,
        tick as fn(f64) -> String,
    );
    let panel = Panel::begin(out, y0, title, axis, bars.len(), ticks);
    if axis.lo < 0.0 {
        let x = axis.x(0.0);
        line(out, (x, panel.top), (x, panel.bottom), r##"stroke="#888""##);
    }
    for (i, bar) in bars.iter().enumerate() {
        let cy = panel.row(out, i, &bar.label);
        draw(out, &axis, cy, results.summary(&bar.key), bar.colour);
        if let Some(target) = bar.target {
            let x = axis.x(target);
            let style = r##"stroke="#c00" stroke-width="2" stroke-dasharray="3,2""##;
            line(out, (x, cy - 9.0), (x, cy + 9.0), style);
        }
        if let Some(seed) = bar.seed {
            let _ = writeln!(
                out,
                r#"<circle cx="{:.1}" cy="{cy:.1}" r="5" fill="none" stroke="{ORANGE}" stroke-width="2"/>"#,
                axis.x(seed)
            );
        }
    }
    panel.bottom + 34.0
}

/// The bar of `s` (from zero to its median) with its min–max whisker and value.
fn draw(out: &mut String, axis: &LinearAxis, cy: f64, s: Summary, colour: &str) {
    if s.n == 0 || !s.median.is_finite() {
        let attributes = r##"font-size="11" fill="#888""##;
        text(out, PLOT_X + 4.0, cy + 4.0, attributes, "not measured");
        return;
    }
    let (a, b) = (axis.x(0.0), axis.x(s.median));
    let _ = writeln!(
        out,
        r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="12" fill="{colour}" fill-opacity="0.55"/>"#,
        a.min(b),
        cy - 6.0,
        (b - a).abs()
    );
    let whisker = format!(r#"stroke="{colour}" stroke-width="2""#);
    line(out, (axis.x(s.min), cy), (axis.x(s.max), cy), &whisker);
    for v in [s.min, s.max] {
        line(out, (axis.x(v), cy - 4.0), (axis.x(v), cy + 4.0), &whisker);
    }
    let attributes = r#"font-size="11""#;
    text(
        out,
        PLOT_X + PLOT_W + 12.0,
        cy + 4.0,
        attributes,
        &num(s.median, 1),
    );
}

pub fn svg(results: &Results, settings: &Settings) -> String {
    let modes = measured(results);
    let memory: Vec<Bar> = Content::ALL
        .into_iter()
        .flat_map(|content| {
            modes.iter().flat_map(move |&mode| {
                settings.stages(mode).into_iter().map(move |point| Bar {
                    label: format!("{}, {}: {}", content.name(), mode.key(), stage(point)),
                    key: key(content, mode, point, "per_instance_mib"),
                    colour: colour(mode),
                    seed: None,
                    target: None,
                })
            })
        })
        .collect();
    let first = Point::Filled(settings.ksm_readings[0]);
    let savings: Vec<Bar> = Content::ALL
        .into_iter()
        .flat_map(|content| {
            modes.iter().filter(|&&m| m != BASE).flat_map(move |&mode| {
                let initial = mode.initial(settings);
                settings.points(mode).into_iter().map(move |point| Bar {
                    label: format!("{}, {}: {}", content.name(), mode.key(), short(point)),
                    key: key(content, mode, point, "saving_pct"),
                    colour: colour(mode),
                    seed: seed::system(mode).and_then(|sys| match point {
                        p if p == initial => Some(sys.saving(content, false)),
                        Point::Rewritten(100) => Some(sys.saving(content, true)),
                        _ => None,
                    }),
                    target: (mode.ksm() && content == Content::Repeated && point == first)
                        .then_some(KSM_2S_SAVING_PCT),
                })
            })
        })
        .collect();
    let extent = |bars: &[Bar]| -> Vec<f64> {
        bars.iter()
            .flat_map(|bar| {
                let s = results.summary(&bar.key);
                [s.min, s.max].into_iter().chain(bar.seed).chain(bar.target)
            })
            .collect()
    };
    let memory_axis = LinearAxis::from_zero(extent(&memory), PLOT_X, PLOT_W);
    let savings_axis = LinearAxis::from_zero(extent(&savings), PLOT_X, PLOT_W);

    let rounds = match settings.runs {
        1 => "1 round".to_owned(),
        n => format!("{n} rounds"),
    };
    let caption = format!(
        "{} VMs × {} MiB, {} MiB of data each, {rounds}. Bar: median, whiskers: min–max, ring: the seed \
         (N=1), red dashes: target.",
        settings.vms,
        settings.memory >> 20,
        settings.app >> 20,
    );
    let mut body = String::new();
    text(&mut body, 10.0, 20.0, r#"font-size="14""#, &caption);
    let mut y = block(
        &mut body,
        results,
        32.0,
        "1. Memory per instance, MiB (PSS of the VM processes ÷ VMs)",
        memory_axis,
        &memory,
    );
    if !savings.is_empty() {
        y = block(
            &mut body,
            results,
            y,
            "2. Saving per instance against no sharing, %",
            savings_axis,
            &savings,
        );
    }
    document(WIDTH, y, true, &body)
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
