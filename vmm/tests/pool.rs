//! The memory pool with real vCPUs: VMs with the same bytes end up mapping one copy, writes
//! stay in the VM that made them, unique content gains nothing and loses nothing, and VMs
//! keep their data when the pool daemon goes away.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use uffd_pager::pager::RamKind;
use uffd_pager::sharing::{PoolServer, Running};
use vmm::script;
use vmm::vm::{Vm, VmOptions};

const MEMORY: u64 = 128 << 20;
const DATA_PAGES: u64 = 8192;

fn skip() -> bool {
    testkit::skip_unless(&["/dev/kvm", "/dev/userfaultfd"])
}

/// A pool daemon on its own thread, stopped on drop.
struct Daemon {
    running: Running,
    server: Arc<PoolServer>,
}

impl Daemon {
    fn start(socket: &Path) -> Self {
        let running = Running::start(socket).unwrap();
        let server = Arc::clone(&running.server);
        Self { running, server }
    }

    /// As if the daemon died: no new VMs, every connection closed.
    fn kill(&mut self) {
        self.running.stop();
        self.server.disconnect_all();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

fn start(dir: &Path, name: &str, pool: Option<&Path>) -> Vm {
    Vm::start(VmOptions {
        io_threads: 2,
        pool: pool.map(Path::to_path_buf),
        ..VmOptions::new(
            MEMORY,
            RamKind::Anon,
            dir.join(format!("{name}.disk")),
            dir.join(format!("{name}.ram")),
        )
    })
    .unwrap()
}

fn exec(vm: &mut Vm, text: &str) -> Vec<vmm::machine::CommandOutput> {
    vm.exec(&script::parse(text).unwrap()).unwrap()
}

fn digest(vm: &mut Vm) -> String {
    exec(vm, "digest")[0].digest.clone().unwrap()
}

/// Ticks every VM a few rounds (what the VM process does between commands).
fn settle(vms: &mut [Vm]) {
    for _ in 0..3 {
        for vm in vms.iter_mut() {
            vm.pool_tick();
        }
    }
}

#[test]
fn pool_identical_vms_share_one_copy_and_keep_writes_apart() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("pool.sock");
    let daemon = Daemon::start(&socket);
    let mut vms: Vec<Vm> = (0..3)
        .map(|i| start(dir.path(), &format!("vm{i}"), Some(&socket)))
        .collect();
    for vm in &mut vms {
        exec(vm, "fill 32MiB random seed=41");
    }
    let expected = digest(&mut vms[0]);
    settle(&mut vms);
    for vm in &vms {
        let pool = vm.stats().pool.unwrap();
        assert!(pool.connected, "{pool:?}");
        assert!(pool.merged_pages >= DATA_PAGES, "{pool:?}");
    }
    // One copy in the pool, three references to each page.
    let stats = daemon.server.stats();
    assert!(
        stats.pool_pages >= DATA_PAGES && stats.pool_pages < DATA_PAGES + 64,
        "{stats:?}"
    );
    assert!(stats.references >= 3 * DATA_PAGES, "{stats:?}");
    assert!(daemon.server.allocated_bytes() < (DATA_PAGES + 64) * 4096);
    for vm in &mut vms {
        assert_eq!(digest(vm), expected);
    }
    // Reading the data maps the pool's pages: each VM pays about a third of them.
    for vm in &vms {
        let pss = vm.stats().memory.guest_ram_pss_bytes;
        assert!(pss < 20 << 20, "guest RAM PSS {pss}");
    }
    // A write gives the writer its own copy; the others keep the pool's.
    let rewritten = exec(&mut vms[0], "rewrite 50 seed=6")[0].pages.unwrap();
    let written = digest(&mut vms[0]);
    assert_ne!(written, expected);
    for vm in &mut vms[1..] {
        assert_eq!(digest(vm), expected);
    }
    vms[0].pool_tick();
    let pool = vms[0].stats().pool.unwrap();
    assert!(pool.released_pages >= rewritten, "{pool:?}");
    assert_eq!(digest(&mut vms[0]), written);
    // A VM that leaves while its process runs keeps its references (it could still map the
    // pages); the pages stay for the others either way.
    let references = daemon.server.stats().references;
    vms.pop();
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(daemon.server.stats().references, references);
    assert_eq!(digest(&mut vms[1]), expected);
    // A VM in the pool is not offloaded (its pool pages are shared).
    let err = vms[1].suspend(true, None).unwrap_err();
    assert!(err.to_string().contains("memory pool"), "{err}");
}

#[test]
fn pool_unique_content_gains_nothing_and_loses_nothing() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("pool.sock");
    let daemon = Daemon::start(&socket);
    let mut vms: Vec<Vm> = (0..2)
        .map(|i| start(dir.path(), &format!("vm{i}"), Some(&socket)))
        .collect();
    let mut plain = start(dir.path(), "plain", None);
    for (i, vm) in vms.iter_mut().enumerate() {
        exec(vm, &format!("fill 32MiB random seed={}", 50 + i));
    }
    exec(&mut plain, "fill 32MiB random seed=60");
    settle(&mut vms);
    // Only the guest's own identical pages (program, page tables) may be pooled.
    let stats = daemon.server.stats();
    assert!(stats.pool_pages < 64, "{stats:?}");
    for vm in &vms {
        assert!(vm.stats().pool.unwrap().merged_pages < 64);
        // No more than the same VM without the pool.
        let pss = vm.stats().memory.guest_ram_pss_bytes;
        assert!(
            pss <= plain.stats().memory.guest_ram_pss_bytes + (256 << 10),
            "guest RAM PSS {pss}"
        );
    }
}

