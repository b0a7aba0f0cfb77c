//! CPU time of one VM's pager threads, read from `/proc/self/task/TID/schedstat` (time on a
//! CPU, ns), or from `stat` (utime + stime, clock ticks) where the kernel has no schedstat.
//!
//! The pager names its threads: `uffd-fault-N` serve faults (MISSING on first touch, MINOR
//! after a probe zapped a block's entries, and the decompression of pooled blocks), `uffd-cold`
//! is the cold-compression scanner (probes, compression, hole punching). A VM's threads are the
//! ones of those names born after the moment `Threads::before` was taken.

use std::fs;
use std::path::Path;

use crate::common::host::task_cpu_seconds;

/// Thread ids alive now.
fn tids() -> Vec<u64> {
    let Ok(tasks) = fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| t.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// The threads born with one VM; which of them are the pager's is read from their names
/// each time (a new thread names itself only once it runs).
#[derive(Debug, Clone, Default)]
pub struct Threads {
    tids: Vec<u64>,
}

/// What a thread of the VM is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Scanner,
    Faults,
    Other,
}

fn role(tid: u64) -> Role {
    let comm = fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap_or_default();
    match comm.trim() {
        "uffd-cold" => Role::Scanner,
        name if name.starts_with("uffd-fault-") => Role::Faults,
        _ => Role::Other,
    }
}

/// CPU seconds of a VM's pager threads at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub struct PagerCpu {
    /// `uffd-cold`.
    pub scanner_s: f64,
    /// Every `uffd-fault-N`.
    pub faults_s: f64,
}

impl PagerCpu {
    pub fn total_s(self) -> f64 {
        self.scanner_s + self.faults_s
    }

    /// `self - earlier`, field by field.
    pub fn since(self, earlier: PagerCpu) -> PagerCpu {
        PagerCpu {
            scanner_s: self.scanner_s - earlier.scanner_s,
            faults_s: self.faults_s - earlier.faults_s,
        }
    }
}

impl Threads {
    /// The threads alive now: pass to `born_since` after the VM started.
    pub fn before() -> Vec<u64> {
        tids()
    }

    /// The threads that are alive now and were not in `before`.
    pub fn born_since(before: &[u64]) -> Self {
        Self {
            tids: tids().into_iter().filter(|t| !before.contains(t)).collect(),
        }
    }

    /// Whether a fault thread is among them (waits up to a second for the threads to name
    /// themselves): the bench's CPU figures would be wrong otherwise.
    pub fn found(&self) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        loop {
            if self.tids.iter().any(|&t| role(t) == Role::Faults) {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Their CPU time so far (all of it: they were born with the VM).
    pub fn cpu(&self) -> PagerCpu {
        let mut cpu = PagerCpu::default();
        for &tid in &self.tids {
            let dir = format!("/proc/self/task/{tid}");
            let seconds = || task_cpu_seconds(Path::new(&dir)).unwrap_or(0.0);
            match role(tid) {
                Role::Scanner => cpu.scanner_s += seconds(),
                Role::Faults => cpu.faults_s += seconds(),
                Role::Other => {}
            }
        }
        cpu
    }
}
