use super::*;
use crate::codec::Codec;
use basics::error_chain;
use proptest::prelude::*;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use testkit::random_bytes;

const BS: u64 = 16 << 10;

fn config(blocks: u64, codec: Codec) -> StoreConfig {
    StoreConfig {
        block_size: BlockSize::new(BS).unwrap(),
        codec: CodecConfig::new(codec),
        image_size: blocks * BS,
    }
}

/// A block that compresses (structured) but is unique to its seed.
fn block_bytes(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64 / 16).wrapping_mul(seed | 1) >> 3) as u8 ^ seed as u8)
        .collect()
}

fn read(store: &DiskStore, block: u64) -> Vec<u8> {
    let mut out = vec![0xEE; store.block_len(block)];
    store.get(block, &mut out).unwrap();
    out
}

#[test]
fn store_committed_blocks_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(8, Codec::Lz4)).unwrap();
    assert_eq!(
        store.put(0, &block_bytes(1, BS as usize)).unwrap(),
        BlockKind::Lz4
    );
    assert_eq!(
        store.put(1, &vec![0; BS as usize]).unwrap(),
        BlockKind::Zero
    );
    assert_eq!(
        store.put(2, &vec![9; BS as usize]).unwrap(),
        BlockKind::Fill
    );
    assert_eq!(
        store.put(3, &random_bytes(3, BS as usize)).unwrap(),
        BlockKind::Raw
    );
    store.set_meta("note", b"hello".to_vec()).unwrap();
    store.commit().unwrap();
    drop(store);

    let store = DiskStore::open(dir.path()).unwrap();
    assert_eq!(read(&store, 0), block_bytes(1, BS as usize));
    assert_eq!(read(&store, 1), vec![0; BS as usize]);
    assert_eq!(read(&store, 2), vec![9; BS as usize]);
    assert_eq!(read(&store, 3), random_bytes(3, BS as usize));
    assert_eq!(read(&store, 4), vec![0; BS as usize]);
    assert_eq!(store.kind(4).unwrap(), None);
    assert_eq!(store.meta("note"), Some(&b"hello"[..]));
    // Creation is the first commit.
    assert_eq!(store.generation(), 2);
}

#[test]
fn store_uncommitted_writes_are_gone_after_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(4, Codec::Lz4)).unwrap();
    store.put(0, &block_bytes(1, BS as usize)).unwrap();
    store.commit().unwrap();
    store.put(0, &block_bytes(2, BS as usize)).unwrap();
    store.put(1, &block_bytes(3, BS as usize)).unwrap();
    assert_eq!(read(&store, 0), block_bytes(2, BS as usize));
    drop(store);

    let store = DiskStore::open(dir.path()).unwrap();
    assert_eq!(read(&store, 0), block_bytes(1, BS as usize));
    assert_eq!(store.kind(1).unwrap(), None);
}

#[test]
fn store_rollback_restores_last_commit() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(4, Codec::Zstd { level: 3 })).unwrap();
    store.put(0, &block_bytes(1, BS as usize)).unwrap();
    store.commit().unwrap();
    store.put(0, &block_bytes(2, BS as usize)).unwrap();
    store.discard(0).unwrap();
    store.put(2, &block_bytes(2, BS as usize)).unwrap();
    assert!(store.has_pending());
    store.rollback().unwrap();
    assert!(!store.has_pending());
    assert_eq!(read(&store, 0), block_bytes(1, BS as usize));
    assert_eq!(store.kind(2).unwrap(), None);
    // Writing after a rollback still works and commits.
    store.put(1, &block_bytes(5, BS as usize)).unwrap();
    store.commit().unwrap();
    assert_eq!(read(&store, 1), block_bytes(5, BS as usize));
}

