//! Huge pages for a test or a bench: lends the host's kernel `pages` more 2 MiB surplus pages
//! to give (`nr_overcommit_hugepages`), for as long as the guard lives, and puts the host's
//! value back afterwards.
//!
//! A bench that times faults on huge pages takes them from a pool reserved up front instead
//! (`nr_hugepages`, [`HugePages::reserve`]): a surplus page is made when it is first faulted,
//! and where memory is fragmented the kernel may compact it first, a stall of up to seconds
//! in the middle of what is timed.
//!
//! Tests run in parallel threads and in several processes, and each would read the host's
//! value and write its own: the guard holds an exclusive `flock` on a lock file for its whole
//! life, so that one test at a time changes the setting. The lock file keeps the host's values
//! while the settings are changed: a holder that was killed before it could put them back is
//! undone by the next one.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::Path;

/// The setting the guard raises.
pub const OVERCOMMIT: &str = "/proc/sys/vm/nr_overcommit_hugepages";
/// The lock that serializes the tests that raise it.
const LOCK: &str = "/run/lock/pvisor-test-hugepages";
/// The host's 2 MiB pool.
const POOL: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";
/// The pool's reserved (persistent) pages.
pub const RESERVED: &str = "/proc/sys/vm/nr_hugepages";

/// While it lives, the kernel may lend `pages` more 2 MiB huge pages than the host allowed.
#[derive(Debug)]
pub struct HugePages {
    lock: File,
    host: u64,
    /// Surplus pages in use when the pages were lent.
    surplus: u64,
    /// The host's reserved pages, where [`HugePages::reserve`] raised them.
    reserved: Option<u64>,
}

/// A pool counter (`free_hugepages`, `surplus_hugepages`, …) of the 2 MiB pool now.
pub fn pool_count(name: &str) -> u64 {
    read_count(&Path::new(POOL).join(name))
}

fn read_count(path: &Path) -> u64 {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{} is not a count: {e}", path.display()))
}

fn write_count(value: u64) {
    write_setting(OVERCOMMIT, value);
}

fn write_setting(path: &str, value: u64) {
    std::fs::write(path, format!("{value}\n"))
        .unwrap_or_else(|e| panic!("cannot write {path} (needs root): {e}"));
}

impl HugePages {
    /// Waits for the other holders, then lets the kernel lend `pages` more surplus huge pages.
    pub fn lend(pages: u64) -> Self {
        if let Some(dir) = Path::new(LOCK).parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let mut lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(LOCK)
            .unwrap_or_else(|e| panic!("cannot open {LOCK}: {e}"));
        // SAFETY: flock on a descriptor this function owns.
        let rc = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
        assert_eq!(rc, 0, "flock {LOCK}: {}", std::io::Error::last_os_error());
        let mut left = String::new();
        lock.read_to_string(&mut left).expect("read the lock file");
        // A holder died with the settings raised: the host's values are the ones it kept.
        let mut kept = left.split_whitespace().map(str::parse::<u64>);
        if let Some(Ok(host)) = kept.next() {
            write_count(host);
        }
        if let Some(Ok(reserved)) = kept.next() {
            write_setting(RESERVED, reserved);
        }
        let host = read_count(Path::new(OVERCOMMIT));
        lock.set_len(0).expect("truncate the lock file");
        lock.rewind().expect("rewind the lock file");
        write!(lock, "{host}").expect("keep the host's value");
        lock.sync_data().expect("sync the lock file");
        write_count(host + pages);
        let surplus = pool_count("surplus_hugepages");
        Self {
            lock,
            host,
            surplus,
            reserved: None,
        }
    }

    /// As [`HugePages::lend`], and `pages` more reserved in the pool now, made before anything
    /// is timed; returns how many of them the kernel could make (fewer where memory is short
    /// or fragmented: the rest are lent as surplus pages).
    pub fn reserve(pages: u64) -> (Self, u64) {
        let mut guard = Self::lend(pages);
        let reserved = read_count(Path::new(RESERVED));
        guard.lock.rewind().expect("rewind the lock file");
        write!(guard.lock, "{} {reserved}", guard.host).expect("keep the host's values");
        guard.lock.sync_data().expect("sync the lock file");
        guard.reserved = Some(reserved);
        write_setting(RESERVED, reserved + pages);
        let made = read_count(Path::new(RESERVED)).saturating_sub(reserved);
        (guard, made)
    }

    /// Lets the kernel lend `pages` more than the host allowed from now on (0: the host's own
    /// setting), still under the lock.
    pub fn set(&self, pages: u64) {
        write_count(self.host + pages);
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        // A VM stopped at the end of a test may still be exiting, its huge pages not yet
        // given back: the next holder would find them gone. Give it a few seconds.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let surplus = || {
            std::fs::read_to_string(Path::new(POOL).join("surplus_hugepages"))
                .ok()
                .and_then(|text| text.trim().parse::<u64>().ok())
        };
        while surplus().is_some_and(|now| now > self.surplus)
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // Not a panic (a test may be unwinding): if the write fails, the lock file keeps the
        // value for the next holder to put back.
        if std::fs::write(OVERCOMMIT, format!("{}\n", self.host)).is_err() {
            return;
        }
        if let Some(reserved) = self.reserved {
            if std::fs::write(RESERVED, format!("{reserved}\n")).is_err() {
                return;
            }
        }
        let _ = self.lock.set_len(0);
        // The lock goes with the descriptor.
    }
}
