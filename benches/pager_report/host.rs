//! The machine side of the bench: the temporary directory, the facts the report states, and
//! the image content (real ELF bytes).

use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::Res;

pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("target"),
        PathBuf::from,
    )
}

/// `target/bench-tmp/pager/`, on the real disk, removed on drop.
pub struct TempRoot {
    pub path: PathBuf,
    pub filesystem: String,
}

impl TempRoot {
    pub fn create() -> Res<Self> {
        let path = target_dir().join("bench-tmp").join("pager");
        if path.exists() {
            fs::remove_dir_all(&path)?;
        }
        fs::create_dir_all(&path)?;
        let root = Self {
            filesystem: filesystem_of(&path)?,
            path,
        };
        if root.filesystem.starts_with("tmpfs") || root.filesystem.starts_with("ramfs") {
            return Err(format!(
                "{} is on {}: the bench must write to a real disk (set CARGO_TARGET_DIR)",
                root.path.display(),
                root.filesystem
            )
            .into());
        }
        Ok(root)
    }
}

impl Drop for TempRoot {
    fn drop(&mut self) {
        if let Err(err) = fs::remove_dir_all(&self.path) {
            eprintln!("pager_report: cannot remove {}: {err}", self.path.display());
        }
        if let Some(parent) = self.path.parent() {
            // Only if empty: another bench may be using it.
            let _ = fs::remove_dir(parent);
        }
    }
}

/// `TYPE on DEVICE` of the mount that holds `path`, from /proc/mounts.
pub fn filesystem_of(path: &Path) -> Res<String> {
    let path = fs::canonicalize(path)?;
    let mounts = fs::read_to_string("/proc/mounts")?;
    let mut best: Option<(usize, String)> = None;
    for line in mounts.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [device, mount_point, fs_type, ..] = fields[..] else {
            continue;
        };
        if path.starts_with(mount_point)
            && best
                .as_ref()
                .is_none_or(|(len, _)| mount_point.len() >= *len)
        {
            best = Some((mount_point.len(), format!("{fs_type} on {device}")));
        }
    }
    Ok(best.map_or_else(|| "unknown file system".to_owned(), |(_, text)| text))
}

fn command_output(program: &str, args: &[&str]) -> Option<String> {
    let output = Command::new(program).args(args).output().ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

fn proc_field(file: &str, prefix: &str) -> Option<String> {
    fs::read_to_string(file)
        .ok()?
        .lines()
        .find_map(|line| line.strip_prefix(prefix))
        .and_then(|rest| rest.split_once(':'))
        .map(|(_, value)| value.trim().to_owned())
}

pub struct Machine {
    pub cpu: String,
    pub nproc: usize,
    pub kernel: String,
    pub memory: String,
    pub rustc: String,
    pub commit: String,
    pub clocksource: String,
}

pub fn machine() -> Machine {
    let unknown = || "unknown".to_owned();
    let memory = proc_field("/proc/meminfo", "MemTotal")
        .and_then(|kib| kib.trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or_else(unknown, |kib| {
            format!("{:.1} GiB", kib as f64 / (1u64 << 20) as f64)
        });
    let manifest = env!("CARGO_MANIFEST_DIR");
    let commit = command_output("git", &["-C", manifest, "rev-parse", "--short", "HEAD"])
        .map_or_else(unknown, |hash| {
            let dirty = command_output("git", &["-C", manifest, "status", "--porcelain"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{hash} (with uncommitted changes in the work tree)")
            } else {
                hash
            }
        });
    Machine {
        cpu: proc_field("/proc/cpuinfo", "model name").unwrap_or_else(unknown),
        nproc: std::thread::available_parallelism().map_or(0, |n| n.get()),
        kernel: fs::read_to_string("/proc/sys/kernel/osrelease")
            .map_or_else(|_| unknown(), |s| s.trim().to_owned()),
        memory,
        rustc: command_output("rustc", &["--version"]).unwrap_or_else(unknown),
        commit,
        clocksource: fs::read_to_string(
            "/sys/devices/system/clocksource/clocksource0/current_clocksource",
        )
        .map_or_else(|_| unknown(), |s| s.trim().to_owned()),
    }
}

/// The current UTC date and time, `YYYY-MM-DD HH:MM UTC`.
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm, non-negative days).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60
    )
}

