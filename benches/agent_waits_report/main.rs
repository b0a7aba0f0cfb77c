//! Scenario bench of agent-wait memory management (issue 7): the real `pvisor replay` of the
//! qutebrowser-667-shaped trajectory, against the seed's 16-VM table, in two forms:
//! - `AGENT_BENCH_WAITS=scaled` (the default): the waits × 0.05, in one VM and in 16 VMs
//!   sharing the machine, under every wait strategy; regenerates `docs/bench/agent-waits.md`,
//!   `.csv` and `.svg`;
//! - `AGENT_BENCH_WAITS=recorded`: the waits as recorded (232.7 s per task, as the seed ran
//!   them), 16 VMs, off against the two offloads, offload without the warm-up as answers
//!   stream in (`offload-late`) and offload with a prefetching reload; regenerates
//!   `docs/bench/agent-waits-recorded.*` (about 4 minutes a run, 100 minutes for 5 rounds).
//!   With `AGENT_BENCH_STEPS=N`, only the trajectory's first N steps (24: the density bench's
//!   prefix, about a minute a run), reported as `docs/bench/agent-waits-prefix.*`.
//!   `AGENT_BENCH_STRATEGIES=off,offload,offload-late` runs only those (off first); naming
//!   `off-huge` or `offload-huge` (guest RAM in 2 MiB huge pages, which the bench has the
//!   kernel lend while it runs) reports as `agent-waits-huge*` instead.
//! - `AGENT_BENCH_WAITS=io`: the trajectory with downloads and image reads (issue 38,
//!   `docs/trajectories/qutebrowser-667-io.json`), 16 VMs, off against offload managing model
//!   waits only (`offload-model`) and all three sources (`offload`); regenerates
//!   `docs/bench/agent-waits-io.*`, or with `AGENT_BENCH_STEPS=N` `agent-waits-io-prefix.*`
//!   (42 steps hold the same 12 model waits and tool phases as the 24-step prefix).
//!
//! `cargo bench --bench agent_waits_report` runs `AGENT_BENCH_RUNS` (default 5) interleaved
//! rounds. In each round every group — N VMs (`Settings::vms`: 1 and 16) under a strategy
//! (`Strategy::ALL`: off, pause, offload, offload-compressed) — runs once as
//! `pvisor replay TRAJECTORY --vms N --strategy S --memory 512MiB --json --samples FILE`
//! (`replay`); round `r` rotates the order of the strategies by `r` and reverses the order of
//! the Ns for odd `r`. Every field of the replay's JSON summary, its exit status and its memory
//! samples are kept; a run whose integrity failed is recorded and counted, never dropped, and
//! the bench fails only if `pvisor replay` cannot run at all. Ratios to `off` are computed
//! within a round (same N), then summarised (`targets`).
//!
//! Needs root, `/dev/kvm`, `/dev/userfaultfd`, memory cgroups, and `target/release/pvisor`
//! built from the current sources (`cargo build --release -p vmm --bin pvisor`). Run without
//! `--bench` (as `cargo test --benches` does), it is a quick smoke run: the trajectory's first
//! `SMOKE_STEPS` steps, 1 and 2 VMs, off and offload, one round; every run must pass its
//! integrity check and give the same `results_digest`; no report is written. It is skipped with
//! a message when the binary is missing or stale, and altogether with
//! `PVISOR_SKIP_DEVICE_TESTS=1`. The smoke run also checks render mode on its own CSV.
//!
//! Render mode (`BENCH_RENDER=1`, `benchkit::render`): the report that the same variables
//! name (`AGENT_BENCH_WAITS`, `AGENT_BENCH_STEPS`) is written again from its kept CSV and
//! report, nothing run: `BENCH_RENDER=1 AGENT_BENCH_WAITS=recorded cargo bench --bench
//! agent_waits_report` re-renders `docs/bench/agent-waits-recorded.md`. The chart is not
//! redrawn (its samples are not kept in the CSV); the report says which chart it shows.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use vmm::replay::{Step, Trajectory};

mod replay;
mod report;
mod seed;
mod targets;

use benchkit as common;
use common::host::BenchRun;
use common::replay::Outcome;
use common::results::Results;
use common::scenario::{self, ReplayBench};
use common::verdict::Verdict;
use common::Res;

