//! `pvisor run`'s options: flags, a TOML config (`[vm]` keys), merged with flags winning,
//! then checked as a whole.

use std::path::{Path, PathBuf};

use basics::{format_bytes, parse_size};
use clap::Args;
use uffd_pager::pager::RamKind;

/// RAM kind of a VM with cold compression when none is given: memfd tracks reads as well as
/// writes (see docs/cold.md for the measurements behind the choice).
const COLD_RAM_BACKING: &str = "memfd";

/// Options of `pvisor run`.
mod waits;

use waits::{batching, image, net, wait_policy};

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// The executor; only `vm` exists.
    #[arg(long, value_name = "KIND")]
    pub executor: Option<String>,
    /// Guest RAM (e.g. 512MiB; a multiple of 2 MiB). Default 512MiB.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub memory: Option<u64>,
    /// vCPUs (the workload guest runs on the first). Default 1.
    #[arg(long, value_name = "N")]
    pub vcpus: Option<u32>,
    /// Offload to a compressed store (lz4 by default, see --vm-ram-codec) instead of raw.
    #[arg(long = "vm-ram-compression", num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub ram_compression: Option<bool>,
    /// Compress RAM the running VM has not touched for a while into an in-memory pool and
    /// drop it; a touch brings it back. Works on memfd RAM (the default with this option) and
    /// on anon RAM (Linux 6.8 or later).
    #[arg(long = "vm-cold-ram-compression", num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub cold_ram_compression: Option<bool>,
    /// When the guest closes a phase arena it declared `survive` (docs/arenas.md), write its
    /// memory to the offload store at once and drop it (it comes back on touch); without this,
    /// survive arenas go to cold compression's pool. Not with --vm-memory-pool or --restore.
    #[arg(long = "vm-arena-offload", num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub arena_offload: Option<bool>,
    /// Act on the guest's phase arenas (default true): drop a discard arena's memory at its
    /// close, compress or offload a survive arena's. `false` checks and counts the reports and
    /// moves nothing, as a host without arenas (the guest's free-page reports still give
    /// memory back): the baseline arenas are measured against.
    #[arg(long = "vm-arenas", num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub arenas: Option<bool>,
    /// After an eager resume, remap the RAM that came back with transparent huge pages
    /// (`MADV_COLLAPSE`), so that the guest's next pass over it pays no fault per 4 KiB page;
    /// anon RAM only, not with cold compression or dedup. Off by default: docs/bench/vm.md
    /// measures what the collapse costs against what it saves.
    #[arg(long = "vm-thp-collapse", num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub thp_collapse: Option<bool>,
    /// Cold compression: milliseconds without an access before a block is compressed (2000).
    #[arg(long = "vm-cold-age-ms", value_name = "MS")]
    pub cold_age_ms: Option<u64>,
    /// Cold compression: milliseconds between scans (500).
    #[arg(long = "vm-cold-scan-ms", value_name = "MS")]
    pub cold_scan_ms: Option<u64>,
    /// Cold compression: whether its scanner looks for cold RAM (true). `false` keeps the pool
    /// for what survive arenas send it at their close (docs/arenas.md): nothing is probed, so
    /// no access pays a fault for it.
    #[arg(long = "vm-cold-scan", num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub cold_scan: Option<bool>,
    /// Cold compression: share of one core the scanner may use (0.05; four times that idle).
    #[arg(long = "vm-cold-cpu-budget", value_name = "SHARE")]
    pub cold_cpu_budget: Option<f64>,
    /// Cold compression: most memory the pool may hold, as a share of guest RAM (0.5).
    #[arg(long = "vm-cold-pool-cap", value_name = "SHARE")]
    pub cold_pool_cap: Option<f64>,
    /// Cold compression: a block stays compressed only if that saves at least this percentage
    /// of it (12.5); others stay resident and are tried again later, less and less often.
    #[arg(long = "vm-cold-min-saving", value_name = "PERCENT")]
    pub cold_min_saving: Option<f64>,
    /// Let KSM merge identical pages within and across VMs: guest RAM is marked mergeable
    /// (anon RAM only) and KSM is tuned for fast merging while any such VM runs; the host's
    /// KSM settings come back when the last one exits. `stats` shows what was merged.
    #[arg(long = "vm-ram-dedup", num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub ram_dedup: Option<bool>,
    /// Dedup: share of one core ksmd may use while it merges (0.5).
    #[arg(long = "vm-dedup-cpu-budget", value_name = "SHARE")]
    pub dedup_cpu_budget: Option<f64>,
    /// Continue a sealed snapshot (`pvisor snapshot JOB --out DIR`) instead of booting: guest
    /// RAM maps the snapshot's image privately, so every VM restored from it shares the
    /// image's page cache and pays only for the pages it writes (with --vm-ram-backing, or a
    /// compressed snapshot, the pager loads it lazily into RAM of its own instead). RAM size
    /// and contents, the vCPU and the disk come from the snapshot; the script runs after it.
    /// `s3://BUCKET/PREFIX` continues a snapshot in an object store (`pvisor snapshot JOB
    /// --out s3://…`): its RAM is fetched as the guest touches it, the working set it carries
    /// first, through the cache (--cache, --s3-endpoint; docs/remote.md).
    #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX")]
    pub restore: Option<String>,
    #[command(flatten)]
    pub remote: uffd_pager::remote_args::RemoteArgs,
    /// Share the pages this VM has in common with other VMs through the memory pool at
    /// SOCKET (`uffd-pager serve --memory-pool --socket SOCKET`): between commands the VM
    /// offers its pages' hashes and maps the pool's copy over identical ones (reads shared, a
    /// write makes a private copy). Anon RAM only; not with cold compression or offload.
    #[arg(long = "vm-memory-pool", value_name = "SOCKET")]
    pub memory_pool: Option<PathBuf>,
    /// Join the host's memory governor at SOCKET (`pvisor serve --memory-governor`): the VM
    /// reports its waits, holds a fault that would take it past the resident limit the
    /// governor sets until room is made, and offloads when the governor needs its memory.
    /// Without the governor (not started yet, or gone) the VM runs as if not given.
    #[arg(long = "vm-governor", value_name = "SOCKET")]
    pub governor: Option<PathBuf>,
    /// A fault the governor holds longer than MS lifts the VM's resident limit, with a message
    /// (120000).
    #[arg(long = "vm-governor-hold-timeout-ms", value_name = "MS")]
    pub governor_hold_timeout_ms: Option<u64>,
    /// Where the guest's `model REQUEST_ID` commands go: an upstream model endpoint,
    /// http://HOST:PORT[/PATH] (the gateway POSTs to PATH/requests/ID and hands the guest the
    /// response body; an error status reaches the guest as an error).
    #[arg(long = "vm-model-upstream", value_name = "URL")]
    pub model_upstream: Option<String>,
    /// A guest that takes its answer in batches (`model ID stream`) gets one as soon as this
    /// much of the answer has arrived (16KiB)...
    #[arg(long = "vm-model-batch", value_parser = parse_size, value_name = "SIZE")]
    pub model_batch: Option<u64>,
    /// ...or when the oldest byte it has not had has waited MS (100), and the rest at the
    /// answer's end.
    #[arg(long = "vm-model-batch-ms", value_name = "MS")]
    pub model_batch_ms: Option<u64>,
    /// Most bytes of a streamed answer kept on the host that the guest has not taken (while
    /// it is offloaded, or held by an operator): past it the gateway stops reading the
    /// upstream until the guest takes a batch (256KiB).
    #[arg(long = "vm-model-buffer", value_parser = parse_size, value_name = "SIZE")]
    pub model_buffer: Option<u64>,
    /// An origin the guest's `download URL` commands may fetch from, http://HOST[:PORT]
    /// (repeat the flag for more; none: the guest has no network). Plain HTTP, GET only,
    /// no redirects followed.
    #[arg(long = "vm-net-allow", value_name = "ORIGIN")]
    pub net_allow: Vec<String>,
    /// A download's body is handed to the guest in chunks: one as soon as this much has
    /// arrived (1MiB)...
    #[arg(long = "vm-net-chunk", value_parser = parse_size, value_name = "SIZE")]
    pub net_chunk: Option<u64>,
    /// ...or when its oldest byte has waited MS (1000), and the rest at the end.
    #[arg(long = "vm-net-chunk-ms", value_name = "MS")]
    pub net_chunk_ms: Option<u64>,
    /// Most bytes of a download kept on the host that the guest has not taken (while it is
    /// offloaded): past it the origin is not read until the guest takes a chunk (4MiB).
    #[arg(long = "vm-net-buffer", value_parser = parse_size, value_name = "SIZE")]
    pub net_buffer: Option<u64>,
    /// A download whose origin sends nothing for MS ends with an error; the VM goes on
    /// (30000).
    #[arg(long = "vm-net-stall-ms", value_name = "MS")]
    pub net_stall_ms: Option<u64>,
    /// A download not over after MS ends with an error, however it trickles (3600000).
    #[arg(long = "vm-net-timeout-ms", value_name = "MS")]
    pub net_timeout_ms: Option<u64>,
    /// A read-only file tree for the guest's `read PATH` commands: a directory,
    /// s3://BUCKET/PREFIX (the S3 options below) or the root URL of a plain-HTTP server
    /// (http://HOST[:PORT]/PATH: a GET of ROOT/FILE per file), holding `image.json` (`pvisor
    /// image-index DIR` writes it). A file is fetched from there on its first read, checked
    /// against the manifest and staged in the VM's runtime directory for later reads.
    #[arg(
        long = "vm-image",
        value_name = "DIR|s3://BUCKET/PREFIX|http://HOST[:PORT]/PATH"
    )]
    pub image: Option<String>,
    /// Hold the image's origin to this rate, bytes a second (e.g. 40MiB): a slow origin
    /// modelled on a fast one. Default: as fast as it serves.
    #[arg(long = "vm-image-rate", value_parser = parse_size, value_name = "SIZE")]
    pub image_rate: Option<u64>,
    /// Stage the image's fetched files in DIR (created 0700; an existing one must be this
    /// user's, writable by no one else) instead of the VM's runtime directory: VMs of one
    /// image given one DIR fetch each file from the origin once between them. Files are named
    /// by their digest and checked on every read. Give each image its own DIR, and put it
    /// where only you can write its parents.
    #[arg(long = "vm-image-staging", value_name = "DIR")]
    pub image_staging: Option<PathBuf>,
    /// While a `model` request is out, pause the VM after 20 ms and offload it after 50 ms
    /// (at most every 5 s, and only when the wait is expected to pay for it: see
    /// --vm-wait-break-even); load it back when the answer arrives. Needs --vm-model-upstream.
    #[arg(long = "vm-wait-management", num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub wait_management: Option<bool>,
    /// What wait management does: offload (default) or pause only.
    #[arg(long = "vm-wait-strategy", value_name = "STRATEGY")]
    pub wait_strategy: Option<String>,
    /// Multiply the wait policy's durations (20 ms, 50 ms, 1 s, 5 s) by this factor, e.g. for
    /// a replay whose waits were scaled by it (1).
    #[arg(long = "vm-wait-scale", value_name = "FACTOR")]
    pub wait_scale: Option<f64>,
    /// Pause a waiting VM after MS of waiting with an idle guest (20).
    #[arg(long = "vm-wait-pause-ms", value_name = "MS")]
    pub wait_pause_ms: Option<u64>,
    /// Offload a paused VM MS after its wait began (50).
    #[arg(long = "vm-wait-offload-ms", value_name = "MS")]
    pub wait_offload_ms: Option<u64>,
    /// Offload only if the guest's next timer is at least MS away (1000).
    #[arg(long = "vm-wait-timer-budget-ms", value_name = "MS")]
    pub wait_timer_budget_ms: Option<u64>,
    /// Offload at most once per MS (5000).
    #[arg(long = "vm-wait-cooldown-ms", value_name = "MS")]
    pub wait_cooldown_ms: Option<u64>,
    /// Offload in a wait only if its expected remaining time (from this VM's past waits) is at
    /// least FACTOR times what this VM's offloads take; 0 offloads whenever the other rules
    /// allow (4).
    #[arg(long = "vm-wait-break-even", value_name = "FACTOR")]
    pub wait_break_even: Option<f64>,
    /// How RAM offloaded in a wait comes back: faults (only what the guest touches; default)
    /// or lazy (faults, and a prefetcher brings the rest back).
    #[arg(long = "vm-wait-reload", value_name = "MODE")]
    pub wait_reload: Option<String>,
    /// When the first bytes of an offloaded VM's answer arrive (an upstream that streams its
    /// answer, in chunks or as server-sent events), start bringing back the RAM its guest
    /// touched after its last resumes while the rest streams in, so that the guest finds it
    /// resident (true).
    #[arg(long = "vm-wait-warm", value_name = "BOOL")]
    pub wait_warm: Option<bool>,
    /// Which waits are managed: any of model, download, read, comma-separated, or all (the
    /// default); the VM only waits through the others.
    #[arg(long = "vm-wait-sources", value_name = "LIST")]
    pub wait_sources: Option<String>,
    /// Guest RAM mapping: anon (private anonymous, default), memfd (shared memfd), hugetlb
    /// (private 2 MiB huge pages) or hugetlb-memfd (a shared memfd of 2 MiB huge pages). Huge
    /// pages come from the host's pool: raise /proc/sys/vm/nr_overcommit_hugepages (or
    /// nr_hugepages) first. With --restore, the snapshot's RAM is loaded lazily into RAM of
    /// this kind instead of mapping its image (shared copy-on-write by every VM restored
    /// from it).
    #[arg(long = "vm-ram-backing", value_name = "KIND")]
    pub ram_backing: Option<String>,
    /// Codec of a compressed offload: lz4 (default) or zstd[:LEVEL].
    #[arg(long = "vm-ram-codec", value_name = "CODEC")]
    pub ram_codec: Option<String>,
    /// What an offload's store survives: process (default: the VM's own store, read again
    /// only while this host runs; its batches are written back and out of the page cache
    /// before the VM's pages go, but never synced) or host (every commit synced: it survives
    /// a crash of the host, at about twice the offload time). docs/pager.md.
    #[arg(long = "vm-offload-durability", value_name = "WHAT")]
    pub offload_durability: Option<String>,
    /// Read the offload store back around the page cache (O_DIRECT, where its file system
    /// allows): true (default) or false (through the page cache, dropping what was read).
    #[arg(long = "vm-direct-reads", num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub direct_reads: Option<bool>,
    /// A TOML file whose `[vm]` table sets any of these options (flags win).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Run the VM in the background; return after the identity line.
    #[arg(long)]
    pub detach: bool,
    /// Job id (default: a fresh one).
    #[arg(long, value_name = "ID")]
    pub job: Option<String>,
    /// The virtual disk's host file (default: a fresh file in the VM's runtime directory).
    #[arg(long, value_name = "FILE")]
    pub disk: Option<PathBuf>,
    /// Run in this memory cgroup (created under pvisor's own; v2, else v1). In the
    /// foreground pvisor moves itself in and executes itself again there, so that all it
    /// touches is charged there.
    #[arg(long, value_name = "PATH")]
    pub cgroup: Option<PathBuf>,
    /// Fault-serving threads of the pager.
    #[arg(long, value_name = "N")]
    pub pager_threads: Option<usize>,
    /// The workload script.
    #[arg(last = true, required = true, value_name = "SCRIPT")]
    pub script: Vec<String>,
}

