//! The store commands: pack, unpack, verify, info, mount.

use basics::say;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use basics::format_bytes;
use compressed_backing::fuse::{self, FuseOptions};
use compressed_backing::{pack_file, unpack_file, BulkOptions, DiskStore, PackOptions, StoreStats};
use indicatif::{ProgressBar, ProgressStyle};
use nix::sys::signal::{SigSet, Signal};

use super::{CliResult, RemoteArgs};
use compressed_backing::remote::{Remote, StoreLocation};

pub(super) fn bulk_options(threads: Option<usize>) -> BulkOptions {
    threads.map_or_else(BulkOptions::default, BulkOptions::with_threads)
}

/// A byte progress bar on stderr; invisible when stderr is not a terminal.
fn progress_bar(total: u64, verb: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("the template is valid")
        .progress_chars("=> "),
    );
    bar.set_message(verb.to_owned());
    bar
}

fn rate(bytes: u64, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64().max(1e-9);
    format!("{:.1} MiB/s", bytes as f64 / secs / (1u64 << 20) as f64)
}

/// Opens a store to read: a directory, or an s3:// store through its mirror in the cache.
pub(super) fn open_read_only(
    location: &StoreLocation,
    remote: &RemoteArgs,
) -> Result<DiskStore, Box<dyn std::error::Error>> {
    Ok(match location {
        StoreLocation::Local(dir) => DiskStore::open_read_only(dir)?,
        StoreLocation::Remote(url) => {
            let remote = Remote::connect(url, &remote.options()?)?;
            let store = remote.open()?;
            remote.fetch_rest_if_asked(&store);
            store
        }
    })
}

