//! The pager's side of the seam with its redundancy scheme ([`crate::scheme`]): the hooks the
//! rest of the pager calls, each handing its event to the pager's scheme (what is the same
//! under every scheme is done here), and what a scheme may use of the pager.

use super::requests::{GetItem, Op, PutItem, ReadDone};
use super::writeback::Writeback;
use super::ServerState;
use crate::scheme::{parity, Landed, RecoveryStep, Sealed};
use crate::table::Table;
use crate::PagerCounters;
use crate::{Disk, Pager, PagerError, Transport};
use netram_proto::{PageKey, PAGE_SIZE};
use std::any::Any;
use std::collections::HashMap;

/// The hooks the rest of the pager calls, each handed to the scheme (what is the same under
/// every scheme is done here).
impl<T: Transport, D: Disk> Pager<T, D> {
    pub(crate) fn written_back(&mut self, page: u64) -> Result<(), PagerError> {
        let s = self.scheme;
        s.written_back(self, page)
    }

    pub(crate) fn place(&mut self, page: u64) -> Result<(), PagerError> {
        let s = self.scheme;
        s.place(self, page)
    }

    pub(crate) fn stored(&mut self, it: PutItem, server: usize) -> Result<(), PagerError> {
        let s = self.scheme;
        s.stored(self, it, server)
    }

    pub(crate) fn put_failed(&mut self, it: PutItem, server: usize) -> Result<(), PagerError> {
        let s = self.scheme;
        s.put_failed(self, it, server)
    }

    /// A write-back of whole copies settled ([`Landed`]).
    pub(crate) fn copies_landed(&mut self, page: u64, landed: Landed) {
        let s = self.scheme;
        s.landed(self, page, landed);
    }

    /// An answer only a scheme's own requests get (a parity holder's, see [`parity::Answer`]).
    pub(crate) fn scheme_answer(
        &mut self,
        server: usize,
        answer: parity::Answer,
    ) -> Result<(), PagerError> {
        let s = self.scheme;
        s.answer(self, server, answer)
    }

    /// A GET that got no good data from `server` (dead, bad checksum, missing: `what`).
    pub(crate) fn get_failed(&mut self, server: usize, it: GetItem, what: Option<&'static str>) {
        if crate::ticket::is_ticket(it.pos) && self.ticket_outdated(&it) {
            // The page changed while its read by ticket was on its way: the server answered
            // for the newer version, not wrongly (`ticket.rs`).
            return self.restart_ticket(it);
        }
        let s = self.scheme;
        s.get_failed(self, server, it, what);
    }

    /// The first live server that holds a page's current version, other than `not`.
    pub(crate) fn alive_holder(&self, page: u64, not: Option<usize>) -> Option<usize> {
        if self.table.get(page).lost {
            return None;
        }
        self.scheme.alive_holder(self, page, not)
    }

    /// Whether a page out of reach can be decoded from the rest of its stripe or group.
    pub(crate) fn reconstructible(&self, page: u64) -> bool {
        self.scheme.reconstructible(self, page)
    }

    /// A read whose page has no copy in reach but can be reconstructed. A read by ticket waits
    /// for recovery to bring its page back, which never waits (the scheme parks it); the others
    /// are decoded by `run_reconstructions`, which does.
    pub(crate) fn reconstruct_later(&mut self, it: GetItem) {
        let it = if crate::ticket::is_ticket(it.pos) {
            let s = self.scheme;
            match s.park(self, it) {
                Ok(()) => return,
                Err(it) => it,
            }
        } else {
            it
        };
        self.reconstruct.push(it);
    }

    /// Whether a degraded read by ticket waits on for recovery: its page is as it was when
    /// the read started, still out of reach, and can come back from its stripe or group.
    pub(crate) fn waits_for_recovery(&self, it: &GetItem) -> bool {
        let e = self.table.get(it.page);
        e.present
            && !e.lost
            && !e.on_disk
            && e.version == it.version
            && !self.cache.contains(&it.page)
            && !self.writeback.contains_key(&it.page)
            && self.alive_holder(it.page, None).is_none()
            && self.reconstructible(it.page)
    }

    /// A degraded read by ticket that no longer waits for recovery (its page came within
    /// reach, changed, or is lost) starts again the ordinary way.
    pub(crate) fn restart_waiter(&mut self, it: GetItem) {
        let tag = (it.pos & !crate::ticket::TICKET) as u64;
        if let Err(err) = self.start_ticket(it.page, tag, Some(it.slot)) {
            self.ticket_failed(&it, err);
        }
    }

    /// Moves the degraded reads by ticket that wait for recovery on.
    pub(crate) fn serve_waiters(&mut self) -> Result<(), PagerError> {
        let s = self.scheme;
        s.serve_parked(self)
    }

    /// Decodes a page into `slot` from the rest of its stripe or group; false when it cannot.
    pub(crate) fn reconstruct(&mut self, page: u64, slot: u32) -> Result<bool, PagerError> {
        let s = self.scheme;
        s.reconstruct(self, page, slot)
    }

