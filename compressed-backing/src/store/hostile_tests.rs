//! A store's files in hostile hands: links to other stores, FIFOs, huge or lying indexes,
//! and the modes that keep guest data private.

use super::*;
use crate::codec::Codec;
use std::time::Duration;
use testkit::{mkfifo, mode};

const BS: u64 = 16 << 10;

fn config(blocks: u64) -> StoreConfig {
    StoreConfig {
        block_size: BlockSize::new(BS).unwrap(),
        codec: CodecConfig::new(Codec::Lz4),
        image_size: blocks * BS,
    }
}

/// A store of `blocks` blocks of `byte`-derived data, committed.
fn filled_store(dir: &Path, blocks: u64, byte: u8) -> DiskStore {
    let mut store = DiskStore::create(dir, config(blocks)).unwrap();
    for block in 0..blocks {
        let data: Vec<u8> = (0..BS as usize)
            .map(|i| (i as u8).wrapping_mul(byte) ^ block as u8)
            .collect();
        store.put(block, &data).unwrap();
    }
    store.commit().unwrap();
    store
}

/// Rewrites the store's index as `change` says, with a valid checksum; returns its bytes.
fn plant_index(dir: &Path, change: impl FnOnce(&mut Index)) -> Vec<u8> {
    let path = dir.join(INDEX_FILE);
    let mut index = Index::decode(&fs::read(&path).unwrap()).unwrap();
    change(&mut index);
    let hostile = index.encode();
    fs::write(&path, &hostile).unwrap();
    hostile
}

#[test]
fn store_files_are_owner_only_from_creation() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("store");
    drop(filled_store(&dir, 3, 1));
    assert_eq!(mode(&dir), 0o700, "store directory");
    for entry in fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        assert_eq!(mode(&path), 0o600, "{}", path.display());
    }
}

#[test]
fn store_segment_linked_to_another_store_is_refused_and_left_intact() {
    let root = tempfile::tempdir().unwrap();
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    drop(filled_store(&a, 8, 3));
    drop(filled_store(&b, 1, 5));
    // B's segment 0 (one block committed) becomes a link to A's (eight blocks): opening B
    // to write used to truncate A's segment to B's committed length.
    let a_segment = a.join(segment::file_name(0));
    let before = fs::read(&a_segment).unwrap();
    let b_segment = b.join(segment::file_name(0));
    fs::remove_file(&b_segment).unwrap();
    std::os::unix::fs::symlink(&a_segment, &b_segment).unwrap();
    let err = DiskStore::open(&b).unwrap_err();
    assert!(
        error_chain(&err).contains("symbolic link"),
        "{}",
        error_chain(&err)
    );
    assert_eq!(fs::read(&a_segment).unwrap(), before);
    let a_store = DiskStore::open_read_only(&a).unwrap();
    assert!(a_store.verify().problems.is_empty());
}

#[test]
fn store_index_tmp_linked_elsewhere_is_not_written_through() {
    let root = tempfile::tempdir().unwrap();
    let victim = root.path().join("victim");
    fs::write(&victim, b"precious").unwrap();
    let dir = root.path().join("store");
    let mut store = filled_store(&dir, 2, 7);
    std::os::unix::fs::symlink(&victim, dir.join(INDEX_TMP)).unwrap();
    store.put(0, &vec![1; BS as usize]).unwrap();
    store.commit().unwrap();
    assert_eq!(fs::read(&victim).unwrap(), b"precious");
    assert_eq!(mode(&dir.join(INDEX_FILE)), 0o600);
}

#[test]
fn store_fifo_as_index_or_segment_is_refused_without_hanging() {
    for name in [INDEX_FILE.to_owned(), segment::file_name(0)] {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("store");
        drop(filled_store(&dir, 2, 9));
        fs::remove_file(dir.join(&name)).unwrap();
        mkfifo(&dir.join(&name));
        for writable in [false, true] {
            let dir = dir.clone();
            let result = testkit::within(Duration::from_secs(10), "opening a FIFO", move || {
                DiskStore::open_with(&dir, writable, StoreOptions::default())
                    .map(drop)
                    .map_err(|e| error_chain(&e))
            });
            let err = result.unwrap_err();
            assert!(err.contains("FIFO"), "{name}: {err}");
        }
    }
}

#[test]
fn store_index_that_is_a_huge_sparse_file_is_refused_unread() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("store");
    drop(filled_store(&dir, 2, 11));
    let index = dir.join(INDEX_FILE);
    // A legitimate header followed by 256 MiB of holes: the header says how big the file
    // can be, so it is refused by its size.
    fs::OpenOptions::new()
        .write(true)
        .open(&index)
        .unwrap()
        .set_len(256 << 20)
        .unwrap();
    let err = DiskStore::open_read_only(&dir).unwrap_err();
    let text = error_chain(&err);
    assert!(text.contains("limit"), "{text}");
}

#[test]
fn store_index_with_the_last_segment_id_is_refused_and_store_intact() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("store");
    drop(filled_store(&dir, 2, 13));
    let path = dir.join(INDEX_FILE);
    let hostile = plant_index(&dir, |index| index.next_segment = u32::MAX);
    let err = DiskStore::open(&dir).unwrap_err();
    assert!(matches!(err, StoreError::IndexCorrupt { .. }), "{err}");
    assert_eq!(fs::read(&path).unwrap(), hostile, "nothing is written");
}

#[test]
fn store_segment_ids_running_out_is_an_error_not_a_wrap() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("store");
    let mut store = filled_store(&dir, 2, 15);
    store.next_segment = segment::MAX_ID;
    store.active = None;
    let data: Vec<u8> = (0..BS as usize).map(|i| (i % 251) as u8).collect();
    store.put(0, &data).unwrap();
    store.active = None;
    let err = store.put(1, &data).unwrap_err();
    assert!(err.to_string().contains("every segment id"), "{err}");
    store.rollback().unwrap();
    drop(store);
    let reopened = DiskStore::open_read_only(&dir).unwrap();
    assert!(reopened.verify().problems.is_empty());
}

#[test]
fn store_pack_over_a_hostile_index_is_refused_and_the_old_image_kept() {
    use crate::image::{pack_file, PackOptions};
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("store");
    drop(filled_store(&dir, 4, 17));
    let path = dir.join(INDEX_FILE);
    let hostile = plant_index(&dir, |index| index.next_segment = u32::MAX);
    let segment = dir.join(segment::file_name(0));
    let segment_before = fs::read(&segment).unwrap();
    let raw = root.path().join("mem");
    fs::write(&raw, vec![0x5A; 3 * BS as usize + 7]).unwrap();
    let err = pack_file(&raw, &dir, &PackOptions::default(), &|_| {}).unwrap_err();
    assert!(
        error_chain(&err).contains("next segment"),
        "{}",
        error_chain(&err)
    );
    assert_eq!(fs::read(&path).unwrap(), hostile);
    assert!(fs::read(&segment).unwrap() == segment_before);
}
