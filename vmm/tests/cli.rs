//! `pvisor` end to end, with real /dev/kvm and /dev/userfaultfd: the commands of the seed
//! documents, as a user runs them.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

use serde_json::Value;

mod common;
use common::{fails, ok, pvisor, skip, text, Detached};

#[test]
fn cli_offload_and_resume_keep_the_digest_and_give_memory_back() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let vm = Detached::start(runtime.path(), &[], "fill 64MiB random seed=3; idle");
    let digest = vm.digest();
    let before = vm.stats();
    assert!(
        before["guest_ram_pss_bytes"].as_u64().unwrap() >= 64 << 20,
        "{before}"
    );

    // The seed's long form.
    let long = vm.long_form();
    let mut args: Vec<&str> = vec!["suspend"];
    args.extend(long.iter().map(String::as_str));
    args.push("--vm-offload");
    let report = ok(runtime.path(), &args).remove(0);
    assert_eq!(report["state"], "offloaded", "{report}");
    let after = vm.stats();
    let (pss_before, pss_after) = (
        before["process_pss_bytes"].as_u64().unwrap(),
        after["process_pss_bytes"].as_u64().unwrap(),
    );
    assert!(
        pss_after + (60 << 20) < pss_before,
        "{pss_before} -> {pss_after}"
    );
    assert!(
        after["backing_disk_bytes"].as_u64().unwrap() >= 64 << 20,
        "{after}"
    );
    // Offloading twice is harmless.
    vm.call("suspend", &["--vm-offload"]);
    // Commands wait for a resume.
    assert!(fails(runtime.path(), &["exec", vm.job(), "--", "digest"]).contains("resume"));

    let mut args: Vec<&str> = vec!["resume"];
    args.extend(long.iter().map(String::as_str));
    args.push("--vm-load");
    ok(runtime.path(), &args);
    assert_eq!(vm.digest(), digest);
    let task = vm.exec("task");
    assert_eq!(task[0]["digest"], digest.as_str());
    assert!(task[0]["elapsed_ms"].as_f64().is_some());

    // Eager resume of a compressed offload of repeated content.
    vm.exec("fill 64MiB repeated");
    let digest = vm.digest();
    vm.call("suspend", &["--vm-offload"]);
    vm.call("resume", &["--eager"]);
    assert_eq!(vm.digest(), digest);
    let stopped = vm.call("stop", &[]);
    assert_eq!(stopped["stopped"], true);
    // The VM removes its runtime directory as it exits (within 10 s on a loaded host).
    let job = runtime.path().join(vm.job());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while job.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(!job.exists(), "the runtime directory was left behind");
}

#[test]
fn cli_compressed_offload_of_repeated_content_takes_little_disk() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let config = runtime.path().join("vm.toml");
    std::fs::write(
        &config,
        "[vm]\nmemory = \"512MiB\"\nram-compression = true\n",
    )
    .unwrap();
    let vm = Detached::start(
        runtime.path(),
        &["--config", config.to_str().unwrap()],
        "fill 64MiB repeated; idle",
    );
    let digest = vm.digest();
    vm.call("suspend", &["--vm-offload"]);
    let stats = vm.stats();
    let backing = stats["backing_disk_bytes"].as_u64().unwrap();
    assert!(
        backing <= 1 << 20,
        "repeated content took {backing} bytes on disk"
    );
    assert!(
        stats["process_pss_bytes"].as_u64().unwrap() < 16 << 20,
        "{stats}"
    );
    vm.call("resume", &[]);
    assert_eq!(vm.digest(), digest);
}

#[test]
fn cli_release_shrinks_the_vm_and_two_vms_run_at_once() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let a = Detached::start(runtime.path(), &[], "fill 64MiB random seed=1; idle");
    let b = Detached::start(
        runtime.path(),
        &["--vm-ram-backing", "memfd"],
        "fill 32MiB random seed=2; idle",
    );
    assert_ne!(a.job(), b.job());
    assert_ne!(a.digest(), b.digest());
    let before = a.stats()["guest_ram_pss_bytes"].as_u64().unwrap();
    let released = a.exec("release");
    assert_eq!(released[0]["released_bytes"], 64 << 20);
    let after = a.stats()["guest_ram_pss_bytes"].as_u64().unwrap();
    assert!(after + (60 << 20) < before, "{before} -> {after}");
    // The other VM is untouched.
    let status = b.call("status", &[]);
    assert_eq!(status["state"], "running");
    assert_eq!(status["app_bytes"], 32 << 20);
}

#[test]
fn cli_foreground_run_prints_identity_then_results() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let lines = ok(
        runtime.path(),
        &[
            "run",
            "--memory",
            "64MiB",
            "--",
            "fill 8MiB zero; digest; task",
        ],
    );
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[0]["job"].is_string());
    let results = lines[1]["results"].as_array().unwrap();
    assert_eq!(results.len(), 3);
    assert_eq!(results[1]["digest"], results[2]["digest"]);
    // The VM is gone with its runtime files.
    assert_eq!(std::fs::read_dir(runtime.path()).unwrap().count(), 0);
}

#[test]
fn cli_download_from_an_allowed_origin_given_by_flag_or_config() {
    if skip() {
        return;
    }
    // An origin that answers every GET with the same 300000 bytes.
    let body: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    let url = testkit::http::serve_body(body.clone(), None);
    let runtime = tempfile::tempdir().unwrap();
    let script = format!("download {url}/pkg.tar bytes=300000; digest");
    let lines = ok(
        runtime.path(),
        &[
            "run",
            "--memory",
            "16MiB",
            "--vm-net-allow",
            &url,
            "--",
            &script,
        ],
    );
    let results = lines[1]["results"].as_array().unwrap();
    let digest = vmm::guest::digest_hex(&body);
    assert_eq!(results[0]["download_bytes"], 300_000);
    assert_eq!(results[0]["digest"], digest.as_str());
    assert_eq!(results[1]["digest"], digest.as_str());
    // The same from the config file's `[vm]` table.
    let config = runtime.path().join("vm.toml");
    std::fs::write(&config, format!("[vm]\nnet-allow = [\"{url}\"]\n")).unwrap();
    let config = config.to_str().unwrap();
    let lines = ok(
        runtime.path(),
        &[
            "run", "--memory", "16MiB", "--config", config, "--", &script,
        ],
    );
    assert_eq!(lines[1]["results"][0]["digest"], digest.as_str());
}

