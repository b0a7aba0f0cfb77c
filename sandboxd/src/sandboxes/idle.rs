//! Idle offload: a `Running` sandbox that has run no command for `--idle-offload` has its VM
//! suspended and its memory offloaded by the daemon on its own, and comes back on its next
//! command before the command runs. The client sees only latency: the sandbox stays
//! `Running` throughout (ping answers, list and get say `Running`), and a pause of an idle
//! sandbox costs nothing more (its memory is out already).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm::control::Method;

use super::{SandboxError, Sandboxes, MAX_COMMANDS};
use crate::model::State;
use crate::store::{Record, VmRef};
use crate::vm::{self, VmError};

/// A sandbox's use, as idle offload sees it.
#[derive(Debug)]
pub(super) struct Use {
    /// When its latest command started or ended (or it started).
    pub last: Instant,
    /// The daemon offloaded it while idle: its VM is suspended, its memory in the store.
    pub offloaded: bool,
    /// The daemon is offloading it now (an operation asked for meanwhile waits for that).
    pub offloading: bool,
}

/// What a command holds while it runs: its permit among the sandbox's commands, and its
/// admission by memory if its sandbox was offloaded while idle.
#[derive(Debug)]
pub struct CommandHold {
    _permit: tokio::sync::OwnedSemaphorePermit,
    _admitted: Option<super::gate::Admitted>,
}

impl super::Slot {
    /// Its VM, when it is `Running`, not offloaded nor being offloaded, with no command in
    /// flight, and has been so for `idle`.
    fn idle_for(&self, idle: Duration) -> Option<VmRef> {
        let idle = self.record.state == State::Running
            && !self.used.offloaded
            && !self.used.offloading
            && self.commands.available_permits() == MAX_COMMANDS
            && self.used.last.elapsed() >= idle;
        self.record.vm.clone().filter(|_| idle)
    }
}

impl Default for Use {
    fn default() -> Self {
        Self {
            last: Instant::now(),
            offloaded: false,
            offloading: false,
        }
    }
}

/// The most idle offloads in progress at once. Each writes a VM's memory out on a blocking
/// thread of the daemon's; two keep both of a small host's cores busy without a burst of
/// sandboxes going idle together queueing every later command behind a disk full of writes.
pub(super) const AT_ONCE: usize = 2;

impl Sandboxes {
    /// How often the daemon looks for idle sandboxes (`None`: no idle offload): a tenth of the
    /// idle time, so that a sandbox is offloaded within 10% of it, between 50 ms and a second.
    pub fn idle_check_period(&self) -> Option<Duration> {
        let idle = self.limits.idle_offload?;
        Some((idle / 10).clamp(Duration::from_millis(50), Duration::from_secs(1)))
    }

    /// Starts offloading the `Running` sandboxes that have had no command in flight for the
    /// idle time, the longest idle first, at most [`AT_ONCE`] at a time; each offload runs as a
    /// task of its own, so that the check never waits for one. Skips a sandbox an operation
    /// holds (it is not idle). A failed offload is tried again after another idle time.
    /// Called every [`Sandboxes::idle_check_period`], apart from [`Sandboxes::tick`].
    pub async fn offload_idle(self: &Arc<Self>) {
        let Some(idle) = self.limits.idle_offload else {
            return;
        };
        let mut due: Vec<(Duration, String, Arc<tokio::sync::Mutex<()>>)> = self
            .table()
            .iter()
            .filter(|(_, s)| s.idle_for(idle).is_some())
            .map(|(id, s)| (s.used.last.elapsed(), id.clone(), Arc::clone(&s.ops)))
            .collect();
        due.sort_by_key(|d| std::cmp::Reverse(d.0));
        for (_, id, ops) in due {
            let Ok(permit) = Arc::clone(&self.idle_slots).try_acquire_owned() else {
                return;
            };
            let Ok(op) = ops.try_lock_owned() else {
                continue;
            };
            // Still idle, under the operation's lock, checked and marked under one lock of the
            // table: a command that starts later sees the mark, waits for this lock and
            // brings the VM back.
            let vm = self.table().get_mut(&id).and_then(|s| {
                let vm = s.idle_for(idle)?;
                s.used.offloading = true;
                Some(vm)
            });
            let Some(vm) = vm else { continue };
            let this = Arc::clone(self);
            tokio::spawn(async move {
                this.offload_now(&id, vm).await;
                drop((op, permit));
            });
        }
    }

