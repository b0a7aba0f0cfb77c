//! Scenario bench of the sandbox daemon (issue 37, docs/sandboxd.md): the real
//! `pvisor-sandboxd` driven through its lifecycle API and execd by the bench's own HTTP client,
//! as an agent platform drives it. `SANDBOX_BENCH_SANDBOXES` (default 64) sandboxes of the
//! workload guest are created one every `SANDBOX_BENCH_STAGGER_MS` (250) under one memory
//! budget (`SANDBOX_BENCH_BUDGET_MIB`, 1024). Each fills a 64 MiB working set, then
//! `SANDBOX_BENCH_ITERATIONS` (10) times waits `SANDBOX_BENCH_IDLE_S` (20) seconds idle and runs
//! `digest`, which reads its whole working set and must find it intact; halfway it is paused
//! and resumed through the API. Three modes run the same load: `managed` (the governor,
//! admission by memory charged, and `--idle-offload 1s`), `managed-eager` (the same with
//! `--idle-resume eager`) and `unmanaged` (`--memory-management off`: the VMs only in the
//! budget's cgroup, nothing taken back, admission by what they are charged). A create waits
//! up to 60 s for room, then counts as refused. Regenerates `docs/bench/sandbox.md`, `.csv` and `.svg`.
//!
//! `cargo bench --bench sandbox_report` runs `SANDBOX_BENCH_RUNS` (default 3: one round takes
//! about 13 minutes) interleaved rounds, the order of the modes alternating. Measured by the
//! client: create (the API's answer) and ready (execd's ping) latency, resume to the first
//! output of a command after an idle wait (p50/p99 over every iteration), pause and resume;
//! by the bench: the budget cgroup's usage every 250 ms (memory charged × time, peak), the
//! kernel's OOM kills in it, and how many sandboxes the budget held (admitted and every
//! iteration right).
//!
//! `SANDBOX_BENCH_TEMPLATE=1` runs the template layout (issue 37 item 6, `docs/bench/sandbox-
//! template.md`; see `Layout::Template` and the modes); a smoke run tries both layouts.
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

/// How the daemon treats memory, and what the sandboxes are made from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The governor, admission by memory charged, and idle offload after a second.
    Managed,
    /// `Managed` with `--idle-resume eager`: all memory back before an idle sandbox's command.
    ManagedEager,
    /// `--memory-management off`.
    Unmanaged,
    /// Sandboxes of a snapshot template, its pages shared through KSM
    /// (`--share-template-pages`) under the governor, without idle offload.
    TemplateShared,
    /// Sandboxes of a snapshot template, managed as `Managed` is.
    Template,
    /// Sandboxes of a snapshot template, `--memory-management off`.
    TemplateUnmanaged,
}

impl Mode {
    pub fn key(self) -> &'static str {
        match self {
            Mode::Managed => "managed",
            Mode::ManagedEager => "managed-eager",
            Mode::Unmanaged => "unmanaged",
            Mode::TemplateShared => "template-shared",
            Mode::Template => "template",
            Mode::TemplateUnmanaged => "template-unmanaged",
        }
    }

    /// The daemon's flags of the mode.
    fn flags(self) -> &'static [&'static str] {
        match self {
            Mode::Managed | Mode::Template => &["--idle-offload", "1s"],
            Mode::ManagedEager => &["--idle-offload", "1s", "--idle-resume", "eager"],
            Mode::Unmanaged | Mode::TemplateUnmanaged => &["--memory-management", "off"],
            Mode::TemplateShared => &["--share-template-pages", "--idle-offload", "0"],
        }
    }
}

/// The modes one bench compares: the managed ones, then the unmanaged one they are judged
/// against (the last).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Sandboxes of the workload guest, each filling its own working set.
    Workload,
    /// Sandboxes of one snapshot template whose RAM holds the working set (item 6): each
    /// reads it as restored from the snapshot.
    Template,
}

impl Layout {
    pub fn modes(self) -> &'static [Mode] {
        match self {
            Layout::Workload => &[Mode::Managed, Mode::ManagedEager, Mode::Unmanaged],
            Layout::Template => &[
                Mode::TemplateShared,
                Mode::Template,
                Mode::TemplateUnmanaged,
            ],
        }
    }

    /// The modes judged against the last.
    pub fn managed(self) -> &'static [Mode] {
        let modes = self.modes();
        &modes[..modes.len() - 1]
    }

    pub fn unmanaged(self) -> Mode {
        self.modes()[self.modes().len() - 1]
    }

    /// The report's file stem under `docs/bench/`.
    pub fn stem(self) -> &'static str {
        match self {
            Layout::Workload => "sandbox",
            Layout::Template => "sandbox-template",
        }
    }
}

