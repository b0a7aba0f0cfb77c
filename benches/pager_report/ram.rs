//! Guest RAM for the bench: anonymous mappings, the host threads that touch them, the
//! touching thread's own fault count, and the Firecracker side of the UFFD handshake.

use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use uffd_pager::addr::{HostAddr, HostRange, PAGE_SIZE};
use uffd_pager::pager::{Pager, PagerConfig, RamKind, RegionSpec};
use uffd_pager::source::PageSource;
use uffd_pager::uffd::{feature, Mode, Userfaultfd};

use crate::Res;

pub const PAGE: usize = PAGE_SIZE as usize;
pub const BLOCK: usize = 64 << 10;

/// Guest RAM of the bench: testkit's mapping (private anonymous, as Firecracker maps guest
/// memory, or a read-only private file mapping, as its example handler maps the memory file).
pub use testkit::Mapping;

/// A mapping as the pager's host range.
fn range(map: &Mapping) -> HostRange {
    HostRange::new(HostAddr::from_ptr(map.as_ptr()), map.len() as u64)
        .expect("mmap returns a page-aligned, non-empty range")
}

/// Allocates `len` bytes of anonymous memory, populated, and frees them again, untimed, so
/// that the measurement right after gets pages the host backs now. On this VM freed guest
/// memory is reported to the host (free page reporting, 8 MiB chunks, after a delay) and the
/// first touch of a reported page costs a host fault: without this, whichever case happened to
/// allocate first after a pause paid several times the fault cost of the others.
pub fn recycle(len: usize) -> Res<()> {
    let map = Mapping::new(
        len,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
        None,
    )
    .map_err(|e| format!("mmap of {len} bytes: {e}"))?;
    drop(map);
    Ok(())
}

/// [`recycle`] for RAM of 2 MiB huge pages: the kernel takes those from its free 2 MiB
/// blocks, which 4 KiB allocations may leave untouched (and reported to the host), so that a
/// huge page's first copy would pay 512 host faults (about 5 ms here, measured: a 2 MiB
/// `UFFDIO_COPY` took 0.3 ms or 5.5 ms) where the other cases pay none. `len` is rounded up to
/// whole huge pages.
pub fn recycle_huge(len: usize) -> Res<()> {
    let len = len.next_multiple_of(2 << 20);
    let flags = libc::MAP_PRIVATE
        | libc::MAP_ANONYMOUS
        | libc::MAP_POPULATE
        | libc::MAP_HUGETLB
        | libc::MAP_HUGE_2MB;
    let map = Mapping::new(len, libc::PROT_READ | libc::PROT_WRITE, flags, None)
        .map_err(|e| format!("mmap of {len} bytes of huge pages: {e}"))?;
    drop(map);
    Ok(())
}

/// Minor faults of the calling thread so far. A fault resolved through a userfaultfd counts one
/// (the kernel counts a retried fault once, when it completes); pages installed ahead of the
/// touch by a whole-block copy or the prefetcher count none.
pub fn thread_faults() -> u64 {
    // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_THREAD fills the struct for the calling thread.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
    if rc == 0 {
        u64::try_from(usage.ru_minflt).unwrap_or(0) + u64::try_from(usage.ru_majflt).unwrap_or(0)
    } else {
        0
    }
}

/// CPU time (ns, from `/proc/self/task/*/schedstat`) of every pager fault thread alive now.
pub fn fault_thread_cpu() -> Vec<(u64, u64)> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for task in tasks.flatten() {
        let path = task.path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if !comm.starts_with("uffd-fault-") {
            continue;
        }
        let ns = std::fs::read_to_string(path.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
        let tid = task.file_name().to_string_lossy().parse().unwrap_or(0);
        out.push((tid, ns));
    }
    out
}

/// `(total ns, busiest thread's share)` of the fault threads' CPU time between two samples.
pub fn fault_thread_work(before: &[(u64, u64)], after: &[(u64, u64)]) -> (u64, f64) {
    let deltas: Vec<u64> = after
        .iter()
        .map(|&(tid, ns)| ns - before.iter().find(|b| b.0 == tid).map_or(0, |b| b.1))
        .collect();
    let total: u64 = deltas.iter().sum();
    let busiest = deltas.iter().copied().max().unwrap_or(0);
    (total, busiest as f64 / total.max(1) as f64)
}

/// What one touching pass did.
#[derive(Debug, Clone, Copy, Default)]
pub struct Pass {
    pub elapsed: Duration,
    /// Sum of the bytes read (checked against the image).
    pub sum: u64,
    /// Faults the touching thread took.
    pub faults: u64,
}

/// One thread reads one byte per page of each `(offset, len)` range in order, timed from the
/// first touch to the last.
pub fn touch_pages(map: &Mapping, ranges: &[(usize, usize)]) -> Pass {
    let faults = thread_faults();
    let mut sum = 0u64;
    let started = Instant::now();
    for &(offset, len) in ranges {
        let mut at = offset;
        while at < offset + len {
            sum += u64::from(map.read(at));
            at += PAGE;
        }
    }
    let elapsed = started.elapsed();
    Pass {
        elapsed,
        sum,
        faults: thread_faults() - faults,
    }
}

/// The sum `touch_pages` must find.
pub fn expected_sum(image: &[u8], ranges: &[(usize, usize)]) -> u64 {
    ranges
        .iter()
        .flat_map(|&(offset, len)| (offset..offset + len).step_by(PAGE))
        .map(|at| u64::from(image[at]))
        .sum()
}

