//! Scenario bench of the offload under a memory budget (issue 13, item 1); regenerates
//! `docs/bench/offload.md` and `docs/bench/offload.csv`.
//!
//! `cargo bench --bench offload_report` runs `OFFLOAD_BENCH_RUNS` (default 7) rounds. Each
//! measured offload runs in a child process of its own (this binary re-executed with
//! `--offload-child`), inside a fresh cgroup v1 memory cgroup that the bench creates and
//! removes: the child joins it before it allocates anything, maps a VM-shaped region
//! (512 MiB, anonymous, registered with an in-process pager) and writes 72 chunks of 1 MiB
//! spread over it (four in nine random, the rest compressible: 72 MiB touched), then
//! `Pager::offload_with` is timed. *Unbudgeted*: the cgroup has no limit. *Budgeted*: once the
//! child has written its data, the limit is set to its cgroup's usage then plus
//! `OFFLOAD_BENCH_MARGIN_MIB` (default 24), so an offload that keeps its page cache until the
//! end cannot fit. Cases: codec `none` and `lz4` × batches of 2, 8, 16 and 32 MiB and one batch
//! (`Batching::WHOLE`: the single-commit order of the offload before batches) × unbudgeted and
//! budgeted; within a round the two budget states of a case run back to back (their order
//! alternating by round) and the cases rotate. Each round also times one index commit of a
//! 512 MiB image's store (what every batch adds), and the write engine alone (`engine`:
//! buffered write-back + drop against `O_DIRECT`, the touched bytes in 8 MiB batches).
//!
//! `--quick` (or `OFFLOAD_BENCH_QUICK=1`), and a run without `--bench` (`cargo test
//! --benches`): 2 rounds of a 128 MiB region with 24 MiB touched, 8 MiB batches and one
//! batch only, no report written.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use compressed_backing::{BlockSize, Codec, CodecConfig, DiskStore, StoreConfig};

mod cgroup;
mod child;
use benchkit as common;
mod engine;
mod report;

use cgroup::MemCgroup;
use child::{Case, Layout, Outcome};
use common::host::{BenchRun, TempRoot};
use common::results::Results;
use common::{env_number, Res};

const MIB: usize = 1 << 20;
const BENCH: &str = "offload_report";

fn main() {
    if std::env::args().any(|a| a == "--offload-child") {
        common::main("offload_report child", child::run);
        return;
    }
    common::main(BENCH, run);
}

/// Sizes of one bench (full or quick).
#[derive(Debug, Clone)]
pub struct Settings {
    pub runs: usize,
    pub write_docs: bool,
    pub layout: Layout,
    pub margin: u64,
    /// Image bytes per batch of each case; `None`: one batch.
    pub batches: Vec<Option<u64>>,
    pub codecs: Vec<&'static str>,
    pub threads: usize,
}

fn settings() -> Res<Settings> {
    let quick = std::env::args().any(|a| a == "--quick")
        || std::env::var_os("OFFLOAD_BENCH_QUICK").is_some_and(|v| v == "1")
        || !common::is_bench_run();
    let runs = env_number("OFFLOAD_BENCH_RUNS", if quick { 2 } else { 7 }, 1)? as usize;
    let margin = env_number("OFFLOAD_BENCH_MARGIN_MIB", 24, 1)? << 20;
    let (layout, batches) = if quick {
        (
            Layout {
                region: 128 * MIB,
                chunk: MIB,
                chunks: 24,
            },
            vec![Some(8 << 20), None],
        )
    } else {
        (
            Layout {
                region: 512 * MIB,
                chunk: MIB,
                chunks: 72,
            },
            vec![
                Some(2 << 20),
                Some(8 << 20),
                Some(16 << 20),
                Some(32 << 20),
                None,
            ],
        )
    };
    Ok(Settings {
        runs,
        write_docs: !quick,
        layout,
        margin,
        batches,
        codecs: vec!["none", "lz4"],
        threads: 2,
    })
}

/// The key of a batch size.
pub fn batch_key(batch: Option<u64>) -> String {
    batch.map_or("whole".to_owned(), |b| format!("b{}m", b >> 20))
}

fn run() -> Res<()> {
    let settings = settings()?;
    if common::skip_smoke(BENCH, settings.write_docs) {
        return Ok(());
    }
    let began = Instant::now();
    let bench = BenchRun::begin();
    let tmp = TempRoot::create(BENCH, Path::new("offload"))?;
    let mut results = Results::new(settings.runs);
    let mut pairs = Vec::new();
    for &codec in &settings.codecs {
        for &batch in &settings.batches {
            pairs.push((codec, batch));
        }
    }
    let mut serial = 0;
    for round in 0..settings.runs {
        let started = Instant::now();
        for i in 0..pairs.len() {
            let (codec, batch) = pairs[(i + round) % pairs.len()];
            let order = if (round + i) % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for budgeted in order {
                serial += 1;
                let case = Case {
                    codec: codec.to_owned(),
                    batch,
                    dir: tmp.path.join(format!("store-{serial}")),
                    cgroup: PathBuf::new(),
                    layout: settings.layout,
                    threads: settings.threads,
                };
                measure(round, case, budgeted, &settings, &mut results)?;
            }
            let key = format!("{codec}.{}", batch_key(batch));
            results.ratio(
                &format!("{key}.ratio"),
                &format!("{key}.on.ms_per_mib"),
                &format!("{key}.off.ms_per_mib"),
                "x",
            );
        }
        index_commit(round, &tmp.path, &settings, &mut results)?;
        for i in 0..engine::ENGINES.len() {
            let name = engine::ENGINES[(i + round) % engine::ENGINES.len()];
            let batch = uffd_pager::offload::DEFAULT_BATCH_BYTES as usize;
            let ms = engine::measure(&tmp.path, name, settings.layout.touched(), batch)?;
            results.put(&format!("engine.{name}.ms_per_mib"), "ms/MiB", round, ms);
        }
        common::end_round(BENCH, &mut results, round, started);
    }
    let markdown = report::markdown(&bench, &settings, &results, &tmp.filesystem);
    let csv = results.csv(&common::results::KEY_RUN_CSV);
    if !settings.write_docs {
        // A quick run shows its figures instead of writing them.
        println!("{markdown}\n{csv}");
    }
    common::finish(
        BENCH,
        settings.write_docs,
        "offload",
        &[("md", markdown), ("csv", csv)],
        began,
    )
}

