//! Phase arenas with a real vCPU (docs/arenas.md): a discard arena's memory goes at its close,
//! at once; a survive arena is compressed (or offloaded) at its close and comes back intact; a hostile
//! guest's reports are refused and move nothing.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use uffd_pager::cold::ColdConfig;
use uffd_pager::pager::RamKind;
use vmm::arena::{self, ArenaStats};
use vmm::guest::{self, FillKind};
use vmm::machine::CommandOutput;
use vmm::script;
use vmm::vm::{Vm, VmOptions};

const MIB: u64 = 1 << 20;

fn skip() -> bool {
    testkit::skip_unless(&["/dev/kvm", "/dev/userfaultfd"])
}

fn start(dir: &std::path::Path, kind: RamKind, cold: Option<ColdConfig>) -> Vm {
    Vm::start(VmOptions {
        ram_compression: cold.is_some(),
        cold,
        ..VmOptions::new(256 << 20, kind, dir.join("disk"), dir.join("ram"))
    })
    .unwrap()
}

/// A VM whose closed survive arenas go to the offload store.
fn start_offload(dir: &std::path::Path, kind: RamKind) -> Vm {
    Vm::start(VmOptions {
        arena_offload: true,
        ..VmOptions::new(256 << 20, kind, dir.join("disk"), dir.join("ram"))
    })
    .unwrap()
}

/// Cold compression that never finds anything cold by itself: what reaches the pool got
/// there by an arena's close.
fn never_cold() -> ColdConfig {
    ColdConfig {
        cold_age: Duration::from_secs(3600),
        ..ColdConfig::default()
    }
}

fn exec(vm: &mut Vm, script: &str) -> Vec<CommandOutput> {
    vm.exec(&script::parse(script).unwrap()).unwrap()
}

fn digest(vm: &mut Vm, script: &str) -> String {
    exec(vm, script).pop().unwrap().digest.expect("a digest")
}

fn arenas(vm: &Vm) -> ArenaStats {
    vm.stats().arenas.expect("the guest reported arenas")
}

fn resident(vm: &Vm) -> u64 {
    vm.stats().memory.guest_ram_resident_bytes
}

#[test]
fn discard_arena_memory_goes_at_close_and_a_touch_after_reads_zeros_and_counts() {
    for kind in [RamKind::Anon, RamKind::Memfd] {
        if skip() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mut vm = start(dir.path(), kind, None);
        exec(&mut vm, "fill 8MiB random seed=1");
        let app = digest(&mut vm, "digest");
        let out = exec(
            &mut vm,
            "arena open 7 64MiB discard; fill 64MiB random seed=2 arena=7",
        );
        let place = out[0].arena.unwrap();
        assert_eq!(place.len, 64 * MIB);
        assert_eq!(place.gpa % arena::EXTENT, 0);
        assert!(place.gpa >= guest::APP_BASE + 8 * MIB, "{place:?}");
        let filled = digest(&mut vm, "digest arena=7");
        let expect = guest::digest_hex(&guest::fill_bytes(64 * MIB, FillKind::Random, 2));
        assert_eq!(filled, expect);
        let before = resident(&vm);
        let pss_before = vm.stats().memory.guest_ram_pss_bytes;
        exec(&mut vm, "arena close 7");
        // At once: no scan, no cold age; the pager's count and the kernel's agree.
        let after = resident(&vm);
        let pss_after = vm.stats().memory.guest_ram_pss_bytes;
        assert!(
            before - after >= 63 * MIB,
            "{kind:?}: {before} -> {after} bytes resident"
        );
        assert!(
            pss_before.saturating_sub(pss_after) >= 63 * MIB,
            "{kind:?}: guest RAM PSS {pss_before} -> {pss_after}"
        );
        let stats = arenas(&vm);
        assert_eq!(stats.dropped_bytes, 64 * MIB, "{stats:?}");
        assert_eq!((stats.open, stats.closed, stats.refused), (0, 1, 0));
        assert_eq!(stats.touched_after_close_pages, 0);
        // The application data below is untouched.
        assert_eq!(digest(&mut vm, "digest"), app);
        // A harness bug: the arena read after its phase: zeros, and it shows.
        let zeros = guest::digest_hex(&vec![0u8; (64 * MIB) as usize]);
        assert_eq!(digest(&mut vm, "digest arena=7"), zeros);
        let stats = arenas(&vm);
        assert_eq!(
            stats.touched_after_close_pages,
            64 * MIB / 4096,
            "{stats:?}"
        );
        // Freed: forgotten, its memory dropped again, its place reused by the next arena.
        exec(&mut vm, "arena free 7");
        let stats = arenas(&vm);
        assert_eq!((stats.closed, stats.touched_after_close_pages), (0, 0));
        let out = exec(&mut vm, "arena open 8 2MiB survive");
        assert_eq!(out[0].arena.unwrap().gpa, place.gpa + 62 * MIB);
        assert_eq!(vm.stats().fault_errors, 0);
    }
}

