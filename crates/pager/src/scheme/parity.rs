//! Nswap's dynamic parity, the client's side (`parity:N`; paper 004 §IV-B and IV-C, with
//! Markatos' parity logging, paper 003 §2.1).
//!
//! A page written out for the first time (or to a new server) joins an *open group*: the pager
//! XORs its image into the group's in-progress parity page and sends it to a server that holds
//! no other member of the group, tagged with the group and the holder that will get its parity.
//! Once N members are acknowledged the parity page is shipped to the holder, and the pager
//! forgets the group: only the holder knows its members, only the member servers know their
//! holder. Until then the members' data stays in their write-back slots, so that a failure
//! before the ship costs nothing: the member is XORed out and placed again. A page overwritten
//! where it is stays in its group ([`PutOp::Keep`]): its server sends the holder the XOR of old
//! and new before it answers (Nswap Fig. 4). A flush, or a write-back that must finish, ships
//! a group early; holders merge small groups.
//!
//! When a server is lost, the pages the page table had there have no holder any more. Recovery
//! asks every live server what it holds for the dead one (PARITY_SCAN): groups with a member
//! there — rebuilt by XORing the parity with the survivors, read at the versions the holder
//! names, then taken out of their group with an [`Owner::SELF`] delta and written out again —
//! and pages whose holder it was (orphans), which join new groups. A degraded read runs the
//! same recovery until its page is back. A server being recovered takes no new pages, so that
//! what a scan reports about it is all old.

use crate::requests::{GetItem, Op, Part, PutItem, PutKind, INTERNAL};
use crate::scheme::RecoveryStep;
use crate::table::Servers;
use crate::writeback::Writeback;
use crate::{Disk, Pager, PagerError, Transport, TransportError};
use netram_policy::placement::{self, Candidate};
use netram_proto::{
    Delta, DeltaKind, Member, OwnedRecord, Owner, Page, PageKey, Record, Request, PAGE_SIZE,
};
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;

/// What a PUT does to the page's parity group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PutOp {
    /// An overwrite in place: the page stays in its group.
    Keep,
    /// The page joins open group `group`, whose parity goes to server `holder`.
    Join { group: u64, holder: u16 },
}

/// Group ids are page numbers of the holder's parity frames: 40 bits.
const GROUP_IDS: u64 = 1 << 40;

/// Rounds of recovery a superseded copy is deleted again before it is left to its session's end.
const STALE_TRIES: u32 = 50;

/// How often a parity PUT whose server could not tell the holder is sent to that server again
/// before the page goes elsewhere.
const HOLDER_TRIES: u8 = 3;

/// Open groups at most: a write finding none with room ships the fullest one.
const MAX_OPEN: usize = 64;

#[derive(Debug, Clone, Copy)]
struct OpenMember {
    page: u64,
    server: usize,
    version: u32,
    acked: bool,
}

#[derive(Debug)]
struct OpenGroup {
    id: u64,
    holder: usize,
    members: Vec<OpenMember>,
    parity: OwnedRecord,
    /// Ship as soon as every member is acknowledged, full or not.
    force: bool,
    shipping: bool,
    /// Holds a page no caller waits for (written by recovery, or placed again after a
    /// failure): recovery work until shipped, so that it is not left waiting for later
    /// writes to fill its group — which may never come.
    unattended: bool,
}

/// A group as a scan reported it.
#[derive(Debug)]
pub(crate) struct ScannedGroup {
    pub group: u64,
    /// Its parity rebuilds nothing (see [`netram_proto::GroupRecord::damaged`]).
    pub damaged: bool,
    pub members: Vec<Member>,
    pub parity: OwnedRecord,
}

/// The parity state of a `parity:N` pager.
#[derive(Debug)]
pub(crate) struct Par {
    n: usize,
    addrs: Vec<SocketAddr>,
    next_group: u64,
    open: Vec<OpenGroup>,
    /// Pages waiting for their open group to ship, by group id.
    member_of: HashMap<u64, u64>,
    /// Servers whose old contents recovery still has to rebuild (dead, or back empty). They
    /// take no new pages meanwhile.
    pub(crate) recovering: BTreeSet<usize>,
    /// Pages (and versions) the page table had on each recovering server.
    lost_on: HashMap<usize, Vec<(u64, u32)>>,
    /// Pages stored outside any group (their holder died, their group was damaged): recovery
    /// protects them again.
    unprotected: BTreeSet<u64>,
    /// Scan answers, by the server that gave them.
    scanned: Vec<(usize, Vec<ScannedGroup>, Vec<PageKey>)>,
    /// Survivor reads that failed, and whether only in transit (a bad checksum).
    /// Survivor reads that failed: page, slot, and whether trying again may help.
    read_failed: Vec<(u64, u32, bool)>,
    /// Superseded copies a server could not delete (their holder could not be told), with
    /// the attempts so far: deleted again at each recovery round, for a while.
    stale: Vec<(usize, PageKey)>,
    stale_tries: HashMap<(usize, PageKey), u32>,
    /// Reads tried again after a bad checksum, by page.
    retries: HashMap<u64, u8>,
    /// PUTs sent again to the same server after it could not tell the holder, by page.
    put_retries: HashMap<u64, u8>,
    /// Overwrites that went elsewhere after their server could not tell the holder: (page,
    /// server). The holder may have applied the delta, leaving its group covering a version
    /// that server never stored; an audit finds and dissolves such groups.
    suspects: Vec<(u64, usize)>,
}

