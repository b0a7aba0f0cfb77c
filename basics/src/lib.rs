//! The small vocabulary every crate of the workspace shares, so that each says it one way:
//!
//! - [`size`]: sizes as people write them (`64MiB`, `512 MiB`) and as reports print them.
//! - [`error`]: an error with all its causes, as binaries and replies print it.
//! - [`page`]: the page size as a value and the arithmetic of pages.
//! - [`rate`]: logs a guest or a peer can cause, kept to a burst per interval.
//! - [`output`]: a command's output when nobody reads it any more (`… | head`): the binaries
//!   end quietly.

// Library code does not print (clippy.toml's `disallowed-macros`); its tests may.
#![cfg_attr(not(test), warn(clippy::disallowed_macros))]

pub mod error;
pub mod output;
pub mod page;
pub mod rate;
pub mod size;

pub use error::error_chain;
pub use page::{PageSize, PAGE_SIZE};
pub use rate::RateLimit;
pub use size::{format_bytes, parse_size, size_text, SizeError};
