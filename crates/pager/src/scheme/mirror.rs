//! Whole copies (`none`: one, `mirror:N`: N on N different servers; Reliable Nswap §IV-A,
//! paper 004): where copies go, what a failed copy or a bad one does, and recovery, which reads
//! a surviving copy and writes the missing ones (§IV-B3).

use crate::requests::{GetItem, PutItem, PutKind, INTERNAL};
use crate::scheme::{delete_copies, Built, RecoveryStep, Redundancy, SchemeState, Shape};
use crate::table::Servers;
use crate::writeback::Writeback;
use crate::{Disk, Op, Pager, PagerConfig, PagerError, Transport};
use netram_policy::placement::{self, Candidate};
use netram_proto::{PageKey, Request};
use std::collections::{BTreeMap, BTreeSet};

/// Whole copies' state: how many each page gets, and recovery's lists.
#[derive(Debug)]
pub(crate) struct Copies {
    /// Copies per page: 1 under `none`, N under `mirror:N`.
    pub(crate) n: usize,
    /// Pages with fewer copies than `n` (a server died, a copy was bad): recovery's list.
    degraded: BTreeSet<u64>,
    /// Pages taken off `degraded` whose surviving copy is being read, with the version read.
    rebuilding: BTreeMap<u64, u32>,
    /// Pages recovery could not give every copy (no server with room) and that the local disk
    /// backs meanwhile: tried again when a server comes back.
    short: BTreeSet<u64>,
}

impl Copies {
    pub(crate) fn new(n: usize) -> Self {
        Self {
            n,
            degraded: BTreeSet::new(),
            rebuilding: BTreeMap::new(),
            short: BTreeSet::new(),
        }
    }

    /// Pages recovery still has to look at, and those whose read for it is out.
    pub(crate) fn pending(&self) -> usize {
        self.degraded.len() + self.rebuilding.len()
    }

    /// Pages recovery could not give every copy, backed by the local disk meanwhile.
    pub(crate) fn short(&self) -> usize {
        self.short.len()
    }

    /// Pages whose surviving copy is being read for recovery.
    pub(crate) fn rebuilding(&self) -> usize {
        self.rebuilding.len()
    }

    /// Whether recovery has `page` on a list: degraded, being rebuilt, or short of copies.
    pub(crate) fn has(&self, page: u64) -> bool {
        self.degraded.contains(&page)
            || self.rebuilding.contains_key(&page)
            || self.short.contains(&page)
    }

    /// Whether recovery's read of `page` is out.
    pub(crate) fn reading(&self, page: u64) -> bool {
        self.rebuilding.contains_key(&page)
    }

    /// A page gone (discarded): off every list.
    pub(crate) fn forget(&mut self, page: u64) {
        self.degraded.remove(&page);
        self.short.remove(&page);
    }

    /// Pages on recovery's lists, for the invariants.
    pub(crate) fn listed(&self) -> impl Iterator<Item = u64> + '_ {
        self.degraded.iter().chain(&self.short).copied()
    }

    /// A write-back settled with `holders` copies: what recovery still owes the page
    /// (`finish_writeback`'s cases, see [`Landed`]).
    pub(crate) fn landed(&mut self, page: u64, landed: Landed) {
        match landed {
            Landed::Enough | Landed::InMemory | Landed::OnDiskOnly => self.forget(page),
            Landed::Short { rebuilt: true } => {
                self.degraded.remove(&page);
                self.short.insert(page);
            }
            Landed::Short { rebuilt: false } => {
                self.degraded.insert(page);
            }
        }
    }
}

/// How a write-back of whole copies ended, for recovery's lists ([`Copies::landed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Landed {
    /// Every copy found a server.
    Enough,
    /// Too few copies and no disk to make up for them: the page stays in memory until it is
    /// written again.
    InMemory,
    /// No copy on any server: the local disk alone holds it.
    OnDiskOnly,
    /// Some copies, fewer than wanted, the local disk backing the rest. `rebuilt`: recovery's
    /// own rebuild with no server revived since it began (short until a server comes back);
    /// otherwise degraded, for recovery to try again.
    Short { rebuilt: bool },
}

/// The scheme of whole copies (its state: [`Copies`]).
pub(crate) struct Mirror;

