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
use crate::scheme::{Built, RecoveryStep, Redundancy, SchemeState, Sealed, Shape};
use crate::table::Servers;
use crate::writeback::Writeback;

mod recover;
use crate::{Disk, Pager, PagerConfig, PagerError, ServerState, Transport, TransportError};
use netram_policy::placement::{self, Candidate};
use netram_proto::{
    DeleteStatus, Delta, DeltaKind, Member, OwnedRecord, Owner, Page, PageKey, PutStatus, Record,
    Reply, Request,
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

/// Recovery rounds a superseded survivor found missing is looked for again (see
/// [`Pager::par_read_failed`]) before its group is given up.
const MISSING_TRIES: u32 = 8;

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
    /// Holds a page no caller waits for (written by recovery or by a migration, or placed
    /// again after a failure): recovery work until shipped, so that it is not left waiting
    /// for later writes to fill its group — which may never come (a migration off one of
    /// three servers under `parity:2` found no server for a second member, and its
    /// write-backs waited for the program's next flush).
    unattended: bool,
}

/// What a server answered to a parity pager's own requests (the reply's meaning, taken in by
/// [`Pager::par_answer`]).
#[derive(Debug)]
pub(crate) enum Answer {
    /// A PUT not stored: the server could not tell the page's parity holder (which may have
    /// changed its group all the same). Sent again, or placed elsewhere.
    Refused(PutItem),
    /// A PUT stored outside any parity group: it joins a new one.
    Unprotected(PutItem),
    /// A group's parity shipped to its holder, or not (by the SHIP's request id).
    Shipped(u64),
    ShipFailed(u64),
    /// A holder's scan of its groups, by its request's id.
    Scanned(u64, Vec<ScannedGroup>, Vec<PageKey>),
    /// Copies the server could not delete yet (their holder unreachable).
    Stale(Vec<PageKey>),
}

/// What a status to one of a parity pager's PUTs means, when it means something only such a
/// PUT can get (`None`: as for any PUT).
pub(crate) fn put_answer(it: PutItem, status: PutStatus) -> Option<Answer> {
    match status {
        // Stored outside any group: it joins a new one.
        PutStatus::Unprotected => Some(Answer::Unprotected(it)),
        PutStatus::HolderUnreachable => Some(Answer::Refused(it)),
        _ => None,
    }
}

/// Whether `reply` is the answer to a parity pager's own request `op` (a SHIP, a delta, a
/// scan, a collection of superseded copies), of the right shape.
pub(crate) fn answers(op: &Op, reply: &Reply<'_>) -> bool {
    match (op, reply) {
        (Op::Ship(_), Reply::Put { .. })
        | (Op::Delta, Reply::ParityDelta { .. })
        | (Op::Scan, Reply::ParityScan { .. }) => true,
        (Op::Gc(keys), Reply::Delete { status, .. }) => status.len() == keys.len(),
        _ => false,
    }
}

