//! `uffd-pager`: the lazy memory service's command line.
//!
//! Store commands (`pack`, `unpack`, `verify`, `info`, `mount`) work on the compressed block
//! store of `compressed-backing`.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => code,
        // Nobody reads the output any more (`… | head`): end quietly.
        Err(err)
            if matches!(
                err.downcast_ref::<cli::StdoutClosed>(),
                Some(cli::StdoutClosed::Closed)
            ) =>
        {
            ExitCode::from(cli::CLOSED_PIPE_STATUS)
        }
        Err(err) => {
            eprintln!("uffd-pager: {}", basics::error_chain(&*err));
            ExitCode::FAILURE
        }
    }
}
