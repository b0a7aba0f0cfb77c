//! The standalone server, driven exactly the way Firecracker drives a UFFD handler: the test
//! maps guest memory, creates a userfaultfd with `UFFD_FEATURE_EVENT_REMOVE`, registers its
//! regions MISSING, connects, and sends one message with the JSON regions and the uffd.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::io::{IoSlice, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use compressed_backing::{pack_file, BlockSize, Codec, CodecConfig, DiskStore, PackOptions};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use testkit::Mapping;
use uffd_pager::addr::{HostAddr, HostRange, PAGE_SIZE};
use uffd_pager::server::{Server, ServerConfig, MAX_HANDSHAKES};
use uffd_pager::source::{PageSource, RawFileSource, StoreSource};
use uffd_pager::uffd::{feature, Mode, Userfaultfd};

const MIB: usize = 1 << 20;

fn skip() -> bool {
    testkit::skip_unless(&["/dev/userfaultfd"])
}

/// A memory image with zero pages, repeated and random-looking stretches.
fn image(len: usize, seed: u8) -> Vec<u8> {
    let mut state = 0x2545_F491_4F6C_DD1D_u64 ^ u64::from(seed);
    (0..len)
        .map(|i| match (i / PAGE_SIZE as usize) % 5 {
            0 => 0,
            1 => (i % 251) as u8 ^ seed,
            _ => {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            }
        })
        .collect()
}

