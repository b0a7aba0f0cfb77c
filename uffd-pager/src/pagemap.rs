//! Which pages were written: the `PAGEMAP_SCAN` ioctl on `/proc/self/pagemap` over ranges
//! registered for asynchronous write-protection (`UFFD_FEATURE_WP_ASYNC`). A write to a
//! protected page is resolved by the kernel itself (no fault reaches the pager) and leaves
//! the page marked written. A scan reads the marks, then write-protects just the written runs
//! again (`UFFDIO_WRITEPROTECT`), so the next scan sees only the writes in between.
//!
//! The scan itself does not protect (no `PM_SCAN_WP_MATCHING`): protecting through it
//! invalidates the whole scanned range in KVM's MMU, so every guest page, read or written,
//! would have to be mapped into the guest again after each scan (~14 ms per 16 MiB on this
//! nested host). A write between the scan and the re-protection goes unrecorded; that only
//! makes its block look cold early, and cold compression checks the bytes before it drops
//! anything.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use linux_raw_sys::general as sys;

use crate::addr::{HostAddr, HostRange};
use crate::uffd::{iowr, UffdError, Userfaultfd};

/// `PAGEMAP_SCAN`: `_IOWR('f', 16, struct pm_scan_arg)`.
const PAGEMAP_SCAN: u32 = iowr(b'f' as u32, 16, std::mem::size_of::<sys::pm_scan_arg>());

/// Runs of written pages returned per call.
const RUNS_PER_CALL: usize = 512;

/// A reusable `PAGEMAP_SCAN` of this process.
#[derive(Debug)]
pub struct WrittenPages {
    pagemap: File,
    runs: Vec<sys::page_region>,
}

impl WrittenPages {
    /// Opens this process's page map.
    pub fn open() -> io::Result<Self> {
        Ok(Self {
            pagemap: File::open("/proc/self/pagemap")?,
            runs: vec![
                sys::page_region {
                    start: 0,
                    end: 0,
                    categories: 0,
                };
                RUNS_PER_CALL
            ],
        })
    }

    /// Calls `each` with every run of present pages of `range` written since the last call (or
    /// since they were mapped), then write-protects those runs again through `uffd`. Pages
    /// that are not present are neither reported nor touched. `range` must be registered
    /// write-protect on `uffd`, which has `WP_ASYNC` (else `EPERM`).
    pub fn take(
        &mut self,
        uffd: &Userfaultfd,
        range: HostRange,
        mut each: impl FnMut(HostRange),
    ) -> io::Result<()> {
        let mut start = range.start().0;
        let end = range.end().0;
        while start < end {
            let mut arg = sys::pm_scan_arg {
                size: std::mem::size_of::<sys::pm_scan_arg>() as u64,
                flags: u64::from(sys::PM_SCAN_CHECK_WPASYNC),
                start,
                end,
                walk_end: 0,
                vec: self.runs.as_mut_ptr() as u64,
                vec_len: self.runs.len() as u64,
                max_pages: 0,
                category_inverted: 0,
                // Present pages only: the kernel counts an empty entry as written.
                category_mask: u64::from(sys::PAGE_IS_WRITTEN | sys::PAGE_IS_PRESENT),
                category_anyof_mask: 0,
                return_mask: u64::from(sys::PAGE_IS_WRITTEN),
            };
            // SAFETY: `arg` is a valid pm_scan_arg whose `vec` points at `vec_len` page_region
            // slots we own; without PM_SCAN_WP_MATCHING the ioctl only reads page tables.
            let n = unsafe {
                libc::ioctl(
                    self.pagemap.as_raw_fd(),
                    libc::c_ulong::from(PAGEMAP_SCAN),
                    &mut arg as *mut sys::pm_scan_arg,
                )
            };
            let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
            for run in &self.runs[..n.min(self.runs.len())] {
                if let Ok(run) = HostRange::new(HostAddr(run.start), run.end - run.start) {
                    each(run);
                    match uffd.write_protect(run) {
                        // Unmapped meanwhile (the owner is going away): nothing to protect.
                        Ok(()) | Err(UffdError::Unmapped { .. }) => {}
                        Err(e) => return Err(io::Error::other(e)),
                    }
                }
            }
            if arg.walk_end <= start {
                return Err(io::Error::other("PAGEMAP_SCAN made no progress"));
            }
            start = arg.walk_end;
        }
        Ok(())
    }
}
