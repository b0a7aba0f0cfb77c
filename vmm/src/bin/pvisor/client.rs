//! The control commands: status, stats, stop, exec, suspend, resume, snapshot.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use vmm::control::{self, Method};
use vmm::runtime;

use crate::{CliResult, Target};

/// Resolves a target to (socket, job, attempt).
fn resolve(target: &Target) -> Result<(PathBuf, String, String), Box<dyn std::error::Error>> {
    runtime::check_job_id(&target.job)?;
    if let Some(job_id) = &target.job_id {
        if job_id != &target.job {
            return Err(
                format!("--vm-job-id {job_id} does not match the job {}", target.job).into(),
            );
        }
    }
    match (&target.socket, &target.attempt) {
        (Some(socket), Some(attempt)) => Ok((socket.clone(), target.job.clone(), attempt.clone())),
        (socket, attempt) => {
            let identity = runtime::read_identity(&target.job)?;
            Ok((
                socket.clone().unwrap_or(identity.socket),
                target.job.clone(),
                attempt.clone().unwrap_or(identity.attempt),
            ))
        }
    }
}

fn call(target: &Target, method: Method) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let (socket, job, attempt) = resolve(target)?;
    control::call(&socket, &job, &attempt, method).map_err(|e| {
        // A VM that died during the call leaves a tombstone: its reason, not the broken reply.
        let broken = matches!(
            e,
            control::ClientError::BadReply(_) | control::ClientError::Io { .. }
        );
        match broken.then(|| dead_reason(&job)).flatten() {
            Some(reason) => format!("the VM ended: {reason}").into(),
            None => e.into(),
        }
    })
}

