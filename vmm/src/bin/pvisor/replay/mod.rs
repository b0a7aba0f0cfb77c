//! `pvisor replay TRAJECTORY`: N VMs replay one recorded agent run from a common release, each
//! in its own memory cgroup, against a local model server that answers after the recorded
//! waits; every result is checked and memory × time is sampled.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command as Process, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::SigSet;

use clap::Args;
use vmm::control::Method;
use vmm::replay::{answer, ReplayServer, Trajectory};
use vmm::runtime::{self, Identity};
use vmm::sampler::{Plan, Probe, Quantity, Sampler, VmProbe};
use vmm::script::Command;
use vmm::stats::MemoryCgroup;

use crate::CliResult;

mod teardown;
mod text;

use teardown::{call, oom_kills_of, watch_signals, Teardown};

/// Options of `pvisor replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// The trajectory (JSON; see docs/waits.md and docs/trajectories/).
    #[arg(value_name = "TRAJECTORY")]
    pub trajectory: PathBuf,
    /// VMs replaying it at once.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub vms: usize,
    /// What is done while the agents wait: off, pause, offload, offload-compressed,
    /// cold-compression (no wait management; cold RAM compressed while the VM runs), governed
    /// (offload, and a memory governor started for the replay keeps all the VMs inside
    /// --memory-budget; without a budget, the same as offload), arenas (the guest's phase
    /// arenas only: discard arenas dropped at close, survive arenas compressed into cold
    /// compression's pool at close, with the pool's scanner off: `--vm-cold-scan false`) or
    /// arenas-offload (offload, and survive arenas written to the offload store at close).
    /// All but the two arena strategies run with --vm-arenas false, as a host without arenas
    /// (docs/arenas.md).
    #[arg(long, default_value = "offload", value_name = "STRATEGY")]
    pub strategy: String,
    /// Guest RAM of each VM.
    #[arg(long, default_value = "512MiB", value_name = "SIZE")]
    pub memory: String,
    /// Put the VMs' cgroups under this one (relative to pvisor's own memory cgroup).
    #[arg(long, value_name = "P")]
    pub cgroup_parent: Option<PathBuf>,
    /// Run all the VMs under one memory cgroup with this hard limit (v2 `memory.max`, v1
    /// `memory.limit_in_bytes`; under --cgroup-parent when given), removed afterwards. A VM
    /// the kernel's OOM killer kills is reported by name.
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<String>,
    /// A `pvisor run` config file (TOML, `[vm]` keys) every VM starts with, e.g. to tune the
    /// wait policy (`wait-cooldown-ms = 1000`); the strategy's flags win over it.
    #[arg(long, value_name = "FILE")]
    pub vm_config: Option<PathBuf>,
    /// With --strategy governed: write the governor's log (every decision and its reason)
    /// to FILE.
    #[arg(long, value_name = "FILE")]
    pub governor_log: Option<PathBuf>,
    /// With --strategy governed: one more option of the governor's (`pvisor serve
    /// --memory-governor`), e.g. `--governor-option=--grant=32MiB` (repeatable; the budget,
    /// socket and budget cgroup are the replay's own).
    #[arg(long, value_name = "OPTION", allow_hyphen_values = true)]
    pub governor_option: Vec<String>,
    /// VM i starts its replay i × MS after the release. 0: all at once, the worst case under
    /// a budget (their tool phases come together); agents on a real host arrive at their own
    /// times. Each VM's task time (from its own start) is reported beside the window.
    #[arg(long, default_value_t = 0, value_name = "MS")]
    pub stagger_ms: u64,
    /// Each agent takes its model answers in batches as they stream in (`model ID stream`;
    /// the server streams every answer over the last quarter of its recorded wait), as an
    /// agent reading tokens as they come; else whole, once they have all arrived.
    #[arg(long)]
    pub stream_answers: bool,
    /// Sampling period of memory, milliseconds: every VM's memory cgroup is read at each
    /// tick, by one thread for all the VMs.
    #[arg(long, default_value_t = 100, value_name = "MS")]
    pub sample_ms: u64,
    /// Read each VM's guest-RAM PSS (a walk of its page tables, ~10 ms for 512 MiB) about once
    /// in this many ticks, the VMs in turn on a thread of their own (a slow walk never delays
    /// the ticks).
    #[arg(long, default_value_t = 10, value_name = "TICKS")]
    pub pss_every: u32,
    /// End with one JSON line of the summary.
    #[arg(long)]
    pub json: bool,
    /// Write every memory reading to FILE as CSV:
    /// `t_s,deadline_s,vm,guest_pss_bytes,cgroup_bytes,hugetlb_bytes` (when it was taken and the
    /// deadline it was taken for, from the common release; the PSS and huge pages only at the
    /// ticks they were read, the cgroup empty where a reading was dropped).
    #[arg(long, value_name = "FILE")]
    pub samples: Option<PathBuf>,
}