#[test]
fn cli_image_in_an_object_store_is_fetched_on_first_read_and_staged() {
    if skip() {
        return;
    }
    // An image of two files, indexed here and put in a bucket of a real S3 server.
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("image");
    std::fs::create_dir_all(root.join("lib")).unwrap();
    let lib: Vec<u8> = (0..700_000u32).map(|i| (i % 241) as u8).collect();
    std::fs::write(root.join("lib/a.so"), &lib).unwrap();
    std::fs::write(root.join("hosts"), b"127.0.0.1 localhost\n").unwrap();
    vmm::image::index(&root).unwrap();
    let server = testkit::s3::S3Server::start();
    server.create_bucket("images");
    for name in ["image.json", "lib/a.so", "hosts"] {
        let object = server.object_path("images", &format!("base/{name}"));
        std::fs::create_dir_all(object.parent().unwrap()).unwrap();
        std::fs::copy(root.join(name), object).unwrap();
    }
    let runtime = tempfile::tempdir().unwrap();
    let cache = work.path().join("cache");
    let endpoint = server.endpoint();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pvisor"))
        .args([
            "run",
            "--memory",
            "16MiB",
            "--vm-image",
            "s3://images/base",
            "--s3-endpoint",
            &endpoint,
            "--cache",
            cache.to_str().unwrap(),
            "--",
            "read lib/a.so bytes=700000; read hosts; read lib/a.so; digest",
        ])
        .envs(server.env())
        .env("PVISOR_RUNTIME_DIR", runtime.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let results = lines[1]["results"].as_array().unwrap();
    let digest = vmm::guest::digest_hex(&lib);
    assert_eq!(results[0]["digest"], digest.as_str());
    assert_eq!(results[1]["download_bytes"], 20);
    assert_eq!(results[2]["digest"], digest.as_str());
    assert_eq!(results[3]["digest"], digest.as_str());
    // The second read of lib/a.so came from the staging, not the bucket.
    let served = server.bytes_out();
    assert!(
        served < 2 * lib.len() as u64,
        "{served} bytes served for one {} byte file read twice",
        lib.len()
    );
}

#[test]
fn cli_status_during_a_download_names_its_source_and_the_download_offloads() {
    if skip() {
        return;
    }
    // An origin that sends 2 MiB in two halves, 1.5 s apart.
    let body: Vec<u8> = (0..2u32 << 20).map(|i| (i % 239) as u8).collect();
    let pause = (1 << 20, std::time::Duration::from_millis(1500));
    let url = testkit::http::serve_body(body.clone(), Some(pause));
    let runtime = tempfile::tempdir().unwrap();
    let vm = Detached::start(
        runtime.path(),
        &["--vm-net-allow", &url, "--vm-wait-management"],
        "fill 16MiB random seed=2; idle",
    );
    let script = format!("download {url}/big bytes=2MiB");
    std::thread::scope(|scope| {
        let command = scope.spawn(|| vm.exec(&script));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let stats = vm.stats_until(deadline, |s| s["model_wait"]["source"] == "download");
        assert!(
            stats["model_wait"]["request"].as_u64().unwrap() >= 1 << 63,
            "{stats}"
        );
        let results = command.join().unwrap();
        assert_eq!(results[0]["digest"], vmm::guest::digest_hex(&body).as_str());
    });
    // The second half's wait was long enough to offload in, and is counted as a download's.
    let stats = vm.stats();
    assert!(
        stats["sources"]["download"]["offloads"].as_u64().unwrap() >= 1,
        "{stats}"
    );
    assert_eq!(stats["io"]["downloads"], 1, "{stats}");
}

#[test]
fn cli_bad_input_gets_clear_messages() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let r = runtime.path();
    // Each refused before anything starts, with a message that names what is wrong.
    let cases: &[(&[&str], &[&str])] = &[
        (&["run", "--memory", "512XB", "--", "idle"], &["512XB"]),
        (
            &["run", "--memory", "64TiB", "--", "idle"],
            &["more than this host has"],
        ),
        (
            &["run", "--", "fill 1MiB zero; explode"],
            &["command 2", "unknown command `explode`"],
        ),
        (
            &[
                "run",
                "--vm-ram-dedup",
                "--vm-ram-backing",
                "memfd",
                "--",
                "idle",
            ],
            &["needs private anonymous RAM"],
        ),
        (
            &[
                "run",
                "--vm-ram-dedup",
                "--vm-dedup-cpu-budget",
                "2",
                "--",
                "idle",
            ],
            &["--vm-dedup-cpu-budget"],
        ),
        (
            &[
                "run",
                "--vm-model-upstream",
                "https://model:443",
                "--",
                "idle",
            ],
            &["http://HOST:PORT"],
        ),
        (&["run", "--", "model five"], &["bad request id"]),
        (
            &["run", "--vm-image", "/nonexistent-image", "--", "idle"],
            &["/nonexistent-image/image.json"],
        ),
        (
            &["run", "--", "read ../etc/passwd"],
            &["an image path is relative"],
        ),
        (
            &[
                "run",
                "--vm-net-allow",
                "http://127.0.0.1:9",
                "--vm-wait-management",
                "--vm-wait-sources",
                "model,disk",
                "--",
                "idle",
            ],
            &["--vm-wait-sources", "wait source `disk`"],
        ),
        (
            &["run", "--vm-net-allow", "https://mirror:443", "--", "idle"],
            &["--vm-net-allow `https://mirror:443`", "only plain http://"],
        ),
        (
            &["run", "--vm-image-staging", "/tmp/x", "--", "idle"],
            &["--vm-image-staging needs --vm-image"],
        ),
        (
            &["run", "--vm-image", "ftp://mirror/image", "--", "idle"],
            &["--vm-image", "expected a directory, s3://"],
        ),
        (
            &[
                "run",
                "--vm-net-allow",
                "http://mirror:80/pkgs",
                "--",
                "idle",
            ],
            &["without a path"],
        ),
        (
            &["run", "--vm-net-stall-ms", "0", "--", "idle"],
            &["--vm-net-stall-ms"],
        ),
        (
            &["run", "--", "download ftp://mirror/x"],
            &["command 1", "expected http://"],
        ),
        (
            &["run", "--", "download http://mirror/x bytes=1 bytes=2"],
            &["unexpected argument `bytes=2`"],
        ),
        (&["replay", "/nonexistent.json"], &["/nonexistent.json"]),
        (
            &["replay", "/dev/null", "--strategy", "nap"],
            &["trajectory"],
        ),
        (
            &["run", "--vm-wait-scale", "0", "--", "idle"],
            &["--vm-wait-scale"],
        ),
        (
            &["run", "--vm-wait-management", "--", "idle"],
            &["needs --vm-model-upstream"],
        ),
        (
            &["run", "--vm-wait-cooldown-ms", "1000", "--", "idle"],
            &["--vm-wait-* policy options need --vm-wait-management"],
        ),
        (
            &[
                "run",
                "--vm-model-upstream",
                "http://127.0.0.1:9",
                "--vm-wait-management",
                "--vm-wait-pause-ms",
                "100",
                "--vm-wait-offload-ms",
                "50",
                "--",
                "idle",
            ],
            &["--vm-wait-offload-ms (50 ms)", "cannot be smaller"],
        ),
        (
            &[
                "run",
                "--vm-model-upstream",
                "http://127.0.0.1:9",
                "--vm-wait-management",
                "--vm-wait-break-even",
                "2000",
                "--",
                "idle",
            ],
            &["--vm-wait-break-even"],
        ),
        (
            &[
                "run",
                "--vm-model-upstream",
                "http://127.0.0.1:9",
                "--vm-wait-management",
                "--vm-wait-reload",
                "sometimes",
                "--",
                "idle",
            ],
            &["--vm-wait-reload `sometimes`", "lazy or faults"],
        ),
        (
            &[
                "run",
                "--vm-model-upstream",
                "http://127.0.0.1:9",
                "--vm-wait-management",
                "--vm-wait-strategy",
                "sleep",
                "--",
                "idle",
            ],
            &["expected offload or pause"],
        ),
        (
            &[
                "run",
                "--vm-cold-ram-compression",
                "--vm-cold-cpu-budget",
                "0",
                "--",
                "idle",
            ],
            &["--vm-cold-cpu-budget"],
        ),
        (
            &[
                "run",
                "--vm-cold-ram-compression",
                "--vm-cold-pool-cap",
                "2",
                "--",
                "idle",
            ],
            &["--vm-cold-pool-cap"],
        ),
        (
            &[
                "run",
                "--vm-cold-ram-compression",
                "--vm-cold-min-saving",
                "100",
                "--",
                "idle",
            ],
            &["--vm-cold-min-saving"],
        ),
    ];
    for (args, expected) in cases {
        let err = fails(r, args);
        for part in *expected {
            assert!(err.contains(part), "{args:?}: {err}");
        }
    }
    let config = r.join("bad.toml");
    std::fs::write(&config, "[vm]\nmemroy = \"1GiB\"\n").unwrap();
    let err = fails(
        r,
        &["run", "--config", config.to_str().unwrap(), "--", "idle"],
    );
    assert!(err.contains("memroy"), "{err}");
    let err = fails(r, &["status", "no-such-vm"]);
    assert!(err.contains("no VM with job id `no-such-vm`"), "{err}");

    let vm = Detached::start(r, &[], "fill 4MiB zero; idle");
    let err = fails(r, &["resume", vm.job()]);
    assert!(err.contains("nothing to resume"), "{err}");
    let err = fails(
        r,
        &[
            "status",
            vm.job(),
            "--vm-socket",
            vm.identity["socket"].as_str().unwrap(),
            "--vm-attempt-id",
            "not-the-attempt",
        ],
    );
    assert!(
        err.contains("refused") && err.contains("not-the-attempt"),
        "{err}"
    );
    let err = fails(r, &["exec", vm.job(), "--", "fill 4GiB zero"]);
    assert!(err.contains("application memory"), "{err}");
    // Another user cannot reach the socket.
    let out = Command::new(env!("CARGO_BIN_EXE_pvisor"))
        .args([
            "status",
            vm.job(),
            "--vm-socket",
            vm.identity["socket"].as_str().unwrap(),
            "--vm-attempt-id",
            vm.identity["attempt"].as_str().unwrap(),
        ])
        .env("PVISOR_RUNTIME_DIR", r)
        .uid(65534)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("cannot reach the VM"),
        "{}",
        text(&out.stderr)
    );
}

