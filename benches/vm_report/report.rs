//! The Markdown report (the targets are in `targets`, the breakdown in `breakdown`).

use std::fmt::Write as _;

use crate::chart::seed;
use crate::common::host::BenchRun;
use crate::host::Machine;
use crate::results::Results;
use crate::targets::Verdict;
use crate::{Content, Settings};

pub struct Context<'a> {
    pub settings: &'a Settings,
    /// The date and the time the bench took (or what a re-rendered report's run kept of them).
    pub run: &'a BenchRun,
    /// The items of the `## Machine` section (`machine_items`, or as a kept report gave them).
    pub machine: &'a str,
}

/// The CPU time the machine, this process and the host's steal took while the bench ran, s.
#[derive(Debug, Clone, Copy)]
pub struct CpuUsed {
    pub busy_s: f64,
    pub own_s: f64,
    pub steal_s: f64,
}

/// `median (min–max)` of a metric, or `–`.
pub fn fig(results: &Results, key: &str, digits: usize) -> String {
    results.summary(key).map_or_else(
        || "–".into(),
        |s| {
            let (median, min, max) = (
                num(s.median, digits),
                num(s.min, digits),
                num(s.max, digits),
            );
            let sep = if min.starts_with('-') { " to " } else { "–" };
            format!("{median} ({min}{sep}{max})")
        },
    )
}

/// `v` with `d` decimals; a value that rounds to zero reads as 0, not -0.
fn num(v: f64, d: usize) -> String {
    let text = format!("{v:.d$}");
    if text.parse::<f64>() == Ok(0.0) {
        text.trim_start_matches('-').to_owned()
    } else {
        text
    }
}

pub fn med(results: &Results, key: &str) -> Option<f64> {
    results.summary(key).map(|s| s.median)
}

/// A table row: quantity, then min/median/max for repeated and for random.
fn row(text: &mut String, results: &Results, label: &str, key: &dyn Fn(&str) -> String, d: usize) {
    let _ = write!(text, "| {label} |");
    for content in Content::ALL {
        match results.summary(&key(content.name())) {
            Some(s) => {
                let _ = write!(text, " {:.d$} | {:.d$} | {:.d$} |", s.min, s.median, s.max);
            }
            None => text.push_str(" – | – | – |"),
        }
    }
    text.push('\n');
}

const HEAD: &str = "| quantity | repeated min | median | max | random min | median | max |\n|---|---:|---:|---:|---:|---:|---:|\n";

pub fn markdown(results: &Results, verdicts: &[Verdict], cx: &Context<'_>) -> String {
    let s = cx.settings;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "# The VM: resident memory, offload and resume — benchmark report\n"
    );
    let _ = writeln!(t, "{}", cx.run.generated("vm_report", s.runs));
    t.push_str(
        "To reproduce (from the workspace root, as root, with `/dev/kvm` and `/dev/userfaultfd`):\n\n```sh\n\
         cargo build --release -p vmm --bin pvisor   # the bench drives target/release/pvisor too\n\
         cargo bench --bench vm_report                # 5 runs\n\
         VM_BENCH_RUNS=9 cargo bench --bench vm_report\n\
         BENCH_RENDER=1 cargo bench --bench vm_report # re-render this report from docs/bench/vm.csv, nothing run\n\
         ```\n\n",
    );
    let _ = writeln!(
        t,
        "One {} MiB VM with {} MiB of application data (`fill {} MiB repeated|random seed={}`), as \
         in the seed's single-VM table.\n",
        s.memory >> 20,
        s.app >> 20,
        s.app >> 20,
        s.seed
    );
    t.push_str(&crate::common::verdict::table(
        "Targets (issue 4)",
        "figure: median (min–max) over the runs",
        verdicts,
        false,
    ));
    t.push_str(
        "\nA ratio target passes when the median of the per-run ratios meets it for both contents \
         (the figure says in how many runs it is met); a size target is judged on the largest run. \
         Every ratio is resume + task of one VM divided by the task of a never-offloaded VM of the \
         same content in the same run, measured at most seconds apart, and only then summarised. \
         The headline is the memory charged for the real `pvisor` VM process (`pvisor stats`), since \
         the bench process also holds its own code and results: that VM runs in no memory cgroup and \
         on anonymous guest RAM, so its memory charged (`process_memory_bytes`: PSS with guest RAM \
         counted as the RAM the host holds for it) is its whole-process PSS, which is what this \
         run kept (issue 35).\n\n",
    );

    seed_table(&mut t, results);
    machine(&mut t, cx);
    method(&mut t, s);
    memory_tables(&mut t, results);
    time_tables(&mut t, results);
    crate::breakdown::breakdown(&mut t, results, cx);
    crate::breakdown::floor(&mut t, results);
    t
}

