//! A detached VM: the VM in a process of its own under a supervisor, outliving whoever
//! started it (`pvisor run --detach`, `pvisor-sandboxd`'s sandboxes).
//!
//! [`start`] re-runs the calling program as [`SUPERVISE_ARG`] with the [`Spec`] on its stdin;
//! the supervisor re-runs it as [`VM_ARG`] and waits for the VM process, leaving a tombstone
//! in the job's directory if it did not end cleanly. A program that calls [`start`] must hand
//! those two hidden commands to [`supervise`] and [`vm_process`]. The VM process serves the
//! control socket ([`crate::control`]) until it is stopped; [`vm_main`] is that process's body,
//! also run in the foreground by `pvisor run` without `--detach`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{ExitCode, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use basics::error_chain;
use nix::sys::signal::{SigSet, Signal};

use crate::control::{self, Method};
use crate::operator::{Operator, OperatorRequest, Reply};
use crate::runtime::{self, Identity};
use crate::script::{self, Command};
use crate::vm::{Vm, VmOptions};

/// The hidden command that runs [`supervise`].
pub const SUPERVISE_ARG: &str = "__supervise";
/// The hidden command that runs [`vm_process`].
pub const VM_ARG: &str = "__vm";

/// What a process's `main` returns: its exit code, or the error to print.
pub type ProcessResult = Result<ExitCode, Box<dyn std::error::Error>>;

/// Everything the VM process needs.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Spec {
    /// The job id (its directory under the runtime directory).
    pub job: String,
    /// The attempt id (a fresh one per start).
    pub attempt: String,
    /// The VM.
    pub options: VmOptions,
    /// The script run first (may be empty).
    pub script: String,
    /// The VM stays up after its script until stopped.
    pub detached: bool,
    /// The disk was made for this VM and goes with it.
    pub temporary_disk: bool,
}

impl Spec {
    /// A detached VM of `job` (checked as a job id by [`start`]) with the disk and offload
    /// store in its job directory and no script: `memory` bytes of anon RAM, everything else
    /// as [`VmOptions::new`] has it, the VM process ending if its memory is lost.
    pub fn in_job_dir(job: &str, memory: u64) -> Self {
        let dir = runtime::job_dir(job);
        let mut options = VmOptions::new(
            memory,
            uffd_pager::pager::RamKind::Anon,
            dir.join("disk.img"),
            dir.join("ram"),
        );
        options.exit_on_memory_lost = true;
        Self {
            job: job.to_owned(),
            attempt: runtime::new_id(""),
            options,
            script: String::new(),
            detached: true,
            temporary_disk: true,
        }
    }
}

