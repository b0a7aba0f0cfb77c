//! The measured series (one value per run), the series derived from them run by run
//! (speeds, ratios), their min/median/max summaries and the CSV.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::measure::Measured;
use crate::plan::{self, MemOp, Side, DECODERS, MEMCPY, MEMORY_CONTENTS, MIB, SIZE_STORES};

pub struct Series {
    pub unit: &'static str,
    /// One value per run (NaN where a run has none).
    pub values: Vec<f64>,
}

#[derive(Clone, Copy)]
pub struct Summary {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Summary {
    const NONE: Summary = Summary {
        min: f64::NAN,
        median: f64::NAN,
        max: f64::NAN,
    };
}

impl Series {
    fn summary(&self) -> Summary {
        let mut sorted: Vec<f64> = self
            .values
            .iter()
            .copied()
            .filter(|v| !v.is_nan())
            .collect();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        if n == 0 {
            return Summary::NONE;
        }
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Summary {
            min: sorted[0],
            median,
            max: sorted[n - 1],
        }
    }
}

pub struct Results {
    pub runs: usize,
    series: BTreeMap<String, Series>,
}

impl Results {
    pub fn new(runs: usize) -> Self {
        Self {
            runs,
            series: BTreeMap::new(),
        }
    }

    pub fn record(&mut self, run: usize, key: &str, unit: &'static str, value: f64) {
        let runs = self.runs;
        let series = self.series.entry(key.to_owned()).or_insert_with(|| Series {
            unit,
            values: vec![f64::NAN; runs],
        });
        series.values[run] = value;
    }

    /// Records the time (`key("time")`) and the minor page faults (`key("faults")`) of a
    /// timed section.
    pub fn record_timed(&mut self, run: usize, key: impl Fn(&str) -> String, measured: Measured) {
        self.record(run, &key("time"), "s", measured.seconds);
        let faults = measured.minor_faults as f64;
        self.record(run, &key("faults"), "faults", faults);
    }

    /// Runs whose value of `key` satisfies `ok`.
    pub fn runs_where(&self, key: &str, ok: impl Fn(f64) -> bool) -> usize {
        self.series
            .get(key)
            .map_or(0, |s| s.values.iter().filter(|&&v| ok(v)).count())
    }

    pub fn summary(&self, key: &str) -> Summary {
        self.series.get(key).map_or(Summary::NONE, Series::summary)
    }

    /// Adds the series `key`, computed run by run as `a / b`.
    fn ratio(&mut self, key: String, a: &str, b: &str) {
        let (Some(a), Some(b)) = (self.series.get(a), self.series.get(b)) else {
            return;
        };
        let values = a.values.iter().zip(&b.values).map(|(x, y)| x / y).collect();
        self.series.insert(key, Series { unit: "x", values });
    }

    /// Speeds and per-run ratios from the times and sizes.
    pub fn derive(&mut self, image: usize) {
        let mib = image as f64 / MIB;
        let speeds: Vec<(String, Series)> = self
            .series
            .iter()
            .filter_map(|(key, series)| {
                let speed = key.strip_prefix("time.")?;
                let values = series.values.iter().map(|&s| mib / s).collect();
                let unit = "MiB/s";
                Some((format!("speed.{speed}"), Series { unit, values }))
            })
            .collect();
        self.series.extend(speeds);
        for content in MEMORY_CONTENTS {
            let whole = MemOp::MemcpyWhole.key("time", content);
            let blocks = MemOp::MemcpyBlocks.key("time", content);
            self.ratio(plan::memcpy_ratio_key(content), &blocks, &whole);
            for codec in DECODERS {
                let decode = MemOp::Decode(codec).key("time", content);
                for memcpy in MEMCPY {
                    let key = plan::decode_ratio_key(codec, memcpy, content);
                    self.ratio(key, &memcpy.key("time", content), &decode);
                }
            }
        }
        for (op, case, content) in plan::comparisons() {
            let store = op.key("time", Side::Store(case), content);
            let raw = op.key("time", Side::Raw, content);
            self.ratio(op.cost_key(case, content), &store, &raw);
        }
        for (case, content) in SIZE_STORES {
            let store = plan::store_key(case, content);
            let raw = plan::key(&["size.raw", &store]);
            for (what, size) in [("stored", "size.stored"), ("disk", "size.disk")] {
                let ratio = format!("ratio.raw_per_{what}");
                self.ratio(
                    plan::key(&[&ratio, &store]),
                    &raw,
                    &plan::key(&[size, &store]),
                );
            }
        }
    }

    pub fn csv(&self) -> String {
        let mut out = String::from("metric,unit,min,median,max");
        for run in 1..=self.runs {
            let _ = write!(out, ",run_{run}");
        }
        out.push('\n');
        for (key, series) in &self.series {
            let s = series.summary();
            let _ = write!(
                out,
                "{key},{},{},{},{}",
                series.unit,
                num(s.min),
                num(s.median),
                num(s.max)
            );
            for value in &series.values {
                let _ = write!(out, ",{}", num(*value));
            }
            out.push('\n');
        }
        out
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
