//! One process's side of KSM: which of its mappings KSM may merge, the advice itself
//! (`MADV_MERGEABLE`, or `PR_SET_MEMORY_MERGE` for a whole process), the check that it took
//! (the `mg` flag in `/proc/PID/smaps`), and what KSM has merged there (`/proc/PID/ksm_stat`).

use std::path::PathBuf;

/// Errors of advice and of reading a process's files.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// A `/proc` file could not be read (the process is gone, or not ours to read).
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// Part of the range is not mapped.
    #[error("{start:#x}..{end:#x} is not entirely mapped")]
    Unmapped {
        /// Start of the range.
        start: u64,
        /// End of the range.
        end: u64,
    },
    /// KSM cannot merge this mapping.
    #[error("KSM cannot merge the mapping at {start:#x}..{end:#x}: {reason}")]
    Ineligible {
        /// Start of the mapping.
        start: u64,
        /// End of the mapping.
        end: u64,
        /// Why.
        reason: &'static str,
    },
    /// `madvise` or `prctl` failed.
    #[error("{call} failed")]
    Advise {
        /// The call.
        call: &'static str,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The advice was accepted but the mapping does not show it.
    #[error("the kernel accepted the advice, but {bytes} bytes at {start:#x} are not marked mergeable (no `mg` in VmFlags)")]
    NotTaken {
        /// First unmarked address.
        start: u64,
        /// Unmarked bytes.
        bytes: u64,
    },
}

/// One mapping of `/proc/PID/smaps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// The file or pseudo-name (`[heap]`), empty for anonymous memory.
    pub name: String,
    /// The two-letter flags of its `VmFlags` line.
    pub flags: Vec<String>,
    /// Resident bytes.
    pub rss: u64,
    /// Proportional set size, bytes.
    pub pss: u64,
}

impl Mapping {
    /// True if the flag (e.g. `mg`) is set.
    pub fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }

    /// Why KSM cannot merge this mapping, or `None` if it can. KSM merges anonymous pages of
    /// private mappings only: private anonymous memory, and the copied-on-write pages of a
    /// private file mapping.
    pub fn ineligible(&self) -> Option<&'static str> {
        let rules: [(&str, &str); 7] = [
            ("sh", "it is shared writable memory (a shared memfd or file); KSM merges private memory only: use anon RAM"),
            ("ms", "it is a shared mapping; KSM merges private memory only"),
            ("ht", "it is hugetlbfs memory"),
            ("pf", "it is a PFN mapping (device memory)"),
            ("io", "it is I/O memory"),
            ("de", "it may not be expanded or merged (VM_DONTEXPAND)"),
            ("mm", "it is a mixed map (device memory)"),
        ];
        rules
            .iter()
            .find(|(flag, _)| self.has(flag))
            .map(|(_, reason)| *reason)
    }
}

/// What KSM did in one process (`/proc/PID/ksm_stat`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProcessKsm {
    /// Pages of this process KSM maps to a shared page.
    pub merging_pages: u64,
    /// Pages KSM tracks (one reverse-map item each).
    pub rmap_items: u64,
    /// Empty pages merged with the zero page.
    pub zero_pages: u64,
    /// Bytes saved minus metadata, this process's share.
    pub process_profit: i64,
    /// The whole process is mergeable (`PR_SET_MEMORY_MERGE`).
    pub merge_any: bool,
}

fn proc_file(pid: Option<u32>, name: &str) -> PathBuf {
    match pid {
        Some(pid) => PathBuf::from(format!("/proc/{pid}/{name}")),
        None => PathBuf::from(format!("/proc/self/{name}")),
    }
}

fn read(path: PathBuf) -> Result<String, ProcessError> {
    std::fs::read_to_string(&path).map_err(|source| ProcessError::Read { path, source })
}

