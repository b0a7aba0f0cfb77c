//! ENOSPC while writing a store: the previous committed image stays readable and intact, in
//! the same process (after rollback) and after reopening. Uses a real, small tmpfs so the
//! kernel itself runs out of space; needs root (mount).

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::io::Write;
use std::path::PathBuf;

use compressed_backing::bulk::{self, BulkOptions, SliceSource};
use compressed_backing::{BlockSize, Codec, CodecConfig, DiskStore, StoreConfig};

const BS: usize = 64 << 10;

use testkit::random_bytes as random;

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
    if testkit::skip_unless(&[]) {
        return;
    }
    let fs = testkit::Tmpfs::mount("4m");
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
    if testkit::skip_unless(&[]) {
        return;
    }
    let fs = testkit::Tmpfs::mount("2m");
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
    let mut filler = std::fs::File::create(&filler_path).unwrap();
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
