//! What the bench measures and how its series are named: contents, codecs, store settings,
//! targets, the task lists of each phase and the keys that tie measurements, tables and the
//! chart together.
//!
//! Keys are dot-separated (`time.write.lz4.t2.random`); `key` builds them all.

use compressed_backing::bulk::{BulkOptions, DEFAULT_BATCH_BYTES};
use compressed_backing::Codec;

use crate::common::Content;

pub const MIB: f64 = (1u64 << 20) as f64;
pub const LZ4: Codec = Codec::Lz4;
pub const ZSTD1: Codec = Codec::Zstd { level: 1 };
pub const ZSTD3: Codec = Codec::Zstd { level: 3 };
pub const ZSTD9: Codec = Codec::Zstd { level: 9 };
/// Contents of the write and read phases.
pub const DISK_CONTENTS: [Content; 3] = [Content::Random, Content::Repeated, Content::Realistic];
/// Contents of the memory phase.
pub const MEMORY_CONTENTS: [Content; 2] = [Content::Realistic, Content::Repeated];
/// Codecs of the memory phase.
pub const DECODERS: [Codec; 2] = [LZ4, ZSTD3];
/// Image bytes per append of the information rows: `bulk`'s append size before it moved to
/// 4 MiB because 1 MiB page-cache writes looked slow on the project's VMs (see the notes).
pub const SMALL_APPENDS: usize = 1 << 20;

/// A target: a bound that a median must reach (`higher`) or stay under.
#[derive(Clone, Copy)]
pub struct Goal {
    pub value: f64,
    pub higher: bool,
}

impl Goal {
    pub fn met(self, value: f64) -> bool {
        if self.higher {
            value >= self.value
        } else {
            value <= self.value
        }
    }
}

/// lz4 block decompression at least a quarter of memcpy speed (judged against memcpy block by
/// block, see the report).
pub const DECODE_SPEED: Goal = Goal {
    value: 0.25,
    higher: true,
};
/// A store write of random content at most 1.3 times a raw write.
pub const WRITE_COST: Goal = Goal {
    value: 1.3,
    higher: false,
};
/// Disk bytes allowed per 64 MiB of repeated content.
pub const REPEATED_DISK_PER_64MIB: f64 = MIB;

/// A key from its parts: `key(&["time", "write", "raw", "random"])`.
pub fn key(parts: &[&str]) -> String {
    parts.join(".")
}

/// Settings of one store write (or, with the read phase's thread count, one store read).
#[derive(Clone, Copy, PartialEq)]
pub struct StoreCase {
    pub codec: Codec,
    pub threads: usize,
    pub batch_bytes: usize,
}

impl StoreCase {
    /// `BulkOptions` defaults (4 MiB appends) with `threads` workers.
    pub const fn new(codec: Codec, threads: usize) -> Self {
        Self {
            codec,
            threads,
            batch_bytes: DEFAULT_BATCH_BYTES,
        }
    }

    const fn appending(self, batch_bytes: usize) -> Self {
        Self {
            batch_bytes,
            ..self
        }
    }

    pub fn options(self) -> BulkOptions {
        BulkOptions {
            threads: self.threads,
            batch_bytes: self.batch_bytes,
        }
    }

    /// `lz4.t2`, with `.b1MiB` for other than the default appends.
    pub fn key(self) -> String {
        let mut key = format!("{}.t{}", self.codec, self.threads);
        if self.batch_bytes != DEFAULT_BATCH_BYTES {
            key.push_str(&format!(".b{}MiB", self.batch_bytes >> 20));
        }
        key
    }

    /// `lz4 2 threads`, with `, 1 MiB appends` for other than the default appends.
    pub fn label(self) -> String {
        let mut label = format!("{} {}", self.codec, threads_label(self.threads));
        if self.batch_bytes != DEFAULT_BATCH_BYTES {
            label.push_str(&format!(", {} MiB appends", self.batch_bytes >> 20));
        }
        label
    }
}

pub fn threads_label(threads: usize) -> String {
    if threads == 1 {
        "1 thread".to_owned()
    } else {
        format!("{threads} threads")
    }
}

/// lz4 stores with default appends on 2 and 1 threads: written and read for every content.
pub const LZ4_CASES: [StoreCase; 2] = [StoreCase::new(LZ4, 2), StoreCase::new(LZ4, 1)];
/// The store that the read phase reads (with each of `LZ4_CASES`' thread counts).
pub const READ_SOURCE: StoreCase = StoreCase::new(LZ4, 2);

/// lz4 stores written beside the raw file: `LZ4_CASES`, plus, on random content, the same
/// with 1 MiB appends for information.
pub fn write_cases(content: Content) -> Vec<StoreCase> {
    let mut cases = LZ4_CASES.to_vec();
    if content == Content::Random {
        cases.extend(LZ4_CASES.map(|case| case.appending(SMALL_APPENDS)));
    }
    cases
}

/// Stores whose sizes and compression ratios are reported, in report order.
pub const SIZE_STORES: [(StoreCase, Content); 7] = [
    (StoreCase::new(LZ4, 2), Content::Repeated),
    (StoreCase::new(ZSTD3, 2), Content::Repeated),
    (StoreCase::new(LZ4, 2), Content::Realistic),
    (StoreCase::new(ZSTD1, 2), Content::Realistic),
    (StoreCase::new(ZSTD3, 2), Content::Realistic),
    (StoreCase::new(ZSTD9, 2), Content::Realistic),
    (StoreCase::new(LZ4, 2), Content::Random),
];