/// What a reply to a parity pager's own request says (see [`answers`]); `None`: nothing to
/// do (a delta applied, every superseded copy collected).
pub(crate) fn answer(id: u64, op: Op, reply: &Reply<'_>) -> Option<Answer> {
    match (op, reply) {
        (Op::Ship(id), Reply::Put { status, .. }) => {
            Some(if status.first() == Some(&PutStatus::Stored) {
                Answer::Shipped(id)
            } else {
                Answer::ShipFailed(id)
            })
        }
        (
            Op::Scan,
            Reply::ParityScan {
                groups, orphans, ..
            },
        ) => {
            let groups = groups
                .iter()
                .map(|g| {
                    let mut parity = OwnedRecord::default();
                    parity.xor(&g.record);
                    ScannedGroup {
                        group: g.group,
                        damaged: g.damaged,
                        members: g.members.clone(),
                        parity,
                    }
                })
                .collect();
            Some(Answer::Scanned(id, groups, orphans.clone()))
        }
        (Op::Gc(keys), Reply::Delete { status, .. }) => {
            let stale: Vec<PageKey> = keys
                .iter()
                .zip(status)
                .filter(|(_, s)| **s == DeleteStatus::HolderUnreachable)
                .map(|(k, _)| *k)
                .collect();
            (!stale.is_empty()).then_some(Answer::Stale(stale))
        }
        _ => None,
    }
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

/// A scan's answer.
#[derive(Debug)]
pub(crate) struct Scanned {
    server: usize,
    /// The scan's request.
    id: u64,
    groups: Vec<ScannedGroup>,
    orphans: Vec<PageKey>,
    /// The server's `leaving_changes` when the answer came.
    leaving_changes: u64,
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
    /// Pages whose write-back ended in a new group (joined and shipped) since recovery's last
    /// scans went out, after their server's scan answered: that scan may still call the page
    /// an orphan, and protecting such a page again would delete the very copy its new group
    /// counts on (`Pager::par_protected`).
    pub(crate) rejoined: BTreeSet<u64>,
    /// Scan answers: the server that gave them and the scan's request id.
    scanned: Vec<Scanned>,
    /// A leaving holder's scan (`Pager::par_release_holder`) per server: its request id (none
    /// when one is to be sent), and how many answers in a row named only members written
    /// since it was sent.
    leaving_scans: HashMap<usize, (Option<u64>, u8)>,
    /// Where recovery's round is: it never waits, a later step takes the answers.
    round: recover::Round,
    /// Degraded reads by ticket (a fault on a page whose server died), each waiting in its
    /// slot for recovery to bring its page back (`Pager::par_serve_waiters`).
    pub(crate) waiters: Vec<GetItem>,
    /// Survivor reads that came back good: page and slot. Kept apart from the pager's other
    /// reads of its own (`fetched`): a failed survivor read gives its slot back at once, and a
    /// move of the same page may read into that very slot; matched by (page, slot) in one
    /// list, the move's read was taken for the survivor's and the move left with no read
    /// (`netram sim --seed 395 --scheme parity:4`, with its client sending after each take).
    read_in: Vec<(u64, u32)>,
    /// Survivor reads that failed: page, slot, and whether trying again may help.
    read_failed: Vec<(u64, u32, bool)>,
    /// Superseded survivors found missing, by (server, key, version), and how many times.
    missing_tries: HashMap<(usize, PageKey, u32), u32>,
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
            rejoined: BTreeSet::new(),
            scanned: Vec::new(),
            leaving_scans: HashMap::new(),
            round: recover::Round::Idle,
            waiters: Vec::new(),
            read_in: Vec::new(),
            read_failed: Vec::new(),
            missing_tries: HashMap::new(),
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
            + usize::from(!matches!(self.round, recover::Round::Idle))
    }

    pub(crate) fn is_open(&self, page: u64) -> bool {
        self.member_of.contains_key(&page)
    }

    /// No group is open (every one shipped and acknowledged).
    pub(crate) fn open_is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// For [`Pager::check_invariants`]: the slots this scheme holds (degraded reads by ticket
    /// waiting for their page, survivor reads in; a survivor read that failed gave its slot
    /// back at once).
    pub(crate) fn slots_held(&self, owned: &mut Vec<u32>) {
        owned.extend(self.waiters.iter().map(|it| it.slot));
        owned.extend(self.read_in.iter().map(|&(_, slot)| slot));
    }

    /// A survivor read came back good: recovery's round takes it.
    pub(crate) fn survivor_read(&mut self, page: u64, slot: u32) {
        self.read_in.push((page, slot));
    }
}

/// Nswap's parity groups (its state: [`Par`]).
pub(crate) struct Parity;

/// `parity:N`: groups of `group` pages, each group's parity on a server that holds none of
/// them.
pub(crate) fn build<T: Transport, D: Disk>(
    cfg: &PagerConfig,
    servers: &[ServerState],
    group: usize,
) -> Built<T, D> {
    let addrs = servers
        .iter()
        .map(|s| {
            s.info
                .addr
                .unwrap_or_else(|| panic!("parity needs every server's address ({})", s.info.name))
        })
        .collect();
    Built {
        scheme: &Parity,
        state: SchemeState::new(Par::new(group, addrs, cfg.seed)),
        shape: Shape {
            copies: 1,
            // A group's parity is computed by its holder, not in a slot of ours.
            seal_slots: 0,
            recovery_slots: cfg.recovery_slots,
            whole_copies: false,
        },
    }
}

