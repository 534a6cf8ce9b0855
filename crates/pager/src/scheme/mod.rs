//! Redundancy behind one seam: what keeps a page safe when a server dies (paper 004, Reliable
//! Nswap §IV: mirroring and parity; Reed-Solomon stripes go past it with K+M pieces).
//!
//! One module per scheme: [`mirror`] (`none` and `mirror:N`: whole copies), [`parity`]
//! (`parity:N`: Nswap's parity groups, the parity on a server that holds no member) and
//! [`stripe`] (`rs:K+M`: Reed-Solomon stripes). The rest of the pager calls only the hooks
//! below, one per event that matters to a scheme: a page written back, a PUT stored or failed,
//! a GET failed, a server dead or back, a page to reconstruct, a recovery step. Each hook
//! dispatches on the scheme (or, for a reply, on what the request was for: [`Part`],
//! [`PutKind`]); nothing outside this folder asks which scheme it runs.
//!
//! The schemes are `impl Pager` blocks rather than structs over a narrower core because their
//! recovery and sealing wait for replies, and waiting runs the reply handlers, which call back
//! into the scheme. What each scheme keeps of its own lives in its struct ([`parity::Par`],
//! [`stripe::Rs`]); the page table, slots, write-backs and requests stay the pager's.

pub(crate) mod mirror;
pub(crate) mod parity;
pub(crate) mod stripe;

pub(crate) use mirror::Landed;

/// What [`Pager::seal_without_waiting`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sealed {
    /// Nothing was open.
    Nothing,
    /// What was open is sealed or forced to ship: its requests are queued or sent.
    Sent,
    /// An open stripe waits for free slots for its parity pieces.
    NoRoom,
}

use crate::requests::{GetItem, Op, Part, PutItem, PutKind};
use crate::{Disk, Pager, PagerConfig, PagerError, ServerState, Transport};
use netram_policy::redundancy::Scheme;
use netram_proto::PageKey;

/// What one call to [`Pager::recover`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecoveryStep {
    /// Pages whose missing copies were sent out (they count as rebuilt once acknowledged).
    pub started: usize,
    /// Pages found with no copy left anywhere.
    pub unrecoverable: usize,
    /// Pages still to look at.
    pub remaining: usize,
}

/// The redundancy scheme of a pager and the state it keeps.
#[derive(Debug)]
pub(crate) enum Redundancy {
    /// `none` (one copy) or `mirror:N` (N copies on N servers), and recovery's lists.
    Copies(Box<mirror::Copies>),
    /// `parity:N`: open groups, the groups' holders, recovery's state.
    Parity(Box<parity::Par>),
    /// `rs:K+M`: the stripes and where their pieces are.
    Stripe(Box<stripe::Rs>),
}

impl Redundancy {
    pub(crate) fn new(cfg: &PagerConfig, servers: &[ServerState]) -> Self {
        match cfg.redundancy {
            Scheme::None => Redundancy::Copies(Box::new(mirror::Copies::new(1))),
            Scheme::Mirror { copies } => {
                Redundancy::Copies(Box::new(mirror::Copies::new(usize::from(copies))))
            }
            Scheme::ReedSolomon { data, parity } => {
                assert!(
                    // The last region of all is the servers' parity frames.
                    cfg.region < stripe::PIECE_REGION - 1,
                    "region {} leaves no room for stripe pieces",
                    cfg.region
                );
                let rs = stripe::Rs::new(usize::from(data), usize::from(parity), cfg.pages);
                Redundancy::Stripe(Box::new(rs))
            }
            Scheme::Parity { group } => {
                let addrs = servers
                    .iter()
                    .map(|s| {
                        s.info.addr.unwrap_or_else(|| {
                            panic!("parity needs every server's address ({})", s.info.name)
                        })
                    })
                    .collect();
                Redundancy::Parity(Box::new(parity::Par::new(
                    usize::from(group),
                    addrs,
                    cfg.seed,
                )))
            }
        }
    }

