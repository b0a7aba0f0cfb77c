//! Firecracker's UFFD handshake: one message on a Unix socket carrying a bare JSON array of
//! guest-memory regions and, as `SCM_RIGHTS`, the userfaultfd. Both page-size fields are in
//! bytes despite the name of one; versions before 1.7 send neither (4096 is assumed); unknown
//! fields are ignored. `offset` is the region's offset in the memory file.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use basics::PageSize;

use crate::addr::{HostAddr, HostRange, PAGE_SIZE};

/// Largest handshake accepted (a VM has a handful of regions; this is generous).
pub const MAX_HANDSHAKE_BYTES: usize = 64 << 10;
/// Most descriptors accepted with a handshake: the userfaultfd and up to 32 memfds.
pub const MAX_FDS: usize = 33;

/// One region as Firecracker describes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct GuestRegion {
    /// Where the region is mapped in the VMM.
    pub base_host_virt_addr: u64,
    /// Bytes.
    pub size: u64,
    /// Offset of the region in the memory file.
    pub offset: u64,
    /// Page size in bytes (Firecracker ≥ 1.7).
    #[serde(default)]
    pub page_size: Option<u64>,
    /// Page size, also in bytes despite its name (Firecracker ≥ 1.7).
    #[serde(default)]
    pub page_size_kib: Option<u64>,
}

/// A validated region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Its range in the VMM's address space.
    pub range: HostRange,
    /// Its offset in the image.
    pub offset: u64,
    /// Its page size: 4 KiB, or 2 MiB for Firecracker's `huge_pages: "2M"` (private
    /// `MAP_HUGETLB` memory).
    pub page_size: PageSize,
}

/// Why a handshake was refused.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// Receiving the message failed.
    #[error("cannot receive the handshake")]
    Recv(#[source] std::io::Error),
    /// The peer closed the connection before sending anything.
    #[error("the peer disconnected before the handshake")]
    Disconnected,
    /// The message was longer than accepted.
    #[error("the handshake is larger than {MAX_HANDSHAKE_BYTES} bytes")]
    TooLarge,
    /// No descriptor came with the message.
    #[error("the handshake carries no userfaultfd (expected one SCM_RIGHTS descriptor)")]
    NoFd,
    /// More descriptors than the handshake uses.
    #[error("the handshake carries {0} descriptors, expected one per its userfaultfd and memfds")]
    TooManyFds(usize),
    /// The JSON is malformed.
    #[error("the handshake is not a JSON array of regions (nor a pvisor-uffd object)")]
    Json(#[source] serde_json::Error),
    /// A region is invalid on its own or against the others or the image.
    #[error("region {index}: {reason}")]
    Region {
        /// Position in the array.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// The whole handshake did not come in time.
    #[error("the handshake did not arrive within {0:?}")]
    Timeout(Duration),
    /// Descriptors came after the first bytes of the message.
    #[error(
        "descriptors came after the start of the handshake (they must come with its first bytes)"
    )]
    LateFds,
    /// The array is empty.
    #[error("the handshake lists no regions")]
    Empty,
    /// The project's handshake names a version this server does not speak.
    #[error("unsupported protocol `{0}` (this server speaks {PVISOR_PROTOCOL})")]
    Protocol(String),
}

/// The project's own handshake: a JSON object instead of Firecracker's bare array. The
/// descriptors are the userfaultfd, then one memfd per region that names one (`memfd`: its
/// index among the memfds), so that the server can read and drop that RAM itself.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct PvisorHandshake {
    /// Protocol name and version: `pvisor-uffd/1`.
    pub protocol: String,
    /// The regions.
    pub regions: Vec<PvisorRegion>,
    /// `zero` for a fresh VM, `source` (default) for one restored from the server's image.
    #[serde(default)]
    pub initial: Option<String>,
}

/// One region of the project's handshake.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct PvisorRegion {
    /// The region as Firecracker would describe it.
    #[serde(flatten)]
    pub region: GuestRegion,
    /// Index of the region's memfd among the descriptors after the userfaultfd.
    #[serde(default)]
    pub memfd: Option<usize>,
    /// Offset of the region in its memfd.
    #[serde(default)]
    pub memfd_offset: u64,
}

/// The version this server speaks.
pub const PVISOR_PROTOCOL: &str = "pvisor-uffd/1";

/// What was received.
#[derive(Debug)]
pub enum Message {
    /// Firecracker's: regions and the userfaultfd.
    Firecracker(Vec<GuestRegion>),
    /// The project's own: regions, memfds, then requests on the same connection.
    Pvisor(PvisorHandshake),
}