#[test]
fn survive_arena_is_compressed_at_close_and_comes_back_intact() {
    for kind in [RamKind::Memfd, RamKind::Anon] {
        if skip() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mut vm = start(dir.path(), kind, Some(never_cold()));
        exec(
            &mut vm,
            "fill 4MiB random seed=3; arena open 1 32MiB survive; \
             fill 32MiB distinct seed=4 arena=1",
        );
        let kept = digest(&mut vm, "digest arena=1");
        let before = resident(&vm);
        exec(&mut vm, "arena close 1");
        let after = resident(&vm);
        let stats = arenas(&vm);
        assert!(stats.compressed_bytes >= 30 * MIB, "{kind:?}: {stats:?}");
        assert!(
            before - after >= 24 * MIB,
            "{kind:?}: {before} -> {after} bytes resident"
        );
        let cold = vm.stats().cold.unwrap();
        assert!(cold.pool.stored_bytes < 16 * MIB, "{cold:?}");
        // Back on touch, byte for byte.
        assert_eq!(digest(&mut vm, "digest arena=1"), kept);
        assert!(vm.stats().cold.unwrap().promotions >= 480);
        assert_eq!(arenas(&vm).touched_after_close_pages, 0);
        assert_eq!(vm.stats().fault_errors, 0);
    }
    // Without a pool to compress into, a survive arena stays as it is, and says so.
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = start(dir.path(), RamKind::Anon, None);
    exec(
        &mut vm,
        "arena open 1 4MiB survive; fill 4MiB distinct seed=4 arena=1",
    );
    let kept = digest(&mut vm, "digest arena=1");
    exec(&mut vm, "arena close 1");
    let stats = arenas(&vm);
    assert_eq!((stats.kept_bytes, stats.compressed_bytes), (4 * MIB, 0));
    assert_eq!(digest(&mut vm, "digest arena=1"), kept);
}

/// The pool without its scanner: only arenas' closes send blocks to it.
fn pool_only() -> ColdConfig {
    ColdConfig {
        scan: false,
        ..ColdConfig::default()
    }
}

#[test]
fn a_closed_survive_arena_comes_back_together_on_its_first_fault() {
    const BLOCKS: u64 = 32 * MIB / (64 << 10);
    for (kind, offload) in [
        (RamKind::Memfd, false),
        (RamKind::Anon, false),
        (RamKind::Memfd, true),
    ] {
        if skip() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mut vm = if offload {
            start_offload(dir.path(), kind)
        } else {
            start(dir.path(), kind, Some(pool_only()))
        };
        exec(
            &mut vm,
            "arena open 1 32MiB survive; fill 32MiB distinct seed=4 arena=1",
        );
        let kept = digest(&mut vm, "digest arena=1");
        exec(&mut vm, "arena close 1");
        let out = vm.stats().pager;
        assert_eq!(arenas(&vm).kept_bytes, 0, "{kind:?} {offload}");
        // Its next reader reads all of it: one fault brings the next blocks with it.
        assert_eq!(digest(&mut vm, "digest arena=1"), kept);
        let back = vm.stats().pager;
        let faults = back.fault_events - out.fault_events;
        let ahead = back.ahead_pages - out.ahead_pages;
        assert!(
            faults <= BLOCKS / 8,
            "{kind:?} {offload}: {faults} faults for {BLOCKS} blocks"
        );
        // Most of it came ahead (a block a fault thread was reading meanwhile is its own).
        assert!(
            ahead >= BLOCKS * 16 * 3 / 4,
            "{kind:?} {offload}: {ahead} pages ahead"
        );
        assert!(resident(&vm) >= 32 * MIB);
        assert_eq!(vm.stats().fault_errors, 0);
        // Without its scanner the pool probed nothing.
        if let Some(cold) = vm.stats().cold {
            assert_eq!(cold.blocks_probed, 0, "{cold:?}");
        }
    }
}

