//! What a VM costs the host: PSS of the whole process and of the guest-RAM mapping
//! (`/proc/self/smaps_rollup`, `/proc/self/smaps`), and its memory cgroup's usage.

use std::path::{Path, PathBuf};

/// PSS of the whole process, bytes.
pub fn process_pss() -> std::io::Result<u64> {
    process_pss_of(None)
}

/// PSS of a whole process (`None`: this one), bytes, from its `smaps_rollup`.
pub fn process_pss_of(pid: Option<u32>) -> std::io::Result<u64> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/smaps_rollup"),
        None => "/proc/self/smaps_rollup".to_owned(),
    };
    let text = std::fs::read_to_string(&path)?;
    text.lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .map(|rest| parse_kib(rest) * 1024)
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{path}: no `Pss:` line"),
            )
        })
}

/// PSS of the mappings inside `[start, start + len)`, bytes (guest RAM can be split into
/// several: the memory pool maps runs of it from its memfd).
pub fn range_pss(start: u64, len: u64) -> std::io::Result<u64> {
    range_pss_of(None, start, len)
}

/// [`range_pss`] of another process (`None`: this one).
pub fn range_pss_of(pid: Option<u32>, start: u64, len: u64) -> std::io::Result<u64> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/smaps"),
        None => "/proc/self/smaps".to_owned(),
    };
    let text = std::fs::read_to_string(path)?;
    let end = start.saturating_add(len);
    let mut inside = false;
    let mut total = 0;
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
            if let Some(rest) = line.strip_prefix("Pss:") {
                total += parse_kib(rest) * 1024;
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

/// A memory cgroup the VM runs in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryCgroup {
    dir: PathBuf,
    v2: bool,
}

/// Errors joining a cgroup.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// Neither a v2 memory controller nor a v1 memory hierarchy is mounted.
    #[error("no memory cgroup controller is available (looked for cgroup v2 with `memory` and v1 at /sys/fs/cgroup/memory)")]
    NoController,
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
        let own =
            std::fs::read_to_string("/proc/self/cgroup").map_err(|source| CgroupError::Io {
                op: "read",
                path: "/proc/self/cgroup".into(),
                source,
            })?;
        let v2_root = Path::new("/sys/fs/cgroup");
        let v2_has_memory = std::fs::read_to_string(v2_root.join("cgroup.controllers"))
            .map(|c| c.split_whitespace().any(|c| c == "memory"))
            .unwrap_or(false);
        let (base, v2) = if v2_has_memory {
            let own = own
                .lines()
                .find_map(|l| l.strip_prefix("0::"))
                .unwrap_or("/");
            (v2_root.join(own.trim_start_matches('/')), true)
        } else {
            let v1_root = v2_root.join("memory");
            if !v1_root.join("memory.usage_in_bytes").exists() {
                return Err(CgroupError::NoController);
            }
            let own = own
                .lines()
                .find_map(|l| {
                    let mut parts = l.splitn(3, ':');
                    let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
                    controllers
                        .split(',')
                        .any(|c| c == "memory")
                        .then_some(path)
                })
                .unwrap_or("/");
            (v1_root.join(own.trim_start_matches('/')), false)
        };
        Ok((base, v2))
    }

    /// Creates `name` (a relative path) under this process's own memory cgroup — v2 where the
    /// host has its memory controller, else v1 — and moves this process into it. Call it
    /// before allocating guest RAM: v1 does not move charges made earlier.
    pub fn join(name: &Path) -> Result<Self, CgroupError> {
        let (base, v2) = Self::own_base()?;
        let dir = base.join(name);
        std::fs::create_dir_all(&dir).map_err(|source| CgroupError::Io {
            op: "create",
            path: dir.clone(),
            source,
        })?;
        let procs = dir.join("cgroup.procs");
        std::fs::write(&procs, std::process::id().to_string()).map_err(|source| {
            CgroupError::Io {
                op: "join",
                path: procs,
                source,
            }
        })?;
        Ok(Self { dir, v2 })
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

    /// The cgroup's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_process_pss_is_positive_and_range_pss_finds_a_mapping() {
        assert!(process_pss().unwrap() > 0);
        let data = vec![1u8; 8 << 20];
        let start = data.as_ptr() as u64;
        // The vector's mapping may start below its pointer (malloc header); look it up.
        let text = std::fs::read_to_string("/proc/self/maps").unwrap();
        let mapping = text
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
        assert!(range_pss(mapping.0, mapping.1 - mapping.0).unwrap() >= 7 << 20);
        assert_eq!(range_pss(1, 4096).unwrap(), 0);
        drop(data);
    }
}
