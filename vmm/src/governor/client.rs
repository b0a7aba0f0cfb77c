//! A VM's link to the memory governor (`pvisor run --vm-governor SOCKET`): a thread that joins
//! the governor, reports the VM's state and readings, carries the governor's limits to the
//! pager, and queues its offload orders for the VM's wait loop (or, while the guest runs a
//! command, for its vCPU thread, which it kicks out of the guest: a preemption).
//!
//! Fail-safe: when the governor goes away (or never answers) the link lifts the resident
//! limit, so nothing waits on a dead governor, and the VM goes on under its own wait policy;
//! the link reconnects by itself and joins a restarted governor anew. A fault held longer
//! than the hold timeout (the governor alive but unable to make room) lifts the limit too,
//! with a message on stderr: running on past the budget beats hanging for ever.

use std::collections::VecDeque;
use std::io::{BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use super::protocol::{self, FromGovernor, LineError, LineReader, ToGovernor, WireState};

/// What the link needs of the VM's pager.
/// How long a cold compression order may take before the VM answers it with what it holds
/// then: inside the governor's order timeout (10 s by default).
const COLD_ANSWER_BY: Duration = Duration::from_secs(8);

pub trait ResidentControl: Send + Sync {
    /// Holds faults past `limit` resident bytes (`None`: no limit).
    fn set_limit(&self, limit: Option<u64>);
    /// Guest RAM resident now, bytes.
    fn resident_bytes(&self) -> u64;
    /// What the faults held now would install, bytes.
    fn held_bytes(&self) -> u64;
    /// Bytes by which the limit as it is now falls short of the held faults (0 once a raise
    /// covers them, before they are tried again).
    fn shortfall_bytes(&self) -> u64;
    /// The PSS of the guest RAM's mappings, bytes, if it can be read.
    fn guest_pss_bytes(&self) -> Option<u64>;
    /// Has cold compression take what has been cold for `age` for a while; false when the VM
    /// runs no cold compression.
    fn compress_cold(&self, age: Duration) -> bool;
    /// Whether cold compression still carries out that order (what stays resident once it is
    /// over answers it).
    fn cold_order_pending(&self) -> bool;
}

/// How the link behaves.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// The governor's socket.
    pub socket: PathBuf,
    /// The VM's name (its job id).
    pub name: String,
    /// Its guest RAM.
    pub memory: u64,
    /// How often it sends a reading.
    pub report_every: Duration,
    /// How often a reading carries the guest RAM's PSS (read from smaps, which costs more).
    pub pss_every: Duration,
    /// How long it waits between connection attempts.
    pub retry_every: Duration,
    /// A fault held this long lifts the limit.
    pub hold_timeout: Duration,
}

impl LinkConfig {
    /// The defaults: a reading every 100 ms, with the guest RAM's PSS every second, a retry
    /// every second, a two-minute hold timeout.
    pub fn new(socket: PathBuf, name: String, memory: u64) -> Self {
        Self {
            socket,
            name,
            memory,
            report_every: Duration::from_millis(100),
            pss_every: Duration::from_secs(1),
            retry_every: Duration::from_secs(1),
            hold_timeout: Duration::from_secs(120),
        }
    }
}

/// An order of the governor for the VM's wait loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Order {
    /// Offload now (answer with [`GovernorLink::offloaded`]).
    Offload {
        /// The governor's reason.
        reason: String,
    },
}

/// The link's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LinkStats {
    /// Connected (welcomed) now.
    pub connected: bool,
    /// Times it joined a governor.
    pub joins: u64,
    /// Times the connection was lost.
    pub disconnects: u64,
    /// Limits set by the governor.
    pub limits: u64,
    /// Offload orders received.
    pub offload_orders: u64,
    /// Offload orders it could not carry out (the VM was not waiting, or was between a
    /// command's guest runs).
    pub orders_refused: u64,
    /// Offload orders that stopped the vCPU in its command (preemptions).
    pub preemptions: u64,
    /// Requests for room it sent.
    pub requests: u64,
    /// Times a held fault outlasted the hold timeout and the limit was lifted.
    pub hold_timeouts: u64,
}