impl<T: Transport, D: Disk> Redundancy<T, D> for Parity {
    fn written_back(&self, p: &mut Pager<T, D>, page: u64) -> Result<(), PagerError> {
        p.par_place(page)
    }
    fn place(&self, p: &mut Pager<T, D>, page: u64) -> Result<(), PagerError> {
        p.par_place(page)
    }
    fn stored(&self, p: &mut Pager<T, D>, it: PutItem, server: usize) -> Result<(), PagerError> {
        p.par_stored(it, server)
    }
    fn put_failed(
        &self,
        p: &mut Pager<T, D>,
        it: PutItem,
        server: usize,
    ) -> Result<(), PagerError> {
        p.par_put_failed(it, server)
    }
    fn answer(&self, p: &mut Pager<T, D>, server: usize, answer: Answer) -> Result<(), PagerError> {
        p.par_answer(server, answer)
    }
    fn get_failed(
        &self,
        p: &mut Pager<T, D>,
        server: usize,
        it: GetItem,
        what: Option<&'static str>,
    ) {
        if it.part == Part::Survivor {
            // A survivor of a parity group, or a page to protect again: recovery looks at
            // what came back.
            p.par_read_failed(server, &it, what);
            p.release_slot(it.slot);
        } else {
            p.par_get_failed(server, it, what);
        }
    }
    fn reconstructible(&self, p: &Pager<T, D>, page: u64) -> bool {
        p.par_reconstructible(page)
    }
    fn park(&self, p: &mut Pager<T, D>, it: GetItem) -> Result<(), GetItem> {
        p.par_mut().waiters.push(it);
        Ok(())
    }
    fn serve_parked(&self, p: &mut Pager<T, D>) -> Result<(), PagerError> {
        if p.par().waiters.is_empty() {
            return Ok(());
        }
        p.par_serve_waiters()
    }
    fn reconstruct(&self, p: &mut Pager<T, D>, page: u64, slot: u32) -> Result<bool, PagerError> {
        let rebuilt = p.par_reconstruct(page, slot)?;
        p.counters_mut().degraded_reads += u64::from(rebuilt);
        Ok(rebuilt)
    }
    fn read_done(&self, p: &mut Pager<T, D>, d: &crate::requests::ReadDone) -> bool {
        if d.part != Part::Survivor {
            return false;
        }
        p.par_mut().survivor_read(d.page, d.slot);
        true
    }
    fn delete_op(&self, keys: &[PageKey]) -> Op {
        Op::Gc(keys.to_vec())
    }
    fn seal_open(&self, p: &mut Pager<T, D>, page: Option<u64>) -> Result<(), PagerError> {
        match page {
            Some(page) if !p.par().is_open(page) => Ok(()),
            page => p.par_seal(page),
        }
    }
    fn seal_without_waiting(&self, p: &mut Pager<T, D>) -> Result<Sealed, PagerError> {
        if p.par().open_is_empty() {
            return Ok(Sealed::Nothing);
        }
        // Every open group, forced to ship once its members are acknowledged.
        p.par_seal(None)?;
        Ok(Sealed::Sent)
    }
    fn settle_writes(&self, p: &mut Pager<T, D>) -> Result<(), PagerError> {
        p.par_settle()
    }
    fn server_lost(&self, p: &mut Pager<T, D>, server: usize) {
        // A read that failed there is rebuilt from parity, and the pages it held wait for
        // recovery. (Its revival needs nothing: recovery rebuilt, or is rebuilding, what it
        // held from the groups.)
        p.par_server_dead(server);
    }
    fn not_leaving(&self, p: &mut Pager<T, D>, server: usize) {
        p.par_forget_leaving_scan(server);
    }
    fn release_leaving(&self, p: &mut Pager<T, D>, server: usize, want: usize) -> Option<Vec<u64>> {
        p.par_release_holder(server, want)
    }
    fn recover(&self, p: &mut Pager<T, D>, max_pages: usize) -> Result<RecoveryStep, PagerError> {
        p.par_recover(max_pages)
    }
    fn degraded_pages(&self, p: &Pager<T, D>) -> usize {
        p.par().pending()
    }
    fn recovery_yield(&self, p: &mut Pager<T, D>) -> bool {
        p.par_yield()
    }
    fn slots_held(&self, p: &Pager<T, D>, owned: &mut Vec<u32>, _used: &mut Vec<u32>) {
        p.par().slots_held(owned);
    }
}

