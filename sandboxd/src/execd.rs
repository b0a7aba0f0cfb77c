//! A minimal execd per sandbox, at `/sandboxes/{id}/port/44772` of the daemon's listener
//! (the endpoint the lifecycle API hands out, with the sandbox's token in its `headers`;
//! every request must carry it). Served: `GET /ping` and `POST /command`, whose command is a
//! workload guest script run through the VM's control socket and answered as a
//! `text/event-stream`: `init`, one `stdout` event per result line, then
//! `execution_complete`, or `stderr` lines and `error` with the exit code. Every other execd
//! call (and everything on the egress port 18080) answers 501 `NOT_IMPLEMENTED`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use crate::api::{self, ApiError, App, EGRESS_PORT, EXECD_PORT, TOKEN_HEADER};
use crate::clock;
use crate::model::State as SandboxState;
use crate::sandboxes::random_hex;
use crate::store::{check_id, Record, VmRef};
use crate::vm::{self, VmError};

/// The exit code of a command that is not a script.
pub const EXIT_USAGE: i32 = 2;
/// The exit code of a script that failed.
pub const EXIT_FAILED: i32 = 1;

/// The sandbox and port a request is for, once its token is checked.
fn admit(app: &App, id: &str, port: &str, headers: &HeaderMap) -> Result<(Record, u16), ApiError> {
    if !check_id(id) {
        return Err(ApiError::not_found(id));
    }
    let record = app.sandboxes.get(id).map_err(|_| ApiError::not_found(id))?;
    let given = headers.get(TOKEN_HEADER).map(|v| v.as_bytes());
    if !given.is_some_and(|given| api::same_secret(given, record.token.as_bytes())) {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "UNAUTHORIZED",
            format!(
                "the {TOKEN_HEADER} header of sandbox {id} {}: it comes with the endpoint \
                 (GET /v1/sandboxes/{id}/endpoints/{EXECD_PORT})",
                if given.is_some() {
                    "is wrong"
                } else {
                    "is missing"
                }
            ),
        ));
    }
    match port.parse::<u16>() {
        Ok(port @ (EXECD_PORT | EGRESS_PORT)) => Ok((record, port)),
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            format!("sandbox {id} serves only ports {EXECD_PORT} and {EGRESS_PORT}"),
        )),
    }
}

fn unserved_answer(port: u16, what: &str) -> ApiError {
    let service = if port == EGRESS_PORT {
        "the egress sidecar is not served: sandboxes have no network"
    } else {
        "this execd serves GET /ping and POST /command only"
    };
    ApiError::new(
        StatusCode::NOT_IMPLEMENTED,
        "NOT_IMPLEMENTED",
        format!("{what}: {service}"),
    )
}

fn not_running(record: &Record) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "SANDBOX_NOT_RUNNING",
        format!(
            "sandbox {} is {}: commands run once it is Running",
            record.id,
            record.state.name()
        ),
    )
}

