//! The mirror's side of reads: the index fetched and adopted, payloads fetched on demand
//! ([`RemoteFill`]) or ahead ([`prefetch`]).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use futures::StreamExt;
use object_store::{ObjectStoreExt, UpdateVersion};

use super::{run, Remote, RemoteError};
use crate::file;
use crate::store::{self, DiskStore, StoreError};

/// Payloads at most this far apart are fetched by one request (the gap comes along).
const MAX_GAP: u64 = 16 << 10;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The first bytes of a sealed index object.
pub(super) const SEALED_INDEX_MAGIC: &[u8; 8] = b"PVSEALD1";
/// The most bytes of a sealed index object: more than the largest plain index (2^25 blocks of
/// at most 26 bytes, their metadata, the segment table), which is checked against its
/// header's limit once opened.
const SEALED_INDEX_LIMIT: u64 = 2 << 30;

/// See [`Remote::fetch_index`]. A sealed index (`--store-key`) is opened here: the mirror
/// holds the plain one (the cache is private), the bucket only the sealed one.
pub(super) fn fetch_index(
    remote: &Remote,
    dir: &Path,
) -> Result<Option<(PathBuf, UpdateVersion)>, RemoteError> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(format!("index.fetch-{}-{n}", std::process::id()));
    let client = remote.client.clone();
    let key = remote.key("index");
    let url = remote.url.clone();
    let on_error = remote.request_error("get", "index");
    let label = path.clone();
    let fetched = run(async move {
        let result = match client.get(&key).await {
            Ok(result) => result,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(on_error(e)),
        };
        let size = result.meta.size;
        let version = UpdateVersion {
            e_tag: result.meta.e_tag.clone(),
            version: result.meta.version.clone(),
        };
        let too_large = |size, limit| RemoteError::IndexTooLarge {
            url: url.clone(),
            size,
            limit,
        };
        let limit_of = |head: &[u8]| -> Result<u64, RemoteError> {
            store::index_size_limit(head).map_err(|source| {
                StoreError::IndexCorrupt {
                    path: label.clone(),
                    source,
                }
                .into()
            })
        };
        // The cap is known from the first bytes: a plain index's header, or the sealed magic.
        let mut bytes = Vec::new();
        let mut limit = None;
        let mut stream = result.into_stream();
        while let Some(piece) = stream.next().await {
            let piece = piece.map_err(|e| RemoteError::Request {
                op: "get",
                bucket: url.bucket.clone(),
                key: url.key("index"),
                source: Box::new(e),
            })?;
            bytes.extend_from_slice(&piece);
            if limit.is_none() && bytes.len() >= store::INDEX_HEADER_LEN {
                let cap = if bytes.starts_with(SEALED_INDEX_MAGIC) {
                    SEALED_INDEX_LIMIT
                } else {
                    limit_of(&bytes[..store::INDEX_HEADER_LEN])?
                };
                if size > cap {
                    return Err(too_large(size, cap));
                }
                limit = Some(cap);
            }
            let cap = limit.unwrap_or(size);
            if bytes.len() as u64 > cap.min(size) {
                return Err(too_large(bytes.len() as u64, cap));
            }
        }
        Ok(Some((bytes, version)))
    })?;
    let Some((mut bytes, version)) = fetched else {
        return Ok(None);
    };
    let sealed = bytes.starts_with(SEALED_INDEX_MAGIC);
    if let Some(key) = remote.key_for(sealed)? {
        let sealed_part = &mut bytes[SEALED_INDEX_MAGIC.len()..];
        let aad = crate::seal::index_aad(&remote.url.to_string());
        let len = key
            .open(&aad, sealed_part)
            .map_err(|_| RemoteError::IndexUnsealed {
                url: remote.url.clone(),
            })?;
        bytes.copy_within(SEALED_INDEX_MAGIC.len()..SEALED_INDEX_MAGIC.len() + len, 0);
        bytes.truncate(len);
        let head = &bytes[..store::INDEX_HEADER_LEN.min(bytes.len())];
        let limit = store::index_size_limit(head).map_err(|source| StoreError::IndexCorrupt {
            path: path.clone(),
            source,
        })?;
        if bytes.len() as u64 > limit {
            return Err(RemoteError::IndexTooLarge {
                url: remote.url.clone(),
                size: bytes.len() as u64,
                limit,
            });
        }
    }
    let written = (|| -> Result<(), StoreError> {
        let _ = fs::remove_file(&path);
        let mut out = file::create_private(&path).map_err(StoreError::File)?;
        out.write_all(&bytes)
            .map_err(StoreError::io("write", &path))?;
        out.sync_all().map_err(StoreError::io("sync", &path))
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&path);
        return Err(e.into());
    }
    Ok(Some((path, version)))
}