    /// Copies the page table records per page: N under `mirror:N`, else one (a parity page has
    /// one copy; a striped page's data piece is found through its stripe, not the table).
    /// Whether pages are kept as whole copies (`none`, `mirror:N`), not in groups or stripes.
    pub(crate) fn copies_only(&self) -> bool {
        matches!(self, Redundancy::Copies(_))
    }

    pub(crate) fn copies(&self) -> usize {
        match self {
            Redundancy::Copies(c) => c.n,
            Redundancy::Parity(_) | Redundancy::Stripe(_) => 1,
        }
    }

    /// Slots a write-back may take besides its own page's: sealing a full stripe takes one
    /// per parity piece (`rs_seal`); a parity group's parity is computed by its holder.
    pub(crate) fn seal_slots(&self) -> usize {
        match self {
            Redundancy::Stripe(rs) => rs.m,
            Redundancy::Copies(_) | Redundancy::Parity(_) => 0,
        }
    }

    /// Slots set aside for rebuilding (decoding stripes, XORing groups, waves of copies) and
    /// for moving pages off a leaving server.
    pub(crate) fn recovery_slots(&self, cfg: &PagerConfig) -> usize {
        match self {
            Redundancy::Copies(_) => cfg.recovery_slots.min(512),
            Redundancy::Parity(_) | Redundancy::Stripe(_) => cfg.recovery_slots,
        }
    }

    /// Slots the scheme holds (`owned`), and slots of others' it uses (`used`), for the
    /// invariants.
    pub(crate) fn slots_held(&self, owned: &mut Vec<u32>, used: &mut Vec<u32>) {
        match self {
            Redundancy::Stripe(rs) => rs.slots_held(owned, used),
            Redundancy::Parity(par) => par.slots_held(owned),
            Redundancy::Copies(_) => {}
        }
    }

    pub(crate) fn whole_copies(&self) -> Option<&mirror::Copies> {
        match self {
            Redundancy::Copies(c) => Some(c),
            _ => None,
        }
    }
    pub(crate) fn whole_copies_mut(&mut self) -> Option<&mut mirror::Copies> {
        match self {
            Redundancy::Copies(c) => Some(c),
            _ => None,
        }
    }
    pub(crate) fn parity(&self) -> Option<&parity::Par> {
        match self {
            Redundancy::Parity(p) => Some(p),
            _ => None,
        }
    }
    pub(crate) fn parity_mut(&mut self) -> Option<&mut parity::Par> {
        match self {
            Redundancy::Parity(p) => Some(p),
            _ => None,
        }
    }
    pub(crate) fn stripe(&self) -> Option<&stripe::Rs> {
        match self {
            Redundancy::Stripe(rs) => Some(rs),
            _ => None,
        }
    }
    pub(crate) fn stripe_mut(&mut self) -> Option<&mut stripe::Rs> {
        match self {
            Redundancy::Stripe(rs) => Some(rs),
            _ => None,
        }
    }
}

/// The hooks: each event a scheme reacts to, dispatched to the scheme's module.
impl<T: Transport, D: Disk> Pager<T, D> {
    /// A page's write-back has begun (its data in `writeback`): send what keeps it safe.
    pub(crate) fn written_back(&mut self, page: u64) -> Result<(), PagerError> {
        match &self.scheme {
            Redundancy::Stripe(_) => self.rs_write(page),
            Redundancy::Parity(_) => self.par_place(page),
            Redundancy::Copies(_) => self.place_copies(page),
        }
    }

    /// Places what a page in write-back still lacks (after a refusal or a failure).
    pub(crate) fn place(&mut self, page: u64) -> Result<(), PagerError> {
        match &self.scheme {
            Redundancy::Parity(_) => self.par_place(page),
            Redundancy::Copies(_) => self.place_copies(page),
            Redundancy::Stripe(_) => unreachable!("a stripe places pieces, not pages"),
        }
    }

