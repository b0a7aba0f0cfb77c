//! The Markdown report (the targets are in `targets`, the seed's figures in `seed`).

use std::fmt::Write as _;

use crate::common::chart::{Figure, Lines, Series, Stroke, BLUE, GREEN, RUST, VIOLET};
use crate::common::host::BenchRun;
use crate::common::results::{fig, num, signed, signed_fig, Results};
use crate::common::Res;
use crate::replay::key;
use crate::seed;
use crate::targets::{self, median_change, median_pct, vms_label};
use crate::{step_counts, Log, Settings, Strategy, BASE};

/// What the report says besides the figures.
struct Context<'a> {
    settings: &'a Settings,
    /// The machine, the date, the time and CPU the bench took.
    run: &'a BenchRun,
    log: &'a Log,
    /// The round the chart shows (from 0).
    chosen: usize,
}

impl<'a> Context<'a> {
    fn new(results: &Results, settings: &'a Settings, run: &'a BenchRun, log: &'a Log) -> Self {
        Self {
            settings,
            run,
            log,
            chosen: targets::median_round(results, settings),
        }
    }
}

/// The report of `results` (as its CSV keeps them) of the run `run`.
pub fn markdown(results: &Results, settings: &Settings, run: &BenchRun, log: &Log) -> String {
    let cx = Context::new(results, settings, run, log);
    let verdicts = targets::verdicts(results, settings, log);
    let s = cx.settings;
    let mut t = String::new();
    let sizes: Vec<String> = s.vms.iter().map(ToString::to_string).collect();
    let _ = writeln!(
        t,
        "# Agent-wait memory management: an agent run replayed in {} VMs — benchmark report\n\n{}",
        sizes.join(" and "),
        cx.run.generated("agent_waits_report", s.runs)
    );
    summary(&mut t, results, &cx);
    t.push_str(&crate::common::verdict::table(
        "Targets (issue 7)",
        "figure: median (min–max) over the rounds",
        &verdicts,
        false,
    ));
    let _ = writeln!(
        t,
        "\nA target is judged on the median of the per-round figures with {} (a ratio is computed within a \
         round: the strategy against `off` with as many VMs, minutes apart at most); the figure says in how many \
         rounds it is met. The rows with other group sizes are for information. Memory is judged on memory \
         charged (issue 35): guest PSS misses memfd RAM resident but unmapped; its target stays, for \
         comparison with pvisor's.\n",
        vms_label(s.judged_vms())
    );
    wait_share(&mut t, results, &cx);
    if s.replayed.has_io() != (false, false) {
        sources_table(&mut t, results, s);
    }
    let mut sizes = s.vms.clone();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    for &vms in &sizes {
        group_table(&mut t, results, s, vms);
    }
    seed_table(&mut t, results, s);
    sampling_table(&mut t, results, &cx);
    chart_section(&mut t, &cx);
    method(&mut t, &cx);
    t
}

/// What the chart shows: the one drawn now, or, re-rendered, the one the run drew (its samples
/// are not in the CSV), as its own captions say.
fn chart_section(t: &mut String, cx: &Context<'_>) {
    let s = cx.settings;
    let _ = writeln!(
        t,
        "## Memory over time\n\n![Memory charged (cgroup memory) and guest-RAM PSS of all the VMs over time, per \
         strategy]({}.svg)\n",
        s.stem
    );
    let Some(svg) = &cx.log.kept_chart else {
        let _ = writeln!(
            t,
            "The chart shows the memory of all the VMs of a group summed, deadline by deadline (`pvisor replay \
             --samples`; where a VM's reading came late, its latest one), in round {} (the round whose offload/off \
             memory charged×time ratio with {} is nearest the median), from the common release to the last VM's \
             end: memory charged (the cgroups' usage) first, then guest-RAM PSS.\n",
            cx.chosen + 1,
            vms_label(s.judged_vms())
        );
        return;
    };
    let note =
        crate::common::render::kept_chart(svg, &cx.run.date, crate::common::render::MEMORY_PANELS);
    let _ = writeln!(t, "{note}\n");
}

