//! Honest memory × time (issues 7 and 35): one sampler thread reads every VM's memory at a
//! fixed period, keeps what it could not read and when it was late, and integrates memory over
//! time.
//!
//! Samples are taken at absolute deadlines (`start + k × period`), so one slow tick does not
//! shift the ones after it; a tick that comes late is kept with its real time, and the time
//! between two readings of a VM is a gap. A reading that fails is counted as dropped, never
//! filled in. [`Recording::integrity`] says whether the recording can be trusted: no gap over
//! twice the period, nothing dropped. Integrals (GiB·s) use the trapezoid rule.
//!
//! What a tick reads is split by cost. The headline, the memory charged (the VM's memory
//! cgroup's usage, a counter read in microseconds), is read for every VM at every tick. Guest
//! RAM's PSS walks the VM's page tables (`/proc/PID/smaps`: about 10 ms for 512 MiB resident
//! on this host, as long as a `smaps_rollup`, which cannot tell guest RAM from the rest), so
//! each VM's is read once every `pss_every` ticks, the stalest first, and only while the tick
//! has used less than half its period: with 32 VMs the thread stays on its deadlines. What one
//! tick cost is kept ([`Recording::harness`]).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::stats::{self, MemoryCgroup};

/// The name of the sampler's thread (`/proc/PID/task/*/comm`).
pub const THREAD_NAME: &str = "pvisor-sampler";

/// One VM's memory at one moment, bytes (`None`: not measured at this tick).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Reading {
    /// The VM's memory cgroup's usage (every tick).
    pub cgroup_bytes: Option<u64>,
    /// PSS of the VM's guest RAM, its hugetlb pages included (on the VM's PSS ticks).
    pub guest_pss_bytes: Option<u64>,
    /// Hugetlb pages of its guest RAM, which no memory cgroup is charged for (with the PSS).
    pub hugetlb_bytes: Option<u64>,
}

/// What is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantity {
    /// `Reading::cgroup_bytes`.
    Cgroup,
    /// `Reading::guest_pss_bytes`.
    GuestPss,
    /// The memory charged for the VM: its cgroup's usage plus the hugetlb pages it holds (the
    /// latest reading of them; none before the first).
    Charged,
}