fn seed_table(t: &mut String, results: &Results) {
    t.push_str(
        "## Beside the seed's figures\n\nThe seed (pvisor, N=1, a real Linux guest on an AMD Ryzen 7 \
         9700X, read 5 s after each operation) and ours (the `pvisor` process, median (min–max)). \
         Both count the VM process's PSS; the seed's \"default\" also counts its management process.\n\n\
         | quantity | seed repeated | seed random | ours repeated | ours random |\n|---|---:|---:|---:|---:|\n",
    );
    let seeds = [seed(Content::Repeated), seed(Content::Random)];
    let rows: [(&str, [f64; 2], &str, usize); 12] = [
        (
            "resident MiB, default (running)",
            [181.4, 179.4],
            "base.pss_running_mib",
            1,
        ),
        (
            "resident MiB, after offload",
            [35.6, 35.8],
            "raw.pss_offloaded_mib",
            2,
        ),
        (
            "resident MiB, after compressed offload (lz4)",
            [39.8, 39.5],
            "lz4.pss_offloaded_mib",
            2,
        ),
        ("offload ms", [44.1, 98.1], "raw.offload_ms", 0),
        ("compressed offload ms", [739.4, 904.0], "lz4.offload_ms", 0),
        (
            "backing MiB, offload",
            [seeds[0][4], seeds[1][4]],
            "raw.backing_mib",
            1,
        ),
        (
            "backing MiB, compressed offload",
            [seeds[0][5], seeds[1][5]],
            "lz4.backing_mib",
            2,
        ),
        (
            "task ms, never offloaded",
            [276.5, 320.1],
            "base.task_ms",
            0,
        ),
        (
            "resume + task ms, after offload",
            [432.4, 498.2],
            "raw.resume_task_ms",
            0,
        ),
        (
            "resume + task ms, after compressed offload",
            [1730.3, 766.2],
            "lz4.resume_task_ms",
            0,
        ),
        (
            "ratio, after offload",
            [seeds[0][0], seeds[1][0]],
            "raw.ratio",
            2,
        ),
        (
            "ratio, after compressed offload",
            [seeds[0][1], seeds[1][1]],
            "lz4.ratio",
            2,
        ),
    ];
    for (label, seed, key, d) in rows {
        let _ = writeln!(
            t,
            "| {label} | {:.1} | {:.1} | {} | {} |",
            seed[0],
            seed[1],
            fig(results, &format!("pvisor.repeated.{key}"), d),
            fig(results, &format!("pvisor.random.{key}"), d)
        );
    }
    // In process, where the re-entry is measured, so that it can be stated apart.
    for (label, seed, key) in [
        (
            "ratio, after offload, in process",
            [seeds[0][0], seeds[1][0]],
            "raw-lazy.ratio",
        ),
        (
            "– the same, less the re-entry",
            [seeds[0][0], seeds[1][0]],
            "raw-lazy.ratio_less_reentry",
        ),
        (
            "ratio, after compressed offload, in process",
            [seeds[0][1], seeds[1][1]],
            "lz4-lazy.ratio",
        ),
        (
            "– the same, less the re-entry",
            [seeds[0][1], seeds[1][1]],
            "lz4-lazy.ratio_less_reentry",
        ),
    ] {
        let _ = writeln!(
            t,
            "| {label} | {:.2} | {:.2} | {} | {} |",
            seed[0],
            seed[1],
            fig(results, &format!("vm.repeated.{key}"), 2),
            fig(results, &format!("vm.random.{key}"), 2)
        );
    }
    t.push_str(
        "\nThe seed's ratios are its resume + task over its never-offloaded task (432.4 / 276.5 …). \
         Its task took 276–320 ms; ours takes far less (table below), so the same fixed resume cost \
         weighs more in our ratio: the seed's 1.3× budget was 83–96 ms of extra time, ours is 0.3× \
         our task. The seed ran a Linux guest, whose kernel, page cache and management process are \
         resident beside the 64 MiB; our workload guest is a 2 KiB program (docs/vmm.md), so our \
         running PSS is little more than the data itself, and the absolute figures compare the \
         designs less than the ratios do. The rows *in process* are the same ratios measured in \
         the bench process, where the re-entry is measured too (*The load against its floor*): \
         less the re-entry, they leave out what this host's KVM charges for rebuilding its shadow \
         mappings. The seed does not split its figures so.\n\n",
    );
}

