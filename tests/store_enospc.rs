//! ENOSPC while writing a store: the previous committed image stays readable and intact, in
//! the same process (after rollback) and after reopening. Uses a real, small tmpfs so the
//! kernel itself runs out of space; needs root (mount).

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::ffi::CString;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use compressed_backing::bulk::{self, BulkOptions, SliceSource};
use compressed_backing::{BlockSize, Codec, CodecConfig, DiskStore, StoreConfig};

const BS: usize = 64 << 10;

/// A tmpfs of a fixed size, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Mounts, or returns `None` when device tests are skipped by the environment.
    fn mount(size: &str) -> Option<Self> {
        if std::env::var_os("PVISOR_SKIP_DEVICE_TESTS").is_some_and(|v| v == "1") {
            eprintln!("skipped: PVISOR_SKIP_DEVICE_TESTS=1");
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let target = CString::new(dir.path().as_os_str().as_bytes()).expect("path");
        let options = CString::new(format!("size={size},mode=0700")).expect("options");
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
            "mounting a tmpfs needs root (set PVISOR_SKIP_DEVICE_TESTS=1 to skip): {}",
            std::io::Error::last_os_error()
        );
        Some(Self { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let target = CString::new(self.dir.path().as_os_str().as_bytes()).expect("path");
        // SAFETY: a valid NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}

fn random(seed: u64, len: usize) -> Vec<u8> {
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

fn config(blocks: u64) -> StoreConfig {
    StoreConfig {
        block_size: BlockSize::new(BS as u64).unwrap(),
        codec: CodecConfig::new(Codec::Lz4),
        image_size: blocks * BS as u64,
    }
}

fn assert_image(store: &DiskStore, image: &[u8]) {
    let mut buf = vec![0u8; BS];
    for block in 0..store.blocks() {
        store.get(block, &mut buf).unwrap();
        let start = block as usize * BS;
        assert!(buf[..] == image[start..start + BS], "block {block} differs");
    }
    assert!(store.verify().problems.is_empty());
}

#[test]
fn enospc_during_bulk_write_keeps_the_committed_image() {
    let Some(fs) = Tmpfs::mount("4m") else { return };
    let dir: PathBuf = fs.path().join("store");
    let blocks = 256; // a 16 MiB image on a 4 MiB file system
    let mut committed = vec![0u8; blocks as usize * BS];
    committed[..16 * BS].copy_from_slice(&random(1, 16 * BS));
    let mut store = DiskStore::create(&dir, config(blocks)).unwrap();
    for block in 0..16 {
        let start = block * BS;
        store
            .put(block as u64, &committed[start..start + BS])
            .unwrap();
    }
    store.commit().unwrap();

    let incompressible = random(2, blocks as usize * BS);
    let all = bulk::all_blocks(&store);
    let err = bulk::write_blocks(
        &mut store,
        &SliceSource::new(&incompressible, BS),
        &all,
        &BulkOptions::with_threads(2),
        &|_| {},
    )
    .unwrap_err();
    assert!(err.is_no_space(), "expected ENOSPC, got: {err}");

    store.rollback().unwrap();
    assert_image(&store, &committed);
    drop(store);

    let mut store = DiskStore::open(&dir).unwrap();
    assert_image(&store, &committed);
    // The space the failed write took is given back, and the store takes writes again.
    let fresh = random(3, BS);
    store.put(100, &fresh).unwrap();
    store.commit().unwrap();
    committed[100 * BS..101 * BS].copy_from_slice(&fresh);
    assert_image(&store, &committed);
}

#[test]
fn enospc_during_commit_keeps_the_committed_image() {
    let Some(fs) = Tmpfs::mount("2m") else { return };
    let dir = fs.path().join("store");
    let old = random(4, 4 * BS);
    let mut store = DiskStore::create(&dir, config(4)).unwrap();
    for block in 0..4 {
        store
            .put(block, &old[block as usize * BS..(block as usize + 1) * BS])
            .unwrap();
    }
    store.commit().unwrap();
    let new = random(5, BS);
    store.put(0, &new).unwrap();

    // Fill the file system so that the new index cannot be written.
    let filler_path = fs.path().join("filler");
    let mut filler = OpenOptions::new()
        .create(true)
        .write(true)
        .open(&filler_path)
        .unwrap();
    let chunk = vec![0xAAu8; 4096];
    while filler.write_all(&chunk).is_ok() {}
    drop(filler);

    let err = store.commit().unwrap_err();
    assert!(err.is_no_space(), "expected ENOSPC, got: {err}");
    assert!(
        !dir.join("index.tmp").exists(),
        "a partial index was left behind"
    );
    drop(store);

    let store = DiskStore::open(&dir).unwrap();
    assert_image(&store, &old);
    drop(store);

    // With space again, the same write commits.
    fs::remove_file(&filler_path).unwrap();
    let mut store = DiskStore::open(&dir).unwrap();
    store.put(0, &new).unwrap();
    store.commit().unwrap();
    let mut expect = old.clone();
    expect[..BS].copy_from_slice(&new);
    assert_image(&store, &expect);
}
