//! Keeping a store in shape: compaction (live payloads out of mostly dead segments),
//! verification of every payload against its checksum, and statistics.

use basics::error_chain;
use std::collections::BTreeSet;
use std::fs;

use super::index::{DataRef, Slot};
use super::segment::Segment;
use super::{
    allocated_bytes, sync_dir, CompactionReport, DiskStore, Problem, StoreError, StoreStats,
    VerifyReport, INDEX_FILE,
};

impl DiskStore {
    /// Runs compaction if the store's options ask for it after every commit
    /// (`auto_compact`): for a writer that committed its steps with
    /// [`commit_uncached`](Self::commit_uncached), once at the end. `None` when the options
    /// say not to.
    pub fn compact_if_auto(&mut self) -> Result<Option<CompactionReport>, StoreError> {
        if !self.options.auto_compact {
            return Ok(None);
        }
        match self.compact() {
            Ok(report) => Ok(Some(report)),
            Err(source) => Err(StoreError::CompactionFailed {
                generation: self.generation,
                source: Box::new(source),
            }),
        }
    }

    /// Rewrites or deletes segments that are mostly dead: commits pending writes first, moves
    /// live payloads out of the chosen segments, commits again, then deletes the old files.
    pub fn compact(&mut self) -> Result<CompactionReport, StoreError> {
        self.check_writable()?;
        if self.has_pending() {
            self.write_index()?;
        }
        let mut report = CompactionReport::default();
        let candidates: BTreeSet<u32> = self
            .segments
            .iter()
            .filter(|(_, seg)| {
                let dead = seg.committed_len.saturating_sub(seg.live);
                let fully_dead = seg.live == 0 && seg.committed_len == seg.len;
                fully_dead
                    || (seg.committed_len >= self.options.compact_min_bytes
                        && seg.committed_len == seg.len
                        && dead as f64
                            >= self.options.compact_dead_ratio * seg.committed_len as f64)
            })
            .map(|(&id, _)| id)
            .collect();
        if candidates.is_empty() {
            return Ok(report);
        }
        if self.active.is_some_and(|id| candidates.contains(&id)) {
            self.active = None;
        }
        let result = self.move_live_out_of(&candidates, &mut report);
        let retired: Vec<(u32, Segment)> = candidates
            .iter()
            .filter_map(|&id| self.segments.remove(&id).map(|seg| (id, seg)))
            .collect();
        if let Err(e) = result.and_then(|()| self.write_index()) {
            self.segments.extend(retired);
            self.slots = self.committed.slots.clone();
            self.recount_live();
            return Err(e);
        }
        for (id, seg) in retired {
            self.forget_segment(id);
            report.segments_removed += 1;
            report.bytes_freed += seg.committed_len;
            fs::remove_file(&seg.path).map_err(StoreError::io("remove segment", &seg.path))?;
        }
        if self.options.durability == super::Durability::Host {
            self.syncs += 1;
            sync_dir(&self.dir)?;
        }
        Ok(report)
    }

    fn move_live_out_of(
        &mut self,
        candidates: &BTreeSet<u32>,
        report: &mut CompactionReport,
    ) -> Result<(), StoreError> {
        let mut payload = Vec::new();
        for block in 0..self.slots.len() as u64 {
            let Slot::Data(data) = self.slots[block as usize] else {
                continue;
            };
            if !candidates.contains(&data.segment) {
                continue;
            }
            self.read_payload(block, &data, &mut payload)?;
            let (segment, offset) = self.append(&[&payload])?;
            report.bytes_moved += payload.len() as u64;
            self.set_slot(
                block,
                Slot::Data(DataRef {
                    segment,
                    offset,
                    ..data
                }),
            );
        }
        Ok(())
    }

    /// Reads and decodes every stored block; lists each one that fails.
    pub fn verify(&self) -> VerifyReport {
        let mut report = VerifyReport::default();
        let mut out = vec![0u8; self.block_size.bytes()];
        for block in 0..self.blocks() {
            let Slot::Data(data) = self.slots[block as usize] else {
                continue;
            };
            let len = self.block_len(block);
            report.blocks_checked += 1;
            report.bytes_checked += u64::from(data.len);
            if let Err(err) = self.get(block, &mut out[..len]) {
                report.problems.push(Problem {
                    block,
                    path: self.segment_path(data.segment),
                    offset: data.offset,
                    reason: error_chain(&err),
                });
            }
        }
        report
    }

    /// Counts and sizes.
    pub fn stats(&self) -> StoreStats {
        let mut stats = StoreStats {
            image_size: self.image_size,
            block_size: self.block_size.bytes_u64(),
            codec: self.codec.codec.to_string(),
            blocks: self.blocks(),
            generation: self.generation,
            segments: self.segments.len() as u64,
            ..StoreStats::default()
        };
        for (block, slot) in self.slots.iter().enumerate() {
            if matches!(slot, Slot::Absent) {
                continue;
            }
            stats.present_blocks += 1;
            stats.raw_bytes += self.block_len(block as u64) as u64;
            match slot {
                Slot::Absent => {}
                Slot::Zero => stats.zero_blocks += 1,
                Slot::Fill(_) => stats.fill_blocks += 1,
                Slot::Data(data) => {
                    stats.stored_bytes += u64::from(data.len);
                    if data.kind.is_compressed() {
                        stats.compressed_blocks += 1;
                    } else {
                        stats.raw_blocks += 1;
                    }
                }
            }
        }
        let mut live = 0;
        for seg in self.segments.values() {
            stats.segment_bytes += seg.len;
            live += seg.live;
            stats.disk_bytes += allocated_bytes(&seg.path);
        }
        stats.dead_bytes = stats.segment_bytes.saturating_sub(live);
        stats.disk_bytes += allocated_bytes(&self.dir.join(INDEX_FILE));
        stats.ratio = stats.raw_bytes as f64 / stats.disk_bytes.max(1) as f64;
        stats
    }
}