impl Par {
    /// `seed` picks where this pager's group ids start: holders tell groups apart by the
    /// owner's node and incarnation, which several pagers of one client share.
    pub(crate) fn new(n: usize, addrs: Vec<SocketAddr>, seed: u64) -> Self {
        Self {
            n,
            addrs,
            next_group: fastrand::Rng::with_seed(seed ^ 0x7061_7269_7479).u64(1..GROUP_IDS),
            open: Vec::new(),
            member_of: HashMap::new(),
            recovering: BTreeSet::new(),
            lost_on: HashMap::new(),
            unprotected: BTreeSet::new(),
            scanned: Vec::new(),
            read_failed: Vec::new(),
            stale: Vec::new(),
            stale_tries: HashMap::new(),
            retries: HashMap::new(),
            put_retries: HashMap::new(),
            suspects: Vec::new(),
        }
    }

    /// Work recovery still has: servers to scan and pages to protect again.
    pub(crate) fn pending(&self) -> usize {
        // A dead server counts until the scans report nothing more about it: its groups may
        // still list superseded members there, which leave the rest of the group unprotected.
        self.lost_on.values().map(Vec::len).sum::<usize>()
            + self.recovering.len()
            + self.unprotected.len()
            + self.stale.len()
            + self.open.iter().filter(|g| g.unattended).count()
            + self.suspects.len()
    }

    pub(crate) fn is_open(&self, page: u64) -> bool {
        self.member_of.contains_key(&page)
    }

    /// For [`Pager::check_invariants`]: the slots this scheme owns (survivor reads that
    /// failed, waiting for recovery to look at them).
    pub(crate) fn slots_held(&self, owned: &mut Vec<u32>) {
        owned.extend(self.read_failed.iter().map(|&(_, slot, _)| slot));
    }
}

impl<T: Transport, D: Disk> Pager<T, D> {
    fn par(&self) -> &Par {
        self.scheme.parity().expect("a parity pager")
    }
    fn par_mut(&mut self) -> &mut Par {
        self.scheme.parity_mut().expect("a parity pager")
    }

    /// Whether a server may take pages or parity now.
    fn par_usable(&self, s: usize) -> bool {
        self.servers[s].alive && !self.par().recovering.contains(&s)
    }

    /// The image of a page in write-back, as its group's parity covers it.
    fn par_record(&self, page: u64, version: u32, slot: u32) -> OwnedRecord {
        let at = slot as usize * PAGE_SIZE;
        let p = Page::seal(self.key(page), version, &self.slots[at..at + PAGE_SIZE]);
        let mut r = OwnedRecord::default();
        r.xor(&Record::of(&p));
        r
    }

    /// Sends a page in write-back: in place if its server is usable and it may stay in its
    /// group, else into an open group. With no server to take it, it goes to the local disk.
    pub(crate) fn par_place(&mut self, page: u64) -> Result<(), PagerError> {
        let wb = *self.writeback.get(&page).expect("page in write-back");
        if !wb.pending.is_empty() || self.par().member_of.contains_key(&page) {
            return Ok(());
        }
        let cur = self
            .table
            .holders(page)
            .first()
            .filter(|&s| self.par_usable(s) && !wb.refused.contains(s));
        if let (Some(s), false) = (cur, wb.join) {
            return self.par_send(page, s, PutOp::Keep);
        }
        let prefer = cur.filter(|_| wb.join);
        match self.par_choose(prefer, wb.refused) {
            Some((gi, server)) => {
                let rec = self.par_record(page, wb.version, wb.slot);
                let (group, holder) = {
                    let g = &mut self.par_mut().open[gi];
                    g.unattended |= wb.join || wb.rebuild;
                    g.parity.xor(&rec.as_record());
                    g.members.push(OpenMember {
                        page,
                        server,
                        version: wb.version,
                        acked: false,
                    });
                    (g.id, g.holder as u16)
                };
                self.par_mut().member_of.insert(page, group);
                self.par_send(page, server, PutOp::Join { group, holder })
            }
            None => self.finish_writeback(page),
        }
    }

    fn par_send(&mut self, page: u64, server: usize, op: PutOp) -> Result<(), PagerError> {
        let wb = self.writeback.get_mut(&page).expect("page in write-back");
        wb.pending.insert(server);
        let (slot, version) = (wb.slot, wb.version);
        self.counters.puts += 1;
        let key = self.key(page);
        let it = PutItem {
            page,
            slot,
            version,
            key,
            kind: PutKind::Parity(op),
        };
        if self.queue_put(server, it) {
            self.pump_paced(server);
        }
        Ok(())
    }