#[test]
fn an_arena_is_populated_at_open_and_freed_memory_stays_for_the_next_open() {
    for kind in [RamKind::Memfd, RamKind::Anon] {
        if skip() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mut vm = start(dir.path(), kind, Some(pool_only()));
        exec(&mut vm, "arena open 1 32MiB survive");
        assert_eq!(arenas(&vm).populated_bytes, 32 * MIB, "{kind:?}");
        // Its fill takes no fault of the pager's.
        let before = vm.stats().pager.fault_events;
        exec(&mut vm, "fill 32MiB distinct seed=4 arena=1");
        assert_eq!(vm.stats().pager.fault_events, before, "{kind:?}");
        let first = digest(&mut vm, "digest arena=1");
        // Freed and opened again on the same extents within one batch: nothing is dropped,
        // nothing populated again.
        let out = exec(
            &mut vm,
            "arena free 1; arena open 2 32MiB survive; fill 32MiB distinct seed=5 arena=2",
        );
        assert_eq!(out[1].arena.unwrap().len, 32 * MIB);
        let stats = arenas(&vm);
        assert_eq!(
            (stats.dropped_bytes, stats.populated_bytes),
            (0, 32 * MIB),
            "{kind:?}: {stats:?}"
        );
        let second = digest(&mut vm, "digest arena=2");
        assert_ne!(first, second);
        let expect = guest::digest_hex(&guest::fill_bytes(32 * MIB, FillKind::Distinct, 5));
        assert_eq!(second, expect);
        // Freed at the end of a batch: gone when the batch returns.
        let before = resident(&vm);
        exec(&mut vm, "arena free 2");
        let after = resident(&vm);
        assert!(
            before - after >= 31 * MIB,
            "{kind:?}: {before} -> {after} bytes resident"
        );
        assert_eq!(arenas(&vm).dropped_bytes, 32 * MIB);
        assert_eq!(vm.stats().fault_errors, 0);
    }
}

#[test]
fn survive_arena_goes_to_the_offload_store_at_close_and_comes_back_intact() {
    for kind in [RamKind::Anon, RamKind::Memfd] {
        if skip() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mut vm = start_offload(dir.path(), kind);
        exec(
            &mut vm,
            "fill 8MiB random seed=3; arena open 1 32MiB survive; \
             fill 32MiB distinct seed=4 arena=1",
        );
        let app = digest(&mut vm, "digest");
        let kept = digest(&mut vm, "digest arena=1");
        let before = resident(&vm);
        exec(&mut vm, "arena close 1");
        let after = resident(&vm);
        let stats = arenas(&vm);
        assert_eq!(
            (stats.offloaded_bytes, stats.kept_bytes),
            (32 * MIB, 0),
            "{kind:?}: {stats:?}"
        );
        assert!(
            before - after >= 31 * MIB,
            "{kind:?}: {before} -> {after} bytes resident"
        );
        // In the store, durably: what went is on disk, the application data is not.
        let stored = vm.stats().backing_disk_bytes;
        assert!(
            (32 * MIB..40 * MIB).contains(&stored),
            "{kind:?}: {stored} bytes"
        );
        assert_eq!(digest(&mut vm, "digest"), app);
        assert!(resident(&vm) < before - 24 * MIB, "the arena stayed out");
        // Back on touch, byte for byte, and a whole offload of the VM afterwards keeps it.
        assert_eq!(digest(&mut vm, "digest arena=1"), kept);
        vm.suspend(true, None).unwrap();
        vm.resume(false).unwrap();
        assert_eq!(digest(&mut vm, "digest arena=1"), kept);
        assert_eq!(digest(&mut vm, "digest"), app);
        assert_eq!(vm.stats().fault_errors, 0);
    }
}

