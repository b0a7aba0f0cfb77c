//! Scenario bench of the VMM (issue 4): a 512 MiB VM with 64 MiB of application data, as in
//! the seed's single-VM table. Regenerates `docs/bench/vm.md`, `docs/bench/vm.csv` and
//! `docs/bench/vm.svg`.
//!
//! `cargo bench --bench vm_report` runs `VM_BENCH_RUNS` (default 5) interleaved runs. Each run
//! measures, for repeated and random content:
//! - in this process, through `vmm::vm::Vm`, one VM at a time (`inproc`): resident memory
//!   (process PSS, guest-RAM PSS) running, after a raw, lz4 and zstd offload; the offload's
//!   time and write/drop split; the store's allocated blocks; the time from the resume call to
//!   the end of `task` (lazy and eager) beside `task` on a never-offloaded VM; and a breakdown
//!   (`touch` of the data right after resume vs on the warm VM, the pager's fault counters);
//!   the never-offloaded task and resume + task again on RAM of 2 MiB huge pages (`huge-*`;
//!   `nr_overcommit_hugepages` is raised while the bench runs, and put back);
//! - in the real `pvisor` process (`process`): `pvisor run --detach`, `pvisor stats` running
//!   and after `pvisor suspend --vm-offload` (the headline PSS), and resume + task beside task
//!   on a never-offloaded `pvisor` VM.
//!
//! `VM_BENCH_CASES=NAME,…` runs only those in-process cases (`base`, `raw-lazy`,
//! `huge-lz4-eager`, `floor-raw`, …), without the `pvisor` part, and writes no report: its
//! figures go to `target/vm_report-cases.csv`.
//!
//! Run `r` does the two parts in the order in-process → pvisor for even `r` and reversed for
//! odd `r`, swaps the order of the contents likewise, and rotates the order of the cases by
//! `r`. Ratios are computed within a run, then summarised (min/median/max). Temporary files
//! live under `target/bench-tmp/vm/pPID/` (the real disk) and are removed.
//!
//! Needs root, `/dev/kvm` and `/dev/userfaultfd`, and `target/release/pvisor` built from the
//! current sources (`cargo build --release -p vmm --bin pvisor`). Run without `--bench` (as
//! `cargo test --benches` does), it is a quick smoke run of a 32 MiB VM with 4 MiB of data
//! that writes no report (and skips the pvisor part if the binary is missing or stale;
//! `PVISOR_SKIP_DEVICE_TESTS=1` skips it altogether); it also checks render mode on its own
//! CSV.
//!
//! Render mode (`BENCH_RENDER=1 cargo bench --bench vm_report`, `benchkit::render`):
//! `docs/bench/vm.md` and `vm.svg` written again from `vm.csv` (its own long form, read back by
//! `Results::from_csv`), the date and duration `vm.md` gives and its `## Machine` items as they
//! are, nothing run.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

mod breakdown;
mod chart;
use benchkit as common;
mod host;
mod inproc;
mod process;
mod report;
mod results;
mod targets;

use common::host::{BenchRun, TempRoot};
use common::Res;
use results::Results;

const MIB: u64 = 1 << 20;

/// Application data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    Repeated,
    Random,
}

impl Content {
    pub const ALL: [Content; 2] = [Content::Repeated, Content::Random];

    pub fn name(self) -> &'static str {
        match self {
            Content::Repeated => "repeated",
            Content::Random => "random",
        }
    }
}

/// How an offload stores RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Raw,
    Lz4,
    Zstd,
}

impl Codec {
    pub fn name(self) -> &'static str {
        match self {
            Codec::Raw => "raw",
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
        }
    }

    /// The name `--vm-ram-codec` takes.
    pub fn codec_name(self) -> &'static str {
        match self {
            Codec::Raw => "none",
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
        }
    }
}

/// Sizes of one bench (full or smoke).
#[derive(Debug, Clone)]
pub struct Settings {
    pub runs: usize,
    pub write_docs: bool,
    pub memory: u64,
    pub app: u64,
    pub seed: u64,
    /// The `pvisor` binary, or why the pvisor part is skipped (smoke run only).
    pub pvisor: Result<PathBuf, String>,
    /// `VM_BENCH_CASES=huge-base,huge-raw-lazy,…`: only these in-process cases, no `pvisor`
    /// part and no report (a quick look at a few figures).
    pub only: Option<Vec<String>>,
    pub root: PathBuf,
}

