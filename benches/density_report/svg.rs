//! The chart: for each budget, the memory cgroup usage of all the VMs over time, one curve
//! per strategy at its density N (the budgeted run in the round of the median window), against
//! the budget as a dashed line.

use crate::common::results::{num, Summary};
use crate::common::svg::{document, heading, legend, memory_time_frame, text, LineChart};
use crate::plan::Job;
use crate::report::{size_text, Context};
use crate::Measured;

const WIDTH: f64 = 980.0;
const PLOT_X: f64 = 80.0;
const PLOT_W: f64 = 860.0;
const PLOT_H: f64 = 260.0;
const GIB: f64 = (1u64 << 30) as f64;
const BUDGET_STYLE: &str = r##"stroke="#c00" stroke-width="1.4" stroke-dasharray="7,4""##;

/// The stroke of the `i`-th strategy's curve.
fn style(i: usize) -> &'static str {
    const STYLES: [&str; 5] = [
        r##"stroke="#369" stroke-width="1.8""##,
        r##"stroke="#c63" stroke-width="1.8""##,
        r##"stroke="#283" stroke-width="1.8""##,
        r##"stroke="#a4c" stroke-width="1.8""##,
        r##"stroke="#111" stroke-width="2.2""##,
    ];
    STYLES[i % STYLES.len()]
}

/// The budgeted run of `job` with `vms` VMs whose window is the median of its rounds (the
/// lower of the two middle ones).
pub fn median_run<'a>(cx: &Context<'a>, job: Job, vms: usize) -> Option<&'a Measured> {
    let mut runs: Vec<&Measured> = cx
        .log
        .runs
        .iter()
        .filter(|m| m.job == job && m.vms == vms && m.timeline.is_some())
        .collect();
    runs.sort_by(|a, b| a.facts.window_s.total_cmp(&b.facts.window_s));
    let middle = runs.len().checked_sub(1)? / 2;
    runs.get(middle).copied()
}

/// The panel of budget `b`; returns the y below it.
fn panel(out: &mut String, cx: &Context<'_>, y0: f64, b: usize) -> f64 {
    let s = cx.settings;
    let (_, bytes) = s.budgets[b];
    let budget_gib = bytes as f64 / GIB;
    let mut curves: Vec<(usize, Vec<(f64, f64)>)> = Vec::new();
    let mut entries: Vec<(&str, String)> = Vec::new();
    for (i, strategy) in s.strategies.iter().enumerate() {
        let Some(density) = cx.log.density(b, i) else {
            continue;
        };
        let job = Job {
            strategy: i,
            budget: Some(b),
        };
        let run = (density.vms > 0)
            .then(|| median_run(cx, job, density.vms))
            .flatten();
        match run.and_then(|m| Some((m, m.timeline.as_ref()?))) {
            Some((m, timeline)) => {
                let points = timeline.points(true);
                let peak = Summary::of(points.iter().map(|&(_, v)| v)).map_or(f64::NAN, |s| s.max);
                entries.push((
                    style(i),
                    format!(
                        "{strategy}, N={} (round {}): peak {} GiB",
                        density.vms,
                        m.round + 1,
                        num(peak, 2)
                    ),
                ));
                curves.push((i, points));
            }
            None => entries.push((style(i), format!("{strategy}: density 0, no curve"))),
        }
    }
    entries.push((BUDGET_STYLE, format!("budget {}", size_text(bytes))));
    let title = format!(
        "Budget {}: memory cgroup usage of all the VMs, GiB, each strategy at its density",
        size_text(bytes)
    );
    heading(out, y0 + 16.0, &title);
    legend(out, (PLOT_X, y0 + 36.0), &entries);
    let top = y0 + 66.0;
    let frame = memory_time_frame(PLOT_X, top, PLOT_W, PLOT_H);
    let xs: Vec<f64> = curves
        .iter()
        .flat_map(|(_, p)| p.iter().map(|&(x, _)| x))
        .collect();
    let mut ys: Vec<f64> = curves
        .iter()
        .flat_map(|(_, p)| p.iter().map(|&(_, y)| y))
        .collect();
    ys.push(budget_gib);
    let end = xs
        .iter()
        .copied()
        .filter(|x| x.is_finite())
        .fold(1.0, f64::max);
    let chart = LineChart::begin(out, &frame, xs, ys);
    chart.polyline(out, &[(0.0, budget_gib), (end, budget_gib)], BUDGET_STYLE);
    for (i, points) in &curves {
        chart.polyline(out, points, style(*i));
    }
    if curves.is_empty() {
        text(
            out,
            PLOT_X + 8.0,
            top + 20.0,
            r##"font-size="12" fill="#888""##,
            "no strategy passed N=1: nothing to draw",
        );
    }
    chart.bottom() + 50.0
}

pub fn svg(cx: &Context<'_>) -> String {
    let s = cx.settings;
    let mut body = String::new();
    let caption = format!(
        "{}, VMs of {}: memory summed over the VMs, a sample every {} ms.",
        s.replayed.name, s.memory, s.sample_ms
    );
    text(&mut body, 10.0, 20.0, r#"font-size="14""#, &caption);
    let mut y = 32.0;
    for b in 0..s.budgets.len() {
        y = panel(&mut body, cx, y, b);
    }
    document(WIDTH, y, true, &body)
}