    /// Waits (first come, first served, at most the admission timeout) until the budget has
    /// room for what `id`'s idle-offloaded VM will bring back: what it offloaded, or at the
    /// least its learned peak less its overhead (see [`super::gate`]).
    async fn admit_command(&self, id: &str) -> Option<super::gate::Admitted> {
        let (_, status) = self.governed.reading();
        let vm = status.vms.iter().find(|vm| vm.name == id)?;
        let need = vm.offloaded_bytes.max(vm.peak.saturating_sub(vm.overhead));
        if need == 0 {
            return None;
        }
        let bound = self.limits.admission_timeout;
        let asked = Instant::now();
        let read = || self.governed.holdings();
        let (admitted, waited) = self.gate.admit(id, need, bound, read).await;
        if waited {
            self.metrics.commands_waited.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%id, need, ms = asked.elapsed().as_millis(), "waited for room to come back");
        }
        Some(admitted)
    }

    /// Offloads `id`'s VM, suspended, for idle offload.
    async fn offload_now(&self, id: &str, vm: VmRef) {
        let started = Instant::now();
        let method = Method::Suspend {
            offload: true,
            ram_file: None,
        };
        match tokio::task::spawn_blocking(move || vm::call(&vm, method)).await {
            Ok(Ok(_)) => {
                // Offloaded before no longer offloading: a pause or command meanwhile sees one.
                self.set_offloaded(id, true);
                self.mark_offloading(id, false);
                self.metrics.idle_offloads.fetch_add(1, Ordering::Relaxed);
                tracing::info!(%id, ms = started.elapsed().as_millis(), "offloaded while idle");
                return;
            }
            Ok(Err(e)) => tracing::warn!(%id, "idle offload: {}", basics::error_chain(&e)),
            Err(e) => tracing::warn!(%id, "idle offload: {e}"),
        }
        self.mark_offloading(id, false);
        // Tried again after another idle time, not at once: a VM that cannot offload now
        // (its store full, say) should not take a slot from every check.
        self.used(id);
    }

    fn mark_offloading(&self, id: &str, now: bool) {
        if let Some(slot) = self.table().get_mut(id) {
            slot.used.offloading = now;
        }
    }

    /// Whether the daemon is offloading `id` while idle, or has and is to bring it back for a
    /// command (an operation that finds its lock held then waits, where it would be busy).
    pub(super) fn idle_work(&self, id: &str) -> bool {
        self.table()
            .get(id)
            .is_some_and(|s| s.used.offloading || s.used.offloaded)
    }

    fn set_offloaded(&self, id: &str, offloaded: bool) {
        if let Some(slot) = self.table().get_mut(id) {
            slot.used.offloaded = offloaded;
            slot.used.last = Instant::now();
        }
    }

    /// Whether the daemon offloaded `id` while idle; clears the mark (a pause takes the
    /// offloaded VM as it is).
    pub(super) fn take_offloaded(&self, id: &str) -> bool {
        self.table()
            .get_mut(id)
            .is_some_and(|slot| std::mem::take(&mut slot.used.offloaded))
    }

    /// Notes that a command of `id` started or ended now.
    pub fn used(&self, id: &str) {
        if let Some(slot) = self.table().get_mut(id) {
            slot.used.last = Instant::now();
        }
    }

    /// The record of `id` and, when it is `Running`, its VM with what lets a command run in
    /// it (held until the command is over), the VM brought back first if the daemon offloaded
    /// it while idle, once the budget has room for what it will bring back.
    pub async fn command_vm(
        self: &Arc<Self>,
        id: &str,
    ) -> Result<(Record, Option<(VmRef, CommandHold)>), SandboxError> {
        let (record, vm) = self.running_vm(id)?;
        let Some((vm, permit)) = vm else {
            return Ok((record, None));
        };
        let mut hold = CommandHold {
            _permit: permit,
            _admitted: None,
        };
        self.used(id);
        // Offloaded, or being offloaded now (then its lock is held until the VM is out).
        let out = self
            .table()
            .get(id)
            .is_some_and(|s| s.used.offloaded || s.used.offloading);
        if !out {
            return Ok((record, Some((vm, hold))));
        }
        hold._admitted = self.admit_command(id).await;
        // An eager resume only with room for all it brings back: one let in without room
        // (alone, or at the end of its wait) would hold the governor's room for all of it at
        // once, the vCPU stopped, where a lazy one runs and comes back as it touches.
        let room = hold._admitted.as_ref().is_none_or(|a| a.room);
        let eager = self.limits.eager_idle_resume && room;
        // The first command after an idle offload resumes the VM; others wait for it. The
        // resume is a task of its own, holding the sandbox's lock: a client gone meanwhile
        // (its request dropped) must not leave the VM running and marked offloaded.
        let ops = self.ops(id)?.lock_owned().await;
        let this = Arc::clone(self);
        let (key, back) = (id.to_owned(), vm.clone());
        let record =
            tokio::spawn(async move { this.resume_for_command(&key, back, eager, ops).await })
                .await??;
        let running = record.state == State::Running;
        Ok((record, running.then_some((vm, hold))))
    }

    /// Brings `id` back for a command if the daemon offloaded it while idle (`eager`: all of
    /// it before the command runs), under its lock (`_op`); its record.
    async fn resume_for_command(
        &self,
        id: &str,
        vm: VmRef,
        eager: bool,
        _op: tokio::sync::OwnedMutexGuard<()>,
    ) -> Result<Record, SandboxError> {
        let record = self.get(id)?;
        let offloaded = self.table().get(id).is_some_and(|s| s.used.offloaded);
        if record.state != State::Running || !offloaded {
            return Ok(record);
        }
        let started = Instant::now();
        if self.limits.eager_idle_resume && !eager {
            tracing::info!(%id, "resumed lazily: no room for all of it at once");
        }
        tracing::info!(%id, eager, "resuming for a command");
        let resumed =
            tokio::task::spawn_blocking(move || vm::call(&vm, Method::Resume { eager })).await?;
        match resumed {
            Ok(_) => {
                self.set_offloaded(id, false);
                self.metrics.idle_resumes.observe(started.elapsed());
                let ms = started.elapsed().as_millis();
                tracing::info!(%id, ms, eager, "back for a command");
                Ok(record)
            }
            Err(VmError::Ended(reason)) => {
                self.transition(id, State::Failed, Some("VM_ENDED"), Some(reason.clone()))?;
                Err(SandboxError::Vm {
                    id: id.to_owned(),
                    source: VmError::Ended(reason),
                })
            }
            Err(source) => Err(SandboxError::Vm {
                id: id.to_owned(),
                source,
            }),
        }
    }
}
