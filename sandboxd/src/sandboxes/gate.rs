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
    /// than its need and overhead; and how many run.
    fn extra(&self, holdings: &Holdings) -> (u64, usize) {
        let running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        let extra = running
            .values()
            .map(|(id, need)| {
                let (held, overhead) = holdings.get(id).copied().unwrap_or((0, 0));
                need.saturating_add(overhead).saturating_sub(held)
            })
            .fold(0u64, u64::saturating_add);
        (extra, running.len())
    }

    /// Waits for room for `need` bytes of sandbox `id` (at most `bound`; alone, it never
    /// waits: a command that needs more than the budget still runs, under the governor),
    /// reading the budget and the VMs' holdings with `read`. Returns its admission and
    /// whether it waited.
    pub(super) async fn admit(
        self: &Arc<Self>,
        id: &str,
        need: u64,
        bound: Duration,
        read: impl Fn() -> (Room, Holdings),
    ) -> (Admitted, bool) {
        let _turn = self.turn.lock().await;
        let asked = Instant::now();
        let mut waited = false;
        loop {
            let (room, holdings) = read();
            let (extra, running) = self.extra(&holdings);
            if running == 0 || fits(&room, extra, need) || asked.elapsed() >= bound {
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
        assert!(!waited);
        // The next one waits while the first is still to bring its 600 back...
        let gate2 = Arc::clone(&gate);
        let second =
            tokio::spawn(async move { gate2.admit("b", 100, Duration::from_secs(60), read).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!second.is_finished());
        // ...and goes once the first is over.
        drop(first);
        let (_second, waited) = second.await.unwrap();
        assert!(waited);
        // A bound ends the wait.
        let (_third, waited) = gate.admit("c", 900, Duration::from_millis(50), read).await;
        assert!(waited);
    }
}
