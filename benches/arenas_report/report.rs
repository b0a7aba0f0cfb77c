//! The figures derived round by round (against `off`, and between strategies), the verdict on
//! each target of issue 16, and the Markdown report.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::common::chart::{Figure, Lines, Series, Stroke, BLUE, GREEN, RUST, VIOLET};
use crate::common::host::BenchRun;
use crate::common::results::{fig, num, signed_fig, Results};
use crate::common::verdict::{result, table, Target, Verdict, Words};
use crate::common::Res;
use crate::run::key;
use crate::{Log, Settings, Strategy, BASE};

/// The verdicts: a target without a figure (a strategy not run, or no run of it gave one), a
/// target met, a target missed.
const WORDS: Words = ["NOT MEASURED", "PASS", "MISS"];
/// The verdicts of a target given for information.
const FOR_INFORMATION: Words = [
    "NOT MEASURED",
    "met (for information)",
    "missed (for information)",
];

/// The arenas' memory charged × time, % of cold compression's (at most). Issue 16 set it on
/// guest PSS × time; issue 35 judges it on memory charged, the threshold kept: guest PSS
/// misses the memfd RAM that cold compression unmapped but still holds.
pub const ARENAS_OF_COLD_MAX_PCT: f64 = 50.0;
/// The arenas' completion window, % over off's (at most; issue 35 replaced issue 16's +2%).
pub const ARENAS_WINDOW_MAX_PCT: f64 = 3.0;
/// Arenas with offload: its completion window, % over off's (at most; issue 35 replaced
/// issue 16's +3%).
pub const ARENAS_OFFLOAD_WINDOW_MAX_PCT: f64 = 8.0;

/// The two memory × time measures, the headline first: (quantity, words).
const MEASURES: [(&str, &str); 2] = [
    ("charged_gib_s", "memory charged×time"),
    ("guest_pss_gib_s", "guest PSS×time"),
];

/// `ratio` × 100: a share, %.
fn share(ratio: f64) -> f64 {
    ratio * 100.0
}

/// (`ratio` − 1) × 100: a change, %.
fn change(ratio: f64) -> f64 {
    (ratio - 1.0) * 100.0
}

/// Puts `derived` = `as_pct(of ÷ base)` round by round, where both were measured.
fn per_round(results: &mut Results, derived: &str, of: &str, base: &str, as_pct: fn(f64) -> f64) {
    for round in 0..results.runs {
        let value = |k: &str| results.values(k).get(round).copied().unwrap_or(f64::NAN);
        let ratio = value(of) / value(base);
        if ratio.is_finite() {
            results.put(derived, "%", round, as_pct(ratio));
        }
    }
}

/// `QUANTITY_pct_of.OTHER`: a strategy's figure as a share of another's in the same round.
fn pct_of(quantity: &str, other: Strategy) -> String {
    format!("{quantity}_pct_of.{}", other.key())
}

/// Adds, round by round: every strategy's memory × time and CPU as a share of off's and its
/// window as a change against off's (`…_pct_of.off`, `window_change_pct`), and the memory ×
/// time of the arena strategies as a share of every other strategy's.
pub fn derive(results: &mut Results, settings: &Settings) {
    let strategies = &settings.strategies;
    for &strategy in strategies.iter().filter(|&&s| s != BASE) {
        for quantity in ["charged_gib_s", "guest_pss_gib_s", "cgroup_gib_s", "cpu_s"] {
            let derived = key(strategy, &pct_of(quantity, BASE));
            per_round(
                results,
                &derived,
                &key(strategy, quantity),
                &key(BASE, quantity),
                share,
            );
        }
        per_round(
            results,
            &key(strategy, "window_change_pct"),
            &key(strategy, "window_s"),
            &key(BASE, "window_s"),
            change,
        );
    }
    for strategy in [Strategy::Arenas, Strategy::ArenasOffload] {
        for &other in strategies.iter().filter(|&&o| o != strategy && o != BASE) {
            for (quantity, _) in MEASURES {
                per_round(
                    results,
                    &key(strategy, &pct_of(quantity, other)),
                    &key(strategy, quantity),
                    &key(other, quantity),
                    share,
                );
            }
        }
    }
}

/// The round whose arenas/off memory charged × time ratio is nearest that ratio's median (the
/// first round if there is none).
pub fn median_round(results: &Results, settings: &Settings) -> usize {
    let reference = if settings.strategies.contains(&Strategy::Arenas) {
        Strategy::Arenas
    } else {
        *settings.strategies.last().expect("a bench has a strategy")
    };
    let k = key(reference, &pct_of("charged_gib_s", BASE));
    results.median_round(&k)
}

