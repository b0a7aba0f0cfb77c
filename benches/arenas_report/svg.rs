//! The chart: the guest-RAM PSS and the cgroup memory of all the VMs over time, one line per
//! strategy, in the round the report names (`Context::chosen`).

use crate::common::results::{num, Results};
use crate::common::svg::{document, heading, legend, memory_time_frame, text, LineChart};
use crate::report::Context;
use crate::run::key;
use crate::Strategy;

const WIDTH: f64 = 980.0;
const PLOT_X: f64 = 80.0;
const PLOT_W: f64 = 860.0;
const PLOT_H: f64 = 260.0;

/// The stroke of a strategy's line.
fn style(strategy: Strategy) -> &'static str {
    match strategy {
        Strategy::Off => r##"stroke="#369" stroke-width="1.8""##,
        Strategy::ColdCompression => r##"stroke="#a4c" stroke-width="1.8" stroke-dasharray="6,3""##,
        Strategy::Offload => r##"stroke="#c63" stroke-width="1.8""##,
        Strategy::Arenas => r##"stroke="#283" stroke-width="1.8""##,
        Strategy::ArenasOffload => r##"stroke="#283" stroke-width="1.8" stroke-dasharray="2,2""##,
    }
}

pub fn svg(results: &Results, cx: &Context<'_>) -> String {
    let s = cx.settings;
    let mut out = String::new();
    let caption = format!(
        "{}, {} VMs of {}: memory summed over the VMs, a sample every {} ms; round {} of {}.",
        s.replayed.name,
        s.vms,
        s.memory,
        s.sample_ms,
        cx.chosen + 1,
        s.runs,
    );
    text(&mut out, 10.0, 20.0, r#"font-size="14""#, &caption);
    let mut y = 32.0;
    for (cgroup, quantity, per_task) in [
        (false, "guest-RAM PSS", "guest_pss_gib_s"),
        (true, "memory cgroup usage", "cgroup_gib_s"),
    ] {
        let lines: Vec<(Strategy, Vec<(f64, f64)>)> = s
            .strategies
            .iter()
            .filter_map(|&st| {
                let timeline = cx.log.timelines.get(&(st, cx.chosen))?;
                Some((st, timeline.points(cgroup)))
            })
            .collect();
        heading(
            &mut out,
            y + 16.0,
            &format!("{quantity} of all the VMs, GiB (legend: GiB·s per task)"),
        );
        let entries: Vec<(&str, String)> = lines
            .iter()
            .map(|&(st, _)| {
                let value = results.values(&key(st, per_task)).get(cx.chosen).copied();
                let label = format!("{}: {}", st.key(), num(value.unwrap_or(f64::NAN), 3));
                (style(st), label)
            })
            .collect();
        legend(&mut out, (PLOT_X, y + 36.0), &entries);
        let top = y + 66.0;
        let frame = memory_time_frame(PLOT_X, top, PLOT_W, PLOT_H);
        let (xs, ys): (Vec<f64>, Vec<f64>) = lines.iter().flat_map(|(_, p)| p.clone()).unzip();
        let chart = LineChart::begin(&mut out, &frame, xs, ys);
        for (st, points) in &lines {
            chart.polyline(&mut out, points, style(*st));
        }
        y = chart.bottom() + 50.0;
    }
    document(WIDTH, y, true, &out)
}
