//! A target of an issue, judged: what every scenario bench's report shows in its table of
//! targets, and that table.

use std::fmt::Write;

/// One target, its measured figure and the verdict on it.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub target: String,
    pub figure: String,
    /// `met`, `**PASS**`, `not measured`, …: each bench's words for its verdicts.
    pub result: &'static str,
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
