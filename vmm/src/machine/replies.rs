//! Operator requests during a model wait (the control socket: `status`, `stats`, `suspend`,
//! `resume`, `stop`) and the replies they get, as typed structures: the reply's fields are
//! the operator's interface, so each is named and documented once, here.

use std::time::Instant;

use uffd_pager::load::{LoadMode, LoadReport};
use uffd_pager::metrics::MetricsSnapshot;
use uffd_pager::offload::OffloadReport;
use uffd_pager::state::StateCounts;

use super::model_wait::ModelWait;
use super::{Machine, WaitManagement};
use crate::charged::MemoryCost;
use crate::operator::OperatorRequest;
use crate::wait::{Action as WaitAction, Phase, WaitCoordinator, WaitEvent, WaitStats};

/// The model wait in progress, as replies show it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct WaitView {
    /// What the guest waits for: `model`, `download` or `read` (a file of its image).
    pub source: &'static str,
    /// The request the guest waits on.
    pub request: u64,
    /// Since it went out, seconds.
    pub waited_s: f64,
    /// Wait management's phase.
    pub phase: Phase,
    /// The answer came and is held for an operator's resume.
    pub answer_ready: bool,
}

impl WaitView {
    fn of(w: &ModelWait, phase: Phase) -> Self {
        Self {
            source: w.source,
            request: w.request,
            waited_s: w.began.elapsed().as_secs_f64(),
            phase,
            answer_ready: w.held.is_some(),
        }
    }
}

/// The VM's state as `status` names it during wait `w` in `phase`.
fn state(w: &ModelWait, phase: Phase) -> &'static str {
    match (w.offloaded, phase) {
        (true, _) => "offloaded",
        // `Offloaded` without the RAM out: the offload failed and the VM stayed paused.
        (false, Phase::Paused | Phase::Manual | Phase::Offloaded) => "paused",
        (false, Phase::Running) => "running",
    }
}

/// `status` during a model wait.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StatusReply {
    pub state: &'static str,
    pub model_wait: WaitView,
}

/// `stats` during a model wait.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StatsReply {
    pub state: &'static str,
    pub model_wait: WaitView,
    /// Configured guest RAM.
    pub memory_bytes: u64,
    /// What the VM costs the host, `memory_charged_bytes` first, as in `pvisor stats` at any
    /// other time.
    #[serde(flatten)]
    pub memory: MemoryCost,
    /// Where guest RAM is mapped in the VM process.
    pub guest_ram_host_base: u64,
    /// Application data the guest filled.
    pub app_bytes: u64,
    /// Guest pages by state.
    pub pages: StateCounts,
    /// The pager's counters.
    pub pager: MetricsSnapshot,
    /// What wait management did.
    pub wait: WaitStats,
}

/// `suspend` during a model wait: the VM is held; `offload` when asked for and carried out.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SuspendReply {
    pub state: &'static str,
    pub offload: Option<OffloadReport>,
    pub model_wait: WaitView,
}

/// `resume` of a suspended VM: `load` when its RAM was offloaded.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ResumeReply {
    /// Always `running`: wait management has the wait again.
    pub state: &'static str,
    pub load: Option<LoadReport>,
    pub model_wait: WaitView,
}

/// `stop`: the VM exits once the command has failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StopReply {
    pub stopped: bool,
}

/// A reply as the operator's channel carries it.
fn json(reply: impl serde::Serialize) -> Result<serde_json::Value, String> {
    serde_json::to_value(reply).map_err(|e| format!("cannot encode the reply: {e}"))
}

