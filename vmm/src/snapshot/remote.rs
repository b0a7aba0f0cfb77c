//! Snapshots in an S3-compatible object store: `s3://BUCKET/PREFIX/` holds the same files as
//! a snapshot directory, `manifest.json`, `disk.img` and the RAM store under `ram.store/`
//! (a remote store: docs/remote.md), the last two under the upload's own sub-prefix
//! (`PREFIX/up-…/`, named by the manifest's `objects`). The manifest is put last and only if
//! absent: it is the commit, so a prefix without one holds no snapshot, a snapshot is never
//! written over, and an upload that loses a race for the prefix deletes its sub-prefix.
//!
//! A restore fetches the manifest and the disk (checked against its seal) and opens the RAM
//! store lazily: instead of reading the whole image against its digest before the restore, it
//! checks the store's index against the manifest's `ram_index` seal; the index holds every
//! block's checksum, and every block is checked as it is fetched. The working set the
//! snapshot carries (the blocks the VM faulted in since its last resume, in order) is fetched
//! first, in coalesced range requests, before the vCPU runs.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use compressed_backing::remote::{PutIf, Remote, RemoteError};
use compressed_backing::DiskStore;
use uffd_pager::source::StoreSource;

use super::*;
use crate::machine::RestoreRam;

/// Where a snapshot is.
#[derive(Debug, Clone)]
pub enum SnapshotAt {
    /// A directory.
    Dir(PathBuf),
    /// A prefix of an object store, and its manifest if it was read already (by the command
    /// that started the VM process: one round trip less).
    Remote(Box<Remote>, Option<Box<Manifest>>),
}

impl fmt::Display for SnapshotAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Dir(dir) => write!(f, "{}", dir.display()),
            Self::Remote(remote, _) => write!(f, "{}", remote.url()),
        }
    }
}

impl SnapshotAt {
    /// Reads the manifest without checking the files (see [`read_manifest`]).
    pub fn read_manifest(&self) -> Result<Manifest, SnapshotError> {
        match self {
            Self::Dir(dir) => read_manifest(dir),
            Self::Remote(_, Some(manifest)) => Ok((**manifest).clone()),
            Self::Remote(remote, None) => {
                let path = PathBuf::from(format!("{}/{MANIFEST}", remote.url()));
                let stored = remote
                    .get_bounded(MANIFEST, MANIFEST_LIMIT)?
                    .ok_or_else(|| SnapshotError::Manifest {
                        path: path.clone(),
                        reason: "there is no snapshot there (no manifest)".into(),
                    })?;
                // Sealed with the key, if the snapshot was: its registers and seals are then
                // as authenticated as the memory they describe.
                parse_manifest(&remote.open_object(MANIFEST, stored)?, &path)
            }
        }
    }

    /// Opens the snapshot and checks it against its seals (see [`Snapshot::open`] and the
    /// module documentation).
    pub fn open(&self) -> Result<Snapshot, SnapshotError> {
        match self {
            Self::Dir(dir) => Snapshot::open(dir),
            Self::Remote(remote, _) => open_remote(remote, self.read_manifest()?),
        }
    }
}

/// The object that fences a VM moved to an object store to one host at a time.
const LEASE: &str = "lease.json";
/// The most bytes of a lease.
const LEASE_LIMIT: u64 = 64 << 10;

/// Who may run a VM moved to an object store (`pvisor suspend JOB --vm-offload-to s3://…`):
/// nobody while it is `offloaded`; the first restore takes it (a put conditional on the
/// version it read) and holds it `running`, and every later restore is refused, naming it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Lease {
    /// `offloaded` or `running`.
    pub state: String,
    /// Who wrote it: host name, process and job.
    pub holder: String,
    /// When, seconds since the epoch.
    pub since_unix_s: u64,
}

impl Lease {
    /// A lease in `state` held by this process (`what` says which VM).
    pub fn ours(state: &str, what: &str) -> Self {
        let host = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "unknown host".into());
        Self {
            state: state.to_owned(),
            holder: format!("{what} on {host}, pid {}", std::process::id()),
            since_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }
}

