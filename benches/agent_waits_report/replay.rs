//! One run: `pvisor replay TRAJECTORY --vms N --strategy S --memory SIZE --sample-ms MS --json
//! --samples FILE`, as a user would type it, and what it gave: its exit status, the JSON
//! summary on its last stdout line, and its memory samples summed over the VMs.
//!
//! The figures of a run (`KEY` = `nN.STRATEGY.QUANTITY`, see `key`): `guest_pss_gib_s` and
//! `cgroup_gib_s` (memory × time per task), `window_s` (release to the last VM's end),
//! `completion_mean_s` and `completion_min_s` (over the VMs), `throughput_per_min`,
//! `requests_served`, `integrity_passed` (1 or 0), `exit_status`, the sampling's `samples`,
//! `largest_gap_s`, `long_gaps`, `dropped` and `sampling_passed`, wait management's
//! `offloads`, `offload_ms`, `skipped_for_cooldown` and `skipped_for_gain` (summed over the
//! VMs), and `wall_s` (the whole command, VM starts and stops included).

use std::fs::{self, File};
use std::path::Path;
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::results::Results;
use crate::common::Res;
use crate::{Log, Settings, Strategy};

/// The digest of a run that gave none.
pub const NO_DIGEST: &str = "none";

const GIB: f64 = (1u64 << 30) as f64;

/// `nN.STRATEGY.QUANTITY`.
pub fn key(vms: usize, strategy: Strategy, quantity: &str) -> String {
    format!("n{vms}.{}.{quantity}", strategy.key())
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
    /// Reads `pvisor replay --samples` CSV (`t_s,deadline_s,vm,guest_pss_bytes,cgroup_bytes`,
    /// one line per VM and deadline, in the deadlines' order) of a run of `vms` VMs. Each VM
    /// samples on its own thread, so one may have skipped a deadline while it was late: there
    /// its latest reading stands (the chart's sums; the figures come from `pvisor replay`
    /// itself). A failed reading, and a deadline before a VM's first reading, is NaN.
    pub fn parse(csv: &str, vms: usize) -> Res<Self> {
        let mut timeline = Self::default();
        // Each VM's latest (guest, cgroup) reading, GiB.
        let mut latest: Vec<Option<(f64, f64)>> = vec![None; vms];
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
            let [_t, deadline, vm, guest, cgroup] = fields[..] else {
                return Err(format!("samples line {}: `{line}`: expected 5 fields", i + 1).into());
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
            latest[vm] = Some((gib(guest), gib(cgroup)));
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
}

/// The last `limit` characters of `text`, on one line.
fn tail(text: &str, limit: usize) -> String {
    let text = text.trim();
    let start = text.char_indices().rev().nth(limit).map_or(0, |(i, _)| i);
    text[start..].replace('\n', " / ")
}

/// Runs `pvisor replay` for `vms` VMs under `strategy`, its samples written to `samples`.
/// An error only when the command cannot be started or its output read.
pub fn run(settings: &Settings, vms: usize, strategy: Strategy, samples: &Path) -> Res<Outcome> {
    let dir = samples
        .parent()
        .ok_or("the samples file has no directory")?;
    let (out_path, err_path) = (dir.join("replay.out"), dir.join("replay.err"));
    let _ = fs::remove_file(samples);
    let vms_text = vms.to_string();
    let sample_ms = settings.sample_ms.to_string();
    let mut command = Command::new(&settings.pvisor);
    command.arg("replay").arg(&settings.trajectory);
    let (name, config) = strategy.replay_args();
    command.args(["--vms", &vms_text, "--strategy", name]);
    if let Some(config) = config {
        let path = dir.join(format!("{}.toml", strategy.key()));
        fs::write(&path, config)?;
        command.arg("--vm-config").arg(path);
    }
    command.args([
        "--memory",
        settings.memory,
        "--sample-ms",
        &sample_ms,
        "--json",
    ]);
    command.arg("--samples").arg(samples);
    command.stdout(File::create(&out_path)?);
    command.stderr(File::create(&err_path)?);
    let started = Instant::now();
    let mut child = command
        .spawn()
        .map_err(|e| format!("cannot start {} replay: {e}", settings.pvisor.display()))?;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if started.elapsed() > settings.run_limit {
            // Our own child; its detached VMs are stopped after it.
            let _ = child.kill();
            let _ = child.wait();
            kill_leftover_vms();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let wall_s = started.elapsed().as_secs_f64();
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
            settings.run_limit.as_secs()
        )),
        (Some(status), None) => Some(format!(
            "no JSON summary ({status}): {}",
            tail(&stderr, 300)
        )),
        (Some(_), Some(_)) => None,
    };
    let timeline = match fs::read_to_string(samples) {
        Ok(csv) => Some(Timeline::parse(&csv, vms)?),
        Err(_) => None,
    };
    Ok(Outcome {
        status,
        wall_s,
        summary,
        problem,
        timeline,
    })
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
            crate::common::vmproc::wait_gone(pid, Duration::from_secs(5));
        }
    }
}

