//! How this bench writes its figures: the CSV style and the numbers of the tables; the series
//! themselves are `common::results`.

pub use crate::common::results::{num, Results};

/// `key,unit,min,median,max,run1..runN`.
pub use crate::common::results::KEY_RUN_CSV as CSV;

/// Seconds of `d`: whole ones without decimals (`4`), else one decimal (`0.4`).
pub fn secs(d: std::time::Duration) -> String {
    let s = d.as_secs_f64();
    num(s, if s.fract() == 0.0 { 0 } else { 1 })
}

/// `v` with `d` decimals and its sign: `+18.2`, `-60.1`.
pub fn signed(v: f64, d: usize) -> String {
    let text = num(v, d);
    if v > 0.0 && text != "–" && text.parse::<f64>() != Ok(0.0) {
        format!("+{text}")
    } else {
        text
    }
}

/// `median (min–max)` of `key` with `d` decimals, or `–`.
pub fn fig(results: &Results, key: &str, d: usize) -> String {
    let s = results.summary(key);
    if s.n == 0 {
        return "–".to_owned();
    }
    let (min, max) = (num(s.min, d), num(s.max, d));
    let sep = if min.starts_with('-') || max.starts_with('-') {
        " to "
    } else {
        "–"
    };
    format!("{} ({min}{sep}{max})", num(s.median, d))
}

/// `fig` with signs: `-91.2 (-91.5 to -90.8)`.
pub fn signed_fig(results: &Results, key: &str, d: usize) -> String {
    let s = results.summary(key);
    if s.n == 0 {
        return "–".to_owned();
    }
    format!(
        "{} ({} to {})",
        signed(s.median, d),
        signed(s.min, d),
        signed(s.max, d)
    )
}
