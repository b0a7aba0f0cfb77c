//! `pvisor-sandboxd` driven by the real OpenSandbox Python SDK (`opensandbox`, pinned to
//! [`SDK_VERSION`]), unmodified: create, commands with their output and exit codes, renew,
//! pause, resume (same digest), kill (`tests/sdk/flow.py`).
//!
//! The SDK lives in a virtual environment under the target directory
//! (`target/opensandbox-sdk-VERSION/`), made and pip-installed from the package index on the
//! first run and reused after. Without python3 or its `venv` module the test installs
//! `python3` and `python3-venv` with apt-get when it runs as root (as
//! `guest-patches/build.sh` installs its build dependencies), and otherwise says what to
//! install.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{skip, vm_pids, Daemon, KEY};

/// The SDK release the daemon is proved against (docs/sandboxd.md).
const SDK_VERSION: &str = "1.1.1";

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The target directory (the daemon's binary is in its profile directory).
fn target_dir() -> PathBuf {
    let binary = Path::new(common::binary());
    binary.parent().unwrap().parent().unwrap().to_path_buf()
}

fn has_sdk(python: &Path) -> bool {
    let check = format!(
        "import importlib.metadata as m, opensandbox; assert m.version('opensandbox') == '{SDK_VERSION}'"
    );
    Command::new(python)
        .args(["-c", &check])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `python3 -m venv DIR`; `None` if python3 does not run at all.
fn make_venv(dir: &Path) -> Option<Output> {
    Command::new("python3")
        .args(["-m", "venv"])
        .arg(dir)
        .output()
        .ok()
}

/// Installs python3 and its `venv` module (Debian's `python3-venv`) with apt-get.
fn install_python() {
    let apt = |args: &[&str]| {
        Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .output()
            .unwrap_or_else(|e| panic!("apt-get: {e}"))
    };
    let packages = ["install", "-y", "-qq", "python3", "python3-venv"];
    if !apt(&packages).status.success() {
        apt(&["update", "-qq"]);
        let install = apt(&packages);
        assert!(
            install.status.success(),
            "apt-get install python3 python3-venv: {}",
            text(&install)
        );
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// How long one run of the SDK flow may take.
const FLOW_TIMEOUT: Duration = Duration::from_secs(300);

/// Runs `command` to its end, or kills it after `within` (then the test fails).
fn output_within(command: &mut Command, within: Duration) -> Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read both pipes aside, so that a talkative child does not block on a full one.
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stdout, &mut bytes);
        bytes
    });
    let err = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stderr, &mut bytes);
        bytes
    });
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{command:?} did not end within {within:?}: {}{}",
                String::from_utf8_lossy(&out.join().unwrap()),
                String::from_utf8_lossy(&err.join().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// The virtual environment's python, with the SDK installed. Runs that share the target
/// directory (several worktrees, or test binaries at once) take turns under a lock file, so
/// that none removes the environment another is making or using.
fn sdk_python() -> PathBuf {
    let dir = target_dir().join(format!("opensandbox-sdk-{SDK_VERSION}"));
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(target_dir().join(format!("opensandbox-sdk-{SDK_VERSION}.lock")))
        .unwrap();
    // SAFETY: flock on a file we hold open; released when it closes, at the end of setup.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    let python = dir.join("bin").join("python");
    if has_sdk(&python) {
        return python;
    }
    // Half made (an interrupted run): start again.
    let _ = std::fs::remove_dir_all(&dir);
    let first = make_venv(&dir);
    if !first.as_ref().is_some_and(|out| out.status.success()) {
        let why = first.map_or_else(|| "python3 does not run".to_owned(), |o| text(&o));
        assert!(
            is_root(),
            "python3 cannot make a virtual environment ({why}): install python3 and python3-venv"
        );
        let _ = std::fs::remove_dir_all(&dir);
        install_python();
        let out = make_venv(&dir).expect("python3 runs once installed");
        assert!(out.status.success(), "python3 -m venv: {}", text(&out));
    }
    let pip = Command::new(&python)
        .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
        .arg(format!("opensandbox=={SDK_VERSION}"))
        .output()
        .unwrap();
    assert!(
        pip.status.success(),
        "pip install opensandbox=={SDK_VERSION}: {}",
        text(&pip)
    );
    assert!(
        has_sdk(&python),
        "the SDK does not import after pip install"
    );
    python
}

#[test]
fn sdk_creates_runs_pauses_resumes_and_kills_a_sandbox() {
    if skip() {
        return;
    }
    let python = sdk_python();
    let daemon = Daemon::start(&[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/flow.py");
    let out = output_within(
        Command::new(&python)
            .arg(&script)
            .arg(&daemon.addr)
            .env("OPEN_SANDBOX_API_KEY", KEY)
            .env_remove("OPEN_SANDBOX_DOMAIN"),
        FLOW_TIMEOUT,
    );
    assert!(
        out.status.success(),
        "the SDK flow failed: {}\n--- daemon log ---\n{}",
        text(&out),
        daemon.log()
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let seen: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(seen["killed"], true, "{seen}");
    assert_eq!(seen["digest"], seen["digest_after_resume"], "{seen}");
    // Killed: no sandbox, no VM left.
    let list = daemon.api("GET", "/v1/sandboxes", None).json();
    assert_eq!(list["pagination"]["totalItems"], 0, "{list}");
    assert!(vm_pids(&daemon.state()).is_empty());
    // The wrong key fails the SDK as it should.
    let out = output_within(
        Command::new(&python)
            .arg(&script)
            .arg(&daemon.addr)
            .env("OPEN_SANDBOX_API_KEY", "wrong")
            .env_remove("OPEN_SANDBOX_DOMAIN"),
        FLOW_TIMEOUT,
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("401") || text(&out).to_lowercase().contains("unauthorized"),
        "{}",
        text(&out)
    );
}
