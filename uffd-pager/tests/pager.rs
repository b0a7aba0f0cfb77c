//! The pager on the real device with host threads touching registered memory (no KVM):
//! page-state transitions, offload and lazy/eager load with equal digests, REMOVE events,
//! concurrent faults, a failing offload, memfd RAM, the recorded working set.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use compressed_backing::bulk::BulkOptions;
use compressed_backing::{Codec, CodecConfig};
use testkit::Mapping;
use uffd_pager::addr::{HostAddr, HostRange, PAGE_SIZE};
use uffd_pager::cold::{Cold, ColdConfig};
use uffd_pager::load::LoadMode;
use uffd_pager::offload::{Batching, OffloadConfig, OffloadError};
use uffd_pager::pager::{Pager, PagerConfig, RamKind, RegionSpec};
use uffd_pager::source::RawFileSource;
use uffd_pager::state::PageState;

const MIB: usize = 1 << 20;

fn skip() -> bool {
    testkit::skip_unless(&["/dev/userfaultfd"])
}

/// Guest RAM for a test: an anonymous or memfd mapping, of base or huge pages, unmapped on
/// drop (after the pager).
struct Ram {
    map: Mapping,
    memfd: Option<Arc<File>>,
    kind: RamKind,
}

impl Ram {
    fn anon(len: usize) -> Self {
        Self {
            map: Mapping::anon(len),
            memfd: None,
            kind: RamKind::Anon,
        }
    }

    /// Private anonymous 2 MiB huge pages, taken from the pool as they are touched.
    fn hugetlb(len: usize) -> Self {
        let flags = libc::MAP_PRIVATE
            | libc::MAP_ANONYMOUS
            | libc::MAP_NORESERVE
            | libc::MAP_HUGETLB
            | libc::MAP_HUGE_2MB;
        Self {
            map: Mapping::new(len, libc::PROT_READ | libc::PROT_WRITE, flags, None).unwrap(),
            memfd: None,
            kind: RamKind::Hugetlb,
        }
    }

    fn memfd(len: usize) -> Self {
        Self::shared(len, 0, RamKind::Memfd)
    }

    /// A shared memfd of 2 MiB huge pages.
    fn hugetlb_memfd(len: usize) -> Self {
        Self::shared(
            len,
            libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
            RamKind::HugetlbMemfd,
        )
    }

    fn shared(len: usize, flags: libc::c_uint, kind: RamKind) -> Self {
        // SAFETY: creating and sizing our own memfd, mapping it shared, all checked; the
        // mapping is handed to `Mapping`, which alone unmaps it.
        unsafe {
            let fd = libc::memfd_create(c"guest-ram".as_ptr(), libc::MFD_CLOEXEC | flags);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, libc::off_t::try_from(len).unwrap()), 0);
            let ptr = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                fd,
                0,
            );
            assert_ne!(ptr, libc::MAP_FAILED);
            Self {
                map: Mapping::from_raw(ptr.cast(), len),
                memfd: Some(Arc::new(File::from_raw_fd(fd))),
                kind,
            }
        }
    }

    fn spec(&self) -> RegionSpec {
        RegionSpec {
            kind: self.kind,
            range: HostRange::new(HostAddr::from_ptr(self.map.as_ptr()), self.map.len() as u64)
                .unwrap(),
            image_offset: 0,
            memfd: self.memfd.clone(),
            memfd_offset: 0,
            view: Some(HostAddr::from_ptr(self.map.as_ptr())),
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is live and `len` long.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr(), self.map.len()) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is live and `len` long, and borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr(), self.map.len()) }
    }

    fn digest(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(self.bytes())
    }

    /// Bytes of this mapping resident in memory (mincore).
    fn resident(&self) -> usize {
        let mut vec = vec![0u8; self.map.len() / PAGE_SIZE as usize];
        // SAFETY: `vec` has one byte per page of the mapping.
        let rc =
            unsafe { libc::mincore(self.map.as_ptr().cast(), self.map.len(), vec.as_mut_ptr()) };
        assert_eq!(rc, 0);
        vec.iter().filter(|&&b| b & 1 == 1).count() * PAGE_SIZE as usize
    }
}

fn pager(ram: &Ram, config: PagerConfig) -> Pager {
    // SAFETY: `ram` outlives the pager in every test (declared before it, dropped after).
    unsafe {
        Pager::new(
            vec![ram.spec()],
            config,
            None,
            Box::new(|e| panic!("fault error: {e}")),
        )
        .unwrap()
    }
}

/// A pager that is told of discards by its caller, not by `REMOVE` events (what cold
/// compression needs, as in the VMM).
fn pager_without_remove_events(ram: &Ram) -> Pager {
    pager(
        ram,
        PagerConfig {
            remove_events: false,
            ..PagerConfig::default()
        },
    )
}

/// Fills `bytes` with a pattern: random-looking in the first half of each MiB, repeated in
/// the rest, some untouched zero pages.
fn fill(bytes: &mut [u8], seed: u64) {
    let mut state = seed | 1;
    for (i, chunk) in bytes.chunks_mut(PAGE_SIZE as usize).enumerate() {
        if i % 16 == 15 {
            continue;
        }
        for (j, b) in chunk.iter_mut().enumerate() {
            *b = if (i * PAGE_SIZE as usize) % MIB < MIB / 2 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            } else {
                (j % 97) as u8 ^ seed as u8
            };
        }
    }
}

/// Cold compression with `cold_age`, scanning every 20 ms with all the CPU it wants, its
/// pool as large as RAM.
fn fast_cold(cold_age: Duration) -> ColdConfig {
    ColdConfig {
        cold_age,
        scan_period: Duration::from_millis(20),
        cpu_budget: 1.0,
        idle_cpu_budget: 1.0,
        pool_cap_share: 1.0,
        ..ColdConfig::default()
    }
}

fn offload_config(dir: &std::path::Path, codec: Codec) -> OffloadConfig {
    OffloadConfig {
        dir: dir.to_path_buf(),
        codec: CodecConfig::new(codec),
        bulk: BulkOptions::with_threads(2),
        durability: compressed_backing::Durability::Host,
        direct_reads: true,
    }
}

#[test]
fn pager_fresh_memory_reads_as_zero_pages() {
    if skip() {
        return;
    }
    let ram = Ram::anon(4 * MIB);
    let pager = pager(&ram, PagerConfig::default());
    assert!(ram.bytes().iter().all(|&b| b == 0));
    let counts = pager.state_counts();
    assert_eq!(counts.resident, (4 * MIB) as u64 / PAGE_SIZE);
    let m = pager.metrics().snapshot();
    // One zero-page fault per 64 KiB block, not per page.
    assert_eq!(m.faults_zero, 64, "{m:?}");
    assert_eq!(m.zero_pages, 1024);
    assert_eq!(m.faults_copy, 0);
}