#[test]
fn store_partial_last_block_roundtrips() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(2, Codec::Lz4);
    cfg.image_size = BS + 4096;
    let mut store = DiskStore::create(dir.path(), cfg).unwrap();
    assert_eq!(store.blocks(), 2);
    let tail = block_bytes(4, 4096);
    store.put(1, &tail).unwrap();
    let err = store.put(1, &block_bytes(4, BS as usize)).unwrap_err();
    assert!(matches!(err, StoreError::WrongLength { .. }), "{err}");
    store.commit().unwrap();
    assert_eq!(read(&store, 1), tail);
}

#[test]
fn store_out_of_range_block_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(2, Codec::Lz4)).unwrap();
    let err = store.put(2, &vec![1; BS as usize]).unwrap_err();
    assert!(err.to_string().contains("block 2 is out of range"), "{err}");
    assert!(store.discard(u64::MAX).is_err());
}

#[test]
fn store_flipped_bit_is_reported_with_block_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(4, Codec::Lz4)).unwrap();
    for block in 0..4 {
        store
            .put(block, &block_bytes(block + 10, BS as usize))
            .unwrap();
    }
    store.commit().unwrap();
    let Slot::Data(victim) = store.slots[2] else {
        panic!("block 2 should be stored data");
    };
    drop(store);

    let seg_path = dir.path().join(segment::file_name(victim.segment));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&seg_path)
        .unwrap();
    let at = victim.offset + u64::from(victim.len) / 2;
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).unwrap();
    file.write_all_at(&[byte[0] ^ 0x04], at).unwrap();

    let store = DiskStore::open(dir.path()).unwrap();
    let report = store.verify();
    assert_eq!(report.blocks_checked, 4);
    assert_eq!(report.problems.len(), 1, "{report:?}");
    let problem = &report.problems[0];
    assert_eq!(problem.block, 2);
    assert_eq!(problem.offset, victim.offset);
    assert_eq!(problem.path, seg_path);
    assert!(
        problem.reason.contains("checksum mismatch"),
        "{}",
        problem.reason
    );

    let mut out = vec![0; BS as usize];
    let err = store.get(2, &mut out).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("block 2"), "{text}");
    assert!(
        text.contains(&format!("offset {}", victim.offset)),
        "{text}"
    );
    assert!(text.contains(&seg_path.display().to_string()), "{text}");
    // The other blocks are still readable.
    assert_eq!(read(&store, 3), block_bytes(13, BS as usize));
}

#[test]
fn store_truncated_segment_is_a_clear_error_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(4, Codec::None)).unwrap();
    store.put(0, &random_bytes(1, BS as usize)).unwrap();
    store.commit().unwrap();
    drop(store);
    let seg_path = dir.path().join(segment::file_name(0));
    let file = OpenOptions::new().write(true).open(&seg_path).unwrap();
    file.set_len(100).unwrap();
    let err = DiskStore::open(dir.path()).unwrap_err();
    assert!(
        matches!(err, StoreError::SegmentTruncated { expected, actual: 100, .. } if expected == BS),
        "{err}"
    );
    assert!(err.to_string().contains("is truncated"), "{err}");
    fs::remove_file(&seg_path).unwrap();
    let err = DiskStore::open_read_only(dir.path()).unwrap_err();
    assert!(matches!(err, StoreError::SegmentMissing { .. }), "{err}");
}

#[test]
fn store_truncated_or_garbage_index_is_a_clear_error_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(4, Codec::Lz4)).unwrap();
    store.put(0, &block_bytes(1, BS as usize)).unwrap();
    store.commit().unwrap();
    drop(store);
    let index_path = dir.path().join(INDEX_FILE);
    let bytes = fs::read(&index_path).unwrap();
    for len in [0, 7, 20, bytes.len() / 2, bytes.len() - 1] {
        fs::write(&index_path, &bytes[..len]).unwrap();
        let err = DiskStore::open(dir.path()).unwrap_err();
        assert!(
            matches!(err, StoreError::IndexCorrupt { .. }),
            "{len}: {err}"
        );
        assert!(error_chain(&err).contains("index"), "{}", error_chain(&err));
    }
    fs::write(&index_path, b"definitely not an index file").unwrap();
    assert!(matches!(
        DiskStore::open(dir.path()),
        Err(StoreError::IndexCorrupt {
            source: IndexError::BadMagic,
            ..
        })
    ));
}

