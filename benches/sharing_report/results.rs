//! How this bench writes its figures: the CSV style and the numbers of the tables; the series
//! themselves and their text are `common::results`.

pub use crate::common::results::{num, secs, Results};

/// `key,unit,min,median,max,run1..runN`.
pub use crate::common::results::KEY_RUN_CSV as CSV;

/// `common::results::fig`, except that a range whose least value is below zero is joined by ` to `
/// even where that value reads `0.0`: this report's savings so show a loss, however small.
pub fn fig(results: &Results, key: &str, d: usize) -> String {
    let s = results.summary(key);
    if s.n > 1 && s.min < 0.0 {
        let [median, min, max] = [s.median, s.min, s.max].map(|v| num(v, d));
        format!("{median} ({min} to {max})")
    } else {
        crate::common::results::fig(results, key, d)
    }
}