/// What each wait source contributed (issue 38): the time the VMs waited for it and the
/// offloads made in those waits, summed over the VMs, median over the rounds.
fn sources_table(t: &mut String, results: &Results, s: &Settings) {
    let vms = s.judged_vms();
    let (downloads, reads) = (s.replayed.downloads(), s.replayed.image_files());
    let _ = writeln!(
        t,
        "## What each wait source contributed ({})\n\n\
         Per task: {} downloads, {:.0} MiB in all, from an origin at {:.1} MiB/s as replayed, and reads of {} \
         files, {:.0} MiB, from an image origin at {:.1} MiB/s on a first read (each VM stages its own \
         copies). Seconds waited and offloads made during those waits, summed over the {vms} VMs, median over \
         the rounds; with `off` nothing is managed, so no offload is made (the waits are the same).\n\n\
         | strategy | model waits | offloads in them | download waits | offloads in them | image-read waits | \
         offloads in them |\n|---|---|---|---|---|---|---|",
        vms_label(vms),
        downloads.len(),
        downloads.iter().map(|d| d.1).sum::<u64>() as f64 / f64::from(1 << 20),
        s.replayed.download_rate_replayed() / f64::from(1 << 20),
        reads.len(),
        reads.values().map(|r| r.0).sum::<u64>() as f64 / f64::from(1 << 20),
        s.replayed.image_rate_replayed() as f64 / f64::from(1 << 20),
    );
    for &strategy in &s.strategies {
        let f = |q: &str, d: usize| fig(results, &key(vms, strategy, q), d);
        let _ = writeln!(
            t,
            "| {} | {} s | {} | {} s | {} | {} s | {} |",
            strategy.key(),
            f("model_wait_s", 1),
            f("model_offloads", 0),
            f("download_wait_s", 1),
            f("download_offloads", 0),
            f("read_wait_s", 1),
            f("read_offloads", 0),
        );
    }
    t.push('\n');
}

/// The paragraph under the title.
fn summary(t: &mut String, results: &Results, cx: &Context<'_>) {
    let s = cx.settings;
    let vms = s.judged_vms();
    let _ = write!(
        t,
        "{} replaying the trajectory `{}` at once ({} model waits, {:.1} s of waits in all: {}) on this \
         machine's {} CPUs: without wait management (`off`) the batch took {} s and each task was charged {} \
         GiB·s of memory × time (its cgroup's; guest-RAM PSS × time {} GiB·s).",
        vms_label(vms),
        s.replayed.name,
        s.replayed.requests().len(),
        s.replayed.total_wait().as_secs_f64(),
        waits_as(s),
        cx.run.machine.nproc,
        fig(results, &key(vms, BASE, "window_s"), 2),
        fig(results, &key(vms, BASE, "charged_gib_s"), 3),
        fig(results, &key(vms, BASE, "guest_pss_gib_s"), 3),
    );
    if cx.log.charged_is_cgroup {
        t.push_str(
            " (This run predates the replay's own memory-charged figure: its CSV has the VMs' memory cgroup \
             usage, `cgroup_gib_s`, which is the memory charged for VMs that each run in a memory cgroup of \
             their own without huge pages, as these did.)",
        );
    }
    if !results.has(&key(vms, BASE, "cpu_s")) {
        t.push_str(" The VMs' CPU was not measured in this run (its CSV has no `cpu_s`).");
    }
    for &strategy in s.strategies.iter().filter(|&&st| st != BASE) {
        let cpu = if results.has(&key(vms, strategy, "cpu_pct_of_off")) {
            format!(
                " and the VMs' CPU {}%",
                median_pct(results, vms, strategy, "cpu_pct_of_off")
            )
        } else {
            String::new()
        };
        let _ = write!(
            t,
            " With `{}`, memory charged × time was {}% of off's (guest PSS × time {}%){cpu}, for a window {}% \
             and a throughput {}% against off.",
            strategy.key(),
            median_pct(results, vms, strategy, "charged_pct_of_off"),
            median_pct(results, vms, strategy, "guest_pss_pct_of_off"),
            median_change(results, vms, strategy, "window_change_pct"),
            median_change(results, vms, strategy, "throughput_change_pct"),
        );
    }
    let integrity = &cx.log.integrity;
    let _ = writeln!(
        t,
        " (Medians over the rounds.) Integrity: {} of {} runs failed, {} of them by their sampling alone. The \
         seed's offload kept {}% of off's guest PSS × time for a window {}% longer.\n",
        integrity.failures.len(),
        integrity.runs,
        integrity.sampling_only,
        num(seed::offload_guest_pct(), 0),
        signed(seed::OFFLOAD_WINDOW_CHANGE_PCT, 0),
    );
}

