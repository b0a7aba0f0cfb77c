//! `pvisor replay` against bad input and on every way it can end: numbers a trajectory or an
//! option cannot mean are refused before anything starts (never a panic), and whether the
//! replay ends, fails or is stopped by a signal, no VM process and no cgroup of it remain.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{alive, pvisor, skip, text, CgroupParent};

fn write_trajectory(dir: &Path, steps: &str) -> PathBuf {
    let path = dir.join("trajectory.json");
    std::fs::write(&path, format!(r#"{{"name": "t", "steps": [{steps}]}}"#)).unwrap();
    path
}

#[test]
fn replay_trajectory_with_a_huge_wait_is_refused_naming_step_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_trajectory(
        dir.path(),
        r#"{"tool": {"script": "digest"}}, {"model": {"wait_ms": 1e300, "answer_bytes": 8}}"#,
    );
    let out = pvisor(dir.path(), &["replay", path.to_str().unwrap()]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("step 2 (model): wait_ms 1e300"), "{stderr}");
}

#[test]
fn replay_bad_numeric_options_are_refused_before_any_vm_starts() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = write_trajectory(
        dir.path(),
        r#"{"model": {"wait_ms": 1, "answer_bytes": 8}}"#,
    );
    let cgroups = CgroupParent::new("options");
    for (option, value) in [
        ("--vms", "0"),
        ("--vms", "65"),
        ("--memory", "0"),
        ("--memory", "3MiB"),
        ("--memory", "5GiB"),
        ("--memory", "7MiB"),
        ("--memory", "lots"),
        ("--sample-ms", "0"),
        ("--sample-ms", "100000000000"),
        ("--stagger-ms", "600001"),
    ] {
        let out = pvisor(
            dir.path(),
            &[
                "replay",
                path.to_str().unwrap(),
                "--cgroup-parent",
                &cgroups.name,
                option,
                value,
            ],
        );
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{option} {value}");
        assert!(!stderr.contains("panicked"), "{option} {value}: {stderr}");
        assert!(
            stderr.contains(&format!("{option} {value}")),
            "{option} {value}: {stderr}"
        );
        assert!(
            !stderr.contains("did not start"),
            "{option} {value}: a VM was started: {stderr}"
        );
        assert_eq!(cgroups.left(), Vec::<PathBuf>::new(), "{option} {value}");
    }
}

#[test]
fn replay_vm_that_fails_to_start_leaves_no_cgroup() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = write_trajectory(
        dir.path(),
        r#"{"model": {"wait_ms": 1, "answer_bytes": 8}}"#,
    );
    // The VM joins its cgroup, then cannot create its disk.
    let config = dir.path().join("vm.toml");
    std::fs::write(&config, "[vm]\ndisk = \"/nonexistent/dir/disk\"\n").unwrap();
    let cgroups = CgroupParent::new("failed-start");
    let out = pvisor(
        dir.path(),
        &[
            "replay",
            path.to_str().unwrap(),
            "--vms",
            "2",
            "--memory",
            "32MiB",
            "--cgroup-parent",
            &cgroups.name,
            "--vm-config",
            config.to_str().unwrap(),
        ],
    );
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("did not start"), "{stderr}");
    assert_eq!(cgroups.left(), Vec::<PathBuf>::new(), "{stderr}");
}

/// Kills what is left of a failed test's VMs (on drop).
struct KillLeft(Vec<u32>);

