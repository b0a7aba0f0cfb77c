//! The VMs this bench process runs itself through `vmm::vm::Vm`, one at a time (PSS is
//! process-wide: the bench process is the VM process, like `pvisor run`).
//!
//! Every case is a fresh 512 MiB VM with a fresh disk file and store directory:
//! - `base`: fill, digest, then `task` (the never-offloaded baseline), then `touch` of the
//!   application data on the warm VM;
//! - `CODEC-lazy|eager`: fill, digest, offload, then resume and `task`, timed from the resume
//!   call to the end of the task;
//! - `touch-CODEC-lazy|eager`: the same offload and resume, then `touch` of the application
//!   data (timed from the resume call), then `task` on the now resident VM;
//! - `huge-base`, `huge-CODEC-lazy|eager`: `base` and `CODEC-lazy|eager` on RAM of 2 MiB huge
//!   pages (`--vm-ram-backing hugetlb`);
//! - `thp-raw-eager`: `raw-eager` with the RAM that came back remapped with transparent huge
//!   pages before the task (`--vm-thp-collapse`; the collapse is part of the resume);
//! - `floor-CODEC`: the same offload, then no resume: the floor a load cannot go under on this
//!   host, in two timed parts. Every stored block is read from the store, out of the page cache,
//!   through the pager's own reader (its read path, checksums and decoding), into one block
//!   buffer; then as many bytes are installed with `UFFDIO_COPY`, block by block from that
//!   buffer, into fresh anonymous memory registered on a userfaultfd of this process (no guest,
//!   so no re-entry).

use std::fs;
use std::path::Path;
use std::time::Instant;

use uffd_pager::metrics::MetricsSnapshot;
use uffd_pager::pager::RamKind;
use vmm::script;
use vmm::vm::{Vm, VmOptions};

use crate::results::Results;
use crate::{Codec, Content, Res, Settings, MIB};

/// A kind of VM run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    Base,
    Resume {
        codec: Codec,
        eager: bool,
    },
    Touch {
        codec: Codec,
        eager: bool,
    },
    /// `Base` on huge-page RAM.
    HugeBase,
    /// `Resume` on huge-page RAM.
    HugeResume {
        codec: Codec,
        eager: bool,
    },
    /// A raw offload, an eager resume and `MADV_COLLAPSE` of what came back.
    Thp,
    /// An offload, then the floor of loading it back: a cold read and an install, timed apart.
    Floor {
        codec: Codec,
    },
}

impl Case {
    pub fn name(self) -> String {
        let mode = |eager: bool| if eager { "eager" } else { "lazy" };
        match self {
            Case::Base => "base".into(),
            Case::Resume { codec, eager } => format!("{}-{}", codec.name(), mode(eager)),
            Case::Touch { codec, eager } => format!("touch-{}-{}", codec.name(), mode(eager)),
            Case::HugeBase => "huge-base".into(),
            Case::HugeResume { codec, eager } => {
                format!("huge-{}-{}", codec.name(), mode(eager))
            }
            Case::Thp => "thp-raw-eager".into(),
            Case::Floor { codec } => format!("floor-{}", codec.name()),
        }
    }

    /// The RAM it runs on.
    pub fn ram(self) -> RamKind {
        match self {
            Case::HugeBase | Case::HugeResume { .. } => RamKind::Hugetlb,
            _ => RamKind::Anon,
        }
    }
}

/// Every case of one content, in the order of run 0.
pub const CASES: [Case; 18] = [
    Case::Base,
    Case::Resume {
        codec: Codec::Raw,
        eager: false,
    },
    Case::Resume {
        codec: Codec::Lz4,
        eager: false,
    },
    Case::Touch {
        codec: Codec::Raw,
        eager: false,
    },
    Case::Resume {
        codec: Codec::Raw,
        eager: true,
    },
    Case::Resume {
        codec: Codec::Zstd,
        eager: false,
    },
    Case::Touch {
        codec: Codec::Lz4,
        eager: false,
    },
    Case::Resume {
        codec: Codec::Lz4,
        eager: true,
    },
    Case::Touch {
        codec: Codec::Raw,
        eager: true,
    },
    Case::Touch {
        codec: Codec::Lz4,
        eager: true,
    },
    Case::HugeBase,
    Case::HugeResume {
        codec: Codec::Raw,
        eager: false,
    },
    Case::HugeResume {
        codec: Codec::Lz4,
        eager: false,
    },
    Case::HugeResume {
        codec: Codec::Raw,
        eager: true,
    },
    Case::HugeResume {
        codec: Codec::Lz4,
        eager: true,
    },
    Case::Thp,
    Case::Floor { codec: Codec::Raw },
    Case::Floor { codec: Codec::Lz4 },
];

fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

fn ms(started: Instant) -> f64 {
    started.elapsed().as_secs_f64() * 1e3
}

/// Runs one case and records its figures under `vm.CONTENT.CASE.*`.
pub fn run_case(
    settings: &Settings,
    dir: &Path,
    content: Content,
    case: Case,
    run: usize,
    results: &mut Results,
) -> Res<()> {
    let name = case.name();
    let key = |quantity: &str| format!("vm.{}.{name}.{quantity}", content.name());
    let mut put = |quantity: &str, unit: &'static str, value: f64| {
        results.put(&key(quantity), unit, run, value);
    };
    let codec = match case {
        Case::Base | Case::HugeBase | Case::Thp => Codec::Raw,
        Case::Resume { codec, .. }
        | Case::Touch { codec, .. }
        | Case::HugeResume { codec, .. }
        | Case::Floor { codec } => codec,
    };
    let store_dir = dir.join(format!("store-{}-{name}", content.name()));
    let disk = dir.join(format!("disk-{}-{name}.img", content.name()));
    let _ = fs::remove_dir_all(&store_dir);
    let _ = fs::remove_file(&disk);
    let options = VmOptions {
        ram_compression: codec != Codec::Raw,
        ram_codec: codec.codec_name().into(),
        thp_collapse: case == Case::Thp,
        // Otherwise what `pvisor run` uses by default.
        ..VmOptions::new(settings.memory, case.ram(), disk.clone(), store_dir.clone())
    };
    let io_threads = options.io_threads.max(1);
    let mut vm = Vm::start(options)?;
    let fill = format!(
        "fill {} {} seed={}; digest",
        settings.app,
        content.name(),
        settings.seed
    );
    let out = vm.exec(&script::parse(&fill)?)?;
    let digest = out[1].digest.clone().ok_or("digest gave no digest")?;
    let running = vm.stats();
    put(
        "pss_running_mib",
        "MiB",
        mib(running.memory.process_pss_bytes),
    );
    put(
        "guest_pss_running_mib",
        "MiB",
        mib(running.memory.guest_ram_pss_bytes),
    );
    let task = script::parse("task")?;
    let touch = script::parse(&format!("touch {}", settings.app))?;
    let check = |out: &[vmm::machine::CommandOutput], what: &str| -> Res<()> {
        match out.first().and_then(|o| o.digest.as_deref()) {
            Some(d) if d == digest => Ok(()),
            other => Err(format!(
                "{}/{name}: {what}: digest {other:?}, expected {digest}: the data changed",
                content.name()
            )
            .into()),
        }
    };

    let (eager, touch_first) = match case {
        Case::Base | Case::HugeBase => {
            crate::settle();
            let started = Instant::now();
            let out = vm.exec(&task)?;
            put("task_ms", "ms", ms(started));
            check(&out, "task")?;
            let started = Instant::now();
            let out = vm.exec(&touch)?;
            put("touch_ms", "ms", ms(started));
            put("touch_cmd_ms", "ms", out[0].elapsed_ms);
            drop(vm);
            let _ = fs::remove_file(&disk);
            return Ok(());
        }
        Case::Resume { eager, .. } | Case::HugeResume { eager, .. } => (eager, false),
        Case::Thp | Case::Floor { .. } => (true, false),
        Case::Touch { eager, .. } => (eager, true),
    };

    crate::settle();
    let suspend = vm.suspend(true, None)?;
    let offload = suspend.offload.ok_or("suspend --offload did no offload")?;
    put("offload_ms", "ms", suspend.elapsed_ms);
    put("offload_write_ms", "ms", offload.write_ms);
    put("offload_drop_ms", "ms", offload.drop_ms);
    put("offload_pages", "pages", offload.pages_dropped as f64);
    let offloaded = vm.stats();
    put(
        "pss_offloaded_mib",
        "MiB",
        mib(offloaded.memory.process_pss_bytes),
    );
    put(
        "guest_pss_offloaded_mib",
        "MiB",
        mib(offloaded.memory.guest_ram_pss_bytes),
    );
    put("backing_mib", "MiB", mib(offloaded.backing_disk_bytes));
    put(
        "store_cached_mib",
        "MiB",
        mib(testkit::page_cache::cached_bytes(&store_dir)),
    );
    let before = offloaded.pager;
    if let Case::Floor { .. } = case {
        let reader = vm
            .machine()
            .pager()
            .store_reader()
            .ok_or("the offload left the pager no store to read")?;
        floor(&reader, &store_dir, io_threads, &key, run, results)?;
        drop(vm);
        let _ = fs::remove_dir_all(&store_dir);
        let _ = fs::remove_file(&disk);
        return Ok(());
    }

    crate::settle();
    let started = Instant::now();
    let resume = vm.resume(eager)?;
    put("resume_ms", "ms", resume.elapsed_ms);
    if let Some(collapse) = &resume.collapse {
        put("collapse_ms", "ms", collapse.elapsed_ms);
        put("collapsed_mib", "MiB", collapse.huge_pages as f64 * 2.0);
    }
    if let Some(load) = &resume.load {
        put("load_blocks", "blocks", load.blocks as f64);
    }
    if touch_first {
        let out = vm.exec(&touch)?;
        put("resume_touch_ms", "ms", ms(started));
        put("touch_cmd_ms", "ms", out[0].elapsed_ms);
        faults(&mut put, &before, &vm.stats().pager);
        let started = Instant::now();
        let out = vm.exec(&task)?;
        put("task_after_touch_ms", "ms", ms(started));
        check(&out, "task after touch")?;
    } else {
        let out = vm.exec(&task)?;
        put("resume_task_ms", "ms", ms(started));
        put("task_cmd_ms", "ms", out[0].elapsed_ms);
        check(&out, "task after resume")?;
        faults(&mut put, &before, &vm.stats().pager);
    }
    // The prefetcher of a lazy load may still be running; let it finish before the VM goes.
    vm.machine().pager().wait_prefetch();
    let after = vm.stats();
    put(
        "pss_resumed_mib",
        "MiB",
        mib(after.memory.process_pss_bytes),
    );
    if after.fault_errors > 0 {
        return Err(format!(
            "{}/{name}: {} fault errors",
            content.name(),
            after.fault_errors
        )
        .into());
    }
    drop(vm);
    let _ = fs::remove_dir_all(&store_dir);
    let _ = fs::remove_file(&disk);
    Ok(())
}

