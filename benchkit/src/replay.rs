//! One run of the real `pvisor replay` (`Replay`), as a user would type it, and what it gave
//! (`Outcome`): its exit status, the JSON summary on its last stdout line, its stderr, the CPU
//! time it took (`cpu::CpuGroup`) and its memory samples summed over the VMs (`Timeline`);
//! and the recorded-wait prefix of a trajectory that a shorter bench replays (`prefix`).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use serde_json::Value;
use vmm::replay::Trajectory;

use super::cpu::{CpuGroup, CpuUse};
use super::results::Results;
use super::verdict::Verdict;
use super::Res;

const GIB: f64 = (1u64 << 30) as f64;

/// The first `steps` steps of the trajectory at `path`, its waits as they are, written to
/// `dir/NAME`; its path and what it holds (named `NAME (first N steps)`).
pub fn prefix(path: &Path, steps: usize, dir: &Path, name: &str) -> Res<(PathBuf, Trajectory)> {
    let mut short = Trajectory::load(path)?;
    if steps > short.steps.len() {
        return Err(format!(
            "{}: {steps} steps wanted, it has {}",
            path.display(),
            short.steps.len()
        )
        .into());
    }
    short.steps.truncate(steps);
    short.name = format!("{} (first {steps} steps)", short.name);
    let out = dir.join(name);
    fs::write(&out, serde_json::to_string_pretty(&short)?)?;
    Ok((out, short))
}

/// Memory summed over the VMs of a run, deadline by deadline, from the common release on.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    /// Seconds after the release: the sampler's deadlines.
    pub t_s: Vec<f64>,
    /// Guest-RAM PSS of all the VMs, GiB; NaN where a VM's reading is missing.
    pub guest_gib: Vec<f64>,
    /// Memory cgroup usage of all the VMs, GiB; NaN where a VM's reading is missing.
    pub cgroup_gib: Vec<f64>,
}

impl Timeline {
    /// Reads `pvisor replay --samples` CSV
    /// (`t_s,deadline_s,vm,guest_pss_bytes,cgroup_bytes[,hugetlb_bytes]`, one line per VM and
    /// deadline, in the deadlines' order) of a run of `vms` VMs. Where a VM has no line for a
    /// deadline (older runs sampled each VM on a thread of its own, which could skip one) its
    /// latest reading stands (the chart's sums; the figures come from `pvisor replay` itself).
    /// The cgroup column is the memory charged (plus huge pages, where the run had them). The
    /// guest PSS is read at some deadlines only (an empty field; the latest stands) in runs
    /// with a hugetlb column; in older runs an empty field is a failed reading. A failed
    /// reading, and a deadline before a VM's first reading, is NaN.
    pub fn parse(csv: &str, vms: usize) -> Res<Self> {
        let mut timeline = Self::default();
        // Each VM's latest (guest, cgroup) reading, GiB.
        let mut latest: Vec<Option<(f64, f64)>> = vec![None; vms];
        // Each VM's latest hugetlb reading, GiB.
        let mut huge_latest = vec![0.0; vms];
        let mut current: Option<String> = None;
        let finish = |timeline: &mut Self, deadline: &str, latest: &[Option<(f64, f64)>]| {
            let (mut guest, mut cgroup) = (0.0, 0.0);
            for reading in latest {
                let (g, c) = reading.unwrap_or((f64::NAN, f64::NAN));
                guest += g;
                cgroup += c;
            }
            timeline.t_s.push(deadline.parse().unwrap_or(f64::NAN));
            timeline.guest_gib.push(guest);
            timeline.cgroup_gib.push(cgroup);
        };
        for (i, line) in csv.lines().enumerate().skip(1) {
            let fields: Vec<&str> = line.split(',').collect();
            let (deadline, vm, guest, cgroup, hugetlb) = match fields[..] {
                [_t, deadline, vm, guest, cgroup] => (deadline, vm, guest, cgroup, None),
                [_t, deadline, vm, guest, cgroup, hugetlb] => {
                    (deadline, vm, guest, cgroup, Some(hugetlb))
                }
                _ => {
                    return Err(
                        format!("samples line {}: `{line}`: expected 5 or 6 fields", i + 1).into(),
                    )
                }
            };
            let vm: usize = vm
                .parse()
                .ok()
                .filter(|&vm| vm < vms)
                .ok_or_else(|| format!("samples line {}: `{line}`: no VM {vm}", i + 1))?;
            if current.as_deref().is_some_and(|at| at != deadline) {
                let done = current.take().expect("checked just above");
                finish(&mut timeline, &done, &latest);
            }
            current.get_or_insert_with(|| deadline.to_owned());
            // An empty field (a dropped reading) is NaN, and so is every sum it is in.
            let gib = |field: &str| field.parse::<u64>().map_or(f64::NAN, |b| b as f64 / GIB);
            let guest = match (guest, hugetlb, latest[vm]) {
                // Not read at this deadline: the VM's latest PSS stands.
                ("", Some(_), Some((last, _))) => last,
                _ => gib(guest),
            };
            // Huge pages are charged to no cgroup: the charge adds them (the latest read).
            let huge = match hugetlb.filter(|h| !h.is_empty()) {
                Some(h) => gib(h),
                None => huge_latest[vm],
            };
            huge_latest[vm] = huge;
            latest[vm] = Some((guest, gib(cgroup) + huge));
        }
        if let Some(done) = current.take() {
            finish(&mut timeline, &done, &latest);
        }
        Ok(timeline)
    }

