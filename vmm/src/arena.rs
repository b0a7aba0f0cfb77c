//! Phase arenas (Tide, seed 003): the guest reports memory a phase owns, in 2 MiB-aligned
//! extents of its own, and whether its contents must survive the phase; the host reclaims
//! exactly that when the phase closes, without waiting for it to turn cold.
//!
//! The channel is a versioned message in a guest page whose page number the guest writes to
//! [`PORT_ARENA`] with a 32-bit `out`: the workload guest sends it (guest/guest.c), and a
//! Linux guest's arena driver sends the same one (guest-patches/). Every field is the guest's
//! word, checked here before anything moves ([`Registry::report`]): only whole extents of the
//! application region, never overlapping another arena, never the guest's own first 2 MiB;
//! close and free act on the extents registered at open, never on what the close says; a
//! flood is refused past a rate. A refused report changes nothing and is counted.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::guest::{self, Refused};

/// The port of arena reports (32-bit `out`: the report's guest page number).
pub const PORT_ARENA: u16 = 0x50;
/// Where the workload guest keeps its report.
pub const REPORT_GPA: u64 = 0xA000;
/// `"PVAR"`, little-endian.
pub const MAGIC: u32 = 0x5241_5650;
/// The message version this host speaks.
pub const VERSION: u16 = 1;
/// Most extents of one arena.
pub const MAX_EXTENTS: usize = 16;
/// Most arenas registered at once.
pub const MAX_ARENAS: usize = 64;
/// Extents are whole, aligned 2 MiB ranges: a huge page each where RAM is huge-page backed.
pub const EXTENT: u64 = 2 << 20;
/// Reports allowed in a burst; they come back at [`REPORTS_PER_SECOND`].
pub const REPORT_BURST: f64 = 256.0;
/// The sustained rate of reports: far above a harness's phases, far below a flood.
pub const REPORTS_PER_SECOND: f64 = 1000.0;

/// What a report says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Kind {
    /// The arena is in use from now on.
    Open = 1,
    /// Its phase is over.
    Close = 2,
    /// It is gone: its extents go back to the guest's allocator.
    Free = 3,
    /// Not an arena's: the guest goes idle, and says when its next clockevent is due
    /// (`id`: nanoseconds from now; `intent`: 1 if a timer is pending then, 0 if none is;
    /// no extents). The idle handoff of guest-patches/0050, and of the workload guest's
    /// `model` waits.
    Idle = 4,
}

/// Longest timer an idle report may name: an hour, as the workload guest's own timers.
pub const MAX_IDLE_NS: u64 = guest::MAX_TIMER_MS * 1_000_000;

/// What must become of an arena's contents when its phase closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u64)]
pub enum Intent {
    /// They must come back intact on touch: compressed into the pool (or kept).
    Survive = 1,
    /// They are dead: dropped; a touch after close reads zeros, and is counted.
    Discard = 2,
}

impl std::str::FromStr for Intent {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "survive" => Ok(Self::Survive),
            "discard" => Ok(Self::Discard),
            other => Err(format!("unknown intent `{other}` (survive or discard)")),
        }
    }
}

impl std::fmt::Display for Intent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Survive => "survive",
            Self::Discard => "discard",
        })
    }
}

/// The report, as laid out in guest memory (version 1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Report {
    /// [`MAGIC`].
    pub magic: u32,
    /// [`VERSION`].
    pub version: u16,
    /// [`Kind`].
    pub kind: u16,
    /// The guest's name for the arena.
    pub id: u64,
    /// [`Intent`] (open; close and free repeat it).
    pub intent: u64,
    /// Extents that follow.
    pub count: u64,
    /// The host's answer: 0, or an errno.
    pub status: u64,
    /// `(gpa, len)` of each extent.
    pub extents: [[u64; 2]; MAX_EXTENTS],
}

// SAFETY: plain integers, no padding (4 + 2 + 2 + 8 * 4 + 16 * 16 bytes), any bits valid.
unsafe impl vm_memory::ByteValued for Report {}

