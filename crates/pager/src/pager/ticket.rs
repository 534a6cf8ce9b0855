//! Reads by ticket: started by [`Pager::start_read`], finished by the replies whoever owns the
//! sockets hands to the pager ([`Pager::poll`], [`Pager::on_reply`], or any other operation's
//! wait), collected by [`Pager::take_finished`]. Nothing here waits for the network, so one loop
//! can keep the reads of many faulting threads in flight together while it goes on reading
//! faults (Anemone §2.2: the client module serves each fault as its own request; it is the
//! pipelining of those requests, not a thread per fault, that hides the round trips).
//!
//! A ticket's read goes the same way as a caller's (`read.rs`): a GET on its holder's batch,
//! another copy when one fails, the disk copy, or its scheme's reconstruction. It is told from
//! the other reads by its `pos`: [`TICKET`] plus the caller's tag. What it reads stays in its
//! slot until taken. A degraded read under Reed-Solomon (its data piece out of reach) waits for
//! its stripe's rebuild, started at once and decoding its page on the way, without waiting
//! (`rs_serve_waiters`); under parity it waits for recovery, driven on by each call that
//! takes finished reads, to bring its page back (`par_serve_waiters`), without waiting
//! either.

use crate::requests::{GetItem, ReadDone};
use crate::{Disk, Pager, PagerError, Transport};
use netram_proto::PAGE_SIZE;

/// The `pos` of a read by ticket: this bit plus its tag (`requests::INTERNAL` is all ones,
/// a caller's buffer position is small).
pub(crate) const TICKET: usize = 1 << 62;

/// Whether a read's `pos` is a ticket's.
pub(crate) fn is_ticket(pos: usize) -> bool {
    pos & TICKET != 0 && pos != crate::requests::INTERNAL
}

/// A page of zeros: what a page never written reads as.
static ZEROS: [u8; PAGE_SIZE] = [0; PAGE_SIZE];

/// A read by ticket that has finished (or failed), waiting to be taken.
#[derive(Debug)]
pub(crate) struct Finished {
    pub(crate) tag: u64,
    pub(crate) page: u64,
    /// The version it read: its slot goes to the cache only if that is still the page's.
    pub(crate) version: u32,
    pub(crate) data: Result<Data, PagerError>,
}

#[derive(Debug)]
pub(crate) enum Data {
    Slot(u32),
    Zeros,
}

impl<T: Transport, D: Disk> Pager<T, D> {
    /// Starts reading `page`; its result is given to [`Pager::take_finished`] under `tag`
    /// (below 2^62), once, however it ends. Never waits for the network: a page in the cache,
    /// never written, or only on the local disk finishes at once; one on a server waits for
    /// its reply, which any later call that reads replies takes in. With no slot free it takes
    /// a clean cached page's, else grows the pool by one (up to [`Pager::spare_slots_max`]);
    /// beyond that the read waits for a slot as a state (`slot_waiters`), a dirty victim's
    /// write-back started for it, and starts from a later call that takes replies in or
    /// finished reads out. Never waits.
    pub fn start_read(&mut self, page: u64, tag: u64) -> Result<(), PagerError> {
        assert!(tag < TICKET as u64, "a ticket's tag is below 2^62");
        self.check(page)?;
        self.counters.reads += 1;
        if !self.slot_waiters.is_empty() || !self.ticket_slot_at_hand() {
            // Behind those that wait already: reads start in the order asked for.
            self.slot_waiters.push_back((page, tag));
            self.tickets += 1;
            self.counters.ticket_slot_waits += 1;
            self.make_room_for_waiters();
            return Ok(());
        }
        // Counted once started: a start that fails (a disk error) leaves no ticket.
        self.start_ticket(page, tag, None)?;
        self.tickets += 1;
        Ok(())
    }

    /// Whether finished reads by ticket not taken yet hold slots (in `finished`, or in
    /// `reads_done` still, where replies taken in by a waiting call leave them).
    pub(crate) fn finished_hold_slots(&self) -> bool {
        self.finished
            .iter()
            .any(|f| matches!(f.data, Ok(Data::Slot(_))))
            || self.reads_done.iter().any(|d| is_ticket(d.pos))
    }

    /// Whether a read by ticket started now would start at once rather than wait for a slot
    /// (see [`Pager::start_read`]): what a guess (a page fetched ahead) should ask first, so
    /// that it never waits in line ahead of a read somebody waits for.
    pub fn read_starts_now(&self) -> bool {
        self.slot_waiters.is_empty() && self.ticket_slot_at_hand()
    }