impl<T: Transport, D: Disk> Pager<T, D> {
    fn par(&self) -> &Par {
        self.state().expect("a parity pager")
    }
    pub(crate) fn par_mut(&mut self) -> &mut Par {
        self.state_mut().expect("a parity pager")
    }

    /// Whether a server may take pages or parity now.
    fn par_usable(&self, s: usize) -> bool {
        self.server_states()[s].alive && !self.par().recovering.contains(&s)
    }

    /// The image of a page in write-back, as its group's parity covers it.
    fn par_record(&self, page: u64, version: u32, slot: u32) -> OwnedRecord {
        let p = Page::seal(self.key(page), version, self.slot(slot));
        let mut r = OwnedRecord::default();
        r.xor(&Record::of(&p));
        r
    }

    /// Sends a page in write-back: in place if its server is usable and it may stay in its
    /// group, else into an open group. With no server to take it, it goes to the local disk.
    pub(crate) fn par_place(&mut self, page: u64) -> Result<(), PagerError> {
        let wb = *self.writebacks().get(&page).expect("page in write-back");
        if !wb.pending.is_empty() || self.par().member_of.contains_key(&page) {
            return Ok(());
        }
        let cur = self
            .table()
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
                let migrating = self.migrating(page);
                let (group, holder) = {
                    let g = &mut self.par_mut().open[gi];
                    g.unattended |= wb.join || wb.rebuild || migrating;
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
        let wb = self
            .writebacks_mut()
            .get_mut(&page)
            .expect("page in write-back");
        wb.pending.insert(server);
        let (slot, version) = (wb.slot, wb.version);
        self.counters_mut().puts += 1;
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
            .server_states()
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
            // A holder that shrank its offer takes no new member: its groups must leave.
            if g.shipping
                || g.force
                || g.members.len() >= n
                || !self.par_usable(g.holder)
                || self.server_states()[g.holder].leaving > 0
            {
                continue;
            }
            let mut exclude: Vec<usize> = g.members.iter().map(|m| m.server).collect();
            exclude.push(g.holder);
            exclude.extend(refused.iter());
            let server = match prefer {
                Some(p) => (!exclude.contains(&p)).then_some(p),
                None => placement::choose(&candidates, &exclude, self.rng()),
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
        let holder = placement::choose(&candidates, &exclude, self.rng())?;
        exclude.push(holder);
        let server = match prefer {
            Some(p) => p,
            None => placement::choose(&candidates, &exclude, self.rng())?,
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
        self.counters_mut().parity_groups_opened += 1;
        Some((self.par().open.len() - 1, server))
    }

    fn par_group(&self, id: u64) -> Option<usize> {
        self.par().open.iter().position(|g| g.id == id)
    }

    /// A PUT of a parity page was stored.
    pub(crate) fn par_stored(&mut self, it: PutItem, server: usize) -> Result<(), PagerError> {
        self.par_mut().put_retries.remove(&it.page);
        let Some(wb) = self.writebacks_mut().get_mut(&it.page) else {
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
                        let wb = self
                            .writebacks_mut()
                            .get_mut(&it.page)
                            .expect("checked above");
                        wb.done.remove(server);
                        wb.join = true;
                        self.par_moved(it.page, server);
                        self.counters_mut().parity_rejoins += 1;
                        return self.par_place(it.page);
                    }
                }
                Ok(())
            }
            _ => {
                // Kept in place: in a group whose holder took the delta. Which holder only the
                // server knows: possibly one this pager has given up for dead that the server
                // still reaches, which a scan's orphan report then tells (not `rejoined`).
                self.par_mut().unprotected.remove(&it.page);
                self.finish_writeback(it.page)
            }
        }
    }