/// The verdict on `bound`, a target on a per-round figure (%) whose median must be at most its
/// threshold, written by `fig`; the figure names `measured` of `strategy` and of `against`
/// (decimals `d`, `unit`).
struct Bound<'a> {
    target: String,
    bound: Target,
    fig: fn(&Results, &str, usize) -> String,
    measured: (&'a str, usize, &'a str),
    strategy: Strategy,
    against: Strategy,
}

impl Bound<'_> {
    fn verdict(&self, results: &Results, words: Words) -> Verdict {
        let (s, meeting, result) = self.bound.judge(results, words);
        let value = (self.fig)(results, &self.bound.key, 1);
        let (quantity, d, unit) = self.measured;
        Verdict {
            target: self.target.clone(),
            figure: format!(
                "{value}% ({meeting} of {} rounds meet it): {}{unit} against {}{unit} ({})",
                s.n,
                fig(results, &key(self.strategy, quantity), d),
                fig(results, &key(self.against, quantity), d),
                self.against.key(),
            ),
            result,
        }
    }
}

/// Arenas with offload below every other strategy on `quantity`: the median of each per-round
/// ratio under 100%.
fn lowest(results: &Results, settings: &Settings, quantity: &str, words: &str) -> Verdict {
    let me = Strategy::ArenasOffload;
    let medians: Vec<(Strategy, f64)> = settings
        .strategies
        .iter()
        .filter(|&&o| o != me)
        .map(|&o| (o, results.summary(&key(me, &pct_of(quantity, o))).median))
        .collect();
    let parts: Vec<String> = medians
        .iter()
        .map(|(o, m)| format!("{}% of {}", num(*m, 1), o.key()))
        .collect();
    let measured = !medians.is_empty() && medians.iter().all(|(_, m)| !m.is_nan());
    Verdict {
        target: format!("arenas-offload: {words} below every other strategy's"),
        figure: format!(
            "{} GiB·s per task; medians of the per-round ratios: {}",
            fig(results, &key(me, quantity), 3),
            parts.join(", ")
        ),
        result: result(measured, medians.iter().all(|(_, m)| *m < 100.0), WORDS),
    }
}

pub fn verdicts(results: &Results, settings: &Settings, log: &Log) -> Vec<Verdict> {
    let window = |strategy: Strategy, max: f64| Bound {
        target: format!(
            "{}: completion window ≤ +{max:.0}% over off",
            strategy.key()
        ),
        bound: Target::at_most(key(strategy, "window_change_pct"), max),
        fig: signed_fig,
        measured: ("window_s", 2, " s"),
        strategy,
        against: BASE,
    };
    let of_cold = |quantity: &'static str, target: String| Bound {
        target,
        bound: Target::at_most(
            key(
                Strategy::Arenas,
                &pct_of(quantity, Strategy::ColdCompression),
            ),
            ARENAS_OF_COLD_MAX_PCT,
        ),
        fig,
        measured: (quantity, 3, " GiB·s per task"),
        strategy: Strategy::Arenas,
        against: Strategy::ColdCompression,
    };
    let mut out = vec![
        of_cold(
            "charged_gib_s",
            format!(
                "arenas: memory charged×time ≤ {ARENAS_OF_COLD_MAX_PCT:.0}% of cold-compression's (on \
                 guest PSS×time until issue 35)"
            ),
        )
        .verdict(results, WORDS),
        window(Strategy::Arenas, ARENAS_WINDOW_MAX_PCT).verdict(results, WORDS),
    ];
    out.extend(MEASURES.map(|(quantity, words)| lowest(results, settings, quantity, words)));
    out.push(
        window(Strategy::ArenasOffload, ARENAS_OFFLOAD_WINDOW_MAX_PCT).verdict(results, WORDS),
    );
    out.push(integrity(log));
    out.push(
        of_cold(
            "guest_pss_gib_s",
            format!(
                "for information: arenas: guest PSS×time ≤ {ARENAS_OF_COLD_MAX_PCT:.0}% of \
                 cold-compression's (the target before issue 35)"
            ),
        )
        .verdict(results, FOR_INFORMATION),
    );
    out
}

/// Zero integrity failures across all runs, and one `results_digest` for all (on the failures
/// alone where a re-rendered CSV did not keep the digests).
pub fn integrity(log: &Log) -> Verdict {
    log.integrity.verdict(
        "integrity: every run's check passed (answers, commands, the same digests in every VM, \
         sampling) and every run gave the same results_digest",
        WORDS,
    )
}

