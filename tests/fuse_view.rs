//! The FUSE view of a compressed store through the real `/dev/fuse`: plain reads, `pwrite`,
//! `MAP_SHARED` and `MAP_PRIVATE` mappings, unmount, and the store's contents afterwards; and
//! the read-only view of a `StoreReader` while the store's owner goes on writing it.
//!
//! Needs `/dev/fuse` and the right to call `mount(2)` (root); set
//! `PVISOR_SKIP_DEVICE_TESTS=1` to skip where FUSE is not available.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use compressed_backing::fuse::{self, FuseOptions, MountedStore};
use compressed_backing::{BlockSize, Codec, CodecConfig, DiskStore, StoreConfig, StoreOptions};
use memmap2::{Mmap, MmapMut, MmapOptions};
use testkit::random_bytes;

const IMAGE_SIZE: u64 = 16 << 20;
const BS: usize = 64 << 10;
const BLOCKS: usize = IMAGE_SIZE as usize / BS;

/// Held for reading by every test, for writing by the one that spawns `setpriv` children.
/// `fork` copies the whole descriptor table of the test process, and the child holds it until
/// it `exec`s (measured 1 to 30 ms on two busy cores): meanwhile another test's store flock
/// stays taken (`Locked` on reopen) and its `/dev/fuse` and image files stay open (`EBUSY` on
/// an outside `umount`). Tests that mount do not run while children are being spawned.
static SPAWNS: RwLock<()> = RwLock::new(());

fn without_children() -> RwLockReadGuard<'static, ()> {
    SPAWNS
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn with_children() -> RwLockWriteGuard<'static, ()> {
    SPAWNS
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// True when FUSE can be used; false (after saying so) when the caller asked to skip device
/// tests; panics with what is missing otherwise.
fn fuse_available() -> bool {
    if Path::new("/dev/fuse").exists() {
        return true;
    }
    if std::env::var("PVISOR_SKIP_DEVICE_TESTS").as_deref() == Ok("1") {
        eprintln!("skipping: /dev/fuse is missing and PVISOR_SKIP_DEVICE_TESTS=1");
        return false;
    }
    panic!(
        "/dev/fuse is missing: load the fuse module (modprobe fuse) or set \
         PVISOR_SKIP_DEVICE_TESTS=1 to skip the device tests"
    );
}

/// Bytes unique to `seed` and position that lz4 compresses.
fn structured(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64 / 8).wrapping_mul(seed | 1) >> 2) as u8 ^ seed as u8)
        .collect()
}

/// Creates a 16 MiB store of 64 KiB lz4 blocks holding absent, zero, same-byte, compressible
/// and incompressible blocks; returns the image it holds.
fn create_store(dir: &Path) -> Vec<u8> {
    create_store_with(dir, StoreOptions::default()).1
}

/// `create_store` with explicit options, keeping the store open.
fn create_store_with(dir: &Path, options: StoreOptions) -> (DiskStore, Vec<u8>) {
    let mut store = DiskStore::create_with(
        dir,
        StoreConfig {
            block_size: BlockSize::new(BS as u64).expect("64 KiB is a valid block size"),
            codec: CodecConfig::new(Codec::Lz4),
            image_size: IMAGE_SIZE,
        },
        options,
    )
    .expect("create store");
    let mut image = vec![0u8; IMAGE_SIZE as usize];
    for block in 0..BLOCKS {
        let data = match block % 5 {
            0 => continue, // absent: reads as zeros
            1 => vec![0; BS],
            2 => vec![block as u8 | 1; BS],
            3 => random_bytes(block as u64, BS),
            _ => structured(block as u64, BS),
        };
        store.put(block as u64, &data).expect("put");
        image[block * BS..(block + 1) * BS].copy_from_slice(&data);
    }
    store.commit().expect("commit");
    (store, image)
}

fn mount_store(store_dir: &Path, mnt: &Path, cache_blocks: usize) -> MountedStore {
    let store = DiskStore::open(store_dir).expect("open store");
    let options = FuseOptions {
        cache_blocks,
        ..FuseOptions::default()
    };
    fuse::mount(store, mnt, &options).expect("mount the store (needs root and /dev/fuse)")
}

