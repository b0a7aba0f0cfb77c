//! The standalone pager server: serves the guest memory of VMMs that hand over their
//! userfaultfd (Firecracker's UFFD handshake, unchanged), from a raw memory file or a
//! compressed store, any number of VMs at once, one connection and one pager each.
//!
//! A connection that sends a bad handshake, or whose peer disconnects, gets a logged (and
//! rate-limited) error and is closed; the server goes on serving the others. A fault that
//! cannot be served (a corrupt block, a read error) is never answered with zeros or stale
//! bytes: the error is logged and the peer, found with `SO_PEERCRED` and held as a pidfd
//! (`SO_PEERPIDFD`, so that a reused pid is never signalled), is killed, since a VM frozen on a
//! fault forever is worse.
//!
//! Peers are not trusted: the socket is private from its creation ([`crate::socket`]), each
//! peer's uid is checked (`SO_PEERCRED`, [`PeerPolicy`]), the descriptor it sends must be a
//! userfaultfd without event kinds the pager does not handle ([`Userfaultfd::adopt`]), memfds
//! must be size-sealed and large enough (so that reading them cannot raise `SIGBUS` here),
//! events outside the peer's regions are ignored, and thread counts it asks for are capped.
//! One peer's misbehaviour ends its own connection at most.
//!
//! With a keeper ([`keeper`], [`handover`]) the server can be killed or upgraded under its VMs:
//! a new server takes over every VM the keeper holds.

mod admission;
pub mod handover;
pub mod handshake;
pub mod keeper;
pub mod protocol;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use compressed_backing::BlockSize;

use crate::journal::Journal;
use crate::pager::{ErrorHandler, Pager, PagerConfig, RamKind, RegionSpec};
use crate::socket::PeerPolicy;
use crate::source::PageSource;
use crate::state::PageState;
use crate::uffd::Userfaultfd;

pub(crate) use admission::Open;
use admission::{wait_readable, HandshakeSlot, Handshakes, Signal, WAIT_MS};
use basics::{error_chain, RateLimit};

/// Server parameters.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Fault-serving threads per VM.
    pub threads: usize,
    /// Fetch unit (must be the store's block size when serving a store).
    pub block_size: BlockSize,
}

/// Server-wide counters.
#[derive(Debug, Default, serde::Serialize)]
pub struct ServerStats {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Handshakes that were refused.
    pub bad_handshakes: AtomicU64,
    /// VMs served (valid handshakes).
    pub vms: AtomicU64,
    /// VMs being served right now.
    pub active: AtomicU64,
    /// Connection threads running: in their handshake, starting their service or serving. A
    /// stopping server waits for them (a VM between its handshake and its service would
    /// otherwise be left with neither a server nor, for an upgrade, its error line).
    #[serde(skip)]
    pub open: AtomicU64,
    /// Peers killed because a fault could not be served.
    pub peers_killed: AtomicU64,
    /// Connections refused because the peer's uid or gid is not allowed.
    pub peers_refused: AtomicU64,
    /// VMs taken over from the keeper at start.
    pub taken_over: AtomicU64,
    /// VMs the keeper held that could not be taken over (their VMMs were killed).
    pub takeovers_refused: AtomicU64,
    /// VMs served right now that the keeper holds (a handover leaves them to the next server).
    pub kept: AtomicU64,
    /// Connections in their handshake right now (at most [`MAX_HANDSHAKES`]).
    pub handshaking: AtomicU64,
    /// Connections closed in their handshake to make room for a new one ([`MAX_HANDSHAKES`]
    /// were in their handshake already).
    pub handshakes_pushed_out: AtomicU64,
}

/// How many connections may be in their handshake at once (each holds a thread for up to
/// [`handshake::HANDSHAKE_TIMEOUT`]): one more pushes the oldest out (its connection is shut
/// down). A Firecracker VMM sends its handshake as it connects, so it is through long before
/// 64 newer connections come; idle peers cannot hold more threads than this. Attached VMs do
/// not count.
pub const MAX_HANDSHAKES: u64 = 64;

