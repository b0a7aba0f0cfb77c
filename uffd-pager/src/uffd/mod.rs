//! A safe wrapper over a userfaultfd.
//!
//! The unsafe boundary is at registration (STYLE.md): registering a range promises that the
//! mapping outlives the registration and that the kernel may fill it at any time. Once
//! registered, resolving faults (`copy`, `zeropage`, `continue_range`, `wake`) is safe: the
//! kernel only writes inside registered ranges and refuses anything else.
//!
//! Errnos are mapped to what they mean for a pager: `EEXIST` → the page is already mapped
//! (someone else resolved it; wake the waiters), `EAGAIN` → the address space is changing
//! (a `REMOVE` event is pending: read events first, then retry), `ESRCH` → the process that
//! owns the memory is gone, `ENOENT` → the range is no longer mapped there.

use std::fs::OpenOptions;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use linux_raw_sys::general as sys;
use linux_raw_sys::ioctl as nr;

use basics::PageSize;

use crate::addr::{HostAddr, HostRange};

mod error;
mod kernel;

pub use error::{AdoptError, UffdError};
use kernel::parse_event;
pub use kernel::{fdinfo_features, feature, Event, Mode, Resolved};

/// `_IO(USERFAULTFD_IOC, 0x00)`: the `/dev/userfaultfd` ioctl that makes a new userfaultfd.
const USERFAULTFD_IOC_NEW: libc::c_ulong = 0xAA00;
/// `UFFDIO_CONTINUE_MODE_DONTWAKE` (missing from the generated bindings).
const UFFDIO_CONTINUE_MODE_DONTWAKE: u64 = 1;
/// `UFFDIO_MOVE`: `_IOWR(0xAA, 0x05, struct uffdio_move)` (missing from the generated ioctls).
const UFFDIO_MOVE: u32 = iowr(0xAA, 0x05, std::mem::size_of::<sys::uffdio_move>());
/// `UFFDIO_WRITEPROTECT_MODE_WP` (missing from the generated bindings).
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1;
/// `UFFDIO_MOVE_MODE_DONTWAKE`.
const UFFDIO_MOVE_MODE_DONTWAKE: u64 = 1;

/// `_IOWR(ty, nr, size)` of the kernel's ioctl encoding.
pub(crate) const fn iowr(ty: u32, nr: u32, size: usize) -> u32 {
    (3 << 30) | ((size as u32) << 16) | (ty << 8) | nr
}

/// One userfaultfd. Safe to share between threads: every operation is one system call.
#[derive(Debug)]
pub struct Userfaultfd {
    fd: OwnedFd,
}