#[test]
fn a_host_that_ignores_arenas_moves_nothing_until_the_guest_releases_their_memory() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = Vm::start(VmOptions {
        arenas: false,
        ..VmOptions::new(
            256 << 20,
            RamKind::Anon,
            dir.path().join("disk"),
            dir.path().join("ram"),
        )
    })
    .unwrap();
    exec(
        &mut vm,
        "fill 4MiB random seed=1; arena open 1 32MiB discard; fill 32MiB random seed=2 arena=1",
    );
    let app = digest(&mut vm, "digest");
    let before = resident(&vm);
    exec(&mut vm, "arena close 1");
    let stats = arenas(&vm);
    assert_eq!(
        (stats.ignored_bytes, stats.dropped_bytes),
        (32 * MIB, 0),
        "{stats:?}"
    );
    // Nothing was dropped, so nothing reads as touched after its close.
    assert_eq!(stats.touched_after_close_pages, 0, "{stats:?}");
    exec(&mut vm, "arena free 1");
    assert!(resident(&vm) + 2 * MIB > before, "nothing moved");
    assert_eq!(arenas(&vm).dropped_bytes, 0);
    // The guest's free-page report gives the freed arena back, with the application data.
    let out = exec(&mut vm, "release");
    assert_eq!(out[0].released_bytes, Some(36 * MIB), "{:?}", out[0]);
    assert!(before - resident(&vm) >= 35 * MIB);
    // A freed arena reopened over is in use again: a release leaves it be.
    exec(
        &mut vm,
        "arena open 2 32MiB survive; fill 32MiB random seed=3 arena=2; arena free 2; \
         arena open 3 32MiB survive; fill 32MiB random seed=4 arena=3",
    );
    let kept = digest(&mut vm, "digest arena=3");
    let out = exec(&mut vm, "release");
    assert_eq!(out[0].released_bytes, Some(0), "{:?}", out[0]);
    assert_eq!(digest(&mut vm, "digest arena=3"), kept);
    exec(&mut vm, "fill 4MiB random seed=1");
    assert_eq!(digest(&mut vm, "digest"), app);
}

#[test]
fn arena_offload_is_refused_where_the_vm_cannot_offload() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let err = Vm::start(VmOptions {
        arena_offload: true,
        pool: Some(dir.path().join("no-pool.sock")),
        ..VmOptions::new(
            64 << 20,
            RamKind::Anon,
            dir.path().join("disk"),
            dir.path().join("ram"),
        )
    })
    .unwrap_err();
    assert!(err.to_string().contains("arenas cannot go"), "{err}");
}

/// The script of a hostile report poked word by word into the report page, then sent.
fn forged(kind: u16, id: u64, intent: u64, extents: &[(u64, u64)], count: Option<u64>) -> String {
    let at = arena::REPORT_GPA;
    let word0 = u64::from(arena::MAGIC) | u64::from(arena::VERSION) << 32 | u64::from(kind) << 48;
    let mut script = format!(
        "poke {:#x} {id}; poke {:#x} {intent}; poke {:#x} {}",
        at + 8,
        at + 16,
        at + 24,
        count.unwrap_or(extents.len() as u64)
    );
    for (i, (gpa, len)) in extents.iter().enumerate() {
        let e = at + 40 + 16 * i as u64;
        script += &format!("; poke {e:#x} {gpa:#x}; poke {:#x} {len:#x}", e + 8);
    }
    script + &format!("; poke {at:#x} {word0:#x} out={:#x}", arena::PORT_ARENA)
}