/// The trajectory of the scaled bench, from the workspace root.
const TRAJECTORY: &str = "docs/trajectories/qutebrowser-667-scaled.json";
/// The trajectory with the waits as recorded.
const TRAJECTORY_RECORDED: &str = "docs/trajectories/qutebrowser-667.json";
/// The same with downloads and image reads (issue 38).
const TRAJECTORY_IO: &str = "docs/trajectories/qutebrowser-667-io.json";
/// Steps of the trajectory the smoke run replays (its first six model waits).
const SMOKE_STEPS: usize = 12;

/// What `pvisor replay --strategy` does while the agents wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Strategy {
    /// No wait management: every VM keeps its memory through its waits.
    Off,
    /// The VM is paused during a wait; its memory stays.
    Pause,
    /// Paused, then its RAM offloaded to its store and loaded back lazily on the answer.
    Offload,
    /// The same with the store compressed.
    OffloadCompressed,
    /// Offload with the RAM brought back by a prefetcher after the answer, not on faults
    /// only (`--vm-wait-reload lazy`).
    OffloadLazy,
    /// Offload without the warm-up as the answer streams in: the RAM comes back on the
    /// guest's faults after the answer only (`--vm-wait-warm false`), as before issue 35's
    /// item 3c.
    OffloadLate,
    /// Offload during model waits only; the VM just waits through downloads and image reads
    /// (`--vm-wait-sources model`).
    OffloadModel,
    /// Off, guest RAM in 2 MiB huge pages (`--vm-ram-backing hugetlb`).
    OffHuge,
    /// Offload, guest RAM in 2 MiB huge pages.
    OffloadHuge,
}

/// The `[vm]` config of the huge-page strategies.
const HUGE: &str = "[vm]\nram-backing = \"hugetlb\"\n";

impl Strategy {
    /// Every strategy, in the order of round 0; the first is the one the others are compared
    /// with.
    pub const ALL: [Strategy; 4] = [
        Strategy::Off,
        Strategy::Pause,
        Strategy::Offload,
        Strategy::OffloadCompressed,
    ];

    /// Its name for `pvisor replay --strategy`, in keys and in tables.
    pub fn key(self) -> &'static str {
        match self {
            Strategy::Off => "off",
            Strategy::Pause => "pause",
            Strategy::Offload => "offload",
            Strategy::OffloadCompressed => "offload-compressed",
            Strategy::OffloadLazy => "offload-lazy",
            Strategy::OffloadLate => "offload-late",
            Strategy::OffloadModel => "offload-model",
            Strategy::OffHuge => "off-huge",
            Strategy::OffloadHuge => "offload-huge",
        }
    }

    /// `pvisor replay --strategy`, and the `[vm]` config the VMs start with, if any.
    pub fn replay_args(self) -> (&'static str, Option<&'static str>) {
        match self {
            Strategy::OffloadLazy => ("offload", Some("[vm]\nwait-reload = \"lazy\"\n")),
            Strategy::OffloadLate => ("offload", Some("[vm]\nwait-warm = false\n")),
            Strategy::OffloadModel => ("offload", Some("[vm]\nwait-sources = \"model\"\n")),
            Strategy::OffHuge => ("off", Some(HUGE)),
            Strategy::OffloadHuge => ("offload", Some(HUGE)),
            other => (other.key(), None),
        }
    }

    /// What the VMs run with, for the Method section.
    pub fn describe(self) -> &'static str {
        match self {
            Strategy::Off => "no wait management (`pvisor run` as it is)",
            Strategy::Pause => "`--vm-wait-management --vm-wait-strategy pause`",
            Strategy::Offload => "`--vm-wait-management` (the default strategy, offload)",
            Strategy::OffloadCompressed => "`--vm-wait-management --vm-ram-compression`",
            Strategy::OffloadLazy => {
                "`--vm-wait-management --vm-wait-reload lazy` (as `pvisor replay --strategy offload \
                 --vm-config FILE` with `wait-reload = \"lazy\"`)"
            }
            Strategy::OffloadLate => {
                "`--vm-wait-management --vm-wait-warm false`: no warm-up as the answer streams \
                 in (as `pvisor replay --strategy offload --vm-config FILE` with \
                 `wait-warm = false`)"
            }
            Strategy::OffloadModel => {
                "`--vm-wait-management --vm-wait-sources model`: model waits managed, downloads \
                 and image reads only waited through (as `pvisor replay --strategy offload \
                 --vm-config FILE` with `wait-sources = \"model\"`)"
            }
            Strategy::OffHuge | Strategy::OffloadHuge => {
                "as off or offload, with guest RAM in 2 MiB huge pages (`pvisor replay --strategy \
                 off|offload --vm-config FILE` with `ram-backing = \"hugetlb\"`)"
            }
        }
    }

    /// Whether its guest RAM is in huge pages.
    pub fn huge(self) -> bool {
        matches!(self, Strategy::OffHuge | Strategy::OffloadHuge)
    }

    /// Whether the memory and window targets are judged on it.
    pub fn judged(self) -> bool {
        matches!(
            self,
            Strategy::Offload | Strategy::OffloadCompressed | Strategy::OffloadLazy
        )
    }
}

