//! One run: the daemon started in a mode, the sandboxes driven through its API by one thread
//! each, the budget cgroup sampled, and what came of it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;
use testkit::http::{self, Answer};

use crate::common::Res;
use crate::{Mode, Settings};

/// How long a create waits for room before the daemon refuses it.
const ADMISSION_TIMEOUT: &str = "60s";
/// How often the budget cgroup's usage is read.
const SAMPLE: Duration = Duration::from_millis(250);
/// The first output of a command: the `stdout` event.
const FIRST_OUTPUT: &[u8] = b"\"type\":\"stdout\"";
const TOKEN_HEADER: &str = "X-Pvisor-Sandbox-Token";
/// The name the template layout's snapshot is served under.
const TEMPLATE: &str = "base";

/// What one sandbox's client saw.
#[derive(Debug, Default)]
struct Sandbox {
    admitted: bool,
    /// Every iteration ran and found its working set intact.
    completed: bool,
    /// What went wrong, if something did.
    problem: Option<String>,
    create_ms: f64,
    ready_ms: f64,
    first_output_ms: Vec<f64>,
    pause_ms: Option<f64>,
    resume_ms: Option<f64>,
    /// From its admission to its delete, seconds since the run began.
    live: (f64, f64),
}

/// What came of one run.
#[derive(Debug)]
pub struct Outcome {
    pub sandboxes: usize,
    pub admitted: usize,
    pub completed: usize,
    /// The most sandboxes live at once of those held to the end.
    pub held_at_once: usize,
    pub problems: Vec<String>,
    pub oom_kills: u64,
    pub create_ms: Vec<f64>,
    pub ready_ms: Vec<f64>,
    pub first_output_ms: Vec<f64>,
    pub pause_ms: Vec<f64>,
    pub resume_ms: Vec<f64>,
    /// (seconds since the first create, GiB charged to the budget cgroup).
    pub samples: Vec<(f64, f64)>,
    pub window_s: f64,
}

impl Outcome {
    pub fn describe(&self) -> String {
        format!(
            "{}/{} admitted, {} held to the end, at most {} at once, {} OOM kills, {:.0} s{}",
            self.admitted,
            self.sandboxes,
            self.completed,
            self.held_at_once,
            self.oom_kills,
            self.window_s,
            self.problems
                .first()
                .map(|p| format!("; first problem: {p}"))
                .unwrap_or_default()
        )
    }

    /// GiB·s charged over the run.
    pub fn gib_s(&self) -> f64 {
        self.samples
            .windows(2)
            .map(|w| (w[1].0 - w[0].0) * (w[0].1 + w[1].1) / 2.0)
            .sum()
    }

    pub fn peak_gib(&self) -> f64 {
        self.samples.iter().map(|s| s.1).fold(0.0, f64::max)
    }
}

/// The daemon of one run, stopped (with its VMs: `--stop-on-exit`) on drop.
struct Daemon {
    child: Child,
    addr: String,
    state: PathBuf,
}

impl Daemon {
    fn start(settings: &Settings, mode: Mode, dir: &Path) -> Res<Daemon> {
        std::fs::create_dir_all(dir)?;
        let state = dir.join("s");
        let log = std::fs::File::create(dir.join("daemon.log"))?;
        let (child, addr) = http::spawn_listening(
            Command::new(&settings.daemon)
                .args(["--listen", "127.0.0.1:0", "--no-auth", "--stop-on-exit"])
                .arg("--state")
                .arg(&state)
                .args(["--memory-budget", &format!("{}MiB", settings.budget_mib)])
                .args(["--admission-timeout", ADMISSION_TIMEOUT])
                .args(mode.flags())
                .args(settings.template.iter().flat_map(|t| {
                    [
                        "--template".into(),
                        format!("{TEMPLATE}={}", t.dir.display()),
                    ]
                }))
                .stderr(log),
            &dir.join("daemon.log"),
        )?;
        Ok(Daemon { child, addr, state })
    }

