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
//! when the binary is missing or stale, and altogether with `PVISOR_SKIP_DEVICE_TESTS=1`.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmm::replay::Trajectory;

use benchkit as common;
mod report;
mod run;

use common::cpu::CpuGroup;
use common::host::TempRoot;
use common::replay::Timeline;
use common::results::Results;
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
#[derive(Debug, Clone)]
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
}

/// What the runs gave that is not a number, and the memory over time.
#[derive(Debug, Default)]
pub struct Log {
    /// `round N, STRATEGY: why` for every run whose integrity failed.
    pub failures: Vec<String>,
    /// Failed runs whose results were all right: only the sampling failed.
    pub sampling_only: usize,
    /// Runs by `results_digest` (`none` for a run that gave none).
    pub digests: BTreeMap<String, usize>,
    /// Runs that printed their JSON summary.
    pub summaries: usize,
    /// The summed memory of every run, by (strategy, round).
    pub timelines: BTreeMap<(Strategy, usize), Timeline>,
    /// How the CPU time was measured.
    pub cpu_meter: String,
}

impl Log {
    /// Runs recorded.
    pub fn runs(&self) -> usize {
        self.digests.values().sum()
    }
}

fn main() {
    common::main("arenas_report", run_bench);
}

/// The settings, or why the smoke run is skipped; `tmp` holds the replayed prefix.
fn settings(tmp: &Path) -> Res<Result<Settings, String>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let pvisor = common::vmproc::find_binary(&root, &common::host::target_dir());
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
        }));
    }
    // A copy, so that a rebuild of target/release/pvisor while the bench runs (the replay
    // starts its VMs from its own executable) cannot change what a later round measures.
    let copy = tmp.join("pvisor");
    fs::copy(pvisor?, &copy)?;
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
    }))
}

fn run_bench() -> Res<()> {
    let started = Instant::now();
    let bench_run = common::host::BenchRun::begin();
    if common::skip_smoke("arenas_report", common::is_bench_run()) {
        return Ok(());
    }
    // One directory per bench process, so that a smoke run cannot clear a running bench's files.
    let relative = Path::new("arenas").join(format!("p{}", std::process::id()));
    let tmp = TempRoot::create("arenas_report", &relative)?;
    let settings = match settings(&tmp.path)? {
        Ok(settings) => settings,
        Err(why) => {
            eprintln!("arenas_report: smoke run skipped: {why}");
            return Ok(());
        }
    };
    common::host::check_vm_devices()?;
    let run_dir = tmp.path.join("run");
    fs::create_dir_all(&run_dir)?;
    // Read by `vmm::runtime` here and inherited by every `pvisor` started; set before any
    // thread exists.
    std::env::set_var("PVISOR_RUNTIME_DIR", &run_dir);
    let cpu = CpuGroup::create(&format!("arenas-bench-{}", std::process::id()))?;
    eprintln!(
        "arenas_report: {} round(s) of {} VMs × {} strategies replaying {} ({} model waits, {:.1} s of \
         waits); {}; temporary files in {} ({})",
        settings.runs,
        settings.vms,
        settings.strategies.len(),
        settings.replayed.name,
        settings.replayed.requests().len(),
        settings.replayed.total_wait().as_secs_f64(),
        settings.pvisor.display(),
        tmp.path.display(),
        tmp.filesystem
    );

    let mut results = Results::new(settings.runs);
    let mut log = Log {
        cpu_meter: cpu.describe(),
        ..Log::default()
    };
    let total = settings.runs * settings.strategies.len();
    let mut done = 0;
    for round in 0..settings.runs {
        let round_started = Instant::now();
        let mut strategies = settings.strategies.clone();
        strategies.rotate_left(round % settings.strategies.len());
        for &strategy in &strategies {
            done += 1;
            let samples = tmp.path.join(format!("samples-{}.csv", strategy.key()));
            let outcome = run::run(&settings, strategy, &samples, &cpu)?;
            eprintln!(
                "arenas_report: [{done}/{total}] round {}, {}: {}",
                round + 1,
                strategy.key(),
                outcome.describe()
            );
            if outcome.summary.is_none() && log.summaries == 0 {
                // Not one replay got as far as its summary: `pvisor replay` cannot run here.
                return Err(format!(
                    "`pvisor replay` did not run: {}",
                    outcome.problem.as_deref().unwrap_or("no summary")
                )
                .into());
            }
            run::record(outcome, strategy, round, &mut results, &mut log);
        }
        common::end_round("arenas_report", &mut results, round, round_started);
    }
    drop(cpu);
    drop(tmp);
    report::derive(&mut results, &settings);
    let verdicts = report::verdicts(&results, &settings, &log);
    for v in &verdicts {
        eprintln!("arenas_report: {}: {} ({})", v.target, v.result, v.figure);
    }
    if !settings.write_docs {
        smoke_checks(&log)?;
    }
    let chosen = report::median_round(&results, &settings);
    let context = report::Context {
        settings: &settings,
        run: &bench_run,
        log: &log,
        chosen,
    };
    let outputs = [
        ("csv", results.csv(&common::results::KEY_RUN_CSV)),
        ("svg", report::chart(&results, &context)?),
        ("md", report::markdown(&results, &verdicts, &context)),
    ];
    common::finish(
        "arenas_report",
        settings.write_docs,
        "arenas",
        &outputs,
        started,
    )
}

/// The smoke run's check: the integrity target (every run passed its integrity check, and
/// all gave the same `results_digest`).
fn smoke_checks(log: &Log) -> Res<()> {
    let integrity = report::integrity(log);
    if integrity.result == report::PASS {
        Ok(())
    } else {
        Err(format!("integrity failed: {}", integrity.figure).into())
    }
}
