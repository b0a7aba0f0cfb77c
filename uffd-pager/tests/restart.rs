//! Restarting `uffd-pager serve` under a VM in the middle of its restore: the server is killed
//! (`SIGKILL`) or upgraded (`SIGTERM`) while a child process playing Firecracker touches its
//! 64 MiB region; a new server on the same keeper must let the restore finish with the image's
//! bytes, and ranges the child discarded before must read as zeros.
//!
//! The child is this test binary run again (`vmm_child_serves_commands_when_spawned`): it maps
//! its region, creates a userfaultfd with `UFFD_FEATURE_EVENT_REMOVE`, registers it MISSING and
//! sends the Firecracker handshake (JSON regions + the uffd), exactly as `tests/server.rs`
//! does, then obeys one command per line on stdin and answers `vmm: …` lines on stdout.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, IoSlice, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use testkit::Mapping;
use uffd_pager::addr::{HostAddr, HostRange, PAGE_SIZE};
use uffd_pager::journal::Journal;
use uffd_pager::server::handover::image_id;
use uffd_pager::server::handshake;
use uffd_pager::server::keeper::KeeperClient;
use uffd_pager::state::PageState;
use uffd_pager::uffd::{feature, Mode, Userfaultfd};

const MIB: usize = 1 << 20;
const IMAGE: usize = 64 * MIB;
const PAGES: usize = IMAGE / PAGE_SIZE as usize;
/// How long the child may take for anything; longer means its guest froze.
const PATIENCE: Duration = Duration::from_secs(20);

fn skip() -> bool {
    testkit::skip_unless(&["/dev/userfaultfd"])
}

/// An image where every page differs from every other and from zeros.
fn image(len: usize) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    (0..len / 8)
        .flat_map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state ^ i as u64 | 1).to_le_bytes()
        })
        .collect()
}

/// The processes of one test: a keeper, a server, the VMM child, in a temporary directory.
struct Rig {
    dir: tempfile::TempDir,
    keeper: Child,
    server: Option<Child>,
    servers_started: usize,
}

impl Rig {
    fn new() -> Self {
        Self::with_keeper_args(&[])
    }

    /// A rig whose keeper also holds the socket VMMs connect to (`keeper --listen`).
    fn with_listening_keeper() -> Self {
        let rig = Self::with_keeper_args(&["--listen", "uffd.sock"]);
        assert!(rig.socket().exists(), "the keeper does not listen for VMMs");
        rig
    }

    fn with_keeper_args(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("mem"), image(IMAGE)).unwrap();
        let keeper = spawn_listening(
            Command::new(env!("CARGO_BIN_EXE_uffd-pager"))
                .current_dir(dir.path())
                .args(["keeper", "--socket"])
                .arg(dir.path().join("keeper.sock"))
                .args(extra),
            &dir.path().join("keeper.log"),
        );
        Self {
            dir,
            keeper,
            server: None,
            servers_started: 0,
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("uffd.sock")
    }

    fn keeper_socket(&self) -> PathBuf {
        self.dir.path().join("keeper.sock")
    }

    /// Starts a server on the keeper; returns once it listens (VMs held are taken over).
    fn start_server(&mut self) {
        assert!(self.server.is_none());
        self.servers_started += 1;
        let log = self
            .dir
            .path()
            .join(format!("server-{}.log", self.servers_started));
        self.server = Some(spawn_listening(
            Command::new(env!("CARGO_BIN_EXE_uffd-pager"))
                .args(["serve", "--socket"])
                .arg(self.socket())
                .arg("--mem-file")
                .arg(self.dir.path().join("mem"))
                .arg("--keeper")
                .arg(self.keeper_socket()),
            &log,
        ));
    }

    fn server_log(&self) -> String {
        let log = format!("server-{}.log", self.servers_started);
        std::fs::read_to_string(self.dir.path().join(log)).unwrap_or_default()
    }

    /// Kills the server with `signal` and waits for it to exit (within `PATIENCE`).
    fn stop_server(&mut self, signal: nix::sys::signal::Signal) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.server.as_ref().unwrap().id().cast_signed());
        nix::sys::signal::kill(pid, signal).unwrap();
        // A server stopped with SIGSTOP takes the signal when it runs again.
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
        let mut server = self.server.take().unwrap();
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = server.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = server.kill();
                panic!("the server did not stop on {signal}: {}", self.server_log());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A rig with a server and a VMM whose first 64 pages are restored.
    fn serving() -> (Self, Vmm) {
        let mut rig = Self::new();
        rig.start_server();
        let mut vmm = rig.vmm();
        vmm.run("touch 0 64 1");
        (rig, vmm)
    }

    fn vmm(&self) -> Vmm {
        Vmm::spawn(&self.socket(), &self.dir.path().join("mem"))
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if let Some(mut server) = self.server.take() {
            let _ = server.kill();
            let _ = server.wait();
        }
        let _ = self.keeper.kill();
        let _ = self.keeper.wait();
    }
}

