//! The targets of issue 4 and their verdicts.

use crate::report::fig;
use crate::results::Results;
use crate::{Codec, Content, Settings, MIB};

pub use crate::common::verdict::Verdict;
use crate::common::verdict::{result, BOLD_PASS_FAIL};

pub const RATIO_TARGET: f64 = 1.3;
/// Issue 14: resume + task on huge-page RAM.
pub const HUGE_RATIO_TARGET: f64 = 1.2;
/// Issue 14: synchronous faults of a lazy resume + task on huge-page RAM, per 64 MiB touched.
pub const HUGE_FAULTS_TARGET: f64 = 64.0;
/// Issue 35: the load itself (resume + task − the never-offloaded task − the re-entry) against
/// the floor of reading the store cold and installing it at the measured `UFFDIO_COPY` rate.
pub const LOAD_FLOOR_TARGET: f64 = 1.2;
pub const PSS_TARGET_MIB: f64 = 4.0;
pub const BACKING_TARGET_MIB: f64 = 1.0;

/// `**PASS**` or `**FAIL**`: a target measured or not, every figure it needs must meet it.
fn verdict(ok: bool) -> &'static str {
    result(true, ok, BOLD_PASS_FAIL)
}

pub fn verdicts(results: &Results, settings: &Settings) -> Vec<Verdict> {
    let mut out = Vec::new();
    let has_pvisor = settings.pvisor.is_ok();
    for codec in [Codec::Raw, Codec::Lz4] {
        let n = codec.name();
        let mut worst: f64 = 0.0;
        let mut parts = Vec::new();
        for content in Content::ALL {
            let c = content.name();
            let scope_key = if has_pvisor {
                format!("pvisor.{c}.{n}.pss_offloaded_mib")
            } else {
                format!("vm.{c}.{n}-lazy.pss_offloaded_mib")
            };
            worst = worst.max(results.summary(&scope_key).map_or(f64::INFINITY, |s| s.max));
            parts.push(format!(
                "{c} {} MiB; the bench process (its own code and data included) {} MiB",
                fig(results, &scope_key, 2),
                fig(results, &format!("vm.{c}.{n}-lazy.pss_offloaded_mib"), 2)
            ));
        }
        let scope = if has_pvisor {
            "`pvisor` process"
        } else {
            "bench process (pvisor part skipped)"
        };
        out.push(Verdict {
            target: format!(
                "memory charged (whole-process PSS: no cgroup, anonymous RAM) after a {n} offload \
                 ≤ {PSS_TARGET_MIB} MiB"
            ),
            figure: format!("{scope}: {}; largest {worst:.2} MiB", parts.join("; ")),
            result: verdict(worst <= PSS_TARGET_MIB),
        });
    }
    for codec in [Codec::Lz4, Codec::Zstd] {
        let n = codec.name();
        let keys = [
            format!("vm.repeated.{n}-lazy.backing_mib"),
            format!("pvisor.repeated.{n}.backing_mib"),
        ];
        let worst = keys
            .iter()
            .filter_map(|k| results.summary(k).map(|s| s.max))
            .fold(0.0, f64::max);
        let info = if codec == Codec::Zstd {
            " (for information)"
        } else {
            ""
        };
        out.push(Verdict {
            target: format!("backing of repeated content after a {n} offload ≤ {BACKING_TARGET_MIB} MiB{info}"),
            figure: format!(
                "in process {} MiB, pvisor process {} MiB; largest {:.2} MiB (random content: {} MiB)",
                fig(results, &keys[0], 2),
                fig(results, &keys[1], 2),
                worst,
                fig(results, &format!("vm.random.{n}-lazy.backing_mib"), 1)
            ),
            result: verdict(worst <= BACKING_TARGET_MIB),
        });
    }
    // Resume + task of `case` in `scope` (in process or in `pvisor`, said as `place`) within
    // `target`× the never-offloaded task, by its median over the runs, for both contents.
    let (vm, pvisor) = (("vm", "in process"), ("pvisor", "`pvisor` process"));
    let mut ratio = |(scope, place): (&str, &str), case: &str, what: String, target: f64| {
        out.push(median_verdict(
            results,
            &|c| format!("{scope}.{c}.{case}.ratio"),
            target,
            format!("resume + task ≤ {target}× the never-offloaded task, {place}, {what}"),
        ));
    };
    let offload = |case: &str| case.replace('-', " offload, ") + " resume";
    let cases = ["raw-lazy", "lz4-lazy", "raw-eager", "lz4-eager"];
    for case in cases {
        ratio(vm, case, offload(case), RATIO_TARGET);
    }
    for codec in ["raw", "lz4"].into_iter().filter(|_| has_pvisor) {
        let what = offload(&format!("{codec}-lazy"));
        ratio(pvisor, codec, what, RATIO_TARGET);
    }
    let zstd = offload("zstd-lazy") + " (for information)";
    ratio(vm, "zstd-lazy", zstd, RATIO_TARGET);
    let thp = "raw offload, eager resume, then MADV_COLLAPSE (for information: issue 14 asks \
               whether it pays)";
    ratio(vm, "thp-raw-eager", thp.to_owned(), RATIO_TARGET);
    for case in cases {
        let what = format!(
            "huge-page RAM (hugetlb), {}, against the never-offloaded task on it",
            offload(case)
        );
        ratio(vm, &format!("huge-{case}"), what, HUGE_RATIO_TARGET);
    }
    for codec in [Codec::Raw, Codec::Lz4] {
        for mode in ["lazy", "eager"] {
            let n = codec.name();
            out.push(median_verdict(
                results,
                &|c| format!("vm.{c}.{n}-{mode}.load_floor"),
                LOAD_FLOOR_TARGET,
                format!(
                    "the load ≤ {LOAD_FLOOR_TARGET}× its floor (reading the store cold + \
                     installing at the `UFFDIO_COPY` rate), in process, {n} offload, {mode} resume"
                ),
            ));
        }
    }
    // Synchronous faults per 64 MiB of data touched by the task after a lazy resume.
    let per_64 = 64.0 * MIB as f64 / settings.app as f64;
    let mut ok = true;
    let mut parts = Vec::new();
    for content in Content::ALL {
        for codec in [Codec::Raw, Codec::Lz4] {
            let key = format!(
                "vm.{}.huge-{}-lazy.faults_copy",
                content.name(),
                codec.name()
            );
            let Some(s) = results.summary(&key) else {
                ok = false;
                continue;
            };
            ok &= s.max * per_64 <= HUGE_FAULTS_TARGET;
            parts.push(format!(
                "{} {}: {:.0} (min {:.0}, max {:.0})",
                content.name(),
                codec.name(),
                s.median * per_64,
                s.min * per_64,
                s.max * per_64
            ));
        }
    }
    out.push(Verdict {
        target: format!(
            "≤ {HUGE_FAULTS_TARGET:.0} synchronous faults per 64 MiB touched, huge-page RAM, lazy \
             resume + task (every run)"
        ),
        figure: parts.join("; "),
        result: verdict(ok),
    });
    out
}

/// Whether the ratio at `key(content)` stays within `target` by its median over the runs, for
/// both contents.
fn median_verdict(
    results: &Results,
    key: &dyn Fn(&str) -> String,
    target: f64,
    label: String,
) -> Verdict {
    let mut ok = true;
    let mut parts = Vec::new();
    for content in Content::ALL {
        let key = key(content.name());
        let Some(s) = results.summary(&key) else {
            ok = false;
            continue;
        };
        ok &= s.median <= target;
        parts.push(format!(
            "{} {:.2}× (min {:.2}, max {:.2}; {} of {} runs meet it)",
            content.name(),
            s.median,
            s.min,
            s.max,
            results.count(&key, |v| v <= target),
            s.n
        ));
    }
    Verdict {
        target: label,
        figure: parts.join("; "),
        result: verdict(ok),
    }
}
