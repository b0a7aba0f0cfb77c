//! The HTTP server: the lifecycle API under `/v1` (API key in `OPEN-SANDBOX-API-KEY`) and
//! each sandbox's execd under `/sandboxes/{id}/port/{port}` ([`crate::execd`]). Every error
//! is JSON `{code, message}`; bodies are bounded.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::Router;

use crate::clock;
use crate::model::{self, CreateRequest, Invalid, ListQuery, RenewRequest};
use crate::sandboxes::{SandboxError, Sandboxes};
use crate::store::{check_id, Record};

/// The header of the lifecycle API's key.
pub const API_KEY_HEADER: &str = "OPEN-SANDBOX-API-KEY";
/// The header of a sandbox's execd token (handed out in its endpoints' `headers`).
pub const TOKEN_HEADER: &str = "X-Pvisor-Sandbox-Token";
/// execd's port.
pub const EXECD_PORT: u16 = 44772;
/// The egress sidecar's port (asked for by the SDK; nothing is served there yet).
pub const EGRESS_PORT: u16 = 18080;
/// The largest request body.
pub const MAX_BODY_BYTES: usize = 64 << 10;

/// What the handlers share.
pub struct App {
    /// The sandboxes.
    pub sandboxes: Arc<Sandboxes>,
    /// The API key (`None`: `--no-auth`).
    pub api_key: Option<Vec<u8>>,
    /// `host:port` of this server, as endpoints name it.
    pub public: String,
    /// The most requests the daemon takes a second, all clients together (`None`: no limit).
    pub rate: Option<basics::RateLimit>,
}

impl std::fmt::Debug for App {
    // Not the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("sandboxes", &self.sandboxes)
            .field("auth", &self.api_key.is_some())
            .field("public", &self.public)
            .finish()
    }
}

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    /// Its HTTP status.
    pub status: StatusCode,
    /// The spec's machine-readable code.
    pub code: &'static str,
    /// In words.
    pub message: String,
}

impl ApiError {
    /// An error of `status`.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    /// 400.
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "INVALID_REQUEST", message)
    }

    /// 404 for sandbox `id`.
    pub fn not_found(id: &str) -> Self {
        let mut shown: String = id.chars().take(40).collect();
        shown.retain(|c| !c.is_control());
        ApiError::new(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            format!("no sandbox `{shown}`"),
        )
    }
}

impl From<Invalid> for ApiError {
    fn from(e: Invalid) -> Self {
        ApiError::invalid(e.0)
    }
}

impl From<SandboxError> for ApiError {
    fn from(e: SandboxError) -> Self {
        let message = basics::error_chain(&e);
        let (status, code) = match &e {
            SandboxError::NotFound(id) => return ApiError::not_found(id),
            SandboxError::Conflict { .. } | SandboxError::Busy { .. } => {
                (StatusCode::CONFLICT, "INVALID_STATE")
            }
            SandboxError::Capacity { .. }
            | SandboxError::TooMany { .. }
            | SandboxError::Commands { .. } => {
                (StatusCode::TOO_MANY_REQUESTS, "INSUFFICIENT_CAPACITY")
            }
            SandboxError::Store(_)
            | SandboxError::Vm { .. }
            | SandboxError::Join(_)
            | SandboxError::Random(_) => {
                tracing::warn!("{message}");
                (StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL_ERROR")
            }
        };
        ApiError::new(status, code, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "code": self.code, "message": self.message });
        json_response(self.status, &body)
    }
}

/// `value` as a JSON answer of `status`.
pub fn json_response(status: StatusCode, value: &impl serde::Serialize) -> Response {
    match serde_json::to_vec(value) {
        Ok(bytes) => (status, [(header::CONTENT_TYPE, "application/json")], bytes).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// Whether `a` and `b` are equal, in a time that depends on their lengths only.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a
        .iter()
        .zip(b)
        .fold(0u8, |acc, (x, y)| acc | std::hint::black_box(x ^ y));
    std::hint::black_box(diff) == 0
}

/// Reads a request body of at most [`MAX_BODY_BYTES`] (a larger declared length is refused
/// before anything is read).
pub async fn read_body(headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "PAYLOAD_TOO_LARGE",
            format!("request bodies are limited to {MAX_BODY_BYTES} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(too_large());
    }
    axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|_| too_large())
}

