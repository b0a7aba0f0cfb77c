//! One VM: guest RAM served by the in-process pager, one KVM vCPU running the workload guest
//! at CPL3, and a paravirtual port-I/O block device over a host file.
//!
//! The vCPU runs only while a command runs: the VMM writes the command into the mailbox,
//! runs the vCPU until the guest says it is done (`out` to `PORT_DONE`), serving the block
//! device and free-page reports on the way, and reads the results. Between commands the vCPU
//! does not run, so the VM is paused whenever no command is in flight.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use compressed_backing::BlockSize;
use kvm_bindings::{kvm_segment, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use uffd_pager::pager::{FaultError, Pager, PagerConfig, RamKind};
use uffd_pager::state::PageState;
use vm_memory::{Bytes, GuestAddress};

use crate::gateway::{Answer, ModelPort};
use crate::governor::client::{GovernorLink, Order};
use crate::governor::protocol::WireState;
use crate::guest::{self, status, BlkRequest, BlockIo, Mailbox, Op, Refused};
use crate::memory::{GuestRam, MemoryError};
use crate::operator::{Operator, OperatorRequest};
use crate::script::Command;
use crate::wait::{Action as WaitAction, Phase, WaitCoordinator, WaitEvent, WaitPolicy, WaitStats};
use std::time::Duration;
use uffd_pager::load::LoadMode;
use uffd_pager::offload::{OffloadConfig, OffloadError, OffloadReport};

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
    #[error("guest memory access at {gpa:#x} failed: {reason}")]
    GuestMemory {
        /// Guest-physical address.
        gpa: u64,
        /// vm-memory's complaint.
        reason: String,
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

/// A restored vCPU's descriptor tables and task register must be the ones the VMM's vCPUs
/// start with: the VMM never sets them, and the CPL3 guest cannot (`lgdt`, `lidt`, `lldt`
/// and `ltr` are CPL0 instructions). A snapshot's manifest is not sealed: an edited GDT base
/// would let the guest load descriptors (a call gate to CPL0) from its own memory.
fn check_tables(
    restored: &kvm_bindings::kvm_sregs,
    fresh: &kvm_bindings::kvm_sregs,
) -> Result<(), MachineError> {
    let table = |t: &kvm_bindings::kvm_dtable| (t.base, t.limit);
    let segment = |s: &kvm_bindings::kvm_segment| (s.base, s.limit, s.selector, s.type_, s.present);
    let differs = [
        ("gdt", table(&restored.gdt) != table(&fresh.gdt)),
        ("idt", table(&restored.idt) != table(&fresh.idt)),
        ("ldt", segment(&restored.ldt) != segment(&fresh.ldt)),
        ("tr", segment(&restored.tr) != segment(&fresh.tr)),
    ];
    match differs.iter().find(|(_, d)| *d) {
        Some((name, _)) => Err(MachineError::Config(format!(
            "the snapshot's vcpu {name} is not the one the VMM's vCPUs start with (a CPL3 guest \
             cannot change it)"
        ))),
        None => Ok(()),
    }
}

fn kvm(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> MachineError {
    move |source| MachineError::Kvm { op, source }
}

/// What one command produced.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct CommandOutput {
    /// The command as run.
    pub command: String,
    /// Wall time, milliseconds.
    pub elapsed_ms: f64,
    /// `digest` and `task`: the digest of the application data, hex.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// `touch`: sum of the words read (keeps the reads honest).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sum: Option<String>,
    /// `rewrite`: pages rewritten.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pages: Option<u64>,
    /// `release`: bytes reported free and dropped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub released_bytes: Option<u64>,
    /// `task`: bytes written to disk and verified.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
    /// `model`: bytes of the answer (its digest is in `digest`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answer_bytes: Option<u64>,
    /// `model … timer=MS`: how many times the guest's timer fired during the wait.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timer_fired: Option<u64>,
    /// `poke … out=PORT`: what the VMM answered in the request areas.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub poke: Option<PokeReport>,
    /// `chaos`: what the guest did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chaos: Option<ChaosReport>,
    /// Application data filled after the command.
    pub app_bytes: u64,
}

/// Ends the command a machine runs, from any thread: `stop` and SIGTERM use it so that they
/// need not wait for a command that may never end (`sleep` for ever, a model answer that does
/// not come, a guest that does not come back). Host-side waits notice it at once; a vCPU in
/// `KVM_RUN` is kicked out by a signal, and a vCPU about to enter `KVM_RUN` finds the run
/// structure's `immediate_exit` set (written by [`Interrupter::stop`] before it signals), so
/// that `KVM_RUN` returns `EINTR` at once however long the vCPU thread was descheduled before
/// entering it. The command ends with [`MachineError::Stopped`]; once stopped, a machine stays
/// stopped.
#[derive(Debug, Clone, Default)]
pub struct Interrupter {
    inner: std::sync::Arc<InterruptState>,
}

#[derive(Debug, Default)]
struct InterruptState {
    stopped: std::sync::atomic::AtomicBool,
    /// The thread running the vCPU, while it does.
    vcpu: std::sync::Mutex<Option<Registered>>,
    /// Host-side waits (`sleep`) wait on this.
    wake: std::sync::Condvar,
    wake_lock: std::sync::Mutex<()>,
}

/// The vCPU thread registered with an [`Interrupter`].
#[derive(Debug, Clone, Copy)]
struct Registered {
    thread: libc::pthread_t,
    /// The `immediate_exit` byte of the vCPU's `kvm_run` mapping (valid while registered:
    /// [`Interrupter::enter`]'s caller keeps the vCPU alive until the registration ends).
    immediate_exit: *mut u8,
}

// SAFETY: the pointer is only dereferenced (atomically) under the registration's lock, while
// the registering thread keeps the mapping alive; the thread id is plain data.
unsafe impl Send for Registered {}

/// Sets or clears a vCPU's `immediate_exit` byte.
///
/// # Safety
/// `byte` points into a live `kvm_run` mapping.
unsafe fn store_immediate_exit(byte: *mut u8, value: u8) {
    // SAFETY: the caller guarantees the byte is live; it is only accessed atomically here
    // (the kernel reads it at KVM_RUN entry).
    unsafe { std::sync::atomic::AtomicU8::from_ptr(byte) }
        .store(value, std::sync::atomic::Ordering::SeqCst);
}

/// How long [`Interrupter::stop`] keeps kicking a vCPU that does not come out.
const KICK_FOR: Duration = Duration::from_secs(2);

/// The signal that kicks the vCPU thread out of `KVM_RUN` (its handler does nothing).
fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN() + 2
}

extern "C" fn ignore_kick(_: libc::c_int) {}

/// Installs the kick signal's handler once (without `SA_RESTART`: `KVM_RUN` returns `EINTR`).
fn install_kick_handler() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: a zeroed sigaction is valid; the handler is an async-signal-safe no-op and
        // lives for the whole program.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = ignore_kick as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&raw mut action.sa_mask);
            libc::sigaction(kick_signal(), &raw const action, std::ptr::null_mut());
        }
    });
}

