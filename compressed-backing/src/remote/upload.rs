//! Uploading a local store's image as a remote store's new image: the chunks first, under
//! names the current index does not use, in parallel with bounded memory; the index last and
//! conditionally; then the chunks no index names are deleted.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use futures::{StreamExt, TryStreamExt};
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};

use super::{run, Remote, RemoteError};
use crate::file;
use crate::store::{self, StoreError};

/// A chunk up to this size is put with one request; a larger one in parts of
/// [`PART_BYTES`]. Together with [`UPLOADS`] this bounds an upload's memory (64 MiB).
const SINGLE_PUT_BYTES: u64 = 16 << 20;
/// Part size of a multipart upload.
const PART_BYTES: u64 = 8 << 20;
/// Chunks uploaded at once.
const UPLOADS: usize = 4;

/// What an upload did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct UploadReport {
    /// Chunks uploaded.
    pub chunks: usize,
    /// Bytes uploaded (chunks and index).
    pub bytes: u64,
    /// Chunks of earlier images deleted after the commit.
    pub deleted: usize,
    /// Seconds the upload took.
    pub elapsed_s: f64,
}

pub(super) fn upload(
    remote: &Remote,
    dir: &Path,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<UploadReport, RemoteError> {
    let start = Instant::now();
    let mirror = remote.mirror_dir()?;
    let (base, version) = match remote.fetch_index(&mirror)? {
        Some((fetched, version)) => {
            let read = store::index_segments(&fetched);
            let _ = fs::remove_file(&fetched);
            (read?.0, Some(version))
        }
        None => (0, None),
    };
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
                    async move { put_chunk(&remote, &dir, local, new, len, &progress).await }
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
    let mode = match version {
        Some(version) => PutMode::Update(version),
        None => PutMode::Create,
    };
    let index_len = index.len() as u64;
    let client = remote.client.clone();
    let key = remote.key("index");
    let committed = run(async move {
        client
            .put_opts(
                &key,
                PutPayload::from(index),
                PutOptions {
                    mode,
                    ..PutOptions::default()
                },
            )
            .await
    });
    match committed {
        Ok(_) => {}
        Err(
            object_store::Error::Precondition { .. } | object_store::Error::AlreadyExists { .. },
        ) => {
            return Err(RemoteError::Conflict {
                url: remote.url.clone(),
            })
        }
        Err(e) => return Err(remote.request_error("put", "index")(e)),
    }
    report.bytes += index_len;
    progress(index_len);
    let named: BTreeSet<u32> = chunks.iter().map(|&(_, new, _)| new).collect();
    report.deleted = delete_unnamed(remote, &named)?;
    report.elapsed_s = start.elapsed().as_secs_f64();
    Ok(report)
}

/// Puts local segment `local` (its first `len` bytes: the committed ones) as chunk `new`;
/// an existing chunk of that name is an error (another writer).
async fn put_chunk(
    remote: &Remote,
    dir: &Path,
    local: u32,
    new: u32,
    len: u64,
    progress: &std::sync::mpsc::Sender<u64>,
) -> Result<u64, RemoteError> {
    let path = dir.join(store::segment_file_name(local));
    let name = store::segment_file_name(new);
    let key = remote.key(&name);
    let file = file::open_read(&path).map_err(StoreError::File)?;
    let read = |offset: u64, n: u64| -> Result<Vec<u8>, RemoteError> {
        let mut buf = vec![0u8; usize::try_from(n).unwrap_or(usize::MAX)];
        file.read_exact_at(&mut buf, offset)
            .map_err(StoreError::io("read segment", &path))?;
        Ok(buf)
    };
    if len <= SINGLE_PUT_BYTES {
        let bytes = read(0, len)?;
        let put = remote
            .client
            .put_opts(
                &key,
                PutPayload::from(bytes),
                PutOptions {
                    mode: PutMode::Create,
                    ..PutOptions::default()
                },
            )
            .await;
        match put {
            Ok(_) => {}
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. },
            ) => {
                return Err(RemoteError::Conflict {
                    url: remote.url.clone(),
                })
            }
            Err(e) => return Err(remote.request_error("put", &name)(e)),
        }
    } else {
        let mut upload = remote
            .client
            .put_multipart(&key)
            .await
            .map_err(remote.request_error("start a multipart upload of", &name))?;
        let mut offset = 0;
        while offset < len {
            let n = PART_BYTES.min(len - offset);
            let part = match read(offset, n) {
                Ok(part) => part,
                Err(e) => {
                    let _ = upload.abort().await;
                    return Err(e);
                }
            };
            if let Err(e) = upload.put_part(PutPayload::from(part)).await {
                let _ = upload.abort().await;
                return Err(remote.request_error("put a part of", &name)(e));
            }
            offset += n;
            let _ = progress.send(n);
        }
        upload
            .complete()
            .await
            .map_err(remote.request_error("complete the upload of", &name))?;
        return Ok(len);
    }
    let _ = progress.send(len);
    Ok(len)
}

/// Deletes the chunks directly under the prefix that `named` does not hold; returns how
/// many.
fn delete_unnamed(remote: &Remote, named: &BTreeSet<u32>) -> Result<usize, RemoteError> {
    let client = remote.client.clone();
    let url = remote.url.clone();
    let prefix =
        (!url.prefix.is_empty()).then(|| object_store::path::Path::from(url.prefix.as_str()));
    let on_error = remote.request_error("list", "");
    let listed: Vec<object_store::path::Path> = run(async move {
        client
            .list(prefix.as_ref())
            .map_ok(|meta| meta.location)
            .try_collect()
            .await
    })
    .map_err(on_error)?;
    let mut deleted = 0;
    for location in listed {
        let key = location.as_ref();
        let name = if url.prefix.is_empty() {
            key
        } else {
            match key
                .strip_prefix(url.prefix.as_str())
                .and_then(|k| k.strip_prefix('/'))
            {
                Some(name) => name,
                None => continue,
            }
        };
        let Some(id) = store::parse_segment_file_name(name) else {
            continue;
        };
        if named.contains(&id) {
            continue;
        }
        let client = remote.client.clone();
        let name = name.to_owned();
        let on_error = remote.request_error("delete", &name);
        match run(async move { client.delete(&location).await }) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => deleted += 1,
            Err(e) => return Err(on_error(e)),
        }
    }
    Ok(deleted)
}
