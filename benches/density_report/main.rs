//! Scenario bench of density under a host memory budget (issue 13): how many VMs replaying a
//! recorded-wait agent trajectory fit in a memory budget under each wait strategy.
//!
//! *Density* of a strategy at a budget is the largest N of the sweep (1, 2, 4, 6, 8, 12, 16,
//! 24, 32, 48, 64) for which every run of the rounds passes every check of `pvisor replay`, with
//! zero OOM kills and a window (release to the last VM's end) at most 1.10× the window of the
//! unbudgeted run of the same N and strategy in the same round (`judge`). Each run is the real
//! `pvisor replay TRAJECTORY --vms N --strategy S [--memory-budget SIZE] --memory 512MiB
//! --sample-ms 100 [--stagger-ms SPREAD/N] --json --samples FILE` (`common::replay`), the
//! trajectory the first `DENSITY_BENCH_STEPS` steps of `docs/trajectories/qutebrowser-667.json`,
//! waits as recorded. The *window* judged is the longest VM's task time, from its own start to
//! its end: with every VM released at once (the default) that is the completion window; with
//! `DENSITY_BENCH_SPREAD_S=S` the N VMs start S/N seconds apart, arrivals spread evenly over
//! S seconds as on a host where agents come at their own times, and a VM's wait for its start
//! is not counted against it.
//!
//! The sweep goes up N by N. At each N it runs `DENSITY_BENCH_ROUNDS` rounds; a round runs
//! every (strategy, budget or none) still swept once, in an order that differs from round to
//! round (`plan::round_order`). A (strategy, budget) whose run failed runs no more rounds at
//! that N, and no larger N: its sweep stops there. A strategy that `pvisor replay` does not
//! know (`--strategy S: expected …`) is reported as not available. The CPU time of each run
//! (the replay, its VMs and everything they start) is read from a `cpuacct` cgroup
//! (`common::cpu`).
//!
//! Options, from the environment:
//! - `DENSITY_BENCH_ROUNDS` (default 3), `DENSITY_BENCH_BUDGETS` (`512MiB,1GiB`),
//!   `DENSITY_BENCH_STRATEGIES` (`off,offload,offload-compressed,cold-compression,governed`,
//!   and the kernel's answer, `off+zram` and `off+zswap`: `off` with swap to a compressed pool
//!   set up on the host for each budgeted run and put back after, the pool's cap counted in the
//!   budget, `DENSITY_BENCH_POOL_SHARE` percent of it at most, 50 by default: `swap`),
//!   `DENSITY_BENCH_VMS` (the sweep), `DENSITY_BENCH_STEPS` (24), `DENSITY_BENCH_MEMORY`
//!   (guest RAM of each VM, `512MiB`), `DENSITY_BENCH_SPREAD_S` (0: lockstep);
//! - `DENSITY_BENCH_QUICK=1`: 1 round, 512 MiB only, N up to 8, the first 12 steps (each still
//!   overridden by its own variable);
//! - `DENSITY_BENCH_RESUME=DIR`: a sweep in pieces (`resume`): each run is kept in DIR when it
//!   ends, and runs found there are taken instead of run again; `DENSITY_BENCH_STOP_AFTER_MIN=M`
//!   begins no round that would not end within M minutes; the report of a sweep so stopped goes
//!   to `DIR/report/`, not `docs/bench/` (which holds finished sweeps only), and says what is not
//!   finished.
//!
//! `cargo bench --bench density_report` writes `docs/bench/density.md`, `.csv` and `.svg`
//! (`DENSITY_BENCH_REPORT=NAME`: `docs/bench/NAME.*`, for a sweep that is not the issue's, such
//! as a few strategies at one budget).
//! Run without `--bench` (`cargo test --bench density_report`), it runs its unit tests, then a
//! smoke run (4 steps, 1 and 2 VMs, off and off+zram, 512 MiB, one round; no report; then the same sweep
//! again from the runs it kept, which must run nothing and judge alike), skipped when
//! `target/release/pvisor` is missing or stale or with `PVISOR_SKIP_DEVICE_TESTS=1`;
//! `cargo test --bench density_report -- --unit` runs the unit tests only.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmm::replay::Trajectory;

use benchkit as common;
use benchkit::judge;
mod plan;
mod report;
mod resume;
mod swap;