/// Why a detached VM did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The job id is not a plain name.
    #[error("{0}")]
    Job(String),
    /// The job runs already.
    #[error("job `{job}` is already running (pid {pid})")]
    Running {
        /// The job.
        job: String,
        /// Its VM process.
        pid: u32,
    },
    /// The runtime directory or the job's cannot be used.
    #[error("cannot prepare the job directory {path}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The supervisor did not start.
    #[error("cannot start the VM's supervisor")]
    Spawn(#[source] std::io::Error),
    /// The spec did not reach it, or its identity line did not come back.
    #[error("cannot talk to the VM's supervisor")]
    Pipe(#[source] std::io::Error),
    /// The VM process ended before it was up.
    #[error("the VM did not start ({status}): {log}")]
    NotStarted {
        /// How its supervisor ended.
        status: ExitStatus,
        /// The VM's log.
        log: String,
    },
}

/// Starts the VM of `spec` in the background under its supervisor (the calling program run
/// again, see the [module](self)) and returns its identity once the VM is up. The VM's
/// output goes to `vm.log` in the job's directory. The spec goes through a pipe, not the
/// command line: it may be large, and the attempt id in it is not for other users to read in
/// `/proc/PID/cmdline`. A start that fails leaves no job directory.
pub fn start(spec: &Spec) -> Result<Identity, StartError> {
    prepare_job(&spec.job)?;
    start_detached(spec).inspect_err(|_| {
        let _ = std::fs::remove_dir_all(runtime::job_dir(&spec.job));
    })
}

/// Makes the directory of `job` ready for a new start of it: refused while the job runs;
/// the last start's tombstone and log removed; VMs that died with nobody to clean up reaped.
pub fn prepare_job(job: &str) -> Result<(), StartError> {
    runtime::check_job_id(job).map_err(StartError::Job)?;
    let dir = runtime::job_dir(job);
    let in_dir = |source| StartError::Dir {
        path: dir.clone(),
        source,
    };
    runtime::ensure_runtime_dir().map_err(in_dir)?;
    // VMs that died with nobody to clean up: their sockets and locks go now.
    runtime::reap_all();
    if let Ok(identity) = runtime::read_identity(job) {
        if runtime::process_alive(identity.pid) {
            return Err(StartError::Running {
                job: job.to_owned(),
                pid: identity.pid,
            });
        }
    }
    // A new start of the job: the last one's tombstone and log go.
    let _ = std::fs::remove_file(runtime::tombstone_path(job));
    let _ = std::fs::remove_file(dir.join("vm.log"));
    runtime::create_private_dir(&dir).map_err(in_dir)
}

/// The most a spec may hold on the VM process's stdin (and its identity line on stdout).
const MAX_SPEC_BYTES: u64 = 64 << 20;

/// Starts the VM process; its identity.
fn start_detached(spec: &Spec) -> Result<Identity, StartError> {
    use std::os::unix::fs::OpenOptionsExt;
    let log_path = runtime::job_dir(&spec.job).join("vm.log");
    let log = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&log_path)
        .map_err(|source| StartError::Dir {
            path: log_path.clone(),
            source,
        })?;
    let mut child = std::process::Command::new(std::env::current_exe().map_err(StartError::Spawn)?)
        .arg(SUPERVISE_ARG)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(log)
        // Its own process group: a Ctrl-C meant for this terminal does not reach the VM.
        .process_group(0)
        .spawn()
        .map_err(StartError::Spawn)?;
    let line = match identity_line(&mut child, spec) {
        Ok(line) => line,
        Err(e) => {
            // Nothing is left running half started: the supervisor and the VM process it may
            // have started are its process group.
            if let Ok(group) = libc::pid_t::try_from(child.id()) {
                // SAFETY: kill has no memory effects; the group is our child's own (it is
                // not waited for yet, so its id is still its own).
                unsafe { libc::kill(-group, libc::SIGKILL) };
            }
            let _ = child.wait();
            return Err(StartError::Pipe(e));
        }
    };
    if let Ok(identity) = serde_json::from_str::<Identity>(&line) {
        return Ok(identity);
    }
    let status = child.wait().map_err(StartError::Pipe)?;
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    Err(StartError::NotStarted {
        status,
        log: log.trim().to_owned(),
    })
}

/// Hands `spec` to the supervisor `child` and reads the first line it prints.
fn identity_line(child: &mut std::process::Child, spec: &Spec) -> std::io::Result<String> {
    let no_pipe = || std::io::Error::other("the VM process has no stdin or stdout");
    let stdin = child.stdin.take().ok_or_else(no_pipe)?;
    send_spec(stdin, spec)?;
    let mut line = String::new();
    let stdout = child.stdout.take().ok_or_else(no_pipe)?;
    BufReader::new(stdout.take(MAX_SPEC_BYTES)).read_line(&mut line)?;
    Ok(line)
}

/// Writes the spec to a child's stdin and closes it.
fn send_spec(mut stdin: std::process::ChildStdin, spec: &Spec) -> std::io::Result<()> {
    stdin.write_all(&serde_json::to_vec(spec).map_err(std::io::Error::other)?)
}

/// Reads the spec from stdin (at most [`MAX_SPEC_BYTES`]).
fn receive_spec() -> Result<Spec, Box<dyn std::error::Error>> {
    let mut text = Vec::new();
    std::io::stdin()
        .lock()
        .take(MAX_SPEC_BYTES)
        .read_to_end(&mut text)?;
    Ok(serde_json::from_slice(&text)?)
}

