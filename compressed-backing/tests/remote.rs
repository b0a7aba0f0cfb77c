//! Remote stores against a real S3-compatible server on loopback (`testkit::s3`): upload,
//! lazy reads through the cache, prefetch, and every fault the issue names.

use std::path::Path;
use std::time::Duration;

use basics::error_chain;
use compressed_backing::remote::{Remote, RemoteError, RemoteOptions, RemoteUrl};
use compressed_backing::{BlockSize, CodecConfig, DiskStore, StoreConfig, StoreError};
use testkit::s3::{S3Server, ACCESS_KEY, SECRET_KEY};

const BLOCK: usize = 64 << 10;
const BLOCKS: u64 = 96;

fn options(server: &S3Server, cache: &Path) -> RemoteOptions {
    RemoteOptions {
        endpoint: Some(server.endpoint()),
        credentials: Some((ACCESS_KEY.into(), SECRET_KEY.into())),
        cache_dir: cache.to_path_buf(),
        cache_size: 1 << 30,
        retry_timeout: Duration::from_secs(2),
        parallel: 4,
        request_size: compressed_backing::remote::DEFAULT_REQUEST_SIZE,
        key: None,
        fetch_rest: false,
    }
}

/// Block `i` of image `seed`: a mix of zero, compressible and random blocks.
fn block(seed: u64, i: u64) -> Vec<u8> {
    match i % 4 {
        0 => vec![0; BLOCK],
        1 => testkit::random_bytes(seed * 1000 + i, BLOCK),
        _ => {
            let mut b = testkit::random_bytes(seed * 1000 + i, 512).repeat(BLOCK / 512);
            b[0] = i as u8;
            b
        }
    }
}

/// A local store of image `seed` in `dir`.
fn local_store(dir: &Path, seed: u64) {
    let mut store = DiskStore::create(
        dir,
        StoreConfig {
            block_size: BlockSize::new(BLOCK as u64).expect("block size"),
            codec: CodecConfig::default(),
            image_size: BLOCKS * BLOCK as u64,
        },
    )
    .expect("create");
    for i in 0..BLOCKS {
        store.put(i, &block(seed, i)).expect("put");
    }
    store.commit().expect("commit");
}

fn read_all(store: &DiskStore, seed: u64) {
    let mut out = vec![0u8; BLOCK];
    for i in 0..BLOCKS {
        store.get(i, &mut out).expect("get");
        assert!(out == block(seed, i), "block {i} differs");
    }
}

fn uploaded(server: &S3Server, prefix: &str, seed: u64) -> (tempfile::TempDir, RemoteUrl) {
    server.create_bucket("vms");
    let dir = tempfile::tempdir().expect("tempdir");
    local_store(&dir.path().join("local"), seed);
    let url = RemoteUrl::parse(&format!("s3://vms/{prefix}")).expect("url");
    let remote =
        Remote::connect(&url, &options(server, &dir.path().join("cache-up"))).expect("connect");
    let report = remote
        .upload(&dir.path().join("local"), &|_| {})
        .expect("upload");
    assert!(report.chunks >= 1 && report.bytes > 0, "{report:?}");
    (dir, url)
}

#[test]
fn a_store_read_on_another_host_fetches_only_what_it_reads() {
    let server = S3Server::start();
    let (dir, url) = uploaded(&server, "a/b", 1);
    let keys = server.keys("vms", "a/b/");
    assert!(keys.contains(&"a/b/index".to_owned()), "{keys:?}");
    // "Another host": a cache of its own, nothing local.
    let remote =
        Remote::connect(&url, &options(&server, &dir.path().join("cache"))).expect("connect");
    let store = remote.open().expect("open");
    assert_eq!(
        remote.stats().bytes_fetched,
        0,
        "opening fetches only the index"
    );
    let mut out = vec![0u8; BLOCK];
    store.get(1, &mut out).expect("get");
    assert!(out == block(1, 1));
    let one = remote.stats();
    assert_eq!(one.requests, 1);
    assert_eq!(one.bytes_fetched, store.stored_len(1) as u64);
    read_all(&store, 1);
    let all = remote.stats();
    let stored: u64 = (0..BLOCKS).map(|b| store.stored_len(b) as u64).sum();
    assert_eq!(all.bytes_fetched, stored, "each payload fetched once");
    assert!(
        server.bytes_out() >= stored,
        "the server counts what it sends"
    );
    // A second open on the same host is served by the cache.
    let again =
        Remote::connect(&url, &options(&server, &dir.path().join("cache"))).expect("connect");
    let requests = server.requests();
    let store = again.open().expect("open");
    read_all(&store, 1);
    assert_eq!(again.stats().bytes_fetched, 0);
    assert_eq!(
        server.requests() - requests,
        1,
        "only the index was asked for"
    );
    assert_eq!(store.verify().problems.len(), 0);
}

