//! Live cold-RAM compression with a real vCPU: compressible memory goes to the pool and comes
//! back intact, random memory is left alone, writes during compression are never lost, and a
//! pool at its cap stops and says so.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use uffd_pager::cold::ColdConfig;
use uffd_pager::pager::RamKind;
use vmm::guest::{self, FillKind};
use vmm::script;
use vmm::vm::{Vm, VmOptions, VmStats};

fn skip() -> bool {
    testkit::skip_unless(&["/dev/kvm", "/dev/userfaultfd"])
}

/// Fast knobs, so that a test does not wait seconds for blocks to turn cold.
fn fast(pool_cap_share: f64) -> ColdConfig {
    ColdConfig {
        cold_age: Duration::from_millis(150),
        scan_period: Duration::from_millis(30),
        cpu_budget: 0.5,
        idle_cpu_budget: 0.9,
        pool_cap_share,
        ..ColdConfig::default()
    }
}

fn start(dir: &std::path::Path, cold: ColdConfig) -> Vm {
    start_kind(dir, cold, RamKind::Memfd)
}

fn start_kind(dir: &std::path::Path, cold: ColdConfig, kind: RamKind) -> Vm {
    Vm::start(VmOptions {
        ram_compression: true,
        io_threads: 2,
        cold: Some(cold),
        ..VmOptions::new(256 << 20, kind, dir.join("disk"), dir.join("ram"))
    })
    .unwrap()
}

fn exec(vm: &mut Vm, script: &str) -> Vec<vmm::machine::CommandOutput> {
    vm.exec(&script::parse(script).unwrap()).unwrap()
}