/// The `[vm]` table of a config file.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct ConfigVm {
    executor: Option<String>,
    memory: Option<toml::Value>,
    vcpus: Option<u32>,
    ram_compression: Option<bool>,
    cold_ram_compression: Option<bool>,
    cold_age_ms: Option<u64>,
    cold_scan_ms: Option<u64>,
    cold_scan: Option<bool>,
    cold_cpu_budget: Option<f64>,
    cold_pool_cap: Option<f64>,
    cold_min_saving: Option<f64>,
    ram_dedup: Option<bool>,
    dedup_cpu_budget: Option<f64>,
    thp_collapse: Option<bool>,
    arena_offload: Option<bool>,
    arenas: Option<bool>,
    ram_backing: Option<String>,
    ram_codec: Option<String>,
    offload_durability: Option<String>,
    direct_reads: Option<bool>,
    restore: Option<PathBuf>,
    memory_pool: Option<PathBuf>,
    governor: Option<PathBuf>,
    governor_hold_timeout_ms: Option<u64>,
    model_upstream: Option<String>,
    model_batch: Option<String>,
    model_batch_ms: Option<u64>,
    model_buffer: Option<String>,
    net_allow: Option<Vec<String>>,
    net_chunk: Option<String>,
    net_chunk_ms: Option<u64>,
    net_buffer: Option<String>,
    net_stall_ms: Option<u64>,
    net_timeout_ms: Option<u64>,
    image: Option<String>,
    image_rate: Option<String>,
    image_staging: Option<PathBuf>,
    wait_management: Option<bool>,
    wait_strategy: Option<String>,
    wait_scale: Option<f64>,
    wait_break_even: Option<f64>,
    wait_reload: Option<String>,
    wait_warm: Option<bool>,
    wait_sources: Option<String>,
    wait_pause_ms: Option<u64>,
    wait_offload_ms: Option<u64>,
    wait_timer_budget_ms: Option<u64>,
    wait_cooldown_ms: Option<u64>,
    disk: Option<PathBuf>,
    cgroup: Option<PathBuf>,
    pager_threads: Option<usize>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    vm: ConfigVm,
}

