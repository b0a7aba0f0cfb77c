//! The machine the bench runs on (`common::host`'s facts and KVM's), and the CPU time used
//! beside it.

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

/// CPU time of the whole machine and of this process, for "what else ran".
#[derive(Debug, Clone, Copy)]
pub struct CpuSample {
    busy_s: f64,
    steal_s: f64,
    own_s: f64,
}

/// Clock ticks per second of `/proc/stat`.
fn ticks() -> f64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

impl CpuSample {
    pub fn now() -> Self {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let fields: Vec<f64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect();
        let at = |i: usize| fields.get(i).copied().unwrap_or(0.0);
        // user nice system idle iowait irq softirq steal
        let busy = at(0) + at(1) + at(2) + at(5) + at(6);
        let own = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| {
                let rest = s.rsplit_once(") ")?.1.to_owned();
                let f: Vec<&str> = rest.split_whitespace().collect();
                // utime, stime, cutime, cstime are fields 14..=17 (1-based); the first field
                // after the command name is field 3, so they are 11..=14 here.
                Some(
                    (11..=14)
                        .filter_map(|i| f.get(i)?.parse::<f64>().ok())
                        .sum(),
                )
            })
            .unwrap_or(0.0);
        let t = ticks();
        Self {
            busy_s: busy / t,
            steal_s: at(7) / t,
            own_s: own / t,
        }
    }

    /// (CPU seconds of the whole machine, of this process and its waited-for children, and
    /// stolen by the host) since `self`.
    pub fn since(self) -> (f64, f64, f64) {
        let now = Self::now();
        (
            now.busy_s - self.busy_s,
            now.own_s - self.own_s,
            now.steal_s - self.steal_s,
        )
    }
}
