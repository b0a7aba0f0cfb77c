//! The guest's model requests: carried to the gateway, and the wait for the answer, plain
//! (the VM only waits, and comes back for the guest's timer) or managed (paused, offloaded
//! and brought back as the wait policy says, the governor's orders carried out, operator
//! requests answered).

use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};

use super::{Machine, MachineError};
use crate::gateway::{Answer, Batching, ModelPort, Progress};
use crate::governor::client::Order;
use crate::governor::protocol::WireState;
use crate::guest::{self, Mailbox};
use crate::wait::{Action as WaitAction, Phase, WaitCoordinator, WaitEvent, WaitPolicy};
use uffd_pager::offload::OffloadConfig;

/// How a model wait (or a download's wait for its next chunk) ended.
pub(super) enum WaitOutcome {
    /// With the answer (or why there is none).
    Answer(Answer),
    /// The guest's timer fell due: it runs its timer's work and comes back for the answer.
    Timer,
    /// A batch of a streamed answer (the guest takes it and comes back for the rest), and
    /// when it became deliverable.
    Batch(Vec<u8>, Instant),
}

/// What a wait waits for, and so what tells how long it will last.
#[derive(Debug, Clone, Copy)]
pub(super) enum Waited {
    /// A model answer (sent by the wait, unless it is out already): the VM's past model
    /// waits.
    Model,
    /// A download's next chunk, the download sent at `sent`, its body handed over as
    /// `chunking` says: the bytes a chunk still needs at the rate seen.
    Download { chunking: Batching, sent: Instant },
    /// An image read sent at `sent`: when its origin is expected to be done, if it is held
    /// to a rate.
    Read { due: Option<Instant>, sent: Instant },
}

impl Machine {
    /// The counters of the waits for `waited`.
    pub(super) fn source_stats(&mut self, waited: Waited) -> &mut crate::net::SourceStats {
        match waited {
            Waited::Model => &mut self.by_source.model,
            Waited::Download { .. } => &mut self.by_source.download,
            Waited::Read { .. } => &mut self.by_source.read,
        }
    }

    /// A part of the data of a wait for `waited` (a batch, a chunk) that became deliverable
    /// at `deliverable` is in the guest's hands now: how long after, for the coordinator and
    /// the source's counters.
    pub(super) fn batch_delivered(&mut self, waited: Waited, deliverable: Instant) {
        let delay = deliverable.elapsed();
        if let Some(coordinator) = self.coordinator.as_mut() {
            coordinator.batch_delivered(delay);
        }
        self.source_stats(waited).batch_delivered(delay);
    }

    /// A wait for `waited` that began at `began` is over.
    pub(super) fn count_wait(&mut self, waited: Waited, began: Instant) {
        let stats = self.source_stats(waited);
        stats.waits += 1;
        stats.wait_s += began.elapsed().as_secs_f64();
    }

    /// Whether the wait for `waited` is managed (`--vm-wait-sources`), and how.
    pub(super) fn management_of(&self, waited: Waited) -> Option<WaitManagement> {
        let wait = self.wait.as_ref()?;
        let sources = wait.policy.sources;
        let managed = match waited {
            Waited::Model => sources.model,
            Waited::Download { .. } => sources.download,
            Waited::Read { .. } => sources.read,
        };
        managed.then(|| wait.clone())
    }
}

impl Waited {
    /// The source's name, as `stats` and the log say it.
    pub(super) fn name(self) -> &'static str {
        match self {
            Waited::Model => "model",
            Waited::Download { .. } => "download",
            Waited::Read { .. } => "read",
        }
    }
}

/// How often a model wait without wait management looks for a stop.
const STOP_POLL: Duration = Duration::from_millis(50);

/// How often a model wait looks for operator requests while its answer is out.
const OPERATOR_POLL: Duration = Duration::from_millis(20);

