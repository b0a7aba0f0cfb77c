//! The figures of each run, the targets of issue 37 judged, and the report.

use std::fmt::Write as _;

use crate::client::Outcome;
use crate::common::chart::{Figure, Lines, Series, Stroke, BLUE, GREEN, RUST};
use crate::common::host::BenchRun;
use crate::common::results::{fig, Results};
use crate::common::verdict::{self, Verdict};
use crate::common::Res;
use crate::{Layout, Mode, Settings};

/// Targets of issue 37.
const FIRST_OUTPUT_P50_MS: f64 = 300.0;
const FIRST_OUTPUT_P99_MS: f64 = 1000.0;
const HELD_RATIO: f64 = 4.0;

/// The `q` quantile (nearest rank) of `values`; NaN for none.
fn quantile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil().max(1.0) as usize).min(sorted.len());
    sorted[rank - 1]
}

/// Puts the figures of `outcome` under `MODE.*`.
pub fn record(outcome: &Outcome, mode: Mode, round: usize, results: &mut Results) {
    let m = mode.key();
    let mut put = |key: &str, unit, value| results.put(&format!("{m}.{key}"), unit, round, value);
    put("admitted", "", outcome.admitted as f64);
    put("held", "", outcome.completed as f64);
    put("held_at_once", "", outcome.held_at_once as f64);
    put("problems", "", outcome.problems.len() as f64);
    put("oom_kills", "", outcome.oom_kills as f64);
    put("create_p50_ms", "ms", quantile(&outcome.create_ms, 0.5));
    put("ready_p50_ms", "ms", quantile(&outcome.ready_ms, 0.5));
    put("ready_p99_ms", "ms", quantile(&outcome.ready_ms, 0.99));
    put(
        "first_output_p50_ms",
        "ms",
        quantile(&outcome.first_output_ms, 0.5),
    );
    put(
        "first_output_p99_ms",
        "ms",
        quantile(&outcome.first_output_ms, 0.99),
    );
    put(
        "first_output_max_ms",
        "ms",
        quantile(&outcome.first_output_ms, 1.0),
    );
    put("pause_p50_ms", "ms", quantile(&outcome.pause_ms, 0.5));
    put("resume_p50_ms", "ms", quantile(&outcome.resume_ms, 0.5));
    put("resume_p99_ms", "ms", quantile(&outcome.resume_ms, 0.99));
    put("gib_s", "GiB·s", outcome.gib_s());
    put("peak_gib", "GiB", outcome.peak_gib());
    put("window_s", "s", outcome.window_s);
}

/// The ratios within each round: each managed mode against the unmanaged one.
pub fn derive(results: &mut Results, layout: Layout) {
    let u = layout.unmanaged().key();
    for mode in layout.managed() {
        let m = mode.key();
        for what in ["held_at_once", "gib_s"] {
            results.ratio(
                &format!("ratio.{m}.{what}"),
                &format!("{m}.{what}"),
                &format!("{u}.{what}"),
                "×",
            );
        }
    }
}

fn judged(met: bool) -> &'static str {
    ["missed", "met"][usize::from(met)]
}

/// The targets of issue 37, judged on the median round (and every round for OOM kills), for
/// each managed mode.
pub fn verdicts(results: &Results, settings: &Settings) -> Vec<Verdict> {
    let median = |key: &str| results.summary(key).median;
    let worst = |key: &str| results.summary(key).max;
    let u = settings.layout.unmanaged().key();
    let mut verdicts = Vec::new();
    for mode in settings.layout.managed() {
        let m = mode.key();
        let key = |what: &str| format!("{m}.{what}");
        verdicts.extend([
            Verdict {
                target: format!("resume to first output, p50 ≤ {FIRST_OUTPUT_P50_MS:.0} ms ({m})"),
                figure: format!("{} ms", fig(results, &key("first_output_p50_ms"), 1)),
                result: judged(median(&key("first_output_p50_ms")) <= FIRST_OUTPUT_P50_MS),
            },
            Verdict {
                target: format!("resume to first output, p99 ≤ {FIRST_OUTPUT_P99_MS:.0} ms ({m})"),
                figure: format!("{} ms", fig(results, &key("first_output_p99_ms"), 1)),
                result: judged(median(&key("first_output_p99_ms")) <= FIRST_OUTPUT_P99_MS),
            },
            Verdict {
                target: format!(
                    "≥ {HELD_RATIO:.0}× the sandboxes of {u} held at once in {} MiB ({m})",
                    settings.budget_mib
                ),
                figure: format!(
                    "{}× ({} against {})",
                    fig(results, &format!("ratio.{m}.held_at_once"), 2),
                    fig(results, &key("held_at_once"), 0),
                    fig(results, &format!("{u}.held_at_once"), 0)
                ),
                result: judged(median(&format!("ratio.{m}.held_at_once")) >= HELD_RATIO),
            },
            Verdict {
                target: format!("zero OOM kills ({m}, every round)"),
                figure: format!("{} at most", fig(results, &key("oom_kills"), 0)),
                result: judged(worst(&key("oom_kills")) == 0.0),
            },
            Verdict {
                target: format!(
                    "every admitted sandbox's data intact, every command answered ({m})"
                ),
                figure: format!("{} problems at most", fig(results, &key("problems"), 0)),
                result: judged(worst(&key("problems")) == 0.0),
            },
        ]);
    }
    verdicts
}

