//! A sweep in pieces (`DENSITY_BENCH_RESUME=DIR`): the whole sweep takes hours, longer than
//! one sitting on a shared machine, so each finished run is kept in `DIR` as one JSON file and
//! a later bench with the same settings takes it from there instead of running it again. The
//! sweep's logic (rounds, verdicts, where a strategy stops) is the same; only the runs come
//! from the directory where they are there. `DENSITY_BENCH_STOP_AFTER_MIN=M` begins no round
//! that would not end within M minutes (a round is never split between pieces: its budgeted
//! runs and their unbudgeted references run side by side); the report then says that the
//! sweep is not finished.
//!
//! `DIR/settings.json` holds the settings the runs were made with; a bench with other settings
//! is refused (mixing them would judge runs of one setting against another's), naming the
//! differing ones. Every run file names the commit and the time it was made, for the report.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::common::cpu::CpuUse;
use crate::common::replay::Timeline;
use crate::common::Res;
use crate::judge::Facts;
use crate::plan::Job;
use crate::swap::{Pool, PoolUse, Split};
use crate::{Measured, Settings};

/// A run read back from the directory, with where it came from.
#[derive(Debug)]
pub struct Saved {
    pub measured: Measured,
    /// The commit (`git rev-parse --short HEAD`, as the report states it) and the UTC time.
    pub commit: String,
    pub finished: String,
}

/// The directory of a sweep in pieces.
#[derive(Debug)]
pub struct Resume {
    pub dir: PathBuf,
    /// Runs found there, by (job, N, round).
    found: BTreeMap<(Job, usize, usize), Saved>,
}

/// The settings that must match for runs to be reused, as JSON.
pub fn fingerprint(s: &Settings) -> Value {
    let mut value = json!({
        "steps": s.steps,
        "trajectory": s.replayed.name,
        "memory": s.memory,
        "sample_ms": s.sample_ms,
        "spread_s": s.spread_s,
        "rounds": s.rounds,
        "strategies": s.strategies,
        "budgets": s.budgets.iter().map(|(text, _)| text).collect::<Vec<_>>(),
        "sweep": s.sweep,
    });
    // Only where a strategy has a pool, so that older sweeps' directories still match.
    if s.strategies
        .iter()
        .any(|n| crate::swap::Pool::of(n).1.is_some())
    {
        value["pool_share"] = json!(s.pool_share);
    }
    value
}

/// The keys whose values differ between `saved` and `wanted`.
fn differences(saved: &Value, wanted: &Value) -> Vec<String> {
    let Some(wanted) = wanted.as_object() else {
        return vec!["(settings)".into()];
    };
    wanted
        .iter()
        .filter(|(key, value)| saved.get(key.as_str()) != Some(value))
        .map(|(key, value)| {
            format!(
                "{key}: {} there, {value} now",
                saved.get(key.as_str()).unwrap_or(&Value::Null)
            )
        })
        .collect()
}

/// The file of one run.
fn file_name(s: &Settings, job: Job, vms: usize, round: usize) -> String {
    let budget = job.budget.map_or("none", |b| s.budgets[b].0.as_str());
    format!(
        "{}-{budget}-n{vms}-r{}.json",
        s.strategies[job.strategy],
        round + 1
    )
}

/// A number for JSON: NaN (not measured) is null.
fn number(v: f64) -> Value {
    serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number)
}

/// A number from JSON: null is NaN; anything else not a number is an error.
fn read_number(v: &Value, key: &str) -> Result<f64, String> {
    match &v[key] {
        Value::Null => Ok(f64::NAN),
        n => n.as_f64().ok_or_else(|| format!("`{key}`: not a number")),
    }
}

fn numbers(values: &[f64]) -> Value {
    Value::Array(values.iter().copied().map(number).collect())
}

fn read_numbers(v: &Value, key: &str) -> Result<Vec<f64>, String> {
    v[key]
        .as_array()
        .ok_or_else(|| format!("`{key}`: not an array"))?
        .iter()
        .map(|n| match n {
            Value::Null => Ok(f64::NAN),
            n => n.as_f64().ok_or_else(|| format!("`{key}`: not a number")),
        })
        .collect()
}

fn texts(v: &Value, key: &str) -> Result<Vec<String>, String> {
    v[key]
        .as_array()
        .ok_or_else(|| format!("`{key}`: not an array"))?
        .iter()
        .map(|t| {
            t.as_str()
                .map(str::to_owned)
                .ok_or_else(|| format!("`{key}`: not text"))
        })
        .collect()
}

