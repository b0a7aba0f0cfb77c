//! The resident limit: a cap, set by whoever governs the host's memory, on the guest RAM a
//! pager keeps mapped.
//!
//! While a limit is set, every install of non-resident pages (a fault's block span, a
//! prefetch or eager-load run) first *reserves* its pages: the reservation succeeds only if
//! the pages mapped now, plus those other installers have reserved, plus its own stay within
//! the limit, so concurrent fault threads and the prefetcher never overshoot it together. A
//! fault whose reservation fails is *held*: its fault thread keeps it pending and retries it
//! when the limit rises, a discard lowers the count, or its short poll times out. Without a
//! limit the only cost is one relaxed load per install.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use crate::addr::PAGE_SIZE;

/// No limit.
const NONE: u64 = u64::MAX;
/// Held faults are reported to the callback at most this often.
pub(crate) const REPORT_EVERY: Duration = Duration::from_millis(10);

/// Called (from a fault thread) when faults are held, with the bytes by which the limit falls
/// short of serving every held fault.
pub type HeldHandler = Box<dyn Fn(u64) + Send + Sync>;

/// A pager's resident limit and what is held at it.
pub(crate) struct ResidentLimit {
    /// The limit in bytes; [`NONE`] for none.
    bytes: AtomicU64,
    /// Pages reserved by installs in progress.
    reserved: AtomicU64,
    /// Pages the held faults would install.
    held_pages: AtomicU64,
    on_held: RwLock<Option<HeldHandler>>,
    /// When the callback was last called.
    reported: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for ResidentLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentLimit")
            .field("bytes", &self.get())
            .field("reserved", &self.reserved.load(Ordering::Relaxed))
            .field("held_pages", &self.held_pages.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Pages reserved under the limit, released on drop (once they are counted resident, or were
/// not installed after all).
#[must_use]
pub(crate) struct Reservation<'a> {
    limit: Option<&'a ResidentLimit>,
    pages: u64,
}

impl Reservation<'_> {
    /// A reservation without a limit: any number of pages.
    pub fn unlimited() -> Self {
        Self {
            limit: None,
            pages: 0,
        }
    }

    /// The most pages the holder may install: all it reserved, or any number without a limit.
    pub fn max_pages(&self) -> u64 {
        match self.limit {
            Some(_) => self.pages,
            None => u64::MAX,
        }
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Some(limit) = self.limit {
            limit.reserved.fetch_sub(self.pages, Ordering::Relaxed);
        }
    }
}

impl ResidentLimit {
    /// No limit, nothing held.
    pub fn new() -> Self {
        Self {
            bytes: AtomicU64::new(NONE),
            reserved: AtomicU64::new(0),
            held_pages: AtomicU64::new(0),
            on_held: RwLock::new(None),
            reported: Mutex::new(None),
        }
    }

    /// The limit in bytes, if one is set.
    pub fn get(&self) -> Option<u64> {
        let bytes = self.bytes.load(Ordering::Relaxed);
        (bytes != NONE).then_some(bytes)
    }

    /// Sets or removes the limit.
    pub fn set(&self, bytes: Option<u64>) {
        // A limit of u64::MAX bytes limits nothing: it is stored as none.
        self.bytes.store(bytes.unwrap_or(NONE), Ordering::Relaxed);
    }

    /// True if a limit is set (one relaxed load: the whole cost on the fault path without).
    pub fn is_set(&self) -> bool {
        self.bytes.load(Ordering::Relaxed) != NONE
    }