use std::os::unix::process::CommandExt;

#[test]
fn cli_offload_that_runs_out_of_disk_keeps_the_vm_running() {
    if skip() {
        return;
    }
    let small = testkit::Tmpfs::mount("16m");
    let runtime = small.path();
    let disk = tempfile::NamedTempFile::new().unwrap();
    let vm = Detached::start(
        runtime,
        &["--disk", disk.path().to_str().unwrap()],
        "fill 64MiB random seed=9; idle",
    );
    let digest = vm.digest();
    let err = fails(runtime, &["suspend", vm.job(), "--vm-offload"]);
    assert!(err.contains("No space left"), "{err}");
    let status = vm.call("status", &[]);
    assert_eq!(status["state"], "running", "{status}");
    assert_eq!(vm.digest(), digest);
    assert!(vm.stats()["guest_ram_pss_bytes"].as_u64().unwrap() >= 64 << 20);
}

#[test]
fn cli_cgroup_accounts_the_vm_and_its_offload() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let name = format!("pvisor-test-cli-{}/vm", std::process::id());
    let vm = Detached::start(
        runtime.path(),
        &["--cgroup", &name],
        "fill 64MiB random seed=4; task; idle",
    );
    let stats = vm.stats();
    let running = stats["cgroup_memory_bytes"].as_u64().unwrap();
    let cgroup = std::path::PathBuf::from(stats["cgroup_dir"].as_str().unwrap());
    assert!(cgroup.ends_with(&name), "{}", cgroup.display());
    // Guest RAM plus the disk's page cache of the task's 64 MiB.
    assert!(running >= 64 << 20, "{running}");
    vm.call("suspend", &["--vm-offload"]);
    let offloaded = vm.stats()["cgroup_memory_bytes"].as_u64().unwrap();
    assert!(offloaded + (48 << 20) < running, "{running} -> {offloaded}");
    let pid = vm.identity["pid"].as_u64().unwrap();
    drop(vm);
    // The VM takes its cgroup with it.
    wait_gone(&[pid], 10);
    assert!(!cgroup.exists(), "{} was left behind", cgroup.display());
    if let Some(parent) = cgroup.parent() {
        let _ = std::fs::remove_dir(parent);
    }
}

#[test]
fn cli_cgroup_names_out_of_pvisors_own_cgroup_are_refused() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let outside = runtime.path().join("outside");
    let escape = format!("../../../../../../../..{}", outside.display());
    for detach in [true, false] {
        for name in [escape.as_str(), "/tmp/pvisor-cgroup-test", "./a"] {
            let mut args = vec!["run", "--executor", "vm", "--memory", "16MiB"];
            if detach {
                args.push("--detach");
            }
            args.extend_from_slice(&["--cgroup", name, "--", "idle"]);
            let err = fails(runtime.path(), &args);
            assert!(
                err.contains("expected a relative path of plain names"),
                "{name} (detach: {detach}): {err}"
            );
        }
    }
    // Nothing was made where the name pointed.
    assert!(!outside.exists());
    assert!(!std::path::Path::new("/tmp/pvisor-cgroup-test").exists());
}

