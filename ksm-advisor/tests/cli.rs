//! `ksm-advisor` end to end on the real KSM of this kernel: advice kept across exec, tuning
//! held for a process and the host's settings restored after it, status and estimates.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn skip() -> bool {
    testkit::skip_unless(&["/sys/kernel/mm/ksm/run"])
}

fn advisor(state: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ksm-advisor"))
        .arg("--state-dir")
        .arg(state)
        .args(args)
        .output()
        .unwrap()
}

fn json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn knob(name: &str) -> String {
    std::fs::read_to_string(Path::new("/sys/kernel/mm/ksm").join(name))
        .unwrap()
        .trim()
        .to_owned()
}

#[test]
fn cli_advise_runs_a_program_whose_memory_is_all_mergeable() {
    if skip() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ksm-advisor"))
        .args(["advise", "--", "sleep", "30"])
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    // The advice survives exec: the sleeping program's private memory is marked.
    let deadline = Instant::now() + Duration::from_secs(10);
    let report = loop {
        let out = advisor(state.path(), &["--json", "advise", "--pid", &pid]);
        if out.status.success() {
            let report = json(&out);
            if report["ksm"]["merge_any"] == true {
                break report;
            }
        }
        assert!(Instant::now() < deadline, "the advice never showed");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(report["advised_bytes"].as_u64().unwrap() > 0, "{report}");
    let status = json(&advisor(state.path(), &["--json", "status", "--pid", &pid]));
    assert!(status["processes"][0]["advised_bytes"].as_u64().unwrap() > 0);
    let estimate = json(&advisor(
        state.path(),
        &["--json", "estimate", "--pid", &pid, "--rate", "1"],
    ));
    assert!(
        estimate["resident_pages"].as_u64().unwrap() > 0,
        "{estimate}"
    );
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn cli_tune_holds_for_a_process_and_restores_after_it() {
    if skip() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let before: Vec<String> = ["run", "pages_to_scan", "sleep_millisecs"]
        .iter()
        .map(|k| knob(k))
        .collect();
    let mut watched = Command::new("sleep").arg("2").spawn().unwrap();
    let tune = Command::new(env!("CARGO_BIN_EXE_ksm-advisor"))
        .arg("--state-dir")
        .arg(state.path())
        .args([
            "tune",
            "--cpu-budget",
            "0.5",
            "--until-exit",
            &watched.id().to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while knob("run") != "1" {
        assert!(Instant::now() < deadline, "KSM was not started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = json(&advisor(state.path(), &["--json", "status"]));
    assert_eq!(status["holders"].as_array().unwrap().len(), 1, "{status}");
    // A restore while it is held needs --force.
    let refused = advisor(state.path(), &["tune", "--restore"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--force"));
    watched.wait().unwrap();
    let out = tune.wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("restored"));
    let after: Vec<String> = ["run", "pages_to_scan", "sleep_millisecs"]
        .iter()
        .map(|k| knob(k))
        .collect();
    assert_eq!(after, before);
}

#[test]
fn cli_bad_input_gets_clear_messages() {
    if skip() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let out = advisor(state.path(), &["tune", "--cpu-budget", "3"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--cpu-budget"));
    let out = advisor(state.path(), &["advise"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("program"));
    let out = advisor(state.path(), &["status", "--pid", "999999999"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/proc/999999999"));
}

#[test]
fn cli_output_to_a_closed_pipe_ends_quietly() {
    if skip() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    for args in [&["status"][..], &["--json", "status"]] {
        // `ksm-advisor status | head` where `head` is gone before anything is written.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_ksm-advisor"))
            .arg("--state-dir")
            .arg(state.path())
            .args(args)
            .stdout(writer)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
        // What a shell shows for a process that SIGPIPE ended.
        assert_eq!(out.status.code(), Some(141), "{args:?}: {stderr}");
    }
}
