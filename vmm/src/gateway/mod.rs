//! The model gateway (issue 7): carries one VM's model requests to an upstream model endpoint
//! over real HTTP (hyper), knows when a request is in flight (wait start) and when its answer
//! is ready (data ready), and keeps the answer until the VM takes it.
//!
//! The guest asks with its `model REQUEST_ID` command: it writes the id to the mailbox and
//! stops at an `out` to the model port; the VMM hands the id to the gateway
//! ([`ModelPort::exchange`]) and, once the answer is there, copies it into the guest's I/O
//! buffer and lets the guest go on (it digests what it got). An upstream error or an answer
//! that does not fit reaches the guest as an error, never as a hang.
//!
//! Upstream protocol: `POST {upstream}/requests/{id}` with a JSON body
//! `{"request": id, "vm": LABEL}`; the answer is the response body (2xx), anything else is an
//! error. The gateway is also an [`EventSource`] for the wait coordinator.
//!
//! An answer is read as it arrives (an upstream may stream it, chunked or as server-sent
//! events): its first bytes are said at once (`DataArriving`), so that an offloaded VM can be
//! got ready, and a request sent with [`Batching`] hands its answer over in batches as they
//! become deliverable (the seed's rule: a batch reaches its size or its time limit, or the
//! answer ends), buffering at most `Batching::buffer` bytes the guest has not taken: past that
//! the gateway stops reading the upstream, whose sends then wait (TCP back-pressure).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::wait::{EventSource, WaitEvent};

mod http;

pub(crate) use http::get_whole;
use http::{get, post, Sink};

/// What a request got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The response body.
    Data(Vec<u8>),
    /// Why there is none (the upstream's status, a connection error, a timeout).
    Error(Failure),
}

/// Why a request got no answer: its kind (which decides what the guest is told, such as its
/// errno) and the words for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// What kind of failure.
    pub kind: FailureKind,
    /// Why, in words.
    pub message: String,
}

/// The kinds of [`Failure`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The other side was silent too long, or the exchange outlasted its time.
    TimedOut,
    /// The body was larger than its bound.
    TooLarge,
    /// Anything else: no connection, an error status, a broken or short body, a file that
    /// differs from its manifest.
    Failed,
}

impl Failure {
    /// A failure of `kind`, said in `message`.
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Self::new(FailureKind::Failed, message)
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Self {
        Self::new(FailureKind::Failed, message)
    }
}

/// Errors setting the gateway up.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The upstream address is not `http://HOST:PORT[/PATH]`.
    #[error("model upstream `{0}`: expected http://HOST:PORT[/PATH]")]
    Upstream(String),
    /// The HTTP runtime could not start.
    #[error("cannot start the gateway's HTTP runtime")]
    Runtime(#[source] std::io::Error),
}

/// How far a request's answer has come.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Its first bytes have arrived; the rest is streaming in (said once per request).
    Arriving,
    /// A batch of a request sent with [`Batching`] is deliverable: the bytes that follow the
    /// ones taken before (taken), and when they became a batch (by size or by time).
    Batch(Vec<u8>, Instant),
    /// It is all there (taken); for a batched request, the bytes after the last batch.
    Done(Answer),
}

/// How far an answer in flight has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    /// Bytes of the body arrived, taken or not.
    pub received: u64,
    /// The length the response announced, if it did.
    pub total: Option<u64>,
    /// When the first bytes arrived.
    pub first_at: Option<Instant>,
    /// Bytes arrived and not taken.
    pub waiting: u64,
    /// When the oldest of those arrived.
    pub since: Option<Instant>,
}

/// How a request's answer is handed over while it streams in: a batch is deliverable once it
/// has `bytes` bytes or its oldest byte has waited `wait`; the rest goes when the answer
/// ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Batching {
    /// A batch of this many bytes goes at once.
    pub bytes: u64,
    /// A smaller one goes when its first byte has waited this long.
    pub wait: Duration,
    /// Most bytes kept on the host that the guest has not taken: past it the upstream is not
    /// read until the guest takes a batch (it may be passed by the one read that reached it:
    /// the HTTP stack reads a body a few hundred KiB at a time at most).
    pub buffer: u64,
}