#[test]
fn pager_offload_then_lazy_and_eager_load_keep_every_byte() {
    if skip() {
        return;
    }
    for (codec, mode) in [
        (Codec::None, LoadMode::Lazy),
        (Codec::Lz4, LoadMode::Eager),
        (Codec::Zstd { level: 1 }, LoadMode::Lazy),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut ram = Ram::anon(16 * MIB);
        let pager = pager(&ram, PagerConfig::default());
        fill(ram.bytes_mut(), 7);
        let digest = ram.digest();
        let resident_before = ram.resident();
        assert_eq!(resident_before, 16 * MIB);

        let report = pager.offload(&offload_config(dir.path(), codec)).unwrap();
        assert_eq!(report.pages_dropped, (16 * MIB) as u64 / PAGE_SIZE);
        assert_eq!(
            ram.resident(),
            0,
            "{codec}: pages still resident after offload"
        );
        let counts = pager.state_counts();
        assert_eq!(counts.stored, (16 * MIB) as u64 / PAGE_SIZE, "{counts:?}");
        if codec != Codec::None {
            assert!(report.stored_bytes < 12 * MIB as u64, "{codec}: {report:?}");
        }

        let load = pager.load(mode, 2).unwrap();
        assert_eq!(load.blocks, 256);
        if mode == LoadMode::Lazy {
            // Touch a few pages while the prefetcher runs.
            assert_eq!(ram.bytes()[3 * MIB + 5], {
                let mut probe = vec![0u8; 16 * MIB];
                fill(&mut probe, 7);
                probe[3 * MIB + 5]
            });
            pager.wait_prefetch();
        } else {
            assert_eq!(load.pages_installed, (16 * MIB) as u64 / PAGE_SIZE);
            assert_eq!(pager.state_counts().resident, (16 * MIB) as u64 / PAGE_SIZE);
        }
        assert_eq!(ram.digest(), digest, "{codec} {mode:?}");
        let m = pager.metrics().snapshot();
        assert_eq!(m.fault_errors, 0);
        if codec != Codec::None {
            assert!(m.bytes_decompressed > 0, "{m:?}");
        }
    }
}

#[test]
fn pager_wait_offload_syncs_nothing_leaves_no_page_cache_and_reads_back() {
    use compressed_backing::Durability;
    if skip() {
        return;
    }
    for durability in [Durability::Process, Durability::Host] {
        let dir = tempfile::tempdir().unwrap();
        let mut ram = Ram::anon(32 * MIB);
        let pager = pager(&ram, PagerConfig::default());
        fill(ram.bytes_mut(), 11);
        let digest = ram.digest();
        let config = OffloadConfig {
            durability,
            ..offload_config(dir.path(), Codec::None)
        };
        let report = pager.offload(&config).unwrap();
        assert_eq!(report.pages_dropped, (32 * MIB) as u64 / PAGE_SIZE);
        assert!(report.batches >= 4, "{report:?}");
        match durability {
            // A VM's own store: no sync at all.
            Durability::Process => assert_eq!(report.syncs, 0, "{report:?}"),
            // A store that must survive the host: segment, index and directory per batch.
            Durability::Host => assert!(report.syncs >= 3 * report.batches, "{report:?}"),
        }
        // Written back and gone from the page cache all the same: 32 MiB of data, and at
        // most the index's few pages left cached.
        let cached = testkit::page_cache::cached_bytes(dir.path());
        assert!(cached <= 64 << 10, "{durability:?}: {cached} bytes cached");
        // Read back from the disk, every byte.
        pager.load(LoadMode::Eager, 2).unwrap();
        assert_eq!(ram.digest(), digest, "{durability:?}");
        assert_eq!(pager.metrics().snapshot().fault_errors, 0);
    }
}

#[test]
fn pager_range_offload_stores_the_whole_blocks_inside_the_range_and_nothing_else() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut ram = Ram::anon(8 * MIB);
    let pager = pager(&ram, PagerConfig::default());
    fill(ram.bytes_mut(), 11);
    let expect = ram.bytes().to_vec();
    let base = HostAddr::from_ptr(ram.map.as_ptr());
    let block = pager.block_size().bytes_u64();
    // Neither end on a block boundary: only the blocks wholly inside go.
    let (start, end) = (2 * MIB as u64 + 100 * 1024, 6 * MIB as u64 - PAGE_SIZE);
    let range = HostRange::new(HostAddr(base.0 + start), end - start).unwrap();
    let config = offload_config(dir.path(), Codec::Lz4);
    let report = pager.offload_range(&config, range).unwrap();
    let (first, last) = (start.div_ceil(block) * block, end / block * block);
    let inside = pager.counts_in(first, last - first);
    assert_eq!(inside.resident, 0, "{inside:?}");
    assert_eq!(
        inside.stored + inside.zero,
        (last - first) / PAGE_SIZE,
        "{inside:?}"
    );
    assert_eq!(report.pages_dropped, inside.stored);
    // The rest, the partial blocks at both ends included, is as it was.
    for (at, len) in [(0, first), (last, 8 * MIB as u64 - last)] {
        let outside = pager.counts_in(at, len);
        assert_eq!(outside.stored, 0, "{at:#x}: {outside:?}");
    }
    // Again, with nothing resident in it: nothing written.
    let again = pager.offload_range(&config, range).unwrap();
    assert_eq!((again.blocks_written, again.batches), (0, 0));
    // Every byte comes back on faults.
    assert!(ram.bytes() == &expect[..]);
}

#[test]
fn pager_second_offload_keeps_pages_that_were_never_loaded() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut ram = Ram::anon(8 * MIB);
    let pager = pager(&ram, PagerConfig::default());
    fill(ram.bytes_mut(), 3);
    let mut expect = ram.bytes().to_vec();
    pager
        .offload(&offload_config(dir.path(), Codec::Lz4))
        .unwrap();
    // Fault back and change one page in the middle of a block; leave the rest stored.
    let at = 2 * MIB + 3 * PAGE_SIZE as usize;
    ram.bytes_mut()[at] ^= 0xFF;
    expect[at] ^= 0xFF;
    let counts = pager.state_counts();
    assert!(counts.stored > 0 && counts.resident > 0, "{counts:?}");
    pager
        .offload(&offload_config(dir.path(), Codec::Lz4))
        .unwrap();
    assert_eq!(ram.resident(), 0);
    pager.load(LoadMode::Eager, 2).unwrap();
    assert!(ram.bytes() == &expect[..]);
}