impl Settings {
    pub fn app_pages(&self) -> f64 {
        (self.app / 4096) as f64
    }
}

fn main() {
    common::main("vm_report", run);
}

fn settings(render: bool) -> Res<Settings> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let pvisor = common::vmproc::find_binary(&root, &common::host::target_dir());
    if !common::is_bench_run() {
        return Ok(Settings {
            runs: 1,
            write_docs: false,
            memory: 32 * MIB,
            app: 4 * MIB,
            seed: 1,
            pvisor,
            only: None,
            root,
        });
    }
    let only = std::env::var("VM_BENCH_CASES")
        .ok()
        .map(|list| list.split(',').map(str::to_owned).collect::<Vec<_>>());
    Ok(Settings {
        runs: common::env_number("VM_BENCH_RUNS", 5, 1)? as usize,
        write_docs: only.is_none(),
        memory: 512 * MIB,
        app: 64 * MIB,
        seed: 1,
        // Render mode runs nothing: whether the pvisor part ran is in the CSV.
        pvisor: if render { pvisor } else { Ok(pvisor?) },
        only,
        root,
    })
}

fn run() -> Res<()> {
    let started = Instant::now();
    let render = common::render::requested();
    let settings = settings(render)?;
    if render {
        return render_kept(settings, started);
    }
    let bench_run = common::host::BenchRun::begin();
    if !settings.write_docs
        && std::env::var_os("PVISOR_SKIP_DEVICE_TESTS").is_some_and(|v| v == "1")
    {
        eprintln!("vm_report: smoke run skipped (PVISOR_SKIP_DEVICE_TESTS=1)");
        return Ok(());
    }
    common::host::check_vm_devices()?;
    // The huge-page cases take their pages as surplus pages the kernel lends while this
    // lives; the host's setting comes back afterwards.
    let _huge_pages = testkit::hugepages::HugePages::lend(settings.memory / (2 * MIB) + 8);
    // One directory per bench process, so that a smoke run cannot clear a running bench's files.
    let relative = Path::new("vm").join(format!("p{}", std::process::id()));
    let tmp = TempRoot::create("vm_report", &relative)?;
    let run_dir = tmp.path.join("run");
    fs::create_dir_all(&run_dir)?;
    // Read by `vmm::runtime` here and inherited by every `pvisor` started; set before any
    // thread exists.
    std::env::set_var("PVISOR_RUNTIME_DIR", &run_dir);
    let pvisor_text = match &settings.pvisor {
        Ok(bin) => bin.display().to_string(),
        Err(why) => format!("skipped: {why}"),
    };
    let machine = host::machine(&tmp.filesystem, &pvisor_text);
    eprintln!(
        "vm_report: {} run(s) of a {} MiB VM with {} MiB of data; temporary files in {} ({}); pvisor: {}",
        settings.runs,
        settings.memory / MIB,
        settings.app / MIB,
        tmp.path.display(),
        machine.filesystem,
        pvisor_text
    );

    let cpu = common::host::CpuSample::now();
    let mut results = Results::default();
    for run in 0..settings.runs {
        let round = Instant::now();
        let mut contents = Content::ALL;
        let mut parts = [false, true];
        if run % 2 == 1 {
            contents.reverse();
            parts.reverse();
        }
        for pvisor_part in parts {
            let t = Instant::now();
            for content in contents {
                if pvisor_part {
                    if settings.only.is_some() {
                        continue;
                    }
                    let Ok(bin) = &settings.pvisor else { continue };
                    let mut cases = process::CASES;
                    let n = cases.len();
                    cases.rotate_left(run % n);
                    for case in cases {
                        process::run_case(&settings, bin, content, case, run, &mut results)?;
                    }
                } else {
                    let mut cases = inproc::CASES;
                    let n = cases.len();
                    cases.rotate_left(run % n);
                    for case in cases.into_iter().filter(|c| {
                        settings
                            .only
                            .as_ref()
                            .is_none_or(|only| only.contains(&c.name()))
                    }) {
                        inproc::run_case(&settings, &tmp.path, content, case, run, &mut results)?;
                    }
                }
            }
            let part = if pvisor_part { "pvisor" } else { "vm" };
            results.put(
                &format!("bench.{part}_part_s"),
                "s",
                run,
                t.elapsed().as_secs_f64(),
            );
        }
        results.put("bench.run_s", "s", run, round.elapsed().as_secs_f64());
        eprintln!(
            "vm_report: run {}/{} done in {:.1} s",
            run + 1,
            settings.runs,
            round.elapsed().as_secs_f64()
        );
    }
    let (busy_s, own_s, steal_s) = cpu.seconds();
    drop(tmp);
    derive(&mut results, &settings);

    let elapsed_s = started.elapsed().as_secs_f64();
    let cpu = report::CpuUsed {
        busy_s,
        own_s,
        steal_s,
    };
    let machine = report::machine_items(&machine, elapsed_s, cpu);
    let csv = results.csv();
    // The report says what its CSV keeps, as render mode does.
    let results = Results::from_csv(&csv)?;
    common::verdict::log("vm_report", &targets::verdicts(&results, &settings));
    if settings.only.is_some() {
        let csv = common::host::target_dir().join("vm_report-cases.csv");
        write(&csv, &results.csv())?;
        eprintln!(
            "vm_report: a part of the cases (VM_BENCH_CASES) in {elapsed_s:.1} s: no report written; figures in {}",
            csv.display()
        );
        return Ok(());
    }
    let markdown = report_of(&results, &settings, &bench_run, &machine);
    if !settings.write_docs {
        if Results::from_csv(&csv)?.csv() != csv {
            return Err("the CSV read back is not written the same again".into());
        }
        common::render::check(&markdown, |run| {
            Ok(report_of(
                &Results::from_csv(&csv)?,
                &settings,
                run,
                &machine,
            ))
        })?;
    }
    let outputs = [
        ("md", markdown),
        ("csv", csv),
        ("svg", chart::svg(&results, &settings)?),
    ];
    common::finish("vm_report", settings.write_docs, "vm", &outputs, started)
}

