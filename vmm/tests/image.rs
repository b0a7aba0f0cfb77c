//! Lazy images with a real vCPU: the guest's `read PATH` gets a file of its image byte for
//! byte, fetched from a slow origin on the first read and from the host's staging after;
//! a read that completes while the VM is offloaded reaches its RAM only after the resume;
//! a file missing, changed at the origin or too large ends the command, and the VM goes on.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use uffd_pager::pager::RamKind;
use vmm::image::{ImageLocation, ImageOptions};
use vmm::script;
use vmm::vm::{Vm, VmOptions};
use vmm::wait::WaitPolicy;

fn skip() -> bool {
    testkit::skip_unless(&["/dev/kvm", "/dev/userfaultfd"])
}

fn pattern(len: usize, salt: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 13 + salt + i / 4099) as u8).collect()
}

/// An image directory: `lib/a.so` (1 MiB), `etc/conf` (5000 bytes), `big` (16 MiB).
fn image(root: &Path) {
    std::fs::create_dir_all(root.join("lib")).unwrap();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("lib/a.so"), pattern(1 << 20, 1)).unwrap();
    std::fs::write(root.join("etc/conf"), pattern(5000, 2)).unwrap();
    std::fs::write(root.join("big"), pattern(16 << 20, 3)).unwrap();
    vmm::image::index(root).unwrap();
}

fn start(dir: &Path, rate: Option<u64>, wait: Option<WaitPolicy>) -> Vm {
    let root = dir.join("image");
    image(&root);
    Vm::start(VmOptions {
        io_threads: 1,
        image: Some(ImageOptions {
            at: ImageLocation::Dir(root),
            staging: dir.join("staging"),
            rate,
        }),
        wait,
        ..VmOptions::new(16 << 20, RamKind::Anon, dir.join("disk"), dir.join("ram"))
    })
    .unwrap()
}

fn digest(len: usize, salt: usize) -> String {
    vmm::guest::digest_hex(&pattern(len, salt))
}

#[test]
fn image_read_is_byte_exact_slow_the_first_time_and_staged_after() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // 4 MiB/s: the 1 MiB file takes about 250 ms from its origin.
    let mut vm = start(dir.path(), Some(4 << 20), None);
    let started = Instant::now();
    let out = vm
        .exec(&script::parse("read lib/a.so bytes=1MiB; digest").unwrap())
        .unwrap();
    let first = started.elapsed();
    assert!(first >= Duration::from_millis(240), "{first:?}");
    assert_eq!(out[0].digest.as_deref(), Some(digest(1 << 20, 1).as_str()));
    assert_eq!(out[0].download_bytes, Some(1 << 20));
    assert_eq!(out[1].digest, out[0].digest);
    // Again: from the staging, at once.
    let started = Instant::now();
    let out = vm
        .exec(&script::parse("read etc/conf; read lib/a.so").unwrap())
        .unwrap();
    assert_eq!(out[0].digest.as_deref(), Some(digest(5000, 2).as_str()));
    assert_eq!(out[1].digest.as_deref(), Some(digest(1 << 20, 1).as_str()));
    assert!(
        out[1].elapsed_ms < 100.0,
        "{} ms for a staged read",
        out[1].elapsed_ms
    );
    assert!(started.elapsed() < first * 2, "{:?}", started.elapsed());
    let io = vm.stats().io.unwrap();
    assert_eq!((io.reads, io.staged_reads, io.failed), (3, 1, 0), "{io:?}");
    assert_eq!(io.bytes, (2 << 20) + 5000);
}

#[test]
fn image_read_that_completes_while_offloaded_is_written_after_the_resume() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let policy = WaitPolicy {
        offload_cooldown: Duration::ZERO,
        break_even: 0.0,
        ..WaitPolicy::default()
    };
    // 1 MiB at 1 MiB/s: a second of fetching, in which the VM is paused and offloaded.
    let mut vm = start(dir.path(), Some(1 << 20), Some(policy));
    let out = vm
        .exec(&script::parse("fill 8MiB random seed=4; read lib/a.so; digest").unwrap())
        .unwrap();
    assert_eq!(out[1].digest.as_deref(), Some(digest(1 << 20, 1).as_str()));
    assert_eq!(out[2].digest, out[1].digest);
    let stats = vm.stats();
    let wait = stats.wait.unwrap();
    assert!(wait.offloads >= 1 && wait.resumes >= 1, "{wait:?}");
    // The file was ready while the VM was offloaded; its chunk reached the guest's RAM only
    // after the resume (the VMM checks the VM runs before every write, and counts it).
    let io = stats.io.unwrap();
    assert_eq!(io.after_resume, 1, "{io:?}");
    assert_eq!(io.chunks, 1, "{io:?}");
}