/// What the report says besides the figures.
struct Context<'a> {
    settings: &'a Settings,
    /// The machine, the date, the time and CPU the bench took.
    run: &'a BenchRun,
    log: &'a Log,
    /// The round the chart shows (from 0).
    chosen: usize,
}

/// The command that regenerates the report, and the one that re-renders it.
const REPRODUCE: &str =
    "cargo build --release -p vmm --bin pvisor && cargo bench --bench arenas_report";
const RENDER: &str = "BENCH_RENDER=1 cargo bench --bench arenas_report";

/// The `- **CPU**:` words of a report `markdown`: how its run measured CPU time.
pub fn cpu_meter(markdown: &str) -> Option<String> {
    let line = markdown
        .lines()
        .find_map(|l| l.strip_prefix("- **CPU**: "))?;
    Some(line.split_once("; the runs took")?.0.to_owned())
}

/// The flags each strategy ran with, by its key, as a report `markdown` lists them (`  - `KEY`:
/// FLAGS` lines): what a re-rendered report says its run ran, whatever the flags are now.
pub fn kept_flags(markdown: &str) -> BTreeMap<String, String> {
    markdown
        .lines()
        .filter_map(|line| {
            let (key, flags) = line.strip_prefix("  - `")?.split_once("`: ")?;
            Some((key.to_owned(), flags.to_owned()))
        })
        .collect()
}

/// The report of `results` (as its CSV keeps them) of the run `run`.
pub fn markdown(results: &Results, settings: &Settings, run: &BenchRun, log: &Log) -> String {
    let cx = &Context {
        settings,
        run,
        log,
        chosen: median_round(results, settings),
    };
    let verdicts = verdicts(results, settings, log);
    let s = cx.settings;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "# Phase arenas: an agent run replayed in {} VMs — benchmark report\n\n{}\nReproduce: \
         `{REPRODUCE}` (`ARENAS_BENCH_RUNS`, default 5; `ARENAS_BENCH_STEPS`, default 24); re-render this report \
         from `docs/bench/arenas.csv`, nothing run: `{RENDER}`.\n",
        s.vms,
        cx.run.generated("arenas_report", s.runs)
    );
    summary(&mut t, results, cx);
    t.push_str(&table(
        "Targets (issue 16)",
        "figure: median (min–max) over the rounds",
        &verdicts,
        true,
    ));
    t.push_str(
        "\nA target is judged on the median of the per-round figures: a ratio is computed within a round \
         (the runs of one round are minutes apart at most), then summarised. The arenas' target against cold \
         compression was set on guest PSS × time (issue 16); it is judged on memory charged × time since \
         issue 35, its threshold kept, because guest PSS misses the memfd RAM that cold compression has \
         unmapped but still holds: by guest PSS cold compression looked smaller than the host's bill says. \
         The old form stays in the table for information.\n\n",
    );
    ratio_table(&mut t, results, s);
    integrity_section(&mut t, cx.log);
    let _ = writeln!(
        t,
        "## Memory over time\n\n![Memory charged (cgroup memory) and guest-RAM PSS of all the VMs over time, per \
         strategy](arenas.svg)\n"
    );
    match &cx.log.kept_chart {
        Some(svg) => {
            let note = crate::common::render::kept_chart(
                svg,
                &cx.run.date,
                crate::common::render::MEMORY_PANELS,
            );
            let _ = writeln!(t, "{note}\n");
        }
        None => {
            let _ = writeln!(
                t,
                "The chart shows the memory of all {} VMs summed, deadline by deadline (`pvisor replay --samples`; \
                 where a VM's reading came late, its latest one), in round {} (the round whose arenas/off memory \
                 charged×time ratio is nearest the median): memory charged first, then guest-RAM PSS.\n",
                s.vms,
                cx.chosen + 1
            );
        }
    }
    method(&mut t, results, cx);
    t
}

