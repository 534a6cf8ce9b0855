//! Reed-Solomon stripes (`rs:K+M`): K pages written out together form a stripe with M parity
//! pieces computed by `reed-solomon-simd`, each of the K+M pieces on its own server, so that any
//! M servers may die (the erasure-coded far memory of Carbink and Hydra, after Markatos' and
//! Nswap's parity, paper 003 §2.1 and paper 004 §IV).
//!
//! A normal read touches one server: a page's data piece is the page itself, stored under the
//! stripe's piece key. A read whose piece is gone reconstructs the page from K other pieces
//! (a degraded read). Stripes are log-structured: a page written again joins a new stripe, and
//! its old piece stays as long as its old stripe has another live member that may need it for
//! a reconstruction; a stripe whose members are all dead is deleted. Recovery rebuilds the
//! lost pieces of a stripe from K survivors onto servers the stripe does not use yet.
//!
//! Left out: compaction of stripes whose members are mostly dead (their pieces are kept until
//! the last member dies), and parity logging for overwrites in place (Nswap's `parity:N`).

use crate::requests::{GetItem, Op, Part, PutItem, PutKind, ReadDone, INTERNAL, RECOVERY};
use crate::scheme::{Built, RecoveryStep, Redundancy, SchemeState, Sealed, Shape};
use crate::table::Servers;
use crate::{Disk, PagerConfig, PagerError, Transport, PAGE_SIZE};
use crate::{Pager, Request};
use netram_policy::placement::{self, Candidate};
use netram_proto::PageKey;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

mod recover;

/// The stripe maps are looked up per piece read and written: a fast hash, and a fixed one, so
/// that a simulated run does the same at every replay.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::FixedState>;

/// Region bit that sets pieces apart from pages on a server (the store keeps 24-bit regions).
pub(crate) const PIECE_REGION: u32 = 1 << 23;
/// Piece numbers per stripe in the key space (K + M is at most 32).
const KEY_STRIDE: u64 = 32;
const NO_SERVER: u16 = u16::MAX;
pub(crate) const NO_STRIPE: u32 = u32::MAX;

#[derive(Debug, Default)]
pub(crate) struct Stripe {
    /// Member pages (data piece `i` is member `i`) and the version each was sealed with.
    members: Vec<(u64, u32)>,
    /// Whether member `i` is still its page's current version.
    live: Vec<bool>,
    /// The server of each piece, data pieces first; [`NO_SERVER`] when lost or never placed.
    servers: Vec<u16>,
    /// The parity pieces' version: new at every sealing, so a stale piece never passes.
    gen: u32,
}

impl Stripe {
    fn k(&self) -> usize {
        self.members.len()
    }
    fn version(&self, piece: usize) -> u32 {
        self.members.get(piece).map_or(self.gen, |m| m.1)
    }
    fn in_use(&self) -> bool {
        self.live.iter().any(|&l| l)
    }
}

/// The pieces of a stripe on their way out.
#[derive(Debug)]
pub(crate) struct StripeWrite {
    /// The slot holding each piece's bytes, or `u32::MAX` for a piece not being written.
    slots: Vec<u32>,
    /// Slots this write owns and frees (parity, rebuilt pieces); members' slots belong to their
    /// write-back.
    owned: Vec<u32>,
    /// The server a piece's PUT is in flight to.
    target: Vec<u16>,
    refused: Servers,
    rebuild: bool,
    /// For a rebuild: every data piece's slot (among `owned`), to put live members on the
    /// local disk should the stripe stay short.
    data: Vec<u32>,
    /// Servers revived before the write began: one that came back since may take the pieces
    /// this write found no server for, and its revival did not see this stripe short.
    revivals: u64,
}

impl StripeWrite {
    /// Every piece of `slots` (one per piece, `u32::MAX` for a piece not written) still to
    /// place.
    fn new(slots: Vec<u32>, owned: Vec<u32>, rebuild: bool, data: Vec<u32>, revivals: u64) -> Self {
        let target = vec![NO_SERVER; slots.len()];
        Self {
            slots,
            owned,
            target,
            refused: Servers::default(),
            rebuild,
            data,
            revivals,
        }
    }
}

