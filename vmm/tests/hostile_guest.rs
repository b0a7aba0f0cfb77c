//! A hostile guest against the VMM, with a real vCPU: requests with fields out of every bound
//! (`poke`), random request fields and port I/O (`chaos`). The VMM answers each with an error
//! status (or ends the command with a clear error), never touches memory outside the guest's
//! RAM or what was asked, never crashes, and the guest's data stays intact.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use uffd_pager::pager::RamKind;
use vmm::gateway::Gateway;
use vmm::guest::{self, FillKind};
use vmm::machine::{CommandOutput, Machine, MachineConfig, MachineError, PokeReport};
use vmm::replay::{ReplayServer, Step, Trajectory};
use vmm::script;

fn skip() -> bool {
    testkit::skip_unless(&["/dev/kvm", "/dev/userfaultfd"])
}

const RAM: u64 = 32 << 20;
/// Mailbox fields (guest-physical addresses).
const ARG5: u64 = guest::MAILBOX_GPA + 8 * 6;
const FREE_GPA: u64 = guest::MAILBOX_GPA + 144;
const FREE_LEN: u64 = guest::MAILBOX_GPA + 152;
/// Block request fields.
const BLK_OP: u64 = guest::BLK_GPA;
const BLK_OFFSET: u64 = guest::BLK_GPA + 8;
const BLK_LEN: u64 = guest::BLK_GPA + 16;
const BLK_BUF: u64 = guest::BLK_GPA + 24;

fn boot(dir: &std::path::Path, kind: RamKind) -> Machine {
    Machine::boot(
        &MachineConfig::new(RAM, kind, dir.join("disk")),
        Box::new(|e| panic!("fault error: {e}")),
    )
    .unwrap()
}

fn run(machine: &mut Machine, script: &str) -> Result<Vec<CommandOutput>, MachineError> {
    script::parse(script)
        .unwrap()
        .iter()
        .map(|c| machine.run(c))
        .collect()
}

/// Pokes `fields` (address, value), the last with an `out` to `port`; returns the statuses.
fn request(machine: &mut Machine, fields: &[(u64, u64)], port: u16) -> PokeReport {
    let (last, first) = fields.split_last().unwrap();
    let mut script: Vec<String> = first
        .iter()
        .map(|(gpa, value)| format!("poke {gpa:#x} {value:#x}"))
        .collect();
    script.push(format!("poke {:#x} {:#x} out={port:#x}", last.0, last.1));
    let out = run(machine, &script.join("; ")).unwrap();
    out.last().unwrap().poke.unwrap()
}

/// Fills 8 MiB (seed `seed`) and checks the guest digests what the host computes.
fn fill(machine: &mut Machine, seed: u64) -> String {
    let out = run(machine, &format!("fill 8MiB random seed={seed}; digest")).unwrap();
    let expect = guest::digest_hex(&guest::fill_bytes(8 << 20, FillKind::Random, seed));
    assert_eq!(out[1].digest.as_deref(), Some(expect.as_str()));
    expect
}

fn digest(machine: &mut Machine) -> String {
    run(machine, "digest").unwrap()[0].digest.clone().unwrap()
}