    /// An open group with room and a server for the page: `prefer` if it fits one, else by
    /// placement. Opens a new group (its holder chosen by placement) when none fits.
    fn par_choose(&mut self, prefer: Option<usize>, refused: Servers) -> Option<(usize, usize)> {
        let candidates: Vec<Candidate> = self
            .servers
            .iter()
            .enumerate()
            .map(|(i, s)| Candidate {
                alive: s.load.alive && !self.par().recovering.contains(&i),
                ..s.load
            })
            .collect();
        let n = self.par().n;
        for gi in 0..self.par().open.len() {
            let g = &self.par().open[gi];
            if g.shipping || g.force || g.members.len() >= n || !self.par_usable(g.holder) {
                continue;
            }
            let mut exclude: Vec<usize> = g.members.iter().map(|m| m.server).collect();
            exclude.push(g.holder);
            exclude.extend(refused.iter());
            let server = match prefer {
                Some(p) => (!exclude.contains(&p)).then_some(p),
                None => placement::choose(&candidates, &exclude, &mut self.rng),
            };
            if let Some(s) = server {
                return Some((gi, s));
            }
        }
        if self.par().open.len() >= MAX_OPEN {
            // Too many groups waiting: ship one early.
            if let Some(g) = self.par_mut().open.iter_mut().find(|g| !g.shipping) {
                g.force = true;
            }
        }
        let mut exclude: Vec<usize> = refused.iter().collect();
        exclude.extend(prefer);
        let holder = placement::choose(&candidates, &exclude, &mut self.rng)?;
        exclude.push(holder);
        let server = match prefer {
            Some(p) => p,
            None => placement::choose(&candidates, &exclude, &mut self.rng)?,
        };
        let par = self.par_mut();
        let id = par.next_group;
        par.next_group = (par.next_group + 1) % GROUP_IDS;
        par.open.push(OpenGroup {
            id,
            holder,
            members: Vec::new(),
            parity: OwnedRecord::default(),
            force: false,
            shipping: false,
            unattended: false,
        });
        self.counters.parity_groups_opened += 1;
        Some((self.par().open.len() - 1, server))
    }

    fn par_group(&self, id: u64) -> Option<usize> {
        self.par().open.iter().position(|g| g.id == id)
    }

    /// A PUT of a parity page was stored.
    pub(crate) fn par_stored(&mut self, it: PutItem, server: usize) -> Result<(), PagerError> {
        self.par_mut().put_retries.remove(&it.page);
        let Some(wb) = self.writeback.get_mut(&it.page) else {
            return Ok(());
        };
        if wb.version != it.version {
            return Ok(());
        }
        wb.pending.remove(server);
        wb.done.insert(server);
        match it.kind {
            PutKind::Parity(PutOp::Join { group, .. }) => {
                let member = self.par_group(group).and_then(|gi| {
                    let g = &mut self.par_mut().open[gi];
                    let m = g.members.iter_mut().find(|m| m.page == it.page)?;
                    m.acked = true;
                    Some(gi)
                });
                match member {
                    Some(gi) => self.par_try_ship(gi),
                    None => {
                        // Its group was given up while the PUT was in flight (the holder
                        // died): stored, but in no group anyone holds. It joins another.
                        self.par_mut().member_of.remove(&it.page);
                        let wb = self.writeback.get_mut(&it.page).expect("checked above");
                        wb.done.remove(server);
                        wb.join = true;
                        self.par_moved(it.page, server);
                        self.counters.parity_rejoins += 1;
                        return self.par_place(it.page);
                    }
                }
                Ok(())
            }
            _ => self.finish_writeback(it.page),
        }
    }

    /// Stored, but outside any group (its old group is gone): it joins a new one, where it is.
    pub(crate) fn par_unprotected(&mut self, it: PutItem, server: usize) -> Result<(), PagerError> {
        let Some(wb) = self.writeback.get_mut(&it.page) else {
            return Ok(());
        };
        wb.pending.remove(server);
        wb.join = true;
        self.counters.parity_rejoins += 1;
        // The server holds this version now: it is where the page is.
        self.par_moved(it.page, server);
        self.par_place(it.page)
    }

    /// A server stores the page's version in write-back, outside any group: the page table
    /// points there, and superseded copies elsewhere are deleted.
    fn par_moved(&mut self, page: u64, server: usize) {
        let mut at = Servers::default();
        at.insert(server);
        self.set_location(page, at);
    }

    /// The server could not tell the holder of the page's group about the PUT, and stored
    /// nothing. The holder may have applied the delta and lost its answer: the same PUT to the
    /// same server again is answered as a repeat and leaves the group consistent, whereas the
    /// page placed elsewhere may leave the group covering a version no server has. So it is
    /// sent there again a few times; an overwrite that then goes elsewhere is audited.
    pub(crate) fn par_holder_unreachable(
        &mut self,
        it: PutItem,
        server: usize,
    ) -> Result<(), PagerError> {
        let current = self
            .writeback
            .get(&it.page)
            .is_some_and(|wb| wb.version == it.version && wb.pending.contains(server));
        let tries = self.par_mut().put_retries.entry(it.page).or_insert(0);
        *tries += 1;
        if current && *tries <= HOLDER_TRIES && self.servers[server].alive {
            self.counters.puts += 1;
            self.counters.parity_puts_retried += 1;
            self.queue_put(server, it);
            return Ok(());
        }
        self.par_mut().put_retries.remove(&it.page);
        if it.kind == PutKind::Parity(PutOp::Keep) {
            self.par_mut().suspects.push((it.page, server));
        }
        self.par_put_failed(it, server)
    }

    /// A PUT that will not be stored (refused, holder unreachable, server dead): the page leaves
    /// the open group it was joining, and is placed elsewhere.
    pub(crate) fn par_put_failed(&mut self, it: PutItem, server: usize) -> Result<(), PagerError> {
        if let PutKind::Parity(PutOp::Join { group, .. }) = it.kind {
            self.par_leave(group, it.page);
        }
        self.copy_failed(it.page, server)
    }