#[derive(Debug)]
pub(crate) struct Rs {
    pub k: usize,
    pub m: usize,
    /// Pages written back and waiting to fill a stripe; their data is in write-back slots.
    open: Vec<u64>,
    stripes: Vec<Stripe>,
    free_ids: Vec<u32>,
    /// Per page: the stripe holding its current version, and its piece there.
    stripe_of: Vec<u32>,
    index_of: Vec<u8>,
    writing: HashMap<u32, StripeWrite>,
    /// Stripes missing pieces: recovery's list.
    pub degraded: BTreeSet<u32>,
    /// Stripes recovery could not complete for want of servers: retried when one comes back.
    pub short: BTreeSet<u32>,
    /// Stripes being decoded: while their pieces are read, replies may kill their last live
    /// member, and the stripe must not be freed (or its number reused) under the decoder.
    pinned: BTreeSet<u32>,
    /// Pieces read ahead for a batch of stripes to rebuild, by (stripe, piece): one round
    /// trip for the whole batch rather than one per stripe.
    prefetched: HashMap<(u32, usize), u32>,
    /// Data pieces decoded ahead for the same batch, by (stripe, piece).
    restored: HashMap<(u32, usize), u32>,
    /// Stripes being rebuilt whose piece reads are out, and how many.
    reading: HashMap<u32, u32>,
    /// The pieces asked for so far for each stripe being rebuilt (a bit each): where reads
    /// failed, the rebuild asks the others (`rs_top_up`), never the same piece twice.
    asked: HashMap<u32, u64>,
    /// Stripes being rebuilt whose piece reads are all back or failed.
    read: Vec<u32>,
    /// Stripes read and waiting for the decoder, which runs for a batch of them.
    decode_wait: Vec<u32>,
    /// A recovery step is running (`rs_stream`): its rebuilds are not given up for a slot.
    streaming: bool,
    /// Degraded reads by ticket, each waiting for its stripe's rebuild, which decodes its
    /// page on the way (`rs_serve_waiters`). Each holds the slot its page goes to.
    pub(crate) waiters: Vec<GetItem>,
    next_gen: u32,
    /// Per member count: whether the pieces of such a stripe XOR to zero ([`xor_code`]).
    xor: Vec<bool>,
    /// Kept from stripe to stripe: a new one per stripe allocates and clears its work space.
    encoder: Option<Encoder>,
}

impl Rs {
    /// No page waits in an open stripe.
    pub(crate) fn open_is_empty(&self) -> bool {
        self.open.is_empty()
    }
}

/// `reed-solomon-simd`'s encoder, which has no `Debug`.
pub(crate) struct Encoder(reed_solomon_simd::ReedSolomonEncoder);

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Encoder")
    }
}

impl Rs {
    pub fn new(k: usize, m: usize, pages: u64) -> Self {
        assert!(k >= 1 && m >= 1 && (k + m) as u64 <= KEY_STRIDE);
        let n = usize::try_from(pages).expect("page count fits in memory");
        Self {
            k,
            m,
            open: Vec::new(),
            stripes: Vec::new(),
            free_ids: Vec::new(),
            stripe_of: vec![NO_STRIPE; n],
            index_of: vec![0; n],
            writing: HashMap::default(),
            degraded: BTreeSet::new(),
            short: BTreeSet::new(),
            pinned: BTreeSet::new(),
            prefetched: HashMap::default(),
            restored: HashMap::default(),
            reading: HashMap::default(),
            asked: HashMap::default(),
            decode_wait: Vec::new(),
            streaming: false,
            waiters: Vec::new(),
            read: Vec::new(),
            next_gen: 1,
            xor: (0..=k).map(|j| j > 0 && xor_code(j, m)).collect(),
            encoder: None,
        }
    }

    /// Stripes recovery has started and not finished: reads out, read, or waiting for the
    /// decoder.
    pub(crate) fn rebuilding(&self) -> usize {
        self.reading.len() + self.read.len() + self.decode_wait.len()
    }

    /// Whether recovery has started stripe `id` and not finished it.
    pub(crate) fn under_way(&self, id: u32) -> bool {
        self.reading.contains_key(&id) || self.read.contains(&id) || self.decode_wait.contains(&id)
    }

    /// Whether one lost piece of a stripe of `k` members is the XOR of the others.
    pub(crate) fn xor_code(&self, k: usize) -> bool {
        self.xor.get(k).copied().unwrap_or(false)
    }

    /// One of a stripe's piece reads is back or failed; the last makes it ready to rebuild.
    fn settle(&mut self, id: u32) {
        if let Some(n) = self.reading.get_mut(&id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.reading.remove(&id);
                self.read.push(id);
            }
        }
    }

    pub fn is_open(&self, page: u64) -> bool {
        self.open.contains(&page)
    }
}