/// The report of `results` (as the CSV keeps them) of the run `run`, its machine `machine`.
fn report_of(results: &Results, settings: &Settings, run: &BenchRun, machine: &str) -> String {
    let verdicts = targets::verdicts(results, settings);
    let context = report::Context {
        settings,
        run,
        machine,
    };
    report::markdown(results, &verdicts, &context)
}

/// Render mode: `vm.md` and `vm.svg` written again from the kept CSV and report.
fn render_kept(settings: Settings, started: Instant) -> Res<()> {
    let dir = common::render::dir(settings.write_docs);
    let read = |ext: &str| fs::read_to_string(dir.join(format!("vm.{ext}")));
    let kept = read("md")?;
    let results = Results::from_csv(&read("csv")?).map_err(|e| format!("vm.csv: {e}"))?;
    let run = BenchRun::kept(&kept, common::host::utc_now())?;
    let machine = report::kept_machine(&kept).ok_or("vm.md: no `## Machine` section")?;
    let ran_pvisor = results.has_prefix("pvisor.");
    let settings = Settings {
        runs: results.runs(),
        // What the kept run did, whatever the binary here is.
        pvisor: if ran_pvisor {
            Ok(settings.pvisor.unwrap_or_default())
        } else {
            Err("not run in the kept run".to_owned())
        },
        ..settings
    };
    let outputs = [
        ("md", report_of(&results, &settings, &run, &machine)),
        ("svg", chart::svg(&results, &settings)?),
    ];
    common::finish("vm_report", settings.write_docs, "vm", &outputs, started)
}

/// Untimed, before every timed section: writes back whatever is dirty on the machine (the
/// previous case's files, other processes'), so that no timed fsync pays for it.
pub fn settle() {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
}

fn write(path: &Path, text: &str) -> Res<()> {
    fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()).into())
}

