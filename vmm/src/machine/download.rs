//! The guest's downloads and image reads (see [`crate::net`], [`crate::image`]): its net
//! requests carried to the gateway, which fetches the URL (or the image's file), and the body
//! handed back chunk by chunk. The wait for each chunk is a wait like a model wait: plain, or
//! managed (paused, offloaded, brought back when the chunk is deliverable), judged by its
//! source's estimate (a download: what is left of the chunk at the rate seen; a read: the
//! file at its origin's rate). A chunk is written into guest RAM only once the VM is back
//! (the wait resumes it before it returns; checked before every write).

use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};

use super::model_wait::{WaitOutcome, Waited};
use super::{Machine, MachineError};
use crate::gateway::{Answer, Batching, Flow};
use crate::guest::Refused;
use crate::net::{self, Kind, Target};
use crate::wait::Phase;

/// The gateway's ids of downloads and reads: the top half of the id space. The guest picks
/// its model requests' ids; one from up here can only get in the way of its own download,
/// and never does: a model request gives up the transfer in progress, a transfer the model
/// request in flight.
const NET_REQUESTS: u64 = 1 << 63;

/// A download in progress.
#[derive(Debug)]
pub(super) struct Transfer {
    /// The guest's name for it.
    id: u64,
    /// The gateway's.
    request: u64,
    /// Bytes received and not yet written to the guest (more than its buffer had room for),
    /// from `written` on.
    leftover: Vec<u8>,
    written: usize,
    /// Bytes handed to the guest so far.
    delivered: u64,
    /// The body has ended: whole (`Ok`: `leftover` is all that is left), or not (why).
    ended: Option<Result<(), crate::gateway::Failure>>,
    /// The length the origin announced, if it did.
    total: Option<u64>,
    /// What its waits wait for.
    waited: Waited,
}

/// What the host answers a net request.
struct Reply {
    len: u64,
    more: bool,
    total: Option<u64>,
}

fn refuse(errno: i32, reason: String) -> Refused {
    Refused { errno, reason }
}

/// How long until the next chunk of a download is deliverable, from how far it has come
/// (`None`: nothing to go by yet, no byte arrived): the bytes a chunk still needs (or the
/// body still has, if less) at the rate seen since its first byte, or the chunk's time
/// limit, whichever comes first.
pub(super) fn next_chunk(flow: Option<Flow>, chunking: Batching, now: Instant) -> Option<Duration> {
    let flow = flow?;
    let first = flow.first_at?;
    let by_time = flow
        .since
        .map(|since| (since + chunking.wait).saturating_duration_since(now));
    let elapsed = now.saturating_duration_since(first).as_secs_f64();
    if elapsed <= 0.0 || flow.received == 0 {
        return by_time;
    }
    let rate = flow.received as f64 / elapsed;
    let mut need = chunking.bytes.saturating_sub(flow.waiting);
    if let Some(total) = flow.total {
        need = need.min(total.saturating_sub(flow.received));
    }
    let by_size = Duration::from_secs_f64((need as f64 / rate).min(3600.0));
    Some(by_time.map_or(by_size, |t| t.min(by_size)))
}

impl Machine {
    /// Serves the net request whose page the guest named with its `out` to
    /// [`net::PORT_NET`], and writes the answer into it (a refused one gets an errno; why is
    /// kept for the command's error).
    pub(super) fn net_request(&mut self, page: Option<u32>) -> Result<(), MachineError> {
        let gpa = match net::request_gpa(page, self.ram.size()) {
            Ok(gpa) => gpa,
            Err(reason) => {
                // Nowhere to answer: the guest finds its request unanswered.
                self.net_error = Some(reason);
                return Ok(());
            }
        };
        let mut request: net::Request = self.read(gpa)?;
        let served = match net::check(&request, self.ram.size()) {
            Ok(checked) => self.net_serve(checked)?,
            Err(refused) => Err(refused),
        };
        match served {
            Ok(reply) => {
                request.status = 0;
                request.len = reply.len;
                request.more = u64::from(reply.more);
                request.total = reply.total.unwrap_or(net::UNKNOWN_TOTAL);
            }
            Err(Refused { errno, reason }) => {
                request.status = u64::try_from(errno).unwrap_or(libc::EIO as u64);
                request.len = 0;
                request.more = 0;
                self.net_error = Some(reason);
            }
        }
        self.write(gpa, request)
    }