#[test]
fn image_reads_that_cannot_be_served_end_the_command_and_the_vm_goes_on() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = start(dir.path(), None, None);
    let fails = |vm: &mut Vm, command: &str| {
        basics::error_chain(&vm.exec(&script::parse(command).unwrap()).unwrap_err())
    };
    let why = fails(&mut vm, "read lib/missing.so");
    assert!(
        why.contains("errno 2") && why.contains("not in the image"),
        "{why}"
    );
    // Larger than the guest's 14 MiB of application memory.
    let why = fails(&mut vm, "read big");
    assert!(why.contains("errno 27"), "{why}");
    // Changed at the origin after the manifest was written: never handed over.
    std::fs::write(dir.path().join("image/etc/conf"), pattern(5000, 9)).unwrap();
    let why = fails(&mut vm, "read etc/conf");
    assert!(why.contains("errno 5") && why.contains("differs"), "{why}");
    // The VM goes on, and reads what is intact.
    let out = vm
        .exec(&script::parse("read lib/a.so; fill 4MiB zero; digest").unwrap())
        .unwrap();
    assert_eq!(out[0].digest.as_deref(), Some(digest(1 << 20, 1).as_str()));
    assert_eq!(vm.stats().io.unwrap().failed, 3);
    // A VM without an image.
    let bare_dir = tempfile::tempdir().unwrap();
    let mut bare = Vm::start(VmOptions {
        io_threads: 1,
        ..VmOptions::new(
            16 << 20,
            RamKind::Anon,
            bare_dir.path().join("disk"),
            bare_dir.path().join("ram"),
        )
    })
    .unwrap();
    let why = fails(&mut bare, "read lib/a.so");
    assert!(why.contains("has no image"), "{why}");
}

#[test]
fn image_from_an_http_origin_is_fetched_once_checked_and_staged() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("served/base");
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/a%20b+c"), pattern(70_000, 4)).unwrap();
    std::fs::write(root.join("etc/plain"), pattern(3000, 5)).unwrap();
    vmm::image::index(&root).unwrap();
    let (origin, served) = testkit::http::serve_dir(dir.path().join("served"));
    let at = |url: String| {
        ImageLocation::parse(&url, &compressed_backing::remote::RemoteOptions::new()).unwrap()
    };
    let options = |url: String| VmOptions {
        io_threads: 1,
        image: Some(ImageOptions {
            at: at(url),
            staging: dir.path().join("staging"),
            rate: None,
        }),
        ..VmOptions::new(
            16 << 20,
            RamKind::Anon,
            dir.path().join("disk"),
            dir.path().join("ram"),
        )
    };
    // No image at that root: the VM does not start, and says where it looked.
    let err = Vm::start(options(format!("{origin}/elsewhere"))).unwrap_err();
    let why = basics::error_chain(&err);
    assert!(
        why.contains("/elsewhere/image.json") && why.contains("404"),
        "{why}"
    );
    let mut vm = Vm::start(options(format!("{origin}/base/"))).unwrap();
    // A name that must be escaped in a URL, read twice: one trip to the origin.
    let out = vm
        .exec(&script::parse("read etc/a%20b+c bytes=70000; read etc/a%20b+c").unwrap())
        .unwrap();
    let expected = digest(70_000, 4);
    assert_eq!(out[0].digest.as_deref(), Some(expected.as_str()));
    assert_eq!(out[1].digest.as_deref(), Some(expected.as_str()));
    let before = served.load(std::sync::atomic::Ordering::Relaxed);
    // Changed at the origin: never handed over; the VM goes on.
    std::fs::write(root.join("etc/plain"), pattern(3000, 6)).unwrap();
    let err = vm
        .exec(&script::parse("read etc/plain").unwrap())
        .unwrap_err();
    let why = basics::error_chain(&err);
    assert!(why.contains("errno 5") && why.contains("differs"), "{why}");
    // Longer at the origin than the manifest says: refused too.
    std::fs::write(root.join("etc/plain"), pattern(3001, 5)).unwrap();
    let err = vm
        .exec(&script::parse("read etc/plain").unwrap())
        .unwrap_err();
    assert!(basics::error_chain(&err).contains("errno 5"), "{err}");
    assert_eq!(
        served.load(std::sync::atomic::Ordering::Relaxed),
        before + 2
    );
    let io = vm.stats().io.unwrap();
    assert_eq!((io.reads, io.staged_reads, io.failed), (4, 1, 2), "{io:?}");
    // A second VM given the same staging reads what the first fetched, from there.
    let second = tempfile::tempdir().unwrap();
    let mut other = Vm::start(VmOptions {
        disk: second.path().join("disk"),
        store_dir: second.path().join("ram"),
        ..options(format!("{origin}/base"))
    })
    .unwrap();
    let out = other
        .exec(&script::parse("read etc/a%20b+c").unwrap())
        .unwrap();
    assert_eq!(out[0].digest.as_deref(), Some(expected.as_str()));
    assert_eq!(other.stats().io.unwrap().staged_reads, 1);
    // It fetched the manifest, and no file.
    assert_eq!(
        served.load(std::sync::atomic::Ordering::Relaxed),
        before + 3
    );
    // A staging directory others may write is refused.
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let err = Vm::start(VmOptions {
        image: Some(ImageOptions {
            at: at(format!("{origin}/base")),
            staging: open,
            rate: None,
        }),
        ..VmOptions::new(
            16 << 20,
            RamKind::Anon,
            second.path().join("d2"),
            second.path().join("r2"),
        )
    })
    .unwrap_err();
    let why = basics::error_chain(&err);
    assert!(why.contains("writable by group or others"), "{why}");
}