#[test]
fn cli_offloaded_ram_is_shown_as_a_plain_file() {
    if skip() || testkit::skip_unless(&["/dev/fuse"]) {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let vm = Detached::start(
        runtime.path(),
        &["--vm-ram-compression"],
        "fill 8MiB random seed=12; idle",
    );
    let ram_file = runtime.path().join("vm.ram");
    vm.call(
        "suspend",
        &["--vm-offload", "--vm-ram-file", ram_file.to_str().unwrap()],
    );
    let image = std::fs::read(&ram_file).unwrap();
    assert_eq!(image.len(), 512 << 20);
    let base = vmm::guest::APP_BASE as usize;
    let expect = vmm::guest::fill_bytes(8 << 20, vmm::guest::FillKind::Random, 12);
    assert!(
        image[base..base + (8 << 20)] == expect[..],
        "the file is not the VM's RAM"
    );
    assert!(image[base + (8 << 20)..].iter().all(|&b| b == 0));
    // A second request for another path while one is shown, and a path that exists, fail
    // cleanly; the VM stays offloaded.
    let err = fails(
        runtime.path(),
        &[
            "suspend",
            vm.job(),
            "--vm-offload",
            "--vm-ram-file",
            runtime.path().to_str().unwrap(),
        ],
    );
    assert!(err.contains("exists already"), "{err}");
    vm.call("resume", &[]);
    assert!(
        std::fs::symlink_metadata(&ram_file).is_err(),
        "the file outlived the offload"
    );
    let digest = vm.digest();
    let expect = vmm::guest::digest_hex(&expect);
    assert_eq!(digest, expect);
}

#[test]
fn cli_cold_compression_shrinks_an_idle_vm_on_both_ram_kinds() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let fast = ["--vm-cold-age-ms", "200", "--vm-cold-scan-ms", "50"];
    let mut memfd_args = vec!["--vm-cold-ram-compression"];
    memfd_args.extend_from_slice(&fast);
    let mut anon_args = vec!["--vm-cold-ram-compression=true", "--vm-ram-backing", "anon"];
    anon_args.extend_from_slice(&fast);
    for args in [memfd_args, anon_args] {
        let vm = Detached::start(runtime.path(), &args, "fill 64MiB repeated seed=5; idle");
        let digest = vm.digest();
        let cold_enough = |vm: &Detached| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            vm.stats_until(deadline, |stats| {
                stats["cold"]["blocks_compressed"].as_u64().unwrap() >= 1024
                    && stats["cold"]["pooled_pages"].as_u64().unwrap() >= 16384
            })
        };
        let stats = cold_enough(&vm);
        // 64 MiB of data: nearly all of it given back, what it costs included.
        assert!(
            stats["cold"]["net_saving_bytes"].as_i64().unwrap() > 60 << 20,
            "{args:?}: {stats}"
        );
        assert!(
            stats["guest_ram_resident_bytes"].as_u64().unwrap() < 8 << 20,
            "{stats}"
        );
        // Touched again after an idle spell, it comes back intact (on anon RAM, data read
        // within a cold age of its compression counts as in use and stays resident for long);
        // left alone, it goes back to the pool.
        std::thread::sleep(std::time::Duration::from_millis(500));
        assert_eq!(vm.digest(), digest, "{args:?}");
        cold_enough(&vm);
        // Released, it leaves the pool at once.
        vm.exec("release");
        let stats = vm.stats();
        assert!(
            stats["cold"]["pooled_pages"].as_u64().unwrap() < 1024,
            "{stats}"
        );
        assert!(
            stats["cold"]["pool"]["blocks"].as_u64().unwrap() < 64,
            "{stats}"
        );
    }
}

/// Dedup tests share KSM's global settings: one at a time, so that the last VM of a test is
/// the last holder of the tuning.
static KSM: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Stops the VMs and waits until their processes are gone.
fn stop_and_wait(vms: Vec<Detached>) {
    let pids: Vec<u64> = vms
        .iter()
        .map(|vm| vm.identity["pid"].as_u64().unwrap())
        .collect();
    drop(vms);
    wait_gone(&pids, 20);
}

