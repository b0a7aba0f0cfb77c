//! A restored VM's offload: the pages it wrote (present and not file-backed) go to a store of
//! 4 KiB blocks and are dropped, showing the image's bytes again; resume writes them back.

use std::path::Path;
use std::time::Instant;

use compressed_backing::store::{DiskStore, StoreConfig};
use compressed_backing::{BlockSize, CodecConfig};
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::memory::GuestRam;

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
        unsafe { uffd_pager::discard::discard(uffd_pager::pager::RamKind::Snapshot, range, None) }
            .map_err(io("drop", dir))?;
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
