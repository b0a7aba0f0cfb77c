//! The control API of a VM process: a Unix socket (mode 0600, the owner's uid only) taking
//! one JSON request per connection and answering one JSON reply, in versioned envelopes with
//! a `request_id`. A request for another job or attempt is refused. The server is bounded
//! against hostile local peers: request size, connections, a deadline for the whole request,
//! requests in flight (see [`serve`]).
//!
//! ```text
//! → {"version":1,"request_id":"r1","job":"vm-…","attempt":"…","method":"suspend","params":{"offload":true}}
//! ← {"version":1,"request_id":"r1","status":"ok","value":{…}}
//! ← {"version":1,"request_id":"r1","status":"error","error":"…"}
//! ```

use std::collections::VecDeque;
use std::io::{Read as _, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

/// The envelope version.
pub const VERSION: u32 = 1;

/// What a client asks.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "method", content = "params", rename_all = "snake_case")]
pub enum Method {
    /// State and identity.
    Status,
    /// Memory and pager statistics.
    Stats,
    /// Run a workload script.
    Exec {
        /// The script.
        script: String,
    },
    /// Pause, or pause and offload.
    Suspend {
        /// Also move RAM to the store.
        offload: bool,
        /// After an offload, expose the stored image read-only as a plain file here.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ram_file: Option<PathBuf>,
    },
    /// Resume (loading RAM back if offloaded).
    Resume {
        /// Load everything before returning.
        eager: bool,
    },
    /// Write a sealed snapshot of the VM.
    Snapshot {
        /// The snapshot's directory (must not exist).
        out: PathBuf,
        /// Keep RAM in a compressed store with this codec (`lz4`, `zstd[:LEVEL]`) instead of a
        /// raw image.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        codec: Option<String>,
        /// The store's block size in bytes (with a codec; default 64 KiB).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        block_size: Option<u64>,
    },
    /// Stop the VM.
    Stop,
}

/// How long a client waits for a VM to answer a query (`status`, `stats`): a VM that does not
/// answer by then is reported as not answering, not waited for.
pub const QUERY_DEADLINE: Duration = Duration::from_secs(10);

/// How long a client waits for a VM to answer `stop` (the VM interrupts its command first).
pub const STOP_DEADLINE: Duration = Duration::from_secs(30);

impl Method {
    /// How long [`call`] waits, from before its connect to the reply's end: a query's answer
    /// comes at once, so a short deadline; `exec`, `suspend`, `resume` and `snapshot`
    /// legitimately wait for the work they do, so none.
    pub fn deadline(&self) -> Option<Duration> {
        match self {
            Method::Status | Method::Stats => Some(QUERY_DEADLINE),
            Method::Stop => Some(STOP_DEADLINE),
            Method::Exec { .. }
            | Method::Suspend { .. }
            | Method::Resume { .. }
            | Method::Snapshot { .. } => None,
        }
    }
}

/// A request envelope.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Request {
    /// Envelope version.
    pub version: u32,
    /// Echoed in the reply.
    pub request_id: String,
    /// The job it is meant for.
    pub job: String,
    /// The attempt it is meant for.
    pub attempt: String,
    /// What to do.
    #[serde(flatten)]
    pub method: Method,
}

/// A reply envelope.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Reply {
    /// Envelope version.
    pub version: u32,
    /// The request's id.
    pub request_id: String,
    /// `ok` or `error`.
    pub status: String,
    /// The result, when ok.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<serde_json::Value>,
    /// What went wrong, when not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Reply {
    fn ok(request_id: &str, value: serde_json::Value) -> Self {
        Self {
            version: VERSION,
            request_id: request_id.to_owned(),
            status: "ok".into(),
            value: Some(value),
            error: None,
        }
    }

    fn error(request_id: &str, error: String) -> Self {
        Self {
            version: VERSION,
            request_id: request_id.to_owned(),
            status: "error".into(),
            value: None,
            error: Some(error),
        }
    }

    /// The reply as one line of JSON, newline included.
    pub fn to_line(&self) -> String {
        let mut text = serde_json::to_string(self).unwrap_or_else(|_| {
            r#"{"version":1,"request_id":"","status":"error","error":"unprintable reply"}"#.into()
        });
        text.push('\n');
        text
    }
}