/// One model wait in progress.
pub(super) struct ModelWait {
    /// What it waits for (`Waited::name`).
    pub(super) source: &'static str,
    pub(super) request: u64,
    pub(super) began: Instant,
    /// The VM's RAM is in the store (by the coordinator or an operator).
    pub(super) offloaded: bool,
    /// The answer, held while an operator holds the VM.
    pub(super) held: Option<Answer>,
    /// When the guest's timer falls due, if it reported one.
    pub(super) timer_due: Option<Instant>,
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

impl Machine {
    /// Carries the guest's model request to the gateway and puts the answer in its I/O buffer.
    pub(super) fn model_request(&mut self) -> Result<(), MachineError> {
        let mut mailbox: Mailbox = self.read(guest::MAILBOX_GPA)?;
        let request = mailbox.arg[0];
        // The guest's idle report on the arena channel, sent before this `out`, says when its
        // next timer falls due, as a Linux guest's idle handoff does; a guest without it puts
        // the timer in arg[5] (ms, 0: none).
        let reported = self.idle_report.take();
        if reported.is_none() && mailbox.arg[5] > guest::MAX_TIMER_MS {
            self.model_error = Some(format!(
                "the guest's timer of {} ms is longer than {} ms",
                mailbox.arg[5],
                guest::MAX_TIMER_MS
            ));
            mailbox.arg[2] = 1;
            return self.write(guest::MAILBOX_GPA, mailbox);
        }
        let timer = match reported {
            Some(due) => due.map(|due| due.saturating_duration_since(Instant::now())),
            None => (mailbox.arg[5] > 0).then(|| Duration::from_millis(mailbox.arg[5])),
        };
        // A guest that takes the answer in batches as it streams in.
        let batching = (mailbox.op == guest::Op::ModelStream as u64).then_some(self.model_batching);
        // A download or read the guest left open is given up: one request at a time.
        self.end_transfer();
        let began = Instant::now();
        let managed = self.management_of(Waited::Model);
        let outcome = match (self.model.clone(), managed) {
            (Some(port), Some(wait)) => {
                self.managed_wait(&*port, request, timer, batching, &wait, Waited::Model)
            }
            (Some(port), None) => self.plain_wait(&*port, request, timer, batching, Waited::Model),
            (None, _) => WaitOutcome::Answer(Answer::Error(
                "this VM has no model gateway (pvisor run --vm-model-upstream URL)".into(),
            )),
        };
        self.count_wait(Waited::Model, began);
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
            WaitOutcome::Batch(bytes, deliverable) => {
                // After the ones before it, in the guest's buffer; it comes back for more.
                if self.deliver(request, &bytes, &mut mailbox)? {
                    mailbox.arg[4] = 2;
                }
                self.write(guest::MAILBOX_GPA, mailbox)?;
                // In the guest's hands now (its RAM back if it was offloaded: the copy
                // faulted the buffer in): how long after it could have been.
                self.batch_delivered(Waited::Model, deliverable);
                return Ok(());
            }
        };
        match answer {
            Answer::Data(bytes) => {
                // The whole answer, or what follows the batches handed over before.
                self.deliver(request, &bytes, &mut mailbox)?;
                self.model_received = 0;
            }
            Answer::Error(why) => {
                self.model_error = Some(why.message);
                mailbox.arg[2] = 1;
            }
        }
        self.write(guest::MAILBOX_GPA, mailbox)
    }

    /// Puts `bytes` of request `request`'s answer into the guest's buffer after the ones it
    /// has had (`arg[1]`: all it has now); false (an error for the guest) if they do not fit.
    fn deliver(
        &mut self,
        request: u64,
        bytes: &[u8],
        mailbox: &mut Mailbox,
    ) -> Result<bool, MachineError> {
        let at = self.model_received;
        let end = at.saturating_add(bytes.len() as u64);
        if end > guest::IO_BUF_SIZE {
            self.model_error = Some(format!(
                "the answer to request {request} has {end} bytes, more than the guest's {} byte buffer",
                guest::IO_BUF_SIZE
            ));
            self.model_received = 0;
            mailbox.arg[2] = 1;
            return Ok(false);
        }
        let gpa = guest::IO_BUF_GPA + at;
        self.ram
            .memory()
            .write_slice(bytes, GuestAddress(gpa))
            .map_err(|e| MachineError::GuestMemory { gpa, source: e })?;
        self.model_received = end;
        mailbox.arg[1] = end;
        mailbox.arg[2] = 0;
        Ok(true)
    }

    /// Sends model request `request` unless it is already out (the guest is back from a
    /// timer or a batch); returns when it went out. A download or read was sent when it
    /// began (`waited` says when): it is never sent here.
    fn send_once(
        &mut self,
        port: &dyn ModelPort,
        request: u64,
        batching: Option<Batching>,
        waited: Waited,
    ) -> Instant {
        if let Waited::Download { sent, .. } | Waited::Read { sent, .. } = waited {
            return sent;
        }
        match self.model_pending {
            Some((pending, since)) if pending == request => since,
            other => {
                // Another request left in flight (the guest asked for a new id) goes nowhere.
                if let Some((pending, _)) = other {
                    self.give_up(pending);
                }
                let now = Instant::now();
                port.send(request, batching);
                self.model_pending = Some((request, now));
                self.model_received = 0;
                now
            }
        }
    }

    /// Waits for the answer to `request` without wait management: the VM keeps running (it
    /// only waits), and comes back early for the guest's timer.
    pub(super) fn plain_wait(
        &mut self,
        port: &dyn ModelPort,
        request: u64,
        timer: Option<Duration>,
        batching: Option<Batching>,
        waited: Waited,
    ) -> WaitOutcome {
        self.send_once(port, request, batching, waited);
        let until = timer.and_then(|t| Instant::now().checked_add(t));
        // In slices, so that a stop ends the wait.
        loop {
            if self.interrupter.stopped() {
                return WaitOutcome::Answer(Answer::Error(
                    format!(
                        "the VM was stopped while it waited for the answer to request {request}"
                    )
                    .into(),
                ));
            }
            let left = until.map_or(STOP_POLL, |u| u.saturating_duration_since(Instant::now()));
            match port.wait_progress(request, left.min(STOP_POLL), batching.is_some()) {
                Some(Progress::Done(answer)) => return WaitOutcome::Answer(answer),
                Some(Progress::Batch(bytes, at)) => return WaitOutcome::Batch(bytes, at),
                // Nothing to get ready: the VM keeps its RAM.
                Some(Progress::Arriving) | None => {}
            }
            if until.is_some_and(|u| u <= Instant::now()) {
                return WaitOutcome::Timer;
            }
        }
    }

