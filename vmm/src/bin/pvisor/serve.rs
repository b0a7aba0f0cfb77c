//! `pvisor serve`: the host daemons, the memory pool or the memory governor.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use uffd_pager::socket::PeerPolicy;
use vmm::governor::{policy, server};
use vmm::stats::PressureLevel;

use crate::CliResult;

/// Options of `pvisor serve`.
#[derive(Debug, Clone, Args)]
#[command(group(clap::ArgGroup::new("service").required(true).args(["memory_pool", "memory_governor"])))]
pub struct ServeArgs {
    /// Serve the memory pool: pages that `pvisor run --vm-memory-pool SOCKET` VMs have in
    /// common are kept once and shared read-only, copied on write (docs/sharing.md).
    #[arg(long)]
    pub memory_pool: bool,
    /// Serve the memory governor: `pvisor run --vm-governor SOCKET` VMs are kept inside
    /// --memory-budget together (docs/governor.md).
    #[arg(long, requires = "memory_budget")]
    pub memory_governor: bool,
    /// The Unix socket to listen on (a stale one is replaced; mode 0600 from its creation).
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    /// Also let processes running as this uid in (repeatable). The daemon's own uid is always
    /// let in, others are refused (`SO_PEERCRED`). The socket stays 0600: give the uid access
    /// to it (chown, an ACL).
    #[arg(long, value_name = "UID")]
    pub allow_uid: Vec<u32>,
    /// Also let processes whose primary group is this gid in (repeatable).
    #[arg(long, value_name = "GID")]
    pub allow_gid: Vec<u32>,
    /// The governor: memory all its VMs may use together (e.g. 1GiB).
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<String>,
    /// The governor: keep usage under this share of the budget (0.9).
    #[arg(long, value_name = "SHARE")]
    pub high_watermark: Option<f64>,
    /// The governor: once over the high watermark, reclaim down to this share (0.8).
    #[arg(long, value_name = "SHARE")]
    pub low_watermark: Option<f64>,
    /// The governor: the least a VM's limit grows by when its faults are held (16MiB).
    #[arg(long, value_name = "SIZE")]
    pub grant: Option<String>,
    /// The governor: whether a grant also raises a VM's limit up to the most it has held, where
    /// that fits (true: a VM back from an offload gets its step's room in one grant; false:
    /// grants of --grant each).
    #[arg(long, value_name = "BOOL")]
    pub grant_to_peak: Option<bool>,
    /// The governor: the resident limit a joining VM gets when it fits (64MiB).
    #[arg(long, value_name = "SIZE")]
    pub initial_limit: Option<String>,
    /// The governor: what a VM costs besides its guest RAM until its cgroup is read (24MiB).
    #[arg(long, value_name = "SIZE")]
    pub default_overhead: Option<String>,
    /// The governor: how often cgroups and pressure are read, milliseconds (100).
    #[arg(long, value_name = "MS")]
    pub tick_ms: Option<u64>,
    /// The governor: a VM silent this long is counted at its last reading and never asked
    /// to give memory back, milliseconds (5000).
    #[arg(long, value_name = "MS")]
    pub stale_ms: Option<u64>,
    /// The governor: an offload order not answered in this time may go to another VM,
    /// milliseconds (10000).
    #[arg(long, value_name = "MS")]
    pub order_timeout_ms: Option<u64>,
    /// The governor: the cold age asked of running VMs' cold compression under pressure,
    /// milliseconds (500).
    #[arg(long, value_name = "MS")]
    pub pressure_cold_age_ms: Option<u64>,
    /// The governor: the memory cgroup all its VMs live under, if any: its usage is the
    /// measured total and its failures count as pressure.
    #[arg(long, value_name = "DIR")]
    pub budget_cgroup: Option<PathBuf>,
    /// The governor: memory PSI `some avg10` (percent) above which the host is under pressure
    /// (the budget cgroup's own on cgroup v2, the system's otherwise) (10).
    #[arg(long, value_name = "PERCENT")]
    pub psi_threshold: Option<f64>,
    /// The governor, cgroup v1: the kernel's memory pressure notifications of the budget
    /// cgroup count as pressure from this level up: low (any reclaim), medium (reclaim that
    /// finds little to take), critical (an OOM kill is near) (medium).
    #[arg(long, value_name = "LEVEL")]
    pub pressure_level: Option<PressureLevel>,
    /// The governor: a waiting or idle VM's limit this far above its resident is a
    /// reservation taken back when room is needed (16MiB).
    #[arg(long, value_name = "SIZE")]
    pub revoke_slack: Option<String>,
    /// The governor: when nothing is left to reclaim, the first queued request may be granted
    /// beyond the high watermark up to this share of the budget (0.95).
    #[arg(long, value_name = "SHARE")]
    pub last_resort_watermark: Option<f64>,
    /// The governor: a VM's overhead (cgroup usage beyond its guest RAM) is the largest seen
    /// over this long, milliseconds (5000).
    #[arg(long, value_name = "MS")]
    pub overhead_window_ms: Option<u64>,
    /// The governor: the remaining wait counted for a waiting VM that gives none, for the
    /// order in which waiting VMs are offloaded, milliseconds (10000).
    #[arg(long, value_name = "MS")]
    pub unknown_wait_ms: Option<u64>,
    /// The governor: while another VM runs unheld (its step will end in a wait that frees
    /// its RAM), a VM held at its faults is preempted for the oldest queued request only
    /// once that request has waited this long, milliseconds (1000).
    #[arg(long, value_name = "MS")]
    pub preempt_wait_ms: Option<u64>,
}

