//! The project's own protocol on a server connection, for VMMs that want offload and load
//! through the server: after a `pvisor-uffd/1` handshake (regions, the userfaultfd and the
//! memfds of their RAM), the VMM sends one JSON request per line and gets one JSON reply per
//! line, matched by `request_id`:
//!
//! ```text
//! {"request_id":1,"op":"stats"}
//! {"request_id":2,"op":"offload","dir":"/run/vm1/ram","codec":"lz4"}   (vCPUs paused)
//! {"request_id":3,"op":"load","mode":"lazy"}
//! {"request_id":4,"op":"wait_prefetch"}
//! → {"request_id":2,"status":"ok","value":{...}}  or  {"request_id":2,"status":"error","error":"..."}
//! ```

use std::path::{Path, PathBuf};

use compressed_backing::bulk::BulkOptions;
use compressed_backing::{Codec, CodecConfig};

use crate::load::LoadMode;
use crate::offload::OffloadConfig;
use crate::pager::Pager;
use basics::error_chain;

/// One request line.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct Request {
    /// Echoed in the reply.
    pub request_id: u64,
    /// What to do.
    #[serde(flatten)]
    pub op: Op,
}

/// The operations.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Metrics and page-state counts.
    Stats,
    /// Offload the VM's resident RAM to the store in `dir` (the VM must be paused).
    Offload {
        /// The store directory.
        dir: PathBuf,
        /// `none`, `lz4` (default) or `zstd[:LEVEL]`.
        #[serde(default)]
        codec: Option<String>,
        /// Compression threads (default: all cores).
        #[serde(default)]
        threads: Option<usize>,
    },
    /// Bring offloaded RAM back.
    Load {
        /// `lazy` or `eager`.
        mode: LoadMode,
        /// Threads for an eager load (default 2).
        #[serde(default)]
        threads: Option<usize>,
    },
    /// Wait until the prefetcher of a lazy load is done.
    WaitPrefetch,
}

/// The most threads a request may ask for: the host's CPU count. Offload and eager load are
/// CPU-bound, so more threads than cores only cost stacks and block buffers, and a peer must
/// not make the server start thousands of threads (`threads: 3000`).
pub fn max_threads() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// A requested thread count, capped to `1..=max_threads()`.
pub fn capped_threads(requested: usize) -> usize {
    requested.clamp(1, max_threads())
}

/// Checks that a peer running as `uid` may have the server write a store at `dir`: an
/// absolute path whose directory (or, before it exists, its parent) is a real directory, not
/// a symlink, owned by `uid`. The server may run as root: without this a peer could have it
/// write anywhere, or replace another VM's store.
pub fn check_store_dir(dir: &Path, uid: u32) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    if !dir.is_absolute() {
        return Err(format!(
            "store directory {}: not an absolute path",
            dir.display()
        ));
    }
    let (checked, meta) = match std::fs::symlink_metadata(dir) {
        Ok(meta) => (dir, meta),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let parent = dir.parent().unwrap_or(dir);
            let meta = std::fs::symlink_metadata(parent)
                .map_err(|e| format!("store directory {}: {e}", parent.display()))?;
            (parent, meta)
        }
        Err(e) => return Err(format!("store directory {}: {e}", dir.display())),
    };
    if !meta.file_type().is_dir() {
        return Err(format!(
            "store directory {}: not a directory (symlinks are not followed)",
            checked.display()
        ));
    }
    if meta.uid() != uid {
        return Err(format!(
            "store directory {}: owned by uid {}, not by the VMM's uid {uid}",
            checked.display(),
            meta.uid()
        ));
    }
    Ok(())
}

/// Handles one request line from a peer running as `uid`; returns the reply line.
pub fn handle(pager: &Pager, line: &str, uid: u32) -> String {
    let request: Request = match serde_json::from_str(line) {
        Ok(request) => request,
        Err(e) => {
            return serde_json::json!({
                "request_id": null,
                "status": "error",
                "error": format!("not a request: {e}"),
            })
            .to_string()
        }
    };
    let result = run(pager, &request.op, uid);
    let reply = match result {
        Ok(value) => serde_json::json!({
            "request_id": request.request_id,
            "status": "ok",
            "value": value,
        }),
        Err(error) => serde_json::json!({
            "request_id": request.request_id,
            "status": "error",
            "error": error,
        }),
    };
    reply.to_string()
}

fn run(pager: &Pager, op: &Op, uid: u32) -> Result<serde_json::Value, String> {
    let json =
        |value: Result<serde_json::Value, serde_json::Error>| value.map_err(|e| e.to_string());
    match op {
        Op::Stats => json(Ok(serde_json::json!({
            "metrics": pager.metrics().snapshot(),
            "pages": pager.state_counts(),
            "image_bytes": pager.image_size(),
        }))),
        Op::Offload {
            dir,
            codec,
            threads,
        } => {
            check_store_dir(dir, uid)?;
            let codec: Codec = codec
                .as_deref()
                .unwrap_or("lz4")
                .parse()
                .map_err(|e| error_chain(&e))?;
            let config = OffloadConfig {
                dir: dir.clone(),
                codec: CodecConfig::new(codec),
                bulk: threads.map_or_else(BulkOptions::default, |n| {
                    BulkOptions::with_threads(capped_threads(n))
                }),
                durability: compressed_backing::Durability::Process,
                direct_reads: true,
            };
            let report = pager.offload(&config).map_err(|e| error_chain(&e))?;
            json(serde_json::to_value(report))
        }
        Op::Load { mode, threads } => {
            let report = pager
                .load(*mode, capped_threads(threads.unwrap_or(2)))
                .map_err(|e| error_chain(&e))?;
            json(serde_json::to_value(report))
        }
        Op::WaitPrefetch => {
            pager.wait_prefetch();
            Ok(serde_json::Value::Null)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_requests_parse_with_defaults() {
        let r: Request =
            serde_json::from_str(r#"{"request_id":7,"op":"offload","dir":"/x"}"#).unwrap();
        assert_eq!(
            r.op,
            Op::Offload {
                dir: "/x".into(),
                codec: None,
                threads: None
            }
        );
        let r: Request =
            serde_json::from_str(r#"{"request_id":8,"op":"load","mode":"eager"}"#).unwrap();
        assert_eq!(
            r.op,
            Op::Load {
                mode: LoadMode::Eager,
                threads: None
            }
        );
        assert!(serde_json::from_str::<Request>(r#"{"request_id":9,"op":"explode"}"#).is_err());
    }

    #[test]
    fn check_store_dir_only_dirs_of_the_peer_are_accepted() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let own = std::fs::metadata(dir.path()).unwrap().uid();
        assert!(check_store_dir(dir.path(), own).is_ok());
        assert!(check_store_dir(&dir.path().join("new"), own).is_ok());
        let err = check_store_dir(dir.path(), own + 1).unwrap_err();
        assert!(err.contains("owned by uid"), "{err}");
        assert!(check_store_dir(Path::new("relative/x"), own).is_err());
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("/", &link).unwrap();
        let err = check_store_dir(&link, own).unwrap_err();
        assert!(err.contains("symlinks"), "{err}");
        assert!(check_store_dir(&link.join("x"), own).is_err());
    }

    #[test]
    fn capped_threads_client_counts_stay_within_the_cpus() {
        assert_eq!(capped_threads(0), 1);
        assert_eq!(capped_threads(3000), max_threads());
        assert!(max_threads() >= 1);
        assert_eq!(capped_threads(1), 1);
    }
}
