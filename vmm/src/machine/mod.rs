//! One VM: guest RAM served by the in-process pager, one KVM vCPU running the workload guest
//! at CPL3, and a paravirtual port-I/O block device over a host file.
//!
//! The vCPU runs only while a command runs: the VMM writes the command into the mailbox,
//! runs the vCPU until the guest says it is done (`out` to `PORT_DONE`), serving the block
//! device and free-page reports on the way, and reads the results. Between commands the vCPU
//! does not run, so the VM is paused whenever no command is in flight.
//!
//! One concern a file, all of them on the one [`Machine`]:
//! - `boot`: guest RAM, the pager, KVM, the vCPU's registers; the guest's page
//!   tables and program;
//! - `interrupt`: ending or preempting a command from another thread;
//! - `vcpu`: the vCPU loop and the port-I/O devices it serves (the block device,
//!   free-page reports);
//! - `command`: a command's dispatch to the guest and what it produced;
//! - `model_wait`: the guest's model requests and the wait for their answer,
//!   managed (pause, offload, the governor's orders) or not;
//! - `download`: the guest's downloads, chunk by chunk, each chunk's wait like a model
//!   wait;
//! - `replies`: the operator's requests during a model wait, and their replies;
//! - here: the configuration, the errors, the machine's state and what the rest of the VMM
//!   reads of it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use compressed_backing::BlockSize;
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use uffd_pager::pager::{Pager, RamKind};
use vm_memory::{Bytes, GuestAddress};

use crate::governor::client::GovernorLink;
use crate::guest::{BlkRequest, Mailbox};
use crate::memory::{GuestRam, MemoryError};
use crate::operator::Operator;
use crate::wait::{WaitCoordinator, WaitStats};
use uffd_pager::offload::{OffloadConfig, OffloadError, OffloadReport};

mod arenas;
mod boot;
mod command;
mod download;
mod interrupt;
mod model_wait;
mod replies;
mod vcpu;

pub use boot::{GUEST_CR0, GUEST_CR4, GUEST_EFER, USER_CODE_SELECTOR, USER_DATA_SELECTOR};
pub use command::{ChaosReport, CommandOutput, PokeReport};
pub use interrupt::Interrupter;
pub use model_wait::WaitManagement;

/// How to build a VM.
#[derive(Debug, Clone)]
pub struct MachineConfig {
    /// Bytes of guest RAM.
    pub memory: u64,
    /// vCPUs (the workload guest runs on the first; the others are created and stay idle).
    pub vcpus: u32,
    /// How guest RAM is mapped.
    pub ram_kind: RamKind,
    /// The virtual disk's host file (created if missing).
    pub disk: PathBuf,
    /// Fault-serving threads of the pager.
    pub pager_threads: usize,
    /// The pager's block size.
    pub block_size: BlockSize,
    /// Track writes to anon RAM (cold compression of anon RAM needs it).
    pub track_writes: bool,
    /// Continue a snapshot instead of booting: RAM maps its image privately (`ram_kind` is
    /// then `Snapshot`) and the vCPU resumes from its saved registers.
    pub restore: Option<Restore>,
    /// What ends the machine's commands from other threads; made before the machine so that
    /// its pager's fault-error handler can end them too ([`Interrupter::fail`]).
    pub interrupter: Interrupter,
}

impl MachineConfig {
    /// A fresh boot of `memory` bytes of `ram_kind` RAM with its disk at `disk`, and the
    /// defaults for the rest: one vCPU, one fault thread, the default block size, no write
    /// tracking.
    pub fn new(memory: u64, ram_kind: RamKind, disk: PathBuf) -> Self {
        Self {
            memory,
            vcpus: 1,
            ram_kind,
            disk,
            pager_threads: 1,
            block_size: BlockSize::default(),
            track_writes: false,
            restore: None,
            interrupter: Interrupter::default(),
        }
    }
}