/// Makes the fetched index at `fetched` the mirror's: its segment files are made (0600,
/// sparse) or resized to the lengths it names, then it replaces `index`, and segment files
/// it does not name are removed.
pub(super) fn adopt_index(dir: &Path, fetched: &Path) -> Result<(), RemoteError> {
    let checked = store::index_segments(fetched);
    let (_, segments) = match checked {
        Ok(found) => found,
        Err(e) => {
            let _ = fs::remove_file(fetched);
            return Err(e.into());
        }
    };
    for (&id, &len) in &segments {
        let path = dir.join(store::segment_file_name(id));
        let f = file::open_or_create_private(&path).map_err(StoreError::File)?;
        let now = f.metadata().map_err(StoreError::io("stat", &path))?.len();
        if now != len {
            f.set_len(len).map_err(StoreError::io("size", &path))?;
        }
    }
    let index = dir.join("index");
    fs::rename(fetched, &index).map_err(StoreError::io("rename", fetched))?;
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let stale = name
                .to_str()
                .and_then(store::parse_segment_file_name)
                .is_some_and(|id| !segments.contains_key(&id));
            if stale {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
    Ok(())
}

/// Fills a mirror's segment files from the object store, one range request per payload.
#[derive(Debug)]
pub(super) struct RemoteFill {
    remote: Remote,
    /// The mirror's segment files, open for writing.
    files: BTreeMap<u32, File>,
}

impl RemoteFill {
    pub(super) fn new(remote: Remote, dir: &Path, store: &DiskStore) -> Result<Self, RemoteError> {
        let mut files = BTreeMap::new();
        for id in store.segment_lengths().into_keys() {
            let path = dir.join(store::segment_file_name(id));
            let f = file::open_regular(&path, fs::OpenOptions::new().write(true))
                .map_err(StoreError::File)?;
            files.insert(id, f);
        }
        Ok(Self { remote, files })
    }
}

impl store::SegmentFill for RemoteFill {
    fn fill(&self, segment: u32, offset: u64, buf: &mut [u8]) -> Result<(), BoxError> {
        let file = self
            .files
            .get(&segment)
            .ok_or_else(|| format!("segment {segment} is not in the mirror"))?;
        let bytes = {
            let _waiting = DemandInFlight::new(&self.remote.counters);
            fetch_range(&self.remote, segment, offset, buf.len() as u64)?
        };
        buf.copy_from_slice(&bytes);
        // The bound first: it may punch older bytes, never these.
        self.remote.cache.filled(bytes.len() as u64);
        file.write_all_at(&bytes, offset)?;
        Ok(())
    }
}

/// A fault waiting on the object store, counted in `demand_in_flight` while it lives (a
/// panic that unwinds through the request uncounts it too).
struct DemandInFlight<'a>(&'a super::RemoteCounters);

impl<'a> DemandInFlight<'a> {
    fn new(counters: &'a super::RemoteCounters) -> Self {
        counters.demand_in_flight.fetch_add(1, Ordering::AcqRel);
        Self(counters)
    }
}

