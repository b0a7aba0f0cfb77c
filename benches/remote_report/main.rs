//! Scenario bench of snapshots in an object store (issue 15); regenerates
//! `docs/bench/remote.md` and `docs/bench/remote.csv`.
//!
//! `cargo build --release -p vmm --bin pvisor && cargo bench --bench remote_report` runs
//! `REMOTE_BENCH_RUNS` (default 5) interleaved rounds against a real S3 server on loopback
//! (`testkit::s3`, in this process), whose every request is delayed by the round trip under
//! test. Setup: a detached 512 MiB VM fills `REMOTE_BENCH_TOUCHED_MIB` (default 64) of random
//! application data; it is snapshotted to a local directory (lz4 store), to `s3://bench/plain`,
//! and, through a VM restored from `plain` that read its data back (`digest`), to
//! `s3://bench/ws`, which carries that VM's working set. Each round then times, in rotated
//! order, `pvisor run --restore … -- digest` (a new process: restore, then the first `digest`,
//! which reads every touched byte) from:
//! - `local`: the local snapshot;
//! - `s3-R-lazy`: `plain` with R = 0, 5 and 20 ms added per request, a fresh cache: every block
//!   is fetched when the guest faults it;
//! - `s3-R-ws`: `ws`, a fresh cache: the working set is fetched first, in coalesced range
//!   requests run 8 at once, then the guest runs;
//! - `s3-20ms-lazy-rest`: `plain` at the last round trip with `--s3-fetch-rest`: no working
//!   set, the rest of the store fetched in the background while the guest faults;
//! - `s3-20ms-ws-cached`: `ws` again on the cache the previous case filled (a second restore
//!   on the same host);
//! - `s3-20ms-ws-sealed`: `ws` written with `--store-key` (every payload sealed with
//!   AES-256-GCM), restored with its key on a fresh cache.
//!
//! Each round also times the upload of a snapshot of the origin VM at 0 and 20 ms. Requests
//! and response bytes are counted by the server.
//!
//! With `REMOTE_BENCH_SIZES=1`, the size sweep instead (`sizes.rs`: block and request sizes,
//! `docs/bench/remote-sizes.md`).
//!
//! Without `--bench` (`cargo test --benches`) or with `REMOTE_BENCH_QUICK=1`: 2 rounds of 8 MiB
//! touched, round trips of 0 and 5 ms, no report written.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use benchkit as common;
mod sizes;

use common::host::{BenchRun, TempRoot};
use common::results::{fig, Results, KEY_RUN_CSV};
use common::verdict::{self, Target, Verdict, Words};
use common::{env_number, vmproc, Res};
use testkit::s3::S3Server;

const BENCH: &str = "remote_report";
const MIB: f64 = (1u64 << 20) as f64;
/// The verdicts: a target without a figure is missed, as the report has always said.
const WORDS: Words = ["**missed**", "met", "**missed**"];

struct Settings {
    runs: usize,
    touched_mib: u64,
    rtts_ms: Vec<u64>,
    write_docs: bool,
}

fn main() {
    common::main(BENCH, run);
}

/// What a restore case reads from and how.
#[derive(Debug, Clone)]
struct Case {
    key: String,
    restore: String,
    /// Options after the remote ones (`--store-key FILE` for a sealed snapshot).
    extra: Vec<String>,
    rtt_ms: u64,
    /// A cache of its own (fresh), or the one of the case before it (`cached`).
    fresh_cache: bool,
}

