//! The memory governor's policy: which VM gets memory, and which gives it back, so that a set
//! of VMs stays inside one host memory budget.
//!
//! This is the decision part only, deterministic and free of I/O, threads and clocks: the
//! server feeds it what VMs say (join, state, readings, requests, order reports) and what the
//! host says (`tick` with the kernel's pressure signals), each with the time it happened, and
//! carries out the [`Decision`]s it answers.
//!
//! # The model
//! Each VM's pager has a *resident limit*: the bytes of guest RAM it may hold resident. A fault
//! that would cross it is held until the limit is raised; the VM then asks for more
//! ([`Governor::request`]). With no swap the kernel cannot reclaim anonymous guest RAM at all,
//! so the limits are the budget's only enforcement short of the OOM killer, and the governor
//! is the only reclaim there is.
//!
//! # Accounting
//! A VM is charged `overhead + max(resident, limit)`: `overhead` is its cgroup usage (what the
//! kernel cannot reclaim: the server gives usage less clean page cache) minus its resident
//! guest RAM (the VMM's own memory, the pager's buffers, kernel memory), learned from each
//! reading that has a cgroup figure and whose resident held still since the one before
//! (within 1 MiB), the largest over [`Config::overhead_window`], never below 0,
//! [`Config::default_overhead`] until the first one; `limit` is its current resident limit
//! (none yet: charged at resident). The sum of charges is the *projected* usage: what the VMs
//! may come to hold without asking again. The *measured* usage is the total the server gives
//! with [`Governor::tick`] (e.g. the budget cgroup's own usage; less, until the next tick, what
//! orders reported since freed and what VMs that left since held), else the sum of the VMs'
//! cgroup readings. *Usage* is the larger of the two.
//!
//! # Rules (every knob is in [`Config`])
//! - **Grants.** Requests queue by *seniority*: the VM that began its current run earliest
//!   first (it joined, or reported running from another state: its command began or its
//!   model answer came), the first to join on a tie; not in the order they came (one entry
//!   per VM; a new request of a queued VM raises its entry's bytes). Under a binding budget
//!   grants handed out in arrival order go round every VM a few MiB at a time: each ends
//!   part-way through its step, none reaches a model wait where its RAM could be offloaded,
//!   and nothing is left to reclaim (measured: 8 VMs filling 64 MiB each under 384 MiB all sat
//!   held until their two-minute hold timeout). The senior VM first finishes its step, waits,
//!   is offloaded, and makes room for the next. Seniority is fixed for a run, so grants do not
//!   go round; it starts anew with each run, so a VM that joined late is not last for its
//!   whole life (by join order, the VMs started last of 16 with spread starts took up to 14%
//!   longer than the first). The head
//!   is granted when projected usage plus what it adds stays at or under
//!   `high_watermark × budget`; it adds `max(bytes, grant)`, and more, until its limit is the
//!   VM's learned peak (the largest resident seen), when that fits: a VM coming back
//!   from an offload gets what it held before in one step instead of a grant per fault
//!   storm. Later requests never overtake the head.
//! - **Admission.** A joining VM gets `initial_limit` (at least its resident) only if that
//!   fits and nobody is queued; otherwise its limit is its resident and it queues for the rest
//!   like any request. An offloaded VM whose answer arrives holds little and has a small
//!   limit: its faults request and go through the same queue, no special case.
//! - **Reclaim, with hysteresis.** When usage is over the high watermark, the kernel signals
//!   pressure, or the head request does not fit, the governor reclaims until usage, less what
//!   the orders it has outstanding are expected to free, is at or under the low watermark (or
//!   lower, where the head request needs more room than the gap between the two). Once usage
//!   is at or under the low watermark it stops, and starts again only over the high watermark,
//!   under pressure or for a request that does not fit: between the two nothing flaps.
//! - **Victims, in this order.** (1) Revoke reservations: lower to its resident the limit of
//!   an offloaded VM, or of a waiting or idle VM whose limit is more than `revoke_slack` above
//!   its resident, largest reservation first. It is free and immediate, and such a VM faults
//!   little. (2) Offload waiting VMs, the longest expected remaining wait first: their RAM is
//!   not needed before the answer comes, and the longer the wait the more memory × time the
//!   offload saves for the same cost. A wait with no expected remaining time counts as
//!   `unknown_wait`. (3) Offload idle VMs, largest resident first: they have no wait that
//!   ends on its own, but they may be told to run at any time. (4) Cold-compress running VMs,
//!   largest resident first, with the shorter `pressure_cold_age`: it costs a running VM the
//!   least (only RAM it has not touched for that long), but frees an unknown part of it; a
//!   VM that refused one is not asked again (its cold age is set at its start).
//!   (5) Preempt: a running VM held at its faults, junior to the queue's head, the
//!   youngest first. Held in its command it never reaches a wait where its RAM could go;
//!   when every VM is so held (VMs that replay one trajectory start their steps together),
//!   nothing else ever frees room. Its vCPU is kicked out of the guest, its RAM offloaded,
//!   and it re-enters its command asking for room behind its elders. Not while another VM
//!   runs unheld, though, until the head has waited `preempt_wait`: that VM's step ends in
//!   a wait where its RAM goes, sooner than a preempted VM's RAM comes back (24 VMs under
//!   512 MiB: 1-18 preemptions in runs whose longest task took 58.9-60.0 s, 47 in the one
//!   that took 65.9 s). Otherwise a VM with
//!   held faults or a queued request, an order not yet reported (see below), or that cannot
//!   be reached, is never a victim; nor, for an order of the same kind, one whose order
//!   failed less than `order_timeout` ago unless it reported a new state since (an idle VM
//!   refuses an offload once its next command has begun: waiting, it can carry one out).
//! - **Orders are paced.** An order counts the bytes it is expected to free (an offload: the
//!   VM's charged RAM minus `offload_remainder`; a cold compression: `cold_expect_fraction` of
//!   its resident), so one reclaim does not order everyone. An order not reported within
//!   `order_timeout` stops counting, and its bytes are sought from the next victim; its VM is
//!   not given another order until it reports back, so two orders never overlap on one VM.
//! - **Deadlock-free.** Reclaim needs no memory (offloads write in bounded batches), and
//!   preemption reaches the RAM of VMs held at their faults. If the head request does not fit, nothing was left to reclaim (a
//!   running VM's cold compression counts as reclaim: the last resort comes once it reported
//!   and freed too little) and no order is outstanding, it is granted `max(bytes, grant)` if projected usage stays at or
//!   under the budget itself (beyond the watermark): reason [`Reason::LastResort`], counted.
//!   Otherwise it stays queued; the VM's client has its own timeout.
//! - **Unreachable VMs.** A VM that has sent nothing for `stale_after` is unreachable: it is
//!   still charged (at its last readings, which do not change), never a victim, and its queued
//!   request is dropped. Its next message makes it reachable again.
//! - **Pressure.** PSI `some avg10` above `psi_threshold`, a `failcnt` that grew since the
//!   last tick, or a notification of the kernel's since then (v1 `memory.pressure_level`),
//!   counts as usage over the high watermark for that tick.
//! - **Log.** Every decision is counted (per VM and in total, by kind) and logged in a ring of
//!   the last [`LOG_LINES`] lines with its time, VM name and reason.
//!
//! # What the server does with each decision
//! - [`Decision::SetLimit`]: set the VM's pager resident limit to `limit` (raise: wake the held
//!   faults that now fit; lower: it is never below the VM's resident).
//! - [`Decision::Offload`]: offload that waiting or idle VM now, overriding its wait policy's
//!   cooldown and break-even, or that running VM with its vCPU kicked out of the guest
//!   ([`Reason::Preempt`]); then call [`Governor::offloaded`] with what stays resident and
//!   whether it worked. Its limit becomes what stays resident: the VM sets it as it reports,
//!   and the governor answers with a [`Decision::SetLimit`] saying so.
//! - [`Decision::ColdCompress`]: compress that running VM's RAM colder than `age` once; then
//!   call [`Governor::offloaded`] with its resident after it. The governor answers with a
//!   [`Decision::SetLimit`] lowering its limit to that plus one grant.
//!
//! Messages about an unknown VM id (one that left) are ignored. [`Governor::leave`] and
//! [`Governor::reading`] answer nothing: the room they make is used at the next call, at the
//! latest the next tick.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

mod config;
mod reclaim;
mod status;
mod types;

pub use config::{Config, LOG_LINES};
pub use status::{OrderStatus, QueueStatus, Status, VmStatus};
pub use types::{
    Decision, DecisionCounts, EventCounts, OrderKind, Pressure, Reading, Reason, VmState,
};

const MIB: u64 = 1 << 20;

/// A VM's resident that moved at most this much since its last reading holds still: its
/// overhead is learned from such readings only (see `Vm::set_reading`).
const STEADY_BYTES: u64 = MIB;

/// A VM's id, given by [`Governor::join`].
pub type VmId = u64;

/// A VM's place in the queue and among victims: the one that began its current run earliest
/// first (the VM that joined first, on a tie). `None` for a VM not there (its queued
/// requests go when it leaves).
fn seniority(vms: &BTreeMap<VmId, Vm>, vm: VmId) -> Option<(Instant, VmId)> {
    vms.get(&vm).map(|v| (v.since, vm))
}

