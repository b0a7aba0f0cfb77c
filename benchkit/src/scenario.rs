//! The run of a replay bench (`agent_waits_report`, `arenas_report`): rounds of `pvisor
//! replay` runs in an interleaved order, each recorded as it ends with its integrity
//! ([`Integrity::record`]); then the figures derived, the report written from the CSV read
//! back (what render mode reads), and, in a smoke run, the integrity and render mode checked
//! ([`render::check`]). [`render`] is the bench's render mode.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::time::Instant;

use crate::host::{BenchRun, TempRoot};
use crate::render;
use crate::replay::{Integrity, Outcome, Timeline};
use crate::results::{Results, KEY_RUN_CSV};
use crate::verdict::Verdict;
use crate::Res;
use vmm::replay::Trajectory;

/// What the runs of a replay bench give that is not a single number: their integrity and the
/// memory over time; rebuilt from the CSV in render mode, with what else the run kept.
#[derive(Debug)]
pub struct Log<R> {
    pub integrity: Integrity,
    /// The summed memory of every run, by (run, round); none when re-rendered (not kept).
    pub timelines: BTreeMap<(R, usize), Timeline>,
    /// Re-rendered from results that predate `charged_gib_s`
    /// ([`crate::replay::charged_from_cgroup`]).
    pub charged_is_cgroup: bool,
    /// Rebuilt from kept results: the report of the run (in render mode and the smoke run's
    /// check), and the chart it drew (render mode).
    pub report: Option<String>,
    pub kept_chart: Option<String>,
}

impl<R> Default for Log<R> {
    fn default() -> Self {
        Self {
            integrity: Integrity::default(),
            timelines: BTreeMap::new(),
            charged_is_cgroup: false,
            report: None,
            kept_chart: None,
        }
    }
}

/// A replay bench: its settings, the runs of its rounds and its report.
pub trait ReplayBench {
    /// What varies between the runs of a round.
    type Run: Copy + Ord;
    /// `NAME` of `benches/NAME/`.
    const NAME: &'static str;
    /// The report's file stem.
    fn stem(&self) -> &str;
    /// A bench run (`docs/bench/`), not a smoke run (`target/bench-smoke/`).
    fn write_docs(&self) -> bool;
    fn rounds(&self) -> usize;
    /// Fits the settings to kept `results`: their rounds, and only the runs they hold (a
    /// strategy added since that run is left out of its report).
    fn fit(&mut self, results: &Results);
    /// The runs of round `round` (from 0), in the order they run.
    fn order(&self, round: usize) -> Vec<Self::Run>;
    /// `16 VM(s), offload`: the run in progress lines and failures.
    fn label(&self, run: Self::Run) -> String;
    /// `n16.offload`: the prefix of the run's keys.
    fn prefix(&self, run: Self::Run) -> String;
    /// Runs `pvisor replay` for `run`, its samples written to `samples`.
    fn replay(&self, run: Self::Run, samples: &Path) -> Res<Outcome>;
    /// Records the figures of `outcome` (its integrity and samples are recorded already) as
    /// round `round` of `run`.
    fn record(&self, outcome: &Outcome, run: Self::Run, round: usize, results: &mut Results);
    /// The figures derived round by round.
    fn derive(&self, results: &mut Results);
    fn verdicts(&self, results: &Results, log: &Log<Self::Run>) -> Vec<Verdict>;
    fn markdown(&self, results: &Results, run: &BenchRun, log: &Log<Self::Run>) -> String;
    fn chart(&self, results: &Results, log: &Log<Self::Run>) -> Res<String>;
}

/// A replay bench ready to run: its settings, its run's facts, its temporary files (their
/// `run/` is `PVISOR_RUNTIME_DIR`) and when its process started.
#[derive(Debug)]
pub struct Begun<B> {
    pub bench: B,
    pub run: BenchRun,
    pub tmp: TempRoot,
    pub started: Instant,
}

/// A replay bench's prologue: a smoke run skipped where asked, temporary files under `dir`
/// (one directory per process, so that a smoke run cannot clear a running bench's), the
/// settings read (`Err`: a smoke run cannot run here, and why), render mode carried out, the
/// VM devices checked. `None`: nothing more to do.
pub fn begin<B: ReplayBench>(
    dir: &str,
    settings: impl FnOnce(&Path, bool) -> Res<Result<B, String>>,
) -> Res<Option<Begun<B>>> {
    let (started, rendering) = (Instant::now(), render::requested());
    if !rendering && crate::skip_smoke(B::NAME, crate::is_bench_run()) {
        return Ok(None);
    }
    let run = BenchRun::begin();
    let relative = Path::new(dir).join(format!("p{}", std::process::id()));
    let tmp = TempRoot::create(B::NAME, &relative)?;
    let bench = match settings(&tmp.path, rendering)? {
        Ok(bench) if rendering => return render(bench, started).map(|()| None),
        Ok(bench) => bench,
        Err(why) => {
            eprintln!("{}: smoke run skipped: {why}", B::NAME);
            return Ok(None);
        }
    };
    crate::host::check_vm_devices()?;
    let run_dir = tmp.path.join("run");
    fs::create_dir_all(&run_dir)?;
    // Inherited by every `pvisor` started; set before any thread exists.
    std::env::set_var("PVISOR_RUNTIME_DIR", &run_dir);
    let begun = Begun {
        bench,
        run,
        tmp,
        started,
    };
    Ok(Some(begun))
}