    /// The key a page's current version is stored under (under Reed-Solomon, its data piece's).
    pub(crate) fn stored_key(&self, page: u64) -> PageKey {
        self.scheme
            .stored_key(self, page)
            .unwrap_or_else(|| self.key(page))
    }

    /// One of the pager's own reads is in: whether the scheme took it.
    pub(crate) fn scheme_read_done(&mut self, d: &ReadDone) -> bool {
        let s = self.scheme;
        s.read_done(self, d)
    }

    /// What deletes superseded copies on a server (a parity pager tracks them, see [`Op::Gc`]).
    pub(crate) fn delete_op(&self, keys: &[PageKey]) -> Op {
        self.scheme.delete_op(keys)
    }

    /// A page is discarded: the copies to delete, per server, go to `deletes`.
    pub(crate) fn discarded(&mut self, page: u64, deletes: &mut [Vec<PageKey>]) {
        let s = self.scheme;
        s.discarded(self, page, deletes);
    }

    pub(crate) fn seal_open(&mut self, page: Option<u64>) -> Result<(), PagerError> {
        let s = self.scheme;
        s.seal_open(self, page)
    }

    /// `settle_writes`' sealing without its waiting, for [`Pager::try_flush`].
    pub(crate) fn seal_without_waiting(&mut self) -> Result<Sealed, PagerError> {
        let s = self.scheme;
        s.seal_without_waiting(self)
    }

    pub(crate) fn settle_writes(&mut self) -> Result<(), PagerError> {
        let s = self.scheme;
        s.settle_writes(self)
    }

    pub(crate) fn server_lost(&mut self, server: usize) {
        let s = self.scheme;
        s.server_lost(self, server);
    }

    pub(crate) fn server_failed_over(&mut self, server: usize) {
        let s = self.scheme;
        s.server_failed_over(self, server);
    }

    pub(crate) fn server_revived(&mut self, server: usize) {
        let s = self.scheme;
        s.server_revived(self, server);
    }

    pub(crate) fn not_leaving(&mut self, server: usize) {
        let s = self.scheme;
        s.not_leaving(self, server);
    }

    pub(crate) fn release_leaving(&mut self, server: usize, want: usize) -> Option<Vec<u64>> {
        let s = self.scheme;
        s.release_leaving(self, server, want)
    }

    pub(crate) fn scheme_leaving_pages(
        &mut self,
        server: usize,
        want: usize,
    ) -> Option<(Vec<u64>, bool)> {
        let s = self.scheme;
        s.leaving_pages(self, server, want)
    }

    pub(crate) fn recovery_yield(&mut self) -> bool {
        let s = self.scheme;
        s.recovery_yield(self)
    }

    pub(crate) fn in_recovery(&self, page: u64) -> bool {
        self.scheme.in_recovery(self, page)
    }

    pub(crate) fn recovery_reading(&self, page: u64) -> bool {
        self.scheme.recovery_reading(self, page)
    }

    pub(crate) fn rebuilding_pages(&self) -> usize {
        self.scheme.rebuilding_pages(self)
    }

    /// How many of this pager's pages (pieces, under Reed-Solomon) each server holds.
    pub fn pages_per_server(&self) -> Vec<u64> {
        self.scheme.pages_per_server(self)
    }

    /// What keeps a page safe, for checkers: (server, key, version) of every piece the page
    /// table counts (its copies, or its stripe's pieces), and how many the scheme wants.
    /// `None` while its write-back is in flight.
    pub fn pieces(&self, page: u64) -> Option<(crate::Pieces, usize)> {
        let loc = self.location(page)?;
        if let Some(p) = self.scheme.pieces(self, page) {
            return Some(p);
        }
        let key = self.key(page);
        let pieces = loc.holders.iter().map(|&s| (s, key, loc.version)).collect();
        Some((pieces, self.shape.copies))
    }

    /// Pages (under Reed-Solomon: stripes) that lack some of what keeps them safe, which
    /// recovery still has to look at.
    pub fn degraded_pages(&self) -> usize {
        self.scheme.degraded_pages(self)
    }

    /// Pages recovery could not give every copy for want of servers with room; the local disk
    /// backs them meanwhile. They are tried again when a server comes back.
    pub fn pages_short_of_copies(&self) -> usize {
        self.scheme.pages_short_of_copies(self)
    }

    /// Rebuilds what up to `max_pages` degraded pages lack (Nswap §IV-B3): new copies from a
    /// surviving one, a lost page from its group's parity, lost pieces from their stripe. The
    /// caller sets the pace ([`Pager::on_tick`] spreads it over time).
    pub fn recover(&mut self, max_pages: usize) -> Result<RecoveryStep, PagerError> {
        let s = self.scheme;
        s.recover(self, max_pages)
    }
}