impl Default for Batching {
    fn default() -> Self {
        Self {
            bytes: 16 << 10,
            wait: Duration::from_millis(100),
            buffer: 256 << 10,
        }
    }
}

/// Where the guest's model requests go (the VMM's side of the model port).
pub trait ModelPort: Send + Sync {
    /// Sends request `request` (its answer is kept until taken), to be handed over whole or,
    /// with `batching`, in batches (see [`wait_progress`](Self::wait_progress)).
    fn send(&self, request: u64, batching: Option<Batching>);

    /// The answer of `request`, waiting at most `timeout` for it (`None`: not yet).
    fn wait_for(&self, request: u64, timeout: Duration) -> Option<Answer>;

    /// Like [`wait_for`](Self::wait_for), but also returns, once, as soon as the first bytes
    /// of the answer arrive (`Progress::Arriving`), so that the VM can be got ready for it,
    /// and, with `batches`, for a batched request, each batch as it becomes deliverable.
    fn wait_progress(&self, request: u64, timeout: Duration, batches: bool) -> Option<Progress>;

    /// Sends request `request` and waits for its answer.
    fn exchange(&self, request: u64) -> Answer;

    /// Gives request `request` up (its command ended without its answer).
    fn cancel(&self, request: u64);

    /// Fetches `target` for the guest as request `request` (see [`Gateway::fetch`]).
    fn fetch(
        &self,
        request: u64,
        target: &crate::net::Target,
        options: &crate::net::NetOptions,
        limit: u64,
    );

    /// How far `request`'s answer has come, while it is in flight.
    fn flow(&self, request: u64) -> Option<Flow>;

    /// Reads `path` of `image` for the guest as request `request` (see [`Gateway::read`]).
    fn read(&self, request: u64, image: &Arc<crate::image::Image>, path: &str);
}

#[derive(Debug, Clone)]
struct Upstream {
    /// `host:port`, to connect to and for the `Host` header.
    authority: String,
    /// Path prefix without a trailing slash.
    prefix: String,
}

impl Upstream {
    fn parse(url: &str) -> Result<Self, GatewayError> {
        let bad = || GatewayError::Upstream(url.to_owned());
        let rest = url.strip_prefix("http://").ok_or_else(bad)?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let (host, port) = authority.rsplit_once(':').ok_or_else(bad)?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(bad());
        }
        Ok(Self {
            authority: authority.to_owned(),
            prefix: path.trim_end_matches('/').to_owned(),
        })
    }
}

/// Checks an upstream address without starting anything.
pub fn check_upstream(url: &str) -> Result<(), GatewayError> {
    Upstream::parse(url).map(|_| ())
}

/// Most answers kept for requests nobody has taken yet, and most events kept for a wait
/// coordinator that has not polled them. The guest picks its request ids: one that asks for
/// request after request and never waits for their answers must not make the VMM keep them
/// all. The oldest go first.
const MAX_KEPT: usize = 256;

/// Most requests out to the upstream at once. The guest picks its request ids and comes back
/// to the model port after each of its timers (1 ms at the shortest) with the same id or a new
/// one: a new id each time must not open connection after connection until the process runs
/// out of descriptors. A request beyond it is answered at once with an error.
pub const MAX_IN_FLIGHT: usize = 64;

/// Most bytes of an answer's body read: what fits the guest's I/O buffer. A larger answer is
/// refused as soon as it passes this (or announces a length over it), never read whole.
const MAX_ANSWER: u64 = crate::guest::IO_BUF_SIZE;

/// Most bytes buffered for a response head (status line and headers): an upstream that sends
/// an endless header is refused after this much.
const MAX_HEAD: usize = 64 << 10;

#[derive(Debug, Default)]
struct State {
    answers: HashMap<u64, Answer>,
    /// The answers' ids, oldest first (some may have been taken).
    order: VecDeque<u64>,
    events: VecDeque<WaitEvent>,
    /// Requests sent and not answered yet (at most [`MAX_IN_FLIGHT`]).
    in_flight: usize,
    /// The answers of the requests in flight, as far as they have come (a request sent again
    /// while in flight replaces its entry: the earlier send is superseded).
    partial: HashMap<u64, Partial>,
    /// The number the next send gets, to tell a request's sends apart.
    next_send: u64,
}

