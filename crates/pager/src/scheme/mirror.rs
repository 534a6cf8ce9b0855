//! Whole copies (`none`: one, `mirror:N`: N on N different servers; Reliable Nswap §IV-A,
//! paper 004): where copies go, what a failed copy or a bad one does, and recovery, which reads
//! a surviving copy and writes the missing ones (§IV-B3).

use crate::requests::{GetItem, PutItem, PutKind, INTERNAL};
use crate::scheme::RecoveryStep;
use crate::table::Servers;
use crate::writeback::Writeback;
use crate::{Disk, Op, Pager, PagerError, Transport};
use netram_policy::placement::{self, Candidate};
use netram_proto::Request;

impl<T: Transport, D: Disk> Pager<T, D> {
    /// Sends the copies a page in write-back still lacks, each to a live server that holds no
    /// other copy of it: its current holders first (an overwrite stays in place), then by
    /// placement. Settles the write-back when nothing is left in flight.
    pub(crate) fn place_copies(&mut self, page: u64) -> Result<(), PagerError> {
        let mut wb = *self.writeback.get(&page).expect("page in write-back");
        let busy = |wb: &Writeback, s: usize| {
            wb.done.contains(s)
                || wb.pending.contains(s)
                || wb.refused.contains(s)
                || wb.keep.contains(s)
        };
        let need = self
            .scheme
            .copies()
            .saturating_sub(wb.done.len() + wb.pending.len() + wb.keep.len());
        let mut full = Vec::new();
        for _ in 0..need {
            let holder = self
                .table
                .holders(page)
                .iter()
                .find(|&s| self.servers[s].alive && !busy(&wb, s));
            let target = holder.or_else(|| {
                let candidates: Vec<Candidate> = self.servers.iter().map(|s| s.load).collect();
                let exclude: Vec<usize> =
                    (0..self.servers.len()).filter(|&s| busy(&wb, s)).collect();
                placement::choose(&candidates, &exclude, &mut self.rng)
            });
            let Some(server) = target else { break };
            wb.pending.insert(server);
            self.counters.puts += 1;
            let key = self.key(page);
            let it = PutItem {
                page,
                slot: wb.slot,
                version: wb.version,
                key,
                kind: PutKind::Copy,
            };
            if self.queue_put(server, it) {
                full.push(server);
            }
        }
        // Recorded before anything is sent: sending may wait for credits and complete PUTs of
        // this very page.
        self.writeback.insert(page, wb);
        if wb.pending.is_empty() {
            return self.finish_writeback(page);
        }
        for server in full {
            self.pump_paced(server);
        }
        Ok(())
    }

    /// A server acknowledged a copy: the write-back is settled once every copy is.
    pub(crate) fn copy_stored(&mut self, it: PutItem, server: usize) -> Result<(), PagerError> {
        debug_assert_eq!(self.table.get(it.page).version, it.version);
        if let Some(wb) = self.writeback.get_mut(&it.page) {
            wb.pending.remove(server);
            wb.done.insert(server);
            if wb.pending.is_empty() {
                return self.finish_writeback(it.page);
            }
        }
        Ok(())
    }

    /// A GET that got no good copy from `server`: a bad copy is dropped (and deleted there) for
    /// recovery to rebuild, and the page is read from another copy or the disk.
    pub(crate) fn copy_get_failed(
        &mut self,
        server: usize,
        it: GetItem,
        what: Option<&'static str>,
    ) {
        let mut holders = self.table.holders(it.page);
        if let Some(what) = what {
            if holders.len() > 1 && holders.contains(server) {
                tracing::warn!(server, page = it.page, what, "dropping a bad copy");
                self.counters.copies_dropped_bad += 1;
                holders.remove(server);
                self.table.set_holders(it.page, holders);
                self.degraded.insert(it.page);
                if what != "missing on server" && self.servers[server].alive {
                    self.counters.deletes += 1;
                    self.submit(
                        server,
                        Op::Delete,
                        &Request::Delete(vec![self.key(it.page)]),
                    );
                }
            }
        }
        self.read_elsewhere(server, it, what)
    }