impl Interrupter {
    /// Stops the machine: the running command (if any) ends with [`MachineError::Stopped`],
    /// and so does every later one. Returns once a vCPU in `KVM_RUN` is out (or after 2 s).
    pub fn stop(&self) {
        self.inner
            .stopped
            .store(true, std::sync::atomic::Ordering::SeqCst);
        {
            let _guard = self
                .inner
                .wake_lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.inner.wake.notify_all();
        }
        let until = Instant::now() + KICK_FOR;
        while Instant::now() < until && self.kick_registered() {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Kicks the registered vCPU thread once; false if none is registered.
    fn kick_registered(&self) -> bool {
        // Held while the signal is sent: the thread cannot unregister (and exit, and its id
        // be reused) between the look-up and the kill.
        let vcpu = self
            .inner
            .vcpu
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(registered) = *vcpu else {
            return false;
        };
        // SAFETY: registered, so the vCPU (and its kvm_run mapping) is alive while this lock
        // is held. Set before the signal: a vCPU thread that takes the signal outside KVM_RUN
        // still finds it when it enters.
        unsafe { store_immediate_exit(registered.immediate_exit, 1) };
        // SAFETY: the thread is registered only while it runs the vCPU loop (it unregisters
        // itself under this lock, which is held, before it returns), so it is alive.
        unsafe { libc::pthread_kill(registered.thread, kick_signal()) };
        true
    }

    /// Kicks the vCPU out of `KVM_RUN` once, without stopping the machine: the command goes
    /// on after the vCPU thread has looked at why (the governor's preemption). A vCPU thread
    /// outside `KVM_RUN` comes back out of its next one at once (`immediate_exit`); no vCPU
    /// thread registered: nothing happens.
    pub fn kick(&self) {
        self.kick_registered();
    }

    /// Whether the machine was stopped.
    pub fn stopped(&self) -> bool {
        self.inner.stopped.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits `duration` unless stopped first; returns whether it was stopped.
    fn sleep(&self, duration: Duration) -> bool {
        let until = Instant::now().checked_add(duration);
        let mut guard = self
            .inner
            .wake_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            if self.stopped() {
                return true;
            }
            let left = until.map_or(Duration::from_secs(3600), |u| {
                u.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                return false;
            }
            guard = self
                .inner
                .wake
                .wait_timeout(guard, left.min(Duration::from_secs(3600)))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Registers the calling thread as the vCPU's until the guard drops. The kick signal is
    /// unblocked in the thread meanwhile (a caller may block every signal, and a blocked kick
    /// never makes `KVM_RUN` return); the thread's mask is restored afterwards.
    ///
    /// # Safety
    /// `vcpu` must outlive the returned guard (its `kvm_run` mapping is written by
    /// [`Interrupter::stop`] while the thread is registered).
    unsafe fn enter(&self, vcpu: &mut VcpuFd) -> VcpuThread<'_> {
        install_kick_handler();
        // SAFETY: the sets are plain data, initialized by sigemptyset before any other use;
        // pthread_sigmask only changes the calling thread's mask and fills `previous`.
        let previous = unsafe {
            let mut kick: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&raw mut kick);
            libc::sigaddset(&raw mut kick, kick_signal());
            let mut previous: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&raw mut previous);
            (libc::pthread_sigmask(libc::SIG_UNBLOCK, &raw const kick, &raw mut previous) == 0)
                .then_some(previous)
        };
        // SAFETY: pthread_self cannot fail.
        let me = unsafe { libc::pthread_self() };
        let immediate_exit = &raw mut vcpu.get_kvm_run().immediate_exit;
        // SAFETY: the byte is in the vCPU's live mapping (borrowed here).
        unsafe { store_immediate_exit(immediate_exit, 0) };
        *self
            .inner
            .vcpu
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Registered {
            thread: me,
            immediate_exit,
        });
        VcpuThread {
            interrupter: self,
            previous,
            immediate_exit,
        }
    }
}

/// The vCPU thread's registration with its [`Interrupter`].
struct VcpuThread<'a> {
    interrupter: &'a Interrupter,
    /// The thread's signal mask before [`Interrupter::enter`].
    previous: Option<libc::sigset_t>,
    /// The vCPU's `immediate_exit` byte (alive as long as the guard, by `enter`'s contract).
    immediate_exit: *mut u8,
}

impl VcpuThread<'_> {
    /// Runs the vCPU once. `Ok(None)`: `KVM_RUN` was interrupted (a kick, another signal, or
    /// `immediate_exit`), run again; [`MachineError::Stopped`] once the machine is stopped.
    /// `vcpu` is the one the guard was made for.
    fn run<'v>(&self, vcpu: &'v mut VcpuFd) -> Result<Option<VcpuExit<'v>>, MachineError> {
        if self.interrupter.stopped() {
            return Err(MachineError::Stopped);
        }
        match vcpu.run() {
            Ok(exit) => Ok(Some(exit)),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                // Handled: clear it before the stop is looked at again (a stop that sets it
                // after this is seen by that look, or makes the next KVM_RUN return at once).
                // SAFETY: the guard's byte is alive while the guard is (enter's contract).
                unsafe { store_immediate_exit(self.immediate_exit, 0) };
                if self.interrupter.stopped() {
                    return Err(MachineError::Stopped);
                }
                Ok(None)
            }
            Err(e) => Err(kvm("run vCPU")(e)),
        }
    }
}

impl Drop for VcpuThread<'_> {
    fn drop(&mut self) {
        *self
            .interrupter
            .inner
            .vcpu
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        if let Some(previous) = &self.previous {
            // SAFETY: restores the calling thread's own mask from a valid set (the guard
            // lives in `run_until_done`'s frame, on the thread that made it).
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, previous, std::ptr::null_mut()) };
        }
    }
}

/// The status fields after a `poke`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PokeReport {
    /// The block request's status (0, or an errno).
    pub blk_status: u64,
    /// The free report's status (0, or an errno).
    pub free_status: u64,
    /// The model port's error flag (mailbox `arg[2]`; 1: no answer).
    pub model_error: u64,
}

/// What a `chaos` command did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ChaosReport {
    /// `out`s sent to the VMM's ports.
    pub outs: u64,
    /// `out`s held back: valid requests that would have changed the guest's own pages or its
    /// filled data.
    pub held_back: u64,
    /// `in`s.
    pub ins: u64,
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
    pager: Pager,
    ram: GuestRam,
    disk: File,
    disk_path: PathBuf,
    filled: u64,
    /// The bounce buffer of disk requests, [`DISK_CHUNK`] bytes at most.
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
    /// port with it after each of its timers.
    model_pending: Option<(u64, Instant)>,
    /// Why the last free report was refused, for the command's error.
    release_error: Option<String>,
    /// A command ended with the guest stopped in the middle of it (it crashed, or the VMM
    /// failed serving it): the guest cannot take another command. Why.
    broken: Option<String>,
}

/// How a model wait ended.
enum WaitOutcome {
    /// With the answer (or why there is none).
    Answer(Answer),
    /// The guest's timer fell due: it runs its timer's work and comes back for the answer.
    Timer,
}

/// How often a model wait without wait management looks for a stop.
const STOP_POLL: Duration = Duration::from_millis(50);

