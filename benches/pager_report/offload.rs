//! Part 3: offload throughput. An in-process pager serves a fresh anonymous region; the
//! "application" writes its data (untimed), the file system is synced (untimed), then
//! `Pager::offload` is timed as a whole: compose and write every resident block to a new
//! `DiskStore` (2 worker threads, the default `BulkOptions`), commit it durably, drop the
//! pages (`MADV_DONTNEED`) and wait for the kernel's discard events.

use std::path::Path;
use std::time::Instant;

use compressed_backing::bulk::BulkOptions;
use compressed_backing::{Codec, CodecConfig};
use uffd_pager::offload::OffloadConfig;
use uffd_pager::pager::PagerConfig;

use crate::common;
use crate::common::results::Results;
use crate::ram::{self, Mapping, PAGE};
use crate::Res;

/// What the region holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    /// `repeated` bytes of a repeated motif, then `random` bytes of random data; the rest of
    /// the region never touched.
    Mixed,
    /// Every byte written, with the ELF image.
    Full,
}

impl Content {
    pub fn key(self) -> &'static str {
        match self {
            Content::Mixed => "mixed",
            Content::Full => "full",
        }
    }
}

pub const CODECS: [Codec; 2] = [Codec::None, Codec::Lz4];

pub fn codec_key(codec: Codec) -> &'static str {
    match codec {
        Codec::None => "none",
        Codec::Lz4 => "lz4",
        Codec::Zstd { .. } => "zstd",
    }
}

pub struct Setup<'a> {
    pub dir: &'a Path,
    pub image: &'a [u8],
    pub repeated: &'a [u8],
    pub random: &'a [u8],
}

/// Measures both contents with both codecs once, in an order rotated by `run`.
pub fn round(run: usize, setup: &Setup<'_>, results: &mut Results) -> Res<()> {
    let mut cases = Vec::new();
    for content in [Content::Mixed, Content::Full] {
        for codec in CODECS {
            cases.push((content, codec));
        }
    }
    for i in 0..cases.len() {
        let (content, codec) = cases[(i + run) % cases.len()];
        measure(run, content, codec, setup, results)?;
    }
    Ok(())
}

fn measure(
    run: usize,
    content: Content,
    codec: Codec,
    setup: &Setup<'_>,
    results: &mut Results,
) -> Res<()> {
    let len = setup.image.len();
    let map = Mapping::try_anon(len)?;
    let pager = ram::pager(&map, PagerConfig::default(), None)?;
    let resident = match content {
        Content::Mixed => {
            map.write(0, setup.repeated);
            map.write(setup.repeated.len(), setup.random);
            setup.repeated.len() + setup.random.len()
        }
        Content::Full => {
            map.write(0, setup.image);
            len
        }
    };
    let dir = setup
        .dir
        .join(format!("offload-{}-{}", content.key(), codec_key(codec)));
    // Pages for the store's page cache, then nothing dirty left from earlier work.
    ram::recycle(len + len / 4)?;
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    let started = Instant::now();
    let report = pager.offload(&OffloadConfig {
        dir: dir.clone(),
        codec: CodecConfig::new(codec),
        bulk: BulkOptions::default(),
        durability: compressed_backing::Durability::Process,
        direct_reads: true,
    })?;
    let elapsed = started.elapsed().as_secs_f64();
    if report.pages_dropped != (resident / PAGE) as u64 {
        return Err(format!(
            "{content:?} {codec}: {} pages dropped, {} were resident",
            report.pages_dropped,
            resident / PAGE
        )
        .into());
    }
    // Untimed: a page of each kind of data reads back right.
    let probes = [0, resident - PAGE];
    for at in probes {
        let want = match content {
            Content::Full => setup.image[at],
            Content::Mixed if at < setup.repeated.len() => setup.repeated[at],
            Content::Mixed => setup.random[at - setup.repeated.len()],
        };
        if map.read(at) != want {
            return Err(format!("{content:?} {codec}: byte {at} differs after the offload").into());
        }
    }
    drop(pager);
    drop(map);
    std::fs::remove_dir_all(&dir)?;
    let key = format!("offload.{}.{}", content.key(), codec_key(codec));
    results.put_all(
        &key,
        run,
        [
            ("ms", "ms", elapsed * 1e3),
            ("write_ms", "ms", report.write_ms),
            ("drop_ms", "ms", report.drop_ms),
            (
                "resident_mib",
                "MiB",
                resident as f64 / f64::from(1u32 << 20),
            ),
            ("gbps", "GB/s", resident as f64 / 1e9 / elapsed),
            ("stored_bytes", "bytes", report.stored_bytes as f64),
            ("disk_bytes", "bytes", report.store.disk_bytes as f64),
            ("blocks", "blocks", report.blocks_written as f64),
        ],
    );
    Ok(())
}

/// The mixed content's two parts.
pub fn mixed_data(repeated: usize, random: usize) -> (Vec<u8>, Vec<u8>) {
    (
        common::repeated(repeated),
        common::random(random, common::RANDOM_SEED),
    )
}
