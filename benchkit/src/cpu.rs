//! The CPU time a command and everything it starts take: a cgroup v1 `cpuacct` group the
//! command enters between fork and exec (its detached children, reparented away from it, stay
//! in the group and are counted), or, where the host has no such controller, the
//! `getrusage(RUSAGE_CHILDREN)` of this process (its waited-for children only: VMs that a
//! command detaches are not counted there).

use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::Command;

use super::host::ticks_per_second;
use super::Res;

/// Where the v1 `cpuacct` hierarchy is mounted here.
const CPUACCT: &str = "/sys/fs/cgroup/cpuacct";

/// User and system CPU time, seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuUse {
    pub user_s: f64,
    pub system_s: f64,
}

impl CpuUse {
    pub fn total_s(self) -> f64 {
        self.user_s + self.system_s
    }

    /// What was used after `before`.
    pub fn since(self, before: CpuUse) -> CpuUse {
        CpuUse {
            user_s: self.user_s - before.user_s,
            system_s: self.system_s - before.system_s,
        }
    }
}

/// Where CPU time is counted.
#[derive(Debug)]
enum Meter {
    /// A `cpuacct` group of ours, and its `cgroup.procs` open for writing.
    Cgroup { dir: PathBuf, procs: File },
    /// `getrusage(RUSAGE_CHILDREN)`.
    Children,
}

/// A place the commands of a bench are counted in; the group is removed on drop.
#[derive(Debug)]
pub struct CpuGroup {
    meter: Meter,
}

/// This process's cgroup in the v1 hierarchy of `controller`, from `/proc/self/cgroup`.
fn own_cgroup(controller: &str) -> Option<PathBuf> {
    let text = fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines().find_map(|line| {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        controllers
            .split(',')
            .any(|c| c == controller)
            .then(|| PathBuf::from(path.trim_start_matches('/')))
    })
}

impl CpuGroup {
    /// A new `cpuacct` group `NAME` beside this process's own, or `getrusage` where there is
    /// no `cpuacct` hierarchy; an error when the group cannot be made.
    pub fn create(name: &str) -> Res<Self> {
        let Some(own) = own_cgroup("cpuacct").filter(|_| Path::new(CPUACCT).is_dir()) else {
            return Ok(Self {
                meter: Meter::Children,
            });
        };
        let dir = Path::new(CPUACCT).join(own).join(name);
        if dir.exists() {
            // Left by an earlier run that was killed; empty unless its commands run on.
            fs::remove_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let procs = OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.procs"))
            .map_err(|e| format!("{}/cgroup.procs: {e}", dir.display()))?;
        Ok(Self {
            meter: Meter::Cgroup { dir, procs },
        })
    }

    /// How it counts, for a report's Method section.
    pub fn describe(&self) -> String {
        match &self.meter {
            Meter::Cgroup { dir, .. } => format!(
                "`cpuacct.stat` of a cgroup v1 `cpuacct` group ({}) that each `pvisor replay` enters before it \
                 runs: the replay, its VMs (detached, but in the group) and all they start, user + system",
                dir.display()
            ),
            Meter::Children => "`getrusage(RUSAGE_CHILDREN)` of the bench, user + system (no `cpuacct` \
                                hierarchy here: detached VMs are not counted)"
                .to_owned(),
        }
    }

    /// Makes `command` enter the group between fork and exec.
    pub fn enter_on_spawn(&self, command: &mut Command) -> Res<()> {
        let Meter::Cgroup { procs, .. } = &self.meter else {
            return Ok(());
        };
        vmm::stats::enter_on_spawn(procs.try_clone()?, command);
        Ok(())
    }

    /// CPU time used so far in the group (or by this process's waited-for children).
    pub fn usage(&self) -> Res<CpuUse> {
        match &self.meter {
            Meter::Cgroup { dir, .. } => {
                let path = dir.join("cpuacct.stat");
                let text =
                    fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                parse_cpuacct_stat(&text)
                    .ok_or_else(|| format!("{}: unreadable: `{text}`", path.display()).into())
            }
            Meter::Children => {
                let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
                // SAFETY: getrusage writes one rusage into the buffer it is given, which is
                // valid and large enough.
                let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, usage.as_mut_ptr()) };
                if rc != 0 {
                    return Err(format!(
                        "getrusage(RUSAGE_CHILDREN): {}",
                        std::io::Error::last_os_error()
                    )
                    .into());
                }
                // SAFETY: getrusage returned 0, so it filled the buffer.
                let usage = unsafe { usage.assume_init() };
                let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
                Ok(CpuUse {
                    user_s: s(usage.ru_utime),
                    system_s: s(usage.ru_stime),
                })
            }
        }
    }
}

impl Drop for CpuGroup {
    fn drop(&mut self) {
        if let Meter::Cgroup { dir, .. } = &self.meter {
            if let Err(err) = fs::remove_dir(dir) {
                eprintln!("cannot remove the cpuacct group {}: {err}", dir.display());
            }
        }
    }
}

/// `user N` and `system N` (clock ticks) of `cpuacct.stat`, in seconds.
pub fn parse_cpuacct_stat(text: &str) -> Option<CpuUse> {
    let field = |name: &str| {
        text.lines().find_map(|line| {
            let (key, value) = line.split_once(' ')?;
            (key == name).then(|| value.trim().parse::<u64>().ok())?
        })
    };
    let ticks = ticks_per_second();
    Some(CpuUse {
        user_s: field("user")? as f64 / ticks,
        system_s: field("system")? as f64 / ticks,
    })
}