    /// The points from the release on: (seconds, GiB) of the guest PSS or of the cgroups.
    pub fn points(&self, cgroup: bool) -> Vec<(f64, f64)> {
        let values = if cgroup {
            &self.cgroup_gib
        } else {
            &self.guest_gib
        };
        self.t_s
            .iter()
            .zip(values)
            .filter(|(&t, _)| t >= 0.0)
            .map(|(&t, &v)| (t, v))
            .collect()
    }
}

/// The numbers of a replay's summary every replay bench keeps: (quantity, unit, path in the
/// summary). Memory charged is the headline; wait management's offloads are NaN without it.
pub const SUMMARY_FIGURES: [(&str, &str, &[&str]); 8] = [
    (
        "charged_gib_s",
        "GiB·s per task",
        &["memory_charged_gib_s_per_task"],
    ),
    (
        "guest_pss_gib_s",
        "GiB·s per task",
        &["guest_pss_gib_s_per_task"],
    ),
    (
        "cgroup_gib_s",
        "GiB·s per task",
        &["cgroup_mem_gib_s_per_task"],
    ),
    ("window_s", "s", &["completion_window_s"]),
    ("requests_served", "requests", &["model_requests_served"]),
    ("samples", "samples", &["sampling", "samples"]),
    ("largest_gap_s", "s", &["sampling", "largest_gap_s"]),
    ("offloads", "offloads", &["wait", "offloads"]),
];

/// What one `pvisor replay` gave.
#[derive(Debug)]
pub struct Outcome {
    /// Its exit status; `None` when it was stopped at the limit.
    pub status: Option<ExitStatus>,
    /// Seconds the command took.
    pub wall_s: f64,
    /// The JSON summary of its last stdout line, if it printed one.
    pub summary: Option<Value>,
    /// Why there is no summary: the limit, or the end of its stderr.
    pub problem: Option<String>,
    pub timeline: Option<Timeline>,
    /// Its whole stderr.
    pub stderr: String,
    /// The CPU time it and everything it started took, when measured.
    pub cpu: Option<CpuUse>,
}

/// The last `limit` characters of `text`, on one line.
fn tail(text: &str, limit: usize) -> String {
    let text = text.trim();
    let start = text.char_indices().rev().nth(limit).map_or(0, |(i, _)| i);
    text[start..].replace('\n', " / ")
}

