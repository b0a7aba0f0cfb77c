//! How this bench writes its figures: the CSV style and the numbers of the tables; the series
//! themselves are `common::results`.

use std::time::Duration;

pub use crate::common::results::Results;

/// `key,unit,min,median,max,run1..runN`.
pub use crate::common::results::KEY_RUN_CSV as CSV;

/// `v` to `d` decimals; `–` when not a number; never `-0`.
pub fn num(v: f64, d: usize) -> String {
    match v {
        v if v.is_nan() => "–".to_owned(),
        // Rounds to zero: no sign.
        v if (v * 10f64.powf(d as f64)).round() == 0.0 => format!("{:.d$}", 0.0),
        v => format!("{v:.d$}"),
    }
}

/// `2`, `0.5`: whole seconds bare, else to the millisecond, trailing zeros cut.
pub fn secs(d: Duration) -> String {
    let text = format!("{:.3}", d.as_secs_f64());
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// The summary of `key` as text: `median (min–max)`; the value alone after one round; `–`
/// when nothing was measured.
pub fn fig(results: &Results, key: &str, d: usize) -> String {
    let s = results.summary(key);
    match s.n {
        0 => "–".to_owned(),
        1 => num(s.median, d),
        _ => {
            // A dash between negative numbers would read as a minus sign.
            let to = if s.min < 0.0 { " to " } else { "–" };
            format!(
                "{} ({}{to}{})",
                num(s.median, d),
                num(s.min, d),
                num(s.max, d)
            )
        }
    }
}