/// Takes the lease of a moved VM for this process, if the prefix has one: refused while
/// another holds it.
fn take_lease(remote: &Remote) -> Result<Option<Lease>, SnapshotError> {
    let Some((bytes, version)) = remote.get_versioned(LEASE, LEASE_LIMIT)? else {
        return Ok(None);
    };
    let path = PathBuf::from(format!("{}/{LEASE}", remote.url()));
    let held: Lease = serde_json::from_slice(&bytes).map_err(|e| SnapshotError::Manifest {
        path: path.clone(),
        reason: format!("its lease is not one: {e}"),
    })?;
    let refused = |holder: String| SnapshotError::Leased {
        url: remote.url().to_string(),
        holder,
    };
    if held.state != "offloaded" {
        return Err(refused(format!(
            "{} (since {})",
            held.holder, held.since_unix_s
        )));
    }
    let ours = Lease::ours("running", "a restored VM");
    let text = serde_json::to_vec(&ours).expect("a lease serializes");
    match remote.put_bytes(LEASE, text, PutIf::Version(version)) {
        Err(RemoteError::Exists { .. }) => Err(refused("another restore, just now".into())),
        other => other.map(|()| Some(ours)).map_err(Into::into),
    }
}

/// What [`upload`] did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct UploadedSnapshot {
    /// Where it went.
    pub url: String,
    /// The RAM store's upload.
    pub ram: compressed_backing::remote::UploadReport,
    /// Bytes of the disk.
    pub disk_bytes: u64,
    /// Seconds in all.
    pub elapsed_s: f64,
    /// The lease written, for a moved VM.
    pub lease: Option<Lease>,
}

/// Uploads the sealed snapshot in `dir` (its RAM in a store) to `remote`'s prefix, which
/// must hold none: the RAM store, the disk, then the manifest with the RAM index's seal.
/// With `moved` (the VM leaves its host: `suspend --vm-offload-to`), a lease held by nobody
/// (`offloaded`) goes before the manifest, so that one restore only can take it.
pub fn upload(
    dir: &Path,
    remote: &Remote,
    moved: Option<&str>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<UploadedSnapshot, SnapshotError> {
    let started = std::time::Instant::now();
    let mut manifest = read_manifest(dir)?;
    let at = PathBuf::from(remote.url().to_string());
    if manifest.ram_format != RamFormat::Store {
        return Err(SnapshotError::Manifest {
            path: dir.join(MANIFEST),
            reason: "a snapshot in an object store keeps its RAM in a store: give --codec".into(),
        });
    }
    if remote.get_bounded(MANIFEST, MANIFEST_LIMIT)?.is_some() {
        return Err(SnapshotError::Exists(at));
    }
    // Its own sub-prefix: another upload racing for this prefix writes elsewhere, and the
    // manifest that lands names objects that are all its own.
    let id = crate::runtime::new_id("up-");
    let objects = remote.child(&id);
    let ram = objects
        .child(RAM_STORE)
        .upload(&dir.join(RAM_STORE), progress)?;
    objects.put_file(DISK, &dir.join(DISK), manifest.disk.bytes)?;
    progress(manifest.disk.bytes);
    manifest.objects = Some(id);
    manifest.leased = moved.is_some();
    // Lost the race: this upload's objects go (best effort; nothing names them).
    let lost = || {
        if let Err(e) = objects.delete_all() {
            tracing::warn!(
                "{}: cannot delete the objects of an upload that lost to another: {}",
                objects.url(),
                basics::error_chain(&e)
            );
        }
        SnapshotError::Exists(at.clone())
    };
    manifest.ram_index = Some(SealedFile {
        name: format!("{RAM_STORE}/index"),
        bytes: ram.index_bytes,
        xxh3_128: ram.index_xxh3_128.clone(),
    });
    let lease = moved.map(|what| Lease::ours("offloaded", what));
    if let Some(lease) = &lease {
        let text = serde_json::to_vec(lease).expect("a lease serializes");
        match remote.put_bytes(LEASE, text, PutIf::Absent) {
            Err(RemoteError::Exists { .. }) => return Err(lost()),
            other => other?,
        }
    }
    let text = serde_json::to_vec_pretty(&manifest).expect("the manifest serializes");
    let text = remote.seal_object(MANIFEST, &text);
    // Any other failure leaves the objects: the put may have landed all the same.
    match remote.put_bytes(MANIFEST, text, PutIf::Absent) {
        Err(RemoteError::Exists { .. }) => return Err(lost()),
        other => other?,
    }
    Ok(UploadedSnapshot {
        url: remote.url().to_string(),
        ram,
        disk_bytes: manifest.disk.bytes,
        elapsed_s: started.elapsed().as_secs_f64(),
        lease,
    })
}

/// The disk: into a private directory of the cache, checked against its seal, then held
/// open only (the directory goes at once).
fn fetch_disk(remote: &Remote, manifest: &Manifest) -> Result<std::fs::File, SnapshotError> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let local = remote
        .cache()
        .root()
        .join(format!("restore-{}-{n}", std::process::id()));
    safe_file::create_private_dir_new(&local).map_err(io("create", &local))?;
    let disk_path = local.join(DISK);
    let opened = (|| {
        remote
            .download(DISK, &disk_path, manifest.disk.bytes)?
            .ok_or_else(|| SnapshotError::Manifest {
                path: PathBuf::from(format!("{}/{DISK}", remote.url())),
                reason: "the disk object is missing".into(),
            })?;
        restore::open_sealed(&disk_path, &manifest.disk)
    })();
    let _ = std::fs::remove_dir_all(&local);
    opened
}

