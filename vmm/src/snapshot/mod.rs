//! Sealed snapshots and their copy-on-write restore.
//!
//! `pvisor snapshot JOB --out DIR` writes, between two commands of the VM:
//! - `ram.img`: guest RAM as a raw sparse file (zero blocks are holes), the image that restored
//!   VMs map `MAP_PRIVATE`: N VMs share its page cache and pay only for the pages they write;
//!   or, with a codec, `ram.store/`: guest RAM in a compressed store (far smaller on disk),
//!   which restored VMs load lazily through the pager (each VM then holds its own copy of
//!   what it touches);
//! - `disk.img`: a copy of the virtual disk (each restored VM gets its own copy);
//! - `manifest.json`: the format, RAM size, the vCPU's registers, the guest's application
//!   bytes, and an xxh3-128 digest and size of each file.
//!
//! It is built in `DIR.partial-PID` (0700, every file 0600 from its creation: guest memory is
//! the owner's alone) and renamed into place once every file is written and synced; then the
//! files are made read-only for their owner (0400) and the directories 0500: sealed, and
//! still private. A restore
//! checks every digest before it maps anything, so a changed or truncated image is refused
//! rather than run.
//!
//! A restored VM's RAM is a private file mapping, which userfaultfd cannot register; so its
//! offload is done here: the pages it has written (present and not file-backed, from
//! `/proc/self/pagemap`) go to a store of 4 KiB blocks, then are dropped, which shows the
//! image's bytes again; resume writes them back before the vCPU runs.

use std::path::{Path, PathBuf};

use compressed_backing::file::{self as safe_file, FileError};
use compressed_backing::store::StoreError;

use crate::machine::{MachineError, VcpuState};

mod private;
mod remote;
mod restore;
mod write;

pub use private::{load_private, offload_private, PrivateLoadReport, PrivateOffloadReport};
pub use remote::{upload, Lease, SnapshotAt, UploadedSnapshot};
pub use restore::Snapshot;
use write::{copy_from_start, digest_open};
pub use write::{remove, write, RamStore};

/// The manifest format this build writes and reads.
pub const FORMAT: u32 = 1;
const RAM: &str = "ram.img";
const RAM_STORE: &str = "ram.store";
const DISK: &str = "disk.img";
const MANIFEST: &str = "manifest.json";
/// A sealed file's mode: read-only, for its owner only.
const SEALED_FILE_MODE: u32 = 0o400;
/// A sealed directory's mode: listable and enterable by its owner only.
const SEALED_DIR_MODE: u32 = 0o500;
/// The most bytes of a manifest: a few KiB of registers and seals; anything near this is not
/// one, and is refused before it is read into memory.
const MANIFEST_LIMIT: u64 = 1 << 20;
/// Bytes read or written at a time.
const CHUNK: usize = 1 << 20;
use basics::PAGE_SIZE as PAGE;

