//! `ksm-advisor`: KSM status, tuning, advice and savings estimates from the command line.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ksm_advisor::estimate::{self, Target};
use ksm_advisor::process;
use ksm_advisor::sys::{self, Ksm};
use ksm_advisor::tune::{self, Profile, Released, Tuning, DEFAULT_STATE_DIR};

/// KSM (kernel samepage merging) for VM memory: see what it merges, tune it for fast merging
/// within a CPU budget and restore the host's settings afterwards, make programs' memory
/// mergeable, and estimate what merging would save before switching it on.
#[derive(Debug, Parser)]
#[command(name = "ksm-advisor", version)]
struct Cli {
    /// Where tuning leases and the host's saved settings are kept.
    #[arg(long, global = true, value_name = "DIR", default_value = DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// KSM's settings and counters, ksmd's CPU time, who holds the tuning; with --pid, what KSM
    /// merged in those processes and how much of their memory is marked mergeable.
    Status {
        /// A process to report on (repeatable).
        #[arg(long, value_name = "PID")]
        pid: Vec<u32>,
    },
    /// Tune KSM for fast merging and hold the tuning until interrupted (Ctrl-C, SIGTERM) or
    /// until the process given by --until-exit ends; the last holder to go restores the
    /// host's previous settings. With --restore, restore them now.
    Tune {
        /// Share of one core ksmd may use while it merges (0 < SHARE ≤ 1).
        #[arg(long, value_name = "SHARE", default_value_t = 0.5)]
        cpu_budget: f64,
        /// Let the kernel's scan-time advisor size each scan within the budget instead of a
        /// fixed number of pages (kernels 6.7 and later).
        #[arg(long)]
        advisor: bool,
        /// Hold the tuning until this process exits (e.g. a VMM's pid).
        #[arg(long, value_name = "PID", conflicts_with = "restore")]
        until_exit: Option<u32>,
        /// Restore the settings saved before the first tuning, now.
        #[arg(long)]
        restore: bool,
        /// With --restore: even while VMs still hold the tuning.
        #[arg(long, requires = "restore")]
        force: bool,
    },
    /// Run a program with all of its private memory mergeable (PR_SET_MEMORY_MERGE, kept
    /// across exec: e.g. a VMM that does not advise its guest RAM itself); or, with --pid,
    /// check how much of a process's memory is marked mergeable.
    Advise {
        /// Check this process instead of running a program.
        #[arg(long, value_name = "PID", conflicts_with = "command")]
        pid: Option<u32>,
        /// The program and its arguments.
        #[arg(last = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
    /// Estimate what KSM would free in these processes' resident mergeable memory, from
    /// content-sampled page hashes (reads memory, changes nothing).
    Estimate {
        /// A process to include (repeatable); duplicates across them count.
        #[arg(long, value_name = "PID", required = true)]
        pid: Vec<u32>,
        /// Sample one page in RATE by content (1: every page).
        #[arg(long, value_name = "RATE", default_value_t = 16)]
        rate: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Nobody reads the output any more (`… | head`): it ends quietly.
    basics::output::exit_code("ksm-advisor: error: ", run(cli))
}

type Error = Box<dyn std::error::Error>;

fn run(cli: Cli) -> Result<ExitCode, Error> {
    match cli.command {
        Command::Status { pid } => status(&cli.state_dir, &pid, cli.json),
        Command::Tune {
            cpu_budget,
            advisor,
            until_exit,
            restore,
            force,
        } => {
            let ksm = Ksm::system()?;
            if restore {
                match tune::restore(&ksm, &cli.state_dir, force)? {
                    Some(knobs) => basics::say!("restored: {}", line(&knobs)),
                    None => basics::say!("nothing to restore: KSM was not tuned by ksm-advisor"),
                }
                return Ok(ExitCode::SUCCESS);
            }
            if !(cpu_budget > 0.0 && cpu_budget <= 1.0) {
                return Err("--cpu-budget is a share of one core, above 0 and at most 1".into());
            }
            let profile = profile(cpu_budget, advisor, &ksm)?;
            hold(&ksm, &cli.state_dir, &profile, until_exit)
        }
        Command::Advise { pid: Some(pid), .. } => {
            let mut advised = 0;
            let mut eligible = 0;
            for m in process::mappings(Some(pid))? {
                if m.ineligible().is_none() {
                    eligible += m.end - m.start;
                    if m.has("mg") {
                        advised += m.end - m.start;
                    }
                }
            }
            let stat = process::ksm_stat(Some(pid))?;
            if cli.json {
                basics::say!(
                    "{}",
                    serde_json::json!({"pid": pid, "eligible_bytes": eligible,
                        "advised_bytes": advised, "ksm": stat})
                );
            } else {
                basics::say!(
                    "pid {pid}: {} of {} of private memory is marked mergeable{}; {} pages merged",
                    mib(advised),
                    mib(eligible),
                    if stat.merge_any {
                        " (whole process)"
                    } else {
                        ""
                    },
                    stat.merging_pages
                );
            }
            Ok(if advised > 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Advise { pid: None, command } => {
            let (program, args) = command
                .split_first()
                .ok_or("give a program to run after `--`, or --pid to check a process")?;
            process::merge_whole_process()?;
            let err = std::process::Command::new(program).args(args).exec();
            Err(format!("cannot run {program}: {err}").into())
        }
        Command::Estimate { pid, rate } => {
            let targets: Vec<Target> = pid
                .iter()
                .map(|&pid| Target {
                    pid,
                    ranges: Vec::new(),
                })
                .collect();
            let found = estimate::estimate(&targets, rate)?;
            if cli.json {
                basics::say!("{}", serde_json::to_string(&found)?);
            } else {
                basics::say!(
                    "{} resident in mergeable memory; KSM would free about {} ({:.1}%) \
                     (sampled {} pages, 1 in {} by content)",
                    mib(found.resident_pages * 4096),
                    mib(found.saving_bytes),
                    found.saving_share * 100.0,
                    found.sampled_pages,
                    found.rate
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn profile(cpu_budget: f64, advisor: bool, ksm: &Ksm) -> Result<Profile, Error> {
    let mut profile = Profile::for_cpu_share(cpu_budget);
    if advisor {
        if !ksm.has("advisor_mode") {
            return Err("this kernel has no scan-time advisor (Linux 6.7 or later)".into());
        }
        profile.advisor = Some(tune::AdvisorProfile::for_cpu_share(cpu_budget));
    }
    Ok(profile)
}

/// Applies the profile and holds it until a signal or the watched process's exit.
fn hold(
    ksm: &Ksm,
    state_dir: &std::path::Path,
    profile: &Profile,
    until_exit: Option<u32>,
) -> Result<ExitCode, Error> {
    let signals = block_signals()?;
    let tuning = Tuning::acquire(ksm, state_dir, &profile.knobs(ksm))?;
    basics::announce!("tuned: {}", line(&ksm.knobs()?));
    match until_exit {
        Some(pid) => basics::announce!("holding until process {pid} exits"),
        None => basics::announce!("holding until interrupted"),
    }
    loop {
        if wait_signal(&signals, Duration::from_millis(500)) {
            break;
        }
        if until_exit.is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists()) {
            break;
        }
    }
    match tuning.release()? {
        Released::Restored(knobs) => basics::announce!("restored: {}", line(&knobs)),
        Released::StillHeld(n) => basics::announce!("released; {n} other holder(s) keep KSM tuned"),
    }
    Ok(ExitCode::SUCCESS)
}

fn block_signals() -> Result<libc::sigset_t, Error> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before any other use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t owned by this frame for all calls below.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
    }
    // SAFETY: blocks the signals of a valid set for this (single-threaded) process.
    let rc = unsafe { libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(set)
}

/// True if one of the blocked signals arrived within `timeout`.
fn wait_signal(set: &libc::sigset_t, timeout: Duration) -> bool {
    let timeout = libc::timespec {
        tv_sec: 0,
        tv_nsec: libc::c_long::from(i32::try_from(timeout.subsec_nanos()).unwrap_or(0)),
    };
    // SAFETY: valid pointers to a signal set and a timespec; no siginfo is asked for.
    unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &timeout) > 0 }
}

fn status(state_dir: &std::path::Path, pids: &[u32], json: bool) -> Result<ExitCode, Error> {
    let ksm = Ksm::system()?;
    let knobs = ksm.knobs()?;
    let stats = ksm.stats()?;
    let cpu = sys::ksmd_cpu_seconds();
    let (holders, saved) = if state_dir.exists() {
        tune::holders(state_dir)?
    } else {
        (Vec::new(), None)
    };
    let mut processes = Vec::new();
    for &pid in pids {
        let stat = process::ksm_stat(Some(pid))?;
        let advised: u64 = process::mappings(Some(pid))?
            .iter()
            .filter(|m| m.has("mg"))
            .map(|m| m.end - m.start)
            .sum();
        processes.push((pid, stat, advised));
    }
    if json {
        let processes: Vec<_> = processes
            .iter()
            .map(|(pid, stat, advised)| {
                serde_json::json!({"pid": pid, "advised_bytes": advised, "ksm": stat})
            })
            .collect();
        basics::say!(
            "{}",
            serde_json::json!({"knobs": knobs, "stats": stats, "ksmd_cpu_seconds": cpu,
                "holders": holders, "saved": saved, "processes": processes})
        );
        return Ok(ExitCode::SUCCESS);
    }
    basics::say!("settings: {}", line(&knobs));
    basics::say!(
        "merged:   {} pages shared by {} mappings (saving {}), {} unshared, {} volatile, \
         {} full scans, profit {}",
        stats.pages_shared,
        stats.pages_sharing,
        mib(stats.pages_sharing * 4096),
        stats.pages_unshared,
        stats.pages_volatile,
        stats.full_scans,
        signed_mib(stats.general_profit)
    );
    if let Some(cpu) = cpu {
        basics::say!("ksmd:     {cpu:.2} CPU seconds since boot");
    }
    match (holders.is_empty(), saved) {
        (true, None) => basics::say!("tuning:   not tuned by ksm-advisor"),
        (_, saved) => {
            let pids: Vec<String> = holders.iter().map(u32::to_string).collect();
            basics::say!(
                "tuning:   held by pid(s) [{}]; restores to: {}",
                pids.join(", "),
                saved.as_ref().map_or_else(|| "-".into(), line)
            );
        }
    }
    for (pid, stat, advised) in processes {
        basics::say!(
            "pid {pid}: {} marked mergeable{}, {} pages merged, profit {}",
            mib(advised),
            if stat.merge_any {
                " (whole process)"
            } else {
                ""
            },
            stat.merging_pages,
            signed_mib(stat.process_profit)
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn line(knobs: &sys::Knobs) -> String {
    knobs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[allow(clippy::cast_precision_loss, reason = "byte counts for display")]
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

#[allow(clippy::cast_precision_loss, reason = "byte counts for display")]
fn signed_mib(bytes: i64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}
