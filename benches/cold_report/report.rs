//! The Markdown report (the targets are in `targets`, the seed's figures in `seed`).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::common::host::BenchRun;
use crate::common::results::{fig, num, secs, signed, signed_fig, Results};
use crate::measure::timeline;
use crate::seed;
use crate::targets::{cold_variants, Verdict};
use uffd_pager::pager::RamKind;

use crate::{Case, Settings, Variant, DEFAULT, VARIANTS};

pub struct Context<'a> {
    pub settings: &'a Settings,
    /// The machine, the date, the time and CPU the bench took (or what a re-rendered report's
    /// run kept of them).
    pub run: &'a BenchRun,
    /// Variants the pager refused, and why.
    pub unsupported: &'a BTreeMap<&'static str, String>,
}

fn key(case: Case, variant: Variant, quantity: &str) -> String {
    format!("{}.{}.{quantity}", case.name(), variant.key)
}

/// The header of a table with one column per variant after `first`, then `extra` columns.
fn header(t: &mut String, first: &str, extra: &[&str]) {
    let _ = write!(t, "| {first} |");
    for v in VARIANTS {
        let _ = write!(t, " {}: {} |", v.key, v.describe());
    }
    for e in extra {
        let _ = write!(t, " {e} |");
    }
    t.push_str("\n|---|");
    for _ in 0..VARIANTS.len() + extra.len() {
        t.push_str("---:|");
    }
    t.push('\n');
}

/// A row: `label`, then `median (min–max)` of `quantity` for every variant.
fn variant_row(
    t: &mut String,
    results: &Results,
    label: &str,
    case: Case,
    quantity: &str,
    d: usize,
) {
    let _ = write!(t, "| {label} |");
    for v in VARIANTS {
        let _ = write!(t, " {} |", fig(results, &key(case, v, quantity), d));
    }
}

/// What a variant is, for the text: `*key*: …`.
fn variant_text(v: Variant) -> String {
    let ram = v.ram_name();
    if v == DEFAULT {
        format!(
            "*{}*: {ram} RAM, no cold compression (`pvisor run`'s default)",
            v.key
        )
    } else if !v.cold {
        format!(
            "*{}*: {ram} RAM, no cold compression (to tell the RAM kind's cost from compression's)",
            v.key
        )
    } else if v.judged {
        format!(
            "*{}*: {ram} RAM with cold compression, what `pvisor run --vm-cold-ram-compression` runs \
             ({ram} RAM is its default); the targets are judged on it",
            v.key
        )
    } else {
        format!(
            "*{}*: {ram} RAM with cold compression (`--vm-ram-backing {ram} --vm-cold-ram-compression`), \
             for information",
            v.key
        )
    }
}

pub fn markdown(results: &Results, verdicts: &[Verdict], cx: &Context<'_>) -> String {
    let s = cx.settings;
    let mut t = String::new();
    t.push_str("# Live cold-RAM compression: memory, CPU and touch latency — benchmark report\n\n");
    let _ = writeln!(t, "{}", cx.run.generated("cold_report", s.runs));
    t.push_str(
        "To reproduce (from the workspace root, as root, with `/dev/kvm` and `/dev/userfaultfd`):\n\n```sh\n\
         cargo bench --bench cold_report                       # 5 rounds, 12 s idle per VM (about 17 minutes)\n\
         COLD_BENCH_RUNS=9 COLD_BENCH_IDLE_S=20 cargo bench --bench cold_report\n\
         BENCH_RENDER=1 cargo bench --bench cold_report        # re-render this report from docs/bench/cold.csv, nothing run\n\
         ```\n\n",
    );
    let _ = writeln!(
        t,
        "One {} MiB VM (1 vCPU, the built-in workload guest) with {} MiB of application data, left idle for {} s \
         after `fill`, in the seed's four cold-compression cases, each run as: {}. \"Memory\" is the memory charged \
         for the VM (issue 35): it runs in no memory cgroup, so that is `process_memory_bytes`, what the VM \
         process really holds: its PSS with guest RAM counted as the bytes the host holds for it (see Method); \
         the process's PSS alone is a second table, for reference.\n",
        s.memory >> 20,
        s.app >> 20,
        secs(s.idle),
        VARIANTS.map(variant_text).join("; ")
    );
    t.push_str(&crate::common::verdict::table(
        "Targets (issue 5)",
        "figure: median (min–max) over the rounds",
        verdicts,
        false,
    ));
    t.push_str(
        "\nA memory target is judged on the median of the per-round changes (the cold VM over the default VM of \
         the same case in the same round, measured minutes apart at most); the figure says in how many rounds it \
         is met. Negative changes are savings.\n\n",
    );
    if !cx.unsupported.is_empty() {
        t.push_str("Variants the pager refused (skipped in every round):\n\n");
        for (variant, why) in cx.unsupported {
            let _ = writeln!(t, "- `{variant}`: {why}");
        }
        t.push('\n');
    }

    seed_table(&mut t, results, s);
    findings(&mut t, results, s);
    machine(&mut t, cx);
    method(&mut t, s);
    memory_tables(&mut t, results);
    cold_table(&mut t, results, s);
    cpu_table(&mut t, results, s);
    touch_table(&mut t, results, s);
    convergence(&mut t, results, s);
    t
}

