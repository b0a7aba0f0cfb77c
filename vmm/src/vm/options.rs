//! What a VM is started with (`pvisor run`'s options), its lifecycle states and its errors.

use std::path::PathBuf;

use compressed_backing::bulk::BulkOptions;
use compressed_backing::{Codec, CodecConfig};
use uffd_pager::cold::ColdConfig;
use uffd_pager::offload::{OffloadConfig, OffloadError};
use uffd_pager::pager::RamKind;

use crate::dedup::{DedupError, DedupOptions};
use crate::machine::MachineError;
use crate::snapshot::SnapshotError;
use crate::stats::CgroupError;

/// Everything a VM is started with.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct VmOptions {
    /// Bytes of guest RAM.
    pub memory: u64,
    /// vCPUs.
    pub vcpus: u32,
    /// How guest RAM is mapped.
    pub ram_backing: RamKind,
    /// Offload writes a compressed store (else raw).
    pub ram_compression: bool,
    /// Codec of a compressed offload.
    pub ram_codec: String,
    /// What the offload store's commits survive (`Process`: the VM's own store, not synced).
    #[serde(default = "own_store")]
    pub offload_durability: compressed_backing::Durability,
    /// The offload store is read back around the page cache (`O_DIRECT`) where it can be.
    #[serde(default = "reads_direct")]
    pub direct_reads: bool,
    /// The virtual disk's file.
    pub disk: PathBuf,
    /// Where offloaded RAM goes.
    pub store_dir: PathBuf,
    /// A memory cgroup to run in (relative to this process's own).
    pub cgroup: Option<PathBuf>,
    /// Fault-serving threads.
    pub pager_threads: usize,
    /// Threads for offload and eager load.
    pub io_threads: usize,
    /// Live cold-RAM compression and its knobs (memfd RAM only).
    #[serde(default)]
    pub cold: Option<ColdConfig>,
    /// KSM dedup of guest RAM (anon RAM only).
    #[serde(default)]
    pub dedup: Option<DedupOptions>,
    /// After an eager resume, remap the RAM that came back with transparent huge pages
    /// (anon RAM only; see `Pager::collapse`).
    #[serde(default)]
    pub thp_collapse: bool,
    /// When guest memory is lost (a page's source failed for good: a fetch past its retries,
    /// a block that does not check, in an object store or a local one), end this process with
    /// [`crate::runtime::EXIT_MEMORY_LOST`] two seconds later, after writing why to the job's
    /// directory: the machine cannot run again, and the thread that faulted may wait in a
    /// fault no one can answer. The VM process of `pvisor run` does; a program that embeds a
    /// `Vm` gets [`crate::machine::MachineError::MemoryLost`] where the vCPU can be kicked.
    #[serde(default)]
    pub exit_on_memory_lost: bool,
    /// Continue this sealed snapshot (its directory) instead of booting: RAM maps the
    /// snapshot's image privately and `ram_backing` must be `snapshot`.
    #[serde(default)]
    pub restore: Option<PathBuf>,
    /// Continue this sealed snapshot in an object store instead (`restore` is then `None`).
    #[serde(default)]
    pub restore_remote: Option<RemoteSnapshot>,
    /// Share pages in common with other VMs through the memory pool at this socket
    /// (`uffd-pager serve --memory-pool`; anon RAM only).
    #[serde(default)]
    pub pool: Option<PathBuf>,
    /// The upstream model endpoint of the guest's `model` requests (`http://HOST:PORT[/PATH]`).
    #[serde(default)]
    pub model_upstream: Option<String>,
    /// How an answer streams into a guest that takes it in batches (`model ID stream`).
    #[serde(default)]
    pub model_batching: crate::gateway::Batching,
    /// The guest's downloads: the origins allowed (none: no network), chunking, stall time.
    #[serde(default)]
    pub net: crate::net::NetOptions,
    /// The guest's read-only image, whose files are fetched on first read (`read PATH`).
    #[serde(default)]
    pub image: Option<crate::image::ImageOptions>,
    /// Pause, and offload if the policy says so, while a model request is out.
    #[serde(default)]
    pub wait: Option<crate::wait::WaitPolicy>,
    /// Join the host's memory governor (`pvisor serve --memory-governor`).
    #[serde(default)]
    pub governor: Option<GovernorOptions>,
    /// Survive arenas go to the offload store at their close (else into cold compression's
    /// pool; docs/arenas.md).
    #[serde(default)]
    pub arena_offload: bool,
    /// Act on the guest's arena reports (docs/arenas.md); else they are checked and counted,
    /// and memory stays as a host without arenas would leave it, until the guest's own
    /// free-page reports give it back.
    #[serde(default = "acts_on_arenas")]
    pub arenas: bool,
}

