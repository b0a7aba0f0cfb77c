//! One VM of the bench, in this process (PSS is process-wide: the bench process is the VM
//! process, as `pvisor run` is), from boot to the digest of its data:
//!
//! 1. boot (`Vm::start`) and `fill APP KIND seed=S; idle`;
//! 2. the idle period: every tick (250 ms) the cold-compression counters are read (to see
//!    when compression stops); in `hot-cold` the host first counts the pooled pages of the
//!    hot part, then runs `touch HOT; idle` (the hot part is read, then the guest reports
//!    idle again); every second the VM's memory is sampled; over the last seconds
//!    (`Settings::window`) the pager threads' CPU time is measured;
//! 3. at the end of the idle period: `Vm::stats` (the headline memory), the pager's CPU time
//!    since boot, which pages of the data are pooled;
//! 4. in `hot-cold`, `touch HOT` (is the hot part still fast?); then `touch APP` (all the
//!    data: brings every pooled block back), timed on the host, with the faults it took and the
//!    pager's CPU time during it; `Vm::stats` again; `digest`.
//!
//! Figures go under `CASE.VARIANT.QUANTITY`, the memory timeline under
//! `timeline.CASE.VARIANT.NN.QUANTITY` (sample NN, one per `Settings::sample`).

use std::fs;
use std::path::Path;
use std::time::Instant;

use basics::error_chain;
use uffd_pager::cold::ColdError;
use uffd_pager::pager::Pager;
use uffd_pager::state::PageState;
use vmm::guest::APP_BASE;
use vmm::script::Command;
use vmm::vm::{Vm, VmError, VmOptions, VmStats};

use crate::common::results::{Results, Summary};
use crate::common::Res;
use crate::cpu::{PagerCpu, Threads};
use crate::{Case, Settings, Variant, MIB};

const PAGE: u64 = 4096;

