//! `pvisor-sandboxd` end to end, with real VMs (/dev/kvm, /dev/userfaultfd): the lifecycle
//! API and execd driven over HTTP as a client drives them, and what it refuses.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::{Duration, Instant};

mod common;
use common::{alive, outcome, request, send_raw, skip, stderr_of, vm_pids, Daemon};
use testkit::rss_bytes;

#[test]
fn sandbox_runs_commands_pauses_resumes_and_is_deleted() {
    if skip() {
        return;
    }
    let daemon = Daemon::start(&[]);
    let created = daemon.api(
        "POST",
        "/v1/sandboxes",
        Some(r#"{"image":{"uri":"pvisor:workload"},"timeout":600,"metadata":{"team":"a","note":"x y"},"resourceLimits":{"cpu":"1","memory":"512Mi"},"env":{}}"#),
    );
    assert_eq!(created.status, 202, "{}", created.text());
    let body = created.json();
    let id = body["id"].as_str().unwrap().to_owned();
    assert_eq!(body["status"]["state"], "Pending");
    assert!(
        body["createdAt"].is_string() && body["expiresAt"].is_string(),
        "{body}"
    );
    assert!(body["entrypoint"].is_array());
    daemon.wait_ready(&id);
    assert_eq!(
        daemon
            .api("GET", &format!("/v1/sandboxes/{id}"), None)
            .json()["status"]["state"],
        "Running"
    );
    let state_file = daemon.state().join("sandboxes").join(format!("{id}.json"));
    assert!(state_file.is_file());

    // A command: its results as stdout lines, exit code 0.
    let events = daemon.command(&id, "fill 64MiB random seed=1; task; digest");
    assert_eq!(events[0]["type"], "init");
    assert!(events.iter().all(|e| e["timestamp"].is_u64()), "{events:?}");
    let (stdout, code) = outcome(&events);
    assert_eq!(code, 0, "{events:?}");
    assert_eq!(stdout.len(), 3, "{stdout:?}");
    let digest = stdout[2]["digest"].as_str().unwrap().to_owned();
    assert_eq!(stdout[1]["digest"], digest.as_str());

    // Failed scripts: not a script (2), failed in the guest (1), with the reason on stderr.
    let (_, code) = outcome(&daemon.command(&id, "fill 64MiB; bogus"));
    assert_eq!(code, 2);
    let events = daemon.command(&id, "fill 600MiB random");
    let (_, code) = outcome(&events);
    assert_eq!(code, 1, "{events:?}");
    assert!(
        stderr_of(&events).contains("application memory"),
        "{events:?}"
    );
    // The failed fill did not touch the data.
    let (stdout, _) = outcome(&daemon.command(&id, "digest"));
    assert_eq!(stdout[0]["digest"], digest.as_str());

    // Pause (an offload: the VM's memory goes), twice: 409 the second time; commands wait
    // for a resume.
    let vm = daemon.vm_pid(&id);
    let before = rss_bytes(vm);
    assert!(before >= 64 << 20, "{before}");
    let paused = daemon.api("POST", &format!("/v1/sandboxes/{id}/pause"), None);
    assert_eq!(paused.status, 202);
    let after = rss_bytes(vm);
    assert!(
        after + (48 << 20) <= before,
        "resident {before} -> {after} bytes"
    );
    let again = daemon.api("POST", &format!("/v1/sandboxes/{id}/pause"), None);
    assert_eq!(
        (again.status, again.code().as_str()),
        (409, "INVALID_STATE")
    );
    assert_eq!(
        daemon
            .api("GET", &format!("/v1/sandboxes/{id}"), None)
            .json()["status"]["state"],
        "Paused"
    );
    let (path, token) = daemon.execd(&id);
    let ping = request(
        &daemon.addr,
        "GET",
        &format!("{path}/ping"),
        &[("X-Pvisor-Sandbox-Token", &token)],
        None,
    );
    assert_eq!(ping.status, 503);
    let paused = daemon.api("GET", "/v1/sandboxes?state=Paused", None).json();
    assert_eq!(paused["items"][0]["id"], id.as_str());
    assert_eq!(
        daemon
            .api("POST", &format!("/v1/sandboxes/{id}/resume"), None)
            .status,
        202
    );
    let again = daemon.api("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(again.status, 409);
    let (stdout, code) = outcome(&daemon.command(&id, "digest"));
    assert_eq!(
        (stdout[0]["digest"].as_str().unwrap(), code),
        (digest.as_str(), 0)
    );

    // List: filters and pages.
    let other = daemon.create(r#","metadata":{"team":"b"}"#);
    let list = daemon
        .api(
            "GET",
            "/v1/sandboxes?metadata=team%3Da%26note%3Dx%2520y",
            None,
        )
        .json();
    assert_eq!(list["items"].as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list["items"][0]["id"], id.as_str());
    let page = daemon
        .api("GET", "/v1/sandboxes?pageSize=1&page=2", None)
        .json();
    assert_eq!(page["pagination"]["totalItems"], 2, "{page}");
    assert_eq!(page["pagination"]["totalPages"], 2);
    assert_eq!(page["pagination"]["hasNextPage"], false);
    assert_eq!(page["items"][0]["id"], other.as_str());
    let none = daemon.api("GET", "/v1/sandboxes?state=Failed", None).json();
    assert_eq!(none["items"].as_array().unwrap().len(), 0);

    // Renew.
    let renewed = daemon.api(
        "POST",
        &format!("/v1/sandboxes/{id}/renew-expiration"),
        Some(r#"{"expiresAt":"2099-01-01T00:00:00Z"}"#),
    );
    assert_eq!(
        renewed.status,
        400,
        "more than 30 days away: {}",
        renewed.text()
    );
    let at = now_plus(3600);
    let renewed = daemon.api(
        "POST",
        &format!("/v1/sandboxes/{id}/renew-expiration"),
        Some(&format!(r#"{{"expiresAt":"{at}"}}"#)),
    );
    assert_eq!(renewed.status, 200, "{}", renewed.text());
    assert!(renewed.json()["expiresAt"].is_string());

    // Delete: 204, then 404; the VM and its files are gone.
    let pids = vm_pids(&daemon.state());
    assert!(!pids.is_empty());
    assert_eq!(
        daemon
            .api("DELETE", &format!("/v1/sandboxes/{id}"), None)
            .status,
        204
    );
    assert_eq!(
        daemon
            .api("GET", &format!("/v1/sandboxes/{id}"), None)
            .status,
        404
    );
    assert_eq!(
        daemon
            .api("DELETE", &format!("/v1/sandboxes/{id}"), None)
            .status,
        404
    );
    assert!(!daemon.state().join("vms").join(&id).exists());
    assert!(!state_file.exists());
    assert_eq!(
        daemon
            .api("DELETE", &format!("/v1/sandboxes/{other}"), None)
            .status,
        204
    );
    daemon.wait_gone(&pids, Duration::from_secs(5));
    let log = daemon.log();
    assert!(log.contains("deleted") && log.contains("VM up"), "{log}");
}

/// An RFC 3339 time `s` seconds from now (from `date`, to check the daemon's own parser).
fn now_plus(s: u64) -> String {
    let out = Command::new("date")
        .args([
            "-u",
            "-d",
            &format!("+{s} seconds"),
            "+%Y-%m-%dT%H:%M:%S+00:00",
        ])
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[test]
fn sandbox_expires_and_its_vm_and_files_go() {
    if skip() {
        return;
    }
    let daemon = Daemon::start(&[]);
    let id = daemon.create(r#","timeout":60"#);
    daemon.wait_ready(&id);
    let pids = vm_pids(&daemon.state());
    // The shortest timeout is 60 s: renew to 2 s from now.
    let at = now_plus(2);
    let renewed = daemon.api(
        "POST",
        &format!("/v1/sandboxes/{id}/renew-expiration"),
        Some(&format!(r#"{{"expiresAt":"{at}"}}"#)),
    );
    assert_eq!(renewed.status, 200, "{}", renewed.text());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let body = daemon
            .api("GET", &format!("/v1/sandboxes/{id}"), None)
            .json();
        if body["status"]["state"] == "Terminated" {
            assert_eq!(body["status"]["reason"], "EXPIRED", "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "did not expire: {body}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(pids.iter().all(|&p| !alive(p)), "{pids:?}");
    assert!(!daemon.state().join("vms").join(&id).exists());
    assert!(!daemon
        .state()
        .join("sandboxes")
        .join(format!("{id}.json"))
        .exists());
    let (path, token) = (format!("/sandboxes/{id}/port/44772"), "x");
    let ping = request(
        &daemon.addr,
        "GET",
        &format!("{path}/ping"),
        &[("X-Pvisor-Sandbox-Token", token)],
        None,
    );
    assert_eq!(ping.status, 401);
    let again = daemon.api("POST", &format!("/v1/sandboxes/{id}/pause"), None);
    assert_eq!(again.status, 409);
}

#[test]
fn sandbox_api_refuses_hostile_and_bad_input() {
    if skip() {
        return;
    }
    let daemon = Daemon::start(&[]);
    let addr = daemon.addr.clone();
    // Keys.
    let missing = request(&addr, "GET", "/v1/sandboxes", &[], None);
    assert_eq!(
        (missing.status, missing.code().as_str()),
        (401, "UNAUTHORIZED")
    );
    let wrong = request(
        &addr,
        "GET",
        "/v1/sandboxes",
        &[("OPEN-SANDBOX-API-KEY", "test-key-5f2c9b")],
        None,
    );
    assert_eq!(wrong.status, 401);
    let create = r#"{"image":{"uri":"pvisor:workload"}}"#;
    assert_eq!(
        request(&addr, "POST", "/v1/sandboxes", &[], Some(create)).status,
        401
    );
    // Unknown ids, and ids that are no ids.
    for path in [
        "/v1/sandboxes/sb-000000000000",
        "/v1/sandboxes/..%2F..%2Fetc",
        "/v1/sandboxes/sb-000000000000/endpoints/44772",
    ] {
        let answer = daemon.api("GET", path, None);
        assert_eq!(
            (answer.status, answer.code().as_str()),
            (404, "NOT_FOUND"),
            "{path}"
        );
    }
    assert_eq!(
        daemon
            .api("POST", "/v1/sandboxes/sb-000000000000/pause", None)
            .status,
        404
    );
    assert_eq!(daemon.api("DELETE", "/v1/sandboxes/nope", None).status, 404);
    assert_eq!(daemon.api("GET", "/nowhere", None).code(), "NOT_FOUND");
    // axum's own rejections answer as JSON too.
    let bad = daemon.api("GET", "/v1/sandboxes/%FF", None);
    assert_eq!((bad.status, bad.code().as_str()), (400, "INVALID_REQUEST"));
    let wrong_method = daemon.api("PUT", "/v1/sandboxes", Some("{}"));
    assert_eq!(
        (wrong_method.status, wrong_method.code().as_str()),
        (405, "METHOD_NOT_ALLOWED")
    );
    // Bodies.
    for (body, why) in [
        ("{\"image\":", "malformed JSON"),
        ("[]", "not an object"),
        (r#"{"image":{"uri":"python:3.11"}}"#, "unknown template"),
        (
            r#"{"image":{"uri":"pvisor:workload"},"timeout":1}"#,
            "timeout under 60",
        ),
        (
            r#"{"image":{"uri":"pvisor:workload"},"metadata":{"a":1}}"#,
            "metadata not text",
        ),
    ] {
        let answer = daemon.api("POST", "/v1/sandboxes", Some(body));
        assert_eq!(
            (answer.status, answer.code().as_str()),
            (400, "INVALID_REQUEST"),
            "{why}: {}",
            answer.text()
        );
    }
    let unknown = daemon.api(
        "POST",
        "/v1/sandboxes",
        Some(r#"{"image":{"uri":"python:3.11"}}"#),
    );
    assert!(
        unknown.text().contains("pvisor:workload"),
        "{}",
        unknown.text()
    );
    // A 100 MiB body is refused on its declared length, before it is read.
    let head = format!(
        "POST /v1/sandboxes HTTP/1.1\r\nHost: {addr}\r\nOPEN-SANDBOX-API-KEY: {}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{{\"image\":",
        common::KEY,
        100 << 20
    );
    let answer = send_raw(&addr, head.as_bytes());
    assert_eq!(
        (answer.status, answer.code().as_str()),
        (413, "PAYLOAD_TOO_LARGE")
    );
    // And a chunked one as it streams past the limit.
    let mut raw = format!(
        "POST /v1/sandboxes HTTP/1.1\r\nHost: {addr}\r\nOPEN-SANDBOX-API-KEY: {}\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        common::KEY
    )
    .into_bytes();
    for _ in 0..5 {
        raw.extend_from_slice(format!("{:x}\r\n", 32 << 10).as_bytes());
        raw.extend(std::iter::repeat_n(b' ', 32 << 10));
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    assert_eq!(send_raw(&addr, &raw).status, 413);

    // execd: tokens are per sandbox.
    let a = daemon.create("");
    let b = daemon.create("");
    daemon.wait_ready(&a);
    daemon.wait_ready(&b);
    let (path_a, token_a) = daemon.execd(&a);
    let (_, token_b) = daemon.execd(&b);
    assert_ne!(token_a, token_b);
    let body = r#"{"command":"digest"}"#;
    for (token, why) in [
        (None, "missing"),
        (Some(token_b.as_str()), "another sandbox's"),
        (Some(""), "empty"),
    ] {
        let headers: Vec<(&str, &str)> = token
            .map(|t| ("X-Pvisor-Sandbox-Token", t))
            .into_iter()
            .collect();
        let answer = request(
            &addr,
            "POST",
            &format!("{path_a}/command"),
            &headers,
            Some(body),
        );
        assert_eq!(
            (answer.status, answer.code().as_str()),
            (401, "UNAUTHORIZED"),
            "{why} token"
        );
        let ping = request(&addr, "GET", &format!("{path_a}/ping"), &headers, None);
        assert_eq!(ping.status, 401, "{why} token");
    }
    // The API key is no execd token.
    let answer = request(
        &addr,
        "GET",
        &format!("{path_a}/ping"),
        &[("OPEN-SANDBOX-API-KEY", common::KEY)],
        None,
    );
    assert_eq!(answer.status, 401);
    let own = [("X-Pvisor-Sandbox-Token", token_a.as_str())];
    let answer = request(
        &addr,
        "POST",
        &format!("{path_a}/command"),
        &own,
        Some("{\"command\":"),
    );
    assert_eq!(
        (answer.status, answer.code().as_str()),
        (400, "INVALID_REQUEST")
    );
    let answer = request(
        &addr,
        "GET",
        &format!("{path_a}/files/info?path=/etc/passwd"),
        &own,
        None,
    );
    assert_eq!(
        (answer.status, answer.code().as_str()),
        (501, "NOT_IMPLEMENTED")
    );
    let egress = daemon.api("GET", &format!("/v1/sandboxes/{a}/endpoints/18080"), None);
    assert_eq!(egress.status, 200, "{}", egress.text());
    let other_port = daemon.api("GET", &format!("/v1/sandboxes/{a}/endpoints/22"), None);
    assert_eq!(other_port.status, 404);
    let (_, code) = outcome(&daemon.command(&a, "digest"));
    assert_eq!(code, 0);

    // A client that opens a command stream and goes away: the command runs to its end, and
    // the sandbox and the daemon serve on.
    drop(daemon.open_command(&a, "sleep 1500; digest"));
    let started = Instant::now();
    let (_, code) = outcome(&daemon.command(&a, "digest"));
    assert_eq!(code, 0);
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "did not wait for the sleep"
    );
    assert_eq!(daemon.api("GET", "/v1/sandboxes", None).status, 200);

    // Commands in flight are bounded per sandbox: past the bound, a clear 429 at once.
    let (path_b, token_b) = daemon.execd(&b);
    let open: Vec<std::net::TcpStream> = (0..sandboxd::sandboxes::MAX_COMMANDS)
        .map(|_| daemon.open_command(&b, "sleep 300"))
        .collect();
    let answer = request(
        &addr,
        "POST",
        &format!("{path_b}/command"),
        &[("X-Pvisor-Sandbox-Token", &token_b)],
        Some(r#"{"command":"digest"}"#),
    );
    assert_eq!(
        (answer.status, answer.code().as_str()),
        (429, "INSUFFICIENT_CAPACITY"),
        "{}",
        answer.text()
    );
    drop(open);
}

#[test]
fn sandbox_pauses_at_once_and_a_delete_during_a_resume_are_race_free() {
    if skip() {
        return;
    }
    let daemon = Daemon::start(&[]);
    let id = daemon.create("");
    daemon.wait_ready(&id);
    let (path, token) = daemon.execd(&id);
    // Fill memory, so that a pause has something to offload and takes a while.
    assert_eq!(
        outcome(&daemon.command(&id, "fill 64MiB random seed=1")).1,
        0
    );
    // Two pauses at once: one pauses, the other is told why not (busy, or paused already).
    let statuses: Vec<(u16, String)> = std::thread::scope(|s| {
        let pauses: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let answer = daemon.api("POST", &format!("/v1/sandboxes/{id}/pause"), None);
                    let code = if answer.status == 202 {
                        String::new()
                    } else {
                        answer.code()
                    };
                    (answer.status, code)
                })
            })
            .collect();
        pauses.into_iter().map(|p| p.join().unwrap()).collect()
    });
    let mut sorted = statuses.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        vec![(202, String::new()), (409, "INVALID_STATE".to_owned())],
        "{statuses:?}"
    );
    // A command on a paused sandbox: a clear 503 before any stream.
    let answer = request(
        &daemon.addr,
        "POST",
        &format!("{path}/command"),
        &[("X-Pvisor-Sandbox-Token", &token)],
        Some(r#"{"command":"digest"}"#),
    );
    assert_eq!(
        (answer.status, answer.code().as_str()),
        (503, "SANDBOX_NOT_RUNNING")
    );
    // A resume and a delete at once: the delete wins in the end, whatever the order.
    let pids = vm_pids(&daemon.state());
    assert!(!pids.is_empty());
    let (resume, delete) = std::thread::scope(|s| {
        let resume = s.spawn(|| {
            daemon
                .api("POST", &format!("/v1/sandboxes/{id}/resume"), None)
                .status
        });
        let delete = s.spawn(|| {
            daemon
                .api("DELETE", &format!("/v1/sandboxes/{id}"), None)
                .status
        });
        (resume.join().unwrap(), delete.join().unwrap())
    });
    assert_eq!(delete, 204);
    assert!([202, 404, 409].contains(&resume), "{resume}");
    assert_eq!(
        daemon
            .api("GET", &format!("/v1/sandboxes/{id}"), None)
            .status,
        404
    );
    daemon.wait_gone(&pids, Duration::from_secs(5));
    assert!(!daemon.state().join("vms").join(&id).exists());
}

#[test]
fn daemon_refuses_a_state_directory_too_deep_for_its_vms_sockets() {
    let dir = tempfile::tempdir().unwrap();
    // Deep enough that STATE/vms/ID/control.sock would be over a socket path's 107 bytes.
    let deep = dir.path().join("d".repeat(100)).join("state");
    let stderr = common::refusal(&deep, &[], &[]);
    assert!(stderr.contains("too deep"), "{stderr}");
    assert!(!deep.exists(), "the refused state directory was made");
}

#[test]
fn daemon_refuses_to_start_without_a_key_or_off_loopback_without_auth() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let run = move |args: &[&str]| {
        Command::new(common::binary())
            .args([
                "--state",
                state.to_str().unwrap(),
                "--memory-budget",
                "1GiB",
            ])
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["--listen", "127.0.0.1:0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--api-key-file"));
    let out = run(&["--listen", "0.0.0.0:0", "--no-auth"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("loopback"),
        "{out:?}"
    );
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n").unwrap();
    std::fs::set_permissions(&empty, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let out = run(&[
        "--listen",
        "127.0.0.1:0",
        "--api-key-file",
        empty.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("non-empty"),
        "{out:?}"
    );
    // A key others can read (whoever reads it can run commands in every sandbox), a FIFO (its
    // read would never end), a symbolic link: refused at once, each saying why.
    let shared = dir.path().join("shared");
    std::fs::write(&shared, "a-key\n").unwrap();
    std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let fifo = dir.path().join("fifo");
    testkit::mkfifo(&fifo);
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&empty, &link).unwrap();
    for (key, why) in [(&shared, "chmod 600"), (&fifo, "FIFO"), (&link, "link")] {
        let out = testkit::within(Duration::from_secs(10), "starting on a bad key file", {
            let key = key.clone();
            let run = run.clone();
            move || {
                run(&[
                    "--listen",
                    "127.0.0.1:0",
                    "--api-key-file",
                    key.to_str().unwrap(),
                ])
            }
        });
        assert!(!out.status.success(), "{key:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(why),
            "{key:?}: {out:?}"
        );
    }
}

/// Waits (at most `within`) until `ok` holds; false if it never did.
fn eventually(within: Duration, mut ok: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    ok()
}

/// Waits up to 20 s for the daemon's log to hold `text`.
fn wait_for_log(daemon: &Daemon, text: &str) {
    let found = eventually(Duration::from_secs(20), || daemon.log().contains(text));
    assert!(found, "no `{text}` in the log: {}", daemon.log());
}

/// A new sandbox that has filled 64 MiB of random data: its id, the data's digest, its VM's
/// pid and that VM's resident bytes.
fn filled_sandbox(daemon: &Daemon, seed: u32) -> (String, String, u32, u64) {
    filled_with(daemon, 64, seed)
}

/// `filled_sandbox` with `mib` MiB.
fn filled_with(daemon: &Daemon, mib: u64, seed: u32) -> (String, String, u32, u64) {
    let id = daemon.create("");
    daemon.wait_ready(&id);
    let fill = format!("fill {mib}MiB random seed={seed}; digest");
    let (stdout, code) = outcome(&daemon.command(&id, &fill));
    assert_eq!(code, 0);
    let digest = stdout[1]["digest"].as_str().unwrap().to_owned();
    let vm = daemon.vm_pid(&id);
    let full = rss_bytes(vm);
    assert!(full >= mib << 20, "{full}");
    (id, digest, vm, full)
}

#[test]
fn idle_sandbox_resumed_eagerly_has_its_memory_back_before_its_command_reads_any() {
    if skip() {
        return;
    }
    let daemon = Daemon::start(&["--idle-offload", "2s", "--idle-resume", "eager"]);
    let (id, digest, vm, full) = filled_sandbox(&daemon, 6);
    wait_for_log(&daemon, "offloaded while idle");
    assert!(rss_bytes(vm) + (48 << 20) <= full, "{}", rss_bytes(vm));
    // A command that reads none of the working set finds it resident (a lazy resume would
    // have brought back only what the command touched), and the log says how it came back.
    let (_, code) = outcome(&daemon.command(&id, "sleep 1"));
    assert_eq!(code, 0);
    let back = rss_bytes(vm);
    assert!(
        back >= 64 << 20,
        "resident {back} bytes after an eager resume"
    );
    let log = daemon.log();
    assert!(
        log.lines()
            .any(|l| l.contains("back for a command") && l.contains("eager=true")),
        "{log}"
    );
    let (stdout, code) = outcome(&daemon.command(&id, "digest"));
    assert_eq!(
        (stdout[0]["digest"].as_str().unwrap(), code),
        (digest.as_str(), 0)
    );
}

/// A daemon that offloads after 1 s idle and resumes eagerly, and its sandbox, filled with
/// 256 MiB (seed `seed`: its digest) and offloaded while idle since: its next command's
/// resume takes a while.
fn offloaded_for_an_eager_resume(seed: u32) -> (Daemon, String, String) {
    let daemon = Daemon::start(&["--idle-offload", "1s", "--idle-resume", "eager"]);
    let (id, digest, _, _) = filled_with(&daemon, 256, seed);
    wait_for_log(&daemon, "offloaded while idle");
    (daemon, id, digest)
}

#[test]
fn idle_sandbox_whose_client_leaves_during_its_resume_still_runs_the_next_command() {
    if skip() {
        return;
    }
    // An eager resume of 256 MiB takes a while: the client leaves in the middle of it.
    let (daemon, id, digest) = offloaded_for_an_eager_resume(7);
    let (path, token) = daemon.execd(&id);
    let raw = testkit::http::raw_request(
        &daemon.addr,
        "POST",
        &format!("{path}/command"),
        &[("X-Pvisor-Sandbox-Token", &token)],
        Some(r#"{"command":"digest"}"#),
    );
    let mut gone = std::net::TcpStream::connect(&daemon.addr).unwrap();
    std::io::Write::write_all(&mut gone, &raw).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    drop(gone);
    // The resume it asked for ends, and the sandbox knows its VM is back: the next command
    // runs (it failed with "not suspended" when the dropped request took the resume's end
    // with it) and finds every byte.
    let (stdout, code) = outcome(&daemon.command(&id, "digest"));
    assert_eq!(
        (stdout[0]["digest"].as_str().unwrap_or_default(), code),
        (digest.as_str(), 0),
        "{stdout:?}; {}",
        daemon.log()
    );
}

#[test]
fn pause_during_an_idle_resume_waits_for_it_then_pauses() {
    if skip() {
        return;
    }
    let (daemon, id, digest) = offloaded_for_an_eager_resume(3);
    let pause = format!("/v1/sandboxes/{id}/pause");
    let resumes = || daemon.log().matches("resuming for a command").count();
    let before = resumes();
    std::thread::scope(|s| {
        // A command brings the sandbox back (an eager resume of 256 MiB: a while)...
        let command = s.spawn(|| outcome(&daemon.command(&id, "digest")));
        // (Its resume begun: a pause sent first found the sandbox idle and paused it, and the
        // command then found it paused.)
        let deadline = Instant::now() + Duration::from_secs(20);
        while resumes() == before {
            assert!(Instant::now() < deadline, "no resume: {}", daemon.log());
            std::thread::sleep(Duration::from_millis(2));
        }
        // ...and a pause meanwhile waits for that resume, then pauses (it answered 409 busy).
        let paused = daemon.api("POST", &pause, None);
        assert_eq!(paused.status, 202, "{}; {}", paused.text(), daemon.log());
        assert!(daemon
            .log()
            .contains("pause waits for the daemon's idle offload or resume"));
        let get = daemon.api("GET", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(get.json()["status"]["state"], "Paused");
        // Resumed, the command (suspended with its VM) ends with every byte right.
        let resume = format!("/v1/sandboxes/{id}/resume");
        assert_eq!(daemon.api("POST", &resume, None).status, 202);
        let (stdout, code) = command.join().unwrap();
        assert_eq!(
            (stdout[0]["digest"].as_str(), code),
            (Some(digest.as_str()), 0)
        );
    });
}

#[test]
fn idle_sandbox_is_offloaded_and_comes_back_on_its_next_command() {
    if skip() {
        return;
    }
    let mut daemon = Daemon::start(&["--idle-offload", "1s"]);
    let (id, digest, vm, full) = filled_sandbox(&daemon, 5);

    // Idle for a second: the daemon offloads it on its own; the client still sees Running.
    assert!(
        eventually(Duration::from_secs(20), || rss_bytes(vm) + (48 << 20)
            <= full),
        "resident {} bytes, was {full}; {}",
        rss_bytes(vm),
        daemon.log()
    );
    // (The memory goes while the offload runs; its log line comes once it is done.)
    wait_for_log(&daemon, "offloaded while idle");
    let get = daemon
        .api("GET", &format!("/v1/sandboxes/{id}"), None)
        .json();
    assert_eq!(get["status"]["state"], "Running");
    daemon.wait_ready(&id);

    // Its next command brings it back: same data, the memory in again.
    let (stdout, code) = outcome(&daemon.command(&id, "digest; task"));
    assert_eq!(
        (stdout[0]["digest"].as_str().unwrap(), code),
        (digest.as_str(), 0)
    );
    assert!(rss_bytes(vm) >= 64 << 20, "{}", rss_bytes(vm));
    assert!(
        daemon.log().contains("back for a command"),
        "{}",
        daemon.log()
    );
    // The metrics say so, and what the VM is charged for now.
    let metrics = daemon.api("GET", "/metrics", None);
    assert_eq!(metrics.status, 200, "{}", metrics.text());
    let metrics = metrics.text();
    let value = |line: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no `{line}` in\n{metrics}"))
    };
    assert_eq!(value("pvisor_sandboxes{state=\"Running\"}"), 1.0);
    assert!(value("pvisor_sandbox_idle_offloads_total") >= 1.0);
    assert_eq!(value("pvisor_sandbox_commands_total"), 2.0);
    assert!(value("pvisor_sandbox_resume_seconds_count{by=\"idle\"}") >= 1.0);
    let charged = value(&format!(
        "pvisor_sandbox_memory_charged_bytes{{id=\"{id}\"}}"
    ));
    assert!(charged >= f64::from(64u32 << 20), "{metrics}");
    assert!(value("pvisor_sandboxes_memory_charged_bytes") >= charged);
    let anonymous = request(&daemon.addr, "GET", "/metrics", &[], None);
    assert_eq!(anonymous.status, 401);

    // Idle again, then paused: the pause takes the offloaded VM as it is; a resume and a
    // command find every byte.
    assert!(
        eventually(Duration::from_secs(20), || rss_bytes(vm) + (48 << 20)
            <= full),
        "not offloaded again; {}",
        daemon.log()
    );
    let paused = daemon.api("POST", &format!("/v1/sandboxes/{id}/pause"), None);
    assert_eq!(paused.status, 202, "{}", paused.text());
    assert_eq!(
        daemon
            .api("GET", &format!("/v1/sandboxes/{id}"), None)
            .json()["status"]["state"],
        "Paused"
    );
    let resumed = daemon.api("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(resumed.status, 202, "{}", resumed.text());
    let (stdout, code) = outcome(&daemon.command(&id, "digest"));
    assert_eq!(
        (stdout[0]["digest"].as_str().unwrap(), code),
        (digest.as_str(), 0)
    );
    let metrics = daemon.api("GET", "/metrics", None).text();
    for line in [
        "pvisor_sandbox_pauses_total 1",
        "pvisor_sandbox_resume_seconds_count{by=\"api\"} 1",
        "pvisor_sandbox_creates_total 1",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "no `{line}` in\n{metrics}"
        );
    }

    // Offloaded while idle when the daemon is killed: the next daemon takes it back as it
    // is, and its next command brings it back.
    assert!(
        eventually(Duration::from_secs(20), || daemon
            .log()
            .matches("offloaded while idle id=")
            .count()
            >= 3),
        "not offloaded again; {}",
        daemon.log()
    );
    daemon.restart();
    assert!(daemon.log().contains("offloaded=true"), "{}", daemon.log());
    assert_eq!(
        daemon
            .api("GET", &format!("/v1/sandboxes/{id}"), None)
            .json()["status"]["state"],
        "Running"
    );
    assert!(rss_bytes(vm) + (48 << 20) <= full, "{}", rss_bytes(vm));
    let (stdout, code) = outcome(&daemon.command(&id, "digest"));
    assert_eq!(
        (stdout[0]["digest"].as_str().unwrap(), code),
        (digest.as_str(), 0)
    );
    assert_eq!(
        daemon
            .api("DELETE", &format!("/v1/sandboxes/{id}"), None)
            .status,
        204
    );
}

#[test]
fn daemon_refuses_requests_past_its_rate_and_serves_again_after() {
    let daemon = Daemon::start(&["--max-request-rate", "20"]);
    // Without the key too: a client that has none floods as well.
    let answers: Vec<common::Answer> = (0..60)
        .map(|i| {
            let key = if i % 2 == 0 { common::KEY } else { "wrong" };
            request(
                &daemon.addr,
                "GET",
                "/v1/sandboxes",
                &[("OPEN-SANDBOX-API-KEY", key)],
                None,
            )
        })
        .collect();
    let limited: Vec<&common::Answer> = answers.iter().filter(|a| a.status == 429).collect();
    // 20 a second: the 60 requests take well under 2 s here, so at least 20 are refused.
    assert!(limited.len() >= 20, "{} refused", limited.len());
    assert!(answers.iter().all(|a| [200, 401, 429].contains(&a.status)));
    assert_eq!(limited[0].code(), "RATE_LIMITED");
    assert_eq!(limited[0].header("retry-after").as_deref(), Some("1"));
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(daemon.api("GET", "/v1/sandboxes", None).status, 200);
    let metrics = daemon.api("GET", "/metrics", None).text();
    let counted: f64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("pvisor_sandbox_requests_rate_limited_total ")?
                .parse()
                .ok()
        })
        .unwrap();
    assert!(counted >= limited.len() as f64, "{metrics}");
}

/// A sandbox of the workload guest that idles, ready: its id.
fn idle_sandbox(daemon: &Daemon) -> String {
    let created = daemon.api(
        "POST",
        "/v1/sandboxes",
        Some(r#"{"image":{"uri":"pvisor:workload"},"timeout":600,"resourceLimits":{},"entrypoint":["idle"]}"#),
    );
    assert_eq!(created.status, 202, "{}", created.text());
    let id = created.json()["id"].as_str().unwrap().to_owned();
    daemon.wait_ready(&id);
    id
}

/// An image of one file, `lib/a.so` of `len` bytes, indexed under `dir/image`: its root and
/// the file's bytes.
fn one_file_image(dir: &std::path::Path, len: u32) -> (std::path::PathBuf, Vec<u8>) {
    let root = dir.join("image");
    std::fs::create_dir_all(root.join("lib")).unwrap();
    let lib: Vec<u8> = (0..len).map(|i| (i % 239) as u8).collect();
    std::fs::write(root.join("lib/a.so"), &lib).unwrap();
    vmm::image::index(&root).unwrap();
    (root, lib)
}

/// Sandbox `id` reads `lib/a.so` twice (its length checked) and digests it: `lib` each time.
fn read_twice(daemon: &Daemon, id: &str, lib: &[u8]) {
    let script = format!("read lib/a.so bytes={}; read lib/a.so; digest", lib.len());
    let events = daemon.command(id, &script);
    let (stdout, code) = outcome(&events);
    assert_eq!(code, 0, "{events:?}");
    let digest = vmm::guest::digest_hex(lib);
    for line in &stdout {
        assert_eq!(line["digest"], digest.as_str(), "{stdout:?}");
    }
}

#[test]
fn sandbox_downloads_from_the_origins_the_daemon_allows_only() {
    if skip() {
        return;
    }
    // An origin that answers every GET with the same 200000 bytes.
    let body: Vec<u8> = (0..200_000u32).map(|i| (i % 241) as u8).collect();
    let url = testkit::http::serve_body(body.clone(), None);
    let daemon = Daemon::start(&["--sandbox-net-allow", &url]);
    let id = idle_sandbox(&daemon);
    let events = daemon.command(&id, &format!("download {url}/pkg.tar bytes=200000; digest"));
    let (stdout, code) = outcome(&events);
    assert_eq!(code, 0, "{events:?}");
    let digest = vmm::guest::digest_hex(&body);
    assert_eq!(stdout[0]["download_bytes"], 200_000, "{stdout:?}");
    assert_eq!(stdout[1]["digest"], digest.as_str(), "{stdout:?}");
    // Any other origin is refused: the command fails with the reason, the sandbox goes on.
    let events = daemon.command(&id, "download http://127.0.0.1:9/x");
    let (_, code) = outcome(&events);
    assert_eq!(code, 1, "{events:?}");
    assert!(
        stderr_of(&events).contains("not an allowed origin"),
        "{events:?}"
    );
    let (stdout, code) = outcome(&daemon.command(&id, "digest"));
    assert_eq!(
        (code, stdout[0]["digest"].as_str()),
        (0, Some(digest.as_str()))
    );
}

#[test]
fn sandbox_reads_files_of_the_daemons_image_fetched_on_first_read() {
    if skip() {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let (root, lib) = one_file_image(work.path(), 300_000);
    let daemon = Daemon::start(&["--sandbox-image", root.to_str().unwrap()]);
    let id = idle_sandbox(&daemon);
    read_twice(&daemon, &id, &lib);
    // Not in the image: the command fails with the reason.
    let events = daemon.command(&id, "read lib/b.so");
    let (_, code) = outcome(&events);
    assert_eq!(code, 1, "{events:?}");
    assert!(
        stderr_of(&events).contains("not in the image"),
        "{events:?}"
    );
}

#[test]
fn sandbox_reads_files_of_an_image_in_an_object_store() {
    if skip() {
        return;
    }
    // An image of one file, put in a bucket of a real S3 server.
    let work = tempfile::tempdir().unwrap();
    let (root, lib) = one_file_image(work.path(), 400_000);
    let server = testkit::s3::S3Server::start();
    server.create_bucket("images");
    for name in ["image.json", "lib/a.so"] {
        let object = server.object_path("images", &format!("base/{name}"));
        std::fs::create_dir_all(object.parent().unwrap()).unwrap();
        std::fs::copy(root.join(name), object).unwrap();
    }
    let endpoint = server.endpoint();
    // A prefix with no image there: the daemon refuses to start, and says why.
    let flags = [
        "--sandbox-image",
        "s3://images/other",
        "--s3-endpoint",
        &endpoint,
    ];
    let stderr = common::refusal(&work.path().join("state"), &flags, &server.env());
    assert!(stderr.contains("no manifest"), "{stderr}");
    let flags = [
        "--sandbox-image",
        "s3://images/base",
        "--s3-endpoint",
        endpoint.as_str(),
    ];
    let daemon = Daemon::start_env(&flags, &server.env());
    let id = idle_sandbox(&daemon);
    read_twice(&daemon, &id, &lib);
    let digest = vmm::guest::digest_hex(&lib);
    // A second sandbox reads it from the daemon's staging: the bucket served it once.
    let other = idle_sandbox(&daemon);
    let events = daemon.command(&other, "read lib/a.so; digest");
    let (stdout, code) = outcome(&events);
    assert_eq!(
        (code, stdout[0]["digest"].as_str()),
        (0, Some(digest.as_str()))
    );
    let served = server.bytes_out();
    assert!(served < 2 * lib.len() as u64, "{served} bytes served");
}
