//! `pvisor-sandboxd --listen 127.0.0.1:PORT --state DIR --memory-budget SIZE
//! --api-key-file F` (or `--no-auth`, loopback only): the sandbox daemon (docs/sandboxd.md).

use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use sandboxd::api::{self, App};
use sandboxd::governed::Governed;
use sandboxd::listener::{Bounded, FIRST_BYTE_TIMEOUT, MAX_CONNECTIONS};
use sandboxd::sandboxes::{Limits, Sandboxes};
use sandboxd::store::Store;
use vmm::detached;

/// Serve OpenSandbox's lifecycle API and a minimal execd; every sandbox is a pvisor VM
/// running the workload guest (template `pvisor:workload`).
#[derive(Debug, Parser)]
#[command(name = "pvisor-sandboxd", version, about, long_about = None, args_override_self = true)]
struct Cli {
    /// The address to serve on (`127.0.0.1:PORT`; port 0: any free one, printed at start).
    #[arg(long, value_name = "ADDR")]
    listen: SocketAddr,
    /// The state directory (created 0700): sandbox records and the VMs' files.
    #[arg(long, value_name = "DIR")]
    state: PathBuf,
    /// The memory all sandboxes' VMs may be charged together (their memory cgroups' usage,
    /// kept there by the memory governor). A create waits for room in it, then is refused
    /// (429).
    #[arg(long, value_name = "SIZE", value_parser = basics::parse_size)]
    memory_budget: u64,
    /// How long a create waits for room in the memory budget before it is refused: `30s`,
    /// `2m`; `0`: refused at once.
    #[arg(long, value_name = "TIME", default_value = "30s", value_parser = parse_idle)]
    admission_timeout: Duration,
    /// What a create leaves free in the memory budget, beyond what the sandboxes hold and
    /// cannot give back (each VM's floor, commands running), for commands to run in: about
    /// the working set of the largest command.
    #[arg(long, value_name = "SIZE", default_value = "128MiB", value_parser = basics::parse_size)]
    admission_reserve: u64,
    /// Guest RAM of each sandbox's VM of the workload guest (`pvisor:workload`); a snapshot
    /// template's VMs have the snapshot's.
    #[arg(long, value_name = "SIZE", default_value = "512MiB", value_parser = basics::parse_size)]
    vm_memory: u64,
    /// Serve a snapshot made with `pvisor snapshot --out DIR` (or `--out s3://…`) as the
    /// template NAME (`image.uri` or `snapshotId`): each sandbox of it is restored into its own
    /// RAM, loaded from there as its guest touches it (from a bucket through a cache under the
    /// state directory, credentials from the environment). Repeatable. The snapshot is read,
    /// never written: keep it while the daemon runs.
    #[arg(
        long,
        value_name = "NAME=DIR|s3://BUCKET/PREFIX",
        value_parser = sandboxd::templates::parse_template
    )]
    template: Vec<(String, compressed_backing::remote::StoreLocation)>,
    /// Sandboxes of a snapshot template mark their RAM mergeable for KSM: the pages they
    /// restored from the same snapshot and have not written are kept once, copy-on-write
    /// (ksmd is tuned to merge fast while any such VM runs, and the host's KSM settings
    /// come back when the last one ends).
    #[arg(long)]
    share_template_pages: bool,
    /// An origin the sandboxes' `download URL` commands may fetch from, http://HOST[:PORT]
    /// (repeatable; none: the sandboxes have no network). Plain HTTP, GET only; a download's
    /// wait between chunks is managed like any wait (docs/waits.md).
    #[arg(long, value_name = "ORIGIN")]
    sandbox_net_allow: Vec<String>,
    /// A read-only file tree the sandboxes' `read PATH` commands read: a directory holding
    /// `image.json` (`pvisor image-index DIR`), a prefix of an S3 bucket holding such a
    /// tree (`s3://BUCKET/PREFIX`; credentials from the environment, `AWS_ACCESS_KEY_ID` and
    /// `AWS_SECRET_ACCESS_KEY`), or the root of such a tree on a plain-HTTP server. Each
    /// file is fetched on its first read by any sandbox, checked against the manifest and
    /// staged under the state directory (`image-staging`), where every sandbox's later reads
    /// of it find it.
    #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX|http://HOST[:PORT]/PATH")]
    sandbox_image: Option<String>,
    /// The S3 endpoint of `s3://` templates and images (`http://127.0.0.1:9000` for a local
    /// S3-compatible server); by default `AWS_ENDPOINT_URL`, else AWS itself.
    #[arg(long, value_name = "URL")]
    s3_endpoint: Option<String>,
    /// Offload a running sandbox's memory once it has run no command for this long (it comes
    /// back on its next command; the client sees only latency): `30s`, `5m`; `0` never.
    /// Checked every tenth of this time (50 ms to 1 s); at most two offloads run at once.
    #[arg(long, value_name = "TIME", default_value = "60s", value_parser = parse_idle)]
    idle_offload: Duration,
    /// How a sandbox offloaded while idle comes back for its next command: `lazy`, each page
    /// read back as the command first touches it; `eager`, all its memory read back (in
    /// large reads, with the VM stopped) before the command starts, which then runs without
    /// faults; lazily still when the budget has no room for all of it at once.
    #[arg(long, value_enum, value_name = "lazy|eager", default_value = "lazy")]
    idle_resume: IdleResume,
    /// The file holding the API key clients send in `OPEN-SANDBOX-API-KEY`.
    #[arg(long, value_name = "F", required_unless_present = "no_auth")]
    api_key_file: Option<PathBuf>,
    /// Serve without an API key (only on a loopback address).
    #[arg(long, conflicts_with = "api_key_file")]
    no_auth: bool,
    /// `off`: the daemon takes no memory back, for comparison (its bench runs both): the VMs
    /// run in the budget's cgroup without the governor and without idle offload, and a
    /// create is admitted by what they are charged, all of which they keep.
    #[arg(long, value_name = "on|off", default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    memory_management: bool,
    /// The most requests the daemon takes a second, all clients and paths together (the key
    /// is checked after: a client without it counts too); past it, `429 RATE_LIMITED` with
    /// `Retry-After: 1`. `0`: no limit.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    max_request_rate: u32,
    /// Stop every sandbox's VM when the daemon is told to stop (SIGTERM, SIGINT); each
    /// becomes `Failed` (`DAEMON_STOPPED`). Without it the VMs run on, keeping their memory,
    /// and the next start on the same `--state` re-adopts them.
    #[arg(long)]
    stop_on_exit: bool,
}

