//! Scenario bench of live cold-RAM compression (issue 5): a 512 MiB VM with 64 MiB of
//! application data, left idle, with and without `--vm-cold-ram-compression`, as in the seed's
//! four cold-compression cases. Regenerates `docs/bench/cold.md`, `docs/bench/cold.csv` and
//! `docs/bench/cold.svg`.
//!
//! `cargo bench --bench cold_report` runs `COLD_BENCH_RUNS` (default 5) interleaved rounds. In
//! each round every case (`repeated`, `random`, `distinct`, `hot-cold`: 16 MiB touched every
//! 250 ms + 48 MiB left alone) runs once in every variant (`VARIANTS`): the default VM
//! (`pvisor run`'s default anonymous RAM, no cold compression), the same on memfd RAM, memfd
//! RAM with cold compression at the product's defaults (`ColdConfig::default()`, what
//! `--vm-cold-ram-compression` runs; the targets are judged on it) and, for information, anon
//! RAM with cold compression. Every VM is a fresh one in this process (`vmm::vm::Vm`, one at a
//! time), filled, then left idle for `COLD_BENCH_IDLE_S` (default 12) seconds; then its memory,
//! the pager's CPU time, the time of a `touch` of all the data and the data's digest are taken
//! (`measure`). Round `r` rotates the order of the cases by `r` and reverses the order of the
//! variants for odd `r`. Savings are computed within a round (cold VM over the default VM of
//! the same case), then summarised.
//!
//! Needs root, `/dev/kvm` and `/dev/userfaultfd`. Run without `--bench` (as
//! `cargo test --benches` does), it is a quick smoke run (a 32 MiB VM with 4 MiB of data, an
//! idle period under a second and fast cold-compression knobs) that checks every digest and
//! writes no report; `PVISOR_SKIP_DEVICE_TESTS=1` skips it. It also checks render mode on its
//! own CSV.
//!
//! Render mode (`BENCH_RENDER=1 cargo bench --bench cold_report`, `benchkit::render`):
//! `docs/bench/cold.md` and `cold.svg` written again from `cold.csv` and the date, duration
//! and machine `cold.md` gives, nothing run. A variant with no figure in the CSV is said not
//! measured (why is not kept).

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use uffd_pager::cold::ColdConfig;
use uffd_pager::pager::RamKind;
use vmm::guest::FillKind;

use benchkit as common;
mod chart;
mod cpu;
mod measure;
mod report;
mod seed;
mod targets;

use common::host::TempRoot;
use common::results::{Results, KEY_RUN_CSV as CSV};
use common::Res;

const MIB: u64 = 1 << 20;

/// One of the seed's four cold-compression cases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// 64 MiB of one repeated motif.
    Repeated,
    /// 64 MiB of seeded random bytes.
    Random,
    /// 64 MiB of distinct pages that still compress.
    Distinct,
    /// 64 MiB of distinct pages; the first 16 MiB touched every 250 ms while the VM idles.
    HotCold,
}

impl Case {
    pub const ALL: [Case; 4] = [Case::Repeated, Case::Random, Case::Distinct, Case::HotCold];

    pub fn name(self) -> &'static str {
        match self {
            Case::Repeated => "repeated",
            Case::Random => "random",
            Case::Distinct => "distinct",
            Case::HotCold => "hot-cold",
        }
    }

    pub fn fill(self) -> FillKind {
        match self {
            Case::Repeated => FillKind::Repeated,
            Case::Random => FillKind::Random,
            Case::Distinct | Case::HotCold => FillKind::Distinct,
        }
    }

    /// Whether part of the data is kept hot while the VM idles.
    pub fn hot(self) -> bool {
        self == Case::HotCold
    }
}

/// How a VM of the bench is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    /// Its name in keys and tables.
    pub key: &'static str,
    /// Guest RAM.
    pub ram: RamKind,
    /// Cold compression on, at `Settings::cold`.
    pub cold: bool,
    /// The targets are judged on it: the product's configuration (`--vm-cold-ram-compression`
    /// alone). The verdicts of other cold variants are for information.
    pub judged: bool,
}

impl Variant {
    /// The VM a cold variant is compared with besides the default one: the same RAM without
    /// cold compression.
    pub fn plain(self) -> Option<Variant> {
        VARIANTS
            .into_iter()
            .find(|v| self.cold && !v.cold && v.ram == self.ram)
    }

    pub fn ram_name(self) -> &'static str {
        self.ram.name()
    }

    /// `anon RAM` / `memfd RAM + cold compression`.
    pub fn describe(self) -> String {
        let cold = if self.cold { " + cold compression" } else { "" };
        format!("{} RAM{cold}", self.ram_name())
    }
}

