//! The page cache around each timed write or read: the ballast file that recycles pages, the
//! drop of a file's cached pages and the check that it worked.
//!
//! On the project's VMs (Firecracker guests with free page reporting) a guest page that has
//! not been used for a while has been given back to the host and costs a host page fault
//! (~10 us) when the kernel next hands it out, so a 64 MiB write into the page cache took
//! anywhere from 13 to 190 ms depending on which free pages it happened to get. Reading and
//! dropping ~96 MiB of a ballast file right before a timed section puts pages that were just
//! in use first in line, for the raw file and the store alike, and makes both repeatable.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use basics::PageSize;

use crate::Res;

/// Bytes of the ballast file, more than one image.
const BALLAST: usize = 96 << 20;

/// Writes the round's ballast file (untimed) from repetitions of `bytes`.
pub fn write_ballast(dir: &Path, bytes: &[u8]) -> Res<PathBuf> {
    let path = dir.join("ballast");
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)?;
    let mut offset = 0;
    while offset < BALLAST {
        let chunk = &bytes[..bytes.len().min(BALLAST - offset)];
        file.write_all_at(chunk, offset as u64)?;
        offset += chunk.len();
    }
    file.sync_all()?;
    drop_cached(std::slice::from_ref(&path))?;
    Ok(path)
}

/// Reads the ballast file into the page cache and drops it again (see the module
/// documentation).
pub fn recycle(ballast: &Path) -> Res<()> {
    let file = File::open(ballast)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    loop {
        let n = file.read_at(&mut buf, offset)?;
        if n == 0 {
            break;
        }
        offset += n as u64;
    }
    drop_cached(&[ballast.to_path_buf()])?;
    Ok(())
}

/// Drops the page-cache pages of `files` (fsyncing them first, so all are clean) and returns
/// the share of their pages still resident afterwards (0 when the drop worked).
pub fn drop_cached(files: &[PathBuf]) -> Res<f64> {
    let (mut resident, mut total) = (0u64, 0u64);
    for path in files {
        let file = File::open(path)?;
        file.sync_all()?;
        // SAFETY: a valid open descriptor; the advice only affects the page cache.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc).into());
        }
        if file.metadata()?.len() == 0 {
            continue;
        }
        let pages = resident_pages(&file)?;
        resident += pages.iter().filter(|&&p| p & 1 != 0).count() as u64;
        total += pages.len() as u64;
    }
    Ok(if total == 0 {
        0.0
    } else {
        resident as f64 / total as f64
    })
}

/// `mincore` of a non-empty file: one byte per page, bit 0 set when resident.
fn resident_pages(file: &File) -> Res<Vec<u8>> {
    // SAFETY: a read-only map of a file of this bench that nothing writes meanwhile; it is
    // only passed to mincore, never read.
    let map = unsafe { memmap2::Mmap::map(file)? };
    let mut pages = vec![0u8; map.len().div_ceil(PageSize::BASE.usize())];
    // SAFETY: `map` is a live, page-aligned mapping of `map.len()` bytes and `pages` has one
    // byte per page of it.
    let rc = unsafe {
        libc::mincore(
            map.as_ptr().cast_mut().cast(),
            map.len(),
            pages.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error().into());
    }
    Ok(pages)
}

/// Bytes allocated on disk for `path` (`st_blocks`).
pub fn allocated(path: &Path) -> io::Result<u64> {
    Ok(fs::metadata(path)?.blocks() * 512)
}