    fn net_serve(&mut self, checked: net::Checked) -> Result<Result<Reply, Refused>, MachineError> {
        match checked.kind {
            Kind::Close => {
                if self.transfer.as_ref().is_some_and(|t| t.id == checked.id) {
                    self.end_transfer();
                }
                Ok(Ok(Reply {
                    len: 0,
                    more: false,
                    total: None,
                }))
            }
            Kind::Get | Kind::Read => {
                let started = if checked.kind == Kind::Get {
                    self.start_download(checked)
                } else {
                    self.start_read(checked)
                };
                if let Err(refused) = started {
                    self.io_stats.failed += 1;
                    return Ok(Err(refused));
                }
                self.next_chunk(checked)
            }
            Kind::Next => {
                if self.transfer.as_ref().is_none_or(|t| t.id != checked.id) {
                    return Ok(Err(refuse(
                        libc::ENOENT,
                        format!("no download {} in progress", checked.id),
                    )));
                }
                self.next_chunk(checked)
            }
        }
    }

    /// Gives the download in progress up: the gateway reads no more of it.
    pub(super) fn end_transfer(&mut self) {
        if let Some(transfer) = self.transfer.take() {
            self.give_up(transfer.request);
        }
    }

    /// Request `request` goes nowhere from now on: the gateway reads no more of it, the
    /// coordinator waits for it no more (harmless for one already over).
    pub(super) fn give_up(&mut self, request: u64) {
        if let Some(port) = &self.model {
            port.cancel(request);
        }
        if let Some(coordinator) = self.coordinator.as_mut() {
            coordinator.forget(request);
        }
    }

    /// The bytes the guest named in a request's URL fields, as text.
    fn request_text(&self, (gpa, len): (u64, u64), what: &str) -> Result<String, Refused> {
        let mut text = vec![0u8; usize::try_from(len).unwrap_or(0)];
        self.ram
            .memory()
            .read_slice(&mut text, GuestAddress(gpa))
            .map_err(|_| {
                refuse(
                    libc::EFAULT,
                    format!("the {what} at {gpa:#x} cannot be read"),
                )
            })?;
        String::from_utf8(text)
            .map_err(|_| refuse(libc::EINVAL, format!("the {what} is not UTF-8")))
    }

    /// The transfer `request` of the guest's `id` is under way.
    fn begin(&mut self, id: u64, request: u64, waited: Waited) {
        // A model request left in flight (a guest may knock on the model port whenever it
        // likes) is given up: one request at a time.
        if let Some((pending, _)) = self.model_pending.take() {
            self.give_up(pending);
        }
        self.transfer = Some(Transfer {
            id,
            request,
            leftover: Vec::new(),
            written: 0,
            delivered: 0,
            ended: None,
            total: None,
            waited,
        });
    }

    /// Checks a `Read`'s path against the VM's image and sends it (one transfer at a time: a
    /// new one replaces the one in progress).
    fn start_read(&mut self, checked: net::Checked) -> Result<(), Refused> {
        let (Some(port), Some(image)) = (self.model.clone(), self.image.clone()) else {
            return Err(refuse(
                libc::ENODEV,
                "this VM has no image (pvisor run --vm-image DIR|s3://BUCKET/PREFIX)".into(),
            ));
        };
        let path = self.request_text(checked.url, "path")?;
        crate::image::check_path(&path).map_err(|why| refuse(libc::EINVAL, why))?;
        let Some(entry) = image.entry(&path) else {
            return Err(refuse(
                libc::ENOENT,
                format!("`{path}` is not in the image"),
            ));
        };
        if entry.bytes > checked.buf.1 {
            return Err(refuse(
                libc::EFBIG,
                format!(
                    "`{path}` has {} bytes, more than the {} the guest has room for",
                    entry.bytes, checked.buf.1
                ),
            ));
        }
        let expected = image.expected(&path);
        self.io_stats.reads += 1;
        if expected == Some(Duration::ZERO) {
            self.io_stats.staged_reads += 1;
        }
        self.end_transfer();
        self.net_sent += 1;
        let request = NET_REQUESTS | self.net_sent;
        port.read(request, &image, &path);
        let sent = Instant::now();
        let due = expected.and_then(|e| sent.checked_add(e));
        self.begin(checked.id, request, Waited::Read { due, sent });
        Ok(())
    }

