//! Private Unix sockets: created unreachable by others from the start, and a check of who
//! connected.
//!
//! `bind()` creates the socket inode with mode `0777 & !umask`; a `chmod 0600` after it leaves
//! a window in which, under umask 000, any local user can connect (and be served guest RAM).
//! [`bind_private`] binds inside a fresh 0700 directory next to the target, restricts the
//! socket to 0600 there, then `rename()`s it into place: the socket is never reachable at a
//! path other users can search before it is 0600. Everything is cleaned up on error.
//!
//! File modes only say who may connect through the path; [`PeerPolicy`] checks each peer's
//! credentials (`SO_PEERCRED`) on the accepted connection as well: this user by default, or
//! explicitly allowed uids and gids (Firecracker under its jailer runs as another uid).

use std::io;
use std::io::IoSliceMut;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::errno::Errno;
use nix::sys::socket::{
    getsockopt, recvmsg, sockopt::PeerCredentials, ControlMessageOwned, MsgFlags,
};

/// Says on stdout that a daemon listens: one line, its socket's path, flushed. The command
/// that started the daemon waits for this line (its documented output) before it connects.
#[allow(
    clippy::disallowed_macros,
    reason = "a daemon's readiness line is its documented output"
)]
pub fn announce(path: &Path) -> io::Result<()> {
    use std::io::Write;
    println!("{}", path.display());
    io::stdout().flush()
}

/// Listens on `path`, a Unix socket of mode 0600 that no other user could ever connect to.
///
/// A stale socket at `path` (nobody accepts on it) is replaced; a live one is refused with
/// `AddrInUse`, anything that is not a socket (a regular file, a directory, a symlink) with
/// `AlreadyExists`, so that a wrong path never destroys a file. The returned listener is
/// blocking, close-on-exec.
pub fn bind_private(path: &Path) -> io::Result<UnixListener> {
    // Clients connect to `path` itself: it must fit a socket address as well as the staging
    // path it is bound at.
    fits_socket_address(path, path)?;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{} is in use by a running server", path.display()),
                ));
            }
        }
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    remove_stale_staging(parent);
    let staging = Staging::create(parent)?;
    let temp = staging.dir.join("s");
    fits_socket_address(path, &temp)?;
    let listener = UnixListener::bind(&temp)?;
    std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o600))?;
    std::fs::rename(&temp, path)?;
    Ok(listener)
}

/// The most bytes a Unix socket's path may have (`sun_path` less its closing NUL).
pub const SOCKET_PATH_MAX: usize = 107;

/// `InvalidInput`, naming `path` and saying how long it may be, when `bound` (the path
/// itself, or the staging path it is bound at) is over [`SOCKET_PATH_MAX`] bytes; the kernel's
/// own refusal names neither.
fn fits_socket_address(path: &Path, bound: &Path) -> io::Result<()> {
    let len = bound.as_os_str().len();
    if len <= SOCKET_PATH_MAX {
        return Ok(());
    }
    let over = len - SOCKET_PATH_MAX;
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "cannot bind a socket at {}: binding it takes a path of {len} bytes ({}), over the \
             {SOCKET_PATH_MAX} a Unix socket's path may have; give a path {over} bytes shorter",
            path.display(),
            bound.display(),
        ),
    ))
}

/// How old one of this process's own staging directories must be to count as left behind
/// (a bind in progress on another thread is younger).
const OWN_STAGING_STALE: std::time::Duration = std::time::Duration::from_secs(60);

/// How old another pid's staging directory must be to count as left behind: a pid that does
/// not exist here may be a bind in progress in another pid namespace sharing the directory.
const STAGING_STALE: std::time::Duration = std::time::Duration::from_secs(10);

/// Removes the staging directories (`.sock-PID-N`) in `parent` that a process killed inside
/// [`bind_private`] left behind: those of a pid that is not alive, older than
/// [`STAGING_STALE`], and this process's own older than [`OWN_STAGING_STALE`]. Only a directory of this user, holding at most its
/// socket `s`, is removed, through a descriptor of the directory itself (never following a
/// symlink); anything else is left alone. Best effort: errors are ignored.
fn remove_stale_staging(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    let own = std::process::id();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(staging_pid) else {
            continue;
        };
        let older_than = |limit| {
            std::fs::symlink_metadata(entry.path())
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age >= limit)
        };
        let stale = if pid == own {
            older_than(OWN_STAGING_STALE)
        } else {
            older_than(STAGING_STALE) && !process_alive(pid)
        };
        if stale {
            remove_staging(parent, &entry.path());
        }
    }
}

