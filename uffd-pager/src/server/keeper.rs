//! The keeper: a tiny process that holds, for every VM a server serves, what must outlive that
//! server (the VMM's connection, its userfaultfd, the VM's journal memfd, and the validated
//! handshake as an opaque JSON value), so that a new server started after a crash or for an
//! upgrade can take the VMs over (see [`super::handover`]).
//!
//! It never maps or reads guest memory nor the journal: it only holds descriptors. It watches
//! each VM's connection for the VMM's end of file (`POLLRDHUP`, without reading: the server
//! reads that connection) and then closes everything it held for that VM.
//!
//! Protocol, on a private socket ([`crate::socket::bind_private`], peers of the keeper's own
//! uid only, `SO_PEERCRED`): every message is a little-endian `u32` length and that many bytes
//! of JSON, sent in one `sendmsg` with its descriptors (`SCM_RIGHTS`). One server at a time is
//! attached: on connecting it gets `{"op":"attached"}` (or an error while another server is
//! attached), then sends `pending` (a connection just accepted, its handshake not read yet),
//! `hold` (meta + connection, uffd, journal; in place of a `pending` one when it names it),
//! `list` (answered by one `vm` message per VM or pending connection with its descriptors,
//! then `end`) and `drop` (a VM or connection the server refused).
//! The attachment ends with the server's connection: the next server may then attach.
//!
//! With `--listen PATH` ([`KeeperSocket::listen`]) the keeper also holds the socket VMMs
//! connect to, as a service manager holds one for socket activation: `attached` comes with its
//! listening descriptor, the server accepts on it, and a VMM that connects while no server runs
//! (or while one is stopping) waits in its backlog for the next server instead of finding no
//! one there. If the keeper itself ends, the socket's path goes with it (its file is removed):
//! a server still running goes on serving the VMs it has and accepts on the descriptor it holds,
//! but VMMs can no longer connect by the path until a keeper listens again.

use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

use crate::socket::PeerPolicy;

/// Largest message: a handshake's regions and some framing.
pub const MAX_MESSAGE: usize = 128 << 10;
/// Most descriptors in one message: connection, uffd, journal.
pub const MAX_FDS: usize = 3;
/// Most VMs held at once.
pub const MAX_VMS: usize = 4096;

/// What travels on the keeper's socket.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Message {
    /// Keeper → server: this server is the attached one; with `listen`, the socket VMMs connect
    /// to at that path comes as its descriptor, for the server to accept on.
    Attached {
        /// The path of the listening socket sent with it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        listen: Option<PathBuf>,
    },
    /// Server → keeper: hold this VM (descriptors: connection, uffd, journal).
    Hold {
        /// What the server needs to serve it again (opaque to the keeper).
        meta: serde_json::Value,
        /// The id it was held under as a `pending` connection, which this replaces.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pending: Option<u64>,
    },
    /// Server → keeper: hold this connection, just accepted, whose handshake is not read yet
    /// (descriptor: the connection), so that a server dying before it has read it leaves it
    /// to the next one.
    Pending,
    /// Keeper → server: the VM is held under `id`.
    Held {
        /// Its id.
        id: u64,
    },
    /// Server → keeper: send every VM held.
    List,
    /// Keeper → server: one VM (descriptors: connection, uffd, journal).
    Vm {
        /// Its id.
        id: u64,
        /// As it was given in `hold`.
        meta: serde_json::Value,
    },
    /// Keeper → server: the end of a `list`.
    End {
        /// VMs sent.
        count: u64,
    },
    /// Server → keeper: stop holding this VM (the server refused it; its connection closes).
    Drop {
        /// Its id.
        id: u64,
    },
    /// Keeper → server: the VM is no longer held.
    Dropped {
        /// Its id.
        id: u64,
    },
    /// Either way: what went wrong.
    Error {
        /// Why.
        error: String,
    },
}

