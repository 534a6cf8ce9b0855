//! The page server's store: where other machines' pages live, with no I/O.
//!
//! It implements the server side of Distributed Anemone (paper 001, §2.1 server module, §2.5
//! soft-state refresh) and of Nswap's per-node cache of remote pages (paper 004, §III):
//!
//! * **Frames** live in one arena handed in at start-up (the daemon mmaps it from `--capacity`);
//!   the store never allocates per page. When no frame is free a PUT is refused with
//!   [`PutStatus::Full`], Anemone's NACK, and the client goes elsewhere.
//! * **The index** maps a page key to its frame with 20 bytes of [`FrameMeta`] per frame plus a
//!   `hashbrown::HashTable<u32>` of frame numbers (5 bytes a slot, at most ~11.4 bytes a page
//!   at hashbrown's lowest load), so that metadata stays under 32 bytes per stored page; the
//!   key itself is kept once, in the frame's metadata, not again in the table.
//! * **Sessions and leases**: a page belongs to a session, opened by a client's handshake (node
//!   id, boot incarnation, session id). A session not refreshed for [`LEASE_PERIODS`] lease
//!   periods is expired and its pages freed; a newer incarnation of a node supersedes the older
//!   ones at once, because a rebooted client can never ask for its old pages again.
//!
//! * **Limits per client** (the side that pays enforces them): a client, known by the address
//!   its connections come from (until clients authenticate, issue "Trust nobody on the wire"),
//!   holds at most [`StoreConfig::max_peer_sessions`] sessions and
//!   [`StoreConfig::max_peer_pages`] frames, so that no client can take every session slot or
//!   fill the arena and starve the others. A PUT over the quota is refused as `Full` (the client
//!   goes elsewhere, as for a full server) and counted apart (`puts_refused_quota`).
//!
//! * **The offer** (Nswap's growing and shrinking cache, paper 004, §III): the arena is the
//!   most the server may ever offer; [`Store::set_offer`] moves how many of its frames are
//!   offered now, in whole frames from the bottom. Frames above the offer take no new page;
//!   the free ones among them are given back to the kernel by the daemon
//!   ([`Store::set_offer`]'s runs, [`Store::take_given_back`]), the pages in the others wait to
//!   be moved away (or deleted) and their frames are given back as they are freed.
//!
//! Time comes in as `now_ms` arguments, so the daemon passes a monotonic clock and the simulator a
//! virtual one. One counter per reason a page was stored, refused or freed ([`Counters`]).

mod adopt;
mod clean;
mod parity;
pub mod serve;
mod shared;

pub use adopt::{EXPECT_TTL_MS, MAX_EXPECTED, MAX_EXPECTED_PER_PEER, MAX_EXPECTED_PER_SESSION};

pub use clean::CleanPage;
pub use parity::{ParityTag, PARITY_REGION};
pub use shared::{GcdOutcome, MAX_ENTRIES as GCD_MAX_ENTRIES, MAX_PER_PEER as GCD_MAX_PER_PEER};

use hashbrown::HashTable;
use netram_proto::{Load, NodeId, Page, PageFlags, PageKey, PutStatus, PAGE_SIZE};
use std::collections::{BTreeSet, HashMap};
use std::hash::BuildHasher;
use std::net::{IpAddr, Ipv4Addr};

/// Who a session belongs to: the node its connection's certificate names (over TLS), or,
/// over clear TCP, the address its connections come from. Sessions are bound to it: a
/// handshake can resume, supersede or be counted against only the sessions of its own peer,
/// whatever node id, incarnation or session id it claims; the limits per client are per peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    /// An authenticated node (its certificate's node id).
    Node(NodeId),
    /// An authenticated node whose certificate names the server role: it may also forward
    /// parity deltas about the members it stores.
    Server(NodeId),
    /// An unauthenticated address (clear TCP, loopback development).
    Addr(IpAddr),
}

impl Peer {
    /// The node id its certificate names; 0 over clear TCP.
    pub fn principal(&self) -> NodeId {
        match *self {
            Peer::Node(n) | Peer::Server(n) => n,
            Peer::Addr(_) => 0,
        }
    }
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Node(n) => write!(f, "node {n}"),
            Peer::Server(n) => write!(f, "server node {n}"),
            Peer::Addr(a) => write!(f, "{a}"),
        }
    }
}

/// Who sent a parity delta, as its holder checks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaFrom {
    /// The group's owner, on its own session (`Owner::SELF`).
    Owner,
    /// Another session: a member's server, as its connection authenticated it.
    Peer(Peer),
}

impl From<IpAddr> for Peer {
    fn from(a: IpAddr) -> Self {
        Peer::Addr(a)
    }
}

/// The peer of sessions opened without a network address (tests, the simulator's defaults).
pub const NO_PEER: Peer = Peer::Addr(IpAddr::V4(Ipv4Addr::UNSPECIFIED));

/// A session silent for this many lease periods is expired (Anemone §2.5: three periods).
pub const LEASE_PERIODS: u64 = 3;

/// The largest region number a client may use (24 bits, the last one being the holder's parity
/// frames, [`PARITY_REGION`])...
pub const REGION_MAX: u32 = (1 << 24) - 2;
/// ... and the largest page number inside a region (40 bits: 4 PiB of 4 KiB pages).
pub const PAGE_NUMBER_MAX: u64 = (1 << 40) - 1;

/// Per-frame metadata: 20 bytes, 4-byte aligned. The key is packed into 64 bits (24-bit region,
/// 40-bit page) so that (key, owner, version, checksum) fit without padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct FrameMeta {
    /// Packed key, little half first; for a free frame, `key[0]` links to the next free frame.
    key: [u32; 2],
    /// Session slot in the low 24 bits, page flags in the top 8; [`FREE`] when free.
    owner: u32,
    version: u32,
    crc: u32,
}

const FREE: u32 = u32::MAX;
const SLOT_BITS: u32 = 24;
const SLOT_MASK: u32 = (1 << SLOT_BITS) - 1;
/// End of the free list.
const NIL: u32 = u32::MAX;

impl FrameMeta {
    fn slot(&self) -> u32 {
        self.owner & SLOT_MASK
    }
    fn flags(&self) -> PageFlags {
        PageFlags((self.owner >> SLOT_BITS) as u16)
    }
    fn packed_key(&self) -> u64 {
        u64::from(self.key[0]) | (u64::from(self.key[1]) << 32)
    }
}