struct Shared {
    config: LinkConfig,
    control: Arc<dyn ResidentControl>,
    outbox: Mutex<VecDeque<ToGovernor>>,
    orders: Mutex<VecDeque<Order>>,
    /// The state last reported, sent again on each join.
    state: Mutex<Option<ToGovernor>>,
    /// The VM is in a managed model wait: an offload order can be carried out.
    waiting: AtomicBool,
    /// While the guest runs a command: kicks its vCPU out, to carry out an order.
    preempter: Mutex<Option<Preempter>>,
    /// A request for room is out and not answered yet.
    requested: AtomicBool,
    stop: AtomicBool,
    connected: AtomicBool,
    counters: [AtomicU64; 8],
    /// A byte on it wakes the link's thread to send what was queued at once (a request for
    /// room waited up to a read slice, 20 ms, before it went out: 10 ms on average for each
    /// of the ~40 requests of a VM's 24-step replay under a binding budget).
    wake: (UnixDatagram, UnixDatagram),
}

/// Kicks the VM's vCPU out of the guest (see [`GovernorLink::set_preempter`]).
pub type Preempter = Arc<dyn Fn() + Send + Sync>;

// Indices of `Shared::counters`.
const JOINS: usize = 0;
const DISCONNECTS: usize = 1;
const LIMITS: usize = 2;
const ORDERS: usize = 3;
const REFUSED: usize = 4;
const REQUESTS: usize = 5;
const HOLD_TIMEOUTS: usize = 6;
const PREEMPTIONS: usize = 7;

/// Asks the governor for room on the link's behalf (see [`GovernorLink::requester`]).
#[derive(Clone)]
#[allow(
    missing_debug_implementations,
    reason = "a handle with nothing to show"
)]
pub struct Requester(Weak<Shared>);

impl Requester {
    /// As [`GovernorLink::request`] (nothing once the link is gone). Weak: the pager holds
    /// this, and the link holds the pager's handle.
    pub fn request(&self, bytes: u64) {
        if let Some(shared) = self.0.upgrade() {
            shared.request(bytes);
        }
    }
}

