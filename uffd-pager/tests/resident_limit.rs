//! The resident limit on the real device, with host threads touching registered anonymous
//! memory (no KVM): faults past the limit are held (and reported) until the limit is raised or
//! removed or a discard makes room; lazy and eager loads wait for room too; the live state
//! counts equal a scan throughout.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::fs::File;
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use compressed_backing::bulk::BulkOptions;
use compressed_backing::{Codec, CodecConfig};
use testkit::Mapping;
use uffd_pager::addr::{HostAddr, HostRange, PAGE_SIZE};
use uffd_pager::load::LoadMode;
use uffd_pager::offload::OffloadConfig;
use uffd_pager::pager::{Pager, PagerConfig, RamKind, RegionSpec};
use uffd_pager::state::{PageState, StateCounts};

const MIB: usize = 1 << 20;
/// The default block: what one fault on fresh memory installs.
const BLOCK: usize = 64 << 10;
const BLOCK_PAGES: u64 = BLOCK as u64 / PAGE_SIZE;
/// How long a held toucher is watched to be still blocked.
const HELD_FOR: Duration = Duration::from_millis(200);
/// A generous bound on how long a released fault takes to finish (it takes well under the
/// fault thread's 5 ms poll; the figure is printed).
const RELEASED_WITHIN: Duration = Duration::from_secs(1);

fn skip() -> bool {
    testkit::skip_unless(&["/dev/userfaultfd"])
}

/// Anonymous guest RAM with a pager serving it.
struct Vm {
    // Declared first: dropped (its threads stopped) before the mapping is unmapped.
    pager: Pager,
    map: Mapping,
    held_reports: Arc<Mutex<Vec<u64>>>,
}

impl Vm {
    fn new(len: usize) -> Self {
        Self::serve(Mapping::anon(len), None, PagerConfig::default())
    }

    /// Memfd RAM whose discards the pager is not told about (no `REMOVE` events): a page
    /// discarded with `MADV_DONTNEED` stays in the page cache and its next touch is a MINOR
    /// fault.
    fn memfd_without_remove_events(len: usize) -> Self {
        use nix::sys::memfd::{memfd_create, MFdFlags};
        use nix::sys::mman::{mmap, MapFlags, ProtFlags};
        let memfd = File::from(memfd_create(c"guest-ram", MFdFlags::MFD_CLOEXEC).unwrap());
        memfd.set_len(len as u64).unwrap();
        let size = std::num::NonZeroUsize::new(len).unwrap();
        let shared_rw = (
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_SHARED,
        );
        // SAFETY: a fresh shared mapping of our own memfd, which nothing else maps.
        let ptr = unsafe { mmap(None, size, shared_rw.0, shared_rw.1, &memfd, 0) }.unwrap();
        // SAFETY: `ptr` starts a live mapping of `len` bytes, handed to `Mapping` alone.
        let map = unsafe { Mapping::from_raw(ptr.as_ptr().cast(), len) };
        let config = PagerConfig {
            remove_events: false,
            ..PagerConfig::default()
        };
        Self::serve(map, Some(Arc::new(memfd)), config)
    }

