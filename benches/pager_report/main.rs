//! Scenario bench of the pager (issue 3); regenerates `docs/bench/pager.md`,
//! `docs/bench/pager.csv` and `docs/bench/pager.svg`.
//!
//! `cargo bench --bench pager_report` runs `PAGER_BENCH_RUNS` (default 5) interleaved rounds.
//! Host threads touch registered memory (no KVM). Each round measures, side by side:
//! 1. `latency`: fault latency p50/p99 for the zero page, a raw-file page, an lz4 block and a
//!    zstd block, one touch per 64 KiB block, from the touching thread and from the pager's
//!    histogram; 1 vs 2 fault threads with 1 and 4 touching threads (raw and lz4);
//! 2. `restore`: a 512 MiB image restored through our `Server` (raw file, lz4 store) and
//!    through a Firecracker-example-style handler (`firecracker`), touching 64 MiB of it or all;
//! 3. `offload`: `Pager::offload` of 512 MiB regions, raw and lz4, 128 MiB or all written;
//! 4. `resume`: first vs second (vs third) lazy resume with the recorded working set, with no
//!    head start and with `PAGER_BENCH_HEAD_START_MS` (default 20);
//! 5. `upgrade`: the real `uffd-pager serve` on a keeper, upgraded (SIGTERM, a new server)
//!    while a guest reads its memory: the guest's longest fault wait, beside a pass without an
//!    upgrade. Needs `target/release/uffd-pager` built from the current sources; a smoke run
//!    skips it otherwise.
//!
//! Within a round every part rotates the order of its cases; even rounds run the parts 1→5,
//! odd rounds 5→1. Ratios are computed within a round, then summarised (min/median/max).
//! Temporary files live under `target/bench-tmp/pager/` (the real disk) and are removed.
//!
//! Run without `--bench` (as `cargo test --benches` does), it is a quick smoke run on 16 MiB
//! images that writes no report.

use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use compressed_backing::{pack_file, BlockSize, Codec, CodecConfig, DiskStore, PackOptions};
use uffd_pager::source::{PageSource, RawFileSource, StoreSource};

use benchkit as common;
mod chart;
mod findings;
mod firecracker;
mod latency;
mod offload;
mod ram;
mod report;
mod restore;
mod resume;
mod targets;
mod upgrade;

use common::host::TempRoot;
use common::{env_number, Res};

const MIB: usize = 1 << 20;

fn main() {
    common::main("pager_report", run);
}

/// Sizes of one bench (full or smoke).
#[derive(Debug, Clone)]
pub struct Settings {
    pub runs: usize,
    /// Nice value of the bench's threads (`PAGER_BENCH_NICE`, default -10): the machine is
    /// shared, and other work at the default priority would otherwise delay every wake-up.
    pub nice: i32,
    /// Parts to run (`PAGER_BENCH_PARTS=1,3`; all by default). Docs are written only when all
    /// five ran.
    pub parts: Vec<u32>,
    pub write_docs: bool,
    pub head_start_ms: u64,
    /// The VM image (restore, offload, resume).
    pub image: usize,
    /// Bytes of real ELF data before the image repeats.
    pub tile: usize,
    /// The region of the latency part.
    pub latency_region: usize,
    /// Lazy restore and working set: `lazy_total` bytes in chunks of `lazy_chunk`.
    pub lazy_total: usize,
    pub lazy_chunk: usize,
    /// Offload of the mixed region.
    pub repeated: usize,
    pub random: usize,
}