    /// Takes a page out of an open group (its image XORed out of the parity).
    fn par_leave(&mut self, group: u64, page: u64) {
        let Some(gi) = self.par_group(group) else {
            return;
        };
        let Some(i) = self.par().open[gi]
            .members
            .iter()
            .position(|m| m.page == page)
        else {
            return;
        };
        let m = self.par().open[gi].members[i];
        if let Some(wb) = self.writeback.get(&page) {
            let rec = self.par_record(page, m.version, wb.slot);
            let g = &mut self.par_mut().open[gi];
            g.parity.xor(&rec.as_record());
            g.members.swap_remove(i);
        }
        self.par_mut().member_of.remove(&page);
        if self.par().open[gi].members.is_empty() && !self.par().open[gi].shipping {
            self.par_mut().open.swap_remove(gi);
        } else {
            self.par_try_ship(gi);
        }
    }

    /// Ships a group's parity page when every member is stored and the group is full (or must
    /// go now).
    fn par_try_ship(&mut self, gi: usize) {
        let n = self.par().n;
        let g = &self.par().open[gi];
        if g.shipping
            || g.members.is_empty()
            || !g.members.iter().all(|m| m.acked)
            || !(g.force || g.members.len() >= n)
        {
            return;
        }
        let addrs = &self.par().addrs;
        let members: Vec<Member> = g
            .members
            .iter()
            .map(|m| Member {
                server: addrs[m.server],
                key: PageKey::new(self.cfg.region, m.page),
                version: m.version,
            })
            .collect();
        let (id, holder, parity) = (g.id, g.holder, g.parity.clone());
        // Recorded before sending: a failed send fails the group at once.
        self.par_mut().open[gi].shipping = true;
        self.counters.parity_ships += 1;
        let req = Request::ParityShip {
            group: id,
            max_members: n as u8,
            members,
            record: parity.as_record(),
        };
        self.submit(holder, Op::Ship(id), &req);
    }

    /// The holder stored a group's parity: its members' write-backs are done.
    pub(crate) fn par_shipped(&mut self, id: u64) -> Result<(), PagerError> {
        let Some(gi) = self.par_group(id) else {
            return Ok(());
        };
        let g = self.par_mut().open.swap_remove(gi);
        self.counters.parity_groups_shipped += 1;
        for m in g.members {
            self.par_mut().member_of.remove(&m.page);
            if self
                .writeback
                .get(&m.page)
                .is_some_and(|wb| wb.version == m.version && wb.pending.is_empty())
            {
                self.finish_writeback(m.page)?;
            }
        }
        Ok(())
    }

    /// The holder refused the parity or died: every member joins another group (its copy
    /// stays where it is, tagged with a group nobody holds, until the new group replaces it).
    pub(crate) fn par_ship_failed(&mut self, id: u64) -> Result<(), PagerError> {
        let Some(gi) = self.par_group(id) else {
            return Ok(());
        };
        let g = self.par_mut().open.swap_remove(gi);
        self.counters.parity_ships_failed += 1;
        self.par_rejoin_all(g.members)
    }

    fn par_rejoin_all(&mut self, members: Vec<OpenMember>) -> Result<(), PagerError> {
        for m in members {
            self.par_mut().member_of.remove(&m.page);
            let Some(wb) = self.writeback.get_mut(&m.page) else {
                continue;
            };
            if wb.version != m.version || !m.acked {
                // Not stored yet: its reply finds the group gone and places it again.
                continue;
            }
            wb.done.remove(m.server);
            wb.join = true;
            if self.servers[m.server].alive {
                self.par_moved(m.page, m.server);
            }
            self.counters.parity_rejoins += 1;
            self.par_place(m.page)?;
        }
        Ok(())
    }

    /// Ships open groups now, full or not: all of them, or the one `page` is waiting in.
    pub(crate) fn par_seal(&mut self, page: Option<u64>) -> Result<(), PagerError> {
        let ids: Vec<u64> = match page {
            Some(p) => self.par().member_of.get(&p).copied().into_iter().collect(),
            None => self.par().open.iter().map(|g| g.id).collect(),
        };
        for id in ids {
            if let Some(gi) = self.par_group(id) {
                self.par_mut().open[gi].force = true;
                self.par_try_ship(gi);
            }
        }
        Ok(())
    }

    /// Ships every open group and completes everything in flight, again while settling it
    /// opened new groups (a failed ship or member re-places pages): what a flush promises. A
    /// group that cannot ship (no holder takes it) is left after a bounded number of rounds.
    pub(crate) fn par_settle(&mut self) -> Result<(), PagerError> {
        for _ in 0..64 {
            self.par_seal(None)?;
            self.drain()?;
            if self.par().open.is_empty() {
                break;
            }
        }
        Ok(())
    }

    /// A server was declared dead: groups it was to hold find other holders, members it
    /// stored leave their open groups, and the pages the page table had there wait for
    /// recovery.
    pub(crate) fn par_server_dead(&mut self, server: usize) {
        let mut rejoin = Vec::new();
        let mut leave = Vec::new();
        for g in &self.par().open {
            if g.shipping {
                continue;
            }
            if g.holder == server {
                rejoin.push(g.id);
            } else {
                leave.extend(
                    g.members
                        .iter()
                        .filter(|m| m.server == server && m.acked)
                        .map(|m| (g.id, m.page)),
                );
            }
        }
        for id in rejoin {
            if let Some(gi) = self.par_group(id) {
                let g = self.par_mut().open.swap_remove(gi);
                if let Err(e) = self.par_rejoin_all(g.members) {
                    tracing::error!("could not place pages after a holder failed: {e}");
                }
            }
        }
        for (id, page) in leave {
            self.par_leave(id, page);
            if let Err(e) = self.copy_failed(page, server) {
                tracing::error!(page, "could not place page after server failure: {e}");
            }
        }
        let pages = self.table.pages_on(server);
        let mut lost = Vec::with_capacity(pages.len());
        for page in pages {
            let mut h = self.table.holders(page);
            h.remove(server);
            self.table.set_holders(page, h);
            lost.push((page, self.table.get(page).version));
        }
        let par = self.par_mut();
        par.recovering.insert(server);
        par.lost_on.entry(server).or_default().extend(lost);
    }

