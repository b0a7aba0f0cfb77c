//! The bench kit: what the scenario benches share, one library (its unit tests run in the
//! suite). Here: the four kinds of content, the realistic sample and where it comes from, and
//! the run helpers of the scenario benches (`main`, `env_number`, `is_bench_run`,
//! `skip_smoke`, `end_round`, `finish`). Beside it:
//! - `host`: the temporary directory under `target/bench-tmp/`, the machine facts the reports
//!   state, CPU time from `/proc/stat`;
//! - `results`: one value per run under a key, min/median/max summaries, the CSV, the numbers
//!   of the tables (`num`, `signed`, `fig`: `median (min–max)`, `secs`);
//! - `chart`: the reports' charts, drawn with `plotters` (memory over time with a budget,
//!   panels of rows with min–max whiskers on a log or linear axis, stacked rows);
//! - `verdict`: a target judged, and the reports' table of targets;
//! - `judge`: the density rule (a budgeted run against its unbudgeted reference, a group size,
//!   the density of a sweep), decided from measured facts alone;
//! - `render`: render mode (`BENCH_RENDER=1`), a report written again from its kept CSV and
//!   report without running anything, and the smoke runs' check of it;
//! - `scenario`: the run of a replay bench (rounds of `pvisor replay`, the report from its
//!   CSV read back, render mode), shared by `agent_waits_report` and `arenas_report`;
//! - `vmproc`: the real `pvisor` VM process (start, control-socket requests, stop) and the
//!   freshness check of `target/release/pvisor`.
//!
//! Contents, all deterministic:
//! - `zero`: all zeros (never-touched guest memory).
//! - `repeated`: one 64-byte motif repeated, the same motif as the `uffd-pager demo` image's
//!   repeated application data (`motif[i] = (i * 37) ^ 0x5A`).
//! - `random`: xorshift64 from a fixed seed (encrypted or already compressed data).
//! - `realistic`: real ELF code and data: the first bytes of the active Rust toolchain's
//!   `lib/librustc_driver-*.so` (about 150 MiB of x86-64 ELF), then, if that is missing or
//!   short, the ELF files of `/usr/bin` in name order. `STORE_BENCH_SAMPLE=FILE` puts FILE
//!   first instead. The source actually used is reported with an FNV-1a hash of the bytes.

pub mod chart;
pub mod cpu;
pub mod host;
pub mod judge;
pub mod render;
pub mod replay;
pub mod results;
pub mod scenario;
pub mod verdict;
pub mod vmproc;

use std::error::Error;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::Command;

use basics::error_chain;

/// The workspace's root directory (this crate's parent), where `docs/` and `target/` are.
pub fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("benchkit/ lies inside the workspace")
}

/// What the fallible parts of a scenario bench return.
pub type Res<T> = Result<T, Box<dyn Error>>;

/// The `main` of a scenario bench: runs `run`; on failure prints `NAME: ` and the whole error
/// chain, and exits with status 1.
pub fn main(name: &str, run: fn() -> Res<()>) {
    if let Err(err) = run() {
        eprintln!("{name}: {}", error_chain(&*err));
        std::process::exit(1);
    }
}

/// True, after saying so, when the smoke run of `bench` (not a bench run: `write_docs` false)
/// is to be skipped: `PVISOR_SKIP_DEVICE_TESTS=1`.
pub fn skip_smoke(bench: &str, write_docs: bool) -> bool {
    let skip =
        !write_docs && std::env::var_os("PVISOR_SKIP_DEVICE_TESTS").is_some_and(|v| v == "1");
    if skip {
        eprintln!("{bench}: smoke run skipped (PVISOR_SKIP_DEVICE_TESTS=1)");
    }
    skip
}