/// Waits until these processes are gone, at most `secs` seconds.
fn wait_gone(pids: &[u64], secs: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while pids
        .iter()
        .any(|pid| Path::new(&format!("/proc/{pid}")).exists())
    {
        assert!(std::time::Instant::now() < deadline, "the VMs did not exit");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn ksm_knob(name: &str) -> String {
    let text = std::fs::read_to_string(Path::new("/sys/kernel/mm/ksm").join(name)).unwrap();
    text.trim().to_owned()
}

#[test]
fn cli_dedup_merges_identical_vms_keeps_them_apart_and_restores_ksm() {
    if skip() {
        return;
    }
    let _ksm = KSM
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // A VM of an earlier test killed with -9 may have left KSM tuned, with no live holder:
    // the host's own settings come back first (what the next VM's lease would do anyway), so
    // that they are what this test expects to find again at its end.
    let ksm = ksm_advisor::Ksm::system().unwrap();
    let state = Path::new(ksm_advisor::tune::DEFAULT_STATE_DIR);
    if state.exists() {
        ksm_advisor::tune::restore(&ksm, state, false).unwrap();
    }
    let before: Vec<String> = ["run", "pages_to_scan", "sleep_millisecs"]
        .iter()
        .map(|k| ksm_knob(k))
        .collect();
    let runtime = tempfile::tempdir().unwrap();
    // The same random content in four VMs: only merging across VMs can save anything.
    let vms: Vec<Detached> = (0..4)
        .map(|_| {
            Detached::start(
                runtime.path(),
                &["--vm-ram-dedup"],
                "fill 64MiB random seed=11; idle",
            )
        })
        .collect();
    let digest = vms[0].digest();
    assert_eq!(ksm_knob("run"), "1");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    for vm in &vms {
        vm.stats_until(deadline, |stats| {
            assert_eq!(
                stats["dedup"]["advised_bytes"].as_u64().unwrap(),
                512 << 20,
                "{stats}"
            );
            // 16384 pages of data, shared by four: each VM pays about a quarter of them.
            stats["dedup"]["merging_pages"].as_u64().unwrap() >= 15_000
                && stats["guest_ram_pss_bytes"].as_u64().unwrap() < 40 << 20
        });
    }
    // A write in one VM gets its own copy: the others keep their bytes.
    vms[0].exec("rewrite 25 seed=3");
    assert_ne!(vms[0].digest(), digest);
    for vm in &vms[1..] {
        assert_eq!(vm.digest(), digest);
    }
    // Merged RAM offloads and comes back like any other.
    vms[1].call("suspend", &["--vm-offload"]);
    let stats = vms[1].stats();
    assert!(
        stats["guest_ram_pss_bytes"].as_u64().unwrap() < 4 << 20,
        "{stats}"
    );
    vms[1].call("resume", &[]);
    assert_eq!(vms[1].digest(), digest);
    stop_and_wait(vms);
    // The last VM gave the host its KSM settings back.
    let after: Vec<String> = ["run", "pages_to_scan", "sleep_millisecs"]
        .iter()
        .map(|k| ksm_knob(k))
        .collect();
    assert_eq!(after, before);
}

#[test]
fn cli_dedup_with_cold_compression_merges_and_compresses() {
    if skip() {
        return;
    }
    let _ksm = KSM
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let runtime = tempfile::tempdir().unwrap();
    // Dedup picks anon RAM; cold compression works on it too.
    let args = [
        "--vm-ram-dedup",
        "--vm-cold-ram-compression",
        "--vm-cold-age-ms",
        "300",
        "--vm-cold-scan-ms",
        "100",
    ];
    let vms: Vec<Detached> = (0..2)
        .map(|_| Detached::start(runtime.path(), &args, "fill 64MiB repeated seed=3; idle"))
        .collect();
    let digest = vms[0].digest();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    for vm in &vms {
        let stats = vm.stats_until(deadline, |stats| {
            let merged = stats["dedup"]["merging_pages"].as_u64().unwrap();
            let pooled = stats["cold"]["pooled_pages"].as_u64().unwrap();
            // Each of the 16384 pages of data is either merged or compressed.
            merged > 0 && merged + pooled >= 16_000
        });
        assert!(
            stats["process_memory_bytes"].as_u64().unwrap() < 12 << 20,
            "{stats}"
        );
        assert_eq!(vm.digest(), digest);
    }
    stop_and_wait(vms);
}

#[test]
fn cli_snapshot_restores_continue_share_and_offload() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let r = runtime.path();
    let origin = Detached::start(r, &[], "fill 64MiB random seed=31; idle");
    let digest = origin.digest();
    let snap = r.join("snap");
    let snap_arg = snap.to_str().unwrap();
    let report = origin.call("snapshot", &["--out", snap_arg]);
    assert!(
        report["ram_data_bytes"].as_u64().unwrap() >= 64 << 20,
        "{report}"
    );
    drop(origin);
    let restored: Vec<Detached> = (0..2)
        .map(|_| Detached::start(r, &["--restore", snap_arg], "idle"))
        .collect();
    for vm in &restored {
        assert_eq!(vm.digest(), digest);
    }
    for vm in &restored {
        let stats = vm.stats();
        // Two mappings of the image: each pays about half of the 64 MiB.
        assert!(
            stats["guest_ram_pss_bytes"].as_u64().unwrap() < 48 << 20,
            "{stats}"
        );
    }
    restored[0].exec("rewrite 50 seed=4");
    let written = restored[0].digest();
    assert_ne!(written, digest);
    assert_eq!(restored[1].digest(), digest);
    let suspended = restored[0].call("suspend", &["--vm-offload"]);
    assert!(
        suspended["private_offload"]["private_pages"]
            .as_u64()
            .unwrap()
            >= 8000,
        "{suspended}"
    );
    restored[0].call("resume", &[]);
    assert_eq!(restored[0].digest(), written);
    // A compressed snapshot of a restored VM, restored in turn (into anon RAM, lazily).
    let packed = r.join("packed");
    let packed_arg = packed.to_str().unwrap();
    let err = restored[1].call_fails("snapshot", &["--out", packed_arg, "--codec", "zip"]);
    assert!(err.contains("--codec"), "{err}");
    restored[1].call("snapshot", &["--out", packed_arg, "--codec", "zstd"]);
    assert!(packed.join("ram.store").is_dir());
    let again = Detached::start(r, &["--restore", packed_arg], "idle");
    assert_eq!(again.digest(), digest);
    // What a restore refuses.
    let err = fails(
        r,
        &[
            "run",
            "--restore",
            snap_arg,
            "--memory",
            "256MiB",
            "--",
            "idle",
        ],
    );
    assert!(err.contains("keeps its RAM size"), "{err}");
    // A raw snapshot loaded into RAM of a kind given (the pager copies its pages in).
    let loaded = Detached::start(
        r,
        &["--restore", snap_arg, "--vm-ram-backing", "anon"],
        "idle",
    );
    assert_eq!(loaded.digest(), digest);
    drop(loaded);
    let err = fails(r, &["run", "--restore", r.to_str().unwrap(), "--", "idle"]);
    assert!(err.contains("not a snapshot"), "{err}");
    let err = fails(
        r,
        &[
            "run",
            "--restore",
            snap_arg,
            "--vm-cold-ram-compression",
            "--",
            "idle",
        ],
    );
    assert!(err.contains("not on a restored"), "{err}");
}

#[test]
fn cli_memory_pool_daemon_shares_identical_vms() {
    use std::io::BufRead;
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let r = runtime.path();
    let socket = r.join("pool.sock");
    let socket_arg = socket.to_str().unwrap();
    let mut daemon = Command::new(env!("CARGO_BIN_EXE_pvisor"))
        .args(["serve", "--memory-pool", "--socket", socket_arg])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(daemon.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), socket_arg);
    let vms: Vec<Detached> = (0..2)
        .map(|_| {
            Detached::start(
                r,
                &["--vm-memory-pool", socket_arg],
                "fill 64MiB random seed=71; idle",
            )
        })
        .collect();
    let digest = vms[0].digest();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    for vm in &vms {
        vm.stats_until(deadline, |stats| {
            stats["pool"]["merged_pages"].as_u64().unwrap() >= 16384
        });
        assert_eq!(vm.digest(), digest);
    }
    // What it refuses.
    let err = fails(
        r,
        &[
            "run",
            "--vm-memory-pool",
            socket_arg,
            "--vm-ram-backing",
            "memfd",
            "--",
            "idle",
        ],
    );
    assert!(err.contains("--vm-memory-pool works on anon RAM"), "{err}");
    let err = vms[0].call_fails("suspend", &["--vm-offload"]);
    assert!(err.contains("memory pool"), "{err}");
    drop(vms);
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(daemon.id().cast_signed(), libc::SIGTERM) };
    assert!(daemon.wait().unwrap().success());
    assert!(!socket.exists());
}

