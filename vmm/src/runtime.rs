//! Where a VM's files live: one directory per job under the runtime directory, with its
//! control socket (mode 0600), its identity, its default disk and offload store, and the log
//! of a detached VM.

use std::path::{Path, PathBuf};

/// The identity a VM prints first and a client needs to reach it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Identity {
    /// The job id.
    pub job: String,
    /// The control socket.
    pub socket: PathBuf,
    /// The attempt id (changes with every start of the job).
    pub attempt: String,
    /// The VM process.
    pub pid: u32,
    /// The process that waits for a detached VM and writes its tombstone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supervisor: Option<u32>,
    /// The VM's memory cgroup, when it runs in one (the tombstone reads its OOM kills).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<PathBuf>,
}

/// Why a VM ended, left in its job directory when it did not end cleanly (`tombstone.json`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tombstone {
    /// The job id.
    pub job: String,
    /// The VM process that ended.
    pub pid: u32,
    /// Its exit status, when it exited.
    pub exit_code: Option<i32>,
    /// The signal that killed it, when one did.
    pub signal: Option<i32>,
    /// Whether its memory cgroup counted an OOM kill.
    pub oom_kill: bool,
    /// Its memory cgroup's OOM kill counter (`oom_kill`), when it was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_kills: Option<u64>,
    /// The hard memory limit (a budget) that bound its cgroup, bytes, when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit_bytes: Option<u64>,
    /// In words.
    pub reason: String,
    /// When it was found ended, seconds since the epoch.
    pub ended_unix_s: u64,
}

/// The exit status of a VM process whose guest memory was lost (see
/// `VmOptions::exit_on_memory_lost`); the cause is in [`MEMORY_LOST_FILE`] of its job's directory.
pub const EXIT_MEMORY_LOST: i32 = 75;
/// See [`EXIT_MEMORY_LOST`].
pub const MEMORY_LOST_FILE: &str = "memory-lost";

impl Tombstone {
    /// The tombstone of `pid`, which ended with `status`; `cgroup` is its memory cgroup.
    pub fn of(
        job: &str,
        pid: u32,
        status: std::process::ExitStatus,
        cgroup: Option<&Path>,
    ) -> Self {
        use std::os::unix::process::ExitStatusExt;
        let cgroup = cgroup.map(crate::stats::MemoryCgroup::at);
        let oom_kills = cgroup
            .as_ref()
            .and_then(crate::stats::MemoryCgroup::oom_kills);
        let oom_kill = oom_kills.is_some_and(|n| n > 0);
        let memory_limit_bytes = cgroup.as_ref().and_then(crate::stats::MemoryCgroup::limit);
        let signal = status.signal();
        let mut reason = match (status.code(), signal) {
            (Some(EXIT_MEMORY_LOST), _) => {
                let cause = crate::runtime::job_dir(job).join(MEMORY_LOST_FILE);
                let cause = compressed_backing::file::read_text_bounded(&cause, 64 << 10)
                    .unwrap_or_else(|_| "its cause was not written".into());
                format!("guest memory is lost: {}", cause.trim())
            }
            (Some(code), _) => format!("the VM process exited with status {code}"),
            (None, Some(signal)) => format!(
                "the VM process was killed by signal {signal} ({})",
                signal_name(signal)
            ),
            (None, None) => format!("the VM process ended: {status}"),
        };
        if let Some(kills) = oom_kills.filter(|_| oom_kill) {
            reason =
                format!("the VM process was killed by the kernel's OOM killer (oom_kill {kills})");
            if let Some(limit) = memory_limit_bytes {
                reason.push_str(&format!(
                    ": memory budget {} reached",
                    basics::size_text(limit)
                ));
            }
        }
        Self {
            job: job.to_owned(),
            pid,
            exit_code: status.code(),
            signal,
            oom_kill,
            oom_kills,
            memory_limit_bytes,
            reason,
            ended_unix_s: now_unix_s(),
        }
    }
}

fn now_unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `SIGKILL` and the like.
fn signal_name(signal: i32) -> String {
    nix::sys::signal::Signal::try_from(signal)
        .map_or_else(|_| format!("signal {signal}"), |s| s.as_str().to_owned())
}

/// Whether the memory cgroup at `dir` counted an OOM kill (v2 `memory.events`, v1
/// `memory.oom_control`).
fn oom_killed(dir: &Path) -> bool {
    ["memory.events", "memory.oom_control"].iter().any(|name| {
        read_small(&dir.join(name)).is_ok_and(|text| {
            text.lines().any(|line| {
                line.strip_prefix("oom_kill ")
                    .and_then(|n| n.trim().parse::<u64>().ok())
                    .is_some_and(|n| n > 0)
            })
        })
    })
}

/// The most a runtime file (identity, tombstone) may hold.
const MAX_RUNTIME_FILE: u64 = 64 << 10;

