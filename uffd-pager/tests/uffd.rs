//! The userfaultfd wrapper on the real device: faults from host threads resolved with COPY,
//! ZEROPAGE and CONTINUE; EEXIST, EAGAIN (pending REMOVE) and REMOVE events.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use testkit::Mapping;
use uffd_pager::addr::{HostAddr, HostRange, PAGE_SIZE};
use uffd_pager::uffd::{feature, Event, Mode, Resolved, UffdError, Userfaultfd};

fn skip() -> bool {
    testkit::skip_unless(&["/dev/userfaultfd"])
}

/// Helpers on a test mapping.
trait MappingExt {
    fn range(&self) -> HostRange;
    fn discard(&self, len: usize);
}

impl MappingExt for Mapping {
    fn range(&self) -> HostRange {
        HostRange::new(HostAddr::from_ptr(self.as_ptr()), self.len() as u64).unwrap()
    }

    fn discard(&self, len: usize) {
        assert!(len <= self.len());
        // SAFETY: discarding pages of our own mapping.
        let rc = unsafe { libc::madvise(self.as_ptr().cast(), len, libc::MADV_DONTNEED) };
        assert_eq!(rc, 0);
    }
}

/// Serves faults in the background until dropped: page N is filled with byte N+1, or the
/// zero page for N % 4 == 3.
fn serve(uffd: &Userfaultfd, range: HostRange, stop: &AtomicBool) -> u64 {
    let mut served = 0;
    let mut events = Vec::new();
    let mut page = vec![0u8; PAGE_SIZE as usize];
    while !stop.load(Ordering::Relaxed) {
        let (ready, _) = uffd.poll(None, 50).unwrap();
        if !ready {
            continue;
        }
        uffd.read_events(&mut events).unwrap();
        for event in &events {
            let Event::Pagefault { addr, .. } = *event else {
                continue;
            };
            let index = range.page_index(addr).unwrap();
            let dst = range.page_addr(index);
            let result = if index % 4 == 3 {
                uffd.zeropage(HostRange::new(dst, PAGE_SIZE).unwrap(), true)
            } else {
                page.fill(index as u8 + 1);
                uffd.copy(dst, &page, true)
            };
            match result.unwrap() {
                Resolved::Done => served += 1,
                Resolved::AlreadyMapped { .. } => {
                    uffd.wake(HostRange::new(dst, PAGE_SIZE).unwrap()).unwrap()
                }
            }
        }
    }
    served
}