/// The pid in a staging directory's name, `.sock-PID-N`.
fn staging_pid(name: &str) -> Option<u32> {
    let (pid, n) = name.strip_prefix(".sock-")?.split_once('-')?;
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(pid) || !all_digits(n) {
        return None;
    }
    pid.parse().ok().filter(|&pid| pid > 0)
}

/// True unless no process has this pid (`kill(pid, 0)` fails with `ESRCH`).
fn process_alive(pid: u32) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return true;
    };
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), None),
        Err(nix::errno::Errno::ESRCH)
    )
}

/// Removes the staging directory `dir` in `parent` if it is a directory of this user: its
/// socket `s` through a descriptor of the directory, then the directory (only if empty).
fn remove_staging(parent: &Path, dir: &Path) {
    use nix::fcntl::{open, OFlag};
    use nix::sys::stat::{fstat, Mode};
    use nix::unistd::{unlinkat, UnlinkatFlags};
    let Ok(fd) = open(
        dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) else {
        return;
    };
    let Ok(stat) = fstat(&fd) else {
        return;
    };
    if stat.st_uid != nix::unistd::geteuid().as_raw() {
        return;
    }
    let _ = unlinkat(&fd, "s", UnlinkatFlags::NoRemoveDir);
    drop(fd);
    if let (Ok(parent), Some(name)) = (
        open(
            parent,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        ),
        dir.file_name(),
    ) {
        let _ = unlinkat(&parent, name, UnlinkatFlags::RemoveDir);
    }
}

/// A fresh 0700 directory next to the target, removed with whatever is left in it on drop.
struct Staging {
    dir: PathBuf,
}

impl Staging {
    fn create(parent: &Path) -> io::Result<Self> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        for _ in 0..100 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let dir = parent.join(format!(".sock-{}-{n}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {
                    let staging = Self { dir };
                    // The umask can only remove bits; make sure nothing else was added.
                    std::fs::set_permissions(&staging.dir, std::fs::Permissions::from_mode(0o700))?;
                    return Ok(staging);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "cannot create a private staging directory in {}",
                parent.display()
            ),
        ))
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.dir.join("s"));
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Who may talk to a server, by the credentials of the connecting process (`SO_PEERCRED`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerPolicy {
    /// Uids allowed besides the server's own.
    pub uids: Vec<u32>,
    /// Gids allowed (a peer whose primary gid is one of them).
    pub gids: Vec<u32>,
}

/// A peer's credentials as the kernel recorded them at `connect()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id.
    pub pid: i32,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
}

/// Why a peer was refused.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// `SO_PEERCRED` failed.
    #[error("cannot read the peer's credentials")]
    Credentials(#[source] nix::Error),
    /// The peer runs as a user the policy does not allow.
    #[error("peer pid {} runs as uid {} gid {}, which may not use this socket (allowed: uid {own}{extra})", .cred.pid, .cred.uid, .cred.gid)]
    Refused {
        /// Its credentials.
        cred: PeerCred,
        /// The server's uid.
        own: u32,
        /// The other allowed ids, for the message.
        extra: String,
    },
}

impl PeerPolicy {
    /// True if a process with `uid`/`gid` may talk to a server running as `own_uid`.
    pub fn allows(&self, own_uid: u32, uid: u32, gid: u32) -> bool {
        uid == own_uid || self.uids.contains(&uid) || self.gids.contains(&gid)
    }

    /// The credentials of `stream`'s peer, if the policy allows it.
    pub fn check(&self, stream: &impl AsFd) -> Result<PeerCred, PeerError> {
        let creds = getsockopt(stream, PeerCredentials).map_err(PeerError::Credentials)?;
        let cred = PeerCred {
            pid: creds.pid(),
            uid: creds.uid(),
            gid: creds.gid(),
        };
        let own = nix::unistd::geteuid().as_raw();
        if self.allows(own, cred.uid, cred.gid) {
            return Ok(cred);
        }
        let mut extra = String::new();
        for uid in &self.uids {
            extra.push_str(&format!(", uid {uid}"));
        }
        for gid in &self.gids {
            extra.push_str(&format!(", gid {gid}"));
        }
        Err(PeerError::Refused { cred, own, extra })
    }
}