/// An answer arriving.
#[derive(Debug, Default)]
struct Partial {
    /// Which send of the request this is.
    send: u64,
    /// Its body so far, less the batches taken (they are not kept: a download may be far
    /// larger than any buffer).
    bytes: Vec<u8>,
    /// Its first bytes have arrived and `wait_progress` has not said so yet.
    arrival_unsaid: bool,
    /// Bytes of the body arrived so far, taken or not.
    received: u64,
    /// When its first bytes arrived.
    first_at: Option<Instant>,
    /// The length its response announced, if it did.
    total: Option<u64>,
    /// When the oldest byte not taken arrived.
    since: Option<Instant>,
    /// When the bytes not taken reached a batch's size, if they have.
    full_at: Option<Instant>,
    /// How it is handed over, if in batches.
    batching: Option<Batching>,
}

impl Partial {
    /// Bytes arrived and not taken.
    fn waiting(&self) -> usize {
        self.bytes.len()
    }

    /// Notes the moment the bytes not taken reach a batch's size.
    fn note_full(&mut self, now: Instant) {
        let full = self
            .batching
            .is_some_and(|b| self.waiting() as u64 >= b.bytes.max(1));
        if full {
            self.full_at.get_or_insert(now);
        }
    }

    /// Takes the bytes not taken yet if they make a deliverable batch at `now`; with when
    /// they became one.
    fn take_batch(&mut self, now: Instant) -> Option<(Vec<u8>, Instant)> {
        let by_time = self.batch_due().filter(|&due| due <= now);
        let since = match (self.full_at, by_time) {
            (Some(full), Some(due)) => full.min(due),
            (Some(at), None) | (None, Some(at)) => at,
            (None, None) => return None,
        };
        if self.waiting() == 0 {
            return None;
        }
        let batch = std::mem::take(&mut self.bytes);
        self.since = None;
        self.full_at = None;
        Some((batch, since))
    }

    /// When the bytes not taken make a batch by time, if there are any.
    fn batch_due(&self) -> Option<Instant> {
        self.since?.checked_add(self.batching?.wait)
    }
}

/// The gateway's state and the condition its waiters wait on, shared with its request tasks.
type Shared = (Mutex<State>, Condvar);

/// Locks the state; a lock poisoned by a panic elsewhere is taken as it is.
fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared
        .0
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl State {
    /// The `send`th send of `request` is over: its body was read whole (`Ok`: the answer is
    /// what it has not taken, read now, not when the body ended, as a batch may have been
    /// taken in between) or not (why). Kept for it, unless it was superseded or cancelled
    /// meanwhile.
    fn finish_send(&mut self, request: u64, send: u64, read: Result<(), Failure>) -> bool {
        if self.partial.get(&request).is_none_or(|p| p.send != send) {
            return false;
        }
        let partial = self.partial.remove(&request).unwrap_or_default();
        let answer = match read {
            Ok(()) => Answer::Data(partial.bytes),
            Err(why) => Answer::Error(why),
        };
        self.keep_answer(request, answer);
        true
    }

    fn keep_answer(&mut self, request: u64, answer: Answer) {
        self.answers.insert(request, answer);
        self.order.push_back(request);
        while self.answers.len() > MAX_KEPT || self.order.len() > 4 * MAX_KEPT {
            // The entry just pushed stays: the loop ends before it is the only one left.
            match self.order.pop_front() {
                Some(old) if old != request => {
                    self.answers.remove(&old);
                }
                Some(_) => {}
                None => break,
            }
        }
    }

    fn push_event(&mut self, event: WaitEvent) {
        self.events.push_back(event);
        while self.events.len() > MAX_KEPT {
            self.events.pop_front();
        }
    }
}

/// One VM's gateway.
#[derive(Debug)]
pub struct Gateway {
    /// Where model requests go (none: a VM that only downloads).
    upstream: Option<Upstream>,
    label: String,
    epoch: u64,
    timeout: Duration,
    runtime: tokio::runtime::Runtime,
    shared: Arc<Shared>,
}

