//! Pager metrics: plain atomic counters, one doc line each, and a fault-latency histogram.
//! Serializable as JSON through [`Metrics::snapshot`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Sub-buckets per power of two in the latency histogram (relative error ≤ 1/16).
const SUB_BUCKETS: usize = 16;
/// Powers of two covered: 1 ns .. 2^40 ns (about 18 minutes).
const OCTAVES: usize = 40;

/// A lock-free latency histogram with log-linear buckets (about 6% resolution).
#[derive(Debug)]
pub struct Histogram {
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    sum_ns: AtomicU64,
    max_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            buckets: (0..SUB_BUCKETS * OCTAVES)
                .map(|_| AtomicU64::new(0))
                .collect(),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
            max_ns: AtomicU64::new(0),
        }
    }
}

fn bucket_of(ns: u64) -> usize {
    if ns < SUB_BUCKETS as u64 {
        return ns as usize;
    }
    let octave = 63 - ns.leading_zeros() as usize; // ≥ 4
    let shift = octave - 4;
    let sub = ((ns >> shift) as usize) & (SUB_BUCKETS - 1);
    ((octave - 3) * SUB_BUCKETS + sub).min(SUB_BUCKETS * OCTAVES - 1)
}

/// The smallest latency that falls into `bucket` (its lower bound).
fn bucket_floor(bucket: usize) -> u64 {
    if bucket < SUB_BUCKETS {
        return bucket as u64;
    }
    let octave = bucket / SUB_BUCKETS + 3;
    let sub = (bucket % SUB_BUCKETS) as u64;
    (1u64 << octave) | (sub << (octave - 4))
}

impl Histogram {
    /// Records one sample.
    pub fn record(&self, latency: Duration) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.buckets[bucket_of(ns)].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// The latency below which a share `q` (0..=1) of the samples fall (bucket lower bound).
    pub fn quantile(&self, q: f64) -> Duration {
        let counts: Vec<u64> = self
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return Duration::ZERO;
        }
        #[allow(
            clippy::cast_sign_loss,
            reason = "q is clamped to [0, 1]: a non-negative count"
        )]
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil().max(1.0)) as u64;
        let mut seen = 0;
        for (bucket, &n) in counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Duration::from_nanos(bucket_floor(bucket));
            }
        }
        Duration::from_nanos(self.max_ns.load(Ordering::Relaxed))
    }

    /// Summary for reports.
    pub fn summary(&self) -> LatencySummary {
        let count = self.count();
        LatencySummary {
            count,
            mean_us: if count == 0 {
                0.0
            } else {
                self.sum_ns.load(Ordering::Relaxed) as f64 / count as f64 / 1e3
            },
            p50_us: self.quantile(0.5).as_secs_f64() * 1e6,
            p99_us: self.quantile(0.99).as_secs_f64() * 1e6,
            max_us: self.max_ns.load(Ordering::Relaxed) as f64 / 1e3,
        }
    }
}

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct LatencySummary {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Largest sample.
    pub max_us: f64,
}

