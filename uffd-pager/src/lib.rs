//! The lazy memory service: serves guest-RAM page faults through userfaultfd from the zero
//! page, a compressed memory pool, an on-disk store or a raw memory file.
//!
//! - [`addr`]: host addresses and page-aligned ranges.
//! - [`uffd`]: the safe userfaultfd wrapper.
//! - [`metrics`]: counters and the fault-latency histogram.

pub mod addr;
pub mod metrics;
pub mod uffd;
