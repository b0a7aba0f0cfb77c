//! Honest memory × time (issue 7): a sampler that reads every VM's memory at a fixed period,
//! keeps what it could not read and when it was late, and integrates memory over time.
//!
//! Samples are taken at absolute deadlines (`start + k × period`), so one slow reading does not
//! shift the ones after it; a reading that comes late is kept with its real time, and the time
//! between two samples is a gap. A reading that fails is counted as dropped, never filled in.
//! [`Recording::integrity`] says whether the recording can be trusted: no gap over twice the
//! period, nothing dropped. Integrals (GiB·s) use the trapezoid rule between samples.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::stats::{self, MemoryCgroup};

/// One VM's memory at one moment, bytes (`None`: not measured for this VM).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Reading {
    /// The VM's memory cgroup's usage.
    pub cgroup_bytes: Option<u64>,
    /// PSS of the VM's guest RAM.
    pub guest_pss_bytes: Option<u64>,
}

/// What is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantity {
    /// `Reading::cgroup_bytes`.
    Cgroup,
    /// `Reading::guest_pss_bytes`.
    GuestPss,
}

impl Reading {
    fn get(&self, quantity: Quantity) -> Option<u64> {
        match quantity {
            Quantity::Cgroup => self.cgroup_bytes,
            Quantity::GuestPss => self.guest_pss_bytes,
        }
    }
}

/// Reads one VM's memory.
pub trait Probe: Send {
    /// The memory now.
    fn read(&mut self) -> std::io::Result<Reading>;
}

/// A `pvisor` VM process: its guest RAM's PSS (from `/proc/PID/smaps`, the mappings inside
/// guest RAM) and its memory cgroup, when it has one.
#[derive(Debug, Clone)]
pub struct VmProbe {
    /// The VM process.
    pub pid: u32,
    /// Where its guest RAM is mapped: start and length.
    pub ram: (u64, u64),
    /// Its memory cgroup's directory.
    pub cgroup: Option<PathBuf>,
}

impl Probe for VmProbe {
    fn read(&mut self) -> std::io::Result<Reading> {
        let guest = stats::range_pss_of(Some(self.pid), self.ram.0, self.ram.1)?;
        let cgroup = self
            .cgroup
            .as_deref()
            .map(|dir| MemoryCgroup::at(dir).usage())
            .transpose()?;
        Ok(Reading {
            cgroup_bytes: cgroup,
            guest_pss_bytes: Some(guest),
        })
    }
}

/// One reading of one VM.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Point {
    /// The deadline it was taken for: `tick × period` after the sampler started.
    pub tick: u32,
    /// When it was taken, since the sampler started (at or after the deadline).
    pub at: Duration,
    /// What was read; `None`: the reading failed (dropped).
    pub reading: Option<Reading>,
}

/// A running sampler: one thread per VM, all on the same deadlines, so that a VM whose
/// reading is slow (its `smaps` walk waits for its memory map lock while it offloads) delays
/// its own series only, not every VM's.
#[derive(Debug)]
pub struct Sampler {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Vec<Point>>>,
    period: Duration,
}

impl Sampler {
    /// Starts sampling each of `probes` every `period`, each on a thread of its own.
    pub fn start(period: Duration, probes: Vec<Box<dyn Probe>>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let start = Instant::now();
        let threads = probes
            .into_iter()
            .map(|probe| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || sample_one(probe, start, period, &stop))
            })
            .collect();
        Self {
            stop,
            threads,
            period,
        }
    }

    /// Stops and returns what was recorded.
    pub fn finish(mut self) -> Recording {
        self.stop.store(true, Ordering::Relaxed);
        let series = std::mem::take(&mut self.threads)
            .into_iter()
            .map(|thread| thread.join().unwrap_or_default())
            .collect();
        Recording {
            period: self.period,
            series,
        }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// One VM's sampling loop: a reading at each absolute deadline `start + k × period`; a late
/// reading keeps its real time and the deadlines it overran are skipped (the gap shows).
fn sample_one(
    mut probe: Box<dyn Probe>,
    start: Instant,
    period: Duration,
    stop: &AtomicBool,
) -> Vec<Point> {
    // A sampler that falls behind the VMs it measures records gaps, not memory: ahead of
    // them in the scheduler (as root; best effort otherwise).
    // SAFETY: setpriority on this thread's own id; it changes only its niceness.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(
            libc::PRIO_PROCESS,
            libc::id_t::try_from(tid).unwrap_or(0),
            -10,
        );
    }
    let mut points = Vec::new();
    let mut tick: u32 = 0;
    while !stop.load(Ordering::Relaxed) {
        let reading = probe.read().ok();
        points.push(Point {
            tick,
            at: start.elapsed(),
            reading,
        });
        // The next deadline after now: a late reading does not shift the others.
        let now = start.elapsed();
        tick += 1;
        while period * tick <= now {
            tick += 1;
        }
        std::thread::sleep(period * tick - now);
    }
    points
}