/// Checks every block of the store at `dir` against `image` and that it verifies clean.
fn assert_store_holds(dir: &Path, image: &[u8]) {
    let store = DiskStore::open(dir).expect("reopen store");
    let mut block = vec![0u8; BS];
    for b in 0..BLOCKS {
        store.get(b as u64, &mut block).expect("get");
        assert!(
            block == image[b * BS..(b + 1) * BS],
            "block {b} differs from the expected image"
        );
    }
    let report = store.verify();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

fn assert_unmounted(mnt: &Path) {
    let parent = mnt.parent().expect("a tempdir has a parent");
    let dev = |p: &Path| fs::metadata(p).expect("stat").dev();
    assert_eq!(
        dev(mnt),
        dev(parent),
        "{} is still a mountpoint",
        mnt.display()
    );
}

fn errno(err: &std::io::Error) -> i32 {
    err.raw_os_error().unwrap_or(0)
}

/// Names of the store's segment files.
fn segment_files(dir: &Path) -> BTreeSet<std::ffi::OsString> {
    fs::read_dir(dir)
        .expect("list store")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "dat"))
        .map(|p| p.file_name().expect("a listed file has a name").to_owned())
        .collect()
}

/// Flips a byte in the middle of a segment file of the store at `dir`.
fn flip_a_segment_byte(dir: &Path) {
    let segment = fs::read_dir(dir)
        .expect("list store")
        .map(|e| e.expect("entry").path())
        .find(|p| p.extension().is_some_and(|e| e == "dat"))
        .expect("a segment file");
    let seg = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&segment)
        .expect("open segment");
    let at = seg.metadata().expect("stat segment").len() / 2;
    let mut byte = [0u8];
    seg.read_exact_at(&mut byte, at).expect("read segment");
    seg.write_all_at(&[byte[0] ^ 0x40], at)
        .expect("write segment");
}

/// The one block of `store` that fails verification.
fn broken_block(store: &DiskStore) -> usize {
    let bad: Vec<u64> = store.verify().problems.iter().map(|p| p.block).collect();
    assert_eq!(bad.len(), 1, "flipping one byte breaks one block: {bad:?}");
    bad[0] as usize
}

/// Overwrites every block of `store` with bytes unlike `create_store`'s and commits.
fn overwrite_and_commit(store: &mut DiskStore, seed: u64) {
    for block in 0..BLOCKS as u64 {
        let data = if block % 3 == 0 {
            random_bytes(block + seed, BS)
        } else {
            structured(block + seed, BS)
        };
        store.put(block, &data).expect("put");
    }
    store.commit().expect("commit");
}

