//! The gateway's side of HTTP: one exchange on a fresh connection (a model request's POST, a
//! download's GET), its body read bounded into the request's [`Sink`] as it arrives.

use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;

use super::{lock, Failure, FailureKind, Shared, State, Upstream, MAX_ANSWER, MAX_HEAD};
use crate::wait::WaitEvent;

/// Where a successful answer's body goes as it arrives: its request's [`Partial`] in the
/// gateway's state.
pub(super) struct Sink {
    pub(super) shared: Arc<Shared>,
    pub(super) request: u64,
    pub(super) epoch: u64,
    /// Which send of the request it reads for.
    pub(super) send: u64,
}

impl Sink {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.shared)
    }

    /// Adds `data` to the answer; its first bytes are said (`DataArriving`). False if the
    /// send was superseded or cancelled: read no more.
    pub(super) fn push(&self, data: &[u8]) -> bool {
        let mut state = self.lock();
        let send = self.send;
        let Some(partial) = state
            .partial
            .get_mut(&self.request)
            .filter(|p| p.send == send)
        else {
            return false;
        };
        let first = partial.received == 0;
        partial.bytes.extend_from_slice(data);
        partial.received += data.len() as u64;
        let now = Instant::now();
        partial.first_at.get_or_insert(now);
        partial.since.get_or_insert(now);
        partial.note_full(now);
        if first {
            partial.arrival_unsaid = true;
            state.push_event(WaitEvent::DataArriving {
                request: self.request,
                epoch: self.epoch,
            });
        }
        self.shared.1.notify_all();
        true
    }

    /// Whether the bytes the guest has not taken fill the host's buffer (read no more).
    pub(super) fn full(&self) -> bool {
        let state = self.lock();
        state.partial.get(&self.request).is_some_and(|p| {
            p.send == self.send
                && p.batching
                    .is_some_and(|b| p.waiting() as u64 >= b.buffer.max(1))
        })
    }

    /// The response announced `total` bytes of body.
    pub(super) fn announce(&self, total: u64) {
        let mut state = self.lock();
        if let Some(partial) = state.partial.get_mut(&self.request) {
            if partial.send == self.send {
                partial.total = Some(total);
            }
        }
    }
}

/// How often a reader held back by a full host buffer looks again.
const BACKPRESSURE_POLL: Duration = Duration::from_millis(2);

/// A model request: `POST {upstream}/requests/{id}` on a fresh connection. A successful
/// answer's body goes to `sink` as it arrives (an answer streamed in chunks, or as
/// server-sent events, is read as it comes); `Err` says why there is no answer.
pub(super) async fn post(
    upstream: &Upstream,
    label: &str,
    request: u64,
    sink: &Sink,
) -> Result<(), Failure> {
    let body = serde_json::json!({ "request": request, "vm": label }).to_string();
    let built = hyper::Request::post(format!("{}/requests/{request}", upstream.prefix))
        .header(hyper::header::HOST, &upstream.authority)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("request {request}: {e}"))?;
    let what = format!("request {request}");
    let side = Side::Upstream;
    exchange(
        &upstream.authority,
        built,
        &what,
        MAX_ANSWER,
        side,
        Some(sink),
    )
    .await
    .map(drop)
}

/// A download: `GET` of `target` on a fresh connection, its body to `sink` as it arrives, at
/// most `limit` bytes, given up when the origin is silent for `stall` (the connection, the
/// response head and each read of the body).
pub(super) async fn get(
    target: &crate::net::Target,
    limit: u64,
    stall: Duration,
    sink: &Sink,
) -> Result<(), Failure> {
    get_to(target, limit, stall, Some(sink)).await.map(drop)
}

/// `GET` of `target` on a fresh connection, its whole body returned: at most `limit` bytes,
/// given up when the origin is silent for `stall` (an image file from an HTTP origin).
pub(crate) async fn get_whole(
    target: &crate::net::Target,
    limit: u64,
    stall: Duration,
) -> Result<Vec<u8>, Failure> {
    get_to(target, limit, stall, None).await
}

/// `GET` of `target`: its body to `sink` as it arrives, or returned if there is none.
async fn get_to(
    target: &crate::net::Target,
    limit: u64,
    stall: Duration,
    sink: Option<&Sink>,
) -> Result<Vec<u8>, Failure> {
    let built = hyper::Request::get(target.path())
        .header(hyper::header::HOST, target.authority())
        .header(hyper::header::USER_AGENT, "pvisor")
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("GET {target}: {e}"))?;
    let what = format!("GET {target}");
    let side = Side::Origin { stall };
    exchange(target.authority(), built, &what, limit, side, sink).await
}

/// Who answers an exchange, and so how it is waited for and what of its words is said.
#[derive(Debug, Clone, Copy)]
enum Side {
    /// A model upstream: waited for within the request's timeout; the body of an error
    /// answer says why, and is quoted.
    Upstream,
    /// A download's origin: given up after `stall` of silence; its error bodies are not
    /// quoted (they could pass for the gateway's own words).
    Origin { stall: Duration },
}

/// Waits for `step`, at most `stall` if given.
async fn within<T>(
    stall: Option<Duration>,
    what: &str,
    step: impl std::future::Future<Output = T>,
) -> Result<T, Failure> {
    match stall {
        None => Ok(step.await),
        Some(stall) => tokio::time::timeout(stall, step)
            .await
            .map_err(|_| silent(what, stall)),
    }
}

