//! Helpers shared by the device tests of every crate: the device check, a small tmpfs to run
//! out of space on, deterministic test data, and hostile files: FIFOs, modes, another user;
//! huge pages lent for a test ([`hugepages`]); what of a store is in the page cache
//! ([`page_cache`]); a small HTTP/1.1 client ([`http`]).

pub mod http;
pub mod hugepages;
pub mod page_cache;
pub mod s3;

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

/// True if device tests are to be skipped (`PVISOR_SKIP_DEVICE_TESTS=1`). Otherwise panics
/// with a clear message if one of `devices` is missing: a device test must not pass silently
/// on a machine that cannot run it.
pub fn skip_unless(devices: &[&str]) -> bool {
    if std::env::var_os("PVISOR_SKIP_DEVICE_TESTS").is_some_and(|v| v == "1") {
        eprintln!("skipped: PVISOR_SKIP_DEVICE_TESTS=1");
        return true;
    }
    for device in devices {
        assert!(
            Path::new(device).exists(),
            "{device} is missing: this test needs it (PVISOR_SKIP_DEVICE_TESTS=1 skips device tests)"
        );
    }
    false
}

/// A tmpfs of a fixed size (e.g. `"4m"`), unmounted on drop. Needs root.
#[derive(Debug)]
pub struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` on a fresh temporary directory.
    pub fn mount(size: &str) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let target = CString::new(dir.path().as_os_str().as_bytes()).expect("a path without NUL");
        let options = CString::new(format!("size={size},mode=0700")).expect("options without NUL");
        // SAFETY: all pointers are valid NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                options.as_ptr().cast(),
            )
        };
        assert_eq!(
            rc,
            0,
            "mounting a tmpfs needs root (PVISOR_SKIP_DEVICE_TESTS=1 skips device tests): {}",
            std::io::Error::last_os_error()
        );
        Self { dir }
    }

    /// Its mount point.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let target =
            CString::new(self.dir.path().as_os_str().as_bytes()).expect("a path without NUL");
        // SAFETY: a valid NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}

/// `len` pseudo-random (incompressible) bytes from `seed`.
pub fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 29) as u8
        })
        .collect()
}

/// Makes a FIFO at `path` (mode 0600): a file whose `open` or `read` blocks for ever.
pub fn mkfifo(path: &Path) {
    let c_path = CString::new(path.as_os_str().as_bytes()).expect("a path without NUL");
    // SAFETY: a valid NUL-terminated path that outlives the call.
    let rc = unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) };
    assert_eq!(
        rc,
        0,
        "mkfifo {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

/// The resident memory of process `pid` (`VmRSS`), bytes.
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap_or_else(|| panic!("process {pid} has no VmRSS"))
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("process {pid}'s VmRSS: {e}"));
    kib << 10
}

/// The permission bits of `path` itself (a link is not followed), setuid and sticky included.
pub fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// Runs `f` on another thread and returns what it returns; panics naming `what` if it takes
/// more than `limit` (a hang: the thread is left behind, blocked).
pub fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} hung (more than {limit:?})"))
}

/// A temporary directory other users may enter (0755; tempdirs are 0700), so that what keeps
/// them out of the files made in it is those files' own modes.
pub fn open_tempdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod 0755 the temporary directory");
    dir
}

/// True if uid/gid 65534 (nobody), without supplementary groups, succeeds in running
/// `program args path` (through `setpriv` of util-linux; needs root).
pub fn nobody_can(program: &str, args: &[&str], path: &Path) -> bool {
    Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--",
            program,
        ])
        .args(args)
        .arg(path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("setpriv (util-linux) runs: this test needs it")
        .success()
}

/// Checks once per process that the other-user check can succeed at all: nobody reads a
/// world-readable file and lists a world-readable directory in an [`open_tempdir`]. Without
/// this, a `setpriv` that fails for any reason, or a temporary directory under a private
/// one, would make every "nobody cannot read" assertion pass whatever the modes.
fn check_nobody_can_reach_public_files() {
    static CHECKED: OnceLock<()> = OnceLock::new();
    CHECKED.get_or_init(|| {
        let dir = open_tempdir();
        let public = dir.path().join("public");
        std::fs::write(&public, b"x").expect("write a public file");
        std::fs::set_permissions(&public, std::fs::Permissions::from_mode(0o644))
            .expect("chmod 0644");
        assert!(
            nobody_can("head", &["-c1"], &public) && nobody_can("ls", &[], dir.path()),
            "uid 65534 cannot read a 0644 file in {}: the other-user check would prove \
             nothing here (is the temporary directory under a private one?)",
            dir.path().display()
        );
    });
}

/// True if nobody (uid 65534) can read one byte of `path`. Checks first that nobody can read
/// a public file, so that `false` means the modes kept it out.
pub fn nobody_can_read(path: &Path) -> bool {
    check_nobody_can_reach_public_files();
    nobody_can("head", &["-c1"], path)
}

/// True if nobody (uid 65534) can list the directory `path` (same check first as
/// [`nobody_can_read`]).
pub fn nobody_can_list(path: &Path) -> bool {
    check_nobody_can_reach_public_files();
    nobody_can("ls", &[], path)
}

/// Connects to the Unix socket `socket` as uid and gid 65534 (nobody) from a forked child that
/// waits up to `secs` seconds for the server to close the connection: true if it closed it (the
/// peer was refused), false if it kept it open. Needs root. The caller makes sure nothing else
/// in the process forks meanwhile if that matters to it (the child only makes raw system calls).
pub fn closed_for_nobody(socket: &Path, secs: i64) -> bool {
    // SAFETY: an all-zero sockaddr_un is valid; the path is copied in below, NUL-terminated.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let path = socket.as_os_str().as_bytes();
    assert!(path.len() < addr.sun_path.len(), "socket path too long");
    for (dst, &src) in addr.sun_path.iter_mut().zip(path) {
        *dst = src.cast_signed();
    }
    let addr_len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: the child only makes raw system calls on prepared data, then _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: async-signal-safe system calls only, on valid arguments.
        unsafe {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(65534) != 0
                || libc::setuid(65534) != 0
            {
                libc::_exit(3);
            }
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            if libc::connect(fd, (&raw const addr).cast(), addr_len) != 0 {
                libc::_exit(4);
            }
            let tv = libc::timeval {
                tv_sec: secs,
                tv_usec: 0,
            };
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const tv).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            );
            let mut byte = 0u8;
            let n = libc::read(fd, (&raw mut byte).cast(), 1);
            libc::_exit(if n == 0 { 0 } else { 1 });
        }
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    match libc::WEXITSTATUS(status) {
        0 => true,
        1 => false,
        code => panic!("the child could not become nobody or connect (exit {code})"),
    }
}

/// Lets uid 65534 reach `socket` through the file system (its directory 0711, the socket
/// 0666), so that only the server's own credential check stands in its way.
pub fn open_to_everyone(socket: &Path) {
    let dir = socket.parent().expect("a socket path has a directory");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
        .expect("chmod 0711 the socket's directory");
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o666))
        .expect("chmod 0666 the socket");
}

/// Guest memory for a test VM: a mapping of `len` bytes, unmapped on drop. Declare it before
/// whatever serves faults on it (a pager, a userfaultfd), so that it is unmapped after.
#[derive(Debug)]
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory; the tests synchronise access themselves.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// A fresh private anonymous read-write mapping (`MAP_NORESERVE`); panics if it fails.
    pub fn anon(len: usize) -> Self {
        Self::try_anon(len).unwrap_or_else(|e| panic!("mmap of {len} bytes: {e}"))
    }

    /// As [`Mapping::anon`], with the error returned.
    pub fn try_anon(len: usize) -> std::io::Result<Self> {
        Self::new(
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            None,
        )
    }

    /// A read-only private mapping of `file`'s first `len` bytes (as Firecracker's example
    /// handler maps the memory file).
    pub fn file(file: &std::fs::File, len: usize) -> std::io::Result<Self> {
        use std::os::fd::AsRawFd;
        Self::new(
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            Some(file.as_raw_fd()),
        )
    }

    /// A fresh mapping with these `mmap` protections and flags, of `fd` from offset 0 or
    /// anonymous (`None`).
    pub fn new(len: usize, prot: i32, flags: i32, fd: Option<i32>) -> std::io::Result<Self> {
        // SAFETY: a fresh mapping the kernel places; the result is checked.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd.unwrap_or(-1), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Reads the byte at `offset` (faulting through whoever serves the mapping).
    #[inline]
    pub fn read(&self, offset: usize) -> u8 {
        assert!(offset < self.len);
        // SAFETY: inside the live mapping.
        unsafe { self.ptr.add(offset).read_volatile() }
    }

    /// The whole mapping (reading it faults every missing page in).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is live and `len` long.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Writes `data` at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        // SAFETY: inside the live, writable mapping; the caller keeps no other reference to
        // these bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) };
    }

    /// Takes ownership of a mapping made by the caller (a memfd mapped shared, say).
    ///
    /// # Safety
    ///
    /// `ptr` must be the start of a live mapping of `len` bytes that nothing else unmaps.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Self {
        Self { ptr, len }
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty mapping.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping, which nothing else unmaps.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A child process killed (SIGKILL) and reaped when this is dropped, unless it has exited:
/// a test that panics must not leave a server running that holds the test's output open
/// (the runner would wait for it).
#[derive(Debug)]
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
