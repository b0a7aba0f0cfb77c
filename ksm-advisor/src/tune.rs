//! Tuning KSM's global knobs for fast merging, shared by every VM that wants it, and giving the
//! host its own settings back when the last of them is gone.
//!
//! KSM's knobs are global, while the VMs that want them tuned come and go independently, in
//! separate processes. So tuning is a lease kept in a state directory (default
//! [`DEFAULT_STATE_DIR`]): the first holder saves the settings it found (`saved.json`), each
//! holder leaves a file under `holders/` named after its pid and the pid's start time, and
//! whoever removes the last live holder writes the saved settings back. A holder that died
//! without releasing is noticed (its pid is gone or belongs to another process) and pruned by
//! the next acquire or release, so a crash never leaves the host tuned for good. All of it
//! happens under an exclusive `flock` of the directory's `lock` file.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::sys::{Knobs, Ksm, SysError};

/// Where leases live unless told otherwise.
pub const DEFAULT_STATE_DIR: &str = "/run/pvisor/ksm";

/// Errors of tuning.
#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    /// The state directory could not be used.
    #[error("cannot {op} {path}")]
    State {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The saved settings do not parse.
    #[error("the saved KSM settings in {path} are unreadable: {reason}")]
    Saved {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A knob could not be read or written.
    #[error(transparent)]
    Sys(#[from] SysError),
    /// A restore was asked for while VMs still hold the tuning.
    #[error("{0} live holder(s) still use the tuning (pids {1}); pass --force to restore anyway")]
    Held(usize, String),
}

/// Settings that make KSM merge quickly within a CPU budget.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Profile {
    /// Pages ksmd scans per wake-up.
    pub pages_to_scan: u64,
    /// Milliseconds ksmd sleeps between wake-ups.
    pub sleep_millisecs: u64,
    /// Skip pages that failed to merge repeatedly (where the kernel has smart scan).
    pub smart_scan: bool,
    /// Let the kernel's scan-time advisor size `pages_to_scan` (where it has one): at most
    /// this percentage of a core, aiming at one pass over all mergeable memory per
    /// `target_scan_time_s`.
    pub advisor: Option<AdvisorProfile>,
}

/// The scan-time advisor's settings.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdvisorProfile {
    /// Most CPU ksmd may use, percent of one core.
    pub max_cpu_percent: u64,
    /// Seconds one pass over all mergeable memory should take.
    pub target_scan_time_s: u64,
    /// Fewest pages per wake-up.
    pub min_pages_to_scan: u64,
    /// Most pages per wake-up.
    pub max_pages_to_scan: u64,
}

impl AdvisorProfile {
    /// Aim at one pass per second, within `share` of one core.
    pub fn for_cpu_share(share: f64) -> Self {
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "clamped to 1..=100"
        )]
        let percent = (share * 100.0).round().clamp(1.0, 100.0) as u64;
        Self {
            max_cpu_percent: percent,
            target_scan_time_s: 1,
            min_pages_to_scan: 500,
            max_pages_to_scan: 30_000,
        }
    }
}

impl Profile {
    /// Fast settings for a share of one core (0 < share ≤ 1). Scanning is measured at
    /// roughly 800 MiB/s of candidate memory per busy core on this project's machines, so ksmd
    /// scans `pages_to_scan` pages per wake-up and sleeps long enough that the busy part is
    /// `share` of each cycle.
    pub fn for_cpu_share(share: f64) -> Self {
        let share = share.clamp(0.01, 1.0);
        // Pages one core scans per millisecond (≈ 800 MiB/s of 4 KiB pages: measured by
        // benches/sharing_report, where 5000 pages every 20 ms kept ksmd 56% busy).
        const PAGES_PER_MS: f64 = 200.0;
        const PAGES_TO_SCAN: u64 = 5000;
        #[allow(clippy::cast_precision_loss, reason = "a small constant")]
        let busy_ms = PAGES_TO_SCAN as f64 / PAGES_PER_MS;
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "clamped: share ≥ 0.01, so the sleep stays positive and small"
        )]
        let sleep_ms = (busy_ms * (1.0 - share) / share).round().max(1.0) as u64;
        Self {
            pages_to_scan: PAGES_TO_SCAN,
            sleep_millisecs: sleep_ms,
            smart_scan: true,
            advisor: None,
        }
    }

    /// The knobs this profile sets on `ksm` (with `run=1`), skipping those the kernel lacks.
    pub fn knobs(&self, ksm: &Ksm) -> Knobs {
        let mut knobs = Knobs::new();
        let mut set = |name: &str, value: String| {
            if ksm.has(name) {
                knobs.insert(name.to_owned(), value);
            }
        };
        set("pages_to_scan", self.pages_to_scan.to_string());
        set("sleep_millisecs", self.sleep_millisecs.to_string());
        set("smart_scan", u8::from(self.smart_scan).to_string());
        match self.advisor {
            Some(a) => {
                set("advisor_max_cpu", a.max_cpu_percent.to_string());
                set("advisor_target_scan_time", a.target_scan_time_s.to_string());
                set("advisor_min_pages_to_scan", a.min_pages_to_scan.to_string());
                set("advisor_max_pages_to_scan", a.max_pages_to_scan.to_string());
                set("advisor_mode", "scan-time".into());
            }
            None => set("advisor_mode", "none".into()),
        }
        set("run", "1".into());
        knobs
    }
}

