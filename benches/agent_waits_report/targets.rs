//! The figures derived round by round against `off`, and the verdict on each target of issue
//! 7: judged on the medians of the largest group (16 VMs), the other group for information.

use crate::common::results::{fig, num, signed, signed_fig, Results};
use crate::replay::key;
use crate::seed;
use crate::{Log, Settings, Strategy, BASE};

/// Memory × time of a judged strategy, % of off's (at most): memory charged, the headline
/// (issue 35), and guest PSS, the figure pvisor quoted.
pub const MEMORY_PCT_MAX: f64 = 25.0;
/// The completion window of a judged strategy, % over off's (at most).
pub const WINDOW_CHANGE_MAX_PCT: f64 = 5.0;
/// The VMs' CPU under a judged strategy, % of off's (at most; issue 35).
pub const CPU_PCT_MAX: f64 = 130.0;
/// With downloads and image reads (issue 38): memory charged × time managing all three
/// sources, % of managing model waits only (at most).
pub const IO_MEMORY_PCT_MAX: f64 = 70.0;
/// A streamed batch or a download's chunk reaches the guest at most this long after it
/// became deliverable (issue 38), ms.
pub const BATCH_DELAY_MAX_MS: f64 = 20.0;

/// The per-round figures against off: (derived quantity, measured quantity, as a change).
/// `…_pct_of_off` is strategy ÷ off × 100; `…_change_pct` is (strategy ÷ off − 1) × 100.
pub const AGAINST_OFF: [(&str, &str, bool); 7] = [
    ("charged_pct_of_off", "charged_gib_s", false),
    ("cpu_pct_of_off", "cpu_s", false),
    ("guest_pss_pct_of_off", "guest_pss_gib_s", false),
    ("cgroup_pct_of_off", "cgroup_gib_s", false),
    ("window_change_pct", "window_s", true),
    ("completion_change_pct", "completion_mean_s", true),
    ("throughput_change_pct", "throughput_per_min", true),
];

/// Adds, round by round, every strategy's figures against off with as many VMs in the same
/// round (`AGAINST_OFF`).
pub fn derive(results: &mut Results, settings: &Settings) {
    for &vms in &settings.vms {
        for &strategy in settings.strategies.iter().filter(|&&s| s != BASE) {
            for (derived, measured, change) in AGAINST_OFF {
                let of = key(vms, strategy, measured);
                let base = key(vms, BASE, measured);
                for round in 0..results.runs {
                    let value = |k: &str| results.values(k).get(round).copied();
                    if let (Some(s), Some(b)) = (value(&of), value(&base)) {
                        let ratio = s / b;
                        if ratio.is_finite() {
                            let v = if change {
                                (ratio - 1.0) * 100.0
                            } else {
                                ratio * 100.0
                            };
                            results.put(&key(vms, strategy, derived), "%", round, v);
                        }
                    }
                }
            }
        }
        // All three sources managed against model waits only, round by round.
        let (all, model) = (Strategy::Offload, Strategy::OffloadModel);
        if settings.strategies.contains(&all) && settings.strategies.contains(&model) {
            for round in 0..results.runs {
                let value = |s| {
                    results
                        .values(&key(vms, s, "charged_gib_s"))
                        .get(round)
                        .copied()
                };
                if let (Some(a), Some(m)) = (value(all), value(model)) {
                    let pct = a / m * 100.0;
                    if pct.is_finite() {
                        results.put(&key(vms, all, "charged_pct_of_model"), "%", round, pct);
                    }
                }
            }
        }
    }
}