fn acts_on_arenas() -> bool {
    true
}

/// How a VM joins the memory governor.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct GovernorOptions {
    /// The governor's socket.
    pub socket: PathBuf,
    /// The name the VM has there (its job id).
    pub name: String,
    /// A fault held this long lifts the limit (milliseconds; the link's default if absent).
    #[serde(default)]
    pub hold_timeout_ms: Option<u64>,
}

impl VmOptions {
    /// A VM of `memory` bytes of `ram_backing` RAM, its disk and offload store at these paths,
    /// everything else as `pvisor run` has it by default: one vCPU and one fault thread, raw
    /// offloads (lz4 once compression is on), an I/O thread per CPU, no cgroup, and none of
    /// cold compression, dedup, restore, memory pool, model gateway or wait management. Set
    /// the rest with struct update syntax.
    pub fn new(memory: u64, ram_backing: RamKind, disk: PathBuf, store_dir: PathBuf) -> Self {
        Self {
            memory,
            vcpus: 1,
            ram_backing,
            ram_compression: false,
            ram_codec: "lz4".into(),
            offload_durability: compressed_backing::Durability::Process,
            direct_reads: true,
            disk,
            store_dir,
            cgroup: None,
            pager_threads: 1,
            io_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            cold: None,
            dedup: None,
            thp_collapse: false,
            exit_on_memory_lost: false,
            restore: None,
            restore_remote: None,
            pool: None,
            model_upstream: None,
            model_batching: crate::gateway::Batching::default(),
            net: crate::net::NetOptions::default(),
            image: None,
            wait: None,
            governor: None,
            arena_offload: false,
            arenas: true,
        }
    }

    /// How this VM's RAM is offloaded: to `store_dir`, compressed with `ram_codec` if
    /// `ram_compression` says so, with `io_threads` writers.
    pub fn offload_config(&self) -> Result<OffloadConfig, VmError> {
        let codec = if self.ram_compression {
            self.ram_codec.parse::<Codec>()?
        } else {
            Codec::None
        };
        Ok(OffloadConfig {
            dir: self.store_dir.clone(),
            codec: CodecConfig::new(codec),
            bulk: BulkOptions::with_threads(self.io_threads.max(1)),
            durability: self.offload_durability,
            direct_reads: self.direct_reads,
        })
    }
}

/// The lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    /// Takes commands.
    Running,
    /// Stopped by `suspend --vm-pause`; RAM resident.
    Paused,
    /// Stopped by `suspend --vm-offload`; RAM in the store.
    Offloaded,
}

