//! The size sweep (`REMOTE_BENCH_SIZES=1`): which block size and which prefetch request size
//! a snapshot in an object store should use; regenerates `docs/bench/remote-sizes.md` and
//! `.csv`.
//!
//! Two workloads, each in a detached 512 MiB VM:
//! - `dense`: `fill 32MiB distinct` (a long run of partly compressible data: a heap, a page
//!   cache);
//! - `sparse`: `fill 128MiB zero; rewrite 1`: about one page in a hundred holds data, the
//!   rest are zero (memory touched here and there: a long-lived process's scattered pages).
//!
//! Each is snapshotted to the bucket with every block size under test, and once more from a
//! VM that restored that snapshot and read it back (with its working set). Each round then
//! restores every snapshot in rotated order at one round trip (default 20 ms) with a fresh
//! cache, lazily and with the working set, and the dense 64 KiB working-set case with other
//! request sizes and request counts; `pvisor run --restore … -- digest` in a new process.

use std::fs;
use std::path::Path;
use std::time::Instant;

use super::common::host::BenchRun;
use super::common::results::{fig, Results, KEY_RUN_CSV};
use super::common::{self, env_number, vmproc, Res};
use super::{restore_and_digest, strs, Case, BENCH, MIB};
use testkit::s3::S3Server;

const BLOCKS_KIB: [u64; 4] = [16, 64, 256, 1024];
const REQUEST_SIZES_KIB: [u64; 3] = [256, 1024, 16384];
const REQUEST_COUNTS: [u64; 2] = [4, 16];
const CHUNKS_MIB: [u64; 4] = [8, 32, 64, 256];
/// The raw image the chunk cases upload.
const CHUNK_IMAGE_MIB: u64 = 256;

struct Workload {
    name: &'static str,
    script: String,
    /// Bytes of data the digest reads (zero pages left out).
    touched: f64,
}

fn workloads() -> Vec<Workload> {
    // `rewrite 1 seed=3` over zeros: the pages the guest's own rule picks, as it counts them.
    let sparse = 128u64 << 20;
    let mut zeros = vec![0u8; sparse as usize];
    let pages = vmm::guest::rewrite_bytes(&mut zeros, 1, 3);
    vec![
        Workload {
            name: "dense",
            script: "fill 32MiB distinct seed=7; idle".into(),
            touched: 32.0 * MIB,
        },
        Workload {
            name: "sparse",
            script: format!("fill {}MiB zero; rewrite 1 seed=3; idle", sparse >> 20),
            touched: (pages * basics::PAGE_SIZE) as f64,
        },
    ]
}

