//! Scenario bench of the sandbox daemon (issue 37, docs/sandboxd.md): the real
//! `pvisor-sandboxd` driven through its lifecycle API and execd by the bench's own HTTP client,
//! as an agent platform drives it. `SANDBOX_BENCH_SANDBOXES` (default 64) sandboxes of the
//! workload guest are created one every `SANDBOX_BENCH_STAGGER_MS` (250) under one memory
//! budget (`SANDBOX_BENCH_BUDGET_MIB`, 1024). Each fills a 64 MiB working set, then
//! `SANDBOX_BENCH_ITERATIONS` (10) times waits `SANDBOX_BENCH_IDLE_S` (20) seconds idle and runs
//! `digest`, which reads its whole working set and must find it intact; halfway it is paused
//! and resumed through the API. Two modes run the same load: `managed` (the governor, admission
//! by memory charged, and `--idle-offload 1s`) and `unmanaged`
//! (`--memory-management off`: the VMs only in the budget's cgroup, nothing taken back,
//! admission by what they are charged). A create waits up to 60 s for room, then counts as
//! refused. Regenerates `docs/bench/sandbox.md`, `.csv` and `.svg`.
//!
//! `cargo bench --bench sandbox_report` runs `SANDBOX_BENCH_RUNS` (default 3: one round takes
//! about 9 minutes) interleaved rounds, the order of the modes alternating. Measured by the
//! client: create (the API's answer) and ready (execd's ping) latency, resume to the first
//! output of a command after an idle wait (p50/p99 over every iteration), pause and resume;
//! by the bench: the budget cgroup's usage every 250 ms (memory charged × time, peak), the
//! kernel's OOM kills in it, and how many sandboxes the budget held (admitted and every
//! iteration right).
//!
//! `SANDBOX_BENCH_TRACE=FILE` appends one line per command (`sandbox,id,iteration,at_s,
//! first_output_ms`) to FILE, to see where the slow ones fall.
//!
//! Needs root, `/dev/kvm`, `/dev/userfaultfd`, memory cgroups and `target/release/
//! pvisor-sandboxd` built from the current sources (`cargo build --release -p sandboxd`). Run
//! without `--bench` (as the suite does), it is a smoke run: 3 sandboxes, 2 iterations of 1 s,
//! a 512 MiB budget, one round of both modes; every sandbox must be admitted and right, and no
//! report is written over `docs/bench/`.

#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss,
    clippy::cast_sign_loss
)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use benchkit as common;
use common::host::TempRoot;
use common::results::Results;
use common::Res;

mod client;
mod report;

/// How the daemon treats memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The governor, admission by memory charged, and idle offload after a second.
    Managed,
    /// `--memory-management off`.
    Unmanaged,
}

impl Mode {
    pub const ALL: [Mode; 2] = [Mode::Managed, Mode::Unmanaged];

    pub fn key(self) -> &'static str {
        match self {
            Mode::Managed => "managed",
            Mode::Unmanaged => "unmanaged",
        }
    }

    /// The daemon's flags of the mode.
    fn flags(self) -> &'static [&'static str] {
        match self {
            Mode::Managed => &["--idle-offload", "1s"],
            Mode::Unmanaged => &["--memory-management", "off"],
        }
    }
}

/// Sizes of one bench (full or smoke).
#[derive(Debug, Clone)]
pub struct Settings {
    pub runs: usize,
    pub write_docs: bool,
    pub sandboxes: usize,
    pub iterations: usize,
    pub idle: Duration,
    pub stagger: Duration,
    pub budget_mib: u64,
    pub working_set: &'static str,
    pub daemon: PathBuf,
}

fn settings() -> Res<Result<Settings, String>> {
    let root = common::workspace_root();
    let daemon = match common::vmproc::find_sandboxd_binary(root, &common::host::target_dir()) {
        Ok(path) => path,
        Err(why) if !common::is_bench_run() => return Ok(Err(why)),
        Err(why) => return Err(why.into()),
    };
    if !common::is_bench_run() {
        return Ok(Ok(Settings {
            runs: 1,
            write_docs: false,
            sandboxes: 3,
            iterations: 2,
            idle: Duration::from_secs(1),
            stagger: Duration::from_millis(100),
            budget_mib: 512,
            working_set: "16MiB",
            daemon,
        }));
    }
    let n = |name, default, min| common::env_number(name, default, min);
    Ok(Ok(Settings {
        runs: n("SANDBOX_BENCH_RUNS", 3, 1)? as usize,
        write_docs: true,
        sandboxes: n("SANDBOX_BENCH_SANDBOXES", 64, 1)? as usize,
        iterations: n("SANDBOX_BENCH_ITERATIONS", 10, 2)? as usize,
        idle: Duration::from_secs(n("SANDBOX_BENCH_IDLE_S", 20, 1)?),
        stagger: Duration::from_millis(n("SANDBOX_BENCH_STAGGER_MS", 250, 0)?),
        budget_mib: n("SANDBOX_BENCH_BUDGET_MIB", 1024, 256)?,
        working_set: "64MiB",
        daemon,
    }))
}

fn main() {
    common::main("sandbox_report", run_bench);
}

fn run_bench() -> Res<()> {
    let started = Instant::now();
    let bench_run = common::host::BenchRun::begin();
    if common::skip_smoke("sandbox_report", common::is_bench_run()) {
        return Ok(());
    }
    let settings = match settings()? {
        Ok(settings) => settings,
        Err(why) => {
            eprintln!("sandbox_report: smoke run skipped: {why}");
            return Ok(());
        }
    };
    common::host::check_vm_devices()?;
    // One directory per bench process: a smoke run cannot clear a running bench's files.
    let relative = Path::new("sandbox").join(format!("p{}", std::process::id()));
    let tmp = TempRoot::create("sandbox_report", &relative)?;
    eprintln!(
        "sandbox_report: {} round(s) of {} sandboxes × {} iterations ({} s idle) in {} MiB, \
         managed and unmanaged; {}",
        settings.runs,
        settings.sandboxes,
        settings.iterations,
        settings.idle.as_secs(),
        settings.budget_mib,
        settings.daemon.display()
    );
    let mut results = Results::new(settings.runs);
    let mut memory = Vec::new();
    for round in 0..settings.runs {
        let round_started = Instant::now();
        let mut modes = Mode::ALL;
        modes.rotate_left(round % Mode::ALL.len());
        for mode in modes {
            let dir = tmp.path.join(format!("{}-{round}", mode.key()));
            let outcome = client::run(&settings, mode, &dir)?;
            eprintln!(
                "sandbox_report: round {}, {}: {}",
                round + 1,
                mode.key(),
                outcome.describe()
            );
            report::record(&outcome, mode, round, &mut results);
            memory.push((mode, round, outcome.samples));
        }
        common::end_round("sandbox_report", &mut results, round, round_started);
    }
    drop(tmp);
    report::derive(&mut results);
    let verdicts = report::verdicts(&results, &settings);
    for v in &verdicts {
        eprintln!("sandbox_report: {}: {} ({})", v.target, v.result, v.figure);
    }
    if !settings.write_docs {
        report::smoke_checks(&results, &settings)?;
    }
    let outputs = [
        ("csv", results.csv(&common::results::KEY_RUN_CSV)),
        ("svg", report::chart(&memory, &settings)?),
        (
            "md",
            report::markdown(&results, &verdicts, &settings, &bench_run),
        ),
    ];
    common::finish(
        "sandbox_report",
        settings.write_docs,
        "sandbox",
        &outputs,
        started,
    )
}
