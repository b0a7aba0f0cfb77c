//! A command: its dispatch to the guest through the mailbox (or on the host: `sleep`,
//! `idle`), what the guest's results mean, and what the command produced.

use std::time::{Duration, Instant};

use vm_memory::Bytes;

use super::{Machine, MachineError};
use crate::guest::{self, status, Mailbox, Op};
use crate::script::{ArenaOp, Command};

/// What one command produced.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct CommandOutput {
    /// The command as run.
    pub command: String,
    /// Wall time, milliseconds.
    pub elapsed_ms: f64,
    /// `digest` and `task`: the digest of the application data, hex.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// `touch`: sum of the words read (keeps the reads honest).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sum: Option<String>,
    /// `rewrite`: pages rewritten.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pages: Option<u64>,
    /// `release`: bytes reported free and dropped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub released_bytes: Option<u64>,
    /// `task`: bytes written to disk and verified.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
    /// `model`: bytes of the answer (its digest is in `digest`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answer_bytes: Option<u64>,
    /// `model … timer=MS`: how many times the guest's timer fired during the wait.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timer_fired: Option<u64>,
    /// `model … stream`: the batches the answer came in before its end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batches: Option<u64>,
    /// `download` and `read`: bytes received (their digest is in `digest`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub download_bytes: Option<u64>,
    /// `download` and `read`: the chunks they came in.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chunks: Option<u64>,
    /// `poke … out=PORT`: what the VMM answered in the request areas.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub poke: Option<PokeReport>,
    /// `chaos`: what the guest did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chaos: Option<ChaosReport>,
    /// `arena …`: where the arena lies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arena: Option<ArenaPlace>,
    /// Application data filled after the command.
    pub app_bytes: u64,
}

/// The status fields after a `poke`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PokeReport {
    /// The block request's status (0, or an errno).
    pub blk_status: u64,
    /// The free report's status (0, or an errno).
    pub free_status: u64,
    /// The model port's error flag (mailbox `arg[2]`; 1: no answer).
    pub model_error: u64,
}

/// Where an arena lies in guest-physical memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ArenaPlace {
    /// Its first byte.
    pub gpa: u64,
    /// Its bytes (whole 2 MiB extents).
    pub len: u64,
}

/// What a `chaos` command did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ChaosReport {
    /// `out`s sent to the VMM's ports.
    pub outs: u64,
    /// `out`s held back: valid requests that would have changed the guest's own pages or its
    /// filled data.
    pub held_back: u64,
    /// `in`s.
    pub ins: u64,
}

impl Machine {
    /// Runs one command (host-side `sleep` and `idle` included).
    pub fn run(&mut self, command: &Command) -> Result<CommandOutput, MachineError> {
        let started = Instant::now();
        let mut output = CommandOutput {
            command: command.to_string(),
            ..CommandOutput::default()
        };
        let app_size = self.ram.size() - guest::APP_BASE;
        let too_large = |size: u64| {
            (size > app_size).then(|| MachineError::Command {
                command: command.to_string(),
                reason: format!(
                    "{size} bytes is more than the {app_size} bytes of application memory"
                ),
            })
        };
        match *command {
            Command::Fill { size, kind, seed } => {
                if let Some(e) = too_large(size) {
                    return Err(e);
                }
                self.guest(command, Op::Fill, &[size, kind as u64, seed])?;
            }
            Command::Digest => {
                let result = self.guest(command, Op::Digest, &[self.filled, 0, 0])?;
                output.digest = Some(format!("{:016x}", result[0]));
            }
            Command::Touch { size } => {
                if let Some(e) = too_large(size) {
                    return Err(e);
                }
                let result = self.guest(command, Op::Touch, &[size, 0, 0])?;
                output.sum = Some(format!("{:016x}", result[0]));
            }
            Command::Rewrite { percent, seed } => {
                let result = self.guest(command, Op::Rewrite, &[percent, seed, 0])?;
                output.pages = Some(result[0]);
            }
            Command::Release => {
                let result = self.guest(command, Op::Release, &[0, 0, 0])?;
                output.released_bytes = Some(result[0]);
            }
            Command::Task => {
                let result = self.guest(command, Op::Task, &[0, 0, 0])?;
                output.digest = Some(format!("{:016x}", result[0]));
                output.disk_bytes = Some(result[1]);
            }
            Command::Model {
                request,
                timer_ms,
                stream,
            } => {
                let op = if stream { Op::ModelStream } else { Op::Model };
                let result = self.guest(command, op, &[request, 0, 0, timer_ms.unwrap_or(0)])?;
                output.digest = Some(format!("{:016x}", result[0]));
                output.answer_bytes = Some(result[1]);
                output.timer_fired = timer_ms.map(|_| result[3]);
                output.batches = stream.then_some(result[4]);
            }
            Command::Download {
                url: ref what,
                expect,
            }
            | Command::Read {
                path: ref what,
                expect,
            } => {
                // The URL or path goes in the guest's I/O buffer (checked at parse: at most
                // `net::URL_MAX` bytes, far below the buffer).
                let gpa = guest::IO_BUF_GPA;
                self.ram
                    .memory()
                    .write_slice(what.as_bytes(), vm_memory::GuestAddress(gpa))
                    .map_err(|e| MachineError::GuestMemory { gpa, source: e })?;
                let op = match command {
                    Command::Read { .. } => Op::Read,
                    _ => Op::Download,
                };
                let result = self.guest(command, op, &[what.len() as u64])?;
                let mismatch = |what: String| MachineError::Command {
                    command: command.to_string(),
                    reason: what,
                };
                if let Some(bytes) = expect.bytes.filter(|&b| b != result[1]) {
                    return Err(mismatch(format!(
                        "got {} bytes, expected {bytes}",
                        result[1]
                    )));
                }
                if let Some(digest) = expect.digest.filter(|&d| d != result[0]) {
                    return Err(mismatch(format!(
                        "got bytes of digest {:016x}, expected {digest:016x}",
                        result[0]
                    )));
                }
                output.digest = Some(format!("{:016x}", result[0]));
                output.download_bytes = Some(result[1]);
                output.chunks = Some(result[4]);
            }
            Command::Poke { gpa, value, port } => {
                let result = self.guest(
                    command,
                    Op::Poke,
                    &[gpa, value, u64::from(port.unwrap_or(0))],
                )?;
                output.poke = port.map(|_| PokeReport {
                    blk_status: result[0],
                    free_status: result[1],
                    model_error: result[3],
                });
            }
            Command::Chaos { seed, count } => {
                let result = self.guest(command, Op::Chaos, &[seed, count])?;
                output.chaos = Some(ChaosReport {
                    outs: result[0],
                    held_back: result[1],
                    ins: result[3],
                });
            }
            Command::Arena { id, ref op } => {
                // The guest names arenas by id + 1 in the data commands (0: the app data).
                let on = id.checked_add(1).ok_or_else(|| MachineError::Command {
                    command: command.to_string(),
                    reason: "arena id too large".into(),
                })?;
                let (action, args) = match *op {
                    ArenaOp::Open { size, intent } => (Some(1), [size, intent as u64]),
                    ArenaOp::Close => (Some(2), [0, 0]),
                    ArenaOp::Free => (Some(3), [0, 0]),
                    ArenaOp::Fill { size, kind, seed } => {
                        self.guest(command, Op::Fill, &[size, kind as u64, seed, 0, 0, on])?;
                        (None, [0, 0])
                    }
                    ArenaOp::Touch { size } => {
                        let result = self.guest(command, Op::Touch, &[size, 0, 0, 0, 0, on])?;
                        output.sum = Some(format!("{:016x}", result[0]));
                        (None, [0, 0])
                    }
                    ArenaOp::Digest => {
                        let result = self.guest(command, Op::Digest, &[0, 0, 0, 0, 0, on])?;
                        output.digest = Some(format!("{:016x}", result[0]));
                        (None, [0, 0])
                    }
                };
                if let Some(action) = action {
                    let result = self.guest(command, Op::Arena, &[action, id, args[0], args[1]])?;
                    output.arena = Some(ArenaPlace {
                        gpa: result[0],
                        len: result[1],
                    });
                }
            }
            Command::Sleep { ms } => {
                if self.interrupter.sleep(Duration::from_millis(ms)) {
                    return Err(self.interrupter.stopped_error());
                }
            }
            Command::Idle => {}
        }
        if let Some(cold) = &self.cold {
            cold.set_idle(*command == Command::Idle);
        }
        output.app_bytes = self.filled;
        output.elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
        Ok(output)
    }

