//! The memory pool keeps no descriptor it should not: the daemon none of a VM that left (a
//! long-running pool that VM after VM connects to and leaves must not run out of them), a VM
//! none a hostile daemon pushes on it. In a test binary of their own, one at a time, so that
//! the process's descriptor count is the running test's own.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use uffd_pager::sharing::Running;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// The process's descriptor count once `done` holds of it, or after 20 s.
fn wait_for(done: impl Fn(usize) -> bool) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut fds = open_fds();
    while !done(fds) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        fds = open_fds();
    }
    fds
}

/// The tests of this file count the process's descriptors: one at a time.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ALONE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn pool_connections_that_left_hold_no_descriptor() {
    let _alone = alone();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("pool.sock");
    let pool = Running::start(&socket).unwrap();
    let before = open_fds();
    const VMS: usize = 200;
    let clients: Vec<UnixStream> = (0..VMS)
        .map(|_| UnixStream::connect(&socket).unwrap())
        .collect();
    // Each accepted connection costs the pool its stream and the clone `disconnect_all` needs:
    // wait until all of them are in, so that what follows measures what the pool keeps.
    let accepted = wait_for(|fds| fds >= before + 3 * VMS);
    assert!(
        accepted >= before + 3 * VMS,
        "the pool accepted only part of {VMS} connections in time"
    );
    drop(clients);
    // Each connection's thread sees its end of file and ends.
    let now = wait_for(|fds| fds <= before + 8);
    drop(pool);
    assert!(
        now <= before + 8,
        "{VMS} VMs came and went and the pool holds {} more descriptors",
        now - before
    );
}

#[test]
fn pool_client_given_more_than_one_descriptor_refuses_and_keeps_none() {
    use std::io::BufRead;
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("fake.sock");
    let _alone = alone();
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    // Counted with the listener, which the daemon closes when it ends.
    let before = open_fds();
    // A daemon that answers the attach with two memfds where one is expected.
    let daemon = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut line = String::new();
        std::io::BufReader::new(&stream)
            .read_line(&mut line)
            .unwrap();
        let memfds: Vec<std::os::fd::OwnedFd> = (0..2)
            .map(|_| {
                nix::sys::memfd::memfd_create(c"extra", nix::sys::memfd::MFdFlags::empty()).unwrap()
            })
            .collect();
        let raw: Vec<i32> = memfds.iter().map(AsRawFd::as_raw_fd).collect();
        nix::sys::socket::sendmsg::<()>(
            stream.as_raw_fd(),
            &[std::io::IoSlice::new(b"{}\n")],
            &[nix::sys::socket::ControlMessage::ScmRights(&raw)],
            nix::sys::socket::MsgFlags::empty(),
            None,
        )
        .unwrap();
        // Held open until the client is done with the reply.
        let mut rest = String::new();
        let _ = std::io::BufReader::new(&stream).read_line(&mut rest);
    });
    let attached = uffd_pager::sharing::PoolClient::attach(&socket, 0, 1 << 20);
    let error = attached.expect_err("a reply with two descriptors was taken");
    assert!(
        error.to_string().contains("more than one descriptor"),
        "{error}"
    );
    daemon.join().unwrap();
    let after = open_fds();
    assert!(
        after <= before,
        "the refused reply's descriptors stayed open ({before} before, {after} after)"
    );
}
