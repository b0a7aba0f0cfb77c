//! Operator requests that reach a VM while it waits for a model answer.
//!
//! A command that sends a `model` request keeps the VMM busy until the answer is there, which
//! may be minutes; meanwhile an operator may want to look at the VM (`status`, `stats`), take
//! it over (`suspend`, with or without an offload, and `resume`) or stop it. The machine asks
//! its [`Operator`] for such requests while it waits and answers them itself: a manual suspend
//! makes the VM the operator's (the wait coordinator neither resumes nor offloads it, and an
//! answer that arrives meanwhile is held until the operator's resume), a stop ends the wait
//! with an error for the guest. Requests that need the command to be over (`exec`,
//! `snapshot`) are the operator source's to refuse.

use std::time::Duration;

/// What an operator asks for during a model wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperatorRequest {
    /// The VM's state and the wait's.
    Status,
    /// Memory and pager statistics (those the machine has: no disk or cgroup figures).
    Stats,
    /// Take the VM over: it stays stopped until `Resume`; with `offload`, its RAM goes to the
    /// store.
    Suspend {
        /// Also offload RAM.
        offload: bool,
    },
    /// Give the VM back (loading RAM if it was offloaded); the held answer is delivered.
    Resume {
        /// Load everything before answering.
        eager: bool,
    },
    /// Stop the VM: the wait ends, the guest's request fails.
    Stop,
}

/// Where an operator request's answer goes.
pub type Reply = Box<dyn FnOnce(Result<serde_json::Value, String>) + Send>;

/// A source of operator requests (the VM process's control socket).
pub trait Operator: Send {
    /// The next request that arrives within `timeout` (`None`: none did).
    fn next(&mut self, timeout: Duration) -> Option<(OperatorRequest, Reply)>;
}