#[test]
fn hostile_arena_reports_are_refused_and_nothing_moves() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = start(dir.path(), RamKind::Anon, None);
    let ram = 256 * MIB;
    let out = exec(
        &mut vm,
        "fill 16MiB random seed=5; arena open 3 8MiB discard; fill 8MiB random seed=6 arena=3",
    );
    let place = out[1].arena.unwrap();
    let app = digest(&mut vm, "digest");
    let data = digest(&mut vm, "digest arena=3");
    let resident_before = resident(&vm);
    let (open, close, free) = (1u16, 2u16, 3u16);
    let cases: Vec<(String, &str)> = vec![
        (
            forged(close, 9, 2, &[(place.gpa, place.len)], None),
            "arena 9 is not open",
        ),
        (
            forged(close, 3, 2, &[(place.gpa, 2 * MIB)], None),
            "differ from its open",
        ),
        (
            forged(free, 3, 1, &[(place.gpa, place.len)], None),
            "differ from its open",
        ),
        (forged(open, 4, 2, &[(0, 2 * MIB)], None), "not whole 2 MiB"),
        (
            forged(open, 4, 2, &[(ram - 2 * MIB, 4 * MIB)], None),
            "not whole 2 MiB",
        ),
        (
            forged(open, 4, 2, &[(place.gpa + 4096, 2 * MIB)], None),
            "not whole 2 MiB",
        ),
        (
            forged(open, 4, 2, &[(place.gpa, 2 * MIB)], None),
            "overlaps arena 3",
        ),
        (
            forged(open, 4, 9, &[(64 * MIB, 2 * MIB)], None),
            "unknown intent",
        ),
        (
            forged(7, 4, 2, &[(64 * MIB, 2 * MIB)], None),
            "unknown report kind",
        ),
        (
            forged(open, 4, 2, &[(64 * MIB, 2 * MIB)], Some(1 << 40)),
            "extents",
        ),
    ];
    for (i, (script, reason)) in cases.iter().enumerate() {
        exec(&mut vm, script);
        let stats = arenas(&vm);
        assert_eq!(stats.refused, i as u64 + 1, "case {i}: {stats:?}");
        let last = stats.last_refusal.unwrap();
        assert!(last.contains(reason), "case {i}: {last}");
    }
    // Nothing moved: the arena and the data are where they were, whole and resident.
    let stats = arenas(&vm);
    assert_eq!((stats.open, stats.closed, stats.dropped_bytes), (1, 0, 0));
    assert_eq!(digest(&mut vm, "digest"), app);
    assert_eq!(digest(&mut vm, "digest arena=3"), data);
    assert!(resident(&vm) + MIB >= resident_before);
    // A flood: refused past the rate, counted apart.
    let flood = vec![
        format!(
            "poke {:#x} 0 out={:#x}",
            arena::REPORT_GPA,
            arena::PORT_ARENA
        );
        // 2000 reports need 1.7 s to stay within the rate: far more than they take, even on
        // a loaded host.
        2000
    ];
    exec(&mut vm, &flood.join("; "));
    let stats = arenas(&vm);
    assert!(stats.refused_flood >= 50, "{stats:?}");
    // The guest's own arena still closes as it should once the flood is over.
    std::thread::sleep(Duration::from_millis(300));
    exec(&mut vm, "arena close 3");
    assert_eq!(arenas(&vm).dropped_bytes, 8 * MIB);
    assert_eq!(digest(&mut vm, "digest"), app);
}

#[test]
fn arena_commands_refuse_what_the_guest_cannot_do() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = start(dir.path(), RamKind::Anon, None);
    exec(&mut vm, "fill 8MiB repeated; arena open 1 16MiB discard");
    for (bad, reason) in [
        (
            "arena open 1 2MiB discard",
            "no such arena, one of that id open",
        ),
        ("arena close 2", "no such arena"),
        ("digest arena=2", "no such arena"),
        ("arena open 2 1GiB survive", "size beyond"),
        ("fill 250MiB zero", "size beyond"),
        ("fill 32MiB zero arena=1", "size beyond"),
    ] {
        let err = vm.exec(&script::parse(bad).unwrap()).unwrap_err();
        assert!(err.to_string().contains(reason), "{bad}: {err}");
    }
    // Application data up to the arena's first byte is fine.
    exec(&mut vm, "fill 200MiB zero");
}
