//! Direct migration (Nswap §III, Fig. 2, paper 004): a page leaves a shrinking server (C) for
//! another (B) without passing through its owner. The owner (this pager) sends keys only:
//!
//! 1. EXPECT to B: which pages, at which versions, C will hand over (B takes nothing else into
//!    our session: sessions are bound to our certificate, `netram_store`'s `adopt.rs`);
//! 2. MIGRATE to C once B has answered: C hands the pages to B (ADOPT, server to server) and
//!    keeps its copies;
//! 3. MIGRATE's reply is Nswap's UPDATE: the table names B instead of C, and the copies on C
//!    are deleted (INVALIDATE, through [`Pager::set_location`]).
//!
//! Nswap settles races with migration counts; here the owner's table is the one writer of
//! where a page is, and a move takes effect only if, when C's answer arrives, the page is
//! still the version that moved, still on C by the table, not being written out, and B is
//! alive. Otherwise the copy B may have taken is deleted (unless B holds the page's current
//! version), and the page stays where the table says:
//!
//! * a page-out while the page moves gives it a new version, written elsewhere or to B (B
//!   never replaces a key it holds with a migrating copy: `Exists`);
//! * a discard meanwhile deletes the copies the table names (C's), then B's on C's answer;
//! * a page is in at most one move at a time (`handing`), and pages in write-back never start
//!   one;
//! * C dying midway fails its MIGRATE: B's copy, if any, is deleted, and C's pages are
//!   recovered like any dead server's; B dying fails the EXPECT or makes C's handover
//!   unreachable: the page stays on C.
//!
//! Only `none` and `mirror:N` move this way. Under `parity:N` and `rs:K+M` the groups and
//! stripes name their servers, so a page moves by being written again through its owner
//! (`migrate.rs`), which is also the way to the local disk when no server has room.

use crate::requests::Op;
use crate::table::Servers;
use crate::{Disk, Pager, Transport};
use netram_policy::placement::{self, Candidate};
use netram_proto::{MoveStatus, Request, MAX_BATCH};

/// Pages per MIGRATE. The old server hands them over before it answers anything else of
/// ours, so a read of a page there waits for at most one such handover.
const MIGRATE_CHUNK: usize = 16;

/// Pages on their way from one server to another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hand {
    pub(crate) from: usize,
    pub(crate) to: usize,
    /// Each page with the version that moves.
    pub(crate) pages: Vec<(u64, u32)>,
}

impl<T: Transport, D: Disk> Pager<T, D> {
    /// Pages in a direct move now.
    pub fn pages_in_handover(&self) -> usize {
        self.handing.len()
    }

    /// Pages in a direct move off `server`.
    pub(crate) fn handing_from(&self, server: usize) -> usize {
        self.handing.values().filter(|&&s| s == server).count()
    }

    /// Whether pages leave a shrinking server straight for another (under `none` and
    /// `mirror:N`), or through this pager (what a benchmark compares).
    pub fn set_direct_migration(&mut self, on: bool) {
        self.cfg.direct_migration = on;
    }

    /// Whether pages of this scheme move server to server.
    pub(crate) fn moves_directly(&self) -> bool {
        self.shape.whole_copies && self.cfg.direct_migration
    }

    /// Starts moving `pages` (on `from`, none in write-back or in a move) straight to another
    /// server; returns them all when no server can take any, for the owner to move itself
    /// (to its disk, most likely). Those the target cannot take now wait for the next step.
    pub(crate) fn hand_over(&mut self, from: usize, pages: Vec<u64>) -> Vec<u64> {
        // A page short of copies is the owner's to move: it writes every copy anew (and its
        // one copy must not go to the server whose failure made it short: that server failing
        // again would lose it).
        let (short, pages): (Vec<u64>, Vec<u64>) =
            pages.into_iter().partition(|&p| self.in_recovery(p));
        if pages.is_empty() {
            return short;
        }
        // One target for the batch: alive, with room and an address. A page with a copy
        // there (mirror:N keeps copies on distinct servers) waits for another target.
        let mut exclude = vec![from];
        exclude.extend((0..self.servers.len()).filter(|&s| {
            self.servers[s].info.addr.is_none()
                || !self.servers[s].alive
                || self.no_direct.contains(&(from, s))
        }));
        let candidates: Vec<Candidate> = self.servers.iter().map(|s| s.load).collect();
        let (to, go) = loop {
            let Some(to) = placement::choose(&candidates, &exclude, &mut self.rng) else {
                return pages.into_iter().chain(short).collect();
            };
            let room = self.servers[to].load.free_pages as usize;
            let go: Vec<(u64, u32)> = pages
                .iter()
                .filter(|&&p| !self.table.holders(p).contains(to))
                // One EXPECT: a server refuses (and drops the connection of) a longer batch.
                .take(room.min(MAX_BATCH))
                .map(|&p| (p, self.table.get(p).version))
                .collect();
            if !go.is_empty() {
                break (to, go);
            }
            exclude.push(to);
        };
        // Counted against its room now, so that the next batch looks elsewhere sooner.
        self.servers[to].load.free_pages -= go.len() as u64;
        for &(page, _) in &go {
            self.handing.insert(page, from);
        }
        self.counters.migrations_started += go.len() as u64;
        let req = Request::Expect {
            from_node: self.servers[from].info.node,
            pages: go.iter().map(|&(p, v)| (self.key(p), v)).collect(),
        };
        let hand = Hand {
            from,
            to,
            pages: go,
        };
        self.submit(to, Op::Expect(Box::new(hand)), &req);
        short
    }

