//! The kernel's KSM interface under `/sys/kernel/mm/ksm`: the global knobs, the global
//! counters, and the CPU time of `ksmd`.
//!
//! The directory is a parameter so that the tuning logic can be tested on a plain directory;
//! [`Ksm::system`] is the real one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The knobs this crate reads, tunes and restores, in the order they are written back. The
/// advisor's mode is written around them (see [`Ksm::apply`]); `run` goes last so that ksmd
/// starts with its final settings.
pub const TUNABLE: &[&str] = &[
    "pages_to_scan",
    "sleep_millisecs",
    "smart_scan",
    "advisor_max_cpu",
    "advisor_target_scan_time",
    "advisor_min_pages_to_scan",
    "advisor_max_pages_to_scan",
    "advisor_mode",
    "run",
];

/// Errors of the sysfs interface.
#[derive(Debug, thiserror::Error)]
pub enum SysError {
    /// The kernel has no KSM (not built in, or sysfs not mounted).
    #[error("this kernel has no KSM: {dir} is missing (CONFIG_KSM)")]
    Missing {
        /// The directory looked for.
        dir: PathBuf,
    },
    /// A file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// A knob refused a value.
    #[error("cannot set {path} to `{value}`")]
    Write {
        /// The file.
        path: PathBuf,
        /// The value written.
        value: String,
        /// The system error (EINVAL: out of range; EPERM: not root).
        #[source]
        source: std::io::Error,
    },
}

/// Values of KSM knobs by name, as the kernel shows them (the advisor's mode without its
/// brackets).
pub type Knobs = BTreeMap<String, String>;

/// The global counters, in pages (see the kernel's `admin-guide/mm/ksm.rst`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GlobalStats {
    /// Shared KSM pages in use (one per distinct merged content).
    pub pages_shared: u64,
    /// Mappings of those pages: the pages saved.
    pub pages_sharing: u64,
    /// Pages checked but unique so far.
    pub pages_unshared: u64,
    /// Pages changing too fast to be merged.
    pub pages_volatile: u64,
    /// Pages scanned since KSM started.
    pub pages_scanned: u64,
    /// Pages skipped by smart scan.
    pub pages_skipped: u64,
    /// Completed passes over all mergeable memory.
    pub full_scans: u64,
    /// Empty pages merged with the kernel's zero page (`use_zero_pages`).
    pub ksm_zero_pages: u64,
    /// Bytes saved minus the cost of KSM's own metadata (may be negative).
    pub general_profit: i64,
}

/// One KSM interface.
#[derive(Debug, Clone)]
pub struct Ksm {
    dir: PathBuf,
}

impl Ksm {
    /// The running kernel's KSM, if it has one.
    pub fn system() -> Result<Self, SysError> {
        Self::at("/sys/kernel/mm/ksm")
    }

    /// KSM's files under `dir` (tests use a plain directory).
    pub fn at(dir: impl Into<PathBuf>) -> Result<Self, SysError> {
        let dir = dir.into();
        if !dir.join("run").exists() {
            return Err(SysError::Missing { dir });
        }
        Ok(Self { dir })
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// True if the knob exists here (older kernels lack the advisor and smart scan).
    pub fn has(&self, name: &str) -> bool {
        self.dir.join(name).exists()
    }

    /// One file's text, trimmed; a bracketed choice list reads as the chosen value.
    pub fn read(&self, name: &str) -> Result<String, SysError> {
        let path = self.dir.join(name);
        let text = std::fs::read_to_string(&path).map_err(|source| SysError::Read {
            path: path.clone(),
            source,
        })?;
        Ok(chosen(text.trim()).to_owned())
    }

    fn read_u64(&self, name: &str) -> Result<u64, SysError> {
        Ok(self.read(name)?.parse().unwrap_or(0))
    }

    /// Writes one knob.
    pub fn write(&self, name: &str, value: &str) -> Result<(), SysError> {
        let path = self.dir.join(name);
        std::fs::write(&path, value).map_err(|source| SysError::Write {
            path,
            value: value.to_owned(),
            source,
        })
    }

    /// The current values of every tunable knob this kernel has.
    pub fn knobs(&self) -> Result<Knobs, SysError> {
        TUNABLE
            .iter()
            .filter(|name| self.has(name))
            .map(|name| Ok(((*name).to_owned(), self.read(name)?)))
            .collect()
    }

    /// Sets `knobs` (names this kernel lacks are skipped). The kernel refuses
    /// `pages_to_scan` while the scan-time advisor runs, so the advisor is switched off
    /// first and set to its final mode after the numbers; `run` is written last.
    pub fn apply(&self, knobs: &Knobs) -> Result<(), SysError> {
        let touches_advisor =
            knobs.contains_key("advisor_mode") || knobs.contains_key("pages_to_scan");
        if touches_advisor && self.has("advisor_mode") && self.read("advisor_mode")? != "none" {
            self.write("advisor_mode", "none")?;
        }
        for name in TUNABLE {
            if let Some(value) = knobs.get(*name) {
                if self.has(name) && self.read(name)? != *value {
                    self.write(name, value)?;
                }
            }
        }
        Ok(())
    }

    /// The global counters.
    pub fn stats(&self) -> Result<GlobalStats, SysError> {
        let profit = self.read("general_profit").ok();
        Ok(GlobalStats {
            pages_shared: self.read_u64("pages_shared")?,
            pages_sharing: self.read_u64("pages_sharing")?,
            pages_unshared: self.read_u64("pages_unshared")?,
            pages_volatile: self.read_u64("pages_volatile")?,
            pages_scanned: self.read_u64("pages_scanned").unwrap_or(0),
            pages_skipped: self.read_u64("pages_skipped").unwrap_or(0),
            full_scans: self.read_u64("full_scans")?,
            ksm_zero_pages: self.read_u64("ksm_zero_pages").unwrap_or(0),
            general_profit: profit.and_then(|p| p.parse().ok()).unwrap_or(0),
        })
    }
}

/// `"[none] scan-time"` → `"none"`; plain values pass through.
fn chosen(text: &str) -> &str {
    text.split_whitespace()
        .find_map(|w| w.strip_prefix('[').and_then(|w| w.strip_suffix(']')))
        .unwrap_or(text)
}

/// CPU seconds `ksmd` has used since boot (user + system), if it runs.
pub fn ksmd_cpu_seconds() -> Option<f64> {
    let ksmd = procfs::process::all_processes()
        .ok()?
        .filter_map(Result::ok)
        .find_map(|p| p.stat().ok().filter(|stat| stat.comm == "ksmd"))?;
    Some(stat_cpu_seconds(&ksmd))
}

/// utime + stime of a `/proc/PID/stat` line, in seconds.
pub fn cpu_seconds(stat: &str) -> Option<f64> {
    use procfs::FromRead;
    procfs::process::Stat::from_read(stat.as_bytes())
        .ok()
        .map(|stat| stat_cpu_seconds(&stat))
}

fn stat_cpu_seconds(stat: &procfs::process::Stat) -> f64 {
    #[allow(clippy::cast_precision_loss, reason = "CPU ticks stay far below 2^52")]
    let ticks = (stat.utime + stat.stime) as f64;
    ticks / procfs::ticks_per_second().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake() -> (tempfile::TempDir, Ksm) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        for (name, value) in [
            ("run", "0"),
            ("pages_to_scan", "100"),
            ("sleep_millisecs", "20"),
            ("advisor_mode", "[none] scan-time"),
            ("pages_sharing", "7"),
            ("pages_shared", "1"),
            ("pages_unshared", "3"),
            ("pages_volatile", "0"),
            ("full_scans", "2"),
            ("general_profit", "-4096"),
        ] {
            std::fs::write(dir.path().join(name), format!("{value}\n")).expect("write");
        }
        let ksm = Ksm::at(dir.path()).expect("fake KSM");
        (dir, ksm)
    }

