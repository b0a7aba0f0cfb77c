//! Scenario bench of phase arenas (issue 16, docs/arenas.md): the real `pvisor replay` of the
//! qutebrowser-667 run with each tool phase's memory in an arena of its own
//! (`docs/trajectories/qutebrowser-667-arenas.json`), its waits as recorded, in 16 VMs, under
//! five strategies (`Strategy::ALL`): off, cold compression and wait-management offload (the
//! three with `--vm-arenas false`, as a host without arenas), arenas (survive arenas into cold
//! compression's pool at close, discard arenas dropped) and arenas with offload (survive
//! arenas to the offload store). Regenerates `docs/bench/arenas.md`, `.csv` and `.svg`.
//!
//! `cargo bench --bench arenas_report` replays the trajectory's first `ARENAS_BENCH_STEPS`
//! steps (default `BENCH_STEPS`; the whole trajectory is 87) in `ARENAS_BENCH_RUNS` (default
//! 5) interleaved rounds; round `r` rotates the order of the strategies by `r`. Each run is
//! `pvisor replay TRAJECTORY --vms 16 --strategy S --memory 512MiB --json --samples FILE` in a
//! CPU accounting group (`common::cpu`); the JSON summary, its exit status, its memory samples
//! and its CPU time are kept; a run whose integrity failed is recorded and counted, never
//! dropped, and the bench fails only if `pvisor replay` cannot run at all. Ratios to `off` are
//! computed within a round, then summarised (`report`).
//!
//! Needs root, `/dev/kvm`, `/dev/userfaultfd`, memory cgroups, and `target/release/pvisor`
//! built from the current sources (`cargo build --release -p vmm --bin pvisor`). Run without
//! `--bench` (as `cargo test --benches` does), it is a quick smoke run: the first
//! `SMOKE_STEPS` steps, 2 VMs, off and arenas, one round; every run must pass its integrity
//! check and give the same `results_digest`; no report is written. It is skipped with a message
//! when the binary is missing or stale, and altogether with `PVISOR_SKIP_DEVICE_TESTS=1`. The
//! smoke run also checks render mode on its own CSV.
//!
//! Render mode (`BENCH_RENDER=1 cargo bench --bench arenas_report`, `benchkit::render`):
//! `docs/bench/arenas.md` written again from its kept CSV and report, nothing run (the steps
//! replayed from `ARENAS_BENCH_STEPS` as for the run). The chart is not redrawn (its samples
//! are not kept in the CSV); the report says which chart it shows.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use vmm::replay::Trajectory;

use benchkit as common;
mod report;
mod run;

use common::cpu::CpuGroup;
use common::host::BenchRun;
use common::replay::Outcome;
use common::results::Results;
use common::scenario::{self, ReplayBench};
use common::verdict::Verdict;
use common::Res;

/// The trajectory, from the workspace root.
const TRAJECTORY: &str = "docs/trajectories/qutebrowser-667-arenas.json";
/// Steps the bench replays by default: the first 12 model waits and 12 tool phases.
const BENCH_STEPS: u64 = 24;
/// Steps the smoke run replays: four waits and four phases, survive and discard arenas both.
const SMOKE_STEPS: usize = 8;
/// VMs of the bench.
const BENCH_VMS: usize = 16;

/// What `pvisor replay --strategy` does with the VMs' memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Strategy {
    /// Nothing: every VM keeps its memory; arena reports are counted only.
    Off,
    /// Cold RAM compressed while the VM runs; no arenas.
    ColdCompression,
    /// Wait-management offload; no arenas.
    Offload,
    /// The arenas alone: discard arenas dropped at close, survive arenas compressed into cold
    /// compression's pool at close (nothing turns cold by age).
    Arenas,
    /// Wait-management offload, and survive arenas written to the offload store at close.
    ArenasOffload,
}

impl Strategy {
    /// Every strategy, in the order of round 0; the first is the one the others are compared
    /// with.
    pub const ALL: [Strategy; 5] = [
        Strategy::Off,
        Strategy::ColdCompression,
        Strategy::Offload,
        Strategy::Arenas,
        Strategy::ArenasOffload,
    ];

    /// Its name for `pvisor replay --strategy`, in keys and in tables.
    pub fn key(self) -> &'static str {
        match self {
            Strategy::Off => "off",
            Strategy::ColdCompression => "cold-compression",
            Strategy::Offload => "offload",
            Strategy::Arenas => "arenas",
            Strategy::ArenasOffload => "arenas-offload",
        }
    }

    /// The `pvisor run` flags the replay gives its VMs, for the Method section.
    pub fn describe(self) -> &'static str {
        match self {
            Strategy::Off => "`--vm-arenas false`",
            Strategy::ColdCompression => "`--vm-cold-ram-compression --vm-arenas false`",
            Strategy::Offload => "`--vm-wait-management --vm-arenas false`",
            Strategy::Arenas => "`--vm-cold-ram-compression --vm-cold-scan false`",
            Strategy::ArenasOffload => "`--vm-wait-management --vm-arena-offload`",
        }
    }
}

/// The strategy every other one is compared with.
pub const BASE: Strategy = Strategy::ALL[0];