/// Errors of snapshots.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The output exists already.
    #[error("{0} exists already: a snapshot is never written over")]
    Exists(PathBuf),
    /// A file operation failed.
    #[error("cannot {op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The VM's state could not be read.
    #[error("cannot read the VM's state")]
    Machine(#[from] MachineError),
    /// Guest memory could not be read or written.
    #[error("guest memory at {gpa:#x} cannot be read or written")]
    GuestMemory {
        /// Guest-physical address.
        gpa: u64,
        /// vm-memory's complaint.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// The manifest cannot be read: missing, a link, a FIFO, too large.
    #[error("{path} is not a snapshot this build can restore")]
    ManifestFile {
        /// The manifest.
        path: PathBuf,
        /// Why.
        #[source]
        source: FileError,
    },
    /// The manifest is not JSON, of another format, or does not describe a snapshot.
    #[error("{path} is not a snapshot this build can restore: {reason}")]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A file's bytes are not what the manifest sealed.
    #[error("{path} does not match its seal ({what}): the snapshot was changed or damaged")]
    Seal {
        /// The file.
        path: PathBuf,
        /// What differs.
        what: String,
    },
    /// The restored VM's disk exists and belongs to another user.
    #[error(
        "{path} belongs to uid {owner}: a restored VM's disk must be a new file or one of ours"
    )]
    DiskNotOurs {
        /// The disk.
        path: PathBuf,
        /// Its owner.
        owner: u32,
    },
    /// A file of the snapshot is a link, a FIFO, a device, or too large.
    #[error(transparent)]
    File(#[from] FileError),
    /// A VM moved to an object store runs elsewhere already.
    #[error("the VM at {url} is running elsewhere: its lease is held by {holder}")]
    Leased {
        /// The prefix.
        url: String,
        /// Who holds the lease.
        holder: String,
    },
    /// The object store failed.
    #[error("the snapshot in the object store")]
    Remote(#[from] compressed_backing::remote::RemoteError),
    /// The private pages' store failed.
    #[error("the store of the VM's private pages")]
    Store(#[from] StoreError),
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError {
    let path = path.to_path_buf();
    move |source| SnapshotError::Io { op, path, source }
}

/// A file of the snapshot as sealed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SealedFile {
    /// Its name in the directory.
    pub name: String,
    /// Its size, bytes.
    pub bytes: u64,
    /// xxh3-128 of its bytes, hex.
    pub xxh3_128: String,
}

/// How a snapshot keeps guest RAM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RamFormat {
    /// `ram.img`, raw and sparse, mapped copy-on-write by restored VMs.
    #[default]
    Raw,
    /// `ram.store/`, a compressed store, loaded lazily by restored VMs' pagers.
    Store,
}

/// `manifest.json`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// Bytes of guest RAM.
    pub memory: u64,
    /// vCPUs.
    pub vcpus: u32,
    /// Application data the guest had filled.
    pub app_bytes: u64,
    /// The guest's phase arenas (docs/arenas.md): its table of them is in its RAM, the
    /// host's record of them here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub arenas: Vec<crate::arena::SavedArena>,
    /// The vCPU's registers.
    pub vcpu: VcpuState,
    /// The RAM image (for a store, the digest is of the image it holds).
    pub ram: SealedFile,
    /// How the RAM image is kept.
    #[serde(default)]
    pub ram_format: RamFormat,
    /// In an object store: the seal of the RAM store's index, which holds every block's
    /// checksum, so the RAM is checked block by block as it is fetched instead of read whole
    /// before the restore.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_index: Option<SealedFile>,
    /// In an object store: the VM was moved there (`suspend --vm-offload-to`), and a lease
    /// lets one restore only continue it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub leased: bool,
    /// The virtual disk.
    pub disk: SealedFile,
    /// In an object store: the sub-prefix of the upload that wrote this snapshot (`up-` and
    /// 12 hex digits), under which its disk and RAM store are. Two uploads racing for one
    /// prefix then never mix their objects: the one whose manifest lands is whole. `None`:
    /// they are right under the prefix (snapshots written before there were sub-prefixes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objects: Option<String>,
    /// Seconds since the epoch when it was taken.
    pub created_unix_s: u64,
}

/// What `snapshot` wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SnapshotReport {
    /// The snapshot's directory.
    pub dir: PathBuf,
    /// Bytes of RAM written (non-zero blocks).
    pub ram_data_bytes: u64,
    /// Bytes of the disk copy.
    pub disk_bytes: u64,
    /// Wall time, milliseconds.
    pub elapsed_ms: f64,
}

/// Streams bytes into an xxh3-128 digest and counts them.
struct Digest {
    hasher: xxhash_rust::xxh3::Xxh3,
    bytes: u64,
}

impl Digest {
    fn new() -> Self {
        Self {
            hasher: xxhash_rust::xxh3::Xxh3::new(),
            bytes: 0,
        }
    }

    fn update(&mut self, data: &[u8]) {
        self.hasher.update(data);
        self.bytes += data.len() as u64;
    }

    fn update_zeros(&mut self, mut len: usize) {
        const ZEROS: [u8; 4096] = [0; 4096];
        while len > 0 {
            let n = len.min(ZEROS.len());
            self.update(&ZEROS[..n]);
            len -= n;
        }
    }

    fn seal(self, name: &str) -> SealedFile {
        SealedFile {
            name: name.to_owned(),
            bytes: self.bytes,
            xxh3_128: format!("{:032x}", self.hasher.digest128()),
        }
    }
}

/// Reads a snapshot's manifest without checking its files (see [`Snapshot::open`]).
pub fn read_manifest(dir: &Path) -> Result<Manifest, SnapshotError> {
    let path = dir.join(MANIFEST);
    let text = safe_file::read_bounded(&path, MANIFEST_LIMIT).map_err(|source| {
        SnapshotError::ManifestFile {
            path: path.clone(),
            source,
        }
    })?;
    parse_manifest(&text, &path)
}

