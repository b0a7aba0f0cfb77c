//! Suspending a VM (a pause, or an offload of its RAM to the store), resuming it, taking a
//! snapshot of it, and the offloaded image shown as a plain file.

use std::path::{Path, PathBuf};
use std::time::Instant;

use compressed_backing::fuse::{self, FuseOptions, MountedStore};
use uffd_pager::load::{LoadMode, LoadReport};
use uffd_pager::offload::OffloadReport;
use uffd_pager::pager::RamKind;

use super::{Vm, VmError, VmState};
use crate::snapshot::{self, PrivateLoadReport, PrivateOffloadReport, SnapshotReport};

/// What `suspend` did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SuspendReport {
    /// The state now.
    pub state: VmState,
    /// The offload, when there was one (absent for a pause or an already offloaded VM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload: Option<OffloadReport>,
    /// For a VM restored from a snapshot: the offload of the pages it wrote.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub private_offload: Option<PrivateOffloadReport>,
    /// Wall time of the operation, milliseconds.
    pub elapsed_ms: f64,
}

/// What `resume` did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ResumeReport {
    /// The state now.
    pub state: VmState,
    /// The load, for an offloaded VM.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load: Option<LoadReport>,
    /// For a VM restored from a snapshot: the pages it wrote, put back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub private_load: Option<PrivateLoadReport>,
    /// With `thp_collapse`, after an eager load: the RAM remapped with huge pages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub collapse: Option<uffd_pager::load::Collapse>,
    /// Wall time of the operation, milliseconds.
    pub elapsed_ms: f64,
}

/// The offloaded image shown as a plain file: a read-only FUSE mount and a link to its file.
#[derive(Debug)]
pub(super) struct RamView {
    mounted: MountedStore,
    link: PathBuf,
}

impl RamView {
    pub(super) fn close(self) {
        let _ = std::fs::remove_file(&self.link);
        let mountpoint = self.mounted.mountpoint().to_path_buf();
        let _ = self.mounted.unmount();
        let _ = std::fs::remove_dir(mountpoint);
    }
}

pub(super) fn state_name(state: VmState) -> &'static str {
    match state {
        VmState::Running => "running",
        VmState::Paused => "paused",
        VmState::Offloaded => "offloaded",
    }
}

impl Vm {
    /// Pauses; with `offload`, also moves resident RAM to the store (idempotent: an
    /// offloaded VM stays as it is). A failed offload leaves the VM running with its memory.
    /// With `ram_file`, the offloaded image is then shown read-only as a plain file there
    /// (until the VM resumes).
    pub fn suspend(
        &mut self,
        offload: bool,
        ram_file: Option<&Path>,
    ) -> Result<SuspendReport, VmError> {
        if let Some(path) = ram_file {
            let ours = self.ram_view.as_ref().is_some_and(|v| v.link == path);
            if !offload {
                return Err(VmError::State("a RAM file needs --vm-offload".into()));
            }
            if !ours && std::fs::symlink_metadata(path).is_ok() {
                return Err(VmError::RamFile {
                    path: path.to_path_buf(),
                    reason: "it exists already".into(),
                });
            }
        }
        let report = self.suspend_inner(offload)?;
        if let Some(path) = ram_file {
            if self.ram_view.as_ref().is_none_or(|v| v.link != path) {
                self.show_ram(path)?;
            }
        }
        Ok(report)
    }

    /// Mounts the store's image read-only and links `path` to its file.
    fn show_ram(&mut self, path: &Path) -> Result<(), VmError> {
        let fail = |reason: String| VmError::RamFile {
            path: path.to_path_buf(),
            reason,
        };
        if let Some(view) = self.ram_view.take() {
            view.close();
        }
        let reader = self
            .machine
            .pager()
            .store_reader()
            .ok_or_else(|| fail("nothing was offloaded".into()))?;
        let mountpoint = self.options.store_dir.with_extension("view");
        compressed_backing::file::create_private_dir(&mountpoint)
            .map_err(|e| fail(basics::error_chain(&e)))?;
        let mounted = fuse::mount_reader(reader, &mountpoint, &FuseOptions::default())
            .map_err(|e| fail(basics::error_chain(&e)))?;
        if let Err(e) = std::os::unix::fs::symlink(mounted.file_path(), path) {
            let _ = mounted.unmount();
            return Err(fail(basics::error_chain(&e)));
        }
        self.ram_view = Some(RamView {
            mounted,
            link: path.to_path_buf(),
        });
        Ok(())
    }