/// Spawns a command that prints its socket's path once it listens; waits for that line.
fn spawn_listening(command: &mut Command, log: &Path) -> Child {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(
        !line.is_empty(),
        "{command:?} did not start: {}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    child
}

/// The VMM child, driven by lines.
struct Vmm {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    progress: Arc<AtomicU64>,
    /// The longest read of one page in the last `touch`, µs.
    longest: Arc<AtomicU64>,
}

impl Vmm {
    fn spawn(socket: &Path, mem: &Path) -> Self {
        let mut vmm = Self::start(socket, mem, false);
        assert_eq!(vmm.reply("the handshake"), "ready");
        vmm
    }

    /// A VMM that connects and waits for [`Vmm::send_handshake`] before it sends anything.
    fn spawn_connected(socket: &Path, mem: &Path) -> Self {
        let mut vmm = Self::start(socket, mem, true);
        assert_eq!(vmm.reply("the connection"), "connected");
        vmm
    }

    fn send_handshake(&mut self) {
        self.send("handshake");
        assert_eq!(self.reply("the handshake"), "ready");
    }

    fn start(socket: &Path, mem: &Path, wait: bool) -> Self {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args([
                "--exact",
                "vmm_child_serves_commands_when_spawned",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("RESTART_VMM_SOCKET", socket)
            .env("RESTART_VMM_IMAGE", mem);
        if wait {
            command.env("RESTART_VMM_WAIT", "1");
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        let progress = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&progress);
        let longest = Arc::new(AtomicU64::new(0));
        let longest_seen = Arc::clone(&longest);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                // The test harness may have started the line with the test's name.
                let Some(at) = line.find("vmm: ") else {
                    continue;
                };
                let line = &line[at..];
                if let Some(n) = line.strip_prefix("vmm: progress ") {
                    seen.fetch_add(n.parse().unwrap_or(0), Ordering::Relaxed);
                } else if let Some(us) = line.strip_prefix("vmm: longest ") {
                    longest_seen.store(us.parse().unwrap_or(u64::MAX), Ordering::Relaxed);
                } else if let Some(reply) = line.strip_prefix("vmm: ") {
                    if tx.send(reply.to_string()).is_err() {
                        return;
                    }
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
            progress,
            longest,
        }
    }

    fn send(&mut self, command: &str) {
        writeln!(self.stdin, "{command}").unwrap();
    }

    /// The next reply, or a panic naming `what` if none comes in time (a frozen guest).
    fn reply(&mut self, what: &str) -> String {
        match self.lines.recv_timeout(PATIENCE) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => {
                panic!("{what}: no answer in {PATIENCE:?}: the guest froze")
            }
            Err(RecvTimeoutError::Disconnected) => {
                panic!("{what}: the VMM died ({:?})", self.child.try_wait())
            }
        }
    }

    /// The next reply; `None` if the VMM died first (a panic if none comes in time).
    fn try_reply(&mut self) -> Option<String> {
        match self.lines.recv_timeout(PATIENCE) {
            Ok(line) => Some(line),
            Err(RecvTimeoutError::Timeout) => {
                panic!("no answer in {PATIENCE:?}: the guest froze")
            }
            Err(RecvTimeoutError::Disconnected) => None,
        }
    }

    /// Runs a command and expects `ok`.
    fn run(&mut self, command: &str) {
        self.send(command);
        assert_eq!(self.reply(command), "ok", "{command}");
    }

    /// Waits for the child to exit (a refused VM's VMM is killed).
    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "the VMM was not refused");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The longest read of one page in the last `touch` that finished, µs.
    fn longest_us(&self) -> u64 {
        self.longest.load(Ordering::Relaxed)
    }

    /// Pages touched so far by running `touch` commands.
    fn progress(&self) -> u64 {
        self.progress.load(Ordering::Relaxed)
    }

    /// Waits until the child touched `pages` pages of a running `touch`.
    fn wait_progress(&self, pages: u64) {
        let deadline = Instant::now() + PATIENCE;
        while self.progress() < pages {
            assert!(Instant::now() < deadline, "the restore does not progress");
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Kills (`SIGKILL`) or upgrades (`SIGTERM`) the server while the child touches its whole
/// region, starts a new one, and checks that the restore finishes with the image's bytes.
fn restart_mid_restore(signal: nix::sys::signal::Signal) {
    // A `kill -9` lands inside the read marker's window (a read of events not yet journaled)
    // a few times in a thousand while four threads fault (docs/pager.md); the next server
    // then rightly refuses the VM. That is a correct outcome but not the one this test is
    // about: try again, a few times at most; wrong bytes fail at once whatever the attempt.
    for _ in 0..3 {
        if restart_mid_restore_once(signal) {
            return;
        }
    }
    panic!("three kills in a row landed inside the read marker's window");
}

/// One restore stopped by `signal` in its middle; false if the next server refused the VM
/// because the kill landed inside the read marker's window.
fn restart_mid_restore_once(signal: nix::sys::signal::Signal) -> bool {
    let mut rig = Rig::new();
    rig.start_server();
    let mut vmm = rig.vmm();
    vmm.send(&format!("touch 0 {PAGES} 4"));
    vmm.wait_progress(PAGES as u64 / 4);
    let status = rig.stop_server(signal);
    let at_stop = vmm.progress();
    assert!(
        at_stop < PAGES as u64,
        "the restore had finished before the server stopped ({status:?})"
    );
    if signal == nix::sys::signal::Signal::SIGTERM {
        assert!(
            status.success(),
            "the upgrade did not exit cleanly: {status:?}"
        );
        assert!(
            rig.server_log().contains("left to the keeper"),
            "{}",
            rig.server_log()
        );
    } else {
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }
    rig.start_server();
    let Some(rest) = vmm.try_reply() else {
        let log = rig.server_log();
        assert!(
            signal == nix::sys::signal::Signal::SIGKILL
                && log.contains("died while reading its events"),
            "the VMM died after the restart: {log}"
        );
        return false;
    };
    assert_eq!(rest, "ok", "{}", rig.server_log());
    assert!(
        rig.server_log().contains("took a VM over"),
        "{}",
        rig.server_log()
    );
    eprintln!("stopped at {at_stop} of {PAGES} pages");
    true
}

#[test]
fn restart_upgrade_stalls_the_guests_faults_briefly() {
    if skip() {
        return;
    }
    let mut rig = Rig::new();
    rig.start_server();
    let mut vmm = rig.vmm();
    vmm.send(&format!("touch 0 {PAGES} 1"));
    vmm.wait_progress(PAGES as u64 / 4);
    // An upgrade as a service manager does it: SIGTERM, the old server's exit, the new one.
    let started = Instant::now();
    let status = rig.stop_server(nix::sys::signal::Signal::SIGTERM);
    let exited = started.elapsed();
    rig.start_server();
    let listening = started.elapsed();
    assert_eq!(vmm.reply("the restore"), "ok", "{}", rig.server_log());
    assert!(status.success(), "{status:?}");
    let longest = vmm.longest_us();
    eprintln!(
        "upgrade: the old server exited {:.1} ms after SIGTERM, the new one listened at {:.1} ms; \
         the guest's longest page read {:.1} ms",
        exited.as_secs_f64() * 1e3,
        listening.as_secs_f64() * 1e3,
        longest as f64 / 1e3
    );
    // Loose bounds for a shared machine (docs/bench/pager.md has the figures): the old server's
    // loops used to find the stop by polls of 50 and 200 ms; now an event ends each at once.
    assert!(
        exited < Duration::from_millis(150),
        "the old server took {exited:?} to exit"
    );
    assert!(longest < 1_000_000, "a fault waited {longest} µs");
}

/// A VMM that connects while its server is down waits in the keeper's backlog: stopped with
/// SIGSTOP (so the connection is never accepted), then killed with `signal`, the server is
/// replaced, and the next one serves the VM from its first fault.
fn vmm_connecting_while_the_server_is_down(signal: nix::sys::signal::Signal) {
    let mut rig = Rig::with_listening_keeper();
    rig.start_server();
    let pid = nix::unistd::Pid::from_raw(rig.server.as_ref().unwrap().id().cast_signed());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let mut vmm = rig.vmm();
    let status = rig.stop_server(signal);
    assert!(
        status.success() || status.signal() == Some(libc::SIGKILL),
        "{status:?}: {}",
        rig.server_log()
    );
    rig.start_server();
    vmm.run(&format!("touch 0 {PAGES} 2"));
    // The socket is the keeper's: the servers leave its path in place.
    assert!(rig.socket().exists());
}

#[test]
fn restart_vmm_connecting_while_the_server_is_killed_waits_for_the_next() {
    if skip() {
        return;
    }
    vmm_connecting_while_the_server_is_down(nix::sys::signal::Signal::SIGKILL);
}

#[test]
fn restart_vmm_connecting_while_the_server_is_upgraded_waits_for_the_next() {
    if skip() {
        return;
    }
    vmm_connecting_while_the_server_is_down(nix::sys::signal::Signal::SIGTERM);
}

/// A connection the server accepted and held at the keeper, its handshake not yet sent, when
/// the server is killed (`-9`): the next server takes it from the keeper, reads its handshake
/// and serves the VM.
#[test]
fn restart_connection_accepted_before_its_handshake_survives_a_kill() {
    if skip() {
        return;
    }
    let mut rig = Rig::with_listening_keeper();
    rig.start_server();
    let mut vmm = Vmm::spawn_connected(&rig.socket(), &rig.dir.path().join("mem"));
    // The server accepts it at once and holds it at the keeper before it reads anything: a
    // connection it had accepted and not handed over would die with it, and the VMM would
    // freeze. (Were it still in the backlog, the next server would accept it: the test cannot
    // fail for that, only pass for the wrong reason, which this pause makes unlikely.)
    std::thread::sleep(Duration::from_millis(300));
    let status = rig.stop_server(nix::sys::signal::Signal::SIGKILL);
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    rig.start_server();
    vmm.send_handshake();
    vmm.run(&format!("touch 0 {PAGES} 2"));
    assert!(
        rig.server_log().contains("serving a VM"),
        "{}",
        rig.server_log()
    );
}

#[test]
fn restart_serve_refuses_a_socket_other_than_the_keepers() {
    let rig = Rig::with_listening_keeper();
    let output = Command::new(env!("CARGO_BIN_EXE_uffd-pager"))
        .args(["serve", "--socket"])
        .arg(rig.dir.path().join("other.sock"))
        .arg("--mem-file")
        .arg(rig.dir.path().join("mem"))
        .arg("--keeper")
        .arg(rig.keeper_socket())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("give the keeper's"), "{stderr}");
}

#[test]
fn restart_kill_mid_restore_completes_with_image_bytes() {
    if skip() {
        return;
    }
    restart_mid_restore(nix::sys::signal::Signal::SIGKILL);
}

#[test]
fn restart_upgrade_mid_restore_completes_with_image_bytes() {
    if skip() {
        return;
    }
    restart_mid_restore(nix::sys::signal::Signal::SIGTERM);
}

/// `RESTART_KILLS` (default 50) kills at random points of restores: each VM either
/// completes with the image's bytes or is refused (the kill landed inside an unjournaled read
/// of events). Prints how many were refused. A measurement: run it on its own.
#[test]
#[ignore = "a measurement: cargo test --release --test restart -- --ignored --nocapture"]
fn restart_random_kills_complete_or_are_refused() {
    if skip() {
        return;
    }
    let kills: u32 = std::env::var("RESTART_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let mut rig = Rig::new();
    let (mut completed, mut refused) = (0, 0);
    let mut seed = 0x2545_F491_4F6C_DD1D_u64;
    for _ in 0..kills {
        rig.start_server();
        let mut vmm = rig.vmm();
        vmm.send(&format!("touch 0 {PAGES} 4"));
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        vmm.wait_progress(PAGES as u64 / 20 + seed % (PAGES as u64 * 17 / 20));
        rig.stop_server(nix::sys::signal::Signal::SIGKILL);
        rig.start_server();
        match vmm.lines.recv_timeout(PATIENCE) {
            Ok(line) => {
                assert_eq!(line, "ok");
                completed += 1;
            }
            Err(RecvTimeoutError::Disconnected) => {
                assert_eq!(vmm.wait_exit().signal(), Some(libc::SIGKILL));
                refused += 1;
            }
            Err(RecvTimeoutError::Timeout) => panic!("the guest froze"),
        }
        drop(vmm);
        rig.stop_server(nix::sys::signal::Signal::SIGKILL);
    }
    eprintln!("{kills} kills mid-restore: {completed} completed, {refused} refused");
}

/// `RESTART_CONNECT_KILLS` (default 6 in the suite) servers killed, by `-9` and SIGTERM in
/// turn, at a random moment around a VMM's connection (before it connects, while it waits in
/// the keeper's backlog, accepted, in its handshake, attached): every VMM is served by the next
/// server with the image's bytes, or killed with a reason (its handshake read by the server
/// that died), never left frozen.
#[test]
fn restart_random_kills_around_the_connection_serve_or_refuse_every_vm() {
    if skip() {
        return;
    }
    let kills: u32 = std::env::var("RESTART_CONNECT_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let mut rig = Rig::with_listening_keeper();
    let (mut served, mut refused) = (0, 0);
    let mut seed = 0x9E37_79B9_7F4A_7C15_u64;
    for kill in 0..kills {
        rig.start_server();
        let mut vmm = Vmm::start(&rig.socket(), &rig.dir.path().join("mem"), false);
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        // The child takes some milliseconds to start and connect: 0–30 ms covers each moment.
        std::thread::sleep(Duration::from_micros(seed % 30_000));
        let signal = if kill % 2 == 0 {
            nix::sys::signal::Signal::SIGKILL
        } else {
            nix::sys::signal::Signal::SIGTERM
        };
        rig.stop_server(signal);
        rig.start_server();
        assert_eq!(vmm.reply("the handshake"), "ready");
        vmm.send("touch 0 64 1");
        match vmm.lines.recv_timeout(PATIENCE) {
            Ok(line) => {
                assert_eq!(line, "ok", "{}", rig.server_log());
                served += 1;
            }
            Err(RecvTimeoutError::Disconnected) => {
                assert_eq!(vmm.wait_exit().signal(), Some(libc::SIGKILL));
                assert!(
                    rig.server_log().contains("killing the VMM"),
                    "{}",
                    rig.server_log()
                );
                refused += 1;
            }
            Err(RecvTimeoutError::Timeout) => panic!("the guest froze: {}", rig.server_log()),
        }
        drop(vmm);
        rig.stop_server(nix::sys::signal::Signal::SIGKILL);
    }
    eprintln!("{kills} kills around a connection: {served} served, {refused} refused");
}

#[test]
fn restart_kill_after_discard_serves_zeros_there() {
    if skip() {
        return;
    }
    let mut rig = Rig::new();
    rig.start_server();
    let mut vmm = rig.vmm();
    let half = PAGES / 2;
    vmm.run(&format!("touch 0 {half} 1"));
    // A balloon-style discard of touched pages and of pages never touched.
    vmm.run("discard 100 300");
    vmm.run(&format!("discard {} {}", half + 100, half + 400));
    // A discard returns once the server has read its event, which is before the server has
    // journaled it: a kill right now would land in the read marker's window, and the VM would
    // be refused (rightly). A fault served after it (one fault thread) says the discards are in
    // the journal.
    vmm.run(&format!("touch {half} {} 1", half + 1));
    rig.stop_server(nix::sys::signal::Signal::SIGKILL);
    rig.start_server();
    vmm.run("zeros 100 300");
    vmm.run(&format!("zeros {} {}", half + 100, half + 400));
    vmm.run("touch 0 100 1");
    vmm.run(&format!("touch 300 {} 1", half + 100));
    vmm.run(&format!("touch {} {PAGES} 2", half + 400));
    // And the same again across an upgrade.
    vmm.run("discard 1000 1010");
    rig.stop_server(nix::sys::signal::Signal::SIGTERM);
    rig.start_server();
    vmm.run("zeros 1000 1010");
    vmm.run("touch 1010 2000 1");
    // A discard while no server runs waits for its event to be read: by the next server.
    rig.stop_server(nix::sys::signal::Signal::SIGKILL);
    vmm.send("discard 3000 3100");
    std::thread::sleep(Duration::from_millis(50));
    rig.start_server();
    assert_eq!(vmm.reply("a discard across a restart"), "ok");
    vmm.run("zeros 3000 3100");
    vmm.run("touch 3100 3200 1");
}

#[test]
fn restart_upgrade_with_keeper_gone_serves_on() {
    if skip() {
        return;
    }
    let (mut rig, mut vmm) = Rig::serving();
    let _ = rig.keeper.kill();
    let _ = rig.keeper.wait();
    let server = rig.server.as_ref().unwrap();
    let pid = nix::unistd::Pid::from_raw(server.id().cast_signed());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    // No keeper to leave the VM to: the server goes on serving it.
    vmm.run(&format!("touch 64 {PAGES} 2"));
    assert!(
        rig.server_log().contains("the keeper is gone"),
        "{}",
        rig.server_log()
    );
    assert!(rig.server.as_mut().unwrap().try_wait().unwrap().is_none());
}

/// The keeper holding the VMM socket dies under a running server: killed (`-9`), its socket's
/// path stays and the server, which holds the listening descriptor too, serves a VMM that
/// connects after; stopped cleanly (SIGTERM), it removes the path, and the server serves on
/// the VMs it has while a new VMM finds no socket to connect to.
fn keeper_with_vmm_socket_dies(signal: nix::sys::signal::Signal) {
    let mut rig = Rig::with_listening_keeper();
    rig.start_server();
    let mut first = rig.vmm();
    first.run("touch 0 64 1");
    let keeper = nix::unistd::Pid::from_raw(rig.keeper.id().cast_signed());
    nix::sys::signal::kill(keeper, signal).unwrap();
    let _ = rig.keeper.wait();
    first.run(&format!("touch 64 {PAGES} 2"));
    if signal == nix::sys::signal::Signal::SIGKILL {
        let mut second = rig.vmm();
        second.run(&format!("touch 0 {PAGES} 2"));
    } else {
        assert!(!rig.socket().exists(), "the keeper left its socket behind");
        assert!(UnixStream::connect(rig.socket()).is_err());
    }
    assert!(rig.server.as_mut().unwrap().try_wait().unwrap().is_none());
}

#[test]
fn restart_keeper_killed_leaves_the_server_serving_old_and_new_vms() {
    if skip() {
        return;
    }
    keeper_with_vmm_socket_dies(nix::sys::signal::Signal::SIGKILL);
}

#[test]
fn restart_keeper_stopped_leaves_the_server_serving_its_vms() {
    if skip() {
        return;
    }
    keeper_with_vmm_socket_dies(nix::sys::signal::Signal::SIGTERM);
}

#[test]
fn restart_upgrade_ends_pvisor_sessions_with_an_error() {
    if skip() {
        return;
    }
    let mut rig = Rig::new();
    rig.start_server();
    let mem = Mapping::anon(4 * MIB);
    let uffd = Userfaultfd::create(feature::EVENT_REMOVE).unwrap();
    // SAFETY: the mapping outlives the server's use of it (this test's end).
    unsafe { uffd.register(mem.range(), Mode::MISSING).unwrap() };
    let hello = format!(
        r#"{{"protocol":"pvisor-uffd/1","regions":[{{"base_host_virt_addr":{},"size":{},"offset":0}}]}}"#,
        mem.as_ptr() as u64,
        mem.len()
    );
    let stream = UnixStream::connect(rig.socket()).unwrap();
    let fds = [uffd.as_raw_fd()];
    sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(hello.as_bytes())],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )
    .unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut lines = BufReader::new(&stream).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.contains("\"ok\""), "{first}");
    let status = rig.stop_server(nix::sys::signal::Signal::SIGTERM);
    assert!(status.success(), "{status:?}");
    let last = lines.next().unwrap().unwrap();
    assert!(last.contains("not handed over"), "{last}");
    assert!(lines.next().is_none(), "the connection stayed open");
}

#[test]
fn restart_serve_with_no_keeper_listening_fails_to_start() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("mem"), vec![0u8; MIB]).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_uffd-pager"))
        .args(["serve", "--socket"])
        .arg(dir.path().join("uffd.sock"))
        .arg("--mem-file")
        .arg(dir.path().join("mem"))
        .arg("--keeper")
        .arg(dir.path().join("no-keeper.sock"))
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("cannot attach to the keeper"), "{stderr}");
    assert!(
        !dir.path().join("uffd.sock").exists(),
        "the socket was left behind"
    );
}