/// How the trajectory's waits relate to the seed's.
fn waits_as(s: &Settings) -> String {
    if s.replayed.time_scale == 1.0 {
        "the seed's waits as recorded".to_owned()
    } else {
        format!("the seed's waits × {}", s.replayed.time_scale)
    }
}

/// For a scaled trajectory: how much of off's window the VMs spend waiting, which bounds what
/// any strategy that frees memory only while a VM waits can save.
fn wait_share(t: &mut String, results: &Results, cx: &Context<'_>) {
    let s = cx.settings;
    if s.replayed.time_scale == 1.0 {
        return;
    }
    let vms = s.judged_vms();
    let window = results.summary(&key(vms, BASE, "window_s")).median;
    let waits = s.replayed.total_wait().as_secs_f64();
    if window.is_nan() || window <= 0.0 {
        return;
    }
    let bound = (1.0 - waits / window) * 100.0;
    let _ = writeln!(
        t,
        "**What scaling leaves to gain.** With {} and `off`, each VM waits {:.1} s of a {:.1} s window \
         (median): {:.0}% of it. Freeing a VM's memory for exactly its waits, at no cost, while it kept \
         what it holds as it computes, would leave about {bound:.0}% of off's memory × time (taking memory as \
         even over the window); going below that takes memory freed while the VM computes too (RAM it does \
         not touch left in the store, as the default reload on faults does), and every offload and reload \
         costs CPU that the VMs' tool phases already compete for on {} CPUs. The seed's figures were taken \
         with the waits as recorded: that comparison is in `docs/bench/agent-waits-recorded.md`.\n",
        vms_label(vms),
        waits,
        window,
        waits / window * 100.0,
        cx.run.machine.nproc,
    );
}

fn group_table(t: &mut String, results: &Results, s: &Settings, vms: usize) {
    let _ = writeln!(
        t,
        "## {}\n\n\
         Per task: memory × time summed over the VMs and divided by {vms}; memory charged is the VMs' memory \
         cgroups' usage (with huge pages held), guest PSS the second column (it misses memfd RAM resident but \
         unmapped). *VMs' CPU*: the VM processes' user + system time from the release to the end (`pvisor \
         replay`'s `cpu.vms_s`; the replay's own is apart). *Agent completion*: from the common \
         release to a VM's last result, the mean over the VMs; *window*: to the last VM's last result; \
         *throughput*: {vms} task(s) over the window. Against off: the strategy's figure over off's in the same \
         round, then the median (min–max) over the rounds.\n",
        vms_label(vms)
    );
    t.push_str(
        "| strategy | memory charged×time, GiB·s per task | % of off | guest PSS×time, GiB·s per task | % of off | \
         VMs' CPU, s | % of off | agent completion, s | window, s | window vs off, % | throughput, tasks/min | \
         vs off, % |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for &strategy in &s.strategies {
        let k = |q: &str| key(vms, strategy, q);
        let against = |q: &str, signed: bool| {
            if strategy == BASE {
                "(the base)".to_owned()
            } else if signed {
                signed_fig(results, &k(q), 1)
            } else {
                fig(results, &k(q), 1)
            }
        };
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            strategy.key(),
            fig(results, &k("charged_gib_s"), 3),
            against("charged_pct_of_off", false),
            fig(results, &k("guest_pss_gib_s"), 3),
            against("guest_pss_pct_of_off", false),
            fig(results, &k("cpu_s"), 1),
            against("cpu_pct_of_off", false),
            fig(results, &k("completion_mean_s"), 2),
            fig(results, &k("window_s"), 2),
            against("window_change_pct", true),
            fig(results, &k("throughput_per_min"), 2),
            against("throughput_change_pct", true),
        );
    }
    t.push('\n');
}