/// Why the VM of `job` ended, if it did (its tombstone, once its supervisor wrote it: waited
/// for up to a second).
fn dead_reason(job: &str) -> Option<String> {
    for _ in 0..20 {
        if let Some(tombstone) = runtime::read_tombstone(job) {
            return Some(tombstone.reason);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    None
}

fn print(value: &serde_json::Value) -> Result<(), basics::output::StdoutClosed> {
    basics::say!("{value}");
    Ok(())
}

pub fn simple(target: &Target, method: Method) -> CliResult {
    print(&call(target, method)?)?;
    Ok(ExitCode::SUCCESS)
}

/// `status`: a running VM's answer, or, for one that died, what its tombstone says (its
/// stale socket and lock are removed on the way).
pub fn status(target: &Target) -> CliResult {
    runtime::check_job_id(&target.job)?;
    // The long form names the socket: the runtime directory is not needed.
    if target.socket.is_some() && target.attempt.is_some() {
        return simple(target, Method::Status);
    }
    runtime::ensure_runtime_dir()?;
    if let Some(tombstone) = runtime::reap(&target.job) {
        let mut value = serde_json::to_value(&tombstone)?;
        if let Some(object) = value.as_object_mut() {
            object.insert("state".into(), "dead".into());
        }
        print(&value)?;
        return Ok(ExitCode::SUCCESS);
    }
    simple(target, Method::Status)
}

pub fn exec(target: &Target, script: &str) -> CliResult {
    // Parse here too, so that a typo is reported before anything runs.
    vmm::script::parse(script)?;
    print(&call(
        target,
        Method::Exec {
            script: script.to_owned(),
        },
    )?)?;
    Ok(ExitCode::SUCCESS)
}

pub fn suspend(
    target: &Target,
    offload: bool,
    ram_file: Option<&Path>,
    offload_to: Option<&str>,
    remote: &uffd_pager::remote_args::RemoteArgs,
) -> CliResult {
    // The VM process resolves the path: make it absolute here, where it was meant.
    let ram_file = ram_file.map(std::path::absolute).transpose()?;
    let Some(offload_to) = offload_to else {
        print(&call(target, Method::Suspend { offload, ram_file })?)?;
        return Ok(ExitCode::SUCCESS);
    };
    // A move: offloaded, written to the bucket with its lease, and only then stopped here.
    let url = compressed_backing::remote::RemoteUrl::parse(offload_to)
        .map_err(|e| format!("--vm-offload-to: {e}"))?;
    let remote = compressed_backing::remote::Remote::connect(&url, &remote.options()?)?;
    let suspended = call(target, Method::Suspend { offload, ram_file })?;
    let what = format!("job {}", target.job);
    // Stopped here before the upload commits, so that it never runs in two places: from then
    // on the snapshot written is the VM, kept if the upload fails.
    let (staging, local, written) = write_staged(target, &remote, None, None)?;
    let stopped = call(target, Method::Stop)?;
    let uploaded = match vmm::snapshot::upload(&local, &remote, Some(&what), &|_| {}) {
        Ok(uploaded) => uploaded,
        Err(e) => {
            let kept = staging.keep();
            return Err(format!(
                "{}; the VM is stopped here and its snapshot kept in {}: `pvisor run --restore \
                 {}` continues it on this host, or move it from there again",
                basics::error_chain(&e),
                kept.display(),
                kept.join("snapshot").display()
            )
            .into());
        }
    };
    vmm::snapshot::remove(&local);
    print(&serde_json::json!({
        "suspended": suspended,
        "written": written,
        "uploaded": uploaded,
        "stopped": stopped,
        "resume_with": format!("pvisor run --restore {url}"),
    }))?;
    Ok(ExitCode::SUCCESS)
}

/// Has the VM write a snapshot into a new private directory of the cache (its RAM in a
/// store, lz4 unless `codec` says otherwise, of `block_size` blocks if given): the
/// directory, the snapshot's path, the reply.
fn write_staged(
    target: &Target,
    remote: &compressed_backing::remote::Remote,
    codec: Option<String>,
    block_size: Option<u64>,
) -> Result<(tempfile::TempDir, PathBuf, serde_json::Value), Box<dyn std::error::Error>> {
    let staging = tempfile::Builder::new()
        .prefix("snapshot-")
        .tempdir_in(remote.cache().root())?;
    let local = staging.path().join("snapshot");
    let written = call(
        target,
        Method::Snapshot {
            out: local.clone(),
            codec: Some(codec.unwrap_or_else(|| "lz4".into())),
            block_size,
        },
    )?;
    Ok((staging, local, written))
}

/// Has the VM write a snapshot into a private directory of the cache (its RAM in a store),
/// uploads it to `remote`'s prefix and removes the local copy.
fn write_and_upload(
    target: &Target,
    remote: &compressed_backing::remote::Remote,
    codec: Option<String>,
    block_size: Option<u64>,
) -> Result<(serde_json::Value, vmm::snapshot::UploadedSnapshot), Box<dyn std::error::Error>> {
    let (_staging, local, written) = write_staged(target, remote, codec, block_size)?;
    let uploaded = vmm::snapshot::upload(&local, remote, None, &|_| {});
    vmm::snapshot::remove(&local);
    let uploaded = uploaded.map_err(|e| basics::error_chain(&e))?;
    Ok((written, uploaded))
}

pub fn resume(target: &Target, eager: bool) -> CliResult {
    print(&call(target, Method::Resume { eager })?)?;
    Ok(ExitCode::SUCCESS)
}

pub fn snapshot(
    target: &Target,
    out: &str,
    remote: &uffd_pager::remote_args::RemoteArgs,
    codec: Option<String>,
    block_size: u64,
) -> CliResult {
    use compressed_backing::remote::{Remote, StoreLocation};
    // Checked here, so that a typo is reported before the VM does anything.
    if let Some(codec) = &codec {
        codec
            .parse::<compressed_backing::Codec>()
            .map_err(|e| format!("--codec: {e}"))?;
    }
    compressed_backing::BlockSize::new(block_size).map_err(|e| format!("--block-size: {e}"))?;
    // The default is the store's own: a request that leaves it out works with older VMs.
    let block_size =
        (block_size != compressed_backing::BlockSize::default().bytes_u64()).then_some(block_size);
    let url = match StoreLocation::parse(out).map_err(|e| format!("--out: {e}"))? {
        StoreLocation::Local(dir) => {
            if codec.is_none() && block_size.is_some() {
                return Err("--block-size needs --codec: a raw snapshot has no blocks".into());
            }
            // The VM process resolves the path: make it absolute here, where it was meant.
            let out = std::path::absolute(dir)?;
            print(&call(
                target,
                Method::Snapshot {
                    out,
                    codec,
                    block_size,
                },
            )?)?;
            return Ok(ExitCode::SUCCESS);
        }
        StoreLocation::Remote(url) => url,
    };
    let remote = Remote::connect(&url, &remote.options()?)?;
    let (written, uploaded) = write_and_upload(target, &remote, codec, block_size)?;
    print(&serde_json::json!({
        "written": written,
        "uploaded": uploaded,
    }))?;
    Ok(ExitCode::SUCCESS)
}