/// `pvisor run`'s flags of a replay strategy (see `ReplayArgs::strategy`).
fn strategy_args(strategy: &str) -> Result<Vec<&'static str>, String> {
    // A host without arenas: the reports are checked and counted, nothing moves.
    const NO_ARENAS: [&str; 2] = ["--vm-arenas", "false"];
    let without_arenas = |flags: &[&'static str]| [flags, &NO_ARENAS[..]].concat();
    Ok(match strategy {
        "off" => without_arenas(&[]),
        "pause" => without_arenas(&["--vm-wait-management", "--vm-wait-strategy", "pause"]),
        "offload" | "governed" => without_arenas(&["--vm-wait-management"]),
        "offload-compressed" => without_arenas(&["--vm-wait-management", "--vm-ram-compression"]),
        "cold-compression" => without_arenas(&["--vm-cold-ram-compression"]),
        // The pool without its scanner: only the arenas' closes act.
        "arenas" => vec!["--vm-cold-ram-compression", "--vm-cold-scan", "false"],
        "arenas-offload" => vec!["--vm-wait-management", "--vm-arena-offload"],
        other => {
            return Err(format!(
                "--strategy `{other}`: expected off, pause, offload, offload-compressed, \
                 cold-compression, governed, arenas or arenas-offload"
            ))
        }
    })
}

/// What one VM's replay gave.
struct Outcome {
    /// When it started, from the release (its stagger).
    started: Duration,
    elapsed: Duration,
    results: Result<Vec<serde_json::Value>, String>,
}

/// Most VMs of one replay.
const MAX_VMS: usize = 64;
/// Longest sampling period, milliseconds: a minute (a replay's waits are seconds to minutes;
/// a longer period would sample nothing).
const MAX_SAMPLE_MS: u64 = 60_000;
/// Most ticks between two PSS readings of a VM.
const MAX_PSS_EVERY: u32 = 1000;
/// Longest stagger between two VMs' starts, milliseconds: ten minutes.
const MAX_STAGGER_MS: u64 = 600_000;

/// Checks the numeric options before anything starts; returns the memory of each VM and the
/// budget of all of them.
fn check_args(args: &ReplayArgs) -> Result<(u64, Option<u64>), String> {
    if args.vms == 0 || args.vms > MAX_VMS {
        return Err(format!("--vms {}: 1 to {MAX_VMS}", args.vms));
    }
    if args.stagger_ms > MAX_STAGGER_MS {
        return Err(format!(
            "--stagger-ms {}: at most {MAX_STAGGER_MS} milliseconds",
            args.stagger_ms
        ));
    }
    if args.pss_every == 0 || args.pss_every > MAX_PSS_EVERY {
        return Err(format!(
            "--pss-every {}: 1 to {MAX_PSS_EVERY} ticks",
            args.pss_every
        ));
    }
    if args.sample_ms == 0 || args.sample_ms > MAX_SAMPLE_MS {
        return Err(format!(
            "--sample-ms {}: 1 to {MAX_SAMPLE_MS} milliseconds",
            args.sample_ms
        ));
    }
    let memory =
        basics::parse_size(&args.memory).map_err(|e| format!("--memory {}: {e}", args.memory))?;
    vmm::guest::check_memory(memory).map_err(|e| format!("--memory {}: {e}", args.memory))?;
    let budget = args
        .memory_budget
        .as_deref()
        .map(|text| match basics::parse_size(text) {
            Ok(0) => Err(format!("--memory-budget {text}: must be more than 0")),
            Ok(bytes) => Ok(bytes),
            Err(e) => Err(format!("--memory-budget {text}: {e}")),
        })
        .transpose()?;
    Ok((memory, budget))
}