#[test]
fn store_directory_without_index_is_not_a_store() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        DiskStore::open(dir.path()),
        Err(StoreError::NotAStore { .. })
    ));
}

#[test]
fn store_create_over_existing_store_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    drop(DiskStore::create(dir.path(), config(4, Codec::Lz4)).unwrap());
    let err = DiskStore::create(dir.path(), config(4, Codec::Lz4)).unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err}");
}

#[test]
fn store_second_writer_is_locked_out() {
    let dir = tempfile::tempdir().unwrap();
    let store = DiskStore::create(dir.path(), config(4, Codec::Lz4)).unwrap();
    assert!(matches!(
        DiskStore::open(dir.path()),
        Err(StoreError::Locked { .. })
    ));
    assert!(matches!(
        DiskStore::open_read_only(dir.path()),
        Err(StoreError::Locked { .. })
    ));
    drop(store);
    let reader = DiskStore::open_read_only(dir.path()).unwrap();
    let reader2 = DiskStore::open_read_only(dir.path()).unwrap();
    assert!(matches!(
        DiskStore::open(dir.path()),
        Err(StoreError::Locked { .. })
    ));
    drop((reader, reader2));
}

#[test]
fn store_read_only_refuses_writes() {
    let dir = tempfile::tempdir().unwrap();
    drop(DiskStore::create(dir.path(), config(4, Codec::Lz4)).unwrap());
    let mut store = DiskStore::open_read_only(dir.path()).unwrap();
    assert!(matches!(
        store.put(0, &vec![1; BS as usize]),
        Err(StoreError::ReadOnly { .. })
    ));
    assert!(matches!(store.commit(), Err(StoreError::ReadOnly { .. })));
}

#[test]
fn store_stray_files_of_a_crashed_writer_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(4, Codec::Lz4)).unwrap();
    store.put(0, &block_bytes(1, BS as usize)).unwrap();
    store.commit().unwrap();
    // Uncommitted tail on the committed segment, an orphan segment and a stale index.tmp.
    store.put(1, &block_bytes(2, BS as usize)).unwrap();
    let committed = store.segments[&0].committed_len;
    drop(store);
    fs::write(dir.path().join(segment::file_name(7)), b"orphan").unwrap();
    fs::write(dir.path().join(INDEX_TMP), b"half an index").unwrap();

    let mut store = DiskStore::open(dir.path()).unwrap();
    assert!(!dir.path().join(segment::file_name(7)).exists());
    assert!(!dir.path().join(INDEX_TMP).exists());
    assert_eq!(
        fs::metadata(dir.path().join(segment::file_name(0)))
            .unwrap()
            .len(),
        committed
    );
    // New segments never reuse the orphan's id.
    store.put(2, &block_bytes(3, BS as usize)).unwrap();
    store.commit().unwrap();
    assert!(
        store.segments.keys().all(|&id| id == 0 || id > 7),
        "{:?}",
        store.segments.keys()
    );
    assert_eq!(read(&store, 2), block_bytes(3, BS as usize));
}

