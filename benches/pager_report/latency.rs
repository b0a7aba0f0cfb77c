//! Part 1: fault latency per source, and 1 vs 2 fault-serving threads.
//!
//! An in-process pager serves a fresh anonymous region; host threads read one byte at the
//! start of every 64 KiB block, so every read is a fault (the pager installs the whole block
//! when all its pages are missing, so a second read in the same block would not fault). Each
//! read is timed by the reading thread; the pager's own histogram (`Metrics::fault_latency`,
//! from reading the event to waking the thread) is reported beside it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use compressed_backing::{Decoder, DiskStore};

use uffd_pager::pager::PagerConfig;
use uffd_pager::source::PageSource;
use uffd_pager::state::PageState;

use crate::common::results::Results;
use crate::ram::{self, Mapping, BLOCK};
use crate::Res;

/// Where faulting pages come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Fresh RAM: `UFFDIO_ZEROPAGE`.
    Zero,
    /// A raw memory file (`RawFileSource`).
    Raw,
    /// A store packed with lz4 (`StoreSource`).
    Lz4,
    /// A store packed with zstd:3 (`StoreSource`).
    Zstd,
}

impl Source {
    pub const ALL: [Source; 4] = [Source::Zero, Source::Raw, Source::Lz4, Source::Zstd];

    pub fn key(self) -> &'static str {
        match self {
            Source::Zero => "zero",
            Source::Raw => "raw",
            Source::Lz4 => "lz4",
            Source::Zstd => "zstd",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Source::Zero => "zero page (fresh RAM)",
            Source::Raw => "raw-file page (`RawFileSource`)",
            Source::Lz4 => "lz4 block (`StoreSource`, lz4 store)",
            Source::Zstd => "zstd block (`StoreSource`, zstd:3 store)",
        }
    }
}

/// The restore sources, opened once.
pub struct Sources {
    pub raw: Arc<dyn PageSource>,
    pub lz4: Arc<dyn PageSource>,
    pub zstd: Arc<dyn PageSource>,
    /// The stores' directories, to split a read into fetch + check and decode.
    pub lz4_dir: PathBuf,
    pub zstd_dir: PathBuf,
}

/// One configuration: source, fault-serving threads, touching threads.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub source: Source,
    pub threads: usize,
    pub touchers: usize,
}

impl Config {
    pub fn key(self) -> String {
        format!(
            "latency.{}.t{}.c{}",
            self.source.key(),
            self.threads,
            self.touchers
        )
    }
}

/// The configurations measured one source at a time: raw and lz4 with 2 fault threads and
/// with 4 touching threads (1 fault thread and 1 touching thread is the interleaved case).
pub fn configs() -> Vec<Config> {
    let mut all = Vec::new();
    for source in [Source::Raw, Source::Lz4] {
        for (threads, touchers) in [(1, 1), (2, 1), (1, 4), (2, 4)] {
            all.push(Config {
                source,
                threads,
                touchers,
            });
        }
    }
    all
}

/// The quantile `per_mille`/1000 (nearest rank) of sorted nanoseconds, in microseconds.
fn quantile_us(sorted: &[u64], per_mille: usize) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (per_mille * sorted.len())
        .div_ceil(1000)
        .clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1e3
}

/// Measures the interleaved case and every configuration once, in an order rotated by `run`,
/// then the cost of reading a block from each source alone.
pub fn round(
    run: usize,
    region: usize,
    sources: &Sources,
    image: &[u8],
    results: &mut Results,
) -> Res<()> {
    let configs: Vec<Config> = configs()
        .into_iter()
        .filter(|c| (c.threads, c.touchers) != (1, 1))
        .collect();
    let cases = configs.len() + 1;
    for i in 0..cases {
        match (i + run) % cases {
            0 => interleaved(run, region, sources, image, results)?,
            n => measure(run, configs[n - 1], region, sources, image, results)?,
        }
    }
    read_cost(run, region, sources, results)
}

/// One untimed pass over every source (the process's first faults, first reads of each
/// store), so that the first measured case does not pay for them.
pub fn warm_up(region: usize, sources: &Sources, image: &[u8]) -> Res<()> {
    interleaved(0, region, sources, image, &mut Results::new(1))
}

