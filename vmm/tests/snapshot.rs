//! Sealed snapshots with a real vCPU: restores continue exactly where the snapshot was taken,
//! share the image's memory and keep their writes apart; a restored VM offloads only what it
//! wrote; a changed snapshot is refused.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use uffd_pager::cold::ColdConfig;
use uffd_pager::pager::RamKind;
use vmm::script;
use vmm::vm::{Vm, VmError, VmOptions};

const MEMORY: u64 = 256 << 20;
const MIB: u64 = 1 << 20;

fn skip() -> bool {
    testkit::skip_unless(&["/dev/kvm", "/dev/userfaultfd"])
}

fn options(dir: &Path, name: &str, kind: RamKind, restore: Option<&Path>) -> VmOptions {
    VmOptions {
        ram_compression: true,
        io_threads: 2,
        restore: restore.map(Path::to_path_buf),
        ..VmOptions::new(
            MEMORY,
            kind,
            dir.join(format!("{name}.disk")),
            dir.join(format!("{name}.ram")),
        )
    }
}

fn restore(dir: &Path, name: &str, snapshot: &Path) -> Vm {
    Vm::start(options(dir, name, RamKind::Snapshot, Some(snapshot))).unwrap()
}

fn exec(vm: &mut Vm, text: &str) -> Vec<vmm::machine::CommandOutput> {
    vm.exec(&script::parse(text).unwrap()).unwrap()
}

use testkit::{mode, nobody_can_read, open_tempdir};

/// Asserts that everything under `dir` is sealed for its owner alone: files 0400,
/// directories 0500, and that another user cannot read the files.
fn assert_sealed_and_private(dir: &Path) {
    assert_eq!(mode(dir), 0o500, "{}", dir.display());
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            assert_sealed_and_private(&path);
        } else {
            assert_eq!(mode(&path), 0o400, "{}", path.display());
            assert!(
                !nobody_can_read(&path),
                "another user reads {}",
                path.display()
            );
        }
    }
}

fn digest(vm: &mut Vm) -> String {
    exec(vm, "digest")[0].digest.clone().unwrap()
}

/// A VM that ran `script`, its snapshot, the snapshot's manifest path and honest bytes.
fn snapshot_to_edit(
    script: &str,
) -> (
    tempfile::TempDir,
    Vm,
    std::path::PathBuf,
    std::path::PathBuf,
    Vec<u8>,
) {
    let dir = tempfile::tempdir().unwrap();
    let mut origin = Vm::start(options(dir.path(), "origin", RamKind::Anon, None)).unwrap();
    exec(&mut origin, script);
    let snap = dir.path().join("snap");
    origin.snapshot(&snap, None).unwrap();
    let manifest_path = snap.join("manifest.json");
    let honest = std::fs::read(&manifest_path).unwrap();
    (dir, origin, snap, manifest_path, honest)
}

#[test]
fn snapshot_restores_continue_share_the_image_and_keep_writes_apart() {
    if skip() {
        return;
    }
    let dir = open_tempdir();
    let mut origin = Vm::start(options(dir.path(), "origin", RamKind::Anon, None)).unwrap();
    // The disk the VM created holds the guest's data: the owner's alone.
    let disk = dir.path().join("origin.disk");
    assert_eq!(mode(&disk), 0o600);
    assert!(!nobody_can_read(&disk), "another user reads the VM's disk");
    exec(&mut origin, "fill 64MiB random seed=21; task");
    let sealed_digest = digest(&mut origin);
    let snap = dir.path().join("snap");
    let report = origin.snapshot(&snap, None).unwrap();
    assert!(report.ram_data_bytes >= 64 * MIB, "{report:?}");
    // Sealed: read-only files in a read-only directory, the owner's alone; never written
    // over.
    for name in ["ram.img", "disk.img", "manifest.json"] {
        assert!(snap.join(name).is_file(), "{name}");
    }
    assert_sealed_and_private(&snap);
    assert!(matches!(
        origin.snapshot(&snap, None),
        Err(VmError::Snapshot(vmm::snapshot::SnapshotError::Exists(_)))
    ));

    let mut restored: Vec<Vm> = (0..4)
        .map(|i| restore(dir.path(), &format!("r{i}"), &snap))
        .collect();
    for vm in &mut restored {
        // The guest goes on from the snapshot: its data, and its disk for the task.
        assert_eq!(vm.machine().app_bytes(), 64 * MIB);
        assert_eq!(digest(vm), sealed_digest);
    }
    for vm in &mut restored {
        let task = exec(vm, "task");
        assert_eq!(task[0].digest.as_deref(), Some(sealed_digest.as_str()));
    }
    // Four mappings of one image: each pays about a quarter of the 64 MiB it reads.
    for vm in &restored {
        let pss = vm.stats().memory.guest_ram_pss_bytes;
        assert!(pss < 24 * MIB, "guest RAM PSS {pss}");
    }
    // A write stays in the VM that made it.
    exec(&mut restored[0], "rewrite 25 seed=5");
    let written = digest(&mut restored[0]);
    assert_ne!(written, sealed_digest);
    for vm in &mut restored[1..] {
        assert_eq!(digest(vm), sealed_digest);
    }
    assert_eq!(digest(&mut origin), sealed_digest);
    // A restored VM can be snapshotted in turn.
    let again = dir.path().join("again");
    restored[0].snapshot(&again, None).unwrap();
    let mut second = restore(dir.path(), "second", &again);
    assert_eq!(digest(&mut second), written);
}

