//! What a VM costs the host: PSS of the whole process and of the guest-RAM mapping
//! (`/proc/self/smaps_rollup`, `/proc/self/smaps`), and its memory cgroup's usage.
//!
//! Huge pages of hugetlb RAM are not in a mapping's PSS (smaps counts them apart, as
//! `Private_Hugetlb` and `Shared_Hugetlb`) nor charged to a v1 memory cgroup: every PSS here
//! adds them, whole, so that what a VM of huge pages holds is seen like any other VM's.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::eventfd::{EfdFlags, EventFd};

/// PSS of the whole process, bytes.
pub fn process_pss() -> std::io::Result<u64> {
    process_pss_of(None)
}

/// PSS of a whole process (`None`: this one), bytes, from its `smaps_rollup`, with its
/// hugetlb pages.
pub fn process_pss_of(pid: Option<u32>) -> std::io::Result<u64> {
    let process = match pid {
        Some(pid) => i32::try_from(pid)
            .map_err(|_| procfs::ProcError::NotFound(None))
            .and_then(procfs::process::Process::new),
        None => procfs::process::Process::myself(),
    };
    let rollup = process
        .and_then(|p| p.smaps_rollup())
        .map_err(std::io::Error::other)?;
    let field = |name: &str| {
        rollup
            .memory_map_rollup
            .iter()
            .find_map(|map| map.extension.map.get(name).copied())
    };
    let pss = field("Pss").ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "smaps_rollup has no `Pss:` line",
        )
    })?;
    Ok(pss + HUGETLB_FIELDS.iter().filter_map(|f| field(f)).sum::<u64>())
}

/// The lines of smaps that count hugetlb pages, which `Pss` leaves out.
const HUGETLB_FIELDS: [&str; 2] = ["Private_Hugetlb", "Shared_Hugetlb"];

/// PSS of the mappings inside `[start, start + len)`, bytes, with their hugetlb pages (guest
/// RAM can be split into several: the memory pool maps runs of it from its memfd).
pub fn range_pss(start: u64, len: u64) -> std::io::Result<u64> {
    range_memory_of(None, start, len).map(|m| m.pss + m.hugetlb)
}

/// What the mappings inside a range hold, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RangeMemory {
    /// Their PSS, hugetlb pages left out.
    pub pss: u64,
    /// Their hugetlb pages (which no memory cgroup is charged for).
    pub hugetlb: u64,
}

/// PSS and hugetlb pages of the mappings of process `pid` (`None`: this one) inside
/// `[start, start + len)`. Read by hand, not through `procfs`: the replay's sampler reads it
/// for every VM, and `procfs` builds a map of every field of every mapping where this needs
/// three fields of a few.
pub fn range_memory_of(pid: Option<u32>, start: u64, len: u64) -> std::io::Result<RangeMemory> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/smaps"),
        None => "/proc/self/smaps".to_owned(),
    };
    let text = std::fs::read_to_string(path)?;
    let end = start.saturating_add(len);
    let mut inside = false;
    let mut total = RangeMemory::default();
    for line in text.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((lo, hi)) = range.split_once('-') {
                if let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16))
                {
                    inside = start <= lo && hi <= end;
                    continue;
                }
            }
        }
        if inside {
            if let Some((name, rest)) = line.split_once(':') {
                if name == "Pss" {
                    total.pss += parse_kib(rest) * 1024;
                } else if HUGETLB_FIELDS.contains(&name) {
                    total.hugetlb += parse_kib(rest) * 1024;
                }
            }
        }
    }
    Ok(total)
}

