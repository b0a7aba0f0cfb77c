//! Writing a snapshot: guest RAM (a sparse raw image, or a compressed store), the disk and
//! the manifest, built in a private partial directory, synced, renamed into place, sealed.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::Path;
use std::time::Instant;

use compressed_backing::file as safe_file;
use compressed_backing::store::{DiskStore, StoreConfig};
use compressed_backing::{BlockSize, CodecConfig};
use uffd_pager::state::PageState;
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::machine::Machine;

/// How a snapshot keeps guest RAM in a compressed store.
#[derive(Debug, Clone, Copy)]
pub struct RamStore {
    /// The codec of its blocks.
    pub codec: CodecConfig,
    /// Its block size: the unit of a lazy restore's reads (one range request each from an
    /// object store), 64 KiB by default (docs/bench/remote.md says why).
    pub block_size: BlockSize,
}

impl RamStore {
    /// A store of `codec` blocks of the default size.
    pub fn new(codec: CodecConfig) -> Self {
        Self {
            codec,
            block_size: BlockSize::default(),
        }
    }
}

/// Writes a sealed snapshot of `machine` (between commands) to `out`, which must not exist:
/// RAM raw, or into a compressed store as `store` says.
pub fn write(
    machine: &Machine,
    vcpus: u32,
    out: &Path,
    store: Option<RamStore>,
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
        write_into(machine, vcpus, &partial, store).and_then(|(ram_data_bytes, disk_bytes)| {
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
pub(super) fn rename_no_replace(from: &Path, to: &Path) -> std::io::Result<()> {
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
    store: Option<RamStore>,
) -> Result<(u64, u64), SnapshotError> {
    let ram = machine.ram();
    let (ram_seal, ram_data_bytes) = match store {
        Some(store) => write_ram_store(machine, &dir.join(RAM_STORE), store)?,
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
        arenas: machine.saved_arenas(),
        vcpu: machine.vcpu_state()?,
        disk: disk_seal.clone(),
        ram: ram_seal,
        ram_index: None,
        leased: false,
        objects: None,
        ram_format: if store.is_some() {
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
    let mut ram_read = RamRead::new(machine);
    while gpa < ram.size() {
        let len = (ram.size() - gpa).min(CHUNK as u64);
        let chunk = &mut buf[..usize::try_from(len).expect("a chunk")];
        if ram_read.read(gpa, chunk, &mut digest)? {
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

/// Guest RAM into a compressed store: blocks never touched or all zero are left out (they
/// read as zeros).
fn write_ram_store(
    machine: &Machine,
    dir: &Path,
    format: RamStore,
) -> Result<(SealedFile, u64), SnapshotError> {
    let ram = machine.ram();
    let mut store = DiskStore::create(
        dir,
        StoreConfig {
            block_size: format.block_size,
            codec: format.codec,
            image_size: ram.size(),
        },
    )?;
    let mut buf = vec![0u8; format.block_size.bytes()];
    let mut digest = Digest::new();
    let mut data_bytes = 0;
    let mut ram_read = RamRead::new(machine);
    for block in 0..store.blocks() {
        let len = store.block_len(block);
        let gpa = block * buf.len() as u64;
        let chunk = &mut buf[..len];
        if ram_read.read(gpa, chunk, &mut digest)? && chunk.iter().any(|&b| b != 0) {
            store.put(block, chunk)?;
            data_bytes += len as u64;
        }
    }
    // The working set travels with the snapshot: the blocks faulted in since the VM's last
    // resume (a restore, a load), in their order, as blocks of this store.
    // A pager block larger than the store's (a 2 MiB one) spans several of them.
    // An offloaded VM's is in its offload store.
    let pager = machine.pager();
    let (recorded, unit) = match pager.working_set() {
        recorded if !recorded.is_empty() => (recorded, pager.block_size().bytes_u64()),
        _ => ram_read.stored_working_set().unwrap_or_default(),
    };
    let ours = buf.len() as u64;
    let mut seen = std::collections::BTreeSet::new();
    let working_set: Vec<u8> = recorded
        .into_iter()
        .flat_map(|block| block * unit / ours..((block + 1) * unit).div_ceil(ours))
        .filter(|&block| block < store.blocks() && seen.insert(block))
        .flat_map(u64::to_le_bytes)
        .collect();
    if !working_set.is_empty() {
        store.set_meta(uffd_pager::offload::WORKING_SET_KEY, working_set)?;
    }
    store.commit()?;
    Ok((digest.seal(RAM_STORE), data_bytes))
}

/// Reads guest RAM for a snapshot without bringing offloaded RAM back: pages the pager holds
/// in its offload store are read from the store, the others from guest memory.
struct RamRead<'a> {
    machine: &'a Machine,
    stored: Option<compressed_backing::StoreReader>,
    /// The store block read last, decoded.
    cached: Option<(u64, Vec<u8>)>,
}

impl<'a> RamRead<'a> {
    fn new(machine: &'a Machine) -> Self {
        Self {
            machine,
            stored: machine.pager().store_reader(),
            cached: None,
        }
    }

    /// The working set the offload store carries (what the VM faulted in before its last
    /// offload), as blocks of the store.
    fn stored_working_set(&self) -> Option<(Vec<u64>, u64)> {
        let reader = self.stored.as_ref()?;
        let bytes = reader.meta(uffd_pager::offload::WORKING_SET_KEY)?;
        let blocks = bytes
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        Some((blocks, reader.block_size().bytes_u64()))
    }

    /// Reads the guest's bytes at `gpa` into `chunk` and adds them to `digest`, unless the
    /// pager knows every page there to be untouched: then zeros go into the digest, `chunk`
    /// is left as it is, and the answer is false.
    fn read(
        &mut self,
        gpa: u64,
        chunk: &mut [u8],
        digest: &mut Digest,
    ) -> Result<bool, SnapshotError> {
        let len = chunk.len() as u64;
        let pager = self.machine.pager();
        let states: Vec<PageState> = (gpa / PAGE..(gpa + len) / PAGE)
            .map(|p| pager.page_state(p * PAGE))
            .collect();
        if states.iter().all(|&s| s == PageState::Zero) {
            digest.update_zeros(chunk.len());
            return Ok(false);
        }
        if !states.contains(&PageState::Stored) {
            self.read_guest(gpa, chunk)?;
        } else {
            for (i, state) in states.iter().enumerate() {
                let at = gpa + i as u64 * PAGE;
                let page = &mut chunk[i * PAGE as usize..(i + 1) * PAGE as usize];
                match state {
                    PageState::Zero => page.fill(0),
                    PageState::Stored => self.read_stored(at, page)?,
                    _ => self.read_guest(at, page)?,
                }
            }
        }
        digest.update(chunk);
        Ok(true)
    }

    fn read_guest(&self, gpa: u64, chunk: &mut [u8]) -> Result<(), SnapshotError> {
        self.machine
            .ram()
            .memory()
            .read_slice(chunk, GuestAddress(gpa))
            .map_err(|e| SnapshotError::GuestMemory { gpa, source: e })
    }

    fn read_stored(&mut self, gpa: u64, page: &mut [u8]) -> Result<(), SnapshotError> {
        let Some(reader) = &self.stored else {
            return self.read_guest(gpa, page);
        };
        let size = reader.block_size();
        let block = size.index_of(gpa);
        if self.cached.as_ref().is_none_or(|(b, _)| *b != block) {
            let mut buf = vec![0u8; size.len_in_image(block, reader.image_size())];
            reader.get(block, &mut buf)?;
            self.cached = Some((block, buf));
        }
        let (_, buf) = self.cached.as_ref().expect("just read");
        let from = usize::try_from(gpa - block * size.bytes_u64()).expect("inside a block");
        page.copy_from_slice(&buf[from..from + page.len()]);
        Ok(())
    }
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
pub(super) fn copy_from_start(
    mut from: &File,
    from_path: &Path,
    mut to: &File,
) -> Result<(), SnapshotError> {
    from.seek(SeekFrom::Start(0))
        .map_err(io("rewind", from_path))?;
    std::io::copy(&mut from, &mut to).map_err(io("copy", from_path))?;
    Ok(())
}

/// The seal of the open file `file` (named `path`), read from its start.
pub(super) fn digest_open(
    mut file: &File,
    path: &Path,
    name: &str,
) -> Result<SealedFile, SnapshotError> {
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
pub(super) fn seal(dir: &Path) -> Result<(), SnapshotError> {
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