fn machine(t: &mut String, cx: &Context<'_>) {
    let _ = writeln!(t, "## Machine\n");
    t.push_str(cx.machine);
    t.push('\n');
}

/// The items of the `## Machine` section of a run that took `elapsed_s` and `cpu`.
pub fn machine_items(m: &Machine, elapsed_s: f64, cpu: CpuUsed) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "- CPU: {} (`nproc`: {})", m.host.cpu, m.host.nproc);
    let _ = writeln!(
        t,
        "- kernel: {}; KVM: `{}`, `KVM_CAP_PRE_FAULT_MEMORY` = {}",
        m.host.kernel, m.paging, m.pre_fault
    );
    let _ = writeln!(t, "- memory: {}", m.host.memory);
    let _ = writeln!(
        t,
        "- temporary files: `target/bench-tmp/vm/` ({})",
        m.filesystem
    );
    let _ = writeln!(t, "- toolchain: {}; commit {}", m.host.rustc, m.host.commit);
    let _ = writeln!(t, "- `pvisor`: {}", m.pvisor);
    let wall = elapsed_s * m.host.nproc as f64;
    let _ = writeln!(
        t,
        "- CPU used, from `/proc/stat`: the whole machine {:.1} s of the {:.0} s the {} CPUs had during the runs, \
         of which this bench process {:.1} s (the detached `pvisor` processes are not its children and count \
         as others); the host's steal time {:.1} s",
        cpu.busy_s, wall, m.host.nproc, cpu.own_s, cpu.steal_s
    );
    t.push_str(
        "- the machine is a shared VM with KVM nested inside it: guest code at CPL3 runs natively, every \
         exit goes through two hypervisors. Absolute figures drift between runs; ratios within a run much less.\n",
    );
    t
}

/// KVM's paging as the `## Machine` items say it.
pub fn paging(machine: &str) -> &str {
    let after = machine.split_once("KVM: `").map_or("", |(_, rest)| rest);
    after
        .split_once('`')
        .map_or("unknown", |(paging, _)| paging)
}

/// The items of the `## Machine` section of a report `markdown`, as they are.
pub fn kept_machine(markdown: &str) -> Option<String> {
    let (_, rest) = markdown.split_once("## Machine\n\n")?;
    let items = rest.split_once("\n## ").map_or(rest, |(items, _)| items);
    Some(format!("{}\n", items.trim_end()))
}