/// KSM's counters for a process (`None`: this process).
pub fn ksm_stat(pid: Option<u32>) -> Result<ProcessKsm, ProcessError> {
    let text = read(proc_file(pid, "ksm_stat"))?;
    let mut stat = ProcessKsm::default();
    for line in text.lines() {
        let mut words = line.split([' ', ':']).filter(|w| !w.is_empty());
        let (Some(name), Some(value)) = (words.next(), words.next()) else {
            continue;
        };
        let number = || value.parse().unwrap_or(0);
        match name {
            "ksm_merging_pages" => stat.merging_pages = number(),
            "ksm_rmap_items" => stat.rmap_items = number(),
            "ksm_zero_pages" => stat.zero_pages = number(),
            "ksm_process_profit" => stat.process_profit = value.parse().unwrap_or(0),
            "ksm_merge_any" => stat.merge_any = value == "yes",
            _ => {}
        }
    }
    Ok(stat)
}

/// The mappings of a process (`None`: this process).
pub fn mappings(pid: Option<u32>) -> Result<Vec<Mapping>, ProcessError> {
    Ok(parse_smaps(&read(proc_file(pid, "smaps"))?))
}

fn parse_smaps(text: &str) -> Vec<Mapping> {
    let mut out: Vec<Mapping> = Vec::new();
    for line in text.lines() {
        if let Some(mapping) = header(line) {
            out.push(mapping);
            continue;
        }
        let Some(last) = out.last_mut() else { continue };
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            last.flags = flags.split_whitespace().map(str::to_owned).collect();
        } else if let Some(kib) = line.strip_prefix("Rss:") {
            last.rss = kib_field(kib);
        } else if let Some(kib) = line.strip_prefix("Pss:") {
            last.pss = kib_field(kib);
        }
    }
    out
}

/// `7f00-7f10 rw-p 00000000 00:00 0   [name]` → a mapping without flags yet.
fn header(line: &str) -> Option<Mapping> {
    let mut words = line.split_whitespace();
    let (lo, hi) = words.next()?.split_once('-')?;
    let start = u64::from_str_radix(lo, 16).ok()?;
    let end = u64::from_str_radix(hi, 16).ok()?;
    let perms = words.next()?;
    if perms.len() != 4 {
        return None;
    }
    let name = words.nth(3).map(str::to_owned).unwrap_or_default();
    Some(Mapping {
        start,
        end,
        name,
        flags: Vec::new(),
        rss: 0,
        pss: 0,
    })
}