fn seed_table(t: &mut String, results: &Results, s: &Settings) {
    let _ = writeln!(
        t,
        "## Beside the seed's figures\n\n\
         The seed (pvisor `--vm-cold-ram-compression`, `seeds/004_*.txt`: a Linux guest with 2 vCPUs on an AMD Ryzen 7 \
         9700X, one run per cell, read 5 s after the operation, the VM and management processes' PSS) and ours \
         (median (min–max) of {} rounds, read {} s after the fill). The seed's pager compressed private anonymous \
         RAM only, captured blocks while paused and kept a block only if `encoded + 256 ≤ decoded × 7/8` \
         (`REFERENCE.md`); its later published figures put live cold compression at **+{:.0}–{:.0}%** memory, no \
         saving at all.\n",
        s.runs,
        secs(s.idle),
        seed::LATER_COST_PCT.0,
        seed::LATER_COST_PCT.1
    );
    t.push_str(
        "| case | seed default MiB | seed cold MiB | seed change | our default MiB | our cold MiB | our change |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
    );
    for case in Case::ALL {
        for variant in cold_variants() {
            let sf = seed::figure(case);
            let label = if cold_variants().count() > 1 {
                format!("{} ({})", case.name(), variant.key)
            } else {
                case.name().to_owned()
            };
            let _ = writeln!(
                t,
                "| {label} | {:.1} | {:.1} | {}% | {} | {} | {}% |",
                sf.default_mib,
                sf.cold_mib,
                signed(sf.change_pct(), 1),
                fig(results, &key(case, DEFAULT, "memory_mib"), 1),
                fig(results, &key(case, variant, "memory_mib"), 1),
                signed_fig(results, &key(case, variant, "change_pct"), 1)
            );
        }
    }
    t.push_str(
        "\nThe seed's default VM held ~180 MiB (a Linux kernel, its page cache and the management process beside the \
         64 MiB); ours holds little more than the data, since the workload guest is a 2 KiB program (docs/vmm.md). \
         So the same bytes saved are a larger share of ours: compare the changes, knowing that ours are measured \
         against a smaller base. Our changes are per round, then summarised; the seed's are single readings.\n\n",
    );
}