#[test]
fn fuse_view_reads_writes_and_maps_round_trip_to_the_store() {
    let _spawns = without_children();
    if !fuse_available() {
        return;
    }
    let started = Instant::now();
    let store_dir = tempfile::tempdir().expect("tempdir");
    let mnt = tempfile::tempdir().expect("tempdir");
    let mut image = create_store(store_dir.path());
    // A small cache, so the test also exercises eviction write-back.
    let mounted = mount_store(store_dir.path(), mnt.path(), 16);
    let path = mounted.file_path();

    // One plain file of the image's size.
    let names: Vec<_> = fs::read_dir(mnt.path())
        .expect("readdir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names, ["ram"]);
    let meta = fs::metadata(&path).expect("stat");
    assert!(meta.is_file());
    assert_eq!(meta.len(), IMAGE_SIZE);
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);

    // Plain reads decompress.
    assert!(
        fs::read(&path).expect("read") == image,
        "file differs from the image"
    );

    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .expect("open rw");

    // MAP_SHARED read-write: read, write across blocks, msync, munmap.
    {
        // SAFETY: nothing else truncates or writes the mapped file while the mapping lives.
        let mut map = unsafe { MmapMut::map_mut(&file) }.expect("mmap shared");
        assert_eq!(map.len(), IMAGE_SIZE as usize);
        assert!(
            map[..] == image[..],
            "shared mapping differs from the image"
        );
        let unaligned = 3 * BS - 100..3 * BS + 5000;
        let fill = structured(77, unaligned.len());
        map[unaligned.clone()].copy_from_slice(&fill);
        image[unaligned].copy_from_slice(&fill);
        let whole = 10 * BS..13 * BS;
        let fill = random_bytes(78, whole.len());
        map[whole.clone()].copy_from_slice(&fill);
        image[whole].copy_from_slice(&fill);
        map[IMAGE_SIZE as usize - 1] = 0x5A;
        image[IMAGE_SIZE as usize - 1] = 0x5A;
        map.flush().expect("msync");
    }
    let after_msync = mounted.stats();
    assert!(after_msync.writes > 0, "{after_msync:?}");

    // MAP_SHARED written and unmapped without msync: munmap writes it back.
    {
        // SAFETY: as above.
        let mut map = unsafe { MmapMut::map_mut(&file) }.expect("mmap shared");
        let range = 40 * BS + 4096..40 * BS + 3 * 4096;
        map[range.clone()].fill(0xC3);
        image[range].fill(0xC3);
    }

    // MAP_PRIVATE: copy-on-write, the file does not change.
    {
        // SAFETY: as above; the private mapping's writes go to anonymous copies.
        let mut map = unsafe { MmapOptions::new().map_copy(&file) }.expect("mmap private");
        map[5 * BS..6 * BS + 10].fill(0xEE);
        assert_eq!(map[5 * BS + 3], 0xEE);
    }
    let mut check = vec![0u8; BS + 10];
    file.read_exact_at(&mut check, 5 * BS as u64)
        .expect("pread");
    assert!(
        check == image[5 * BS..6 * BS + 10],
        "MAP_PRIVATE writes reached the file"
    );

    // pwrite through the descriptor, unaligned across a block boundary, then fsync.
    let offset = 21 * BS - 3;
    let data = structured(91, BS + 7);
    file.write_all_at(&data, offset as u64).expect("pwrite");
    image[offset..offset + data.len()].copy_from_slice(&data);
    file.sync_all().expect("fsync");
    let after_fsync = mounted.stats();
    assert!(after_fsync.commits > 0, "{after_fsync:?}");
    assert_eq!(after_fsync.writeback_errors, 0, "{after_fsync:?}");

    // The end of the file: short writes, EFBIG, empty reads.
    let tail = file
        .write_at(&[0x11; 8192], IMAGE_SIZE - 4096)
        .expect("write across EOF");
    assert_eq!(tail, 4096);
    image[IMAGE_SIZE as usize - 4096..].fill(0x11);
    let past = file
        .write_at(&[1], IMAGE_SIZE)
        .expect_err("a write past EOF fails");
    assert_eq!(errno(&past), libc::EFBIG, "{past}");
    assert_eq!(
        file.read_at(&mut [0; 16], IMAGE_SIZE)
            .expect("pread at EOF"),
        0
    );

    // The size is fixed; truncating to it is harmless.
    file.set_len(IMAGE_SIZE)
        .expect("ftruncate to the same size");
    let shrink = file
        .set_len(IMAGE_SIZE / 2)
        .expect_err("shrinking is refused");
    assert_eq!(errno(&shrink), libc::EINVAL, "{shrink}");
    assert_eq!(fs::metadata(&path).expect("stat").len(), IMAGE_SIZE);

    // Everything is visible through a fresh read.
    assert!(
        fs::read(&path).expect("read") == image,
        "file differs after writes"
    );
    drop(file);

    let stats = mounted.unmount().expect("unmount");
    assert_unmounted(mnt.path());
    assert!(stats.bytes_read >= IMAGE_SIZE, "{stats:?}");
    assert!(stats.blocks_written_back > 0, "{stats:?}");
    assert!(stats.cache_misses > 0 && stats.cache_hits > 0, "{stats:?}");
    assert_eq!(
        (
            stats.read_errors,
            stats.write_errors,
            stats.writeback_errors
        ),
        (0, 0, 0),
        "{stats:?}"
    );
    assert_store_holds(store_dir.path(), &image);
    eprintln!(
        "fuse_view round trip took {:?}: {stats:?}",
        started.elapsed()
    );
}