    /// A page's write-back ended in a new group, shipped to a live holder, stored on
    /// `server`: it is protected, whatever an older scan said (see `Par::rejoined`). A scan of
    /// `server` still unanswered is not older: that server applied the write first (a
    /// connection's requests are applied in order), so its answer, an orphan or not, is the
    /// newer word (recovery does not stop the program, and the holder may die meanwhile).
    fn par_protected(&mut self, page: u64, server: usize) {
        let newer_scan = self.par_scan_pending(server);
        let par = self.par_mut();
        par.unprotected.remove(&page);
        if !newer_scan {
            par.rejoined.insert(page);
        }
    }

    /// What a server answered to one of this pager's parity requests.
    pub(crate) fn par_answer(&mut self, server: usize, answer: Answer) -> Result<(), PagerError> {
        match answer {
            Answer::Refused(it) => self.par_holder_unreachable(it, server),
            Answer::Unprotected(it) => self.par_unprotected(it, server),
            Answer::Shipped(id) => self.par_shipped(id),
            Answer::ShipFailed(id) => self.par_ship_failed(id),
            Answer::Scanned(id, groups, orphans) => {
                self.par_scanned(server, id, groups, orphans);
                Ok(())
            }
            Answer::Stale(keys) => {
                self.par_stale(server, keys);
                Ok(())
            }
        }
    }