/// What the figures below say beyond the targets, with their numbers. Every statement is
/// made only when the figures bear it out.
fn findings(t: &mut String, results: &Results, s: &Settings) {
    t.push_str("## Findings\n\n");
    let med = |key: &str| results.summary(key).median;
    for v in cold_variants() {
        let k = |case: Case, q: &str| key(case, v, q);
        let d = |case: Case, q: &str| key(case, DEFAULT, q);
        if results.summary(&k(Case::Repeated, "memory_mib")).n == 0 {
            continue;
        }
        let _ = writeln!(t, "{}:\n", v.describe());
        let (pss, real) = (
            med(&k(Case::Random, "pss_change_pct")),
            med(&k(Case::Random, "change_pct")),
        );
        if v.ram == RamKind::Memfd && pss < real - 10.0 {
            let _ = writeln!(
                t,
                "- **PSS alone misjudges memfd RAM.** With random content {} MiB of the data is pooled, yet the \
                 cold VM's PSS is {}% of the default VM's while what it really holds is {}%: its guest-RAM mapping \
                 has {} MiB of PSS but the memfd holds {} MiB. The blocks the scanner watches have no page-table \
                 entries, so they are in no PSS. Memory is judged by `process_memory_bytes` here.",
                fig(results, &k(Case::Random, "app_pooled_mib"), 1),
                signed_fig(results, &k(Case::Random, "pss_change_pct"), 1),
                signed_fig(results, &k(Case::Random, "change_pct"), 2),
                fig(results, &k(Case::Random, "guest_pss_mib"), 1),
                fig(results, &k(Case::Random, "guest_resident_mib"), 1),
            );
        }
        let ratio = med(&k(Case::Random, "touch_ratio"));
        if ratio.is_finite() {
            let head = if ratio >= 2.0 {
                "The first access after the idle period is slow, compressed or not."
            } else {
                "The first access after the idle period."
            };
            let why = if v.ram == RamKind::Memfd {
                " (on memfd RAM a block the scanner watches has no page-table entries: its first access \
                 faults)"
            } else {
                ""
            };
            let _ = writeln!(
                t,
                "- **{head}** `touch {} MiB` of random data ({} MiB of it pooled) took {} ms, {}× the default VM's, \
                 with {} MINOR faults{why} and {} faults that copied a block in. Over compressed data it took {} ms \
                 (repeated, {}×) and {} ms (distinct, {}×), with {} copying faults, {} MiB decompressed and {} ms of \
                 pager CPU (distinct).",
                s.app >> 20,
                fig(results, &k(Case::Random, "app_pooled_mib"), 1),
                fig(results, &k(Case::Random, "touch_ms"), 1),
                fig(results, &k(Case::Random, "touch_ratio"), 1),
                fig(results, &k(Case::Random, "touch_faults_minor"), 0),
                fig(results, &k(Case::Random, "touch_faults_copy"), 0),
                fig(results, &k(Case::Repeated, "touch_ms"), 1),
                fig(results, &k(Case::Repeated, "touch_ratio"), 1),
                fig(results, &k(Case::Distinct, "touch_ms"), 1),
                fig(results, &k(Case::Distinct, "touch_ratio"), 1),
                fig(results, &k(Case::Distinct, "touch_faults_copy"), 0),
                fig(results, &k(Case::Distinct, "touch_decompressed_mib"), 1),
                fig(results, &k(Case::Distinct, "touch_pager_cpu_ms"), 1),
            );
        }
        if results.summary(&k(Case::HotCold, "hot_touch_idle_ms")).n > 0 {
            let _ = writeln!(
                t,
                "- **Keeping data hot.** In *hot-cold* at most {} MiB of the hot part was found pooled in any round. \
                 Each `touch {} MiB` of it during the idle period took {} ms against {} ms on the default VM ({}×), \
                 with {} MINOR faults and {} blocks brought back from the pool per pass (a pass every {:.0} ms; the \
                 hot part is {} blocks); the pager used {}% of a core meanwhile.",
                num(results.summary(&k(Case::HotCold, "hot_pooled_max_mib")).max, 2),
                s.hot >> 20,
                fig(results, &k(Case::HotCold, "hot_touch_idle_ms"), 2),
                fig(results, &d(Case::HotCold, "hot_touch_idle_ms"), 2),
                fig(results, &k(Case::HotCold, "hot_touch_idle_ratio"), 1),
                fig(results, &k(Case::HotCold, "hot_touch_minor_faults"), 1),
                fig(results, &k(Case::HotCold, "hot_touch_promotions"), 1),
                s.tick.as_secs_f64() * 1e3,
                s.hot / (64 << 10),
                fig(results, &k(Case::HotCold, "idle_cpu_pct"), 2),
            );
        }
        let (thread, counter) = (
            med(&k(Case::Repeated, "idle_scanner_pct")),
            med(&k(Case::Repeated, "idle_scanner_counter_pct")),
        );
        if thread > 2.0 * counter {
            let _ = writeln!(
                t,
                "- **The scanner's own counter undercounts it.** Over the last {} s of the idle period the scanner \
                 thread used {}% of a core (repeated; schedstat) while `ColdStats::scanner_cpu_seconds` says {}%: the \
                 counter times the scans only, not the thread's wake-ups between them.",
                secs(s.window),
                fig(results, &k(Case::Repeated, "idle_scanner_pct"), 2),
                fig(results, &k(Case::Repeated, "idle_scanner_counter_pct"), 2),
            );
        }
        if med(&k(Case::Distinct, "after_touch_change_pct")) > 0.0 {
            let _ = writeln!(
                t,
                "- **Once everything is back, a little stays.** After the `touch` of all the data the cold VM holds {}% \
                 (distinct) and {}% (hot-cold) against the default VM; cold compression then still holds {} and {} MiB \
                 (the pool's slabs and index, and the tracking table).",
                signed_fig(results, &k(Case::Distinct, "after_touch_change_pct"), 1),
                signed_fig(results, &k(Case::HotCold, "after_touch_change_pct"), 1),
                fig(results, &k(Case::Distinct, "after_touch_pool_mib"), 2),
                fig(results, &k(Case::HotCold, "after_touch_pool_mib"), 2),
            );
        }
        let most = |q: &str| {
            Case::ALL
                .into_iter()
                .map(|c| results.summary(&k(c, q)).max)
                .filter(|v| v.is_finite())
                .fold(f64::NAN, f64::max)
        };
        if most("converged_s").is_finite() {
            let n = most("window_compressed");
            let window = if n == 0.0 {
                "no block was compressed during the CPU window in any round".to_owned()
            } else {
                format!("at most {n:.0} blocks were compressed during the CPU window in one round")
            };
            let _ = writeln!(
                t,
                "- **Convergence.** The last block was compressed at most {:.2} s into the idle period in any \
                 case and round (seen at {:.0} ms steps; a {} s cold age); {window}.",
                most("converged_s"),
                s.tick.as_secs_f64() * 1e3,
                secs(s.cold.cold_age),
            );
        }
        t.push('\n');
    }
}

