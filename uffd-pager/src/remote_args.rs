//! The command-line options of stores in an object store, shared by `uffd-pager` and
//! `pvisor`: the endpoint, the cache and its bound, the retry timeout, the key, the background
//! fetch.

use std::path::PathBuf;

use basics::parse_size;
use compressed_backing::remote::RemoteOptions;

/// Where an s3:// store is reached and cached. Credentials and region come from the standard
/// AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION).
#[derive(Debug, Clone, clap::Args)]
pub struct RemoteArgs {
    /// The S3 endpoint, for S3-compatible servers (default: AWS_ENDPOINT_URL, else AWS).
    #[arg(long, value_name = "URL")]
    pub s3_endpoint: Option<String>,
    /// The local read cache of s3:// stores, shared by this user's VMs; it must be private
    /// to this user [default: $XDG_CACHE_HOME/pvisor, else ~/.cache/pvisor].
    #[arg(long, value_name = "DIR")]
    pub cache: Option<PathBuf>,
    /// At most this much is kept in the cache (KiB/MiB/GiB suffixes).
    #[arg(long, value_name = "SIZE", default_value = "4GiB", value_parser = parse_size)]
    pub cache_size: u64,
    /// How long a failing request to the object store is retried before it fails.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub s3_retry_timeout: f64,
    /// Encrypt and authenticate every block on this host before it goes to the object store,
    /// and open them on the way back (AES-256-GCM, docs/remote.md): a private file (0600)
    /// of 32 bytes or 64 hex digits, e.g. `head -c 32 /dev/urandom > KEY`. A store written
    /// with a key is read only with it.
    #[arg(long, value_name = "FILE")]
    pub store_key: Option<PathBuf>,
    /// When a VM restores from (or `serve` serves) an s3:// store: after the working set,
    /// fetch the rest of the store into the cache in the background, two requests at a time
    /// and none while a fault waits, so that later faults find their blocks here. Off by
    /// default: it fetches what the VM may never touch. Skipped, with a note in the log, when
    /// the rest does not fit in the cache's bound beside what the cache holds.
    #[arg(long)]
    pub s3_fetch_rest: bool,
    /// Range requests in flight at once while the working set is fetched (and chunks
    /// uploaded at once).
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u16).range(1..=256))]
    pub s3_requests: u16,
    /// The most one range request of the working set's fetch asks for: neighbouring blocks
    /// are fetched together up to this size (KiB/MiB suffixes; from 64 KiB to 64 MiB).
    #[arg(long, value_name = "SIZE", default_value = "4MiB", value_parser = parse_request_size)]
    pub s3_request_size: u64,
}

/// A `--s3-request-size`: from 64 KiB (a block) to 64 MiB (a chunk).
fn parse_request_size(text: &str) -> Result<u64, String> {
    let size = parse_size(text).map_err(|e| e.to_string())?;
    if !(64 << 10..=64 << 20).contains(&size) {
        return Err(format!(
            "{text} is outside 64KiB..=64MiB (a block to a chunk)"
        ));
    }
    Ok(size)
}

impl RemoteArgs {
    /// The options these arguments give.
    pub fn options(&self) -> Result<RemoteOptions, String> {
        if !(self.s3_retry_timeout.is_finite() && self.s3_retry_timeout >= 0.0) {
            return Err(format!(
                "--s3-retry-timeout {} is not a number of seconds",
                self.s3_retry_timeout
            ));
        }
        let mut options = RemoteOptions::new();
        options.endpoint = self.s3_endpoint.clone();
        if let Some(dir) = &self.cache {
            options.cache_dir = dir.clone();
        }
        options.cache_size = self.cache_size;
        options.retry_timeout = std::time::Duration::from_secs_f64(self.s3_retry_timeout);
        options.fetch_rest = self.s3_fetch_rest;
        options.parallel = usize::from(self.s3_requests);
        options.request_size = self.s3_request_size;
        if let Some(path) = &self.store_key {
            let key = compressed_backing::seal::StoreKey::from_file(path)
                .map_err(|e| format!("--store-key: {}", basics::error_chain(&e)))?;
            options.key = Some(std::sync::Arc::new(key));
        }
        Ok(options)
    }
}