#[test]
fn snapshot_restored_vm_offloads_only_the_pages_it_wrote() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut origin = Vm::start(options(dir.path(), "origin", RamKind::Anon, None)).unwrap();
    exec(&mut origin, "fill 64MiB random seed=22");
    let snap = dir.path().join("snap");
    origin.snapshot(&snap, None).unwrap();
    drop(origin);
    let mut vm = restore(dir.path(), "vm", &snap);
    let rewritten = exec(&mut vm, "rewrite 10 seed=9")[0].pages.unwrap();
    let expected = digest(&mut vm);
    let before = vm.stats().memory.guest_ram_pss_bytes;
    let report = vm.suspend(true, None).unwrap();
    let private = report.private_offload.unwrap();
    // The rewritten pages and a few of the guest's own (stack, mailbox), nothing else.
    assert!(
        private.private_pages >= rewritten && private.private_pages < rewritten + 64,
        "{} private pages for {rewritten} rewritten",
        private.private_pages
    );
    let after = vm.stats().memory.guest_ram_pss_bytes;
    assert!(
        after + rewritten * 4096 / 2 < before,
        "guest RAM PSS {before} -> {after}"
    );
    let resumed = vm.resume(false).unwrap();
    assert_eq!(resumed.private_load.unwrap().pages, private.private_pages);
    assert_eq!(digest(&mut vm), expected);
    // Offloaded twice, it still comes back whole.
    vm.suspend(true, None).unwrap();
    vm.resume(true).unwrap();
    assert_eq!(digest(&mut vm), expected);
}

#[test]
fn snapshot_of_cold_compressed_ram_restores_intact() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path(), "cold", RamKind::Memfd, None);
    opts.cold = Some(ColdConfig {
        cold_age: Duration::from_millis(100),
        scan_period: Duration::from_millis(25),
        cpu_budget: 0.5,
        idle_cpu_budget: 0.9,
        ..ColdConfig::default()
    });
    let mut vm = Vm::start(opts).unwrap();
    exec(&mut vm, "fill 32MiB repeated seed=3");
    let expected = digest(&mut vm);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while vm.stats().cold.unwrap().pooled_pages < 4096 {
        assert!(std::time::Instant::now() < deadline, "nothing was pooled");
        std::thread::sleep(Duration::from_millis(50));
    }
    let snap = dir.path().join("snap");
    vm.snapshot(&snap, None).unwrap();
    let mut restored = restore(dir.path(), "restored", &snap);
    assert_eq!(digest(&mut restored), expected);
}