/// What a scheme may use of the pager's state besides its operations: the page table,
/// counters, servers, write-backs, its own state, and a few questions about a page.
impl<T: Transport, D: Disk> Pager<T, D> {
    /// The scheme's own state (its type: `mirror::Copies`, `parity::Par`, `stripe::Rs`).
    pub(crate) fn state<S: Any>(&self) -> Option<&S> {
        self.scheme_state.get()
    }
    pub(crate) fn state_mut<S: Any>(&mut self) -> Option<&mut S> {
        self.scheme_state.get_mut()
    }
    pub(crate) fn table(&self) -> &Table {
        &self.table
    }
    pub(crate) fn table_mut(&mut self) -> &mut Table {
        &mut self.table
    }
    pub(crate) fn counters_mut(&mut self) -> &mut PagerCounters {
        &mut self.counters
    }
    pub(crate) fn server_states(&self) -> &[ServerState] {
        &self.servers
    }
    /// Pages whose write-back is in flight.
    pub(crate) fn writebacks(&self) -> &HashMap<u64, Writeback> {
        &self.writeback
    }
    pub(crate) fn writebacks_mut(&mut self) -> &mut HashMap<u64, Writeback> {
        &mut self.writeback
    }
    pub(crate) fn free_slot_count(&self) -> usize {
        self.free_slots.len()
    }
    pub(crate) fn rng(&mut self) -> &mut fastrand::Rng {
        &mut self.rng
    }
    /// Whether a page is in the cache.
    pub(crate) fn cached(&self, page: u64) -> bool {
        self.cache.contains(&page)
    }
    /// Whether a page is on its way off a leaving server.
    pub(crate) fn migrating(&self, page: u64) -> bool {
        self.migrating.contains(&page)
    }
    /// Whether a page's read for a move through this pager is out.
    pub(crate) fn moving(&self, page: u64) -> bool {
        self.moving.contains_key(&page)
    }
    /// A GET to be tried on another copy.
    pub(crate) fn retry_elsewhere(&mut self, it: GetItem) {
        self.retry.push(it);
    }

    /// The slot pool, for a scheme's arithmetic over several slots at once (encoding a stripe).
    pub(crate) fn slot_pool(&self) -> &[u8] {
        &self.slots
    }
    /// Copies slot `from` into slot `to`.
    pub(crate) fn copy_slot(&mut self, from: u32, to: u32) {
        let from = from as usize * PAGE_SIZE;
        self.slots
            .copy_within(from..from + PAGE_SIZE, to as usize * PAGE_SIZE);
    }
    /// Reads a page's disk copy into `slot` (counted as a disk read).
    pub(crate) fn read_disk_into(&mut self, page: u64, slot: u32) -> Result<(), PagerError> {
        self.counters.disk_reads += 1;
        let at = slot as usize * PAGE_SIZE;
        self.disk.read(page, &mut self.slots[at..at + PAGE_SIZE])?;
        Ok(())
    }
    /// Copies a page's current data held in memory — its write-back's slot, or its slot in the
    /// cache — into `slot`, opened if it was sealed: whether there was any.
    pub(crate) fn copy_from_memory(&mut self, page: u64, slot: u32) -> bool {
        let held = self
            .writeback
            .get(&page)
            .map(|wb| (wb.slot, wb.version))
            .or_else(|| self.cache.peek(&page).map(|&s| (s, 0)));
        let Some((from, version)) = held else {
            return false;
        };
        let sealed = self.sealed[from as usize];
        self.copy_slot(from, slot);
        if sealed {
            // A write-back's ciphertext, sealed by this pager: it opens.
            self.sealed[slot as usize] = true;
            self.unseal_own(page, version, slot);
        }
        true
    }
    /// One of the pager's own finished reads, of `page` into `slot`, taken: false if it is
    /// not in.
    pub(crate) fn take_fetched_one(&mut self, page: u64, slot: u32) -> bool {
        let i = self.fetched.iter().position(|&f| f == (page, slot));
        i.map(|i| self.fetched.swap_remove(i)).is_some()
    }
    /// The pager's own finished reads (page, slot) that `mine` picks, taken; the others stay.
    pub(crate) fn take_fetched(
        &mut self,
        mine: impl Fn(&Self, u64, u32) -> bool,
    ) -> Vec<(u64, u32)> {
        let all = std::mem::take(&mut self.fetched);
        let (taken, rest) = all.into_iter().partition(|&(p, s)| mine(self, p, s));
        self.fetched = rest;
        taken
    }
    /// A finished read of the pager's own, for whoever wants it next (`take_fetched`).
    pub(crate) fn fetched_push(&mut self, page: u64, slot: u32) {
        self.fetched.push((page, slot));
    }
    /// Pages whose own read (recovery's, a move's) failed on every copy that `mine` picks,
    /// taken; the others stay.
    pub(crate) fn take_own_failed(&mut self, mine: impl Fn(&Self, u64) -> bool) -> Vec<u64> {
        let all = std::mem::take(&mut self.own_failed);
        let (taken, rest) = all.into_iter().partition(|&p| mine(self, p));
        self.own_failed = rest;
        taken
    }
    /// Finished reads that `mine` picks (a scheme's piece reads), taken in the order they
    /// came; the others stay, in theirs.
    pub(crate) fn take_reads_done(&mut self, mine: impl Fn(&ReadDone) -> bool) -> Vec<ReadDone> {
        let all = std::mem::take(&mut self.reads_done);
        let (taken, rest) = all.into_iter().partition(|d| mine(d));
        self.reads_done = rest;
        taken
    }
}