/// Reads a small regular file, not following a symlink, at most [`MAX_RUNTIME_FILE`] bytes.
fn read_small(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    let mut text = String::new();
    file.take(MAX_RUNTIME_FILE).read_to_string(&mut text)?;
    Ok(text)
}

/// The tombstone file of `job`.
pub fn tombstone_path(job: &str) -> PathBuf {
    job_dir(job).join("tombstone.json")
}

/// Reads the tombstone `job` left, if any.
pub fn read_tombstone(job: &str) -> Option<Tombstone> {
    serde_json::from_str(&read_small(&tombstone_path(job)).ok()?).ok()
}

/// Writes `job`'s tombstone (mode 0600, whole or not at all).
pub fn write_tombstone(tombstone: &Tombstone) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = tombstone_path(&tombstone.job);
    let temporary = path.with_extension("json.new");
    let _ = std::fs::remove_file(&temporary);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temporary)?;
    file.write_all(&serde_json::to_vec(tombstone).map_err(std::io::Error::other)?)?;
    std::fs::rename(&temporary, &path)
}

/// Whether process `pid` runs. A zombie does not: it has ended, and only waits for a parent
/// to reap it (one whose supervisor is gone may wait for ever under an init that does not).
pub fn process_alive(pid: u32) -> bool {
    let Ok(signed) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks that the process exists.
    let sent = unsafe { libc::kill(signed, 0) };
    let exists = sent == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    exists && !ended(pid)
}

/// Whether `/proc` says process `pid` has ended (a zombie, or dead); false when it cannot
/// tell.
fn ended(pid: u32) -> bool {
    use procfs::process::{ProcState, Process};
    i32::try_from(pid)
        .ok()
        .and_then(|pid| Process::new(pid).and_then(|p| p.stat()).ok())
        .and_then(|stat| stat.state().ok())
        .is_some_and(|state| matches!(state, ProcState::Zombie | ProcState::Dead))
}

/// Removes what a VM process that ended leaves behind in its job directory: its socket,
/// identity (the lock that says the job runs), RAM store and default disk; the log and the
/// tombstone stay.
pub fn remove_vm_files(job: &str) {
    let dir = job_dir(job);
    for name in ["control.sock", "vm.json", "ram", "disk.img"] {
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_dir_all(&path);
    }
}

/// Removes a dead VM's memory cgroup, retrying for a moment while the kernel still counts
/// the process in it (`EBUSY`).
pub fn remove_cgroup(dir: &Path) {
    for _ in 0..50 {
        match std::fs::remove_dir(dir) {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            _ => return,
        }
    }
}

/// How long a check waits for a dead VM's supervisor to write the tombstone.
const SUPERVISOR_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// If `job`'s VM process is gone but its files are still there (it was killed with nobody
/// to see it, or its supervisor is about to), cleans them, leaving a tombstone; returns the
/// tombstone of a job whose VM is dead (`None`: it runs, or there is no such job).
pub fn reap(job: &str) -> Option<Tombstone> {
    check_private_dir(&runtime_dir()).ok()?;
    let Ok(identity) = read_identity(job) else {
        return read_tombstone(job);
    };
    if process_alive(identity.pid) {
        return None;
    }
    // Its supervisor writes the real tombstone: give it a moment.
    if let Some(supervisor) = identity.supervisor.filter(|&p| process_alive(p)) {
        let until = std::time::Instant::now() + SUPERVISOR_GRACE;
        while identity_path(job).exists()
            && process_alive(supervisor)
            && std::time::Instant::now() < until
        {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        if !identity_path(job).exists() {
            return read_tombstone(job);
        }
    }
    let tombstone = read_tombstone(job).unwrap_or_else(|| Tombstone {
        job: job.to_owned(),
        pid: identity.pid,
        exit_code: None,
        signal: None,
        oom_kill: identity.cgroup.as_deref().is_some_and(oom_killed),
        oom_kills: None,
        memory_limit_bytes: None,
        reason: format!(
            "the VM process {} is gone and nobody saw how it ended; its stale files were removed",
            identity.pid
        ),
        ended_unix_s: now_unix_s(),
    });
    // The tombstone first: whoever finds the identity gone finds the tombstone.
    let _ = write_tombstone(&tombstone);
    remove_vm_files(job);
    if let Some(cgroup) = &identity.cgroup {
        remove_cgroup(cgroup);
    }
    Some(tombstone)
}

/// Reaps every job of the runtime directory whose VM process is gone.
pub fn reap_all() {
    let Ok(entries) = std::fs::read_dir(runtime_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if let (true, Some(job)) = (is_dir, entry.file_name().to_str()) {
            if check_job_id(job).is_ok() {
                let _ = reap(job);
            }
        }
    }
}

/// The runtime directory: `$PVISOR_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/pvisor`, else
/// `/run/pvisor` for root, else `/tmp/pvisor-UID`. Used only once [`ensure_runtime_dir`]
/// has checked it.
pub fn runtime_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PVISOR_RUNTIME_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR") {
        return PathBuf::from(dir).join("pvisor");
    }
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    if uid == 0 {
        PathBuf::from("/run/pvisor")
    } else {
        PathBuf::from(format!("/tmp/pvisor-{uid}"))
    }
}