#[test]
fn store_rewrites_are_reclaimed_by_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let options = StoreOptions {
        segment_max_bytes: 256 << 10,
        compact_min_bytes: 64 << 10,
        ..StoreOptions::default()
    };
    let blocks = 64;
    let mut store =
        DiskStore::create_with(dir.path(), config(blocks, Codec::None), options).unwrap();
    for round in 0..6u64 {
        for block in 0..blocks {
            store
                .put(block, &random_bytes(round * 1000 + block, BS as usize))
                .unwrap();
        }
        store.commit().unwrap();
        let stats = store.stats();
        // Never more than the live image plus one partly dead segment.
        assert!(
            stats.segment_bytes <= blocks * BS + options.segment_max_bytes,
            "round {round}: {stats:?}"
        );
    }
    // Rewrite half the blocks: the dead half is compacted away.
    for block in (0..blocks).step_by(2) {
        store
            .put(block, &random_bytes(9000 + block, BS as usize))
            .unwrap();
    }
    store.commit().unwrap();
    drop(store);
    let store = DiskStore::open(dir.path()).unwrap();
    for block in 0..blocks {
        let expect = if block % 2 == 0 {
            9000 + block
        } else {
            5000 + block
        };
        assert_eq!(
            read(&store, block),
            random_bytes(expect, BS as usize),
            "block {block}"
        );
    }
    let stats = store.stats();
    assert!(
        stats.segment_bytes <= blocks * BS + options.segment_max_bytes,
        "{stats:?}"
    );
    assert!(store.verify().problems.is_empty());
}

#[test]
fn store_reset_reclaims_the_old_image() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(16, Codec::None)).unwrap();
    for block in 0..16 {
        store.put(block, &random_bytes(block, BS as usize)).unwrap();
    }
    store.commit().unwrap();
    store.reset(4 * BS).unwrap();
    store.put(0, &random_bytes(99, BS as usize)).unwrap();
    store.commit().unwrap();
    let stats = store.stats();
    assert_eq!(stats.blocks, 4);
    assert_eq!(stats.segment_bytes, BS, "{stats:?}");
    drop(store);
    let store = DiskStore::open(dir.path()).unwrap();
    assert_eq!(store.image_size(), 4 * BS);
    assert_eq!(read(&store, 0), random_bytes(99, BS as usize));
}

#[test]
fn store_stats_count_kinds_and_disk_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(8, Codec::Lz4)).unwrap();
    store.put(0, &vec![0; BS as usize]).unwrap();
    store.put(1, &vec![3; BS as usize]).unwrap();
    store.put(2, &random_bytes(1, BS as usize)).unwrap();
    store.put(3, &block_bytes(1, BS as usize)).unwrap();
    store.commit().unwrap();
    let stats = store.stats();
    assert_eq!(stats.blocks, 8);
    assert_eq!(stats.present_blocks, 4);
    assert_eq!(stats.zero_blocks, 1);
    assert_eq!(stats.fill_blocks, 1);
    assert_eq!(stats.raw_blocks, 1);
    assert_eq!(stats.compressed_blocks, 1);
    assert_eq!(stats.raw_bytes, 4 * BS);
    assert!(
        stats.stored_bytes > BS && stats.stored_bytes < 2 * BS,
        "{stats:?}"
    );
    assert!(stats.disk_bytes >= stats.stored_bytes, "{stats:?}");
    assert_eq!(stats.dead_bytes, 0);
}

#[test]
fn store_put_encoded_passes_compressed_blocks_through() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(2, Codec::None)).unwrap();
    let data = block_bytes(7, BS as usize);
    let mut encoder = Encoder::new(CodecConfig::new(Codec::Zstd { level: 3 })).unwrap();
    let encoded = encoder.encode(&data);
    assert_eq!(encoded.kind, BlockKind::Zstd);
    store.put_encoded(1, encoded).unwrap();
    store.commit().unwrap();
    assert_eq!(read(&store, 1), data);
    let mut payload = Vec::new();
    assert_eq!(
        store.get_encoded(1, &mut payload).unwrap(),
        Some(BlockKind::Zstd)
    );
    assert_eq!(payload, encoder.encode(&data).payload);
}

#[derive(Debug, Clone)]
enum Op {
    Put(u64, u64),
    Zero(u64),
    Discard(u64),
    Commit,
    Rollback,
    Reopen,
}