/// What the host must do for a report it accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Nothing moves.
    None,
    /// An arena opened on these guest-physical ranges: the guest fills them next, so their
    /// pages may be installed now, without a fault each.
    Populate(Vec<(u64, u64)>),
    /// Drop these guest-physical ranges (a discard arena closed).
    Drop(Vec<(u64, u64)>),
    /// An arena was freed: these ranges are free memory, which may be dropped (the host
    /// drops them when the guest goes idle, unless an arena opened on them meanwhile).
    Free(Vec<(u64, u64)>),
    /// Keep these, out of memory (a survive arena closed): into the offload store or cold
    /// compression's pool.
    Survive(Vec<(u64, u64)>),
    /// The guest went idle; its next timer falls due this long after the report (`None`: no
    /// timer is pending).
    Idle(Option<std::time::Duration>),
}

/// A registered arena as a snapshot keeps it (the guest's table of arenas is in its RAM, and
/// goes on after a restore).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SavedArena {
    /// The guest's name for it.
    pub id: u64,
    /// Its intent.
    pub intent: Intent,
    /// Its phase is over.
    pub closed: bool,
    /// Its `(gpa, len)` extents.
    pub extents: Vec<(u64, u64)>,
}

/// What the host did with an accepted report's extents (see [`Registry::record`]).
#[derive(Debug, Default)]
pub struct Outcome {
    /// Bytes installed at an open.
    pub populated: u64,
    /// Bytes dropped.
    pub dropped: u64,
    /// Bytes compressed into the pool.
    pub compressed: u64,
    /// Bytes written to the offload store.
    pub offloaded: u64,
    /// Bytes kept resident.
    pub kept: u64,
    /// Why something was kept that should have gone.
    pub failure: Option<String>,
}

/// Where an arena stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    Closed,
}

#[derive(Debug, Clone)]
struct Arena {
    extents: Vec<(u64, u64)>,
    intent: Intent,
    state: State,
}

/// What the arenas did (in `stats`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ArenaStats {
    /// Reports received, accepted or not.
    pub reports: u64,
    /// Bytes of arenas closed and left as they were (`--vm-arenas false`).
    pub ignored_bytes: u64,
    /// Idle reports accepted (the guest's next clockevent, for wait management).
    pub idle_reports: u64,
    /// Reports refused (bad fields, unknown arenas, overlaps, a flood); nothing moved.
    pub refused: u64,
    /// Of those, refused for their rate.
    pub refused_flood: u64,
    /// Arenas open now.
    pub open: u64,
    /// Arenas closed and not yet freed.
    pub closed: u64,
    /// Bytes of memory dropped (resident before, gone after) at the close of discard arenas
    /// and the free of any.
    pub dropped_bytes: u64,
    /// Bytes of arenas installed as zero pages at their open, before the guest filled them.
    pub populated_bytes: u64,
    /// Bytes of survive arenas that went into the pool at close.
    pub compressed_bytes: u64,
    /// Bytes of survive arenas written to the offload store at close
    /// (`--vm-arena-offload`).
    pub offloaded_bytes: u64,
    /// Bytes of arenas still resident after their close or free: a survive arena with no pool
    /// or store to go to or not compressible, a drop or write that failed.
    pub kept_bytes: u64,
    /// Pages of closed discard arenas in memory again: the guest touched them after it
    /// declared them dead (a harness bug shows here).
    pub touched_after_close_pages: u64,
    /// Why the last report was refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_refusal: Option<String>,
    /// Why the host last failed to drop an accepted arena's memory (it was kept).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<String>,
}

/// The host's record of a guest's arenas.
#[derive(Debug)]
pub struct Registry {
    arenas: BTreeMap<u64, Arena>,
    /// The application region: `[guest::APP_BASE, ram_size)`.
    ram_size: u64,
    bucket: Bucket,
    idle_bucket: Bucket,
    /// Bytes survive closes may move.
    survive_bucket: Bucket,
    /// Closes and frees are acted on (else only checked and counted).
    acting: bool,
    stats: ArenaStats,
}

/// A token bucket on the caller's clock (the tests' too): `burst` tokens, refilled at `rate`
/// a second.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    burst: f64,
    rate: f64,
    refilled: Instant,
}

impl Bucket {
    /// [`REPORT_BURST`] reports, refilled at [`REPORTS_PER_SECOND`].
    fn full() -> Self {
        Self::new(REPORT_BURST, REPORTS_PER_SECOND)
    }

    fn new(burst: f64, rate: f64) -> Self {
        Self {
            tokens: burst,
            burst,
            rate,
            refilled: Instant::now(),
        }
    }

    fn take(&mut self, now: Instant) -> bool {
        self.take_many(1.0, now)
    }

