//! What the measured runs say, decided without running anything: whether a budgeted run
//! passed (every check of `pvisor replay`, zero OOM kills, a window within `WINDOW_LIMIT` of
//! the unbudgeted run of the same N, strategy and round), whether CPU rather than memory is
//! what failed it, whether a group size passed, and the density a sweep gives.

/// Largest budgeted window as a multiple of the unbudgeted one.
pub const WINDOW_LIMIT: f64 = 1.10;
/// A budgeted run whose memory peaked below this share of the budget, while its CPU time was
/// at least `CPU_SHARE_BOUND` of what the machine's cores had over its wall time, was held
/// back by CPU: if its window is too long, CPU is the limit. Memory under the budget alone
/// says nothing under a governor, whose limits (counted as used) hold VMs at their faults
/// below it: at 24 VMs under 512 MiB the memory peaked at 79% with 0.85 of 2 cores busy, and
/// the first rule (memory alone) called that CPU-bound.
pub const MEMORY_SHARE_CPU_BOUND: f64 = 0.90;
/// See [`MEMORY_SHARE_CPU_BOUND`].
pub const CPU_SHARE_BOUND: f64 = 0.75;

/// The facts of one `pvisor replay` that the verdicts need.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Facts {
    /// Exit status 0 and `integrity_passed` (results and sampling).
    pub passed: bool,
    /// Why it did not pass: the replay's own failures, its sampling, no summary, the limit.
    pub failures: Vec<String>,
    /// The kernel's OOM kills, summed over the VMs.
    pub oom_kills: u64,
    /// `VM i (job): oom_kill k` of each VM that was OOM-killed.
    pub oom_killed: Vec<String>,
    /// Release to the last VM's end, seconds; NaN without a summary.
    pub window_s: f64,
    /// The largest memory cgroup usage of all the VMs together, bytes; NaN without samples.
    pub peak_bytes: f64,
    /// CPU time of the run over its wall time and the machine's cores (1: every core busy
    /// throughout); NaN when not measured.
    pub cpu_share: f64,
}

/// The verdict on one budgeted run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunVerdict {
    pub passed: bool,
    /// Why not, one line per reason.
    pub reasons: Vec<String>,
    /// Budgeted window / unbudgeted window; NaN when either is missing.
    pub ratio: f64,
    /// The window alone failed it, with no OOM kill, memory under `MEMORY_SHARE_CPU_BOUND` of
    /// the budget and the cores at least `CPU_SHARE_BOUND` busy: CPU, not memory, was the
    /// limit.
    pub cpu_bound: bool,
}

/// Judges a budgeted run against the unbudgeted run of its N, strategy and round (`None`
/// when that was not run).
pub fn judge_run(budgeted: &Facts, unbudgeted: Option<&Facts>, budget_bytes: u64) -> RunVerdict {
    let mut reasons = Vec::new();
    if budgeted.oom_kills > 0 {
        let who = if budgeted.oom_killed.is_empty() {
            String::new()
        } else {
            format!(": {}", budgeted.oom_killed.join(", "))
        };
        reasons.push(format!("{} OOM kill(s){who}", budgeted.oom_kills));
    }
    if !budgeted.passed {
        // The OOM-killed VMs' own lines say again what the line above says.
        let other: Vec<&String> = budgeted
            .failures
            .iter()
            .filter(|f| !f.contains("OOM killer"))
            .collect();
        if other.is_empty() && budgeted.oom_kills == 0 {
            reasons.push("a check failed".to_owned());
        }
        reasons.extend(other.into_iter().cloned());
    }
    let ratio = match unbudgeted {
        None => {
            reasons.push("no unbudgeted run to compare with".to_owned());
            f64::NAN
        }
        Some(reference) if !reference.passed => {
            let why = if reference.failures.is_empty() {
                "a check failed".to_owned()
            } else {
                reference.failures.join("; ")
            };
            reasons.push(format!("the unbudgeted run failed: {why}"));
            budgeted.window_s / reference.window_s
        }
        Some(reference) => budgeted.window_s / reference.window_s,
    };
    let window_too_long = !ratio.is_nan() && ratio > WINDOW_LIMIT;
    if window_too_long {
        reasons.push(format!(
            "window {:.2}× the unbudgeted one (limit {WINDOW_LIMIT:.2}×)",
            ratio
        ));
    }
    let memory_under = budgeted.peak_bytes < MEMORY_SHARE_CPU_BOUND * budget_bytes as f64;
    let cores_busy = budgeted.cpu_share >= CPU_SHARE_BOUND;
    let cpu_bound = window_too_long
        && reasons.len() == 1
        && budgeted.passed
        && budgeted.oom_kills == 0
        && memory_under
        && cores_busy;
    RunVerdict {
        passed: reasons.is_empty(),
        reasons,
        ratio,
        cpu_bound,
    }
}

