//! The pool's daemon (`uffd-pager serve --memory-pool`, `pvisor serve --memory-pool`): the
//! sealed memfd laid out like guest RAM, the candidates (one VM's hash per page index), and
//! the merges it orders once two VMs offer the same page; one thread per VM, at most
//! [`MAX_PEERS`].

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufRead, BufReader, IoSlice, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

use super::{
    errno, io, PageSet, PoolError, PoolStats, Reply, Request, MAX_CANDIDATES, MAX_PEERS, PAGE,
    POOL_SIZE,
};
use crate::socket::PeerPolicy;
use basics::RateLimit;

struct PoolPage {
    hash: u64,
    refs: u64,
}

#[derive(Default)]
struct Conn {
    pid: i32,
    /// The process's start time, to tell a reused pid apart.
    start: Option<u64>,
    ram_base: u64,
    pages: u64,
    merged: PageSet,
    pending: HashSet<u64>,
}

#[derive(Default)]
struct State {
    pages: HashMap<u64, PoolPage>,
    candidates: HashMap<u64, (u64, u64)>,
    conns: HashMap<u64, Conn>,
    /// VMs whose connection closed while their process still runs: they may still map
    /// their pool pages, so the references stay until the process is gone.
    orphans: Vec<Conn>,
    next_conn: u64,
    stats: PoolStats,
}

/// The pool daemon.
#[derive(Debug)]
pub struct PoolServer {
    listener: UnixListener,
    socket: PathBuf,
    inner: Arc<Inner>,
}

impl Drop for PoolServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
    }
}

struct Inner {
    memfd: File,
    read_only: File,
    state: Mutex<State>,
    /// A clone of each open connection, so that `disconnect_all` can shut them down; a
    /// connection's entry goes when its thread ends (else every VM that ever connected would
    /// keep a descriptor of the daemon until it runs out).
    streams: Mutex<HashMap<u64, UnixStream>>,
    /// The key of the next connection in `streams`.
    next_stream: std::sync::atomic::AtomicU64,
    peers: PeerPolicy,
    refusals: RateLimit,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner").finish_non_exhaustive()
    }
}

