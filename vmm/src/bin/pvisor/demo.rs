//! `pvisor demo`: the README's main job. Boots a VM, fills application data, and shows what
//! it costs resident, after an offload and after a compressed offload, with the data checked
//! after each resume.

use std::process::ExitCode;
use std::time::Instant;

use basics::{format_bytes, parse_size};
use clap::Args;
use uffd_pager::pager::RamKind;
use vmm::script;
use vmm::vm::{Vm, VmOptions};

use crate::CliResult;

/// Options of `pvisor demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Guest RAM.
    #[arg(long, default_value = "512MiB", value_parser = parse_size)]
    memory: u64,
    /// Application data to fill.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    app: u64,
}

struct Row {
    content: &'static str,
    state: String,
    /// `memory_charged_bytes`.
    charged: u64,
    guest: u64,
    backing: Option<u64>,
    check: String,
}

pub fn demo(args: &DemoArgs) -> CliResult {
    let dir = std::env::temp_dir().join(format!("pvisor-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = rows(args, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    let rows = result?;
    basics::say!(
        "pvisor demo: a {} VM with {} of application data (one VM at a time, this process)",
        format_bytes(args.memory),
        format_bytes(args.app)
    );
    basics::say!();
    basics::say!(
        "{:<9} {:<22} {:>12} {:>14} {:>12}  after resume",
        "content",
        "state",
        "charged",
        "guest RAM PSS",
        "backing"
    );
    let mut all_ok = true;
    for row in &rows {
        all_ok &= !row.check.contains("DIFFERS");
        basics::say!(
            "{:<9} {:<22} {:>12} {:>14} {:>12}  {}",
            row.content,
            row.state,
            format_bytes(row.charged),
            format_bytes(row.guest),
            row.backing.map_or_else(|| "-".to_owned(), format_bytes),
            row.check
        );
    }
    basics::say!();
    basics::say!(
        "charged: what the host is charged for the VM (here, in no memory cgroup, this process's \
         PSS with guest RAM counted as resident; in one, its usage); guest RAM PSS: that mapping's \
         PSS alone; backing: the offload store's allocated bytes."
    );
    Ok(if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn rows(args: &DemoArgs, dir: &std::path::Path) -> Result<Vec<Row>, Box<dyn std::error::Error>> {
    let mut rows = Vec::new();
    for content in ["repeated", "random"] {
        for compression in [false, true] {
            let mut vm = Vm::start(VmOptions {
                ram_compression: compression,
                io_threads: 2,
                ..VmOptions::new(
                    args.memory,
                    RamKind::Anon,
                    dir.join("disk.img"),
                    dir.join(format!("ram-{content}-{compression}")),
                )
            })?;
            let fill = format!("fill {} {content} seed=1; digest", args.app);
            let out = vm.exec(&script::parse(&fill)?)?;
            let digest = out[1].digest.clone().unwrap_or_default();
            // The never-offloaded task, for comparison.
            let task = vm.exec(&script::parse("task")?)?[0].elapsed_ms;
            let resident = vm.stats();
            if !compression {
                rows.push(Row {
                    content,
                    state: "running (default)".into(),
                    charged: resident.memory.memory_charged_bytes,
                    guest: resident.memory.guest_ram_pss_bytes,
                    backing: None,
                    check: format!("task {task:.0} ms"),
                });
            }
            let suspend = vm.suspend(true, None)?;
            let offloaded = vm.stats();
            let started = Instant::now();
            vm.resume(false)?;
            let after = vm.exec(&script::parse("task")?)?;
            let resume_task = started.elapsed().as_secs_f64() * 1e3;
            let same = after[0].digest.as_deref() == Some(digest.as_str());
            rows.push(Row {
                content,
                state: format!(
                    "offloaded ({}, {:.0} ms)",
                    if compression { "lz4" } else { "raw" },
                    suspend.elapsed_ms
                ),
                charged: offloaded.memory.memory_charged_bytes,
                guest: offloaded.memory.guest_ram_pss_bytes,
                backing: Some(offloaded.backing_disk_bytes),
                check: format!(
                    "digest {}, resume + task {resume_task:.0} ms",
                    if same { "same" } else { "DIFFERS" }
                ),
            });
        }
    }
    Ok(rows)
}
