//! Reads: a page from the cache, from a server that holds it (batched, pipelined GETs), from
//! another copy or the local disk when that fails (Markatos' flexible backing store, paper 003
//! §2), or decoded by its redundancy scheme; and what a read reports when none of that works
//! (the lost pages by server, or a page that came back corrupt).

use crate::requests::{GetItem, Part, ReadDone, INTERNAL, RECOVERY};
use crate::ticket::is_ticket;
use crate::{Disk, LostPages, Pager, PagerError, Transport, STRIPE_LOST};
use netram_proto::PAGE_SIZE;

/// Whether a read's `pos` is a waiting caller's buffer position (not recovery's, not a
/// ticket's).
pub(crate) fn is_caller(pos: usize) -> bool {
    pos != INTERNAL && pos != RECOVERY && !is_ticket(pos)
}

impl<T: Transport, D: Disk> Pager<T, D> {
    /// Reads one page into `out` (PAGE_SIZE bytes).
    pub fn read(&mut self, page: u64, out: &mut [u8]) -> Result<(), PagerError> {
        self.read_many(&[page], out)
    }

    /// Reads many pages into `out`, one PAGE_SIZE chunk per page, with the misses' GETs
    /// pipelined up to each server's window.
    pub fn read_many(&mut self, pages: &[u64], out: &mut [u8]) -> Result<(), PagerError> {
        if out.len() != pages.len() * PAGE_SIZE {
            return Err(PagerError::BadBuffer {
                got: out.len(),
                pages: pages.len(),
            });
        }
        pages.iter().try_for_each(|&p| self.check(p))?;
        self.lost.clear();
        self.corrupt = None;
        let read = self.read_into(pages, out);
        if read.is_err() {
            self.abandon_reads();
        }
        read
    }

    /// A read that ends early (the disk failed, no slot to be had) leaves GETs in flight whose
    /// data was for its caller's buffer: they are completed and dropped here, so that a later
    /// read never receives them at its own positions.
    pub(crate) fn abandon_reads(&mut self) {
        // Each round completes a reply or fails a server: this ends.
        while !self.idle() {
            if let Err(e) = self.complete_one() {
                tracing::debug!("while abandoning a read: {e}");
            }
        }
        // The caller's reads hold slots; the pager's own (recovery's) stay.
        let mut callers: Vec<u32> = Vec::new();
        // (So do reads by ticket: they are other callers'.)
        let mut ours = |pos: usize, slot: u32| {
            let keep = !is_caller(pos);
            if !keep {
                callers.push(slot);
            }
            keep
        };
        self.retry.retain(|it| ours(it.pos, it.slot));
        self.reconstruct.retain(|it| ours(it.pos, it.slot));
        self.reads_done.retain(|d| ours(d.pos, d.slot));
        for slot in callers {
            self.release_slot(slot);
        }
        self.caller_reads = 0;
        self.lost.clear();
        self.corrupt = None;
    }

    /// Reads `page` into `out` (PAGE_SIZE bytes) if that needs no I/O at all — it is in the
    /// cache or in write-back, or was never written (zeros) — and says whether it did. A page
    /// it does not read is for [`Pager::start_read`]: so a front end serving several callers
    /// answers hits at once and sends only the misses by ticket, with no slot and no copy
    /// spent on a hit.
    pub fn read_at_hand(&mut self, page: u64, out: &mut [u8]) -> Result<bool, PagerError> {
        self.check(page)?;
        if out.len() != PAGE_SIZE {
            return Err(PagerError::BadBuffer {
                got: out.len(),
                pages: 1,
            });
        }
        let served = self.serve_at_hand(page, out);
        if served {
            self.counters.reads += 1;
        }
        Ok(served)
    }

    /// A cache or write-back hit copied out, or zeros for a page never written.
    fn serve_at_hand(&mut self, page: u64, dst: &mut [u8]) -> bool {
        let cached = self
            .cache
            .get(&page)
            .map(|&slot| (slot, 0))
            .or_else(|| self.writeback.get(&page).map(|w| (w.slot, w.version)));
        if let Some((slot, version)) = cached {
            self.counters.cache_hits += 1;
            // A write-back's slot holds ciphertext: opened on the way out.
            self.copy_plain(page, version, slot, dst);
            return true;
        }
        if !self.table.get(page).present {
            self.counters.zero_reads += 1;
            dst.fill(0);
            return true;
        }
        false
    }

