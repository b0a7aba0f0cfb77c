//! Booting a VM: guest RAM and its pager, the disk, KVM's VM and vCPUs, and the registers
//! the workload guest starts with at CPL3 (or a snapshot's, checked); the guest's identity
//! map, program and mailbox.

use kvm_bindings::{kvm_segment, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::Kvm;
use uffd_pager::pager::{FaultError, Pager, PagerConfig};
use uffd_pager::state::PageState;
use vm_memory::{Bytes, GuestAddress};

use super::{kvm, Machine, MachineConfig, MachineError, RestoreRam};
use crate::guest::{self, Mailbox};
use crate::memory::GuestRam;

/// The workload guest's code selector (GDT entry 3, RPL 3): it runs at CPL3.
pub const USER_CODE_SELECTOR: u16 = 0x1b;
/// Its data and stack selector (GDT entry 4, RPL 3).
pub const USER_DATA_SELECTOR: u16 = 0x23;
/// CR0 the VMM sets: PG | PE | WP.
pub const GUEST_CR0: u64 = 0x8000_0001 | (1 << 16);
/// CR4 the VMM sets: PAE.
pub const GUEST_CR4: u64 = 1 << 5;
/// EFER the VMM sets: LME | LMA.
pub const GUEST_EFER: u64 = 0x500;

/// A restored vCPU's descriptor tables and task register must be the ones the VMM's vCPUs
/// start with: the VMM never sets them, and the CPL3 guest cannot (`lgdt`, `lidt`, `lldt`
/// and `ltr` are CPL0 instructions). A snapshot's manifest is not sealed: an edited GDT base
/// would let the guest load descriptors (a call gate to CPL0) from its own memory.
/// The host's record of the guest's arenas: empty at boot, a snapshot's after a restore
/// (checked again as its opens were).
fn restored_arenas(config: &MachineConfig) -> Result<crate::arena::Registry, MachineError> {
    let mut arenas = crate::arena::Registry::new(config.memory);
    if let Some(restore) = &config.restore {
        arenas.restore(&restore.arenas).map_err(|refused| {
            MachineError::Config(format!("the snapshot's arenas: {}", refused.reason))
        })?;
    }
    Ok(arenas)
}

fn check_tables(
    restored: &kvm_bindings::kvm_sregs,
    fresh: &kvm_bindings::kvm_sregs,
) -> Result<(), MachineError> {
    let table = |t: &kvm_bindings::kvm_dtable| (t.base, t.limit);
    let segment = |s: &kvm_bindings::kvm_segment| (s.base, s.limit, s.selector, s.type_, s.present);
    let differs = [
        ("gdt", table(&restored.gdt) != table(&fresh.gdt)),
        ("idt", table(&restored.idt) != table(&fresh.idt)),
        ("ldt", segment(&restored.ldt) != segment(&fresh.ldt)),
        ("tr", segment(&restored.tr) != segment(&fresh.tr)),
    ];
    match differs.iter().find(|(_, d)| *d) {
        Some((name, _)) => Err(MachineError::Config(format!(
            "the snapshot's vcpu {name} is not the one the VMM's vCPUs start with (a CPL3 guest \
             cannot change it)"
        ))),
        None => Ok(()),
    }
}

/// A user code segment (selector with RPL 3).
fn segment(selector: u16, type_: u8, long: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xFFFF_FFFF,
        selector,
        type_,
        present: 1,
        dpl: 3,
        db: u8::from(!long),
        s: 1,
        l: u8::from(long),
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

impl Machine {
    /// Maps RAM, starts the pager, loads the guest, creates the VM and runs the guest to its
    /// first `PORT_DONE` (ready for commands). `on_fault_error` is told of faults the pager
    /// cannot serve.
    pub fn boot(
        config: &MachineConfig,
        on_fault_error: Box<dyn Fn(&FaultError) + Send + Sync>,
    ) -> Result<Self, MachineError> {
        guest::check_memory(config.memory).map_err(MachineError::Config)?;
        if config.vcpus == 0 || config.vcpus > 64 {
            return Err(MachineError::Config(format!(
                "vcpus must be 1 to 64, not {}",
                config.vcpus
            )));
        }
        // Snapshot RAM is served by its image's page cache, not by the pager: every page
        // counts as resident. RAM restored from a store starts with every page in the store.
        let (ram, initial, source) = match config.restore.as_ref().map(|r| &r.ram) {
            Some(RestoreRam::Image(image)) => (
                GuestRam::from_image(std::sync::Arc::clone(image), config.memory)?,
                PageState::Resident,
                None,
            ),
            Some(RestoreRam::Source(source)) => (
                GuestRam::new(config.memory, config.ram_kind)?,
                PageState::Source,
                Some(std::sync::Arc::clone(source)),
            ),
            None => (
                GuestRam::new(config.memory, config.ram_kind)?,
                PageState::Zero,
                None,
            ),
        };
        // SAFETY: the RAM mapping outlives the pager (field order of `Machine`), and every
        // access to it goes through KVM, the pager or vm-memory, all of which tolerate the
        // pager filling pages at any time.
        let pager = unsafe {
            Pager::new(
                vec![ram.region_spec()],
                PagerConfig {
                    threads: config.pager_threads.max(1),
                    // A block holds whole pages: huge-page RAM moves in 2 MiB blocks. RAM
                    // restored from a store moves in the store's blocks, so that a fault
                    // reads one payload (one range request from an object store).
                    block_size: source
                        .as_ref()
                        .and_then(|s| s.block_size())
                        .unwrap_or(config.block_size)
                        .max(huge_block(config.ram_kind.page_size())),
                    initial,
                    register: true,
                    // The VMM tells the pager of every discard itself (before making it), and
                    // cold compression zaps page-table entries, which must not read as discards.
                    remove_events: false,
                    track_writes: config.track_writes,
                },
                source,
                on_fault_error,
            )
        }
        .map_err(MachineError::Pager)?;
        // A new disk is created 0600 (it holds the guest's data); never through a link,
        // never a FIFO (whose open would block) or a device.
        let disk = compressed_backing::file::open_or_create_private(&config.disk).map_err(|e| {
            MachineError::Disk {
                path: config.disk.clone(),
                source: e.into(),
            }
        })?;

        if config.restore.is_none() {
            write_boot_structures(&ram)?;
        }

        let kvm_fd = Kvm::new().map_err(kvm("open /dev/kvm"))?;
        let vm = kvm_fd.create_vm().map_err(kvm("create VM"))?;
        let region = kvm_userspace_memory_region {
            slot: 0,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: ram.size(),
            userspace_addr: ram.host_base().0,
        };
        // SAFETY: the region is our own RAM mapping, which outlives the VM (field order).
        unsafe { vm.set_user_memory_region(region) }.map_err(kvm("set memory region"))?;
        let cpuid = kvm_fd
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm("get supported CPUID"))?;
        let mut vcpus = Vec::new();
        for id in 0..config.vcpus {
            let vcpu = vm.create_vcpu(u64::from(id)).map_err(kvm("create vCPU"))?;
            vcpu.set_cpuid2(&cpuid).map_err(kvm("set CPUID"))?;
            vcpus.push(vcpu);
        }
        let vcpu = vcpus.remove(0);
        let mut sregs = vcpu.get_sregs().map_err(kvm("get sregs"))?;
        sregs.cr3 = guest::PML4_GPA;
        sregs.cr4 = GUEST_CR4;
        sregs.cr0 = GUEST_CR0;
        sregs.efer = GUEST_EFER;
        sregs.cs = segment(USER_CODE_SELECTOR, 11, true);
        let data = segment(USER_DATA_SELECTOR, 3, false);
        (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
        let regs = kvm_bindings::kvm_regs {
            rip: guest::CODE_GPA,
            rsp: guest::STACK_TOP,
            rflags: 0x3002, // IOPL 3, reserved bit 1
            ..Default::default()
        };
        let (sregs, regs) = match &config.restore {
            Some(restore) => {
                check_tables(&restore.vcpu.sregs, &sregs)?;
                (restore.vcpu.sregs, restore.vcpu.regs)
            }
            None => (sregs, regs),
        };
        vcpu.set_sregs(&sregs).map_err(kvm("set sregs"))?;
        vcpu.set_regs(&regs).map_err(kvm("set regs"))?;

        let mut machine = Self {
            vcpu,
            _idle_vcpus: vcpus,
            _vm: vm,
            _kvm: kvm_fd,
            cold: None,
            pager,
            ram,
            disk,
            disk_path: config.disk.clone(),
            filled: config.restore.as_ref().map_or(0, |r| r.filled),
            io_buf: Vec::new(),
            model: None,
            model_error: None,
            wait: None,
            coordinator: None,
            wait_failures: (0, 0),
            operator: None,
            governor: None,
            stop_requested: false,
            interrupter: config.interrupter.clone(),
            model_pending: None,
            model_received: 0,
            model_batching: crate::gateway::Batching::default(),
            net: None,
            transfer: None,
            net_sent: 0,
            net_error: None,
            image: None,
            io_stats: crate::net::IoStats::default(),
            by_source: crate::net::BySource::default(),
            release_error: None,
            arenas: restored_arenas(config)?,
            arena_offload: None,
            freed_arenas: Vec::new(),
            freed_since: None,
            idle_report: None,
            cgroup_dir: None,
            broken: None,
        };
        if config.restore.is_none() {
            machine.run_until_done()?;
        }
        Ok(machine)
    }
}

/// Writes the identity map (2 MiB user pages), the program and the mailbox.
fn write_boot_structures(ram: &GuestRam) -> Result<(), MachineError> {
    let mem = ram.memory();
    let fail = |gpa: u64| {
        move |e: vm_memory::GuestMemoryError| MachineError::GuestMemory { gpa, source: e }
    };
    mem.write_obj(guest::PDPT_GPA | 7, GuestAddress(guest::PML4_GPA))
        .map_err(fail(guest::PML4_GPA))?;
    let pages = ram.size() / (2 << 20);
    for gib in 0..pages.div_ceil(512) {
        let pd = guest::PD_GPA + gib * 0x1000;
        mem.write_obj(pd | 7, GuestAddress(guest::PDPT_GPA + gib * 8))
            .map_err(fail(guest::PDPT_GPA))?;
    }
    for page in 0..pages {
        // Present, writable, user, 2 MiB.
        let entry = (page * (2 << 20)) | 0x87;
        let gpa = guest::PD_GPA + page * 8;
        mem.write_obj(entry, GuestAddress(gpa)).map_err(fail(gpa))?;
    }
    mem.write_slice(guest::BINARY, GuestAddress(guest::CODE_GPA))
        .map_err(fail(guest::CODE_GPA))?;
    let mailbox = Mailbox {
        app_base: guest::APP_BASE,
        app_size: ram.size() - guest::APP_BASE,
        io_buf: guest::IO_BUF_GPA,
        io_buf_size: guest::IO_BUF_SIZE,
        ..Mailbox::default()
    };
    mem.write_obj(mailbox, GuestAddress(guest::MAILBOX_GPA))
        .map_err(fail(guest::MAILBOX_GPA))?;
    Ok(())
}

/// The block of a page size: the smallest block that holds whole pages of it.
fn huge_block(page: basics::PageSize) -> compressed_backing::BlockSize {
    compressed_backing::BlockSize::new(page.bytes()).expect("2 MiB is a valid block size")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_tables_refuses_each_table_a_snapshot_may_have_edited() {
        let fresh = kvm_bindings::kvm_sregs {
            cs: segment(USER_CODE_SELECTOR, 11, true),
            ..Default::default()
        };
        assert!(check_tables(&fresh, &fresh).is_ok());
        // Registers the guest itself sets may differ.
        let mut other = fresh;
        other.cr3 ^= 0x1000;
        other.ds = segment(USER_DATA_SELECTOR, 3, false);
        assert!(check_tables(&other, &fresh).is_ok());
        type Edit = fn(&mut kvm_bindings::kvm_sregs);
        let edits: [(&str, Edit); 5] = [
            ("gdt", |s| s.gdt.base = 0x10_0000),
            ("gdt", |s| s.gdt.limit = 0xffff),
            ("idt", |s| s.idt.base = 0x20_0000),
            ("ldt", |s| s.ldt.present = 1),
            ("tr", |s| s.tr.selector = 0x40),
        ];
        for (name, edit) in edits {
            let mut restored = fresh;
            edit(&mut restored);
            let e = check_tables(&restored, &fresh).unwrap_err().to_string();
            assert!(e.contains(&format!("vcpu {name} ")), "{name}: {e}");
        }
    }
}
