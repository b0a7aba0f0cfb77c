//! Uploading a local store's image as a remote store's new image: the chunks first, under
//! names the current index does not use, in parallel with bounded memory; the index last and
//! conditionally; then the chunks no index names are deleted.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::time::Instant;

use futures::{StreamExt, TryStreamExt};

use super::{fill, objects, run, Remote, RemoteError};
use crate::store;

/// Chunks uploaded at once: each holds at most 16 MiB in memory (one request up to 16 MiB,
/// parts of 8 MiB above; [`objects::put_file`]), so an upload holds at most 64 MiB.
const UPLOADS: usize = 4;

/// What an upload did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct UploadReport {
    /// Chunks uploaded.
    pub chunks: usize,
    /// Bytes uploaded (chunks and index).
    pub bytes: u64,
    /// Chunks deleted after the commit: those of images before the one replaced, and orphans
    /// of interrupted uploads.
    pub deleted: usize,
    /// Why that cleanup stopped, if it did (the upload itself is committed).
    pub cleanup_error: Option<String>,
    /// Seconds the upload took.
    pub elapsed_s: f64,
    /// The index committed: its size and xxh3-128 (hex), which seal the whole image (it
    /// holds every block's checksum).
    pub index_bytes: u64,
    /// See `index_bytes`.
    pub index_xxh3_128: String,
}

pub(super) fn upload(
    remote: &Remote,
    dir: &Path,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<UploadReport, RemoteError> {
    let Some(key) = remote.options.key.clone() else {
        return upload_dir(remote, dir, progress);
    };
    // With a key, a sealed copy in the cache (private) is what goes; it is removed after.
    let staging = remote.cache.root().join(format!(
        "seal-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let sealed = crate::DiskStore::open_read_only(dir)
        .and_then(|plain| plain.sealed_copy(&staging, &key))
        .map_err(RemoteError::from)
        .and_then(|copy| {
            drop(copy);
            upload_dir(remote, &staging, progress)
        });
    let _ = fs::remove_dir_all(&staging);
    sealed
}

fn upload_dir(
    remote: &Remote,
    dir: &Path,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<UploadReport, RemoteError> {
    let start = Instant::now();
    let mirror = remote.mirror_dir()?;
    let (next, previous, version) = match remote.fetch_index(&mirror)? {
        Some((fetched, version)) => {
            let read = store::index_segments(&fetched);
            let _ = fs::remove_file(&fetched);
            let (next, segments) = read?;
            (next, segments.into_keys().collect(), Some(version))
        }
        None => (0, BTreeSet::new(), None),
    };
    // Names no chunk has had: above the index's and above every chunk there (those of an
    // interrupted upload, or of a writer at work now), and a random step further, so that
    // two writers that start together do not pick the same names.
    let listed = list_chunks(remote)?;
    let above = listed.iter().map(|&(id, _)| id + 1).max().unwrap_or(0);
    let step = u32::from(u16::from_le_bytes(
        crate::seal::new_store_id()[..2]
            .try_into()
            .expect("2 bytes"),
    )) % 4096;
    let base = next.max(above).saturating_add(step);
    let (index, chunks) = store::renumbered_index(dir, base)?;
    let mut report = UploadReport::default();
    let (progress_tx, progress_rx) = std::sync::mpsc::channel::<u64>();
    let uploads = {
        let remote = remote.clone();
        let dir = dir.to_path_buf();
        let chunks = chunks.clone();
        std::thread::scope(|scope| {
            let watcher = scope.spawn(|| {
                for bytes in progress_rx {
                    progress(bytes);
                }
            });
            let result = run(async move {
                futures::stream::iter(chunks.into_iter().map(|(local, new, len)| {
                    let remote = remote.clone();
                    let dir = dir.clone();
                    let progress = progress_tx.clone();
                    async move {
                        let path = dir.join(store::segment_file_name(local));
                        let name = store::segment_file_name(new);
                        let sent = move |n| {
                            let _ = progress.send(n);
                        };
                        match objects::put_file(&remote, &name, &path, len, &sent).await {
                            // Another writer took the name: nothing of this upload counts.
                            Err(RemoteError::Exists { .. }) => Err(RemoteError::Conflict {
                                url: remote.url.clone(),
                            }),
                            other => other.map(|()| len),
                        }
                    }
                }))
                .buffer_unordered(UPLOADS)
                .try_fold(0u64, |sum, bytes| async move { Ok(sum + bytes) })
                .await
            });
            let _ = watcher.join();
            result
        })
    };
    report.bytes = uploads?;
    report.chunks = chunks.len();
    // The commit: visible only now, and only over the index this upload started from.
    let put_if = match version {
        Some(version) => objects::PutIf::Version(version),
        None => objects::PutIf::Absent,
    };
    report.index_bytes = index.len() as u64;
    report.index_xxh3_128 = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&index));
    let index = match &remote.options.key {
        Some(key) => {
            let mut sealed = fill::SEALED_INDEX_MAGIC.to_vec();
            key.seal(
                &crate::seal::index_aad(&remote.url.to_string()),
                &index,
                &mut sealed,
            );
            sealed
        }
        None => index,
    };
    let index_len = index.len() as u64;
    match remote.put_bytes("index", index, put_if) {
        Err(RemoteError::Exists { .. }) => {
            return Err(RemoteError::Conflict {
                url: remote.url.clone(),
            })
        }
        other => other?,
    }
    report.bytes += index_len;
    progress(index_len);
    let named: BTreeSet<u32> = chunks.iter().map(|&(_, new, _)| new).collect();
    // Best effort, and one image late: the chunks of the image just replaced stay for readers
    // that hold its index (a lazily restored VM); those older than that, and orphans of
    // interrupted uploads, go. Only names below this upload's are touched.
    let keep: BTreeSet<u32> = named.union(&previous).copied().collect();
    let stale: Vec<_> = listed
        .into_iter()
        .filter(|(id, _)| *id < base && !keep.contains(id))
        .collect();
    match remote.delete_objects(stale.into_iter().map(|(_, key)| key).collect()) {
        Ok(deleted) => report.deleted = deleted,
        Err(e) => report.cleanup_error = Some(basics::error_chain(&e)),
    }
    report.elapsed_s = start.elapsed().as_secs_f64();
    Ok(report)
}

/// The chunks directly under the prefix: their ids and keys.
fn list_chunks(remote: &Remote) -> Result<Vec<(u32, object_store::path::Path)>, RemoteError> {
    Ok(remote
        .list_objects()?
        .into_iter()
        .filter_map(|key| {
            let id = store::parse_segment_file_name(remote.name_of(key.as_ref())?)?;
            Some((id, key))
        })
        .collect())
}
