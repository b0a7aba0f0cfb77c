//! Where resume + task goes: the breakdown table and its explanation, every figure in the
//! text computed from the runs.

use std::fmt::Write as _;

use crate::report::{fig, med, Context};
use crate::results::Results;
use crate::targets::RATIO_TARGET;
use crate::Content;

/// `lo–hi` of some figures (`lo to hi` with signs when one is negative).
fn span(v: &[f64], d: usize) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let d = if lo < 0.0 { d.max(1) } else { d };
    let (a, b) = (format!("{lo:.d$}"), format!("{hi:.d$}"));
    if v.is_empty() {
        "–".into()
    } else if a == b {
        a
    } else if lo < 0.0 {
        format!("{lo:+.d$} to {hi:+.d$}")
    } else {
        format!("{a}–{b}")
    }
}

const ROWS: [(&str, &str, usize); 22] = [
    ("never-offloaded task", "base.task_ms", 1),
    ("`touch` of the data, warm VM", "base.touch_ms", 1),
    ("**eager**: resume + task", "{n}-eager.resume_task_ms", 1),
    (
        "– the eager load (the resume call)",
        "{n}-eager.resume_ms",
        1,
    ),
    (
        "– the task after it, minus the never-offloaded task",
        "{n}-eager.task_extra_ms",
        1,
    ),
    (
        "`touch` right after an eager load",
        "touch-{n}-eager.touch_cmd_ms",
        1,
    ),
    (
        "– userfaultfd faults during it",
        "touch-{n}-eager.faults_copy",
        0,
    ),
    (
        "– minus the warm `touch`: re-entry",
        "touch-{n}-eager.touch_extra_ms",
        1,
    ),
    (
        "– re-entry per 4 KiB page (µs)",
        "touch-{n}-eager.touch_extra_us_per_page",
        2,
    ),
    (
        "task after that `touch`, minus the never-offloaded task",
        "touch-{n}-eager.task_extra_ms",
        1,
    ),
    (
        "eager resume + task − load − re-entry − never-offloaded task",
        "{n}-eager.rest_ms",
        1,
    ),
    ("**lazy**: resume + task", "{n}-lazy.resume_task_ms", 1),
    ("– the resume call", "{n}-lazy.resume_ms", 2),
    (
        "– copy faults served while the guest waited",
        "{n}-lazy.faults_copy",
        0,
    ),
    (
        "– pages installed by the prefetcher",
        "{n}-lazy.prefetch_pages",
        0,
    ),
    (
        "– mean fault latency, pager (µs)",
        "{n}-lazy.fault_mean_us",
        0,
    ),
    (
        "`touch` right after a lazy resume",
        "touch-{n}-lazy.touch_cmd_ms",
        1,
    ),
    ("– copy faults during it", "touch-{n}-lazy.faults_copy", 0),
    (
        "– minus the warm `touch`",
        "touch-{n}-lazy.touch_extra_ms",
        1,
    ),
    (
        "task after that `touch`, minus the never-offloaded task",
        "touch-{n}-lazy.task_extra_ms",
        1,
    ),
    (
        "store in the page cache at the resume (MiB, `mincore`)",
        "{n}-lazy.store_cached_mib",
        2,
    ),
    ("store's allocated size (MiB)", "{n}-lazy.backing_mib", 2),
];

const CODECS: [&str; 2] = ["raw", "lz4"];

/// The load against its floor (issue 35), same columns.
const FLOOR_ROWS: [(&str, &str, usize); 11] = [
    (
        "stored blocks read (MiB, zero blocks left out)",
        "floor-{n}.floor_mib",
        1,
    ),
    (
        "store in the page cache before the read (MiB, `mincore`)",
        "floor-{n}.floor_store_cached_mib",
        2,
    ),
    (
        "floor: read them cold through the pager's reader",
        "floor-{n}.floor_read_ms",
        1,
    ),
    (
        "floor: install them with `UFFDIO_COPY`",
        "floor-{n}.floor_install_ms",
        1,
    ),
    ("**floor**", "floor-{n}.floor_ms", 1),
    ("eager resume call", "{n}-eager.resume_ms", 1),
    (
        "eager load: resume + task − never-offloaded task − re-entry",
        "{n}-eager.load_ms",
        1,
    ),
    ("– over its floor (×)", "{n}-eager.load_floor", 2),
    (
        "lazy load: resume + task − never-offloaded task − re-entry",
        "{n}-lazy.load_ms",
        1,
    ),
    ("– over its floor (×)", "{n}-lazy.load_floor", 2),
    (
        "re-entry (from the eager `touch` case)",
        "touch-{n}-eager.touch_extra_ms",
        1,
    ),
];

