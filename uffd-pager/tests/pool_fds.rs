//! The memory pool daemon keeps no descriptor of a VM that left: a long-running pool that VM
//! after VM connects to and leaves must not run out of descriptors. Alone in its test binary,
//! so that the process's descriptor count is this test's own.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

#[test]
fn pool_connections_that_left_hold_no_descriptor() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("pool.sock");
    let server = Arc::new(uffd_pager::pool::PoolServer::bind(&socket).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let thread = {
        let (server, stop) = (Arc::clone(&server), Arc::clone(&stop));
        std::thread::spawn(move || server.run(&stop))
    };
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
    stop.store(true, Ordering::Relaxed);
    thread.join().unwrap();
    assert!(
        now <= before + 8,
        "{VMS} VMs came and went and the pool holds {} more descriptors",
        now - before
    );
}