/// One `pvisor replay` as a user would type it: `pvisor replay TRAJECTORY --vms N --strategy S
/// [--vm-config FILE] [--memory-budget SIZE] --memory SIZE --sample-ms MS --json --samples FILE`.
#[derive(Debug, Clone)]
pub struct Replay<'a> {
    pub pvisor: &'a Path,
    pub trajectory: &'a Path,
    pub vms: usize,
    /// `--strategy`.
    pub strategy: &'a str,
    /// The `[vm]` config the VMs start with (`--vm-config`), if any; `config_name` names its
    /// file.
    pub config: Option<(&'a str, &'a str)>,
    /// `--memory-budget`, if any.
    pub budget: Option<&'a str>,
    /// Guest RAM of every VM (`--memory`).
    pub memory: &'a str,
    /// `--sample-ms`.
    pub sample_ms: u64,
    /// `--stagger-ms` (0: every VM released at once).
    pub stagger_ms: u64,
    /// The longest the replay may take before it is stopped and counted as failed.
    pub limit: Duration,
}

impl Replay<'_> {
    /// Runs it, its samples written to `samples` and its stdout and stderr beside them; the
    /// replay process and everything it starts are put in `cpu`'s group when given. An error
    /// only when the command cannot be started or its output read.
    pub fn run(&self, samples: &Path, cpu: Option<&CpuGroup>) -> Res<Outcome> {
        let dir = samples
            .parent()
            .ok_or("the samples file has no directory")?;
        let (out_path, err_path) = (dir.join("replay.out"), dir.join("replay.err"));
        let _ = fs::remove_file(samples);
        let vms_text = self.vms.to_string();
        let sample_ms = self.sample_ms.to_string();
        let mut command = Command::new(self.pvisor);
        command.arg("replay").arg(self.trajectory);
        command.args(["--vms", &vms_text, "--strategy", self.strategy]);
        if let Some((name, config)) = self.config {
            let path = dir.join(format!("{name}.toml"));
            fs::write(&path, config)?;
            command.arg("--vm-config").arg(path);
        }
        if let Some(budget) = self.budget {
            command.args(["--memory-budget", budget]);
        }
        command.args(["--memory", self.memory, "--sample-ms", &sample_ms, "--json"]);
        if self.stagger_ms > 0 {
            command.args(["--stagger-ms", &self.stagger_ms.to_string()]);
        }
        command.arg("--samples").arg(samples);
        command.stdout(File::create(&out_path)?);
        command.stderr(File::create(&err_path)?);
        if let Some(group) = cpu {
            group.enter_on_spawn(&mut command)?;
        }
        let cpu_before = cpu.map(CpuGroup::usage).transpose()?;
        let started = Instant::now();
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot start {} replay: {e}", self.pvisor.display()))?;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            if started.elapsed() > self.limit {
                // Our own child; its detached VMs are stopped after it.
                let _ = child.kill();
                let _ = child.wait();
                kill_leftover_vms();
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let wall_s = started.elapsed().as_secs_f64();
        let cpu_used = match (cpu, cpu_before) {
            (Some(group), Some(before)) => Some(group.usage()?.since(before)),
            _ => None,
        };
        let stdout = fs::read_to_string(&out_path)?;
        let stderr = fs::read_to_string(&err_path)?;
        let summary = stdout
            .lines()
            .rev()
            .find(|line| line.trim_start().starts_with('{'))
            .and_then(|line| serde_json::from_str::<Value>(line).ok());
        let problem = match (status, &summary) {
            (None, _) => Some(format!(
                "stopped after {} s, the bench's limit for one replay",
                self.limit.as_secs()
            )),
            (Some(status), None) => Some(format!(
                "no JSON summary ({status}): {}",
                tail(&stderr, 300)
            )),
            (Some(_), Some(_)) => None,
        };
        let timeline = match fs::read_to_string(samples) {
            Ok(csv) => Some(Timeline::parse(&csv, self.vms)?),
            Err(_) => None,
        };
        Ok(Outcome {
            status,
            wall_s,
            summary,
            problem,
            timeline,
            stderr,
            cpu: cpu_used,
        })
    }
}

