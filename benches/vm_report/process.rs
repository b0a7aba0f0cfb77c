//! The real `pvisor` VM process: `pvisor run --detach`, then `pvisor stats JOB` and
//! `pvisor suspend JOB --vm-offload` as a user would type them, and the timed resume + task
//! through the control socket (`vmm::control::call`: what `pvisor resume` and `pvisor exec`
//! send, without starting a client process).
//!
//! Cases per content: `base` (never offloaded: `task`), `raw`, `lz4`, `zstd` (offload, lazy
//! resume, `task`).

use std::path::Path;
use std::time::Instant;

use crate::common::vmproc::{json_number, Job};
use crate::results::Results;
use crate::{Codec, Content, Res, Settings, MIB};

/// The cases, in the order of run 0 (`None`: never offloaded).
pub const CASES: [Option<Codec>; 4] = [None, Some(Codec::Raw), Some(Codec::Lz4), Some(Codec::Zstd)];

pub fn case_name(case: Option<Codec>) -> &'static str {
    case.map_or("base", Codec::name)
}

fn mib(text: &str, key: &str) -> Res<f64> {
    Ok(json_number(text, key)? / MIB as f64)
}

/// Runs one case in a `pvisor` process and records it under `pvisor.CONTENT.CASE.*`.
pub fn run_case(
    settings: &Settings,
    bin: &Path,
    content: Content,
    case: Option<Codec>,
    run: usize,
    results: &mut Results,
) -> Res<()> {
    let name = case_name(case);
    let key = |quantity: &str| format!("pvisor.{}.{name}.{quantity}", content.name());
    let mut put = |quantity: &str, unit: &'static str, value: f64| {
        results.put(&key(quantity), unit, run, value);
    };
    let job_id = format!(
        "vmbench-{}-{run}-{}-{name}",
        std::process::id(),
        content.name()
    );
    let script = format!(
        "fill {} {} seed={}",
        settings.app,
        content.name(),
        settings.seed
    );
    let memory = format!("{}MiB", settings.memory / MIB);
    let mut args = vec!["--memory", &memory];
    let codec_flag;
    if let Some(codec) = case.filter(|&c| c != Codec::Raw) {
        codec_flag = codec.codec_name();
        args.extend(["--vm-ram-compression", "--vm-ram-codec", codec_flag]);
    }
    args.extend(["--", &script]);
    let job = Job::start(bin, &job_id, &args)?;
    // Answered once the script has run: the VM takes requests only then.
    let digest = job.exec("digest")?.ok_or("digest gave no digest")?;
    let running = job.cli(&["stats"])?;
    put(
        "pss_running_mib",
        "MiB",
        mib(&running, "process_pss_bytes")?,
    );
    put(
        "guest_pss_running_mib",
        "MiB",
        mib(&running, "guest_ram_pss_bytes")?,
    );
    let check = |got: Option<String>| -> Res<()> {
        match got {
            Some(d) if d == digest => Ok(()),
            other => Err(format!(
                "pvisor {}/{name}: task digest {other:?}, expected {digest}",
                content.name()
            )
            .into()),
        }
    };
    if case.is_none() {
        crate::settle();
        let started = Instant::now();
        let got = job.exec("task")?;
        put("task_ms", "ms", started.elapsed().as_secs_f64() * 1e3);
        return check(got);
    }
    crate::settle();
    let suspend = job.cli(&["suspend", "--vm-offload"])?;
    put("offload_ms", "ms", json_number(&suspend, "elapsed_ms")?);
    put("offload_write_ms", "ms", json_number(&suspend, "write_ms")?);
    put("offload_drop_ms", "ms", json_number(&suspend, "drop_ms")?);
    let offloaded = job.cli(&["stats"])?;
    put(
        "pss_offloaded_mib",
        "MiB",
        mib(&offloaded, "process_pss_bytes")?,
    );
    put(
        "guest_pss_offloaded_mib",
        "MiB",
        mib(&offloaded, "guest_ram_pss_bytes")?,
    );
    put("backing_mib", "MiB", mib(&offloaded, "backing_disk_bytes")?);
    crate::settle();
    let started = Instant::now();
    job.resume()?;
    let got = job.exec("task")?;
    put(
        "resume_task_ms",
        "ms",
        started.elapsed().as_secs_f64() * 1e3,
    );
    check(got)?;
    let resumed = job.cli(&["stats"])?;
    put(
        "pss_resumed_mib",
        "MiB",
        mib(&resumed, "process_pss_bytes")?,
    );
    Ok(())
}