/// The strategy every other one is compared with.
pub const BASE: Strategy = Strategy::ALL[0];

/// Sizes and places of one bench (full or smoke).
#[derive(Debug, Clone)]
pub struct Settings {
    pub runs: usize,
    pub write_docs: bool,
    /// The reports' file stem under docs/bench.
    pub stem: &'static str,
    /// The group sizes, in the order of even rounds; the last is the one the targets judge.
    pub vms: Vec<usize>,
    pub strategies: Vec<Strategy>,
    /// Guest RAM of every VM, as `pvisor replay --memory` takes it.
    pub memory: &'static str,
    /// The sampling period of `pvisor replay --sample-ms`.
    pub sample_ms: u64,
    /// The trajectory as given to `pvisor replay`, and what it holds.
    pub trajectory: PathBuf,
    /// The trajectory as the report names it: its file, or the first steps of its file (a
    /// prefix is written to a temporary file).
    pub source: String,
    /// The environment variables that pick this report (`AGENT_BENCH_WAITS=recorded `…).
    pub picks: &'static str,
    pub replayed: Trajectory,
    /// The longest a replay may take before it is stopped and counted as failed.
    pub run_limit: Duration,
    pub pvisor: PathBuf,
}

impl Settings {
    /// The runs of round `round` (from 0), in order: it rotates the order of the strategies
    /// by `round` and reverses the order of the group sizes for odd rounds.
    pub fn order(&self, round: usize) -> Vec<(usize, Strategy)> {
        let mut strategies = self.strategies.clone();
        strategies.rotate_left(round % self.strategies.len());
        let mut sizes = self.vms.clone();
        if round % 2 == 1 {
            sizes.reverse();
        }
        sizes
            .into_iter()
            .flat_map(|vms| strategies.iter().map(move |&s| (vms, s)))
            .collect()
    }

    /// The group size the targets are judged on (16 in the bench).
    pub fn judged_vms(&self) -> usize {
        *self
            .vms
            .iter()
            .max()
            .expect("a bench has at least one group size")
    }
}

/// What the runs give that is not a number, by (VMs, strategy).
pub type Log = scenario::Log<(usize, Strategy)>;

fn main() {
    common::main("agent_waits_report", run);
}

