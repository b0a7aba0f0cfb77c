//! A VM with its lifecycle: running, paused, or offloaded (paused with its RAM in the store),
//! and the operations the control API offers on it.
//!
//! - `options`: what a VM is started with, its states and errors;
//! - `suspend`: suspend (pause, offload), resume, snapshot, and the offloaded RAM's view;
//! - `cost`: what `stats` reports: what the VM costs, what its parts did;
//! - here: the VM, its start, its commands and its background ticks.

mod cost;
mod options;
mod suspend;

pub use cost::{GovernorStats, VmStats};
pub use options::{GovernorOptions, RemoteSnapshot, VmError, VmOptions, VmState};
use suspend::{state_name, RamView};
pub use suspend::{ResumeReport, SuspendReport};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use compressed_backing::BlockSize;
use uffd_pager::pager::RamKind;

use crate::dedup::Dedup;
use crate::governor::client::{GovernorLink, LinkConfig, Order, ResidentControl};
use crate::governor::protocol::WireState;
use crate::machine::{CommandOutput, Machine, MachineConfig};
use crate::script::Command;
use crate::sharing::PoolLink;
use crate::snapshot;
use crate::stats::{self, MemoryCgroup};

/// The pager's resident limit as the governor's link drives it, and the guest RAM's span
/// (host address, bytes) whose PSS it reports.
struct PagerControl(
    uffd_pager::pager::ResidentHandle,
    (u64, u64),
    Option<uffd_pager::cold::ColdOrders>,
);

impl ResidentControl for PagerControl {
    fn set_limit(&self, limit: Option<u64>) {
        self.0.set_resident_limit(limit);
    }

    fn resident_bytes(&self) -> u64 {
        self.0.resident_bytes()
    }

    fn held_bytes(&self) -> u64 {
        self.0.held_bytes()
    }

    fn shortfall_bytes(&self) -> u64 {
        self.0.shortfall_bytes()
    }

    fn guest_pss_bytes(&self) -> Option<u64> {
        let (start, len) = self.1;
        stats::range_pss(start, len).ok()
    }

    fn compress_cold(&self, age: Duration) -> bool {
        self.2.as_ref().map(|orders| orders.compress(age)).is_some()
    }

    fn cold_order_pending(&self) -> bool {
        self.2
            .as_ref()
            .is_some_and(uffd_pager::cold::ColdOrders::pending)
    }
}

/// How often a governed VM looks at the governor's orders between commands.
const GOVERNOR_POLL: Duration = Duration::from_millis(50);

/// How long a model request may take before the guest gets an error instead.
pub const MODEL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// A VM and its state.
#[derive(Debug)]
pub struct Vm {
    ram_view: Option<RamView>,
    machine: Machine,
    options: VmOptions,
    state: VmState,
    cgroup: Option<MemoryCgroup>,
    fault_errors: Arc<AtomicU64>,
    dedup: Option<Dedup>,
    pool: Option<PoolLink>,
}

