//! The vCPU loop of a command and the port-I/O devices it serves on the way: the block
//! device over the disk file and the guest's free-page reports; the governor's preemption
//! between two `KVM_RUN`s.

use std::os::unix::fs::FileExt;

use kvm_ioctls::VcpuExit;
use vm_memory::{Bytes, GuestAddress};

use super::{Machine, MachineError};
use crate::arena;
use crate::governor::client::Order;
use crate::governor::protocol::WireState;
use crate::guest::{self, BlkRequest, BlockIo, Mailbox, Refused};

/// A disk request goes through the bounce buffer this many bytes at a time. The buffer lives
/// as long as the VM and holds guest data: sized for a whole request (1 MiB), it was the
/// largest piece of an offloaded VM's own memory (4.6-4.8 MiB in all; at 24 VMs under a
/// 512 MiB budget, 24 MiB of it).
const DISK_CHUNK: usize = 64 << 10;

/// `(offset, length)` of each [`DISK_CHUNK`] of a request of `len` bytes.
fn chunks(len: usize) -> impl Iterator<Item = (u64, usize)> {
    (0..len)
        .step_by(DISK_CHUNK)
        .map(move |at| (at as u64, DISK_CHUNK.min(len - at)))
}

/// The first `n` bytes of the bounce buffer (grown to [`DISK_CHUNK`] once).
fn bounce(buf: &mut Vec<u8>, n: usize) -> &mut [u8] {
    if buf.len() < n {
        buf.resize(DISK_CHUNK.max(n), 0);
    }
    &mut buf[..n]
}

impl Machine {
    /// Runs the vCPU until the guest writes `PORT_DONE`; meanwhile the memory governor may
    /// preempt it (see [`Machine::preempted`]).
    pub(super) fn run_until_done(&mut self) -> Result<(), MachineError> {
        if let Some(link) = &self.governor {
            let interrupter = self.interrupter.clone();
            link.set_preempter(Some(std::sync::Arc::new(move || interrupter.kick())));
        }
        let ran = self.run_vcpu_until_done();
        if let Some(link) = &self.governor {
            link.set_preempter(None);
        }
        ran
    }

    /// The governor kicked the vCPU out to take its RAM: a VM held at a fault in its command
    /// cannot reach a wait where its RAM could go, and when every VM is so held nothing else
    /// frees room (the deadlock of docs/governor.md). Offloaded here, between two `KVM_RUN`s
    /// of the vCPU thread, the guest re-enters where it was; the faults that follow ask for
    /// room again, behind the older VMs. A VM without wait management has no store: it
    /// refuses.
    fn preempted(&mut self) {
        if self.governor.is_none() {
            return;
        }
        // Freed arena memory goes before anything is offloaded.
        self.drop_freed_arenas();
        let Some(link) = &self.governor else {
            return;
        };
        while let Some(Order::Offload { .. }) = link.take_order() {
            let ok = self.idle_offload().is_some_and(|r| r.is_ok());
            link.offloaded(ok, self.resident_bytes());
            // Still in its command.
            link.report(WireState::Running, None);
        }
    }

    fn run_vcpu_until_done(&mut self) -> Result<(), MachineError> {
        let interrupter = self.interrupter.clone();
        // SAFETY: `self.vcpu` outlives the guard, a local of this frame (`&mut self`).
        let vcpu_thread = unsafe { interrupter.enter(&mut self.vcpu) };
        loop {
            let exit = match vcpu_thread.run(&mut self.vcpu)? {
                None => {
                    self.preempted();
                    continue;
                }
                Some(VcpuExit::IoOut(port, data)) => {
                    // The ports that take a value take 32 bits (a page number).
                    Ok((port, <[u8; 4]>::try_from(data).ok().map(u32::from_le_bytes)))
                }
                // No port answers reads: an `in` reads all ones, as from an empty bus.
                Some(VcpuExit::IoIn(_, data)) => {
                    data.fill(0xFF);
                    continue;
                }
                Some(exit) => Err(format!("{exit:?}")),
            };
            let (port, value) = match exit {
                Ok(out) => out,
                Err(exit) => {
                    let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
                    return Err(MachineError::GuestCrashed(format!(
                        "{exit} at rip {rip:#x}"
                    )));
                }
            };
            self.drop_freed_arenas_due();
            match port {
                guest::PORT_DONE => return Ok(()),
                guest::PORT_BLK => self.block_request()?,
                guest::PORT_FREE => self.free_report()?,
                guest::PORT_MODEL => {
                    // The guest waits for the model: freed memory goes now.
                    self.drop_freed_arenas();
                    self.model_request()?;
                }
                arena::PORT_ARENA => self.arena_report(value)?,
                crate::net::PORT_NET => {
                    // The guest waits for its download: freed memory goes now.
                    self.drop_freed_arenas();
                    self.net_request(value)?;
                }
                // Writes to a port nothing listens on go nowhere, as on real hardware.
                _ => {}
            }
        }
    }

