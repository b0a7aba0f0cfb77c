//! The three timed phases of a round: memory (memcpy and decompression), writes (raw file and
//! stores) and reads from disk. Each records into `Results` under the keys of `plan`.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::hint::black_box;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use compressed_backing::bulk::{self, SliceSource};
use compressed_backing::{
    BlockKind, BlockSize, Codec, CodecConfig, Decoder, DiskStore, Encoder, StoreConfig, StoreStats,
};

use crate::common::{Content, BLOCK};
use crate::pagecache;
use crate::plan::{self, MemOp, Op, Side, StoreCase};
use crate::results::{record_timed, Results};
use crate::Res;

/// An image encoded block by block: kind and payload of each block.
pub type EncodedImage = Vec<(BlockKind, Vec<u8>)>;

pub fn encode_image(bytes: &[u8], codec: Codec) -> Res<EncodedImage> {
    let mut encoder = Encoder::new(CodecConfig::new(codec))?;
    Ok(bytes
        .chunks(BLOCK)
        .map(|block| {
            let encoded = encoder.encode(block);
            (encoded.kind, encoded.payload.to_vec())
        })
        .collect())
}

/// Wall time and minor page faults (all threads of the process) of a timed section.
#[derive(Clone, Copy)]
pub struct Measured {
    pub seconds: f64,
    pub minor_faults: u64,
}

/// Runs `section` and measures it.
fn timed<T>(section: impl FnOnce() -> T) -> (T, Measured) {
    let faults = minor_faults();
    let start = Instant::now();
    let value = section();
    let seconds = start.elapsed().as_secs_f64();
    let measured = Measured {
        seconds,
        minor_faults: minor_faults().saturating_sub(faults),
    };
    (value, measured)
}

/// Like `timed`, for a section that can fail.
fn timed_ok(section: impl FnOnce() -> Res<()>) -> Res<Measured> {
    let (result, measured) = timed(section);
    result.map(|()| measured)
}

fn minor_faults() -> u64 {
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid, writable rusage.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    if rc != 0 {
        return 0;
    }
    u64::try_from(usage.ru_minflt).unwrap_or(0)
}

/// A new buffer whose every page has been written (so no page fault is timed), and which
/// pushes older data out of the CPU caches.
fn fresh_buffer(len: usize) -> Vec<u8> {
    black_box(vec![0x55u8; len])
}

fn check_same(what: &str, got: &[u8], expected: &[u8]) -> Res<()> {
    if got == expected {
        Ok(())
    } else {
        Err(format!("{what}: bytes differ from the image").into())
    }
}

pub fn memory_round(
    run: usize,
    data: &BTreeMap<Content, Vec<u8>>,
    encoded: &BTreeMap<(Content, String), EncodedImage>,
    results: &mut Results,
) -> Res<()> {
    for (content, op) in plan::rotated(plan::memory_tasks(), run) {
        let source = &data[&content];
        let mut dest = fresh_buffer(source.len());
        let measured = match op {
            MemOp::MemcpyWhole => timed(|| dest.copy_from_slice(black_box(source))).1,
            MemOp::MemcpyBlocks => {
                timed(|| {
                    for (out, block) in dest.chunks_mut(BLOCK).zip(source.chunks(BLOCK)) {
                        // `black_box` keeps the compiler from merging the copies into one.
                        out.copy_from_slice(black_box(block));
                    }
                })
                .1
            }
            MemOp::Decode(codec) => {
                let blocks = &encoded[&(content, codec.to_string())];
                let mut decoder = Decoder::new();
                // Creates the zstd context outside the timed loop.
                let (kind, payload) = &blocks[0];
                decoder.decode(*kind, payload, &mut vec![0u8; BLOCK])?;
                timed_ok(|| {
                    for ((kind, payload), out) in blocks.iter().zip(dest.chunks_mut(BLOCK)) {
                        decoder.decode(*kind, payload, out)?;
                    }
                    Ok(())
                })?
            }
        };
        black_box(&mut dest);
        check_same(&op.key("mem", content), &dest, source)?;
        record_timed(results, run, |prefix| op.key(prefix, content), measured);
    }
    Ok(())
}

/// What the read phase reads: per content, the raw file and the `plan::READ_SOURCE` store.
pub struct Written {
    raw: BTreeMap<Content, PathBuf>,
    store: BTreeMap<Content, PathBuf>,
}

pub fn write_round(
    run: usize,
    dir: &Path,
    ballast: &Path,
    data: &BTreeMap<Content, Vec<u8>>,
    results: &mut Results,
) -> Res<Written> {
    let mut written = Written {
        raw: BTreeMap::new(),
        store: BTreeMap::new(),
    };
    for (content, side) in plan::rotated(plan::write_tasks(), run) {
        let bytes = &data[&content];
        let path = dir.join(format!("{}.{}", side.key(), content.name()).replace(':', "-"));
        // Flushes whatever else is dirty (earlier rounds, other processes) so that it is not
        // written back during the timed section.
        // SAFETY: sync(2) has no preconditions.
        unsafe { libc::sync() };
        pagecache::recycle(ballast)?;
        let measured = match side {
            Side::Raw => {
                let (file, measured) = timed(|| write_raw(&path, bytes));
                drop(file?);
                let disk = pagecache::allocated(&path)?;
                let size_key = plan::key(&["size.disk.raw", content.name()]);
                results.put(&size_key, "B", run, disk as f64);
                written.raw.insert(content, path);
                measured
            }
            Side::Store(case) => {
                let (store, measured) = timed(|| write_store(&path, case, bytes));
                let stats = store?.stats();
                record_store_stats(run, &plan::store_key(case, content), &stats, &path, results)?;
                if case == plan::READ_SOURCE {
                    written.store.insert(content, path);
                }
                measured
            }
        };
        record_timed(
            results,
            run,
            |prefix| Op::Write.key(prefix, side, content),
            measured,
        );
    }
    Ok(written)
}