pub fn pack(
    mem_file: &Path,
    location: &StoreLocation,
    remote: &RemoteArgs,
    options: &PackOptions,
    json: bool,
) -> CliResult {
    let (store, remote, _staging) = match location {
        StoreLocation::Local(dir) => (dir.clone(), None, None),
        StoreLocation::Remote(url) => {
            let remote = Remote::connect(url, &remote.options()?)?;
            // Packed in the cache (private to this user), then uploaded.
            let staging = tempfile::Builder::new()
                .prefix("pack-")
                .tempdir_in(remote.cache().root())?;
            (staging.path().join("store"), Some(remote), Some(staging))
        }
    };
    let store = store.as_path();
    let total = std::fs::metadata(mem_file).map(|m| m.len()).unwrap_or(0);
    let bar = progress_bar(total, "packing");
    let start = Instant::now();
    let result = pack_file(mem_file, store, options, &|bytes| bar.inc(bytes));
    bar.finish_and_clear();
    let (report, stats) = result?;
    let uploaded = match &remote {
        Some(remote) => {
            let bar = progress_bar(stats.disk_bytes, "uploading");
            let uploaded = remote.upload(store, &|bytes| bar.inc(bytes));
            bar.finish_and_clear();
            Some(uploaded?)
        }
        None => None,
    };
    let elapsed = start.elapsed();
    if json {
        let value = serde_json::json!({
            "store": location.to_string(),
            "elapsed_s": elapsed.as_secs_f64(),
            "written": report,
            "stats": stats,
            "uploaded": uploaded,
        });
        say!("{value}");
    } else {
        say!(
            "packed {} into {} in {:.2} s ({}): {} blocks ({} zero, {} same-byte, {} raw, {} compressed), {} stored, ratio {:.1}x",
            format_bytes(report.bytes),
            location,
            elapsed.as_secs_f64(),
            rate(report.bytes, elapsed),
            report.blocks,
            report.zero_blocks,
            report.fill_blocks,
            report.raw_blocks,
            report.compressed_blocks,
            format_bytes(stats.disk_bytes),
            stats.ratio,
        );
        if let Some(up) = &uploaded {
            say!(
                "uploaded {} in {} chunks in {:.2} s; {} chunks of the previous image deleted",
                format_bytes(up.bytes),
                up.chunks,
                up.elapsed_s,
                up.deleted
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn unpack(store: &Path, out: &Path, threads: Option<usize>) -> CliResult {
    let image_size = DiskStore::open_read_only(store)?.image_size();
    let bar = progress_bar(image_size, "unpacking");
    let start = Instant::now();
    let result = unpack_file(store, out, &bulk_options(threads), &|bytes| bar.inc(bytes));
    bar.finish_and_clear();
    let report = result?;
    let elapsed = start.elapsed();
    say!(
        "unpacked {} to {} in {:.2} s ({}): {} blocks, {} zero",
        format_bytes(report.bytes),
        out.display(),
        elapsed.as_secs_f64(),
        rate(report.bytes, elapsed),
        report.blocks,
        report.zero_blocks,
    );
    Ok(ExitCode::SUCCESS)
}

pub fn verify(store: &StoreLocation, remote: &RemoteArgs, json: bool) -> CliResult {
    let opened = open_read_only(store, remote)?;
    let report = opened.verify();
    if json {
        say!("{}", serde_json::to_string(&report)?);
    } else {
        for problem in &report.problems {
            say!(
                "bad block {} in {} at offset {}: {}",
                problem.block,
                problem.path.display(),
                problem.offset,
                problem.reason
            );
        }
        say!(
            "{}: {} stored blocks checked ({}), {} bad",
            store,
            report.blocks_checked,
            format_bytes(report.bytes_checked),
            report.problems.len()
        );
    }
    Ok(if report.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

pub fn info(store: &StoreLocation, remote: &RemoteArgs, json: bool) -> CliResult {
    let stats = open_read_only(store, remote)?.stats();
    if json {
        let mut value = serde_json::to_value(&stats)?;
        value["store"] = serde_json::json!(store.to_string());
        say!("{value}");
    } else {
        print_info(store, &stats)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn print_info(store: &StoreLocation, s: &StoreStats) -> Result<(), basics::output::StdoutClosed> {
    say!("store           {store}");
    say!(
        "image           {} ({} blocks of {})",
        format_bytes(s.image_size),
        s.blocks,
        format_bytes(s.block_size)
    );
    say!("codec           {}", s.codec);
    say!(
        "blocks          {} present: {} zero, {} same-byte, {} raw, {} compressed",
        s.present_blocks,
        s.zero_blocks,
        s.fill_blocks,
        s.raw_blocks,
        s.compressed_blocks
    );
    say!(
        "raw bytes       {} ({})",
        s.raw_bytes,
        format_bytes(s.raw_bytes)
    );
    say!(
        "stored bytes    {} ({})",
        s.stored_bytes,
        format_bytes(s.stored_bytes)
    );
    say!(
        "disk bytes      {} ({}) in {} segments, {} dead",
        s.disk_bytes,
        format_bytes(s.disk_bytes),
        s.segments,
        format_bytes(s.dead_bytes)
    );
    say!("ratio           {:.2}x (raw bytes per disk byte)", s.ratio);
    say!("generation      {}", s.generation);
    Ok(())
}

pub fn mount(
    store: &Path,
    mountpoint: &Path,
    file_name: String,
    cache_blocks: usize,
    allow_other: bool,
) -> CliResult {
    // Block the stop signals before any thread starts, so every thread inherits the mask and
    // only the `wait` below receives them.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    signals.thread_block()?;

    let opened = DiskStore::open(store)?;
    let options = FuseOptions {
        file_name,
        cache_blocks,
        allow_other,
        ..FuseOptions::default()
    };
    let mounted = fuse::mount(opened, mountpoint, &options)?;
    say!("{}", mounted.file_path().display());
    eprintln!(
        "serving {} from {}; stop with Ctrl-C or SIGTERM",
        mounted.file_path().display(),
        store.display()
    );
    let signal = signals.wait()?;
    eprintln!("{signal}: writing back and unmounting");
    let stats = mounted.unmount()?;
    eprintln!("unmounted: {}", serde_json::to_string(&stats)?);
    Ok(ExitCode::SUCCESS)
}