/// Reads one VM's memory.
pub trait Probe: Send {
    /// The memory now: always what is cheap to read; with `pss`, guest RAM's PSS too.
    fn read(&mut self, pss: bool) -> std::io::Result<Reading>;
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
    fn read(&mut self, pss: bool) -> std::io::Result<Reading> {
        let cgroup = self
            .cgroup
            .as_deref()
            .map(|dir| MemoryCgroup::at(dir).usage())
            .transpose()?;
        let guest = pss
            .then(|| stats::range_memory_of(Some(self.pid), self.ram.0, self.ram.1))
            .transpose()?;
        Ok(Reading {
            cgroup_bytes: cgroup,
            guest_pss_bytes: guest.map(|g| g.pss + g.hugetlb),
            hugetlb_bytes: guest.map(|g| g.hugetlb),
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

/// What one tick cost the sampler's thread.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Tick {
    /// Its deadline's number.
    pub tick: u32,
    /// From its first reading to its last.
    pub work: Duration,
    /// PSS readings it took.
    pub pss_reads: u32,
}

/// When to sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Time between two ticks.
    pub period: Duration,
    /// Each VM's guest PSS is read once in this many ticks (at least 1).
    pub pss_every: u32,
}

/// A running sampler: one thread for all the VMs.
#[derive(Debug)]
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Recording>>,
}

impl Sampler {
    /// Starts sampling each of `probes` on `plan`'s ticks, on one thread.
    pub fn start(plan: Plan, probes: Vec<Box<dyn Probe>>) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name(THREAD_NAME.to_owned())
                .spawn(move || sample(probes, plan, &stop))?
        };
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops and returns what was recorded.
    pub fn finish(mut self) -> Recording {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|thread| thread.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// This thread's CPU time.
fn thread_cpu() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(Duration::from)
        .unwrap_or_default()
}

/// The sampling loop: at each absolute deadline `start + k × period`, every VM's cheap
/// reading, then the PSS of the VMs due for it, stalest first, while the tick has used less
/// than half the period (at least one a tick, so that none waits for ever). A late tick keeps
/// its real time and the deadlines it overran are skipped (the gaps show).
fn sample(mut probes: Vec<Box<dyn Probe>>, plan: Plan, stop: &AtomicBool) -> Recording {
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
    let cpu = thread_cpu();
    let start = Instant::now();
    let period = plan.period;
    let every = plan.pss_every.max(1);
    let mut recording = Recording {
        period,
        pss_every: every,
        series: vec![Vec::new(); probes.len()],
        ..Recording::default()
    };
    // The tick of each VM's latest PSS reading (`None`: none yet, the stalest of all).
    let mut last_pss: Vec<Option<u32>> = vec![None; probes.len()];
    let mut tick: u32 = 0;
    while !stop.load(Ordering::Relaxed) {
        let began = start.elapsed();
        for (vm, probe) in probes.iter_mut().enumerate() {
            recording.series[vm].push(Point {
                tick,
                at: start.elapsed(),
                reading: probe.read(false).ok(),
            });
        }
        let mut due: Vec<(Option<u32>, usize)> = last_pss
            .iter()
            .enumerate()
            .filter(|(_, last)| last.is_none_or(|t| tick - t >= every))
            .map(|(vm, &last)| (last, vm))
            .collect();
        due.sort_unstable();
        let mut pss_reads = 0;
        for (_, vm) in due {
            if pss_reads > 0 && start.elapsed() - began >= period / 2 {
                break;
            }
            pss_reads += 1;
            last_pss[vm] = Some(tick);
            let point = recording.series[vm]
                .last_mut()
                .expect("pushed in this tick");
            match (probes[vm].read(true), &mut point.reading) {
                (Ok(full), Some(reading)) => {
                    reading.guest_pss_bytes = full.guest_pss_bytes;
                    reading.hugetlb_bytes = full.hugetlb_bytes;
                }
                (Ok(_), None) => {}
                (Err(_), _) => recording.pss_dropped += 1,
            }
        }
        let now = start.elapsed();
        recording.ticks.push(Tick {
            tick,
            work: now - began,
            pss_reads,
        });
        // The next deadline after now: a late tick does not shift the others.
        tick += 1;
        while period * tick <= now {
            tick += 1;
        }
        std::thread::sleep(period * tick - now);
    }
    recording.cpu = thread_cpu().saturating_sub(cpu);
    recording
}

/// What a sampler recorded.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Recording {
    /// The period asked for.
    pub period: Duration,
    /// Each VM's PSS was due once in this many ticks.
    pub pss_every: u32,
    /// Per VM (the order of the probes), its readings in time order.
    pub series: Vec<Vec<Point>>,
    /// What each tick cost.
    pub ticks: Vec<Tick>,
    /// PSS readings that failed.
    pub pss_dropped: usize,
    /// CPU time of the sampler's thread.
    pub cpu: Duration,
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
    /// Readings that failed (a failed PSS reading among them).
    pub dropped: usize,
    /// The largest time between two PSS readings of a VM, seconds (PSS is read once in
    /// `pss_every` ticks: this is not judged, it says how fine the PSS column is).
    pub largest_pss_gap_s: f64,
}

/// What the sampling cost: the figures that say the harness was not the bottleneck.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Harness {
    /// Threads that sampled.
    pub threads: usize,
    /// Ticks taken.
    pub ticks: usize,
    /// Mean work of a tick, milliseconds.
    pub tick_mean_ms: f64,
    /// The 99th percentile of a tick's work, milliseconds.
    pub tick_p99_ms: f64,
    /// The longest tick, milliseconds.
    pub tick_max_ms: f64,
    /// PSS readings taken.
    pub pss_reads: u64,
    /// CPU time of the sampler's thread, seconds.
    pub cpu_s: f64,
    /// That CPU time as a share of one core over the recording.
    pub cpu_share: f64,
}

