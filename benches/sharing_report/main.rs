//! Scenario bench of cross-VM memory sharing (issue 6): four 512 MiB VMs, each a real `pvisor`
//! process with 64 MiB of application data, with and without sharing, as in the seed's
//! four-VM table. Regenerates `docs/bench/sharing.md`, `docs/bench/sharing.csv` and
//! `docs/bench/sharing.svg`.
//!
//! `cargo bench --bench sharing_report` runs `SHARING_BENCH_RUNS` (default 5) interleaved
//! rounds. In each round every content (`Content::ALL`: the same repeated data in all four
//! VMs, the same random data, different random data) runs once as a group of four VMs in every
//! mode (`Mode::ALL`: no sharing, and KSM through `pvisor run --vm-ram-dedup`); round `r`
//! rotates the order of the contents by `r` and reverses the order of the modes for odd `r`.
//! A group (`group`) starts its four VMs, fills them, reads their memory at fixed moments
//! after the last fill (for KSM at 2 s, 10 s and `SHARING_BENCH_LONG_S`, default 60), then
//! rewrites 25% and then 100% of every VM's data with seeds of its own, reading each stage
//! 2 s later; ksmd's CPU time is sampled every 250 ms throughout. Savings are computed within
//! a round (mode over no sharing, same content and stage), then summarised.
//!
//! Every digest is checked (`integrity`): VMs with the same content agree, every VM agrees
//! with the unshared VM of the same index after every stage, and those agree with the host's
//! own computation of the bytes; before and after every KSM group the KSM knobs are read, to
//! see that the host gets its settings back.
//!
//! Needs root, `/dev/kvm`, `/dev/userfaultfd`, a kernel with KSM, and `target/release/pvisor`
//! built from the current sources (`cargo build --release -p vmm --bin pvisor`). Run without
//! `--bench` (as `cargo test --benches` does), it is a quick smoke run (64 MiB VMs with 4 MiB
//! of data, waits of 0.5 s, one round, every check) that writes no report; it is skipped with
//! a message when the binary is missing or stale, and altogether with
//! `PVISOR_SKIP_DEVICE_TESTS=1`.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmm::guest::FillKind;
use vmm::script::Command;

use benchkit as common;
mod chart;
mod group;
mod integrity;
mod ksmd;
mod report;
mod results;
mod seed;
mod targets;

use common::host::TempRoot;
use common::Res;
use results::Results;

const MIB: u64 = 1 << 20;

/// What the four VMs of a group hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Content {
    /// One repeated motif, the same in every VM (every page alike, within and across VMs).
    Repeated,
    /// The same random bytes in every VM (pages alike across VMs only).
    SameRandom,
    /// Different random bytes in every VM (nothing alike).
    UniqueRandom,
}

impl Content {
    pub const ALL: [Content; 3] = [
        Content::Repeated,
        Content::SameRandom,
        Content::UniqueRandom,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Content::Repeated => "repeated",
            Content::SameRandom => "same-random",
            Content::UniqueRandom => "unique-random",
        }
    }

    /// Every VM holds the same bytes.
    pub fn identical(self) -> bool {
        self != Content::UniqueRandom
    }

    /// What VM `vm` (from 0) holds: the kind of fill and its seed.
    pub fn data(self, vm: usize) -> (FillKind, u64) {
        match self {
            Content::Repeated => (FillKind::Repeated, 1),
            Content::SameRandom => (FillKind::Random, 11),
            Content::UniqueRandom => (FillKind::Random, 100 + vm as u64),
        }
    }

    /// The fill of VM `vm`.
    pub fn fill(self, size: u64, vm: usize) -> Command {
        let (kind, seed) = self.data(vm);
        Command::Fill { size, kind, seed }
    }
}