impl Drop for KillLeft {
    fn drop(&mut self) {
        for &pid in &self.0 {
            if alive(pid) {
                // SAFETY: kill(2) on a VM process this test started.
                unsafe { libc::kill(libc::pid_t::try_from(pid).unwrap_or(0), libc::SIGKILL) };
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The pids of the replay's VMs, once `count` of them have written their identities.
fn wait_for_vms(runtime: &Path, count: usize) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pids: Vec<u32> = std::fs::read_dir(runtime)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|job| std::fs::read_to_string(job.path().join("vm.json")).ok())
            .filter_map(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
            .filter_map(|identity| identity["pid"].as_u64())
            .map(|pid| u32::try_from(pid).unwrap())
            .collect();
        if pids.len() >= count {
            return pids;
        }
        assert!(Instant::now() < deadline, "the VMs did not start: {pids:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn replay_stopped_by_a_signal_stops_its_vms_and_removes_their_cgroups() {
    if skip() {
        return;
    }
    for (signal, vms) in [(libc::SIGTERM, 2), (libc::SIGINT, 1)] {
        let dir = tempfile::tempdir().unwrap();
        let runtime = dir.path().join("runtime");
        std::fs::create_dir(&runtime).unwrap();
        // A minute's model wait: the signal comes in the middle of it.
        let path = write_trajectory(
            dir.path(),
            r#"{"tool": {"script": "fill 4MiB random seed=1"}},
               {"model": {"wait_ms": 60000, "answer_bytes": 8}}"#,
        );
        // Declared first, dropped last: after the VMs are killed.
        let cgroups = CgroupParent::new(&format!("signal-{signal}"));
        let mut replay = Command::new(env!("CARGO_BIN_EXE_pvisor"))
            .args(["replay", path.to_str().unwrap(), "--memory", "32MiB"])
            .args(["--vms", &vms.to_string(), "--cgroup-parent", &cgroups.name])
            .env("PVISOR_RUNTIME_DIR", &runtime)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let pids = wait_for_vms(&runtime, vms);
        let _left = KillLeft(pids.clone());
        assert_eq!(cgroups.left().len(), vms + 1, "{:?}", cgroups.left());
        // Into the model wait.
        std::thread::sleep(Duration::from_millis(1500));
        let started = Instant::now();
        // SAFETY: kill(2) on our own child.
        let rc = unsafe { libc::kill(libc::pid_t::try_from(replay.id()).unwrap(), signal) };
        assert_eq!(rc, 0);
        let status = loop {
            if let Some(status) = replay.try_wait().unwrap() {
                break status;
            }
            assert!(
                started.elapsed() < Duration::from_secs(45),
                "the replay did not end"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        eprintln!(
            "signal {signal}: the replay ended ({status}) {:.2} s later",
            started.elapsed().as_secs_f64()
        );
        assert_eq!(status.code(), Some(128 + signal), "{status}");
        let running: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        assert!(running.is_empty(), "VM processes left: {running:?}");
        assert_eq!(cgroups.left(), Vec::<PathBuf>::new());
    }
}

/// A replay of 2 VMs of 64 MiB that fill 48 MiB each, under `budget`, with its summary.
/// `dir` is its runtime directory.
fn replay_under_budget(
    dir: &Path,
    tag: &str,
    budget: &str,
) -> (Output, serde_json::Value, Vec<PathBuf>) {
    let path = write_trajectory(
        dir,
        r#"{"model": {"wait_ms": 1, "answer_bytes": 8}},
           {"tool": {"script": "fill 48MiB random seed=1; digest"}},
           {"model": {"wait_ms": 1, "answer_bytes": 8}}"#,
    );
    let cgroups = CgroupParent::new(tag);
    let out = pvisor(
        dir,
        &[
            "replay",
            path.to_str().unwrap(),
            "--vms",
            "2",
            "--memory",
            "64MiB",
            "--strategy",
            "off",
            "--memory-budget",
            budget,
            "--cgroup-parent",
            &cgroups.name,
            "--json",
        ],
    );
    let stdout = text(&out.stdout);
    let summary = serde_json::from_str(stdout.lines().last().unwrap_or("null")).unwrap();
    let left = cgroups.left();
    (out, summary, left)
}

#[test]
fn replay_over_its_memory_budget_reports_the_oom_killed_vms_by_name() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (out, summary, left) = replay_under_budget(dir.path(), "budget-small", "64MiB");
    let stdout = text(&out.stdout);
    let all = format!("{stdout}{}", text(&out.stderr));
    assert!(!out.status.success(), "{all}");
    assert_eq!(summary["memory_budget_bytes"], 64 << 20, "{all}");
    let killed = summary["oom_killed"].as_array().unwrap();
    assert!(!killed.is_empty(), "{all}");
    for vm in killed {
        let job = vm["job"].as_str().unwrap();
        assert!(vm["oom_kill"].as_u64().unwrap() >= 1, "{all}");
        assert!(
            stdout.contains(&format!(
                "({job}): killed by the kernel's OOM killer (oom_kill"
            )),
            "{all}"
        );
        // The detached VM's own status says it too.
        let status = pvisor(dir.path(), &["status", job]);
        let status = text(&status.stdout);
        assert!(
            status.contains(
                "killed by the kernel's OOM killer (oom_kill 1): memory budget 64 MiB reached"
            ),
            "{status}"
        );
    }
    assert!(stdout.contains("memory budget 64 MiB reached"), "{all}");
    assert!(!all.contains("not a reply"), "{all}");
    assert_eq!(left, Vec::<PathBuf>::new(), "{all}");
}

#[test]
fn replay_within_its_memory_budget_passes() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (out, summary, left) = replay_under_budget(dir.path(), "budget-large", "1GiB");
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{all}");
    assert_eq!(summary["oom_kills"], 0, "{all}");
    assert_eq!(summary["integrity_passed"], true, "{all}");
    assert_eq!(left, Vec::<PathBuf>::new(), "{all}");
}

#[test]
fn replay_staggered_starts_each_vm_later_and_reports_its_own_task_time() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = write_trajectory(
        dir.path(),
        r#"{"tool": {"script": "fill 4MiB random seed=1; digest"}},
           {"model": {"wait_ms": 300, "answer_bytes": 8}}"#,
    );
    let cgroups = CgroupParent::new("stagger");
    let out = pvisor(
        dir.path(),
        &[
            "replay",
            path.to_str().unwrap(),
            "--vms",
            "3",
            "--memory",
            "64MiB",
            "--strategy",
            "offload",
            "--stagger-ms",
            "1000",
            "--cgroup-parent",
            &cgroups.name,
            "--json",
        ],
    );
    let stdout = text(&out.stdout);
    let all = format!("{stdout}{}", text(&out.stderr));
    assert!(out.status.success(), "{all}");
    let summary: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(summary["integrity_passed"], true, "{all}");
    assert_eq!(summary["stagger_ms"], 1000, "{all}");
    let numbers = |key: &str| -> Vec<f64> {
        summary[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    let (starts, ends, tasks) = (
        numbers("start_s"),
        numbers("completion_s"),
        numbers("task_s"),
    );
    for i in 0..3 {
        // VM i starts i s after the release (give or take a scheduling delay) and its task
        // time is its end less its start; each takes at least its 300 ms wait.
        let i_s = i as f64;
        assert!(starts[i] >= i_s && starts[i] < i_s + 0.5, "{all}");
        assert!((ends[i] - starts[i] - tasks[i]).abs() < 1e-6, "{all}");
        assert!(tasks[i] >= 0.3, "{all}");
    }
    let longest = summary["longest_task_s"].as_f64().unwrap();
    let window = summary["completion_window_s"].as_f64().unwrap();
    assert!(longest + 1.5 < window, "{all}");
    assert_eq!(cgroups.left(), Vec::<PathBuf>::new(), "{all}");
    // The --cgroup-parent the replay made goes with it.
    assert!(!cgroups.exists(), "{all}");
}

#[test]
fn replay_memory_budget_of_zero_or_nonsense_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_trajectory(
        dir.path(),
        r#"{"model": {"wait_ms": 1, "answer_bytes": 8}}"#,
    );
    for (budget, expected) in [
        ("0", "must be more than 0"),
        ("lots", "--memory-budget lots"),
    ] {
        let out = pvisor(
            dir.path(),
            &["replay", path.to_str().unwrap(), "--memory-budget", budget],
        );
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{budget}: {stderr}");
        assert!(stderr.contains(expected), "{budget}: {stderr}");
    }
}