/// A listening server.
#[derive(Debug)]
pub struct Server {
    listener: UnixListener,
    path: PathBuf,
    /// Whether this server bound `path` (and removes it on drop), or serves on a socket the
    /// keeper holds ([`Server::listen_on`]).
    owns_path: bool,
    source: Arc<dyn PageSource>,
    config: ServerConfig,
    stats: Arc<ServerStats>,
    log_limit: Arc<RateLimit>,
    /// The connections in their handshake, oldest first.
    handshakes: Arc<Handshakes>,
    /// For connections pushed out of their handshake (a flood must not silence other logs).
    cap_log_limit: RateLimit,
    peers: Arc<PeerPolicy>,
    /// The keeper that holds this server's VMs across restarts, if any.
    keeper: Option<Arc<keeper::KeeperClient>>,
    /// Raised to stop serving every VM and leave them to the keeper (an upgrade).
    handover: Arc<Signal>,
    /// Raised by [`Server::wake`]: the accept loop looks at its stop flag at once.
    wake: Signal,
    /// What identifies the image served (a VM is taken over only by a server of the same).
    image_id: Arc<str>,
}

impl Server {
    /// Listens on `path`, a 0600 socket private from its creation (see
    /// [`crate::socket::bind_private`]: a stale socket is replaced, a live one or a file that
    /// is not a socket is refused). Only peers of this uid are served until
    /// [`Server::allow_peers`] says otherwise.
    pub fn bind(
        path: &Path,
        source: Arc<dyn PageSource>,
        config: ServerConfig,
    ) -> std::io::Result<Self> {
        let listener = crate::socket::bind_private(path)?;
        let mut server = Self::listen_on(listener, path, source, config)?;
        server.owns_path = true;
        Ok(server)
    }

