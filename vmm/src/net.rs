//! Downloads for the guest (issue 38, the seed's second wait): the guest asks the host to
//! fetch a URL and takes the body chunk by chunk; between chunks it waits, and the wait is
//! managed like a model wait (paused, offloaded, brought back for the next chunk).
//!
//! The channel is a versioned message in a guest page whose page number the guest writes to
//! [`PORT_NET`] with a 32-bit `out` (the arena channel's shape, so that a Linux guest's
//! driver can speak it; docs/waits.md has the layout). Every field is the guest's word,
//! checked here before anything moves ([`check`]): the buffer and the URL inside RAM, the
//! URL plain `http://` to an origin the host allows (`--vm-net-allow`), nothing else
//! fetched. The host writes a chunk into the guest's buffer only after the VM is back in
//! RAM (the seed's RAM gate): never while it is offloaded.

use std::fmt;

use crate::guest::Refused;

/// The port of net requests (32-bit `out`: the request's guest page number).
pub const PORT_NET: u16 = 0x60;
/// Where the workload guest keeps its request.
pub const REQUEST_GPA: u64 = 0xB000;
/// `"PVNT"`, little-endian.
pub const MAGIC: u32 = 0x544E_5650;
/// The message version this host speaks.
pub const VERSION: u16 = 1;
/// Longest URL, bytes.
pub const URL_MAX: u64 = 2048;
/// The `total` of a response that announced no length.
pub const UNKNOWN_TOTAL: u64 = u64::MAX;

/// What a request asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Kind {
    /// Start transfer `id`: GET the URL; the answer carries the first chunk (or the end).
    Get = 1,
    /// The next chunk of transfer `id`.
    Next = 2,
    /// Give transfer `id` up.
    Close = 3,
    /// Start transfer `id`: read the file of the VM's image at the path (in the URL's
    /// fields); the answer carries its first chunk, once the whole file is fetched and
    /// checked.
    Read = 4,
}

/// The message, as laid out in guest memory (guest/guest.c `struct net_request`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Request {
    /// [`MAGIC`].
    pub magic: u32,
    /// [`VERSION`].
    pub version: u16,
    /// [`Kind`].
    pub kind: u16,
    /// The guest's name for the transfer.
    pub id: u64,
    /// Where the host writes a chunk.
    pub buf_gpa: u64,
    /// Room there, bytes.
    pub buf_len: u64,
    /// The URL (`Get` only): where it lies...
    pub url_gpa: u64,
    /// ...and its bytes.
    pub url_len: u64,
    /// The host's answer: 0, or an errno.
    pub status: u64,
    /// Bytes of the chunk written at `buf_gpa`.
    pub len: u64,
    /// 1 while more chunks follow, 0 after the last.
    pub more: u64,
    /// The length the origin announced, or [`UNKNOWN_TOTAL`].
    pub total: u64,
}

// SAFETY: plain-old-data of integer fields, valid for any bit pattern.
unsafe impl vm_memory::ByteValued for Request {}

/// A request once checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    /// What it asks.
    pub kind: Kind,
    /// The transfer.
    pub id: u64,
    /// The chunk's buffer, inside RAM.
    pub buf: (u64, u64),
    /// The URL's (`Get`) or path's (`Read`) bytes, inside RAM.
    pub url: (u64, u64),
}

/// The waits of one source and what was done in them: the wait coordinator's decisions
/// ([`crate::wait::WaitStats`], all sources together) split by the source waited for.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SourceStats {
    /// Waits (a model answer's, a chunk's, a file's; a model wait the guest's timer broke
    /// counts once per part).
    pub waits: u64,
    /// Seconds waited in all.
    pub wait_s: f64,
    /// Offloads made during them.
    pub offloads: u64,
    /// Offloads skipped during them because the last one was too recent.
    pub skipped_for_cooldown: u64,
    /// Offloads skipped during them as not paying (the wait expected too short).
    pub skipped_for_gain: u64,
    /// Offloads skipped during them because the guest's timer was too close.
    pub skipped_for_timer: u64,
    /// Warm-ups started during them.
    pub warms: u64,
    /// Parts handed to the guest before the end (a streamed answer's batches, a download's
    /// chunks), managed or not.
    pub batches: u64,
    /// Microseconds from the moments those parts became deliverable to their being in the
    /// guest's buffer, summed (with `batches`: the mean).
    pub batch_delay_us: u64,
    /// Parts handed over more than [`crate::wait::BATCH_LATE`] after they became deliverable.
    pub batches_late: u64,
}