use uffd_pager::socket::SOCKET_PATH_MAX;

/// Refuses a state directory so deep that its VMs' sockets could not be bound: each sandbox's
/// VM binds `STATE/vms/ID/control.sock` through a staging directory beside it, and a path
/// over [`SOCKET_PATH_MAX`] bytes would fail every sandbox's start, not the daemon's.
fn check_socket_depth(state: &std::path::Path) -> Result<(), String> {
    // The longest: a sandbox id, and the staging directory of a 7-digit pid's millionth bind.
    let deepest = state
        .join("vms")
        .join("sb-000000000000")
        .join(".sock-4194304-999999")
        .join("s");
    let len = deepest.as_os_str().len();
    if len > SOCKET_PATH_MAX {
        return Err(format!(
            "--state {}: too deep for the sandboxes' VMs to bind their sockets under it (paths \
             of up to {len} bytes, over the {SOCKET_PATH_MAX} a Unix socket's path may have): \
             give a state directory at most {} bytes long",
            state.display(),
            state.as_os_str().len() - (len - SOCKET_PATH_MAX)
        ));
    }
    Ok(())
}

/// `--idle-offload` and `--admission-timeout`: a whole number of seconds or minutes (`30s`,
/// `5m`; `0`: never, or not at all).
fn parse_idle(text: &str) -> Result<Duration, String> {
    let bad = || format!("`{text}`: expected seconds or minutes, as 30s or 5m (0: never)");
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?);
    let number: u64 = number.parse().map_err(|_| bad())?;
    match unit {
        "s" => Ok(Duration::from_secs(number)),
        "m" => number
            .checked_mul(60)
            .map(Duration::from_secs)
            .ok_or_else(bad),
        _ => Err(bad()),
    }
}

/// `--idle-resume`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum IdleResume {
    Lazy,
    Eager,
}

fn parse_on_off(text: &str) -> Result<bool, String> {
    match text {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("`{text}`: expected on or off")),
    }
}

type MainResult = Result<ExitCode, Box<dyn std::error::Error>>;

/// How long requests in flight (command streams) have to finish once the daemon is told to
/// stop, before it stops the VMs under them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The longest API key file.
const MAX_KEY_BYTES: u64 = 4096;

