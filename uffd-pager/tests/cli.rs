//! The store commands of the `uffd-pager` binary, run as a user would run them.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_uffd-pager"))
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run uffd-pager")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// SIGTERM to `child`, then its exit status (at most 20 s later, else the test fails with
/// `what`).
fn stop_with_sigterm(child: &mut std::process::Child, what: &str) -> std::process::ExitStatus {
    // SAFETY: sending a signal to our own child process.
    let rc = unsafe { libc::kill(child.id().cast_signed(), libc::SIGTERM) };
    assert_eq!(rc, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn device_tests_skipped() -> bool {
    testkit::skip_unless(&["/dev/fuse"])
}

/// An 8 MiB image: zero, repeated, random and same-byte stretches.
fn write_image(path: &Path) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let data: Vec<u8> = (0..8usize << 20)
        .map(|i| match (i >> 18) % 4 {
            0 => 0,
            1 => (i % 61) as u8,
            2 => {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as u8
            }
            _ => 0xC3,
        })
        .collect();
    fs::write(path, &data).unwrap();
    data
}

fn unpack(store: &Path, out: &Path) -> Output {
    run(&[
        "unpack",
        "--store",
        store.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
}

/// Unpacks `store` into `dir`/out.raw and checks it holds `data`.
fn assert_unpacks_to(store: &Path, dir: &Path, data: &[u8]) {
    let raw_out = dir.join("out.raw");
    let out = unpack(store, &raw_out);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(fs::read(&raw_out).unwrap() == data);
}

/// `uffd-pager pack --mem-file RAW --store STORE EXTRA…`.
fn run_pack(raw: &Path, store: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "pack",
        "--mem-file",
        raw.to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    run(&args)
}

fn pack(dir: &Path, extra: &[&str]) -> (PathBuf, Vec<u8>) {
    let raw = dir.join("mem.raw");
    let data = write_image(&raw);
    let store = dir.join("store");
    let out = run_pack(&raw, &store, extra);
    assert!(out.status.success(), "pack failed: {}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("packed 8.0 MiB"),
        "{}",
        text(&out.stdout)
    );
    (store, data)
}

#[test]
fn cli_pack_info_verify_unpack_roundtrip() {
    let dir = tempfile::tempdir().unwrap();
    let (store, data) = pack(dir.path(), &["--codec", "zstd:3", "--block-size", "16KiB"]);
    let store_arg = store.to_str().unwrap();

    let out = run(&["info", "--store", store_arg, "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["blocks"], 512);
    assert_eq!(info["block_size"], 16384);
    assert_eq!(info["image_size"], 8 << 20);
    assert_eq!(info["zero_blocks"], 128);
    assert!(info["disk_bytes"].as_u64().unwrap() < 4 << 20, "{info}");
    assert!(info["ratio"].as_f64().unwrap() > 2.0, "{info}");

    let out = run(&["info", "--store", store_arg]);
    assert!(
        text(&out.stdout).contains("disk bytes"),
        "{}",
        text(&out.stdout)
    );

    let out = run(&["verify", "--store", store_arg]);
    assert!(out.status.success(), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains("0 bad"), "{}", text(&out.stdout));

    assert_unpacks_to(&store, dir.path(), &data);
}

#[test]
fn cli_output_to_a_closed_pipe_ends_quietly() {
    // `uffd-pager info … | head` where `head` is gone before anything is written.
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = pack(dir.path(), &[]);
    for args in [&["info"][..], &["info", "--json"], &["verify"]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = bin()
            .args(args)
            .args(["--store", store.to_str().unwrap()])
            .stdout(writer)
            .output()
            .unwrap();
        let stderr = text(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
        // What a shell shows for a process that SIGPIPE ended.
        assert_eq!(out.status.code(), Some(141), "{args:?}: {stderr}");
    }
}

#[test]
fn cli_pack_json_reports_what_was_written() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("mem.raw");
    write_image(&raw);
    let store = dir.path().join("store");
    let out = run_pack(&raw, &store, &["--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["written"]["blocks"], 128);
    assert_eq!(report["stats"]["codec"], "lz4");
    assert!(report["stats"]["disk_bytes"].as_u64().is_some());
}

#[test]
fn cli_invalid_block_size_and_codec_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("mem.raw");
    fs::write(&raw, [0u8; 4096]).unwrap();
    let store = dir.path().join("store");
    let base = [
        "pack",
        "--mem-file",
        raw.to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
    ];

    let out = run(&[&base[..], &["--block-size", "3000"]].concat());
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("power of two from 4 KiB to 2 MiB"), "{err}");

    let out = run(&[&base[..], &["--block-size", "4MiB"]].concat());
    assert!(!out.status.success());

    let out = run(&[&base[..], &["--codec", "gzip"]].concat());
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("unknown codec `gzip`"), "{err}");
    assert!(
        !store.join("index").exists(),
        "a rejected command must not create a store"
    );
}

#[test]
fn cli_missing_store_or_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere");
    let out = run(&["info", "--store", missing.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("is not a store"),
        "{}",
        text(&out.stderr)
    );

    let out = run(&[
        "pack",
        "--mem-file",
        missing.to_str().unwrap(),
        "--store",
        dir.path().to_str().unwrap(),
    ]);
    assert_fails_saying(&out, "nowhere: No such file", "pack of a missing file");
    // The server names the file and says why too (it used to drop the cause).
    let socket = dir.path().join("s.sock");
    let (socket_arg, missing_arg) = (socket.to_str().unwrap(), missing.to_str().unwrap());
    let out = run_within_10s(&["serve", "--socket", socket_arg, "--mem-file", missing_arg])
        .expect("serve of a missing file hung");
    assert_fails_saying(&out, "nowhere: No such file", "serve of a missing file");
}

#[test]
fn cli_flipped_bit_fails_verify_with_block_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = pack(dir.path(), &["--codec", "lz4"]);
    let segment = fs::read_dir(&store)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("seg-"))
        .unwrap();
    let mut bytes = fs::read(&segment).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x01;
    fs::write(&segment, &bytes).unwrap();

    let out = run(&["verify", "--store", store.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("bad block"), "{stdout}");
    assert!(stdout.contains("checksum mismatch"), "{stdout}");
    assert!(stdout.contains(&segment.display().to_string()), "{stdout}");

    let out = run(&["verify", "--store", store.to_str().unwrap(), "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let problem = &report["problems"][0];
    let offset = problem["offset"].as_u64().unwrap();
    assert!(offset <= at as u64, "{problem}");
    assert!(problem["block"].as_u64().is_some(), "{problem}");

    // Unpacking a corrupt store fails and leaves no output file behind.
    let raw_out = dir.path().join("out.raw");
    let out = unpack(&store, &raw_out);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("checksum mismatch"),
        "{}",
        text(&out.stderr)
    );
    assert!(!raw_out.exists());
    assert!(!dir.path().join("out.raw.partial").exists());
}

#[test]
fn cli_truncated_index_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = pack(dir.path(), &[]);
    let index = store.join("index");
    let len = fs::metadata(&index).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&index)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let out = run(&["info", "--store", store.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("is unusable") && err.contains("truncated"),
        "{err}"
    );
}

fn is_mounted(path: &Path) -> bool {
    let canonical = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .any(|line| line.split(' ').nth(4) == Some(canonical.to_str().unwrap()))
}

#[test]
fn cli_mount_serves_the_image_until_sigterm() {
    if device_tests_skipped() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (store, data) = pack(dir.path(), &["--codec", "zstd"]);
    let mountpoint = dir.path().join("mnt");
    fs::create_dir(&mountpoint).unwrap();
    let mut child = bin()
        .args([
            "mount",
            "--store",
            store.to_str().unwrap(),
            mountpoint.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let file = PathBuf::from(first.trim());
    assert_eq!(file, mountpoint.join("ram"));
    assert!(is_mounted(&mountpoint));
    assert!(fs::read(&file).unwrap() == data);
    // The store is held by the mount: a second writer is refused with a clear message.
    let out = run(&[
        "pack",
        "--mem-file",
        dir.path().join("mem.raw").to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
    ]);
    assert!(
        text(&out.stderr).contains("in use by another process"),
        "{}",
        text(&out.stderr)
    );

    let status = stop_with_sigterm(&mut child, "mount did not stop on SIGTERM");
    assert!(status.success(), "{status}");
    assert!(!is_mounted(&mountpoint), "still mounted after SIGTERM");
    let out = run(&["verify", "--store", store.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stdout));
}

#[test]
fn cli_demo_packs_verifies_and_serves_a_small_image() {
    if device_tests_skipped() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = run(&[
        "demo",
        "--size",
        "96MiB",
        "--keep",
        dir.path().to_str().unwrap(),
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    for codec in ["none", "lz4", "zstd:3"] {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(codec))
            .unwrap_or_else(|| panic!("{stdout}"));
        assert!(row.ends_with("same"), "{row}");
    }
    assert!(stdout.contains("same bytes as the image"), "{stdout}");
}

#[test]
fn cli_serve_listens_refuses_garbage_and_stops_on_sigterm() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("mem");
    fs::write(&mem, vec![7u8; 1 << 20]).unwrap();
    let socket = dir.path().join("uffd.sock");
    let mut child = bin()
        .args([
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--mem-file",
            mem.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert_eq!(first.trim(), socket.to_str().unwrap());
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        fs::metadata(&socket).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // A handshake without a descriptor is refused and the connection closed.
    let mut stream = UnixStream::connect(&socket).unwrap();
    stream.write_all(b"[]").unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 8];
    assert_eq!(stream.read(&mut buf).unwrap(), 0);

    let status = stop_with_sigterm(&mut child, "serve did not stop on SIGTERM");
    assert!(status.success(), "{status}");
    let mut log = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(log.contains("connection refused"), "{log}");
    assert!(!socket.exists(), "the socket file was left behind");
}

#[test]
fn cli_serve_needs_a_memory_file_or_a_store() {
    let out = run(&["serve", "--socket", "/tmp/x.sock"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--mem-file"),
        "{}",
        text(&out.stderr)
    );
    let out = run(&[
        "serve",
        "--socket",
        "/tmp/x.sock",
        "--mem-file",
        "/nonexistent/mem",
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("/nonexistent/mem"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn cli_memory_pool_merges_identical_pages_and_stops_on_sigterm() {
    use std::os::unix::fs::{FileExt, PermissionsExt};
    use uffd_pager::sharing::PoolClient;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("pool.sock");
    let mut child = bin()
        .args([
            "serve",
            "--memory-pool",
            "--socket",
            socket.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert_eq!(first.trim(), socket.to_str().unwrap());
    assert_eq!(
        fs::metadata(&socket).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // Two "VMs" of 16 pages in this process: pages 0..8 equal, 8..16 different.
    let pages = 16u64;
    let mut a = memmap2::MmapMut::map_anon(16 << 12).unwrap();
    let mut b = memmap2::MmapMut::map_anon(16 << 12).unwrap();
    for page in 0..pages as usize {
        a[page << 12..(page + 1) << 12].fill(page as u8 + 1);
        let other = if page < 8 {
            page as u8 + 1
        } else {
            0xF0 - page as u8
        };
        b[page << 12..(page + 1) << 12].fill(other);
    }
    let offers = |m: &memmap2::MmapMut| -> Vec<(u64, u64)> {
        (0..pages)
            .map(|p| {
                let page = &m[(p as usize) << 12..(p as usize + 1) << 12];
                (p, xxhash_rust::xxh3::xxh3_64(page))
            })
            .collect()
    };
    let mut va = PoolClient::attach(&socket, a.as_ptr() as u64, pages << 12).unwrap();
    let mut vb = PoolClient::attach(&socket, b.as_ptr() as u64, pages << 12).unwrap();
    // The first offer only makes candidates; the second VM's equal pages enter the pool.
    assert!(va.offer(offers(&a), vec![]).unwrap().merge.is_empty());
    let reply = vb.offer(offers(&b), vec![]).unwrap();
    assert_eq!(reply.merge, (0..8).collect::<Vec<u64>>());
    let mut pooled = vec![0u8; 4096];
    vb.pool().read_exact_at(&mut pooled, 3 << 12).unwrap();
    assert_eq!(&pooled[..], &b[3 << 12..4 << 12]);
    assert_eq!(vb.merged(reply.merge).unwrap().stats.references, 8);
    // The first VM finds them on its next offer.
    let reply = va.offer(offers(&a), vec![]).unwrap();
    assert_eq!(reply.merge, (0..8).collect::<Vec<u64>>());
    let stats = va.merged(reply.merge).unwrap().stats;
    assert_eq!((stats.pool_pages, stats.references), (8, 16));
    // A descriptor that cannot write the pool.
    assert!(va.pool().write_all_at(&[1], 0).is_err());

    let status = stop_with_sigterm(&mut child, "the pool did not stop on SIGTERM");
    assert!(status.success(), "{status}");
    assert!(!socket.exists(), "the socket file was left behind");
    // The pages outlive the daemon in the descriptors the VMs hold.
    va.pool().read_exact_at(&mut pooled, 3 << 12).unwrap();
    assert_eq!(&pooled[..], &a[3 << 12..4 << 12]);
}

// Hostile files around a store: other users, links, FIFOs, lying or huge indexes.

use testkit::{mkfifo, mode, nobody_can_list, nobody_can_read, open_tempdir};

/// Asserts that the command failed and said `needle` on stderr.
fn assert_fails_saying(out: &Output, needle: &str, what: &str) {
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{what} succeeded");
    assert!(err.contains(needle), "{what}: {err}");
}

/// Sets the `next_segment` field of an index file's bytes and recomputes the checksum, so
/// that only the decoder's range checks can refuse it. The field follows magic, version,
/// block size, codec, level, ratio, image size and generation.
fn set_next_segment(bytes: &mut [u8], value: u32) {
    bytes[45..49].copy_from_slice(&value.to_le_bytes());
    let body = bytes.len() - 16;
    let checksum = xxhash_rust::xxh3::xxh3_64(&bytes[..body]);
    bytes[body..body + 8].copy_from_slice(&checksum.to_le_bytes());
}

/// Runs the binary with `args`; `None` if it has not ended after 10 s (it is killed).
fn run_within_10s(args: &[&str]) -> Option<Output> {
    let mut child = bin()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(child.wait_with_output().unwrap())
}

#[test]
fn cli_pack_and_unpack_write_files_other_users_cannot_read() {
    use std::os::unix::fs::PermissionsExt;
    let dir = open_tempdir();
    let (store, _) = pack(dir.path(), &[]);
    fs::set_permissions(
        dir.path().join("mem.raw"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    assert_eq!(mode(&store), 0o700);
    for entry in fs::read_dir(&store).unwrap() {
        let path = entry.unwrap().path();
        assert_eq!(mode(&path), 0o600, "{}", path.display());
    }
    assert!(!nobody_can_list(&store), "another user lists the store");
    assert!(!nobody_can_read(&store.join("index")));
    let raw_out = dir.path().join("out.raw");
    let out = unpack(&store, &raw_out);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(mode(&raw_out), 0o600);
    assert!(
        !nobody_can_read(&raw_out),
        "another user reads the unpacked RAM"
    );
}

#[test]
fn cli_pack_into_a_store_whose_segment_links_to_another_keeps_the_other() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _) = pack(dir.path(), &[]);
    let small = dir.path().join("small.raw");
    fs::write(
        &small,
        (0..1u32 << 20).map(|i| (i % 253) as u8).collect::<Vec<_>>(),
    )
    .unwrap();
    let b = dir.path().join("b");
    let out = run_pack(&small, &b, &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let b_segment = b.join("seg-00000000.dat");
    fs::remove_file(&b_segment).unwrap();
    std::os::unix::fs::symlink(a.join("seg-00000000.dat"), &b_segment).unwrap();

    let out = run_pack(&small, &b, &[]);
    assert_fails_saying(&out, "symbolic link", "pack through a link");
    let out = run(&["verify", "--store", a.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "store A was damaged: {}",
        text(&out.stdout)
    );
}

#[test]
fn cli_fifo_as_index_or_memory_file_fails_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = pack(dir.path(), &[]);
    let index = store.join("index");
    fs::remove_file(&index).unwrap();
    mkfifo(&index);
    let store_arg = store.to_str().unwrap();
    let out_arg = dir.path().join("out.raw");
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    let socket = dir.path().join("s.sock");
    let commands: [Vec<&str>; 5] = [
        vec!["verify", "--store", store_arg],
        vec!["info", "--store", store_arg],
        vec![
            "unpack",
            "--store",
            store_arg,
            "--out",
            out_arg.to_str().unwrap(),
        ],
        vec![
            "pack",
            "--mem-file",
            fifo.to_str().unwrap(),
            "--store",
            "/nonexistent/x",
        ],
        vec![
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--mem-file",
            fifo.to_str().unwrap(),
        ],
    ];
    for args in &commands {
        let out = run_within_10s(args).unwrap_or_else(|| panic!("{args:?} hung"));
        assert_fails_saying(&out, "FIFO", &format!("{args:?}"));
    }
}

#[test]
fn cli_pack_over_an_index_with_the_last_segment_id_fails_and_keeps_the_image() {
    let dir = tempfile::tempdir().unwrap();
    let (store, data) = pack(dir.path(), &[]);
    let index = store.join("index");
    let honest = fs::read(&index).unwrap();
    let mut bytes = honest.clone();
    set_next_segment(&mut bytes, u32::MAX);
    fs::write(&index, &bytes).unwrap();

    let out = run_pack(&dir.path().join("mem.raw"), &store, &[]);
    assert_fails_saying(&out, "next segment", "pack over a hostile index");
    assert!(
        fs::read(&index).unwrap() == bytes,
        "the index was rewritten"
    );
    // With the honest index back, the image is all there.
    fs::write(&index, &honest).unwrap();
    assert_unpacks_to(&store, dir.path(), &data);
}

#[test]
fn cli_huge_sparse_index_is_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = pack(dir.path(), &[]);
    fs::OpenOptions::new()
        .write(true)
        .open(store.join("index"))
        .unwrap()
        .set_len(6 << 30)
        .unwrap();
    let out = run_within_10s(&["info", "--store", store.to_str().unwrap()]).expect("info hung");
    assert_fails_saying(&out, "more than the limit", "info of a 6 GiB index");
}

#[test]
fn cli_pack_under_umask_000_still_writes_owner_only_files() {
    // Modes are given at creation, not by a chmod afterwards: no umask opens a window.
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("mem.raw");
    write_image(&raw);
    let store = dir.path().join("store");
    let out = Command::new("sh")
        .args(["-c", "umask 000; exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_uffd-pager"))
        .args(["pack", "--mem-file", raw.to_str().unwrap(), "--store"])
        .arg(&store)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(mode(&store), 0o700);
    for entry in fs::read_dir(&store).unwrap() {
        let path = entry.unwrap().path();
        assert_eq!(mode(&path), 0o600, "{}", path.display());
    }
}
