//! A sandbox's VM: a detached `vmm` VM process (`vmm::detached`, the code of `pvisor run
//! --detach`), reached through its control socket. Every call here blocks: the daemon runs
//! them on tokio's blocking threads.

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

/// Starts the VM of sandbox `id` with `memory` bytes of guest RAM (its files in the job
/// directory `id` of the runtime directory).
pub fn start(id: &str, memory: u64) -> Result<VmRef, VmError> {
    let spec = Spec::in_job_dir(id, memory);
    let identity = detached::start(&spec).map_err(VmError::Start)?;
    Ok(VmRef {
        job: identity.job,
        attempt: identity.attempt,
        socket: identity.socket,
        pid: identity.pid,
        supervisor: identity.supervisor,
    })
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

/// Stops the VM (asked through its socket, killed if it does not exit in time), reaps its
/// supervisor, and removes its job directory.
pub fn stop(vm: &VmRef) {
    if runtime::process_alive(vm.pid) {
        if let Err(e) = control::call(&vm.socket, &vm.job, &vm.attempt, Method::Stop) {
            tracing::warn!(job = %vm.job, "stop through the control socket: {}", basics::error_chain(&e));
        }
        let deadline = Instant::now() + EXIT_GRACE;
        while runtime::process_alive(vm.pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if runtime::process_alive(vm.pid) {
            tracing::warn!(job = %vm.job, pid = vm.pid, "the VM did not exit: killed");
            kill(vm.pid);
        }
    }
    reap_supervisor(vm);
    remove_files(&vm.job);
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
    // SAFETY: kill has no memory effects. The pid is the VM's, alive a moment ago; its
    // supervisor reaps it, so the pid stays its own until it exits.
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
