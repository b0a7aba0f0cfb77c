//! The chart: memory at the end of the idle period per case and variant, the cold VM's change
//! against the default VM beside the seed's (diamond) and the targets (dashed), the time of a
//! `touch` of all the data (log scale), and the pager's CPU while idle. Dots are medians,
//! whiskers min–max.

use std::fmt::Write as _;

use crate::common::svg::{document, line, text, LogAxis, Panel, ROW_H};
use crate::results::{num, secs, Results, Summary};
use crate::seed;
use crate::targets::{cold_variants, IDLE_CPU_PCT, RANDOM_COST_PCT, REPEATED_SAVING_PCT};
use crate::{Case, Settings, Variant, DEFAULT, VARIANTS};

const WIDTH: f64 = 980.0;
const PLOT_X: f64 = 330.0;
const PLOT_W: f64 = 560.0;
const BLUE: &str = "#369";
const GREEN: &str = "#283";
const PURPLE: &str = "#849";
const ORANGE: &str = "#e80";

/// A row: a label, the key of its figures, its colour, the seed's figure and a target, if
/// any.
struct Row {
    label: String,
    key: String,
    colour: &'static str,
    seed: Option<f64>,
    target: Option<f64>,
}

/// Blue without cold compression, green for the judged cold variant, purple for the others.
fn colour(variant: Variant) -> &'static str {
    match (variant.cold, variant.judged) {
        (false, _) => BLUE,
        (true, true) => GREEN,
        (true, false) => PURPLE,
    }
}

/// The row of `quantity` of `case` run as `variant`.
fn row(case: Case, variant: Variant, quantity: &str) -> Row {
    Row {
        label: format!("{}: {}", case.name(), variant.describe()),
        key: key(case, variant, quantity),
        colour: colour(variant),
        seed: None,
        target: None,
    }
}

/// A linear axis from `lo` to `hi` with a grid at a 1-2-5 step.
#[derive(Debug, Clone, Copy)]
struct Linear {
    lo: f64,
    hi: f64,
    step: f64,
}

impl Linear {
    /// Covers `values` (and 0), with at most about eight steps.
    fn covering(values: impl IntoIterator<Item = f64>) -> Self {
        let (mut lo, mut hi) = (0.0f64, 0.0f64);
        for v in values.into_iter().filter(|v| v.is_finite()) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if hi - lo <= 0.0 {
            hi = lo + 1.0;
        }
        let raw = (hi - lo) / 8.0;
        let decade = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0]
            .into_iter()
            .map(|m| m * decade)
            .find(|&s| s >= raw)
            .unwrap_or(10.0 * decade);
        Self {
            lo: (lo / step).floor() * step,
            hi: (hi / step).ceil() * step,
            step,
        }
    }

    fn x(&self, v: f64) -> f64 {
        PLOT_X + (v.clamp(self.lo, self.hi) - self.lo) / (self.hi - self.lo) * PLOT_W
    }

    fn ticks(&self) -> Vec<f64> {
        (0..)
            .map(|i| self.lo + f64::from(i) * self.step)
            .take_while(|&v| v <= self.hi + self.step * 1e-6)
            .collect()
    }
}

fn tick_label(v: f64) -> String {
    if v.abs() >= 10.0 || v.fract() == 0.0 {
        num(v, 0)
    } else if v.abs() >= 1.0 {
        num(v, 1)
    } else {
        num(v, 2)
    }
}