/// Whether `name` is an upload's sub-prefix as `remote::upload` makes them (`up-` and 12
/// lowercase hex digits): a manifest from a bucket may say anything.
fn is_upload_id(name: &str) -> bool {
    name.strip_prefix("up-").is_some_and(|hex| {
        hex.len() == 12
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Parses and checks a manifest's bytes (`path` names it in errors).
fn parse_manifest(text: &[u8], path: &Path) -> Result<Manifest, SnapshotError> {
    let bad = |reason: String| SnapshotError::Manifest {
        path: path.to_path_buf(),
        reason,
    };
    let manifest: Manifest = serde_json::from_slice(text).map_err(|e| bad(e.to_string()))?;
    if manifest.format != FORMAT {
        return Err(bad(format!(
            "format {} (this build reads {FORMAT})",
            manifest.format
        )));
    }
    if manifest.ram.bytes != manifest.memory {
        return Err(bad("the RAM image's size is not the RAM size".into()));
    }
    // The seals cover the files, not the manifest's own numbers: each is checked here.
    crate::guest::check_memory(manifest.memory).map_err(&bad)?;
    let app_size = manifest.memory - crate::guest::APP_BASE;
    if manifest.app_bytes > app_size {
        return Err(bad(format!(
            "app_bytes {} is more than the {app_size} bytes of application memory",
            manifest.app_bytes
        )));
    }
    check_vcpu(&manifest.vcpu, manifest.memory).map_err(&bad)?;
    crate::arena::Registry::new(manifest.memory)
        .restore(&manifest.arenas)
        .map_err(|refused| bad(format!("arenas: {}", refused.reason)))?;
    // The files are the ones `write` makes, in this directory: a manifest naming another
    // file (`../x`, `/x`, or the RAM image as the disk) would have that file checked and
    // another one used.
    let ram_name = match manifest.ram_format {
        RamFormat::Raw => RAM,
        RamFormat::Store => RAM_STORE,
    };
    if let Some(objects) = &manifest.objects {
        if !is_upload_id(objects) {
            return Err(bad(format!(
                "its objects are under {objects:?}, not an upload's sub-prefix (up- and 12 hex \
                 digits)"
            )));
        }
    }
    if manifest.ram.name != ram_name || manifest.disk.name != DISK {
        return Err(bad(format!(
            "its files are {:?} and {:?}, not {ram_name:?} and {DISK:?}",
            manifest.ram.name, manifest.disk.name
        )));
    }
    Ok(manifest)
}

/// RFLAGS bits a CPL3 program may hold: CF, bit 1, PF, AF, ZF, SF, TF, IF (IOPL 3), DF, OF,
/// IOPL, NT, RF (`iretq`), AC, ID.
const USER_RFLAGS: u64 = 0x0025_7FD7;

/// Checks that restored registers are the workload guest's own state, as the VMM set it up
/// and a CPL3 program can leave it: user code and data segments (RPL and DPL 3, 64-bit
/// code), the VMM's paging (CR0, CR3, CR4, EFER), RIP inside the guest program and RSP
/// inside its stack. A manifest's numbers are not sealed: without this, an edited one could
/// start the guest at CPL0, with its own page tables, anywhere.
fn check_vcpu(vcpu: &VcpuState, memory: u64) -> Result<(), String> {
    use crate::guest::{BINARY, CODE_GPA, IO_BUF_GPA, PML4_GPA};
    use crate::machine::{
        GUEST_CR0, GUEST_CR4, GUEST_EFER, USER_CODE_SELECTOR, USER_DATA_SELECTOR,
    };
    let sregs = &vcpu.sregs;
    let segment = |name: &str, s: &kvm_bindings::kvm_segment, selector: u16| {
        if s.selector != selector || s.dpl != 3 || s.present != 1 || s.s != 1 {
            return Err(format!(
                "vcpu {name} is selector {:#x} with DPL {}, not the guest's user segment \
                 {selector:#x} with DPL 3",
                s.selector, s.dpl
            ));
        }
        if s.base != 0 {
            return Err(format!("vcpu {name} has base {:#x}, not 0", s.base));
        }
        Ok(())
    };
    segment("cs", &sregs.cs, USER_CODE_SELECTOR)?;
    if sregs.cs.l != 1 || sregs.cs.type_ & 0x8 == 0 {
        return Err("vcpu cs is not a 64-bit code segment".into());
    }
    for (name, s) in [
        ("ss", &sregs.ss),
        ("ds", &sregs.ds),
        ("es", &sregs.es),
        ("fs", &sregs.fs),
        ("gs", &sregs.gs),
    ] {
        segment(name, s, USER_DATA_SELECTOR)?;
    }
    if sregs.cr3 != PML4_GPA {
        return Err(format!(
            "vcpu cr3 is {:#x}, not the VMM's page tables at {PML4_GPA:#x}",
            sregs.cr3
        ));
    }
    let bits = [
        ("cr0", sregs.cr0, GUEST_CR0),
        ("cr4", sregs.cr4, GUEST_CR4),
        ("efer", sregs.efer, GUEST_EFER),
    ];
    for (name, value, set) in bits {
        if value & set != set {
            return Err(format!(
                "vcpu {name} is {value:#x}, without the bits {set:#x} the VMM sets"
            ));
        }
    }
    let code_end = CODE_GPA + BINARY.len() as u64;
    let rip = vcpu.regs.rip;
    if !(CODE_GPA..code_end).contains(&rip) {
        return Err(format!(
            "vcpu rip {rip:#x} is outside the guest program ({CODE_GPA:#x}..{code_end:#x})"
        ));
    }
    // RFLAGS as a CPL3 program can leave it: bit 1 set, and no bit that `popf` or `iretq`
    // at CPL3 cannot set (VM, VIF, VIP, reserved). IOPL is not checked: the VMM starts the
    // guest with IOPL 3, and this host's paravirtual KVM reports 0 in the saved state.
    let rflags = vcpu.regs.rflags;
    if rflags & !USER_RFLAGS != 0 || rflags & 0x2 == 0 {
        return Err(format!(
            "vcpu rflags is {rflags:#x}: bits a CPL3 program cannot set, or bit 1 clear"
        ));
    }
    // The stack grows down from STACK_TOP to the program's end (below the I/O buffer).
    let rsp = vcpu.regs.rsp;
    if !(code_end..IO_BUF_GPA.min(memory)).contains(&rsp) {
        return Err(format!(
            "vcpu rsp {rsp:#x} is outside the guest's stack ({code_end:#x}..{IO_BUF_GPA:#x})"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::write::{rename_no_replace, seal};
    use super::*;

    #[test]
    fn remove_sealed_tree_is_removed_by_its_non_root_owner() {
        use std::os::unix::ffi::OsStrExt;
        let root = tempfile::tempdir().expect("tempdir");
        let partial = root.path().join("snap.partial-1");
        std::fs::create_dir_all(partial.join(RAM_STORE).join("segments")).expect("dirs");
        std::fs::write(partial.join(RAM), b"guest").expect("file");
        std::fs::write(partial.join(RAM_STORE).join("index"), b"i").expect("file");
        std::fs::write(partial.join(RAM_STORE).join("segments/0"), b"s").expect("file");
        seal(&partial).expect("seal");
        // Everything owned by `nobody`, who then cleans up (root would not need the chmod).
        let nobody = 65534;
        let chown = |path: &Path| {
            let c = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path");
            // SAFETY: a NUL-terminated path that lives across the call.
            assert_eq!(unsafe { libc::lchown(c.as_ptr(), nobody, nobody) }, 0);
        };
        chown(root.path());
        for dir in [
            partial.clone(),
            partial.join(RAM),
            partial.join(RAM_STORE),
            partial.join(RAM_STORE).join("index"),
            partial.join(RAM_STORE).join("segments"),
            partial.join(RAM_STORE).join("segments/0"),
        ] {
            chown(&dir);
        }
        // SAFETY: the child only changes its ids, removes the tree and exits with `_exit`
        // (glibc's fork keeps malloc usable in the child).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            // SAFETY: plain syscalls in the child; `_exit` skips the parent's atexit work.
            unsafe {
                if libc::setgid(nobody) != 0 || libc::setuid(nobody) != 0 {
                    libc::_exit(2);
                }
                remove(&partial);
                libc::_exit(i32::from(partial.exists()));
            }
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &raw mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "{status}");
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "the partial directory is left"
        );
        assert!(!partial.exists());
    }

    #[test]
    fn rename_no_replace_existing_target_is_refused_and_both_kept() {
        let root = tempfile::tempdir().expect("tempdir");
        let (from, to) = (root.path().join("from"), root.path().join("to"));
        std::fs::create_dir(&from).expect("from");
        std::fs::write(from.join("ram.img"), b"guest").expect("file");
        // An empty directory (which `rename` would replace) and a file.
        std::fs::create_dir(&to).expect("to");
        let err = rename_no_replace(&from, &to).expect_err("an existing directory");
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
        std::fs::remove_dir(&to).expect("remove");
        std::fs::write(&to, b"other").expect("file");
        let err = rename_no_replace(&from, &to).expect_err("an existing file");
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&to).expect("kept"), b"other");
        assert_eq!(std::fs::read(from.join("ram.img")).expect("kept"), b"guest");
        // Nothing there: renamed.
        std::fs::remove_file(&to).expect("remove");
        rename_no_replace(&from, &to).expect("renamed");
        assert_eq!(std::fs::read(to.join("ram.img")).expect("moved"), b"guest");
        assert!(!from.exists());
    }
}
