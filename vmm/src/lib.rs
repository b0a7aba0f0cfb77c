//! The KVM VMM: one VM per process, guest RAM delegated to the in-process pager, the built-in
//! workload guest, and the `pvisor` command line.
//!
//! - [`control`]: the control socket's protocol, server and client.
//! - [`detached`]: a VM in a process of its own under a supervisor (`pvisor run --detach`).
//! - [`dedup`]: KSM dedup of guest RAM (`--vm-ram-dedup`).
//! - [`gateway`]: the model gateway: a VM's model requests over HTTP, answers kept until taken.
//! - [`governor`]: the memory governor: many VMs inside one host memory budget.
//! - [`guest`]: the workload guest's binary, layout, mailbox and digest.
//! - [`hugepages`]: the host's pool of 2 MiB huge pages, checked before hugetlb RAM is mapped.
//! - [`machine`]: one VM: RAM, pager, vCPU, block device; runs commands.
//! - [`memory`]: guest RAM (anon, memfd, hugetlb, hugetlb-memfd, or a snapshot image mapped
//!   privately).
//! - [`operator`]: operator requests that reach a VM while it waits for the model.
//! - [`replay`]: trajectories and the local model server that replays them.
//! - [`runtime`]: the runtime directory, job ids and identities.
//! - [`sampler`]: memory × time sampling with its own integrity check.
//! - [`script`]: workload scripts.
//! - [`sharing`]: this VM's side of page sharing through the memory pool (`--vm-memory-pool`).
//! - [`snapshot`]: sealed snapshots, their copy-on-write restore and private-page offload.
//! - [`stats`]: PSS and memory-cgroup readings.
//! - [`wait`]: the wait coordinator's policy (pause, offload, resume around model waits).
//! - [`vm`]: a VM's lifecycle (running, paused, offloaded) and operations.

// Library code does not print (clippy.toml's `disallowed-macros`): it returns errors, counts,
// and logs through `tracing`; its tests may print.
#![cfg_attr(not(test), warn(clippy::disallowed_macros))]

pub mod arena;
pub mod charged;
pub mod control;
pub mod dedup;
pub mod detached;
pub mod gateway;
pub mod governor;
pub mod guest;
pub mod hugepages;
pub mod image;
pub mod machine;
pub mod memory;
pub mod net;
pub mod operator;
pub mod replay;
pub mod runtime;
pub mod sampler;
pub mod script;
pub mod sharing;
pub mod snapshot;
pub mod stats;
pub mod vm;
pub mod wait;