/// `total` bytes spread over `len`: `chunk` bytes at the start of every `len * chunk / total`.
pub fn scattered(len: usize, total: usize, chunk: usize) -> Vec<(usize, usize)> {
    let chunks = (total / chunk).max(1);
    let stride = len / chunks;
    (0..chunks).map(|i| (i * stride, chunk)).collect()
}

/// Touches one byte at the start of each block of `blocks` with `threads` threads (contiguous
/// shares), timing every read; returns the latencies in nanoseconds, the wall time and the
/// faults the touching threads took.
pub fn touch_blocks(map: &Mapping, blocks: usize, threads: usize) -> (Vec<u64>, Duration, u64) {
    let share = blocks.div_ceil(threads);
    let started = Instant::now();
    let results: Vec<(Vec<u64>, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    let faults = thread_faults();
                    let mut latencies = Vec::with_capacity(share);
                    for block in t * share..((t + 1) * share).min(blocks) {
                        let before = Instant::now();
                        let byte = map.read(block * BLOCK);
                        let ns = before.elapsed().as_nanos();
                        std::hint::black_box(byte);
                        latencies.push(u64::try_from(ns).unwrap_or(u64::MAX));
                    }
                    (latencies, thread_faults() - faults)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a touching thread panicked"))
            .collect()
    });
    let elapsed = started.elapsed();
    let faults = results.iter().map(|r| r.1).sum();
    let latencies = results.into_iter().flat_map(|r| r.0).collect();
    (latencies, elapsed, faults)
}

/// An in-process pager over `map` (anonymous RAM of this process, image offset 0).
pub fn pager(
    map: &Mapping,
    config: PagerConfig,
    restore: Option<Arc<dyn PageSource>>,
) -> Res<Pager> {
    let spec = RegionSpec {
        kind: RamKind::Anon,
        range: range(map),
        image_offset: 0,
        memfd: None,
        memfd_offset: 0,
        view: Some(range(map).start()),
    };
    let on_error = Box::new(|e: &uffd_pager::pager::FaultError| {
        // A fault that cannot be served leaves its thread blocked forever: stop the bench.
        let mut text = e.to_string();
        let mut cause = std::error::Error::source(e);
        while let Some(next) = cause {
            text = format!("{text}: {next}");
            cause = next.source();
        }
        eprintln!("pager_report: fault error: {text}");
        std::process::exit(1);
    });
    // SAFETY: every caller keeps `map` alive until the pager is dropped (declared before it)
    // and touches it only through the pager.
    Ok(unsafe { Pager::new(vec![spec], config, restore, on_error)? })
}

/// Guest memory the way Firecracker has it at restore: private anonymous RAM (of 2 MiB huge
/// pages with `huge_pages: "2M"`) registered MISSING on a userfaultfd with
/// `UFFD_FEATURE_EVENT_REMOVE`.
pub struct FirecrackerVm {
    pub uffd: Userfaultfd,
    pub map: Mapping,
    page_size: usize,
}

impl FirecrackerVm {
    pub fn new(len: usize, huge: bool) -> Res<Self> {
        let uffd = Userfaultfd::create(feature::EVENT_REMOVE)?;
        let (map, page_size) = if huge {
            let flags = libc::MAP_PRIVATE
                | libc::MAP_ANONYMOUS
                | libc::MAP_NORESERVE
                | libc::MAP_HUGETLB
                | libc::MAP_HUGE_2MB;
            (
                Mapping::new(len, libc::PROT_READ | libc::PROT_WRITE, flags, None)?,
                2 << 20,
            )
        } else {
            (Mapping::try_anon(len)?, PAGE)
        };
        // SAFETY: `map` lives as long as the uffd in this struct; whoever serves it only
        // resolves faults through the uffd.
        unsafe { uffd.register(range(&map), Mode::MISSING)? };
        Ok(Self {
            uffd,
            map,
            page_size,
        })
    }

    /// Connects to `socket` and sends Firecracker 1.12's handshake: one message with the bare
    /// JSON array of regions and the uffd as `SCM_RIGHTS`. The socket stays open.
    pub fn connect(&self, socket: &Path) -> Res<UnixStream> {
        let stream = UnixStream::connect(socket)?;
        let json = format!(
            r#"[{{"base_host_virt_addr":{},"size":{},"offset":0,"page_size":{2},"page_size_kib":{2}}}]"#,
            range(&self.map).start().0,
            self.map.len(),
            self.page_size
        );
        send_with_fd(&stream, json.as_bytes(), self.uffd.as_raw_fd())?;
        Ok(stream)
    }
}

/// `sendmsg` of `bytes` with `fd` as `SCM_RIGHTS`.
fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: i32) -> Res<()> {
    let fd_len = std::mem::size_of::<i32>() as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fd_len) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at a control buffer of `space` bytes, room for one header and one
    // descriptor; CMSG_FIRSTHDR/CMSG_DATA stay inside it.
    let rc = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(fd_len) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<i32>(), fd);
        libc::sendmsg(stream.as_raw_fd(), &msg, 0)
    };
    if usize::try_from(rc).ok() != Some(bytes.len()) {
        return Err(format!(
            "sendmsg of the handshake: {}",
            std::io::Error::last_os_error()
        )
        .into());
    }
    (&*stream).flush()?;
    Ok(())
}
