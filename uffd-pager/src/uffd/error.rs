//! What a userfaultfd operation reports when it fails, with the errno's meaning for a pager.

use std::os::fd::RawFd;

use crate::addr::{HostAddr, HostRange};

/// Errors of userfaultfd operations, with the errno translated.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    /// The userfaultfd could not be created.
    #[error("cannot create a userfaultfd through {via}")]
    Create {
        /// `/dev/userfaultfd` or the system call.
        via: &'static str,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel refused the API handshake or lacks a feature the pager needs.
    #[error("userfaultfd API handshake failed: asked for features {asked:#x}, kernel offers {offered:#x}")]
    Api {
        /// Features asked for.
        asked: u64,
        /// Features the kernel reported (0 if the call itself failed).
        offered: u64,
        /// The system error, if the call failed.
        #[source]
        source: Option<std::io::Error>,
    },
    /// Registration of a range failed.
    #[error("cannot register {range:?} ({mode})")]
    Register {
        /// The range.
        range: HostRange,
        /// The mode, for the message.
        mode: &'static str,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// `EAGAIN`: the ioctl stopped after `done` bytes. With `done == 0` the address space is
    /// changing (a `REMOVE` event is pending): read events, then retry. With `done > 0` it
    /// made partial progress (it stops at an already-mapped page): continue after it.
    #[error(
        "{op} at {addr}: address space changing, {done} bytes done; retry after reading events"
    )]
    Retry {
        /// The operation.
        op: &'static str,
        /// Where.
        addr: HostAddr,
        /// Bytes resolved before the interruption.
        done: u64,
    },
    /// `ESRCH`: the process owning the memory has exited.
    #[error("{op} at {addr}: the process owning the memory is gone")]
    OwnerGone {
        /// The operation.
        op: &'static str,
        /// Where.
        addr: HostAddr,
    },
    /// `ENOENT`: the range is no longer mapped (the owner unmapped or remapped it).
    #[error("{op} at {addr}: the range is no longer mapped")]
    Unmapped {
        /// The operation.
        op: &'static str,
        /// Where.
        addr: HostAddr,
    },
    /// Any other failure of a resolving ioctl.
    #[error("{op} of {len} bytes at {addr} failed")]
    Ioctl {
        /// The operation.
        op: &'static str,
        /// Where.
        addr: HostAddr,
        /// How much.
        len: u64,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// `UFFDIO_MOVE` failed after moving `done` bytes.
    #[error("UFFDIO_MOVE from {src} to {dst} failed after {done} bytes")]
    MovePartial {
        /// Source start.
        src: HostAddr,
        /// Destination start.
        dst: HostAddr,
        /// Bytes moved before the failure.
        done: u64,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// Reading events failed.
    #[error("cannot read userfaultfd events")]
    Read(#[source] std::io::Error),
    /// A read returned a partial event message.
    #[error("short read of {0} bytes from the userfaultfd")]
    ShortRead(usize),
}

/// Why a descriptor received from a peer is not accepted as its userfaultfd.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    /// The descriptor is something else (a pipe, `/dev/null`, a memfd, a socket...).
    #[error("descriptor {fd} is not a userfaultfd: it is `{found}`")]
    NotUffd {
        /// Its number here.
        fd: RawFd,
        /// What `/proc/self/fd` says it is.
        found: String,
    },
    /// Its kind or features could not be read.
    #[error("cannot inspect descriptor {fd} ({what})")]
    Inspect {
        /// Its number here.
        fd: RawFd,
        /// What was read.
        what: &'static str,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// `/proc/self/fdinfo` has no `API:` line the pager understands.
    #[error("cannot read the features of userfaultfd {fd} from its fdinfo")]
    Fdinfo {
        /// Its number here.
        fd: RawFd,
    },
    /// The peer never did the API handshake (it could still enable any feature later).
    #[error("the userfaultfd has not been through UFFDIO_API: it serves no registered memory")]
    NotInitialized,
    /// The peer enabled event kinds the pager does not handle.
    #[error("the userfaultfd enables features {refused:#x} (of {features:#x}) that the server refuses: {names}")]
    Features {
        /// All its features.
        features: u64,
        /// The refused ones.
        refused: u64,
        /// Their names.
        names: String,
    },
}