#[test]
fn cli_replay_scaled_trajectory_gives_the_same_results_under_every_strategy() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let trajectory = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs/trajectories/qutebrowser-667-scaled.json");
    let trajectory = trajectory.to_str().unwrap();
    // The last one takes its answers in batches as they stream in.
    let strategies = [
        "off",
        "pause",
        "offload",
        "offload-compressed",
        "cold-compression",
        "offload",
    ];
    let summaries: Vec<Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = strategies
            .iter()
            .enumerate()
            .map(|(i, strategy)| {
                let r = runtime.path();
                scope.spawn(move || {
                    let mut args = vec![
                        "replay",
                        trajectory,
                        "--strategy",
                        strategy,
                        "--memory",
                        "256MiB",
                        "--json",
                    ];
                    if i == 5 {
                        args.push("--stream-answers");
                    }
                    let out = pvisor(r, &args);
                    let stdout = text(&out.stdout);
                    assert!(
                        out.status.success(),
                        "{strategy}: {stdout}{}",
                        text(&out.stderr)
                    );
                    // The last line is the summary.
                    serde_json::from_str::<Value>(stdout.lines().last().unwrap()).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (strategy, summary) in strategies.iter().zip(&summaries) {
        assert_eq!(summary["integrity_passed"], true, "{strategy}: {summary}");
        assert_eq!(
            summary["model_requests_served"], 44,
            "{strategy}: {summary}"
        );
        assert_eq!(
            summary["results_digest"], summaries[0]["results_digest"],
            "{strategy}: {summary}"
        );
        for key in [
            "guest_pss_gib_s_per_task",
            "cgroup_mem_gib_s_per_task",
            "completion_window_s",
            "throughput_tasks_per_min",
        ] {
            assert!(
                summary[key].as_f64().unwrap() > 0.0,
                "{strategy} {key}: {summary}"
            );
        }
    }
    // Every answer came in batches, byte for byte the same (the results digest).
    assert_eq!(summaries[5]["stream_answers"], true);
    assert!(
        summaries[5]["wait"]["batches"].as_u64().unwrap() > 0,
        "{}",
        summaries[5]
    );
    // (How much offloading saves is for the scenario bench, not a test: it depends on timing.)
}

/// A detached VM under wait management running `script`, and its model upstream, which
/// answers request 1 with 5000 bytes after `wait_ms` (kept alive with the VM).
fn vm_with_slow_model(
    runtime: &Path,
    wait_ms: f64,
    script: &str,
) -> (vmm::replay::ReplayServer, Detached) {
    let trajectory = vmm::replay::Trajectory {
        name: "one slow answer".into(),
        note: String::new(),
        time_scale: 1.0,
        steps: vec![vmm::replay::Step::Model {
            wait_ms,
            answer_bytes: 5000,
        }],
        download_rate: None,
        image_rate: None,
    };
    let server = vmm::replay::ReplayServer::start(&trajectory).unwrap();
    let url = server.url();
    let vm = Detached::start(
        runtime,
        &["--vm-model-upstream", &url, "--vm-wait-management"],
        script,
    );
    (server, vm)
}

#[test]
fn cli_operator_takes_a_vm_over_during_a_model_wait_and_gets_the_answer_on_resume() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let (server, vm) = vm_with_slow_model(runtime.path(), 1500.0, "fill 32MiB random seed=4; idle");
    let before = vm.digest();
    // The command waits for the model's answer on a thread of its own.
    let waiting = std::thread::scope(|scope| {
        let command = scope.spawn(|| vm.exec("model 1; digest"));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        // The VM answers while the answer is out: stats show the wait.
        let stats = vm.stats_until(deadline, |s| s["model_wait"]["request"] == 1);
        assert_eq!(stats["model_wait"]["answer_ready"], false, "{stats}");
        assert_eq!(stats["model_wait"]["source"], "model", "{stats}");
        // The operator takes it over and offloads it.
        let suspended = vm.call("suspend", &["--vm-offload"]);
        assert_eq!(suspended["state"], "offloaded", "{suspended}");
        assert_eq!(suspended["model_wait"]["phase"], "manual", "{suspended}");
        // Commands that need the command to be over are refused with the reason.
        let refused = vm.call_fails("exec", &["--", "digest"]);
        assert!(refused.contains("waits for a model answer"), "{refused}");
        // The answer arrives; the operator holds the VM, so it stays offloaded and the
        // command waits on.
        let held = vm.stats_until(deadline, |s| s["model_wait"]["answer_ready"] == true);
        assert_eq!(held["state"], "offloaded", "{held}");
        assert!(
            held["guest_ram_pss_bytes"].as_u64().unwrap() < 4 << 20,
            "{held}"
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
        assert!(
            !command.is_finished(),
            "the coordinator resumed a VM an operator holds"
        );
        let status = vm.call("status", &[]);
        assert_eq!(status["job"], vm.job(), "{status}");
        assert_eq!(status["state"], "offloaded", "{status}");
        // The operator's resume loads the RAM back and delivers the answer, once.
        let resumed = vm.call("resume", &["--vm-load"]);
        assert_eq!(resumed["state"], "running", "{resumed}");
        command.join().unwrap()
    });
    let expected = vmm::guest::digest_hex(&vmm::replay::answer(1, 5000));
    assert_eq!(
        waiting[0]["digest"].as_str(),
        Some(expected.as_str()),
        "{waiting:?}"
    );
    // The guest's own data came back whole.
    assert_eq!(waiting[1]["digest"].as_str(), Some(before.as_str()));
    assert_eq!(server.served(), 1);
    let wait = &vm.stats()["wait"];
    assert_eq!(wait["delivered"], 1, "{wait}");
    assert_eq!(wait["resumes"], 0, "{wait}");
}

#[test]
fn cli_stop_during_a_model_wait_ends_the_vm() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let (_server, vm) = vm_with_slow_model(runtime.path(), 30_000.0, "idle");
    let pid = vm.identity["pid"].as_u64().unwrap();
    std::thread::scope(|scope| {
        let command = scope.spawn(|| vm.call_fails("exec", &["--", "model 1"]));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        vm.stats_until(deadline, |s| s["model_wait"]["request"] == 1);
        assert_eq!(vm.call("stop", &[])["stopped"], true);
        let failed = command.join().unwrap();
        assert!(failed.contains("stopped"), "{failed}");
    });
    // The VM process exits without waiting for the 30 s answer.
    wait_gone(&[pid], 10);
}

#[test]
fn cli_operator_resume_before_the_answer_gives_the_wait_back_to_wait_management() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    // Long enough for the five `pvisor` calls below on a loaded machine.
    let (_server, vm) =
        vm_with_slow_model(runtime.path(), 8000.0, "fill 16MiB distinct seed=2; idle");
    let before = vm.digest();
    let results = std::thread::scope(|scope| {
        let command = scope.spawn(|| vm.exec("model 1; digest"));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        vm.stats_until(deadline, |s| s["model_wait"]["request"] == 1);
        vm.call("suspend", &["--vm-pause"]);
        assert_eq!(vm.call("status", &[])["model_wait"]["phase"], "manual");
        let resumed = vm.call("resume", &[]);
        assert_eq!(resumed["state"], "running", "{resumed}");
        // The guest still waits: the coordinator takes it over again (pauses it, and
        // offloads it once the cooldown since its first offload allows).
        let taken = |s: &Value| {
            s["model_wait"]["phase"] == "paused" || s["model_wait"]["phase"] == "offloaded"
        };
        let again = vm.stats_until(deadline, |s| taken(s) || s.get("model_wait").is_none());
        assert!(taken(&again), "{again}");
        assert!(!command.is_finished());
        command.join().unwrap()
    });
    let wait = &vm.stats()["wait"];
    assert_eq!(wait["pauses"], 2, "{wait}");
    assert_eq!(wait["delivered"], 1, "{wait}");
    let expected = vmm::guest::digest_hex(&vmm::replay::answer(1, 5000));
    assert_eq!(results[0]["digest"].as_str(), Some(expected.as_str()));
    assert_eq!(results[1]["digest"].as_str(), Some(before.as_str()));
}

/// Runs `pvisor ARGS` and fails unless it succeeds within `secs` (killed then).
fn answers_within(runtime: &Path, args: &[&str], secs: f64) {
    let started = std::time::Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_pvisor"))
        .args(args)
        .env("PVISOR_RUNTIME_DIR", runtime)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed().as_secs_f64() > secs {
            let _ = child.kill();
            let _ = child.wait();
            panic!("pvisor {args:?} did not answer within {secs} s");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    assert!(status.success(), "pvisor {args:?}: {status}");
}

#[test]
fn cli_control_socket_floods_and_huge_lines_do_not_starve_or_bloat_the_vm() {
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let vm = Detached::start(runtime.path(), &[], "idle");
    let pid = vm.identity["pid"].as_u64().unwrap();
    let socket = std::path::PathBuf::from(vm.identity["socket"].as_str().unwrap());
    // The VM runs with the usual default descriptor limit.
    set_fd_limit(pid, 1024);
    let before = testkit::rss_bytes(u32::try_from(pid).unwrap());
    let stop = std::sync::atomic::AtomicBool::new(false);
    /// Stops the trickle however the scope ends (a failed check included).
    struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
    std::thread::scope(|scope| {
        let _stop = StopOnDrop(&stop);
        // Four 64 MiB request lines at once.
        for _ in 0..4 {
            scope.spawn(|| {
                let Ok(mut stream) = UnixStream::connect(&socket) else {
                    return;
                };
                let chunk = vec![b'a'; 1 << 20];
                for _ in 0..64 {
                    if stream.write_all(&chunk).is_err() {
                        return;
                    }
                }
            });
        }
        // 1,100 idle connections.
        let idle: Vec<UnixStream> = (0..1100)
            .filter_map(|_| UnixStream::connect(&socket).ok())
            .collect();
        // 200 that trickle a byte every 200 ms.
        let trickling = scope.spawn(|| {
            let mut streams: Vec<UnixStream> = (0..200)
                .filter_map(|_| UnixStream::connect(&socket).ok())
                .collect();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                for stream in &mut streams {
                    let _ = stream.write_all(b"{");
                }
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        });
        std::thread::sleep(std::time::Duration::from_millis(500));
        for _ in 0..3 {
            answers_within(runtime.path(), &["status", vm.job()], 3.0);
            answers_within(
                runtime.path(),
                &["exec", vm.job(), "--", "fill 1MiB zero; digest"],
                3.0,
            );
        }
        let grown = testkit::rss_bytes(u32::try_from(pid).unwrap()).saturating_sub(before);
        assert!(grown < 64 << 20, "the VM process grew by {grown} bytes");
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        trickling.join().unwrap();
        drop(idle);
    });
    answers_within(runtime.path(), &["status", vm.job()], 3.0);
    // Out of descriptors: a few more than the VM has open, then a flood. The accept loop
    // gives up the oldest connections instead of spinning, and the VM still answers.
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count() as u64;
    set_fd_limit(pid, open + 24);
    let idle: Vec<UnixStream> = (0..300)
        .filter_map(|_| UnixStream::connect(&socket).ok())
        .collect();
    let cpu_before = cpu_ticks(pid);
    std::thread::sleep(std::time::Duration::from_secs(1));
    let spun = cpu_ticks(pid) - cpu_before;
    // SAFETY: sysconf only reads a setting.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap();
    assert!(
        spun * 2 < hz,
        "the VM used {spun} of {hz} ticks in 1 s with a flood open"
    );
    answers_within(runtime.path(), &["status", vm.job()], 3.0);
    answers_within(runtime.path(), &["exec", vm.job(), "--", "digest"], 3.0);
    drop(idle);
}

/// Sets process `pid`'s descriptor limit.
fn set_fd_limit(pid: u64, limit: u64) {
    let limit = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit.max(1024),
    };
    // SAFETY: prlimit only reads `limit`; the old value is not asked for.
    let set = unsafe {
        libc::prlimit(
            i32::try_from(pid).unwrap(),
            libc::RLIMIT_NOFILE,
            &raw const limit,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(set, 0, "prlimit: {}", std::io::Error::last_os_error());
}

/// User plus system CPU time of process `pid`, clock ticks.
fn cpu_ticks(pid: u64) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command's closing parenthesis; utime and stime are the 12th and 13th.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// Sends `signal` to `pid`.
fn send_signal(pid: u64, signal: i32) {
    let pid = i32::try_from(pid).unwrap();
    // SAFETY: kill only sends a signal.
    let sent = unsafe { libc::kill(pid, signal) };
    assert_eq!(sent, 0);
}

#[test]
fn cli_stop_and_sigterm_interrupt_a_running_command() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let forever = "sleep 18446744073709551615";
    // `stop` while an `exec` sleeps: the exec ends with "stopped", the VM and its files go.
    let vm = Detached::start(runtime.path(), &[], "idle");
    let pid = vm.identity["pid"].as_u64().unwrap();
    let dir = runtime.path().join(vm.job());
    std::thread::scope(|scope| {
        let command = scope.spawn(|| vm.call_fails("exec", &["--", forever]));
        std::thread::sleep(std::time::Duration::from_millis(500));
        answers_within(runtime.path(), &["stop", vm.job()], 5.0);
        let failed = command.join().unwrap();
        assert!(failed.contains("stopped"), "{failed}");
    });
    wait_gone(&[pid], 5);
    assert!(!dir.exists(), "{} is left", dir.display());
    // SIGTERM while the script itself sleeps.
    let vm = Detached::start(runtime.path(), &[], forever);
    let pid = vm.identity["pid"].as_u64().unwrap();
    let dir = runtime.path().join(vm.job());
    std::thread::sleep(std::time::Duration::from_millis(500));
    send_signal(pid, libc::SIGTERM);
    wait_gone(&[pid], 5);
    assert!(!dir.exists(), "{} is left", dir.display());
    // `stop` while the vCPU is in KVM_RUN, filling RAM (seconds without an exit to the VMM):
    // it is kicked out at once.
    let vm = Detached::start(runtime.path(), &[], "idle");
    let pid = vm.identity["pid"].as_u64().unwrap();
    std::thread::scope(|scope| {
        let command = scope.spawn(|| vm.call_fails("exec", &["--", "fill 500MiB random"]));
        std::thread::sleep(std::time::Duration::from_millis(1000));
        answers_within(runtime.path(), &["stop", vm.job()], 3.0);
        let failed = command.join().unwrap();
        assert!(failed.contains("stopped"), "{failed}");
    });
    wait_gone(&[pid], 5);
}

#[test]
fn cli_detached_spec_is_not_in_argv_and_may_be_large() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    // A 1 MiB script: 40,000 or so commands.
    let mut script = String::from("fill 1MiB zero");
    while script.len() < 1 << 20 {
        script.push_str("; touch 4KiB");
    }
    script.push_str("; idle");
    // In arguments of 64 KiB (the kernel takes at most 128 KiB in one), joined by spaces.
    let mut args = vec!["run", "--detach", "--"];
    let mut rest = script.as_str();
    while !rest.is_empty() {
        let cut = rest[..rest.len().min(64 << 10)]
            .rfind(' ')
            .filter(|_| rest.len() > 64 << 10);
        let (arg, tail) = rest.split_at(cut.unwrap_or(rest.len()));
        args.push(arg);
        rest = tail.trim_start();
    }
    let out = pvisor(runtime.path(), &args);
    // (Not the arguments: a megabyte.)
    assert!(out.status.success(), "{}", text(&out.stderr));
    let identity = text(&out.stdout).lines().next().map(str::to_owned);
    let vm = Detached {
        runtime: runtime.path().to_path_buf(),
        identity: serde_json::from_str(&identity.unwrap()).unwrap(),
    };
    let pid = vm.identity["pid"].as_u64().unwrap();
    let attempt = vm.identity["attempt"].as_str().unwrap().to_owned();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(
        !text(&cmdline).contains(&attempt),
        "the attempt id is in the VM's command line: {}",
        text(&cmdline)
    );
    // The script ran (up to its `idle`).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    vm.stats_until(deadline, |s| s.get("pager").is_some());
    assert_eq!(vm.call("status", &[])["app_bytes"], 1 << 20);
    // A start that fails leaves no job directory.
    let err = fails(
        runtime.path(),
        &[
            "run",
            "--detach",
            "--job",
            "broken",
            "--disk",
            "/nonexistent/dir/disk.img",
            "--",
            "idle",
        ],
    );
    assert!(!err.is_empty());
    assert!(!runtime.path().join("broken").exists(), "{err}");
}

/// Polls `pvisor status JOB` until `done` holds for it, at most 5 s; returns the last answer.
fn status_until(runtime: &Path, job: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let status = ok(runtime, &["status", job]).remove(0);
        if done(&status) || std::time::Instant::now() > deadline {
            return status;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn cli_killed_vm_leaves_a_tombstone_that_status_reports() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let vm = Detached::start(runtime.path(), &[], "idle");
    let pid = vm.identity["pid"].as_u64().unwrap();
    let dir = runtime.path().join(vm.job());
    send_signal(pid, libc::SIGKILL);
    wait_gone(&[pid], 5);
    let status = status_until(runtime.path(), vm.job(), |s| s["signal"] == 9);
    assert_eq!(status["state"], "dead", "{status}");
    assert_eq!(status["signal"], 9, "{status}");
    assert!(
        status["reason"].as_str().unwrap().contains("SIGKILL"),
        "{status}"
    );
    assert!(!dir.join("control.sock").exists());
    assert!(!dir.join("vm.json").exists());
    // A VM process that died with nobody to see it (no supervisor): status finds its files
    // stale, cleans them and says so; so does the next `pvisor run` for other jobs.
    let gone = Command::new("true").spawn().unwrap();
    let gone_pid = gone.id();
    drop(gone.wait_with_output());
    for job in ["stale-a", "stale-b"] {
        let dir = runtime.path().join(job);
        std::fs::create_dir(&dir).unwrap();
        let identity = serde_json::json!({
            "job": job, "socket": dir.join("control.sock"), "attempt": "x", "pid": gone_pid
        });
        std::fs::write(dir.join("vm.json"), identity.to_string()).unwrap();
        std::os::unix::net::UnixListener::bind(dir.join("control.sock")).unwrap();
    }
    let status = ok(runtime.path(), &["status", "stale-a"]).remove(0);
    assert_eq!(status["state"], "dead", "{status}");
    assert!(!runtime.path().join("stale-a/control.sock").exists());
    let next = Detached::start(runtime.path(), &[], "idle");
    assert!(!runtime.path().join("stale-b/control.sock").exists());
    assert!(!runtime.path().join("stale-b/vm.json").exists());
    drop(next);
}

#[test]
fn cli_resume_takes_vm_load_with_eager_as_an_eager_load() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let vm = Detached::start(runtime.path(), &[], "fill 16MiB random seed=3; idle");
    let before = vm.digest();
    assert_eq!(vm.call("suspend", &["--vm-offload"])["state"], "offloaded");
    let resumed = vm.call("resume", &["--vm-load", "--eager"]);
    assert_eq!(resumed["state"], "running", "{resumed}");
    // Eager: the data is resident before anything touches it.
    let stats = vm.stats();
    assert!(
        stats["guest_ram_pss_bytes"].as_u64().unwrap() >= 16 << 20,
        "{stats}"
    );
    assert_eq!(vm.digest(), before);
}

#[test]
fn cli_runtime_dir_that_is_a_symlink_or_writable_by_others_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    if skip() {
        return;
    }
    let base = tempfile::tempdir().unwrap();
    let real = base.path().join("real");
    std::fs::create_dir(&real).unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700)).unwrap();
    let link = base.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let open = base.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    for (dir, why) in [(&link, "symlink"), (&open, "writable")] {
        let err = fails(dir, &["run", "--", "digest"]);
        assert!(err.contains(why), "{}: {err}", dir.display());
        let err = fails(dir, &["status", "vm-1"]);
        assert!(err.contains(why), "{}: {err}", dir.display());
        assert_eq!(std::fs::read_dir(&real).unwrap().count(), 0);
    }
    assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0);
    // One that does not exist is made private; one of ours, 0700, is used.
    let fresh = base.path().join("fresh");
    ok(&fresh, &["run", "--", "digest"]);
    let mode = std::fs::symlink_metadata(&fresh)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
    ok(&real, &["run", "--", "digest"]);
}