fn settings() -> Res<Settings> {
    let head_start_ms = env_number("PAGER_BENCH_HEAD_START_MS", 20, 1)?;
    let parts: Vec<u32> = match std::env::var("PAGER_BENCH_PARTS") {
        Ok(text) => text
            .split(',')
            .map(|p| p.trim().parse().ok().filter(|p| (1..=5).contains(p)))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                format!("PAGER_BENCH_PARTS={text}: expected numbers 1 to 5, comma-separated")
            })?,
        Err(_) => vec![1, 2, 3, 4, 5],
    };
    let all_parts = (1..=5).all(|p| parts.contains(&p));
    let nice = match std::env::var("PAGER_BENCH_NICE") {
        Ok(text) => text
            .trim()
            .parse::<i32>()
            .ok()
            .filter(|n| (-20..=19).contains(n))
            .ok_or_else(|| format!("PAGER_BENCH_NICE={text}: expected -20 to 19"))?,
        Err(_) => -10,
    };
    if !common::is_bench_run() {
        return Ok(Settings {
            runs: 1,
            nice,
            parts,
            write_docs: false,
            head_start_ms,
            image: 16 * MIB,
            tile: 16 * MIB,
            latency_region: 4 * MIB,
            lazy_total: 2 * MIB,
            lazy_chunk: 256 << 10,
            repeated: 2 * MIB,
            random: 2 * MIB,
        });
    }
    Ok(Settings {
        runs: env_number("PAGER_BENCH_RUNS", 5, 1)? as usize,
        nice,
        parts,
        write_docs: all_parts,
        head_start_ms,
        image: 512 * MIB,
        tile: 128 * MIB,
        latency_region: 128 * MIB,
        lazy_total: 64 * MIB,
        lazy_chunk: MIB,
        repeated: 64 * MIB,
        random: 64 * MIB,
    })
}

/// Untimed setup figures for the report.
#[derive(Debug, Default)]
pub struct Prepared {
    pub raw_write_s: f64,
    pub pack: Vec<(String, f64, compressed_backing::StoreStats)>,
}

fn pack(raw: &Path, dir: &Path, codec: Codec, prepared: &mut Prepared) -> Res<Arc<dyn PageSource>> {
    let started = Instant::now();
    let options = PackOptions {
        codec: Some(CodecConfig::new(codec)),
        block_size: Some(BlockSize::default()),
        ..PackOptions::default()
    };
    let (_, stats) = pack_file(raw, dir, &options, &|_| {})?;
    prepared
        .pack
        .push((codec.to_string(), started.elapsed().as_secs_f64(), stats));
    Ok(Arc::new(StoreSource::new(DiskStore::open_read_only(dir)?)))
}

