//! The proof that sharing never mixes data between VMs. After every stage each VM's `digest`
//! is taken; then, per content and round:
//!
//! - after the fills, VMs given the same content report the same digest;
//! - the unshared VM `i` reports the digest the host computes for its bytes (its fill, then
//!   its rewrites: `vmm::guest::{fill_bytes, rewrite_bytes, digest}`);
//! - every VM `i` of every other mode reports the same digest as the unshared VM `i` after the
//!   same stage. The rewrites use seeds of each VM's own, so after them no two VMs hold the
//!   same bytes: a write seen in another VM would change that VM's digest.
//!
//! Any difference stops the bench.

use std::collections::BTreeMap;

use vmm::guest::{digest_hex, fill_bytes, rewrite_bytes};

use crate::common::Res;
use crate::{Content, Mode, Settings, BASE, REWRITES};

/// The host's digests of every VM's data after each stage, by content: `[stage][vm]`.
pub type Expected = BTreeMap<Content, Vec<Vec<String>>>;

pub fn expected(settings: &Settings) -> Expected {
    let mut out = Expected::new();
    for content in Content::ALL {
        let mut stages = vec![Vec::with_capacity(settings.vms); 1 + REWRITES.len()];
        for vm in 0..settings.vms {
            let (kind, seed) = content.data(vm);
            let mut bytes = fill_bytes(settings.app, kind, seed);
            stages[0].push(digest_hex(&bytes));
            for (stage, &(percent, base)) in REWRITES.iter().enumerate() {
                rewrite_bytes(&mut bytes, percent, base + vm as u64);
                stages[stage + 1].push(digest_hex(&bytes));
            }
        }
        out.insert(content, stages);
    }
    out
}

/// `after the fills`, `after the 25% rewrite`.
fn stage_name(stage: usize) -> String {
    match stage.checked_sub(1).and_then(|i| REWRITES.get(i)) {
        None => "after the fills".to_owned(),
        Some((percent, _)) => format!("after the {percent}% rewrite"),
    }
}

/// Checks the digests of one content in one round (`[stage][vm]` by mode).
pub fn check(
    settings: &Settings,
    content: Content,
    round: usize,
    digests: &BTreeMap<Mode, Vec<Vec<String>>>,
    expected: &Expected,
) -> Res<()> {
    let failed = |what: String| -> Res<()> {
        Err(format!(
            "integrity check failed in round {}, {}: {what}",
            round + 1,
            content.name()
        )
        .into())
    };
    let want = &expected[&content];
    let base = digests
        .get(&BASE)
        .ok_or_else(|| format!("no `{}` group to compare with", BASE.key()))?;
    for (mode, got) in digests {
        let m = mode.key();
        if got.len() != want.len() || got.iter().any(|stage| stage.len() != settings.vms) {
            return failed(format!(
                "{m}: digests of {} stages, expected {}",
                got.len(),
                want.len()
            ));
        }
        if content.identical() {
            if let Some(vm) = (1..settings.vms).find(|&vm| got[0][vm] != got[0][0]) {
                return failed(format!(
                    "{m}: VM {vm} reports {} after the fills, VM 0 {}, though both were given the same bytes",
                    got[0][vm], got[0][0]
                ));
            }
        }
        for (stage, (got, want)) in got.iter().zip(want).enumerate() {
            for vm in 0..settings.vms {
                let (reference, of) = if *mode == BASE {
                    (&want[vm], "the host computes for its bytes")
                } else {
                    (
                        &base[stage][vm],
                        "the unshared VM with the same index reports",
                    )
                };
                if got[vm] != *reference {
                    return failed(format!(
                        "{m}: VM {vm} reports digest {} {}, but {of} {reference}",
                        got[vm],
                        stage_name(stage)
                    ));
                }
            }
        }
    }
    Ok(())
}