/// What a sampler recorded.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Recording {
    /// The period asked for.
    pub period: Duration,
    /// Per VM (the order of the probes), its readings in time order.
    pub series: Vec<Vec<Point>>,
}

/// Whether a recording can be trusted, and why not.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Integrity {
    /// No gap over twice the period and nothing dropped.
    pub passed: bool,
    /// Samples taken: the readings of the VM with the most.
    pub samples: usize,
    /// The largest time between two readings of a VM, seconds.
    pub largest_gap_s: f64,
    /// Gaps over twice the period, over all the VMs.
    pub long_gaps: usize,
    /// Readings that failed.
    pub dropped: usize,
}

impl Recording {
    /// Gaps and drops, each VM's series on its own.
    pub fn integrity(&self) -> Integrity {
        let limit = self.period * 2;
        let gaps: Vec<Duration> = self
            .series
            .iter()
            .flat_map(|points| points.windows(2).map(|w| w[1].at.saturating_sub(w[0].at)))
            .collect();
        let largest = gaps.iter().max().copied().unwrap_or(Duration::ZERO);
        let long_gaps = gaps.iter().filter(|&&g| g > limit).count();
        let dropped = self
            .series
            .iter()
            .flatten()
            .filter(|p| p.reading.is_none())
            .count();
        let samples = self.series.iter().map(Vec::len).max().unwrap_or(0);
        let every_vm_twice = !self.series.is_empty() && self.series.iter().all(|s| s.len() >= 2);
        Integrity {
            passed: long_gaps == 0 && dropped == 0 && every_vm_twice,
            samples,
            largest_gap_s: largest.as_secs_f64(),
            long_gaps,
            dropped,
        }
    }