#[test]
fn pager_faults_only_load_brings_back_what_is_touched_and_the_next_offload_writes_only_that() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut ram = Ram::anon(8 * MIB);
    let pager = pager(&ram, PagerConfig::default());
    fill(ram.bytes_mut(), 5);
    let mut expect = ram.bytes().to_vec();
    let first = pager
        .offload(&offload_config(dir.path(), Codec::None))
        .unwrap();
    assert_eq!(first.blocks_written, 128);
    let load = pager.load(LoadMode::Faults, 2).unwrap();
    assert_eq!(load.pages_installed, 0);
    // Nothing comes back on its own.
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(ram.resident(), 0);
    // One block read, one written: only those return.
    assert_eq!(ram.bytes()[MIB + 17], expect[MIB + 17]);
    ram.bytes_mut()[5 * MIB + 9] ^= 0x5A;
    expect[5 * MIB + 9] ^= 0x5A;
    let counts = pager.state_counts();
    assert_eq!(counts.resident, 2 * 16, "{counts:?}");
    assert_eq!(ram.resident(), 2 * 64 * 1024);
    // The next offload writes the written block, only drops the one read (the store holds
    // it as it is), and keeps the rest where it is.
    let second = pager
        .offload(&offload_config(dir.path(), Codec::None))
        .unwrap();
    assert_eq!(second.blocks_written, 1, "{second:?}");
    assert_eq!(second.blocks_clean, 1, "{second:?}");
    assert_eq!(second.pages_dropped, 2 * 16, "{second:?}");
    assert_eq!(ram.resident(), 0);
    pager.load(LoadMode::Eager, 2).unwrap();
    assert!(ram.bytes() == &expect[..]);
    assert_eq!(pager.metrics().snapshot().fault_errors, 0);
}

#[test]
fn pager_offload_after_a_read_only_resume_writes_nothing_and_every_byte_comes_back() {
    if skip() {
        return;
    }
    for codec in [Codec::None, Codec::Lz4] {
        let dir = tempfile::tempdir().unwrap();
        let mut ram = Ram::anon(8 * MIB);
        let pager = pager(&ram, PagerConfig::default());
        fill(ram.bytes_mut(), 21);
        let mut expect = ram.bytes().to_vec();
        let config = offload_config(dir.path(), codec);
        let first = pager.offload(&config).unwrap();
        assert_eq!((first.blocks_written, first.blocks_clean), (128, 0));
        // Read back whole (a command that reads its working set): all clean.
        pager.load(LoadMode::Eager, 2).unwrap();
        assert!(ram.bytes() == &expect[..]);
        let again = pager.offload(&config).unwrap();
        assert_eq!(
            (again.blocks_written, again.blocks_clean),
            (0, 128),
            "{again:?}"
        );
        assert_eq!(again.pages_dropped, first.pages_dropped, "{again:?}");
        assert_eq!(again.stored_bytes, 0, "{again:?}");
        let counted = pager.metrics().snapshot();
        assert_eq!(counted.pages_clean, again.pages_dropped);
        assert_eq!(counted.pages_offloaded, first.pages_dropped);
        assert_eq!(ram.resident(), 0);
        // Back lazily; one byte changed in each of three blocks, one block's page zeroed
        // back to what a never-touched page reads as: only those four are written.
        for at in [0, 3 * MIB + 5, 7 * MIB + 4095] {
            ram.bytes_mut()[at] ^= 0xA5;
            expect[at] ^= 0xA5;
        }
        let zeroed = 2 * MIB..2 * MIB + PAGE_SIZE as usize;
        ram.bytes_mut()[zeroed.clone()].fill(0);
        expect[zeroed].fill(0);
        assert!(ram.bytes() == &expect[..]);
        let third = pager.offload(&config).unwrap();
        assert_eq!(
            (third.blocks_written, third.blocks_clean),
            (4, 124),
            "{third:?}"
        );
        pager.load(LoadMode::Eager, 2).unwrap();
        assert!(ram.bytes() == &expect[..], "{codec:?}");
        // And the blocks just written are clean the next time.
        let fourth = pager.offload(&config).unwrap();
        assert_eq!(
            (fourth.blocks_written, fourth.blocks_clean),
            (0, 128),
            "{fourth:?}"
        );
        pager.load(LoadMode::Faults, 2).unwrap();
        assert!(ram.bytes() == &expect[..], "{codec:?}");
        assert_eq!(pager.metrics().snapshot().fault_errors, 0);
    }
}

#[test]
fn pager_warm_installs_the_recorded_working_set_alone_and_a_faults_load_lets_it_finish() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut ram = Ram::anon(8 * MIB);
    let pager = pager(&ram, PagerConfig::default());
    fill(ram.bytes_mut(), 7);
    let mut expect = ram.bytes().to_vec();
    pager
        .offload(&offload_config(dir.path(), Codec::Lz4))
        .unwrap();
    // Nothing faulted since the start: there is no working set to warm.
    let none = pager.warm(2).unwrap();
    assert_eq!((none.blocks, none.working_set_blocks), (128, 0));
    pager.wait_prefetch();
    assert_eq!(ram.resident(), 0);
    pager.load(LoadMode::Faults, 2).unwrap();
    // A tool step touches three blocks (reads two, writes one): its working set.
    assert_eq!(ram.bytes()[5 * MIB + 1], expect[5 * MIB + 1]);
    assert_eq!(ram.bytes()[MIB + 2], expect[MIB + 2]);
    ram.bytes_mut()[3 * MIB + 3] ^= 0x33;
    expect[3 * MIB + 3] ^= 0x33;
    pager
        .offload(&offload_config(dir.path(), Codec::Lz4))
        .unwrap();
    assert_eq!(ram.resident(), 0);
    // The answer arrives: the three blocks come back, nothing else, with no fault.
    let faults = pager.metrics().snapshot().fault_events;
    let warm = pager.warm(2).unwrap();
    assert_eq!((warm.blocks, warm.working_set_blocks), (128, 3), "{warm:?}");
    let load = pager.load(LoadMode::Faults, 2).unwrap();
    assert_eq!(load.pages_installed, 0);
    pager.wait_prefetch();
    assert_eq!(ram.resident(), 3 * 64 * 1024);
    assert_eq!(pager.state_counts().resident, 3 * 16);
    for at in [5 * MIB + 1, MIB + 2, 3 * MIB + 3] {
        assert_eq!(ram.bytes()[at], expect[at], "{at:#x}");
    }
    assert_eq!(pager.metrics().snapshot().fault_events, faults);
    // The set stays recorded (the warm-up's blocks raised no fault): the next offload
    // carries it again, and everything else still comes back right.
    pager
        .offload(&offload_config(dir.path(), Codec::Lz4))
        .unwrap();
    assert_eq!(pager.warm(2).unwrap().working_set_blocks, 3);
    pager.load(LoadMode::Faults, 2).unwrap();
    assert!(ram.bytes() == &expect[..]);
    assert_eq!(pager.metrics().snapshot().fault_errors, 0);
}

