//! `uffd-pager keeper`: holds what `serve --keeper` VMs need to outlive a server.

use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::signal::{SigSet, Signal};
use uffd_pager::server::keeper::KeeperSocket;

use super::CliResult;

pub fn keeper(socket: &Path, listen: Option<&Path>) -> CliResult {
    super::serve::init_logging();
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    signals.thread_block()?;
    let keeper = KeeperSocket::bind(socket)
        .map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?;
    let keeper = match listen {
        Some(path) => keeper
            .listen(path)
            .map_err(|e| format!("cannot listen on {} for VMMs: {e}", path.display()))?,
        None => keeper,
    };
    tracing::info!(socket = %socket.display(), vmms = ?listen, "keeper listening");
    uffd_pager::socket::announce(socket)?;
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| -> CliResult {
        let run = scope.spawn(|| keeper.run(&stop));
        let signal = signals.wait()?;
        stop.store(true, Ordering::Relaxed);
        let stats = run.join().map_err(|_| "the keeper's thread panicked")?;
        tracing::info!(
            ?stats,
            "{signal}: keeper stopped (the VMs it held can no longer outlive their server)"
        );
        Ok(ExitCode::SUCCESS)
    })
}