    pub(crate) fn read_into(&mut self, pages: &[u64], out: &mut [u8]) -> Result<(), PagerError> {
        for (pos, &page) in pages.iter().enumerate() {
            self.counters.reads += 1;
            let dst = &mut out[pos * PAGE_SIZE..(pos + 1) * PAGE_SIZE];
            if self.serve_at_hand(page, dst) {
                continue;
            }
            let e = *self.table.get(page);
            match self.alive_holder(page, None) {
                Some(server) => {
                    let slot = self.take_slot_for_read(out)?;
                    self.caller_reads += 1;
                    self.submit_get(server, page, slot, pos);
                }
                None if !e.on_disk && self.reconstructible(page) => {
                    let slot = self.take_slot_for_read(out)?;
                    let it = self.page_get_item(page, slot, pos);
                    self.caller_reads += 1;
                    self.reconstruct.push(it);
                }
                None if e.on_disk => {
                    if !self.table.holders(page).is_empty() {
                        self.counters.disk_fallbacks += 1;
                    }
                    self.counters.disk_reads += 1;
                    self.disk.read(page, dst)?;
                    if self.cfg.cache_pages > 0 {
                        let slot = self.take_slot_for_read(out)?;
                        let at = slot as usize * PAGE_SIZE;
                        self.slots[at..at + PAGE_SIZE]
                            .copy_from_slice(&out[pos * PAGE_SIZE..(pos + 1) * PAGE_SIZE]);
                        self.insert_clean(page, slot)?;
                    }
                }
                None => {
                    // A Reed-Solomon page whose stripe lost too many pieces has no holder.
                    let s = self.table.holders(page).first().unwrap_or(STRIPE_LOST);
                    self.lost.push((s, page));
                }
            }
            self.copy_out_reads(out)?;
        }
        // Waits for this call's reads only. Copying out may evict dirty pages, recovery's
        // and migration's reads go on, other callers' tickets arrive: none of that is this
        // read's business, and a read that waited for all of it waited for as many round
        // trips (the owner's read p99 during a migration was more than twice its p99 with
        // moves that did not go through the owner).
        loop {
            self.resubmit_retries();
            self.copy_out_reads(out)?;
            if self.caller_reads == 0 {
                break;
            }
            if !self.retry.is_empty() {
                // Failed over while copying out (keeping a page in the cache may write
                // another back, and that pump fails over what was queued for a server found
                // dead): sent elsewhere first.
                continue;
            }
            let decoding = self
                .reconstruct
                .iter()
                .filter(|it| is_caller(it.pos))
                .count();
            if decoding == self.caller_reads && self.settled() {
                // Only degraded reads are left (rare): decoded once the rest has settled,
                // so that their stripes' pieces are not in flight.
                self.run_reconstructions()?;
                continue;
            }
            assert!(
                !self.idle(),
                "{} of the caller's reads are neither in flight nor done",
                self.caller_reads
            );
            self.complete_one()?;
        }
        self.read_outcome()
    }

    /// A GET that got no good data from `server`, once its scheme has had its say: tried on
    /// another copy, else read from the disk copy, else reported (lost or corrupt) to its
    /// caller.
    pub(crate) fn read_elsewhere(
        &mut self,
        server: usize,
        it: GetItem,
        what: Option<&'static str>,
    ) {
        if self.alive_holder(it.page, Some(server)).is_some() {
            self.counters.reads_from_other_copy += 1;
            self.retry.push(it);
            return;
        }
        self.disk_copy_or_report(server, it, what)
    }

    /// A page no server can give: from the disk copy if there is one; else its caller learns
    /// it is lost (or came back corrupt), and recovery's own read finds it by its absence.
    pub(crate) fn disk_copy_or_report(
        &mut self,
        server: usize,
        it: GetItem,
        what: Option<&'static str>,
    ) {
        if self.table.get(it.page).on_disk {
            self.counters.disk_fallbacks += 1;
            self.counters.disk_reads += 1;
            let at = it.slot as usize * PAGE_SIZE;
            match self.disk.read(it.page, &mut self.slots[at..at + PAGE_SIZE]) {
                Ok(()) => {
                    return self.reads_done.push(ReadDone {
                        pos: it.pos,
                        page: it.page,
                        version: it.version,
                        slot: it.slot,
                        part: Part::Page,
                    })
                }
                Err(e) => tracing::error!(page = it.page, "disk read failed: {e}"),
            }
        }
        if it.pos == INTERNAL {
            // The pager's own read: whole copies' recovery and moves learn of it at their
            // next step; the other users find the page unrecoverable by its absence.
            self.own_read_failed(it.page);
        } else if is_ticket(it.pos) {
            let err = match what {
                Some(what) => self.corrupt_error(server, it.page, what),
                None => self.lost_error(&[(server, it.page)]),
            };
            self.ticket_failed(&it, err);
        } else if let Some(what) = what {
            self.caller_reads -= 1;
            self.corrupt = Some((server, it.page, what));
        } else {
            self.caller_reads -= 1;
            self.lost.push((server, it.page));
        }
        self.release_slot(it.slot);
    }

    /// Decodes the reads whose piece was out of reach (degraded reads).
    pub(crate) fn run_reconstructions(&mut self) -> Result<(), PagerError> {
        for it in std::mem::take(&mut self.reconstruct) {
            if let Some(s) = self.alive_holder(it.page, None) {
                // Its data piece was rebuilt meanwhile: read it.
                let it = self.page_get_item(it.page, it.slot, it.pos);
                self.submit_get_item(s, it);
                continue;
            }
            if self.reconstruct(it.page, it.slot)? {
                self.reconstructed(&it);
            } else {
                self.reconstruction_failed(&it);
            }
        }
        Ok(())
    }

