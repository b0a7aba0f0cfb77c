//! The host's side of the guest's phase arenas (docs/arenas.md): a report on the arena port is
//! checked by [`arena::Registry`], then acted on here. An open installs the arena's zero
//! pages; a discard close drops its memory at once; a survive close sends it to the pool or
//! the offload store, marked to come back together; a free makes its memory free, dropped when
//! the guest goes idle unless an arena opens on it first.
//!
//! Why a free waits: an agent's harness frees the last phase's arena and opens the next one in
//! the same step, on the same extents. Dropping the freed memory at once means the next open
//! pays for every page again (on this nested host a new page costs about as much as a fault,
//! 64 MiB about 0.1 s), for memory that was out of use for microseconds. Freed memory is
//! dropped at the guest's idle report, at the end of the command batch (the workload guest
//! waits for the next one), before the governor's offload, or [`FREE_GRACE`] after the free
//! at the latest, whichever comes first.

use std::time::{Duration, Instant};

use uffd_pager::addr::PAGE_SIZE;

use super::{Machine, MachineError};
use crate::arena;
use crate::guest::Refused;

/// Freed arena memory is dropped at the latest this long after its free (checked at the
/// vCPU's exits).
pub(super) const FREE_GRACE: Duration = Duration::from_millis(200);

impl Machine {
    /// Serves an arena report: the report in guest page `page` (the `out`'s value) is
    /// checked by the registry, what it asks is done, and the guest gets 0 or an errno in
    /// its status. A report the host cannot even read (not a 32-bit `out`, a page outside
    /// RAM) is counted and answered nowhere.
    pub(super) fn arena_report(&mut self, page: Option<u32>) -> Result<(), MachineError> {
        let gpa = match arena::report_gpa(page, self.ram.size()) {
            Ok(gpa) => gpa,
            Err(reason) => {
                self.arenas.refuse_malformed(reason);
                return Ok(());
            }
        };
        let report: arena::Report = self.read(gpa)?;
        let status = match self.arenas.report(&report, Instant::now()) {
            Ok(action) => {
                self.arena_act(action);
                0
            }
            Err(Refused { errno, .. }) => {
                // A refused idle report leaves no older one to stand for it.
                if report.kind == arena::Kind::Idle as u16 {
                    self.idle_report = None;
                }
                u64::try_from(errno).unwrap_or(22)
            }
        };
        self.write(
            gpa + std::mem::offset_of!(arena::Report, status) as u64,
            status,
        )
    }

    /// Does what an accepted arena report asks, and counts it from the pages' states before
    /// and after. The extents were checked (whole 2 MiB of the application memory); a drop,
    /// offload or compression that fails leaves the memory where it was (counted as kept),
    /// never anything else.
    fn arena_act(&mut self, action: arena::Action) {
        let (extents, survive) = match action {
            arena::Action::None => return,
            arena::Action::Idle(timer) => {
                self.drop_freed_arenas();
                self.idle_report = Some(timer.map(|t| Instant::now() + t));
                return;
            }
            arena::Action::Populate(extents) => {
                self.arena_populate(&extents);
                return;
            }
            arena::Action::Free(extents) => {
                self.freed_arenas.extend(extents);
                self.freed_since.get_or_insert_with(Instant::now);
                return;
            }
            arena::Action::Drop(extents) => (extents, false),
            arena::Action::Survive(extents) => (extents, true),
        };
        self.arena_extents(&extents, survive);
    }

    /// Drops (`survive` false) or moves out (true) each extent, counted from page states.
    fn arena_extents(&mut self, extents: &[(u64, u64)], survive: bool) {
        let mut done = arena::Outcome::default();
        for &(gpa, len) in extents {
            let before = self.pager.counts_in(gpa, len);
            if let Err(failure) = self.arena_extent(gpa, len, survive) {
                done.failure = Some(failure);
            }
            let after = self.pager.counts_in(gpa, len);
            let gone = |b: u64, a: u64| b.saturating_sub(a) * PAGE_SIZE;
            let came = |b: u64, a: u64| a.saturating_sub(b) * PAGE_SIZE;
            if survive {
                done.offloaded += came(before.stored, after.stored);
                done.compressed += came(before.pooled, after.pooled);
            } else {
                done.dropped += gone(before.resident, after.resident);
            }
            done.kept += after.resident * PAGE_SIZE;
        }
        self.arenas.record(done);
    }

