//! The lifecycle API's wire types (OpenSandbox `specs/sandbox-lifecycle.yml`, camelCase),
//! the sandbox states, and the checks on what a client sends.
//!
//! Optional fields are omitted, never `null`: the Python SDK fails on `null` where it expects
//! an object or a timestamp.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::clock;
use crate::templates::Templates;

/// The template always served: the plain workload guest (`vmm::guest`); the others are
/// snapshots (`crate::templates`).
pub const WORKLOAD_TEMPLATE: &str = "pvisor:workload";

/// The entrypoint a sandbox reports when the request names none (the spec's default).
pub const DEFAULT_ENTRYPOINT: [&str; 3] = ["tail", "-f", "/dev/null"];

/// Bounds on what a create request may carry.
pub const MAX_METADATA_ENTRIES: usize = 64;
/// See [`MAX_METADATA_ENTRIES`].
pub const MAX_TEXT_BYTES: usize = 1024;
/// The spec's minimum `timeout` (seconds).
pub const MIN_TIMEOUT_S: u64 = 60;
/// The longest `timeout` (and renewal) accepted: 30 days.
pub const MAX_TIMEOUT_S: u64 = 30 * 24 * 3600;

/// A sandbox's lifecycle state (the spec's `SandboxState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum State {
    /// Its VM is starting.
    Pending,
    /// Its VM runs and takes commands.
    Running,
    /// Its VM is being suspended and offloaded.
    Pausing,
    /// Its VM is suspended, its memory offloaded.
    Paused,
    /// Its VM is being resumed.
    Resuming,
    /// Its VM is being stopped.
    Stopping,
    /// Its VM stopped (deleted or expired); its files are gone.
    Terminated,
    /// Its VM failed to start, or died; `reason` and `message` say why.
    Failed,
}

impl State {
    /// Every state, for the list filter.
    pub const ALL: [State; 8] = [
        State::Pending,
        State::Running,
        State::Pausing,
        State::Paused,
        State::Resuming,
        State::Stopping,
        State::Terminated,
        State::Failed,
    ];

    /// The state's name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            State::Pending => "Pending",
            State::Running => "Running",
            State::Pausing => "Pausing",
            State::Paused => "Paused",
            State::Resuming => "Resuming",
            State::Stopping => "Stopping",
            State::Terminated => "Terminated",
            State::Failed => "Failed",
        }
    }

    /// The state named `text` (case-insensitive, as the spec's examples vary).
    pub fn parse(text: &str) -> Option<State> {
        State::ALL
            .into_iter()
            .find(|s| s.name().eq_ignore_ascii_case(text))
    }

    /// Whether the sandbox is over (no VM any more).
    pub fn is_final(self) -> bool {
        matches!(self, State::Terminated | State::Failed)
    }
}

/// `image` of a create request.
#[derive(Debug, Clone, Deserialize)]
pub struct ImageSpec {
    /// The template's name.
    pub uri: String,
}

/// The body of `POST /v1/sandboxes` (fields this daemon does not use are accepted and
/// ignored, as the SDK sends several: `env`, `resourceLimits`, `extensions`, …).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateRequest {
    /// The template.
    pub image: Option<ImageSpec>,
    /// A snapshot template to restore (the same names as `image.uri`).
    pub snapshot_id: Option<String>,
    /// Seconds until the sandbox expires; `None` (absent or null): never.
    pub timeout: Option<u64>,
    /// Reported back as given.
    pub entrypoint: Option<Vec<String>>,
    /// Labels, for the list filter.
    pub metadata: Option<BTreeMap<String, String>>,
}

/// A create request, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Create {
    /// The template.
    pub template: String,
    /// Bytes of guest RAM of its VM (the template's).
    pub memory: u64,
    /// Seconds until it expires.
    pub timeout_s: Option<u64>,
    /// Reported back.
    pub entrypoint: Vec<String>,
    /// Labels.
    pub metadata: BTreeMap<String, String>,
}

/// Why a request is refused (answered 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

fn text_ok(what: &str, text: &str) -> Result<(), Invalid> {
    if text.len() > MAX_TEXT_BYTES {
        return Err(Invalid(format!(
            "{what} is longer than {MAX_TEXT_BYTES} bytes"
        )));
    }
    if text.chars().any(char::is_control) {
        return Err(Invalid(format!("{what} holds control characters")));
    }
    Ok(())
}