    /// Stored, but outside any group: kept in place, its old group is gone, and it joins a
    /// new one where it is; joining, the server had no room to remember the group, and it
    /// leaves that group (which would otherwise wait for it forever: `netram sim --seed 28841
    /// --scheme parity:4`) and joins one elsewhere.
    pub(crate) fn par_unprotected(&mut self, it: PutItem, server: usize) -> Result<(), PagerError> {
        let Some(wb) = self.writebacks_mut().get_mut(&it.page) else {
            return Ok(());
        };
        wb.pending.remove(server);
        wb.join = true;
        if let PutKind::Parity(PutOp::Join { group, .. }) = it.kind {
            wb.refused.insert(server);
            self.par_leave(group, it.page);
        }
        self.counters_mut().parity_rejoins += 1;
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
            .writebacks()
            .get(&it.page)
            .is_some_and(|wb| wb.version == it.version && wb.pending.contains(server));
        let tries = self.par_mut().put_retries.entry(it.page).or_insert(0);
        *tries += 1;
        if current && *tries <= HOLDER_TRIES && self.server_states()[server].alive {
            self.counters_mut().puts += 1;
            self.counters_mut().parity_puts_retried += 1;
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
        if let Some(wb) = self.writebacks().get(&page) {
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
                node: self.server_states()[m.server].info.node,
                key: PageKey::new(self.config().region, m.page),
                version: m.version,
            })
            .collect();
        let (id, holder, parity) = (g.id, g.holder, g.parity.clone());
        // Recorded before sending: a failed send fails the group at once.
        self.par_mut().open[gi].shipping = true;
        self.counters_mut().parity_ships += 1;
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
        self.counters_mut().parity_groups_shipped += 1;
        for m in g.members {
            self.par_mut().member_of.remove(&m.page);
            if self
                .writebacks()
                .get(&m.page)
                .is_some_and(|wb| wb.version == m.version && wb.pending.is_empty())
            {
                self.par_protected(m.page, m.server);
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
        self.counters_mut().parity_ships_failed += 1;
        self.par_rejoin_all(g.members)
    }

    fn par_rejoin_all(&mut self, members: Vec<OpenMember>) -> Result<(), PagerError> {
        for m in members {
            self.par_mut().member_of.remove(&m.page);
            let Some(wb) = self.writebacks_mut().get_mut(&m.page) else {
                continue;
            };
            if wb.version != m.version || !m.acked {
                // Not stored yet: its reply finds the group gone and places it again.
                continue;
            }
            wb.done.remove(m.server);
            wb.join = true;
            if self.server_states()[m.server].alive {
                self.par_moved(m.page, m.server);
            }
            self.counters_mut().parity_rejoins += 1;
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
        let pages = self.table().pages_on(server);
        let mut lost = Vec::with_capacity(pages.len());
        for page in pages {
            let mut h = self.table().holders(page);
            h.remove(server);
            self.table_mut().set_holders(page, h);
            lost.push((page, self.table().get(page).version));
        }
        let par = self.par_mut();
        par.recovering.insert(server);
        par.lost_on.entry(server).or_default().extend(lost);
    }

    /// Whether a page with no live holder can come back through its group's parity.
    pub(crate) fn par_reconstructible(&self, page: u64) -> bool {
        let Some(par) = self.state::<Par>() else {
            return false;
        };
        let e = self.table().get(page);
        e.present && !e.lost && !e.on_disk && !par.recovering.is_empty()
    }

    /// A degraded read: recovery runs until the page is rebuilt (its data then waits in its
    /// write-back slot) or known lost. True when `slot` holds the page.
    pub(crate) fn par_reconstruct(&mut self, page: u64, slot: u32) -> Result<bool, PagerError> {
        // A bound against a bookkeeping slip, not a limit: recovery's phases each take a
        // step, and a page may be many rounds away.
        for _ in 0..1_000_000 {
            // Rebuilt and in flight, or kept in memory because the disk failed to take it.
            if self.copy_from_memory(page, slot) {
                return Ok(true);
            }
            let e = *self.table().get(page);
            if e.lost || !e.present {
                return Ok(false);
            }
            if e.on_disk {
                // Rebuilt, but no server could take it: the local disk has it.
                self.read_disk_into(page, slot)?;
                return Ok(true);
            }
            if let Some(s) = self.alive_holder(page, None) {
                // Rebuilt and already stored: read it.
                let it = self.page_get_item(page, slot, INTERNAL);
                self.submit_get_item(s, it);
                self.par_drain()?;
                return Ok(self.take_fetched_one(page, slot));
            }
            if self.par().recovering.is_empty() {
                return Ok(false);
            }
            // Recovery never waits: this read does, for recovery's answers.
            self.par_recover(usize::MAX)?;
            if !self.idle() {
                self.complete_one()?;
            }
        }
        Ok(false)
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

    /// A scan's answer, made owned.
    pub(crate) fn par_scanned(
        &mut self,
        server: usize,
        id: u64,
        groups: Vec<ScannedGroup>,
        orphans: Vec<PageKey>,
    ) {
        let leaving_changes = self.server_states()[server].leaving_changes;
        self.par_mut().scanned.push(Scanned {
            server,
            id,
            groups,
            orphans,
            leaving_changes,
        });
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
                    self.retry_elsewhere(it);
                    return;
                }
                // The server sends the page bad again and again: it is broken or lying. Under
                // parity a page has one copy, so the server is declared dead and what it held
                // is rebuilt from the groups' parity (Nswap §IV-B) instead of being reported
                // corrupt while its parity could rebuild it.
                if self.server_states()[server].alive {
                    let why = format!("page {} came back bad on every read ({what})", it.page);
                    self.mark_dead(server, TransportError::Protocol(why));
                }
            }
            if self.par_reconstructible(it.page) && self.alive_holder(it.page, None).is_none() {
                // (A read by ticket waits for recovery, which never waits.)
                self.reconstruct_later(it);
                return;
            }
        }
        self.read_elsewhere(server, it, what)
    }

    /// A survivor read failed. Trying again may help after a bad checksum (in transit), and
    /// for a copy of a page that changed since the holder's scan (written again, moved,
    /// discarded: recovery does not stop the program): its old copy may be deleted or
    /// overwritten in place, the member's server then tells the holder, and a later scan
    /// names the group as it is now (`netram sim --seed 89 --scheme parity:4`: a write-back
    /// ended during recovery, and the group of a member on the dead server was given up for
    /// it). A copy missing for another reason (its server restarted empty) is missing for
    /// good, so a changed page's copy is waited for [`MISSING_TRIES`] rounds at most.
    pub(crate) fn par_read_failed(&mut self, server: usize, it: &GetItem, what: Option<&str>) {
        let changed = it.page < self.config().pages && {
            let e = self.table().get(it.page);
            !e.present || e.version != it.version || !self.table().holders(it.page).contains(server)
        };
        let transient = match what {
            Some("checksum mismatch") => true,
            Some(_) if changed => {
                let tries = self
                    .par_mut()
                    .missing_tries
                    .entry((server, it.key, it.version))
                    .or_insert(0);
                *tries += 1;
                *tries <= MISSING_TRIES
            }
            _ => false,
        };
        self.par_mut()
            .read_failed
            .push((it.page, it.slot, transient));
    }
}