/// Errors of the keeper's protocol.
#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    /// A socket operation failed.
    #[error("keeper socket: cannot {what}")]
    Io {
        /// The operation.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The other side broke the protocol or refused the request.
    #[error("keeper protocol: {0}")]
    Protocol(String),
    /// The keeper's process does not run as this user.
    #[error("the keeper's socket is served by another user")]
    Peer(#[source] crate::socket::PeerError),
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> KeeperError {
    move |source| KeeperError::Io { what, source }
}

/// Sends one message with `fds`.
pub fn send(
    stream: &UnixStream,
    message: &Message,
    fds: &[BorrowedFd<'_>],
) -> Result<(), KeeperError> {
    let body = serde_json::to_vec(message).expect("a message serializes");
    if body.len() > MAX_MESSAGE {
        return Err(KeeperError::Protocol(format!(
            "a {}-byte message",
            body.len()
        )));
    }
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let control = [ControlMessage::ScmRights(&raw)];
    let control: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &control };
    let sent = sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(&frame)],
        control,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(|e| io("send")(e.into()))?;
    (&*stream).write_all(&frame[sent..]).map_err(io("send"))
}

/// Receives one message and its descriptors (more than [`MAX_FDS`] is a protocol error).
pub fn recv(stream: &UnixStream) -> Result<(Message, Vec<OwnedFd>), KeeperError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < len.len() {
        let received = crate::socket::recv_with_fds::<MAX_FDS>(stream, &mut len[got..])
            .map_err(|e| io("receive")(e.into()))?;
        fds.extend(received.fds);
        if received.truncated {
            return Err(KeeperError::Protocol("too many descriptors".into()));
        }
        if received.bytes == 0 {
            return Err(KeeperError::Io {
                what: "receive",
                source: std::io::ErrorKind::UnexpectedEof.into(),
            });
        }
        got += received.bytes;
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(KeeperError::Protocol(format!("a {len}-byte message")));
    }
    let mut body = vec![0u8; len];
    (&*stream).read_exact(&mut body).map_err(io("receive"))?;
    let message = serde_json::from_slice(&body)
        .map_err(|e| KeeperError::Protocol(format!("unreadable message: {e}")))?;
    Ok((message, fds))
}

/// One VM held.
#[derive(Debug)]
struct Held {
    id: u64,
    meta: serde_json::Value,
    /// Connection, uffd, journal.
    fds: Vec<OwnedFd>,
}

/// Counters of a keeper.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct KeeperStats {
    /// VMs taken in.
    pub held: u64,
    /// VMs released because their VMM left.
    pub released: u64,
    /// VMs released because a server refused them.
    pub dropped: u64,
    /// Servers attached.
    pub attachments: u64,
    /// Connections refused (wrong uid, another server attached).
    pub refused: u64,
}

/// A keeper's listening socket.
#[derive(Debug)]
pub struct KeeperSocket {
    listener: UnixListener,
    path: PathBuf,
    /// The socket VMMs connect to, handed to each server that attaches ([`KeeperSocket::listen`]).
    vmm_listener: Option<(UnixListener, PathBuf)>,
}

impl KeeperSocket {
    /// Listens on `path`, a private socket (see [`crate::socket::bind_private`]).
    pub fn bind(path: &Path) -> std::io::Result<Self> {
        let listener = crate::socket::bind_private(path)?;
        listener.set_nonblocking(true)?;
        Ok(Self {
            listener,
            path: path.to_path_buf(),
            vmm_listener: None,
        })
    }

    /// Also listens on `path` for VMMs (a private socket, [`crate::socket::bind_private`]), and
    /// hands that socket to every server that attaches.
    pub fn listen(mut self, path: &Path) -> std::io::Result<Self> {
        // Absolute: servers compare it with their own --socket, from their own directories.
        let path = std::path::absolute(path)?;
        self.vmm_listener = Some((crate::socket::bind_private(&path)?, path));
        Ok(self)
    }

    /// Holds VMs until `stop` is set; returns the counters. Everything held is closed then.
    pub fn run(&self, stop: &AtomicBool) -> KeeperStats {
        let mut keeper = Keeper::default();
        let vmms = self.vmm_listener.as_ref().map(|(l, p)| (l, p.as_path()));
        while !stop.load(Ordering::Relaxed) {
            keeper.step(&self.listener, vmms);
        }
        keeper.stats
    }
}