#[test]
fn cli_oom_killed_vm_leaves_a_tombstone_that_says_so() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let name = format!("pvisor-oom-test/{}", std::process::id());
    let vm = Detached::start(runtime.path(), &["--cgroup", &name], "idle");
    let pid = vm.identity["pid"].as_u64().unwrap();
    let cgroup = std::path::PathBuf::from(vm.stats()["cgroup_dir"].as_str().unwrap());
    // 64 MiB for a VM that fills 300 MiB (v2, else v1 with swap).
    let limit = (64u64 << 20).to_string();
    if cgroup.join("memory.max").exists() {
        std::fs::write(cgroup.join("memory.max"), &limit).unwrap();
        let _ = std::fs::write(cgroup.join("memory.swap.max"), "0");
    } else {
        std::fs::write(cgroup.join("memory.limit_in_bytes"), &limit).unwrap();
        let _ = std::fs::write(cgroup.join("memory.memsw.limit_in_bytes"), &limit);
    }
    let _ = pvisor(
        runtime.path(),
        &["exec", vm.job(), "--", "fill 300MiB random"],
    );
    wait_gone(&[pid], 20);
    let status = status_until(runtime.path(), vm.job(), |s| s["oom_kill"] == true);
    assert_eq!(status["state"], "dead", "{status}");
    assert_eq!(status["oom_kill"], true, "{status}");
    assert!(
        status["reason"].as_str().unwrap().contains("OOM"),
        "{status}"
    );
    // The supervisor removes the dead VM's cgroup (just after the tombstone).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while cgroup.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "{} was left behind",
            cgroup.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    if let Some(parent) = cgroup.parent() {
        let _ = std::fs::remove_dir(parent);
    }
}

