//! Snapshot templates (`--template NAME=DIR`): sandboxes restored from a snapshot made with
//! `pvisor snapshot`, each into its own RAM, with real VMs (/dev/kvm, /dev/userfaultfd).

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::process::Command;

mod common;
use common::{binary, outcome, skip, Daemon};
use uffd_pager::pager::RamKind;
use vmm::script;
use vmm::vm::{Vm, VmOptions};

/// The digest `digest` prints in sandbox `id`.
fn digest(daemon: &Daemon, id: &str, script: &str) -> String {
    let (stdout, code) = outcome(&daemon.command(id, script));
    assert_eq!(code, 0, "{stdout:?}");
    stdout.last().unwrap()["digest"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Creates a sandbox with `body`'s template fields; its id.
fn create(daemon: &Daemon, fields: &str) -> String {
    let body = format!(r#"{{{fields},"entrypoint":["tail","-f","/dev/null"]}}"#);
    let answer = daemon.api("POST", "/v1/sandboxes", Some(&body));
    assert_eq!(answer.status, 202, "{}", answer.text());
    answer.json()["id"].as_str().unwrap().to_owned()
}

#[test]
fn sandboxes_of_a_snapshot_template_start_from_its_state_and_keep_their_writes_apart() {
    if skip() {
        return;
    }
    // The template: a VM of 64 MiB that filled 24 MiB, snapshotted.
    let snaps = tempfile::tempdir().unwrap();
    let snap = snaps.path().join("base");
    let filled = {
        let mut vm = Vm::start(VmOptions {
            io_threads: 1,
            ..VmOptions::new(
                64 << 20,
                RamKind::Anon,
                snaps.path().join("disk"),
                snaps.path().join("ram"),
            )
        })
        .unwrap();
        let out = vm
            .exec(&script::parse("fill 24MiB random seed=21; digest").unwrap())
            .unwrap();
        vm.snapshot(&snap, None).unwrap();
        out[1].digest.clone().unwrap()
    };
    let template = format!("base={}", snap.display());
    let daemon = Daemon::start(&["--template", &template]);
    // One by image.uri, one by snapshotId: both start from the snapshot's data.
    let a = create(&daemon, r#""image":{"uri":"base"}"#);
    let b = create(&daemon, r#""snapshotId":"base""#);
    for id in [&a, &b] {
        daemon.wait_ready(id);
        assert_eq!(digest(&daemon, id, "digest"), filled);
        let got = daemon
            .api("GET", &format!("/v1/sandboxes/{id}"), None)
            .json();
        assert_eq!(got["image"]["uri"], "base", "{got}");
    }
    // What one writes, the other and the snapshot never see.
    let written = digest(&daemon, &a, "rewrite 50 seed=3; digest");
    assert_ne!(written, filled);
    assert_eq!(digest(&daemon, &b, "digest"), filled);
    assert_eq!(digest(&daemon, &a, "digest"), written);
    // A fresh one of the same template still starts from the snapshot.
    let c = create(&daemon, r#""image":{"uri":"base"}"#);
    daemon.wait_ready(&c);
    assert_eq!(digest(&daemon, &c, "digest"), filled);
    // Names it does not serve, and both fields at once, are refused with the names it does.
    for fields in [
        r#""image":{"uri":"other"}"#,
        r#""snapshotId":"pvisor:nothing""#,
        r#""image":{"uri":"base"},"snapshotId":"base""#,
    ] {
        let body = format!("{{{fields}}}");
        let answer = daemon.api("POST", "/v1/sandboxes", Some(&body));
        assert_eq!(answer.status, 400, "{fields}: {}", answer.text());
    }
    let answer = daemon.api(
        "POST",
        "/v1/sandboxes",
        Some(r#"{"image":{"uri":"other"}}"#),
    );
    assert!(answer.text().contains("`base`"), "{}", answer.text());
}

#[test]
fn daemon_refuses_a_template_that_is_no_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    for (template, says) in [
        (format!("e={}", empty.display()), "template `e`"),
        (
            format!("e={}", dir.path().join("missing").display()),
            "template `e`",
        ),
        ("pvisor:workload=/x".to_owned(), "served always"),
        ("no-dir".to_owned(), "NAME=DIR"),
    ] {
        let out = Command::new(binary())
            .args(["--listen", "127.0.0.1:0", "--state"])
            .arg(dir.path().join("state"))
            .args([
                "--memory-budget",
                "1GiB",
                "--no-auth",
                "--template",
                &template,
            ])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{template}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(says), "{template}: {stderr}");
    }
}