#[derive(Debug, Clone, Copy)]
struct Order {
    kind: OrderKind,
    at: Instant,
    /// Bytes it is expected to free; stops counting once timed out.
    expect_free: u64,
    timed_out: bool,
}

#[derive(Debug)]
struct Vm {
    name: String,
    memory_bytes: u64,
    state: VmState,
    reading: Reading,
    overhead: Option<u64>,
    /// When `overhead` was read.
    overhead_at: Option<Instant>,
    limit: Option<u64>,
    peak: u64,
    /// When it began its current run: joined, or reported running from another state. The
    /// earliest goes first (see [`seniority`]).
    since: Instant,
    last_heard: Instant,
    reachable: bool,
    order: Option<Order>,
    /// When an order of each kind ([`OrderKind`] as index) last failed: a VM that cannot
    /// cold-compress may still offload.
    failed_at: [Option<Instant>; 2],
    /// It refused a cold compression: it is not asked for another.
    cold_unable: bool,
    cold_at: Option<Instant>,
    offloaded_bytes: u64,
    counts: DecisionCounts,
}

impl Vm {
    fn overhead(&self, config: &Config) -> u64 {
        self.overhead.unwrap_or(config.default_overhead)
    }

    /// The RAM it is charged for: the larger of its resident and its limit.
    fn charged_ram(&self) -> u64 {
        self.limit
            .map_or(self.reading.resident, |l| l.max(self.reading.resident))
    }

    fn charge(&self, config: &Config) -> u64 {
        self.overhead(config).saturating_add(self.charged_ram())
    }

    fn set_reading(&mut self, now: Instant, reading: Reading, window: Duration) {
        self.peak = self.peak.max(reading.resident);
        // Learned only while its resident holds still: the VM's figure and its cgroup's are
        // read a moment apart, and while pages come and go (a fill, an offload's batches)
        // their difference is that moment's traffic, not overhead. Held for the window, such
        // figures had offloaded VMs charged 60-87 MiB of overhead for 4-5 MiB of real.
        let steady = reading.resident.abs_diff(self.reading.resident) <= STEADY_BYTES;
        if let Some(cgroup) = reading.cgroup.filter(|_| steady) {
            // The largest over the window: a reading lower than the one held replaces it
            // only once that one is older than the window.
            let overhead = cgroup.saturating_sub(reading.resident);
            let held = self
                .overhead
                .filter(|_| {
                    self.overhead_at
                        .is_some_and(|at| now.saturating_duration_since(at) < window)
                })
                .unwrap_or(0);
            if overhead >= held {
                self.overhead = Some(overhead);
                self.overhead_at = Some(now);
            }
        }
        self.reading = reading;
    }
}

/// What a queued request waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueKind {
    /// A join waiting for its initial limit.
    Admission,
    /// Held faults.
    Grant,
}

#[derive(Debug, Clone, Copy)]
struct Queued {
    vm: VmId,
    kind: QueueKind,
    /// Admission: the limit wanted; grant: the bytes to add.
    bytes: u64,
    since: Instant,
}

/// A victim and what to do with it.
#[derive(Debug, Clone, Copy)]
enum Victim {
    Revoke(VmId),
    Order(VmId, OrderKind, u64),
}

/// The governor's state: the VMs, the queue of requests, the log.
#[derive(Debug)]
pub struct Governor {
    config: Config,
    vms: BTreeMap<VmId, Vm>,
    next_id: VmId,
    queue: VecDeque<Queued>,
    /// Why the reclaim under way started (none: usage was last at or under the low watermark).
    reclaiming: Option<Reason>,
    total_usage: Option<u64>,
    psi: Option<f64>,
    failcnt: Option<u64>,
    under_pressure: bool,
    base: Option<Instant>,
    log: VecDeque<String>,
    counts: DecisionCounts,
    events: EventCounts,
}

impl Governor {
    /// A governor with these knobs (see [`Config::check`]) and no VMs.
    pub fn new(config: Config) -> Self {
        Self {
            config,
            vms: BTreeMap::new(),
            next_id: 1,
            queue: VecDeque::new(),
            reclaiming: None,
            total_usage: None,
            psi: None,
            failcnt: None,
            under_pressure: false,
            base: None,
            log: VecDeque::with_capacity(LOG_LINES),
            counts: DecisionCounts::default(),
            events: EventCounts::default(),
        }
    }

    /// The knobs.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// A VM joins with its guest RAM size and first readings: it gets its id and, where the
    /// initial limit fits and nobody is queued, that limit; otherwise its resident as limit
    /// and a place in the queue.
    pub fn join(
        &mut self,
        now: Instant,
        name: String,
        memory_bytes: u64,
        reading: Reading,
    ) -> (VmId, Vec<Decision>) {
        self.base.get_or_insert(now);
        let id = self.next_id;
        self.next_id += 1;
        let mut vm = Vm {
            name,
            memory_bytes,
            state: VmState::Running,
            reading: Reading::default(),
            overhead: None,
            overhead_at: None,
            limit: None,
            peak: 0,
            since: now,
            last_heard: now,
            reachable: true,
            order: None,
            failed_at: [None; 2],
            cold_unable: false,
            cold_at: None,
            offloaded_bytes: 0,
            counts: DecisionCounts::default(),
        };
        vm.set_reading(now, reading, self.config.overhead_window);
        self.vms.insert(id, vm);
        let mut out = Vec::new();
        let wanted = self.config.initial_limit.max(reading.resident);
        let add = wanted - reading.resident;
        self.sweep(now);
        if self.queue.is_empty() && self.fits(add, self.config.high_bytes()) {
            self.decide(
                now,
                &mut out,
                Decision::SetLimit {
                    vm: id,
                    limit: wanted,
                    reason: Reason::Join,
                },
            );
        } else {
            let limit = reading.resident;
            self.decide(
                now,
                &mut out,
                Decision::SetLimit {
                    vm: id,
                    limit,
                    reason: Reason::Queued,
                },
            );
            self.queue.push_back(Queued {
                vm: id,
                kind: QueueKind::Admission,
                bytes: wanted,
                since: now,
            });
        }
        self.evaluate(now, &mut out);
        (id, out)
    }

    /// A VM leaves: it is no longer charged; its queued request goes.
    pub fn leave(&mut self, vm: VmId) {
        if let Some(v) = self.vms.remove(&vm) {
            // Out of the last measured total too, until the next tick measures again.
            let held = v.reading.cgroup.unwrap_or_else(|| v.charge(&self.config));
            self.total_usage = self.total_usage.map(|t| t.saturating_sub(held));
        }
        self.queue.retain(|q| q.vm != vm);
    }

    /// A VM reports a state change.
    pub fn state(&mut self, now: Instant, vm: VmId, state: VmState) -> Vec<Decision> {
        let Some(v) = self.heard(now, vm) else {
            return Vec::new();
        };
        let new_run = state == VmState::Running && v.state != VmState::Running;
        if new_run {
            v.since = now;
        }
        // Just offloaded (by an order or by its owner), it holds no fault: a request queued
        // before is stale (see `drop_request`). Its client forgets it as it reports the state.
        let offloaded_now = state == VmState::Offloaded && v.state != VmState::Offloaded;
        if v.state != state {
            // An order refused in the state it was sent for (an idle VM whose next command
            // had begun) says nothing of the new one: a VM that starts to wait is a victim
            // again at once (shut out for the order timeout, waiting VMs were missed until
            // every VM ran held).
            v.failed_at = [None; 2];
        }
        v.state = state;
        if offloaded_now {
            self.drop_request(vm);
        }
        if new_run {
            // Its place in the queue follows its seniority.
            let vms = &self.vms;
            self.queue
                .make_contiguous()
                .sort_by_key(|q| seniority(vms, q.vm));
        }
        let mut out = Vec::new();
        self.evaluate(now, &mut out);
        out
    }

    /// A VM reports its readings.
    pub fn reading(&mut self, now: Instant, vm: VmId, reading: Reading) {
        let window = self.config.overhead_window;
        if let Some(v) = self.heard(now, vm) {
            v.set_reading(now, reading, window);
        }
    }

    /// A VM's faults are held: it wants its limit raised by at least `bytes`.
    pub fn request(&mut self, now: Instant, vm: VmId, bytes: u64) -> Vec<Decision> {
        if self.heard(now, vm).is_none() {
            return Vec::new();
        }
        self.events.requests += 1;
        // Held until its next reading says otherwise: a VM asking for room is never the one
        // whose room is taken back meanwhile (readings come every 100 ms; a grant followed at
        // once by a revocation left a VM held at the copy of its model answer, over and over).
        if let Some(v) = self.vms.get_mut(&vm) {
            v.reading.held = v.reading.held.max(bytes.max(1));
        }
        if let Some(q) = self.queue.iter_mut().find(|q| q.vm == vm) {
            // A queued join's own faults are covered by its admission; a queued grant asks
            // for the larger of the two.
            if q.kind == QueueKind::Grant {
                q.bytes = q.bytes.max(bytes);
            }
        } else {
            // In the order the VMs began their runs, not the order they asked: see the
            // module doc.
            let key = seniority(&self.vms, vm);
            let at = self
                .queue
                .partition_point(|q| seniority(&self.vms, q.vm) < key);
            self.queue.insert(
                at,
                Queued {
                    vm,
                    kind: QueueKind::Grant,
                    bytes,
                    since: now,
                },
            );
        }
        let mut out = Vec::new();
        self.evaluate(now, &mut out);
        out
    }