use common::cpu::{CpuGroup, CpuUse};
use common::host::TempRoot;
use common::replay::{Outcome, Replay, Timeline};
use common::Res;
use judge::{Density, Facts, RunVerdict, SizeVerdict};
use plan::Job;
use resume::Resume;

const BENCH: &str = "density_report";
/// The trajectory, from the workspace root.
const TRAJECTORY: &str = "docs/trajectories/qutebrowser-667.json";

/// Sizes and places of one bench run.
#[derive(Debug)]
pub struct Settings {
    pub rounds: usize,
    pub write_docs: bool,
    /// `DENSITY_BENCH_QUICK=1`.
    pub quick: bool,
    pub strategies: Vec<String>,
    /// As given (`512MiB`) and in bytes.
    pub budgets: Vec<(String, u64)>,
    pub sweep: Vec<usize>,
    pub steps: usize,
    pub memory: String,
    pub sample_ms: u64,
    /// Arrivals spread over this many seconds (0: all VMs released at once).
    pub spread_s: u64,
    /// The prefix as given to `pvisor replay`, and what it holds.
    pub trajectory: PathBuf,
    pub replayed: Trajectory,
    pub pvisor: PathBuf,
    /// `DENSITY_BENCH_RESUME`: where finished runs are kept and taken from.
    pub resume: Option<PathBuf>,
    /// `DENSITY_BENCH_STOP_AFTER_MIN`: no round begins that would not end within this long.
    pub stop_after: Option<Duration>,
    /// `DENSITY_BENCH_REPORT`: the report's name under `docs/bench/` (`density`).
    pub report_name: String,
    /// `DENSITY_BENCH_POOL_SHARE`: the most of a budget the kernel's compressed pool may take
    /// (`off+zram`, `off+zswap`), percent.
    pub pool_share: u64,
}

impl Settings {
    /// The longest one replay of `vms` VMs may take: four times its waits, 10 s a VM, and
    /// the spread of its starts.
    pub fn run_limit(&self, vms: usize) -> Duration {
        let waits = self.replayed.total_wait().as_secs_f64();
        Duration::from_secs_f64((4.0 * waits + 10.0 * vms as f64).max(300.0) + self.spread_s as f64)
    }

    /// The time between two VMs' starts with `vms` VMs, milliseconds.
    pub fn stagger_ms(&self, vms: usize) -> u64 {
        self.spread_s * 1000 / vms.max(1) as u64
    }
}

/// One run as measured.
#[derive(Debug)]
pub struct Measured {
    pub job: Job,
    pub vms: usize,
    pub round: usize,
    pub facts: Facts,
    pub cgroup_gib_s: f64,
    pub guest_gib_s: f64,
    pub cpu: Option<CpuUse>,
    /// Offloads and their time, summed over the VMs (NaN without wait management).
    pub offloads: f64,
    pub offload_ms: f64,
    pub wall_s: f64,
    pub timeline: Option<Timeline>,
    /// What the compressed pool held (`off+zram`, `off+zswap`, budgeted runs).
    pub pool: Option<swap::PoolUse>,
}

/// Everything the sweep gave.
#[derive(Debug, Default)]
pub struct Log {
    pub runs: Vec<Measured>,
    /// Why a strategy is not available, by its index: `pvisor replay`'s own words.
    pub unavailable: BTreeMap<usize, String>,
    /// The verdict on each budgeted run, by (budget, strategy, N, round).
    pub verdicts: BTreeMap<(usize, usize, usize, usize), RunVerdict>,
    /// The verdicts on the group sizes of each (budget, strategy), in the sweep's order.
    pub sizes: BTreeMap<(usize, usize), Vec<SizeVerdict>>,
    /// The N the sweep was stopped in (`DENSITY_BENCH_STOP_AFTER_MIN`) before it finished;
    /// its runs are not in `runs` (they stay in the resume directory).
    pub unfinished: Option<usize>,
    /// Runs of `runs` taken from the resume directory: how many, by (commit, first and last
    /// time one finished).
    pub loaded: BTreeMap<String, (usize, String, String)>,
}

impl Log {
    /// The run of `job` with `vms` VMs in `round`.
    pub fn run(&self, job: Job, vms: usize, round: usize) -> Option<&Measured> {
        self.runs
            .iter()
            .find(|m| m.job == job && m.vms == vms && m.round == round)
    }

