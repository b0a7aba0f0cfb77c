//! The options of a VM's waits and what it waits for: the model's streamed answers, its
//! downloads, its image and the wait policy, from the flags and the config file.

use basics::parse_size;

use super::{ConfigVm, RunArgs};

/// A size from its flag, else its config key (`name`).
pub(super) fn size(
    flag: Option<u64>,
    key: &Option<String>,
    name: &str,
) -> Result<Option<u64>, String> {
    match (flag, key) {
        (Some(bytes), _) => Ok(Some(bytes)),
        (None, Some(text)) => parse_size(text)
            .map(Some)
            .map_err(|e| format!("config {name}: {e}")),
        (None, None) => Ok(None),
    }
}

/// How the guest's downloads go, from the flags and the config file.
pub(super) fn net(args: &RunArgs, config: &ConfigVm) -> Result<vmm::net::NetOptions, String> {
    let allow = if args.net_allow.is_empty() {
        config.net_allow.clone().unwrap_or_default()
    } else {
        args.net_allow.clone()
    };
    let default = vmm::net::NetOptions::default();
    let options = vmm::net::NetOptions {
        allow: vmm::net::Allow::parse(&allow)?,
        chunking: vmm::gateway::Batching {
            bytes: size(args.net_chunk, &config.net_chunk, "net-chunk")?
                .unwrap_or(default.chunking.bytes),
            wait: args
                .net_chunk_ms
                .or(config.net_chunk_ms)
                .map_or(default.chunking.wait, std::time::Duration::from_millis),
            buffer: size(args.net_buffer, &config.net_buffer, "net-buffer")?
                .unwrap_or(default.chunking.buffer),
        },
        stall: args
            .net_stall_ms
            .or(config.net_stall_ms)
            .map_or(default.stall, std::time::Duration::from_millis),
        timeout: args
            .net_timeout_ms
            .or(config.net_timeout_ms)
            .map_or(default.timeout, std::time::Duration::from_millis),
    };
    let most = 1u64 << 30;
    if !(1..=most).contains(&options.chunking.bytes)
        || !(options.chunking.bytes..=most).contains(&options.chunking.buffer)
    {
        return Err(
            "--vm-net-chunk and --vm-net-buffer are from 1 byte to 1 GiB, the buffer at least a \
             chunk"
                .into(),
        );
    }
    let (day, hour) = (
        std::time::Duration::from_secs(86_400),
        std::time::Duration::from_secs(3600),
    );
    let bad_time = options.chunking.wait > hour
        || options.stall > hour
        || options.stall.is_zero()
        || options.timeout > day
        || options.timeout.is_zero();
    if bad_time {
        return Err(
            "--vm-net-chunk-ms is at most an hour, --vm-net-stall-ms 1 ms to an hour, \
             --vm-net-timeout-ms 1 ms to a day"
                .into(),
        );
    }
    Ok(options)
}

/// How streamed answers are handed to the guest, from the flags and the config file.
pub(super) fn batching(
    args: &RunArgs,
    config: &ConfigVm,
) -> Result<vmm::gateway::Batching, String> {
    let default = vmm::gateway::Batching::default();
    let batching = vmm::gateway::Batching {
        bytes: size(args.model_batch, &config.model_batch, "model-batch")?.unwrap_or(default.bytes),
        wait: args
            .model_batch_ms
            .or(config.model_batch_ms)
            .map_or(default.wait, std::time::Duration::from_millis),
        buffer: size(args.model_buffer, &config.model_buffer, "model-buffer")?
            .unwrap_or(default.buffer),
    };
    let most = vmm::guest::IO_BUF_SIZE;
    if !(1..=most).contains(&batching.bytes) || !(batching.bytes..=most).contains(&batching.buffer)
    {
        return Err(format!(
            "--vm-model-batch and --vm-model-buffer are from 1 byte to the guest's {} KiB buffer, \
             the buffer at least a batch",
            most >> 10
        ));
    }
    if batching.wait > std::time::Duration::from_secs(3600) {
        return Err("--vm-model-batch-ms is at most an hour".into());
    }
    Ok(batching)
}

/// The VM's image as the flags and the config file give it.
#[derive(Debug, Clone)]
pub struct ImageChoice {
    /// Where it is.
    pub at: vmm::image::ImageLocation,
    /// Its origin's rate, if held to one.
    pub rate: Option<u64>,
    /// Where its files are staged (`None`: the job's directory).
    pub staging: Option<std::path::PathBuf>,
}