/// A received handshake: the descriptors and the message.
#[derive(Debug)]
pub struct Handshake {
    /// The VMM's userfaultfd.
    pub uffd: OwnedFd,
    /// Further descriptors (memfds; only in the project's handshake).
    pub memfds: Vec<OwnedFd>,
    /// The message.
    pub message: Message,
}

/// How long a peer has to send its whole handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Receives the handshake message from `stream` within `timeout`: the descriptors come with
/// the first bytes; the rest of a long message (the kernel splits a large `sendmsg` into
/// several reads, and a peer may write in pieces) is read until the JSON value ends, up to
/// [`MAX_HANDSHAKE_BYTES`]. Descriptors sent after the first bytes are closed and refused.
pub fn receive(stream: &UnixStream, timeout: Duration) -> Result<Handshake, HandshakeError> {
    let deadline = Instant::now() + timeout;
    // One byte more than accepted, to tell "exactly the limit" from "too large".
    let mut buf = vec![0u8; MAX_HANDSHAKE_BYTES + 1];
    let mut len = 0;
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut end = ValueEnd::default();
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(HandshakeError::Timeout(timeout));
        }
        stream
            .set_read_timeout(Some(remaining))
            .map_err(HandshakeError::Recv)?;
        let (n, received) = recv_some(stream, &mut buf[len..], timeout)?;
        if !received.is_empty() {
            if len > 0 || !fds.is_empty() {
                // Dropping them closes them.
                return Err(HandshakeError::LateFds);
            }
            fds = received;
        }
        if n == 0 {
            if len == 0 && fds.is_empty() {
                return Err(HandshakeError::Disconnected);
            }
            // End of file: parse what came (an incomplete value is refused by the parser).
            break;
        }
        let done = end.feed(&buf[len..len + n]);
        len += n;
        if len > MAX_HANDSHAKE_BYTES {
            return Err(HandshakeError::TooLarge);
        }
        if done {
            break;
        }
    }
    let mut fds = fds.into_iter();
    let uffd = fds.next().ok_or(HandshakeError::NoFd)?;
    let memfds: Vec<OwnedFd> = fds.collect();
    let message = parse(&buf[..len], memfds.len())?;
    Ok(Handshake {
        uffd,
        memfds,
        message,
    })
}

/// One `recvmsg`: the bytes read and the descriptors that came with them.
fn recv_some(
    stream: &UnixStream,
    buf: &mut [u8],
    timeout: Duration,
) -> Result<(usize, Vec<OwnedFd>), HandshakeError> {
    let received = match crate::socket::recv_with_fds::<MAX_FDS>(stream, buf) {
        Ok(received) => received,
        Err(nix::errno::Errno::EAGAIN) => return Err(HandshakeError::Timeout(timeout)),
        Err(e) => return Err(HandshakeError::Recv(e.into())),
    };
    if received.truncated {
        return Err(HandshakeError::TooManyFds(MAX_FDS + 1));
    }
    Ok((received.bytes, received.fds))
}

/// Finds where a JSON array or object ends, fed in pieces (strings and escapes tracked), so
/// that a long handshake is read in O(length). Anything else counts as ended at once: the
/// parser then says what is wrong with it.
#[derive(Debug, Default)]
struct ValueEnd {
    started: bool,
    depth: usize,
    in_string: bool,
    escaped: bool,
}

impl ValueEnd {
    /// Feeds the next bytes; true once the value has ended.
    fn feed(&mut self, bytes: &[u8]) -> bool {
        for &b in bytes {
            if !self.started {
                match b {
                    b'[' | b'{' => {
                        self.started = true;
                        self.depth = 1;
                    }
                    b if b.is_ascii_whitespace() => {}
                    _ => return true,
                }
                continue;
            }
            if self.in_string {
                match (self.escaped, b) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'[' | b'{' => self.depth += 1,
                b']' | b'}' => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        return true;
                    }
                }
                _ => {}
            }
        }
        false
    }
}

/// Parses a handshake body that came with `memfds` descriptors after the userfaultfd: the
/// project's JSON object, or Firecracker's bare array (which brings no memfds).
pub fn parse(body: &[u8], memfds: usize) -> Result<Message, HandshakeError> {
    if body.len() > MAX_HANDSHAKE_BYTES {
        return Err(HandshakeError::TooLarge);
    }
    if body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{') {
        let handshake: PvisorHandshake =
            serde_json::from_slice(body).map_err(HandshakeError::Json)?;
        if handshake.protocol != PVISOR_PROTOCOL {
            return Err(HandshakeError::Protocol(handshake.protocol));
        }
        Ok(Message::Pvisor(handshake))
    } else {
        if memfds > 0 {
            return Err(HandshakeError::TooManyFds(memfds + 1));
        }
        Ok(Message::Firecracker(
            serde_json::from_slice(body).map_err(HandshakeError::Json)?,
        ))
    }
}

