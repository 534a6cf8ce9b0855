//! Redundancy behind one seam: what keeps a page safe when a server dies (paper 004, Reliable
//! Nswap §IV: mirroring and parity; Reed-Solomon stripes go past it with K+M pieces).
//!
//! A scheme is a type implementing one trait, [`Redundancy`], in its own module: [`mirror`]
//! (`none` and `mirror:N`: whole copies), [`parity`] (`parity:N`: Nswap's parity groups, the
//! parity on a server that holds no member) and [`stripe`] (`rs:K+M`: Reed-Solomon stripes).
//! The trait has one method per event that matters to a scheme — a page written back, a PUT
//! stored or failed, a GET failed, a server dead, back or leaving, a page to reconstruct, what
//! is open to seal, a recovery step — and [`build`] is the one place where schemes are named.
//! The rest of the pager calls the hooks of `pager/hooks.rs`, which hand each event to
//! the pager's scheme; nothing outside this folder asks which scheme it runs (but the kinds
//! of request only one scheme sends are named in `pager/requests.rs`, and the reply handler
//! hands the answers to parity's own requests to `parity::answer`). What a scheme
//! keeps (its lists, groups, stripes) is its own type ([`mirror::Copies`], [`parity::Par`],
//! [`stripe::Rs`]), which the pager holds without knowing it ([`SchemeState`]); the numbers the
//! pager sizes its slots by are its [`Shape`].
//!
//! A scheme's methods take the pager, not the scheme's state by `&mut self`: a scheme's work
//! re-enters it (sending finds a server dead and its failed PUTs come back to `put_failed`
//! while `written_back` still places; recovery reads replies, which reach `stored`), so each
//! borrows its state only while it uses it. The pager's fields are private to its folder
//! (`crate::pager`): a scheme uses its operations and the accessors of `pager/hooks.rs`.

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

use crate::requests::{GetItem, Op, PutItem};
use crate::{Disk, Pager, PagerConfig, PagerError, ServerState, Transport};
use netram_policy::redundancy::Scheme;
use netram_proto::PageKey;
use std::any::Any;

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

/// A redundancy scheme: what it does on each event that matters to it. Implemented once per
/// folder ([`mirror::Mirror`], [`parity::Parity`], [`stripe::Stripe`]) by a type without
/// fields; what a scheme keeps (its lists, groups, stripes) is its state type, held by the
/// pager as a [`SchemeState`] and reached by the scheme alone.
///
/// The methods take the pager rather than `&mut self` of the state because a scheme's work
/// re-enters the scheme: sending may find a server dead, whose failed PUTs come back to
/// `put_failed` while `written_back` is still placing; recovery reads replies, which reach
/// `stored`. A method borrows its state for as long as it uses it, never across a call into
/// the pager. Defaults are what a scheme of whole copies without lists does.
pub(crate) trait Redundancy<T: Transport, D: Disk>: Sync {
    // Placing.

    /// A page's write-back has begun (its data in `writeback`): send what keeps it safe.
    fn written_back(&self, p: &mut Pager<T, D>, page: u64) -> Result<(), PagerError>;
    /// Places what a page in write-back still lacks (after a refusal or a failure).
    fn place(&self, p: &mut Pager<T, D>, page: u64) -> Result<(), PagerError>;
    /// A server stored one of the scheme's PUTs.
    fn stored(&self, p: &mut Pager<T, D>, it: PutItem, server: usize) -> Result<(), PagerError>;
    /// A PUT that will not be stored (refused, server dead): the data is still in its slot.
    fn put_failed(&self, p: &mut Pager<T, D>, it: PutItem, server: usize)
        -> Result<(), PagerError>;
    /// A write-back of whole copies settled ([`Landed`]): what the page still lacks.
    fn landed(&self, _p: &mut Pager<T, D>, _page: u64, _landed: Landed) {}
    /// An answer only the scheme's own requests get (a parity holder's).
    fn answer(
        &self,
        _p: &mut Pager<T, D>,
        _server: usize,
        answer: parity::Answer,
    ) -> Result<(), PagerError> {
        unreachable!("an answer to a request this scheme never sends: {answer:?}")
    }

    // Reading.