/// Whether the K+M pieces of every `rs:K+M` stripe XOR to zero. `reed-solomon-simd`'s codes
/// (Lin–Chung–Han's additive-FFT Reed-Solomon over GF(2^16)) have this parity check for most K
/// when M is a power of two; where it holds, one lost piece is the XOR of the others, which
/// spares the decoder (a fixed ~0.25 ms and ~20 µs per stripe on these VMs, against ~1 µs) at
/// the price of one read more. It is a property of the construction, not a promise of the
/// crate, so it is checked here rather than assumed: the check is linear in the data, so a
/// stripe with one nonzero member per member position proves it for all stripes.
pub(crate) fn xor_code(k: usize, m: usize) -> bool {
    (0..k).all(|i| {
        let shard = |j: usize| -> Vec<u8> {
            if j == i {
                (0..64u8)
                    .map(|b| b.wrapping_mul(37).wrapping_add(1))
                    .collect()
            } else {
                vec![0; 64]
            }
        };
        let data: Vec<Vec<u8>> = (0..k).map(shard).collect();
        let Ok(parity) = reed_solomon_simd::encode(k, m, &data) else {
            return false;
        };
        let mut sum = data[i].clone();
        for p in &parity {
            netram_proto::parity::xor_into(&mut sum, p);
        }
        sum.iter().all(|&b| b == 0)
    })
}

impl Rs {
    /// The live members of up to `stripes` stripes that have a piece on `server`: written
    /// again, they leave those stripes, which are freed (their pieces deleted) with the last.
    pub(crate) fn members_with_piece_on(&self, server: usize, stripes: usize) -> Vec<(u64, u32)> {
        self.stripes
            .iter()
            .filter(|st| st.in_use() && st.servers.contains(&(server as u16)))
            .take(stripes)
            .flat_map(|st| {
                st.members
                    .iter()
                    .zip(&st.live)
                    .filter(|(_, &live)| live)
                    .map(|(&m, _)| m)
            })
            .collect()
    }

    /// For [`Pager::check_invariants`]: the slots this scheme owns (stripe writes' parity and
    /// rebuilt pieces, pieces read ahead and decoded for recovery, degraded reads by ticket
    /// waiting for their stripe), and the slots each stripe
    /// write reads from (its own and its members' write-back slots).
    pub(crate) fn slots_held(&self, owned: &mut Vec<u32>, used: &mut Vec<u32>) {
        for w in self.writing.values() {
            owned.extend_from_slice(&w.owned);
            used.extend(w.slots.iter().copied().filter(|&s| s != u32::MAX));
        }
        owned.extend(self.prefetched.values().copied());
        owned.extend(self.restored.values().copied());
        owned.extend(self.waiters.iter().map(|it| it.slot));
    }
}

/// Reed-Solomon stripes of K data and M parity pieces (its state: [`Rs`]).
pub(crate) struct ReedSolomon;

/// `rs:K+M`.
pub(crate) fn build<T: Transport, D: Disk>(cfg: &PagerConfig, k: usize, m: usize) -> Built<T, D> {
    assert!(
        // The last region of all is the servers' parity frames.
        cfg.region < PIECE_REGION - 1,
        "region {} leaves no room for stripe pieces",
        cfg.region
    );
    Built {
        scheme: &ReedSolomon,
        state: SchemeState::new(Rs::new(k, m, cfg.pages)),
        shape: Shape {
            copies: 1,
            // Sealing a full stripe takes a slot per parity piece.
            seal_slots: m,
            recovery_slots: cfg.recovery_slots,
            whole_copies: false,
        },
    }
}

