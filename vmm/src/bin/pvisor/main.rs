//! `pvisor`: run agent VMs whose idle memory goes back to the host.

mod client;
mod demo;
mod options;
mod replay;
mod run;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// Run microVMs with the built-in workload guest; suspend them to give their memory back
/// while they idle, and resume them fast.
#[derive(Debug, Parser)]
#[command(name = "pvisor", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// How to find a running VM: the job id alone (socket and attempt come from the runtime
/// directory), or the seed's long form with all three.
#[derive(Debug, Clone, Args)]
struct Target {
    /// The job id printed by `pvisor run`.
    job: String,
    /// The VM's control socket.
    #[arg(long = "vm-socket", value_name = "S")]
    socket: Option<PathBuf>,
    /// The job id again (long form; must match JOB).
    #[arg(long = "vm-job-id", value_name = "J")]
    job_id: Option<String>,
    /// The attempt id printed by `pvisor run`.
    #[arg(long = "vm-attempt-id", value_name = "A")]
    attempt: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Boot a VM and run a workload script in it (commands separated by `;`: fill SIZE
    /// repeated|random|zero [seed=N], digest, touch SIZE, rewrite PERCENT [seed=N], release,
    /// task, sleep MS, idle, model ID). The first line on stdout is the VM's identity as JSON. A script
    /// ending in `idle` keeps the VM alive until `pvisor stop`.
    Run(Box<options::RunArgs>),
    /// Show a VM's state.
    Status(Target),
    /// Show what a VM costs (PSS, guest-RAM PSS, store and cgroup bytes), its pager's counters,
    /// and what cold compression and KSM dedup did.
    Stats(Target),
    /// Stop a VM.
    Stop(Target),
    /// Run a workload script in a running VM; prints the results as JSON.
    Exec {
        #[command(flatten)]
        target: Target,
        /// The script.
        #[arg(last = true, required = true, value_name = "SCRIPT")]
        script: Vec<String>,
    },
    /// Pause a VM (RAM stays resident) or offload it (RAM moves to the store and is dropped).
    Suspend {
        #[command(flatten)]
        target: Target,
        /// Pause only.
        #[arg(
            long = "vm-pause",
            conflicts_with = "offload",
            required_unless_present = "offload"
        )]
        pause: bool,
        /// Pause and offload RAM (raw, or compressed if the VM runs with --vm-ram-compression).
        #[arg(long = "vm-offload")]
        offload: bool,
        /// After the offload, show the stored RAM image read-only as a plain file at P (through
        /// the store's FUSE view) until the VM resumes.
        #[arg(long = "vm-ram-file", value_name = "P", requires = "offload")]
        ram_file: Option<PathBuf>,
        /// Move the VM to an object store: offload it, write it to s3://BUCKET/PREFIX (RAM,
        /// vCPU, disk and a lease; the prefix must hold nothing yet), then stop it here.
        /// `pvisor run --restore s3://BUCKET/PREFIX` continues it on any host, once: the
        /// first restore takes the lease, later ones are refused, naming its holder.
        #[arg(
            long = "vm-offload-to",
            value_name = "s3://BUCKET/PREFIX",
            requires = "offload"
        )]
        offload_to: Option<String>,
        #[command(flatten)]
        remote: uffd_pager::remote_args::RemoteArgs,
    },
    /// Resume a paused or offloaded VM. An offloaded VM's RAM comes back lazily (faults
    /// plus background prefetch, the recorded working set first) unless --eager.
    Resume {
        #[command(flatten)]
        target: Target,
        /// Load RAM back (the seed's flag): lazily, the default, or with --eager all of it
        /// first (`resume … [--vm-load] [--eager]`).
        #[arg(long = "vm-load")]
        load: bool,
        /// Bring all RAM back before returning.
        #[arg(long)]
        eager: bool,
    },
    /// Write a sealed snapshot of a VM (RAM image, vCPU and disk; read-only, checksummed) to
    /// a new directory; the VM goes on. `pvisor run --restore DIR` continues it, as many times
    /// as wanted, sharing the image's memory copy-on-write.
    Snapshot {
        #[command(flatten)]
        target: Target,
        /// The snapshot's directory (must not exist), or s3://BUCKET/PREFIX (holding no
        /// snapshot yet): written in the cache, then uploaded, its manifest last; its RAM is
        /// kept in a store (lz4 unless --codec says otherwise) with the VM's working set.
        #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX")]
        out: String,
        #[command(flatten)]
        remote: uffd_pager::remote_args::RemoteArgs,
        /// Keep RAM compressed (lz4, zstd[:LEVEL]): far smaller on disk, but restored VMs load
        /// it lazily into their own memory instead of sharing the image's page cache.
        #[arg(long, value_name = "CODEC")]
        codec: Option<String>,
        /// The RAM store's block size (with --codec, or to an s3:// prefix): a power of two
        /// from 4 KiB to 2 MiB. It is what a lazy restore reads at a time (one range request
        /// from an object store): larger blocks mean fewer round trips for RAM read in long
        /// runs, and more bytes fetched for RAM touched here and there (docs/bench/remote.md).
        #[arg(long, value_name = "SIZE", default_value = "64KiB", value_parser = basics::parse_size)]
        block_size: u64,
    },
    /// Run a host daemon until SIGINT or SIGTERM; prints the socket's path once it listens.
    /// `--memory-pool`: pages that `pvisor run --vm-memory-pool SOCKET` VMs have in common
    /// are kept once and shared read-only, copied on write (docs/sharing.md; the same daemon
    /// as `uffd-pager serve --memory-pool`, whose code pages run from pvisor's binary are
    /// shared with the VMs'). `--memory-governor --memory-budget SIZE`: `pvisor run
    /// --vm-governor SOCKET` VMs are kept inside the budget together (docs/governor.md).
    Serve(serve::ServeArgs),
    /// Show the memory governor's status as JSON: budget, usage, each VM's state, resident
    /// bytes and limit, and its decisions.
    GovernorStatus {
        /// The governor's socket.
        #[arg(long, value_name = "PATH")]
        socket: PathBuf,
    },
    /// Replay a recorded agent run (model waits and tool phases) in N VMs at once against a
    /// local model server that answers after the recorded waits; check every result and
    /// report memory × time (guest-RAM PSS and cgroup memory, GiB·s per task), the completion
    /// window and throughput. Exit 1 if any check or the sampling's integrity failed.
    Replay(replay::ReplayArgs),
    /// Index a directory as a VM image (`pvisor run --vm-image DIR`): writes DIR/image.json,
    /// listing every regular file under DIR with its length and xxh3-128 (symbolic links
    /// and special files are left out, and said). Upload the directory to an s3:// prefix to
    /// serve it from an object store.
    ImageIndex {
        /// The image's root.
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
    /// Boot a 512 MiB VM, fill 64 MiB, and print its resident memory as it is, after an
    /// offload and after a compressed offload, with the digest checked after each resume.
    Demo(demo::DemoArgs),
    /// The VM process itself (started by `run --detach`; its spec, JSON, on stdin).
    #[command(name = "__vm", hide = true)]
    VmProcess,
    /// The detached VM's supervisor: starts `__vm`, waits for it, leaves its tombstone.
    #[command(name = "__supervise", hide = true)]
    Supervise,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let result = match cli.command {
        Command::Run(args) => run::run(*args),
        Command::VmProcess => vmm::detached::vm_process(),
        Command::Supervise => vmm::detached::supervise(),
        Command::Status(target) => client::status(&target),
        Command::Stats(target) => client::simple(&target, vmm::control::Method::Stats),
        Command::Stop(target) => client::simple(&target, vmm::control::Method::Stop),
        Command::Exec { target, script } => client::exec(&target, &script.join(" ")),
        Command::Suspend {
            target,
            offload,
            ram_file,
            offload_to,
            remote,
            ..
        } => client::suspend(
            &target,
            offload,
            ram_file.as_deref(),
            offload_to.as_deref(),
            &remote,
        ),
        Command::Resume { target, eager, .. } => client::resume(&target, eager),
        Command::Snapshot {
            target,
            out,
            remote,
            codec,
            block_size,
        } => client::snapshot(&target, &out, &remote, codec, block_size),
        Command::Serve(args) => serve::serve(&args),
        Command::GovernorStatus { socket } => serve::status(&socket),
        Command::Replay(args) => replay::replay(&args),
        Command::Demo(args) => demo::demo(&args),
        Command::ImageIndex { dir } => vmm::image::index(&dir)
            .map(|(manifest, left_out)| {
                for what in left_out {
                    eprintln!("pvisor: left out of the image: {what}");
                }
                let bytes: u64 = manifest.files.iter().map(|f| f.bytes).sum();
                println!(
                    "{}: {} files, {bytes} bytes",
                    dir.join(vmm::image::MANIFEST).display(),
                    manifest.files.len()
                );
                ExitCode::SUCCESS
            })
            .map_err(|e| basics::error_chain(&e).into()),
    };
    // Nobody reads the output any more (`… | head`): it ends quietly.
    basics::output::exit_code("pvisor: ", result)
}

/// The process's log: the libraries' `tracing` events on stderr, each line the message as
/// written (`pvisor …: …`), `info` and above unless `RUST_LOG` says otherwise
/// (`uffd_pager::logging`).
fn init_logging() {
    uffd_pager::logging::init(uffd_pager::logging::Style::Plain);
}

/// What a command returns.
type CliResult = Result<ExitCode, Box<dyn std::error::Error>>;