/// The verdict on a group size: it passes when it was run and every run passed.
#[derive(Debug, Clone, PartialEq)]
pub struct SizeVerdict {
    pub vms: usize,
    pub passed: bool,
    /// `round R: reason` for each reason of each failed run.
    pub reasons: Vec<String>,
    /// Rounds in which CPU, not memory, failed the run.
    pub cpu_bound_rounds: Vec<usize>,
}

/// Judges group size `vms` from its runs' verdicts, `(round, verdict)`.
pub fn judge_size(vms: usize, runs: &[(usize, RunVerdict)]) -> SizeVerdict {
    let mut reasons = Vec::new();
    let mut cpu_bound_rounds = Vec::new();
    for (round, verdict) in runs {
        for reason in &verdict.reasons {
            reasons.push(format!("round {}: {reason}", round + 1));
        }
        if verdict.cpu_bound {
            cpu_bound_rounds.push(*round);
        }
    }
    if runs.is_empty() {
        reasons.push("not run".to_owned());
    }
    SizeVerdict {
        vms,
        passed: reasons.is_empty(),
        reasons,
        cpu_bound_rounds,
    }
}

/// What a sweep over ascending group sizes gives.
#[derive(Debug, Clone, PartialEq)]
pub struct Density {
    /// The largest N of the passing prefix of the sweep; 0 when its first N failed.
    pub vms: usize,
    /// The first N that failed, where the sweep stopped; `None` when every N tried passed.
    pub stopped_at: Option<usize>,
    /// The first N at which CPU rather than memory failed a run, if any.
    pub cpu_limit_at: Option<usize>,
}

/// The density of a sweep from its size verdicts in ascending order of N (the sweep stops at
/// its first failure, so later verdicts, if any, are not counted).
pub fn density(sizes: &[SizeVerdict]) -> Density {
    let mut result = Density {
        vms: 0,
        stopped_at: None,
        cpu_limit_at: None,
    };
    for size in sizes {
        if result.cpu_limit_at.is_none() && !size.cpu_bound_rounds.is_empty() {
            result.cpu_limit_at = Some(size.vms);
        }
        if !size.passed {
            result.stopped_at = Some(size.vms);
            break;
        }
        result.vms = size.vms;
    }
    result
}