fn op_strategy(blocks: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..blocks, any::<u64>()).prop_map(|(b, s)| Op::Put(b, s)),
        1 => (0..blocks).prop_map(Op::Zero),
        1 => (0..blocks).prop_map(Op::Discard),
        2 => Just(Op::Commit),
        1 => Just(Op::Rollback),
        1 => Just(Op::Reopen),
    ]
}

fn model_block(seed: u64) -> Vec<u8> {
    if seed.is_multiple_of(3) {
        random_bytes(seed, BS as usize)
    } else {
        block_bytes(seed, BS as usize)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn store_any_bytes_roundtrip_through_every_codec(
        blocks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), BS as usize), 1..4),
        codec in prop_oneof![Just(Codec::None), Just(Codec::Lz4), Just(Codec::Zstd { level: 3 })],
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut store = DiskStore::create(dir.path(), config(blocks.len() as u64, codec)).unwrap();
        for (block, data) in blocks.iter().enumerate() {
            store.put(block as u64, data).unwrap();
        }
        store.commit().unwrap();
        drop(store);
        let store = DiskStore::open_read_only(dir.path()).unwrap();
        for (block, data) in blocks.iter().enumerate() {
            prop_assert!(&read(&store, block as u64) == data);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn store_matches_a_model_under_any_operations(
        ops in proptest::collection::vec(op_strategy(6), 1..40),
        codec in prop_oneof![Just(Codec::None), Just(Codec::Lz4), Just(Codec::Zstd { level: 1 })],
    ) {
        let dir = tempfile::tempdir().unwrap();
        let options = StoreOptions {
            segment_max_bytes: 48 << 10,
            compact_min_bytes: 16 << 10,
            ..StoreOptions::default()
        };
        let mut store = DiskStore::create_with(dir.path(), config(6, codec), options).unwrap();
        let zero = vec![0u8; BS as usize];
        let mut current: Vec<Vec<u8>> = vec![zero.clone(); 6];
        let mut committed = current.clone();
        for op in ops {
            match op {
                Op::Put(block, seed) => {
                    let data = model_block(seed);
                    store.put(block, &data).unwrap();
                    current[block as usize] = data;
                }
                Op::Zero(block) => {
                    store.put(block, &zero).unwrap();
                    current[block as usize] = zero.clone();
                }
                Op::Discard(block) => {
                    store.discard(block).unwrap();
                    current[block as usize] = zero.clone();
                }
                Op::Commit => {
                    store.commit().unwrap();
                    committed = current.clone();
                }
                Op::Rollback => {
                    store.rollback().unwrap();
                    current = committed.clone();
                }
                Op::Reopen => {
                    drop(store);
                    store = DiskStore::open_with(dir.path(), true, options).unwrap();
                    current = committed.clone();
                }
            }
            for (block, expect) in current.iter().enumerate() {
                prop_assert_eq!(&read(&store, block as u64), expect, "block {}", block);
            }
        }
        prop_assert!(store.verify().problems.is_empty());
    }
}

#[test]
fn store_reader_keeps_reading_its_view_while_the_store_is_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    let options = StoreOptions {
        segment_max_bytes: 64 << 10,
        compact_min_bytes: 16 << 10,
        ..StoreOptions::default()
    };
    let mut store = DiskStore::create_with(dir.path(), config(8, Codec::Lz4), options).unwrap();
    for block in 0..8 {
        store.put(block, &block_bytes(block, BS as usize)).unwrap();
    }
    store.commit().unwrap();
    let view = store.reader();
    // Rewrite everything twice: compaction deletes the segments the view reads from.
    for round in 1..3 {
        for block in 0..8 {
            store
                .put(block, &random_bytes(round * 100 + block, BS as usize))
                .unwrap();
        }
        store.commit().unwrap();
    }
    assert!(!dir.path().join(segment::file_name(0)).exists());
    let mut out = vec![0; BS as usize];
    for block in 0..8 {
        view.get(block, &mut out).unwrap();
        assert_eq!(out, block_bytes(block, BS as usize), "block {block}");
    }
    assert!(matches!(
        view.get(8, &mut out),
        Err(StoreError::BlockOutOfRange { .. })
    ));
    assert_eq!(read(&store, 3), random_bytes(203, BS as usize));
}