fn seed_table(t: &mut String, results: &Results, s: &Settings) {
    let vms = seed::VMS;
    let _ = writeln!(
        t,
        "## The seed's 16-VM figures\n\n\
         For reference: the seed system (pvisor) with {vms} VMs, off against offload. The seed ran the waits as \
         recorded (232.7 s of model time per task) with real Linux guests; this bench runs them {} with a \
         2 KiB workload guest, so its GiB·s and tasks per minute are not comparable: compare the ratios to off.\n",
        if s.replayed.time_scale == 1.0 {
            "as recorded too".to_owned()
        } else {
            format!("× {}", s.replayed.time_scale)
        }
    );
    let ours = s.vms.contains(&vms);
    t.push_str(
        "| | seed: off | seed: offload | seed: offload vs off | ours: offload vs off | ours: offload-compressed vs off |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    let cell = |strategy: Strategy, q: &str, signed: bool| {
        let k = key(vms, strategy, q);
        match (ours && s.strategies.contains(&strategy), signed) {
            (false, _) => "–".to_owned(),
            (true, false) => format!("{}%", fig(results, &k, 1)),
            (true, true) => format!("{}%", signed_fig(results, &k, 1)),
        }
    };
    // A row: its label, the seed's off, offload and offload against off, our quantity against
    // off and whether it is a change (signed).
    let rows = [
        (
            "guest PSS×time, GiB·s per task",
            num(seed::OFF_GUEST_PSS_GIB_S, 2),
            num(seed::OFFLOAD_GUEST_PSS_GIB_S, 2),
            num(seed::offload_guest_pct(), 1),
            "guest_pss_pct_of_off",
            false,
        ),
        (
            "completion window",
            "–".to_owned(),
            "–".to_owned(),
            signed(seed::OFFLOAD_WINDOW_CHANGE_PCT, 0),
            "window_change_pct",
            true,
        ),
        (
            "throughput, tasks/min",
            num(seed::OFF_THROUGHPUT, 2),
            num(seed::OFFLOAD_THROUGHPUT, 2),
            signed(seed::offload_throughput_change_pct(), 1),
            "throughput_change_pct",
            true,
        ),
    ];
    for (label, off, offload, against, quantity, signed) in rows {
        let _ = writeln!(
            t,
            "| {label} | {off} | {offload} | {against}% | {} | {} |",
            cell(Strategy::Offload, quantity, signed),
            cell(Strategy::OffloadCompressed, quantity, signed),
        );
    }
    t.push('\n');
}

fn sampling_table(t: &mut String, results: &Results, cx: &Context<'_>) {
    let s = cx.settings;
    let _ = writeln!(
        t,
        "## Integrity and sampling\n\n\
         Per group over the rounds: runs whose replay passed every check (`integrity_passed`, exit status 0), \
         model requests served, and the sampler's record (`sampling` of the summary: a sample every {} ms; a \
         long gap is one over twice that; a dropped reading is one that failed); then what wait management did \
         in a run, all VMs together (median over the rounds): offloads, waits where an offload was put off by \
         the cooldown or by the break-even rule (not paying), and the mean time an offload took. A run that \
         fails is recorded and counted, never dropped.\n",
        s.sample_ms
    );
    t.push_str(
        "| VMs | strategy | runs passed | requests served | samples | largest gap, s (max) | long gaps (sum) | dropped (sum) | offloads | skipped: cooldown | skipped: not paying | ms per offload | pvisor replay, s |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut sizes = s.vms.clone();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    for &vms in &sizes {
        for &strategy in &s.strategies {
            let k = |q: &str| key(vms, strategy, q);
            let sum = |q: &str| {
                results
                    .values(&k(q))
                    .iter()
                    .filter(|v| !v.is_nan())
                    .sum::<f64>()
            };
            // Wait management's counters, per run (median); a dash without it.
            let managed = |q: &str| {
                if strategy == BASE || results.values(&k(q)).iter().all(|v| v.is_nan()) {
                    "–".to_owned()
                } else {
                    num(results.summary(&k(q)).median, 0)
                }
            };
            let per_offload = if strategy == BASE || sum("offloads") == 0.0 {
                "–".to_owned()
            } else {
                num(sum("offload_ms") / sum("offloads"), 0)
            };
            let _ = writeln!(
                t,
                "| {vms} | {} | {} of {} | {} | {} | {} | {} | {} | {} | {} | {} | {per_offload} | {} |",
                strategy.key(),
                results.count(&k("integrity_passed"), |v| v == 1.0),
                results.values(&k("integrity_passed")).len(),
                fig(results, &k("requests_served"), 0),
                fig(results, &k("samples"), 0),
                num(results.summary(&k("largest_gap_s")).max, 3),
                num(sum("long_gaps"), 0),
                num(sum("dropped"), 0),
                managed("offloads"),
                managed("skipped_for_cooldown"),
                managed("skipped_for_gain"),
                fig(results, &k("wall_s"), 1),
            );
        }
    }
    let failures = &cx.log.integrity.failures;
    if failures.is_empty() {
        t.push_str("\nNo run failed.\n\n");
    } else {
        t.push_str("\nFailed runs:\n\n");
        for failure in failures {
            let _ = writeln!(t, "- {failure}");
        }
        t.push('\n');
    }
}