/// A request handed to the thread that owns the VM, with the way back.
pub type Job = (Method, mpsc::Sender<Result<serde_json::Value, String>>);

/// The longest request line: well above the largest script `pvisor exec` can pass (its
/// arguments are bounded by the kernel's 2 MiB `ARG_MAX`).
pub const MAX_REQUEST_BYTES: usize = 4 << 20;
/// Request bytes buffered over all connections at once; past it the largest is dropped.
pub const MAX_BUFFERED_BYTES: usize = 16 << 20;
/// Connections being read at once; a new one beyond it displaces the oldest.
pub const MAX_CONNECTIONS: usize = 128;
/// Requests handed to the VM and not answered yet; beyond it a request is refused at once.
pub const MAX_IN_FLIGHT: usize = 64;
/// Places beyond [`MAX_IN_FLIGHT`] kept for `stop`: requests queued behind a command that
/// does not end must not keep the stop that would end it from being heard.
pub const STOP_RESERVE: usize = 8;
/// How long a connection has, from its accept, to send its whole request line.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(5);
/// How long writing a reply may take.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections accepted per poll round, at most: a connect flood cannot keep the poll thread
/// accepting while the connections it holds wait (and pass their deadlines) unread.
pub const ACCEPTS_PER_ROUND: usize = 16;
/// The wait after the process ran out of descriptors with no connection to give up.
const EMFILE_BACKOFF: Duration = Duration::from_millis(100);

/// Who a server answers: the VM's identity and its owner.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The job id.
    pub job: String,
    /// The attempt id.
    pub attempt: String,
    /// The uid allowed besides root.
    pub owner: u32,
}

/// Parses and checks one request line from a peer of uid `peer`; a refusal comes back as the
/// reply to send. Never panics, whatever the bytes.
pub fn check_request(line: &[u8], peer: Option<u32>, who: &Identity) -> Result<Request, Reply> {
    if line.len() > MAX_REQUEST_BYTES {
        return Err(Reply::error(
            "",
            format!("request longer than {MAX_REQUEST_BYTES} bytes"),
        ));
    }
    let request = match serde_json::from_slice::<Request>(line) {
        Err(e) => return Err(Reply::error("", format!("not a request: {e}"))),
        Ok(request) => request,
    };
    let own = who.owner;
    if peer != Some(own) && peer != Some(0) {
        return Err(Reply::error(
            "",
            format!("refused: the VM belongs to uid {own}, the caller is uid {peer:?}"),
        ));
    }
    if request.version != VERSION {
        return Err(Reply::error(
            &request.request_id,
            format!(
                "unsupported version {} (this VM speaks {VERSION})",
                request.version
            ),
        ));
    }
    if request.job != who.job || request.attempt != who.attempt {
        return Err(Reply::error(
            &request.request_id,
            format!(
                "refused: this VM is job `{}` attempt `{}`, not job `{}` attempt `{}`",
                who.job, who.attempt, request.job, request.attempt
            ),
        ));
    }
    Ok(request)
}

/// Answers one request line: checks it, hands a valid one to `dispatch`, and returns the
/// reply's line (newline included).
pub fn answer_line(
    line: &[u8],
    peer: Option<u32>,
    who: &Identity,
    dispatch: impl FnOnce(Method) -> Option<Result<serde_json::Value, String>>,
) -> String {
    let reply = match check_request(line, peer, who) {
        Err(reply) => reply,
        Ok(request) => match dispatch(request.method) {
            Some(Ok(value)) => Reply::ok(&request.request_id, value),
            Some(Err(error)) => Reply::error(&request.request_id, error),
            None => Reply::error(&request.request_id, "the VM is shutting down".into()),
        },
    };
    reply.to_line()
}

/// Called when a `stop` arrives, before it queues behind a running command (to interrupt it).
pub type OnStop = Arc<dyn Fn() + Send + Sync>;

