//! The chart: memory at the end of the idle period per case and variant, the cold VM's change
//! against the default VM beside the seed's (diamond) and the targets (dashed), the time of a
//! `touch` of all the data (log scale), and the pager's CPU while idle. Dots are medians,
//! whiskers min–max.

use crate::common::chart::{Colour, Figure, Row, Rows, Scale, BLUE, GREEN, PURPLE};
use crate::common::results::{num, secs, Results};
use crate::common::Res;
use crate::seed;
use crate::targets::{cold_variants, IDLE_CPU_PCT, RANDOM_COST_PCT, REPEATED_SAVING_PCT};
use crate::{Case, Settings, Variant, DEFAULT, VARIANTS};

/// Blue without cold compression, green for the judged cold variant, purple for the others.
fn colour(variant: Variant) -> Colour {
    match (variant.cold, variant.judged) {
        (false, _) => BLUE,
        (true, true) => GREEN,
        (true, false) => PURPLE,
    }
}

fn key(case: Case, variant: Variant, quantity: &str) -> String {
    format!("{}.{}.{quantity}", case.name(), variant.key)
}

/// The row of `quantity` of `case` run as `variant`.
fn row(results: &Results, case: Case, variant: Variant, quantity: &str) -> Row {
    let label = format!("{}: {}", case.name(), variant.describe());
    let summary = results.summary(&key(case, variant, quantity));
    Row::new(label, summary, colour(variant))
}

/// A row of `quantity` for every case and variant.
fn rows(results: &Results, quantity: &str) -> Vec<Row> {
    Case::ALL
        .into_iter()
        .flat_map(|case| {
            VARIANTS
                .into_iter()
                .map(move |v| row(results, case, v, quantity))
        })
        .collect()
}

fn tick(v: f64) -> String {
    if v.abs() >= 10.0 || v.fract() == 0.0 {
        num(v, 0)
    } else if v.abs() >= 1.0 {
        num(v, 1)
    } else {
        num(v, 2)
    }
}

fn one_decimal(v: f64) -> String {
    num(v, 1)
}

fn two_decimals(v: f64) -> String {
    num(v, 2)
}

/// A panel of `rows` on `scale`, medians written with `value`.
fn panel(title: String, scale: Scale, rows: Vec<Row>, value: fn(f64) -> String) -> Rows {
    Rows {
        tick,
        value: Some(value),
        ..Rows::new(title, scale, rows)
    }
}

pub fn svg(results: &Results, settings: &Settings) -> Res<String> {
    // The idle target is for the cases left alone (`hot-cold` is read every tick).
    let cpu: Vec<Row> = Case::ALL
        .into_iter()
        .flat_map(|case| {
            VARIANTS.into_iter().map(move |v| Row {
                target: (v.judged && !case.hot()).then_some(IDLE_CPU_PCT),
                ..row(results, case, v, "idle_cpu_pct")
            })
        })
        .collect();
    let change: Vec<Row> = Case::ALL
        .into_iter()
        .flat_map(|case| {
            cold_variants().map(move |v| Row {
                seed: Some(seed::figure(case).change_pct()),
                target: match case {
                    Case::Repeated => Some(-REPEATED_SAVING_PCT),
                    Case::Random => Some(RANDOM_COST_PCT),
                    _ => None,
                },
                ..Row::new(
                    format!("{}: {} vs default", case.name(), v.key),
                    results.summary(&key(case, v, "change_pct")),
                    colour(v),
                )
            })
        })
        .collect();
    let caption = format!(
        "{} MiB VM, {} MiB of data, {} s idle, {} rounds. Dot: median, whiskers: min–max, \
         diamond: the seed (N=1), red dashes: target.",
        settings.memory >> 20,
        settings.app >> 20,
        secs(settings.idle),
        settings.runs
    );
    Figure::new(caption)
        .panel(panel(
            "1. Memory charged at the end of the idle period, MiB (process memory: PSS, guest RAM as held)".into(),
            Scale::Linear,
            rows(results, "memory_mib"),
            one_decimal,
        ))
        .panel(panel(
            format!(
                "2. Cold VM's memory vs the default VM ({}), % (negative: saved)",
                DEFAULT.describe()
            ),
            Scale::Linear,
            change,
            one_decimal,
        ))
        .panel(panel(
            format!(
                "3. touch {} MiB after the idle period, ms (log scale)",
                settings.app >> 20
            ),
            Scale::Log,
            rows(results, "touch_ms"),
            one_decimal,
        ))
        .panel(panel(
            format!(
                "4. Pager CPU over the last {} s of the idle period, % of one core",
                secs(settings.window)
            ),
            Scale::Linear,
            cpu,
            two_decimals,
        ))
        .svg()
}