#[test]
fn hostile_guest_block_requests_out_of_bounds_get_an_errno() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut machine = boot(dir.path(), RamKind::Anon);
    let data = fill(&mut machine, 3);
    let (read, write) = (guest::blk::READ, guest::blk::WRITE);
    for (op, offset, len, buf, errno) in [
        // More than one I/O buffer (inside RAM: it was served, in one host buffer of its size).
        (write, 0, 16 << 20, 0, libc::EINVAL),
        (read, 0, u64::MAX, guest::IO_BUF_GPA, libc::EINVAL),
        // Not whole sectors.
        (write, 100, 512, guest::IO_BUF_GPA, libc::EINVAL),
        (write, 0, 100, guest::IO_BUF_GPA, libc::EINVAL),
        // Past the disk's bounds (a 1 TiB sparse disk file), or wrapping around.
        (write, 1 << 40, 4096, guest::IO_BUF_GPA, libc::EFBIG),
        (write, u64::MAX - 511, 512, guest::IO_BUF_GPA, libc::EFBIG),
        // Buffers outside RAM, or wrapping around.
        (read, 0, 4096, RAM - 2048, libc::EFAULT),
        (write, 0, 4096, u64::MAX - 1023, libc::EFAULT),
        (7, 0, 512, guest::IO_BUF_GPA, libc::EINVAL),
    ] {
        let report = request(
            &mut machine,
            &[
                (BLK_OFFSET, offset),
                (BLK_LEN, len),
                (BLK_BUF, buf),
                (BLK_OP, op),
            ],
            guest::PORT_BLK,
        );
        assert_eq!(
            report.blk_status,
            u64::try_from(errno).unwrap(),
            "op {op} offset {offset:#x} len {len:#x} buf {buf:#x}"
        );
    }
    let disk = std::fs::metadata(dir.path().join("disk")).unwrap().len();
    assert!(disk <= guest::DISK_MAX, "the disk grew to {disk} bytes");
    // A valid request is served; the data and the disk device still work.
    let report = request(
        &mut machine,
        &[
            (BLK_OFFSET, 4096),
            (BLK_LEN, 8192),
            (BLK_BUF, guest::IO_BUF_GPA),
            (BLK_OP, write),
        ],
        guest::PORT_BLK,
    );
    assert_eq!(report.blk_status, 0);
    assert_eq!(digest(&mut machine), data);
    let out = run(&mut machine, "task").unwrap();
    assert_eq!(out[0].digest.as_deref(), Some(data.as_str()));
}

#[test]
fn hostile_guest_free_reports_outside_the_application_data_are_refused() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for kind in [RamKind::Anon, RamKind::Memfd] {
        let mut machine = boot(dir.path(), kind);
        let data = fill(&mut machine, 4);
        let einval = u64::try_from(libc::EINVAL).unwrap();
        for (gpa, len) in [
            // The guest's own program and page tables: dropped, the guest ran on zeros.
            (guest::CODE_GPA, 0x1000),
            (guest::PML4_GPA, 0x1000),
            // Not whole pages, outside RAM, wrapping around, empty.
            (guest::APP_BASE + (8 << 20) + 1, 0x1000),
            (RAM - 0x1000, 0x2000),
            (u64::MAX - 0xFFF, 0x2000),
            (guest::APP_BASE + (16 << 20), u64::MAX - 0xFFF),
            (guest::APP_BASE + (16 << 20), 0),
        ] {
            let report = request(
                &mut machine,
                &[(FREE_GPA, gpa), (FREE_LEN, len)],
                guest::PORT_FREE,
            );
            assert_eq!(report.free_status, einval, "{kind:?}: {gpa:#x} {len:#x}");
            assert_eq!(digest(&mut machine), data, "{kind:?}: {gpa:#x} {len:#x}");
        }
        // Free memory above the data is dropped; the data stays.
        let report = request(
            &mut machine,
            &[
                (FREE_GPA, guest::APP_BASE + (16 << 20)),
                (FREE_LEN, 4 << 20),
            ],
            guest::PORT_FREE,
        );
        assert_eq!(report.free_status, 0, "{kind:?}");
        assert_eq!(digest(&mut machine), data, "{kind:?}");
        let out = run(&mut machine, "release").unwrap();
        assert_eq!(out[0].released_bytes, Some(8 << 20), "{kind:?}");
    }
}

/// A model server for a one-request trajectory, and a gateway to it.
fn model() -> (ReplayServer, Arc<Gateway>) {
    let trajectory = Trajectory {
        name: "t".into(),
        note: String::new(),
        time_scale: 1.0,
        steps: vec![Step::Model {
            wait_ms: 1.0,
            answer_bytes: 64,
        }],
        download_rate: None,
        image_rate: None,
    };
    let server = ReplayServer::start(&trajectory).unwrap();
    let gateway = Gateway::new(Some(&server.url()), "t", 0, Duration::from_secs(5)).unwrap();
    (server, Arc::new(gateway))
}