/// `none` (`copies` 1) or `mirror:N`.
pub(crate) fn build<T: Transport, D: Disk>(cfg: &PagerConfig, copies: usize) -> Built<T, D> {
    Built {
        scheme: &Mirror,
        state: SchemeState::new(Copies::new(copies)),
        shape: Shape {
            copies,
            seal_slots: 0,
            // Waves of copies need few slots at a time.
            recovery_slots: cfg.recovery_slots.min(512),
            whole_copies: true,
        },
    }
}

impl<T: Transport, D: Disk> Redundancy<T, D> for Mirror {
    fn written_back(&self, p: &mut Pager<T, D>, page: u64) -> Result<(), PagerError> {
        p.place_copies(page)
    }
    fn place(&self, p: &mut Pager<T, D>, page: u64) -> Result<(), PagerError> {
        p.place_copies(page)
    }
    fn stored(&self, p: &mut Pager<T, D>, it: PutItem, server: usize) -> Result<(), PagerError> {
        p.copy_stored(it, server)
    }
    fn put_failed(
        &self,
        p: &mut Pager<T, D>,
        it: PutItem,
        server: usize,
    ) -> Result<(), PagerError> {
        p.copy_failed(it.page, server)
    }
    fn landed(&self, p: &mut Pager<T, D>, page: u64, landed: Landed) {
        p.cp_mut().landed(page, landed);
    }
    fn get_failed(
        &self,
        p: &mut Pager<T, D>,
        server: usize,
        it: GetItem,
        what: Option<&'static str>,
    ) {
        p.copy_get_failed(server, it, what);
    }
    fn discarded(&self, p: &mut Pager<T, D>, page: u64, deletes: &mut [Vec<PageKey>]) {
        p.cp_mut().forget(page);
        delete_copies(p, page, deletes);
    }
    fn server_failed_over(&self, p: &mut Pager<T, D>, server: usize) {
        p.copies_server_dead(server);
    }
    fn server_revived(&self, p: &mut Pager<T, D>, server: usize) {
        p.copies_server_revived(server);
    }
    fn recover(&self, p: &mut Pager<T, D>, max_pages: usize) -> Result<RecoveryStep, PagerError> {
        p.copies_recover(max_pages)
    }
    fn degraded_pages(&self, p: &Pager<T, D>) -> usize {
        p.cp().pending()
    }
    fn pages_short_of_copies(&self, p: &Pager<T, D>) -> usize {
        p.cp().short()
    }
    fn rebuilding_pages(&self, p: &Pager<T, D>) -> usize {
        p.cp().rebuilding()
    }
    fn in_recovery(&self, p: &Pager<T, D>, page: u64) -> bool {
        p.cp().has(page)
    }
    fn recovery_reading(&self, p: &Pager<T, D>, page: u64) -> bool {
        p.cp().reading(page)
    }
    fn own_reads_out(&self, p: &Pager<T, D>) -> bool {
        p.cp().rebuilding() > 0
    }
    fn own_reads_in(&self, p: &mut Pager<T, D>) -> Result<(), PagerError> {
        p.rebuild_read_pages(&mut RecoveryStep::default())
    }
}

impl<T: Transport, D: Disk> Pager<T, D> {
    fn cp(&self) -> &Copies {
        self.state().expect("a pager of whole copies")
    }
    fn cp_mut(&mut self) -> &mut Copies {
        self.state_mut().expect("a pager of whole copies")
    }