/// What a request asks the network for.
#[derive(Debug, Clone)]
enum Exchange {
    /// A model request: `POST {upstream}/requests/{id}`, answered within the gateway's
    /// timeout, at most the guest's I/O buffer.
    Model(Upstream),
    /// A download for the guest (its origin allowed already): `GET`, at most `limit` bytes,
    /// given up once the origin sends nothing for `stall`.
    Get {
        target: crate::net::Target,
        limit: u64,
        stall: Duration,
        timeout: Duration,
    },
    /// A file of the VM's image, fetched (or taken from the staging) and verified whole
    /// before any of it is handed over.
    Read {
        image: Arc<crate::image::Image>,
        path: String,
    },
}

impl Gateway {
    /// A gateway to `upstream` (`http://HOST:PORT[/PATH]`; none for a VM without model
    /// requests) for the VM called `label`, in VM epoch `epoch`; a model request unanswered
    /// after `timeout` is answered with an error.
    pub fn new(
        upstream: Option<&str>,
        label: &str,
        epoch: u64,
        timeout: Duration,
    ) -> Result<Self, GatewayError> {
        let upstream = upstream.map(Upstream::parse).transpose()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("pvisor-gateway")
            .enable_all()
            .build()
            .map_err(GatewayError::Runtime)?;
        Ok(Self {
            upstream,
            label: label.to_owned(),
            epoch,
            timeout,
            runtime,
            shared: Arc::new((Mutex::new(State::default()), Condvar::new())),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.shared)
    }

    /// Sends `request` upstream; its answer is kept until taken (whole, or with `batching`
    /// in batches).
    pub fn send(&self, request: u64, batching: Option<Batching>) {
        match &self.upstream {
            Some(upstream) => self.start(request, batching, Exchange::Model(upstream.clone())),
            None => self.refuse(
                request,
                "this VM has no model upstream (pvisor run --vm-model-upstream URL)".into(),
            ),
        }
    }

    /// Fetches `target` for the guest as request `request` (an id of the caller's, apart from
    /// its model requests'), handed over in batches as `options.chunking` says: at most
    /// `limit` bytes, given up once the origin has sent nothing for `options.stall`, or is
    /// not done after `options.timeout`. The caller has checked the origin against the VM's
    /// allow-list.
    pub fn fetch(
        &self,
        request: u64,
        target: &crate::net::Target,
        options: &crate::net::NetOptions,
        limit: u64,
    ) {
        let get = Exchange::Get {
            target: target.clone(),
            limit,
            stall: options.stall,
            timeout: options.timeout,
        };
        let batching = options.chunking;
        self.start(request, Some(batching), get);
    }

    /// Reads `path` of `image` for the guest as request `request`: its answer is the whole
    /// file once it has been fetched and checked (or why not).
    pub fn read(&self, request: u64, image: &Arc<crate::image::Image>, path: &str) {
        let read = Exchange::Read {
            image: Arc::clone(image),
            path: path.to_owned(),
        };
        self.start(request, None, read);
    }

    /// How far `request`'s answer has come, while it is in flight.
    pub fn flow(&self, request: u64) -> Option<Flow> {
        let state = self.lock();
        let partial = state.partial.get(&request)?;
        Some(Flow {
            received: partial.received,
            total: partial.total,
            first_at: partial.first_at,
            waiting: partial.waiting() as u64,
            since: partial.since,
        })
    }

    /// Answers `request` at once with an error.
    fn refuse(&self, request: u64, why: String) {
        let mut state = self.lock();
        state.push_event(WaitEvent::WaitStart {
            request,
            epoch: self.epoch,
        });
        state.keep_answer(request, Answer::Error(why.into()));
        state.push_event(WaitEvent::DataReady {
            request,
            epoch: self.epoch,
        });
        self.shared.1.notify_all();
    }

    fn start(&self, request: u64, batching: Option<Batching>, exchange: Exchange) {
        let send = {
            let mut state = self.lock();
            if state.in_flight >= MAX_IN_FLIGHT {
                drop(state);
                return self.refuse(
                    request,
                    format!(
                        "request {request} refused: {MAX_IN_FLIGHT} requests are in flight \
                         already"
                    ),
                );
            }
            state.push_event(WaitEvent::WaitStart {
                request,
                epoch: self.epoch,
            });
            state.in_flight += 1;
            state.next_send += 1;
            let send = state.next_send;
            // A request sent again while in flight supersedes its earlier send, whose bytes
            // and answer go nowhere from now on.
            state.partial.insert(
                request,
                Partial {
                    send,
                    batching,
                    ..Partial::default()
                },
            );
            send
        };
        let shared = Arc::clone(&self.shared);
        let (label, epoch, timeout) = (self.label.clone(), self.epoch, self.timeout);
        let sink = Sink {
            shared: Arc::clone(&self.shared),
            request,
            epoch,
            send,
        };
        self.runtime.spawn(async move {
            let read = match exchange {
                Exchange::Model(upstream) => {
                    let post = post(&upstream, &label, request, &sink);
                    match tokio::time::timeout(timeout, post).await {
                        Ok(read) => read,
                        Err(_) => Err(Failure::new(
                            FailureKind::TimedOut,
                            format!("no answer within {} s", timeout.as_secs_f64()),
                        )),
                    }
                }
                Exchange::Get {
                    target,
                    limit,
                    stall,
                    timeout,
                } => {
                    let get = get(&target, limit, stall, &sink);
                    match tokio::time::timeout(timeout, get).await {
                        Ok(read) => read,
                        Err(_) => Err(Failure::new(
                            FailureKind::TimedOut,
                            format!("GET {target}: not done within {} s", timeout.as_secs_f64()),
                        )),
                    }
                }
                Exchange::Read { image, path } => {
                    // The origin's client blocks: off the runtime's one worker.
                    let fetched = tokio::task::spawn_blocking(move || image.fetch(&path)).await;
                    match fetched {
                        Ok(Ok(fetched)) => {
                            sink.announce(fetched.bytes.len() as u64);
                            if fetched.bytes.is_empty() || sink.push(&fetched.bytes) {
                                Ok(())
                            } else {
                                Err("the read was given up".into())
                            }
                        }
                        Ok(Err(why)) => Err(why),
                        Err(e) => Err(format!("the read failed: {e}").into()),
                    }
                }
            };
            let mut state = lock(&shared);
            state.in_flight = state.in_flight.saturating_sub(1);
            if state.finish_send(request, send, read) {
                state.push_event(WaitEvent::DataReady { request, epoch });
                shared.1.notify_all();
            }
        });
    }

    /// Gives up `request`: its answer, whatever of it has come and whatever comes later go
    /// nowhere, and the upstream is no longer read for it once anything more arrives (the
    /// command that sent it ended without it).
    pub fn cancel(&self, request: u64) {
        let mut state = self.lock();
        state.partial.remove(&request);
        state.answers.remove(&request);
    }

    /// The answer of `request` if it is there (taken: each answer is handed out once).
    pub fn take(&self, request: u64) -> Option<Answer> {
        self.lock().answers.remove(&request)
    }

    /// Waits for the answer of `request` and takes it (an error once the timeout has passed
    /// with some slack: the request task always answers by then).
    pub fn wait(&self, request: u64) -> Answer {
        ModelPort::wait_for(self, request, self.timeout + Duration::from_secs(1))
            .unwrap_or_else(|| Answer::Error("the gateway lost the request".into()))
    }
}

impl ModelPort for Gateway {
    fn send(&self, request: u64, batching: Option<Batching>) {
        Gateway::send(self, request, batching);
    }

