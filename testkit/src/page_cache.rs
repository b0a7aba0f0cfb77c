//! What of a file is in the page cache, read with `mincore` (a store that should leave none
//! behind is checked with it).

use std::path::Path;

/// Bytes of the files in `dir` that are in the page cache (`mincore` of a mapping that is
/// never read).
pub fn cached_bytes(dir: &Path) -> u64 {
    use std::os::fd::AsRawFd;
    let mut total = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    for entry in entries.filter_map(Result::ok) {
        let Ok(file) = std::fs::File::open(entry.path()) else {
            continue;
        };
        let Ok(len) = usize::try_from(file.metadata().map_or(0, |m| m.len())) else {
            continue;
        };
        if len == 0 || !entry.path().is_file() {
            continue;
        }
        // SAFETY: a new read-only shared mapping of a file we hold open; never dereferenced,
        // unmapped below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            continue;
        }
        let mut resident = vec![0u8; len.div_ceil(4096)];
        // SAFETY: `resident` has one byte per page of the mapping.
        if unsafe { libc::mincore(addr, len, resident.as_mut_ptr()) } == 0 {
            total += resident.iter().filter(|&&b| b & 1 == 1).count() as u64 * 4096;
        }
        // SAFETY: unmapping the mapping made above.
        unsafe { libc::munmap(addr, len) };
    }
    total
}

/// Asks the kernel to drop the page cache of the files in `dir` (`POSIX_FADV_DONTNEED`; dirty
/// pages are written back first by the caller's `sync`, or stay). Errors are ignored: what is
/// left is what [`cached_bytes`] reports.
pub fn drop_cached(dir: &Path) {
    use std::os::fd::AsRawFd;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        if let Ok(file) = std::fs::File::open(entry.path()) {
            // SAFETY: advice on a descriptor we hold open; no memory is involved.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }
}
