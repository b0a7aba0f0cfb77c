//! A real vCPU (KVM) running the workload guest over pager-managed RAM.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::time::Instant;

use uffd_pager::pager::RamKind;
use vmm::guest::{self, FillKind};
use vmm::machine::{Machine, MachineConfig};
use vmm::script::{self, Command};

fn skip() -> bool {
    testkit::skip_unless(&["/dev/kvm", "/dev/userfaultfd"])
}

fn boot(dir: &std::path::Path, memory: u64, kind: RamKind) -> Machine {
    Machine::boot(
        &MachineConfig::new(memory, kind, dir.join("disk")),
        Box::new(|e| panic!("fault error: {e}")),
    )
    .unwrap()
}

fn run(machine: &mut Machine, script: &str) -> Vec<vmm::machine::CommandOutput> {
    script::parse(script)
        .unwrap()
        .iter()
        .map(|c| machine.run(c).unwrap())
        .collect()
}

#[test]
fn machine_guest_fills_and_digests_like_the_host_computes() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for kind in [RamKind::Anon, RamKind::Memfd] {
        let mut machine = boot(dir.path(), 128 << 20, kind);
        let started = Instant::now();
        let out = run(
            &mut machine,
            "fill 16MiB random seed=7; digest; fill 8MiB repeated; digest; task",
        );
        let expect = guest::digest_hex(&guest::fill_bytes(16 << 20, FillKind::Random, 7));
        assert_eq!(out[1].digest.as_deref(), Some(expect.as_str()));
        let expect = guest::digest_hex(&guest::fill_bytes(8 << 20, FillKind::Repeated, 0));
        assert_eq!(out[3].digest.as_deref(), Some(expect.as_str()));
        assert_eq!(out[4].digest, out[3].digest);
        assert_eq!(out[4].disk_bytes, Some(8 << 20));
        assert_eq!(
            std::fs::metadata(dir.path().join("disk")).unwrap().len(),
            8 << 20
        );
        eprintln!(
            "{kind:?}: {:.1} ms for the script",
            started.elapsed().as_secs_f64() * 1e3
        );
    }
}

#[test]
fn machine_too_large_fill_is_refused_by_the_host() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut machine = boot(dir.path(), 16 << 20, RamKind::Anon);
    let err = machine
        .run(&Command::Fill {
            size: 64 << 20,
            kind: FillKind::Zero,
            seed: 0,
        })
        .unwrap_err();
    assert!(err.to_string().contains("application memory"), "{err}");
    // The VM still works.
    run(&mut machine, "fill 4MiB zero; digest");
}

#[test]
fn machine_stop_kicks_a_vcpu_whose_thread_blocks_every_signal() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut machine = boot(dir.path(), 1 << 30, RamKind::Anon);
    let interrupter = machine.interrupter();
    let fill = script::parse("fill 1000MiB random").unwrap().remove(0);
    let command = std::thread::spawn(move || {
        // A caller that keeps every signal to itself (as signal-handling code does).
        let all = nix::sys::signal::SigSet::all();
        all.thread_block().unwrap();
        let started = Instant::now();
        let result = machine.run(&fill);
        (result.map(|_| ()), started.elapsed())
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    interrupter.stop();
    let (result, took) = command.join().unwrap();
    assert!(
        matches!(result, Err(vmm::machine::MachineError::Stopped)),
        "{result:?} after {took:?}"
    );
    assert!(
        took < std::time::Duration::from_millis(1500),
        "the stop waited for the fill ({took:?})"
    );
}