/// Issue 38's targets, on a trajectory with downloads and image reads: all three sources
/// managed against model waits only, and how soon batches and chunks reached the guests.
fn io_verdicts(results: &Results, vms: usize) -> Vec<Verdict> {
    let bound = Target::at_most(
        key(vms, Strategy::Offload, "charged_pct_of_model"),
        IO_MEMORY_PCT_MAX,
    );
    let (s, meeting, result) = bound.judge(results, BOLD_PASS_FAIL);
    let memory = Verdict {
        target: format!(
            "{}, offload: memory charged×time ≤ {IO_MEMORY_PCT_MAX:.0}% of offload-model's (issue 38: all three sources managed against model waits only)",
            vms_label(vms)
        ),
        figure: if s.n == 0 {
            "not measured in this run".to_owned()
        } else {
            format!(
                "{}% ({meeting} of {} rounds meet it): {} against {} GiB·s per task",
                fig(results, &bound.key, 1),
                s.n,
                fig(results, &key(vms, Strategy::Offload, "charged_gib_s"), 3),
                fig(results, &key(vms, Strategy::OffloadModel, "charged_gib_s"), 3),
            )
        },
        result,
    };
    // Summed over the rounds: the mean delay of every batch, and how many were late.
    let sum = |q: &str| -> f64 {
        results
            .values(&key(vms, Strategy::Offload, q))
            .iter()
            .filter(|v| v.is_finite())
            .sum()
    };
    let (batches, late) = (sum("batches"), sum("batches_late"));
    let mean_ms = sum("batch_delay_us") / 1e3 / batches.max(1.0);
    let delay = Verdict {
        target: format!(
            "{}, offload: a batch or chunk reaches the guest ≤ {BATCH_DELAY_MAX_MS:.0} ms after it became deliverable (issue 38)",
            vms_label(vms)
        ),
        figure: format!(
            "{batches:.0} batches and chunks over all rounds: {mean_ms:.1} ms after on average, {late:.0} later than {BATCH_DELAY_MAX_MS:.0} ms"
        ),
        result: verdict::result(batches > 0.0, late == 0.0, BOLD_PASS_FAIL),
    };
    vec![memory, delay]
}

/// The strategy the chart's round is chosen by: offload if measured, else the first other
/// than off.
fn reference(settings: &Settings) -> Option<Strategy> {
    if settings.strategies.contains(&Strategy::Offload) {
        return Some(Strategy::Offload);
    }
    settings.strategies.iter().copied().find(|&s| s != BASE)
}

/// The round whose memory charged × time ratio of offload to off, with the most VMs, is
/// nearest that ratio's median (the first round if there is none).
pub fn median_round(results: &Results, settings: &Settings) -> usize {
    let Some(strategy) = reference(settings) else {
        return 0;
    };
    let k = key(settings.judged_vms(), strategy, "charged_pct_of_off");
    results.median_round(&k)
}

pub use crate::common::verdict::Verdict;
use crate::common::verdict::{self, Target, Words, BOLD_PASS_FAIL};

/// The verdicts of a target on a group judged for information: `meets` / `misses`.
const FOR_INFORMATION: Words = [
    "NOT MEASURED",
    "meets (for information)",
    "misses (for information)",
];

/// `16 VMs`, `1 VM`.
pub fn vms_label(vms: usize) -> String {
    if vms == 1 {
        "1 VM".to_owned()
    } else {
        format!("{vms} VMs")
    }
}

/// A target that bounds a figure against off from above.
struct Bound {
    /// The target's text after the group and the strategy.
    target: String,
    /// The figure against off it bounds (`AGAINST_OFF`).
    derived: &'static str,
    /// The figure that is compared with off's: its quantity, decimals and unit.
    measured: (&'static str, usize, &'static str),
    /// The most the figure may be, %.
    max: f64,
    /// Whether the figure is a change (written with its sign) or a share of off's.
    change: bool,
}

