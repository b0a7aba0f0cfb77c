//! The sandboxes: their records (in memory and in the state directory), their state
//! machine, and the VM operations behind each transition. One operation at a time per
//! sandbox (start, pause, resume, stop); commands run beside them, the VM serializing them.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use vmm::control::Method;

use crate::clock;
use crate::governed::{Governed, Room};
use crate::metrics::Metrics;
use crate::model::{Create, ListQuery, State};
use crate::store::{Record, Store, StoreError, VmRef};
use crate::vm::{self, VmError};

mod adopt;
mod gate;
mod idle;
mod measure;

pub use idle::CommandHold;

/// Errors of a sandbox operation.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// No sandbox has this id.
    #[error("no sandbox `{0}`")]
    NotFound(String),
    /// The sandbox is in the wrong state for it.
    #[error("sandbox {id} is {}: {what} needs it {}", state.name(), wanted.name())]
    Conflict {
        /// The sandbox.
        id: String,
        /// Its state.
        state: State,
        /// What was asked.
        what: &'static str,
        /// The state it needs.
        wanted: State,
    },
    /// Another operation on the sandbox is in progress.
    #[error("sandbox {id} is busy ({}): ask for {what} again once the operation in progress is over", state.name())]
    Busy {
        /// The sandbox.
        id: String,
        /// Its state.
        state: State,
        /// What was asked.
        what: &'static str,
    },
    /// The sandbox runs as many commands as it may at once.
    #[error("sandbox {id} runs {max} commands already: send the next when one is over")]
    Commands {
        /// The sandbox.
        id: String,
        /// The most at once.
        max: usize,
    },
    /// The daemon keeps as many sandboxes as it may (live or ended, until deleted).
    #[error("the daemon keeps {max} sandboxes already: delete some first")]
    TooMany {
        /// The most it keeps.
        max: usize,
    },
    /// The memory budget had no room for another VM within the admission timeout.
    #[error(
        "the memory budget ({}) has no room for another sandbox: its {} VMs are charged {}, \
         {} of which they hold and cannot give back now (their floors, commands running, \
         sandboxes starting); a new sandbox needs {} to start, and {} stays free for commands \
         to run in{}",
        basics::size_text(room.budget), room.vms, basics::size_text(room.usage),
        basics::size_text(room.held(*starting, *need)),
        basics::size_text(*need), basics::size_text(*reserve),
        if waited.is_zero() { String::new() } else { format!(" (waited {} s for room)", waited.as_secs()) }
    )]
    Capacity {
        /// The budget as the governor saw it last.
        room: Box<Room>,
        /// Sandboxes admitted whose VMs are starting.
        starting: u64,
        /// What one more needs.
        need: u64,
        /// What is kept free.
        reserve: u64,
        /// How long the create waited.
        waited: Duration,
    },
    /// The state directory failed.
    #[error("the state directory")]
    Store(#[from] StoreError),
    /// The VM failed.
    #[error("sandbox {id}")]
    Vm {
        /// The sandbox.
        id: String,
        /// What failed.
        #[source]
        source: VmError,
    },
    /// A blocking task did not finish.
    #[error("a worker task failed")]
    Join(#[from] tokio::task::JoinError),
    /// No randomness for a token.
    #[error("no random bytes for a token")]
    Random(#[source] std::io::Error),
}

/// How the daemon sizes its sandboxes.
#[derive(Debug, Clone)]
pub struct Limits {
    /// How long a create waits for room in the memory budget before it is refused.
    pub admission_timeout: Duration,
    /// What a create leaves free in the budget, beyond what the sandboxes hold and cannot
    /// give back, for commands to run in.
    pub admission_reserve: u64,
    /// A running sandbox with no command for this long is offloaded (see [`idle`]).
    pub idle_offload: Option<Duration>,
    /// A sandbox offloaded while idle comes back for its next command eagerly, all its memory
    /// read back before the command starts (`--idle-resume eager`), not page by page.
    pub eager_idle_resume: bool,
    /// The VMs join the memory governor (`--memory-management on`, the default); else they
    /// only run in the budget's cgroup and keep what they touch.
    pub managed: bool,
    /// Sandboxes of snapshot templates share the pages they restored alike through KSM
    /// (`--share-template-pages`).
    pub share_template_pages: bool,
    /// Where the sandboxes' `download` commands may fetch from (`--sandbox-net-allow`; none:
    /// no network).
    pub net: vmm::net::NetOptions,
    /// The read-only image the sandboxes' `read` commands read (`--sandbox-image`).
    pub image: Option<vmm::image::ImageOptions>,
}

/// How often a create waiting for room looks at the budget again.
const ADMISSION_POLL: Duration = Duration::from_millis(100);

/// The most sandboxes kept at once, whatever their state (failed ones stay until deleted).
pub const MAX_SANDBOXES: usize = 4096;

/// The most commands one sandbox has in flight (its VM runs them one after the other; each
/// waiting one holds a blocking thread of the daemon's).
pub const MAX_COMMANDS: usize = 8;

/// How long a terminated (expired) sandbox stays visible.
const TERMINATED_KEPT: Duration = Duration::from_secs(300);

struct Slot {
    record: Record,
    /// Held by the operation in progress.
    ops: Arc<tokio::sync::Mutex<()>>,
    /// One permit per command in flight ([`MAX_COMMANDS`]).
    commands: Arc<tokio::sync::Semaphore>,
    /// When it ended, for [`TERMINATED_KEPT`].
    ended: Option<Instant>,
    /// Its commands' times, and whether it was offloaded while idle.
    used: idle::Use,
}

impl Slot {
    fn new(record: Record, used: idle::Use) -> Slot {
        Slot {
            record,
            ops: Arc::default(),
            commands: Arc::new(tokio::sync::Semaphore::new(MAX_COMMANDS)),
            ended: None,
            used,
        }
    }
}

/// Every sandbox of this daemon.
pub struct Sandboxes {
    store: Store,
    limits: Limits,
    /// The memory governor every sandbox's VM joins.
    governed: Governed,
    /// What sandboxes are made from.
    templates: crate::templates::Templates,
    table: Mutex<HashMap<String, Slot>>,
    /// One permit per idle offload in progress ([`idle::AT_ONCE`]).
    idle_slots: Arc<tokio::sync::Semaphore>,
    /// Commands of idle-offloaded sandboxes admitted by memory.
    gate: Arc<gate::Gate>,
    /// What `GET /metrics` counts.
    pub metrics: Metrics,
}

impl std::fmt::Debug for Sandboxes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandboxes")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// Runs `f`, which blocks (a record's write and fsync), telling tokio's multi-thread runtime
/// so that it moves its other tasks to another worker meanwhile; plainly elsewhere.
fn off_the_runtime<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// `n` random bytes as hex.
pub fn random_hex(n: usize) -> Result<String, std::io::Error> {
    let mut bytes = vec![0u8; n];
    let mut filled = 0;
    while filled < n {
        // SAFETY: getrandom writes at most `n - filled` bytes at the buffer's unfilled tail.
        let got = unsafe { libc::getrandom(bytes[filled..].as_mut_ptr().cast(), n - filled, 0) };
        match usize::try_from(got) {
            Ok(got) => filled += got,
            Err(_) => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

impl Sandboxes {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What sandboxes are made from.
    pub fn templates(&self) -> &crate::templates::Templates {
        &self.templates
    }

    /// A copy of the record of `id`.
    pub fn get(&self, id: &str) -> Result<Record, SandboxError> {
        self.table()
            .get(id)
            .map(|s| s.record.clone())
            .ok_or_else(|| SandboxError::NotFound(id.to_owned()))
    }

    /// The page `query` asks for, of the sandboxes it matches (oldest first), and how many
    /// match.
    pub fn list(&self, query: &ListQuery) -> (Vec<Record>, u64) {
        let mut all: Vec<Record> = self
            .table()
            .values()
            .map(|s| &s.record)
            .filter(|r| query.states.is_empty() || query.states.contains(&r.state))
            .filter(|r| {
                query
                    .metadata
                    .iter()
                    .all(|(k, v)| r.metadata.get(k) == Some(v))
            })
            .cloned()
            .collect();
        all.sort_by(|a, b| (a.created_ms, &a.id).cmp(&(b.created_ms, &b.id)));
        let total = all.len() as u64;
        let skip =
            usize::try_from((query.page - 1).saturating_mul(query.page_size)).unwrap_or(usize::MAX);
        let take = usize::try_from(query.page_size).unwrap_or(usize::MAX);
        (all.into_iter().skip(skip).take(take).collect(), total)
    }

    fn ops(&self, id: &str) -> Result<Arc<tokio::sync::Mutex<()>>, SandboxError> {
        self.table()
            .get(id)
            .map(|s| Arc::clone(&s.ops))
            .ok_or_else(|| SandboxError::NotFound(id.to_owned()))
    }

    /// Changes the record of `id` and saves it; the new record.
    fn update(&self, id: &str, change: impl FnOnce(&mut Record)) -> Result<Record, SandboxError> {
        let (record, writes) = {
            let mut table = self.table();
            let slot = table
                .get_mut(id)
                .ok_or_else(|| SandboxError::NotFound(id.to_owned()))?;
            change(&mut slot.record);
            if slot.record.state.is_final() && slot.ended.is_none() {
                slot.ended = Some(Instant::now());
            }
            // Taken before the table is let go: records are written in the order they change.
            (slot.record.clone(), self.store.writes())
        };
        off_the_runtime(|| writes.save(&record))?;
        Ok(record)
    }

    fn transition(
        &self,
        id: &str,
        state: State,
        reason: Option<&str>,
        message: Option<String>,
    ) -> Result<Record, SandboxError> {
        self.update(id, |r| {
            r.state = state;
            r.reason = reason.map(str::to_owned);
            r.message = message;
            r.transition_ms = clock::now_ms();
        })
    }

    /// Creates a sandbox (`Pending`) once the memory budget has room for it (waiting for
    /// that up to the admission timeout), and starts its VM in the background; `Running` once
    /// it is up, `Failed` if it does not start.
    pub async fn create(self: &Arc<Self>, create: Create) -> Result<Record, SandboxError> {
        let asked = Instant::now();
        // Drawn once: a create that waits for room looks at the budget many times.
        let token = random_hex(24).map_err(SandboxError::Random)?;
        loop {
            match self.admit(&create, &token, asked.elapsed()) {
                Err(SandboxError::Capacity { .. })
                    if asked.elapsed() < self.limits.admission_timeout =>
                {
                    tokio::time::sleep(ADMISSION_POLL).await;
                }
                Err(e @ SandboxError::Capacity { .. }) => {
                    self.metrics.creates_refused.fetch_add(1, Ordering::Relaxed);
                    return Err(e);
                }
                done => {
                    self.metrics.admission.observe(asked.elapsed());
                    return done;
                }
            }
        }
    }

    /// Creates the sandbox, with `token`, if the budget has room for it now (the governor's
    /// reading of it, and the sandboxes admitted whose VMs are not counted there yet).
    fn admit(
        self: &Arc<Self>,
        create: &Create,
        token: &str,
        waited: Duration,
    ) -> Result<Record, SandboxError> {
        let room = self.governed.room();
        let need = self.governed.start_need();
        let (record, writes) = {
            let mut table = self.table();
            if table.len() >= MAX_SANDBOXES {
                return Err(SandboxError::TooMany { max: MAX_SANDBOXES });
            }
            // Admitted, their VMs not in the governor's figures yet (starting, or up and
            // about to join it). Unmanaged VMs never join: the budget cgroup's usage counts
            // them once they are up.
            let starting = table
                .values()
                .filter(|s| match self.limits.managed {
                    true => !s.record.state.is_final() && !room.joined.contains(&s.record.id),
                    false => s.record.state == State::Pending,
                })
                .count() as u64;
            if !room.admits(starting, need, self.limits.admission_reserve) {
                return Err(SandboxError::Capacity {
                    room: Box::new(room),
                    starting,
                    need,
                    reserve: self.limits.admission_reserve,
                    waited,
                });
            }
            // A fresh id, never one another sandbox has (random, so this loops very rarely).
            let id = std::iter::repeat_with(|| vmm::runtime::new_id("sb-"))
                .find(|id| !table.contains_key(id))
                .expect("the ids never run out");
            let now = clock::now_ms();
            let record = Record {
                id: id.clone(),
                token: token.to_owned(),
                template: create.template.clone(),
                entrypoint: create.entrypoint.clone(),
                metadata: create.metadata.clone(),
                created_ms: now,
                expires_ms: create.timeout_s.map(|s| now + s * 1000),
                state: State::Pending,
                reason: Some("STARTING".into()),
                message: Some("its VM is starting".into()),
                transition_ms: now,
                memory: create.memory,
                vm: None,
            };
            table.insert(id, Slot::new(record.clone(), idle::Use::default()));
            (record, self.store.writes())
        };
        let id = record.id.clone();
        if let Err(e) = off_the_runtime(|| writes.save(&record)) {
            drop(writes);
            self.table().remove(&id);
            return Err(e.into());
        }
        tracing::info!(%id, "created");
        self.metrics.creates.fetch_add(1, Ordering::Relaxed);
        let this = Arc::clone(self);
        tokio::spawn(async move { this.start_vm(id).await });
        Ok(record)
    }

    async fn start_vm(self: Arc<Self>, id: String) {
        let Ok(ops) = self.ops(&id) else { return };
        let _op = ops.lock().await;
        // Deleted before it started.
        let Some(record) = self.get(&id).ok().filter(|r| r.state == State::Pending) else {
            return;
        };
        // A sandbox re-adopted by a daemon that no longer serves its template cannot start.
        let Some(template) = self.templates.get(&record.template) else {
            let why = format!(
                "its template `{}` is not served by this daemon (--template)",
                record.template
            );
            let _ = self.transition(&id, State::Failed, Some("VM_START_FAILED"), Some(why));
            return;
        };
        // The template's RAM size now (a snapshot served under the same name after a restart
        // may differ from the one the record was made for).
        if template.memory != record.memory
            && self.update(&id, |r| r.memory = template.memory).is_err()
        {
            return;
        }
        let plan = vm::Plan {
            memory: template.memory,
            restore: template.snapshot.clone(),
            dedup: self.limits.share_template_pages && template.snapshot.is_some(),
            governor: self
                .limits
                .managed
                .then(|| self.governed.socket().to_path_buf()),
            cgroup: self.governed.vm_cgroup(&id),
            net: self.limits.net.clone(),
            image: self.limits.image.clone(),
        };
        let job = id.clone();
        let started = Instant::now();
        let result = tokio::task::spawn_blocking(move || vm::start(&job, &plan)).await;
        let outcome = match result {
            Ok(Ok(vm)) => {
                tracing::info!(%id, pid = vm.pid, ms = started.elapsed().as_millis(), "VM up");
                self.update(&id, |r| {
                    r.vm = Some(vm);
                    r.state = State::Running;
                    r.reason = None;
                    r.message = None;
                    r.transition_ms = clock::now_ms();
                })
            }
            Ok(Err(e)) => {
                let why = basics::error_chain(&e);
                tracing::warn!(%id, "VM did not start: {why}");
                self.transition(&id, State::Failed, Some("VM_START_FAILED"), Some(why))
            }
            Err(e) => self.transition(
                &id,
                State::Failed,
                Some("VM_START_FAILED"),
                Some(e.to_string()),
            ),
        };
        if let Err(e) = outcome {
            tracing::warn!(%id, "{}", basics::error_chain(&e));
        }
    }

    /// Stops the VM of `record` (its files go with it), or removes the files of one that never
    /// came up, off the runtime.
    async fn stop_vm(&self, record: Record) -> Result<(), SandboxError> {
        tokio::task::spawn_blocking(move || vm::stop_or_clear(&record.id, record.vm.as_ref()))
            .await?;
        Ok(())
    }

    /// Deletes a sandbox: its VM stopped, its files and record removed.
    pub async fn delete(&self, id: &str) -> Result<(), SandboxError> {
        let ops = self.ops(id)?;
        let _op = ops.lock().await;
        let record = self.get(id)?;
        if !record.state.is_final() {
            self.transition(id, State::Stopping, Some("DELETED"), None)?;
        }
        self.stop_vm(record).await?;
        let writes = {
            let mut table = self.table();
            table.remove(id);
            self.store.writes()
        };
        off_the_runtime(|| writes.remove(id))?;
        tracing::info!(%id, "deleted");
        Ok(())
    }

    /// Runs a VM request for a transition `from` → (`during`) → `to`; the new record and how
    /// long the VM took (nothing, for a pause of a sandbox offloaded while idle).
    async fn switch(
        &self,
        id: &str,
        what: &'static str,
        (from, during, to): (State, State, State),
        method: Method,
    ) -> Result<(Record, Duration), SandboxError> {
        let ops = self.ops(id)?;
        // A second request while one is in progress sees its in-between state.
        // The daemon's own idle offload, or the resume for a command after it, is waited for:
        // the client asked for nothing else.
        let _op = match ops.try_lock() {
            Ok(op) => op,
            Err(_) if self.idle_work(id) => {
                tracing::info!(%id, "{what} waits for the daemon's idle offload or resume");
                ops.lock().await
            }
            Err(_) => {
                let state = self.get(id)?.state;
                return Err(SandboxError::Busy {
                    id: id.to_owned(),
                    state,
                    what,
                });
            }
        };
        let record = self.get(id)?;
        let (true, Some(vm)) = (record.state == from, record.vm) else {
            return Err(SandboxError::Conflict {
                id: id.to_owned(),
                state: record.state,
                what,
                wanted: from,
            });
        };
        // A pause of a sandbox offloaded while idle: its VM is suspended, its memory out.
        if matches!(method, Method::Suspend { .. }) && self.take_offloaded(id) {
            tracing::info!(%id, "{what} (offloaded while idle already)");
            return Ok((self.transition(id, to, None, None)?, Duration::ZERO));
        }
        self.transition(id, during, None, None)?;
        let started = Instant::now();
        let result = tokio::task::spawn_blocking(move || vm::call(&vm, method)).await?;
        match result {
            Ok(_) => {
                let took = started.elapsed();
                tracing::info!(%id, ms = took.as_millis(), "{what}");
                Ok((self.transition(id, to, None, None)?, took))
            }
            Err(VmError::Ended(reason)) => {
                self.transition(id, State::Failed, Some("VM_ENDED"), Some(reason.clone()))?;
                Err(SandboxError::Vm {
                    id: id.to_owned(),
                    source: VmError::Ended(reason),
                })
            }
            Err(e) => {
                // The VM refused: it is where it was.
                self.transition(id, from, None, None)?;
                Err(SandboxError::Vm {
                    id: id.to_owned(),
                    source: e,
                })
            }
        }
    }

    /// Pauses a running sandbox: its VM suspended and its memory offloaded.
    pub async fn pause(&self, id: &str) -> Result<Record, SandboxError> {
        let states = (State::Running, State::Pausing, State::Paused);
        let method = Method::Suspend {
            offload: true,
            ram_file: None,
        };
        let (paused, _) = self.switch(id, "pause", states, method).await?;
        self.metrics.pauses.fetch_add(1, Ordering::Relaxed);
        Ok(paused)
    }

    /// Resumes a paused sandbox (its memory comes back as it is touched).
    pub async fn resume(&self, id: &str) -> Result<Record, SandboxError> {
        let states = (State::Paused, State::Resuming, State::Running);
        let (resumed, took) = self
            .switch(id, "resume", states, Method::Resume { eager: false })
            .await?;
        self.metrics.resumes.observe(took);
        Ok(resumed)
    }

    /// Sets a live sandbox's expiry.
    pub fn renew(&self, id: &str, expires_ms: u64) -> Result<Record, SandboxError> {
        let record = self.get(id)?;
        if record.state.is_final() || record.state == State::Stopping {
            return Err(SandboxError::Conflict {
                id: id.to_owned(),
                state: record.state,
                what: "renew-expiration",
                wanted: State::Running,
            });
        }
        self.update(id, |r| r.expires_ms = Some(expires_ms))
    }

    /// Stops the sandboxes whose time is up (`Terminated`, `EXPIRED`: VM stopped, files
    /// removed), marks those whose VM died `Failed` with its tombstone's reason, and forgets
    /// terminated ones after a while. Called every second.
    pub async fn tick(&self) {
        let now = clock::now_ms();
        let (expired, live): (Vec<Record>, Vec<Record>) = {
            let mut table = self.table();
            table.retain(|_, s| {
                s.record.state != State::Terminated
                    || s.ended.is_none_or(|at| at.elapsed() < TERMINATED_KEPT)
            });
            table
                .values()
                .map(|s| s.record.clone())
                .filter(|r| !r.state.is_final() && r.state != State::Stopping)
                .partition(|r| r.expires_ms.is_some_and(|at| at <= now))
        };
        for record in expired {
            if let Err(e) = self.expire(&record.id).await {
                tracing::warn!(id = %record.id, "expiry: {}", basics::error_chain(&e));
            }
        }
        for record in live {
            let Some(vm) = record.vm.filter(|vm| !vmm::runtime::process_alive(vm.pid)) else {
                continue;
            };
            let Ok(ops) = self.ops(&record.id) else {
                continue;
            };
            let Ok(_op) = ops.try_lock() else { continue };
            let reason = match tokio::task::spawn_blocking(move || {
                let reason = vm::ended_reason(&vm);
                vm::reap_supervisor(&vm);
                reason
            })
            .await
            {
                Ok(reason) => reason,
                Err(e) => e.to_string(),
            };
            tracing::warn!(id = %record.id, "VM died: {reason}");
            let _ = self.update(&record.id, |r| {
                r.state = State::Failed;
                r.reason = Some("VM_ENDED".into());
                r.message = Some(reason);
                r.transition_ms = clock::now_ms();
            });
        }
    }

    async fn expire(&self, id: &str) -> Result<(), SandboxError> {
        let ops = self.ops(id)?;
        let _op = ops.lock().await;
        let record = self.get(id)?;
        if record.state.is_final() || record.expires_ms.is_none_or(|at| at > clock::now_ms()) {
            return Ok(());
        }
        self.transition(id, State::Stopping, Some("EXPIRED"), None)?;
        self.stop_vm(record).await?;
        let writes = {
            let mut table = self.table();
            if let Some(slot) = table.get_mut(id) {
                slot.record.state = State::Terminated;
                slot.record.reason = Some("EXPIRED".into());
                slot.record.message = Some("its timeout passed: VM stopped, files removed".into());
                slot.record.transition_ms = clock::now_ms();
                slot.record.vm = None;
                slot.ended = Some(Instant::now());
            }
            self.store.writes()
        };
        off_the_runtime(|| writes.remove(id))?;
        tracing::info!(%id, "expired");
        Ok(())
    }

    /// How many sandboxes are live (not `Failed` or `Terminated`).
    pub fn live(&self) -> usize {
        self.table()
            .values()
            .filter(|s| !s.record.state.is_final())
            .count()
    }

    /// Stops every sandbox's VM as the daemon stops (`--stop-on-exit`): each waits for the
    /// operation in progress on it, then is `Failed` (`DAEMON_STOPPED`), its files removed,
    /// its record kept.
    pub async fn shutdown(self: &Arc<Self>) {
        let ids: Vec<String> = self
            .table()
            .values()
            .filter(|s| !s.record.state.is_final())
            .map(|s| s.record.id.clone())
            .collect();
        let mut stops = tokio::task::JoinSet::new();
        for id in ids {
            let this = Arc::clone(self);
            stops.spawn(async move {
                if let Err(e) = this.stop_for_shutdown(&id).await {
                    tracing::warn!(%id, "stopping: {}", basics::error_chain(&e));
                }
            });
        }
        while stops.join_next().await.is_some() {}
    }

    async fn stop_for_shutdown(&self, id: &str) -> Result<(), SandboxError> {
        let ops = self.ops(id)?;
        let _op = ops.lock().await;
        let record = self.get(id)?;
        if record.state.is_final() {
            return Ok(());
        }
        self.stop_vm(record).await?;
        self.update(id, |r| {
            r.state = State::Failed;
            r.reason = Some("DAEMON_STOPPED".into());
            r.message = Some("the daemon stopped with --stop-on-exit, and its VM with it".into());
            r.transition_ms = clock::now_ms();
            r.vm = None;
        })?;
        tracing::info!(%id, "stopped with the daemon");
        Ok(())
    }

    /// The record of `id` and, when it is `Running`, its VM with a permit to run a command
    /// in it (held until the command is over).
    pub fn running_vm(
        &self,
        id: &str,
    ) -> Result<(Record, Option<(VmRef, tokio::sync::OwnedSemaphorePermit)>), SandboxError> {
        let (record, commands) = self
            .table()
            .get(id)
            .map(|s| (s.record.clone(), Arc::clone(&s.commands)))
            .ok_or_else(|| SandboxError::NotFound(id.to_owned()))?;
        let Some(vm) = record.vm.clone().filter(|_| record.state == State::Running) else {
            return Ok((record, None));
        };
        let permit = commands
            .try_acquire_owned()
            .map_err(|_| SandboxError::Commands {
                id: id.to_owned(),
                max: MAX_COMMANDS,
            })?;
        Ok((record, Some((vm, permit))))
    }
}