    /// Sends the copies a page in write-back still lacks, each to a live server that holds no
    /// other copy of it: its current holders first (an overwrite stays in place), then by
    /// placement. Settles the write-back when nothing is left in flight.
    pub(crate) fn place_copies(&mut self, page: u64) -> Result<(), PagerError> {
        let mut wb = *self.writebacks().get(&page).expect("page in write-back");
        let busy = |wb: &Writeback, s: usize| {
            wb.done.contains(s)
                || wb.pending.contains(s)
                || wb.refused.contains(s)
                || wb.keep.contains(s)
        };
        let need = self
            .cp()
            .n
            .saturating_sub(wb.done.len() + wb.pending.len() + wb.keep.len());
        let mut full = Vec::new();
        for _ in 0..need {
            let holder = self
                .table()
                .holders(page)
                .iter()
                .find(|&s| self.server_states()[s].alive && !busy(&wb, s));
            let target = holder.or_else(|| {
                let candidates: Vec<Candidate> =
                    self.server_states().iter().map(|s| s.load).collect();
                let exclude: Vec<usize> = (0..self.server_states().len())
                    .filter(|&s| busy(&wb, s))
                    .collect();
                placement::choose(&candidates, &exclude, self.rng())
            });
            let Some(server) = target else { break };
            wb.pending.insert(server);
            self.counters_mut().puts += 1;
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
        self.writebacks_mut().insert(page, wb);
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
        debug_assert_eq!(self.table().get(it.page).version, it.version);
        if let Some(wb) = self.writebacks_mut().get_mut(&it.page) {
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
        let mut holders = self.table().holders(it.page);
        // A GET of a version written over since (recovery's read, out while the page was
        // written again) says nothing of the copies the table names now: the new version's,
        // which a delete here would take away.
        let current = it.version == self.table().get(it.page).version;
        if !current && it.pos == INTERNAL {
            // No copy of that version is left to read: the next step of recovery (or of
            // migration) sees the page changed and leaves it to what changed it.
            self.own_read_failed(it.page);
            return self.release_slot(it.slot);
        }
        if !current {
            // A caller's read out while its page was written again (a read by ticket restarts
            // before it gets here, see `get_failed`; a waiting read cannot be overtaken): an
            // error, rather than old data or a hunt through copies that all hold the new
            // version.
            return self.disk_copy_or_report(server, it, what);
        }
        let clean = self.config().backing == crate::Backing::ClusterDisk
            && self.table().get(it.page).on_disk;
        if what == Some("missing on server") && clean && holders.contains(server) {
            // A clean copy the server dropped for another page (GMS; `requests.rs` sends
            // them): the disk has the page, and a copy rebuilt would only take another's
            // frame. Forgotten, so that the next read goes to a copy that is there.
            self.counters_mut().clean_copies_dropped += 1;
            holders.remove(server);
            self.table_mut().set_holders(it.page, holders);
            if let Some(wb) = self.writebacks_mut().get_mut(&it.page) {
                if wb.version == it.version {
                    wb.keep.remove(server);
                }
            }
            return self.read_elsewhere(server, it, what);
        }
        if let Some(what) = what {
            if holders.len() > 1 && holders.contains(server) {
                tracing::warn!(server, page = it.page, what, "dropping a bad copy");
                self.counters_mut().copies_dropped_bad += 1;
                holders.remove(server);
                self.table_mut().set_holders(it.page, holders);
                self.cp_mut().degraded.insert(it.page);
                // A rebuild out for this version counts that copy no more.
                if let Some(wb) = self.writebacks_mut().get_mut(&it.page) {
                    if wb.version == it.version {
                        wb.keep.remove(server);
                    }
                }
                if what != "missing on server" && self.server_states()[server].alive {
                    self.counters_mut().deletes += 1;
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
        if self.cp().n > 1 {
            let pages = self.table().pages_on(server);
            self.cp_mut().degraded.extend(pages);
        }
    }

    /// A server back from the dead is empty: its copies are gone. A page with another copy is
    /// degraded (recovery makes a new one); a page whose only copy it held is lost.
    pub(crate) fn copies_server_revived(&mut self, server: usize) {
        // Nor do copies it held or acknowledged for write-backs still out.
        for wb in self.writebacks_mut().values_mut() {
            wb.keep.remove(server);
            wb.done.remove(server);
        }
        for page in self.table().pages_on(server) {
            let mut holders = self.table().holders(page);
            if holders.len() > 1 {
                holders.remove(server);
                self.table_mut().set_holders(page, holders);
                self.cp_mut().degraded.insert(page);
            } else {
                self.table_mut().get_mut(page).lost = true;
            }
        }
        // Room again, perhaps: what lacked copies for want of servers tries again.
        let c = self.cp_mut();
        let short = std::mem::take(&mut c.short);
        c.degraded.extend(short);
    }

    /// One step of recovery, which never waits: the degraded pages whose surviving copy has
    /// been read since the last step get their missing copies written (not waited for either;
    /// a read of such a page meanwhile is served from memory), and up to `max_pages` more are
    /// read from a surviving copy (pipelined; taken in by whatever reads replies next, and
    /// written out at the next step, or at once if they are in before this one ends).
    pub(crate) fn copies_recover(&mut self, max_pages: usize) -> Result<RecoveryStep, PagerError> {
        let mut step = RecoveryStep::default();
        self.poll()?;
        self.resubmit_retries();
        self.take_internal_reads();
        self.rebuild_read_pages(&mut step)?;
        // Each page holds a slot from its read to its last acknowledgement: stay well inside
        // the staging slots.
        let staging = (self.free_slot_count() / 2).saturating_sub(self.cp().rebuilding.len());
        let mut batch: Vec<(u64, Servers)> = Vec::new();
        let mut later = Vec::new();
        while batch.len() < max_pages.min(staging) {
            let Some(page) = self.cp_mut().degraded.pop_first() else {
                break;
            };
            let e = *self.table().get(page);
            if !e.present || e.lost || self.writebacks().contains_key(&page) {
                // Discarded, lost, or being written: a write-back places every copy anew
                // and puts the page back on the list if it falls short.
                continue;
            }
            if self.cp().rebuilding.contains_key(&page) {
                // Its read is out: the copies it lacks are counted when it is in.
                continue;
            }
            if self.moving(page) {
                // Being moved: the move writes every copy it lacks; looked at again after.
                later.push(page);
                continue;
            }
            let holders = self.table().holders(page);
            let alive: Servers = holders
                .iter()
                .filter(|&s| self.server_states()[s].alive)
                .collect();
            if alive.len() >= self.cp().n {
                if alive.len() < holders.len() {
                    self.table_mut().set_holders(page, alive);
                }
                continue;
            }
            if alive.is_empty() && !e.on_disk {
                step.unrecoverable += 1;
                self.counters_mut().pages_unrecoverable += 1;
                self.table_mut().get_mut(page).lost = true;
                continue;
            }
            batch.push((page, alive));
        }
        self.cp_mut().degraded.extend(later);
        // Read every page of the batch from a surviving copy (or the disk copy).
        for &(page, alive) in &batch {
            let slot = self.take_slot()?;
            let it = self.page_get_item(page, slot, INTERNAL);
            self.cp_mut().rebuilding.insert(page, it.version);
            match alive.first() {
                // Queued, never waited for: a full window sends it later.
                Some(s) => self.queue_get(s, it),
                None => {
                    self.read_disk_into(page, slot)?;
                    self.fetched_push(page, slot);
                }
            }
        }
        self.pump_all();
        // Whatever has answered already (a local disk's copy, a fast server) goes on now.
        self.poll()?;
        self.take_internal_reads();
        self.rebuild_read_pages(&mut step)?;
        step.remaining = self.cp().pending();
        Ok(step)
    }

    /// Writes the missing copies of the pages whose recovery read is in (`fetched`), unless
    /// the page changed meanwhile (written: its write-back places every copy; discarded; or
    /// lost); a read that failed on every copy puts its page back on the list if a copy is
    /// left to read, else the page is lost.
    fn rebuild_read_pages(&mut self, step: &mut RecoveryStep) -> Result<(), PagerError> {
        let failed = self.take_own_failed(|p, page| p.cp().reading(page));
        for page in failed {
            if self.cp_mut().rebuilding.remove(&page).is_none() {
                continue;
            }
            let e = *self.table().get(page);
            if !e.present || e.lost || self.writebacks().contains_key(&page) {
                continue;
            }
            if self.alive_holder(page, None).is_some() || e.on_disk {
                // A read that failed on the way (a bad checksum in transit): again later.
                self.cp_mut().degraded.insert(page);
            } else {
                // Every copy failed while being read: gone.
                step.unrecoverable += 1;
                self.counters_mut().pages_unrecoverable += 1;
                self.table_mut().get_mut(page).lost = true;
            }
        }
        let read = self.take_fetched(|p, page, _| p.cp().reading(page));
        for (page, slot) in read {
            let version = self
                .cp_mut()
                .rebuilding
                .remove(&page)
                .expect("partitioned on it");
            let e = *self.table().get(page);
            if !e.present || e.lost || e.version != version || self.writebacks().contains_key(&page)
            {
                // Changed while it was read: whatever changed it placed its copies, or
                // needs none.
                self.release_slot(slot);
                continue;
            }
            let keep: Servers = self
                .table()
                .holders(page)
                .iter()
                .filter(|&s| self.server_states()[s].alive)
                .collect();
            if keep.len() >= self.cp().n {
                self.release_slot(slot);
                continue;
            }
            let revivals = self.counters().servers_revived;
            self.begin_writeback(
                page,
                Writeback {
                    keep,
                    rebuild: true,
                    revivals,
                    ..Writeback::new(slot, e.version)
                },
            );
            step.started += 1;
            self.place_copies(page)?;
        }
        Ok(())
    }
}