impl Drop for KeeperSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        if let Some((_, path)) = &self.vmm_listener {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[derive(Debug, Default)]
struct Keeper {
    vms: Vec<Held>,
    server: Option<UnixStream>,
    next_id: u64,
    stats: KeeperStats,
}

impl Keeper {
    /// One poll round: the attached server's requests, VMMs that left, new connections.
    /// `vmms` is the socket VMMs connect to, if the keeper holds it, and its path.
    fn step(&mut self, listener: &UnixListener, vmms: Option<(&UnixListener, &Path)>) {
        let mut fds = vec![pollfd(listener.as_fd(), libc::POLLIN)];
        if let Some(server) = &self.server {
            fds.push(pollfd(server.as_fd(), libc::POLLIN));
        }
        let first_vm = fds.len();
        for vm in &self.vms {
            // Only the hang-up: the VMM's bytes are the server's to read.
            fds.push(pollfd(vm.fds[0].as_fd(), libc::POLLRDHUP));
        }
        // SAFETY: `fds` is a valid array of pollfds for descriptors that stay open.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 200) };
        if rc <= 0 {
            return;
        }
        let gone: Vec<u64> = fds[first_vm..]
            .iter()
            .zip(&self.vms)
            .filter(|(p, _)| p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0)
            .map(|(_, vm)| vm.id)
            .collect();
        for id in gone {
            self.vms.retain(|vm| vm.id != id);
            self.stats.released += 1;
            tracing::info!(vm = id, "VMM gone: released");
        }
        if first_vm == 2 && fds[1].revents != 0 {
            self.serve_request();
        }
        if fds[0].revents != 0 {
            self.accept(listener, vmms);
        }
    }

    fn accept(&mut self, listener: &UnixListener, vmms: Option<(&UnixListener, &Path)>) {
        let Ok((stream, _)) = listener.accept() else {
            return;
        };
        let refuse = |stream: &UnixStream, error: String| {
            let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = send(stream, &Message::Error { error }, &[]);
        };
        let cred = match PeerPolicy::default().check(&stream) {
            Ok(cred) => cred,
            Err(e) => {
                self.stats.refused += 1;
                tracing::warn!("refused: {}", basics::error_chain(&e));
                return;
            }
        };
        if self.server.is_some() {
            self.stats.refused += 1;
            refuse(&stream, "another server is attached to this keeper".into());
            return;
        }
        if stream.set_nonblocking(false).is_err()
            || stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .is_err()
            || stream
                .set_write_timeout(Some(Duration::from_secs(5)))
                .is_err()
            || send(
                &stream,
                &Message::Attached {
                    listen: vmms.map(|(_, path)| path.to_path_buf()),
                },
                &vmms.map(|(l, _)| l.as_fd()).into_iter().collect::<Vec<_>>(),
            )
            .is_err()
        {
            return;
        }
        self.stats.attachments += 1;
        tracing::info!(
            server_pid = cred.pid,
            held = self.vms.len(),
            "server attached"
        );
        self.server = Some(stream);
    }