#[test]
fn pager_discarded_range_reads_back_as_zeros() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut ram = Ram::anon(4 * MIB);
    let pager = pager(&ram, PagerConfig::default());
    fill(ram.bytes_mut(), 9);
    // A resident range discarded by the VMM (a balloon) reads as zeros.
    // SAFETY: discarding part of our own mapping.
    let value =
        unsafe { libc::madvise(ram.map.as_ptr().add(MIB).cast(), MIB, libc::MADV_DONTNEED) };
    assert_eq!(value, 0);
    assert!(ram.bytes()[MIB..2 * MIB].iter().all(|&b| b == 0));
    // Offloaded, then discarded before loading: zeros too, never the stored bytes.
    pager
        .offload(&offload_config(dir.path(), Codec::Lz4))
        .unwrap();
    // SAFETY: as above.
    let value = unsafe {
        libc::madvise(
            ram.map.as_ptr().add(3 * MIB).cast(),
            MIB,
            libc::MADV_DONTNEED,
        )
    };
    assert_eq!(value, 0);
    assert_eq!(pager.page_state(3 * MIB as u64), PageState::Zero);
    pager.load(LoadMode::Eager, 1).unwrap();
    assert!(ram.bytes()[3 * MIB..].iter().all(|&b| b == 0));
    let mut expect = vec![0u8; 4 * MIB];
    fill(&mut expect, 9);
    assert!(ram.bytes()[..MIB] == expect[..MIB]);
    assert!(ram.bytes()[2 * MIB..3 * MIB] == expect[2 * MIB..3 * MIB]);
    assert!(pager.metrics().snapshot().remove_events >= 2);
}

#[test]
fn pager_concurrent_faults_from_eight_threads_get_the_right_bytes() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut ram = Ram::anon(32 * MIB);
    let pager = pager(
        &ram,
        PagerConfig {
            threads: 2,
            ..PagerConfig::default()
        },
    );
    fill(ram.bytes_mut(), 11);
    let expect = ram.bytes().to_vec();
    pager
        .offload(&offload_config(dir.path(), Codec::Lz4))
        .unwrap();
    pager.load(LoadMode::Lazy, 1).unwrap();
    std::thread::scope(|s| {
        for t in 0..8 {
            let (ram, expect) = (&ram, &expect);
            s.spawn(move || {
                // Interleaved pages, so threads race on the same blocks.
                for page in (t..ram.map.len() / PAGE_SIZE as usize).step_by(8) {
                    let at = page * PAGE_SIZE as usize + (page % 4000);
                    // SAFETY: reading a byte of the live mapping.
                    let got = unsafe { ram.map.as_ptr().add(at).read_volatile() };
                    assert_eq!(got, expect[at], "page {page}");
                }
            });
        }
    });
    pager.wait_prefetch();
    assert!(ram.bytes() == &expect[..]);
    assert_eq!(pager.metrics().snapshot().fault_errors, 0);
}

#[test]
fn pager_offload_that_fails_half_way_leaves_memory_intact() {
    if skip() {
        return;
    }
    // 16 MiB of raw blocks in batches of 4 MiB onto a 10 MiB disk: two batches fit.
    let small = testkit::Tmpfs::mount("10m");
    let mut ram = Ram::anon(16 * MIB);
    let pager = pager(&ram, PagerConfig::default());
    fill(ram.bytes_mut(), 13);
    let expect = ram.bytes().to_vec();
    let pages = (16 * MIB) as u64 / PAGE_SIZE;
    let written: Vec<bool> = (0..pages)
        .map(|p| pager.page_state(p * PAGE_SIZE) == PageState::Resident)
        .collect();
    let err = pager
        .offload_with(
            &offload_config(&small.path().join("store"), Codec::None),
            Batching::of(4 * MIB as u64),
        )
        .unwrap_err();
    assert!(
        matches!(err, OffloadError::Store { ref source, .. } if source.is_no_space()),
        "{err}"
    );
    assert_eq!(err.batches(), 2, "{err}");
    // Pages of the two committed batches (the first 8 MiB) are stored, the rest resident.
    let committed = (8 * MIB) as u64 / PAGE_SIZE;
    for page in 0..pages {
        let state = pager.page_state(page * PAGE_SIZE);
        let want = match (written[page as usize], page < committed) {
            (false, _) => PageState::Zero,
            (true, true) => PageState::Stored,
            (true, false) => PageState::Resident,
        };
        assert_eq!(state, want, "page {page}");
    }
    let resident_pages = written[committed as usize..].iter().filter(|&&w| w).count();
    assert_eq!(ram.resident(), resident_pages * PAGE_SIZE as usize);
    // What it dropped before failing is counted: written, none clean.
    let counted = pager.metrics().snapshot();
    let dropped = written[..committed as usize].iter().filter(|&&w| w).count() as u64;
    assert_eq!(
        (
            counted.pages_offloaded,
            counted.pages_dropped,
            counted.pages_clean
        ),
        (dropped, dropped, 0)
    );
    // Every byte is there: the stored pages are served from the store on fault.
    let copies = pager.metrics().snapshot().pages_copied;
    for (page, want) in expect.chunks(PAGE_SIZE as usize).enumerate() {
        let at = page * PAGE_SIZE as usize;
        assert!(ram.bytes()[at..at + want.len()] == *want, "page {page}");
    }
    let stored = written[..committed as usize].iter().filter(|&&w| w).count() as u64;
    assert!(pager.metrics().snapshot().pages_copied - copies >= stored);
    assert_eq!(pager.metrics().snapshot().fault_errors, 0);
    assert_eq!(pager.state_counts().stored, 0);
    // A later offload to a disk with room works.
    let dir = tempfile::tempdir().unwrap();
    drop(small);
    let mut ram2 = Ram::anon(MIB);
    let pager2 = self::pager(&ram2, PagerConfig::default());
    fill(ram2.bytes_mut(), 1);
    pager2
        .offload(&offload_config(dir.path(), Codec::Lz4))
        .unwrap();
}

