//! A VM with its lifecycle: running, paused, or offloaded (paused with its RAM in the store),
//! and the operations the control API offers on it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use compressed_backing::bulk::BulkOptions;
use compressed_backing::fuse::{self, FuseOptions, MountedStore};
use compressed_backing::{BlockSize, Codec, CodecConfig};
use uffd_pager::cold::{ColdConfig, ColdStats};
use uffd_pager::load::{LoadMode, LoadReport};
use uffd_pager::metrics::MetricsSnapshot;
use uffd_pager::offload::{OffloadConfig, OffloadError, OffloadReport};
use uffd_pager::pager::RamKind;
use uffd_pager::state::StateCounts;

use crate::dedup::{Dedup, DedupError, DedupOptions, DedupStats};
use crate::governor::client::{GovernorLink, LinkConfig, LinkStats, Order, ResidentControl};
use crate::governor::protocol::WireState;
use crate::machine::{CommandOutput, Machine, MachineConfig, MachineError};
use crate::script::Command;
use crate::sharing::{PoolLink, PoolLinkStats};
use crate::snapshot::{
    self, PrivateLoadReport, PrivateOffloadReport, Snapshot, SnapshotError, SnapshotReport,
};
use crate::stats::{self, CgroupError, MemoryCgroup};

/// Everything a VM is started with.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct VmOptions {
    /// Bytes of guest RAM.
    pub memory: u64,
    /// vCPUs.
    pub vcpus: u32,
    /// How guest RAM is mapped.
    pub ram_backing: RamKind,
    /// Offload writes a compressed store (else raw).
    pub ram_compression: bool,
    /// Codec of a compressed offload.
    pub ram_codec: String,
    /// The virtual disk's file.
    pub disk: PathBuf,
    /// Where offloaded RAM goes.
    pub store_dir: PathBuf,
    /// A memory cgroup to run in (relative to this process's own).
    pub cgroup: Option<PathBuf>,
    /// Fault-serving threads.
    pub pager_threads: usize,
    /// Threads for offload and eager load.
    pub io_threads: usize,
    /// Live cold-RAM compression and its knobs (memfd RAM only).
    #[serde(default)]
    pub cold: Option<ColdConfig>,
    /// KSM dedup of guest RAM (anon RAM only).
    #[serde(default)]
    pub dedup: Option<DedupOptions>,
    /// Continue this sealed snapshot (its directory) instead of booting: RAM maps the
    /// snapshot's image privately and `ram_backing` must be `snapshot`.
    #[serde(default)]
    pub restore: Option<PathBuf>,
    /// Share pages in common with other VMs through the memory pool at this socket
    /// (`uffd-pager serve --memory-pool`; anon RAM only).
    #[serde(default)]
    pub pool: Option<PathBuf>,
    /// The upstream model endpoint of the guest's `model` requests (`http://HOST:PORT[/PATH]`).
    #[serde(default)]
    pub model_upstream: Option<String>,
    /// Pause, and offload if the policy says so, while a model request is out.
    #[serde(default)]
    pub wait: Option<crate::wait::WaitPolicy>,
    /// Join the host's memory governor (`pvisor serve --memory-governor`).
    #[serde(default)]
    pub governor: Option<GovernorOptions>,
}

/// How a VM joins the memory governor.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct GovernorOptions {
    /// The governor's socket.
    pub socket: PathBuf,
    /// The name the VM has there (its job id).
    pub name: String,
    /// A fault held this long lifts the limit (milliseconds; the link's default if absent).
    #[serde(default)]
    pub hold_timeout_ms: Option<u64>,
}

impl VmOptions {
    /// A VM of `memory` bytes of `ram_backing` RAM, its disk and offload store at these paths,
    /// everything else as `pvisor run` has it by default: one vCPU and one fault thread, raw
    /// offloads (lz4 once compression is on), an I/O thread per CPU, no cgroup, and none of
    /// cold compression, dedup, restore, memory pool, model gateway or wait management. Set
    /// the rest with struct update syntax.
    pub fn new(memory: u64, ram_backing: RamKind, disk: PathBuf, store_dir: PathBuf) -> Self {
        Self {
            memory,
            vcpus: 1,
            ram_backing,
            ram_compression: false,
            ram_codec: "lz4".into(),
            disk,
            store_dir,
            cgroup: None,
            pager_threads: 1,
            io_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            cold: None,
            dedup: None,
            restore: None,
            pool: None,
            model_upstream: None,
            wait: None,
            governor: None,
        }
    }
}

