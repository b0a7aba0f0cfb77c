//! Committing: what makes a store's writes the image that the next open finds, and what a
//! commit survives ([`Durability`]).

use std::fs;
use std::io;

use super::files::{sync_dir, write_private_file};
use super::index::Index;
use super::{Committed, DiskStore, Durability, StoreError, INDEX_FILE, INDEX_TMP};

impl DiskStore {
    /// Commits all writes since the last commit (durable against what the store's
    /// [`Durability`] says: a crash of the host, or only the writer's end), then compacts if the
    /// options say so.
    pub fn commit(&mut self) -> Result<u64, StoreError> {
        self.check_writable()?;
        self.write_index()?;
        if self.options.auto_compact {
            if let Err(source) = self.compact() {
                return Err(StoreError::CompactionFailed {
                    generation: self.generation,
                    source: Box::new(source),
                });
            }
        }
        Ok(self.generation)
    }

    /// Makes the writes since the last commit durable and commits them without compacting,
    /// leaving none of them in the page cache: the pending part of each segment written to
    /// disk was just written is written back and waited for (`sync_file_range`), then dropped
    /// from the page cache (`POSIX_FADV_DONTNEED`), then the index is written as by
    /// [`commit`](Self::commit). For a writer that commits in steps under a memory budget
    /// (the pager's offload): each step leaves no dirty or cached pages behind, and no step
    /// moves data that a later step will replace anyway. Returns the new generation.
    pub fn commit_uncached(&mut self) -> Result<u64, StoreError> {
        use std::os::fd::AsRawFd;
        self.check_writable()?;
        for &id in &self.dirty {
            let seg = &self.segments[&id];
            // From the page holding the first pending byte: that page was left cached by the
            // step before, clean now.
            let from = basics::PageSize::BASE.align_down(seg.committed_len);
            let (Ok(offset), Ok(len)) = (
                libc::off64_t::try_from(from),
                libc::off64_t::try_from(seg.len - from),
            ) else {
                return Err(StoreError::Io {
                    op: "write back",
                    path: seg.path.clone(),
                    source: io::Error::from_raw_os_error(libc::EFBIG),
                });
            };
            let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
                | libc::SYNC_FILE_RANGE_WRITE
                | libc::SYNC_FILE_RANGE_WAIT_AFTER;
            // SAFETY: sync_file_range on our own open descriptor; it only starts and waits
            // for writeback.
            let rc = unsafe { libc::sync_file_range(seg.file.as_raw_fd(), offset, len, flags) };
            if rc != 0 {
                return Err(StoreError::Io {
                    op: "write back",
                    path: seg.path.clone(),
                    source: io::Error::last_os_error(),
                });
            }
            // SAFETY: fadvise on our own open descriptor; it only affects caching.
            let rc = unsafe {
                // Length 0: to the end of the file, its last partial page included.
                libc::posix_fadvise(seg.file.as_raw_fd(), offset, 0, libc::POSIX_FADV_DONTNEED)
            };
            if rc != 0 {
                return Err(StoreError::Io {
                    op: "drop the page cache of",
                    path: seg.path.clone(),
                    source: io::Error::from_raw_os_error(rc),
                });
            }
        }
        self.write_index()?;
        Ok(self.generation)
    }

    /// Syncs dirty segments, then atomically replaces the index with the current state
    /// (without the syncs under [`Durability::Process`]).
    pub(super) fn write_index(&mut self) -> Result<(), StoreError> {
        let sync = self.options.durability == Durability::Host;
        for &id in self.dirty.iter().filter(|_| sync) {
            let seg = &self.segments[&id];
            seg.file
                .sync_data()
                .map_err(StoreError::io("sync segment", seg.path.clone()))?;
            self.syncs += 1;
        }
        let generation =
            self.generation
                .checked_add(1)
                .ok_or_else(|| StoreError::GenerationsExhausted {
                    dir: self.dir.clone(),
                })?;
        let index = Index {
            sealed: self.how.sealed,
            block_size: self.block_size,
            codec: self.codec,
            image_size: self.image_size,
            generation,
            next_segment: self.next_segment,
            segments: self
                .segments
                .iter()
                .map(|(&id, seg)| (id, seg.len))
                .collect(),
            slots: self.slots.clone(),
            meta: self.meta.clone(),
        };
        let bytes = index.encode();
        // Old or new, never neither: an index this build could not open again is not
        // committed (decoding is far cheaper than the fsyncs around it).
        Index::decode(&bytes).map_err(StoreError::Unloadable)?;
        let tmp = self.dir.join(INDEX_TMP);
        let result = write_private_file(&tmp, &bytes, sync).and_then(|()| {
            fs::rename(&tmp, self.dir.join(INDEX_FILE))
                .map_err(StoreError::io("rename index", &tmp))
        });
        if let Err(e) = result {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        if sync {
            // The index file's and the directory's.
            self.syncs += 2;
            sync_dir(&self.dir)?;
        }
        self.generation = index.generation;
        for seg in self.segments.values_mut() {
            seg.committed_len = seg.len;
        }
        self.dirty.clear();
        self.committed = Committed {
            image_size: index.image_size,
            slots: index.slots,
            meta: index.meta,
        };
        Ok(())
    }
}