impl CreateRequest {
    /// Checks the request: one of `templates` (by `image.uri`, or a snapshot by
    /// `snapshotId`), a timeout in bounds, bounded labels.
    pub fn check(self, templates: &Templates) -> Result<Create, Invalid> {
        let name = match (self.image, self.snapshot_id) {
            (Some(_), Some(_)) => {
                return Err(Invalid("give image.uri or snapshotId, not both".into()))
            }
            (Some(image), None) => image.uri,
            (None, Some(snapshot)) => snapshot,
            (None, None) => {
                return Err(Invalid(format!(
                    "image.uri is required: one of the templates {}",
                    templates.names()
                )))
            }
        };
        let Some(template) = templates.get(&name) else {
            let mut shown = name.chars().take(80).collect::<String>();
            shown.retain(|c| !c.is_control());
            return Err(Invalid(format!(
                "`{shown}` names no template here; the templates are: {} (`{WORKLOAD_TEMPLATE}` \
                 is the workload guest, the others snapshots)",
                templates.names()
            )));
        };
        if let Some(timeout) = self.timeout {
            if !(MIN_TIMEOUT_S..=MAX_TIMEOUT_S).contains(&timeout) {
                return Err(Invalid(format!(
                    "timeout {timeout} s is out of bounds ({MIN_TIMEOUT_S} to {MAX_TIMEOUT_S})"
                )));
            }
        }
        let entrypoint = match self.entrypoint {
            Some(e) if !e.is_empty() => e,
            _ => DEFAULT_ENTRYPOINT.iter().map(|s| (*s).to_owned()).collect(),
        };
        if entrypoint.len() > MAX_METADATA_ENTRIES {
            return Err(Invalid("entrypoint has too many arguments".into()));
        }
        for arg in &entrypoint {
            text_ok("an entrypoint argument", arg)?;
        }
        let metadata = self.metadata.unwrap_or_default();
        if metadata.len() > MAX_METADATA_ENTRIES {
            return Err(Invalid(format!(
                "metadata has more than {MAX_METADATA_ENTRIES} entries"
            )));
        }
        for (key, value) in &metadata {
            if key.is_empty() {
                return Err(Invalid("a metadata key is empty".into()));
            }
            text_ok("a metadata key", key)?;
            text_ok("a metadata value", value)?;
        }
        Ok(Create {
            template: template.name.clone(),
            memory: template.memory,
            timeout_s: self.timeout,
            entrypoint,
            metadata,
        })
    }
}

/// The body of `POST /v1/sandboxes/{id}/renew-expiration`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RenewRequest {
    /// RFC 3339.
    pub expires_at: String,
}

/// A sandbox's `status`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusBody {
    /// The state's name.
    pub state: &'static str,
    /// A machine-readable reason, when there is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// In words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// RFC 3339.
    pub last_transition_at: String,
}

/// `image` in a sandbox body.
#[derive(Debug, Clone, Serialize)]
pub struct ImageBody {
    /// The template.
    pub uri: String,
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxBody {
    /// The id.
    pub id: String,
    /// Its template.
    pub image: ImageBody,
    /// Its state.
    pub status: StatusBody,
    /// Its labels.
    pub metadata: BTreeMap<String, String>,
    /// As created.
    pub entrypoint: Vec<String>,
    /// RFC 3339, when it expires.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// RFC 3339.
    pub created_at: String,
}

/// `pagination` of a list.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pagination {
    /// 1-based.
    pub page: u64,
    /// Items per page.
    pub page_size: u64,
    /// Items matching the filters.
    pub total_items: u64,
    /// Pages of them.
    pub total_pages: u64,
    /// Whether a next page exists.
    pub has_next_page: bool,
}

/// The body of a list.
#[derive(Debug, Clone, Serialize)]
pub struct ListBody {
    /// This page's sandboxes.
    pub items: Vec<SandboxBody>,
    /// Where it is.
    pub pagination: Pagination,
}

/// The body of `GET …/endpoints/{port}`.
#[derive(Debug, Clone, Serialize)]
pub struct EndpointBody {
    /// `host:port/path`, no scheme.
    pub endpoint: String,
    /// Headers every request to it must carry.
    pub headers: BTreeMap<String, String>,
}

/// The filters and page of a list (`?state=…&state=…&metadata=k%3Dv%26…&page=&pageSize=`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListQuery {
    /// Any of these states (none: all).
    pub states: Vec<State>,
    /// All of these labels.
    pub metadata: BTreeMap<String, String>,
    /// 1-based.
    pub page: u64,
    /// Items per page.
    pub page_size: u64,
}

/// The largest page.
pub const MAX_PAGE_SIZE: u64 = 200;