pub fn replay(args: &ReplayArgs) -> CliResult {
    let trajectory = Trajectory::load(&args.trajectory)?;
    let extra = strategy_args(&args.strategy)?;
    let (_, budget) = check_args(args)?;
    if args.strategy == "governed" && budget.is_none() {
        // What a density sweep compares a governed run with: the same VMs, nothing binding.
        eprintln!(
            "pvisor replay: --strategy governed without --memory-budget: nothing to govern, the \
             VMs run as under offload"
        );
    }
    let governed = args.strategy == "governed" && budget.is_some();
    if !governed && (args.governor_log.is_some() || !args.governor_option.is_empty()) {
        return Err(
            "--governor-log and --governor-option need --strategy governed and \
                    --memory-budget (no governor runs otherwise)"
                .into(),
        );
    }
    if let Some(config) = &args.vm_config {
        // Read here too, so that a missing file is one error, not one per VM.
        std::fs::metadata(config).map_err(|e| format!("--vm-config {}: {e}", config.display()))?;
    }
    // Before any thread starts, so that the signals reach the signal thread only.
    let teardown = Arc::new(Teardown::default());
    let signals = watch_signals(&teardown)?;
    let result = run_replay(args, &trajectory, &extra, budget, &teardown, signals);
    teardown.run();
    result
}

