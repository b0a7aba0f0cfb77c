//! Workload scripts: commands separated by `;`, run one by one by the workload guest (memory
//! and disk commands) or the VMM (`sleep`, `idle`).

use std::fmt;

use basics::parse_size;

use crate::arena::Intent;
use crate::guest::{FillKind, MAX_TIMER_MS};

/// One command of a script.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "command", rename_all = "lowercase")]
pub enum Command {
    /// Write `size` bytes of application data.
    Fill {
        /// Bytes.
        size: u64,
        /// Content.
        kind: FillKind,
        /// Seed for `random`.
        seed: u64,
    },
    /// Digest the application data.
    Digest,
    /// Read the first `size` bytes.
    Touch {
        /// Bytes.
        size: u64,
    },
    /// Overwrite `percent` of the application-data pages.
    Rewrite {
        /// Share of pages, 0..=100.
        percent: u64,
        /// Seed.
        seed: u64,
    },
    /// Free the application data and report it to the host.
    Release,
    /// The seed's test task: digest, write to disk, fsync, read back, verify.
    Task,
    /// Wait on the host side.
    Sleep {
        /// Milliseconds.
        ms: u64,
    },
    /// Report idle and wait for the next command.
    Idle,
    /// Ask the model through the gateway and digest the answer.
    Model {
        /// The request's id.
        request: u64,
        /// The guest keeps a timer while it waits: every this many milliseconds it wakes,
        /// does its timer's work (a heartbeat that touches its memory) and waits on.
        timer_ms: Option<u64>,
        /// The guest takes the answer in batches as it streams in (reading each), not whole.
        stream: bool,
    },
    /// The guest writes `value` at guest-physical `gpa`, then (with a port) does one `out` to
    /// it: a hostile guest's request, one field at a time. An address outside the guest's
    /// RAM crashes the guest (and ends the VM's commands).
    Poke {
        /// Guest-physical address of the word.
        gpa: u64,
        /// The word.
        value: u64,
        /// The port, if any.
        port: Option<u16>,
    },
    /// The guest plays a hostile guest: `count` random steps, each a random value written into
    /// the mailbox's arguments, its free report or the block request, or a random `out` (block,
    /// free, model or an unknown port) or `in`. It leaves alone the requests that would change
    /// its own pages or its filled data, so that a VMM that validates every request keeps
    /// both intact.
    Chaos {
        /// Seed of the steps.
        seed: u64,
        /// How many.
        count: u64,
    },
    /// Download `url` (plain http, from an origin the VM allows: `--vm-net-allow`) into the
    /// application data, as `fill` would write it, chunk by chunk; with `bytes` or `digest`,
    /// the command fails unless it got exactly that (the digest as `digest` prints it).
    Download {
        /// What to fetch.
        url: String,
        /// What the bytes must be, if known.
        expect: Expect,
    },
    /// Read the file at `path` of the VM's image (`--vm-image`) into the application data,
    /// as `download` does; fetched from the image's origin on its first read.
    Read {
        /// The file, from the image's root.
        path: String,
        /// What the bytes must be, if known.
        expect: Expect,
    },
    /// A phase arena (docs/arenas.md): `arena open ID SIZE survive|discard`, `arena close
    /// ID`, `arena free ID`, and the data commands on one: `fill SIZE KIND arena=ID`, `touch
    /// SIZE arena=ID`, `digest arena=ID`.
    Arena {
        /// The guest's name for it.
        id: u64,
        /// What to do.
        op: ArenaOp,
    },
}

/// What a `download` or `read` must get, if the script knows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Expect {
    /// The length.
    pub bytes: Option<u64>,
    /// The digest (as `digest` prints it).
    pub digest: Option<u64>,
}