impl<T: Transport, D: Disk> Redundancy<T, D> for ReedSolomon {
    fn written_back(&self, p: &mut Pager<T, D>, page: u64) -> Result<(), PagerError> {
        p.rs_write(page)
    }
    fn place(&self, _p: &mut Pager<T, D>, _page: u64) -> Result<(), PagerError> {
        unreachable!("a stripe places pieces, not pages")
    }
    fn stored(&self, p: &mut Pager<T, D>, it: PutItem, server: usize) -> Result<(), PagerError> {
        let PutKind::Piece(piece) = it.kind else {
            unreachable!("a Reed-Solomon pager sends pieces only: {it:?}")
        };
        p.rs_stored(it.page as u32, piece, server)
    }
    fn put_failed(
        &self,
        p: &mut Pager<T, D>,
        it: PutItem,
        server: usize,
    ) -> Result<(), PagerError> {
        let PutKind::Piece(piece) = it.kind else {
            unreachable!("a Reed-Solomon pager sends pieces only: {it:?}")
        };
        p.rs_piece_failed(it.page as u32, piece, server)
    }
    fn get_failed(
        &self,
        p: &mut Pager<T, D>,
        server: usize,
        it: GetItem,
        what: Option<&'static str>,
    ) {
        let Part::Piece(piece) = it.part else {
            return p.rs_get_failed(server, it, what);
        };
        // The pager's own read of a stripe's piece: its caller sees it missing (recovery by
        // its count of reads out, `rs_fetch` by its absence).
        if let Some(what) = what {
            p.rs_bad_piece(it.page as u32, piece, server, what);
        }
        if it.pos == RECOVERY {
            p.rs_read_settled(it.page as u32);
        }
        p.release_slot(it.slot);
    }
    fn alive_holder(&self, p: &Pager<T, D>, page: u64, not: Option<usize>) -> Option<usize> {
        // The stripe, not the page table, is the authority.
        let live = |s: &usize| p.server_states()[*s].alive && Some(*s) != not;
        p.rs_data_server(page).flatten().filter(live)
    }
    fn reconstructible(&self, p: &Pager<T, D>, page: u64) -> bool {
        p.rs_reconstructible(page)
    }
    fn park(&self, p: &mut Pager<T, D>, it: GetItem) -> Result<(), GetItem> {
        p.rs_mut().waiters.push(it);
        Ok(())
    }
    fn serve_parked(&self, p: &mut Pager<T, D>) -> Result<(), PagerError> {
        if p.rs().waiters.is_empty() {
            return Ok(());
        }
        p.rs_serve_waiters()
    }
    fn reconstruct(&self, p: &mut Pager<T, D>, page: u64, slot: u32) -> Result<bool, PagerError> {
        p.rs_reconstruct(page, slot)
    }
    fn stored_key(&self, p: &Pager<T, D>, page: u64) -> Option<PageKey> {
        p.rs_key(page)
    }
    fn discarded(&self, p: &mut Pager<T, D>, page: u64, _deletes: &mut [Vec<PageKey>]) {
        // Its piece stays while its stripe has other live members.
        p.rs_member_dead(page);
    }
    fn seal_open(&self, p: &mut Pager<T, D>, page: Option<u64>) -> Result<(), PagerError> {
        match page {
            Some(page) if p.rs().is_open(page) => p.rs_seal(),
            // Only parity keeps whole slots waiting for a batch that may never fill.
            _ => Ok(()),
        }
    }
    fn seal_without_waiting(&self, p: &mut Pager<T, D>) -> Result<Sealed, PagerError> {
        let rs = p.rs();
        if rs.open_is_empty() {
            return Ok(Sealed::Nothing);
        }
        if p.free_slot_count() < rs.m {
            return Ok(Sealed::NoRoom);
        }
        p.rs_seal()?;
        Ok(Sealed::Sent)
    }
    fn settle_writes(&self, p: &mut Pager<T, D>) -> Result<(), PagerError> {
        p.rs_seal()?;
        p.drain()
    }
    fn server_failed_over(&self, p: &mut Pager<T, D>, server: usize) {
        p.rs_server_dead(server);
    }
    fn server_revived(&self, p: &mut Pager<T, D>, server: usize) {
        p.rs_server_revived(server);
    }
    fn leaving_pages(
        &self,
        p: &mut Pager<T, D>,
        server: usize,
        want: usize,
    ) -> Option<(Vec<u64>, bool)> {
        Some(p.rs_leaving_pages(server, want))
    }
    fn recover(&self, p: &mut Pager<T, D>, max_pages: usize) -> Result<RecoveryStep, PagerError> {
        p.rs_recover(max_pages)
    }
    fn degraded_pages(&self, p: &Pager<T, D>) -> usize {
        p.rs_degraded()
    }
    fn pages_short_of_copies(&self, p: &Pager<T, D>) -> usize {
        p.rs().short.len()
    }
    fn rebuilding_pages(&self, p: &Pager<T, D>) -> usize {
        p.rs().rebuilding()
    }
    fn recovery_yield(&self, p: &mut Pager<T, D>) -> bool {
        p.rs_yield()
    }
    fn pages_per_server(&self, p: &Pager<T, D>) -> Vec<u64> {
        p.rs_pieces_per_server()
    }
    fn pieces(&self, p: &Pager<T, D>, page: u64) -> Option<(crate::Pieces, usize)> {
        p.rs_pieces(page)
    }
    fn slots_held(&self, p: &Pager<T, D>, owned: &mut Vec<u32>, used: &mut Vec<u32>) {
        p.rs().slots_held(owned, used);
    }
}

impl<T: Transport, D: Disk> Pager<T, D> {
    fn rs(&self) -> &Rs {
        self.state().expect("a Reed-Solomon pager")
    }
    pub(crate) fn rs_mut(&mut self) -> &mut Rs {
        self.state_mut::<Rs>().expect("a Reed-Solomon pager")
    }

    pub(crate) fn piece_key(&self, id: u32, piece: usize) -> PageKey {
        PageKey::new(
            self.config().region | PIECE_REGION,
            u64::from(id) * KEY_STRIDE + piece as u64,
        )
    }

    /// The key of a page's data piece, if the page lives in a stripe.
    pub(crate) fn rs_key(&self, page: u64) -> Option<PageKey> {
        let rs = self.state::<Rs>()?;
        let id = rs.stripe_of[page as usize];
        (id != NO_STRIPE).then(|| self.piece_key(id, usize::from(rs.index_of[page as usize])))
    }

