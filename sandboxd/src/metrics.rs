//! `GET /metrics`, in Prometheus' text format (0.0.4): sandboxes by state, what each live
//! sandbox's VM is charged for now and the sum, and counters of what the daemon did (creates
//! and refusals, pauses, idle offloads, commands, resumes with a latency histogram). Behind the
//! API key like the lifecycle API: it names every sandbox.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::governed::Room;
use crate::model::State;
use crate::store::Record;

/// Upper bounds of the resume histogram's buckets, seconds.
const RESUME_BUCKETS: [f64; 9] = [0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// A latency histogram (cumulative buckets as Prometheus wants them, summed at render).
#[derive(Debug, Default)]
pub struct Histogram {
    /// Observations per bucket of [`RESUME_BUCKETS`], and one past the last.
    buckets: [AtomicU64; RESUME_BUCKETS.len() + 1],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    /// Counts one observation.
    pub fn observe(&self, took: Duration) {
        let secs = took.as_secs_f64();
        let at = RESUME_BUCKETS
            .iter()
            .position(|&bound| secs <= bound)
            .unwrap_or(RESUME_BUCKETS.len());
        self.buckets[at].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(
            u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, bound) in RESUME_BUCKETS.iter().enumerate() {
            cumulative += self.buckets[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        cumulative += self.buckets[RESUME_BUCKETS.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cumulative}");
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(
            out,
            "{name}_count{{{labels}}} {}",
            self.count.load(Ordering::Relaxed)
        );
    }
}

/// What the daemon counts.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Sandboxes created (admitted).
    pub creates: AtomicU64,
    /// Creates refused for want of room in the memory budget.
    pub creates_refused: AtomicU64,
    /// Pauses done (each an offload, unless the daemon had offloaded it while idle).
    pub pauses: AtomicU64,
    /// Offloads the daemon did on its own, of sandboxes idle past `--idle-offload`.
    pub idle_offloads: AtomicU64,
    /// Commands started.
    pub commands: AtomicU64,
    /// Commands of sandboxes offloaded while idle that waited for room in the budget before
    /// their VM came back (see `sandboxes::gate`).
    pub commands_waited: AtomicU64,
    /// Resumes asked for through the API, by how long the VM took to come back.
    pub resumes: Histogram,
    /// Sandboxes offloaded while idle brought back for a command, by how long that took (the
    /// latency the command's client saw before its command started).
    pub idle_resumes: Histogram,
    /// Creates admitted, by how long they waited for room in the memory budget.
    pub admission: Histogram,
    /// Requests refused past `--max-request-rate`.
    pub rate_limited: AtomicU64,
}

/// One live sandbox as the metrics show it: its id and what its VM is charged for now
/// (`None`: it did not answer).
pub type Charged = (String, Option<u64>);

impl Metrics {
    /// The text of `GET /metrics` for `records` (all sandboxes), the charges of the live, and
    /// the memory governor's `room` and `status` (its decisions).
    pub fn render(
        &self,
        records: &[Record],
        charged: &[Charged],
        room: &Room,
        status: &vmm::governor::policy::Status,
    ) -> String {
        let mut out = String::new();
        let help = |out: &mut String, name: &str, kind: &str, text: &str| {
            let _ = writeln!(out, "# HELP {name} {text}\n# TYPE {name} {kind}");
        };
        help(&mut out, "pvisor_sandboxes", "gauge", "Sandboxes by state.");
        for state in State::ALL {
            let n = records.iter().filter(|r| r.state == state).count();
            let _ = writeln!(out, "pvisor_sandboxes{{state=\"{}\"}} {n}", state.name());
        }
        help(
            &mut out,
            "pvisor_sandbox_memory_charged_bytes",
            "gauge",
            "What each live sandbox's VM is charged for now (its memory cgroup's usage, else its process memory).",
        );
        let mut total = 0;
        for (id, bytes) in charged {
            if let Some(bytes) = bytes {
                total += bytes;
                let _ = writeln!(
                    out,
                    "pvisor_sandbox_memory_charged_bytes{{id=\"{id}\"}} {bytes}"
                );
            }
        }
        help(
            &mut out,
            "pvisor_sandboxes_memory_charged_bytes",
            "gauge",
            "The sum of pvisor_sandbox_memory_charged_bytes.",
        );
        let _ = writeln!(out, "pvisor_sandboxes_memory_charged_bytes {total}");
        let counters: [(&str, &AtomicU64, &str); 7] = [
            (
                "pvisor_sandbox_requests_rate_limited_total",
                &self.rate_limited,
                "Requests refused past --max-request-rate.",
            ),
            (
                "pvisor_sandbox_creates_total",
                &self.creates,
                "Sandboxes created.",
            ),
            (
                "pvisor_sandbox_creates_refused_total",
                &self.creates_refused,
                "Creates refused: the memory budget had no room.",
            ),
            (
                "pvisor_sandbox_pauses_total",
                &self.pauses,
                "Pauses (offloads) done.",
            ),
            (
                "pvisor_sandbox_idle_offloads_total",
                &self.idle_offloads,
                "Offloads of sandboxes idle past --idle-offload, done by the daemon.",
            ),
            (
                "pvisor_sandbox_commands_total",
                &self.commands,
                "Commands started.",
            ),
            (
                "pvisor_sandbox_commands_waited_total",
                &self.commands_waited,
                "Commands that waited for room in the memory budget before their idle-offloaded VM came back.",
            ),
        ];
        for (name, value, text) in counters {
            help(&mut out, name, "counter", text);
            let _ = writeln!(out, "{name} {}", value.load(Ordering::Relaxed));
        }
        help(
            &mut out,
            "pvisor_sandbox_resume_seconds",
            "histogram",
            "How long a VM took to come back: asked for (api) or for a command after an idle offload (idle).",
        );
        self.resumes
            .render(&mut out, "pvisor_sandbox_resume_seconds", "by=\"api\"");
        self.idle_resumes
            .render(&mut out, "pvisor_sandbox_resume_seconds", "by=\"idle\"");
        help(
            &mut out,
            "pvisor_sandbox_admission_seconds",
            "histogram",
            "How long admitted creates waited for room in the memory budget.",
        );
        self.admission
            .render(&mut out, "pvisor_sandbox_admission_seconds", "by=\"api\"");
        let gauges: [(&str, u64, &str); 4] = [
            (
                "pvisor_governor_budget_bytes",
                room.budget,
                "The memory budget (--memory-budget).",
            ),
            (
                "pvisor_governor_usage_bytes",
                room.usage,
                "What the sandboxes' VMs are charged, as the governor counts it.",
            ),
            (
                "pvisor_governor_reclaimable_bytes",
                room.reclaimable,
                "What the VMs running no command hold beyond their floor.",
            ),
            (
                "pvisor_governor_vms",
                room.vms as u64,
                "VMs joined to the memory governor.",
            ),
        ];
        for (name, value, text) in gauges {
            help(&mut out, name, "gauge", text);
            let _ = writeln!(out, "{name} {value}");
        }
        help(
            &mut out,
            "pvisor_governor_decisions_total",
            "counter",
            "The memory governor's decisions, by kind (offloads ordered, grants, ...).",
        );
        // Every kind the governor counts, by its name (so a new kind shows up by itself).
        let decisions = serde_json::to_value(status.decisions).unwrap_or_default();
        if let Some(decisions) = decisions.as_object() {
            for (kind, n) in decisions {
                if let Some(n) = n.as_u64() {
                    let _ = writeln!(
                        out,
                        "pvisor_governor_decisions_total{{kind=\"{kind}\"}} {n}"
                    );
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_end_at_inf() {
        let h = Histogram::default();
        h.observe(Duration::from_millis(20));
        h.observe(Duration::from_millis(300));
        h.observe(Duration::from_secs(60));
        let mut out = String::new();
        h.render(&mut out, "x", "by=\"api\"");
        assert!(
            out.contains("x_bucket{by=\"api\",le=\"0.025\"} 1\n"),
            "{out}"
        );
        assert!(out.contains("x_bucket{by=\"api\",le=\"0.5\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{by=\"api\",le=\"10\"} 2\n"), "{out}");
        assert!(
            out.contains("x_bucket{by=\"api\",le=\"+Inf\"} 3\n"),
            "{out}"
        );
        assert!(out.contains("x_count{by=\"api\"} 3\n"), "{out}");
        assert!(out.contains("x_sum{by=\"api\"} 60.32\n"), "{out}");
    }
}
