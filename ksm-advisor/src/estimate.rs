//! How much would KSM save? An estimate from page hashes, before KSM is switched on.
//!
//! Every resident page of the chosen processes' mergeable mappings is read (pages that are not
//! resident are skipped, so the estimate never faults memory in) and hashed. Sampling is by
//! content: a page enters the sample when its hash falls in one `rate`-th of the hash space, so
//! all copies of one content are sampled together or not at all, and the duplicates counted
//! in the sample, times `rate`, estimate the duplicates of the whole (sampling by position
//! would see both copies of a pair only `1/rate²` of the time). The sample bounds the table's
//! memory; reading still costs one pass over resident memory (about 60 ms per GiB here).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use crate::process::{self, ProcessError};

use basics::PAGE_SIZE as PAGE;
/// Pages read per `process_vm_readv`.
const BATCH: u64 = 256;

/// Errors of an estimate.
#[derive(Debug, thiserror::Error)]
pub enum EstimateError {
    /// The process's mappings could not be read.
    #[error(transparent)]
    Process(#[from] ProcessError),
    /// The page map or the memory could not be read.
    #[error("cannot read {what} of process {pid}")]
    Read {
        /// The process.
        pid: u32,
        /// What.
        what: &'static str,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
}

/// What an estimate found.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Estimate {
    /// Resident pages in the mergeable mappings looked at.
    pub resident_pages: u64,
    /// Pages that entered the sample.
    pub sampled_pages: u64,
    /// Distinct contents among them.
    pub sampled_distinct: u64,
    /// One page in this many (by content) is sampled.
    pub rate: u64,
    /// Pages KSM would free: the sample's duplicates scaled up.
    pub mergeable_pages: u64,
    /// The same in bytes.
    pub saving_bytes: u64,
    /// The share of the resident pages it frees.
    pub saving_share: f64,
}

/// One process's memory to look at.
#[derive(Debug, Clone)]
pub struct Target {
    /// The process.
    pub pid: u32,
    /// `(start, len)` ranges; empty: every mapping KSM could merge.
    pub ranges: Vec<(u64, u64)>,
}

/// Estimates what merging the targets' identical pages would save.
pub fn estimate(targets: &[Target], rate: u64) -> Result<Estimate, EstimateError> {
    let rate = rate.max(1);
    let mut counts: HashMap<u64, u32> = HashMap::new();
    let mut resident = 0;
    let mut sampled = 0;
    for target in targets {
        let ranges = if target.ranges.is_empty() {
            process::mappings(Some(target.pid))?
                .into_iter()
                .filter(|m| m.ineligible().is_none() && m.rss > 0 && m.name != "[vsyscall]")
                .map(|m| (m.start, m.end - m.start))
                .collect()
        } else {
            target.ranges.clone()
        };
        let mut reader = Reader::open(target.pid)?;
        for (start, len) in ranges {
            reader.each_resident(start, len, |page| {
                resident += 1;
                let hash = xxhash_rust::xxh3::xxh3_64(page);
                if hash.is_multiple_of(rate) {
                    sampled += 1;
                    *counts.entry(hash).or_insert(0) += 1;
                }
            })?;
        }
    }
    let distinct = counts.len() as u64;
    let mergeable = (sampled - distinct) * rate;
    #[allow(
        clippy::cast_precision_loss,
        reason = "page counts stay far below 2^52"
    )]
    let share = if resident == 0 {
        0.0
    } else {
        mergeable.min(resident) as f64 / resident as f64
    };
    Ok(Estimate {
        resident_pages: resident,
        sampled_pages: sampled,
        sampled_distinct: distinct,
        rate,
        mergeable_pages: mergeable.min(resident),
        saving_bytes: mergeable.min(resident) * PAGE,
        saving_share: share,
    })
}

/// Reads another process's resident pages.
struct Reader {
    pid: u32,
    pagemap: File,
    entries: Vec<u8>,
    buf: Vec<u8>,
}

impl Reader {
    fn open(pid: u32) -> Result<Self, EstimateError> {
        let path = PathBuf::from(format!("/proc/{pid}/pagemap"));
        let pagemap = File::open(&path).map_err(|source| EstimateError::Read {
            pid,
            what: "the page map",
            source,
        })?;
        Ok(Self {
            pid,
            pagemap,
            entries: vec![0; usize::try_from(BATCH * 8).expect("small")],
            buf: vec![0; usize::try_from(BATCH * PAGE).expect("small")],
        })
    }