#[test]
fn fuse_view_corrupt_block_reads_fail_with_eio() {
    let _spawns = without_children();
    if !fuse_available() {
        return;
    }
    let store_dir = tempfile::tempdir().expect("tempdir");
    let mnt = tempfile::tempdir().expect("tempdir");
    let image = create_store(store_dir.path());
    flip_a_segment_byte(store_dir.path());
    let bad = broken_block(&DiskStore::open_read_only(store_dir.path()).expect("open store"));
    let good = (0..BLOCKS)
        .find(|&b| b != bad && b % 5 == 4)
        .expect("another data block");

    let mounted = mount_store(store_dir.path(), mnt.path(), 8);
    let file = File::open(mounted.file_path()).expect("open");
    let mut buf = vec![0u8; 4096];
    let err = file
        .read_at(&mut buf, (bad * BS + 1000) as u64)
        .expect_err("a corrupt block must not read");
    assert_eq!(errno(&err), libc::EIO, "{err}");
    let whole = fs::read(mounted.file_path()).expect_err("reading the whole file fails too");
    assert_eq!(errno(&whole), libc::EIO, "{whole}");
    file.read_exact_at(&mut buf, (good * BS) as u64)
        .expect("an intact block reads");
    assert!(buf == image[good * BS..good * BS + 4096]);
    assert!(mounted.stats().read_errors > 0);
    drop(file);

    mounted.unmount().expect("unmount");
    assert_unmounted(mnt.path());
}

#[test]
fn fuse_view_unmount_while_open_waits_for_the_last_user() {
    let _spawns = without_children();
    if !fuse_available() {
        return;
    }
    let store_dir = tempfile::tempdir().expect("tempdir");
    let mnt = tempfile::tempdir().expect("tempdir");
    let mut image = create_store(store_dir.path());
    let mounted = mount_store(store_dir.path(), mnt.path(), 16);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(mounted.file_path())
        .expect("open rw");
    let offset = 7 * BS + 123;
    image[offset..offset + 4].copy_from_slice(b"late");

    let user = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        // The mount is detached by now; the open file keeps working.
        file.write_all_at(b"late", offset as u64)
            .expect("write after detach");
        drop(file);
    });
    let stats = mounted.unmount().expect("unmount");
    user.join().expect("user thread");

    assert_unmounted(mnt.path());
    assert!(stats.writes > 0, "{stats:?}");
    assert_store_holds(store_dir.path(), &image);
}

#[test]
fn fuse_view_external_umount_leaves_the_store_committed() {
    let _spawns = without_children();
    if !fuse_available() {
        return;
    }
    let store_dir = tempfile::tempdir().expect("tempdir");
    let mnt = tempfile::tempdir().expect("tempdir");
    let mut image = create_store(store_dir.path());
    let mounted = mount_store(store_dir.path(), mnt.path(), 16);
    let path = mounted.file_path();
    // The tree is fixed: no new files, no removal.
    let create = File::create(mnt.path().join("other")).expect_err("create is refused");
    assert_eq!(errno(&create), libc::EPERM, "{create}");
    let remove = fs::remove_file(&path).expect_err("unlink is refused");
    assert_eq!(errno(&remove), libc::EPERM, "{remove}");
    let file = OpenOptions::new().write(true).open(&path).expect("open wo");
    file.write_all_at(&[0x42; 3000], (30 * BS - 1000) as u64)
        .expect("pwrite");
    image[30 * BS - 1000..30 * BS + 2000].fill(0x42);
    drop(file);

    let target = std::ffi::CString::new(mnt.path().as_os_str().as_encoded_bytes())
        .expect("a tempdir path has no NUL");
    // SAFETY: `target` is a NUL-terminated path that outlives the call.
    let rc = unsafe { libc::umount(target.as_ptr()) };
    assert_eq!(rc, 0, "umount: {}", std::io::Error::last_os_error());
    let stats = mounted.unmount().expect("unmount after an external umount");

    assert_unmounted(mnt.path());
    assert_eq!(stats.writeback_errors, 0, "{stats:?}");
    assert_store_holds(store_dir.path(), &image);
}

#[test]
fn fuse_view_concurrent_mapped_writers_all_land() {
    let _spawns = without_children();
    if !fuse_available() {
        return;
    }
    let store_dir = tempfile::tempdir().expect("tempdir");
    let mnt = tempfile::tempdir().expect("tempdir");
    let mut image = create_store(store_dir.path());
    // Fewer cache entries than blocks touched: write-back on eviction races with faults.
    let mounted = mount_store(store_dir.path(), mnt.path(), 4);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(mounted.file_path())
        .expect("open rw");
    // SAFETY: nothing else truncates the mapped file while the mapping lives.
    let mut map = unsafe { MmapMut::map_mut(&file) }.expect("mmap shared");
    const WRITERS: usize = 4;
    let chunk = IMAGE_SIZE as usize / WRITERS;
    std::thread::scope(|scope| {
        for (i, part) in map.chunks_mut(chunk).enumerate() {
            scope.spawn(move || {
                // Every third page of the quarter, a byte pattern per writer and page.
                for page in (0..part.len() / 4096).step_by(3) {
                    part[page * 4096..page * 4096 + 100].fill((i * 31 + page) as u8);
                }
            });
        }
    });
    for (i, part) in image.chunks_mut(chunk).enumerate() {
        for page in (0..part.len() / 4096).step_by(3) {
            part[page * 4096..page * 4096 + 100].fill((i * 31 + page) as u8);
        }
    }
    map.flush().expect("msync");
    drop(map);
    drop(file);

    let stats = mounted.unmount().expect("unmount");
    assert_eq!(stats.writeback_errors, 0, "{stats:?}");
    assert_store_holds(store_dir.path(), &image);
}

