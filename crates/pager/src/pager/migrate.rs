//! Migration (Nswap §III, Fig. 2, paper 004): a server whose offer shrank below the pages it
//! holds tells each owner, on every reply, how many of its pages must leave
//! ([`netram_proto::Load::leaving`]); the owner moves that many elsewhere, and to its local disk
//! when no server has room (Markatos, paper 003 §2). The server itself moves what it can into
//! the frames still free below its offer (`netram_store::Store::compact`); what the owners move
//! away frees the rest.
//!
//! Nswap moves a page server to server (MIGRATE from C to B, UPDATE from B to the owner A,
//! INVALIDATE from A to C). Here the owner drives every step, because only the owner may
//! place its pages: sessions are bound to the owner's certificate ("Trust nobody on the
//! wire"), so B would have no way to know that a page C hands it is A's. The page travels
//! C → A → B, and the races Nswap settles with its migration counts are settled by the
//! owner's page table, the one writer of where a page is:
//!
//! * under `none` and `mirror:N` a page keeps its version: it is read from the leaving server
//!   (C), written to a server that holds no copy of it (B), and the copy on C is deleted only
//!   once B has acknowledged (the same steps as recovery, `scheme/mirror.rs`); a read
//!   meanwhile is served from the slot or from C, a write of the page waits for the move to
//!   end (one write-back per page), a discard deletes whatever copies the table names then;
//! * under `parity:N` and `rs:K+M` a page is written again as a new version, so that it joins
//!   a new group or stripe away from C and its old one is left the usual way (the holder told,
//!   the stripe freed when its last member leaves): redundancy follows the page;
//! * under `parity:N` a server may hold nothing of ours but groups' parity, which only it
//!   can name: it is asked which groups it holds above its offer
//!   (`Pager::par_release_holder`), and their members are written again where they are,
//!   into new groups; the emptied groups leave it.
//!
//! A step never waits for the pages it moves: it sends their reads and returns, and a later
//! step writes the pages whose reads are in, once their version is checked unchanged
//! (`Pager::move_read_pages`); a leaving parity holder's scan too: its answer is taken at a
//! later step (`Pager::par_release_holder`).
//!
//! A server with pages leaving takes no new page ([`netram_store::Store::room`] is zero, so
//! placement passes it by); a page being moved is kept off it even where it would otherwise
//! stay in place (its write-back starts with that server among those that refused it).

use crate::requests::INTERNAL;
use crate::table::Servers;
use crate::writeback::Writeback;
use crate::{Disk, Pager, PagerError, Transport};

/// What one call to [`Pager::migrate`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MigrationStep {
    /// Pages whose move started (they count as migrated once their new home acknowledged).
    pub started: usize,
    /// Pages the servers still ask us to move, before this step.
    pub leaving: u64,
}

impl<T: Transport, D: Disk> Pager<T, D> {
    /// Pages of ours that live servers want moved away (what their last replies said).
    pub fn pages_leaving(&self) -> u64 {
        self.servers
            .iter()
            .filter(|s| s.alive)
            .map(|s| u64::from(s.leaving))
            .sum()
    }

    /// Whether a migration step has something to do: a live server wants pages of ours moved
    /// and the last step did not find that it holds none we can move; or reads for moves are
    /// out, whose pages the next step moves.
    pub fn migration_due(&self) -> bool {
        !self.moving.is_empty()
            || self
                .servers
                .iter()
                .any(|s| s.alive && s.leaving > 0 && s.leaving != s.leaving_stuck)
    }