    /// Whether a page with no live holder can come back through its group's parity.
    pub(crate) fn par_reconstructible(&self, page: u64) -> bool {
        let Some(par) = self.scheme.parity() else {
            return false;
        };
        let e = self.table.get(page);
        e.present && !e.lost && !e.on_disk && !par.recovering.is_empty()
    }

    /// A degraded read: recovery runs until the page is rebuilt (its data then waits in its
    /// write-back slot) or known lost. True when `slot` holds the page.
    pub(crate) fn par_reconstruct(&mut self, page: u64, slot: u32) -> Result<bool, PagerError> {
        for _ in 0..10_000 {
            // Rebuilt and in flight, or kept in memory because the disk failed to take it.
            let rebuilt = self
                .writeback
                .get(&page)
                .map(|wb| wb.slot)
                .or_else(|| self.cache.peek(&page).copied());
            if let Some(from) = rebuilt {
                let (from, to) = (from as usize * PAGE_SIZE, slot as usize * PAGE_SIZE);
                self.slots.copy_within(from..from + PAGE_SIZE, to);
                return Ok(true);
            }
            let e = *self.table.get(page);
            if e.lost || !e.present {
                return Ok(false);
            }
            if e.on_disk {
                // Rebuilt, but no server could take it: the local disk has it.
                let at = slot as usize * PAGE_SIZE;
                self.counters.disk_reads += 1;
                self.disk.read(page, &mut self.slots[at..at + PAGE_SIZE])?;
                return Ok(true);
            }
            if let Some(s) = self.alive_holder(page, None) {
                // Rebuilt and already stored: read it.
                let it = self.page_get_item(page, slot, INTERNAL);
                self.submit_get_item(s, it);
                self.par_drain()?;
                let i = self.fetched.iter().position(|&f| f == (page, slot));
                return Ok(i.map(|i| self.fetched.swap_remove(i)).is_some());
            }
            if self.par().recovering.is_empty() {
                return Ok(false);
            }
            self.par_recover(usize::MAX)?;
        }
        Ok(false)
    }

