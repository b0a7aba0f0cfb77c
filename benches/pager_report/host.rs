//! The machine side of the bench beyond `common::host`: the image content (real ELF bytes)
//! and the CPU time other work took during a measurement.

use std::time::Instant;

use crate::common::host::{ticks_per_second, CpuTimes};
use crate::common::{self, Res};

/// The image content: real x86-64 ELF code and data, `PAGER_BENCH_SAMPLE=FILE` first, then the
/// toolchain's `librustc_driver-*.so`, then the ELF files of `/usr/bin`; `tile` bytes of it are
/// repeated up to `len`.
pub struct Image {
    pub bytes: Vec<u8>,
    pub sources: Vec<String>,
    /// Bytes of real data before the image repeats.
    pub tile: usize,
    /// FNV-1a 64 of the whole image.
    pub fnv: u64,
}

pub fn image(len: usize, tile: usize) -> Res<Image> {
    let tile = tile.min(len);
    let sample = common::elf_sample(tile, "PAGER_BENCH_SAMPLE")?;
    let mut bytes = sample.bytes;
    bytes.reserve(len - tile);
    while bytes.len() < len {
        let take = tile.min(len - bytes.len());
        bytes.extend_from_within(..take);
    }
    Ok(Image {
        fnv: common::fnv1a64(&bytes),
        bytes,
        sources: sample.sources,
        tile,
    })
}

/// CPU time of the whole machine and of this process, to tell how much other work ran
/// during a measurement (the machine is shared).
#[derive(Debug, Clone, Copy)]
pub struct CpuSample {
    at: Instant,
    times: Option<CpuTimes>,
}

impl CpuSample {
    pub fn now() -> Self {
        let times = CpuTimes::now();
        Self {
            at: Instant::now(),
            times,
        }
    }

    /// `(other, steal)`: CPU used by other processes and stolen by the host since `self`, in
    /// percent of one CPU (zero if `/proc/stat` cannot be read).
    pub fn since(&self) -> (f64, f64) {
        let now = Self::now();
        let (Some(then), Some(times)) = (self.times, now.times) else {
            return (0.0, 0.0);
        };
        let hz = ticks_per_second();
        let secs = now.at.duration_since(self.at).as_secs_f64().max(1e-3);
        let pct = |ticks: u64| ticks as f64 / hz / secs * 100.0;
        let other = (times.busy - then.busy).saturating_sub(times.own - then.own);
        (pct(other), pct(times.steal - then.steal))
    }
}