    /// Checks a `Get`'s URL against the allow-list and sends it (one transfer at a time: a
    /// new one replaces the one in progress).
    fn start_download(&mut self, checked: net::Checked) -> Result<(), Refused> {
        let (Some(port), Some(options)) = (self.model.clone(), self.net.clone()) else {
            return Err(refuse(
                libc::ENETUNREACH,
                "this VM has no network (pvisor run --vm-net-allow ORIGIN)".into(),
            ));
        };
        let url = self.request_text(checked.url, "URL")?;
        let target = Target::parse(&url).map_err(|why| refuse(libc::EINVAL, why))?;
        if !options.allow.permits(&target) {
            return Err(refuse(
                libc::EACCES,
                format!(
                    "{} is not an allowed origin (--vm-net-allow: {})",
                    target.origin(),
                    match options.allow.origins() {
                        [] => "none".to_owned(),
                        origins => origins.join(", "),
                    }
                ),
            ));
        }
        self.io_stats.downloads += 1;
        self.end_transfer();
        self.net_sent += 1;
        let request = NET_REQUESTS | self.net_sent;
        // The guest's buffer at the start bounds the whole body.
        let limit = checked.buf.1;
        port.fetch(request, &target, &options, limit);
        let waited = Waited::Download {
            chunking: options.chunking,
            sent: Instant::now(),
        };
        self.begin(checked.id, request, waited);
        Ok(())
    }

    /// The next chunk of the download in progress into the guest's buffer: what is left of
    /// the last one, else the next batch once deliverable (waiting for it as for a model
    /// answer), or the end.
    fn next_chunk(
        &mut self,
        checked: net::Checked,
    ) -> Result<Result<Reply, Refused>, MachineError> {
        let Some(mut transfer) = self.transfer.take() else {
            return Ok(Err(refuse(libc::ENOENT, "no download in progress".into())));
        };
        let resumes = |machine: &Self| {
            machine
                .coordinator
                .as_ref()
                .map_or(0, |c| c.stats().resumes)
        };
        let resumes_before = resumes(self);
        if transfer.written == transfer.leftover.len() && transfer.ended.is_none() {
            self.wait_chunk(&mut transfer);
        }
        if let Some(Err(why)) = &transfer.ended {
            self.io_stats.failed += 1;
            // By its kind; the words are the gateway's own (an origin's error body is not
            // quoted for a GET).
            let errno = match why.kind {
                crate::gateway::FailureKind::TimedOut => libc::ETIMEDOUT,
                crate::gateway::FailureKind::TooLarge => libc::EFBIG,
                crate::gateway::FailureKind::Failed => libc::EIO,
            };
            let why = why.message.clone();
            self.give_up(transfer.request);
            return Ok(Err(refuse(errno, why)));
        }
        let (gpa, room) = checked.buf;
        let rest = &transfer.leftover[transfer.written..];
        let n = rest.len().min(usize::try_from(room).unwrap_or(usize::MAX));
        // The RAM gate: the device writes guest RAM only while the VM runs, its RAM back.
        let phase = self
            .coordinator
            .as_ref()
            .map_or(Phase::Running, |c| c.phase());
        if phase != Phase::Running {
            self.give_up(transfer.request);
            return Err(MachineError::Command {
                command: "download".into(),
                reason: format!("a chunk was about to be written while the VM is {phase:?}"),
            });
        }
        self.ram
            .memory()
            .write_slice(&rest[..n], GuestAddress(gpa))
            .map_err(|e| MachineError::GuestMemory { gpa, source: e })?;
        transfer.written += n;
        transfer.delivered += n as u64;
        if transfer.written == transfer.leftover.len() {
            transfer.leftover = Vec::new();
            transfer.written = 0;
        }
        self.io_stats.bytes += n as u64;
        if n > 0 {
            self.io_stats.chunks += 1;
            if resumes(self) > resumes_before {
                self.io_stats.after_resume += 1;
            }
        }
        let more = !transfer.leftover.is_empty() || transfer.ended.is_none();
        if !more {
            // Whole: its length is what came.
            transfer.total = Some(transfer.delivered);
        }
        let reply = Reply {
            len: n as u64,
            more,
            total: transfer.total,
        };
        if more {
            self.transfer = Some(transfer);
        }
        Ok(Ok(reply))
    }