/// Creates a file at `path`, writes `bytes` with one `pwrite` and fsyncs it.
fn write_raw(path: &Path, bytes: &[u8]) -> Res<File> {
    let file = OpenOptions::new().write(true).create_new(true).open(path)?;
    file.write_all_at(bytes, 0)?;
    file.sync_all()?;
    Ok(file)
}

/// Creates a store of `bytes` at `path`, writes every block and commits.
fn write_store(path: &Path, case: StoreCase, bytes: &[u8]) -> Res<DiskStore> {
    let mut store = DiskStore::create(
        path,
        StoreConfig {
            block_size: BlockSize::new(BLOCK as u64)?,
            codec: CodecConfig::new(case.codec),
            image_size: bytes.len() as u64,
        },
    )?;
    let blocks = bulk::all_blocks(&store);
    let source = SliceSource::new(bytes, BLOCK);
    bulk::write_blocks(&mut store, &source, &blocks, &case.options(), &|_| {})?;
    store.commit()?;
    Ok(store)
}

fn record_store_stats(
    run: usize,
    store: &str,
    stats: &StoreStats,
    dir: &Path,
    results: &mut Results,
) -> Res<()> {
    let mut all_files = 0;
    for entry in fs::read_dir(dir)? {
        all_files += pagecache::allocated(&entry?.path())?;
    }
    let series = [
        ("size.raw", "B", stats.raw_bytes),
        ("size.stored", "B", stats.stored_bytes),
        ("size.disk", "B", stats.disk_bytes),
        ("size.all_files", "B", all_files),
        ("blocks.zero", "blocks", stats.zero_blocks),
        ("blocks.fill", "blocks", stats.fill_blocks),
        ("blocks.raw", "blocks", stats.raw_blocks),
        ("blocks.compressed", "blocks", stats.compressed_blocks),
    ];
    for (name, unit, value) in series {
        results.put(&plan::key(&[name, store]), unit, run, value as f64);
    }
    Ok(())
}

pub fn read_round(
    run: usize,
    written: &Written,
    ballast: &Path,
    data: &BTreeMap<Content, Vec<u8>>,
    results: &mut Results,
) -> Res<()> {
    for (content, side) in plan::rotated(plan::read_tasks(), run) {
        let expected = &data[&content];
        let files = match side {
            Side::Raw => vec![written.raw[&content].clone()],
            Side::Store(_) => fs::read_dir(&written.store[&content])?
                .map(|entry| entry.map(|e| e.path()))
                .collect::<io::Result<Vec<_>>>()?,
        };
        // The destination first: touching it must not use up the recycled pages.
        let mut dest = fresh_buffer(expected.len());
        pagecache::recycle(ballast)?;
        let resident = pagecache::drop_cached(&files)?;
        let cache_key = Op::Read.key("cache.resident", side, content);
        results.put(&cache_key, "share", run, resident);
        let measured = match side {
            Side::Raw => timed_ok(|| Ok(File::open(&files[0])?.read_exact_at(&mut dest, 0)?))?,
            Side::Store(case) => {
                let store_dir = &written.store[&content];
                let chunks: Vec<Mutex<&mut [u8]>> =
                    dest.chunks_mut(BLOCK).map(Mutex::new).collect();
                timed_ok(|| read_store(store_dir, case, &chunks))?
            }
        };
        check_same(&Op::Read.key("read", side, content), &dest, expected)?;
        record_timed(
            results,
            run,
            |prefix| Op::Read.key(prefix, side, content),
            measured,
        );
    }
    Ok(())
}

/// Opens the store at `dir` and reads every block into its chunk of the destination.
fn read_store(dir: &Path, case: StoreCase, chunks: &[Mutex<&mut [u8]>]) -> Res<()> {
    let store = DiskStore::open_read_only(dir)?;
    let blocks = bulk::all_blocks(&store);
    let sink = |block: u64, _kind: Option<BlockKind>, bytes: &[u8]| {
        let chunk = usize::try_from(block)
            .ok()
            .and_then(|i| chunks.get(i))
            .ok_or_else(|| io::Error::other("block out of range"))?;
        chunk
            .lock()
            .map_err(|_| io::Error::other("poisoned"))?
            .copy_from_slice(bytes);
        Ok(())
    };
    bulk::read_blocks(&store, &blocks, &case.options(), &sink, &|_| {})?;
    Ok(())
}
