//! The machine the bench runs on: `common::host`'s facts and KVM's.

use std::path::Path;

use crate::common::host;

/// What the report says about the machine.
#[derive(Debug, Clone)]
pub struct Machine {
    /// CPU, memory, kernel, toolchain and commit.
    pub host: host::Machine,
    /// `TYPE on DEVICE` of the temporary directory.
    pub filesystem: String,
    pub pvisor: String,
    /// The KVM backend module and its two-dimensional paging parameters.
    pub paging: String,
    /// `KVM_CHECK_EXTENSION(KVM_CAP_PRE_FAULT_MEMORY)` on `/dev/kvm`.
    pub pre_fault: i32,
}

/// The loaded KVM backend and whether it has two-dimensional paging (`ept`/`npt`, `tdp_mmu`).
fn paging() -> String {
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .map(|v| v.trim().to_owned())
    };
    let mut parts = Vec::new();
    for module in ["kvm_intel", "kvm_amd", "kvm_pvm"] {
        if Path::new(&format!("/sys/module/{module}")).exists() {
            parts.push(module.to_owned());
        }
    }
    for (module, param) in [("kvm_intel", "ept"), ("kvm_amd", "npt"), ("kvm", "tdp_mmu")] {
        if let Some(v) = read(&format!("/sys/module/{module}/parameters/{param}")) {
            parts.push(format!("{module} {param}={v}"));
        }
    }
    if parts.is_empty() {
        "unknown".into()
    } else {
        parts.join(", ")
    }
}

/// Whether KVM offers `KVM_PRE_FAULT_MEMORY` (capability 236), which maps guest memory into
/// KVM's page tables without guest exits.
fn pre_fault() -> i32 {
    use std::os::fd::AsRawFd;
    const KVM_CHECK_EXTENSION: libc::c_ulong = 0xAE03;
    const KVM_CAP_PRE_FAULT_MEMORY: libc::c_ulong = 236;
    let Ok(kvm) = std::fs::File::open("/dev/kvm") else {
        return -1;
    };
    // SAFETY: KVM_CHECK_EXTENSION takes an integer argument and touches no memory of ours.
    unsafe {
        libc::ioctl(
            kvm.as_raw_fd(),
            KVM_CHECK_EXTENSION,
            KVM_CAP_PRE_FAULT_MEMORY,
        )
    }
}

pub fn machine(filesystem: &str, pvisor: &str) -> Machine {
    Machine {
        host: host::machine(),
        filesystem: filesystem.to_owned(),
        pvisor: pvisor.to_owned(),
        paging: paging(),
        pre_fault: pre_fault(),
    }
}