fn method(t: &mut String, s: &Settings) {
    let _ = writeln!(t, "## Method\n");
    let _ = writeln!(
        t,
        "Each of the {} runs starts every VM afresh (one at a time), with its own new disk file and store \
         directory, and deletes them afterwards. Run *r* does the in-process part first for even *r* and \
         the `pvisor` part first for odd *r*, swaps the order of the two contents likewise, and rotates \
         the order of the cases by *r*. Before every timed section `sync` runs, untimed, so that no timed \
         `fsync` writes back data of an earlier case or another process.\n",
        s.runs
    );
    t.push_str(
        "- **In process** (`vmm::vm::Vm`, what `pvisor run` runs: 1 vCPU, anonymous guest RAM, 1 fault \
         thread, offload and eager load with one thread per CPU). *base*: boot, `fill`, `digest`, then \
         `task` (timed: the never-offloaded task), then `touch` of the application data (timed: the warm \
         VM). *CODEC-lazy|eager*: boot, `fill`, `digest`, `Vm::suspend(offload)` (raw, lz4 or zstd:3), \
         `Vm::stats`, then `Vm::resume(eager)` and `task`, timed from before the resume call to the end \
         of the task; the pager's counters (`vm.stats().pager`) before the resume and after the task \
         give the faults and prefetched pages. *touch-CODEC-lazy|eager*: the same offload and resume, \
         then `touch` of the application data (its own time, and the faults during it), then `task`. \
         The digest of every task is checked against the one taken before the offload.\n",
    );
    t.push_str(
        "- **`pvisor` process**: `target/release/pvisor run --detach --memory 512MiB [--vm-ram-compression \
         --vm-ram-codec lz4|zstd] -- fill …`, then `pvisor stats JOB` (running), `pvisor suspend JOB \
         --vm-offload` (its report gives the offload's time and write/drop split), `pvisor stats JOB` \
         (offloaded: the headline PSS), then resume (lazy) and `task` through the control socket with \
         `vmm::control::call` — the requests `pvisor resume` and `pvisor exec` send, without the time to \
         start a client process — timed from before the resume request to the task's reply. *base*: a \
         never-offloaded `pvisor` VM runs `task` the same way. Then `pvisor stop JOB`.\n",
    );
    t.push_str(
        "- **Quantities.** PSS: `process_pss_bytes` (`/proc/PID/smaps_rollup`) and `guest_ram_pss_bytes` \
         (the guest-RAM mapping) of `stats`; backing: the allocated blocks of every file in the store \
         directory (`backing_disk_bytes`); offload time: the `suspend` report's `elapsed_ms`, and the \
         pager's `write_ms` (write and commit) and `drop_ms` (drop the pages). Ratio: resume + task / the \
         never-offloaded task of the same content and run. MiB = 2^20 bytes.\n\n",
    );
}

fn memory_tables(t: &mut String, results: &Results) {
    t.push_str("## Resident memory and backing (MiB)\n\n");
    t.push_str(HEAD);
    let rows: [(&str, &str); 12] = [
        (
            "`pvisor` memory charged (process PSS), running (never offloaded)",
            "pvisor.{c}.base.pss_running_mib",
        ),
        (
            "`pvisor` guest-RAM PSS, running",
            "pvisor.{c}.base.guest_pss_running_mib",
        ),
        (
            "`pvisor` memory charged (process PSS) after raw offload",
            "pvisor.{c}.raw.pss_offloaded_mib",
        ),
        (
            "`pvisor` memory charged (process PSS) after lz4 offload",
            "pvisor.{c}.lz4.pss_offloaded_mib",
        ),
        (
            "`pvisor` memory charged (process PSS) after zstd offload",
            "pvisor.{c}.zstd.pss_offloaded_mib",
        ),
        (
            "`pvisor` guest-RAM PSS after raw offload",
            "pvisor.{c}.raw.guest_pss_offloaded_mib",
        ),
        (
            "`pvisor` memory charged (process PSS) after lazy resume + task (raw)",
            "pvisor.{c}.raw.pss_resumed_mib",
        ),
        (
            "bench process PSS, running (never offloaded)",
            "vm.{c}.base.pss_running_mib",
        ),
        (
            "bench process PSS after raw offload",
            "vm.{c}.raw-lazy.pss_offloaded_mib",
        ),
        (
            "bench process PSS after lz4 offload",
            "vm.{c}.lz4-lazy.pss_offloaded_mib",
        ),
        (
            "bench process PSS after zstd offload",
            "vm.{c}.zstd-lazy.pss_offloaded_mib",
        ),
        (
            "bench guest-RAM PSS after lz4 offload",
            "vm.{c}.lz4-lazy.guest_pss_offloaded_mib",
        ),
    ];
    for (label, pattern) in rows {
        row(t, results, label, &|c| pattern.replace("{c}", c), 2);
    }
    for codec in ["raw", "lz4", "zstd"] {
        let label = format!("backing after {codec} offload (in process)");
        row(
            t,
            results,
            &label,
            &|c| format!("vm.{c}.{codec}-lazy.backing_mib"),
            2,
        );
        let label = format!("backing after {codec} offload (`pvisor` process)");
        row(
            t,
            results,
            &label,
            &|c| format!("pvisor.{c}.{codec}.backing_mib"),
            2,
        );
    }
    t.push('\n');
}