/// One run as JSON.
pub fn to_json(m: &Measured, commit: &str, finished: &str) -> Value {
    let f = &m.facts;
    json!({
        "commit": commit,
        "finished": finished,
        "vms": m.vms,
        "round": m.round,
        "facts": {
            "passed": f.passed,
            "failures": f.failures,
            "oom_kills": f.oom_kills,
            "oom_killed": f.oom_killed,
            "window_s": number(f.window_s),
            "peak_bytes": number(f.peak_bytes),
            "cpu_share": number(f.cpu_share),
        },
        "cgroup_gib_s": number(m.cgroup_gib_s),
        "guest_gib_s": number(m.guest_gib_s),
        "cpu": m.cpu.map(|c| json!({"user_s": number(c.user_s), "system_s": number(c.system_s)})),
        "offloads": number(m.offloads),
        "offload_ms": number(m.offload_ms),
        "wall_s": number(m.wall_s),
        "timeline": m.timeline.as_ref().map(|t| json!({
            "t_s": numbers(&t.t_s),
            "guest_gib": numbers(&t.guest_gib),
            "cgroup_gib": numbers(&t.cgroup_gib),
        })),
        "pool": m.pool.as_ref().map(|p| json!({
            "pool": p.pool.name(),
            "compressor": p.compressor,
            "pool_bytes": p.split.pool_bytes,
            "cgroup_bytes": p.split.cgroup_bytes,
            "zswap_percent": p.split.zswap_percent,
            "peak_bytes": number(p.peak_bytes),
            "gib_s": number(p.gib_s),
        })),
    })
}

/// A run from JSON, as `job` with `vms` VMs in `round` (what its file's name says; the file
/// must agree).
pub fn from_json(v: &Value, job: Job, vms: usize, round: usize) -> Result<Saved, String> {
    if v["vms"].as_u64() != Some(vms as u64) || v["round"].as_u64() != Some(round as u64) {
        return Err(format!(
            "it says N={} round {}, its name N={vms} round {}",
            v["vms"],
            v["round"],
            round + 1
        ));
    }
    let f = &v["facts"];
    let facts = Facts {
        passed: f["passed"].as_bool().ok_or("`passed`: not a boolean")?,
        failures: texts(f, "failures")?,
        oom_kills: f["oom_kills"].as_u64().ok_or("`oom_kills`: not a count")?,
        oom_killed: texts(f, "oom_killed")?,
        window_s: read_number(f, "window_s")?,
        peak_bytes: read_number(f, "peak_bytes")?,
        cpu_share: read_number(f, "cpu_share")?,
    };
    let cpu = match &v["cpu"] {
        Value::Null => None,
        c => Some(CpuUse {
            user_s: read_number(c, "user_s")?,
            system_s: read_number(c, "system_s")?,
        }),
    };
    let timeline = match &v["timeline"] {
        Value::Null => None,
        t => {
            let timeline = Timeline {
                t_s: read_numbers(t, "t_s")?,
                guest_gib: read_numbers(t, "guest_gib")?,
                cgroup_gib: read_numbers(t, "cgroup_gib")?,
            };
            let n = timeline.t_s.len();
            if timeline.guest_gib.len() != n || timeline.cgroup_gib.len() != n {
                return Err("the timeline's columns differ in length".into());
            }
            Some(timeline)
        }
    };
    // Runs made before pools existed have no `pool`.
    let pool = match &v["pool"] {
        Value::Null => None,
        p => Some(PoolUse {
            pool: match p["pool"].as_str() {
                Some("zram") => Pool::Zram,
                Some("zswap") => Pool::Zswap,
                other => return Err(format!("`pool`: {other:?} is no pool")),
            },
            compressor: p["compressor"]
                .as_str()
                .ok_or("`compressor`: not text")?
                .to_owned(),
            split: Split {
                pool_bytes: p["pool_bytes"].as_u64().ok_or("`pool_bytes`: not a size")?,
                cgroup_bytes: p["cgroup_bytes"]
                    .as_u64()
                    .ok_or("`cgroup_bytes`: not a size")?,
                zswap_percent: p["zswap_percent"].as_u64(),
            },
            peak_bytes: read_number(p, "peak_bytes")?,
            gib_s: read_number(p, "gib_s")?,
        }),
    };
    let text = |key: &str| {
        v[key]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("`{key}`: not text"))
    };
    Ok(Saved {
        measured: Measured {
            job,
            vms,
            round,
            facts,
            cgroup_gib_s: read_number(v, "cgroup_gib_s")?,
            guest_gib_s: read_number(v, "guest_gib_s")?,
            cpu,
            offloads: read_number(v, "offloads")?,
            offload_ms: read_number(v, "offload_ms")?,
            wall_s: read_number(v, "wall_s")?,
            timeline,
            pool,
        },
        commit: text("commit")?,
        finished: text("finished")?,
    })
}

