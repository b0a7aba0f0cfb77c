//! `pvisor-sandboxd` stopped or killed and started again on its state directory, with real
//! VMs (/dev/kvm, /dev/userfaultfd): it takes back every sandbox its VMs still serve, finishes
//! what the previous daemon left half done, and leaves no VM behind that nothing names.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

mod common;
use common::{alive, outcome, skip, vm_pids, Daemon};

fn state_of(daemon: &Daemon, id: &str) -> serde_json::Value {
    daemon
        .api("GET", &format!("/v1/sandboxes/{id}"), None)
        .json()
}

/// Fills `id` with 16 MiB of data of `seed`; its digest.
fn fill(daemon: &Daemon, id: &str, seed: u32) -> String {
    let (stdout, code) =
        outcome(&daemon.command(id, &format!("fill 16MiB random seed={seed}; digest")));
    assert_eq!(code, 0, "{stdout:?}");
    stdout[1]["digest"].as_str().unwrap().to_owned()
}

/// The digest `id` holds now.
fn digest(daemon: &Daemon, id: &str) -> String {
    let (stdout, code) = outcome(&daemon.command(id, "digest"));
    assert_eq!(code, 0, "{stdout:?}; {}", daemon.log());
    stdout[0]["digest"].as_str().unwrap().to_owned()
}

