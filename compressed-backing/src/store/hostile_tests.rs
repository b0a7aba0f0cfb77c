//! A store's files in hostile hands: links to other stores, FIFOs, huge or lying indexes,
//! and the modes that keep guest data private.

use super::files::{load_index, INDEX_PIECE, INDEX_READ_WHOLE};
use super::*;
use crate::codec::Codec;
use crate::store::index::Index;
use basics::error_chain;
use std::io::Write;
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

/// Bytes this thread has read through `read(2)` and friends so far.
fn thread_read_bytes() -> u64 {
    let io = fs::read_to_string("/proc/thread-self/io").unwrap();
    io.lines()
        .find_map(|line| line.strip_prefix("rchar: "))
        .unwrap()
        .parse()
        .unwrap()
}

/// Replaces the store's index with a valid header claiming `blocks` blocks, `segments`
/// segments and the last segment ids, over a sparse file of `len(limit)` bytes, where
/// `limit` is the old header-only size limit; returns the file's size.
fn plant_lying_header(dir: &Path, segments: u32, len: impl FnOnce(u64) -> u64) -> u64 {
    let path = dir.join(INDEX_FILE);
    let mut head = fs::read(&path).unwrap()[..index::HEADER_LEN].to_vec();
    // Image size (bytes 29..37), next segment (45..49), segment count (49..53).
    head[29..37].copy_from_slice(&(index::MAX_BLOCKS * BS).to_le_bytes());
    head[45..49].copy_from_slice(&(segment::MAX_ID + 1).to_le_bytes());
    head[49..53].copy_from_slice(&segments.to_le_bytes());
    let size = len(Index::size_limit(&head).unwrap());
    let file = fs::File::create(&path).unwrap();
    (&file).write_all(&head).unwrap();
    file.set_len(size).unwrap();
    size
}

#[test]
fn store_index_header_claiming_the_most_segments_over_a_sparse_file_is_refused_early() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("store");
    drop(filled_store(&dir, 2, 19));
    // 10^8 segments and 2^25 blocks: the header allows about 2.2 GiB, all holes.
    let size = plant_lying_header(&dir, segment::MAX_ID + 1, |limit| limit);
    assert!(size > 2 << 30, "{size}");
    let before = thread_read_bytes();
    let err = DiskStore::open_read_only(&dir).unwrap_err();
    let read = thread_read_bytes() - before;
    assert!(matches!(err, StoreError::IndexCorrupt { .. }), "{err}");
    // The segment table's second entry (id 0 again) is refused: a few bytes were read.
    assert!(read < 4 << 20, "{read} bytes read of a {size} byte index");
}

#[test]
fn store_index_without_segments_longer_than_its_block_tags_allow_is_refused_unread() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("store");
    drop(filled_store(&dir, 2, 21));
    // No segment: every block entry is a one- or two-byte tag, not 25 bytes, so a file of
    // the old limit (about 1.1 GiB) is far too long for its header.
    let size = plant_lying_header(&dir, 0, |limit| limit);
    let before = thread_read_bytes();
    let err = DiskStore::open_read_only(&dir).unwrap_err();
    let read = thread_read_bytes() - before;
    let text = error_chain(&err);
    assert!(text.contains("limit"), "{text}");
    assert!(read < 4 << 20, "{read} bytes read of a {size} byte index");
}

/// A file that remembers the largest buffer it was asked to fill.
struct Watched {
    file: fs::File,
    largest_read: usize,
}

impl io::Read for Watched {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.largest_read = self.largest_read.max(buf.len());
        self.file.read(buf)
    }
}

impl io::Seek for Watched {
    fn seek(&mut self, to: io::SeekFrom) -> io::Result<u64> {
        self.file.seek(to)
    }
}

#[test]
fn store_index_lying_within_its_limits_is_checked_in_bounded_pieces() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("store");
    drop(filled_store(&dir, 2, 23));
    // No segment, 2^25 one-byte tags and the most metadata: within the limits, all holes,
    // refused by its checksum before the file is read into a buffer of its size.
    let size = plant_lying_header(&dir, 0, |_| {
        index::HEADER_LEN as u64
            + 8
            + 2 * index::MAX_BLOCKS
            + 4
            + index::meta_limit(index::MAX_BLOCKS)
            + 16
    });
    let path = dir.join(INDEX_FILE);
    // A plausible trailer: a checksum of zero and the end magic.
    {
        use std::os::unix::fs::FileExt;
        let planted = fs::OpenOptions::new().write(true).open(&path).unwrap();
        planted.write_all_at(b"PVSTEND1", size - 8).unwrap();
    }
    let mut file = Watched {
        file: fs::File::open(&path).unwrap(),
        largest_read: 0,
    };
    let err = load_index(&mut file, size, &path).unwrap_err();
    let text = error_chain(&err);
    assert!(text.contains("checksum"), "{text}");
    assert!(file.largest_read <= INDEX_PIECE, "{}", file.largest_read);
}

#[test]
fn store_index_larger_than_read_whole_is_checked_streaming_and_opens() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("store");
    // 5 Mi blocks, two written: an index of about 5 MiB, checked in pieces first.
    let blocks = 5 << 20;
    let mut store = DiskStore::create(&dir, config(blocks)).unwrap();
    store.put(0, &vec![3; BS as usize]).unwrap();
    store.put(blocks - 1, &vec![0; BS as usize]).unwrap();
    store.commit().unwrap();
    drop(store);
    let size = fs::metadata(dir.join(INDEX_FILE)).unwrap().len();
    assert!(size > INDEX_READ_WHOLE, "{size}");
    let store = DiskStore::open_read_only(&dir).unwrap();
    let mut out = vec![0; BS as usize];
    store.get(0, &mut out).unwrap();
    assert_eq!(out, vec![3; BS as usize]);
    // One flipped byte in the middle: refused by the streamed checksum.
    drop(store);
    let path = dir.join(INDEX_FILE);
    let mut bytes = fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x55;
    fs::write(&path, &bytes).unwrap();
    let err = DiskStore::open_read_only(&dir).unwrap_err();
    assert!(
        error_chain(&err).contains("checksum"),
        "{}",
        error_chain(&err)
    );
}
