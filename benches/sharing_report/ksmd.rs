//! KSM from the outside: ksmd's CPU time (`/proc/PID/schedstat`, ns; `stat` ticks where the
//! kernel has no schedstat), sampled on a thread of its own, and the global knobs a dedup VM
//! tunes and must give back (`ksm_advisor::Ksm::knobs`).

use std::fs;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ksm_advisor::Ksm;

use crate::common::host::task_cpu_seconds;
use crate::common::Res;

/// KSM's tunable knobs by name.
pub type Knobs = ksm_advisor::sys::Knobs;

/// The knobs the report names (the others are compared too).
pub const SHOWN: [&str; 5] = [
    "run",
    "pages_to_scan",
    "sleep_millisecs",
    "smart_scan",
    "advisor_mode",
];

/// Fails with a clear message unless this kernel has KSM and ksmd runs.
pub fn check() -> Res<()> {
    Ksm::system().map_err(|e| format!("KSM: {e} (the bench measures `--vm-ram-dedup`)"))?;
    Ksmd::find().ok_or("KSM: no ksmd thread in /proc")?;
    Ok(())
}

/// The knobs now.
pub fn knobs() -> Res<Knobs> {
    Ok(Ksm::system()?.knobs()?)
}

/// The global counters now (zeros where they cannot be read).
pub fn global() -> ksm_advisor::GlobalStats {
    Ksm::system()
        .and_then(|ksm| ksm.stats())
        .unwrap_or_default()
}

/// `run=0 pages_to_scan=100 …`, the knobs of `SHOWN` this kernel has.
pub fn describe(knobs: &Knobs) -> String {
    SHOWN
        .iter()
        .filter_map(|name| knobs.get(*name).map(|v| format!("`{name}={v}`")))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The knobs around one KSM group.
#[derive(Debug, Clone)]
pub struct GroupKnobs {
    /// Before its first VM started.
    pub before: Knobs,
    /// Once all its VMs ran.
    pub tuned: Knobs,
    /// Once all its VM processes were gone.
    pub after: Knobs,
}

impl GroupKnobs {
    /// `(knob, before, after)` for every knob that did not come back.
    pub fn differences(&self) -> Vec<(String, String, String)> {
        let missing = || "(missing)".to_owned();
        let mut names: Vec<&String> = self.before.keys().chain(self.after.keys()).collect();
        names.sort();
        names.dedup();
        names
            .into_iter()
            .filter(|name| self.before.get(*name) != self.after.get(*name))
            .map(|name| {
                let before = self.before.get(name).cloned().unwrap_or_else(missing);
                let after = self.after.get(name).cloned().unwrap_or_else(missing);
                (name.clone(), before, after)
            })
            .collect()
    }

    pub fn restored(&self) -> bool {
        self.before == self.after
    }
}

/// The ksmd kernel thread.
#[derive(Debug, Clone)]
pub struct Ksmd {
    dir: PathBuf,
}

impl Ksmd {
    /// The thread named `ksmd`, if there is one.
    pub fn find() -> Option<Self> {
        fs::read_dir("/proc")
            .ok()?
            .filter_map(Result::ok)
            .filter(|entry| entry.file_name().to_str().is_some_and(is_pid))
            .find(|entry| {
                fs::read_to_string(entry.path().join("comm")).is_ok_and(|c| c.trim() == "ksmd")
            })
            .map(|entry| Self { dir: entry.path() })
    }

    /// CPU seconds ksmd has used since boot.
    pub fn cpu_seconds(&self) -> Option<f64> {
        task_cpu_seconds(&self.dir)
    }
}

fn is_pid(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit())
}

/// ksmd's CPU time at one moment.
#[derive(Debug, Clone, Copy)]
pub struct Mark {
    pub at: Instant,
    pub cpu_s: f64,
}

/// ksmd's CPU time, every `period`, from `start` until `stop`.
#[derive(Debug)]
pub struct Sampler {
    ksmd: Ksmd,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<Mark>>,
}

impl Sampler {
    /// Starts sampling now (the first sample is taken at once).
    pub fn start(period: Duration) -> Res<Self> {
        let ksmd = Ksmd::find().ok_or("no ksmd thread in /proc")?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (ksmd, stop) = (ksmd.clone(), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("ksmd-sampler".into())
                .spawn(move || sample(&ksmd, period, &stop))?
        };
        Ok(Self { ksmd, stop, thread })
    }

    /// ksmd's CPU time now (between samples: window boundaries are exact).
    pub fn mark(&self) -> Res<Mark> {
        let at = Instant::now();
        let cpu_s = self
            .ksmd
            .cpu_seconds()
            .ok_or("ksmd's CPU time cannot be read")?;
        Ok(Mark { at, cpu_s })
    }

    /// Stops sampling; the samples, in time order.
    pub fn stop(self) -> Res<Vec<Mark>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| "the ksmd sampler panicked".into())
    }
}

fn sample(ksmd: &Ksmd, period: Duration, stop: &AtomicBool) -> Vec<Mark> {
    let started = Instant::now();
    let mut marks = Vec::new();
    let mut tick: u32 = 0;
    while !stop.load(Ordering::Relaxed) {
        let at = Instant::now();
        if let Some(cpu_s) = ksmd.cpu_seconds() {
            marks.push(Mark { at, cpu_s });
        }
        tick += 1;
        // On a fixed grid, so that late wake-ups do not add up.
        if let Some(wait) = (period * tick).checked_sub(started.elapsed()) {
            std::thread::sleep(wait);
        }
    }
    marks
}

/// ksmd's CPU from `from` to `to`: seconds, and the highest share of one core over any span
/// of `span` inside (samples of `marks` and the two ends); the window's average share when
/// it is shorter than `span`.
pub fn window(marks: &[Mark], from: Mark, to: Mark, span: Duration) -> (f64, f64) {
    let cpu_s = to.cpu_s - from.cpu_s;
    let mut points: Vec<Mark> = vec![from];
    points.extend(
        marks
            .iter()
            .filter(|m| m.at > from.at && m.at < to.at)
            .copied(),
    );
    points.push(to);
    let share = |a: &Mark, b: &Mark| (b.cpu_s - a.cpu_s) / b.at.duration_since(a.at).as_secs_f64();
    let peak = points
        .iter()
        .enumerate()
        .filter_map(|(i, a)| {
            let b = points[i..]
                .iter()
                .find(|b| b.at.duration_since(a.at) >= span)?;
            Some(share(a, b))
        })
        .fold(f64::NAN, f64::max);
    let peak = if peak.is_nan() {
        share(&from, &to)
    } else {
        peak
    };
    (cpu_s, peak * 100.0)
}