#[test]
fn prefetch_coalesces_and_faults_then_need_nothing() {
    let server = S3Server::start();
    let (dir, url) = uploaded(&server, "p", 2);
    let remote =
        Remote::connect(&url, &options(&server, &dir.path().join("cache"))).expect("connect");
    let store = remote.open().expect("open");
    let working_set: Vec<u64> = (10..60).rev().collect();
    let fetched = remote.prefetch(&store, &working_set).expect("prefetch");
    let stored: u64 = working_set
        .iter()
        .map(|&b| store.stored_len(b) as u64)
        .sum();
    assert!(
        fetched >= stored && fetched <= stored + stored / 4,
        "{fetched} for {stored}"
    );
    let stats = remote.stats();
    assert!(stats.requests <= 3, "{stats:?}: neighbours are coalesced");
    let mut out = vec![0u8; BLOCK];
    for &b in &working_set {
        store.get(b, &mut out).expect("get");
        assert!(out == block(2, b));
    }
    assert_eq!(remote.stats(), stats, "the working set was all there");
    assert_eq!(remote.prefetch(&store, &working_set).expect("again"), 0);
}

#[test]
fn the_rest_is_fetched_in_the_background_yielding_to_faults_then_reads_need_nothing() {
    let mut server = S3Server::start();
    let (dir, url) = uploaded(&server, "rest", 3);
    let remote =
        Remote::connect(&url, &options(&server, &dir.path().join("cache"))).expect("connect");
    let store = std::sync::Arc::new(remote.open().expect("open"));
    let working_set: Vec<u64> = (0..8).collect();
    remote.prefetch(&store, &working_set).expect("prefetch");
    let after_prefetch = remote.stats();
    // A fault waits on a slow request; the background fetch starts meanwhile and must not
    // send anything until that fault is served.
    server.set_delay(Duration::from_millis(1500));
    let faulting = {
        let store = std::sync::Arc::clone(&store);
        std::thread::spawn(move || {
            let mut out = vec![0u8; BLOCK];
            store.get(BLOCKS - 3, &mut out).expect("get");
            assert!(out == block(3, BLOCKS - 3));
        })
    };
    let requests = server.requests();
    while server.requests() == requests {
        std::thread::sleep(Duration::from_millis(1));
    }
    let sent = server.requests();
    let planned = remote
        .fetch_rest(&store)
        .expect("fetch rest")
        .expect("it fits");
    let stored: u64 = (8..BLOCKS).map(|b| store.stored_len(b) as u64).sum();
    assert!(
        planned >= stored && planned <= stored + stored / 4,
        "{planned} for {stored}"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        server.requests(),
        sent,
        "the background fetch sent a request while a fault waited"
    );
    faulting.join().expect("the fault is served");
    server.set_delay(Duration::ZERO);
    let started = std::time::Instant::now();
    while !remote.stats().background_done {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{:?}",
            remote.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let done = remote.stats();
    assert!(
        done.background_bytes >= stored - store.stored_len(BLOCKS - 3) as u64,
        "{done:?}"
    );
    assert!(
        done.background_requests <= 4,
        "{done:?}: coalesced like a prefetch"
    );
    assert_eq!(
        done.requests,
        after_prefetch.requests + 1,
        "counted apart from the fault's"
    );
    // Everything is here now: with the server down, every block still reads.
    server.stop();
    read_all(&store, 3);
    assert_eq!(remote.stats(), done);
    server.restart();
    // A cache whose bound leaves no room for the rest: nothing is started.
    let mut small = options(&server, &dir.path().join("cache-small"));
    small.cache_size = 1 << 20;
    let remote = Remote::connect(&url, &small).expect("connect");
    let store = remote.open().expect("open");
    assert_eq!(remote.fetch_rest(&store).expect("fetch rest"), None);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(remote.stats().background_requests, 0);
}

#[test]
fn corrupt_truncated_or_deleted_chunks_are_errors_never_data() {
    let server = S3Server::start();
    let (dir, url) = uploaded(&server, "c", 3);
    let chunk = server
        .keys("vms", "c/seg-")
        .into_iter()
        .next()
        .expect("a chunk");
    let path = server.object_path("vms", &chunk);
    let mut bytes = std::fs::read(&path).expect("read chunk");
    let remote =
        Remote::connect(&url, &options(&server, &dir.path().join("cache"))).expect("connect");
    let store = remote.open().expect("open");
    let (_, offset, _) = store.payload_location(1).expect("block 1 is stored");
    bytes[offset as usize + 7] ^= 0x40;
    std::fs::write(&path, &bytes).expect("corrupt");
    let mut out = vec![0u8; BLOCK];
    let err = store.get(1, &mut out).expect_err("corrupt block served");
    assert!(matches!(err, StoreError::Corrupt { block: 1, .. }), "{err}");
    store.get(2, &mut out).expect("other blocks read");
    assert!(out == block(3, 2));
    // Truncated: the blocks past the end cannot be fetched.
    std::fs::write(&path, &bytes[..offset as usize]).expect("truncate");
    let (_, last_offset, _) = store.payload_location(BLOCKS - 1).expect("stored");
    assert!(last_offset >= offset);
    let err = store
        .get(BLOCKS - 1, &mut out)
        .expect_err("truncated served");
    assert!(matches!(err, StoreError::Fetch { .. }), "{err}");
    // Deleted.
    std::fs::remove_file(&path).expect("delete");
    let err = store.get(BLOCKS - 2, &mut out).expect_err("deleted served");
    let text = error_chain(&err);
    assert!(
        text.contains("not found") || text.contains("NotFound") || text.contains("404"),
        "{text}"
    );
}

#[test]
fn an_upload_that_fails_half_way_leaves_the_previous_image() {
    let server = S3Server::start();
    let (dir, url) = uploaded(&server, "u", 4);
    let before = server.keys("vms", "u/");
    // A second image whose segment is cut short: the upload fails after its index is read.
    let second = dir.path().join("second");
    local_store(&second, 5);
    let seg = std::fs::read_dir(&second)
        .expect("list")
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("seg-"))
        .expect("a segment")
        .path();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&seg)
        .expect("open");
    f.set_len(1000).expect("truncate");
    let remote =
        Remote::connect(&url, &options(&server, &dir.path().join("cache"))).expect("connect");
    let err = remote
        .upload(&second, &|_| {})
        .expect_err("a short segment uploaded");
    assert!(matches!(err, RemoteError::Store(_)), "{err}");
    let store = remote.open().expect("the old image opens");
    read_all(&store, 4);
    assert_eq!(server.keys("vms", "u/index"), vec!["u/index".to_owned()]);
    // A whole second image replaces it. A reader that opened the first keeps reading it: its
    // chunks go only with the image after.
    let reader = remote.open().expect("open the first image");
    local_store(&dir.path().join("third"), 6);
    let report = remote
        .upload(&dir.path().join("third"), &|_| {})
        .expect("upload");
    assert_eq!(report.cleanup_error, None);
    read_all(&reader, 4);
    let fresh =
        Remote::connect(&url, &options(&server, &dir.path().join("cache2"))).expect("connect");
    read_all(&fresh.open().expect("open"), 6);
    local_store(&dir.path().join("fourth"), 7);
    let report = remote
        .upload(&dir.path().join("fourth"), &|_| {})
        .expect("upload");
    assert!(report.deleted >= 1, "{report:?}");
    let after = server.keys("vms", "u/");
    assert!(
        after.iter().all(|k| !before.contains(k) || k == "u/index"),
        "{before:?} {after:?}"
    );
    // Chunks an interrupted upload left (named above the index) neither block the next
    // upload nor stay.
    let orphan = server.object_path("vms", "u/seg-09999999.dat");
    std::fs::write(&orphan, b"left by a writer that died").expect("orphan");
    local_store(&dir.path().join("fifth"), 8);
    remote
        .upload(&dir.path().join("fifth"), &|_| {})
        .expect("an upload after an orphan");
    local_store(&dir.path().join("sixth"), 9);
    remote
        .upload(&dir.path().join("sixth"), &|_| {})
        .expect("and the next");
    assert!(!orphan.exists(), "the orphan stayed");
    let fresh =
        Remote::connect(&url, &options(&server, &dir.path().join("cache3"))).expect("connect");
    read_all(&fresh.open().expect("open"), 9);
}