    /// A server stored a PUT.
    pub(crate) fn stored(&mut self, it: PutItem, server: usize) -> Result<(), PagerError> {
        match it.kind {
            PutKind::Copy => self.copy_stored(it, server),
            PutKind::Piece(piece) => self.rs_stored(it.page as u32, piece, server),
            PutKind::Parity(_) => self.par_stored(it, server),
        }
    }

    /// A PUT that will not be stored (refused, server dead): the data is still in its slot.
    pub(crate) fn put_failed(&mut self, it: PutItem, server: usize) -> Result<(), PagerError> {
        match it.kind {
            PutKind::Copy => self.copy_failed(it.page, server),
            PutKind::Piece(piece) => self.rs_piece_failed(it.page as u32, piece, server),
            PutKind::Parity(_) => self.par_put_failed(it, server),
        }
    }

    /// A GET that got no good data from `server` (dead, bad checksum, missing: `what`).
    pub(crate) fn get_failed(&mut self, server: usize, it: GetItem, what: Option<&'static str>) {
        if crate::ticket::is_ticket(it.pos) && self.ticket_outdated(&it) {
            // The page changed while its read by ticket was on its way: the server answered
            // for the newer version, not wrongly (`ticket.rs`).
            return self.restart_ticket(it);
        }
        match (it.part, &self.scheme) {
            (Part::Survivor, _) => {
                // A survivor of a parity group, or a page to protect again: recovery looks at
                // what came back.
                self.par_read_failed(server, &it, what);
                self.release_slot(it.slot);
            }
            (Part::Piece(piece), _) => {
                // The pager's own read of a stripe's piece: its caller sees it missing
                // (recovery by its count of reads out, `rs_fetch` by its absence).
                if let Some(what) = what {
                    self.rs_bad_piece(it.page as u32, piece, server, what);
                }
                if it.pos == crate::requests::RECOVERY {
                    self.rs_read_settled(it.page as u32);
                }
                self.release_slot(it.slot);
            }
            (Part::Page, Redundancy::Stripe(_)) => self.rs_get_failed(server, it, what),
            (Part::Page, Redundancy::Parity(_)) => self.par_get_failed(server, it, what),
            (Part::Page, Redundancy::Copies(_)) => self.copy_get_failed(server, it, what),
        }
    }

    /// The first live server that holds a page's current version, other than `not`.
    pub(crate) fn alive_holder(&self, page: u64, not: Option<usize>) -> Option<usize> {
        if self.table.get(page).lost {
            return None;
        }
        let live = |s: &usize| self.servers[*s].alive && Some(*s) != not;
        match &self.scheme {
            Redundancy::Stripe(_) => self.rs_data_server(page).flatten().filter(live),
            _ => self.table.holders(page).iter().find(live),
        }
    }

    /// Whether a page out of reach can be decoded from the rest of its stripe or group.
    pub(crate) fn reconstructible(&self, page: u64) -> bool {
        match &self.scheme {
            Redundancy::Stripe(_) => self.rs_reconstructible(page),
            Redundancy::Parity(_) => self.par_reconstructible(page),
            Redundancy::Copies(_) => false,
        }
    }

