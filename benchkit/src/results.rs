//! Every figure of a scenario bench: one value per run under a key, summarised as
//! min/median/max, and the CSV of them all, which [`Results::from_csv`] reads back (the render
//! mode of `render`).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

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
    /// Static when measured, owned when read back from a CSV.
    pub unit: Cow<'static, str>,
    pub values: Vec<f64>,
}

/// Every series of a bench, by key, with as many runs each.
#[derive(Debug, Clone)]
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
    /// A value; the empty string for NaN, `inf` and `-inf` for the infinities (what
    /// [`Results::from_csv`] reads back).
    pub number: fn(f64) -> String,
}

/// `key,unit,min,median,max,run1..runN`, numbers rounded to four decimals, written without
/// decimals where that leaves a whole number.
pub const KEY_RUN_CSV: CsvStyle = CsvStyle {
    key: "key",
    run: "run",
    number: csv_number,
};

fn csv_number(v: f64) -> String {
    if v.is_nan() {
        String::new()
    } else if v.is_infinite() {
        if v > 0.0 { "inf" } else { "-inf" }.to_owned()
    } else if v.abs() >= 1e15 {
        format!("{v:.4}")
    } else {
        // Rounded first, so that what is read back is written the same way again.
        let rounded = (v * 1e4).round() / 1e4;
        if rounded.fract() == 0.0 {
            format!("{rounded:.0}")
        } else {
            format!("{rounded:.4}")
        }
    }
}