#[test]
fn hostile_guest_model_timer_out_of_range_is_an_error_not_a_panic() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut machine = boot(dir.path(), RamKind::Anon);
    let (_server, gateway) = model();
    machine.set_model_port(gateway, vmm::gateway::Batching::default());
    let data = fill(&mut machine, 5);
    for timer in [u64::MAX, guest::MAX_TIMER_MS + 1, 1 << 62] {
        let report = request(&mut machine, &[(ARG5, timer)], guest::PORT_MODEL);
        assert_eq!(report.model_error, 1, "timer {timer}");
    }
    assert_eq!(digest(&mut machine), data);
    let out = run(&mut machine, "model 1").unwrap();
    assert_eq!(out[0].answer_bytes, Some(64));
}

#[test]
fn hostile_guest_port_io_nothing_listens_to_is_ignored() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut machine = boot(dir.path(), RamKind::Anon);
    let data = fill(&mut machine, 6);
    for port in [0u16, 0x11, 0x3f, 0x1234, 0xffff] {
        request(&mut machine, &[(guest::IO_BUF_GPA, 1)], port);
        assert_eq!(digest(&mut machine), data, "port {port:#x}");
    }
}

#[test]
fn hostile_guest_that_crashed_gets_no_more_commands() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut machine = boot(dir.path(), RamKind::Anon);
    fill(&mut machine, 7);
    // Outside the identity map: a page fault with no handler, a triple fault.
    let err = run(&mut machine, "poke 0x10000000000 1").unwrap_err();
    assert!(err.to_string().contains("crashed"), "{err}");
    let err = run(&mut machine, "digest").unwrap_err();
    assert!(err.to_string().contains("takes no more commands"), "{err}");
    // Nor is it snapshotted: a restore would resume the guest in the middle of the command
    // that crashed, with nothing to say it cannot take another.
    let out = dir.path().join("snap");
    let err = vmm::snapshot::write(&machine, 1, &out, None).unwrap_err();
    assert!(
        basics::error_chain(&err).contains("takes no more commands"),
        "{err}"
    );
    assert!(!out.exists());
    assert!(std::fs::read_dir(dir.path()).unwrap().all(|e| !e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .contains("partial")));
}

#[test]
fn hostile_guest_chaos_leaves_the_vmm_running_and_the_data_intact() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (_server, gateway) = model();
    let (mut outs, mut held, mut ins) = (0, 0, 0);
    for seed in 1..=8u64 {
        let kind = if seed % 2 == 0 {
            RamKind::Memfd
        } else {
            RamKind::Anon
        };
        let mut machine = boot(dir.path(), kind);
        if seed % 4 < 2 {
            machine.set_model_port(
                Arc::clone(&gateway) as Arc<dyn vmm::gateway::ModelPort>,
                vmm::gateway::Batching::default(),
            );
        }
        let data = fill(&mut machine, seed);
        for round in 0..3 {
            let chaos = format!("chaos seed={} count=2000", seed * 10 + round);
            match run(&mut machine, &chaos) {
                Ok(out) => {
                    let report = out[0].chaos.unwrap();
                    (outs, held, ins) = (
                        outs + report.outs,
                        held + report.held_back,
                        ins + report.ins,
                    );
                }
                // A request the VMM refused may fail the command; the VM goes on.
                Err(MachineError::Command { .. }) => {}
                Err(e) => panic!("seed {seed} round {round}: {e}"),
            }
            assert_eq!(digest(&mut machine), data, "seed {seed} round {round}");
        }
        // The disk and the free reports still work.
        let out = run(&mut machine, "task; release").unwrap();
        assert_eq!(out[0].digest.as_deref(), Some(data.as_str()), "seed {seed}");
        assert_eq!(out[1].released_bytes, Some(8 << 20), "seed {seed}");
    }
    eprintln!("chaos: {outs} outs sent, {held} held back, {ins} ins");
    assert!(outs > 1000 && ins > 500, "{outs} outs, {ins} ins");
}