fn parse_kib(rest: &str) -> u64 {
    rest.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Has the process `command` starts write itself into `procs` (a cgroup's `cgroup.procs` or
/// `tasks`, v1 or v2, opened for writing) between its fork and its exec, so that it is in that
/// cgroup from its first instruction on. The file stays open, with the hook, until `command`
/// is dropped (close-on-exec: the child's copy goes at its exec).
pub fn enter_on_spawn(procs: std::fs::File, command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let enter = move || {
        // "0": the writing process itself.
        let line = b"0\n";
        // SAFETY: `line` is valid for its length; `procs` is open while the hook lives.
        let written = unsafe { libc::write(procs.as_raw_fd(), line.as_ptr().cast(), line.len()) };
        if written == 2 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    // SAFETY: the hook runs between fork and exec and calls only write(2), which is
    // async-signal-safe, and allocates nothing (an error is an errno, kept inline).
    unsafe { command.pre_exec(enter) };
}

/// Where the cgroup file systems are mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Set by [`MemoryCgroup::place_self`] for the image it executes: the cgroup it was put in.
pub const PLACED_ENV: &str = "PVISOR_CGROUP_PLACED";

/// A memory cgroup the VM runs in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryCgroup {
    dir: PathBuf,
    v2: bool,
}

/// Errors joining a cgroup.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A name that is no relative path of plain names: `..`, `.`, or a root other than the
    /// cgroup file system's would reach out of the process's own cgroup.
    #[error("memory cgroup `{}`: expected a relative path of plain names (no `..`, `.` or leading `/`)", .0.display())]
    Name(PathBuf),
    /// Neither a v2 memory controller nor a v1 memory hierarchy is mounted.
    #[error("no memory cgroup controller is available (looked for cgroup v2 with `memory` and v1 at /sys/fs/cgroup/memory)")]
    NoController,
    /// [`PLACED_ENV`] names a cgroup this process is not in, or not the one asked for.
    #[error("{PLACED_ENV} names {}, which is not this process's memory cgroup ({}) or not the one asked for", .placed.display(), .own.display())]
    Placed {
        /// What the variable says.
        placed: PathBuf,
        /// The cgroup this process is in.
        own: PathBuf,
    },
    /// Creating or joining failed.
    #[error("cannot {op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
}

impl MemoryCgroup {
    /// This process's own memory cgroup's directory, and whether it is v2 (where the host
    /// has the v2 memory controller) or v1: where [`MemoryCgroup::join`] creates its names.
    pub fn own_base() -> Result<(PathBuf, bool), CgroupError> {
        Self::base_of(None)
    }

    /// The memory cgroup process `pid` is in (e.g. a VM connected to the governor, found by
    /// its peer credentials rather than by what it claims).
    pub fn of_process(pid: u32) -> Result<Self, CgroupError> {
        let (dir, v2) = Self::base_of(Some(pid))?;
        Ok(Self { dir, v2 })
    }

    /// The memory cgroup directory of process `pid` (`None`: this one), from its
    /// `/proc/PID/cgroup`, and whether it is v2.
    fn base_of(pid: Option<u32>) -> Result<(PathBuf, bool), CgroupError> {
        let path = PathBuf::from(match pid {
            Some(pid) => format!("/proc/{pid}/cgroup"),
            None => "/proc/self/cgroup".to_owned(),
        });
        let read_error = |e: procfs::ProcError| CgroupError::Io {
            op: "read",
            path: path.clone(),
            source: std::io::Error::other(e),
        };
        let process = match pid {
            Some(pid) => i32::try_from(pid)
                .map_err(|_| procfs::ProcError::NotFound(Some(path.clone())))
                .and_then(procfs::process::Process::new),
            None => procfs::process::Process::myself(),
        };
        let own = process.and_then(|p| p.cgroups()).map_err(read_error)?.0;
        let v2_root = Path::new(CGROUP_ROOT);
        let v2_has_memory = std::fs::read_to_string(v2_root.join("cgroup.controllers"))
            .map(|c| c.split_whitespace().any(|c| c == "memory"))
            .unwrap_or(false);
        let (root, v2, own) = if v2_has_memory {
            // The v2 hierarchy is the one numbered 0, with no controllers named.
            let own = own
                .iter()
                .find(|c| c.hierarchy == 0 && c.controllers.is_empty());
            (v2_root.to_path_buf(), true, own)
        } else {
            let v1_root = v2_root.join("memory");
            if !v1_root.join("memory.usage_in_bytes").exists() {
                return Err(CgroupError::NoController);
            }
            let own = own
                .iter()
                .find(|c| c.controllers.iter().any(|c| c == "memory"));
            (v1_root, false, own)
        };
        let own = own.map_or("/", |c| c.pathname.as_str());
        Ok((root.join(own.trim_start_matches('/')), v2))
    }

    /// Creates `name` (a relative path) under this process's own memory cgroup — v2 where the
    /// host has its memory controller, else v1 — and moves this process into it. Call it
    /// before allocating guest RAM: v1 does not move charges made earlier.
    pub fn join(name: &Path) -> Result<Self, CgroupError> {
        let cgroup = Self::create(name)?;
        cgroup.enter()?;
        Ok(cgroup)
    }

    /// Moves this process into this cgroup.
    fn enter(&self) -> Result<(), CgroupError> {
        let procs = self.dir.join("cgroup.procs");
        std::fs::write(&procs, std::process::id().to_string()).map_err(|source| CgroupError::Io {
            op: "join",
            path: procs,
            source,
        })
    }

    /// Creates `name` (a relative path of plain names, and what leads to it) under this
    /// process's own memory cgroup; or, absolute, that cgroup below `/sys/fs/cgroup` (where a
    /// supervisor placed its VM).
    pub(crate) fn create(name: &Path) -> Result<Self, CgroupError> {
        let below = name.strip_prefix(CGROUP_ROOT).unwrap_or(name);
        let plain = below
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !plain || below.as_os_str().is_empty() {
            return Err(CgroupError::Name(name.to_path_buf()));
        }
        let (base, v2) = Self::own_base()?;
        let dir = base.join(name);
        std::fs::create_dir_all(&dir).map_err(|source| CgroupError::Io {
            op: "create",
            path: dir.clone(),
            source,
        })?;
        Ok(Self { dir, v2 })
    }

    /// Has the process `command` starts join this cgroup between its fork and its exec: all
    /// it touches from its first instruction on is charged here. A process that joins on
    /// its own ([`MemoryCgroup::join`]) does so only once it runs, and v1 leaves what it
    /// touched before where it was: a detached VM left 0.86 MiB of its 1.75 MiB of
    /// anonymous memory (its relocated binary, its early heap) charged to its launcher's
    /// cgroup, outside a sandbox daemon's budget.
    pub(crate) fn join_before_exec(
        &self,
        command: &mut std::process::Command,
    ) -> Result<(), CgroupError> {
        let path = self.dir.join("cgroup.procs");
        let procs = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|source| CgroupError::Io {
                op: "open",
                path,
                source,
            })?;
        enter_on_spawn(procs, command);
        Ok(())
    }

    /// For a process that runs its VM itself (`pvisor run` in the foreground, each VM of a
    /// replay): puts it into cgroup `name` with all it will touch. On the first call this
    /// creates `name`, moves the process in and executes the same program again with the same
    /// arguments, so that the new image (its relocated binary, its heap, its page tables) is
    /// charged there from its first instruction; the fresh image's call returns the cgroup's
    /// full directory, for the VM to join by that path (a no-op). It tells the two calls
    /// apart by [`PLACED_ENV`], which it believes only when this process is in that very
    /// cgroup already.
    pub fn place_self(name: &Path) -> Result<PathBuf, CgroupError> {
        use std::os::unix::process::CommandExt;
        if let Some(placed) = std::env::var_os(PLACED_ENV).map(PathBuf::from) {
            let (own, _) = Self::own_base()?;
            let below = name.strip_prefix(CGROUP_ROOT).unwrap_or(name);
            if placed == own && placed.ends_with(below) {
                return Ok(placed);
            }
            return Err(CgroupError::Placed { placed, own });
        }
        let cgroup = Self::create(name)?;
        cgroup.enter()?;
        let program = PathBuf::from("/proc/self/exe");
        let error = std::process::Command::new(&program)
            .args(std::env::args_os().skip(1))
            .arg0(std::env::args_os().next().unwrap_or_default())
            .env(PLACED_ENV, &cgroup.dir)
            .exec();
        // Still here: the exec failed. Back out, so that nothing stays charged there.
        cgroup.leave_and_remove();
        Err(CgroupError::Io {
            op: "execute again in its cgroup",
            path: program,
            source: error,
        })
    }

    /// A cgroup that exists already (e.g. one a VM process joined), without joining it: v2 if
    /// `dir` has `memory.current`, else v1.
    pub fn at(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            v2: dir.join("memory.current").exists(),
        }
    }

    /// Moves this process back to the parent cgroup and removes this one (best effort: a
    /// cgroup other processes still use stays). What it was charged goes to the parent.
    pub fn leave_and_remove(&self) {
        if let Some(parent) = self.dir.parent() {
            let _ = std::fs::write(parent.join("cgroup.procs"), std::process::id().to_string());
        }
        let _ = std::fs::remove_dir(&self.dir);
    }

    /// Creates `name` (a relative path) under this process's own memory cgroup without
    /// joining it, with a hard limit of `limit` bytes (v2 `memory.max`, v1
    /// `memory.limit_in_bytes`); on v2 its children get the memory controller too. A cgroup
    /// that cannot be limited is removed again.
    pub fn create_limited(name: &Path, limit: u64) -> Result<Self, CgroupError> {
        let cgroup = Self::create(name)?;
        let (file, children) = if cgroup.v2 {
            ("memory.max", Some("cgroup.subtree_control"))
        } else {
            ("memory.limit_in_bytes", None)
        };
        let write = |file: &str, value: &str| {
            let path = cgroup.dir.join(file);
            std::fs::write(&path, value).map_err(|source| CgroupError::Io {
                op: "write",
                path,
                source,
            })
        };
        let limited = write(file, &limit.to_string())
            .and_then(|()| children.map_or(Ok(()), |c| write(c, "+memory")));
        if let Err(e) = limited {
            let _ = std::fs::remove_dir(&cgroup.dir);
            return Err(e);
        }
        Ok(cgroup)
    }

    /// The hard memory limit that binds this cgroup: the smallest of its own and its
    /// ancestors' (v2 `memory.max`, v1 `memory.limit_in_bytes`), `None` where none is set.
    pub fn limit(&self) -> Option<u64> {
        let file = if self.v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        };
        self.dir
            .ancestors()
            .map_while(|dir| std::fs::read_to_string(dir.join(file)).ok())
            // v2 says `max`; v1's "unlimited" is the largest page-aligned i64.
            .filter_map(|text| text.trim().parse::<u64>().ok())
            .filter(|&limit| limit < 1 << 62)
            .min()
    }

    /// How many processes of this cgroup the kernel's OOM killer has killed: `oom_kill` of
    /// v2 `memory.events` or v1 `memory.oom_control` (`None` where the file is gone or the
    /// kernel does not count it).
    pub fn oom_kills(&self) -> Option<u64> {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        stat_value(
            &std::fs::read_to_string(self.dir.join(file)).ok()?,
            "oom_kill",
        )
    }

    /// The cgroup's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How often the cgroup's usage hit its limit: v1 `memory.failcnt`, v2 the `max` line of
    /// `memory.events` (`None` where neither can be read).
    pub fn failcnt(&self) -> Option<u64> {
        if self.v2 {
            stat_value(
                &std::fs::read_to_string(self.dir.join("memory.events")).ok()?,
                "max",
            )
        } else {
            let text = std::fs::read_to_string(self.dir.join("memory.failcnt")).ok()?;
            text.trim().parse().ok()
        }
    }

    /// Memory charged to the cgroup that the kernel cannot take back without swap, bytes: its
    /// usage less its clean file pages (page cache already written back, which the kernel
    /// drops at the limit before it OOM-kills anyone). A guest's disk writes leave their size
    /// in page cache until the VM drops it at its next offload (69 MiB for a 69 MiB `task`
    /// step, measured); counted as the VM's, it looked like overhead to the memory governor.
    pub fn unreclaimable(&self) -> std::io::Result<u64> {
        let usage = self.usage()?;
        let path = self.dir.join("memory.stat");
        let stat = std::fs::read_to_string(&path).map_err(at(&path))?;
        let clean = clean_file_bytes(&stat, self.v2).ok_or_else(|| {
            std::io::Error::other(format!("{}: no file page counts", path.display()))
        })?;
        // Read a moment apart: the clean pages may just have outgrown what was charged.
        Ok(usage.saturating_sub(clean))
    }

    /// The cgroup's own memory pressure, `some avg10` of v2 `memory.pressure`, percent (`None`
    /// on v1, which has no per-cgroup PSI: see [`MemoryCgroup::pressure_events`]).
    pub fn psi_some_avg10(&self) -> Option<f64> {
        if !self.v2 {
            return None;
        }
        parse_psi_some_avg10(&std::fs::read_to_string(self.dir.join("memory.pressure")).ok()?)
    }

    /// Registers for the kernel's memory pressure notifications of this v1 cgroup at `level`
    /// and above (`memory.pressure_level` through `cgroup.event_control`). v2 has no such
    /// file (its pressure is [`MemoryCgroup::psi_some_avg10`]): refused there.
    pub fn pressure_events(&self, level: PressureLevel) -> std::io::Result<PressureEvents> {
        if self.v2 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "cgroup v2 has no memory.pressure_level (its memory.pressure is read instead)",
            ));
        }
        let level_path = self.dir.join("memory.pressure_level");
        let level_file = std::fs::File::open(&level_path).map_err(at(&level_path))?;
        let events = EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?;
        let control = self.dir.join("cgroup.event_control");
        let line = format!(
            "{} {} {}",
            events.as_raw_fd(),
            level_file.as_raw_fd(),
            level.as_str()
        );
        std::fs::write(&control, line).map_err(at(&control))?;
        Ok(PressureEvents {
            events,
            _level: level_file,
        })
    }

    /// Memory charged to the cgroup, bytes (page cache included).
    pub fn usage(&self) -> std::io::Result<u64> {
        let file = if self.v2 {
            "memory.current"
        } else {
            "memory.usage_in_bytes"
        };
        let text = std::fs::read_to_string(self.dir.join(file))?;
        text.trim()
            .parse()
            .map_err(|_| std::io::Error::other(format!("unreadable {file}: {text}")))
    }
}