/// Parses a JSON body.
pub fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::invalid(format!("malformed JSON: {e}")))
}

async fn authorize(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        let given = request.headers().get(API_KEY_HEADER).map(|v| v.as_bytes());
        if !given.is_some_and(|given| same_secret(given, key)) {
            let why = if given.is_some() {
                "is wrong"
            } else {
                "is missing"
            };
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "UNAUTHORIZED",
                format!("the {API_KEY_HEADER} header {why}"),
            )
            .into_response();
        }
    }
    next.run(request).await
}

/// Refuses a request past `--max-request-rate` (before its key is checked: a client without
/// the key floods too) with `429 RATE_LIMITED` and `Retry-After: 1`.
async fn limit_rate(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    if app.rate.as_ref().is_some_and(|rate| !rate.allow()) {
        app.sandboxes
            .metrics
            .rate_limited
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut answer = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "RATE_LIMITED",
            "the daemon takes no more requests this second (--max-request-rate): try again in a second",
        )
        .into_response();
        answer
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        return answer;
    }
    next.run(request).await
}

/// Turns an error answer that is not JSON (axum's own rejections: a path segment that is not
/// UTF-8, say) into `{code, message}`, like every other error.
async fn json_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let code = match status {
        StatusCode::NOT_FOUND => "NOT_FOUND",
        StatusCode::METHOD_NOT_ALLOWED => "METHOD_NOT_ALLOWED",
        StatusCode::PAYLOAD_TOO_LARGE => "PAYLOAD_TOO_LARGE",
        s if s.is_client_error() => "INVALID_REQUEST",
        _ => "INTERNAL_ERROR",
    };
    let text = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let mut message: String = text.chars().take(200).collect();
    message.retain(|c| !c.is_control());
    if message.is_empty() {
        message = status.canonical_reason().unwrap_or("error").to_owned();
    }
    ApiError::new(status, code, message).into_response()
}

/// `GET /metrics`: Prometheus' text format ([`crate::metrics`]).
async fn metrics(State(app): State<Arc<App>>) -> Response {
    let charged = app.sandboxes.charged().await;
    let (room, status) = app.sandboxes.governor();
    let text = app
        .sandboxes
        .metrics
        .render(&app.sandboxes.records(), &charged, &room, &status);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// The server's routes.
pub fn router(app: Arc<App>) -> Router {
    let lifecycle = Router::new()
        .route("/v1/sandboxes", get(list).post(create))
        .route("/v1/sandboxes/{id}", get(get_one).delete(delete))
        .route("/v1/sandboxes/{id}/pause", post(pause))
        .route("/v1/sandboxes/{id}/resume", post(resume))
        .route("/v1/sandboxes/{id}/renew-expiration", post(renew))
        .route("/v1/sandboxes/{id}/endpoints/{port}", get(endpoint))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(Arc::clone(&app), authorize));
    let execd = Router::new()
        .route("/sandboxes/{id}/port/{port}/ping", get(crate::execd::ping))
        .route(
            "/sandboxes/{id}/port/{port}/command",
            post(crate::execd::command),
        )
        .route(
            "/sandboxes/{id}/port/{port}",
            any(crate::execd::unserved_root),
        )
        .route(
            "/sandboxes/{id}/port/{port}/{*rest}",
            any(crate::execd::unserved),
        );
    lifecycle
        .merge(execd)
        .fallback(|uri: Uri| async move {
            let mut path: String = uri.path().chars().take(100).collect();
            path.retain(|c| !c.is_control());
            ApiError::new(
                StatusCode::NOT_FOUND,
                "NOT_FOUND",
                format!("nothing at {path}"),
            )
        })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "METHOD_NOT_ALLOWED",
                "this path does not take that method",
            )
        })
        .layer(middleware::from_fn(json_errors))
        .layer(middleware::from_fn_with_state(Arc::clone(&app), limit_rate))
        .with_state(app)
}

