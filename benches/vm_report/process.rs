//! The real `pvisor` VM process: `pvisor run --detach`, then `pvisor stats JOB` and
//! `pvisor suspend JOB --vm-offload` as a user would type them, and the timed resume + task
//! through the control socket (`vmm::control::call`: what `pvisor resume` and `pvisor exec`
//! send, without starting a client process).
//!
//! Cases per content: `base` (never offloaded: `task`), `raw`, `lz4`, `zstd` (offload, lazy
//! resume, `task`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use vmm::control::{self, Method};
use vmm::runtime::{self, Identity};

use crate::results::Results;
use crate::{Codec, Content, Res, Settings, MIB};

/// The cases, in the order of run 0 (`None`: never offloaded).
pub const CASES: [Option<Codec>; 4] = [None, Some(Codec::Raw), Some(Codec::Lz4), Some(Codec::Zstd)];

pub fn case_name(case: Option<Codec>) -> &'static str {
    case.map_or("base", Codec::name)
}

/// A started VM process; stopped (or killed) when dropped.
struct Job {
    bin: PathBuf,
    identity: Identity,
}

impl Job {
    /// Runs `script` through the control socket; returns the first command's digest, if any.
    fn exec(&self, script: &str) -> Res<Option<String>> {
        let id = &self.identity;
        let method = Method::Exec {
            script: script.to_owned(),
        };
        let value = control::call(&id.socket, &id.job, &id.attempt, method)?;
        Ok(value["results"][0]["digest"].as_str().map(str::to_owned))
    }

    /// Lazy resume through the control socket.
    fn resume(&self) -> Res<()> {
        let id = &self.identity;
        control::call(
            &id.socket,
            &id.job,
            &id.attempt,
            Method::Resume { eager: false },
        )?;
        Ok(())
    }

    /// `pvisor ARGS JOB`; its stdout.
    fn cli(&self, args: &[&str]) -> Res<String> {
        let mut all: Vec<&str> = args.to_vec();
        all.insert(1, &self.identity.job);
        cli(&self.bin, &all)
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = Command::new(&self.bin)
            .args(["stop", &self.identity.job])
            .output();
        if !wait_gone(self.identity.pid, Duration::from_secs(10)) {
            // SAFETY: kill has no memory-safety preconditions; the pid is our VM process.
            unsafe { libc::kill(self.identity.pid.cast_signed(), libc::SIGKILL) };
            let _ = wait_gone(self.identity.pid, Duration::from_secs(5));
        }
    }
}