    fn serve_request(&mut self) {
        let Some(server) = self.server.take() else {
            return;
        };
        let (message, fds) = match recv(&server) {
            Ok(received) => received,
            Err(e) => {
                // Its end (a crash included) frees the attachment for the next server.
                tracing::info!("server detached: {}", basics::error_chain(&e));
                return;
            }
        };
        let reply = match message {
            Message::Hold { .. } | Message::Pending
                if fds.first().is_some_and(|fd| !is_socket(fd.as_fd())) =>
            {
                Err("the first descriptor is not the VMM's connection socket".into())
            }
            // A pending connection's handshake was valid: the VM replaces it, under its id.
            Message::Hold {
                meta,
                pending: Some(id),
            } if fds.len() == MAX_FDS
                && self.vms.iter().any(|vm| vm.id == id && vm.fds.len() == 1) =>
            {
                let vm = self
                    .vms
                    .iter_mut()
                    .find(|vm| vm.id == id)
                    .expect("found just above");
                vm.meta = meta;
                vm.fds = fds;
                self.stats.held += 1;
                Ok(Message::Held { id })
            }
            Message::Hold { meta, .. } if fds.len() == MAX_FDS && self.vms.len() < MAX_VMS => {
                self.next_id += 1;
                let id = self.next_id;
                self.vms.push(Held { id, meta, fds });
                self.stats.held += 1;
                Ok(Message::Held { id })
            }
            Message::Pending if fds.len() == 1 && self.vms.len() < MAX_VMS => {
                self.next_id += 1;
                let id = self.next_id;
                let meta = serde_json::json!({ "session": "pending" });
                self.vms.push(Held { id, meta, fds });
                Ok(Message::Held { id })
            }
            Message::Pending if fds.len() != 1 => Err(format!(
                "pending needs 1 descriptor (the connection), {} came",
                fds.len()
            )),
            Message::Hold { .. } if fds.len() != MAX_FDS => Err(format!(
                "hold needs {MAX_FDS} descriptors (connection, uffd, journal), {} came",
                fds.len()
            )),
            Message::Hold { .. } => Err(format!("{MAX_VMS} VMs are held already")),
            Message::List => self.list(&server),
            Message::Drop { id } => {
                let before = self.vms.len();
                self.vms.retain(|vm| vm.id != id);
                if self.vms.len() < before {
                    self.stats.dropped += 1;
                }
                Ok(Message::Dropped { id })
            }
            other => Err(format!("unexpected {other:?}")),
        };
        let reply = reply.unwrap_or_else(|error| Message::Error { error });
        if send(&server, &reply, &[]).is_ok() {
            self.server = Some(server);
        }
    }

    fn list(&self, server: &UnixStream) -> Result<Message, String> {
        for vm in &self.vms {
            let fds: Vec<BorrowedFd<'_>> = vm.fds.iter().map(AsFd::as_fd).collect();
            let message = Message::Vm {
                id: vm.id,
                meta: vm.meta.clone(),
            };
            send(server, &message, &fds).map_err(|e| basics::error_chain(&e))?;
        }
        Ok(Message::End {
            count: self.vms.len() as u64,
        })
    }
}

/// True if `fd` is a socket (whose hang-up the keeper can watch).
fn is_socket(fd: BorrowedFd<'_>) -> bool {
    nix::sys::stat::fstat(fd).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFSOCK)
}

fn pollfd(fd: BorrowedFd<'_>, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    }
}

/// A VM as the keeper hands it back.
#[derive(Debug)]
pub struct HeldVm {
    /// Its id at the keeper.
    pub id: u64,
    /// What the server gave with it.
    pub meta: serde_json::Value,
    /// The VMM's connection.
    pub conn: UnixStream,
    /// The userfaultfd.
    pub uffd: OwnedFd,
    /// The journal memfd.
    pub journal: OwnedFd,
}

/// What the keeper holds, as [`KeeperClient::list`] gives it: the VMs, and the connections
/// (with their ids) whose handshake no server has read to the end.
pub type Listed = (Vec<HeldVm>, Vec<(u64, UnixStream)>);

/// A server's attachment to its keeper.
#[derive(Debug)]
pub struct KeeperClient {
    stream: parking_lot::Mutex<UnixStream>,
    /// The socket VMMs connect to, if the keeper holds one, until [`KeeperClient::take_listener`].
    listener: parking_lot::Mutex<Option<(UnixListener, PathBuf)>>,
}

impl KeeperClient {
    /// Attaches to the keeper at `path`, which must run as this user; waits up to `patience`
    /// while another server is still attached (one that is stopping).
    pub fn attach(path: &Path, patience: Duration) -> Result<Self, KeeperError> {
        let deadline = std::time::Instant::now() + patience;
        loop {
            let stream = UnixStream::connect(path).map_err(io("connect"))?;
            crate::socket::PeerPolicy::default()
                .check(&stream)
                .map_err(KeeperError::Peer)?;
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .map_err(io("set a timeout"))?;
            let (message, mut fds) = recv(&stream)?;
            match message {
                Message::Attached { listen } => {
                    let listener = match (listen, fds.pop()) {
                        (Some(path), Some(fd)) if fds.is_empty() && is_socket(fd.as_fd()) => {
                            Some((UnixListener::from(fd), path))
                        }
                        (None, None) => None,
                        _ => {
                            return Err(KeeperError::Protocol(
                                "`attached` came with a listening socket that is not one".into(),
                            ))
                        }
                    };
                    return Ok(Self {
                        stream: parking_lot::Mutex::new(stream),
                        listener: parking_lot::Mutex::new(listener),
                    });
                }
                Message::Error { error } if std::time::Instant::now() < deadline => {
                    // The server before is stopping: its end reaches the keeper within
                    // milliseconds, and every one of them is a guest's fault waiting.
                    tracing::debug!("keeper busy: {error}");
                    std::thread::sleep(Duration::from_millis(2));
                }
                other => return Err(KeeperError::Protocol(format!("{other:?}"))),
            }
        }
    }