impl Vm {
    /// Joins the cgroup (before any guest RAM exists), then boots.
    pub fn start(options: VmOptions) -> Result<Self, VmError> {
        let cgroup = options
            .cgroup
            .as_deref()
            .map(MemoryCgroup::join)
            .transpose()?;
        let at = match (&options.restore, &options.restore_remote) {
            (Some(dir), _) => Some(snapshot::SnapshotAt::Dir(dir.clone())),
            (None, Some(remote)) => Some(remote.connect()?),
            (None, None) => None,
        };
        let restore = match &at {
            Some(at) => {
                // The cheap checks first, then every byte against the seal (in an object
                // store: the index against its seal, each block as it is fetched).
                let manifest = at.read_manifest()?;
                let memory = manifest.memory;
                // A raw image is mapped as it is (snapshot RAM) or loaded by the pager into RAM
                // of another kind; a store is always loaded.
                let kind_fits = manifest.ram_format == snapshot::RamFormat::Raw
                    || options.ram_backing != RamKind::Snapshot;
                if memory != options.memory || !kind_fits {
                    return Err(VmError::State(format!(
                        "the snapshot at {at} has {memory} bytes of RAM, kept {:?}: restore it with \
                         that size and {} RAM",
                        manifest.ram_format,
                        if manifest.ram_format == snapshot::RamFormat::Raw {
                            "any"
                        } else {
                            "anon, memfd, hugetlb or hugetlb-memfd"
                        }
                    )));
                }
                let mut snapshot = at.open()?;
                if options.ram_backing != RamKind::Snapshot {
                    snapshot = snapshot.loaded()?;
                }
                Some(snapshot.restore(&options.disk)?)
            }
            None if options.ram_backing == RamKind::Snapshot => {
                return Err(VmError::State(
                    "snapshot RAM needs a snapshot to restore".into(),
                ))
            }
            None => None,
        };
        // One gateway carries the model requests and the downloads.
        let image = options
            .image
            .as_ref()
            .map(crate::image::Image::open)
            .transpose()?;
        let networked =
            options.model_upstream.is_some() || !options.net.allow.is_empty() || image.is_some();
        let gateway = networked
            .then(|| {
                crate::gateway::Gateway::new(
                    options.model_upstream.as_deref(),
                    &format!("pid-{}", std::process::id()),
                    0,
                    MODEL_TIMEOUT,
                )
            })
            .transpose()?;
        let fault_errors = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&fault_errors);
        let interrupter = crate::machine::Interrupter::default();
        let lost = interrupter.clone();
        let exit_on_lost = options.exit_on_memory_lost;
        // The job's directory holds the store (`ram`): the cause goes beside it.
        let job_dir = options.store_dir.parent().map(std::path::Path::to_path_buf);
        let mut machine = Machine::boot(
            &MachineConfig {
                memory: options.memory,
                vcpus: options.vcpus,
                ram_kind: options.ram_backing,
                disk: options.disk.clone(),
                pager_threads: options.pager_threads,
                block_size: BlockSize::default(),
                track_writes: options.cold.is_some() && options.ram_backing == RamKind::Anon,
                restore,
                interrupter,
            },
            Box::new({
                // The guest decides how many faults fail (every one counts in its stats); the
                // log has a few a second.
                let log = basics::RateLimit::new(10, Duration::from_secs(1));
                move |e| {
                    counter.fetch_add(1, Ordering::Relaxed);
                    // A page whose source failed (its retries spent, or its bytes bad) can
                    // never be served right: the command ends with the cause rather than
                    // leave the guest waiting for ever, and the machine does not run again.
                    if matches!(e, uffd_pager::pager::FaultError::Source { .. }) {
                        let reason = basics::error_chain(e);
                        if lost.fail(reason.clone()).is_some() && exit_on_lost {
                            // The machine cannot run again, and the thread that faulted may
                            // wait for an answer that will not come (a host-side copy cannot
                            // be kicked): after a moment for a kicked command to reply, the
                            // process ends, saying why (the tombstone quotes it).
                            tracing::error!("pvisor: guest memory is lost: {reason}");
                            if let Some(dir) = &job_dir {
                                let _ = std::fs::write(
                                    dir.join(crate::runtime::MEMORY_LOST_FILE),
                                    &reason,
                                );
                            }
                            std::thread::spawn(|| {
                                std::thread::sleep(Duration::from_secs(2));
                                std::process::exit(crate::runtime::EXIT_MEMORY_LOST);
                            });
                        }
                    }
                    if log.allow() {
                        tracing::warn!("pvisor: guest memory fault cannot be served: {e}");
                    }
                }
            }),
        )?;
        if let Some(config) = options.cold {
            machine.start_cold(config).map_err(VmError::Cold)?;
        }
        if let Some(gateway) = gateway {
            machine.set_model_port(Arc::new(gateway), options.model_batching);
            if !options.net.allow.is_empty() {
                machine.set_net(options.net.clone());
            }
            if let Some(image) = image {
                machine.set_image(image);
            }
        }
        let offloads = options.pool.is_some() || options.ram_backing == RamKind::Snapshot;
        if let Some(policy) = options.wait {
            if policy.offload && offloads {
                return Err(VmError::State(
                    "waits cannot offload a VM in the memory pool or on snapshot RAM: use the \
                     pause strategy"
                        .into(),
                ));
            }
            machine.set_wait_management(crate::machine::WaitManagement {
                policy,
                offload: options.offload_config()?,
                io_threads: options.io_threads.max(1),
            });
        }
        machine.set_arenas(options.arenas);
        machine.set_cgroup_dir(cgroup.as_ref().map(|c| c.dir().to_path_buf()));
        if options.arena_offload {
            if !options.arenas {
                return Err(VmError::State(
                    "arena offload acts on arenas, and this VM does not (arenas: false)".into(),
                ));
            }
            if offloads {
                return Err(VmError::State(
                    "arenas cannot go to the offload store from a VM in the memory pool or on \
                     snapshot RAM (leave --vm-arena-offload out: survive arenas then go to \
                     cold compression's pool)"
                        .into(),
                ));
            }
            machine.set_arena_offload(options.offload_config()?);
        }
        if let Some(governor) = &options.governor {
            let mut config = LinkConfig::new(
                governor.socket.clone(),
                governor.name.clone(),
                options.memory,
            );
            if let Some(ms) = governor.hold_timeout_ms {
                config.hold_timeout = Duration::from_millis(ms);
            }
            let span = machine.ram().span();
            let control = Arc::new(PagerControl(
                machine.pager().resident_handle(),
                span,
                machine.cold().map(uffd_pager::cold::Cold::orders),
            ));
            let link = GovernorLink::start(config, control).map_err(VmError::Governor)?;
            let requester = link.requester();
            machine
                .pager()
                .on_held(Box::new(move |bytes| requester.request(bytes)));
            machine.set_governor(link);
        }
        let dedup = options
            .dedup
            .as_ref()
            .map(|d| Dedup::start(machine.ram(), d))
            .transpose()?;
        let pool = match &options.pool {
            Some(_) if options.ram_backing != RamKind::Anon || options.cold.is_some() => {
                return Err(VmError::State(
                    "the memory pool works on anon RAM without cold compression".into(),
                ))
            }
            Some(socket) => Some(PoolLink::attach(socket, machine.ram())?),
            None => None,
        };
        Ok(Self {
            dedup,
            pool,
            ram_view: None,
            machine,
            options,
            state: VmState::Running,
            cgroup,
            fault_errors,
        })
    }

    /// The lifecycle state.
    pub fn state(&self) -> VmState {
        self.state
    }

    /// The options it was started with.
    pub fn options(&self) -> &VmOptions {
        &self.options
    }

    /// The machine.
    pub fn machine(&self) -> &Machine {
        &self.machine
    }

    /// The memory cgroup's directory, when the VM runs in one.
    pub fn cgroup_dir(&self) -> Option<&std::path::Path> {
        self.cgroup.as_ref().map(MemoryCgroup::dir)
    }

    /// What ends the running command from another thread (`stop`, SIGTERM).
    pub fn interrupter(&self) -> crate::machine::Interrupter {
        self.machine.interrupter()
    }

    /// Where operator requests come from while a command waits for a model answer (see
    /// [`crate::operator`]).
    pub fn set_operator(&mut self, operator: Box<dyn crate::operator::Operator>) {
        self.machine.set_operator(operator);
    }

    /// Runs commands; refused unless running.
    pub fn exec(&mut self, commands: &[Command]) -> Result<Vec<CommandOutput>, VmError> {
        if self.state != VmState::Running {
            return Err(VmError::State(format!(
                "the VM is {}: resume it before running commands",
                state_name(self.state)
            )));
        }
        if let Some(pool) = &mut self.pool {
            pool.wrote();
        }
        if let Some(dedup) = &mut self.dedup {
            dedup.wrote();
        }
        if let Some(link) = self.machine.governor() {
            link.set_waiting(false);
            link.report(WireState::Running, None);
        }
        let results = commands
            .iter()
            .map(|c| self.machine.run(c).map_err(VmError::from))
            .collect();
        self.machine.commands_done();
        self.between_commands();
        results
    }

    /// Tells the memory governor that the VM runs no command (after its commands, or once a
    /// detached VM is up without any): between commands the governor may take its RAM (see
    /// [`Vm::background_tick`]).
    pub fn between_commands(&self) {
        if let Some(link) = self.machine.governor() {
            link.report(WireState::Idle, None);
            link.set_waiting(true);
        }
    }

    /// How long until the memory pool wants a tick (`None`: no pool, or it is gone).
    pub fn pool_wait(&self) -> Option<std::time::Duration> {
        self.pool.as_ref().and_then(PoolLink::wait)
    }

    /// How long until [`Vm::background_tick`] has something to do (`None`: nothing until
    /// the next command).
    pub fn background_wait(&self) -> Option<std::time::Duration> {
        let dedup = self.dedup.as_ref().and_then(Dedup::wait);
        let governor = self.machine.governor().map(|_| GOVERNOR_POLL);
        [self.pool_wait(), dedup, governor]
            .into_iter()
            .flatten()
            .min()
    }

    /// Between commands: the memory pool's tick when due, and KSM's return to its idle rate
    /// once no VM has written for a while.
    pub fn background_tick(&mut self) {
        if self.pool_wait() == Some(std::time::Duration::ZERO) {
            self.pool_tick();
        }
        if let Some(dedup) = &mut self.dedup {
            dedup.govern();
        }
        self.governor_tick();
    }

    /// Between commands: the governor's offload orders. The VM stays `Running` (its vCPU runs
    /// only inside a command); its next command faults back what it touches, through the
    /// resident limit. A VM without wait management has no offload store and refuses.
    fn governor_tick(&mut self) {
        let Some(link) = self.machine.governor() else {
            return;
        };
        while let Some(Order::Offload { .. }) = link.take_order() {
            let ok = self.state == VmState::Running
                && self.machine.idle_offload().is_some_and(|r| r.is_ok());
            link.offloaded(ok, self.machine.resident_bytes());
            if ok {
                link.report(WireState::Offloaded, None);
            }
        }
    }

    /// Lets the memory pool merge and release pages; between commands only (the vCPU must be
    /// stopped). Nothing happens unless the VM is running (not paused or offloaded).
    pub fn pool_tick(&mut self) {
        if self.state == VmState::Running {
            if let Some(pool) = &mut self.pool {
                pool.tick(self.machine.ram());
            }
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if let Some(view) = self.ram_view.take() {
            view.close();
        }
        // The cgroup was made for this VM: it goes with it.
        if let Some(cgroup) = self.cgroup.take() {
            cgroup.leave_and_remove();
        }
    }
}
