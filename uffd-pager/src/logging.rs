//! The binaries' log: `tracing` events on stderr, one line each, `info` and above unless
//! `RUST_LOG` says otherwise; `uffd-pager` lines carry time, level and target, `pvisor`'s read
//! as plain messages.
//!
//! One source is kept to a few lines: `object_store` logs every retry of a request at `info`
//! ("Encountered transport error …, backing off for …"), and in an outage of the object store a
//! VM's prefetch and faults retry dozens of times in a few seconds. At most [`RETRY_BURST`] of
//! its lines pass per [`RETRY_INTERVAL`]; the error that ends the retries says how many there
//! were.

use std::time::Duration;

use basics::RateLimit;
use tracing::Metadata;
use tracing_subscriber::filter::{dynamic_filter_fn, EnvFilter, FilterExt};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// Lines of `object_store` that pass per [`RETRY_INTERVAL`].
pub const RETRY_BURST: u32 = 3;
/// See [`RETRY_BURST`].
pub const RETRY_INTERVAL: Duration = Duration::from_secs(30);

/// What a line holds besides its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// Time, level and target, then the message (a daemon's log).
    Full,
    /// The message alone, as `pvisor`'s lines have always read (`pvisor …: …`).
    Plain,
}

/// Whether an event of `meta` passes `limit`: everything but `object_store`'s events at
/// `info` and below does (its warnings and errors always pass).
fn passes(meta: &Metadata<'_>, limit: &RateLimit) -> bool {
    let limited = meta.is_event()
        && *meta.level() >= tracing::Level::INFO
        && meta.target().starts_with("object_store");
    !limited || limit.allow()
}

/// Sets the process's log up (once; a second call does nothing).
pub fn init(style: Style) {
    let levels = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let limit = RateLimit::new(RETRY_BURST, RETRY_INTERVAL);
    // `and` asks the limit only of what the levels let through; a dynamic filter is asked of
    // every event (a plain `filter_fn` is asked once per call site, and its answer kept).
    let filter = levels.and(dynamic_filter_fn(move |meta, _| passes(meta, &limit)));
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false);
    let layer = match style {
        Style::Full => lines.boxed(),
        Style::Plain => lines
            .without_time()
            .with_level(false)
            .with_target(false)
            .boxed(),
    };
    let _ = tracing_subscriber::registry()
        .with(layer.with_filter(filter))
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::{Level, Subscriber};
    use tracing_subscriber::layer::Context;

    /// Counts the events that reach it.
    struct Count(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl<S: Subscriber> Layer<S> for Count {
        fn on_event(&self, _: &tracing::Event<'_>, _: Context<'_, S>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[test]
    fn object_store_events_pass_a_burst_and_others_all() {
        let limit = RateLimit::new(RETRY_BURST, RETRY_INTERVAL);
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let subscriber = tracing_subscriber::registry().with(
            Count(std::sync::Arc::clone(&seen))
                .with_filter(dynamic_filter_fn(move |meta, _| passes(meta, &limit))),
        );
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..20 {
                tracing::event!(target: "object_store::client::retry", Level::INFO, "backing off");
            }
            let retries = seen.load(std::sync::atomic::Ordering::Relaxed);
            assert_eq!(retries, RETRY_BURST as usize);
            // Its warnings are not held back.
            tracing::event!(target: "object_store::client", Level::WARN, "a warning");
            let retries = retries + 1;
            assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), retries);
            for _ in 0..20 {
                tracing::event!(target: "uffd_pager::server", Level::INFO, "a line");
            }
            assert_eq!(
                seen.load(std::sync::atomic::Ordering::Relaxed),
                retries + 20
            );
        });
    }
}
