//! A command's output when nobody reads it any more (`pvisor stats … | head`): every binary of
//! the workspace ends quietly, as a Unix tool killed by `SIGPIPE` does, with no panic and no
//! backtrace. Rust ignores `SIGPIPE`, so a write to a closed pipe fails with `EPIPE`, and
//! `println!` panics on that; the binaries write through these instead:
//!
//! - [`say!`](crate::say) for what a command is run for (a status, a table, a JSON reply): a
//!   closed pipe returns [`StdoutClosed::Closed`] through `?`, and [`exit_code`] in `main`
//!   turns it into the shell's status for a process `SIGPIPE` ended (141), silently;
//! - [`announce!`](crate::announce) for a line a long-running command prints on its way (a
//!   daemon's socket, "holding until …"): one nobody reads is no reason to stop what it holds,
//!   so a failed write is ignored.

use std::error::Error;
use std::process::ExitCode;

/// Writing a command's output failed: the reader went away, or another error.
#[derive(Debug, thiserror::Error)]
pub enum StdoutClosed {
    /// Nobody reads the output any more.
    #[error("standard output was closed")]
    Closed,
    /// Any other failure to write it.
    #[error("cannot write to standard output")]
    Write(#[source] std::io::Error),
}

impl From<std::io::Error> for StdoutClosed {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            Self::Closed
        } else {
            Self::Write(e)
        }
    }
}

/// The exit status of a command whose reader went away: a shell's for a process that
/// `SIGPIPE` ended (128 + 13).
pub const CLOSED_PIPE_STATUS: u8 = 141;

/// `println!` for a command's output: returns [`StdoutClosed`] through `?` instead of
/// panicking when the write fails (see the [module](crate::output)).
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)
            .map_err($crate::output::StdoutClosed::from)?
    }};
}

/// `println!` for a line printed on the way: a failed write is ignored (see the
/// [module](crate::output)).
#[macro_export]
macro_rules! announce {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// What `main` returns for a command's result: its own code; [`CLOSED_PIPE_STATUS`],
/// silently, when its output was closed; otherwise `FAILURE`, with the error and all its
/// causes printed on stderr after `prefix` (`"pvisor: "`).
pub fn exit_code(prefix: &str, result: Result<ExitCode, Box<dyn Error>>) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(err) if is_closed(&*err) => ExitCode::from(CLOSED_PIPE_STATUS),
        Err(err) => {
            let text = crate::error_chain(&*err);
            // stderr may be closed too: nothing is left to tell.
            let _ = std::io::Write::write_all(
                &mut std::io::stderr().lock(),
                format!("{prefix}{text}\n").as_bytes(),
            );
            ExitCode::FAILURE
        }
    }
}

/// Whether `err` is, or was caused by, a closed standard output.
fn is_closed(err: &(dyn Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        if matches!(e.downcast_ref::<StdoutClosed>(), Some(StdoutClosed::Closed)) {
            return true;
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_pipe_is_closed_other_errors_are_not() {
        let closed = StdoutClosed::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        assert!(matches!(closed, StdoutClosed::Closed));
        let full = StdoutClosed::from(std::io::Error::from(std::io::ErrorKind::StorageFull));
        assert!(matches!(full, StdoutClosed::Write(_)));
    }

    #[test]
    fn exit_code_is_quiet_for_a_closed_pipe_even_when_wrapped() {
        #[derive(Debug, thiserror::Error)]
        #[error("printing the table")]
        struct Wrapper(#[source] StdoutClosed);
        assert!(is_closed(&StdoutClosed::Closed));
        assert!(is_closed(&Wrapper(StdoutClosed::Closed)));
        assert!(!is_closed(&Wrapper(StdoutClosed::Write(
            std::io::Error::from(std::io::ErrorKind::StorageFull)
        ))));
        assert_eq!(
            exit_code("t: ", Err(Box::new(StdoutClosed::Closed))),
            ExitCode::from(CLOSED_PIPE_STATUS)
        );
        assert_eq!(exit_code("t: ", Ok(ExitCode::SUCCESS)), ExitCode::SUCCESS);
    }
}