/// The sweep; `remote` gives the options that reach the server with a cache.
pub fn run(
    bin: &Path,
    server: &S3Server,
    tmp: &Path,
    remote: &dyn Fn(&Path) -> Vec<String>,
    write_docs: bool,
    started: Instant,
) -> Res<()> {
    let (runs, rtt) = if write_docs {
        (
            env_number("REMOTE_BENCH_RUNS", 5, 1)? as usize,
            env_number("REMOTE_BENCH_SIZES_RTT_MS", 20, 0)?,
        )
    } else {
        (1, 1)
    };
    let bench_run = BenchRun::begin();
    server.create_bucket("sizes");
    let workloads = workloads();
    let mut results = Results::new(runs);
    let mut cases = Vec::new();
    for (w, workload) in workloads.iter().enumerate() {
        eprintln!("{BENCH}: writing the {} snapshots", workload.name);
        let job = format!("sizes-{}", workload.name);
        let origin = vmproc::Job::start(
            bin,
            &job,
            &[
                "--executor",
                "vm",
                "--memory",
                "512MiB",
                "--",
                &workload.script,
            ],
        )?;
        let digest = origin
            .exec("digest")?
            .ok_or("the origin VM's digest gave no digest")?;
        for kib in BLOCKS_KIB {
            let plain = format!("s3://sizes/{}-{kib}k", workload.name);
            let cache = tmp.join(format!("cache-sizes-{w}-{kib}"));
            let out = snapshot(bin, &job, &plain, kib, &remote(&cache))?;
            let uploaded: serde_json::Value = serde_json::from_str(&out)?;
            let ram = &uploaded["uploaded"]["ram"];
            let key = format!("{}-{kib}k", workload.name);
            for (field, unit) in [("bytes", "B"), ("index_bytes", "B")] {
                let value = ram[field].as_f64().ok_or("no RAM upload in the reply")?;
                for run in 0..runs {
                    results.put(&format!("{key}.store_{field}"), unit, run, value);
                }
            }
            // A VM that restores it and reads it all back: its snapshot carries that
            // working set.
            let reader_job = format!("sizes-{w}-{kib}-reader");
            let mut args: Vec<String> = ["--executor", "vm", "--memory", "512MiB", "--restore"]
                .map(String::from)
                .to_vec();
            args.push(plain.clone());
            args.extend(remote(&cache));
            args.extend(["--".into(), "digest; idle".into()]);
            let reader = vmproc::Job::start(bin, &reader_job, &strs(&args))?;
            let ws = format!("{plain}-ws");
            snapshot(bin, &reader_job, &ws, kib, &remote(&cache))?;
            vmproc::stop_all(vec![reader])?;
            let _ = fs::remove_dir_all(&cache);
            for (mode, url) in [("lazy", &plain), ("ws", &ws)] {
                cases.push((
                    w,
                    digest.clone(),
                    Case {
                        key: format!("{key}-{mode}"),
                        restore: url.clone(),
                        extra: Vec::new(),
                        rtt_ms: rtt,
                        fresh_cache: true,
                    },
                ));
            }
            if workload.name == "dense" && kib == 64 {
                let variants = REQUEST_SIZES_KIB
                    .iter()
                    .map(|s| {
                        (
                            format!("req{s}k"),
                            ["--s3-request-size".into(), format!("{s}KiB")],
                        )
                    })
                    .chain(
                        REQUEST_COUNTS
                            .iter()
                            .map(|n| (format!("par{n}"), ["--s3-requests".into(), n.to_string()])),
                    );
                for (name, extra) in variants {
                    cases.push((
                        w,
                        digest.clone(),
                        Case {
                            key: format!("{key}-ws-{name}"),
                            restore: ws.clone(),
                            extra: extra.to_vec(),
                            rtt_ms: rtt,
                            fresh_cache: true,
                        },
                    ));
                }
            }
        }
        vmproc::stop_all(vec![origin])?;
    }
    // The chunk cases: `uffd-pager pack --store s3://… --chunk-size` of random data.
    let packer = bin.with_file_name("uffd-pager");
    if !packer.exists() {
        return Err(format!("{} is missing: cargo build --release", packer.display()).into());
    }
    let raw = tmp.join("chunks.raw");
    fs::write(
        &raw,
        testkit::random_bytes(11, (CHUNK_IMAGE_MIB << 20) as usize),
    )?;
    for round in 0..runs {
        server.set_delay(std::time::Duration::from_millis(rtt));
        for i in 0..CHUNKS_MIB.len() {
            let mib = CHUNKS_MIB[(i + round) % CHUNKS_MIB.len()];
            let cache = tmp.join(format!("cache-chunks-{round}-{mib}"));
            let mut args = vec![
                "pack".to_owned(),
                "--mem-file".into(),
                raw.display().to_string(),
                "--store".into(),
                format!("s3://sizes/chunks-{mib}m-{round}"),
                "--chunk-size".into(),
                format!("{mib}MiB"),
                "--codec".into(),
                "lz4".into(),
                "--json".into(),
            ];
            args.extend(remote(&cache));
            let out = vmproc::cli(&packer, &strs(&args))?;
            let value: serde_json::Value = serde_json::from_str(out.trim())?;
            let up = &value["uploaded"];
            let key = format!("chunks-{mib}m");
            let field = |name: &str| up[name].as_f64().ok_or(format!("no `{name}` in {out}"));
            results.put(&format!("{key}.upload_s"), "s", round, field("elapsed_s")?);
            results.put(&format!("{key}.chunks"), "", round, field("chunks")?);
            let _ = fs::remove_dir_all(&cache);
        }
        server.set_delay(std::time::Duration::ZERO);
    }
    let _ = fs::remove_file(&raw);
    for round in 0..runs {
        let n = cases.len();
        for i in 0..n {
            let (w, digest, case) = &cases[(i + round) % n];
            let cache = tmp.join(format!("cache-sizes-{round}-{}", case.key));
            let measured = restore_and_digest(bin, server, case, &cache, &remote(&cache), digest)?;
            measured.put(&mut results, &case.key, round);
            results.put(
                &format!("{}.fetched_over_touched", case.key),
                "x",
                round,
                measured.bytes_out as f64 / workloads[*w].touched,
            );
            let _ = fs::remove_dir_all(&cache);
        }
        common::end_round(BENCH, &mut results, round, started);
    }
    let md = report(&results, &workloads, &bench_run, runs, rtt);
    let csv = results.csv(&KEY_RUN_CSV);
    common::finish(
        BENCH,
        write_docs,
        "remote-sizes",
        &[("md", md), ("csv", csv)],
        started,
    )
}