    /// One round of recovery: scans every live server about the first recovering server,
    /// rebuilds the groups reported (as many as the free slots allow) and protects the orphans
    /// again; when the scans report nothing more, what is still missing is lost.
    pub(crate) fn par_recover(&mut self, max: usize) -> Result<RecoveryStep, PagerError> {
        let mut step = RecoveryStep::default();
        // Deltas and write-backs in flight must have settled: a scan reports what holders have.
        self.drain()?;
        self.par_retry_stale();
        self.drain()?;
        self.par_reprotect(max, &mut step)?;
        self.par_audit(&mut step)?;
        let Some(&x) = self.par().recovering.first() else {
            // Pages placed again since the last round wait in open groups: ship them.
            self.par_seal(None)?;
            self.pump_all();
            step.remaining = self.par().pending();
            return Ok(step);
        };
        let dead = self.par().addrs[x];
        let budget = (self.free_slots.len() / 2).max(1);
        let per_scan = (budget / self.par().n.max(1)).clamp(1, netram_proto::MAX_BATCH);
        let asked: Vec<usize> = (0..self.servers.len())
            .filter(|&s| self.servers[s].alive && s != x)
            .collect();
        for &s in &asked {
            self.submit(
                s,
                Op::Scan,
                &Request::ParityScan {
                    dead,
                    max: per_scan as u32,
                },
            );
        }
        self.drain()?;
        let scanned = std::mem::take(&mut self.par_mut().scanned);
        let answered = scanned.len() == asked.len() && asked.iter().all(|s| self.servers[*s].alive);
        if answered && scanned.iter().all(|(_, g, o)| g.is_empty() && o.is_empty()) {
            self.par_finish_server(x, &mut step);
            step.remaining = self.par().pending();
            return Ok(step);
        }
        // Orphans: pages whose parity the dead server held.
        let mut reprotect = Vec::new();
        for (s, _, orphans) in &scanned {
            for k in orphans {
                if k.region != self.cfg.region || k.page >= self.cfg.pages {
                    continue;
                }
                let e = *self.table.get(k.page);
                if e.present && !e.lost && self.table.holders(k.page).contains(*s) {
                    reprotect.push(k.page);
                } else if !self.writeback.contains_key(&k.page) {
                    // A superseded copy left behind: delete it (its tag is gone, so the delete
                    // needs no holder).
                    self.counters.deletes += 1;
                    self.delete(*s, vec![*k]);
                }
            }
        }
        self.par_mut().unprotected.extend(reprotect);
        // Groups with a member on the dead server.
        let mut work: Vec<(usize, ScannedGroup)> = Vec::new();
        let mut reads = 0;
        for (s, groups, _) in scanned {
            for g in groups {
                if reads + g.members.len() > budget && !work.is_empty() {
                    break;
                }
                reads += g.members.len();
                work.push((s, g));
            }
        }
        let mut planned = Vec::new();
        for (h, g) in work {
            if g.damaged {
                self.par_dissolve(h, &g, Some(dead), &mut step);
                continue;
            }
            let index = |a: SocketAddr| self.par().addrs.iter().position(|&b| b == a);
            let lost: Vec<&Member> = g.members.iter().filter(|m| m.server == dead).collect();
            let survivors: Vec<(usize, Member)> = g
                .members
                .iter()
                .filter(|m| m.server != dead)
                .map(|m| (index(m.server).unwrap_or(usize::MAX), *m))
                .collect();
            let readable = survivors
                .iter()
                .all(|&(s, _)| s != usize::MAX && self.servers[s].alive);
            if lost.len() != 1 || !readable {
                self.par_drop_group(h, &g, dead, &mut step);
                continue;
            }
            let mut slots = Vec::with_capacity(survivors.len());
            for &(s, m) in &survivors {
                let slot = self.take_slot()?;
                slots.push(slot);
                self.submit_get_item(
                    s,
                    GetItem {
                        page: m.key.page,
                        slot,
                        pos: INTERNAL,
                        key: m.key,
                        version: m.version,
                        part: Part::Survivor,
                    },
                );
            }
            planned.push((h, g, slots));
        }
        self.par_drain()?;
        // Matched by slot, not by page: one page can be a survivor of two groups at two
        // versions (a superseded copy not deleted yet), and the XOR of a page sealed at the
        // wrong version would still pass the CRC, which is linear.
        let fetched: BTreeSet<(u64, u32)> = std::mem::take(&mut self.fetched).into_iter().collect();
        let failed = std::mem::take(&mut self.par_mut().read_failed);
        for (h, g, slots) in planned {
            let lost = *g.members.iter().find(|m| m.server == dead).expect("one");
            let survivors: Vec<(&Member, u32)> = g
                .members
                .iter()
                .filter(|m| m.server != dead)
                .zip(slots)
                .collect();
            let got = |m: &Member, slot: u32| fetched.contains(&(m.key.page, slot));
            if !survivors.iter().all(|&(m, slot)| got(m, slot)) {
                let transient = survivors
                    .iter()
                    .all(|&(m, slot)| got(m, slot) || failed.contains(&(m.key.page, slot, true)));
                if !transient {
                    self.par_drop_group(h, &g, dead, &mut step);
                }
                continue;
            }
            let mut r = g.parity.clone();
            for &(m, slot) in &survivors {
                let at = slot as usize * PAGE_SIZE;
                let p = Page::seal(m.key, m.version, &self.slots[at..at + PAGE_SIZE]);
                r.xor(&Record::of(&p));
            }
            let page = r.as_record().page(lost.key);
            if !page.verify() || page.version != lost.version {
                // The parity does not rebuild it (damaged): the member leaves the group.
                self.par_drop_group(h, &g, dead, &mut step);
                continue;
            }
            self.counters.parity_members_rebuilt += 1;
            let delta = Delta {
                owner: Owner::SELF,
                group: g.group,
                member: lost.server,
                key: lost.key,
                from: lost.version,
                to: lost.version,
                kind: DeltaKind::Remove,
                record: r.as_record(),
            };
            self.submit(h, Op::Delta, &Request::ParityDelta(vec![delta]));
            if self.par_wanted(lost.key.page, lost.version) {
                let slot = self.take_slot()?;
                let at = slot as usize * PAGE_SIZE;
                self.slots[at..at + PAGE_SIZE].copy_from_slice(r.data.as_ref());
                self.par_forget_lost(x, lost.key.page);
                self.par_rewrite(lost.key.page, slot, true)?;
                step.started += 1;
            }
        }
        for (_, slot) in fetched {
            self.release_slot(slot);
        }
        // Rebuilt pages are protected at once, not left in open groups for later writes to
        // fill: ship the groups they joined, full or not (holders merge small ones).
        self.par_seal(None)?;
        self.pump_all();
        step.remaining = self.par().pending();
        Ok(step)
    }

    /// Whether a rebuilt member is still the page's current version, wanted back.
    fn par_wanted(&self, page: u64, version: u32) -> bool {
        if page >= self.cfg.pages || self.writeback.contains_key(&page) {
            return false;
        }
        let e = self.table.get(page);
        e.present
            && !e.lost
            && !e.on_disk
            && e.version == version
            && self.alive_holder(page, None).is_none()
    }

    fn par_forget_lost(&mut self, x: usize, page: u64) {
        if let Some(l) = self.par_mut().lost_on.get_mut(&x) {
            l.retain(|&(p, _)| p != page);
        }
    }

    /// Writes a page out again from `slot` at its current version: a rebuilt page, or one
    /// whose group is gone.
    fn par_rewrite(&mut self, page: u64, slot: u32, rebuild: bool) -> Result<(), PagerError> {
        let e = *self.table.get(page);
        self.writeback.insert(
            page,
            Writeback {
                slot,
                version: e.version,
                done: Servers::default(),
                pending: Servers::default(),
                refused: Servers::default(),
                keep: Servers::default(),
                rebuild,
                join: true,
            },
        );
        self.par_place(page)
    }

