//! `pvisor replay TRAJECTORY`: N VMs replay one recorded agent run from a common release, each
//! in its own memory cgroup, against a local model server that answers after the recorded
//! waits; every result is checked and memory × time is sampled.

use std::path::PathBuf;
use std::process::{Command as Process, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use vmm::control::{self, Method};
use vmm::replay::{answer, ReplayServer, Trajectory};
use vmm::runtime::{self, Identity};
use vmm::sampler::{Probe, Quantity, Sampler, VmProbe};
use vmm::script::Command;

use crate::CliResult;

/// Options of `pvisor replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// The trajectory (JSON; see docs/waits.md and docs/trajectories/).
    #[arg(value_name = "TRAJECTORY")]
    pub trajectory: PathBuf,
    /// VMs replaying it at once.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub vms: usize,
    /// What is done while the agents wait: off, pause, offload, offload-compressed, or
    /// cold-compression (no wait management; cold RAM compressed while the VM runs).
    #[arg(long, default_value = "offload", value_name = "STRATEGY")]
    pub strategy: String,
    /// Guest RAM of each VM.
    #[arg(long, default_value = "512MiB", value_name = "SIZE")]
    pub memory: String,
    /// Put the VMs' cgroups under this one (relative to pvisor's own memory cgroup).
    #[arg(long, value_name = "P")]
    pub cgroup_parent: Option<PathBuf>,
    /// A `pvisor run` config file (TOML, `[vm]` keys) every VM starts with, e.g. to tune the
    /// wait policy (`wait-cooldown-ms = 1000`); the strategy's flags win over it.
    #[arg(long, value_name = "FILE")]
    pub vm_config: Option<PathBuf>,
    /// Sampling period of memory, milliseconds.
    #[arg(long, default_value_t = 100, value_name = "MS")]
    pub sample_ms: u64,
    /// End with one JSON line of the summary.
    #[arg(long)]
    pub json: bool,
    /// Write every memory reading to FILE as CSV: `t_s,deadline_s,vm,guest_pss_bytes,cgroup_bytes`
    /// (when it was taken and the deadline it was taken for, from the common release; empty
    /// fields where a reading was dropped).
    #[arg(long, value_name = "FILE")]
    pub samples: Option<PathBuf>,
}

fn strategy_args(strategy: &str) -> Result<Vec<&'static str>, String> {
    Ok(match strategy {
        "off" => vec![],
        "pause" => vec!["--vm-wait-management", "--vm-wait-strategy", "pause"],
        "offload" => vec!["--vm-wait-management"],
        "offload-compressed" => vec!["--vm-wait-management", "--vm-ram-compression"],
        "cold-compression" => vec!["--vm-cold-ram-compression"],
        other => {
            return Err(format!(
                "--strategy `{other}`: expected off, pause, offload, offload-compressed or \
                 cold-compression"
            ))
        }
    })
}

/// A VM of the replay, stopped when dropped.
struct ReplayVm {
    identity: Identity,
}

impl ReplayVm {
    fn call(&self, method: Method) -> Result<serde_json::Value, control::ClientError> {
        let id = &self.identity;
        control::call(&id.socket, &id.job, &id.attempt, method)
    }
}

impl Drop for ReplayVm {
    fn drop(&mut self) {
        let _ = self.call(Method::Stop);
    }
}

/// What one VM's replay gave.
struct Outcome {
    elapsed: Duration,
    results: Result<Vec<serde_json::Value>, String>,
}