/// A running server on a temporary socket, stopped on drop.
struct Running {
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    server: Arc<Server>,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Running {
    fn start(source: Arc<dyn PageSource>, block_size: BlockSize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("uffd.sock");
        let server = Arc::new(
            Server::bind(
                &socket,
                source,
                ServerConfig {
                    threads: 1,
                    block_size,
                },
            )
            .unwrap(),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (server, stop) = (Arc::clone(&server), Arc::clone(&stop));
            std::thread::spawn(move || server.run(&stop))
        };
        Self {
            socket,
            stop,
            server,
            thread: Some(thread),
            _dir: dir,
        }
    }

    fn wait_until(&self, what: &str, mut done: impl FnMut(&Server) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done(&self.server) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
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

/// Guest memory the way Firecracker has it: private anonymous regions registered on a uffd.
struct Vm {
    maps: Vec<Mapping>,
    uffd: Userfaultfd,
    /// The page size the regions are mapped with.
    page_size: usize,
}

// SAFETY: plain memory mappings; the tests synchronise access themselves.
unsafe impl Send for Vm {}

impl Vm {
    fn new(sizes: &[usize]) -> Self {
        Self::with_features(sizes, feature::EVENT_REMOVE)
    }

    /// Regions registered on a userfaultfd created with `features`.
    fn with_features(sizes: &[usize], features: u64) -> Self {
        Self::mapped(sizes, features, PAGE_SIZE as usize, Mapping::anon)
    }

    /// Regions of 2 MiB huge pages, as Firecracker maps guest memory with `huge_pages: "2M"`
    /// (private anonymous `MAP_HUGETLB`), registered MISSING on a uffd with `EVENT_REMOVE`.
    fn huge(sizes: &[usize]) -> Self {
        Self::mapped(sizes, feature::EVENT_REMOVE, 2 * MIB, |len| {
            let flags = libc::MAP_PRIVATE
                | libc::MAP_ANONYMOUS
                | libc::MAP_NORESERVE
                | libc::MAP_HUGETLB
                | libc::MAP_HUGE_2MB;
            Mapping::new(len, libc::PROT_READ | libc::PROT_WRITE, flags, None).unwrap()
        })
    }

    fn mapped(
        sizes: &[usize],
        features: u64,
        page_size: usize,
        map: impl Fn(usize) -> Mapping,
    ) -> Self {
        let uffd = Userfaultfd::create(features).unwrap();
        let maps = sizes
            .iter()
            .map(|&len| {
                let map = map(len);
                let range = HostRange::new(HostAddr::from_ptr(map.as_ptr()), len as u64).unwrap();
                // SAFETY: the mapping lives until `Vm` is dropped, after the server is done.
                unsafe { uffd.register(range, Mode::MISSING).unwrap() };
                map
            })
            .collect();
        Self {
            maps,
            uffd,
            page_size,
        }
    }

    /// The Firecracker 1.12 handshake: regions laid end to end in the file.
    fn json(&self, page_size_fields: bool) -> String {
        let mut offset = 0;
        let regions: Vec<String> = self
            .maps
            .iter()
            .map(|map| {
                let (ptr, len) = (map.as_ptr(), map.len());
                let sizes = if page_size_fields {
                    format!(r#","page_size":{0},"page_size_kib":{0}"#, self.page_size)
                } else {
                    String::new()
                };
                let json = format!(
                    r#"{{"base_host_virt_addr":{},"size":{len},"offset":{offset}{sizes}}}"#,
                    ptr as u64
                );
                offset += len;
                json
            })
            .collect();
        format!("[{}]", regions.join(","))
    }

    fn connect(&self, socket: &Path, json: &str) -> UnixStream {
        let stream = UnixStream::connect(socket).unwrap();
        send(&stream, json.as_bytes(), Some(self.uffd.as_raw_fd()));
        stream
    }

    fn bytes(&self, region: usize) -> &[u8] {
        let (ptr, len) = (self.maps[region].as_ptr(), self.maps[region].len());
        // SAFETY: a live mapping of `len` bytes; reading it faults to the server.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }
}

fn send(stream: &UnixStream, bytes: &[u8], fd: Option<i32>) {
    let iov = [IoSlice::new(bytes)];
    let fds = fd.map(|fd| [fd]);
    let cmsgs: Vec<ControlMessage<'_>> = fds.iter().map(|f| ControlMessage::ScmRights(f)).collect();
    sendmsg::<()>(stream.as_raw_fd(), &iov, &cmsgs, MsgFlags::empty(), None).unwrap();
}

/// True once the server has closed the connection.
fn closed_by_server(stream: &UnixStream) -> bool {
    closed_within(stream, Duration::from_secs(10))
}

/// True if the server closes the connection within `within`.
fn closed_within(mut stream: &UnixStream, within: Duration) -> bool {
    stream.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 16];
    // A close with our bytes still unread reads as a reset.
    match stream.read(&mut buf) {
        Ok(0) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    }
}

fn raw_file(dir: &Path, data: &[u8]) -> Arc<dyn PageSource> {
    let path = dir.join("mem");
    std::fs::write(&path, data).unwrap();
    Arc::new(RawFileSource::open(&path).unwrap())
}

#[test]
fn server_serves_a_firecracker_vm_from_a_raw_memory_file() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = image(8 * MIB, 1);
    let running = Running::start(raw_file(dir.path(), &data), BlockSize::default());
    let vm = Vm::new(&[3 * MIB, 5 * MIB]);
    let stream = vm.connect(&running.socket, &vm.json(true));
    assert!(vm.bytes(0) == &data[..3 * MIB]);
    assert!(vm.bytes(1) == &data[3 * MIB..]);
    // A balloon-style discard: the range faults back as zeros.
    let ptr = vm.maps[1].as_ptr();
    // SAFETY: discarding part of our own mapping.
    let rc = unsafe { libc::madvise(ptr.add(MIB).cast(), MIB, libc::MADV_DONTNEED) };
    assert_eq!(rc, 0);
    assert!(vm.bytes(1)[MIB..2 * MIB].iter().all(|&b| b == 0));
    assert!(vm.bytes(1)[2 * MIB..] == data[5 * MIB..]);
    assert_eq!(running.server.stats().active.load(Ordering::Relaxed), 1);
    drop(stream);
    running.wait_until("the VM to be released", |s| {
        s.stats().active.load(Ordering::Relaxed) == 0
    });
}

#[test]
fn server_serves_a_firecracker_vm_of_huge_pages_from_a_raw_file_and_a_store() {
    if skip() {
        return;
    }
    let _lent = testkit::hugepages::HugePages::lend(8);
    let dir = tempfile::tempdir().unwrap();
    let data = image(8 * MIB, 7);
    let raw = dir.path().join("mem");
    std::fs::write(&raw, &data).unwrap();
    let store_dir = dir.path().join("store");
    // 64 KiB blocks: a 2 MiB page is gathered from 32 of them.
    let options = PackOptions {
        codec: Some(CodecConfig::new(Codec::Lz4)),
        ..PackOptions::default()
    };
    pack_file(&raw, &store_dir, &options, &|_| {}).unwrap();
    let store = DiskStore::open_read_only(&store_dir).unwrap();
    let sources: [(Arc<dyn PageSource>, BlockSize); 2] = [
        (
            Arc::new(RawFileSource::open(&raw).unwrap()),
            BlockSize::default(),
        ),
        (Arc::new(StoreSource::new(store)), BlockSize::default()),
    ];
    for (source, block_size) in sources {
        let running = Running::start(source, block_size);
        let vm = Vm::huge(&[2 * MIB, 6 * MIB]);
        let stream = vm.connect(&running.socket, &vm.json(true));
        assert!(vm.bytes(0) == &data[..2 * MIB]);
        assert!(vm.bytes(1) == &data[2 * MIB..]);
        // A balloon's discard of one huge page: it faults back as zeros.
        let ptr = vm.maps[1].as_ptr();
        // SAFETY: discarding a whole huge page of our own mapping.
        let rc = unsafe { libc::madvise(ptr.add(2 * MIB).cast(), 2 * MIB, libc::MADV_DONTNEED) };
        assert_eq!(rc, 0);
        assert!(vm.bytes(1)[2 * MIB..4 * MIB].iter().all(|&b| b == 0));
        assert!(vm.bytes(1)[4 * MIB..] == data[6 * MIB..]);
        assert!(vm.bytes(1)[..2 * MIB] == data[2 * MIB..4 * MIB]);
        drop(stream);
        running.wait_until("the VM to be released", |s| {
            s.stats().active.load(Ordering::Relaxed) == 0
        });
    }
    // Regions not aligned to their huge pages are refused; the server goes on.
    let running = Running::start(raw_file(dir.path(), &data), BlockSize::default());
    let vm = Vm::huge(&[2 * MIB]);
    let base = vm.maps[0].as_ptr() as u64;
    let json = format!(
        r#"[{{"base_host_virt_addr":{base},"size":2097152,"offset":4096,"page_size":2097152,"page_size_kib":2097152}}]"#
    );
    let stream = vm.connect(&running.socket, &json);
    assert!(closed_by_server(&stream));
}

#[test]
fn server_serves_an_old_firecracker_from_a_compressed_store() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = image(6 * MIB, 2);
    let raw = dir.path().join("mem");
    std::fs::write(&raw, &data).unwrap();
    let store_dir = dir.path().join("store");
    let options = PackOptions {
        codec: Some(CodecConfig::new(Codec::Zstd { level: 3 })),
        block_size: Some(BlockSize::new(16 << 10).unwrap()),
        ..PackOptions::default()
    };
    pack_file(&raw, &store_dir, &options, &|_| {}).unwrap();
    let store = DiskStore::open_read_only(&store_dir).unwrap();
    let block_size = store.block_size();
    let running = Running::start(Arc::new(StoreSource::new(store)), block_size);
    let vm = Vm::new(&[6 * MIB]);
    // Before 1.7 Firecracker sent no page size fields.
    let _stream = vm.connect(&running.socket, &vm.json(false));
    assert!(vm.bytes(0) == &data[..]);
}

#[test]
fn server_serves_several_vms_at_once() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = image(4 * MIB, 3);
    let running = Running::start(raw_file(dir.path(), &data), BlockSize::default());
    std::thread::scope(|s| {
        for _ in 0..3 {
            let (socket, data) = (&running.socket, &data);
            s.spawn(move || {
                let vm = Vm::new(&[4 * MIB]);
                let _stream = vm.connect(socket, &vm.json(true));
                assert!(vm.bytes(0) == &data[..]);
            });
        }
    });
    assert_eq!(running.server.stats().vms.load(Ordering::Relaxed), 3);
}

#[test]
fn server_refuses_bad_handshakes_and_keeps_serving() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = image(2 * MIB, 4);
    let running = Running::start(raw_file(dir.path(), &data), BlockSize::default());
    let vm = Vm::new(&[2 * MIB]);
    let base = vm.maps[0].as_ptr() as u64;
    let fd = Some(vm.uffd.as_raw_fd());
    let cases: Vec<(String, Option<i32>)> = vec![
        ("this is not json".into(), fd),
        (vm.json(true), None),
        (
            format!(
                r#"[{{"base_host_virt_addr":{},"size":4096,"offset":0}}]"#,
                base + 1
            ),
            fd,
        ),
        (
            format!(
                r#"[{{"base_host_virt_addr":{base},"size":8192,"offset":0}},{{"base_host_virt_addr":{},"size":4096,"offset":8192}}]"#,
                base + 4096
            ),
            fd,
        ),
        (
            format!(r#"[{{"base_host_virt_addr":{base},"size":4194304,"offset":0}}]"#),
            fd,
        ),
    ];
    for (i, (json, fd)) in cases.iter().enumerate() {
        let stream = UnixStream::connect(&running.socket).unwrap();
        send(&stream, json.as_bytes(), *fd);
        assert!(closed_by_server(&stream), "case {i} was not refused");
        let expect = i as u64 + 1;
        running.wait_until("the refusal to be counted", |s| {
            s.stats().bad_handshakes.load(Ordering::Relaxed) == expect
        });
    }
    // A peer that disconnects before its handshake.
    drop(UnixStream::connect(&running.socket).unwrap());
    running.wait_until("the disconnect", |s| {
        s.stats().bad_handshakes.load(Ordering::Relaxed) == 6
    });
    // The server still serves a good VM.
    let _stream = vm.connect(&running.socket, &vm.json(true));
    assert!(vm.bytes(0) == &data[..]);
}

/// The "Firecracker" of the next tests: run as a child process so that it can be killed; its
/// RAM is of 2 MiB pages with `SERVER_TEST_HUGE` set.
#[test]
fn server_child_vm() {
    let Some(socket) = std::env::var_os("SERVER_TEST_SOCKET") else {
        return;
    };
    let vm = if std::env::var_os("SERVER_TEST_HUGE").is_some() {
        Vm::huge(&[8 * MIB])
    } else {
        Vm::new(&[4 * MIB])
    };
    let _stream = vm.connect(Path::new(&socket), &vm.json(true));
    // Touch everything; the corrupt block never arrives.
    let sum: u64 = vm.bytes(0).iter().map(|&b| u64::from(b)).sum();
    println!("read everything: {sum}");
}

#[test]
fn server_kills_the_vm_rather_than_serve_a_corrupt_block() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("mem");
    std::fs::write(&raw, image(4 * MIB, 5)).unwrap();
    let store_dir = dir.path().join("store");
    pack_file(&raw, &store_dir, &PackOptions::default(), &|_| {}).unwrap();
    // Flip a byte in the middle of the segment: some block's checksum fails.
    let segment = std::fs::read_dir(&store_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("seg-"))
        .unwrap();
    let mut bytes = std::fs::read(&segment).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&segment, &bytes).unwrap();

    let store = DiskStore::open_read_only(&store_dir).unwrap();
    let block_size = store.block_size();
    let running = Running::start(Arc::new(StoreSource::new(store)), block_size);
    expect_child_vm_killed(&running, false);
}

