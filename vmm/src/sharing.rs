//! `--vm-memory-pool SOCKET`: this VM's side of the memory pool (`uffd_pager::sharing`).
//!
//! Between commands (the vCPU is stopped, so nothing writes guest RAM) the VM offers the
//! hashes of the pages it holds privately, merges the pages the pool holds with the same bytes
//! (compared byte for byte, then the pool's memfd mapped `MAP_PRIVATE | MAP_FIXED` over them:
//! reads share the pool's page, a write makes a private copy again), and tells the pool which
//! pool pages it stopped using. Ticks back off while nothing changes.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use uffd_pager::sharing::{PageSet, PoolClient, PoolError, PoolStats};
use vm_memory::{Bytes, GuestAddress};

use crate::memory::GuestRam;

use basics::PAGE_SIZE as PAGE;
/// The first tick after a command, and the shortest period.
const FIRST: Duration = Duration::from_millis(200);
/// The longest period while nothing changes.
const LONGEST: Duration = Duration::from_secs(8);

/// What the pool did for this VM.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PoolLinkStats {
    /// Still talking to the daemon.
    pub connected: bool,
    /// Why not, if it stopped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Guest pages mapped from the pool now.
    pub merged_pages: u64,
    /// Ticks so far.
    pub ticks: u64,
    /// Pages offered at the last tick.
    pub last_offered_pages: u64,
    /// Pages whose bytes differed from the pool's when compared (not merged).
    pub compare_mismatches: u64,
    /// Pool pages given back after the VM wrote them.
    pub released_pages: u64,
    /// CPU-side wall time of the last tick, milliseconds.
    pub last_tick_ms: f64,
    /// The daemon's counters at the last reply.
    pub daemon: PoolStats,
}

/// A VM's link to the pool.
#[derive(Debug)]
pub struct PoolLink {
    client: Option<PoolClient>,
    merged: PageSet,
    stats: PoolLinkStats,
    period: Duration,
    next: Instant,
}

impl PoolLink {
    /// Attaches `ram` (anon RAM) to the pool at `socket`.
    pub fn attach(socket: &Path, ram: &GuestRam) -> Result<Self, PoolError> {
        let client = PoolClient::attach(socket, ram.host_base().0, ram.size())?;
        Ok(Self {
            client: Some(client),
            merged: PageSet::new(ram.size() / PAGE),
            stats: PoolLinkStats {
                connected: true,
                ..PoolLinkStats::default()
            },
            period: FIRST,
            next: Instant::now() + FIRST,
        })
    }

    /// How long until the next tick is due (zero: now).
    pub fn wait(&self) -> Option<Duration> {
        self.client
            .as_ref()
            .map(|_| self.next.saturating_duration_since(Instant::now()))
    }

    /// The guest ran: tick again soon.
    pub fn wrote(&mut self) {
        self.period = FIRST;
        self.next = Instant::now() + FIRST;
    }

    /// The counters.
    pub fn stats(&self) -> PoolLinkStats {
        let mut stats = self.stats.clone();
        stats.merged_pages = self.merged.len();
        stats
    }

    /// Offers, merges and releases. Call only while the vCPU is stopped. A broken link is
    /// recorded (stats) and not retried: the pages merged so far stay mapped and correct.
    pub fn tick(&mut self, ram: &GuestRam) {
        let started = Instant::now();
        let Some(client) = self.client.as_mut() else {
            return;
        };
        let result = tick(client, ram, &mut self.merged, &mut self.stats);
        // The tick's lists and messages are freed by now; hand the heap's free pages back, so
        // that the pool does not cost the VM what it saves.
        // SAFETY: malloc_trim only releases free memory of the allocator.
        unsafe { libc::malloc_trim(0) };
        self.stats.ticks += 1;
        self.stats.last_tick_ms = started.elapsed().as_secs_f64() * 1e3;
        match result {
            Ok(changed) => {
                self.period = if changed {
                    FIRST
                } else {
                    (self.period * 2).min(LONGEST)
                };
                self.next = Instant::now() + self.period;
            }
            Err(e) => {
                self.stats.connected = false;
                self.stats.error = Some(basics::error_chain(&e));
                self.client = None;
            }
        }
    }
}

/// One round; returns whether anything was merged or released.
fn tick(
    client: &mut PoolClient,
    ram: &GuestRam,
    merged: &mut PageSet,
    stats: &mut PoolLinkStats,
) -> Result<bool, PoolError> {
    let (private, _) = ram.resident_pages().map_err(|source| PoolError::Io {
        op: "read /proc/self/pagemap",
        source,
    })?;
    // Merged pages the guest wrote since are private again.
    let released: Vec<u64> = private
        .iter()
        .copied()
        .filter(|p| merged.remove(*p))
        .collect();
    let mut buf = vec![0u8; PAGE as usize];
    let mut offers = Vec::with_capacity(private.len());
    for &page in &private {
        read(ram, page, &mut buf)?;
        if buf.iter().all(|&b| b == 0) {
            continue;
        }
        offers.push((page, xxhash_rust::xxh3::xxh3_64(&buf)));
    }
    stats.last_offered_pages = offers.len() as u64;
    stats.released_pages += released.len() as u64;
    let released_any = !released.is_empty();
    let reply = client.offer(offers, released)?;
    let mut theirs = vec![0u8; PAGE as usize];
    let mut equal = Vec::new();
    for &page in &reply.merge {
        read(ram, page, &mut buf)?;
        client
            .pool()
            .read_exact_at(&mut theirs, page * PAGE)
            .map_err(|source| PoolError::Io {
                op: "read the pool's page",
                source,
            })?;
        if buf == theirs {
            equal.push(page);
        } else {
            stats.compare_mismatches += 1;
        }
    }
    let mapped = map_runs(ram, client.pool(), &equal);
    let reply = client.merged(mapped.clone())?;
    stats.daemon = reply.stats;
    let changed = !mapped.is_empty() || released_any;
    for page in mapped {
        merged.insert(page);
    }
    Ok(changed)
}

fn read(ram: &GuestRam, page: u64, buf: &mut [u8]) -> Result<(), PoolError> {
    ram.memory()
        .read_slice(buf, GuestAddress(page * PAGE))
        .map_err(|e| PoolError::Protocol(format!("guest page {page}: {e}")))
}

/// Maps the pool over runs of `pages` (sorted); returns the pages mapped.
fn map_runs(ram: &GuestRam, pool: &File, pages: &[u64]) -> Vec<u64> {
    let mut mapped = Vec::new();
    for (start, end) in crate::memory::page_runs(pages) {
        let range = ram
            .host_range(start * PAGE, (end - start) * PAGE)
            .expect("pages of RAM");
        let Ok(len) = usize::try_from(range.len()) else {
            continue;
        };
        let Ok(offset) = libc::off_t::try_from(start * PAGE) else {
            continue;
        };
        // SAFETY: the range is inside our guest-RAM mapping, which outlives this mapping (it
        // unmaps the whole range when dropped). Its bytes were just compared equal to the
        // pool's pages at the same offsets, and nothing writes guest RAM meanwhile (the vCPU
        // is stopped; this RAM has no cold compression), so the guest sees the same bytes.
        let ptr = unsafe {
            libc::mmap(
                range.start().as_ptr(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED,
                pool.as_raw_fd(),
                offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            // Stop and report what was done. (Should the failure have come after the old
            // mapping went, the guest's next access to it fails loudly in KVM: it can never
            // read bytes that are not its own.)
            break;
        }
        mapped.extend(start..end);
    }
    mapped
}