    /// A read whose page has no copy in reach but can be reconstructed. A read by ticket waits
    /// for recovery to bring its page back, which never waits (`rs_serve_waiters`,
    /// `par_serve_waiters`); the others are decoded by `run_reconstructions`, which does.
    pub(crate) fn reconstruct_later(&mut self, it: GetItem) {
        let ticket = crate::ticket::is_ticket(it.pos);
        match &mut self.scheme {
            Redundancy::Stripe(rs) if ticket => rs.waiters.push(it),
            Redundancy::Parity(par) if ticket => par.waiters.push(it),
            _ => self.reconstruct.push(it),
        }
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

    /// Decodes a page into `slot` from the rest of its stripe or group; false when it cannot.
    pub(crate) fn reconstruct(&mut self, page: u64, slot: u32) -> Result<bool, PagerError> {
        match &self.scheme {
            Redundancy::Stripe(_) => self.rs_reconstruct(page, slot),
            Redundancy::Parity(_) => {
                let rebuilt = self.par_reconstruct(page, slot)?;
                self.counters.degraded_reads += u64::from(rebuilt);
                Ok(rebuilt)
            }
            Redundancy::Copies(_) => Ok(false),
        }
    }

    /// The key a page's current version is stored under (under Reed-Solomon, its data piece's).
    pub(crate) fn stored_key(&self, page: u64) -> PageKey {
        self.rs_key(page).unwrap_or_else(|| self.key(page))
    }

    /// What deletes superseded copies on a server (a parity pager tracks them, see [`Op::Gc`]).
    pub(crate) fn delete_op(&self, keys: &[PageKey]) -> Op {
        match &self.scheme {
            Redundancy::Parity(_) => Op::Gc(keys.to_vec()),
            _ => Op::Delete,
        }
    }

    /// A page is discarded: the copies to delete, per server, go to `deletes`. A striped
    /// page's piece stays while its stripe has other live members.
    pub(crate) fn discarded(&mut self, page: u64, deletes: &mut [Vec<PageKey>]) {
        match &mut self.scheme {
            Redundancy::Stripe(_) => return self.rs_member_dead(page),
            Redundancy::Copies(c) => c.forget(page),
            Redundancy::Parity(_) => {}
        }
        for s in self.table.holders(page).iter() {
            if self.servers[s].alive {
                deletes[s].push(self.key(page));
            }
        }
    }

    /// Sends what waits to be sealed (an open stripe, an open parity group) before a page of it
    /// is waited for; with `None` (every slot is waiting in one), every open parity group.
    pub(crate) fn seal_open(&mut self, page: Option<u64>) -> Result<(), PagerError> {
        match (&self.scheme, page) {
            (Redundancy::Stripe(rs), Some(p)) if !rs.is_open(p) => Ok(()),
            (Redundancy::Stripe(_), Some(_)) => self.rs_seal(),
            // Only parity keeps whole slots waiting for a batch that may never fill.
            (Redundancy::Stripe(_), None) => Ok(()),
            (Redundancy::Parity(p), Some(page)) if !p.is_open(page) => Ok(()),
            (Redundancy::Parity(_), page) => self.par_seal(page),
            (Redundancy::Copies(_), _) => Ok(()),
        }
    }

    /// `settle_writes`' sealing without its waiting, for [`Pager::try_flush`]: seals what the
    /// scheme keeps open (an open stripe, when slots for its parity pieces are free; every
    /// open group, forced to ship once its members are acknowledged) and says what it did.
    pub(crate) fn seal_without_waiting(&mut self) -> Result<Sealed, PagerError> {
        match &self.scheme {
            Redundancy::Copies(_) => Ok(Sealed::Nothing),
            Redundancy::Stripe(rs) if rs.open_is_empty() => Ok(Sealed::Nothing),
            Redundancy::Stripe(rs) => {
                if self.free_slots.len() < rs.m {
                    return Ok(Sealed::NoRoom);
                }
                self.rs_seal()?;
                Ok(Sealed::Sent)
            }
            Redundancy::Parity(p) if p.open_is_empty() => Ok(Sealed::Nothing),
            Redundancy::Parity(_) => {
                self.par_seal(None)?;
                Ok(Sealed::Sent)
            }
        }
    }

    /// What `flush` and a write-through promise: every page written is stored (its stripe
    /// sealed, its group's parity shipped) and everything in flight is answered.
    pub(crate) fn settle_writes(&mut self) -> Result<(), PagerError> {
        match &self.scheme {
            Redundancy::Parity(_) => self.par_settle(),
            Redundancy::Stripe(_) => {
                self.rs_seal()?;
                self.drain()
            }
            Redundancy::Copies(_) => self.drain(),
        }
    }

    /// A write-back of whole copies settled ([`Landed`]): recovery's lists learn what the
    /// page still lacks. Other schemes keep no such list.
    pub(crate) fn copies_landed(&mut self, page: u64, landed: Landed) {
        if let Some(c) = self.scheme.whole_copies_mut() {
            c.landed(page, landed);
        }
    }

    /// Whether recovery has work on a page (it lacks copies, or is being rebuilt): such a page
    /// is moved by its owner, which writes every copy anew, never handed server to server.
    pub(crate) fn in_recovery(&self, page: u64) -> bool {
        self.scheme.whole_copies().is_some_and(|c| c.has(page))
    }

    /// Whether recovery's own read of a page is out (a move waits for it to land).
    pub(crate) fn recovery_reading(&self, page: u64) -> bool {
        self.scheme.whole_copies().is_some_and(|c| c.reading(page))
    }

    /// Pages (stripes, under Reed-Solomon) whose rebuild's reads are out.
    pub(crate) fn rebuilding_pages(&self) -> usize {
        match &self.scheme {
            Redundancy::Copies(c) => c.rebuilding(),
            Redundancy::Stripe(rs) => rs.rebuilding(),
            Redundancy::Parity(_) => 0,
        }
    }

    /// One of the pager's own reads is in: whether the scheme took it (a parity survivor's,
    /// for recovery's round); the others go to `fetched`.
    pub(crate) fn scheme_read_done(&mut self, d: &crate::requests::ReadDone) -> bool {
        match &mut self.scheme {
            Redundancy::Parity(par) if d.part == Part::Survivor => {
                par.survivor_read(d.page, d.slot);
                true
            }
            _ => false,
        }
    }

    /// Moves the degraded reads by ticket that wait for recovery on (`rs_serve_waiters`,
    /// `par_serve_waiters`).
    pub(crate) fn serve_waiters(&mut self) -> Result<(), PagerError> {
        match &self.scheme {
            Redundancy::Stripe(rs) if !rs.waiters.is_empty() => self.rs_serve_waiters(),
            Redundancy::Parity(par) if !par.waiters.is_empty() => self.par_serve_waiters(),
            _ => Ok(()),
        }
    }

    /// Every slot is taken and nothing is in flight: whether recovery gave back slots its
    /// reads held (its round starts again later).
    pub(crate) fn recovery_yield(&mut self) -> bool {
        match &self.scheme {
            Redundancy::Parity(_) => self.par_yield(),
            Redundancy::Stripe(_) => self.rs_yield(),
            Redundancy::Copies(_) => false,
        }
    }

    /// A server is not (or no longer) leaving: what the scheme asked it about its pages is
    /// forgotten (a parity holder's scan).
    pub(crate) fn not_leaving(&mut self, server: usize) {
        if let Redundancy::Parity(_) = &self.scheme {
            self.par_forget_leaving_scan(server);
        }
    }

    /// A leaving server has none of our pages the page table knows of: pages the scheme keeps
    /// there otherwise, to move (a parity holder's groups' members, sent to new groups);
    /// `None` while it waits for the server's answer.
    pub(crate) fn release_leaving(&mut self, server: usize, want: usize) -> Option<Vec<u64>> {
        match &self.scheme {
            Redundancy::Parity(_) => self.par_release_holder(server, want),
            _ => Some(Vec::new()),
        }
    }

    /// Up to `want` pages whose move frees a frame on a leaving `server`, and whether we hold
    /// anything there, for a scheme whose pieces the page table does not list (stripes);
    /// `None` for the others, whose pages the table finds.
    pub(crate) fn scheme_leaving_pages(
        &mut self,
        server: usize,
        want: usize,
    ) -> Option<(Vec<u64>, bool)> {
        match &self.scheme {
            Redundancy::Stripe(_) => Some(self.rs_leaving_pages(server, want)),
            _ => None,
        }
    }

    /// An answer only a scheme's own requests get (a parity holder's, see [`parity::Answer`]).
    pub(crate) fn scheme_answer(
        &mut self,
        server: usize,
        answer: parity::Answer,
    ) -> Result<(), PagerError> {
        self.par_answer(server, answer)
    }

    /// A server was declared dead, before its requests fail over.
    pub(crate) fn server_lost(&mut self, server: usize) {
        if let Redundancy::Parity(_) = &self.scheme {
            // A read that failed there is rebuilt from parity, and the pages it held wait for
            // recovery.
            self.par_server_dead(server);
        }
    }

    /// A dead server's requests have failed over.
    pub(crate) fn server_failed_over(&mut self, server: usize) {
        match &self.scheme {
            Redundancy::Copies(_) => self.copies_server_dead(server),
            Redundancy::Stripe(_) => self.rs_server_dead(server),
            Redundancy::Parity(_) => {}
        }
    }

    /// A dead server came back, empty.
    pub(crate) fn server_revived(&mut self, server: usize) {
        match &self.scheme {
            Redundancy::Copies(_) => self.copies_server_revived(server),
            Redundancy::Stripe(_) => self.rs_server_revived(server),
            // Parity recovery rebuilt (or is rebuilding) what it held from the groups.
            Redundancy::Parity(_) => {}
        }
    }

    /// How many of this pager's pages (pieces, under Reed-Solomon) each server holds.
    pub fn pages_per_server(&self) -> Vec<u64> {
        match &self.scheme {
            Redundancy::Stripe(_) => self.rs_pieces_per_server(),
            _ => self.table.pages_per_server(self.servers.len()),
        }
    }

    /// What keeps a page safe, for checkers: (server, key, version) of every piece the page
    /// table counts (its copies, or its stripe's pieces), and how many the scheme wants.
    /// `None` while its write-back is in flight.
    pub fn pieces(&self, page: u64) -> Option<(crate::Pieces, usize)> {
        let loc = self.location(page)?;
        if let Some(p) = self.rs_pieces(page) {
            return Some(p);
        }
        let key = self.key(page);
        let pieces = loc.holders.iter().map(|&s| (s, key, loc.version)).collect();
        Some((pieces, self.scheme.copies()))
    }

    /// Pages (under Reed-Solomon: stripes) that lack some of what keeps them safe, which
    /// recovery still has to look at.
    pub fn degraded_pages(&self) -> usize {
        match &self.scheme {
            Redundancy::Stripe(_) => self.rs_degraded(),
            Redundancy::Parity(p) => p.pending(),
            Redundancy::Copies(c) => c.pending(),
        }
    }

    /// Pages recovery could not give every copy for want of servers with room; the local disk
    /// backs them meanwhile. They are tried again when a server comes back.
    pub fn pages_short_of_copies(&self) -> usize {
        match &self.scheme {
            Redundancy::Stripe(rs) => rs.short.len(),
            Redundancy::Copies(c) => c.short(),
            Redundancy::Parity(_) => 0,
        }
    }

    /// Rebuilds what up to `max_pages` degraded pages lack (Nswap §IV-B3): new copies from a
    /// surviving one, a lost page from its group's parity, lost pieces from their stripe. The
    /// caller sets the pace ([`Pager::on_tick`] spreads it over time).
    pub fn recover(&mut self, max_pages: usize) -> Result<RecoveryStep, PagerError> {
        match &self.scheme {
            Redundancy::Stripe(_) => self.rs_recover(max_pages),
            Redundancy::Parity(_) => self.par_recover(max_pages),
            Redundancy::Copies(_) => self.copies_recover(max_pages),
        }
    }
}