/// Validates regions: page size 4 KiB or 2 MiB, aligned to it in memory and in the image, no
/// overlap in memory or in the image, every byte inside an image of `image_size` bytes.
pub fn validate(raw: &[GuestRegion], image_size: u64) -> Result<Vec<Region>, HandshakeError> {
    if raw.is_empty() {
        return Err(HandshakeError::Empty);
    }
    let bad = |index: usize, reason: String| HandshakeError::Region { index, reason };
    let mut regions: Vec<Region> = Vec::with_capacity(raw.len());
    for (index, r) in raw.iter().enumerate() {
        let page_size = r.page_size.or(r.page_size_kib).unwrap_or(PAGE_SIZE);
        if let (Some(a), Some(b)) = (r.page_size, r.page_size_kib) {
            if a != b {
                return Err(bad(
                    index,
                    format!("page_size {a} and page_size_kib {b} disagree"),
                ));
            }
        }
        let page_size = match page_size {
            4096 => PageSize::BASE,
            2_097_152 => PageSize::HUGE,
            other => {
                return Err(bad(
                    index,
                    format!("page size {other} is not served (4096 or 2097152 bytes)"),
                ))
            }
        };
        let range = HostRange::new(HostAddr(r.base_host_virt_addr), r.size)
            .map_err(|e| bad(index, e.to_string()))?;
        if !page_size.is_aligned(r.offset) {
            return Err(bad(
                index,
                format!(
                    "offset {:#x} is not aligned to its {}-byte pages",
                    r.offset,
                    page_size.bytes()
                ),
            ));
        }
        if !page_size.is_aligned(r.base_host_virt_addr) || !page_size.is_aligned(r.size) {
            return Err(bad(
                index,
                format!(
                    "{range:?} is not aligned to its {}-byte pages",
                    page_size.bytes()
                ),
            ));
        }
        let end = r
            .offset
            .checked_add(r.size)
            .filter(|&end| end <= image_size)
            .ok_or_else(|| {
                bad(
                    index,
                    format!(
                        "offset {:#x} + size {:#x} is beyond the {image_size}-byte memory image",
                        r.offset, r.size
                    ),
                )
            })?;
        for (other_index, other) in regions.iter().enumerate() {
            if other.range.overlaps(&range) {
                return Err(bad(
                    index,
                    format!("overlaps region {other_index} in memory"),
                ));
            }
            if other.offset < end && r.offset < other.offset + other.range.len() {
                return Err(bad(
                    index,
                    format!("overlaps region {other_index} in the image"),
                ));
            }
        }
        regions.push(Region {
            range,
            offset: r.offset,
            page_size,
        });
    }
    Ok(regions)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Vec<Region>, HandshakeError> {
        let raw: Vec<GuestRegion> = serde_json::from_str(json).map_err(HandshakeError::Json)?;
        validate(&raw, 1 << 30)
    }

    #[test]
    fn handshake_firecracker_forms_are_all_accepted() {
        // 1.12 style: both fields, in bytes.
        let regions = parse(
            r#"[{"base_host_virt_addr":140000000000000,"size":1048576,"offset":0,"page_size":4096,"page_size_kib":4096}]"#,
        )
        .unwrap();
        assert_eq!(regions[0].range.len(), 1 << 20);
        // Pre-1.7: no page size at all; unknown fields ignored.
        parse(r#"[{"base_host_virt_addr":140000000000000,"size":4096,"offset":0,"future":true}]"#)
            .unwrap();
        // Only one of the two fields.
        parse(r#"[{"base_host_virt_addr":140000000000000,"size":4096,"offset":8192,"page_size_kib":4096}]"#)
            .unwrap();
    }

    #[test]
    fn handshake_bad_regions_are_refused_with_a_reason() {
        let cases = [
            (r#"[]"#, "no regions"),
            (r#"{"regions":[]}"#, "not a JSON array"),
            (
                r#"[{"base_host_virt_addr":4097,"size":4096,"offset":0}]"#,
                "not page-aligned",
            ),
            (
                r#"[{"base_host_virt_addr":4096,"size":100,"offset":0}]"#,
                "not page-aligned",
            ),
            (
                r#"[{"base_host_virt_addr":4096,"size":4096,"offset":7}]"#,
                "offset 0x7",
            ),
            (
                r#"[{"base_host_virt_addr":4096,"size":4096,"offset":0,"page_size":65536}]"#,
                "4096 or 2097152 bytes",
            ),
            (
                r#"[{"base_host_virt_addr":4096,"size":2097152,"offset":0,"page_size":2097152}]"#,
                "not aligned to its 2097152-byte pages",
            ),
            (
                r#"[{"base_host_virt_addr":2097152,"size":2097152,"offset":4096,"page_size_kib":2097152}]"#,
                "offset 0x1000 is not aligned to its 2097152-byte pages",
            ),
            (
                r#"[{"base_host_virt_addr":4096,"size":8192,"offset":0},{"base_host_virt_addr":8192,"size":4096,"offset":65536}]"#,
                "overlaps region 0 in memory",
            ),
            (
                r#"[{"base_host_virt_addr":4096,"size":8192,"offset":0},{"base_host_virt_addr":65536,"size":4096,"offset":4096}]"#,
                "overlaps region 0 in the image",
            ),
            (
                r#"[{"base_host_virt_addr":4096,"size":8192,"offset":1073737728}]"#,
                "beyond the",
            ),
            (
                r#"[{"base_host_virt_addr":4096,"size":4096,"offset":0,"page_size":4096,"page_size_kib":8192}]"#,
                "disagree",
            ),
        ];
        for (json, expect) in cases {
            let err = parse(json).unwrap_err();
            let text = basics::error_chain(&err);
            assert!(text.contains(expect), "{json}: {text}");
        }
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        const IMAGE: u64 = 1 << 30;

        /// Numbers a hostile peer would pick: edges, near-misses and plain values.
        fn number() -> impl Strategy<Value = u64> {
            prop_oneof![
                Just(0u64),
                Just(4096),
                Just(u64::MAX),
                Just(u64::MAX - 4095),
                Just(IMAGE),
                Just(IMAGE - 4096),
                Just(2 << 20),
                (0u64..1 << 20).prop_map(|p| p * PAGE_SIZE),
                any::<u64>(),
                0u64..10_000,
            ]
        }

        fn region() -> impl Strategy<Value = String> {
            (
                number(),
                number(),
                number(),
                prop::option::of(number()),
                prop::option::of(number()),
                prop::option::of(0usize..40),
                any::<bool>(),
            )
                .prop_map(|(base, size, offset, ps, psk, memfd, extra)| {
                    let mut fields = vec![
                        format!(r#""base_host_virt_addr":{base}"#),
                        format!(r#""size":{size}"#),
                        format!(r#""offset":{offset}"#),
                    ];
                    if let Some(ps) = ps {
                        fields.push(format!(r#""page_size":{ps}"#));
                    }
                    if let Some(psk) = psk {
                        fields.push(format!(r#""page_size_kib":{psk}"#));
                    }
                    if let Some(memfd) = memfd {
                        fields.push(format!(r#""memfd":{memfd},"memfd_offset":{base}"#));
                    }
                    if extra {
                        fields.push(r#""future":[{"x":"]}\""}]"#.into());
                    }
                    format!("{{{}}}", fields.join(","))
                })
        }

        /// Handshake bodies of both protocols, whole or cut or with a byte changed.
        fn body() -> impl Strategy<Value = Vec<u8>> {
            let regions = prop::collection::vec(region(), 0..12).prop_map(|r| r.join(","));
            let json = (regions, 0u8..4, "[a-z/0-9.-]{0,16}").prop_map(|(regions, kind, proto)| {
                match kind {
                    0 | 1 => format!("[{regions}]"),
                    2 => format!(
                        r#"{{"protocol":"pvisor-uffd/1","initial":"zero","regions":[{regions}]}}"#
                    ),
                    _ => format!(r#"{{"protocol":"{proto}","regions":[{regions}]}}"#),
                }
            });
            (json, any::<prop::sample::Index>(), any::<u8>(), 0u8..3).prop_map(
                |(json, at, byte, mutation)| {
                    let mut bytes = json.into_bytes();
                    let i = at.index(bytes.len().max(1)).min(bytes.len());
                    match mutation {
                        0 => {}
                        1 => bytes.truncate(i),
                        _ => {
                            if i < bytes.len() {
                                bytes[i] = byte;
                            }
                        }
                    }
                    bytes
                },
            )
        }

        /// Parses and validates as the server does; checks what is accepted.
        fn check(body: &[u8], memfds: usize) -> Result<(), TestCaseError> {
            let raw = match crate::server::handshake::parse(body, memfds) {
                Ok(Message::Firecracker(raw)) => raw,
                Ok(Message::Pvisor(hello)) => {
                    prop_assert_eq!(hello.protocol.as_str(), PVISOR_PROTOCOL);
                    hello.regions.into_iter().map(|r| r.region).collect()
                }
                Err(_) => return Ok(()),
            };
            let Ok(regions) = validate(&raw, IMAGE) else {
                return Ok(());
            };
            prop_assert!(!regions.is_empty());
            for (i, r) in regions.iter().enumerate() {
                prop_assert_eq!(r.offset % PAGE_SIZE, 0);
                prop_assert!(r.page_size.is_aligned(r.offset));
                prop_assert!(r.page_size.is_aligned(r.range.start().0));
                prop_assert!(r.page_size.is_aligned(r.range.len()));
                prop_assert!(r.offset + r.range.len() <= IMAGE);
                for other in &regions[..i] {
                    prop_assert!(!r.range.overlaps(&other.range));
                    prop_assert!(
                        r.offset >= other.offset + other.range.len()
                            || other.offset >= r.offset + r.range.len()
                    );
                }
            }
            Ok(())
        }

        proptest! {
            #[test]
            fn fuzz_handshake_random_bytes_never_panic(
                bytes in prop::collection::vec(any::<u8>(), 0..512),
                memfds in 0usize..4,
            ) {
                check(&bytes, memfds)?;
                let mut end = ValueEnd::default();
                let _ = end.feed(&bytes);
            }

            #[test]
            fn fuzz_handshake_json_bodies_are_parsed_or_refused(body in body(), memfds in 0usize..4) {
                check(&body, memfds)?;
            }

            #[test]
            fn fuzz_handshake_random_region_lists_validate_consistently(
                regions in prop::collection::vec(
                    (0u64..64, 1u64..16, 0u64..64).prop_map(|(base, pages, offset)| GuestRegion {
                        base_host_virt_addr: base * PAGE_SIZE,
                        size: pages * PAGE_SIZE,
                        offset: offset * PAGE_SIZE,
                        page_size: None,
                        page_size_kib: Some(PAGE_SIZE),
                    }),
                    1..8,
                ),
            ) {
                let json = serde_json::to_vec(&regions).expect("plain structs serialize");
                let accepted = match crate::server::handshake::parse(&json, 0) {
                    Ok(Message::Firecracker(raw)) => validate(&raw, 64 * PAGE_SIZE).is_ok(),
                    other => return Err(TestCaseError::fail(format!("{other:?}"))),
                };
                // Accepted exactly when no two overlap in memory or in the image and all fit.
                let fits = regions.iter().all(|r| r.offset + r.size <= 64 * PAGE_SIZE);
                let disjoint = regions.iter().enumerate().all(|(i, a)| {
                    regions[..i].iter().all(|b| {
                        let apart = |x: u64, xl: u64, y: u64, yl: u64| x + xl <= y || y + yl <= x;
                        apart(a.base_host_virt_addr, a.size, b.base_host_virt_addr, b.size)
                            && apart(a.offset, a.size, b.offset, b.size)
                    })
                });
                prop_assert_eq!(accepted, fits && disjoint);
            }

            #[test]
            fn fuzz_handshake_value_end_finds_the_end_in_any_split(
                body in body(),
                cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
            ) {
                // Byte by byte: where the end is found.
                let mut bytewise = ValueEnd::default();
                let found = (0..body.len()).find(|&n| bytewise.feed(&body[n..=n])).map(|n| n + 1);
                // In pieces cut anywhere: found or not the same way.
                let mut points: Vec<usize> = cuts.iter().map(|c| c.index(body.len() + 1)).collect();
                points.push(body.len());
                points.sort_unstable();
                let mut split = ValueEnd::default();
                let mut from = 0;
                let mut done = false;
                for to in points {
                    if !done && to > from {
                        done = split.feed(&body[from..to]);
                    }
                    from = to;
                }
                prop_assert_eq!(done, found.is_some());
                // Where a value parses, the end found is its end.
                let mut values = serde_json::Deserializer::from_slice(&body)
                    .into_iter::<serde_json::Value>();
                if let Some(Ok(serde_json::Value::Array(_) | serde_json::Value::Object(_))) =
                    values.next()
                {
                    prop_assert_eq!(found, Some(values.byte_offset()));
                }
            }
        }
    }
}
