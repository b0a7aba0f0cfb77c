//! The baseline: a handler written the way Firecracker's `examples/uffd/valid_handler.rs`
//! serves a snapshot (its `uffd_utils.rs` `Runtime` and `UffdHandler`).
//!
//! One thread accepts one connection, maps the memory file `PROT_READ`/`MAP_PRIVATE`, receives
//! the handshake (JSON regions + the uffd), then polls the socket and the uffd; for every
//! page fault it answers with one `UFFDIO_COPY` (waking) of the faulting page (4 KiB, or the
//! region's `page_size`: 2 MiB with Firecracker's `huge_pages: "2M"`) straight from the file
//! mapping, or `UFFDIO_ZEROPAGE` for a 4 KiB page a `REMOVE` event discarded (kept in a
//! `HashSet` of page numbers, as the example does). It stops when the socket closes.
//! Deviations, none of which the bench exercises: events are read with the pager's wrapper
//! (up to 64 per `read`, where the example reads one; with one touching thread there is only
//! ever one pending), and a copy failing with `EAGAIN` is retried after the next read of events
//! instead of being dropped.

use std::collections::HashSet;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use uffd_pager::addr::{HostAddr, HostRange, PAGE_SIZE};
use uffd_pager::socket::recv_with_fds;
use uffd_pager::uffd::{Event, UffdError, Userfaultfd};

use crate::ram::{Mapping, PAGE};
use crate::Res;

/// A handler waiting for its one VM.
pub struct Handler {
    thread: JoinHandle<Result<u64, String>>,
}

impl Handler {
    /// Listens on `socket` (bound before returning) and serves one VM from `mem_file`.
    pub fn spawn(socket: &Path, mem_file: &Path) -> Res<Self> {
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket)?;
        let mem_file: PathBuf = mem_file.to_path_buf();
        let thread = std::thread::Builder::new()
            .name("fc-uffd-handler".into())
            .spawn(move || serve(&listener, &mem_file).map_err(|e| e.to_string()))?;
        Ok(Self { thread })
    }

    /// Waits until the VM has left; returns the page faults served.
    pub fn join(self) -> Res<u64> {
        Ok(self
            .thread
            .join()
            .map_err(|_| "the Firecracker-style handler panicked")??)
    }
}

/// One region of the handshake (`GuestRegionUffdMapping`).
struct Region {
    base: u64,
    size: u64,
    offset: u64,
    page_size: u64,
}

fn serve(listener: &UnixListener, mem_file: &Path) -> Res<u64> {
    let (stream, _) = listener.accept()?;
    let file = File::open(mem_file)?;
    let backing = Mapping::file(&file, usize::try_from(file.metadata()?.len())?)?;
    let (json, uffd) = receive(&stream)?;
    let regions = parse_regions(&json)?;
    let uffd = Userfaultfd::from_fd(uffd);
    let mut removed: HashSet<u64> = HashSet::new();
    let mut events = Vec::with_capacity(64);
    let mut pending: Vec<HostAddr> = Vec::new();
    let mut served = 0u64;
    let mut discard = [0u8; 256];
    loop {
        let (uffd_ready, stream_ready) = uffd.poll(Some(stream.as_raw_fd()), -1)?;
        if stream_ready {
            // Firecracker sends nothing after the handshake: readable means it left.
            // SAFETY: reading into our own buffer.
            let n = unsafe {
                libc::read(
                    stream.as_raw_fd(),
                    discard.as_mut_ptr().cast(),
                    discard.len(),
                )
            };
            if n <= 0 {
                return Ok(served);
            }
        }
        if !uffd_ready && pending.is_empty() {
            continue;
        }
        uffd.read_events(&mut events)?;
        for event in events.drain(..) {
            match event {
                Event::Pagefault { addr, .. } => pending.push(addr),
                Event::Remove { start, end } => {
                    removed.extend(start.0 / PAGE_SIZE..end.0 / PAGE_SIZE);
                }
                _ => {}
            }
        }
        let mut retry = Vec::new();
        for addr in pending.drain(..) {
            let region = regions
                .iter()
                .find(|r| addr.0 >= r.base && addr.0 < r.base + r.size)
                .ok_or_else(|| format!("fault at {addr} outside every region"))?;
            let page = HostAddr(addr.0 - (addr.0 - region.base) % region.page_size);
            let len = usize::try_from(region.page_size)?;
            let result = if len == PAGE && removed.contains(&(page.0 / PAGE_SIZE)) {
                let range = HostRange::new(page, PAGE_SIZE).expect("one page");
                uffd.zeropage(range, true).map(|_| ())
            } else {
                let at = usize::try_from(region.offset + page.0 - region.base)?;
                uffd.copy(page, &backing.bytes()[at..at + len], true)
                    .map(|_| ())
            };
            match result {
                Ok(()) => served += 1,
                Err(UffdError::Retry { .. }) => retry.push(addr),
                Err(e) => return Err(e.into()),
            }
        }
        pending = retry;
    }
}

/// Receives the handshake: the JSON text and the one descriptor (one `recvmsg`, the
/// descriptor passed with `SCM_RIGHTS`).
fn receive(stream: &UnixStream) -> Res<(String, OwnedFd)> {
    let mut buf = vec![0u8; 4096];
    let received = recv_with_fds::<1>(stream, &mut buf)?;
    let uffd = received.fds.into_iter().next();
    let uffd = uffd.ok_or("the handshake carries no descriptor")?;
    Ok((String::from_utf8(buf[..received.bytes].to_vec())?, uffd))
}

/// The regions of a bare JSON array of `{base_host_virt_addr, size, offset, ...}` (the bench
/// sends it; numbers only, no nesting).
fn parse_regions(json: &str) -> Res<Vec<Region>> {
    let field = |object: &str, key: &str| -> Res<u64> {
        let pattern = format!("\"{key}\":");
        let at = object
            .find(&pattern)
            .ok_or_else(|| format!("no {key} in {object}"))?;
        let digits: String = object[at + pattern.len()..]
            .trim_start()
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        Ok(digits.parse()?)
    };
    json.split('{')
        .skip(1)
        .map(|object| {
            Ok(Region {
                base: field(object, "base_host_virt_addr")?,
                size: field(object, "size")?,
                offset: field(object, "offset")?,
                page_size: field(object, "page_size").unwrap_or(PAGE_SIZE),
            })
        })
        .collect()
}