/// Every variant, in the order of even rounds. The first is the default run every other
/// variant is compared with (`pvisor run`'s default: anonymous RAM). Adding a variant is one
/// line here; a cold variant the pager refuses (`ColdError::Unsupported`) is skipped and
/// reported as such.
pub const VARIANTS: [Variant; 4] = [
    Variant {
        key: "default",
        ram: RamKind::Anon,
        cold: false,
        judged: false,
    },
    Variant {
        key: "memfd",
        ram: RamKind::Memfd,
        cold: false,
        judged: false,
    },
    // What `pvisor run --vm-cold-ram-compression` runs: memfd RAM is its default.
    Variant {
        key: "cold",
        ram: RamKind::Memfd,
        cold: true,
        judged: true,
    },
    // `--vm-ram-backing anon --vm-cold-ram-compression`: the seed's only kind.
    Variant {
        key: "anon-cold",
        ram: RamKind::Anon,
        cold: true,
        judged: false,
    },
];

/// The variant every other one is compared with.
pub const DEFAULT: Variant = VARIANTS[0];

/// Sizes and periods of one bench (full or smoke).
#[derive(Debug, Clone)]
pub struct Settings {
    pub runs: usize,
    pub write_docs: bool,
    pub memory: u64,
    pub app: u64,
    /// The hot part of `hot-cold` (its first bytes).
    pub hot: u64,
    pub seed: u64,
    /// How long every VM idles after its fill.
    pub idle: Duration,
    /// The end of the idle period over which idle CPU is measured.
    pub window: Duration,
    /// Period of the host's `touch` of the hot part (and of the convergence samples).
    pub tick: Duration,
    /// Period of the memory timeline.
    pub sample: Duration,
    /// Cold compression's knobs.
    pub cold: ColdConfig,
    pub root: PathBuf,
}

impl Settings {
    /// Samples of the memory timeline in the idle period (the last one at its end).
    pub fn samples(&self) -> usize {
        usize::try_from(self.idle.as_millis() / self.sample.as_millis().max(1)).unwrap_or(0)
    }
}

fn main() {
    common::main("cold_report", run);
}

fn settings() -> Res<Settings> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if !common::is_bench_run() {
        // Fast knobs (as in vmm/tests/cold.rs), so that data turns cold within the short idle.
        return Ok(Settings {
            runs: 1,
            write_docs: false,
            memory: 32 * MIB,
            app: 4 * MIB,
            hot: MIB,
            seed: 1,
            idle: Duration::from_millis(600),
            window: Duration::from_millis(300),
            tick: Duration::from_millis(50),
            sample: Duration::from_millis(200),
            cold: ColdConfig {
                cold_age: Duration::from_millis(100),
                scan_period: Duration::from_millis(20),
                cpu_budget: 0.5,
                idle_cpu_budget: 0.9,
                ..ColdConfig::default()
            },
            root,
        });
    }
    let idle_s = common::env_number("COLD_BENCH_IDLE_S", 12, 6)?;
    Ok(Settings {
        runs: common::env_number("COLD_BENCH_RUNS", 5, 1)? as usize,
        write_docs: true,
        memory: 512 * MIB,
        app: 64 * MIB,
        hot: 16 * MIB,
        seed: 1,
        idle: Duration::from_secs(idle_s),
        window: Duration::from_secs(4),
        tick: Duration::from_millis(250),
        sample: Duration::from_secs(1),
        cold: ColdConfig::default(),
        root,
    })
}