/// Kills the VM processes left in the bench's runtime directory (after a replay was stopped
/// at the limit, its detached VMs run on).
fn kill_leftover_vms() {
    let Ok(entries) = fs::read_dir(vmm::runtime::runtime_dir()) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let job = entry.file_name().to_string_lossy().into_owned();
        if let Ok(identity) = vmm::runtime::read_identity(&job) {
            let pid = identity.pid;
            // SAFETY: kill has no memory-safety preconditions; the pid is a VM process that
            // this bench's replay started, named in the bench's own runtime directory.
            unsafe { libc::kill(pid.cast_signed(), libc::SIGKILL) };
            super::vmproc::wait_gone(pid, Duration::from_secs(5));
        }
    }
}

/// The digest of a run that gave none.
pub const NO_DIGEST: &str = "none";

/// The key prefix under which a bench's results count, round by round, the runs that gave a
/// `results_digest`: `results_digest.DIGEST` (so that the CSV keeps them for render mode).
pub const DIGEST_KEY: &str = "results_digest.";

/// What the runs of a replay bench gave that is not a single number: their integrity. It is
/// kept in the CSV ([`Integrity::record`]) so that render mode rebuilds it
/// ([`Integrity::kept`]), but for the reasons a run failed.
#[derive(Debug, Default)]
pub struct Integrity {
    /// `round N, WHAT: why` for every run whose integrity failed.
    pub failures: Vec<String>,
    /// Failed runs whose results were all right: only the sampling failed.
    pub sampling_only: usize,
    /// Runs by `results_digest` ([`NO_DIGEST`] for a run that gave none); empty when
    /// re-rendered from a CSV that predates `results_digest.DIGEST`.
    pub digests: BTreeMap<String, usize>,
    /// Runs recorded.
    pub runs: usize,
    /// Runs that printed their JSON summary.
    pub summaries: usize,
}

impl Integrity {
    /// Records `outcome`, round `round` of `what`, whose figures are `PREFIX.QUANTITY` in
    /// `results`: `integrity_passed` and `sampling_only` (1 or 0), and one more run of the round
    /// under `results_digest.DIGEST`.
    pub fn record(
        &mut self,
        outcome: &Outcome,
        results: &mut Results,
        prefix: &str,
        round: usize,
        what: &str,
    ) {
        let flag = |yes: bool| if yes { 1.0 } else { 0.0 };
        let passed = outcome.passed();
        results.put(
            &format!("{prefix}.integrity_passed"),
            "1 = passed",
            round,
            flag(passed),
        );
        let sampling_only = outcome.sampling_only();
        results.put(
            &format!("{prefix}.sampling_only"),
            "1 = yes",
            round,
            flag(sampling_only),
        );
        let digest = outcome.results_digest();
        let key = format!("{DIGEST_KEY}{digest}");
        let before = results
            .values(&key)
            .get(round)
            .copied()
            .filter(|v| !v.is_nan());
        results.put(&key, "runs", round, before.unwrap_or(0.0) + 1.0);
        *self.digests.entry(digest).or_default() += 1;
        self.sampling_only += usize::from(sampling_only);
        if !passed {
            self.failures.push(format!(
                "round {}, {what}: {}",
                round + 1,
                outcome.failure()
            ));
        }
        self.runs += 1;
        self.summaries += usize::from(outcome.summary.is_some());
    }