macro_rules! counters {
    ($(#[$meta:meta])* $name:ident, $snap:ident { $($(#[$doc:meta])* $field:ident),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Default)]
        pub struct $name {
            $($(#[$doc])* pub $field: AtomicU64,)*
            /// Time from reading a fault to waking the faulting thread.
            pub fault_latency: Histogram,
        }

        /// A point-in-time copy of the metrics, for JSON.
        #[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
        pub struct $snap {
            $($(#[$doc])* pub $field: u64,)*
            /// Fault latency percentiles.
            pub fault_latency: LatencySummary,
        }

        impl $name {
            /// Copies every counter.
            pub fn snapshot(&self) -> $snap {
                $snap {
                    $($field: self.$field.load(Ordering::Relaxed),)*
                    fault_latency: self.fault_latency.summary(),
                }
            }
        }
    };
}

counters! {
    /// Counters of one pager (shared by its fault threads, prefetcher and offload).
    Metrics, MetricsSnapshot {
        /// Page-fault events read: every time a thread waited on the pager (synchronous
        /// faults), however they were resolved.
        fault_events,
        /// MISSING faults resolved by copying data (`UFFDIO_COPY`).
        faults_copy,
        /// MISSING faults resolved with the zero page (`UFFDIO_ZEROPAGE`).
        faults_zero,
        /// MINOR faults resolved by mapping the page cache (`UFFDIO_CONTINUE`).
        faults_minor,
        /// Faults that found their page already mapped (EEXIST: another thread or the
        /// prefetcher won the race).
        eexist_races,
        /// Resolutions retried after `EAGAIN` (a `REMOVE` event was pending).
        eagain_retries,
        /// Blocks read from a source (the restore image, the store or the memory pool) by
        /// faults, the prefetcher or an eager load: each block once per load, as one reader
        /// claims it.
        blocks_fetched,
        /// Faults that waited for another thread's read of their block (the prefetcher's)
        /// instead of reading it again.
        fetch_waits,
        /// `REMOVE` events (ranges discarded by the VMM or a balloon; they read as zeros).
        remove_events,
        /// Pages installed by copying (faults and prefetch).
        pages_copied,
        /// Pages mapped as the zero page.
        zero_pages,
        /// Whole blocks installed by one copy because all their pages were missing.
        block_copies,
        /// Bytes decompressed to serve faults and prefetch.
        bytes_decompressed,
        /// Pages installed by the prefetcher.
        prefetch_pages,
        /// Blocks of the recorded working set the prefetcher installed before a fault asked
        /// for them.
        prefetch_hits,
        /// Pages installed ahead of the guest's faults: the rest of a range marked to come
        /// back together after a fault in it, and ranges populated with zero pages.
        ahead_pages,
        /// Pages installed ahead of the guest's faults along the stride of its faults (huge
        /// pages read from a store or a restore image that is not mapped).
        stride_pages,
        /// Faults that could not be served (the faulting process is reported, never fed
        /// wrong data).
        fault_errors,
        /// Pages written to the store by offloads.
        pages_offloaded,
        /// Pages an offload dropped without writing them: their blocks were in the store as
        /// they are (see `offload::clean`).
        pages_clean,
        /// Pages dropped from memory after a durable offload (written or clean).
        pages_dropped,
        /// Faults held at the resident limit at least once (see [`crate::limit`]).
        faults_held,
        /// Faults held at the resident limit right now (a gauge, not a counter).
        held_now,
        /// Microseconds faults spent held at the resident limit, summed over the faults
        /// served after a hold.
        held_us,
        /// Events ignored: kinds the pager never enables (`REMAP`, `FORK`, unknown), and
        /// faults or discards outside every region (reported to the error handler).
        events_ignored,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_within_bucket_resolution() {
        let h = Histogram::default();
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let p50 = h.quantile(0.5).as_secs_f64() * 1e6;
        let p99 = h.quantile(0.99).as_secs_f64() * 1e6;
        assert!((470.0..=500.0).contains(&p50), "{p50}");
        assert!((930.0..=990.0).contains(&p99), "{p99}");
        assert_eq!(h.count(), 1000);
        assert_eq!(h.summary().max_us, 1000.0);
    }

    #[test]
    fn histogram_bucket_floor_is_monotonic_and_bounds_its_samples() {
        let mut last = 0;
        for bucket in 1..SUB_BUCKETS * OCTAVES {
            let floor = bucket_floor(bucket);
            assert!(floor > last, "bucket {bucket}");
            last = floor;
        }
        for ns in [
            0u64,
            1,
            15,
            16,
            17,
            100,
            1_000,
            12_345,
            1 << 30,
            u64::MAX >> 24,
        ] {
            let b = bucket_of(ns);
            assert!(bucket_floor(b) <= ns, "{ns}");
            if b + 1 < SUB_BUCKETS * OCTAVES {
                assert!(ns < bucket_floor(b + 1), "{ns}");
            }
        }
    }

    #[test]
    fn metrics_snapshot_serializes_every_counter() {
        let m = Metrics::default();
        m.faults_copy.fetch_add(3, Ordering::Relaxed);
        m.fault_latency.record(Duration::from_micros(20));
        let json = serde_json::to_value(m.snapshot()).unwrap();
        assert_eq!(json["faults_copy"], 3);
        assert_eq!(json["fault_latency"]["count"], 1);
        assert!(json.get("prefetch_hits").is_some());
    }
}
