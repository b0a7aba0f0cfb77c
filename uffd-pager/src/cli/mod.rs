//! Command-line parsing and dispatch.

mod demo;
mod keeper;
mod serve;
mod store;

use std::error::Error;
use std::path::PathBuf;
use std::process::ExitCode;

use basics::parse_size;
use clap::{Parser, Subcommand};
use compressed_backing::remote::StoreLocation;
use compressed_backing::{BlockSize, Codec};
pub(crate) use uffd_pager::remote_args::RemoteArgs;

/// What a command returns: its exit code, or an error printed with all its causes.
pub(crate) type CliResult = Result<ExitCode, Box<dyn Error>>;

/// Userfaultfd lazy memory service for microVMs, with a compressed block store.
#[derive(Debug, Parser)]
#[command(name = "uffd-pager", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Pack a raw RAM file (e.g. a Firecracker snapshot memory file) into a store.
    ///
    /// Creates the store if DIR holds none; otherwise replaces its image (same block size)
    /// and reclaims the old one. The new image is committed only when complete.
    Pack {
        /// The raw memory file to read.
        #[arg(long, value_name = "RAW")]
        mem_file: PathBuf,
        /// The store: a directory, or s3://BUCKET/PREFIX (packed in the cache, then uploaded:
        /// the chunks first, the index last, so the previous image stays whole until then).
        #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX")]
        store: StoreLocation,
        #[command(flatten)]
        remote: RemoteArgs,
        /// Codec: none, lz4 (fast, default) or zstd[:LEVEL] (smaller).
        #[arg(long)]
        codec: Option<Codec>,
        /// Block size, a power of two from 4KiB to 2MiB (default 64KiB).
        #[arg(long, value_name = "N")]
        block_size: Option<BlockSize>,
        /// The most bytes of one segment of a new store: one chunk object in an object
        /// store, put in parts of 8 MiB, four at once (from 1 MiB to 1 GiB; default 64 MiB,
        /// docs/bench/remote-sizes.md says why).
        #[arg(long, value_name = "SIZE", value_parser = parse_chunk_size)]
        chunk_size: Option<u64>,
        /// Compression threads (default: all cores).
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Write a store's image back to a raw file (sparse where blocks are zero).
    Unpack {
        /// The store directory.
        #[arg(long, value_name = "DIR")]
        store: PathBuf,
        /// The raw file to write; it appears only when complete.
        #[arg(long, value_name = "RAW")]
        out: PathBuf,
        /// Decompression threads (default: all cores).
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
    },
    /// Read and check every block: checksums and decompression. Exits 1 if any block is bad.
    Verify {
        /// The store: a directory, or s3://BUCKET/PREFIX (every block is fetched).
        #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX")]
        store: StoreLocation,
        #[command(flatten)]
        remote: RemoteArgs,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Show a store's blocks, sizes and compression ratio.
    Info {
        /// The store: a directory, or s3://BUCKET/PREFIX (only its index is fetched).
        #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX")]
        store: StoreLocation,
        #[command(flatten)]
        remote: RemoteArgs,
        /// Print one JSON object (keys include raw_bytes, stored_bytes, disk_bytes, ratio).
        #[arg(long)]
        json: bool,
    },
    /// Show what the store does: pack a VM-shaped RAM image (program code, 64 MiB of repeated
    /// and 64 MiB of random application data, untouched memory) with every codec, verify and
    /// unpack each, serve the compressed one through the FUSE view, and print the table.
    Demo {
        /// Size of the RAM image (KiB/MiB/GiB suffixes).
        #[arg(long, default_value = "512MiB", value_parser = parse_size)]
        size: u64,
        /// Keep the files in this directory instead of a temporary one.
        #[arg(long, value_name = "DIR")]
        keep: Option<PathBuf>,
    },
    /// Serve the guest memory of VMMs that hand over their userfaultfd with Firecracker's UFFD
    /// handshake (a JSON array of regions plus the uffd over SCM_RIGHTS), from a raw memory
    /// file or a compressed store, any number of VMs at once. With --memory-pool, serve the
    /// memory pool instead: pages that `pvisor run --vm-memory-pool SOCKET` VMs have in
    /// common are kept once and shared read-only (docs/sharing.md). Runs until SIGINT or
    /// SIGTERM.
    Serve {
        /// The Unix socket to listen on (a stale one is replaced).
        #[arg(long, value_name = "PATH")]
        socket: PathBuf,
        /// Serve from this raw memory file (e.g. a Firecracker snapshot memory file).
        #[arg(
            long,
            value_name = "FILE",
            conflicts_with_all = ["store", "memory_pool"],
            required_unless_present_any = ["store", "memory_pool"]
        )]
        mem_file: Option<PathBuf>,
        /// Run the memory pool for pvisor VMs instead of serving a memory image.
        #[arg(long, conflicts_with = "store")]
        memory_pool: bool,
        /// Serve from this store (made with `pack`): a directory, or s3://BUCKET/PREFIX, whose
        /// blocks are fetched as the guest faults them, through the cache.
        #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX")]
        store: Option<StoreLocation>,
        #[command(flatten)]
        remote: RemoteArgs,
        /// Fault-serving threads per VM.
        #[arg(long, default_value_t = 1, value_name = "N")]
        threads: usize,
        /// Also serve peers running as this uid (repeatable; e.g. Firecracker under its
        /// jailer). Peers of the server's own uid are always served, others are refused
        /// (`SO_PEERCRED`). The socket stays 0600: give the uid access to it (chown, an ACL).
        #[arg(long, value_name = "UID")]
        allow_uid: Vec<u32>,
        /// Also serve peers whose primary group is this gid (repeatable).
        #[arg(long, value_name = "GID")]
        allow_gid: Vec<u32>,
        /// Hand every VM to the keeper listening on this socket (`uffd-pager keeper`), take
        /// over those it already holds at start, and on SIGTERM leave them to the next server
        /// instead of serving them until they leave (docs/pager.md, "Restarting the server").
        /// If the keeper holds the socket VMMs connect to (`keeper --listen`), the server
        /// accepts on it; --socket must then name it.
        #[arg(long, value_name = "PATH", conflicts_with = "memory_pool")]
        keeper: Option<PathBuf>,
    },
    /// Hold what must outlive `serve --keeper` for each of its VMs (the VMM's connection, its
    /// userfaultfd, the page-state journal), so that a server killed or upgraded can be
    /// restarted without freezing them. Never touches guest memory. Runs until SIGINT or
    /// SIGTERM.
    Keeper {
        /// The Unix socket to listen on (private to this user).
        #[arg(long, value_name = "PATH")]
        socket: PathBuf,
        /// Also hold the socket VMMs connect to (give the servers the same path as --socket):
        /// each server attached takes it from the keeper instead of binding its own, so a VMM
        /// that connects while no server runs, or while one restarts, waits for the next
        /// server instead of failing to connect.
        #[arg(long, value_name = "PATH")]
        listen: Option<PathBuf>,
    },
    /// Mount a store so its image appears as one plain file (MOUNTPOINT/ram) that any VMM can
    /// read, write or mmap. Runs until SIGINT or SIGTERM, then writes back, commits and
    /// unmounts.
    Mount {
        /// The store directory.
        #[arg(long, value_name = "DIR")]
        store: PathBuf,
        /// An existing empty directory to mount on.
        mountpoint: PathBuf,
        /// Name of the image file inside the mount.
        #[arg(long, default_value = "ram")]
        file_name: String,
        /// Decompressed blocks kept in memory.
        #[arg(long, default_value_t = 256)]
        cache_blocks: usize,
        /// Let other users access the mount.
        #[arg(long)]
        allow_other: bool,
    },
}