/// The running link; dropping it disconnects (and lifts the limit).
pub struct GovernorLink {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for GovernorLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GovernorLink")
            .field("socket", &self.shared.config.socket)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl GovernorLink {
    /// Starts the link's thread (it connects in the background: a governor not there yet is
    /// tried again every `retry_every`).
    pub fn start(config: LinkConfig, control: Arc<dyn ResidentControl>) -> std::io::Result<Self> {
        let wake = UnixDatagram::pair()?;
        wake.0.set_nonblocking(true)?;
        wake.1.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            config,
            control,
            outbox: Mutex::new(VecDeque::new()),
            orders: Mutex::new(VecDeque::new()),
            state: Mutex::new(None),
            waiting: AtomicBool::new(false),
            preempter: Mutex::new(None),
            requested: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            connected: AtomicBool::new(false),
            counters: Default::default(),
            wake,
        });
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("governor-link".into())
                .spawn(move || shared.run())?
        };
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// What the pager's held-fault callback calls: [`GovernorLink::request`] from another
    /// thread.
    pub fn requester(&self) -> Requester {
        Requester(Arc::downgrade(&self.shared))
    }

    /// Reports the VM's state (sent now, and again on each join).
    pub fn report(&self, state: WireState, expected_remaining: Option<Duration>) {
        let message = ToGovernor::State {
            state,
            expected_remaining_ms: expected_remaining
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        };
        *lock(&self.shared.state) = Some(message.clone());
        self.shared.send(message);
        // Offloaded, it holds no fault, and the governor drops a request it queued before:
        // the next held fault asks anew (forgotten after the state is sent, so that no
        // request goes out ahead of it to be dropped with the stale one).
        if state == WireState::Offloaded {
            self.shared.requested.store(false, Ordering::SeqCst);
        }
    }

    /// The VM's faults are held: asks for room (at most one request is out at a time; called
    /// from the pager's fault thread, it never blocks).
    pub fn request(&self, bytes: u64) {
        self.shared.request(bytes);
    }

    /// What came of an offload order. Carried out, the limit is what stays resident (the
    /// governor's model says so too): the faults that bring RAM back ask for it.
    pub fn offloaded(&self, ok: bool, resident_bytes: u64) {
        if ok && self.shared.connected.load(Ordering::SeqCst) {
            self.shared.control.set_limit(Some(resident_bytes));
        }
        self.shared
            .send(ToGovernor::Offloaded { ok, resident_bytes });
    }

    /// While the guest runs a command (outside managed model waits), an offload order is
    /// queued for the vCPU thread and `preempter` kicks it out of the guest to carry it out
    /// ([`GovernorLink::take_order`]); `None` once the command's guest run ends. Without one,
    /// such an order is refused.
    pub fn set_preempter(&self, preempter: Option<Preempter>) {
        *lock(&self.shared.preempter) = preempter;
    }

    /// Whether the VM is in a managed model wait, where offload orders are carried out. Orders
    /// still queued when the wait ends are answered as not carried out.
    /// Orders left from an earlier wait are answered so at its start too.
    pub fn set_waiting(&self, waiting: bool) {
        let left: Vec<Order> = lock(&self.shared.orders).drain(..).collect();
        for _ in left {
            self.shared.refuse_order();
        }
        self.shared.waiting.store(waiting, Ordering::SeqCst);
    }

    /// The next order for the wait loop.
    pub fn take_order(&self) -> Option<Order> {
        lock(&self.shared.orders).pop_front()
    }

    /// The link's counters.
    pub fn stats(&self) -> LinkStats {
        let n = |i: usize| self.shared.counters[i].load(Ordering::Relaxed);
        LinkStats {
            connected: self.shared.connected.load(Ordering::Relaxed),
            joins: n(JOINS),
            disconnects: n(DISCONNECTS),
            limits: n(LIMITS),
            offload_orders: n(ORDERS),
            orders_refused: n(REFUSED),
            requests: n(REQUESTS),
            hold_timeouts: n(HOLD_TIMEOUTS),
            preemptions: n(PREEMPTIONS),
        }
    }
}

impl Drop for GovernorLink {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// How often the link's thread looks at its outbox and the stop flag while no line arrives.
const SLICE: Duration = Duration::from_millis(20);

/// How often a reading carries the PSS of a VM whose resident has not moved since the last.
const PSS_STILL_EVERY: Duration = Duration::from_secs(10);

impl Shared {
    fn count(&self, i: usize) {
        self.counters[i].fetch_add(1, Ordering::Relaxed);
    }

    fn send(&self, message: ToGovernor) {
        lock(&self.outbox).push_back(message);
        // Full: a wake-up is pending already.
        let _ = self.wake.0.send(&[1]);
    }

    /// Waits up to a slice for a line from the governor or a wake-up; true if a line (or
    /// part of one) is there to read.
    fn wait_input(&self, input: &BufReader<UnixStream>) -> bool {
        if !input.buffer().is_empty() {
            return true;
        }
        let mut fds = [
            PollFd::new(input.get_ref().as_fd(), PollFlags::POLLIN),
            PollFd::new(self.wake.1.as_fd(), PollFlags::POLLIN),
        ];
        let slice = PollTimeout::try_from(SLICE).unwrap_or(PollTimeout::MAX);
        if poll(&mut fds, slice).is_err() {
            return true;
        }
        let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
        let (line, woken) = (ready(&fds[0]), ready(&fds[1]));
        if woken {
            let mut byte = [0u8; 64];
            while self.wake.1.recv(&mut byte).is_ok() {}
        }
        line
    }