impl Bound {
    fn verdict(&self, results: &Results, vms: usize, strategy: Strategy, judged: bool) -> Verdict {
        let bound = Target::at_most(key(vms, strategy, self.derived), self.max);
        let words = if judged {
            BOLD_PASS_FAIL
        } else {
            FOR_INFORMATION
        };
        let (s, meeting, result) = bound.judge(results, words);
        let (quantity, d, unit) = self.measured;
        let (value, of) = if self.change {
            (signed_fig(results, &bound.key, 1), "")
        } else {
            (fig(results, &bound.key, 1), " of off")
        };
        Verdict {
            target: format!("{}, {}: {}", vms_label(vms), strategy.key(), self.target),
            figure: if s.n == 0 {
                format!("not measured in this run (its CSV has no `{quantity}`)")
            } else {
                format!(
                    "{value}%{of} ({meeting} of {} rounds meet it): {}{unit} against {}{unit}",
                    s.n,
                    fig(results, &key(vms, strategy, quantity), d),
                    fig(results, &key(vms, BASE, quantity), d),
                )
            },
            result,
        }
    }
}

pub fn verdicts(results: &Results, settings: &Settings, log: &Log) -> Vec<Verdict> {
    let judged_vms = settings.judged_vms();
    let mut sizes = vec![judged_vms];
    sizes.extend(settings.vms.iter().copied().filter(|&n| n != judged_vms));
    let strategies: Vec<Strategy> = settings
        .strategies
        .iter()
        .copied()
        .filter(|s| s.judged())
        .collect();
    let bounds = [
        Bound {
            target: format!(
                "memory charged×time ≤ {MEMORY_PCT_MAX:.0}% of off (the headline; pvisor quoted guest \
                 PSS only)"
            ),
            derived: "charged_pct_of_off",
            measured: ("charged_gib_s", 3, " GiB·s per task"),
            max: MEMORY_PCT_MAX,
            change: false,
        },
        Bound {
            target: format!("VMs' CPU ≤ {CPU_PCT_MAX:.0}% of off (issue 35)"),
            derived: "cpu_pct_of_off",
            measured: ("cpu_s", 1, " s"),
            max: CPU_PCT_MAX,
            change: false,
        },
        Bound {
            target: format!(
                "guest PSS×time ≤ {MEMORY_PCT_MAX:.0}% of off (pvisor: {:.0}%)",
                seed::offload_guest_pct()
            ),
            derived: "guest_pss_pct_of_off",
            measured: ("guest_pss_gib_s", 3, " GiB·s per task"),
            max: MEMORY_PCT_MAX,
            change: false,
        },
        Bound {
            target: format!(
                "completion window ≤ +{WINDOW_CHANGE_MAX_PCT:.0}% over off (pvisor: +{:.0}%)",
                seed::OFFLOAD_WINDOW_CHANGE_PCT
            ),
            derived: "window_change_pct",
            measured: ("window_s", 2, " s"),
            max: WINDOW_CHANGE_MAX_PCT,
            change: true,
        },
    ];
    let mut out = Vec::new();
    for &vms in &sizes {
        let judged = vms == judged_vms;
        for bound in &bounds {
            for &strategy in &strategies {
                out.push(bound.verdict(results, vms, strategy, judged));
            }
        }
        if judged {
            if settings.replayed.has_io() != (false, false) {
                out.extend(io_verdicts(results, vms));
            }
            out.push(integrity(log));
        }
    }
    out
}

/// Zero integrity failures across all runs, and one `results_digest` for all (on the failures
/// alone where a re-rendered CSV did not keep the digests).
fn integrity(log: &Log) -> Verdict {
    log.integrity.verdict(
        "zero integrity failures (every answer's digest, every command, the same digests in every \
         VM, sampling without long gaps or drops; across all runs)",
        BOLD_PASS_FAIL,
    )
}

/// `35.1% of off` style text of a strategy's median ratio, for the summary.
pub fn median_pct(results: &Results, vms: usize, strategy: Strategy, quantity: &str) -> String {
    num(results.summary(&key(vms, strategy, quantity)).median, 1)
}

/// The median of a change, signed, for the summary.
pub fn median_change(results: &Results, vms: usize, strategy: Strategy, quantity: &str) -> String {
    signed(results.summary(&key(vms, strategy, quantity)).median, 1)
}