/// Whether `density` is at least `factor` times `base`'s: `met`, `missed`, or `not
/// measured` when a sweep that passed every N leaves the answer open (its density is only a
/// lower bound).
pub fn at_least_times(density: &Density, base: &Density, factor: usize) -> &'static str {
    let wanted = factor * base.vms;
    let base_exact = base.stopped_at.is_some();
    let exact = density.stopped_at.is_some();
    if density.vms == 0 {
        "missed"
    } else if density.vms >= wanted && base_exact {
        "met"
    } else if density.vms < wanted && exact {
        "missed"
    } else {
        "not measured"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A run that passed, its cores 90% busy.
    fn ok(window_s: f64, peak_mib: u64) -> Facts {
        Facts {
            passed: true,
            window_s,
            peak_bytes: (peak_mib * MIB) as f64,
            cpu_share: 0.9,
            ..Facts::default()
        }
    }

    fn size(vms: usize, runs: &[RunVerdict]) -> SizeVerdict {
        let runs: Vec<(usize, RunVerdict)> = runs.iter().cloned().enumerate().collect();
        judge_size(vms, &runs)
    }

    #[test]
    fn judge_run_within_limit_passes() {
        let v = judge_run(&ok(10.9, 400), Some(&ok(10.0, 600)), 512 * MIB);
        assert!(v.passed, "{v:?}");
        assert!(!v.cpu_bound);
        assert!((v.ratio - 1.09).abs() < 1e-9);
    }

    #[test]
    fn judge_run_window_too_long_memory_low_is_cpu_bound() {
        let v = judge_run(&ok(11.5, 300), Some(&ok(10.0, 300)), 512 * MIB);
        assert!(!v.passed);
        assert!(v.cpu_bound, "{v:?}");
        assert_eq!(v.reasons.len(), 1);
        assert!(v.reasons[0].contains("1.15×"), "{:?}", v.reasons);
    }

    #[test]
    fn judge_run_window_too_long_memory_at_budget_is_not_cpu_bound() {
        let v = judge_run(&ok(11.5, 500), Some(&ok(10.0, 900)), 512 * MIB);
        assert!(!v.passed);
        assert!(!v.cpu_bound, "{v:?}");
    }

    #[test]
    fn judge_run_window_too_long_memory_low_cores_idle_is_not_cpu_bound() {
        // The governed run at 24 VMs: memory peaked at 79%, 0.85 of 2 cores busy.
        let mut held = ok(83.4, 403);
        held.cpu_share = 0.42;
        let v = judge_run(&held, Some(&ok(58.1, 300)), 512 * MIB);
        assert!(!v.passed);
        assert!(!v.cpu_bound, "{v:?}");
        let mut unmeasured = ok(11.5, 300);
        unmeasured.cpu_share = f64::NAN;
        assert!(!judge_run(&unmeasured, Some(&ok(10.0, 300)), 512 * MIB).cpu_bound);
    }

    #[test]
    fn judge_run_oom_kill_fails_naming_the_vm() {
        let killed = Facts {
            passed: false,
            failures: vec![
                "VM 2 (replay-x-2): killed by the kernel's OOM killer (oom_kill 1)".into(),
            ],
            oom_kills: 1,
            oom_killed: vec!["VM 2 (replay-x-2): oom_kill 1".into()],
            window_s: 10.0,
            peak_bytes: (510 * MIB) as f64,
            cpu_share: 0.5,
        };
        let v = judge_run(&killed, Some(&ok(10.0, 900)), 512 * MIB);
        assert!(!v.passed);
        assert!(!v.cpu_bound);
        assert_eq!(
            v.reasons,
            vec!["1 OOM kill(s): VM 2 (replay-x-2): oom_kill 1".to_owned()]
        );
    }

    #[test]
    fn judge_run_failed_check_and_long_window_is_not_cpu_bound() {
        let mut sampled = ok(12.0, 100);
        sampled.passed = false;
        sampled.failures = vec!["sampling failed: 3 gaps".into()];
        let v = judge_run(&sampled, Some(&ok(10.0, 100)), 512 * MIB);
        assert!(!v.passed);
        assert!(!v.cpu_bound);
        assert_eq!(v.reasons.len(), 2, "{:?}", v.reasons);
    }

    #[test]
    fn judge_run_without_reference_fails() {
        let v = judge_run(&ok(10.0, 100), None, 512 * MIB);
        assert!(!v.passed);
        assert!(v.ratio.is_nan());
        let mut broken = ok(10.0, 100);
        broken.passed = false;
        let v = judge_run(&ok(10.0, 100), Some(&broken), 512 * MIB);
        assert!(!v.passed);
        assert!(v.reasons[0].starts_with("the unbudgeted run failed"));
    }

    #[test]
    fn judge_size_one_failed_round_fails_with_its_round() {
        let pass = judge_run(&ok(10.0, 100), Some(&ok(10.0, 100)), 512 * MIB);
        let slow = judge_run(&ok(12.0, 100), Some(&ok(10.0, 100)), 512 * MIB);
        let v = size(4, &[pass.clone(), slow, pass]);
        assert!(!v.passed);
        assert_eq!(v.cpu_bound_rounds, vec![1]);
        assert!(
            v.reasons[0].starts_with("round 2: window"),
            "{:?}",
            v.reasons
        );
        assert!(!judge_size(4, &[]).passed);
    }

    #[test]
    fn density_all_pass_is_largest_n() {
        let pass = judge_run(&ok(10.0, 100), Some(&ok(10.0, 100)), 512 * MIB);
        let sizes: Vec<SizeVerdict> = [1, 2, 4]
            .iter()
            .map(|&n| size(n, std::slice::from_ref(&pass)))
            .collect();
        let d = density(&sizes);
        assert_eq!((d.vms, d.stopped_at, d.cpu_limit_at), (4, None, None));
    }

    #[test]
    fn density_stops_at_first_failure() {
        let pass = judge_run(&ok(10.0, 100), Some(&ok(10.0, 100)), 512 * MIB);
        let slow = judge_run(&ok(12.0, 100), Some(&ok(10.0, 100)), 512 * MIB);
        let sizes = vec![
            size(1, std::slice::from_ref(&pass)),
            size(2, std::slice::from_ref(&pass)),
            size(4, &[slow]),
            // Counted for nothing: the sweep stopped before it.
            size(6, &[pass]),
        ];
        let d = density(&sizes);
        assert_eq!((d.vms, d.stopped_at, d.cpu_limit_at), (2, Some(4), Some(4)));
    }

    #[test]
    fn density_first_size_fails_is_zero() {
        let killed = Facts {
            oom_kills: 1,
            ..ok(10.0, 512)
        };
        let v = judge_run(&killed, Some(&ok(10.0, 100)), 512 * MIB);
        let d = density(&[size(1, &[v])]);
        assert_eq!((d.vms, d.stopped_at, d.cpu_limit_at), (0, Some(1), None));
    }

    #[test]
    fn at_least_times_open_sweeps_are_not_measured() {
        let d = |vms, stopped_at| Density {
            vms,
            stopped_at,
            cpu_limit_at: None,
        };
        assert_eq!(at_least_times(&d(24, Some(32)), &d(6, Some(8)), 4), "met");
        assert_eq!(
            at_least_times(&d(16, Some(24)), &d(6, Some(8)), 4),
            "missed"
        );
        // Off passed every N: governed's 24 is ≥ 4 × a lower bound only.
        assert_eq!(at_least_times(&d(24, None), &d(6, None), 4), "not measured");
        assert_eq!(
            at_least_times(&d(24, Some(32)), &d(6, None), 4),
            "not measured"
        );
        // Governed stopped below 4 × even a lower bound of off's.
        assert_eq!(at_least_times(&d(16, Some(24)), &d(6, None), 4), "missed");
        assert_eq!(at_least_times(&d(0, Some(1)), &d(0, Some(1)), 4), "missed");
    }
}