#[test]
fn restarted_daemon_re_adopts_its_sandboxes_and_fails_those_whose_vm_died() {
    if skip() {
        return;
    }
    let mut daemon = Daemon::start(&["--idle-offload", "0"]);
    let running = daemon.create(r#","metadata":{"keep":"me"}"#);
    let paused = daemon.create("");
    let dies = daemon.create("");
    let mut digests = Vec::new();
    for (seed, id) in [&running, &paused, &dies].into_iter().enumerate() {
        daemon.wait_ready(id);
        digests.push(fill(&daemon, id, u32::try_from(seed).unwrap() + 1));
    }
    let pause = daemon.api("POST", &format!("/v1/sandboxes/{paused}/pause"), None);
    assert_eq!(pause.status, 202, "{}", pause.text());
    let (_, token) = daemon.execd(&running);
    let pids: Vec<u32> = [&running, &paused, &dies]
        .iter()
        .map(|id| daemon.vm_pid(id))
        .collect();

    // Stopped (SIGTERM): the VMs run on, each keeping its memory.
    let status = daemon.terminate(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}: {}",
        daemon.log()
    );
    assert!(pids.iter().all(|&p| alive(p)), "{pids:?}; {}", daemon.log());
    // One VM dies while no daemon watches.
    // SAFETY: a signal to a VM process this test's daemon started.
    unsafe { libc::kill(libc::pid_t::try_from(pids[2]).unwrap(), libc::SIGKILL) };
    daemon.wait_gone(&pids[2..], Duration::from_secs(10));
    daemon.respawn();

    // Each sandbox is what its VM is: the same process, the same data, the same token.
    let body = state_of(&daemon, &running);
    assert_eq!(body["status"]["state"], "Running", "{body}");
    assert_eq!(body["metadata"]["keep"], "me");
    assert_eq!(daemon.vm_pid(&running), pids[0]);
    assert_eq!(daemon.execd(&running).1, token);
    assert_eq!(digest(&daemon, &running), digests[0]);
    assert_eq!(state_of(&daemon, &paused)["status"]["state"], "Paused");
    let resume = daemon.api("POST", &format!("/v1/sandboxes/{paused}/resume"), None);
    assert_eq!(resume.status, 202, "{}", resume.text());
    assert_eq!(digest(&daemon, &paused), digests[1]);
    let body = state_of(&daemon, &dies);
    assert_eq!(body["status"]["state"], "Failed", "{body}");
    assert_eq!(body["status"]["reason"], "VM_ENDED", "{body}");
    let why = body["status"]["message"].as_str().unwrap();
    assert!(why.contains("signal 9"), "{body}");
    assert!(!daemon.state().join("vms").join(&dies).exists());

    // Killed (-9) in the middle of a pause: the restarted daemon finds the sandbox paused or
    // running, whichever its VM reached, and not a byte is lost.
    let asked = {
        let (addr, path) = (
            daemon.addr.clone(),
            format!("/v1/sandboxes/{running}/pause"),
        );
        std::thread::spawn(move || {
            common::request(
                &addr,
                "POST",
                &path,
                &[("OPEN-SANDBOX-API-KEY", common::KEY)],
                None,
            )
        })
    };
    std::thread::sleep(Duration::from_millis(20));
    daemon.kill();
    // (The pause's answer, if any came, is of no interest: the daemon died under it.)
    let _ = asked.join();
    daemon.respawn();
    let body = state_of(&daemon, &running);
    let state = body["status"]["state"].as_str().unwrap().to_owned();
    assert!(["Running", "Paused"].contains(&state.as_str()), "{body}");
    if state == "Paused" {
        let resume = daemon.api("POST", &format!("/v1/sandboxes/{running}/resume"), None);
        assert_eq!(resume.status, 202, "{}", resume.text());
    }
    assert_eq!(digest(&daemon, &running), digests[0]);
    assert_eq!(daemon.vm_pid(&running), pids[0]);

    // Deleted after all that: nothing is left.
    let live = vm_pids(&daemon.state());
    for id in [&running, &paused, &dies] {
        let deleted = daemon.api("DELETE", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(deleted.status, 204, "{}", deleted.text());
    }
    daemon.wait_gone(&live, Duration::from_secs(10));
    assert!(vm_pids(&daemon.state()).is_empty());
}

#[test]
fn restarted_daemon_adopts_an_unrecorded_vm_starts_an_unstarted_one_and_stops_orphans() {
    if skip() {
        return;
    }
    let mut daemon = Daemon::start(&[]);
    let unrecorded = daemon.create("");
    let orphan = daemon.create("");
    daemon.wait_ready(&unrecorded);
    daemon.wait_ready(&orphan);
    let digest_before = fill(&daemon, &unrecorded, 7);
    let pid = daemon.vm_pid(&unrecorded);
    let orphan_pid = daemon.vm_pid(&orphan);
    daemon.kill();
    let records = daemon.state().join("sandboxes");
    // The daemon died while the VM started: the record is still `Pending`, without the VM.
    let path = records.join(format!("{unrecorded}.json"));
    let mut record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    record["state"] = "Pending".into();
    record["vm"] = serde_json::Value::Null;
    std::fs::write(&path, serde_json::to_vec(&record).unwrap()).unwrap();
    // It died after it created a sandbox and before its VM started.
    let unstarted = "sb-00000000abcd";
    record["id"] = unstarted.into();
    record["token"] = "0123456789abcdef".into();
    std::fs::write(
        records.join(format!("{unstarted}.json")),
        serde_json::to_vec(&record).unwrap(),
    )
    .unwrap();
    // It died in a delete, after the record went and before the VM stopped.
    std::fs::remove_file(records.join(format!("{orphan}.json"))).unwrap();
    daemon.respawn();

    let body = state_of(&daemon, &unrecorded);
    assert_eq!(body["status"]["state"], "Running", "{body}");
    assert_eq!(daemon.vm_pid(&unrecorded), pid);
    assert_eq!(digest(&daemon, &unrecorded), digest_before);
    daemon.wait_ready(unstarted);
    assert_eq!(state_of(&daemon, unstarted)["status"]["state"], "Running");
    assert_eq!(
        outcome(&daemon.command(unstarted, "fill 1MiB random seed=3; digest")).1,
        0
    );
    daemon.wait_gone(&[orphan_pid], Duration::from_secs(10));
    assert!(!daemon.state().join("vms").join(&orphan).exists());
    assert_eq!(
        daemon
            .api("GET", &format!("/v1/sandboxes/{orphan}"), None)
            .status,
        404
    );
}

#[test]
fn daemon_stopped_with_sigterm_and_stop_on_exit_stops_its_vms_and_keeps_their_records() {
    if skip() {
        return;
    }
    let mut daemon = Daemon::start(&["--stop-on-exit"]);
    let id = daemon.create(r#","metadata":{"keep":"me"}"#);
    daemon.wait_ready(&id);
    let pids = vm_pids(&daemon.state());
    assert!(!pids.is_empty());
    // A command stream in flight, that would run for 10 minutes, holds the stop back only
    // for a while.
    let stream = daemon.open_command(&id, "sleep 600000");
    let asked = Instant::now();
    let status = daemon.terminate(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}: {}",
        daemon.log()
    );
    assert!(
        asked.elapsed() < Duration::from_secs(40),
        "{:?}",
        asked.elapsed()
    );
    drop(stream);
    // (A supervisor the daemon did not reap is init's to reap.)
    daemon.wait_gone(&pids, Duration::from_secs(10));
    assert!(!daemon.state().join("vms").join(&id).exists());
    let record: serde_json::Value = serde_json::from_slice(
        &std::fs::read(daemon.state().join(format!("sandboxes/{id}.json"))).unwrap(),
    )
    .unwrap();
    assert_eq!(record["state"], "Failed", "{record}");
    assert_eq!(record["reason"], "DAEMON_STOPPED", "{record}");
    assert!(record["vm"].is_null(), "{record}");
}

#[test]
fn restarted_daemon_adopts_a_sandbox_busy_with_a_long_command_and_keeps_its_data() {
    if skip() {
        return;
    }
    let mut daemon = Daemon::start(&["--idle-offload", "0"]);
    let id = daemon.create("");
    daemon.wait_ready(&id);
    let before = fill(&daemon, &id, 9);
    let pid = daemon.vm_pid(&id);
    // A command that outlasts the next daemon's status deadline (10 s): the VM answers its
    // requests one at a time, so the adoption's status waits behind it and times out.
    let stream = daemon.open_command(&id, "sleep 13000");
    // The stream's head is answered before the VM is asked: give the request time to reach it.
    std::thread::sleep(Duration::from_millis(500));
    daemon.kill();
    drop(stream);
    daemon.respawn();
    // Busy, not gone: adopted as it runs (it was stopped, `VM_UNREACHABLE`, and its memory
    // lost), the same process with the same data once the command is over.
    let body = state_of(&daemon, &id);
    assert_eq!(
        body["status"]["state"],
        "Running",
        "{body}; {}",
        daemon.log()
    );
    assert_eq!(daemon.vm_pid(&id), pid);
    assert!(alive(pid));
    assert_eq!(digest(&daemon, &id), before);
}