    fn request(
        stream: &UnixStream,
        message: &Message,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Message, KeeperError> {
        send(stream, message, fds)?;
        match recv(stream)? {
            (Message::Error { error }, _) => Err(KeeperError::Protocol(error)),
            (reply, _) => Ok(reply),
        }
    }

    /// The socket VMMs connect to and its path, if the keeper holds one (once).
    pub fn take_listener(&self) -> Option<(UnixListener, PathBuf)> {
        self.listener.lock().take()
    }

    /// True while the keeper's end of the connection is open.
    pub fn alive(&self) -> bool {
        let stream = self.stream.lock();
        let mut fd = pollfd(stream.as_fd(), libc::POLLRDHUP);
        // SAFETY: one valid pollfd for a descriptor we hold; no waiting.
        let rc = unsafe { libc::poll(&mut fd, 1, 0) };
        rc == 0 || (rc > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) == 0)
    }

    /// Has the keeper hold a VM, in place of its `pending` connection if it was one; returns
    /// its id.
    pub fn hold(
        &self,
        meta: serde_json::Value,
        conn: BorrowedFd<'_>,
        uffd: BorrowedFd<'_>,
        journal: BorrowedFd<'_>,
        pending: Option<u64>,
    ) -> Result<u64, KeeperError> {
        let stream = self.stream.lock();
        let message = Message::Hold { meta, pending };
        match Self::request(&stream, &message, &[conn, uffd, journal])? {
            Message::Held { id } => Ok(id),
            other => Err(KeeperError::Protocol(format!("{other:?} answers hold"))),
        }
    }

    /// Has the keeper hold a connection just accepted, before its handshake is read; returns
    /// its id (give it to [`KeeperClient::hold`] once the handshake is valid, or to
    /// [`KeeperClient::drop_vm`] if it is not).
    pub fn pending(&self, conn: BorrowedFd<'_>) -> Result<u64, KeeperError> {
        let stream = self.stream.lock();
        match Self::request(&stream, &Message::Pending, &[conn])? {
            Message::Held { id } => Ok(id),
            other => Err(KeeperError::Protocol(format!("{other:?} answers pending"))),
        }
    }

    /// Every VM the keeper holds, and every connection it holds whose handshake no server
    /// has read to the end.
    pub fn list(&self) -> Result<Listed, KeeperError> {
        let stream = self.stream.lock();
        send(&stream, &Message::List, &[])?;
        let mut vms = Vec::new();
        let mut pending = Vec::new();
        loop {
            match recv(&stream)? {
                (Message::Vm { id, meta }, mut fds)
                    if meta["session"] == "pending" && fds.len() == 1 =>
                {
                    let conn = fds.pop().expect("one descriptor");
                    pending.push((id, UnixStream::from(conn)));
                }
                (Message::Vm { id, meta }, fds) => {
                    let [conn, uffd, journal]: [OwnedFd; MAX_FDS] =
                        fds.try_into().map_err(|_| {
                            KeeperError::Protocol(format!("VM {id} without its descriptors"))
                        })?;
                    vms.push(HeldVm {
                        id,
                        meta,
                        conn: UnixStream::from(conn),
                        uffd,
                        journal,
                    });
                }
                (Message::End { .. }, _) => return Ok((vms, pending)),
                (Message::Error { error }, _) => return Err(KeeperError::Protocol(error)),
                (other, _) => return Err(KeeperError::Protocol(format!("{other:?} in a list"))),
            }
        }
    }

