//! The figures derived round by round, and the verdict on each target of issue 5.

use crate::common::results::{fig, num, secs, signed, signed_fig, Results};
use crate::seed;
use crate::{Case, Settings, Variant, DEFAULT, MIB, VARIANTS};

/// Repeated content: the cold VM's memory at most this share of the default VM's, %.
pub const REPEATED_SAVING_PCT: f64 = 60.0;
/// Random content: the cold VM's memory at most this much above the default VM's, %.
pub const RANDOM_COST_PCT: f64 = 1.0;
/// Pager CPU while idle, once converged, % of one core.
pub const IDLE_CPU_PCT: f64 = 2.0;
/// Hot+cold: the share of the cold part that must be pooled, %.
pub const COLD_PART_POOLED_PCT: f64 = 90.0;

/// The variants with cold compression.
pub fn cold_variants() -> impl Iterator<Item = Variant> {
    VARIANTS.into_iter().filter(|v| v.cold)
}

/// Puts `key` = (`num` / `den` − 1) × 100 for every round that has both.
fn relative(results: &mut Results, key: &str, num: &str, den: &str) {
    let values: Vec<f64> = results
        .values(num)
        .iter()
        .zip(results.values(den))
        .map(|(&a, &b)| (a / b - 1.0) * 100.0)
        .collect();
    for (run, value) in values.into_iter().enumerate() {
        results.put(key, "%", run, value);
    }
}

/// Adds the per-round comparisons: every variant against the default VM of the same case and
/// round, a cold variant also against its plain twin (same RAM, no cold compression).
pub fn derive(results: &mut Results) {
    for case in Case::ALL {
        let c = case.name();
        let base = |q: &str| format!("{c}.{}.{q}", DEFAULT.key);
        for variant in VARIANTS.into_iter().filter(|&v| v != DEFAULT) {
            let k = |q: &str| format!("{c}.{}.{q}", variant.key);
            if !results.has(&k("memory_mib")) {
                continue;
            }
            for (quantity, of) in [
                ("change_pct", "memory_mib"),
                ("pss_change_pct", "pss_mib"),
                ("after_touch_change_pct", "after_touch_memory_mib"),
            ] {
                relative(results, &k(quantity), &k(of), &base(of));
            }
            for (quantity, of) in [
                ("touch_ratio", "touch_ms"),
                ("hot_touch_ratio", "hot_touch_ms"),
                ("hot_touch_idle_ratio", "hot_touch_idle_ms"),
            ] {
                if results.has(&k(of)) {
                    results.ratio(&k(quantity), &k(of), &base(of), "×");
                }
            }
            if let Some(plain) = variant.plain().filter(|&p| p != DEFAULT) {
                let p = |q: &str| format!("{c}.{}.{q}", plain.key);
                for (quantity, of) in [
                    ("vs_plain_pct", "memory_mib"),
                    ("pss_vs_plain_pct", "pss_mib"),
                    ("after_touch_vs_plain_pct", "after_touch_memory_mib"),
                ] {
                    if results.has(&p(of)) {
                        relative(results, &k(quantity), &k(of), &p(of));
                    }
                }
            }
        }
    }
}

pub use crate::common::verdict::Verdict;
use crate::common::verdict::{result, Target, Words, BOLD_PASS_FAIL};

/// The words of the verdicts of a variant the targets are not judged on: in plain type.
const FOR_INFORMATION: Words = [
    "NOT MEASURED",
    "pass (for information)",
    "fail (for information)",
];