#[test]
fn snapshot_changed_or_unusable_is_refused_with_the_reason() {
    if skip() {
        return;
    }
    let (dir, mut origin, snap, manifest_path, honest) =
        snapshot_to_edit("fill 8MiB random seed=23");
    // A manifest that seals another file as the disk (here the RAM image, whose seal it
    // copies) while disk.img is changed: the file checked must be the file used.
    let mut manifest: serde_json::Value = serde_json::from_slice(&honest).unwrap();
    manifest["disk"] = manifest["ram"].clone();
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let disk_image = snap.join("disk.img");
    let disk_honest = std::fs::read(&disk_image).unwrap();
    std::fs::write(&disk_image, vec![0xA5; disk_honest.len()]).unwrap();
    let Err(err) = Vm::start(options(dir.path(), "named", RamKind::Snapshot, Some(&snap))) else {
        panic!("a snapshot whose manifest names another file as the disk was restored");
    };
    assert!(
        err.to_string().contains("not \"ram.img\" and \"disk.img\""),
        "{err}"
    );
    std::fs::write(&manifest_path, &honest).unwrap();
    std::fs::write(&disk_image, &disk_honest).unwrap();
    // Filled application data beyond the application memory (the guest would be asked to
    // digest past its RAM).
    let mut manifest: serde_json::Value = serde_json::from_slice(&honest).unwrap();
    manifest["app_bytes"] = serde_json::json!(u64::MAX);
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let Err(err) = Vm::start(options(
        dir.path(),
        "filled",
        RamKind::Snapshot,
        Some(&snap),
    )) else {
        panic!("a snapshot with more filled data than application memory was restored");
    };
    assert!(err.to_string().contains("app_bytes"), "{err}");
    std::fs::write(&manifest_path, &honest).unwrap();
    // The disk copy's path taken by a file of another user (who would read the guest's
    // disk through it): refused, and nothing written into it.
    let planted = dir.path().join("planted.disk");
    std::fs::write(&planted, b"theirs").unwrap();
    std::os::unix::fs::chown(&planted, Some(65534), Some(65534)).unwrap();
    let mut planted_options = options(dir.path(), "planted", RamKind::Snapshot, Some(&snap));
    planted_options.disk.clone_from(&planted);
    let Err(err) = Vm::start(planted_options) else {
        panic!("a restore wrote its disk into another user's file");
    };
    assert!(err.to_string().contains("belongs to uid 65534"), "{err}");
    assert_eq!(std::fs::read(&planted).unwrap(), b"theirs");
    // One byte of the image changed (root may write a read-only file).
    let image = snap.join("ram.img");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&image)
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &[0x5A], 2 << 20).unwrap();
    drop(file);
    let err = Vm::start(options(dir.path(), "bad", RamKind::Snapshot, Some(&snap))).unwrap_err();
    assert!(err.to_string().contains("does not match its seal"), "{err}");
    // Not a snapshot at all.
    let err = Vm::start(options(
        dir.path(),
        "none",
        RamKind::Snapshot,
        Some(dir.path()),
    ))
    .unwrap_err();
    assert!(err.to_string().contains("not a snapshot"), "{err}");
    // And why: the cause is kept.
    let chain = basics::error_chain(&err);
    assert!(chain.contains("manifest.json: No such file"), "{chain}");
    // The wrong RAM size.
    let mut wrong = options(dir.path(), "size", RamKind::Snapshot, Some(&snap));
    wrong.memory = 128 << 20;
    let err = Vm::start(wrong).unwrap_err();
    assert!(err.to_string().contains("bytes of RAM"), "{err}");
    // An offloaded VM's snapshot is read from its offload store: its RAM stays offloaded,
    // and the snapshot restores to the same bytes.
    let expected = digest(&mut origin);
    origin.suspend(true, None).unwrap();
    let resident = |vm: &Vm| vm.machine().pager().state_counts().resident;
    let before = resident(&origin);
    let later = dir.path().join("later");
    origin.snapshot(&later, None).unwrap();
    assert_eq!(resident(&origin), before, "the snapshot brought RAM back");
    assert_eq!(origin.state(), vmm::vm::VmState::Offloaded);
    let mut restored = Vm::start(options(
        dir.path(),
        "later",
        RamKind::Snapshot,
        Some(&later),
    ))
    .unwrap();
    assert_eq!(digest(&mut restored), expected);
}

