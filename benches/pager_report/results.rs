//! Every figure of the bench: one value per run under a key, summarised as min/median/max.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The values of one quantity, one per run (NaN where a run did not measure it).
#[derive(Debug, Clone)]
pub struct Series {
    pub unit: &'static str,
    pub values: Vec<f64>,
}

#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub min: f64,
    pub median: f64,
    pub max: f64,
    /// Runs with a value.
    pub n: usize,
}

impl Summary {
    fn of(values: &[f64]) -> Self {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n == 0 {
            return Self {
                min: f64::NAN,
                median: f64::NAN,
                max: f64::NAN,
                n,
            };
        }
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Self {
            min: v[0],
            median,
            max: v[n - 1],
            n,
        }
    }
}

#[derive(Debug)]
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

    pub fn put(&mut self, key: &str, unit: &'static str, run: usize, value: f64) {
        let runs = self.runs;
        let series = self.series.entry(key.to_owned()).or_insert_with(|| Series {
            unit,
            values: vec![f64::NAN; runs],
        });
        series.values[run] = value;
    }

    pub fn values(&self, key: &str) -> &[f64] {
        self.series.get(key).map_or(&[], |s| s.values.as_slice())
    }

    pub fn has(&self, key: &str) -> bool {
        self.series.contains_key(key)
    }

    pub fn summary(&self, key: &str) -> Summary {
        Summary::of(self.values(key))
    }

    pub fn unit(&self, key: &str) -> &'static str {
        self.series.get(key).map_or("", |s| s.unit)
    }

    /// Adds `key` = `num / den`, run by run.
    pub fn ratio(&mut self, key: &str, num: &str, den: &str) {
        let values: Vec<f64> = self
            .values(num)
            .iter()
            .zip(self.values(den))
            .map(|(&a, &b)| a / b)
            .collect();
        for (run, value) in values.into_iter().enumerate() {
            self.put(key, "×", run, value);
        }
    }

    /// Runs whose value of `key` satisfies `ok`.
    pub fn count(&self, key: &str, ok: impl Fn(f64) -> bool) -> usize {
        self.values(key)
            .iter()
            .filter(|&&v| !v.is_nan() && ok(v))
            .count()
    }

    /// `key,unit,min,median,max,run1..runN`.
    pub fn csv(&self) -> String {
        let mut out = String::from("key,unit,min,median,max");
        for run in 1..=self.runs {
            let _ = write!(out, ",run{run}");
        }
        out.push('\n');
        for (key, series) in &self.series {
            let s = Summary::of(&series.values);
            let _ = write!(
                out,
                "{key},{},{},{},{}",
                series.unit,
                num(s.min),
                num(s.median),
                num(s.max)
            );
            for &v in &series.values {
                let _ = write!(out, ",{}", num(v));
            }
            out.push('\n');
        }
        out
    }
}

fn num(v: f64) -> String {
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

/// A figure for a table: 3 significant digits, `∞` for an infinite ratio.
pub fn fmt(v: f64) -> String {
    if v.is_nan() {
        "–".to_owned()
    } else if v.is_infinite() {
        "∞".to_owned()
    } else if v == 0.0 {
        "0".to_owned()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}
