//! A sandbox's VM: a detached `vmm` VM process (`vmm::detached`, the code of `pvisor run
//! --detach`), reached through its control socket. Every call here blocks: the daemon runs
//! them on tokio's blocking threads.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use vmm::control::{self, Method};
use vmm::detached::{self, Spec};
use vmm::runtime;

use crate::store::VmRef;

/// Errors of a VM operation.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// The VM did not start.
    #[error("the VM did not start")]
    Start(#[source] detached::StartError),
    /// The VM refused or failed a request, or could not be reached.
    #[error("the VM's control socket")]
    Call(#[source] control::ClientError),
    /// The VM process is gone.
    #[error("the VM ended: {0}")]
    Ended(String),
}

/// How a sandbox's VM is made.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Bytes of guest RAM.
    pub memory: u64,
    /// The snapshot it is restored from, into its own RAM (`None`: the workload guest,
    /// started afresh).
    pub restore: Option<crate::templates::SnapshotAt>,
    /// Its RAM is marked mergeable for KSM (`--vm-ram-dedup`), so that the pages sandboxes of
    /// one snapshot restored alike and have not written are kept once, copy-on-write.
    pub dedup: bool,
    /// The memory governor's socket (`None`: the VM does not join it, and keeps what it
    /// touches).
    pub governor: Option<PathBuf>,
    /// Its memory cgroup, relative to the daemon's.
    pub cgroup: PathBuf,
    /// Its downloads: the origins allowed (none: no network).
    pub net: vmm::net::NetOptions,
    /// Its read-only image (a directory, a bucket's prefix or an HTTP root with
    /// `image.json`) and where its files are staged, if any.
    pub image: Option<vmm::image::ImageOptions>,
}

/// Starts the VM of sandbox `id` by `plan` (its files in the job directory `id` of the
/// runtime directory): anonymous RAM served by its pager, in a memory cgroup of its own,
/// joined to the governor (when the plan names it), with an offload store the governor's
/// orders and pauses use.
pub fn start(id: &str, plan: &Plan) -> Result<VmRef, VmError> {
    let mut spec = Spec::in_job_dir(id, plan.memory);
    spec.options.cgroup = Some(plan.cgroup.clone());
    // Anonymous RAM its pager loads from the snapshot as the guest touches it (the kind
    // `Spec::in_job_dir` gives), never the snapshot's image mapped: the governor limits and
    // takes back what the pager serves, and no sandbox sees another's writes.
    match plan.restore.clone() {
        Some(crate::templates::SnapshotAt::Dir(dir)) => spec.options.restore = Some(dir),
        Some(crate::templates::SnapshotAt::Remote(remote)) => {
            spec.options.restore_remote = Some(*remote);
        }
        None => {}
    }
    spec.options.net = plan.net.clone();
    spec.options.image = plan.image.clone();
    if plan.dedup {
        spec.options.dedup = Some(vmm::dedup::DedupOptions::default());
    }
    if let Some(socket) = &plan.governor {
        spec.options.governor = Some(vmm::vm::GovernorOptions {
            socket: socket.clone(),
            name: id.to_owned(),
            hold_timeout_ms: None,
        });
        // Wait management gives the VM the offload store a governor's order offloads into
        // between commands (a sandbox has no model waits of its own).
        spec.options.wait = Some(vmm::wait::WaitPolicy::default());
    }
    let identity = detached::start(&spec).map_err(VmError::Start)?;
    Ok(vm_ref(identity))
}

fn vm_ref(identity: runtime::Identity) -> VmRef {
    VmRef {
        job: identity.job,
        attempt: identity.attempt,
        socket: identity.socket,
        pid: identity.pid,
        supervisor: identity.supervisor,
    }
}

/// The VM that job `id` (a checked sandbox id) has in its directory, by its identity file:
/// one a previous daemon started but had not recorded when it died.
pub fn left_in(id: &str) -> Option<VmRef> {
    if !crate::store::check_id(id) {
        return None;
    }
    runtime::read_identity(id)
        .ok()
        .filter(|identity| identity.job == id)
        .map(vm_ref)
}

/// Sends `method` to the VM; a VM that died meanwhile answers with its tombstone's reason.
pub fn call(vm: &VmRef, method: Method) -> Result<serde_json::Value, VmError> {
    control::call(&vm.socket, &vm.job, &vm.attempt, method).map_err(|e| {
        match (!runtime::process_alive(vm.pid)).then(|| ended_reason(vm)) {
            Some(reason) => VmError::Ended(reason),
            None => VmError::Call(e),
        }
    })
}