/// The settings, or why the smoke run is skipped; `tmp` holds the smoke's trajectory. With
/// `render`, no `pvisor` is needed.
fn settings(tmp: &Path, render: bool) -> Res<Result<Settings, String>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let pvisor = match common::vmproc::find_binary(&root, &common::host::target_dir()) {
        Err(_) if render => Ok(PathBuf::new()),
        found => found,
    };
    let full = root.join(TRAJECTORY);
    let trajectory = Trajectory::load(&full)?;
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
            stem: "agent-waits",
            vms: vec![1, 2],
            strategies: vec![Strategy::Off, Strategy::Offload],
            memory: "512MiB",
            sample_ms: 100,
            trajectory: path,
            source: format!("the first {SMOKE_STEPS} steps of `{TRAJECTORY}`"),
            picks: "",
            replayed: short,
            run_limit: Duration::from_secs(60),
            pvisor,
        }));
    }
    let runs = common::env_number("AGENT_BENCH_RUNS", 5, 1)? as usize;
    let waits = std::env::var("AGENT_BENCH_WAITS").unwrap_or_else(|_| "scaled".to_owned());
    Ok(Ok(match waits.as_str() {
        "scaled" => Settings {
            runs,
            write_docs: true,
            stem: "agent-waits",
            vms: vec![1, 16],
            strategies: Strategy::ALL.to_vec(),
            memory: "512MiB",
            sample_ms: 100,
            trajectory: full,
            source: format!("`{TRAJECTORY}`"),
            picks: "",
            replayed: trajectory,
            run_limit: Duration::from_secs(600),
            pvisor: pvisor?,
        },
        "recorded" | "io" => {
            let io = waits == "io";
            let (file, stem_all, stem_prefix) = if io {
                (TRAJECTORY_IO, "agent-waits-io", "agent-waits-io-prefix")
            } else {
                (
                    TRAJECTORY_RECORDED,
                    "agent-waits-recorded",
                    "agent-waits-prefix",
                )
            };
            let recorded = root.join(file);
            // `AGENT_BENCH_STEPS=N`: the first N steps only (the density bench's prefix is 24),
            // reported apart (`agent-waits-prefix`) so that the whole run's report stays.
            let steps = match std::env::var("AGENT_BENCH_STEPS") {
                Ok(text) => Some(text.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(
                    || format!("AGENT_BENCH_STEPS=`{text}`: expected a number of steps above 0"),
                )?),
                Err(_) => None,
            };
            let (trajectory, replayed, stem) = match steps {
                Some(steps) => {
                    let (path, short) =
                        common::replay::prefix(&recorded, steps, tmp, "prefix-trajectory.json")?;
                    (path, short, stem_prefix)
                }
                None => (recorded.clone(), Trajectory::load(&recorded)?, stem_all),
            };
            let (source, picks) = match (steps, io) {
                (Some(steps), _) => (
                    format!("the first {steps} steps of `{file}`"),
                    match (steps, io) {
                        (24, false) => "AGENT_BENCH_WAITS=recorded AGENT_BENCH_STEPS=24 ",
                        (42, true) => "AGENT_BENCH_WAITS=io AGENT_BENCH_STEPS=42 ",
                        (_, false) => "AGENT_BENCH_WAITS=recorded AGENT_BENCH_STEPS=N ",
                        (_, true) => "AGENT_BENCH_WAITS=io AGENT_BENCH_STEPS=N ",
                    },
                ),
                (None, false) => (format!("`{file}`"), "AGENT_BENCH_WAITS=recorded "),
                (None, true) => (format!("`{file}`"), "AGENT_BENCH_WAITS=io "),
            };
            let strategies: &[Strategy] = if io {
                &[Strategy::Off, Strategy::OffloadModel, Strategy::Offload]
            } else {
                &[
                    Strategy::Off,
                    Strategy::Offload,
                    Strategy::OffloadLate,
                    Strategy::OffloadCompressed,
                    Strategy::OffloadLazy,
                ]
            };
            let huge = [Strategy::OffHuge, Strategy::OffloadHuge];
            let strategies = chosen_strategies(strategies, if io { &[] } else { &huge })?;
            // Huge pages are reported apart, so that the 4 KiB report stays.
            let (stem, picks) = match (strategies.iter().any(|s| s.huge()), steps) {
                (false, _) => (stem, picks),
                (true, Some(_)) => ("agent-waits-huge-prefix", HUGE_PICKS),
                (true, None) => (
                    "agent-waits-huge",
                    HUGE_PICKS.trim_end_matches("AGENT_BENCH_STEPS=24 "),
                ),
            };
            Settings {
                runs,
                write_docs: true,
                stem,
                vms: vec![16],
                // Pausing frees nothing (the scaled bench shows it): the time goes to the
                // other ways of bringing RAM back instead.
                strategies,
                memory: "512MiB",
                sample_ms: 100,
                replayed,
                trajectory,
                source,
                picks,
                run_limit: Duration::from_secs(900),
                pvisor: pvisor?,
            }
        }
        other => {
            return Err(
                format!("AGENT_BENCH_WAITS=`{other}`: expected scaled, recorded or io").into(),
            )
        }
    }))
}

/// The variables that pick a huge-page report.
const HUGE_PICKS: &str = "AGENT_BENCH_WAITS=recorded \
                          AGENT_BENCH_STRATEGIES=off,offload,off-huge,offload-huge \
                          AGENT_BENCH_STEPS=24 ";

