//! Criterion micro-benches of the block codecs and the memory pool, per 64 KiB block.
//!
//! Groups (throughput in bytes of the uncompressed block):
//! - `encode_64KiB/<codec>/<content>` and `decode_64KiB/<codec>/<content>` for the codecs
//!   none, lz4, zstd:1 and zstd:3 on zero, repeated, random and realistic content;
//! - `memcpy_64KiB/<content>`: a plain copy of the same blocks, the yardstick;
//! - `pool_lz4_64KiB/{put,get,take}/<content>`: `MemoryPool` with lz4 (random content only
//!   for `put`: the pool refuses incompressible blocks, so that is the bail-out's cost).
//!
//! `none` encodes by looking at the block (zero/same-byte check) and returning it as is, so its
//! encode figures are that check alone; the copy happens where the payload is stored.
//!
//! Each iteration takes the next block of a 64 MiB image of the content (4 MiB when run as a
//! test), so the realistic sample is measured over all of its blocks, not one lucky block.
//! Contents are described in `benches/common/mod.rs`.
//!
//! Run: `cargo bench --bench codecs` (about two minutes); `-- encode` filters groups.

use std::hint::black_box;
use std::time::Duration;

use compressed_backing::{
    BlockKind, BlockSize, Codec, CodecConfig, Decoder, Encoder, MemoryPool, PoolConfig,
};
use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BatchSize, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};

use benchkit::{Content, BLOCK, IMAGE};

const CODECS: [Codec; 4] = [
    Codec::None,
    Codec::Lz4,
    Codec::Zstd { level: 1 },
    Codec::Zstd { level: 3 },
];

/// One content cut into blocks.
struct Image {
    content: Content,
    bytes: Vec<u8>,
}

impl Image {
    fn blocks(&self) -> usize {
        self.bytes.len() / BLOCK
    }

    fn block(&self, index: usize) -> &[u8] {
        &self.bytes[index * BLOCK..(index + 1) * BLOCK]
    }
}

/// Yields block indices 0, 1, 2, … cycling over `blocks`.
fn cycle(blocks: usize) -> impl FnMut() -> usize {
    let mut next = 0;
    move || {
        let index = next;
        next = (next + 1) % blocks;
        index
    }
}

fn encode_all(image: &Image, codec: Codec) -> Vec<(BlockKind, Vec<u8>)> {
    let mut encoder = Encoder::new(CodecConfig::new(codec)).expect("codec context");
    (0..image.blocks())
        .map(|i| {
            let encoded = encoder.encode(image.block(i));
            (encoded.kind, encoded.payload.to_vec())
        })
        .collect()
}

fn images() -> Vec<Image> {
    // As a smoke test (`cargo test --benches`) a small image keeps the setup quick.
    let len = if benchkit::is_bench_run() {
        IMAGE
    } else {
        4 << 20
    };
    let sample = benchkit::realistic(len).expect("realistic sample");
    Content::ALL
        .into_iter()
        .map(|content| Image {
            content,
            bytes: benchkit::content(content, len, &sample),
        })
        .collect()
}

/// A group whose throughput is counted in bytes of one uncompressed block per iteration.
fn block_group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Bytes(BLOCK as u64));
    group
}

/// Benchmarks `routine` on what `setup` returns (untimed), in batches of `size`.
fn batched<I, O>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: BenchmarkId,
    mut setup: impl FnMut() -> I,
    mut routine: impl FnMut(I) -> O,
    size: BatchSize,
) {
    group.bench_function(id, |b| b.iter_batched(&mut setup, &mut routine, size));
}

fn codecs(c: &mut Criterion) {
    let images = images();

    let mut group = block_group(c, "encode_64KiB");
    for image in &images {
        for codec in CODECS {
            let mut encoder = Encoder::new(CodecConfig::new(codec)).expect("codec context");
            let mut next = cycle(image.blocks());
            let id = BenchmarkId::new(codec.to_string(), image.content.name());
            batched(
                &mut group,
                id,
                || image.block(next()),
                |block| {
                    let encoded = encoder.encode(black_box(block));
                    black_box((encoded.kind, encoded.payload.len()))
                },
                BatchSize::SmallInput,
            );
        }
    }
    group.finish();

    let mut group = block_group(c, "decode_64KiB");
    for image in &images {
        for codec in CODECS {
            let encoded = encode_all(image, codec);
            let mut decoder = Decoder::new();
            let mut out = vec![0u8; BLOCK];
            let mut next = cycle(encoded.len());
            let id = BenchmarkId::new(codec.to_string(), image.content.name());
            batched(
                &mut group,
                id,
                || &encoded[next()],
                |(kind, payload)| {
                    decoder
                        .decode(*kind, black_box(payload), &mut out)
                        .expect("a payload just encoded decodes");
                    black_box(&out);
                },
                BatchSize::SmallInput,
            );
        }
    }
    group.finish();

    let mut group = block_group(c, "memcpy_64KiB");
    for image in &images {
        let mut out = vec![0u8; BLOCK];
        let mut next = cycle(image.blocks());
        batched(
            &mut group,
            BenchmarkId::from_parameter(image.content.name()),
            || image.block(next()),
            |block| {
                out.copy_from_slice(black_box(block));
                black_box(&out);
            },
            BatchSize::SmallInput,
        );
    }
    group.finish();

    let mut group = block_group(c, "pool_lz4_64KiB");
    for image in &images {
        let blocks = image.blocks();
        let pool = MemoryPool::new(PoolConfig {
            block_size: BlockSize::new(BLOCK as u64).expect("valid block size"),
            codec: CodecConfig::new(Codec::Lz4),
            blocks: blocks as u64,
            cap_bytes: 2 << 30,
        })
        .expect("pool");
        let name = image.content.name();
        let mut out = vec![0u8; BLOCK];

        // A batch never holds the same key twice, so each put lands in an empty slot and each
        // take finds its block.
        let batch = BatchSize::NumIterations(blocks as u64);

        // put: into an empty slot (the setup removes the key, untimed).
        let mut next = cycle(blocks);
        batched(
            &mut group,
            BenchmarkId::new("put", name),
            || {
                let index = next();
                pool.remove(index as u64).expect("key in range");
                index
            },
            |index| black_box(pool.put(index as u64, image.block(index)).expect("put")),
            batch,
        );

        // The pool refuses incompressible blocks: there is nothing to get or take.
        if image.content == Content::Random {
            continue;
        }

        // get: from a full pool.
        for index in 0..blocks {
            pool.put(index as u64, image.block(index)).expect("put");
        }
        let mut next = cycle(blocks);
        batched(
            &mut group,
            BenchmarkId::new("get", name),
            || next() as u64,
            |key| {
                black_box(pool.get(key, &mut out).expect("get"));
                black_box(&out);
            },
            BatchSize::SmallInput,
        );

        // take: get and remove (the setup puts the block back, untimed).
        let mut next = cycle(blocks);
        batched(
            &mut group,
            BenchmarkId::new("take", name),
            || {
                let index = next();
                pool.put(index as u64, image.block(index)).expect("put");
                index as u64
            },
            |key| {
                black_box(pool.take(key, &mut out).expect("take"));
                black_box(&out);
            },
            batch,
        );
    }
    group.finish();
}

criterion_group! {
    name = benches;
    // Small samples keep the whole run to a couple of minutes on a 2-core machine; the
    // scenario bench (`store_report`) is the one that compares figures across runs.
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .nresamples(20_000);
    targets = codecs
}
criterion_main!(benches);
