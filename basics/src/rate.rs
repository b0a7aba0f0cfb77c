//! Logs that a guest or a peer can cause (an unserved fault, a refused connection), kept to a
//! burst per interval so that whoever causes them cannot flood the log; what is kept back is
//! counted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Allows a burst of messages, then one per interval, counting what it suppresses.
#[derive(Debug)]
pub struct RateLimit {
    state: Mutex<(Instant, u32)>,
    suppressed: AtomicU64,
    burst: u32,
    interval: Duration,
}

impl RateLimit {
    /// `burst` messages per `interval`.
    pub fn new(burst: u32, interval: Duration) -> Self {
        Self {
            state: Mutex::new((Instant::now(), 0)),
            suppressed: AtomicU64::new(0),
            burst,
            interval,
        }
    }

    /// True if a message may be logged now; otherwise counts it as suppressed.
    pub fn allow(&self) -> bool {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if state.0.elapsed() >= self.interval {
            *state = (Instant::now(), 0);
        }
        if state.1 < self.burst {
            state.1 += 1;
            true
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            false
        }
    }

    /// Messages suppressed so far.
    pub fn suppressed(&self) -> u64 {
        self.suppressed.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limit_allows_a_burst_per_interval_and_counts_the_rest() {
        let limit = RateLimit::new(2, Duration::from_secs(3600));
        assert!(limit.allow());
        assert!(limit.allow());
        assert!(!limit.allow());
        assert!(!limit.allow());
        assert_eq!(limit.suppressed(), 2);
        // Each interval starts a new burst (here every call is in a new one).
        let every = RateLimit::new(1, Duration::ZERO);
        assert!((0..5).all(|_| every.allow()));
        assert_eq!(every.suppressed(), 0);
    }
}