    fn take_many(&mut self, tokens: f64, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.refilled = self.refilled.max(now);
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        if self.tokens < tokens {
            return false;
        }
        self.tokens -= tokens;
        true
    }
}

/// Survive arenas cost the host a compression or a write to disk per byte: their closes may
/// move this many times guest RAM in a burst, and a tenth of it a second after that (a
/// harness's phases move a fraction of it between waits of seconds).
pub const SURVIVE_BURST_RAMS: f64 = 1.0;
/// See [`SURVIVE_BURST_RAMS`].
pub const SURVIVE_RAMS_PER_SECOND: f64 = 0.1;

fn bytes(extents: &[(u64, u64)]) -> u64 {
    extents.iter().map(|&(_, len)| len).sum()
}

fn refuse(errno: i32, reason: String) -> Refused {
    Refused { errno, reason }
}

impl Registry {
    /// No arenas, for a guest of `ram_size` bytes.
    pub fn new(ram_size: u64) -> Self {
        Self {
            arenas: BTreeMap::new(),
            ram_size,
            bucket: Bucket::full(),
            idle_bucket: Bucket::full(),
            survive_bucket: Bucket::new(
                ram_size as f64 * SURVIVE_BURST_RAMS,
                ram_size as f64 * SURVIVE_RAMS_PER_SECOND,
            ),
            acting: true,
            stats: ArenaStats::default(),
        }
    }

    /// Checks `report` (every field the guest's) and records it; returns what the host must
    /// do, or why it refused (nothing changed then; counted).
    pub fn report(&mut self, report: &Report, now: Instant) -> Result<Action, Refused> {
        self.stats.reports += 1;
        let result = match self.check_rate(report, now) {
            Ok(()) => self.apply(report),
            Err(flood) => {
                self.stats.refused_flood += 1;
                Err(flood)
            }
        };
        let result = match result {
            Ok(Action::Survive(extents))
                if self.acting && !self.survive_bucket.take_many(bytes(&extents) as f64, now) =>
            {
                // Closed all the same; its memory stays where it is.
                self.stats.kept_bytes += bytes(&extents);
                self.stats.last_failure = Some(format!(
                    "survive arenas closed faster than {SURVIVE_RAMS_PER_SECOND} times guest RAM \
                     a second: kept resident"
                ));
                Ok(Action::None)
            }
            Ok(
                Action::Drop(extents)
                | Action::Free(extents)
                | Action::Survive(extents)
                | Action::Populate(extents),
            ) if !self.acting => {
                if report.kind == Kind::Close as u16 {
                    self.stats.ignored_bytes += bytes(&extents);
                }
                Ok(Action::None)
            }
            other => other,
        };
        match &result {
            Err(refused) => {
                self.stats.refused += 1;
                self.stats.last_refusal = Some(refused.reason.clone());
            }
            Ok(Action::Idle(_)) => self.stats.idle_reports += 1,
            Ok(_) => {}
        }
        result
    }

    /// The arenas registered now, for a snapshot.
    pub fn saved(&self) -> Vec<SavedArena> {
        self.arenas
            .iter()
            .map(|(&id, a)| SavedArena {
                id,
                intent: a.intent,
                closed: a.state == State::Closed,
                extents: a.extents.clone(),
            })
            .collect()
    }

    /// Registers a snapshot's arenas, each checked as its open report would be (a manifest is
    /// no more trusted than the guest): the first one refused is the error, and nothing is
    /// registered then. Counts nothing.
    pub fn restore(&mut self, saved: &[SavedArena]) -> Result<(), Refused> {
        let mut fresh = Self::new(self.ram_size);
        for arena in saved {
            if arena.extents.len() > MAX_EXTENTS {
                return Err(refuse(
                    libc::EINVAL,
                    format!("arena {}: {} extents", arena.id, arena.extents.len()),
                ));
            }
            let mut report = Report {
                magic: MAGIC,
                version: VERSION,
                kind: Kind::Open as u16,
                id: arena.id,
                intent: arena.intent as u64,
                count: arena.extents.len() as u64,
                ..Report::default()
            };
            for (slot, &(gpa, len)) in report.extents.iter_mut().zip(&arena.extents) {
                *slot = [gpa, len];
            }
            fresh.apply(&report)?;
            if arena.closed {
                if let Some(a) = fresh.arenas.get_mut(&arena.id) {
                    a.state = State::Closed;
                }
            }
        }
        self.arenas = fresh.arenas;
        Ok(())
    }