/// The paragraph under the title.
fn summary(t: &mut String, results: &Results, cx: &Context<'_>) {
    let s = cx.settings;
    let phases = s.replayed.steps.len() - s.replayed.requests().len();
    let _ = write!(
        t,
        "{} VMs replaying `{}` at once ({} model waits as recorded, {:.1} s of waits in all, and {phases} \
         tool phases, each in an arena of its own) on this machine's {} CPUs: without anything done (`off`) \
         the batch took {} s and each task was charged {} GiB·s of memory × time (its cgroup's; guest-RAM \
         PSS × time {} GiB·s).",
        s.vms,
        s.replayed.name,
        s.replayed.requests().len(),
        s.replayed.total_wait().as_secs_f64(),
        cx.run.machine.nproc,
        fig(results, &key(BASE, "window_s"), 2),
        fig(results, &key(BASE, "charged_gib_s"), 3),
        fig(results, &key(BASE, "guest_pss_gib_s"), 3),
    );
    if cx.log.charged_is_cgroup {
        t.push_str(
            " (This run predates the replay's own memory-charged figure: its CSV has the VMs' memory cgroup \
             usage, `cgroup_gib_s`, which is the memory charged for VMs that each run in a memory cgroup of \
             their own without huge pages, as these did.)",
        );
    }
    for &strategy in s.strategies.iter().filter(|&&st| st != BASE) {
        let median = |q: &str| results.summary(&key(strategy, q)).median;
        let _ = write!(
            t,
            " `{}`: memory charged × time {}% of off's (guest PSS × time {}%), window {}%.",
            strategy.key(),
            num(median(&pct_of("charged_gib_s", BASE)), 1),
            num(median(&pct_of("guest_pss_gib_s", BASE)), 1),
            crate::common::results::signed(median("window_change_pct"), 1),
        );
    }
    let _ = writeln!(
        t,
        " (Medians of the per-round ratios.) Integrity: {} of {} runs failed, {} of them by their \
         sampling alone.\n",
        cx.log.integrity.failures.len(),
        cx.log.integrity.runs,
        cx.log.integrity.sampling_only
    );
}

fn ratio_table(t: &mut String, results: &Results, s: &Settings) {
    let _ = writeln!(
        t,
        "## Every strategy against off\n\n\
         Per task: memory × time summed over the VMs and divided by {}; memory charged is the VMs' memory \
         cgroups' usage (with huge pages held), guest PSS the second column (it misses memfd RAM resident but \
         unmapped). *Window*: from the common release to \
         the last VM's last result. *CPU*: user + system of the replay, its VMs and all they start. Against \
         off: the strategy's figure over off's in the same round, then the median (min–max) over the rounds.\n",
        s.vms
    );
    t.push_str(
        "| strategy | memory charged×time, GiB·s per task | % of off | guest PSS×time, GiB·s per task | % of off | \
         window, s | window vs off, % | CPU, s | % of off | runs passed |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for &strategy in &s.strategies {
        let k = |q: &str| key(strategy, q);
        let against = |q: &str, signed: bool| match (strategy == BASE, signed) {
            (true, _) => "(the base)".to_owned(),
            (false, true) => signed_fig(results, &k(q), 1),
            (false, false) => fig(results, &k(&pct_of(q, BASE)), 1),
        };
        let passed = results.count(&k("integrity_passed"), |v| v == 1.0);
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {passed} of {} |",
            strategy.key(),
            fig(results, &k("charged_gib_s"), 3),
            against("charged_gib_s", false),
            fig(results, &k("guest_pss_gib_s"), 3),
            against("guest_pss_gib_s", false),
            fig(results, &k("window_s"), 2),
            against("window_change_pct", true),
            fig(results, &k("cpu_s"), 1),
            against("cpu_s", false),
            results.values(&k("integrity_passed")).len(),
        );
    }
    t.push_str(
        "\nThe arena strategies against the others (memory × time, % of the other's in the same round):\n\n\
         | strategy | against | memory charged×time, % | guest PSS×time, % |\n|---|---|---:|---:|\n",
    );
    for strategy in [Strategy::Arenas, Strategy::ArenasOffload] {
        for &other in s.strategies.iter().filter(|&&o| o != strategy && o != BASE) {
            let _ = writeln!(
                t,
                "| {} | {} | {} | {} |",
                strategy.key(),
                other.key(),
                fig(results, &key(strategy, &pct_of("charged_gib_s", other)), 1),
                fig(
                    results,
                    &key(strategy, &pct_of("guest_pss_gib_s", other)),
                    1
                ),
            );
        }
    }
    t.push('\n');
}

fn integrity_section(t: &mut String, log: &Log) {
    t.push_str(
        "## Integrity\n\nEvery run is checked by `pvisor replay` itself: every model answer's digest, every \
         command's success, the same digests (the arenas' `digest arena=ID` among them) in every VM, and \
         sampling without long gaps or dropped readings; its `results_digest` must be the same in every run, \
         whatever the strategy. A failed run is recorded here and kept in the figures, never dropped.\n\n",
    );
    if log.integrity.failures.is_empty() {
        t.push_str("No run failed.\n\n");
    } else {
        for failure in &log.integrity.failures {
            let _ = writeln!(t, "- {failure}");
        }
        t.push('\n');
    }
}