pub fn verdicts(results: &Results, settings: &Settings) -> Vec<Verdict> {
    let mut out = Vec::new();
    for variant in cold_variants() {
        let v = variant.key;
        let words = if variant.judged {
            BOLD_PASS_FAIL
        } else {
            FOR_INFORMATION
        };
        let who = match (cold_variants().count() > 1, variant.judged) {
            (false, _) => String::new(),
            (true, true) => format!(" ({})", variant.describe()),
            (true, false) => format!(" ({}; for information)", variant.describe()),
        };
        let k = |case: Case, q: &str| format!("{}.{v}.{q}", case.name());
        let memory = |case: Case| {
            format!(
                "{} MiB vs the default VM's {} MiB",
                fig(results, &k(case, "memory_mib"), 1),
                fig(
                    results,
                    &format!("{}.{}.memory_mib", case.name(), DEFAULT.key),
                    1
                )
            )
        };

        let saving = Target::at_most(k(Case::Repeated, "change_pct"), -REPEATED_SAVING_PCT);
        let (s, meeting, verdict) = saving.judge(results, words);
        let seed = seed::figure(Case::Repeated).change_pct();
        out.push(Verdict {
            target: format!(
                "repeated content saves ≥ {REPEATED_SAVING_PCT:.0}% of the default run's memory{who} (pvisor: {:.1}%)",
                -seed
            ),
            figure: format!(
                "saves {}% (min {}, max {}; {meeting} of {} rounds meet it); {}; by PSS alone {}%",
                num(-s.median, 1),
                num(-s.max, 1),
                num(-s.min, 1),
                s.n,
                memory(Case::Repeated),
                signed_fig(results, &k(Case::Repeated, "pss_change_pct"), 1)
            ),
            result: verdict,
        });

        let cost = Target::at_most(k(Case::Random, "change_pct"), RANDOM_COST_PCT);
        let (s, meeting, verdict) = cost.judge(results, words);
        let seed = seed::figure(Case::Random).change_pct();
        out.push(Verdict {
            target: format!(
                "random content costs ≤ +{RANDOM_COST_PCT:.0}% of the default run's memory{who} (pvisor: +{seed:.1}%, later +{:.0}–{:.0}%)",
                seed::LATER_COST_PCT.0,
                seed::LATER_COST_PCT.1
            ),
            figure: format!(
                "{}% (min {}, max {}; {meeting} of {} rounds meet it); {}{}",
                signed(s.median, 2),
                signed(s.min, 2),
                signed(s.max, 2),
                s.n,
                memory(Case::Random),
                match variant.plain().filter(|&p| p != DEFAULT) {
                    Some(plain) => format!(
                        "; over the same VM on {} RAM without cold compression {}%",
                        plain.ram_name(),
                        signed_fig(results, &k(Case::Random, "vs_plain_pct"), 2)
                    ),
                    None => String::new(),
                }
            ),
            result: verdict,
        });

        let hot = Case::HotCold;
        let cold_part_mib = (settings.app - settings.hot) as f64 / MIB as f64;
        let hot_pooled = results.summary(&k(hot, "hot_pooled_max_mib"));
        let promotions = results.summary(&k(hot, "promotions"));
        let cold_part = results.summary(&k(hot, "cold_part_pooled_mib"));
        let ok = hot_pooled.max == 0.0
            && cold_part.median >= cold_part_mib * COLD_PART_POOLED_PCT / 100.0;
        out.push(Verdict {
            target: format!(
                "hot+cold keeps the hot {} MiB resident and compresses the cold part{who} (pvisor: saves {:.1}%)",
                settings.hot >> 20,
                -seed::figure(hot).change_pct()
            ),
            figure: format!(
                "hot part found pooled before any of its touches or at the end of the idle period: at most {} MiB; \
                 blocks brought back from the pool while idle (any block of RAM): at most {}; \
                 cold part pooled: {} of {cold_part_mib:.0} MiB (≥ {COLD_PART_POOLED_PCT:.0}% wanted); memory {}% ({}); \
                 `touch` of the hot part after the idle period {}× the default VM's",
                num(hot_pooled.max, 2),
                num(promotions.max, 0),
                fig(results, &k(hot, "cold_part_pooled_mib"), 1),
                signed_fig(results, &k(hot, "change_pct"), 1),
                memory(hot),
                fig(results, &k(hot, "hot_touch_ratio"), 2)
            ),
            result: result(hot_pooled.n > 0 && cold_part.n > 0, ok, words),
        });

        let (mut ok, mut measured, mut parts) = (true, true, Vec::new());
        for case in [Case::Repeated, Case::Random, Case::Distinct] {
            let idle = Target::at_most(k(case, "idle_cpu_pct"), IDLE_CPU_PCT);
            let (s, meeting, _) = idle.judge(results, words);
            (measured, ok) = (measured && s.n > 0, ok && idle.meets(s.median));
            parts.push(format!(
                "{} {}% (max {}; {meeting} of {} rounds meet it)",
                case.name(),
                num(s.median, 2),
                num(s.max, 2),
                s.n
            ));
        }
        out.push(Verdict {
            target: format!(
                "pager CPU while idle ≤ {IDLE_CPU_PCT:.0}% of one core once converged{who} (last {} s of the idle period)",
                secs(settings.window)
            ),
            figure: format!(
                "scanner + fault threads: {}; for information, hot-cold ({} MiB read every {:.0} ms, not idle) {}%",
                parts.join("; "),
                settings.hot >> 20,
                settings.tick.as_secs_f64() * 1e3,
                fig(results, &k(hot, "idle_cpu_pct"), 2)
            ),
            result: result(measured, ok, words),
        });
    }
    out
}