/// A value of a CSV as [`CsvStyle::number`] writes it: NaN for the empty field.
fn parse_number(field: &str) -> Option<f64> {
    match field {
        "" => Some(f64::NAN),
        "inf" => Some(f64::INFINITY),
        "-inf" => Some(f64::NEG_INFINITY),
        _ => field.parse().ok(),
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
            unit: Cow::Borrowed(unit),
            values: vec![f64::NAN; runs],
        });
        series.values[run] = value;
    }

    /// Sets the values of `run` of every `(quantity, unit, value)` of `figures` under
    /// `prefix` (`PREFIX.QUANTITY`), as [`Results::put`] does.
    pub fn put_all<'a>(
        &mut self,
        prefix: &str,
        run: usize,
        figures: impl IntoIterator<Item = (&'a str, &'static str, f64)>,
    ) {
        for (quantity, unit, value) in figures {
            self.put(&format!("{prefix}.{quantity}"), unit, run, value);
        }
    }

    /// The results a CSV written by [`Results::csv`] in `style` holds: the exact inverse, as
    /// far as the CSV's numbers go (a value is read as written, four decimals at most). The
    /// min/median/max columns are checked against the runs'.
    pub fn from_csv(text: &str, style: &CsvStyle) -> Result<Self, String> {
        let mut lines = text.lines().filter(|line| !line.is_empty());
        let header = lines.next().ok_or("the CSV is empty")?;
        let heads: Vec<&str> = header.split(',').collect();
        let fixed = [style.key, "unit", "min", "median", "max"];
        if heads.len() < fixed.len() || heads[..fixed.len()] != fixed {
            return Err(format!(
                "the header `{header}` does not open with `{}`",
                fixed.join(",")
            ));
        }
        let runs = heads.len() - fixed.len();
        for (i, head) in heads[fixed.len()..].iter().enumerate() {
            if *head != format!("{}{}", style.run, i + 1) {
                return Err(format!(
                    "column {} is `{head}`, not a run",
                    fixed.len() + i + 1
                ));
            }
        }
        let mut results = Self::new(runs);
        for (row, line) in lines.enumerate() {
            let fields: Vec<&str> = line.split(',').collect();
            let at = || format!("row {} (`{line}`)", row + 1);
            if fields.len() != heads.len() {
                return Err(format!(
                    "{} has {} fields, the header {}",
                    at(),
                    fields.len(),
                    heads.len()
                ));
            }
            let numbers: Vec<f64> = fields[2..]
                .iter()
                .map(|field| {
                    parse_number(field)
                        .ok_or_else(|| format!("{}: `{field}` is not a number", at()))
                })
                .collect::<Result<_, _>>()?;
            let values = numbers[3..].to_vec();
            let summary = Summary::of(values.iter().copied()).unwrap_or(Summary::NONE);
            let same = |a: f64, b: f64| a.is_nan() && b.is_nan() || number_eq(a, b, style);
            if !(same(numbers[0], summary.min)
                && same(numbers[1], summary.median)
                && same(numbers[2], summary.max))
            {
                return Err(format!("{}: min/median/max do not match its runs", at()));
            }
            let key = fields[0].to_owned();
            if results.series.contains_key(&key) {
                return Err(format!("{}: `{key}` appears twice", at()));
            }
            let unit = Cow::Owned(fields[1].to_owned());
            results.series.insert(key, Series { unit, values });
        }
        Ok(results)
    }

    /// Sets the series `to` to a copy of `from` (nothing if `from` has none).
    pub fn copy(&mut self, from: &str, to: &str) {
        if let Some(series) = self.series.get(from).cloned() {
            self.series.insert(to.to_owned(), series);
        }
    }

    pub fn has(&self, key: &str) -> bool {
        self.series.contains_key(key)
    }

    /// One value per run; empty if `key` has none.
    pub fn values(&self, key: &str) -> &[f64] {
        self.series.get(key).map_or(&[], |s| s.values.as_slice())
    }

    pub fn unit(&self, key: &str) -> &str {
        self.series.get(key).map_or("", |s| &s.unit)
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
            // Summarised as written, so that the CSV read back is written the same again.
            let written = series.values.iter().map(|&v| parse_number(&number(v)));
            let s = Summary::of(written.map(|v| v.unwrap_or(f64::NAN))).unwrap_or(Summary::NONE);
            let _ = write!(
                out,
                "{key},{},{},{},{}",
                &series.unit,
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

/// Whether `a` and `b` read the same in a CSV of `style` (a median of two runs may have more
/// decimals than either).
fn number_eq(a: f64, b: f64, style: &CsvStyle) -> bool {
    (style.number)(a) == (style.number)(b)
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

/// Seconds of `d`: whole ones bare (`2`), else to the millisecond, trailing zeros cut (`0.6`,
/// `0.25`).
pub fn secs(d: Duration) -> String {
    let text = format!("{:.3}", d.as_secs_f64());
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
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

/// `v` to about three significant digits for a table: `123`, `12.3`, `1.23`, `0.123`; `∞` for
/// an infinite ratio, `–` for NaN.
pub fn sig3(v: f64) -> String {
    let a = v.abs();
    if a.is_nan() {
        return "–".to_owned();
    } else if a.is_infinite() {
        return "∞".to_owned();
    } else if a == 0.0 {
        return "0".to_owned();
    }
    let d = [100.0, 10.0, 1.0].iter().take_while(|&&at| a < at).count();
    format!("{v:.d$}")
}

/// The table `quantity | min | median | max` of `rows`, each `(label, key, bold)`: the label
/// (in bold where asked) with the series' unit, the figures written by `write`; a key with no
/// series is left out. An empty line ends it.
pub fn minmax_table(
    results: &Results,
    rows: &[(String, String, bool)],
    write: fn(f64) -> String,
) -> String {
    let mut out = "| quantity | min | median | max |\n|---|---:|---:|---:|\n".to_owned();
    for (label, key, bold) in rows.iter().filter(|(_, key, _)| results.has(key)) {
        let s = results.summary(key);
        let label = if *bold {
            format!("**{label}**")
        } else {
            label.clone()
        };
        let label = format!("{label} ({})", results.unit(key));
        let (min, median, max) = (write(s.min), write(s.median), write(s.max));
        let _ = writeln!(out, "| {label} | {min} | {median} | {max} |");
    }
    out + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_from_csv_reads_back_what_csv_wrote() {
        let mut results = Results::new(4);
        for (run, v) in [1.0, 2.5, f64::NAN, 123_456.789_01].into_iter().enumerate() {
            results.put("a.window_s", "s", run, v);
        }
        results.put("b.ratio", "%", 1, f64::INFINITY);
        results.put("b.ratio", "%", 2, f64::NEG_INFINITY);
        results.put("c.flag", "1 = passed", 0, 1.0);
        results.put("d.median", "GiB·s per task", 0, 0.000_04);
        results.put("d.median", "GiB·s per task", 1, 0.000_05);
        let csv = results.csv(&KEY_RUN_CSV);

        let back = Results::from_csv(&csv, &KEY_RUN_CSV).expect("reads back");

        assert_eq!(back.csv(&KEY_RUN_CSV), csv);
        assert_eq!(back.runs, 4);
        assert_eq!(back.unit("d.median"), "GiB·s per task");
        assert_eq!(back.values("a.window_s")[1], 2.5);
        assert!(back.values("a.window_s")[2].is_nan());
        assert_eq!(back.values("b.ratio")[2], f64::NEG_INFINITY);
        assert_eq!(back.summary("c.flag").n, 1);
    }

    #[test]
    fn secs_are_whole_or_to_the_millisecond() {
        let ms = |ms| secs(Duration::from_millis(ms));
        assert_eq!(ms(12_000), "12");
        assert_eq!(ms(600), "0.6");
        assert_eq!(ms(250), "0.25");
        assert_eq!(ms(1_001), "1.001");
        assert_eq!(ms(0), "0");
    }

    #[test]
    fn results_from_csv_names_what_is_wrong() {
        let bad = |text: &str| Results::from_csv(text, &KEY_RUN_CSV).expect_err(text);
        assert!(bad("").contains("empty"));
        assert!(bad("metric,unit,run,value\n").contains("header"));
        assert!(bad("key,unit,min,median,max,run1,round2\n").contains("column 7"));
        assert!(bad("key,unit,min,median,max,run1\nx,s,1,1,1\n").contains("row 1"));
        assert!(bad("key,unit,min,median,max,run1\nx,s,1,1,1,z\n").contains("`z`"));
        assert!(bad("key,unit,min,median,max,run1\nx,s,2,1,2,1\n").contains("min/median/max"));
        assert!(bad("key,unit,min,median,max,run1\nx,s,1,1,1,1\nx,s,1,1,1,1\n").contains("twice"));
    }

    #[test]
    fn minmax_table_writes_a_row_per_measured_key_with_its_unit() {
        let mut results = Results::new(3);
        for (run, v) in [0.5, f64::INFINITY, 1234.4].into_iter().enumerate() {
            results.put("a", "ms", run, v);
        }
        let rows = [
            ("A".into(), "a".into(), true),
            ("B".into(), "b".into(), false),
        ];

        let table = minmax_table(&results, &rows, sig3);

        assert!(table.ends_with("| **A** (ms) | 0.500 | 1234 | ∞ |\n\n"));
        assert_eq!(table.lines().count(), 4);
        assert_eq!(
            [sig3(f64::NAN), sig3(0.0), sig3(-12.34)],
            ["–", "0", "-12.3"]
        );
    }
}