    /// A GET of the scheme's that got no good data from `server` (dead, bad checksum,
    /// missing: `what`); a read by ticket outdated meanwhile has been restarted before.
    fn get_failed(
        &self,
        p: &mut Pager<T, D>,
        server: usize,
        it: GetItem,
        what: Option<&'static str>,
    );
    /// The first live server that holds a page's current version, other than `not`.
    fn alive_holder(&self, p: &Pager<T, D>, page: u64, not: Option<usize>) -> Option<usize> {
        let live = |s: &usize| p.server_states()[*s].alive && Some(*s) != not;
        p.table().holders(page).iter().find(live)
    }
    /// Whether a page out of reach can be decoded from the rest of its stripe or group.
    fn reconstructible(&self, _p: &Pager<T, D>, _page: u64) -> bool {
        false
    }
    /// A degraded read by ticket, parked until recovery brings its page back (`Err` gives it
    /// back when the scheme keeps no such list: it is decoded the waiting way).
    fn park(&self, _p: &mut Pager<T, D>, it: GetItem) -> Result<(), GetItem> {
        Err(it)
    }
    /// Moves the parked degraded reads on.
    fn serve_parked(&self, _p: &mut Pager<T, D>) -> Result<(), PagerError> {
        Ok(())
    }
    /// Decodes a page into `slot` from the rest of its stripe or group; false when it cannot.
    fn reconstruct(
        &self,
        _p: &mut Pager<T, D>,
        _page: u64,
        _slot: u32,
    ) -> Result<bool, PagerError> {
        Ok(false)
    }
    /// The key a page's current version is stored under, when not the page's own (a striped
    /// page's data piece).
    fn stored_key(&self, _p: &Pager<T, D>, _page: u64) -> Option<PageKey> {
        None
    }
    /// One of the pager's own reads is in: whether the scheme takes it (else `fetched` does).
    fn read_done(&self, _p: &mut Pager<T, D>, _d: &crate::requests::ReadDone) -> bool {
        false
    }

    // Deleting.

    /// What deletes superseded copies on a server.
    fn delete_op(&self, _keys: &[PageKey]) -> Op {
        Op::Delete
    }
    /// A page is discarded: the copies to delete, per server, go to `deletes`.
    fn discarded(&self, p: &mut Pager<T, D>, page: u64, deletes: &mut [Vec<PageKey>]) {
        delete_copies(p, page, deletes);
    }

    // Sealing.

    /// Sends what waits to be sealed (an open stripe or group) before a page of it is waited
    /// for; with `None` (every slot is waiting in one), everything open that holds slots.
    fn seal_open(&self, _p: &mut Pager<T, D>, _page: Option<u64>) -> Result<(), PagerError> {
        Ok(())
    }
    /// Seals what is open without waiting, and says what it did.
    fn seal_without_waiting(&self, _p: &mut Pager<T, D>) -> Result<Sealed, PagerError> {
        Ok(Sealed::Nothing)
    }
    /// What `flush` and a write-through promise: every page written is stored and everything
    /// in flight is answered.
    fn settle_writes(&self, p: &mut Pager<T, D>) -> Result<(), PagerError> {
        p.drain()
    }

    // Servers.

    /// A server was declared dead, before its requests fail over.
    fn server_lost(&self, _p: &mut Pager<T, D>, _server: usize) {}
    /// A dead server's requests have failed over.
    fn server_failed_over(&self, _p: &mut Pager<T, D>, _server: usize) {}
    /// A dead server came back, empty.
    fn server_revived(&self, _p: &mut Pager<T, D>, _server: usize) {}
    /// A server is not (or no longer) leaving: what was asked of it about its pages goes.
    fn not_leaving(&self, _p: &mut Pager<T, D>, _server: usize) {}
    /// A leaving server has none of our pages the page table knows of: pages kept there
    /// otherwise, to move; `None` while the server's answer is awaited.
    fn release_leaving(
        &self,
        _p: &mut Pager<T, D>,
        _server: usize,
        _want: usize,
    ) -> Option<Vec<u64>> {
        Some(Vec::new())
    }
    /// Up to `want` pages whose move frees a frame on a leaving `server`, and whether we hold
    /// anything there, when the page table does not say (stripes' pieces).
    fn leaving_pages(
        &self,
        _p: &mut Pager<T, D>,
        _server: usize,
        _want: usize,
    ) -> Option<(Vec<u64>, bool)> {
        None
    }

    // Recovery.