/// How the VMs of a group share memory. Adding a mode is a variant here (its name, its
/// `pvisor run` flags, whether it uses KSM) and, if its VMs start otherwise, an arm in
/// `group::start`; the report shows the modes that were measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mode {
    /// Plain `pvisor run`: every VM pays for all of its pages.
    None,
    /// `pvisor run --vm-ram-dedup`: KSM merges identical pages within and across VMs.
    Ksm,
    /// `pvisor run --restore DIR`: every VM continues one sealed snapshot of a VM that holds
    /// the content (the unique content is filled after the restore), mapping its image
    /// copy-on-write.
    Snapshot,
    /// `pvisor run --vm-memory-pool SOCKET` beside `pvisor serve --memory-pool`: the pool
    /// keeps one copy of the pages the VMs have in common.
    Pool,
}

impl Mode {
    /// Every mode, in the order of even rounds; the first is the one the others save against.
    pub const ALL: [Mode; 4] = [Mode::None, Mode::Ksm, Mode::Snapshot, Mode::Pool];

    pub fn key(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::Ksm => "ksm",
            Mode::Snapshot => "snapshot",
            Mode::Pool => "pool",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Mode::None => "no sharing (`pvisor run`)",
            Mode::Ksm => "KSM (`pvisor run --vm-ram-dedup`)",
            Mode::Snapshot => "snapshot COW (`pvisor run --restore DIR`)",
            Mode::Pool => "memory pool (`pvisor run --vm-memory-pool S`)",
        }
    }

    /// The flags of `pvisor run` besides `--memory`.
    pub fn run_args(self) -> &'static [&'static str] {
        match self {
            Mode::None | Mode::Snapshot | Mode::Pool => &[],
            Mode::Ksm => &["--vm-ram-dedup"],
        }
    }

    /// Whether the mode uses KSM (its knobs are checked, its merged pages read).
    pub fn ksm(self) -> bool {
        self == Mode::Ksm
    }

    /// When the memory is read after the last fill; the last is the mode's initial reading.
    /// Without sharing nothing changes once the fills return, so one reading is enough.
    pub fn fill_readings(self, settings: &Settings) -> Vec<Duration> {
        match self {
            Mode::None | Mode::Snapshot | Mode::Pool => vec![settings.settle],
            Mode::Ksm => settings.ksm_readings.clone(),
        }
    }

    /// The key of the mode's initial reading.
    pub fn initial(self, settings: &Settings) -> Point {
        let after = *self
            .fill_readings(settings)
            .last()
            .expect("every mode reads its memory at least once after the fills");
        Point::Filled(after)
    }
}

/// The mode every other one is compared with.
pub const BASE: Mode = Mode::ALL[0];

/// The rewrite stages after the initial readings: the share of every VM's data pages
/// rewritten, and the base of the seeds (VM `i` uses `base + i`, so the VMs diverge).
pub const REWRITES: [(u64, u64); 2] = [(25, 1000), (100, 2000)];

/// A moment at which a group's memory is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    /// This long after the last fill returned.
    Filled(Duration),
    /// `Settings::settle` after the last `rewrite PERCENT` returned.
    Rewritten(u64),
}

impl Point {
    /// Its part of the result keys: `at_2s`, `at_500ms`, `rewrite25`.
    pub fn key(self) -> String {
        match self {
            Point::Filled(after) if after.subsec_millis() == 0 => {
                format!("at_{}s", after.as_secs())
            }
            Point::Filled(after) => format!("at_{}ms", after.as_millis()),
            Point::Rewritten(percent) => format!("rewrite{percent}"),
        }
    }

    /// For the tables: `2 s after the fills`, `after the 25% rewrite`.
    pub fn label(self) -> String {
        match self {
            Point::Filled(after) => format!("{} s after the fills", results::secs(after)),
            Point::Rewritten(percent) => format!("after the {percent}% rewrite"),
        }
    }
}

