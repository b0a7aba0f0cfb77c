//! The memory governor inside the daemon: every sandbox's VM runs in a memory cgroup of its
//! own under one budget cgroup (hard limit: `--memory-budget`) and joins the governor
//! (`vmm::governor`), which keeps the VMs' charges under the budget. It sets each VM's
//! resident limit (the VM's pager holds a fault that would cross it until room is made) and,
//! when room is short, has the VMs that run no command give their RAM back first. The daemon
//! admits a new sandbox only when the budget holds its start ([`Room::admits`]).
//!
//! The budget cgroup's name is kept in the state directory (`budget-cgroup`), so that a
//! restarted daemon governs the VMs its predecessor left where they are.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use vmm::governor::policy::{self, VmState};
use vmm::governor::server::{GovernorServer, ServerConfig};
use vmm::stats::MemoryCgroup;

/// The file in the state directory that names the budget cgroup.
const CGROUP_FILE: &str = "budget-cgroup";
/// The budget cgroup's name: this and 12 hex digits.
const CGROUP_PREFIX: &str = "pvisor-sandboxd-";

/// What a new sandbox is counted for until its VM's own charge is known: the governor's
/// default overhead of a VM (its process, page tables, KVM's part) and one grant of guest
/// RAM. A sandbox that runs commands gets more from the governor as it faults, like any VM.
pub fn start_need(config: &policy::Config) -> u64 {
    config.default_overhead + config.grant
}

/// The governor of the daemon's sandboxes.
pub struct Governed {
    server: Arc<GovernorServer>,
    stop: Arc<AtomicBool>,
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
    socket: PathBuf,
    /// The budget cgroup's name under this process's memory cgroup.
    cgroup: PathBuf,
    /// Its directory.
    dir: PathBuf,
    config: policy::Config,
}

impl std::fmt::Debug for Governed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Governed")
            .field("socket", &self.socket)
            .field("cgroup", &self.cgroup)
            .finish_non_exhaustive()
    }
}

/// How much of the budget is held and what of it can be had back, from the governor.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Room {
    /// The budget.
    pub budget: u64,
    /// The governor keeps the charges at or under this (its high watermark).
    pub high: u64,
    /// What the VMs are charged, the larger of the governor's sum and the budget cgroup's
    /// usage.
    pub usage: u64,
    /// What the VMs that run no command hold beyond their floor: an offload frees it.
    pub reclaimable: u64,
    /// VMs the governor knows.
    pub vms: usize,
    /// Their names (the sandboxes' ids): a live sandbox not among them is not counted yet.
    pub joined: std::collections::HashSet<String>,
}

impl Room {
    /// What the sandboxes hold and cannot give back now (those running commands, and every
    /// VM's floor), with `starting` more admitted whose VMs are not counted yet, needing
    /// `need` each.
    pub fn held(&self, starting: u64, need: u64) -> u64 {
        self.usage
            .saturating_sub(self.reclaimable)
            .saturating_add(need.saturating_mul(starting))
    }

    /// Whether one more sandbox, needing `need` to start, fits beside `starting` others
    /// admitted whose VMs are not counted yet, leaving `reserve` free under the governor's
    /// high watermark for commands to run in.
    pub fn admits(&self, starting: u64, need: u64, reserve: u64) -> bool {
        self.held(starting + 1, need).saturating_add(reserve) <= self.high
    }

    /// The budget as the governor's `status` has it (`remainder`: what it expects an offload
    /// to leave resident).
    fn of(status: &policy::Status, remainder: u64) -> Room {
        let reclaimable = status.vms.iter().map(|vm| reclaimable(vm, remainder)).sum();
        Room {
            budget: status.budget,
            high: status.high_bytes,
            usage: status.usage,
            reclaimable,
            vms: status.vms.len(),
            joined: status.vms.iter().map(|vm| vm.name.clone()).collect(),
        }
    }
}

/// What an offload or a revocation could take from `vm` now (`remainder`: what an offload
/// leaves resident).
fn reclaimable(vm: &policy::VmStatus, remainder: u64) -> u64 {
    if vm.order.is_some() {
        return 0;
    }
    match vm.state {
        // Between commands, or waiting for a model: an offload takes all but a remainder.
        VmState::Idle | VmState::Waiting { .. } => {
            vm.charge.saturating_sub(vm.overhead + remainder)
        }
        // Its limit beyond its resident is a reservation the governor revokes.
        VmState::Offloaded => vm.limit.unwrap_or(0).saturating_sub(vm.resident),
        VmState::Running => 0,
    }
}