fn run() -> Res<()> {
    let write_docs = common::is_bench_run() && std::env::var_os("REMOTE_BENCH_QUICK").is_none();
    if common::skip_smoke(BENCH, write_docs) {
        return Ok(());
    }
    let sweep = std::env::var_os("REMOTE_BENCH_SIZES").is_some();
    let settings = if write_docs {
        Settings {
            runs: env_number("REMOTE_BENCH_RUNS", 5, 1)? as usize,
            touched_mib: env_number("REMOTE_BENCH_TOUCHED_MIB", 64, 1)?,
            rtts_ms: vec![0, 5, 20],
            write_docs,
        }
    } else {
        Settings {
            runs: 2,
            touched_mib: 8,
            rtts_ms: vec![0, 5],
            write_docs,
        }
    };
    let bench_run = BenchRun::begin();
    let started = Instant::now();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bin = vmproc::find_binary(root, &common::host::target_dir())?;
    let tmp = TempRoot::create(BENCH, Path::new("remote"))?;
    let server = S3Server::start();
    server.create_bucket("bench");
    // Set before any thread of ours runs; every pvisor started inherits them.
    std::env::set_var("PVISOR_RUNTIME_DIR", tmp.path.join("runtime"));
    for (key, value) in server.env() {
        std::env::set_var(key, value);
    }
    fs::create_dir_all(tmp.path.join("runtime"))?;
    let endpoint = server.endpoint();
    let remote = |cache: &Path| -> Vec<String> {
        vec![
            "--s3-endpoint".into(),
            endpoint.clone(),
            "--cache".into(),
            cache.display().to_string(),
        ]
    };
    if sweep {
        return sizes::run(&bin, &server, &tmp.path, &remote, write_docs, started);
    }

    // The snapshots.
    eprintln!(
        "{BENCH}: writing the snapshots ({} MiB touched)",
        settings.touched_mib
    );
    let origin = vmproc::Job::start(
        &bin,
        "remote-origin",
        &[
            "--executor",
            "vm",
            "--memory",
            "512MiB",
            "--",
            &format!("fill {}MiB random seed=7; idle", settings.touched_mib),
        ],
    )?;
    let digest = origin
        .exec("digest")?
        .ok_or("the origin VM's digest gave no digest")?;
    let local = tmp.path.join("local");
    origin.cli(&[
        "snapshot",
        "--out",
        &local.display().to_string(),
        "--codec",
        "lz4",
    ])?;
    let origin_cache = tmp.path.join("cache-origin");
    let mut args = vec![
        "snapshot".to_owned(),
        "remote-origin".into(),
        "--out".into(),
        "s3://bench/plain".into(),
    ];
    args.extend(remote(&origin_cache));
    vmproc::cli(&bin, &strs(&args))?;
    let mut args = vec![
        "--executor".to_owned(),
        "vm".into(),
        "--memory".into(),
        "512MiB".into(),
        "--restore".into(),
        "s3://bench/plain".into(),
    ];
    args.extend(remote(&tmp.path.join("cache-ws")));
    args.extend(["--".into(), "digest; idle".into()]);
    let reader = vmproc::Job::start(&bin, "remote-ws", &strs(&args))?;
    let mut args = vec![
        "snapshot".to_owned(),
        "remote-ws".into(),
        "--out".into(),
        "s3://bench/ws".into(),
    ];
    args.extend(remote(&tmp.path.join("cache-ws")));
    vmproc::cli(&bin, &strs(&args))?;
    // The same, sealed with a key (--store-key).
    let key = tmp.path.join("store.key");
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&key)?;
        f.write_all(&[0x42; 32])?;
    }
    let key_args = vec!["--store-key".to_owned(), key.display().to_string()];
    args[3] = "s3://bench/ws-sealed".into();
    args.extend(key_args.clone());
    vmproc::cli(&bin, &strs(&args))?;
    vmproc::stop_all(vec![reader])?;

    let mut cases = vec![Case {
        key: "local".into(),
        restore: local.display().to_string(),
        extra: Vec::new(),
        rtt_ms: 0,
        fresh_cache: true,
    }];
    for &rtt in &settings.rtts_ms {
        for (name, prefix) in [("lazy", "plain"), ("ws", "ws")] {
            cases.push(Case {
                key: format!("s3-{rtt}ms-{name}"),
                restore: format!("s3://bench/{prefix}"),
                extra: Vec::new(),
                rtt_ms: rtt,
                fresh_cache: true,
            });
        }
    }
    let last_rtt = *settings.rtts_ms.last().ok_or("no round trips")?;
    // No working set, the rest fetched in the background from the start (`--s3-fetch-rest`).
    cases.push(Case {
        key: format!("s3-{last_rtt}ms-lazy-rest"),
        restore: "s3://bench/plain".into(),
        extra: vec!["--s3-fetch-rest".into()],
        rtt_ms: last_rtt,
        fresh_cache: true,
    });
    cases.push(Case {
        key: format!("s3-{last_rtt}ms-ws-sealed"),
        restore: "s3://bench/ws-sealed".into(),
        extra: key_args,
        rtt_ms: last_rtt,
        fresh_cache: true,
    });
    let mut results = Results::new(settings.runs);
    let touched = settings.touched_mib as f64 * MIB;
    for round in 0..settings.runs {
        let n = cases.len();
        for i in 0..n {
            let case = &cases[(i + round) % n];
            let cache = tmp.path.join(format!("cache-{round}-{}", case.key));
            let measured =
                restore_and_digest(&bin, &server, case, &cache, &remote(&cache), &digest)?;
            measured.put(&mut results, &case.key, round);
            if case.key == format!("s3-{last_rtt}ms-ws") {
                // The second restore on this host: the cache the first one filled.
                let cached = Case {
                    key: format!("s3-{last_rtt}ms-ws-cached"),
                    fresh_cache: false,
                    ..case.clone()
                };
                let measured =
                    restore_and_digest(&bin, &server, &cached, &cache, &remote(&cache), &digest)?;
                measured.put(&mut results, &cached.key, round);
            }
            let _ = fs::remove_dir_all(&cache);
        }
        for rtt in [0, last_rtt] {
            server.set_delay(Duration::from_millis(rtt));
            let mut args = vec![
                "snapshot".to_owned(),
                "remote-origin".into(),
                "--out".into(),
                format!("s3://bench/up-{round}-{rtt}"),
            ];
            args.extend(remote(&origin_cache));
            let began = Instant::now();
            let out = vmproc::cli(&bin, &strs(&args))?;
            results.put(
                &format!("upload.{rtt}ms.wall_s"),
                "s",
                round,
                began.elapsed().as_secs_f64(),
            );
            let upload_s = vmproc::json_number(&out, "elapsed_s")?;
            results.put(&format!("upload.{rtt}ms.upload_s"), "s", round, upload_s);
            server.set_delay(Duration::ZERO);
        }
        common::end_round(BENCH, &mut results, round, started);
    }
    vmproc::stop_all(vec![origin])?;
    for case in results
        .series()
        .map(|(k, _)| k.to_owned())
        .collect::<Vec<_>>()
    {
        if let Some(key) = case.strip_suffix(".wall_s") {
            if key != "local" && !key.starts_with("upload") {
                results.ratio(
                    &format!("ratio.{key}_over_local"),
                    &case,
                    "local.wall_s",
                    "x",
                );
            }
        }
    }
    results.ratio(
        "ratio.sealed_over_clear",
        &format!("s3-{last_rtt}ms-ws-sealed.wall_s"),
        &format!("s3-{last_rtt}ms-ws.wall_s"),
        "x",
    );
    let rest = format!("s3-{last_rtt}ms-lazy-rest");
    for &rtt in &settings.rtts_ms {
        for name in ["lazy", "ws", "lazy-rest"] {
            let key = format!("s3-{rtt}ms-{name}");
            if name == "lazy-rest" && key != rest {
                continue;
            }
            let values: Vec<f64> = results.values(&format!("{key}.bytes_out")).to_vec();
            for (run, v) in values.iter().enumerate() {
                results.put(
                    &format!("{key}.fetched_over_touched"),
                    "x",
                    run,
                    v / touched,
                );
            }
        }
    }
    let report = report(&results, &settings, &bench_run, last_rtt);
    let csv = results.csv(&KEY_RUN_CSV);
    common::finish(
        BENCH,
        settings.write_docs,
        "remote",
        &[("md", report), ("csv", csv)],
        started,
    )
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// One restore and its first digest.
struct Measured {
    wall_s: f64,
    digest_ms: f64,
    requests: u64,
    bytes_out: u64,
}

