//! The wait coordinator's policy (issue 7): when a VM's agent waits for the model, pause the
//! VM, then offload it, and bring it back when the answer is there, a guest timer falls due, or
//! something else needs it.
//!
//! This is the decision part only, a state machine over explicit time: it is fed events
//! (`WaitEvent`: a request went out, its data is ready, the guest reported idle, a manual
//! suspend or resume, an external event) and asked what is due (`tick`), and it answers with
//! `Action`s for the VMM to carry out. Keeping it free of clocks, threads and I/O makes every
//! rule testable with a fake clock; the sources of events (a model gateway, later downloads or
//! file reads) sit behind [`EventSource`].
//!
//! Rules (all durations in [`WaitPolicy`]):
//! - a request's wait starts at `WaitStart`; once some request has waited `pause_after` and the
//!   guest has been idle as long, the VM is paused;
//! - `offload_after` from that same moment (a wait with an idle guest), it is offloaded, if the
//!   strategy allows,
//!   if the guest's next timer is at least `min_timer_budget` away (or none is pending), if
//!   the last offload is at least `offload_cooldown` ago, and if the wait is expected to last
//!   long enough to pay for it: its expected remaining time at least `break_even` times what
//!   this VM's offloads have taken (see [`WaitCoordinator::expected_remaining`]). An offload
//!   that does not pay yet is looked at again while the wait goes on;
//! - when the first bytes of a waited-for request's answer arrive while the VM is offloaded,
//!   its recorded working set starts coming back (`warm`, if the policy allows) while it still
//!   waits, so that the guest finds it resident when the answer is delivered: timed to be done
//!   as the answer ends (see [`WaitCoordinator::warm_due`]), not earlier, since the memory is
//!   charged from then on;
//! - a batch of a streamed answer resumes it and is delivered; the request goes on waiting
//!   (and the guest, idle again, is paused and offloaded again as the rules say);
//! - it is resumed when a waited-for request's data is ready (then the data is delivered),
//!   when a guest timer falls due, or on an external event; a request may see several pause
//!   and resume cycles;
//! - a manual suspend owns the VM: the coordinator does nothing until the manual resume, and
//!   data that arrives meanwhile is delivered after it, in order;
//! - events of another VM epoch (the VM was restarted or restored since) and data for a request
//!   that is not waiting (already delivered, or never sent) are ignored: each response is
//!   delivered exactly once.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

mod policy;

/// How many of a VM's past waits predict its next one.
const WAIT_HISTORY: usize = 32;

/// A batch delivered later than this after it became deliverable is counted late (issue 38's
/// target).
pub const BATCH_LATE: Duration = Duration::from_millis(20);

pub use policy::{Sources, WaitPolicy};

/// What the coordinator learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEvent {
    /// The guest sent request `request` and now waits for it.
    WaitStart {
        /// The request's id.
        request: u64,
        /// The VM epoch it was sent in.
        epoch: u64,
    },
    /// The first bytes of `request`'s answer have arrived (the rest is streaming in).
    DataArriving {
        /// The request's id.
        request: u64,
        /// The VM epoch it belongs to.
        epoch: u64,
    },
    /// A batch of `request`'s answer is ready to deliver; the rest is still to come (the
    /// request goes on waiting).
    BatchReady {
        /// The request's id.
        request: u64,
        /// The VM epoch it belongs to.
        epoch: u64,
    },
    /// The data of `request` is ready to deliver.
    DataReady {
        /// The request's id.
        request: u64,
        /// The VM epoch it belongs to.
        epoch: u64,
    },
    /// The guest reported idle; its next timer falls due at `timer_due`, if it has one.
    GuestIdle {
        /// The VM epoch.
        epoch: u64,
        /// When the guest's next timer fires.
        timer_due: Option<Instant>,
    },
    /// The guest is running something (not idle).
    GuestBusy {
        /// The VM epoch.
        epoch: u64,
    },
    /// An operator suspended the VM (`pvisor suspend`): it is theirs until they resume it.
    ManualSuspend,
    /// An operator resumed the VM.
    ManualResume,
    /// Something else needs the VM running (a signal, a host request).
    External,
    /// The host's memory governor needs this VM's memory back now (the budget binds): a VM
    /// waiting with its guest idle offloads at once, the cooldown, the break-even and the
    /// guest's timer budget overridden (the governor has weighed the cost). Anything else
    /// (running, already offloaded, an operator's) is left as it is.
    Reclaim,
}

/// What the VMM is to do, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Stop the vCPUs; RAM stays.
    Pause,
    /// Offload the paused VM's RAM.
    Offload,
    /// Start bringing the offloaded VM's recorded working set back; it stays stopped.
    Warm,
    /// Resume (loading RAM back if it was offloaded).
    Resume,
    /// Hand the data of `request` to the guest.
    Deliver {
        /// The request's id.
        request: u64,
    },
}

/// Where the coordinator believes the VM is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Running.
    Running,
    /// Paused by the coordinator.
    Paused,
    /// Offloaded by the coordinator.
    Offloaded,
    /// Suspended by an operator: not the coordinator's to touch.
    Manual,
}

/// Where wait events come from: the model gateway now, downloads and file reads later.
pub trait EventSource: Send {
    /// Events that arrived since the last call, oldest first.
    fn poll(&mut self) -> Vec<WaitEvent>;
}

/// The coordinator's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct WaitStats {
    /// Pauses it made.
    pub pauses: u64,
    /// Offloads it made.
    pub offloads: u64,
    /// Resumes it made.
    pub resumes: u64,
    /// Responses delivered.
    pub delivered: u64,
    /// Warm-ups started: an offloaded VM's working set brought back as its answer arrived.
    pub warms: u64,
    /// Batches of streamed answers delivered before their ends.
    pub batches: u64,
    /// Microseconds from the moments batches became deliverable (by size or by time) to
    /// their being in the guest's buffer, summed (with `batches`: the mean).
    pub batch_delay_us: u64,
    /// Batches delivered more than [`BATCH_LATE`] after they became deliverable.
    pub batches_late: u64,
    /// Events ignored as stale (another epoch, or a request not waiting).
    pub stale: u64,
    /// Offloads skipped: the guest's timer was too close.
    pub skipped_for_timer: u64,
    /// Offloads skipped: the last one was too recent.
    pub skipped_for_cooldown: u64,
    /// Offloads skipped: the wait was not expected to last long enough to pay for one.
    pub skipped_for_gain: u64,
    /// Offloads that failed (RAM stayed resident).
    pub failed_offloads: u64,
    /// Loads after an offload that failed.
    pub failed_loads: u64,
    /// Offloads the host's memory governor asked for (counted in `offloads` too).
    pub reclaims: u64,
    /// Milliseconds the offloads took, in all.
    pub offload_ms: u64,
    /// What the next offload is expected to take (the moving average), milliseconds.
    pub offload_cost_ms: u64,
}