    /// The integrity `results` kept of the runs `(round, PREFIX, WHAT)`, in the order they ran
    /// (see [`Integrity::record`]); a run without `integrity_passed` was not recorded. Why a
    /// failed run failed is not kept: its line says so.
    pub fn kept(
        results: &Results,
        runs: impl IntoIterator<Item = (usize, String, String)>,
    ) -> Self {
        let mut kept = Self {
            digests: results
                .series()
                .filter_map(|(key, series)| {
                    let digest = key.strip_prefix(DIGEST_KEY)?;
                    let runs = series.values.iter().filter(|v| v.is_finite() && **v > 0.0);
                    // Whole counts of runs.
                    #[allow(clippy::cast_sign_loss, clippy::cast_possible_truncation)]
                    let runs = runs.map(|&v| v as usize).sum();
                    Some((digest.to_owned(), runs))
                })
                .collect(),
            ..Self::default()
        };
        for (round, prefix, what) in runs {
            let value = |quantity: &str| {
                let values = results.values(&format!("{prefix}.{quantity}"));
                values.get(round).copied().filter(|v| !v.is_nan())
            };
            let Some(passed) = value("integrity_passed") else {
                continue;
            };
            kept.runs += 1;
            kept.summaries += 1;
            kept.sampling_only += usize::from(value("sampling_only") == Some(1.0));
            if passed != 1.0 {
                kept.failures.push(format!(
                    "round {}, {what}: integrity failed (why is in the run's output, not kept in the CSV)",
                    round + 1
                ));
            }
        }
        kept
    }

    /// Whether every run passed and all gave one `results_digest`; on the failures alone where
    /// the runs' digests are not kept (a re-rendered CSV from before they were).
    pub fn all_passed(&self) -> bool {
        let same = self.digests.is_empty()
            || self.digests.len() == 1 && !self.digests.contains_key(NO_DIGEST);
        self.failures.is_empty() && same
    }

    /// The verdict on the runs' integrity, `target` its words: its result is `words`' first
    /// (no run), second (all passed, [`Integrity::all_passed`]) or third.
    pub fn verdict(&self, target: &str, words: [&'static str; 3]) -> Verdict {
        let failed = self.failures.len();
        Verdict {
            target: target.to_owned(),
            figure: format!(
                "{failed} failed of {} runs ({} by their sampling alone, {} in their results); {}",
                self.runs,
                self.sampling_only,
                failed - self.sampling_only,
                self.digest_text()
            ),
            result: match (self.runs, self.all_passed()) {
                (0, _) => words[0],
                (_, true) => words[1],
                (_, false) => words[2],
            },
        }
    }

    /// What the runs' `results_digest` values were: `every run gave D`, `D ×N, E ×M`, or that
    /// they are not kept.
    pub fn digest_text(&self) -> String {
        let mut digests = self.digests.keys();
        match (digests.next(), digests.next()) {
            (None, _) => {
                "the runs' results_digest values are not kept in this run's CSV (each run's own \
                          check, the same digests in every VM, is in its integrity)"
                    .to_owned()
            }
            (Some(digest), None) if digest != NO_DIGEST => {
                format!("every run gave results_digest {digest}")
            }
            _ => {
                let counts: Vec<String> = self
                    .digests
                    .iter()
                    .map(|(digest, n)| format!("{digest} ×{n}"))
                    .collect();
                format!("results_digest differs: {}", counts.join(", "))
            }
        }
    }
}

/// For results kept from a run that predates the replay's `memory_charged` figure: every
/// `….cgroup_…` series copied to `….charged_…`, and true, unless some `charged_` series is
/// there already (false then, nothing copied). A replay runs each VM in a memory cgroup of its
/// own, so the memory charged for a VM without huge pages is its cgroup's usage
/// (`vmm::charged`); a report that uses this says so.
pub fn charged_from_cgroup(results: &mut Results) -> bool {
    let copies: Vec<(String, String)> = results
        .series()
        .filter(|(key, _)| key.contains(".cgroup_"))
        .map(|(key, _)| (key.to_owned(), key.replacen(".cgroup_", ".charged_", 1)))
        .collect();
    if copies.is_empty() || results.series().any(|(key, _)| key.contains(".charged_")) {
        return false;
    }
    for (cgroup, charged) in copies {
        results.copy(&cgroup, &charged);
    }
    true
}

impl Outcome {
    /// The `results_digest` of its summary, [`NO_DIGEST`] without one.
    pub fn results_digest(&self) -> String {
        self.summary
            .as_ref()
            .and_then(|s| s["results_digest"].as_str())
            .unwrap_or(NO_DIGEST)
            .to_owned()
    }

