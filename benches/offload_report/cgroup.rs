//! A cgroup v1 memory cgroup of the bench's own, one per measured offload: created under
//! `/sys/fs/cgroup/memory/`, limited or not, read (`memory.max_usage_in_bytes`,
//! `memory.failcnt`, the `oom_kill` count of `memory.oom_control`) and removed on drop.

use std::fs;
use std::path::{Path, PathBuf};

use crate::common::Res;

/// Where the v1 memory controller is mounted.
pub const ROOT: &str = "/sys/fs/cgroup/memory";

/// One memory cgroup, removed on drop (its tasks must have exited by then).
#[derive(Debug)]
pub struct MemCgroup {
    pub path: PathBuf,
}

impl MemCgroup {
    /// Creates `ROOT/NAME` with no limit.
    pub fn create(name: &str) -> Res<Self> {
        let root = Path::new(ROOT);
        if !root.join("memory.limit_in_bytes").exists() {
            return Err(format!(
                "{ROOT} is not a cgroup v1 memory controller: the budgeted offloads need one (and root)"
            )
            .into());
        }
        let path = root.join(name);
        if path.exists() {
            fs::remove_dir(&path)?;
        }
        fs::create_dir(&path).map_err(|e| format!("create {}: {e}", path.display()))?;
        Ok(Self { path })
    }

    fn write(&self, file: &str, value: &str) -> Res<()> {
        let path = self.path.join(file);
        fs::write(&path, value).map_err(|e| format!("write {value} to {}: {e}", path.display()))?;
        Ok(())
    }

    fn read_number(&self, file: &str) -> Res<u64> {
        let path = self.path.join(file);
        let text =
            fs::read_to_string(&path).map_err(|e| format!("read {}: {e}", path.display()))?;
        Ok(text.trim().parse()?)
    }

    /// Sets `memory.limit_in_bytes` (no swap here, so it binds all memory).
    pub fn limit(&self, bytes: u64) -> Res<()> {
        self.write("memory.limit_in_bytes", &bytes.to_string())
    }

    /// Current usage, `memory.usage_in_bytes`.
    pub fn usage(&self) -> Res<u64> {
        self.read_number("memory.usage_in_bytes")
    }

    /// Restarts the peak (at the current usage) and the failure count.
    pub fn reset_peak(&self) -> Res<()> {
        self.write("memory.max_usage_in_bytes", "0")?;
        self.write("memory.failcnt", "0")
    }

    /// `memory.max_usage_in_bytes`.
    pub fn peak(&self) -> Res<u64> {
        self.read_number("memory.max_usage_in_bytes")
    }

    /// `memory.failcnt`: times the limit was hit.
    pub fn failcnt(&self) -> Res<u64> {
        self.read_number("memory.failcnt")
    }

    /// The `oom_kill` count of `memory.oom_control` (0 if the kernel does not show it).
    pub fn oom_kills(&self) -> Res<u64> {
        let text = fs::read_to_string(self.path.join("memory.oom_control"))?;
        Ok(text
            .lines()
            .find_map(|line| line.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0))
    }

    /// Moves the calling process into the cgroup (all its threads; memory charged from now
    /// on is the cgroup's).
    pub fn join(path: &Path) -> Res<()> {
        let procs = path.join("cgroup.procs");
        fs::write(&procs, std::process::id().to_string())
            .map_err(|e| format!("join {}: {e}", procs.display()))?;
        Ok(())
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir(&self.path) {
            eprintln!("offload_report: cannot remove {}: {e}", self.path.display());
        }
    }
}
