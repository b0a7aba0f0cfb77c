//! The real `pvisor` VM process, for the scenario benches that drive it: `pvisor run --detach`
//! and other commands as a user would type them, requests through the control socket
//! (`vmm::control::call`: what `pvisor exec`, `stats`, `resume` and `stop` send, without
//! starting a client process), and where the binary is, refused when older than its sources.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use vmm::control::{self, Method};
use vmm::runtime::{self, Identity};

use super::Res;

/// How long a VM may take to exit after `stop` before it is killed.
const STOP_LIMIT: Duration = Duration::from_secs(10);

/// A started VM process; stopped (or killed) when dropped.
#[derive(Debug)]
pub struct Job {
    bin: PathBuf,
    identity: Identity,
    stopped: bool,
}

impl Job {
    /// `pvisor run --detach --job JOB ARGS…` (ARGS end with `-- SCRIPT`); returns once the VM
    /// process has printed its identity.
    pub fn start(bin: &Path, job: &str, args: &[&str]) -> Res<Self> {
        let mut all = vec!["run", "--detach", "--job", job];
        all.extend_from_slice(args);
        cli(bin, &all)?;
        let identity = match runtime::read_identity(job) {
            Ok(identity) => identity,
            Err(e) => {
                let _ = Command::new(bin).args(["stop", job]).output();
                return Err(e.into());
            }
        };
        Ok(Self {
            bin: bin.to_path_buf(),
            identity,
            stopped: false,
        })
    }

    /// The VM process.
    pub fn pid(&self) -> u32 {
        self.identity.pid
    }

    /// One request through the control socket; the reply's value.
    pub fn call(&self, method: Method) -> Res<serde_json::Value> {
        let id = &self.identity;
        Ok(control::call(&id.socket, &id.job, &id.attempt, method)?)
    }

    /// Runs `script` through the control socket; returns the first command's digest, if any.
    pub fn exec(&self, script: &str) -> Res<Option<String>> {
        let value = self.call(Method::Exec {
            script: script.to_owned(),
        })?;
        Ok(value["results"][0]["digest"].as_str().map(str::to_owned))
    }

    /// `stats` through the control socket.
    pub fn stats(&self) -> Res<serde_json::Value> {
        self.call(Method::Stats)
    }

    /// Lazy resume through the control socket.
    pub fn resume(&self) -> Res<()> {
        self.call(Method::Resume { eager: false })?;
        Ok(())
    }

    /// `pvisor ARGS JOB`; its stdout.
    pub fn cli(&self, args: &[&str]) -> Res<String> {
        let mut all: Vec<&str> = args.to_vec();
        all.insert(1, &self.identity.job);
        cli(&self.bin, &all)
    }

    /// Asks the VM to stop, without waiting.
    fn ask_to_stop(&mut self) {
        if !self.stopped {
            self.stopped = true;
            let _ = self.call(Method::Stop);
        }
    }

    /// Waits until the VM process has exited; kills it after `STOP_LIMIT`. True if it exited
    /// by itself.
    fn wait_exit(&self) -> bool {
        let pid = self.identity.pid;
        if wait_gone(pid, STOP_LIMIT) {
            return true;
        }
        // SAFETY: kill has no memory-safety preconditions; the pid is our VM process.
        unsafe { libc::kill(pid.cast_signed(), libc::SIGKILL) };
        let _ = wait_gone(pid, Duration::from_secs(5));
        false
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.stopped {
            self.ask_to_stop();
            self.wait_exit();
        }
    }
}

/// Stops every VM of `jobs` at once and waits until all their processes are gone; an error
/// names the ones that had to be killed.
pub fn stop_all(jobs: Vec<Job>) -> Res<()> {
    let mut jobs = jobs;
    for job in &mut jobs {
        job.ask_to_stop();
    }
    let killed: Vec<String> = jobs
        .iter()
        .filter(|job| !job.wait_exit())
        .map(|job| format!("{} (pid {})", job.identity.job, job.identity.pid))
        .collect();
    if killed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "VMs still running {} s after `stop` were killed: {}",
            STOP_LIMIT.as_secs(),
            killed.join(", ")
        )
        .into())
    }
}

/// `pvisor ARGS`; its stdout, or an error with its stderr.
pub fn cli(bin: &Path, args: &[&str]) -> Res<String> {
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
pub fn wait_gone(pid: u32, limit: Duration) -> bool {
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

/// The source directories `pvisor` is built from.
const SOURCES: [&str; 5] = [
    "vmm/src",
    "vmm/guest",
    "uffd-pager/src",
    "compressed-backing/src",
    "ksm-advisor/src",
];

/// The source directories `uffd-pager` is built from.
const PAGER_SOURCES: [&str; 3] = ["uffd-pager/src", "compressed-backing/src", "basics/src"];

/// Where `pvisor` is, and whether it is at least as new as the sources it is built from.
pub fn find_binary(root: &Path, target: &Path) -> Result<PathBuf, String> {
    find_built(root, target, "vmm", "pvisor", &SOURCES)
}

/// Where `uffd-pager` is, and whether it is at least as new as the sources it is built from.
pub fn find_pager_binary(root: &Path, target: &Path) -> Result<PathBuf, String> {
    find_built(root, target, "uffd-pager", "uffd-pager", &PAGER_SOURCES)
}

/// Where `pvisor-sandboxd` is, and whether it is at least as new as the sources it is built
/// from (the VMs' code among them: its VM processes are the same binary; `pvisor`'s own
/// command-line code is not in it).
pub fn find_sandboxd_binary(root: &Path, target: &Path) -> Result<PathBuf, String> {
    let mut sources = SOURCES.to_vec();
    sources.extend(["sandboxd/src", "!vmm/src/bin"]);
    find_built(root, target, "sandboxd", "pvisor-sandboxd", &sources)
}

/// `target/release/BIN` of `package`, if no file under `sources` (but outside those written
/// `!DIR`) is newer.
fn find_built(
    root: &Path,
    target: &Path,
    package: &str,
    bin_name: &str,
    sources: &[&str],
) -> Result<PathBuf, String> {
    let except: Vec<PathBuf> = sources
        .iter()
        .filter_map(|d| Some(root.join(d.strip_prefix('!')?)))
        .collect();
    let build = format!("cargo build --release -p {package} --bin {bin_name}");
    let bin = target.join("release").join(bin_name);
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .map_err(|e| format!("{}: {e}; build it first: {build}", bin.display()))?;
    let newest = sources
        .iter()
        .filter(|d| !d.starts_with('!'))
        .filter_map(|d| newest_file(&root.join(d), &except))
        .max_by_key(|(t, _)| *t);
    if let Some((time, path)) = newest {
        if time > built {
            return Err(format!(
                "{} is older than {}; rebuild it: {build}",
                bin.display(),
                path.display()
            ));
        }
    }
    Ok(bin)
}

/// The newest file under `dir` (not under `except`), and when it changed.
fn newest_file(dir: &Path, except: &[PathBuf]) -> Option<(SystemTime, PathBuf)> {
    let entries = std::fs::read_dir(dir).ok()?.filter_map(Result::ok);
    entries
        .map(|entry| entry.path())
        .filter(|path| !except.iter().any(|e| path.starts_with(e)))
        .filter_map(|path| match path.is_dir() {
            true => newest_file(&path, except),
            false => Some((path.metadata().and_then(|m| m.modified()).ok()?, path)),
        })
        .max_by_key(|(time, _)| *time)
}