/// A disk request goes through the bounce buffer this many bytes at a time. The buffer lives
/// as long as the VM and holds guest data: sized for a whole request (1 MiB), it was the
/// largest piece of an offloaded VM's own memory (4.6-4.8 MiB in all; at 24 VMs under a
/// 512 MiB budget, 24 MiB of it).
const DISK_CHUNK: usize = 64 << 10;

/// `(offset, length)` of each [`DISK_CHUNK`] of a request of `len` bytes.
fn chunks(len: usize) -> impl Iterator<Item = (u64, usize)> {
    (0..len)
        .step_by(DISK_CHUNK)
        .map(move |at| (at as u64, DISK_CHUNK.min(len - at)))
}

/// The first `n` bytes of the bounce buffer (grown to [`DISK_CHUNK`] once).
fn bounce(buf: &mut Vec<u8>, n: usize) -> &mut [u8] {
    if buf.len() < n {
        buf.resize(DISK_CHUNK.max(n), 0);
    }
    &mut buf[..n]
}

/// How often a model wait looks for operator requests while its answer is out.
const OPERATOR_POLL: Duration = Duration::from_millis(20);

/// One model wait in progress.
struct ModelWait {
    request: u64,
    began: Instant,
    /// The VM's RAM is in the store (by the coordinator or an operator).
    offloaded: bool,
    /// The answer, held while an operator holds the VM.
    held: Option<Answer>,
    /// When the guest's timer falls due, if it reported one.
    timer_due: Option<Instant>,
}

impl ModelWait {
    /// The VM's state as `status` names it.
    fn state(&self, phase: Phase) -> &'static str {
        match (self.offloaded, phase) {
            (true, _) => "offloaded",
            // `Offloaded` without the RAM out: the offload failed and the VM stayed paused.
            (false, Phase::Paused | Phase::Manual | Phase::Offloaded) => "paused",
            (false, Phase::Running) => "running",
        }
    }

    fn describe(&self, phase: Phase) -> serde_json::Value {
        serde_json::json!({
            "request": self.request,
            "waited_s": self.began.elapsed().as_secs_f64(),
            "phase": phase,
            "answer_ready": self.held.is_some(),
        })
    }
}

/// How a machine spends its model waits (`--vm-wait-management`).
#[derive(Debug, Clone)]
pub struct WaitManagement {
    /// When to pause and offload.
    pub policy: WaitPolicy,
    /// Where and how an offload writes.
    pub offload: OffloadConfig,
    /// Threads that load RAM back.
    pub io_threads: usize,
}

impl std::fmt::Debug for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Machine")
            .field("ram", &self.ram)
            .field("disk", &self.disk_path)
            .finish_non_exhaustive()
    }
}

/// The workload guest's code selector (GDT entry 3, RPL 3): it runs at CPL3.
pub const USER_CODE_SELECTOR: u16 = 0x1b;
/// Its data and stack selector (GDT entry 4, RPL 3).
pub const USER_DATA_SELECTOR: u16 = 0x23;
/// CR0 the VMM sets: PG | PE | WP.
pub const GUEST_CR0: u64 = 0x8000_0001 | (1 << 16);
/// CR4 the VMM sets: PAE.
pub const GUEST_CR4: u64 = 1 << 5;
/// EFER the VMM sets: LME | LMA.
pub const GUEST_EFER: u64 = 0x500;