fn pack(key: PageKey) -> Option<u64> {
    (key.region <= REGION_MAX && key.page <= PAGE_NUMBER_MAX)
        .then(|| (u64::from(key.region) << 40) | key.page)
}

/// A session as the connection that opened it holds it. The generation tells a handle to an
/// expired session from one to the session that reused its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionHandle {
    slot: u32,
    generation: u32,
}

#[derive(Debug, Clone)]
struct Session {
    peer: Peer,
    node: NodeId,
    incarnation: u64,
    id: u64,
    generation: u32,
    last_refresh_ms: u64,
    live: bool,
    pages: u64,
    /// Its frames at or above the offer: the pages it must move away (told to it with every
    /// reply, [`Load::leaving`]). Empty unless the offer shrank below its pages.
    beyond: BTreeSet<u32>,
}

/// A stored page, as a GET hands it back.
#[derive(Debug, Clone, Copy)]
pub struct StoredPage<'a> {
    pub version: u32,
    pub crc: u32,
    pub flags: PageFlags,
    pub data: &'a [u8],
}

impl<'a> StoredPage<'a> {
    /// The page's envelope for a GET reply, with the checksum the client sent, untouched.
    pub fn envelope(&self, key: PageKey) -> Page<'a> {
        Page {
            key,
            version: self.version,
            crc: self.crc,
            flags: self.flags,
            tag: [0; netram_proto::TAG_LEN],
            data: self.data,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The session's lease ran out and its pages were freed.
    #[error("session expired: its lease ran out and its pages were freed")]
    SessionExpired,
    /// Every session slot is taken.
    #[error("too many sessions ({0} is the limit)")]
    TooManySessions(usize),
    /// The client already holds as many sessions as one client may.
    #[error("too many sessions from {peer} ({limit} is the limit per client)")]
    TooManyPeerSessions { peer: Peer, limit: u32 },
    /// A newer incarnation of this node has connected: this one is dead.
    #[error("stale incarnation {got} of node {node:#x}: incarnation {newest} has connected since")]
    StaleIncarnation { node: NodeId, got: u64, newest: u64 },
}

/// What the store is configured with.
#[derive(Debug, Clone, Copy)]
pub struct StoreConfig {
    pub lease_period_ms: u64,
    pub max_sessions: usize,
    /// Live sessions one client (peer) may hold.
    pub max_peer_sessions: u32,
    /// Frames (pages and parity pages) one client may hold.
    pub max_peer_pages: u64,
    /// Operations per second one client may make (each page of a batch one, any other request
    /// one); 0: no limit. See [`Store::charge`].
    pub max_peer_ops_per_s: u32,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            lease_period_ms: 2_000,
            max_sessions: 4096,
            max_peer_sessions: 64,
            max_peer_pages: u64::MAX,
            max_peer_ops_per_s: 0,
        }
    }
}

/// What one client holds, for its limits.
#[derive(Debug, Clone, Copy, Default)]
struct PeerUse {
    sessions: u32,
    pages: u64,
    /// Of `pages`, owners' clean pages (`clean.rs`): outside the quota, since they never make
    /// this store refuse anyone's page.
    clean: u64,
    /// The client's rate budget, in thousandths of an operation (a token bucket that may go
    /// into debt: a request is served whole, and what it overdrew is waited for after it).
    credit: i64,
    /// When `credit` was last topped up; 0 before the first request (a full bucket).
    credited_ms: u64,
}