    /// The density of (budget, strategy); `None` when the strategy is not available.
    pub fn density(&self, budget: usize, strategy: usize) -> Option<Density> {
        if self.unavailable.contains_key(&strategy) {
            return None;
        }
        self.sizes
            .get(&(budget, strategy))
            .map(|sizes| judge::density(sizes))
    }
}

fn main() {
    common::main(BENCH, run);
}

/// The value of the environment variable `name`, or `default`.
fn env_text(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// The settings, or why the smoke run is skipped.
fn settings(tmp: &Path) -> Res<Result<Settings, String>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let pvisor = match common::vmproc::find_binary(&root, &common::host::target_dir()) {
        Ok(pvisor) => pvisor,
        Err(why) if !common::is_bench_run() => return Ok(Err(why)),
        Err(why) => return Err(why.into()),
    };
    let bench = common::is_bench_run();
    let quick = bench && std::env::var_os("DENSITY_BENCH_QUICK").is_some_and(|v| v == "1");
    let (rounds, budgets, vms, steps, strategies) = if !bench {
        (1, "512MiB", "1,2", 4, "off,off+zram")
    } else if quick {
        (1, "512MiB", "1,2,4,6,8", 12, "off,offload")
    } else {
        (
            3,
            "512MiB,1GiB",
            "1,2,4,6,8,12,16,24,32,48,64",
            24,
            "off,offload,offload-compressed,cold-compression,governed,off+zram,off+zswap",
        )
    };
    let (rounds, steps) = if bench {
        (
            common::env_number("DENSITY_BENCH_ROUNDS", rounds, 1)? as usize,
            common::env_number("DENSITY_BENCH_STEPS", steps, 1)? as usize,
        )
    } else {
        (rounds as usize, steps as usize)
    };
    let pick = |name: &str, default: &str| {
        if bench {
            env_text(name, default)
        } else {
            default.to_owned()
        }
    };
    let strategies = plan::parse_strategies(&pick("DENSITY_BENCH_STRATEGIES", strategies))
        .map_err(|e| format!("DENSITY_BENCH_STRATEGIES: {e}"))?;
    let budgets = plan::parse_budgets(&pick("DENSITY_BENCH_BUDGETS", budgets))
        .map_err(|e| format!("DENSITY_BENCH_BUDGETS: {e}"))?;
    let sweep = plan::parse_vms(&pick("DENSITY_BENCH_VMS", vms))
        .map_err(|e| format!("DENSITY_BENCH_VMS: {e}"))?;
    let (trajectory, replayed) =
        common::replay::prefix(&root.join(TRAJECTORY), steps, tmp, "trajectory.json")?;
    // The smoke run proves the pieces on its own runs: it keeps them, then sweeps again from
    // them alone.
    let resume = if bench {
        std::env::var_os("DENSITY_BENCH_RESUME")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
    } else {
        Some(tmp.join("resume"))
    };
    let stop_after = match std::env::var("DENSITY_BENCH_STOP_AFTER_MIN") {
        Ok(_) if !bench => None,
        Ok(_) => {
            if resume.is_none() {
                return Err(
                    "DENSITY_BENCH_STOP_AFTER_MIN needs DENSITY_BENCH_RESUME=DIR: the runs of a \
                            stopped sweep would be lost"
                        .into(),
                );
            }
            let minutes = common::env_number("DENSITY_BENCH_STOP_AFTER_MIN", 0, 1)?;
            Some(Duration::from_secs(minutes * 60))
        }
        Err(_) => None,
    };
    Ok(Ok(Settings {
        rounds,
        write_docs: bench,
        quick,
        strategies,
        budgets,
        sweep,
        steps,
        memory: pick("DENSITY_BENCH_MEMORY", "512MiB"),
        sample_ms: 100,
        spread_s: if bench {
            common::env_number("DENSITY_BENCH_SPREAD_S", 0, 0)?
        } else {
            0
        },
        trajectory,
        replayed,
        pvisor,
        resume,
        stop_after,
        report_name: {
            let name = pick("DENSITY_BENCH_REPORT", "density");
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(format!(
                    "DENSITY_BENCH_REPORT=`{name}`: a file name of letters, digits, `-` and `_`"
                )
                .into());
            }
            name
        },
        pool_share: if bench {
            common::env_number("DENSITY_BENCH_POOL_SHARE", 50, 1)?
        } else {
            50
        },
    }))
}

