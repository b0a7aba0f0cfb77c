//! Part 2: restoring a VM image through a UFFD handler, driven the way Firecracker drives one
//! (private anonymous RAM, a uffd with `EVENT_REMOVE`, registered MISSING, one `sendmsg` of
//! the JSON regions and the uffd). One thread touches the memory right after the handshake is
//! sent (as Firecracker resumes its vCPUs), reading one byte per page in order, timed from the
//! first touch to the last: either 1 MiB at the start of every 8 MiB (lazy) or every page
//! (full). Handlers: our `Server` (one fault thread per VM, from the raw file or from an lz4
//! store) and the Firecracker-example-style handler of `firecracker.rs` (raw file), on guest
//! RAM of 4 KiB pages, and our `Server` again on RAM of 2 MiB huge pages (Firecracker's
//! `huge_pages: "2M"`: private `MAP_HUGETLB` memory, `page_size` 2097152 in the handshake).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use compressed_backing::BlockSize;
use uffd_pager::server::{Server, ServerConfig};
use uffd_pager::source::PageSource;

use crate::common::results::Results;
use crate::firecracker;
use crate::ram::{self, FirecrackerVm};
use crate::Res;

/// Who serves the faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Who {
    OursRaw,
    OursLz4,
    Firecracker,
    /// Ours, on RAM of 2 MiB huge pages.
    OursRawHuge,
    OursLz4Huge,
    /// The Firecracker-example-style handler on RAM of 2 MiB huge pages.
    FirecrackerHuge,
}

impl Who {
    pub const ALL: [Who; 6] = [
        Who::OursRaw,
        Who::OursLz4,
        Who::Firecracker,
        Who::OursRawHuge,
        Who::OursLz4Huge,
        Who::FirecrackerHuge,
    ];

    pub fn key(self) -> &'static str {
        match self {
            Who::OursRaw => "ours_raw",
            Who::OursLz4 => "ours_lz4",
            Who::Firecracker => "firecracker",
            Who::OursRawHuge => "ours_raw_huge",
            Who::OursLz4Huge => "ours_lz4_huge",
            Who::FirecrackerHuge => "firecracker_huge",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Who::OursRaw => "ours (`Server`), raw file",
            Who::OursLz4 => "ours (`Server`), lz4 store",
            Who::Firecracker => "Firecracker-example-style handler, raw file",
            Who::OursRawHuge => "ours (`Server`), raw file, 2 MiB pages",
            Who::OursLz4Huge => "ours (`Server`), lz4 store, 2 MiB pages",
            Who::FirecrackerHuge => "Firecracker-example-style handler, raw file, 2 MiB pages",
        }
    }

    /// Whether guest RAM is of 2 MiB huge pages.
    pub fn huge(self) -> bool {
        matches!(
            self,
            Who::OursRawHuge | Who::OursLz4Huge | Who::FirecrackerHuge
        )
    }
}

/// How much is touched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Touch {
    Lazy,
    Full,
}

impl Touch {
    pub fn key(self) -> &'static str {
        match self {
            Touch::Lazy => "lazy",
            Touch::Full => "full",
        }
    }
}

/// Our server, running on its own thread until dropped.
pub struct Running {
    pub socket: PathBuf,
    pub server: Arc<Server>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Running {
    pub fn start(socket: &Path, source: Arc<dyn PageSource>, block_size: BlockSize) -> Res<Self> {
        let server = Arc::new(Server::bind(
            socket,
            source,
            ServerConfig {
                threads: 1,
                block_size,
            },
        )?);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (server, stop) = (Arc::clone(&server), Arc::clone(&stop));
            std::thread::spawn(move || server.run(&stop))
        };
        Ok(Self {
            socket: socket.to_path_buf(),
            server,
            stop,
            thread: Some(thread),
        })
    }

    /// Waits until no VM is attached any more.
    fn wait_idle(&self) -> Res<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.server.stats().active.load(Ordering::Relaxed) > 0 {
            if Instant::now() > deadline {
                return Err("the server did not release a VM within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.server.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

pub struct Setup<'a> {
    pub raw_server: &'a Running,
    pub lz4_server: &'a Running,
    pub mem_file: &'a Path,
    pub fc_socket: &'a Path,
    pub image: &'a [u8],
    pub lazy: &'a [(usize, usize)],
}

/// Measures every handler on both touch patterns once, in an order rotated by `run`.
pub fn round(run: usize, setup: &Setup<'_>, results: &mut Results) -> Res<()> {
    let mut cases = Vec::new();
    for touch in [Touch::Lazy, Touch::Full] {
        for who in Who::ALL {
            cases.push((who, touch));
        }
    }
    for i in 0..cases.len() {
        let (who, touch) = cases[(i + run) % cases.len()];
        measure(run, who, touch, setup, results)?;
    }
    Ok(())
}

fn measure(
    run: usize,
    who: Who,
    touch: Touch,
    setup: &Setup<'_>,
    results: &mut Results,
) -> Res<()> {
    let len = setup.image.len();
    let full = [(0, len)];
    let ranges: &[(usize, usize)] = match touch {
        Touch::Lazy => setup.lazy,
        Touch::Full => &full,
    };
    ram::recycle(len + len / 8)?;
    if who.huge() {
        ram::recycle_huge(len)?;
    }
    let vm = FirecrackerVm::new(len, who.huge())?;
    let handler = match who {
        Who::Firecracker | Who::FirecrackerHuge => Some(firecracker::Handler::spawn(
            setup.fc_socket,
            setup.mem_file,
        )?),
        _ => None,
    };
    let socket = match who {
        Who::OursRaw | Who::OursRawHuge => &setup.raw_server.socket,
        Who::OursLz4 | Who::OursLz4Huge => &setup.lz4_server.socket,
        Who::Firecracker | Who::FirecrackerHuge => setup.fc_socket,
    };
    let cpu = crate::common::host::CpuSample::now();
    let stream = vm.connect(socket)?;
    let pass = ram::touch_pages(&vm.map, ranges);
    let (other_cpu, _) = cpu.since();
    if pass.sum != ram::expected_sum(setup.image, ranges) {
        return Err(format!("{who:?} {touch:?}: the touched bytes differ from the image").into());
    }
    // Untimed: everything touched is resident with the image's bytes.
    for &(offset, n) in ranges {
        if vm.map.bytes()[offset..offset + n] != setup.image[offset..offset + n] {
            return Err(format!("{who:?} {touch:?}: memory differs from the image").into());
        }
    }
    drop(stream);
    let handler_faults = match handler {
        Some(handler) => handler.join()? as f64,
        None => {
            let server = match who {
                Who::OursLz4 | Who::OursLz4Huge => setup.lz4_server,
                _ => setup.raw_server,
            };
            server.wait_idle()?;
            f64::NAN
        }
    };
    drop(vm);
    let key = format!("restore.{}.{}", touch.key(), who.key());
    let touched = ranges.iter().map(|r| r.1).sum::<usize>() as f64;
    let secs = pass.elapsed.as_secs_f64();
    let figures = [
        ("ms", "ms", secs * 1e3),
        ("faults", "faults", pass.faults as f64),
        ("other_cpu_pct", "% of a CPU", other_cpu),
        ("mib_per_s", "MiB/s", touched / f64::from(1u32 << 20) / secs),
    ];
    results.put_all(&key, run, figures);
    if !handler_faults.is_nan() {
        results.put(
            &format!("{key}.handler_faults"),
            "faults",
            run,
            handler_faults,
        );
    }
    Ok(())
}
