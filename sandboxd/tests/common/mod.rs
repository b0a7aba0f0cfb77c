//! What the daemon's end-to-end tests share: the device check, the real `pvisor-sandboxd`
//! started on a free port with a state directory of the test's own (its VMs stopped on
//! drop), and a small HTTP/1.1 client that reads whole answers (chunked or not).

// Each test file uses a part of it; test code stops on a failed setup step.
#![allow(dead_code, clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::Value;
// (Each test file uses some of them.)
#[allow(unused_imports)]
pub use testkit::http::{events, request, send_raw, Answer};

/// The test API key.
pub const KEY: &str = "test-key-5f2c9a";

/// True (and says why) if /dev/kvm or /dev/userfaultfd is missing and device tests are skipped.
pub fn skip() -> bool {
    testkit::skip_unless(&["/dev/kvm", "/dev/userfaultfd"])
}

/// The daemon's binary.
pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_pvisor-sandboxd")
}

/// Starts the daemon on loopback without auth, with a 1 GiB budget, the state directory
/// `state`, `extra` arguments and `env` in its environment, where it must refuse to start: what
/// it said on stderr.
pub fn refusal(state: &Path, extra: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(binary())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--no-auth",
            "--memory-budget",
            "1GiB",
        ])
        .arg("--state")
        .arg(state)
        .args(extra)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "started with {extra:?}: {stderr}");
    stderr
}

/// A running daemon, stopped on drop (SIGTERM), with every VM it left killed.
pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub addr: String,
    args: Vec<String>,
    /// The daemon's environment beyond the test's.
    env: Vec<(String, String)>,
    child: Child,
    /// The child was waited for (its pid may be another process's now).
    ended: bool,
}

/// Starts the daemon with `args`; it and its address once it says it listens.
fn spawn(dir: &Path, args: &[String], env: &[(String, String)]) -> (Child, String) {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("daemon.log"))
        .unwrap();
    testkit::http::spawn_listening(
        Command::new(binary())
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stderr(log),
        &dir.join("daemon.log"),
    )
    .unwrap_or_else(|why| panic!("{why}"))
}

impl Daemon {
    /// Starts the daemon with an API key and a 4 GiB budget, plus `extra` arguments.
    pub fn start(extra: &[&str]) -> Daemon {
        Self::start_env(extra, &[])
    }

    /// The same, with `env` set in the daemon's environment (and so its VMs').
    pub fn start_env(extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, format!("{KEY}\n")).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut args = vec![
            "--listen".to_owned(),
            "127.0.0.1:0".into(),
            "--state".into(),
            dir.path().join("state").display().to_string(),
            "--memory-budget".into(),
            "4GiB".into(),
            "--api-key-file".into(),
            key.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let (child, addr) = spawn(dir.path(), &args, &env);
        Daemon {
            dir,
            addr,
            args,
            env,
            child,
            ended: false,
        }
    }

    /// Kills the daemon (`-9`, its VMs left running) and starts it again on the same state
    /// directory (on a new port).
    pub fn restart(&mut self) {
        self.kill();
        self.respawn();
    }