impl Userfaultfd {
    /// Creates a non-blocking, close-on-exec userfaultfd through `/dev/userfaultfd` (falling
    /// back to the system call where the device does not exist) and does the API handshake,
    /// asking for `features` (`feature::*` bits).
    pub fn create(features: u64) -> Result<Self, UffdError> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        let fd = match OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/userfaultfd")
        {
            Ok(dev) => {
                // SAFETY: USERFAULTFD_IOC_NEW takes the userfaultfd(2) flags as its argument.
                let fd = unsafe { libc::ioctl(dev.as_raw_fd(), USERFAULTFD_IOC_NEW, flags) };
                if fd < 0 {
                    return Err(UffdError::Create {
                        via: "/dev/userfaultfd",
                        source: std::io::Error::last_os_error(),
                    });
                }
                fd
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // SAFETY: the userfaultfd system call takes only flags.
                let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
                if fd < 0 {
                    return Err(UffdError::Create {
                        via: "userfaultfd(2)",
                        source: std::io::Error::last_os_error(),
                    });
                }
                fd as RawFd
            }
            Err(source) => {
                return Err(UffdError::Create {
                    via: "/dev/userfaultfd",
                    source,
                })
            }
        };
        // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let uffd = Self { fd };
        let mut api = sys::uffdio_api {
            api: u64::from(sys::UFFD_API),
            features,
            ioctls: 0,
        };
        // SAFETY: `api` is the uffdio_api structure UFFDIO_API expects.
        let rc = unsafe { ioctl(uffd.fd(), nr::UFFDIO_API, &mut api) };
        if rc != 0 {
            return Err(UffdError::Api {
                asked: features,
                offered: api.features,
                source: Some(std::io::Error::last_os_error()),
            });
        }
        if api.features & features != features {
            return Err(UffdError::Api {
                asked: features,
                offered: api.features,
                source: None,
            });
        }
        Ok(uffd)
    }

    /// Takes over a userfaultfd created elsewhere (e.g. received from Firecracker over a
    /// socket), on which the API handshake has already been done. For a descriptor from an
    /// untrusted peer use [`Userfaultfd::adopt`].
    pub fn from_fd(fd: OwnedFd) -> Self {
        Self { fd }
    }

    /// Takes over a descriptor a peer says is its userfaultfd, after checking that it is one
    /// (its anonymous inode), that its API handshake is done (else the peer could still enable
    /// anything), and that it enables no event kind the pager does not handle: `EVENT_FORK`
    /// (the kernel would install the forked child's descriptors in this process) and
    /// `EVENT_REMAP` (the pager does not follow moved ranges); unknown feature bits are refused
    /// too. Returns the wrapper and the features the peer enabled.
    pub fn adopt(fd: OwnedFd) -> Result<(Self, u64), AdoptError> {
        let raw = fd.as_raw_fd();
        let inspect = |what| {
            move |source| AdoptError::Inspect {
                fd: raw,
                what,
                source,
            }
        };
        let link =
            std::fs::read_link(format!("/proc/self/fd/{raw}")).map_err(inspect("/proc/self/fd"))?;
        if link.as_os_str() != "anon_inode:[userfaultfd]" {
            return Err(AdoptError::NotUffd {
                fd: raw,
                found: link.to_string_lossy().into_owned(),
            });
        }
        // Doing the API handshake ourselves succeeds only if the peer never did it: then the
        // descriptor is refused (it is now locked to no features, whatever the peer tries).
        let mut api = sys::uffdio_api {
            api: u64::from(sys::UFFD_API),
            features: 0,
            ioctls: 0,
        };
        // SAFETY: `api` is the uffdio_api structure UFFDIO_API expects; `fd` is a userfaultfd.
        if unsafe { ioctl(raw, nr::UFFDIO_API, &mut api) } == 0 {
            return Err(AdoptError::NotInitialized);
        }
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{raw}"))
            .map_err(inspect("/proc/self/fdinfo"))?;
        let features = fdinfo_features(&info).ok_or(AdoptError::Fdinfo { fd: raw })?;
        let features = features & !feature::INITIALIZED;
        let refused = features & (feature::EVENT_FORK | feature::EVENT_REMAP | !feature::KNOWN);
        if refused != 0 {
            let mut names = Vec::new();
            if refused & feature::EVENT_FORK != 0 {
                names.push("EVENT_FORK (the kernel would install descriptors in the server)");
            }
            if refused & feature::EVENT_REMAP != 0 {
                names.push("EVENT_REMAP (moved ranges are not followed)");
            }
            if refused & !feature::KNOWN != 0 {
                names.push("unknown features");
            }
            return Err(AdoptError::Features {
                features,
                refused,
                names: names.join(", "),
            });
        }
        Ok((Self { fd }, features))
    }

    /// Registers `range` for faults of `mode`.
    ///
    /// # Safety
    ///
    /// `range` must be mapped in the process that owns this userfaultfd and stay mapped (or be
    /// unregistered) for as long as faults in it may be resolved; the kernel will fill pages of
    /// it at any time, so nothing may rely on its contents except through the pager.
    pub unsafe fn register(&self, range: HostRange, mode: Mode) -> Result<(), UffdError> {
        let mut arg = sys::uffdio_register {
            range: sys::uffdio_range {
                start: range.start().0,
                len: range.len(),
            },
            mode: mode.bits(),
            ioctls: 0,
        };
        // SAFETY: `arg` is the uffdio_register structure UFFDIO_REGISTER expects; the caller
        // guarantees the range's lifetime.
        let rc = unsafe { ioctl(self.fd(), nr::UFFDIO_REGISTER, &mut arg) };
        if rc != 0 {
            return Err(UffdError::Register {
                range,
                mode: mode.name(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Unregisters `range`; its pages stay as they are.
    pub fn unregister(&self, range: HostRange) -> Result<(), UffdError> {
        let mut arg = sys::uffdio_range {
            start: range.start().0,
            len: range.len(),
        };
        // SAFETY: `arg` is the uffdio_range structure UFFDIO_UNREGISTER expects.
        let rc = unsafe { ioctl(self.fd(), nr::UFFDIO_UNREGISTER, &mut arg) };
        if rc != 0 {
            return Err(UffdError::Register {
                range,
                mode: "unregister",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Fills the missing pages at `dst` with `src` (page multiple) and maps them; wakes the
    /// faulting threads if `wake`.
    pub fn copy(&self, dst: HostAddr, src: &[u8], wake: bool) -> Result<Resolved, UffdError> {
        let mut arg = sys::uffdio_copy {
            dst: dst.0,
            src: src.as_ptr() as u64,
            len: src.len() as u64,
            mode: if wake {
                0
            } else {
                u64::from(sys::UFFDIO_COPY_MODE_DONTWAKE)
            },
            copy: 0,
        };
        // SAFETY: `arg` is a valid uffdio_copy; `src` is readable for `len` bytes for the
        // duration of the call; the kernel writes only inside ranges registered on this fd.
        let rc = unsafe { ioctl(self.fd(), nr::UFFDIO_COPY, &mut arg) };
        resolve("UFFDIO_COPY", dst, src.len() as u64, rc, arg.copy)
    }

    /// Maps the shared zero page over the missing pages of `range`.
    pub fn zeropage(&self, range: HostRange, wake: bool) -> Result<Resolved, UffdError> {
        let mut arg = sys::uffdio_zeropage {
            range: sys::uffdio_range {
                start: range.start().0,
                len: range.len(),
            },
            mode: if wake {
                0
            } else {
                u64::from(sys::UFFDIO_ZEROPAGE_MODE_DONTWAKE)
            },
            zeropage: 0,
        };
        // SAFETY: `arg` is a valid uffdio_zeropage; the kernel maps only registered ranges.
        let rc = unsafe { ioctl(self.fd(), nr::UFFDIO_ZEROPAGE, &mut arg) };
        resolve(
            "UFFDIO_ZEROPAGE",
            range.start(),
            range.len(),
            rc,
            arg.zeropage,
        )
    }

    /// Maps the page-cache pages of `range` (MINOR faults): nothing is copied.
    pub fn continue_range(&self, range: HostRange, wake: bool) -> Result<Resolved, UffdError> {
        let mut arg = sys::uffdio_continue {
            range: sys::uffdio_range {
                start: range.start().0,
                len: range.len(),
            },
            mode: if wake {
                0
            } else {
                UFFDIO_CONTINUE_MODE_DONTWAKE
            },
            mapped: 0,
        };
        // SAFETY: `arg` is a valid uffdio_continue; the kernel maps only registered ranges.
        let rc = unsafe { ioctl(self.fd(), nr::UFFDIO_CONTINUE, &mut arg) };
        resolve(
            "UFFDIO_CONTINUE",
            range.start(),
            range.len(),
            rc,
            arg.mapped,
        )
    }

    /// Write-protects the present pages of `range` (registered write-protect). With
    /// `WP_ASYNC` the kernel resolves the next write itself and marks the page written (see
    /// [`crate::pagemap`]); only `range` loses its mappings in KVM and other secondary MMUs.
    pub fn write_protect(&self, range: HostRange) -> Result<(), UffdError> {
        let mut arg = sys::uffdio_writeprotect {
            range: sys::uffdio_range {
                start: range.start().0,
                len: range.len(),
            },
            mode: UFFDIO_WRITEPROTECT_MODE_WP,
        };
        // SAFETY: `arg` is a valid uffdio_writeprotect; the kernel only changes protection of
        // ranges registered on this fd.
        let rc = unsafe { ioctl(self.fd(), nr::UFFDIO_WRITEPROTECT, &mut arg) };
        resolve("UFFDIO_WRITEPROTECT", range.start(), range.len(), rc, 0).map(|_| ())
    }

    /// Moves the anonymous pages of `src .. src + len` to the unmapped `dst .. dst + len`:
    /// their page-table entries move, nothing is copied; `src` is left missing (its next
    /// access faults to this userfaultfd if registered). Wakes `dst`'s waiters if `wake`. An
    /// error reports the bytes moved before it in [`UffdError::MovePartial`].
    ///
    /// # Safety
    ///
    /// Both ranges must be private anonymous mappings of this process registered on this
    /// userfaultfd, and nothing may hold a reference into `src` (its contents vanish) or `dst`.
    pub unsafe fn move_pages(
        &self,
        dst: HostAddr,
        src: HostAddr,
        len: u64,
        wake: bool,
    ) -> Result<u64, UffdError> {
        let mut arg = sys::uffdio_move {
            dst: dst.0,
            src: src.0,
            len,
            mode: if wake { 0 } else { UFFDIO_MOVE_MODE_DONTWAKE },
            move_: 0,
        };
        // SAFETY: `arg` is a valid uffdio_move; the caller vouches for both ranges.
        let rc = unsafe { ioctl(self.fd(), UFFDIO_MOVE, &mut arg) };
        if rc == 0 {
            return Ok(len);
        }
        let err = std::io::Error::last_os_error();
        let done = u64::try_from(arg.move_).unwrap_or(0);
        Err(UffdError::MovePartial {
            src,
            dst,
            done,
            source: err,
        })
    }

    /// Fills every missing page of `dst .. dst + src.len()` from `src` (a multiple of
    /// `page`, the mapping's page size), skipping pages that are already mapped, then wakes
    /// the waiters of the whole range if `wake`. Returns the bytes this call filled.
    /// `Err(Retry { done })` means the address space changed under it (a `REMOVE` event is
    /// pending): the first `done` bytes are settled; read events, then call again for the rest.
    pub fn copy_missing(
        &self,
        dst: HostAddr,
        src: &[u8],
        page: PageSize,
        wake: bool,
    ) -> Result<u64, UffdError> {
        self.settle_missing(dst, src.len() as u64, page, wake, |offset| {
            self.copy(HostAddr(dst.0 + offset), &src[offset as usize..], false)
        })
    }

    /// Maps the zero page over every missing page of `range`, skipping pages that are
    /// already mapped, then wakes the waiters of the whole range if `wake`. Returns the bytes
    /// this call mapped; errors as for [`Userfaultfd::copy_missing`]. Base pages only: the
    /// kernel has no zero page to map in hugetlb mappings.
    pub fn zeropage_missing(&self, range: HostRange, wake: bool) -> Result<u64, UffdError> {
        self.settle_missing(range.start(), range.len(), PageSize::BASE, wake, |offset| {
            let rest = HostRange::new(HostAddr(range.start().0 + offset), range.len() - offset)
                .expect("a page-aligned tail of a valid range");
            self.zeropage(rest, false)
        })
    }

    /// Maps the page-cache pages of `range` (MINOR faults; a multiple of `page`, the
    /// mapping's page size), skipping pages already mapped, then wakes the waiters of the whole
    /// range if `wake`. Returns the bytes mapped; errors as for [`Userfaultfd::copy_missing`].
    pub fn continue_missing(
        &self,
        range: HostRange,
        page: PageSize,
        wake: bool,
    ) -> Result<u64, UffdError> {
        self.settle_missing(range.start(), range.len(), page, wake, |offset| {
            let rest = HostRange::new(HostAddr(range.start().0 + offset), range.len() - offset)
                .expect("a page-aligned tail of a valid range");
            self.continue_range(rest, false)
        })
    }

    /// Runs `step(offset)` (one DONTWAKE ioctl on `dst + offset ..`) until `len` bytes are
    /// settled: an already-mapped page (of `page` bytes) is skipped, partial progress
    /// continues, no progress on EAGAIN stops with `Retry`. Then wakes the whole range if
    /// `wake`.
    fn settle_missing(
        &self,
        dst: HostAddr,
        len: u64,
        page: PageSize,
        wake: bool,
        mut step: impl FnMut(u64) -> Result<Resolved, UffdError>,
    ) -> Result<u64, UffdError> {
        let mut offset = 0u64;
        let mut filled = 0u64;
        while offset < len {
            match step(offset) {
                Ok(Resolved::Done) => {
                    filled += len - offset;
                    offset = len;
                }
                Ok(Resolved::AlreadyMapped { done }) => {
                    // `done` bytes were filled, then one page was found mapped: skip it.
                    filled += done;
                    offset += done + page.bytes();
                }
                // Partial progress also ends in EAGAIN; only no progress means "stop".
                Err(UffdError::Retry { done, .. }) if done > 0 => {
                    filled += done;
                    offset += done;
                }
                Err(UffdError::Retry { op, .. }) => {
                    return Err(UffdError::Retry {
                        op,
                        addr: dst,
                        done: offset,
                    })
                }
                Err(e) => return Err(e),
            }
        }
        if wake {
            let range = HostRange::new(dst, len).map_err(|_| UffdError::Ioctl {
                op: "UFFDIO_WAKE",
                addr: dst,
                len,
                source: std::io::Error::from_raw_os_error(libc::EINVAL),
            })?;
            self.wake(range)?;
        }
        Ok(filled)
    }

    /// Wakes threads waiting on faults in `range` (after `EEXIST`, or after DONTWAKE batches).
    pub fn wake(&self, range: HostRange) -> Result<(), UffdError> {
        let mut arg = sys::uffdio_range {
            start: range.start().0,
            len: range.len(),
        };
        // SAFETY: `arg` is a valid uffdio_range; WAKE only wakes waiters.
        let rc = unsafe { ioctl(self.fd(), nr::UFFDIO_WAKE, &mut arg) };
        match resolve("UFFDIO_WAKE", range.start(), range.len(), rc, 0) {
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Reads the events that are ready into `out` (cleared first), without blocking; returns
    /// how many were read (0 when none are ready).
    pub fn read_events(&self, out: &mut Vec<Event>) -> Result<usize, UffdError> {
        const BATCH: usize = 64;
        let msg_size = std::mem::size_of::<sys::uffd_msg>();
        let mut msgs = [std::mem::MaybeUninit::<sys::uffd_msg>::uninit(); BATCH];
        out.clear();
        // SAFETY: `msgs` is writable for BATCH messages; read(2) writes at most that much.
        let n = unsafe { libc::read(self.fd(), msgs.as_mut_ptr().cast(), BATCH * msg_size) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            return match err.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(0),
                _ => Err(UffdError::Read(err)),
            };
        }
        let n = n.unsigned_abs();
        if !n.is_multiple_of(msg_size) {
            return Err(UffdError::ShortRead(n));
        }
        for msg in &msgs[..n / msg_size] {
            // SAFETY: the kernel filled these messages.
            let msg = unsafe { msg.assume_init_ref() };
            out.push(parse_event(msg));
        }
        Ok(out.len())
    }

    /// Waits up to `timeout_ms` (-1: forever) for events or for `extra` (e.g. an eventfd used
    /// to stop) to become readable. Returns `(uffd_ready, extra_ready)`.
    pub fn poll(&self, extra: Option<RawFd>, timeout_ms: i32) -> std::io::Result<(bool, bool)> {
        let mut fds = [
            libc::pollfd {
                fd: self.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: extra.unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfd; a negative fd is ignored by poll.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                return Ok((false, false));
            }
            return Err(err);
        }
        let ready =
            |f: &libc::pollfd| f.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0;
        Ok((ready(&fds[0]), ready(&fds[1])))
    }

    fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsRawFd for Userfaultfd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}

impl std::os::fd::AsFd for Userfaultfd {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Issues a userfaultfd ioctl.
///
/// # Safety
///
/// `arg` must be the argument structure that `request` expects.
unsafe fn ioctl<T>(fd: RawFd, request: u32, arg: &mut T) -> libc::c_int {
    // SAFETY: forwarded from the caller.
    unsafe { libc::ioctl(fd, libc::c_ulong::from(request), arg as *mut T) }
}

/// Translates the result of a resolving ioctl. `count` is the kernel's progress field (bytes
/// done, or a negative errno).
fn resolve(
    op: &'static str,
    addr: HostAddr,
    len: u64,
    rc: libc::c_int,
    count: i64,
) -> Result<Resolved, UffdError> {
    if rc == 0 {
        return Ok(Resolved::Done);
    }
    let err = std::io::Error::last_os_error();
    let done = u64::try_from(count).unwrap_or(0);
    match err.raw_os_error() {
        Some(libc::EEXIST) => Ok(Resolved::AlreadyMapped { done }),
        Some(libc::EAGAIN) => Err(UffdError::Retry { op, addr, done }),
        Some(libc::ESRCH) => Err(UffdError::OwnerGone { op, addr }),
        Some(libc::ENOENT) => Err(UffdError::Unmapped { op, addr }),
        _ => Err(UffdError::Ioctl {
            op,
            addr,
            len,
            source: err,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_event_fake_fork_leaves_the_named_descriptor_open() {
        let victim = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: an all-zero uffd_msg is a valid value of the plain-data union.
        let mut msg: sys::uffd_msg = unsafe { std::mem::zeroed() };
        msg.event = sys::UFFD_EVENT_FORK as u8;
        msg.arg.fork.ufd = victim.as_raw_fd().cast_unsigned();
        assert_eq!(parse_event(&msg), Event::Fork);
        // Still open: fcntl succeeds on it.
        // SAFETY: F_GETFD on a descriptor number, no memory involved.
        assert!(unsafe { libc::fcntl(victim.as_raw_fd(), libc::F_GETFD) } >= 0);
    }

    #[test]
    fn fdinfo_features_linux_format_is_parsed() {
        let info = "pos:\t0\nflags:\t02004000\nmnt_id:\t17\nino:\t1\npending:\t0\ntotal:\t3\nAPI:\taa:8000000a:80000000000001ff\n";
        assert_eq!(fdinfo_features(info), Some(0x8000_000a));
        assert_eq!(fdinfo_features("pos:\t0\n"), None);
        assert_eq!(fdinfo_features("API:\tab:0:0\n"), None);
        assert_eq!(fdinfo_features("API:\taa:zz:0\n"), None);
        assert_eq!(fdinfo_features("API:\taa:1\n"), None);
    }
}