/// Where an offload's warm-up is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Warm {
    /// None yet.
    Idle,
    /// Due then (the answer has begun to arrive).
    Due(Instant),
    /// Started: the working set is coming back.
    Started,
}

/// Keeps `value` as the newest of a history of at most [`WAIT_HISTORY`].
fn remember<T>(history: &mut VecDeque<T>, value: T) {
    if history.len() == WAIT_HISTORY {
        history.pop_front();
    }
    history.push_back(value);
}

/// One VM's coordinator.
#[derive(Debug, Clone)]
pub struct WaitCoordinator {
    policy: WaitPolicy,
    epoch: u64,
    phase: Phase,
    /// Requests waited for, by id, with when their wait began.
    waiting: BTreeMap<u64, Instant>,
    /// Data ready while an operator holds the VM, in arrival order.
    held: Vec<u64>,
    idle_since: Option<Instant>,
    timer_due: Option<Instant>,
    last_offload: Option<Instant>,
    /// An offload was considered and skipped in this pause (counted once).
    skipped: bool,
    /// After a skip for gain: when to look again.
    recheck: Option<Instant>,
    /// The guest's timer is too close for an offload in this pause: nothing to look at until
    /// the guest reports again or runs.
    timer_blocked: bool,
    /// This offload's warm-up (one per offload).
    warm: Warm,
    /// When the answers of requests waited for began to arrive, and how long they had been
    /// waited for then.
    arriving: BTreeMap<u64, (Instant, Duration)>,
    /// How long this VM's last answers took from their first bytes to their last, over how
    /// long their first bytes took: oldest first.
    streams: VecDeque<f64>,
    /// The lengths of this VM's last waits, oldest first.
    waits: VecDeque<Duration>,
    /// What its offloads take (a moving average of the durations reported).
    offload_cost: Option<Duration>,
    /// Requests whose source estimates their wait (a download: from the bytes left and the
    /// rate seen), with its latest estimate (when made, what was left then) if it has one:
    /// used instead of this VM's past waits, and their ends kept out of them.
    estimates: BTreeMap<u64, Option<(Instant, Duration)>>,
    stats: WaitStats,
}

impl WaitCoordinator {
    /// A coordinator for a running VM in `epoch`.
    pub fn new(policy: WaitPolicy, epoch: u64) -> Self {
        Self {
            policy,
            epoch,
            phase: Phase::Running,
            waiting: BTreeMap::new(),
            held: Vec::new(),
            idle_since: None,
            timer_due: None,
            last_offload: None,
            skipped: false,
            recheck: None,
            timer_blocked: false,
            warm: Warm::Idle,
            arriving: BTreeMap::new(),
            streams: VecDeque::with_capacity(WAIT_HISTORY),
            waits: VecDeque::with_capacity(WAIT_HISTORY),
            offload_cost: None,
            estimates: BTreeMap::new(),
            stats: WaitStats::default(),
        }
    }

    /// The source of `request` expects its wait to last `left` more from `now` (`None`: it
    /// cannot tell yet). From then on the request's wait is judged by its source's estimate,
    /// not by this VM's past waits, and its end is not counted among them (a download's wait
    /// for its next chunk says nothing of a model's).
    pub fn expect(&mut self, now: Instant, request: u64, left: Option<Duration>) {
        self.estimates.insert(request, left.map(|left| (now, left)));
    }

    /// `request` was given up (its command ended without its data): it is waited for no
    /// more, and its data, should any come, is stale.
    pub fn forget(&mut self, request: u64) {
        self.waiting.remove(&request);
        self.arriving.remove(&request);
        self.estimates.remove(&request);
    }

    /// What the source of `request` expects to be left of its wait at `now`: `None` if it
    /// gives no estimate, `Some(None)` if it cannot tell yet.
    fn estimated(&self, request: u64, now: Instant) -> Option<Option<Duration>> {
        let estimate = self.estimates.get(&request)?;
        Some(estimate.map(|(at, left)| left.saturating_sub(now.saturating_duration_since(at))))
    }

    /// The VMM reports that a batch reached the guest `delay` after it became deliverable.
    pub fn batch_delivered(&mut self, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.stats.batch_delay_us = self.stats.batch_delay_us.saturating_add(us);
        if delay > BATCH_LATE {
            self.stats.batches_late += 1;
        }
    }

    /// The VMM reports how long an offload took (from the decision until the RAM was given
    /// back): what the next ones are expected to cost.
    pub fn offload_took(&mut self, took: Duration) {
        self.stats.offload_ms += u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
        self.offload_cost = Some(match self.offload_cost {
            // A moving average that follows a change of load within a few offloads.
            Some(cost) => (cost * 3 + took) / 4,
            None => took,
        });
        self.stats.offload_cost_ms = self
            .offload_cost
            .map_or(0, |c| u64::try_from(c.as_millis()).unwrap_or(u64::MAX));
    }

    /// How much longer a wait that has lasted `elapsed` is expected to go on, from this VM's
    /// past waits: the median of what the longer ones had left at `elapsed`. A wait longer
    /// than every one seen is expected to go on about as long again (the longer a wait has
    /// lasted, the longer it tends to last); `None` before any wait has ended.
    pub fn expected_remaining(&self, elapsed: Duration) -> Option<Duration> {
        if self.waits.is_empty() {
            return None;
        }
        let mut left: Vec<Duration> = self
            .waits
            .iter()
            .filter(|&&w| w > elapsed)
            .map(|&w| w - elapsed)
            .collect();
        if left.is_empty() {
            return Some(elapsed);
        }
        left.sort_unstable();
        Some(left[left.len() / 2])
    }

    /// How long after an answer's first bytes, which came `first` into its wait, its warm-up
    /// is due: so that it is done as the answer ends. The answer is expected to stream for
    /// `first` times the median ratio of this VM's last answers (first byte to last, over
    /// the wait for the first byte: a model that thinks longer tends to say more); the
    /// warm-up to take about what an offload takes (the same blocks, read instead of
    /// written), with a margin of as much again. At once while there is nothing to go by.
    pub fn warm_due(&self, first: Duration) -> Duration {
        let (Some(cost), false) = (self.offload_cost, self.streams.is_empty()) else {
            return Duration::ZERO;
        };
        let mut ratios: Vec<f64> = self.streams.iter().copied().collect();
        ratios.sort_unstable_by(f64::total_cmp);
        let ratio = ratios[ratios.len() / 2];
        first
            .mul_f64(ratio.clamp(0.0, 1000.0))
            .saturating_sub(cost * 2)
    }

