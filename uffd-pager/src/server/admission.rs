//! What the server's threads wait on and are counted by: the connections in their handshake
//! (at most [`super::MAX_HANDSHAKES`], the oldest pushed out), the connection threads a
//! stopping server waits for ([`Open`]), and the one-way [`Signal`]s that end its loops at once.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{ServerStats, MAX_HANDSHAKES};

/// The connections in their handshake, oldest first, each with a handle to shut it down.
#[derive(Debug, Default)]
pub(super) struct Handshakes {
    queue: Mutex<std::collections::VecDeque<(u64, UnixStream)>>,
    next_id: AtomicU64,
}

impl Handshakes {
    /// Holds `stream` as in its handshake, pushing the oldest out (shut down) if
    /// [`MAX_HANDSHAKES`] are held already.
    pub(super) fn admit(
        this: &Arc<Self>,
        stream: &UnixStream,
        stats: &Arc<ServerStats>,
    ) -> std::io::Result<HandshakeSlot> {
        let handle = stream.try_clone()?;
        let id = this.next_id.fetch_add(1, Ordering::Relaxed);
        let mut queue = this.queue.lock().unwrap_or_else(|p| p.into_inner());
        let mut pushed_out = false;
        while queue.len() as u64 >= MAX_HANDSHAKES {
            let Some((_, oldest)) = queue.pop_front() else {
                break;
            };
            // Its thread's read ends at once; the thread then leaves.
            let _ = oldest.shutdown(std::net::Shutdown::Both);
            stats.handshakes_pushed_out.fetch_add(1, Ordering::Relaxed);
            pushed_out = true;
        }
        queue.push_back((id, handle));
        stats
            .handshaking
            .store(queue.len() as u64, Ordering::Relaxed);
        Ok(HandshakeSlot {
            handshakes: Arc::clone(this),
            stats: Arc::clone(stats),
            id,
            pushed_out,
        })
    }
}

/// A connection's place among the [`Handshakes`], given up on [`HandshakeSlot::finish`] or
/// drop.
pub(super) struct HandshakeSlot {
    handshakes: Arc<Handshakes>,
    stats: Arc<ServerStats>,
    id: u64,
    /// True if taking it pushed another connection out.
    pub(super) pushed_out: bool,
}

impl HandshakeSlot {
    /// Gives the place up; false if the connection was pushed out (shut down) meanwhile.
    /// Once this returns true, the connection can no longer be pushed out.
    pub(super) fn finish(&self) -> bool {
        let mut queue = self
            .handshakes
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let held = queue.iter().position(|(id, _)| *id == self.id);
        if let Some(at) = held {
            queue.remove(at);
        }
        self.stats
            .handshaking
            .store(queue.len() as u64, Ordering::Relaxed);
        held.is_some()
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Counts a connection thread in [`ServerStats::open`] for as long as it lives.
pub(crate) struct Open(Arc<ServerStats>);

impl Open {
    pub(crate) fn count(stats: &Arc<ServerStats>) -> Self {
        stats.open.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(stats))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The longest a loop of the server waits in `poll` before it looks at what no descriptor
/// tells it (a stop flag set without [`Server::wake`], a VMM found gone by its pager).
pub(super) const WAIT_MS: i32 = 1000;

/// Waits up to `timeout_ms` until `fd` is readable (or hung up) or `signal` is raised; true if
/// `fd` is.
pub(super) fn wait_readable(fd: i32, signal: Option<&Signal>, timeout_ms: i32) -> bool {
    let event = |fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // A negative descriptor is left out by poll.
    let mut fds = [event(fd), event(signal.map_or(-1, Signal::raw_fd))];
    // SAFETY: two valid pollfds.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
    rc > 0 && fds[0].revents != 0
}

/// A one-way switch that threads waiting in `poll` see at once: a flag, and an eventfd that
/// becomes readable, and stays so, when it is raised.
#[derive(Debug)]
pub(crate) struct Signal {
    raised: AtomicBool,
    fd: nix::sys::eventfd::EventFd,
}

impl Signal {
    pub(super) fn new() -> std::io::Result<Self> {
        use nix::sys::eventfd::{EfdFlags, EventFd};
        Ok(Self {
            raised: AtomicBool::new(false),
            fd: EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?,
        })
    }

    pub(crate) fn raise(&self) {
        self.raised.store(true, Ordering::SeqCst);
        // Never read: it stays readable. A full counter (it cannot be, at one write a
        // raise) would leave it readable too.
        let _ = self.fd.write(1);
    }

    pub(crate) fn is_raised(&self) -> bool {
        self.raised.load(Ordering::SeqCst)
    }

    fn raw_fd(&self) -> i32 {
        use std::os::fd::{AsFd, AsRawFd};
        self.fd.as_fd().as_raw_fd()
    }
}