    /// Whether [`Pager::take_slot_for_ticket`] has a slot without waiting.
    fn ticket_slot_at_hand(&self) -> bool {
        !self.free_slots.is_empty()
            || self
                .cache
                .peek_lru()
                .is_some_and(|(_, &slot)| !self.dirty[slot as usize])
            || self.spare_slots < self.spare_slots_max()
    }

    /// Starts the write-back of the least recently used cached page for a read waiting for a
    /// slot (its slot is free once acknowledged), unless that would wait: its last write-back
    /// still in flight, or no slot left for sealing a stripe. Slots held otherwise come back
    /// as replies and taken reads return them.
    fn make_room_for_waiters(&mut self) {
        let Some((&page, &slot)) = self.cache.peek_lru() else {
            return;
        };
        if !self.dirty[slot as usize]
            || self.writeback.contains_key(&page)
            || self.free_slots.len() < self.shape.seal_slots
        {
            return;
        }
        self.cache.pop_lru();
        self.dirty[slot as usize] = false;
        self.counters.evictions_dirty += 1;
        self.must_not_wait += 1;
        let written = self.write_back(page, slot);
        self.must_not_wait -= 1;
        if let Err(e) = written {
            tracing::debug!("writing page {page} back for a read waiting for a slot: {e}");
        }
    }

    /// Starts the reads waiting for a slot, in order, while slots are at hand; `wait`: the
    /// first may wait for one when nothing else would free it (only from a waiting call).
    pub(crate) fn start_slot_waiters(&mut self, wait: bool) {
        while let Some(&(page, tag)) = self.slot_waiters.front() {
            if !(self.ticket_slot_at_hand() || wait && self.idle()) {
                self.make_room_for_waiters();
                return;
            }
            self.slot_waiters.pop_front();
            if let Err(err) = self.start_ticket(page, tag, None) {
                // Said to its taker, as a read that failed in flight is.
                self.finished.push(Finished {
                    tag,
                    page,
                    version: 0,
                    data: Err(err),
                });
            }
        }
    }

    /// Where a read by ticket goes, at the page's current version. `slot`: the one it holds
    /// already (a restart, see `restart_ticket`), else one is taken.
    pub(crate) fn start_ticket(
        &mut self,
        page: u64,
        tag: u64,
        slot: Option<u32>,
    ) -> Result<(), PagerError> {
        let mut held = slot;
        let mut take = |p: &mut Self| match held.take() {
            Some(s) => Ok(s),
            None => p.take_slot_for_ticket(),
        };
        let started = self.start_ticket_with(page, tag, &mut take);
        if let Some(s) = held {
            // Not needed after all (a page of zeros, lost, or failed).
            self.release_slot(s);
        }
        started
    }

    fn start_ticket_with(
        &mut self,
        page: u64,
        tag: u64,
        take: &mut impl FnMut(&mut Self) -> Result<u32, PagerError>,
    ) -> Result<(), PagerError> {
        let pos = TICKET | tag as usize;

        let cached = self
            .cache
            .get(&page)
            .map(|&slot| (slot, 0))
            .or_else(|| self.writeback.get(&page).map(|w| (w.slot, w.version)));
        let finished = |data| Finished {
            tag,
            page,
            version: 0,
            data,
        };
        if let Some((from, version)) = cached {
            self.counters.cache_hits += 1;
            let slot = take(self)?;
            let mut page_data = [0u8; PAGE_SIZE];
            self.copy_plain(page, version, from, &mut page_data);
            self.slot_mut(slot).copy_from_slice(&page_data);
            // Already cached (or leaving it): the slot is a copy, given back once taken.
            self.finished.push(Finished {
                version: u32::MAX,
                ..finished(Ok(Data::Slot(slot)))
            });
            return Ok(());
        }
        let e = *self.table.get(page);
        if !e.present {
            self.counters.zero_reads += 1;
            self.finished.push(finished(Ok(Data::Zeros)));
            return Ok(());
        }
        match self.alive_holder(page, None) {
            Some(server) => {
                let slot = take(self)?;
                let it = self.page_get_item(page, slot, pos);
                self.queue_get(server, it);
            }
            None if !e.on_disk && self.reconstructible(page) => {
                let slot = take(self)?;
                let it = self.page_get_item(page, slot, pos);
                self.reconstruct_later(it);
            }
            None if e.on_disk => {
                if !self.table.holders(page).is_empty() {
                    self.counters.disk_fallbacks += 1;
                }
                self.counters.disk_reads += 1;
                let slot = take(self)?;
                let at = slot as usize * PAGE_SIZE;
                match self.disk.read(page, &mut self.slots[at..at + PAGE_SIZE]) {
                    Ok(()) => self.finished.push(Finished {
                        version: e.version,
                        ..finished(Ok(Data::Slot(slot)))
                    }),
                    Err(err) => {
                        self.release_slot(slot);
                        self.finished.push(finished(Err(PagerError::Disk(err))));
                    }
                }
            }
            None => {
                let s = self
                    .table
                    .holders(page)
                    .first()
                    .unwrap_or(crate::STRIPE_LOST);
                let err = self.lost_error(&[(s, page)]);
                self.finished.push(finished(Err(err)));
            }
        }
        Ok(())
    }