    /// A page written back joins the open stripe, sealed when it has K members.
    pub(crate) fn rs_write(&mut self, page: u64) -> Result<(), PagerError> {
        let rs = self.rs_mut();
        rs.open.push(page);
        if rs.open.len() >= rs.k {
            self.rs_seal()?;
        }
        Ok(())
    }

    /// Seals the open stripe, full or not (a flush, or a page of it that must be waited for):
    /// computes the parity and sends every piece.
    pub(crate) fn rs_seal(&mut self) -> Result<(), PagerError> {
        let m = match self.state::<Rs>() {
            Some(rs) if !rs.open.is_empty() => rs.m,
            _ => return Ok(()),
        };
        // The parity pieces' slots first: taking one may wait, and may fail (a disk that fails
        // every write), and what runs meanwhile may seal this very stripe. Taken after the
        // open pages, a failure would leave those pages in write-back with nothing to finish it.
        let mut owned = Vec::with_capacity(m);
        for _ in 0..m {
            match self.take_slot() {
                Ok(slot) => owned.push(slot),
                Err(e) => {
                    owned.into_iter().for_each(|s| self.release_slot(s));
                    return Err(e);
                }
            }
        }
        let rs = self.rs_mut();
        if rs.open.is_empty() {
            owned.into_iter().for_each(|s| self.release_slot(s));
            return Ok(());
        }
        let pages = std::mem::take(&mut rs.open);
        let gen = rs.next_gen;
        rs.next_gen = rs.next_gen.wrapping_add(1).max(1);
        let id = match rs.free_ids.pop() {
            Some(id) => id,
            None => {
                rs.stripes.push(Stripe::default());
                (rs.stripes.len() - 1) as u32
            }
        };
        let member_slots: Vec<u32> = pages.iter().map(|p| self.writebacks()[p].slot).collect();
        self.rs_encode(&member_slots, &owned);
        let members: Vec<(u64, u32)> = pages
            .iter()
            .map(|&p| (p, self.writebacks()[&p].version))
            .collect();
        let total = pages.len() + m;
        let revivals = self.counters_mut().servers_revived;
        let rs = self.rs_mut();
        rs.stripes[id as usize] = Stripe {
            live: vec![true; pages.len()],
            members,
            servers: vec![NO_SERVER; total],
            gen,
        };
        let mut slots = member_slots;
        slots.extend(&owned);
        rs.writing.insert(
            id,
            StripeWrite::new(slots, owned, false, Vec::new(), revivals),
        );
        self.rs_place(id)
    }

    /// Sends every piece of a stripe being written that has no server and none in flight, each
    /// to a live server holding no other piece of the stripe. Settles the stripe when nothing
    /// is left in flight.
    fn rs_place(&mut self, id: u32) -> Result<(), PagerError> {
        let mut full = Vec::new();
        let mut candidates = None;
        let total = self.rs().stripes[id as usize].servers.len();
        for piece in 0..total {
            let rs = self.rs();
            let w = &rs.writing[&id];
            let stripe = &rs.stripes[id as usize];
            if w.slots[piece] == u32::MAX
                || w.target[piece] != NO_SERVER
                || stripe.servers[piece] != NO_SERVER
            {
                continue;
            }
            let mut exclude: Vec<usize> = w.refused.iter().collect();
            exclude.extend(
                stripe
                    .servers
                    .iter()
                    .chain(&w.target)
                    .filter(|&&s| s != NO_SERVER)
                    .map(|&s| usize::from(s)),
            );
            let (slot, version) = (w.slots[piece], stripe.version(piece));
            let candidates = candidates.get_or_insert_with(|| {
                self.server_states()
                    .iter()
                    .map(|s| s.load)
                    .collect::<Vec<Candidate>>()
            });
            let Some(server) = placement::choose(candidates, &exclude, self.rng()) else {
                continue;
            };
            let key = self.piece_key(id, piece);
            self.rs_mut().writing.get_mut(&id).expect("writing").target[piece] = server as u16;
            self.counters_mut().puts += 1;
            let it = PutItem {
                page: u64::from(id),
                slot,
                version,
                key,
                kind: PutKind::Piece(piece as u8),
            };
            if self.queue_put(server, it) {
                full.push(server);
            }
        }
        if self.rs().writing[&id]
            .target
            .iter()
            .all(|&t| t == NO_SERVER)
        {
            return self.rs_finish(id);
        }
        for server in full {
            self.pump_paced(server);
        }
        Ok(())
    }