    /// Whether closes and frees are acted on (`false`: a host without arenas, to compare
    /// against: reports are checked, registered and counted, and nothing moves).
    pub fn set_acting(&mut self, acting: bool) {
        self.acting = acting;
    }

    /// A report the guest sent the wrong way (not a 32-bit page number): refused, counted.
    pub fn refuse_malformed(&mut self, reason: String) {
        self.stats.reports += 1;
        self.stats.refused += 1;
        self.stats.last_refusal = Some(reason);
    }

    /// Counts what an accepted close or free did with its bytes, and why a drop failed.
    pub fn record(&mut self, done: Outcome) {
        if done.failure.is_some() {
            self.stats.last_failure = done.failure;
        }
        self.stats.populated_bytes += done.populated;
        self.stats.dropped_bytes += done.dropped;
        self.stats.compressed_bytes += done.compressed;
        self.stats.offloaded_bytes += done.offloaded;
        self.stats.kept_bytes += done.kept;
    }

    /// The closed discard arenas' extents (where a touch after close shows); none where the
    /// host does not act on arenas (nothing was dropped).
    pub fn closed_discarded(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.arenas
            .values()
            .filter(|a| self.acting && a.state == State::Closed && a.intent == Intent::Discard)
            .flat_map(|a| a.extents.iter().copied())
    }

    /// Its counters; `touched_after_close_pages` is the caller's to fill.
    pub fn stats(&self) -> ArenaStats {
        let mut stats = self.stats.clone();
        stats.open = self.count(State::Open);
        stats.closed = self.count(State::Closed);
        stats
    }

    fn count(&self, state: State) -> u64 {
        self.arenas.values().filter(|a| a.state == state).count() as u64
    }

    /// Idle reports have a bucket of their own: a guest that idles often must not have its
    /// arenas' closes refused.
    fn check_rate(&mut self, report: &Report, now: Instant) -> Result<(), Refused> {
        let (bucket, what) = if report.kind == Kind::Idle as u16 {
            (&mut self.idle_bucket, "idle")
        } else {
            (&mut self.bucket, "arena")
        };
        if bucket.take(now) {
            Ok(())
        } else {
            Err(refuse(
                libc::EBUSY,
                format!("more than {REPORTS_PER_SECOND} {what} reports a second"),
            ))
        }
    }

    fn apply(&mut self, report: &Report) -> Result<Action, Refused> {
        if report.magic != MAGIC {
            return Err(refuse(
                libc::EINVAL,
                format!("arena report magic {:#x}", report.magic),
            ));
        }
        if report.version != VERSION {
            return Err(refuse(
                libc::EPROTONOSUPPORT,
                format!(
                    "arena report version {} (this host speaks {VERSION})",
                    report.version
                ),
            ));
        }
        if report.kind == Kind::Idle as u16 {
            return idle(report);
        }
        let id = report.id;
        let extents = self.extents(report)?;
        let intent = match report.intent {
            1 => Intent::Survive,
            2 => Intent::Discard,
            other => {
                return Err(refuse(
                    libc::EINVAL,
                    format!("arena {id}: unknown intent {other}"),
                ))
            }
        };
        match report.kind {
            k if k == Kind::Open as u16 => {
                if self.arenas.contains_key(&id) {
                    return Err(refuse(libc::EEXIST, format!("arena {id} is already open")));
                }
                if self.arenas.len() >= MAX_ARENAS {
                    return Err(refuse(
                        libc::ENOSPC,
                        format!("more than {MAX_ARENAS} arenas"),
                    ));
                }
                for (other, arena) in &self.arenas {
                    if arena
                        .extents
                        .iter()
                        .any(|&e| extents.iter().any(|&n| overlap(e, n)))
                    {
                        return Err(refuse(
                            libc::EBUSY,
                            format!("arena {id} overlaps arena {other}"),
                        ));
                    }
                }
                self.arenas.insert(
                    id,
                    Arena {
                        extents: extents.clone(),
                        intent,
                        state: State::Open,
                    },
                );
                Ok(Action::Populate(extents))
            }
            k if k == Kind::Close as u16 || k == Kind::Free as u16 => {
                let arena = self
                    .arenas
                    .get(&id)
                    .ok_or_else(|| refuse(libc::ENOENT, format!("arena {id} is not open")))?;
                // The host acts on what it registered; a close that says otherwise is a
                // confused or hostile guest.
                if arena.extents != extents || arena.intent != intent {
                    return Err(refuse(
                        libc::EINVAL,
                        format!("arena {id}: the report's extents or intent differ from its open"),
                    ));
                }
                if k == Kind::Free as u16 {
                    let arena = self.arenas.remove(&id).expect("found above");
                    return Ok(Action::Free(arena.extents));
                }
                if arena.state != State::Open {
                    return Err(refuse(libc::EALREADY, format!("arena {id} is closed")));
                }
                let arena = self.arenas.get_mut(&id).expect("found above");
                arena.state = State::Closed;
                Ok(match arena.intent {
                    Intent::Discard => Action::Drop(arena.extents.clone()),
                    Intent::Survive => Action::Survive(arena.extents.clone()),
                })
            }
            other => Err(refuse(
                libc::EINVAL,
                format!("arena {id}: unknown report kind {other}"),
            )),
        }
    }