/// `pvisor replay`'s words when it does not know `strategy`, if that is why it did not run.
fn unavailable(outcome: &Outcome, strategy: &str) -> Option<String> {
    if outcome.summary.is_some() {
        return None;
    }
    let marker = format!("--strategy `{strategy}`: expected");
    outcome
        .stderr
        .lines()
        .find(|line| line.contains(&marker))
        .map(|line| line.trim().to_owned())
}

/// The facts of a run for the verdicts.
fn facts(outcome: &Outcome) -> Facts {
    let summary = outcome.summary.as_ref();
    let oom_killed = summary
        .and_then(|s| s["oom_killed"].as_array())
        .into_iter()
        .flatten()
        .map(|v| {
            format!(
                "VM {} ({}): oom_kill {}",
                v["vm"],
                v["job"].as_str().unwrap_or("?"),
                v["oom_kill"]
            )
        })
        .collect();
    let peak_gib = outcome.timeline.as_ref().map_or(f64::NAN, |t| {
        t.points(true)
            .iter()
            .map(|&(_, v)| v)
            .filter(|v| v.is_finite())
            .fold(f64::NAN, f64::max)
    });
    Facts {
        passed: outcome.passed(),
        failures: if outcome.passed() {
            Vec::new()
        } else {
            outcome.failure_parts()
        },
        oom_kills: summary.and_then(|s| s["oom_kills"].as_u64()).unwrap_or(0),
        oom_killed,
        // Each VM's own task time, start to end: the completion window when all start at once.
        window_s: Some(outcome.number(&["longest_task_s"]))
            .filter(|w| w.is_finite())
            .unwrap_or_else(|| outcome.number(&["completion_window_s"])),
        peak_bytes: peak_gib * (1u64 << 30) as f64,
        cpu_share: outcome.cpu.map_or(f64::NAN, |cpu| {
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            cpu.total_s() / (outcome.wall_s * cores as f64)
        }),
    }
}

