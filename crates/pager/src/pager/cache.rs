//! The slot pool and the LRU cache over it (Anemone's client cache, paper 001 §2.1): every page
//! the pager touches lives in one of `cache_pages + staging` slots allocated at start. Taking a
//! slot may evict (a dirty page goes to write-back) or wait for a request in flight to release
//! one.

use crate::{Disk, Pager, PagerError, Transport};
use netram_proto::PAGE_SIZE;

impl<T: Transport, D: Disk> Pager<T, D> {
    pub(crate) fn slot(&self, slot: u32) -> &[u8] {
        let at = slot as usize * PAGE_SIZE;
        &self.slots[at..at + PAGE_SIZE]
    }

    pub(crate) fn slot_mut(&mut self, slot: u32) -> &mut [u8] {
        let at = slot as usize * PAGE_SIZE;
        &mut self.slots[at..at + PAGE_SIZE]
    }

    pub(crate) fn insert_clean(&mut self, page: u64, slot: u32) -> Result<(), PagerError> {
        self.dirty[slot as usize] = false;
        self.cache.put(page, slot);
        self.evict_over_budget()
    }

    /// [`Pager::insert_clean`] for a read by ticket, whose taker must not wait: the evictions
    /// it makes room with are deferred where they would wait.
    pub(crate) fn insert_clean_without_waiting(
        &mut self,
        page: u64,
        slot: u32,
    ) -> Result<(), PagerError> {
        self.dirty[slot as usize] = false;
        self.cache.put(page, slot);
        self.evict_without_waiting()
    }

    /// Evicts least recently used pages while the cache is over budget, a batch at a time, so
    /// that dirty pages go out as pipelined PUTs.
    pub(crate) fn evict_over_budget(&mut self) -> Result<(), PagerError> {
        self.evict(true)
    }

    /// [`Pager::evict_over_budget`] that never waits: it stops, leaving the cache over its
    /// budget until a later call, at a dirty victim whose last write-back is still in flight
    /// (versions land in order) or when no slot is left for sealing a stripe.
    pub(crate) fn evict_without_waiting(&mut self) -> Result<(), PagerError> {
        self.evict(false)
    }

    fn evict(&mut self, wait: bool) -> Result<(), PagerError> {
        // Pages the disk failed to write stay in memory on top of the budget: evicting others
        // for them would only push more pages at the failing disk.
        let budget = |p: &Self| p.cfg.cache_pages + p.rehomed.len();
        if self.cache.len() <= budget(self) {
            self.evictions_deferred = 0;
            return Ok(());
        }
        let n = (self.cache.len() - budget(self))
            .max(self.cfg.writeback_batch.min(self.cfg.cache_pages));
        // A batch at least, and until within the budget: writing a failed page back shrinks
        // the budget by one. Bounded, as a page the disk fails again comes back at the top.
        for evicted in 0..n + self.cache.len() {
            if evicted >= n && self.cache.len() <= budget(self) {
                break;
            }
            let Some((&page, &slot)) = self.cache.peek_lru() else {
                break;
            };
            let blocked = self.dirty[slot as usize]
                && (self.writeback.contains_key(&page)
                    || self.free_slots.len() < self.shape.seal_slots);
            if !wait && blocked {
                // Over the budget by as many pages as are left: a later call evicts them.
                self.evictions_deferred = self.cache.len().saturating_sub(budget(self));
                return Ok(());
            }
            self.cache.pop_lru();
            if self.dirty[slot as usize] {
                self.counters.evictions_dirty += 1;
                self.dirty[slot as usize] = false;
                self.write_back(page, slot)?;
            } else {
                self.counters.evictions_clean += 1;
                self.release_slot(slot);
            }
        }
        if self.cache.len() <= budget(self) {
            self.evictions_deferred = 0;
        }
        Ok(())
    }

