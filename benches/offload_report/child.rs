//! The measured offload, in a child process of its own (re-executed with `--offload-child`),
//! so that everything it allocates is charged to its memory cgroup: it joins the cgroup
//! first, maps the VM-shaped region, registers it with an in-process pager, writes the
//! touched chunks, syncs, says `ready`, waits for `go` (the parent sets the limit meanwhile),
//! times `Pager::offload_with`, prints its figures as one JSON line, waits for `check` (the
//! parent reads the cgroup's peak meanwhile), checks every touched byte and says `ok`.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Instant;

use compressed_backing::bulk::BulkOptions;
use compressed_backing::{Codec, CodecConfig};
use uffd_pager::addr::{HostAddr, HostRange};
use uffd_pager::offload::{Batching, OffloadConfig};
use uffd_pager::pager::{Pager, PagerConfig, RamKind, RegionSpec};

use crate::cgroup::MemCgroup;
use crate::common::{self, Res};

/// What the parent asks of a child.
#[derive(Debug, Clone)]
pub struct Case {
    pub codec: String,
    /// Image bytes per batch; `None`: one batch (the single-commit order).
    pub batch: Option<u64>,
    pub dir: PathBuf,
    pub cgroup: PathBuf,
    pub layout: Layout,
    pub threads: usize,
}

/// Where the touched data lies in the region.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub region: usize,
    pub chunk: usize,
    pub chunks: usize,
}

impl Layout {
    pub fn touched(&self) -> usize {
        self.chunk * self.chunks
    }

    fn offset(&self, i: usize) -> usize {
        let stride = self.region / self.chunks / self.chunk * self.chunk;
        i * stride
    }

    /// Four chunks in nine are random, the others compress well.
    fn fill(&self, i: usize, out: &mut [u8]) {
        if i % 9 >= 5 {
            let random = common::random(out.len(), common::RANDOM_SEED ^ i as u64);
            out.copy_from_slice(&random);
        } else {
            let motif = common::motif();
            for (j, b) in out.iter_mut().enumerate() {
                *b = motif[j % 64] ^ (i as u8) ^ ((j / 4096) as u8);
            }
        }
    }
}

/// What the child measured.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    pub ms: f64,
    pub write_ms: f64,
    pub drop_ms: f64,
    pub batches: u64,
    pub pages_dropped: u64,
    pub stored_bytes: u64,
}

impl Case {
    /// The case as environment variables of the child.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("OFFLOAD_CHILD_CODEC", self.codec.clone()),
            (
                "OFFLOAD_CHILD_BATCH",
                self.batch.map_or("whole".to_owned(), |b| b.to_string()),
            ),
            ("OFFLOAD_CHILD_DIR", self.dir.display().to_string()),
            ("OFFLOAD_CHILD_CGROUP", self.cgroup.display().to_string()),
            ("OFFLOAD_CHILD_REGION", self.layout.region.to_string()),
            ("OFFLOAD_CHILD_CHUNK", self.layout.chunk.to_string()),
            ("OFFLOAD_CHILD_CHUNKS", self.layout.chunks.to_string()),
            ("OFFLOAD_CHILD_THREADS", self.threads.to_string()),
        ]
    }

    fn from_env() -> Res<Self> {
        let var = |name: &str| std::env::var(name).map_err(|e| format!("{name}: {e}"));
        let number = |name: &str| -> Res<usize> { Ok(var(name)?.parse()?) };
        let batch = var("OFFLOAD_CHILD_BATCH")?;
        Ok(Self {
            codec: var("OFFLOAD_CHILD_CODEC")?,
            batch: if batch == "whole" {
                None
            } else {
                Some(batch.parse()?)
            },
            dir: PathBuf::from(var("OFFLOAD_CHILD_DIR")?),
            cgroup: PathBuf::from(var("OFFLOAD_CHILD_CGROUP")?),
            layout: Layout {
                region: number("OFFLOAD_CHILD_REGION")?,
                chunk: number("OFFLOAD_CHILD_CHUNK")?,
                chunks: number("OFFLOAD_CHILD_CHUNKS")?,
            },
            threads: number("OFFLOAD_CHILD_THREADS")?,
        })
    }
}

impl Outcome {
    fn to_json(self) -> String {
        serde_json::json!({
            "ms": self.ms,
            "write_ms": self.write_ms,
            "drop_ms": self.drop_ms,
            "batches": self.batches,
            "pages_dropped": self.pages_dropped,
            "stored_bytes": self.stored_bytes,
        })
        .to_string()
    }