impl<B: ReplayBench> Begun<B> {
    /// Says what runs: `vms` VMs under `strategies` strategies replaying `replayed`.
    pub fn announce(&self, vms: &dyn std::fmt::Debug, strategies: usize, replayed: &Trajectory) {
        eprintln!(
            "{}: {} round(s) of {vms:?} VMs × {strategies} strategies replaying {} ({} model \
             waits, {:.1} s of waits); temporary files in {} ({})",
            B::NAME,
            self.bench.rounds(),
            replayed.name,
            replayed.requests().len(),
            replayed.total_wait().as_secs_f64(),
            self.tmp.path.display(),
            self.tmp.filesystem
        );
    }

    /// Runs every round and writes the report ([`run`]).
    pub fn run(&self) -> Res<()> {
        run(&self.bench, &self.run, &self.tmp.path, self.started)
    }
}

/// Runs every round of `bench` (its temporary files in `tmp`), then writes its report: see
/// the module's documentation.
pub fn run<B: ReplayBench>(bench: &B, run: &BenchRun, tmp: &Path, started: Instant) -> Res<()> {
    let mut results = Results::new(bench.rounds());
    let mut log = Log::default();
    let total = bench.rounds() * bench.order(0).len();
    let mut done = 0;
    for round in 0..bench.rounds() {
        let round_started = Instant::now();
        for r in bench.order(round) {
            done += 1;
            let (label, prefix) = (bench.label(r), bench.prefix(r));
            let mut outcome = bench.replay(r, &tmp.join(format!("samples-{prefix}.csv")))?;
            let name = B::NAME;
            eprintln!(
                "{name}: [{done}/{total}] round {}, {label}: {}",
                round + 1,
                outcome.describe()
            );
            if outcome.summary.is_none() && log.integrity.summaries == 0 {
                // Not one replay got as far as its summary: `pvisor replay` cannot run here.
                let why = outcome.problem.as_deref().unwrap_or("no summary");
                return Err(format!("`pvisor replay` did not run: {why}").into());
            }
            log.integrity
                .record(&outcome, &mut results, &prefix, round, &label);
            bench.record(&outcome, r, round, &mut results);
            if let Some(timeline) = outcome.timeline.take() {
                log.timelines.insert((r, round), timeline);
            }
        }
        crate::end_round(B::NAME, &mut results, round, round_started);
    }
    bench.derive(&mut results);
    let integrity = &log.integrity;
    // A smoke run fails unless every run passed and gave the one digest.
    if !bench.write_docs() && (!integrity.all_passed() || integrity.digests.is_empty()) {
        let failures = integrity.failures.join("; ");
        return Err(format!("integrity failed: {failures}; {}", integrity.digest_text()).into());
    }
    let csv = results.csv(&KEY_RUN_CSV);
    // The report says what its CSV keeps, as render mode does.
    let results = Results::from_csv(&csv, &KEY_RUN_CSV)?;
    for v in bench.verdicts(&results, &log) {
        eprintln!("{}: {}: {} ({})", B::NAME, v.target, v.result, v.figure);
    }
    let markdown = bench.markdown(&results, run, &log);
    if !bench.write_docs() {
        render::check(&markdown, |run| {
            let mut results = Results::from_csv(&csv, &KEY_RUN_CSV)?;
            let mut kept = kept(bench, &mut results, markdown.clone());
            kept.timelines = log.timelines.clone();
            Ok(bench.markdown(&results, run, &kept))
        })?;
    }
    let chart = bench.chart(&results, &log)?;
    let outputs = [("csv", csv), ("svg", chart), ("md", markdown)];
    crate::finish(B::NAME, bench.write_docs(), bench.stem(), &outputs, started)
}

/// Render mode: the report of `bench` written again from its kept CSV, report and chart
/// (`render::dir`); the CSV and the chart stay as they are.
pub fn render<B: ReplayBench>(mut bench: B, started: Instant) -> Res<()> {
    let (mut results, run) = render::load(bench.write_docs(), bench.stem(), &KEY_RUN_CSV)?;
    bench.fit(&results);
    let path = |ext: &str| render::dir(bench.write_docs()).join(format!("{}.{ext}", bench.stem()));
    let mut log = kept(&bench, &mut results, fs::read_to_string(path("md"))?);
    log.kept_chart = fs::read_to_string(path("svg")).ok();
    let markdown = bench.markdown(&results, &run, &log);
    let outputs = [("md", markdown)];
    crate::finish(B::NAME, bench.write_docs(), bench.stem(), &outputs, started)
}

/// The log of `bench`'s run whose report is `report`, rebuilt from its kept `results`, which
/// gain `charged_*` series where the run predates them.
fn kept<B: ReplayBench>(bench: &B, results: &mut Results, report: String) -> Log<B::Run> {
    let runs = (0..results.runs).flat_map(|round| {
        let order = bench.order(round).into_iter();
        order.map(move |r| (round, bench.prefix(r), bench.label(r)))
    });
    Log {
        integrity: Integrity::kept(results, runs),
        charged_is_cgroup: crate::replay::charged_from_cgroup(results),
        report: Some(report),
        ..Log::default()
    }
}