fn machine(t: &mut String, cx: &Context<'_>) {
    t.push_str("## Machine\n\n");
    t.push_str(&cx.run.machine_markdown());
    t.push_str(
        "- the machine is a shared VM with KVM nested inside it (guest code at CPL3 runs natively, every exit goes \
         through two hypervisors): absolute times drift between rounds, ratios within a round much less.\n\n",
    );
}

fn method(t: &mut String, s: &Settings) {
    let c = &s.cold;
    t.push_str("## Method\n\n");
    let _ = writeln!(
        t,
        "Each round runs every case in every variant, one fresh VM at a time, in this process (`vmm::vm::Vm`, as \
         `pvisor run` does: 1 vCPU, 1 fault thread). Round *r* rotates the order of the cases by *r* and reverses \
         the order of the variants for odd *r*. Before each VM starts, `malloc_trim(0)` hands the previous VM's \
         freed buffers back, so that they do not count as this VM's memory.\n"
    );
    let _ = writeln!(
        t,
        "- **Cases** (the seed's four): `fill {app} MiB repeated|random|distinct seed={seed}; idle`; *hot-cold* fills \
         distinct data too, then, every {tick:.0} ms of the idle period, the host runs `touch {hot} MiB; idle` (the \
         guest reads the first {hot} MiB, then reports idle again), so {hot} MiB stay hot and {cold} MiB go cold. \
         *distinct* pages each hold a random word and a counter in every 64-byte line (they compress, but no two \
         are alike).",
        app = s.app >> 20,
        seed = s.seed,
        tick = s.tick.as_secs_f64() * 1e3,
        hot = s.hot >> 20,
        cold = (s.app - s.hot) >> 20
    );
    let _ = writeln!(
        t,
        "- **Variants**: {}. Cold compression runs at `ColdConfig::default()`, what `--vm-cold-ram-compression` \
         uses: cold age {:.1} s, a scan every {:.0} ms ({:.0} ms while the guest reports idle), CPU budget {:.0}% of \
         a core ({:.0}% idle), pool cap {:.0}% of guest RAM, a block kept compressed only if it shrinks to {}/{} of \
         its size, {:?}.",
        VARIANTS.map(variant_text).join("; "),
        c.cold_age.as_secs_f64(),
        c.scan_period.as_secs_f64() * 1e3,
        c.scan_period.as_secs_f64() * 1e3 / 4.0,
        c.cpu_budget * 100.0,
        c.idle_cpu_budget * 100.0,
        c.pool_cap_share * 100.0,
        c.max_ratio.0,
        c.max_ratio.1,
        c.codec
    );
    let _ = writeln!(
        t,
        "- **Idle period**: {} s from the end of `fill`, the same for every VM. With the default knobs a block is \
         compressed one cold age after the scan that probed it, and compression of the {} MiB runs at the idle \
         budget; the *Convergence* table below shows the memory second by second and when the last block was \
         compressed (`converged at`). {} s leaves several seconds of converged idling for the CPU figure.",
        secs(s.idle),
        s.app >> 20,
        secs(s.idle)
    );
    t.push_str(
        "- **Memory** (`Vm::stats`, at the end of the idle period): the headline is `process_memory_bytes`, the \
         process's PSS (`/proc/self/smaps_rollup`) with the guest-RAM mapping's PSS replaced by the bytes the host \
         really holds for guest RAM: the mapping's PSS for anonymous RAM, the memfd's allocated bytes (`st_blocks`) \
         for memfd RAM. PSS alone undercounts memfd RAM: cold compression watches a block by zapping its page-table \
         entries (the page cache keeps the bytes), so a watched but resident block is in no mapping's PSS. Both \
         are in the tables; the pool's memory and the tracking table are process heap/mappings and so in both. The \
         bench process is the VM process, so its own code and results (a few MiB, the same for every variant) are \
         included. Change = cold ÷ default − 1, per round.\n",
    );
    let _ = writeln!(
        t,
        "- **CPU**: the CPU time of the VM's pager threads, `uffd-cold` (the scanner) and `uffd-fault-N` (faults: \
         first touches, MINOR faults after a probe, decompression), from `/proc/self/task/TID/schedstat`, from \
         boot to the end of the idle period, and over its last {} s (idle CPU, as a share of one core). The \
         scanner's own counter (`ColdStats::scanner_cpu_seconds`, the scanner thread's CPU clock) is shown beside \
         it.",
        secs(s.window)
    );
    t.push_str(
        "- **Touch**: after the idle period (and, in *hot-cold*, a `touch` of the hot part), `touch` of all the data, \
         timed on the host around `Vm::exec`: every pooled block comes back through a fault. The pager's counters \
         before and after give the faults and the bytes decompressed.\n\
         - **Data**: then `digest`; every VM's digest must equal the digest of the bytes its fill writes, computed \
         on the host (`vmm::guest::fill_bytes`), so the cold VMs read back exactly what the default VMs do; any \
         difference, or any fault the pager could not serve, stops the bench.\n\n",
    );
}