impl Drop for DemandInFlight<'_> {
    fn drop(&mut self) {
        self.0.demand_in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One range request: exactly `len` bytes at `offset` of segment `segment`'s object.
fn fetch_range(
    remote: &Remote,
    segment: u32,
    offset: u64,
    len: u64,
) -> Result<bytes::Bytes, BoxError> {
    let name = store::segment_file_name(segment);
    let client = remote.client.clone();
    let key = remote.key(&name);
    let on_error = remote.request_error("get range of", &name);
    let bytes =
        run(async move { client.get_range(&key, offset..offset + len).await }).map_err(on_error)?;
    if bytes.len() as u64 != len {
        return Err(format!(
            "{name}: asked for {len} bytes at offset {offset}, got {}",
            bytes.len()
        )
        .into());
    }
    remote.counters.requests.fetch_add(1, Ordering::Relaxed);
    remote
        .counters
        .bytes_fetched
        .fetch_add(len, Ordering::Relaxed);
    Ok(bytes)
}

/// Whether the mirror file holds data over all of `[offset, offset + len)` (no hole in it).
fn present(file: &File, offset: u64, len: u64) -> bool {
    let Ok(start) = libc::off_t::try_from(offset) else {
        return false;
    };
    // SAFETY: lseek on an open descriptor of ours.
    let hole = unsafe { libc::lseek(file.as_raw_fd(), start, libc::SEEK_HOLE) };
    u64::try_from(hole).is_ok_and(|hole| hole >= offset + len)
}

/// One range request: `start..end` of segment `segment`'s object.
type Request = (u32, (u64, u64));

/// What fetching `blocks` of `store` asks for: the mirror's segment files they are in (open
/// for writing), and range requests for the payloads the mirror lacks (see [`coalesce`]).
fn plan(
    store: &DiskStore,
    blocks: &[u64],
    max_request: u64,
) -> Result<(BTreeMap<u32, File>, Vec<Request>), RemoteError> {
    let dir = store.dir();
    let mut files = BTreeMap::new();
    let mut wanted: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
    for &block in blocks {
        let Some((segment, offset, len)) = store.payload_location(block) else {
            continue;
        };
        let file = match files.entry(segment) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                let path = dir.join(store::segment_file_name(segment));
                let f = file::open_regular(&path, fs::OpenOptions::new().write(true))
                    .map_err(StoreError::File)?;
                e.insert(f)
            }
        };
        if !present(file, offset, u64::from(len)) {
            wanted
                .entry(segment)
                .or_default()
                .push((offset, offset + u64::from(len)));
        }
    }
    Ok((files, coalesce(wanted, max_request)))
}

/// The range requests for `wanted` (payload ranges by segment): neighbours at most
/// [`MAX_GAP`] apart go in one request of at most `max_request` bytes, in segment and offset
/// order.
fn coalesce(wanted: BTreeMap<u32, Vec<(u64, u64)>>, max_request: u64) -> Vec<Request> {
    let mut requests = Vec::new();
    for (segment, mut ranges) in wanted {
        ranges.sort_unstable();
        ranges.dedup();
        let mut current: Option<(u64, u64)> = None;
        for (start, end) in ranges {
            current = match current {
                Some((s, e)) if start <= e + MAX_GAP && end.max(e) - s <= max_request => {
                    Some((s, end.max(e)))
                }
                Some(done) => {
                    requests.push((segment, done));
                    Some((start, end))
                }
                None => Some((start, end)),
            };
        }
        if let Some(done) = current {
            requests.push((segment, done));
        }
    }
    requests
}

/// Which counters a fetch adds to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Counted {
    /// Faults and prefetch: [`super::RemoteCounters::requests`] and `bytes_fetched`.
    Reads,
    /// The background fetch of the rest, counted apart.
    Background,
}

/// Runs `requests`, `parallel` at once, writing what comes back into `files` (the mirror's
/// segment files). Returns the bytes fetched. A short answer is skipped: its blocks fail
/// their checks when read, and are fetched again then.
fn fetch(
    remote: &Remote,
    dir: &Path,
    files: &std::sync::Arc<BTreeMap<u32, File>>,
    requests: Vec<Request>,
    parallel: usize,
    counted: Counted,
) -> Result<u64, RemoteError> {
    let files = std::sync::Arc::clone(files);
    let client = remote.client.clone();
    let url = remote.url.clone();
    let counters = std::sync::Arc::clone(&remote.counters);
    let dir = dir.to_path_buf();
    let fetched = run(async move {
        let mut results =
            futures::stream::iter(requests.into_iter().map(|(segment, (start, end))| {
                let client = client.clone();
                let url = url.clone();
                async move {
                    let name = store::segment_file_name(segment);
                    let key = object_store::path::Path::from(url.key(&name));
                    let bytes = client.get_range(&key, start..end).await.map_err(|source| {
                        RemoteError::Request {
                            op: "get range of",
                            bucket: url.bucket.clone(),
                            key: url.key(&name),
                            source: Box::new(source),
                        }
                    })?;
                    Ok::<_, RemoteError>((segment, start, end, bytes))
                }
            }))
            .buffer_unordered(parallel.max(1));
        let mut total = 0u64;
        while let Some(result) = results.next().await {
            let (segment, start, end, bytes) = result?;
            if bytes.len() as u64 != end - start {
                continue;
            }
            if let Some(f) = files.get(&segment) {
                f.write_all_at(&bytes, start)
                    .map_err(StoreError::io("write", &dir))?;
            }
            let (requests, bytes_fetched) = match counted {
                Counted::Reads => (&counters.requests, &counters.bytes_fetched),
                Counted::Background => (&counters.background_requests, &counters.background_bytes),
            };
            requests.fetch_add(1, Ordering::Relaxed);
            bytes_fetched.fetch_add(end - start, Ordering::Relaxed);
            total += end - start;
        }
        Ok::<_, RemoteError>(total)
    })?;
    remote.cache.filled(fetched);
    Ok(fetched)
}