/// Pages of `path` in the page cache (`mincore` over a mapping of it).
fn cached_pages(path: &std::path::Path) -> usize {
    let file = std::fs::File::open(path).unwrap();
    // SAFETY: a read-only private mapping of a file this test owns; nothing writes it.
    let map = unsafe { memmap2::Mmap::map(&file).unwrap() };
    let pages = map.len().div_ceil(4096);
    let mut vec = vec![0u8; pages];
    // SAFETY: `vec` has one byte per page of the mapping, which lives across the call.
    let rc = unsafe { libc::mincore(map.as_ptr().cast_mut().cast(), map.len(), vec.as_mut_ptr()) };
    assert_eq!(rc, 0);
    vec.iter().filter(|&&b| b & 1 == 1).count()
}

#[test]
fn store_drop_behind_reads_leave_nothing_cached() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(8, Codec::Lz4)).unwrap();
    for b in 0..8 {
        store.put(b, &block_bytes(b + 1, BS as usize)).unwrap();
    }
    store.commit().unwrap();
    store.drop_cache().unwrap();
    let segment = dir.path().join(segment::file_name(0));
    let segment = if segment.exists() {
        segment
    } else {
        dir.path().join(segment::file_name(1))
    };
    let mut out = vec![0u8; BS as usize];
    // A plain read leaves what it read cached (this file system keeps a page cache).
    for b in 0..8 {
        store.get(b, &mut out).unwrap();
    }
    let plain = cached_pages(&segment);
    if plain == 0 {
        eprintln!("no page cache for {}: nothing to check", segment.display());
        return;
    }
    store.drop_cache().unwrap();
    store.set_drop_behind(true);
    for b in 0..8 {
        store.get(b, &mut out).unwrap();
        assert!(out == block_bytes(b + 1, BS as usize));
    }
    assert_eq!(
        cached_pages(&segment),
        0,
        "{plain} pages cached by plain reads"
    );
    // A reader taken from the store drops behind too.
    let reader = store.reader();
    reader.get(3, &mut out).unwrap();
    assert_eq!(cached_pages(&segment), 0);
}

#[test]
fn store_drop_behind_reads_go_around_the_page_cache_where_the_file_system_allows() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(16, Codec::Lz4)).unwrap();
    // Payloads of odd lengths at odd offsets: compressed blocks and raw ones.
    for b in 0..16 {
        let bytes = if b % 3 == 0 {
            random_bytes(b, BS as usize)
        } else {
            block_bytes(b + 1, BS as usize)
        };
        store.put(b, &bytes).unwrap();
    }
    store.commit().unwrap();
    store.set_drop_behind(true);
    let mut out = vec![0u8; BS as usize];
    for round in 0..2 {
        for b in 0..16 {
            store.get(b, &mut out).unwrap();
            let expected = if b % 3 == 0 {
                random_bytes(b, BS as usize)
            } else {
                block_bytes(b + 1, BS as usize)
            };
            assert!(out == expected, "round {round}, block {b}");
        }
    }
    // A reader shares the direct descriptors and the count.
    store.reader().get(5, &mut out).unwrap();
    let direct = store.direct_reads();
    if direct == 0 {
        eprintln!(
            "{}: no O_DIRECT here, read through the page cache",
            dir.path().display()
        );
    } else {
        assert_eq!(direct, 33);
    }
    // On a file system without direct I/O the same reads go the buffered way (a tmpfs
    // mount needs root: a device test).
    if testkit::skip_unless(&[]) {
        return;
    }
    let tmpfs = testkit::Tmpfs::mount("4m");
    let mut small = DiskStore::create(tmpfs.path().join("s"), config(4, Codec::Lz4)).unwrap();
    for b in 0..4 {
        small.put(b, &block_bytes(b + 7, BS as usize)).unwrap();
    }
    small.commit().unwrap();
    small.set_drop_behind(true);
    for b in 0..4 {
        small.get(b, &mut out).unwrap();
        assert!(out == block_bytes(b + 7, BS as usize));
    }
}