    /// The report's extents, each whole 2 MiB of the application region, none overlapping.
    fn extents(&self, report: &Report) -> Result<Vec<(u64, u64)>, Refused> {
        let id = report.id;
        let count = usize::try_from(report.count).unwrap_or(usize::MAX);
        if count == 0 || count > MAX_EXTENTS {
            return Err(refuse(
                libc::EINVAL,
                format!("arena {id}: {} extents (1 to {MAX_EXTENTS})", report.count),
            ));
        }
        let mut extents: Vec<(u64, u64)> = Vec::with_capacity(count);
        for &[gpa, len] in &report.extents[..count] {
            let end = gpa.checked_add(len);
            let inside = end.is_some_and(|end| gpa >= guest::APP_BASE && end <= self.ram_size);
            if len == 0 || !gpa.is_multiple_of(EXTENT) || !len.is_multiple_of(EXTENT) || !inside {
                return Err(refuse(
                    libc::EINVAL,
                    format!(
                        "arena {id}: extent of {len:#x} bytes at {gpa:#x} is not whole 2 MiB \
                         pages of the application memory ({:#x}..{:#x})",
                        guest::APP_BASE,
                        self.ram_size
                    ),
                ));
            }
            if extents.iter().any(|&e| overlap(e, (gpa, len))) {
                return Err(refuse(
                    libc::EINVAL,
                    format!("arena {id}: its extents overlap"),
                ));
            }
            extents.push((gpa, len));
        }
        Ok(extents)
    }
}

/// An idle report: no extents, a timer flag of 0 or 1, a timer no longer than
/// [`MAX_IDLE_NS`].
fn idle(report: &Report) -> Result<Action, Refused> {
    let (next_ns, timer) = (report.id, report.intent);
    if report.count != 0 {
        return Err(refuse(
            libc::EINVAL,
            format!("an idle report with {} extents (none)", report.count),
        ));
    }
    match timer {
        0 => Ok(Action::Idle(None)),
        1 if next_ns <= MAX_IDLE_NS => {
            Ok(Action::Idle(Some(std::time::Duration::from_nanos(next_ns))))
        }
        1 => Err(refuse(
            libc::ERANGE,
            format!("an idle report's timer of {next_ns} ns is longer than {MAX_IDLE_NS} ns"),
        )),
        other => Err(refuse(
            libc::EINVAL,
            format!("an idle report's timer flag is {other} (0 or 1)"),
        )),
    }
}

/// Where the report of an `out` of `value` to [`PORT_ARENA`] lies: a 32-bit page number whose
/// page holds a whole report inside `ram_size` bytes of RAM; else why not.
pub fn report_gpa(value: Option<u32>, ram_size: u64) -> Result<u64, String> {
    message_gpa::<Report>(value, ram_size, "an arena report")
}

/// Where a message of type `M` (`what`, with its article) sent by an `out` of `value` lies: a 32-bit page
/// number whose page holds a whole `M` inside `ram_size` bytes of RAM; else why not. The
/// shape of every page-number channel (arenas, downloads).
pub fn message_gpa<M>(value: Option<u32>, ram_size: u64, what: &str) -> Result<u64, String> {
    let Some(page) = value else {
        return Err(format!("{what}'s `out` is not 32 bits (its page number)"));
    };
    let gpa = u64::from(page) << 12;
    if gpa + std::mem::size_of::<M>() as u64 > ram_size {
        return Err(format!("{what} at {gpa:#x} is outside RAM"));
    }
    Ok(gpa)
}