fn run_replay(
    args: &ReplayArgs,
    trajectory: &Trajectory,
    extra: &[&str],
    budget: Option<u64>,
    teardown: &Teardown,
    signals: SigSet,
) -> CliResult {
    let server = ReplayServer::start(trajectory)?;
    let url = server.url();
    let run = runtime::new_id("replay-");
    let parent = args.cgroup_parent.clone().unwrap_or_default();
    // Where the VMs' cgroups will be (each VM creates its own under pvisor's own cgroup),
    // known before any VM starts: a VM that fails after creating its cgroup leaves it to us.
    if let Ok((base, _)) = MemoryCgroup::own_base() {
        let mut state = teardown.lock();
        let dir = base.join(&parent).join(&run);
        state
            .cgroups
            .extend((0..args.vms).map(|i| dir.join(format!("vm-{i}"))));
        state.cgroups.push(dir);
        // What of --cgroup-parent does not exist yet is made for this replay and goes with
        // it, the deepest first (one that another replay still uses is not empty and stays).
        let made: Vec<PathBuf> = parent
            .ancestors()
            .filter(|p| !p.as_os_str().is_empty())
            .map(|p| base.join(p))
            .take_while(|p| !p.exists())
            .collect();
        state.cgroups.extend(made);
    }
    if let Some(budget) = budget {
        // The VMs' parent, limited before any VM joins it; the teardown removes it.
        MemoryCgroup::create_limited(&parent.join(&run), budget)
            .map_err(|e| format!("--memory-budget: {}", basics::error_chain(&e)))?;
    }
    let governor = match budget.filter(|_| args.strategy == "governed") {
        Some(budget) => Some(teardown.start_governor(
            &run,
            budget,
            &parent,
            signals,
            args.governor_log.as_deref(),
            &args.governor_option,
        )?),
        None => None,
    };
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
    // The trajectory's I/O: downloads from the replay server, reads of an image the replay
    // writes (removed with it); each VM stages the files it reads in its own directory.
    let (downloads, reads) = trajectory.has_io();
    let image = if reads {
        let dir = tempfile::Builder::new()
            .prefix("pvisor-replay-image-")
            .tempdir()?;
        trajectory.write_image(dir.path())?;
        Some(dir)
    } else {
        None
    };
    let image_rate = trajectory.image_rate_replayed().to_string();
    let exe = std::env::current_exe()?;
    let mut vms = Vec::new();
    for i in 0..args.vms {
        let job = format!("{run}-{i}");
        let cgroup = parent.join(&run).join(format!("vm-{i}"));
        let cgroup = cgroup.to_string_lossy().into_owned();
        let mut command = Process::new(&exe);
        command.args(["run", "--detach", "--job", &job, "--memory", &args.memory]);
        command.args(["--vm-model-upstream", &url, "--cgroup", &cgroup]);
        if downloads {
            command.args(["--vm-net-allow", &url]);
        }
        if let Some(dir) = &image {
            command.arg("--vm-image").arg(dir.path());
            command.args(["--vm-image-rate", &image_rate]);
        }
        command.args(extra);
        if let Some(socket) = &governor {
            command.arg("--vm-governor").arg(socket);
        }
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
        // SAFETY: between fork and exec the child only changes its own signal mask
        // (pthread_sigmask is async-signal-safe): the VM takes its stop signals as usual.
        unsafe {
            command.pre_exec(move || signals.thread_unblock().map_err(std::io::Error::from));
        }
        let identity = teardown.start_vm(|| {
            let out = command.stderr(Stdio::inherit()).output()?;
            if !out.status.success() {
                return Err(format!("VM {i} did not start").into());
            }
            let line = String::from_utf8_lossy(&out.stdout);
            serde_json::from_str::<Identity>(line.lines().next().unwrap_or(""))
                .map_err(|e| format!("VM {i}: unreadable identity: {e}").into())
        })?;
        vms.push(identity);
    }
    let mut probes: Vec<Box<dyn Probe>> = Vec::new();
    let mut vm_cgroups = Vec::new();
    for vm in &vms {
        let stats = call(vm, Method::Stats)?;
        vm_cgroups.push(stats["cgroup_dir"].as_str().map(PathBuf::from));
        probes.push(Box::new(VmProbe {
            pid: vm.pid,
            ram: (
                stats["guest_ram_host_base"].as_u64().unwrap_or(0),
                stats["memory_bytes"].as_u64().unwrap_or(0),
            ),
            cgroup: stats["cgroup_dir"].as_str().map(PathBuf::from),
        }));
    }
    // Built once (each download's and file's digest computed): the VMs' script, and what
    // their results are checked against.
    let commands = trajectory.script_taking(args.stream_answers, &url);
    let script = commands
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    let plan = Plan {
        period: Duration::from_millis(args.sample_ms),
        pss_every: args.pss_every,
    };
    let sampler = Sampler::start(plan, probes)?;
    let sampling_started = Instant::now();
    // CPU from here on: the VMs' and this process's (its sampler, model server and callers).
    let cpu_before = (own_cpu_s(), vms_cpu_s(&vms));
    // A common release: VM i starts its replay i × the stagger after it (all at once by
    // default).
    let release = Instant::now();
    let stagger = Duration::from_millis(args.stagger_ms);
    let outcomes: Vec<Outcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = vms
            .iter()
            .enumerate()
            .map(|(i, vm)| {
                let script = script.clone();
                let start = stagger * u32::try_from(i).unwrap_or(u32::MAX);
                scope.spawn(move || {
                    std::thread::sleep(start.saturating_sub(release.elapsed()));
                    let started = release.elapsed();
                    let results = call(vm, Method::Exec { script })
                        .map_err(|e| basics::error_chain(&e))
                        .and_then(|v| {
                            v["results"]
                                .as_array()
                                .cloned()
                                .ok_or_else(|| format!("no results: {v}"))
                        });
                    Outcome {
                        started,
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
                    started: Duration::ZERO,
                    elapsed: release.elapsed(),
                    results: Err("the replay thread failed".into()),
                })
            })
            .collect()
    });
    let recording = sampler.finish();
    let harness = recording.harness();
    let (vms_cpu, vms_gone) = vms_cpu_between(&cpu_before.1, &vms_cpu_s(&vms));
    let cpu = serde_json::json!({
        "replay_s": own_cpu_s() - cpu_before.0,
        "vms_s": vms_cpu,
        "vms_gone": vms_gone,
        "sampler_s": harness.cpu_s,
    });
    if let Some(path) = &args.samples {
        let offset = release.duration_since(sampling_started).as_secs_f64();
        // A line per VM and deadline, the deadlines in order: `deadline_s` is the deadline a
        // reading was taken for, `t_s` when it was taken (both from the release).
        let mut lines: Vec<(u32, usize, String)> = Vec::new();
        for (vm, points) in recording.series.iter().enumerate() {
            // A PSS reading goes on the line of the first tick at or after it.
            let mut guest = recording.guest.get(vm).map_or(&[][..], Vec::as_slice);
            for point in points {
                let field = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_default();
                let taken = guest.partition_point(|g| g.at <= point.at);
                let pss = guest[..taken].iter().rev().find_map(|g| g.reading);
                guest = &guest[taken..];
                let deadline = (recording.period * point.tick).as_secs_f64() - offset;
                lines.push((
                    point.tick,
                    vm,
                    format!(
                        "{:.3},{deadline:.3},{vm},{},{},{}\n",
                        point.at.as_secs_f64() - offset,
                        field(pss.map(|g| g.guest_pss_bytes)),
                        field(point.reading.and_then(|r| r.cgroup_bytes)),
                        field(pss.map(|g| g.hugetlb_bytes)),
                    ),
                ));
            }
        }
        lines.sort_by_key(|&(tick, vm, _)| (tick, vm));
        let mut csv =
            String::from("t_s,deadline_s,vm,guest_pss_bytes,cgroup_bytes,hugetlb_bytes\n");
        for (_, _, line) in lines {
            csv.push_str(&line);
        }
        std::fs::write(path, csv).map_err(|e| format!("--samples {}: {e}", path.display()))?;
    }
    // What wait management did, summed over the VMs (a VM without it has none); how long
    // their faults were held at the resident limit, each VM's (its pager's `held_us`).
    let mut wait = serde_json::Map::new();
    // And what the waits of each source (model, download, read) and the I/O came to.
    let mut sources = serde_json::Map::new();
    let mut io = serde_json::Map::new();
    // And what the offloads wrote and what they only dropped (their pagers' counters).
    let mut offloaded = serde_json::Map::new();
    let mut held_s = Vec::new();
    for vm in &vms {
        let stats = call(vm, Method::Stats).ok();
        #[allow(clippy::cast_precision_loss, reason = "microseconds of one run")]
        held_s.push(
            stats
                .as_ref()
                .and_then(|s| s["pager"]["held_us"].as_u64())
                .map_or(0.0, |us| us as f64 / 1e6),
        );
        if let Some(mut stats) = stats {
            // A VM's own estimate, not a count: a sum over VMs means nothing.
            if let Some(own) = stats["wait"].as_object_mut() {
                own.remove("offload_cost_ms");
            }
            add_numbers(&mut wait, &stats["wait"]);
            add_numbers(&mut sources, &stats["sources"]);
            add_numbers(&mut io, &stats["io"]);
            let pager = &stats["pager"];
            add_numbers(
                &mut offloaded,
                &serde_json::json!({
                    "pages_offloaded": pager["pages_offloaded"],
                    "pages_clean": pager["pages_clean"],
                }),
            );
        }
    }
    // Which VMs the kernel's OOM killer killed, from their cgroups' counters (read before
    // the cgroups go).
    let oom_kills: Vec<u64> = vms
        .iter()
        .zip(&vm_cgroups)
        .zip(&outcomes)
        .map(|((vm, dir), outcome)| oom_kills_of(vm, dir.as_deref(), outcome.results.is_err()))
        .collect();
    // What the governor did, asked before it stops.
    let governor_status = governor.as_deref().map(|socket| {
        vmm::governor::server::query_status(socket, Duration::from_secs(5))
            .unwrap_or_else(|e| serde_json::json!({ "error": e }))
    });
    // The VMs and their cgroups go before the results are checked and printed.
    teardown.run();
    let oom_killed: Vec<serde_json::Value> = vms
        .iter()
        .zip(&oom_kills)
        .enumerate()
        .filter(|(_, (_, &kills))| kills > 0)
        .map(|(i, (vm, &kills))| serde_json::json!({"vm": i, "job": vm.job, "oom_kill": kills}))
        .collect();

    // Every result against the trajectory: each answer's digest, each command's success, and
    // the same digests in every VM.
    let requests = trajectory.requests();
    let mut failures = Vec::new();
    let mut reference: Option<Vec<Option<String>>> = None;
    for (i, outcome) in outcomes.iter().enumerate() {
        if oom_kills[i] > 0 {
            // What the VM answered (a broken connection) says nothing more.
            let budget = budget.map_or_else(String::new, |b| {
                format!(": memory budget {} reached", basics::size_text(b))
            });
            failures.push(format!(
                "VM {i} ({}): killed by the kernel's OOM killer (oom_kill {}){budget}",
                vms[i].job, oom_kills[i]
            ));
            continue;
        }
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
                failures.push(format!(
                    "VM {i}: digests differ from VM 0's ({})",
                    digest_difference(first, &digests)
                ));
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
    let (charged_per_task, guest_per_task) =
        (per_task(Quantity::Charged), per_task(Quantity::GuestPss));
    let window = outcomes
        .iter()
        .map(|o| o.elapsed)
        .max()
        .unwrap_or_default()
        .as_secs_f64();
    // Each VM's own time: from its start to its end.
    let tasks: Vec<f64> = outcomes
        .iter()
        .map(|o| o.elapsed.saturating_sub(o.started).as_secs_f64())
        .collect();
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
        "memory_charged_gib_s_per_task": charged_per_task,
        "guest_pss_gib_s_per_task": guest_per_task,
        "cgroup_mem_gib_s_per_task": per_task(Quantity::Cgroup),
        "completion_window_s": window,
        "completion_s": outcomes.iter().map(|o| o.elapsed.as_secs_f64()).collect::<Vec<_>>(),
        "stagger_ms": args.stagger_ms,
        "stream_answers": args.stream_answers,
        "start_s": outcomes.iter().map(|o| o.started.as_secs_f64()).collect::<Vec<_>>(),
        "task_s": tasks,
        "longest_task_s": tasks.iter().copied().fold(0.0, f64::max),
        "held_s": held_s,
        "throughput_tasks_per_min": if window > 0.0 { n as f64 / window * 60.0 } else { 0.0 },
        "model_requests_served": server.served(),
        "sampling": integrity,
        "harness": harness,
        "cpu": cpu,
        "wait": wait,
        "sources": sources,
        "io": io,
        "offloaded_pages": offloaded,
        "memory_budget_bytes": budget,
        "oom_killed": oom_killed,
        "oom_kills": oom_kills.iter().sum::<u64>(),
        "governor": governor_status,
    });
    text::print(&summary)?;
    if args.json {
        basics::say!("{summary}");
    }
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Adds the numbers of `from` (an object, nested objects summed likewise) into `into`:
/// counts stay whole, anything with a fraction is summed as a float.
fn add_numbers(into: &mut serde_json::Map<String, serde_json::Value>, from: &serde_json::Value) {
    use serde_json::Value;
    for (name, value) in from.as_object().into_iter().flatten() {
        let slot = into.entry(name.clone()).or_insert(Value::Null);
        match (value, &mut *slot) {
            (Value::Object(_), Value::Null) => {
                *slot = Value::Object(serde_json::Map::new());
                if let Value::Object(inner) = slot {
                    add_numbers(inner, value);
                }
            }
            (Value::Object(_), Value::Object(inner)) => add_numbers(inner, value),
            (Value::Number(n), old) => {
                *old = match (n.as_u64(), old.as_u64()) {
                    (Some(a), Some(b)) => (a + b).into(),
                    (Some(a), None) if old.is_null() => a.into(),
                    _ => (n.as_f64().unwrap_or(0.0) + old.as_f64().unwrap_or(0.0)).into(),
                };
            }
            _ => {}
        }
    }
}