impl PoolServer {
    /// Creates the pool's memfd and listens on `socket` (a stale socket file is replaced).
    pub fn bind(socket: &Path) -> Result<Self, PoolError> {
        // SAFETY: memfd_create with a valid name; the result is checked.
        let fd = unsafe {
            libc::memfd_create(
                c"pvisor-memory-pool".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io("create the pool's memfd")(
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let memfd = unsafe { File::from_raw_fd(fd) };
        memfd
            .set_len(POOL_SIZE)
            .map_err(io("size the pool's memfd"))?;
        // Size-sealed: a VM's mapping can never lose its pages to a truncation.
        // SAFETY: fcntl on our own descriptor with integer arguments.
        let rc = unsafe {
            libc::fcntl(
                memfd.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            )
        };
        if rc != 0 {
            return Err(io("seal the pool's memfd")(std::io::Error::last_os_error()));
        }
        // VMs get a descriptor that cannot write the pool.
        let read_only = File::open(format!("/proc/self/fd/{}", memfd.as_raw_fd()))
            .map_err(io("reopen the pool's memfd read-only"))?;
        // Only this user's VMs may join (the daemon reads their memory): the socket is 0600
        // from its creation, and each peer's uid is checked too.
        let listener =
            crate::socket::bind_private(socket).map_err(io("listen on a private socket"))?;
        listener
            .set_nonblocking(true)
            .map_err(io("make the socket non-blocking"))?;
        Ok(Self {
            listener,
            socket: socket.to_path_buf(),
            inner: Arc::new(Inner {
                memfd,
                read_only,
                state: Mutex::new(State::default()),
                streams: Mutex::new(HashMap::new()),
                next_stream: std::sync::atomic::AtomicU64::new(0),
                peers: PeerPolicy::default(),
                refusals: RateLimit::new(20, Duration::from_secs(1)),
            }),
        })
    }

    /// Also lets VMs of these uids and gids join (the pool's own uid always may). Call before
    /// [`PoolServer::run`].
    pub fn allow_peers(mut self, policy: PeerPolicy) -> Result<Self, PoolError> {
        let inner = Arc::get_mut(&mut self.inner).ok_or_else(|| {
            PoolError::Protocol("the pool's peer policy is set before it runs".into())
        })?;
        inner.peers = policy;
        Ok(self)
    }

    /// The counters.
    pub fn stats(&self) -> PoolStats {
        self.inner.lock().stats
    }

    /// Bytes the pool's memfd holds.
    pub fn allocated_bytes(&self) -> u64 {
        self.inner
            .memfd
            .metadata()
            .map_or(0, |m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
    }

    /// Accepts VMs until `stop`; each is served on its own thread, at most [`MAX_PEERS`] at
    /// once.
    pub fn run(&self, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            match self.listener.accept() {
                Ok((stream, _)) if self.inner.streams().len() >= MAX_PEERS => {
                    self.inner.lock().stats.over_cap += 1;
                    // A peer can open connections as fast as it likes: the log has a few.
                    if self.inner.refusals.allow() {
                        tracing::warn!(
                            "memory pool: {MAX_PEERS} connections open already; closing a new one"
                        );
                    }
                    drop(stream);
                }
                Ok((stream, _)) => {
                    let key = self.inner.next_stream.fetch_add(1, Ordering::Relaxed);
                    if let Ok(clone) = stream.try_clone() {
                        self.inner.streams().insert(key, clone);
                    }
                    let inner = Arc::clone(&self.inner);
                    std::thread::spawn(move || {
                        inner.serve(stream);
                        inner.streams().remove(&key);
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    tracing::warn!("memory pool: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }
}

/// A pool bound at a socket, accepting on a thread of its own until [`Running::stop`] or
/// drop: for a process that embeds the pool beside its other work.
#[derive(Debug)]
pub struct Running {
    /// The pool (its counters, `disconnect_all`).
    pub server: Arc<PoolServer>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Running {
    /// Binds the pool at `socket` (see [`PoolServer::bind`]) and starts its accept loop.
    pub fn start(socket: &Path) -> Result<Self, PoolError> {
        let server = Arc::new(PoolServer::bind(socket)?);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (server, stop) = (Arc::clone(&server), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("memory-pool".into())
                .spawn(move || server.run(&stop))
                .map_err(io("start the pool's accept thread"))?
        };
        Ok(Self {
            server,
            stop,
            thread: Some(thread),
        })
    }

    /// Stops accepting (within the accept loop's 50 ms poll); connections open stay served.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The daemon's main loop: listens on `socket`, prints its path on stdout once it does, and
/// serves until SIGINT or SIGTERM (blocked here for the whole process, so call it before any
/// other thread starts). VMs that mapped pool pages keep them after it returns.
pub fn run_daemon(socket: &Path) -> Result<PoolStats, PoolError> {
    run_daemon_with(socket, PeerPolicy::default())
}

/// [`run_daemon`], also letting VMs of the uids and gids of `peers` join.
pub fn run_daemon_with(socket: &Path, peers: PeerPolicy) -> Result<PoolStats, PoolError> {
    use nix::sys::signal::{SigSet, Signal};
    // The daemon's memory counts against what the pool saves. An offer's lists are large and
    // short-lived, and glibc by default keeps freed memory in per-thread arenas and raises its
    // mmap threshold after the first large free: one arena, and large blocks always mapped (so
    // freeing them returns them), keep the daemon small (measured: 7 MiB of arenas after four
    // 64 MiB VMs offered their pages, without this).
    // SAFETY: mallopt only changes allocator parameters; called before the daemon's threads.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10);
    }
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    signals
        .thread_block()
        .map_err(errno("block SIGINT and SIGTERM"))?;
    let server = PoolServer::bind(socket)?.allow_peers(peers)?;
    crate::socket::announce(socket).map_err(io("write to stdout"))?;
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let accept = scope.spawn(|| server.run(&stop));
        let waited = signals.wait();
        stop.store(true, Ordering::Relaxed);
        let _ = accept.join();
        waited.map_err(errno("wait for a signal"))?;
        Ok(server.stats())
    })
}

impl PoolServer {
    /// Closes every VM's connection (what the daemon's exit does): VMs keep the pages they
    /// mapped and stop merging.
    pub fn disconnect_all(&self) {
        let streams = std::mem::take(&mut *self.inner.streams());
        for stream in streams.into_values() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Inner {
    fn streams(&self) -> std::sync::MutexGuard<'_, HashMap<u64, UnixStream>> {
        self.streams
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn serve(&self, stream: UnixStream) {
        let peer = match self.peers.check(&stream) {
            Ok(peer) => peer,
            Err(e) => {
                self.lock().stats.refused += 1;
                if self.refusals.allow() {
                    tracing::warn!("memory pool: {}", basics::error_chain(&e));
                }
                // `run` keeps a clone of the stream: shut it down, not only drop this one.
                let _ = stream.shutdown(std::net::Shutdown::Both);
                return;
            }
        };
        let id = {
            let mut state = self.lock();
            state.next_conn += 1;
            let id = state.next_conn;
            state.conns.insert(
                id,
                Conn {
                    pid: peer.pid,
                    start: process_start(peer.pid),
                    ..Conn::default()
                },
            );
            state.stats.vms += 1;
            id
        };
        if let Err(e) = self.conversation(id, &stream) {
            tracing::debug!("memory pool: VM {id} left: {e}");
        }
        self.detach(id);
    }

    fn conversation(&self, id: u64, stream: &UnixStream) -> Result<(), PoolError> {
        let mut reader = BufReader::new(stream.try_clone().map_err(io("clone the socket"))?);
        let mut writer = stream;
        let mut line = String::new();
        loop {
            line.clear();
            if reader.read_line(&mut line).map_err(io("read a request"))? == 0 {
                return Ok(());
            }
            let request: Request = match serde_json::from_str(&line) {
                Ok(r) => r,
                Err(e) => {
                    let reply = Reply {
                        error: Some(format!("bad request: {e}")),
                        ..Reply::default()
                    };
                    send_line(writer, &reply, None)?;
                    continue;
                }
            };
            match request {
                Request::Attach { ram_base, memory } => {
                    let reply = if memory > POOL_SIZE || memory % PAGE != 0 {
                        Reply {
                            error: Some(format!(
                                "{memory} bytes of RAM: the pool serves page multiples up to {POOL_SIZE}"
                            )),
                            ..Reply::default()
                        }
                    } else {
                        let mut state = self.lock();
                        let conn = state.conns.get_mut(&id).expect("this connection");
                        conn.ram_base = ram_base;
                        conn.pages = memory / PAGE;
                        conn.merged = PageSet::new(conn.pages);
                        Reply {
                            stats: state.stats,
                            ..Reply::default()
                        }
                    };
                    let fd = reply.error.is_none().then(|| self.read_only.as_raw_fd());
                    send_line(writer, &reply, fd)?;
                }
                Request::Offer { pages, released } => {
                    let reply = self.offer(id, &pages, &released);
                    drop((pages, released));
                    send_line(writer, &reply, None)?;
                    drop(reply);
                    line = String::new();
                    // An offer's lists are large and short-lived: give their memory back.
                    // SAFETY: malloc_trim only releases free memory of the allocator.
                    unsafe { libc::malloc_trim(0) };
                }
                Request::Merged { pages } => {
                    let reply = self.merged(id, &pages);
                    send_line(writer, &reply, None)?;
                }
            }
            writer.flush().map_err(io("write a reply"))?;
        }
    }

    fn offer(&self, id: u64, pages: &[(u64, u64)], released: &[u64]) -> Reply {
        let mut state = self.lock();
        let (pid, ram_base, limit) = match state.conns.get(&id) {
            Some(c) if c.pages > 0 => (c.pid, c.ram_base, c.pages),
            _ => {
                return Reply {
                    error: Some("attach first".into()),
                    ..Reply::default()
                }
            }
        };
        self.collect_orphans(&mut state);
        for &page in released {
            let had = state
                .conns
                .get_mut(&id)
                .is_some_and(|c| c.merged.remove(page));
            if had {
                self.unref(&mut state, page);
            }
        }
        let mut merge = Vec::new();
        let mut buf = vec![0u8; PAGE as usize];
        for &(page, hash) in pages {
            if page >= limit {
                continue;
            }
            if let Some(pooled) = state.pages.get(&page) {
                if pooled.hash == hash {
                    merge.push(page);
                }
                continue;
            }
            match state.candidates.get(&page).copied() {
                Some((theirs, other)) if theirs == hash && other != id => {
                    // A second VM holds the same bytes here: pool them, read from this VM
                    // (stopped while it waits for this reply).
                    if read_remote(pid, ram_base + page * PAGE, &mut buf).is_err()
                        || xxhash_rust::xxh3::xxh3_64(&buf) != hash
                    {
                        state.stats.mismatched += 1;
                        continue;
                    }
                    if self.memfd.write_all_at(&buf, page * PAGE).is_err() {
                        continue;
                    }
                    state.candidates.remove(&page);
                    state.pages.insert(page, PoolPage { hash, refs: 0 });
                    state.stats.adopted += 1;
                    merge.push(page);
                }
                Some(_) => {
                    state.candidates.insert(page, (hash, id));
                }
                None if state.candidates.len() < MAX_CANDIDATES => {
                    state.candidates.insert(page, (hash, id));
                }
                None => {}
            }
        }
        if let Some(conn) = state.conns.get_mut(&id) {
            conn.pending.extend(merge.iter().copied());
        }
        // Candidates come and go in bulk (a VM's unique pages, then their adoption): keep the
        // table's memory to what it holds.
        if state.candidates.capacity() > 4 * state.candidates.len() + 1024 {
            state.candidates.shrink_to_fit();
        }
        state.stats.pool_pages = state.pages.len() as u64;
        state.stats.candidates = state.candidates.len() as u64;
        Reply {
            merge,
            stats: state.stats,
            ..Reply::default()
        }
    }

    fn merged(&self, id: u64, pages: &[u64]) -> Reply {
        let mut state = self.lock();
        let Some(conn) = state.conns.get_mut(&id) else {
            return Reply::default();
        };
        let pending = std::mem::take(&mut conn.pending);
        let mut added = Vec::new();
        for &page in pages {
            if pending.contains(&page) && conn.merged.insert(page) {
                added.push(page);
            }
        }
        for page in &added {
            if let Some(p) = state.pages.get_mut(page) {
                p.refs += 1;
                state.stats.references += 1;
            }
        }
        // Adopted for this VM but not taken: nobody maps them.
        let taken: HashSet<u64> = pages.iter().copied().collect();
        for page in pending.difference(&taken) {
            if state.pages.get(page).is_some_and(|p| p.refs == 0) {
                self.drop_page(&mut state, *page);
            }
        }
        Reply {
            stats: state.stats,
            ..Reply::default()
        }
    }

    fn unref(&self, state: &mut State, page: u64) {
        let Some(p) = state.pages.get_mut(&page) else {
            return;
        };
        p.refs = p.refs.saturating_sub(1);
        state.stats.references = state.stats.references.saturating_sub(1);
        if p.refs == 0 {
            self.drop_page(state, page);
        }
    }

    fn drop_page(&self, state: &mut State, page: u64) {
        state.pages.remove(&page);
        let _ = crate::discard::punch_hole(&self.memfd, page * PAGE, PAGE);
        state.stats.dropped += 1;
        state.stats.pool_pages = state.pages.len() as u64;
    }

    fn detach(&self, id: u64) {
        let mut state = self.lock();
        let Some(conn) = state.conns.remove(&id) else {
            return;
        };
        state.stats.vms -= 1;
        state.candidates.retain(|_, (_, owner)| *owner != id);
        state.stats.candidates = state.candidates.len() as u64;
        // A page is dropped (its hole punched, which every mapping of it sees) only once no
        // live process can map it: a VM whose connection broke may still run.
        if conn.start.is_some() && process_start(conn.pid) == conn.start {
            state.orphans.push(conn);
        } else {
            self.release_conn(&mut state, conn);
        }
        self.collect_orphans(&mut state);
    }

    fn release_conn(&self, state: &mut State, conn: Conn) {
        for page in conn.merged.iter() {
            self.unref(state, page);
        }
        for page in conn.pending {
            if state.pages.get(&page).is_some_and(|p| p.refs == 0) {
                self.drop_page(state, page);
            }
        }
    }

    /// Lets go of the references of orphaned VMs whose process has ended.
    fn collect_orphans(&self, state: &mut State) {
        let (gone, alive): (Vec<Conn>, Vec<Conn>) = std::mem::take(&mut state.orphans)
            .into_iter()
            .partition(|c| process_start(c.pid) != c.start);
        state.orphans = alive;
        for conn in gone {
            self.release_conn(state, conn);
        }
    }
}

fn send_line(stream: &UnixStream, reply: &Reply, fd: Option<i32>) -> Result<(), PoolError> {
    let mut text = serde_json::to_vec(reply).expect("a reply serializes");
    text.push(b'\n');
    let fds;
    let control: &[ControlMessage<'_>] = match fd {
        Some(fd) => {
            fds = [fd];
            &[ControlMessage::ScmRights(&fds)]
        }
        None => &[],
    };
    let mut sent = sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(&text)],
        control,
        MsgFlags::empty(),
        None,
    )
    .map_err(errno("send a reply"))?;
    let mut stream = stream;
    while sent < text.len() {
        let n = stream.write(&text[sent..]).map_err(io("send a reply"))?;
        sent += n;
    }
    Ok(())
}

/// The start time of a process (`starttime` of `/proc/PID/stat`), `None` if it is gone.
fn process_start(pid: i32) -> Option<u64> {
    let stat = procfs::process::Process::new(pid).and_then(|p| p.stat());
    stat.ok().map(|stat| stat.starttime)
}

/// Reads `buf.len()` bytes at `addr` of process `pid`.
fn read_remote(pid: i32, addr: u64, buf: &mut [u8]) -> std::io::Result<()> {
    let remote = nix::sys::uio::RemoteIoVec {
        base: usize::try_from(addr).map_err(|_| std::io::ErrorKind::InvalidInput)?,
        len: buf.len(),
    };
    let len = buf.len();
    let n = nix::sys::uio::process_vm_readv(
        nix::unistd::Pid::from_raw(pid),
        &mut [std::io::IoSliceMut::new(buf)],
        &[remote],
    )?;
    if n == len {
        Ok(())
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("read {n} of {len} bytes at {addr:#x} of process {pid}"),
        ))
    }
}