    /// Kills the daemon (`-9`, its VMs left running).
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        self.ended = true;
    }

    /// Starts the killed daemon again on the same state directory (on a new port).
    pub fn respawn(&mut self) {
        assert!(self.ended, "the daemon runs");
        let (child, addr) = spawn(self.dir.path(), &self.args, &self.env);
        self.child = child;
        self.addr = addr;
        self.ended = false;
    }

    /// Starts the killed daemon again, with `extra` arguments after its first ones (the
    /// last of a flag given twice counts).
    pub fn respawn_with(&mut self, extra: &[&str]) {
        self.args.extend(extra.iter().map(|s| (*s).to_owned()));
        self.respawn();
    }

    /// Stops the daemon with SIGTERM and waits (at most `within`) for it to exit; its exit
    /// status, `None` if it did not exit in time (then it is killed).
    pub fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        // SAFETY: a signal to our own child, not waited for yet.
        unsafe {
            libc::kill(
                libc::pid_t::try_from(self.child.id()).unwrap(),
                libc::SIGTERM,
            )
        };
        let deadline = Instant::now() + within;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        self.ended = true;
        status
    }

    /// The VM process of sandbox `id` (from its identity file).
    pub fn vm_pid(&self, id: &str) -> u32 {
        let path = self.state().join("vms").join(id).join("vm.json");
        let identity: Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        u32::try_from(identity["pid"].as_u64().unwrap()).unwrap()
    }

    /// Waits (at most `within`) for every process of `pids` to be gone.
    pub fn wait_gone(&self, pids: &[u32], within: Duration) {
        let deadline = Instant::now() + within;
        while pids.iter().any(|&p| alive(p)) {
            assert!(
                Instant::now() < deadline,
                "processes left: {pids:?}; {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts `command` in sandbox `id` and returns its stream once its `init` event came:
    /// the command runs while the stream is held, and goes on if it is dropped.
    pub fn open_command(&self, id: &str, command: &str) -> std::net::TcpStream {
        use std::io::{Read, Write};
        let (path, token) = self.execd(id);
        let body = serde_json::json!({ "command": command }).to_string();
        let raw = testkit::http::raw_request(
            &self.addr,
            "POST",
            &format!("{path}/command"),
            &[("X-Pvisor-Sandbox-Token", &token)],
            Some(&body),
        );
        let mut stream = std::net::TcpStream::connect(&self.addr).unwrap();
        stream.write_all(&raw).unwrap();
        // Up to the `init` event, which the daemon sends as it hands the command to the VM:
        // the answer's head alone comes before, and a command sent next could reach the VM
        // first.
        let mut seen = Vec::new();
        let mut buf = [0u8; 512];
        while !String::from_utf8_lossy(&seen).contains("init") {
            let n = stream.read(&mut buf).unwrap();
            assert!(n > 0, "{}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buf[..n]);
        }
        assert!(
            String::from_utf8_lossy(&seen).contains("200 OK"),
            "{}",
            String::from_utf8_lossy(&seen)
        );
        stream
    }

    /// The state directory.
    pub fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// A request with the API key.
    pub fn api(&self, method: &str, path: &str, body: Option<&str>) -> Answer {
        request(
            &self.addr,
            method,
            path,
            &[("OPEN-SANDBOX-API-KEY", KEY)],
            body,
        )
    }

    /// Creates a sandbox of the workload guest; its id.
    pub fn create(&self, extra: &str) -> String {
        let body = format!(
            r#"{{"image":{{"uri":"pvisor:workload"}},"entrypoint":["tail","-f","/dev/null"]{extra}}}"#
        );
        let answer = self.api("POST", "/v1/sandboxes", Some(&body));
        assert_eq!(answer.status, 202, "{}", answer.text());
        answer.json()["id"].as_str().unwrap().to_owned()
    }

    /// The execd endpoint of `id`: its path on this daemon and its token.
    pub fn execd(&self, id: &str) -> (String, String) {
        let answer = self.api("GET", &format!("/v1/sandboxes/{id}/endpoints/44772"), None);
        assert_eq!(answer.status, 200, "{}", answer.text());
        let body = answer.json();
        let endpoint = body["endpoint"].as_str().unwrap();
        let path = endpoint
            .strip_prefix(&self.addr)
            .unwrap_or_else(|| panic!("{endpoint} is not on {}", self.addr))
            .to_owned();
        let token = body["headers"]["X-Pvisor-Sandbox-Token"]
            .as_str()
            .unwrap()
            .to_owned();
        (path, token)
    }

    /// Polls execd's ping until it answers 200 (at most 30 s, as the SDK does).
    pub fn wait_ready(&self, id: &str) {
        let (path, token) = self.execd(id);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let answer = request(
                &self.addr,
                "GET",
                &format!("{path}/ping"),
                &[("X-Pvisor-Sandbox-Token", &token)],
                None,
            );
            if answer.status == 200 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "not ready: {} {}; {}",
                answer.status,
                answer.text(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Runs `command` in `id`; its events.
    pub fn command(&self, id: &str, command: &str) -> Vec<Value> {
        let (path, token) = self.execd(id);
        let body = serde_json::json!({ "command": command }).to_string();
        let answer = request(
            &self.addr,
            "POST",
            &format!("{path}/command"),
            &[("X-Pvisor-Sandbox-Token", &token)],
            Some(&body),
        );
        assert_eq!(answer.status, 200, "{}", answer.text());
        assert_eq!(
            answer.header("content-type").as_deref(),
            Some("text/event-stream")
        );
        events(&answer.text())
    }
}

/// The `stdout` texts and the exit code (from `error`, or 0 on `execution_complete`) of a
/// command's events.
pub fn outcome(events: &[Value]) -> (Vec<Value>, i64) {
    let stdout = events
        .iter()
        .filter(|e| e["type"] == "stdout")
        .map(|e| serde_json::from_str(e["text"].as_str().unwrap().trim_end()).unwrap())
        .collect();
    let last = events.last().unwrap();
    let code = match last["type"].as_str() {
        Some("execution_complete") => 0,
        Some("error") => last["error"]["evalue"].as_str().unwrap().parse().unwrap(),
        other => panic!("the stream ended with {other:?}: {events:?}"),
    };
    (stdout, code)
}

/// What a command's events said on stderr, joined.
pub fn stderr_of(events: &[Value]) -> String {
    events
        .iter()
        .filter(|e| e["type"] == "stderr")
        .filter_map(|e| e["text"].as_str())
        .collect()
}

/// The VM processes and supervisors (pids) the daemon's sandboxes have now.
pub fn vm_pids(state: &Path) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir(state.join("vms"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(text) = std::fs::read_to_string(entry.path().join("vm.json")) {
            let identity: Value = serde_json::from_str(&text).unwrap();
            pids.extend(identity["pid"].as_u64().map(|p| p as u32));
            pids.extend(identity["supervisor"].as_u64().map(|p| p as u32));
        }
    }
    pids
}

/// The VM processes and supervisors running for the state directory `state`, found in
/// `/proc` by their command and runtime directory.
pub fn processes_of(state: &Path) -> Vec<u32> {
    let runtime = format!("PVISOR_RUNTIME_DIR={}", state.join("vms").display());
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        let ours = args.first() == Some(&binary().as_bytes())
            && args
                .get(1)
                .is_some_and(|a| *a == b"__vm" || *a == b"__supervise");
        let here = std::fs::read(format!("/proc/{pid}/environ"))
            .is_ok_and(|env| env.split(|&b| b == 0).any(|var| var == runtime.as_bytes()));
        if ours && here && alive(pid) {
            pids.push(pid);
        }
    }
    pids
}

/// Whether process `pid` runs (exists and is not a zombie).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
    })
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if !self.ended {
            self.terminate(Duration::from_secs(60));
        }
        // The daemon stops its VMs; any it left (a failed test) go with it, even those
        // whose job directory is gone.
        let mut pids = vm_pids(&self.state());
        pids.extend(processes_of(&self.state()));
        for &pid in &pids {
            // SAFETY: a signal to a VM process this test's daemon started.
            unsafe { libc::kill(libc::pid_t::try_from(pid).unwrap(), libc::SIGKILL) };
        }
        remove_budget_cgroup(&self.state(), &pids);
    }
}

/// Removes the memory cgroup the daemon of `state` kept its VMs under (the daemon leaves it
/// while VMs run), once the processes `pids` are gone: the VMs' own cgroups, then it.
fn remove_budget_cgroup(state: &Path, pids: &[u32]) {
    let Ok(name) = std::fs::read_to_string(state.join("budget-cgroup")) else {
        return;
    };
    // The daemon made it under its own memory cgroup, which is this process's.
    let Ok((base, _)) = vmm::stats::MemoryCgroup::own_base() else {
        return;
    };
    let dir = base.join(name.trim());
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    loop {
        for child in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if child.path().is_dir() {
                let _ = std::fs::remove_dir(child.path());
            }
        }
        if std::fs::remove_dir(&dir).is_ok() || !dir.exists() || Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
