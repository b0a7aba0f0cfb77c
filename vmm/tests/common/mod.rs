//! What the `pvisor` end-to-end tests share: the device check, running the binary with a
//! runtime directory of the test's own, a detached VM driven through the CLI, and a cgroup
//! parent that is removed afterwards.

// Each test file uses a part of it; test code stops on a failed setup step.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

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

/// Whether process `pid` runs (exists and is not a zombie).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
    })
}

/// Output bytes as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs and expects success; returns stdout's JSON lines.
pub fn ok(runtime: &Path, args: &[&str]) -> Vec<Value> {
    let out = pvisor(runtime, args);
    assert!(
        out.status.success(),
        "pvisor {args:?} failed: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

/// Runs and expects failure; returns stderr.
pub fn fails(runtime: &Path, args: &[&str]) -> String {
    let out = pvisor(runtime, args);
    assert!(
        !out.status.success(),
        "pvisor {args:?} should fail: {}",
        text(&out.stdout)
    );
    text(&out.stderr)
}

/// `pvisor run` of a detached 512 MiB VM, before its own options.
pub const RUN_DETACHED: [&str; 6] = ["run", "--executor", "vm", "--memory", "512MiB", "--detach"];

/// A detached VM, stopped on drop.
pub struct Detached {
    /// The runtime directory it was started with.
    pub runtime: std::path::PathBuf,
    /// The identity line `run --detach` printed.
    pub identity: Value,
}

impl Detached {
    pub fn start(runtime: &Path, extra: &[&str], script: &str) -> Self {
        let mut args = RUN_DETACHED.to_vec();
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", script]);
        let lines = ok(runtime, &args);
        let identity = lines[0].clone();
        for key in ["job", "socket", "attempt", "pid"] {
            assert!(identity.get(key).is_some(), "{identity}");
        }
        Self {
            runtime: runtime.to_path_buf(),
            identity,
        }
    }

    pub fn job(&self) -> &str {
        self.identity["job"].as_str().unwrap()
    }

    pub fn long_form(&self) -> Vec<String> {
        vec![
            self.job().to_owned(),
            "--vm-socket".into(),
            self.identity["socket"].as_str().unwrap().to_owned(),
            "--vm-job-id".into(),
            self.job().to_owned(),
            "--vm-attempt-id".into(),
            self.identity["attempt"].as_str().unwrap().to_owned(),
        ]
    }

    pub fn call(&self, command: &str, extra: &[&str]) -> Value {
        let mut args = vec![command, self.job()];
        args.extend_from_slice(extra);
        ok(&self.runtime, &args).remove(0)
    }

    pub fn call_fails(&self, command: &str, extra: &[&str]) -> String {
        let mut args = vec![command, self.job()];
        args.extend_from_slice(extra);
        fails(&self.runtime, &args)
    }

    pub fn exec(&self, script: &str) -> Vec<Value> {
        let value = self.call("exec", &["--", script]);
        value["results"].as_array().unwrap().clone()
    }

    pub fn digest(&self) -> String {
        self.exec("digest")[0]["digest"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    pub fn stats(&self) -> Value {
        self.call("stats", &[])
    }

    /// Polls `stats` until `done` holds for them (their last reading), failing at `deadline`.
    pub fn stats_until(
        &self,
        deadline: std::time::Instant,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        loop {
            let stats = self.stats();
            if done(&stats) {
                return stats;
            }
            assert!(std::time::Instant::now() < deadline, "{stats}");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

impl Drop for Detached {
    fn drop(&mut self) {
        let _ = pvisor(&self.runtime, &["stop", self.job()]);
    }
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