    /// Whether the replay passed every check and exited with status 0.
    pub fn passed(&self) -> bool {
        self.status.is_some_and(|s| s.success())
            && self
                .summary
                .as_ref()
                .is_some_and(|s| s["integrity_passed"] == true)
    }

    /// The replay's own failures (answers, commands, digests across the VMs).
    pub fn failures(&self) -> Vec<String> {
        let failures = self.summary.as_ref().and_then(|s| s["failures"].as_array());
        failures
            .into_iter()
            .flatten()
            .filter_map(|f| f.as_str().map(str::to_owned))
            .collect()
    }

    /// The sampling's failure, if it failed.
    pub fn sampling_failure(&self) -> Option<String> {
        let sampling = &self.summary.as_ref()?["sampling"];
        (sampling["passed"] == false).then(|| {
            format!(
                "sampling failed: {} gaps over twice the period (largest {:.3} s), {} readings dropped",
                sampling["long_gaps"],
                sampling["largest_gap_s"].as_f64().unwrap_or(f64::NAN),
                sampling["dropped"]
            )
        })
    }

    /// A failed run whose results were all right: only its sampling failed.
    pub fn sampling_only(&self) -> bool {
        !self.passed()
            && self.problem.is_none()
            && self.failures().is_empty()
            && self.sampling_failure().is_some()
    }

    /// Puts, with `put(quantity, unit, value)`, the figures every replay bench keeps: the
    /// exit status, the wall time and [`SUMMARY_FIGURES`]; then the summary's numbers that
    /// `more` names (NaN where missing).
    pub fn figures(
        &self,
        more: &[(&'static str, &'static str, &[&str])],
        mut put: impl FnMut(&str, &'static str, f64),
    ) {
        let code = self
            .status
            .and_then(|s| s.code())
            .map_or(f64::NAN, f64::from);
        put("exit_status", "code", code);
        put("wall_s", "s", self.wall_s);
        for &(quantity, unit, path) in SUMMARY_FIGURES.iter().chain(more) {
            put(quantity, unit, self.number(path));
        }
    }

    /// A number of the summary at `path` (`["sampling", "samples"]`); NaN if missing.
    pub fn number(&self, path: &[&str]) -> f64 {
        let mut value = self.summary.as_ref();
        for part in path {
            value = value.and_then(|v| v.get(part));
        }
        value.and_then(Value::as_f64).unwrap_or(f64::NAN)
    }

    /// The per-VM completion times.
    pub fn completions(&self) -> Vec<f64> {
        self.summary
            .as_ref()
            .and_then(|s| s["completion_s"].as_array())
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default()
    }

    /// Why the run failed, one part each: no summary, its exit status, the replay's own
    /// failures, the sampling.
    pub fn failure_parts(&self) -> Vec<String> {
        let mut parts: Vec<String> = self.problem.iter().cloned().collect();
        if let Some(status) = self.status.filter(|s| !s.success()) {
            parts.push(status.to_string());
        }
        parts.extend(self.failures());
        parts.extend(self.sampling_failure());
        parts
    }

    /// Why the run failed, on one line.
    pub fn failure(&self) -> String {
        self.failure_parts().join("; ")
    }

    /// One line for the progress log.
    pub fn describe(&self) -> String {
        let verdict = if self.passed() {
            "integrity passed".to_owned()
        } else {
            format!("integrity FAILED: {}", self.failure())
        };
        format!(
            "window {:.2} s, guest PSS×time {:.3} GiB·s per task, cgroup {:.3}, {:.2} tasks/min, {} samples \
             (largest gap {:.3} s); {verdict} ({:.1} s)",
            self.number(&["completion_window_s"]),
            self.number(&["guest_pss_gib_s_per_task"]),
            self.number(&["cgroup_mem_gib_s_per_task"]),
            self.number(&["throughput_tasks_per_min"]),
            self.number(&["sampling", "samples"]),
            self.number(&["sampling", "largest_gap_s"]),
            self.wall_s
        )
    }
}