impl SourceStats {
    /// Counts a part handed to the guest `delay` after it became deliverable.
    pub fn batch_delivered(&mut self, delay: std::time::Duration) {
        self.batches += 1;
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.batch_delay_us = self.batch_delay_us.saturating_add(us);
        if delay > crate::wait::BATCH_LATE {
            self.batches_late += 1;
        }
    }

    /// Adds the coordinator's skips and warm-ups from `before` to `after` (its counters around
    /// one wait of this source).
    pub fn add_decisions(
        &mut self,
        before: &crate::wait::WaitStats,
        after: &crate::wait::WaitStats,
    ) {
        self.skipped_for_cooldown += after
            .skipped_for_cooldown
            .saturating_sub(before.skipped_for_cooldown);
        self.skipped_for_gain += after
            .skipped_for_gain
            .saturating_sub(before.skipped_for_gain);
        self.skipped_for_timer += after
            .skipped_for_timer
            .saturating_sub(before.skipped_for_timer);
        self.warms += after.warms.saturating_sub(before.warms);
    }
}

/// The waits by source: what each contributed.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BySource {
    /// Model answers.
    pub model: SourceStats,
    /// Downloads' chunks.
    pub download: SourceStats,
    /// Image reads.
    pub read: SourceStats,
}

/// What the guest's downloads and image reads came to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IoStats {
    /// Downloads started.
    pub downloads: u64,
    /// Image reads started.
    pub reads: u64,
    /// Of those, served from the host's staging (no trip to the origin).
    pub staged_reads: u64,
    /// Downloads and reads that failed (refused, or the origin failed).
    pub failed: u64,
    /// Bytes written into the guest.
    pub bytes: u64,
    /// Chunks written.
    pub chunks: u64,
    /// Chunks written after the VM was brought back for them: their data became ready while
    /// it was paused or offloaded, and reached its RAM only after the resume.
    pub after_resume: u64,
}

fn refuse(errno: i32, reason: String) -> Refused {
    Refused { errno, reason }
}

/// Where the request of an `out` of `value` to [`PORT_NET`] lies: a 32-bit page number whose
/// page holds a whole request inside `ram_size` bytes of RAM; else why not.
pub fn request_gpa(value: Option<u32>, ram_size: u64) -> Result<u64, String> {
    crate::arena::message_gpa::<Request>(value, ram_size, "a net request")
}

/// Checks a request read from guest memory for a VM of `ram_size` bytes: the magic and
/// version, a known kind, a buffer and (for `Get`) a URL of at most [`URL_MAX`] bytes inside
/// RAM, every sum checked.
pub fn check(request: &Request, ram_size: u64) -> Result<Checked, Refused> {
    if request.magic != MAGIC || request.version != VERSION {
        return Err(refuse(
            libc::EPROTO,
            format!(
                "a net request of magic {:#x} version {}: this host speaks {MAGIC:#x} version {VERSION}",
                request.magic, request.version
            ),
        ));
    }
    let kind = match request.kind {
        1 => Kind::Get,
        2 => Kind::Next,
        3 => Kind::Close,
        4 => Kind::Read,
        other => {
            return Err(refuse(
                libc::EINVAL,
                format!("unknown net request kind {other}"),
            ))
        }
    };
    let inside = |gpa: u64, len: u64| gpa.checked_add(len).is_some_and(|end| end <= ram_size);
    if kind != Kind::Close && (request.buf_len == 0 || !inside(request.buf_gpa, request.buf_len)) {
        return Err(refuse(
            libc::EFAULT,
            format!(
                "a net buffer of {} bytes at {:#x} is empty or outside RAM",
                request.buf_len, request.buf_gpa
            ),
        ));
    }
    if matches!(kind, Kind::Get | Kind::Read)
        && (!(1..=URL_MAX).contains(&request.url_len) || !inside(request.url_gpa, request.url_len))
    {
        return Err(refuse(
            libc::EINVAL,
            format!(
                "a URL of {} bytes at {:#x}: 1 to {URL_MAX} bytes inside RAM",
                request.url_len, request.url_gpa
            ),
        ));
    }
    Ok(Checked {
        kind,
        id: request.id,
        buf: (request.buf_gpa, request.buf_len),
        url: (request.url_gpa, request.url_len),
    })
}

/// A URL the host can fetch: plain `http://HOST[:PORT][/PATH][?QUERY]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `host:port`, the host lower-cased, the port explicit.
    authority: String,
    /// From the first `/` (at least `/`), query included.
    path: String,
}

