//! The memory governor (issue 13): one daemon keeps a host's agent VMs inside a memory budget.
//!
//! - [`policy`]: the decisions, pure and deterministic (no I/O, no clock of its own);
//! - [`server`]: `pvisor serve --memory-governor`, which reads the cgroups and the kernel's
//!   pressure, runs the policy and sends its decisions;
//! - [`client`]: a VM's link to it (`pvisor run --vm-governor`), which carries the limits to
//!   the pager and the offload orders to the VM's wait loop;
//! - [`protocol`]: what goes over the socket.
//!
//! **Who decides (the governor and wait management).** A VM's wait coordinator
//! ([`crate::wait`]) decides its pauses and offloads by itself, as without a governor: it
//! knows the wait, its expected length and what an offload of this VM costs. The governor
//! owns the decisions only the host can make: how much RAM each VM may hold (its *resident
//! limit*, enforced by the pager, which holds a fault that would cross it until room is
//! made) and, under pressure, which waiting VM gives its RAM back first. Its offload order
//! reaches the coordinator as [`crate::wait::WaitEvent::Reclaim`], which overrides the
//! cooldown and break-even (the governor weighed the cost against an OOM kill) but never an
//! operator's suspend, and is carried out by the same code as the coordinator's own offloads.
//! So one place (the coordinator) carries out every offload, and one place (the governor)
//! decides when the budget forces one.

pub mod client;
pub mod policy;
pub mod protocol;
pub mod server;