    /// A free slot, completing requests in flight until one is released. There is always one to
    /// wait for: slots not free are cached (at most `cache_pages`) or carry a request; or they
    /// all hold finished reads by ticket not taken yet, and the pool grows by one.
    pub(crate) fn take_slot(&mut self) -> Result<u32, PagerError> {
        // Evictions go back to the cache when the disk fails them: once more have failed than
        // pages are cached, there is no room to be had.
        let failed_before = self.counters.disk_write_errors;
        loop {
            if self.counters.disk_write_errors - failed_before > self.cache.len() as u64 {
                return Err(self.disk_outcome().err().unwrap_or_else(|| {
                    PagerError::Disk(std::io::Error::other(
                        "every page in memory waits for a disk that fails its writes",
                    ))
                }));
            }
            if let Some(s) = self.free_slots.pop() {
                return Ok(s);
            }
            if self.idle() && self.cache.is_empty() && self.start_own_reads()? {
                // Recovery's and moves' reads that were in held slots: their copies are
                // out now.
                continue;
            }
            if self.idle() && self.cache.is_empty() && self.recovery_yield() {
                // The scheme's recovery held them (parity survivors', pieces of stripes being
                // rebuilt): it starts again at a later step.
                continue;
            }
            if self.idle() && self.cache.is_empty() {
                // Every slot waits in an open parity group: ship them.
                self.seal_open(None)?;
                if self.idle() && self.finished_hold_slots() {
                    // Every slot holds a read by ticket that has finished and is not taken
                    // yet: its caller takes it once this call is over, and this waiting
                    // caller (which holds the pager meanwhile) gets one more slot instead.
                    return Ok(self.grow_slot());
                }
                if self.idle() {
                    panic!(
                        "no slot free, cached or in flight: {} slots ({} grown), {} finished \
                         reads by ticket, {} waiting, {} own reads fetched, {} moving, {} \
                         write-backs, {} reads done",
                        self.dirty.len(),
                        self.spare_slots,
                        self.finished.len(),
                        self.slot_waiters.len(),
                        self.fetched.len(),
                        self.moving.len(),
                        self.writeback.len(),
                        self.reads_done.len()
                    );
                }
                continue;
            }
            if self.idle() {
                // Only cached slots remain: make room.
                let (page, slot) = self.cache.pop_lru().expect("slots are cached or in flight");
                if self.dirty[slot as usize] {
                    self.dirty[slot as usize] = false;
                    self.counters.evictions_dirty += 1;
                    self.write_back(page, slot)?;
                } else {
                    self.counters.evictions_clean += 1;
                    self.release_slot(slot);
                }
                continue;
            }
            self.complete_one()?;
        }
    }

    /// A free slot for a read: like [`Pager::take_slot`], but finished reads hold slots until
    /// they are copied out, so they are copied out while waiting.
    pub(crate) fn take_slot_for_read(&mut self, out: &mut [u8]) -> Result<u32, PagerError> {
        loop {
            self.copy_out_reads(out)?;
            if let Some(s) = self.free_slots.pop() {
                return Ok(s);
            }
            if self.idle() {
                return self.take_slot();
            }
            self.complete_one()?;
        }
    }

    /// A slot for a read by ticket, without waiting where that can be: a free one; else the
    /// least recently used cached page's, if it is clean; else, while the pool has grown by
    /// less than [`Pager::spare_slots_max`], a new one. (A dirty victim's slot is free only
    /// once its write-back is acknowledged, which [`Pager::take_slot`] waits for: a read
    /// started when nothing was in flight and the cache was all dirty waited for a PUT.)
    /// Beyond that it waits as [`Pager::take_slot_for_read`] does, which only a waiting call
    /// gets to: `start_read` keeps a read that would as a slot waiter instead (`ticket.rs`).
    pub(crate) fn take_slot_for_ticket(&mut self) -> Result<u32, PagerError> {
        if let Some(s) = self.free_slots.pop() {
            return Ok(s);
        }
        if let Some((_, &slot)) = self.cache.peek_lru() {
            if !self.dirty[slot as usize] {
                self.cache.pop_lru();
                self.counters.evictions_clean += 1;
                self.release_slot(slot);
                return Ok(self.free_slots.pop().expect("released above"));
            }
        }
        if self.spare_slots < self.spare_slots_max() {
            return Ok(self.grow_slot());
        }
        self.take_slot_for_read(&mut [])
    }

    pub(crate) fn release_slot(&mut self, slot: u32) {
        debug_assert!(
            !self.free_slots.contains(&slot),
            "slot {slot} released twice"
        );
        self.dirty[slot as usize] = false;
        self.sealed[slot as usize] = false;
        self.free_slots.push(slot);
    }
}