fn open_remote(remote: &Remote, manifest: Manifest) -> Result<Snapshot, SnapshotError> {
    let label = |name: &str| PathBuf::from(format!("{}/{name}", remote.url()));
    let Some(ram_seal) = manifest.ram_index.clone() else {
        return Err(SnapshotError::Manifest {
            path: label(MANIFEST),
            reason: "it has no seal of its RAM store's index".into(),
        });
    };
    if manifest.ram_format != RamFormat::Store {
        return Err(SnapshotError::Manifest {
            path: label(MANIFEST),
            reason: "its RAM is not in a store".into(),
        });
    }
    // The disk and the RAM store's index at once: one round trip.
    let objects = match &manifest.objects {
        Some(id) => remote.child(id),
        None => remote.clone(),
    };
    let ram_remote = objects.child(RAM_STORE);
    let (disk, store) = std::thread::scope(|scope| {
        let disk = scope.spawn(|| fetch_disk(&objects, &manifest));
        let store = ram_remote.open();
        (disk.join().expect("the disk thread does not panic"), store)
    });
    // The store's error first: it says when a key is missing or wrong.
    let store: DiskStore = store?;
    let disk = disk?;
    let index_path = store.dir().join("index");
    let found = {
        let file = safe_file::open_read(&index_path)?;
        digest_open(&file, &index_path, &ram_seal.name)?
    };
    if found.bytes != ram_seal.bytes || found.xxh3_128 != ram_seal.xxh3_128 {
        return Err(SnapshotError::Seal {
            path: PathBuf::from(format!("{}/{}", objects.url(), ram_seal.name)),
            what: format!(
                "{} bytes, xxh3-128 {}; sealed as {} bytes, {}",
                found.bytes, found.xxh3_128, ram_seal.bytes, ram_seal.xxh3_128
            ),
        });
    }
    let working_set: Vec<u64> = store
        .meta(uffd_pager::offload::WORKING_SET_KEY)
        .unwrap_or_default()
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect();
    if !working_set.is_empty() {
        ram_remote.prefetch(&store, &working_set)?;
    }
    // A VM moved here runs on one host only: the lease is taken last, once everything the
    // restore needs is in hand and checked, so that a restore that cannot run does not hold
    // it (a VM that fails to boot after this still does: see docs/remote.md).
    if manifest.leased && take_lease(remote)?.is_none() {
        return Err(SnapshotError::Manifest {
            path: label(LEASE),
            reason: "the VM was moved here, but its lease is missing".into(),
        });
    }
    // The rest after the working set, while the VM runs (`--s3-fetch-rest`), once the
    // restore is sure to go on.
    ram_remote.fetch_rest_if_asked(&store);
    let ram_path = store.dir().to_path_buf();
    Ok(Snapshot::from_parts(
        manifest,
        RestoreRam::Source(Arc::new(StoreSource::new(store))),
        ram_path,
        disk,
        PathBuf::from(format!("{}/{DISK}", objects.url())),
    ))
}