/// Listens on `path` (mode 0600) and hands every valid request for `who` to `tx`. One thread
/// reads every connection with `poll` (bounded: [`MAX_CONNECTIONS`], [`MAX_REQUEST_BYTES`],
/// [`MAX_BUFFERED_BYTES`], [`REQUEST_DEADLINE`] for the whole request); each complete request
/// waits for its answer on a thread of its own (at most [`MAX_IN_FLIGHT`], and
/// [`STOP_RESERVE`] more for `stop`). A `stop` calls `on_stop` first.
pub fn serve(
    path: &Path,
    who: Identity,
    tx: mpsc::Sender<Job>,
    on_stop: OnStop,
) -> std::io::Result<Listening> {
    // Private from its creation (made 0600 elsewhere, then renamed into place): no other
    // user can connect in a window between bind and chmod. A stale socket is replaced, a
    // live one or anything that is not a socket refused (never removed).
    let listener = uffd_pager::socket::bind_private(path)?;
    listener.set_nonblocking(true)?;
    let in_flight = Arc::new(AtomicUsize::new(0));
    let server = Server {
        listener,
        who,
        tx,
        on_stop,
        pending: VecDeque::new(),
        buffered: 0,
        in_flight: Arc::clone(&in_flight),
    };
    let thread = std::thread::Builder::new()
        .name("pvisor-control".into())
        .spawn(move || server.run())?;
    Ok(Listening {
        in_flight,
        _thread: thread,
    })
}

/// A serving control socket.
#[derive(Debug)]
pub struct Listening {
    in_flight: Arc<AtomicUsize>,
    _thread: std::thread::JoinHandle<()>,
}

impl Listening {
    /// Requests read and not answered yet (their replies not written): a VM that exits waits
    /// for them, answering what is queued, so that a `stop` gets its reply.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}

/// A connection whose request is being read.
struct Pending {
    stream: UnixStream,
    accepted: Instant,
    line: Vec<u8>,
}

struct Server {
    listener: UnixListener,
    who: Identity,
    tx: mpsc::Sender<Job>,
    on_stop: OnStop,
    /// Oldest first.
    pending: VecDeque<Pending>,
    buffered: usize,
    in_flight: Arc<AtomicUsize>,
}

/// What reading a connection came to.
enum Read {
    More,
    Line,
    Closed,
    TooLong,
}

impl Server {
    fn run(mut self) {
        let mut listening = true;
        let mut backoff_until: Option<Instant> = None;
        loop {
            let now = Instant::now();
            if backoff_until.is_some_and(|t| t <= now) {
                backoff_until = None;
                listening = true;
            }
            self.expire(now);
            let deadline = self
                .pending
                .front()
                .map(|p| p.accepted + REQUEST_DEADLINE)
                .into_iter()
                .chain(backoff_until)
                .min();
            let timeout = deadline.map_or(PollTimeout::NONE, |d| {
                let ms = d.saturating_duration_since(now).as_millis() + 1;
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
            });
            let ready: Vec<(usize, PollFlags)> = {
                let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(self.pending.len() + 1);
                fds.push(PollFd::new(
                    self.listener.as_fd(),
                    if listening {
                        PollFlags::POLLIN
                    } else {
                        PollFlags::empty()
                    },
                ));
                fds.extend(
                    self.pending
                        .iter()
                        .map(|p| PollFd::new(p.stream.as_fd(), PollFlags::POLLIN)),
                );
                match poll(&mut fds, timeout) {
                    Ok(_) => {}
                    Err(nix::errno::Errno::EINTR) => continue,
                    // Nothing in the set can be wrong for long; do not spin on it.
                    Err(_) => {
                        std::thread::sleep(EMFILE_BACKOFF);
                        continue;
                    }
                }
                fds.iter()
                    .enumerate()
                    .filter_map(|(i, fd)| {
                        fd.revents()
                            .filter(|r| !r.is_empty())
                            .map(|revents| (i, revents))
                    })
                    .collect()
            };
            // Read the ready connections (highest index first, so removals keep indices).
            for &(i, _) in ready.iter().rev().filter(|(i, _)| *i > 0) {
                self.service(i - 1);
            }
            if ready.first().is_some_and(|(i, _)| *i == 0) && !self.accept_some() {
                // Out of descriptors and nothing of ours to give up: wait a little.
                listening = false;
                backoff_until = Some(Instant::now() + EMFILE_BACKOFF);
            }
        }
    }