impl Measured {
    fn put(&self, results: &mut Results, key: &str, run: usize) {
        results.put(&format!("{key}.wall_s"), "s", run, self.wall_s);
        results.put(&format!("{key}.digest_ms"), "ms", run, self.digest_ms);
        if key != "local" {
            results.put(&format!("{key}.requests"), "", run, self.requests as f64);
            results.put(&format!("{key}.bytes_out"), "B", run, self.bytes_out as f64);
        }
    }
}

/// `pvisor run --restore … -- digest` in a new process, timed from its start to its exit;
/// the digest must be the origin's.
fn restore_and_digest(
    bin: &Path,
    server: &S3Server,
    case: &Case,
    cache: &PathBuf,
    remote: &[String],
    expected: &str,
) -> Res<Measured> {
    if case.fresh_cache {
        let _ = fs::remove_dir_all(cache);
    }
    server.set_delay(Duration::from_millis(case.rtt_ms));
    let (requests, bytes) = (server.requests(), server.chunk_bytes_out());
    let mut command = Command::new(bin);
    command.args([
        "run",
        "--executor",
        "vm",
        "--memory",
        "512MiB",
        "--restore",
        &case.restore,
    ]);
    if case.key != "local" {
        command.args(remote).args(&case.extra);
    }
    command.args(["--", "digest"]);
    let began = Instant::now();
    let out = command.output()?;
    let wall_s = began.elapsed().as_secs_f64();
    server.set_delay(Duration::ZERO);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!(
            "{}: {} {}",
            case.key,
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    let results = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v.get("results").cloned())
        .ok_or_else(|| format!("{}: no results in {text}", case.key))?;
    let digest = &results[0];
    if digest["digest"].as_str() != Some(expected) {
        return Err(format!(
            "{}: digest {} instead of {expected}",
            case.key, digest["digest"]
        )
        .into());
    }
    Ok(Measured {
        wall_s,
        digest_ms: digest["elapsed_ms"].as_f64().unwrap_or(f64::NAN),
        requests: server.requests() - requests,
        bytes_out: server.chunk_bytes_out() - bytes,
    })
}