    /// Has the keeper stop holding VM `id` (its connection then closes once the server's
    /// copy does).
    pub fn drop_vm(&self, id: u64) -> Result<(), KeeperError> {
        let stream = self.stream.lock();
        match Self::request(&stream, &Message::Drop { id }, &[])? {
            Message::Dropped { .. } => Ok(()),
            other => Err(KeeperError::Protocol(format!("{other:?} answers drop"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeper_message_round_trips_with_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let (x, _y) = UnixStream::pair().unwrap();
        let meta = serde_json::json!({"regions": [1, 2]});
        send(
            &a,
            &Message::Hold {
                meta: meta.clone(),
                pending: None,
            },
            &[x.as_fd(), x.as_fd(), x.as_fd()],
        )
        .unwrap();
        send(&a, &Message::List, &[]).unwrap();
        let (first, fds) = recv(&b).unwrap();
        assert_eq!(
            first,
            Message::Hold {
                meta,
                pending: None
            }
        );
        assert_eq!(fds.len(), 3);
        let (second, fds) = recv(&b).unwrap();
        assert_eq!(second, Message::List);
        assert!(fds.is_empty());
    }

    /// Runs `f` against a keeper running on a thread, stopped after it.
    fn with_keeper(f: impl FnOnce(&Path)) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keeper.sock");
        let socket = KeeperSocket::bind(&path).unwrap();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| socket.run(&stop));
            f(&path);
            stop.store(true, Ordering::Relaxed);
        });
    }

    #[test]
    fn keeper_one_server_at_a_time_and_vm_released_on_hangup() {
        with_keeper(|path| {
            let first = KeeperClient::attach(path, Duration::ZERO).unwrap();
            assert!(KeeperClient::attach(path, Duration::ZERO).is_err());
            let (vmm, conn) = UnixStream::pair().unwrap();
            let journal =
                crate::journal::Journal::create(1, crate::state::PageState::Zero).unwrap();
            let meta = serde_json::json!({"session": "firecracker"});
            first
                .hold(meta.clone(), conn.as_fd(), conn.as_fd(), journal.fd(), None)
                .unwrap();
            let held = first.list().unwrap().0;
            assert_eq!((held.len(), &held[0].meta), (1, &meta));
            drop(held);
            // The VMM leaves: the keeper lets the VM go.
            drop(vmm);
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while !first.list().unwrap().0.is_empty() {
                assert!(std::time::Instant::now() < deadline, "the VM is still held");
                std::thread::sleep(Duration::from_millis(10));
            }
            // The first server's end frees the attachment.
            drop(first);
            let second = KeeperClient::attach(path, Duration::from_secs(5)).unwrap();
            assert!(second.list().unwrap().0.is_empty());
        });
    }

    #[test]
    fn keeper_hold_without_a_socket_is_refused() {
        with_keeper(|path| {
            let client = KeeperClient::attach(path, Duration::ZERO).unwrap();
            let journal =
                crate::journal::Journal::create(1, crate::state::PageState::Zero).unwrap();
            let fd = journal.fd();
            assert!(client
                .hold(serde_json::json!({}), fd, fd, fd, None)
                .is_err());
            assert!(client.pending(fd).is_err());
            assert!(client.list().unwrap().0.is_empty());
        });
    }

    proptest::proptest! {
        #[test]
        fn fuzz_keeper_recv_random_frames_never_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
            small_len in proptest::prelude::any::<bool>(),
        ) {
            let (a, b) = UnixStream::pair().unwrap();
            let mut bytes = bytes;
            if small_len && bytes.len() >= 4 {
                // A plausible length, so that the body is parsed.
                let len = (bytes.len() - 4) as u32;
                bytes[..4].copy_from_slice(&len.to_le_bytes());
            }
            (&a).write_all(&bytes).unwrap();
            drop(a);
            let _ = recv(&b);
        }
    }

    #[test]
    fn keeper_message_oversized_length_is_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(&u32::MAX.to_le_bytes()).unwrap();
        assert!(matches!(recv(&b), Err(KeeperError::Protocol(_))));
    }
}