    /// Reserves `pages` more pages next to `resident` mapped ones; `None` if that would cross
    /// the limit. Without a limit, an empty reservation that allows any number of pages.
    pub fn reserve(&self, resident: u64, pages: u64) -> Option<Reservation<'_>> {
        let limit = self.bytes.load(Ordering::Relaxed);
        if limit == NONE {
            return Some(Reservation::unlimited());
        }
        let limit_pages = limit / PAGE_SIZE;
        let mut reserved = self.reserved.load(Ordering::Relaxed);
        loop {
            let after = resident.saturating_add(reserved).saturating_add(pages);
            if after > limit_pages {
                return None;
            }
            match self.reserved.compare_exchange_weak(
                reserved,
                reserved + pages,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Some(Reservation {
                        limit: Some(self),
                        pages,
                    })
                }
                Err(now) => reserved = now,
            }
        }
    }

    /// Pages the held faults would install.
    pub fn held_pages(&self) -> u64 {
        self.held_pages.load(Ordering::Relaxed)
    }

    /// A held fault now needs `now` pages where it needed `before` (0: it was not held).
    pub fn held_changed(&self, before: u64, now: u64) {
        if now > before {
            self.held_pages.fetch_add(now - before, Ordering::Relaxed);
        } else {
            self.held_pages.fetch_sub(before - now, Ordering::Relaxed);
        }
    }

    /// Bytes by which the limit falls short of serving every held fault next to `resident`
    /// mapped pages (0 if it does not, or there is no limit).
    pub fn shortfall(&self, resident: u64) -> u64 {
        let Some(limit) = self.get() else {
            return 0;
        };
        let need = resident
            .saturating_add(self.reserved.load(Ordering::Relaxed))
            .saturating_add(self.held_pages())
            .saturating_mul(PAGE_SIZE);
        need.saturating_sub(limit / PAGE_SIZE * PAGE_SIZE)
    }

    /// Sets the callback for held faults.
    pub fn on_held(&self, handler: HeldHandler) {
        *self.on_held.write() = Some(handler);
    }

    /// Calls the callback with `shortfall` unless it was called less than [`REPORT_EVERY`]
    /// ago; true if it was called (or there is none to call).
    pub fn report(&self, shortfall: u64) -> bool {
        {
            let mut reported = self.reported.lock();
            let now = Instant::now();
            if reported.is_some_and(|at| now.duration_since(at) < REPORT_EVERY) {
                return false;
            }
            *reported = Some(now);
        }
        if let Some(handler) = self.on_held.read().as_ref() {
            handler(shortfall);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_reservations_never_cross_it_together() {
        let limit = ResidentLimit::new();
        assert!(limit.reserve(1 << 40, 1 << 40).is_some(), "no limit");
        limit.set(Some(10 * PAGE_SIZE));
        let a = limit.reserve(4, 4).expect("8 of 10");
        assert!(limit.reserve(4, 4).is_none(), "12 of 10");
        let b = limit.reserve(4, 2).expect("10 of 10");
        assert_eq!((a.max_pages(), b.max_pages()), (4, 2));
        drop(a);
        assert!(limit.reserve(4, 4).is_some(), "4 + 2 + 4 of 10");
        limit.set(None);
        assert_eq!(limit.get(), None);
        assert_eq!(
            limit.reserve(100, 100).map(|r| r.max_pages()),
            Some(u64::MAX)
        );
    }

    #[test]
    fn limit_shortfall_counts_every_held_page() {
        let limit = ResidentLimit::new();
        limit.set(Some(8 * PAGE_SIZE + 100));
        limit.held_changed(0, 16);
        assert_eq!(limit.shortfall(8), 16 * PAGE_SIZE);
        limit.held_changed(16, 4);
        assert_eq!(limit.shortfall(6), 2 * PAGE_SIZE);
        limit.held_changed(4, 0);
        assert_eq!(limit.shortfall(6), 0);
    }

    #[test]
    fn limit_reports_at_most_once_per_interval() {
        let limit = ResidentLimit::new();
        let calls = std::sync::Arc::new(AtomicU64::new(0));
        let seen = std::sync::Arc::clone(&calls);
        limit.on_held(Box::new(move |bytes| {
            seen.fetch_add(bytes, Ordering::Relaxed);
        }));
        assert!(limit.report(5));
        assert!(!limit.report(7));
        std::thread::sleep(REPORT_EVERY);
        assert!(limit.report(11));
        assert_eq!(calls.load(Ordering::Relaxed), 16);
    }
}