/// `SO_PEERPIDFD` (Linux 6.5): a pidfd of the process that connected.
const SO_PEERPIDFD: libc::c_int = 77;

/// The process that connected to `stream`, held so that it can be signalled later without
/// the risk of a reused pid: a pidfd where the kernel offers `SO_PEERPIDFD`, else the pid.
#[derive(Debug)]
pub struct PeerProcess {
    pid: i32,
    pidfd: Option<std::os::fd::OwnedFd>,
}

impl PeerProcess {
    /// The peer of `stream`, whose pid (from `SO_PEERCRED`) is `pid`.
    pub fn of(stream: &impl AsFd, pid: i32) -> Self {
        use std::os::fd::{AsRawFd, FromRawFd};
        let mut fd: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `fd`; the result is checked.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_fd().as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PEERPIDFD,
                (&raw mut fd).cast(),
                &mut len,
            )
        };
        let pidfd = (rc == 0 && fd >= 0).then(|| {
            // SAFETY: a new descriptor the kernel just installed for us.
            unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }
        });
        Self { pid, pidfd }
    }

    /// Its pid.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Sends `SIGKILL`: through the pidfd (it cannot reach another process), else by pid.
    pub fn kill(&self) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let rc = match &self.pidfd {
            // SAFETY: pidfd_send_signal on our pidfd, no siginfo, no flags.
            Some(pidfd) => unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    pidfd.as_raw_fd(),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            },
            // SAFETY: kill with integer arguments.
            None => libc::c_long::from(unsafe { libc::kill(self.pid, libc::SIGKILL) }),
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

/// What one [`recv_with_fds`] got.
#[derive(Debug)]
pub struct Received {
    /// Bytes read into the buffer (0 at end of stream).
    pub bytes: usize,
    /// The descriptors that came with them, close-on-exec, owned here.
    pub fds: Vec<OwnedFd>,
    /// The peer sent more descriptors than `MAX_FDS`: the kernel dropped (closed) the rest
    /// (`MSG_CTRUNC`). The caller decides whether that is an error.
    pub truncated: bool,
}

