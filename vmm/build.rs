//! Builds the workload guest (guest/guest.c) into a flat binary with the machine's gcc and
//! objcopy, for `include_bytes!` in src/guest.rs.

use std::path::PathBuf;
use std::process::Command;

fn run(cmd: &mut Command, what: &str) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {what} to build the workload guest: {e}"));
    assert!(
        status.success(),
        "{what} failed building the workload guest: {status}"
    );
}

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let elf = out.join("guest.elf");
    let bin = out.join("guest.bin");
    println!("cargo:rerun-if-changed=guest/guest.c");
    println!("cargo:rerun-if-changed=guest/guest.ld");
    run(
        Command::new("gcc")
            .args([
                "-O2",
                "-ffreestanding",
                "-fno-builtin",
                "-nostdlib",
                "-static",
                "-fno-pic",
                "-fno-pie",
                "-no-pie",
                "-mno-red-zone",
                "-fno-stack-protector",
                "-fcf-protection=none",
                "-mgeneral-regs-only",
                "-fno-asynchronous-unwind-tables",
                "-Wl,--build-id=none",
                "-Wl,--no-warn-rwx-segments",
                "-Tguest/guest.ld",
                "-o",
            ])
            .arg(&elf)
            .arg("guest/guest.c"),
        "gcc",
    );
    run(
        Command::new("objcopy")
            .args(["-O", "binary"])
            .arg(&elf)
            .arg(&bin),
        "objcopy",
    );
}
