//! Honest memory × time (issues 7 and 35): a sampler reads every VM's memory at a fixed
//! period on two threads, keeps what it could not read and when it was late, and integrates
//! memory over time.
//!
//! Samples are taken at absolute deadlines (`start + k × period`), so one slow tick does not
//! shift the ones after it; a tick that comes late is kept with its real time, and the time
//! between two readings of a VM is a gap. A reading that fails is counted as dropped, never
//! filled in. [`Recording::integrity`] says whether the recording can be trusted: no gap over
//! twice the period, nothing dropped. Integrals (GiB·s) use the trapezoid rule.
//!
//! What is read is split by cost, over two threads whatever the number of VMs. The headline,
//! the memory charged (the VM's memory cgroup's usage, a counter read in microseconds, that
//! takes no lock of the VM's), is read for every VM at every tick by the sampler's thread
//! (`pvisor-sampler`). Guest RAM's PSS walks the VM's page tables under its memory map lock
//! (`/proc/PID/smaps`: about 10 ms for 512 MiB resident on this host, and as long as a
//! `smaps_rollup`, which cannot tell guest RAM from the rest), and a VM offloading or faulting
//! its RAM back holds that lock for long: so a second thread (`pvisor-sampler-pss`) reads it,
//! the VMs in turn, each once in about `pss_every` ticks, and a slow walk delays only the PSS
//! column, never a tick. What the ticks cost and both threads' CPU are kept
//! ([`Recording::harness`]).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::stats::{self, MemoryCgroup};

/// The name of the sampler's thread (`/proc/PID/task/*/comm`); its PSS reader's name starts
/// with it too.
pub const THREAD_NAME: &str = "pvisor-sampler";
/// The name of the thread that reads the VMs' PSS.
pub const PSS_THREAD_NAME: &str = "pvisor-sampler-pss";

/// One VM's memory cgroup at one tick, bytes (`None`: not measured for this VM).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Reading {
    /// The VM's memory cgroup's usage.
    pub cgroup_bytes: Option<u64>,
}

/// One VM's guest RAM at one moment, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct GuestReading {
    /// PSS of its guest RAM, its hugetlb pages included.
    pub guest_pss_bytes: u64,
    /// Hugetlb pages of its guest RAM, which no memory cgroup is charged for.
    pub hugetlb_bytes: u64,
}

/// What is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantity {
    /// `Reading::cgroup_bytes`.
    Cgroup,
    /// `GuestReading::guest_pss_bytes`.
    GuestPss,
    /// The memory charged for the VM: its cgroup's usage plus the hugetlb pages it holds (the
    /// latest reading of them before the tick; none before the first).
    Charged,
}

/// Reads one VM's memory; called from the sampler's two threads.
pub trait Probe: Send + Sync {
    /// What is cheap to read, at every tick.
    fn read(&self) -> std::io::Result<Reading>;
    /// Guest RAM's PSS, once in `pss_every` ticks.
    fn guest(&self) -> std::io::Result<GuestReading>;
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
    fn read(&self) -> std::io::Result<Reading> {
        let cgroup = self
            .cgroup
            .as_deref()
            .map(|dir| MemoryCgroup::at(dir).usage())
            .transpose()?;
        Ok(Reading {
            cgroup_bytes: cgroup,
        })
    }

    fn guest(&self) -> std::io::Result<GuestReading> {
        let guest = stats::range_memory_of(Some(self.pid), self.ram.0, self.ram.1)?;
        Ok(GuestReading {
            guest_pss_bytes: guest.pss + guest.hugetlb,
            hugetlb_bytes: guest.hugetlb,
        })
    }
}

/// One tick's reading of one VM.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Point {
    /// The deadline it was taken for: `tick × period` after the sampler started.
    pub tick: u32,
    /// When it was taken, since the sampler started (at or after the deadline).
    pub at: Duration,
    /// What was read; `None`: the reading failed (dropped).
    pub reading: Option<Reading>,
}

/// One PSS reading of one VM.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GuestPoint {
    /// When it was taken, since the sampler started.
    pub at: Duration,
    /// What was read; `None`: the reading failed (dropped).
    pub reading: Option<GuestReading>,
}

