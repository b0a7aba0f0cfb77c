//! Every figure of a scenario bench: one value per run under a key, summarised as
//! min/median/max, and the CSV of them all.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// min / median / max of a quantity's values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub min: f64,
    pub median: f64,
    pub max: f64,
    /// Values summarised.
    pub n: usize,
}

impl Summary {
    /// Nothing measured: NaN figures of no value.
    pub const NONE: Summary = Summary {
        min: f64::NAN,
        median: f64::NAN,
        max: f64::NAN,
        n: 0,
    };

    /// The summary of `values`, NaN left out; `None` when no value is left.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Self> {
        let mut sorted: Vec<f64> = values.into_iter().filter(|v| !v.is_nan()).collect();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let (&min, &max) = (sorted.first()?, sorted.last()?);
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Some(Self {
            min,
            median,
            max,
            n,
        })
    }
}

/// The values of one quantity, one per run (NaN where a run did not measure it).
#[derive(Debug, Clone)]
pub struct Series {
    pub unit: &'static str,
    pub values: Vec<f64>,
}

/// Every series of a bench, by key, with as many runs each.
#[derive(Debug)]
pub struct Results {
    pub runs: usize,
    series: BTreeMap<String, Series>,
}

/// How a bench writes its CSV: `KEY,unit,min,median,max,RUN1..RUNn`, a line per series.
#[derive(Debug, Clone, Copy)]
pub struct CsvStyle {
    /// Heading of the first column.
    pub key: &'static str,
    /// Heading of the run columns, before the run's number (from 1).
    pub run: &'static str,
    /// A value; the empty string for NaN.
    pub number: fn(f64) -> String,
}

/// `key,unit,min,median,max,run1..runN`, whole numbers without decimals, others with four.
pub const KEY_RUN_CSV: CsvStyle = CsvStyle {
    key: "key",
    run: "run",
    number: csv_number,
};

fn csv_number(v: f64) -> String {
    if v.is_nan() {
        String::new()
    } else if v.is_infinite() {
        "inf".to_owned()
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v:.4}")
    }
}

impl Results {
    pub fn new(runs: usize) -> Self {
        Self {
            runs,
            series: BTreeMap::new(),
        }
    }

    /// Sets the value of `key` in `run`; `unit` is the series' unit if `key` is new.
    pub fn put(&mut self, key: &str, unit: &'static str, run: usize, value: f64) {
        let runs = self.runs;
        let series = self.series.entry(key.to_owned()).or_insert_with(|| Series {
            unit,
            values: vec![f64::NAN; runs],
        });
        series.values[run] = value;
    }

    pub fn has(&self, key: &str) -> bool {
        self.series.contains_key(key)
    }

    /// One value per run; empty if `key` has none.
    pub fn values(&self, key: &str) -> &[f64] {
        self.series.get(key).map_or(&[], |s| s.values.as_slice())
    }

    pub fn unit(&self, key: &str) -> &'static str {
        self.series.get(key).map_or("", |s| s.unit)
    }

    /// Every series, in key order.
    pub fn series(&self) -> impl Iterator<Item = (&str, &Series)> {
        self.series
            .iter()
            .map(|(key, series)| (key.as_str(), series))
    }

    /// The summary of `key`; `Summary::NONE` if it has no value.
    pub fn summary(&self, key: &str) -> Summary {
        Summary::of(self.values(key).iter().copied()).unwrap_or(Summary::NONE)
    }

    /// The round whose value of `key` is nearest its median (0 if it has no value): the round
    /// a report's charts show.
    pub fn median_round(&self, key: &str) -> usize {
        let median = self.summary(key).median;
        self.values(key)
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .min_by(|(_, a), (_, b)| (*a - median).abs().total_cmp(&(*b - median).abs()))
            .map_or(0, |(round, _)| round)
    }

    /// Runs whose value of `key` satisfies `ok`.
    pub fn count(&self, key: &str, ok: impl Fn(f64) -> bool) -> usize {
        self.values(key)
            .iter()
            .filter(|&&v| !v.is_nan() && ok(v))
            .count()
    }

    /// Adds `key` = `num / den` in `unit`, run by run (nothing if either is missing).
    pub fn ratio(&mut self, key: &str, num: &str, den: &str, unit: &'static str) {
        let values: Vec<f64> = self
            .values(num)
            .iter()
            .zip(self.values(den))
            .map(|(&a, &b)| a / b)
            .collect();
        for (run, value) in values.into_iter().enumerate() {
            self.put(key, unit, run, value);
        }
    }

    /// The CSV, in key order.
    pub fn csv(&self, style: &CsvStyle) -> String {
        let number = style.number;
        let mut out = format!("{},unit,min,median,max", style.key);
        for run in 1..=self.runs {
            let _ = write!(out, ",{}{run}", style.run);
        }
        out.push('\n');
        for (key, series) in &self.series {
            let s = Summary::of(series.values.iter().copied()).unwrap_or(Summary::NONE);
            let _ = write!(
                out,
                "{key},{},{},{},{}",
                series.unit,
                number(s.min),
                number(s.median),
                number(s.max)
            );
            for &value in &series.values {
                let _ = write!(out, ",{}", number(value));
            }
            out.push('\n');
        }
        out
    }
}

/// `v` with `d` decimals; `–` for NaN; a value that rounds to zero reads `0`, never `-0`.
pub fn num(v: f64, d: usize) -> String {
    if v.is_nan() {
        return "–".to_owned();
    }
    let text = format!("{v:.d$}");
    if text.parse::<f64>() == Ok(0.0) {
        text.trim_start_matches('-').to_owned()
    } else {
        text
    }
}

/// `v` with `d` decimals and its sign when not zero: `+18.2`, `-60.1`, `0.0`.
pub fn signed(v: f64, d: usize) -> String {
    let text = num(v, d);
    if v > 0.0 && text.parse::<f64>().is_ok_and(|p| p != 0.0) {
        format!("+{text}")
    } else {
        text
    }
}

/// The summary of `key` as `median (min–max)` with `d` decimals, each written by `write`
/// (`num`, `signed`); the value alone after one run; `–` when nothing was measured. Negative
/// bounds are joined by ` to `, not by a dash that would read as a minus sign.
pub fn fig_with(results: &Results, key: &str, d: usize, write: fn(f64, usize) -> String) -> String {
    let s = results.summary(key);
    match s.n {
        0 => "–".to_owned(),
        1 => write(s.median, d),
        _ => {
            let (min, max) = (write(s.min, d), write(s.max, d));
            let signs = [&min, &max].iter().any(|t| t.starts_with(['-', '+']));
            let to = if signs { " to " } else { "–" };
            format!("{} ({min}{to}{max})", write(s.median, d))
        }
    }
}

/// `fig_with(…, num)`: `0.98 (0.95–1.02)`.
pub fn fig(results: &Results, key: &str, d: usize) -> String {
    fig_with(results, key, d, num)
}

/// `fig_with(…, signed)`: `+4.1 (-2.0 to +9.3)`.
pub fn signed_fig(results: &Results, key: &str, d: usize) -> String {
    fig_with(results, key, d, signed)
}