/// Runs `server_child_vm` against `running` and expects it killed (`SIGKILL`) before it read
/// everything, and the server's one kill counted.
fn expect_child_vm_killed(running: &Running, huge: bool) {
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "server_child_vm",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SERVER_TEST_SOCKET", &running.socket)
        .stdout(std::process::Stdio::piped());
    if huge {
        command.env("SERVER_TEST_HUGE", "1");
    }
    let mut child = command.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the VM with a corrupt block was neither served nor killed");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(
        !out.contains("read everything"),
        "the VM read bytes it should not have: {out}"
    );
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    assert_eq!(
        running.server.stats().peers_killed.load(Ordering::Relaxed),
        1
    );
}

#[test]
fn server_kills_a_huge_page_vm_whose_memory_file_shrank_and_lives_on() {
    if skip() {
        return;
    }
    let _lent = testkit::hugepages::HugePages::lend(8);
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("mem");
    std::fs::write(&raw, image(8 * MIB, 9)).unwrap();
    // Opened at 8 MiB, then cut to 2 MiB under the server: huge pages are installed straight
    // from a mapping of the file, and the pages past its new end are not there. A read of them
    // by the server would raise SIGBUS and kill it (and this test); `UFFDIO_COPY` reads them in
    // the kernel and fails instead, and the VM that cannot be served right is killed.
    let running = Running::start(
        Arc::new(RawFileSource::open(&raw).unwrap()),
        BlockSize::default(),
    );
    std::fs::OpenOptions::new()
        .write(true)
        .open(&raw)
        .unwrap()
        .set_len(2 * MIB as u64)
        .unwrap();
    expect_child_vm_killed(&running, true);
    // The server serves on: a VM within the file's first 2 MiB reads them right.
    let data = std::fs::read(&raw).unwrap();
    let vm = Vm::huge(&[2 * MIB]);
    let _stream = vm.connect(&running.socket, &vm.json(true));
    assert!(vm.bytes(0) == &data[..]);
}

/// Guest RAM as one memfd, shared with the server through the project's own handshake.
struct MemfdVm {
    ptr: *mut u8,
    len: usize,
    memfd: std::fs::File,
    uffd: Userfaultfd,
}

impl MemfdVm {
    /// Guest RAM of `len` bytes in a memfd sealed against shrinking, as the server requires.
    fn new(len: usize) -> Self {
        Self::with_memfd(len, len, true)
    }