fn wait_for(vm: &Vm, what: &str, secs: u64, done: impl Fn(&VmStats) -> bool) -> VmStats {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let stats = vm.stats();
        if done(&stats) {
            return stats;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {stats:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn cold_repeated_content_goes_to_the_pool_and_comes_back_intact() {
    cold_repeated_content_goes_to_the_pool_and_comes_back_intact_on(RamKind::Memfd);
}

#[test]
fn anon_cold_repeated_content_goes_to_the_pool_and_comes_back_intact() {
    cold_repeated_content_goes_to_the_pool_and_comes_back_intact_on(RamKind::Anon);
}

fn cold_repeated_content_goes_to_the_pool_and_comes_back_intact_on(kind: RamKind) {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = start_kind(dir.path(), fast(0.5), kind);
    exec(&mut vm, "fill 32MiB repeated seed=1; idle");
    let stats = wait_for(&vm, "the data to turn cold", 20, |s| {
        s.cold.as_ref().is_some_and(|c| c.blocks_compressed >= 512)
    });
    let cold = stats.cold.as_ref().unwrap();
    // Of 32 MiB of data (and the guest's own few MiB), under 6 MiB stay resident. (Blocks
    // may turn cold while the fill still runs, so this is not measured against the peak.)
    assert!(stats.memory.guest_ram_resident_bytes < 6 << 20, "{stats:?}");
    assert!(cold.net_saving_bytes > 28 << 20, "{cold:?}");
    assert!(cold.pool.held_bytes < 1 << 20, "{cold:?}");
    let expect = guest::digest_hex(&guest::fill_bytes(32 << 20, FillKind::Repeated, 1));
    let out = exec(&mut vm, "digest");
    assert_eq!(out[0].digest.as_deref(), Some(expect.as_str()));
    let stats = vm.stats();
    assert!(stats.cold.as_ref().unwrap().promotions >= 512, "{stats:?}");
    assert_eq!(stats.fault_errors, 0);
}

#[test]
fn cold_random_content_is_left_alone_and_costs_nothing() {
    cold_random_content_is_left_alone_and_costs_nothing_on(RamKind::Memfd);
}

#[test]
fn anon_cold_random_content_is_left_alone_and_costs_nothing() {
    cold_random_content_is_left_alone_and_costs_nothing_on(RamKind::Anon);
}

fn cold_random_content_is_left_alone_and_costs_nothing_on(kind: RamKind) {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = start_kind(dir.path(), fast(0.5), kind);
    exec(&mut vm, "fill 32MiB random seed=2; idle");
    // Three rounds of attempts: the third backs each block off for four cold ages.
    let stats = wait_for(&vm, "every block to be tried three times", 20, |s| {
        s.cold.as_ref().is_some_and(|c| c.incompressible >= 3 * 512)
    });
    let cold = stats.cold.as_ref().unwrap();
    // Only blocks of the guest's own first 2 MiB (page tables, program, buffers) compress.
    assert!(cold.blocks_compressed <= 32, "{cold:?}");
    assert!(cold.pool.slabs <= 1, "{cold:?}");
    // What it costs: the tracking table, well under 1% of the data.
    assert!(cold.overhead_bytes < (32 << 20) / 100, "{cold:?}");
    assert!(
        stats.memory.guest_ram_resident_bytes >= 32 << 20,
        "{stats:?}"
    );
    // Backing off: in 1.2 s (eight cold ages, 160 idle scans) each block is tried once or
    // twice more, not at every scan.
    let later = {
        std::thread::sleep(Duration::from_millis(1200));
        vm.stats().cold.unwrap()
    };
    assert!(
        later.incompressible <= cold.incompressible + 2 * 512,
        "{later:?}"
    );
    let expect = guest::digest_hex(&guest::fill_bytes(32 << 20, FillKind::Random, 2));
    assert_eq!(
        exec(&mut vm, "digest")[0].digest.as_deref(),
        Some(expect.as_str())
    );
}

#[test]
fn cold_writes_during_compression_are_never_lost() {
    cold_writes_during_compression_are_never_lost_on(RamKind::Memfd);
}

#[test]
fn anon_cold_writes_during_compression_are_never_lost() {
    cold_writes_during_compression_are_never_lost_on(RamKind::Anon);
}

fn cold_writes_during_compression_are_never_lost_on(kind: RamKind) {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = start_kind(
        dir.path(),
        ColdConfig {
            cold_age: Duration::from_millis(20),
            scan_period: Duration::from_millis(5),
            cpu_budget: 0.9,
            idle_cpu_budget: 0.9,
            ..fast(0.5)
        },
        kind,
    );
    let mut model = guest::fill_bytes(16 << 20, FillKind::Distinct, 3);
    exec(&mut vm, "fill 16MiB distinct seed=3");
    for round in 0..40u64 {
        // Let the compressor get to work, then write while it does.
        std::thread::sleep(Duration::from_millis(8 + round % 7));
        exec(&mut vm, &format!("rewrite 7 seed={round}"));
        guest::rewrite_bytes(&mut model, 7, round);
    }
    let stats = vm.stats();
    let cold = stats.cold.as_ref().unwrap();
    assert!(
        cold.blocks_compressed > 0 && cold.promotions > 0,
        "{cold:?}"
    );
    let out = exec(&mut vm, "digest");
    assert_eq!(
        out[0].digest.as_deref(),
        Some(guest::digest_hex(&model).as_str()),
        "{cold:?}"
    );
}

#[test]
fn cold_pool_at_its_cap_stops_and_says_so() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // 0.4% of 256 MiB: about 1 MiB for the pool.
    let mut vm = start(dir.path(), fast(0.004));
    exec(&mut vm, "fill 32MiB distinct seed=4; idle");
    let stats = wait_for(&vm, "the pool to fill", 20, |s| {
        s.cold
            .as_ref()
            .is_some_and(|c| c.pool_full && c.pool_full_refusals > 0)
    });
    let cold = stats.cold.as_ref().unwrap();
    assert!(cold.pool.held_bytes <= cold.pool.cap_bytes, "{cold:?}");
    assert!(cold.blocks_compressed > 0, "{cold:?}");
    let expect = guest::digest_hex(&guest::fill_bytes(32 << 20, FillKind::Distinct, 4));
    assert_eq!(
        exec(&mut vm, "digest")[0].digest.as_deref(),
        Some(expect.as_str())
    );
}

#[test]
fn cold_offload_takes_pooled_blocks_as_they_are() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = start(dir.path(), fast(0.5));
    exec(&mut vm, "fill 16MiB repeated seed=5; idle");
    wait_for(&vm, "the data to turn cold", 20, |s| {
        s.cold.as_ref().is_some_and(|c| c.blocks_compressed >= 256)
    });
    vm.suspend(true, None).unwrap();
    let stats = vm.stats();
    assert_eq!(stats.pages.pooled, 0, "{stats:?}");
    assert_eq!(stats.cold.as_ref().unwrap().pool.blocks, 0, "{stats:?}");
    assert!(stats.backing_disk_bytes < 1 << 20, "{stats:?}");
    vm.resume(false).unwrap();
    let expect = guest::digest_hex(&guest::fill_bytes(16 << 20, FillKind::Repeated, 5));
    assert_eq!(
        exec(&mut vm, "digest")[0].digest.as_deref(),
        Some(expect.as_str())
    );
}

#[test]
fn cold_blocks_in_use_stay_resident_and_are_probed_once_per_cold_age() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = start(dir.path(), fast(0.5));
    exec(&mut vm, "fill 16MiB distinct seed=6");
    let before = vm.stats().cold.unwrap();
    // Read all of it every 50 ms for 1.5 s: ten cold ages, fifty scans.
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1500) {
        exec(&mut vm, "touch 16MiB");
        std::thread::sleep(Duration::from_millis(50));
    }
    let cold = vm.stats().cold.unwrap();
    // 256 blocks in use: probed about once per cold age (ten times each), not at every scan.
    let probed = cold.blocks_probed - before.blocks_probed;
    assert!(probed < 256 * 16, "{probed} probes: {cold:?}");
    // And never compressed: data in use stays resident.
    assert!(cold.pooled_pages < 1024, "{cold:?}");
}
