//! A daemon that starts on a state directory takes back what its predecessor left: the VM
//! processes outlive the daemon (each runs under its own supervisor, `vmm::detached`), so a
//! restart, planned or after a `kill -9`, loses no sandbox.
//!
//! Each record that is not final is settled by what its VM says now, not by what the record
//! says (the previous daemon may have died in the middle of a transition):
//!
//! | record | VM | becomes |
//! |---|---|---|
//! | `Stopping` (a delete or an expiry) | any | the stop is finished: VM stopped, files and record removed |
//! | `Pending`, no VM started | none | started again |
//! | any live state | the recorded process, answering `running` | `Running` |
//! | `Paused`, `Pausing`, `Resuming` | answering `offloaded` or `paused` | `Paused` |
//! | `Running`, `Pending` | answering `offloaded` or `paused` | `Running`, offloaded while idle (its next command resumes it) |
//! | any live state | ended | `Failed`, `VM_ENDED`, with its tombstone's reason |
//! | `Pausing`, `Paused` | the recorded process, its answer not back within the status deadline (busy: a VM answers one request at a time) | `Paused` |
//! | other live states | the same | `Running` (a long command, or a resume, holds it) |
//! | any live state | alive but not answering (refused, or broken) | `Failed`, `VM_UNREACHABLE`, VM stopped |
//!
//! A VM job directory that no record names (its record was removed but the stop did not
//! finish) has its VM stopped and its files removed: none is left orphaned.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use vmm::control::Method;

use super::{idle, Limits, Sandboxes, Slot};
use crate::clock;
use crate::governed::Governed;
use crate::metrics::Metrics;
use crate::model::State;
use crate::store::{check_id, Record, Store, VmRef};
use crate::vm;

/// How many VMs are asked for their state at once while the daemon starts.
const ASK_AT_ONCE: usize = 16;

/// What a VM the records name is doing now.
#[derive(Debug, PartialEq, Eq)]
enum Found {
    /// It runs and takes commands.
    Running,
    /// It is suspended (its memory offloaded, or resident).
    Suspended,
    /// It is gone: why.
    Ended(String),
    /// It is the recorded process, but did not answer within the status deadline: busy
    /// with a request of the previous daemon's that it answers first (a long command, an
    /// eager resume).
    Busy,
    /// Its process lives but its control socket does not answer: why.
    Unreachable(String),
}

/// Asks the VM of `vm` its state.
fn look_at(vm: &VmRef) -> Found {
    if !vm::is_this_vm(vm) {
        return Found::Ended(vm::ended_reason(vm));
    }
    match vm::call(vm, Method::Status) {
        Ok(status) => match status.get("state").and_then(serde_json::Value::as_str) {
            Some("running") => Found::Running,
            Some("offloaded" | "paused") => Found::Suspended,
            other => Found::Unreachable(format!("its status names no known state: {other:?}")),
        },
        Err(vm::VmError::Ended(reason)) => Found::Ended(reason),
        Err(vm::VmError::Call(vmm::control::ClientError::Timeout { .. })) => Found::Busy,
        Err(e) => Found::Unreachable(basics::error_chain(&e)),
    }
}