/// Errors of VM operations.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// The machine failed.
    #[error(transparent)]
    Machine(#[from] MachineError),
    /// The cgroup could not be joined.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// The operation does not fit the VM's state.
    #[error("{0}")]
    State(String),
    /// Offload failed; the VM keeps its memory and runs on.
    #[error("offload failed; the VM keeps its memory and goes on running")]
    Offload(#[source] OffloadError),
    /// The offloaded image could not be shown as a file (the offload itself stands).
    #[error("the VM is offloaded, but its RAM cannot be shown at {path}: {reason}")]
    RamFile {
        /// The requested path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The host cannot give the huge pages an offloaded VM of huge-page RAM needs back; it
    /// stays offloaded.
    #[error("cannot resume: the VM stays offloaded")]
    HugePages(#[source] crate::hugepages::HugePoolError),
    /// Load failed.
    #[error("loading the VM's RAM back failed")]
    Load(#[source] uffd_pager::load::LoadError),
    /// The codec name is unknown.
    #[error(transparent)]
    Codec(#[from] compressed_backing::codec::UnknownCodec),
    /// Cold compression could not start.
    #[error("cannot start cold-RAM compression")]
    Cold(#[source] uffd_pager::cold::ColdError),
    /// KSM dedup could not start.
    #[error("cannot start KSM dedup (--vm-ram-dedup)")]
    Dedup(#[from] DedupError),
    /// The model gateway could not start.
    #[error("cannot start the gateway of model requests, downloads and image reads")]
    Gateway(#[from] crate::gateway::GatewayError),
    /// The image could not be opened.
    #[error("cannot open the VM's image (--vm-image)")]
    Image(#[from] crate::image::ImageError),
    /// The memory pool could not be joined.
    #[error("cannot join the memory pool (--vm-memory-pool)")]
    Pool(#[from] uffd_pager::sharing::PoolError),
    /// A snapshot could not be written, opened, or its private pages moved.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The link to the memory governor could not start.
    #[error("cannot start the memory governor's link (--vm-governor)")]
    Governor(#[source] std::io::Error),
}

/// A snapshot in an object store, as a VM process is told it (it connects itself; the
/// credentials come from the environment it inherits).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RemoteSnapshot {
    /// `s3://BUCKET/PREFIX`.
    pub url: String,
    /// The S3 endpoint, if not the environment's.
    pub endpoint: Option<String>,
    /// The read cache.
    pub cache_dir: PathBuf,
    /// Its bound, bytes.
    pub cache_size: u64,
    /// How long requests are retried, milliseconds.
    pub retry_timeout_ms: u64,
    /// The key file of an encrypted snapshot (`--store-key`).
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// Fetch the rest of the RAM store in the background after the working set
    /// (`--s3-fetch-rest`).
    #[serde(default)]
    pub fetch_rest: bool,
    /// Range requests in flight at once (`--s3-requests`; 0: the default).
    #[serde(default)]
    pub parallel: usize,
    /// The largest prefetch request, bytes (`--s3-request-size`; 0: the default).
    #[serde(default)]
    pub request_size: u64,
    /// Its manifest, as the starting command read and checked it: the VM process takes it
    /// as it takes every other option from its starter, and saves a round trip.
    #[serde(default)]
    pub manifest: Option<Box<crate::snapshot::Manifest>>,
}

impl RemoteSnapshot {
    /// The description of `url` reached with `options`.
    pub fn new(
        url: &compressed_backing::remote::RemoteUrl,
        options: &compressed_backing::remote::RemoteOptions,
        key_file: Option<PathBuf>,
    ) -> Self {
        Self {
            url: url.to_string(),
            endpoint: options.endpoint.clone(),
            cache_dir: options.cache_dir.clone(),
            cache_size: options.cache_size,
            retry_timeout_ms: u64::try_from(options.retry_timeout.as_millis()).unwrap_or(u64::MAX),
            manifest: None,
            key_file,
            fetch_rest: options.fetch_rest,
            parallel: options.parallel,
            request_size: options.request_size,
        }
    }

    /// Connects to it.
    pub fn connect(&self) -> Result<crate::snapshot::SnapshotAt, crate::snapshot::SnapshotError> {
        Ok(crate::snapshot::SnapshotAt::Remote(
            Box::new(self.remote()?),
            self.manifest.clone(),
        ))
    }

    /// Reads and checks its manifest, and keeps it: the VM process given this description
    /// takes it from there instead of fetching it again.
    pub fn fetch_manifest(
        &mut self,
    ) -> Result<crate::snapshot::Manifest, crate::snapshot::SnapshotError> {
        let manifest = self.connect()?.read_manifest()?;
        self.manifest = Some(Box::new(manifest.clone()));
        Ok(manifest)
    }

    /// A connection to its prefix.
    pub fn remote(
        &self,
    ) -> Result<compressed_backing::remote::Remote, crate::snapshot::SnapshotError> {
        use compressed_backing::remote::{Remote, RemoteOptions, RemoteUrl};
        let url =
            RemoteUrl::parse(&self.url).map_err(|e| crate::snapshot::SnapshotError::Manifest {
                path: PathBuf::from(&self.url),
                reason: e.to_string(),
            })?;
        let mut options = RemoteOptions::new();
        options.endpoint = self.endpoint.clone();
        options.cache_dir = self.cache_dir.clone();
        options.cache_size = self.cache_size;
        options.retry_timeout = std::time::Duration::from_millis(self.retry_timeout_ms);
        options.fetch_rest = self.fetch_rest;
        if self.parallel > 0 {
            options.parallel = self.parallel;
        }
        if self.request_size > 0 {
            options.request_size = self.request_size;
        }
        if let Some(path) = &self.key_file {
            let key = compressed_backing::seal::StoreKey::from_file(path).map_err(|e| {
                crate::snapshot::SnapshotError::Manifest {
                    path: path.clone(),
                    reason: basics::error_chain(&e),
                }
            })?;
            options.key = Some(std::sync::Arc::new(key));
        }
        Ok(Remote::connect(&url, &options)?)
    }
}

/// A VM's own offload store is read again only while its host runs.
fn own_store() -> compressed_backing::Durability {
    compressed_backing::Durability::Process
}

/// Reading the offload store around the page cache is the default.
fn reads_direct() -> bool {
    true
}