/// The hidden [`SUPERVISE_ARG`] command: starts the VM process, hands it the spec, waits for
/// it, and if it did not end cleanly (killed, OOM, failed) leaves a tombstone in its job
/// directory and removes its socket, identity and stores.
pub fn supervise() -> ProcessResult {
    // The stop signals are the VM's to handle (it blocks them too); this process waits on.
    let mut signals = SigSet::empty();
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        signals.add(signal);
    }
    signals.thread_block()?;
    let mut spec = receive_spec()?;
    let mut command = std::process::Command::new(std::env::current_exe()?);
    command.arg(VM_ARG).stdin(Stdio::piped());
    // In its memory cgroup from its exec on, so that it is charged for all it holds; the VM
    // joins it again by its full path (a no-op), not under its own.
    if let Some(name) = &spec.options.cgroup {
        let cgroup = crate::stats::MemoryCgroup::create(name)?;
        cgroup.join_before_exec(&mut command)?;
        spec.options.cgroup = Some(cgroup.dir().to_path_buf());
    }
    let mut child = command.spawn().map_err(|e| match &spec.options.cgroup {
        Some(dir) => format!(
            "cannot start the VM process in memory cgroup {}: {e}",
            dir.display()
        ),
        None => format!("cannot start the VM process: {e}"),
    })?;
    let stdin = child.stdin.take().ok_or("the VM process has no stdin")?;
    send_spec(stdin, &spec)?;
    // The script may be large and is the VM's business now.
    spec.script = String::new();
    // Our stdout is the VM's now: let it go, so that the parent sees it end with the VM's.
    redirect_stdout_to("/dev/null".as_ref(), false)?;
    let pid = child.id();
    let status = child.wait()?;
    if status.success() {
        return Ok(ExitCode::SUCCESS);
    }
    // (Read before the files go: the identity names the cgroup.)
    let cgroup = runtime::read_identity(&spec.job)
        .ok()
        .and_then(|identity| identity.cgroup);
    let tombstone = runtime::Tombstone::of(&spec.job, pid, status, cgroup.as_deref());
    tracing::error!("pvisor: {}", tombstone.reason);
    if runtime::job_dir(&spec.job).is_dir() {
        // The tombstone first: whoever finds the identity gone finds the tombstone.
        runtime::write_tombstone(&tombstone)?;
        runtime::remove_vm_files(&spec.job);
        if spec.temporary_disk {
            let _ = std::fs::remove_file(&spec.options.disk);
        }
        if let Some(cgroup) = &cgroup {
            runtime::remove_cgroup(cgroup);
        }
    }
    Ok(ExitCode::FAILURE)
}

/// The hidden [`VM_ARG`] command: the detached VM process (its spec on stdin).
pub fn vm_process() -> ProcessResult {
    vm_main(receive_spec()?)
}