/// Sizes and periods of one bench (full or smoke).
#[derive(Debug, Clone)]
pub struct Settings {
    pub runs: usize,
    pub write_docs: bool,
    /// VMs per group.
    pub vms: usize,
    pub memory: u64,
    pub app: u64,
    /// When a KSM group is read after its fills (2 s, 10 s, `SHARING_BENCH_LONG_S`).
    pub ksm_readings: Vec<Duration>,
    /// When the unshared group is read after its fills, and every group after a rewrite.
    pub settle: Duration,
    /// Period of ksmd's CPU samples.
    pub sample: Duration,
    /// Span of the busiest window of ksmd.
    pub peak_span: Duration,
    pub pvisor: PathBuf,
    pub root: PathBuf,
}

impl Settings {
    /// Every reading of a group of `mode`, in order.
    pub fn points(&self, mode: Mode) -> Vec<Point> {
        let filled = mode.fill_readings(self).into_iter().map(Point::Filled);
        let rewritten = REWRITES
            .iter()
            .map(|&(percent, _)| Point::Rewritten(percent));
        filled.chain(rewritten).collect()
    }

    /// The stages a group goes through, by their reading: the initial one, then the rewrites.
    pub fn stages(&self, mode: Mode) -> Vec<Point> {
        let rewritten = REWRITES
            .iter()
            .map(|&(percent, _)| Point::Rewritten(percent));
        std::iter::once(mode.initial(self))
            .chain(rewritten)
            .collect()
    }
}

fn main() {
    common::main("sharing_report", run);
}

/// The settings, or why the smoke run is skipped.
fn settings() -> Res<Result<Settings, String>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let pvisor = common::vmproc::find_binary(&root, &common::host::target_dir());
    if !common::is_bench_run() {
        let pvisor = match pvisor {
            Ok(pvisor) => pvisor,
            Err(why) => return Ok(Err(why)),
        };
        let step = Duration::from_millis(500);
        return Ok(Ok(Settings {
            runs: 1,
            write_docs: false,
            vms: 4,
            memory: 64 * MIB,
            app: 4 * MIB,
            ksm_readings: vec![step, 2 * step, 3 * step],
            settle: step,
            sample: Duration::from_millis(250),
            peak_span: Duration::from_secs(1),
            pvisor,
            root,
        }));
    }
    let long = common::env_number("SHARING_BENCH_LONG_S", 60, 10)?;
    let mut ksm_readings: Vec<Duration> = [2, 10, long].map(Duration::from_secs).to_vec();
    ksm_readings.dedup();
    Ok(Ok(Settings {
        runs: common::env_number("SHARING_BENCH_RUNS", 5, 1)? as usize,
        write_docs: true,
        vms: 4,
        memory: 512 * MIB,
        app: 64 * MIB,
        ksm_readings,
        settle: Duration::from_secs(2),
        sample: Duration::from_millis(250),
        peak_span: Duration::from_secs(1),
        pvisor: pvisor?,
        root,
    }))
}

/// What the bench saw of KSM's knobs besides the figures, for the report.
#[derive(Debug, Default)]
pub struct KnobLog {
    /// The knobs before the first KSM group.
    pub first: Option<ksmd::Knobs>,
    /// The knobs while the first KSM group's VMs ran.
    pub tuned: Option<ksmd::Knobs>,
    /// `round N, CONTENT: knob before → after` for every knob not given back.
    pub not_restored: Vec<String>,
}

