//! `pvisor run` and the VM process: boot, serve the control socket, run the script, and
//! stay up (for `--detach` or a script ending in `idle`) until stopped.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, Signal};
use vmm::control::{self, Method};
use vmm::operator::{Operator, OperatorRequest, Reply};
use vmm::runtime::{self, Identity};
use vmm::script::{self, Command};
use vmm::vm::{Vm, VmOptions};

use crate::options::{self, RunArgs};
use crate::CliResult;

/// Everything the VM process needs.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Spec {
    job: String,
    attempt: String,
    options: VmOptions,
    script: String,
    detached: bool,
    /// The disk was made for this VM and goes with it.
    temporary_disk: bool,
}

pub fn run(args: RunArgs) -> CliResult {
    let resolved = options::resolve(&args)?;
    let script = args.script.join(" ");
    script::parse(&script)?;
    let job = match &args.job {
        Some(job) => job.clone(),
        None => runtime::new_id("vm-"),
    };
    runtime::check_job_id(&job)?;
    runtime::ensure_runtime_dir()?;
    // VMs that died with nobody to clean up: their sockets and locks go now.
    runtime::reap_all();
    if let Ok(identity) = runtime::read_identity(&job) {
        if runtime::process_alive(identity.pid) {
            return Err(format!("job `{job}` is already running (pid {})", identity.pid).into());
        }
    }
    let dir = runtime::job_dir(&job);
    // A new start of the job: the last one's tombstone and log go.
    let _ = std::fs::remove_file(runtime::tombstone_path(&job));
    let _ = std::fs::remove_file(dir.join("vm.log"));
    runtime::create_private_dir(&dir)?;
    let spec = Spec {
        attempt: runtime::new_id(""),
        options: VmOptions {
            memory: resolved.memory,
            vcpus: resolved.vcpus,
            ram_backing: resolved.ram_backing,
            ram_compression: resolved.ram_compression,
            ram_codec: resolved.ram_codec,
            offload_durability: resolved.offload_durability,
            direct_reads: resolved.direct_reads,
            disk: resolved
                .disk
                .clone()
                .unwrap_or_else(|| dir.join("disk.img")),
            store_dir: dir.join("ram"),
            cgroup: resolved.cgroup,
            pager_threads: resolved.pager_threads,
            io_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            cold: resolved.cold,
            dedup: resolved.dedup,
            thp_collapse: resolved.thp_collapse,
            arena_offload: resolved.arena_offload,
            arenas: resolved.arenas,
            exit_on_memory_lost: true,
            restore: resolved.restore.clone(),
            restore_remote: resolved.restore_remote.clone(),
            pool: resolved.pool.clone(),
            model_upstream: resolved.model_upstream.clone(),
            wait: resolved.wait,
            governor: resolved
                .governor
                .clone()
                .map(|socket| vmm::vm::GovernorOptions {
                    socket,
                    name: job.clone(),
                    hold_timeout_ms: resolved.governor_hold_timeout_ms,
                }),
        },
        temporary_disk: resolved.disk.is_none(),
        job,
        script,
        detached: args.detach,
    };
    if args.detach {
        detach(&spec)
    } else {
        vm_main(spec)
    }
}

/// The most a spec may hold on the VM process's stdin.
const MAX_SPEC_BYTES: u64 = 64 << 20;

/// Starts the VM process in the background (under its supervisor) and passes on its
/// identity line. The spec goes through a pipe, not the command line: it may be large, and
/// the attempt id in it is not for other users to read in `/proc/PID/cmdline`. A start that
/// fails leaves no job directory.
fn detach(spec: &Spec) -> CliResult {
    match start_detached(spec) {
        Ok(identity) => {
            // The VM has started: it runs on whether anyone reads this or not.
            basics::say!("{identity}");
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(runtime::job_dir(&spec.job));
            Err(e)
        }
    }
}