/// A user code segment (selector with RPL 3).
fn segment(selector: u16, type_: u8, long: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xFFFF_FFFF,
        selector,
        type_,
        present: 1,
        dpl: 3,
        db: u8::from(!long),
        s: 1,
        l: u8::from(long),
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

impl Machine {
    /// Maps RAM, starts the pager, loads the guest, creates the VM and runs the guest to its
    /// first `PORT_DONE` (ready for commands). `on_fault_error` is told of faults the pager
    /// cannot serve.
    pub fn boot(
        config: &MachineConfig,
        on_fault_error: Box<dyn Fn(&FaultError) + Send + Sync>,
    ) -> Result<Self, MachineError> {
        guest::check_memory(config.memory).map_err(MachineError::Config)?;
        if config.vcpus == 0 || config.vcpus > 64 {
            return Err(MachineError::Config(format!(
                "vcpus must be 1 to 64, not {}",
                config.vcpus
            )));
        }
        // Snapshot RAM is served by its image's page cache, not by the pager: every page
        // counts as resident. RAM restored from a store starts with every page in the store.
        let (ram, initial, source) = match config.restore.as_ref().map(|r| &r.ram) {
            Some(RestoreRam::Image(image)) => (
                GuestRam::from_image(std::sync::Arc::clone(image), config.memory)?,
                PageState::Resident,
                None,
            ),
            Some(RestoreRam::Source(source)) => (
                GuestRam::new(config.memory, config.ram_kind)?,
                PageState::Source,
                Some(std::sync::Arc::clone(source)),
            ),
            None => (
                GuestRam::new(config.memory, config.ram_kind)?,
                PageState::Zero,
                None,
            ),
        };
        // SAFETY: the RAM mapping outlives the pager (field order of `Machine`), and every
        // access to it goes through KVM, the pager or vm-memory, all of which tolerate the
        // pager filling pages at any time.
        let pager = unsafe {
            Pager::new(
                vec![ram.region_spec()],
                PagerConfig {
                    threads: config.pager_threads.max(1),
                    block_size: config.block_size,
                    initial,
                    register: true,
                    // The VMM tells the pager of every discard itself (before making it), and
                    // cold compression zaps page-table entries, which must not read as discards.
                    remove_events: false,
                    track_writes: config.track_writes,
                },
                source,
                on_fault_error,
            )
        }
        .map_err(MachineError::Pager)?;
        // A new disk is created 0600 (it holds the guest's data); never through a link,
        // never a FIFO (whose open would block) or a device.
        let disk = compressed_backing::file::open_or_create_private(&config.disk).map_err(|e| {
            MachineError::Disk {
                path: config.disk.clone(),
                source: e.into(),
            }
        })?;

        if config.restore.is_none() {
            write_boot_structures(&ram)?;
        }

        let kvm_fd = Kvm::new().map_err(kvm("open /dev/kvm"))?;
        let vm = kvm_fd.create_vm().map_err(kvm("create VM"))?;
        let region = kvm_userspace_memory_region {
            slot: 0,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: ram.size(),
            userspace_addr: ram.host_base().0,
        };
        // SAFETY: the region is our own RAM mapping, which outlives the VM (field order).
        unsafe { vm.set_user_memory_region(region) }.map_err(kvm("set memory region"))?;
        let cpuid = kvm_fd
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm("get supported CPUID"))?;
        let mut vcpus = Vec::new();
        for id in 0..config.vcpus {
            let vcpu = vm.create_vcpu(u64::from(id)).map_err(kvm("create vCPU"))?;
            vcpu.set_cpuid2(&cpuid).map_err(kvm("set CPUID"))?;
            vcpus.push(vcpu);
        }
        let vcpu = vcpus.remove(0);
        let mut sregs = vcpu.get_sregs().map_err(kvm("get sregs"))?;
        sregs.cr3 = guest::PML4_GPA;
        sregs.cr4 = GUEST_CR4;
        sregs.cr0 = GUEST_CR0;
        sregs.efer = GUEST_EFER;
        sregs.cs = segment(USER_CODE_SELECTOR, 11, true);
        let data = segment(USER_DATA_SELECTOR, 3, false);
        (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
        let regs = kvm_bindings::kvm_regs {
            rip: guest::CODE_GPA,
            rsp: guest::STACK_TOP,
            rflags: 0x3002, // IOPL 3, reserved bit 1
            ..Default::default()
        };
        let (sregs, regs) = match &config.restore {
            Some(restore) => {
                check_tables(&restore.vcpu.sregs, &sregs)?;
                (restore.vcpu.sregs, restore.vcpu.regs)
            }
            None => (sregs, regs),
        };
        vcpu.set_sregs(&sregs).map_err(kvm("set sregs"))?;
        vcpu.set_regs(&regs).map_err(kvm("set regs"))?;

        let mut machine = Self {
            vcpu,
            _idle_vcpus: vcpus,
            _vm: vm,
            _kvm: kvm_fd,
            pager,
            ram,
            disk,
            disk_path: config.disk.clone(),
            filled: config.restore.as_ref().map_or(0, |r| r.filled),
            io_buf: Vec::new(),
            model: None,
            model_error: None,
            wait: None,
            coordinator: None,
            wait_failures: (0, 0),
            operator: None,
            governor: None,
            stop_requested: false,
            interrupter: Interrupter::default(),
            model_pending: None,
            release_error: None,
            broken: None,
        };
        if config.restore.is_none() {
            machine.run_until_done()?;
        }
        Ok(machine)
    }

    /// The pager serving this VM's RAM.
    pub fn pager(&self) -> &Pager {
        &self.pager
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
        let result = self.pager.offload(config);
        if result.is_ok() {
            let _ = self.drop_disk_cache();
        }
        // SAFETY: malloc_trim only releases free memory of the allocator.
        unsafe { libc::malloc_trim(0) };
        result
    }

    /// For the memory governor, with the vCPU out of the guest (between commands, or
    /// preempted in one): offloads the VM's RAM to its wait management's store (`None`: no
    /// wait management, so no store).
    pub fn idle_offload(&self) -> Option<Result<OffloadReport, OffloadError>> {
        let wait = self.wait.as_ref()?;
        Some(self.offload(&wait.offload))
    }

    /// Where the guest's `model` requests go.
    pub fn set_model_port(&mut self, port: std::sync::Arc<dyn crate::gateway::ModelPort>) {
        self.model = Some(port);
    }

    /// The virtual disk's file.
    pub fn disk(&self) -> &File {
        &self.disk
    }

    /// Runs one command (host-side `sleep` and `idle` included).
    pub fn run(&mut self, command: &Command) -> Result<CommandOutput, MachineError> {
        let started = Instant::now();
        let mut output = CommandOutput {
            command: command.to_string(),
            ..CommandOutput::default()
        };
        let app_size = self.ram.size() - guest::APP_BASE;
        let too_large = |size: u64| {
            (size > app_size).then(|| MachineError::Command {
                command: command.to_string(),
                reason: format!(
                    "{size} bytes is more than the {app_size} bytes of application memory"
                ),
            })
        };
        match *command {
            Command::Fill { size, kind, seed } => {
                if let Some(e) = too_large(size) {
                    return Err(e);
                }
                self.guest(command, Op::Fill, &[size, kind as u64, seed])?;
            }
            Command::Digest => {
                let result = self.guest(command, Op::Digest, &[self.filled, 0, 0])?;
                output.digest = Some(format!("{:016x}", result[0]));
            }
            Command::Touch { size } => {
                if let Some(e) = too_large(size) {
                    return Err(e);
                }
                let result = self.guest(command, Op::Touch, &[size, 0, 0])?;
                output.sum = Some(format!("{:016x}", result[0]));
            }
            Command::Rewrite { percent, seed } => {
                let result = self.guest(command, Op::Rewrite, &[percent, seed, 0])?;
                output.pages = Some(result[0]);
            }
            Command::Release => {
                let result = self.guest(command, Op::Release, &[0, 0, 0])?;
                output.released_bytes = Some(result[0]);
            }
            Command::Task => {
                let result = self.guest(command, Op::Task, &[0, 0, 0])?;
                output.digest = Some(format!("{:016x}", result[0]));
                output.disk_bytes = Some(result[1]);
            }
            Command::Model { request, timer_ms } => {
                let result =
                    self.guest(command, Op::Model, &[request, 0, 0, timer_ms.unwrap_or(0)])?;
                output.digest = Some(format!("{:016x}", result[0]));
                output.answer_bytes = Some(result[1]);
                output.timer_fired = timer_ms.map(|_| result[3]);
            }
            Command::Poke { gpa, value, port } => {
                let result = self.guest(
                    command,
                    Op::Poke,
                    &[gpa, value, u64::from(port.unwrap_or(0))],
                )?;
                output.poke = port.map(|_| PokeReport {
                    blk_status: result[0],
                    free_status: result[1],
                    model_error: result[3],
                });
            }
            Command::Chaos { seed, count } => {
                let result = self.guest(command, Op::Chaos, &[seed, count])?;
                output.chaos = Some(ChaosReport {
                    outs: result[0],
                    held_back: result[1],
                    ins: result[3],
                });
            }
            Command::Sleep { ms } => {
                if self.interrupter.sleep(Duration::from_millis(ms)) {
                    return Err(MachineError::Stopped);
                }
            }
            Command::Idle => self.pager.set_idle(true),
        }
        if *command != Command::Idle {
            self.pager.set_idle(false);
        }
        output.app_bytes = self.filled;
        output.elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
        Ok(output)
    }

    /// Runs one guest command; returns its results. Everything read back is the guest's word:
    /// its filled size is clamped to the application memory, an unknown status is an error.
    fn guest(&mut self, command: &Command, op: Op, args: &[u64]) -> Result<[u64; 6], MachineError> {
        self.check_usable()?;
        self.model_error = None;
        self.release_error = None;
        let mut mailbox: Mailbox = self.read(guest::MAILBOX_GPA)?;
        mailbox.op = op as u64;
        mailbox.arg = [0; 6];
        mailbox.arg[..args.len()].copy_from_slice(args);
        self.write(guest::MAILBOX_GPA, mailbox)?;
        let ran = self.run_until_done();
        // However the command ended, none of its model requests is in flight any more.
        self.model_pending = None;
        if let Err(e) = ran {
            self.broken = Some(e.to_string());
            return Err(e);
        }
        let mailbox: Mailbox = self.read(guest::MAILBOX_GPA)?;
        self.filled = mailbox.result[2].min(self.ram.size() - guest::APP_BASE);
        let reason = match mailbox.status {
            status::OK => return Ok(mailbox.result),
            status::BAD_OP => "unknown operation".to_owned(),
            status::TOO_LARGE => "size beyond the application memory".to_owned(),
            status::IO => "a disk request failed".to_owned(),
            status::MISMATCH => "data read back from the disk differs".to_owned(),
            status::MODEL => self
                .model_error
                .take()
                .unwrap_or_else(|| "the model request got no answer".to_owned()),
            status::RELEASE => self
                .release_error
                .take()
                .unwrap_or_else(|| "the free report was refused".to_owned()),
            other => format!("status {other}"),
        };
        Err(MachineError::Command {
            command: command.to_string(),
            reason,
        })
    }

    /// Runs the vCPU until the guest writes `PORT_DONE`; meanwhile the memory governor may
    /// preempt it (see [`Machine::preempted`]).
    fn run_until_done(&mut self) -> Result<(), MachineError> {
        if let Some(link) = &self.governor {
            let interrupter = self.interrupter.clone();
            link.set_preempter(Some(std::sync::Arc::new(move || interrupter.kick())));
        }
        let ran = self.run_vcpu_until_done();
        if let Some(link) = &self.governor {
            link.set_preempter(None);
        }
        ran
    }

    /// The governor kicked the vCPU out to take its RAM: a VM held at a fault in its command
    /// cannot reach a wait where its RAM could go, and when every VM is so held nothing else
    /// frees room (the deadlock of docs/governor.md). Offloaded here, between two `KVM_RUN`s
    /// of the vCPU thread, the guest re-enters where it was; the faults that follow ask for
    /// room again, behind the older VMs. A VM without wait management has no store: it
    /// refuses.
    fn preempted(&mut self) {
        let Some(link) = &self.governor else {
            return;
        };
        while let Some(Order::Offload { .. }) = link.take_order() {
            let ok = self.idle_offload().is_some_and(|r| r.is_ok());
            link.offloaded(ok, self.resident_bytes());
            // Still in its command.
            link.report(WireState::Running, None);
        }
    }

    fn run_vcpu_until_done(&mut self) -> Result<(), MachineError> {
        let interrupter = self.interrupter.clone();
        // SAFETY: `self.vcpu` outlives the guard, a local of this frame (`&mut self`).
        let vcpu_thread = unsafe { interrupter.enter(&mut self.vcpu) };
        loop {
            let exit = match vcpu_thread.run(&mut self.vcpu)? {
                None => {
                    self.preempted();
                    continue;
                }
                Some(VcpuExit::IoOut(port, _)) => Ok(port),
                // No port answers reads: an `in` reads all ones, as from an empty bus.
                Some(VcpuExit::IoIn(_, data)) => {
                    data.fill(0xFF);
                    continue;
                }
                Some(exit) => Err(format!("{exit:?}")),
            };
            let port = match exit {
                Ok(port) => port,
                Err(exit) => {
                    let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
                    return Err(MachineError::GuestCrashed(format!(
                        "{exit} at rip {rip:#x}"
                    )));
                }
            };
            match port {
                guest::PORT_DONE => return Ok(()),
                guest::PORT_BLK => self.block_request()?,
                guest::PORT_FREE => self.free_report()?,
                guest::PORT_MODEL => self.model_request()?,
                // Writes to a port nothing listens on go nowhere, as on real hardware.
                _ => {}
            }
        }
    }

    /// Serves the block request in the mailbox's neighbour page, [`DISK_CHUNK`] bytes at a
    /// time through one bounce buffer. Every field is the guest's:
    /// a request that is not whole sectors of at most one I/O buffer, inside the disk's bounds
    /// and with its buffer inside RAM gets an errno back ([`guest::check_block`]); so does a
    /// disk error.
    fn block_request(&mut self) -> Result<(), MachineError> {
        let mut request: BlkRequest = self.read(guest::BLK_GPA)?;
        let result: std::io::Result<()> = match guest::check_block(&request, self.ram.size()) {
            Err(Refused { errno, .. }) => Err(std::io::Error::from_raw_os_error(errno)),
            Ok(BlockIo::Write { offset, len, buf }) => chunks(len).try_for_each(|(at, n)| {
                let chunk = bounce(&mut self.io_buf, n);
                self.ram
                    .memory()
                    .read_slice(chunk, GuestAddress(buf + at))
                    .map_err(|_| std::io::Error::from_raw_os_error(libc::EFAULT))?;
                self.disk.write_all_at(chunk, offset + at)
            }),
            Ok(BlockIo::Read { offset, len, buf }) => chunks(len).try_for_each(|(at, n)| {
                let chunk = bounce(&mut self.io_buf, n);
                self.disk.read_exact_at(chunk, offset + at)?;
                self.ram
                    .memory()
                    .write_slice(chunk, GuestAddress(buf + at))
                    .map_err(|_| std::io::Error::from_raw_os_error(libc::EFAULT))
            }),
            Ok(BlockIo::Flush) => self.disk.sync_data(),
        };
        // The guest sees the failure as an errno (EIO for a read past the disk's end).
        request.status = match result {
            Ok(()) => 0,
            Err(e) => u64::try_from(e.raw_os_error().unwrap_or(libc::EIO)).unwrap_or(5),
        };
        self.write(guest::BLK_GPA, request)
    }

    /// Carries the guest's model request to the gateway and puts the answer in its I/O buffer.
    fn model_request(&mut self) -> Result<(), MachineError> {
        let mut mailbox: Mailbox = self.read(guest::MAILBOX_GPA)?;
        let request = mailbox.arg[0];
        // The guest's idle report: its next timer fires in this many ms (0: it has none).
        if mailbox.arg[5] > guest::MAX_TIMER_MS {
            self.model_error = Some(format!(
                "the guest's timer of {} ms is longer than {} ms",
                mailbox.arg[5],
                guest::MAX_TIMER_MS
            ));
            mailbox.arg[2] = 1;
            return self.write(guest::MAILBOX_GPA, mailbox);
        }
        let timer = (mailbox.arg[5] > 0).then(|| Duration::from_millis(mailbox.arg[5]));
        let outcome = match (self.model.clone(), self.wait.clone()) {
            (Some(port), Some(wait)) => self.managed_wait(&*port, request, timer, &wait),
            (Some(port), None) => self.plain_wait(&*port, request, timer),
            (None, _) => WaitOutcome::Answer(Answer::Error(
                "this VM has no model gateway (pvisor run --vm-model-upstream URL)".into(),
            )),
        };
        // (The command clears `model_pending` when it ends, however it ends.)
        let answer = match outcome {
            WaitOutcome::Answer(answer) => {
                // Answered: nothing is in flight (the guest may ask for the same id again).
                self.model_pending = None;
                answer
            }
            WaitOutcome::Timer => {
                mailbox.arg[4] = 1;
                return self.write(guest::MAILBOX_GPA, mailbox);
            }
        };
        match answer {
            Answer::Data(bytes) if bytes.len() as u64 <= guest::IO_BUF_SIZE => {
                self.ram
                    .memory()
                    .write_slice(&bytes, GuestAddress(guest::IO_BUF_GPA))
                    .map_err(|e| MachineError::GuestMemory {
                        gpa: guest::IO_BUF_GPA,
                        reason: e.to_string(),
                    })?;
                mailbox.arg[1] = bytes.len() as u64;
                mailbox.arg[2] = 0;
            }
            Answer::Data(bytes) => {
                self.model_error = Some(format!(
                    "the answer to request {request} has {} bytes, more than the guest's {} byte buffer",
                    bytes.len(),
                    guest::IO_BUF_SIZE
                ));
                mailbox.arg[2] = 1;
            }
            Answer::Error(why) => {
                self.model_error = Some(why);
                mailbox.arg[2] = 1;
            }
        }
        self.write(guest::MAILBOX_GPA, mailbox)
    }

    /// Sends `request` unless it is already out (the guest is back from a timer); returns
    /// when it went out.
    fn send_once(&mut self, port: &dyn ModelPort, request: u64) -> Instant {
        match self.model_pending {
            Some((pending, since)) if pending == request => since,
            _ => {
                let now = Instant::now();
                port.send(request);
                self.model_pending = Some((request, now));
                now
            }
        }
    }

    /// Waits for the answer to `request` without wait management: the VM keeps running (it
    /// only waits), and comes back early for the guest's timer.
    fn plain_wait(
        &mut self,
        port: &dyn ModelPort,
        request: u64,
        timer: Option<Duration>,
    ) -> WaitOutcome {
        self.send_once(port, request);
        let until = timer.and_then(|t| Instant::now().checked_add(t));
        // In slices, so that a stop ends the wait.
        loop {
            if self.interrupter.stopped() {
                return WaitOutcome::Answer(Answer::Error(format!(
                    "the VM was stopped while it waited for the answer to request {request}"
                )));
            }
            let left = until.map_or(STOP_POLL, |u| u.saturating_duration_since(Instant::now()));
            if let Some(answer) = port.wait_for(request, left.min(STOP_POLL)) {
                return WaitOutcome::Answer(answer);
            }
            if until.is_some_and(|u| u <= Instant::now()) {
                return WaitOutcome::Timer;
            }
        }
    }

    /// Waits for the answer to `request` the way the wait policy says: the guest is stopped at
    /// the model port (idle, no timer pending), so it is paused as it is, offloaded once the
    /// wait is long enough, and brought back (on faults, by default) when the answer arrives.
    /// Operator requests are answered meanwhile (see [`crate::operator`]).
    fn managed_wait(
        &mut self,
        port: &dyn ModelPort,
        request: u64,
        timer: Option<Duration>,
        wait: &WaitManagement,
    ) -> WaitOutcome {
        let mut coordinator = self
            .coordinator
            .take()
            .unwrap_or_else(|| WaitCoordinator::new(wait.policy, 0));
        let mut operator = self.operator.take();
        let began = self.send_once(port, request);
        let now = Instant::now();
        let mut w = ModelWait {
            request,
            began,
            offloaded: false,
            held: None,
            timer_due: timer.map(|t| now + t),
        };
        coordinator.handle(
            now,
            WaitEvent::GuestIdle {
                epoch: 0,
                timer_due: w.timer_due,
            },
        );
        // Back from a timer, the request keeps the start it had.
        let mut actions = coordinator.handle(now, WaitEvent::WaitStart { request, epoch: 0 });
        if let Some(link) = &self.governor {
            link.set_waiting(true);
            link.report(
                WireState::Waiting,
                coordinator.expected_remaining(now.saturating_duration_since(began)),
            );
        }
        // An offload the governor ordered is under way: its outcome goes back to it.
        let mut reclaiming = false;
        let outcome = loop {
            for action in actions.drain(..) {
                if let Some(took) = self.carry_out(action, wait, &mut w.offloaded) {
                    coordinator.offload_took(took);
                }
                if action == WaitAction::Offload {
                    self.report_offload(&coordinator, &w, std::mem::take(&mut reclaiming));
                }
            }
            if coordinator.phase() != Phase::Manual {
                // Held for an operator who has given the VM back now.
                if let Some(answer) = w.held.take() {
                    break WaitOutcome::Answer(answer);
                }
            }
            if self.stop_requested || self.interrupter.stopped() {
                break WaitOutcome::Answer(Answer::Error(format!(
                    "the VM was stopped while it waited for the answer to request {request}"
                )));
            }
            // The guest's timer runs when the VM runs: at once if the coordinator let it run,
            // after the coordinator's resume (for that timer) if it had paused or offloaded it,
            // never while an operator holds it (a held answer means an operator holds it).
            let running = coordinator.phase() == Phase::Running;
            if running && w.timer_due.is_some_and(|due| due <= Instant::now()) {
                break WaitOutcome::Timer;
            }
            let next = [coordinator.next_deadline(), w.timer_due.filter(|_| running)]
                .into_iter()
                .flatten()
                .min();
            let until = next.map_or(Duration::from_secs(3600), |d| {
                d.saturating_duration_since(Instant::now())
            });
            if w.held.is_none() {
                let slice = if operator.is_some() {
                    until.min(OPERATOR_POLL)
                } else {
                    until.min(STOP_POLL)
                };
                if let Some(answer) = port.wait_for(request, slice) {
                    let done = coordinator
                        .handle(Instant::now(), WaitEvent::DataReady { request, epoch: 0 });
                    if coordinator.phase() != Phase::Manual {
                        if let Some(link) = &self.governor {
                            // Running from here: the copy of the answer faults RAM back.
                            link.set_waiting(false);
                            link.report(WireState::Running, None);
                        }
                    }
                    if coordinator.phase() == Phase::Manual {
                        // An operator holds the VM: the answer waits for their resume.
                        w.held = Some(answer);
                    } else {
                        for action in done {
                            // Only a resume and a delivery follow an answer.
                            let _ = self.carry_out(action, wait, &mut w.offloaded);
                        }
                        break WaitOutcome::Answer(answer);
                    }
                }
            }
            if let Some(source) = operator.as_mut() {
                // With the answer held only an operator can end the wait: block on them.
                let timeout = if w.held.is_some() {
                    until.min(Duration::from_secs(1))
                } else {
                    Duration::ZERO
                };
                if let Some((asked, reply)) = source.next(timeout) {
                    let (result, more) = self.operate(asked, &mut coordinator, &mut w, wait);
                    reply(result);
                    actions.extend(more);
                }
            }
            if let Some(link) = &self.governor {
                while let Some(Order::Offload { .. }) = link.take_order() {
                    let ordered = coordinator.handle(Instant::now(), WaitEvent::Reclaim);
                    if ordered.contains(&WaitAction::Offload) {
                        reclaiming = true;
                        actions.extend(ordered);
                    } else {
                        // Offloaded already, or an operator's: nothing to give.
                        link.offloaded(false, self.resident_bytes());
                    }
                }
            }
            actions.extend(coordinator.tick(Instant::now()));
        };
        if let Some(link) = &self.governor {
            link.set_waiting(false);
            link.report(WireState::Running, None);
        }
        // The guest runs on (after the answer, or its timer's work): its idleness is reported
        // anew next time.
        coordinator.handle(Instant::now(), WaitEvent::GuestBusy { epoch: 0 });
        self.coordinator = Some(coordinator);
        self.operator = operator;
        outcome
    }

    /// Answers an operator request during model wait `w`; returns the answer and what the
    /// coordinator wants done next.
    fn operate(
        &mut self,
        asked: OperatorRequest,
        coordinator: &mut WaitCoordinator,
        w: &mut ModelWait,
        wait: &WaitManagement,
    ) -> (Result<serde_json::Value, String>, Vec<WaitAction>) {
        let now = Instant::now();
        match asked {
            OperatorRequest::Status => (
                Ok(serde_json::json!({
                    "state": w.state(coordinator.phase()),
                    "model_wait": w.describe(coordinator.phase()),
                })),
                Vec::new(),
            ),
            OperatorRequest::Stats => {
                let ram = &self.ram;
                (
                    Ok(serde_json::json!({
                        "state": w.state(coordinator.phase()),
                        "model_wait": w.describe(coordinator.phase()),
                        "memory_bytes": ram.size(),
                        "process_pss_bytes": crate::stats::process_pss().unwrap_or(0),
                        "guest_ram_pss_bytes": ram.pss(),
                        "guest_ram_host_base": ram.host_base().0,
                        "app_bytes": self.app_bytes(),
                        "pages": self.pager.state_counts(),
                        "pager": self.pager.metrics().snapshot(),
                        "wait": self.wait_stats_of(coordinator),
                    })),
                    Vec::new(),
                )
            }
            OperatorRequest::Suspend { offload } => {
                let actions = coordinator.handle(now, WaitEvent::ManualSuspend);
                let mut report = None;
                if offload && !w.offloaded {
                    match self.offload(&wait.offload) {
                        Ok(done) => {
                            w.offloaded = true;
                            report = Some(done);
                        }
                        Err(e) => {
                            return (
                                Err(format!(
                                "the offload failed and the VM stays suspended with its RAM: {}",
                                compressed_backing::store::error_chain(&e)
                            )),
                                actions,
                            )
                        }
                    }
                }
                (
                    Ok(serde_json::json!({
                        "state": w.state(coordinator.phase()),
                        "offload": report,
                        "model_wait": w.describe(coordinator.phase()),
                    })),
                    actions,
                )
            }
            OperatorRequest::Resume { eager } => {
                if coordinator.phase() != Phase::Manual {
                    return (
                        Err(format!(
                            "the VM is not suspended: it waits for the answer to model request {} \
                             under wait management",
                            w.request
                        )),
                        Vec::new(),
                    );
                }
                let mut load = None;
                if w.offloaded {
                    // The guest still waits: unless asked for everything, the RAM comes back
                    // the way wait management brings it back.
                    let mode = if eager {
                        LoadMode::Eager
                    } else {
                        wait.policy.reload
                    };
                    match self.pager.load(mode, wait.io_threads) {
                        Ok(report) => {
                            w.offloaded = false;
                            load = Some(report);
                        }
                        Err(e) => {
                            return (
                                Err(format!(
                                    "cannot load the VM's RAM back: {}",
                                    compressed_backing::store::error_chain(&e)
                                )),
                                Vec::new(),
                            )
                        }
                    }
                }
                let mut actions = coordinator.handle(now, WaitEvent::ManualResume);
                // The guest is still stopped at the model port, as idle as before: wait
                // management takes the wait over again.
                actions.extend(coordinator.handle(
                    now,
                    WaitEvent::GuestIdle {
                        epoch: 0,
                        timer_due: w.timer_due,
                    },
                ));
                (
                    Ok(serde_json::json!({
                        "state": "running",
                        "load": load,
                        "model_wait": w.describe(coordinator.phase()),
                    })),
                    actions,
                )
            }
            OperatorRequest::Stop => {
                self.stop_requested = true;
                (Ok(serde_json::json!({ "stopped": true })), Vec::new())
            }
        }
    }

    /// Tells the governor what an offload of wait `w` gave: the answer to its order if it
    /// `ordered` it, and the VM's new state if the RAM went out.
    fn report_offload(&self, coordinator: &WaitCoordinator, w: &ModelWait, ordered: bool) {
        let Some(link) = &self.governor else {
            return;
        };
        if ordered {
            link.offloaded(w.offloaded, self.resident_bytes());
        }
        if w.offloaded {
            link.report(
                WireState::Offloaded,
                coordinator.expected_remaining(w.began.elapsed()),
            );
        }
    }

    /// One of the coordinator's actions. The vCPU is already stopped at the model port, so a
    /// pause changes nothing; an offload that fails leaves RAM resident (counted). Returns how
    /// long an offload took.
    fn carry_out(
        &mut self,
        action: WaitAction,
        wait: &WaitManagement,
        offloaded: &mut bool,
    ) -> Option<Duration> {
        match action {
            WaitAction::Pause | WaitAction::Deliver { .. } => {}
            WaitAction::Offload => {
                let started = Instant::now();
                if self.offload(&wait.offload).is_ok() {
                    *offloaded = true;
                    return Some(started.elapsed());
                }
                // Counted; a failure says nothing about what an offload costs.
                self.wait_failures.0 += 1;
            }
            WaitAction::Resume => {
                if *offloaded {
                    // Lazily (or on faults only): the answer's copy and the guest's next steps
                    // fault pages back.
                    if self
                        .pager
                        .load(wait.policy.reload, wait.io_threads)
                        .is_err()
                    {
                        self.wait_failures.1 += 1;
                    }
                    *offloaded = false;
                }
            }
        }
        None
    }

    /// Drops the range the guest reported free (it reads as zeros afterwards), or tells the
    /// guest why not in the report's status: only whole pages of the application data are
    /// dropped ([`guest::check_free`]).
    fn free_report(&mut self) -> Result<(), MachineError> {
        let mailbox: Mailbox = self.read(guest::MAILBOX_GPA)?;
        let status = match self.drop_free(mailbox.free_gpa, mailbox.free_len) {
            Ok(()) => 0,
            Err(Refused { errno, reason }) => {
                self.release_error = Some(reason);
                u64::try_from(errno).unwrap_or(5)
            }
        };
        let field = guest::MAILBOX_GPA + std::mem::offset_of!(Mailbox, free_status) as u64;
        self.write(field, status)
    }

    fn drop_free(&mut self, gpa: u64, len: u64) -> Result<(), Refused> {
        guest::check_free(gpa, len, self.ram.size())?;
        let range = self.ram.host_range(gpa, len).ok_or_else(|| Refused {
            errno: libc::EINVAL,
            reason: format!("free report of {len} bytes at {gpa:#x} is outside RAM"),
        })?;
        let fail = |source: std::io::Error| Refused {
            errno: source.raw_os_error().unwrap_or(libc::EIO),
            reason: compressed_backing::store::error_chain(&MachineError::Release {
                gpa,
                len,
                source,
            }),
        };
        let len = usize::try_from(len).expect("inside RAM");
        // The pager learns of the discard first, so that nothing it installs meanwhile
        // survives it: the pages read as zeros from now on.
        self.pager.discarded(range);
        match self.ram.kind() {
            // Snapshot RAM: its private copies go; the range reads as the snapshot's bytes
            // again (free memory has no contents the guest relies on).
            RamKind::Anon | RamKind::Snapshot => {
                // SAFETY: discarding whole pages of our own guest RAM (checked inside it),
                // which the guest freed.
                let rc = unsafe { libc::madvise(range.start().as_ptr(), len, libc::MADV_DONTNEED) };
                if rc != 0 {
                    return Err(fail(std::io::Error::last_os_error()));
                }
            }
            RamKind::Memfd => {
                let memfd = self.ram.memfd().expect("memfd RAM has its memfd");
                uffd_pager::offload::punch_hole(memfd, gpa, len as u64).map_err(fail)?;
            }
        }
        Ok(())
    }

    fn read<T: vm_memory::ByteValued>(&self, gpa: u64) -> Result<T, MachineError> {
        self.ram
            .memory()
            .read_obj(GuestAddress(gpa))
            .map_err(|e| MachineError::GuestMemory {
                gpa,
                reason: e.to_string(),
            })
    }

    fn write<T: vm_memory::ByteValued>(&self, gpa: u64, value: T) -> Result<(), MachineError> {
        self.ram
            .memory()
            .write_obj(value, GuestAddress(gpa))
            .map_err(|e| MachineError::GuestMemory {
                gpa,
                reason: e.to_string(),
            })
    }
}

// SAFETY: plain-old-data structures of u64 fields, valid for any bit pattern.
unsafe impl vm_memory::ByteValued for Mailbox {}
// SAFETY: as above.
unsafe impl vm_memory::ByteValued for BlkRequest {}

/// Writes the identity map (2 MiB user pages), the program and the mailbox.
fn write_boot_structures(ram: &GuestRam) -> Result<(), MachineError> {
    let mem = ram.memory();
    let fail = |gpa: u64| {
        move |e: vm_memory::GuestMemoryError| MachineError::GuestMemory {
            gpa,
            reason: e.to_string(),
        }
    };
    mem.write_obj(guest::PDPT_GPA | 7, GuestAddress(guest::PML4_GPA))
        .map_err(fail(guest::PML4_GPA))?;
    let pages = ram.size() / (2 << 20);
    for gib in 0..pages.div_ceil(512) {
        let pd = guest::PD_GPA + gib * 0x1000;
        mem.write_obj(pd | 7, GuestAddress(guest::PDPT_GPA + gib * 8))
            .map_err(fail(guest::PDPT_GPA))?;
    }
    for page in 0..pages {
        // Present, writable, user, 2 MiB.
        let entry = (page * (2 << 20)) | 0x87;
        let gpa = guest::PD_GPA + page * 8;
        mem.write_obj(entry, GuestAddress(gpa)).map_err(fail(gpa))?;
    }
    mem.write_slice(guest::BINARY, GuestAddress(guest::CODE_GPA))
        .map_err(fail(guest::CODE_GPA))?;
    let mailbox = Mailbox {
        app_base: guest::APP_BASE,
        app_size: ram.size() - guest::APP_BASE,
        io_buf: guest::IO_BUF_GPA,
        io_buf_size: guest::IO_BUF_SIZE,
        ..Mailbox::default()
    };
    mem.write_obj(mailbox, GuestAddress(guest::MAILBOX_GPA))
        .map_err(fail(guest::MAILBOX_GPA))?;
    Ok(())
}

#[cfg(test)]
mod disk_tests {
    use super::*;

    #[test]
    fn disk_requests_go_in_chunks_that_cover_them_through_a_bounded_buffer() {
        assert_eq!(chunks(0).count(), 0);
        assert_eq!(chunks(512).collect::<Vec<_>>(), vec![(0, 512)]);
        assert_eq!(
            chunks(DISK_CHUNK + 512).collect::<Vec<_>>(),
            vec![(0, DISK_CHUNK), (DISK_CHUNK as u64, 512)]
        );
        let whole: Vec<_> = chunks(guest::MAX_BLK_LEN as usize).collect();
        assert_eq!(whole.len(), guest::MAX_BLK_LEN as usize / DISK_CHUNK);
        assert!(whole
            .windows(2)
            .all(|w| w[0].0 + w[0].1 as u64 == w[1].0 && w[0].1 == DISK_CHUNK));
        let mut buf = Vec::new();
        assert_eq!(bounce(&mut buf, 512).len(), 512);
        assert_eq!(bounce(&mut buf, DISK_CHUNK).len(), DISK_CHUNK);
        assert_eq!(buf.len(), DISK_CHUNK);
    }
}

#[cfg(test)]
mod interrupt_tests {
    use super::*;

    #[test]
    fn interrupter_stop_ends_a_sleep_for_ever_at_once() {
        let interrupter = Interrupter::default();
        let sleeper = interrupter.clone();
        let started = Instant::now();
        let waiting = std::thread::spawn(move || sleeper.sleep(Duration::from_millis(u64::MAX)));
        std::thread::sleep(Duration::from_millis(50));
        interrupter.stop();
        assert!(waiting.join().expect("the sleeper panicked"));
        assert!(started.elapsed() < Duration::from_secs(2));
        // Stopped stays stopped.
        assert!(interrupter.sleep(Duration::from_secs(10)));
    }

    /// A vCPU that spins in `jmp $` in real mode, with its memory (which must outlive it).
    fn spinning_vcpu() -> (VmFd, VcpuFd, *mut libc::c_void) {
        let vm = Kvm::new()
            .expect("open /dev/kvm")
            .create_vm()
            .expect("create VM");
        // SAFETY: a fresh anonymous mapping, checked below; the test leaks it on purpose.
        let memory = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(memory, libc::MAP_FAILED);
        // SAFETY: the mapping is 4096 writable bytes; `jmp $` is EB FE.
        unsafe { std::ptr::copy_nonoverlapping([0xEBu8, 0xFE].as_ptr(), memory.cast(), 2) };
        let region = kvm_userspace_memory_region {
            slot: 0,
            guest_phys_addr: 0,
            memory_size: 4096,
            userspace_addr: memory as u64,
            flags: 0,
        };
        // SAFETY: the mapping is never unmapped (leaked), so it outlives the VM.
        unsafe { vm.set_user_memory_region(region) }.expect("set memory region");
        let vcpu = vm.create_vcpu(0).expect("create vCPU");
        let mut sregs = vcpu.get_sregs().expect("get sregs");
        sregs.cs.base = 0;
        sregs.cs.selector = 0;
        vcpu.set_sregs(&sregs).expect("set sregs");
        let mut regs = vcpu.get_regs().expect("get regs");
        regs.rip = 0;
        regs.rflags = 2;
        vcpu.set_regs(&regs).expect("set regs");
        (vm, vcpu, memory)
    }

    #[test]
    fn interrupter_stop_while_vcpu_thread_descheduled_before_kvm_run_still_stops_it() {
        let interrupter = Interrupter::default();
        let runner = interrupter.clone();
        let (registered_tx, registered) = std::sync::mpsc::channel();
        let (go, go_rx) = std::sync::mpsc::channel::<()>();
        let (done_tx, done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (_vm, mut vcpu, _memory) = spinning_vcpu();
            // SAFETY: `vcpu` lives until the end of this closure, after the guard.
            let guard = unsafe { runner.enter(&mut vcpu) };
            registered_tx.send(()).expect("send");
            // "Descheduled" right before KVM_RUN for longer than the stop kicks: every kick
            // signal arrives here, outside KVM_RUN.
            go_rx.recv().expect("go");
            // The thread looked at `stopped` before it was descheduled: it enters KVM_RUN.
            let entered = vcpu.run().err().map(|e| e.errno());
            // The run loop then sees the stop.
            let next = guard.run(&mut vcpu).err().map(|e| e.to_string());
            drop(guard);
            done_tx.send((entered, next)).expect("send");
        });
        registered.recv().expect("registered");
        interrupter.stop();
        go.send(()).expect("go");
        let (entered, next) = done
            .recv_timeout(Duration::from_secs(5))
            .expect("KVM_RUN did not return after the stop");
        assert_eq!(entered, Some(libc::EINTR));
        assert_eq!(next.as_deref(), Some("stopped"));
    }
}
