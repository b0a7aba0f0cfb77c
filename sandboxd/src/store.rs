//! The daemon's state directory (`--state DIR`, mode 0700): one JSON file per sandbox under
//! `sandboxes/`, each written whole or not at all (a temporary file, synced, renamed over
//! the old one, the directory synced), and the VMs' runtime directory `vms/`.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::model::State;

/// Where a sandbox's VM is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmRef {
    /// Its job id (the sandbox's id).
    pub job: String,
    /// The attempt id its control socket checks.
    pub attempt: String,
    /// Its control socket.
    pub socket: PathBuf,
    /// The VM process.
    pub pid: u32,
    /// Its supervisor (this daemon's child).
    pub supervisor: Option<u32>,
}

/// What the daemon keeps of a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The id ([`check_id`]).
    pub id: String,
    /// The token its execd endpoint asks for.
    pub token: String,
    /// Its template.
    pub template: String,
    /// As created.
    pub entrypoint: Vec<String>,
    /// Its labels.
    pub metadata: BTreeMap<String, String>,
    /// Unix ms.
    pub created_ms: u64,
    /// Unix ms, when it expires.
    pub expires_ms: Option<u64>,
    /// Its state.
    pub state: State,
    /// Why it is in it (a code), when that says something.
    pub reason: Option<String>,
    /// In words.
    pub message: Option<String>,
    /// Unix ms of the last state change.
    pub transition_ms: u64,
    /// Bytes of guest RAM.
    pub memory: u64,
    /// Its VM, once started.
    pub vm: Option<VmRef>,
}

/// A sandbox id: `sb-` and 12 lowercase hex digits (what [`vmm::runtime::new_id`] makes).
/// Only such ids name files.
pub fn check_id(id: &str) -> bool {
    id.len() == 15
        && id.starts_with("sb-")
        && id[3..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Errors of the state directory.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The directory cannot be made or is not private.
    #[error("state directory {path}: {why}")]
    Unsafe {
        /// The directory.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A file operation failed.
    #[error("state file {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// A record cannot be written as JSON.
    #[error("sandbox {id} cannot be written")]
    Encode {
        /// The sandbox.
        id: String,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// A record's id is not an id.
    #[error("`{0}` is not a sandbox id")]
    BadId(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Creates `dir` (mode 0700) or checks that it is a real directory of ours that only we can
/// use, and makes it 0700.
fn private_dir(dir: &Path) -> Result<(), StoreError> {
    let unsafe_dir = |why: String| StoreError::Unsafe {
        path: dir.to_path_buf(),
        why,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(unsafe_dir(e.to_string())),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| unsafe_dir(e.to_string()))?;
    // SAFETY: geteuid cannot fail.
    let own = unsafe { libc::geteuid() };
    if !meta.is_dir() {
        return Err(unsafe_dir("not a directory (or a symlink)".into()));
    }
    if meta.uid() != own {
        return Err(unsafe_dir(format!(
            "owned by uid {}, not {own}",
            meta.uid()
        )));
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| unsafe_dir(e.to_string()))
}

/// The state directory.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

impl Store {
    /// Opens (creating) `root` and its `sandboxes/` and `vms/` directories, all 0700.
    pub fn open(root: &Path) -> Result<Store, StoreError> {
        let root = std::path::absolute(root).map_err(io(root))?;
        private_dir(&root)?;
        private_dir(&root.join("sandboxes"))?;
        private_dir(&root.join("vms"))?;
        Ok(Store { root })
    }

    /// The runtime directory of the sandboxes' VMs.
    pub fn vms_dir(&self) -> PathBuf {
        self.root.join("vms")
    }

    fn path(&self, id: &str) -> Result<PathBuf, StoreError> {
        if !check_id(id) {
            return Err(StoreError::BadId(id.to_owned()));
        }
        Ok(self.root.join("sandboxes").join(format!("{id}.json")))
    }

    /// Writes `record` atomically.
    pub fn save(&self, record: &Record) -> Result<(), StoreError> {
        let path = self.path(&record.id)?;
        let tmp = path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(record).map_err(|source| StoreError::Encode {
            id: record.id.clone(),
            source,
        })?;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(io(&tmp))?;
        file.write_all(&bytes).map_err(io(&tmp))?;
        file.sync_all().map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        self.sync_dir()
    }

    /// Removes the record of `id` (none is fine).
    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let path = self.path(id)?;
        match std::fs::remove_file(&path) {
            Ok(()) => self.sync_dir(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&path)(e)),
        }
    }

    fn sync_dir(&self) -> Result<(), StoreError> {
        let dir = self.root.join("sandboxes");
        std::fs::File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&dir))
    }

    /// Every record kept; files that are not records are skipped, with the reason.
    pub fn load_all(&self) -> (Vec<Record>, Vec<String>) {
        let dir = self.root.join("sandboxes");
        let mut records = Vec::new();
        let mut skipped = Vec::new();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return (records, vec![format!("cannot read {}", dir.display())]);
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_suffix(".json").filter(|id| check_id(id)) else {
                skipped.push(format!("{name}: not a sandbox file"));
                continue;
            };
            let read = std::fs::read(entry.path())
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Record>(&b).map_err(|e| e.to_string()));
            match read {
                Ok(record) if record.id == id => records.push(record),
                Ok(_) => skipped.push(format!("{name}: holds another id")),
                Err(e) => skipped.push(format!("{name}: {e}")),
            }
        }
        records.sort_by_key(|r| r.created_ms);
        (records, skipped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> Record {
        Record {
            id: id.into(),
            token: "t".into(),
            template: "pvisor:workload".into(),
            entrypoint: vec!["tail".into()],
            metadata: BTreeMap::new(),
            created_ms: 1,
            expires_ms: None,
            state: State::Running,
            reason: None,
            message: None,
            transition_ms: 1,
            memory: 512 << 20,
            vm: None,
        }
    }

    #[test]
    fn store_ids_are_strict() {
        assert!(check_id("sb-0123456789ab"));
        for bad in [
            "",
            "sb-0123456789aB",
            "sb-../../etc/x",
            "vm-0123456789ab",
            "sb-0123456789abc",
        ] {
            assert!(!check_id(bad), "{bad}");
        }
    }

    #[test]
    fn store_saves_atomically_privately_and_loads_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("state");
        let store = Store::open(&root).expect("opens");
        let meta = std::fs::metadata(&root).expect("exists");
        assert_eq!(meta.mode() & 0o777, 0o700);
        let mut r = record("sb-0123456789ab");
        store.save(&r).expect("saves");
        r.state = State::Paused;
        store.save(&r).expect("saves again");
        std::fs::write(root.join("sandboxes/junk.json"), b"{").expect("junk");
        let (loaded, skipped) = store.load_all();
        assert_eq!(loaded, vec![r.clone()]);
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        assert!(store.save(&record("../escape")).is_err());
        store.remove(&r.id).expect("removes");
        store.remove(&r.id).expect("removing twice is fine");
        assert!(store.load_all().0.is_empty());
    }

    #[test]
    fn store_refuses_a_symlink_for_a_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("elsewhere");
        std::fs::create_dir(&target).expect("mkdir");
        let link = dir.path().join("state");
        std::os::unix::fs::symlink(&target, &link).expect("symlink");
        assert!(Store::open(&link).is_err());
    }
}