/// One `recvmsg` on `socket` into `buf`, taking up to `MAX_FDS` descriptors passed with
/// `SCM_RIGHTS`, close-on-exec from the start (`MSG_CMSG_CLOEXEC`), each wrapped in an
/// [`OwnedFd`] at once. The errno of `recvmsg` (or of reading its control messages) is
/// returned as is, for the caller to give it a meaning.
pub fn recv_with_fds<const MAX_FDS: usize>(
    socket: impl AsFd,
    buf: &mut [u8],
) -> Result<Received, Errno> {
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        socket.as_fd().as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for control in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(received) = control {
            // SAFETY: the kernel just installed these descriptors in this process for this
            // message; nothing else knows their numbers, so each gets exactly one owner.
            fds.extend(
                received
                    .into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    Ok(Received {
        bytes: msg.bytes,
        fds,
        truncated: msg.flags.intersects(MsgFlags::MSG_CTRUNC),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn bind_private_fresh_path_is_0600_and_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let listener = bind_private(&path).unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.mode() & 0o7777, 0o600);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![OsString::from("a.sock")]);
        // It really listens at the final path.
        let _client = UnixStream::connect(&path).unwrap();
        listener.accept().unwrap();
    }

    #[test]
    fn bind_private_live_socket_is_refused_and_stale_one_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let live = bind_private(&path).unwrap();
        let err = bind_private(&path).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        drop(live);
        let _again = bind_private(&path).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn bind_private_refuses_a_path_too_long_for_a_socket_saying_so() {
        let dir = tempfile::tempdir().unwrap();
        // A directory whose socket `z` fits, but not its staging path (`.sock-PID-N/s`).
        let deep = dir
            .path()
            .join("y".repeat(SOCKET_PATH_MAX - 2 - dir.path().as_os_str().len() - 1));
        std::fs::create_dir(&deep).unwrap();
        let path = deep.join("z");
        assert_eq!(path.as_os_str().len(), SOCKET_PATH_MAX);
        let err = bind_private(&path).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
        assert!(
            err.to_string().contains(".sock-"),
            "names the staging path: {err}"
        );
        assert!(err.to_string().contains("bytes shorter"), "{err}");
        // Too long itself.
        let err = bind_private(&deep.join("zz")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
        assert!(
            err.to_string()
                .contains(&format!("{} bytes", SOCKET_PATH_MAX + 1)),
            "{err}"
        );
        // Nothing is left behind, staging included.
        assert_eq!(std::fs::read_dir(&deep).unwrap().count(), 0);
        // A path that fits, staging and all, binds.
        assert!(bind_private(&dir.path().join("z")).is_ok());
    }

    #[test]
    fn bind_private_non_socket_is_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("precious");
        std::fs::write(&path, b"data").unwrap();
        let err = bind_private(&path).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&path).unwrap(), b"data");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(bind_private(&link).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"data");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    /// A staging directory as a process killed inside `bind_private` leaves it.
    fn plant_staging(parent: &Path, pid: i32, n: u64) -> PathBuf {
        let dir = parent.join(format!(".sock-{pid}-{n}"));
        std::fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
        let _bound = UnixListener::bind(dir.join("s")).unwrap();
        dir
    }

    #[test]
    fn bind_private_stale_staging_of_dead_or_old_own_pid_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        // A pid that is dead: a child that has exited and been reaped.
        let dead = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = dead.id().cast_signed();
        let status = { dead }.wait().unwrap();
        assert!(status.success());
        let ours = std::process::id().cast_signed();
        let stale = plant_staging(dir.path(), dead_pid, 7);
        // A pid we cannot see may be a bind in progress in another pid namespace.
        let fresh_dead = plant_staging(dir.path(), dead_pid, 9);
        let fresh_own = plant_staging(dir.path(), ours, 1_000_001);
        let old_own = plant_staging(dir.path(), ours, 1_000_002);
        let age = |dir: &Path, secs| {
            let then = std::time::SystemTime::now() - std::time::Duration::from_secs(secs);
            std::fs::File::open(dir)
                .unwrap()
                .set_modified(then)
                .unwrap();
        };
        age(&stale, 30);
        age(&old_own, 120);
        // Not staging directories: never touched.
        std::fs::create_dir(dir.path().join(".sock-notapid-0")).unwrap();
        std::fs::write(dir.path().join(format!(".sock-{dead_pid}-8")), b"x").unwrap();

        let _listener = bind_private(&dir.path().join("a.sock")).unwrap();

        assert!(!stale.exists(), "a dead pid's staging directory was left");
        assert!(!old_own.exists(), "our own old staging directory was left");
        assert!(
            fresh_own.join("s").exists(),
            "a live bind's staging was removed"
        );
        assert!(
            fresh_dead.join("s").exists(),
            "a fresh staging directory was removed"
        );
        assert!(dir.path().join(".sock-notapid-0").exists());
        assert!(dir.path().join(format!(".sock-{dead_pid}-8")).exists());
    }

    #[test]
    fn bind_private_missing_directory_fails_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no/such/dir/a.sock");
        assert!(bind_private(&path).is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn peer_policy_own_uid_or_listed_ids_are_allowed() {
        let policy = PeerPolicy {
            uids: vec![123],
            gids: vec![456],
        };
        assert!(policy.allows(0, 0, 9));
        assert!(policy.allows(0, 123, 9));
        assert!(policy.allows(0, 7, 456));
        assert!(!policy.allows(0, 7, 9));
        assert!(!PeerPolicy::default().allows(1000, 0, 0));
    }

    #[test]
    fn peer_policy_own_process_passes_check() {
        let (a, _b) = UnixStream::pair().unwrap();
        let cred = PeerPolicy::default().check(&a).unwrap();
        assert_eq!(cred.pid, std::process::id().cast_signed());
    }

    #[test]
    fn peer_process_kill_reaches_the_connected_child() {
        use nix::sys::socket::{SockaddrLike, UnixAddr};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.sock");
        let listener = bind_private(&path).unwrap();
        let addr = UnixAddr::new(&path).unwrap();
        // SAFETY: the child only makes raw system calls on prepared data.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: async-signal-safe calls only; the child never returns.
            unsafe {
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                libc::connect(fd, addr.as_ptr().cast(), addr.len());
                loop {
                    libc::pause();
                }
            }
        }
        let (stream, _) = listener.accept().unwrap();
        let cred = PeerPolicy::default().check(&stream).unwrap();
        assert_eq!(cred.pid, pid);
        let peer = PeerProcess::of(&stream, cred.pid);
        assert!(peer.pidfd.is_some(), "no SO_PEERPIDFD on this kernel");
        peer.kill().unwrap();
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL);
    }
}
