//! `uffd-pager demo`: packs a VM-shaped RAM image with every codec, checks each round trip,
//! serves the compressed image through the FUSE view and prints what it costs on disk.

use basics::say;
use std::fs::{self, File};
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use basics::format_bytes;
use compressed_backing::fuse::{self, FuseOptions};
use compressed_backing::{
    pack_file, unpack_file, BulkOptions, Codec, CodecConfig, DiskStore, PackOptions,
};
use xxhash_rust::xxh3::Xxh3;

use super::CliResult;

const MIB: u64 = 1 << 20;

/// Writes a RAM image shaped like an idle agent VM: program code (this executable's own
/// bytes), 64 MiB of repeated application data, 64 MiB of random application data, and
/// never-touched (zero) memory for the rest.
fn write_image(path: &Path, size: u64) -> std::io::Result<(u64, String)> {
    let code = fs::read("/proc/self/exe")?;
    let mut file = std::io::BufWriter::with_capacity(1 << 20, File::create(path)?);
    let mut hasher = Xxh3::new();
    let mut written = 0u64;
    let mut emit = |chunk: &[u8], file: &mut std::io::BufWriter<File>| -> std::io::Result<()> {
        hasher.update(chunk);
        file.write_all(chunk)
    };
    let regions = [8 * MIB, 64 * MIB, 64 * MIB];
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let motif: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5A).collect();
    let mut chunk = vec![0u8; MIB as usize];
    for (region, &len) in regions.iter().enumerate() {
        let mut left = len.min(size.saturating_sub(written));
        while left > 0 {
            for (i, byte) in chunk.iter_mut().enumerate() {
                *byte = match region {
                    0 => code[(written as usize + i) % code.len()],
                    1 => motif[i % motif.len()],
                    _ => {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        (state >> 32) as u8
                    }
                };
            }
            let n = left.min(MIB) as usize;
            emit(&chunk[..n], &mut file)?;
            written += n as u64;
            left -= n as u64;
        }
    }
    chunk.fill(0);
    while written < size {
        let n = (size - written).min(MIB) as usize;
        emit(&chunk[..n], &mut file)?;
        written += n as u64;
    }
    file.flush()?;
    file.get_ref().sync_all()?;
    let description = format!(
        "{} of program code, {} of repeated and {} of random application data, {} never touched",
        format_bytes(regions[0].min(size)),
        format_bytes(regions[1].min(size.saturating_sub(regions[0]))),
        format_bytes(regions[2].min(size.saturating_sub(regions[0] + regions[1]))),
        format_bytes(size.saturating_sub(regions.iter().sum())),
    );
    Ok((hasher.digest(), description))
}

fn digest_file(path: &Path) -> std::io::Result<u64> {
    let file = File::open(path)?;
    // SAFETY: the file is a private copy in the demo's own directory; nothing else writes it.
    let map = unsafe { memmap2::Mmap::map(&file)? };
    Ok(xxhash_rust::xxh3::xxh3_64(&map))
}

pub fn demo(size: u64, keep: Option<&Path>) -> CliResult {
    let temp = tempfile_dir(keep)?;
    let dir = temp.as_path();
    let image = dir.join("vm.ram");
    eprintln!(
        "writing a {} RAM image to {} ...",
        format_bytes(size),
        image.display()
    );
    let (digest, description) = write_image(&image, size)?;
    say!("RAM image: {} ({description})", format_bytes(size));
    say!();
    say!(
        "{:<8} {:>12} {:>10} {:>9} {:>11} {:>9} {:>11} {:>7}",
        "codec",
        "on disk",
        "saved",
        "ratio",
        "pack",
        "verify",
        "unpack",
        "bytes"
    );
    let raw_disk = compressed_backing::store::allocated_bytes(&image);
    say!(
        "{:<8} {:>12} {:>10} {:>9} {:>11} {:>9} {:>11} {:>7}",
        "raw file",
        format_bytes(raw_disk),
        "-",
        "1.0x",
        "-",
        "-",
        "-",
        "-"
    );
    let mut all_ok = true;
    let codecs = [Codec::None, Codec::Lz4, Codec::Zstd { level: 3 }];
    for codec in codecs {
        let store = dir.join(format!("store-{codec}").replace(':', "-"));
        let start = Instant::now();
        let options = PackOptions {
            codec: Some(CodecConfig::new(codec)),
            ..PackOptions::default()
        };
        let (_, stats) = pack_file(&image, &store, &options, &|_| {})?;
        let pack_time = start.elapsed();
        let start = Instant::now();
        let problems = DiskStore::open_read_only(&store)?.verify().problems.len();
        let verify_time = start.elapsed();
        let out = dir.join("unpacked.ram");
        let start = Instant::now();
        unpack_file(&store, &out, &BulkOptions::default(), &|_| {})?;
        let unpack_time = start.elapsed();
        let same = digest_file(&out)? == digest;
        fs::remove_file(&out)?;
        all_ok &= same && problems == 0;
        say!(
            "{:<8} {:>12} {:>9.1}% {:>8.1}x {:>9.0}ms {:>7.0}ms {:>9.0}ms {:>7}",
            codec.to_string(),
            format_bytes(stats.disk_bytes),
            100.0 * (1.0 - stats.disk_bytes as f64 / raw_disk.max(1) as f64),
            stats.ratio,
            pack_time.as_secs_f64() * 1e3,
            verify_time.as_secs_f64() * 1e3,
            unpack_time.as_secs_f64() * 1e3,
            if same && problems == 0 {
                "same"
            } else {
                "DIFFER"
            },
        );
    }

    // The compressed store as a plain file another VMM could map.
    let store_dir = dir.join("store-zstd-3");
    let mountpoint = dir.join("mnt");
    fs::create_dir_all(&mountpoint)?;
    let mounted = fuse::mount(
        DiskStore::open(&store_dir)?,
        &mountpoint,
        &FuseOptions::default(),
    )?;
    let start = Instant::now();
    let view = digest_file(&mounted.file_path());
    let elapsed = start.elapsed();
    let stats = mounted.unmount()?;
    let view_ok = view.as_ref().is_ok_and(|&d| d == digest);
    all_ok &= view_ok;
    say!();
    say!(
        "FUSE view of the zstd store: mmap of {} read in {:.0} ms, {} ({} blocks decompressed)",
        mountpoint.join("ram").display(),
        elapsed.as_secs_f64() * 1e3,
        match view {
            Ok(_) if view_ok => "same bytes as the image".to_owned(),
            Ok(_) => "DIFFERENT bytes".to_owned(),
            Err(e) => format!("read failed: {e}"),
        },
        stats.blocks_decompressed,
    );
    if keep.is_none() {
        fs::remove_dir_all(dir)?;
    } else {
        say!("files kept in {}", dir.display());
    }
    Ok(if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The demo's working directory: the one given, or a new one under the system temp dir.
fn tempfile_dir(keep: Option<&Path>) -> std::io::Result<std::path::PathBuf> {
    let dir = match keep {
        Some(dir) => dir.to_path_buf(),
        None => std::env::temp_dir().join(format!("uffd-pager-demo-{}", std::process::id())),
    };
    fs::create_dir_all(&dir)?;
    Ok(dir)
}