/// Ratios and differences, computed within each run.
fn derive(results: &mut Results, settings: &Settings) {
    let runs = settings.runs;
    let pages = settings.app_pages();
    for content in Content::ALL {
        let c = content.name();
        let base_task = format!("vm.{c}.base.task_ms");
        let base_touch = format!("vm.{c}.base.touch_ms");
        let huge_base_task = format!("vm.{c}.huge-base.task_ms");
        for case in inproc::CASES {
            let name = case.name();
            let k = |q: &str| format!("vm.{c}.{name}.{q}");
            match case {
                inproc::Case::Base | inproc::Case::HugeBase | inproc::Case::Floor { .. } => {}
                inproc::Case::Resume { .. }
                | inproc::Case::HugeResume { .. }
                | inproc::Case::Thp => {
                    // Against the never-offloaded task on the same RAM.
                    let base_task = if case.ram() == uffd_pager::pager::RamKind::Anon {
                        &base_task
                    } else {
                        &huge_base_task
                    };
                    results.ratio(&k("ratio"), &k("resume_task_ms"), base_task, runs);
                    results.difference(&k("extra_ms"), &k("resume_task_ms"), base_task, "ms", runs);
                    results.difference(
                        &k("task_extra_ms"),
                        &k("task_cmd_ms"),
                        base_task,
                        "ms",
                        runs,
                    );
                }
                inproc::Case::Touch { .. } => {
                    results.difference(
                        &k("touch_extra_ms"),
                        &k("touch_cmd_ms"),
                        &base_touch,
                        "ms",
                        runs,
                    );
                    results.difference(
                        &k("task_extra_ms"),
                        &k("task_after_touch_ms"),
                        &base_task,
                        "ms",
                        runs,
                    );
                    for run in 0..runs {
                        if let Some(extra) = results.value(&k("touch_extra_ms"), run) {
                            results.put(
                                &k("touch_extra_us_per_page"),
                                "µs",
                                run,
                                extra * 1e3 / pages,
                            );
                        }
                    }
                }
            }
        }
        // Eager resume + task minus its parts: the load, the re-entry (from the touch case of
        // the same run) and the never-offloaded task.
        for codec in [Codec::Raw, Codec::Lz4] {
            let n = codec.name();
            let eager = |q: &str| format!("vm.{c}.{n}-eager.{q}");
            let reentry = format!("vm.{c}.touch-{n}-eager.touch_extra_ms");
            for run in 0..runs {
                let parts = [
                    results.value(&eager("resume_task_ms"), run),
                    results.value(&eager("resume_ms"), run),
                    results.value(&reentry, run),
                    results.value(&base_task, run),
                ];
                if let [Some(total), Some(load), Some(reentry), Some(task)] = parts {
                    results.put(&eager("rest_ms"), "ms", run, total - load - reentry - task);
                }
            }
        }
        // The load itself (issue 35): resume + task less the never-offloaded task and the
        // re-entry, against the floor of the same codec measured in the same run.
        for codec in [Codec::Raw, Codec::Lz4] {
            let n = codec.name();
            let floor = |q: &str| format!("vm.{c}.floor-{n}.{q}");
            let reentry = format!("vm.{c}.touch-{n}-eager.touch_extra_ms");
            for run in 0..runs {
                if let (Some(read), Some(install)) = (
                    results.value(&floor("floor_read_ms"), run),
                    results.value(&floor("floor_install_ms"), run),
                ) {
                    results.put(&floor("floor_ms"), "ms", run, read + install);
                }
            }
            for mode in ["lazy", "eager"] {
                let k = |q: &str| format!("vm.{c}.{n}-{mode}.{q}");
                for run in 0..runs {
                    let parts = [
                        results.value(&k("resume_task_ms"), run),
                        results.value(&base_task, run),
                        results.value(&reentry, run),
                    ];
                    if let [Some(total), Some(task), Some(reentry)] = parts {
                        results.put(&k("load_ms"), "ms", run, total - task - reentry);
                        results.put(&k("ratio_less_reentry"), "×", run, (total - reentry) / task);
                    }
                }
                results.ratio(&k("load_floor"), &k("load_ms"), &floor("floor_ms"), runs);
            }
        }
        let base = format!("pvisor.{c}.base.task_ms");
        for case in process::CASES.iter().flatten() {
            let k = |q: &str| format!("pvisor.{c}.{}.{q}", case.name());
            results.ratio(&k("ratio"), &k("resume_task_ms"), &base, runs);
            results.difference(&k("extra_ms"), &k("resume_task_ms"), &base, "ms", runs);
        }
    }
}