macro_rules! counters {
    ($($(#[doc = $doc:literal])* $name:ident),* $(,)?) => {
        /// One counter per reason (zswap style), exported through STATS under these names.
        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        pub struct Counters { $($(#[doc = $doc])* pub $name: u64,)* }
        impl Counters {
            pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
                [$((stringify!($name), self.$name)),*].into_iter()
            }
        }
    };
}

counters! {
    /// PUTs that took a new frame.
    pages_stored,
    /// PUTs that replaced a page already stored under that key, in place.
    pages_overwritten,
    /// GETs answered with a page.
    pages_read,
    /// GETs of a key the session does not have.
    pages_missing,
    /// DELETEs that freed a page.
    pages_deleted,
    /// DELETEs of a key the session does not have.
    deletes_missing,
    /// PUTs refused because no frame was free (Anemone's NACK).
    puts_refused_full,
    /// PUTs (and parity pages) refused because their client holds its quota of frames.
    puts_refused_quota,
    /// Times the offer grew, and shrank ([`Store::set_offer`]).
    offer_grows,
    offer_shrinks,
    /// Pages moved from above a shrunk offer into a frame freed below it, without leaving the
    /// server ([`Store::compact`]).
    pages_compacted,
    /// Requests after which their client had overdrawn its rate (`max_peer_ops_per_s`): its
    /// connections read nothing more until the rate allows.
    requests_throttled,
    /// Handshakes refused because their client holds its quota of sessions.
    sessions_refused_peer_limit,
    /// PUTs refused because the key is beyond the index's limits.
    puts_refused_bad_key,
    /// PUTs refused because the page's checksum does not match its contents (damaged on the
    /// way: stored, it would be found only when read back, perhaps as its only copy).
    puts_refused_corrupt,
    /// Requests on a session whose lease had run out.
    requests_expired_session,
    sessions_opened,
    sessions_resumed,
    sessions_closed,
    /// Sessions whose lease ran out (three periods without a refresh).
    sessions_expired,
    /// Sessions freed because a newer incarnation of their node connected.
    sessions_superseded,
    /// Handshakes refused because a newer incarnation of the node had connected.
    sessions_refused_stale,
    /// Pages freed by expiry, supersession or close, rather than by DELETE.
    pages_freed_with_session,
    /// Parity pages received: groups this server became the holder of.
    parity_groups_shipped,
    /// Deltas XORed into a group held here.
    parity_deltas_applied,
    /// Deltas for a group (or owner) this server does not hold.
    parity_deltas_unknown,
    /// Deltas refused: sent by a peer that is not the owner, not certified as a server, or not
    /// the server the owner placed the member on (answered as for an unknown group).
    parity_deltas_refused,
    /// Members that left a group held here.
    parity_members_removed,
    /// Small groups folded into another.
    parity_groups_merged,
    /// Deltas answered as applied without applying them again (a sender that lost the answer).
    parity_deltas_repeated,
    /// Deltas that did not match the version the parity covers: the group is damaged.
    parity_deltas_stale,
    /// Groups freed when their last member left.
    parity_groups_freed,
    /// Members dropped by their owner from a group that could not rebuild them.
    parity_members_dropped,
    /// Damaged groups (see `parity_deltas_stale`) freed.
    parity_groups_damaged,
    /// Parity pages and tags refused because the table of server addresses was full.
    parity_addresses_refused,
    /// Groups whose parity was not zero when their last member left: a delta was lost or
    /// applied twice. Must stay zero.
    parity_groups_inconsistent,
    /// Member pages reported to their owner because their parity holder died.
    parity_orphans_reported,
    /// Overwrites and deletes of member pages that waited for their holder.
    parity_forwards,
    /// ... and found it unreachable: nothing was changed, the client was told.
    parity_holder_unreachable,
    /// Pages another server handed over as their owner said (Nswap's MIGRATE, received).
    pages_adopted,
    /// Pages handed over to another server at their owner's request (MIGRATE, sent).
    pages_handed_over,
    /// EXPECTs refused: no room, or as many expectations as the store holds.
    expects_refused,
    /// Pages handed over that no expectation matched (sender, version, time, session).
    adopts_refused_unexpected,
    /// ... whose key the owner's session already held (a newer write came first).
    adopts_refused_exists,
    /// ... for want of room, or damaged on the way.
    adopts_refused_full,
    /// Clean pages (GMS, `clean.rs`) taken into a free frame, and in place of an older one.
    clean_stored,
    clean_replaced,
    /// ... refused: every clean page here is younger (the plan that sent it was wrong), or
    /// the offer is shrinking.
    clean_refused_younger,
    /// ... refused: their sender holds its quota of frames in clean pages.
    clean_refused_quota,
    /// ... refused: the checksum does not match the uid and contents.
    clean_refused_corrupt,
    /// ... already here.
    clean_present,
    /// Clean pages asked for and found (and of those, taken away by their user), or not found.
    clean_hits,
    clean_taken,
    clean_misses,
    /// Clean pages dropped to give their frame to an owned page, and above a shrunk offer.
    clean_dropped_for_owned,
    clean_dropped_for_offer,
    /// Owners' clean pages (`cluster+disk`, [`PageFlags::CLEAN`]) stored, and dropped: for
    /// a page that found no free frame (the globally oldest of the clean pages here), and
    /// above a shrunk offer. Their owners read them from their disks.
    clean_owned_stored,
    clean_owned_dropped,
    clean_owned_dropped_for_offer,
    /// The global-cache directory's part held here (`shared.rs`): shared pages registered,
    /// registrations refused beyond their peer's bound, pages given up, and given up while
    /// another node held them (duplicates: their sender drops them).
    gcd_adds,
    gcd_adds_refused,
    gcd_removes,
    gcd_duplicates,
    /// Peers that asked to start over, and entries forgotten (by those, or with a peer's last
    /// session).
    gcd_resets,
    gcd_forgotten,
}

/// The page store. `A` is the arena: the daemon passes an mmap, tests a `Vec<u8>`.
pub struct Store<A> {
    arena: A,
    meta: Vec<FrameMeta>,
    index: HashTable<u32>,
    hasher: foldhash::fast::RandomState,
    free_head: u32,
    /// Free frames on the free list: all below the offer.
    free_frames: u64,
    /// Frames offered now: `0..offered` (the rest of the arena holds no new page).
    offered: u32,
    /// Frames at or above the offer that hold pages (a shrink's pages still to move away).
    used_beyond: u64,
    /// Frames above the offer freed since [`Store::take_given_back`] last ran: their memory is
    /// to be given back.
    given_back: Vec<u32>,
    sessions: Vec<Session>,
    free_slots: Vec<u32>,
    peers: HashMap<Peer, PeerUse>,
    cfg: StoreConfig,
    counters: Counters,
    parity: parity::ParityState,
    expected: adopt::Expectations,
    load_window_s: u64,
    load_count: u32,
    load_last: u32,
    /// Clean pages held for other nodes (GMS; `clean.rs`).
    clean: clean::CleanPages,
    /// Owners' pages they also keep on disk, oldest first (`clean.rs`).
    owned_clean: clean::OwnedClean,
    /// This daemon's part of the global-cache directory (`shared.rs`).
    shared: shared::SharedDir,
}

impl<A> std::fmt::Debug for Store<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("capacity_pages", &self.meta.len())
            .field("free_pages", &self.free_frames)
            .field("sessions", &self.sessions.len())
            .finish()
    }
}

impl<A: AsRef<[u8]> + AsMut<[u8]>> Store<A> {
    /// A store over `arena`, which holds `arena.len() / PAGE_SIZE` frames.
    pub fn new(arena: A, cfg: StoreConfig) -> Self {
        let frames = arena.as_ref().len() / PAGE_SIZE;
        assert!(frames < NIL as usize, "at most 2^32 - 1 frames");
        // The last slot value marks clean pages' frames (`clean::CLEAN`).
        assert!(cfg.max_sessions > 0 && cfg.max_sessions < SLOT_MASK as usize);
        // Free list threaded through the metadata, lowest frame first.
        let meta = (0..frames as u32)
            .map(|i| FrameMeta {
                key: [if i + 1 == frames as u32 { NIL } else { i + 1 }, 0],
                owner: FREE,
                version: 0,
                crc: 0,
            })
            .collect();
        Self {
            arena,
            meta,
            index: HashTable::with_capacity(frames),
            hasher: foldhash::fast::RandomState::default(),
            free_head: if frames == 0 { NIL } else { 0 },
            free_frames: frames as u64,
            offered: frames as u32,
            used_beyond: 0,
            given_back: Vec::new(),
            sessions: Vec::new(),
            free_slots: Vec::new(),
            peers: HashMap::new(),
            cfg,
            counters: Counters::default(),
            parity: parity::ParityState::default(),
            expected: adopt::Expectations::default(),
            load_window_s: 0,
            load_count: 0,
            load_last: 0,
            clean: clean::CleanPages::default(),
            owned_clean: clean::OwnedClean::default(),
            shared: Default::default(),
        }
    }

    /// Frames offered now (see [`Store::set_offer`]).
    pub fn capacity_pages(&self) -> u64 {
        u64::from(self.offered)
    }
    /// Frames of the arena: the most the store can offer.
    pub fn arena_pages(&self) -> u64 {
        self.meta.len() as u64
    }
    pub fn free_pages(&self) -> u64 {
        self.free_frames
    }
    /// Frames a new page of session `slot` may take: [`Store::room`], and no more than its
    /// client's quota leaves. What every reply tells the client, so that it places pages
    /// where they will be taken (a client at its quota once kept handing pages to a server
    /// that refused each).
    pub(crate) fn room_for(&self, slot: u32) -> u64 {
        let used = self
            .sessions
            .get(slot as usize)
            .and_then(|s| self.peers.get(&s.peer))
            .map_or(0, |u| u.pages - u.clean);
        self.owned_room()
            .min(self.cfg.max_peer_pages.saturating_sub(used))
    }

    /// Frames an owned page may take: [`Store::room`] and the frames of clean pages, since a
    /// clean page is never a reason to refuse one (`clean.rs`). What clients are told.
    pub fn owned_room(&self) -> u64 {
        if self.used_beyond > 0 {
            0
        } else {
            self.free_frames + self.droppable_pages()
        }
    }

    /// Frames a new page may take: none while pages wait above the offer, since every frame
    /// freed below it is theirs ([`Store::compact`]).
    pub fn room(&self) -> u64 {
        if self.used_beyond > 0 {
            0
        } else {
            self.free_frames
        }
    }
    /// What a reply to session `h` tells its client about this server (Anemone §2.4), and how
    /// many of the session's pages must leave (Nswap §III).
    pub fn load(&self, h: SessionHandle, requests_per_s: u32) -> Load {
        let leaving = match self.sessions.get(h.slot as usize) {
            Some(s) if s.live && s.generation == h.generation => s.beyond.len(),
            _ => 0,
        };
        Load {
            free_pages: self.room_for(h.slot),
            requests_per_s,
            leaving: u32::try_from(leaving).unwrap_or(u32::MAX),
        }
    }
    /// Pages of session `h` held above the offer.
    pub fn session_leaving(&self, h: SessionHandle) -> u64 {
        self.load(h, 0).leaving.into()
    }
    pub fn stored_pages(&self) -> u64 {
        self.capacity_pages() - self.free_frames + self.used_beyond
    }
    /// Pages held above the offer: what a shrink still has to move away.
    pub fn pages_beyond_offer(&self) -> u64 {
        self.used_beyond
    }
    /// The keys session `h` holds above the offer, groups' parity included (for checkers).
    pub fn keys_beyond_offer(&self, h: SessionHandle) -> Vec<PageKey> {
        if self.session_pages(h).is_none() {
            return Vec::new();
        }
        self.sessions[h.slot as usize]
            .beyond
            .iter()
            .map(|&f| {
                let k = self.meta[f as usize].packed_key();
                PageKey::new((k >> 40) as u32, k & PAGE_NUMBER_MAX)
            })
            .collect()
    }

    /// Offers `frames` frames of the arena from now on (at most the arena's). Growing puts the
    /// frames it adds on the free list; shrinking takes the free frames above the new offer off
    /// it and returns them as runs `(first frame, count)` whose memory the caller gives back to
    /// the kernel. Pages above the new offer stay where they are, readable and deletable, until
    /// [`Store::compact`] moves them down into free frames or their owners move them away
    /// ([`Store::pages_beyond_offer`], each session's [`Load::leaving`]); their frames are
    /// given back as they are freed ([`Store::take_given_back`]). The free list is rebuilt
    /// lowest frame first, so that new pages fill the bottom of the arena and later shrinks
    /// find the top free.
    pub fn set_offer(&mut self, frames: u64) -> Vec<(u32, u32)> {
        let new = frames.min(self.arena_pages()) as u32;
        let old = self.offered;
        let mut runs: Vec<(u32, u32)> = Vec::new();
        if new >= old {
            for f in old..new {
                let m = self.meta[f as usize];
                if m.owner == FREE {
                    self.free_frames += 1;
                } else {
                    debug_assert_ne!(
                        m.slot(),
                        clean::CLEAN,
                        "clean pages above the offer are dropped"
                    );
                    self.used_beyond -= 1;
                    self.sessions[m.slot() as usize].beyond.remove(&f);
                }
            }
        } else {
            for f in new..old {
                let m = self.meta[f as usize];
                if m.owner == FREE {
                    self.free_frames -= 1;
                    match runs.last_mut() {
                        Some((start, n)) if *start + *n == f => *n += 1,
                        _ => runs.push((f, 1)),
                    }
                } else if m.slot() == clean::CLEAN || m.flags().is_clean() {
                    // A copy: dropped rather than moved, its frame given back.
                    if m.slot() == clean::CLEAN {
                        self.drop_clean_frame(f);
                    } else {
                        self.drop_owned_clean_frame(f);
                    }
                    self.meta[f as usize] = FrameMeta {
                        key: [NIL, 0],
                        owner: FREE,
                        version: 0,
                        crc: 0,
                    };
                    self.given_back.push(f);
                } else {
                    self.used_beyond += 1;
                    self.sessions[m.slot() as usize].beyond.insert(f);
                }
            }
        }
        self.offered = new;
        // A frame offered again may take a page before the caller gives back what was freed
        // above the old offer: it must not be given back then.
        self.given_back.retain(|&f| f >= new);
        // The free list, rebuilt over the offer, lowest first.
        self.free_head = NIL;
        for f in (0..new).rev() {
            if self.meta[f as usize].owner == FREE {
                self.meta[f as usize].key = [self.free_head, 0];
                self.free_head = f;
            }
        }
        if new < old {
            self.counters.offer_shrinks += 1;
        } else if new > old {
            self.counters.offer_grows += 1;
        }
        runs
    }

    /// The arena, to give back the memory of frames the store no longer offers.
    pub fn arena(&self) -> &A {
        &self.arena
    }

    /// Frames above the offer freed since the last call: the caller gives their memory back.
    pub fn take_given_back(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.given_back)
    }
    pub fn counters(&self) -> &Counters {
        &self.counters
    }
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }
    pub fn live_sessions(&self) -> usize {
        self.sessions.iter().filter(|s| s.live).count()
    }

    /// Bytes of index and frame metadata: what the store spends besides the frames themselves.
    pub fn meta_bytes(&self) -> usize {
        self.meta.capacity() * std::mem::size_of::<FrameMeta>()
            + self.index.allocation_size()
            + self.owned_clean_bytes()
            + self.shared.bytes()
    }

    /// Counts one request for the load the server piggy-backs on replies (Anemone §2.4);
    /// returns requests served in the last whole second.
    pub fn note_requests(&mut self, n: u32, now_ms: u64) -> u32 {
        let window = now_ms / 1000;
        if window != self.load_window_s {
            self.load_last = if window == self.load_window_s + 1 {
                self.load_count
            } else {
                0
            };
            self.load_window_s = window;
            self.load_count = 0;
        }
        self.load_count = self.load_count.saturating_add(n);
        self.load_last
    }

    /// Charges `ops` operations of the session's client against its rate
    /// ([`StoreConfig::max_peer_ops_per_s`], shared by all of the client's sessions and
    /// connections) and returns how long, in milliseconds, its connections must then wait
    /// before another request is read (0 within its rate). The bucket holds a tenth of a
    /// second's worth (at least a window of 64): bursts pass, a sustained excess waits. The
    /// server that pays for the requests enforces it; the client is slowed, never refused (a
    /// refusal would only move the retry to it, and make its pager take the server for dead).
    pub fn charge(&mut self, h: SessionHandle, ops: u32, now_ms: u64) -> u64 {
        let rate = i64::from(self.cfg.max_peer_ops_per_s);
        if rate == 0 {
            return 0;
        }
        let Some(s) = self.sessions.get(h.slot as usize).filter(|s| s.live) else {
            return 0;
        };
        let Some(u) = self.peers.get_mut(&s.peer) else {
            return 0;
        };
        // Thousandths of an operation per millisecond = operations per second.
        let cap = (rate * 100).max(64 * 1000);
        let elapsed = now_ms.saturating_sub(u.credited_ms);
        u.credit = if u.credited_ms == 0 {
            cap
        } else {
            u.credit
                .saturating_add(rate.saturating_mul(elapsed.min(1 << 20) as i64))
                .min(cap)
        };
        u.credited_ms = now_ms.max(1);
        u.credit -= i64::from(ops.max(1)) * 1000;
        if u.credit >= 0 {
            return 0;
        }
        self.counters.requests_throttled += 1;
        u64::try_from(-u.credit)
            .unwrap_or(u64::MAX)
            .div_ceil(rate as u64)
    }

    /// Opens (or resumes) a session for a client without a network address (see
    /// [`Store::open_session_from`]).
    pub fn open_session(
        &mut self,
        node: NodeId,
        incarnation: u64,
        id: u64,
        now_ms: u64,
    ) -> Result<SessionHandle, StoreError> {
        self.open_session_from(NO_PEER, node, incarnation, id, now_ms)
    }

    /// Opens (or resumes, after a reconnect) the session of a client's handshake, which came
    /// from `peer`.
    pub fn open_session_from(
        &mut self,
        peer: Peer,
        node: NodeId,
        incarnation: u64,
        id: u64,
        now_ms: u64,
    ) -> Result<SessionHandle, StoreError> {
        // Only this peer's sessions: an incarnation, a node id or a session id claimed by
        // another peer names nothing of this one's.
        let newest = self
            .sessions
            .iter()
            .filter(|s| s.live && s.peer == peer && s.node == node)
            .map(|s| s.incarnation)
            .max();
        if let Some(newest) = newest.filter(|&n| n > incarnation) {
            self.counters.sessions_refused_stale += 1;
            return Err(StoreError::StaleIncarnation {
                node,
                got: incarnation,
                newest,
            });
        }
        // Resumed only by its own peer: over TLS the node its certificate names, wherever it
        // reconnects from; over clear TCP its address.
        if let Some(slot) = self.sessions.iter().position(|s| {
            s.live && s.peer == peer && s.node == node && s.incarnation == incarnation && s.id == id
        }) {
            let s = &mut self.sessions[slot];
            s.last_refresh_ms = now_ms;
            self.counters.sessions_resumed += 1;
            return Ok(SessionHandle {
                slot: slot as u32,
                generation: s.generation,
            });
        }
        // A newer incarnation: everything of the older ones is dead (Nswap: a rebooted node).
        let dead: Vec<u32> = (0..self.sessions.len() as u32)
            .filter(|&i| {
                let s = &self.sessions[i as usize];
                s.live && s.peer == peer && s.node == node && s.incarnation < incarnation
            })
            .collect();
        self.counters.sessions_superseded += dead.len() as u64;
        self.end_sessions(&dead);

        let used = self.peers.get(&peer).map_or(0, |u| u.sessions);
        if used >= self.cfg.max_peer_sessions {
            self.counters.sessions_refused_peer_limit += 1;
            return Err(StoreError::TooManyPeerSessions {
                peer,
                limit: self.cfg.max_peer_sessions,
            });
        }
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None if self.sessions.len() < self.cfg.max_sessions => {
                self.sessions.push(Session {
                    peer,
                    node,
                    incarnation,
                    id,
                    generation: 0,
                    last_refresh_ms: now_ms,
                    live: false,
                    pages: 0,
                    beyond: BTreeSet::new(),
                });
                self.sessions.len() as u32 - 1
            }
            None => return Err(StoreError::TooManySessions(self.cfg.max_sessions)),
        };
        let s = &mut self.sessions[slot as usize];
        *s = Session {
            peer,
            node,
            incarnation,
            id,
            generation: s.generation.wrapping_add(1),
            last_refresh_ms: now_ms,
            live: true,
            pages: 0,
            beyond: BTreeSet::new(),
        };
        self.peers.entry(peer).or_default().sessions += 1;
        self.counters.sessions_opened += 1;
        Ok(SessionHandle {
            slot,
            generation: s.generation,
        })
    }

    /// Checks a handle and refreshes its lease: every request is also a refresh.
    fn session(&mut self, h: SessionHandle, now_ms: u64) -> Result<(), StoreError> {
        match self.sessions.get_mut(h.slot as usize) {
            Some(s) if s.live && s.generation == h.generation => {
                s.last_refresh_ms = s.last_refresh_ms.max(now_ms);
                Ok(())
            }
            _ => {
                self.counters.requests_expired_session += 1;
                Err(StoreError::SessionExpired)
            }
        }
    }

    pub fn refresh(&mut self, h: SessionHandle, now_ms: u64) -> Result<(), StoreError> {
        self.session(h, now_ms)
    }

    fn hash(&self, slot: u32, packed: u64) -> u64 {
        self.hasher.hash_one((slot, packed))
    }

    fn find(&self, slot: u32, packed: u64) -> Option<u32> {
        let meta = &self.meta;
        self.index
            .find(self.hash(slot, packed), |&f| {
                let m = &meta[f as usize];
                m.slot() == slot && m.packed_key() == packed
            })
            .copied()
    }

    fn frame(&self, f: u32) -> &[u8] {
        let at = f as usize * PAGE_SIZE;
        &self.arena.as_ref()[at..at + PAGE_SIZE]
    }

    /// Stores a page, in place if the session already has one under that key.
    #[allow(clippy::too_many_arguments)]
    pub fn put(
        &mut self,
        h: SessionHandle,
        key: PageKey,
        version: u32,
        crc: u32,
        flags: PageFlags,
        data: &[u8],
        now_ms: u64,
    ) -> Result<PutStatus, StoreError> {
        self.session(h, now_ms)?;
        let Some(packed) = pack(key) else {
            self.counters.puts_refused_bad_key += 1;
            return Ok(PutStatus::BadKey);
        };
        let fits = data.len() <= PAGE_SIZE && (data.is_empty() || !flags.is_zero());
        if !fits || netram_proto::page_checksum(key, version, flags, data) != crc {
            self.counters.puts_refused_corrupt += 1;
            return Ok(PutStatus::Corrupt);
        }
        let (f, was_clean) = match self.find(h.slot, packed) {
            Some(f) => {
                let was_clean = self.meta[f as usize].flags().is_clean();
                // A clean page written again as its owner's only copy counts against the
                // quota from now on: refused at the quota, as a new page would be.
                let peer = self.sessions[h.slot as usize].peer;
                if was_clean
                    && !flags.is_clean()
                    && self.quota_used(peer) >= self.cfg.max_peer_pages
                {
                    self.counters.puts_refused_quota += 1;
                    return Ok(PutStatus::Full);
                }
                self.counters.pages_overwritten += 1;
                (f, was_clean)
            }
            None => match self.insert_frame(h.slot, packed, flags.is_clean()) {
                Ok(f) => {
                    self.counters.pages_stored += 1;
                    (f, false)
                }
                Err(refused) => return Ok(refused),
            },
        };
        self.meta[f as usize] = FrameMeta {
            key: [packed as u32, (packed >> 32) as u32],
            owner: h.slot | (u32::from(flags.0 as u8) << SLOT_BITS),
            version,
            crc,
        };
        self.owned_clean_put(f, packed, version, was_clean, flags.is_clean(), now_ms);
        let at = f as usize * PAGE_SIZE;
        let frame = &mut self.arena.as_mut()[at..at + PAGE_SIZE];
        // A page that came without its zero tail gets it back: frames are whole pages, for
        // parity's arithmetic and every read.
        netram_proto::expand_into(data, frame);
        Ok(PutStatus::Stored)
    }

    pub fn get(
        &mut self,
        h: SessionHandle,
        key: PageKey,
        now_ms: u64,
    ) -> Result<Option<StoredPage<'_>>, StoreError> {
        let f = self.get_frame(h, key, now_ms)?;
        Ok(f.map(|f| self.stored_page(f)))
    }

    /// A GET of `key` that leaves the page where it is: its frame, to read with
    /// [`Store::stored`] (a GET reply lists every entry before any page's data).
    pub fn get_frame(
        &mut self,
        h: SessionHandle,
        key: PageKey,
        now_ms: u64,
    ) -> Result<Option<u32>, StoreError> {
        self.session(h, now_ms)?;
        let Some(f) = pack(key).and_then(|p| self.find(h.slot, p)) else {
            self.counters.pages_missing += 1;
            return Ok(None);
        };
        self.counters.pages_read += 1;
        Ok(Some(f))
    }

    /// The page in frame `f`, as [`Store::get_frame`] found it.
    pub fn stored(&self, f: u32) -> StoredPage<'_> {
        self.stored_page(f)
    }

    fn stored_page(&self, f: u32) -> StoredPage<'_> {
        let m = self.meta[f as usize];
        StoredPage {
            version: m.version,
            crc: m.crc,
            flags: m.flags(),
            // As it travels: without its zero tail (`netram_proto::page`).
            data: netram_proto::trim(self.frame(f)),
        }
    }

    pub fn delete(
        &mut self,
        h: SessionHandle,
        key: PageKey,
        now_ms: u64,
    ) -> Result<bool, StoreError> {
        self.session(h, now_ms)?;
        // A delete also withdraws what the owner expected another server to hand over under
        // this key: a handover that comes after it is refused (`adopt.rs`).
        if let Some(p) = pack(key) {
            self.withdraw_expected(h.slot, p);
        }
        let found = pack(key).and_then(|p| self.find(h.slot, p));
        match found {
            Some(f) => {
                self.release_frame(f);
                self.page_freed(h.slot);
                self.counters.pages_deleted += 1;
                // A frame freed below the offer takes one of the pages above it at once, the
                // session's own first: what the owner moves away is what its `leaving` counts.
                self.compact_one(Some(h.slot));
                Ok(true)
            }
            None => {
                self.counters.deletes_missing += 1;
                Ok(false)
            }
        }
    }

    /// Ends a session at its client's request, freeing its pages now.
    pub fn close(&mut self, h: SessionHandle) -> Result<(), StoreError> {
        self.session(h, 0)?;
        self.counters.sessions_closed += 1;
        self.end_sessions(&[h.slot]);
        Ok(())
    }

    /// Expires every session not refreshed for [`LEASE_PERIODS`] periods; returns how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let deadline = self.cfg.lease_period_ms * LEASE_PERIODS;
        let dead: Vec<u32> = (0..self.sessions.len() as u32)
            .filter(|&i| {
                let s = &self.sessions[i as usize];
                s.live && now_ms.saturating_sub(s.last_refresh_ms) > deadline
            })
            .collect();
        self.counters.sessions_expired += dead.len() as u64;
        self.end_sessions(&dead);
        dead.len()
    }

    /// Frees every page of the given sessions with one pass over the frames, and their slots.
    fn end_sessions(&mut self, slots: &[u32]) {
        if slots.is_empty() {
            return;
        }
        let mut pages: u64 = slots.iter().map(|&s| self.sessions[s as usize].pages).sum();
        for f in 0..self.meta.len() as u32 {
            if pages == 0 {
                break;
            }
            let m = self.meta[f as usize];
            if m.owner != FREE && slots.contains(&m.slot()) {
                self.release_frame(f);
                pages -= 1;
                self.counters.pages_freed_with_session += 1;
            }
        }
        debug_assert_eq!(pages, 0, "a session's page count disagrees with its frames");
        self.parity.end_sessions(slots);
        let mut gone = Vec::new();
        for &s in slots {
            let session = &mut self.sessions[s as usize];
            let use_ = self.peers.entry(session.peer).or_default();
            use_.sessions -= 1;
            use_.pages -= session.pages;
            if use_.sessions == 0 {
                debug_assert_eq!(use_.pages, 0);
                self.peers.remove(&session.peer);
                gone.push(session.peer);
            }
            debug_assert!(session.beyond.is_empty());
            session.live = false;
            session.pages = 0;
            self.free_slots.push(s);
        }
        for peer in gone {
            self.gcd_forget_peer(&peer);
        }
    }

    /// Takes a free frame for a new key of the session and indexes it; the caller fills in its
    /// metadata. Refused (with the status and the counter) when no frame is free or the
    /// session's client holds its quota.
    fn insert_frame(&mut self, slot: u32, packed: u64, clean: bool) -> Result<u32, PutStatus> {
        let peer = self.sessions[slot as usize].peer;
        // A full server is full, whoever asks; the quota decides while frames remain. While
        // pages wait above a shrunk offer, the frames freed below it are theirs. A clean page
        // is never a reason to refuse: the oldest one gives up its frame (`clean.rs`).
        if (self.free_head == NIL && self.droppable_pages() == 0) || self.used_beyond > 0 {
            self.counters.puts_refused_full += 1;
            return Err(PutStatus::Full);
        }
        if !clean && self.quota_used(peer) >= self.cfg.max_peer_pages {
            self.counters.puts_refused_quota += 1;
            return Err(PutStatus::Full);
        }
        if self.free_head == NIL {
            let dropped = self.drop_oldest_clean();
            debug_assert!(dropped, "a clean page, checked above");
        }
        let f = self.take_free_frame().expect("a free frame, checked above");
        self.meta[f as usize].key = [packed as u32, (packed >> 32) as u32];
        self.meta[f as usize].owner = slot;
        let hash = self.hash(slot, packed);
        let meta = &self.meta;
        self.index.insert_unique(hash, f, |&g| {
            let m = &meta[g as usize];
            self.hasher.hash_one((m.slot(), m.packed_key()))
        });
        self.sessions[slot as usize].pages += 1;
        self.peers.entry(peer).or_default().pages += 1;
        Ok(f)
    }

    /// Pages of `peer`'s that count against its quota: all but its clean ones.
    fn quota_used(&self, peer: Peer) -> u64 {
        self.peers.get(&peer).map_or(0, |u| u.pages - u.clean)
    }

    /// Accounts for a frame of the session's freed (its page deleted, a parity frame freed).
    fn page_freed(&mut self, slot: u32) {
        let s = &mut self.sessions[slot as usize];
        s.pages -= 1;
        if let Some(u) = self.peers.get_mut(&s.peer) {
            u.pages -= 1;
        }
    }

    fn take_free_frame(&mut self) -> Option<u32> {
        let f = self.free_head;
        if f == NIL {
            return None;
        }
        let m = &self.meta[f as usize];
        debug_assert_eq!(m.owner, FREE);
        self.free_head = m.key[0];
        self.free_frames -= 1;
        Some(f)
    }

    /// Unlinks a frame from the index and puts it on the free list (or, above the offer,
    /// among the frames to give back).
    fn release_frame(&mut self, f: u32) {
        let m = self.meta[f as usize];
        self.unindex(f);
        if f >= self.offered {
            self.sessions[m.slot() as usize].beyond.remove(&f);
        }
        self.return_frame(f);
    }

    /// Takes an owned (or parity) frame's page out of the index and of the parity groups.
    fn unindex(&mut self, f: u32) {
        let m = self.meta[f as usize];
        if m.flags().is_clean() {
            self.owned_clean_gone(m.slot());
        }
        let hash = self.hash(m.slot(), m.packed_key());
        let entry = self.index.find_entry(hash, |&g| g == f);
        entry.expect("a used frame is in the index").remove();
        self.parity.frame_released(f);
    }

    /// A frame whose page is gone: onto the free list, or, above the offer, among the frames
    /// to give back.
    fn return_frame(&mut self, f: u32) {
        if f >= self.offered {
            self.meta[f as usize] = FrameMeta {
                key: [NIL, 0],
                owner: FREE,
                version: 0,
                crc: 0,
            };
            self.used_beyond -= 1;
            self.given_back.push(f);
            return;
        }
        self.meta[f as usize] = FrameMeta {
            key: [self.free_head, 0],
            owner: FREE,
            version: 0,
            crc: 0,
        };
        self.free_head = f;
        self.free_frames += 1;
    }

    /// Moves up to `max` pages from above the offer into free frames below it (a memory copy
    /// each; keys, versions and parity stay as they were), and returns how many moved. Their
    /// frames join those to give back. The daemon calls it after a shrink and on every tick,
    /// in bounded steps so that the store's lock is never held long.
    pub fn compact(&mut self, max: usize) -> usize {
        let mut moved = 0;
        while moved < max && self.compact_one(None) {
            moved += 1;
        }
        moved
    }

    /// Moves one page from above the offer into a free frame below it, one of session
    /// `prefer`'s if it has any there; false when nothing is above or nothing is free.
    fn compact_one(&mut self, prefer: Option<u32>) -> bool {
        if self.used_beyond == 0 || self.free_head == NIL {
            return false;
        }
        let own = prefer.and_then(|slot| self.sessions[slot as usize].beyond.last().copied());
        let from = own.or_else(|| self.sessions.iter().find_map(|s| s.beyond.last().copied()));
        let Some(from) = from else {
            debug_assert!(false, "pages above the offer that no session lists");
            return false;
        };
        let to = self.take_free_frame().expect("a free frame, checked above");
        let m = self.meta[from as usize];
        let hash = self.hash(m.slot(), m.packed_key());
        *self
            .index
            .find_mut(hash, |&g| g == from)
            .expect("a used frame is in the index") = to;
        self.arena.as_mut().copy_within(
            from as usize * PAGE_SIZE..(from as usize + 1) * PAGE_SIZE,
            to as usize * PAGE_SIZE,
        );
        self.meta[to as usize] = m;
        self.meta[from as usize] = FrameMeta {
            key: [NIL, 0],
            owner: FREE,
            version: 0,
            crc: 0,
        };
        self.parity.frame_moved(from, to, m.slot(), m.packed_key());
        self.sessions[m.slot() as usize].beyond.remove(&from);
        self.used_beyond -= 1;
        self.given_back.push(from);
        self.counters.pages_compacted += 1;
        true
    }

    /// Checks the store's invariants; for tests and the simulator (it walks every frame).
    /// Panics unless the frame accounting, the index, the sessions and the free list agree.
    pub fn check_invariants(&self) {
        if let Some(why) = self.invariant_violation() {
            panic!("store invariant violated: {why}");
        }
    }

    /// What is wrong with the store's accounting, if anything (for checkers that report rather
    /// than panic, like the simulator's).
    pub fn invariant_violation(&self) -> Option<String> {
        if let Some(why) = self.shared.violation() {
            return Some(why);
        }
        let used = self.meta.iter().filter(|m| m.owner != FREE).count() as u64;
        let beyond = self.meta[self.offered as usize..]
            .iter()
            .filter(|m| m.owner != FREE)
            .count() as u64;
        if beyond != self.used_beyond || used != self.stored_pages() {
            return Some(format!(
                "{used} frames used ({beyond} above the offer of {}): the store counts {} \
                 ({} above) with {} free",
                self.offered,
                self.stored_pages(),
                self.used_beyond,
                self.free_frames
            ));
        }
        let listed: u64 = self
            .sessions
            .iter()
            .filter(|s| s.live)
            .map(|s| s.beyond.len() as u64)
            .sum();
        let wrong = self.sessions.iter().enumerate().any(|(i, s)| {
            s.beyond.iter().any(|&f| {
                f < self.offered
                    || self.meta[f as usize].owner == FREE
                    || self.meta[f as usize].slot() != i as u32
            })
        });
        if listed != beyond || wrong {
            return Some(format!(
                "sessions list {listed} frames above the offer, {beyond} are (or a list is wrong)"
            ));
        }
        if let Some(why) = self.clean_violation() {
            return Some(why);
        }
        // Owned pages (and parity pages): the frames used less those holding clean pages.
        let used = used - self.clean_pages();
        if self.index.len() as u64 != used {
            return Some(format!(
                "index has {} keys, {used} frames used",
                self.index.len()
            ));
        }
        let per_session: u64 = self
            .sessions
            .iter()
            .filter(|s| s.live)
            .map(|s| s.pages)
            .sum();
        if per_session != used {
            return Some(format!(
                "sessions count {per_session} pages, {used} frames used"
            ));
        }
        let per_peer: u64 = self.peers.values().map(|u| u.pages).sum();
        let clean_per_peer: u64 = self.peers.values().map(|u| u.clean).sum();
        if clean_per_peer != self.owned_clean_pages() {
            return Some(format!(
                "clients count {clean_per_peer} clean pages, {} held",
                self.owned_clean_pages()
            ));
        }
        let peer_sessions: u64 = self.peers.values().map(|u| u64::from(u.sessions)).sum();
        if per_peer != used || peer_sessions != self.live_sessions() as u64 {
            return Some(format!(
                "clients count {per_peer} pages and {peer_sessions} sessions, {used} frames \
                 used and {} sessions live",
                self.live_sessions()
            ));
        }
        let mut free = 0;
        let mut f = self.free_head;
        while f != NIL {
            if self.meta[f as usize].owner != FREE || free > self.free_frames || f >= self.offered {
                return Some(format!("free list broken at frame {f}"));
            }
            f = self.meta[f as usize].key[0];
            free += 1;
        }
        (free != self.free_frames)
            .then(|| format!("free list has {free} frames, {} counted", self.free_frames))
    }

    /// Whom a session belongs to (the peer its connection authenticated as).
    pub fn peer(&self, h: SessionHandle) -> Peer {
        self.sessions[h.slot as usize].peer
    }

    /// Pages a live session holds (`None` for an ended or unknown session).
    pub fn session_pages(&self, h: SessionHandle) -> Option<u64> {
        match self.sessions.get(h.slot as usize) {
            Some(s) if s.live && s.generation == h.generation => Some(s.pages),
            _ => None,
        }
    }

    /// The keys a live session holds, in frame order, parity frames left out: for checkers (a
    /// scan of every frame).
    pub fn session_keys(&self, h: SessionHandle) -> Vec<PageKey> {
        if self.session_pages(h).is_none() {
            return Vec::new();
        }
        self.meta
            .iter()
            .filter(|m| m.owner != FREE && m.slot() == h.slot)
            .map(|m| {
                let k = m.packed_key();
                PageKey::new((k >> 40) as u32, k & PAGE_NUMBER_MAX)
            })
            .filter(|k| k.region != PARITY_REGION)
            .collect()
    }

    /// A stored page, read without refreshing the session or counting a read: for checkers.
    pub fn peek(&self, h: SessionHandle, key: PageKey) -> Option<StoredPage<'_>> {
        match self.sessions.get(h.slot as usize) {
            Some(s) if s.live && s.generation == h.generation => {}
            _ => return None,
        }
        let f = pack(key).and_then(|p| self.find(h.slot, p))?;
        Some(self.stored_page(f))
    }
}

#[cfg(test)]
mod adopt_tests;
#[cfg(test)]
mod limits_tests;
#[cfg(test)]
mod parity_tests;
#[cfg(test)]
mod tests;