/// The merged, checked options.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub memory: u64,
    pub vcpus: u32,
    pub ram_backing: RamKind,
    pub ram_compression: bool,
    pub ram_codec: String,
    pub offload_durability: compressed_backing::Durability,
    pub direct_reads: bool,
    pub disk: Option<PathBuf>,
    pub cgroup: Option<PathBuf>,
    pub pager_threads: usize,
    pub cold: Option<uffd_pager::cold::ColdConfig>,
    pub dedup: Option<vmm::dedup::DedupOptions>,
    pub thp_collapse: bool,
    pub arena_offload: bool,
    pub arenas: bool,
    pub restore: Option<PathBuf>,
    pub restore_remote: Option<vmm::vm::RemoteSnapshot>,
    pub pool: Option<PathBuf>,
    pub governor: Option<PathBuf>,
    pub governor_hold_timeout_ms: Option<u64>,
    pub model_upstream: Option<String>,
    pub model_batching: vmm::gateway::Batching,
    pub net: vmm::net::NetOptions,
    /// Where the image is, its origin's rate and where its files are staged (`None`: the
    /// job's directory).
    pub image: Option<waits::ImageChoice>,
    pub wait: Option<vmm::wait::WaitPolicy>,
}

/// Most bytes of a config file: a `[vm]` table is a few hundred bytes; 1 MiB is far beyond
/// any, and keeps `--config /dev/zero` or a huge file from filling memory.
const CONFIG_LIMIT: u64 = 1 << 20;