impl Profile {
    /// Settings for when nothing has been written for a while: ksmd looks at 1000 pages a
    /// second (about half a percent of a core), enough to keep merged pages merged and to
    /// find slow changes, without scanning unmergeable memory flat out.
    pub fn idle() -> Self {
        Self {
            pages_to_scan: 500,
            sleep_millisecs: 500,
            smart_scan: true,
            advisor: None,
        }
    }
}

impl Default for Profile {
    /// Half a core: 5000 pages per wake-up, which merges 4 × 64 MiB of identical memory in
    /// about a second.
    fn default() -> Self {
        Self::for_cpu_share(0.5)
    }
}

/// A live claim on the tuning; releasing the last one restores the host's settings.
#[derive(Debug)]
pub struct Tuning {
    ksm: Ksm,
    dir: PathBuf,
    holder: Option<PathBuf>,
    busy: Knobs,
    idle: Knobs,
}

/// What a release did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Released {
    /// Others still hold the tuning.
    StillHeld(usize),
    /// This was the last holder: these settings were written back.
    Restored(Knobs),
}

static SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// The state directory, locked for the lifetime of the value.
struct Locked {
    dir: PathBuf,
    _lock: File,
}

impl Locked {
    fn open(dir: &Path) -> Result<Self, TuneError> {
        let state = |op, path: &Path| {
            let path = path.to_path_buf();
            move |source| TuneError::State { op, path, source }
        };
        let holders = dir.join("holders");
        std::fs::create_dir_all(&holders).map_err(state("create", &holders))?;
        let path = dir.join("lock");
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(state("open", &path))?;
        // SAFETY: flock on a descriptor we own; it is released when the file closes.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(state("lock", &path)(std::io::Error::last_os_error()));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            _lock: lock,
        })
    }

    fn saved_path(&self) -> PathBuf {
        self.dir.join("saved.json")
    }

    fn saved(&self) -> Result<Option<Knobs>, TuneError> {
        let path = self.saved_path();
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| TuneError::Saved {
                    path,
                    reason: e.to_string(),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(TuneError::State {
                op: "read",
                path,
                source,
            }),
        }
    }

    fn save(&self, knobs: &Knobs) -> Result<(), TuneError> {
        let path = self.saved_path();
        let tmp = self.dir.join("saved.json.tmp");
        let fail = |op| {
            let path = path.clone();
            move |source| TuneError::State { op, path, source }
        };
        let text = serde_json::to_string_pretty(knobs).expect("a string map serializes");
        let mut file = File::create(&tmp).map_err(fail("write"))?;
        file.write_all(text.as_bytes()).map_err(fail("write"))?;
        file.sync_all().map_err(fail("sync"))?;
        std::fs::rename(&tmp, &path).map_err(fail("rename"))
    }

    /// Live holders' pids after removing the files of holders that are gone.
    fn live_holders(&self) -> Result<Vec<u32>, TuneError> {
        let dir = self.dir.join("holders");
        let entries = std::fs::read_dir(&dir).map_err(|source| TuneError::State {
            op: "list",
            path: dir.clone(),
            source,
        })?;
        let mut live = Vec::new();
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            match parse_holder(&name) {
                Some((pid, start)) if process_start(pid) == Some(start) => live.push(pid),
                _ => {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        Ok(live)
    }

    /// Writes the saved settings back and forgets them.
    fn restore(&self, ksm: &Ksm) -> Result<Option<Knobs>, TuneError> {
        let Some(saved) = self.saved()? else {
            return Ok(None);
        };
        ksm.apply(&saved)?;
        let _ = std::fs::remove_file(self.dir.join("boost-until-ms"));
        let path = self.saved_path();
        std::fs::remove_file(&path).map_err(|source| TuneError::State {
            op: "remove",
            path,
            source,
        })?;
        Ok(Some(saved))
    }
}

fn now_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

fn parse_holder(name: &str) -> Option<(u32, u64)> {
    let mut parts = name.split('-');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// The start time of a process (`starttime` of `/proc/PID/stat`), to tell a pid's reuse apart.
fn process_start(pid: u32) -> Option<u64> {
    let pid = i32::try_from(pid).ok()?;
    let stat = procfs::process::Process::new(pid).and_then(|p| p.stat());
    stat.ok().map(|stat| stat.starttime)
}

impl Tuning {
    /// Applies `knobs` and records this process as a holder; the first holder saves the
    /// settings it replaces.
    pub fn acquire(ksm: &Ksm, state_dir: &Path, knobs: &Knobs) -> Result<Self, TuneError> {
        let locked = Locked::open(state_dir)?;
        let live = locked.live_holders()?;
        // With no live holder, saved settings are the host's own only if a holder died
        // before restoring them; then they are kept, never replaced by tuned values.
        if live.is_empty() && locked.saved()?.is_none() {
            locked.save(&ksm.knobs()?)?;
        }
        let pid = std::process::id();
        let start = process_start(pid).ok_or_else(|| TuneError::State {
            op: "read",
            path: format!("/proc/{pid}/stat").into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        })?;
        let seq = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        let holder = state_dir
            .join("holders")
            .join(format!("{pid}-{start}-{seq}"));
        File::create(&holder).map_err(|source| TuneError::State {
            op: "create",
            path: holder.clone(),
            source,
        })?;
        if let Err(e) = ksm.apply(knobs) {
            let _ = std::fs::remove_file(&holder);
            if live.is_empty() {
                let _ = locked.restore(ksm);
            }
            return Err(e.into());
        }
        Ok(Self {
            ksm: ksm.clone(),
            dir: state_dir.to_path_buf(),
            holder: Some(holder),
            busy: knobs.clone(),
            idle: knobs.clone(),
        })
    }

    /// Lets [`Tuning::govern`] drop to `idle` while no holder has written memory lately
    /// (`boost`), instead of scanning at the acquired settings all the time.
    pub fn with_idle(mut self, idle: Knobs) -> Self {
        self.idle = idle;
        self
    }

    fn boost_path(&self) -> PathBuf {
        self.dir.join("boost-until-ms")
    }

    fn boosted_until(&self) -> u128 {
        std::fs::read_to_string(self.boost_path())
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    }

    /// This holder wrote memory: KSM scans at the acquired settings for `span` (shared with
    /// every holder: the latest deadline wins).
    pub fn boost(&self, span: std::time::Duration) -> Result<(), TuneError> {
        let _locked = Locked::open(&self.dir)?;
        let until = now_ms() + span.as_millis();
        if until > self.boosted_until() {
            let path = self.boost_path();
            std::fs::write(&path, until.to_string()).map_err(|source| TuneError::State {
                op: "write",
                path,
                source,
            })?;
        }
        self.ksm.apply(&self.busy)?;
        Ok(())
    }

    /// Applies the acquired settings while a boost lasts, the idle ones after; returns how
    /// long the boost still lasts (zero: idle now).
    pub fn govern(&self) -> Result<std::time::Duration, TuneError> {
        let _locked = Locked::open(&self.dir)?;
        let left = self.boosted_until().saturating_sub(now_ms());
        let knobs = if left > 0 { &self.busy } else { &self.idle };
        self.ksm.apply(knobs)?;
        Ok(std::time::Duration::from_millis(
            u64::try_from(left).unwrap_or(u64::MAX),
        ))
    }

    /// Gives the claim up; the last holder restores the saved settings.
    pub fn release(mut self) -> Result<Released, TuneError> {
        self.release_inner()
    }

    fn release_inner(&mut self) -> Result<Released, TuneError> {
        let Some(holder) = self.holder.take() else {
            return Ok(Released::StillHeld(0));
        };
        let locked = Locked::open(&self.dir)?;
        let _ = std::fs::remove_file(&holder);
        let live = locked.live_holders()?;
        // Other holders of this very process count as live as well.
        if !live.is_empty() {
            return Ok(Released::StillHeld(live.len()));
        }
        Ok(match locked.restore(&self.ksm)? {
            Some(knobs) => Released::Restored(knobs),
            None => Released::StillHeld(0),
        })
    }
}

impl Drop for Tuning {
    fn drop(&mut self) {
        let _ = self.release_inner();
    }
}

/// The pids holding the tuning now (dead holders pruned), and the settings saved for restore.
pub fn holders(state_dir: &Path) -> Result<(Vec<u32>, Option<Knobs>), TuneError> {
    let locked = Locked::open(state_dir)?;
    Ok((locked.live_holders()?, locked.saved()?))
}

/// Writes the saved settings back now. Refused while live holders remain, unless `force`.
pub fn restore(ksm: &Ksm, state_dir: &Path, force: bool) -> Result<Option<Knobs>, TuneError> {
    let locked = Locked::open(state_dir)?;
    let live = locked.live_holders()?;
    if !live.is_empty() && !force {
        let pids: Vec<String> = live.iter().map(u32::to_string).collect();
        return Err(TuneError::Held(live.len(), pids.join(", ")));
    }
    locked.restore(ksm)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake() -> (tempfile::TempDir, Ksm) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let sys = dir.path().join("sys");
        std::fs::create_dir(&sys).expect("mkdir");
        for (name, value) in [
            ("run", "0"),
            ("pages_to_scan", "100"),
            ("sleep_millisecs", "20"),
            ("smart_scan", "1"),
            ("advisor_mode", "[none] scan-time"),
        ] {
            std::fs::write(sys.join(name), value).expect("write");
        }
        let ksm = Ksm::at(&sys).expect("fake KSM");
        (dir, ksm)
    }

    #[test]
    fn profile_sleep_follows_the_cpu_share() {
        let half = Profile::for_cpu_share(0.5);
        let tenth = Profile::for_cpu_share(0.1);
        assert!(tenth.sleep_millisecs > half.sleep_millisecs * 5);
        assert_eq!(Profile::for_cpu_share(1.0).sleep_millisecs, 1);
    }

    #[test]
    fn tuning_last_release_restores_the_host_settings() {
        let (dir, ksm) = fake();
        let state = dir.path().join("state");
        let knobs = Profile::default().knobs(&ksm);
        let first = Tuning::acquire(&ksm, &state, &knobs).expect("first");
        let second = Tuning::acquire(&ksm, &state, &knobs).expect("second");
        assert_eq!(ksm.read("run").expect("run"), "1");
        assert_eq!(ksm.read("pages_to_scan").expect("pages"), "5000");
        assert!(matches!(first.release(), Ok(Released::StillHeld(1))));
        assert_eq!(ksm.read("run").expect("run"), "1");
        let Released::Restored(knobs) = second.release().expect("release") else {
            panic!("the last release restores");
        };
        assert_eq!(knobs["pages_to_scan"], "100");
        assert_eq!(ksm.read("run").expect("run"), "0");
        assert_eq!(ksm.read("pages_to_scan").expect("pages"), "100");
        assert!(!state.join("saved.json").exists());
    }

    #[test]
    fn tuning_a_dead_holder_is_pruned_and_the_original_settings_survive() {
        let (dir, ksm) = fake();
        let state = dir.path().join("state");
        let knobs = Profile::default().knobs(&ksm);
        // A holder that crashed: its file and the saved settings stay, the host is tuned.
        let crashed = Tuning::acquire(&ksm, &state, &knobs).expect("acquire");
        std::mem::forget(crashed);
        let files: Vec<_> = std::fs::read_dir(state.join("holders"))
            .expect("holders")
            .filter_map(Result::ok)
            .collect();
        assert_eq!(files.len(), 1);
        std::fs::rename(files[0].path(), state.join("holders").join("999999999-1-0"))
            .expect("rename");
        // The next VM must not save the tuned values as the host's.
        let next = Tuning::acquire(&ksm, &state, &knobs).expect("acquire");
        assert_eq!(holders(&state).expect("holders").0.len(), 1);
        let Released::Restored(knobs) = next.release().expect("release") else {
            panic!("the last release restores");
        };
        assert_eq!(knobs["run"], "0");
        assert_eq!(ksm.read("pages_to_scan").expect("pages"), "100");
    }

    #[test]
    fn tuning_scans_fast_while_boosted_and_idles_after() {
        let (dir, ksm) = fake();
        let state = dir.path().join("state");
        let busy = Profile::default().knobs(&ksm);
        let tuning = Tuning::acquire(&ksm, &state, &busy)
            .expect("acquire")
            .with_idle(Profile::idle().knobs(&ksm));
        tuning
            .boost(std::time::Duration::from_secs(60))
            .expect("boost");
        assert!(tuning.govern().expect("govern") > std::time::Duration::from_secs(50));
        assert_eq!(ksm.read("pages_to_scan").expect("pages"), "5000");
        tuning
            .boost(std::time::Duration::ZERO)
            .expect("a shorter boost");
        std::fs::write(state.join("boost-until-ms"), "1").expect("expire the boost");
        assert_eq!(tuning.govern().expect("govern"), std::time::Duration::ZERO);
        assert_eq!(ksm.read("pages_to_scan").expect("pages"), "500");
        assert_eq!(ksm.read("run").expect("run"), "1");
    }

    #[test]
    fn restore_with_live_holders_needs_force() {
        let (dir, ksm) = fake();
        let state = dir.path().join("state");
        let tuning =
            Tuning::acquire(&ksm, &state, &Profile::default().knobs(&ksm)).expect("acquire");
        let err = restore(&ksm, &state, false).expect_err("held");
        assert!(err.to_string().contains("--force"), "{err}");
        assert!(restore(&ksm, &state, true).expect("forced").is_some());
        assert_eq!(ksm.read("run").expect("run"), "0");
        drop(tuning);
    }
}
