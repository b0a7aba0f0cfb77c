//! Reclaim: which VM gives memory back when the budget binds, in the order of the module's
//! documentation (limits held unused, then waiting VMs by their expected remaining wait, idle
//! VMs, running VMs' cold RAM, and preemption last), and revoking grants for elder VMs.

use std::time::{Duration, Instant};

use super::config::fraction_of;
use super::{seniority, Decision, Governor, Order, OrderKind, Reason, Victim, Vm, VmId, VmState};

impl Governor {
    /// Orders victims until usage, less what outstanding orders are expected to free, is at
    /// or under the target.
    pub(super) fn reclaim(&mut self, now: Instant, reason: Reason, out: &mut Vec<Decision>) {
        let target = self.target();
        self.revoke_for_elders(now, out);
        loop {
            let mut usage = self.usage();
            if self.under_pressure {
                usage = usage.max(self.config.high_bytes().saturating_add(1));
            }
            if usage.saturating_sub(self.outstanding()) <= target {
                return;
            }
            let Some(victim) = self.next_victim(now) else {
                return;
            };
            let (decision, order) = match victim {
                Victim::Revoke(vm) => {
                    let limit = self.vms.get(&vm).map_or(0, |v| v.reading.resident);
                    (
                        Decision::SetLimit {
                            vm,
                            limit,
                            reason: Reason::Revoke,
                        },
                        None,
                    )
                }
                Victim::Order(vm, OrderKind::Offload, free) => {
                    let running = self
                        .vms
                        .get(&vm)
                        .is_some_and(|v| v.state == VmState::Running);
                    let reason = if running { Reason::Preempt } else { reason };
                    (
                        Decision::Offload { vm, reason },
                        Some((OrderKind::Offload, free)),
                    )
                }
                Victim::Order(vm, OrderKind::ColdCompress, free) => (
                    Decision::ColdCompress {
                        vm,
                        age: self.config.pressure_cold_age,
                        reason,
                    },
                    Some((OrderKind::ColdCompress, free)),
                ),
            };
            if let (Some((kind, expect_free)), Some(v)) = (order, self.vms.get_mut(&decision.vm()))
            {
                v.order = Some(Order {
                    kind,
                    at: now,
                    expect_free,
                    timed_out: false,
                });
                if kind == OrderKind::ColdCompress {
                    v.cold_at = Some(now);
                }
            }
            self.decide(now, out, decision);
        }
    }

    /// Seniority: when the queue's head does not fit, the unused room of every junior VM
    /// (its limit above its resident, whatever it is doing) is taken back first. Limits
    /// handed out at join are reservations a VM may never use: left with the young, they
    /// keep the old VM from finishing its step, and every VM ends held a little short of its
    /// need (measured: 5 VMs admitted with 64 MiB each, all held at 64 of the 66 MiB their
    /// step needed). Lowering a limit to what is resident frees room at once and costs the
    /// younger VM only an earlier hold.
    pub(super) fn revoke_for_elders(&mut self, now: Instant, out: &mut Vec<Decision>) {
        let Some(head) = self.queue.front().copied() else {
            return;
        };
        let Some(v) = self.vms.get(&head.vm) else {
            return;
        };
        if self.fits(self.need(&head, v), self.config.high_bytes()) {
            return;
        }
        let head_key = seniority(&self.vms, head.vm);
        let mut younger: Vec<(VmId, u64)> = self
            .vms
            .iter()
            .filter(|&(&id, v)| {
                seniority(&self.vms, id) > head_key
                    && v.reachable
                    && v.limit.is_some_and(|l| l > v.reading.resident)
            })
            .map(|(&id, v)| (id, v.reading.resident))
            .collect();
        younger.sort_by_key(|&(id, _)| seniority(&self.vms, id));
        for (vm, resident) in younger.into_iter().rev() {
            self.decide(
                now,
                out,
                Decision::SetLimit {
                    vm,
                    limit: resident,
                    reason: Reason::Revoke,
                },
            );
            let v = self.vms.get(&head.vm).expect("the head's VM is there");
            if self.fits(self.need(&head, v), self.config.high_bytes()) {
                return;
            }
        }
    }

    /// Marks silent VMs unreachable (dropping their queued requests) and orders past their
    /// timeout as timed out.
    pub(super) fn sweep(&mut self, now: Instant) {
        let mut dropped = Vec::new();
        for (&id, v) in &mut self.vms {
            if v.reachable && now.saturating_duration_since(v.last_heard) >= self.config.stale_after
            {
                v.reachable = false;
                self.events.unreachable += 1;
                dropped.push(id);
            }
            if let Some(order) = v.order.as_mut() {
                if !order.timed_out
                    && now.saturating_duration_since(order.at) >= self.config.order_timeout
                {
                    order.timed_out = true;
                    self.events.orders_timed_out += 1;
                }
            }
        }
        for id in dropped {
            self.drop_request(id);
        }
    }

