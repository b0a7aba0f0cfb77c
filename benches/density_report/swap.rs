//! The kernel's answer to memory pressure, beside ours (issue 35, item 6): the strategies
//! `off+zram` and `off+zswap` run the VMs as `off` under a memory cgroup limit, with swap to
//! compressed memory set up on the host for each budgeted run and taken down after it.
//!
//! The budget holds for the total: the compressed pool's cap plus the cgroup limit
//! ([`split`]). zram's cap is its `mem_limit` (a share of the budget, `DENSITY_BENCH_POOL_SHARE`
//! percent, 50 by default); zswap's is `max_pool_percent`, a whole percent of the host's RAM,
//! the largest that fits in that share. zram compresses with lz4; zswap with lz4 where the
//! kernel's crypto API has it, else lzo-rle or lzo (this host's has no lz4): the report names it. On cgroup v1 neither pool is charged to the VMs'
//! cgroup (zram's memory belongs to a block device; v1 does not charge zswap), so the bench
//! reads the pool itself every 100 ms while the run lasts ([`Watch`]): zram's `mm_stat`
//! (`mem_used_total`), `/proc/meminfo`'s `Zswap` line. zswap needs a swap device behind it: a
//! swap file (4 GiB, allocated, not sparse) in the bench's temporary directory; what does not
//! fit in the pool goes there, to disk, outside the budget as any disk is.
//!
//! The host is put back whatever happens to the run ([`HostSwap`]'s `Drop`): swap off, zram
//! reset, zswap's parameters as they were, the swap file removed. A host that already swaps is
//! refused: the runs of the other strategies must see none, and its swap is not ours to stop.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::common::Res;

const ZRAM: &str = "/sys/block/zram0";
const ZSWAP: &str = "/sys/module/zswap/parameters";
/// The swap device's size: zram's `disksize` (what it may hold uncompressed), the zswap swap
/// file's length.
const SWAP_BYTES: u64 = 4 << 30;
/// How often the pool is read while a run lasts.
const WATCH_PERIOD: Duration = Duration::from_millis(100);

/// A compressed pool the kernel swaps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    Zram,
    Zswap,
}

impl Pool {
    /// The strategy `pvisor replay` runs and the pool of a bench strategy: `off+zram` is
    /// (`off`, zram); `governed` is (`governed`, none).
    pub fn of(strategy: &str) -> (&str, Option<Pool>) {
        match strategy.split_once('+') {
            Some((base, "zram")) => (base, Some(Pool::Zram)),
            Some((base, "zswap")) => (base, Some(Pool::Zswap)),
            _ => (strategy, None),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Pool::Zram => "zram",
            Pool::Zswap => "zswap",
        }
    }

    /// The pool's compressed bytes now.
    fn used_bytes(self) -> Res<u64> {
        match self {
            Pool::Zram => {
                let text = fs::read_to_string(Path::new(ZRAM).join("mm_stat"))?;
                // orig_data_size compr_data_size mem_used_total …
                text.split_whitespace()
                    .nth(2)
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| format!("{ZRAM}/mm_stat: no mem_used_total in `{text}`").into())
            }
            Pool::Zswap => meminfo_kib("Zswap").map(|kib| kib * 1024),
        }
    }
}

/// A `/proc/meminfo` line's value, KiB.
fn meminfo_kib(key: &str) -> Res<u64> {
    let text = fs::read_to_string("/proc/meminfo")?;
    text.lines()
        .find_map(|line| {
            let (name, rest) = line.split_once(':')?;
            (name == key).then(|| rest.split_whitespace().next()?.parse().ok())?
        })
        .ok_or_else(|| format!("/proc/meminfo has no `{key}`").into())
}

/// How a budget is shared between the pool and the cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    pub pool_bytes: u64,
    pub cgroup_bytes: u64,
    /// zswap's `max_pool_percent`.
    pub zswap_percent: Option<u64>,
}

/// Shares `budget` between `pool` (at most `share_percent` of it) and the cgroup, on a host
/// of `mem_total` bytes.
pub fn split(pool: Pool, budget: u64, share_percent: u64, mem_total: u64) -> Result<Split, String> {
    let share = |of: u64, percent: u64| (u128::from(of) * u128::from(percent) / 100) as u64;
    let wanted = share(budget, share_percent);
    let (pool_bytes, zswap_percent) = match pool {
        Pool::Zram => (wanted & !4095, None),
        Pool::Zswap => {
            let percent = (u128::from(wanted) * 100 / u128::from(mem_total.max(1))) as u64;
            if percent == 0 {
                return Err(format!(
                    "zswap's pool is a whole percent of the host's {} MiB: {share_percent}% of a \
                     {} MiB budget is less than 1%",
                    mem_total >> 20,
                    budget >> 20
                ));
            }
            (share(mem_total, percent) & !4095, Some(percent))
        }
    };
    if pool_bytes == 0 || pool_bytes >= budget {
        return Err(format!(
            "a {} pool of {pool_bytes} bytes leaves nothing of a {budget}-byte budget",
            pool.name()
        ));
    }
    Ok(Split {
        pool_bytes,
        cgroup_bytes: budget - pool_bytes,
        zswap_percent,
    })
}