impl ListQuery {
    /// Parses a query string.
    pub fn parse(query: Option<&str>) -> Result<ListQuery, Invalid> {
        let mut out = ListQuery {
            states: Vec::new(),
            metadata: BTreeMap::new(),
            page: 1,
            page_size: 20,
        };
        let number = |name: &str, value: &str| {
            value
                .parse::<u64>()
                .ok()
                .filter(|n| *n >= 1)
                .ok_or_else(|| Invalid(format!("{name} `{value}` is not a positive integer")))
        };
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let key = percent_decode(key)?;
            let value = percent_decode(value)?;
            match key.as_str() {
                "state" => out.states.push(
                    State::parse(&value)
                        .ok_or_else(|| Invalid(format!("state `{value}` is not a state")))?,
                ),
                "metadata" => {
                    for item in value.split('&').filter(|p| !p.is_empty()) {
                        let (k, v) = item.split_once('=').ok_or_else(|| {
                            Invalid(format!("metadata `{item}` is not key=value"))
                        })?;
                        out.metadata.insert(percent_decode(k)?, percent_decode(v)?);
                    }
                }
                "page" => out.page = number("page", &value)?,
                "pageSize" => out.page_size = number("pageSize", &value)?.min(MAX_PAGE_SIZE),
                _ => {}
            }
        }
        if out.metadata.len() > MAX_METADATA_ENTRIES {
            return Err(Invalid("too many metadata filters".into()));
        }
        Ok(out)
    }
}

/// Decodes `%XX` escapes and `+` (a space, in a query).
pub fn percent_decode(text: &str) -> Result<String, Invalid> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| Invalid(format!("`{text}` has a bad %-escape")))?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| Invalid(format!("`{text}` is not UTF-8 once decoded")))
}

/// An RFC 3339 time in the future, at most [`MAX_TIMEOUT_S`] away, as Unix milliseconds.
pub fn check_expiry(text: &str, now_ms: u64) -> Result<u64, Invalid> {
    let at = clock::parse_rfc3339(text)
        .ok_or_else(|| Invalid(format!("expiresAt `{text}` is not an RFC 3339 time")))?;
    if at <= now_ms {
        return Err(Invalid(format!("expiresAt {text} is not in the future")));
    }
    if at - now_ms > MAX_TIMEOUT_S * 1000 {
        return Err(Invalid(format!(
            "expiresAt {text} is more than {MAX_TIMEOUT_S} s away"
        )));
    }
    Ok(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(json: &str) -> Result<Create, Invalid> {
        let templates = Templates::new(
            64 << 20,
            &[],
            &compressed_backing::remote::RemoteOptions::new(),
        )
        .expect("the workload guest");
        serde_json::from_str::<CreateRequest>(json)
            .expect("parses")
            .check(&templates)
    }

    #[test]
    fn create_unknown_template_is_refused_by_name() {
        let err = request(r#"{"image":{"uri":"python:3.11"}}"#).unwrap_err();
        assert!(
            err.0.contains("python:3.11") && err.0.contains(WORKLOAD_TEMPLATE),
            "{err}"
        );
        assert!(request(r#"{"timeout":600}"#).is_err());
    }

    #[test]
    fn create_defaults_and_bounds_hold() {
        let ok = request(r#"{"image":{"uri":"pvisor:workload"},"timeout":null,"env":{"A":"b"},"resourceLimits":{"memory":"2Gi"}}"#)
            .expect("accepted");
        assert_eq!(ok.timeout_s, None);
        assert_eq!(ok.entrypoint, DEFAULT_ENTRYPOINT);
        assert!(request(r#"{"image":{"uri":"pvisor:workload"},"timeout":5}"#).is_err());
        let many: BTreeMap<String, String> =
            (0..65).map(|i| (format!("k{i}"), "v".into())).collect();
        let body = serde_json::json!({"image":{"uri":"pvisor:workload"},"metadata":many});
        assert!(request(&body.to_string()).is_err());
        assert!(request(r#"{"image":{"uri":"pvisor:workload"},"metadata":{"a":"x\ny"}}"#).is_err());
    }

    #[test]
    fn list_query_parses_states_metadata_and_pages() {
        let q = ListQuery::parse(Some(
            "state=Running&state=paused&metadata=project%3DApollo%26note%3DDemo%252520Test&page=2&pageSize=5",
        ))
        .expect("parses");
        assert_eq!(q.states, vec![State::Running, State::Paused]);
        assert_eq!(q.metadata["project"], "Apollo");
        assert_eq!(q.metadata["note"], "Demo%20Test");
        assert_eq!((q.page, q.page_size), (2, 5));
        assert!(ListQuery::parse(Some("state=Sleeping")).is_err());
        assert!(ListQuery::parse(Some("page=0")).is_err());
        assert!(ListQuery::parse(Some("metadata=%zz")).is_err());
        assert_eq!(ListQuery::parse(None).expect("empty").page_size, 20);
    }

    #[test]
    fn expiry_must_be_future_and_bounded() {
        let now = 1_700_000_000_000;
        assert_eq!(check_expiry("2023-11-14T22:13:20Z", now - 1000), Ok(now));
        assert!(check_expiry("2023-11-14T22:13:20Z", now).is_err());
        assert!(check_expiry("2099-01-01T00:00:00Z", now).is_err());
        assert!(check_expiry("tomorrow", now).is_err());
    }
}
