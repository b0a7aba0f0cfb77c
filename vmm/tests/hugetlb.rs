//! VMs on 2 MiB huge pages through `pvisor`, with real /dev/kvm and /dev/userfaultfd: every
//! byte kept through offload and lazy or eager resume, the huge pages given back to the host,
//! free-page reports dropping whole huge pages, snapshots, cold compression, the refusals of
//! what cannot work; and anon RAM remapped with transparent huge pages after a resume.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use testkit::hugepages::{pool_count, HugePages};

mod common;
use common::{fails, skip, Detached};

const MIB: u64 = 1 << 20;

/// Huge pages for a 512 MiB VM and a few more.
fn lend() -> HugePages {
    HugePages::lend(512 / 2 + 8)
}

#[test]
fn hugetlb_vm_offload_and_resume_keep_every_byte_and_give_huge_pages_back() {
    if skip() {
        return;
    }
    let _lent = lend();
    // Raw offloads of one kind, compressed ones of the other.
    for (kind, compression) in [("hugetlb", "false"), ("hugetlb-memfd", "true")] {
        let runtime = tempfile::tempdir().unwrap();
        let surplus = pool_count("surplus_hugepages");
        let vm = Detached::start(
            runtime.path(),
            &[
                "--vm-ram-backing",
                kind,
                "--vm-ram-compression",
                compression,
            ],
            "fill 64MiB random seed=3; idle",
        );
        let digest = vm.digest();
        let before = vm.stats();
        // Huge pages are not in PSS: stats count them all the same.
        let ram = before["guest_ram_pss_bytes"].as_u64().unwrap();
        assert!((64 * MIB..100 * MIB).contains(&ram), "{kind}: {before}");
        let held = pool_count("surplus_hugepages") - surplus;
        assert_eq!(
            held * 2 * MIB,
            ram,
            "{kind}: every huge page the VM holds is counted"
        );

        // Offload, lazy resume.
        let report = vm.call("suspend", &["--vm-offload"]);
        assert_eq!(report["state"], "offloaded", "{kind}: {report}");
        assert_eq!(
            pool_count("surplus_hugepages"),
            surplus,
            "{kind}: the offload gave every huge page back to the host"
        );
        assert_eq!(vm.stats()["guest_ram_pss_bytes"], 0, "{kind}");
        vm.call("resume", &[]);
        assert_eq!(vm.digest(), digest, "{kind}");
        let task = vm.exec("task");
        assert_eq!(task[0]["digest"], digest.as_str(), "{kind}");

        // Offload, eager resume.
        vm.exec("fill 32MiB repeated");
        let digest = vm.digest();
        vm.call("suspend", &["--vm-offload"]);
        vm.call("resume", &["--eager"]);
        assert_eq!(vm.digest(), digest, "{kind}");
        let stats = vm.stats();
        assert_eq!(stats["fault_errors"], 0, "{kind}: {stats}");

        // A free-page report drops whole huge pages.
        let released = vm.exec("release");
        assert_eq!(released[0]["released_bytes"], 32 * MIB, "{kind}");
        let after = vm.stats()["guest_ram_pss_bytes"].as_u64().unwrap();
        assert!(after + 30 * MIB <= ram, "{kind}: {ram} -> {after}");
        vm.call("stop", &[]);
        wait_for_surplus(surplus, kind);
    }
}