/// A `--chunk-size`: from 1 MiB to 1 GiB.
fn parse_chunk_size(text: &str) -> Result<u64, String> {
    let size = parse_size(text).map_err(|e| e.to_string())?;
    if !(1 << 20..=1 << 30).contains(&size) {
        return Err(format!("{text} is outside 1MiB..=1GiB"));
    }
    Ok(size)
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> CliResult {
    match cli.command {
        Command::Pack {
            mem_file,
            store,
            remote,
            codec,
            block_size,
            chunk_size,
            threads,
            json,
        } => {
            let options = compressed_backing::image::PackOptions {
                codec: codec.map(compressed_backing::CodecConfig::new),
                block_size,
                bulk: store::bulk_options(threads),
                segment_bytes: chunk_size,
            };
            store::pack(&mem_file, &store, &remote, &options, json)
        }
        Command::Unpack {
            store,
            out,
            threads,
        } => store::unpack(&store, &out, threads),
        Command::Verify {
            store,
            remote,
            json,
        } => store::verify(&store, &remote, json),
        Command::Info {
            store,
            remote,
            json,
        } => store::info(&store, &remote, json),
        Command::Serve {
            socket,
            memory_pool: true,
            allow_uid,
            allow_gid,
            ..
        } => serve::memory_pool(
            &socket,
            uffd_pager::socket::PeerPolicy {
                uids: allow_uid,
                gids: allow_gid,
            },
        ),
        Command::Serve {
            socket,
            mem_file,
            store,
            remote,
            threads,
            allow_uid,
            allow_gid,
            keeper,
            ..
        } => serve::serve(
            &socket,
            mem_file.as_deref(),
            store.as_ref(),
            &remote,
            threads,
            uffd_pager::socket::PeerPolicy {
                uids: allow_uid,
                gids: allow_gid,
            },
            keeper.as_deref(),
        ),
        Command::Keeper { socket, listen } => keeper::keeper(&socket, listen.as_deref()),
        Command::Demo { size, keep } => demo::demo(size, keep.as_deref()),
        Command::Mount {
            store,
            mountpoint,
            file_name,
            cache_blocks,
            allow_other,
        } => store::mount(&store, &mountpoint, file_name, cache_blocks, allow_other),
    }
}
