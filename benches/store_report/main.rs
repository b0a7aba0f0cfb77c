//! Scenario bench of the compressed block store; regenerates `docs/bench/store.md`,
//! `docs/bench/store.csv` and `docs/bench/store.svg`.
//!
//! `cargo bench --bench store_report` runs `STORE_BENCH_RUNS` (default 7) interleaved rounds.
//! Each round measures, on 64 MiB images and in an order that rotates from round to round:
//! - memory: two memcpy baselines (the whole image with one copy, and block by block: 1024
//!   copies of 64 KiB, in order) beside lz4 and zstd:3 decompression of the same image (1024
//!   blocks of 64 KiB, encoded beforehand, decoded in order), each into a fresh, touched
//!   64 MiB buffer, for realistic and repeated content; one thread each;
//! - writes: a raw file (create, `pwrite` of the 64 MiB, `fsync`) beside a store
//!   (`DiskStore::create`, `bulk::write_blocks`, `commit`) of the same bytes, with lz4 on 2 and
//!   1 threads and the default 4 MiB appends, for random, repeated and realistic content; the
//!   same with 1 MiB appends on random content, for information; zstd:3 stores of repeated
//!   content and zstd:1/3/9 stores of the realistic sample for their sizes;
//! - reads, from disk: the page cache of each file is dropped (`posix_fadvise(DONTNEED)`,
//!   residency checked with `mincore`), then one `pread` of the raw file beside
//!   `bulk::read_blocks` of the lz4 store with 2 and 1 threads, both into a fresh buffer.
//!
//! Before each timed write or read, untimed: `sync`, then a 96 MiB ballast file is read and
//! its pages dropped, so that the timed section gets recently used pages (see
//! `pagecache::recycle`).
//!
//! Every ratio is computed within a round (both sides measured minutes apart at most), then
//! summarised as min/median/max over the rounds. Temporary files live under
//! `target/bench-tmp/` (the real disk, never tmpfs) and are removed after each round.
//!
//! Run without `--bench` (as `cargo test --benches` does), it is a quick smoke test on 4 MiB
//! images that writes no report.
//!
//! Modules: `plan` (what is measured, and the keys), `measure` (the three phases),
//! `pagecache` (ballast, drop, residency), `results` (derived ratios, CSV format), `targets`
//! (verdicts), `report` (Markdown), `chart` (what the chart shows); from `common`: content,
//! `host` (temporary directory, machine facts, CPU time), `results` (series, summaries, CSV),
//! `chart` (the charts, drawn with plotters).

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::time::Instant;

use benchkit as common;
mod chart;
mod measure;
mod pagecache;
mod plan;
mod report;
mod results;
mod targets;

use common::host::{self, CpuTimes, TempRoot};
use common::{Content, Res, IMAGE};
use plan::{DECODERS, DISK_CONTENTS, MEMORY_CONTENTS};

fn main() {
    common::main("store_report", run);
}

/// How much to run, and whether to write the report.
#[derive(Debug)]
pub struct Settings {
    pub runs: usize,
    pub image: usize,
    pub write_docs: bool,
}

fn settings() -> Res<Settings> {
    if !common::is_bench_run() {
        return Ok(Settings {
            runs: 1,
            image: 4 << 20,
            write_docs: false,
        });
    }
    Ok(Settings {
        runs: common::env_number("STORE_BENCH_RUNS", 7, 1)? as usize,
        image: IMAGE,
        write_docs: true,
    })
}

fn run() -> Res<()> {
    let started = Instant::now();
    let cpu_at_start = CpuTimes::now();
    let settings = settings()?;
    let image = settings.image;
    let relative = format!("store-report-{}", std::process::id());
    let tmp = TempRoot::create("store_report", Path::new(&relative))?;
    eprintln!(
        "store_report: {} run(s) of {} MiB images; temporary files in {} ({})",
        settings.runs,
        image >> 20,
        tmp.path.display(),
        tmp.filesystem
    );

    let sample = common::realistic(image)?;
    let data: BTreeMap<Content, Vec<u8>> = DISK_CONTENTS
        .into_iter()
        .map(|content| (content, common::content(content, image, &sample)))
        .collect();
    let mut encoded = BTreeMap::new();
    for content in MEMORY_CONTENTS {
        for codec in DECODERS {
            let blocks = measure::encode_image(&data[&content], codec)?;
            encoded.insert((content, codec.to_string()), blocks);
        }
    }

    let mut results = results::Results::new(settings.runs);
    for run in 0..settings.runs {
        let round_started = Instant::now();
        let dir = tmp.path.join(format!("round-{run}"));
        fs::create_dir_all(&dir)?;
        let ballast = pagecache::write_ballast(&dir, &data[&Content::Random])?;
        let memory_first = run % 2 == 0;
        if memory_first {
            measure::memory_round(run, &data, &encoded, &mut results)?;
        }
        let stores = measure::write_round(run, &dir, &ballast, &data, &mut results)?;
        measure::read_round(run, &stores, &ballast, &data, &mut results)?;
        if !memory_first {
            measure::memory_round(run, &data, &encoded, &mut results)?;
        }
        fs::remove_dir_all(&dir)?;
        eprintln!(
            "store_report: round {}/{} done in {:.1} s",
            run + 1,
            settings.runs,
            round_started.elapsed().as_secs_f64()
        );
    }
    drop(tmp);

    results::derive(&mut results, image);
    let verdicts = targets::verdicts(&results, image);
    common::verdict::log("store_report", &verdicts);
    let elapsed_s = started.elapsed().as_secs_f64();
    let disturbance = report::disturbance(cpu_at_start, CpuTimes::now(), elapsed_s);
    eprintln!("store_report: CPU used meanwhile: {disturbance}");
    let context = report::Context {
        settings: &settings,
        sample: &sample,
        elapsed_s,
        filesystem: host::filesystem_of(&host::target_dir())?,
        disturbance,
    };
    // Built in the smoke run too (under target/, its shape checked).
    let outputs = [
        ("md", report::markdown(&results, &verdicts, &context)),
        ("csv", results.csv(&results::CSV)),
        ("svg", chart::svg(&results)?),
    ];
    common::finish(
        "store_report",
        settings.write_docs,
        "store",
        &outputs,
        started,
    )?;
    eprintln!(
        "store_report: total {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
