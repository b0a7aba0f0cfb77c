//! One group: `Settings::vms` real `pvisor` VM processes of one mode holding one content, from
//! start to stop:
//!
//! 1. the KSM knobs are read (a KSM mode), then every VM is started with
//!    `pvisor run --memory SIZE --detach [MODE FLAGS] -- idle`, and the knobs read again;
//! 2. ksmd's CPU sampler starts; `fill` runs in every VM in turn (through the control socket);
//!    t0 is when the last one returns;
//! 3. the memory is read at the mode's moments after t0 (`Mode::fill_readings`), then every
//!    VM's `digest` is taken;
//! 4. for each of `REWRITES`: `rewrite PERCENT seed=BASE+i` in every VM `i` in turn, the
//!    memory read `Settings::settle` after the last one returns, the digests taken;
//! 5. every VM is stopped and its process waited for; then the KSM knobs are read a third time.
//!
//! A reading (`PREFIX` = `CONTENT.MODE.POINT`): `per_instance_mib`, the sum of the VM
//! processes' PSS (`/proc/PID/smaps_rollup`) over the number of VMs; `guest_pss_mib`, the same
//! of their guest-RAM mappings (`stats`); `merging_pages`, pages per VM mapped to a KSM page
//! (`stats.dedup`); KSM's global `pages_sharing` and `pages_shared`; `read_at_s`, when it was
//! taken after t0 (or after the last rewrite); `ksmd_cpu_s` and `ksmd_window_s`, ksmd's CPU
//! over the window that ends with the reading (from the first fill, the previous reading or
//! the first rewrite), the window's length, ksmd's mean share of one core over it
//! (`ksmd_mean_pct`) and its busiest `Settings::peak_span` in it (`ksmd_peak_pct`).

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Instant;

use vmm::control::Method;
use vmm::script::Command;

use crate::common::vmproc::{self, Job};
use crate::common::Res;
use crate::ksmd::{self, GroupKnobs, Mark, Sampler};
use crate::results::Results;
use crate::{Content, Mode, Point, Settings, MIB, REWRITES};

/// What a group leaves besides its figures.
#[derive(Debug)]
pub struct Outcome {
    /// Every VM's digest after each stage (`Settings::stages`): `[stage][vm]`.
    pub digests: Vec<Vec<String>>,
    /// The KSM knobs around the group, for a mode that uses KSM.
    pub knobs: Option<GroupKnobs>,
}

/// Runs one group and records it for round `round`.
pub fn run(
    settings: &Settings,
    content: Content,
    mode: Mode,
    round: usize,
    results: &mut Results,
) -> Res<Outcome> {
    let name = format!("{}.{}", content.name(), mode.key());
    let key = |quantity: &str| format!("{name}.{quantity}");
    let before = mode.ksm().then(ksmd::knobs).transpose()?;
    let started = Instant::now();
    let mut extra = Extra::prepare(settings, content, mode, round)?;
    let jobs = match start(settings, content, mode, round, &extra) {
        Ok(jobs) => jobs,
        Err(e) => {
            extra.finish();
            return Err(e);
        }
    };
    results.put(&key("start_s"), "s", round, started.elapsed().as_secs_f64());
    let tuned = mode.ksm().then(ksmd::knobs).transpose()?;
    let measured = measure(settings, content, mode, round, &jobs, &extra, results);
    // Stopped whatever happened, so that the host has its KSM settings back before an error is
    // reported.
    let stopped = vmproc::stop_all(jobs);
    extra.finish();
    let digests = measured.map_err(|e| format!("{name}, round {}: {e}", round + 1))?;
    stopped?;
    let knobs = match (before, tuned) {
        (Some(before), Some(tuned)) => {
            let knobs = GroupKnobs {
                before,
                tuned,
                after: ksmd::knobs()?,
            };
            let restored = if knobs.restored() { 1.0 } else { 0.0 };
            results.put(&key("knobs_restored"), "1 = yes", round, restored);
            Some(knobs)
        }
        _ => None,
    };
    Ok(Outcome { digests, knobs })
}