    /// Whether an offload at `now`, `elapsed` into the request's wait, is expected to pay
    /// (until the answer, or the guest's timer if that comes first); if not, when to look
    /// again.
    fn pays(&self, now: Instant, elapsed: Duration) -> Result<(), Instant> {
        let oldest = self
            .waiting
            .iter()
            .min_by_key(|&(_, &began)| began)
            .map(|(&request, _)| request);
        let expected = match oldest.and_then(|request| self.estimated(request, now)) {
            Some(estimate) => estimate,
            None => self.expected_remaining(elapsed),
        };
        let (Some(cost), Some(mut left)) = (self.offload_cost, expected) else {
            // Nothing to go by yet: the first offload measures the cost.
            return Ok(());
        };
        // The guest's timer brings the VM back before the answer may.
        if let Some(timer) = self.timer_due {
            left = left.min(timer.saturating_duration_since(now));
        }
        if left.as_secs_f64() >= self.policy.break_even * cost.as_secs_f64() {
            Ok(())
        } else {
            // The expectation grows as the wait outlasts the ones seen: look again an
            // offload's time later (at least the offload delay, at most a second).
            let step = cost.clamp(
                self.policy.offload_after.max(Duration::from_millis(1)),
                Duration::from_secs(1).max(self.policy.offload_after),
            );
            Err(now + step)
        }
    }

    /// Where it believes the VM is.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The counters.
    pub fn stats(&self) -> WaitStats {
        self.stats
    }