fn overlap((a, alen): (u64, u64), (b, blen): (u64, u64)) -> bool {
    a < b + blen && b < a + alen
}

#[cfg(test)]
mod tests {
    use super::*;

    const RAM: u64 = 64 << 20;
    const AT: u64 = 32 << 20;

    fn report(kind: Kind, id: u64, intent: Intent, extents: &[(u64, u64)]) -> Report {
        let mut r = Report {
            magic: MAGIC,
            version: VERSION,
            kind: kind as u16,
            id,
            intent: intent as u64,
            count: extents.len() as u64,
            ..Report::default()
        };
        for (i, &(gpa, len)) in extents.iter().enumerate() {
            r.extents[i] = [gpa, len];
        }
        r
    }

    #[test]
    fn survive_closes_past_their_byte_budget_keep_the_memory_and_say_so() {
        let mut reg = Registry::new(RAM);
        let now = Instant::now();
        // The whole application memory, in 16 extents, opened and closed again and again.
        let span = (RAM - AT) / 16 / EXTENT * EXTENT;
        let all: Vec<(u64, u64)> = (0..16).map(|i| (AT + i * span, span)).collect();
        let mut moved = 0;
        for id in 0..4 {
            reg.report(&report(Kind::Open, id, Intent::Survive, &all), now)
                .unwrap();
            if reg.report(&report(Kind::Close, id, Intent::Survive, &all), now)
                == Ok(Action::Survive(all.clone()))
            {
                moved += 1;
            }
            reg.report(&report(Kind::Free, id, Intent::Survive, &all), now)
                .unwrap();
        }
        // One RAM's worth in the burst (each close moves half of it), no more.
        assert_eq!(span * 16, RAM / 2);
        assert_eq!(moved, 2);
        let stats = reg.stats();
        assert_eq!(stats.kept_bytes, RAM, "{stats:?}");
        assert!(stats.last_failure.unwrap().contains("kept resident"));
        // Ten seconds later the budget is back.
        let later = now + std::time::Duration::from_secs(10);
        reg.report(&report(Kind::Open, 9, Intent::Survive, &all), later)
            .unwrap();
        assert_eq!(
            reg.report(&report(Kind::Close, 9, Intent::Survive, &all), later),
            Ok(Action::Survive(all.clone()))
        );
    }

    #[test]
    fn saved_arenas_restore_as_they_were_and_a_bad_one_restores_nothing() {
        let mut reg = Registry::new(RAM);
        let now = Instant::now();
        let a = [(AT, 4 << 20)];
        let b = [(AT + (8 << 20), EXTENT)];
        reg.report(&report(Kind::Open, 1, Intent::Discard, &a), now)
            .unwrap();
        reg.report(&report(Kind::Open, 2, Intent::Survive, &b), now)
            .unwrap();
        reg.report(&report(Kind::Close, 1, Intent::Discard, &a), now)
            .unwrap();
        let saved = reg.saved();
        let mut back = Registry::new(RAM);
        back.restore(&saved).unwrap();
        assert_eq!(back.saved(), saved);
        assert_eq!((back.stats().open, back.stats().closed), (1, 1));
        // The restored arenas act as before: the survive one closes to its extents.
        assert_eq!(
            back.report(&report(Kind::Close, 2, Intent::Survive, &b), now),
            Ok(Action::Survive(b.to_vec()))
        );
        // Overlapping, or outside the application memory: refused, and nothing registered.
        for bad in [
            vec![
                saved[0].clone(),
                SavedArena {
                    id: 9,
                    ..saved[0].clone()
                },
            ],
            vec![SavedArena {
                extents: vec![(0, EXTENT)],
                ..saved[1].clone()
            }],
        ] {
            let mut fresh = Registry::new(RAM);
            assert!(fresh.restore(&bad).is_err());
            assert!(fresh.saved().is_empty());
        }
    }