    /// Parses the child's last line.
    pub fn from_json(line: &str) -> Res<Self> {
        let value: serde_json::Value = serde_json::from_str(line)?;
        let f = |key: &str| {
            value[key]
                .as_f64()
                .ok_or_else(|| format!("{key} missing in {line}"))
        };
        let u = |key: &str| {
            value[key]
                .as_u64()
                .ok_or_else(|| format!("{key} missing in {line}"))
        };
        Ok(Self {
            ms: f("ms")?,
            write_ms: f("write_ms")?,
            drop_ms: f("drop_ms")?,
            batches: u("batches")?,
            pages_dropped: u("pages_dropped")?,
            stored_bytes: u("stored_bytes")?,
        })
    }
}

/// The VM's RAM: a private anonymous mapping (unmapped on drop, after the pager).
struct Region(testkit::Mapping);

impl Region {
    fn range(&self) -> HostRange {
        HostRange::new(HostAddr::from_ptr(self.0.as_ptr()), self.0.len() as u64).expect("a mapping")
    }

    fn slice(&self, at: usize, len: usize) -> &[u8] {
        assert!(at + len <= self.0.len());
        // SAFETY: inside the live mapping; reading it faults through the pager.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().add(at), len) }
    }

    fn slice_mut(&mut self, at: usize, len: usize) -> &mut [u8] {
        assert!(at + len <= self.0.len());
        // SAFETY: inside the live mapping, borrowed mutably; nothing else in this process
        // holds a reference into it (the pager writes it only through the kernel).
        unsafe { std::slice::from_raw_parts_mut(self.0.as_ptr().add(at), len) }
    }
}

pub fn codec(name: &str) -> Res<Codec> {
    match name {
        "none" => Ok(Codec::None),
        "lz4" => Ok(Codec::Lz4),
        other => Err(format!("unknown codec {other}").into()),
    }
}

/// The child's `main`: the case comes in `OFFLOAD_CHILD_*` variables.
pub fn run() -> Res<()> {
    let case = Case::from_env()?;
    MemCgroup::join(&case.cgroup)?;
    let layout = case.layout;
    let mut region = Region(testkit::Mapping::anon(layout.region));
    let spec = RegionSpec {
        kind: RamKind::Anon,
        range: region.range(),
        image_offset: 0,
        memfd: None,
        memfd_offset: 0,
        view: Some(region.range().start()),
    };
    let on_error = Box::new(|e: &uffd_pager::pager::FaultError| {
        eprintln!("offload_report child: fault error: {e}");
        std::process::exit(1);
    });
    // SAFETY: `region` outlives the pager (declared before it, dropped after) and is only
    // touched through it.
    let pager = unsafe { Pager::new(vec![spec], PagerConfig::default(), None, on_error)? };
    for i in 0..layout.chunks {
        layout.fill(i, region.slice_mut(layout.offset(i), layout.chunk));
    }
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "ready")?;
    stdout.flush()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    if line.trim() != "go" {
        return Err(format!("expected go, got {line:?}").into());
    }
    let config = OffloadConfig {
        dir: case.dir.clone(),
        codec: CodecConfig::new(codec(&case.codec)?),
        bulk: BulkOptions::with_threads(case.threads),
        durability: compressed_backing::Durability::Process,
        direct_reads: true,
    };
    let batching = case.batch.map_or(Batching::WHOLE, Batching::of);
    let started = Instant::now();
    let report = pager.offload_with(&config, batching)?;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    let outcome = Outcome {
        ms,
        write_ms: report.write_ms,
        drop_ms: report.drop_ms,
        batches: report.batches,
        pages_dropped: report.pages_dropped,
        stored_bytes: report.stored_bytes,
    };
    writeln!(stdout, "{}", outcome.to_json())?;
    stdout.flush()?;
    // Untimed, once the parent has read the cgroup's peak: every page dropped, every byte
    // back.
    line.clear();
    std::io::stdin().lock().read_line(&mut line)?;
    if line.trim() != "check" {
        return Err(format!("expected check, got {line:?}").into());
    }
    let pages = (layout.touched() / 4096) as u64;
    if report.pages_dropped != pages {
        return Err(format!("{} pages dropped, {pages} written", report.pages_dropped).into());
    }
    let mut want = vec![0u8; layout.chunk];
    for i in 0..layout.chunks {
        layout.fill(i, &mut want);
        if region.slice(layout.offset(i), layout.chunk) != &want[..] {
            return Err(format!("chunk {i} differs after the offload").into());
        }
    }
    writeln!(stdout, "ok")?;
    stdout.flush()?;
    drop(pager);
    drop(region);
    std::fs::remove_dir_all(&case.dir)?;
    Ok(())
}