/// The medians of a key pattern (`{n}` stands for the codec) in the four columns, for the text.
fn medians(results: &Results, pattern: &str) -> Vec<f64> {
    Content::ALL
        .iter()
        .flat_map(|c| CODECS.map(|n| (c.name(), n)))
        .filter_map(|(c, n)| med(results, &format!("vm.{c}.{}", pattern.replace("{n}", n))))
        .collect()
}

/// One table row per `(label, key pattern, decimals)`, a column per content and codec.
fn table(t: &mut String, results: &Results, rows: &[(&str, &str, usize)]) {
    t.push_str(
        "| quantity | repeated, raw | repeated, lz4 | random, raw | random, lz4 |\n\
         |---|---:|---:|---:|---:|\n",
    );
    for (label, pattern, d) in rows {
        let _ = write!(t, "| {label} |");
        for content in Content::ALL {
            for codec in CODECS {
                let key = format!("vm.{}.{}", content.name(), pattern.replace("{n}", codec));
                let _ = write!(t, " {} |", fig(results, &key, *d));
            }
        }
        t.push('\n');
    }
}

pub fn breakdown(t: &mut String, results: &Results, cx: &Context<'_>) {
    t.push_str(
        "## Where resume + task goes\n\nIn process; median (min–max) over the runs, ms unless \
         stated.\n\n",
    );
    table(t, results, &ROWS);
    let pick = |pattern: &str| medians(results, pattern);
    let r0 = |pattern: &str| span(&pick(pattern), 0);
    let reentry = pick("touch-{n}-eager.touch_extra_ms");
    let budget: Vec<f64> = Content::ALL
        .iter()
        .filter_map(|c| med(results, &format!("vm.{}.base.task_ms", c.name())))
        .map(|b| b * (RATIO_TARGET - 1.0))
        .collect();
    let min_reentry = reentry.iter().copied().fold(f64::INFINITY, f64::min);
    let max_budget = budget.iter().copied().fold(0.0, f64::max);
    let exceeds = min_reentry > max_budget;
    let _ = writeln!(
        t,
        "\n**Eager resume.** Resume + task is the eager load, then the guest re-entering its \
         reloaded memory, then the task as on a never-offloaded VM. The load of the {} MiB (the \
         resume call) took {} ms (medians of the four columns). The guest's first pass over the \
         reloaded data then costs {} ms more than on the warm VM, {} µs per 4 KiB page, with no \
         userfaultfd fault at all (every page is installed by then): it is KVM's own cost. The \
         offload dropped every page (`MADV_DONTNEED`), which also zaps KVM's mappings of them, and \
         this host's KVM has no two-dimensional paging ({}), so it maps guest memory through \
         shadow page tables, rebuilt one exit per 4 KiB page. The guest maps its memory with 2 MiB \
         pages, but the host backs it with 4 KiB pages (each `UFFDIO_COPY` installs 4 KiB pages), \
         so KVM maps at most 4 KiB per exit. Once that pass is done, the task costs what it costs \
         on the never-offloaded VM (task after the `touch` minus the never-offloaded task: {} ms). \
         Load, re-entry and the never-offloaded task, each measured in its own VM of the same run, \
         leave {} ms of the eager resume + task unaccounted for (noise of three measurements, and \
         whatever else the first task after a load pays). \
         The {RATIO_TARGET}× target leaves 0.3 × the never-offloaded task, {} ms; the re-entry \
         alone {}.\n",
        cx.settings.app >> 20,
        r0("{n}-eager.resume_ms"),
        span(&reentry, 0),
        span(&pick("touch-{n}-eager.touch_extra_us_per_page"), 1),
        crate::report::paging(cx.machine),
        r0("touch-{n}-eager.task_extra_ms"),
        span(&pick("{n}-eager.rest_ms"), 0),
        span(&budget, 0),
        if exceeds {
            "exceeds it, before any byte is loaded: no faster load can meet the target on this host"
        } else {
            "fits in it; the load is what the target leaves no room for"
        }
    );
    let cached = pick("{n}-lazy.store_cached_mib");
    let max_cached = cached.iter().copied().fold(0.0, f64::max);
    let from = if max_cached < 1.0 {
        "none of it was in the page cache at the resume (`mincore`), so every fault and prefetch \
         reads the disk"
    } else {
        "part or all of it was in the page cache at the resume (`mincore`, table)"
    };
    let small = match (
        med(results, "vm.repeated.lz4-lazy.fault_mean_us"),
        med(results, "vm.repeated.raw-lazy.fault_mean_us"),
        med(results, "vm.repeated.lz4-lazy.backing_mib"),
        med(results, "vm.repeated.raw-lazy.backing_mib"),
    ) {
        (Some(lz4), Some(raw), Some(small), Some(large)) => format!(
            " (with repeated content a fault took {lz4:.0} µs on the {small:.2} MiB lz4 store, \
             {raw:.0} µs on the {large:.0} MiB raw one)"
        ),
        _ => String::new(),
    };
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (lazy, eager) = (
        mean(&pick("{n}-lazy.resume_task_ms")),
        mean(&pick("{n}-eager.resume_task_ms")),
    );
    let versus = if lazy < eager * 0.85 {
        "less than"
    } else if lazy > eager * 1.15 {
        "more than"
    } else {
        "about as much as"
    };
    let _ = writeln!(
        t,
        "**Lazy resume.** The resume call returns at once; the guest then waits for a fault on any \
         block not yet installed while the prefetcher installs the rest in ascending order. During \
         resume + task {} faults were served while the guest waited (one 64 KiB block each), at a \
         mean of {} µs from the pager reading the fault to waking the guest, and the prefetcher \
         installed {} of the {} pages offloaded; the store is read for both, and {from}{small}. A `touch` right \
         after a lazy resume costs {} ms more than on the warm VM: the same re-entry as after an \
         eager load, plus the waits for faults and for the prefetcher. The task after that `touch` \
         costs {} ms more than the never-offloaded task. So lazy resume + task ({} ms) costs {versus} \
         eager's ({} ms): the load is paid either way — in the resume call, or while the guest runs \
         on {} CPUs beside the prefetcher and the fault thread — and the re-entry comes on top.\n",
        r0("{n}-lazy.faults_copy"),
        r0("{n}-lazy.fault_mean_us"),
        r0("{n}-lazy.prefetch_pages"),
        r0("{n}-lazy.offload_pages"),
        r0("touch-{n}-lazy.touch_extra_ms"),
        r0("touch-{n}-lazy.task_extra_ms"),
        r0("{n}-lazy.resume_task_ms"),
        r0("{n}-eager.resume_task_ms"),
        cx.run.machine.nproc
    );
    let base: Vec<String> = Content::ALL
        .iter()
        .map(|c| {
            let key = format!("vm.{}.base.task_ms", c.name());
            format!("{} {}", c.name(), fig(results, &key, 0))
        })
        .collect();
    let _ = writeln!(
        t,
        "**The baseline.** The never-offloaded task (digest, write 64 MiB, `fsync`, read back, \
         verify) took {} ms on the shared disk. It varies from run to run about as much as the differences measured, which is why \
         every ratio pairs a VM with the baseline of its own run and the verdict uses the median of \
         the ratios.\n",
        base.join(", ")
    );
    t.push_str(
        "**What would close the gap** (not changed by this bench): the re-entry is paid per 4 KiB \
         mapping, so backing guest RAM with 2 MiB pages (hugetlbfs, which userfaultfd serves a huge \
         page at a time, or a THP collapse after the load) would let KVM rebuild 32 mappings for \
         64 MiB instead of 16,384; `KVM_PRE_FAULT_MEMORY` would build them without guest exits but \
         needs two-dimensional paging (the capability is 0 here, see *Machine*); on a host with \
         EPT/NPT the rebuild is far cheaper to begin with. Keeping the store's page cache after an \
         offload would serve faults and prefetch at memory speed, at the cost of host memory that \
         the offload is meant to give back.\n",
    );
}

