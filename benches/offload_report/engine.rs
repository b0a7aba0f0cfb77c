//! The write engine alone: the touched bytes written to a fresh file in batches of the default
//! size, each batch made durable before the next, (a) through the page cache as the store
//! does it (`pwrite`, `sync_file_range(WAIT_BEFORE|WRITE|WAIT_AFTER)`,
//! `POSIX_FADV_DONTNEED`, `fdatasync`) and (b) with `O_DIRECT` (`pwrite` of the aligned
//! buffer, `fdatasync`). Both leave no page cache behind; this measures what each costs.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::Instant;

use crate::common::{self, Res};
use crate::MIB;

/// The two engines, by key.
pub const ENGINES: [&str; 2] = ["buffered", "direct"];

fn check(rc: libc::c_int, what: &str) -> Res<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("{what}: {}", std::io::Error::last_os_error()).into())
    }
}

fn batch_durable(file: &File, engine: &str, at: u64, len: usize) -> Res<()> {
    if engine == "buffered" {
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        let (Ok(offset), Ok(len)) = (libc::off64_t::try_from(at), libc::off64_t::try_from(len))
        else {
            return Err("offset out of range".into());
        };
        // SAFETY: sync_file_range on our own descriptor; it only writes back and waits.
        let rc = unsafe { libc::sync_file_range(file.as_raw_fd(), offset, len, flags) };
        check(rc, "sync_file_range")?;
        // SAFETY: fadvise on our own descriptor; it returns the error number itself.
        let rc =
            unsafe { libc::posix_fadvise(file.as_raw_fd(), offset, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(format!("fadvise: {}", std::io::Error::from_raw_os_error(rc)).into());
        }
    }
    file.sync_data()?;
    Ok(())
}

/// Writes `total` bytes in `batch`-byte batches with `engine`; returns ms per MiB.
pub fn measure(dir: &Path, engine: &str, total: usize, batch: usize) -> Res<f64> {
    let path = dir.join(format!("engine-{engine}"));
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    if engine == "direct" {
        options.custom_flags(libc::O_DIRECT);
    }
    let file = options.open(&path)?;
    // A page-aligned buffer (O_DIRECT needs aligned memory), written before the clock starts.
    let buf = testkit::Mapping::anon(batch);
    // SAFETY: the mapping is live, `batch` long, and only this function uses it.
    let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), batch) };
    bytes.copy_from_slice(&common::random(batch, common::RANDOM_SEED));
    let started = Instant::now();
    let mut at = 0u64;
    while (at as usize) < total {
        file.write_all_at(bytes, at)?;
        batch_durable(&file, engine, at, batch)?;
        at += batch as u64;
    }
    let ms = started.elapsed().as_secs_f64() * 1e3;
    drop(file);
    std::fs::remove_file(&path)?;
    Ok(ms / (total as f64 / MIB as f64))
}