#[test]
fn snapshot_compressed_is_small_and_restores_lazily() {
    if skip() {
        return;
    }
    let dir = open_tempdir();
    let mut origin = Vm::start(options(dir.path(), "origin", RamKind::Anon, None)).unwrap();
    exec(&mut origin, "fill 64MiB repeated seed=24");
    let expected = digest(&mut origin);
    let snap = dir.path().join("snap");
    origin
        .snapshot(
            &snap,
            Some(vmm::snapshot::RamStore::new(
                compressed_backing::CodecConfig::new(compressed_backing::Codec::Lz4),
            )),
        )
        .unwrap();
    let manifest = vmm::snapshot::read_manifest(&snap).unwrap();
    assert_eq!(manifest.ram_format, vmm::snapshot::RamFormat::Store);
    assert_sealed_and_private(&snap);
    // 64 MiB of one motif: a few hundred KiB on disk.
    let on_disk: u64 = std::fs::read_dir(snap.join("ram.store"))
        .unwrap()
        .map(|e| compressed_backing::store::allocated_bytes(&e.unwrap().path()))
        .sum();
    assert!(on_disk < 4 << 20, "{on_disk} bytes on disk");
    // Loaded lazily into anon RAM, twice, and offloaded again like any anon VM.
    let mut vms: Vec<Vm> = (0..2)
        .map(|i| {
            Vm::start(options(
                dir.path(),
                &format!("r{i}"),
                RamKind::Anon,
                Some(&snap),
            ))
            .unwrap()
        })
        .collect();
    for vm in &mut vms {
        assert_eq!(digest(vm), expected);
    }
    exec(&mut vms[0], "rewrite 10 seed=2");
    let written = digest(&mut vms[0]);
    vms[0].suspend(true, None).unwrap();
    vms[0].resume(false).unwrap();
    assert_eq!(digest(&mut vms[0]), written);
    assert_eq!(digest(&mut vms[1]), expected);
    // A store cannot be mapped as snapshot RAM: it is loaded into RAM of another kind.
    let err = Vm::start(options(dir.path(), "bad", RamKind::Snapshot, Some(&snap))).unwrap_err();
    assert!(
        err.to_string()
            .contains("anon, memfd, hugetlb or hugetlb-memfd RAM"),
        "{err}"
    );
}

#[test]
fn snapshot_store_block_size_is_kept_and_restores_fault_by_its_blocks() {
    if skip() {
        return;
    }
    let dir = open_tempdir();
    let mut origin = Vm::start(options(dir.path(), "origin", RamKind::Anon, None)).unwrap();
    exec(&mut origin, "fill 8MiB random seed=31; rewrite 5 seed=4");
    let expected = digest(&mut origin);
    for bytes in [16u64 << 10, 1 << 20] {
        let block_size = compressed_backing::BlockSize::new(bytes).unwrap();
        let snap = dir.path().join(format!("snap-{bytes}"));
        let mut store = vmm::snapshot::RamStore::new(compressed_backing::CodecConfig::new(
            compressed_backing::Codec::Lz4,
        ));
        store.block_size = block_size;
        origin.snapshot(&snap, Some(store)).unwrap();
        let written =
            compressed_backing::store::DiskStore::open_read_only(snap.join("ram.store")).unwrap();
        assert_eq!(written.block_size(), block_size);
        drop(written);
        let mut restored = Vm::start(options(
            dir.path(),
            &format!("r-{bytes}"),
            RamKind::Anon,
            Some(&snap),
        ))
        .unwrap();
        // One fault, one payload: the pager moves the store's blocks.
        assert_eq!(restored.machine().pager().block_size(), block_size);
        assert_eq!(digest(&mut restored), expected);
    }
}

#[test]
fn snapshot_out_appearing_while_written_is_never_replaced() {
    if skip() {
        return;
    }
    let dir = open_tempdir();
    let mut vm = Vm::start(options(dir.path(), "origin", RamKind::Anon, None)).unwrap();
    exec(&mut vm, "fill 128MiB random seed=4");
    let out = dir.path().join("snap");
    let partial = out.with_extension(format!("partial-{}", std::process::id()));
    // Another process's empty directory appears at `out` once the snapshot is being written:
    // after the check that `out` does not exist, before the rename into place.
    let planter = {
        let (out, partial) = (out.clone(), partial.clone());
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while !partial.exists() {
                assert!(std::time::Instant::now() < deadline, "no partial directory");
                std::thread::yield_now();
            }
            std::fs::create_dir(&out).unwrap();
        })
    };
    let result = vm.snapshot(&out, None);
    planter.join().unwrap();
    assert!(
        matches!(
            result,
            Err(VmError::Snapshot(vmm::snapshot::SnapshotError::Exists(_)))
        ),
        "{result:?}"
    );
    // The planted directory is still there, empty; the partial one is gone.
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
    assert!(!partial.exists());
}