    fn wait_for(&self, request: u64, timeout: Duration) -> Option<Answer> {
        match self.wait_until(request, timeout, false, false)? {
            Progress::Done(answer) => Some(answer),
            // Said only when asked for.
            Progress::Arriving | Progress::Batch(..) => None,
        }
    }

    fn wait_progress(&self, request: u64, timeout: Duration, batches: bool) -> Option<Progress> {
        self.wait_until(request, timeout, true, batches)
    }

    fn exchange(&self, request: u64) -> Answer {
        Gateway::send(self, request, None);
        self.wait(request)
    }

    fn cancel(&self, request: u64) {
        Gateway::cancel(self, request);
    }

    fn fetch(
        &self,
        request: u64,
        target: &crate::net::Target,
        options: &crate::net::NetOptions,
        limit: u64,
    ) {
        Gateway::fetch(self, request, target, options, limit);
    }

    fn flow(&self, request: u64) -> Option<Flow> {
        Gateway::flow(self, request)
    }

    fn read(&self, request: u64, image: &Arc<crate::image::Image>, path: &str) {
        Gateway::read(self, request, image, path);
    }
}

impl Gateway {
    /// Waits at most `timeout` for `request`'s answer, or (if `arrival`) for its first bytes,
    /// or (if `batches`) for a batch.
    fn wait_until(
        &self,
        request: u64,
        timeout: Duration,
        arrival: bool,
        batches: bool,
    ) -> Option<Progress> {
        let ready = &self.shared.1;
        let mut state = self.lock();
        // A timeout too long for an `Instant` is no timeout (an hour at a time).
        let deadline = Instant::now().checked_add(timeout);
        loop {
            if let Some(answer) = state.answers.remove(&request) {
                return Some(Progress::Done(answer));
            }
            if let Some(partial) = state.partial.get_mut(&request) {
                if arrival && partial.arrival_unsaid {
                    partial.arrival_unsaid = false;
                    return Some(Progress::Arriving);
                }
                if let Some((batch, since)) = batches
                    .then(|| partial.take_batch(Instant::now()))
                    .flatten()
                {
                    return Some(Progress::Batch(batch, since));
                }
            }
            let mut left = deadline.map_or(Duration::from_secs(3600), |d| {
                d.saturating_duration_since(Instant::now())
            });
            if batches {
                // A batch that falls due by time wakes nobody: look again then.
                if let Some(due) = state.partial.get(&request).and_then(Partial::batch_due) {
                    left = left.min(due.saturating_duration_since(Instant::now()));
                }
            }
            if left.is_zero() {
                return None;
            }
            state = ready
                .wait_timeout(state, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

impl EventSource for Gateway {
    fn poll(&mut self) -> Vec<WaitEvent> {
        self.lock().events.drain(..).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_keeps_a_bounded_number_of_answers_and_events_newest_first() {
        let mut state = State::default();
        for request in 0..10_000u64 {
            state.keep_answer(request, Answer::Data(vec![0; 8]));
            state.push_event(WaitEvent::DataReady { request, epoch: 0 });
        }
        assert_eq!(state.answers.len(), MAX_KEPT);
        assert!(state.order.len() <= 4 * MAX_KEPT);
        assert_eq!(state.events.len(), MAX_KEPT);
        assert!(state.answers.contains_key(&9_999));
        assert!(!state.answers.contains_key(&0));
        // The same id answered again (a retry) is kept once.
        for _ in 0..10_000 {
            state.keep_answer(5, Answer::Data(vec![1]));
        }
        assert!(state.answers.contains_key(&5));
        assert!(state.order.len() <= 4 * MAX_KEPT);
    }

    #[test]
    fn gateway_requests_in_flight_beyond_the_cap_are_answered_with_an_error_at_once() {
        // An upstream that takes connections and never answers.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("a local port");
        let url = format!("http://{}", silent.local_addr().expect("bound"));
        let gateway = Gateway::new(Some(&url), "t", 0, Duration::from_secs(60)).expect("a gateway");
        for request in 0..MAX_IN_FLIGHT as u64 {
            gateway.send(request, None);
        }
        // A guest that asks for request after request (a new id after each of its timers).
        gateway.send(u64::MAX, None);
        let answer = ModelPort::wait_for(&gateway, u64::MAX, Duration::from_secs(2));
        match answer {
            Some(Answer::Error(why)) => assert!(why.message.contains("in flight"), "{why}"),
            other => panic!("request over the cap got {other:?}"),
        }
        // The ones within the cap are still waiting for the upstream.
        assert_eq!(gateway.take(0), None);
    }

    #[test]
    fn gateway_batched_answer_holds_the_upstream_back_past_its_buffer_and_loses_nothing() {
        use std::io::Write;
        const ONE_READ: usize = 400 << 10;
        // An upstream that sends 1 MiB as fast as it can.
        let len = 1usize << 20;
        let body: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a local port");
        let url = format!("http://{}", listener.local_addr().expect("bound"));
        let sent = body.clone();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("the gateway connects");
            testkit::http::read_head(&stream);
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\n");
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&sent);
        });
        let gateway = Gateway::new(Some(&url), "t", 0, Duration::from_secs(20)).expect("a gateway");
        let batching = Batching {
            bytes: 16 << 10,
            wait: Duration::from_millis(10),
            buffer: 128 << 10,
        };
        gateway.send(1, Some(batching));
        // Nobody takes a batch: the gateway reads no further than its buffer and the read
        // that filled it (hyper's reads of a body are of at most a few hundred KiB).
        std::thread::sleep(Duration::from_millis(500));
        let held = gateway.lock().partial.get(&1).map_or(0, |p| p.bytes.len());
        assert!(
            (1..=ONE_READ + (128 << 10)).contains(&held),
            "{held} bytes read while nobody took a batch"
        );
        // Taken batch by batch, then the rest: every byte, in order.
        let mut got = Vec::new();
        let mut batches = 0;
        loop {
            match gateway.wait_progress(1, Duration::from_secs(10), true) {
                Some(Progress::Arriving) => {}
                Some(Progress::Batch(bytes, _)) => {
                    assert!(bytes.len() <= ONE_READ + (128 << 10), "{}", bytes.len());
                    batches += 1;
                    got.extend(bytes);
                }
                Some(Progress::Done(Answer::Data(rest))) => {
                    got.extend(rest);
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(batches >= 2, "{batches} batches");
        assert!(got == body, "{} bytes, not the ones sent", got.len());
    }

    #[test]
    fn gateway_request_sent_again_in_flight_supersedes_its_first_send_and_cancel_drops_it() {
        use std::io::Write;
        // An upstream whose k-th connection answers 4096 bytes of b'a' + k, in two halves.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a local port");
        let url = format!("http://{}", listener.local_addr().expect("bound"));
        std::thread::spawn(move || {
            for (k, stream) in listener.incoming().enumerate() {
                let Ok(mut stream) = stream else { continue };
                std::thread::spawn(move || {
                    testkit::http::read_head(&stream);
                    std::thread::sleep(Duration::from_millis(100));
                    let head = "HTTP/1.1 200 OK\r\ncontent-length: 4096\r\n\r\n";
                    let body = vec![b'a' + k as u8; 4096];
                    let _ = stream.write_all(head.as_bytes());
                    let _ = stream.write_all(&body[..2048]);
                    std::thread::sleep(Duration::from_millis(100));
                    let _ = stream.write_all(&body[2048..]);
                });
            }
        });
        let gateway = Gateway::new(Some(&url), "t", 0, Duration::from_secs(10)).expect("a gateway");
        let whole = Batching {
            bytes: 1 << 20,
            wait: Duration::from_secs(10),
            buffer: 1 << 20,
        };
        gateway.send(1, Some(whole));
        std::thread::sleep(Duration::from_millis(30));
        gateway.send(1, Some(whole));
        // The second send's answer, whole and unmixed; the first's goes nowhere.
        assert_eq!(gateway.wait(1), Answer::Data(vec![b'b'; 4096]));
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(gateway.take(1), None);
        // Given up: nothing of it is kept.
        gateway.send(2, None);
        std::thread::sleep(Duration::from_millis(150));
        gateway.cancel(2);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(gateway.take(2), None);
        assert_eq!(gateway.lock().partial.len(), 0);
    }

    #[test]
    fn upstream_parses_host_port_and_prefix() {
        let u = Upstream::parse("http://127.0.0.1:8080/v1/").expect("valid");
        assert_eq!(u.authority, "127.0.0.1:8080");
        assert_eq!(u.prefix, "/v1");
        assert_eq!(
            Upstream::parse("http://localhost:9").expect("valid").prefix,
            ""
        );
        for bad in [
            "https://x:1",
            "http://x",
            "http://:80",
            "http://x:port",
            "x:1",
        ] {
            assert!(Upstream::parse(bad).is_err(), "{bad}");
        }
    }
}