    /// Accepts waiting connections, at most [`ACCEPTS_PER_ROUND`] (the listener stays ready
    /// for the next round if more wait); false when out of descriptors with none to free.
    fn accept_some(&mut self) -> bool {
        for _ in 0..ACCEPTS_PER_ROUND {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.pending.len() >= MAX_CONNECTIONS {
                        // The oldest has had the longest time to send its request.
                        self.drop_pending(0, "too many connections: the oldest is dropped");
                    }
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    self.pending.push_back(Pending {
                        stream,
                        accepted: Instant::now(),
                        line: Vec::new(),
                    });
                    // A client writes its request right after connecting: read it now.
                    self.service(self.pending.len() - 1);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
                        && !self.pending.is_empty() =>
                {
                    self.drop_pending(0, "out of descriptors: the oldest connection is dropped");
                }
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    return false
                }
                // The peer left before its accept (ECONNABORTED and the like).
                Err(_) => return true,
            }
        }
        true
    }

    /// Drops the connections whose deadline passed.
    fn expire(&mut self, now: Instant) {
        while self
            .pending
            .front()
            .is_some_and(|p| now >= p.accepted + REQUEST_DEADLINE)
        {
            self.drop_pending(0, "request not received in time");
        }
    }

    /// Closes pending connection `i`, telling it why (best effort, never blocking).
    fn drop_pending(&mut self, i: usize, why: &str) {
        if let Some(p) = self.pending.remove(i) {
            self.buffered -= p.line.len();
            let _ = (&p.stream).write(Reply::error("", why.into()).to_line().as_bytes());
        }
    }

    /// Reads what connection `i` has; hands a complete request on.
    fn service(&mut self, i: usize) {
        let outcome = self.read(i);
        match outcome {
            Read::More => {
                if self.buffered > MAX_BUFFERED_BYTES {
                    self.drop_largest();
                }
            }
            Read::Closed => {
                // Nobody to tell.
                if let Some(p) = self.pending.remove(i) {
                    self.buffered -= p.line.len();
                }
            }
            Read::TooLong => {
                self.drop_pending(i, &format!("request longer than {MAX_REQUEST_BYTES} bytes"))
            }
            Read::Line => {
                if let Some(p) = self.pending.remove(i) {
                    self.buffered -= p.line.len();
                    self.dispatch(p);
                }
            }
        }
    }

    fn read(&mut self, i: usize) -> Read {
        let Some(p) = self.pending.get_mut(i) else {
            return Read::Closed;
        };
        let mut chunk = [0u8; 64 * 1024];
        loop {
            let room = (MAX_REQUEST_BYTES + 1 - p.line.len()).min(chunk.len());
            match (&p.stream).read(&mut chunk[..room]) {
                Ok(0) if p.line.is_empty() => return Read::Closed,
                // A request without its newline, ended by the peer's shutdown.
                Ok(0) => return Read::Line,
                Ok(n) => {
                    let got = &chunk[..n];
                    if let Some(end) = got.iter().position(|&b| b == b'\n') {
                        p.line.extend_from_slice(&got[..end]);
                        self.buffered += end;
                        return if p.line.len() > MAX_REQUEST_BYTES {
                            Read::TooLong
                        } else {
                            Read::Line
                        };
                    }
                    p.line.extend_from_slice(got);
                    self.buffered += n;
                    if p.line.len() > MAX_REQUEST_BYTES {
                        return Read::TooLong;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Read::More,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Read::Closed,
            }
        }
    }

    fn drop_largest(&mut self) {
        while self.buffered > MAX_BUFFERED_BYTES {
            let Some(largest) = (0..self.pending.len()).max_by_key(|&i| self.pending[i].line.len())
            else {
                return;
            };
            self.drop_pending(
                largest,
                "too much request data buffered: the largest is dropped",
            );
        }
    }

    /// Answers a complete request on a thread of its own.
    fn dispatch(&self, p: Pending) {
        let peer = getsockopt(&p.stream, PeerCredentials).map(|c| c.uid()).ok();
        let in_flight = self.in_flight.load(Ordering::SeqCst);
        if in_flight >= MAX_IN_FLIGHT {
            let reply = match check_request(&p.line, peer, &self.who) {
                // A stop interrupts the command the others wait for.
                Ok(request)
                    if request.method == Method::Stop
                        && in_flight < MAX_IN_FLIGHT + STOP_RESERVE =>
                {
                    None
                }
                Ok(request) => Some(Reply::error(
                    &request.request_id,
                    format!("busy: {MAX_IN_FLIGHT} requests wait for the VM already"),
                )),
                Err(reply) => Some(reply),
            };
            if let Some(reply) = reply {
                let _ = (&p.stream).write(reply.to_line().as_bytes());
                return;
            }
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let in_flight = Arc::clone(&self.in_flight);
        let (who, tx, on_stop) = (self.who.clone(), self.tx.clone(), Arc::clone(&self.on_stop));
        let spawned = std::thread::Builder::new()
            .name("pvisor-request".into())
            .spawn(move || {
                let text = answer_line(&p.line, peer, &who, |method| {
                    if method == Method::Stop {
                        on_stop();
                    }
                    let (reply_tx, reply_rx) = mpsc::channel();
                    tx.send((method, reply_tx)).ok()?;
                    reply_rx.recv().ok()
                });
                if p.stream.set_nonblocking(false).is_ok()
                    && p.stream.set_write_timeout(Some(REPLY_TIMEOUT)).is_ok()
                {
                    let _ = (&p.stream).write_all(text.as_bytes());
                }
                in_flight.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Errors of a client call.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket cannot be reached.
    #[error("cannot reach the VM at {path}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The exchange failed.
    #[error("talking to the VM at {path} failed")]
    Io {
        /// The socket.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The VM did not answer in time.
    #[error("the VM at {path} did not answer within {deadline:?}")]
    Timeout {
        /// The socket.
        path: PathBuf,
        /// The method's deadline.
        deadline: Duration,
    },
    /// The reply is not an envelope.
    #[error("the VM answered something that is not a reply: {0}")]
    BadReply(String),
    /// The VM refused or failed the request.
    #[error("{0}")]
    Refused(String),
}

/// The longest reply a client reads.
const MAX_REPLY_BYTES: u64 = 64 << 20;

/// Connects to `socket`, giving up at `until` (a listener whose queue is full makes a plain
/// connect block).
fn connect(socket: &Path, until: Option<Instant>) -> Result<UnixStream, std::io::Error> {
    use nix::sys::socket::{self as sock, sockopt};
    let Some(until) = until else {
        return UnixStream::connect(socket);
    };
    let fd = sock::socket(
        sock::AddressFamily::Unix,
        sock::SockType::Stream,
        sock::SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let left = until.saturating_duration_since(Instant::now());
    let left = nix::sys::time::TimeVal::new(
        i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
        i64::from(left.subsec_micros()).max(1),
    );
    // A Unix socket's connect waits for room in the queue at most its send timeout.
    sock::setsockopt(&fd, sockopt::SendTimeout, &left)?;
    sock::connect(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &sock::UnixAddr::new(socket)?,
    )?;
    Ok(UnixStream::from(fd))
}

/// Whether an I/O error is a socket timeout's.
fn timed_out(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// Reads one reply line of at most [`MAX_REPLY_BYTES`], all of it before `until`.
fn read_reply(stream: &UnixStream, until: Option<Instant>) -> Result<String, std::io::Error> {
    let mut line = Vec::new();
    let mut chunk = [0u8; 64 << 10];
    let limit = usize::try_from(MAX_REPLY_BYTES).unwrap_or(usize::MAX);
    loop {
        if let Some(until) = until {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            stream.set_read_timeout(Some(left))?;
        }
        let want = chunk.len().min(limit - line.len());
        let n = match (&*stream).read(&mut chunk[..want]) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let got = &chunk[..n];
        if let Some(end) = got.iter().position(|&b| b == b'\n') {
            line.extend_from_slice(&got[..=end]);
            break;
        }
        line.extend_from_slice(got);
        if n == 0 || line.len() >= limit {
            break;
        }
    }
    Ok(String::from_utf8_lossy(&line).into_owned())
}

/// Sends one request and returns the reply's value, within the method's
/// [deadline](Method::deadline) (connect and reply together).
pub fn call(
    socket: &Path,
    job: &str,
    attempt: &str,
    method: Method,
) -> Result<serde_json::Value, ClientError> {
    let deadline = method.deadline();
    call_within(socket, job, attempt, method, deadline)
}

/// [`call`] with a deadline of the caller's (none: wait as long as it takes).
fn call_within(
    socket: &Path,
    job: &str,
    attempt: &str,
    method: Method,
    deadline: Option<Duration>,
) -> Result<serde_json::Value, ClientError> {
    let until = deadline.and_then(|d| Instant::now().checked_add(d));
    let timeout =
        |source: std::io::Error, or: fn(PathBuf, std::io::Error) -> ClientError| match deadline {
            Some(deadline) if timed_out(&source) => ClientError::Timeout {
                path: socket.to_path_buf(),
                deadline,
            },
            _ => or(socket.to_path_buf(), source),
        };
    let stream = connect(socket, until)
        .map_err(|e| timeout(e, |path, source| ClientError::Connect { path, source }))?;
    let io = |e| timeout(e, |path, source| ClientError::Io { path, source });
    if let Some(until) = until {
        let left = until.saturating_duration_since(Instant::now());
        stream
            .set_write_timeout(Some(left.max(Duration::from_millis(1))))
            .map_err(io)?;
    }
    let request = Request {
        version: VERSION,
        request_id: crate::runtime::new_id("r-"),
        job: job.to_owned(),
        attempt: attempt.to_owned(),
        method,
    };
    let mut text =
        serde_json::to_string(&request).map_err(|e| ClientError::BadReply(e.to_string()))?;
    text.push('\n');
    (&stream).write_all(text.as_bytes()).map_err(io)?;
    let line = read_reply(&stream, until).map_err(io)?;
    let reply: Reply =
        serde_json::from_str(&line).map_err(|_| ClientError::BadReply(line.clone()))?;
    if reply.request_id != request.request_id && !reply.request_id.is_empty() {
        return Err(ClientError::BadReply(format!(
            "reply for request {} to request {}",
            reply.request_id, request.request_id
        )));
    }
    match reply.status.as_str() {
        "ok" => Ok(reply.value.unwrap_or(serde_json::Value::Null)),
        _ => Err(ClientError::Refused(
            reply.error.unwrap_or_else(|| "unknown error".into()),
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    fn who() -> Identity {
        Identity {
            job: "vm-1".into(),
            attempt: "a-1".into(),
            owner: 1000,
        }
    }

    /// Any JSON value, a few levels deep.
    fn any_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(|f| json!(f)),
            ".{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(".{0,8}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Envelopes close to valid ones: each field right, wrong, missing or of the wrong type.
    fn envelope() -> impl Strategy<Value = Vec<u8>> {
        let version = prop_oneof![
            Just(json!(1)),
            Just(json!(0)),
            Just(json!(2)),
            Just(json!(u64::from(u32::MAX) + 1)),
            any_json()
        ];
        let id = prop_oneof![".{0,16}".prop_map(Value::String), any_json()];
        let job = prop_oneof![Just(json!("vm-1")), any_json()];
        let attempt = prop_oneof![Just(json!("a-1")), any_json()];
        let method = prop_oneof![
            Just("status"),
            Just("stats"),
            Just("exec"),
            Just("suspend"),
            Just("resume"),
            Just("snapshot"),
            Just("stop"),
        ]
        .prop_map(|m| json!(m))
        .boxed()
        .prop_union(any_json().boxed());
        let params = prop_oneof![
            Just(None),
            Just(Some(json!({"script": "digest"}))),
            Just(Some(json!({"offload": true}))),
            Just(Some(json!({"eager": false}))),
            Just(Some(json!({"out": "/tmp/x", "codec": "lz4"}))),
            any_json().prop_map(Some),
        ];
        let drop_field = prop::option::weighted(0.2, 0..5usize);
        (version, id, job, attempt, method, params, drop_field).prop_map(
            |(version, id, job, attempt, method, params, drop_field)| {
                let mut fields = vec![
                    ("version", version),
                    ("request_id", id),
                    ("job", job),
                    ("attempt", attempt),
                    ("method", method),
                ];
                if let Some(params) = params {
                    fields.push(("params", params));
                }
                if let Some(i) = drop_field {
                    fields.remove(i);
                }
                let object: serde_json::Map<String, Value> =
                    fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
                serde_json::to_vec(&Value::Object(object)).unwrap()
            },
        )
    }

    fn peer() -> impl Strategy<Value = Option<u32>> {
        prop_oneof![
            Just(Some(1000)),
            Just(Some(0)),
            Just(Some(65534)),
            Just(None)
        ]
    }

    /// What the VM answers in the fuzz: anything it may answer.
    fn vm_answer() -> impl Strategy<Value = Option<Result<Value, String>>> {
        prop_oneof![
            any_json().prop_map(|v| Some(Ok(v))),
            ".{0,16}".prop_map(|e| Some(Err(e))),
            Just(None),
        ]
    }

    proptest! {
        #[test]
        fn fuzz_control_request_lines_always_get_one_well_formed_reply(
            line in prop_oneof![prop::collection::vec(any::<u8>(), 0..256), envelope()],
            peer in peer(),
            answer in vm_answer(),
        ) {
            let mut dispatched = None;
            let text = answer_line(&line, peer, &who(), |method| {
                dispatched = Some(method);
                answer.clone()
            });
            prop_assert!(text.ends_with('\n'));
            prop_assert_eq!(text.matches('\n').count(), 1);
            let reply: Reply = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(reply.version, VERSION);
            let checked = check_request(&line, peer, &who());
            match (&checked, &dispatched) {
                (Ok(request), Some(method)) => {
                    // Only a valid request for this VM, from its owner or root, is dispatched.
                    prop_assert_eq!(&request.method, method);
                    prop_assert!(peer == Some(1000) || peer == Some(0));
                    prop_assert_eq!(request.version, VERSION);
                    prop_assert_eq!(request.job.as_str(), "vm-1");
                    prop_assert_eq!(request.attempt.as_str(), "a-1");
                    prop_assert_eq!(&reply.request_id, &request.request_id);
                    let ok = matches!(answer, Some(Ok(_)));
                    prop_assert_eq!(reply.status.as_str(), if ok { "ok" } else { "error" });
                }
                (Err(refusal), None) => {
                    prop_assert_eq!(reply.status.as_str(), "error");
                    prop_assert!(reply.error.is_some());
                    prop_assert_eq!(&reply.request_id, &refusal.request_id);
                }
                _ => prop_assert!(false, "dispatched {dispatched:?} for {checked:?}"),
            }
        }
    }

    #[test]
    fn control_call_status_to_a_socket_that_never_answers_times_out_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("silent.sock");
        let listener = UnixListener::bind(&path).unwrap();
        // Accepts and holds every connection, never answers.
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming() {
                held.push(stream);
            }
        });
        let (tx, rx) = mpsc::channel();
        let socket = path.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            // Status's own deadline (10 s) is checked below; a shorter one keeps this test short.
            let deadline = Some(Duration::from_secs(1));
            let result = call_within(&socket, "vm-1", "a-1", Method::Status, deadline);
            let _ = tx.send((result, started.elapsed()));
        });
        let (result, took) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("status waited for ever on a VM that never answers");
        let message = result.unwrap_err().to_string();
        assert!(message.contains(&path.display().to_string()), "{message}");
        assert!(message.contains("1s"), "{message}");
        assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(10));
    }

    #[test]
    fn control_call_deadlines_are_short_for_queries_and_absent_for_waiting_methods() {
        assert_eq!(Method::Status.deadline(), Some(Duration::from_secs(10)));
        assert_eq!(Method::Stats.deadline(), Some(Duration::from_secs(10)));
        assert!(Method::Stop.deadline().is_some());
        let exec = Method::Exec {
            script: "sleep 1".into(),
        };
        assert_eq!(exec.deadline(), None);
        assert_eq!(Method::Resume { eager: true }.deadline(), None);
    }

    #[test]
    fn control_accept_flood_is_taken_at_most_a_round_cap_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("flood.sock");
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let (tx, _rx) = mpsc::channel();
        let mut server = Server {
            listener,
            who: who(),
            tx,
            on_stop: Arc::new(|| {}),
            pending: VecDeque::new(),
            buffered: 0,
            in_flight: Arc::new(AtomicUsize::new(0)),
        };
        // A flood of connections that send nothing, all queued before the round.
        let flood: Vec<UnixStream> = (0..ACCEPTS_PER_ROUND * 3)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        assert!(server.accept_some());
        assert_eq!(server.pending.len(), ACCEPTS_PER_ROUND);
        assert!(server.accept_some());
        assert_eq!(server.pending.len(), 2 * ACCEPTS_PER_ROUND);
        drop(flood);
    }

    #[test]
    fn control_valid_request_is_dispatched_and_echoes_its_id() {
        let line =
            br#"{"version":1,"request_id":"r9","job":"vm-1","attempt":"a-1","method":"status"}"#;
        let text = answer_line(line, Some(0), &who(), |m| {
            assert_eq!(m, Method::Status);
            Some(Ok(json!({"fine": true})))
        });
        let reply: Reply = serde_json::from_str(&text).unwrap();
        assert_eq!(
            (reply.request_id.as_str(), reply.status.as_str()),
            ("r9", "ok")
        );
    }

    fn request_line(method: &str) -> String {
        format!(
            "{{\"version\":1,\"request_id\":\"r\",\"job\":\"vm-1\",\"attempt\":\"a-1\",\
             \"method\":\"{method}\"}}\n"
        )
    }

    fn own_identity() -> Identity {
        Identity {
            // SAFETY: geteuid cannot fail.
            owner: unsafe { libc::geteuid() },
            ..who()
        }
    }

    #[test]
    fn control_serve_on_a_path_that_is_not_a_socket_refuses_and_keeps_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        std::fs::write(&path, b"not a socket").unwrap();
        let (tx, _rx) = mpsc::channel();
        let served = serve(&path, own_identity(), tx, Arc::new(|| {}));
        assert!(served.is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
    }

    #[test]
    fn control_stop_with_every_request_slot_taken_still_interrupts_the_vm() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        // A VM busy with a command that never ends: it takes no request.
        let (tx, _rx) = mpsc::channel();
        let (stopped_tx, stopped_rx) = mpsc::channel();
        let stopped_tx = std::sync::Mutex::new(stopped_tx);
        let on_stop: OnStop = Arc::new(move || {
            let _ = stopped_tx.lock().unwrap().send(());
        });
        let listening = serve(&path, own_identity(), tx, on_stop).unwrap();
        let mut waiting = Vec::new();
        for _ in 0..MAX_IN_FLIGHT {
            let stream = UnixStream::connect(&path).unwrap();
            (&stream)
                .write_all(request_line("status").as_bytes())
                .unwrap();
            waiting.push(stream);
        }
        let until = Instant::now() + Duration::from_secs(5);
        while listening.in_flight() < MAX_IN_FLIGHT && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(listening.in_flight(), MAX_IN_FLIGHT);
        let stop = UnixStream::connect(&path).unwrap();
        (&stop).write_all(request_line("stop").as_bytes()).unwrap();
        assert!(
            stopped_rx.recv_timeout(Duration::from_secs(3)).is_ok(),
            "a stop behind {MAX_IN_FLIGHT} waiting requests did not interrupt the VM"
        );
    }

    #[test]
    fn control_oversized_line_is_refused_before_parsing() {
        let line = vec![b' '; MAX_REQUEST_BYTES + 1];
        let refusal = check_request(&line, Some(1000), &who()).unwrap_err();
        assert!(refusal.error.unwrap().contains("longer than"));
    }
}
