//! What the `pvisor` end-to-end tests share: the device check, running the binary with a
//! runtime directory of the test's own, and a cgroup parent that is removed afterwards.

// Each test file uses a part of it; test code stops on a failed setup step.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// True (and says why) if /dev/kvm or /dev/userfaultfd is missing and device tests are skipped.
pub fn skip() -> bool {
    testkit::skip_unless(&["/dev/kvm", "/dev/userfaultfd"])
}

/// Runs `pvisor` with its runtime directory in `runtime`.
pub fn pvisor(runtime: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pvisor"))
        .args(args)
        .env("PVISOR_RUNTIME_DIR", runtime)
        .output()
        .unwrap()
}

/// Output bytes as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A cgroup parent of this test's own, under pvisor's memory cgroup; removed on drop with
/// whatever is left under it.
pub struct CgroupParent {
    /// Its name, relative to pvisor's cgroup (what `--cgroup-parent` takes).
    pub name: String,
    dir: PathBuf,
}

impl CgroupParent {
    /// `test-TAG-PID` under pvisor's own memory cgroup (not created here).
    pub fn new(tag: &str) -> Self {
        let (base, _) = vmm::stats::MemoryCgroup::own_base().unwrap();
        let name = format!("test-{tag}-{}", std::process::id());
        let dir = base.join(&name);
        Self { name, dir }
    }

    /// Whether it is there (a replay removes it when it made it).
    pub fn exists(&self) -> bool {
        self.dir.exists()
    }

    /// What is left under it (cgroup directories of the replay or its VMs).
    pub fn left(&self) -> Vec<PathBuf> {
        let mut left = Vec::new();
        let mut todo = vec![self.dir.clone()];
        while let Some(dir) = todo.pop() {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    left.push(entry.path());
                    todo.push(entry.path());
                }
            }
        }
        left
    }
}

impl Drop for CgroupParent {
    fn drop(&mut self) {
        let mut left = self.left();
        left.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for dir in left {
            let _ = std::fs::remove_dir(dir);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
