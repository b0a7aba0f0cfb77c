//! Samples per metric and run (sparse: a run that did not measure a metric has no entry),
//! their summaries (`common::results::Summary`, of the finite values) and the long-form CSV,
//! which `Results::from_csv` reads back (render mode; this bench's CSV is its own form, not
//! the kit's `key,unit,min,median,max,runs` one).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;

pub use crate::common::results::Summary;

/// One metric: its unit and one value per run that measured it.
#[derive(Debug, Clone)]
pub struct Metric {
    /// Static when measured, owned when read back.
    pub unit: Cow<'static, str>,
    pub values: Vec<(usize, f64)>,
}

/// Every sample of the bench, keyed `scope.content.case.quantity`.
#[derive(Debug, Default)]
pub struct Results {
    metrics: BTreeMap<String, Metric>,
}

impl Results {
    pub fn put(&mut self, key: &str, unit: &'static str, run: usize, value: f64) {
        self.metrics
            .entry(key.to_owned())
            .or_insert_with(|| Metric {
                unit: Cow::Borrowed(unit),
                values: Vec::new(),
            })
            .values
            .push((run, value));
    }

    pub fn value(&self, key: &str, run: usize) -> Option<f64> {
        self.metrics
            .get(key)?
            .values
            .iter()
            .find(|&&(r, _)| r == run)
            .map(|&(_, v)| v)
    }

    pub fn values(&self, key: &str) -> Vec<f64> {
        self.metrics
            .get(key)
            .map(|m| m.values.iter().map(|&(_, v)| v).collect())
            .unwrap_or_default()
    }

    /// The summary of the finite values of `key`.
    pub fn summary(&self, key: &str) -> Option<Summary> {
        Summary::of(self.values(key).into_iter().filter(|v| v.is_finite()))
    }

    /// How many runs have a value of `key` satisfying `pred`.
    pub fn count(&self, key: &str, pred: impl Fn(f64) -> bool) -> usize {
        self.values(key).into_iter().filter(|&v| pred(v)).count()
    }

    /// For every run that has both, puts `numerator / denominator` as `key`.
    pub fn ratio(&mut self, key: &str, numerator: &str, denominator: &str, runs: usize) {
        for run in 0..runs {
            if let (Some(a), Some(b)) = (self.value(numerator, run), self.value(denominator, run)) {
                if b > 0.0 {
                    self.put(key, "×", run, a / b);
                }
            }
        }
    }

    /// For every run that has both, puts `a - b` as `key`.
    pub fn difference(&mut self, key: &str, a: &str, b: &str, unit: &'static str, runs: usize) {
        for run in 0..runs {
            if let (Some(x), Some(y)) = (self.value(a, run), self.value(b, run)) {
                self.put(key, unit, run, x - y);
            }
        }
    }

    /// Long-form CSV: one line per metric and run, then one per metric's summary.
    pub fn csv(&self) -> String {
        let mut text = String::from("metric,unit,run,value\n");
        for (key, metric) in &self.metrics {
            for &(run, value) in &metric.values {
                let _ = writeln!(text, "{key},{},{run},{value:.6}", metric.unit);
            }
        }
        for (key, metric) in &self.metrics {
            let values = metric.values.iter().map(|&(_, v)| v);
            if let Some(s) = Summary::of(values.filter(|v| v.is_finite())) {
                let unit = &metric.unit;
                let _ = writeln!(text, "{key},{unit},min,{:.6}", s.min);
                let _ = writeln!(text, "{key},{unit},median,{:.6}", s.median);
                let _ = writeln!(text, "{key},{unit},max,{:.6}", s.max);
            }
        }
        text
    }

    /// The results a CSV written by `csv` holds: its lines of runs (six decimals, as written);
    /// the summary lines are checked to be of known metrics, and left, as `csv` writes them
    /// again from the runs.
    pub fn from_csv(text: &str) -> Result<Self, String> {
        let mut lines = text.lines();
        if lines.next() != Some("metric,unit,run,value") {
            return Err("the CSV does not open with `metric,unit,run,value`".into());
        }
        let mut results = Self::default();
        for (i, line) in lines.enumerate().filter(|(_, l)| !l.is_empty()) {
            let at = || format!("line {} (`{line}`)", i + 2);
            let [key, unit, run, value] = line.split(',').collect::<Vec<_>>()[..] else {
                return Err(format!("{}: not four fields", at()));
            };
            let value: f64 = value
                .parse()
                .map_err(|_| format!("{}: not a number", at()))?;
            if ["min", "median", "max"].contains(&run) {
                if !results.metrics.contains_key(key) {
                    return Err(format!("{}: a summary of no runs", at()));
                }
                continue;
            }
            let run: usize = run.parse().map_err(|_| format!("{}: no run", at()))?;
            let metric = results
                .metrics
                .entry(key.to_owned())
                .or_insert_with(|| Metric {
                    unit: Cow::Owned(unit.to_owned()),
                    values: Vec::new(),
                });
            metric.values.push((run, value));
        }
        Ok(results)
    }

    /// Whether some metric's key starts with `prefix`.
    pub fn has_prefix(&self, prefix: &str) -> bool {
        self.metrics.keys().any(|key| key.starts_with(prefix))
    }

    /// Runs: one more than the highest run any metric has.
    pub fn runs(&self) -> usize {
        let last = self
            .metrics
            .values()
            .flat_map(|m| m.values.iter().map(|&(run, _)| run));
        last.max().map_or(0, |run| run + 1)
    }
}
