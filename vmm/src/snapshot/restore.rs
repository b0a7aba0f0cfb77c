//! Restoring from a snapshot: every file checked against the manifest's digests before
//! anything is mapped; the RAM image mapped privately (copy-on-write) or a store loaded lazily.

use std::fs::{File, OpenOptions};

use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use compressed_backing::file::{self as safe_file, PRIVATE_FILE_MODE};
use compressed_backing::store::DiskStore;
use uffd_pager::source::StoreSource;

use super::*;
use crate::machine::{Restore, RestoreRam};

/// A snapshot whose seal has been checked.
#[derive(Debug)]
pub struct Snapshot {
    manifest: Manifest,
    ram: RestoreRam,
    ram_path: PathBuf,
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
            ram_path,
            disk,
            disk_path,
        })
    }

    /// A snapshot opened and checked elsewhere (in an object store).
    pub(super) fn from_parts(
        manifest: Manifest,
        ram: RestoreRam,
        ram_path: PathBuf,
        disk: File,
        disk_path: PathBuf,
    ) -> Self {
        Self {
            manifest,
            ram,
            ram_path,
            disk,
            disk_path,
        }
    }

    /// Has the pager load a raw image lazily, as it loads a store, instead of mapping it
    /// (for RAM of another kind than snapshot RAM: huge pages, say).
    pub fn loaded(mut self) -> Result<Self, SnapshotError> {
        if let RestoreRam::Image(image) = &self.ram {
            let file = image.try_clone().map_err(io("reopen", &self.ram_path))?;
            let source = uffd_pager::source::RawFileSource::from_file(&self.ram_path, file)
                .map_err(io("stat", &self.ram_path))?;
            self.ram = RestoreRam::Source(Arc::new(source));
        }
        Ok(self)
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
            arenas: self.manifest.arenas.clone(),
        })
    }
}

/// Opens `path` (a regular file, not through a link), checks it against its seal and
/// returns it open.
pub(super) fn open_sealed(path: &Path, sealed: &SealedFile) -> Result<File, SnapshotError> {
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