fn cli(bin: &Path, args: &[&str]) -> Res<String> {
    let out = Command::new(bin).args(args).output()?;
    if !out.status.success() {
        return Err(format!(
            "pvisor {}: {} {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// True once `pid` has exited (gone, or a zombie waiting for init).
fn wait_gone(pid: u32, limit: Duration) -> bool {
    let started = Instant::now();
    loop {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return true,
            Ok(stat) => {
                let state = stat
                    .rsplit_once(") ")
                    .and_then(|(_, rest)| rest.chars().next());
                if matches!(state, Some('Z' | 'X')) {
                    return true;
                }
            }
        }
        if started.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The number after `"key":` in a JSON text (the first occurrence), or an error naming it.
pub fn json_number(text: &str, key: &str) -> Res<f64> {
    let pattern = format!("\"{key}\":");
    let at = text
        .find(&pattern)
        .ok_or_else(|| format!("no `{key}` in {text}"))?;
    let rest = text[at + pattern.len()..].trim_start();
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E')))
        .unwrap_or(rest.len());
    Ok(rest[..end]
        .parse()
        .map_err(|_| format!("`{key}` is not a number in {text}"))?)
}

fn mib(text: &str, key: &str) -> Res<f64> {
    Ok(json_number(text, key)? / MIB as f64)
}

/// Runs one case in a `pvisor` process and records it under `pvisor.CONTENT.CASE.*`.
pub fn run_case(
    settings: &Settings,
    bin: &Path,
    content: Content,
    case: Option<Codec>,
    run: usize,
    results: &mut Results,
) -> Res<()> {
    let name = case_name(case);
    let key = |quantity: &str| format!("pvisor.{}.{name}.{quantity}", content.name());
    let job_id = format!(
        "vmbench-{}-{run}-{}-{name}",
        std::process::id(),
        content.name()
    );
    let script = format!(
        "fill {} {} seed={}",
        settings.app,
        content.name(),
        settings.seed
    );
    let memory = format!("{}MiB", settings.memory / MIB);
    let mut args = vec!["run", "--detach", "--job", &job_id, "--memory", &memory];
    let codec_flag;
    if let Some(codec) = case.filter(|&c| c != Codec::Raw) {
        codec_flag = codec.codec_name();
        args.extend(["--vm-ram-compression", "--vm-ram-codec", codec_flag]);
    }
    args.extend(["--", &script]);
    cli(bin, &args)?;
    let identity = match runtime::read_identity(&job_id) {
        Ok(identity) => identity,
        Err(e) => {
            let _ = Command::new(bin).args(["stop", &job_id]).output();
            return Err(e.into());
        }
    };
    let job = Job {
        bin: bin.to_path_buf(),
        identity,
    };
    // Answered once the script has run: the VM takes requests only then.
    let digest = job.exec("digest")?.ok_or("digest gave no digest")?;
    let running = job.cli(&["stats"])?;
    results.put(
        &key("pss_running_mib"),
        "MiB",
        run,
        mib(&running, "process_pss_bytes")?,
    );
    results.put(
        &key("guest_pss_running_mib"),
        "MiB",
        run,
        mib(&running, "guest_ram_pss_bytes")?,
    );
    let check = |got: Option<String>| -> Res<()> {
        match got {
            Some(d) if d == digest => Ok(()),
            other => Err(format!(
                "pvisor {}/{name}: task digest {other:?}, expected {digest}",
                content.name()
            )
            .into()),
        }
    };
    if case.is_none() {
        crate::settle();
        let started = Instant::now();
        let got = job.exec("task")?;
        results.put(
            &key("task_ms"),
            "ms",
            run,
            started.elapsed().as_secs_f64() * 1e3,
        );
        return check(got);
    }
    crate::settle();
    let suspend = job.cli(&["suspend", "--vm-offload"])?;
    results.put(
        &key("offload_ms"),
        "ms",
        run,
        json_number(&suspend, "elapsed_ms")?,
    );
    results.put(
        &key("offload_write_ms"),
        "ms",
        run,
        json_number(&suspend, "write_ms")?,
    );
    results.put(
        &key("offload_drop_ms"),
        "ms",
        run,
        json_number(&suspend, "drop_ms")?,
    );
    let offloaded = job.cli(&["stats"])?;
    results.put(
        &key("pss_offloaded_mib"),
        "MiB",
        run,
        mib(&offloaded, "process_pss_bytes")?,
    );
    results.put(
        &key("guest_pss_offloaded_mib"),
        "MiB",
        run,
        mib(&offloaded, "guest_ram_pss_bytes")?,
    );
    results.put(
        &key("backing_mib"),
        "MiB",
        run,
        mib(&offloaded, "backing_disk_bytes")?,
    );
    crate::settle();
    let started = Instant::now();
    job.resume()?;
    let got = job.exec("task")?;
    results.put(
        &key("resume_task_ms"),
        "ms",
        run,
        started.elapsed().as_secs_f64() * 1e3,
    );
    check(got)?;
    let resumed = job.cli(&["stats"])?;
    results.put(
        &key("pss_resumed_mib"),
        "MiB",
        run,
        mib(&resumed, "process_pss_bytes")?,
    );
    Ok(())
}

/// Where `pvisor` is, and whether it is at least as new as the sources it is built from.
pub fn find_binary(root: &Path, target: &Path) -> Result<PathBuf, String> {
    let bin = target.join("release").join("pvisor");
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .map_err(|e| {
            format!(
                "{}: {e}; build it first: cargo build --release -p vmm --bin pvisor",
                bin.display()
            )
        })?;
    let dirs = [
        "vmm/src",
        "vmm/guest",
        "uffd-pager/src",
        "compressed-backing/src",
    ];
    let newest = dirs
        .iter()
        .filter_map(|d| newest_file(&root.join(d)))
        .max_by_key(|(t, _)| *t);
    if let Some((time, path)) = newest {
        if time > built {
            return Err(format!(
                "{} is older than {}; rebuild it: cargo build --release -p vmm --bin pvisor",
                bin.display(),
                path.display()
            ));
        }
    }
    Ok(bin)
}

fn newest_file(dir: &Path) -> Option<(std::time::SystemTime, PathBuf)> {
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in std::fs::read_dir(dir).ok()?.filter_map(Result::ok) {
        let path = entry.path();
        let candidate = if path.is_dir() {
            newest_file(&path)
        } else {
            entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .map(|t| (t, path))
        };
        if let Some(c) = candidate {
            if newest.as_ref().is_none_or(|n| c.0 > n.0) {
                newest = Some(c);
            }
        }
    }
    newest
}
