//! `uffd-pager`: the lazy memory service's command line.
//!
//! Store commands (`pack`, `unpack`, `verify`, `info`, `mount`) work on the compressed block
//! store of `compressed-backing`.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    // Nobody reads the output any more (`… | head`): it ends quietly.
    basics::output::exit_code("uffd-pager: ", cli::run(args))
}