/// Makes sure the runtime directory is safe to keep sockets and identities in, creating it
/// (mode 0700) if it does not exist: an existing one is used only if it is a real directory
/// (not a symlink), owned by this user and not writable by group or others. Otherwise another
/// local user could see or replace a VM's socket and identity.
pub fn ensure_runtime_dir() -> std::io::Result<PathBuf> {
    let dir = runtime_dir();
    if let Err(e) = std::fs::symlink_metadata(&dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            return Err(e);
        }
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent)?;
        }
        use std::os::unix::fs::DirBuilderExt;
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            // Someone made it meanwhile: it is checked below like any existing one.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    check_private_dir(&dir)?;
    Ok(dir)
}

/// Refuses `dir` unless it is a real directory of ours that only we can write.
fn check_private_dir(dir: &Path) -> std::io::Result<()> {
    match not_private(dir)? {
        None => Ok(()),
        Some(why) => Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "runtime directory {} is not safe to use: {why}; remove it or point \
                 PVISOR_RUNTIME_DIR at a private directory",
                dir.display()
            ),
        )),
    }
}

/// Why `dir` is not a real directory of ours that only we can write (`None`: it is one).
pub(crate) fn not_private(dir: &Path) -> std::io::Result<Option<String>> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(dir)?;
    // SAFETY: geteuid cannot fail.
    let own = unsafe { libc::geteuid() };
    let why = if meta.file_type().is_symlink() {
        Some("it is a symlink".to_owned())
    } else if !meta.is_dir() {
        Some("it is not a directory".to_owned())
    } else if meta.uid() != own {
        Some(format!("it belongs to uid {}, not {own}", meta.uid()))
    } else if meta.mode() & 0o022 != 0 {
        Some(format!(
            "it is writable by group or others (mode {:o})",
            meta.mode() & 0o7777
        ))
    } else {
        None
    };
    Ok(why)
}

/// The directory of `job`.
pub fn job_dir(job: &str) -> PathBuf {
    runtime_dir().join(job)
}

/// The control socket of `job`.
pub fn socket_path(job: &str) -> PathBuf {
    job_dir(job).join("control.sock")
}

/// The identity file of `job`.
pub fn identity_path(job: &str) -> PathBuf {
    job_dir(job).join("vm.json")
}

/// Reads the identity a running job left.
pub fn read_identity(job: &str) -> std::io::Result<Identity> {
    check_private_dir(&runtime_dir())?;
    let path = identity_path(job);
    let text = read_small(&path).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("no VM with job id `{job}` here ({}: {e})", path.display()),
        )
    })?;
    serde_json::from_str(&text)
        .map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))
}

/// A fresh random id of 12 hex digits.
pub fn new_id(prefix: &str) -> String {
    let mut bytes = [0u8; 6];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != 6 {
        // Fall back on time and pid; ids only need to differ between live jobs.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
            ^ u128::from(std::process::id());
        bytes.copy_from_slice(&seed.to_le_bytes()[..6]);
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}{hex}")
}

/// A job id must be a plain name: it becomes a directory name.
pub fn check_job_id(job: &str) -> Result<(), String> {
    let ok = !job.is_empty()
        && job.len() <= 64
        && job
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !job.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "job id `{job}` must be 1-64 letters, digits, '-', '_' or '.', not starting with '.'"
        ))
    }
}

/// Creates `dir` with mode 0700 (and its parents).
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_process_alive_counts_a_zombie_as_gone() {
        let child = std::process::Command::new("true")
            .spawn()
            .expect("`true` starts");
        let pid = child.id();
        // Not reaped yet: a zombie once it has exited.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            stat.rsplit_once(") ")
                .is_some_and(|(_, s)| s.starts_with('Z'))
        }) {
            assert!(std::time::Instant::now() < deadline, "`true` did not exit");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let alive = process_alive(pid);
        drop(child.wait_with_output());
        assert!(!alive, "a zombie counted as a running VM");
        assert!(process_alive(std::process::id()));
    }

    #[test]
    fn runtime_job_ids_are_checked_and_fresh_ids_differ() {
        assert!(check_job_id("vm-1a2b").is_ok());
        for bad in ["", "../x", ".hidden", "a/b", "a b", &"x".repeat(65)] {
            assert!(check_job_id(bad).is_err(), "{bad}");
        }
        assert_ne!(new_id("vm-"), new_id("vm-"));
        assert!(check_job_id(&new_id("vm-")).is_ok());
    }
}