impl Target {
    /// Parses `url`; why not if it is not a plain `http://` URL this host fetches.
    pub fn parse(url: &str) -> Result<Self, String> {
        if let Some(bad) = url.chars().find(|c| !c.is_ascii_graphic()) {
            return Err(format!(
                "URL `{}` has a space, control or non-ASCII character ({bad:?})",
                url.escape_default()
            ));
        }
        let Some(rest) = strip_prefix_ignore_case(url, "http://") else {
            return Err(if strip_prefix_ignore_case(url, "https://").is_some() {
                format!("URL `{url}`: only plain http:// is fetched (no TLS on the host side)")
            } else {
                format!("URL `{url}`: expected http://HOST[:PORT][/PATH]")
            });
        };
        if url.contains('#') {
            return Err(format!("URL `{url}` has a fragment"));
        }
        let split = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, path) = rest.split_at(split);
        if authority.contains('@') {
            return Err(format!("URL `{url}` carries user information"));
        }
        let (host, port) = match authority.rsplit_once(':') {
            // An IPv6 literal's colons are inside its brackets.
            Some((host, port)) if !port.contains(']') => {
                let port = port
                    .parse::<u16>()
                    .ok()
                    .filter(|&p| p != 0)
                    .ok_or_else(|| format!("URL `{url}`: bad port `{port}`"))?;
                (host, port)
            }
            _ => (authority, 80),
        };
        let bracketed = host.starts_with('[') && host.ends_with(']') && host.len() > 2;
        let plain = !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-');
        if !(bracketed || plain) {
            return Err(format!("URL `{url}`: bad host `{host}`"));
        }
        let path = match path {
            "" => "/".to_owned(),
            p if p.starts_with('?') => format!("/{p}"),
            p => p.to_owned(),
        };
        Ok(Self {
            authority: format!("{}:{port}", host.to_ascii_lowercase()),
            path,
        })
    }

    /// `host:port`, to connect to and for the `Host` header.
    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// The request target: path and query.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Its origin, as an allow-list names it: `http://host:port`.
    pub fn origin(&self) -> String {
        format!("http://{}", self.authority)
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}{}", self.authority, self.path)
    }
}

fn strip_prefix_ignore_case<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    let head = text.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &text[prefix.len()..])
}

/// The origins a VM's guest may download from (`--vm-net-allow`), each `http://host:port`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Allow {
    origins: Vec<String>,
}

impl Allow {
    /// The origins of `entries` (`http://HOST[:PORT]`, a trailing `/` allowed, no path).
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, String> {
        let mut origins = Vec::new();
        for entry in entries {
            let entry = entry.as_ref();
            let target =
                Target::parse(entry).map_err(|e| format!("--vm-net-allow `{entry}`: {e}"))?;
            if target.path != "/" || entry.ends_with('?') {
                return Err(format!(
                    "--vm-net-allow `{entry}`: an origin is http://HOST[:PORT], without a path"
                ));
            }
            if !origins.contains(&target.origin()) {
                origins.push(target.origin());
            }
        }
        Ok(Self { origins })
    }

    /// Whether no origin is allowed (the guest has no network).
    pub fn is_empty(&self) -> bool {
        self.origins.is_empty()
    }

    /// Whether `target`'s origin is allowed.
    pub fn permits(&self, target: &Target) -> bool {
        self.origins.contains(&target.origin())
    }

    /// The origins, as given (normalised).
    pub fn origins(&self) -> &[String] {
        &self.origins
    }
}

/// How a VM's downloads go (`--vm-net-*`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetOptions {
    /// Where the guest may download from (none: no downloads).
    pub allow: Allow,
    /// How the body is handed to the guest: a chunk is deliverable at `bytes` or when its
    /// oldest byte has waited `wait`; at most `buffer` bytes kept on the host that the guest
    /// has not taken (past it the origin is not read: back-pressure).
    pub chunking: crate::gateway::Batching,
    /// A download whose origin sends nothing for this long ends with an error.
    pub stall: std::time::Duration,
    /// A download not over after this long ends with an error (an origin that sends a byte
    /// now and then is no stall).
    pub timeout: std::time::Duration,
}