/// CPU time of `pid` (`None`: this process), seconds; `None` where it cannot be read (the
/// process is gone).
fn cpu_s(pid: Option<u32>) -> Option<f64> {
    let process = match pid {
        Some(pid) => i32::try_from(pid)
            .map_err(|_| procfs::ProcError::NotFound(None))
            .and_then(procfs::process::Process::new),
        None => procfs::process::Process::myself(),
    };
    #[allow(clippy::cast_precision_loss, reason = "clock ticks of one run")]
    process
        .and_then(|p| p.stat())
        .ok()
        .map(|s| (s.utime + s.stime) as f64 / procfs::ticks_per_second() as f64)
}

/// This process's CPU time, seconds.
fn own_cpu_s() -> f64 {
    cpu_s(None).unwrap_or(0.0)
}

/// Each VM process's CPU time, seconds (`None`: gone).
fn vms_cpu_s(vms: &[Identity]) -> Vec<Option<f64>> {
    vms.iter().map(|vm| cpu_s(Some(vm.pid))).collect()
}

/// The VMs' CPU between two readings: summed over the VMs read both times, and how many
/// were gone at the second (their CPU is not in the sum, which then says too little).
fn vms_cpu_between(before: &[Option<f64>], after: &[Option<f64>]) -> (f64, usize) {
    let mut gone = 0;
    let mut sum = 0.0;
    for (b, a) in before.iter().zip(after) {
        match (b, a) {
            (Some(b), Some(a)) => sum += a - b,
            _ => gone += 1,
        }
    }
    (sum, gone)
}