/// The host's RAM, bytes.
pub fn mem_total() -> Res<u64> {
    meminfo_kib("MemTotal").map(|kib| kib * 1024)
}

/// Swap to a compressed pool, on while this lives.
#[derive(Debug)]
pub struct HostSwap {
    pool: Pool,
    /// The swap device or file given to `swapon`.
    device: PathBuf,
    /// zswap's parameters as they were, written back on drop.
    restore: Vec<(PathBuf, String)>,
}

fn write(path: impl AsRef<Path>, value: &str) -> Res<()> {
    let path = path.as_ref();
    fs::write(path, value).map_err(|e| format!("{}: writing `{value}`: {e}", path.display()).into())
}

fn run(program: &str, args: &[&str]) -> Res<()> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into())
    }
}

/// The swap areas in use (`/proc/swaps` past its header).
fn swaps_in_use() -> Res<Vec<String>> {
    Ok(fs::read_to_string("/proc/swaps")?
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect())
}

impl HostSwap {
    /// Turns swap to `pool` on, capped as `split` says; the swap file of zswap goes in `dir`.
    pub fn enable(pool: Pool, split: &Split, dir: &Path) -> Res<Self> {
        let in_use = swaps_in_use()?;
        if !in_use.is_empty() {
            return Err(format!(
                "the host already swaps to {}: off+zram and off+zswap need a host without swap \
                 (turn it off with `swapoff`, or leave those strategies out)",
                in_use.join(", ")
            )
            .into());
        }
        let swap = match pool {
            Pool::Zram => {
                if !Path::new(ZRAM).exists() {
                    return Err(format!("{ZRAM} does not exist: this kernel has no zram").into());
                }
                write(Path::new(ZRAM).join("reset"), "1")?;
                write(Path::new(ZRAM).join("comp_algorithm"), "lz4")?;
                write(Path::new(ZRAM).join("disksize"), &SWAP_BYTES.to_string())?;
                write(
                    Path::new(ZRAM).join("mem_limit"),
                    &split.pool_bytes.to_string(),
                )?;
                HostSwap {
                    pool,
                    device: PathBuf::from("/dev/zram0"),
                    restore: Vec::new(),
                }
            }
            Pool::Zswap => {
                let mut restore = Vec::new();
                for name in ["enabled", "compressor", "max_pool_percent"] {
                    let path = Path::new(ZSWAP).join(name);
                    let was = fs::read_to_string(&path).map_err(|e| {
                        format!("{}: {e} (this kernel has no zswap?)", path.display())
                    })?;
                    restore.push((path, was.trim().to_owned()));
                }
                let file = dir.join("zswap.swapfile");
                let _ = fs::remove_file(&file);
                allocate(&file, SWAP_BYTES)?;
                // From here on, drop puts the parameters back and removes the file.
                let swap = HostSwap {
                    pool,
                    device: file,
                    restore,
                };
                write(Path::new(ZSWAP).join("compressor"), &zswap_compressor()?)?;
                let percent = split.zswap_percent.ok_or("a zswap split has a percent")?;
                write(
                    Path::new(ZSWAP).join("max_pool_percent"),
                    &percent.to_string(),
                )?;
                write(Path::new(ZSWAP).join("enabled"), "Y")?;
                swap
            }
        };
        let device = swap.device.to_string_lossy().into_owned();
        run("mkswap", &[&device])?;
        run("swapon", &[&device])?;
        Ok(swap)
    }

    pub fn pool(&self) -> Pool {
        self.pool
    }
}

/// The compressor zswap is given: lz4, as zram's, where the kernel's crypto API has it (zswap
/// compresses through it, zram through its own backends), else lzo-rle or lzo.
pub fn zswap_compressor() -> Res<String> {
    let crypto = fs::read_to_string("/proc/crypto")?;
    let names: Vec<&str> = crypto
        .lines()
        .filter_map(|l| l.strip_prefix("name"))
        .filter_map(|rest| rest.trim_start().strip_prefix(':'))
        .map(str::trim)
        .collect();
    ["lz4", "lzo-rle", "lzo"]
        .into_iter()
        .find(|c| names.contains(c))
        .map(str::to_owned)
        .ok_or_else(|| "the kernel's crypto API has none of lz4, lzo-rle, lzo for zswap".into())
}

/// What compresses a pool's pages, for the report.
pub fn compressor(pool: Pool) -> String {
    let path = match pool {
        Pool::Zram => Path::new(ZRAM).join("comp_algorithm"),
        Pool::Zswap => Path::new(ZSWAP).join("compressor"),
    };
    let text = fs::read_to_string(path).unwrap_or_default();
    // zram lists every algorithm with the one in use in brackets.
    text.split_whitespace()
        .find_map(|w| w.strip_prefix('[').and_then(|w| w.strip_suffix(']')))
        .unwrap_or(text.trim())
        .to_owned()
}