/// A snapshot template: its directory, and the digest of its working set.
#[derive(Debug, Clone)]
pub struct TemplateSnapshot {
    pub dir: PathBuf,
    pub digest: String,
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
    pub layout: Layout,
    /// The template of [`Layout::Template`], made before the first round.
    pub template: Option<TemplateSnapshot>,
}

fn settings() -> Res<Result<Settings, String>> {
    let root = common::workspace_root();
    let daemon = match common::vmproc::find_sandboxd_binary(root, &common::host::target_dir()) {
        Ok(path) => path,
        Err(why) if !common::is_bench_run() => return Ok(Err(why)),
        Err(why) => return Err(why.into()),
    };
    let layout = if std::env::var_os("SANDBOX_BENCH_TEMPLATE").is_some_and(|v| v == "1") {
        Layout::Template
    } else {
        Layout::Workload
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
            layout,
            template: None,
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
        layout,
        template: None,
    }))
}

fn main() {
    common::main("sandbox_report", run_bench);
}

fn run_bench() -> Res<()> {
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
    // A smoke run tries both layouts; a bench run the one asked for.
    let layouts = if settings.write_docs {
        vec![settings.layout]
    } else {
        vec![Layout::Workload, Layout::Template]
    };
    for layout in layouts {
        let mut settings = Settings {
            layout,
            ..settings.clone()
        };
        if layout == Layout::Template {
            settings.template = Some(template_snapshot(&settings, &tmp.path.join("template"))?);
        }
        // Short names: the daemon's state directory must leave room for its VMs' socket
        // paths (107 bytes) under a checkout anywhere.
        let short = if layout == Layout::Template { "t" } else { "w" };
        run_layout(&settings, &tmp.path.join(short), &bench_run)?;
    }
    Ok(())
}

/// Bytes of guest RAM of the template's VM: the daemon's default for the workload guest, so
/// that both layouts' sandboxes are alike but for where their data comes from; smaller in a
/// smoke run.
fn template_memory(settings: &Settings) -> u64 {
    if settings.write_docs {
        512 << 20
    } else {
        128 << 20
    }
}

/// Makes the template: a VM that filled the working set, snapshotted into `dir`.
fn template_snapshot(settings: &Settings, dir: &Path) -> Res<TemplateSnapshot> {
    use vmm::vm::{Vm, VmOptions};
    std::fs::create_dir_all(dir)?;
    let started = Instant::now();
    let mut vm = Vm::start(VmOptions {
        io_threads: 1,
        ..VmOptions::new(
            template_memory(settings),
            uffd_pager::pager::RamKind::Anon,
            dir.join("disk"),
            dir.join("ram"),
        )
    })?;
    let script = format!("fill {} random seed=1; digest", settings.working_set);
    let out = vm.exec(&vmm::script::parse(&script)?)?;
    let digest = out
        .get(1)
        .and_then(|o| o.digest.clone())
        .ok_or("the template's VM printed no digest")?;
    let snap = dir.join("snapshot");
    vm.snapshot(&snap, None)?;
    drop(vm);
    eprintln!(
        "sandbox_report: template of {} MiB holding {} made in {:.1} s",
        template_memory(settings) >> 20,
        settings.working_set,
        started.elapsed().as_secs_f64()
    );
    Ok(TemplateSnapshot { dir: snap, digest })
}

/// Every round of one layout, and its report.
fn run_layout(settings: &Settings, tmp: &Path, bench_run: &common::host::BenchRun) -> Res<()> {
    let started = Instant::now();
    let layout = settings.layout;
    eprintln!(
        "sandbox_report: {} round(s) of {} sandboxes × {} iterations ({} s idle) in {} MiB, \
         modes {}; {}",
        settings.runs,
        settings.sandboxes,
        settings.iterations,
        settings.idle.as_secs(),
        settings.budget_mib,
        report::modes_text(layout),
        settings.daemon.display()
    );
    let mut results = Results::new(settings.runs);
    let mut memory = Vec::new();
    for round in 0..settings.runs {
        let round_started = Instant::now();
        let mut modes = layout.modes().to_vec();
        let turn = round % modes.len();
        modes.rotate_left(turn);
        for mode in modes {
            let index = layout.modes().iter().position(|m| *m == mode).unwrap_or(0);
            let dir = tmp.join(format!("m{index}-{round}"));
            let outcome = client::run(settings, mode, &dir)?;
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
    report::derive(&mut results, layout);
    let verdicts = report::verdicts(&results, settings);
    common::verdict::log("sandbox_report", &verdicts);
    if !settings.write_docs {
        report::smoke_checks(&results, settings)?;
    }
    let outputs = [
        ("csv", results.csv(&common::results::KEY_RUN_CSV)),
        ("svg", report::chart(&memory, settings)?),
        (
            "md",
            report::markdown(&results, &verdicts, settings, bench_run),
        ),
    ];
    common::finish(
        "sandbox_report",
        settings.write_docs,
        layout.stem(),
        &outputs,
        started,
    )
}
