//! Snapshot templates (`--template NAME=DIR|s3://BUCKET/PREFIX`): sandboxes restored from a snapshot made with
//! `pvisor snapshot`, each into its own RAM, with real VMs (/dev/kvm, /dev/userfaultfd).

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

mod common;
use common::{outcome, refusal, skip, Daemon};
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
    let (snap, filled) = template_snapshot(snaps.path());
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

/// A snapshot of a 64 MiB VM that filled 24 MiB, in `dir`; with the digest of its data.
fn template_snapshot(dir: &std::path::Path) -> (std::path::PathBuf, String) {
    template_snapshot_kept(dir, None)
}

/// The same, its RAM kept as `store` says (`None`: raw).
fn template_snapshot_kept(
    dir: &std::path::Path,
    store: Option<vmm::snapshot::RamStore>,
) -> (std::path::PathBuf, String) {
    let snap = dir.join("base");
    let mut vm = Vm::start(VmOptions {
        io_threads: 1,
        ..VmOptions::new(64 << 20, RamKind::Anon, dir.join("disk"), dir.join("ram"))
    })
    .unwrap();
    let out = vm
        .exec(&script::parse("fill 24MiB random seed=21; digest").unwrap())
        .unwrap();
    vm.snapshot(&snap, store).unwrap();
    (snap, out[1].digest.clone().unwrap())
}

#[test]
fn sandboxes_of_a_template_in_an_object_store_start_from_its_state() {
    if skip() {
        return;
    }
    // The template: the snapshot kept in a store (lz4) and uploaded to a real S3 server.
    let snaps = tempfile::tempdir().unwrap();
    let (snap, filled) = template_snapshot_kept(
        snaps.path(),
        Some(vmm::snapshot::RamStore::new(
            compressed_backing::CodecConfig::new(compressed_backing::Codec::Lz4),
        )),
    );
    let server = testkit::s3::S3Server::start();
    server.create_bucket("snaps");
    let endpoint = server.endpoint();
    let mut options = compressed_backing::remote::RemoteOptions::new();
    options.endpoint = Some(endpoint.clone());
    options.credentials = Some((
        testkit::s3::ACCESS_KEY.to_owned(),
        testkit::s3::SECRET_KEY.to_owned(),
    ));
    options.cache_dir = snaps.path().join("cache");
    let url = compressed_backing::remote::RemoteUrl::parse("s3://snaps/base").unwrap();
    let remote = compressed_backing::remote::Remote::connect(&url, &options).unwrap();
    vmm::snapshot::upload(&snap, &remote, None, &|_| {}).unwrap();
    std::fs::remove_dir_all(&snap).unwrap();
    // Two sandboxes start from the snapshot's data, each in its own RAM.
    let daemon = Daemon::start_env(
        &[
            "--template",
            "base=s3://snaps/base",
            "--s3-endpoint",
            &endpoint,
        ],
        &server.env(),
    );
    let a = create(&daemon, r#""image":{"uri":"base"}"#);
    let b = create(&daemon, r#""snapshotId":"base""#);
    for id in [&a, &b] {
        daemon.wait_ready(id);
        assert_eq!(digest(&daemon, id, "digest"), filled);
    }
    let written = digest(&daemon, &a, "rewrite 50 seed=3; digest");
    assert_ne!(written, filled);
    assert_eq!(digest(&daemon, &b, "digest"), filled);
    drop(daemon);
    // A prefix that holds no snapshot stops the daemon with the template's name.
    let flags = [
        "--template",
        "gone=s3://snaps/none",
        "--s3-endpoint",
        &endpoint,
    ];
    let stderr = refusal(&snaps.path().join("state"), &flags, &server.env());
    assert!(stderr.contains("template `gone`"), "{stderr}");
}

/// KSM's global knobs that VMs tune: run, pages_to_scan, sleep_millisecs.
fn ksm_knobs() -> [String; 3] {
    ["run", "pages_to_scan", "sleep_millisecs"]
        .map(|k| std::fs::read_to_string(format!("/sys/kernel/mm/ksm/{k}")).unwrap())
}

/// Pages of process `pid` that KSM has merged.
fn ksm_merged_pages(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/ksm_merging_pages"))
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn sandboxes_of_a_template_share_the_pages_they_restored_alike() {
    if skip() || !std::path::Path::new("/sys/kernel/mm/ksm/run").exists() {
        return;
    }
    let before = ksm_knobs();
    let snaps = tempfile::tempdir().unwrap();
    let (snap, filled) = template_snapshot(snaps.path());
    let template = format!("base={}", snap.display());
    // Stopped on exit: its VMs end cleanly and give KSM's settings back (a VM killed with
    // -9 leaves them tuned until the next VM that tunes KSM prunes its lease).
    let daemon = Daemon::start(&[
        "--template",
        &template,
        "--share-template-pages",
        "--stop-on-exit",
    ]);
    let ids: Vec<String> = (0..3)
        .map(|_| create(&daemon, r#""image":{"uri":"base"}"#))
        .collect();
    for id in &ids {
        daemon.wait_ready(id);
        // Each reads the 24 MiB back from the snapshot into its own RAM.
        assert_eq!(digest(&daemon, id, "digest"), filled);
    }
    // KSM keeps them once: most of each VM's 6144 pages of data end up merged.
    let pids: Vec<u32> = ids.iter().map(|id| daemon.vm_pid(id)).collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    loop {
        let merged: Vec<u64> = pids.iter().map(|&pid| ksm_merged_pages(pid)).collect();
        if merged.iter().all(|&m| m >= 5000) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "merged pages per VM: {merged:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    // Copy-on-write: one's writes are its own.
    let written = digest(&daemon, &ids[0], "rewrite 50 seed=5; digest");
    assert_ne!(written, filled);
    assert_eq!(digest(&daemon, &ids[1], "digest"), filled);
    assert_eq!(digest(&daemon, &ids[2], "digest"), filled);
    // The host's KSM settings come back once the daemon has stopped the VMs.
    drop(daemon);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while ksm_knobs() != before && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(ksm_knobs(), before);
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
        let stderr = refusal(&dir.path().join("state"), &["--template", &template], &[]);
        assert!(stderr.contains(says), "{template}: {stderr}");
    }
}

#[test]
fn daemon_refuses_an_image_without_a_manifest_and_a_bad_origin() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let image = empty.to_str().unwrap().to_owned();
    for (flag, value, says) in [
        ("--sandbox-image", image.as_str(), "image.json"),
        (
            "--sandbox-image",
            "ftp://mirror/image",
            "expected a directory, s3://",
        ),
        (
            "--sandbox-net-allow",
            "https://mirror:443",
            "--sandbox-net-allow",
        ),
    ] {
        let stderr = refusal(&dir.path().join("state"), &[flag, value], &[]);
        assert!(stderr.contains(says), "{flag} {value}: {stderr}");
    }
}
