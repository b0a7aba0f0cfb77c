//! The guest-kernel series (guest-patches/, issue 16) still applies to the source Debian serves:
//! `guest-patches/build.sh --apply-only` fetches `linux-source-6.12` into a fresh cache,
//! unpacks it and applies every patch (about 25 s, most of it the fetch). The compile of the
//! patched kernel takes 6 to 9 minutes on this project's 2-core machines, more than the suite
//! can carry; it is the documented job `guest-patches/build.sh` (guest-patches/README.md).

use std::path::Path;
use std::process::Command;

#[test]
fn guest_kernel_series_applies_to_the_debian_6_12_source() {
    if std::env::var_os("PVISOR_SKIP_GUEST_PATCHES").is_some_and(|v| v == "1") {
        eprintln!("skipped: PVISOR_SKIP_GUEST_PATCHES=1");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let scratch = root.join("target/tmp");
    std::fs::create_dir_all(&scratch).expect("target/tmp");
    let cache = tempfile::tempdir_in(&scratch).expect("a scratch cache");
    let out = Command::new(root.join("guest-patches/build.sh"))
        .arg("--apply-only")
        .arg("--cache")
        .arg(cache.path())
        .output()
        .expect("guest-patches/build.sh runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "build.sh --apply-only failed:\n{text}"
    );
    let patches: Vec<String> = std::fs::read_dir(root.join("guest-patches"))
        .expect("guest-patches/")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name.ends_with(".patch"))
        .collect();
    assert!(patches.len() >= 7, "{patches:?}");
    for name in &patches {
        assert!(
            text.contains(&format!("applied {name}")),
            "{name} not applied:\n{text}"
        );
    }
}