    /// Serves on `listener`, a socket at `path` that someone else bound and keeps (the
    /// keeper's, [`keeper::KeeperClient::take_listener`]): connections waiting in its backlog
    /// are this server's to accept, and its path is left in place when the server ends.
    pub fn listen_on(
        listener: UnixListener,
        path: &Path,
        source: Arc<dyn PageSource>,
        config: ServerConfig,
    ) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        Ok(Self {
            listener,
            path: path.to_path_buf(),
            owns_path: false,
            source,
            config,
            stats: Arc::new(ServerStats::default()),
            log_limit: Arc::new(RateLimit::new(20, Duration::from_secs(1))),
            handshakes: Arc::new(Handshakes::default()),
            cap_log_limit: RateLimit::new(1, Duration::from_secs(10)),
            peers: Arc::new(PeerPolicy::default()),
            keeper: None,
            handover: Arc::new(Signal::new()?),
            wake: Signal::new()?,
            image_id: Arc::from(""),
        })
    }

    /// Also serves peers of these uids and gids (e.g. Firecracker under its jailer); the
    /// socket's mode must then let them connect, which is the caller's choice.
    pub fn allow_peers(mut self, policy: PeerPolicy) -> Self {
        self.peers = Arc::new(policy);
        self
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<ServerStats> {
        &self.stats
    }

    /// Accepts connections until `stop` is set, each served on its own thread; it sees
    /// `stop` at once after [`Server::wake`], else within a second. Connections still open
    /// when it returns go on being served until their peers leave. While [`MAX_HANDSHAKES`]
    /// connections are in their handshake, a new one pushes the oldest out.
    pub fn run(&self, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) && !self.wake.is_raised() {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    self.stats.connections.fetch_add(1, Ordering::Relaxed);
                    let slot = match Handshakes::admit(&self.handshakes, &stream, &self.stats) {
                        Ok(slot) => slot,
                        Err(e) => {
                            if self.log_limit.allow() {
                                tracing::warn!("cannot hold a new connection: {e}");
                            }
                            continue;
                        }
                    };
                    if slot.pushed_out && self.cap_log_limit.allow() {
                        tracing::warn!(
                            pushed_out = self.stats.handshakes_pushed_out.load(Ordering::Relaxed),
                            "{MAX_HANDSHAKES} connections are in their handshake: the oldest \
                             was closed to make room"
                        );
                    }
                    let connection = self.connection(stream);
                    let open = Open::count(&self.stats);
                    let spawned =
                        std::thread::Builder::new()
                            .name("uffd-conn".into())
                            .spawn(move || {
                                let _open = open;
                                connection.serve(Some(slot), None);
                            });
                    if let Err(e) = spawned {
                        tracing::error!("cannot start a connection thread: {e}");
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    wait_readable(self.listener.as_raw_fd(), Some(&self.wake), WAIT_MS);
                }
                Err(e) => {
                    if self.log_limit.allow() {
                        tracing::warn!("accept failed: {e}");
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }
}

impl Server {
    /// Ends [`Server::run`] now, whatever its `stop` flag says (a stop signal's handler sets
    /// the flag and calls this).
    pub fn wake(&self) {
        self.wake.raise();
    }

    fn connection(&self, stream: UnixStream) -> Connection {
        Connection {
            stream,
            source: Arc::clone(&self.source),
            config: self.config.clone(),
            stats: Arc::clone(&self.stats),
            log_limit: Arc::clone(&self.log_limit),
            peers: Arc::clone(&self.peers),
            keeper: self.keeper.clone(),
            handover: Arc::clone(&self.handover),
            image_id: Arc::clone(&self.image_id),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.owns_path {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// One VMM's connection.
struct Connection {
    stream: UnixStream,
    source: Arc<dyn PageSource>,
    config: ServerConfig,
    stats: Arc<ServerStats>,
    log_limit: Arc<RateLimit>,
    peers: Arc<PeerPolicy>,
    keeper: Option<Arc<keeper::KeeperClient>>,
    handover: Arc<Signal>,
    image_id: Arc<str>,
}

impl Connection {
    /// Takes the handshake (in `slot` until it is read), then serves the VM. With a keeper the
    /// connection is held there (`pending`: its id, if held already, a connection taken over)
    /// before its handshake is read, so that a server dying meanwhile leaves it to the next.
    fn serve(self, slot: Option<HandshakeSlot>, pending: Option<u64>) {
        let (pid, uid) = match self.peers.check(&self.stream) {
            Ok(cred) => (cred.pid, cred.uid),
            Err(e) => {
                self.stats.peers_refused.fetch_add(1, Ordering::Relaxed);
                if self.log_limit.allow() {
                    tracing::warn!("connection refused: {}", error_chain(&e));
                }
                return;
            }
        };
        let peer = crate::socket::PeerProcess::of(&self.stream, pid);
        let taken_over = pending.is_some();
        let pending = pending.or_else(|| {
            let keeper = self.keeper.as_ref()?;
            keeper
                .pending(std::os::fd::AsFd::as_fd(&self.stream))
                .map_err(|e| {
                    if self.log_limit.allow() {
                        tracing::warn!(
                            "the keeper does not hold this connection before its handshake: {}",
                            error_chain(&e)
                        );
                    }
                })
                .ok()
        });
        let (pager, session) = match self.start(peer, slot, pending) {
            Ok(started) => started,
            Err(e) => {
                self.stats.bad_handshakes.fetch_add(1, Ordering::Relaxed);
                if let (Some(keeper), Some(id)) = (&self.keeper, pending) {
                    let _ = keeper.drop_vm(id);
                }
                // A connection taken over whose handshake never came: the server before read
                // it and died, and its VMM waits forever for faults nobody can serve.
                let lost = taken_over
                    && matches!(
                        e.downcast_ref::<handshake::HandshakeError>(),
                        Some(handshake::HandshakeError::Timeout(_))
                    );
                if lost {
                    // `peer` went into the handshake: the connection gives its pidfd again.
                    kill_peer(
                        &self.stats,
                        &crate::socket::PeerProcess::of(&self.stream, pid),
                        "its handshake was read by a server that died, and its memory can \
                         never be served",
                    );
                } else if self.log_limit.allow() {
                    tracing::warn!(peer_pid = pid, "connection refused: {}", error_chain(&*e));
                }
                return;
            }
        };
        self.stats.vms.fetch_add(1, Ordering::Relaxed);
        tracing::info!(peer_pid = pid, bytes = pager.image_size(), "serving a VM");
        self.serve_vm(pid, uid, pager, session);
    }

    /// Serves a VM (its VMM runs as `pid`, `uid`) until its VMM leaves or the server hands
    /// its VMs over.
    fn serve_vm(&self, pid: i32, uid: u32, pager: Pager, session: Session) {
        self.stats.active.fetch_add(1, Ordering::Relaxed);
        let kept = matches!(session, Session::Firecracker { kept: Some(_), .. });
        if kept {
            self.stats.kept.fetch_add(1, Ordering::Relaxed);
        }
        match &session {
            // Firecracker keeps the socket open and sends nothing more: its end of file (or the
            // end of its address space) ends the service.
            Session::Firecracker { .. } => self.wait_for_end(&pager, kept),
            Session::Pvisor { .. } => self.answer_requests(&pager, uid),
        }
        let metrics = pager.metrics().snapshot();
        // Its threads are joined here: every event they read is applied to the journal.
        drop(pager);
        let handed_over = self.handed_over(&session);
        // `active` first: a handover that sees `kept` fall to 0 finds these VMs gone from it.
        self.stats.active.fetch_sub(1, Ordering::Relaxed);
        if kept {
            self.stats.kept.fetch_sub(1, Ordering::Relaxed);
        }
        if handed_over {
            tracing::info!(peer_pid = pid, "VM left to the keeper for the next server");
            return;
        }
        self.release(&session);
        tracing::info!(
            peer_pid = pid,
            faults = metrics.faults_copy + metrics.faults_zero + metrics.faults_minor,
            errors = metrics.fault_errors,
            "VM gone"
        );
        drop(session);
    }

    /// Until the VMM leaves, or a handover if the keeper holds the VM (`kept`): woken at
    /// once by either.
    fn wait_for_end(&self, pager: &Pager, kept: bool) {
        let mut stream = &self.stream;
        let mut discard = [0u8; 256];
        let handover = kept.then_some(&*self.handover);
        while !pager.owner_gone() && !handover.is_some_and(Signal::is_raised) {
            if !wait_readable(self.stream.as_raw_fd(), handover, WAIT_MS) {
                continue;
            }
            match stream.read(&mut discard) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }

    /// One JSON request per line, one JSON reply per line, until the peer (running as `uid`)
    /// leaves.
    fn answer_requests(&self, pager: &Pager, uid: u32) {
        let mut stream = &self.stream;
        let mut pending = Vec::new();
        let mut chunk = [0u8; 4096];
        while !pager.owner_gone() {
            if self.handover.is_raised() {
                let _ = stream.write_all(handover::PVISOR_NOT_HANDED_OVER.as_bytes());
                return;
            }
            if !wait_readable(self.stream.as_raw_fd(), Some(&self.handover), WAIT_MS) {
                continue;
            }
            let n = match stream.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            pending.extend_from_slice(&chunk[..n]);
            if pending.len() > handshake::MAX_HANDSHAKE_BYTES {
                if self.log_limit.allow() {
                    tracing::warn!("request line too long: closing the connection");
                }
                return;
            }
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line[..end]);
                if line.trim().is_empty() {
                    continue;
                }
                let mut reply = protocol::handle(pager, &line, uid);
                reply.push('\n');
                if stream.write_all(reply.as_bytes()).is_err() {
                    return;
                }
            }
        }
    }

    fn start(
        &self,
        peer: crate::socket::PeerProcess,
        slot: Option<HandshakeSlot>,
        pending: Option<u64>,
    ) -> Result<(Pager, Session), Box<dyn std::error::Error>> {
        let received = handshake::receive(&self.stream, handshake::HANDSHAKE_TIMEOUT)?;
        if slot.as_ref().is_some_and(|slot| !slot.finish()) {
            return Err("pushed out of its handshake by newer connections".into());
        }
        drop(slot);
        let image_size = self.source.image_size();
        let (specs, session, initial) = match received.message {
            handshake::Message::Firecracker(raw) => {
                let regions = handshake::validate(&raw, image_size)?;
                let session = Session::Firecracker {
                    regions: raw,
                    kept: None,
                };
                (anon_specs(&regions), session, PageState::Source)
            }
            handshake::Message::Pvisor(hello) => {
                let initial = match hello.initial.as_deref() {
                    None | Some("source") => PageState::Source,
                    Some("zero") => PageState::Zero,
                    Some(other) => {
                        return Err(format!("unknown initial state `{other}`").into());
                    }
                };
                let (specs, views) = memfd_regions(&hello, received.memfds, image_size)?;
                (specs, Session::Pvisor { _views: views }, initial)
            }
        };
        self.stream.set_read_timeout(None)?;
        let (uffd, features) = Userfaultfd::adopt(received.uffd)?;
        let remove_events = features & crate::uffd::feature::EVENT_REMOVE != 0;
        let mut session = session;
        let journal = match &mut session {
            Session::Firecracker { regions, kept } => {
                *kept = self.deposit(regions, &uffd, &specs, initial, pending);
                kept.as_ref().map(|k| Arc::clone(&k.journal))
            }
            Session::Pvisor { .. } => {
                // Not handed over (see `handover`): the keeper lets its connection go.
                if let (Some(keeper), Some(id)) = (&self.keeper, pending) {
                    let _ = keeper.drop_vm(id);
                }
                None
            }
        };
        // SAFETY: the regions belong to the peer's address space and were registered by the
        // peer; their views are the server's own memfd mappings, which `session` keeps alive
        // as long as the pager.
        let pager = unsafe { self.pager(peer, uffd, remove_events, specs, initial, journal) };
        let pager = match pager {
            Ok(pager) => pager,
            Err(e) => {
                self.release(&session);
                return Err(e.into());
            }
        };
        if let Session::Pvisor { .. } = session {
            let hello = serde_json::json!({
                "status": "ok",
                "value": {
                    "protocol": handshake::PVISOR_PROTOCOL,
                    "image_bytes": pager.image_size(),
                    "block_bytes": pager.block_size().bytes_u64(),
                },
            });
            (&self.stream).write_all(format!("{hello}\n").as_bytes())?;
        }
        Ok((pager, session))
    }

    /// A pager for the peer's regions on its uffd, its states in `journal` if given.
    ///
    /// # Safety
    ///
    /// The regions are registered by the peer in its own address space; every `view` is a
    /// mapping of this process that outlives the pager.
    unsafe fn pager(
        &self,
        peer: crate::socket::PeerProcess,
        uffd: Userfaultfd,
        remove_events: bool,
        specs: Vec<RegionSpec>,
        initial: PageState,
        journal: Option<Arc<Journal>>,
    ) -> Result<Pager, crate::pager::PagerError> {
        // A fault installs whole pages: huge pages are fetched as 2 MiB blocks, gathered from
        // the source's smaller blocks where it has them.
        let block_size = specs
            .iter()
            .map(|s| s.kind.page_size().bytes())
            .filter_map(|bytes| BlockSize::new(bytes).ok())
            .fold(self.config.block_size, BlockSize::max);
        let config = PagerConfig {
            threads: self.config.threads,
            block_size,
            initial,
            register: false,
            // Firecracker asks for them; the pager never discards remote memory itself.
            remove_events,
            track_writes: false,
        };
        let source = Some(Arc::clone(&self.source));
        let on_error = self.error_handler(peer);
        // SAFETY: the pager only resolves faults on the peer's registered regions through the
        // uffd; the views are forwarded from the caller.
        unsafe {
            Pager::with_journal(
                uffd,
                remove_events,
                specs,
                config,
                source,
                on_error,
                journal,
            )
        }
    }

    /// What to do with a fault that cannot be served: log it and kill the peer (once).
    fn error_handler(&self, peer: crate::socket::PeerProcess) -> ErrorHandler {
        let pid = peer.pid();
        let killed = AtomicBool::new(false);
        let stats = Arc::clone(&self.stats);
        let log_limit = Arc::clone(&self.log_limit);
        Box::new(move |e: &crate::pager::FaultError| {
            // What the peer's own address space does outside its regions harms nobody else:
            // ignored, never applied to another range.
            if e.is_ignored() {
                if log_limit.allow() {
                    tracing::warn!(peer_pid = pid, "{}", error_chain(e));
                }
                return;
            }
            if log_limit.allow() {
                tracing::error!(peer_pid = pid, "fault cannot be served: {}", error_chain(e));
            }
            // Never feed the guest wrong bytes; a VM frozen forever is worse than a dead one.
            if !killed.swap(true, Ordering::Relaxed) {
                kill_peer(&stats, &peer, "its memory cannot be served");
            }
        })
    }
}

/// Kills a VMM whose memory can never be served right (a frozen VM is worse than a dead one),
/// through the pidfd of its connection, saying `why`; never this process itself (a peer of
/// unknown pid, or one in the same process, as in tests), and counted in `peers_killed`.
pub(crate) fn kill_peer(stats: &ServerStats, peer: &crate::socket::PeerProcess, why: &str) {
    let pid = peer.pid();
    if pid <= 0 || pid == std::process::id().cast_signed() {
        return;
    }
    stats.peers_killed.fetch_add(1, Ordering::Relaxed);
    tracing::error!(peer_pid = pid, "killing the VMM: {why}");
    if let Err(e) = peer.kill() {
        tracing::warn!(peer_pid = pid, "cannot kill the VMM: {e}");
    }
}

/// What a connection speaks after its handshake.
enum Session {
    /// Firecracker's: nothing more. Its regions as they came, and where the keeper holds it.
    Firecracker {
        regions: Vec<handshake::GuestRegion>,
        kept: Option<handover::Kept>,
    },
    /// The project's: requests; the memfd views must outlive the pager.
    Pvisor { _views: Vec<MemfdView> },
}

/// Firecracker regions: the peer's anonymous memory (of base pages, or private `MAP_HUGETLB`
/// memory of 2 MiB pages), reachable only through its uffd.
fn anon_specs(regions: &[handshake::Region]) -> Vec<RegionSpec> {
    regions
        .iter()
        .map(|r| RegionSpec {
            kind: if r.page_size == basics::PageSize::BASE {
                RamKind::Anon
            } else {
                RamKind::Hugetlb
            },
            range: r.range,
            image_offset: r.offset,
            memfd: None,
            memfd_offset: 0,
            view: None,
        })
        .collect()
}

/// The server's own read-only mapping of a VM's memfd, to read its RAM for offload.
struct MemfdView {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: a read-only shared mapping; it is only read, by the pager, under its own rules.
unsafe impl Send for MemfdView {}

impl MemfdView {
    fn map(file: &File, offset: u64, len: u64) -> std::io::Result<Self> {
        let (Ok(len), Ok(offset)) = (usize::try_from(len), libc::off_t::try_from(offset)) else {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        };
        // SAFETY: a new shared read-only mapping of a descriptor we hold; checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { ptr, len })
    }
}

impl Drop for MemfdView {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping, once.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

/// Checks that `file` is a memfd whose first `end` bytes the server can map and read without
/// ever taking `SIGBUS`: a shmem memfd (not hugetlb), regular, sealed against shrinking
/// (`F_SEAL_SHRINK`: the peer can never cut pages from under the mapping) and at least `end`
/// bytes long.
fn check_memfd(file: &File, end: u64) -> Result<(), String> {
    let fd = file.as_raw_fd();
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .map_err(|e| format!("cannot inspect its memfd: {e}"))?;
    if !link.to_string_lossy().starts_with("/memfd:") {
        return Err(format!("its memfd is not a memfd but `{}`", link.display()));
    }
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot stat its memfd: {e}"))?;
    if !meta.file_type().is_file() {
        return Err("its memfd is not a regular file".into());
    }
    // SAFETY: an all-zero statfs is a valid value to be overwritten by fstatfs.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs fills `fs` for a descriptor we hold.
    if unsafe { libc::fstatfs(fd, &mut fs) } != 0 {
        return Err(format!(
            "cannot statfs its memfd: {}",
            std::io::Error::last_os_error()
        ));
    }
    if fs.f_type != libc::TMPFS_MAGIC {
        return Err("its memfd is not a shmem memfd (hugetlb memfds are not served)".into());
    }
    // SAFETY: F_GET_SEALS on a descriptor we hold, no memory involved.
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(
            "its memfd is not sealed with F_SEAL_SHRINK (create it with MFD_ALLOW_SEALING, size it, \
             then add the seal: a memfd that can shrink could kill the server with SIGBUS)"
                .into(),
        );
    }
    if meta.len() < end {
        return Err(format!(
            "its memfd has {} bytes, the region needs {end}",
            meta.len()
        ));
    }
    Ok(())
}

/// Builds the regions of a `pvisor-uffd/1` handshake, mapping the memfds it brought.
fn memfd_regions(
    hello: &handshake::PvisorHandshake,
    memfds: Vec<OwnedFd>,
    image_size: u64,
) -> Result<(Vec<RegionSpec>, Vec<MemfdView>), Box<dyn std::error::Error>> {
    let raw: Vec<handshake::GuestRegion> = hello.regions.iter().map(|r| r.region.clone()).collect();
    let regions = handshake::validate(&raw, image_size)?;
    let files: Vec<Arc<File>> = memfds
        .into_iter()
        .map(|fd| Arc::new(File::from(fd)))
        .collect();
    let mut used = vec![false; files.len()];
    let mut specs = Vec::with_capacity(regions.len());
    let mut views = Vec::new();
    for (index, (region, wire)) in regions.iter().zip(&hello.regions).enumerate() {
        if region.page_size != basics::PageSize::BASE {
            return Err(format!(
                "region {index}: huge pages are served to Firecracker's handshake, not over {}",
                handshake::PVISOR_PROTOCOL
            )
            .into());
        }
        let spec = match wire.memfd {
            None => RegionSpec {
                kind: RamKind::Anon,
                range: region.range,
                image_offset: region.offset,
                memfd: None,
                memfd_offset: 0,
                view: None,
            },
            Some(fd) => {
                let file = files.get(fd).ok_or_else(|| {
                    format!("region {index} names memfd {fd}, but {} came", files.len())
                })?;
                if std::mem::replace(&mut used[fd], true) {
                    return Err(format!("region {index} reuses memfd {fd}").into());
                }
                if wire.memfd_offset % crate::addr::PAGE_SIZE != 0 {
                    return Err(format!("region {index}: memfd_offset is not page-aligned").into());
                }
                let end = wire
                    .memfd_offset
                    .checked_add(region.range.len())
                    .ok_or_else(|| format!("region {index}: memfd_offset overflows"))?;
                check_memfd(file, end).map_err(|e| format!("region {index}: {e}"))?;
                let view = MemfdView::map(file, wire.memfd_offset, region.range.len())
                    .map_err(|e| format!("region {index}: cannot map its memfd: {e}"))?;
                let spec = RegionSpec {
                    kind: RamKind::Memfd,
                    range: region.range,
                    image_offset: region.offset,
                    memfd: Some(Arc::clone(file)),
                    memfd_offset: wire.memfd_offset,
                    view: Some(crate::addr::HostAddr::from_ptr(view.ptr)),
                };
                views.push(view);
                spec
            }
        };
        specs.push(spec);
    }
    if let Some(unused) = used.iter().position(|&u| !u) {
        return Err(format!("memfd {unused} is named by no region").into());
    }
    Ok((specs, views))
}