/// The load against its floor (issue 35, item 4): the table and what it says, every figure
/// computed from the runs.
pub fn floor(t: &mut String, results: &Results) {
    use crate::targets::LOAD_FLOOR_TARGET;
    t.push_str(
        "## The load against its floor\n\nIn process; median (min–max) over the runs, ms unless \
         stated.\n\n",
    );
    table(t, results, &FLOOR_ROWS);
    let pick = |pattern: &str| medians(results, pattern);
    let r0 = |pattern: &str| span(&pick(pattern), 0);
    let r2 = |pattern: &str| span(&pick(pattern), 2);
    // The columns whose median load is over the target, in words.
    let over = |mode: &str| -> String {
        let names: Vec<String> = Content::ALL
            .iter()
            .flat_map(|c| CODECS.map(|n| (c.name(), n)))
            .filter_map(|(c, n)| {
                let key = format!("vm.{c}.{n}-{mode}.load_floor");
                med(results, &key)
                    .filter(|&v| v > LOAD_FLOOR_TARGET)
                    .map(|v| format!("{c} {n}, {v:.2}×"))
            })
            .collect();
        if names.is_empty() {
            "within it in every column".to_owned()
        } else {
            format!("over it in {}", names.join(" and "))
        }
    };
    let threads = span(&pick("floor-{n}.floor_threads"), 0);
    let _ = writeln!(
        t,
        "\nA load reads what the offload stored and installs it. The floor measures the two apart \
         in a VM of its own in each run (`floor-raw`, `floor-lz4`): the same fill and offload, \
         then no resume. Every stored block is read, out of the page cache, through the pager's \
         own reader (its read path, checksums and decoding) by {threads} threads, as many as the \
         load uses, taking blocks in order from one counter as the eager load does ({} ms); then \
         as many bytes are installed with `UFFDIO_COPY`, block by block, by as many threads, into \
         fresh anonymous memory registered on a userfaultfd of the bench process ({} ms; no \
         guest, so no re-entry). The floor is the sum: a load whose threads overlap reading one \
         block with installing another can come in under it. The load itself is resume + task \
         less the never-offloaded task and the re-entry, each from its own VM of the same run; \
         the ratio is taken within each run, then summarised. Eager loads cost {}× their floor \
         (medians of the four columns), {}; lazy loads {}×, {} (the {LOAD_FLOOR_TARGET}× \
         target). The eager resume call alone (the load as the VMM sees it, with nothing else \
         running) took {} ms. A lazy load also pays for the guest waiting on faults while the \
         prefetcher, the fault thread and the vCPU share the machine's CPUs, and its figure \
         carries the noise of three VMs' measurements (see the min–max).\n",
        r0("floor-{n}.floor_read_ms"),
        r0("floor-{n}.floor_install_ms"),
        r2("{n}-eager.load_floor"),
        over("eager"),
        r2("{n}-lazy.load_floor"),
        over("lazy"),
        r0("{n}-eager.resume_ms"),
    );
    t.push_str(
        "**The re-entry is the host's.** Issue 35 quoted 15–20 ms for the C probe's pass over \
         64 MiB (`../shared/examples/hugepage_reentry_probe.c`) against our 62–64 ms. On this \
         machine the probe itself takes 42–95 ms for that pass after a refill with `UFFDIO_COPY` \
         (docs/governor.md, *Where the time goes*, measured side by side): the probe's lower \
         figure came from a host with another CPU. The re-entry above is what this host's KVM \
         charges for rebuilding 16,384 shadow mappings, not a cost of our pager, which is why \
         the target leaves it out.\n\n",
    );
}