/// What one tick cost the sampler's thread.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Tick {
    /// Its deadline's number.
    pub tick: u32,
    /// From its first reading to its last.
    pub work: Duration,
}

/// When to sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Time between two ticks.
    pub period: Duration,
    /// Each VM's guest PSS is read about once in this many ticks (at least 1).
    pub pss_every: u32,
}

/// What the ticks' thread recorded: per VM its points, each tick's cost, the thread's CPU.
type Ticked = (Vec<Vec<Point>>, Vec<Tick>, Duration);

/// A running sampler: one thread for every VM's ticks, one for their PSS.
#[derive(Debug)]
pub struct Sampler {
    stop: Arc<AtomicBool>,
    ticks: Option<JoinHandle<Ticked>>,
    pss: Option<JoinHandle<(Vec<Vec<GuestPoint>>, Duration)>>,
    plan: Plan,
}

impl Sampler {
    /// Starts sampling each of `probes` on `plan`'s ticks.
    pub fn start(plan: Plan, probes: Vec<Box<dyn Probe>>) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let probes: Arc<[Box<dyn Probe>]> = probes.into();
        let start = Instant::now();
        let ticks = {
            let (stop, probes) = (Arc::clone(&stop), Arc::clone(&probes));
            std::thread::Builder::new()
                .name(THREAD_NAME.to_owned())
                .spawn(move || sample_ticks(&probes, start, plan.period, &stop))?
        };
        let pss = {
            let pss_stop = Arc::clone(&stop);
            let spawned = std::thread::Builder::new()
                .name(PSS_THREAD_NAME.to_owned())
                .spawn(move || sample_pss(&probes, start, plan, &pss_stop));
            match spawned {
                Ok(thread) => thread,
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    let _ = ticks.join();
                    return Err(e);
                }
            }
        };
        Ok(Self {
            stop,
            ticks: Some(ticks),
            pss: Some(pss),
            plan,
        })
    }

    /// Stops and returns what was recorded.
    pub fn finish(mut self) -> Recording {
        self.stop.store(true, Ordering::Relaxed);
        let (series, ticks, cpu) = self
            .ticks
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default();
        let (guest, pss_cpu) = self
            .pss
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default();
        Recording {
            period: self.plan.period,
            pss_every: self.plan.pss_every,
            series,
            guest,
            ticks,
            cpu,
            pss_cpu,
        }
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

/// Puts this thread ahead of the VMs it measures in the scheduler (as root; best effort
/// otherwise): a sampler that falls behind them records gaps, not memory.
fn ahead_of_the_vms() {
    // SAFETY: setpriority on this thread's own id; it changes only its niceness.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(
            libc::PRIO_PROCESS,
            libc::id_t::try_from(tid).unwrap_or(0),
            -10,
        );
    }
}

/// The next deadline (`start + k × period`) after `now`, from the tick just taken: a late
/// tick does not shift the others, the deadlines it overran are skipped (the gaps show).
fn next_tick(tick: u32, now: Duration, period: Duration) -> u32 {
    let mut next = tick + 1;
    while period * next <= now {
        next += 1;
    }
    next
}

/// The ticks: every VM's cheap reading at each absolute deadline `start + k × period`.
fn sample_ticks(
    probes: &[Box<dyn Probe>],
    start: Instant,
    period: Duration,
    stop: &AtomicBool,
) -> Ticked {
    ahead_of_the_vms();
    let cpu = thread_cpu();
    let mut series = vec![Vec::new(); probes.len()];
    let mut ticks = Vec::new();
    let mut tick: u32 = 0;
    while !stop.load(Ordering::Relaxed) {
        let began = start.elapsed();
        for (points, probe) in series.iter_mut().zip(probes) {
            points.push(Point {
                tick,
                at: start.elapsed(),
                reading: probe.read().ok(),
            });
        }
        let now = start.elapsed();
        ticks.push(Tick {
            tick,
            work: now - began,
        });
        tick = next_tick(tick, now, period);
        std::thread::sleep(period * tick - now);
    }
    (series, ticks, thread_cpu().saturating_sub(cpu))
}