impl Recording {
    /// Gaps and drops, each VM's series on its own.
    pub fn integrity(&self) -> Integrity {
        let limit = self.period * 2;
        let gaps = |has: &dyn Fn(&Point) -> bool| -> Vec<Duration> {
            self.series
                .iter()
                .flat_map(|points| {
                    let taken: Vec<Duration> =
                        points.iter().filter(|p| has(p)).map(|p| p.at).collect();
                    taken
                        .windows(2)
                        .map(|w| w[1].saturating_sub(w[0]))
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        let all = gaps(&|_| true);
        let pss = gaps(&|p| p.reading.is_some_and(|r| r.guest_pss_bytes.is_some()));
        let largest = all.iter().max().copied().unwrap_or(Duration::ZERO);
        let long_gaps = all.iter().filter(|&&g| g > limit).count();
        let dropped = self
            .series
            .iter()
            .flatten()
            .filter(|p| p.reading.is_none())
            .count()
            + self.pss_dropped;
        let samples = self.series.iter().map(Vec::len).max().unwrap_or(0);
        let every_vm_twice = !self.series.is_empty() && self.series.iter().all(|s| s.len() >= 2);
        Integrity {
            passed: long_gaps == 0 && dropped == 0 && every_vm_twice,
            samples,
            largest_gap_s: largest.as_secs_f64(),
            long_gaps,
            dropped,
            largest_pss_gap_s: pss.iter().max().copied().unwrap_or_default().as_secs_f64(),
        }
    }

    /// What the sampling cost.
    pub fn harness(&self) -> Harness {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut work: Vec<Duration> = self.ticks.iter().map(|t| t.work).collect();
        work.sort_unstable();
        let p99 = work
            .len()
            .checked_sub(1)
            .map_or(Duration::ZERO, |last| work[last * 99 / 100]);
        let span = self
            .series
            .iter()
            .filter_map(|s| s.last().map(|p| p.at))
            .max()
            .unwrap_or_default();
        #[allow(clippy::cast_precision_loss, reason = "ticks of one run")]
        Harness {
            threads: 1,
            ticks: work.len(),
            tick_mean_ms: if work.is_empty() {
                0.0
            } else {
                ms(work.iter().sum::<Duration>()) / work.len() as f64
            },
            tick_p99_ms: ms(p99),
            tick_max_ms: ms(work.last().copied().unwrap_or_default()),
            pss_reads: self.ticks.iter().map(|t| u64::from(t.pss_reads)).sum(),
            cpu_s: self.cpu.as_secs_f64(),
            cpu_share: if span.is_zero() {
                0.0
            } else {
                self.cpu.as_secs_f64() / span.as_secs_f64()
            },
        }
    }

    /// ∫ memory dt of VM `vm` over the recording, GiB·s: trapezoids between consecutive
    /// readings that both measured it (PSS: between its own readings); a dropped reading leaves
    /// its trapezoids out, which [`Recording::integrity`] reports.
    pub fn integral_gib_s(&self, vm: usize, quantity: Quantity) -> f64 {
        #[allow(clippy::cast_precision_loss, reason = "bytes far below 2^52")]
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        let Some(points) = self.series.get(vm) else {
            return 0.0;
        };
        // (when, the value) of each point: `None` where it is not measured there.
        let mut hugetlb = 0;
        let values: Vec<(Duration, Option<u64>)> = points
            .iter()
            .map(|p| {
                let value = p.reading.and_then(|r| match quantity {
                    Quantity::Cgroup => r.cgroup_bytes,
                    Quantity::GuestPss => r.guest_pss_bytes,
                    Quantity::Charged => {
                        hugetlb = r.hugetlb_bytes.unwrap_or(hugetlb);
                        r.cgroup_bytes.map(|c| c + hugetlb)
                    }
                });
                (p.at, value)
            })
            .collect();
        // PSS is read at some ticks only: its trapezoids span the ticks between.
        let values: Vec<(Duration, Option<u64>)> = if quantity == Quantity::GuestPss {
            values.into_iter().filter(|(_, v)| v.is_some()).collect()
        } else {
            values
        };
        values
            .windows(2)
            .filter_map(|w| {
                let (a, b) = (w[0].1?, w[1].1?);
                let dt = w[1].0.saturating_sub(w[0].0).as_secs_f64();
                Some((gib(a) + gib(b)) / 2.0 * dt)
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recording of one series per VM from `(ms, bytes)` readings, PSS in each.
    fn recording(series: &[&[(u64, Option<u64>)]]) -> Recording {
        Recording {
            period: Duration::from_millis(100),
            pss_every: 1,
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
                                hugetlb_bytes: Some(0),
                            }),
                        })
                        .collect()
                })
                .collect(),
            ..Recording::default()
        }
    }

    #[test]
    fn recording_integral_is_the_trapezoid_sum() {
        let gib = 1u64 << 30;
        let r = recording(&[&[(0, Some(gib)), (100, Some(gib)), (200, Some(3 * gib))]]);
        // 0.1 s × 1 GiB + 0.1 s × 2 GiB (mean of 1 and 3).
        assert!((r.integral_gib_s(0, Quantity::Cgroup) - 0.3).abs() < 1e-9);
        assert!((r.integral_gib_s(0, Quantity::Charged) - 0.3).abs() < 1e-9);
        assert!((r.integral_gib_s(0, Quantity::GuestPss) - 0.15).abs() < 1e-9);
        let i = r.integrity();
        assert!(i.passed && i.long_gaps == 0 && i.dropped == 0);
        assert!((i.largest_gap_s - 0.1).abs() < 1e-9);
    }