fn kib_field(text: &str) -> u64 {
    text.split_whitespace()
        .next()
        .and_then(|n| n.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// The mappings that cover `[start, start + len)`, or an error if part of it is unmapped.
fn covering(all: Vec<Mapping>, start: u64, len: u64) -> Result<Vec<Mapping>, ProcessError> {
    let end = start.saturating_add(len);
    let inside: Vec<Mapping> = all
        .into_iter()
        .filter(|m| m.start < end && start < m.end)
        .collect();
    let mut next = start;
    for m in &inside {
        if m.start > next {
            break;
        }
        next = next.max(m.end);
    }
    if next < end {
        return Err(ProcessError::Unmapped { start, end });
    }
    Ok(inside)
}

/// How much of a range carries the advice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Coverage {
    /// Bytes of the range.
    pub bytes: u64,
    /// Bytes in mappings marked mergeable (`mg`).
    pub advised_bytes: u64,
    /// Resident bytes of those mappings.
    pub resident_bytes: u64,
    /// PSS of those mappings: what the range costs after sharing.
    pub pss_bytes: u64,
}

/// How much of `[start, start + len)` in a process (`None`: this one) is marked mergeable.
pub fn coverage(pid: Option<u32>, start: u64, len: u64) -> Result<Coverage, ProcessError> {
    let end = start.saturating_add(len);
    let inside = covering(mappings(pid)?, start, len)?;
    let mut out = Coverage {
        bytes: len,
        ..Coverage::default()
    };
    for m in inside.iter().filter(|m| m.has("mg")) {
        out.advised_bytes += m.end.min(end) - m.start.max(start);
        out.resident_bytes += m.rss;
        out.pss_bytes += m.pss;
    }
    Ok(out)
}

/// Marks `[start, start + len)` of this process mergeable after checking that KSM can merge
/// it, then checks that the kernel shows the advice. The range must be page-aligned.
///
/// Advice does not change what memory holds, so this is safe on any mapped range; refusing
/// ineligible mappings turns a silent no-op (KSM skips them) into a clear error.
pub fn advise(start: u64, len: u64) -> Result<Coverage, ProcessError> {
    for m in covering(mappings(None)?, start, len)? {
        if let Some(reason) = m.ineligible() {
            return Err(ProcessError::Ineligible {
                start: m.start,
                end: m.end,
                reason,
            });
        }
    }
    let ptr = usize::try_from(start).map_err(|_| ProcessError::Unmapped {
        start,
        end: start.saturating_add(len),
    })? as *mut libc::c_void;
    let size = usize::try_from(len).map_err(|_| ProcessError::Unmapped {
        start,
        end: start.saturating_add(len),
    })?;
    // SAFETY: MADV_MERGEABLE only changes how the kernel may share the pages of the range
    // (a write still gets a private copy); it never changes their contents, and the range was
    // checked to be mapped.
    let rc = unsafe { libc::madvise(ptr, size, libc::MADV_MERGEABLE) };
    if rc != 0 {
        return Err(ProcessError::Advise {
            call: "madvise(MADV_MERGEABLE)",
            source: std::io::Error::last_os_error(),
        });
    }
    let coverage = coverage(None, start, len)?;
    if coverage.advised_bytes < len {
        return Err(ProcessError::NotTaken {
            start,
            bytes: len - coverage.advised_bytes,
        });
    }
    Ok(coverage)
}

/// Makes every present and future private anonymous mapping of this process mergeable
/// (`PR_SET_MEMORY_MERGE`); kept across fork and exec. For launching a program that cannot
/// advise its own memory.
pub fn merge_whole_process() -> Result<(), ProcessError> {
    // SAFETY: prctl with PR_SET_MEMORY_MERGE and integer arguments touches no memory of ours.
    let rc = unsafe { libc::prctl(libc::PR_SET_MEMORY_MERGE, 1, 0, 0, 0) };
    if rc != 0 {
        return Err(ProcessError::Advise {
            call: "prctl(PR_SET_MEMORY_MERGE)",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0 
Size:               4096 kB
Rss:                1024 kB
Pss:                 512 kB
VmFlags: rd wr mr mw me ac mg
7f0000400000-7f0000800000 rw-s 00000000 00:01 12                         /memfd:ram (deleted)
Rss:                   0 kB
Pss:                   0 kB
VmFlags: rd wr sh mr mw me ms
";

    #[test]
    fn parse_smaps_reads_ranges_names_flags_and_sizes() {
        let maps = parse_smaps(SMAPS);
        assert_eq!(maps.len(), 2);
        assert_eq!(maps[0].start, 0x7f00_0000_0000);
        assert!(maps[0].has("mg"));
        assert_eq!(maps[0].rss, 1 << 20);
        assert_eq!(maps[0].pss, 512 << 10);
        assert_eq!(maps[1].name, "/memfd:ram");
        assert!(maps[0].ineligible().is_none());
        assert!(maps[1].ineligible().expect("shared").contains("shared"));
    }

    #[test]
    fn covering_a_hole_is_an_error() {
        let maps = parse_smaps(SMAPS);
        assert_eq!(
            covering(maps.clone(), 0x7f00_0000_0000, 8 << 20)
                .expect("covered")
                .len(),
            2
        );
        assert!(matches!(
            covering(maps, 0x7f00_0000_0000, 9 << 20),
            Err(ProcessError::Unmapped { .. })
        ));
    }

    #[test]
    fn advise_private_anonymous_memory_is_verified() {
        let len = 4 << 20;
        let map = memmap2::MmapMut::map_anon(len).expect("a mapping");
        let coverage = advise(map.as_ptr() as u64, len as u64).expect("advice on private memory");
        assert_eq!(coverage.advised_bytes, len as u64);
    }

    #[test]
    fn advise_shared_memory_is_refused_with_the_reason() {
        let len = 2 << 20;
        // SAFETY: a fresh mapping at an address of the kernel's choice.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        let err = advise(ptr as u64, len as u64).expect_err("shared memory");
        assert!(err.to_string().contains("shared"), "{err}");
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(ptr, len) };
    }

    #[test]
    fn ksm_stat_of_this_process_reads() {
        let stat = ksm_stat(None).expect("ksm_stat");
        assert!(!stat.merge_any);
    }
}
