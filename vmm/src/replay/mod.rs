//! Trajectory replay (issue 7): an agent's recorded run — model waits with their durations
//! and answers, tool phases as workload-guest scripts — and a local model server that answers
//! each request with its recorded bytes, streamed as a model API streams its tokens: the
//! response head at once, the body in [`ANSWER_CHUNKS`] equal chunks over the last quarter of
//! the recorded wait, the last at its end (so the answer is whole exactly when it was).
//!
//! A trajectory file is JSON:
//! `{"name": …, "steps": [{"model": {"wait_ms": 5290.5, "answer_bytes": 2048}},
//! {"tool": {"script": "fill 24MiB random seed=3; digest; release"}}, …]}`. Model step `i`
//! (counting model steps from 1) is request `i`; its answer is [`answer`]`(i, answer_bytes)`,
//! bytes anyone can compute, so a replay checks every answer the guest digested.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::channel::Channel;
use http_body_util::{BodyExt, Either, Full};
use hyper::body::Bytes;

use crate::script::{self, Command};

mod io;

pub use io::{download_body, DEFAULT_DOWNLOAD_RATE, DEFAULT_IMAGE_RATE, MAX_IO_BYTES};

/// Errors of trajectories and the replay server.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The file could not be read.
    #[error("cannot read trajectory {path}")]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a trajectory.
    #[error("trajectory {path}: {reason}")]
    Invalid {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The model server could not listen.
    #[error("the replay model server cannot listen")]
    Listen(#[source] std::io::Error),
}

/// One step of a trajectory.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Step {
    /// The agent waits for the model.
    Model {
        /// How long the model took, milliseconds.
        wait_ms: f64,
        /// Bytes of its answer.
        answer_bytes: u64,
    },
    /// A tool runs in the VM: a workload-guest script.
    Tool {
        /// The script.
        script: String,
    },
    /// The agent downloads this many bytes (a package, a checkout) from an origin held to
    /// the trajectory's download rate: `download` of the replay server's download `k`
    /// (counting download steps from 1).
    Download {
        /// Its length.
        bytes: u64,
    },
    /// The agent reads a file of its image, fetched at the trajectory's image rate on its
    /// first read: `read PATH`.
    Read {
        /// The file, from the image's root (the same length wherever it is read).
        path: String,
        /// Its length.
        bytes: u64,
    },
}

/// A recorded agent run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Trajectory {
    /// Its name.
    pub name: String,
    /// Where it comes from and how it was shaped.
    #[serde(default)]
    pub note: String,
    /// The factor its waits were scaled by (1: as recorded); a replay scales the wait policy by
    /// it too, so that pauses, offloads and cooldowns keep their proportion to the waits.
    #[serde(default = "one")]
    pub time_scale: f64,
    /// The steps, in order.
    pub steps: Vec<Step>,
    /// The rate of the downloads' origin, bytes a second, as recorded (default
    /// [`DEFAULT_DOWNLOAD_RATE`]); a replay divides it by `time_scale`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub download_rate: Option<u64>,
    /// The rate of the image's origin on a first read (default [`DEFAULT_IMAGE_RATE`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_rate: Option<u64>,
}

fn one() -> f64 {
    1.0
}

/// Most bytes of a trajectory file (see [`Trajectory::load`]).
pub const TRAJECTORY_LIMIT: u64 = 64 << 20;

/// Most bytes of one answer (the guest's I/O buffer).
pub const MAX_ANSWER: u64 = crate::guest::IO_BUF_SIZE;

/// Longest model wait (and tool `sleep`) of a step, milliseconds: one hour. Recorded model
/// calls take seconds to minutes; an hour is far beyond any, and keeps every wait (and the
/// sum of all of them) well inside what `Duration` and `Instant` arithmetic can hold.
pub const MAX_WAIT_MS: f64 = MAX_SLEEP_MS as f64;

/// [`MAX_WAIT_MS`] for a tool's `sleep MS`.
const MAX_SLEEP_MS: u64 = 3_600_000;

/// Most steps of a trajectory: recorded agent runs have tens to hundreds; the whole run goes
/// to each VM as one script.
pub const MAX_STEPS: usize = 100_000;