fn read_config(path: &Path) -> Result<ConfigVm, String> {
    // A FIFO (whose read would block), a device or a link is refused.
    // The whole chain: the FileError names the file, its source says why (ENOENT, EACCES).
    let text = compressed_backing::file::read_text_bounded(path, CONFIG_LIMIT)
        .map_err(|e| format!("config: {}", basics::error_chain(&e)))?;
    let file: ConfigFile =
        toml::from_str(&text).map_err(|e| format!("config {}: {e}", path.display()))?;
    Ok(file.vm)
}

/// Host RAM in bytes (`MemTotal`).
fn host_memory() -> Option<u64> {
    use procfs::Current;
    procfs::Meminfo::current().ok().map(|m| m.mem_total)
}

/// Merges the config file under the flags and checks the result.
pub fn resolve(args: &RunArgs) -> Result<Resolved, String> {
    let config = match &args.config {
        Some(path) => read_config(path)?,
        None => ConfigVm::default(),
    };
    let model_batching = batching(args, &config)?;
    let net = net(args, &config)?;
    let image = image(args, &config)?;
    let wait = wait_policy(args, &config)?;
    let executor = args
        .executor
        .clone()
        .or(config.executor)
        .unwrap_or_else(|| "vm".into());
    if executor != "vm" {
        return Err(format!(
            "executor `{executor}` is not available; only `vm` is"
        ));
    }
    let location = match args.restore.as_deref() {
        Some(text) => Some(
            compressed_backing::remote::StoreLocation::parse(text)
                .map_err(|e| format!("--restore: {e}"))?,
        ),
        None => config
            .restore
            .map(compressed_backing::remote::StoreLocation::Local),
    };
    let (restore, mut restore_remote) = match location {
        None => (None, None),
        Some(compressed_backing::remote::StoreLocation::Local(dir)) => (
            Some(std::path::absolute(dir).map_err(|e| format!("--restore: {e}"))?),
            None,
        ),
        Some(compressed_backing::remote::StoreLocation::Remote(url)) => {
            let options = args.remote.options()?;
            // The VM process reads the key file itself: the key never travels.
            let key_file = args
                .remote
                .store_key
                .as_deref()
                .map(std::path::absolute)
                .transpose()
                .map_err(|e| format!("--store-key: {e}"))?;
            (
                None,
                Some(vmm::vm::RemoteSnapshot::new(&url, &options, key_file)),
            )
        }
    };
    // Kept with a remote snapshot: the VM process need not fetch it again.
    let snapshot = match (&restore, &mut restore_remote) {
        (Some(dir), _) => Some(vmm::snapshot::read_manifest(dir)),
        (None, Some(remote)) => Some(remote.fetch_manifest()),
        (None, None) => None,
    }
    .transpose()
    .map_err(|e| format!("--restore: {}", basics::error_chain(&e)))?;
    let memory = match (args.memory, config.memory) {
        (Some(bytes), _) => bytes,
        (None, Some(toml::Value::String(text))) => {
            parse_size(&text).map_err(|e| format!("config memory: {e}"))?
        }
        (None, Some(toml::Value::Integer(bytes))) => {
            u64::try_from(bytes).map_err(|_| format!("config memory: {bytes} is negative"))?
        }
        (None, Some(other)) => return Err(format!("config memory: `{other}` is not a size")),
        (None, None) => snapshot.as_ref().map_or(512 << 20, |s| s.memory),
    };
    if let Some(manifest) = &snapshot {
        if memory != manifest.memory {
            return Err(format!(
                "--memory {} differs from the snapshot's {}: a restored VM keeps its RAM size",
                format_bytes(memory),
                format_bytes(manifest.memory)
            ));
        }
    }
    let cold = args
        .cold_ram_compression
        .or(config.cold_ram_compression)
        .unwrap_or(false);
    let dedup = args.ram_dedup.or(config.ram_dedup).unwrap_or(false);
    // Dedup needs private anonymous RAM, so with both it decides the default kind.
    let default_backing = if cold && !dedup {
        COLD_RAM_BACKING
    } else {
        "anon"
    };
    let backing = args.ram_backing.clone().or(config.ram_backing);
    let restore_store = snapshot
        .as_ref()
        .is_some_and(|m| m.ram_format == vmm::snapshot::RamFormat::Store);
    let restoring = (restore.is_some() || restore_remote.is_some()).then_some(());
    let ram_backing = match (backing.as_deref(), &restoring) {
        // A compressed snapshot is loaded into anon RAM by the pager; a raw one is mapped
        // privately, its page cache shared by every VM restored from it. With a kind given,
        // the pager loads either into RAM of that kind.
        (None, Some(_)) if restore_store => RamKind::Anon,
        (None, Some(_)) => RamKind::Snapshot,
        (Some("anon"), _) => RamKind::Anon,
        (Some("memfd"), _) => RamKind::Memfd,
        (Some("hugetlb"), _) => RamKind::Hugetlb,
        (Some("hugetlb-memfd"), _) => RamKind::HugetlbMemfd,
        (None, None) => match default_backing {
            "memfd" => RamKind::Memfd,
            _ => RamKind::Anon,
        },
        (Some(other), _) => {
            return Err(format!(
                "--vm-ram-backing `{other}`: expected anon, memfd, hugetlb or hugetlb-memfd"
            ))
        }
    };
    let disk = args.disk.clone().or(config.disk);
    if let (Some(disk), Some(())) = (&disk, &restoring) {
        if disk.exists() {
            return Err(format!(
                "--disk {} exists: a restored VM gets its own copy of the snapshot's disk, \
                 written to a new file",
                disk.display()
            ));
        }
    }
    let pool = args
        .memory_pool
        .clone()
        .or(config.memory_pool)
        .map(std::path::absolute)
        .transpose()
        .map_err(|e| format!("--vm-memory-pool: {e}"))?;
    if pool.is_some() && (cold || restoring.is_some() || ram_backing != RamKind::Anon) {
        return Err(
            "--vm-memory-pool works on anon RAM, without --vm-cold-ram-compression or --restore"
                .into(),
        );
    }
    if cold && restoring.is_some() {
        return Err(
            "--vm-cold-ram-compression works on anon and memfd RAM, not on a restored \
             snapshot's RAM"
                .into(),
        );
    }
    if cold && ram_backing == RamKind::Hugetlb {
        return Err(
            "--vm-cold-ram-compression does not work on hugetlb RAM (private huge pages cannot \
             be moved out to be checked before they are dropped): use hugetlb-memfd, memfd or \
             anon RAM"
                .into(),
        );
    }
    if dedup && ram_backing.is_hugetlb() {
        return Err(format!(
            "--vm-ram-dedup cannot work on {} RAM: KSM does not merge huge pages",
            ram_backing.name()
        ));
    }
    if dedup && ram_backing == RamKind::Memfd {
        return Err(
            "--vm-ram-dedup needs private anonymous RAM, but --vm-ram-backing is memfd \
             (shared writable memory cannot be merged by KSM)"
                .into(),
        );
    }
    let thp_collapse = args.thp_collapse.or(config.thp_collapse).unwrap_or(false);
    if thp_collapse && (ram_backing != RamKind::Anon || cold || dedup) {
        return Err(
            "--vm-thp-collapse remaps anon RAM with transparent huge pages: not with another \
             RAM kind, --vm-cold-ram-compression (the kernel does not collapse write-tracked \
             RAM) or --vm-ram-dedup (KSM's merged pages cannot be collapsed)"
                .into(),
        );
    }
    let arena_offload = args.arena_offload.or(config.arena_offload).unwrap_or(false);
    if arena_offload && (pool.is_some() || restoring.is_some()) {
        return Err(
            "--vm-arena-offload writes arenas to the VM's offload store: not with \
             --vm-memory-pool or --restore"
                .into(),
        );
    }
    let arenas = args.arenas.or(config.arenas).unwrap_or(true);
    if arena_offload && !arenas {
        return Err("--vm-arena-offload acts on arenas: not with --vm-arenas false".into());
    }
    let dedup_cpu_budget = args.dedup_cpu_budget.or(config.dedup_cpu_budget);
    if dedup_cpu_budget.is_some_and(|s| !(s > 0.0 && s <= 1.0)) {
        return Err("--vm-dedup-cpu-budget is a share of one core, above 0 and at most 1".into());
    }
    let dedup = dedup.then(|| {
        let default = vmm::dedup::DedupOptions::default();
        vmm::dedup::DedupOptions {
            cpu_budget: dedup_cpu_budget.unwrap_or(default.cpu_budget),
            ..default
        }
    });
    let ram_codec = args
        .ram_codec
        .clone()
        .or(config.ram_codec)
        .unwrap_or_else(|| "lz4".into());
    ram_codec
        .parse::<compressed_backing::Codec>()
        .map_err(|e| format!("--vm-ram-codec: {e}"))?;
    let offload_durability = match args
        .offload_durability
        .clone()
        .or(config.offload_durability)
        .as_deref()
    {
        None | Some("process") => compressed_backing::Durability::Process,
        Some("host") => compressed_backing::Durability::Host,
        Some(other) => {
            return Err(format!(
                "--vm-offload-durability `{other}`: expected process or host"
            ))
        }
    };
    if let Some(host) = host_memory() {
        if memory > host {
            return Err(format!(
                "--memory {} is more than this host has ({})",
                format_bytes(memory),
                format_bytes(host)
            ));
        }
    }
    let min_saving = args.cold_min_saving.or(config.cold_min_saving);
    if min_saving.is_some_and(|p| !(0.0..100.0).contains(&p)) {
        return Err("--vm-cold-min-saving is a percentage, at least 0 and below 100".into());
    }
    let cold = cold.then(|| {
        let default = uffd_pager::cold::ColdConfig::default();
        let cpu_budget = args
            .cold_cpu_budget
            .or(config.cold_cpu_budget)
            .unwrap_or(default.cpu_budget);
        uffd_pager::cold::ColdConfig {
            cold_age: args
                .cold_age_ms
                .or(config.cold_age_ms)
                .map_or(default.cold_age, std::time::Duration::from_millis),
            scan_period: args
                .cold_scan_ms
                .or(config.cold_scan_ms)
                .map_or(default.scan_period, std::time::Duration::from_millis),
            scan: args.cold_scan.or(config.cold_scan).unwrap_or(default.scan),
            cpu_budget,
            // While the guest reports idle the scanner may use four times its budget.
            idle_cpu_budget: (cpu_budget * 4.0).min(1.0),
            pool_cap_share: args
                .cold_pool_cap
                .or(config.cold_pool_cap)
                .unwrap_or(default.pool_cap_share),
            // Kept if compressed size ≤ (1000 - saving‰) / 1000 of the block.
            max_ratio: min_saving.map_or(default.max_ratio, |p| {
                #[allow(
                    clippy::cast_sign_loss,
                    clippy::cast_possible_truncation,
                    reason = "checked above: 0 ≤ p < 100, so 0 ≤ p × 10 < 1000"
                )]
                let saving = (p * 10.0).round() as u32;
                (1000 - saving.min(999), 1000)
            }),
            ..default
        }
    });
    if let Some(cold) = &cold {
        if cold.scan_period.is_zero() || !(cold.cpu_budget > 0.0 && cold.cpu_budget <= 1.0) {
            return Err(
                "--vm-cold-scan-ms must be positive and --vm-cold-cpu-budget in (0, 1]".into(),
            );
        }
        if !(0.0..=1.0).contains(&cold.pool_cap_share) {
            return Err("--vm-cold-pool-cap is a share of guest RAM, 0 to 1".into());
        }
    }
    let model_upstream = args.model_upstream.clone().or(config.model_upstream);
    if let Some(url) = &model_upstream {
        // The same check the gateway makes, before anything starts.
        vmm::gateway::check_upstream(url).map_err(|e| e.to_string())?;
    }
    if wait.is_some() && model_upstream.is_none() && net.allow.is_empty() && image.is_none() {
        return Err(
            "--vm-wait-management manages the waits of `model` requests, downloads and image \
             reads: it needs --vm-model-upstream, --vm-net-allow or --vm-image"
                .into(),
        );
    }
    if wait.is_some_and(|w| w.offload) && (pool.is_some() || ram_backing == RamKind::Snapshot) {
        return Err(
            "--vm-wait-management cannot offload a VM in the memory pool or restored from a raw \
             snapshot: add --vm-wait-strategy pause"
                .into(),
        );
    }
    let governor = args
        .governor
        .clone()
        .or(config.governor)
        .map(std::path::absolute)
        .transpose()
        .map_err(|e| format!("--vm-governor: {e}"))?;
    let governor_hold_timeout_ms = args
        .governor_hold_timeout_ms
        .or(config.governor_hold_timeout_ms);
    if governor_hold_timeout_ms.is_some() && governor.is_none() {
        return Err("--vm-governor-hold-timeout-ms needs --vm-governor".into());
    }
    if governor_hold_timeout_ms.is_some_and(|ms| ms == 0 || ms > 3_600_000) {
        return Err("--vm-governor-hold-timeout-ms: 1 to 3600000 milliseconds".into());
    }
    if governor.is_some() && ram_backing.is_hugetlb() {
        return Err(format!(
            "--vm-governor keeps VMs inside a budget of memory-cgroup charges, and huge pages \
             are not charged to a memory cgroup: not with {} RAM",
            ram_backing.name()
        ));
    }
    // A snapshot restored into the VM's own RAM is served by its pager like any other RAM;
    // its image mapped as RAM is not.
    if governor.is_some() && (pool.is_some() || ram_backing == RamKind::Snapshot) {
        return Err(
            "--vm-governor limits RAM the pager serves: not with --vm-memory-pool, nor with \
             --restore mapping the snapshot's image as RAM (restore into the VM's own RAM: \
             --vm-ram-backing anon)"
                .into(),
        );
    }
    Ok(Resolved {
        thp_collapse,
        arena_offload,
        arenas,
        governor,
        governor_hold_timeout_ms,
        cold,
        dedup,
        restore,
        restore_remote,
        pool,
        model_upstream,
        model_batching,
        net,
        image,
        wait,
        memory,
        vcpus: args.vcpus.or(config.vcpus).unwrap_or(1),
        ram_backing,
        ram_compression: args
            .ram_compression
            .or(config.ram_compression)
            .unwrap_or(false),
        ram_codec,
        offload_durability,
        direct_reads: args.direct_reads.or(config.direct_reads).unwrap_or(true),
        disk,
        cgroup: args.cgroup.clone().or(config.cgroup),
        pager_threads: args.pager_threads.or(config.pager_threads).unwrap_or(1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_config_of_a_device_fifo_or_huge_file_is_refused_at_once() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let fifo = dir.path().join("fifo");
        testkit::mkfifo(&fifo);
        let huge = dir.path().join("huge.toml");
        let file = std::fs::File::create(&huge).expect("a file");
        file.set_len(CONFIG_LIMIT + 1).expect("a sparse file");
        // The FIFO first: before the fix it hangs, and the test stops there rather than read
        // /dev/zero without end.
        let missing = dir.path().join("missing.toml");
        for (path, expected) in [
            (fifo.as_path(), "FIFO"),
            (huge.as_path(), "limit"),
            (Path::new("/dev/zero"), "character device"),
            // The cause is kept, not only the file's name.
            (missing.as_path(), "missing.toml: No such file"),
        ] {
            let owned = path.to_path_buf();
            let limit = std::time::Duration::from_secs(10);
            let what = format!("reading {}", path.display());
            let result = testkit::within(limit, &what, move || read_config(&owned).map(drop));
            let err = result.expect_err("refused");
            assert!(err.contains(expected), "{err}");
        }
    }
}