    /// Drops `vm`'s queued request, counted: a silent VM's, or one queued before its VM was
    /// offloaded. Left queued, a stale one kept its VM out of every reclaim (a VM that asks
    /// is never a victim) and, its own reservation charged, from fitting: at the queue's head
    /// nobody was granted again (two sandboxes, one offloaded while idle with 112 MiB
    /// reserved: the other held for minutes).
    pub(super) fn drop_request(&mut self, vm: VmId) {
        let before = self.queue.len();
        self.queue.retain(|q| q.vm != vm);
        self.events.requests_dropped += (before - self.queue.len()) as u64;
    }

    /// The next victim in the order of the module doc, if any.
    pub(super) fn next_victim(&self, now: Instant) -> Option<Victim> {
        let c = &self.config;
        // Only a VM younger than the queue's head may be preempted: seniority, as for grants.
        let head = self.queue.front().map(|q| seniority(&self.vms, q.vm));
        // And only when nothing else will free room soon: no VM runs unheld (its step ends
        // in a wait where its RAM goes), or the head has waited `preempt_wait` already.
        let preempt = self.queue.front().is_some_and(|q| {
            now.saturating_duration_since(q.since) >= c.preempt_wait
                || !self.vms.iter().any(|(&id, v)| self.progressing(id, v))
        });
        let eligible = self
            .vms
            .iter()
            .filter(|(_, v)| v.reachable && v.order.is_none());
        let failed = |v: &Vm, kind: OrderKind| {
            v.failed_at[kind as usize]
                .is_some_and(|at| now.saturating_duration_since(at) < c.order_timeout)
        };
        // (tier, key, id, victim): the lowest tier first, the largest key within it.
        let candidate = |id: VmId, v: &Vm| -> Option<(u8, (Duration, u64), Victim)> {
            let resident = v.reading.resident;
            let reserved = v.limit.map_or(0, |l| l.saturating_sub(resident));
            let offload_free = v.charged_ram().saturating_sub(c.offload_remainder);
            let order = |kind, free| Victim::Order(id, kind, free);
            let asking = v.reading.held > 0 || self.queue.iter().any(|q| q.vm == id);
            if asking {
                // (5) Preempt: a VM held at its faults cannot reach a wait where its RAM
                // could go; when every other tier is empty, the youngest one younger than
                // the head is stopped in its command and offloaded, and re-enters it asking
                // for room behind its elders.
                let junior = self
                    .base
                    .map_or(Duration::ZERO, |b| v.since.saturating_duration_since(b));
                return (preempt
                    && v.state == VmState::Running
                    && head.is_some_and(|h| seniority(&self.vms, id) > h)
                    && resident > c.offload_remainder
                    && !failed(v, OrderKind::Offload))
                .then_some((
                    4,
                    (junior, id),
                    Victim::Order(id, OrderKind::Offload, offload_free),
                ));
            }
            match v.state {
                VmState::Offloaded if reserved > 0 => {
                    Some((0, (Duration::ZERO, reserved), Victim::Revoke(id)))
                }
                // Not an idle VM's: between commands it is about to run the next one, and
                // taking its room to admit a younger VM leaves both part-way (measured).
                VmState::Waiting { .. } if reserved > c.revoke_slack => {
                    Some((0, (Duration::ZERO, reserved), Victim::Revoke(id)))
                }
                VmState::Waiting { expected_remaining }
                    if offload_free > 0 && !failed(v, OrderKind::Offload) =>
                {
                    Some((
                        1,
                        (expected_remaining.unwrap_or(c.unknown_wait), resident),
                        order(OrderKind::Offload, offload_free),
                    ))
                }
                VmState::Idle if offload_free > 0 && !failed(v, OrderKind::Offload) => Some((
                    2,
                    (Duration::ZERO, resident),
                    order(OrderKind::Offload, offload_free),
                )),
                VmState::Running
                    if resident > 0
                        && !v.cold_unable
                        && v.cold_at.is_none_or(|at| {
                            now.saturating_duration_since(at) >= c.pressure_cold_age
                        }) =>
                {
                    let free = fraction_of(resident, c.cold_expect_fraction);
                    Some((
                        3,
                        (Duration::ZERO, resident),
                        order(OrderKind::ColdCompress, free),
                    ))
                }
                _ => None,
            }
        };
        eligible
            .filter_map(|(&id, v)| {
                candidate(id, v).map(|(tier, key, victim)| (tier, key, id, victim))
            })
            .min_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)))
            .map(|(_, _, _, victim)| victim)
    }

    /// The VM's run goes on without the governor: it runs (or its held faults were
    /// granted) and it asks for nothing, so its step will end in a wait or a request.
    pub(super) fn progressing(&self, id: VmId, v: &Vm) -> bool {
        let r = v.reading;
        v.reachable
            && v.order.is_none()
            && (v.state == VmState::Running || r.held > 0)
            && v.limit
                .is_none_or(|l| l >= r.resident.saturating_add(r.held))
            && !self.queue.iter().any(|q| q.vm == id)
    }
}