    pub(crate) fn rs_stored(
        &mut self,
        id: u32,
        piece: u8,
        server: usize,
    ) -> Result<(), PagerError> {
        let rs = self.rs_mut();
        let Some(w) = rs.writing.get_mut(&id) else {
            return Ok(());
        };
        w.target[usize::from(piece)] = NO_SERVER;
        rs.stripes[id as usize].servers[usize::from(piece)] = server as u16;
        if w.target.iter().all(|&t| t == NO_SERVER) {
            self.rs_finish(id)?;
        }
        Ok(())
    }

    /// A piece `server` refused or will never acknowledge: placed elsewhere if possible.
    pub(crate) fn rs_piece_failed(
        &mut self,
        id: u32,
        piece: u8,
        server: usize,
    ) -> Result<(), PagerError> {
        let Some(w) = self.rs_mut().writing.get_mut(&id) else {
            return Ok(());
        };
        w.target[usize::from(piece)] = NO_SERVER;
        w.refused.insert(server);
        self.rs_place(id)
    }

    /// Every piece is acknowledged or could not be placed. A new stripe becomes its members'
    /// home (their old stripes lose a live member); pieces that found no server leave the
    /// stripe degraded, and its members go to the local disk too, so that nothing rests on
    /// fewer pieces than the scheme promises.
    fn rs_finish(&mut self, id: u32) -> Result<(), PagerError> {
        let w = self
            .rs_mut()
            .writing
            .remove(&id)
            .expect("stripe being written");
        let stripe = &self.rs().stripes[id as usize];
        let up: Vec<bool> = self.server_states().iter().map(|s| s.alive).collect();
        let mut spill_failed = false;
        let alive = move |s: u16| s != NO_SERVER && up[usize::from(s)];
        let whole = stripe.servers.iter().all(|&s| alive(s));
        let members = stripe.members.clone();
        let servers = stripe.servers.clone();
        for (i, &(page, version)) in members.iter().enumerate() {
            if w.rebuild {
                let rs = self.rs();
                let current = rs.stripe_of[page as usize] == id
                    && rs.stripes[id as usize].live[i]
                    && self.table().get(page).version == version;
                if current && w.slots[i] != u32::MAX && alive(servers[i]) {
                    self.table_mut()
                        .set_holders(page, Servers::from_iter([usize::from(servers[i])]));
                }
                if current && !whole && !self.table().get(page).on_disk {
                    // A failed write leaves the stripe short: recovery tries again. The disk
                    // takes plaintext: the decoded piece must open (else it is not written).
                    self.counters_mut().spills += 1;
                    let written = self.unseal_slot(page, version, w.data[i])
                        && self.write_to_disk(page, w.data[i]);
                    self.table_mut().get_mut(page).on_disk = written;
                    spill_failed |= !written;
                }
                continue;
            }
            let wb = self
                .writebacks_mut()
                .remove(&page)
                .expect("member in write-back");
            debug_assert_eq!(wb.version, version);
            self.rs_member_dead(page);
            let rs = self.rs_mut();
            rs.stripe_of[page as usize] = id;
            rs.index_of[page as usize] = i as u8;
            let holders: Servers = Some(servers[i])
                .filter(|&s| alive(s))
                .map(usize::from)
                .into_iter()
                .collect();
            self.landed(page, holders.is_empty());
            self.table_mut().set_holders(page, holders);
            if !whole && !self.table().get(page).on_disk {
                self.counters_mut().spills += 1;
                self.unseal_own(page, version, wb.slot);
                if !self.write_to_disk(page, wb.slot) {
                    // Its piece counts as far as it goes; the page stays in memory until it
                    // is written again.
                    self.rehome(page, wb.slot);
                    continue;
                }
                self.table_mut().get_mut(page).on_disk = true;
            }
            self.release_slot(wb.slot);
        }
        if w.rebuild {
            let rebuilt = w
                .slots
                .iter()
                .zip(&servers)
                .filter(|&(&slot, &s)| slot != u32::MAX && alive(s))
                .count();
            self.counters_mut().pages_rebuilt += rebuilt as u64;
        }
        for slot in w.owned {
            self.release_slot(slot);
        }
        let in_use = self.rs().stripes[id as usize].in_use();
        if !in_use {
            self.rs_free(id);
        } else if whole {
            let rs = self.rs_mut();
            rs.degraded.remove(&id);
            rs.short.remove(&id);
        } else if w.rebuild && !spill_failed && w.revivals == self.counters_mut().servers_revived {
            self.rs_mut().short.insert(id);
        } else if w.rebuild {
            // Short of servers and the disk failed to back its members, or a server came back
            // while this rebuild was out (its revival found the stripe not yet short): recovery
            // tries again at its next step, not only when a server comes back.
            self.rs_mut().degraded.insert(id);
        } else {
            self.counters_mut().writes_degraded += 1;
            self.rs_mut().degraded.insert(id);
        }
        Ok(())
    }