fn read_key(path: &Path) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let fail = |e: &dyn std::error::Error| format!("--api-key-file: {}", basics::error_chain(e));
    // A regular file (not a link, FIFO or device), read whole only if it is small.
    let mut file = compressed_backing::file::open_read(path).map_err(|e| fail(&e))?;
    let meta = file.metadata().map_err(|e| fail(&e))?;
    // Whoever can read the key can run commands in every sandbox, and so read its memory: as
    // for a store's key (`--store-key`), the file must be this user's and private to it.
    // SAFETY: geteuid cannot fail.
    let own = unsafe { libc::geteuid() };
    if meta.uid() != own || meta.mode() & 0o077 != 0 {
        return Err(format!(
            "--api-key-file {}: must be owned by uid {own} and readable by it alone (it is uid {}, \
             mode {:o}): chmod 600 it",
            path.display(),
            meta.uid(),
            meta.mode() & 0o7777
        )
        .into());
    }
    let bytes = compressed_backing::file::read_to_end_bounded(&mut file, path, MAX_KEY_BYTES)
        .map_err(|e| fail(&e))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| format!("--api-key-file {}: not text", path.display()))?;
    let key = text.trim();
    if key.is_empty() || key.chars().any(|c| c.is_control()) {
        return Err(format!(
            "--api-key-file {}: the key must be one non-empty line",
            path.display()
        )
        .into());
    }
    Ok(key.as_bytes().to_vec())
}

fn serve(cli: Cli) -> MainResult {
    let api_key = match (&cli.api_key_file, cli.no_auth) {
        (Some(path), false) => Some(read_key(path)?),
        (None, true) if cli.listen.ip().is_loopback() => None,
        (None, true) => {
            return Err(format!(
                "--no-auth serves only on a loopback address, not {}",
                cli.listen
            )
            .into())
        }
        _ => return Err("give --api-key-file F, or --no-auth on a loopback address".into()),
    };
    // A VM's guest RAM may pass the budget: the governor keeps what is resident inside it.
    if cli.vm_memory == 0 {
        return Err("--vm-memory must be more than 0".into());
    }
    if cli.admission_reserve >= cli.memory_budget {
        return Err("--admission-reserve must be less than --memory-budget".into());
    }
    let state = std::path::absolute(&cli.state).map_err(|e| format!("--state: {e}"))?;
    check_socket_depth(&state)?;
    let remote = remote_options(cli.s3_endpoint.clone(), &state);
    let templates = sandboxd::templates::Templates::new(cli.vm_memory, &cli.template, &remote)?;
    let store = Store::open(&cli.state)?;
    let state_dir = cli.state.clone();
    // The sandboxes' VMs keep their sockets and files under the state directory. Set before
    // any thread starts; the VM processes inherit it.
    std::env::set_var("PVISOR_RUNTIME_DIR", store.vms_dir());
    vmm::runtime::ensure_runtime_dir()?;
    // The VMs' budget cgroup and their governor, before any VM (re-adopted ones included)
    // needs them.
    let governed = Governed::start(&cli.state, cli.memory_budget)?;
    let image = match &cli.sandbox_image {
        // Staged once for every sandbox: the first to read a file fetches it.
        Some(text) => Some(vmm::image::ImageOptions {
            at: sandbox_image(text, &remote)?,
            staging: state.join("image-staging"),
            rate: None,
        }),
        None => None,
    };
    let limits = Limits {
        admission_timeout: cli.admission_timeout,
        admission_reserve: cli.admission_reserve,
        idle_offload: (cli.memory_management && !cli.idle_offload.is_zero())
            .then_some(cli.idle_offload),
        eager_idle_resume: cli.idle_resume == IdleResume::Eager,
        managed: cli.memory_management,
        share_template_pages: cli.share_template_pages,
        net: vmm::net::NetOptions {
            allow: vmm::net::Allow::parse(&cli.sandbox_net_allow)
                .map_err(|e| e.replace("--vm-net-allow", "--sandbox-net-allow"))?,
            ..vmm::net::NetOptions::default()
        },
        image,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("sandboxd")
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(cli.listen).await?;
        let bound = listener.local_addr()?;
        let sandboxes = Arc::new(
            tokio::task::spawn_blocking(move || {
                Sandboxes::load(store, limits, governed, templates)
            })
            .await?,
        );
        sandboxes.start_pending();
        let app = Arc::new(App {
            sandboxes: Arc::clone(&sandboxes),
            api_key,
            public: bound.to_string(),
            rate: (cli.max_request_rate > 0)
                .then(|| basics::RateLimit::new(cli.max_request_rate, Duration::from_secs(1))),
        });
        let ticker = {
            let sandboxes = Arc::clone(&sandboxes);
            tokio::spawn(async move {
                let mut every = tokio::time::interval(Duration::from_secs(1));
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    every.tick().await;
                    sandboxes.tick().await;
                }
            })
        };
        // Idle offload on a clock of its own: the second's tick may wait on an expiry.
        let idler = sandboxes.idle_check_period().map(|period| {
            let sandboxes = Arc::clone(&sandboxes);
            tokio::spawn(async move {
                let mut every = tokio::time::interval(period);
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    every.tick().await;
                    sandboxes.offload_idle().await;
                }
            })
        });
        tracing::info!(
            "pvisor-sandboxd: listening on {bound} (auth {})",
            if app.api_key.is_some() { "on" } else { "off" }
        );
        // The readiness line: the address, for whoever started it with port 0.
        basics::announce!("{}", serde_json::json!({ "listen": bound.to_string() }));
        let listener = Bounded::new(listener, MAX_CONNECTIONS, FIRST_BYTE_TIMEOUT);
        let stopping = Arc::new(tokio::sync::Notify::new());
        let signal = {
            let stopping = Arc::clone(&stopping);
            async move {
                shutdown().await;
                stopping.notify_one();
            }
        };
        let server = axum::serve(listener, api::router(app)).with_graceful_shutdown(signal);
        // Requests in flight get a while to finish, not forever: a command may run for hours.
        tokio::select! {
            served = server => served?,
            () = async {
                stopping.notified().await;
                tokio::time::sleep(SHUTDOWN_GRACE).await;
            } => {
                tracing::warn!(
                    "requests still in flight {} s after the stop signal: stopping the VMs anyway",
                    SHUTDOWN_GRACE.as_secs()
                );
            }
        }
        ticker.abort();
        if let Some(idler) = idler {
            idler.abort();
        }
        if cli.stop_on_exit {
            sandboxes.shutdown().await;
            sandboxes.stop_governor(true);
            tracing::info!("pvisor-sandboxd: stopped, and its sandboxes' VMs");
        } else {
            // An empty budget cgroup goes; one with VMs in it waits for the next daemon.
            sandboxes.stop_governor(sandboxes.live() == 0);
            tracing::info!(
                "pvisor-sandboxd: stopped; {} live sandboxes run on, and the next start on {} \
                 re-adopts them",
                sandboxes.live(),
                state_dir.display()
            );
        }
        Ok(ExitCode::SUCCESS)
    })
}