    #[test]
    fn idle_reports_give_the_next_timer_and_bad_ones_are_refused() {
        let mut reg = Registry::new(RAM);
        let now = Instant::now();
        let idle = |next_ns: u64, timer: u64, count: u64| Report {
            magic: MAGIC,
            version: VERSION,
            kind: Kind::Idle as u16,
            id: next_ns,
            intent: timer,
            count,
            ..Report::default()
        };
        let ms = std::time::Duration::from_millis;
        assert_eq!(
            reg.report(&idle(1_500_000_000, 1, 0), now),
            Ok(Action::Idle(Some(ms(1500))))
        );
        // No timer pending: whatever the time field says.
        assert_eq!(reg.report(&idle(7, 0, 0), now), Ok(Action::Idle(None)));
        for (bad, errno) in [
            (idle(1, 1, 1), libc::EINVAL),
            (idle(1, 2, 0), libc::EINVAL),
            (idle(MAX_IDLE_NS + 1, 1, 0), libc::ERANGE),
        ] {
            assert_eq!(reg.report(&bad, now).map_err(|r| r.errno), Err(errno));
        }
        let stats = reg.stats();
        assert_eq!(
            (stats.idle_reports, stats.refused, stats.refused_flood),
            (2, 3, 0)
        );
        assert_eq!((stats.open, stats.closed), (0, 0));
    }

    #[test]
    fn an_arena_opens_closes_by_its_intent_and_frees() {
        let mut reg = Registry::new(RAM);
        let now = Instant::now();
        let ext = [(AT, 4 << 20)];
        assert_eq!(
            reg.report(&report(Kind::Open, 1, Intent::Discard, &ext), now),
            Ok(Action::Populate(ext.to_vec()))
        );
        assert_eq!(
            reg.report(
                &report(Kind::Open, 2, Intent::Survive, &[(AT + (4 << 20), EXTENT)]),
                now
            ),
            Ok(Action::Populate(vec![(AT + (4 << 20), EXTENT)]))
        );
        assert_eq!(reg.stats().open, 2);
        assert_eq!(
            reg.report(&report(Kind::Close, 1, Intent::Discard, &ext), now),
            Ok(Action::Drop(ext.to_vec()))
        );
        assert_eq!(reg.closed_discarded().collect::<Vec<_>>(), ext.to_vec());
        assert_eq!(
            reg.report(
                &report(Kind::Close, 2, Intent::Survive, &[(AT + (4 << 20), EXTENT)]),
                now
            ),
            Ok(Action::Survive(vec![(AT + (4 << 20), EXTENT)]))
        );
        // Closed twice: refused.
        let again = reg.report(&report(Kind::Close, 1, Intent::Discard, &ext), now);
        assert_eq!(again.unwrap_err().errno, libc::EALREADY);
        assert_eq!(
            reg.report(&report(Kind::Free, 1, Intent::Discard, &ext), now),
            Ok(Action::Free(ext.to_vec()))
        );
        assert_eq!(reg.closed_discarded().count(), 0);
        // Its id and extents can be used again.
        assert_eq!(
            reg.report(&report(Kind::Open, 1, Intent::Survive, &ext), now),
            Ok(Action::Populate(ext.to_vec()))
        );
        let stats = reg.stats();
        assert_eq!(
            (stats.reports, stats.refused, stats.open, stats.closed),
            (7, 1, 1, 1)
        );
    }