/// `what` was given up: nothing came from the origin for `stall`.
fn silent(what: &str, stall: Duration) -> Failure {
    Failure::new(
        FailureKind::TimedOut,
        format!(
            "{what}: nothing from the origin for {} s",
            stall.as_secs_f64()
        ),
    )
}

/// One HTTP/1.1 exchange with `authority` on a fresh connection: `request` sent, the body of
/// a successful answer (2xx) to `sink` as it arrives (or returned, without one), at most
/// `limit` bytes; anything else an error naming `what`.
async fn exchange(
    authority: &str,
    request: hyper::Request<Full<Bytes>>,
    what: &str,
    limit: u64,
    side: Side,
    sink: Option<&Sink>,
) -> Result<Vec<u8>, Failure> {
    let stall = match side {
        Side::Upstream => None,
        Side::Origin { stall } => Some(stall),
    };
    let stream = within(stall, what, tokio::net::TcpStream::connect(authority))
        .await?
        .map_err(|e| format!("cannot connect to {authority}: {e}"))?;
    let io = hyper_util::rt::TokioIo::new(stream);
    let handshake = hyper::client::conn::http1::Builder::new()
        .max_buf_size(MAX_HEAD)
        .handshake(io)
        .await;
    let (mut sender, connection) =
        handshake.map_err(|e| format!("HTTP handshake with {authority}: {e}"))?;
    tokio::spawn(connection);
    let response = match within(stall, what, sender.send_request(request)).await? {
        Ok(response) => response,
        // hyper tells a head over `max_buf_size` from other parse errors only with its
        // `server` feature: name the limit for both.
        Err(e) if e.is_parse() => {
            return Err(format!(
                "{what} to {authority}: the answer's head (status line and headers, at most {} KiB) is invalid: {e}",
                MAX_HEAD >> 10
            )
            .into())
        }
        Err(e) => return Err(format!("{what} to {authority}: {e}").into()),
    };
    let status = response.status();
    if !status.is_success() {
        // An error's body is no answer: nothing to get ready for, nothing to hand over; a
        // little of it says why.
        if let Side::Origin { .. } = side {
            return Err(format!("{what}: {authority} answered {status}").into());
        }
        let body = read_bounded(response.into_body(), 4096, None, stall)
            .await
            .unwrap_or_default();
        return Err(format!(
            "{what}: {authority} answered {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)]).trim()
        )
        .into());
    }
    if let Some(sink) = sink {
        use hyper::body::Body;
        if let Some(total) = response.body().size_hint().exact() {
            sink.announce(total);
        }
    }
    match read_bounded(response.into_body(), limit, sink, stall).await {
        Ok(bytes) => Ok(bytes),
        Err(BodyError::TooLarge) => Err(Failure::new(
            FailureKind::TooLarge,
            format!("{what}: the answer is over {limit} bytes"),
        )),
        Err(BodyError::Read(e)) => Err(format!("{what}: reading the answer: {e}").into()),
        Err(BodyError::Stalled) => Err(silent(what, stall.unwrap_or_default())),
        Err(BodyError::Abandoned) => Err(format!("{what} was sent again or given up").into()),
    }
}

/// Why a body was not read.
#[derive(Debug)]
enum BodyError {
    /// It announced, or sent, more than the limit.
    TooLarge,
    /// The connection failed.
    Read(hyper::Error),
    /// The request was sent again or given up: nobody reads this answer.
    Abandoned,
    /// The origin sent nothing for the stall time.
    Stalled,
}

/// Reads `body` whole if it has at most `limit` bytes; stops (and drops the connection) as soon
/// as it announces or sends more, or (with `stall`) once no frame came for that long. The
/// bytes go to `sink` as they arrive (then none are returned), reading no further while its
/// host buffer is full (that wait is not a stall); else they are returned.
async fn read_bounded(
    mut body: hyper::body::Incoming,
    limit: u64,
    sink: Option<&Sink>,
    stall: Option<Duration>,
) -> Result<Vec<u8>, BodyError> {
    use hyper::body::Body;
    if body.size_hint().lower() > limit {
        return Err(BodyError::TooLarge);
    }
    let mut bytes = Vec::new();
    let mut read = 0u64;
    loop {
        while sink.is_some_and(Sink::full) {
            tokio::time::sleep(BACKPRESSURE_POLL).await;
        }
        let next = match stall {
            Some(stall) => tokio::time::timeout(stall, body.frame())
                .await
                .map_err(|_| BodyError::Stalled)?,
            None => body.frame().await,
        };
        let Some(frame) = next else {
            return Ok(bytes);
        };
        let frame = frame.map_err(BodyError::Read)?;
        if let Ok(data) = frame.into_data() {
            read = read.saturating_add(data.len() as u64);
            if read > limit {
                return Err(BodyError::TooLarge);
            }
            match sink {
                Some(sink) if !data.is_empty() => {
                    if !sink.push(&data) {
                        return Err(BodyError::Abandoned);
                    }
                }
                Some(_) => {}
                None => bytes.extend_from_slice(&data),
            }
        }
    }
}