    /// Waits for the answer to `request` the way the wait policy says: the guest is stopped at
    /// the model port (idle, no timer pending), so it is paused as it is, offloaded once the
    /// wait is long enough, its recorded working set brought back as the answer's first bytes
    /// arrive, and the rest (on faults, by default) once the answer is there.
    /// Operator requests are answered meanwhile (see [`crate::operator`]). A download's or an
    /// image read's wait is judged by its source's estimate ([`Waited`]), not by the VM's past
    /// model waits.
    pub(super) fn managed_wait(
        &mut self,
        port: &dyn ModelPort,
        request: u64,
        timer: Option<Duration>,
        batching: Option<Batching>,
        wait: &WaitManagement,
        waited: Waited,
    ) -> WaitOutcome {
        let estimate = |coordinator: &mut WaitCoordinator| {
            let now = Instant::now();
            let left = match waited {
                Waited::Model => return,
                Waited::Download { chunking, .. } => {
                    super::download::next_chunk(port.flow(request), chunking, now)
                }
                Waited::Read { due, .. } => due.map(|due| due.saturating_duration_since(now)),
            };
            coordinator.expect(now, request, left);
        };
        let mut coordinator = self
            .coordinator
            .take()
            .unwrap_or_else(|| WaitCoordinator::new(wait.policy, 0));
        let decided = coordinator.stats();
        let mut operator = self.operator.take();
        let began = self.send_once(port, request, batching, waited);
        let now = Instant::now();
        let mut w = ModelWait {
            source: waited.name(),
            request,
            began,
            offloaded: false,
            held: None,
            timer_due: timer.map(|t| now + t),
        };
        estimate(&mut coordinator);
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
                    self.source_stats(waited).offloads += 1;
                    tracing::debug!(
                        "pvisor: offloaded in {} ms during a {} wait (request {request})",
                        took.as_millis(),
                        waited.name()
                    );
                }
                if action == WaitAction::Offload {
                    self.report_offload(&coordinator, &w, std::mem::take(&mut reclaiming));
                }
                if action == WaitAction::Warm {
                    if let Some(link) = &self.governor {
                        // Its RAM is coming back: waiting, about to run.
                        link.report(WireState::Waiting, Some(Duration::ZERO));
                    }
                }
            }
            if coordinator.phase() != Phase::Manual {
                // Held for an operator who has given the VM back now.
                if let Some(answer) = w.held.take() {
                    break WaitOutcome::Answer(answer);
                }
            }
            if self.stop_requested || self.interrupter.stopped() {
                break WaitOutcome::Answer(Answer::Error(
                    format!(
                        "the VM was stopped while it waited for the answer to request {request}"
                    )
                    .into(),
                ));
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
                // An operator's VM takes no batch: the answer waits for their resume, whole
                // (the host buffers what the guest has not taken, bounded, then holds the
                // upstream back).
                let progress = if coordinator.phase() == Phase::Manual {
                    port.wait_for(request, slice).map(Progress::Done)
                } else {
                    // Batches only to a guest that takes them now.
                    port.wait_progress(request, slice, batching.is_some())
                };
                if let Some(Progress::Batch(bytes, deliverable)) = progress {
                    let deliver = coordinator
                        .handle(Instant::now(), WaitEvent::BatchReady { request, epoch: 0 });
                    if let Some(link) = &self.governor {
                        // Running from here, as for an answer: told before its RAM comes back.
                        link.set_waiting(false);
                        link.report(WireState::Running, None);
                    }
                    for action in deliver {
                        // A resume and a delivery.
                        let _ = self.carry_out(action, wait, &mut w.offloaded);
                    }
                    break WaitOutcome::Batch(bytes, deliverable);
                } else if progress == Some(Progress::Arriving) {
                    // The answer streams in: its working set can start back meanwhile.
                    actions.extend(coordinator.handle(
                        Instant::now(),
                        WaitEvent::DataArriving { request, epoch: 0 },
                    ));
                } else if let Some(Progress::Done(answer)) = progress {
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
            if w.held.is_none() {
                estimate(&mut coordinator);
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
        // What it decided in this wait, by the source waited for.
        self.source_stats(waited)
            .add_decisions(&decided, &coordinator.stats());
        self.coordinator = Some(coordinator);
        self.operator = operator;
        outcome
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
            WaitAction::Warm => {
                // The VM stays stopped; the load that follows lets the warm-up finish.
                if *offloaded && self.pager.warm(wait.io_threads).is_err() {
                    self.wait_failures.1 += 1;
                }
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
}
