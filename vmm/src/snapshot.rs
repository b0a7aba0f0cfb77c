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

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use compressed_backing::file::{self as safe_file, FileError, PRIVATE_FILE_MODE};
use compressed_backing::store::{DiskStore, StoreConfig, StoreError};
use compressed_backing::{BlockSize, CodecConfig};
use uffd_pager::source::StoreSource;
use uffd_pager::state::PageState;
use vm_memory::{Bytes, GuestAddress};

use crate::machine::{Machine, MachineError, Restore, RestoreRam, VcpuState};
use crate::memory::GuestRam;

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
    /// The vCPU's registers.
    pub vcpu: VcpuState,
    /// The RAM image (for a store, the digest is of the image it holds).
    pub ram: SealedFile,
    /// How the RAM image is kept.
    #[serde(default)]
    pub ram_format: RamFormat,
    /// The virtual disk.
    pub disk: SealedFile,
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

/// Writes a sealed snapshot of `machine` (between commands) to `out`, which must not exist:
/// RAM raw, or into a compressed store with `codec`.
pub fn write(
    machine: &Machine,
    vcpus: u32,
    out: &Path,
    codec: Option<CodecConfig>,
) -> Result<SnapshotReport, SnapshotError> {
    let started = Instant::now();
    machine.check_usable()?;
    if std::fs::symlink_metadata(out).is_ok() {
        return Err(SnapshotError::Exists(out.to_path_buf()));
    }
    let partial = out.with_extension(format!("partial-{}", std::process::id()));
    remove(&partial);
    if let Some(parent) = partial.parent().filter(|p| !p.as_os_str().is_empty()) {
        safe_file::create_private_dir(parent).map_err(io("create", parent))?;
    }
    // Made here and now, or refused: never a directory (or a link to one) that appeared
    // since, where another user could swap the files once they are sealed.
    safe_file::create_private_dir_new(&partial).map_err(io("create", &partial))?;
    let result =
        write_into(machine, vcpus, &partial, codec).and_then(|(ram_data_bytes, disk_bytes)| {
            seal(&partial)?;
            rename_no_replace(&partial, out).map_err(|e| match e.kind() {
                // `out` appeared since the check above: it is left as it is.
                std::io::ErrorKind::AlreadyExists => SnapshotError::Exists(out.to_path_buf()),
                _ => io("rename into place", out)(e),
            })?;
            if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
                File::open(parent)
                    .and_then(|d| d.sync_all())
                    .map_err(io("sync", parent))?;
            }
            Ok((ram_data_bytes, disk_bytes))
        });
    match result {
        Ok((ram_data_bytes, disk_bytes)) => Ok(SnapshotReport {
            dir: out.to_path_buf(),
            ram_data_bytes,
            disk_bytes,
            elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
        }),
        Err(e) => {
            remove(&partial);
            Err(e)
        }
    }
}

/// Removes a snapshot directory, partial or sealed, best effort (a sealed 0500 directory's
/// entries cannot be removed by a non-root owner until it is its owner's alone again: 0700,
/// never opened to others on the way).
pub fn remove(dir: &Path) {
    unseal_dirs(dir);
    let _ = std::fs::remove_dir_all(dir);
}

/// Makes `dir` and the directories under it 0700 again, top down (a 0500 directory cannot
/// be listed-and-emptied by its owner otherwise); links are never followed.
fn unseal_dirs(dir: &Path) {
    let is_dir = std::fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_dir());
    if !is_dir || std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).is_err() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            unseal_dirs(&entry.path());
        }
    }
}