/// The PSS: the VMs in strict turn, one walk per slot of `pss_every × period / n`, so that
/// each is read once in `pss_every` ticks and the walks are spread over them. A walk that runs
/// late delays the next ones (the slots it overran are skipped, never a VM's turn), never a
/// tick.
fn sample_pss(
    probes: &[Box<dyn Probe>],
    start: Instant,
    plan: Plan,
    stop: &AtomicBool,
) -> (Vec<Vec<GuestPoint>>, Duration) {
    ahead_of_the_vms();
    let cpu = thread_cpu();
    let mut series = vec![Vec::new(); probes.len()];
    let Some(n) = u32::try_from(probes.len()).ok().filter(|&n| n > 0) else {
        return (series, Duration::ZERO);
    };
    let slot = (plan.period * plan.pss_every.max(1) / n).max(Duration::from_micros(1));
    // The slot on the grid, and whose turn it is: apart, so that a late walk skips slots,
    // not VMs.
    let (mut turn, mut vm): (u32, usize) = (0, 0);
    while !stop.load(Ordering::Relaxed) {
        series[vm].push(GuestPoint {
            at: start.elapsed(),
            reading: probes[vm].guest().ok(),
        });
        vm = (vm + 1) % probes.len();
        let now = start.elapsed();
        turn = next_tick(turn, now, slot);
        // Sleep in short steps: a long slot must not hold up the end of the recording.
        let due = slot * turn;
        while !stop.load(Ordering::Relaxed) && start.elapsed() < due {
            std::thread::sleep((due - start.elapsed()).min(plan.period));
        }
    }
    (series, thread_cpu().saturating_sub(cpu))
}

/// What a sampler recorded.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Recording {
    /// The period asked for.
    pub period: Duration,
    /// Each VM's PSS was due once in this many ticks.
    pub pss_every: u32,
    /// Per VM (the order of the probes), its tick readings in time order.
    pub series: Vec<Vec<Point>>,
    /// Per VM, its PSS readings in time order.
    pub guest: Vec<Vec<GuestPoint>>,
    /// What each tick cost.
    pub ticks: Vec<Tick>,
    /// CPU time of the sampler's thread.
    pub cpu: Duration,
    /// CPU time of the PSS reader's thread.
    pub pss_cpu: Duration,
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
    /// The largest time between two PSS readings of a VM, seconds (not judged: it says how
    /// fine the PSS column is).
    pub largest_pss_gap_s: f64,
}

/// What the sampling cost: the figures that say the harness was not the bottleneck.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Harness {
    /// Threads that sampled, whatever the number of VMs.
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
    pub pss_reads: usize,
    /// CPU time of the sampler's two threads, seconds.
    pub cpu_s: f64,
    /// That CPU time as a share of one core over the recording.
    pub cpu_share: f64,
}