/// The lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    /// Takes commands.
    Running,
    /// Stopped by `suspend --vm-pause`; RAM resident.
    Paused,
    /// Stopped by `suspend --vm-offload`; RAM in the store.
    Offloaded,
}

/// Errors of VM operations.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// The machine failed.
    #[error(transparent)]
    Machine(#[from] MachineError),
    /// The cgroup could not be joined.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// The operation does not fit the VM's state.
    #[error("{0}")]
    State(String),
    /// Offload failed; the VM keeps its memory and runs on.
    #[error("offload failed; the VM keeps its memory and goes on running")]
    Offload(#[source] OffloadError),
    /// The offloaded image could not be shown as a file (the offload itself stands).
    #[error("the VM is offloaded, but its RAM cannot be shown at {path}: {reason}")]
    RamFile {
        /// The requested path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Load failed.
    #[error("loading the VM's RAM back failed")]
    Load(#[source] uffd_pager::load::LoadError),
    /// The codec name is unknown.
    #[error(transparent)]
    Codec(#[from] compressed_backing::codec::UnknownCodec),
    /// Cold compression could not start.
    #[error("cannot start cold-RAM compression")]
    Cold(#[source] uffd_pager::cold::ColdError),
    /// KSM dedup could not start.
    #[error("cannot start KSM dedup (--vm-ram-dedup)")]
    Dedup(#[from] DedupError),
    /// The model gateway could not start.
    #[error("cannot start the model gateway (--vm-model-upstream)")]
    Gateway(#[from] crate::gateway::GatewayError),
    /// The memory pool could not be joined.
    #[error("cannot join the memory pool (--vm-memory-pool)")]
    Pool(#[from] uffd_pager::sharing::PoolError),
    /// A snapshot could not be written, opened, or its private pages moved.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The link to the memory governor could not start.
    #[error("cannot start the memory governor's link (--vm-governor)")]
    Governor(#[source] std::io::Error),
}

/// The pager's resident limit as the governor's link drives it, and the guest RAM's span
/// (host address, bytes) whose PSS it reports.
struct PagerControl(uffd_pager::pager::ResidentHandle, (u64, u64));

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
}

/// How often a governed VM looks at the governor's orders between commands.
const GOVERNOR_POLL: Duration = Duration::from_millis(50);

/// How long a model request may take before the guest gets an error instead.
pub const MODEL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// What `stats` reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct VmStats {
    /// Lifecycle state.
    pub state: VmState,
    /// Configured guest RAM.
    pub memory_bytes: u64,
    /// PSS of the whole VM process (`smaps_rollup`).
    pub process_pss_bytes: u64,
    /// PSS of the guest-RAM mapping alone. For memfd RAM this misses pages that are in the
    /// memfd but not mapped (cold compression unmaps blocks it watches): see
    /// `guest_ram_resident_bytes`.
    pub guest_ram_pss_bytes: u64,
    /// Guest RAM the host really holds: the mapping's PSS for anon RAM, the memfd's allocated
    /// bytes for memfd RAM.
    pub guest_ram_resident_bytes: u64,
    /// What the VM process really holds: its PSS with guest RAM counted as
    /// `guest_ram_resident_bytes` (the figure to compare across RAM kinds).
    pub process_memory_bytes: u64,
    /// Bytes held by cold compression: the pool's memory plus its tracking (0 without it).
    pub pool_bytes: u64,
    /// Cold compression's counters and costs, when it runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cold: Option<ColdStats>,
    /// What KSM merged, with `--vm-ram-dedup`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dedup: Option<DedupStats>,
    /// What wait management did, with `--vm-wait-management`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait: Option<crate::wait::WaitStats>,
    /// What the memory pool did, with `--vm-memory-pool`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolLinkStats>,
    /// The link to the memory governor, with `--vm-governor`: its counters and the resident
    /// limit in force now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub governor: Option<GovernorStats>,
    /// Bytes allocated on disk by the offload store.
    pub backing_disk_bytes: u64,
    /// Bytes allocated on disk by the virtual disk.
    pub disk_bytes: u64,
    /// The memory cgroup's usage, when the VM runs in one.
    pub cgroup_memory_bytes: Option<u64>,
    /// The memory cgroup's directory, when the VM runs in one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup_dir: Option<PathBuf>,
    /// Where guest RAM is mapped in the VM process (for samplers that read its smaps).
    pub guest_ram_host_base: u64,
    /// Application data filled in the guest.
    pub app_bytes: u64,
    /// Pages per state.
    pub pages: StateCounts,
    /// Pager counters.
    pub pager: MetricsSnapshot,
    /// Faults that could not be served.
    pub fault_errors: u64,
}

/// A governed VM's side of the governor.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GovernorStats {
    /// The link's counters.
    #[serde(flatten)]
    pub link: LinkStats,
    /// The resident limit in force (`None`: none).
    pub resident_limit_bytes: Option<u64>,
    /// What the faults held now would install.
    pub held_bytes: u64,
}

/// What `suspend` did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SuspendReport {
    /// The state now.
    pub state: VmState,
    /// The offload, when there was one (absent for a pause or an already offloaded VM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload: Option<OffloadReport>,
    /// For a VM restored from a snapshot: the offload of the pages it wrote.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub private_offload: Option<PrivateOffloadReport>,
    /// Wall time of the operation, milliseconds.
    pub elapsed_ms: f64,
}

/// What `resume` did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ResumeReport {
    /// The state now.
    pub state: VmState,
    /// The load, for an offloaded VM.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load: Option<LoadReport>,
    /// For a VM restored from a snapshot: the pages it wrote, put back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub private_load: Option<PrivateLoadReport>,
    /// Wall time of the operation, milliseconds.
    pub elapsed_ms: f64,
}

/// The offloaded image shown as a plain file: a read-only FUSE mount and a link to its file.
#[derive(Debug)]
struct RamView {
    mounted: MountedStore,
    link: PathBuf,
}

impl RamView {
    fn close(self) {
        let _ = std::fs::remove_file(&self.link);
        let mountpoint = self.mounted.mountpoint().to_path_buf();
        let _ = self.mounted.unmount();
        let _ = std::fs::remove_dir(mountpoint);
    }
}

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
        let restore = match &options.restore {
            Some(dir) => {
                // The cheap checks first, then every byte against the seal.
                let manifest = snapshot::read_manifest(dir)?;
                let memory = manifest.memory;
                // A raw image is mapped (snapshot RAM); a store is loaded into anon or memfd RAM.
                let kind_fits = (manifest.ram_format == snapshot::RamFormat::Raw)
                    == (options.ram_backing == RamKind::Snapshot);
                if memory != options.memory || !kind_fits {
                    return Err(VmError::State(format!(
                        "the snapshot at {} has {memory} bytes of RAM, kept {:?}: restore it with \
                         that size and {} RAM",
                        dir.display(),
                        manifest.ram_format,
                        if manifest.ram_format == snapshot::RamFormat::Raw {
                            "snapshot"
                        } else {
                            "anon or memfd"
                        }
                    )));
                }
                Some(Snapshot::open(dir)?.restore(&options.disk)?)
            }
            None if options.ram_backing == RamKind::Snapshot => {
                return Err(VmError::State(
                    "snapshot RAM needs a snapshot to restore".into(),
                ))
            }
            None => None,
        };
        let gateway = options
            .model_upstream
            .as_deref()
            .map(|url| {
                crate::gateway::Gateway::new(
                    url,
                    &format!("pid-{}", std::process::id()),
                    0,
                    MODEL_TIMEOUT,
                )
            })
            .transpose()?;
        let fault_errors = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&fault_errors);
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
            },
            Box::new({
                // The guest decides how many faults fail (every one counts in its stats); the
                // log has a few a second.
                let log = uffd_pager::server::RateLimit::new(10, Duration::from_secs(1));
                move |e| {
                    counter.fetch_add(1, Ordering::Relaxed);
                    if log.allow() {
                        tracing::warn!("pvisor: guest memory fault cannot be served: {e}");
                    }
                }
            }),
        )?;
        if let Some(config) = options.cold {
            machine.pager().start_cold(config).map_err(VmError::Cold)?;
        }
        if let Some(gateway) = gateway {
            machine.set_model_port(Arc::new(gateway));
        }
        if let Some(policy) = options.wait {
            if policy.offload
                && (options.pool.is_some() || options.ram_backing == RamKind::Snapshot)
            {
                return Err(VmError::State(
                    "waits cannot offload a VM in the memory pool or on snapshot RAM: use the \
                     pause strategy"
                        .into(),
                ));
            }
            let codec = if options.ram_compression {
                options.ram_codec.parse::<Codec>()?
            } else {
                Codec::None
            };
            machine.set_wait_management(crate::machine::WaitManagement {
                policy,
                offload: OffloadConfig {
                    dir: options.store_dir.clone(),
                    codec: CodecConfig::new(codec),
                    bulk: BulkOptions::with_threads(options.io_threads.max(1)),
                },
                io_threads: options.io_threads.max(1),
            });
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
            let control = Arc::new(PagerControl(machine.pager().resident_handle(), span));
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
        if let Some(link) = self.machine.governor() {
            // Between commands the governor may take the VM's RAM (see `background_tick`).
            link.report(WireState::Idle, None);
            link.set_waiting(true);
        }
        results
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

    /// Pauses; with `offload`, also moves resident RAM to the store (idempotent: an
    /// offloaded VM stays as it is). A failed offload leaves the VM running with its memory.
    /// With `ram_file`, the offloaded image is then shown read-only as a plain file there
    /// (until the VM resumes).
    pub fn suspend(
        &mut self,
        offload: bool,
        ram_file: Option<&Path>,
    ) -> Result<SuspendReport, VmError> {
        if let Some(path) = ram_file {
            let ours = self.ram_view.as_ref().is_some_and(|v| v.link == path);
            if !offload {
                return Err(VmError::State("a RAM file needs --vm-offload".into()));
            }
            if !ours && std::fs::symlink_metadata(path).is_ok() {
                return Err(VmError::RamFile {
                    path: path.to_path_buf(),
                    reason: "it exists already".into(),
                });
            }
        }
        let report = self.suspend_inner(offload)?;
        if let Some(path) = ram_file {
            if self.ram_view.as_ref().is_none_or(|v| v.link != path) {
                self.show_ram(path)?;
            }
        }
        Ok(report)
    }

    /// Mounts the store's image read-only and links `path` to its file.
    fn show_ram(&mut self, path: &Path) -> Result<(), VmError> {
        let fail = |reason: String| VmError::RamFile {
            path: path.to_path_buf(),
            reason,
        };
        if let Some(view) = self.ram_view.take() {
            view.close();
        }
        let reader = self
            .machine
            .pager()
            .store_reader()
            .ok_or_else(|| fail("nothing was offloaded".into()))?;
        let mountpoint = self.options.store_dir.with_extension("view");
        compressed_backing::file::create_private_dir(&mountpoint)
            .map_err(|e| fail(e.to_string()))?;
        let mounted = fuse::mount_reader(reader, &mountpoint, &FuseOptions::default())
            .map_err(|e| fail(basics::error_chain(&e)))?;
        if let Err(e) = std::os::unix::fs::symlink(mounted.file_path(), path) {
            let _ = mounted.unmount();
            return Err(fail(e.to_string()));
        }
        self.ram_view = Some(RamView {
            mounted,
            link: path.to_path_buf(),
        });
        Ok(())
    }

    fn suspend_inner(&mut self, offload: bool) -> Result<SuspendReport, VmError> {
        let started = Instant::now();
        let report = |state, offload| SuspendReport {
            state,
            offload,
            private_offload: None,
            elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
        };
        if !offload || self.state == VmState::Offloaded {
            if self.state == VmState::Running {
                self.state = VmState::Paused;
            }
            return Ok(report(self.state, None));
        }
        if self.pool.is_some() {
            return Err(VmError::State(
                "a VM in the memory pool cannot be offloaded: its pool pages are shared with \
                 other VMs (pause it instead)"
                    .into(),
            ));
        }
        let previous = self.state;
        self.state = VmState::Paused;
        let codec = if self.options.ram_compression {
            self.options.ram_codec.parse::<Codec>()?
        } else {
            Codec::None
        };
        if self.options.ram_backing == RamKind::Snapshot {
            let result = snapshot::offload_private(
                self.machine.ram(),
                &self.options.store_dir,
                CodecConfig::new(codec),
            );
            return match result {
                Ok(done) => {
                    let _ = self.machine.drop_disk_cache();
                    self.state = VmState::Offloaded;
                    let mut out = report(self.state, None);
                    out.private_offload = Some(done);
                    Ok(out)
                }
                Err(e) => {
                    self.state = previous;
                    Err(e.into())
                }
            };
        }
        let config = OffloadConfig {
            dir: self.options.store_dir.clone(),
            codec: CodecConfig::new(codec),
            bulk: BulkOptions::with_threads(self.options.io_threads.max(1)),
        };
        match self.machine.offload(&config) {
            Ok(done) => {
                self.state = VmState::Offloaded;
                Ok(report(self.state, Some(done)))
            }
            Err(e) => {
                self.state = previous;
                Err(VmError::Offload(e))
            }
        }
    }

    /// Resumes a paused or offloaded VM; an offloaded one loads its RAM back lazily
    /// (faults plus prefetch) or, with `eager`, completely before returning.
    pub fn resume(&mut self, eager: bool) -> Result<ResumeReport, VmError> {
        let started = Instant::now();
        if self.state != VmState::Running {
            // The file showed the offloaded image; the VM is about to change it.
            if let Some(view) = self.ram_view.take() {
                view.close();
            }
        }
        let mut private_load = None;
        let load = match self.state {
            VmState::Running => {
                return Err(VmError::State(
                    "the VM is running: there is nothing to resume".into(),
                ))
            }
            VmState::Paused => None,
            // The pages a restored VM wrote come back before its vCPU runs (userfaultfd cannot
            // serve a private file mapping lazily).
            VmState::Offloaded if self.options.ram_backing == RamKind::Snapshot => {
                private_load = Some(snapshot::load_private(
                    self.machine.ram(),
                    &self.options.store_dir,
                )?);
                None
            }
            VmState::Offloaded => {
                let mode = if eager {
                    LoadMode::Eager
                } else {
                    LoadMode::Lazy
                };
                Some(
                    self.machine
                        .pager()
                        .load(mode, self.options.io_threads.max(1))
                        .map_err(VmError::Load)?,
                )
            }
        };
        self.state = VmState::Running;
        Ok(ResumeReport {
            state: self.state,
            load,
            private_load,
            elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Writes a sealed snapshot of the VM to `out` (which must not exist), RAM raw or, with a
    /// codec, compressed. The VM must not be offloaded; it goes on as it was.
    pub fn snapshot(&self, out: &Path, codec: Option<Codec>) -> Result<SnapshotReport, VmError> {
        if self.state == VmState::Offloaded {
            return Err(VmError::State(
                "the VM is offloaded: resume it before taking a snapshot".into(),
            ));
        }
        Ok(snapshot::write(
            &self.machine,
            self.options.vcpus,
            out,
            codec.map(CodecConfig::new),
        )?)
    }

    /// What the VM costs and how its pager is doing.
    pub fn stats(&self) -> VmStats {
        let pager = self.machine.pager();
        let store_dir = &self.options.store_dir;
        let backing_disk_bytes = std::fs::read_dir(store_dir)
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .map(|e| compressed_backing::store::allocated_bytes(&e.path()))
                    .sum()
            })
            .unwrap_or(0);
        let cold = pager.cold_stats();
        let process_pss_bytes = stats::process_pss().unwrap_or(0);
        let ram = self.machine.ram();
        let guest_ram_pss_bytes = ram.pss();
        let guest_ram_resident_bytes = match self.machine.ram().memfd() {
            Some(memfd) => memfd
                .metadata()
                .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
                .unwrap_or(0),
            None => guest_ram_pss_bytes,
        };
        VmStats {
            process_pss_bytes,
            guest_ram_pss_bytes,
            guest_ram_resident_bytes,
            process_memory_bytes: (process_pss_bytes - guest_ram_pss_bytes.min(process_pss_bytes))
                + guest_ram_resident_bytes,
            pool_bytes: cold.as_ref().map_or(0, |c| c.overhead_bytes),
            cold,
            dedup: self.dedup.as_ref().map(Dedup::stats),
            pool: self.pool.as_ref().map(PoolLink::stats),
            governor: self.machine.governor().map(|link| GovernorStats {
                link: link.stats(),
                resident_limit_bytes: pager.resident_limit(),
                held_bytes: pager.held_bytes(),
            }),
            wait: self.machine.wait_stats(),
            state: self.state,
            memory_bytes: self.options.memory,
            backing_disk_bytes,
            disk_bytes: compressed_backing::store::allocated_bytes(self.machine.disk_path()),
            cgroup_memory_bytes: self.cgroup.as_ref().and_then(|c| c.usage().ok()),
            cgroup_dir: self.cgroup.as_ref().map(|c| c.dir().to_path_buf()),
            guest_ram_host_base: ram.host_base().0,
            app_bytes: self.machine.app_bytes(),
            pages: pager.state_counts(),
            pager: pager.metrics().snapshot(),
            fault_errors: self.fault_errors.load(Ordering::Relaxed),
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

fn state_name(state: VmState) -> &'static str {
    match state {
        VmState::Running => "running",
        VmState::Paused => "paused",
        VmState::Offloaded => "offloaded",
    }
}
