//! Firecracker's UFFD handshake: one message on a Unix socket carrying a bare JSON array of
//! guest-memory regions and, as `SCM_RIGHTS`, the userfaultfd. Both page-size fields are in
//! bytes despite the name of one; versions before 1.7 send neither (4096 is assumed); unknown
//! fields are ignored. `offset` is the region's offset in the memory file.

use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};

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
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = match recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    ) {
        Ok(msg) => msg,
        Err(nix::errno::Errno::EAGAIN) => return Err(HandshakeError::Timeout(timeout)),
        Err(e) => return Err(HandshakeError::Recv(e.into())),
    };
    let mut fds = Vec::new();
    for control in msg.cmsgs().map_err(|e| HandshakeError::Recv(e.into()))? {
        if let ControlMessageOwned::ScmRights(received) = control {
            // SAFETY: the kernel just installed these descriptors for us; nobody else owns
            // them.
            fds.extend(
                received
                    .into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    if msg.flags.intersects(MsgFlags::MSG_CTRUNC) {
        return Err(HandshakeError::TooManyFds(MAX_FDS + 1));
    }
    Ok((msg.bytes, fds))
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

/// Validates regions: page size 4 KiB (huge pages are not served), page-aligned, no overlap
/// in memory or in the image, every byte inside an image of `image_size` bytes.
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
        if page_size != PAGE_SIZE {
            return Err(bad(
                index,
                format!("page size {page_size} is not served (only 4096-byte pages)"),
            ));
        }
        let range = HostRange::new(HostAddr(r.base_host_virt_addr), r.size)
            .map_err(|e| bad(index, e.to_string()))?;
        if r.offset % PAGE_SIZE != 0 {
            return Err(bad(
                index,
                format!("offset {:#x} is not page-aligned", r.offset),
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
                r#"[{"base_host_virt_addr":4096,"size":4096,"offset":0,"page_size":2097152}]"#,
                "only 4096-byte pages",
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
            let text = crate::server::error_chain(&err);
            assert!(text.contains(expect), "{json}: {text}");
        }
    }
}