/// Runs `pvisor ARGS` with its stdout a pipe whose reader is already gone (`… | head` after
/// `head` ended).
fn to_closed_pipe(runtime: &Path, args: &[&str]) -> std::process::Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    Command::new(env!("CARGO_BIN_EXE_pvisor"))
        .args(args)
        .env("PVISOR_RUNTIME_DIR", runtime)
        .stdout(writer)
        .output()
        .unwrap()
}

#[test]
fn cli_output_to_a_closed_pipe_ends_quietly_and_the_vm_runs_on() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    // `run --detach` whose identity line nobody reads: the VM starts all the same.
    let mut args = common::RUN_DETACHED.to_vec();
    args.extend_from_slice(&["--job", "piped", "--", "fill 4MiB random seed=1; idle"]);
    let out = to_closed_pipe(runtime.path(), &args);
    assert_eq!(out.status.code(), Some(141), "{}", text(&out.stderr));
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    let vm = Detached {
        runtime: runtime.path().to_path_buf(),
        identity: serde_json::json!({ "job": "piped" }),
    };
    for args in [
        &["status", "piped"][..],
        &["stats", "piped"],
        &["exec", "piped", "--", "digest"],
        &["suspend", "piped", "--vm-pause"],
    ] {
        let out = to_closed_pipe(runtime.path(), args);
        let stderr = text(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
        // What a shell shows for a process that SIGPIPE ended.
        assert_eq!(out.status.code(), Some(141), "{args:?}: {stderr}");
    }
    // The suspend was made before its reply went nowhere; the VM answers on.
    assert_eq!(vm.call("status", &[])["state"], "paused");
    vm.call("resume", &[]);
    assert_eq!(vm.exec("digest").len(), 1);
}