#[test]
fn pager_offload_of_pooled_blocks_that_fails_half_way_keeps_the_committed_ones_stored() {
    if skip() {
        return;
    }
    // 8 MiB that lz4 halves, all in the cold pool, passed through in batches of 1 MiB of
    // image (about 512 KiB stored each) onto a 2 MiB disk: a few batches fit, not all.
    let small = testkit::Tmpfs::mount("2m");
    let mut ram = Ram::memfd(8 * MIB);
    let pager = pager_without_remove_events(&ram);
    let mut state = 7u64;
    for page in ram.bytes_mut().chunks_mut(PAGE_SIZE as usize) {
        for b in &mut page[..PAGE_SIZE as usize / 2] {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *b = state as u8;
        }
    }
    let expect = ram.bytes().to_vec();
    let cold = Cold::start(&pager, fast_cold(Duration::from_millis(50))).unwrap();
    cold.set_idle(true);
    let pages = (8 * MIB) as u64 / PAGE_SIZE;
    let deadline = Instant::now() + Duration::from_secs(20);
    while pager.state_counts().pooled < pages {
        assert!(Instant::now() < deadline, "{:?}", pager.state_counts());
        std::thread::sleep(Duration::from_millis(20));
    }
    let err = pager
        .offload_with(
            &offload_config(&small.path().join("store"), Codec::Lz4),
            Batching::of(MIB as u64),
        )
        .unwrap_err();
    assert!(
        matches!(err, OffloadError::Store { ref source, .. } if source.is_no_space()),
        "{err}"
    );
    let batches = err.batches();
    assert!((1..8).contains(&batches), "{err}");
    // The committed batches' blocks are stored and out of the pool, the rest pooled.
    let committed = batches * MIB as u64 / PAGE_SIZE;
    for page in 0..pages {
        let want = if page < committed {
            PageState::Stored
        } else {
            PageState::Pooled
        };
        assert_eq!(pager.page_state(page * PAGE_SIZE), want, "page {page}");
    }
    let blocks_left = (pages - committed) / 16;
    assert_eq!(cold.stats().pool.blocks, blocks_left);
    // Every byte is there, from the store or from the pool.
    for (page, want) in expect.chunks(PAGE_SIZE as usize).enumerate() {
        let at = page * PAGE_SIZE as usize;
        assert!(ram.bytes()[at..at + want.len()] == *want, "page {page}");
    }
    assert_eq!(pager.metrics().snapshot().fault_errors, 0);
}

