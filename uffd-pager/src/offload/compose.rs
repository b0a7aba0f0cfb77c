//! Composing the blocks an offload writes, each from its pages' current homes, and telling
//! the store's record of clean blocks ([`super::clean`]) what each one holds.

use std::cell::RefCell;

use compressed_backing::bulk::BlockSource;
use compressed_backing::StoreReader;

use crate::addr::PAGE_SIZE;
use crate::pager::Shared;
use crate::source::PageSource;
use crate::state::PageState;

thread_local! {
    /// Per-thread buffers for the old stored block, the restore block and the pooled block of
    /// a mixed block.
    static COMPOSE: RefCell<(Vec<u8>, Vec<u8>, Vec<u8>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Builds each block to write from its pages' current homes: resident pages from memory,
/// stored pages from the store as it was, restore pages from the restore image, zeros.
pub(super) struct Composer<'a> {
    pub(super) shared: &'a Shared,
    pub(super) stored: &'a StoreReader,
}

impl BlockSource for Composer<'_> {
    fn prepare(&self, block_bytes: usize) {
        COMPOSE.with(|scratch| {
            let (old, restore, pooled) = &mut *scratch.borrow_mut();
            for buf in [old, restore, pooled] {
                buf.resize(block_bytes, 0);
            }
        });
    }

    fn block<'s>(&'s self, block: u64, buf: &mut [u8]) -> std::io::Result<Option<&'s [u8]>> {
        let shared = self.shared;
        let first = block * shared.block_size.pages() as u64;
        let len = buf.len();
        let pages = len as u64 / PAGE_SIZE;
        // A block that is wholly resident in one region is encoded from guest memory as it is.
        // SAFETY: the VM is paused, so nothing writes the pages while the slice lives, and
        // they stay resident until the offload's write is done (drops come after).
        if let Some(bytes) = unsafe { resident_block(shared, block, len) } {
            shared.stored_hashes.composed(block, bytes);
            return Ok(Some(bytes));
        }
        COMPOSE.with(|scratch| {
            let (old, restore, pooled) = &mut *scratch.borrow_mut();
            let (mut have_old, mut have_restore, mut have_pooled) = (false, false, false);
            for page in first..first + pages {
                let at = ((page - first) * PAGE_SIZE) as usize;
                let dst = &mut buf[at..at + PAGE_SIZE as usize];
                match shared.table.get(page) {
                    PageState::Resident | PageState::Dropping => {
                        let region = shared
                            .region_of_page(page)
                            .expect("a resident page lies in a region");
                        let view = region.view_of(page).expect("checked before the offload");
                        let src = view.as_ptr().cast::<u8>().cast_const();
                        // SAFETY: the region's view is mapped for the pager's lifetime and the
                        // page is resident, so reading it does not fault into the pager; the
                        // VM is paused, so nothing writes it meanwhile.
                        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
                    }
                    PageState::Stored => {
                        if !have_old {
                            old.resize(len, 0);
                            self.stored.get(block, old).map_err(std::io::Error::other)?;
                            have_old = true;
                        }
                        dst.copy_from_slice(&old[at..at + PAGE_SIZE as usize]);
                    }
                    PageState::Source => {
                        if !have_restore {
                            let source = shared.restore.as_ref().ok_or_else(|| {
                                std::io::Error::other("a restore-state page without a source")
                            })?;
                            restore.resize(len, 0);
                            let offset = block * shared.block_size.bytes_u64();
                            source
                                .read(offset, restore, &mut 0)
                                .map_err(std::io::Error::other)?;
                            have_restore = true;
                        }
                        dst.copy_from_slice(&restore[at..at + PAGE_SIZE as usize]);
                    }
                    PageState::Pooled => {
                        if !have_pooled {
                            let pool = shared.pool.get().ok_or_else(|| {
                                std::io::Error::other("a pooled page without a pool")
                            })?;
                            pooled.resize(len, 0);
                            let offset = block * shared.block_size.bytes_u64();
                            pool.read(offset, pooled, &mut 0)
                                .map_err(std::io::Error::other)?;
                            have_pooled = true;
                        }
                        dst.copy_from_slice(&pooled[at..at + PAGE_SIZE as usize]);
                    }
                    PageState::Zero => dst.fill(0),
                }
            }
            Ok::<(), std::io::Error>(())
        })?;
        shared.stored_hashes.composed(block, buf);
        Ok(None)
    }
}

/// The bytes of `block` (`len` of them) in guest memory, if every page of it is resident in
/// one region.
///
/// # Safety
///
/// Nothing may write the pages, nor drop them, while the slice lives: the VM is paused (or its
/// vCPU is out of the guest) and the offload drops them only after.
pub(super) unsafe fn resident_block(shared: &Shared, block: u64, len: usize) -> Option<&[u8]> {
    let first = block * shared.block_size.pages() as u64;
    let pages = len as u64 / PAGE_SIZE;
    let region = shared.region_of_page(first)?;
    if !region.pages().contains(&(first + pages - 1))
        || !shared.table.all(first..first + pages, PageState::Resident)
    {
        return None;
    }
    let view = region.view_of(first).expect("checked before the offload");
    let start = view.as_ptr().cast::<u8>().cast_const();
    // SAFETY: the region's view is mapped for the pager's lifetime (checked before the
    // offload), which outlives `shared`'s borrow; the pages are resident, so reading them
    // does not fault into the pager; the caller keeps them unwritten and resident meanwhile.
    Some(unsafe { std::slice::from_raw_parts(start, len) })
}

/// Composes `block` into `buf` (`len` bytes) where each of its pages is resident or was never
/// touched (zeros), and at least one is resident: the bytes an offload would write for it.
/// `false` (and `buf` unspecified) where a page lies elsewhere.
///
/// # Safety
///
/// As [`resident_block`], while this runs.
pub(super) unsafe fn resident_or_zero_block(
    shared: &Shared,
    block: u64,
    len: usize,
    buf: &mut Vec<u8>,
) -> bool {
    let first = block * shared.block_size.pages() as u64;
    let pages = first..first + len as u64 / PAGE_SIZE;
    if !shared.table.any(pages.clone(), PageState::Resident) {
        return false;
    }
    buf.resize(len, 0);
    for page in pages {
        let at = ((page - first) * PAGE_SIZE) as usize;
        let dst = &mut buf[at..at + PAGE_SIZE as usize];
        match shared.table.get(page) {
            PageState::Zero => dst.fill(0),
            PageState::Resident => {
                let Some(view) = shared.region_of_page(page).and_then(|r| r.view_of(page)) else {
                    return false;
                };
                // SAFETY: the view is mapped for the pager's lifetime and the page is
                // resident, so reading it does not fault into the pager; the caller keeps
                // it unwritten meanwhile.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        view.as_ptr().cast::<u8>().cast_const(),
                        dst.as_mut_ptr(),
                        dst.len(),
                    );
                }
            }
            _ => return false,
        }
    }
    true
}
