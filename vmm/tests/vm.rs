//! The VM lifecycle with a real vCPU: offload and resume keep every byte, and offload gives
//! the memory back.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use uffd_pager::pager::RamKind;
use vmm::script;
use vmm::vm::{Vm, VmOptions, VmState};

fn skip() -> bool {
    testkit::skip_unless(&["/dev/kvm", "/dev/userfaultfd"])
}

/// Process-wide PSS is measured: one VM at a time in this test binary.
static ONE_VM: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn options(dir: &std::path::Path, kind: RamKind, compression: bool) -> VmOptions {
    VmOptions {
        ram_compression: compression,
        io_threads: 2,
        ..VmOptions::new(512 << 20, kind, dir.join("disk"), dir.join("ram"))
    }
}

fn digest(vm: &mut Vm) -> String {
    let out = vm.exec(&script::parse("digest").unwrap()).unwrap();
    out[0].digest.clone().unwrap()
}

#[test]
fn vm_offload_and_resume_keep_every_byte_and_give_memory_back() {
    if skip() {
        return;
    }
    let _one = ONE_VM.lock().unwrap_or_else(|p| p.into_inner());
    for (kind, compression, content, eager) in [
        (RamKind::Anon, false, "random", false),
        (RamKind::Anon, true, "repeated", true),
        (RamKind::Memfd, true, "random", false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut vm = Vm::start(options(dir.path(), kind, compression)).unwrap();
        vm.exec(&script::parse(&format!("fill 64MiB {content} seed=5")).unwrap())
            .unwrap();
        let before = digest(&mut vm);
        let resident = vm.stats();
        assert!(
            resident.memory.guest_ram_pss_bytes >= 64 << 20,
            "{resident:?}"
        );

        let report = vm.suspend(true, None).unwrap();
        assert_eq!(report.state, VmState::Offloaded);
        let offloaded = vm.stats();
        eprintln!(
            "{kind:?} {content} compression={compression}: PSS {} -> {} KiB (guest RAM {} KiB), store {} KiB",
            resident.memory.process_pss_bytes >> 10,
            offloaded.memory.process_pss_bytes >> 10,
            offloaded.memory.guest_ram_pss_bytes >> 10,
            offloaded.backing_disk_bytes >> 10
        );
        assert!(
            offloaded.memory.guest_ram_pss_bytes < 1 << 20,
            "{offloaded:?}"
        );
        assert!(
            offloaded.memory.process_pss_bytes + (60 << 20) < resident.memory.process_pss_bytes,
            "{offloaded:?}"
        );
        // Offloading twice is a no-op.
        assert!(vm.suspend(true, None).unwrap().offload.is_none());
        // Commands wait for a resume.
        assert!(vm.exec(&script::parse("digest").unwrap()).is_err());

        vm.resume(eager).unwrap();
        assert_eq!(digest(&mut vm), before, "{kind:?} {content}");
        assert!(
            vm.resume(false).is_err(),
            "resuming a running VM must be refused"
        );
    }
}

#[test]
fn vm_release_gives_the_application_memory_back() {
    if skip() {
        return;
    }
    let _one = ONE_VM.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    for kind in [RamKind::Anon, RamKind::Memfd] {
        let mut vm = Vm::start(options(dir.path(), kind, false)).unwrap();
        vm.exec(&script::parse("fill 64MiB random").unwrap())
            .unwrap();
        let before = vm.stats().memory.guest_ram_pss_bytes;
        let out = vm.exec(&script::parse("release; digest").unwrap()).unwrap();
        assert_eq!(out[0].released_bytes, Some(64 << 20));
        let after = vm.stats().memory.guest_ram_pss_bytes;
        assert!(after + (60 << 20) < before, "{kind:?}: {before} -> {after}");
        // The released memory reads as zeros; it can be filled again.
        vm.exec(&script::parse("fill 16MiB repeated; digest").unwrap())
            .unwrap();
    }
}

#[test]
fn vm_sampler_integrates_guest_memory_over_time() {
    use std::time::Duration;
    use vmm::sampler::{Plan, Probe, Quantity, Sampler, VmProbe};
    if skip() {
        return;
    }
    let _one = ONE_VM.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let mut vm = Vm::start(options(dir.path(), RamKind::Anon, false)).unwrap();
    let ram = vm.machine().ram();
    let probe = VmProbe {
        pid: std::process::id(),
        ram: (ram.host_base().0, ram.size()),
        cgroup: None,
    };
    let empty = probe.guest().unwrap().guest_pss_bytes;
    let plan = Plan {
        period: Duration::from_millis(20),
        pss_every: 1,
    };
    let sampler = Sampler::start(plan, vec![Box::new(probe)]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    vm.exec(&script::parse("fill 64MiB random seed=9").unwrap())
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let recording = sampler.finish();
    let readings: Vec<u64> = recording.guest[0]
        .iter()
        .filter_map(|p| p.reading.map(|r| r.guest_pss_bytes))
        .collect();
    // The fill shows: from next to nothing to the 64 MiB of data.
    assert!(empty < 8 << 20, "{empty}");
    assert!(*readings.last().unwrap() >= 64 << 20, "{readings:?}");
    // About 0.3 s with 64 MiB (0.019 GiB·s; at least a third of it even if this thread was
    // starved), and never more than the whole span at 66 MiB.
    let integral = recording.integral_gib_s(0, Quantity::GuestPss);
    let span = recording.series[0].last().unwrap().at.as_secs_f64();
    assert!(integral > 0.1 * 64.0 / 1024.0, "{integral}");
    assert!(integral < span * 66.0 / 1024.0, "{integral}");
    assert_eq!(recording.integrity().dropped, 0);
}