/// The VM process's body: boots the VM of `spec`, serves its control socket, runs its
/// script, and (detached, or a script ending in `idle`) stays up until stopped. The first
/// line on stdout is the VM's identity, then its script's results.
pub fn vm_main(spec: Spec) -> ProcessResult {
    // Only the signal thread below receives the stop signals.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    signals.thread_block()?;

    runtime::ensure_runtime_dir()?;
    let dir = runtime::job_dir(&spec.job);
    runtime::create_private_dir(&dir)?;
    let mut cleanup = Cleanup {
        dir: dir.clone(),
        disk: spec.temporary_disk.then(|| spec.options.disk.clone()),
        keep_log: true,
    };
    let mut vm = Vm::start(spec.options.clone())?;
    let started = Instant::now();
    let socket = runtime::socket_path(&spec.job);
    let (tx, rx) = mpsc::channel::<control::Job>();
    let who = control::Identity {
        job: spec.job.clone(),
        attempt: spec.attempt.clone(),
        // SAFETY: geteuid cannot fail.
        owner: unsafe { libc::geteuid() },
    };
    // A stop ends the running command at once instead of queueing behind it.
    let interrupter = vm.interrupter();
    let on_stop = {
        let interrupter = interrupter.clone();
        Arc::new(move || interrupter.stop())
    };
    let server = control::serve(&socket, who, tx.clone(), on_stop)?;
    let signal_tx = tx.clone();
    std::thread::Builder::new()
        .name("pvisor-signals".into())
        .spawn(move || {
            if signals.wait().is_ok() {
                interrupter.stop();
                let (reply, _ignored) = mpsc::channel();
                let _ = signal_tx.send((Method::Stop, reply));
            }
        })?;
    drop(tx);

    let identity = Identity {
        job: spec.job.clone(),
        socket,
        attempt: spec.attempt.clone(),
        pid: std::process::id(),
        // SAFETY: getppid cannot fail.
        supervisor: spec
            .detached
            .then(|| unsafe { libc::getppid() }.unsigned_abs()),
        cgroup: vm.cgroup_dir().map(std::path::Path::to_path_buf),
    };
    // The requests go to this loop between commands and to the machine during model waits.
    let rx = Arc::new(Mutex::new(rx));
    vm.set_operator(Box::new(DuringWait {
        rx: Arc::clone(&rx),
        identity: identity.clone(),
        started,
    }));
    std::fs::write(
        runtime::identity_path(&spec.job),
        serde_json::to_vec(&identity)?,
    )?;
    // The VM process: its reader going away is no reason to stop the VM.
    basics::announce!("{}", serde_json::to_string(&identity)?);
    if spec.detached {
        redirect_stdout_to(&dir.join("vm.log"), true)?;
    }

    let commands = script::parse(&spec.script)?;
    let mut failed = false;
    let receive = |timeout: Option<Duration>| {
        let rx = rx.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match timeout {
            Some(wait) => rx.recv_timeout(wait),
            None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
        }
    };
    if !commands.is_empty() {
        match vm.exec(&commands) {
            Ok(results) => basics::announce!("{}", serde_json::json!({ "results": results })),
            Err(e) => {
                basics::announce!("{}", serde_json::json!({ "error": error_chain(&e) }));
                failed = true;
            }
        }
    }
    let stay = spec.detached || commands.last() == Some(&Command::Idle);
    if stay && !failed && !vm.machine().stop_requested() {
        vm.between_commands();
        loop {
            // Between commands the memory pool and the KSM governor get their ticks.
            let next = receive(vm.background_wait());
            let (method, reply) = match next {
                Ok(job) => job,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    vm.background_tick();
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            };
            let stop = method == Method::Stop;
            let _ = reply.send(handle(&mut vm, &identity, started, method));
            // A stop can also come while a command waits for a model answer.
            if stop || vm.machine().stop_requested() {
                break;
            }
        }
    }
    let stopped = vm.machine().stop_requested();
    finish_requests(&rx, &server);
    drop(vm);
    // A stopped command is not a failure of the VM: its files go.
    cleanup.keep_log = failed && !stopped;
    drop(cleanup);
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// How long an exiting VM waits for the requests in flight to be answered.
const FINISH_REQUESTS: Duration = Duration::from_secs(2);

/// Answers what is queued and waits (a little) for the requests in flight: a `stop` gets its
/// reply, anything else is told the VM stopped.
fn finish_requests(rx: &Mutex<mpsc::Receiver<control::Job>>, server: &control::Listening) {
    let rx = rx.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let deadline = Instant::now() + FINISH_REQUESTS;
    loop {
        match rx.recv_timeout(Duration::from_millis(10)) {
            Ok((method, reply)) => {
                let _ = reply.send(if method == Method::Stop {
                    Ok(serde_json::json!({ "stopped": true }))
                } else {
                    Err("stopped: the VM is shutting down".into())
                });
            }
            Err(mpsc::RecvTimeoutError::Timeout) if server.in_flight() == 0 => return,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        if Instant::now() >= deadline {
            return;
        }
    }
}

/// The control socket's requests while a command waits for a model answer: those the machine
/// can answer then go to it; `exec` and `snapshot` are refused until the command is over.
struct DuringWait {
    rx: Arc<Mutex<mpsc::Receiver<control::Job>>>,
    identity: Identity,
    started: Instant,
}

impl Operator for DuringWait {
    fn next(&mut self, timeout: Duration) -> Option<(OperatorRequest, Reply)> {
        let (method, reply) = self
            .rx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .recv_timeout(timeout)
            .ok()?;
        let asked = match method {
            Method::Status => OperatorRequest::Status,
            Method::Stats => OperatorRequest::Stats,
            Method::Suspend {
                offload,
                ram_file: None,
            } => OperatorRequest::Suspend { offload },
            Method::Resume { eager } => OperatorRequest::Resume { eager },
            Method::Stop => OperatorRequest::Stop,
            Method::Suspend {
                ram_file: Some(_), ..
            } => {
                let _ = reply.send(Err(
                    "the VM is waiting for a model answer: it can be suspended and offloaded \
                     now, but --vm-ram-file only after the command is over"
                        .into(),
                ));
                return None;
            }
            Method::Exec { .. } | Method::Snapshot { .. } => {
                let _ = reply.send(Err(
                    "the VM is running a command that waits for a model answer: exec and \
                     snapshot can follow once it is over (status, stats, suspend, resume and \
                     stop work now)"
                        .into(),
                ));
                return None;
            }
        };
        // Status gets the identity that `status` always carries.
        let identity = (asked == OperatorRequest::Status).then(|| {
            serde_json::json!({
                "job": self.identity.job,
                "attempt": self.identity.attempt,
                "pid": self.identity.pid,
                "socket": self.identity.socket,
                "uptime_s": self.started.elapsed().as_secs_f64(),
            })
        });
        let reply: Reply = Box::new(move |result| {
            let result = result.map(|mut value| {
                if let (Some(extra), Some(object)) = (identity, value.as_object_mut()) {
                    for (key, v) in extra.as_object().into_iter().flatten() {
                        object.insert(key.clone(), v.clone());
                    }
                }
                value
            });
            let _ = reply.send(result);
        });
        Some((asked, reply))
    }
}

fn handle(
    vm: &mut Vm,
    identity: &Identity,
    started: Instant,
    method: Method,
) -> Result<serde_json::Value, String> {
    let json = |v: Result<serde_json::Value, serde_json::Error>| v.map_err(|e| e.to_string());
    match method {
        Method::Status => Ok(serde_json::json!({
            "job": identity.job,
            "attempt": identity.attempt,
            "pid": identity.pid,
            "socket": identity.socket,
            "state": vm.state(),
            "memory_bytes": vm.options().memory,
            "app_bytes": vm.machine().app_bytes(),
            "uptime_s": started.elapsed().as_secs_f64(),
        })),
        Method::Stats => json(serde_json::to_value(vm.stats())),
        Method::Exec { script } => {
            let commands = script::parse(&script).map_err(|e| e.to_string())?;
            let results = vm.exec(&commands).map_err(|e| error_chain(&e))?;
            Ok(serde_json::json!({ "results": results }))
        }
        Method::Suspend { offload, ram_file } => json(serde_json::to_value(
            vm.suspend(offload, ram_file.as_deref())
                .map_err(|e| error_chain(&e))?,
        )),
        Method::Resume { eager } => json(serde_json::to_value(
            vm.resume(eager).map_err(|e| error_chain(&e))?,
        )),
        Method::Snapshot {
            out,
            codec,
            block_size,
        } => {
            let store = snapshot_store(codec.as_deref(), block_size)?;
            json(serde_json::to_value(
                vm.snapshot(&out, store).map_err(|e| error_chain(&e))?,
            ))
        }
        Method::Stop => Ok(serde_json::json!({ "stopped": true })),
    }
}

/// The RAM store a `snapshot` request asks for: none without a codec (a raw image), else
/// the codec's blocks of `block_size` bytes (64 KiB if not given).
fn snapshot_store(
    codec: Option<&str>,
    block_size: Option<u64>,
) -> Result<Option<crate::snapshot::RamStore>, String> {
    let Some(codec) = codec else {
        return match block_size {
            Some(_) => Err("--block-size needs --codec: a raw snapshot has no blocks".into()),
            None => Ok(None),
        };
    };
    let codec = codec
        .parse::<compressed_backing::Codec>()
        .map_err(|e| format!("--codec: {e}"))?;
    let mut store = crate::snapshot::RamStore::new(compressed_backing::CodecConfig::new(codec));
    if let Some(bytes) = block_size {
        store.block_size =
            compressed_backing::BlockSize::new(bytes).map_err(|e| format!("--block-size: {e}"))?;
    }
    Ok(Some(store))
}

/// Sends everything printed from now on to `path` (the log: appended, created if `create`).
fn redirect_stdout_to(path: &std::path::Path, create: bool) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let log = std::fs::OpenOptions::new()
        .append(true)
        .create(create)
        .mode(0o600)
        .open(path)?;
    // SAFETY: dup2 onto our own stdout; both descriptors are valid.
    if unsafe { libc::dup2(log.as_raw_fd(), libc::STDOUT_FILENO) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Removes the VM's runtime files when the VM process ends.
struct Cleanup {
    dir: PathBuf,
    disk: Option<PathBuf>,
    /// Keep a detached VM's log (and so its directory) when it failed.
    keep_log: bool,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(disk) = &self.disk {
            let _ = std::fs::remove_file(disk);
        }
        for name in ["control.sock", "vm.json", "ram"] {
            let path = self.dir.join(name);
            let _ = std::fs::remove_file(&path);
            let _ = std::fs::remove_dir_all(&path);
        }
        if !self.keep_log {
            let _ = std::fs::remove_file(self.dir.join("vm.log"));
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detached_spec_in_job_dir_keeps_the_vm_files_in_its_job_directory() {
        let spec = Spec::in_job_dir("sb-0123456789ab", 256 << 20);
        let dir = runtime::job_dir("sb-0123456789ab");
        assert_eq!(spec.options.disk, dir.join("disk.img"));
        assert_eq!(spec.options.store_dir, dir.join("ram"));
        assert_eq!(spec.options.memory, 256 << 20);
        assert!(spec.detached && spec.temporary_disk && spec.options.exit_on_memory_lost);
        assert!(spec.script.is_empty());
        assert_ne!(spec.attempt, Spec::in_job_dir("sb-0123456789ab", 1).attempt);
    }

    #[test]
    fn detached_start_refuses_a_job_id_that_is_no_plain_name() {
        for job in ["../escape", "", ".hidden", "a/b"] {
            let mut spec = Spec::in_job_dir("vm-x", 1 << 20);
            spec.job = job.to_owned();
            assert!(
                matches!(start(&spec), Err(StartError::Job(_))),
                "{job:?} was not refused"
            );
        }
    }
}
