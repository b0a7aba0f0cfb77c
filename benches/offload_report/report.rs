//! `docs/bench/offload.md`: what was measured, the table, the findings computed from it,
//! and how to rerun it.

use std::fmt::Write as _;

use crate::common::host::BenchRun;
use crate::common::results::{fig, num, Results};
use crate::common::verdict::Target;
use crate::{batch_key, Settings, MIB};

/// Target of issue 13: budgeted time per MiB at most this many times the unbudgeted.
const TARGET_RATIO: f64 = 1.3;

fn batch_name(batch: Option<u64>) -> String {
    batch.map_or("one batch (before)".to_owned(), |b| {
        format!("{} MiB batches", b >> 20)
    })
}

pub fn markdown(bench: &BenchRun, s: &Settings, r: &Results, filesystem: &str) -> String {
    let mut out = String::from("# Offload under a memory budget\n\n");
    out.push_str(&bench.generated("offload_report", s.runs));
    let touched = s.layout.touched() / MIB;
    let region = s.layout.region / MIB;
    let _ = write!(
        out,
        "\n`Pager::offload_with` of a {region} MiB anonymous region with {touched} MiB touched \
         (1 MiB chunks spread over it, four in nine random, the rest compressible), {} worker \
         threads, in a child process inside a cgroup v1 memory cgroup: *unbudgeted* (no \
         limit) and *budgeted* (limit = the cgroup's usage once the data is written + {} MiB; \
         no swap), interleaved in each round. Times are per touched MiB; the ratio is \
         budgeted / unbudgeted within a round. Peak is `memory.max_usage_in_bytes` over the \
         usage before the offload; `failcnt` counts the times the limit was hit.\n\n",
        s.threads,
        s.margin >> 20
    );
    out.push_str("## Findings\n\n");
    findings(&mut out, s, r);
    out.push_str("\n## Every case\n\n");
    out.push_str(
        "| codec | batches | unbudgeted ms/MiB | budgeted ms/MiB | ratio | peak unbudgeted MiB | \
         peak budgeted MiB | failcnt budgeted | OOM kills | batches committed |\n",
    );
    out.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    for codec in &s.codecs {
        for &batch in &s.batches {
            let key = format!("{codec}.{}", batch_key(batch));
            let kills: f64 = ["on", "off"]
                .iter()
                .flat_map(|b| r.values(&format!("{key}.{b}.oom_kills")).to_vec())
                .filter(|v| !v.is_nan())
                .sum();
            let _ = writeln!(
                out,
                "| {codec} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                batch_name(batch),
                fig(r, &format!("{key}.off.ms_per_mib"), 2),
                fig(r, &format!("{key}.on.ms_per_mib"), 2),
                fig(r, &format!("{key}.ratio"), 2),
                fig(r, &format!("{key}.off.peak_over_base_mib"), 1),
                fig(r, &format!("{key}.on.peak_over_base_mib"), 1),
                fig(r, &format!("{key}.on.failcnt"), 0),
                num(kills, 0),
                fig(r, &format!("{key}.off.batches"), 0),
            );
        }
    }
    let _ = write!(
        out,
        "\nOne index commit of a {region} MiB image's store ({} bytes of index, \
         `commit_uncached` of one changed block: index written, fsynced, renamed, directory \
         fsynced): {} ms.\n",
        num(r.summary("index.bytes").median, 0),
        fig(r, "index.commit_ms", 2),
    );
    let _ = write!(
        out,
        "\nThe write engine alone ({touched} MiB of random bytes in {} MiB batches to a fresh \
         file, each batch durable before the next, no page cache left): through the page \
         cache as the store does it (`pwrite`, `sync_file_range`, `POSIX_FADV_DONTNEED`, \
         `fdatasync`) {} ms/MiB; `O_DIRECT` (`pwrite` of an aligned buffer, `fdatasync`) {} \
         ms/MiB. The store appends payloads of any length end to end, so `O_DIRECT` would \
         also need aligned, padded appends.\n",
        uffd_pager::offload::DEFAULT_BATCH_BYTES >> 20,
        fig(r, "engine.buffered.ms_per_mib", 2),
        fig(r, "engine.direct.ms_per_mib", 2),
    );
    out.push_str("\n## Method\n\n");
    let _ = write!(
        out,
        "- `cargo bench --bench offload_report` (`OFFLOAD_BENCH_RUNS`, default 7; \
         `OFFLOAD_BENCH_MARGIN_MIB`, default 24; `--quick` or `OFFLOAD_BENCH_QUICK=1` for a \
         short run that writes no report). Needs root and the cgroup v1 memory controller at \
         `/sys/fs/cgroup/memory`; the bench creates a cgroup per offload and removes it.\n\
         - Each offload runs in a fresh child process (this bench re-executed) that joins its \
         cgroup before it allocates, so the cgroup is charged with its guest RAM, its page \
         cache and its buffers, nothing else. The store lives under `target/bench-tmp/` \
         ({filesystem}); the child syncs before the timed offload and checks every touched \
         byte after it (untimed).\n\
         - *One batch* is `Batching::WHOLE`: every block written and committed, then every \
         page dropped, the order of the offload before batches (the same store writes; only \
         the per-batch write-back and page-cache drop differ, and with one batch they happen \
         once, at the end).\n\
         - Not measured: io_uring (not built); `O_DIRECT` only as the engine alone above, \
         not in the store.\n\
         - The machine is shared with other work while the bench runs: the min–max spreads are \
         wide; compare medians, and the peaks, which do not depend on timing.\n"
    );
    out.push_str(&bench.machine_markdown());
    out
}