/// One offload in a child process in a fresh memory cgroup, limited if `budgeted`.
fn measure(
    round: usize,
    mut case: Case,
    budgeted: bool,
    settings: &Settings,
    results: &mut Results,
) -> Res<()> {
    let cg = MemCgroup::create(&format!("offload-bench-{}", std::process::id()))?;
    case.cgroup = cg.path.clone();
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .arg("--offload-child")
        .envs(case.env())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let mut stdin = child.stdin.take().ok_or("the child's stdin")?;
    let mut lines = BufReader::new(child.stdout.take().ok_or("the child's stdout")?).lines();
    let ready = lines.next().transpose()?.unwrap_or_default();
    if ready != "ready" {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("the child did not get ready: {ready:?}").into());
    }
    let base = cg.usage()?;
    if budgeted {
        cg.limit(base + settings.margin)?;
    }
    cg.reset_peak()?;
    writeln!(stdin, "go")?;
    stdin.flush()?;
    let outcome = lines.next().transpose()?;
    // The offload's peak, before the check reads everything back.
    let peak = cg.peak()?;
    let failcnt = cg.failcnt()?;
    let checked = if outcome.is_some() {
        writeln!(stdin, "check")?;
        stdin.flush()?;
        lines.next().transpose()?
    } else {
        None
    };
    let status = child.wait()?;
    let oom_kills = cg.oom_kills()?;
    drop(cg);
    let outcome = outcome.filter(|_| checked.as_deref() == Some("ok"));
    let key = format!(
        "{}.{}.{}",
        case.codec,
        batch_key(case.batch),
        if budgeted { "on" } else { "off" }
    );
    results.put(
        &format!("{key}.oom_kills"),
        "kills",
        round,
        oom_kills as f64,
    );
    results.put(&format!("{key}.failcnt"), "hits", round, failcnt as f64);
    results.put(
        &format!("{key}.peak_over_base_mib"),
        "MiB",
        round,
        peak.saturating_sub(base) as f64 / MIB as f64,
    );
    results.put(
        &format!("{key}.base_mib"),
        "MiB",
        round,
        base as f64 / MIB as f64,
    );
    match (status.success(), outcome) {
        (true, Some(line)) => {
            let o = Outcome::from_json(&line)?;
            let mib = case.layout.touched() as f64 / MIB as f64;
            results.put(&format!("{key}.ms"), "ms", round, o.ms);
            results.put(&format!("{key}.ms_per_mib"), "ms/MiB", round, o.ms / mib);
            results.put(&format!("{key}.write_ms"), "ms", round, o.write_ms);
            results.put(&format!("{key}.drop_ms"), "ms", round, o.drop_ms);
            results.put(
                &format!("{key}.batches"),
                "batches",
                round,
                o.batches as f64,
            );
            results.put(
                &format!("{key}.stored_mib"),
                "MiB",
                round,
                o.stored_bytes as f64 / MIB as f64,
            );
        }
        _ if oom_kills > 0 => {
            eprintln!(
                "{BENCH}: {key}: the child was OOM-killed (round {})",
                round + 1
            );
        }
        (_, outcome) => {
            return Err(format!("{key}: the child failed ({status}), said {outcome:?}").into());
        }
    }
    if case.dir.exists() {
        std::fs::remove_dir_all(&case.dir)?;
    }
    Ok(())
}

/// Times a commit of one changed block in a store of the region's size whose touched blocks
/// hold data: the index rewrite (and its fsyncs) that every batch adds.
fn index_commit(round: usize, tmp: &Path, settings: &Settings, results: &mut Results) -> Res<()> {
    let dir = tmp.join("index");
    let block = BlockSize::new(64 << 10)?;
    let mut store = DiskStore::create(
        &dir,
        StoreConfig {
            block_size: block,
            codec: CodecConfig::new(Codec::Lz4),
            image_size: settings.layout.region as u64,
        },
    )?;
    let blocks = (settings.layout.touched() / block.bytes()) as u64;
    let stride = store.blocks() / blocks;
    let data = common::repeated(block.bytes());
    for b in 0..blocks {
        store.put(b * stride, &data)?;
    }
    store.commit_uncached()?;
    let mut times = Vec::new();
    for b in 0..5 {
        store.put(b * stride + 1, &data)?;
        let started = Instant::now();
        store.commit_uncached()?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    results.put("index.commit_ms", "ms", round, times[times.len() / 2]);
    results.put(
        "index.bytes",
        "bytes",
        round,
        std::fs::metadata(dir.join("index"))
            .map(|m| m.len() as f64)
            .unwrap_or(f64::NAN),
    );
    drop(store);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