/// Starts the group's VMs (those already started are stopped if one fails).
fn start(
    settings: &Settings,
    content: Content,
    mode: Mode,
    round: usize,
    extra: &Extra,
) -> Res<Vec<Job>> {
    let memory = format!("{}MiB", settings.memory / MIB);
    let mut jobs = Vec::new();
    for vm in 0..settings.vms {
        // Unique within the bench's own runtime directory.
        let job = format!("sh-{round}-{}-{}-{vm}", content.name(), mode.key());
        let mut args = vec!["--memory", memory.as_str()];
        args.extend_from_slice(mode.run_args());
        if let Some(snapshot) = &extra.snapshot {
            args.extend(["--restore", path_str(snapshot)?]);
        }
        if let Some(socket) = &extra.socket {
            args.extend(["--vm-memory-pool", path_str(socket)?]);
        }
        args.extend(["--", "idle"]);
        match Job::start(&settings.pvisor, &job, &args) {
            Ok(started) => jobs.push(started),
            Err(e) => {
                let _ = vmproc::stop_all(jobs);
                return Err(e);
            }
        }
    }
    Ok(jobs)
}

fn path_str(path: &Path) -> Res<&str> {
    path.to_str()
        .ok_or_else(|| format!("{} is not UTF-8", path.display()).into())
}

/// What a mode needs besides its VMs: the pool daemon, or the snapshot they restore.
#[derive(Debug, Default)]
pub struct Extra {
    daemon: Option<Child>,
    socket: Option<PathBuf>,
    snapshot: Option<PathBuf>,
}

impl Extra {
    /// For `Snapshot`: a template VM with the content (the identical ones; the unique content
    /// is filled after the restore) is snapshotted and stopped. For `Pool`: the daemon starts.
    fn prepare(settings: &Settings, content: Content, mode: Mode, round: usize) -> Res<Self> {
        let work = PathBuf::from(
            std::env::var_os("PVISOR_RUNTIME_DIR").ok_or("PVISOR_RUNTIME_DIR is not set")?,
        );
        match mode {
            Mode::Snapshot => {
                let dir = work.join(format!("snap-{round}-{}", content.name()));
                let memory = format!("{}MiB", settings.memory / MIB);
                let job = format!("sh-{round}-{}-template", content.name());
                let template =
                    Job::start(&settings.pvisor, &job, &["--memory", &memory, "--", "idle"])?;
                let made = (|| -> Res<()> {
                    if content.identical() {
                        template.exec(&content.fill(settings.app, 0).to_string())?;
                    }
                    template.call(Method::Snapshot {
                        out: dir.clone(),
                        codec: None,
                        block_size: None,
                    })?;
                    Ok(())
                })();
                vmproc::stop_all(vec![template])?;
                made?;
                Ok(Self {
                    snapshot: Some(dir),
                    ..Self::default()
                })
            }
            Mode::Pool => {
                let socket = work.join(format!("pool-{round}-{}.sock", content.name()));
                let mut daemon = std::process::Command::new(&settings.pvisor)
                    .args(["serve", "--memory-pool", "--socket", path_str(&socket)?])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()?;
                // It prints the socket once it listens.
                let mut line = String::new();
                let stdout = daemon
                    .stdout
                    .take()
                    .ok_or("the pool daemon has no stdout")?;
                std::io::BufReader::new(stdout).read_line(&mut line)?;
                if line.trim() != socket.to_string_lossy() {
                    let _ = daemon.kill();
                    let _ = daemon.wait();
                    return Err(format!("the pool daemon did not start: {line:?}").into());
                }
                Ok(Self {
                    daemon: Some(daemon),
                    socket: Some(socket),
                    snapshot: None,
                })
            }
            Mode::None | Mode::Ksm => Ok(Self::default()),
        }
    }

    /// The daemon's pid, for its memory.
    fn daemon_pid(&self) -> Option<u32> {
        self.daemon.as_ref().map(Child::id)
    }