/// The end of a scenario bench that started at `started`: a bench run (`write_docs`) writes
/// `docs/bench/STEM.EXT` for each `(EXT, text)` of `outputs`. A smoke run writes them under
/// `target/bench-smoke/` instead, never over `docs/bench/`, and fails if one has not the shape
/// of a report ([`check_shape`]): the suite runs every bench's smoke mode, so a bench whose
/// report code breaks fails it.
pub fn finish(
    bench: &str,
    write_docs: bool,
    stem: &str,
    outputs: &[(&str, String)],
    started: std::time::Instant,
) -> Res<()> {
    let dir = if write_docs {
        workspace_root().join("docs/bench")
    } else {
        for (ext, text) in outputs {
            check_shape(ext, text).map_err(|why| format!("{bench}: {stem}.{ext}: {why}"))?;
        }
        host::target_dir().join("bench-smoke")
    };
    fs::create_dir_all(&dir)?;
    let mut written = Vec::new();
    for (ext, text) in outputs {
        let path = dir.join(format!("{stem}.{ext}"));
        fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        written.push(
            path.strip_prefix(workspace_root())
                .unwrap_or(&path)
                .display()
                .to_string(),
        );
    }
    let what = if write_docs { "" } else { "smoke run passed; " };
    eprintln!(
        "{bench}: {what}wrote {} in {:.1} s",
        written.join(", "),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Whether `text` has the shape of a report's file of kind `ext`: Markdown opens with a title
/// and holds a table, a CSV has a header and rows of as many fields (outside quotes), an SVG is
/// one whole `<svg>` element. The reason when not.
pub fn check_shape(ext: &str, text: &str) -> Result<(), String> {
    match ext {
        "md" => {
            if !text.starts_with("# ") {
                return Err("does not open with a `# ` title".into());
            }
            if !text
                .lines()
                .any(|l| l.starts_with("|---") || l.starts_with("| ---"))
            {
                return Err("holds no table".into());
            }
        }
        "csv" => {
            let fields = |line: &str| {
                let mut quoted = false;
                1 + line
                    .chars()
                    .filter(|&c| {
                        if c == '"' {
                            quoted = !quoted;
                        }
                        c == ',' && !quoted
                    })
                    .count()
            };
            let mut lines = text.lines().filter(|l| !l.is_empty());
            let header = lines.next().ok_or("is empty")?;
            let width = fields(header);
            let mut rows = 0;
            for (i, line) in lines.enumerate() {
                if fields(line) != width {
                    return Err(format!(
                        "row {} has {} fields, the header {width}",
                        i + 1,
                        fields(line)
                    ));
                }
                rows += 1;
            }
            if rows == 0 {
                return Err("has a header and no rows".into());
            }
        }
        "svg" => {
            let body = text.trim_start().trim_start_matches(|c| c != '<');
            let body = match body.strip_prefix("<?xml") {
                Some(rest) => rest.split_once("?>").map_or("", |(_, r)| r.trim_start()),
                None => body,
            };
            if !body.starts_with("<svg") || !text.trim_end().ends_with("</svg>") {
                return Err("is not one <svg> element".into());
            }
        }
        _ => {}
    }
    Ok(())
}

/// The whole number in the environment variable `name`, at least `min`; `default` when unset.
pub fn env_number(name: &str, default: u64, min: u64) -> Res<u64> {
    match std::env::var(name) {
        Ok(text) => text
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|&n| n >= min)
            .ok_or_else(|| format!("{name}={text}: expected a whole number >= {min}").into()),
        Err(_) => Ok(default),
    }
}

/// Block size of every bench: the store's default.
pub const BLOCK: usize = 64 << 10;
/// Image size of the scenario bench and of the realistic sample.
pub const IMAGE: usize = 64 << 20;

/// A kind of content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Content {
    Zero,
    Repeated,
    Random,
    Realistic,
}

impl Content {
    pub const ALL: [Content; 4] = [
        Content::Zero,
        Content::Repeated,
        Content::Random,
        Content::Realistic,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Content::Zero => "zero",
            Content::Repeated => "repeated",
            Content::Random => "random",
            Content::Realistic => "realistic",
        }
    }
}

/// The 64-byte motif of `repeated` content.
pub fn motif() -> [u8; 64] {
    let mut motif = [0u8; 64];
    for (i, byte) in (0u8..).zip(motif.iter_mut()) {
        *byte = i.wrapping_mul(37) ^ 0x5A;
    }
    motif
}

/// `len` bytes of the motif repeated.
pub fn repeated(len: usize) -> Vec<u8> {
    let motif = motif();
    (0..len).map(|i| motif[i % motif.len()]).collect()
}

/// `len` bytes of xorshift64 output from `seed`, eight bytes per step.
pub fn random(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    let mut bytes = Vec::with_capacity(len + 8);
    while bytes.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        bytes.extend_from_slice(&state.to_le_bytes());
    }
    bytes.truncate(len);
    bytes
}

/// Seed of the `random` content.
pub const RANDOM_SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// The realistic sample and a description of where it came from.
#[derive(Debug)]
pub struct Sample {
    pub bytes: Vec<u8>,
    /// `path (N bytes from offset 0)` for each file used, in order.
    pub sources: Vec<String>,
    /// FNV-1a 64 of the bytes.
    pub fnv: u64,
}

impl Sample {
    /// The sample repeated up to `len` bytes, its hash that of the whole.
    pub fn tiled(mut self, len: usize) -> Self {
        let tile = self.bytes.len();
        self.bytes.reserve(len.saturating_sub(tile));
        while tile > 0 && self.bytes.len() < len {
            let take = tile.min(len - self.bytes.len());
            self.bytes.extend_from_within(..take);
        }
        self.fnv = fnv1a64(&self.bytes);
        self
    }
}

/// Reads the realistic sample: `len` bytes of real ELF files (see the module documentation).
pub fn realistic(len: usize) -> io::Result<Sample> {
    elf_sample(len, "STORE_BENCH_SAMPLE")
}