    /// Whether a move of `page` at `version` from `from` to `to` may still take effect: that
    /// version, on `from` by the table and not on `to` (recovery may have put a copy there
    /// meanwhile: moving onto it would leave one copy fewer), not being written out, and not
    /// short of copies (found so meanwhile: recovery or the owner moves it).
    fn still_moving(&self, page: u64, version: u32, from: usize, to: usize) -> bool {
        let e = self.table.get(page);
        let holders = self.table.holders(page);
        e.present
            && !e.lost
            && e.version == version
            && holders.contains(from)
            && !holders.contains(to)
            && !self.writeback.contains_key(&page)
            && !self.in_recovery(page)
    }

    /// B answered the EXPECT: what it expects goes to C as a MIGRATE; the rest stays.
    pub(crate) fn expected(&mut self, hand: Hand, status: Vec<MoveStatus>) {
        let Hand { from, to, pages } = hand;
        let mut go = Vec::new();
        for (&(page, version), s) in pages.iter().zip(&status) {
            if *s == MoveStatus::Done && self.still_moving(page, version, from, to) {
                go.push((page, version));
            } else {
                if *s == MoveStatus::Full {
                    self.servers[to].load.free_pages = 0;
                }
                self.handing.remove(&page);
                self.counters.migrations_refused += 1;
            }
        }
        let (Some(to_addr), true, true) = (
            self.servers[to].info.addr,
            self.servers[from].alive,
            self.servers[to].alive,
        ) else {
            for (page, _) in go {
                self.handing.remove(&page);
                self.counters.migrations_refused += 1;
            }
            return;
        };
        if go.is_empty() {
            return;
        }
        // In small MIGRATEs: the old server serves our reads between them, not after a
        // whole batch's handover.
        for chunk in go.chunks(MIGRATE_CHUNK) {
            let req = Request::Migrate {
                to: to_addr,
                to_node: self.servers[to].info.node,
                keys: chunk.iter().map(|&(p, _)| self.key(p)).collect(),
            };
            let hand = Hand {
                from,
                to,
                pages: chunk.to_vec(),
            };
            self.submit(from, Op::Migrate(Box::new(hand)), &req);
        }
    }

    /// C answered the MIGRATE (Nswap's UPDATE): each page B took moves in the table, and C's
    /// copy is deleted; a page that changed meanwhile stays, and B's copy goes.
    pub(crate) fn migrated(&mut self, hand: Hand, status: &[MoveStatus]) {
        let Hand { from, to, pages } = hand;
        for (i, &(page, version)) in pages.iter().enumerate() {
            self.handing.remove(&page);
            let s = status.get(i).copied().unwrap_or(MoveStatus::Unreachable);
            if s == MoveStatus::Done
                && self.servers[to].alive
                && self.still_moving(page, version, from, to)
            {
                let mut holders: Servers = self.table.holders(page);
                holders.remove(from);
                holders.insert(to);
                self.set_location(page, holders);
                self.counters.pages_migrated += 1;
                self.counters.pages_migrated_direct += 1;
                continue;
            }
            // Not moved: refused, or the page changed meanwhile (it is moved again if it
            // still has to leave).
            self.counters.migrations_refused += 1;
            if s == MoveStatus::Unreachable && self.servers[to].alive {
                // C would not reach B, though we do (C does not count B a member of its
                // cluster, or cannot get through): asking again would loop, so the pages go
                // through us. Transient views of membership cost a detour, not a livelock.
                self.no_direct.insert((from, to));
            }
            if s == MoveStatus::Full {
                // Full, or this client at its quota there: placed elsewhere until B's next
                // answer says otherwise.
                self.servers[to].load.free_pages = 0;
            }
            // Whatever C said: B may hold a copy the table does not name (C's answer may be
            // lost, wrong, or a lie), and a DELETE of a key B lacks costs nothing.
            self.drop_adopted(page, to);
        }
    }

    /// A MIGRATE or EXPECT that will get no answer (its server died).
    pub(crate) fn handover_failed(&mut self, hand: Hand, migrate: bool) {
        for &(page, _) in &hand.pages {
            self.handing.remove(&page);
            self.counters.migrations_refused += 1;
            if migrate {
                // C may have handed it over before it died.
                self.drop_adopted(page, hand.to);
            }
        }
    }

    /// Deletes the copy B may have taken of `page`, unless B holds (or is being sent) the
    /// page's current version under the same key.
    fn drop_adopted(&mut self, page: u64, to: usize) {
        if !self.servers[to].alive || self.table.holders(page).contains(to) {
            return;
        }
        if let Some(wb) = self.writeback.get(&page) {
            if wb.pending.contains(to) || wb.done.contains(to) {
                return;
            }
        }
        self.counters.deletes += 1;
        self.delete(to, vec![self.key(page)]);
    }
}