    /// Drops the memory of arenas freed since the last drop (see the module documentation).
    pub(super) fn drop_freed_arenas(&mut self) {
        self.freed_since = None;
        let freed = std::mem::take(&mut self.freed_arenas);
        if !freed.is_empty() {
            self.arena_extents(&freed, false);
        }
    }

    /// Drops freed arena memory whose grace is over.
    pub(super) fn drop_freed_arenas_due(&mut self) {
        if self
            .freed_since
            .is_some_and(|at| at.elapsed() >= FREE_GRACE)
        {
            self.drop_freed_arenas();
        }
    }

    /// Installs the zero pages of a newly opened arena's extents, which the guest fills
    /// next: one install per block instead of a fault per block. Freed memory it opens on
    /// is the guest's again, and stays. A failure leaves the pages to their faults.
    fn arena_populate(&mut self, extents: &[(u64, u64)]) {
        for &extent in extents {
            self.freed_arenas = self
                .freed_arenas
                .iter()
                .flat_map(|&free| subtract(free, extent))
                .collect();
        }
        let mut done = arena::Outcome::default();
        for &(gpa, len) in extents {
            let Some(range) = self.ram.host_range(gpa, len) else {
                continue;
            };
            match self.pager.populate(range) {
                Ok(pages) => done.populated += pages * PAGE_SIZE,
                Err(e) => done.failure = Some(basics::error_chain(&e)),
            }
        }
        self.arenas.record(done);
    }

    /// Drops one extent, or (`survive`) sends it to the offload store or the pool, marked to
    /// come back together (its next reader reads all of it).
    fn arena_extent(&mut self, gpa: u64, len: u64, survive: bool) -> Result<(), String> {
        if !survive {
            return self.drop_free(gpa, len).map_err(|refused| refused.reason);
        }
        let range = self
            .ram
            .host_range(gpa, len)
            .ok_or_else(|| format!("arena extent at {gpa:#x} is outside RAM"))?;
        // The vCPU is out of the guest: nothing writes the extent meanwhile.
        if let Some(config) = &self.arena_offload {
            let _held = self
                .cold
                .as_ref()
                .map(uffd_pager::cold::Cold::hold_compression);
            self.pager
                .offload_range(config, range)
                .map_err(|e| basics::error_chain(&e))?;
        } else if let Some(cold) = &self.cold {
            cold.compress_now(range);
        }
        self.pager.restore_together(range);
        Ok(())
    }
}

/// The parts of range `from` outside range `cut` (both `(start, len)`).
fn subtract(from: (u64, u64), cut: (u64, u64)) -> impl Iterator<Item = (u64, u64)> {
    let (start, end) = (from.0, from.0 + from.1);
    let (lo, hi) = (cut.0.max(start), (cut.0 + cut.1).min(end));
    let parts = if lo >= hi {
        [Some(from), None]
    } else {
        [
            (start < lo).then_some((start, lo - start)),
            (hi < end).then_some((hi, end - hi)),
        ]
    };
    parts.into_iter().flatten()
}

#[cfg(test)]
mod tests {
    use super::subtract;

    #[test]
    fn subtract_keeps_what_lies_outside_the_cut() {
        let parts = |from, cut| subtract(from, cut).collect::<Vec<_>>();
        // Apart, or touching: all of it.
        assert_eq!(parts((10, 10), (30, 5)), vec![(10, 10)]);
        assert_eq!(parts((10, 10), (20, 5)), vec![(10, 10)]);
        assert_eq!(parts((10, 10), (0, 10)), vec![(10, 10)]);
        // Covered: nothing.
        assert_eq!(parts((10, 10), (10, 10)), vec![]);
        assert_eq!(parts((10, 10), (0, 40)), vec![]);
        // A head, a tail, a hole.
        assert_eq!(parts((10, 10), (15, 10)), vec![(10, 5)]);
        assert_eq!(parts((10, 10), (5, 10)), vec![(15, 5)]);
        assert_eq!(parts((10, 10), (12, 3)), vec![(10, 2), (15, 5)]);
    }
}