/// Writes `contents` to `path` whole or not at all: a stopped bench leaves no half file.
fn write_whole(path: &Path, contents: &str) -> Res<()> {
    let partial = path.with_extension("partial");
    let mut file = fs::File::create(&partial)?;
    file.write_all(contents.as_bytes())?;
    file.sync_all()?;
    fs::rename(&partial, path)?;
    Ok(())
}

/// Every (job, N, round) of the settings, with its file's name.
fn every_run(s: &Settings) -> Vec<((Job, usize, usize), String)> {
    let mut all = Vec::new();
    for &vms in &s.sweep {
        for round in 0..s.rounds {
            for strategy in 0..s.strategies.len() {
                let budgets = std::iter::once(None).chain((0..s.budgets.len()).map(Some));
                for budget in budgets {
                    let job = Job { strategy, budget };
                    all.push(((job, vms, round), file_name(s, job, vms, round)));
                }
            }
        }
    }
    all
}

impl Resume {
    /// Opens (or creates) `dir` for the settings `s`: an error when it holds runs of other
    /// settings, or a run file that does not read.
    pub fn open(dir: &Path, s: &Settings) -> Res<Self> {
        fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let wanted = fingerprint(s);
        let settings = dir.join("settings.json");
        match fs::read_to_string(&settings) {
            Ok(text) => {
                let saved: Value = serde_json::from_str(&text)
                    .map_err(|e| format!("{}: {e}", settings.display()))?;
                let differ = differences(&saved, &wanted);
                if !differ.is_empty() {
                    return Err(format!(
                        "{} holds runs of other settings ({}): run with those, or remove the directory to start \
                         the sweep anew",
                        dir.display(),
                        differ.join("; ")
                    )
                    .into());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                write_whole(&settings, &serde_json::to_string_pretty(&wanted)?)?;
            }
            Err(e) => return Err(format!("{}: {e}", settings.display()).into()),
        }
        let mut found = BTreeMap::new();
        for (key, name) in every_run(s) {
            let path = dir.join(&name);
            let text = match fs::read_to_string(&path) {
                Ok(text) => text,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(format!("{}: {e}", path.display()).into()),
            };
            let (job, vms, round) = key;
            let saved = serde_json::from_str::<Value>(&text)
                .map_err(|e| e.to_string())
                .and_then(|v| from_json(&v, job, vms, round))
                .map_err(|e| {
                    format!("{}: {e} (remove the file to run it again)", path.display())
                })?;
            found.insert(key, saved);
        }
        Ok(Self {
            dir: dir.to_owned(),
            found,
        })
    }

    /// How many runs the directory holds.
    pub fn len(&self) -> usize {
        self.found.len()
    }

    /// Whether the run of `job` with `vms` VMs in `round` was made before.
    pub fn holds(&self, job: Job, vms: usize, round: usize) -> bool {
        self.found.contains_key(&(job, vms, round))
    }

    /// The run of `job` with `vms` VMs in `round`, taken out if it was made before.
    pub fn take(&mut self, job: Job, vms: usize, round: usize) -> Option<Saved> {
        self.found.remove(&(job, vms, round))
    }

    /// Keeps a run just made.
    pub fn keep(&self, s: &Settings, m: &Measured, commit: &str, finished: &str) -> Res<()> {
        let path = self.dir.join(file_name(s, m.job, m.vms, m.round));
        let text = serde_json::to_string(&to_json(m, commit, finished))?;
        write_whole(&path, &text).map_err(|e| format!("{}: {e}", path.display()).into())
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// A failed budgeted run of 8 VMs, with NaNs where figures are missing.
    pub fn measured() -> Measured {
        Measured {
            job: Job {
                strategy: 1,
                budget: Some(0),
            },
            vms: 8,
            round: 2,
            facts: Facts {
                passed: false,
                failures: vec!["round 1: exit status: 1".into()],
                oom_kills: 1,
                oom_killed: vec!["VM 4 (replay-x-4): oom_kill 1".into()],
                window_s: 54.5,
                peak_bytes: f64::NAN,
                cpu_share: 0.28,
            },
            cgroup_gib_s: 5.2,
            guest_gib_s: f64::NAN,
            cpu: Some(CpuUse {
                user_s: 20.0,
                system_s: 9.5,
            }),
            offloads: f64::NAN,
            offload_ms: f64::NAN,
            wall_s: 101.8,
            timeline: Some(Timeline {
                t_s: vec![0.0, 0.1],
                guest_gib: vec![f64::NAN, 0.25],
                cgroup_gib: vec![0.5, 0.5],
            }),
            pool: Some(PoolUse {
                pool: Pool::Zswap,
                compressor: "lzo-rle".into(),
                split: Split {
                    pool_bytes: 251_658_240,
                    cgroup_bytes: 285_212_672,
                    zswap_percent: Some(1),
                },
                peak_bytes: 2.5e8,
                gib_s: f64::NAN,
            }),
        }
    }

    /// `NaN == NaN` for the comparison of a run with its copy.
    fn same(a: f64, b: f64) -> bool {
        a == b || (a.is_nan() && b.is_nan())
    }

    fn run_survives_json_with_its_nans() {
        let m = measured();
        let text = serde_json::to_string(&to_json(&m, "abc1234", "2026-12-01 23:00 UTC")).unwrap();
        let back = from_json(&serde_json::from_str(&text).unwrap(), m.job, 8, 2).unwrap();
        assert_eq!(back.commit, "abc1234");
        assert_eq!(back.finished, "2026-12-01 23:00 UTC");
        let b = &back.measured;
        assert_eq!(b.facts.failures, m.facts.failures);
        assert_eq!(b.facts.oom_killed, m.facts.oom_killed);
        assert_eq!((b.facts.passed, b.facts.oom_kills), (false, 1));
        for (x, y) in [
            (b.facts.window_s, m.facts.window_s),
            (b.facts.peak_bytes, m.facts.peak_bytes),
            (b.facts.cpu_share, m.facts.cpu_share),
            (b.cgroup_gib_s, m.cgroup_gib_s),
            (b.guest_gib_s, m.guest_gib_s),
            (b.offloads, m.offloads),
            (b.wall_s, m.wall_s),
        ] {
            assert!(same(x, y), "{x} != {y}");
        }
        assert_eq!(b.cpu, m.cpu);
        let (t, u) = (b.timeline.as_ref().unwrap(), m.timeline.as_ref().unwrap());
        assert_eq!(t.t_s, u.t_s);
        assert!(t.guest_gib[0].is_nan() && t.guest_gib[1] == 0.25);
        assert_eq!(t.cgroup_gib, u.cgroup_gib);
        let (p, q) = (b.pool.as_ref().unwrap(), m.pool.as_ref().unwrap());
        assert_eq!(
            (p.pool, &p.compressor, p.split, p.peak_bytes),
            (q.pool, &q.compressor, q.split, q.peak_bytes)
        );
        assert!(p.gib_s.is_nan());
        // A run kept before pools existed reads as one without.
        let mut old = to_json(&m, "abc1234", "now");
        old.as_object_mut().unwrap().remove("pool");
        assert!(from_json(&old, m.job, 8, 2)
            .unwrap()
            .measured
            .pool
            .is_none());
    }

    fn run_file_that_lies_is_refused() {
        let m = measured();
        let v = to_json(&m, "abc1234", "now");
        // Named for another round or N than it holds.
        assert!(from_json(&v, m.job, 8, 1).is_err());
        assert!(from_json(&v, m.job, 6, 2).is_err());
        let mut bad = v.clone();
        bad["facts"]["window_s"] = json!("fast");
        assert!(from_json(&bad, m.job, 8, 2)
            .unwrap_err()
            .contains("window_s"));
        let mut bad = v.clone();
        bad["timeline"]["t_s"] = json!([0.0]);
        assert!(from_json(&bad, m.job, 8, 2).is_err());
        let mut bad = v;
        bad["facts"]["passed"] = Value::Null;
        assert!(from_json(&bad, m.job, 8, 2).is_err());
    }

    fn differences_name_each_setting_that_changed() {
        let saved = json!({"steps": 24, "rounds": 3, "sweep": [6, 8]});
        let wanted = json!({"steps": 24, "rounds": 5, "sweep": [6, 8, 16]});
        let d = differences(&saved, &wanted);
        assert_eq!(d.len(), 2, "{d:?}");
        assert!(d[0].starts_with("rounds: 3 there, 5 now"), "{d:?}");
        assert!(d[1].starts_with("sweep:"), "{d:?}");
        assert!(differences(&wanted, &wanted).is_empty());
        // A setting the directory does not name differs too.
        assert_eq!(differences(&json!({}), &json!({"steps": 24})).len(), 1);
    }

    pub const ALL: &[(&str, fn())] = &[
        (
            "run_survives_json_with_its_nans",
            run_survives_json_with_its_nans,
        ),
        (
            "run_file_that_lies_is_refused",
            run_file_that_lies_is_refused,
        ),
        (
            "differences_name_each_setting_that_changed",
            differences_name_each_setting_that_changed,
        ),
    ];
}