    /// A VM's order (offload or cold compression) was carried out (`ok`) or failed, or, with
    /// no order out, its owner offloaded it; `resident_after` is what it holds resident now.
    pub fn offloaded(
        &mut self,
        now: Instant,
        vm: VmId,
        resident_after: u64,
        ok: bool,
    ) -> Vec<Decision> {
        let grant = self.config.grant;
        if self.heard(now, vm).is_none() {
            return Vec::new();
        }
        let Some(v) = self.vms.get_mut(&vm) else {
            return Vec::new();
        };
        let order = v.order.take();
        let before = v.reading.resident;
        v.reading.resident = resident_after;
        // The last measured total still holds what this order freed: take it out until the
        // next tick measures again, or the reclaim would go on for memory already freed.
        let freed = before.saturating_sub(resident_after);
        self.total_usage = self.total_usage.map(|t| t.saturating_sub(freed));
        let mut new_limit = None;
        if !ok {
            if let Some(order) = order {
                v.failed_at[order.kind as usize] = Some(now);
                // A VM's cold age is set at its start: one that cannot compress now never
                // will, and is not asked again (its RAM is reached by offloads).
                v.cold_unable |= order.kind == OrderKind::ColdCompress;
            }
            self.events.orders_failed += u64::from(order.is_some());
        } else {
            self.events.orders_done += u64::from(order.is_some());
            match order.map(|o| o.kind) {
                // Ordered, or its owner's own (a pause, a daemon's idle offload; its state
                // comes next): the VM lowers its own limit to what stays resident as it
                // reports, and the decision says so again after any limit sent meanwhile.
                // Kept, an owner's offload left a reservation the VM no longer had, and its
                // next request was charged on top: at the queue's head, never a victim as
                // one that asks, it was granted nothing (two sandboxes under 128 MiB).
                kind @ (None | Some(OrderKind::Offload)) => {
                    new_limit = Some((resident_after, Reason::Offloaded));
                    v.offloaded_bytes = before.saturating_sub(resident_after);
                    if kind.is_some() {
                        v.state = VmState::Offloaded;
                    }
                }
                Some(OrderKind::ColdCompress) => {
                    let lower = resident_after.saturating_add(grant);
                    if v.limit.is_some_and(|l| l > lower) {
                        new_limit = Some((lower, Reason::Compressed));
                    }
                }
            }
        }
        let mut out = Vec::new();
        if let Some((limit, reason)) = new_limit {
            self.decide(now, &mut out, Decision::SetLimit { vm, limit, reason });
        }
        self.evaluate(now, &mut out);
        out
    }

    /// Time passes; the host's readings and pressure signals.
    pub fn tick(&mut self, now: Instant, pressure: Pressure) -> Vec<Decision> {
        self.base.get_or_insert(now);
        self.total_usage = pressure.total_usage;
        self.psi = pressure.psi_some_avg10;
        let failcnt_grew = match (self.failcnt, pressure.failcnt) {
            (Some(before), Some(now)) => now > before,
            _ => false,
        };
        if pressure.failcnt.is_some() {
            self.failcnt = pressure.failcnt;
        }
        let psi_high = pressure
            .psi_some_avg10
            .is_some_and(|p| p > self.config.psi_threshold);
        self.events.pressure_notifications += pressure.notifications;
        self.under_pressure = psi_high || failcnt_grew || pressure.notifications > 0;
        let mut out = Vec::new();
        self.evaluate(now, &mut out);
        self.under_pressure = false;
        out
    }

    /// The VM's record, marked heard now (reachable again).
    fn heard(&mut self, now: Instant, vm: VmId) -> Option<&mut Vm> {
        self.base.get_or_insert(now);
        let v = self.vms.get_mut(&vm)?;
        v.last_heard = now;
        v.reachable = true;
        Some(v)
    }

    /// The sum of charges.
    pub fn projected(&self) -> u64 {
        self.vms
            .values()
            .map(|v| v.charge(&self.config))
            .fold(0u64, u64::saturating_add)
    }

    /// The measured usage: the last tick's total, else the sum of cgroup readings (none: no
    /// VM has one).
    pub fn measured(&self) -> Option<u64> {
        self.total_usage.or_else(|| {
            self.vms
                .values()
                .filter_map(|v| v.reading.cgroup)
                .reduce(u64::saturating_add)
        })
    }

    /// The larger of projected and measured usage.
    pub fn usage(&self) -> u64 {
        self.projected().max(self.measured().unwrap_or(0))
    }

    /// Adding `add` to the projected usage stays at or under `ceiling`.
    fn fits(&self, add: u64, ceiling: u64) -> bool {
        self.projected()
            .checked_add(add)
            .is_some_and(|total| total <= ceiling)
    }

    /// Bytes the outstanding (not timed out) orders are expected to free.
    fn outstanding(&self) -> u64 {
        self.vms
            .values()
            .filter_map(|v| v.order)
            .filter(|o| !o.timed_out)
            .map(|o| o.expect_free)
            .fold(0u64, u64::saturating_add)
    }

    /// What granting the queue's head would raise its limit to, if it fits under `ceiling`
    /// (`extend`: also up to its learned peak, where that fits too).
    fn head_limit(&self, head: &Queued, ceiling: u64, extend: bool) -> Option<(u64, Reason)> {
        let v = self.vms.get(&head.vm)?;
        let base = v.charged_ram();
        let need = self.need(head, v);
        let reason = match head.kind {
            QueueKind::Admission => Reason::Admission,
            QueueKind::Grant => Reason::Grant,
        };
        if !self.fits(need, ceiling) {
            return None;
        }
        let mut add = need;
        if extend && self.config.grant_to_peak && head.kind == QueueKind::Grant {
            let room = ceiling - self.projected();
            // Up to the peak as a limit: from what it is charged, not from its resident. An
            // offloaded VM granted room whose faults have not filled it yet asked again and
            // got its peak on top of that room (limits of 130-210 MiB for 70 MiB steps).
            add = add.max(v.peak.saturating_sub(base).min(room));
            // No more than its RAM, unless what it asked for already is.
            let cap = v.memory_bytes.max(base.saturating_add(need));
            add = add.min(cap.saturating_sub(base));
        }
        Some((base.saturating_add(add), reason))
    }

    /// Grants what fits, reclaims where needed, and grants a last resort where nothing else
    /// can move.
    fn evaluate(&mut self, now: Instant, out: &mut Vec<Decision>) {
        self.sweep(now);
        let high = self.config.high_bytes();
        let low = self.config.low_bytes();
        if self.usage() <= low && !self.under_pressure {
            self.reclaiming = None;
        }
        let mut trigger = None;
        if self.under_pressure {
            trigger = Some(Reason::Pressure);
        } else if self.usage() > high {
            trigger = Some(Reason::OverWatermark);
        }
        self.grant_fitting(now, out);
        if trigger.is_none() && !self.queue.is_empty() {
            trigger = Some(Reason::MakeRoom);
        }
        if trigger.is_some() {
            self.reclaiming = trigger;
        }
        let Some(reason) = self.reclaiming else {
            return;
        };
        let before = out.len();
        self.reclaim(now, reason, out);
        let reclaimed = out.len() > before;
        self.grant_fitting(now, out);
        if !reclaimed && self.outstanding() == 0 {
            self.last_resort(now, out);
        }
    }

    /// Grants queued requests in order while the head fits under the high watermark.
    fn grant_fitting(&mut self, now: Instant, out: &mut Vec<Decision>) {
        while let Some(head) = self.queue.front().copied() {
            let Some((limit, reason)) = self.head_limit(&head, self.config.high_bytes(), true)
            else {
                return;
            };
            self.queue.pop_front();
            self.decide(
                now,
                out,
                Decision::SetLimit {
                    vm: head.vm,
                    limit,
                    reason,
                },
            );
        }
    }

    /// Grants queued requests in order while the head fits under the last-resort watermark: a
    /// whole grant, or, where that does not fit, all the room left under the watermark if
    /// what the head asked for fits in it (a VM near the budget that needs 64 KiB more would
    /// else wait for room that nothing is going to make). Not just what it asked for: a VM
    /// paging its working set back in under a full budget asks 4-64 KiB at a time, and was
    /// granted each about 12 ms after the last.
    fn last_resort(&mut self, now: Instant, out: &mut Vec<Decision>) {
        while let Some(head) = self.queue.front().copied() {
            let ceiling = self.config.last_resort_bytes();
            let limit = match self.head_limit(&head, ceiling, false) {
                Some((limit, _)) => limit,
                None if head.kind == QueueKind::Grant && self.fits(head.bytes, ceiling) => {
                    let Some(v) = self.vms.get(&head.vm) else {
                        return;
                    };
                    let room = ceiling.saturating_sub(self.projected());
                    v.charged_ram().saturating_add(room.max(head.bytes))
                }
                None => return,
            };
            self.queue.pop_front();
            self.decide(
                now,
                out,
                Decision::SetLimit {
                    vm: head.vm,
                    limit,
                    reason: Reason::LastResort,
                },
            );
        }
    }