/// Sizes and places of one bench (full or smoke).
#[derive(Debug)]
pub struct Settings {
    pub runs: usize,
    pub write_docs: bool,
    pub vms: usize,
    pub strategies: Vec<Strategy>,
    /// Guest RAM of every VM, as `pvisor replay --memory` takes it.
    pub memory: &'static str,
    /// The sampling period of `pvisor replay --sample-ms`.
    pub sample_ms: u64,
    /// The trajectory (a prefix of it) as given to `pvisor replay`, what it holds, and the
    /// steps of the whole one.
    pub trajectory: PathBuf,
    pub replayed: Trajectory,
    pub whole_steps: usize,
    /// The longest a replay may take before it is stopped and counted as failed.
    pub run_limit: Duration,
    pub pvisor: PathBuf,
    /// The CPU accounting group the runs enter (set before the first run).
    pub cpu: Option<CpuGroup>,
}

/// What the runs give that is not a number, by strategy.
pub type Log = scenario::Log<Strategy>;

impl Settings {
    /// The strategies of round `round` (from 0), in order: round 1's rotated by `round`.
    pub fn order(&self, round: usize) -> Vec<Strategy> {
        let mut strategies = self.strategies.clone();
        strategies.rotate_left(round % self.strategies.len());
        strategies
    }
}

fn main() {
    common::main("arenas_report", run_bench);
}

/// The settings, or why the smoke run is skipped; `tmp` holds the replayed prefix. With
/// `render`, no `pvisor` is needed.
fn settings(tmp: &Path, render: bool) -> Res<Result<Settings, String>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let pvisor = match common::vmproc::find_binary(&root, &common::host::target_dir()) {
        Err(_) if render => Ok(PathBuf::new()),
        found => found,
    };
    let full = root.join(TRAJECTORY);
    let whole_steps = Trajectory::load(&full)?.steps.len();
    if !common::is_bench_run() {
        let pvisor = match pvisor {
            Ok(pvisor) => pvisor,
            Err(why) => return Ok(Err(why)),
        };
        let (path, short) =
            common::replay::prefix(&full, SMOKE_STEPS, tmp, "smoke-trajectory.json")?;
        return Ok(Ok(Settings {
            runs: 1,
            write_docs: false,
            vms: 2,
            strategies: vec![Strategy::Off, Strategy::Arenas],
            memory: "512MiB",
            sample_ms: 100,
            trajectory: path,
            replayed: short,
            whole_steps,
            run_limit: Duration::from_secs(60),
            pvisor,
            cpu: None,
        }));
    }
    // A copy, so that a rebuild of target/release/pvisor while the bench runs (the replay
    // starts its VMs from its own executable) cannot change what a later round measures.
    let copy = tmp.join("pvisor");
    if !render {
        fs::copy(pvisor?, &copy)?;
    }
    let runs = common::env_number("ARENAS_BENCH_RUNS", 5, 1)? as usize;
    let steps = common::env_number("ARENAS_BENCH_STEPS", BENCH_STEPS, 2)? as usize;
    let (trajectory, replayed) = if steps >= whole_steps {
        (full.clone(), Trajectory::load(&full)?)
    } else {
        common::replay::prefix(&full, steps, tmp, "bench-trajectory.json")?
    };
    Ok(Ok(Settings {
        runs,
        write_docs: true,
        vms: BENCH_VMS,
        strategies: Strategy::ALL.to_vec(),
        memory: "512MiB",
        sample_ms: 100,
        trajectory,
        replayed,
        whole_steps,
        run_limit: Duration::from_secs(900),
        pvisor: copy,
        cpu: None,
    }))
}

impl ReplayBench for Settings {
    type Run = Strategy;
    const NAME: &'static str = "arenas_report";

    fn stem(&self) -> &str {
        "arenas"
    }
    fn write_docs(&self) -> bool {
        self.write_docs
    }
    fn rounds(&self) -> usize {
        self.runs
    }
    fn fit(&mut self, results: &Results) {
        self.runs = results.runs;
        let held = |s: &Strategy| results.has(&run::key(*s, "integrity_passed"));
        self.strategies.retain(held);
    }
    fn order(&self, round: usize) -> Vec<Strategy> {
        Settings::order(self, round)
    }
    fn label(&self, strategy: Strategy) -> String {
        strategy.key().to_owned()
    }
    fn prefix(&self, strategy: Strategy) -> String {
        strategy.key().to_owned()
    }
    fn replay(&self, strategy: Strategy, samples: &Path) -> Res<Outcome> {
        run::run(self, strategy, samples)
    }
    fn record(&self, outcome: &Outcome, strategy: Strategy, round: usize, results: &mut Results) {
        run::record(outcome, strategy, round, results);
    }
    fn derive(&self, results: &mut Results) {
        report::derive(results, self);
    }
    fn verdicts(&self, results: &Results, log: &Log) -> Vec<Verdict> {
        report::verdicts(results, self, log)
    }
    fn markdown(&self, results: &Results, run: &BenchRun, log: &Log) -> String {
        report::markdown(results, self, run, log)
    }
    fn chart(&self, results: &Results, log: &Log) -> Res<String> {
        report::chart(results, self, log)
    }
}

fn run_bench() -> Res<()> {
    let Some(mut begun) = scenario::begin("arenas", settings)? else {
        return Ok(());
    };
    begun.bench.cpu = Some(CpuGroup::create(&format!(
        "arenas-bench-{}",
        std::process::id()
    ))?);
    let settings = &begun.bench;
    begun.announce(&settings.vms, settings.strategies.len(), &settings.replayed);
    begun.run()
}
