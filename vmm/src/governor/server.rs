//! `pvisor serve --memory-governor`: the daemon that keeps a host's agent VMs inside one memory
//! budget. It listens on a 0600 Unix socket ([`uffd_pager::socket::bind_private`]), lets in the
//! processes its [`PeerPolicy`] allows, reads each VM's memory cgroup (found from the peer's
//! pid, never from what the VM says) with each of the VM's readings, and the budget cgroup's
//! usage and failures and the kernel's pressure (`/proc/pressure/memory`) every tick, hands
//! all of it to the [`Governor`], and
//! sends its decisions to the VMs. Every decision is logged on stderr with its reason.

use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use uffd_pager::socket::{PeerCred, PeerPolicy};

use super::policy::{self, Decision, Governor, Pressure, Reading, VmId, VmState};
use super::protocol::{self, FromGovernor, LineError, LineReader, ToGovernor, WireState};
use crate::stats::{parse_psi_some_avg10, MemoryCgroup, PressureLevel};
use basics::RateLimit;

/// Most connections at once (VMs and status clients); more are refused with a message.
pub const MAX_CONNECTIONS: usize = 512;
/// How long a new connection has for its first line.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);
/// How long a write to a VM may block before the VM is dropped (it does not read).
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// How often blocked reads and the accept loop look at the stop flag.
const POLL: Duration = Duration::from_millis(100);
/// Longest VM name.
const MAX_NAME: usize = 128;

/// Errors of the governor daemon.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The configuration cannot work.
    #[error("invalid governor configuration: {0}")]
    Config(String),
    /// The socket could not be bound.
    #[error("cannot listen on {path}")]
    Bind {
        /// The socket.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// Something else of the system failed.
    #[error("{op}")]
    System {
        /// What was being done.
        op: &'static str,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
}

/// How to run the governor.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The policy's knobs (the budget among them).
    pub policy: policy::Config,
    /// How often cgroups and pressure are read and the policy ticks.
    pub tick: Duration,
    /// The cgroup all governed VMs live under, if there is one: its usage is the measured
    /// total and its failures a pressure signal.
    pub budget_cgroup: Option<PathBuf>,
    /// Who may connect besides the governor's own uid.
    pub peers: PeerPolicy,
    /// The kernel's memory pressure notifications of the budget cgroup (v1) taken as pressure
    /// from this level up.
    pub pressure_level: PressureLevel,
}

/// One VM's connection.
struct Conn {
    name: String,
    writer: UnixStream,
}

struct State {
    governor: Governor,
    conns: HashMap<VmId, Conn>,
}

struct Inner {
    state: Mutex<State>,
    config: ServerConfig,
    peers: PeerPolicy,
    started: Instant,
    connections: AtomicU64,
    refused: AtomicU64,
    protocol_errors: AtomicU64,
    /// The log of what any local peer can cause (a refused connection, a protocol error).
    peer_log: RateLimit,
}

/// The governor, bound to its socket.
#[allow(
    missing_debug_implementations,
    reason = "its state is shown by `status`"
)]
pub struct GovernorServer {
    listener: UnixListener,
    inner: Arc<Inner>,
    path: PathBuf,
}