fn setup(source: Source, sources: &Sources) -> (PageState, Option<Arc<dyn PageSource>>) {
    match source {
        Source::Zero => (PageState::Zero, None),
        Source::Raw => (PageState::Source, Some(Arc::clone(&sources.raw))),
        Source::Lz4 => (PageState::Source, Some(Arc::clone(&sources.lz4))),
        Source::Zstd => (PageState::Source, Some(Arc::clone(&sources.zstd))),
    }
}

fn ns(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Untimed: every block of `map` holds the image's bytes (zeros from the zero page).
fn check(map: &Mapping, source: Source, image: &[u8], blocks: usize) -> Res<()> {
    for block in 0..blocks {
        let want = if source == Source::Zero {
            0
        } else {
            image[block * BLOCK]
        };
        if map.read(block * BLOCK) != want {
            return Err(format!("{source:?}: block {block} differs from the image").into());
        }
    }
    Ok(())
}

/// All four sources side by side: one region and one pager (one fault thread) each; one
/// thread touches block 0 of every region, then block 1 of every region, and so on (the order
/// of the sources rotating from block to block), so that every source's faults are spread over
/// the same stretch of time and meet the same background load.
fn interleaved(
    run: usize,
    region: usize,
    sources: &Sources,
    image: &[u8],
    results: &mut Results,
) -> Res<()> {
    ram::recycle(Source::ALL.len() * region + region / 2)?;
    let mut maps = Vec::new();
    let mut pagers = Vec::new();
    let mut threads = Vec::new();
    for source in Source::ALL {
        let (initial, restore) = setup(source, sources);
        let map = Mapping::try_anon(region)?;
        let before: Vec<u64> = ram::fault_thread_cpu().iter().map(|t| t.0).collect();
        let pager = ram::pager(
            &map,
            PagerConfig {
                threads: 1,
                initial,
                ..PagerConfig::default()
            },
            restore,
        )?;
        let mine: Vec<u64> = ram::fault_thread_cpu()
            .iter()
            .map(|t| t.0)
            .filter(|tid| !before.contains(tid))
            .collect();
        maps.push(map);
        pagers.push(pager);
        threads.push(mine);
    }
    let n = Source::ALL.len();
    let blocks = region / BLOCK;
    let mut latencies = vec![Vec::with_capacity(blocks); n];
    let mut faults = vec![0u64; n];
    let cpu_before = ram::fault_thread_cpu();
    for block in 0..blocks {
        for j in 0..n {
            let i = (block + j) % n;
            let before = ram::thread_faults();
            let started = Instant::now();
            let byte = maps[i].read(block * BLOCK);
            let elapsed = started.elapsed();
            faults[i] += ram::thread_faults() - before;
            std::hint::black_box(byte);
            latencies[i].push(ns(elapsed));
        }
    }
    let cpu_after = ram::fault_thread_cpu();
    for (i, source) in Source::ALL.into_iter().enumerate() {
        check(&maps[i], source, image, blocks)?;
        let m = pagers[i].metrics().snapshot();
        let mine = |list: &[(u64, u64)]| -> Vec<(u64, u64)> {
            list.iter()
                .copied()
                .filter(|t| threads[i].contains(&t.0))
                .collect()
        };
        let (cpu_ns, _) = ram::fault_thread_work(&mine(&cpu_before), &mine(&cpu_after));
        let lat = &mut latencies[i];
        let busy_ns: u64 = lat.iter().sum();
        lat.sort_unstable();
        let key = Config {
            source,
            threads: 1,
            touchers: 1,
        }
        .key();
        let pager_faults = (m.faults_copy + m.faults_zero) as f64;
        let figures = [
            ("touch_p50_us", "µs", quantile_us(lat, 500)),
            ("touch_p99_us", "µs", quantile_us(lat, 990)),
            ("pager_p50_us", "µs", m.fault_latency.p50_us),
            ("pager_p99_us", "µs", m.fault_latency.p99_us),
            ("faults", "faults", pager_faults),
            ("thread_faults", "faults", faults[i] as f64),
            (
                "faults_per_s",
                "faults/s",
                pager_faults / (busy_ns as f64 / 1e9),
            ),
            (
                "fault_cpu_us_per_fault",
                "µs",
                cpu_ns as f64 / 1e3 / pager_faults,
            ),
        ];
        results.put_all(&key, run, figures);
    }
    drop(pagers);
    drop(maps);
    Ok(())
}

/// `PageSource::read` of every block of the region in order, one thread, no userfaultfd:
/// the part of a fault spent fetching (and for a store, checking and decoding) the block.
fn read_cost(run: usize, region: usize, sources: &Sources, results: &mut Results) -> Res<()> {
    let mut buf = vec![0u8; BLOCK];
    for (name, source) in [
        ("raw", &sources.raw),
        ("lz4", &sources.lz4),
        ("zstd", &sources.zstd),
    ] {
        let mut times = Vec::with_capacity(region / BLOCK);
        let mut decompressed = 0;
        for block in 0..region / BLOCK {
            let started = Instant::now();
            source.read((block * BLOCK) as u64, &mut buf, &mut decompressed)?;
            times.push(ns(started.elapsed()));
        }
        times.sort_unstable();
        results.put_all(
            &format!("latency.{name}"),
            run,
            [
                ("read_p50_us", "µs", quantile_us(&times, 500)),
                ("read_p99_us", "µs", quantile_us(&times, 990)),
            ],
        );
    }
    // The same reads split: fetch the payload and check its checksum, then decode it.
    for (name, dir) in [("lz4", &sources.lz4_dir), ("zstd", &sources.zstd_dir)] {
        let store = DiskStore::open_read_only(dir)?;
        let mut decoder = Decoder::new();
        let mut payload = Vec::with_capacity(BLOCK);
        let (mut fetch, mut decode) = (Vec::new(), Vec::new());
        let mut payload_bytes = 0;
        for block in 0..(region / BLOCK) as u64 {
            let t0 = Instant::now();
            let kind = store.get_encoded(block, &mut payload)?;
            let t1 = Instant::now();
            if let Some(kind) = kind {
                decoder.decode(kind, &payload, &mut buf)?;
            }
            let t2 = Instant::now();
            payload_bytes += payload.len();
            fetch.push(ns(t1 - t0));
            decode.push(ns(t2 - t1));
        }
        fetch.sort_unstable();
        decode.sort_unstable();
        results.put_all(
            &format!("latency.{name}"),
            run,
            [
                ("fetch_p50_us", "µs", quantile_us(&fetch, 500)),
                ("decode_p50_us", "µs", quantile_us(&decode, 500)),
                (
                    "payload_kib",
                    "KiB",
                    payload_bytes as f64 / 1024.0 / (region / BLOCK) as f64,
                ),
            ],
        );
    }
    Ok(())
}

fn measure(
    run: usize,
    config: Config,
    region: usize,
    sources: &Sources,
    image: &[u8],
    results: &mut Results,
) -> Res<()> {
    let (initial, restore) = setup(config.source, sources);
    ram::recycle(region + region / 2)?;
    let map = Mapping::try_anon(region)?;
    let pager = ram::pager(
        &map,
        PagerConfig {
            threads: config.threads,
            initial,
            ..PagerConfig::default()
        },
        restore,
    )?;
    let blocks = region / BLOCK;
    let cpu_before = ram::fault_thread_cpu();
    let (mut latencies, wall, thread_faults) = ram::touch_blocks(&map, blocks, config.touchers);
    let (cpu_ns, busiest) = ram::fault_thread_work(&cpu_before, &ram::fault_thread_cpu());
    check(&map, config.source, image, blocks)?;
    let m = pager.metrics().snapshot();
    drop(pager);
    drop(map);
    latencies.sort_unstable();
    let key = config.key();
    let faults = (m.faults_copy + m.faults_zero) as f64;
    results.put_all(
        &key,
        run,
        [
            ("touch_p50_us", "µs", quantile_us(&latencies, 500)),
            ("touch_p99_us", "µs", quantile_us(&latencies, 990)),
            ("pager_p50_us", "µs", m.fault_latency.p50_us),
            ("pager_p99_us", "µs", m.fault_latency.p99_us),
            ("faults", "faults", faults),
            ("thread_faults", "faults", thread_faults as f64),
            ("faults_per_s", "faults/s", faults / wall.as_secs_f64()),
            ("wall_ms", "ms", wall.as_secs_f64() * 1e3),
            ("fault_cpu_us_per_fault", "µs", cpu_ns as f64 / 1e3 / faults),
            ("busiest_fault_thread_share", "share", busiest),
        ],
    );
    Ok(())
}