    #[test]
    fn hostile_reports_are_refused_and_change_nothing() {
        let mut reg = Registry::new(RAM);
        let now = Instant::now();
        let ext = [(AT, EXTENT)];
        reg.report(&report(Kind::Open, 1, Intent::Discard, &ext), now)
            .unwrap();
        let mut bad_magic = report(Kind::Open, 2, Intent::Discard, &[(AT + EXTENT, EXTENT)]);
        bad_magic.magic ^= 1;
        let mut bad_version = bad_magic;
        bad_version.magic = MAGIC;
        bad_version.version = 2;
        let mut bad_intent = report(Kind::Open, 2, Intent::Discard, &[(AT + EXTENT, EXTENT)]);
        bad_intent.intent = 7;
        let mut bad_kind = bad_intent;
        bad_kind.intent = 2;
        bad_kind.kind = 9;
        let mut too_many = bad_kind;
        too_many.kind = 1;
        too_many.count = MAX_EXTENTS as u64 + 1;
        let mut none = too_many;
        none.count = 0;
        let cases = [
            (bad_magic, libc::EINVAL),
            (bad_version, libc::EPROTONOSUPPORT),
            (bad_intent, libc::EINVAL),
            (bad_kind, libc::EINVAL),
            (too_many, libc::EINVAL),
            (none, libc::EINVAL),
            // The guest's own pages, past RAM, wrapping around, unaligned, empty.
            (
                report(Kind::Open, 2, Intent::Discard, &[(0, EXTENT)]),
                libc::EINVAL,
            ),
            (
                report(
                    Kind::Open,
                    2,
                    Intent::Discard,
                    &[(RAM - EXTENT, 2 * EXTENT)],
                ),
                libc::EINVAL,
            ),
            (
                report(
                    Kind::Open,
                    2,
                    Intent::Discard,
                    &[(u64::MAX - EXTENT + 1, EXTENT)],
                ),
                libc::EINVAL,
            ),
            (
                report(Kind::Open, 2, Intent::Discard, &[(AT + 4096, EXTENT)]),
                libc::EINVAL,
            ),
            (
                report(Kind::Open, 2, Intent::Discard, &[(AT + EXTENT, 0)]),
                libc::EINVAL,
            ),
            // Overlapping itself or another arena; the same id twice.
            (
                report(
                    Kind::Open,
                    2,
                    Intent::Discard,
                    &[(AT + EXTENT, 2 * EXTENT), (AT + 2 * EXTENT, EXTENT)],
                ),
                libc::EINVAL,
            ),
            (
                report(Kind::Open, 2, Intent::Discard, &[(AT - EXTENT, 2 * EXTENT)]),
                libc::EBUSY,
            ),
            (
                report(Kind::Open, 1, Intent::Discard, &[(AT + EXTENT, EXTENT)]),
                libc::EEXIST,
            ),
            // Closing what is not open, or with other extents or another intent than its open.
            (report(Kind::Close, 5, Intent::Discard, &ext), libc::ENOENT),
            (
                report(Kind::Close, 1, Intent::Discard, &[(AT + EXTENT, EXTENT)]),
                libc::EINVAL,
            ),
            (report(Kind::Close, 1, Intent::Survive, &ext), libc::EINVAL),
            (
                report(Kind::Free, 1, Intent::Discard, &[(AT, 2 * EXTENT)]),
                libc::EINVAL,
            ),
        ];
        for (i, (bad, errno)) in cases.iter().enumerate() {
            let refused = reg.report(bad, now).expect_err(&format!("case {i}"));
            assert_eq!(refused.errno, *errno, "case {i}: {}", refused.reason);
        }
        let stats = reg.stats();
        assert_eq!(stats.refused, cases.len() as u64);
        assert_eq!((stats.open, stats.closed), (1, 0));
        // The one arena is as it was.
        assert_eq!(
            reg.report(&report(Kind::Close, 1, Intent::Discard, &ext), now),
            Ok(Action::Drop(ext.to_vec()))
        );
    }

    #[test]
    fn a_flood_of_reports_is_refused_past_the_rate_and_the_rate_comes_back() {
        let mut reg = Registry::new(RAM);
        let now = Instant::now();
        let junk = Report::default();
        for _ in 0..256 {
            assert_eq!(reg.report(&junk, now).unwrap_err().errno, libc::EINVAL);
        }
        let flood = reg.report(&junk, now).unwrap_err();
        assert_eq!(flood.errno, libc::EBUSY);
        assert_eq!(reg.stats().refused_flood, 1);
        // A good report past the flood is refused too, until time passes.
        let ext = [(AT, EXTENT)];
        let open = report(Kind::Open, 1, Intent::Discard, &ext);
        assert_eq!(reg.report(&open, now).unwrap_err().errno, libc::EBUSY);
        let later = now + std::time::Duration::from_millis(10);
        assert_eq!(reg.report(&open, later), Ok(Action::Populate(ext.to_vec())));
    }

    #[test]
    fn a_report_is_read_only_from_a_32_bit_page_number_inside_ram() {
        assert_eq!(report_gpa(Some(0xA), RAM), Ok(0xA000));
        assert_eq!(
            report_gpa(Some((RAM >> 12) as u32 - 1), RAM),
            Ok(RAM - 4096)
        );
        for bad in [None, Some((RAM >> 12) as u32), Some(u32::MAX)] {
            assert!(report_gpa(bad, RAM).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_report_is_laid_out_as_the_guest_writes_it() {
        assert_eq!(std::mem::size_of::<Report>(), 40 + 16 * MAX_EXTENTS);
        assert_eq!(std::mem::offset_of!(Report, id), 8);
        assert_eq!(std::mem::offset_of!(Report, status), 32);
        assert_eq!(std::mem::offset_of!(Report, extents), 40);
    }
}