fn memory_tables(t: &mut String, results: &Results) {
    let cold: Vec<Variant> = cold_variants().collect();
    let mut extra: Vec<String> = Vec::new();
    for v in &cold {
        extra.push(format!("{} vs default, %", v.key));
        if let Some(p) = v.plain().filter(|&p| p != DEFAULT) {
            extra.push(format!("{} vs {}, %", v.key, p.key));
        }
    }
    let extra_refs: Vec<&str> = extra.iter().map(String::as_str).collect();
    for (title, quantity, change, vs_plain, note) in [
        (
            "Memory charged at the end of the idle period (MiB; process memory, the VM runs in no cgroup)",
            "memory_mib",
            "change_pct",
            "vs_plain_pct",
            "",
        ),
        (
            "Process PSS at the end of the idle period (MiB, for reference)",
            "pss_mib",
            "pss_change_pct",
            "pss_vs_plain_pct",
            " PSS misses the memfd pages of blocks the scanner watches (resident, not mapped): \
             not a measure of what the host holds for memfd RAM.",
        ),
        (
            "Memory charged after `touch` of all the data (MiB)",
            "after_touch_memory_mib",
            "after_touch_change_pct",
            "after_touch_vs_plain_pct",
            " Every pooled block is back in guest RAM.",
        ),
    ] {
        let _ = writeln!(t, "## {title}\n\nMedian (min–max) over the rounds.{note}\n");
        header(t, "case", &extra_refs);
        for case in Case::ALL {
            variant_row(t, results, case.name(), case, quantity, 1);
            for v in &cold {
                let _ = write!(t, " {} |", signed_fig(results, &key(case, *v, change), 1));
                if v.plain().is_some_and(|p| p != DEFAULT) {
                    let _ = write!(t, " {} |", signed_fig(results, &key(case, *v, vs_plain), 2));
                }
            }
            t.push('\n');
        }
        t.push('\n');
        if quantity == "after_touch_memory_mib" {
            for v in &cold {
                let held: Vec<String> = Case::ALL
                    .into_iter()
                    .map(|case| {
                        format!(
                            "{} {}",
                            case.name(),
                            fig(results, &key(case, *v, "after_touch_pool_mib"), 2)
                        )
                    })
                    .collect();
                let _ = writeln!(
                    t,
                    "What cold compression still holds then ({}: the pool's slabs and index, and the tracking \
                     table), MiB: {}.\n",
                    v.key,
                    held.join("; ")
                );
            }
        }
    }
    t.push_str("Guest RAM alone (MiB): the bytes held (memfd `st_blocks` or the anonymous mapping's PSS), and the guest-RAM mapping's PSS.\n\n");
    header(t, "case, quantity", &[]);
    for case in Case::ALL {
        variant_row(
            t,
            results,
            &format!("{}: guest RAM held", case.name()),
            case,
            "guest_resident_mib",
            1,
        );
        t.push('\n');
        variant_row(
            t,
            results,
            &format!("{}: guest-RAM mapping PSS", case.name()),
            case,
            "guest_pss_mib",
            1,
        );
        t.push('\n');
    }
    t.push('\n');
}