/// Once the VM processes are gone, removes their cgroups and the replay's own (best effort:
/// a cgroup with a process left in it stays).
fn remove_cgroups(pids: &[u32], cgroups: &[PathBuf]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids
        .iter()
        .any(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    for dir in cgroups {
        let _ = std::fs::remove_dir(dir);
    }
    if let Some(run) = cgroups.first().and_then(|d| d.parent()) {
        let _ = std::fs::remove_dir(run);
    }
}

pub fn replay(args: &ReplayArgs) -> CliResult {
    let trajectory = Trajectory::load(&args.trajectory)?;
    let extra = strategy_args(&args.strategy)?;
    if args.vms == 0 || args.vms > 64 {
        return Err("--vms is 1 to 64".into());
    }
    if args.sample_ms == 0 {
        return Err("--sample-ms must be positive".into());
    }
    if let Some(config) = &args.vm_config {
        // Read here too, so that a missing file is one error, not one per VM.
        std::fs::metadata(config).map_err(|e| format!("--vm-config {}: {e}", config.display()))?;
    }
    let server = ReplayServer::start(&trajectory)?;
    let url = server.url();
    let run = runtime::new_id("replay-");
    let parent = args.cgroup_parent.clone().unwrap_or_default();
    eprintln!(
        "pvisor replay: {} ({} steps, {:.3} s of model waits, time scale {}) in {} VM(s) of {}, \
         strategy {}",
        trajectory.name,
        trajectory.steps.len(),
        trajectory.total_wait().as_secs_f64(),
        trajectory.time_scale,
        args.vms,
        args.memory,
        args.strategy
    );
    let exe = std::env::current_exe()?;
    let mut vms = Vec::new();
    for i in 0..args.vms {
        let job = format!("{run}-{i}");
        let cgroup = parent.join(&run).join(format!("vm-{i}"));
        let cgroup = cgroup.to_string_lossy().into_owned();
        let mut command = Process::new(&exe);
        command.args(["run", "--detach", "--job", &job, "--memory", &args.memory]);
        command.args(["--vm-model-upstream", &url, "--cgroup", &cgroup]);
        command.args(&extra);
        if let Some(config) = &args.vm_config {
            command.arg("--config").arg(config);
        }
        let scale = trajectory.time_scale.to_string();
        if extra.contains(&"--vm-wait-management") {
            command.args(["--vm-wait-scale", &scale]);
        } else {
            // The strategy's flags win over a --vm-config that turns wait management on.
            command.args(["--vm-wait-management", "false"]);
        }
        command.args(["--", "idle"]);
        let out = command.stderr(Stdio::inherit()).output()?;
        if !out.status.success() {
            return Err(format!("VM {i} did not start").into());
        }
        let line = String::from_utf8_lossy(&out.stdout);
        let identity: Identity = serde_json::from_str(line.lines().next().unwrap_or(""))
            .map_err(|e| format!("VM {i}: unreadable identity: {e}"))?;
        vms.push(ReplayVm { identity });
    }
    let mut probes: Vec<Box<dyn Probe>> = Vec::new();
    let mut cgroups = Vec::new();
    for vm in &vms {
        let stats = vm.call(Method::Stats)?;
        if let Some(dir) = stats["cgroup_dir"].as_str() {
            cgroups.push(PathBuf::from(dir));
        }
        probes.push(Box::new(VmProbe {
            pid: vm.identity.pid,
            ram: (
                stats["guest_ram_host_base"].as_u64().unwrap_or(0),
                stats["memory_bytes"].as_u64().unwrap_or(0),
            ),
            cgroup: stats["cgroup_dir"].as_str().map(PathBuf::from),
        }));
    }
    let script = trajectory
        .script()
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    let sampler = Sampler::start(Duration::from_millis(args.sample_ms), probes);
    let sampling_started = Instant::now();
    // A common release: every VM starts its replay at once.
    let release = Instant::now();
    let outcomes: Vec<Outcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = vms
            .iter()
            .map(|vm| {
                let script = script.clone();
                scope.spawn(move || {
                    let results = vm
                        .call(Method::Exec { script })
                        .map_err(|e| compressed_backing::store::error_chain(&e))
                        .and_then(|v| {
                            v["results"]
                                .as_array()
                                .cloned()
                                .ok_or_else(|| format!("no results: {v}"))
                        });
                    Outcome {
                        elapsed: release.elapsed(),
                        results,
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or(Outcome {
                    elapsed: release.elapsed(),
                    results: Err("the replay thread failed".into()),
                })
            })
            .collect()
    });
    let recording = sampler.finish();
    if let Some(path) = &args.samples {
        let offset = release.duration_since(sampling_started).as_secs_f64();
        // A line per VM and deadline, the deadlines in order: `deadline_s` is the deadline a
        // reading was taken for, `t_s` when it was taken (both from the release).
        let mut lines: Vec<(u32, usize, String)> = Vec::new();
        for (vm, points) in recording.series.iter().enumerate() {
            for point in points {
                let field = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_default();
                let deadline = (recording.period * point.tick).as_secs_f64() - offset;
                lines.push((
                    point.tick,
                    vm,
                    format!(
                        "{:.3},{deadline:.3},{vm},{},{}\n",
                        point.at.as_secs_f64() - offset,
                        field(point.reading.and_then(|r| r.guest_pss_bytes)),
                        field(point.reading.and_then(|r| r.cgroup_bytes)),
                    ),
                ));
            }
        }
        lines.sort_by_key(|&(tick, vm, _)| (tick, vm));
        let mut csv = String::from("t_s,deadline_s,vm,guest_pss_bytes,cgroup_bytes\n");
        for (_, _, line) in lines {
            csv.push_str(&line);
        }
        std::fs::write(path, csv).map_err(|e| format!("--samples {}: {e}", path.display()))?;
    }
    // What wait management did, summed over the VMs (a VM without it has none).
    let mut wait = serde_json::Map::new();
    for vm in &vms {
        if let Ok(stats) = vm.call(Method::Stats) {
            for (name, value) in stats["wait"].as_object().into_iter().flatten() {
                // A VM's own estimate, not a count: a sum over VMs means nothing.
                if name == "offload_cost_ms" {
                    continue;
                }
                let sum = wait
                    .get(name)
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0)
                    + value.as_u64().unwrap_or(0);
                wait.insert(name.clone(), sum.into());
            }
        }
    }
    let pids: Vec<u32> = vms.iter().map(|vm| vm.identity.pid).collect();
    drop(vms);
    remove_cgroups(&pids, &cgroups);

    // Every result against the trajectory: each answer's digest, each command's success, and
    // the same digests in every VM.
    let commands = trajectory.script();
    let requests = trajectory.requests();
    let mut failures = Vec::new();
    let mut reference: Option<Vec<Option<String>>> = None;
    for (i, outcome) in outcomes.iter().enumerate() {
        let results = match &outcome.results {
            Ok(results) => results,
            Err(e) => {
                failures.push(format!("VM {i}: {e}"));
                continue;
            }
        };
        if results.len() != commands.len() {
            failures.push(format!(
                "VM {i}: {} results for {} commands",
                results.len(),
                commands.len()
            ));
            continue;
        }
        let digests: Vec<Option<String>> = results
            .iter()
            .map(|r| r["digest"].as_str().map(str::to_owned))
            .collect();
        for (command, result) in commands.iter().zip(results) {
            if let Command::Model { request, .. } = command {
                let (_, _, len) = requests[usize::try_from(*request - 1)?];
                let expected = vmm::guest::digest_hex(&answer(*request, len));
                if result["digest"].as_str() != Some(expected.as_str()) {
                    failures.push(format!("VM {i}: request {request} got other bytes"));
                }
            }
        }
        match &reference {
            None => reference = Some(digests),
            Some(first) if *first != digests => {
                failures.push(format!("VM {i}: digests differ from VM 0's"));
            }
            Some(_) => {}
        }
    }
    let integrity = recording.integrity();
    let n = outcomes.len();
    // One value for every digest the replay produced: equal across strategies and runs.
    let results_digest = reference.as_ref().map(|digests| {
        let text: Vec<&str> = digests
            .iter()
            .map(|d| d.as_deref().unwrap_or("-"))
            .collect();
        format!(
            "{:016x}",
            xxhash_rust::xxh3::xxh3_64(text.join(",").as_bytes())
        )
    });
    #[allow(clippy::cast_precision_loss, reason = "a handful of VMs")]
    let per_task = |q: Quantity| {
        (0..n)
            .map(|vm| recording.integral_gib_s(vm, q))
            .sum::<f64>()
            / n as f64
    };
    let window = outcomes
        .iter()
        .map(|o| o.elapsed)
        .max()
        .unwrap_or_default()
        .as_secs_f64();
    let passed = failures.is_empty() && integrity.passed;
    #[allow(clippy::cast_precision_loss, reason = "a handful of VMs")]
    let summary = serde_json::json!({
        "trajectory": trajectory.name,
        "strategy": args.strategy,
        "vms": n,
        "integrity_passed": passed,
        "results_passed": failures.is_empty(),
        "sampling_passed": integrity.passed,
        "failures": failures,
        "results_digest": results_digest,
        "guest_pss_gib_s_per_task": per_task(Quantity::GuestPss),
        "cgroup_mem_gib_s_per_task": per_task(Quantity::Cgroup),
        "completion_window_s": window,
        "completion_s": outcomes.iter().map(|o| o.elapsed.as_secs_f64()).collect::<Vec<_>>(),
        "throughput_tasks_per_min": if window > 0.0 { n as f64 / window * 60.0 } else { 0.0 },
        "model_requests_served": server.served(),
        "sampling": integrity,
        "wait": wait,
    });
    println!(
        "replay {}: {} VM(s), {}: window {:.2} s, guest PSS×time {:.4} GiB·s per task, cgroup \
         memory×time {:.4} GiB·s per task, {} samples (largest gap {:.3} s, {} dropped); \
         integrity {}",
        trajectory.name,
        n,
        args.strategy,
        window,
        per_task(Quantity::GuestPss),
        per_task(Quantity::Cgroup),
        integrity.samples,
        integrity.largest_gap_s,
        integrity.dropped,
        if passed { "passed" } else { "FAILED" }
    );
    if !wait.is_empty() {
        let n = |k: &str| wait.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
        println!(
            "  wait management, all VMs: {} pauses, {} offloads ({} ms in all), skipped {} for the \
             cooldown, {} for the guest's timer, {} as not paying; {} failed offloads, {} failed loads",
            n("pauses"),
            n("offloads"),
            n("offload_ms"),
            n("skipped_for_cooldown"),
            n("skipped_for_timer"),
            n("skipped_for_gain"),
            n("failed_offloads"),
            n("failed_loads"),
        );
    }
    for failure in summary["failures"].as_array().into_iter().flatten() {
        println!("  {}", failure.as_str().unwrap_or_default());
    }
    if args.json {
        println!("{summary}");
    }
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
