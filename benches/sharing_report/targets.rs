//! The figures derived round by round, and the verdict on each target of issue 6 that a
//! measured mode answers (targets of modes not built yet are left out).

use crate::results::{fig, num, secs, Results};
use crate::seed;
use crate::{Content, Mode, Point, Settings, BASE};

/// KSM's saving on identical repeated content at its first reading, % (at least).
pub const KSM_2S_SAVING_PCT: f64 = 60.0;
/// ksmd's busiest second while converging, % of one core (at most).
pub const KSMD_PEAK_PCT: f64 = 100.0;
/// Snapshot COW's saving on identical content, % (at least; four instances cap it at 75%).
pub const COW_SAVING_PCT: f64 = 72.0;

/// `CONTENT.MODE.POINT.QUANTITY`.
pub fn key(content: Content, mode: Mode, point: Point, quantity: &str) -> String {
    format!(
        "{}.{}.{}.{quantity}",
        content.name(),
        mode.key(),
        point.key()
    )
}

/// The modes measured in this run, in `Mode::ALL` order.
pub fn measured(results: &Results) -> Vec<Mode> {
    Mode::ALL
        .into_iter()
        .filter(|&mode| {
            Content::ALL
                .into_iter()
                .any(|c| results.has(&format!("{}.{}.start_s", c.name(), mode.key())))
        })
        .collect()
}

/// The key of the busiest second of ksmd while converging, highest over the contents.
pub fn peak_key(mode: Mode) -> String {
    format!("{}.converging.ksmd_peak_pct", mode.key())
}

/// Adds, round by round: every mode's saving per instance against the unshared group of the
/// same content and round (at the same reading where the unshared group has one, else
/// against its initial reading), and ksmd's busiest second over all contents.
pub fn derive(results: &mut Results, settings: &Settings) {
    let base_initial = BASE.initial(settings);
    for content in Content::ALL {
        for mode in Mode::ALL.into_iter().filter(|&m| m != BASE) {
            for point in settings.points(mode) {
                let at = key(content, BASE, point, "per_instance_mib");
                let base = if results.has(&at) {
                    at
                } else {
                    key(content, BASE, base_initial, "per_instance_mib")
                };
                let of = key(content, mode, point, "per_instance_mib");
                let saving = key(content, mode, point, "saving_pct");
                for round in 0..results.runs {
                    let value = |k: &str| results.values(k).get(round).copied();
                    if let (Some(m), Some(b)) = (value(&of), value(&base)) {
                        if !m.is_nan() && !b.is_nan() {
                            results.put(&saving, "%", round, (b - m) / b * 100.0);
                        }
                    }
                }
            }
        }
    }
    for mode in Mode::ALL.into_iter().filter(|m| m.ksm()) {
        for round in 0..results.runs {
            let peak = Content::ALL
                .into_iter()
                .filter_map(|c| {
                    let k = format!("{}.{}.converging.ksmd_peak_pct", c.name(), mode.key());
                    results.values(&k).get(round).copied()
                })
                .fold(f64::NAN, f64::max);
            if !peak.is_nan() {
                results.put(&peak_key(mode), "% of a core", round, peak);
            }
        }
    }
}

/// Groups of `mode` after which the KSM knobs were as before, and groups that checked.
pub fn restored(results: &Results, mode: Mode) -> (usize, usize) {
    let keys = Content::ALL.map(|c| format!("{}.{}.knobs_restored", c.name(), mode.key()));
    let checked = keys.iter().map(|k| results.summary(k).n).sum();
    let restored = keys.iter().map(|k| results.count(k, |v| v == 1.0)).sum();
    (restored, checked)
}

pub use crate::common::verdict::Verdict;
use crate::common::verdict::{result, Target, BOLD_PASS_FAIL};

