//! The series derived run by run from the measured ones (speeds, ratios), and how the CSV
//! writes them; the series, their min/median/max summaries and the CSV are
//! `common::results`.

pub use crate::common::results::Results;

use crate::common::results::CsvStyle;
use crate::measure::Measured;
use crate::plan::{self, MemOp, Side, DECODERS, MEMCPY, MEMORY_CONTENTS, MIB, SIZE_STORES};

/// `metric,unit,min,median,max,run_1..run_N`.
pub const CSV: CsvStyle = CsvStyle {
    key: "metric",
    run: "run_",
    number: num,
};

/// Records the time (`key("time")`) and the minor page faults (`key("faults")`) of a timed
/// section.
pub fn record_timed(
    results: &mut Results,
    run: usize,
    key: impl Fn(&str) -> String,
    measured: Measured,
) {
    results.put(&key("time"), "s", run, measured.seconds);
    let faults = measured.minor_faults as f64;
    results.put(&key("faults"), "faults", run, faults);
}

/// Adds the series `key`, computed run by run as `a / b`.
fn ratio(results: &mut Results, key: String, a: &str, b: &str) {
    results.ratio(&key, a, b, "x");
}

/// Adds the speeds and the per-run ratios, from the times and sizes.
pub fn derive(results: &mut Results, image: usize) {
    let mib = image as f64 / MIB;
    let speeds: Vec<(String, Vec<f64>)> = results
        .series()
        .filter_map(|(key, series)| {
            let speed = key.strip_prefix("time.")?;
            let values = series.values.iter().map(|&s| mib / s).collect();
            Some((format!("speed.{speed}"), values))
        })
        .collect();
    for (key, values) in speeds {
        for (run, value) in values.into_iter().enumerate() {
            results.put(&key, "MiB/s", run, value);
        }
    }
    for content in MEMORY_CONTENTS {
        let whole = MemOp::MemcpyWhole.key("time", content);
        let blocks = MemOp::MemcpyBlocks.key("time", content);
        ratio(results, plan::memcpy_ratio_key(content), &blocks, &whole);
        for codec in DECODERS {
            let decode = MemOp::Decode(codec).key("time", content);
            for memcpy in MEMCPY {
                let key = plan::decode_ratio_key(codec, memcpy, content);
                ratio(results, key, &memcpy.key("time", content), &decode);
            }
        }
    }
    for (op, case, content) in plan::comparisons() {
        let store = op.key("time", Side::Store(case), content);
        let raw = op.key("time", Side::Raw, content);
        ratio(results, op.cost_key(case, content), &store, &raw);
    }
    for (case, content) in SIZE_STORES {
        let store = plan::store_key(case, content);
        let raw = plan::key(&["size.raw", &store]);
        for (what, size) in [("stored", "size.stored"), ("disk", "size.disk")] {
            let key = format!("ratio.raw_per_{what}");
            ratio(
                results,
                plan::key(&[&key, &store]),
                &raw,
                &plan::key(&[size, &store]),
            );
        }
    }
}

/// A number for the CSV: integers as integers, others with 6 significant digits.
fn num(value: f64) -> String {
    if value.is_nan() {
        String::new()
    } else if value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{value:.0}")
    } else {
        format!("{value:.6e}")
    }
}