/// Where one VM's digests part from the reference VM's: the first step whose digest differs,
/// with both, so a failed run says which command saw other bytes.
fn digest_difference(reference: &[Option<String>], digests: &[Option<String>]) -> String {
    let text = |d: Option<&Option<String>>| match d {
        Some(Some(d)) => d.clone(),
        Some(None) => "no digest".to_owned(),
        None => "no step".to_owned(),
    };
    let steps = reference.len().max(digests.len());
    (0..steps)
        .find(|&k| reference.get(k) != digests.get(k))
        .map_or_else(
            || "the same digests".to_owned(),
            |k| {
                format!(
                    "first at command {}: {} against {}",
                    k + 1,
                    text(digests.get(k)),
                    text(reference.get(k))
                )
            },
        )
}

#[cfg(test)]
mod tests {
    use super::{add_numbers, digest_difference};

    #[test]
    fn add_numbers_sums_counts_whole_and_seconds_as_floats_nested() {
        let mut into = serde_json::Map::new();
        let a = serde_json::json!({"waits": 2, "wait_s": 1.5, "model": {"offloads": 1}});
        let b = serde_json::json!({"waits": 3, "wait_s": 0.25, "model": {"offloads": 4}});
        add_numbers(&mut into, &a);
        add_numbers(&mut into, &b);
        add_numbers(&mut into, &serde_json::Value::Null);
        assert_eq!(
            serde_json::Value::Object(into),
            serde_json::json!({"waits": 5, "wait_s": 1.75, "model": {"offloads": 5}})
        );
    }

    #[test]
    fn digest_difference_names_the_first_command_that_differs() {
        let some = |s: &str| Some(s.to_owned());
        let reference = vec![None, some("aa"), some("bb"), some("cc")];
        let other = vec![None, some("aa"), some("bx"), some("cx")];
        assert_eq!(
            digest_difference(&reference, &other),
            "first at command 3: bx against bb"
        );
        assert_eq!(
            digest_difference(&reference, &reference[..2]),
            "first at command 3: no step against bb"
        );
    }
}
