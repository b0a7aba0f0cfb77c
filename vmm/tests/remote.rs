//! Snapshots in an object store (a real S3 server on loopback, `testkit::s3`): written by one
//! "host", continued on others. Each host is a runtime directory and a cache of its own, and
//! every VM a fresh process; the writer's cache is deleted before anyone restores.

mod common;

use std::path::Path;

use common::{fails, skip, Detached, RUN_DETACHED};
use testkit::s3::S3Server;

/// `args` followed by the options that reach the server and name the host's cache.
fn with_remote(args: &[&str], endpoint: &str, cache: &Path) -> Vec<String> {
    let mut all: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    all.extend(
        [
            "--s3-endpoint",
            endpoint,
            "--s3-retry-timeout",
            "5",
            "--cache",
            cache.to_str().expect("a UTF-8 path"),
        ]
        .map(str::to_owned),
    );
    all
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

#[test]
fn snapshots_in_a_bucket_continue_on_another_host_lazily_with_their_working_set() {
    if skip() {
        return;
    }
    let mut server = S3Server::start();
    server.create_bucket("snaps");
    // One test in this file: the environment is the test's own to set, and the VM processes
    // inherit it (credentials come from the standard AWS variables).
    for (key, value) in server.env() {
        std::env::set_var(key, value);
    }
    let endpoint = server.endpoint();
    let tmp = tempfile::tempdir().unwrap();
    let host = |name: &str| {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(dir.join("runtime")).unwrap();
        dir
    };
    let a = host("a");
    let origin = Detached::start(&a.join("runtime"), &[], "fill 32MiB random seed=31; idle");
    let digest = origin.digest();
    let args = with_remote(&["--out", "s3://snaps/vm-lz4"], &endpoint, &a.join("cache"));
    let report = origin.call("snapshot", &strs(&args));
    assert!(
        report["uploaded"]["ram"]["chunks"].as_u64().unwrap() >= 1,
        "{report}"
    );
    let raw = with_remote(
        &["--out", "s3://snaps/vm-raw", "--codec", "none"],
        &endpoint,
        &a.join("cache"),
    );
    origin.call("snapshot", &strs(&raw));
    // Larger blocks: fewer requests for a lazy restore (docs/bench/remote-sizes.md).
    let large = with_remote(
        &["--out", "s3://snaps/vm-1m", "--block-size", "1MiB"],
        &endpoint,
        &a.join("cache"),
    );
    origin.call("snapshot", &strs(&large));
    let bad = with_remote(
        &["--out", "s3://snaps/vm-bad", "--block-size", "3KiB"],
        &endpoint,
        &a.join("cache"),
    );
    let err = origin.call_fails("snapshot", &strs(&bad));
    assert!(
        err.contains("--block-size") && err.contains("power of two"),
        "{err}"
    );
    let local = a.join("raw-snapshot");
    let err = origin.call_fails(
        "snapshot",
        &["--out", local.to_str().unwrap(), "--block-size", "1MiB"],
    );
    assert!(err.contains("needs --codec"), "{err}");
    // Sealed with a key (made before the origin goes).
    let key = a.join("key");
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&key)
            .unwrap();
        writeln!(f, "{}", "3c".repeat(32)).unwrap();
    }
    let key_arg = key.to_str().unwrap().to_owned();
    let sealed = with_remote(
        &["--out", "s3://snaps/vm-sealed", "--store-key", &key_arg],
        &endpoint,
        &a.join("cache"),
    );
    origin.call("snapshot", &strs(&sealed));
    // The disk and the RAM store are under the upload's own sub-prefix.
    let disk_key = server
        .keys("snaps", "vm-sealed/")
        .into_iter()
        .find(|k| k.starts_with("vm-sealed/up-") && k.ends_with("/disk.img"))
        .expect("the disk under the upload's sub-prefix");
    let disk = std::fs::read(server.object_path("snaps", &disk_key)).unwrap();
    assert!(disk.starts_with(b"PVSEALO1"), "the disk is sealed too");
    let manifest = std::fs::read(server.object_path("snaps", "vm-sealed/manifest.json")).unwrap();
    assert!(manifest.starts_with(b"PVSEALO1"), "and the manifest");
    // A prefix that holds a snapshot is never written over.
    let err = origin.call_fails("snapshot", &strs(&args));
    assert!(err.contains("exists already"), "{err}");
    // Two uploads racing for one prefix (each past the check that it is free, the round trip
    // slowed): one manifest lands, the loser deletes its own sub-prefix, and what is there
    // restores whole (below).
    let rival = Detached::start(&a.join("runtime"), &[], "fill 32MiB random seed=32; idle");
    let rival_digest = rival.digest();
    let race = with_remote(&["--out", "s3://snaps/race"], &endpoint, &a.join("cache"));
    server.set_delay(std::time::Duration::from_millis(20));
    let outcomes: Vec<std::process::Output> = std::thread::scope(|scope| {
        let runs: Vec<_> = [&origin, &rival]
            .into_iter()
            .map(|vm| {
                let mut args = vec!["snapshot", vm.job()];
                args.extend(strs(&race));
                let runtime = &vm.runtime;
                scope.spawn(move || common::pvisor(runtime, &args))
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    server.set_delay(std::time::Duration::ZERO);
    let won: Vec<bool> = outcomes.iter().map(|o| o.status.success()).collect();
    assert_eq!(
        won.iter().filter(|&&w| w).count(),
        1,
        "one upload wins: {outcomes:?}"
    );
    let lost = outcomes.iter().find(|o| !o.status.success()).unwrap();
    assert!(
        common::text(&lost.stderr).contains("exists already"),
        "{}",
        common::text(&lost.stderr)
    );
    let winner_digest = if won[0] { digest.clone() } else { rival_digest };
    let uploads: std::collections::BTreeSet<String> = server
        .keys("snaps", "race/")
        .into_iter()
        .filter_map(|k| {
            k.strip_prefix("race/")?
                .split_once('/')
                .map(|(id, _)| id.to_owned())
        })
        .collect();
    assert_eq!(
        uploads.len(),
        1,
        "the loser's objects are gone: {uploads:?}"
    );
    drop(rival);
    drop(origin);
    std::fs::remove_dir_all(a.join("cache")).unwrap();

    // Host B: both snapshots restored with the right bytes; faults fetch block by block.
    let b = host("b");
    let mut restored = Vec::new();
    for prefix in ["s3://snaps/vm-lz4", "s3://snaps/vm-raw"] {
        let extra = with_remote(&["--restore", prefix], &endpoint, &b.join("cache"));
        let before = server.requests();
        let vm = Detached::start(&b.join("runtime"), &strs(&extra), "idle");
        assert_eq!(vm.digest(), digest, "{prefix}");
        let requests = server.requests() - before;
        // 32 MiB touched in 64 KiB blocks, no working set yet: about one request each.
        assert!(requests >= 450, "{prefix}: {requests} requests");
        restored.push(vm);
    }
    // 1 MiB blocks: a fault per MiB.
    let extra = with_remote(
        &["--restore", "s3://snaps/vm-1m"],
        &endpoint,
        &b.join("cache"),
    );
    let before = server.requests();
    let vm = Detached::start(&b.join("runtime"), &strs(&extra), "idle");
    assert_eq!(vm.digest(), digest, "1 MiB blocks");
    let requests = server.requests() - before;
    assert!(
        (32..=60).contains(&requests),
        "1 MiB blocks: {requests} requests"
    );
    drop(vm);
    // The one that won the race, whole.
    let extra = with_remote(
        &["--restore", "s3://snaps/race"],
        &endpoint,
        &b.join("cache"),
    );
    let vm = Detached::start(&b.join("runtime"), &strs(&extra), "idle");
    assert_eq!(vm.digest(), winner_digest, "the race's winner");
    drop(vm);
    // The sealed one: with its key only.
    let extra = with_remote(
        &["--restore", "s3://snaps/vm-sealed", "--store-key", &key_arg],
        &endpoint,
        &b.join("cache"),
    );
    let vm = Detached::start(&b.join("runtime"), &strs(&extra), "idle");
    assert_eq!(vm.digest(), digest, "sealed");
    drop(vm);
    // B's VM, snapshotted in turn, carries what it faulted in: its working set.
    let again = with_remote(&["--out", "s3://snaps/vm-ws"], &endpoint, &b.join("cache"));
    restored[0].call("snapshot", &strs(&again));
    drop(restored);

    // Host C: the working set comes first, in coalesced requests; the digest needs no more.
    let c = host("c");
    let extra = with_remote(
        &["--restore", "s3://snaps/vm-ws"],
        &endpoint,
        &c.join("cache"),
    );
    let before = server.requests();
    let vm = Detached::start(&c.join("runtime"), &strs(&extra), "idle");
    let at_start = server.requests() - before;
    assert_eq!(vm.digest(), digest);
    let requests = server.requests() - before;
    assert!(requests < 100, "{requests} requests with the working set");
    assert_eq!(requests, at_start, "the digest fetched nothing more");
    drop(vm);

    // A move: `suspend --vm-offload-to` offloads the VM, writes it with a lease and stops it;
    // one host continues it, the next is refused, naming who holds it.
    let e = host("e");
    let mover = Detached::start(&e.join("runtime"), &[], "fill 32MiB random seed=5; idle");
    let moved_digest = mover.digest();
    let args = with_remote(
        &["--vm-offload", "--vm-offload-to", "s3://snaps/moved"],
        &endpoint,
        &e.join("cache"),
    );
    let report = mover.call("suspend", &strs(&args));
    assert_eq!(
        report["uploaded"]["lease"]["state"], "offloaded",
        "{report}"
    );
    assert!(report["resume_with"]
        .as_str()
        .unwrap()
        .contains("s3://snaps/moved"));
    let err = fails(&e.join("runtime"), &["status", mover.job()]);
    assert!(!err.is_empty(), "the source still answers");
    drop(mover);
    let f = host("f");
    let extra = with_remote(
        &["--restore", "s3://snaps/moved"],
        &endpoint,
        &f.join("cache"),
    );
    let continued = Detached::start(&f.join("runtime"), &strs(&extra), "idle");
    assert_eq!(continued.digest(), moved_digest);
    let lease: serde_json::Value = serde_json::from_slice(
        &std::fs::read(server.object_path("snaps", "moved/lease.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(lease["state"], "running", "{lease}");

    // No snapshot there, a second restore of a moved VM, and a damaged manifest: clear
    // errors, nothing runs.
    let d = host("d");
    let runtime = d.join("runtime");
    let run = |prefix: &str| {
        let mut args = with_remote(
            &[&RUN_DETACHED[..], &["--restore", prefix]].concat(),
            &endpoint,
            &d.join("cache"),
        );
        args.extend(["--".to_owned(), "idle".to_owned()]);
        fails(&runtime, &strs(&args))
    };
    let err = run("s3://snaps/nothing");
    assert!(err.contains("no snapshot there"), "{err}");
    let err = run("s3://snaps/vm-sealed");
    assert!(err.contains("encrypted"), "{err}");
    let err = run("s3://snaps/moved");
    assert!(err.contains("lease is held by a restored VM on"), "{err}");
    drop(continued);
    let manifest = server.object_path("snaps", "vm-lz4/manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    // The RAM index's seal, one hex digit changed.
    let at = text.find("\"ram_index\"").unwrap();
    let digit = at + text[at..].find("\"xxh3_128\": \"").unwrap() + "\"xxh3_128\": \"".len();
    let flipped = if &text[digit..=digit] == "0" {
        "1"
    } else {
        "0"
    };
    let text = format!("{}{flipped}{}", &text[..digit], &text[digit + 1..]);
    std::fs::write(&manifest, text).unwrap();
    let err = run("s3://snaps/vm-lz4");
    assert!(err.contains("seal") || err.contains("xxh3"), "{err}");

    // The server goes down under a VM that still faults: the guest waits out the retries,
    // then the command fails with the cause; no wrong byte is ever served.
    let g = host("g");
    let extra = with_remote(
        &["--restore", "s3://snaps/vm-raw"],
        &endpoint,
        &g.join("cache"),
    );
    let vm = Detached::start(&g.join("runtime"), &strs(&extra), "idle");
    server.stop();
    let started = std::time::Instant::now();
    let err = vm.call_fails("exec", &["--", "digest"]);
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(4),
        "no retries"
    );
    assert!(err.contains("guest memory is lost"), "{err}");
    assert!(
        err.contains("s3://snaps/vm-raw/up-") && err.contains("/ram.store/seg-"),
        "{err}"
    );
    let status = common::pvisor(&g.join("runtime"), &["status", vm.job()]);
    let said = common::text(&status.stdout);
    assert!(
        said.contains("guest memory is lost") && said.contains("\"exit_code\":75"),
        "{said}"
    );
    // The VM's log shows a few of object_store's lines, one per retry, not every one.
    let log = std::fs::read_to_string(g.join("runtime").join(vm.job()).join("vm.log")).unwrap();
    let retries = log.lines().filter(|l| l.contains("backing off")).count();
    assert!(
        (1..=uffd_pager::logging::RETRY_BURST as usize).contains(&retries),
        "{retries} retry lines:\n{log}"
    );
    server.restart();
}
