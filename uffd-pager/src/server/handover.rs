//! Restarting the server without freezing its VMs: each Firecracker VM is handed to the
//! keeper ([`super::keeper`]) right after its handshake is validated and before any fault is
//! served, with its page states in a journal ([`crate::journal`]); a server started with the
//! same keeper takes every held VM over, and one stopped for an upgrade leaves them there.
//!
//! Taking a VM over: the journal's read marker must be clear (else a discard the old server
//! read may never have reached the table: the VM is refused and its VMM killed, as for any
//! fault that cannot be served right); the table may hold only `Zero`, `Source` and
//! `Resident` pages; the regions are validated against this server's image again and the uffd
//! is checked as at a handshake. Then a pager serves the uffd from the journaled states (a
//! page the old server installed but had not yet marked answers `EEXIST`, which the pager
//! takes as resident) and every registered range is woken, so that faults the old server read
//! but never resolved are raised again.
//!
//! `pvisor-uffd/1` sessions are not handed to the keeper: their offloads and stored pages are
//! not journaled, so no new server could prove them right. A crash closes their connection;
//! an upgrade ends them with [`PVISOR_NOT_HANDED_OVER`].

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use super::keeper::{HeldVm, KeeperClient, KeeperError};
use super::{anon_specs, handshake, Connection, Server, Session};
use crate::addr::PAGE_SIZE;
use crate::journal::Journal;
use crate::pager::RegionSpec;
use crate::state::{PageState, PageStates};
use crate::uffd::{feature, Userfaultfd};
use basics::error_chain;

/// The line a `pvisor-uffd/1` peer gets when the server stops for an upgrade.
pub const PVISOR_NOT_HANDED_OVER: &str = "{\"status\":\"error\",\"error\":\"uffd-pager is \
     restarting: pvisor-uffd/1 sessions are not handed over (offloaded pages are not \
     journaled); stop the VM or connect again\"}\n";

/// What names an image for takeovers ([`Server::with_image_id`]): a raw memory file's path,
/// device, inode, size and modification time, or a store directory's (`store`) and its index
/// file's: replacing or repacking the image changes it.
pub fn image_id(path: &Path, store: bool) -> std::io::Result<String> {
    use std::os::unix::fs::MetadataExt;
    let path = path.canonicalize()?;
    let (kind, meta) = if store {
        ("store", std::fs::metadata(path.join("index"))?)
    } else {
        ("raw", std::fs::metadata(&path)?)
    };
    Ok(format!(
        "{kind} {} dev {} ino {} size {} mtime {}.{:09}",
        path.display(),
        meta.dev(),
        meta.ino(),
        meta.size(),
        meta.mtime(),
        meta.mtime_nsec()
    ))
}

/// What the server tells the keeper about a VM, to serve it again.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Meta {
    /// `firecracker`.
    session: String,
    /// The regions as the VMM sent them.
    regions: Vec<handshake::GuestRegion>,
    /// The image it was restored from ([`Server::with_image_id`]).
    #[serde(default)]
    image: String,
}

/// A VM the keeper holds for this server.
pub(super) struct Kept {
    pub id: u64,
    pub journal: Arc<Journal>,
}

impl Connection {
    /// Hands the VM to the keeper, if there is one: its connection, uffd and a fresh journal.
    /// A VM the keeper cannot take is still served (logged: it would not survive a restart).
    pub(super) fn deposit(
        &self,
        regions: &[handshake::GuestRegion],
        uffd: &Userfaultfd,
        specs: &[RegionSpec],
        initial: PageState,
        pending: Option<u64>,
    ) -> Option<Kept> {
        let keeper = self.keeper.as_ref()?;
        let end = specs.iter().map(|s| s.image_offset + s.range.len()).max()?;
        let kept = Journal::create(end / PAGE_SIZE, initial)
            .map_err(|e| error_chain(&e))
            .and_then(|journal| {
                let meta = serde_json::to_value(Meta {
                    session: "firecracker".into(),
                    regions: regions.to_vec(),
                    image: self.image_id.to_string(),
                })
                .expect("regions serialize");
                let id = keeper
                    .hold(
                        meta,
                        self.stream.as_fd(),
                        uffd.as_fd(),
                        journal.fd(),
                        pending,
                    )
                    .map_err(|e| error_chain(&e))?;
                Ok(Kept {
                    id,
                    journal: Arc::new(journal),
                })
            });
        match kept {
            Ok(kept) => Some(kept),
            Err(e) => {
                // Served here without the keeper: it must not hand the connection to the next
                // server as one whose handshake is yet to come.
                if let Some(id) = pending {
                    let _ = keeper.drop_vm(id);
                }
                if self.log_limit.allow() {
                    tracing::error!(
                        "the keeper does not hold this VM (a restart would freeze it): {e}"
                    );
                }
                None
            }
        }
    }