pub fn verdicts(results: &Results, settings: &Settings) -> Vec<Verdict> {
    let mut out = Vec::new();
    for mode in measured(results).into_iter().filter(|m| m.ksm()) {
        let first = Point::Filled(settings.ksm_readings[0]);
        let initial = mode.initial(settings);
        let repeated = Content::Repeated;
        let saving = Target::at_least(key(repeated, mode, first, "saving_pct"), KSM_2S_SAVING_PCT);
        let (s, meeting, verdict) = saving.judge(results, BOLD_PASS_FAIL);
        out.push(Verdict {
            target: format!(
                "KSM saves ≥ {KSM_2S_SAVING_PCT:.0}% within {} s of the content being written, on identical \
                 repeated content (pvisor: {}% at 2 s, {}% at 60 s)",
                secs(settings.ksm_readings[0]),
                num(seed::KSM_2S_PCT, 1),
                num(seed::System::Ksm.saving(repeated, false), 1)
            ),
            figure: format!(
                "saves {}% {} s after the fills ({meeting} of {} rounds meet it): {} MiB per instance against {} MiB \
                 unshared, {} pages merged per VM; {}% {}",
                fig(results, &saving.key, 1),
                secs(settings.ksm_readings[0]),
                s.n,
                fig(results, &key(repeated, mode, first, "per_instance_mib"), 1),
                fig(
                    results,
                    &key(repeated, BASE, BASE.initial(settings), "per_instance_mib"),
                    1
                ),
                fig(results, &key(repeated, mode, first, "merging_pages"), 0),
                fig(results, &key(repeated, mode, initial, "saving_pct"), 1),
                initial.label()
            ),
            result: verdict,
        });

        let peak = Target::at_most(peak_key(mode), KSMD_PEAK_PCT);
        let (s, meeting, verdict) = peak.judge(results, BOLD_PASS_FAIL);
        let cpu: Vec<String> = Content::ALL
            .into_iter()
            .map(|c| {
                let k = format!("{}.{}.converging.ksmd_cpu_s", c.name(), mode.key());
                format!("{} {} s", c.name(), fig(results, &k, 2))
            })
            .collect();
        out.push(Verdict {
            target: "ksmd ≤ 1 core while converging".to_owned(),
            figure: format!(
                "busiest {} s of ksmd from the first fill to the {} reading, highest over the contents: {}% of a \
                 core (max {}; {meeting} of {} rounds meet it); ksmd CPU over that time: {}",
                secs(settings.peak_span),
                initial.label(),
                fig(results, &peak.key, 1),
                num(s.max, 1),
                s.n,
                cpu.join(", ")
            ),
            result: verdict,
        });

        let (restored, groups) = restored(results, mode);
        out.push(Verdict {
            target: "the previous KSM settings are restored when the last dedup VM exits".to_owned(),
            figure: format!(
                "restored after {restored} of {groups} groups (knobs read before the group's first VM started and \
                 after all its VM processes were gone; every group must pass)"
            ),
            result: result(groups > 0, restored == groups, BOLD_PASS_FAIL),
        });
    }
    let measured = measured(results);
    let identical = [Content::Repeated, Content::SameRandom];
    if measured.contains(&Mode::Snapshot) {
        let mode = Mode::Snapshot;
        let initial = mode.initial(settings);
        let mut ok = true;
        let parts: Vec<String> = identical
            .iter()
            .map(|&c| {
                let cow = Target::at_least(key(c, mode, initial, "saving_pct"), COW_SAVING_PCT);
                let (s, meeting, _) = cow.judge(results, BOLD_PASS_FAIL);
                ok &= s.n > 0 && cow.meets(s.median);
                let unshared = key(c, BASE, BASE.initial(settings), "per_instance_mib");
                format!(
                    "{} saves {}% ({meeting} of {} rounds meet it; {} MiB per instance against {} MiB)",
                    c.name(),
                    fig(results, &cow.key, 1),
                    s.n,
                    fig(results, &key(c, mode, initial, "per_instance_mib"), 1),
                    fig(results, &unshared, 1),
                )
            })
            .collect();
        out.push(Verdict {
            target: format!(
                "snapshot COW saves ≥ {COW_SAVING_PCT:.0}% on identical content (pvisor: {}% repeated, {}% same \
                 random; the limit with 4 instances is 75%)",
                num(seed::System::SnapshotCow.saving(Content::Repeated, false), 1),
                num(seed::System::SnapshotCow.saving(Content::SameRandom, false), 1),
            ),
            figure: parts.join("; "),
            result: result(true, ok, BOLD_PASS_FAIL),
        });
    }
    if measured.contains(&Mode::Pool) && measured.contains(&Mode::Snapshot) {
        let mut ok = true;
        let parts: Vec<String> = identical
            .iter()
            .map(|&c| {
                let [pool, cow] = [Mode::Pool, Mode::Snapshot]
                    .map(|m| key(c, m, m.initial(settings), "saving_pct"));
                let [p, s] = [&pool, &cow].map(|k| results.summary(k));
                ok &= p.n > 0 && s.n > 0 && p.median >= s.median;
                format!(
                    "{}: pool {}% vs snapshot COW {}%",
                    c.name(),
                    fig(results, &pool, 1),
                    fig(results, &cow, 1)
                )
            })
            .collect();
        out.push(Verdict {
            target: format!(
                "the memory pool saves at least as much as snapshot COW on identical content (pvisor's pool: \
                 {}% / {}%)",
                num(seed::System::Pool.saving(Content::Repeated, false), 1),
                num(seed::System::Pool.saving(Content::SameRandom, false), 1),
            ),
            figure: parts.join("; "),
            result: result(true, ok, BOLD_PASS_FAIL),
        });
    }
    out
}