    /// `len` bytes mapped from a memfd of `file_len` bytes, `F_SEAL_SHRINK`ed if `seal`.
    fn with_memfd(len: usize, file_len: usize, seal: bool) -> Self {
        use std::os::fd::FromRawFd;
        // SAFETY: creating, sizing and mapping our own memfd; all checked.
        let (ptr, memfd) = unsafe {
            let fd = libc::memfd_create(
                c"guest-ram".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            );
            assert!(fd >= 0);
            assert_eq!(
                libc::ftruncate(fd, libc::off_t::try_from(file_len).unwrap()),
                0
            );
            if seal {
                assert_eq!(libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
            }
            let ptr = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            assert_ne!(ptr, libc::MAP_FAILED);
            (ptr.cast::<u8>(), std::fs::File::from_raw_fd(fd))
        };
        let uffd = Userfaultfd::create(
            feature::EVENT_REMOVE | feature::MISSING_SHMEM | feature::MINOR_SHMEM,
        )
        .unwrap();
        let range = HostRange::new(HostAddr::from_ptr(ptr), len as u64).unwrap();
        // SAFETY: the mapping lives until the VM is dropped, after the server is done.
        unsafe { uffd.register(range, Mode::MISSING_MINOR).unwrap() };
        Self {
            ptr,
            len,
            memfd,
            uffd,
        }
    }

    fn connect(&self, socket: &Path) -> std::io::BufReader<UnixStream> {
        let stream = UnixStream::connect(socket).unwrap();
        let hello = format!(
            r#"{{"protocol":"pvisor-uffd/1","initial":"zero","regions":[{{"base_host_virt_addr":{},"size":{},"offset":0,"memfd":0}}]}}"#,
            self.ptr as u64, self.len
        );
        let iov = [IoSlice::new(hello.as_bytes())];
        let fds = [self.uffd.as_raw_fd(), self.memfd.as_raw_fd()];
        sendmsg::<()>(
            stream.as_raw_fd(),
            &iov,
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        std::io::BufReader::new(stream)
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: a live mapping of `len` bytes, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for MemfdVm {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn request(conn: &mut std::io::BufReader<UnixStream>, line: &str) -> serde_json::Value {
    use std::io::{BufRead, Write};
    conn.get_mut()
        .write_all(format!("{line}\n").as_bytes())
        .unwrap();
    let mut reply = String::new();
    conn.read_line(&mut reply).unwrap();
    serde_json::from_str(&reply).unwrap()
}

#[test]
fn server_offloads_and_loads_a_vm_through_its_own_protocol() {
    if skip() {
        return;
    }
    use std::io::BufRead;
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    // The server's restore image is irrelevant to a fresh VM (`initial: zero`).
    let running = Running::start(
        raw_file(dir.path(), &vec![0u8; 16 * MIB]),
        BlockSize::default(),
    );
    let mut vm = MemfdVm::new(16 * MIB);
    let mut conn = vm.connect(&running.socket);
    let mut hello = String::new();
    conn.read_line(&mut hello).unwrap();
    let hello: serde_json::Value = serde_json::from_str(&hello).unwrap();
    assert_eq!(hello["status"], "ok", "{hello}");
    assert_eq!(hello["value"]["protocol"], "pvisor-uffd/1");

    let data = image(16 * MIB, 9);
    vm.bytes().copy_from_slice(&data);
    assert!(vm.memfd.metadata().unwrap().blocks() * 512 >= 12 * MIB as u64);

    let store = dir.path().join("vm-ram");
    let reply = request(
        &mut conn,
        &format!(
            r#"{{"request_id":1,"op":"offload","dir":"{}","codec":"lz4"}}"#,
            store.display()
        ),
    );
    assert_eq!(reply["status"], "ok", "{reply}");
    assert_eq!(reply["request_id"], 1);
    assert_eq!(
        reply["value"]["pages_dropped"],
        (16 * MIB) as u64 / PAGE_SIZE
    );
    assert_eq!(
        vm.memfd.metadata().unwrap().blocks(),
        0,
        "the memfd still holds RAM"
    );

    // Faults bring it back from the store, byte for byte.
    assert!(vm.bytes()[..8 * MIB] == data[..8 * MIB]);
    let reply = request(&mut conn, r#"{"request_id":2,"op":"load","mode":"eager"}"#);
    assert_eq!(reply["status"], "ok", "{reply}");
    assert!(vm.bytes() == &data[..]);
    let stats = request(&mut conn, r#"{"request_id":3,"op":"stats"}"#);
    assert_eq!(
        stats["value"]["pages"]["resident"],
        (16 * MIB) as u64 / PAGE_SIZE,
        "{stats}"
    );
    assert!(
        stats["value"]["metrics"]["bytes_decompressed"]
            .as_u64()
            .unwrap()
            > 0
    );

    // Bad requests get an error reply, not a closed connection.
    let reply = request(
        &mut conn,
        r#"{"request_id":4,"op":"offload","dir":"/x","codec":"gzip"}"#,
    );
    assert_eq!(reply["status"], "error");
    assert!(
        reply["error"].as_str().unwrap().contains("unknown codec"),
        "{reply}"
    );
    let reply = request(&mut conn, "not json");
    assert_eq!(reply["status"], "error");
    // A store directory the VMM does not own (or a relative one) is refused.
    let foreign = dir.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
    for target in [foreign.display().to_string(), "relative-store".to_string()] {
        let reply = request(
            &mut conn,
            &format!(r#"{{"request_id":6,"op":"offload","dir":"{target}"}}"#),
        );
        assert_eq!(reply["status"], "error", "{target}: {reply}");
    }
    assert_eq!(std::fs::read_dir(&foreign).unwrap().count(), 0);
    let reply = request(&mut conn, r#"{"request_id":5,"op":"stats"}"#);
    assert_eq!(reply["status"], "ok");
}

// ---------------------------------------------------------------------------------------
// Hostile peers. Whatever a peer sends, it ends its own connection at most: other VMs go on
// being served with the right bytes and the server goes on accepting.

/// Held while this process forks, and while it holds a userfaultfd with `EVENT_FORK`: a
/// `fork()` then waits until someone reads the event, and nobody does (the server refuses it).
static FORK_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn fork_lock() -> std::sync::MutexGuard<'static, ()> {
    FORK_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `UFFD_EVENT_*` numbers, for fake event messages.
const EVENT_PAGEFAULT: u8 = 0x12;
const EVENT_FORK: u8 = 0x13;
const EVENT_REMOVE: u8 = 0x15;
/// `UFFD_FEATURE_EVENT_FORK` and `UFFD_FEATURE_EVENT_REMAP`.
const FEATURE_EVENT_FORK: u64 = 1 << 1;
const FEATURE_EVENT_REMAP: u64 = 1 << 2;

/// A fake `struct uffd_msg`: the event byte, then the first two words of its union.
fn fake_event(event: u8, a: u64, b: u64) -> [u8; 32] {
    let mut msg = [0u8; 32];
    msg[0] = event;
    msg[8..16].copy_from_slice(&a.to_le_bytes());
    msg[16..24].copy_from_slice(&b.to_le_bytes());
    msg
}

fn pipe() -> (std::fs::File, std::fs::File) {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors, which we own from here on.
    unsafe {
        assert_eq!(libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC), 0);
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    }
}

/// Runs the test `name` of this binary in a child process with `env` set, killed after
/// `timeout`: its exit status and output.
fn run_child(
    name: &str,
    env: (&str, &str),
    timeout: Duration,
) -> (std::process::ExitStatus, String) {
    let fork = fork_lock();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(env.0, env.1)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    drop(fork);
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    let _ = child.stdout.take().unwrap().read_to_string(&mut out);
    (status, out)
}

/// A Firecracker handshake for `vm` padded with an ignored field to `len` bytes, the padding
/// full of brackets and escaped quotes.
fn padded_json(vm: &Vm, len: usize) -> String {
    let json = vm.json(true);
    let head = &json[..json.len() - 2];
    let bare = format!(r#"{head},"pad":""}}]"#);
    let room = len - bare.len();
    let unit = "]}[{\\\"x";
    let mut filler = unit.repeat(room / unit.len());
    filler.push_str(&"x".repeat(room % unit.len()));
    format!(r#"{head},"pad":"{filler}"}}]"#)
}

#[test]
fn server_refuses_descriptors_that_are_not_userfaultfds() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = image(2 * MIB, 4);
    let running = Running::start(raw_file(dir.path(), &data), BlockSize::default());
    let vm = Vm::new(&[2 * MIB]);
    let json = vm.json(true);
    let (read_end, _write_end) = pipe();
    let null = std::fs::File::open("/dev/null").unwrap();
    // SAFETY: memfd_create with a valid name; checked.
    let memfd = unsafe { libc::memfd_create(c"not-a-uffd".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(memfd >= 0);
    // A userfaultfd whose API handshake was never done: the peer could still enable anything.
    // SAFETY: the userfaultfd system call takes only flags; checked.
    let raw_uffd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
    assert!(raw_uffd >= 0);
    let cases = [
        ("a pipe", read_end.as_raw_fd()),
        ("/dev/null", null.as_raw_fd()),
        ("a memfd", memfd),
        ("an uninitialised userfaultfd", raw_uffd as i32),
    ];
    for (i, (what, fd)) in cases.iter().enumerate() {
        let stream = UnixStream::connect(&running.socket).unwrap();
        send(&stream, json.as_bytes(), Some(*fd));
        assert!(
            closed_by_server(&stream),
            "{what} was accepted as a userfaultfd"
        );
        let expect = i as u64 + 1;
        running.wait_until("the refusal to be counted", |s| {
            s.stats().bad_handshakes.load(Ordering::Relaxed) == expect
        });
    }
    assert_eq!(running.server.stats().vms.load(Ordering::Relaxed), 0);
    let _stream = vm.connect(&running.socket, &json);
    assert!(vm.bytes(0) == &data[..]);
}

#[test]
fn server_refuses_userfaultfds_with_event_kinds_it_does_not_handle() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = image(2 * MIB, 5);
    let running = Running::start(raw_file(dir.path(), &data), BlockSize::default());
    let _fork = fork_lock();
    for (i, features) in [FEATURE_EVENT_FORK, FEATURE_EVENT_REMAP].iter().enumerate() {
        let vm = Vm::with_features(&[2 * MIB], feature::EVENT_REMOVE | features);
        let stream = vm.connect(&running.socket, &vm.json(true));
        assert!(
            closed_by_server(&stream),
            "a userfaultfd with features {features:#x} was accepted"
        );
        let expect = i as u64 + 1;
        running.wait_until("the refusal to be counted", |s| {
            s.stats().bad_handshakes.load(Ordering::Relaxed) == expect
        });
    }
    // UNMAP events are handled (as discards): such a VM is served.
    let vm = Vm::with_features(&[2 * MIB], feature::EVENT_REMOVE | (1 << 6));
    let stream = vm.connect(&running.socket, &vm.json(true));
    assert!(vm.bytes(0) == &data[..]);
    // Unmapping waits until the server has read the UNMAP event: unmap while it serves.
    drop(vm);
    drop(stream);
}

#[test]
fn server_accepts_handshakes_up_to_64_kib_in_one_or_several_writes() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = image(2 * MIB, 6);
    let running = Running::start(raw_file(dir.path(), &data), BlockSize::default());
    // One sendmsg of 60 KiB, as Firecracker would send a long region list.
    let vm = Vm::new(&[2 * MIB]);
    let json = padded_json(&vm, 60 << 10);
    assert_eq!(json.len(), 60 << 10);
    let _one = vm.connect(&running.socket, &json);
    running.wait_until("the 60 KiB handshake to be accepted", |s| {
        s.stats().vms.load(Ordering::Relaxed) == 1
    });
    assert!(vm.bytes(0) == &data[..], "a 60 KiB handshake in one write");
    // The same in pieces: the descriptor with the first bytes, the rest trickling in.
    let vm = Vm::new(&[2 * MIB]);
    let json = padded_json(&vm, 60 << 10);
    let mut stream = UnixStream::connect(&running.socket).unwrap();
    send(&stream, &json.as_bytes()[..1000], Some(vm.uffd.as_raw_fd()));
    for piece in json.as_bytes()[1000..].chunks(7 << 10) {
        std::thread::sleep(Duration::from_millis(20));
        std::io::Write::write_all(&mut stream, piece).unwrap();
    }
    running.wait_until("the split handshake to be accepted", |s| {
        s.stats().vms.load(Ordering::Relaxed) == 2
    });
    assert!(vm.bytes(0) == &data[..], "a 60 KiB handshake in pieces");
    assert_eq!(running.server.stats().vms.load(Ordering::Relaxed), 2);
    // Beyond the limit: refused.
    let vm = Vm::new(&[2 * MIB]);
    let stream = vm.connect(&running.socket, &padded_json(&vm, 70 << 10));
    assert!(closed_by_server(&stream));
}

#[test]
fn server_refuses_memfds_that_could_shrink_or_are_short() {
    if skip() {
        return;
    }
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let running = Running::start(
        raw_file(dir.path(), &vec![0u8; 4 * MIB]),
        BlockSize::default(),
    );
    let cases = [
        ("not sealed", MemfdVm::with_memfd(4 * MIB, 4 * MIB, false)),
        (
            "shorter than its region",
            MemfdVm::with_memfd(4 * MIB, MIB, true),
        ),
    ];
    for (i, (what, vm)) in cases.iter().enumerate() {
        let mut conn = vm.connect(&running.socket);
        let mut hello = String::new();
        let _ = conn.read_line(&mut hello);
        assert!(
            !hello.contains("\"ok\""),
            "a memfd {what} was accepted: {hello}"
        );
        let expect = i as u64 + 1;
        running.wait_until("the refusal to be counted", |s| {
            s.stats().bad_handshakes.load(Ordering::Relaxed) == expect
        });
    }
    let vm = MemfdVm::new(4 * MIB);
    let mut conn = vm.connect(&running.socket);
    let mut hello = String::new();
    conn.read_line(&mut hello).unwrap();
    assert!(hello.contains("\"ok\""), "{hello}");
}

#[test]
fn server_refuses_peers_of_other_uids() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let running = Running::start(raw_file(dir.path(), &image(MIB, 7)), BlockSize::default());
    testkit::open_to_everyone(&running.socket);
    let _fork = fork_lock();
    assert!(
        testkit::closed_for_nobody(&running.socket, 3),
        "a peer of another uid was not refused at once"
    );
}

#[test]
fn pool_refuses_peers_of_other_uids() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("pool.sock");
    let pool = uffd_pager::sharing::Running::start(&socket).unwrap();
    testkit::open_to_everyone(&socket);
    let refused = {
        let _fork = fork_lock();
        testkit::closed_for_nobody(&socket, 3)
    };
    drop(pool);
    assert!(refused, "a VM of another uid was let into the memory pool");
}

#[test]
fn pool_closes_connections_over_its_cap_and_serves_again_below_it() {
    use uffd_pager::sharing::MAX_PEERS;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("pool.sock");
    let pool = uffd_pager::sharing::Running::start(&socket).unwrap();
    // Whether the pool closed `stream` (EOF) rather than waiting for its hello.
    let closed = |stream: &mut UnixStream| {
        stream
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        matches!(stream.read(&mut [0u8; 1]), Ok(0))
    };
    let held: Vec<UnixStream> = (0..MAX_PEERS)
        .map(|_| UnixStream::connect(&socket).unwrap())
        .collect();
    // Every one of them is being served (a thread each) before the next comes.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut extra = UnixStream::connect(&socket).unwrap();
    while !closed(&mut extra) {
        assert!(
            Instant::now() < deadline,
            "a connection over the cap was served"
        );
        extra = UnixStream::connect(&socket).unwrap();
    }
    assert!(pool.server.stats().over_cap >= 1);
    drop(held);
    // Below the cap again: a new connection is served (it waits for its hello).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut again = UnixStream::connect(&socket).unwrap();
        if !closed(&mut again) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the pool still refuses after its peers left"
        );
    }
}

/// The child of the next test: binds the server again and again under umask 000 while a
/// thread watches the socket path; fails if the socket was ever seen with a mode that lets
/// others in.
#[test]
fn server_child_umask() {
    let Some(dir) = std::env::var_os("SERVER_TEST_UMASK") else {
        return;
    };
    use std::os::unix::fs::MetadataExt;
    // SAFETY: umask only changes this process's file creation mask.
    unsafe { libc::umask(0) };
    let dir = PathBuf::from(dir);
    let source = raw_file(&dir, &image(64 << 10, 8));
    let socket = dir.join("watched.sock");
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (socket, done) = (socket.clone(), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut seen = 0u64;
            while !done.load(Ordering::Relaxed) {
                if let Ok(meta) = std::fs::symlink_metadata(&socket) {
                    if meta.mode() & 0o077 != 0 {
                        return Some(meta.mode());
                    }
                    seen += 1;
                }
            }
            assert!(seen > 0, "the watcher never saw the socket");
            None
        })
    };
    for _ in 0..3000 {
        let server = Server::bind(
            &socket,
            Arc::clone(&source),
            ServerConfig {
                threads: 1,
                block_size: BlockSize::default(),
            },
        )
        .unwrap();
        drop(server);
    }
    done.store(true, Ordering::Relaxed);
    if let Some(mode) = watcher.join().unwrap() {
        panic!("the socket was visible with mode {mode:o}");
    }
    println!("never open to others");
}

#[test]
fn server_socket_is_private_from_its_creation_even_under_umask_000() {
    let dir = tempfile::tempdir().unwrap();
    let (status, out) = run_child(
        "server_child_umask",
        ("SERVER_TEST_UMASK", dir.path().to_str().unwrap()),
        Duration::from_secs(120),
    );
    assert!(
        status.success() && out.contains("never open to others"),
        "{status:?}: {out}"
    );
}

/// The child of the next test: a victim VM keeps faulting and checking its bytes while
/// hostile peers do their worst on the same server; prints "victim intact" at the end.
#[test]
fn server_child_hostile() {
    if std::env::var_os("SERVER_TEST_HOSTILE").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = Arc::new(image(8 * MIB, 12));
    let running = Running::start(raw_file(dir.path(), &data), BlockSize::default());
    let socket = running.socket.clone();

    // The victim: reads its RAM a page at a time, slowly, checking every page.
    let victim_done = Arc::new(AtomicBool::new(false));
    let victim = {
        let (socket, data, done) = (socket.clone(), Arc::clone(&data), Arc::clone(&victim_done));
        std::thread::spawn(move || {
            let vm = Vm::new(&[8 * MIB]);
            let _stream = vm.connect(&socket, &vm.json(true));
            for (page, chunk) in data.chunks(PAGE_SIZE as usize).enumerate() {
                let at = page * PAGE_SIZE as usize;
                assert!(
                    &vm.bytes(0)[at..at + chunk.len()] == chunk,
                    "victim page {page} is wrong"
                );
                std::thread::sleep(Duration::from_micros(1500));
            }
            done.store(true, Ordering::Relaxed);
            vm.bytes(0) == &data[..]
        })
    };
    std::thread::sleep(Duration::from_millis(100));

    // 1. A pipe as the userfaultfd, then fake events: FORKs naming every descriptor number
    // (the listener, the victim's uffd...), faults and a REMOVE on the victim's addresses.
    let decoy = Vm::new(&[2 * MIB]);
    let (read_end, mut write_end) = pipe();
    let hostile = UnixStream::connect(&socket).unwrap();
    send(
        &hostile,
        decoy.json(true).as_bytes(),
        Some(read_end.as_raw_fd()),
    );
    std::thread::sleep(Duration::from_millis(50));
    let base = decoy.maps[0].as_ptr() as u64;
    let mut events = Vec::new();
    for fd in 0..1024u64 {
        events.extend_from_slice(&fake_event(EVENT_FORK, fd, 0));
    }
    events.extend_from_slice(&fake_event(EVENT_PAGEFAULT, 0, base));
    events.extend_from_slice(&fake_event(EVENT_REMOVE, base, base + 2 * MIB as u64));
    let _ = std::io::Write::write_all(&mut write_end, &events);

    // 2. /dev/null as the userfaultfd.
    let null = std::fs::File::open("/dev/null").unwrap();
    let null_peer = UnixStream::connect(&socket).unwrap();
    send(
        &null_peer,
        decoy.json(true).as_bytes(),
        Some(null.as_raw_fd()),
    );

    // 3. A real userfaultfd with EVENT_FORK.
    let forky = Vm::with_features(&[2 * MIB], feature::EVENT_REMOVE | FEATURE_EVENT_FORK);
    let _forky_stream = forky.connect(&socket, &forky.json(true));

    // 4. A memfd shorter than its region, then an offload (SIGBUS in the server, before).
    let short = MemfdVm::with_memfd(4 * MIB, MIB, false);
    let mut conn = short.connect(&socket);
    let mut hello = String::new();
    let _ = std::io::BufRead::read_line(&mut conn, &mut hello);
    if hello.contains("\"ok\"") {
        let store = dir.path().join("short-store");
        let line = format!(
            r#"{{"request_id":1,"op":"offload","dir":"{}"}}"#,
            store.display()
        );
        let _ = std::io::Write::write_all(conn.get_mut(), format!("{line}\n").as_bytes());
        let mut reply = String::new();
        let _ = std::io::BufRead::read_line(&mut conn, &mut reply);
    }

    // 5. A flood of connections that never send anything.
    let flood: Vec<UnixStream> = (0..300)
        .map(|_| UnixStream::connect(&socket).unwrap())
        .collect();

    // 6. A 60 KiB handshake in pieces, from a VM that must still be served.
    let late = Vm::new(&[2 * MIB]);
    let json = padded_json(&late, 60 << 10);
    let mut late_stream = UnixStream::connect(&socket).unwrap();
    send(
        &late_stream,
        &json.as_bytes()[..500],
        Some(late.uffd.as_raw_fd()),
    );
    for piece in json.as_bytes()[500..].chunks(9 << 10) {
        std::thread::sleep(Duration::from_millis(10));
        std::io::Write::write_all(&mut late_stream, piece).unwrap();
    }
    assert!(late.bytes(0) == &data[..2 * MIB], "the split-handshake VM");

    // The victim finishes with every byte right, and a new VM is served during the flood.
    assert!(victim.join().unwrap(), "the victim's RAM is wrong");
    assert!(victim_done.load(Ordering::Relaxed));
    let fresh = Vm::new(&[8 * MIB]);
    let _fresh_stream = fresh.connect(&socket, &fresh.json(true));
    assert!(fresh.bytes(0) == &data[..], "a VM after the attacks");
    drop(flood);
    assert!(closed_by_server(&null_peer));
    println!("victim intact");
}

#[test]
fn server_hostile_peers_never_touch_a_victim_vm() {
    if skip() {
        return;
    }
    let (status, out) = run_child(
        "server_child_hostile",
        ("SERVER_TEST_HOSTILE", "1"),
        Duration::from_secs(60),
    );
    assert!(
        status.success() && out.contains("victim intact"),
        "{status:?}: {out}"
    );
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;
    use uffd_pager::pager::{Pager, PagerConfig, RamKind, RegionSpec};
    use uffd_pager::server::protocol;

    /// An in-process pager over a small anonymous mapping, to answer request lines.
    struct Target {
        pager: Option<Pager>,
        /// Declared after the pager, so unmapped after it is gone.
        _ram: Mapping,
    }

    impl Target {
        fn new() -> Self {
            let len = 256 << 10;
            let ram = Mapping::anon(len);
            let range = HostRange::new(HostAddr::from_ptr(ram.as_ptr()), len as u64).unwrap();
            let spec = RegionSpec {
                kind: RamKind::Anon,
                range,
                image_offset: 0,
                memfd: None,
                memfd_offset: 0,
                view: Some(range.start()),
            };
            // SAFETY: the mapping lives until `Target` is dropped, after the pager.
            let pager = unsafe {
                Pager::new(vec![spec], PagerConfig::default(), None, Box::new(|_| {})).unwrap()
            };
            Self {
                pager: Some(pager),
                _ram: ram,
            }
        }
    }

    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("null".to_string()),
            Just("-1".to_string()),
            Just("1e300".to_string()),
            Just("18446744073709551615".to_string()),
            Just("18446744073709551616".to_string()),
            Just("3000".to_string()),
            Just("0".to_string()),
            Just(r#""x""#.to_string()),
            Just("[]".to_string()),
            Just("{}".to_string()),
            (0u64..10).prop_map(|n| n.to_string()),
        ]
    }

    fn line() -> impl Strategy<Value = String> {
        let op = prop_oneof![
            Just("stats"),
            Just("offload"),
            Just("load"),
            Just("wait_prefetch"),
            Just("explode"),
        ];
        let text = prop_oneof![
            Just(r#""lazy""#.to_string()),
            Just(r#""eager""#.to_string()),
            Just(r#""faults""#.to_string()),
            Just(r#""zstd:99""#.to_string()),
            Just(r#""zstd:-5""#.to_string()),
            Just(r#""lz4""#.to_string()),
            // Offload stores that cannot be created: the handler is fuzzed, not the disk.
            "[a-z]{0,8}".prop_map(|s| format!(r#""/proc/uffd-fuzz/{s}""#)),
            value(),
        ];
        let field = (
            prop_oneof![
                Just("mode"),
                Just("threads"),
                Just("codec"),
                Just("dir"),
                Just("request_id"),
                Just("zzz"),
            ],
            prop_oneof![text, value()],
        )
            .prop_map(|(k, v)| format!(r#""{k}":{v}"#));
        let structured =
            (value(), op, prop::collection::vec(field, 0..4)).prop_map(|(id, op, fields)| {
                let mut all = vec![format!(r#""request_id":{id}"#), format!(r#""op":"{op}""#)];
                all.extend(fields);
                format!("{{{}}}", all.join(","))
            });
        prop_oneof![
            structured,
            prop::collection::vec(any::<u8>(), 0..200)
                .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        ]
    }

    thread_local! {
        static TARGET: Target = Target::new();
    }

    proptest! {
        #[test]
        fn fuzz_protocol_request_lines_get_one_json_reply(line in line()) {
            if skip() {
                return Ok(());
            }
            TARGET.with(|target| {
                let pager = target.pager.as_ref().expect("alive until drop");
                let reply = protocol::handle(pager, &line, nix::unistd::geteuid().as_raw());
                prop_assert!(!reply.contains('\n'), "{}", reply);
                let reply: serde_json::Value = serde_json::from_str(&reply)
                    .map_err(|e| TestCaseError::fail(format!("{e}: {reply}")))?;
                let status = reply["status"].as_str().unwrap_or_default();
                prop_assert!(status == "ok" || status == "error", "{}", reply);
                if let Ok(request) = serde_json::from_str::<protocol::Request>(&line) {
                    prop_assert_eq!(reply["request_id"].as_u64(), Some(request.request_id));
                } else {
                    prop_assert_eq!(status, "error");
                }
                Ok(())
            })?;
        }
    }
}

#[test]
fn server_idle_handshakes_over_the_cap_push_the_oldest_out_and_a_vm_still_gets_through() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = image(4 * MIB, 5);
    let running = Running::start(raw_file(dir.path(), &data), BlockSize::default());
    let stats = || running.server.stats();
    let in_handshake = |s: &Server| s.stats().handshaking.load(Ordering::Relaxed);
    let cap = usize::try_from(MAX_HANDSHAKES).unwrap();
    // Same-uid peers that connect and send nothing: each holds a handshake place.
    let idle: Vec<UnixStream> = (0..cap)
        .map(|_| UnixStream::connect(&running.socket).unwrap())
        .collect();
    running.wait_until("the idle connections to be in their handshake", |s| {
        in_handshake(s) == MAX_HANDSHAKES
    });
    // Six more: the six oldest are closed at once, not held for the handshake timeout.
    let newer: Vec<UnixStream> = (0..6)
        .map(|_| UnixStream::connect(&running.socket).unwrap())
        .collect();
    for (n, oldest) in idle[..6].iter().enumerate() {
        assert!(
            closed_within(oldest, Duration::from_secs(3)),
            "idle connection {n} was not pushed out"
        );
    }
    assert!(!closed_within(&idle[6], Duration::from_millis(100)));
    assert!(!closed_within(&newer[5], Duration::from_millis(100)));
    assert_eq!(stats().handshakes_pushed_out.load(Ordering::Relaxed), 6);
    assert_eq!(in_handshake(&running.server), MAX_HANDSHAKES);
    // Every place is held by an idle peer, and a VM is still served at once.
    let vm = Vm::new(&[4 * MIB]);
    let started = Instant::now();
    let stream = vm.connect(&running.socket, &vm.json(true));
    assert!(vm.bytes(0) == &data[..]);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the VM waited for the idle peers"
    );
    assert_eq!(stats().handshakes_pushed_out.load(Ordering::Relaxed), 7);
    // An attached VM holds no handshake place.
    running.wait_until("the VM to leave its handshake", |s| {
        in_handshake(s) == MAX_HANDSHAKES - 1
    });
    assert_eq!(stats().active.load(Ordering::Relaxed), 1);
    drop((idle, newer));
    running.wait_until("the idle connections to be closed", |s| {
        in_handshake(s) == 0
    });
    drop(stream);
    running.wait_until("the VM to be released", |s| {
        s.stats().active.load(Ordering::Relaxed) == 0
    });
}

/// `uffd-pager pack --store s3://…` uploads an image, `info` and `verify` read it back, and
/// `serve --store s3://…` restores a Firecracker VM from it on "another host": a cache of its
/// own, the packing host's cache deleted, a fresh process. A chunk corrupted in the bucket
/// then fails `verify`.
#[test]
fn the_binary_packs_into_an_object_store_and_a_firecracker_vm_restores_from_it() {
    if skip() {
        return;
    }
    let server = testkit::s3::S3Server::start();
    server.create_bucket("snapshots");
    let dir = tempfile::tempdir().unwrap();
    let data = image(6 * MIB, 9);
    let raw = dir.path().join("mem");
    std::fs::write(&raw, &data).unwrap();
    let endpoint = server.endpoint();
    let url = "s3://snapshots/fc/vm-1";
    let cli = |cache: &str, args: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_uffd-pager"));
        cmd.args(args)
            .args(["--s3-endpoint", &endpoint, "--s3-retry-timeout", "3"])
            .arg("--cache")
            .arg(dir.path().join(cache))
            .envs(server.env());
        cmd
    };
    let succeed = |cache: &str, args: &[&str]| -> String {
        let out = cli(cache, args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let raw_arg = raw.to_str().unwrap();
    let said = succeed(
        "cache-a",
        &[
            "pack",
            "--mem-file",
            raw_arg,
            "--store",
            url,
            "--codec",
            "lz4",
        ],
    );
    assert!(said.contains("uploaded"), "{said}");
    std::fs::remove_dir_all(dir.path().join("cache-a")).unwrap();
    let info = succeed("cache-b", &["info", "--store", url, "--json"]);
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["image_size"], 6 * MIB as u64);
    assert_eq!(info["store"], url);

    let socket = dir.path().join("fc.sock");
    // `serve` of the store on the cache `cache`, its log to `stderr`.
    let serve = |cache: &str, extra: &[&str], stderr: std::process::Stdio| {
        let mut args = vec![
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--store",
            url,
        ];
        args.extend_from_slice(extra);
        testkit::KillOnDrop(
            cli(cache, &args)
                .stdout(std::process::Stdio::null())
                .stderr(stderr)
                .spawn()
                .unwrap(),
        )
    };
    let mut child = serve("cache-b", &[], std::process::Stdio::null());
    let deadline = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "the server did not listen");
        assert!(child.0.try_wait().unwrap().is_none(), "the server exited");
        std::thread::sleep(Duration::from_millis(20));
    }
    let vm = Vm::new(&[2 * MIB, 4 * MIB]);
    let stream = vm.connect(&socket, &vm.json(true));
    assert!(vm.bytes(0) == &data[..2 * MIB]);
    assert!(vm.bytes(1) == &data[2 * MIB..]);
    drop(stream);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.0.id().cast_signed(), libc::SIGTERM) };
    let status = child.0.wait().unwrap();
    assert!(
        status.success() || status.signal() == Some(libc::SIGTERM),
        "{status:?}"
    );

    // With --s3-fetch-rest, the server fetches the whole store in the background from its
    // start (a fresh cache again): once that is done, the VM's faults ask the bucket nothing.
    let log_path = dir.path().join("serve-rest.log");
    let started = server.requests();
    let mut child = serve(
        "cache-e",
        &["--s3-fetch-rest"],
        std::fs::File::create(&log_path).unwrap().into(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        assert!(
            Instant::now() < deadline,
            "the background fetch did not end:\n{log}"
        );
        assert!(
            child.0.try_wait().unwrap().is_none(),
            "the server exited:\n{log}"
        );
        if socket.exists() && log.contains("the background fetch is done") {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let fetched = server.requests() - started;
    // The index, then a few coalesced range requests for 6 MiB in 64 KiB blocks.
    assert!(fetched <= 8, "{fetched} requests");
    let before = server.requests();
    let vm = Vm::new(&[2 * MIB, 4 * MIB]);
    let stream = vm.connect(&socket, &vm.json(true));
    assert!(vm.bytes(0) == &data[..2 * MIB]);
    assert!(vm.bytes(1) == &data[2 * MIB..]);
    assert_eq!(
        server.requests(),
        before,
        "the faults were served from the cache"
    );
    drop(stream);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.0.id().cast_signed(), libc::SIGTERM) };
    child.0.wait().unwrap();

    succeed("cache-c", &["verify", "--store", url]);
    let chunk = server.keys("snapshots", "fc/vm-1/seg-").pop().unwrap();
    let path = server.object_path("snapshots", &chunk);
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let out = cli("cache-d", &["verify", "--store", url])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(said.contains("bad block"), "{said}");
}