#[test]
fn fuse_view_reader_mount_is_read_only_and_keeps_the_image_of_the_reader() {
    let _spawns = without_children();
    if !fuse_available() {
        return;
    }
    let store_dir = tempfile::tempdir().expect("tempdir");
    let mnt = tempfile::tempdir().expect("tempdir");
    // Small segments, so overwriting the image leaves whole segments dead for compaction.
    let options = StoreOptions {
        segment_max_bytes: 1 << 20,
        ..StoreOptions::default()
    };
    let (mut store, image) = create_store_with(store_dir.path(), options);
    let reader = store.reader();
    let segments_of_reader = segment_files(store_dir.path());
    // The owner goes on writing: every block changes, commit compacts and unlinks segments.
    overwrite_and_commit(&mut store, 1000);
    let remaining = segment_files(store_dir.path());
    assert!(
        segments_of_reader.iter().any(|s| !remaining.contains(s)),
        "compaction removed none of {segments_of_reader:?}"
    );

    let mounted = fuse::mount_reader(reader, mnt.path(), &FuseOptions::default())
        .expect("mount the reader (needs root and /dev/fuse)");
    let path = mounted.file_path();
    // And while it is mounted.
    overwrite_and_commit(&mut store, 2000);

    let names: Vec<_> = fs::read_dir(mnt.path())
        .expect("readdir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names, ["ram"]);
    let meta = fs::metadata(&path).expect("stat");
    assert!(meta.is_file());
    assert_eq!(meta.len(), IMAGE_SIZE);
    assert_eq!(meta.permissions().mode() & 0o777, 0o400);
    assert!(
        fs::read(&path).expect("read") == image,
        "file differs from the image of the reader"
    );

    let file = File::open(&path).expect("open ro");
    // MAP_PRIVATE: the image, and copy-on-write that does not reach the file.
    {
        // SAFETY: the file is read-only and never changes size while the mapping lives.
        let mut map = unsafe { MmapOptions::new().map_copy(&file) }.expect("mmap private");
        assert_eq!(map.len(), IMAGE_SIZE as usize);
        assert!(
            map[..] == image[..],
            "private mapping differs from the image"
        );
        map[7 * BS - 10..7 * BS + 10].fill(0xEE);
        assert_eq!(map[7 * BS], 0xEE);
    }
    // MAP_SHARED read-only works; writable fails on the read-only descriptor.
    {
        // SAFETY: as above.
        let map = unsafe { Mmap::map(&file) }.expect("mmap shared read-only");
        assert!(
            map[..] == image[..],
            "shared mapping differs from the image"
        );
    }
    // SAFETY: as above; the call is expected to fail.
    let shared_rw = unsafe { MmapMut::map_mut(&file) }.expect_err("MAP_SHARED|PROT_WRITE fails");
    assert!(
        [libc::EACCES, libc::EROFS].contains(&errno(&shared_rw)),
        "{shared_rw}"
    );
    let mut check = vec![0u8; 30];
    file.read_exact_at(&mut check, (7 * BS - 10) as u64)
        .expect("pread");
    assert!(check == image[7 * BS - 10..7 * BS + 20]);
    let write = file
        .write_at(&[1], 0)
        .expect_err("a read-only descriptor does not write");
    assert_eq!(errno(&write), libc::EBADF, "{write}");

    // Opening for writing, truncating and chmod are refused.
    for open in [
        OpenOptions::new().write(true).open(&path),
        OpenOptions::new().read(true).write(true).open(&path),
        OpenOptions::new().write(true).truncate(true).open(&path),
    ] {
        let err = open.expect_err("opening for writing is refused");
        assert!([libc::EROFS, libc::EACCES].contains(&errno(&err)), "{err}");
    }
    let chmod = fs::set_permissions(&path, fs::Permissions::from_mode(0o644))
        .expect_err("chmod is refused");
    assert_eq!(errno(&chmod), libc::EROFS, "{chmod}");
    let create = File::create(mnt.path().join("other")).expect_err("create is refused");
    assert!(
        [libc::EROFS, libc::EPERM].contains(&errno(&create)),
        "{create}"
    );
    assert!(
        fs::read(&path).expect("read") == image,
        "file changed after refused writes"
    );
    drop(file);

    let stats = mounted.unmount().expect("unmount");
    assert_unmounted(mnt.path());
    assert!(stats.bytes_read >= IMAGE_SIZE, "{stats:?}");
    assert_eq!(
        (
            stats.writes,
            stats.blocks_written_back,
            stats.commits,
            stats.read_errors,
            stats.writeback_errors
        ),
        (0, 0, 0, 0, 0),
        "{stats:?}"
    );
    // The owner's store is untouched by the view and holds its own last writes.
    let mut block = vec![0u8; BS];
    store.get(3, &mut block).expect("get");
    assert!(block == random_bytes(3 + 2000, BS));
    let report = store.verify();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

#[test]
fn fuse_view_reader_corrupt_block_reads_fail_with_eio() {
    let _spawns = without_children();
    if !fuse_available() {
        return;
    }
    let store_dir = tempfile::tempdir().expect("tempdir");
    let mnt = tempfile::tempdir().expect("tempdir");
    let (store, image) = create_store_with(store_dir.path(), StoreOptions::default());
    let reader = store.reader();
    flip_a_segment_byte(store_dir.path());
    let bad = broken_block(&store);
    let good = (0..BLOCKS)
        .find(|&b| b != bad && b % 5 == 4)
        .expect("another data block");

    let mounted =
        fuse::mount_reader(reader, mnt.path(), &FuseOptions::default()).expect("mount the reader");
    let file = File::open(mounted.file_path()).expect("open");
    let mut buf = vec![0u8; 4096];
    let err = file
        .read_at(&mut buf, (bad * BS + 1000) as u64)
        .expect_err("a corrupt block must not read");
    assert_eq!(errno(&err), libc::EIO, "{err}");
    file.read_exact_at(&mut buf, (good * BS) as u64)
        .expect("an intact block reads");
    assert!(buf == image[good * BS..good * BS + 4096]);
    drop(file);

    let stats = mounted.unmount().expect("unmount");
    assert_unmounted(mnt.path());
    assert!(stats.read_errors > 0, "{stats:?}");
}

#[test]
fn fuse_view_of_a_store_or_reader_is_private_to_its_owner_even_with_allow_other() {
    let _spawns = with_children();
    if !fuse_available() {
        return;
    }
    let store_dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = create_store_with(store_dir.path(), StoreOptions::default());
    let reader = store.reader();
    drop(store);
    for allow_other in [false, true] {
        let options = FuseOptions {
            allow_other,
            ..FuseOptions::default()
        };
        for read_only in [false, true] {
            let mnt = tempfile::tempdir().expect("tempdir");
            let mounted = if read_only {
                fuse::mount_reader(reader.clone(), mnt.path(), &options)
            } else {
                fuse::mount(
                    DiskStore::open(store_dir.path()).expect("open"),
                    mnt.path(),
                    &options,
                )
            }
            .expect("mount (needs root and /dev/fuse)");
            let what = format!("allow_other {allow_other}, read-only {read_only}");
            let file = mounted.file_path();
            let mode = fs::metadata(&file).expect("stat").permissions().mode() & 0o777;
            assert_eq!(mode, if read_only { 0o400 } else { 0o600 }, "{what}");
            let dir_mode = fs::metadata(mnt.path()).expect("stat").permissions().mode() & 0o777;
            assert_eq!(dir_mode, 0o700, "{what}");
            assert!(
                !testkit::nobody_can_read(&file),
                "another user reads: {what}"
            );
            assert!(
                !testkit::nobody_can_list(mnt.path()),
                "another user lists: {what}"
            );
            // The owner still can.
            assert_eq!(
                File::open(&file)
                    .expect("open")
                    .metadata()
                    .expect("stat")
                    .len(),
                IMAGE_SIZE
            );
            mounted.unmount().expect("unmount");
        }
    }
}