impl Default for NetOptions {
    fn default() -> Self {
        Self {
            allow: Allow::default(),
            chunking: crate::gateway::Batching {
                bytes: 1 << 20,
                wait: std::time::Duration::from_secs(1),
                buffer: 4 << 20,
            },
            stall: std::time::Duration::from_secs(30),
            timeout: std::time::Duration::from_secs(3600),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_layout_is_the_guests() {
        assert_eq!(std::mem::size_of::<Request>(), 80);
        assert_eq!(std::mem::offset_of!(Request, id), 8);
        assert_eq!(std::mem::offset_of!(Request, status), 48);
        assert_eq!(std::mem::offset_of!(Request, total), 72);
    }

    #[test]
    fn targets_parse_plain_http_only() {
        let t = Target::parse("http://Mirror.Local/pkgs/a.tar?x=1").expect("valid");
        assert_eq!(t.authority(), "mirror.local:80");
        assert_eq!(t.path(), "/pkgs/a.tar?x=1");
        assert_eq!(t.origin(), "http://mirror.local:80");
        let t = Target::parse("HTTP://127.0.0.1:8080").expect("valid");
        assert_eq!((t.authority(), t.path()), ("127.0.0.1:8080", "/"));
        let t = Target::parse("http://[::1]:9/a").expect("valid");
        assert_eq!(t.authority(), "[::1]:9");
        assert_eq!(Target::parse("http://h?q").expect("valid").path(), "/?q");
        for bad in [
            "https://h/x",
            "ftp://h/x",
            "http://",
            "http://:80/",
            "http://h:0/",
            "http://h:99999/",
            "http://user@h/",
            "http://h/a b",
            "http://h/a#frag",
            "http://h/\u{e9}",
            "http://h_x/",
            "http://h:8/\r\nX: y",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn allow_lists_match_origins_exactly() {
        let allow = Allow::parse(&["http://127.0.0.1:8080/", "http://Example.test"]).expect("ok");
        assert_eq!(
            allow.origins(),
            ["http://127.0.0.1:8080", "http://example.test:80"]
        );
        let ok = |u: &str| allow.permits(&Target::parse(u).expect("valid"));
        assert!(ok("http://127.0.0.1:8080/a/b"));
        assert!(ok("http://example.test:80/x"));
        assert!(!ok("http://127.0.0.1:8081/a"));
        assert!(!ok("http://127.0.0.2:8080/a"));
        assert!(!ok("http://example.test.evil:80/"));
        assert!(Allow::parse(&["http://h:1/path"]).is_err());
        assert!(Allow::parse(&["https://h:1"]).is_err());
        assert!(Allow::parse::<&str>(&[]).expect("empty").is_empty());
    }

    #[test]
    fn check_refuses_what_is_outside_ram_or_malformed() {
        const RAM: u64 = 64 << 20;
        let good = Request {
            magic: MAGIC,
            version: VERSION,
            kind: Kind::Get as u16,
            id: 7,
            buf_gpa: 4 << 20,
            buf_len: 1 << 20,
            url_gpa: 0x100000,
            url_len: 20,
            ..Request::default()
        };
        let checked = check(&good, RAM).expect("valid");
        assert_eq!(checked.kind, Kind::Get);
        assert_eq!(checked.buf, (4 << 20, 1 << 20));
        let errno = |r: Request| check(&r, RAM).expect_err("refused").errno;
        assert_eq!(errno(Request { magic: 1, ..good }), libc::EPROTO);
        assert_eq!(errno(Request { version: 2, ..good }), libc::EPROTO);
        assert_eq!(errno(Request { kind: 9, ..good }), libc::EINVAL);
        assert_eq!(errno(Request { buf_len: 0, ..good }), libc::EFAULT);
        assert_eq!(
            errno(Request {
                buf_gpa: RAM - 4,
                ..good
            }),
            libc::EFAULT
        );
        assert_eq!(
            errno(Request {
                buf_gpa: u64::MAX,
                ..good
            }),
            libc::EFAULT
        );
        assert_eq!(errno(Request { url_len: 0, ..good }), libc::EINVAL);
        assert_eq!(
            errno(Request {
                url_len: URL_MAX + 1,
                ..good
            }),
            libc::EINVAL
        );
        assert_eq!(
            errno(Request {
                url_gpa: u64::MAX - 4,
                ..good
            }),
            libc::EINVAL
        );
        // A `Next` carries no URL; a `Close` no buffer.
        let next = Request {
            kind: Kind::Next as u16,
            url_len: 0,
            ..good
        };
        assert_eq!(check(&next, RAM).expect("valid").kind, Kind::Next);
        let close = Request {
            kind: Kind::Close as u16,
            buf_len: 0,
            url_len: 0,
            ..good
        };
        assert_eq!(check(&close, RAM).expect("valid").kind, Kind::Close);
        assert!(request_gpa(None, RAM).is_err());
        assert!(request_gpa(Some(u32::MAX), RAM).is_err());
        assert_eq!(request_gpa(Some(0xB), RAM), Ok(0xB000));
    }
}