    #[test]
    fn chosen_bracketed_list_gives_the_choice() {
        assert_eq!(chosen("[none] scan-time"), "none");
        assert_eq!(chosen("none [scan-time]"), "scan-time");
        assert_eq!(chosen("100"), "100");
    }

    #[test]
    fn knobs_read_only_what_the_kernel_has() {
        let (_dir, ksm) = fake();
        let knobs = ksm.knobs().expect("knobs");
        assert_eq!(knobs["advisor_mode"], "none");
        assert_eq!(knobs["pages_to_scan"], "100");
        assert!(!knobs.contains_key("smart_scan"));
    }

    #[test]
    fn apply_writes_changed_knobs_and_skips_missing_ones() {
        let (dir, ksm) = fake();
        let mut knobs = Knobs::new();
        knobs.insert("pages_to_scan".into(), "5000".into());
        knobs.insert("smart_scan".into(), "1".into());
        knobs.insert("run".into(), "1".into());
        ksm.apply(&knobs).expect("apply");
        assert_eq!(ksm.read("pages_to_scan").expect("read"), "5000");
        assert_eq!(ksm.read("run").expect("read"), "1");
        assert!(!dir.path().join("smart_scan").exists());
    }

    #[test]
    fn stats_parse_the_counters() {
        let (_dir, ksm) = fake();
        let stats = ksm.stats().expect("stats");
        assert_eq!(stats.pages_sharing, 7);
        assert_eq!(stats.general_profit, -4096);
        assert_eq!(stats.pages_scanned, 0);
    }

    #[test]
    fn missing_directory_is_a_clear_error() {
        let err = Ksm::at("/nonexistent/ksm").expect_err("no KSM there");
        assert!(err.to_string().contains("CONFIG_KSM"), "{err}");
    }

    #[test]
    fn ksmd_cpu_seconds_finds_the_kernel_thread_where_ksm_is_built_in() {
        if !Path::new("/sys/kernel/mm/ksm").exists() {
            return;
        }
        // ksmd is a kernel thread from boot on wherever the kernel has KSM.
        let seconds = ksmd_cpu_seconds().expect("ksmd found among the processes");
        assert!(seconds >= 0.0, "{seconds}");
    }

    #[test]
    fn cpu_seconds_parses_a_stat_line_with_spaces_in_the_name() {
        // A whole line as Linux 6.x writes it: utime 250 and stime 150 ticks.
        let line = "36 (k smd) S 2 0 0 0 -1 2129984 0 0 0 0 250 150 0 0 25 5 1 0 9 0 0 \
                    18446744073709551615 0 0 0 0 0 0 0 2147483647 0 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 0";
        let ticks = procfs::ticks_per_second() as f64;
        let seconds = cpu_seconds(line).expect("parsed");
        assert!((seconds - 400.0 / ticks).abs() < 1e-9, "{seconds}");
    }
}