    fn api(&self, method: &str, path: &str, body: Option<&str>) -> Result<Answer, String> {
        let raw = http::raw_request(&self.addr, method, path, &[], body);
        http::timed(&self.addr, &raw, b"").map(|(answer, _)| answer)
    }

    /// The budget cgroup's directory (named in the state directory).
    fn budget_cgroup(&self) -> Option<PathBuf> {
        let name = std::fs::read_to_string(self.state.join("budget-cgroup")).ok()?;
        // The daemon made it under its own memory cgroup, which is this process's.
        let (base, _) = vmm::stats::MemoryCgroup::own_base().ok()?;
        Some(base.join(name.trim()))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: a signal to our own child, not waited for yet.
        unsafe {
            libc::kill(
                libc::pid_t::try_from(self.child.id()).unwrap_or(0),
                libc::SIGTERM,
            )
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A sandbox's execd: the path of its endpoint on the daemon, and its token.
fn execd(daemon: &Daemon, id: &str) -> Result<(String, String), String> {
    let answer = daemon.api("GET", &format!("/v1/sandboxes/{id}/endpoints/44772"), None)?;
    let body: Value = serde_json::from_slice(&answer.body).map_err(|e| e.to_string())?;
    let endpoint = body["endpoint"].as_str().unwrap_or_default();
    let path = endpoint
        .strip_prefix(&daemon.addr)
        .ok_or_else(|| format!("endpoint {body}"))?;
    let token = body["headers"][TOKEN_HEADER].as_str().unwrap_or_default();
    Ok((path.to_owned(), token.to_owned()))
}

/// Runs `command` in the sandbox; its stdout results, and when the first came (ms).
fn command(
    daemon: &Daemon,
    (path, token): &(String, String),
    command: &str,
) -> Result<(Vec<Value>, f64), String> {
    let body = serde_json::json!({ "command": command }).to_string();
    let raw = http::raw_request(
        &daemon.addr,
        "POST",
        &format!("{path}/command"),
        &[(TOKEN_HEADER, token)],
        Some(&body),
    );
    let (answer, first) = http::timed(&daemon.addr, &raw, FIRST_OUTPUT)?;
    if answer.status != 200 {
        return Err(format!("`{command}`: {} {}", answer.status, answer.text()));
    }
    let events = http::events(&answer.text());
    if events.last().map(|e| &e["type"]) != Some(&"execution_complete".into()) {
        return Err(format!("`{command}` failed: {events:?}"));
    }
    let stdout = events
        .iter()
        .filter(|e| e["type"] == "stdout")
        .filter_map(|e| serde_json::from_str(e["text"].as_str()?.trim_end()).ok())
        .collect();
    let first = first.ok_or_else(|| format!("`{command}` gave no output"))?;
    Ok((stdout, first.as_secs_f64() * 1e3))
}

/// The sandbox's status as the API tells it (for a failed one, its VM's tombstone).
fn status(daemon: &Daemon, id: &str) -> Value {
    daemon
        .api("GET", &format!("/v1/sandboxes/{id}"), None)
        .ok()
        .and_then(|a| serde_json::from_slice::<Value>(&a.body).ok())
        .map(|b| b["status"].clone())
        .unwrap_or_default()
}

fn ms_since(at: Instant) -> f64 {
    at.elapsed().as_secs_f64() * 1e3
}

/// One sandbox's whole life: created, filled, idle and checked `iterations` times, deleted.
fn drive(
    daemon: &Daemon,
    settings: &Settings,
    i: usize,
    began: Instant,
    out: &mut Sandbox,
) -> Result<(), String> {
    let uri = if settings.template.is_some() {
        TEMPLATE
    } else {
        "pvisor:workload"
    };
    let body = format!(r#"{{"image":{{"uri":"{uri}"}},"entrypoint":["tail","-f","/dev/null"]}}"#);
    let asked = Instant::now();
    let created = daemon.api("POST", "/v1/sandboxes", Some(&body))?;
    out.create_ms = ms_since(asked);
    match created.status {
        202 => {
            out.admitted = true;
            out.live.0 = began.elapsed().as_secs_f64();
        }
        429 => return Ok(()),
        other => return Err(format!("create: {other} {}", created.text())),
    }
    let id = serde_json::from_slice::<Value>(&created.body)
        .ok()
        .and_then(|b| b["id"].as_str().map(str::to_owned))
        .ok_or("create: no id")?;
    let execd = execd(daemon, &id)?;
    loop {
        let raw = http::raw_request(
            &daemon.addr,
            "GET",
            &format!("{}/ping", execd.0),
            &[(TOKEN_HEADER, &execd.1)],
            None,
        );
        if http::timed(&daemon.addr, &raw, b"")?.0.status == 200 {
            break;
        }
        if asked.elapsed() > Duration::from_secs(60) {
            return Err(format!(
                "{id} not ready within 60 s ({})",
                status(daemon, &id)
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    out.ready_ms = ms_since(asked);
    // Its working set: its own, filled now, or the template's, restored from the snapshot.
    let digest = match &settings.template {
        None => {
            let fill = format!("fill {} random seed={i}; digest", settings.working_set);
            let (stdout, _) = command(daemon, &execd, &fill)?;
            stdout
                .get(1)
                .map(|r| r["digest"].clone())
                .ok_or("no digest")?
        }
        Some(template) => {
            let (stdout, _) = command(daemon, &execd, "digest")?;
            let digest = stdout.first().map(|r| r["digest"].clone());
            if digest != Some(Value::from(template.digest.as_str())) {
                return Err(format!("{id} did not start with the template's data"));
            }
            Value::from(template.digest.as_str())
        }
    };
    for iteration in 0..settings.iterations {
        std::thread::sleep(settings.idle);
        if iteration == settings.iterations / 2 {
            for (what, slot) in [("pause", &mut out.pause_ms), ("resume", &mut out.resume_ms)] {
                let at = Instant::now();
                let answer = daemon.api("POST", &format!("/v1/sandboxes/{id}/{what}"), None)?;
                if answer.status != 202 {
                    return Err(format!("{what}: {} {}", answer.status, answer.text()));
                }
                *slot = Some(ms_since(at));
            }
        }
        let at = began.elapsed().as_secs_f64();
        let (stdout, first_ms) = command(daemon, &execd, "digest")
            .map_err(|e| format!("{e} ({})", status(daemon, &id)))?;
        if let Some(trace) = std::env::var_os("SANDBOX_BENCH_TRACE") {
            use std::io::Write as _;
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(trace)
            {
                let _ = writeln!(f, "{i},{id},{iteration},{at:.3},{first_ms:.1}");
            }
        }
        if stdout.first().map(|r| &r["digest"]) != Some(&digest) {
            return Err(format!("{id}: iteration {iteration} found another digest"));
        }
        out.first_output_ms.push(first_ms);
    }
    let deleted = daemon.api("DELETE", &format!("/v1/sandboxes/{id}"), None)?;
    if deleted.status != 204 {
        return Err(format!("delete: {}", deleted.status));
    }
    out.live.1 = began.elapsed().as_secs_f64();
    out.completed = true;
    Ok(())
}

/// The most of the intervals `live` that overlap at one time.
fn at_once(live: impl Iterator<Item = (f64, f64)>) -> usize {
    let mut edges: Vec<(f64, i32)> = live.flat_map(|(a, b)| [(a, 1), (b, -1)]).collect();
    // At one time, ends before starts.
    edges.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
    let mut live = 0i32;
    let mut most = 0;
    for (_, step) in edges {
        live += step;
        most = most.max(live);
    }
    most.unsigned_abs() as usize
}

/// The kernel's OOM kills counted in the budget cgroup itself.
fn oom_kills(cgroup: &Path) -> u64 {
    std::fs::read_to_string(cgroup.join("memory.oom_control"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Runs the load against a daemon in `mode`, with its files under `dir`.
pub fn run(settings: &Settings, mode: Mode, dir: &Path) -> Res<Outcome> {
    let daemon = Daemon::start(settings, mode, dir)?;
    let cgroup = daemon
        .budget_cgroup()
        .ok_or("the daemon named no budget cgroup")?;
    let began = Instant::now();
    let done = AtomicBool::new(false);
    let samples = Mutex::new(Vec::new());
    let mut sandboxes: Vec<Sandbox> = (0..settings.sandboxes)
        .map(|_| Sandbox::default())
        .collect();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                if let Ok(text) = std::fs::read_to_string(cgroup.join("memory.usage_in_bytes")) {
                    if let Ok(bytes) = text.trim().parse::<f64>() {
                        let at = began.elapsed().as_secs_f64();
                        let mut samples = samples.lock().unwrap_or_else(|e| e.into_inner());
                        samples.push((at, bytes / f64::from(1u32 << 30)));
                    }
                }
                std::thread::sleep(SAMPLE);
            }
        });
        let clients: Vec<_> = sandboxes
            .iter_mut()
            .enumerate()
            .map(|(i, out)| {
                let daemon = &daemon;
                scope.spawn(move || {
                    std::thread::sleep(settings.stagger * i as u32);
                    if let Err(why) = drive(daemon, settings, i, began, out) {
                        out.problem = Some(why);
                    }
                })
            })
            .collect();
        for client in clients {
            let _ = client.join();
        }
        done.store(true, Ordering::Relaxed);
    });
    let window_s = began.elapsed().as_secs_f64();
    // The kernel counts an OOM kill in the cgroup of the VM it killed (gone with it); the
    // sandbox's record keeps its tombstone's reason.
    let failed = daemon
        .api("GET", "/v1/sandboxes?state=Failed&pageSize=1000", None)
        .ok()
        .and_then(|a| serde_json::from_slice::<Value>(&a.body).ok())
        .unwrap_or_default();
    let killed = failed["items"].as_array().map_or(0, |items| {
        items
            .iter()
            .filter(|s| {
                s["status"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("OOM killer"))
            })
            .count() as u64
    });
    let oom_kills = oom_kills(&cgroup).max(killed);
    drop(daemon);
    let problems: Vec<String> = sandboxes.iter().filter_map(|s| s.problem.clone()).collect();
    if !problems.is_empty() && !settings.write_docs {
        // A smoke run's failure is read in CI's log, where the daemon's log is not kept.
        let log = std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        eprintln!(
            "sandbox_report: {}: the daemon's last log lines:\n{}",
            mode.key(),
            lines[lines.len().saturating_sub(30)..].join("\n")
        );
    }
    let all = |f: fn(&Sandbox) -> Vec<f64>| sandboxes.iter().flat_map(f).collect::<Vec<f64>>();
    Ok(Outcome {
        sandboxes: settings.sandboxes,
        admitted: sandboxes.iter().filter(|s| s.admitted).count(),
        completed: sandboxes.iter().filter(|s| s.completed).count(),
        held_at_once: at_once(sandboxes.iter().filter(|s| s.completed).map(|s| s.live)),
        problems,
        oom_kills,
        create_ms: all(|s| vec![s.create_ms]),
        ready_ms: all(|s| s.admitted.then_some(s.ready_ms).into_iter().collect()),
        first_output_ms: all(|s| s.first_output_ms.clone()),
        pause_ms: all(|s| s.pause_ms.into_iter().collect()),
        resume_ms: all(|s| s.resume_ms.into_iter().collect()),
        samples: samples.into_inner().unwrap_or_else(|e| e.into_inner()),
        window_s,
    })
}
