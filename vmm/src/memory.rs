//! Guest RAM: one mapping of the configured size, private anonymous (`anon`, the default), a
//! shared memfd (`memfd`), private anonymous or a shared memfd of 2 MiB huge pages (`hugetlb`,
//! `hugetlb-memfd`), or a private mapping of a sealed snapshot image (`snapshot`: the image's
//! page cache is shared by every VM restored from it; a write makes a private copy), through
//! vm-memory.
//!
//! Huge-page RAM is mapped without a reservation (`MAP_NORESERVE`): a huge page is taken from
//! the kernel's pool when the guest first touches it and given back when the pager drops it,
//! so that a VM holds only the huge pages it uses, and surplus pages
//! (`nr_overcommit_hugepages`) go back to the host. The pool is checked first
//! ([`crate::hugepages::HugePool::check`]).

use std::fs::File;
use std::sync::Arc;

use uffd_pager::addr::{HostAddr, HostRange};
use uffd_pager::pager::{RamKind, RegionSpec};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap, MmapRegion,
};

/// Errors creating guest RAM.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The memfd could not be created or sized.
    #[error("cannot create a {size}-byte memfd for guest RAM")]
    Memfd {
        /// Bytes.
        size: u64,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The host's huge-page pool cannot hold this RAM.
    #[error(transparent)]
    HugePages(#[from] crate::hugepages::HugePoolError),
    /// The mapping failed.
    #[error("cannot map {size} bytes of guest RAM")]
    Map {
        /// Bytes.
        size: u64,
        /// The cause: vm-memory's error, or why it was not tried.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// The guest's RAM, guest-physical address 0 up to its size.
#[derive(Debug)]
pub struct GuestRam {
    memory: GuestMemoryMmap,
    size: u64,
    kind: RamKind,
    memfd: Option<Arc<File>>,
    image: Option<Arc<File>>,
}

impl GuestRam {
    /// Maps `image` (a RAM image of exactly `size` bytes) privately: reads come from its page
    /// cache, shared with every other mapping of it; writes stay in this process.
    pub fn from_image(image: Arc<File>, size: u64) -> Result<Self, MemoryError> {
        let map_err =
            |e: Box<dyn std::error::Error + Send + Sync>| MemoryError::Map { size, source: e };
        let len =
            usize::try_from(size).map_err(|_| map_err("too large for this machine".into()))?;
        let region = MmapRegion::build(
            Some(FileOffset::from_arc(Arc::clone(&image), 0)),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_NORESERVE,
        )
        .map_err(|e| map_err(e.into()))?;
        let region = GuestRegionMmap::new(region, GuestAddress(0))
            .ok_or_else(|| map_err("the region does not fit the address space".into()))?;
        Ok(Self {
            memory: GuestMemoryMmap::from_regions(vec![region]).map_err(|e| map_err(e.into()))?,
            size,
            kind: RamKind::Snapshot,
            memfd: None,
            image: Some(image),
        })
    }

    /// Maps `size` bytes of `kind` RAM (nothing is allocated until touched).
    pub fn new(size: u64, kind: RamKind) -> Result<Self, MemoryError> {
        let len = usize::try_from(size).map_err(|_| MemoryError::Map {
            size,
            source: "too large for this machine".into(),
        })?;
        let map_err =
            |e: Box<dyn std::error::Error + Send + Sync>| MemoryError::Map { size, source: e };
        if kind.is_hugetlb() {
            let page = kind.page_size();
            if !page.is_aligned(size) {
                return Err(map_err(
                    format!(
                        "{} RAM is a whole number of {} pages",
                        kind.name(),
                        basics::format_bytes(page.bytes())
                    )
                    .into(),
                ));
            }
            crate::hugepages::HugePool::read()?.check(size / page.bytes())?;
        }
        let (memory, memfd) = match kind {
            RamKind::Hugetlb => (
                one_region(
                    MmapRegionBuilder::new(len)
                        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                        .with_mmap_flags(
                            libc::MAP_ANONYMOUS
                                | libc::MAP_PRIVATE
                                | libc::MAP_NORESERVE
                                | libc::MAP_HUGETLB
                                | libc::MAP_HUGE_2MB,
                        )
                        .with_hugetlbfs(true)
                        .build(),
                )
                .map_err(map_err)?,
                None,
            ),
            RamKind::HugetlbMemfd => {
                let file = Arc::new(memfd(size, libc::MFD_HUGETLB | libc::MFD_HUGE_2MB)?);
                let region = MmapRegionBuilder::new(len)
                    .with_file_offset(FileOffset::from_arc(Arc::clone(&file), 0))
                    .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                    .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
                    .with_hugetlbfs(true)
                    .build();
                (one_region(region).map_err(map_err)?, Some(file))
            }
            RamKind::Anon => (
                GuestMemoryMmap::from_ranges(&[(GuestAddress(0), len)])
                    .map_err(|e| map_err(e.into()))?,
                None,
            ),
            RamKind::Snapshot => {
                return Err(map_err(
                    "snapshot RAM is mapped from an image (GuestRam::from_image)".into(),
                ))
            }
            RamKind::Memfd => {
                let file = memfd(size, 0)?;
                let file = Arc::new(file);
                let region = MmapRegion::from_file(FileOffset::from_arc(Arc::clone(&file), 0), len)
                    .map_err(|e| map_err(e.into()))?;
                let region = GuestRegionMmap::new(region, GuestAddress(0))
                    .ok_or_else(|| map_err("the region does not fit the address space".into()))?;
                (
                    GuestMemoryMmap::from_regions(vec![region]).map_err(|e| map_err(e.into()))?,
                    Some(file),
                )
            }
        };
        Ok(Self {
            memory,
            size,
            kind,
            memfd,
            image: None,
        })
    }

    /// The vm-memory view, for reads and writes by guest-physical address.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.memory
    }

    /// Bytes of RAM.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// How it is mapped.
    pub fn kind(&self) -> RamKind {
        self.kind
    }

    /// The memfd, for memfd RAM.
    pub fn memfd(&self) -> Option<&Arc<File>> {
        self.memfd.as_ref()
    }

    /// The image, for snapshot RAM.
    pub fn image(&self) -> Option<&Arc<File>> {
        self.image.as_ref()
    }

    /// Host address of guest-physical address 0.
    pub fn host_base(&self) -> HostAddr {
        let ptr = self
            .memory
            .get_host_address(GuestAddress(0))
            .expect("guest RAM starts at address 0");
        HostAddr::from_ptr(ptr)
    }

    /// Its host span: (address of guest-physical 0, bytes).
    pub fn span(&self) -> (u64, u64) {
        (self.host_base().0, self.size)
    }

    /// The PSS of its mappings in this process, bytes (0 if smaps cannot be read).
    pub fn pss(&self) -> u64 {
        let (start, len) = self.span();
        crate::stats::range_pss(start, len).unwrap_or(0)
    }

    /// The host range of `[gpa, gpa + len)`, if inside RAM and page-aligned.
    pub fn host_range(&self, gpa: u64, len: u64) -> Option<HostRange> {
        let end = gpa.checked_add(len)?;
        if end > self.size {
            return None;
        }
        HostRange::new(HostAddr(self.host_base().0 + gpa), len).ok()
    }

    /// Guest pages (indices) present in the mapping: those this process holds privately
    /// (anonymous, copied on write), and those mapped from a file's page cache (a snapshot
    /// image, the memory pool), from `/proc/self/pagemap` (bit 63 present, bit 61 file or
    /// shared).
    pub fn resident_pages(&self) -> std::io::Result<(Vec<u64>, Vec<u64>)> {
        use basics::PAGE_SIZE as PAGE;
        use std::os::unix::fs::FileExt;
        const BATCH: u64 = 4096;
        let pagemap = File::open("/proc/self/pagemap")?;
        let first = self.host_base().0 / PAGE;
        let total = self.size / PAGE;
        let mut entries = vec![0u8; 8 * BATCH as usize];
        let (mut private, mut file) = (Vec::new(), Vec::new());
        let mut page = 0;
        while page < total {
            let count = (total - page).min(BATCH);
            let want = usize::try_from(count * 8).expect("a batch");
            pagemap.read_exact_at(&mut entries[..want], (first + page) * 8)?;
            for (i, entry) in entries[..want].chunks_exact(8).enumerate() {
                let entry = u64::from_le_bytes(entry.try_into().expect("8 bytes"));
                if entry >> 63 == 1 {
                    if (entry >> 61) & 1 == 0 {
                        private.push(page + i as u64);
                    } else {
                        file.push(page + i as u64);
                    }
                }
            }
            page += count;
        }
        Ok((private, file))
    }

    /// The region the pager serves: all of RAM, read by the pager where it is mapped.
    pub fn region_spec(&self) -> RegionSpec {
        let range = self.host_range(0, self.size).expect("RAM is page-aligned");
        RegionSpec {
            kind: self.kind,
            range,
            image_offset: 0,
            memfd: self.memfd.clone(),
            memfd_offset: 0,
            view: Some(range.start()),
        }
    }
}

/// Guest memory of one region at guest-physical 0, from a mapping just made.
fn one_region(
    region: Result<MmapRegion, vm_memory::mmap::MmapRegionError>,
) -> Result<GuestMemoryMmap, Box<dyn std::error::Error + Send + Sync>> {
    let region = GuestRegionMmap::new(region?, GuestAddress(0))
        .ok_or("the region does not fit the address space")?;
    Ok(GuestMemoryMmap::from_regions(vec![region])?)
}

/// A memfd of `size` bytes for guest RAM, with `flags` beside `MFD_CLOEXEC`.
fn memfd(size: u64, flags: libc::c_uint) -> Result<File, MemoryError> {
    use std::os::fd::FromRawFd;
    let fail = |source| MemoryError::Memfd { size, source };
    // SAFETY: memfd_create with a valid name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"pvisor-guest-ram".as_ptr(), libc::MFD_CLOEXEC | flags) };
    if fd < 0 {
        return Err(fail(std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor that nobody else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size).map_err(fail)?;
    Ok(file)
}

/// Runs of consecutive page indices in sorted `pages`: `(first, one past the last)`.
pub fn page_runs(pages: &[u64]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &page in pages {
        match runs.last_mut() {
            Some((_, end)) if *end == page => *end += 1,
            _ => runs.push((page, page + 1)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_runs_groups_consecutive_pages() {
        assert_eq!(page_runs(&[]), vec![]);
        assert_eq!(
            page_runs(&[3, 4, 5, 9, 11, 12]),
            vec![(3, 6), (9, 10), (11, 13)]
        );
    }
}