    fn serve(map: Mapping, memfd: Option<Arc<File>>, config: PagerConfig) -> Self {
        let spec = RegionSpec {
            kind: if memfd.is_some() {
                RamKind::Memfd
            } else {
                RamKind::Anon
            },
            range: HostRange::new(HostAddr::from_ptr(map.as_ptr()), map.len() as u64).unwrap(),
            image_offset: 0,
            memfd,
            memfd_offset: 0,
            view: Some(HostAddr::from_ptr(map.as_ptr())),
        };
        // SAFETY: the mapping outlives the pager (the pager is dropped first, see `Vm`).
        let pager = unsafe {
            Pager::new(
                vec![spec],
                config,
                None,
                Box::new(|e| panic!("fault error: {e}")),
            )
            .unwrap()
        };
        let held_reports = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&held_reports);
        pager.on_held(Box::new(move |bytes| sink.lock().unwrap().push(bytes)));
        Self {
            pager,
            map,
            held_reports,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is live and `len` long, and borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr(), self.map.len()) }
    }

    fn digest(&self) -> u64 {
        // SAFETY: the mapping is live and `len` long.
        let bytes = unsafe { std::slice::from_raw_parts(self.map.as_ptr(), self.map.len()) };
        xxhash_rust::xxh3::xxh3_64(bytes)
    }

    /// Reads one byte at `offset` on this thread.
    fn touch(&self, offset: usize) -> u8 {
        assert!(offset < self.map.len());
        // SAFETY: reading a byte of the live mapping.
        unsafe { self.map.as_ptr().add(offset).read_volatile() }
    }

    /// Reads one byte at `offset` on a new thread; the receiver gets it when the read is done.
    fn touch_in_thread(&self, offset: usize) -> Receiver<u8> {
        assert!(offset < self.map.len());
        let addr = self.map.as_ptr() as usize + offset;
        let (done, rx) = mpsc::channel();
        std::thread::spawn(move || {
            // SAFETY: reading a byte of the live mapping, which outlives the test's waits (a
            // toucher still blocked at the end is woken with zeros when the pager drops).
            let byte = unsafe { (addr as *const u8).read_volatile() };
            let _ = done.send(byte);
        });
        rx
    }

    /// Discards `len` bytes at `offset` (a balloon), as the VMM would.
    fn discard(&self, offset: usize, len: usize) {
        // SAFETY: discarding part of our own mapping.
        let rc = unsafe {
            libc::madvise(
                self.map.as_ptr().add(offset).cast(),
                len,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(rc, 0);
    }

    /// Pages per state by asking for every page's state (a scan through the public API).
    fn scan(&self) -> StateCounts {
        let mut counts = StateCounts::default();
        for page in 0..self.map.len() as u64 / PAGE_SIZE {
            match self.pager.page_state(page * PAGE_SIZE) {
                PageState::Zero => counts.zero += 1,
                PageState::Source => counts.source += 1,
                PageState::Stored => counts.stored += 1,
                PageState::Resident => counts.resident += 1,
                PageState::Dropping => counts.dropping += 1,
                PageState::Pooled => counts.pooled += 1,
            }
        }
        counts
    }

    /// The live counts, checked against a scan.
    fn counts(&self) -> StateCounts {
        let counts = self.pager.state_counts();
        assert_eq!(counts, self.scan());
        counts
    }

    fn reports(&self) -> Vec<u64> {
        self.held_reports.lock().unwrap().clone()
    }

    fn offload(&self, dir: &std::path::Path) {
        let config = OffloadConfig {
            dir: dir.to_path_buf(),
            codec: CodecConfig::new(Codec::Lz4),
            bulk: BulkOptions::with_threads(2),
            durability: compressed_backing::Durability::Host,
            direct_reads: true,
        };
        self.pager.offload(&config).unwrap();
    }

    /// Waits (up to 10 s) until `pages` pages are resident.
    fn wait_resident(&self, pages: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.pager.state_counts().resident < pages {
            assert!(Instant::now() < deadline, "{:?}", self.pager.state_counts());
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Waits for a released toucher; returns how long it took.
fn released(toucher: &Receiver<u8>) -> Duration {
    let started = Instant::now();
    toucher
        .recv_timeout(RELEASED_WITHIN)
        .expect("the held fault was not served after room was made");
    started.elapsed()
}

/// A fresh VM with a limit of four blocks, four blocks touched and a toucher held at the
/// fifth.
fn held_at_the_fifth_block() -> (Vm, Receiver<u8>) {
    let vm = Vm::new(4 * MIB);
    vm.pager
        .set_resident_limit(Some(4 * BLOCK_PAGES * PAGE_SIZE));
    for block in 0..4 {
        assert_eq!(vm.touch(block * BLOCK + 7), 0);
    }
    assert_eq!(vm.counts().resident, 4 * BLOCK_PAGES);
    let toucher = vm.touch_in_thread(4 * BLOCK + 7);
    std::thread::sleep(HELD_FOR);
    assert!(
        toucher.try_recv().is_err(),
        "the touch past the limit was served"
    );
    (vm, toucher)
}

#[test]
fn limit_of_n_pages_lets_n_in_and_holds_the_next_touch() {
    if skip() {
        return;
    }
    let (vm, toucher) = held_at_the_fifth_block();
    assert_eq!(vm.pager.held_faults(), 1);
    assert_eq!(vm.pager.held_bytes(), BLOCK as u64);
    let m = vm.pager.metrics().snapshot();
    assert_eq!((m.faults_held, m.held_now), (1, 1), "{m:?}");
    // Reported once, with the block it needs: the figure did not change while held.
    assert_eq!(vm.reports(), vec![BLOCK as u64]);
    let counts = vm.counts();
    assert_eq!(counts.resident, 4 * BLOCK_PAGES, "{counts:?}");
    // Released before the mapping goes away.
    vm.pager.set_resident_limit(None);
    released(&toucher);
}

#[test]
fn limit_raised_serves_the_held_fault_at_once() {
    if skip() {
        return;
    }
    let (vm, toucher) = held_at_the_fifth_block();
    vm.pager
        .set_resident_limit(Some(5 * BLOCK_PAGES * PAGE_SIZE));
    let took = released(&toucher);
    eprintln!("held fault served {took:?} after the limit was raised");
    assert_eq!(vm.pager.held_faults(), 0);
    assert_eq!(vm.pager.held_bytes(), 0);
    let m = vm.pager.metrics().snapshot();
    assert_eq!((m.faults_held, m.held_now), (1, 0), "{m:?}");
    assert_eq!(vm.counts().resident, 5 * BLOCK_PAGES);
    // The next block is past the raised limit again.
    let next = vm.touch_in_thread(5 * BLOCK);
    std::thread::sleep(HELD_FOR);
    assert!(next.try_recv().is_err());
    assert_eq!(vm.pager.metrics().snapshot().faults_held, 2);
    assert_eq!(vm.reports(), vec![BLOCK as u64, BLOCK as u64]);
    vm.pager.set_resident_limit(None);
    released(&next);
}

#[test]
fn limit_raised_by_one_block_serves_one_of_two_held_faults() {
    if skip() {
        return;
    }
    let config = PagerConfig {
        threads: 2,
        ..PagerConfig::default()
    };
    let vm = Vm::serve(Mapping::anon(4 * MIB), None, config);
    vm.pager
        .set_resident_limit(Some(4 * BLOCK_PAGES * PAGE_SIZE));
    for block in 0..4 {
        vm.touch(block * BLOCK);
    }
    let touchers = [vm.touch_in_thread(4 * BLOCK), vm.touch_in_thread(5 * BLOCK)];
    std::thread::sleep(HELD_FOR);
    assert_eq!(vm.pager.held_faults(), 2);
    assert_eq!(vm.pager.held_bytes(), 2 * BLOCK as u64);
    // The last report asks for both blocks (the first may have come before the second fault).
    assert_eq!(vm.reports().last(), Some(&(2 * BLOCK as u64)));

    vm.pager
        .set_resident_limit(Some(5 * BLOCK_PAGES * PAGE_SIZE));
    let deadline = Instant::now() + RELEASED_WITHIN;
    let first = loop {
        if let Some(i) = touchers.iter().position(|t| t.try_recv().is_ok()) {
            break i;
        }
        assert!(Instant::now() < deadline, "neither held fault was served");
        std::thread::sleep(Duration::from_millis(1));
    };
    let other = &touchers[1 - first];
    std::thread::sleep(HELD_FOR);
    assert!(other.try_recv().is_err(), "both were served past the limit");
    assert_eq!(vm.pager.held_faults(), 1);
    assert_eq!(vm.counts().resident, 5 * BLOCK_PAGES);

    vm.pager
        .set_resident_limit(Some(6 * BLOCK_PAGES * PAGE_SIZE));
    released(other);
    assert_eq!(vm.counts().resident, 6 * BLOCK_PAGES);
    assert_eq!(vm.pager.metrics().snapshot().faults_held, 2);
}

#[test]
fn limit_removed_serves_the_held_fault_and_every_later_one() {
    if skip() {
        return;
    }
    let (vm, toucher) = held_at_the_fifth_block();
    vm.pager.set_resident_limit(None);
    assert_eq!(vm.pager.resident_limit(), None);
    let took = released(&toucher);
    eprintln!("held fault served {took:?} after the limit was removed");
    for block in 5..4 * MIB / BLOCK {
        assert_eq!(vm.touch(block * BLOCK), 0);
    }
    assert_eq!(vm.counts().resident, (4 * MIB) as u64 / PAGE_SIZE);
    assert_eq!(vm.pager.metrics().snapshot().faults_held, 1);
}

#[test]
fn limit_discard_while_held_lowers_the_count_and_lets_the_fault_through() {
    if skip() {
        return;
    }
    let (vm, toucher) = held_at_the_fifth_block();
    vm.discard(0, BLOCK);
    let took = released(&toucher);
    eprintln!("held fault served {took:?} after a discard");
    assert_eq!(vm.pager.resident_limit(), Some(4 * BLOCK_PAGES * PAGE_SIZE));
    assert_eq!(vm.pager.page_state(0), PageState::Zero);
    let counts = vm.counts();
    assert_eq!(counts.resident, 4 * BLOCK_PAGES, "{counts:?}");
    assert!(vm.pager.metrics().snapshot().remove_events >= 1);
}

#[test]
fn limit_without_one_nothing_is_held() {
    if skip() {
        return;
    }
    let vm = Vm::new(4 * MIB);
    assert_eq!(vm.pager.resident_limit(), None);
    for block in 0..4 * MIB / BLOCK {
        assert_eq!(vm.touch(block * BLOCK), 0);
    }
    assert_eq!(vm.counts().resident, (4 * MIB) as u64 / PAGE_SIZE);
    let m = vm.pager.metrics().snapshot();
    assert_eq!((m.faults_held, m.held_now), (0, 0));
    assert!(vm.reports().is_empty());
}

#[test]
fn limit_minor_fault_of_a_page_in_memory_is_never_held() {
    if skip() {
        return;
    }
    let vm = Vm::memfd_without_remove_events(4 * MIB);
    vm.pager
        .set_resident_limit(Some(4 * BLOCK_PAGES * PAGE_SIZE));
    for block in 0..4 {
        assert_eq!(vm.touch(block * BLOCK), 0);
    }
    // The mapping goes, the page cache stays: the pager still counts the block resident.
    vm.discard(0, BLOCK);
    assert_eq!(vm.counts().resident, 4 * BLOCK_PAGES);
    let toucher = vm.touch_in_thread(3 * PAGE_SIZE as usize);
    released(&toucher);
    let m = vm.pager.metrics().snapshot();
    assert!(m.faults_minor >= 1, "{m:?}");
    assert_eq!(m.faults_held, 0, "{m:?}");
    // A page not in memory is still held.
    let past = vm.touch_in_thread(4 * BLOCK);
    std::thread::sleep(HELD_FOR);
    assert!(past.try_recv().is_err());
    assert_eq!(vm.pager.held_faults(), 1);
    vm.pager.set_resident_limit(None);
    released(&past);
}

/// A VM of 8 MiB written and offloaded, then lazily loaded under a 1 MiB limit: the prefetcher
/// fills the limit and waits.
fn lazy_load_at_a_limit(dir: &std::path::Path) -> (Vm, u64) {
    let mut vm = Vm::new(8 * MIB);
    for (i, b) in vm.bytes_mut().iter_mut().enumerate() {
        *b = (i / 4093) as u8 ^ (i % 251) as u8;
    }
    let digest = vm.digest();
    vm.offload(dir);
    assert_eq!(vm.counts().resident, 0);
    let limit_pages = MIB as u64 / PAGE_SIZE;
    vm.pager.set_resident_limit(Some(MIB as u64));
    vm.pager.load(LoadMode::Lazy, 1).unwrap();
    vm.wait_resident(limit_pages);
    std::thread::sleep(HELD_FOR);
    let counts = vm.counts();
    assert_eq!(counts.resident, limit_pages, "{counts:?}");
    assert_eq!(counts.stored, (8 * MIB) as u64 / PAGE_SIZE - limit_pages);
    (vm, digest)
}

#[test]
fn limit_holds_a_lazy_load_and_its_faults_until_removed() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (vm, digest) = lazy_load_at_a_limit(dir.path());
    // A fault on a stored page is held too.
    let last = 8 * MIB - BLOCK;
    assert_eq!(vm.pager.page_state(last as u64), PageState::Stored);
    let toucher = vm.touch_in_thread(last + 3);
    std::thread::sleep(HELD_FOR);
    assert!(
        toucher.try_recv().is_err(),
        "the fault past the limit was served"
    );
    assert_eq!(vm.pager.held_faults(), 1);
    assert_eq!(vm.reports(), vec![BLOCK as u64]);
    assert_eq!(vm.counts().resident, MIB as u64 / PAGE_SIZE);

    vm.pager.set_resident_limit(None);
    let took = released(&toucher);
    eprintln!("held fault of a lazy load served {took:?} after the limit was removed");
    vm.pager.wait_prefetch();
    assert_eq!(vm.digest(), digest);
    let counts = vm.counts();
    assert_eq!(counts.resident, (8 * MIB) as u64 / PAGE_SIZE, "{counts:?}");
    assert_eq!(vm.pager.metrics().snapshot().fault_errors, 0);
}

#[test]
fn limit_held_prefetch_stops_promptly() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (vm, _) = lazy_load_at_a_limit(dir.path());
    let started = Instant::now();
    vm.pager.stop_prefetch();
    let took = started.elapsed();
    eprintln!("a prefetch waiting for room stopped in {took:?}");
    assert!(took < RELEASED_WITHIN, "{took:?}");
    let started = Instant::now();
    drop(vm);
    assert!(started.elapsed() < RELEASED_WITHIN);
}

#[test]
fn limit_holds_an_eager_load_until_raised() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = Vm::new(8 * MIB);
    vm.bytes_mut().fill(0x5A);
    let digest = vm.digest();
    vm.offload(dir.path());
    vm.pager.set_resident_limit(Some(2 * MIB as u64));
    let (held, reports) = std::thread::scope(|scope| {
        let load = scope.spawn(|| vm.pager.load(LoadMode::Eager, 2).unwrap());
        vm.wait_resident((2 * MIB) as u64 / PAGE_SIZE);
        std::thread::sleep(HELD_FOR);
        assert!(!load.is_finished(), "the eager load crossed the limit");
        assert_eq!(vm.counts().resident, (2 * MIB) as u64 / PAGE_SIZE);
        // Read while it waits, checked once it is let go (a failed check in here would wait
        // for the load for ever).
        let (held, reports) = (vm.pager.held_bytes(), vm.reports());
        vm.pager.set_resident_limit(Some(8 * MIB as u64));
        let report = load.join().unwrap();
        assert_eq!(report.pages_installed, (8 * MIB) as u64 / PAGE_SIZE);
        (held, reports)
    });
    // With no fault to ask for it (the vCPUs are stopped), the load asked for the room it
    // still needed itself: the 6 MiB left, as a held fault would have.
    assert_eq!(held, 6 * MIB as u64);
    assert_eq!(reports.last(), Some(&(6 * MIB as u64)), "{reports:?}");
    assert_eq!(vm.digest(), digest);
    assert_eq!(vm.counts().resident, (8 * MIB) as u64 / PAGE_SIZE);
    assert_eq!(
        vm.pager.held_bytes(),
        0,
        "nothing stays held once it is done"
    );
}

#[test]
fn limit_eager_load_asks_a_governor_for_its_room_and_finishes() {
    if skip() {
        return;
    }
    // A governor that grants what is asked: the load goes through without anyone raising
    // the limit by hand (before, it waited for ever).
    let dir = tempfile::tempdir().unwrap();
    let mut vm = Vm::new(8 * MIB);
    vm.bytes_mut().fill(0x3C);
    let digest = vm.digest();
    vm.offload(dir.path());
    let handle = vm.pager.resident_handle();
    let granter = handle.clone();
    vm.pager.on_held(Box::new(move |shortfall| {
        let limit = granter.resident_bytes() + granter.held_bytes().max(shortfall);
        let raise = granter.clone();
        // Not on the calling thread: the callback must return quickly.
        std::thread::spawn(move || raise.set_resident_limit(Some(limit)));
    }));
    handle.set_resident_limit(Some(MIB as u64));
    let (done, finished) = mpsc::channel();
    let report = std::thread::scope(|scope| {
        scope.spawn(|| {
            let report = vm.pager.load(LoadMode::Eager, 2).unwrap();
            done.send(report).unwrap();
        });
        let report = finished.recv_timeout(Duration::from_secs(20));
        if report.is_err() {
            // Let the load end, so that the test fails rather than hangs.
            handle.set_resident_limit(None);
        }
        report
    });
    let report = report.expect("the eager load waited for room nobody was asked for");
    assert_eq!(report.pages_installed, (8 * MIB) as u64 / PAGE_SIZE);
    assert_eq!(vm.digest(), digest);
    assert_eq!(vm.pager.held_bytes(), 0);
}

/// CPU time (ns) of every fault thread of this process, by thread id.
fn fault_threads_cpu() -> std::collections::HashMap<String, u64> {
    let mut cpu = std::collections::HashMap::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let dir = task.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with("uffd-fault") {
            continue;
        }
        // schedstat: time on CPU (ns), time waiting, slices.
        if let Ok(stat) = std::fs::read_to_string(dir.join("schedstat")) {
            let ns = stat.split_whitespace().next().unwrap().parse().unwrap();
            cpu.insert(task.file_name().to_string_lossy().into_owned(), ns);
        }
    }
    cpu
}

#[test]
fn limit_held_fault_keeps_its_thread_polling_not_spinning() {
    if skip() {
        return;
    }
    let (vm, toucher) = held_at_the_fifth_block();
    let window = Duration::from_millis(500);
    let before = fault_threads_cpu();
    std::thread::sleep(window);
    let after = fault_threads_cpu();
    // Every fault thread of the process (other tests' too, which serve few faults): a spinning
    // thread would use the whole window.
    let used: u64 = after
        .iter()
        .filter_map(|(tid, ns)| before.get(tid).map(|b| ns - b))
        .sum();
    eprintln!(
        "fault threads used {:.2} ms of CPU in {window:?} with one fault held",
        used as f64 / 1e6
    );
    assert!(Duration::from_nanos(used) < window / 10, "{used} ns");
    assert!(toucher.try_recv().is_err());
    vm.pager.set_resident_limit(None);
    released(&toucher);
}