fn size(flag: &str, text: Option<&str>, default: u64) -> Result<u64, String> {
    match text {
        None => Ok(default),
        Some(text) => match basics::parse_size(text) {
            Ok(0) => Err(format!("{flag} {text}: must be more than 0")),
            Ok(bytes) => Ok(bytes),
            Err(e) => Err(format!("{flag} {text}: {e}")),
        },
    }
}

/// The governor's configuration from the flags (checked).
pub fn governor_config(args: &ServeArgs) -> Result<server::ServerConfig, String> {
    let budget = size("--memory-budget", args.memory_budget.as_deref(), 0)?;
    let defaults = policy::Config {
        budget,
        ..policy::Config::default()
    };
    let ms = |value: Option<u64>, default: Duration| value.map_or(default, Duration::from_millis);
    let config = policy::Config {
        high_watermark: args.high_watermark.unwrap_or(defaults.high_watermark),
        low_watermark: args.low_watermark.unwrap_or(defaults.low_watermark),
        grant: size("--grant", args.grant.as_deref(), defaults.grant)?,
        grant_to_peak: args.grant_to_peak.unwrap_or(defaults.grant_to_peak),
        initial_limit: size(
            "--initial-limit",
            args.initial_limit.as_deref(),
            defaults.initial_limit,
        )?,
        default_overhead: size(
            "--default-overhead",
            args.default_overhead.as_deref(),
            defaults.default_overhead,
        )?,
        stale_after: ms(args.stale_ms, defaults.stale_after),
        order_timeout: ms(args.order_timeout_ms, defaults.order_timeout),
        pressure_cold_age: ms(args.pressure_cold_age_ms, defaults.pressure_cold_age),
        psi_threshold: args.psi_threshold.unwrap_or(defaults.psi_threshold),
        revoke_slack: size(
            "--revoke-slack",
            args.revoke_slack.as_deref(),
            defaults.revoke_slack,
        )?,
        last_resort_watermark: args
            .last_resort_watermark
            .unwrap_or(defaults.last_resort_watermark),
        overhead_window: ms(args.overhead_window_ms, defaults.overhead_window),
        unknown_wait: ms(args.unknown_wait_ms, defaults.unknown_wait),
        preempt_wait: ms(args.preempt_wait_ms, defaults.preempt_wait),
        ..defaults
    };
    config.check()?;
    let tick = ms(args.tick_ms, Duration::from_millis(100));
    Ok(server::ServerConfig {
        policy: config,
        tick,
        budget_cgroup: args.budget_cgroup.clone(),
        pressure_level: args.pressure_level.unwrap_or_default(),
        peers: PeerPolicy {
            uids: args.allow_uid.clone(),
            gids: args.allow_gid.clone(),
        },
    })
}

/// `pvisor serve`.
pub fn serve(args: &ServeArgs) -> CliResult {
    let peers = PeerPolicy {
        uids: args.allow_uid.clone(),
        gids: args.allow_gid.clone(),
    };
    if args.memory_pool {
        // (clap's `requires` counts a flag's default as given: checked here.)
        let governor_only = [
            ("--memory-budget", args.memory_budget.is_some()),
            ("--high-watermark", args.high_watermark.is_some()),
            ("--low-watermark", args.low_watermark.is_some()),
            ("--grant", args.grant.is_some()),
            ("--grant-to-peak", args.grant_to_peak.is_some()),
            ("--initial-limit", args.initial_limit.is_some()),
            ("--default-overhead", args.default_overhead.is_some()),
            ("--tick-ms", args.tick_ms.is_some()),
            ("--stale-ms", args.stale_ms.is_some()),
            ("--order-timeout-ms", args.order_timeout_ms.is_some()),
            (
                "--pressure-cold-age-ms",
                args.pressure_cold_age_ms.is_some(),
            ),
            ("--budget-cgroup", args.budget_cgroup.is_some()),
            ("--psi-threshold", args.psi_threshold.is_some()),
            ("--pressure-level", args.pressure_level.is_some()),
            ("--revoke-slack", args.revoke_slack.is_some()),
            (
                "--last-resort-watermark",
                args.last_resort_watermark.is_some(),
            ),
            ("--overhead-window-ms", args.overhead_window_ms.is_some()),
            ("--unknown-wait-ms", args.unknown_wait_ms.is_some()),
            ("--preempt-wait-ms", args.preempt_wait_ms.is_some()),
        ];
        if let Some((flag, _)) = governor_only.iter().find(|(_, given)| *given) {
            return Err(
                format!("{flag} is an option of --memory-governor, not --memory-pool").into(),
            );
        }
        uffd_pager::sharing::run_daemon_with(&args.socket, peers)?;
        return Ok(ExitCode::SUCCESS);
    }
    let config = governor_config(args)?;
    eprintln!(
        "pvisor governor: budget {}, watermarks {:.0}%/{:.0}%",
        basics::size_text(config.policy.budget),
        config.policy.high_watermark * 100.0,
        config.policy.low_watermark * 100.0
    );
    server::run_daemon(&args.socket, config)?;
    Ok(ExitCode::SUCCESS)
}

/// `pvisor governor-status`.
pub fn status(socket: &std::path::Path) -> CliResult {
    let status = server::query_status(socket, Duration::from_secs(5))?;
    basics::say!("{}", serde_json::to_string_pretty(&status)?);
    Ok(ExitCode::SUCCESS)
}