/// `AGENT_BENCH_STRATEGIES=off,offload,…`: the strategies to run, off first (what the others
/// are compared with), of `all` and `more`; else `all`.
fn chosen_strategies(all: &[Strategy], more: &[Strategy]) -> Res<Vec<Strategy>> {
    let Ok(text) = std::env::var("AGENT_BENCH_STRATEGIES") else {
        return Ok(all.to_vec());
    };
    let all = [all, more].concat();
    let mut chosen = Vec::new();
    for key in text.split(',').map(str::trim) {
        let strategy = all.iter().find(|s| s.key() == key).ok_or_else(|| {
            let keys: Vec<_> = all.iter().map(|s| s.key()).collect();
            format!(
                "AGENT_BENCH_STRATEGIES: `{key}` is none of {}",
                keys.join(", ")
            )
        })?;
        if !chosen.contains(strategy) {
            chosen.push(*strategy);
        }
    }
    if chosen.first() != Some(&BASE) || chosen.len() < 2 {
        return Err(format!(
            "AGENT_BENCH_STRATEGIES=`{text}`: start with {} (what the others are compared with) \
             and name at least one more",
            BASE.key()
        )
        .into());
    }
    Ok(chosen)
}

impl ReplayBench for Settings {
    type Run = (usize, Strategy);
    const NAME: &'static str = "agent_waits_report";

    fn stem(&self) -> &str {
        self.stem
    }
    fn write_docs(&self) -> bool {
        self.write_docs
    }
    fn rounds(&self) -> usize {
        self.runs
    }
    fn fit(&mut self, results: &Results) {
        self.runs = results.runs;
        let vms = &self.vms;
        let held = |s: &Strategy| {
            let passed = |&n: &usize| results.has(&replay::key(n, *s, "integrity_passed"));
            vms.iter().any(passed)
        };
        self.strategies.retain(held);
    }
    fn order(&self, round: usize) -> Vec<Self::Run> {
        Settings::order(self, round)
    }
    fn label(&self, (vms, strategy): Self::Run) -> String {
        format!("{vms} VM(s), {}", strategy.key())
    }
    fn prefix(&self, (vms, strategy): Self::Run) -> String {
        replay::key(vms, strategy, "")
            .trim_end_matches('.')
            .to_owned()
    }
    fn replay(&self, (vms, strategy): Self::Run, samples: &Path) -> Res<Outcome> {
        replay::run(self, vms, strategy, samples)
    }
    fn record(
        &self,
        outcome: &Outcome,
        (vms, strategy): Self::Run,
        round: usize,
        results: &mut Results,
    ) {
        replay::record(outcome, vms, strategy, round, results);
    }
    fn derive(&self, results: &mut Results) {
        targets::derive(results, self);
    }
    fn verdicts(&self, results: &Results, log: &Log) -> Vec<Verdict> {
        targets::verdicts(results, self, log)
    }
    fn markdown(&self, results: &Results, run: &BenchRun, log: &Log) -> String {
        report::markdown(results, self, run, log)
    }
    fn chart(&self, results: &Results, log: &Log) -> Res<String> {
        report::chart(results, self, log)
    }
}

fn run() -> Res<()> {
    let Some(begun) = scenario::begin("agent-waits", settings)? else {
        return Ok(());
    };
    let settings = &begun.bench;
    // Huge-page VMs need the kernel to lend them pages; the host's setting is put back after.
    let _huge = settings.strategies.iter().any(|s| s.huge()).then(|| {
        let per_vm = basics::parse_size(settings.memory).unwrap_or(512 << 20) >> 21;
        testkit::hugepages::HugePages::lend(
            per_vm * settings.vms.iter().max().map_or(1, |&n| n as u64) + 64,
        )
    });
    begun.announce(&settings.vms, settings.strategies.len(), &settings.replayed);
    begun.run()
}

/// The model steps and the tool steps of a trajectory.
pub fn step_counts(trajectory: &Trajectory) -> (usize, usize) {
    let models = trajectory
        .steps
        .iter()
        .filter(|s| matches!(s, Step::Model { .. }))
        .count();
    (models, trajectory.steps.len() - models)
}