#[test]
fn restart_on_another_image_is_refused() {
    if skip() {
        return;
    }
    let (mut rig, mut vmm) = Rig::serving();
    rig.stop_server(nix::sys::signal::Signal::SIGKILL);
    // The memory file is replaced (same size, other bytes) before the restart.
    let mem = rig.dir.path().join("mem");
    let mut other = image(IMAGE);
    other.reverse();
    std::fs::write(mem.with_extension("new"), other).unwrap();
    std::fs::rename(mem.with_extension("new"), &mem).unwrap();
    vmm.send("touch 64 128 1");
    rig.start_server();
    let status = vmm.wait_exit();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    let log = rig.server_log();
    assert!(log.contains("it was restored from image"), "{log}");
}

/// Plays an old server: takes the VMM's handshake, lets `before_death` act on the VM (its
/// uffd, the region's base address, the journal), hands the VM to the keeper and dies.
fn old_server_died(
    rig: &Rig,
    before_death: impl FnOnce(&mut Vmm, &Userfaultfd, u64, &Journal),
) -> Vmm {
    use std::os::fd::AsFd;
    let listener = UnixListener::bind(rig.socket()).unwrap();
    let (socket, mem) = (rig.socket(), rig.dir.path().join("mem"));
    let spawn = std::thread::spawn(move || Vmm::spawn(&socket, &mem));
    let (conn, _) = listener.accept().unwrap();
    let received = handshake::receive(&conn, Duration::from_secs(10)).unwrap();
    let handshake::Message::Firecracker(regions) = received.message else {
        panic!("not a Firecracker handshake");
    };
    let mut vmm = spawn.join().unwrap();
    let uffd = Userfaultfd::from_fd(received.uffd);
    let journal = Journal::create(PAGES as u64, PageState::Source).unwrap();
    before_death(&mut vmm, &uffd, regions[0].base_host_virt_addr, &journal);
    let keeper = KeeperClient::attach(&rig.keeper_socket(), Duration::from_secs(5)).unwrap();
    let image = image_id(&rig.dir.path().join("mem"), false).unwrap();
    let meta = serde_json::json!({"session": "firecracker", "regions": regions, "image": image});
    keeper
        .hold(meta, conn.as_fd(), uffd.as_fd(), journal.fd(), None)
        .unwrap();
    drop((keeper, conn, uffd, journal, listener));
    std::fs::remove_file(rig.socket()).unwrap();
    vmm
}