#[test]
fn bad_credentials_missing_buckets_and_stores_are_clear_errors() {
    let server = S3Server::start();
    let (dir, url) = uploaded(&server, "e", 7);
    let mut wrong = options(&server, &dir.path().join("cache"));
    wrong.credentials = Some((ACCESS_KEY.into(), "not-the-secret".into()));
    let err = Remote::connect(&url, &wrong)
        .expect("connect")
        .open()
        .expect_err("wrong secret accepted");
    let text = error_chain(&err);
    assert!(text.contains("s3://vms/e/index"), "{text}");
    let missing = RemoteUrl::parse("s3://no-such-bucket/x").expect("url");
    let err = Remote::connect(&missing, &options(&server, &dir.path().join("cache")))
        .expect("connect")
        .open()
        .expect_err("a missing bucket opened");
    assert!(!matches!(err, RemoteError::Store(_)), "{err}");
    let empty = RemoteUrl::parse("s3://vms/nothing-here").expect("url");
    let err = Remote::connect(&empty, &options(&server, &dir.path().join("cache")))
        .expect("connect")
        .open()
        .expect_err("no store opened");
    assert!(matches!(err, RemoteError::NotFound { .. }), "{err}");
}

#[test]
fn a_server_outage_fails_reads_after_the_retries_and_they_work_again_after() {
    let mut server = S3Server::start();
    let (dir, url) = uploaded(&server, "o", 8);
    let remote =
        Remote::connect(&url, &options(&server, &dir.path().join("cache"))).expect("connect");
    let store = remote.open().expect("open");
    server.stop();
    let mut out = vec![0u8; BLOCK];
    let started = std::time::Instant::now();
    let err = store
        .get(1, &mut out)
        .expect_err("read with the server down");
    assert!(matches!(err, StoreError::Fetch { .. }), "{err}");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "retried for a while"
    );
    server.restart();
    store.get(1, &mut out).expect("read after the outage");
    assert!(out == block(8, 1));
}