impl Outcome {
    /// Whether the replay passed every check and exited with status 0.
    pub fn passed(&self) -> bool {
        self.status.is_some_and(|s| s.success())
            && self
                .summary
                .as_ref()
                .is_some_and(|s| s["integrity_passed"] == true)
    }

    /// The replay's own failures (answers, commands, digests across the VMs).
    fn failures(&self) -> Vec<String> {
        let failures = self.summary.as_ref().and_then(|s| s["failures"].as_array());
        failures
            .into_iter()
            .flatten()
            .filter_map(|f| f.as_str().map(str::to_owned))
            .collect()
    }

    /// The sampling's failure, if it failed.
    fn sampling_failure(&self) -> Option<String> {
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

    /// A number of the summary at `path` (`["sampling", "samples"]`); NaN if missing.
    fn number(&self, path: &[&str]) -> f64 {
        let mut value = self.summary.as_ref();
        for part in path {
            value = value.and_then(|v| v.get(part));
        }
        value.and_then(Value::as_f64).unwrap_or(f64::NAN)
    }

    /// The per-VM completion times.
    fn completions(&self) -> Vec<f64> {
        self.summary
            .as_ref()
            .and_then(|s| s["completion_s"].as_array())
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default()
    }

    /// Why the run failed: no summary, its exit status, the replay's own failures, the
    /// sampling.
    fn failure(&self) -> String {
        let mut parts: Vec<String> = self.problem.iter().cloned().collect();
        if let Some(status) = self.status.filter(|s| !s.success()) {
            parts.push(status.to_string());
        }
        parts.extend(self.failures());
        parts.extend(self.sampling_failure());
        parts.join("; ")
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

    /// Records the run as round `round` of `vms` VMs under `strategy`.
    pub fn record(
        self,
        vms: usize,
        strategy: Strategy,
        round: usize,
        results: &mut Results,
        log: &mut Log,
    ) {
        let mut put = |quantity: &str, unit: &'static str, value: f64| {
            results.put(&key(vms, strategy, quantity), unit, round, value);
        };
        let flag = |ok: bool| if ok { 1.0 } else { 0.0 };
        put("integrity_passed", "1 = passed", flag(self.passed()));
        let code = self
            .status
            .and_then(|s| s.code())
            .map_or(f64::NAN, f64::from);
        put("exit_status", "code", code);
        put("wall_s", "s", self.wall_s);
        let numbers: [(&str, &'static str, &[&str]); 14] = [
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
            (
                "throughput_per_min",
                "tasks/min",
                &["throughput_tasks_per_min"],
            ),
            ("requests_served", "requests", &["model_requests_served"]),
            ("samples", "samples", &["sampling", "samples"]),
            ("largest_gap_s", "s", &["sampling", "largest_gap_s"]),
            ("long_gaps", "gaps", &["sampling", "long_gaps"]),
            ("dropped", "readings", &["sampling", "dropped"]),
            ("sampling_passed", "1 = passed", &["sampling", "passed"]),
            // What wait management did, summed over the VMs (NaN without it).
            ("offloads", "offloads", &["wait", "offloads"]),
            ("offload_ms", "ms", &["wait", "offload_ms"]),
            (
                "skipped_for_cooldown",
                "waits",
                &["wait", "skipped_for_cooldown"],
            ),
            ("skipped_for_gain", "waits", &["wait", "skipped_for_gain"]),
        ];
        for (quantity, unit, path) in numbers {
            let value = if quantity == "sampling_passed" {
                let passed = self
                    .summary
                    .as_ref()
                    .map(|s| s["sampling"]["passed"] == true);
                passed.map_or(f64::NAN, flag)
            } else {
                self.number(path)
            };
            put(quantity, unit, value);
        }
        let completions = self.completions();
        if !completions.is_empty() {
            let mean = completions.iter().sum::<f64>() / completions.len() as f64;
            let min = completions.iter().copied().fold(f64::INFINITY, f64::min);
            put("completion_mean_s", "s", mean);
            put("completion_min_s", "s", min);
        }
        if self.sampling_only() {
            log.sampling_only += 1;
        }
        if !self.passed() {
            log.failures.push(format!(
                "round {}, {vms} VM(s), {}: {}",
                round + 1,
                strategy.key(),
                self.failure()
            ));
        }
        let digest = self
            .summary
            .as_ref()
            .and_then(|s| s["results_digest"].as_str())
            .unwrap_or(NO_DIGEST)
            .to_owned();
        *log.digests.entry(digest).or_default() += 1;
        if self.summary.is_some() {
            log.summaries += 1;
        }
        if let Some(timeline) = self.timeline {
            log.timelines.insert((vms, strategy, round), timeline);
        }
    }
}