    /// Sends whatever is queued that the servers' credits allow, open batches too: what a loop
    /// does once it has started the reads of every fault it has read. Never waits.
    pub fn send_queued(&mut self) {
        self.start_slot_waiters(false);
        self.pump_all();
        self.transport.flush();
    }

    /// Whether requests wait in a server's queue for credits that only replies return: then a
    /// loop that has not read replies for a while does well to take them in before it adds
    /// more (`send_queued` sends what they allow).
    pub fn sends_waiting(&self) -> bool {
        self.queues.iter().any(|q| !q.is_empty())
    }

    /// Whether anything is in flight whose reply a loop should wait for (see
    /// [`Pager::reply_fds`]).
    pub fn awaits_replies(&self) -> bool {
        !self.inflight.ops.is_empty()
    }

    /// The descriptors a loop waits on for the replies of what is in flight (see
    /// [`crate::Transport::reply_fd`]), appended to `out`.
    pub fn reply_fds(&self, out: &mut Vec<std::os::fd::RawFd>) {
        for (s, &n) in self.inflight.per_server.iter().enumerate() {
            if n > 0 {
                out.extend(self.transport.reply_fd(s));
            }
        }
    }

    /// [`Pager::reply_fds`] with the server each descriptor belongs to.
    pub fn reply_fds_by_server(&self, out: &mut Vec<(usize, std::os::fd::RawFd)>) {
        for (s, &n) in self.inflight.per_server.iter().enumerate() {
            if n > 0 {
                out.extend(self.transport.reply_fd(s).map(|fd| (s, fd)));
            }
        }
    }

    /// Whether some server with requests in flight has a descriptor to watch for its replies
    /// (what [`Pager::reply_fds_by_server`] would list).
    pub fn has_reply_fds(&self) -> bool {
        self.inflight
            .per_server
            .iter()
            .enumerate()
            .any(|(s, &n)| n > 0 && self.transport.reply_fd(s).is_some())
    }

    /// Waits until every read by ticket has finished (the transport's reply timeout bounds
    /// each wait: a server that does not answer is declared dead and its reads go elsewhere).
    /// What a loop falls back on when it has no descriptor to wait on (a transport in memory),
    /// or before a step that must not have reads in flight (a fork).
    pub fn wait_finished(&mut self) -> Result<(), PagerError> {
        loop {
            self.resubmit_ticket_retries();
            self.start_slot_waiters(true);
            self.route_ticket_reads();
            // Degraded reads waiting for recovery drive it on (it sends, and never waits).
            self.serve_waiters()?;
            // Idle with tickets unfinished: nothing in flight can finish them (degraded reads
            // waiting for a rebuild that cannot start yet).
            if self.finished.len() >= self.tickets || self.idle() {
                return Ok(());
            }
            self.complete_one()?;
        }
    }

    /// Whether the page changed since a read by ticket asked for `it.version`: written (into
    /// the cache, which it was not in when the read started; a write-back of another version
    /// in flight, or done), or discarded. A server may then answer for the newer version, and
    /// that is no fault of its copy; and what the read failed to get is not the page's current
    /// contents anyway.
    pub(crate) fn ticket_outdated(&self, it: &GetItem) -> bool {
        let e = self.table.get(it.page);
        self.cache.contains(&it.page)
            || !e.present
            || e.version != it.version
            || self
                .writeback
                .get(&it.page)
                .is_some_and(|w| w.version != it.version)
    }

    /// Reads an outdated ticket's page again, at its current version, in the slot it holds.
    /// Called while a reply is handled: never waits (the slot is there already).
    pub(crate) fn restart_ticket(&mut self, it: GetItem) {
        self.counters.reads_restarted += 1;
        let tag = (it.pos & !TICKET) as u64;
        if let Err(e) = self.start_ticket(it.page, tag, Some(it.slot)) {
            self.ticket_failed(&it, e);
        }
    }

    /// Reads by ticket [`Pager::start_read`] starts now without waiting for a slot: the free
    /// slots, less those sealing a Reed-Solomon stripe may take. A loop that starts no more
    /// than this (or starts one anyway when [`Pager::awaits_replies`] is false, when no reply
    /// could free a slot) never waits in `start_read`.
    pub fn read_room(&self) -> usize {
        self.free_slots.len().saturating_sub(self.shape.seal_slots)
    }