/// A record as the API shows it.
pub fn body(record: &Record) -> model::SandboxBody {
    model::SandboxBody {
        id: record.id.clone(),
        image: model::ImageBody {
            uri: record.template.clone(),
        },
        status: model::StatusBody {
            state: record.state.name(),
            reason: record.reason.clone(),
            message: record.message.clone(),
            last_transition_at: clock::rfc3339(record.transition_ms),
        },
        metadata: record.metadata.clone(),
        entrypoint: record.entrypoint.clone(),
        expires_at: record.expires_ms.map(clock::rfc3339),
        created_at: clock::rfc3339(record.created_ms),
    }
}

/// The id of a path, checked before anything is looked up.
fn id_of(id: &str) -> Result<&str, ApiError> {
    if check_id(id) {
        Ok(id)
    } else {
        Err(ApiError::not_found(id))
    }
}

async fn create(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    request: Body,
) -> Result<Response, ApiError> {
    let bytes = read_body(&headers, request).await?;
    let create = parse_json::<CreateRequest>(&bytes)?.check(app.sandboxes.templates())?;
    let record = app.sandboxes.create(create).await?;
    Ok(json_response(StatusCode::ACCEPTED, &body(&record)))
}

async fn list(State(app): State<Arc<App>>, uri: Uri) -> Result<Response, ApiError> {
    let query = ListQuery::parse(uri.query())?;
    let (records, total) = app.sandboxes.list(&query);
    let total_pages = total.div_ceil(query.page_size);
    let list = model::ListBody {
        items: records.iter().map(body).collect(),
        pagination: model::Pagination {
            page: query.page,
            page_size: query.page_size,
            total_items: total,
            total_pages,
            has_next_page: query.page < total_pages,
        },
    };
    Ok(json_response(StatusCode::OK, &list))
}

async fn get_one(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let record = app.sandboxes.get(id_of(&id)?)?;
    Ok(json_response(StatusCode::OK, &body(&record)))
}

async fn delete(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    app.sandboxes.delete(id_of(&id)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn pause(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    app.sandboxes.pause(id_of(&id)?).await?;
    Ok(StatusCode::ACCEPTED)
}

async fn resume(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    app.sandboxes.resume(id_of(&id)?).await?;
    Ok(StatusCode::ACCEPTED)
}

async fn renew(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    request: Body,
) -> Result<Response, ApiError> {
    let id = id_of(&id)?;
    // An unknown id is a 404 whatever the body.
    app.sandboxes.get(id)?;
    let bytes = read_body(&headers, request).await?;
    let renew: RenewRequest = parse_json(&bytes)?;
    let expires = model::check_expiry(&renew.expires_at, clock::now_ms())?;
    let record = app.sandboxes.renew(id, expires)?;
    let at = record.expires_ms.map(clock::rfc3339).unwrap_or_default();
    Ok(json_response(
        StatusCode::OK,
        &serde_json::json!({ "expiresAt": at }),
    ))
}

async fn endpoint(
    State(app): State<Arc<App>>,
    Path((id, port)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let record = app.sandboxes.get(id_of(&id)?)?;
    let port = match port.parse::<u16>() {
        Ok(port @ (EXECD_PORT | EGRESS_PORT)) => port,
        _ => {
            let mut shown: String = port.chars().take(10).collect();
            shown.retain(|c| !c.is_control());
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "NOT_FOUND",
                format!(
                    "sandbox {} serves no port `{shown}`: only execd ({EXECD_PORT}) and \
                     egress ({EGRESS_PORT})",
                    record.id
                ),
            ));
        }
    };
    if record.state.is_final() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "INVALID_STATE",
            format!("sandbox {} is {}", record.id, record.state.name()),
        ));
    }
    let headers = BTreeMap::from([(TOKEN_HEADER.to_owned(), record.token.clone())]);
    let endpoint = model::EndpointBody {
        endpoint: format!("{}/sandboxes/{}/port/{port}", app.public, record.id),
        headers,
    };
    Ok(json_response(StatusCode::OK, &endpoint))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_secret_compares_whole_values() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"ab"));
        assert!(!same_secret(b"", b"a"));
    }
}