    /// Starts moving up to `max_pages` pages off servers that asked for it: reads them
    /// (pipelined), then writes each where it may go, not waiting for the writes. The caller
    /// sets the pace ([`Pager::on_tick`]).
    pub fn migrate(&mut self, max_pages: usize) -> Result<MigrationStep, PagerError> {
        // Server to server (`handover.rs`): nothing to wait for, the replies drive each move;
        // pages in a move are not picked again, and its server's count still includes them.
        let direct = self.moves_directly();
        // Moves through this pager do not wait either (what no server could take in a direct
        // move goes that way too): a step sends the reads and returns; the next one writes
        // the pages that are in (`move_read_pages`). As with moves server to server, a
        // server's count may still include pages moved off it whose deletes it has not
        // answered yet: a step may then move a few more than it asks for. (Until 2026-11,
        // moves under parity and Reed-Solomon drained everything in flight first and waited
        // for their reads, under the region's lock; a leaving parity holder's scan,
        // `par_release_holder`, waited until 2026-11-29: its answer is now taken at a later
        // step.)
        let mut step = MigrationStep::default();
        self.poll()?;
        self.resubmit_retries();
        self.take_internal_reads();
        self.move_read_pages(&mut step)?;
        step.leaving = self.pages_leaving();
        // Each page the owner moves holds a slot from its read to its last acknowledgement;
        // a direct move holds none. At most a step's worth are under way, read or written
        // (twice that moved no faster on this 2-vCPU VM and cost the owner's reads more:
        // they queue behind the moves' requests on the same connections).
        let budget = if direct {
            max_pages.saturating_sub(self.handing.len())
        } else {
            let under_way = self.moving.len() + self.migrating.len();
            max_pages
                .saturating_sub(under_way)
                .min(self.free_slots.len() / 2)
        };
        let mut batch: Vec<(u64, usize)> = Vec::new();
        for s in 0..self.servers.len() {
            let st = &self.servers[s];
            if !st.alive || st.leaving == 0 || st.leaving == st.leaving_stuck {
                self.not_leaving(s);
                continue;
            }
            if batch.len() >= budget {
                break;
            }
            let leaving = (st.leaving as usize)
                .saturating_sub(self.handing_from(s))
                .saturating_sub(self.moving_from(s));
            let want = leaving.min(budget - batch.len());
            if want == 0 {
                continue;
            }
            let (mut pages, held) = self.leaving_pages(s, want);
            // Nothing to move there: unless pages there are only out of reach for now (in a
            // move, being written out), the rest is groups' parity (`parity:N`): their members
            // are sent to new groups (`par_release_holder`), and the server asked again once
            // they are. When it names none, what is left is not ours to move; looked at again
            // when the server's count changes, or at the next probe. (A page whose write-back
            // waits in an open parity group is not in flight: maintenance ships its group.)
            if pages.is_empty()
                && self.handing_from(s) == 0
                && self.moving_from(s) == 0
                && self.settled()
            {
                // `None`: its scan is out, or is to be sent again.
                let released = self.release_leaving(s, want);
                match released {
                    Some(p) if p.is_empty() => {
                        self.servers[s].leaving_stuck = self.servers[s].leaving;
                    }
                    Some(p) => pages = p,
                    // Not stuck while it waits for the answer, whatever the count meanwhile:
                    // a count back at its stuck value would leave the answer untaken.
                    None => self.servers[s].leaving_stuck = 0,
                }
            }
            if !held {
                tracing::debug!(
                    server = s,
                    leaving = self.servers[s].leaving,
                    "a server wants pages moved and holds none of ours but groups' parity"
                );
            }
            for page in pages {
                // A page with copies on two leaving servers moves once per step.
                if !batch.iter().any(|&(p, _)| p == page) {
                    batch.push((page, s));
                }
            }
        }
        if direct && !batch.is_empty() {
            let before = self.handing.len();
            let mut stay = Vec::new();
            for s in 0..self.servers.len() {
                let pages: Vec<u64> = batch
                    .iter()
                    .filter(|&&(_, from)| from == s)
                    .map(|&(p, _)| p)
                    .collect();
                // One EXPECT per frame's worth (a server refuses a longer batch).
                for chunk in pages.chunks(netram_proto::MAX_BATCH) {
                    stay.extend(
                        self.hand_over(s, chunk.to_vec())
                            .into_iter()
                            .map(|p| (p, s)),
                    );
                }
            }
            step.started += self.handing.len().saturating_sub(before);
            self.pump_all();
            // What no server could take, and pages short of copies, are moved by the owner
            // (to the local disk when the cluster is full), within the slots it has. Not while moves are
            // under way: their answers bring the servers' room up to date (this pager counts
            // what it sends against it), and the owner's moves would wait for them.
            if stay.is_empty() || !self.handing.is_empty() {
                return Ok(step);
            }
            stay.truncate((self.free_slots.len() / 2).saturating_sub(self.moving.len()));
            batch = stay;
        }
        if batch.is_empty() {
            return Ok(step);
        }
        for &(page, server) in &batch {
            let slot = self.take_slot()?;
            // Read from another copy where there is one: the leaving server has work enough.
            match self
                .alive_holder(page, Some(server))
                .or_else(|| self.alive_holder(page, None))
            {
                Some(from) => {
                    let it = self.page_get_item(page, slot, INTERNAL);
                    // Queued, never waited for: a full window sends it later.
                    self.moving.insert(page, (it.version, server, slot));
                    self.queue_get(from, it);
                }
                None if self.table.get(page).on_disk => {
                    // A striped page whose own piece is out of reach, backed by the disk
                    // while its stripe is short: the disk has it in clear.
                    self.moving
                        .insert(page, (self.table.get(page).version, server, slot));
                    let at = slot as usize * netram_proto::PAGE_SIZE;
                    self.counters.disk_reads += 1;
                    self.disk
                        .read(page, &mut self.slots[at..at + netram_proto::PAGE_SIZE])?;
                    self.fetched.push((page, slot));
                }
                // Its server died while slots were being found: recovery's now.
                None => self.release_slot(slot),
            }
        }
        self.pump_all();
        // Whatever has answered already (the local disk, a fast server) moves now.
        self.poll()?;
        self.take_internal_reads();
        self.move_read_pages(&mut step)?;
        Ok(step)
    }

