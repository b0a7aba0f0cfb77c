//! The daemon's state directory (`--state DIR`, mode 0700): one JSON file per sandbox under
//! `sandboxes/`, each written whole or not at all (a temporary file, synced, renamed over
//! the old one, the directory synced), and the VMs' runtime directory `vms/`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

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
    /// Held by every write: one at a time (a record has one temporary file name), in the
    /// order their holders took it (a later state is never overwritten by an earlier one).
    writes: Arc<Mutex<()>>,
}

/// The right to write the state directory, taken in the order of the changes written.
#[derive(Debug)]
pub struct Writes<'a> {
    store: &'a Store,
    _held: MutexGuard<'a, ()>,
}

impl Store {
    /// Opens (creating) `root` and its `sandboxes/` and `vms/` directories, all 0700.
    pub fn open(root: &Path) -> Result<Store, StoreError> {
        let root = std::path::absolute(root).map_err(io(root))?;
        private_dir(&root)?;
        private_dir(&root.join("sandboxes"))?;
        private_dir(&root.join("vms"))?;
        Ok(Store {
            root,
            writes: Arc::default(),
        })
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

    /// Waits for the right to write. Take it before letting go of the lock under which the
    /// record changed, so that changes are written in the order they were made; never take
    /// that lock while holding this.
    pub fn writes(&self) -> Writes<'_> {
        Writes {
            store: self,
            _held: self.writes.lock().unwrap_or_else(PoisonError::into_inner),
        }
    }

    /// Writes `record` atomically.
    pub fn save(&self, record: &Record) -> Result<(), StoreError> {
        self.writes().save(record)
    }

    /// Removes the record of `id` (none is fine).
    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        self.writes().remove(id)
    }

    fn sync_dir(&self) -> Result<(), StoreError> {
        let dir = self.root.join("sandboxes");
        std::fs::File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&dir))
    }

    /// Every record kept; files that are not records (or are symlinks) are skipped, with the
    /// reason.
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
            let read = read_plain_file(&entry.path())
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

/// The largest record file read back.
const MAX_RECORD_BYTES: u64 = 1 << 20;

/// The bytes of a regular file (not through a symlink), at most [`MAX_RECORD_BYTES`].
fn read_plain_file(path: &Path) -> Result<Vec<u8>, String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    let mut bytes = Vec::new();
    file.take(MAX_RECORD_BYTES)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    Ok(bytes)
}

/// Writes `bytes` to `path` (mode 0600) whole or not at all: a fresh temporary file beside it
/// (one planted there, symlink or not, is removed first, never followed), synced, renamed over
/// `path`, the directory synced.
pub fn write_private(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(&tmp)(e)),
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(io(&tmp))?;
    file.write_all(bytes).map_err(io(&tmp))?;
    file.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))
}

impl Writes<'_> {
    /// Writes `record` atomically: a fresh temporary file (one planted there, symlink or not,
    /// is removed first, never followed), synced, renamed over the record.
    pub fn save(&self, record: &Record) -> Result<(), StoreError> {
        let path = self.store.path(&record.id)?;
        let bytes = serde_json::to_vec_pretty(record).map_err(|source| StoreError::Encode {
            id: record.id.clone(),
            source,
        })?;
        write_private(&path, &bytes)
    }

    /// Removes the record of `id` (none is fine).
    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let path = self.store.path(id)?;
        match std::fs::remove_file(&path) {
            Ok(()) => self.store.sync_dir(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&path)(e)),
        }
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
        assert_eq!(testkit::mode(&root), 0o700);
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
    fn store_follows_no_symlink_planted_among_its_records() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("state");
        let store = Store::open(&root).expect("opens");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").expect("victim");
        let r = record("sb-0123456789ab");
        // A symlink where the temporary file goes, and one for another record.
        let tmp = root.join("sandboxes/sb-0123456789ab.json.tmp");
        std::os::unix::fs::symlink(&victim, &tmp).expect("symlink");
        let mut other = record("sb-00000000000f");
        other.created_ms = 2;
        std::fs::write(
            dir.path().join("other.json"),
            serde_json::to_vec(&other).expect("json"),
        )
        .expect("other");
        std::os::unix::fs::symlink(
            dir.path().join("other.json"),
            root.join("sandboxes/sb-00000000000f.json"),
        )
        .expect("symlink");
        store.save(&r).expect("saves");
        assert_eq!(std::fs::read(&victim).expect("victim"), b"precious");
        let saved = root.join("sandboxes/sb-0123456789ab.json");
        assert!(std::fs::symlink_metadata(&saved).expect("record").is_file());
        assert_eq!(testkit::mode(&saved), 0o600);
        let (loaded, skipped) = store.load_all();
        assert_eq!(loaded, vec![r]);
        assert_eq!(skipped.len(), 1, "{skipped:?}");
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