    #[test]
    fn recording_charged_adds_the_latest_hugetlb_and_pss_spans_the_ticks_between() {
        let gib = 1u64 << 30;
        let mut r = recording(&[&[(0, Some(gib)), (100, Some(gib)), (200, Some(gib))]]);
        let points = &mut r.series[0];
        // Huge pages read at the first tick only; PSS at the first and the last.
        points[0].reading.as_mut().unwrap().hugetlb_bytes = Some(gib);
        points[1].reading.as_mut().unwrap().hugetlb_bytes = None;
        points[1].reading.as_mut().unwrap().guest_pss_bytes = None;
        points[2].reading.as_mut().unwrap().hugetlb_bytes = None;
        // 0.2 s at 1 GiB of cgroup and 1 GiB of huge pages held.
        assert!((r.integral_gib_s(0, Quantity::Charged) - 0.4).abs() < 1e-9);
        // One trapezoid of 0.2 s at 0.5 GiB.
        assert!((r.integral_gib_s(0, Quantity::GuestPss) - 0.1).abs() < 1e-9);
        assert!((r.integrity().largest_pss_gap_s - 0.2).abs() < 1e-9);
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
        let mut r = recording(&[&[(0, Some(1)), (100, Some(1))]]);
        r.pss_dropped = 1;
        assert!(!r.integrity().passed);
    }

    /// A VM with fixed memory whose PSS reading takes `pss_cost`, counting its PSS reads.
    struct Fixed {
        bytes: u64,
        pss_cost: Duration,
        pss_reads: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Fixed {
        fn boxed(bytes: u64, pss_cost: Duration) -> Box<dyn Probe> {
            Box::new(Self {
                bytes,
                pss_cost,
                pss_reads: Arc::default(),
            })
        }
    }

    impl Probe for Fixed {
        fn read(&mut self, pss: bool) -> std::io::Result<Reading> {
            if pss {
                self.pss_reads.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(self.pss_cost);
            }
            Ok(Reading {
                cgroup_bytes: Some(self.bytes),
                guest_pss_bytes: pss.then_some(self.bytes / 2),
                hugetlb_bytes: pss.then_some(0),
            })
        }
    }

    struct Failing;

    impl Probe for Failing {
        fn read(&mut self, _: bool) -> std::io::Result<Reading> {
            Err(std::io::Error::other("gone"))
        }
    }

    fn plan(ms: u64, pss_every: u32) -> Plan {
        Plan {
            period: Duration::from_millis(ms),
            pss_every,
        }
    }

    #[test]
    fn sampler_keeps_its_period_and_counts_failed_readings() {
        let sampler = Sampler::start(
            plan(10, 1),
            vec![Fixed::boxed(1 << 30, Duration::ZERO), Box::new(Failing)],
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let r = sampler.finish();
        let i = r.integrity();
        // About 20 samples; fewer only if this machine starves the thread.
        assert!(i.samples >= 3, "{i:?}");
        assert!(i.dropped >= r.series[1].len(), "{i:?}");
        assert!(!i.passed);
        // About 1 GiB over the time recorded.
        let fixed = &r.series[0];
        let span = fixed.last().unwrap().at - fixed[0].at;
        let integral = r.integral_gib_s(0, Quantity::Cgroup);
        assert!((integral - span.as_secs_f64()).abs() < 1e-6, "{integral}");
        let harness = r.harness();
        assert_eq!(harness.threads, 1);
        assert_eq!(harness.ticks, r.ticks.len());
        assert!(harness.tick_max_ms >= harness.tick_mean_ms);
    }

    #[test]
    fn sampler_reads_slow_pss_within_half_a_period_and_reaches_every_vm() {
        // Eight VMs whose PSS takes 15 ms each, sampled every 40 ms: reading all eight in one
        // tick would take 120 ms, three periods.
        let probes: Vec<Box<dyn Probe>> = (0..8)
            .map(|_| Fixed::boxed(1 << 20, Duration::from_millis(15)))
            .collect();
        let sampler = Sampler::start(plan(40, 2), probes).unwrap();
        std::thread::sleep(Duration::from_millis(1000));
        let r = sampler.finish();
        // After one PSS reading a tick has used 15 ms; after two, 30 ms, over half its period.
        for tick in &r.ticks {
            assert!((1..=2).contains(&tick.pss_reads), "{tick:?}");
        }
        for (vm, points) in r.series.iter().enumerate() {
            let pss = points
                .iter()
                .filter(|p| p.reading.is_some_and(|r| r.guest_pss_bytes.is_some()))
                .count();
            assert!(pss >= 1, "VM {vm}: no PSS in {} ticks", r.ticks.len());
            // Every tick read every VM's cgroup.
            assert_eq!(points.len(), r.ticks.len());
        }
        assert_eq!(
            r.harness().pss_reads,
            r.ticks.iter().map(|t| u64::from(t.pss_reads)).sum::<u64>()
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
        let reading = probe.read(true).unwrap();
        assert!(reading.guest_pss_bytes.is_some());
        assert_eq!(reading.hugetlb_bytes, Some(0));
        assert!(reading.cgroup_bytes.is_none());
        assert_eq!(probe.read(false).unwrap().guest_pss_bytes, None);
        drop(data);
    }
}