impl Recording {
    /// Gaps and drops, each VM's series on its own.
    pub fn integrity(&self) -> Integrity {
        let limit = self.period * 2;
        let gaps = |times: Vec<Vec<Duration>>| -> Vec<Duration> {
            times
                .iter()
                .flat_map(|t| t.windows(2).map(|w| w[1].saturating_sub(w[0])))
                .collect()
        };
        let all = gaps(
            self.series
                .iter()
                .map(|s| s.iter().map(|p| p.at).collect())
                .collect(),
        );
        let pss = gaps(
            self.guest
                .iter()
                .map(|s| s.iter().map(|p| p.at).collect())
                .collect(),
        );
        let largest = all.iter().max().copied().unwrap_or(Duration::ZERO);
        let long_gaps = all.iter().filter(|&&g| g > limit).count();
        let dropped = self
            .series
            .iter()
            .flatten()
            .filter(|p| p.reading.is_none())
            .count()
            + self
                .guest
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
            largest_pss_gap_s: pss.iter().max().copied().unwrap_or_default().as_secs_f64(),
        }
    }

    /// What the sampling cost.
    pub fn harness(&self) -> Harness {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut work: Vec<Duration> = self.ticks.iter().map(|t| t.work).collect();
        work.sort_unstable();
        // Nearest rank: the smallest tick that 99% of them do not exceed.
        let p99 = (work.len() * 99)
            .div_ceil(100)
            .checked_sub(1)
            .map_or(Duration::ZERO, |rank| work[rank]);
        let span = self
            .series
            .iter()
            .filter_map(|s| s.last().map(|p| p.at))
            .max()
            .unwrap_or_default();
        let cpu = self.cpu + self.pss_cpu;
        #[allow(clippy::cast_precision_loss, reason = "ticks of one run")]
        Harness {
            threads: 2,
            ticks: work.len(),
            tick_mean_ms: if work.is_empty() {
                0.0
            } else {
                ms(work.iter().sum::<Duration>()) / work.len() as f64
            },
            tick_p99_ms: ms(p99),
            tick_max_ms: ms(work.last().copied().unwrap_or_default()),
            pss_reads: self.guest.iter().map(Vec::len).sum(),
            cpu_s: cpu.as_secs_f64(),
            cpu_share: if span.is_zero() {
                0.0
            } else {
                cpu.as_secs_f64() / span.as_secs_f64()
            },
        }
    }

    /// The hugetlb pages VM `vm` held at `at`: its latest PSS reading's at or before it (0
    /// before the first).
    fn hugetlb_at(&self, vm: usize, at: Duration) -> u64 {
        self.guest
            .get(vm)
            .and_then(|g| {
                let taken = g.partition_point(|p| p.at <= at);
                g[..taken].iter().rev().find_map(|p| p.reading)
            })
            .map_or(0, |r| r.hugetlb_bytes)
    }

    /// ∫ memory dt of VM `vm` over the recording, GiB·s: trapezoids between consecutive
    /// readings that both measured it (PSS: between its own readings); a dropped reading leaves
    /// its trapezoids out, which [`Recording::integrity`] reports.
    pub fn integral_gib_s(&self, vm: usize, quantity: Quantity) -> f64 {
        #[allow(clippy::cast_precision_loss, reason = "bytes far below 2^52")]
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        // (when, the value) of each reading: `None` where it failed.
        let values: Vec<(Duration, Option<u64>)> = match quantity {
            Quantity::GuestPss => self.guest.get(vm).map_or_else(Vec::new, |g| {
                g.iter()
                    .map(|p| (p.at, p.reading.map(|r| r.guest_pss_bytes)))
                    .collect()
            }),
            Quantity::Cgroup | Quantity::Charged => {
                self.series.get(vm).map_or_else(Vec::new, |s| {
                    s.iter()
                        .map(|p| {
                            let cgroup = p.reading.and_then(|r| r.cgroup_bytes);
                            let huge = match quantity {
                                Quantity::Charged => self.hugetlb_at(vm, p.at),
                                _ => 0,
                            };
                            (p.at, cgroup.map(|c| c + huge))
                        })
                        .collect()
                })
            }
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

    /// A recording of one series per VM from `(ms, bytes)` readings, the guest PSS half the
    /// cgroup's, read at the same moments.
    fn recording(series: &[&[(u64, Option<u64>)]]) -> Recording {
        let at = |ms| Duration::from_millis(ms);
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
                            at: at(ms),
                            reading: bytes.map(|b| Reading {
                                cgroup_bytes: Some(b),
                            }),
                        })
                        .collect()
                })
                .collect(),
            guest: series
                .iter()
                .map(|points| {
                    points
                        .iter()
                        .map(|&(ms, bytes)| GuestPoint {
                            at: at(ms),
                            reading: bytes.map(|b| GuestReading {
                                guest_pss_bytes: b / 2,
                                hugetlb_bytes: 0,
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
    fn recording_charged_adds_the_latest_hugetlb_and_pss_spans_its_own_readings() {
        let gib = 1u64 << 30;
        let mut r = recording(&[&[(0, Some(gib)), (100, Some(gib)), (200, Some(gib))]]);
        // PSS read at 50 ms (1 GiB of huge pages held) and at 250 ms only.
        r.guest[0] = [(50, gib), (250, 0)]
            .map(|(ms, huge)| GuestPoint {
                at: Duration::from_millis(ms),
                reading: Some(GuestReading {
                    guest_pss_bytes: gib,
                    hugetlb_bytes: huge,
                }),
            })
            .to_vec();
        // At 0 ms the cgroup alone (1 GiB), at 100 and 200 ms with the huge pages read at
        // 50 ms on top (2 GiB): 0.1 s × 1.5 GiB + 0.1 s × 2 GiB.
        assert!((r.integral_gib_s(0, Quantity::Charged) - 0.35).abs() < 1e-9);
        // One trapezoid of 0.2 s at 1 GiB.
        assert!((r.integral_gib_s(0, Quantity::GuestPss) - 0.2).abs() < 1e-9);
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
        // The dropped tick and the dropped PSS reading.
        assert_eq!(r.integrity().dropped, 2);
        assert!(!r.integrity().passed);
        // The dropped reading's trapezoid is left out, not filled in.
        assert_eq!(r.integral_gib_s(1, Quantity::Cgroup), 0.0);
    }

    /// A VM with fixed memory whose PSS reading takes `pss_cost`.
    struct Fixed {
        bytes: u64,
        pss_cost: Duration,
    }

    impl Fixed {
        fn boxed(bytes: u64, pss_cost: Duration) -> Box<dyn Probe> {
            Box::new(Self { bytes, pss_cost })
        }
    }

    impl Probe for Fixed {
        fn read(&self) -> std::io::Result<Reading> {
            Ok(Reading {
                cgroup_bytes: Some(self.bytes),
            })
        }

        fn guest(&self) -> std::io::Result<GuestReading> {
            std::thread::sleep(self.pss_cost);
            Ok(GuestReading {
                guest_pss_bytes: self.bytes / 2,
                hugetlb_bytes: 0,
            })
        }
    }

    struct Failing;

    impl Probe for Failing {
        fn read(&self) -> std::io::Result<Reading> {
            Err(std::io::Error::other("gone"))
        }

        fn guest(&self) -> std::io::Result<GuestReading> {
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
        assert_eq!(harness.threads, 2);
        assert_eq!(harness.ticks, r.ticks.len());
        assert!(harness.tick_max_ms >= harness.tick_mean_ms);
    }

    #[test]
    fn sampler_slow_pss_never_delays_a_tick_and_reaches_every_vm() {
        // Eight VMs whose PSS walk takes 50 ms each, sampled every 20 ms: one thread doing
        // both would miss two ticks at every walk.
        let probes: Vec<Box<dyn Probe>> = (0..8)
            .map(|_| Fixed::boxed(1 << 20, Duration::from_millis(50)))
            .collect();
        let sampler = Sampler::start(plan(20, 1), probes).unwrap();
        std::thread::sleep(Duration::from_millis(1000));
        let r = sampler.finish();
        // Ticks take microseconds: none waited on a walk.
        assert!(r.harness().tick_max_ms < 40.0, "{:?}", r.harness());
        for (vm, guest) in r.guest.iter().enumerate() {
            // About two each in a second (8 × 50 ms a round); at least one.
            assert!(!guest.is_empty(), "VM {vm}: no PSS reading");
        }
        // Every tick read every VM.
        for points in &r.series {
            assert_eq!(points.len(), r.ticks.len());
        }
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
    fn sampler_reads_each_vm_s_pss_once_in_pss_every_ticks() {
        let probes: Vec<Box<dyn Probe>> = (0..4)
            .map(|_| Fixed::boxed(1 << 20, Duration::ZERO))
            .collect();
        let sampler = Sampler::start(plan(10, 5), probes).unwrap();
        std::thread::sleep(Duration::from_millis(500));
        let r = sampler.finish();
        // Ten rounds of 50 ms in 0.5 s: about ten readings of each VM, never one per tick.
        for guest in &r.guest {
            assert!((3..=12).contains(&guest.len()), "{}", guest.len());
        }
    }

    #[test]
    fn vm_probe_reads_this_process() {
        let data = vec![1u8; 4 << 20];
        let start = data.as_ptr() as u64;
        let probe = VmProbe {
            pid: std::process::id(),
            ram: (start & !0xFFF, 64 << 20),
            cgroup: None,
        };
        let guest = probe.guest().unwrap();
        assert_eq!(guest.hugetlb_bytes, 0);
        assert!(probe.read().unwrap().cgroup_bytes.is_none());
        drop(data);
    }
}