    /// Up to `want` members whose move frees a frame on a leaving `server` (the live members
    /// of stripes with a piece there, readable and movable now), and whether we hold anything
    /// there at all.
    pub(crate) fn rs_leaving_pages(&mut self, server: usize, want: usize) -> (Vec<u64>, bool) {
        // Every stripe there, not the first `want`: a stripe none of whose members can move
        // now (one waits to be rebuilt) must not hide the others (`netram sim --seed 3225
        // --scheme rs:3+2` left a piece above the offer so, the server taken for stuck).
        let members = self.rs().members_with_piece_on(server, usize::MAX);
        let held = !members.is_empty();
        let mut out = Vec::new();
        let mut unread = Vec::new();
        for (page, _) in members {
            // A member whose data piece is out of reach is read from the disk if the disk
            // backs it, else left to recovery to rebuild first.
            let readable =
                self.alive_holder(page, None).is_some() || self.table().get(page).on_disk;
            if !readable {
                unread.push(page);
            }
            if self.movable(page) && !out.contains(&page) && readable {
                out.push(page);
            }
            if out.len() >= want {
                break;
            }
        }
        // ... and recovery is told: such a stripe may have been left out of its list (its
        // other lost member superseded meanwhile), and then nothing would ever rebuild the
        // page, or find it lost and free the stripe's pieces (`netram sim --seed 3457
        // --scheme rs:2+1`: a parity piece stayed above a shrunk offer).
        if !unread.is_empty() {
            self.rs_recheck(&unread);
        }
        (out, held)
    }

    /// A page's version in its stripe is superseded or discarded. The last live member takes
    /// the whole stripe with it.
    pub(crate) fn rs_member_dead(&mut self, page: u64) {
        let rs = self.rs_mut();
        let id = rs.stripe_of[page as usize];
        if id == NO_STRIPE {
            return;
        }
        rs.stripe_of[page as usize] = NO_STRIPE;
        let i = usize::from(rs.index_of[page as usize]);
        let stripe = &mut rs.stripes[id as usize];
        stripe.live[i] = false;
        if !stripe.in_use() && !rs.writing.contains_key(&id) && !rs.pinned.contains(&id) {
            self.rs_free(id);
        }
    }

    /// Deletes every piece of a stripe no member needs and frees its number.
    fn rs_free(&mut self, id: u32) {
        let servers = std::mem::take(&mut self.rs_mut().stripes[id as usize].servers);
        for (piece, &s) in servers.iter().enumerate() {
            let s = usize::from(s);
            if s != usize::from(NO_SERVER) && self.server_states()[s].alive {
                self.counters_mut().deletes += 1;
                let key = self.piece_key(id, piece);
                self.submit(s, Op::Delete, &Request::Delete(vec![key]));
            }
        }
        let rs = self.rs_mut();
        rs.stripes[id as usize] = Stripe::default();
        rs.degraded.remove(&id);
        rs.short.remove(&id);
        rs.free_ids.push(id);
    }

    /// Computes the parity pieces of the data pieces in slots `data` into slots `parity`.
    fn rs_encode(&mut self, data: &[u32], parity: &[u32]) {
        let (k, m) = (data.len(), parity.len());
        // Taken out while the slots are read, put back for the next stripe.
        let mut enc = match self.rs_mut().encoder.take() {
            Some(Encoder(mut enc)) => {
                enc.reset(k, m, PAGE_SIZE).expect("a valid stripe shape");
                enc
            }
            None => reed_solomon_simd::ReedSolomonEncoder::new(k, m, PAGE_SIZE)
                .expect("a valid stripe shape"),
        };
        for &s in data {
            enc.add_original_shard(self.slot(s))
                .expect("page-sized shards, K of them");
        }
        {
            let out = enc.encode().expect("K shards added");
            for (shard, &s) in out.recovery_iter().zip(parity) {
                self.slot_mut(s).copy_from_slice(shard);
            }
        }
        self.rs_mut().encoder = Some(Encoder(enc));
    }

    /// The server of a page's data piece, if the page lives in a stripe and the piece has
    /// one: the stripe, not the page table, is the authority.
    pub(crate) fn rs_data_server(&self, page: u64) -> Option<Option<usize>> {
        let rs = self.state::<Rs>()?;
        let id = rs.stripe_of[page as usize];
        if id == NO_STRIPE {
            return Some(None);
        }
        let s = rs.stripes[id as usize].servers[usize::from(rs.index_of[page as usize])];
        Some((s != NO_SERVER).then_some(usize::from(s)))
    }

    /// Whether a page that lives in a stripe can be read by reconstruction.
    pub(crate) fn rs_reconstructible(&self, page: u64) -> bool {
        self.state::<Rs>().is_some_and(|rs| {
            let id = rs.stripe_of[page as usize];
            id != NO_STRIPE && self.rs_live_pieces(id) >= rs.stripes[id as usize].k()
        })
    }