fn cold_table(t: &mut String, results: &Results, s: &Settings) {
    for v in cold_variants() {
        let _ = writeln!(
            t,
            "## Cold compression at the end of the idle period ({})\n\nMedian (min–max) over the rounds. *pooled*: \
             pages whose block is in the pool (of RAM, and of the {} MiB of data); *pool*: the pool's memory (slabs \
             touched + index) and the payload it holds; *net saving*: pooled bytes − pool − tracking \
             (`ColdStats::net_saving_bytes`); *tries refused*: compression attempts refused as incompressible (each \
             backs the block off, doubling up to 64 cold ages).\n",
            v.describe(),
            s.app >> 20
        );
        t.push_str(
            "| case | pooled MiB | of the data, MiB | pool MiB | payload MiB | tracking KiB | net saving MiB | blocks compressed | tries refused | promotions | thrash / hot blocks |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for case in Case::ALL {
            let k = |q: &str| key(case, v, q);
            let _ = writeln!(
                t,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} |",
                case.name(),
                fig(results, &k("pooled_mib"), 1),
                fig(results, &k("app_pooled_mib"), 1),
                fig(results, &k("pool_held_mib"), 2),
                fig(results, &k("pool_stored_mib"), 2),
                fig(results, &k("tracking_kib"), 0),
                fig(results, &k("net_saving_mib"), 1),
                fig(results, &k("blocks_compressed"), 0),
                fig(results, &k("incompressible"), 0),
                fig(results, &k("promotions"), 0),
                fig(results, &k("thrash_promotions"), 0),
                fig(results, &k("hot_blocks"), 0),
            );
        }
        t.push('\n');
        let hc = |q: &str| key(Case::HotCold, v, q);
        let _ = writeln!(
            t,
            "*hot-cold*: hot part ({} MiB) pooled before any touch or at the end: at most {} MiB in any round; cold \
             part pooled {} of {} MiB; `touch {} MiB` during the idle period {} ms (default VM {} ms), right after it \
             {} ms (default VM {} ms, ratio {}×).\n",
            s.hot >> 20,
            num(results.summary(&hc("hot_pooled_max_mib")).max, 2),
            fig(results, &hc("cold_part_pooled_mib"), 1),
            (s.app - s.hot) >> 20,
            s.hot >> 20,
            fig(results, &hc("hot_touch_idle_ms"), 2),
            fig(results, &key(Case::HotCold, DEFAULT, "hot_touch_idle_ms"), 2),
            fig(results, &hc("hot_touch_ms"), 2),
            fig(results, &key(Case::HotCold, DEFAULT, "hot_touch_ms"), 2),
            fig(results, &hc("hot_touch_ratio"), 2),
        );
    }
}

