//! Commands admitted by memory: a command of a sandbox the daemon offloaded while idle waits,
//! first come first served, until the working set it will bring back fits under the
//! governor's high watermark beside what the commands already admitted are still bringing
//! back. Without it, a slower host lets more commands run at once than the budget holds: the
//! governor then trims the younger runners' fresh grants for the elder ones, they come back
//! for 64 KiB at a time, and every command slows further (a collapse measured on 2026-12-07:
//! first output p50 6.7 s where it had been 189 ms). Admitted, a command runs at full speed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::governed::Room;

/// How often the first waiter looks at the budget again.
const POLL: Duration = Duration::from_millis(20);

/// The commands admitted and running.
#[derive(Debug, Default)]
pub(super) struct Gate {
    /// Held by the first waiter while it waits: the others queue behind it in order.
    turn: tokio::sync::Mutex<()>,
    /// Each admitted command's sandbox and the bytes it was admitted to bring back.
    running: Mutex<HashMap<u64, (String, u64)>>,
    next: AtomicU64,
}

/// A command's admission, given back when it is dropped (at the command's end).
#[derive(Debug)]
pub struct Admitted {
    gate: Arc<Gate>,
    key: u64,
    /// What it will bring back fitted (or its sandbox had a command admitted already); not
    /// when it was let in alone or at the end of its wait without room.
    pub room: bool,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.gate
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.key);
    }
}

/// Whether `need` more fits: what the VMs hold and cannot give back now, with each admitted
/// command's VM counted at no less than it was admitted for (`extra`: what that adds to the
/// readings, which may not have seen its memory come back yet), plus `need`, at or under the
/// high watermark.
pub(super) fn fits(room: &Room, extra: u64, need: u64) -> bool {
    room.held(0, 0).saturating_add(extra).saturating_add(need) <= room.high
}

/// What each VM holds and cannot give back now, and its overhead, by name.
pub(super) type Holdings = HashMap<String, (u64, u64)>;

impl Gate {
    /// What the admitted commands add to the readings: each one's VM counted at no less
    /// than its need and overhead, once however many of its commands are admitted (they
    /// bring the same memory back); and how many run.
    fn extra(&self, holdings: &Holdings) -> (u64, usize) {
        let running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        let mut needs: HashMap<&str, u64> = HashMap::new();
        for (id, need) in running.values() {
            let most = needs.entry(id).or_default();
            *most = (*most).max(*need);
        }
        let extra = needs
            .iter()
            .map(|(id, need)| {
                let (held, overhead) = holdings.get(*id).copied().unwrap_or((0, 0));
                need.saturating_add(overhead).saturating_sub(held)
            })
            .fold(0u64, u64::saturating_add);
        (extra, running.len())
    }

    /// Whether a command of sandbox `id` is admitted and running: another one of it needs
    /// no room of its own.
    fn admitted(&self, id: &str) -> bool {
        let running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        running.values().any(|(admitted, _)| admitted == id)
    }

    /// Waits for room for `need` bytes of sandbox `id` (at most `bound`; alone, it never
    /// waits: a command that needs more than the budget still runs, under the governor; nor
    /// does a second command of a sandbox with one admitted already, arriving while the
    /// first brings the memory back), reading the budget and the VMs' holdings with `read`.
    /// Returns its admission and whether it waited.
    pub(super) async fn admit(
        self: &Arc<Self>,
        id: &str,
        need: u64,
        bound: Duration,
        read: impl Fn() -> (Room, Holdings),
    ) -> (Admitted, bool) {
        let turn = if self.admitted(id) {
            None
        } else {
            Some(self.turn.lock().await)
        };
        let asked = Instant::now();
        let mut waited = false;
        let mut fitted = true;
        // Admitted meanwhile (a command of the same sandbox was ahead in the queue): the room
        // it was given serves this one too.
        while turn.is_some() && !self.admitted(id) {
            let (room, holdings) = read();
            let (extra, running) = self.extra(&holdings);
            fitted = fits(&room, extra, need);
            if running == 0 || fitted || asked.elapsed() >= bound {
                break;
            }
            waited = true;
            tokio::time::sleep(POLL).await;
        }
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        self.running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, (id.to_owned(), need));
        (
            Admitted {
                gate: Arc::clone(self),
                key,
                room: fitted,
            },
            waited,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room(usage: u64, reclaimable: u64) -> Room {
        Room {
            budget: 1000,
            high: 900,
            usage,
            reclaimable,
            vms: 10,
            joined: Default::default(),
        }
    }

    #[test]
    fn a_command_fits_beside_what_is_held_and_still_coming_back() {
        // Held 500 (600 charged, 100 of it idle and reclaimable); 300 more for an admitted one.
        assert!(fits(&room(600, 100), 300, 100));
        assert!(!fits(&room(600, 100), 300, 101));
        // What idle VMs hold does not keep a command out: the governor takes it back.
        assert!(fits(&room(900, 400), 0, 400));
    }

    #[tokio::test]
    async fn commands_wait_in_order_until_the_first_is_done() {
        let gate = Arc::new(Gate::default());
        let read = || (room(500, 0), HashMap::new());
        // Alone, a command never waits, even one larger than the room.
        let (first, waited) = gate.admit("a", 600, Duration::from_secs(60), read).await;
        assert!(!waited && !first.room);
        // The next one waits while the first is still to bring its 600 back...
        let gate2 = Arc::clone(&gate);
        let second =
            tokio::spawn(async move { gate2.admit("b", 100, Duration::from_secs(60), read).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!second.is_finished());
        // ...and goes once the first is over.
        drop(first);
        let (second, waited) = second.await.unwrap();
        assert!(waited && second.room);
        // A bound ends the wait, without room.
        let (third, waited) = gate.admit("c", 900, Duration::from_millis(50), read).await;
        assert!(waited && !third.room);
    }

    #[tokio::test]
    async fn a_sandbox_with_two_commands_admitted_is_counted_once() {
        let gate = Arc::new(Gate::default());
        // 100 held; the high watermark is 900.
        let read = || (room(100, 0), HashMap::new());
        let (_a1, _) = gate.admit("a", 400, Duration::from_secs(60), read).await;
        // A second command of `a`, while its first brings 400 back, waits for nothing, even
        // with the queue held by another sandbox's waiter...
        let queued = gate.turn.lock().await;
        let (a2, waited) = gate.admit("a", 400, Duration::from_secs(60), read).await;
        assert!(!waited && a2.room);
        drop(queued);
        // ...and `a` counts 400, not 800: 300 more for `b` fit (100 + 400 + 300 <= 900).
        assert_eq!(gate.extra(&HashMap::new()), (400, 2));
        let (_b, waited) = gate.admit("b", 300, Duration::from_millis(200), read).await;
        assert!(!waited);
    }
}