/// A level of the kernel's memory pressure notifications (cgroup v1
/// `memory.pressure_level`): `low`, the kernel reclaims memory for new allocations; `medium`,
/// it reclaims hard (with no swap: little is left that it can reclaim); `critical`, an OOM
/// kill is near.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PressureLevel {
    /// Any reclaim.
    Low,
    /// Reclaim that finds little to take.
    #[default]
    Medium,
    /// About to OOM-kill.
    Critical,
}

impl PressureLevel {
    /// Its name in `cgroup.event_control`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Low => "low",
            Self::Medium => "medium",
            Self::Critical => "critical",
        }
    }
}

impl std::str::FromStr for PressureLevel {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "low" => Ok(Self::Low),
            "medium" => Ok(Self::Medium),
            "critical" => Ok(Self::Critical),
            _ => Err(format!(
                "a pressure level is low, medium or critical, not {text:?}"
            )),
        }
    }
}

/// Registered memory pressure notifications of a v1 cgroup (see
/// [`MemoryCgroup::pressure_events`]); dropping it ends the registration.
#[derive(Debug)]
pub struct PressureEvents {
    events: EventFd,
    /// Open for as long as the registration lasts.
    _level: std::fs::File,
}

impl PressureEvents {
    /// Notifications since the last call (0: none; it never blocks).
    pub fn take(&self) -> std::io::Result<u64> {
        match self.events.read() {
            Ok(n) => Ok(n),
            Err(Errno::EAGAIN) => Ok(0),
            Err(e) => Err(e.into()),
        }
    }
}