/// `len` bytes of real ELF files: the file named by the environment variable `env_var` first,
/// then the toolchain's `librustc_driver-*.so`, then the ELF files of `/usr/bin`.
pub fn elf_sample(len: usize, env_var: &str) -> io::Result<Sample> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(path) = std::env::var_os(env_var) {
        candidates.push(PathBuf::from(path));
    }
    if let Some(driver) = rustc_driver_library() {
        candidates.push(driver);
    }
    candidates.extend(elf_files_in(Path::new("/usr/bin")));
    let mut bytes = Vec::with_capacity(len);
    let mut sources = Vec::new();
    for path in candidates {
        if bytes.len() == len {
            break;
        }
        let Ok(file) = File::open(&path) else {
            continue;
        };
        let before = bytes.len();
        let want = (len - before) as u64;
        file.take(want).read_to_end(&mut bytes)?;
        let got = bytes.len() - before;
        if got > 0 {
            sources.push(format!("{} ({got} bytes from offset 0)", path.display()));
        }
    }
    if bytes.len() < len {
        return Err(io::Error::other(format!(
            "found only {} of the {len} bytes of ELF files wanted for the realistic sample; \
             set {env_var} to a large binary",
            bytes.len()
        )));
    }
    let fnv = fnv1a64(&bytes);
    Ok(Sample {
        bytes,
        sources,
        fnv,
    })
}

/// `lib/librustc_driver-*.so` of the toolchain that `rustc` (or `$RUSTC`) runs.
fn rustc_driver_library() -> Option<PathBuf> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let output = Command::new(rustc)
        .args(["--print", "sysroot"])
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let sysroot = PathBuf::from(String::from_utf8(output.stdout).ok()?.trim());
    let mut found: Vec<PathBuf> = fs::read_dir(sysroot.join("lib"))
        .ok()?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("librustc_driver-") && n.ends_with(".so"))
        })
        .collect();
    found.sort();
    found.into_iter().next()
}

/// Regular ELF files directly in `dir`, in name order.
fn elf_files_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            let regular = fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file());
            let mut magic = [0u8; 4];
            regular
                && File::open(path)
                    .and_then(|mut f| f.read_exact(&mut magic))
                    .is_ok()
                && magic == *b"\x7fELF"
        })
        .collect();
    files.sort();
    files
}

/// The content of kind `content`, `len` bytes (`realistic` must be the loaded sample).
pub fn content(content: Content, len: usize, realistic: &Sample) -> Vec<u8> {
    match content {
        Content::Zero => vec![0u8; len],
        Content::Repeated => repeated(len),
        Content::Random => random(len, RANDOM_SEED),
        Content::Realistic => realistic.bytes[..len].to_vec(),
    }
}

/// FNV-1a, 64 bits: identifies the sample in the report.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// True when the bench binary runs as a bench (`cargo bench` passes `--bench`); false when
/// `cargo test --benches` runs it as a smoke test.
pub fn is_bench_run() -> bool {
    std::env::args().any(|arg| arg == "--bench")
}

/// The end of round `round` (from 0) of a scenario bench that began at `started`: its time as
/// `bench.round_s`, and a progress line.
pub fn end_round(
    bench: &str,
    results: &mut results::Results,
    round: usize,
    started: std::time::Instant,
) {
    let elapsed = started.elapsed().as_secs_f64();
    results.put("bench.round_s", "s", round, elapsed);
    eprintln!(
        "{bench}: round {}/{} done in {elapsed:.0} s",
        round + 1,
        results.runs
    );
}

#[cfg(test)]
mod tests {
    use super::{check_shape, fnv1a64, Sample};

    #[test]
    fn sample_tiled_repeats_its_bytes_up_to_the_length() {
        let (bytes, sources) = (vec![1, 2, 3], Vec::new());

        let sample = Sample {
            bytes,
            sources,
            fnv: 0,
        }
        .tiled(7);

        assert_eq!(sample.bytes, [1, 2, 3, 1, 2, 3, 1]);
        assert_eq!(sample.fnv, fnv1a64(&sample.bytes));
    }

    #[test]
    fn check_shape_accepts_reports_and_names_what_is_wrong() {
        assert!(check_shape("md", "# T\n\n| a | b |\n|---|---|\n| 1 | 2 |\n").is_ok());
        assert!(check_shape("md", "T\n|---|\n").is_err());
        assert!(check_shape("md", "# T\nno table\n").is_err());
        assert!(check_shape("csv", "key,unit,\"a, b\"\nx,ms,1\n").is_ok());
        assert!(check_shape("csv", "key,unit\n").is_err_and(|why| why.contains("no rows")));
        assert!(check_shape("csv", "key,unit\nx,ms,3\n").is_err_and(|why| why.contains("row 1")));
        assert!(check_shape("svg", "<svg xmlns=\"x\"><g/></svg>\n").is_ok());
        assert!(check_shape("svg", "<?xml version=\"1.0\"?>\n<svg></svg>").is_ok());
        assert!(check_shape("svg", "<svg><g/>").is_err());
    }
}