/// The VM's image, its origin's rate and its staging, from the flags and the config file.
pub(super) fn image(args: &RunArgs, config: &ConfigVm) -> Result<Option<ImageChoice>, String> {
    Ok(match args.image.clone().or(config.image.clone()) {
        None if args.image_staging.is_some() || config.image_staging.is_some() => {
            return Err("--vm-image-staging needs --vm-image".into())
        }
        None => None,
        Some(text) => {
            let at = vmm::image::ImageLocation::parse(&text, &args.remote.options()?)
                .map_err(|e| format!("--vm-image: {e}"))?;
            let rate = size(args.image_rate, &config.image_rate, "image-rate")?;
            let staging = args
                .image_staging
                .clone()
                .or(config.image_staging.clone())
                .map(std::path::absolute)
                .transpose()
                .map_err(|e| format!("--vm-image-staging: {e}"))?;
            Some(ImageChoice { at, rate, staging })
        }
    })
}

/// The wait policy if `--vm-wait-management` is on, from the flags and the config file (the
/// options that tune it are refused without it).
pub(super) fn wait_policy(
    args: &RunArgs,
    config: &ConfigVm,
) -> Result<Option<vmm::wait::WaitPolicy>, String> {
    let wait_management = args
        .wait_management
        .or(config.wait_management)
        .unwrap_or(false);
    let strategy = args.wait_strategy.clone().or(config.wait_strategy.clone());
    let offload = match strategy.as_deref() {
        None | Some("offload") => true,
        Some("pause") => false,
        Some(other) => {
            return Err(format!(
                "--vm-wait-strategy `{other}`: expected offload or pause"
            ))
        }
    };
    if args.wait_strategy.is_some() && !wait_management {
        return Err("--vm-wait-strategy needs --vm-wait-management".into());
    }
    let wait_scale = args.wait_scale.or(config.wait_scale);
    if wait_scale.is_some_and(|f| !(f > 0.0 && f <= 100.0)) {
        return Err("--vm-wait-scale is a factor above 0 and at most 100".into());
    }
    let break_even = args.wait_break_even.or(config.wait_break_even);
    if break_even.is_some_and(|f| !(0.0..=1000.0).contains(&f)) {
        return Err("--vm-wait-break-even is a factor from 0 to 1000".into());
    }
    let ms = |flag: Option<u64>, key: Option<u64>, default: std::time::Duration| {
        flag.or(key)
            .map_or(default, std::time::Duration::from_millis)
    };
    let default = vmm::wait::WaitPolicy::default();
    let policy = vmm::wait::WaitPolicy {
        pause_after: ms(
            args.wait_pause_ms,
            config.wait_pause_ms,
            default.pause_after,
        ),
        offload_after: ms(
            args.wait_offload_ms,
            config.wait_offload_ms,
            default.offload_after,
        ),
        min_timer_budget: ms(
            args.wait_timer_budget_ms,
            config.wait_timer_budget_ms,
            default.min_timer_budget,
        ),
        offload_cooldown: ms(
            args.wait_cooldown_ms,
            config.wait_cooldown_ms,
            default.offload_cooldown,
        ),
        offload,
        break_even: break_even.unwrap_or(default.break_even),
        reload: match args
            .wait_reload
            .as_deref()
            .or(config.wait_reload.as_deref())
        {
            None => default.reload,
            Some("lazy") => uffd_pager::load::LoadMode::Lazy,
            Some("faults") => uffd_pager::load::LoadMode::Faults,
            Some(other) => {
                return Err(format!(
                    "--vm-wait-reload `{other}`: expected lazy or faults"
                ))
            }
        },
        warm: args.wait_warm.or(config.wait_warm).unwrap_or(default.warm),
        sources: match args
            .wait_sources
            .as_deref()
            .or(config.wait_sources.as_deref())
        {
            Some(text) => {
                vmm::wait::Sources::parse(text).map_err(|e| format!("--vm-wait-sources: {e}"))?
            }
            None => default.sources,
        },
    };
    // Flags that tune a policy that is off are a mistake; a config file may hold a policy
    // for when it is on.
    let tuned = [
        args.wait_pause_ms,
        args.wait_offload_ms,
        args.wait_timer_budget_ms,
        args.wait_cooldown_ms,
    ]
    .iter()
    .any(Option::is_some)
        || args.wait_reload.is_some()
        || args.wait_warm.is_some()
        || args.wait_sources.is_some()
        || args.wait_scale.is_some()
        || args.wait_break_even.is_some();
    if tuned && !wait_management {
        return Err("the --vm-wait-* policy options need --vm-wait-management".into());
    }
    if policy.offload_after < policy.pause_after {
        return Err(format!(
            "--vm-wait-offload-ms ({} ms) is counted from the wait's start like \
             --vm-wait-pause-ms ({} ms): it cannot be smaller",
            policy.offload_after.as_millis(),
            policy.pause_after.as_millis()
        ));
    }
    Ok(wait_management.then(|| policy.scaled(wait_scale.unwrap_or(1.0))))
}
