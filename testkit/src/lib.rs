//! Helpers shared by the device tests of every crate: the device check, a small tmpfs to run
//! out of space on, and deterministic test data.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// True if device tests are to be skipped (`PVISOR_SKIP_DEVICE_TESTS=1`). Otherwise panics
/// with a clear message if one of `devices` is missing: a device test must not pass silently
/// on a machine that cannot run it.
pub fn skip_unless(devices: &[&str]) -> bool {
    if std::env::var_os("PVISOR_SKIP_DEVICE_TESTS").is_some_and(|v| v == "1") {
        eprintln!("skipped: PVISOR_SKIP_DEVICE_TESTS=1");
        return true;
    }
    for device in devices {
        assert!(
            Path::new(device).exists(),
            "{device} is missing: this test needs it (PVISOR_SKIP_DEVICE_TESTS=1 skips device tests)"
        );
    }
    false
}

/// A tmpfs of a fixed size (e.g. `"4m"`), unmounted on drop. Needs root.
#[derive(Debug)]
pub struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` on a fresh temporary directory.
    pub fn mount(size: &str) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let target = CString::new(dir.path().as_os_str().as_bytes()).expect("a path without NUL");
        let options = CString::new(format!("size={size},mode=0700")).expect("options without NUL");
        // SAFETY: all pointers are valid NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                options.as_ptr().cast(),
            )
        };
        assert_eq!(
            rc,
            0,
            "mounting a tmpfs needs root (PVISOR_SKIP_DEVICE_TESTS=1 skips device tests): {}",
            std::io::Error::last_os_error()
        );
        Self { dir }
    }

    /// Its mount point.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let target =
            CString::new(self.dir.path().as_os_str().as_bytes()).expect("a path without NUL");
        // SAFETY: a valid NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}

/// `len` pseudo-random (incompressible) bytes from `seed`.
pub fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 29) as u8
        })
        .collect()
}