    /// A group that cannot rebuild its member on the dead server (more of it is gone than one
    /// parity page covers, or a survivor no longer matches): the member is dropped from it and,
    /// if still wanted, lost; the other members are protected again elsewhere.
    fn par_drop_group(
        &mut self,
        h: usize,
        g: &ScannedGroup,
        dead: SocketAddr,
        step: &mut RecoveryStep,
    ) {
        let zero = OwnedRecord::default();
        let mut drops = Vec::new();
        for m in g.members.iter().filter(|m| m.server == dead) {
            drops.push(Delta {
                owner: Owner::SELF,
                group: g.group,
                member: m.server,
                key: m.key,
                from: m.version,
                to: m.version,
                kind: DeltaKind::Drop,
                record: zero.as_record(),
            });
            if self.par_wanted(m.key.page, m.version) {
                self.table.get_mut(m.key.page).lost = true;
                self.counters.pages_unrecoverable += 1;
                step.unrecoverable += 1;
            }
        }
        if !drops.is_empty() {
            self.submit(h, Op::Delta, &Request::ParityDelta(drops));
        }
        let others: Vec<u64> = g
            .members
            .iter()
            .filter(|m| m.server != dead && m.key.page < self.cfg.pages)
            .map(|m| m.key.page)
            .collect();
        self.par_mut().unprotected.extend(others);
    }

    /// A damaged group (its parity covers a version some member's server does not have): every
    /// member is dropped from it, so that its holder frees it, and the members still wanted
    /// join new groups where they are; one on the dead server, if still wanted, is lost.
    fn par_dissolve(
        &mut self,
        h: usize,
        g: &ScannedGroup,
        dead: Option<SocketAddr>,
        step: &mut RecoveryStep,
    ) {
        self.counters.parity_groups_dissolved += 1;
        let zero = OwnedRecord::default();
        let drops = g
            .members
            .iter()
            .map(|m| Delta {
                owner: Owner::SELF,
                group: g.group,
                member: m.server,
                key: m.key,
                from: m.version,
                to: m.version,
                kind: DeltaKind::Drop,
                record: zero.as_record(),
            })
            .collect();
        self.submit(h, Op::Delta, &Request::ParityDelta(drops));
        for m in &g.members {
            if m.key.region != self.cfg.region || m.key.page >= self.cfg.pages {
                continue;
            }
            if Some(m.server) == dead {
                if self.par_wanted(m.key.page, m.version) {
                    self.table.get_mut(m.key.page).lost = true;
                    self.counters.pages_unrecoverable += 1;
                    step.unrecoverable += 1;
                }
            } else {
                self.par_mut().unprotected.insert(m.key.page);
            }
        }
    }

    /// Audits the groups that overwrites sent elsewhere may have damaged (see
    /// [`Par::suspects`]). It waits until the page's copy on that server has been deleted:
    /// the holder then finds the delete stale, marks the group damaged and reports it to a
    /// scan that names no dead server. Until the audit, the group's other members have no
    /// working parity.
    fn par_audit(&mut self, step: &mut RecoveryStep) -> Result<(), PagerError> {
        let settled = |p: &Self, page: u64, s: usize| {
            !p.writeback.contains_key(&page) && !p.par().stale.contains(&(s, p.key(page)))
        };
        if !self
            .par()
            .suspects
            .iter()
            .any(|&(page, s)| settled(self, page, s))
        {
            return Ok(());
        }
        self.counters.parity_audits += 1;
        let asked: Vec<usize> = (0..self.servers.len())
            .filter(|&s| self.servers[s].alive)
            .collect();
        // No server listens on port 0: only damaged groups are reported.
        let nobody = SocketAddr::from(([0, 0, 0, 0], 0));
        for &s in &asked {
            self.submit(
                s,
                Op::Scan,
                &Request::ParityScan {
                    dead: nobody,
                    max: netram_proto::MAX_BATCH as u32,
                },
            );
        }
        self.drain()?;
        let scanned = std::mem::take(&mut self.par_mut().scanned);
        let answered = scanned.len() == asked.len() && asked.iter().all(|s| self.servers[*s].alive);
        let mut found = false;
        for (h, groups, _) in scanned {
            for g in groups.iter().filter(|g| g.damaged) {
                found = true;
                self.par_dissolve(h, g, None, step);
            }
        }
        if answered && !found {
            let suspects = std::mem::take(&mut self.par_mut().suspects);
            let left = suspects
                .into_iter()
                .filter(|&(page, s)| !settled(self, page, s))
                .collect();
            self.par_mut().suspects = left;
        }
        self.pump_all();
        Ok(())
    }

    /// The scans report nothing more about `x`: what the page table still had there and nobody
    /// rebuilt is lost.
    fn par_finish_server(&mut self, x: usize, step: &mut RecoveryStep) {
        let par = self.par_mut();
        par.recovering.remove(&x);
        let lost = par.lost_on.remove(&x).unwrap_or_default();
        for (page, version) in lost {
            if self.par_wanted(page, version) {
                self.table.get_mut(page).lost = true;
                self.counters.pages_unrecoverable += 1;
                step.unrecoverable += 1;
            }
        }
    }