    /// Runs one guest command; returns its results. Everything read back is the guest's word:
    /// its filled size is clamped to the application memory, an unknown status is an error.
    fn guest(&mut self, command: &Command, op: Op, args: &[u64]) -> Result<[u64; 6], MachineError> {
        self.check_usable()?;
        self.model_error = None;
        self.release_error = None;
        self.net_error = None;
        // An idle report speaks for the command that sent it, never for a later one.
        self.idle_report = None;
        let mut mailbox: Mailbox = self.read(guest::MAILBOX_GPA)?;
        mailbox.op = op as u64;
        mailbox.arg = [0; 6];
        mailbox.arg[..args.len()].copy_from_slice(args);
        self.write(guest::MAILBOX_GPA, mailbox)?;
        let ran = self.run_until_done();
        // However the command ended, none of its model requests is in flight any more: one it
        // left without its answer is given up (the upstream no longer read for it).
        if let (Some((request, _)), Some(port)) = (self.model_pending.take(), &self.model) {
            port.cancel(request);
            if let Some(coordinator) = self.coordinator.as_mut() {
                coordinator.forget(request);
            }
        }
        // A download or read it left unfinished goes with it.
        self.end_transfer();
        if let Err(e) = ran {
            self.broken = Some(basics::error_chain(&e));
            return Err(e);
        }
        let mailbox: Mailbox = self.read(guest::MAILBOX_GPA)?;
        self.filled = mailbox.result[2].min(self.ram.size() - guest::APP_BASE);
        let reason = match mailbox.status {
            status::OK => return Ok(mailbox.result),
            status::BAD_OP => "unknown operation".to_owned(),
            status::TOO_LARGE => "size beyond the application memory".to_owned(),
            status::IO => "a disk request failed".to_owned(),
            status::MISMATCH => "data read back from the disk differs".to_owned(),
            status::MODEL => self
                .model_error
                .take()
                .unwrap_or_else(|| "the model request got no answer".to_owned()),
            status::RELEASE => self
                .release_error
                .take()
                .unwrap_or_else(|| "the free report was refused".to_owned()),
            status::ARENA if mailbox.result[3] != 0 => format!(
                "the host refused the arena report (errno {}): {}",
                mailbox.result[3],
                self.arenas
                    .stats()
                    .last_refusal
                    .unwrap_or_else(|| "no reason kept".into())
            ),
            status::NET => format!(
                "the transfer failed (errno {}): {}",
                mailbox.result[3],
                self.net_error
                    .take()
                    .unwrap_or_else(|| "the host did not answer".into())
            ),
            status::ARENA => "no such arena, one of that id open already, or no room for it \
                              above the application data"
                .to_owned(),
            other => format!("status {other}"),
        };
        Err(MachineError::Command {
            command: command.to_string(),
            reason,
        })
    }
}