fn time_tables(t: &mut String, results: &Results) {
    t.push_str("## Offload (ms)\n\n");
    t.push_str(HEAD);
    for codec in ["raw", "lz4", "zstd"] {
        for (scope, case, who) in [
            ("pvisor", codec.to_owned(), "`pvisor`"),
            ("vm", format!("{codec}-lazy"), "in process"),
        ] {
            for (q, what) in [
                ("offload_ms", "suspend, whole"),
                ("offload_write_ms", "write + commit"),
                ("offload_drop_ms", "drop"),
            ] {
                let label = format!("{codec}: {what} ({who})");
                row(
                    t,
                    results,
                    &label,
                    &|c| format!("{scope}.{c}.{case}.{q}"),
                    1,
                );
            }
        }
    }
    t.push_str(
        "\n## Resume + task (ms, and ratio to the never-offloaded task of the same run)\n\n",
    );
    t.push_str(HEAD);
    // (label, key with `{c}` for the content, decimals)
    let mut rows: Vec<(String, String, usize)> = Vec::new();
    let mut add = |label: String, key: &str, d| rows.push((label, key.to_owned(), d));
    add(
        "never-offloaded task (in process)".into(),
        "vm.{c}.base.task_ms",
        1,
    );
    add(
        "never-offloaded task (`pvisor`)".into(),
        "pvisor.{c}.base.task_ms",
        1,
    );
    for case in [
        "raw-lazy",
        "lz4-lazy",
        "zstd-lazy",
        "raw-eager",
        "lz4-eager",
    ] {
        let key = |q: &str| format!("vm.{{c}}.{case}.{q}");
        add(
            format!("{case}: resume + task (in process)"),
            &key("resume_task_ms"),
            1,
        );
        add(format!("{case}: **ratio** (in process)"), &key("ratio"), 2);
    }
    for (what, q, d) in [
        ("resume + task (in process)", "resume_task_ms", 1),
        ("the collapse alone (ms)", "collapse_ms", 1),
        ("MiB collapsed", "collapsed_mib", 0),
        ("**ratio** (in process)", "ratio", 2),
    ] {
        let key = format!("vm.{{c}}.thp-raw-eager.{q}");
        add(format!("raw-eager + THP collapse: {what}"), &key, d);
    }
    let huge = "never-offloaded task, huge-page RAM (in process)";
    add(huge.into(), "vm.{c}.huge-base.task_ms", 1);
    for case in ["raw-lazy", "lz4-lazy", "raw-eager", "lz4-eager"] {
        let key = |q: &str| format!("vm.{{c}}.huge-{case}.{q}");
        let label = |what: &str| format!("huge pages, {case}: {what}");
        add(
            label("resume + task (in process)"),
            &key("resume_task_ms"),
            1,
        );
        add(label("**ratio** (in process)"), &key("ratio"), 2);
        add(label("synchronous faults"), &key("faults_copy"), 0);
    }
    for codec in ["raw", "lz4", "zstd"] {
        let key = |q: &str| format!("pvisor.{{c}}.{codec}.{q}");
        add(
            format!("{codec}, lazy: resume + task (`pvisor`)"),
            &key("resume_task_ms"),
            1,
        );
        add(
            format!("{codec}, lazy: **ratio** (`pvisor`)"),
            &key("ratio"),
            2,
        );
    }
    for (label, key, d) in &rows {
        row(t, results, label, &|c| key.replace("{c}", c), *d);
    }
    t.push('\n');
}