    /// The VM was restarted or restored: a new epoch, nothing waited for.
    pub fn new_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.waiting.clear();
        self.estimates.clear();
        self.held.clear();
        self.idle_since = None;
        self.timer_due = None;
        self.arriving.clear();
        // A warm-up under way stays counted for this offload.
        if let Warm::Due(_) = self.warm {
            self.warm = Warm::Idle;
        }
    }

    fn current(&mut self, epoch: u64) -> bool {
        let current = epoch == self.epoch;
        if !current {
            self.stats.stale += 1;
        }
        current
    }

    /// A new pause starts its offload bookkeeping afresh.
    fn forget_skips(&mut self) {
        self.skipped = false;
        self.recheck = None;
        self.timer_blocked = false;
        self.warm = Warm::Idle;
    }

    fn resume(&mut self, out: &mut Vec<Action>) {
        if matches!(self.phase, Phase::Paused | Phase::Offloaded) {
            out.push(Action::Resume);
            self.stats.resumes += 1;
            self.phase = Phase::Running;
            self.forget_skips();
            // The guest runs again: its idleness is to be reported anew.
            self.idle_since = None;
        }
    }

    /// Takes an event at `now`; returns what to do at once.
    pub fn handle(&mut self, now: Instant, event: WaitEvent) -> Vec<Action> {
        let mut out = Vec::new();
        match event {
            WaitEvent::WaitStart { request, epoch } => {
                if self.current(epoch) {
                    self.waiting.entry(request).or_insert(now);
                }
            }
            WaitEvent::DataArriving { request, epoch } => {
                // Only for a request still waited for, once per offload, and never while an
                // operator holds the VM (its RAM is theirs to bring back).
                if !self.current(epoch) {
                    return out;
                }
                let Some(&began) = self.waiting.get(&request) else {
                    return out;
                };
                let waited = now.saturating_duration_since(began);
                self.arriving.entry(request).or_insert((now, waited));
                if self.phase == Phase::Offloaded && self.policy.warm && self.warm == Warm::Idle {
                    // Done as the data is due: by its source's estimate, if it gives one.
                    let due = match self.estimated(request, now) {
                        Some(left) => left
                            .unwrap_or_default()
                            .saturating_sub(self.offload_cost.unwrap_or_default() * 2),
                        None => self.warm_due(waited),
                    };
                    self.warm = Warm::Due(now + due);
                }
            }
            WaitEvent::BatchReady { request, epoch } => {
                // The guest takes it and comes back for the rest; an operator's VM takes
                // none (its answer waits for their resume, whole).
                if !(self.current(epoch) && self.waiting.contains_key(&request)) {
                    if epoch == self.epoch {
                        self.stats.stale += 1;
                    }
                    return out;
                }
                if self.phase != Phase::Manual {
                    self.resume(&mut out);
                    out.push(Action::Deliver { request });
                    self.stats.batches += 1;
                }
                return out;
            }
            WaitEvent::DataReady { request, epoch } => {
                let began = if self.current(epoch) {
                    self.waiting.remove(&request)
                } else {
                    None
                };
                let Some(began) = began else {
                    if epoch == self.epoch {
                        self.stats.stale += 1;
                    }
                    return out;
                };
                let estimated = self.estimates.remove(&request).is_some();
                if !estimated {
                    remember(&mut self.waits, now.saturating_duration_since(began));
                }
                if let Some((arrived, first)) = self.arriving.remove(&request) {
                    if !first.is_zero() && !estimated {
                        let stream = now.saturating_duration_since(arrived);
                        remember(
                            &mut self.streams,
                            stream.as_secs_f64() / first.as_secs_f64(),
                        );
                    }
                }
                if self.phase == Phase::Manual {
                    self.held.push(request);
                    return out;
                }
                self.resume(&mut out);
                out.push(Action::Deliver { request });
                self.stats.delivered += 1;
            }
            WaitEvent::GuestIdle { epoch, timer_due } => {
                if self.current(epoch) {
                    self.idle_since.get_or_insert(now);
                    if self.timer_due != timer_due {
                        self.timer_blocked = false;
                    }
                    self.timer_due = timer_due;
                }
            }
            WaitEvent::GuestBusy { epoch } => {
                if self.current(epoch) {
                    self.idle_since = None;
                }
            }
            WaitEvent::ManualSuspend => {
                self.phase = Phase::Manual;
                self.forget_skips();
            }
            WaitEvent::ManualResume => {
                if self.phase == Phase::Manual {
                    self.phase = Phase::Running;
                    self.forget_skips();
                    self.idle_since = None;
                    for request in std::mem::take(&mut self.held) {
                        out.push(Action::Deliver { request });
                        self.stats.delivered += 1;
                    }
                }
            }
            WaitEvent::External => self.resume(&mut out),
            WaitEvent::Reclaim => {
                let idle_wait = self.wait_began().is_some();
                if idle_wait && matches!(self.phase, Phase::Running | Phase::Paused) {
                    if self.phase == Phase::Running {
                        out.push(Action::Pause);
                        self.stats.pauses += 1;
                    }
                    out.push(Action::Offload);
                    self.stats.offloads += 1;
                    self.stats.reclaims += 1;
                    self.phase = Phase::Offloaded;
                    self.last_offload = Some(now);
                    self.recheck = None;
                }
                return out;
            }
        }
        out.extend(self.tick(now));
        out
    }

    /// Since when some request has been waited for with an idle guest: the moment the pause
    /// and offload delays count from.
    fn wait_began(&self) -> Option<Instant> {
        let began = self.waiting.values().min().copied()?;
        Some(began.max(self.idle_since?))
    }

    /// When a pause is due, if one is to come.
    fn pause_due(&self) -> Option<Instant> {
        if self.phase != Phase::Running {
            return None;
        }
        Some(self.wait_began()? + self.policy.pause_after)
    }

    /// When the coordinator next looks at offloading in this pause: `offload_after` into the
    /// wait (where it offloads or records why not), then, if the cooldown stopped it, when the
    /// cooldown ends; never while only a resume (the guest's timer) can lift the block.
    fn offload_due(&self) -> Option<Instant> {
        if self.phase != Phase::Paused || !self.policy.offload {
            return None;
        }
        let first = self.wait_began()? + self.policy.offload_after;
        if !self.skipped {
            return Some(first);
        }
        if self.timer_blocked {
            // Only the guest (a new report) or a resume for its timer can lift that.
            return None;
        }
        let due = self
            .last_offload
            .map_or(first, |last| first.max(last + self.policy.offload_cooldown))
            .max(self.recheck.unwrap_or(first));
        let timer_blocks = self
            .timer_due
            .is_some_and(|timer| timer < due + self.policy.min_timer_budget);
        (!timer_blocks).then_some(due)
    }

    /// Does what has fallen due by `now`.
    pub fn tick(&mut self, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        if self.phase == Phase::Manual {
            return out;
        }
        // A guest timer falling due needs the guest.
        if let Some(due) = self.timer_due {
            if due <= now && self.phase != Phase::Running {
                self.timer_due = None;
                self.resume(&mut out);
                return out;
            }
        }
        if self.phase == Phase::Offloaded && matches!(self.warm, Warm::Due(due) if due <= now) {
            self.warm = Warm::Started;
            self.stats.warms += 1;
            out.push(Action::Warm);
        }
        if self.pause_due().is_some_and(|due| due <= now) {
            out.push(Action::Pause);
            self.stats.pauses += 1;
            self.phase = Phase::Paused;
        }
        if self.phase == Phase::Paused && self.policy.offload {
            if let Some(began) = self.wait_began() {
                let rechecked = self.recheck.is_none_or(|at| at <= now);
                if began + self.policy.offload_after <= now && rechecked {
                    let budget_ok = self
                        .timer_due
                        .is_none_or(|due| due >= now + self.policy.min_timer_budget);
                    let cooled = self
                        .last_offload
                        .is_none_or(|last| last + self.policy.offload_cooldown <= now);
                    // How long the request has waited, across the guest's timer runs.
                    let requested = self.waiting.values().min().copied().unwrap_or(began);
                    let pays = self.pays(now, now.saturating_duration_since(requested));
                    if budget_ok && cooled && pays.is_ok() {
                        out.push(Action::Offload);
                        self.stats.offloads += 1;
                        self.phase = Phase::Offloaded;
                        self.last_offload = Some(now);
                        self.recheck = None;
                    } else {
                        if let Err(again) = pays {
                            self.recheck = Some(again);
                        }
                        self.timer_blocked = !budget_ok;
                        if !self.skipped {
                            self.skipped = true;
                            if !budget_ok {
                                self.stats.skipped_for_timer += 1;
                            } else if !cooled {
                                self.stats.skipped_for_cooldown += 1;
                            } else {
                                self.stats.skipped_for_gain += 1;
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// When [`WaitCoordinator::tick`] next has something to do (`None`: only an event can
    /// change anything).
    pub fn next_deadline(&self) -> Option<Instant> {
        if self.phase == Phase::Manual {
            return None;
        }
        let timer = self.timer_due.filter(|_| self.phase != Phase::Running);
        let offload = self.offload_due();
        let warm = match self.warm {
            Warm::Due(due) if self.phase == Phase::Offloaded => Some(due),
            _ => None,
        };
        [self.pause_due(), offload, timer, warm]
            .into_iter()
            .flatten()
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    /// The guest of `c` reports idle with no timer and waits for `request`, at `t`.
    fn idle_waiting_for(c: &mut WaitCoordinator, t: Instant, request: u64) {
        let idle = WaitEvent::GuestIdle {
            epoch: 1,
            timer_due: None,
        };
        c.handle(t, idle);
        c.handle(t, WaitEvent::WaitStart { request, epoch: 1 });
    }

    fn waiting_idle(base: Instant, policy: WaitPolicy, timer_ms: Option<u64>) -> WaitCoordinator {
        let mut c = WaitCoordinator::new(policy, 1);
        let timer_due = timer_ms.map(|t| at(base, t));
        assert!(c
            .handle(
                base,
                WaitEvent::GuestIdle {
                    epoch: 1,
                    timer_due
                }
            )
            .is_empty());
        assert!(c
            .handle(
                base,
                WaitEvent::WaitStart {
                    request: 7,
                    epoch: 1
                }
            )
            .is_empty());
        c
    }

    /// Request 7's answer at `now` resumes the offloaded VM and is delivered; returns the
    /// event.
    fn answer_resumes_and_delivers(c: &mut WaitCoordinator, now: Instant) -> WaitEvent {
        let ready = WaitEvent::DataReady {
            request: 7,
            epoch: 1,
        };
        assert_eq!(
            c.handle(now, ready),
            vec![Action::Resume, Action::Deliver { request: 7 }]
        );
        ready
    }

    #[test]
    fn wait_pauses_after_20ms_then_offloads_after_50ms() {
        let base = Instant::now();
        let mut c = waiting_idle(base, WaitPolicy::default(), None);
        assert_eq!(c.next_deadline(), Some(at(base, 20)));
        assert!(c.tick(at(base, 19)).is_empty());
        assert_eq!(c.tick(at(base, 20)), vec![Action::Pause]);
        assert_eq!(c.next_deadline(), Some(at(base, 50)));
        assert!(c.tick(at(base, 49)).is_empty());
        assert_eq!(c.tick(at(base, 50)), vec![Action::Offload]);
        assert_eq!(c.phase(), Phase::Offloaded);
        // The answer: resume, then deliver, once.
        let ready = answer_resumes_and_delivers(&mut c, at(base, 900));
        assert!(c.handle(at(base, 901), ready).is_empty());
        assert_eq!(c.stats().delivered, 1);
        assert_eq!(c.stats().stale, 1);
    }

    #[test]
    fn wait_warms_an_offloaded_vm_once_as_its_answer_arrives_and_only_then() {
        let base = Instant::now();
        let arriving = |request| WaitEvent::DataArriving { request, epoch: 1 };
        let mut c = waiting_idle(base, WaitPolicy::default(), None);
        // Running or paused: the RAM is there, nothing to warm.
        assert!(c.handle(at(base, 10), arriving(7)).is_empty());
        assert_eq!(c.tick(at(base, 20)), vec![Action::Pause]);
        assert!(c.handle(at(base, 30), arriving(7)).is_empty());
        assert_eq!(c.tick(at(base, 50)), vec![Action::Offload]);
        // Another request, another epoch: not this wait's answer.
        assert!(c.handle(at(base, 60), arriving(8)).is_empty());
        let old = WaitEvent::DataArriving {
            request: 7,
            epoch: 0,
        };
        assert!(c.handle(at(base, 61), old).is_empty());
        // Its first bytes: the working set starts back, once; the VM stays offloaded.
        assert_eq!(c.handle(at(base, 700), arriving(7)), vec![Action::Warm]);
        assert!(c.handle(at(base, 710), arriving(7)).is_empty());
        assert_eq!(c.phase(), Phase::Offloaded);
        answer_resumes_and_delivers(&mut c, at(base, 900));
        assert_eq!(c.stats().warms, 1);
        // A policy without warm-ups never warms.
        let mut cold = waiting_idle(
            base,
            WaitPolicy {
                warm: false,
                ..WaitPolicy::default()
            },
            None,
        );
        cold.tick(at(base, 20));
        assert_eq!(cold.tick(at(base, 50)), vec![Action::Offload]);
        assert!(cold.handle(at(base, 700), arriving(7)).is_empty());
        // An operator's VM is theirs: its RAM comes back on their resume.
        let mut manual = waiting_idle(base, WaitPolicy::default(), None);
        manual.tick(at(base, 20));
        manual.tick(at(base, 50));
        manual.handle(at(base, 60), WaitEvent::ManualSuspend);
        assert!(manual.handle(at(base, 700), arriving(7)).is_empty());
    }

    #[test]
    fn wait_sources_parse_any_of_the_three_or_all() {
        let all = Sources::default();
        assert_eq!(Sources::parse("all"), Ok(all));
        assert_eq!(Sources::parse("model, read,download"), Ok(all));
        let model = Sources::parse("model").expect("valid");
        assert!(model.model && !model.download && !model.read);
        assert!(Sources::parse("model,disk").is_err());
        assert!(Sources::parse("").is_err());
    }

    #[test]
    fn wait_estimate_of_a_source_replaces_the_history_and_stays_out_of_it() {
        let base = Instant::now();
        let policy = WaitPolicy {
            offload_cooldown: Duration::ZERO,
            ..WaitPolicy::default()
        };
        let mut c = WaitCoordinator::new(policy, 1);
        c.offload_took(Duration::from_millis(100));
        // A long model wait in the history: a wait would be expected to pay.
        c.handle(
            base,
            WaitEvent::WaitStart {
                request: 1,
                epoch: 1,
            },
        );
        c.handle(
            at(base, 10_000),
            WaitEvent::DataReady {
                request: 1,
                epoch: 1,
            },
        );
        // A download's chunk due in 200 ms: less than 4 offloads' cost, so no offload.
        let t = at(base, 20_000);
        idle_waiting_for(&mut c, t, 9);
        c.expect(t, 9, Some(Duration::from_millis(200)));
        c.tick(at(base, 20_020));
        assert!(!c.tick(at(base, 20_050)).contains(&Action::Offload));
        assert_eq!(c.stats().skipped_for_gain, 1);
        // Its end stays out of the history: the next model wait still expects ~10 s.
        c.handle(
            at(base, 20_200),
            WaitEvent::DataReady {
                request: 9,
                epoch: 1,
            },
        );
        assert_eq!(
            c.expected_remaining(Duration::ZERO),
            Some(Duration::from_secs(10))
        );
        // A wait its source cannot tell yet is offloaded as a first wait would be.
        let t = at(base, 30_000);
        idle_waiting_for(&mut c, t, 10);
        c.expect(t, 10, None);
        c.tick(at(base, 30_020));
        assert!(c.tick(at(base, 30_050)).contains(&Action::Offload));
        // Given up: no longer waited for; its data, if it comes, is stale.
        c.forget(10);
        assert!(c
            .handle(
                at(base, 30_100),
                WaitEvent::DataReady {
                    request: 10,
                    epoch: 1
                }
            )
            .is_empty());
    }

    #[test]
    fn wait_warm_up_is_timed_to_end_with_the_answer_once_answers_have_been_seen_streaming() {
        let base = Instant::now();
        let policy = WaitPolicy {
            offload_cooldown: Duration::ZERO,
            break_even: 0.0,
            ..WaitPolicy::default()
        };
        let arriving = WaitEvent::DataArriving {
            request: 7,
            epoch: 1,
        };
        let mut c = waiting_idle(base, policy, None);
        c.tick(at(base, 20));
        assert_eq!(c.tick(at(base, 50)), vec![Action::Offload]);
        c.offload_took(Duration::from_millis(30));
        // The first answer: nothing to go by, so at once. Its first bytes came 600 ms into
        // the wait, its last 400 ms later: two thirds of that.
        assert_eq!(c.handle(at(base, 600), arriving), vec![Action::Warm]);
        answer_resumes_and_delivers(&mut c, at(base, 1000));
        // The next wait, its first bytes 600 ms in again: its answer is expected to stream
        // 400 ms, the warm-up to take 30 ms (an offload's time), with as much again to spare:
        // due 340 ms after the first bytes.
        let next = at(base, 2000);
        c.handle(next, WaitEvent::GuestBusy { epoch: 1 });
        c.handle(
            next,
            WaitEvent::GuestIdle {
                epoch: 1,
                timer_due: None,
            },
        );
        c.handle(
            next,
            WaitEvent::WaitStart {
                request: 7,
                epoch: 1,
            },
        );
        c.tick(next + Duration::from_millis(20));
        assert_eq!(
            c.tick(next + Duration::from_millis(50)),
            vec![Action::Offload]
        );
        c.offload_took(Duration::from_millis(30));
        assert_eq!(
            c.warm_due(Duration::from_millis(600)),
            Duration::from_millis(340)
        );
        // A wait twice as long before its first bytes: twice as long a stream expected.
        assert_eq!(
            c.warm_due(Duration::from_millis(1200)),
            Duration::from_millis(740)
        );
        let first = next + Duration::from_millis(600);
        assert!(c.handle(first, arriving).is_empty());
        assert_eq!(c.next_deadline(), Some(first + Duration::from_millis(340)));
        assert!(c.tick(first + Duration::from_millis(339)).is_empty());
        assert_eq!(
            c.tick(first + Duration::from_millis(340)),
            vec![Action::Warm]
        );
        assert!(c.tick(first + Duration::from_millis(380)).is_empty());
        assert_eq!(c.stats().warms, 2);
        // An answer that ends before its warm-up was due: resumed and delivered, no warm-up.
        let mut early = c.clone();
        early.warm = Warm::Due(first + Duration::from_millis(340));
        answer_resumes_and_delivers(&mut early, first + Duration::from_millis(100));
        assert!(early.tick(first + Duration::from_millis(400)).is_empty());
        assert_eq!(early.stats().warms, 2);
    }

    #[test]
    fn wait_with_a_busy_guest_does_not_pause() {
        let base = Instant::now();
        let mut c = waiting_idle(base, WaitPolicy::default(), None);
        c.handle(at(base, 5), WaitEvent::GuestBusy { epoch: 1 });
        assert!(c.tick(at(base, 100)).is_empty());
        assert_eq!(c.next_deadline(), None);
        // Idle again: 20 ms from then.
        c.handle(
            at(base, 100),
            WaitEvent::GuestIdle {
                epoch: 1,
                timer_due: None,
            },
        );
        assert!(c.tick(at(base, 119)).is_empty());
        assert_eq!(c.tick(at(base, 120)), vec![Action::Pause]);
    }

    #[test]
    fn wait_near_a_guest_timer_pauses_but_does_not_offload_and_resumes_for_it() {
        let base = Instant::now();
        // The timer fires 600 ms in: less than 1 s of budget at 50 ms.
        let mut c = waiting_idle(base, WaitPolicy::default(), Some(600));
        assert_eq!(c.tick(at(base, 20)), vec![Action::Pause]);
        assert!(c.tick(at(base, 50)).is_empty());
        assert_eq!(c.stats().skipped_for_timer, 1);
        assert_eq!(c.next_deadline(), Some(at(base, 600)));
        assert_eq!(c.tick(at(base, 600)), vec![Action::Resume]);
        // The request still waits: the guest idles again, so another cycle.
        c.handle(
            at(base, 610),
            WaitEvent::GuestIdle {
                epoch: 1,
                timer_due: None,
            },
        );
        assert_eq!(c.tick(at(base, 630)), vec![Action::Pause]);
        assert_eq!(c.tick(at(base, 660)), vec![Action::Offload]);
        assert_eq!(c.stats().pauses, 2);
    }

    #[test]
    fn wait_offloads_at_most_once_per_cooldown() {
        let base = Instant::now();
        let mut c = waiting_idle(base, WaitPolicy::default(), None);
        c.tick(at(base, 20));
        assert_eq!(c.tick(at(base, 50)), vec![Action::Offload]);
        c.handle(
            at(base, 100),
            WaitEvent::DataReady {
                request: 7,
                epoch: 1,
            },
        );
        // A second request 1 s later: paused, but not offloaded until 5 s after the first.
        c.handle(
            at(base, 1000),
            WaitEvent::GuestIdle {
                epoch: 1,
                timer_due: None,
            },
        );
        c.handle(
            at(base, 1000),
            WaitEvent::WaitStart {
                request: 8,
                epoch: 1,
            },
        );
        assert_eq!(c.tick(at(base, 1020)), vec![Action::Pause]);
        assert!(c.tick(at(base, 1050)).is_empty());
        assert_eq!(c.stats().skipped_for_cooldown, 1);
        assert_eq!(c.next_deadline(), Some(at(base, 5050)));
        assert_eq!(c.tick(at(base, 5050)), vec![Action::Offload]);
    }

    #[test]
    fn wait_under_a_manual_suspend_is_never_resumed_by_the_coordinator() {
        let base = Instant::now();
        let mut c = waiting_idle(base, WaitPolicy::default(), Some(300));
        c.handle(
            at(base, 5),
            WaitEvent::WaitStart {
                request: 8,
                epoch: 1,
            },
        );
        c.handle(at(base, 10), WaitEvent::ManualSuspend);
        assert!(c.tick(at(base, 5000)).is_empty(), "timer due, yet manual");
        assert!(c
            .handle(
                at(base, 5001),
                WaitEvent::DataReady {
                    request: 8,
                    epoch: 1
                }
            )
            .is_empty());
        assert!(c
            .handle(
                at(base, 5002),
                WaitEvent::DataReady {
                    request: 7,
                    epoch: 1
                }
            )
            .is_empty());
        assert!(c.handle(at(base, 5003), WaitEvent::External).is_empty());
        assert_eq!(c.next_deadline(), None);
        // The operator's resume delivers what arrived, in order.
        assert_eq!(
            c.handle(at(base, 6000), WaitEvent::ManualResume),
            vec![
                Action::Deliver { request: 8 },
                Action::Deliver { request: 7 }
            ]
        );
        assert_eq!(c.phase(), Phase::Running);
    }

    #[test]
    fn wait_events_of_another_epoch_or_request_are_ignored() {
        let base = Instant::now();
        let mut c = waiting_idle(base, WaitPolicy::default(), None);
        c.tick(at(base, 20));
        assert!(c
            .handle(
                at(base, 30),
                WaitEvent::DataReady {
                    request: 7,
                    epoch: 0
                }
            )
            .is_empty());
        assert!(c
            .handle(
                at(base, 31),
                WaitEvent::DataReady {
                    request: 99,
                    epoch: 1
                }
            )
            .is_empty());
        assert_eq!(c.stats().stale, 2);
        assert_eq!(c.phase(), Phase::Paused);
        // Restored: the old request is gone with its epoch.
        c.new_epoch(2);
        assert!(c
            .handle(
                at(base, 40),
                WaitEvent::DataReady {
                    request: 7,
                    epoch: 2
                }
            )
            .is_empty());
        assert_eq!(c.stats().delivered, 0);
    }

    /// A coordinator that has seen waits of `lengths_ms` (one after another from `base`) and
    /// offloads that took `cost_ms`; returns it and when its history ends.
    fn with_history(
        base: Instant,
        policy: WaitPolicy,
        lengths_ms: &[u64],
        cost_ms: u64,
    ) -> (WaitCoordinator, Instant) {
        let mut c = WaitCoordinator::new(policy, 1);
        let mut now = base;
        for (request, &len) in (100..).zip(lengths_ms) {
            c.handle(now, WaitEvent::WaitStart { request, epoch: 1 });
            now += Duration::from_millis(len);
            c.handle(now, WaitEvent::DataReady { request, epoch: 1 });
            now += Duration::from_millis(10);
        }
        c.offload_took(Duration::from_millis(cost_ms));
        (c, now)
    }

    fn start_idle_wait(
        c: &mut WaitCoordinator,
        now: Instant,
        request: u64,
        timer_due: Option<Instant>,
    ) {
        c.handle(
            now,
            WaitEvent::GuestIdle {
                epoch: 1,
                timer_due,
            },
        );
        c.handle(now, WaitEvent::WaitStart { request, epoch: 1 });
    }

    #[test]
    fn wait_expected_remaining_follows_the_vm_s_past_waits() {
        let base = Instant::now();
        let policy = WaitPolicy::default();
        let (c, _) = with_history(base, policy, &[100, 300, 500, 700, 900], 10);
        let ms = Duration::from_millis;
        // At the start: the median of the whole history.
        assert_eq!(c.expected_remaining(ms(0)), Some(ms(500)));
        // 400 ms in: the waits that went on had 100, 300 and 500 ms left.
        assert_eq!(c.expected_remaining(ms(400)), Some(ms(300)));
        // Longer than all: about as long again.
        assert_eq!(c.expected_remaining(ms(2000)), Some(ms(2000)));
        assert_eq!(
            WaitCoordinator::new(policy, 1).expected_remaining(ms(0)),
            None
        );
    }

    #[test]
    fn wait_offloads_only_when_the_expected_wait_pays_for_it() {
        let ms = Duration::from_millis;
        let policy = WaitPolicy {
            offload_cooldown: Duration::ZERO,
            ..WaitPolicy::default()
        };
        // Waits of 5 s, offloads of 100 ms: 4.95 s left at 50 ms is worth 4 offloads.
        let base = Instant::now();
        let (mut c, now) = with_history(base, policy, &[5000, 5000, 5000], 100);
        start_idle_wait(&mut c, now, 7, None);
        assert_eq!(c.tick(now + ms(20)), vec![Action::Pause]);
        assert_eq!(c.tick(now + ms(50)), vec![Action::Offload]);

        // Waits of 200 ms, offloads of 100 ms: 150 ms left at 50 ms is not worth it.
        let (mut c, now) = with_history(base, policy, &[200, 200, 200], 100);
        start_idle_wait(&mut c, now, 7, None);
        assert_eq!(c.tick(now + ms(20)), vec![Action::Pause]);
        assert!(c.tick(now + ms(50)).is_empty());
        assert_eq!(c.stats().skipped_for_gain, 1);
        // Looked at again an offload's time later: longer than every wait seen (250 ms in:
        // 250 ms expected) but still short of 400 ms.
        assert_eq!(c.next_deadline(), Some(now + ms(150)));
        assert!(c.tick(now + ms(150)).is_empty());
        assert_eq!(c.next_deadline(), Some(now + ms(250)));
        assert!(c.tick(now + ms(250)).is_empty());
        assert!(c.tick(now + ms(350)).is_empty());
        // 400 ms in, 400 ms expected: it pays now.
        assert_eq!(c.tick(now + ms(450)), vec![Action::Offload]);
        assert_eq!(c.stats().skipped_for_gain, 1, "counted once per pause");
        // The answer brings it back; the cost follows what offloads take.
        assert_eq!(
            c.handle(
                now + ms(500),
                WaitEvent::DataReady {
                    request: 7,
                    epoch: 1
                }
            ),
            vec![Action::Resume, Action::Deliver { request: 7 }]
        );
        c.offload_took(ms(500));
        assert_eq!(c.offload_cost, Some(ms(200)));
    }

    #[test]
    fn wait_timer_just_short_of_the_budget_leaves_nothing_due_but_the_timer() {
        // The timer 1050 ms in: at 50 ms exactly the budget holds, but a tick comes late.
        let base = Instant::now();
        let mut c = waiting_idle(base, WaitPolicy::default(), Some(1050));
        assert_eq!(c.tick(at(base, 20)), vec![Action::Pause]);
        assert!(c.tick(at(base, 51)).is_empty());
        assert_eq!(c.stats().skipped_for_timer, 1);
        // No deadline in the past to spin on: the next thing is the timer.
        assert_eq!(c.next_deadline(), Some(at(base, 1050)));
    }

    #[test]
    fn wait_offload_pays_only_until_the_guest_timer_brings_the_vm_back() {
        let ms = Duration::from_millis;
        let policy = WaitPolicy {
            offload_cooldown: Duration::ZERO,
            min_timer_budget: Duration::ZERO,
            ..WaitPolicy::default()
        };
        let base = Instant::now();
        // Waits of 5 s, offloads of 100 ms: worth it, unless a timer 300 ms in will undo it.
        let (mut c, now) = with_history(base, policy, &[5000, 5000, 5000], 100);
        start_idle_wait(&mut c, now, 7, Some(now + ms(300)));
        assert_eq!(c.tick(now + ms(20)), vec![Action::Pause]);
        assert!(c.tick(now + ms(50)).is_empty());
        assert_eq!(c.stats().skipped_for_gain, 1);
        let (mut c, now) = with_history(base, policy, &[5000, 5000, 5000], 100);
        start_idle_wait(&mut c, now, 7, Some(now + ms(2000)));
        c.tick(now + ms(20));
        assert_eq!(c.tick(now + ms(50)), vec![Action::Offload]);
    }

    #[test]
    fn wait_break_even_zero_offloads_whenever_the_other_rules_allow() {
        let ms = Duration::from_millis;
        let policy = WaitPolicy {
            break_even: 0.0,
            offload_cooldown: Duration::ZERO,
            ..WaitPolicy::default()
        };
        let base = Instant::now();
        let (mut c, now) = with_history(base, policy, &[60, 60], 10_000);
        start_idle_wait(&mut c, now, 7, None);
        c.tick(now + ms(20));
        assert_eq!(c.tick(now + ms(50)), vec![Action::Offload]);
    }

    #[test]
    fn wait_policy_scales_every_duration() {
        let p = WaitPolicy::default().scaled(0.05);
        assert_eq!(p.pause_after, Duration::from_millis(1));
        assert_eq!(p.offload_cooldown, Duration::from_millis(250));
        assert_eq!(p.min_timer_budget, Duration::from_millis(50));
        assert!(p.offload);
    }

    #[test]
    fn wait_reclaim_offloads_a_waiting_vm_at_once_overriding_cooldown_and_gain() {
        let base = Instant::now();
        // A cooldown and a break-even that would forbid any offload here.
        let policy = WaitPolicy {
            offload_cooldown: Duration::from_secs(3600),
            break_even: 1e9,
            ..WaitPolicy::default()
        };
        let mut c = waiting_idle(base, policy, Some(100));
        // 5 ms into the wait: not even paused yet, the guest's timer 95 ms away.
        assert_eq!(
            c.handle(at(base, 5), WaitEvent::Reclaim),
            vec![Action::Pause, Action::Offload]
        );
        assert_eq!(c.phase(), Phase::Offloaded);
        assert_eq!((c.stats().offloads, c.stats().reclaims), (1, 1));
        // Already offloaded: a second ask changes nothing.
        assert!(c.handle(at(base, 6), WaitEvent::Reclaim).is_empty());
        // The answer brings it back as usual.
        let done = c.handle(
            at(base, 50),
            WaitEvent::DataReady {
                request: 7,
                epoch: 1,
            },
        );
        assert_eq!(done, vec![Action::Resume, Action::Deliver { request: 7 }]);
        // Running a command (no wait): nothing to reclaim from wait management.
        c.handle(at(base, 51), WaitEvent::GuestBusy { epoch: 1 });
        assert!(c.handle(at(base, 52), WaitEvent::Reclaim).is_empty());
        assert_eq!(c.stats().reclaims, 1);
    }

    #[test]
    fn wait_reclaim_leaves_an_operator_s_suspended_vm_alone() {
        let base = Instant::now();
        let mut c = waiting_idle(base, WaitPolicy::default(), None);
        c.handle(at(base, 1), WaitEvent::ManualSuspend);
        assert!(c.handle(at(base, 2), WaitEvent::Reclaim).is_empty());
        assert_eq!(c.phase(), Phase::Manual);
        assert_eq!(c.stats().reclaims, 0);
    }

    #[test]
    fn wait_pause_only_strategy_never_offloads() {
        let base = Instant::now();
        let policy = WaitPolicy {
            offload: false,
            ..WaitPolicy::default()
        };
        let mut c = waiting_idle(base, policy, None);
        assert_eq!(c.tick(at(base, 20)), vec![Action::Pause]);
        assert!(c.tick(at(base, 10_000)).is_empty());
        assert_eq!(c.next_deadline(), None);
        assert_eq!(
            c.handle(at(base, 10_001), WaitEvent::External),
            vec![Action::Resume]
        );
    }

    proptest::proptest! {
        /// Whatever happens, in any order: a response is delivered once per wait, and only to
        /// a request that waits; nothing but a delivery follows a manual suspend until the
        /// manual resume; offloads are at least a cooldown apart; a warm-up comes only while
        /// offloaded, at most once per offload.
        #[test]
        fn wait_any_event_sequence_keeps_the_rules(
            steps in proptest::collection::vec((0u8..10, 0u64..4, 0u64..400), 1..80)
        ) {
            let base = Instant::now();
            let policy = WaitPolicy::default();
            let mut c = WaitCoordinator::new(policy, 1);
            let mut now = base;
            // Requests waiting, as the events say: a delivery must take one of them.
            let mut waiting: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
            let take = |waiting: &mut std::collections::HashMap<u64, u32>, request: u64| {
                match waiting.get_mut(&request) {
                    Some(n) if *n > 0 => { *n -= 1; true }
                    _ => false,
                }
            };
            let mut manual = false;
            let mut last_offload: Option<Instant> = None;
            // Offloaded (by the coordinator), and warmed since.
            let (mut offloaded, mut warmed) = (false, false);
            for (kind, request, gap_ms) in steps {
                now += Duration::from_millis(gap_ms);
                let event = match kind {
                    0 => {
                        // A second start of a request already waited for is the same wait.
                        if !c.waiting.contains_key(&request) {
                            *waiting.entry(request).or_insert(0) += 1;
                        }
                        WaitEvent::WaitStart { request, epoch: 1 }
                    }
                    1 => WaitEvent::DataReady { request, epoch: 1 },
                    2 => WaitEvent::GuestIdle { epoch: 1, timer_due: Some(now + Duration::from_millis(gap_ms * 5)) },
                    3 => WaitEvent::GuestIdle { epoch: 1, timer_due: None },
                    4 => WaitEvent::GuestBusy { epoch: 1 },
                    5 => { manual = true; WaitEvent::ManualSuspend }
                    6 => WaitEvent::External,
                    7 => WaitEvent::DataReady { request, epoch: 0 },
                    8 => WaitEvent::DataArriving { request, epoch: 1 },
                    _ => WaitEvent::BatchReady { request, epoch: 1 },
                };
                let batch = matches!(event, WaitEvent::BatchReady { .. });
                let mut actions = c.handle(now, event);
                actions.extend(c.tick(now));
                for action in actions {
                    match action {
                        // A batch: only of a request waited for, which goes on waiting.
                        Action::Deliver { request } if batch => {
                            proptest::prop_assert!(!manual);
                            proptest::prop_assert!(waiting.get(&request).is_some_and(|&n| n > 0), "a batch of a request not waited for");
                        }
                        Action::Deliver { request } => {
                            proptest::prop_assert!(take(&mut waiting, request), "delivered twice, or unasked");
                        }
                        Action::Offload => {
                            proptest::prop_assert!(!manual);
                            if let Some(last) = last_offload {
                                proptest::prop_assert!(now >= last + policy.offload_cooldown);
                            }
                            last_offload = Some(now);
                            (offloaded, warmed) = (true, false);
                        }
                        Action::Warm => {
                            proptest::prop_assert!(!manual && offloaded && !warmed);
                            warmed = true;
                        }
                        Action::Resume => {
                            proptest::prop_assert!(!manual);
                            offloaded = false;
                        }
                        Action::Pause => proptest::prop_assert!(!manual),
                    }
                }
                if manual && kind == 6 {
                    // An operator's resume ends the manual hold and hands over what was held.
                    manual = false;
                    for action in c.handle(now, WaitEvent::ManualResume) {
                        let Action::Deliver { request } = action else {
                            proptest::prop_assert!(false, "{action:?} on a manual resume");
                            continue;
                        };
                        proptest::prop_assert!(take(&mut waiting, request), "delivered twice, or unasked");
                    }
                }
            }
        }
    }
}
