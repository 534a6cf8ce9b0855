//! Recovery (Nswap §IV-B3, Markatos §2.1): pages that lost a copy, to a dead server or a bad
//! checksum, get it back from a surviving copy, onto a live server that holds none, while the
//! program keeps running. The caller decides the pace: each call rebuilds a bounded batch, so a
//! runtime can spread recovery over time (Nswap Table III: recovery must not slow programs).

use crate::{Disk, Pager, PagerError, Servers, Transport, Writeback, INTERNAL};

/// What one call to [`Pager::recover`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecoveryStep {
    /// Pages whose missing copies were sent out (they count as rebuilt once acknowledged).
    pub started: usize,
    /// Pages found with no copy left anywhere.
    pub unrecoverable: usize,
    /// Pages still to look at.
    pub remaining: usize,
}

impl<T: Transport, D: Disk> Pager<T, D> {
    /// Pages with fewer copies than the redundancy scheme keeps, which recovery still has to
    /// look at.
    /// (Under Reed-Solomon: stripes with pieces missing.)
    pub fn degraded_pages(&self) -> usize {
        if self.rs.is_some() {
            return self.rs_degraded();
        }
        if let Some(p) = self.par.as_deref() {
            return p.pending();
        }
        self.degraded.len()
    }

    /// Pages recovery could not give every copy for want of servers with room; the local disk
    /// backs them meanwhile. They are tried again when a server comes back.
    pub fn pages_short_of_copies(&self) -> usize {
        match &self.rs {
            Some(rs) => rs.short.len(),
            None => self.short.len(),
        }
    }

    /// Rebuilds the missing copies of up to `max_pages` degraded pages: reads each from a
    /// surviving copy (pipelined), then writes the copies it lacks to servers that hold none.
    /// The writes are not waited for; a read of such a page meanwhile is served from memory.
    pub fn recover(&mut self, max_pages: usize) -> Result<RecoveryStep, PagerError> {
        if self.rs.is_some() {
            return self.rs_recover(max_pages);
        }
        if self.par.is_some() {
            return self.par_recover(max_pages);
        }
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
            if alive.len() >= self.copies {
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
            let e = *self.table.get(page);
            if self.alive_holder(page, &e, None).is_some() {
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
            self.writeback.insert(
                page,
                Writeback {
                    slot,
                    version: e.version,
                    done: Servers::default(),
                    pending: Servers::default(),
                    refused: Servers::default(),
                    keep,
                    rebuild: true,
                    join: false,
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