/// Median dot, min–max whisker and the median's value at the right.
fn figure(out: &mut String, x: &dyn Fn(f64) -> f64, cy: f64, s: Summary, colour: &str, d: usize) {
    if s.n == 0 || !s.median.is_finite() {
        text(
            out,
            PLOT_X + 4.0,
            cy + 4.0,
            r##"font-size="11" fill="#888""##,
            "not measured",
        );
        return;
    }
    line(
        out,
        (x(s.min), cy),
        (x(s.max), cy),
        &format!(r#"stroke="{colour}" stroke-width="2""#),
    );
    let _ = writeln!(
        out,
        r#"<circle cx="{:.1}" cy="{cy:.1}" r="4.5" fill="{colour}"/>"#,
        x(s.median)
    );
    text(
        out,
        PLOT_X + PLOT_W + 12.0,
        cy + 4.0,
        r#"font-size="11""#,
        &num(s.median, d),
    );
}

fn diamond(out: &mut String, x: f64, cy: f64) {
    let d = 5.0;
    let _ = writeln!(
        out,
        r#"<polygon points="{:.1},{cy:.1} {x:.1},{:.1} {:.1},{cy:.1} {x:.1},{:.1}" fill="none" stroke="{ORANGE}" stroke-width="2"/>"#,
        x - d,
        cy - d,
        x + d,
        cy + d
    );
}

fn target_mark(out: &mut String, x: f64, cy: f64) {
    line(
        out,
        (x, cy - 9.0),
        (x, cy + 9.0),
        r##"stroke="#c00" stroke-width="2" stroke-dasharray="3,2""##,
    );
}

/// A panel on a linear axis; returns the y below it.
fn linear_panel(
    out: &mut String,
    results: &Results,
    y0: f64,
    title: &str,
    rows: &[Row],
    d: usize,
) -> f64 {
    let values = rows.iter().flat_map(|r| {
        let s = results.summary(&r.key);
        [s.min, s.max].into_iter().chain(r.seed).chain(r.target)
    });
    let axis = Linear::covering(values);
    text(
        out,
        10.0,
        y0 + 16.0,
        r#"font-weight="bold" font-size="14""#,
        title,
    );
    let top = y0 + 28.0;
    let bottom = top + ROW_H * rows.len() as f64;
    for v in axis.ticks() {
        let x = axis.x(v);
        let style = if v == 0.0 {
            r##"stroke="#888""##
        } else {
            r##"stroke="#ddd""##
        };
        line(out, (x, top), (x, bottom), style);
        text(
            out,
            x,
            bottom + 14.0,
            r#"font-size="10" text-anchor="middle""#,
            &tick_label(v),
        );
    }
    let x = |v: f64| axis.x(v);
    for (i, r) in rows.iter().enumerate() {
        let cy = top + ROW_H * (i as f64 + 0.5);
        text(
            out,
            PLOT_X - 8.0,
            cy + 4.0,
            r#"font-size="12" text-anchor="end""#,
            &r.label,
        );
        if let Some(t) = r.target {
            target_mark(out, x(t), cy);
        }
        if let Some(seed) = r.seed {
            diamond(out, x(seed), cy);
        }
        figure(out, &x, cy, results.summary(&r.key), r.colour, d);
    }
    bottom + 34.0
}

/// A panel on a log axis (common pieces); returns the y below it.
fn log_panel(out: &mut String, results: &Results, y0: f64, title: &str, rows: &[Row]) -> f64 {
    let values = rows.iter().flat_map(|r| {
        let s = results.summary(&r.key);
        [s.min, s.max]
    });
    let axis = LogAxis::covering(values, PLOT_X, PLOT_W).clamped();
    let ticks = (
        r#"font-size="10" text-anchor="middle""#,
        tick_label as fn(f64) -> String,
    );
    let panel = Panel::begin(out, y0, title, axis, rows.len(), ticks);
    let x = |v: f64| axis.x(v);
    for (i, r) in rows.iter().enumerate() {
        let cy = panel.row(out, i, &r.label);
        figure(out, &x, cy, results.summary(&r.key), r.colour, 1);
    }
    panel.bottom + 34.0
}

fn key(case: Case, variant: Variant, quantity: &str) -> String {
    format!("{}.{}.{quantity}", case.name(), variant.key)
}

pub fn svg(results: &Results, settings: &Settings) -> String {
    let rows = |quantity: &'static str| -> Vec<Row> {
        Case::ALL
            .into_iter()
            .flat_map(|case| VARIANTS.into_iter().map(move |v| row(case, v, quantity)))
            .collect()
    };
    let memory = rows("memory_mib");
    let touch = rows("touch_ms");
    // The idle target is for the cases left alone (`hot-cold` is read every tick).
    let cpu: Vec<Row> = Case::ALL
        .into_iter()
        .flat_map(|case| {
            VARIANTS.into_iter().map(move |v| Row {
                target: (v.judged && !case.hot()).then_some(IDLE_CPU_PCT),
                ..row(case, v, "idle_cpu_pct")
            })
        })
        .collect();
    let change: Vec<Row> = Case::ALL
        .into_iter()
        .flat_map(|case| {
            cold_variants().map(move |v| Row {
                label: format!("{}: {} vs default", case.name(), v.key),
                key: key(case, v, "change_pct"),
                colour: colour(v),
                seed: Some(seed::figure(case).change_pct()),
                target: match case {
                    Case::Repeated => Some(-REPEATED_SAVING_PCT),
                    Case::Random => Some(RANDOM_COST_PCT),
                    _ => None,
                },
            })
        })
        .collect();

    let mut body = String::new();
    text(
        &mut body,
        10.0,
        20.0,
        r#"font-size="14""#,
        &format!(
            "{} MiB VM, {} MiB of data, {} s idle, {} rounds. Dot: median, whiskers: min–max, diamond: the seed (N=1), red dashes: target.",
            settings.memory >> 20,
            settings.app >> 20,
            secs(settings.idle),
            settings.runs
        ),
    );
    let mut y = linear_panel(
        &mut body,
        results,
        32.0,
        "1. Memory at the end of the idle period, MiB (PSS, guest RAM as held)",
        &memory,
        1,
    );
    y = linear_panel(
        &mut body,
        results,
        y,
        &format!(
            "2. Cold VM's memory vs the default VM ({}), % (negative: saved)",
            DEFAULT.describe()
        ),
        &change,
        1,
    );
    y = log_panel(
        &mut body,
        results,
        y,
        &format!(
            "3. touch {} MiB after the idle period, ms (log scale)",
            settings.app >> 20
        ),
        &touch,
    );
    y = linear_panel(
        &mut body,
        results,
        y,
        &format!(
            "4. Pager CPU over the last {} s of the idle period, % of one core",
            secs(settings.window)
        ),
        &cpu,
        2,
    );
    document(WIDTH, y, true, &body)
}
