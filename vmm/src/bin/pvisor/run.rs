//! `pvisor run`: the options resolved into a VM spec, then the VM process in the foreground,
//! or detached under its supervisor (`vmm::detached`, which holds the VM process itself).

use std::process::ExitCode;

use vmm::detached::{self, Spec};
use vmm::runtime;
use vmm::script;
use vmm::stats::MemoryCgroup;
use vmm::vm::VmOptions;

use crate::options::{self, RunArgs};
use crate::CliResult;

pub fn run(args: RunArgs) -> CliResult {
    let mut resolved = options::resolve(&args)?;
    let script = args.script.join(" ");
    script::parse(&script)?;
    let job = match &args.job {
        Some(job) => job.clone(),
        None => runtime::new_id("vm-"),
    };
    runtime::check_job_id(&job)?;
    // A VM in the foreground is this process: it goes into its cgroup by executing itself
    // again there (the detached VM's supervisor does it for its VM between fork and exec).
    if !args.detach {
        if let Some(name) = &resolved.cgroup {
            resolved.cgroup = Some(MemoryCgroup::place_self(name)?);
        }
    }
    let dir = runtime::job_dir(&job);
    let spec = Spec {
        attempt: runtime::new_id(""),
        options: VmOptions {
            memory: resolved.memory,
            vcpus: resolved.vcpus,
            ram_backing: resolved.ram_backing,
            ram_compression: resolved.ram_compression,
            ram_codec: resolved.ram_codec,
            offload_durability: resolved.offload_durability,
            direct_reads: resolved.direct_reads,
            disk: resolved
                .disk
                .clone()
                .unwrap_or_else(|| dir.join("disk.img")),
            store_dir: dir.join("ram"),
            cgroup: resolved.cgroup,
            pager_threads: resolved.pager_threads,
            io_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            cold: resolved.cold,
            dedup: resolved.dedup,
            thp_collapse: resolved.thp_collapse,
            arena_offload: resolved.arena_offload,
            arenas: resolved.arenas,
            exit_on_memory_lost: true,
            restore: resolved.restore.clone(),
            restore_remote: resolved.restore_remote.clone(),
            pool: resolved.pool.clone(),
            model_upstream: resolved.model_upstream.clone(),
            model_batching: resolved.model_batching,
            net: resolved.net.clone(),
            image: resolved
                .image
                .clone()
                .map(|image| vmm::image::ImageOptions {
                    at: image.at,
                    staging: image.staging.unwrap_or_else(|| dir.join("image")),
                    rate: image.rate,
                }),
            wait: resolved.wait,
            governor: resolved
                .governor
                .clone()
                .map(|socket| vmm::vm::GovernorOptions {
                    socket,
                    name: job.clone(),
                    hold_timeout_ms: resolved.governor_hold_timeout_ms,
                }),
        },
        temporary_disk: resolved.disk.is_none(),
        job,
        script,
        detached: args.detach,
    };
    if args.detach {
        // The VM has started: it runs on whether anyone reads this or not.
        let identity = detached::start(&spec)?;
        basics::say!("{}", serde_json::to_string(&identity)?);
        Ok(ExitCode::SUCCESS)
    } else {
        detached::prepare_job(&spec.job)?;
        detached::vm_main(spec)
    }
}