/// `1h02m03s`.
pub fn duration_text(seconds: f64) -> String {
    // NaN and negative times read 0.
    let s = Duration::try_from_secs_f64(seconds + 0.5).map_or(0, |d| d.as_secs());
    if s >= 3600 {
        format!("{}h{:02}m{:02}s", s / 3600, s % 3600 / 60, s % 60)
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

fn run() -> Res<()> {
    let started = Instant::now();
    if !common::is_bench_run() && unit_tests()? {
        return Ok(());
    }
    let bench_run = common::host::BenchRun::begin();
    if common::skip_smoke(BENCH, common::is_bench_run()) {
        return Ok(());
    }
    let relative = Path::new("density").join(format!("p{}", std::process::id()));
    let tmp = TempRoot::create(BENCH, &relative)?;
    let settings = match settings(&tmp.path)? {
        Ok(settings) => settings,
        Err(why) => {
            eprintln!("{BENCH}: smoke run skipped: {why}");
            return Ok(());
        }
    };
    common::host::check_vm_devices()?;
    let run_dir = tmp.path.join("run");
    std::fs::create_dir_all(&run_dir)?;
    // Read by `vmm::runtime` here and inherited by every `pvisor` started; set before any
    // thread exists.
    std::env::set_var("PVISOR_RUNTIME_DIR", &run_dir);
    // A budget a pool cannot share (zswap's pool is a whole percent of the host's RAM) is
    // refused now, not hours into the sweep.
    for strategy in &settings.strategies {
        if let (_, Some(pool)) = swap::Pool::of(strategy) {
            for (text, bytes) in &settings.budgets {
                swap::split(pool, *bytes, settings.pool_share, swap::mem_total()?)
                    .map_err(|e| format!("{strategy} at {text}: {e}"))?;
            }
        }
    }
    let cpu = CpuGroup::create(&format!("density-bench-{}", std::process::id()))?;
    let s = &settings;
    eprintln!(
        "{BENCH}: {} round(s); strategies {}; budgets {}; N {:?}; {} ({} steps, {} model waits, {:.1} s of waits), \
         VMs of {}; arrivals {}; {}; temporary files in {} ({})",
        s.rounds,
        s.strategies.join(", "),
        s.budgets.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>().join(", "),
        s.sweep,
        s.replayed.name,
        s.steps,
        s.replayed.requests().len(),
        s.replayed.total_wait().as_secs_f64(),
        s.memory,
        report::arrivals_text(s),
        s.pvisor.display(),
        tmp.path.display(),
        tmp.filesystem
    );
    let mut resume = match &s.resume {
        Some(dir) => {
            let resume = Resume::open(dir, s)?;
            eprintln!(
                "{BENCH}: runs are kept in {}; {} made before are taken from there",
                dir.display(),
                resume.len()
            );
            Some(resume)
        }
        None => None,
    };
    let commit = &bench_run.machine.commit;
    let log = sweep(s, &tmp.path, &cpu, resume.as_mut(), commit)?;
    if !s.write_docs {
        // The pieces: a second sweep from the kept runs alone runs nothing and judges alike.
        let dir = s.resume.as_deref().ok_or("the smoke run keeps its runs")?;
        let again = sweep(s, &tmp.path, &cpu, Some(&mut Resume::open(dir, s)?), commit)?;
        let loaded: usize = again.loaded.values().map(|(n, _, _)| n).sum();
        if loaded != log.runs.len() || again.verdicts != log.verdicts || again.sizes != log.sizes {
            return Err(format!(
                "the sweep from its kept runs differs: {loaded} of {} runs taken back, verdicts {}",
                log.runs.len(),
                if again.verdicts == log.verdicts {
                    "the same"
                } else {
                    "not the same"
                }
            )
            .into());
        }
        eprintln!("{BENCH}: the sweep from its {loaded} kept runs judged alike");
    }
    let cpu_method = cpu.describe();
    drop(cpu);
    drop(tmp);
    let targets = report::targets(&log, s);
    common::verdict::log(BENCH, &targets);
    for (b, (budget, _)) in s.budgets.iter().enumerate() {
        for (i, strategy) in s.strategies.iter().enumerate() {
            eprintln!(
                "{BENCH}: density at {budget}, {strategy}: {}",
                report::density_text(&log, s, b, i)
            );
        }
    }
    let context = report::Context {
        settings: s,
        run: &bench_run,
        log: &log,
        cpu_method,
    };
    let outputs = [
        ("csv", report::csv(&log, s)),
        ("svg", report::chart(&context)?),
        ("md", report::markdown(&targets, &context)),
    ];
    if !s.write_docs && log.runs.iter().any(|m| m.facts.window_s.is_nan()) {
        return Err("a smoke run gave no summary".into());
    }
    if let (true, Some(vms), Some(dir)) = (s.write_docs, log.unfinished, s.resume.as_deref()) {
        // docs/bench holds finished sweeps only: a piece's report stays beside its runs.
        let report = dir.join("report");
        std::fs::create_dir_all(&report)?;
        for (ext, text) in &outputs {
            let path = report.join(format!("{}.{ext}", s.report_name));
            std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        eprintln!(
            "{BENCH}: the sweep stopped in N={vms}, not finished: its report so far is in {} \
             (docs/bench/density.* keep the last finished sweep's); the same command goes on",
            report.display()
        );
        return Ok(());
    }
    common::finish(BENCH, s.write_docs, &s.report_name, &outputs, started)
}

/// Runs the sweep, taking the runs `resume` holds from there and keeping there each run
/// made (as made at `commit`).
fn sweep(
    s: &Settings,
    tmp: &Path,
    cpu: &CpuGroup,
    mut resume: Option<&mut Resume>,
    commit: &str,
) -> Res<Log> {
    let mut log = Log::default();
    // Where each (budget, strategy) stopped: the N that failed.
    let mut stopped: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    let samples = tmp.join("samples.csv");
    let started = Instant::now();
    let mut done = 0usize;
    for (stage, &vms) in s.sweep.iter().enumerate() {
        // (budget, strategy) failed at this N, by the round it failed in.
        let mut failed_here: BTreeMap<(usize, usize), usize> = BTreeMap::new();
        for round in 0..s.rounds {
            let swept = |strategy: usize, budget: usize| {
                !log.unavailable.contains_key(&strategy)
                    && !stopped.contains_key(&(budget, strategy))
                    && !failed_here.contains_key(&(budget, strategy))
            };
            let jobs = plan::jobs(s.strategies.len(), s.budgets.len(), swept);
            if jobs.is_empty() {
                break;
            }
            // A round is made in one piece, so that its budgeted runs and their references run
            // side by side: one that would not end before the stop does not begin.
            let to_make = jobs
                .iter()
                .filter(|job| {
                    !resume
                        .as_deref()
                        .is_some_and(|r| r.holds(**job, vms, round))
                })
                .count();
            if let Some(limit) = s.stop_after.filter(|_| to_make > 0) {
                let estimate = Duration::from_secs_f64(round_estimate_s(&log, vms, to_make));
                if started.elapsed() + estimate > limit {
                    eprintln!(
                        "{BENCH}: DENSITY_BENCH_STOP_AFTER_MIN: round {} of N={vms} ({to_make} runs, about {}) would \
                         not end in time; the sweep stops here, and the same command resumes it",
                        round + 1,
                        duration_text(estimate.as_secs_f64())
                    );
                    log.runs.retain(|m| m.vms != vms);
                    log.verdicts.retain(|&(_, _, n, _), _| n != vms);
                    log.unfinished = Some(vms);
                    return Ok(log);
                }
            }
            for job in plan::round_order(&jobs, round) {
                if log.unavailable.contains_key(&job.strategy) {
                    continue;
                }
                let strategy = &s.strategies[job.strategy];
                let budget = job.budget.map(|b| s.budgets[b].0.as_str());
                if let Some(saved) = resume.as_deref_mut().and_then(|r| r.take(job, vms, round)) {
                    let entry = log
                        .loaded
                        .entry(saved.commit)
                        .or_insert_with(|| (0, saved.finished.clone(), saved.finished.clone()));
                    entry.0 += 1;
                    entry.1 = entry.1.clone().min(saved.finished.clone());
                    entry.2 = entry.2.clone().max(saved.finished);
                    log.runs.push(saved.measured);
                    continue;
                }
                // The kernel's answer: swap to a compressed pool, on for a budgeted run only (an
                // unbudgeted one never swaps), the budget shared between pool and cgroup.
                let (replayed, pool) = swap::Pool::of(strategy);
                let host_swap = match (pool, job.budget) {
                    (Some(pool), Some(b)) => {
                        let split =
                            swap::split(pool, s.budgets[b].1, s.pool_share, swap::mem_total()?)?;
                        let on = swap::HostSwap::enable(pool, &split, tmp)?;
                        let watch = swap::Watch::start(&on, split)?;
                        Some((on, watch, split.cgroup_bytes.to_string()))
                    }
                    _ => None,
                };
                let outcome = Replay {
                    pvisor: &s.pvisor,
                    trajectory: &s.trajectory,
                    vms,
                    strategy: replayed,
                    config: None,
                    budget: host_swap
                        .as_ref()
                        .map(|(_, _, cgroup)| cgroup.as_str())
                        .or(budget),
                    memory: &s.memory,
                    sample_ms: s.sample_ms,
                    stagger_ms: s.stagger_ms(vms),
                    limit: s.run_limit(vms),
                }
                .run(&samples, Some(cpu));
                let pool_use = match host_swap {
                    Some((on, watch, _)) => {
                        let used = watch.finish();
                        drop(on);
                        Some(used?)
                    }
                    None => None,
                };
                let outcome = outcome?;
                done += 1;
                let elapsed = started.elapsed().as_secs_f64();
                let done_here = log.runs.iter().filter(|m| m.vms == vms).count() + 1;
                let left = runs_left(s, &log, &stopped, stage, done_here);
                let eta = elapsed / done as f64 * left as f64;
                let under =
                    budget.map_or_else(|| "no budget".to_owned(), |b| format!("budget {b}"));
                if let Some(why) = unavailable(&outcome, strategy) {
                    eprintln!(
                        "{BENCH}: [{done}] {strategy}: not available ({why}); its sweep is skipped"
                    );
                    log.unavailable.insert(job.strategy, why);
                    continue;
                }
                if outcome.summary.is_none() && log.runs.iter().all(|m| m.facts.window_s.is_nan()) {
                    return Err(format!(
                        "`pvisor replay` did not run: {}",
                        outcome.problem.as_deref().unwrap_or("no summary")
                    )
                    .into());
                }
                let measured = measure(&outcome, job, vms, round, pool_use);
                if let Some(resume) = resume.as_deref() {
                    resume.keep(s, &measured, commit, &common::host::utc_now())?;
                }
                eprintln!(
                    "{BENCH}: [{done}, ~{left} left] N={vms}, round {}/{}, {strategy}, {under}: {}; cpu {}; \
                     elapsed {}, ETA ≤ {}",
                    round + 1,
                    s.rounds,
                    outcome.describe(),
                    measured
                        .cpu
                        .map_or_else(|| "–".to_owned(), |c| format!("{:.1} s", c.total_s())),
                    duration_text(elapsed),
                    duration_text(eta),
                );
                log.runs.push(measured);
            }
            // The verdicts of this round's budgeted runs.
            for (b, (_, bytes)) in s.budgets.iter().enumerate() {
                for i in 0..s.strategies.len() {
                    let job = Job {
                        strategy: i,
                        budget: Some(b),
                    };
                    let Some(budgeted) = log.run(job, vms, round) else {
                        continue;
                    };
                    let reference = log.run(
                        Job {
                            strategy: i,
                            budget: None,
                        },
                        vms,
                        round,
                    );
                    let verdict =
                        judge::judge_run(&budgeted.facts, reference.map(|m| &m.facts), *bytes);
                    if !verdict.passed {
                        eprintln!(
                            "{BENCH}: N={vms}, {}, budget {}: round {} FAILED: {}",
                            s.strategies[i],
                            s.budgets[b].0,
                            round + 1,
                            verdict.reasons.join("; ")
                        );
                        failed_here.entry((b, i)).or_insert(round);
                    }
                    log.verdicts.insert((b, i, vms, round), verdict);
                }
            }
        }
        // The size verdicts of this N; a failed (budget, strategy) stops here.
        for b in 0..s.budgets.len() {
            for i in 0..s.strategies.len() {
                if stopped.contains_key(&(b, i)) || log.unavailable.contains_key(&i) {
                    continue;
                }
                let runs: Vec<(usize, RunVerdict)> = (0..s.rounds)
                    .filter_map(|r| log.verdicts.get(&(b, i, vms, r)).map(|v| (r, v.clone())))
                    .collect();
                let verdict = judge::judge_size(vms, &runs);
                if !verdict.passed {
                    eprintln!(
                        "{BENCH}: {} at {}: the sweep stops at N={vms} (density {})",
                        s.strategies[i],
                        s.budgets[b].0,
                        report::previous_size(s, vms)
                    );
                    stopped.insert((b, i), vms);
                }
                log.sizes.entry((b, i)).or_default().push(verdict);
            }
        }
    }
    Ok(log)
}

/// About how long `runs` runs of `vms` VMs take, seconds: the mean wall time of the runs of
/// the largest N made so far up to `vms`, scaled by 10% for each step up to `vms`; none made
/// yet reads 0 (the first round always begins).
fn round_estimate_s(log: &Log, vms: usize, runs: usize) -> f64 {
    let Some(largest) = log.runs.iter().map(|m| m.vms).filter(|&n| n <= vms).max() else {
        return 0.0;
    };
    let walls: Vec<f64> = log
        .runs
        .iter()
        .filter(|m| m.vms == largest && m.wall_s.is_finite())
        .map(|m| m.wall_s)
        .collect();
    if walls.is_empty() {
        return 0.0;
    }
    let mean = walls.iter().sum::<f64>() / walls.len() as f64;
    let scale = if largest < vms { 1.1 } else { 1.0 };
    mean * scale * runs as f64
}

/// An upper bound of the runs still to go after this one: every (budget, strategy) still
/// swept running every round of this N (stage `stage` of the sweep) and of every larger one;
/// `done_here` runs of this N are done.
fn runs_left(
    s: &Settings,
    log: &Log,
    stopped: &BTreeMap<(usize, usize), usize>,
    stage: usize,
    done_here: usize,
) -> usize {
    let swept =
        |i: usize, b: usize| !log.unavailable.contains_key(&i) && !stopped.contains_key(&(b, i));
    let per_stage = plan::jobs(s.strategies.len(), s.budgets.len(), swept).len() * s.rounds;
    per_stage.saturating_sub(done_here) + per_stage * (s.sweep.len() - stage - 1)
}

/// What a run gave, for the tables. With a compressed pool, the peak memory judged is the
/// cgroup's peak plus the pool's (each at its own moment: a bound from above).
fn measure(
    outcome: &Outcome,
    job: Job,
    vms: usize,
    round: usize,
    pool: Option<swap::PoolUse>,
) -> Measured {
    let number = |path: &[&str]| outcome.number(path);
    let mut facts = facts(outcome);
    if let Some(pool) = &pool {
        facts.peak_bytes += pool.peak_bytes;
    }
    Measured {
        job,
        vms,
        round,
        facts,
        cgroup_gib_s: number(&["cgroup_mem_gib_s_per_task"]),
        guest_gib_s: number(&["guest_pss_gib_s_per_task"]),
        cpu: outcome.cpu,
        offloads: number(&["wait", "offloads"]),
        offload_ms: number(&["wait", "offload_ms"]),
        wall_s: outcome.wall_s,
        timeline: outcome.timeline.clone(),
        pool,
    }
}

/// Runs the unit tests (built by `cargo test`); true when they are all that is to run
/// (`-- --unit`). An error when one failed.
#[cfg(test)]
fn unit_tests() -> Res<bool> {
    let tests = plan::tests::ALL
        .iter()
        .chain(resume::tests::ALL)
        .chain(swap::tests::ALL)
        .chain(tests::ALL);
    let mut failed = Vec::new();
    let mut count = 0;
    for (name, test) in tests {
        count += 1;
        let ok = std::panic::catch_unwind(test).is_ok();
        eprintln!("test {name} ... {}", if ok { "ok" } else { "FAILED" });
        if !ok {
            failed.push(*name);
        }
    }
    if !failed.is_empty() {
        return Err(format!(
            "{} of {count} unit tests failed: {}",
            failed.len(),
            failed.join(", ")
        )
        .into());
    }
    eprintln!("{BENCH}: {count} unit tests passed");
    Ok(std::env::args().any(|a| a == "--unit"))
}

/// Without `cargo test` there are no unit tests to run.
#[cfg(not(test))]
fn unit_tests() -> Res<bool> {
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(stderr: &str) -> Outcome {
        Outcome {
            status: None,
            wall_s: 0.1,
            summary: None,
            problem: Some("no JSON summary".into()),
            timeline: None,
            stderr: stderr.into(),
            cpu: None,
        }
    }

    fn unavailable_unknown_strategy_gives_pvisors_words() {
        let outcome = refused(
            "pvisor: --strategy `governed`: expected off, pause, offload, offload-compressed or \
             cold-compression\n",
        );
        let why = unavailable(&outcome, "governed").unwrap();
        assert!(
            why.starts_with("pvisor: --strategy `governed`: expected off"),
            "{why}"
        );
    }

    fn unavailable_other_failure_is_none() {
        assert_eq!(
            unavailable(&refused("VM 0 did not start\n"), "governed"),
            None
        );
        // Another strategy's refusal says nothing about this one.
        let other = refused("pvisor: --strategy `swap`: expected off\n");
        assert_eq!(unavailable(&other, "governed"), None);
        let mut ran = refused("pvisor: --strategy `governed`: expected off\n");
        ran.summary = Some(serde_json::json!({"integrity_passed": false}));
        assert_eq!(unavailable(&ran, "governed"), None);
    }

    fn duration_text_hours_minutes_seconds() {
        assert_eq!(duration_text(59.4), "0m59s");
        assert_eq!(duration_text(3723.0), "1h02m03s");
        assert_eq!(duration_text(f64::NAN), "0m00s");
        assert_eq!(duration_text(-5.0), "0m00s");
    }

    fn round_estimate_scales_the_largest_n_made() {
        let mut log = Log::default();
        assert_eq!(round_estimate_s(&log, 8, 10), 0.0);
        let run = |vms: usize, wall_s: f64| Measured {
            vms,
            wall_s,
            ..resume::tests::measured()
        };
        log.runs
            .extend([run(6, 90.0), run(8, 100.0), run(8, 110.0), run(8, f64::NAN)]);
        // The runs of N=8, unscaled; the missing wall time is left out.
        assert!((round_estimate_s(&log, 8, 3) - 315.0).abs() < 1e-9);
        // A larger N scales them by 10%; a smaller one reads its own.
        assert!((round_estimate_s(&log, 16, 2) - 231.0).abs() < 1e-9);
        assert!((round_estimate_s(&log, 6, 1) - 90.0).abs() < 1e-9);
        assert_eq!(round_estimate_s(&log, 4, 1), 0.0);
    }

    pub const ALL: &[(&str, fn())] = &[
        (
            "round_estimate_scales_the_largest_n_made",
            round_estimate_scales_the_largest_n_made,
        ),
        (
            "unavailable_unknown_strategy_gives_pvisors_words",
            unavailable_unknown_strategy_gives_pvisors_words,
        ),
        (
            "unavailable_other_failure_is_none",
            unavailable_other_failure_is_none,
        ),
        (
            "duration_text_hours_minutes_seconds",
            duration_text_hours_minutes_seconds,
        ),
    ];
}