fn run() -> Res<()> {
    let started = Instant::now();
    let settings = settings()?;
    if settings.nice != 0 {
        // Every thread made from here on (ours, the pagers', the servers') inherits it.
        // SAFETY: setpriority has no memory-safety preconditions; its result is checked.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, settings.nice) };
        if rc != 0 {
            return Err(format!(
                "setpriority({}): {}",
                settings.nice,
                std::io::Error::last_os_error()
            )
            .into());
        }
    }
    let tmp = TempRoot::create("pager_report", Path::new("pager"))?;
    eprintln!(
        "pager_report: {} run(s), {} MiB image; temporary files in {} ({})",
        settings.runs,
        settings.image / MIB,
        tmp.path.display(),
        tmp.filesystem
    );
    let tile = settings.tile.min(settings.image);
    let image = common::elf_sample(tile, "PAGER_BENCH_SAMPLE")?.tiled(settings.image);
    let (repeated, random) = offload::mixed_data(settings.repeated, settings.random);
    let lazy = ram::scattered(settings.image, settings.lazy_total, settings.lazy_chunk);

    let mut prepared = Prepared::default();
    let raw_path = tmp.path.join("mem.raw");
    let t = Instant::now();
    {
        use std::io::Write as _;
        let mut file = fs::File::create(&raw_path)?;
        file.write_all(&image.bytes)?;
        file.sync_all()?;
    }
    prepared.raw_write_s = t.elapsed().as_secs_f64();
    let raw: Arc<dyn PageSource> = Arc::new(RawFileSource::open(&raw_path)?);
    let (lz4_dir, zstd_dir) = (tmp.path.join("store-lz4"), tmp.path.join("store-zstd"));
    let lz4 = pack(&raw_path, &lz4_dir, Codec::Lz4, &mut prepared)?;
    let zstd = pack(
        &raw_path,
        &zstd_dir,
        Codec::Zstd { level: 3 },
        &mut prepared,
    )?;
    let sources = latency::Sources {
        raw: Arc::clone(&raw),
        lz4: Arc::clone(&lz4),
        zstd,
        lz4_dir,
        zstd_dir,
    };
    // RAM of 2 MiB pages for the restore part, reserved while the bench runs: the time to make
    // a huge page (seconds, where the kernel compacts memory first) is not what is compared.
    let wanted = (settings.image >> 21) as u64 + 8;
    let (_huge_pages, reserved) = testkit::hugepages::HugePages::reserve(wanted);
    if reserved < wanted {
        eprintln!(
            "pager_report: only {reserved} of {wanted} huge pages could be reserved; the rest \
             are made as they fault, which may stall the huge-page cases"
        );
    }
    let raw_server =
        restore::Running::start(&tmp.path.join("ours-raw.sock"), raw, BlockSize::default())?;
    let lz4_server =
        restore::Running::start(&tmp.path.join("ours-lz4.sock"), lz4, BlockSize::default())?;
    let head_starts = [0, settings.head_start_ms];
    let work = tmp.path.join("work");
    fs::create_dir_all(&work)?;
    let restore_setup = restore::Setup {
        raw_server: &raw_server,
        lz4_server: &lz4_server,
        mem_file: &raw_path,
        fc_socket: &tmp.path.join("firecracker.sock"),
        image: &image.bytes,
        lazy: &lazy,
    };
    let offload_setup = offload::Setup {
        dir: &work,
        image: &image.bytes,
        repeated: &repeated,
        random: &random,
    };
    let resume_setup = resume::Setup {
        dir: &work,
        image: &image.bytes,
        working_set: &lazy,
        head_starts_ms: &head_starts,
    };
    // Part 5 runs the real binaries.
    let upgrade_setup = if settings.parts.contains(&5) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        match common::vmproc::find_pager_binary(root, &common::host::target_dir()) {
            Ok(bin) => Some(upgrade::Setup::start(
                &bin,
                &tmp.path.join("upgrade"),
                &raw_path,
                settings.image.min(64 * MIB),
            )?),
            Err(why) if !common::is_bench_run() => {
                eprintln!("pager_report: part 5 (upgrade) skipped: {why}");
                None
            }
            Err(why) => return Err(why.into()),
        }
    } else {
        None
    };
    latency::warm_up(
        settings.latency_region.min(16 * MIB),
        &sources,
        &image.bytes,
    )?;
    eprintln!(
        "pager_report: setup done in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let mut results = common::results::Results::new(settings.runs);
    for run in 0..settings.runs {
        let round = Instant::now();
        let mut parts = settings.parts.clone();
        if run % 2 == 1 {
            parts.reverse();
        }
        for part in parts {
            let t = Instant::now();
            let cpu = common::host::CpuSample::now();
            match part {
                1 => latency::round(
                    run,
                    settings.latency_region,
                    &sources,
                    &image.bytes,
                    &mut results,
                )?,
                2 => restore::round(run, &restore_setup, &mut results)?,
                3 => offload::round(run, &offload_setup, &mut results)?,
                4 => resume::round(run, &resume_setup, &mut results)?,
                _ => {
                    if let Some(setup) = &upgrade_setup {
                        upgrade::round(run, setup, &mut results)?;
                    }
                }
            }
            let part_s = t.elapsed().as_secs_f64();
            let (other, steal) = cpu.since();
            let pct = "% of a CPU";
            let figures = [
                ("s", "s", part_s),
                ("other_cpu_pct", pct, other),
                ("steal_pct", pct, steal),
            ];
            for (quantity, unit, value) in figures {
                results.put(&format!("bench.part{part}_{quantity}"), unit, run, value);
            }
        }
        eprintln!(
            "pager_report: round {}/{} done in {:.1} s",
            run + 1,
            settings.runs,
            round.elapsed().as_secs_f64()
        );
    }
    drop(upgrade_setup);
    drop(raw_server);
    drop(lz4_server);
    drop(sources);
    drop(tmp);

    targets::derive(&mut results, &settings);
    let verdicts = targets::verdicts(&results, &settings);
    common::verdict::log("pager_report", &verdicts);
    let context = report::Context {
        settings: &settings,
        image: &image,
        prepared: &prepared,
        elapsed_s: started.elapsed().as_secs_f64(),
        filesystem: common::host::filesystem_of(&common::host::target_dir())?,
    };
    let csv = results.csv(&common::results::KEY_RUN_CSV);
    let outputs = [
        ("md", report::markdown(&results, &verdicts, &context)),
        ("csv", csv.clone()),
        ("svg", chart::svg(&results, &settings)?),
    ];
    common::finish(
        "pager_report",
        settings.write_docs,
        "pager",
        &outputs,
        started,
    )?;
    if std::env::var_os("PAGER_BENCH_DUMP").is_some() {
        println!("{csv}");
    }
    eprintln!(
        "pager_report: total {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
