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
//!   the stripe freed when its last member leaves): redundancy follows the page.
//!
//! A server with pages leaving takes no new page ([`netram_store::Store::room`] is zero, so
//! placement passes it by); a page being moved is kept off it even where it would otherwise
//! stay in place (its write-back starts with that server among those that refused it).

use crate::requests::{Op, MIGRATE};
use crate::scheme::Redundancy;
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
    /// Pages on their way after it (read, or being written), at most the step's `max_pages`.
    pub in_flight: usize,
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
    /// and the last step did not find that it holds none we can move.
    pub fn migration_due(&self) -> bool {
        self.servers
            .iter()
            .any(|s| s.alive && s.leaving > 0 && s.leaving != s.leaving_stuck)
    }

    /// Pages of ours on their way off server `s`: read and not yet written, being written, or
    /// whose old copy's deletion is on its way to it. Its `leaving` count includes them
    /// until the deletion arrives.
    fn moving_off(&self, s: usize) -> usize {
        let deletes = self
            .requests()
            .filter(|(to, op, _)| *to == s && matches!(op, Op::Delete | Op::Gc(_)))
            .count();
        self.migrate_reads.values().filter(|r| r.0 == s).count()
            + self.migrating.values().filter(|&&from| from == s).count()
            + deletes
    }

    /// One step of migration, which never waits: the pages read since the last step start
    /// their moves (to other servers, or the disk), and more pages are asked of servers that
    /// want them gone, so that at most `max_pages` are on their way at once (and half the
    /// free slots). Replies come back with the next step's poll or with whatever the program
    /// does meanwhile. A program's own operation waits for what is in flight, so `max_pages`
    /// bounds what a migration adds to its latency (the caller sets the pace,
    /// [`Pager::on_tick`]).
    pub fn migrate(&mut self, max_pages: usize) -> Result<MigrationStep, PagerError> {
        let mut step = MigrationStep {
            leaving: self.pages_leaving(),
            ..MigrationStep::default()
        };
        // Reads that failed on one copy go to another; finished ones come out.
        self.resubmit_retries();
        self.copy_out_reads(&mut [])?;
        let mut last = None;
        for (page, slot) in std::mem::take(&mut self.migrate_fetched) {
            let Some((leaving, version)) = self.migrate_reads.remove(&page) else {
                self.release_slot(slot);
                continue;
            };
            let e = *self.table.get(page);
            if !e.present
                || e.lost
                || e.version != version
                || self.writeback.contains_key(&page)
                || self.rehomed.contains(&page)
            {
                // Written, discarded or lost since it was read: this copy is not the page.
                self.release_slot(slot);
                continue;
            }
            step.started += 1;
            self.counters.migrations_started += 1;
            self.migrating.insert(page, leaving);
            last = Some(page);
            match self.scheme {
                Redundancy::Copies(_) => self.move_copy(page, slot, leaving)?,
                // Written again: the page leaves its group or stripe and joins a new one
                // away from the leaving server.
                Redundancy::Parity(_) | Redundancy::Stripe(_) => {
                    self.write_back_avoiding(page, slot, Some(leaving))?
                }
            }
        }
        // Pages written again wait in an open group or stripe for more members, which may not
        // come: what they joined goes now, full or not.
        if let Some(page) = last {
            match self.scheme {
                Redundancy::Parity(_) => self.seal_open(None)?,
                Redundancy::Stripe(_) => self.seal_open(Some(page))?,
                Redundancy::Copies(_) => {}
            }
        }
        // Each page holds a slot from its read to its last acknowledgement; the program keeps
        // half of them.
        let mut budget = max_pages
            .saturating_sub(self.migrate_reads.len() + self.migrating.len())
            .min(self.free_slots.len() / 2);
        for s in 0..self.servers.len() {
            let st = &self.servers[s];
            if !st.alive || st.leaving == 0 || st.leaving == st.leaving_stuck || budget == 0 {
                continue;
            }
            let want = (st.leaving as usize)
                .saturating_sub(self.moving_off(s))
                .min(budget);
            if want == 0 {
                continue;
            }
            let (pages, held) = self.leaving_pages(s, want);
            if pages.is_empty() && self.moving_off(s) == 0 {
                self.servers[s].leaving_stuck = self.servers[s].leaving;
                if !held {
                    tracing::debug!(
                        server = s,
                        leaving = self.servers[s].leaving,
                        "a server wants pages moved that are not ours to move (parity pages)"
                    );
                }
            }
            for page in pages {
                let Some(slot) = self.free_slots.pop() else {
                    break;
                };
                budget -= 1;
                let version = self.table.get(page).version;
                self.migrate_reads.insert(page, (s, version));
                // Read from another copy where there is one: the leaving server has work
                // enough.
                match self
                    .alive_holder(page, Some(s))
                    .or_else(|| self.alive_holder(page, None))
                {
                    Some(from) => {
                        let it = self.page_get_item(page, slot, MIGRATE);
                        self.queue_get(from, it);
                    }
                    None if self.table.get(page).on_disk => {
                        // A striped page whose own piece is out of reach, backed by the disk
                        // while its stripe is short: the disk has it in clear.
                        let at = slot as usize * netram_proto::PAGE_SIZE;
                        self.counters.disk_reads += 1;
                        self.disk
                            .read(page, &mut self.slots[at..at + netram_proto::PAGE_SIZE])?;
                        self.migrate_fetched.push((page, slot));
                    }
                    None => {
                        self.migrate_reads.remove(&page);
                        self.release_slot(slot);
                    }
                }
            }
        }
        self.pump_all();
        step.in_flight = self.migrate_reads.len() + self.migrating.len();
        Ok(step)
    }

    /// Whether a migration's read asked for what is no longer the page: it was written (or
    /// discarded, or is being written) since the read was sent.
    pub(crate) fn migrate_read_stale(&self, it: &crate::requests::GetItem) -> bool {
        let e = self.table.get(it.page);
        !e.present
            || e.version != it.version
            || self.writeback.contains_key(&it.page)
            || self.rehomed.contains(&it.page)
    }

    /// A write-back ended: if it moved a page, the move is done (to the disk alone when
    /// `on_disk_only`).
    pub(crate) fn landed(&mut self, page: u64, on_disk_only: bool) {
        if self.migrating.remove(&page).is_some() {
            self.counters.pages_migrated += 1;
            if on_disk_only {
                self.counters.pages_migrated_to_disk += 1;
            }
        }
    }

    /// Up to `want` pages of ours whose moving frees a frame on `server`: pages with a copy
    /// there (under Reed-Solomon, the live members of stripes with a piece there), not in
    /// write-back (a write-back places its page anew, away from a leaving server); and
    /// whether we have anything there at all, in write-back or not. A cursor keeps a long
    /// migration from scanning the table from the start each step.
    fn leaving_pages(&mut self, server: usize, want: usize) -> (Vec<u64>, bool) {
        let mut out = Vec::new();
        if let Some(rs) = self.scheme.stripe() {
            let members = rs.members_with_piece_on(server, want);
            let held = !members.is_empty();
            for (page, _) in members {
                // A member whose data piece is out of reach is read from the disk if the disk
                // backs it, else left to recovery to rebuild first.
                if !self.writeback.contains_key(&page)
                    && !self.rehomed.contains(&page)
                    && !self.migrate_reads.contains_key(&page)
                    && !out.contains(&page)
                    && (self.alive_holder(page, None).is_some() || self.table.get(page).on_disk)
                {
                    out.push(page);
                }
                if out.len() >= want {
                    break;
                }
            }
            return (out, held);
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
            if e.present
                && !e.lost
                && self.table.holders(p).contains(server)
                && !self.writeback.contains_key(&p)
                && !self.rehomed.contains(&p)
                && !self.migrate_reads.contains_key(&p)
            {
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