/// The zstd stores: written for their sizes and speed only.
pub fn zstd_stores() -> impl Iterator<Item = (StoreCase, Content)> {
    SIZE_STORES
        .into_iter()
        .filter(|(case, _)| case.codec != LZ4)
}

/// `lz4.t2.random`: a store's part of its size keys.
pub fn store_key(case: StoreCase, content: Content) -> String {
    key(&[&case.key(), content.name()])
}

/// The file side of a write or read: the raw file or a store.
#[derive(Clone, Copy)]
pub enum Side {
    Raw,
    Store(StoreCase),
}

impl Side {
    pub fn key(self) -> String {
        match self {
            Side::Raw => "raw".to_owned(),
            Side::Store(case) => case.key(),
        }
    }
}

/// A store write or read compared with the same on the raw file.
#[derive(Clone, Copy)]
pub enum Op {
    Write,
    Read,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Read => "read",
        }
    }

    /// The series of `prefix` (`time`, `speed`, `faults`) of this operation on `side`.
    pub fn key(self, prefix: &str, side: Side, content: Content) -> String {
        key(&[prefix, self.name(), &side.key(), content.name()])
    }

    /// The per-run ratio store time / raw time.
    pub fn cost_key(self, case: StoreCase, content: Content) -> String {
        let ratio = format!("ratio.{}_cost_vs_raw", self.name());
        key(&[&ratio, &case.key(), content.name()])
    }

    /// The stores compared with the raw file on `content`.
    pub fn cases(self, content: Content) -> Vec<StoreCase> {
        match self {
            Op::Write => write_cases(content),
            Op::Read => LZ4_CASES.to_vec(),
        }
    }
}

/// Every store-versus-raw comparison, in report order.
pub fn comparisons() -> Vec<(Op, StoreCase, Content)> {
    let mut all = Vec::new();
    for op in [Op::Write, Op::Read] {
        for content in DISK_CONTENTS {
            all.extend(
                op.cases(content)
                    .into_iter()
                    .map(|case| (op, case, content)),
            );
        }
    }
    all
}

/// The write phase's tasks, before rotation.
pub fn write_tasks() -> Vec<(Content, Side)> {
    let mut tasks = Vec::new();
    for content in DISK_CONTENTS {
        tasks.push((content, Side::Raw));
        tasks.extend(
            write_cases(content)
                .into_iter()
                .map(|c| (content, Side::Store(c))),
        );
    }
    tasks.extend(zstd_stores().map(|(case, content)| (content, Side::Store(case))));
    tasks
}

/// The read phase's tasks, before rotation.
pub fn read_tasks() -> Vec<(Content, Side)> {
    let mut tasks = Vec::new();
    for content in DISK_CONTENTS {
        tasks.push((content, Side::Raw));
        tasks.extend(LZ4_CASES.map(|case| (content, Side::Store(case))));
    }
    tasks
}

/// One timed section of the memory phase.
#[derive(Clone, Copy)]
pub enum MemOp {
    /// One `copy_from_slice` of the whole image.
    MemcpyWhole,
    /// One `copy_from_slice` per 64 KiB block, in order.
    MemcpyBlocks,
    /// Decoding of every block, in order, each into its place.
    Decode(Codec),
}

/// The two memcpy baselines: block by block (the one targets are judged against) first.
pub const MEMCPY: [MemOp; 2] = [MemOp::MemcpyBlocks, MemOp::MemcpyWhole];

impl MemOp {
    pub fn name(self) -> String {
        match self {
            MemOp::MemcpyWhole => "memcpy_whole".to_owned(),
            MemOp::MemcpyBlocks => "memcpy_blocks".to_owned(),
            MemOp::Decode(codec) => codec.to_string(),
        }
    }

    pub fn label(self) -> String {
        match self {
            MemOp::MemcpyWhole => "memcpy, whole buffer".to_owned(),
            MemOp::MemcpyBlocks => "memcpy, block by block".to_owned(),
            MemOp::Decode(codec) => format!("{codec} decompress"),
        }
    }

    /// The series of `prefix` (`time`, `speed`, `faults`) of this operation on `content`.
    pub fn key(self, prefix: &str, content: Content) -> String {
        key(&[prefix, "mem", &self.name(), content.name()])
    }
}

/// The per-run ratio memcpy time / decode time (decode speed as a share of memcpy speed).
pub fn decode_ratio_key(codec: Codec, memcpy: MemOp, content: Content) -> String {
    let ratio = format!("ratio.decode_vs_{}", memcpy.name());
    key(&[&ratio, &codec.to_string(), content.name()])
}

/// The per-run ratio memcpy block by block time / whole-buffer time (how much faster the
/// whole-buffer copy is).
pub fn memcpy_ratio_key(content: Content) -> String {
    key(&["ratio.memcpy_whole_vs_blocks", content.name()])
}

/// The memory phase's tasks, before rotation.
pub fn memory_tasks() -> Vec<(Content, MemOp)> {
    let mut tasks = Vec::new();
    for content in MEMORY_CONTENTS {
        tasks.extend(MEMCPY.map(|op| (content, op)));
        tasks.extend(DECODERS.map(|codec| (content, MemOp::Decode(codec))));
    }
    tasks
}

/// `tasks` rotated for run `run`: run *r* starts at task *r*.
pub fn rotated<T>(mut tasks: Vec<T>, run: usize) -> Vec<T> {
    let len = tasks.len().max(1);
    tasks.rotate_left(run % len);
    tasks
}