    /// Stops the daemon, removes the snapshot.
    fn finish(&mut self) {
        if let Some(mut daemon) = self.daemon.take() {
            if let Ok(pid) = libc::pid_t::try_from(daemon.id()) {
                // SAFETY: a signal to our own child process.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
            let _ = daemon.wait();
        }
        if let Some(dir) = self.snapshot.take() {
            vmm::snapshot::remove(&dir);
        }
    }
}

/// A reading's ksmd window: from, to.
type Window = (Point, Mark, Mark);

/// Steps 2 to 4; the digests.
fn measure(
    settings: &Settings,
    content: Content,
    mode: Mode,
    round: usize,
    jobs: &[Job],
    extra: &Extra,
    results: &mut Results,
) -> Res<Vec<Vec<String>>> {
    let name = format!("{}.{}", content.name(), mode.key());
    let sampler = Sampler::start(settings.sample)?;
    let staged = stages(
        settings, content, mode, round, jobs, extra, &sampler, results,
    );
    let marks = sampler.stop()?;
    let (digests, windows) = staged?;
    for (point, from, to) in &windows {
        let (cpu_s, peak_pct) = ksmd::window(&marks, *from, *to, settings.peak_span);
        let key = |quantity: &str| format!("{name}.{}.{quantity}", point.key());
        let window_s = to.at.duration_since(from.at).as_secs_f64();
        results.put(&key("ksmd_cpu_s"), "s", round, cpu_s);
        results.put(&key("ksmd_window_s"), "s", round, window_s);
        results.put(
            &key("ksmd_mean_pct"),
            "% of a core",
            round,
            cpu_s / window_s * 100.0,
        );
        results.put(&key("ksmd_peak_pct"), "% of a core", round, peak_pct);
    }
    // While converging: from the first fill to the initial reading.
    let initial = mode.initial(settings);
    if let (Some((_, from, _)), Some((_, _, to))) = (
        windows.first(),
        windows.iter().find(|(point, _, _)| *point == initial),
    ) {
        let (cpu_s, peak_pct) = ksmd::window(&marks, *from, *to, settings.peak_span);
        results.put(&format!("{name}.converging.ksmd_cpu_s"), "s", round, cpu_s);
        results.put(
            &format!("{name}.converging.ksmd_peak_pct"),
            "% of a core",
            round,
            peak_pct,
        );
    }
    Ok(digests)
}

#[allow(
    clippy::too_many_arguments,
    reason = "the group's parts, each used on its own; bundling them would only rename them"
)]
fn stages(
    settings: &Settings,
    content: Content,
    mode: Mode,
    round: usize,
    jobs: &[Job],
    extra: &Extra,
    sampler: &Sampler,
    results: &mut Results,
) -> Res<(Vec<Vec<String>>, Vec<Window>)> {
    let name = format!("{}.{}", content.name(), mode.key());
    let mut windows = Vec::new();
    let mut from = sampler.mark()?;
    for (vm, job) in jobs.iter().enumerate() {
        if mode == Mode::Snapshot && content.identical() {
            // Restored with the data: reading it is what maps it.
            job.exec("digest")?;
        } else {
            job.exec(&content.fill(settings.app, vm).to_string())?;
        }
    }
    let t0 = Instant::now();
    results.put(
        &format!("{name}.fill_s"),
        "s",
        round,
        t0.duration_since(from.at).as_secs_f64(),
    );
    for after in mode.fill_readings(settings) {
        sleep_until(t0 + after);
        let point = Point::Filled(after);
        read(
            jobs,
            extra,
            &format!("{name}.{}", point.key()),
            t0,
            round,
            results,
        )?;
        let to = sampler.mark()?;
        windows.push((point, from, to));
        from = to;
    }
    let mut digests = vec![digest_all(jobs)?];
    for (percent, seed) in REWRITES {
        let point = Point::Rewritten(percent);
        let from = sampler.mark()?;
        for (vm, job) in jobs.iter().enumerate() {
            let seed = seed + vm as u64;
            job.exec(&Command::Rewrite { percent, seed }.to_string())?;
        }
        let done = Instant::now();
        let prefix = format!("{name}.{}", point.key());
        results.put(
            &format!("{prefix}.rewrite_s"),
            "s",
            round,
            done.duration_since(from.at).as_secs_f64(),
        );
        sleep_until(done + settings.settle);
        read(jobs, extra, &prefix, done, round, results)?;
        windows.push((point, from, sampler.mark()?));
        digests.push(digest_all(jobs)?);
    }
    Ok((digests, windows))
}

fn sleep_until(at: Instant) {
    if let Some(wait) = at.checked_duration_since(Instant::now()) {
        std::thread::sleep(wait);
    }
}

fn digest_all(jobs: &[Job]) -> Res<Vec<String>> {
    jobs.iter()
        .map(|job| {
            job.exec("digest")?
                .ok_or_else(|| "`digest` gave no digest".into())
        })
        .collect()
}

