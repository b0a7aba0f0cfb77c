//! Part 5, `upgrade` (issue 36): how long a guest's fault waits while `uffd-pager serve` is
//! upgraded under it. The real binaries run as a service manager runs them: a keeper
//! (`uffd-pager keeper`) for the whole bench, and `uffd-pager serve --mem-file … --keeper …`
//! started, then stopped with SIGTERM and started again. The bench process plays Firecracker
//! (`ram::FirecrackerVm`: private anonymous RAM registered MISSING, the uffd handed over in
//! Firecracker's handshake) and one thread reads a byte of every page of its region, a little
//! slowly (a pause of 3 ms every 64 pages, a pass of about a second), timing each read.
//!
//! Each round measures two passes over fresh RAM: `baseline`, no restart; `upgrade`, with the
//! server upgraded once a quarter of the pages are read: SIGTERM, its exit, the new server's
//! start up to its `listening` line. The figure that matters is the longest single read of
//! the pass: a fault that waited for the next server.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::common::results::Results;
use crate::ram::{self, FirecrackerVm, PAGE};
use crate::Res;

/// How long any step may take before the bench gives up (a frozen guest).
const PATIENCE: Duration = Duration::from_secs(30);

/// The processes of the part.
pub struct Setup {
    pub bin: PathBuf,
    pub dir: PathBuf,
    pub mem_file: PathBuf,
    /// Bytes of the region each pass reads.
    pub len: usize,
    /// The sum of the first byte of each of its pages in the image: what a pass must read.
    expected: u64,
    keeper: Child,
}

impl Setup {
    /// Starts the keeper in `dir`.
    pub fn start(bin: &Path, dir: &Path, mem_file: &Path, len: usize) -> Res<Self> {
        std::fs::create_dir_all(dir)?;
        let mut image = vec![0u8; len];
        std::io::Read::read_exact(&mut std::fs::File::open(mem_file)?, &mut image)?;
        let expected = image.iter().step_by(PAGE).map(|&b| u64::from(b)).sum();
        let keeper = listening(
            Command::new(bin)
                .args(["keeper", "--socket"])
                .arg(dir.join("keeper.sock")),
            &dir.join("keeper.log"),
        )?;
        Ok(Self {
            bin: bin.to_path_buf(),
            dir: dir.to_path_buf(),
            mem_file: mem_file.to_path_buf(),
            len,
            expected,
            keeper,
        })
    }

    fn server(&self) -> Res<Child> {
        listening(
            Command::new(&self.bin)
                .args(["serve", "--socket"])
                .arg(self.dir.join("uffd.sock"))
                .arg("--mem-file")
                .arg(&self.mem_file)
                .arg("--keeper")
                .arg(self.dir.join("keeper.sock")),
            &self.dir.join("server.log"),
        )
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = self.keeper.kill();
        let _ = self.keeper.wait();
    }
}

/// Spawns `command`, which prints its socket's path once it listens; returns when it has.
fn listening(command: &mut Command, log: &Path) -> Res<Child> {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log)?)
        .spawn()?;
    let mut line = String::new();
    let stdout = child.stdout.take().ok_or("no stdout")?;
    BufReader::new(stdout).read_line(&mut line)?;
    if line.is_empty() {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!(
            "{command:?} did not start: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        )
        .into());
    }
    Ok(child)
}

/// SIGTERM to `server`, then its exit (within [`PATIENCE`]); an error if it failed.
fn upgrade_stop(mut server: Child) -> Res<()> {
    let pid = libc::pid_t::try_from(server.id())?;
    // SAFETY: kill has no memory-safety preconditions; `server` is our child, not reaped yet,
    // so its pid is not reused.
    if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
        return Err(format!("SIGTERM to the server: {}", std::io::Error::last_os_error()).into());
    }
    // `wait` blocks in the kernel until the exit: no polling delay in the figure.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(server.wait());
    });
    let status = rx
        .recv_timeout(PATIENCE)
        .map_err(|_| "the server did not exit on SIGTERM")??;
    if !status.success() {
        return Err(format!("the upgraded server exited with {status}").into());
    }
    Ok(())
}

/// One pass over the region; with `upgrade`, the server is upgraded a quarter of the way in.
/// Puts `upgrade.CASE.*` for `run`.
fn pass(setup: &Setup, upgrade: bool, run: usize, results: &mut Results) -> Res<()> {
    let case = if upgrade { "upgrade" } else { "baseline" };
    let key = |q: &str| format!("upgrade.{case}.{q}");
    let pages = setup.len / PAGE;
    ram::recycle(setup.len + setup.len / 8)?;
    let mut server = Some(setup.server()?);
    let vm = FirecrackerVm::new(setup.len, false)?;
    let _stream = vm.connect(&setup.dir.join("uffd.sock"))?;
    let progress = AtomicU64::new(0);
    let (longest_ns, sum, elapsed) = std::thread::scope(|scope| -> Res<(u64, u64, Duration)> {
        let reader = scope.spawn(|| {
            let (mut longest, mut sum) = (0u64, 0u64);
            let started = Instant::now();
            for page in 0..pages {
                let read = Instant::now();
                sum += u64::from(vm.map.read(page * PAGE));
                longest = longest.max(u64::try_from(read.elapsed().as_nanos()).unwrap_or(u64::MAX));
                progress.store(page as u64 + 1, Ordering::Relaxed);
                if page % 64 == 63 {
                    std::thread::sleep(Duration::from_millis(3));
                }
            }
            (longest, sum, started.elapsed())
        });
        if upgrade {
            let deadline = Instant::now() + PATIENCE;
            while progress.load(Ordering::Relaxed) < pages as u64 / 4 {
                if Instant::now() > deadline {
                    return Err("the pass does not progress".into());
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            let started = Instant::now();
            upgrade_stop(server.take().ok_or("no server")?)?;
            results.put(&key("exit_ms"), "ms", run, ms(started));
            server = Some(setup.server()?);
            results.put(&key("listening_ms"), "ms", run, ms(started));
        }
        reader
            .join()
            .map_err(|_| "the reading thread panicked".into())
    })?;
    if let Some(mut server) = server {
        let _ = server.kill();
        let _ = server.wait();
    }
    if sum != setup.expected {
        return Err(format!(
            "{case}: the guest read other bytes than the image's: {}",
            setup.log()
        )
        .into());
    }
    results.put(&key("longest_read_ms"), "ms", run, longest_ns as f64 / 1e6);
    results.put(&key("pass_ms"), "ms", run, elapsed.as_secs_f64() * 1e3);
    Ok(())
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// Both passes, in an order that alternates with `run`.
pub fn round(run: usize, setup: &Setup, results: &mut Results) -> Res<()> {
    let order = if run.is_multiple_of(2) {
        [false, true]
    } else {
        [true, false]
    };
    for upgrade in order {
        pass(setup, upgrade, run, results)?;
    }
    Ok(())
}