fn method(t: &mut String, cx: &Context<'_>) {
    let s = cx.settings;
    let tr = &s.replayed;
    t.push_str("## Method\n\n");
    t.push_str(
        "To reproduce (from the workspace root, as root, with `/dev/kvm`, `/dev/userfaultfd` and memory \
         cgroups; `target/release/pvisor` built from the current sources):\n\n```sh\n\
         cargo build --release -p vmm --bin pvisor && cargo bench --bench agent_waits_report\n\
         AGENT_BENCH_RUNS=9 cargo bench --bench agent_waits_report   # more rounds\n\
         AGENT_BENCH_WAITS=recorded cargo bench --bench agent_waits_report   # the waits as recorded, 16 VMs\n\
         AGENT_BENCH_WAITS=recorded AGENT_BENCH_STEPS=24 cargo bench --bench agent_waits_report   # their first 24 \
         steps\n",
    );
    let _ = writeln!(
        t,
        "BENCH_RENDER=1 {}cargo bench --bench agent_waits_report   # re-render this report from \
         docs/bench/{}.csv, nothing run\n```\n",
        s.picks, s.stem
    );
    t.push_str(&cx.run.machine_markdown());
    let _ = writeln!(
        t,
        "- The machine is a shared VM running nested KVM: the {} VMs share its {} CPUs with each other and with \
         whatever else runs, so absolute times drift between rounds; the ratios are taken within a round.",
        s.judged_vms(),
        cx.run.machine.nproc
    );
    let (models, tools) = step_counts(tr);
    let scaling = if tr.time_scale == 1.0 {
        "its waits are the seed-shaped ones as they are, and so is the VMs' wait policy (pause after 20 ms, \
         offload at 50 ms, at most every 5 s, and only when the wait is expected to last at least 4 times what \
         the VM's offloads take; after the answer, RAM comes back as the guest touches it unless the \
         strategy says otherwise)."
            .to_owned()
    } else {
        format!(
            "its waits are the seed-shaped ones × {scale}, and `pvisor replay` scales the VMs' wait policy by \
             the same factor (`--vm-wait-scale`: pause after 20 ms × {scale}, offload at 50 ms × {scale}, at most \
             every 5 s × {scale}; the break-even rule, offloading only when the wait is expected to last at least \
             4 times what the VM's offloads take, compares measured times and is not scaled; after the answer, \
             RAM comes back as the guest touches it unless the strategy says otherwise).",
            scale = tr.time_scale
        )
    };
    let _ = writeln!(
        t,
        "- **Trajectory**: {} ({}): {} steps, {models} model waits ({:.3} s in all) and {tools} tool phases \
         (workload-guest scripts: fills, digests, releases). `time_scale` {scale}: {scaling} {}",
        s.source,
        tr.name,
        tr.steps.len(),
        tr.total_wait().as_secs_f64(),
        tr.note,
        scale = tr.time_scale,
    );
    if tr.time_scale != 1.0 {
        let _ = writeln!(
            t,
            "- **Scaling**: the waits and the wait policy are × {}, the work is not: a tool phase, an offload of \
             a VM's RAM and its loading back take as long as with the seed's waits. Against waits {:.0} times \
             shorter, an offload's cost weighs {1:.0} times more, the more so when {} VMs share {} CPUs.",
            tr.time_scale,
            1.0 / tr.time_scale,
            s.judged_vms(),
            cx.run.machine.nproc
        );
    }
    let strategies: Vec<String> = s
        .strategies
        .iter()
        .map(|st| format!("*{}*: {}", st.key(), st.describe()))
        .collect();
    let _ = writeln!(
        t,
        "- **Runs**: each is `pvisor replay TRAJECTORY --vms N --strategy S --memory {} --sample-ms {} --json \
         --samples FILE`. It starts a local model server that answers each request after its recorded wait, \
         then N VM processes (`pvisor run --detach`: 1 vCPU, the built-in workload guest, anonymous guest RAM, \
         each in a memory cgroup of its own) with the strategy's flags ({}), samples their memory, releases them \
         at once with the whole trajectory as one script, and checks every result. Each round runs every N in \
         {:?} under every strategy, one replay at a time; round *r* rotates the order of the strategies by *r* \
         and reverses the order of the Ns for odd *r*.",
        s.memory,
        s.sample_ms,
        strategies.join("; "),
        s.vms
    );
    t.push_str(
        "- **Figures** (from the replay's JSON summary): memory × time per task is each VM's reading integrated \
         by trapezoids between samples, from the start of sampling (just before the release) to the end of the \
         last VM's run, summed over the VMs and divided by N — a VM that finished early is counted until the \
         window closes. *Memory charged*: the VM's memory cgroup usage plus the huge pages it holds \
         (`memory_charged_gib_s_per_task`; see `vmm::charged`). *Guest PSS*: the PSS of the mappings inside the VM's guest RAM (`/proc/PID/smaps`); \
         *cgroup memory*: its memory cgroup's usage, which includes the page cache charged to it (a raw offload \
         store read back through the page cache is counted there). Completion times run from the common \
         release; throughput is N over the window, per minute.\n",
    );
    t.push_str(
        "- **Integrity**: the replay checks every answer's digest against the bytes the server sent, every \
         command's success, the same digests in every VM, and the sampling (no gap over twice the period, no \
         dropped reading); `integrity_passed` is all of them, and the exit status is 1 otherwise. The bench \
         records every run, failed or not, and also checks that every run gives the same `results_digest`.\n",
    );
}

