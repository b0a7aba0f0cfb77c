//! TEMPORARY STUB (not committed): the shape of the policy being written by a helper.
#![allow(missing_docs, unused)]
use std::time::{Duration, Instant};
#[derive(Debug, Clone)]
pub struct Config {
    pub budget: u64,
    pub high_watermark: f64,
    pub low_watermark: f64,
    pub grant: u64,
    pub initial_limit: u64,
    pub default_overhead: u64,
    pub stale_after: Duration,
    pub order_timeout: Duration,
    pub pressure_cold_age: Duration,
}
impl Config {
    pub fn check(&self) -> Result<(), String> {
        Ok(())
    }
}
pub type VmId = u64;
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum VmState {
    Running,
    Waiting {
        expected_remaining: Option<Duration>,
    },
    Idle,
    Offloaded,
}
#[derive(Debug, Clone, Copy, Default)]
pub struct Reading {
    pub resident: u64,
    pub cgroup: Option<u64>,
    pub pss: Option<u64>,
    pub held: u64,
}
#[derive(Debug, Clone, Copy, Default)]
pub struct Pressure {
    pub total_usage: Option<u64>,
    pub psi_some_avg10: Option<f64>,
    pub failcnt: Option<u64>,
}
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Join,
}
impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "join")
    }
}
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    SetLimit {
        vm: VmId,
        limit: u64,
        reason: Reason,
    },
    Offload {
        vm: VmId,
        reason: Reason,
    },
    ColdCompress {
        vm: VmId,
        age: Duration,
        reason: Reason,
    },
    Unlimit {
        vm: VmId,
        reason: Reason,
    },
}
#[derive(Debug, Clone, serde::Serialize)]
pub struct Status {
    pub budget: u64,
}
#[derive(Debug)]
pub struct Governor {
    c: Config,
    n: u64,
}
impl Governor {
    pub fn new(config: Config) -> Self {
        Self { c: config, n: 0 }
    }
    pub fn join(
        &mut self,
        now: Instant,
        name: String,
        memory_bytes: u64,
        reading: Reading,
    ) -> (VmId, Vec<Decision>) {
        self.n += 1;
        (self.n, vec![])
    }
    pub fn leave(&mut self, vm: VmId) {}
    pub fn state(&mut self, now: Instant, vm: VmId, state: VmState) -> Vec<Decision> {
        vec![]
    }
    pub fn reading(&mut self, now: Instant, vm: VmId, reading: Reading) {}
    pub fn request(&mut self, now: Instant, vm: VmId, bytes: u64) -> Vec<Decision> {
        vec![]
    }
    pub fn offloaded(
        &mut self,
        now: Instant,
        vm: VmId,
        resident_after: u64,
        ok: bool,
    ) -> Vec<Decision> {
        vec![]
    }
    pub fn tick(&mut self, now: Instant, pressure: Pressure) -> Vec<Decision> {
        vec![]
    }
    pub fn status(&self, now: Instant) -> Status {
        Status {
            budget: self.c.budget,
        }
    }
}
impl Config {
    pub fn new(budget: u64) -> Self {
        Self {
            budget,
            high_watermark: 0.9,
            low_watermark: 0.8,
            grant: 16 << 20,
            initial_limit: 64 << 20,
            default_overhead: 24 << 20,
            stale_after: Duration::from_secs(3),
            order_timeout: Duration::from_secs(5),
            pressure_cold_age: Duration::from_millis(500),
        }
    }
}