fn run() -> Res<()> {
    let started = Instant::now();
    let settings = settings()?;
    if common::render::requested() {
        return render(&settings, started);
    }
    if common::skip_smoke("cold_report", settings.write_docs) {
        return Ok(());
    }
    common::host::check_vm_devices()?;
    // One directory per bench process, so that a smoke run cannot clear a running bench's files.
    let relative = Path::new("cold").join(format!("p{}", std::process::id()));
    let tmp = TempRoot::create("cold_report", &relative)?;
    let bench_run = common::host::BenchRun::begin();
    eprintln!(
        "cold_report: {} round(s) of {} cases × {} variants: a {} MiB VM with {} MiB of data, idle {:.1} s each; \
         temporary files in {} ({})",
        settings.runs,
        Case::ALL.len(),
        VARIANTS.len(),
        settings.memory / MIB,
        settings.app / MIB,
        settings.idle.as_secs_f64(),
        tmp.path.display(),
        tmp.filesystem
    );

    let digests = expected_digests(&settings);
    let mut results = Results::new(settings.runs);
    let mut unsupported: BTreeMap<&'static str, String> = BTreeMap::new();
    let total = settings.runs * Case::ALL.len() * VARIANTS.len();
    let mut done = 0;
    for run in 0..settings.runs {
        let round = Instant::now();
        let mut cases = Case::ALL;
        cases.rotate_left(run % Case::ALL.len());
        let mut variants = VARIANTS;
        if run % 2 == 1 {
            variants.reverse();
        }
        for case in cases {
            for variant in variants {
                done += 1;
                if unsupported.contains_key(variant.key) {
                    continue;
                }
                let t = Instant::now();
                let outcome =
                    measure::run_vm(&settings, &tmp.path, case, variant, run, &mut results)?;
                let digest = match outcome {
                    measure::Outcome::Done { digest } => digest,
                    measure::Outcome::Unsupported(why) => {
                        eprintln!("cold_report: {} skipped: {why}", variant.key);
                        unsupported.insert(variant.key, why);
                        continue;
                    }
                };
                let want = &digests[&case.name()];
                if digest != *want {
                    return Err(format!(
                        "round {}, {} on {}: digest {digest} after the idle period, expected {want}: \
                         the data changed",
                        run + 1,
                        case.name(),
                        variant.key
                    )
                    .into());
                }
                eprintln!(
                    "cold_report: [{done}/{total}] round {}, {} on {}: {:.1} MiB at the end of the idle period ({:.1} s)",
                    run + 1,
                    case.name(),
                    variant.key,
                    results
                        .values(&format!("{}.{}.memory_mib", case.name(), variant.key))
                        .get(run)
                        .copied()
                        .unwrap_or(f64::NAN),
                    t.elapsed().as_secs_f64()
                );
            }
        }
        results.put("bench.round_s", "s", run, round.elapsed().as_secs_f64());
        eprintln!(
            "cold_report: round {}/{} done in {:.0} s",
            run + 1,
            settings.runs,
            round.elapsed().as_secs_f64()
        );
    }
    drop(tmp);
    targets::derive(&mut results);
    let csv = results.csv(&CSV);
    // The report says what its CSV keeps, as render mode does.
    let results = Results::from_csv(&csv, &CSV)?;
    common::verdict::log("cold_report", &targets::verdicts(&results, &settings));
    let markdown = report_of(&results, &settings, &bench_run, &unsupported);
    // Built in the smoke run too (under target/, its shape checked), and its render mode
    // checked on its own CSV.
    let outputs = [
        ("md", markdown),
        ("csv", csv),
        ("svg", chart::svg(&results, &settings)?),
    ];
    if !settings.write_docs {
        common::render::check(&outputs[0].1, |run| {
            let results = Results::from_csv(&outputs[1].1, &CSV)?;
            Ok(report_of(
                &results,
                &settings,
                run,
                &unsupported_in(&results),
            ))
        })?;
    }
    write(&settings, &outputs, started)
}

/// Writes the report's `outputs` (`common::finish`).
fn write(settings: &Settings, outputs: &[(&str, String)], started: Instant) -> Res<()> {
    common::finish("cold_report", settings.write_docs, "cold", outputs, started)
}

/// The report of `results` (as the CSV keeps them) of the run `run`.
fn report_of(
    results: &Results,
    settings: &Settings,
    run: &common::host::BenchRun,
    unsupported: &BTreeMap<&'static str, String>,
) -> String {
    let verdicts = targets::verdicts(results, settings);
    let context = report::Context {
        settings,
        run,
        unsupported,
    };
    report::markdown(results, &verdicts, &context)
}

/// The variants kept results have no memory figure of: refused by the pager in that run, for a
/// reason the CSV does not keep.
fn unsupported_in(results: &Results) -> BTreeMap<&'static str, String> {
    VARIANTS
        .iter()
        .filter(|v| {
            let key = |case: Case| format!("{}.{}.memory_mib", case.name(), v.key);
            Case::ALL.iter().all(|&case| !results.has(&key(case)))
        })
        .map(|v| {
            (
                v.key,
                "not measured in this run (why is not kept in the CSV)".to_owned(),
            )
        })
        .collect()
}

/// Render mode: `cold.md` and `cold.svg` written again from the kept CSV and report.
fn render(settings: &Settings, started: Instant) -> Res<()> {
    let (results, run) = common::render::load(settings.write_docs, "cold", &CSV)?;
    let settings = Settings {
        runs: results.runs,
        ..settings.clone()
    };
    let outputs = [
        (
            "md",
            report_of(&results, &settings, &run, &unsupported_in(&results)),
        ),
        ("svg", chart::svg(&results, &settings)?),
    ];
    write(&settings, &outputs, started)
}

/// The digest every VM of a case must report: the guest's digest of the bytes its fill writes,
/// computed here.
fn expected_digests(settings: &Settings) -> BTreeMap<&'static str, String> {
    Case::ALL
        .into_iter()
        .map(|case| {
            let bytes = vmm::guest::fill_bytes(settings.app, case.fill(), settings.seed);
            (case.name(), vmm::guest::digest_hex(&bytes))
        })
        .collect()
}