    /// Has the keeper let go of the VM (refused or gone: its connection must close).
    pub(super) fn release(&self, session: &Session) {
        if let (
            Some(keeper),
            Session::Firecracker {
                kept: Some(kept), ..
            },
        ) = (&self.keeper, session)
        {
            if let Err(e) = keeper.drop_vm(kept.id) {
                tracing::warn!("cannot release a VM at the keeper: {}", error_chain(&e));
            }
        }
    }

    /// True if the service ended for a handover and the keeper holds the VM; its journal is
    /// then marked clean (the pager's threads are joined: every event read is applied).
    pub(super) fn handed_over(&self, session: &Session) -> bool {
        if !self.handover.is_raised() {
            return false;
        }
        match session {
            Session::Firecracker {
                kept: Some(kept), ..
            } => {
                kept.journal.set_clean(true);
                true
            }
            _ => false,
        }
    }
}

impl Server {
    /// Attaches to the keeper at `path` (waiting up to 10 s for a stopping server to detach):
    /// VMs accepted from now on are handed to it, and [`Server::take_over`] takes those it
    /// already holds.
    pub fn with_keeper(self, path: &Path) -> Result<Self, KeeperError> {
        Ok(self.with_keeper_client(KeeperClient::attach(path, Duration::from_secs(10))?))
    }

    /// As [`Server::with_keeper`], attached already (the caller took the keeper's listening
    /// socket from `client` to make this server with [`Server::listen_on`]).
    pub fn with_keeper_client(mut self, client: KeeperClient) -> Self {
        self.keeper = Some(Arc::new(client));
        self
    }

    /// Takes over every VM the keeper holds; returns how many are served now. Each VM that
    /// cannot be proven right is refused (logged, its VMM killed, released by the keeper).
    pub fn take_over(&self) -> Result<usize, KeeperError> {
        let Some(keeper) = &self.keeper else {
            return Ok(0);
        };
        let mut served = 0;
        let (vms, pending) = keeper.list()?;
        // Connections a server accepted and died before it read their handshake: each is
        // served as a new one, its handshake read here.
        for (id, conn) in pending {
            let connection = self.connection(conn);
            let open = super::Open::count(&self.stats);
            let spawned = std::thread::Builder::new()
                .name("uffd-conn".into())
                .spawn(move || {
                    let _open = open;
                    connection.serve(None, Some(id));
                });
            if let Err(e) = spawned {
                tracing::error!("cannot start a connection thread: {e}");
                let _ = keeper.drop_vm(id);
            }
        }
        for vm in vms {
            let id = vm.id;
            let pid = getsockopt(&vm.conn, PeerCredentials).map_or(0, |c| c.pid());
            // Held before the connection is consumed, so that a refused VMM is killed through
            // its pidfd: a pid reused since it connected is never signalled.
            let peer = crate::socket::PeerProcess::of(&vm.conn, pid);
            match self.take_one(pid, vm) {
                Ok(()) => {
                    served += 1;
                    self.stats.taken_over.fetch_add(1, Ordering::Relaxed);
                }
                Err(reason) => {
                    self.stats.takeovers_refused.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(peer_pid = pid, "cannot take the VM over: {reason}");
                    super::kill_peer(&self.stats, &peer, "its memory cannot be served right");
                    if let Err(e) = keeper.drop_vm(id) {
                        tracing::warn!("cannot release a VM at the keeper: {}", error_chain(&e));
                    }
                }
            }
        }
        Ok(served)
    }