#[test]
fn snapshot_manifest_registers_not_the_guests_cpl3_state_are_refused_naming_the_field() {
    if skip() {
        return;
    }
    let (dir, mut origin, snap, manifest_path, honest) =
        snapshot_to_edit("fill 4MiB random seed=5");
    // The registers are serialized as the structures' bytes: edit them as structures.
    type Edit = fn(&mut vmm::machine::VcpuState);
    let edits: [(&str, Edit); 14] = [
        // The guest at CPL0 (kernel code and stack selectors).
        ("cs", |v| v.sregs.cs.selector = 0x18),
        ("cs", |v| v.sregs.cs.dpl = 0),
        ("ss", |v| v.sregs.ss.selector = 0x20),
        ("ds", |v| v.sregs.ds.dpl = 0),
        ("cr3", |v| v.sregs.cr3 = 0x20_0000),
        ("cr0", |v| v.sregs.cr0 = 0x11),
        ("rip", |v| v.regs.rip = 64 << 20),
        ("rsp", |v| v.regs.rsp = 0x8000),
        // Flags a CPL3 program cannot set: virtual-8086 mode, a reserved bit, bit 1 clear.
        ("rflags", |v| v.regs.rflags |= 1 << 17),
        ("rflags", |v| v.regs.rflags &= !0x2),
        ("rflags", |v| v.regs.rflags |= 1 << 40),
        // Descriptor tables in the guest's own memory, and a task register of its choosing.
        ("gdt", |v| v.sregs.gdt.base = 0x10_0000),
        ("idt", |v| v.sregs.idt.limit = 0xfff),
        ("tr", |v| v.sregs.tr.base = 0x10_0000),
    ];
    for (i, (field, edit)) in edits.iter().enumerate() {
        let mut manifest: vmm::snapshot::Manifest = serde_json::from_slice(&honest).unwrap();
        edit(&mut manifest.vcpu);
        std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
        let name = format!("edited-{i}");
        let Err(err) = Vm::start(options(dir.path(), &name, RamKind::Snapshot, Some(&snap))) else {
            panic!("a snapshot whose manifest's {field} was edited was restored");
        };
        let message = err.to_string();
        assert!(message.contains(field), "{field}: {message}");
    }
    // The honest registers restore and continue.
    std::fs::write(&manifest_path, &honest).unwrap();
    let mut restored = restore(dir.path(), "honest", &snap);
    assert_eq!(digest(&mut restored), digest(&mut origin));
}

#[test]
fn snapshot_keeps_the_guests_arenas_and_refuses_a_manifest_that_forges_one() {
    if skip() {
        return;
    }
    let (dir, _origin, snap, manifest_path, honest) = snapshot_to_edit(
        "fill 4MiB random seed=7; arena open 1 8MiB discard; fill 8MiB random seed=8 arena=1; \
         arena close 1; arena open 2 4MiB survive; fill 4MiB distinct seed=9 arena=2",
    );
    let manifest: vmm::snapshot::Manifest = serde_json::from_slice(&honest).unwrap();
    assert_eq!(manifest.arenas.len(), 2, "{:?}", manifest.arenas);
    // The restored VM's guest goes on with its arenas, and the host knows them.
    let mut vm = restore(dir.path(), "arenas", &snap);
    let kept = exec(&mut vm, "digest arena=2")[0].digest.clone();
    exec(&mut vm, "arena close 2; arena free 1");
    assert_eq!(exec(&mut vm, "digest arena=2")[0].digest, kept);
    exec(&mut vm, "arena free 2");
    let stats = vm.stats().arenas.unwrap();
    assert_eq!(
        (stats.open, stats.closed, stats.refused),
        (0, 0, 0),
        "{stats:?}"
    );
    // A manifest that gives the guest an arena over its own first pages: refused.
    let mut forged: serde_json::Value = serde_json::from_slice(&honest).unwrap();
    forged["arenas"][0]["extents"] = serde_json::json!([[0, 2 << 20]]);
    std::fs::write(&manifest_path, serde_json::to_vec(&forged).unwrap()).unwrap();
    let Err(err) = Vm::start(options(
        dir.path(),
        "forged",
        RamKind::Snapshot,
        Some(&snap),
    )) else {
        panic!("a snapshot whose manifest forges an arena was restored");
    };
    assert!(err.to_string().contains("arenas"), "{err}");
}