    /// The usage a reclaim aims for: the low watermark, or lower where the queue's head needs
    /// more room under the high watermark than that leaves.
    fn target(&self) -> u64 {
        let low = self.config.low_bytes();
        let Some(head) = self.queue.front() else {
            return low;
        };
        let Some(v) = self.vms.get(&head.vm) else {
            return low;
        };
        low.min(self.config.high_bytes().saturating_sub(self.need(head, v)))
    }

    /// What granting a queued request adds to its VM's charge at the least.
    fn need(&self, head: &Queued, v: &Vm) -> u64 {
        match head.kind {
            QueueKind::Admission => head.bytes.saturating_sub(v.charged_ram()),
            QueueKind::Grant => head.bytes.max(self.config.grant),
        }
    }

    /// Applies a decision to the model, counts and logs it, and hands it out.
    fn decide(&mut self, now: Instant, out: &mut Vec<Decision>, decision: Decision) {
        let Some(v) = self.vms.get_mut(&decision.vm()) else {
            return;
        };
        let what = match decision {
            Decision::SetLimit { limit, .. } => {
                v.limit = Some(limit);
                format!("limit {}", Mib(limit))
            }
            Decision::Offload { .. } => format!("offload ({} resident)", Mib(v.reading.resident)),
            Decision::ColdCompress { age, .. } => format!(
                "cold-compress, age {} ms ({} resident)",
                age.as_millis(),
                Mib(v.reading.resident)
            ),
        };
        v.counts.count(&decision);
        self.counts.count(&decision);
        let at = self
            .base
            .map_or(Duration::ZERO, |b| now.saturating_duration_since(b));
        let line = format!(
            "+{:.3}s {}: {what}: {}",
            at.as_secs_f64(),
            v.name,
            decision.reason()
        );
        if self.log.len() == LOG_LINES {
            self.log.pop_front();
        }
        self.log.push_back(line);
        out.push(decision);
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Bytes shown as MiB, for the log.
struct Mib(u64);

impl fmt::Display for Mib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.1} MiB", self.0 as f64 / MIB as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = MIB;

    /// A 1000 MiB budget (high 900, low 800), no default overhead, no initial limit beyond
    /// a VM's resident: the arithmetic of each test is in whole MiB.
    fn config() -> Config {
        Config {
            budget: 1000 * M,
            initial_limit: 0,
            default_overhead: 0,
            // Most tests grant up to the budget itself; the default reserve has its own.
            last_resort_watermark: 1.0,
            ..Config::default()
        }
    }

    /// [`config`] with the last resort at this share of the budget.
    fn last_resort_at(share: f64) -> Governor {
        Governor::new(Config {
            last_resort_watermark: share,
            ..config()
        })
    }

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    fn res(mib: u64) -> Reading {
        Reading {
            resident: mib * M,
            ..Reading::default()
        }
    }

    /// The host's readings: this total usage, no pressure signal.
    fn total(mib: u64) -> Pressure {
        Pressure {
            total_usage: Some(mib * M),
            ..Pressure::default()
        }
    }

    fn waiting(secs: Option<u64>) -> VmState {
        VmState::Waiting {
            expected_remaining: secs.map(Duration::from_secs),
        }
    }

    /// Joins a VM with `mib` resident (its limit: that) in `state`.
    fn vm(g: &mut Governor, now: Instant, name: &str, mib: u64, state: VmState) -> VmId {
        let (id, _) = g.join(now, name.into(), 1024 * M, res(mib));
        g.state(now, id, state);
        id
    }

    /// The queued VMs, in the queue's order.
    fn queued(g: &Governor, now: Instant) -> Vec<VmId> {
        g.status(now).queue.iter().map(|q| q.vm).collect()
    }

    fn limit(g: &Governor, now: Instant, id: VmId) -> Option<u64> {
        g.status(now)
            .vms
            .iter()
            .find(|v| v.id == id)
            .and_then(|v| v.limit)
    }

    fn set(vm: VmId, mib: u64, reason: Reason) -> Decision {
        Decision::SetLimit {
            vm,
            limit: mib * M,
            reason,
        }
    }

    #[test]
    fn governor_config_check_refuses_bad_knobs() {
        assert_eq!(Config::default().check(), Ok(()));
        let bad = [
            Config {
                budget: 0,
                ..Config::default()
            },
            Config {
                low_watermark: 0.9,
                high_watermark: 0.9,
                ..Config::default()
            },
            Config {
                high_watermark: 1.1,
                ..Config::default()
            },
            Config {
                low_watermark: 0.0,
                ..Config::default()
            },
            Config {
                low_watermark: f64::NAN,
                ..Config::default()
            },
            Config {
                grant: 0,
                ..Config::default()
            },
            Config {
                stale_after: Duration::ZERO,
                ..Config::default()
            },
            Config {
                psi_threshold: -1.0,
                ..Config::default()
            },
            Config {
                cold_expect_fraction: 2.0,
                ..Config::default()
            },
        ];
        for config in bad {
            assert!(config.check().is_err(), "{config:?} accepted");
        }
    }

    #[test]
    fn governor_charge_counts_learned_overhead_and_the_larger_of_resident_and_limit() {
        let base = Instant::now();
        let mut g = Governor::new(Config {
            default_overhead: 24 * M,
            initial_limit: 64 * M,
            ..config()
        });
        let (a, out) = g.join(base, "a".into(), 512 * M, res(10));
        assert_eq!(out, vec![set(a, 64, Reason::Join)]);
        // Default overhead until a cgroup figure; charged at the limit above resident.
        assert_eq!(g.projected(), 88 * M);
        let reading = |mib, cgroup| Reading {
            cgroup: Some(cgroup * M),
            ..res(mib)
        };
        g.reading(base, a, reading(10, 40));
        assert_eq!(g.projected(), 94 * M);
        // While its resident moves, the difference is not learned (a fill whose cgroup was
        // read a moment after its resident).
        g.reading(at(base, 100), a, reading(100, 300));
        assert_eq!(g.projected(), 130 * M);
        // Held still: overhead 40, resident above the limit: charged at resident.
        g.reading(at(base, 200), a, reading(100, 140));
        assert_eq!(g.projected(), 140 * M);
        // A lower overhead within the window does not replace the larger one.
        g.reading(at(base, 1000), a, reading(100, 110));
        assert_eq!(g.projected(), 140 * M);
        // Past the window, the new figure; overhead never below 0.
        g.reading(at(base, 6000), a, reading(100, 40));
        assert_eq!(g.projected(), 100 * M);
        assert_eq!(g.measured(), Some(40 * M));
        assert_eq!(g.usage(), 100 * M);
        g.tick(base, total(300));
        assert_eq!(g.measured(), Some(300 * M));
        assert_eq!(g.usage(), 300 * M);
    }

    #[test]
    fn governor_join_that_does_not_fit_waits_until_another_vm_offloads_and_reports() {
        let base = Instant::now();
        let mut g = Governor::new(Config {
            initial_limit: 400 * M,
            ..config()
        });
        let w = vm(&mut g, base, "w", 400, waiting(Some(30)));
        let r = vm(&mut g, base, "r", 400, VmState::Running);
        assert_eq!(limit(&g, base, r), Some(400 * M));
        // 850 projected: 350 more for the newcomer does not fit under 900.
        let (c, out) = g.join(at(base, 1), "c".into(), 1024 * M, res(50));
        assert_eq!(
            out,
            vec![
                set(c, 50, Reason::Queued),
                Decision::Offload {
                    vm: w,
                    reason: Reason::MakeRoom
                }
            ]
        );
        assert_eq!(g.status(base).queue.len(), 1);
        // Nothing more while the offload is under way.
        assert!(g.tick(at(base, 2), Pressure::default()).is_empty());
        let out = g.offloaded(at(base, 3), w, 4 * M, true);
        assert_eq!(
            out,
            vec![set(w, 4, Reason::Offloaded), set(c, 400, Reason::Admission)]
        );
        let s = g.status(at(base, 3));
        assert!(s.queue.is_empty());
        assert_eq!(s.projected, 804 * M);
        assert_eq!(s.decisions.admission, 1);
        assert_eq!(s.vms[0].offloaded_bytes, 396 * M);
        assert_eq!(s.vms[0].limit, Some(4 * M));
    }

