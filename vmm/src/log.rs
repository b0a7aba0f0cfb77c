//! What the VMM's library code has to say, and the only place it says it: library code does
//! not print (clippy's `disallowed_macros` holds every other place of the library to it, and
//! the suite's `house` test checks it too).
//!
//! - [`line`] (through [`log_line!`](crate::log::log_line)): one line on stderr, the log of
//!   the process (a VM's `pvisor run`, kept in the job's log when detached; the governor
//!   daemon's). A line a guest or a peer can cause goes through a [`RateLimit`] first.
//!
//! A daemon's readiness line on stdout (its socket, which the command that started it waits
//! for) is `uffd_pager::socket::announce`.

pub use uffd_pager::server::RateLimit;

/// Writes one line of the process's log.
#[allow(
    clippy::disallowed_macros,
    reason = "the process's log on stderr is this function"
)]
pub fn line(args: std::fmt::Arguments<'_>) {
    eprintln!("{args}");
}

/// `log_line!("…", …)`: [`line`] with `format!`'s arguments.
macro_rules! log_line {
    ($($arg:tt)*) => {
        $crate::log::line(format_args!($($arg)*))
    };
}
pub(crate) use log_line;