    /// Serves the block request in the mailbox's neighbour page, [`DISK_CHUNK`] bytes at a
    /// time through one bounce buffer. Every field is the guest's:
    /// a request that is not whole sectors of at most one I/O buffer, inside the disk's bounds
    /// and with its buffer inside RAM gets an errno back ([`guest::check_block`]); so does a
    /// disk error.
    fn block_request(&mut self) -> Result<(), MachineError> {
        let mut request: BlkRequest = self.read(guest::BLK_GPA)?;
        let result: std::io::Result<()> = match guest::check_block(&request, self.ram.size()) {
            Err(Refused { errno, .. }) => Err(std::io::Error::from_raw_os_error(errno)),
            Ok(BlockIo::Write { offset, len, buf }) => chunks(len).try_for_each(|(at, n)| {
                let chunk = bounce(&mut self.io_buf, n);
                self.ram
                    .memory()
                    .read_slice(chunk, GuestAddress(buf + at))
                    .map_err(|_| std::io::Error::from_raw_os_error(libc::EFAULT))?;
                self.disk.write_all_at(chunk, offset + at)
            }),
            Ok(BlockIo::Read { offset, len, buf }) => chunks(len).try_for_each(|(at, n)| {
                let chunk = bounce(&mut self.io_buf, n);
                self.disk.read_exact_at(chunk, offset + at)?;
                self.ram
                    .memory()
                    .write_slice(chunk, GuestAddress(buf + at))
                    .map_err(|_| std::io::Error::from_raw_os_error(libc::EFAULT))
            }),
            Ok(BlockIo::Flush) => self.disk.sync_data(),
        };
        // The guest sees the failure as an errno (EIO for a read past the disk's end).
        request.status = match result {
            Ok(()) => 0,
            Err(e) => u64::try_from(e.raw_os_error().unwrap_or(libc::EIO)).unwrap_or(5),
        };
        self.write(guest::BLK_GPA, request)
    }

    /// Drops the range the guest reported free (it reads as zeros afterwards), or tells the
    /// guest why not in the report's status: only whole pages of the application data are
    /// dropped ([`guest::check_free`]).
    fn free_report(&mut self) -> Result<(), MachineError> {
        let mailbox: Mailbox = self.read(guest::MAILBOX_GPA)?;
        let status = match self.drop_free(mailbox.free_gpa, mailbox.free_len) {
            Ok(()) => 0,
            Err(Refused { errno, reason }) => {
                self.release_error = Some(reason);
                u64::try_from(errno).unwrap_or(5)
            }
        };
        let field = guest::MAILBOX_GPA + std::mem::offset_of!(Mailbox, free_status) as u64;
        self.write(field, status)
    }

    /// Drops the free range `gpa..gpa + len` the guest reported (only whole pages of the
    /// application data; huge pages whole), telling the pager first.
    pub(super) fn drop_free(&mut self, gpa: u64, len: u64) -> Result<(), Refused> {
        guest::check_free(gpa, len, self.ram.size())?;
        let range = self.ram.host_range(gpa, len).ok_or_else(|| Refused {
            errno: libc::EINVAL,
            reason: format!("free report of {len} bytes at {gpa:#x} is outside RAM"),
        })?;
        let fail = |source: std::io::Error| Refused {
            errno: source.raw_os_error().unwrap_or(libc::EIO),
            reason: basics::error_chain(&MachineError::Release { gpa, len, source }),
        };
        // Huge pages go whole: a report that covers part of one leaves that one be.
        let Some(range) = uffd_pager::discard::inward(range, self.ram.kind().page_size()) else {
            return Ok(());
        };
        // The pager learns of the discard first, so that nothing it installs meanwhile
        // survives it: the pages read as zeros from now on (snapshot RAM: its private copies
        // go, and the range reads as the snapshot's bytes again; free memory has no contents
        // the guest relies on).
        self.pager.discarded(range);
        let offset = range.start().0 - self.ram.host_base().0;
        let memfd = self.ram.memfd().map(|file| (&**file, offset));
        // SAFETY: whole pages of our own guest RAM (checked inside it), which the guest freed.
        unsafe { uffd_pager::discard::discard(self.ram.kind(), range, memfd) }.map_err(fail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_requests_go_in_chunks_that_cover_them_through_a_bounded_buffer() {
        assert_eq!(chunks(0).count(), 0);
        assert_eq!(chunks(512).collect::<Vec<_>>(), vec![(0, 512)]);
        assert_eq!(
            chunks(DISK_CHUNK + 512).collect::<Vec<_>>(),
            vec![(0, DISK_CHUNK), (DISK_CHUNK as u64, 512)]
        );
        let whole: Vec<_> = chunks(guest::MAX_BLK_LEN as usize).collect();
        assert_eq!(whole.len(), guest::MAX_BLK_LEN as usize / DISK_CHUNK);
        assert!(whole
            .windows(2)
            .all(|w| w[0].0 + w[0].1 as u64 == w[1].0 && w[0].1 == DISK_CHUNK));
        let mut buf = Vec::new();
        assert_eq!(bounce(&mut buf, 512).len(), 512);
        assert_eq!(bounce(&mut buf, DISK_CHUNK).len(), DISK_CHUNK);
        assert_eq!(buf.len(), DISK_CHUNK);
    }
}