    /// Pages whose read for a move through this pager is out, off `server`.
    fn moving_from(&self, server: usize) -> usize {
        self.moving
            .values()
            .filter(|&&(_, s, _)| s == server)
            .count()
    }

    /// Moves the pages whose read is in (`fetched`), unless the page changed meanwhile
    /// (written: its write-back places it anew; discarded; lost; or, as whole copies, no
    /// longer on the server it was to leave); a read that failed on every copy leaves its page where it is, for a
    /// later step to pick again.
    pub(crate) fn move_read_pages(&mut self, step: &mut MigrationStep) -> Result<(), PagerError> {
        let failed: Vec<u64>;
        (failed, self.own_failed) = std::mem::take(&mut self.own_failed)
            .into_iter()
            .partition(|p| self.moving.contains_key(p));
        for page in failed {
            self.moving.remove(&page);
        }
        let read: Vec<(u64, u32)>;
        (read, self.fetched) = std::mem::take(&mut self.fetched)
            .into_iter()
            .partition(|(page, slot)| self.moving.get(page).is_some_and(|m| m.2 == *slot));
        let copies = self.shape.whole_copies;
        for (page, slot) in read {
            if self.must_not_wait > 0 && self.free_slots.len() < self.shape.seal_slots {
                // Written again, it may seal a stripe, whose parity takes slots: with none
                // free that would wait for replies, which a tick must not. The read stays in
                // for a later step.
                self.fetched.push((page, slot));
                continue;
            }
            let (version, from, _) = self.moving.remove(&page).expect("partitioned on it");
            let e = *self.table.get(page);
            // Under parity or Reed-Solomon a page moves for anything of its group or stripe on
            // the leaving server, its own copy or not: only a new version (written,
            // discarded) ends its move.
            // A page whose write-back the disk failed meanwhile waits dirty in the cache for
            // its next one, which places it anew (`movable`).
            let still = e.present
                && !e.lost
                && e.version == version
                && !self.writeback.contains_key(&page)
                && !self.rehomed.contains(&page)
                && (!copies || self.table.holders(page).contains(from));
            if !still {
                self.release_slot(slot);
                continue;
            }
            step.started += 1;
            self.counters.migrations_started += 1;
            if copies {
                self.move_copy(page, slot, from)?;
            } else {
                // Written again: the page leaves its group or stripe and joins a new one away
                // from the leaving server; a member of a group whose parity is there
                // (`par_release_holder`) joins a new group where it is.
                self.migrating.insert(page);
                let member_only = !self.table.holders(page).contains(from);
                self.write_back_avoiding(page, slot, Some(from), member_only)?;
            }
        }
        Ok(())
    }

