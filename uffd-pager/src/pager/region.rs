//! The regions a pager serves: where each maps the image, its RAM kind, and the checks that
//! a set of regions makes sense (no overlap, aligned, inside the source's image).

use std::fs::File;
use std::sync::Arc;

use super::*;
use crate::addr::{HostAddr, HostRange, PAGE_SIZE};
use crate::source::PageSource;

/// One range of guest RAM handed to the pager.
#[derive(Debug, Clone)]
pub struct RegionSpec {
    /// How it is mapped.
    pub kind: RamKind,
    /// Where it is mapped in the process that owns the userfaultfd.
    pub range: HostRange,
    /// Its offset in the RAM image (page-aligned; regions are laid end to end in the image).
    pub image_offset: u64,
    /// For memfd RAM: the memfd, to punch holes in on offload.
    pub memfd: Option<Arc<File>>,
    /// For memfd RAM: the offset in the memfd at which the region is mapped.
    pub memfd_offset: u64,
    /// Where the pager can read the region in its own address space: `range.start()` for an
    /// in-process VMM (anonymous RAM is then dropped with `madvise`), the pager's own mapping
    /// of the memfd for memfd RAM of another process (dropped by punching holes), `None` for
    /// memory of another process that is reachable only through its userfaultfd (served, but
    /// never offloaded).
    pub view: Option<HostAddr>,
}

impl RegionSpec {
    /// True if the region is this process's own mapping.
    pub fn in_process(&self) -> bool {
        self.view == Some(self.range.start())
    }

    /// True if the pager can read and drop the region's pages itself.
    pub fn can_offload(&self) -> bool {
        match self.kind {
            RamKind::Anon | RamKind::Hugetlb => self.in_process(),
            RamKind::Memfd | RamKind::HugetlbMemfd => self.view.is_some() && self.memfd.is_some(),
            RamKind::Snapshot => false,
        }
    }
}

/// A region as the pager keeps it.
#[derive(Debug)]
pub(crate) struct Region {
    pub spec: RegionSpec,
    /// Image page index of the region's first page.
    pub first_page: u64,
}

impl Region {
    /// Image pages of the region.
    pub fn pages(&self) -> std::ops::Range<u64> {
        self.first_page..self.first_page + self.spec.range.pages()
    }

    /// Host address of image page `page` (which must be in the region), as the owner of the
    /// userfaultfd sees it.
    pub fn addr_of(&self, page: u64) -> HostAddr {
        self.spec.range.page_addr(page - self.first_page)
    }

    /// The image pages of the page of the mapping that holds image page `page`: the page
    /// alone for base pages, all of its huge page for hugetlb RAM (what one install, drop or
    /// discard covers at least).
    pub fn unit_span(&self, page: u64) -> std::ops::Range<u64> {
        let per_unit = self.spec.kind.page_size().bytes() / PAGE_SIZE;
        // Regions of huge pages start on a huge page in the image (`check_regions`).
        let start = page / per_unit * per_unit;
        start..(start + per_unit).min(self.pages().end)
    }

    /// Where the pager reads image page `page` in its own address space, if it can.
    pub fn view_of(&self, page: u64) -> Option<HostAddr> {
        self.spec
            .view
            .map(|view| HostAddr(view.0 + (page - self.first_page) * PAGE_SIZE))
    }
}

/// Checks that regions do not overlap in memory or in the image and are page-aligned;
/// returns the image size.
pub(super) fn check_regions(
    regions: &[RegionSpec],
    restore: Option<&dyn PageSource>,
    block_size: BlockSize,
) -> Result<u64, PagerError> {
    if regions.is_empty() {
        return Err(PagerError::Regions("no regions".into()));
    }
    let mut image_size = 0u64;
    for (i, region) in regions.iter().enumerate() {
        if region.image_offset % PAGE_SIZE != 0 {
            return Err(PagerError::Regions(format!(
                "region {:?} has image offset {:#x}, not page-aligned",
                region.range, region.image_offset
            )));
        }
        if region.kind.is_memfd() && region.view.is_some() && region.memfd.is_none() {
            return Err(PagerError::Regions(format!(
                "memfd region {:?} comes without its memfd",
                region.range
            )));
        }
        let page = region.kind.page_size();
        if page != PageSize::BASE {
            // Every install, drop and discard covers whole huge pages, and a block holds whole
            // ones, so that the pages of one huge page are always in one state.
            if !page.is_aligned(region.range.start().0)
                || !page.is_aligned(region.range.len())
                || !page.is_aligned(region.image_offset)
                || !page.is_aligned(region.memfd_offset)
            {
                return Err(PagerError::Regions(format!(
                    "{} region {:?} at image offset {:#x} is not aligned to its {} pages",
                    region.kind.name(),
                    region.range,
                    region.image_offset,
                    basics::format_bytes(page.bytes())
                )));
            }
            if block_size.bytes_u64() < page.bytes() {
                return Err(PagerError::Regions(format!(
                    "{} region {:?} has {} pages, larger than the pager's {} blocks",
                    region.kind.name(),
                    region.range,
                    basics::format_bytes(page.bytes()),
                    basics::format_bytes(block_size.bytes_u64())
                )));
            }
        }
        let end = region
            .image_offset
            .checked_add(region.range.len())
            .ok_or_else(|| PagerError::Regions("image offset overflows".into()))?;
        image_size = image_size.max(end);
        for other in &regions[i + 1..] {
            if region.range.overlaps(&other.range) {
                return Err(PagerError::Regions(format!(
                    "regions {:?} and {:?} overlap",
                    region.range, other.range
                )));
            }
            let other_end = other.image_offset + other.range.len();
            if region.image_offset < other_end && other.image_offset < end {
                return Err(PagerError::Regions(format!(
                    "regions {:?} and {:?} overlap in the image",
                    region.range, other.range
                )));
            }
        }
    }
    if let Some(source) = restore {
        if source.image_size() < image_size {
            return Err(PagerError::Regions(format!(
                "the regions need {image_size} bytes of image, the source has {}",
                source.image_size()
            )));
        }
    }
    Ok(image_size)
}