    /// Pages stored outside any group join one again, where they are (read first, unless
    /// cached).
    fn par_reprotect(&mut self, max: usize, step: &mut RecoveryStep) -> Result<(), PagerError> {
        let budget = (self.free_slots.len() / 2).min(max);
        let mut batch = Vec::new();
        while batch.len() < budget {
            let Some(page) = self.par_mut().unprotected.pop_first() else {
                break;
            };
            let e = *self.table.get(page);
            if !e.present || e.lost || self.writeback.contains_key(&page) {
                continue;
            }
            let Some(s) = self.alive_holder(page, None) else {
                continue;
            };
            batch.push((page, s));
        }
        if batch.is_empty() {
            return Ok(());
        }
        let mut asked = BTreeSet::new();
        for &(page, s) in &batch {
            let slot = self.take_slot()?;
            asked.insert((page, slot));
            let it = self.page_get_item(page, slot, INTERNAL);
            self.submit_get_item(
                s,
                GetItem {
                    part: Part::Survivor,
                    ..it
                },
            );
        }
        self.par_drain()?;
        self.par_mut().read_failed.clear();
        for (page, slot) in std::mem::take(&mut self.fetched) {
            let e = *self.table.get(page);
            if !asked.contains(&(page, slot))
                || !e.present
                || e.lost
                || self.writeback.contains_key(&page)
            {
                self.release_slot(slot);
                continue;
            }
            self.counters.parity_reprotected += 1;
            step.started += 1;
            self.par_rewrite(page, slot, false)?;
        }
        for (page, _) in batch {
            let e = *self.table.get(page);
            if !self.writeback.contains_key(&page) && e.present && !e.lost {
                // Its read failed on the way: try again later.
                self.par_mut().unprotected.insert(page);
            }
        }
        self.par_seal(None)?;
        self.pump_all();
        Ok(())
    }

    /// Completes everything in flight and collects the pager's own finished reads into
    /// `fetched`, leaving a caller's reads where they are.
    fn par_drain(&mut self) -> Result<(), PagerError> {
        loop {
            self.drain()?;
            self.resubmit_retries();
            if self.idle() {
                break;
            }
        }
        let mut i = 0;
        while i < self.reads_done.len() {
            if self.reads_done[i].pos == INTERNAL {
                let d = self.reads_done.swap_remove(i);
                self.fetched.push((d.page, d.slot));
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Whether a page whose read failed its checksum is read once more (a flip in transit);
    /// a few times, not forever.
    pub(crate) fn par_retry(&mut self, page: u64) -> bool {
        let n = self.par_mut().retries.entry(page).or_insert(0);
        *n += 1;
        *n <= 3
    }

    /// Copies a server kept because their holder could not be told of the delete.
    pub(crate) fn par_stale(&mut self, server: usize, keys: Vec<PageKey>) {
        self.par_mut()
            .stale
            .extend(keys.into_iter().map(|k| (server, k)));
    }

    /// Deletes superseded copies again (their holder may answer now, or be known dead and
    /// forgotten by the server); gives up on one after `STALE_TRIES` rounds (it stays until
    /// the session ends).
    fn par_retry_stale(&mut self) {
        let stale = std::mem::take(&mut self.par_mut().stale);
        for (s, k) in stale {
            // Deletes go by key: a copy of the current version there must not be deleted in
            // its place, and one may be on its way.
            if k.page < self.cfg.pages && self.writeback.contains_key(&k.page) {
                self.par_mut().stale.push((s, k));
                continue;
            }
            let current = k.page < self.cfg.pages
                && self.table.holders(k.page).contains(s)
                && !self.table.get(k.page).lost;
            if current || !self.servers[s].alive {
                self.par_mut().stale_tries.remove(&(s, k));
                continue;
            }
            let tries = self.par_mut().stale_tries.entry((s, k)).or_insert(0);
            *tries += 1;
            if *tries > STALE_TRIES {
                self.par_mut().stale_tries.remove(&(s, k));
                tracing::warn!(server = s, key = ?k, "giving up deleting a superseded copy");
                continue;
            }
            // Its answer puts it back on the list if the server kept it again.
            self.counters.deletes += 1;
            self.delete(s, vec![k]);
        }
    }

    /// A scan's answer, made owned.
    pub(crate) fn par_scanned(
        &mut self,
        server: usize,
        groups: Vec<ScannedGroup>,
        orphans: Vec<PageKey>,
    ) {
        self.par_mut().scanned.push((server, groups, orphans));
    }

    /// A page's GET that got no good data from `server`. Its one copy is the only one, so a
    /// server that keeps sending it bad is declared dead and the page rebuilt from its group.
    pub(crate) fn par_get_failed(
        &mut self,
        server: usize,
        it: GetItem,
        what: Option<&'static str>,
    ) {
        if it.pos != INTERNAL {
            // Any bad answer, not only a checksum mismatch: a bit flipped in the reply's page
            // key or version is as much a lie (found by the `pager_replies` fuzz target: a
            // flipped key cost a page that parity could rebuild), and a page missing from the
            // server that holds its only copy is lost there all the same.
            if let Some(what) = what {
                if self.par_retry(it.page) {
                    self.retry.push(it);
                    return;
                }
                // The server sends the page bad again and again: it is broken or lying. Under
                // parity a page has one copy, so the server is declared dead and what it held
                // is rebuilt from the groups' parity (Nswap §IV-B) instead of being reported
                // corrupt while its parity could rebuild it.
                if self.servers[server].alive {
                    let why = format!("page {} came back bad on every read ({what})", it.page);
                    self.mark_dead(server, TransportError::Protocol(why));
                }
            }
            if self.par_reconstructible(it.page) && self.alive_holder(it.page, None).is_none() {
                self.reconstruct.push(it);
                return;
            }
        }
        self.read_elsewhere(server, it, what)
    }

    /// A survivor read failed.
    pub(crate) fn par_read_failed(&mut self, page: u64, slot: u32, transient: bool) {
        self.par_mut().read_failed.push((page, slot, transient));
    }
}