/// Why the VM ended: its tombstone's reason (waited for a little: its supervisor writes it),
/// else that it is gone.
pub fn ended_reason(vm: &VmRef) -> String {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        if let Some(tombstone) = runtime::read_tombstone(&vm.job) {
            return tombstone.reason;
        }
        if Instant::now() >= deadline {
            return format!("the VM process {} is gone and left no tombstone", vm.pid);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs a workload script; the results (one JSON object per command).
pub fn exec(vm: &VmRef, script: &str) -> Result<Vec<serde_json::Value>, VmError> {
    let value = call(
        vm,
        Method::Exec {
            script: script.to_owned(),
        },
    )?;
    Ok(value
        .get("results")
        .and_then(serde_json::Value::as_array)
        .cloned()
        .unwrap_or_default())
}

/// How long a stopped VM gets to exit before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(10);

/// Whether process `vm.pid` is still this VM, not a process that took its pid after it
/// ended (the pid comes from a record, perhaps a previous daemon's): it runs the VM command,
/// its job's identity file names it with the same attempt, and it started before that file
/// was written.
pub fn is_this_vm(vm: &VmRef) -> bool {
    let Ok(identity) = runtime::read_identity(&vm.job) else {
        return false;
    };
    if identity.pid != vm.pid || identity.attempt != vm.attempt || !runtime::process_alive(vm.pid) {
        return false;
    }
    let runs_vm = std::fs::read(format!("/proc/{}/cmdline", vm.pid))
        .is_ok_and(|c| c.split(|&b| b == 0).nth(1) == Some(detached::VM_ARG.as_bytes()));
    let written = std::fs::metadata(runtime::identity_path(&vm.job))
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
    match (runs_vm, written, started_unix(vm.pid)) {
        (true, Some(written), Some(started)) => started <= written.as_secs() + START_SLACK_S,
        _ => false,
    }
}

/// How much later than its identity file a VM process may seem to have started: the boot
/// time is in whole seconds, and a clock step since boot moves it.
const START_SLACK_S: u64 = 5;

/// When process `pid` started, in Unix seconds.
fn started_unix(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command's name: state is field 3, starttime field 22.
    let (_, rest) = stat.rsplit_once(')')?;
    let ticks: u64 = rest.split_whitespace().nth(19)?.parse().ok()?;
    let boot: u64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    // SAFETY: sysconf has no memory effects.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok()?;
    Some(boot + ticks / hz.max(1))
}

/// Stops the VM (asked through its socket; killed if it does not exit in time, but only if
/// the pid is still this VM's: [`is_this_vm`]), reaps its supervisor, and removes its job
/// directory.
pub fn stop(vm: &VmRef) {
    if runtime::process_alive(vm.pid) {
        let ours = is_this_vm(vm);
        // Asked whoever has the pid now: the socket answers only this VM (it checks the job
        // and the attempt).
        if let Err(e) = control::call(&vm.socket, &vm.job, &vm.attempt, Method::Stop) {
            tracing::warn!(job = %vm.job, "stop through the control socket: {}", basics::error_chain(&e));
        }
        if ours {
            let deadline = Instant::now() + EXIT_GRACE;
            while runtime::process_alive(vm.pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if is_this_vm(vm) {
                tracing::warn!(job = %vm.job, pid = vm.pid, "the VM did not exit: killed");
                kill(vm.pid);
            }
        } else {
            tracing::info!(job = %vm.job, pid = vm.pid, "the pid is no longer this VM's: left alone");
        }
    }
    reap_supervisor(vm);
    remove_files(&vm.job);
}

/// Stops `vm` (its files go with it: [`stop`]) or, with no VM, removes the files of job
/// `job` (a start that never came up, or died).
pub fn stop_or_clear(job: &str, vm: Option<&VmRef>) {
    match vm {
        Some(vm) => stop(vm),
        None => remove_files(job),
    }
}

/// Removes the job directory of `job` (a checked sandbox id) and everything in it.
pub fn remove_files(job: &str) {
    if crate::store::check_id(job) {
        let _ = std::fs::remove_dir_all(runtime::job_dir(job));
    }
}

fn kill(pid: u32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill has no memory effects. The pid is the VM's ([`is_this_vm`] a moment ago);
    // its supervisor reaps it, so the pid stays its own until it exits.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(5);
    while runtime::process_alive(pid.unsigned_abs()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (a little) for the VM's supervisor, this daemon's child, so that it does not stay
/// a zombie.
pub fn reap_supervisor(vm: &VmRef) {
    let Some(pid) = vm.supervisor.and_then(|p| libc::pid_t::try_from(p).ok()) else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes only `status`; WNOHANG keeps it from blocking. A pid that
        // is not our child (a supervisor started by an earlier daemon) answers ECHILD.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if rc != 0 || Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn vm_is_this_vm_only_while_the_pid_is_the_recorded_process() {
        let dir = tempfile::tempdir().expect("tempdir");
        let runtime = dir.path().join("vms");
        std::fs::create_dir(&runtime).expect("mkdir");
        std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o700)).expect("0700");
        // The only test of this crate that sets it.
        std::env::set_var("PVISOR_RUNTIME_DIR", &runtime);
        // A process whose first argument is the VM command, as a VM process's is.
        // (It waits on its stdin in the shell itself: no grandchild is left behind.)
        std::fs::write(dir.path().join(detached::VM_ARG), "read line\n").expect("script");
        let mut child = std::process::Command::new("sh")
            .arg(detached::VM_ARG)
            .current_dir(dir.path())
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("sh");
        let job = "sb-0123456789ab";
        std::fs::create_dir(runtime.join(job)).expect("job dir");
        let identity = runtime::Identity {
            job: job.into(),
            socket: runtime.join(job).join("control.sock"),
            attempt: "a1".into(),
            pid: child.id(),
            supervisor: None,
            cgroup: None,
        };
        let path = runtime::identity_path(job);
        std::fs::write(&path, serde_json::to_vec(&identity).expect("json")).expect("identity");
        let vm = vm_ref(identity);
        // The child runs the test's own command line until its exec of `sh`: wait for that.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !std::fs::read(format!("/proc/{}/cmdline", child.id()))
            .is_ok_and(|c| c.starts_with(b"sh\0"))
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let this = is_this_vm(&vm);
        let other_attempt = is_this_vm(&VmRef {
            attempt: "a2".into(),
            ..vm.clone()
        });
        // An identity written an hour before the process started: the pid was taken since.
        let hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_modified(hour_ago))
            .expect("mtime");
        let reused = is_this_vm(&vm);
        let _ = child.kill();
        let _ = child.wait();
        assert!(this, "the recorded VM process");
        assert!(!other_attempt, "another attempt of the job");
        assert!(
            !reused,
            "a process that started after the identity was written"
        );
        assert!(!is_this_vm(&vm), "a process that ended");
        assert_eq!(left_in(job), Some(vm));
        assert_eq!(left_in("../escape"), None);
    }
}
