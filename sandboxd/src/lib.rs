//! `pvisor-sandboxd`: a host daemon that serves OpenSandbox's lifecycle API and a minimal
//! execd over `vmm` VMs, one detached VM process per sandbox (docs/sandboxd.md).
//!
//! - [`api`]: the HTTP server: the lifecycle API under `/v1`, errors, bodies, the API key.
//! - [`clock`]: Unix milliseconds and RFC 3339.
//! - [`execd`]: each sandbox's execd (`/ping`, `/command` as a server-sent event stream).
//! - [`listener`]: the listener, a bounded number of connections at once.
//! - [`metrics`]: `GET /metrics` in Prometheus' text format, and the counters behind it.
//! - [`model`]: the API's wire types, states and input checks.
//! - [`sandboxes`]: the sandboxes' records and state machine.
//! - [`store`]: the state directory (0700, records written atomically).
//! - [`vm`]: a sandbox's VM: start, control calls, stop.

// Library code does not print (clippy.toml's `disallowed-macros`): the daemon logs through
// `tracing`.
#![cfg_attr(not(test), warn(clippy::disallowed_macros))]

pub mod api;
pub mod clock;
pub mod execd;
pub mod governed;
pub mod listener;
pub mod metrics;
pub mod model;
pub mod sandboxes;
pub mod store;
pub mod templates;
pub mod vm;