fn cpu_table(t: &mut String, results: &Results, s: &Settings) {
    let _ = writeln!(
        t,
        "## Pager CPU\n\nSeconds of CPU from boot to the end of the idle period (fill included), and the share of \
         one core over the last {} s of the idle period. Median (min–max) over the rounds.\n",
        secs(s.window)
    );
    t.push_str(
        "| case | variant | pager CPU s | scanner s | fault threads s | idle: pager % of a core | idle: scanner % | idle: scanner's own counter % | compressed in the window, blocks | converged at, s |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for case in Case::ALL {
        for v in VARIANTS {
            let k = |q: &str| key(case, v, q);
            if !results.has(&k("pager_cpu_s")) {
                continue;
            }
            let _ = writeln!(
                t,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                case.name(),
                v.key,
                fig(results, &k("pager_cpu_s"), 3),
                fig(results, &k("scanner_thread_cpu_s"), 3),
                fig(results, &k("fault_threads_cpu_s"), 3),
                fig(results, &k("idle_cpu_pct"), 2),
                fig(results, &k("idle_scanner_pct"), 2),
                fig(results, &k("idle_scanner_counter_pct"), 2),
                fig(results, &k("window_compressed"), 0),
                fig(results, &k("converged_s"), 1),
            );
        }
    }
    t.push('\n');
}

fn touch_table(t: &mut String, results: &Results, s: &Settings) {
    let _ = writeln!(
        t,
        "## `touch {} MiB` after the idle period\n\nHost wall time of the command (ms), and for the cold variant \
         the ratio to the default VM of the same round, the faults it took, the bytes decompressed and the \
         pager's CPU time during it. Median (min–max) over the rounds.\n",
        s.app >> 20
    );
    let cold: Vec<Variant> = cold_variants().collect();
    let mut extra: Vec<String> = Vec::new();
    for v in &cold {
        for what in [
            "ratio to default",
            "MINOR faults",
            "faults copying",
            "MiB decompressed",
            "pager CPU ms",
        ] {
            extra.push(format!("{}: {what}", v.key));
        }
    }
    let extra_refs: Vec<&str> = extra.iter().map(String::as_str).collect();
    header(t, "case", &extra_refs);
    for case in Case::ALL {
        variant_row(t, results, case.name(), case, "touch_ms", 1);
        for v in &cold {
            let k = |q: &str| key(case, *v, q);
            let _ = write!(
                t,
                " {} | {} | {} | {} | {} |",
                fig(results, &k("touch_ratio"), 2),
                fig(results, &k("touch_faults_minor"), 0),
                fig(results, &k("touch_faults_copy"), 0),
                fig(results, &k("touch_decompressed_mib"), 1),
                fig(results, &k("touch_pager_cpu_ms"), 1),
            );
        }
        t.push('\n');
    }
    t.push('\n');
}

fn convergence(t: &mut String, results: &Results, s: &Settings) {
    let samples = s.samples();
    for v in cold_variants() {
        let _ = writeln!(
            t,
            "## Convergence ({})\n\nMemory (MiB) and pooled MiB, median over the rounds, at each second of the idle \
             period (the default VM's memory beside it).\n",
            v.describe()
        );
        t.push_str("| s |");
        for case in Case::ALL {
            let _ = write!(
                t,
                " {c}: default | {c}: cold | {c}: pooled |",
                c = case.name()
            );
        }
        t.push_str("\n|---:|");
        for _ in Case::ALL {
            t.push_str("---:|---:|---:|");
        }
        t.push('\n');
        for sample in 1..=samples {
            let _ = write!(t, "| {} |", num(sample as f64 * s.sample.as_secs_f64(), 1));
            for case in Case::ALL {
                let med = |variant: Variant, q: &str| {
                    num(
                        results.summary(&timeline(case, variant, sample, q)).median,
                        1,
                    )
                };
                let _ = write!(
                    t,
                    " {} | {} | {} |",
                    med(DEFAULT, "memory_mib"),
                    med(v, "memory_mib"),
                    med(v, "pooled_mib")
                );
            }
            t.push('\n');
        }
        t.push('\n');
    }
}