/// See [`Remote::prefetch`].
pub(super) fn prefetch(
    remote: &Remote,
    store: &DiskStore,
    blocks: &[u64],
) -> Result<u64, RemoteError> {
    let (files, requests) = plan(store, blocks, remote.options.request_size)?;
    fetch(
        remote,
        store.dir(),
        &std::sync::Arc::new(files),
        requests,
        remote.options.parallel,
        Counted::Reads,
    )
}

/// Range requests the background fetch keeps in flight at once: few, so that a fault's own
/// request does not queue behind many of them.
const BACKGROUND_PARALLEL: usize = 2;

/// See [`Remote::fetch_rest`].
pub(super) fn fetch_rest(remote: &Remote, store: &DiskStore) -> Result<Option<u64>, RemoteError> {
    let blocks: Vec<u64> = (0..store.blocks()).collect();
    let (files, requests) = plan(store, &blocks, remote.options.request_size)?;
    let total: u64 = requests.iter().map(|(_, (start, end))| end - start).sum();
    // Room below where the cache's bound trims it (7/8 of the bound), after what every
    // mirror holds now (trimmed first if it is over): fetching more would push out what VMs
    // read, this one's working set included.
    let limit = remote.cache.limit();
    let held = remote.cache.enforce()?.bytes;
    let room = (limit - limit / 8).saturating_sub(held);
    if total > room {
        tracing::info!(
            "{}: the rest of the store ({total} bytes) does not fit in the cache's room \
             ({room} bytes below its bound, after what it holds); it is fetched as the VM \
             touches it",
            remote.url
        );
        return Ok(None);
    }
    let remote = remote.clone();
    let dir = store.dir().to_path_buf();
    let files = std::sync::Arc::new(files);
    std::thread::Builder::new()
        .name("s3-fetch-rest".into())
        .spawn(move || {
            let mut requests = requests.into_iter().peekable();
            while requests.peek().is_some() {
                // Faults first: no new request while one waits on the object store.
                while remote.counters.demand_in_flight.load(Ordering::Acquire) > 0 {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                let batch: Vec<Request> = requests.by_ref().take(BACKGROUND_PARALLEL).collect();
                if let Err(e) = fetch(
                    &remote,
                    &dir,
                    &files,
                    batch,
                    BACKGROUND_PARALLEL,
                    Counted::Background,
                ) {
                    tracing::warn!(
                        "{}: the background fetch stopped; the rest is fetched as the VM \
                         touches it: {}",
                        remote.url,
                        basics::error_chain(&e)
                    );
                    return;
                }
            }
            let counters = &remote.counters;
            counters.background_done.store(true, Ordering::Release);
            tracing::info!(
                "{}: the background fetch is done: {} bytes in {} requests",
                remote.url,
                counters.background_bytes.load(Ordering::Relaxed),
                counters.background_requests.load(Ordering::Relaxed)
            );
        })
        .map_err(StoreError::io("start the background fetch of", store.dir()))?;
    Ok(Some(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wanted(ranges: &[(u32, u64, u64)]) -> BTreeMap<u32, Vec<(u64, u64)>> {
        let mut wanted: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
        for &(segment, start, end) in ranges {
            wanted.entry(segment).or_default().push((start, end));
        }
        wanted
    }

    #[test]
    fn neighbours_coalesce_within_the_gap_and_segments_stay_apart() {
        const K: u64 = 1 << 10;
        let requests = coalesce(
            wanted(&[
                (0, 64 * K, 128 * K),
                (0, 0, 64 * K),
                (0, 128 * K + MAX_GAP, 200 * K),
                (0, 200 * K + MAX_GAP + 1, 300 * K),
                (1, 0, 10 * K),
                (0, 0, 64 * K),
            ]),
            4 << 20,
        );
        assert_eq!(
            requests,
            vec![
                (0, (0, 200 * K)),
                (0, (200 * K + MAX_GAP + 1, 300 * K)),
                (1, (0, 10 * K))
            ]
        );
        // No request past the largest size.
        let requests = coalesce(
            wanted(&[(0, 0, 64 * K), (0, 64 * K, 128 * K), (0, 128 * K, 160 * K)]),
            100 * K,
        );
        assert_eq!(requests, vec![(0, (0, 64 * K)), (0, (64 * K, 160 * K))]);
    }
}