/// Why the governor did not start.
#[derive(Debug, thiserror::Error)]
pub enum GovernedError {
    /// The budget cgroup's name in the state directory is not one.
    #[error("{path}: {why}")]
    Name {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The budget cgroup could not be made or limited.
    #[error("cannot make the budget cgroup {0} (the daemon needs the memory cgroup controller and the right to make cgroups)")]
    Cgroup(PathBuf, #[source] vmm::stats::CgroupError),
    /// The governor's socket.
    #[error("the memory governor")]
    Server(#[source] vmm::governor::server::ServerError),
    /// Its thread.
    #[error("cannot start the governor's thread")]
    Thread(#[source] std::io::Error),
}

/// The budget cgroup's name kept in `state`, or a new one written there.
fn cgroup_name(state: &Path) -> Result<PathBuf, GovernedError> {
    let path = state.join(CGROUP_FILE);
    let bad = |why: String| GovernedError::Name {
        path: path.clone(),
        why,
    };
    match compressed_backing::file::read_text_bounded(&path, 256) {
        Ok(text) => {
            let name = text.trim();
            let ok = name
                .strip_prefix(CGROUP_PREFIX)
                .is_some_and(|hex| hex.len() == 12 && hex.bytes().all(|b| b.is_ascii_hexdigit()));
            if !ok {
                return Err(bad(format!(
                    "`{name}` is not a budget cgroup's name ({CGROUP_PREFIX} and 12 hex digits)"
                )));
            }
            Ok(PathBuf::from(name))
        }
        Err(compressed_backing::file::FileError::Open { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            let hex = crate::sandboxes::random_hex(6).map_err(|e| bad(e.to_string()))?;
            let name = format!("{CGROUP_PREFIX}{hex}");
            crate::store::write_private(&path, name.as_bytes()).map_err(|e| bad(e.to_string()))?;
            Ok(PathBuf::from(name))
        }
        Err(e) => Err(bad(basics::error_chain(&e))),
    }
}

impl Governed {
    /// Makes (or finds) the budget cgroup of the state directory `state`, limited to
    /// `budget`, and starts the governor on `state/governor.sock`.
    pub fn start(state: &Path, budget: u64) -> Result<Governed, GovernedError> {
        let cgroup = cgroup_name(state)?;
        let limited = MemoryCgroup::create_limited(&cgroup, budget)
            .map_err(|e| GovernedError::Cgroup(cgroup.clone(), e))?;
        let config = policy::Config {
            budget,
            ..policy::Config::default()
        };
        let socket = state.join("governor.sock");
        let server = GovernorServer::bind(
            &socket,
            ServerConfig {
                policy: config.clone(),
                tick: Duration::from_millis(100),
                budget_cgroup: Some(limited.dir().to_path_buf()),
                peers: uffd_pager::socket::PeerPolicy::default(),
                pressure_level: vmm::stats::PressureLevel::default(),
            },
        )
        .map_err(GovernedError::Server)?;
        let server = Arc::new(server);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (server, stop) = (Arc::clone(&server), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("governor".into())
                .spawn(move || server.run(&stop))
                .map_err(GovernedError::Thread)?
        };
        tracing::info!(
            cgroup = %limited.dir().display(),
            budget,
            "memory governor up"
        );
        Ok(Governed {
            server,
            stop,
            thread: std::sync::Mutex::new(Some(thread)),
            socket,
            cgroup,
            dir: limited.dir().to_path_buf(),
            config,
        })
    }

    /// The governor's socket, for the VMs.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The memory cgroup of sandbox `id`'s VM, relative to this process's.
    pub fn vm_cgroup(&self, id: &str) -> PathBuf {
        self.cgroup.join(id)
    }

    /// What one more sandbox needs to start.
    pub fn start_need(&self) -> u64 {
        start_need(&self.config)
    }

    /// The budget now, as the governor sees it.
    pub fn room(&self) -> Room {
        self.reading().0
    }

    /// The budget now, and for each VM by name what it holds and cannot give back now (its
    /// charge less what is reclaimable) and its overhead.
    pub fn holdings(&self) -> (Room, std::collections::HashMap<String, (u64, u64)>) {
        let (room, status) = self.reading();
        let remainder = self.config.offload_remainder;
        let each = status
            .vms
            .iter()
            .map(|vm| {
                let held = vm.charge.saturating_sub(reclaimable(vm, remainder));
                (vm.name.clone(), (held, vm.overhead))
            })
            .collect();
        (room, each)
    }

    /// The budget now and the governor's whole status (for `GET /metrics`).
    pub fn reading(&self) -> (Room, policy::Status) {
        let status = self.server.policy_status();
        (Room::of(&status, self.config.offload_remainder), status)
    }

    /// Stops the governor (its VMs' links lift their limits and try again until another
    /// daemon's governor listens); with `remove`, the budget cgroup goes too (it must hold no
    /// VM by then).
    pub fn stop(&self, remove: bool) {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.socket);
        if remove {
            // Each VM removes its own cgroup as it ends (its supervisor, if it died).
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A VM of a status: its name, state, charge, overhead, limit, resident, whether an
    /// order runs.
    fn vm(
        name: &str,
        state: VmState,
        (charge, overhead): (u64, u64),
        (limit, resident): (Option<u64>, u64),
        order: bool,
    ) -> policy::VmStatus {
        policy::VmStatus {
            id: 0,
            name: name.into(),
            state,
            memory_bytes: 512 * MIB,
            resident,
            cgroup: None,
            pss: None,
            held: 0,
            limit,
            charge,
            overhead,
            overhead_learned: true,
            peak: resident,
            offloaded_bytes: 0,
            reachable: true,
            silent_ms: 0,
            order: order.then_some(policy::OrderStatus {
                kind: policy::OrderKind::Offload,
                age_ms: 0,
                expect_free: 0,
                timed_out: false,
            }),
            decisions: policy::DecisionCounts::default(),
        }
    }

    #[test]
    fn room_counts_what_idle_and_waiting_vms_can_give_back() {
        let governor = policy::Governor::new(policy::Config {
            budget: 1024 * MIB,
            ..policy::Config::default()
        });
        let mut status = governor.status(std::time::Instant::now());
        status.usage = 500 * MIB;
        let waiting = VmState::Waiting {
            expected_remaining: None,
        };
        status.vms = vec![
            vm(
                "sb-1",
                VmState::Idle,
                (100 * MIB, 20 * MIB),
                (None, 0),
                false,
            ),
            vm("sb-2", waiting, (50 * MIB, 10 * MIB), (None, 0), false),
            // Running a command, or offloading already: nothing to be had.
            vm(
                "sb-3",
                VmState::Running,
                (300 * MIB, 20 * MIB),
                (None, 0),
                false,
            ),
            vm("sb-4", VmState::Idle, (50 * MIB, 10 * MIB), (None, 0), true),
            // Below its floor: nothing, not less than nothing.
            vm("sb-5", VmState::Idle, (5 * MIB, 4 * MIB), (None, 0), false),
            // Offloaded: its reservation.
            vm(
                "sb-6",
                VmState::Offloaded,
                (70 * MIB, 4 * MIB),
                (Some(64 * MIB), 2 * MIB),
                false,
            ),
        ];
        let room = Room::of(&status, 4 * MIB);
        assert_eq!(room.reclaimable, (100 - 24 + 50 - 14 + 62) * MIB);
        assert_eq!(room.vms, 6);
        assert_eq!((room.budget, room.high), (1024 * MIB, status.high_bytes));
        assert!(room.joined.contains("sb-1") && room.joined.len() == 6);
        let room = Room {
            reclaimable: 112 * MIB,
            high: 900 * MIB,
            ..room
        };
        // Held: 500 - 112 = 388 MiB; 40 MiB each: 12 more fit under 900, not 13, and with
        // 100 MiB kept free, 10.
        assert_eq!(room.held(0, 40 * MIB), 388 * MIB);
        assert!(room.admits(11, 40 * MIB, 0));
        assert!(!room.admits(12, 40 * MIB, 0));
        assert!(room.admits(9, 40 * MIB, 100 * MIB));
        assert!(!room.admits(10, 40 * MIB, 100 * MIB));
        assert!(!Room::default().admits(0, 1, 0));
    }
}