    #[test]
    fn governor_join_behind_a_queue_waits_its_turn() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let a = vm(&mut g, base, "a", 850, VmState::Running);
        // Nothing to reclaim, and 1050 would pass the budget: it stays queued.
        assert!(g.request(base, a, 200 * M).is_empty());
        // It would fit by itself (adds nothing), but the queue goes first.
        let (b, out) = g.join(base, "b".into(), 1024 * M, res(0));
        assert_eq!(out[0], set(b, 0, Reason::Queued));
        assert_eq!(g.status(base).queue.len(), 2);
    }

    #[test]
    fn governor_victims_revocations_then_longest_wait_then_idle_then_largest_cold() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let r_small = vm(&mut g, base, "r-small", 100, VmState::Running);
        let r_big = vm(&mut g, base, "r-big", 200, VmState::Running);
        let idle = vm(&mut g, base, "idle", 100, VmState::Idle);
        let w_short = vm(&mut g, base, "w-short", 100, waiting(Some(5)));
        let w_long = vm(&mut g, base, "w-long", 100, waiting(Some(30)));
        let w_unknown = vm(&mut g, base, "w-unknown", 100, waiting(None));
        // Offloaded by its own wait policy: 10 resident under a limit of 110.
        let off = vm(&mut g, base, "off", 110, VmState::Running);
        g.reading(base, off, res(10));
        g.state(base, off, VmState::Offloaded);
        // Far over the high watermark, measured: everything reclaimable is ordered.
        let out = g.tick(at(base, 1), total(3000));
        let reason = Reason::OverWatermark;
        let age = Config::default().pressure_cold_age;
        assert_eq!(
            out,
            vec![
                set(off, 10, Reason::Revoke),
                Decision::Offload { vm: w_long, reason },
                // Unknown counts as `unknown_wait` (10 s): between 30 s and 5 s.
                Decision::Offload {
                    vm: w_unknown,
                    reason
                },
                Decision::Offload {
                    vm: w_short,
                    reason
                },
                Decision::Offload { vm: idle, reason },
                Decision::ColdCompress {
                    vm: r_big,
                    age,
                    reason
                },
                Decision::ColdCompress {
                    vm: r_small,
                    age,
                    reason
                },
            ]
        );
        // Each VM has one order: nothing more until they report or time out.
        assert!(g.tick(at(base, 2), total(3000)).is_empty());
    }

    #[test]
    fn governor_one_reclaim_orders_only_what_it_needs() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let a = vm(&mut g, base, "a", 300, waiting(Some(30)));
        let _b = vm(&mut g, base, "b", 300, waiting(Some(20)));
        let _c = vm(&mut g, base, "c", 300, waiting(Some(10)));
        // 900 projected, 950 measured: 150 to free to reach 800; one offload frees ~296.
        let out = g.tick(at(base, 1), total(950));
        assert_eq!(
            out,
            vec![Decision::Offload {
                vm: a,
                reason: Reason::OverWatermark
            }]
        );
        assert_eq!(g.status(at(base, 1)).outstanding, 296 * M);
    }

    #[test]
    fn governor_requests_are_granted_oldest_vm_first_whatever_their_arrival() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let old = vm(&mut g, base, "old", 300, VmState::Running);
        let young = vm(&mut g, base, "young", 300, VmState::Running);
        let w = vm(&mut g, base, "w", 200, waiting(Some(30)));
        // The young VM asks first; nothing fits (800 + 200 > 900): w goes to make room.
        let out = g.request(at(base, 1), young, 200 * M);
        assert_eq!(
            out,
            vec![Decision::Offload {
                vm: w,
                reason: Reason::MakeRoom
            }]
        );
        // The old one asks after it, and goes before it.
        assert!(g.request(at(base, 2), old, 200 * M).is_empty());
        assert_eq!(queued(&g, at(base, 2)), vec![old, young]);
        // The room w frees (196) goes to the old VM; the young one waits for more.
        let out = g.offloaded(at(base, 3), w, 4 * M, true);
        assert_eq!(out[0], set(w, 4, Reason::Offloaded));
        assert_eq!(out[1], set(old, 500, Reason::Grant));
        assert!(!out
            .iter()
            .any(|d| matches!(d, Decision::SetLimit { vm, .. } if *vm == young)));
        assert_eq!(queued(&g, at(base, 3)), vec![young]);
    }

    #[test]
    fn governor_seniority_is_the_start_of_the_current_run_not_the_join() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let a = vm(&mut g, base, "a", 300, VmState::Running);
        let b = vm(&mut g, base, "b", 300, VmState::Running);
        let w = vm(&mut g, base, "w", 200, waiting(Some(30)));
        // a waits for the model and its answer comes: its new run began after b's.
        g.state(at(base, 1), a, waiting(Some(3)));
        g.state(at(base, 5), a, VmState::Running);
        let out = g.request(at(base, 6), a, 200 * M);
        assert_eq!(
            out,
            vec![Decision::Offload {
                vm: w,
                reason: Reason::MakeRoom
            }]
        );
        assert!(g.request(at(base, 7), b, 200 * M).is_empty());
        assert_eq!(queued(&g, at(base, 7)), vec![b, a], "b began its run first");
        // The room w frees goes to b; a waits for more.
        let out = g.offloaded(at(base, 8), w, 4 * M, true);
        assert_eq!(
            out,
            vec![set(w, 4, Reason::Offloaded), set(b, 500, Reason::Grant)]
        );
        assert_eq!(queued(&g, at(base, 8)), vec![a]);
    }

    #[test]
    fn governor_younger_vms_unused_room_goes_to_an_older_vm_youngest_first() {
        let base = Instant::now();
        let mut g = Governor::new(Config {
            initial_limit: 300 * M,
            ..config()
        });
        let (old, _) = g.join(base, "old".into(), 512 * M, res(1));
        let (mid, _) = g.join(base, "mid".into(), 512 * M, res(1));
        let (young, _) = g.join(base, "young".into(), 512 * M, res(1));
        g.reading(base, old, res(300));
        g.reading(base, mid, res(100));
        g.reading(base, young, res(50));
        // 900 projected: the old VM's 100 more does not fit; the young one's unused 250 is
        // taken back, and that is enough: the middle one keeps its room.
        let out = g.request(at(base, 1), old, 100 * M);
        assert_eq!(
            out,
            vec![set(young, 50, Reason::Revoke), set(old, 400, Reason::Grant)],
            "{out:?}"
        );
        assert_eq!(limit(&g, at(base, 1), mid), Some(300 * M));
        // The young VM asking does not take room back from its elders.
        let out = g.request(at(base, 2), young, 100 * M);
        assert!(
            !out.iter().any(|d| matches!(
                d,
                Decision::SetLimit { vm, reason: Reason::Revoke, .. } if *vm == old || *vm == mid
            )),
            "{out:?}"
        );
    }

    #[test]
    fn governor_a_vm_granted_room_for_held_faults_keeps_it_until_its_next_reading() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let a = vm(&mut g, base, "a", 100, VmState::Offloaded);
        let b = vm(&mut g, base, "b", 700, VmState::Running);
        g.reading(base, a, res(1));
        // a's answer came and its copy faults: 100 MiB granted.
        let out = g.request(at(base, 1), a, 100 * M);
        assert!(
            out.iter().any(
                |d| matches!(d, Decision::SetLimit { vm, reason: Reason::Grant, .. } if *vm == a)
            ),
            "{out:?}"
        );
        // b asks for more than fits; a (still reported offloaded, its reading not in yet)
        // is not the one whose room is taken back.
        let out = g.request(at(base, 2), b, 200 * M);
        assert!(
            !out.iter()
                .any(|d| matches!(d, Decision::SetLimit { vm, .. } if *vm == a)),
            "{out:?}"
        );
    }

    #[test]
    fn governor_a_request_queued_before_its_vm_was_offloaded_is_dropped_and_its_room_revoked() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let a = vm(&mut g, base, "a", 1, VmState::Running);
        let b = vm(&mut g, at(base, 1), "b", 1, VmState::Running);
        // a, the elder, is granted 800 MiB, then asks for 250 more, past the budget: queued,
        // at the head, ahead of b's 100.
        let out = g.request(at(base, 2), a, 800 * M);
        assert!(out.contains(&set(a, 801, Reason::Grant)), "{out:?}");
        g.reading(at(base, 3), a, res(801));
        let granted = |out: &[Decision]| {
            out.iter().any(|d| {
                matches!(
                    d,
                    Decision::SetLimit {
                        reason: Reason::Grant,
                        ..
                    }
                )
            })
        };
        assert!(!granted(&g.request(at(base, 4), a, 250 * M)));
        assert!(!granted(&g.request(at(base, 5), b, 100 * M)));
        assert_eq!(queued(&g, at(base, 5)), vec![a, b]);
        // Its owner offloads it (its command over, idle): nothing of it is resident, 801
        // MiB reserved. Its request goes, its reservation is taken back, and b is granted.
        g.reading(at(base, 6), a, res(0));
        let out = g.state(at(base, 7), a, VmState::Offloaded);
        assert!(out.contains(&set(a, 0, Reason::Revoke)), "{out:?}");
        assert!(
            out.iter().any(
                |d| matches!(d, Decision::SetLimit { vm, reason: Reason::Grant, .. } if *vm == b)
            ),
            "{out:?}"
        );
        assert!(queued(&g, at(base, 7)).is_empty());
    }

    #[test]
    fn governor_an_owner_offload_lowers_the_limit_so_the_vm_coming_back_is_granted() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let a = vm(&mut g, base, "a", 1, VmState::Running);
        let b = vm(&mut g, at(base, 1), "b", 300, VmState::Running);
        assert!(g
            .request(at(base, 2), a, 499 * M)
            .contains(&set(a, 500, Reason::Grant)));
        g.reading(at(base, 3), a, res(500));
        // Its owner offloads it (a pause, or the daemon's idle offload: no order out). The VM
        // lowers its own limit as it reports; so does the governor's record.
        let out = g.offloaded(at(base, 4), a, 0, true);
        assert_eq!(out, vec![set(a, 0, Reason::Offloaded)]);
        g.state(at(base, 5), a, VmState::Offloaded);
        assert_eq!(limit(&g, at(base, 5), a), Some(0));
        // It resumes and asks for what it held: 300 of b and 500 fit under 900. Charged its
        // old 500 MiB as well, it sat at the queue's head, granted nothing.
        g.state(at(base, 6), a, VmState::Running);
        let out = g.request(at(base, 7), a, 500 * M);
        assert!(out.contains(&set(a, 500, Reason::Grant)), "{out:?}");
        assert_eq!(limit(&g, at(base, 7), b), Some(300 * M));
        assert_eq!(g.status(at(base, 7)).events.orders_done, 0);
    }

    #[test]
    fn governor_idle_vm_keeps_its_reservation_when_a_younger_vm_joins() {
        let base = Instant::now();
        let mut g = Governor::new(Config {
            initial_limit: 400 * M,
            ..config()
        });
        let (a, _) = g.join(base, "a".into(), 512 * M, res(1));
        g.state(base, a, VmState::Idle);
        let (_b, _) = g.join(at(base, 1), "b".into(), 512 * M, res(1));
        // 800 + 400 > 900: c waits; a's room (idle, about to run) is not taken for it.
        let (c, out) = g.join(at(base, 2), "c".into(), 512 * M, res(1));
        assert_eq!(out[0], set(c, 1, Reason::Queued));
        assert!(
            !out.iter().any(|d| matches!(
                d,
                Decision::SetLimit { vm, reason: Reason::Revoke, .. } if *vm == a
            )),
            "{out:?}"
        );
        assert_eq!(limit(&g, at(base, 2), a), Some(400 * M));
    }

    #[test]
    fn governor_a_small_request_never_overtakes_the_head() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let a = vm(&mut g, base, "a", 300, VmState::Running);
        let b = vm(&mut g, base, "b", 300, VmState::Running);
        let w = vm(&mut g, base, "w", 200, waiting(Some(30)));
        // 800 projected: a's 200 does not fit under 900; w is offloaded to make room.
        let out = g.request(at(base, 1), a, 200 * M);
        assert_eq!(
            out,
            vec![Decision::Offload {
                vm: w,
                reason: Reason::MakeRoom
            }]
        );
        // b's 16 would fit, but a is first.
        assert!(g.request(at(base, 2), b, M).is_empty());
        let out = g.offloaded(at(base, 3), w, 4 * M, true);
        assert_eq!(
            out,
            vec![
                set(w, 4, Reason::Offloaded),
                set(a, 500, Reason::Grant),
                set(b, 316, Reason::Grant)
            ]
        );
        assert_eq!(g.status(at(base, 3)).decisions.grant, 2);
    }

    #[test]
    fn governor_grant_back_from_offload_extends_to_learned_peak_where_it_fits() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let a = vm(&mut g, base, "a", 300, waiting(Some(30)));
        let big = vm(&mut g, base, "big", 400, VmState::Running);
        let over = total(950);
        let offload = Decision::Offload {
            vm: a,
            reason: Reason::OverWatermark,
        };
        assert_eq!(g.tick(base, over), vec![offload]);
        assert_eq!(
            g.offloaded(at(base, 1), a, 4 * M, true),
            vec![set(a, 4, Reason::Offloaded)]
        );
        assert_eq!(limit(&g, base, a), Some(4 * M));
        // Its answer arrives; it faults: 404 projected, room for its whole peak (296 more).
        g.state(at(base, 2), a, VmState::Running);
        assert_eq!(
            g.request(at(base, 2), a, M),
            vec![set(a, 300, Reason::Grant)]
        );
        // Again, with less room: the extension stops at the high watermark.
        g.reading(at(base, 3), a, res(300));
        g.state(at(base, 3), a, waiting(Some(30)));
        assert_eq!(g.tick(at(base, 4), over), vec![offload]);
        assert_eq!(
            g.offloaded(at(base, 5), a, 4 * M, true),
            vec![set(a, 4, Reason::Offloaded)]
        );
        g.reading(at(base, 5), big, res(700));
        g.state(at(base, 6), a, VmState::Running);
        assert_eq!(
            g.request(at(base, 6), a, M),
            vec![set(a, 200, Reason::Grant)]
        );
        assert_eq!(g.projected(), 900 * M);
        // Granted room it has not faulted in yet, it asks again: the extension stops at its
        // peak as a limit (300), not its peak on top of the room granted.
        g.reading(at(base, 7), big, res(100));
        assert_eq!(
            g.request(at(base, 7), a, M),
            vec![set(a, 300, Reason::Grant)]
        );
    }

    #[test]
    fn governor_between_watermarks_no_reclaim_over_high_reclaims_down_to_low() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let w: Vec<VmId> = (0..6)
            .map(|i| vm(&mut g, base, &format!("w{i}"), 100, waiting(Some(60 - i))))
            .collect();
        let offload = |vm| Decision::Offload {
            vm,
            reason: Reason::OverWatermark,
        };
        // 850 measured: between the watermarks, nothing.
        assert!(g.tick(at(base, 1), total(850)).is_empty());
        assert!(!g.status(at(base, 1)).reclaiming);
        // 950: over high: 150 to free, two offloads of ~96.
        assert_eq!(
            g.tick(at(base, 2), total(950)),
            vec![offload(w[0]), offload(w[1])]
        );
        // The first freed only 50: 900 less the 96 still expected is over low: the reclaim
        // goes on, between the watermarks, down to the low one.
        assert_eq!(
            g.offloaded(at(base, 3), w[0], 50 * M, true),
            vec![set(w[0], 50, Reason::Offloaded), offload(w[2])]
        );
        assert_eq!(
            g.offloaded(at(base, 4), w[1], 4 * M, true),
            vec![set(w[1], 4, Reason::Offloaded)]
        );
        assert!(g.status(at(base, 4)).reclaiming);
        assert_eq!(
            g.offloaded(at(base, 5), w[2], 4 * M, true),
            vec![set(w[2], 4, Reason::Offloaded)]
        );
        // Under low: done; back between the watermarks: still nothing.
        assert!(!g.status(at(base, 5)).reclaiming);
        assert!(g.tick(at(base, 6), total(790)).is_empty());
        assert!(g.tick(at(base, 7), total(890)).is_empty());
        assert!(!g.status(at(base, 7)).reclaiming);
        // Over high again: a new reclaim.
        assert_eq!(
            g.tick(at(base, 8), total(910)),
            vec![offload(w[3]), offload(w[4])]
        );
    }

    #[test]
    fn governor_silent_vm_is_charged_and_never_a_victim_until_it_speaks() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let silent = vm(&mut g, base, "silent", 300, waiting(Some(60)));
        let other = vm(&mut g, base, "other", 300, waiting(Some(5)));
        let later = at(base, 6000);
        g.reading(later, other, res(300));
        let over = total(950);
        let out = g.tick(later, over);
        // The longest wait is silent: the other is ordered instead.
        assert_eq!(
            out,
            vec![Decision::Offload {
                vm: other,
                reason: Reason::OverWatermark
            }]
        );
        let s = g.status(later);
        assert!(!s.vms[0].reachable);
        assert_eq!(s.vms[0].charge, 300 * M);
        assert_eq!(s.events.unreachable, 1);
        // It speaks again: a victim again.
        g.reading(at(base, 6001), silent, res(300));
        let more = total(1300);
        let out = g.tick(at(base, 6002), more);
        assert_eq!(
            out,
            vec![Decision::Offload {
                vm: silent,
                reason: Reason::OverWatermark
            }]
        );
        assert!(g.status(at(base, 6002)).vms[0].reachable);
    }

    #[test]
    fn governor_silent_vm_queued_request_is_dropped() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let a = vm(&mut g, base, "a", 450, VmState::Running);
        let b = vm(&mut g, base, "b", 450, VmState::Running);
        // Nothing to reclaim but b's cold RAM: ordered, so a's request waits.
        let out = g.request(base, a, 20 * M);
        assert!(matches!(out[..], [Decision::ColdCompress { vm, .. }] if vm == b));
        assert_eq!(g.status(base).queue.len(), 1);
        g.reading(at(base, 4000), b, res(450));
        // a is silent past stale_after: its request goes.
        let out = g.offloaded(at(base, 6000), b, 450 * M, true);
        assert!(out.iter().all(|d| d.vm() != a), "{out:?}");
        let s = g.status(at(base, 6000));
        assert!(s.queue.is_empty());
        assert_eq!(s.events.requests_dropped, 1);
        assert_eq!(s.projected, 900 * M);
    }

    #[test]
    fn governor_held_running_vms_the_youngest_behind_the_head_is_preempted() {
        let base = Instant::now();
        let mut g = last_resort_at(0.95);
        let old = vm(&mut g, base, "old", 300, VmState::Running);
        let mid = vm(&mut g, base, "mid", 300, VmState::Running);
        let young = vm(&mut g, base, "young", 280, VmState::Running);
        let cold = |vm| Decision::ColdCompress {
            vm,
            age: Duration::from_millis(500),
            reason: Reason::MakeRoom,
        };
        // 880 projected: the old VM's 100 does not fit; its juniors run, unheld: cold RAM.
        let out = g.request(at(base, 1), old, 100 * M);
        assert_eq!(out, vec![cold(mid), cold(young)]);
        // They cannot (a VM's cold age is its own): refused, and the last resort (980 over
        // 950) does not fit either.
        assert!(g.offloaded(at(base, 2), mid, 300 * M, false).is_empty());
        assert!(g.offloaded(at(base, 3), young, 280 * M, false).is_empty());
        // The young VM is held at its faults too: it is stopped and offloaded (a refused
        // cold compression does not shut out an offload).
        let preempt = |vm| Decision::Offload {
            vm,
            reason: Reason::Preempt,
        };
        // Not while the middle one runs unheld: its step ends in a wait that frees its RAM.
        assert!(g.request(at(base, 4), young, 50 * M).is_empty());
        // The middle one held as well: nothing else will free room.
        assert_eq!(g.request(at(base, 5), mid, 50 * M), vec![preempt(young)]);
        // It reports: its limit is what stays, and the old VM gets its room first.
        let out = g.offloaded(at(base, 6), young, 4 * M, true);
        assert_eq!(out[0], set(young, 4, Reason::Offloaded));
        assert_eq!(out[1], set(old, 400, Reason::Grant));
        let s = g.status(at(base, 6));
        assert_eq!(s.decisions.preempt, 1);
        assert_eq!(s.decisions.offload, 1);
        // The head is never preempted, nor a VM older than it.
        let g2 = {
            let mut g = last_resort_at(0.95);
            let a = vm(&mut g, base, "a", 450, VmState::Running);
            let b = vm(&mut g, base, "b", 450, VmState::Running);
            // b first: a runs unheld, so only its cold RAM is asked for (and refused).
            let out = g.request(at(base, 1), b, 50 * M);
            assert!(
                !out.iter().any(|d| matches!(d, Decision::Offload { .. })),
                "{out:?}"
            );
            g.offloaded(at(base, 1), a, 450 * M, false);
            // Then a: the older, the head; b is preempted, never a.
            let out = g.request(at(base, 2), a, 50 * M);
            assert!(out.iter().any(|d| *d == preempt(b)), "{out:?}");
            assert!(!out.iter().any(|d| *d == preempt(a)), "{out:?}");
            g
        };
        assert_eq!(g2.status(at(base, 2)).decisions.preempt, 1);
        // A VM that runs unheld for longer than the head may wait: the young one goes.
        let mut g = last_resort_at(0.95);
        let old = vm(&mut g, base, "old", 300, VmState::Running);
        let mid = vm(&mut g, base, "mid", 300, VmState::Running);
        let young = vm(&mut g, base, "young", 280, VmState::Running);
        g.request(at(base, 1), old, 100 * M);
        g.offloaded(at(base, 2), mid, 300 * M, false);
        g.offloaded(at(base, 3), young, 280 * M, false);
        assert!(g.request(at(base, 4), young, 50 * M).is_empty());
        assert!(g.tick(at(base, 1000), total(880)).is_empty());
        assert_eq!(g.tick(at(base, 1001), total(880)), vec![preempt(young)]);
    }

    #[test]
    fn governor_a_refused_order_does_not_shut_out_a_vm_that_starts_to_wait() {
        let base = Instant::now();
        // No last resort: nothing but w can make room.
        let mut g = last_resort_at(0.9);
        let w = vm(&mut g, base, "w", 300, VmState::Idle);
        let a = vm(&mut g, base, "a", 550, VmState::Running);
        let offload = Decision::Offload {
            vm: w,
            reason: Reason::MakeRoom,
        };
        assert_eq!(g.request(at(base, 1), a, 100 * M), vec![offload]);
        // Its next command had begun: refused. Not ordered again while it runs.
        assert!(g.offloaded(at(base, 2), w, 300 * M, false).is_empty());
        let out = g.state(at(base, 3), w, VmState::Running);
        assert!(
            !out.iter().any(|d| matches!(d, Decision::Offload { .. })),
            "{out:?}"
        );
        // (Its cold RAM is asked for instead, and refused.)
        g.offloaded(at(base, 3), w, 300 * M, false);
        // It waits for the model: a victim again at once, not after the order timeout.
        assert_eq!(g.state(at(base, 4), w, waiting(Some(5))), vec![offload]);
    }

    #[test]
    fn governor_order_timeout_seeks_the_bytes_from_the_next_victim_only() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let first = vm(&mut g, base, "first", 300, waiting(Some(60)));
        let second = vm(&mut g, base, "second", 300, waiting(Some(30)));
        let _third = vm(&mut g, base, "third", 300, waiting(Some(10)));
        let over = total(950);
        let offload = |vm| Decision::Offload {
            vm,
            reason: Reason::OverWatermark,
        };
        assert_eq!(g.tick(base, over), vec![offload(first)]);
        // All keep talking; first never reports its offload.
        for vm in [first, second, _third] {
            g.reading(at(base, 9000), vm, res(300));
        }
        assert!(g.tick(at(base, 9999), over).is_empty());
        assert_eq!(g.tick(at(base, 10_000), over), vec![offload(second)]);
        let s = g.status(at(base, 10_000));
        assert_eq!(s.events.orders_timed_out, 1);
        assert!(s.vms[0].order.as_ref().is_some_and(|o| o.timed_out));
        // first still has its (timed out) order: not ordered again until it reports.
        g.offloaded(at(base, 10_001), second, 300 * M, false);
        let out = g.tick(at(base, 10_002), over);
        assert!(
            out.iter().all(|d| d.vm() != first && d.vm() != second),
            "{out:?}"
        );
        g.offloaded(at(base, 10_003), first, 300 * M, false);
        assert!(g.status(at(base, 10_003)).vms[0].order.is_none());
        // A failed order: not retried before order_timeout.
        let out = g.tick(at(base, 10_004), over);
        assert!(out.iter().all(|d| d.vm() != first), "{out:?}");
    }

    #[test]
    fn governor_last_resort_grants_the_room_left_where_a_whole_grant_does_not_fit() {
        let base = Instant::now();
        let mut g = last_resort_at(0.95);
        // One VM, running, near the budget: nothing to reclaim; a whole grant (16 MiB) would
        // pass the last resort's 950 MiB, the 1 MiB it asks for does not.
        let a = vm(&mut g, base, "a", 940, VmState::Running);
        // Its cold RAM was asked for first, and freed nothing.
        g.offloaded(base, a, 940 * M, true);
        // All 10 MiB left under 950 at once, not 1 MiB now and the next in a new round.
        let out = g.request(base, a, M);
        assert_eq!(out, vec![set(a, 950, Reason::LastResort)]);
        // What would pass it stays queued.
        assert!(g.request(at(base, 1), a, 20 * M).is_empty());
        assert_eq!(queued(&g, at(base, 1)), vec![a]);
    }

    #[test]
    fn governor_last_resort_grant_when_nothing_moves_never_above_budget() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let a = vm(&mut g, base, "a", 450, VmState::Running);
        let b = vm(&mut g, base, "b", 450, VmState::Running);
        let out = g.request(base, a, 20 * M);
        assert!(matches!(out[..], [Decision::ColdCompress { vm, .. }] if vm == b));
        // The compression freed nothing; b cannot be asked again so soon: last resort.
        let out = g.offloaded(at(base, 1), b, 450 * M, true);
        assert_eq!(out, vec![set(a, 470, Reason::LastResort)]);
        // 920 + 100 would pass the budget: it stays queued.
        let out = g.request(at(base, 2), a, 100 * M);
        assert!(out.is_empty(), "{out:?}");
        let s = g.status(at(base, 2));
        assert_eq!(s.queue.len(), 1);
        assert_eq!(s.decisions.last_resort, 1);
        assert!(s.projected <= s.budget);
        // 80 fits the budget exactly: a last resort, once b's cold age has passed again and it
        // freed nothing.
        let mut g2 = Governor::new(config());
        let a = vm(&mut g2, base, "a", 450, VmState::Running);
        let b = vm(&mut g2, base, "b", 370, VmState::Running);
        g2.reading(base, b, res(470));
        g2.request(base, a, 80 * M);
        let out = g2.offloaded(at(base, 1), b, 470 * M, true);
        assert_eq!(out, vec![set(a, 530, Reason::LastResort)]);
        assert_eq!(g2.projected(), g2.config().budget);
        // With the default reserve the same grant stays queued: 1000 > 950.
        let mut g3 = Governor::new(Config {
            last_resort_watermark: 0.95,
            ..config()
        });
        let a = vm(&mut g3, base, "a", 450, VmState::Running);
        let b = vm(&mut g3, base, "b", 370, VmState::Running);
        g3.reading(base, b, res(470));
        g3.request(base, a, 80 * M);
        assert!(g3.offloaded(at(base, 1), b, 470 * M, true).is_empty());
        assert_eq!(g3.status(at(base, 1)).queue.len(), 1);
        assert_eq!(g3.request(at(base, 2), a, 30 * M), vec![]);
    }

    #[test]
    fn governor_cold_compression_report_lowers_the_limit_to_what_stays_plus_a_grant() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let r = vm(&mut g, base, "r", 500, VmState::Running);
        let out = g.tick(base, total(950));
        assert!(matches!(out[..], [Decision::ColdCompress { vm, .. }] if vm == r));
        let out = g.offloaded(at(base, 1), r, 100 * M, true);
        assert_eq!(out, vec![set(r, 116, Reason::Compressed)]);
        assert_eq!(g.projected(), 116 * M);
    }

    #[test]
    fn governor_pressure_from_psi_a_growing_failcnt_or_a_notification_reclaims() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let w1 = vm(&mut g, base, "w1", 200, waiting(Some(30)));
        let w2 = vm(&mut g, base, "w2", 200, waiting(Some(20)));
        let calm = Pressure {
            psi_some_avg10: Some(5.0),
            failcnt: Some(7),
            ..Pressure::default()
        };
        // 400 projected, well under low: only pressure reclaims.
        assert!(g.tick(base, calm).is_empty());
        let out = g.tick(
            at(base, 1),
            Pressure {
                psi_some_avg10: Some(40.0),
                ..calm
            },
        );
        assert_eq!(
            out,
            vec![Decision::Offload {
                vm: w1,
                reason: Reason::Pressure
            }]
        );
        g.offloaded(at(base, 2), w1, 4 * M, true);
        // The same failcnt: calm.
        assert!(g.tick(at(base, 3), calm).is_empty());
        let out = g.tick(
            at(base, 4),
            Pressure {
                failcnt: Some(8),
                ..calm
            },
        );
        assert_eq!(
            out,
            vec![Decision::Offload {
                vm: w2,
                reason: Reason::Pressure
            }]
        );
        g.offloaded(at(base, 5), w2, 4 * M, true);
        let w3 = vm(&mut g, at(base, 6), "w3", 200, waiting(Some(10)));
        let calm = Pressure {
            failcnt: Some(8),
            ..calm
        };
        assert!(g.tick(at(base, 7), calm).is_empty());
        // A notification of the kernel's: pressure, counted.
        let out = g.tick(
            at(base, 8),
            Pressure {
                notifications: 2,
                ..calm
            },
        );
        assert_eq!(
            out,
            vec![Decision::Offload {
                vm: w3,
                reason: Reason::Pressure
            }]
        );
        assert_eq!(g.status(at(base, 8)).events.pressure_notifications, 2);
    }

    #[test]
    fn governor_status_json_has_the_documented_shape() {
        let base = Instant::now();
        let mut g = Governor::new(config());
        let a = vm(&mut g, base, "agent-a", 850, VmState::Running);
        g.request(at(base, 1500), a, 200 * M);
        let json = serde_json::to_value(g.status(at(base, 2000))).expect("serializes");
        for key in [
            "budget",
            "high_watermark",
            "low_watermark",
            "high_bytes",
            "low_bytes",
            "projected",
            "measured",
            "usage",
            "reclaiming",
            "queue",
            "vms",
            "decisions",
            "events",
            "log",
        ] {
            assert!(json.get(key).is_some(), "no {key} in {json}");
        }
        assert_eq!(json["budget"], 1000 * M);
        assert_eq!(json["queue"][0]["name"], "agent-a");
        assert_eq!(json["queue"][0]["kind"], "grant");
        assert_eq!(json["queue"][0]["waited_ms"], 500);
        let v = &json["vms"][0];
        for key in [
            "name",
            "state",
            "resident",
            "limit",
            "charge",
            "overhead",
            "peak",
            "offloaded_bytes",
            "reachable",
            "order",
            "decisions",
        ] {
            assert!(v.get(key).is_some(), "no {key} in {v}");
        }
        assert_eq!(v["state"], "running");
        assert_eq!(v["decisions"]["join"], 1);
        assert_eq!(json["decisions"]["cold_compress"], 0);
        let log = json["log"].as_array().expect("log lines");
        assert_eq!(log[0], "+0.000s agent-a: limit 850.0 MiB: joined; its initial limit fits under the high watermark");
    }

    #[test]
    fn governor_log_keeps_the_newest_lines() {
        let base = Instant::now();
        let mut g = Governor::new(Config {
            status_log_lines: LOG_LINES + 10,
            ..config()
        });
        for i in 0..300 {
            let (id, _) = g.join(at(base, i), format!("vm{i}"), M, res(0));
            g.leave(id);
        }
        let log = g.status(at(base, 300)).log;
        assert_eq!(log.len(), LOG_LINES);
        assert!(log[0].contains("vm44:"), "{}", log[0]);
        assert!(log[LOG_LINES - 1].contains("vm299:"));
        assert_eq!(g.status(base).decisions.join, 300);
    }

    /// Property-test cases: PROPTEST_CASES, else a small number (the long run is
    /// `PROPTEST_CASES=100000 cargo test --release -p vmm --lib fuzz_governor`).
    fn cases() -> u32 {
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(64)
    }

    /// What the fuzz test knows of the VMs from the events it sent.
    #[derive(Default)]
    struct Seen {
        live: Vec<VmId>,
        resident: BTreeMap<VmId, u64>,
        ordered: std::collections::BTreeSet<VmId>,
    }

    impl Seen {
        /// Checks one answer: no limit below what the VM holds, no second order to a VM
        /// before it reports, no raise that takes projected usage over the budget (or over
        /// the high watermark but for a last resort).
        fn check(&mut self, g: &Governor, out: &[Decision]) -> Result<(), String> {
            let mut raised = false;
            let mut last_resort = false;
            for d in out {
                let vm = d.vm();
                if !self.live.contains(&vm) {
                    return Err(format!("{d:?} for a VM that is not there"));
                }
                match *d {
                    Decision::SetLimit { limit, reason, .. } => {
                        let resident = self.resident.get(&vm).copied().unwrap_or(0);
                        if limit < resident {
                            return Err(format!("{d:?} below its resident {resident}"));
                        }
                        raised |= matches!(
                            reason,
                            Reason::Join | Reason::Admission | Reason::Grant | Reason::LastResort
                        );
                        last_resort |= reason == Reason::LastResort;
                    }
                    Decision::Offload { .. } | Decision::ColdCompress { .. } => {
                        if !self.ordered.insert(vm) {
                            return Err(format!("{d:?}: a second order before a report"));
                        }
                    }
                }
            }
            let status = g.status(Instant::now());
            let charges = status.vms.iter().map(|v| v.charge).sum::<u64>();
            if charges != status.projected {
                return Err(format!(
                    "projected {} is not the sum of charges {charges}",
                    status.projected
                ));
            }
            if raised && status.projected > status.budget {
                return Err(format!(
                    "{out:?} took projected usage to {} over the budget",
                    status.projected
                ));
            }
            if raised && !last_resort && status.projected > status.high_bytes {
                return Err(format!(
                    "{out:?} took projected usage to {} over the high watermark",
                    status.projected
                ));
            }
            Ok(())
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(cases()))]

        /// Whatever the VMs and the host say, in any order: no grant takes projected usage
        /// over the budget, no limit goes below a VM's resident, no VM gets a second order
        /// before it reports the first.
        #[test]
        fn fuzz_governor_any_events_keep_the_budget_residents_and_one_order_per_vm(
            steps in proptest::collection::vec(
                (0u8..9, 0usize..8, 0u64..700, 0u64..101, proptest::bool::ANY),
                1..150,
            )
        ) {
            let base = Instant::now();
            let mut g = Governor::new(Config {
                budget: 1000 * M,
                initial_limit: 64 * M,
                default_overhead: 24 * M,
                ..Config::default()
            });
            let mut seen = Seen::default();
            let mut now = base;
            let mut failcnt = 0;
            for (op, pick, a, b, flag) in steps {
                now += Duration::from_millis(b * 10);
                let vm = (!seen.live.is_empty()).then(|| seen.live[pick % seen.live.len()]);
                let out = match (op, vm) {
                    (0, _) | (_, None) => {
                        let reading = Reading { cgroup: flag.then_some((a + b) * M), ..res(a) };
                        let (id, out) = g.join(now, format!("vm{}", seen.live.len()), 1024 * M, reading);
                        seen.live.push(id);
                        seen.resident.insert(id, a * M);
                        out
                    }
                    (1, Some(vm)) => {
                        g.leave(vm);
                        seen.live.retain(|&v| v != vm);
                        seen.ordered.remove(&vm);
                        Vec::new()
                    }
                    (2, Some(vm)) => {
                        let state = match a % 4 {
                            0 => VmState::Running,
                            1 => waiting(flag.then_some(b)),
                            2 => VmState::Idle,
                            _ => VmState::Offloaded,
                        };
                        g.state(now, vm, state)
                    }
                    (3, Some(vm)) => {
                        let held = if flag { b * M } else { 0 };
                        g.reading(now, vm, Reading { cgroup: flag.then_some((a + b) * M), held, ..res(a) });
                        seen.resident.insert(vm, a * M);
                        Vec::new()
                    }
                    (4, Some(vm)) => g.request(now, vm, a * M),
                    (5, Some(vm)) => {
                        let after = seen.resident.get(&vm).copied().unwrap_or(0) / 100 * b;
                        seen.resident.insert(vm, after);
                        seen.ordered.remove(&vm);
                        g.offloaded(now, vm, after, flag)
                    }
                    (6, _) => {
                        failcnt += u64::from(flag);
                        g.tick(now, Pressure {
                            total_usage: (a > 100).then_some(a * 2 * M),
                            psi_some_avg10: Some(b as f64 / 2.0),
                            failcnt: Some(failcnt),
                            notifications: u64::from(flag && a % 3 == 0),
                        })
                    }
                    (7, _) => {
                        now += Duration::from_millis(a * 20);
                        g.tick(now, Pressure::default())
                    }
                    (_, Some(vm)) => g.request(now, vm, M),
                };
                let checked = seen.check(&g, &out);
                proptest::prop_assert!(checked.is_ok(), "{}", checked.err().unwrap_or_default());
            }
        }
    }
}