fn findings(out: &mut String, s: &Settings, r: &Results) {
    let default = Some(uffd_pager::offload::DEFAULT_BATCH_BYTES);
    for codec in &s.codecs {
        let new = format!("{codec}.{}", batch_key(default));
        let old = format!("{codec}.{}", batch_key(None));
        let need_new = r.summary(&format!("{new}.off.peak_over_base_mib")).median;
        let need_old = r.summary(&format!("{old}.off.peak_over_base_mib")).median;
        let commit = r.summary("index.commit_ms").median;
        let batches = r.summary(&format!("{new}.off.batches")).median;
        let total = r.summary(&format!("{new}.off.ms")).median;
        let _ = writeln!(
            out,
            "- **{codec}, memory the offload needs** (peak over the usage before it, \
             unbudgeted): {} MiB with {} against {} MiB with one batch ({}× less). Its {} index \
             commits at the median {} ms each are about {}% of the median {} ms offload.",
            num(need_new, 1),
            batch_name(default),
            num(need_old, 1),
            num(need_old / need_new, 1),
            num(batches, 0),
            num(commit, 2),
            num(100.0 * batches * commit / total, 0),
            num(total, 0),
        );
    }
    for codec in &s.codecs {
        let new = format!("{codec}.{}", batch_key(default));
        let old = format!("{codec}.{}", batch_key(None));
        let target = Target::at_most(format!("{new}.ratio"), TARGET_RATIO);
        // Not measured, it misses, as the report has always said.
        let verdict = target.judge(r, ["misses", "meets", "misses"]).2;
        let _ = writeln!(
            out,
            "- **{codec}, {} (the default)**: budgeted / unbudgeted {} ({verdict} the target \
             {}×); {} ms/MiB budgeted against {} unbudgeted; peak {} MiB over \
             the usage before the offload (budgeted), limit hit {} times.",
            batch_name(default),
            fig(r, &target.key, 2),
            target.short(),
            fig(r, &format!("{new}.on.ms_per_mib"), 2),
            fig(r, &format!("{new}.off.ms_per_mib"), 2),
            fig(r, &format!("{new}.on.peak_over_base_mib"), 1),
            fig(r, &format!("{new}.on.failcnt"), 0),
        );
        let kills: f64 = r
            .values(&format!("{old}.on.oom_kills"))
            .iter()
            .filter(|v| !v.is_nan())
            .sum();
        let _ = writeln!(
            out,
            "- **{codec}, one batch (before)**: budgeted / unbudgeted {}; {} ms/MiB budgeted \
             against {} unbudgeted; peak {} MiB unbudgeted; limit hit {} times; {} OOM kills \
             in {} budgeted runs.",
            fig(r, &format!("{old}.ratio"), 2),
            fig(r, &format!("{old}.on.ms_per_mib"), 2),
            fig(r, &format!("{old}.off.ms_per_mib"), 2),
            fig(r, &format!("{old}.off.peak_over_base_mib"), 1),
            fig(r, &format!("{old}.on.failcnt"), 0),
            num(kills, 0),
            s.runs,
        );
    }
}
