//! The machine side of the scenario benches: the temporary directory under
//! `target/bench-tmp/` (on the real disk, never tmpfs), the facts about the machine that the
//! reports state, and the CPU time of the whole machine and of the bench from `/proc/stat`
//! (`BenchRun` gathers them for a report; `CpuSample`, what other work took during a
//! measurement), and of one process or thread.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Instant, SystemTime};

use super::Res;

/// `$CARGO_TARGET_DIR` (relative to the workspace root), or the workspace's `target/`.
pub fn target_dir() -> PathBuf {
    let root = super::workspace_root();
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), |dir| root.join(dir))
}

/// `target/bench-tmp/RELATIVE`, emptied when created and removed on drop, with those of its
/// parents up to `bench-tmp` that are left empty.
#[derive(Debug)]
pub struct TempRoot {
    pub path: PathBuf,
    /// `TYPE on DEVICE` of the file system that holds it.
    pub filesystem: String,
    /// The bench, for the message when the directory cannot be removed.
    bench: &'static str,
    /// How many directories below `bench-tmp` it is.
    depth: usize,
}

impl TempRoot {
    /// Creates `target/bench-tmp/RELATIVE` for the bench named `bench`; refuses tmpfs and ramfs.
    pub fn create(bench: &'static str, relative: &Path) -> Res<Self> {
        let path = target_dir().join("bench-tmp").join(relative);
        if path.exists() {
            fs::remove_dir_all(&path)?;
        }
        fs::create_dir_all(&path)?;
        let root = Self {
            filesystem: filesystem_of(&path)?,
            path,
            bench,
            depth: relative.components().count(),
        };
        if root.filesystem.starts_with("tmpfs") || root.filesystem.starts_with("ramfs") {
            return Err(format!(
                "{} is on {}: the bench must write to a real disk (set CARGO_TARGET_DIR)",
                root.path.display(),
                root.filesystem
            )
            .into());
        }
        Ok(root)
    }
}

impl Drop for TempRoot {
    fn drop(&mut self) {
        if let Err(err) = fs::remove_dir_all(&self.path) {
            eprintln!(
                "{}: cannot remove {}: {err}",
                self.bench,
                self.path.display()
            );
        }
        for parent in self.path.ancestors().skip(1).take(self.depth) {
            // Only if empty: another bench may be using it.
            let _ = fs::remove_dir(parent);
        }
    }
}

/// `TYPE on DEVICE` of the mount that holds `path`, from /proc/mounts.
pub fn filesystem_of(path: &Path) -> Res<String> {
    let path = fs::canonicalize(path)?;
    let mounts = fs::read_to_string("/proc/mounts")?;
    let mut best: Option<(usize, String)> = None;
    for line in mounts.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [device, mount_point, fs_type, ..] = fields[..] else {
            continue;
        };
        if path.starts_with(mount_point)
            && best
                .as_ref()
                .is_none_or(|(len, _)| mount_point.len() >= *len)
        {
            best = Some((mount_point.len(), format!("{fs_type} on {device}")));
        }
    }
    Ok(best.map_or_else(|| "unknown file system".to_owned(), |(_, text)| text))
}