    /// ∫ memory dt of VM `vm` over the recording, GiB·s (trapezoids between consecutive
    /// readings that both measured it; a dropped reading leaves its trapezoids out, which
    /// [`Recording::integrity`] reports).
    pub fn integral_gib_s(&self, vm: usize, quantity: Quantity) -> f64 {
        let value = |p: &Point| p.reading.and_then(|r| r.get(quantity));
        #[allow(clippy::cast_precision_loss, reason = "bytes far below 2^52")]
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        self.series.get(vm).map_or(0.0, |points| {
            points
                .windows(2)
                .filter_map(|w| {
                    let (a, b) = (value(&w[0])?, value(&w[1])?);
                    let dt = w[1].at.saturating_sub(w[0].at).as_secs_f64();
                    Some((gib(a) + gib(b)) / 2.0 * dt)
                })
                .sum()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recording of one series per VM from `(ms, bytes)` readings.
    fn recording(series: &[&[(u64, Option<u64>)]]) -> Recording {
        Recording {
            period: Duration::from_millis(100),
            series: series
                .iter()
                .map(|points| {
                    points
                        .iter()
                        .map(|&(ms, bytes)| Point {
                            tick: u32::try_from(ms / 100).unwrap(),
                            at: Duration::from_millis(ms),
                            reading: bytes.map(|b| Reading {
                                cgroup_bytes: Some(b),
                                guest_pss_bytes: Some(b / 2),
                            }),
                        })
                        .collect()
                })
                .collect(),
        }
    }

    #[test]
    fn recording_integral_is_the_trapezoid_sum() {
        let gib = 1u64 << 30;
        let r = recording(&[&[(0, Some(gib)), (100, Some(gib)), (200, Some(3 * gib))]]);
        // 0.1 s × 1 GiB + 0.1 s × 2 GiB (mean of 1 and 3).
        assert!((r.integral_gib_s(0, Quantity::Cgroup) - 0.3).abs() < 1e-9);
        assert!((r.integral_gib_s(0, Quantity::GuestPss) - 0.15).abs() < 1e-9);
        let i = r.integrity();
        assert!(i.passed && i.long_gaps == 0 && i.dropped == 0);
        assert!((i.largest_gap_s - 0.1).abs() < 1e-9);
    }

    #[test]
    fn recording_with_a_long_gap_or_a_drop_fails_its_integrity() {
        let r = recording(&[&[(0, Some(1)), (100, Some(1)), (350, Some(1))]]);
        let i = r.integrity();
        assert!(!i.passed);
        assert_eq!(i.long_gaps, 1);
        assert!((i.largest_gap_s - 0.25).abs() < 1e-9);
        let r = recording(&[
            &[(0, Some(1)), (100, Some(1))],
            &[(0, None), (100, Some(1))],
        ]);
        assert_eq!(r.integrity().dropped, 1);
        assert!(!r.integrity().passed);
        // The dropped reading's trapezoid is left out, not filled in.
        assert_eq!(r.integral_gib_s(1, Quantity::Cgroup), 0.0);
    }

    struct Fixed(u64);

    impl Probe for Fixed {
        fn read(&mut self) -> std::io::Result<Reading> {
            Ok(Reading {
                cgroup_bytes: Some(self.0),
                guest_pss_bytes: None,
            })
        }
    }

    struct Failing;

    impl Probe for Failing {
        fn read(&mut self) -> std::io::Result<Reading> {
            Err(std::io::Error::other("gone"))
        }
    }

    #[test]
    fn sampler_keeps_its_period_and_counts_failed_readings() {
        let sampler = Sampler::start(
            Duration::from_millis(10),
            vec![Box::new(Fixed(1 << 30)), Box::new(Failing)],
        );
        std::thread::sleep(Duration::from_millis(200));
        let r = sampler.finish();
        let i = r.integrity();
        // About 20 samples; fewer only if this machine starves the thread.
        assert!(i.samples >= 3, "{i:?}");
        assert_eq!(i.dropped, r.series[1].len());
        assert!(!i.passed);
        // About 1 GiB over the time recorded.
        let fixed = &r.series[0];
        let span = fixed.last().unwrap().at - fixed[0].at;
        let integral = r.integral_gib_s(0, Quantity::Cgroup);
        assert!((integral - span.as_secs_f64()).abs() < 1e-6, "{integral}");
    }

    /// A VM whose reading takes its duration (its memory map lock is held, say).
    struct Slow(Duration);

    impl Probe for Slow {
        fn read(&mut self) -> std::io::Result<Reading> {
            std::thread::sleep(self.0);
            Ok(Reading::default())
        }
    }

    #[test]
    fn sampler_slow_vm_delays_only_its_own_readings() {
        let sampler = Sampler::start(
            Duration::from_millis(20),
            vec![
                Box::new(Fixed(1)),
                Box::new(Slow(Duration::from_millis(100))),
            ],
        );
        std::thread::sleep(Duration::from_millis(400));
        let r = sampler.finish();
        let slow = Recording {
            period: r.period,
            series: vec![r.series[1].clone()],
        };
        // The slow VM's readings are 100 ms apart: five periods, gaps that fail the recording.
        assert!(slow.integrity().long_gaps >= 2, "{:?}", slow.integrity());
        assert!(!r.integrity().passed);
        // The other VM was read on (nearly) every deadline all the same.
        assert!(
            r.series[0].len() >= 2 * r.series[1].len(),
            "{} readings against the slow VM's {}",
            r.series[0].len(),
            r.series[1].len()
        );
        // Deadlines stay on the grid: ticks rise, and a reading is never early.
        for points in &r.series {
            for w in points.windows(2) {
                assert!(w[0].tick < w[1].tick);
            }
            for p in points {
                assert!(p.at >= r.period * p.tick);
            }
        }
    }

    #[test]
    fn vm_probe_reads_this_process() {
        let data = vec![1u8; 4 << 20];
        let start = data.as_ptr() as u64;
        let mut probe = VmProbe {
            pid: std::process::id(),
            ram: (start & !0xFFF, 64 << 20),
            cgroup: None,
        };
        let reading = probe.read().unwrap();
        assert!(reading.guest_pss_bytes.is_some());
        assert!(reading.cgroup_bytes.is_none());
        drop(data);
    }
}
