//! Ending the running command from another thread ([`Interrupter::stop`]: `stop`, SIGTERM)
//! or taking the vCPU out of the guest for a moment ([`Interrupter::kick`]: the governor's
//! preemption), and the vCPU thread's registration that makes both reach `KVM_RUN`.

use std::time::{Duration, Instant};

use kvm_ioctls::{VcpuExit, VcpuFd};

use super::{kvm, MachineError};

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
    /// Why the machine was stopped, when it failed rather than was stopped.
    failure: std::sync::Mutex<Option<String>>,
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

    /// Stops the machine because it cannot go on (its guest memory cannot be served): the
    /// running command and every later one end with [`MachineError::MemoryLost`] naming
    /// `reason` (the first reason given) instead of [`MachineError::Stopped`].
    ///
    /// Returns, the first time only, whether a vCPU is still in `KVM_RUN` after the kicks
    /// (a vCPU waiting in a fault that will not be answered may not come out); `None` after.
    pub fn fail(&self, reason: String) -> Option<bool> {
        {
            let mut failure = self
                .inner
                .failure
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if failure.is_some() {
                return None;
            }
            *failure = Some(reason);
        }
        self.stop();
        Some(
            self.inner
                .vcpu
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .is_some(),
        )
    }

    /// The error a command that found the machine stopped ends with.
    pub(super) fn stopped_error(&self) -> MachineError {
        match &*self
            .inner
            .failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Some(reason) => MachineError::MemoryLost(reason.clone()),
            None => MachineError::Stopped,
        }
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
    pub(super) fn sleep(&self, duration: Duration) -> bool {
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
    pub(super) unsafe fn enter(&self, vcpu: &mut VcpuFd) -> VcpuThread<'_> {
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
pub(super) struct VcpuThread<'a> {
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
    pub(super) fn run<'v>(
        &self,
        vcpu: &'v mut VcpuFd,
    ) -> Result<Option<VcpuExit<'v>>, MachineError> {
        if self.interrupter.stopped() {
            return Err(self.interrupter.stopped_error());
        }
        match vcpu.run() {
            Ok(exit) => Ok(Some(exit)),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                // Handled: clear it before the stop is looked at again (a stop that sets it
                // after this is seen by that look, or makes the next KVM_RUN return at once).
                // SAFETY: the guard's byte is alive while the guard is (enter's contract).
                unsafe { store_immediate_exit(self.immediate_exit, 0) };
                if self.interrupter.stopped() {
                    return Err(self.interrupter.stopped_error());
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_userspace_memory_region;
    use kvm_ioctls::{Kvm, VmFd};

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