    fn request(&self, bytes: u64) {
        if self.connected.load(Ordering::SeqCst) && !self.requested.swap(true, Ordering::SeqCst) {
            self.count(REQUESTS);
            self.send(ToGovernor::Request { bytes });
        }
    }

    fn refuse_order(&self) {
        self.count(REFUSED);
        self.send(ToGovernor::Offloaded {
            ok: false,
            resident_bytes: self.control.resident_bytes(),
        });
    }

    fn sleep(&self, duration: Duration) {
        let until = Instant::now() + duration;
        while !self.stop.load(Ordering::SeqCst) && Instant::now() < until {
            std::thread::sleep(SLICE.min(until.saturating_duration_since(Instant::now())));
        }
    }

    fn run(&self) {
        let mut warned = false;
        while !self.stop.load(Ordering::SeqCst) {
            match UnixStream::connect(&self.config.socket) {
                Ok(stream) => {
                    warned = false;
                    let why = self.session(stream);
                    // Fail-safe: nothing may stay held on a governor that is gone.
                    self.control.set_limit(None);
                    if self.connected.swap(false, Ordering::SeqCst) {
                        self.count(DISCONNECTS);
                        if !self.stop.load(Ordering::SeqCst) {
                            tracing::warn!(
                                "pvisor: {}: lost the memory governor ({why}); going on under \
                                 the VM's own wait policy, rejoining when it is back",
                                self.config.name
                            );
                        }
                    }
                }
                Err(e) => {
                    if !warned {
                        warned = true;
                        tracing::warn!(
                            "pvisor: {}: no memory governor at {} ({e}); trying again every {:?}",
                            self.config.name,
                            self.config.socket.display(),
                            self.config.retry_every
                        );
                    }
                }
            }
            self.sleep(self.config.retry_every);
        }
    }

