//! The control API of a VM process: a Unix socket (mode 0600, the owner's uid only) taking
//! one JSON request per connection and answering one JSON reply, in versioned envelopes with
//! a `request_id`. A request for another job or attempt is refused.
//!
//! ```text
//! → {"version":1,"request_id":"r1","job":"vm-…","attempt":"…","method":"suspend","params":{"offload":true}}
//! ← {"version":1,"request_id":"r1","status":"ok","value":{…}}
//! ← {"version":1,"request_id":"r1","status":"error","error":"…"}
//! ```

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

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
    },
    /// Stop the VM.
    Stop,
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
}

/// A request handed to the thread that owns the VM, with the way back.
pub type Job = (Method, mpsc::Sender<Result<serde_json::Value, String>>);

/// Listens on `path` (mode 0600) and hands every valid request for `job`/`attempt` to `tx`,
/// one at a time per connection. Returns the listener thread.
pub fn serve(
    path: &Path,
    job: String,
    attempt: String,
    tx: mpsc::Sender<Job>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    if path.exists() {
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    std::thread::Builder::new()
        .name("pvisor-control".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (job, attempt, tx) = (job.clone(), attempt.clone(), tx.clone());
                let _ = std::thread::Builder::new()
                    .name("pvisor-request".into())
                    .spawn(move || answer(stream, &job, &attempt, &tx));
            }
        })
}

fn answer(stream: UnixStream, job: &str, attempt: &str, tx: &mpsc::Sender<Job>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    // SAFETY: geteuid cannot fail.
    let own = unsafe { libc::geteuid() };
    let peer = getsockopt(&stream, PeerCredentials).map(|c| c.uid()).ok();
    let mut line = String::new();
    let _ = BufReader::new(&stream).read_line(&mut line);
    let reply = match serde_json::from_str::<Request>(&line) {
        Err(e) => Reply::error("", format!("not a request: {e}")),
        Ok(_) if peer != Some(own) && peer != Some(0) => Reply::error(
            "",
            format!("refused: the VM belongs to uid {own}, the caller is uid {peer:?}"),
        ),
        Ok(request) if request.version != VERSION => Reply::error(
            &request.request_id,
            format!(
                "unsupported version {} (this VM speaks {VERSION})",
                request.version
            ),
        ),
        Ok(request) if request.job != job || request.attempt != attempt => Reply::error(
            &request.request_id,
            format!(
                "refused: this VM is job `{job}` attempt `{attempt}`, not job `{}` attempt `{}`",
                request.job, request.attempt
            ),
        ),
        Ok(request) => {
            let (reply_tx, reply_rx) = mpsc::channel();
            match tx
                .send((request.method, reply_tx))
                .ok()
                .and_then(|()| reply_rx.recv().ok())
            {
                Some(Ok(value)) => Reply::ok(&request.request_id, value),
                Some(Err(error)) => Reply::error(&request.request_id, error),
                None => Reply::error(&request.request_id, "the VM is shutting down".into()),
            }
        }
    };
    let mut text = serde_json::to_string(&reply).unwrap_or_default();
    text.push('\n');
    let _ = (&stream).write_all(text.as_bytes());
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
    /// The reply is not an envelope.
    #[error("the VM answered something that is not a reply: {0}")]
    BadReply(String),
    /// The VM refused or failed the request.
    #[error("{0}")]
    Refused(String),
}

/// Sends one request and returns the reply's value.
pub fn call(
    socket: &Path,
    job: &str,
    attempt: &str,
    method: Method,
) -> Result<serde_json::Value, ClientError> {
    let stream = UnixStream::connect(socket).map_err(|source| ClientError::Connect {
        path: socket.to_path_buf(),
        source,
    })?;
    let io = |source| ClientError::Io {
        path: socket.to_path_buf(),
        source,
    };
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
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).map_err(io)?;
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