#[test]
fn pool_daemon_gone_leaves_vms_with_their_data() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("pool.sock");
    let mut daemon = Daemon::start(&socket);
    let mut vms: Vec<Vm> = (0..2)
        .map(|i| start(dir.path(), &format!("vm{i}"), Some(&socket)))
        .collect();
    for vm in &mut vms {
        exec(vm, "fill 16MiB repeated seed=2");
    }
    let expected = digest(&mut vms[0]);
    settle(&mut vms);
    assert!(vms[0].stats().pool.unwrap().merged_pages >= 4096);
    daemon.kill();
    drop(daemon);
    for vm in &mut vms {
        assert_eq!(digest(vm), expected);
        exec(vm, "rewrite 10 seed=1");
        vm.pool_tick();
        let pool = vm.stats().pool.unwrap();
        assert!(!pool.connected && pool.error.is_some(), "{pool:?}");
    }
    // The VMs' own writes went to their own copies.
    let first = digest(&mut vms[0]);
    assert_eq!(first, digest(&mut vms[1]));
    assert_ne!(first, expected);
    // A pool that is not there is a clear error at start.
    let err = Vm::start(VmOptions {
        pool: Some(dir.path().join("none.sock")),
        ..vms[0].options().clone()
    })
    .unwrap_err();
    assert!(err.to_string().contains("memory pool"), "{err}");
}

/// `pvisor serve --memory-pool` on a socket in a fresh directory, `extra` flags added; waits
/// for the line that says it listens.
fn pvisor_pool(socket: &Path, extra: &[&str]) -> std::process::Child {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_pvisor"))
        .args(["serve", "--memory-pool", "--socket"])
        .arg(socket)
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(
        socket.exists(),
        "the pool printed {line:?} but has no socket"
    );
    child
}

#[test]
fn pvisor_pool_lets_other_uids_in_only_when_allowed() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("pool.sock");
    for (extra, refused) in [(&[][..], true), (&["--allow-uid", "65534"][..], false)] {
        let mut pool = pvisor_pool(&socket, extra);
        testkit::open_to_everyone(&socket);
        let closed = testkit::closed_for_nobody(&socket, 2);
        pool.kill().unwrap();
        pool.wait().unwrap();
        assert_eq!(
            closed,
            refused,
            "pvisor serve --memory-pool {extra:?}: a VM of uid 65534 was {}",
            if closed { "refused" } else { "let in" }
        );
    }
}