/// The vCPU's registers at a command boundary (the workload guest is built with general
/// registers only, so these are all of its state).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct VcpuState {
    /// General registers.
    pub regs: kvm_bindings::kvm_regs,
    /// Segment and control registers.
    pub sregs: kvm_bindings::kvm_sregs,
}

/// Where a restored machine's RAM comes from.
#[derive(Debug, Clone)]
pub enum RestoreRam {
    /// A raw image, opened read-only, mapped privately (snapshot RAM).
    Image(std::sync::Arc<File>),
    /// Pages the pager reads on faults (RAM of another kind, loaded lazily).
    Source(std::sync::Arc<dyn uffd_pager::source::PageSource>),
}

/// What a restored machine starts from.
#[derive(Debug, Clone)]
pub struct Restore {
    /// The RAM image.
    pub ram: RestoreRam,
    /// The vCPU's registers.
    pub vcpu: VcpuState,
    /// Application data the guest had filled.
    pub filled: u64,
    /// The arenas the guest had registered (checked again at boot).
    pub arenas: Vec<crate::arena::SavedArena>,
}

/// Errors of a VM.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    /// The configuration cannot work.
    #[error("invalid VM configuration: {0}")]
    Config(String),
    /// Guest RAM could not be mapped.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The pager could not start.
    #[error("cannot start the pager")]
    Pager(#[source] uffd_pager::pager::PagerError),
    /// A KVM ioctl failed.
    #[error("KVM: {op}")]
    Kvm {
        /// What was being done.
        op: &'static str,
        /// The error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Guest memory could not be read or written by the VMM.
    #[error("guest memory access at {gpa:#x} failed")]
    GuestMemory {
        /// Guest-physical address.
        gpa: u64,
        /// vm-memory's complaint.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// The virtual disk's file failed.
    #[error("virtual disk {path}")]
    Disk {
        /// The file.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// `stop` or SIGTERM ended the command.
    #[error("stopped")]
    Stopped,
    /// Guest memory could not be served (its source failed: an object store down past its
    /// retries, a corrupt block): the command ended, and the machine cannot run again.
    #[error("guest memory is lost: {0}")]
    MemoryLost(String),
    /// The guest stopped in a way it never should (triple fault, unexpected exit).
    #[error("the guest crashed: {0}")]
    GuestCrashed(String),
    /// The guest reported a failed command.
    #[error("`{command}` failed in the guest: {reason}")]
    Command {
        /// The command.
        command: String,
        /// Why.
        reason: String,
    },
    /// Dropping released pages failed.
    #[error("cannot drop {len} released bytes at {gpa:#x}")]
    Release {
        /// Start.
        gpa: u64,
        /// Length.
        len: u64,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
}

fn kvm(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> MachineError {
    move |source| MachineError::Kvm { op, source }
}

/// A running VM. Fields drop in order: the vCPU and VM before the pager, the pager before
/// the RAM it serves.
pub struct Machine {
    /// The link to the host's memory governor, if the VM joined one: it goes first, its
    /// thread holds a handle on the pager's limit.
    governor: Option<GovernorLink>,
    vcpu: VcpuFd,
    _idle_vcpus: Vec<VcpuFd>,
    _vm: VmFd,
    _kvm: Kvm,
    /// Cold compression above the pager, if it runs (dropped before the pager and RAM).
    cold: Option<uffd_pager::cold::Cold>,
    pager: Pager,
    ram: GuestRam,
    disk: File,
    disk_path: PathBuf,
    filled: u64,
    /// The bounce buffer of disk requests, [`vcpu::DISK_CHUNK`] bytes at most.
    io_buf: Vec<u8>,
    model: Option<std::sync::Arc<dyn crate::gateway::ModelPort>>,
    /// Why the last model request failed, for the command's error.
    model_error: Option<String>,
    /// Pause/offload while a model request is out; one coordinator for the machine's life, so
    /// that its cooldown spans requests.
    wait: Option<WaitManagement>,
    coordinator: Option<WaitCoordinator>,
    /// Offloads and loads that failed during waits.
    wait_failures: (u64, u64),
    /// Operator requests during model waits (the control socket), if anyone sends them.
    operator: Option<Box<dyn Operator>>,
    /// An operator stopped the VM during a model wait.
    stop_requested: bool,
    /// Ends the running command from another thread (`stop`, SIGTERM).
    interrupter: Interrupter,
    /// The model request in flight and when it went out: the guest comes back to the model
    /// port with it after each of its timers and each batch of its answer.
    model_pending: Option<(u64, Instant)>,
    /// Bytes of the pending request's answer handed to the guest in batches so far.
    model_received: u64,
    /// How a streamed answer is handed to a guest that takes it in batches.
    model_batching: crate::gateway::Batching,
    /// How the guest's downloads go (none: it has no network).
    net: Option<crate::net::NetOptions>,
    /// The download in progress.
    transfer: Option<download::Transfer>,
    /// Downloads sent so far (their gateway ids).
    net_sent: u64,
    /// Why the last net request failed, for the command's error.
    net_error: Option<String>,
    /// The VM's read-only image (`--vm-image`), if it has one.
    image: Option<std::sync::Arc<crate::image::Image>>,
    /// What its downloads and image reads came to.
    io_stats: crate::net::IoStats,
    /// Its waits by source.
    by_source: crate::net::BySource,
    /// Why the last free report was refused, for the command's error.
    release_error: Option<String>,
    /// The guest's phase arenas (docs/arenas.md).
    arenas: crate::arena::Registry,
    /// Where survive arenas go at their close, if to the offload store.
    arena_offload: Option<OffloadConfig>,
    /// Guest-physical ranges of arenas freed and not yet dropped (see [`arenas`]).
    freed_arenas: Vec<(u64, u64)>,
    /// When the oldest of them was freed.
    freed_since: Option<Instant>,
    /// The guest's last idle report on the arena channel, not yet used by a wait: when its
    /// next timer falls due (`None` inside: no timer pending).
    idle_report: Option<Option<Instant>>,
    /// The memory cgroup the VM runs in, if any: its usage is what the VM is charged.
    cgroup_dir: Option<PathBuf>,
    /// A command ended with the guest stopped in the middle of it (it crashed, or the VMM
    /// failed serving it): the guest cannot take another command. Why.
    broken: Option<String>,
}

impl std::fmt::Debug for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Machine")
            .field("ram", &self.ram)
            .field("disk", &self.disk_path)
            .finish_non_exhaustive()
    }
}

impl Machine {
    fn read<T: vm_memory::ByteValued>(&self, gpa: u64) -> Result<T, MachineError> {
        self.ram
            .memory()
            .read_obj(GuestAddress(gpa))
            .map_err(|e| MachineError::GuestMemory { gpa, source: e })
    }

    fn write<T: vm_memory::ByteValued>(&self, gpa: u64, value: T) -> Result<(), MachineError> {
        self.ram
            .memory()
            .write_obj(value, GuestAddress(gpa))
            .map_err(|e| MachineError::GuestMemory { gpa, source: e })
    }
}

impl Machine {
    /// The pager serving this VM's RAM.
    pub fn pager(&self) -> &Pager {
        &self.pager
    }

    /// Starts cold compression of guest RAM above the pager.
    pub fn start_cold(
        &mut self,
        config: uffd_pager::cold::ColdConfig,
    ) -> Result<(), uffd_pager::cold::ColdError> {
        if self.cold.is_some() {
            return Err(uffd_pager::cold::ColdError::Running);
        }
        self.cold = Some(uffd_pager::cold::Cold::start(&self.pager, config)?);
        Ok(())
    }

    /// Cold compression, if it runs.
    pub fn cold(&self) -> Option<&uffd_pager::cold::Cold> {
        self.cold.as_ref()
    }

    /// Guest RAM.
    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    /// The virtual disk's file.
    pub fn disk_path(&self) -> &Path {
        &self.disk_path
    }

    /// Makes the virtual disk durable and drops its page cache: a suspended VM keeps its disk
    /// on disk, not in memory.
    pub fn drop_disk_cache(&self) -> Result<(), MachineError> {
        use std::os::fd::AsRawFd;
        let fail = |source| MachineError::Disk {
            path: self.disk_path.clone(),
            source,
        };
        self.disk.sync_data().map_err(fail)?;
        // SAFETY: fadvise on our own open descriptor; it only affects caching.
        let rc =
            unsafe { libc::posix_fadvise(self.disk.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(fail(std::io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }

    /// What the guest's arenas did (`touched_after_close_pages` counted now).
    pub fn arena_stats(&self) -> crate::arena::ArenaStats {
        let mut stats = self.arenas.stats();
        let pager = self.pager();
        stats.touched_after_close_pages = self
            .arenas
            .closed_discarded()
            .flat_map(|(gpa, len)| (gpa..gpa + len).step_by(basics::PAGE_SIZE as usize))
            .filter(|&gpa| pager.page_state(gpa) != uffd_pager::state::PageState::Zero)
            .count() as u64;
        stats
    }

    /// The arenas the guest has registered, for a snapshot.
    pub fn saved_arenas(&self) -> Vec<crate::arena::SavedArena> {
        self.arenas.saved()
    }

    /// Bytes of application data filled.
    pub fn app_bytes(&self) -> u64 {
        self.filled
    }

    /// Refuses a machine whose guest an earlier command left stopped in the middle of it (it
    /// crashed, or the VMM failed serving it): it takes no more commands, and a snapshot of
    /// it would resume the guest mid-command.
    pub fn check_usable(&self) -> Result<(), MachineError> {
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(MachineError::GuestCrashed(format!(
                "an earlier command left the guest stopped in the middle of it ({why}); \
                 the VM takes no more commands"
            ))),
        }
    }

    /// The vCPU's registers (between commands: the guest waits for the next one); refused
    /// for a machine that [`Machine::check_usable`] refuses.
    pub fn vcpu_state(&self) -> Result<VcpuState, MachineError> {
        self.check_usable()?;
        Ok(VcpuState {
            regs: self.vcpu.get_regs().map_err(kvm("get regs"))?,
            sregs: self.vcpu.get_sregs().map_err(kvm("get sregs"))?,
        })
    }

    /// Pause and offload while model requests are out.
    pub fn set_wait_management(&mut self, wait: WaitManagement) {
        self.coordinator = Some(WaitCoordinator::new(wait.policy, 0));
        self.wait = Some(wait);
    }

    /// What wait management did so far (`None`: not on).
    pub fn wait_stats(&self) -> Option<WaitStats> {
        self.coordinator.as_ref().map(|c| self.wait_stats_of(c))
    }

    fn wait_stats_of(&self, coordinator: &WaitCoordinator) -> WaitStats {
        WaitStats {
            failed_offloads: self.wait_failures.0,
            failed_loads: self.wait_failures.1,
            ..coordinator.stats()
        }
    }

    /// Joins the host's memory governor through `link`: model waits report to it and carry
    /// out its offload orders (see [`crate::governor`]).
    pub fn set_governor(&mut self, link: GovernorLink) {
        self.governor = Some(link);
    }

    /// The link to the memory governor, if the VM joined one.
    pub fn governor(&self) -> Option<&GovernorLink> {
        self.governor.as_ref()
    }

    /// Guest RAM resident now, bytes.
    pub fn resident_bytes(&self) -> u64 {
        self.pager.state_counts().resident * uffd_pager::addr::PAGE_SIZE
    }

    /// Where operator requests come from while the VM waits for a model answer.
    pub fn set_operator(&mut self, operator: Box<dyn Operator>) {
        self.operator = Some(operator);
    }

    /// Whether an operator stopped the VM during a model wait (the command failed; the VM is
    /// to exit).
    pub fn stop_requested(&self) -> bool {
        self.stop_requested || self.interrupter.stopped()
    }

    /// What ends this machine's running command from another thread.
    pub fn interrupter(&self) -> Interrupter {
        self.interrupter.clone()
    }

    /// Moves resident RAM to the store (the VM must not run), then drops what else the VM no
    /// longer needs: the disk's page cache (durable once synced) and the heap's free pages (the
    /// offload's batch buffers), so that an offloaded VM costs what it holds. Both are best
    /// effort; a failed offload leaves RAM resident.
    pub fn offload(&self, config: &OffloadConfig) -> Result<OffloadReport, OffloadError> {
        // No block is compressed while the RAM moves.
        let held = self
            .cold
            .as_ref()
            .map(uffd_pager::cold::Cold::hold_compression);
        let result = self.pager.offload(config);
        drop(held);
        if result.is_ok() {
            let _ = self.drop_disk_cache();
        }
        // SAFETY: malloc_trim only releases free memory of the allocator.
        unsafe { libc::malloc_trim(0) };
        result
    }

    /// Whether arena reports are acted on (`false`: checked and counted, nothing moves).
    pub fn set_arenas(&mut self, act: bool) {
        self.arenas.set_acting(act);
    }

    /// The VM runs in the memory cgroup at `dir`: `stats` replies charge it with its usage.
    pub fn set_cgroup_dir(&mut self, dir: Option<PathBuf>) {
        self.cgroup_dir = dir;
    }

    /// Survive arenas go to this offload store at their close (else to cold compression's
    /// pool, if it runs).
    pub fn set_arena_offload(&mut self, config: OffloadConfig) {
        self.arena_offload = Some(config);
    }

    /// The command batch is over (the guest waits for the next one): memory of arenas freed
    /// during it is dropped now.
    pub fn commands_done(&mut self) {
        self.drop_freed_arenas();
    }

    /// For the memory governor, with the vCPU out of the guest (between commands, or
    /// preempted in one): offloads the VM's RAM to its wait management's store (`None`: no
    /// wait management, so no store).
    pub fn idle_offload(&self) -> Option<Result<OffloadReport, OffloadError>> {
        let wait = self.wait.as_ref()?;
        Some(self.offload(&wait.offload))
    }

    /// Where the guest's `model` requests go, and how their answers are handed to a guest
    /// that takes them in batches (`model ID stream`).
    pub fn set_model_port(
        &mut self,
        port: std::sync::Arc<dyn crate::gateway::ModelPort>,
        batching: crate::gateway::Batching,
    ) {
        self.model = Some(port);
        self.model_batching = batching;
    }

    /// How the guest's downloads go; they use the gateway of [`Machine::set_model_port`].
    pub fn set_net(&mut self, options: crate::net::NetOptions) {
        self.net = Some(options);
    }

    /// The guest's read-only image; its reads use the gateway of
    /// [`Machine::set_model_port`].
    pub fn set_image(&mut self, image: crate::image::Image) {
        self.image = Some(std::sync::Arc::new(image));
    }

    /// What the guest's downloads and image reads came to, if it has done any.
    pub fn io_stats(&self) -> Option<crate::net::IoStats> {
        Some(self.io_stats).filter(|s| s.downloads + s.reads > 0)
    }

    /// Its waits by source, if it has waited for any.
    pub fn source_stats_all(&self) -> Option<crate::net::BySource> {
        let s = self.by_source;
        Some(s).filter(|_| s.model.waits + s.download.waits + s.read.waits > 0)
    }

    /// The virtual disk's file.
    pub fn disk(&self) -> &File {
        &self.disk
    }
}

// SAFETY: plain-old-data structures of u64 fields, valid for any bit pattern.
unsafe impl vm_memory::ByteValued for Mailbox {}
// SAFETY: as above.
unsafe impl vm_memory::ByteValued for BlkRequest {}