    /// Waits for the next chunk of `transfer` (plainly, or managed if `--vm-wait-sources`
    /// manages its kind) and keeps it, or the end, or why it failed.
    fn wait_chunk(&mut self, transfer: &mut Transfer) {
        let Some(port) = self.model.clone() else {
            transfer.ended = Some(Err("this VM has no gateway".into()));
            return;
        };
        if let Some(flow) = port.flow(transfer.request) {
            transfer.total = flow.total.or(transfer.total);
        }
        // A read is handed over whole, once fetched and checked.
        let chunking = match transfer.waited {
            Waited::Download { chunking, .. } => Some(chunking),
            Waited::Model | Waited::Read { .. } => None,
        };
        let began = Instant::now();
        let (request, waited) = (transfer.request, transfer.waited);
        let outcome = match self.management_of(waited) {
            Some(wait) => self.managed_wait(&*port, request, None, chunking, &wait, waited),
            None => self.plain_wait(&*port, request, None, chunking, waited),
        };
        self.count_wait(waited, began);
        match outcome {
            WaitOutcome::Batch(bytes, deliverable) => {
                transfer.leftover = bytes;
                transfer.written = 0;
                self.batch_delivered(waited, deliverable);
            }
            WaitOutcome::Answer(Answer::Data(rest)) => {
                transfer.leftover = rest;
                transfer.written = 0;
                transfer.ended = Some(Ok(()));
            }
            WaitOutcome::Answer(Answer::Error(why)) => transfer.ended = Some(Err(why)),
            // No timer is kept while a transfer waits.
            WaitOutcome::Timer => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_chunk_is_due_by_size_at_the_rate_seen_or_by_time() {
        let now = Instant::now();
        let chunking = Batching {
            bytes: 1 << 20,
            wait: Duration::from_secs(1),
            buffer: 4 << 20,
        };
        let flow = |received: u64, waiting: u64, total: Option<u64>| Flow {
            received,
            total,
            first_at: Some(now - Duration::from_secs(2)),
            waiting,
            since: Some(now - Duration::from_millis(100)),
        };
        // Nothing arrived yet: nothing to go by.
        assert_eq!(next_chunk(None, chunking, now), None);
        let none = Flow {
            first_at: None,
            since: None,
            ..flow(0, 0, None)
        };
        assert_eq!(next_chunk(Some(none), chunking, now), None);
        // 2 MiB in 2 s: 1 MiB/s; half a chunk waiting: half a second more by size, before
        // the 0.9 s left by time.
        let left = next_chunk(Some(flow(2 << 20, 512 << 10, None)), chunking, now).expect("some");
        assert!((left.as_secs_f64() - 0.5).abs() < 0.01, "{left:?}");
        // The body ends sooner than a chunk fills.
        let left = next_chunk(
            Some(flow(2 << 20, 0, Some((2 << 20) + (256 << 10)))),
            chunking,
            now,
        )
        .expect("some");
        assert!((left.as_secs_f64() - 0.25).abs() < 0.01, "{left:?}");
        // A slow origin: the time limit comes first.
        let slow = Flow {
            received: 1 << 10,
            ..flow(0, 512, None)
        };
        let left = next_chunk(Some(slow), chunking, now).expect("some");
        assert!((left.as_secs_f64() - 0.9).abs() < 0.01, "{left:?}");
    }
}