    /// A read whose page was decoded into its slot: done, for its ticket or its waiting read.
    pub(crate) fn reconstructed(&mut self, it: &GetItem) {
        self.reads_done.push(ReadDone {
            pos: it.pos,
            page: it.page,
            version: it.version,
            slot: it.slot,
            part: Part::Page,
        });
    }

    /// A read whose page could not be decoded (too few pieces answered, or what they gave
    /// does not open): lost, for its ticket or its waiting read; its slot goes back.
    pub(crate) fn reconstruction_failed(&mut self, it: &GetItem) {
        let s = self.table.holders(it.page).first().unwrap_or(STRIPE_LOST);
        if is_ticket(it.pos) {
            let err = self.lost_error(&[(s, it.page)]);
            self.ticket_failed(it, err);
        } else {
            self.caller_reads -= 1;
            self.lost.push((s, it.page));
        }
        self.release_slot(it.slot);
    }

    /// Sends the GETs that failed on one copy to another.
    pub(crate) fn resubmit_retries(&mut self) {
        for it in std::mem::take(&mut self.retry) {
            match self.alive_holder(it.page, None) {
                Some(s) => self.submit_get_item(s, it),
                None => {
                    let s = self.table.holders(it.page).first().unwrap_or(0);
                    self.get_failed(s, it, None)
                }
            }
        }
    }

    /// Queues a GET; it goes out with its server's batch.
    pub(crate) fn submit_get(&mut self, server: usize, page: u64, slot: u32, pos: usize) {
        let it = self.page_get_item(page, slot, pos);
        self.submit_get_item(server, it);
    }

    /// A GET of a page's current version (its stripe's data piece under Reed-Solomon).
    pub(crate) fn page_get_item(&self, page: u64, slot: u32, pos: usize) -> GetItem {
        GetItem {
            page,
            slot,
            pos,
            key: self.stored_key(page),
            version: self.table.get(page).version,
            part: Part::Page,
        }
    }

    /// Copies finished reads to the caller and hands their slots to the cache. Reed-Solomon
    /// recovery's stay where they are, for its next step (`rs_harvest`).
    pub(crate) fn copy_out_reads(&mut self, out: &mut [u8]) -> Result<(), PagerError> {
        while let Some(i) = self.reads_done.iter().rposition(|d| d.pos != RECOVERY) {
            let d = self.reads_done.swap_remove(i);
            if d.pos == INTERNAL {
                self.own_read_done(&d);
                continue;
            }
            if is_ticket(d.pos) {
                self.ticket_done(d);
                continue;
            }
            self.caller_reads -= 1;
            out[d.pos * PAGE_SIZE..(d.pos + 1) * PAGE_SIZE].copy_from_slice(self.slot(d.slot));
            if self.cfg.cache_pages > 0 && !self.cache.contains(&d.page) {
                self.insert_clean(d.page, d.slot)?;
            } else {
                self.release_slot(d.slot);
            }
        }
        Ok(())
    }

    /// Moves the pager's own finished reads from `reads_done` to `fetched`, leaving a
    /// caller's reads where they are.
    pub(crate) fn take_internal_reads(&mut self) {
        let mut i = 0;
        while i < self.reads_done.len() {
            if self.reads_done[i].pos == INTERNAL {
                let d = self.reads_done.swap_remove(i);
                self.own_read_done(&d);
            } else {
                i += 1;
            }
        }
    }

    /// One of the pager's own reads is in: a parity survivor's for recovery's round, any
    /// other (recovery of whole copies, a move, a degraded read's) for `fetched`.
    fn own_read_done(&mut self, d: &ReadDone) {
        if !self.scheme_read_done(d) {
            self.fetched.push((d.page, d.slot));
        }
    }

    pub(crate) fn read_outcome(&mut self) -> Result<(), PagerError> {
        if let Some((s, page, what)) = self.corrupt.take() {
            return Err(self.corrupt_error(s, page, what));
        }
        if self.lost.is_empty() {
            return Ok(());
        }
        let err = self.lost_error(&self.lost);
        self.lost.clear();
        Err(err)
    }

    pub(crate) fn corrupt_error(&self, s: usize, page: u64, what: &'static str) -> PagerError {
        PagerError::Corrupt {
            server: self.servers[s].info.name.clone(),
            page,
            what,
        }
    }

    /// The error naming lost pages, by the server (or stripe) they were lost with.
    pub(crate) fn lost_error(&self, lost: &[(usize, u64)]) -> PagerError {
        let mut by_server: Vec<LostPages> = Vec::new();
        for &(s, page) in lost {
            let (name, reason) = match self.servers.get(s) {
                Some(st) => (st.info.name.clone(), st.dead_reason.clone()),
                None => (
                    "(its stripe's servers)".to_string(),
                    "fewer pieces of its stripe survive than it needs".to_string(),
                ),
            };
            match by_server.iter_mut().find(|l| l.server == name) {
                Some(l) => l.pages.push(page),
                None => by_server.push(LostPages {
                    server: name,
                    reason,
                    pages: vec![page],
                }),
            }
        }
        PagerError::Lost(by_server)
    }
}
