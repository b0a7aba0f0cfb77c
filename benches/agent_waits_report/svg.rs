//! The chart: the memory of all the VMs of a group over time, one line per strategy, in the
//! round the report names (`Context::chosen`): the guest-RAM PSS and the cgroup memory with the
//! most VMs, then the guest-RAM PSS of each other group size.

use crate::common::results::{num, Results};
use crate::common::svg::{document, heading, legend, memory_time_frame, text, LineChart};
use crate::replay::key;
use crate::report::Context;
use crate::targets::vms_label;
use crate::Strategy;

const WIDTH: f64 = 980.0;
const PLOT_X: f64 = 80.0;
const PLOT_W: f64 = 860.0;
const PLOT_H: f64 = 260.0;

/// The stroke of a strategy's line.
fn style(strategy: Strategy) -> &'static str {
    match strategy {
        Strategy::Off => r##"stroke="#369" stroke-width="1.8""##,
        Strategy::Pause => r##"stroke="#a4c" stroke-width="1.8" stroke-dasharray="6,3""##,
        Strategy::Offload => r##"stroke="#c63" stroke-width="1.8""##,
        Strategy::OffloadCompressed => r##"stroke="#283" stroke-width="1.8""##,
        Strategy::OffloadLazy => r##"stroke="#c63" stroke-width="1.8" stroke-dasharray="2,2""##,
    }
}

/// One chart of `vms` VMs (`cgroup`: the cgroups' memory, else the guest PSS); returns the y
/// below it.
fn panel(
    out: &mut String,
    results: &Results,
    cx: &Context<'_>,
    y0: f64,
    vms: usize,
    cgroup: bool,
) -> f64 {
    let s = cx.settings;
    let lines: Vec<(Strategy, Vec<(f64, f64)>)> = s
        .strategies
        .iter()
        .filter_map(|&strategy| {
            let timeline = cx.log.timelines.get(&(vms, strategy, cx.chosen))?;
            Some((strategy, timeline.points(cgroup)))
        })
        .collect();
    let quantity = if cgroup {
        "memory cgroup usage"
    } else {
        "guest-RAM PSS"
    };
    let title = format!(
        "{}: {quantity} of all the VMs, GiB, round {} (legend: GiB·s per task)",
        vms_label(vms),
        cx.chosen + 1
    );
    heading(out, y0 + 16.0, &title);
    let entries: Vec<(&str, String)> = lines
        .iter()
        .map(|(strategy, _)| {
            let per_task = key(
                vms,
                *strategy,
                if cgroup {
                    "cgroup_gib_s"
                } else {
                    "guest_pss_gib_s"
                },
            );
            let value = results
                .values(&per_task)
                .get(cx.chosen)
                .copied()
                .unwrap_or(f64::NAN);
            (
                style(*strategy),
                format!("{}: {}", strategy.key(), num(value, 3)),
            )
        })
        .collect();
    legend(out, (PLOT_X, y0 + 36.0), &entries);
    let top = y0 + 66.0;
    if lines.is_empty() {
        text(
            out,
            PLOT_X + 8.0,
            top + 20.0,
            r##"font-size="12" fill="#888""##,
            "not measured",
        );
        return top + 40.0;
    }
    let frame = memory_time_frame(PLOT_X, top, PLOT_W, PLOT_H);
    let points = lines.iter().flat_map(|(_, p)| p.iter().copied());
    let (xs, ys): (Vec<f64>, Vec<f64>) = points.unzip();
    let chart = LineChart::begin(out, &frame, xs, ys);
    for (strategy, points) in &lines {
        chart.polyline(out, points, style(*strategy));
    }
    chart.bottom() + 50.0
}

pub fn svg(results: &Results, cx: &Context<'_>) -> String {
    let s = cx.settings;
    let mut body = String::new();
    let caption = format!(
        "{}, VMs of {}: memory summed over the VMs, a sample every {} ms; round {} of {}.",
        s.replayed.name,
        s.memory,
        s.sample_ms,
        cx.chosen + 1,
        s.runs,
    );
    text(&mut body, 10.0, 20.0, r#"font-size="14""#, &caption);
    let mut sizes = s.vms.clone();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let mut y = 32.0;
    for (i, &vms) in sizes.iter().enumerate() {
        y = panel(&mut body, results, cx, y, vms, false);
        if i == 0 {
            y = panel(&mut body, results, cx, y, vms, true);
        }
    }
    document(WIDTH, y, true, &body)
}