/// What a floor thread does with one block: (block, offset in the install target, a buffer of
/// the block's length).
type BlockWork<'a> = dyn Fn(u64, usize, &mut [u8]) -> Result<(), String> + Sync + 'a;

/// The floor of loading an offloaded VM back, measured on its own store with as many threads
/// as the VM's load uses (`io_threads`, taking blocks in ascending order from one counter, as
/// the eager load does), in two phases: `floor_read_ms`, every stored block read cold through
/// the pager's reader (its read path, checksums and decoding) into a block buffer per thread,
/// then `floor_install_ms`, as many bytes installed with `UFFDIO_COPY` from such a buffer into
/// fresh registered anonymous memory. Blocks stored as zeros are left out of both (a load maps
/// nothing for them).
fn floor(
    reader: &compressed_backing::StoreReader,
    store_dir: &Path,
    threads: usize,
    key: &dyn Fn(&str) -> String,
    run: usize,
    results: &mut Results,
) -> Res<()> {
    let mut put = |quantity: &str, unit: &'static str, value: f64| {
        results.put(&key(quantity), unit, run, value);
    };
    use compressed_backing::BlockKind;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use uffd_pager::addr::{HostAddr, HostRange};
    use uffd_pager::uffd::{Mode, Userfaultfd};

    let image = reader.image_size();
    let block_size = reader.block_size();
    let len = |b: u64| block_size.len_in_image(b, image);
    // (block, offset in the install target) of every block holding data.
    let mut blocks = Vec::new();
    let mut total = 0usize;
    for b in 0..image.div_ceil(block_size.bytes_u64()) {
        if !matches!(reader.kind(b), None | Some(BlockKind::Zero)) {
            blocks.push((b, total));
            total += len(b);
        }
    }
    if total == 0 {
        return Err("the offload stored no data".into());
    }
    // Each of `threads` workers takes the next block from one counter until none is left.
    let in_parallel = |work: &BlockWork<'_>| -> Res<f64> {
        let next = AtomicUsize::new(0);
        let started = Instant::now();
        let outcomes: Vec<Result<(), String>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| -> Result<(), String> {
                        let mut buf = vec![0u8; block_size.bytes()];
                        while let Some(&(b, at)) = blocks.get(next.fetch_add(1, Ordering::Relaxed))
                        {
                            work(b, at, &mut buf[..len(b)])?;
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| {
                    w.join()
                        .unwrap_or_else(|_| Err("a floor thread panicked".into()))
                })
                .collect()
        });
        let elapsed = ms(started);
        outcomes.into_iter().collect::<Result<Vec<()>, String>>()?;
        Ok(elapsed)
    };

    testkit::page_cache::drop_cached(store_dir);
    put(
        "floor_store_cached_mib",
        "MiB",
        mib(testkit::page_cache::cached_bytes(store_dir)),
    );
    crate::settle();
    let read = in_parallel(&|b, _, buf| reader.get(b, buf).map(drop).map_err(|e| e.to_string()))?;
    put("floor_read_ms", "ms", read);

    let map = testkit::Mapping::try_anon(total)?;
    let range = HostRange::new(HostAddr::from_ptr(map.as_ptr()), total as u64)?;
    let uffd = Userfaultfd::create(0)?;
    // SAFETY: `map` outlives `uffd` (declared before it) and is touched only through it.
    unsafe { uffd.register(range, Mode::MISSING)? };
    let start = range.start().0;
    let install = in_parallel(&|_, at, buf| {
        uffd.copy(HostAddr(start + at as u64), buf, false)
            .map(drop)
            .map_err(|e| e.to_string())
    })?;
    put("floor_install_ms", "ms", install);
    put("floor_mib", "MiB", mib(total as u64));
    put("floor_blocks", "blocks", blocks.len() as f64);
    put("floor_threads", "threads", threads as f64);
    Ok(())
}

/// Pager counters between two snapshots.
fn faults(
    put: &mut dyn FnMut(&str, &'static str, f64),
    before: &MetricsSnapshot,
    after: &MetricsSnapshot,
) {
    let (a, b) = (after, before);
    for (name, unit, now, then) in [
        ("faults_copy", "faults", a.faults_copy, b.faults_copy),
        ("faults_zero", "faults", a.faults_zero, b.faults_zero),
        ("block_copies", "blocks", a.block_copies, b.block_copies),
        ("pages_copied", "pages", a.pages_copied, b.pages_copied),
        (
            "prefetch_pages",
            "pages",
            a.prefetch_pages,
            b.prefetch_pages,
        ),
        ("eexist_races", "faults", a.eexist_races, b.eexist_races),
    ] {
        put(name, unit, now.saturating_sub(then) as f64);
    }
    // The histogram is cumulative: the mean of the faults in between, from counts and means.
    let (n0, n1) = (before.fault_latency.count, after.fault_latency.count);
    if n1 > n0 {
        let total =
            after.fault_latency.mean_us * n1 as f64 - before.fault_latency.mean_us * n0 as f64;
        put("fault_mean_us", "µs", total / (n1 - n0) as f64);
    }
}
