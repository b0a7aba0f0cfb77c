//! The lazy memory service: serves guest-RAM page faults through userfaultfd from the zero
//! page, a compressed memory pool, an on-disk store or a raw memory file.
//!
//! - [`addr`]: host addresses and page-aligned ranges.
//! - [`uffd`]: the safe userfaultfd wrapper.
//! - [`metrics`]: counters and the fault-latency histogram.
//! - [`state`]: the flat per-page state table.
//! - [`pager`]: [`Pager`](pager::Pager): regions, fault threads, fault resolution.
//! - [`cold`]: live cold-RAM compression into the memory pool.
//! - [`discard`]: the one way guest RAM's pages are freed, whatever its kind.
//! - [`journal`]: a VM's page-state table in a memfd, to outlive a server restart.
//! - [`limit`]: the resident limit, at which faults and loads are held.
//! - [`load`]: bringing offloaded RAM back: on faults only, lazily with prefetch, or eagerly.
//! - [`logging`]: the binaries' log, `object_store`'s retry lines kept to a few.
//! - [`offload`]: offload of a paused VM's RAM to a store.
//! - [`pagemap`]: which pages were written (`PAGEMAP_SCAN`).
//! - [`sharing`]: page sharing between VMs, the memory-pool daemon and its client: pages VMs
//!   share read-only.
//! - [`server`]: the standalone server (Firecracker's UFFD handshake).
//! - [`socket`]: private Unix sockets and the check of who connected.
//! - [`source`]: where non-resident pages come from (raw memory file, store).

// Library code does not print (clippy.toml's `disallowed-macros`); its tests may.
#![cfg_attr(not(test), warn(clippy::disallowed_macros))]

pub mod addr;
pub mod cold;
pub mod discard;
pub mod journal;
pub mod limit;
pub mod load;
pub mod logging;
pub mod metrics;
pub mod offload;
pub mod pagemap;
pub mod pager;
pub mod remote_args;
pub mod server;
pub mod sharing;
pub mod socket;
pub mod source;
pub mod state;
pub mod uffd;
