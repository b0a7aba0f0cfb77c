//! What a replay undoes however it ends (its end, an error, SIGTERM, SIGINT): its VMs stopped,
//! the governor it started stopped, their cgroups and the replay's own removed; and what it
//! asks of its VMs on the way (a control call, whether the kernel OOM-killed one).

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command as Process, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, Signal};

use vmm::control::{self, Method};
use vmm::runtime::{self, Identity};
use vmm::stats::MemoryCgroup;

/// How long stopped VMs get to end by themselves before they are sent SIGTERM, and then
/// SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
const TERM_GRACE: Duration = Duration::from_secs(5);

pub(super) fn call(
    id: &Identity,
    method: Method,
) -> Result<serde_json::Value, control::ClientError> {
    control::call(&id.socket, &id.job, &id.attempt, method)
}

/// Waits until none of `pids` runs, at most `timeout`; returns those still running.
pub(super) fn wait_gone(pids: &[u32], timeout: Duration) -> Vec<u32> {
    let deadline = Instant::now() + timeout;
    loop {
        // (A zombie has left its cgroup already.)
        let left: Vec<u32> = pids
            .iter()
            .copied()
            .filter(|&pid| runtime::process_alive(pid))
            .collect();
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How long a VM that failed gets for its supervisor's tombstone to appear.
const TOMBSTONE_WAIT: Duration = Duration::from_secs(5);

/// How many times the kernel's OOM killer killed in `vm`'s cgroup: its counter while the
/// cgroup is there; for a VM that `failed`, or whose cgroup is gone (killed after its script
/// ended), what its tombstone says (its supervisor reads the counter, then removes the
/// cgroup).
pub(super) fn oom_kills_of(vm: &Identity, cgroup: Option<&std::path::Path>, failed: bool) -> u64 {
    let counter = cgroup.and_then(|dir| MemoryCgroup::at(dir).oom_kills());
    if counter.is_some_and(|n| n > 0) || (!failed && counter.is_some()) {
        return counter.unwrap_or(0);
    }
    let deadline = Instant::now() + TOMBSTONE_WAIT;
    loop {
        if let Some(tombstone) = runtime::read_tombstone(&vm.job) {
            return tombstone
                .oom_kills
                .unwrap_or_else(|| u64::from(tombstone.oom_kill));
        }
        if runtime::process_alive(vm.pid) || Instant::now() >= deadline {
            return counter.unwrap_or(0);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What a replay started and undoes however it ends (its end, an error, SIGTERM, SIGINT):
/// its VMs stopped, their cgroups and the replay's own (their parent) removed. Undone once;
/// shared with the signal thread.
#[derive(Debug, Default)]
pub(super) struct Teardown {
    state: Mutex<Started>,
}

#[derive(Debug, Default)]
pub(super) struct Started {
    pub(super) vms: Vec<Identity>,
    /// The VMs' cgroup directories, then the replay's own (their parent): the paths they are
    /// given, whether or not a VM got as far as creating its own.
    pub(super) cgroups: Vec<PathBuf>,
    /// The memory governor of a `governed` replay.
    pub(super) governor: Option<std::process::Child>,
    /// Torn down: nothing more may start.
    pub(super) done: bool,
}

impl Teardown {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Started> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts a VM with `start` unless the replay is being torn down; the lock is held while
    /// it starts, so that a teardown meanwhile waits for it and stops it too.
    pub(super) fn start_vm(
        &self,
        start: impl FnOnce() -> Result<Identity, Box<dyn std::error::Error>>,
    ) -> Result<Identity, Box<dyn std::error::Error>> {
        let mut state = self.lock();
        if state.done {
            return Err("the replay is stopping".into());
        }
        let identity = start()?;
        state.vms.push(identity.clone());
        Ok(identity)
    }

    /// Stops every VM (through its control socket, then SIGTERM, then SIGKILL for one that
    /// does not end) and removes the cgroups once their processes are gone.
    pub(super) fn run(&self) {
        let mut state = self.lock();
        if state.done {
            return;
        }
        state.done = true;
        for vm in &state.vms {
            // A VM in the middle of a command answers when it ends (or never): do not wait.
            let vm = vm.clone();
            let _ = std::thread::Builder::new()
                .name("replay-stop".into())
                .spawn(move || {
                    let _ = call(&vm, Method::Stop);
                });
        }
        let pids: Vec<u32> = state.vms.iter().map(|vm| vm.pid).collect();
        let mut left = wait_gone(&pids, STOP_GRACE);
        for signal in [libc::SIGTERM, libc::SIGKILL] {
            if left.is_empty() {
                break;
            }
            for &pid in &left {
                if let Ok(pid) = libc::pid_t::try_from(pid) {
                    // SAFETY: kill(2) sends a signal; no memory is involved.
                    unsafe { libc::kill(pid, signal) };
                }
            }
            left = wait_gone(&left, TERM_GRACE);
        }
        if let Some(mut governor) = state.governor.take() {
            // After the VMs: none of them may be left waiting on it.
            if let Ok(pid) = libc::pid_t::try_from(governor.id()) {
                // SAFETY: kill(2) sends a signal to our own child; no memory is involved.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
            let deadline = Instant::now() + TERM_GRACE;
            while governor.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = governor.kill();
            let _ = governor.wait();
        }
        for dir in &state.cgroups {
            // A cgroup whose last process has just left may be busy for a moment.
            for _ in 0..50 {
                match std::fs::remove_dir(dir) {
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    _ => break,
                }
            }
        }
    }
}

impl Teardown {
    /// Starts the replay's memory governor (`pvisor serve --memory-governor`) over `budget`,
    /// reading the replay's cgroup; returns its socket once it listens. The teardown stops it.
    pub(super) fn start_governor(
        &self,
        run: &str,
        budget: u64,
        parent: &std::path::Path,
        signals: SigSet,
        log: Option<&std::path::Path>,
        options: &[String],
    ) -> Result<PathBuf, Box<dyn std::error::Error>> {
        let socket = runtime::runtime_dir().join(format!("{run}-governor.sock"));
        let mut command = Process::new(std::env::current_exe()?);
        command
            .args(["serve", "--memory-governor", "--memory-budget"])
            .arg(budget.to_string())
            .arg("--socket")
            .arg(&socket)
            .args(options);
        if let Ok((base, _)) = MemoryCgroup::own_base() {
            command
                .arg("--budget-cgroup")
                .arg(base.join(parent).join(run));
        }
        let stderr = match log {
            Some(path) => Stdio::from(
                std::fs::File::create(path)
                    .map_err(|e| format!("--governor-log {}: {e}", path.display()))?,
            ),
            None => Stdio::null(),
        };
        command.stdout(Stdio::piped()).stderr(stderr);
        // SAFETY: between fork and exec the child only changes its own signal mask
        // (pthread_sigmask is async-signal-safe): it takes SIGTERM as its stop.
        unsafe {
            command.pre_exec(move || signals.thread_unblock().map_err(std::io::Error::from));
        }
        let mut state = self.lock();
        if state.done {
            return Err("the replay is stopping".into());
        }
        let mut child = command.spawn()?;
        let stdout = child.stdout.take();
        state.governor = Some(child);
        drop(state);
        // The governor prints its socket once it listens (or exits on a bad option).
        let mut line = String::new();
        if let Some(stdout) = stdout {
            use std::io::BufRead;
            let _ = std::io::BufReader::new(stdout).read_line(&mut line);
        }
        if line.trim().is_empty() {
            return Err(
                "the memory governor did not start (run with --governor-log FILE to see why)"
                    .into(),
            );
        }
        Ok(socket)
    }
}

/// Blocks SIGINT and SIGTERM in this thread (and so in every thread it starts afterwards) and
/// starts the thread that takes them: it tears the replay down and exits as the signal
/// would have. Returns the signals, for children to unblock.
pub(super) fn watch_signals(
    teardown: &Arc<Teardown>,
) -> Result<SigSet, Box<dyn std::error::Error>> {
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    signals.thread_block()?;
    let teardown = Arc::clone(teardown);
    std::thread::Builder::new()
        .name("replay-signals".into())
        .spawn(move || {
            if let Ok(signal) = signals.wait() {
                eprintln!("pvisor replay: {signal}: stopping the VMs");
                teardown.run();
                std::process::exit(128 + signal as i32);
            }
        })?;
    Ok(signals)
}