/// `GET /ping`: 200 once the sandbox runs, 503 before (the SDK polls it until it is ready).
pub async fn ping(
    State(app): State<Arc<App>>,
    Path((id, port)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    let (record, port) = admit(&app, &id, &port, &headers)?;
    if port != EXECD_PORT {
        return Err(unserved_answer(port, "/ping"));
    }
    if record.state == SandboxState::Running {
        Ok(StatusCode::OK)
    } else {
        Err(not_running(&record))
    }
}

/// Any other call on the endpoint.
pub async fn unserved(
    State(app): State<Arc<App>>,
    Path((id, port, rest)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    let (_, port) = admit(&app, &id, &port, &headers)?;
    let mut shown: String = rest.chars().take(60).collect();
    shown.retain(|c| !c.is_control());
    Err(unserved_answer(port, &format!("/{shown}")))
}

/// A call on the endpoint's root.
pub async fn unserved_root(
    State(app): State<Arc<App>>,
    Path((id, port)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    let (_, port) = admit(&app, &id, &port, &headers)?;
    Err(unserved_answer(port, "/"))
}

/// A command as the SDK sends it (`cwd`, `envs`, `timeout` and the rest are accepted and
/// ignored: a script has none of them).
#[derive(Debug, Deserialize)]
struct CommandRequest {
    command: CommandText,
    #[serde(default)]
    background: bool,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum CommandText {
    Line(String),
    Argv(Vec<String>),
}

/// One server-sent event: `data: {"type", "timestamp", …}`.
fn event(kind: &str, fields: serde_json::Value) -> Bytes {
    let mut object = serde_json::Map::new();
    object.insert("type".into(), kind.into());
    object.insert("timestamp".into(), clock::now_ms().into());
    if let serde_json::Value::Object(extra) = fields {
        object.extend(extra);
    }
    Bytes::from(format!("data: {}\n\n", serde_json::Value::Object(object)))
}

fn error_events(code: i32, message: &str) -> Vec<Bytes> {
    let mut events: Vec<Bytes> = message
        .lines()
        .map(|line| event("stderr", serde_json::json!({ "text": format!("{line}\n") })))
        .collect();
    events.push(event(
        "error",
        serde_json::json!({
            "error": {
                "ename": "CommandExecError",
                "evalue": code.to_string(),
                "traceback": [message],
            }
        }),
    ));
    events
}

/// `POST /command`: runs the command (a workload guest script: `fill 64MiB random seed=1;
/// task; digest`) in the sandbox's VM and streams its results.
pub async fn command(
    State(app): State<Arc<App>>,
    Path((id, port)): Path<(String, String)>,
    headers: HeaderMap,
    request: Body,
) -> Result<Response, ApiError> {
    let (record, port) = admit(&app, &id, &port, &headers)?;
    if port != EXECD_PORT {
        return Err(unserved_answer(port, "/command"));
    }
    let bytes = api::read_body(&headers, request).await?;
    let request: CommandRequest = api::parse_json(&bytes)?;
    if request.background {
        return Err(ApiError::invalid(
            "background commands are not served: a script runs in the foreground",
        ));
    }
    let script = match request.command {
        CommandText::Line(line) => line,
        CommandText::Argv(argv) => argv.join(" "),
    };
    if script.trim().is_empty() {
        return Err(ApiError::invalid("the command is empty"));
    }
    // A sandbox the daemon offloaded while idle comes back first (the client sees latency).
    let (record, vm) = app.sandboxes.command_vm(&record.id).await?;
    let Some((vm, permit)) = vm else {
        return Err(not_running(&record));
    };
    app.sandboxes
        .metrics
        .commands
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    let sandboxes = Arc::clone(&app.sandboxes);
    tokio::spawn(async move {
        let id = record.id.clone();
        run_command(record.id, vm, script, tx).await;
        // The command is over, whether its client stayed or not: idle from now.
        sandboxes.used(&id);
        drop(permit);
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    Ok((
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// Runs `script` and sends its events; the stream ends when this returns.
async fn run_command(id: String, vm: VmRef, script: String, tx: tokio::sync::mpsc::Sender<Bytes>) {
    let command_id = random_hex(8).unwrap_or_else(|_| format!("{}", clock::now_ms()));
    let mut events = vec![event("init", serde_json::json!({ "text": command_id }))];
    let started = Instant::now();
    match vmm::script::parse(&script) {
        Err(e) => events.extend(error_events(EXIT_USAGE, &basics::error_chain(&e))),
        Ok(_) => {
            // The init event goes out before the command runs.
            for e in events.drain(..) {
                if tx.send(e).await.is_err() {
                    tracing::info!(%id, "command stream closed by the client before it ran");
                }
            }
            let result = tokio::task::spawn_blocking(move || vm::exec(&vm, &script)).await;
            match result {
                Ok(Ok(results)) => {
                    for line in results {
                        events.push(event(
                            "stdout",
                            serde_json::json!({ "text": format!("{line}\n") }),
                        ));
                    }
                    let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
                    events.push(event(
                        "execution_complete",
                        serde_json::json!({ "execution_time": ms }),
                    ));
                }
                Ok(Err(e)) => {
                    let message = match &e {
                        VmError::Call(vmm::control::ClientError::Refused(why)) => why.clone(),
                        other => basics::error_chain(other),
                    };
                    tracing::info!(%id, "command failed: {message}");
                    events.extend(error_events(EXIT_FAILED, &message));
                }
                Err(e) => events.extend(error_events(EXIT_FAILED, &e.to_string())),
            }
        }
    }
    for e in events {
        if tx.send(e).await.is_err() {
            // The client went away; the command ran to its end anyway.
            return;
        }
    }
}
