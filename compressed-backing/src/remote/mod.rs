//! Stores in an S3-compatible object store (`s3://BUCKET/PREFIX`), read lazily through a
//! local cache.
//!
//! **Layout.** A remote store is a store directory, object by object: `PREFIX/index` is the
//! index file (the same format, with the same checks) and `PREFIX/seg-NNNNNNNN.dat` are the
//! segment files, the chunks. A chunk is written once and never changed: an upload names its
//! chunks above every id the current index uses, puts them all, and only then puts the new
//! index, conditionally on the index it read (`If-Match` on its ETag, or `If-None-Match: *`
//! for a first upload). A reader therefore sees the old store or the new one, and an upload
//! interrupted half-way leaves the old one whole; chunks no index names are deleted by the
//! next upload that commits.
//!
//! **Reads** go through a mirror in the cache ([`cache`]): a store directory holding the
//! remote index and sparse segment files of the chunks' sizes. The store is opened from the
//! mirror as any store is; a payload whose bytes fail their checksum (a hole: not fetched yet)
//! is fetched with one range request, written into the mirror and checked again, so a corrupt
//! or truncated object is an error, never served. [`Remote::prefetch`] fetches a list of
//! blocks (a recorded working set) ahead of the faults, coalescing neighbours into one range
//! request and running several at once.
//!
//! **The client** is `object_store`'s S3 client: endpoint, region and credentials come from
//! the standard AWS environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
//! `AWS_ENDPOINT_URL`, …), the endpoint also from [`RemoteOptions::endpoint`]. Transient
//! failures (connection refused or reset, 5xx, throttling) are retried with exponential
//! backoff until [`RemoteOptions::retry_timeout`]; then the read fails with the cause.

pub mod cache;
mod fill;
mod objects;
mod upload;
mod url;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, ObjectStore, RetryConfig};

pub use cache::{Cache, CacheError, CacheUsage};
pub use objects::PutIf;
pub use upload::UploadReport;
pub use url::{RemoteUrl, StoreLocation, UrlError};

use crate::store::{DiskStore, StoreError};

/// How to reach an object store and where to cache what is read from it.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// The S3 endpoint (`http://127.0.0.1:9000` for a local S3-compatible server); `None`
    /// takes `AWS_ENDPOINT_URL` or AWS itself.
    pub endpoint: Option<String>,
    /// An access key id and secret that take the place of the environment's (for a program
    /// that embeds the client; the commands take the environment).
    pub credentials: Option<(String, String)>,
    /// The cache directory (private to this user; see [`cache`]).
    pub cache_dir: PathBuf,
    /// At most this many bytes are kept in the cache.
    pub cache_size: u64,
    /// How long a request is retried before it fails.
    pub retry_timeout: Duration,
    /// Range requests in flight at once while prefetching; chunks uploaded at once.
    pub parallel: usize,
    /// The most bytes one prefetch request asks for: neighbouring payloads are fetched
    /// together up to this size.
    pub request_size: u64,
    /// The key that seals what is uploaded and opens what is read (`--store-key`; see
    /// [`crate::seal`]); `None` for stores kept in the clear.
    pub key: Option<Arc<crate::seal::StoreKey>>,
    /// A restore fetches the rest of the store in the background after its working set
    /// (`--s3-fetch-rest`; see [`Remote::fetch_rest`]).
    pub fetch_rest: bool,
}

/// The default largest prefetch request: 4 MiB.
pub const DEFAULT_REQUEST_SIZE: u64 = 4 << 20;

/// The default cache size: 4 GiB.
pub const DEFAULT_CACHE_SIZE: u64 = 4 << 30;

impl RemoteOptions {
    /// The defaults: the endpoint from the environment, the cache in `$XDG_CACHE_HOME/pvisor`
    /// (else `$HOME/.cache/pvisor`, else `/var/cache/pvisor`), 4 GiB of it, 30 s of retries,
    /// 8 requests of up to 4 MiB at once (docs/bench/remote.md says why).
    pub fn new() -> Self {
        Self {
            endpoint: None,
            credentials: None,
            cache_dir: default_cache_dir(),
            cache_size: DEFAULT_CACHE_SIZE,
            retry_timeout: Duration::from_secs(30),
            parallel: 8,
            request_size: DEFAULT_REQUEST_SIZE,
            key: None,
            fetch_rest: false,
        }
    }
}

impl Default for RemoteOptions {
    fn default() -> Self {
        Self::new()
    }
}