#[test]
fn restart_journal_with_read_marker_set_is_refused() {
    if skip() {
        return;
    }
    let mut rig = Rig::new();
    // As a server killed inside a read of its events leaves it.
    let mut vmm = old_server_died(&rig, |_, _, _, journal| journal.begin_read());
    vmm.send("touch 0 16 1");
    rig.start_server();
    let status = vmm.wait_exit();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    let log = rig.server_log();
    assert!(log.contains("cannot take the VM over"), "{log}");
    assert!(log.contains("died while reading its events"), "{log}");
}

#[test]
fn restart_journal_with_unprovable_states_is_refused() {
    if skip() {
        return;
    }
    let mut rig = Rig::new();
    // A page whose bytes were in the dead server's offload store.
    let mut vmm = old_server_died(&rig, |_, _, _, journal| {
        journal.slots()[7].store(PageState::Stored as u8, Ordering::Relaxed);
    });
    rig.start_server();
    let status = vmm.wait_exit();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    let log = rig.server_log();
    assert!(log.contains("states it cannot prove"), "{log}");
}

#[test]
fn restart_fault_read_and_pages_installed_by_the_dead_server_are_served() {
    if skip() {
        return;
    }
    let mut rig = Rig::new();
    let data = image(IMAGE);
    let page = PAGE_SIZE as usize;
    let mut vmm = old_server_died(&rig, |vmm, uffd, base, _| {
        // The old server reads the child's first fault and dies before resolving it, after
        // installing pages 64..128 that its journal does not say are resident yet.
        vmm.send("touch 0 128 1");
        let mut events = Vec::new();
        let deadline = Instant::now() + PATIENCE;
        while events.is_empty() {
            assert!(Instant::now() < deadline, "no fault came");
            uffd.poll(None, 100).unwrap();
            uffd.read_events(&mut events).unwrap();
        }
        assert!(matches!(
            events[0],
            uffd_pager::uffd::Event::Pagefault { .. }
        ));
        let installed = uffd
            .copy_missing(
                HostAddr(base + 64 * PAGE_SIZE),
                &data[64 * page..128 * page],
                basics::PageSize::BASE,
                false,
            )
            .unwrap();
        assert_eq!(installed, 64 * PAGE_SIZE);
    });
    rig.start_server();
    // Without the wake, the child's read fault stays asleep for good.
    assert_eq!(
        vmm.reply("the fault the old server read"),
        "ok",
        "{}",
        rig.server_log()
    );
    vmm.run(&format!("touch 0 {PAGES} 2"));
}