#[test]
fn the_cache_stays_within_its_bound_and_reads_stay_right() {
    let server = S3Server::start();
    let (dir, url) = uploaded(&server, "b", 9);
    let mut small = options(&server, &dir.path().join("cache"));
    small.cache_size = 1 << 20;
    let remote = Remote::connect(&url, &small).expect("connect");
    let store = remote.open().expect("open");
    read_all(&store, 9);
    let usage = remote.cache().enforce().expect("enforce");
    assert!(usage.bytes <= 1 << 20, "{usage:?}");
    read_all(&store, 9);
}

#[test]
fn sealed_stores_keep_guest_memory_secret_and_refuse_wrong_keys_and_moved_blocks() {
    use compressed_backing::seal::StoreKey;
    use std::sync::Arc;
    let server = S3Server::start();
    server.create_bucket("vms");
    let dir = tempfile::tempdir().expect("tempdir");
    local_store(&dir.path().join("local"), 11);
    let key = Arc::new(StoreKey::from_bytes(&[5; 32]));
    let with_key = |cache: &str, key: &Arc<StoreKey>| {
        let mut o = options(&server, &dir.path().join(cache));
        o.key = Some(Arc::clone(key));
        o
    };
    let url = RemoteUrl::parse("s3://vms/sealed").expect("url");
    Remote::connect(&url, &with_key("cache-up", &key))
        .expect("connect")
        .upload(&dir.path().join("local"), &|_| {})
        .expect("sealed upload");
    // Nothing of the guest's memory, nor the index's format, is in the bucket.
    let secret = block(11, 1);
    for object in server.keys("vms", "sealed/") {
        let bytes = std::fs::read(server.object_path("vms", &object)).expect("read object");
        assert!(
            !bytes.windows(64).any(|w| w == &secret[4096..4160]),
            "{object} leaks"
        );
        assert!(
            !bytes.windows(8).any(|w| w == b"PVSTORE1"),
            "{object} shows the index"
        );
    }
    // Another host with the key reads it all.
    let remote = Remote::connect(&url, &with_key("cache-a", &key)).expect("connect");
    let store = remote.open().expect("open with the key");
    read_all(&store, 11);
    // Without the key, with another key, or a key for a store in the clear: refused.
    let err = Remote::connect(&url, &options(&server, &dir.path().join("cache-b")))
        .expect("connect")
        .open()
        .expect_err("opened without the key");
    assert!(matches!(err, RemoteError::Sealed { .. }), "{err}");
    let other = Arc::new(StoreKey::from_bytes(&[6; 32]));
    let err = Remote::connect(&url, &with_key("cache-c", &other))
        .expect("connect")
        .open()
        .expect_err("opened with another key");
    assert!(matches!(err, RemoteError::IndexUnsealed { .. }), "{err}");
    let (_, clear) = uploaded(&server, "clear", 12);
    let err = Remote::connect(&clear, &with_key("cache-d", &key))
        .expect("connect")
        .open()
        .expect_err("a store in the clear read with a key");
    assert!(matches!(err, RemoteError::NotSealed { .. }), "{err}");
    // The same objects copied under another prefix: its index does not open there.
    std::fs::create_dir_all(server.object_path("vms", "copied")).expect("mkdir");
    for object in server.keys("vms", "sealed/") {
        let name = object.trim_start_matches("sealed/");
        std::fs::copy(
            server.object_path("vms", &object),
            server.object_path("vms", &format!("copied/{name}")),
        )
        .expect("copy");
    }
    let copied = RemoteUrl::parse("s3://vms/copied").expect("url");
    let err = Remote::connect(&copied, &with_key("cache-f", &key))
        .expect("connect")
        .open()
        .expect_err("a sealed store opened under another prefix");
    assert!(matches!(err, RemoteError::IndexUnsealed { .. }), "{err}");
    // Two payloads of the same length swapped in their chunk: neither is served.
    let fresh = Remote::connect(&url, &with_key("cache-e", &key)).expect("connect");
    let store = fresh.open().expect("open");
    let (seg_a, off_a, len_a) = store.payload_location(1).expect("stored");
    let (seg_b, off_b, len_b) = store.payload_location(5).expect("stored");
    assert_eq!(
        (seg_a, len_a),
        (seg_b, len_b),
        "two raw blocks in one chunk"
    );
    let chunk = server.object_path("vms", &format!("sealed/seg-{seg_a:08}.dat"));
    let mut bytes = std::fs::read(&chunk).expect("read chunk");
    let (a, b) = (off_a as usize, off_b as usize);
    let first = bytes[a..a + len_a as usize].to_vec();
    bytes.copy_within(b..b + len_b as usize, a);
    bytes[b..b + len_b as usize].copy_from_slice(&first);
    std::fs::write(&chunk, &bytes).expect("swap");
    let mut out = vec![0u8; BLOCK];
    for moved in [1, 5] {
        let err = store
            .get(moved, &mut out)
            .expect_err("a moved block served");
        assert!(
            matches!(
                err,
                StoreError::Corrupt { .. } | StoreError::Unsealed { .. }
            ),
            "{err}"
        );
    }
    store.get(2, &mut out).expect("other blocks read");
}