/// The default cache directory (see [`RemoteOptions::new`]).
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir).join("pvisor");
    }
    if let Some(home) = std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(home).join(".cache/pvisor");
    }
    PathBuf::from("/var/cache/pvisor")
}

/// What fails with a remote store.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The client could not be set up (a bad endpoint, say).
    #[error("cannot set up the S3 client for {url}")]
    Client {
        /// The store.
        url: RemoteUrl,
        /// Why.
        #[source]
        source: Box<object_store::Error>,
    },
    /// A request failed (after its retries).
    #[error("{op} s3://{bucket}/{key} failed")]
    Request {
        /// What was asked.
        op: &'static str,
        /// The bucket.
        bucket: String,
        /// The object.
        key: String,
        /// Why (boxed: the client's errors are large).
        #[source]
        source: Box<object_store::Error>,
    },
    /// There is no store at the location.
    #[error("no store at {url}: its index object does not exist")]
    NotFound {
        /// The store.
        url: RemoteUrl,
    },
    /// Another writer committed to the store while this one uploaded.
    #[error("{url} was changed by another writer during this upload; nothing of this upload was committed")]
    Conflict {
        /// The store.
        url: RemoteUrl,
    },
    /// The store is encrypted and no key was given.
    #[error("{url} is encrypted: give its key (--store-key FILE)")]
    Sealed {
        /// The store.
        url: RemoteUrl,
    },
    /// A key was given for a store kept in the clear.
    #[error("{url} is not encrypted, but a key was given: it is not read without one")]
    NotSealed {
        /// The store.
        url: RemoteUrl,
    },
    /// The sealed index does not open with the key.
    #[error("the index of {url} does not open with this key: another key, or forged or damaged")]
    IndexUnsealed {
        /// The store.
        url: RemoteUrl,
    },
    /// An object sealed whole does not open with the key.
    #[error("{url}/{name} does not open with this key: not sealed, another key, or forged")]
    ObjectUnsealed {
        /// The prefix.
        url: RemoteUrl,
        /// The object.
        name: String,
    },
    /// An object that must not be overwritten exists.
    #[error("{url}/{name} exists already")]
    Exists {
        /// The prefix.
        url: RemoteUrl,
        /// The object.
        name: String,
    },
    /// An object is larger than what reads it accepts.
    #[error("{url}/{name} is {size} bytes or more, more than the {limit} accepted")]
    TooLarge {
        /// The prefix.
        url: RemoteUrl,
        /// The object.
        name: String,
        /// Its size, or what was read of it.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The index object is larger than its header allows.
    #[error("the index of {url} is {size} bytes, more than the {limit} its header allows")]
    IndexTooLarge {
        /// The store.
        url: RemoteUrl,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// Deleting everything under no prefix would empty the bucket.
    #[error("refusing to delete every object of {url}: only a prefix's objects are deleted")]
    WholeBucket {
        /// The bucket.
        url: RemoteUrl,
    },
    /// The cache failed.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The store (its index, or the local store uploaded) failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Counts of what a remote store's reads cost.
#[derive(Debug, Default)]
pub struct RemoteCounters {
    /// Range requests made for payloads (faults and prefetch).
    pub requests: AtomicU64,
    /// Payload bytes fetched (faults and prefetch).
    pub bytes_fetched: AtomicU64,
    /// Range requests of the background fetch of the rest ([`Remote::fetch_rest`]).
    pub background_requests: AtomicU64,
    /// Bytes the background fetch fetched.
    pub background_bytes: AtomicU64,
    /// The background fetch fetched all it set out to.
    pub background_done: AtomicBool,
    /// Faults waiting on a request now: the background fetch starts none meanwhile.
    pub demand_in_flight: AtomicU64,
}

/// A snapshot of [`RemoteCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RemoteStats {
    /// Range requests made for payloads (faults and prefetch).
    pub requests: u64,
    /// Payload bytes fetched (faults and prefetch).
    pub bytes_fetched: u64,
    /// Range requests of the background fetch of the rest.
    pub background_requests: u64,
    /// Bytes the background fetch fetched.
    pub background_bytes: u64,
    /// The background fetch is over, everything it set out to fetch fetched.
    pub background_done: bool,
}

/// A connection to one remote store, with the cache its reads go through.
#[derive(Debug, Clone)]
pub struct Remote {
    url: RemoteUrl,
    client: Arc<dyn ObjectStore>,
    cache: Arc<Cache>,
    options: RemoteOptions,
    counters: Arc<RemoteCounters>,
}

impl Remote {
    /// Sets up the client for `url` and opens the cache. Nothing is requested yet.
    pub fn connect(url: &RemoteUrl, options: &RemoteOptions) -> Result<Self, RemoteError> {
        // The TLS of the client (rustls, under reqwest) is built without a crypto provider of
        // its own: this process's default is ring's. An error means one is installed already
        // (by an earlier connect, or by the program), which then serves.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(&url.bucket)
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(50),
                    max_backoff: Duration::from_secs(2),
                    base: 2.0,
                },
                max_retries: 100,
                retry_timeout: options.retry_timeout,
            });
        if std::env::var_os("AWS_REGION").is_none()
            && std::env::var_os("AWS_DEFAULT_REGION").is_none()
        {
            builder = builder.with_region("us-east-1");
        }
        if let Some((id, secret)) = &options.credentials {
            builder = builder
                .with_access_key_id(id)
                .with_secret_access_key(secret);
        }
        if let Some(endpoint) = &options.endpoint {
            builder = builder
                .with_endpoint(endpoint)
                .with_allow_http(endpoint.starts_with("http://"))
                .with_virtual_hosted_style_request(false);
        }
        let client = builder.build().map_err(|source| RemoteError::Client {
            url: url.clone(),
            source: Box::new(source),
        })?;
        let cache = Cache::open(&options.cache_dir, options.cache_size)?;
        Ok(Self {
            url: url.clone(),
            client: Arc::new(client),
            cache: Arc::new(cache),
            options: options.clone(),
            counters: Arc::default(),
        })
    }

    /// The store under `name` within this one's prefix (a snapshot's RAM store, say), on
    /// the same client and cache.
    pub fn child(&self, name: &str) -> Remote {
        Remote {
            url: RemoteUrl {
                bucket: self.url.bucket.clone(),
                prefix: self.url.key(name),
            },
            client: Arc::clone(&self.client),
            cache: Arc::clone(&self.cache),
            options: self.options.clone(),
            counters: Arc::clone(&self.counters),
        }
    }

    /// The key for a store that is `sealed` or not: a sealed store needs one, a store in the
    /// clear is not read with one.
    pub(crate) fn key_for(
        &self,
        sealed: bool,
    ) -> Result<Option<&Arc<crate::seal::StoreKey>>, RemoteError> {
        match (&self.options.key, sealed) {
            (None, true) => Err(RemoteError::Sealed {
                url: self.url.clone(),
            }),
            (Some(_), false) => Err(RemoteError::NotSealed {
                url: self.url.clone(),
            }),
            (key, _) => Ok(key.as_ref()),
        }
    }

    /// The store's location.
    pub fn url(&self) -> &RemoteUrl {
        &self.url
    }

    /// The options it was set up with.
    pub fn options(&self) -> &RemoteOptions {
        &self.options
    }

    /// The cache reads go through.
    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    /// What reads cost so far (every store opened from this connection).
    pub fn stats(&self) -> RemoteStats {
        let c = &self.counters;
        RemoteStats {
            requests: c.requests.load(Ordering::Relaxed),
            bytes_fetched: c.bytes_fetched.load(Ordering::Relaxed),
            background_requests: c.background_requests.load(Ordering::Relaxed),
            background_bytes: c.background_bytes.load(Ordering::Relaxed),
            background_done: c.background_done.load(Ordering::Acquire),
        }
    }

    /// The mirror directory of this store in the cache.
    pub fn mirror_dir(&self) -> Result<PathBuf, RemoteError> {
        Ok(self
            .cache
            .mirror_dir(&mirror_name(&self.url, &self.options))?)
    }

    fn key(&self, name: &str) -> ObjectPath {
        ObjectPath::from(self.url.key(name))
    }

    fn request_error(
        &self,
        op: &'static str,
        name: &str,
    ) -> impl FnOnce(object_store::Error) -> RemoteError {
        let bucket = self.url.bucket.clone();
        let key = self.url.key(name);
        move |source| RemoteError::Request {
            op,
            bucket,
            key,
            source: Box::new(source),
        }
    }

    /// Opens the store read-only: fetches its index into the mirror, sizes the mirror's
    /// segment files and returns the store, whose reads fetch what the mirror lacks.
    pub fn open(&self) -> Result<DiskStore, RemoteError> {
        let dir = self.mirror_dir()?;
        // One process at a time fetches, adopts and opens the mirror's index: two opening it
        // while the store is replaced could otherwise adopt in one order and open in another
        // (and fill files the other one just replaced). Held until the store is open.
        let adopting = dir.join("adopt.lock");
        let lock = crate::file::open_or_create_private(&adopting).map_err(StoreError::File)?;
        lock.lock().map_err(StoreError::io("lock", &adopting))?;
        let fetched = self.fetch_index(&dir)?;
        let Some((index_tmp, _version)) = fetched else {
            return Err(RemoteError::NotFound {
                url: self.url.clone(),
            });
        };
        fill::adopt_index(&dir, &index_tmp)?;
        let mut store = DiskStore::open_read_only(&dir)?;
        if let Some(key) = self.key_for(store.is_sealed())? {
            store.set_key(Arc::clone(key))?;
        }
        let filler = fill::RemoteFill::new(self.clone(), &dir, &store)?;
        store.set_fill(Arc::new(filler));
        Ok(store)
    }

    /// Fetches the blocks `blocks` (in their order: a recorded working set) of `store` (opened
    /// by [`open`](Self::open)) into the cache: neighbours coalesced into one range request
    /// of up to 4 MiB, [`RemoteOptions::parallel`] requests at once; bytes the mirror holds
    /// already are not fetched again. Returns the payload bytes fetched.
    pub fn prefetch(&self, store: &DiskStore, blocks: &[u64]) -> Result<u64, RemoteError> {
        fill::prefetch(self, store, blocks)
    }

    /// Starts fetching every payload of `store` (opened by [`open`](Self::open)) that the
    /// mirror lacks into the cache, on a thread of its own, yielding to faults: coalesced
    /// range requests as [`prefetch`](Self::prefetch) makes, two at a time, and none started
    /// while a fault waits on the object store. Its requests and bytes are counted apart
    /// ([`RemoteStats::background_bytes`]). Returns the bytes it set out to fetch, or `None`
    /// (having started nothing) when they do not fit in the cache below its bound after what
    /// the cache holds, which would only push out what VMs need. A request that fails ends
    /// it with a warning: the rest is fetched as the VM touches it, as without it.
    pub fn fetch_rest(&self, store: &DiskStore) -> Result<Option<u64>, RemoteError> {
        fill::fetch_rest(self, store)
    }

    /// [`fetch_rest`](Self::fetch_rest) if the options ask for it (`--s3-fetch-rest`). It is
    /// optional: if it cannot start, that is a warning, and reads fetch as without it.
    pub fn fetch_rest_if_asked(&self, store: &DiskStore) {
        if self.options.fetch_rest {
            if let Err(e) = self.fetch_rest(store) {
                tracing::warn!(
                    "{}: no background fetch: {}",
                    self.url,
                    basics::error_chain(&e)
                );
            }
        }
    }

    /// Uploads the committed image of the local store in `dir` as this store's new image;
    /// see the module documentation. `progress` gets the bytes uploaded as they go.
    pub fn upload(
        &self,
        dir: &Path,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<UploadReport, RemoteError> {
        upload::upload(self, dir, progress)
    }

    /// Fetches the index object into a new file of `dir`; `None` if there is none. The size
    /// is checked against what its header allows before more is read.
    fn fetch_index(
        &self,
        dir: &Path,
    ) -> Result<Option<(PathBuf, object_store::UpdateVersion)>, RemoteError> {
        fill::fetch_index(self, dir)
    }
}

/// The mirror's directory name: readable, and distinct per endpoint, bucket and prefix.
fn mirror_name(url: &RemoteUrl, options: &RemoteOptions) -> String {
    let endpoint = options
        .endpoint
        .clone()
        .or_else(|| std::env::var("AWS_ENDPOINT_URL").ok())
        .unwrap_or_default();
    let identity = format!("{endpoint}\0{}\0{}", url.bucket, url.prefix);
    let hash = xxhash_rust::xxh3::xxh3_128(identity.as_bytes());
    format!("{}-{hash:032x}", url.bucket)
}

/// Runs `future` on the shared runtime and waits for it, from any thread (a fault thread, a
/// command's main thread; never a runtime thread).
fn run<F>(future: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    let runtime = RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("object-store")
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("cannot start the object store's runtime: {e}"))
    });
    match futures::executor::block_on(runtime.spawn(future)) {
        Ok(output) => output,
        Err(e) => match e.try_into_panic() {
            Ok(payload) => std::panic::resume_unwind(payload),
            Err(e) => panic!("object store task cancelled: {e}"),
        },
    }
}