/// Creates `path` (mode 0600, as `swapon` wants) with `len` bytes allocated.
fn allocate(path: &Path, len: u64) -> Res<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let len_arg = libc::off_t::try_from(len).map_err(|_| format!("{len} bytes: too long"))?;
    // SAFETY: fallocate on a descriptor we own; no memory is involved.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len_arg) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        let _ = fs::remove_file(path);
        return Err(format!("{}: fallocate of {len} bytes: {e}", path.display()).into());
    }
    Ok(())
}

impl Drop for HostSwap {
    fn drop(&mut self) {
        let device = self.device.to_string_lossy().into_owned();
        if swaps_in_use().is_ok_and(|s| s.contains(&device)) {
            if let Err(e) = run("swapoff", &[&device]) {
                eprintln!("density_report: WARNING: the host still swaps to {device}: {e}");
            }
        }
        match self.pool {
            Pool::Zram => {
                let _ = write(Path::new(ZRAM).join("reset"), "1");
            }
            Pool::Zswap => {
                for (path, value) in &self.restore {
                    if let Err(e) = write(path, value) {
                        eprintln!("density_report: WARNING: zswap not put back: {e}");
                    }
                }
                let _ = fs::remove_file(&self.device);
            }
        }
    }
}

/// What the pool held while a run lasted.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolUse {
    pub pool: Pool,
    /// What compressed its pages (`lz4`, `lzo-rle`).
    pub compressor: String,
    /// The pool's cap and the cgroup limit the run had.
    pub split: Split,
    /// Largest reading, bytes.
    pub peak_bytes: f64,
    /// The readings integrated over the run, GiB·s.
    pub gib_s: f64,
}

/// Reads the pool every [`WATCH_PERIOD`] on a thread of its own until stopped.
#[derive(Debug)]
pub struct Watch {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Result<(f64, f64), String>>,
    pool: Pool,
    split: Split,
    compressor: String,
}

impl Watch {
    pub fn start(swap: &HostSwap, split: Split) -> Res<Self> {
        let pool = swap.pool();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("pool-watch".into())
            .spawn(move || -> Result<(f64, f64), String> {
                let (mut peak, mut gib_s) = (0f64, 0f64);
                let mut last = Instant::now();
                loop {
                    let used = pool.used_bytes().map_err(|e| e.to_string())? as f64;
                    let now = Instant::now();
                    peak = peak.max(used);
                    gib_s += used / f64::from(1u32 << 30) * (now - last).as_secs_f64();
                    last = now;
                    if flag.load(Ordering::Relaxed) {
                        return Ok((peak, gib_s));
                    }
                    std::thread::sleep(WATCH_PERIOD);
                }
            })?;
        Ok(Self {
            stop,
            thread,
            pool,
            split,
            compressor: compressor(pool),
        })
    }

    /// Stops it: what the pool held.
    pub fn finish(self) -> Res<PoolUse> {
        self.stop.store(true, Ordering::Relaxed);
        let (peak_bytes, gib_s) = self
            .thread
            .join()
            .map_err(|_| "the pool's watch panicked")??;
        Ok(PoolUse {
            pool: self.pool,
            compressor: self.compressor,
            split: self.split,
            peak_bytes,
            gib_s,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub const ALL: &[(&str, fn())] = &[
        ("strategies_name_their_pool", strategies_name_their_pool),
        (
            "a_split_keeps_the_total_within_the_budget",
            a_split_keeps_the_total_within_the_budget,
        ),
    ];

    pub fn strategies_name_their_pool() {
        assert_eq!(Pool::of("off+zram"), ("off", Some(Pool::Zram)));
        assert_eq!(Pool::of("off+zswap"), ("off", Some(Pool::Zswap)));
        assert_eq!(Pool::of("governed"), ("governed", None));
        assert_eq!(Pool::of("off+swap"), ("off+swap", None));
    }

    pub fn a_split_keeps_the_total_within_the_budget() {
        let gib = 1u64 << 30;
        let zram = split(Pool::Zram, 512 << 20, 50, 24 * gib).unwrap();
        assert_eq!(zram.pool_bytes + zram.cgroup_bytes, 512 << 20);
        assert_eq!(zram.pool_bytes, 256 << 20);
        // 1% of 24 GiB is 245.76 MiB: under half of 512 MiB.
        let zswap = split(Pool::Zswap, 512 << 20, 50, 24 * gib).unwrap();
        assert_eq!(zswap.zswap_percent, Some(1));
        assert_eq!(zswap.pool_bytes, (24 * gib / 100) & !4095);
        assert_eq!(zswap.pool_bytes + zswap.cgroup_bytes, 512 << 20);
        let zswap = split(Pool::Zswap, gib, 50, 24 * gib).unwrap();
        assert_eq!(zswap.zswap_percent, Some(2));
        // Less than 1% of the host: refused rather than rounded up past the budget.
        assert!(split(Pool::Zswap, 128 << 20, 50, 24 * gib).is_err());
        assert!(split(Pool::Zram, 512 << 20, 100, 24 * gib).is_err());
        assert!(split(Pool::Zram, 512 << 20, 0, 24 * gib).is_err());
    }
}
