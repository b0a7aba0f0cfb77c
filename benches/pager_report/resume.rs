//! Part 4: resuming with the recorded working set. An in-process pager serves a region the
//! application filled with the image; it is offloaded (lz4), then resumed three times with
//! `Pager::load(LoadMode::Lazy, 2)` (two threads for the recorded working set): after each load the bench waits `head start` (the time a
//! real resume gives the prefetcher before the vCPU's first access), then one thread touches
//! the working set (1 MiB at the start of every 8 MiB, one byte per page, in order), counting
//! the synchronous faults (`faults_copy + faults_zero` deltas over the touch) and timing it.
//! After each touch the prefetcher is left to finish (the VM runs on) and the region is
//! offloaded again, which saves the blocks faulted during that resume as the next working set.
//! A chain with no head start and a chain with the configured head start run in every round.

use std::path::Path;
use std::time::Duration;

use compressed_backing::bulk::BulkOptions;
use compressed_backing::{Codec, CodecConfig};
use uffd_pager::load::LoadMode;
use uffd_pager::offload::OffloadConfig;
use uffd_pager::pager::PagerConfig;

use crate::common::results::Results;
use crate::ram::{self, Mapping, PAGE};
use crate::Res;

/// Resumes per chain: the first (nothing recorded), the second (the first's working set), and
/// a third (the second's).
pub const RESUMES: usize = 3;

pub struct Setup<'a> {
    pub dir: &'a Path,
    pub image: &'a [u8],
    pub working_set: &'a [(usize, usize)],
    /// Head starts, one chain each.
    pub head_starts_ms: &'a [u64],
}

pub fn key(head_start_ms: u64, resume: usize) -> String {
    format!("resume.h{head_start_ms}.r{resume}")
}

/// Runs every chain once, the order alternating with `run`.
pub fn round(run: usize, setup: &Setup<'_>, results: &mut Results) -> Res<()> {
    let n = setup.head_starts_ms.len();
    for i in 0..n {
        let head_start = setup.head_starts_ms[(i + run) % n];
        chain(run, head_start, setup, results)?;
    }
    Ok(())
}

fn chain(run: usize, head_start_ms: u64, setup: &Setup<'_>, results: &mut Results) -> Res<()> {
    let map = Mapping::try_anon(setup.image.len())?;
    let pager = ram::pager(&map, PagerConfig::default(), None)?;
    map.write(0, setup.image);
    let dir = setup.dir.join(format!("resume-h{head_start_ms}"));
    let config = OffloadConfig {
        dir: dir.clone(),
        codec: CodecConfig::new(Codec::Lz4),
        bulk: BulkOptions::default(),
        durability: compressed_backing::Durability::Process,
        direct_reads: true,
    };
    let expected = ram::expected_sum(setup.image, setup.working_set);
    pager.offload(&config)?;
    for resume in 1..=RESUMES {
        ram::recycle(setup.image.len() + setup.image.len() / 8)?;
        let at_load = pager.metrics().snapshot();
        let load = pager.load(LoadMode::Lazy, 2)?;
        std::thread::sleep(Duration::from_millis(head_start_ms));
        let before = pager.metrics().snapshot();
        let cpu = crate::common::host::CpuSample::now();
        let pass = ram::touch_pages(&map, setup.working_set);
        let (other_cpu, _) = cpu.since();
        let after = pager.metrics().snapshot();
        if pass.sum != expected {
            return Err(format!("resume {resume}: the working set differs from the image").into());
        }
        let sync_faults =
            (after.faults_copy + after.faults_zero) - (before.faults_copy + before.faults_zero);
        // Faults that found their block already installed (by the prefetcher, while they
        // waited): the touching thread still waited for them.
        let raced = after.eexist_races - before.eexist_races;
        let key = key(head_start_ms, resume);
        let mib = f64::from(1u32 << 20);
        results.put_all(
            &key,
            run,
            [
                ("sync_faults", "faults", sync_faults as f64),
                ("thread_faults", "faults", pass.faults as f64),
                ("raced", "faults", raced as f64),
                ("other_cpu_pct", "% of a CPU", other_cpu),
                ("touch_ms", "ms", pass.elapsed.as_secs_f64() * 1e3),
                (
                    "prefetched_before_mib",
                    "MiB",
                    ((before.prefetch_pages - at_load.prefetch_pages) * PAGE as u64) as f64 / mib,
                ),
                (
                    "prefetched_during_mib",
                    "MiB",
                    ((after.prefetch_pages - before.prefetch_pages) * PAGE as u64) as f64 / mib,
                ),
                ("ws_blocks", "blocks", load.working_set_blocks as f64),
            ],
        );
        pager.wait_prefetch();
        // Stored pages left once the prefetcher has returned: it stopped before the end (it
        // panicked: see the report's findings).
        let unfinished = pager.state_counts().stored;
        results.put(
            &format!("{key}.prefetch_unfinished_pages"),
            "pages",
            run,
            unfinished as f64,
        );
        if resume < RESUMES {
            pager.offload(&config)?;
        }
    }
    // Untimed: after the last resume's prefetch everything is back and intact.
    if map.bytes() != setup.image {
        return Err("after the last resume the memory differs from the image".into());
    }
    drop(pager);
    drop(map);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