impl GovernorServer {
    /// Checks `config` and binds `socket` (mode 0600; a stale socket is replaced, a live one
    /// refused).
    pub fn bind(socket: &Path, config: ServerConfig) -> Result<Self, ServerError> {
        config.policy.check().map_err(ServerError::Config)?;
        if config.tick.is_zero() || config.tick > Duration::from_secs(10) {
            return Err(ServerError::Config(format!(
                "tick {:?}: 1 ms to 10 s",
                config.tick
            )));
        }
        if let Some(dir) = &config.budget_cgroup {
            MemoryCgroup::at(dir).unreclaimable().map_err(|e| {
                ServerError::Config(format!(
                    "budget cgroup {}: no readable memory usage: {e}",
                    dir.display()
                ))
            })?;
        }
        let listener =
            uffd_pager::socket::bind_private(socket).map_err(|source| ServerError::Bind {
                path: socket.to_path_buf(),
                source,
            })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| ServerError::System {
                op: "make the socket non-blocking",
                source,
            })?;
        Ok(Self {
            listener,
            path: socket.to_path_buf(),
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    governor: Governor::new(config.policy.clone()),
                    conns: HashMap::new(),
                }),
                peers: config.peers.clone(),
                config,
                started: Instant::now(),
                connections: AtomicU64::new(0),
                refused: AtomicU64::new(0),
                protocol_errors: AtomicU64::new(0),
                peer_log: RateLimit::new(10, Duration::from_secs(1)),
            }),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serves until `stop`: accepts VMs, ticks, and closes every connection at the end (the
    /// VMs' links then lift their limits and go on by themselves).
    pub fn run(&self, stop: &AtomicBool) {
        std::thread::scope(|scope| {
            scope.spawn(|| self.tick_loop(stop));
            while !stop.load(Ordering::Relaxed) {
                match self.listener.accept() {
                    Ok((stream, _)) => self.admit(scope, stream, stop),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => {
                        tracing::warn!("pvisor governor: accept: {e}");
                        std::thread::sleep(POLL);
                    }
                }
            }
            // The connection threads see the flag within a poll period.
            for conn in self.inner.lock().conns.values() {
                let _ = conn.writer.shutdown(std::net::Shutdown::Both);
            }
        });
    }

    fn admit<'s>(
        &'s self,
        scope: &'s std::thread::Scope<'s, '_>,
        stream: UnixStream,
        stop: &'s AtomicBool,
    ) {
        let inner = &self.inner;
        let peer = match inner.peers.check(&stream) {
            Ok(peer) => peer,
            Err(e) => {
                inner.refused.fetch_add(1, Ordering::Relaxed);
                // Closed without a word: another user learns nothing from the governor.
                if inner.peer_log.allow() {
                    tracing::warn!("pvisor governor: refused a connection: {e}");
                }
                return;
            }
        };
        let live = inner.connections.fetch_add(1, Ordering::Relaxed);
        if live >= MAX_CONNECTIONS as u64 {
            inner.connections.fetch_sub(1, Ordering::Relaxed);
            inner.refused.fetch_add(1, Ordering::Relaxed);
            refuse(
                &stream,
                &format!("the governor serves at most {MAX_CONNECTIONS} connections"),
            );
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("governor-conn".into())
            .spawn_scoped(scope, move || {
                inner.serve(stream, peer, stop);
                inner.connections.fetch_sub(1, Ordering::Relaxed);
            });
        if spawned.is_err() {
            inner.connections.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Every `tick`: the budget cgroup and pressure read, the policy ticked. (Each VM's own
    /// cgroup is read with its reading, by its connection's thread.)
    fn tick_loop(&self, stop: &AtomicBool) {
        let inner = &self.inner;
        let budget = inner.config.budget_cgroup.as_deref().map(MemoryCgroup::at);
        // v1: the kernel's notifications; v2 has the cgroup's own PSI instead (read below).
        let notifications =
            budget
                .as_ref()
                .and_then(|c| match c.pressure_events(inner.config.pressure_level) {
                    Ok(events) => Some(events),
                    Err(e) if e.kind() == std::io::ErrorKind::Unsupported => None,
                    Err(e) => {
                        tracing::warn!(
                            "pvisor governor: no memory pressure notifications ({e}); PSI and \
                         failcnt still count"
                        );
                        None
                    }
                });
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(inner.config.tick);
            let pressure = Pressure {
                total_usage: budget.as_ref().and_then(|c| c.unreclaimable().ok()),
                psi_some_avg10: budget
                    .as_ref()
                    .and_then(MemoryCgroup::psi_some_avg10)
                    .or_else(memory_psi_some_avg10),
                failcnt: budget.as_ref().and_then(MemoryCgroup::failcnt),
                notifications: notifications
                    .as_ref()
                    .and_then(|n| n.take().ok())
                    .unwrap_or(0),
            };
            let mut state = inner.lock();
            let decisions = state.governor.tick(Instant::now(), pressure);
            inner.dispatch(&mut state, decisions);
        }
    }

    /// The governor's status (what `pvisor governor-status` prints).
    pub fn status(&self) -> serde_json::Value {
        self.inner.status()
    }

    /// The policy's status, typed, for a program that runs the governor in its own process.
    pub fn policy_status(&self) -> policy::Status {
        self.inner.lock().governor.status(Instant::now())
    }
}

fn refuse(stream: &UnixStream, message: &str) {
    let _ = stream.set_write_timeout(Some(Duration::from_millis(200)));
    let _ = (&*stream).write_all(&protocol::line(&FromGovernor::Error {
        message: message.to_string(),
    }));
}

/// `some avg10` of the system's memory pressure (`/proc/pressure/memory`), percent.
fn memory_psi_some_avg10() -> Option<f64> {
    parse_psi_some_avg10(&std::fs::read_to_string("/proc/pressure/memory").ok()?)
}

/// A VM name as a log line may show it: short, printable, no spaces.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(format!("a VM name is 1 to {MAX_NAME} bytes"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
    {
        return Err("a VM name holds only letters, digits and -_.:".into());
    }
    Ok(())
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn status(&self) -> serde_json::Value {
        self.status_of(&self.lock())
    }

    fn status_of(&self, state: &State) -> serde_json::Value {
        let mut status =
            serde_json::to_value(state.governor.status(Instant::now())).unwrap_or_default();
        if let Some(map) = status.as_object_mut() {
            map.insert(
                "uptime_s".into(),
                self.started.elapsed().as_secs_f64().into(),
            );
            map.insert("connections".into(), state.conns.len().into());
            map.insert(
                "refused_connections".into(),
                self.refused.load(Ordering::Relaxed).into(),
            );
            map.insert(
                "protocol_errors".into(),
                self.protocol_errors.load(Ordering::Relaxed).into(),
            );
        }
        status
    }

    /// One connection, from its first line to its end.
    fn serve(&self, stream: UnixStream, peer: PeerCred, stop: &AtomicBool) {
        let Ok(writer) = stream.try_clone() else {
            return;
        };
        let _ = writer.set_write_timeout(Some(WRITE_TIMEOUT));
        let _ = stream.set_read_timeout(Some(POLL));
        let mut input = BufReader::new(stream);
        let mut lines = LineReader::default();
        let deadline = Instant::now() + HELLO_DEADLINE;
        let first = loop {
            match lines.next::<ToGovernor>(&mut input) {
                Ok(message) => break message,
                Err(LineError::Timeout)
                    if Instant::now() < deadline && !stop.load(Ordering::Relaxed) => {}
                Err(e) => {
                    self.protocol_error(&writer, &format!("before its hello: {e}"));
                    return;
                }
            }
        };
        let (name, memory_bytes, resident_bytes) = match first {
            ToGovernor::Status => {
                let _ = (&writer).write_all(&protocol::line(&FromGovernor::Status(self.status())));
                return;
            }
            ToGovernor::Hello {
                name,
                memory_bytes,
                resident_bytes,
            } => (name, memory_bytes, resident_bytes),
            other => {
                self.protocol_error(
                    &writer,
                    &format!("a first line that is not hello: {other:?}"),
                );
                return;
            }
        };
        if let Err(e) = check_name(&name) {
            self.protocol_error(&writer, &e);
            return;
        }
        // The VM's cgroup from its pid: a VM cannot point the governor at another's.
        // Only a cgroup of its own says what the VM uses: a VM started without one shares
        // its launcher's (a shell's, a whole service's), which would be charged to it.
        let cgroup = u32::try_from(peer.pid).ok().and_then(|pid| {
            let cgroup = MemoryCgroup::of_process(pid).ok()?;
            let procs = std::fs::read_to_string(cgroup.dir().join("cgroup.procs")).ok()?;
            let pid_text = pid.to_string();
            procs
                .lines()
                .all(|line| line.trim() == pid_text)
                .then_some(cgroup)
        });
        // The last usage read: what a reading goes with if its own read fails.
        let mut cgroup_usage = cgroup.as_ref().and_then(|c| c.unreclaimable().ok());
        // The last guest PSS the VM sent (it sends one every few readings).
        let mut guest_pss = None;
        let id = {
            let mut state = self.lock();
            let (id, decisions) = state.governor.join(
                Instant::now(),
                name.clone(),
                memory_bytes,
                Reading {
                    resident: resident_bytes,
                    cgroup: cgroup_usage,
                    pss: None,
                    held: 0,
                },
            );
            let welcome = protocol::line(&FromGovernor::Welcome {
                vm: id,
                budget_bytes: self.config.policy.budget,
            });
            if (&writer).write_all(&welcome).is_err() {
                state.governor.leave(id);
                return;
            }
            state.conns.insert(
                id,
                Conn {
                    name: name.clone(),
                    writer,
                },
            );
            tracing::info!(
                "pvisor governor: {name} joined (pid {}, {} of guest RAM, {} resident)",
                peer.pid,
                basics::size_text(memory_bytes),
                basics::size_text(resident_bytes)
            );
            self.dispatch(&mut state, decisions);
            id
        };
        let why = loop {
            if stop.load(Ordering::Relaxed) {
                break "the governor is stopping".to_string();
            }
            let message = match lines.next::<ToGovernor>(&mut input) {
                Ok(message) => message,
                Err(LineError::Timeout) => continue,
                Err(LineError::Closed) => break "it closed the connection".to_string(),
                Err(e) => {
                    self.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    break format!("protocol error: {e}");
                }
            };
            // (Read before the lock: a slow cgroup file holds no other VM up.)
            let fresh = matches!(message, ToGovernor::Reading { .. })
                .then(|| cgroup.as_ref().and_then(|c| c.unreclaimable().ok()))
                .flatten();
            let now = Instant::now();
            let mut state = self.lock();
            let decisions = match message {
                ToGovernor::State {
                    state: wire,
                    expected_remaining_ms,
                } => {
                    let vm_state = match wire {
                        WireState::Running => VmState::Running,
                        WireState::Idle => VmState::Idle,
                        WireState::Offloaded => VmState::Offloaded,
                        WireState::Waiting => VmState::Waiting {
                            expected_remaining: expected_remaining_ms.map(Duration::from_millis),
                        },
                    };
                    state.governor.state(now, id, vm_state)
                }
                ToGovernor::Reading {
                    resident_bytes,
                    held_bytes,
                    guest_pss_bytes,
                } => {
                    // Read with the VM's figure, not a tick earlier: a VM that is filling
                    // memory would otherwise show its resident ahead of its cgroup, and its
                    // overhead (the difference) as nothing.
                    cgroup_usage = fresh.or(cgroup_usage);
                    guest_pss = guest_pss_bytes.or(guest_pss);
                    state.governor.reading(
                        now,
                        id,
                        Reading {
                            resident: resident_bytes,
                            cgroup: cgroup_usage,
                            pss: guest_pss,
                            held: held_bytes,
                        },
                    );
                    Vec::new()
                }
                ToGovernor::Request { bytes } => state.governor.request(now, id, bytes),
                ToGovernor::Offloaded { ok, resident_bytes } => {
                    state.governor.offloaded(now, id, resident_bytes, ok)
                }
                ToGovernor::Status => {
                    let status = protocol::line(&FromGovernor::Status(self.status_of(&state)));
                    if let Some(conn) = state.conns.get(&id) {
                        let _ = (&conn.writer).write_all(&status);
                    }
                    Vec::new()
                }
                ToGovernor::Hello { .. } => {
                    self.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    break "a second hello".to_string();
                }
            };
            self.dispatch(&mut state, decisions);
        };
        let mut state = self.lock();
        state.governor.leave(id);
        if let Some(conn) = state.conns.remove(&id) {
            let _ = conn.writer.shutdown(std::net::Shutdown::Both);
        }
        tracing::info!("pvisor governor: {name} left: {why}");
    }

    fn protocol_error(&self, writer: &UnixStream, why: &str) {
        self.protocol_errors.fetch_add(1, Ordering::Relaxed);
        if self.peer_log.allow() {
            tracing::warn!("pvisor governor: dropped a connection: {why}");
        }
        refuse(writer, why);
    }

    /// Sends each decision to its VM (and logs it); a VM that cannot be written to is
    /// disconnected, which its connection thread turns into a leave.
    fn dispatch(&self, state: &mut State, decisions: Vec<Decision>) {
        for decision in decisions {
            let (vm, message) = match &decision {
                Decision::SetLimit { vm, limit, reason } => (
                    *vm,
                    FromGovernor::SetLimit {
                        bytes: *limit,
                        reason: reason.to_string(),
                    },
                ),
                Decision::Offload { vm, reason } => (
                    *vm,
                    FromGovernor::Offload {
                        reason: reason.to_string(),
                    },
                ),
                Decision::ColdCompress { vm, age, reason } => (
                    *vm,
                    FromGovernor::ColdCompress {
                        age_ms: u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
                        reason: reason.to_string(),
                    },
                ),
            };
            let Some(conn) = state.conns.get(&vm) else {
                continue;
            };
            tracing::info!(
                "pvisor governor: +{:.3}s {}: {}",
                self.started.elapsed().as_secs_f64(),
                conn.name,
                describe(&message)
            );
            if (&conn.writer).write_all(&protocol::line(&message)).is_err() {
                let _ = conn.writer.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

/// A decision as its log line says it.
fn describe(message: &FromGovernor) -> String {
    match message {
        FromGovernor::SetLimit { bytes, reason } => {
            format!("limit {} ({reason})", basics::size_text(*bytes))
        }
        FromGovernor::Unlimit { reason } => format!("no limit ({reason})"),
        FromGovernor::Offload { reason } => format!("offload ({reason})"),
        FromGovernor::ColdCompress { age_ms, reason } => {
            format!("compress RAM cold for {age_ms} ms ({reason})")
        }
        other => format!("{other:?}"),
    }
}

/// Runs the governor on `socket` until SIGINT or SIGTERM (what `pvisor serve
/// --memory-governor` does): prints the socket's path once it listens, removes it at the end.
pub fn run_daemon(socket: &Path, config: ServerConfig) -> Result<(), ServerError> {
    use nix::sys::signal::{SigSet, Signal};
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    signals.thread_block().map_err(|e| ServerError::System {
        op: "block SIGINT and SIGTERM",
        source: e.into(),
    })?;
    let server = GovernorServer::bind(socket, config)?;
    uffd_pager::socket::announce(socket).map_err(|source| ServerError::System {
        op: "write to stdout",
        source,
    })?;
    let stop = AtomicBool::new(false);
    let waited = std::thread::scope(|scope| {
        let serving = scope.spawn(|| server.run(&stop));
        let waited = signals.wait();
        stop.store(true, Ordering::Relaxed);
        let _ = serving.join();
        waited
    });
    let _ = std::fs::remove_file(socket);
    waited.map_err(|e| ServerError::System {
        op: "wait for a signal",
        source: e.into(),
    })?;
    tracing::info!("pvisor governor: stopped");
    Ok(())
}

/// Asks the governor at `socket` for its status (`pvisor governor-status`).
pub fn query_status(socket: &Path, timeout: Duration) -> Result<serde_json::Value, String> {
    let stream = UnixStream::connect(socket).map_err(|e| {
        format!(
            "cannot connect to the governor at {}: {e}",
            socket.display()
        )
    })?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| e.to_string())?;
    (&stream)
        .write_all(&protocol::line(&ToGovernor::Status))
        .map_err(|e| format!("cannot write to the governor: {e}"))?;
    let mut input = BufReader::new(&stream);
    match LineReader::default().next::<FromGovernor>(&mut input) {
        Ok(FromGovernor::Status(status)) => Ok(status),
        Ok(FromGovernor::Error { message }) => Err(format!("the governor refused: {message}")),
        Ok(other) => Err(format!("the governor answered something else: {other:?}")),
        Err(LineError::Timeout) => Err(format!(
            "the governor at {} did not answer within {timeout:?}",
            socket.display()
        )),
        Err(e) => Err(format!("no status from the governor: {e}")),
    }
}