/// `some avg10` of a PSI file (`/proc/pressure/memory`, v2 `memory.pressure`), percent. By
/// hand, not through `procfs`, whose `PressureRecord` holds it as `f32`.
pub fn parse_psi_some_avg10(text: &str) -> Option<f64> {
    let some = text.lines().find(|l| l.starts_with("some "))?;
    some.split_whitespace()
        .find_map(|field| field.strip_prefix("avg10="))
        .and_then(|v| v.parse().ok())
}

/// Clean file pages of a cgroup's `memory.stat` (v2 keys, or v1's hierarchical `total_`
/// ones), bytes: file pages on the LRU lists less those dirty or under writeback. `None` if a
/// key is missing.
fn clean_file_bytes(stat: &str, v2: bool) -> Option<u64> {
    let keys: [&str; 4] = if v2 {
        [
            "inactive_file",
            "active_file",
            "file_dirty",
            "file_writeback",
        ]
    } else {
        [
            "total_inactive_file",
            "total_active_file",
            "total_dirty",
            "total_writeback",
        ]
    };
    let [inactive, active, dirty, writeback] = keys.map(|key| stat_value(stat, key));
    let file = inactive?.saturating_add(active?);
    Some(file.saturating_sub(dirty?.saturating_add(writeback?)))
}