fn report(results: &Results, settings: &Settings, run: &BenchRun, last: u64) -> String {
    use std::fmt::Write;
    let mut md = String::from("# Snapshots in an object store: restore, first digest, upload\n\n");
    md.push_str(&run.generated(BENCH, settings.runs));
    let ws = format!("s3-{last}ms-ws");
    let cached = format!("s3-{last}ms-ws-cached");
    // A bound on the median of a ratio, written with `d` decimals.
    let judge = |target: String, bound: Target, d: usize| Verdict {
        figure: format!("{}×", fig(results, &bound.key, d)),
        result: bound.judge(results, WORDS).2,
        target,
    };
    let verdicts = [
        judge(format!("{last} ms round trip, working set: time to the first digest ≤ 2× the local store's"), Target::at_most(format!("ratio.{ws}_over_local"), 2.0), 2),
        judge("bytes fetched before that digest ≤ 1.25× bytes touched".into(), Target::at_most(format!("{ws}.fetched_over_touched"), 1.25), 3),
        judge("a second restore on the same host, from the cache, within 1.2× the local store".into(), Target::at_most(format!("ratio.{cached}_over_local"), 1.2), 2),
        judge(format!("encryption costs ≤ 10% of restore time ({last} ms, working set: sealed over clear)"), Target::at_most("ratio.sealed_over_clear", 1.10), 3),
    ];
    md.push('\n');
    md.push_str(&verdict::table(
        "Targets (issue 15)",
        "median (min–max)",
        &verdicts,
        false,
    ));
    let _ = writeln!(
        md,
        "\n## Restore and first digest\n\nA 512 MiB VM with {} MiB of random application data, restored by a new `pvisor run \
         --restore … -- digest` process; wall time from its start to its exit, the guest's own time for the digest, and what \
         the server served. Median (min–max) of {} interleaved rounds.\n",
        settings.touched_mib, settings.runs
    );
    md.push_str("| case | wall s | digest ms | × local | requests | MiB served | served / touched |\n|---|---|---|---|---|---|---|\n");
    let mut keys = vec!["local".to_owned()];
    for &rtt in &settings.rtts_ms {
        keys.push(format!("s3-{rtt}ms-lazy"));
        keys.push(format!("s3-{rtt}ms-ws"));
    }
    keys.push(format!("s3-{last}ms-lazy-rest"));
    keys.push(format!("s3-{last}ms-ws-sealed"));
    keys.push(cached.clone());
    for key in &keys {
        let mib = results.summary(&format!("{key}.bytes_out"));
        let served = if mib.n == 0 {
            "–".to_owned()
        } else {
            format!("{:.1}", mib.median / MIB)
        };
        let _ = writeln!(
            md,
            "| `{key}` | {} | {} | {} | {} | {served} | {} |",
            fig(results, &format!("{key}.wall_s"), 2),
            fig(results, &format!("{key}.digest_ms"), 0),
            if key == "local" {
                "1".to_owned()
            } else {
                fig(results, &format!("ratio.{key}_over_local"), 2)
            },
            if key == "local" {
                "–".to_owned()
            } else {
                fig(results, &format!("{key}.requests"), 0)
            },
            if key.ends_with("cached") || key.ends_with("sealed") || key == "local" {
                "–".to_owned()
            } else {
                fig(results, &format!("{key}.fetched_over_touched"), 3)
            },
        );
    }
    let _ = writeln!(
        md,
        "\n`s3-{last}ms-lazy-rest` restores the snapshot without a working set with `--s3-fetch-rest`: the rest of the \
         store is fetched in the background from the start, two coalesced requests at a time and none while a fault \
         waits; what it served counts in its row (the background's bytes are not apart here: the server cannot tell them \
         apart)."
    );
    let _ = writeln!(
        md,
        "\n## Upload\n\n`pvisor snapshot JOB --out s3://…` of the origin VM (its RAM in an lz4 store: {} MiB of random data, \
         stored raw), the command's wall time and the upload's own.\n\n| round trip | wall s | upload s |\n|---|---|---|",
        settings.touched_mib
    );
    for rtt in [0, last] {
        let _ = writeln!(
            md,
            "| {rtt} ms | {} | {} |",
            fig(results, &format!("upload.{rtt}ms.wall_s"), 2),
            fig(results, &format!("upload.{rtt}ms.upload_s"), 2)
        );
    }
    let _ = writeln!(
        md,
        "\n## Method\n\n`cargo build --release -p vmm --bin pvisor && cargo bench --bench remote_report` \
         (`REMOTE_BENCH_RUNS`, `REMOTE_BENCH_TOUCHED_MIB`). The server is `s3s` over its file-system backend on loopback, \
         in the bench's process; the round trip is a delay before each request is served. Requests and bytes served are \
         the server's counts; MiB served is what range reads of chunks returned (guest memory only: not the index, \
         the manifest or the disk). Every case \
         checks the digest against the origin VM's.\n"
    );
    md.push_str(&run.machine_markdown());
    md
}