    /// One connection; returns why it ended.
    fn session(&self, stream: UnixStream) -> String {
        let Ok(writer) = stream.try_clone() else {
            return "cannot use the socket".into();
        };
        let _ = writer.set_write_timeout(Some(Duration::from_secs(2)));
        let _ = stream.set_read_timeout(Some(SLICE));
        let mut input = BufReader::new(stream);
        let mut lines = LineReader::default();
        let write = |message: &ToGovernor| (&writer).write_all(&protocol::line(message));
        let hello = ToGovernor::Hello {
            name: self.config.name.clone(),
            memory_bytes: self.config.memory,
            resident_bytes: self.control.resident_bytes(),
        };
        if let Err(e) = write(&hello) {
            return format!("hello: {e}");
        }
        // What was queued for an earlier governor means nothing to this one; the state does.
        lock(&self.outbox).clear();
        self.requested.store(false, Ordering::SeqCst);
        if let Some(state) = lock(&self.state).clone() {
            self.send(state);
        }
        let mut next_reading = Instant::now();
        let mut next_pss = next_reading;
        // When the PSS was last read, and the resident then.
        let mut pss_read: Option<(Instant, u64)> = None;
        let mut held_since: Option<Instant> = None;
        // A cold compression order under way, since when.
        let mut cold_since: Option<Instant> = None;
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return "the VM is stopping".into();
            }
            let now = Instant::now();
            if now >= next_reading {
                next_reading = now + self.config.report_every;
                let resident_bytes = self.control.resident_bytes();
                // The PSS walks the VM's page tables (`smaps`): while its resident holds still
                // (an idle or offloaded VM) only every `PSS_STILL_EVERY` (sharing may still
                // move it); 64 sandboxes walking theirs every second took ~5% of the host's
                // CPU (2026-12-07). The governor keeps the last one.
                let still = pss_read.is_some_and(|(at, resident)| {
                    resident == resident_bytes && now.duration_since(at) < PSS_STILL_EVERY
                });
                let guest_pss_bytes = (now >= next_pss && !still)
                    .then(|| {
                        next_pss = now + self.config.pss_every;
                        let pss = self.control.guest_pss_bytes();
                        // A failed reading is tried again at the next `pss_every`.
                        if pss.is_some() {
                            pss_read = Some((now, resident_bytes));
                        }
                        pss
                    })
                    .flatten();
                self.send(ToGovernor::Reading {
                    resident_bytes,
                    held_bytes: self.control.held_bytes(),
                    guest_pss_bytes,
                });
            }
            // Answered once it is over, or before the governor's order would time out (10 s
            // by default) however far it got.
            if cold_since.is_some_and(|since| {
                !self.control.cold_order_pending() || now.duration_since(since) >= COLD_ANSWER_BY
            }) {
                cold_since = None;
                // Its limit is the governor's to lower (to what stays resident and a grant):
                // the VM runs, and a limit at its resident would hold its next fault.
                self.send(ToGovernor::Offloaded {
                    ok: true,
                    resident_bytes: self.control.resident_bytes(),
                });
            }
            let queued: Vec<ToGovernor> = lock(&self.outbox).drain(..).collect();
            for message in &queued {
                if let Err(e) = write(message) {
                    return format!("write: {e}");
                }
            }
            let held = self.control.held_bytes();
            if held == 0 {
                held_since = None;
            } else {
                // A hold the pager's callback did not report (or that outlived its answer):
                // `request` sends only while connected and with no request out. It asks for
                // the shortfall against the limit as it is now: right after a raise the
                // faults are still held until the pager tries them again, and asking for
                // what they install then had the governor raise the limit again, 16 MiB a
                // round trip (one VM went from 64 to 214 MiB in a millisecond for a 69 MiB
                // step, and that room was kept from every other VM).
                let shortfall = self.control.shortfall_bytes();
                if shortfall > 0 {
                    self.request(shortfall);
                }
                let since = *held_since.get_or_insert(now);
                if now.duration_since(since) >= self.config.hold_timeout {
                    self.count(HOLD_TIMEOUTS);
                    tracing::warn!(
                        "pvisor: {}: a fault held for {:?} without the governor making room; \
                         lifting the limit (the VM may now exceed the memory budget)",
                        self.config.name,
                        self.config.hold_timeout
                    );
                    self.control.set_limit(None);
                    held_since = None;
                }
            }
            if !self.wait_input(&input) {
                continue;
            }
            let message = match lines.next::<FromGovernor>(&mut input) {
                Ok(message) => message,
                Err(LineError::Timeout) => continue,
                Err(e) => return basics::error_chain(&e),
            };
            match message {
                FromGovernor::Welcome { .. } => {
                    self.connected.store(true, Ordering::SeqCst);
                    self.count(JOINS);
                }
                FromGovernor::SetLimit { bytes, .. } => {
                    self.count(LIMITS);
                    self.control.set_limit(Some(bytes));
                    self.requested.store(false, Ordering::SeqCst);
                }
                FromGovernor::Unlimit { .. } => {
                    self.count(LIMITS);
                    self.control.set_limit(None);
                    self.requested.store(false, Ordering::SeqCst);
                }
                FromGovernor::Offload { reason } => {
                    self.count(ORDERS);
                    if self.waiting.load(Ordering::SeqCst) {
                        lock(&self.orders).push_back(Order::Offload { reason });
                    } else if let Some(kick) = lock(&self.preempter).clone() {
                        self.count(PREEMPTIONS);
                        lock(&self.orders).push_back(Order::Offload { reason });
                        kick();
                    } else {
                        self.refuse_order();
                    }
                }
                // A running VM's cold RAM, compressed with the governor's shorter age for a
                // while; without cold compression the order is answered as not carried out,
                // so the governor looks elsewhere.
                FromGovernor::ColdCompress { age_ms, .. } => {
                    self.count(ORDERS);
                    if self.control.compress_cold(Duration::from_millis(age_ms)) {
                        cold_since = Some(Instant::now());
                    } else {
                        self.refuse_order();
                    }
                }
                FromGovernor::Status(_) => {}
                FromGovernor::Error { message } => return format!("refused: {message}"),
            }
        }
    }
}
