//! Where a VM's files live: one directory per job under the runtime directory, with its
//! control socket (mode 0600), its identity, its default disk and offload store, and the log
//! of a detached VM.

use std::path::{Path, PathBuf};

/// The identity a VM prints first and a client needs to reach it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Identity {
    /// The job id.
    pub job: String,
    /// The control socket.
    pub socket: PathBuf,
    /// The attempt id (changes with every start of the job).
    pub attempt: String,
    /// The VM process.
    pub pid: u32,
}

/// The runtime directory: `$PVISOR_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/pvisor`, else
/// `/run/pvisor` for root, else `/tmp/pvisor-UID`.
pub fn runtime_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PVISOR_RUNTIME_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR") {
        return PathBuf::from(dir).join("pvisor");
    }
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    if uid == 0 {
        PathBuf::from("/run/pvisor")
    } else {
        PathBuf::from(format!("/tmp/pvisor-{uid}"))
    }
}

/// The directory of `job`.
pub fn job_dir(job: &str) -> PathBuf {
    runtime_dir().join(job)
}

/// The control socket of `job`.
pub fn socket_path(job: &str) -> PathBuf {
    job_dir(job).join("control.sock")
}

/// The identity file of `job`.
pub fn identity_path(job: &str) -> PathBuf {
    job_dir(job).join("vm.json")
}

/// Reads the identity a running job left.
pub fn read_identity(job: &str) -> std::io::Result<Identity> {
    let path = identity_path(job);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("no VM with job id `{job}` here ({}: {e})", path.display()),
        )
    })?;
    serde_json::from_str(&text)
        .map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))
}

/// A fresh random id of 12 hex digits.
pub fn new_id(prefix: &str) -> String {
    let mut bytes = [0u8; 6];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != 6 {
        // Fall back on time and pid; ids only need to differ between live jobs.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
            ^ u128::from(std::process::id());
        bytes.copy_from_slice(&seed.to_le_bytes()[..6]);
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}{hex}")
}

/// A job id must be a plain name: it becomes a directory name.
pub fn check_job_id(job: &str) -> Result<(), String> {
    let ok = !job.is_empty()
        && job.len() <= 64
        && job
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !job.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "job id `{job}` must be 1-64 letters, digits, '-', '_' or '.', not starting with '.'"
        ))
    }
}

/// Creates `dir` with mode 0700 (and its parents).
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_job_ids_are_checked_and_fresh_ids_differ() {
        assert!(check_job_id("vm-1a2b").is_ok());
        for bad in ["", "../x", ".hidden", "a/b", "a b", &"x".repeat(65)] {
            assert!(check_job_id(bad).is_err(), "{bad}");
        }
        assert_ne!(new_id("vm-"), new_id("vm-"));
        assert!(check_job_id(&new_id("vm-")).is_ok());
    }
}