#[test]
fn uffd_missing_faults_are_served_by_copy_and_zeropage() {
    if skip() {
        return;
    }
    let mem = Mapping::anon(64 * PAGE_SIZE as usize);
    let uffd = Userfaultfd::create(feature::EVENT_REMOVE).unwrap();
    // SAFETY: `mem` outlives the userfaultfd's use below (it is dropped last).
    unsafe { uffd.register(mem.range(), Mode::MISSING).unwrap() };
    let stop = AtomicBool::new(false);
    let served = thread::scope(|s| {
        let server = s.spawn(|| serve(&uffd, mem.range(), &stop));
        let readers: Vec<_> = (0..4)
            .map(|t| {
                let mem = &mem;
                s.spawn(move || {
                    for page in (t..64).step_by(4) {
                        let expect = if page % 4 == 3 { 0 } else { page as u8 + 1 };
                        assert_eq!(
                            mem.read(page * PAGE_SIZE as usize + 17),
                            expect,
                            "page {page}"
                        );
                    }
                })
            })
            .collect();
        for reader in readers {
            reader.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap()
    });
    assert_eq!(served, 64);
}

#[test]
fn uffd_copy_over_a_mapped_page_reports_already_mapped() {
    if skip() {
        return;
    }
    let mem = Mapping::anon(4 * PAGE_SIZE as usize);
    let uffd = Userfaultfd::create(0).unwrap();
    // SAFETY: `mem` outlives every use of the registration.
    unsafe { uffd.register(mem.range(), Mode::MISSING).unwrap() };
    let start = mem.range().start();
    let page = vec![7u8; PAGE_SIZE as usize];
    assert_eq!(uffd.copy(start, &page, true).unwrap(), Resolved::Done);
    assert_eq!(
        uffd.copy(start, &page, true).unwrap(),
        Resolved::AlreadyMapped { done: 0 }
    );
    // A two-page copy whose second page is mapped stops there: EAGAIN with the progress.
    let second = HostAddr(start.0 + 2 * PAGE_SIZE);
    assert_eq!(uffd.copy(second, &page, true).unwrap(), Resolved::Done);
    let two = vec![9u8; 2 * PAGE_SIZE as usize];
    assert!(matches!(
        uffd.copy(HostAddr(start.0 + PAGE_SIZE), &two, true),
        Err(UffdError::Retry {
            done: PAGE_SIZE,
            ..
        })
    ));
    assert_eq!(mem.read(PAGE_SIZE as usize), 9);
    assert_eq!(mem.read(2 * PAGE_SIZE as usize), 7);
    // `copy_missing` fills the holes of a partly mapped range and leaves the rest alone.
    let four = vec![3u8; 4 * PAGE_SIZE as usize];
    assert_eq!(
        uffd.copy_missing(start, &four, basics::PageSize::BASE, true)
            .unwrap(),
        PAGE_SIZE
    );
    assert_eq!(
        (0..4)
            .map(|p| mem.read(p * PAGE_SIZE as usize))
            .collect::<Vec<_>>(),
        vec![7, 9, 7, 3]
    );
}

#[test]
fn uffd_pending_remove_makes_copy_retry_and_is_reported() {
    if skip() {
        return;
    }
    let mem = Mapping::anon(16 * PAGE_SIZE as usize);
    let uffd = Userfaultfd::create(feature::EVENT_REMOVE).unwrap();
    // SAFETY: `mem` outlives every use of the registration.
    unsafe { uffd.register(mem.range(), Mode::MISSING).unwrap() };
    let range = mem.range();
    let page = vec![1u8; PAGE_SIZE as usize];
    uffd.copy(range.start(), &page, true).unwrap();

    thread::scope(|s| {
        // MADV_DONTNEED blocks until the REMOVE event is read.
        let mem = &mem;
        let discarder = s.spawn(move || mem.discard(8 * PAGE_SIZE as usize));
        // Once the event is posted (the descriptor is readable) and until it is read,
        // resolving ioctls fail with EAGAIN and no progress.
        assert!(
            uffd.poll(None, 5000).unwrap().0,
            "no REMOVE event was posted"
        );
        match uffd.copy(range.page_addr(12), &page, true) {
            Err(UffdError::Retry { done: 0, .. }) => {}
            other => panic!("expected EAGAIN while a REMOVE is pending, got {other:?}"),
        }
        let mut events = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while events.is_empty() && Instant::now() < deadline {
            uffd.poll(None, 100).unwrap();
            uffd.read_events(&mut events).unwrap();
        }
        assert_eq!(
            events,
            vec![Event::Remove {
                start: range.start(),
                end: range.page_addr(8)
            }]
        );
        discarder.join().unwrap();
        // With the event read, the same copy goes through.
        assert_eq!(
            uffd.copy(range.page_addr(12), &page, true).unwrap(),
            Resolved::Done
        );
    });
}

#[test]
fn uffd_minor_fault_on_memfd_is_resolved_by_continue() {
    if skip() {
        return;
    }
    let len = 8 * PAGE_SIZE as usize;
    // SAFETY: creating a memfd with a valid name.
    let fd = unsafe { libc::memfd_create(c"uffd-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: sizing our own memfd.
    assert_eq!(unsafe { libc::ftruncate(fd, 8 * 4096) }, 0);
    // SAFETY: a shared mapping of the memfd; checked below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    let ptr = ptr.cast::<u8>();
    // Put data in the page cache, then drop this mapping's page table entries.
    // SAFETY: in bounds of the mapping.
    unsafe { std::ptr::write_bytes(ptr, 0x5A, len) };
    // SAFETY: zapping our own mapping; the shmem page cache keeps the data.
    let value = unsafe { libc::madvise(ptr.cast(), len, libc::MADV_DONTNEED) };
    assert_eq!(value, 0);

    let uffd = Userfaultfd::create(feature::MISSING_SHMEM | feature::MINOR_SHMEM).unwrap();
    let range = HostRange::new(HostAddr::from_ptr(ptr), len as u64).unwrap();
    // SAFETY: the mapping lives until the munmap at the end, after the last fault.
    unsafe { uffd.register(range, Mode::MISSING_MINOR).unwrap() };
    let stop = AtomicBool::new(false);
    let minors = thread::scope(|s| {
        let server = s.spawn(|| {
            let mut minors = 0;
            let mut events = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if !uffd.poll(None, 20).unwrap().0 {
                    continue;
                }
                uffd.read_events(&mut events).unwrap();
                for event in &events {
                    if let Event::Pagefault {
                        addr, minor: true, ..
                    } = *event
                    {
                        let page = HostRange::new(addr.page_down(), PAGE_SIZE).unwrap();
                        uffd.continue_range(page, true).unwrap();
                        minors += 1;
                    }
                }
            }
            minors
        });
        for page in 0..8 {
            // SAFETY: in bounds of the mapping.
            let value = unsafe { ptr.add(page * PAGE_SIZE as usize).read_volatile() };
            assert_eq!(value, 0x5A);
        }
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap()
    });
    assert_eq!(minors, 8);
    // SAFETY: unmapping and closing our own objects.
    unsafe {
        libc::munmap(ptr.cast(), len);
        libc::close(fd);
    }
}

/// Whether `addr`'s page is present, and whether it carries the uffd-wp bit, by
/// `/proc/self/pagemap`.
fn pagemap_entry(addr: HostAddr) -> (bool, bool) {
    use std::os::unix::fs::FileExt;
    let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
    let mut entry = [0u8; 8];
    pagemap
        .read_exact_at(&mut entry, addr.0 / PAGE_SIZE * 8)
        .unwrap();
    let entry = u64::from_le_bytes(entry);
    (entry >> 63 != 0, (entry >> 57) & 1 != 0)
}

#[test]
fn uffd_written_pages_and_move_on_write_tracked_anon() {
    if skip() {
        return;
    }
    const BLOCK: usize = 64 << 10;
    let uffd = Userfaultfd::create(feature::WP_ASYNC | feature::MOVE).unwrap();
    let guest = Mapping::anon(16 * BLOCK);
    let scratch = Mapping::anon(BLOCK);
    // SAFETY: both mappings outlive the userfaultfd and are only touched through it here.
    unsafe {
        uffd.register(guest.range(), Mode::MISSING_WP).unwrap();
        uffd.register(scratch.range(), Mode::MISSING_WP).unwrap();
    }
    let pattern: Vec<u8> = (0..guest.len())
        .map(|i| (i / 4096 * 7 + i % 251) as u8)
        .collect();
    assert_eq!(
        uffd.copy_missing(
            guest.range().start(),
            &pattern,
            basics::PageSize::BASE,
            true
        )
        .unwrap(),
        guest.len() as u64
    );
    let mut written = uffd_pager::pagemap::WrittenPages::open().unwrap();
    let mut take = || {
        let mut runs = Vec::new();
        written
            .take(&uffd, guest.range(), |run| runs.push(run))
            .unwrap();
        runs
    };
    // Installed pages count as written once; then only what is written in between.
    assert_eq!(take(), vec![guest.range()]);
    assert_eq!(take(), vec![]);
    // SAFETY: in bounds of the live, fully mapped guest mapping.
    unsafe { guest.as_ptr().add(5 * 4096 + 9).write_volatile(0xEE) };
    let page5 = HostRange::new(guest.range().page_addr(5), PAGE_SIZE).unwrap();
    assert_eq!(take(), vec![page5]);
    assert_eq!(guest.read(5 * 4096 + 9), 0xEE);
    // A discarded page is not reported and keeps no marker: the zero page still fills it.
    let page40 = HostRange::new(guest.range().page_addr(40), PAGE_SIZE).unwrap();
    // SAFETY: discarding one page of our own mapping.
    let rc = unsafe { libc::madvise(page40.start().as_ptr(), 4096, libc::MADV_DONTNEED) };
    assert_eq!(rc, 0);
    assert_eq!(take(), vec![]);
    assert_eq!(pagemap_entry(page40.start()), (false, false));
    assert_eq!(uffd.zeropage(page40, true).unwrap(), Resolved::Done);
    assert_eq!(guest.read(40 * 4096), 0);
    // A block moves out (the guest's pages are gone, no marker left) and back, intact.
    let block = guest.range().page_addr(16);
    // SAFETY: both ranges are registered anon mappings of this test, nothing refers into them.
    unsafe { uffd.move_pages(scratch.range().start(), block, BLOCK as u64, false) }.unwrap();
    assert_eq!(pagemap_entry(block), (false, false));
    assert_eq!(
        pagemap_entry(scratch.range().start()),
        (true, pagemap_entry(scratch.range().start()).1)
    );
    // SAFETY: the scratch is fully mapped after the move.
    let moved = unsafe { std::slice::from_raw_parts(scratch.as_ptr(), BLOCK) };
    let first_diff = moved
        .iter()
        .zip(&pattern[16 * 4096..])
        .position(|(a, b)| a != b);
    assert_eq!(first_diff, None);
    // SAFETY: as above.
    unsafe { uffd.move_pages(block, scratch.range().start(), BLOCK as u64, true) }.unwrap();
    assert_eq!(pagemap_entry(scratch.range().start()), (false, false));
    assert_eq!(guest.read(16 * 4096 + 3), pattern[16 * 4096 + 3]);
    // Discarding the scratch after a move leaves it empty for the next one.
    scratch.discard(BLOCK);
}