/// An I/O error that names the file it came from.
fn at(path: &Path) -> impl FnOnce(std::io::Error) -> std::io::Error + '_ {
    move |e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// The number on the `KEY N` line of a cgroup's flat-keyed file (`memory.stat`,
/// `memory.events`, v1 `memory.oom_control`); `None` if there is no such line or it is no
/// number.
fn stat_value(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.split_once(' ').filter(|(name, _)| *name == key))
        .and_then(|(_, n)| n.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_names_that_reach_out_of_the_own_cgroup_are_refused() {
        for name in [
            "../x",
            "a/../../b",
            "./a",
            "/tmp/x",
            "/sys/fs/cgroup/../../tmp/x",
            "",
        ] {
            let refused = MemoryCgroup::create(Path::new(name));
            assert!(
                matches!(refused, Err(CgroupError::Name(_))),
                "{name}: {refused:?}"
            );
        }
    }

    #[test]
    fn clean_file_pages_are_file_pages_less_dirty_and_writeback() {
        let v1 = "cache 9\ntotal_cache 900\ntotal_inactive_file 600\ntotal_active_file 300\n\
                  total_dirty 100\ntotal_writeback 50\ninactive_file 6\n";
        assert_eq!(clean_file_bytes(v1, false), Some(750));
        let v2 = "anon 5\nfile 900\nactive_file 300\ninactive_file 600\nfile_dirty 100\n\
                  file_writeback 50\n";
        assert_eq!(clean_file_bytes(v2, true), Some(750));
        // More dirty than on the lists (counters read a moment apart): none clean.
        let skew = "inactive_file 1\nactive_file 1\nfile_dirty 5\nfile_writeback 0\n";
        assert_eq!(clean_file_bytes(skew, true), Some(0));
        // A v2 file read as v1, or a key missing: no figure rather than a wrong one.
        assert_eq!(clean_file_bytes(v2, false), None);
        assert_eq!(
            clean_file_bytes("inactive_file 1\nactive_file 1\n", true),
            None
        );
    }

    #[test]
    fn oom_kill_of_v1_and_v2_files_is_their_counter() {
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(stat_value(v1, "oom_kill"), Some(3));
        let v2 = "low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(stat_value(v2, "oom_kill"), Some(2));
        assert_eq!(
            stat_value("oom_kill_disable 0\nunder_oom 0\n", "oom_kill"),
            None
        );
    }

    #[test]
    fn cgroup_own_base_is_this_processs_memory_cgroup_and_of_process_agrees() {
        let (dir, v2) = match MemoryCgroup::own_base() {
            Ok(base) => base,
            // A host without a memory controller has nothing to find.
            Err(CgroupError::NoController) => return,
            Err(e) => panic!("{}", basics::error_chain(&e)),
        };
        let usage = if v2 {
            "memory.current"
        } else {
            "memory.usage_in_bytes"
        };
        assert!(dir.join(usage).exists(), "{} has no {usage}", dir.display());
        let mine = MemoryCgroup::of_process(std::process::id()).expect("this process's cgroup");
        assert_eq!(mine.dir(), dir);
        // A process that is not there is an error naming its file.
        let e = MemoryCgroup::of_process(u32::MAX).unwrap_err();
        assert!(basics::error_chain(&e).contains("/cgroup"), "{e}");
    }

    #[test]
    fn stats_process_pss_is_positive_and_range_pss_finds_a_mapping() {
        assert!(process_pss().unwrap() > 0);
        // Every page its own content, so that none of them can be shared with another page
        // (KSM merges identical pages where merging is on) and their PSS is their size. Not
        // inherited by a fork: another test of this process forks a child (the snapshot
        // removal as nobody), and while that child lives every private page is shared with
        // it and reads at half its size (this test read under 7 MiB in full suite runs).
        let data = testkit::Mapping::anon(8 << 20);
        // SAFETY: advice on a mapping this test owns.
        let rc = unsafe { libc::madvise(data.as_ptr().cast(), data.len(), libc::MADV_DONTFORK) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        for (i, offset) in (0..data.len()).step_by(4096).enumerate() {
            data.write(offset, &(i as u64 + 1).to_le_bytes());
        }
        let start = data.as_ptr() as u64;
        // The kernel may have merged the mapping with a neighbour of the same flags; range_pss
        // counts whole mappings only, so ask for the one that holds it.
        let text = std::fs::read_to_string("/proc/self/maps").unwrap();
        let (lo, hi) = text
            .lines()
            .filter_map(|l| {
                let (lo, hi) = l.split_whitespace().next()?.split_once('-')?;
                Some((
                    u64::from_str_radix(lo, 16).ok()?,
                    u64::from_str_radix(hi, 16).ok()?,
                ))
            })
            .find(|&(lo, hi)| lo <= start && start < hi)
            .unwrap();
        assert!(range_pss(lo, hi - lo).unwrap() >= 7 << 20);
        assert_eq!(range_pss(1, 4096).unwrap(), 0);
    }
}