impl Trajectory {
    /// Reads and checks a trajectory file.
    pub fn load(path: &Path) -> Result<Self, ReplayError> {
        // A trajectory is a few KiB to a few MiB of JSON (one line per step, answers given
        // by size, not content); 64 MiB is far beyond any recorded run, and keeps
        // `replay /dev/zero` or a huge file from filling memory. FIFOs and devices are refused.
        let text =
            compressed_backing::file::read_text_bounded(path, TRAJECTORY_LIMIT).map_err(|e| {
                ReplayError::Read {
                    path: path.to_path_buf(),
                    source: e.into(),
                }
            })?;
        let invalid = |reason: String| ReplayError::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        let trajectory: Trajectory =
            serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        trajectory.check().map_err(invalid)?;
        Ok(trajectory)
    }

    /// Checks every number before anything uses it: a wait that `Duration` cannot hold
    /// (`1e300`), a negative or NaN one, a scale that would make the wait policy meaningless,
    /// an answer that cannot fit the guest, a tool script that does not parse, waits or asks
    /// the model itself (its request would not be in the trajectory).
    fn check(&self) -> Result<(), String> {
        if self.steps.is_empty() {
            return Err("no steps".into());
        }
        if self.steps.len() > MAX_STEPS {
            return Err(format!("{} steps, more than {MAX_STEPS}", self.steps.len()));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0 && self.time_scale <= 100.0) {
            return Err(format!(
                "time_scale {:?} (above 0, at most 100)",
                self.time_scale
            ));
        }
        // Each file's first length, gathered once for the reads' checks.
        let files = self.image_files();
        for (i, step) in self.steps.iter().enumerate() {
            let n = i + 1;
            match step {
                Step::Model {
                    wait_ms,
                    answer_bytes,
                } => {
                    if !(wait_ms.is_finite() && *wait_ms >= 0.0 && *wait_ms <= MAX_WAIT_MS) {
                        return Err(format!(
                            "step {n} (model): wait_ms {wait_ms:?} is not a number of \
                             milliseconds from 0 to {MAX_WAIT_MS} (one hour)"
                        ));
                    }
                    if *answer_bytes > MAX_ANSWER {
                        return Err(format!(
                            "step {n} (model): answer_bytes {answer_bytes} is more than \
                             {MAX_ANSWER} (the guest's I/O buffer)"
                        ));
                    }
                }
                Step::Download { .. } | Step::Read { .. } => self.check_io(n, step, &files)?,
                Step::Tool { script } => {
                    let commands =
                        script::parse(script).map_err(|e| format!("step {n} (tool): {e}"))?;
                    for command in commands {
                        match command {
                            Command::Model { .. } => {
                                return Err(format!(
                                    "step {n} (tool): `{command}`: a tool script cannot ask \
                                     the model (model steps do)"
                                ))
                            }
                            // As many milliseconds as a model wait may take.
                            Command::Sleep { ms } if ms > MAX_SLEEP_MS => {
                                return Err(format!(
                                    "step {n} (tool): `{command}` is longer than \
                                     {MAX_WAIT_MS} ms (one hour)"
                                ))
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The model steps: (request id, wait, answer bytes).
    pub fn requests(&self) -> Vec<(u64, Duration, u64)> {
        let mut id = 0;
        self.steps
            .iter()
            .filter_map(|step| match step {
                Step::Model {
                    wait_ms,
                    answer_bytes,
                } => {
                    id += 1;
                    Some((id, Duration::from_secs_f64(wait_ms / 1e3), *answer_bytes))
                }
                Step::Tool { .. } | Step::Download { .. } | Step::Read { .. } => None,
            })
            .collect()
    }

    /// Total model wait.
    pub fn total_wait(&self) -> Duration {
        self.requests().iter().map(|r| r.1).sum()
    }

    /// The whole run as one workload script: `model ID` for each model step, the tool
    /// scripts as they are, the downloads from the replay server at `origin` and the reads
    /// of the image, each with the length and digest it must have.
    pub fn script(&self, origin: &str) -> Vec<Command> {
        self.script_taking(false, origin)
    }

    /// Whether it downloads, and whether it reads an image.
    pub fn has_io(&self) -> (bool, bool) {
        let has = |f: fn(&Step) -> bool| self.steps.iter().any(f);
        (
            has(|s| matches!(s, Step::Download { .. })),
            has(|s| matches!(s, Step::Read { .. })),
        )
    }

    /// The same, with each answer taken in batches as it streams in (`model ID stream`) if
    /// `stream`.
    pub fn script_taking(&self, stream: bool, origin: &str) -> Vec<Command> {
        let mut id = 0;
        let mut downloads = 0;
        let digests = self.image_digests();
        let mut out = Vec::new();
        for step in &self.steps {
            if matches!(step, Step::Download { .. }) {
                downloads += 1;
            }
            if let Some(command) = Self::io_command(step, downloads, origin, &digests) {
                out.push(command);
                continue;
            }
            match step {
                Step::Model { .. } => {
                    id += 1;
                    out.push(Command::Model {
                        request: id,
                        timer_ms: None,
                        stream,
                    });
                }
                Step::Tool { script } => {
                    out.extend(script::parse(script).expect("checked when loaded"));
                }
                Step::Download { .. } | Step::Read { .. } => {}
            }
        }
        out
    }
}

/// The answer to request `id`: `len` bytes anyone can compute.
pub fn answer(id: u64, len: u64) -> Vec<u8> {
    let mut state = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 32) as u8
        })
        .collect()
}

/// A local model server answering a trajectory's requests after their recorded waits
/// (`POST …/requests/ID`, HTTP/1.1 through hyper, one connection per request), on a small
/// tokio runtime of its own.
#[derive(Debug)]
pub struct ReplayServer {
    address: SocketAddr,
    /// Dropped (or sent) to stop accepting.
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: Arc<AtomicU64>,
}

/// Most bytes of a request's head (request line and headers) the replay server reads.
const MAX_REQUEST_HEAD: usize = 64 << 10;
/// Most bytes of a request's body it reads (the gateway's are a few dozen).
const MAX_REQUEST_BODY: usize = 1 << 20;
/// How long reading one request's head may wait for its peer.
const REQUEST_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What the server answers: each model request's recorded answer (id, wait, answer bytes),
/// and the downloads.
#[derive(Debug)]
struct Replies {
    requests: Vec<(u64, Duration, u64)>,
    downloads: Arc<io::Downloads>,
}

type Recorded = Arc<Replies>;

/// An answer streams in this many equal chunks (fewer if it has fewer bytes).
pub const ANSWER_CHUNKS: u64 = 20;

/// The share of a recorded wait over which its answer streams: the last quarter.
const STREAMED_SHARE: f64 = 0.25;

/// When each chunk of an answer of `len` bytes recorded after `wait` is sent (counted from the
/// request), and which bytes it carries: [`ANSWER_CHUNKS`] equal chunks, one every
/// `wait / 4 / ANSWER_CHUNKS` from three quarters of the wait on, the last at `wait`.
pub fn answer_chunks(wait: Duration, len: u64) -> Vec<(Duration, std::ops::Range<usize>)> {
    let n = len.min(ANSWER_CHUNKS);
    (1..=n)
        .map(|k| {
            let at = wait.mul_f64(1.0 - STREAMED_SHARE + STREAMED_SHARE * k as f64 / n as f64);
            let bytes = ((k - 1) * len / n) as usize..(k * len / n) as usize;
            (at, bytes)
        })
        .collect()
}

/// A response body: a whole one (errors) or an answer streaming in.
type ReplyBody = Either<Full<Bytes>, Channel<Bytes>>;

impl ReplayServer {
    /// Serves `trajectory`'s requests on 127.0.0.1 (a free port).
    pub fn start(trajectory: &Trajectory) -> Result<Self, ReplayError> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(ReplayError::Listen)?;
        let address = listener.local_addr().map_err(ReplayError::Listen)?;
        listener
            .set_nonblocking(true)
            .map_err(ReplayError::Listen)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("replay-model")
            .enable_all()
            .build()
            .map_err(ReplayError::Listen)?;
        let requests: Recorded = Arc::new(Replies {
            requests: trajectory.requests(),
            downloads: io::Downloads::of(trajectory),
        });
        let served = Arc::new(AtomicU64::new(0));
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let counter = Arc::clone(&served);
        let listener = {
            let _entered = runtime.enter();
            tokio::net::TcpListener::from_std(listener).map_err(ReplayError::Listen)?
        };
        std::thread::Builder::new()
            .name("replay-model".into())
            .spawn(move || runtime.block_on(accept(listener, requests, counter, stopped)))
            .map_err(ReplayError::Listen)?;
        Ok(Self {
            address,
            stop: Some(stop),
            served,
        })
    }

    /// `http://127.0.0.1:PORT`, for `--vm-model-upstream`.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Requests answered so far.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }
}

impl Drop for ReplayServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Accepts connections until `stopped`, each served on its own task; the runtime (and the
/// answers still waiting) ends with it.
async fn accept(
    listener: tokio::net::TcpListener,
    requests: Recorded,
    served: Arc<AtomicU64>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    loop {
        let stream = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of descriptors, say: try again shortly.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
            },
        };
        let (requests, served) = (Arc::clone(&requests), Arc::clone(&served));
        tokio::spawn(async move {
            // Anyone on the host can connect to 127.0.0.1: a request's head is read bounded in
            // size and time, its body bounded in size, or the connection is dropped.
            let service =
                hyper::service::service_fn(move |request| respond(request, Arc::clone(&requests)));
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(REQUEST_READ_TIMEOUT)
                .max_buf_size(MAX_REQUEST_HEAD)
                .keep_alive(false)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            if connection.await.is_ok() {
                served.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
}

/// One request: its recorded answer, streamed over the end of its recorded wait (see
/// [`answer_chunks`]); 404 for an id not in the trajectory, 413 for a body over
/// [`MAX_REQUEST_BODY`].
async fn respond(
    request: hyper::Request<hyper::body::Incoming>,
    requests: Recorded,
) -> Result<hyper::Response<ReplyBody>, std::convert::Infallible> {
    let path = request.uri().path().to_owned();
    let reply = |status: hyper::StatusCode, body: Vec<u8>| {
        let mut response = hyper::Response::new(Either::Left(Full::new(Bytes::from(body))));
        *response.status_mut() = status;
        Ok(response)
    };
    let body = http_body_util::Limited::new(request.into_body(), MAX_REQUEST_BODY);
    if body.collect().await.is_err() {
        let why = format!("the request's body is over {MAX_REQUEST_BODY} bytes, or broken");
        return reply(hyper::StatusCode::PAYLOAD_TOO_LARGE, why.into_bytes());
    }
    let id: Option<u64> = path.rsplit('/').next().and_then(|id| id.parse().ok());
    if path.starts_with("/downloads/") {
        return match id.and_then(|k| requests.downloads.serve(k)) {
            Some((len, body)) => {
                let mut response = hyper::Response::new(Either::Right(body));
                response
                    .headers_mut()
                    .insert(hyper::header::CONTENT_LENGTH, len.into());
                Ok(response)
            }
            None => reply(
                hyper::StatusCode::NOT_FOUND,
                format!("no download {path}").into_bytes(),
            ),
        };
    }
    match id.and_then(|id| requests.requests.iter().find(|r| r.0 == id)) {
        Some(&(id, wait, len)) => {
            let started = tokio::time::Instant::now();
            let (mut sender, body) = Channel::new(1);
            tokio::spawn(async move {
                let bytes = Bytes::from(answer(id, len));
                for (at, range) in answer_chunks(wait, len) {
                    tokio::time::sleep_until(started + at).await;
                    if sender.send_data(bytes.slice(range)).await.is_err() {
                        // The client went away.
                        return;
                    }
                }
                // An empty answer ends when its wait does, too.
                tokio::time::sleep_until(started + wait).await;
            });
            Ok(hyper::Response::new(Either::Right(body)))
        }
        None => reply(
            hyper::StatusCode::NOT_FOUND,
            format!("no request {path}").into_bytes(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    fn sample() -> Trajectory {
        serde_json::from_str(
            r#"{"name": "t", "steps": [
                {"model": {"wait_ms": 20, "answer_bytes": 100}},
                {"tool": {"script": "fill 1MiB random seed=2; digest"}},
                {"model": {"wait_ms": 10.5, "answer_bytes": 7}}
            ]}"#,
        )
        .expect("a trajectory")
    }

    #[test]
    fn trajectory_numbers_model_steps_and_builds_the_script() {
        let t = sample();
        t.check().expect("valid");
        let requests = t.requests();
        assert_eq!(requests.len(), 2);
        assert_eq!(requests[1], (2, Duration::from_micros(10_500), 7));
        assert_eq!(t.total_wait(), Duration::from_micros(30_500));
        let script: Vec<String> = t.script("").iter().map(ToString::to_string).collect();
        assert_eq!(
            script,
            ["model 1", "fill 1048576 random seed=2", "digest", "model 2"]
        );
    }

    #[test]
    fn trajectory_with_a_bad_step_is_refused_with_its_number() {
        let mut t = sample();
        t.steps.push(Step::Tool {
            script: "explode".into(),
        });
        assert!(t.check().expect_err("bad script").contains("step 4"));
        let mut t = sample();
        t.steps[0] = Step::Model {
            wait_ms: -1.0,
            answer_bytes: 1,
        };
        assert!(t.check().is_err());
    }

    #[test]
    fn trajectory_with_out_of_range_numbers_is_refused_naming_step_and_field() {
        let model = |wait: &str, bytes: &str| {
            format!(
                r#"{{"name": "t", "steps": [{{"tool": {{"script": "digest"}}}},
                    {{"model": {{"wait_ms": {wait}, "answer_bytes": {bytes}}}}}]}}"#
            )
        };
        for (text, expect) in [
            (model("1e300", "1"), "step 2 (model): wait_ms 1e300"),
            (model("3600000.5", "1"), "wait_ms"),
            (model("-0.5", "1"), "wait_ms -0.5"),
            (
                model("5", "1048577"),
                "step 2 (model): answer_bytes 1048577",
            ),
            (
                r#"{"name": "t", "time_scale": 1e300, "steps": [{"tool": {"script": "digest"}}]}"#
                    .to_owned(),
                "time_scale",
            ),
            (
                r#"{"name": "t", "steps": [{"tool": {"script": "sleep 99999999999"}}]}"#.to_owned(),
                "step 1 (tool): `sleep 99999999999`",
            ),
            (
                r#"{"name": "t", "steps": [{"tool": {"script": "digest; model 0"}}]}"#.to_owned(),
                "step 1 (tool): `model 0`",
            ),
        ] {
            let t: Trajectory = serde_json::from_str(&text).expect("parses as JSON");
            let err = t.check().expect_err(&text);
            assert!(err.contains(expect), "{text}: {err}");
        }
        // The largest wait allowed still converts.
        let t: Trajectory = serde_json::from_str(&model("3600000", "1")).expect("parses");
        t.check().expect("an hour is allowed");
        assert_eq!(t.total_wait(), Duration::from_secs(3600));
    }

    #[test]
    fn answers_are_deterministic_and_differ_by_request() {
        assert_eq!(answer(3, 64), answer(3, 64));
        assert_ne!(answer(3, 64), answer(4, 64));
        assert_eq!(answer(9, 5).len(), 5);
    }

    #[test]
    fn replay_server_endless_request_line_is_cut_off_not_buffered() {
        let server = ReplayServer::start(&sample()).expect("listens");
        let mut stream = TcpStream::connect(server.address).expect("connects");
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("a timeout");
        // A local peer (any user can reach 127.0.0.1) that never ends its request line.
        let line = vec![b'a'; 1 << 20];
        let mut sent = 0usize;
        while sent < 16 && stream.write_all(&line).is_ok() {
            sent += 1;
        }
        let mut rest = Vec::new();
        let read = stream.read_to_end(&mut rest);
        // Closed (or reset) by the server, not left reading for ever.
        let waiting = matches!(&read, Err(e) if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ));
        assert!(
            !waiting,
            "the server kept reading {sent} MiB of one line: {read:?}"
        );
    }

    #[test]
    fn replay_server_body_over_its_limit_is_refused_not_buffered() {
        let server = ReplayServer::start(&sample()).expect("listens");
        let mut stream = TcpStream::connect(server.address).expect("connects");
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("a timeout");
        let len = 2 * MAX_REQUEST_BODY;
        let head = format!("POST /requests/1 HTTP/1.1\r\nhost: x\r\ncontent-length: {len}\r\n\r\n");
        stream.write_all(head.as_bytes()).expect("the head goes");
        // The server may answer and close before it has it all.
        let _ = stream.write_all(&vec![b'x'; len]);
        let mut reply = Vec::new();
        let _ = stream.read_to_end(&mut reply);
        let reply = String::from_utf8_lossy(&reply);
        assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    }

    #[test]
    fn answers_stream_in_equal_chunks_over_the_last_quarter_of_their_wait() {
        let wait = Duration::from_millis(4000);
        let chunks = answer_chunks(wait, 1000);
        assert_eq!(chunks.len() as u64, ANSWER_CHUNKS);
        assert_eq!(chunks[0], (Duration::from_millis(3050), 0..50));
        assert_eq!(chunks[19], (wait, 950..1000));
        let covered: usize = chunks.iter().map(|(_, r)| r.len()).sum();
        assert_eq!(covered, 1000);
        assert!(chunks
            .windows(2)
            .all(|w| w[0].0 < w[1].0 && w[0].1.end == w[1].1.start));
        // Short answers: a byte a chunk; none for an empty one.
        assert_eq!(answer_chunks(wait, 3).len(), 3);
        assert_eq!(answer_chunks(wait, 3)[2], (wait, 2..3));
        assert!(answer_chunks(wait, 0).is_empty());
    }

    #[test]
    fn replay_server_streams_an_answer_and_the_gateway_says_when_it_begins() {
        use crate::gateway::{ModelPort, Progress};
        let t: Trajectory = serde_json::from_str(
            r#"{"name": "s", "steps": [{"model": {"wait_ms": 2000, "answer_bytes": 4000}}]}"#,
        )
        .expect("a trajectory");
        let server = ReplayServer::start(&t).expect("listens");
        let gateway =
            crate::gateway::Gateway::new(Some(&server.url()), "t", 0, Duration::from_secs(10))
                .expect("a gateway");
        let started = std::time::Instant::now();
        gateway.send(1, None);
        let first = gateway.wait_progress(1, Duration::from_secs(5), false);
        let arriving = started.elapsed();
        assert_eq!(first, Some(Progress::Arriving));
        // The first chunk goes at 1525 ms, the last at 2000 ms.
        assert!(arriving >= Duration::from_millis(1500), "{arriving:?}");
        let done = gateway.wait_progress(1, Duration::from_secs(5), false);
        assert!(started.elapsed() >= Duration::from_millis(1990));
        assert_eq!(
            done,
            Some(Progress::Done(crate::gateway::Answer::Data(answer(
                1, 4000
            ))))
        );
        // The events a wait coordinator polls say the same, in order.
        let events = crate::wait::EventSource::poll(&mut { gateway });
        let kinds: Vec<_> = events
            .iter()
            .map(|e| match e {
                crate::wait::WaitEvent::WaitStart { .. } => "start",
                crate::wait::WaitEvent::DataArriving { .. } => "arriving",
                crate::wait::WaitEvent::DataReady { .. } => "ready",
                _ => "other",
            })
            .collect();
        assert_eq!(kinds, ["start", "arriving", "ready"]);
    }

    #[test]
    fn replay_server_answers_after_the_recorded_wait() {
        let t = sample();
        let server = ReplayServer::start(&t).expect("listens");
        let gateway =
            crate::gateway::Gateway::new(Some(&server.url()), "t", 0, Duration::from_secs(5))
                .expect("a gateway");
        let started = std::time::Instant::now();
        gateway.send(1, None);
        assert_eq!(
            gateway.wait(1),
            crate::gateway::Answer::Data(answer(1, 100))
        );
        assert!(started.elapsed() >= Duration::from_millis(20));
        gateway.send(7, None);
        let crate::gateway::Answer::Error(why) = gateway.wait(7) else {
            panic!("an answer for a request not in the trajectory");
        };
        assert!(why.message.contains("404"), "{why}");
        // The server counts a request once its answer is written, which may be just after the
        // client has read it.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while server.served() < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(server.served(), 2);
    }
}