impl Expect {
    /// Reads `bytes=SIZE` and `digest=HEX`, each at most once.
    fn parse(words: &[&str]) -> Result<Self, String> {
        let mut expect = Self::default();
        for word in words {
            if let Some(value) = word
                .strip_prefix("bytes=")
                .filter(|_| expect.bytes.is_none())
            {
                expect.bytes = Some(parse_size(value).map_err(|e| e.to_string())?);
            } else if let Some(value) = word
                .strip_prefix("digest=")
                .filter(|_| expect.digest.is_none())
            {
                expect.digest = Some(u64::from_str_radix(value, 16).map_err(|_| {
                    format!("bad digest `{value}` (16 hex digits, as `digest` prints it)")
                })?);
            } else {
                return Err(format!(
                    "unexpected argument `{word}` (bytes=SIZE? digest=HEX?)"
                ));
            }
        }
        Ok(expect)
    }
}

impl fmt::Display for Expect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(bytes) = self.bytes {
            write!(f, " bytes={bytes}")?;
        }
        if let Some(digest) = self.digest {
            write!(f, " digest={digest:016x}")?;
        }
        Ok(())
    }
}

/// What an `arena` command does.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ArenaOp {
    /// Open it: `size` bytes in whole 2 MiB extents, with its intent.
    Open {
        /// Bytes asked.
        size: u64,
        /// What becomes of its contents at close.
        intent: Intent,
    },
    /// Its phase is over.
    Close,
    /// It is gone.
    Free,
    /// Write `size` bytes of it.
    Fill {
        /// Bytes.
        size: u64,
        /// Content.
        kind: FillKind,
        /// Seed for `random`.
        seed: u64,
    },
    /// Read its first `size` bytes.
    Touch {
        /// Bytes.
        size: u64,
    },
    /// Digest what was filled.
    Digest,
}

/// Most steps of one `chaos` command.
pub const MAX_CHAOS_STEPS: u64 = 1_000_000;

fn kind_name(kind: FillKind) -> &'static str {
    match kind {
        FillKind::Repeated => "repeated",
        FillKind::Random => "random",
        FillKind::Zero => "zero",
        FillKind::Distinct => "distinct",
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Command::Fill { size, kind, seed } => {
                write!(f, "fill {size} {} seed={seed}", kind_name(*kind))
            }
            Command::Arena { id, op } => match op {
                ArenaOp::Open { size, intent } => write!(f, "arena open {id} {size} {intent}"),
                ArenaOp::Close => write!(f, "arena close {id}"),
                ArenaOp::Free => write!(f, "arena free {id}"),
                ArenaOp::Fill { size, kind, seed } => {
                    write!(f, "fill {size} {} seed={seed} arena={id}", kind_name(*kind))
                }
                ArenaOp::Touch { size } => write!(f, "touch {size} arena={id}"),
                ArenaOp::Digest => write!(f, "digest arena={id}"),
            },
            Command::Digest => f.write_str("digest"),
            Command::Touch { size } => write!(f, "touch {size}"),
            Command::Rewrite { percent, seed } => write!(f, "rewrite {percent} seed={seed}"),
            Command::Release => f.write_str("release"),
            Command::Task => f.write_str("task"),
            Command::Sleep { ms } => write!(f, "sleep {ms}"),
            Command::Idle => f.write_str("idle"),
            Command::Model {
                request,
                timer_ms,
                stream,
            } => {
                write!(f, "model {request}")?;
                if let Some(ms) = timer_ms {
                    write!(f, " timer={ms}")?;
                }
                if *stream {
                    f.write_str(" stream")?;
                }
                Ok(())
            }
            Command::Poke {
                gpa,
                value,
                port: None,
            } => write!(f, "poke {gpa:#x} {value:#x}"),
            Command::Poke {
                gpa,
                value,
                port: Some(port),
            } => write!(f, "poke {gpa:#x} {value:#x} out={port:#x}"),
            Command::Chaos { seed, count } => write!(f, "chaos seed={seed} count={count}"),
            Command::Download { url, expect } => write!(f, "download {url}{expect}"),
            Command::Read { path, expect } => write!(f, "read {path}{expect}"),
        }
    }
}

/// A script that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("command {position} (`{text}`): {reason}")]
pub struct ScriptError {
    /// 1-based position of the command in the script.
    pub position: usize,
    /// The command as written.
    pub text: String,
    /// What is wrong.
    pub reason: String,
}

