//! `pvisor-sandboxd`'s memory budget, with real VMs (/dev/kvm, /dev/userfaultfd) in real
//! memory cgroups under the memory governor: creates admitted by what the VMs are charged
//! (not by their nominal RAM), refused clearly past it or after a bounded wait, and sandboxes
//! whose working sets together pass the budget taking turns in it, with no OOM kill and not a
//! byte lost.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

mod common;
use common::{outcome, skip, Daemon};

const BODY: &str = r#"{"image":{"uri":"pvisor:workload"},"entrypoint":["tail","-f","/dev/null"]}"#;

/// The memory cgroup of each VM of the daemon's sandboxes (from their identity files).
fn vm_cgroups(daemon: &Daemon) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(daemon.state().join("vms"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("vm.json")).ok())
        .filter_map(|text| {
            let identity: serde_json::Value = serde_json::from_str(&text).ok()?;
            Some(identity["cgroup"].as_str()?.into())
        })
        .collect()
}

/// The kernel's OOM kills in the budget cgroup (the parent of every VM's).
fn oom_kills(daemon: &Daemon) -> u64 {
    let cgroup = vm_cgroups(daemon).pop().expect("a VM in a cgroup");
    let control = std::fs::read_to_string(cgroup.parent().unwrap().join("memory.oom_control"))
        .unwrap_or_default();
    control
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Whether the daemon's `log` says that sandbox `id` is offloaded while idle now: offloaded
/// after it was last brought back for a command.
fn offloaded_idle(log: &str, id: &str) -> bool {
    let last = |what: &str| log.rfind(&format!("{what} id={id}"));
    match (last("offloaded while idle"), last("back for a command")) {
        (Some(out), back) => back.is_none_or(|back| back < out),
        (None, _) => false,
    }
}

fn metric(daemon: &Daemon, name: &str) -> f64 {
    let text = daemon.api("GET", "/metrics", None).text();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `{name}` in\n{text}"))
}

/// How many VMs the daemon's governor counts.
fn governed(daemon: &Daemon) -> f64 {
    metric(daemon, "pvisor_governor_vms")
}

#[test]
fn budget_admits_by_memory_charged_and_sandboxes_take_turns_in_it() {
    if skip() {
        return;
    }
    // 320 MiB, of which the governor keeps 90% (288 MiB), and 96 MiB stays free for commands:
    // by nominal RAM (512 MiB each) not one sandbox would fit.
    let mut daemon = Daemon::start(&[
        "--memory-budget",
        "320MiB",
        "--admission-timeout",
        "0",
        "--admission-reserve",
        "96MiB",
        "--idle-offload",
        "0",
    ]);
    // 200 creates: admitted while the budget holds each one's start, then refused at once,
    // each refusal with its numbers.
    let mut admitted = Vec::new();
    let mut refusal = None;
    for _ in 0..200 {
        let answer = daemon.api("POST", "/v1/sandboxes", Some(BODY));
        match answer.status {
            202 => admitted.push(answer.json()["id"].as_str().unwrap().to_owned()),
            429 => {
                assert_eq!(answer.code(), "INSUFFICIENT_CAPACITY", "{}", answer.text());
                refusal.get_or_insert(answer.json()["message"].as_str().unwrap().to_owned());
            }
            other => panic!("{other}: {}", answer.text()),
        }
    }
    let refusal = refusal.expect("the budget filled up");
    assert!(
        refusal.contains("memory budget (320 MiB)") && refusal.contains("to start"),
        "{refusal}"
    );
    assert!(
        (4..=20).contains(&admitted.len()),
        "{} admitted; {refusal}",
        admitted.len()
    );
    for id in &admitted {
        daemon.wait_ready(id);
    }
    assert_eq!(
        metric(&daemon, "pvisor_sandbox_creates_refused_total"),
        (200 - admitted.len()) as f64
    );
    assert_eq!(
        metric(&daemon, "pvisor_governor_vms"),
        admitted.len() as f64
    );

    // Four sandboxes fill 64 MiB each, one after the other: 256 MiB of working sets in a
    // budget that holds about two beside the others' floors. The governor takes the RAM of
    // those between commands to let the next one run.
    let mut digests = Vec::new();
    for (i, id) in admitted.iter().take(4).enumerate() {
        let (stdout, code) =
            outcome(&daemon.command(id, &format!("fill 64MiB random seed={i}; digest")));
        assert_eq!(code, 0, "{stdout:?}; {}", daemon.log());
        digests.push(stdout[1]["digest"].as_str().unwrap().to_owned());
    }
    // Every byte comes back, again taking turns.
    for (id, digest) in admitted.iter().zip(&digests) {
        let (stdout, code) = outcome(&daemon.command(id, "digest"));
        assert_eq!(
            (stdout[0]["digest"].as_str().unwrap(), code),
            (digest.as_str(), 0)
        );
    }
    assert!(
        metric(&daemon, "pvisor_governor_decisions_total{kind=\"offload\"}") >= 1.0,
        "the governor ordered no offload"
    );
    assert_eq!(oom_kills(&daemon), 0);
    let failed = daemon.api("GET", "/v1/sandboxes?state=Failed", None).json();
    assert_eq!(failed["pagination"]["totalItems"], 0, "{failed}");

    // A create that finds no room waits for it (up to --admission-timeout), and is admitted
    // once a sandbox goes. The budget is filled up first (the offloads made room).
    loop {
        let answer = daemon.api("POST", "/v1/sandboxes", Some(BODY));
        if answer.status == 429 {
            break;
        }
        assert_eq!(answer.status, 202, "{}", answer.text());
        let id = answer.json()["id"].as_str().unwrap().to_owned();
        daemon.wait_ready(&id);
        admitted.push(id);
    }
    daemon.kill();
    daemon.respawn_with(&["--admission-timeout", "60s"]);
    // Once every VM has joined the new daemon's governor (one still joining is counted at a
    // whole start's need, more than it holds), creates until one waits: the VMs' charges moved
    // while no daemon watched them (a dozen more sandboxes may fit now). A create that finds
    // room is answered at once, its VM starting after.
    let deadline = Instant::now() + Duration::from_secs(30);
    while governed(&daemon) < admitted.len() as f64 {
        assert!(Instant::now() < deadline, "VMs not back: {}", daemon.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let waiting = (0..64)
        .find_map(|_| {
            let (addr, body) = (daemon.addr.clone(), BODY.to_owned());
            let create = std::thread::spawn(move || {
                let asked = Instant::now();
                let answer = common::request(
                    &addr,
                    "POST",
                    "/v1/sandboxes",
                    &[("OPEN-SANDBOX-API-KEY", common::KEY)],
                    Some(&body),
                );
                (answer, asked, Instant::now())
            });
            std::thread::sleep(Duration::from_secs(1));
            if !create.is_finished() {
                return Some(create);
            }
            let (answer, ..) = create.join().unwrap();
            assert_eq!(answer.status, 202, "{}", answer.text());
            let id = answer.json()["id"].as_str().unwrap().to_owned();
            daemon.wait_ready(&id);
            eprintln!("admitted after the restart: {id}");
            admitted.push(id);
            None
        })
        .expect("every create found room: the budget never filled");
    // Each VM left holds about 5 MiB now (offloaded, or never used): a start's 40 MiB and
    // the reserve come free when a dozen or so go.
    let deleting = Instant::now();
    assert!(!waiting.is_finished(), "admitted with no sandbox gone");
    for id in admitted.iter().rev().take(16) {
        let deleted = daemon.api("DELETE", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(deleted.status, 204, "{}", deleted.text());
    }
    let (answer, asked, answered) = waiting.join().unwrap();
    assert_eq!(answer.status, 202, "{}; {}", answer.text(), daemon.log());
    assert!(answered > deleting, "{:?}", answered - asked);
    // The daemon measured a wait of over a second for it.
    let admissions = metric(
        &daemon,
        "pvisor_sandbox_admission_seconds_count{by=\"api\"}",
    );
    let within_1s = "pvisor_sandbox_admission_seconds_bucket{by=\"api\",le=\"1\"}";
    assert!(admissions - metric(&daemon, within_1s) >= 1.0);
    assert_eq!(oom_kills(&daemon), 0);
}

/// A daemon under a budget of 128 MiB (115 under the governor's high watermark) with `extra`
/// flags, and two sandboxes that filled 64 MiB each (their digests), both offloaded while
/// idle since: their working sets cannot come back at once beside the VMs' floors.
fn two_idle_offloaded(extra: &[&str]) -> (Daemon, Vec<String>, Vec<String>) {
    let mut args = vec![
        "--memory-budget",
        "128MiB",
        "--admission-reserve",
        "16MiB",
        "--idle-offload",
        "1s",
    ];
    args.extend_from_slice(extra);
    let daemon = Daemon::start(&args);
    let ids: Vec<String> = (0..2)
        .map(|_| {
            let id = daemon.create("");
            daemon.wait_ready(&id);
            id
        })
        .collect();
    let digests: Vec<String> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let script = format!("fill 64MiB random seed={i}; digest");
            let (stdout, code) = outcome(&daemon.command(id, &script));
            assert_eq!(code, 0, "{stdout:?}");
            stdout[1]["digest"].as_str().unwrap().to_owned()
        })
        .collect();
    // Both offloaded while idle since their fill (a sandbox can be offloaded before its
    // fill too, when the other's takes over the idle time: a count of offloads misleads).
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ids.iter().all(|id| offloaded_idle(&daemon.log(), id)) {
        assert!(Instant::now() < deadline, "{}", daemon.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    (daemon, ids, digests)
}

/// Runs `script` (which begins with `digest`) in every sandbox of `ids` at once; each finds
/// its digest.
fn digests_at_once(daemon: &Daemon, ids: &[String], digests: &[String], script: &str) {
    std::thread::scope(|scope| {
        for (id, digest) in ids.iter().zip(digests) {
            scope.spawn(move || {
                let (stdout, code) = outcome(&daemon.command(id, script));
                assert_eq!(code, 0, "{stdout:?}");
                assert_eq!(stdout[0]["digest"].as_str().unwrap(), digest);
            });
        }
    });
}

#[test]
fn commands_of_idle_offloaded_sandboxes_wait_for_room_then_run_whole() {
    if skip() {
        return;
    }
    let (daemon, ids, digests) = two_idle_offloaded(&[]);
    // Both at once: the second waits for the first to have its memory back and be done,
    // then runs; both find their data.
    digests_at_once(&daemon, &ids, &digests, "digest");
    assert!(
        metric(&daemon, "pvisor_sandbox_commands_waited_total") >= 1.0,
        "{}",
        daemon.log()
    );
}

#[test]
fn an_eager_resume_let_in_without_room_comes_back_lazily() {
    if skip() {
        return;
    }
    let (daemon, ids, digests) =
        two_idle_offloaded(&["--idle-resume", "eager", "--admission-timeout", "1s"]);
    // Both at once, the first holding its room for 3 s: the second is let in after its
    // second without room, and resumes lazily (an eager resume would hold the governor's
    // room for all of its 64 MiB at once, its vCPU stopped); both find their data.
    // (What the log says from here: a sandbox may have been offloaded and brought back for
    // its fill too.)
    let before = daemon.log().len();
    digests_at_once(&daemon, &ids, &digests, "digest; sleep 3000");
    let whole = daemon.log();
    let log = &whole[before..];
    let back: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("back for a command"))
        .collect();
    assert_eq!(back.len(), 2, "{log}");
    assert_eq!(
        back.iter().filter(|l| l.contains("eager=true")).count(),
        1,
        "{log}"
    );
    assert!(
        log.contains("resumed lazily: no room for all of it at once"),
        "{log}"
    );
    assert_eq!(oom_kills(&daemon), 0);
}