impl Machine {
    /// Answers an operator request during model wait `w`; returns the answer and what the
    /// coordinator wants done next.
    pub(super) fn operate(
        &mut self,
        asked: OperatorRequest,
        coordinator: &mut WaitCoordinator,
        w: &mut ModelWait,
        wait: &WaitManagement,
    ) -> (Result<serde_json::Value, String>, Vec<WaitAction>) {
        let now = Instant::now();
        match asked {
            OperatorRequest::Status => (
                json(StatusReply {
                    state: state(w, coordinator.phase()),
                    model_wait: WaitView::of(w, coordinator.phase()),
                }),
                Vec::new(),
            ),
            OperatorRequest::Stats => (json(self.stats_reply(coordinator, w)), Vec::new()),
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
                            let why = format!(
                                "the offload failed and the VM stays suspended with its RAM: {}",
                                basics::error_chain(&e)
                            );
                            return (Err(why), actions);
                        }
                    }
                }
                let reply = SuspendReply {
                    state: state(w, coordinator.phase()),
                    offload: report,
                    model_wait: WaitView::of(w, coordinator.phase()),
                };
                (json(reply), actions)
            }
            OperatorRequest::Resume { eager } => {
                if coordinator.phase() != Phase::Manual {
                    let why = format!(
                        "the VM is not suspended: it waits for the answer to model request {} under \
                         wait management",
                        w.request
                    );
                    return (Err(why), Vec::new());
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
                            let why = format!(
                                "cannot load the VM's RAM back: {}",
                                basics::error_chain(&e)
                            );
                            return (Err(why), Vec::new());
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
                let reply = ResumeReply {
                    state: "running",
                    load,
                    model_wait: WaitView::of(w, coordinator.phase()),
                };
                (json(reply), actions)
            }
            OperatorRequest::Stop => {
                self.stop_requested = true;
                (json(StopReply { stopped: true }), Vec::new())
            }
        }
    }

    fn stats_reply(&self, coordinator: &WaitCoordinator, w: &ModelWait) -> StatsReply {
        let ram = &self.ram;
        StatsReply {
            state: state(w, coordinator.phase()),
            model_wait: WaitView::of(w, coordinator.phase()),
            memory_bytes: ram.size(),
            memory: MemoryCost::measure(ram, self.cgroup_dir.as_deref()),
            guest_ram_host_base: ram.host_base().0,
            app_bytes: self.app_bytes(),
            pages: self.pager.state_counts(),
            pager: self.pager.metrics().snapshot(),
            wait: self.wait_stats_of(coordinator),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::Answer;

    fn wait(offloaded: bool, held: bool) -> ModelWait {
        ModelWait {
            source: "model",
            request: 7,
            began: Instant::now(),
            offloaded,
            held: held.then(|| Answer::Data(b"answer".to_vec())),
            timer_due: None,
        }
    }

    #[test]
    fn state_says_offloaded_only_with_the_ram_out_and_running_only_unpaused() {
        let phases = [
            Phase::Running,
            Phase::Paused,
            Phase::Offloaded,
            Phase::Manual,
        ];
        for phase in phases {
            assert_eq!(state(&wait(true, false), phase), "offloaded", "{phase:?}");
        }
        assert_eq!(state(&wait(false, false), Phase::Running), "running");
        // A failed offload leaves the phase `Offloaded` with the RAM in: paused.
        for phase in [Phase::Paused, Phase::Offloaded, Phase::Manual] {
            assert_eq!(state(&wait(false, false), phase), "paused", "{phase:?}");
        }
    }

    #[test]
    fn replies_carry_their_fields_by_the_names_operators_read() {
        let w = wait(false, true);
        let status = json(StatusReply {
            state: state(&w, Phase::Manual),
            model_wait: WaitView::of(&w, Phase::Manual),
        })
        .unwrap();
        assert_eq!(status["state"], "paused");
        assert_eq!(status["model_wait"]["request"], 7);
        assert_eq!(status["model_wait"]["answer_ready"], true);
        assert!(status["model_wait"]["waited_s"].as_f64().unwrap() >= 0.0);
        assert!(status["model_wait"]["phase"].is_string());
        let suspend = json(SuspendReply {
            state: "paused",
            offload: None,
            model_wait: WaitView::of(&w, Phase::Manual),
        })
        .unwrap();
        // Not asked for: there, as null.
        assert!(suspend.as_object().unwrap().contains_key("offload"));
        assert!(suspend["offload"].is_null());
        let resume = json(ResumeReply {
            state: "running",
            load: Some(LoadReport::default()),
            model_wait: WaitView::of(&w, Phase::Running),
        })
        .unwrap();
        assert!(resume["load"].is_object());
        assert_eq!(json(StopReply { stopped: true }).unwrap()["stopped"], true);
    }
}