/// The process's PSS, bytes, from `/proc/PID/smaps_rollup`.
fn pss_bytes(pid: u32) -> Res<u64> {
    vmm::stats::process_pss_of(Some(pid))
        .map_err(|e| format!("/proc/{pid}/smaps_rollup: {e}").into())
}

/// PSS of the pool's pages in a process's mappings of the pool's memfd, bytes: each mapping's
/// PSS less its anonymous pages (the copies the VM made by writing, which are its own).
fn pool_mapping_pss(pid: u32) -> Res<u64> {
    let path = format!("/proc/{pid}/smaps");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let kib = |rest: &str| -> u64 {
        rest.trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .unwrap_or(0)
    };
    let mut inside = false;
    let (mut pss, mut anon) = (0, 0);
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            inside = line.contains("pvisor-memory-pool");
        } else if inside {
            if let Some(rest) = line.strip_prefix("Pss:") {
                pss += kib(rest) * 1024;
            } else if let Some(rest) = line.strip_prefix("Anonymous:") {
                anon += kib(rest) * 1024;
            }
        }
    }
    Ok(pss.saturating_sub(anon))
}

/// One reading of every VM (see the module documentation), `since` the moment it follows.
fn read(
    jobs: &[Job],
    extra: &Extra,
    prefix: &str,
    since: Instant,
    round: usize,
    results: &mut Results,
) -> Res<()> {
    let at = since.elapsed();
    // The headline first, all VMs as close together as possible.
    let pss = jobs
        .iter()
        .map(|job| pss_bytes(job.pid()))
        .collect::<Res<Vec<u64>>>()?;
    let global = ksmd::global();
    let stats = jobs
        .iter()
        .map(Job::stats)
        .collect::<Res<Vec<serde_json::Value>>>()?;
    let n = jobs.len() as f64;
    let mut put = |quantity: &str, unit: &'static str, value: f64| {
        results.put(&format!("{prefix}.{quantity}"), unit, round, value);
    };
    let per_vm_mib = |bytes: u64| bytes as f64 / n / MIB as f64;
    let mut total: u64 = pss.iter().sum();
    if let Some(daemon) = extra.daemon_pid() {
        // Each pool page once, whoever maps it: the VMs' PSS without their share of the pool's
        // mapping, plus the pool's pages and the daemon itself.
        let mapped = jobs
            .iter()
            .map(|job| pool_mapping_pss(job.pid()))
            .collect::<Res<Vec<u64>>>()?
            .iter()
            .sum::<u64>();
        let pool_pages = stats
            .iter()
            .filter_map(|s| s["pool"]["daemon"]["pool_pages"].as_u64())
            .max()
            .unwrap_or(0);
        let daemon_pss = pss_bytes(daemon)?;
        total = total - mapped.min(total) + pool_pages * 4096 + daemon_pss;
        put("pool_pages", "pages", pool_pages as f64);
        put("daemon_pss_mib", "MiB", daemon_pss as f64 / MIB as f64);
    }
    put("per_instance_mib", "MiB", per_vm_mib(total));
    let field = |path: &[&str]| -> Res<Vec<u64>> {
        stats
            .iter()
            .map(|s| {
                path.iter()
                    .fold(s, |v, k| &v[*k])
                    .as_u64()
                    .ok_or_else(|| format!("no `{}` in the stats: {s}", path.join(".")).into())
            })
            .collect()
    };
    put(
        "guest_pss_mib",
        "MiB",
        per_vm_mib(field(&["guest_ram_pss_bytes"])?.iter().sum()),
    );
    let errors: u64 = field(&["fault_errors"])?.iter().sum();
    if errors > 0 {
        return Err(format!("{errors} guest faults could not be served").into());
    }
    if stats.iter().all(|s| s["dedup"].is_object()) {
        let merging: u64 = field(&["dedup", "merging_pages"])?.iter().sum();
        put("merging_pages", "pages per VM", merging as f64 / n);
    }
    put("ksm_pages_sharing", "pages", global.pages_sharing as f64);
    put("ksm_pages_shared", "pages", global.pages_shared as f64);
    put("read_at_s", "s", at.as_secs_f64());
    Ok(())
}