    fn take_one(&self, pid: i32, vm: HeldVm) -> Result<(), String> {
        let connection = self.connection(vm.conn);
        let cred = connection
            .peers
            .check(&connection.stream)
            .map_err(|e| error_chain(&e))?;
        let peer = crate::socket::PeerProcess::of(&connection.stream, pid);
        let meta: Meta = serde_json::from_value(vm.meta)
            .map_err(|e| format!("the keeper's record is unreadable: {e}"))?;
        if meta.session != "firecracker" {
            return Err(format!("a {} session is not taken over", meta.session));
        }
        let regions = handshake::validate(&meta.regions, self.source.image_size())
            .map_err(|e| format!("its regions do not fit this server's image: {e}"))?;
        let journal = Arc::new(Journal::open(vm.journal).map_err(|e| error_chain(&e))?);
        if journal.read_in_progress() {
            return Err(
                "the old server died while reading its events, before it journaled \
                 them: a discarded range may be missing from the journal"
                    .into(),
            );
        }
        let counts = PageStates::journaled(Arc::clone(&journal)).counts();
        if counts.stored + counts.dropping + counts.pooled > 0 {
            return Err(format!(
                "the journal has pages in states it cannot prove: {counts:?}"
            ));
        }
        if meta.image != *self.image_id {
            return Err(format!(
                "it was restored from image `{}`, this server serves `{}`",
                meta.image, self.image_id
            ));
        }
        let (uffd, features) = Userfaultfd::adopt(vm.uffd).map_err(|e| error_chain(&e))?;
        let remove_events = features & feature::EVENT_REMOVE != 0;
        let clean = journal.clean();
        let generation = journal.next_generation();
        journal.set_clean(false);
        let specs = anon_specs(&regions);
        let ranges: Vec<_> = specs.iter().map(|s| s.range).collect();
        // SAFETY: as at the handshake: the regions are the peer's, registered by the peer, and
        // have no views in this process.
        let pager = unsafe {
            connection.pager(
                peer,
                uffd,
                remove_events,
                specs,
                PageState::Source,
                Some(Arc::clone(&journal)),
            )
        }
        .map_err(|e| error_chain(&e))?;
        // Faults the old server read and never resolved: their threads retry and fault again.
        for range in ranges {
            pager
                .shared()
                .uffd
                .wake(range)
                .map_err(|e| format!("cannot wake its faults: {}", error_chain(&e)))?;
        }
        tracing::info!(
            peer_pid = pid,
            generation,
            clean,
            resident = counts.resident,
            discarded = counts.zero,
            "took a VM over"
        );
        let session = Session::Firecracker {
            regions: meta.regions,
            kept: Some(Kept { id: vm.id, journal }),
        };
        let open = super::Open::count(&self.stats);
        std::thread::Builder::new()
            .name("uffd-conn".into())
            .spawn(move || {
                let _open = open;
                connection.serve_vm(pid, cred.uid, pager, session);
            })
            .map_err(|e| format!("cannot start its thread: {e}"))?;
        Ok(())
    }

    /// Names the image this server serves (e.g. its file's device, inode, size and mtime):
    /// VMs are taken over only by a server whose image has the same name, so that a restore
    /// never goes on from another image.
    pub fn with_image_id(mut self, id: &str) -> Self {
        self.image_id = Arc::from(id);
        self
    }

    /// Stops serving the VMs the keeper holds, leaving them for the next server (an upgrade),
    /// and ends `pvisor-uffd/1` sessions ([`PVISOR_NOT_HANDED_OVER`]); returns once none of
    /// those is served any more, true if it handed over. Without a keeper, or if the keeper is
    /// gone (they would freeze), nothing is handed over: VMs are served until they leave.
    /// A Firecracker VM the keeper does not hold is served on too.
    pub fn hand_over(&self) -> bool {
        let Some(keeper) = &self.keeper else {
            return false;
        };
        if !keeper.alive() {
            tracing::error!("the keeper is gone: its VMs are served here until they leave");
            return false;
        }
        // Every connection of a kept VM waits on it: each ends its service at once.
        self.handover.raise();
        while self.stats.kept.load(Ordering::Relaxed) > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// True if VMs are handed to a keeper.
    pub fn has_keeper(&self) -> bool {
        self.keeper.is_some()
    }
}