    /// Pieces of a stripe on live servers.
    fn rs_live_pieces(&self, id: u32) -> usize {
        self.rs().stripes[id as usize]
            .servers
            .iter()
            .filter(|&&s| s != NO_SERVER && self.server_states()[usize::from(s)].alive)
            .count()
    }

    /// A piece found bad (checksum, missing) on `server`: it counts as lost, and is deleted.
    pub(crate) fn rs_bad_piece(&mut self, id: u32, piece: u8, server: usize, what: &'static str) {
        let rs = self.rs_mut();
        let Some(stripe) = rs.stripes.get_mut(id as usize) else {
            return;
        };
        let piece = usize::from(piece);
        if stripe.servers.get(piece) != Some(&(server as u16)) {
            return;
        }
        stripe.servers[piece] = NO_SERVER;
        rs.degraded.insert(id);
        if piece < stripe.k() {
            let page = stripe.members[piece].0;
            if rs.stripe_of[page as usize] == id {
                self.table_mut().set_holders(page, Servers::default());
            }
        }
        self.counters_mut().copies_dropped_bad += 1;
        if what != "missing on server" && self.server_states()[server].alive {
            self.counters_mut().deletes += 1;
            let key = self.piece_key(id, piece);
            self.submit(server, Op::Delete, &Request::Delete(vec![key]));
        }
    }

    /// A server is dead: every stripe with a piece there is degraded.
    pub(crate) fn rs_server_dead(&mut self, server: usize) {
        let rs = self.rs_mut();
        let s = server as u16;
        let hit: Vec<u32> = rs
            .stripes
            .iter()
            .enumerate()
            .filter(|(_, st)| st.servers.contains(&s))
            .map(|(id, _)| id as u32)
            .collect();
        rs.degraded.extend(hit);
    }

    /// A server came back empty: its pieces are gone.
    pub(crate) fn rs_server_revived(&mut self, server: usize) {
        let s = server as u16;
        let rs = self.rs_mut();
        let mut lost_data = Vec::new();
        for (id, st) in rs.stripes.iter_mut().enumerate() {
            for (j, piece) in st.servers.iter_mut().enumerate() {
                if *piece == s {
                    *piece = NO_SERVER;
                    rs.degraded.insert(id as u32);
                    if let Some(&(page, _)) = st.members.get(j) {
                        if rs.stripe_of[page as usize] == id as u32 {
                            lost_data.push(page);
                        }
                    }
                }
            }
        }
        let short = std::mem::take(&mut rs.short);
        rs.degraded.extend(short);
        for w in rs.writing.values_mut() {
            w.refused.remove(server);
        }
        for page in lost_data {
            self.table_mut().set_holders(page, Servers::default());
        }
    }

    /// The pieces that make a page safe, for checkers: (server, key, version) of each piece
    /// of its stripe that has a server, and how many pieces the stripe has.
    pub(crate) fn rs_pieces(&self, page: u64) -> Option<(crate::Pieces, usize)> {
        let rs = self.state::<Rs>()?;
        let id = rs.stripe_of[page as usize];
        if id == NO_STRIPE {
            return Some((Vec::new(), 0));
        }
        let st = &rs.stripes[id as usize];
        let pieces = st
            .servers
            .iter()
            .enumerate()
            .filter(|(_, &s)| s != NO_SERVER)
            .map(|(j, &s)| (usize::from(s), self.piece_key(id, j), st.version(j)))
            .collect();
        Some((pieces, st.servers.len()))
    }

    /// Pieces each server holds, by the stripes.
    pub(crate) fn rs_pieces_per_server(&self) -> Vec<u64> {
        let mut n = vec![0u64; self.server_states().len()];
        for st in &self.rs().stripes {
            for &s in st.servers.iter().filter(|&&s| s != NO_SERVER) {
                n[usize::from(s)] += 1;
            }
        }
        n
    }

    /// Stripes missing pieces: on recovery's list, or being rebuilt (their reads out).
    pub(crate) fn rs_degraded(&self) -> usize {
        let rs = self.rs();
        rs.degraded.len() + rs.rebuilding()
    }

    /// The stripes of these pages, whose data pieces are out of reach, go back on recovery's
    /// list unless it already waits for room for them (`short`).
    pub(crate) fn rs_recheck(&mut self, pages: &[u64]) {
        let rs = self.rs_mut();
        for &page in pages {
            let Some(&id) = rs.stripe_of.get(page as usize) else {
                continue;
            };
            if rs.stripes.get(id as usize).is_some_and(Stripe::in_use) && !rs.short.contains(&id) {
                rs.degraded.insert(id);
            }
        }
    }
}
