//! Crash consistency: a writer process is killed with SIGKILL at random points while it
//! rewrites and commits a store over and over; after each kill the store must reopen and hold
//! exactly one whole generation, the last one acknowledged or the one being committed, never
//! a mix of two.
//!
//! The writer is this test binary itself, re-executed with `CRASH_WRITER_DIR` set.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use compressed_backing::{
    BlockSize, Codec, CodecConfig, DiskStore, Durability, StoreConfig, StoreOptions,
};

const BLOCK: usize = 16 << 10;
const BLOCKS: u64 = 48;
const KILLS: usize = 60;

fn options(durability: Durability) -> StoreOptions {
    // Small segments and an eager compaction threshold, so that commits often also compact:
    // kills then land inside compaction too.
    StoreOptions {
        durability,
        segment_max_bytes: 256 << 10,
        compact_min_bytes: 32 << 10,
        compact_dead_ratio: 0.3,
        auto_compact: true,
    }
}

/// The content of block `block` in generation `generation`: some blocks zero, some random,
/// most compressible, every one distinct per generation.
fn pattern(generation: u64, block: u64) -> Vec<u8> {
    let mut out = vec![0u8; BLOCK];
    if block % 11 == 5 && generation.is_multiple_of(2) {
        return out;
    }
    out[..8].copy_from_slice(&generation.to_le_bytes());
    out[8..16].copy_from_slice(&block.to_le_bytes());
    let mut state = (generation << 20 | block).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let random = (generation + block).is_multiple_of(4);
    for (i, byte) in out[16..].iter_mut().enumerate() {
        if random || i % 64 == 0 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
        }
        *byte = state as u8;
    }
    out
}

/// The generation the store holds, if all its blocks agree on one.
fn whole_generation(store: &DiskStore, candidates: &[u64]) -> Option<u64> {
    let mut buf = vec![0u8; BLOCK];
    candidates.iter().copied().find(|&generation| {
        (0..BLOCKS)
            .all(|block| store.get(block, &mut buf).is_ok() && buf == pattern(generation, block))
    })
}

/// Which generation each block holds, for a failure message.
fn describe(store: &DiskStore) -> String {
    let mut buf = vec![0u8; BLOCK];
    (0..BLOCKS)
        .map(|block| match store.get(block, &mut buf) {
            Err(e) => format!("{block}:error({e})"),
            Ok(kind) => {
                let generation = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
                let whole = buf == pattern(generation, block);
                format!(
                    "{block}:{kind:?}:g{generation}{}",
                    if whole { "" } else { "!" }
                )
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The durability the writer child runs with (`CRASH_WRITER_DURABILITY`).
fn child_durability() -> Durability {
    match std::env::var("CRASH_WRITER_DURABILITY").as_deref() {
        Ok("process") => Durability::Process,
        _ => Durability::Host,
    }
}

fn writer(dir: &Path) {
    let options = || options(child_durability());
    let mut store = match DiskStore::open_with(dir, true, options()) {
        Ok(store) => store,
        Err(_) => {
            let config = StoreConfig {
                block_size: BlockSize::new(BLOCK as u64).expect("valid"),
                codec: CodecConfig::new(Codec::Lz4),
                image_size: BLOCKS * BLOCK as u64,
            };
            let mut store = DiskStore::create_with(dir, config, options()).expect("create");
            for block in 0..BLOCKS {
                store.put(block, &pattern(0, block)).expect("put");
            }
            store.commit().expect("commit");
            store
        }
    };
    let mut generation = u64::from_le_bytes(
        store
            .meta("generation")
            .expect("written with every commit")
            .try_into()
            .expect("u64"),
    );
    let mut stdout = std::io::stdout();
    loop {
        generation += 1;
        for block in 0..BLOCKS {
            store.put(block, &pattern(generation, block)).expect("put");
        }
        store
            .set_meta("generation", generation.to_le_bytes().to_vec())
            .expect("meta");
        store.commit().expect("commit");
        writeln!(stdout, "committed {generation}").expect("stdout");
        stdout.flush().expect("stdout");
    }
}

#[test]
fn crash_writer_child() {
    // Only does something when re-executed by the test below.
    if let Some(dir) = std::env::var_os("CRASH_WRITER_DIR") {
        writer(Path::new(&dir));
    }
}

#[test]
fn crash_kill_writer_at_random_points_leaves_old_or_new_image() {
    kill_writer_at_random_points(Durability::Host);
}

/// A VM's own offload store, committed without syncs: a writer killed at any point (a pager
/// replaced by its keeper) leaves the old image or the new one to the next, never a mix.
#[test]
fn crash_kill_process_durable_writer_at_random_points_leaves_old_or_new_image() {
    kill_writer_at_random_points(Durability::Process);
}

fn kill_writer_at_random_points(durability: Durability) {
    let options = || options(durability);
    let dir = tempfile::tempdir().expect("tempdir");
    // Generation 0 with its metadata, so every later state has both.
    {
        let config = StoreConfig {
            block_size: BlockSize::new(BLOCK as u64).unwrap(),
            codec: CodecConfig::new(Codec::Lz4),
            image_size: BLOCKS * BLOCK as u64,
        };
        let mut store = DiskStore::create_with(dir.path(), config, options()).unwrap();
        for block in 0..BLOCKS {
            store.put(block, &pattern(0, block)).unwrap();
        }
        store
            .set_meta("generation", 0u64.to_le_bytes().to_vec())
            .unwrap();
        store.commit().unwrap();
    }
    let exe = std::env::current_exe().unwrap();
    let mut rng = Instant::now().elapsed().subsec_nanos() as u64 | 0x9E37_79B9;
    let mut generation = 0u64;
    let mut advanced = 0;
    for kill in 0..KILLS {
        let mut child = Command::new(&exe)
            .args([
                "crash_writer_child",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("CRASH_WRITER_DIR", dir.path())
            .env(
                "CRASH_WRITER_DURABILITY",
                match durability {
                    Durability::Process => "process",
                    Durability::Host => "host",
                },
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_micros(2_000 + rng % 40_000));
        child.kill().unwrap();
        child.wait().unwrap();
        let acked = BufReader::new(child.stdout.take().unwrap())
            .lines()
            .map_while(Result::ok)
            // The harness prints `test crash_writer_child ... ` without a newline first, so
            // the first acknowledgement may share its line.
            .filter_map(|line| {
                let at = line.find("committed ")?;
                line[at + "committed ".len()..].trim().parse::<u64>().ok()
            })
            .max()
            .unwrap_or(generation);

        let store = DiskStore::open_with(dir.path(), true, options())
            .unwrap_or_else(|e| panic!("kill {kill}: reopen failed: {e}"));
        let found = whole_generation(&store, &[acked, acked + 1]).unwrap_or_else(|| {
            panic!(
                "kill {kill}: the image is neither generation {acked} nor {}: {}",
                acked + 1,
                describe(&store)
            )
        });
        let problems = store.verify().problems;
        assert!(problems.is_empty(), "kill {kill}: {problems:?}");
        let meta = u64::from_le_bytes(store.meta("generation").unwrap().try_into().unwrap());
        assert_eq!(meta, found, "kill {kill}: metadata and blocks disagree");
        if found > generation {
            advanced += 1;
        }
        generation = found;
    }
    // The kills must have interrupted a writer that was making progress, not only start-up.
    assert!(
        advanced >= KILLS / 3,
        "only {advanced} of {KILLS} runs committed anything"
    );
}