/// `pvisor snapshot JOB --out URL --block-size KIB` at no added delay: its reply.
fn snapshot(bin: &Path, job: &str, url: &str, kib: u64, remote: &[String]) -> Res<String> {
    let mut args = vec![
        "snapshot".to_owned(),
        job.into(),
        "--out".into(),
        url.into(),
        "--block-size".into(),
        format!("{kib}KiB"),
    ];
    args.extend(remote.iter().cloned());
    vmproc::cli(bin, &strs(&args))
}

fn report(
    results: &Results,
    workloads: &[Workload],
    run: &BenchRun,
    runs: usize,
    rtt: u64,
) -> String {
    use std::fmt::Write;
    let mut md = String::from("# Snapshots in an object store: block and request sizes\n\n");
    md.push_str(&run.generated(BENCH, runs));
    let _ = writeln!(
        md,
        "\nEvery restore is a new `pvisor run --restore s3://… -- digest` process on a fresh cache, with {rtt} ms added \
         to every request; wall time from its start to its exit, and what the server served of guest memory. Median \
         (min–max) of {runs} interleaved rounds.\n"
    );
    for workload in workloads {
        let _ = writeln!(
            md,
            "## `{}`: {:.1} MiB of data read by the digest\n\n| block | stored MiB | index KiB | lazy s | lazy requests | \
             lazy served / data | working set s | ws requests | ws served / data |\n|---|---|---|---|---|---|---|---|---|",
            workload.name,
            workload.touched / MIB
        );
        for kib in BLOCKS_KIB {
            let key = format!("{}-{kib}k", workload.name);
            let _ = writeln!(
                md,
                "| {kib} KiB | {:.1} | {:.0} | {} | {} | {} | {} | {} | {} |",
                results.summary(&format!("{key}.store_bytes")).median / MIB,
                results.summary(&format!("{key}.store_index_bytes")).median / 1024.0,
                fig(results, &format!("{key}-lazy.wall_s"), 2),
                fig(results, &format!("{key}-lazy.requests"), 0),
                fig(results, &format!("{key}-lazy.fetched_over_touched"), 2),
                fig(results, &format!("{key}-ws.wall_s"), 2),
                fig(results, &format!("{key}-ws.requests"), 0),
                fig(results, &format!("{key}-ws.fetched_over_touched"), 2),
            );
        }
        md.push('\n');
    }
    let _ = writeln!(
        md,
        "## Prefetch requests: `dense`, 64 KiB blocks, working set\n\n| requests in flight | largest request | s | \
         requests |\n|---|---|---|---|"
    );
    let base = "dense-64k-ws";
    let mut rows = vec![(8, "4 MiB (default)".to_owned(), base.to_owned())];
    rows.extend(
        REQUEST_SIZES_KIB
            .iter()
            .map(|s| (8, format!("{} KiB", s), format!("{base}-req{s}k"))),
    );
    rows.extend(
        REQUEST_COUNTS
            .iter()
            .map(|&n| (n, "4 MiB".to_owned(), format!("{base}-par{n}"))),
    );
    for (n, size, key) in rows {
        let _ = writeln!(
            md,
            "| {n} | {size} | {} | {} |",
            fig(results, &format!("{key}.wall_s"), 2),
            fig(results, &format!("{key}.requests"), 0)
        );
    }
    let _ = writeln!(
        md,
        "\n## Chunks: the upload of {CHUNK_IMAGE_MIB} MiB of random data\n\n`uffd-pager pack --store s3://… \
         --chunk-size` (stored raw: random data does not compress), at the same round trip.\n\n| chunk | chunks | \
         upload s |\n|---|---|---|"
    );
    for mib in CHUNKS_MIB {
        let _ = writeln!(
            md,
            "| {mib} MiB | {} | {} |",
            fig(results, &format!("chunks-{mib}m.chunks"), 0),
            fig(results, &format!("chunks-{mib}m.upload_s"), 2)
        );
    }
    let _ = writeln!(
        md,
        "\n## Method\n\n`cargo build --release -p vmm --bin pvisor && REMOTE_BENCH_SIZES=1 cargo bench --bench \
         remote_report` (`REMOTE_BENCH_RUNS`, `REMOTE_BENCH_SIZES_RTT_MS`). Snapshots are written with `pvisor snapshot \
         --block-size`; the request cases restore with `--s3-request-size` and `--s3-requests`; the chunk cases pack with `uffd-pager pack --chunk-size`. Served / data is what \
         range reads of chunks returned over the bytes of data the digest reads (for `sparse`, the rewritten pages): \
         below 1 where the store is compressed. docs/remote.md says which sizes were chosen from this and why.\n"
    );
    md.push_str(&run.machine_markdown());
    md
}
