//! A target of an issue, judged: what every scenario bench's report shows in its table of
//! targets, and that table; and a target on one figure of the results as data ([`Target`]),
//! judged over the runs ([`Judged`]).

use std::fmt::Write;

use crate::results::{Results, Summary};

/// One target, its measured figure and the verdict on it.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub target: String,
    pub figure: String,
    /// `met`, `**PASS**`, `not measured`, …: each bench's words for its verdicts.
    pub result: &'static str,
}

/// A bench's words for a verdict: not measured, met, missed.
pub type Words = [&'static str; 3];

/// `NOT MEASURED`, `PASS`, `FAIL`.
pub const PASS_FAIL: Words = ["NOT MEASURED", "PASS", "FAIL"];

/// [`PASS_FAIL`], the two verdicts in bold.
pub const BOLD_PASS_FAIL: Words = ["NOT MEASURED", "**PASS**", "**FAIL**"];

/// `words`' first when not `measured`, else its second when `met`, else its third.
pub fn result(measured: bool, met: bool, words: Words) -> &'static str {
    match (measured, met) {
        (false, _) => words[0],
        (true, true) => words[1],
        (true, false) => words[2],
    }
}

/// A target on the median of one figure of a bench's results: at most (`at_most`), or else
/// at least, `threshold` in the figure's unit.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// The key of the figure judged.
    pub key: String,
    pub at_most: bool,
    pub threshold: f64,
}

impl Target {
    /// The median of `key` at most `threshold`.
    pub fn at_most(key: impl Into<String>, threshold: f64) -> Self {
        let (key, at_most) = (key.into(), true);
        Self {
            key,
            at_most,
            threshold,
        }
    }

    /// The median of `key` at least `threshold`.
    pub fn at_least(key: impl Into<String>, threshold: f64) -> Self {
        let (key, at_most) = (key.into(), false);
        Self {
            key,
            at_most,
            threshold,
        }
    }

    /// Whether `value` meets the target (never NaN).
    pub fn meets(&self, value: f64) -> bool {
        if self.at_most {
            value <= self.threshold
        } else {
            value >= self.threshold
        }
    }

    /// `≤ 1.3`, `≥ 3`: the target in short, as a chart's label gives it.
    pub fn short(&self) -> String {
        let sign = if self.at_most { "≤" } else { "≥" };
        format!("{sign} {}", self.threshold)
    }

    /// The target judged over the runs of `results`: the figure's summary, the runs that meet
    /// the target, and the verdict on the median in `words`.
    pub fn judge(&self, results: &Results, words: Words) -> (Summary, usize, &'static str) {
        let s = results.summary(&self.key);
        let meeting = results.count(&self.key, |v| self.meets(v));
        (s, meeting, result(s.n > 0, self.meets(s.median), words))
    }
}

/// Says each of `verdicts` on stderr: `BENCH: TARGET: RESULT (FIGURE)`.
pub fn log(bench: &str, verdicts: &[Verdict]) {
    for v in verdicts {
        eprintln!("{bench}: {}: {} ({})", v.target, v.result, v.figure);
    }
}

/// `## {heading}` and the table of `verdicts`, whose figure column is headed `figure`; with
/// `bold`, each result in bold.
pub fn table(heading: &str, figure: &str, verdicts: &[Verdict], bold: bool) -> String {
    let mut t = format!("## {heading}\n\n| target | {figure} | result |\n|---|---|---|\n");
    for v in verdicts {
        let result = if bold {
            format!("**{}**", v.result)
        } else {
            v.result.to_owned()
        };
        let _ = writeln!(t, "| {} | {} | {result} |", v.target, v.figure);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_is_judged_on_its_median_and_counts_the_runs_that_meet_it() {
        let mut r = Results::new(5);
        for (run, v) in [1.0, 3.0, f64::NAN, 2.0, 5.0].into_iter().enumerate() {
            r.put("x.pct", "%", run, v);
        }

        let (s, meeting, verdict) = Target::at_most("x.pct", 2.5).judge(&r, PASS_FAIL);
        let least = Target::at_least("x.pct", 3.0);
        let none = Target::at_least("y.pct", 0.0).judge(&r, PASS_FAIL);

        assert_eq!((s.n, s.median, meeting, verdict), (4, 2.5, 2, "PASS"));
        assert_eq!(least.judge(&r, PASS_FAIL).2, "FAIL");
        assert_eq!((none.0.n, none.2), (0, "NOT MEASURED"));
        assert_eq!(least.short(), "≥ 3");
    }
}