/// Resolves at SIGTERM or SIGINT.
async fn shutdown() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("cannot catch SIGTERM/SIGINT: stop with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("pvisor-sandboxd: stopping");
}

fn main() -> ExitCode {
    // The sandboxes' VM processes are this program run again (`vmm::detached`).
    let hidden = std::env::args_os().nth(1);
    let result = match hidden.as_ref().and_then(|a| a.to_str()) {
        Some(detached::SUPERVISE_ARG) => {
            uffd_pager::logging::init(uffd_pager::logging::Style::Plain);
            detached::supervise()
        }
        Some(detached::VM_ARG) => {
            uffd_pager::logging::init(uffd_pager::logging::Style::Plain);
            detached::vm_process()
        }
        _ => {
            let cli = Cli::parse();
            uffd_pager::logging::init(uffd_pager::logging::Style::Full);
            serve(cli)
        }
    };
    basics::output::exit_code("pvisor-sandboxd: ", result)
}

/// How the daemon and its VMs reach an object store: at `endpoint` (else the environment's),
/// caching what they fetch under the state directory `state` (absolute).
fn remote_options(
    endpoint: Option<String>,
    state: &std::path::Path,
) -> compressed_backing::remote::RemoteOptions {
    let mut options = compressed_backing::remote::RemoteOptions::new();
    options.endpoint = endpoint;
    options.cache_dir = state.join("s3-cache");
    options
}

/// The image `--sandbox-image` names, its manifest read and checked now: a daemon whose
/// sandboxes could not read it says so at once.
fn sandbox_image(
    text: &str,
    remote: &compressed_backing::remote::RemoteOptions,
) -> Result<vmm::image::ImageLocation, String> {
    let at = vmm::image::ImageLocation::parse(text, remote)
        .map_err(|e| format!("--sandbox-image: {e}"))?;
    at.manifest()
        .map_err(|e| format!("--sandbox-image: {}", basics::error_chain(&e)))?;
    Ok(at)
}
