//! Files handed to `pvisor` that are not what they claim: a trajectory that is a FIFO (whose
//! read blocks for ever), a device that never ends, or a file of many GiB.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use vmm::replay::{ReplayError, Trajectory, TRAJECTORY_LIMIT};

/// `Trajectory::load(path)` on another thread; panics if it takes more than 10 s.
fn load_within_10s(path: &Path) -> Result<Trajectory, ReplayError> {
    let owned: PathBuf = path.to_path_buf();
    let what = format!("loading {}", path.display());
    testkit::within(Duration::from_secs(10), &what, move || {
        Trajectory::load(&owned)
    })
}

fn chain(err: &dyn std::error::Error) -> String {
    basics::error_chain(err)
}

#[test]
fn replay_trajectory_fifo_device_or_huge_file_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    testkit::mkfifo(&fifo);
    let huge = dir.path().join("huge.json");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(TRAJECTORY_LIMIT + 1)
        .unwrap();
    // The FIFO first: before the fix it hangs, and the test stops there rather than read
    // /dev/zero without end.
    for (path, expected) in [
        (fifo.as_path(), "FIFO"),
        (huge.as_path(), "limit"),
        (Path::new("/dev/zero"), "character device"),
    ] {
        let err = load_within_10s(path).unwrap_err();
        let text = chain(&err);
        assert!(matches!(err, ReplayError::Read { .. }), "{text}");
        assert!(text.contains(expected), "{text}");
        assert!(text.contains(&path.display().to_string()), "{text}");
    }
}