/// The image content: real x86-64 ELF code and data, `PAGER_BENCH_SAMPLE=FILE` first, then the
/// toolchain's `librustc_driver-*.so`, then the ELF files of `/usr/bin`; `tile` bytes of it are
/// repeated up to `len`.
pub struct Image {
    pub bytes: Vec<u8>,
    pub sources: Vec<String>,
    /// Bytes of real data before the image repeats.
    pub tile: usize,
    pub fnv: u64,
}

pub fn image(len: usize, tile: usize) -> Res<Image> {
    let tile = tile.min(len);
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(path) = std::env::var_os("PAGER_BENCH_SAMPLE") {
        candidates.push(PathBuf::from(path));
    }
    if let Some(driver) = rustc_driver_library() {
        candidates.push(driver);
    }
    candidates.extend(elf_files_in(Path::new("/usr/bin")));
    let mut bytes = Vec::with_capacity(len);
    let mut sources = Vec::new();
    for path in candidates {
        if bytes.len() == tile {
            break;
        }
        let Ok(file) = File::open(&path) else {
            continue;
        };
        let before = bytes.len();
        file.take((tile - before) as u64).read_to_end(&mut bytes)?;
        if bytes.len() > before {
            sources.push(format!(
                "{} ({} bytes from offset 0)",
                path.display(),
                bytes.len() - before
            ));
        }
    }
    if bytes.len() < tile {
        return Err(format!(
            "found only {} of the {tile} bytes of ELF files wanted; set PAGER_BENCH_SAMPLE to a large binary",
            bytes.len()
        )
        .into());
    }
    while bytes.len() < len {
        let take = tile.min(len - bytes.len());
        bytes.extend_from_within(..take);
    }
    let mut fnv = 0xcbf2_9ce4_8422_2325_u64;
    for &byte in &bytes {
        fnv ^= u64::from(byte);
        fnv = fnv.wrapping_mul(0x0100_0000_01b3);
    }
    Ok(Image {
        bytes,
        sources,
        tile,
        fnv,
    })
}

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

/// `len` bytes of one 64-byte motif repeated (application data that compresses well; the
/// motif of `uffd-pager demo`).
pub fn repeated(len: usize) -> Vec<u8> {
    let motif: Vec<u8> = (0u8..64).map(|i| i.wrapping_mul(37) ^ 0x5A).collect();
    (0..len).map(|i| motif[i % motif.len()]).collect()
}

/// `len` bytes of xorshift64 output (encrypted or compressed application data).
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

/// CPU time of the whole machine and of this process, to tell how much other work ran
/// during a measurement (the machine is shared).
#[derive(Debug, Clone, Copy)]
pub struct CpuSample {
    at: std::time::Instant,
    /// Busy ticks of all CPUs (user, nice, system, irq, softirq, steal).
    busy: u64,
    steal: u64,
    /// Ticks of this process (user + system, all threads).
    own: u64,
}

impl CpuSample {
    pub fn now() -> Self {
        let stat = fs::read_to_string("/proc/stat").unwrap_or_default();
        let fields: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse().unwrap_or(0))
            .collect();
        let field = |i: usize| fields.get(i).copied().unwrap_or(0);
        let own = fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| {
                // Fields after the command name (which may hold spaces): utime is the 12th.
                let rest = s.rsplit_once(')')?.1.split_whitespace().collect::<Vec<_>>();
                Some(rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?)
            })
            .unwrap_or(0);
        Self {
            at: std::time::Instant::now(),
            busy: field(0) + field(1) + field(2) + field(5) + field(6) + field(7),
            steal: field(7),
            own,
        }
    }

    /// `(other, steal)`: CPU used by other processes and stolen by the host since `self`, in
    /// percent of one CPU.
    pub fn since(&self) -> (f64, f64) {
        let now = Self::now();
        // SAFETY: sysconf has no memory-safety preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let secs = now.at.duration_since(self.at).as_secs_f64().max(1e-3);
        let pct = |ticks: u64| ticks as f64 / hz / secs * 100.0;
        let other =
            (now.busy - self.busy - (now.steal - self.steal)).saturating_sub(now.own - self.own);
        (pct(other), pct(now.steal - self.steal))
    }
}