/// The stroke of a strategy's line.
fn stroke(strategy: Strategy) -> Stroke {
    match strategy {
        Strategy::Off => Stroke::solid(BLUE),
        Strategy::Pause => Stroke::dashed(VIOLET, 6, 3),
        Strategy::Offload => Stroke::solid(RUST),
        Strategy::OffloadCompressed => Stroke::solid(GREEN),
        Strategy::OffloadLazy => Stroke::dashed(RUST, 2, 2),
        Strategy::OffloadLate => Stroke::dashed(GREEN, 2, 2),
        Strategy::OffloadModel => Stroke::dashed(VIOLET, 2, 2),
        Strategy::OffHuge => Stroke::dashed(BLUE, 6, 3),
        Strategy::OffloadHuge => Stroke::dashed(RUST, 6, 3),
    }
}

/// What the chart's panels are drawn from.
struct Panels<'a> {
    settings: &'a Settings,
    log: &'a Log,
    /// The round the chart shows (from 0).
    chosen: usize,
}

/// The chart of `vms` VMs (`cgroup`: the memory charged, the cgroups' usage, else the guest
/// PSS) over time in the round the report names, one line per strategy, its GiB·s per task in
/// the legend.
fn memory_panel(results: &Results, cx: &Panels<'_>, vms: usize, cgroup: bool) -> Lines {
    let (quantity, per_task) = if cgroup {
        ("memory charged (cgroup usage)", "charged_gib_s")
    } else {
        ("guest-RAM PSS", "guest_pss_gib_s")
    };
    let series = cx
        .settings
        .strategies
        .iter()
        .filter_map(|&strategy| {
            let timeline = cx.log.timelines.get(&((vms, strategy), cx.chosen))?;
            let values = results.values(&key(vms, strategy, per_task));
            let value = values.get(cx.chosen).copied().unwrap_or(f64::NAN);
            Some(Series {
                label: format!("{}: {}", strategy.key(), num(value, 3)),
                stroke: stroke(strategy),
                points: timeline.points(cgroup),
            })
        })
        .collect();
    let title = format!(
        "{}: {quantity} of all the VMs, GiB, round {} (legend: GiB·s per task)",
        vms_label(vms),
        cx.chosen + 1
    );
    Lines::memory_over_time(title, series)
}

/// The chart: the memory of all the VMs of a group over time, one line per strategy, in the
/// round the report names (`targets::median_round`): the memory charged and the guest-RAM
/// PSS with the most VMs, then the memory charged of each other group size.
pub fn chart(results: &Results, settings: &Settings, log: &Log) -> Res<String> {
    let cx = &Panels {
        settings,
        log,
        chosen: targets::median_round(results, settings),
    };
    let s = cx.settings;
    let caption = format!(
        "{}, VMs of {}: memory summed over the VMs, a sample every {} ms; round {} of {}.",
        s.replayed.name,
        s.memory,
        s.sample_ms,
        cx.chosen + 1,
        s.runs,
    );
    let mut sizes = s.vms.clone();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let mut figure = Figure::new(caption);
    for (i, &vms) in sizes.iter().enumerate() {
        figure = figure.panel(memory_panel(results, cx, vms, true));
        if i == 0 {
            figure = figure.panel(memory_panel(results, cx, vms, false));
        }
    }
    figure.svg()
}