fn command_output(program: &str, args: &[&str]) -> Option<String> {
    let output = Command::new(program).args(args).output().ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// The value after `prefix` and a colon on the first line of `file` that starts with `prefix`.
fn proc_field(file: &str, prefix: &str) -> Option<String> {
    fs::read_to_string(file)
        .ok()?
        .lines()
        .find_map(|line| line.strip_prefix(prefix))
        .and_then(|rest| rest.split_once(':'))
        .map(|(_, value)| value.trim().to_owned())
}

/// What the reports say about the machine; `unknown` where a fact cannot be read.
#[derive(Debug, Clone)]
pub struct Machine {
    /// `model name` of `/proc/cpuinfo`.
    pub cpu: String,
    /// CPUs this process may run on (`nproc`); 1 if that cannot be read.
    pub nproc: usize,
    /// `uname -r`.
    pub kernel: String,
    /// `MemTotal`, as `N.N GiB`.
    pub memory: String,
    /// `rustc --version`.
    pub rustc: String,
    /// The short hash of `HEAD`, and whether the work tree has uncommitted changes.
    pub commit: String,
    /// The kernel's current clock source.
    pub clocksource: String,
}

pub fn machine() -> Machine {
    let unknown = || "unknown".to_owned();
    let memory = proc_field("/proc/meminfo", "MemTotal")
        .and_then(|kib| kib.trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or_else(unknown, |kib| {
            format!("{:.1} GiB", kib as f64 / (1u64 << 20) as f64)
        });
    let manifest = super::workspace_root().to_str().unwrap_or(".");
    let commit = command_output("git", &["-C", manifest, "rev-parse", "--short", "HEAD"])
        .map_or_else(unknown, |hash| {
            let dirty = command_output("git", &["-C", manifest, "status", "--porcelain"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{hash} (with uncommitted changes in the work tree)")
            } else {
                hash
            }
        });
    let read =
        |path: &str| fs::read_to_string(path).map_or_else(|_| unknown(), |s| s.trim().to_owned());
    Machine {
        cpu: proc_field("/proc/cpuinfo", "model name").unwrap_or_else(unknown),
        nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
        kernel: read("/proc/sys/kernel/osrelease"),
        memory,
        rustc: command_output("rustc", &["--version"]).unwrap_or_else(unknown),
        commit,
        clocksource: read("/sys/devices/system/clocksource/clocksource0/current_clocksource"),
    }
}

/// The current UTC date and time, `YYYY-MM-DD HH:MM UTC`.
pub fn utc_now() -> String {
    // `YYYY-MM-DDTHH:MM:SSZ`.
    let rfc3339 = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    format!("{} {} UTC", &rfc3339[..10], &rfc3339[11..16])
}

/// CPU time, in clock ticks (`ticks_per_second`), of the whole machine and of this process:
/// what other processes and the host took while the bench ran.
#[derive(Debug, Clone, Copy)]
pub struct CpuTimes {
    /// All CPUs, busy: user, nice, system, irq, softirq (not steal).
    pub busy: u64,
    /// All CPUs, stolen by the host.
    pub steal: u64,
    /// This process, all threads, user and system.
    pub own: u64,
}

impl CpuTimes {
    /// Reads `/proc/stat` and `/proc/self/stat`; `None` if either cannot be read.
    pub fn now() -> Option<Self> {
        use procfs::CurrentSI;
        let cpu = procfs::KernelStats::current().ok()?.total;
        let own = procfs::process::Process::myself().ok()?.stat().ok()?;
        Some(Self {
            busy: cpu.user
                + cpu.nice
                + cpu.system
                + cpu.irq.unwrap_or(0)
                + cpu.softirq.unwrap_or(0),
            steal: cpu.steal.unwrap_or(0),
            own: own.utime + own.stime,
        })
    }

    /// `(busy, own, steal)`: the CPU seconds the whole machine used, this process used and the
    /// host stole from `then` to `self`.
    pub fn seconds_since(self, then: Self) -> (f64, f64, f64) {
        let s = |from: u64, to: u64| to.saturating_sub(from) as f64 / ticks_per_second();
        let (busy, own) = (s(then.busy, self.busy), s(then.own, self.own));
        (busy, own, s(then.steal, self.steal))
    }
}

/// The CPU times of [`CpuTimes`] at an instant, to tell how much other work ran during a
/// measurement (the machine is shared).
#[derive(Debug, Clone, Copy)]
pub struct CpuSample {
    at: Instant,
    times: Option<CpuTimes>,
}

impl CpuSample {
    pub fn now() -> Self {
        let (times, at) = (CpuTimes::now(), Instant::now());
        Self { at, times }
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

    /// [`CpuTimes::seconds_since`] `self`, up to now (zeros if `/proc/stat` cannot be read).
    pub fn seconds(&self) -> (f64, f64, f64) {
        let now = CpuTimes::now();
        self.times
            .zip(now)
            .map_or((0.0, 0.0, 0.0), |(then, now)| now.seconds_since(then))
    }
}

/// The disk under `target/` (where the benches' stores live) and the machine's I/O stalls,
/// as counters: how busy the disk was and how much moved while a bench ran. A store's speed
/// drifts with the host's disk as its CPU figures drift with the host's CPUs.
#[derive(Debug, Clone)]
pub struct IoTimes {
    /// The block device holding `target/` (`/proc/diskstats`): its name, milliseconds it was
    /// doing I/O, and sectors (512 bytes) read and written; `None` if it cannot be told.
    disk: Option<(String, u64, u64, u64)>,
    /// Microseconds in which some task was stalled on I/O (`/proc/pressure/io`, `some`).
    stall_us: Option<u64>,
}

impl IoTimes {
    pub fn now() -> Self {
        use procfs::Current;
        use std::os::unix::fs::MetadataExt;
        let disk = fs::metadata(target_dir()).ok().and_then(|meta| {
            let dev = meta.dev();
            let (major, minor) = (libc::major(dev), libc::minor(dev));
            procfs::diskstats().ok()?.into_iter().find_map(|d| {
                (u32::try_from(d.major) == Ok(major) && u32::try_from(d.minor) == Ok(minor))
                    .then_some((
                        d.name,
                        d.time_in_progress,
                        d.sectors_read,
                        d.sectors_written,
                    ))
            })
        });
        let stall_us = procfs::IoPressure::current().ok().map(|p| p.some.total);
        Self { disk, stall_us }
    }

    /// What moved since `then`, over `wall_s` seconds: `the disk under target/ (NAME) had I/O
    /// in flight P% of the time, W GiB written, R GiB read; some task stalled on I/O S% of the
    /// time`, the parts that could be read; `None` if neither could. (A disk that serves many
    /// requests at once may have I/O in flight all the time without being saturated; a
    /// `target/` on overlayfs, btrfs or tmpfs names no block device, and its part is left out.)
    fn since(&self, then: &Self, wall_s: f64) -> Option<String> {
        let gib = |sectors: u64| sectors as f64 * 512.0 / f64::from(1u32 << 30);
        let pct = |part: f64| 100.0 * part / wall_s.max(1e-9);
        let disk = match (&self.disk, &then.disk) {
            (Some((name, busy, read, written)), Some((before, busy0, read0, written0)))
                if name == before =>
            {
                Some(format!(
                    "the disk under target/ ({name}) had I/O in flight {:.0}% of the time, {:.2} GiB written, \
                     {:.2} GiB read",
                    pct(busy.saturating_sub(*busy0) as f64 / 1e3),
                    gib(written.saturating_sub(*written0)),
                    gib(read.saturating_sub(*read0)),
                ))
            }
            _ => None,
        };
        let stall = self.stall_us.zip(then.stall_us).map(|(now, before)| {
            format!(
                "some task stalled on I/O {:.0}% of the time (`/proc/pressure/io`)",
                pct(now.saturating_sub(before) as f64 / 1e6)
            )
        });
        let parts: Vec<String> = disk.into_iter().chain(stall).collect();
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// Clock ticks per second of `/proc/stat`.
pub fn ticks_per_second() -> f64 {
    procfs::ticks_per_second().max(1) as f64
}

/// CPU time of the task (process or thread) whose `/proc` directory is `dir`, seconds: its
/// `schedstat`'s time on a CPU (ns), or its `stat`'s utime + stime (clock ticks) where the
/// kernel keeps no schedstat; `None` once it has exited.
pub fn task_cpu_seconds(dir: &Path) -> Option<f64> {
    let schedstat = fs::read_to_string(dir.join("schedstat")).ok();
    if let Some(ns) = schedstat.and_then(|t| t.split_whitespace().next()?.parse::<u64>().ok()) {
        return Some(ns as f64 / 1e9);
    }
    // utime and stime are fields 14 and 15; counted after the command name (which may hold
    // spaces), they are the 12th and 13th.
    let stat = fs::read_to_string(dir.join("stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / ticks_per_second())
}

/// Fails with a clear message unless `/dev/kvm` and `/dev/userfaultfd` open read-write.
pub fn check_vm_devices() -> Res<()> {
    for device in ["/dev/kvm", "/dev/userfaultfd"] {
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(device)
            .map_err(|e| format!("{device}: {e} (the bench needs root, KVM and userfaultfd)"))?;
    }
    Ok(())
}

/// One run of a scenario bench as its report tells it: the machine, the date it began, and
/// what the run took of the machine's time and CPU since; or, for a report re-rendered from a
/// kept run ([`BenchRun::kept`]), what that run's report said of it.
#[derive(Debug, Clone)]
pub struct BenchRun {
    pub machine: Machine,
    /// `YYYY-MM-DD HH:MM UTC` at `begin` (the kept run's date when re-rendered).
    pub date: String,
    began: Instant,
    cpu: Option<CpuTimes>,
    io: Option<IoTimes>,
    kept: Option<Kept>,
}

/// What a kept report said of its run, and when it was re-rendered.
#[derive(Debug, Clone)]
struct Kept {
    /// The whole bench's seconds, as the report gave them.
    elapsed_s: f64,
    /// Its `- **CPU used**` line, as it was.
    cpu_line: Option<String>,
    /// `YYYY-MM-DD HH:MM UTC` of the re-rendering.
    rendered: String,
}

/// The line of a report that [`BenchRun::generated`] writes.
const GENERATED: &str = "Generated by `benches/";
/// The line of a report that [`BenchRun::machine_markdown`] writes first, and second.
const MACHINE: &str = "- **Machine**: ";
const CPU_USED: &str = "- **CPU used**";
/// The same in the older reports' `## Machine` list ([`parse_machine_list`]).
const OLD_CPU_USED: &str = "- CPU used, from";

impl BenchRun {
    pub fn begin() -> Self {
        Self {
            machine: machine(),
            date: utc_now(),
            began: Instant::now(),
            cpu: CpuTimes::now(),
            io: Some(IoTimes::now()),
            kept: None,
        }
    }

    /// The run that the report `markdown` (as [`BenchRun::generated`] and
    /// [`BenchRun::machine_markdown`] wrote it, re-rendered or not) tells of: its date, its
    /// duration, its machine and the CPU it used; `rendered` is the date of re-rendering it.
    pub fn kept(markdown: &str, rendered: String) -> Result<Self, String> {
        let line = |prefix: &str| markdown.lines().find(|l| l.starts_with(prefix));
        let generated = line(GENERATED).ok_or("the report has no `Generated by` line")?;
        let between = |text: &'static str, open: &str, close: &str| {
            generated
                .split_once(open)
                .and_then(|(_, rest)| rest.split_once(close))
                .map(|(inside, _)| inside.to_owned())
                .ok_or_else(|| format!("`{generated}`: no {text}"))
        };
        let date = between("date", "` on ", ";")?;
        let elapsed_s = between("duration", "the whole bench took ", " s")?
            .parse::<f64>()
            .map_err(|e| format!("`{generated}`: its duration: {e}"))?;
        let machine = match line(MACHINE) {
            Some(machine) => parse_machine(&machine[MACHINE.len()..])
                .ok_or_else(|| format!("`{machine}`: not the shape machine_markdown writes"))?,
            None => parse_machine_list(markdown).ok_or("the report names no machine")?,
        };
        Ok(Self {
            machine,
            date,
            began: Instant::now(),
            cpu: None,
            io: None,
            kept: Some(Kept {
                elapsed_s,
                cpu_line: line(CPU_USED)
                    .or_else(|| line(OLD_CPU_USED))
                    .map(str::to_owned),
                rendered,
            }),
        })
    }

    /// The line under a report's title: which bench made it, when, over how many rounds, in
    /// how long, when it was re-rendered if it was, and not to edit it by hand.
    pub fn generated(&self, bench: &str, runs: usize) -> String {
        let rounds = if runs == 1 {
            "1 round".to_owned()
        } else {
            format!("{runs} interleaved rounds")
        };
        let rendered = self.kept.as_ref().map_or(String::new(), |kept| {
            format!(
                " Re-rendered on {} from that run's kept data (`BENCH_RENDER=1`: nothing was run \
                 again), its figures as its CSV keeps them (rounded: a report written before \
                 render mode may differ from it in a last digit).",
                kept.rendered
            )
        });
        format!(
            "{GENERATED}{bench}/` on {}; {rounds}; the whole bench took {:.0} s.{rendered} Do not edit by \
             hand: rerun the bench{} (see Method).\n",
            self.date,
            self.elapsed_s(),
            if self.kept.is_some() {
                ", or re-render it"
            } else {
                ""
            }
        )
    }

    /// Seconds since `begin`; the kept run's whole duration when re-rendered.
    pub fn elapsed_s(&self) -> f64 {
        self.kept
            .as_ref()
            .map_or_else(|| self.began.elapsed().as_secs_f64(), |kept| kept.elapsed_s)
    }

    /// Two Markdown list items: the machine's facts, and the CPU time spent since `begin` by
    /// the whole machine, by this process and stolen by the host (when `/proc/stat` reads; as
    /// the kept report said when re-rendered).
    pub fn machine_markdown(&self) -> String {
        let m = &self.machine;
        let mut out = format!(
            "{MACHINE}{} (`nproc`: {}), {}; kernel {} (clock source {}); {}; commit {}.\n",
            m.cpu, m.nproc, m.memory, m.kernel, m.clocksource, m.rustc, m.commit
        );
        if let Some(kept) = &self.kept {
            if let Some(line) = &kept.cpu_line {
                out.push_str(line);
                out.push('\n');
            }
        } else if let Some((then, now)) = self.cpu.zip(CpuTimes::now()) {
            let (busy, own, steal) = now.seconds_since(then);
            let io = self
                .io
                .as_ref()
                .and_then(|then| IoTimes::now().since(then, self.elapsed_s()))
                .map_or(String::new(), |io| format!("; {io}"));
            out.push_str(&format!(
                "{CPU_USED} (`/proc/stat`): the whole machine {:.1} s of the {:.0} s its {} CPUs had while the \
                 bench ran, this bench process {:.1} s, stolen by the host {:.1} s{io}.\n",
                busy,
                self.elapsed_s() * m.nproc as f64,
                m.nproc,
                own,
                steal,
            ));
        }
        out
    }
}

/// The machine of a `- **Machine**:` line, after its prefix: the inverse of
/// [`BenchRun::machine_markdown`]'s first line.
fn parse_machine(text: &str) -> Option<Machine> {
    let (cpu, rest) = text.rsplit_once(" (`nproc`: ")?;
    let (nproc, rest) = rest.split_once("), ")?;
    let (memory, rest) = rest.split_once("; kernel ")?;
    let (kernel, rest) = rest.split_once(" (clock source ")?;
    let (clocksource, rest) = rest.split_once("); ")?;
    let (rustc, commit) = rest.split_once("; commit ")?;
    Some(Machine {
        cpu: cpu.to_owned(),
        nproc: nproc.parse().ok()?,
        kernel: kernel.to_owned(),
        memory: memory.to_owned(),
        rustc: rustc.to_owned(),
        commit: commit.strip_suffix('.')?.to_owned(),
        clocksource: clocksource.to_owned(),
    })
}

/// The machine of an older report's `## Machine` list (`- CPU: …`, `- kernel: …[; clock
/// source: …]`, `- memory: …`, `- toolchain: …; commit …`).
fn parse_machine_list(markdown: &str) -> Option<Machine> {
    let item = |prefix: &str| markdown.lines().find_map(|l| l.strip_prefix(prefix));
    let (cpu, nproc) = item("- CPU: ")?.rsplit_once(" (`nproc`: ")?;
    let kernel = item("- kernel: ")?;
    let (kernel, rest) = kernel.split_once("; ").unwrap_or((kernel, ""));
    let clocksource = rest.strip_prefix("clock source: ").unwrap_or("unknown");
    let (rustc, commit) = item("- toolchain: ")?.split_once("; commit ")?;
    Some(Machine {
        cpu: cpu.to_owned(),
        nproc: nproc.strip_suffix(')')?.parse().ok()?,
        kernel: kernel.to_owned(),
        memory: item("- memory: ")?.to_owned(),
        rustc: rustc.to_owned(),
        commit: commit.to_owned(),
        clocksource: clocksource.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_times_seconds_since_are_the_differences_never_below_zero() {
        let at = |busy, steal, own| CpuTimes { busy, steal, own };
        let hz = procfs::ticks_per_second().max(1);
        let (then, now) = (at(100, 5, 10), at(100 + 3 * hz, 5, 10 + hz));
        assert_eq!(now.seconds_since(then), (3.0, 1.0, 0.0));
        assert_eq!(then.seconds_since(now), (0.0, 0.0, 0.0));
    }

    #[test]
    fn task_cpu_seconds_reads_schedstat_else_stat() {
        assert!(task_cpu_seconds(Path::new("/proc/thread-self")).is_some_and(|s| s >= 0.0));
        let dir = std::env::temp_dir().join(format!("benchkit-stat-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("a temporary directory");
        assert_eq!(task_cpu_seconds(&dir), None, "no task");
        let stat = "7 (a) b) S 1 7 7 0 -1 0 0 0 0 0 250 150 0 0 20 0 1 0";
        fs::write(dir.join("stat"), stat).expect("a stat file");
        assert_eq!(task_cpu_seconds(&dir), Some(400.0 / ticks_per_second()));
        fs::remove_dir_all(&dir).expect("removed");
    }

    #[test]
    fn bench_run_kept_reads_back_what_a_report_says_of_its_run() {
        let mut run = BenchRun::begin();
        run.machine.cpu = "Intel(R) Xeon(R) CPU @ 2.20GHz".to_owned();
        run.machine.commit = "2a9156b (with uncommitted changes in the work tree)".to_owned();
        // Written once: its CPU and I/O shares change from one reading to the next.
        let machine = run.machine_markdown();
        let report = format!("# T\n\n{}\n## Method\n\n{machine}", run.generated("b", 5));

        let kept = BenchRun::kept(&report, "2026-12-05 10:00 UTC".to_owned()).expect("kept");

        assert_eq!(kept.date, run.date);
        assert_eq!(kept.machine_markdown(), machine);
        let generated = kept.generated("b", 5);
        assert!(generated.contains("Re-rendered on 2026-12-05 10:00 UTC"));
        let (head, tail) = generated
            .split_once(" Re-rendered on 2026-12-05 10:00 UTC")
            .expect("says when it was re-rendered");
        let (_, rest) = tail.split_once(" Do not edit").expect("ends as before");
        let rest = rest.replace(", or re-render it", "");
        assert_eq!(format!("{head} Do not edit{rest}"), run.generated("b", 5));
        // A re-rendered report is read back as the run it tells of.
        let again = BenchRun::kept(
            &format!("{generated}\n{}", kept.machine_markdown()),
            "x".into(),
        )
        .expect("kept again");
        assert_eq!(again.date, run.date);
        assert_eq!(
            again.generated("b", 5).replace("on x", ""),
            generated.replace("on 2026-12-05 10:00 UTC", "")
        );
    }

    #[test]
    fn bench_run_kept_reads_an_older_reports_machine_list() {
        let report = "Generated by `benches/b/` on D; 5 interleaved rounds; the whole bench took 980 s. \
                      Do not edit by hand: rerun the bench.\n\n## Machine\n\n- CPU: AMD EPYC (`nproc`: 2)\n\
                      - kernel: 6.18; clock source: tsc\n- memory: 23.5 GiB\n\
                      - toolchain: rustc 1.95.0; commit 2fc280e\n- CPU used, from `/proc/stat`: x\n";

        let kept = BenchRun::kept(report, "R".into()).expect("kept");

        assert_eq!(kept.machine.nproc, 2);
        assert_eq!(kept.elapsed_s(), 980.0);
        assert!(kept
            .machine_markdown()
            .ends_with("commit 2fc280e.\n- CPU used, from `/proc/stat`: x\n"));
    }

    #[test]
    fn bench_run_kept_without_a_generated_line_says_so() {
        let err = BenchRun::kept("# T\n", "x".into()).expect_err("no line");
        assert!(err.contains("Generated by"));
    }

    #[test]
    fn io_times_say_how_busy_the_disk_was_and_what_moved() {
        let then = IoTimes {
            disk: Some(("vda".into(), 1_000, 0, 0)),
            stall_us: Some(5_000_000),
        };
        let now = IoTimes {
            disk: Some(("vda".into(), 31_000, 1 << 21, 3 << 21)),
            stall_us: Some(20_000_000),
        };

        assert_eq!(
            now.since(&then, 100.0).as_deref(),
            Some(
                "the disk under target/ (vda) had I/O in flight 30% of the time, 3.00 GiB written, 1.00 GiB \
                 read; some task stalled on I/O 15% of the time (`/proc/pressure/io`)"
            )
        );
        let unknown = IoTimes {
            disk: None,
            stall_us: None,
        };
        assert_eq!(unknown.since(&then, 100.0), None);
        // Readings of another device are not subtracted.
        let other = IoTimes {
            disk: Some(("vdb".into(), 9, 9, 9)),
            stall_us: None,
        };
        assert_eq!(other.since(&then, 100.0), None);
        // What this machine gives is read without failing.
        let _ = IoTimes::now().since(&IoTimes::now(), 1.0);
    }
}