/// What becomes of a record the previous daemon left live, given what its VM does.
#[derive(Debug, PartialEq, Eq)]
enum Settled {
    /// Live again: its state, and whether it is offloaded while idle.
    Adopted(State, bool),
    /// Its VM must be started (again).
    Start,
    /// Failed: reason code and message; the VM is stopped if still there.
    Failed(&'static str, String),
}

/// The rule of the [module](self)'s table, for a record in `state` whose VM is `found`
/// (`None`: no VM was started for it).
fn settle(state: State, found: Option<Found>) -> Settled {
    match (found, state) {
        (None, State::Pending) => Settled::Start,
        (None, _) => Settled::Failed(
            "DAEMON_RESTARTED",
            "the daemon restarted and found no VM for it".into(),
        ),
        (Some(Found::Running), _) => Settled::Adopted(State::Running, false),
        (Some(Found::Suspended), State::Paused | State::Pausing | State::Resuming) => {
            Settled::Adopted(State::Paused, false)
        }
        (Some(Found::Suspended), _) => Settled::Adopted(State::Running, true),
        // What it is busy with ends as the record says: a pause paused, else running.
        (Some(Found::Busy), State::Pausing | State::Paused) => {
            Settled::Adopted(State::Paused, false)
        }
        (Some(Found::Busy), _) => Settled::Adopted(State::Running, false),
        (Some(Found::Ended(why)), _) => Settled::Failed("VM_ENDED", why),
        (Some(Found::Unreachable(why)), _) => Settled::Failed(
            "VM_UNREACHABLE",
            format!("after the daemon restarted its VM did not answer ({why}): stopped"),
        ),
    }
}

/// The VM of `record`: the one it names, else one a previous daemon started but had not
/// recorded when it died.
fn vm_of(record: &Record) -> Option<VmRef> {
    record.vm.clone().or_else(|| vm::left_in(&record.id))
}

/// Settles one record (blocking: it may stop a VM); `None` when the record is gone (a delete
/// or an expiry finished).
fn settle_record(store: &Store, mut record: Record) -> Option<(Record, idle::Use)> {
    let vm = vm_of(&record);
    if record.state == State::Stopping {
        vm::stop_or_clear(&record.id, vm.as_ref());
        if let Err(e) = store.remove(&record.id) {
            tracing::warn!(id = %record.id, "{}", basics::error_chain(&e));
        }
        tracing::info!(id = %record.id, "its stop, left half done by the previous daemon, finished");
        return None;
    }
    let settled = settle(record.state, vm.as_ref().map(look_at));
    let mut used = idle::Use::default();
    match settled {
        Settled::Adopted(state, offloaded) => {
            tracing::info!(id = %record.id, state = state.name(), offloaded, "re-adopted");
            used.offloaded = offloaded;
            if record.state != state {
                record.state = state;
                record.reason = None;
                record.message = None;
                record.transition_ms = clock::now_ms();
            }
            record.vm = vm;
        }
        Settled::Start => {
            vm::remove_files(&record.id);
            tracing::info!(id = %record.id, "its VM had not started: starting it");
        }
        Settled::Failed(reason, message) => {
            tracing::warn!(id = %record.id, "{reason}: {message}");
            vm::stop_or_clear(&record.id, vm.as_ref());
            record.state = State::Failed;
            record.reason = Some(reason.into());
            record.message = Some(message);
            record.transition_ms = clock::now_ms();
            record.vm = None;
        }
    }
    if let Err(e) = store.save(&record) {
        tracing::warn!(id = %record.id, "{}", basics::error_chain(&e));
    }
    Some((record, used))
}

/// Stops the VMs of job directories no record names, and removes those directories.
fn stop_orphans(store: &Store, kept: &HashMap<String, Slot>) {
    let Ok(entries) = std::fs::read_dir(store.vms_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !check_id(&name) || kept.contains_key(&name) {
            continue;
        }
        let vm = vm::left_in(&name);
        if let Some(vm) = &vm {
            tracing::warn!(job = %name, pid = vm.pid, "a VM no sandbox names: stopped");
        }
        vm::stop_or_clear(&name, vm.as_ref());
    }
}

impl Sandboxes {
    /// The sandboxes kept in `store`, their VMs re-adopted (see the [module](self)); blocks
    /// while it asks the VMs their state. Those whose VM must be started are `Pending`:
    /// [`Sandboxes::start_pending`] starts them.
    pub fn load(
        store: Store,
        limits: Limits,
        governed: Governed,
        templates: crate::templates::Templates,
    ) -> Sandboxes {
        let (records, skipped) = store.load_all();
        for why in skipped {
            tracing::warn!("state directory: skipped {why}");
        }
        let mut live = Vec::new();
        let mut table = HashMap::new();
        for record in records {
            if record.state == State::Terminated {
                let _ = store.remove(&record.id);
            } else if record.state.is_final() {
                table.insert(record.id.clone(), Slot::new(record, idle::Use::default()));
            } else {
                live.push(record);
            }
        }
        let settled = Mutex::new(Vec::new());
        for batch in live.chunks(ASK_AT_ONCE) {
            std::thread::scope(|scope| {
                for record in batch {
                    let (store, settled) = (&store, &settled);
                    scope.spawn(move || {
                        if let Some(done) = settle_record(store, record.clone()) {
                            settled
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .push(done);
                        }
                    });
                }
            });
        }
        for (record, used) in settled
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            table.insert(record.id.clone(), Slot::new(record, used));
        }
        stop_orphans(&store, &table);
        Sandboxes {
            store,
            limits,
            governed,
            templates,
            table: Mutex::new(table),
            idle_slots: Arc::new(tokio::sync::Semaphore::new(idle::AT_ONCE)),
            gate: Arc::default(),
            metrics: Metrics::default(),
        }
    }

    /// Starts the VMs of the `Pending` sandboxes a previous daemon created but did not start.
    pub fn start_pending(self: &Arc<Self>) {
        let pending: Vec<String> = self
            .table()
            .values()
            .filter(|s| s.record.state == State::Pending && s.record.vm.is_none())
            .map(|s| s.record.id.clone())
            .collect();
        for id in pending {
            let this = Arc::clone(self);
            tokio::spawn(async move { this.start_vm(id).await });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_settled_by_what_its_vm_does_now() {
        use Found::{Busy, Ended, Running, Suspended, Unreachable};
        let adopted = |s, offloaded| Settled::Adopted(s, offloaded);
        for state in [
            State::Pending,
            State::Running,
            State::Pausing,
            State::Paused,
            State::Resuming,
        ] {
            assert_eq!(
                settle(state, Some(Running)),
                adopted(State::Running, false),
                "{state:?}"
            );
            assert!(matches!(
                settle(state, Some(Ended("oom".into()))),
                Settled::Failed("VM_ENDED", why) if why == "oom"
            ));
            assert!(matches!(
                settle(state, Some(Unreachable("timeout".into()))),
                Settled::Failed("VM_UNREACHABLE", _)
            ));
        }
        // Busy with what the previous daemon asked: adopted, never stopped.
        for (state, now) in [
            (State::Pending, State::Running),
            (State::Running, State::Running),
            (State::Resuming, State::Running),
            (State::Pausing, State::Paused),
            (State::Paused, State::Paused),
        ] {
            assert_eq!(settle(state, Some(Busy)), adopted(now, false), "{state:?}");
        }
        // A pause the previous daemon did not see finish, or a resume it did not start.
        for state in [State::Pausing, State::Paused, State::Resuming] {
            assert_eq!(
                settle(state, Some(Suspended)),
                adopted(State::Paused, false)
            );
        }
        // Offloaded by the daemon while idle: running to the client.
        assert_eq!(
            settle(State::Running, Some(Suspended)),
            adopted(State::Running, true)
        );
        assert_eq!(settle(State::Pending, None), Settled::Start);
        assert!(matches!(
            settle(State::Running, None),
            Settled::Failed("DAEMON_RESTARTED", _)
        ));
    }
}