/// Starts the VM process; its identity line.
fn start_detached(spec: &Spec) -> Result<String, Box<dyn std::error::Error>> {
    use std::os::unix::fs::OpenOptionsExt;
    let log_path = runtime::job_dir(&spec.job).join("vm.log");
    let log = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&log_path)?;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .arg("__supervise")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(log)
        // Its own process group: a Ctrl-C meant for this terminal does not reach the VM.
        .process_group(0)
        .spawn()?;
    let stdin = child.stdin.take().ok_or("the VM process has no stdin")?;
    send_spec(stdin, spec)?;
    let mut line = String::new();
    let stdout = child.stdout.take().ok_or("the VM process has no stdout")?;
    BufReader::new(stdout.take(MAX_SPEC_BYTES)).read_line(&mut line)?;
    if serde_json::from_str::<Identity>(&line).is_ok() {
        return Ok(line.trim_end().to_owned());
    }
    let status = child.wait()?;
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    Err(format!("the VM did not start ({status}): {}", log.trim()).into())
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

/// The hidden `__supervise` command: starts the VM process, hands it the spec, waits for
/// it, and if it did not end cleanly (killed, OOM, failed) leaves a tombstone in its job
/// directory and removes its socket, identity and stores.
pub fn supervise() -> CliResult {
    // The stop signals are the VM's to handle (it blocks them too); this process waits on.
    let mut signals = SigSet::empty();
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        signals.add(signal);
    }
    signals.thread_block()?;
    let mut spec = receive_spec()?;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .arg("__vm")
        .stdin(Stdio::piped())
        .spawn()?;
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
    eprintln!("pvisor: {}", tombstone.reason);
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

/// The hidden `__vm` command: the detached VM process (its spec on stdin).
pub fn vm_process() -> CliResult {
    vm_main(receive_spec()?)
}

fn vm_main(spec: Spec) -> CliResult {
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
                basics::announce!("{}", serde_json::json!({ "error": crate::error_chain(&e) }));
                failed = true;
            }
        }
    }
    let stay = spec.detached || commands.last() == Some(&Command::Idle);
    if stay && !failed && !vm.machine().stop_requested() {
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
            let results = vm.exec(&commands).map_err(|e| crate::error_chain(&e))?;
            Ok(serde_json::json!({ "results": results }))
        }
        Method::Suspend { offload, ram_file } => json(serde_json::to_value(
            vm.suspend(offload, ram_file.as_deref())
                .map_err(|e| crate::error_chain(&e))?,
        )),
        Method::Resume { eager } => json(serde_json::to_value(
            vm.resume(eager).map_err(|e| crate::error_chain(&e))?,
        )),
        Method::Snapshot {
            out,
            codec,
            block_size,
        } => {
            let store = snapshot_store(codec.as_deref(), block_size)?;
            json(serde_json::to_value(
                vm.snapshot(&out, store)
                    .map_err(|e| crate::error_chain(&e))?,
            ))
        }
        Method::Stop => Ok(serde_json::json!({ "stopped": true })),
    }
}

/// Sends everything printed from now on to `path` (the log: appended, created if `create`).
/// The RAM store a `snapshot` request asks for: none without a codec (a raw image), else
/// the codec's blocks of `block_size` bytes (64 KiB if not given).
fn snapshot_store(
    codec: Option<&str>,
    block_size: Option<u64>,
) -> Result<Option<vmm::snapshot::RamStore>, String> {
    let Some(codec) = codec else {
        return match block_size {
            Some(_) => Err("--block-size needs --codec: a raw snapshot has no blocks".into()),
            None => Ok(None),
        };
    };
    let codec = codec
        .parse::<compressed_backing::Codec>()
        .map_err(|e| format!("--codec: {e}"))?;
    let mut store = vmm::snapshot::RamStore::new(compressed_backing::CodecConfig::new(codec));
    if let Some(bytes) = block_size {
        store.block_size =
            compressed_backing::BlockSize::new(bytes).map_err(|e| format!("--block-size: {e}"))?;
    }
    Ok(Some(store))
}

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