const COMMANDS: &str =
    "fill, digest, touch, rewrite, release, task, sleep, idle, model, download, read, poke, chaos, \
     arena";

/// A whole number, decimal or `0x` hexadecimal.
fn number(text: &str) -> Result<u64, String> {
    let parsed = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed.map_err(|_| format!("bad number `{text}` (decimal or 0x hexadecimal)"))
}

/// Parses a script: commands separated by `;`, blank ones ignored.
pub fn parse(script: &str) -> Result<Vec<Command>, ScriptError> {
    let mut commands = Vec::new();
    for (index, text) in script.split(';').enumerate() {
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        let fail = |reason: String| ScriptError {
            position: index + 1,
            text: text.to_owned(),
            reason,
        };
        commands.push(parse_one(text).map_err(fail)?);
    }
    Ok(commands)
}

fn parse_one(text: &str) -> Result<Command, String> {
    let mut words = text.split_whitespace();
    let name = words.next().unwrap_or_default();
    let mut positional = Vec::new();
    let mut seed = None;
    let mut arena = None;
    for word in words {
        if let Some(value) = word.strip_prefix("seed=") {
            seed = Some(
                value
                    .parse::<u64>()
                    .map_err(|_| format!("bad seed `{value}`"))?,
            );
        } else if let Some(value) = word.strip_prefix("arena=") {
            if !matches!(name, "fill" | "touch" | "digest") {
                return Err(format!(
                    "`{name}` takes no arena (fill, touch and digest do)"
                ));
            }
            arena = Some(number(value)?);
        } else {
            positional.push(word);
        }
    }
    let size = |i: usize| -> Result<u64, String> {
        let text = positional
            .get(i)
            .ok_or_else(|| format!("`{name}` needs a size (e.g. 64MiB)"))?;
        parse_size(text).map_err(|e| e.to_string())
    };
    let no_more = |count: usize| -> Result<(), String> {
        match positional.get(count) {
            Some(extra) => Err(format!("unexpected argument `{extra}`")),
            None => Ok(()),
        }
    };
    let no_seed = || match seed {
        Some(_) => Err(format!("`{name}` takes no seed")),
        None => Ok(()),
    };
    let command = match name {
        "fill" => {
            let kind = match positional.get(1).copied() {
                Some("repeated") => FillKind::Repeated,
                Some("random") => FillKind::Random,
                Some("zero") => FillKind::Zero,
                Some("distinct") => FillKind::Distinct,
                Some(other) => {
                    return Err(format!(
                        "unknown content `{other}` (repeated, random, distinct or zero)"
                    ))
                }
                None => {
                    return Err("`fill` needs a content: repeated, random, distinct or zero".into())
                }
            };
            no_more(2)?;
            let size = size(0)?;
            if !size.is_multiple_of(4096) {
                return Err(format!("size {size} is not a multiple of 4 KiB"));
            }
            Command::Fill {
                size,
                kind,
                seed: seed.unwrap_or(0),
            }
        }
        "digest" | "release" | "task" | "idle" => {
            no_more(0)?;
            no_seed()?;
            match name {
                "digest" => Command::Digest,
                "release" => Command::Release,
                "task" => Command::Task,
                _ => Command::Idle,
            }
        }
        "model" => {
            no_seed()?;
            let id = positional.first().ok_or("`model` needs a request id")?;
            let request = id
                .parse()
                .map_err(|_| format!("bad request id `{id}` (a whole number)"))?;
            let mut stream = false;
            let mut timer_ms = None;
            // The words after the id: at most a timer and `stream`, in either order.
            for word in positional.iter().skip(1) {
                if *word == "stream" && !stream {
                    stream = true;
                    continue;
                }
                if timer_ms.is_some() {
                    return Err(format!("unexpected argument `{word}`"));
                }
                timer_ms = {
                    let ms = word.strip_prefix("timer=").ok_or_else(|| {
                        format!("unexpected argument `{word}` (timer=MS? stream?)")
                    })?;
                    let ms: u64 = ms
                        .trim_end_matches("ms")
                        .parse()
                        .map_err(|_| format!("bad timer `{ms}` (milliseconds)"))?;
                    if ms == 0 {
                        return Err("timer=0: a timer's period is at least 1 ms".into());
                    }
                    if ms > MAX_TIMER_MS {
                        return Err(format!(
                            "timer={ms}: a timer's period is at most {MAX_TIMER_MS} ms (an hour)"
                        ));
                    }
                    Some(ms)
                };
            }
            Command::Model {
                request,
                timer_ms,
                stream,
            }
        }
        "download" => {
            no_seed()?;
            let url = positional
                .first()
                .ok_or("`download` needs a URL (http://HOST[:PORT]/PATH)")?;
            if url.len() as u64 > crate::net::URL_MAX {
                return Err(format!(
                    "the URL has {} bytes, more than {}",
                    url.len(),
                    crate::net::URL_MAX
                ));
            }
            crate::net::Target::parse(url)?;
            Command::Download {
                url: (*url).to_owned(),
                expect: Expect::parse(&positional[1..])?,
            }
        }
        "read" => {
            no_seed()?;
            let path = positional
                .first()
                .ok_or("`read` needs a path in the VM's image (e.g. usr/lib/libc.so.6)")?;
            crate::image::check_path(path)?;
            Command::Read {
                path: (*path).to_owned(),
                expect: Expect::parse(&positional[1..])?,
            }
        }
        "touch" => {
            no_more(1)?;
            no_seed()?;
            let size = size(0)?;
            if !size.is_multiple_of(8) {
                return Err(format!("size {size} is not a multiple of 8 bytes"));
            }
            Command::Touch { size }
        }
        "rewrite" => {
            no_more(1)?;
            let percent = positional
                .first()
                .ok_or("`rewrite` needs a percentage")?
                .trim_end_matches('%');
            let percent: u64 = percent
                .parse()
                .map_err(|_| format!("bad percentage `{percent}`"))?;
            if percent > 100 {
                return Err(format!("percentage {percent} is above 100"));
            }
            Command::Rewrite {
                percent,
                seed: seed.unwrap_or(1),
            }
        }
        "sleep" => {
            no_more(1)?;
            no_seed()?;
            let ms = positional.first().ok_or("`sleep` needs milliseconds")?;
            let ms = ms
                .trim_end_matches("ms")
                .parse()
                .map_err(|_| format!("bad duration `{ms}` (milliseconds)"))?;
            Command::Sleep { ms }
        }
        "poke" => {
            no_seed()?;
            let gpa = number(positional.first().ok_or("`poke` needs an address")?)?;
            let value = number(positional.get(1).ok_or("`poke` needs a value")?)?;
            let port = match positional.get(2) {
                None => None,
                Some(word) => {
                    let port = word
                        .strip_prefix("out=")
                        .ok_or_else(|| format!("unexpected argument `{word}` (out=PORT?)"))?;
                    let port = number(port)?;
                    Some(
                        u16::try_from(port)
                            .map_err(|_| format!("port {port:#x} is above 0xffff"))?,
                    )
                }
            };
            no_more(3)?;
            Command::Poke { gpa, value, port }
        }
        "chaos" => {
            let mut count = 1000;
            for word in &positional {
                let value = word
                    .strip_prefix("count=")
                    .ok_or_else(|| format!("unexpected argument `{word}` (count=N?)"))?;
                count = number(value)?;
            }
            if count > MAX_CHAOS_STEPS {
                return Err(format!(
                    "count={count} is more than {MAX_CHAOS_STEPS} steps"
                ));
            }
            Command::Chaos {
                seed: seed.unwrap_or(0),
                count,
            }
        }
        "arena" => {
            no_seed()?;
            let action = positional
                .first()
                .ok_or("`arena` needs open, close or free")?;
            let id = number(positional.get(1).ok_or("`arena` needs an id")?)?;
            let op = match *action {
                "open" => {
                    let size = positional
                        .get(2)
                        .ok_or("`arena open` needs a size (e.g. 64MiB)")?;
                    let size = parse_size(size).map_err(|e| e.to_string())?;
                    if size == 0 {
                        return Err("an arena has at least one byte".into());
                    }
                    let intent = positional
                        .get(3)
                        .ok_or("`arena open` needs an intent: survive or discard")?
                        .parse()?;
                    no_more(4)?;
                    ArenaOp::Open { size, intent }
                }
                "close" | "free" => {
                    no_more(2)?;
                    if *action == "close" {
                        ArenaOp::Close
                    } else {
                        ArenaOp::Free
                    }
                }
                other => {
                    return Err(format!(
                        "unknown arena action `{other}` (open, close or free)"
                    ))
                }
            };
            Command::Arena { id, op }
        }
        other => return Err(format!("unknown command `{other}` (commands: {COMMANDS})")),
    };
    let Some(id) = arena else {
        return Ok(command);
    };
    let op = match command {
        Command::Fill { size, kind, seed } => ArenaOp::Fill { size, kind, seed },
        Command::Touch { size } => ArenaOp::Touch { size },
        Command::Digest => ArenaOp::Digest,
        other => return Err(format!("`{other}` takes no arena")),
    };
    Ok(Command::Arena { id, op })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_every_command_parses() {
        let script = "fill 64MiB random seed=7; digest; touch 16MiB; rewrite 25% seed=3; \
                      release; task; sleep 50; idle; fill 1GiB repeated;";
        let commands = parse(script).unwrap();
        assert_eq!(commands.len(), 9);
        assert_eq!(
            commands[0],
            Command::Fill {
                size: 64 << 20,
                kind: FillKind::Random,
                seed: 7
            }
        );
        assert_eq!(
            commands[3],
            Command::Rewrite {
                percent: 25,
                seed: 3
            }
        );
        assert_eq!(commands[6], Command::Sleep { ms: 50 });
    }

    #[test]
    fn script_model_takes_a_guest_timer_and_prints_back_as_parsed() {
        let commands = parse(
            "model 4; model 5 timer=600; model 6 timer=250ms; model 7 stream; \
             model 8 stream timer=9; model 9 timer=9 stream",
        )
        .unwrap();
        let model = |request, timer_ms, stream| Command::Model {
            request,
            timer_ms,
            stream,
        };
        assert_eq!(
            commands,
            vec![
                model(4, None, false),
                model(5, Some(600), false),
                model(6, Some(250), false),
                model(7, None, true),
                model(8, Some(9), true),
                model(9, Some(9), true),
            ]
        );
        let printed: Vec<String> = commands.iter().map(ToString::to_string).collect();
        assert_eq!(
            printed,
            [
                "model 4",
                "model 5 timer=600",
                "model 6 timer=250",
                "model 7 stream",
                "model 8 timer=9 stream",
                "model 9 timer=9 stream"
            ]
        );
        let again = parse(&printed.join("; ")).unwrap();
        assert_eq!(again, commands);
    }

    #[test]
    fn script_poke_and_chaos_parse_and_print_back_as_parsed() {
        let commands = parse(
            "poke 0x9000 18446744073709551615; poke 36864 2 out=0x20; chaos seed=3 count=50; chaos",
        )
        .unwrap();
        assert_eq!(
            commands,
            vec![
                Command::Poke {
                    gpa: 0x9000,
                    value: u64::MAX,
                    port: None
                },
                Command::Poke {
                    gpa: 0x9000,
                    value: 2,
                    port: Some(0x20)
                },
                Command::Chaos { seed: 3, count: 50 },
                Command::Chaos {
                    seed: 0,
                    count: 1000
                },
            ]
        );
        let printed: Vec<String> = commands.iter().map(ToString::to_string).collect();
        assert_eq!(parse(&printed.join("; ")).unwrap(), commands);
    }

    #[test]
    fn script_arena_commands_parse_and_print_back_as_parsed() {
        let commands = parse(
            "arena open 3 64MiB discard; fill 8MiB random seed=2 arena=3; touch 4MiB arena=3; \
             digest arena=3; arena close 3; arena free 3; arena open 4 1 survive",
        )
        .unwrap();
        assert_eq!(
            commands,
            vec![
                Command::Arena {
                    id: 3,
                    op: ArenaOp::Open {
                        size: 64 << 20,
                        intent: Intent::Discard
                    }
                },
                Command::Arena {
                    id: 3,
                    op: ArenaOp::Fill {
                        size: 8 << 20,
                        kind: FillKind::Random,
                        seed: 2
                    }
                },
                Command::Arena {
                    id: 3,
                    op: ArenaOp::Touch { size: 4 << 20 }
                },
                Command::Arena {
                    id: 3,
                    op: ArenaOp::Digest
                },
                Command::Arena {
                    id: 3,
                    op: ArenaOp::Close
                },
                Command::Arena {
                    id: 3,
                    op: ArenaOp::Free
                },
                Command::Arena {
                    id: 4,
                    op: ArenaOp::Open {
                        size: 1,
                        intent: Intent::Survive
                    }
                },
            ]
        );
        let printed: Vec<String> = commands.iter().map(ToString::to_string).collect();
        assert_eq!(parse(&printed.join("; ")).unwrap(), commands);
        for (bad, expect) in [
            ("arena", "needs open, close or free"),
            ("arena open", "needs an id"),
            ("arena open 1", "needs a size"),
            ("arena open 1 0 discard", "at least one byte"),
            ("arena open 1 2MiB", "needs an intent"),
            ("arena open 1 2MiB forever", "unknown intent `forever`"),
            ("arena open 1 2MiB discard now", "unexpected argument `now`"),
            ("arena shut 1", "unknown arena action `shut`"),
            ("arena close x", "bad number `x`"),
            ("arena close 1 2", "unexpected argument `2`"),
            ("arena open 1 2MiB discard seed=3", "takes no seed"),
            ("rewrite 5 arena=1", "`rewrite` takes no arena"),
            ("fill 4KiB zero arena=z", "bad number `z`"),
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.to_string().contains(expect), "{bad}: {err}");
        }
    }

    #[test]
    fn script_errors_name_the_command_and_its_position() {
        let err = parse("fill 1MiB zero; explode now; digest").unwrap_err();
        assert_eq!(err.position, 2);
        assert!(
            err.to_string().contains("unknown command `explode`"),
            "{err}"
        );
        assert!(
            err.to_string().contains("command 2 (`explode now`)"),
            "{err}"
        );
        for (bad, expect) in [
            ("fill 512XB random", "512XB"),
            ("fill 64MiB", "needs a content"),
            ("fill 64MiB purple", "unknown content"),
            ("fill 1000 zero", "multiple of 4 KiB"),
            ("rewrite 150", "above 100"),
            ("digest 5", "unexpected argument"),
            ("sleep soon", "bad duration"),
            ("touch", "needs a size"),
            ("fill 1MiB random seed=x", "bad seed"),
            ("model", "needs a request id"),
            ("model 4 soon", "unexpected argument `soon`"),
            ("model 4 timer=0", "at least 1 ms"),
            ("model 4 timer=often", "bad timer"),
            ("model 4 timer=5 timer=6", "unexpected argument `timer=6`"),
            ("model 4 stream stream", "unexpected argument `stream`"),
            ("model 4 stream timer=1 x", "unexpected argument `x`"),
            ("model 4 timer=18446744073709551615", "at most 3600000 ms"),
            ("poke", "needs an address"),
            ("poke 0x9000", "needs a value"),
            ("poke 0x9000 zz", "bad number `zz`"),
            ("poke 0x9000 1 out=0x10000", "above 0xffff"),
            ("poke 0x9000 1 in=5", "unexpected argument `in=5`"),
            ("chaos count=2000000", "more than 1000000"),
            ("chaos 5", "unexpected argument `5`"),
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.to_string().contains(expect), "{bad}: {err}");
        }
    }
}