/// Renames `from` to `to` unless `to` exists, whatever it is (`renameat2` with
/// `RENAME_NOREPLACE`; `EEXIST` if it does): plain `rename` would replace an empty directory
/// that appeared at `to` since it was checked.
fn rename_no_replace(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |path: &Path| {
        std::ffi::CString::new(path.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    };
    let (from, to) = (c(from)?, c(to)?);
    // SAFETY: both paths are NUL-terminated strings that live across the call; `AT_FDCWD`
    // resolves relative paths as `rename` does; the call touches no memory of ours beyond
    // reading the two strings.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Writes the three files into `dir`; returns the RAM data bytes and the disk bytes.
fn write_into(
    machine: &Machine,
    vcpus: u32,
    dir: &Path,
    codec: Option<CodecConfig>,
) -> Result<(u64, u64), SnapshotError> {
    let ram = machine.ram();
    let (ram_seal, ram_data_bytes) = match codec {
        Some(codec) => write_ram_store(machine, &dir.join(RAM_STORE), codec)?,
        None => write_ram(machine, &dir.join(RAM))?,
    };
    machine
        .disk()
        .sync_data()
        .map_err(io("sync", machine.disk_path()))?;
    // From the VM's own descriptor: the file it runs on, whatever its path names now.
    let disk_seal = copy_sealed(machine.disk(), machine.disk_path(), &dir.join(DISK))?;
    let manifest = Manifest {
        format: FORMAT,
        memory: ram.size(),
        vcpus,
        app_bytes: machine.app_bytes(),
        vcpu: machine.vcpu_state()?,
        disk: disk_seal.clone(),
        ram: ram_seal,
        ram_format: if codec.is_some() {
            RamFormat::Store
        } else {
            RamFormat::Raw
        },
        created_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    let path = dir.join(MANIFEST);
    let text = serde_json::to_vec_pretty(&manifest).expect("the manifest serializes");
    let mut file = safe_file::create_private(&path)?;
    file.write_all(&text).map_err(io("write", &path))?;
    file.sync_all().map_err(io("sync", &path))?;
    Ok((ram_data_bytes, disk_seal.bytes))
}

/// Guest RAM into a sparse file: blocks the pager knows to be zero, and blocks whose bytes
/// are all zero, stay holes.
fn write_ram(machine: &Machine, path: &Path) -> Result<(SealedFile, u64), SnapshotError> {
    let ram = machine.ram();
    let file = safe_file::create_private(path)?;
    file.set_len(ram.size()).map_err(io("size", path))?;
    let mut digest = Digest::new();
    let mut buf = vec![0u8; CHUNK];
    let mut data_bytes = 0;
    let mut gpa = 0;
    while gpa < ram.size() {
        let len = (ram.size() - gpa).min(CHUNK as u64);
        let chunk = &mut buf[..usize::try_from(len).expect("a chunk")];
        if read_touched(machine, gpa, chunk, &mut digest)? {
            // Only pages with data are written; the rest stay holes.
            for (i, page) in chunk.chunks(PAGE as usize).enumerate() {
                if page.iter().any(|&b| b != 0) {
                    let at = gpa + i as u64 * PAGE;
                    file.write_all_at(page, at).map_err(io("write", path))?;
                    data_bytes += PAGE;
                }
            }
        }
        gpa += len;
    }
    file.sync_all().map_err(io("sync", path))?;
    Ok((digest.seal(RAM), data_bytes))
}

/// Guest RAM into a compressed store of 64 KiB blocks: blocks never touched or all zero are
/// left out (they read as zeros).
fn write_ram_store(
    machine: &Machine,
    dir: &Path,
    codec: CodecConfig,
) -> Result<(SealedFile, u64), SnapshotError> {
    let ram = machine.ram();
    let mut store = DiskStore::create(
        dir,
        StoreConfig {
            block_size: BlockSize::default(),
            codec,
            image_size: ram.size(),
        },
    )?;
    let mut buf = vec![0u8; BlockSize::default().bytes()];
    let mut digest = Digest::new();
    let mut data_bytes = 0;
    for block in 0..store.blocks() {
        let len = store.block_len(block);
        let gpa = block * buf.len() as u64;
        let chunk = &mut buf[..len];
        if read_touched(machine, gpa, chunk, &mut digest)? && chunk.iter().any(|&b| b != 0) {
            store.put(block, chunk)?;
            data_bytes += len as u64;
        }
    }
    store.commit()?;
    Ok((digest.seal(RAM_STORE), data_bytes))
}

/// Reads the guest's bytes at `gpa` into `chunk` and adds them to `digest`, unless the pager
/// knows every page there to be untouched: then zeros go into the digest, `chunk` is left as
/// it is, and the answer is false.
fn read_touched(
    machine: &Machine,
    gpa: u64,
    chunk: &mut [u8],
    digest: &mut Digest,
) -> Result<bool, SnapshotError> {
    let len = chunk.len() as u64;
    let untouched = (gpa / PAGE..(gpa + len) / PAGE)
        .all(|p| machine.pager().page_state(p * PAGE) == PageState::Zero);
    if untouched {
        digest.update_zeros(chunk.len());
        return Ok(false);
    }
    machine
        .ram()
        .memory()
        .read_slice(chunk, GuestAddress(gpa))
        .map_err(|e| SnapshotError::GuestMemory { gpa, source: e })?;
    digest.update(chunk);
    Ok(true)
}

/// Copies the open file `from` (named `from_path`) to the new file `to` (0600 from the
/// start), with the seal of what was written.
fn copy_sealed(from: &File, from_path: &Path, to: &Path) -> Result<SealedFile, SnapshotError> {
    let copied = safe_file::create_private(to)?;
    copy_from_start(from, from_path, &copied)?;
    copied.sync_all().map_err(io("sync", to))?;
    digest_open(&copied, to, DISK)
}

/// Copies all of the open file `from` (named `from_path`) into `to`, from their current
/// offsets (the kernel's `copy_file_range` where it can, as `std::fs::copy`). `from` is
/// rewound first; its offset is not used by anyone else (the disk is read with `pread`).
fn copy_from_start(mut from: &File, from_path: &Path, mut to: &File) -> Result<(), SnapshotError> {
    from.seek(SeekFrom::Start(0))
        .map_err(io("rewind", from_path))?;
    std::io::copy(&mut from, &mut to).map_err(io("copy", from_path))?;
    Ok(())
}

/// The seal of the open file `file` (named `path`), read from its start.
fn digest_open(mut file: &File, path: &Path, name: &str) -> Result<SealedFile, SnapshotError> {
    file.seek(SeekFrom::Start(0)).map_err(io("rewind", path))?;
    let mut digest = Digest::new();
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = file.read(&mut buf).map_err(io("read", path))?;
        if n == 0 {
            break;
        }
        digest.update(&buf[..n]);
    }
    Ok(digest.seal(name))
}

/// Makes every file read-only and every directory unwritable, for the owner only (they were
/// created owner-only: this only takes the write bits away). A store's lock file goes:
/// readers of a store without one lock its index, which they can open read-only.
fn seal(dir: &Path) -> Result<(), SnapshotError> {
    let _ = std::fs::remove_file(dir.join(RAM_STORE).join("lock"));
    seal_tree(dir)
}

fn seal_tree(dir: &Path) -> Result<(), SnapshotError> {
    for entry in std::fs::read_dir(dir).map_err(io("list", dir))? {
        let entry = entry.map_err(io("list", dir))?;
        let path = entry.path();
        // `file_type` does not follow links: only what this function wrote is sealed.
        if entry.file_type().map_err(io("stat", &path))?.is_dir() {
            seal_tree(&path)?;
        } else {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(SEALED_FILE_MODE))
                .map_err(io("seal", &path))?;
        }
    }
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("sync", dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(SEALED_DIR_MODE))
        .map_err(io("seal", dir))
}

/// Reads a snapshot's manifest without checking its files (see [`Snapshot::open`]).
pub fn read_manifest(dir: &Path) -> Result<Manifest, SnapshotError> {
    let path = dir.join(MANIFEST);
    let bad = |reason: String| SnapshotError::Manifest {
        path: path.clone(),
        reason,
    };
    let text = safe_file::read_bounded(&path, MANIFEST_LIMIT).map_err(|source| {
        SnapshotError::ManifestFile {
            path: path.clone(),
            source,
        }
    })?;
    let manifest: Manifest = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
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
    // The files are the ones `write` makes, in this directory: a manifest naming another
    // file (`../x`, `/x`, or the RAM image as the disk) would have that file checked and
    // another one used.
    let ram_name = match manifest.ram_format {
        RamFormat::Raw => RAM,
        RamFormat::Store => RAM_STORE,
    };
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

/// A snapshot whose seal has been checked.
#[derive(Debug)]
pub struct Snapshot {
    manifest: Manifest,
    ram: RestoreRam,
    /// The disk image, open: the file whose seal was checked is the one copied.
    disk: File,
    disk_path: PathBuf,
}

impl Snapshot {
    /// Opens `dir` and checks every file against the manifest's digests.
    pub fn open(dir: &Path) -> Result<Self, SnapshotError> {
        let manifest = read_manifest(dir)?;
        // Each file is opened once, checked, and that open file is what is used: nothing is
        // opened again by its name, which could by then name another file.
        let disk_path = dir.join(DISK);
        let disk = open_sealed(&disk_path, &manifest.disk)?;
        let ram_path = dir.join(&manifest.ram.name);
        let ram = match manifest.ram_format {
            RamFormat::Raw => RestoreRam::Image(Arc::new(open_sealed(&ram_path, &manifest.ram)?)),
            RamFormat::Store => {
                let store = DiskStore::open_read_only(&ram_path)?;
                let found = digest_store(&store)?;
                compare_seal(&ram_path, &found, &manifest.ram)?;
                RestoreRam::Source(Arc::new(StoreSource::new(store)))
            }
        };
        Ok(Self {
            manifest,
            ram,
            disk,
            disk_path,
        })
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Gives a VM its own copy of the disk at `disk` and what its machine restores from.
    pub fn restore(&self, disk: &Path) -> Result<Restore, SnapshotError> {
        let copy = safe_file::open_regular(
            disk,
            OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(PRIVATE_FILE_MODE),
        )?;
        // A file that appeared there since `--disk` was checked, planted by another user who
        // keeps it open, would get the guest's disk: only a file of ours is written.
        let owner = copy.metadata().map_err(io("stat", disk))?.uid();
        // SAFETY: geteuid cannot fail.
        let own = unsafe { libc::geteuid() };
        if owner != own {
            return Err(SnapshotError::DiskNotOurs {
                path: disk.to_path_buf(),
                owner,
            });
        }
        // An existing file keeps its mode through `open`: the VM's own, before any byte.
        copy.set_permissions(std::fs::Permissions::from_mode(PRIVATE_FILE_MODE))
            .map_err(io("make private", disk))?;
        copy.set_len(0).map_err(io("truncate", disk))?;
        copy_from_start(&self.disk, &self.disk_path, &copy)?;
        Ok(Restore {
            ram: self.ram.clone(),
            vcpu: self.manifest.vcpu.clone(),
            filled: self.manifest.app_bytes,
        })
    }
}

/// Opens `path` (a regular file, not through a link), checks it against its seal and
/// returns it open.
fn open_sealed(path: &Path, sealed: &SealedFile) -> Result<File, SnapshotError> {
    let file = safe_file::open_read(path)?;
    compare_seal(path, &digest_open(&file, path, &sealed.name)?, sealed)?;
    Ok(file)
}

fn compare_seal(path: &Path, found: &SealedFile, sealed: &SealedFile) -> Result<(), SnapshotError> {
    if found.bytes != sealed.bytes {
        return Err(SnapshotError::Seal {
            path: path.to_path_buf(),
            what: format!("{} bytes, sealed with {}", found.bytes, sealed.bytes),
        });
    }
    if found.xxh3_128 != sealed.xxh3_128 {
        return Err(SnapshotError::Seal {
            path: path.to_path_buf(),
            what: format!("xxh3-128 {}, sealed as {}", found.xxh3_128, sealed.xxh3_128),
        });
    }
    Ok(())
}

/// The digest of the image a store holds (every block read, checked and decoded).
fn digest_store(store: &DiskStore) -> Result<SealedFile, SnapshotError> {
    let mut digest = Digest::new();
    let mut buf = vec![0u8; store.block_size().bytes()];
    for block in 0..store.blocks() {
        let chunk = &mut buf[..store.block_len(block)];
        store.get(block, chunk)?;
        digest.update(chunk);
    }
    Ok(digest.seal(RAM_STORE))
}

/// What offloading a restored VM's private pages did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PrivateOffloadReport {
    /// Pages the VM had written since the restore (its private copies).
    pub private_pages: u64,
    /// Bytes the store holds for them.
    pub stored_bytes: u64,
    /// Wall time, milliseconds.
    pub elapsed_ms: f64,
}

/// What bringing them back did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PrivateLoadReport {
    /// Pages written back.
    pub pages: u64,
    /// Wall time, milliseconds.
    pub elapsed_ms: f64,
}

/// Writes the private pages of a paused restored VM to a fresh store in `dir`, makes it
/// durable, then drops them (the image's bytes show again until [`load_private`]).
pub fn offload_private(
    ram: &GuestRam,
    dir: &Path,
    codec: CodecConfig,
) -> Result<PrivateOffloadReport, SnapshotError> {
    let started = Instant::now();
    let pages = ram
        .resident_pages()
        .map_err(io(
            "read /proc/self/pagemap",
            Path::new("/proc/self/pagemap"),
        ))?
        .0;
    let _ = std::fs::remove_dir_all(dir);
    let mut store = DiskStore::create(
        dir,
        StoreConfig {
            block_size: BlockSize::new(PAGE).expect("4 KiB is a block size"),
            codec,
            image_size: ram.size(),
        },
    )?;
    let mut buf = vec![0u8; PAGE as usize];
    for &page in &pages {
        let gpa = page * PAGE;
        ram.memory()
            .read_slice(&mut buf, GuestAddress(gpa))
            .map_err(|e| SnapshotError::GuestMemory { gpa, source: e })?;
        store.put(page, &buf)?;
    }
    store.commit()?;
    let stored_bytes = store.stats().stored_bytes;
    // Durable: now the private copies can go, a run at a time.
    for (start, end) in crate::memory::page_runs(&pages) {
        let range = ram
            .host_range(start * PAGE, (end - start) * PAGE)
            .expect("pages of RAM");
        // SAFETY: our own guest RAM, paused; its private bytes are durable in the store and
        // `load_private` writes them back before the vCPU runs again.
        let rc = unsafe {
            libc::madvise(
                range.start().as_ptr(),
                usize::try_from(range.len()).expect("a RAM range"),
                libc::MADV_DONTNEED,
            )
        };
        if rc != 0 {
            return Err(io("drop", dir)(std::io::Error::last_os_error()));
        }
    }
    Ok(PrivateOffloadReport {
        private_pages: pages.len() as u64,
        stored_bytes,
        elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
    })
}

/// Writes the pages [`offload_private`] stored back into RAM, then removes the store.
pub fn load_private(ram: &GuestRam, dir: &Path) -> Result<PrivateLoadReport, SnapshotError> {
    let started = Instant::now();
    let store = DiskStore::open(dir)?;
    let mut buf = vec![0u8; PAGE as usize];
    let mut pages = 0;
    for block in 0..store.blocks() {
        if store.get(block, &mut buf)?.is_none() {
            continue;
        }
        let gpa = block * PAGE;
        ram.memory()
            .write_slice(&buf, GuestAddress(gpa))
            .map_err(|e| SnapshotError::GuestMemory { gpa, source: e })?;
        pages += 1;
    }
    drop(store);
    std::fs::remove_dir_all(dir).map_err(io("remove", dir))?;
    Ok(PrivateLoadReport {
        pages,
        elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
    })
}

#[cfg(test)]
mod tests {
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