    fn suspend_inner(&mut self, offload: bool) -> Result<SuspendReport, VmError> {
        let started = Instant::now();
        let report = |state, offload| SuspendReport {
            state,
            offload,
            private_offload: None,
            elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
        };
        if !offload || self.state == VmState::Offloaded {
            if self.state == VmState::Running {
                self.state = VmState::Paused;
            }
            return Ok(report(self.state, None));
        }
        if self.pool.is_some() {
            return Err(VmError::State(
                "a VM in the memory pool cannot be offloaded: its pool pages are shared with \
                 other VMs (pause it instead)"
                    .into(),
            ));
        }
        let previous = self.state;
        self.state = VmState::Paused;
        let config = self.options.offload_config()?;
        if self.options.ram_backing == RamKind::Snapshot {
            let result = snapshot::offload_private(self.machine.ram(), &config.dir, config.codec);
            return match result {
                Ok(done) => {
                    let _ = self.machine.drop_disk_cache();
                    self.state = VmState::Offloaded;
                    let mut out = report(self.state, None);
                    out.private_offload = Some(done);
                    Ok(out)
                }
                Err(e) => {
                    self.state = previous;
                    Err(e.into())
                }
            };
        }
        match self.machine.offload(&config) {
            Ok(done) => {
                self.state = VmState::Offloaded;
                if let Some(link) = self.machine.governor() {
                    // The governor learns that this VM holds little now, and that the limit
                    // above what it holds is a reservation to take back; the VM's own limit
                    // falls to it at once (its faults after the resume ask for room).
                    link.offloaded(true, self.machine.resident_bytes());
                    link.report(crate::governor::protocol::WireState::Offloaded, None);
                }
                Ok(report(self.state, Some(done)))
            }
            Err(e) => {
                self.state = previous;
                Err(VmError::Offload(e))
            }
        }
    }

    /// Resumes a paused or offloaded VM; an offloaded one loads its RAM back lazily
    /// (faults plus prefetch) or, with `eager`, completely before returning.
    pub fn resume(&mut self, eager: bool) -> Result<ResumeReport, VmError> {
        let started = Instant::now();
        if self.state != VmState::Running {
            // The file showed the offloaded image; the VM is about to change it.
            if let Some(view) = self.ram_view.take() {
                view.close();
            }
        }
        let mut private_load = None;
        let load = match self.state {
            VmState::Running => {
                return Err(VmError::State(
                    "the VM is running: there is nothing to resume".into(),
                ))
            }
            VmState::Paused => None,
            // The pages a restored VM wrote come back before its vCPU runs (userfaultfd cannot
            // serve a private file mapping lazily).
            VmState::Offloaded if self.options.ram_backing == RamKind::Snapshot => {
                private_load = Some(snapshot::load_private(
                    self.machine.ram(),
                    &self.options.store_dir,
                )?);
                None
            }
            VmState::Offloaded => {
                let kind = self.options.ram_backing;
                if kind.is_hugetlb() {
                    // Every huge page the VM had is back in the host's hands: that the host can
                    // give them again is found out here, with the VM still offloaded, rather
                    // than at a guest fault that could not be served.
                    let stored = self.machine.pager().state_counts().stored * basics::PAGE_SIZE;
                    crate::hugepages::HugePool::probe(stored.div_ceil(kind.page_size().bytes()))
                        .map_err(VmError::HugePages)?;
                }
                let mode = if eager {
                    LoadMode::Eager
                } else {
                    LoadMode::Lazy
                };
                Some(
                    self.machine
                        .pager()
                        .load(mode, self.options.io_threads.max(1))
                        .map_err(VmError::Load)?,
                )
            }
        };
        let collapse = (eager && load.is_some() && self.options.thp_collapse)
            .then(|| self.machine.pager().collapse());
        self.state = VmState::Running;
        // Resumed, it runs no command yet.
        self.between_commands();
        Ok(ResumeReport {
            state: self.state,
            load,
            private_load,
            collapse,
            elapsed_ms: started.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Writes a sealed snapshot of the VM to `out` (which must not exist), RAM raw or, with a
    /// store format, compressed; it goes on as it was. An offloaded VM's RAM is read from its offload
    /// store, never brought back (not for snapshot RAM, whose offload keeps only the pages it
    /// wrote).
    pub fn snapshot(
        &self,
        out: &Path,
        store: Option<snapshot::RamStore>,
    ) -> Result<SnapshotReport, VmError> {
        if self.state == VmState::Offloaded && self.options.ram_backing == RamKind::Snapshot {
            return Err(VmError::State(
                "the VM is restored from a snapshot and offloaded: resume it before taking a \
                 snapshot"
                    .into(),
            ));
        }
        Ok(snapshot::write(
            &self.machine,
            self.options.vcpus,
            out,
            store,
        )?)
    }
}
