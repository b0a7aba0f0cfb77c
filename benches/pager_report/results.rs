//! How this bench writes its figures: the CSV style and the numbers of the tables; the series
//! themselves are `common::results`.

pub use crate::common::results::Results;

/// `key,unit,min,median,max,run1..runN`.
pub use crate::common::results::KEY_RUN_CSV as CSV;

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