    /// A read of recovery's or of a move's failed on every copy: their next step sees it.
    pub(crate) fn own_read_failed(&mut self, page: u64) {
        if self.recovery_reading(page) || self.moving(page) {
            self.own_failed.push(page);
        }
    }

    /// Starts the copies of recovery's and moves' reads that are in, ahead of their next step
    /// (a slot is wanted and they hold some); whether there were any.
    pub(crate) fn start_own_reads(&mut self) -> Result<bool, PagerError> {
        if !self.scheme.own_reads_out(self) && self.moving.is_empty() {
            return Ok(false);
        }
        self.take_internal_reads();
        let before = self.free_slot_count();
        let ready = self
            .fetched
            .iter()
            .any(|&(p, _)| self.recovery_reading(p) || self.moving(p))
            || !self.own_failed.is_empty();
        if ready {
            let s = self.scheme;
            s.own_reads_in(self)?;
            self.move_read_pages(&mut MigrationStep::default())?;
        }
        Ok(ready && (self.free_slot_count() > before || !self.idle()))
    }

    /// A write-back ended: if it moved a page, the move is done (to the disk alone when
    /// `on_disk_only`).
    pub(crate) fn landed(&mut self, page: u64, on_disk_only: bool) {
        if self.migrating.remove(&page) {
            self.counters.pages_migrated += 1;
            if on_disk_only {
                self.counters.pages_migrated_to_disk += 1;
            }
        }
    }

    /// Whether a move of `page` may start: not in write-back (a write-back places its page
    /// anew, away from a leaving server), not waiting in the cache after a failed one, not
    /// in a move already (server to server, or its read out for one through this pager), not
    /// being rebuilt (recovery writes its copies anew).
    pub(crate) fn movable(&self, page: u64) -> bool {
        !self.writeback.contains_key(&page)
            && !self.rehomed.contains(&page)
            && !self.handing.contains_key(&page)
            && !self.recovery_reading(page)
            && !self.moving.contains_key(&page)
    }

    /// Up to `want` pages of ours whose moving frees a frame on `server`: pages with a copy
    /// there (under Reed-Solomon, the live members of stripes with a piece there), not in
    /// write-back (a write-back places its page anew, away from a leaving server); and
    /// whether we have anything there at all, in write-back or not. A cursor keeps a long
    /// migration from scanning the table from the start each step.
    fn leaving_pages(&mut self, server: usize, want: usize) -> (Vec<u64>, bool) {
        let mut out = Vec::new();
        if let Some(found) = self.scheme_leaving_pages(server, want) {
            // A scheme that keeps pages other than by the page table (stripes' pieces).
            return found;
        }
        let pages = self.cfg.pages;
        if pages == 0 {
            return (out, false);
        }
        let mut held = false;
        let start = self.migrate_cursor % pages;
        let mut p = start;
        loop {
            let e = self.table.get(p);
            if e.present && !e.lost && self.table.holders(p).contains(server) {
                held = true;
            }
            // A page the disk failed to take waits, dirty, in the cache for its next
            // write-back, which places it anew.
            if e.present && !e.lost && self.table.holders(p).contains(server) && self.movable(p) {
                out.push(p);
                if out.len() >= want {
                    p = (p + 1) % pages;
                    break;
                }
            }
            p = (p + 1) % pages;
            if p == start {
                break;
            }
        }
        self.migrate_cursor = p;
        (out, held)
    }

    /// Moves the copy of `page` on `from` (its data, this version, in `slot`) to a server that
    /// holds no copy; the copy on `from` is deleted once the new one is acknowledged
    /// (`finish_writeback`), or the page goes to the local disk when no server has room.
    fn move_copy(&mut self, page: u64, slot: u32, from: usize) -> Result<(), PagerError> {
        let e = *self.table.get(page);
        let keep: Servers = self
            .table
            .holders(page)
            .iter()
            .filter(|&s| s != from && self.servers[s].alive)
            .collect();
        let mut refused = Servers::default();
        refused.insert(from);
        self.migrating.insert(page);
        self.begin_writeback(
            page,
            Writeback {
                keep,
                refused,
                ..Writeback::new(slot, e.version)
            },
        );
        self.place_copies(page)
    }
}