/// The CPU time of every run, summed.
fn runs_cpu(results: &Results, s: &Settings) -> f64 {
    s.strategies
        .iter()
        .flat_map(|&st| results.values(&key(st, "cpu_s")))
        .filter(|v| !v.is_nan())
        .sum()
}

fn method(t: &mut String, results: &Results, cx: &Context<'_>) {
    let s = cx.settings;
    let _ = writeln!(
        t,
        "## Method\n\n\
         - **Trajectory**: `docs/trajectories/qutebrowser-667-arenas.json` (made by `scripts/make-trajectories`: \
         the waits and fills of `qutebrowser-667.json`, each tool phase in an arena of its own, `discard` for \
         scratch, `survive` for results the next step reads), its first {} of {} steps, the waits as \
         recorded.\n\
         - **Each run**: `pvisor replay TRAJECTORY --vms {} --strategy S --memory {} --sample-ms {} --json \
         --samples FILE`, all the VMs released at once; a run is stopped (and counted as failed) after {} s.\n\
         - **Rounds**: {}, interleaved: round r runs the strategies in the order of round 1 rotated by r.\n\
         - **Strategies** (the `pvisor run` flags `pvisor replay` gives the VMs):",
        s.replayed.steps.len(),
        s.whole_steps,
        s.vms,
        s.memory,
        s.sample_ms,
        s.run_limit.as_secs(),
        s.runs,
    );
    // What the run ran with, as its report said when re-rendered.
    let kept = cx.log.report.as_deref();
    let kept_flags = kept.map(kept_flags).unwrap_or_default();
    for &strategy in &s.strategies {
        let flags = kept_flags.get(strategy.key());
        let flags = flags.map_or(strategy.describe(), String::as_str);
        let _ = writeln!(t, "  - `{}`: {flags}", strategy.key());
    }
    let _ = writeln!(
        t,
        "- **Memory × time**: the replay's own integrals of each VM's memory charged (its memory cgroup's \
         usage plus the huge pages it holds, `memory_charged_gib_s_per_task`; see `vmm::charged`), guest-RAM \
         PSS and memory cgroup usage (`guest_pss_gib_s_per_task`, `cgroup_mem_gib_s_per_task`).\n\
         - **CPU**: {}; the runs took {:.1} s of CPU in all: what the whole machine used beyond \
         that (below) was other work on it while the bench ran.\n{}",
        kept.and_then(cpu_meter)
            .or_else(|| s.cpu.as_ref().map(|cpu| cpu.describe()))
            .unwrap_or_default(),
        runs_cpu(results, s),
        cx.run.machine_markdown()
    );
}

/// The stroke of a strategy's line.
fn stroke(strategy: Strategy) -> Stroke {
    match strategy {
        Strategy::Off => Stroke::solid(BLUE),
        Strategy::ColdCompression => Stroke::dashed(VIOLET, 6, 3),
        Strategy::Offload => Stroke::solid(RUST),
        Strategy::Arenas => Stroke::solid(GREEN),
        Strategy::ArenasOffload => Stroke::dashed(GREEN, 2, 2),
    }
}

/// The chart: the memory charged (the cgroups' usage) and the guest-RAM PSS of all the VMs
/// over time, one line per strategy, in the round the report names (`median_round`).
pub fn chart(results: &Results, settings: &Settings, log: &Log) -> Res<String> {
    let s = settings;
    let chosen = median_round(results, settings);
    let caption = format!(
        "{}, {} VMs of {}: memory summed over the VMs, a sample every {} ms; round {} of {}.",
        s.replayed.name,
        s.vms,
        s.memory,
        s.sample_ms,
        chosen + 1,
        s.runs,
    );
    let mut figure = Figure::new(caption);
    for (cgroup, quantity, per_task) in [
        (true, "memory charged (cgroup usage)", "charged_gib_s"),
        (false, "guest-RAM PSS", "guest_pss_gib_s"),
    ] {
        let series = s
            .strategies
            .iter()
            .filter_map(|&st| {
                let timeline = log.timelines.get(&(st, chosen))?;
                let value = results.values(&key(st, per_task)).get(chosen).copied();
                Some(Series {
                    label: format!("{}: {}", st.key(), num(value.unwrap_or(f64::NAN), 3)),
                    stroke: stroke(st),
                    points: timeline.points(cgroup),
                })
            })
            .collect();
        let title = format!("{quantity} of all the VMs, GiB (legend: GiB·s per task)");
        figure = figure.panel(Lines::memory_over_time(title, series));
    }
    figure.svg()
}