/// How often a kill at a random moment of a busy restore lands inside a read of events that
/// is not yet journaled (such a VM is refused on takeover): the share of samples with the read
/// marker set while four threads fault 64 MiB in through an in-process pager with a journal.
#[test]
fn journal_marker_window_share_is_small_during_a_restore() {
    if skip() {
        return;
    }
    let data = image(IMAGE);
    let source_dir = tempfile::tempdir().unwrap();
    let path = source_dir.path().join("mem");
    std::fs::write(&path, &data).unwrap();
    let source: Arc<dyn uffd_pager::source::PageSource> =
        Arc::new(uffd_pager::source::RawFileSource::open(&path).unwrap());
    let mut rounds = Vec::new();
    for _ in 0..3 {
        let mem = Mapping::anon(IMAGE);
        let journal = Arc::new(Journal::create(PAGES as u64, PageState::Source).unwrap());
        let spec = uffd_pager::pager::RegionSpec {
            kind: uffd_pager::pager::RamKind::Anon,
            range: mem.range(),
            image_offset: 0,
            memfd: None,
            memfd_offset: 0,
            view: Some(mem.range().start()),
        };
        let config = uffd_pager::pager::PagerConfig {
            initial: PageState::Source,
            ..Default::default()
        };
        // SAFETY: `mem` is mapped in this process and outlives the pager; only the pager and
        // the reads below touch it.
        let pager = unsafe {
            uffd_pager::pager::Pager::with_journal(
                Userfaultfd::create(uffd_pager::pager::FEATURES).unwrap(),
                true,
                vec![spec],
                config,
                Some(Arc::clone(&source)),
                Box::new(|_| {}),
                Some(Arc::clone(&journal)),
            )
            .unwrap()
        };
        let done = AtomicBool::new(false);
        let (samples, marked) = std::thread::scope(|s| {
            let sampler = s.spawn(|| {
                let (mut samples, mut marked) = (0u64, 0u64);
                while !done.load(Ordering::Relaxed) {
                    samples += 1;
                    marked += u64::from(journal.read_in_progress());
                }
                (samples, marked)
            });
            let quarter = IMAGE / 4;
            let touchers: Vec<_> = (0..4)
                .map(|t| {
                    let (mem, data) = (&mem, &data);
                    s.spawn(move || {
                        let range = t * quarter..(t + 1) * quarter;
                        assert!(mem.bytes()[range.clone()] == data[range]);
                    })
                })
                .collect();
            for toucher in touchers {
                toucher.join().unwrap();
            }
            done.store(true, Ordering::Relaxed);
            sampler.join().unwrap()
        });
        drop(pager);
        rounds.push(marked as f64 / samples.max(1) as f64);
    }
    eprintln!(
        "share of a busy restore inside an unjournaled read: {:?}",
        rounds
            .iter()
            .map(|r| format!("{:.2}%", r * 100.0))
            .collect::<Vec<_>>()
    );
    let mean = rounds.iter().sum::<f64>() / rounds.len() as f64;
    assert!(
        mean < 0.5,
        "the read marker is set {:.0}% of the time",
        mean * 100.0
    );
}

