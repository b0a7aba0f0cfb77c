//! `uffd-pager serve`: the standalone server.

use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use compressed_backing::remote::StoreLocation;
use compressed_backing::BlockSize;
use nix::sys::signal::{SigSet, Signal};
use uffd_pager::server::keeper::KeeperClient;
use uffd_pager::server::{Server, ServerConfig};
use uffd_pager::socket::PeerPolicy;
use uffd_pager::source::{PageSource, RawFileSource, StoreSource};

use super::{CliResult, RemoteArgs};

/// `serve --memory-pool`: the pool daemon until SIGINT or SIGTERM. VMs that mapped pool pages
/// keep them after it stops (their mappings hold the memfd); they only stop merging.
pub fn memory_pool(socket: &Path, peers: PeerPolicy) -> CliResult {
    init_logging();
    let stats = uffd_pager::sharing::run_daemon_with(socket, peers)?;
    tracing::info!(?stats, "memory pool stopped");
    Ok(ExitCode::SUCCESS)
}

pub(super) fn init_logging() {
    uffd_pager::logging::init(uffd_pager::logging::Style::Full);
}

pub fn serve(
    socket: &Path,
    mem_file: Option<&Path>,
    store: Option<&StoreLocation>,
    remote: &RemoteArgs,
    threads: usize,
    peers: PeerPolicy,
    keeper: Option<&Path>,
) -> CliResult {
    init_logging();
    // Only the wait below receives the stop signals; every thread inherits the mask.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    signals.thread_block()?;

    let mut store_dir = None;
    let (source, block_size): (Arc<dyn PageSource>, BlockSize) = match (mem_file, store) {
        (Some(path), _) => (
            // Its error names the file and keeps the cause (a FIFO, a link, ENOENT).
            Arc::new(RawFileSource::open(path)?),
            BlockSize::default(),
        ),
        (None, Some(location)) => {
            let store = super::store::open_read_only(location, remote)?;
            let block_size = store.block_size();
            store_dir = Some(store.dir().to_path_buf());
            (Arc::new(StoreSource::new(store)), block_size)
        }
        (None, None) => return Err("give --mem-file FILE or --store DIR".into()),
    };
    let config = ServerConfig {
        threads: threads.max(1),
        block_size,
    };
    // With a keeper: attach first; a keeper that holds the socket VMMs connect to hands it
    // over, and this server accepts on it instead of binding its own.
    let client = match keeper {
        Some(path) => Some(
            KeeperClient::attach(path, Duration::from_secs(10))
                .map_err(|e| format!("cannot attach to the keeper {}: {e}", path.display()))?,
        ),
        None => None,
    };
    let server = match client.as_ref().and_then(KeeperClient::take_listener) {
        Some((listener, listen)) => {
            if !same_path(&listen, socket) {
                return Err(format!(
                    "the keeper holds the socket {} for VMMs, and this server was given \
                     --socket {}: give the keeper's",
                    listen.display(),
                    socket.display()
                )
                .into());
            }
            Server::listen_on(listener, socket, Arc::clone(&source), config)
        }
        None => Server::bind(socket, Arc::clone(&source), config),
    }
    .map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?
    .allow_peers(peers);
    let image_id = match (mem_file, &store_dir) {
        (Some(path), _) => uffd_pager::server::handover::image_id(path, false)?,
        // A remote store's mirror: its index is the remote one.
        (None, Some(dir)) => uffd_pager::server::handover::image_id(dir, true)?,
        (None, None) => return Err("give --mem-file FILE or --store DIR".into()),
    };
    let server = server.with_image_id(&image_id);
    let server = match (keeper, client) {
        (Some(path), Some(client)) => {
            let server = server.with_keeper_client(client);
            let taken = server.take_over()?;
            tracing::info!(keeper = %path.display(), vms = taken, "attached to the keeper");
            server
        }
        _ => server,
    };
    tracing::info!(
        socket = %socket.display(),
        image_bytes = source.image_size(),
        "listening"
    );
    uffd_pager::socket::announce(socket)?;
    let stop = Arc::new(AtomicBool::new(false));
    std::thread::scope(|scope| -> CliResult {
        let accept = scope.spawn(|| server.run(&stop));
        let signal = signals.wait()?;
        stop.store(true, Ordering::Relaxed);
        server.wake();
        // An upgrade: the VMs the keeper holds stop being served at once and are left to the
        // next server; one accepted before the accept loop ends is handed over as it starts.
        let handed_over = server.hand_over();
        let _ = accept.join();
        if handed_over {
            server.hand_over();
            tracing::info!("{signal}: VMs held by the keeper left to the next server");
        }
        // VMs still attached would freeze on their next fault if the server left now: serve
        // them until they go, unless told again to stop. Connections in their handshake or
        // just past it are waited for too: each ends at once after a handover.
        let active = || server.stats().active.load(Ordering::SeqCst);
        let open = || server.stats().open.load(Ordering::SeqCst);
        if active() > 0 {
            tracing::warn!(
                "{signal}: no new VMs; still serving {} (signal again to stop now)",
                active()
            );
        }
        while open() > 0 {
            if wait_signal(&signals, 10) {
                tracing::warn!("stopping with {} VMs attached", active());
                break;
            }
        }
        tracing::info!("stopped");
        Ok(ExitCode::SUCCESS)
    })
}

/// Whether `a` and `b` name the same file (both exist: the keeper bound its socket).
fn same_path(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// Waits up to `timeout_ms` for one of `signals`; true if one arrived.
fn wait_signal(signals: &SigSet, timeout_ms: i64) -> bool {
    let timeout = libc::timespec {
        tv_sec: timeout_ms / 1000,
        tv_nsec: (timeout_ms % 1000) * 1_000_000,
    };
    // SAFETY: `signals` is a valid, blocked signal set; a null info pointer is allowed.
    let rc = unsafe { libc::sigtimedwait(signals.as_ref(), std::ptr::null_mut(), &timeout) };
    rc > 0
}