    /// Reads by ticket started and not yet taken.
    pub fn tickets(&self) -> usize {
        self.tickets
    }

    /// Whether a read by ticket has finished and waits to be taken (without reading any reply).
    pub fn has_finished(&self) -> bool {
        !self.finished.is_empty() || self.reads_done.iter().any(|d| is_ticket(d.pos))
    }

    /// Gives every finished read by ticket to `f` (tag, page, its data or why there is none),
    /// then keeps its page in the cache if it is still the page's current version. A read that
    /// failed on one copy is sent to another here, and a degraded one moved on (it waits for
    /// recovery to bring its page back, which never waits). Never waits.
    pub fn take_finished(
        &mut self,
        mut f: impl FnMut(u64, u64, Result<&[u8], PagerError>),
    ) -> Result<(), PagerError> {
        // Keeping a page evicts another, whose write-back must not wait for credits: it
        // queues, and goes with the replies that return them or the caller's `send_queued`
        // (which a loop calls after this: left queued, it waits for the next reply).
        // Without this it did: the userfaultfd handler, installing fetches, waited for
        // acknowledgements under the region's lock (231 replies in a forking Python's run).
        self.must_not_wait += 1;
        let result = self.take_finished_without_waiting(&mut f);
        self.must_not_wait -= 1;
        result
    }

    fn take_finished_without_waiting(
        &mut self,
        f: &mut impl FnMut(u64, u64, Result<&[u8], PagerError>),
    ) -> Result<(), PagerError> {
        self.resubmit_ticket_retries();
        self.serve_waiters()?;
        self.route_ticket_reads();
        self.pump_all();
        let mut result = Ok(());
        // Reads waiting for a slot start as the slots these give back allow; those that
        // finish at once (a cache hit, a page never written) are given out in the same call.
        loop {
            for done in std::mem::take(&mut self.finished) {
                self.tickets -= 1;
                match done.data {
                    Ok(Data::Zeros) => f(done.tag, done.page, Ok(&ZEROS)),
                    Err(e) => f(done.tag, done.page, Err(e)),
                    Ok(Data::Slot(slot)) => {
                        f(done.tag, done.page, Ok(self.slot(slot)));
                        // What it read is worth keeping only while it is the page's current
                        // version: a write or a discard may have come in while it was on its way.
                        let e = *self.table.get(done.page);
                        let current = e.present
                            && e.version == done.version
                            && !self.writeback.contains_key(&done.page);
                        if self.cfg.cache_pages > 0 && current && !self.cache.contains(&done.page) {
                            if let Err(e) = self.insert_clean_without_waiting(done.page, slot) {
                                result = Err(e);
                            }
                        } else {
                            self.release_slot(slot);
                        }
                    }
                }
            }
            let waiting = self.slot_waiters.len();
            self.start_slot_waiters(false);
            self.route_ticket_reads();
            if self.finished.is_empty() || self.slot_waiters.len() == waiting {
                break;
            }
        }
        result
    }

    /// Moves the reads by ticket that replies finished out of `reads_done` (where the reply
    /// handlers put every finished read) into `finished`.
    pub(crate) fn route_ticket_reads(&mut self) {
        let mut i = 0;
        while i < self.reads_done.len() {
            if is_ticket(self.reads_done[i].pos) {
                let d = self.reads_done.swap_remove(i);
                self.ticket_done(d);
            } else {
                i += 1;
            }
        }
    }

    /// A read by ticket whose data is in its slot.
    pub(crate) fn ticket_done(&mut self, d: ReadDone) {
        self.finished.push(Finished {
            tag: (d.pos & !TICKET) as u64,
            page: d.page,
            version: d.version,
            data: Ok(Data::Slot(d.slot)),
        });
    }

    /// A read by ticket that no copy, disk or reconstruction could serve.
    pub(crate) fn ticket_failed(&mut self, it: &GetItem, err: PagerError) {
        self.finished.push(Finished {
            tag: (it.pos & !TICKET) as u64,
            page: it.page,
            version: 0,
            data: Err(err),
        });
    }

    /// Sends the reads by ticket that failed on one copy to another (the others' retries are
    /// their waiting operation's).
    fn resubmit_ticket_retries(&mut self) {
        if !self.retry.iter().any(|it| is_ticket(it.pos)) {
            return;
        }
        let (mine, rest): (Vec<GetItem>, Vec<GetItem>) = std::mem::take(&mut self.retry)
            .into_iter()
            .partition(|it| is_ticket(it.pos));
        self.retry = mine;
        self.resubmit_retries();
        self.retry.extend(rest);
    }
}