    /// One step of rebuilding what up to `max_pages` degraded pages lack; never waits.
    fn recover(&self, p: &mut Pager<T, D>, max_pages: usize) -> Result<RecoveryStep, PagerError>;
    /// Pages (stripes) recovery still has to look at.
    fn degraded_pages(&self, p: &Pager<T, D>) -> usize;
    /// Pages (stripes) recovery could not make whole for want of servers with room.
    fn pages_short_of_copies(&self, _p: &Pager<T, D>) -> usize {
        0
    }
    /// Pages (stripes) whose rebuild's reads are out.
    fn rebuilding_pages(&self, _p: &Pager<T, D>) -> usize {
        0
    }
    /// Every slot is taken and nothing is in flight: whether recovery gave back slots its
    /// reads held.
    fn recovery_yield(&self, _p: &mut Pager<T, D>) -> bool {
        false
    }
    /// Whether recovery has work on a page (moved by its owner, not handed server to server).
    fn in_recovery(&self, _p: &Pager<T, D>, _page: u64) -> bool {
        false
    }
    /// Whether recovery's own read of a page is out.
    fn recovery_reading(&self, _p: &Pager<T, D>, _page: u64) -> bool {
        false
    }
    /// Whether recovery has reads of its own out that land in `fetched` (whole copies').
    fn own_reads_out(&self, _p: &Pager<T, D>) -> bool {
        false
    }
    /// Recovery's reads that landed in `fetched` (or failed) go on now, ahead of its next
    /// step: a slot is wanted and they hold some.
    fn own_reads_in(&self, _p: &mut Pager<T, D>) -> Result<(), PagerError> {
        Ok(())
    }

    // Reports.

    /// How many of this pager's pages (pieces) each server holds.
    fn pages_per_server(&self, p: &Pager<T, D>) -> Vec<u64> {
        p.table().pages_per_server(p.server_states().len())
    }
    /// (server, key, version) of every piece of a page, and how many the scheme wants, when
    /// they are not its copies in the page table.
    fn pieces(&self, _p: &Pager<T, D>, _page: u64) -> Option<(crate::Pieces, usize)> {
        None
    }
    /// Slots the scheme holds (`owned`), and others' it uses (`used`), for the invariants.
    fn slots_held(&self, _p: &Pager<T, D>, _owned: &mut Vec<u32>, _used: &mut Vec<u32>) {}
}

/// The copies of a discarded page that the page table lists, to delete from live servers.
pub(crate) fn delete_copies<T: Transport, D: Disk>(
    p: &Pager<T, D>,
    page: u64,
    deletes: &mut [Vec<PageKey>],
) {
    for s in p.table().holders(page).iter() {
        if p.server_states()[s].alive {
            deletes[s].push(p.key(page));
        }
    }
}

/// What a scheme keeps of its own (its state type, e.g. [`parity::Par`]), held by the pager
/// and reached by the scheme alone.
pub(crate) struct SchemeState(Box<dyn Any + Send>);

impl SchemeState {
    pub(crate) fn new<S: Any + Send>(state: S) -> Self {
        Self(Box::new(state))
    }
    pub(crate) fn get<S: Any>(&self) -> Option<&S> {
        self.0.downcast_ref()
    }
    pub(crate) fn get_mut<S: Any>(&mut self) -> Option<&mut S> {
        self.0.downcast_mut()
    }
}

impl std::fmt::Debug for SchemeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SchemeState")
    }
}

/// The numbers of a scheme that the rest of the pager sizes things by.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    /// Copies the page table records per page: N under `mirror:N`, else one (a parity page
    /// has one copy; a striped page's data piece is found through its stripe).
    pub(crate) copies: usize,
    /// Slots a write-back may take besides its own page's (sealing a full stripe takes one per
    /// parity piece; a parity group's parity is computed by its holder).
    pub(crate) seal_slots: usize,
    /// Slots set aside for rebuilding and for moving pages off a leaving server.
    pub(crate) recovery_slots: usize,
    /// Whether pages are kept as whole copies (`none`, `mirror:N`), not in groups or stripes:
    /// a move copies the page, and may go server to server.
    pub(crate) whole_copies: bool,
}

/// A pager's scheme, built from its configuration: the one place where schemes are named.
pub(crate) struct Built<T: Transport, D: Disk> {
    pub(crate) scheme: &'static dyn Redundancy<T, D>,
    pub(crate) state: SchemeState,
    pub(crate) shape: Shape,
}

pub(crate) fn build<T: Transport, D: Disk>(
    cfg: &PagerConfig,
    servers: &[ServerState],
) -> Built<T, D> {
    match cfg.redundancy {
        Scheme::None => mirror::build(cfg, 1),
        Scheme::Mirror { copies } => mirror::build(cfg, usize::from(copies)),
        Scheme::ReedSolomon { data, parity } => {
            stripe::build(cfg, usize::from(data), usize::from(parity))
        }
        Scheme::Parity { group } => parity::build(cfg, servers, usize::from(group)),
    }
}