/// How one VM ended.
#[derive(Debug)]
pub enum Outcome {
    /// It ran; the digest of its data at the end.
    Done { digest: String },
    /// The pager refused cold compression on this RAM kind (the whole error chain).
    Unsupported(String),
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

fn ms(started: Instant) -> f64 {
    started.elapsed().as_secs_f64() * 1e3
}

/// The key of timeline sample `sample` (from 1, one per `Settings::sample`).
pub fn timeline(case: Case, variant: Variant, sample: usize, quantity: &str) -> String {
    format!(
        "timeline.{}.{}.{sample:02}.{quantity}",
        case.name(),
        variant.key
    )
}

/// Pages of `[start, end)` (image offsets) that are pooled.
fn pooled_pages(pager: &Pager, start: u64, end: u64) -> u64 {
    (start..end)
        .step_by(PAGE as usize)
        .filter(|&offset| pager.page_state(offset) == PageState::Pooled)
        .count() as u64
}

/// The pager threads' CPU time and the scanner's own counter at one moment.
#[derive(Debug, Clone, Copy)]
struct Mark {
    at: Instant,
    cpu: PagerCpu,
    scanner_counter_s: f64,
    compressed: u64,
}

fn mark(vm: &Vm, threads: &Threads) -> Mark {
    let cold = vm.machine().cold().map(uffd_pager::cold::Cold::stats);
    Mark {
        at: Instant::now(),
        cpu: threads.cpu(),
        scanner_counter_s: cold.as_ref().map_or(0.0, |c| c.scanner_cpu_seconds),
        compressed: cold.map_or(0, |c| c.blocks_compressed),
    }
}

/// Runs one VM of `case` as `variant` and records its figures for round `run`.
pub fn run_vm(
    settings: &Settings,
    dir: &Path,
    case: Case,
    variant: Variant,
    run: usize,
    results: &mut Results,
) -> Res<Outcome> {
    let name = format!("{}.{}", case.name(), variant.key);
    let key = |quantity: &str| format!("{name}.{quantity}");
    let disk = dir.join(format!("disk-{}-{}.img", case.name(), variant.key));
    let store_dir = dir.join(format!("store-{}-{}", case.name(), variant.key));
    let _ = fs::remove_file(&disk);
    let _ = fs::remove_dir_all(&store_dir);
    // The previous VM's freed buffers go back to the system first, so that they do not count
    // as this VM's memory.
    // SAFETY: malloc_trim only releases free memory of the allocator.
    unsafe { libc::malloc_trim(0) };
    let before = Threads::before();
    let booted = Instant::now();
    let started = Vm::start(VmOptions {
        cold: variant.cold.then_some(settings.cold),
        // Otherwise what `pvisor run` uses by default.
        ..VmOptions::new(
            settings.memory,
            variant.ram,
            disk.clone(),
            store_dir.clone(),
        )
    });
    let mut vm = match started {
        Ok(vm) => vm,
        Err(e @ VmError::Cold(ColdError::Unsupported { .. })) => {
            return Ok(Outcome::Unsupported(error_chain(&e)));
        }
        Err(e) => return Err(format!("{name}: cannot start the VM: {}", error_chain(&e)).into()),
    };
    results.put(&key("boot_ms"), "ms", run, ms(booted));
    let threads = Threads::born_since(&before);
    if !threads.found() {
        return Err(format!("{name}: no pager thread (uffd-fault-N) in /proc/self/task").into());
    }

    let fill = vm.exec(&[
        Command::Fill {
            size: settings.app,
            kind: case.fill(),
            seed: settings.seed,
        },
        Command::Idle,
    ])?;
    results.put(&key("fill_ms"), "ms", run, fill[0].elapsed_ms);
    let filled = vm.machine().pager().metrics().snapshot();

    let Idle {
        window,
        hot_ms,
        hot_pooled_max,
        converged_s,
        samples,
    } = idle(&mut vm, settings, case, variant, &threads, run, results)?;

    // The end of the idle period: the last sample of the timeline.
    let end = mark(&vm, &threads);
    let stats = vm.stats();
    let last = settings.samples().max(samples + 1);
    results.put(
        &timeline(case, variant, last, "memory_mib"),
        "MiB",
        run,
        mib(stats.memory.process_memory_bytes),
    );
    let wall = end.at.duration_since(window.at).as_secs_f64();
    let idle_cpu = end.cpu.since(window.cpu);
    results.put(
        &key("idle_cpu_pct"),
        "% of a core",
        run,
        idle_cpu.total_s() / wall * 100.0,
    );
    results.put(
        &key("idle_scanner_pct"),
        "% of a core",
        run,
        idle_cpu.scanner_s / wall * 100.0,
    );
    results.put(
        &key("idle_fault_threads_pct"),
        "% of a core",
        run,
        idle_cpu.faults_s / wall * 100.0,
    );
    let minor = stats.pager.faults_minor.saturating_sub(filled.faults_minor) as f64;
    results.put(&key("idle_faults_minor"), "faults", run, minor);
    if !hot_ms.is_empty() {
        let passes = hot_ms.len() as f64;
        results.put(
            &key("hot_touch_minor_faults"),
            "faults",
            run,
            minor / passes,
        );
        if let Some(cold) = &stats.cold {
            // Nothing is pooled before the idle period: every promotion happened in it.
            results.put(
                &key("hot_touch_promotions"),
                "blocks",
                run,
                cold.promotions as f64 / passes,
            );
        }
    }
    results.put(&key("pager_cpu_s"), "s", run, end.cpu.total_s());
    results.put(&key("scanner_thread_cpu_s"), "s", run, end.cpu.scanner_s);
    results.put(&key("fault_threads_cpu_s"), "s", run, end.cpu.faults_s);
    memory(&key, &stats, "", run, results);
    if let Some(cold) = &stats.cold {
        results.put(
            &timeline(case, variant, last, "pooled_mib"),
            "MiB",
            run,
            mib(cold.pooled_pages * PAGE),
        );
        results.put(&key("converged_s"), "s", run, converged_s);
        results.put(
            &key("idle_scanner_counter_pct"),
            "% of a core",
            run,
            (end.scanner_counter_s - window.scanner_counter_s) / wall * 100.0,
        );
        results.put(
            &key("window_compressed"),
            "blocks",
            run,
            (end.compressed - window.compressed) as f64,
        );
        results.put(&key("scanner_cpu_s"), "s", run, cold.scanner_cpu_seconds);
        for (quantity, value) in [
            ("scans", cold.scans),
            ("blocks_probed", cold.blocks_probed),
            ("blocks_compressed", cold.blocks_compressed),
            ("incompressible", cold.incompressible),
            ("touched_after_probe", cold.touched_after_probe),
            ("raced", cold.raced),
            ("promotions", cold.promotions),
            ("thrash_promotions", cold.thrash_promotions),
            ("hot_blocks", cold.hot_blocks),
            ("pool_full_refusals", cold.pool_full_refusals),
        ] {
            results.put(&key(quantity), "count", run, value as f64);
        }
        results.put(
            &key("pooled_mib"),
            "MiB",
            run,
            mib(cold.pooled_pages * PAGE),
        );
        results.put(&key("pool_held_mib"), "MiB", run, mib(cold.pool.held_bytes));
        results.put(
            &key("pool_stored_mib"),
            "MiB",
            run,
            mib(cold.pool.stored_bytes),
        );
        results.put(
            &key("tracking_kib"),
            "KiB",
            run,
            cold.tracking_bytes as f64 / 1024.0,
        );
        results.put(
            &key("net_saving_mib"),
            "MiB",
            run,
            cold.net_saving_bytes as f64 / MIB as f64,
        );
    }
    let pager = vm.machine().pager();
    let (app_start, app_end) = (APP_BASE, APP_BASE + settings.app);
    results.put(
        &key("app_pooled_mib"),
        "MiB",
        run,
        mib(pooled_pages(pager, app_start, app_end) * PAGE),
    );
    if case.hot() {
        let hot_end = app_start + settings.hot;
        results.put(
            &key("hot_pooled_mib"),
            "MiB",
            run,
            mib(pooled_pages(pager, app_start, hot_end) * PAGE),
        );
        results.put(
            &key("hot_pooled_max_mib"),
            "MiB",
            run,
            mib(hot_pooled_max.max(pooled_pages(pager, app_start, hot_end)) * PAGE),
        );
        results.put(
            &key("cold_part_pooled_mib"),
            "MiB",
            run,
            mib(pooled_pages(pager, hot_end, app_end) * PAGE),
        );
        if let Some(s) = Summary::of(hot_ms) {
            results.put(&key("hot_touch_idle_ms"), "ms", run, s.median);
            results.put(&key("hot_touch_idle_max_ms"), "ms", run, s.max);
        }
        let t = Instant::now();
        vm.exec(&[Command::Touch { size: settings.hot }])?;
        results.put(&key("hot_touch_ms"), "ms", run, ms(t));
    }

    // Every byte of the data, pooled or not.
    let metrics = vm.machine().pager().metrics().snapshot();
    let promotions = vm
        .machine()
        .cold()
        .map(uffd_pager::cold::Cold::stats)
        .map(|c| c.promotions);
    let cpu = threads.cpu();
    let t = Instant::now();
    vm.exec(&[Command::Touch { size: settings.app }])?;
    results.put(&key("touch_ms"), "ms", run, ms(t));
    let spent = threads.cpu().since(cpu);
    let after = vm.stats();
    results.put(&key("touch_pager_cpu_ms"), "ms", run, spent.total_s() * 1e3);
    let delta = |a: u64, b: u64| a.saturating_sub(b) as f64;
    results.put(
        &key("touch_faults_minor"),
        "faults",
        run,
        delta(after.pager.faults_minor, metrics.faults_minor),
    );
    results.put(
        &key("touch_faults_copy"),
        "faults",
        run,
        delta(after.pager.faults_copy, metrics.faults_copy),
    );
    results.put(
        &key("touch_decompressed_mib"),
        "MiB",
        run,
        delta(after.pager.bytes_decompressed, metrics.bytes_decompressed) / MIB as f64,
    );
    if let (Some(before), Some(cold)) = (promotions, &after.cold) {
        results.put(
            &key("touch_promotions"),
            "blocks",
            run,
            delta(cold.promotions, before),
        );
    }
    memory(&key, &after, "after_touch_", run, results);

    let out = vm.exec(&[Command::Digest])?;
    let digest = out
        .first()
        .and_then(|o| o.digest.clone())
        .ok_or_else(|| format!("{name}: digest gave no digest"))?;
    let errors = vm.stats().fault_errors;
    if errors > 0 {
        return Err(format!("{name}: {errors} guest faults could not be served").into());
    }
    results.put(&key("vm_s"), "s", run, booted.elapsed().as_secs_f64());
    drop(vm);
    let _ = fs::remove_file(&disk);
    let _ = fs::remove_dir_all(&store_dir);
    Ok(Outcome::Done { digest })
}

/// The memory figures of `stats` under `PREFIX…`.
fn memory(
    key: &dyn Fn(&str) -> String,
    stats: &VmStats,
    prefix: &str,
    run: usize,
    results: &mut Results,
) {
    for (quantity, bytes) in [
        ("memory_mib", stats.memory.process_memory_bytes),
        ("pss_mib", stats.memory.process_pss_bytes),
        ("guest_pss_mib", stats.memory.guest_ram_pss_bytes),
        ("guest_resident_mib", stats.memory.guest_ram_resident_bytes),
        ("pool_mib", stats.pool_bytes),
    ] {
        results.put(&key(&format!("{prefix}{quantity}")), "MiB", run, mib(bytes));
    }
}

/// What the idle period saw.
#[derive(Debug)]
struct Idle {
    /// The start of the CPU window.
    window: Mark,
    /// The host's touches of the hot part, ms.
    hot_ms: Vec<f64>,
    /// The most pages of the hot part found pooled before one of them.
    hot_pooled_max: u64,
    /// When the last block was compressed, seconds into the idle period.
    converged_s: f64,
    /// Timeline samples taken.
    samples: usize,
}

/// The idle period.
fn idle(
    vm: &mut Vm,
    settings: &Settings,
    case: Case,
    variant: Variant,
    threads: &Threads,
    run: usize,
    results: &mut Results,
) -> Res<Idle> {
    let timeline = |sample: usize, quantity: &str| timeline(case, variant, sample, quantity);
    let hot_touch = [Command::Touch { size: settings.hot }, Command::Idle];
    let window_from = settings.idle.saturating_sub(settings.window);
    let started = Instant::now();
    let mut window: Option<Mark> = None;
    let mut hot_ms = Vec::new();
    let mut hot_pooled_max = 0;
    let mut compressed = 0;
    let mut converged_s = 0.0;
    let mut sample = 1;
    let mut tick: u32 = 0;
    loop {
        let now = started.elapsed();
        if now >= settings.idle {
            break;
        }
        if window.is_none() && now >= window_from {
            window = Some(mark(vm, threads));
        }
        if case.hot() {
            // Was any of the hot part pooled since the last pass (which brought all of it in)?
            let pooled = pooled_pages(vm.machine().pager(), APP_BASE, APP_BASE + settings.hot);
            hot_pooled_max = hot_pooled_max.max(pooled);
            let t = Instant::now();
            vm.exec(&hot_touch)?;
            hot_ms.push(ms(t));
        }
        if let Some(cold) = vm.machine().cold().map(uffd_pager::cold::Cold::stats) {
            if cold.blocks_compressed > compressed {
                compressed = cold.blocks_compressed;
                converged_s = started.elapsed().as_secs_f64();
            }
        }
        if started.elapsed() >= settings.sample * sample as u32 {
            let stats = vm.stats();
            results.put(
                &timeline(sample, "memory_mib"),
                "MiB",
                run,
                mib(stats.memory.process_memory_bytes),
            );
            if let Some(cold) = &stats.cold {
                results.put(
                    &timeline(sample, "pooled_mib"),
                    "MiB",
                    run,
                    mib(cold.pooled_pages * PAGE),
                );
            }
            sample += 1;
        }
        tick += 1;
        let next = (settings.tick * tick).min(settings.idle);
        if let Some(wait) = next.checked_sub(started.elapsed()) {
            std::thread::sleep(wait);
        }
    }
    Ok(Idle {
        window: window.ok_or("the idle period ended before its CPU window began")?,
        hot_ms,
        hot_pooled_max,
        converged_s,
        samples: sample - 1,
    })
}