/// Helpers on the test VM's memory.
trait MappingExt {
    fn range(&self) -> HostRange;
}

impl MappingExt for Mapping {
    fn range(&self) -> HostRange {
        HostRange::new(HostAddr::from_ptr(self.as_ptr()), self.len() as u64).unwrap()
    }
}

#[test]
fn keeper_refuses_servers_of_other_uids() {
    if skip() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let rig = Rig::new();
    // Only the keeper's own credential check stands in the way of uid 65534.
    std::fs::set_permissions(rig.dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    std::fs::set_permissions(rig.keeper_socket(), std::fs::Permissions::from_mode(0o666)).unwrap();
    let output = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "probe_child_connects_when_spawned",
            "--nocapture",
        ])
        .env("RESTART_PROBE_SOCKET", rig.keeper_socket())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("probe: closed"), "{stdout}");
    let log = std::fs::read_to_string(rig.dir.path().join("keeper.log")).unwrap();
    assert!(log.contains("runs as uid 65534"), "{log}");
}

/// The other-uid child of the test above: connects, says whether the keeper closed the
/// connection without a word.
#[test]
fn probe_child_connects_when_spawned() {
    let Some(socket) = std::env::var_os("RESTART_PROBE_SOCKET") else {
        return;
    };
    let Ok(mut stream) = UnixStream::connect(socket) else {
        println!("probe: connect failed");
        return;
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut buf = [0u8; 64];
    match std::io::Read::read(&mut stream, &mut buf) {
        Ok(0) => println!("probe: closed"),
        Ok(n) => println!("probe: answered {n} bytes"),
        Err(e) => println!("probe: {e}"),
    }
}

/// The VMM child's side: only when spawned by a test above (else it returns at once).
#[test]
fn vmm_child_serves_commands_when_spawned() {
    let (Some(socket), Some(image)) = (
        std::env::var_os("RESTART_VMM_SOCKET"),
        std::env::var_os("RESTART_VMM_IMAGE"),
    ) else {
        return;
    };
    let data = std::fs::read(image).unwrap();
    let mem = Mapping::anon(data.len());
    let uffd = Userfaultfd::create(feature::EVENT_REMOVE).unwrap();
    // SAFETY: the mapping lives until this process exits.
    unsafe { uffd.register(mem.range(), Mode::MISSING).unwrap() };
    let json = format!(
        r#"[{{"base_host_virt_addr":{},"size":{},"offset":0,"page_size":4096,"page_size_kib":4096}}]"#,
        mem.as_ptr() as u64,
        mem.len()
    );
    let stream = UnixStream::connect(socket).unwrap();
    if std::env::var_os("RESTART_VMM_WAIT").is_some() {
        // Connected; the handshake goes when the test says so.
        println!("vmm: connected");
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "handshake");
    }
    let fds = [uffd.as_raw_fd()];
    sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(json.as_bytes())],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )
    .unwrap();
    println!("vmm: ready");
    let page = PAGE_SIZE as usize;
    let out = std::sync::Mutex::new(std::io::stdout());
    let say = |line: String| {
        let mut out = out.lock().unwrap();
        writeln!(out, "vmm: {line}").unwrap();
        out.flush().unwrap();
    };
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| words.get(i).and_then(|w| w.parse::<usize>().ok()).unwrap();
        match words.first().copied() {
            // touch FIRST END THREADS: read every page, compare with the image, a little
            // slowly so that a restart lands in the middle.
            Some("touch") => {
                let (first, end, threads) = (num(1), num(2), num(3));
                let per = (end - first).div_ceil(threads);
                let bad = AtomicU64::new(0);
                let longest = AtomicU64::new(0);
                std::thread::scope(|s| {
                    for t in 0..threads {
                        let (mem, data, bad, say) = (&mem, &data, &bad, &say);
                        let longest = &longest;
                        s.spawn(move || {
                            let pages = first + t * per..(first + (t + 1) * per).min(end);
                            let mut count = 0;
                            for p in pages {
                                let at = p * page..(p + 1) * page;
                                let read = Instant::now();
                                let differs = mem.bytes()[at.clone()] != data[at];
                                let us = read.elapsed().as_micros() as u64;
                                longest.fetch_max(us, Ordering::Relaxed);
                                if differs {
                                    bad.fetch_add(1, Ordering::Relaxed);
                                }
                                count += 1;
                                if count == 64 {
                                    say("progress 64".into());
                                    count = 0;
                                    std::thread::sleep(Duration::from_millis(3));
                                }
                            }
                            say(format!("progress {count}"));
                        });
                    }
                });
                say(format!("longest {}", longest.load(Ordering::Relaxed)));
                match bad.load(Ordering::Relaxed) {
                    0 => say("ok".into()),
                    n => say(format!("{n} pages differ from the image")),
                }
            }
            Some("discard") => {
                let (first, end) = (num(1), num(2));
                // SAFETY: discarding pages of our own mapping.
                let rc = unsafe {
                    libc::madvise(
                        mem.as_ptr().add(first * page).cast(),
                        (end - first) * page,
                        libc::MADV_DONTNEED,
                    )
                };
                say(if rc == 0 {
                    "ok".into()
                } else {
                    "madvise failed".into()
                });
            }
            Some("zeros") => {
                let (first, end) = (num(1), num(2));
                let nonzero = mem.bytes()[first * page..end * page]
                    .chunks(page)
                    .filter(|p| p.iter().any(|&b| b != 0))
                    .count();
                say(match nonzero {
                    0 => "ok".into(),
                    n => format!("{n} discarded pages are not zeros"),
                });
            }
            _ => return,
        }
    }
}