#[test]
fn pager_cold_compression_order_takes_ram_cold_for_its_shorter_age_then_lapses() {
    if skip() {
        return;
    }
    // A memory governor's order to a running VM: its cold compression, with a cold age of a
    // minute, compresses what has been cold for 50 ms, for a while, then goes back to its own.
    let mut ram = Ram::memfd(8 * MIB);
    let pager = pager_without_remove_events(&ram);
    fill(ram.bytes_mut(), 5);
    let expect = ram.bytes().to_vec();
    let cold = Cold::start(&pager, fast_cold(Duration::from_secs(60))).unwrap();
    // Cold compression runs above the pager: a second one is refused.
    assert!(Cold::start(&pager, fast_cold(Duration::from_secs(60))).is_err());
    let orders = cold.orders();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        pager.state_counts().pooled,
        0,
        "compressed before its cold age"
    );
    orders.compress(Duration::from_millis(50));
    assert!(orders.pending());
    // Over well inside the governor's order timeout (10 s by default).
    let ordered = Instant::now();
    while orders.pending() {
        assert!(
            ordered.elapsed() < Duration::from_secs(5),
            "the order is not over"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Once it is over, its compression is done: the repeated half of the 8 MiB (the rest
    // does not compress) is mostly in the pool.
    let pooled = pager.state_counts().pooled;
    assert!(
        pooled * PAGE_SIZE >= 3 * MIB as u64,
        "{:?}",
        pager.state_counts()
    );
    // Every byte reads back, the pooled ones from the pool; then the order has lapsed and
    // the minute's cold age holds again: nothing more is compressed.
    assert!(ram.bytes() == &expect[..], "the bytes read back differ");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        pager.state_counts().pooled,
        0,
        "compressed after the order lapsed"
    );
    assert!(pooled > 0);
    assert_eq!(pager.metrics().snapshot().fault_errors, 0);
}

#[test]
fn pager_cold_compression_counts_an_install_after_a_discard_as_an_access() {
    if skip() {
        return;
    }
    // A block that cold compression has probed, then the guest frees and writes again, is in
    // use from its new install on: a compression timed from the old probe would read it while
    // the guest writes it (the install maps it, so those writes fault nowhere) and lose them.
    let mut ram = Ram::memfd(4 * MIB);
    let pager = pager_without_remove_events(&ram);
    let block = pager.block_size().bytes();
    for (i, page) in ram.bytes_mut().chunks_mut(PAGE_SIZE as usize).enumerate() {
        page.fill(i as u8 | 1);
    }
    let cold_age = Duration::from_millis(400);
    let cold = Cold::start(&pager, fast_cold(cold_age)).unwrap();
    let blocks = (4 * MIB / block) as u64;
    let probed = Instant::now();
    while cold.stats().blocks_probed < blocks {
        assert!(
            probed.elapsed() < Duration::from_secs(10),
            "{:?}",
            cold.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Half a cold age after the probe, the first block is freed and written again.
    std::thread::sleep(cold_age / 2);
    let first = HostRange::new(HostAddr::from_ptr(ram.map.as_ptr()), block as u64).unwrap();
    pager.discarded(first);
    let memfd = ram.memfd.clone().unwrap();
    // SAFETY: our own RAM, whose first block the test rewrites below.
    unsafe { uffd_pager::discard::discard(RamKind::Memfd, first, Some((&*memfd, 0))) }.unwrap();
    let written = Instant::now();
    ram.bytes_mut()[..block].fill(0x5a);
    // (Computed, not read: a read would touch every block.)
    let mut expect: Vec<u8> = (0..4 * MIB)
        .map(|i| (i / PAGE_SIZE as usize) as u8 | 1)
        .collect();
    expect[..block].fill(0x5a);
    // The blocks left alone since the probe go into the pool after one cold age; the
    // rewritten one not before a cold age after its install (less a tick of the scanner).
    let mut others_pooled = false;
    loop {
        let state = pager.page_state(0);
        let seen = written.elapsed();
        if state == PageState::Pooled {
            assert!(
                seen >= cold_age - Duration::from_millis(50),
                "the rewritten block went into the pool {seen:?} after its install, within \
                 its cold age of {cold_age:?}"
            );
            break;
        }
        others_pooled |= pager.page_state(block as u64) == PageState::Pooled;
        assert!(
            seen < Duration::from_secs(10),
            "the rewritten block never went into the pool: {:?}",
            cold.stats()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        others_pooled,
        "the untouched blocks went into the pool first"
    );
    assert!(ram.bytes() == &expect[..], "the bytes read back differ");
    assert_eq!(pager.metrics().snapshot().fault_errors, 0);
}

#[test]
fn pager_memfd_ram_offloads_by_punching_holes_and_serves_minor_faults() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut ram = Ram::memfd(8 * MIB);
    let pager = pager(&ram, PagerConfig::default());
    fill(ram.bytes_mut(), 17);
    let digest = ram.digest();
    // A zapped mapping of data still in the page cache comes back as MINOR faults.
    // SAFETY: zapping our own shared mapping; the memfd keeps the data.
    let value = unsafe { libc::madvise(ram.map.as_ptr().cast(), MIB, libc::MADV_DONTNEED) };
    assert_eq!(value, 0);
    assert_eq!(ram.digest(), digest);
    let minors = pager.metrics().snapshot().faults_minor;
    assert_eq!(minors, (MIB as u64) / PAGE_SIZE);

    let memfd = ram.memfd.as_ref().unwrap();
    let allocated = |f: &File| {
        use std::os::unix::fs::MetadataExt;
        f.metadata().unwrap().blocks() * 512
    };
    assert!(allocated(memfd) >= 7 * MIB as u64);
    pager
        .offload(&offload_config(dir.path(), Codec::Lz4))
        .unwrap();
    assert_eq!(allocated(memfd), 0, "the memfd still holds pages");
    pager.load(LoadMode::Lazy, 1).unwrap();
    assert_eq!(ram.digest(), digest);
}

#[test]
fn pager_restore_from_a_raw_file_serves_its_bytes() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mem");
    let mut image = vec![0u8; 4 * MIB];
    fill(&mut image, 21);
    std::fs::write(&path, &image).unwrap();
    let source = Arc::new(RawFileSource::open(&path).unwrap());
    let ram = Ram::anon(4 * MIB);
    // SAFETY: `ram` outlives the pager.
    let pager = unsafe {
        Pager::new(
            vec![ram.spec()],
            PagerConfig {
                initial: PageState::Source,
                ..PagerConfig::default()
            },
            Some(source),
            Box::new(|e| panic!("{e}")),
        )
        .unwrap()
    };
    assert!(ram.bytes() == &image[..]);
    let m = pager.metrics().snapshot();
    assert_eq!(m.faults_copy + m.faults_zero, 64, "{m:?}");
}

#[test]
fn pager_second_resume_prefetches_the_recorded_working_set() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut ram = Ram::anon(32 * MIB);
    let pager = pager(&ram, PagerConfig::default());
    fill(ram.bytes_mut(), 23);
    let config = offload_config(dir.path(), Codec::Lz4);
    let touch = |ram: &Ram| {
        // The "working set": 4 MiB scattered over the image.
        let mut sum = 0u64;
        for block in (0..512).step_by(8) {
            sum += u64::from(ram.bytes()[block * 64 * 1024 + 100]);
        }
        sum
    };

    pager.offload(&config).unwrap();
    // First resume without prefetch: every touched block is a synchronous fault, recorded.
    let before = pager.metrics().snapshot().fault_events;
    let first_sum = touch(&ram);
    let first_faults = pager.metrics().snapshot().fault_events - before;
    assert_eq!(first_faults, 64);

    pager.offload(&config).unwrap();
    let report = pager.load(LoadMode::Lazy, 1).unwrap();
    assert_eq!(report.working_set_blocks, 64);
    // Give the prefetcher the head start a real resume has (the VM's first instructions).
    std::thread::sleep(std::time::Duration::from_millis(200));
    let before = pager.metrics().snapshot().fault_events;
    assert_eq!(touch(&ram), first_sum);
    let second_faults = pager.metrics().snapshot().fault_events - before;
    assert!(
        second_faults * 2 <= first_faults,
        "{second_faults} vs {first_faults}"
    );
    assert!(pager.metrics().snapshot().prefetch_hits >= 32);
    pager.wait_prefetch();
}

/// A VMM that registered more than it declared: faults and discards outside the declared
/// regions reach the pager. They are reported and ignored, and the declared region is untouched.
#[test]
fn pager_events_outside_regions_are_ignored_and_reported() {
    if skip() {
        return;
    }
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::sync::Mutex;
    use std::time::{Duration, Instant};
    use uffd_pager::uffd::{feature, Mode, Userfaultfd};

    let ram = Ram::anon(2 * MIB);
    let whole = HostRange::new(HostAddr::from_ptr(ram.map.as_ptr()), 2 * MIB as u64).unwrap();
    let uffd = Userfaultfd::create(feature::EVENT_REMOVE).unwrap();
    // SAFETY: `ram` outlives the pager and the registration.
    unsafe { uffd.register(whole, Mode::MISSING).unwrap() };
    // SAFETY: dup of a descriptor we hold; the result is checked and owned.
    let mine = unsafe { libc::dup(uffd.as_raw_fd()) };
    assert!(mine >= 0);
    // SAFETY: a fresh descriptor owned by nobody else.
    let mine = Userfaultfd::from_fd(unsafe { <OwnedFd as FromRawFd>::from_raw_fd(mine) });
    let mut declared = ram.spec();
    declared.range = HostRange::new(HostAddr::from_ptr(ram.map.as_ptr()), MIB as u64).unwrap();
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = Arc::clone(&errors);
    // SAFETY: `ram` outlives the pager (declared before it, dropped after).
    let pager = unsafe {
        Pager::with_uffd(
            uffd,
            true,
            vec![declared],
            PagerConfig {
                register: false,
                ..PagerConfig::default()
            },
            None,
            Box::new(move |e| sink.lock().unwrap().push(e.to_string())),
        )
        .unwrap()
    };
    let wait_for = |what: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !errors.lock().unwrap().iter().any(|e| e.contains(what)) {
            assert!(Instant::now() < deadline, "never reported: {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    assert!(ram.bytes()[..MIB].iter().all(|&b| b == 0));
    // A discard of the undeclared half.
    // SAFETY: discarding part of our own mapping.
    let rc = unsafe { libc::madvise(ram.map.as_ptr().add(MIB).cast(), MIB, libc::MADV_DONTNEED) };
    assert_eq!(rc, 0);
    wait_for("discard of");
    // A fault in the undeclared half: reported, left to its owner (here: us).
    let addr = ram.map.as_ptr() as usize + MIB;
    let toucher = std::thread::spawn(move || {
        // SAFETY: reading a byte of the live mapping; it faults.
        unsafe { std::ptr::read_volatile(addr as *const u8) }
    });
    wait_for("outside every region");
    let page = HostRange::new(HostAddr(addr as u64), PAGE_SIZE).unwrap();
    mine.zeropage(page, true).unwrap();
    assert_eq!(toucher.join().unwrap(), 0);
    // The declared half is as it was: resident and served.
    assert_eq!(pager.page_state(0), PageState::Resident);
    assert!(ram.bytes()[..MIB].iter().all(|&b| b == 0));
    drop(pager);
}

/// A pager for huge-page RAM: 2 MiB blocks (a block holds whole huge pages).
fn huge_pager(ram: &Ram, remove_events: bool) -> Pager {
    pager(
        ram,
        PagerConfig {
            block_size: compressed_backing::BlockSize::new(2 * MIB as u64).unwrap(),
            remove_events,
            threads: 2,
            ..PagerConfig::default()
        },
    )
}

#[test]
fn pager_serves_huge_pages_whole_and_offloads_them_back_to_the_host() {
    if skip() {
        return;
    }
    const RAM: usize = 32 * MIB;
    const HUGE: u64 = (RAM / (2 * MIB)) as u64;
    let _lent = testkit::hugepages::HugePages::lend(HUGE + 4);
    let surplus_before = testkit::hugepages::pool_count("surplus_hugepages");
    for (make, remove_events, codec, mode) in [
        (
            Ram::hugetlb as fn(usize) -> Ram,
            true,
            Codec::Lz4,
            LoadMode::Lazy,
        ),
        (Ram::hugetlb, false, Codec::None, LoadMode::Eager),
        (Ram::hugetlb_memfd, false, Codec::Lz4, LoadMode::Faults),
        (Ram::hugetlb_memfd, false, Codec::None, LoadMode::Lazy),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut ram = make(RAM);
        let kind = ram.kind;
        let pager = huge_pager(&ram, remove_events);
        fill(ram.bytes_mut(), 11);
        let digest = ram.digest();
        let m = pager.metrics().snapshot();
        // One fault per huge page, each a whole huge page of copied zeros (no zero page).
        assert_eq!(m.faults_zero, HUGE, "{kind:?}: {m:?}");
        assert_eq!(m.zero_pages, RAM as u64 / PAGE_SIZE, "{kind:?}");
        assert_eq!(ram.resident(), RAM, "{kind:?}");
        assert_eq!(
            testkit::hugepages::pool_count("surplus_hugepages"),
            surplus_before + HUGE,
            "{kind:?}: the pool lent one huge page per huge page touched"
        );

        let report = pager.offload(&offload_config(dir.path(), codec)).unwrap();
        assert_eq!(report.pages_dropped, RAM as u64 / PAGE_SIZE, "{kind:?}");
        assert_eq!(report.blocks_written, HUGE, "{kind:?}: {report:?}");
        assert_eq!(ram.resident(), 0, "{kind:?}");
        // The huge pages went back to the host, not only to the pool.
        assert_eq!(
            testkit::hugepages::pool_count("surplus_hugepages"),
            surplus_before,
            "{kind:?}"
        );

        let load = pager.load(mode, 2).unwrap();
        assert_eq!(load.blocks, HUGE, "{kind:?}");
        match mode {
            LoadMode::Eager => assert_eq!(load.pages_installed, RAM as u64 / PAGE_SIZE),
            // The digest below faults while the prefetcher runs.
            LoadMode::Lazy | LoadMode::Faults => {}
        }
        let faults_before = pager.metrics().snapshot().faults_copy;
        assert_eq!(ram.digest(), digest, "{kind:?} {codec} {mode:?}");
        if mode == LoadMode::Lazy {
            pager.wait_prefetch();
        }
        let m = pager.metrics().snapshot();
        // Faults and the prefetcher never read one block twice: one reader claims it.
        assert_eq!(m.blocks_fetched, HUGE, "{kind:?} {mode:?}: {m:?}");
        if mode == LoadMode::Faults {
            // Each huge page brought back by one synchronous fault or read ahead along the
            // digest's stride (a compressed store's block is decoded ahead of the faults).
            let ahead = m.stride_pages / (2 * MIB as u64 / PAGE_SIZE);
            assert!(
                m.faults_copy - faults_before + ahead <= HUGE,
                "{kind:?}: {m:?}"
            );
            assert!(ahead > HUGE / 4, "{kind:?}: {m:?}");
        }
        assert_eq!(m.fault_errors, 0, "{kind:?}");
        assert_eq!(pager.state_counts().resident, RAM as u64 / PAGE_SIZE);
        drop(pager);
        drop(ram);
        assert_eq!(
            testkit::hugepages::pool_count("surplus_hugepages"),
            surplus_before
        );
    }
}

/// Huge-page RAM restored from an lz4 store (as `uffd-pager serve` restores a Firecracker VM):
/// faults along a stride are read ahead, never read twice, every byte right; faults in no
/// order read nothing ahead; an offload while read-ahead runs loses nothing.
#[test]
fn pager_reads_huge_pages_ahead_along_the_guests_stride_only() {
    if skip() {
        return;
    }
    const RAM: usize = 64 * MIB;
    const HUGE: u64 = (RAM / (2 * MIB)) as u64;
    const PER_HUGE: u64 = 2 * MIB as u64 / PAGE_SIZE;
    let _lent = testkit::hugepages::HugePages::lend(HUGE + 4);
    let dir = tempfile::tempdir().unwrap();
    let mut image = vec![0u8; RAM];
    fill(&mut image, 31);
    let raw = dir.path().join("mem");
    std::fs::write(&raw, &image).unwrap();
    let store_dir = dir.path().join("store");
    let options = compressed_backing::PackOptions {
        codec: Some(CodecConfig::new(Codec::Lz4)),
        ..compressed_backing::PackOptions::default()
    };
    compressed_backing::pack_file(&raw, &store_dir, &options, &|_| {}).unwrap();
    let restore = || -> Arc<dyn uffd_pager::source::PageSource> {
        let store = compressed_backing::DiskStore::open_read_only(&store_dir).unwrap();
        Arc::new(uffd_pager::source::StoreSource::new(store))
    };
    let start = |ram: &Ram| {
        // SAFETY: `ram` outlives the pager.
        unsafe {
            Pager::new(
                vec![ram.spec()],
                PagerConfig {
                    block_size: compressed_backing::BlockSize::new(2 * MIB as u64).unwrap(),
                    initial: PageState::Source,
                    threads: 1,
                    ..PagerConfig::default()
                },
                Some(restore()),
                Box::new(|e| panic!("fault error: {e}")),
            )
            .unwrap()
        }
    };
    let huge = |ram: &Ram, h: usize| ram.bytes()[h * 2 * MIB..(h + 1) * 2 * MIB].to_vec();

    // Every third huge page, in order: after three faults the rest come ahead of the faults.
    let ram = Ram::hugetlb(RAM);
    let pager = start(&ram);
    let along: Vec<usize> = (0..HUGE as usize).step_by(3).collect();
    for &h in &along {
        assert!(
            huge(&ram, h) == image[h * 2 * MIB..(h + 1) * 2 * MIB],
            "huge page {h}"
        );
    }
    let m = pager.metrics().snapshot();
    let ahead = m.stride_pages / PER_HUGE;
    assert!(ahead >= along.len() as u64 / 2, "{m:?}");
    // Never a block read twice, and only blocks on the stride read ahead (none past the end).
    assert_eq!(m.blocks_fetched, along.len() as u64, "{m:?}");
    assert_eq!(m.fault_errors, 0);
    // The pages between the stride's steps were never installed, and still read right.
    assert!(ram.bytes() == &image[..]);
    drop(pager);
    drop(ram);

    // No order: nothing read ahead.
    let ram = Ram::hugetlb(RAM);
    let pager = start(&ram);
    for h in [5, 1, 9, 2, 14, 7, 30, 11, 3, 20] {
        assert!(
            huge(&ram, h) == image[h * 2 * MIB..(h + 1) * 2 * MIB],
            "huge page {h}"
        );
    }
    let m = pager.metrics().snapshot();
    assert_eq!(m.stride_pages, 0, "{m:?}");
    assert_eq!(m.blocks_fetched, 10, "{m:?}");
    drop(pager);
    drop(ram);

    // An offload right after a pass along the stride (its read-ahead may still run): what it
    // stores is what the guest wrote, and comes back as it was.
    let mut ram = Ram::hugetlb(RAM);
    let pager = start(&ram);
    for h in (0..HUGE as usize).step_by(2) {
        ram.bytes_mut()[h * 2 * MIB + 7] ^= 0xff;
        image[h * 2 * MIB + 7] ^= 0xff;
    }
    let offload_dir = dir.path().join("offload");
    pager
        .offload(&offload_config(&offload_dir, Codec::Lz4))
        .unwrap();
    assert!(ram.bytes() == &image[..]);
    assert_eq!(pager.metrics().snapshot().fault_errors, 0);
}

#[test]
fn pager_refuses_huge_page_regions_it_could_not_keep_whole() {
    if skip() {
        return;
    }
    let _lent = testkit::hugepages::HugePages::lend(2);
    let ram = Ram::hugetlb(4 * MIB);
    // 64 KiB blocks would cut huge pages apart.
    // SAFETY: `ram` outlives the attempt.
    let small_blocks = unsafe {
        Pager::new(
            vec![ram.spec()],
            PagerConfig::default(),
            None,
            Box::new(|_| {}),
        )
    };
    let error = small_blocks.unwrap_err().to_string();
    assert!(error.contains("larger than the pager's"), "{error}");
    // A region that starts half-way into the image's huge page.
    let mut spec = ram.spec();
    spec.image_offset = 64 << 10;
    // SAFETY: as above.
    let misaligned = unsafe {
        Pager::new(
            vec![spec],
            PagerConfig {
                block_size: compressed_backing::BlockSize::new(2 * MIB as u64).unwrap(),
                ..PagerConfig::default()
            },
            None,
            Box::new(|_| {}),
        )
    };
    let error = misaligned.unwrap_err().to_string();
    assert!(error.contains("not aligned"), "{error}");
}

#[test]
fn pager_discard_of_huge_page_ram_drops_whole_huge_pages_only() {
    if skip() {
        return;
    }
    let _lent = testkit::hugepages::HugePages::lend(4);
    let mut ram = Ram::hugetlb(8 * MIB);
    let pager = huge_pager(&ram, false);
    fill(ram.bytes_mut(), 13);
    let expect = ram.bytes().to_vec();
    let base = HostAddr::from_ptr(ram.map.as_ptr());
    // A report of 1 MiB to 5 MiB covers one whole huge page (2 to 4 MiB), and parts of two.
    let reported = HostRange::new(HostAddr(base.0 + MIB as u64), 4 * MIB as u64).unwrap();
    let whole = uffd_pager::discard::inward(reported, basics::PageSize::HUGE).unwrap();
    assert_eq!(whole.start().0, base.0 + 2 * MIB as u64);
    assert_eq!(whole.len(), 2 * MIB as u64);
    // A range that is not whole huge pages is refused, never rounded.
    // SAFETY: our own RAM, whose bytes the test no longer needs where it is dropped.
    let refused = unsafe { uffd_pager::discard::discard(RamKind::Hugetlb, reported, None) };
    assert!(refused.is_err());
    pager.discarded(whole);
    // SAFETY: as above.
    unsafe { uffd_pager::discard::discard(RamKind::Hugetlb, whole, None) }.unwrap();
    assert_eq!(pager.page_state(2 * MIB as u64), PageState::Zero);
    assert_eq!(
        pager.page_state(2 * MIB as u64 - PAGE_SIZE),
        PageState::Resident
    );
    let bytes = ram.bytes();
    assert!(bytes[2 * MIB..4 * MIB].iter().all(|&b| b == 0));
    assert!(bytes[..2 * MIB] == expect[..2 * MIB]);
    assert!(bytes[4 * MIB..] == expect[4 * MIB..]);
    assert_eq!(pager.metrics().snapshot().fault_errors, 0);
}

#[test]
fn pager_collapse_after_an_eager_load_maps_resident_ram_with_huge_pages() {
    if skip() {
        return;
    }
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut ram = Ram::anon(16 * MIB);
    let pager = pager(&ram, PagerConfig::default());
    fill(ram.bytes_mut(), 21);
    let digest = ram.digest();
    pager
        .offload(&offload_config(dir.path(), Codec::None))
        .unwrap();
    // Nothing resident: nothing to collapse.
    assert_eq!(pager.collapse().huge_pages, 0);
    pager.load(LoadMode::Eager, 2).unwrap();
    let collapse = pager.collapse();
    // 16 MiB from a page-aligned start hold at least 7 whole aligned 2 MiB ranges.
    if thp.contains("[never]") {
        assert_eq!(collapse.huge_pages, 0);
    } else {
        assert!(collapse.huge_pages >= 7, "{collapse:?}");
        let start = ram.map.as_ptr() as u64;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        let mut huge_kib = 0;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((lo, _)) = range.split_once('-') {
                    if let Ok(lo) = u64::from_str_radix(lo, 16) {
                        inside = lo == start;
                        continue;
                    }
                }
            }
            if let (true, Some(rest)) = (inside, line.strip_prefix("AnonHugePages:")) {
                huge_kib = rest.trim().trim_end_matches(" kB").parse::<u64>().unwrap();
            }
        }
        assert_eq!(huge_kib, collapse.huge_pages * 2048, "{collapse:?}");
    }
    assert_eq!(ram.digest(), digest);
    assert_eq!(pager.metrics().snapshot().fault_errors, 0);
}