fn run() -> Res<()> {
    let started = Instant::now();
    let bench_run = common::host::BenchRun::begin();
    let settings = match settings()? {
        Ok(settings) => settings,
        Err(why) => {
            eprintln!("sharing_report: smoke run skipped: {why}");
            return Ok(());
        }
    };
    if common::skip_smoke("sharing_report", settings.write_docs) {
        return Ok(());
    }
    common::host::check_vm_devices()?;
    ksmd::check()?;
    // One directory per bench process, so that a smoke run cannot clear a running bench's files.
    let relative = Path::new("sharing").join(format!("p{}", std::process::id()));
    let tmp = TempRoot::create("sharing_report", &relative)?;
    let run_dir = tmp.path.join("run");
    fs::create_dir_all(&run_dir)?;
    // Read by `vmm::runtime` here and inherited by every `pvisor` started; set before any
    // thread exists.
    std::env::set_var("PVISOR_RUNTIME_DIR", &run_dir);
    let readings: Vec<String> = settings
        .ksm_readings
        .iter()
        .map(|&d| results::secs(d))
        .collect();
    eprintln!(
        "sharing_report: {} round(s) of {} contents × {} modes: {} VMs of {} MiB with {} MiB of data each, \
         KSM read {} s after the fills; {}; temporary files in {} ({})",
        settings.runs,
        Content::ALL.len(),
        Mode::ALL.len(),
        settings.vms,
        settings.memory / MIB,
        settings.app / MIB,
        readings.join(", "),
        settings.pvisor.display(),
        tmp.path.display(),
        tmp.filesystem
    );

    let expected = integrity::expected(&settings);
    let mut results = Results::new(settings.runs);
    let mut knobs = KnobLog::default();
    let total = settings.runs * Content::ALL.len() * Mode::ALL.len();
    let mut done = 0;
    for round in 0..settings.runs {
        let round_started = Instant::now();
        let mut contents = Content::ALL;
        contents.rotate_left(round % Content::ALL.len());
        let mut modes = Mode::ALL;
        if round % 2 == 1 {
            modes.reverse();
        }
        for content in contents {
            let mut digests = BTreeMap::new();
            for mode in modes {
                done += 1;
                let t = Instant::now();
                let outcome = group::run(&settings, content, mode, round, &mut results)?;
                if let Some(k) = &outcome.knobs {
                    knobs.first.get_or_insert_with(|| k.before.clone());
                    knobs.tuned.get_or_insert_with(|| k.tuned.clone());
                    for (name, before, after) in k.differences() {
                        knobs.not_restored.push(format!(
                            "round {}, {}: `{name}` {before} before, {after} after",
                            round + 1,
                            content.name()
                        ));
                    }
                }
                digests.insert(mode, outcome.digests);
                let initial = mode.initial(&settings).key();
                let key =
                    |point: &str, q: &str| format!("{}.{}.{point}.{q}", content.name(), mode.key());
                let value = |key: &str| results.values(key).get(round).copied();
                eprintln!(
                    "sharing_report: [{done}/{total}] round {}, {} / {}: {:.1} MiB per VM initially, {:.1} after \
                     the 100% rewrite{} ({:.1} s)",
                    round + 1,
                    content.name(),
                    mode.key(),
                    value(&key(&initial, "per_instance_mib")).unwrap_or(f64::NAN),
                    value(&key("rewrite100", "per_instance_mib")).unwrap_or(f64::NAN),
                    match outcome.knobs.as_ref().map(ksmd::GroupKnobs::restored) {
                        Some(true) => "; KSM settings given back",
                        Some(false) => "; KSM settings NOT given back",
                        None => "",
                    },
                    t.elapsed().as_secs_f64()
                );
            }
            integrity::check(&settings, content, round, &digests, &expected)?;
        }
        results.put(
            "bench.round_s",
            "s",
            round,
            round_started.elapsed().as_secs_f64(),
        );
        eprintln!(
            "sharing_report: round {}/{} done in {:.0} s",
            round + 1,
            settings.runs,
            round_started.elapsed().as_secs_f64()
        );
    }
    drop(tmp);
    targets::derive(&mut results, &settings);
    let verdicts = targets::verdicts(&results, &settings);
    common::verdict::log("sharing_report", &verdicts);
    let context = report::Context {
        settings: &settings,
        run: &bench_run,
        knobs: &knobs,
    };
    let outputs = [
        ("csv", results.csv(&results::CSV)),
        ("svg", chart::svg(&results, &settings)?),
        ("md", report::markdown(&results, &verdicts, &context)),
    ];
    common::finish(
        "sharing_report",
        settings.write_docs,
        "sharing",
        &outputs,
        started,
    )
}