/// The smoke run's checks: every sandbox admitted and right in every mode, no OOM kill.
pub fn smoke_checks(results: &Results, settings: &Settings) -> Res<()> {
    for mode in settings.layout.modes() {
        let m = mode.key();
        let held = results.summary(&format!("{m}.held")).min;
        let oom = results.summary(&format!("{m}.oom_kills")).max;
        if held < settings.sandboxes as f64 || oom > 0.0 {
            return Err(format!(
                "{m}: {held} of {} sandboxes held to the end, {oom} OOM kills",
                settings.sandboxes
            )
            .into());
        }
    }
    Ok(())
}

/// The layout's modes, as a chart's title names them.
pub fn modes_text(layout: Layout) -> String {
    let keys: Vec<&str> = layout.modes().iter().map(|m| m.key()).collect();
    match keys.split_last() {
        Some((last, [])) => (*last).to_owned(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// A run's memory samples: its mode, its round, and (seconds, GiB charged).
pub type Samples = (Mode, usize, Vec<(f64, f64)>);

/// The budget cgroup's usage over the first round, both modes.
pub fn chart(memory: &[Samples], settings: &Settings) -> Res<String> {
    let series = memory
        .iter()
        .filter(|(_, round, _)| *round == 0)
        .map(|(mode, _, points)| Series {
            label: format!("{}: charged to the budget cgroup", mode.key()),
            stroke: Stroke::solid(match mode {
                Mode::Managed | Mode::Template => BLUE,
                Mode::TemplateShared | Mode::ManagedEager => GREEN,
                Mode::Unmanaged | Mode::TemplateUnmanaged => RUST,
            }),
            points: points.clone(),
        })
        .collect();
    let mut lines = Lines::memory_over_time(
        format!(
            "{} sandboxes, {} MiB working set each, {} × ({} s idle, then a command); round 1",
            settings.sandboxes,
            settings.working_set.trim_end_matches("MiB"),
            settings.iterations,
            settings.idle.as_secs()
        ),
        series,
    );
    lines.x_title = "seconds after the first create";
    lines.budget = Some((
        settings.budget_mib as f64 / 1024.0,
        format!("budget {} MiB", settings.budget_mib),
    ));
    Figure::new(format!(
        "pvisor-sandboxd: memory charged over time, {}",
        modes_text(settings.layout)
    ))
    .panel(lines)
    .svg()
}

/// `docs/bench/sandbox.md`.
pub fn markdown(
    results: &Results,
    verdicts: &[Verdict],
    settings: &Settings,
    run: &BenchRun,
) -> String {
    let mut t = String::from("# pvisor-sandboxd: sandboxes in a memory budget\n\n");
    t.push_str(&run.generated("sandbox_report", settings.runs));
    let (what, data) = match settings.layout {
        Layout::Workload => (
            "the workload guest".to_owned(),
            format!(
                "Each fills a {} working set of random data",
                settings.working_set
            ),
        ),
        Layout::Template => (
            format!(
                "one snapshot template (`--template`: a {} MiB VM that filled a {} working set \
                 of random data, snapshotted)",
                crate::template_memory(settings) >> 20,
                settings.working_set
            ),
            "Each starts with the template's working set, restored from the snapshot as it is \
             read, and reads it all (`digest`, which must find the template's data)"
                .to_owned(),
        ),
    };
    let _ = writeln!(
        t,
        "\n{} sandboxes of {what}, created through the lifecycle API one every {} ms under \
         a {} MiB budget. {data}, then {} times waits {} s idle and \
         runs `digest`, which reads the whole set and must find it unchanged; before the middle \
         iteration it is paused and resumed through the API. A create waits up to 60 s for room. \
         Figures are median (min–max) over the rounds.\n",
        settings.sandboxes,
        settings.stagger.as_millis(),
        settings.budget_mib,
        settings.iterations,
        settings.idle.as_secs()
    );
    t.push_str(&verdict::table(
        "Targets (issue 37)",
        "measured",
        verdicts,
        true,
    ));
    let modes = settings.layout.modes();
    let _ = writeln!(
        t,
        "\n## Every mode\n\n| | {} |\n|---|{}",
        modes
            .iter()
            .map(|m| m.key())
            .collect::<Vec<_>>()
            .join(" | "),
        "---|".repeat(modes.len())
    );
    // A row a line: its label, its figure's key, its decimals.
    const ROWS: &str = "sandboxes admitted|admitted|0
        the most held at once (of those held to the end)|held_at_once|0
        sandboxes held to the end (every iteration right)|held|0
        problems (a command failed or found other data)|problems|0
        OOM kills in the budget cgroup|oom_kills|0
        create answered, p50 (ms)|create_p50_ms|1
        ready (execd ping), p50 (ms)|ready_p50_ms|1
        ready, p99 (ms)|ready_p99_ms|1
        first output after idle, p50 (ms)|first_output_p50_ms|1
        first output after idle, p99 (ms)|first_output_p99_ms|1
        first output after idle, max (ms)|first_output_max_ms|1
        pause, p50 (ms)|pause_p50_ms|1
        resume, p50 (ms)|resume_p50_ms|1
        memory charged × time (GiB·s)|gib_s|1
        peak charged (GiB)|peak_gib|3
        window (s)|window_s|0";
    let rows = ROWS.lines().filter_map(|row| {
        let mut cells = row.trim().split('|');
        let (label, key) = (cells.next()?, cells.next()?);
        Some((label, key, cells.next()?.parse::<usize>().ok()?))
    });
    for (label, key, d) in rows {
        let cells: Vec<String> = modes
            .iter()
            .map(|m| fig(results, &format!("{}.{key}", m.key()), d))
            .collect();
        let _ = writeln!(t, "| {label} | {} |", cells.join(" | "));
    }
    let u = settings.layout.unmanaged().key();
    t.push('\n');
    for m in settings.layout.managed() {
        let m = m.key();
        let _ = writeln!(
            t,
            "`{m}` held {}× the sandboxes of `{u}` at once, for {}× its memory charged × time.\n",
            fig(results, &format!("ratio.{m}.held_at_once"), 2),
            fig(results, &format!("ratio.{m}.gib_s"), 2)
        );
    }
    let _ = writeln!(
        t,
        "![memory charged over time]({}.svg)\n\n## Method\n",
        settings.layout.stem()
    );
    if settings.layout == Layout::Template {
        t.push_str(
            "`SANDBOX_BENCH_TEMPLATE=1` selects this layout (the other is `docs/bench/sandbox.md`). \
             The daemon serves the snapshot with `--template base=DIR`; `template-shared` adds \
             `--share-template-pages --idle-offload 0` (the VMs' RAM marked mergeable for KSM, \
             ksmd tuned to merge fast while they run, and no idle offload: the pages the \
             sandboxes restored alike are kept once, and the governor takes memory back only \
             under the budget's pressure), `template` adds `--idle-offload 1s` as `managed` \
             does, and `template-unmanaged` `--memory-management off`.\n\n",
        );
    }
    t.push_str(
        "`cargo build --release -p sandboxd && cargo bench --bench sandbox_report` \
         (`SANDBOX_BENCH_RUNS`, `_SANDBOXES`, `_ITERATIONS`, `_IDLE_S`, `_STAGGER_MS`, `_BUDGET_MIB` \
         change the plan). The daemon runs with `--no-auth --admission-timeout 60s --stop-on-exit` \
         and its defaults otherwise; `managed` adds `--idle-offload 1s` (a sandbox idle for a second \
         is offloaded by the daemon, so that the governor seldom has to make room while a command \
         waits), `unmanaged` adds \
         `--memory-management off` (no governor, no idle offload). An OOM kill is counted from the \
         budget cgroup and from the tombstones of the sandboxes that failed. The bench's client measures every latency from its own side \
         of the socket: *first output* is from sending `POST …/command` to the first `stdout` \
         event. Memory is the budget cgroup's `memory.usage_in_bytes`, read every 250 ms. A \
         sandbox is *held* when it was admitted and every one of its commands answered with its \
         data intact; *held at once* is the most such sandboxes live (admitted, not yet deleted) \
         at one time, the density the budget gave.\n\n",
    );
    t.push_str(&run.machine_markdown());
    t
}