    /// Calls `each` with every resident page of `[start, start + len)`.
    fn each_resident(
        &mut self,
        start: u64,
        len: u64,
        mut each: impl FnMut(&[u8]),
    ) -> Result<(), EstimateError> {
        let pid = self.pid;
        let mut addr = start;
        let end = start + len;
        while addr < end {
            let pages = ((end - addr) / PAGE).min(BATCH);
            let want = usize::try_from(pages * 8).expect("a batch fits");
            let entries = &mut self.entries[..want];
            self.pagemap
                .read_exact_at(entries, addr / PAGE * 8)
                .map_err(|source| EstimateError::Read {
                    pid,
                    what: "the page map",
                    source,
                })?;
            let present: Vec<bool> = entries
                .chunks_exact(8)
                .map(|e| u64::from_le_bytes(e.try_into().expect("8 bytes")) >> 63 == 1)
                .collect();
            // Read runs of present pages.
            let mut i = 0;
            while i < present.len() {
                if !present[i] {
                    i += 1;
                    continue;
                }
                let run_start = i;
                while i < present.len() && present[i] {
                    i += 1;
                }
                let first = addr + run_start as u64 * PAGE;
                let bytes = (i - run_start) * usize::try_from(PAGE).expect("small");
                let got = read_remote(pid, first, &mut self.buf[..bytes]);
                // A page may vanish between the page map and the read: count what came.
                let got = got.map_err(|source| EstimateError::Read {
                    pid,
                    what: "the memory",
                    source,
                })?;
                for page in self.buf[..got].chunks_exact(4096) {
                    each(page);
                }
            }
            addr += pages * PAGE;
        }
        Ok(())
    }
}

/// `process_vm_readv` of one run; a partial read returns its length.
fn read_remote(pid: u32, addr: u64, buf: &mut [u8]) -> std::io::Result<usize> {
    let remote = nix::sys::uio::RemoteIoVec {
        base: usize::try_from(addr).map_err(|_| std::io::ErrorKind::InvalidInput)?,
        len: buf.len(),
    };
    let pid = libc::pid_t::try_from(pid).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    match nix::sys::uio::process_vm_readv(
        nix::unistd::Pid::from_raw(pid),
        &mut [std::io::IoSliceMut::new(buf)],
        &[remote],
    ) {
        Ok(n) => Ok(n),
        // The first page is gone already.
        Err(nix::errno::Errno::EFAULT) => Ok(0),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Page-aligned memory of `pages` pages where page `i` holds `content(i)` in every word.
    fn pages(pages: usize, content: impl Fn(usize) -> u64) -> (Vec<u8>, usize) {
        let mut data = vec![0u8; pages * 4096 + 4096];
        let offset = data.as_ptr().align_offset(4096);
        for (i, page) in data[offset..offset + pages * 4096]
            .chunks_exact_mut(4096)
            .enumerate()
        {
            for word in page.chunks_exact_mut(8) {
                word.copy_from_slice(&content(i).to_le_bytes());
            }
        }
        (data, offset)
    }

    fn target(data: &[u8], offset: usize, pages: usize) -> Target {
        Target {
            pid: std::process::id(),
            ranges: vec![(data[offset..].as_ptr() as u64, (pages * 4096) as u64)],
        }
    }

    #[test]
    fn estimate_at_rate_one_counts_duplicates_exactly() {
        // 1024 pages of one content, 1024 distinct ones.
        let (data, offset) = pages(2048, |i| if i < 1024 { 0xAB } else { i as u64 + 1 });
        let exact = estimate(&[target(&data, offset, 2048)], 1).expect("estimate");
        assert_eq!(exact.resident_pages, 2048);
        assert_eq!(exact.mergeable_pages, 1023);
        assert!((exact.saving_share - 1023.0 / 2048.0).abs() < 1e-9);
    }

    #[test]
    fn estimate_by_content_sampling_stays_close_to_the_exact_count() {
        // 2048 contents, 4 copies each: 6144 pages would be freed.
        let (data, offset) = pages(8192, |i| (i % 2048) as u64 + 7);
        let sampled = estimate(&[target(&data, offset, 8192)], 8).expect("estimate");
        assert!(sampled.sampled_pages < 8192 / 4, "{sampled:?}");
        let error = (sampled.mergeable_pages as f64 - 6144.0).abs() / 6144.0;
        assert!(error < 0.3, "{sampled:?}");
    }

    #[test]
    fn estimate_skips_pages_that_are_not_resident() {
        let len = 64 * 4096;
        // Never touched, so nothing in it is resident.
        let map = memmap2::MmapMut::map_anon(len).expect("a mapping");
        let target = Target {
            pid: std::process::id(),
            ranges: vec![(map.as_ptr() as u64, len as u64)],
        };
        assert_eq!(estimate(&[target], 1).expect("estimate").resident_pages, 0);
    }
}