/// Waits until the host's surplus huge pages are `surplus` again: a VM's last huge pages go
/// back when its process ends.
fn wait_for_surplus(surplus: u64, kind: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while pool_count("surplus_hugepages") != surplus {
        assert!(
            std::time::Instant::now() < deadline,
            "{kind}: huge pages kept"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn hugetlb_vm_discard_arena_gives_its_whole_huge_pages_back_at_close() {
    if skip() {
        return;
    }
    let _lent = lend();
    for kind in ["hugetlb", "hugetlb-memfd"] {
        let runtime = tempfile::tempdir().unwrap();
        let surplus = pool_count("surplus_hugepages");
        let vm = Detached::start(
            runtime.path(),
            &["--vm-ram-backing", kind],
            "fill 8MiB random seed=1; arena open 1 32MiB discard; \
             fill 32MiB random seed=2 arena=1; idle",
        );
        let digest = vm.digest();
        let held = pool_count("surplus_hugepages");
        let closed = vm.exec("arena close 1");
        assert!(closed[0]["arena"]["gpa"]
            .as_u64()
            .unwrap()
            .is_multiple_of(2 * MIB));
        // At once, and whole: the arena's 16 huge pages, no more and no fewer.
        assert_eq!(held - pool_count("surplus_hugepages"), 16, "{kind}");
        let stats = vm.stats();
        assert_eq!(
            stats["arenas"]["dropped_bytes"],
            32 * MIB,
            "{kind}: {stats}"
        );
        assert_eq!(vm.digest(), digest, "{kind}");
        // Touched after its close: zeros, in huge pages again, and counted.
        let zeros = vmm::guest::digest_hex(&vec![0u8; 32 << 20]);
        assert_eq!(
            vm.exec("digest arena=1")[0]["digest"],
            zeros.as_str(),
            "{kind}"
        );
        assert_eq!(held, pool_count("surplus_hugepages"), "{kind}");
        let stats = vm.stats();
        assert_eq!(
            stats["arenas"]["touched_after_close_pages"],
            32 * MIB / 4096,
            "{kind}: {stats}"
        );
        vm.call("stop", &[]);
        wait_for_surplus(surplus, kind);
    }
}

#[test]
fn hugetlb_vm_survive_arena_goes_to_the_store_in_whole_huge_pages_and_comes_back_intact() {
    if skip() {
        return;
    }
    let _lent = lend();
    for kind in ["hugetlb", "hugetlb-memfd"] {
        let runtime = tempfile::tempdir().unwrap();
        let surplus = pool_count("surplus_hugepages");
        let vm = Detached::start(
            runtime.path(),
            &["--vm-ram-backing", kind, "--vm-arena-offload"],
            "fill 8MiB random seed=1; arena open 1 32MiB survive; \
             fill 32MiB random seed=2 arena=1; idle",
        );
        let digest = vm.digest();
        let kept = vm.exec("digest arena=1")[0]["digest"].clone();
        let held = pool_count("surplus_hugepages");
        vm.exec("arena close 1");
        // Written to the store and given back at once, whole: the arena's 16 huge pages.
        assert_eq!(held - pool_count("surplus_hugepages"), 16, "{kind}");
        let stats = vm.stats();
        assert_eq!(
            stats["arenas"]["offloaded_bytes"],
            32 * MIB,
            "{kind}: {stats}"
        );
        assert_eq!(vm.digest(), digest, "{kind}");
        // Back on touch, in huge pages, byte for byte.
        assert_eq!(vm.exec("digest arena=1")[0]["digest"], kept, "{kind}");
        assert_eq!(held, pool_count("surplus_hugepages"), "{kind}");
        assert_eq!(vm.stats()["fault_errors"], 0, "{kind}");
        vm.call("stop", &[]);
        wait_for_surplus(surplus, kind);
    }
}

#[test]
fn hugetlb_vm_resume_that_the_host_cannot_give_huge_pages_is_refused_and_stays_offloaded() {
    if skip() {
        return;
    }
    let lent = lend();
    let runtime = tempfile::tempdir().unwrap();
    let vm = Detached::start(
        runtime.path(),
        &["--vm-ram-backing", "hugetlb"],
        "fill 32MiB random seed=5; idle",
    );
    let digest = vm.digest();
    vm.call("suspend", &["--vm-offload"]);
    // The host takes back what it lent: no surplus page can be made any more.
    lent.set(0);
    if pool_count("free_hugepages") == 0 {
        let error = vm.call_fails("resume", &[]);
        assert!(error.contains("stays offloaded"), "{error}");
        assert!(error.contains("nr_overcommit_hugepages"), "{error}");
        assert_eq!(vm.call("status", &[])["state"], "offloaded");
    }
    lent.set(512 / 2 + 8);
    vm.call("resume", &[]);
    assert_eq!(vm.digest(), digest);
}

#[test]
fn hugetlb_vm_snapshots_restore_into_huge_pages_and_base_pages_alike() {
    if skip() {
        return;
    }
    let _lent = HugePages::lend(3 * (512 / 2) + 8);
    let runtime = tempfile::tempdir().unwrap();
    let r = runtime.path();
    let origin = Detached::start(
        r,
        &["--vm-ram-backing", "hugetlb"],
        "fill 32MiB random seed=9; idle",
    );
    let digest = origin.digest();
    let (raw, packed) = (r.join("raw"), r.join("packed"));
    origin.call("snapshot", &["--out", raw.to_str().unwrap()]);
    origin.call(
        "snapshot",
        &["--out", packed.to_str().unwrap(), "--codec", "lz4"],
    );
    drop(origin);
    for snap in [&raw, &packed] {
        for kind in [None, Some("hugetlb"), Some("hugetlb-memfd")] {
            let mut args = vec!["--restore", snap.to_str().unwrap()];
            if let Some(kind) = kind {
                args.extend(["--vm-ram-backing", kind]);
            }
            let vm = Detached::start(r, &args, "idle");
            assert_eq!(vm.digest(), digest, "{snap:?} into {kind:?}");
            if kind.is_some() {
                // Loaded into huge pages it can offload and come back like any VM of them.
                vm.call("suspend", &["--vm-offload"]);
                vm.call("resume", &["--eager"]);
                assert_eq!(vm.digest(), digest, "{snap:?} into {kind:?}, offloaded");
                let stats = vm.stats();
                assert_eq!(stats["fault_errors"], 0, "{stats}");
                assert!(
                    stats["guest_ram_pss_bytes"].as_u64().unwrap() >= 32 * MIB,
                    "{stats}"
                );
            }
        }
    }
}

#[test]
fn hugetlb_memfd_vm_cold_compression_pools_whole_huge_pages_and_gives_them_back() {
    if skip() {
        return;
    }
    let _lent = lend();
    let runtime = tempfile::tempdir().unwrap();
    let surplus = pool_count("surplus_hugepages");
    let vm = Detached::start(
        runtime.path(),
        &[
            "--vm-ram-backing",
            "hugetlb-memfd",
            "--vm-cold-ram-compression",
            "--vm-cold-age-ms",
            "200",
            "--vm-cold-scan-ms",
            "50",
        ],
        "fill 64MiB repeated seed=5; idle",
    );
    let digest = vm.digest();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    // 32 huge pages of data, each probed by a MINOR fault, pooled and dropped whole.
    let stats = vm.stats_until(deadline, |stats| {
        stats["cold"]["blocks_compressed"].as_u64().unwrap() >= 32
            && stats["cold"]["pooled_pages"].as_u64().unwrap() >= 16384
    });
    assert!(
        stats["cold"]["net_saving_bytes"].as_i64().unwrap() > 56 << 20,
        "{stats}"
    );
    // The pooled huge pages went back to the host.
    let held = pool_count("surplus_hugepages") - surplus;
    assert!(
        held * 2 * MIB < 16 * MIB,
        "{held} huge pages still held: {stats}"
    );
    // Touched again, every byte comes back (whole huge pages decompressed).
    assert_eq!(vm.digest(), digest);
    assert_eq!(vm.stats()["fault_errors"], 0);
}

#[test]
fn thp_collapse_vm_comes_back_on_transparent_huge_pages() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let vm = Detached::start(
        runtime.path(),
        &["--vm-thp-collapse"],
        "fill 32MiB random seed=11; idle",
    );
    let digest = vm.digest();
    vm.call("suspend", &["--vm-offload"]);
    let resumed = vm.call("resume", &["--eager"]);
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap();
    if !thp.contains("[never]") {
        // The 32 MiB of data and the guest's own pages that came back.
        let collapsed = resumed["collapse"]["huge_pages"].as_u64().unwrap();
        assert!(collapsed >= 15, "{resumed}");
    }
    assert_eq!(vm.digest(), digest);
    // A lazy resume collapses nothing: its pages are not all there yet.
    vm.call("suspend", &["--vm-offload"]);
    let resumed = vm.call("resume", &[]);
    assert!(resumed.get("collapse").is_none(), "{resumed}");
    assert_eq!(vm.digest(), digest);
}

#[test]
fn hugetlb_vm_refusals_say_why() {
    if skip() {
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--executor", "vm", "--memory", "512MiB"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "digest"]);
        fails(runtime.path(), &args)
    };
    let error = run(&["--vm-ram-backing", "hugetlb", "--vm-ram-dedup"]);
    assert!(error.contains("KSM does not merge huge pages"), "{error}");
    let error = run(&["--vm-ram-backing", "hugetlb", "--vm-cold-ram-compression"]);
    assert!(error.contains("does not work on hugetlb RAM"), "{error}");
    let error = run(&[
        "--vm-ram-backing",
        "hugetlb",
        "--vm-governor",
        "/nonexistent.sock",
    ]);
    assert!(error.contains("not charged to a memory cgroup"), "{error}");
    let error = run(&["--vm-ram-backing", "hugetlb", "--vm-thp-collapse"]);
    assert!(error.contains("not with another RAM kind"), "{error}");
    let error = run(&["--vm-ram-backing", "huge"]);
    assert!(error.contains("hugetlb-memfd"), "{error}");
    // A pool that cannot give the RAM's huge pages: refused before anything is mapped, with
    // the setting to raise. (The lock keeps other tests from lending meanwhile.)
    let none = HugePages::lend(0);
    let free = pool_count("free_hugepages") + pool_count("nr_overcommit_hugepages");
    if free < 256 {
        let error = run(&["--vm-ram-backing", "hugetlb"]);
        assert!(error.contains("nr_overcommit_hugepages"), "{error}");
        assert!(error.contains("256 huge pages"), "{error}");
    }
    drop(none);
}
