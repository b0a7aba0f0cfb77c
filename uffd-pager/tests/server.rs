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
use uffd_pager::addr::{HostAddr, HostRange, PAGE_SIZE};
use uffd_pager::server::{Server, ServerConfig};
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
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Guest memory the way Firecracker has it: private anonymous regions registered on a uffd.
struct Vm {
    maps: Vec<(*mut u8, usize)>,
    uffd: Userfaultfd,
}

// SAFETY: plain memory mappings; the tests synchronise access themselves.
unsafe impl Send for Vm {}

impl Vm {
    fn new(sizes: &[usize]) -> Self {
        let uffd = Userfaultfd::create(feature::EVENT_REMOVE).unwrap();
        let maps = sizes
            .iter()
            .map(|&len| {
                // SAFETY: a fresh private anonymous mapping, checked below.
                let ptr = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                        -1,
                        0,
                    )
                };
                assert_ne!(ptr, libc::MAP_FAILED);
                let range = HostRange::new(HostAddr::from_ptr(ptr), len as u64).unwrap();
                // SAFETY: the mapping lives until `Vm` is dropped, after the server is done.
                unsafe { uffd.register(range, Mode::MISSING).unwrap() };
                (ptr.cast::<u8>(), len)
            })
            .collect();
        Self { maps, uffd }
    }

    /// The Firecracker 1.12 handshake: regions laid end to end in the file.
    fn json(&self, page_size_fields: bool) -> String {
        let mut offset = 0;
        let regions: Vec<String> = self
            .maps
            .iter()
            .map(|&(ptr, len)| {
                let sizes = if page_size_fields {
                    r#","page_size":4096,"page_size_kib":4096"#
                } else {
                    ""
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
        let (ptr, len) = self.maps[region];
        // SAFETY: a live mapping of `len` bytes; reading it faults to the server.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        for &(ptr, len) in &self.maps {
            // SAFETY: unmapping our own mappings.
            unsafe { libc::munmap(ptr.cast(), len) };
        }
    }
}

fn send(stream: &UnixStream, bytes: &[u8], fd: Option<i32>) {
    let iov = [IoSlice::new(bytes)];
    let fds = fd.map(|fd| [fd]);
    let cmsgs: Vec<ControlMessage<'_>> = fds.iter().map(|f| ControlMessage::ScmRights(f)).collect();
    sendmsg::<()>(stream.as_raw_fd(), &iov, &cmsgs, MsgFlags::empty(), None).unwrap();
}

/// True once the server has closed the connection.
fn closed_by_server(mut stream: &UnixStream) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 16];
    matches!(stream.read(&mut buf), Ok(0))
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
    let (ptr, _) = vm.maps[1];
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
    let base = vm.maps[0].0 as u64;
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

/// The "Firecracker" of the next test: run as a child process so that it can be killed.
#[test]
fn server_child_vm() {
    let Some(socket) = std::env::var_os("SERVER_TEST_SOCKET") else {
        return;
    };
    let vm = Vm::new(&[4 * MIB]);
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
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "server_child_vm",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SERVER_TEST_SOCKET", &running.socket)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
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
        "the VM read a corrupt block: {out}"
    );
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    assert_eq!(
        running.server.stats().peers_killed.load(Ordering::Relaxed),
        1
    );
}

/// Guest RAM as one memfd, shared with the server through the project's own handshake.
struct MemfdVm {
    ptr: *mut u8,
    len: usize,
    memfd: std::fs::File,
    uffd: Userfaultfd,
}

impl MemfdVm {
    fn new(len: usize) -> Self {
        use std::os::fd::FromRawFd;
        // SAFETY: creating, sizing and mapping our own memfd; all checked.
        let (ptr, memfd) = unsafe {
            let fd = libc::memfd_create(c"guest-ram".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, libc::off_t::try_from(len).unwrap()), 0);
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
    let reply = request(&mut conn, r#"{"request_id":5,"op":"stats"}"#);
    assert_eq!(reply["status"], "ok");
}
