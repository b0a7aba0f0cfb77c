//! Idle offload: a `Running` sandbox that has run no command for `--idle-offload` has its VM
//! suspended and its memory offloaded by the daemon on its own, and comes back on its next
//! command before the command runs. The client sees only latency: the sandbox stays
//! `Running` throughout (ping answers, list and get say `Running`), and a pause of an idle
//! sandbox costs nothing more (its memory is out already).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

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

impl Default for Use {
    fn default() -> Self {
        Self {
            last: Instant::now(),
            offloaded: false,
            offloading: false,
        }
    }
}

impl Sandboxes {
    /// Offloads the `Running` sandboxes that have had no command in flight for the idle time.
    /// Skips one an operation holds (it is not idle). Called every second.
    pub(super) async fn offload_idle(&self) {
        let Some(idle) = self.limits.idle_offload else {
            return;
        };
        let due: Vec<(String, Arc<tokio::sync::Mutex<()>>)> = self
            .table()
            .iter()
            .filter(|(_, s)| {
                s.record.state == State::Running
                    && !s.used.offloaded
                    && s.record.vm.is_some()
                    && s.commands.available_permits() == MAX_COMMANDS
                    && s.used.last.elapsed() >= idle
            })
            .map(|(id, s)| (id.clone(), Arc::clone(&s.ops)))
            .collect();
        for (id, ops) in due {
            let Ok(_op) = ops.try_lock() else { continue };
            // Still idle, still running, under the operation's lock: no command started since
            // (a command takes this lock to bring an offloaded sandbox back).
            let vm = {
                let table = self.table();
                let Some(slot) = table.get(&id) else { continue };
                let still = slot.record.state == State::Running
                    && !slot.used.offloaded
                    && slot.commands.available_permits() == MAX_COMMANDS
                    && slot.used.last.elapsed() >= idle;
                match (still, slot.record.vm.clone()) {
                    (true, Some(vm)) => vm,
                    _ => continue,
                }
            };
            let started = Instant::now();
            let method = Method::Suspend {
                offload: true,
                ram_file: None,
            };
            self.mark_offloading(&id, true);
            let result = tokio::task::spawn_blocking(move || vm::call(&vm, method)).await;
            self.mark_offloading(&id, false);
            match result {
                Ok(Ok(_)) => {
                    self.set_offloaded(&id, true);
                    self.metrics.idle_offloads.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(%id, ms = started.elapsed().as_millis(), "offloaded while idle");
                }
                Ok(Err(e)) => tracing::warn!(%id, "idle offload: {}", basics::error_chain(&e)),
                Err(e) => tracing::warn!(%id, "idle offload: {e}"),
            }
        }
    }

    fn mark_offloading(&self, id: &str, now: bool) {
        if let Some(slot) = self.table().get_mut(id) {
            slot.used.offloading = now;
        }
    }

    /// Whether the daemon is offloading `id` while idle right now.
    pub(super) fn offloading(&self, id: &str) -> bool {
        self.table().get(id).is_some_and(|s| s.used.offloading)
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

    /// The record of `id` and, when it is `Running`, its VM with a permit to run a command in
    /// it (held until the command is over), the VM brought back first if the daemon offloaded
    /// it while idle.
    pub async fn command_vm(
        &self,
        id: &str,
    ) -> Result<(Record, Option<(VmRef, tokio::sync::OwnedSemaphorePermit)>), SandboxError> {
        let (record, vm) = self.running_vm(id)?;
        let Some((vm, permit)) = vm else {
            return Ok((record, None));
        };
        self.used(id);
        let offloaded = self.table().get(id).is_some_and(|s| s.used.offloaded);
        if !offloaded {
            return Ok((record, Some((vm, permit))));
        }
        // The first command after an idle offload resumes the VM; others wait for it.
        let ops = self.ops(id)?;
        let _op = ops.lock().await;
        let record = self.get(id)?;
        let offloaded = self.table().get(id).is_some_and(|s| s.used.offloaded);
        if record.state != State::Running {
            return Ok((record, None));
        }
        if offloaded {
            let started = Instant::now();
            let back = vm.clone();
            let resumed = tokio::task::spawn_blocking(move || {
                vm::call(&back, Method::Resume { eager: false })
            })
            .await?;
            match resumed {
                Ok(_) => {
                    self.set_offloaded(id, false);
                    self.metrics.idle_resumes.observe(started.elapsed());
                    tracing::info!(%id, ms = started.elapsed().as_millis(), "back for a command");
                }
                Err(VmError::Ended(reason)) => {
                    self.transition(id, State::Failed, Some("VM_ENDED"), Some(reason.clone()))?;
                    return Err(SandboxError::Vm {
                        id: id.to_owned(),
                        source: VmError::Ended(reason),
                    });
                }
                Err(source) => {
                    return Err(SandboxError::Vm {
                        id: id.to_owned(),
                        source,
                    })
                }
            }
        }
        Ok((record, Some((vm, permit))))
    }
}