    /// Every page with a copy on a dead server has one copy fewer: recovery's work.
    pub(crate) fn copies_server_dead(&mut self, server: usize) {
        if self.scheme.copies() > 1 {
            self.degraded.extend(self.table.pages_on(server));
        }
    }

    /// A server back from the dead is empty: its copies are gone. A page with another copy is
    /// degraded (recovery makes a new one); a page whose only copy it held is lost.
    pub(crate) fn copies_server_revived(&mut self, server: usize) {
        for page in self.table.pages_on(server) {
            let mut holders = self.table.holders(page);
            if holders.len() > 1 {
                holders.remove(server);
                self.table.set_holders(page, holders);
                self.degraded.insert(page);
            } else {
                self.table.get_mut(page).lost = true;
            }
        }
    }

    /// Rebuilds the missing copies of up to `max_pages` degraded pages: reads each from a
    /// surviving copy (pipelined), then writes the copies it lacks to servers that hold none.
    /// The writes are not waited for; a read of such a page meanwhile is served from memory.
    pub(crate) fn copies_recover(&mut self, max_pages: usize) -> Result<RecoveryStep, PagerError> {
        let mut step = RecoveryStep::default();
        // Each page holds a slot from its read to its last acknowledgement: stay well inside
        // the staging slots.
        let staging = self.free_slots.len() / 2;
        let mut batch: Vec<(u64, Servers)> = Vec::new();
        while batch.len() < max_pages.min(staging) {
            let Some(page) = self.degraded.pop_first() else {
                break;
            };
            let e = *self.table.get(page);
            if !e.present || e.lost || self.writeback.contains_key(&page) {
                // Discarded, lost, or being written: a write-back places every copy anew
                // and puts the page back on the list if it falls short.
                continue;
            }
            let holders = self.table.holders(page);
            let alive: Servers = holders.iter().filter(|&s| self.servers[s].alive).collect();
            if alive.len() >= self.scheme.copies() {
                if alive.len() < holders.len() {
                    self.table.set_holders(page, alive);
                }
                continue;
            }
            if alive.is_empty() && !e.on_disk {
                step.unrecoverable += 1;
                self.counters.pages_unrecoverable += 1;
                self.table.get_mut(page).lost = true;
                continue;
            }
            batch.push((page, alive));
        }
        // Read every page of the batch from a surviving copy (or the disk copy).
        for &(page, alive) in &batch {
            let slot = self.take_slot()?;
            let it = self.page_get_item(page, slot, INTERNAL);
            match alive.first() {
                Some(s) => self.submit_get_item(s, it),
                None => {
                    let at = slot as usize * netram_proto::PAGE_SIZE;
                    self.counters.disk_reads += 1;
                    self.disk
                        .read(page, &mut self.slots[at..at + netram_proto::PAGE_SIZE])?;
                    self.fetched.push((page, slot));
                }
            }
        }
        while !self.idle() || !self.retry.is_empty() || !self.reads_done.is_empty() {
            self.drain()?;
            self.resubmit_retries();
            self.copy_out_reads(&mut [])?;
        }
        let fetched = std::mem::take(&mut self.fetched);
        let got: Vec<u64> = fetched.iter().map(|&(p, _)| p).collect();
        for &(page, _) in &batch {
            if got.contains(&page) {
                continue;
            }
            if self.alive_holder(page, None).is_some() {
                // A read that failed on the way (a bad checksum in transit): try again later.
                self.degraded.insert(page);
            } else {
                // Every copy failed while being read: gone.
                step.unrecoverable += 1;
                self.counters.pages_unrecoverable += 1;
                self.table.get_mut(page).lost = true;
            }
        }
        for (page, slot) in fetched {
            let e = *self.table.get(page);
            let keep: Servers = self
                .table
                .holders(page)
                .iter()
                .filter(|&s| self.servers[s].alive)
                .collect();
            self.begin_writeback(
                page,
                Writeback {
                    keep,
                    rebuild: true,
                    revivals: self.counters.servers_revived,
                    ..Writeback::new(slot, e.version)
                },
            );
            step.started += 1;
            self.place_copies(page)?;
        }
        self.pump_all();
        step.remaining = self.degraded.len();
        Ok(step)
    }
}