#[test]
fn store_drop_behind_reads_from_several_threads_leave_nothing_cached() {
    // What a pager's load does: threads reading blocks out of order, each dropping what it
    // read. Kernel readahead of one thread's read used to bring in blocks another thread had
    // read and dropped already: 60 of 64 MiB stayed cached after a VM's load.
    let dir = tempfile::tempdir().unwrap();
    let blocks = 1024;
    let mut store = DiskStore::create(dir.path(), config(blocks, Codec::None)).unwrap();
    for b in 0..blocks {
        store.put(b, &random_bytes(b, BS as usize)).unwrap();
    }
    store.commit().unwrap();
    store.drop_cache().unwrap();
    store.set_drop_behind(true);
    let reader = store.reader();
    std::thread::scope(|scope| {
        for t in 0..2u64 {
            let reader = &reader;
            scope.spawn(move || {
                let mut out = vec![0u8; BS as usize];
                for b in (t..blocks).step_by(2) {
                    reader.get(b, &mut out).unwrap();
                    assert!(out == random_bytes(b, BS as usize));
                }
            });
        }
    });
    let cached: usize = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| segment::parse_file_name(&p.file_name().unwrap().to_string_lossy()).is_some())
        .map(|p| cached_pages(&p))
        .sum();
    assert_eq!(
        cached, 0,
        "pages of the store left cached after drop-behind reads"
    );
}

#[test]
fn store_commit_uncached_leaves_no_page_cache_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = DiskStore::create(dir.path(), config(64, Codec::None)).unwrap();
    for step in 0..2u64 {
        for block in step * 32..(step + 1) * 32 {
            store.put(block, &random_bytes(block, BS as usize)).unwrap();
        }
        store.commit_uncached().unwrap();
        let segments: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                segment::parse_file_name(&p.file_name().unwrap().to_string_lossy()).is_some()
            })
            .collect();
        assert!(!segments.is_empty());
        for seg in &segments {
            assert_eq!(cached_pages(seg), 0, "step {step}: {seg:?} is cached");
        }
    }
    drop(store);
    let store = DiskStore::open(dir.path()).unwrap();
    for block in 0..64 {
        assert!(read(&store, block) == random_bytes(block, BS as usize));
    }
}

#[test]
fn store_durability_host_syncs_each_commit_and_process_syncs_nothing_yet_survives_its_writer() {
    for durability in [Durability::Host, Durability::Process] {
        let dir = tempfile::tempdir().unwrap();
        let mut store = DiskStore::create(dir.path(), config(8, Codec::Lz4)).unwrap();
        // What a snapshot or a packed image gets: the host's crash survived.
        assert_eq!(store.durability(), Durability::Host);
        store.set_durability(durability);
        // (Creating the store committed its empty index, as a `Host` store.)
        let before = store.syncs();
        for round in 0..3 {
            store.put(round, &block_bytes(round, BS as usize)).unwrap();
            store.commit_uncached().unwrap();
        }
        store.put(3, &block_bytes(3, BS as usize)).unwrap();
        store.commit().unwrap();
        match durability {
            // Each commit: its segment, the index file and the directory.
            Durability::Host => assert!(store.syncs() - before >= 4 * 3, "{}", store.syncs()),
            Durability::Process => assert_eq!(store.syncs(), before),
        }
        // The writer is gone: a new one (a pager taking over) finds every commit.
        drop(store);
        let store = DiskStore::open(dir.path()).unwrap();
        assert_eq!(store.durability(), Durability::Host);
        for block in 0..4 {
            assert_eq!(read(&store, block), block_bytes(block, BS as usize));
        }
    }
}
