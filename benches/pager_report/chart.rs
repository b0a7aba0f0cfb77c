//! The chart of the report: medians as dots with min–max whiskers on log scales, a dashed
//! mark at each target.

use crate::common::chart::{Figure, Row, Rows, Scale, BLUE};
use crate::common::results::{sig3, Results};
use crate::common::Res;
use crate::latency::Source;
use crate::restore::Who;
use crate::Settings;

/// A row of the figures under `key`.
fn bar(results: &Results, label: String, key: &str) -> Row {
    Row::new(label, results.summary(key), BLUE)
}

/// A panel of `rows` on a log axis.
fn panel(title: &str, rows: Vec<Row>) -> Rows {
    Rows {
        tick: sig3,
        value: Some(sig3),
        plot: (430, 470),
        ..Rows::new(title, Scale::Log, rows)
    }
}

pub fn svg(results: &Results, settings: &Settings) -> Res<String> {
    let latency = Source::ALL.iter().flat_map(|s| {
        let (s, k) = (s.key(), format!("latency.{}.t1.c1", s.key()));
        [("touching thread", "touch"), ("pager histogram", "pager")].map(|(who, q)| {
            bar(
                results,
                format!("{s}: {who} p50"),
                &format!("{k}.{q}_p50_us"),
            )
        })
    });
    let restore = ["lazy", "full"].iter().flat_map(|touch| {
        Who::ALL.iter().map(move |who| {
            let (label, key) = (who.key().replace('_', " "), who.key());
            bar(
                results,
                format!("{touch}: {label}"),
                &format!("restore.{touch}.{key}.ms"),
            )
        })
    });
    let ratios = crate::targets::goals(results, settings)
        .into_iter()
        .filter_map(|goal| {
            let label = format!("{} ({})", goal.chart?, goal.target.short());
            let target = Some(goal.target.threshold);
            Some(Row {
                target,
                ..bar(results, label, &goal.target.key)
            })
        })
        .collect();
    let caption = format!(
        "uffd-pager, {} runs: dot = median, whisker = min–max, log scales",
        results.runs
    );
    Figure::new(caption)
        .panel(panel(
            "1. Fault latency p50, µs (one fault per 64 KiB block)",
            latency.collect(),
        ))
        .panel(panel(
            "2. Restore, first touch to last, ms (512 MiB image)",
            restore.collect(),
        ))
        .panel(panel(
            "Targets: per-run ratios (dashed red: the target)",
            ratios,
        ))
        .svg()
}
