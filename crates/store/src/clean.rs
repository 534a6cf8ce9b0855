//! Clean pages (GMS, paper 000, §3.3 and §4.5; issue 39): copies of pages that also exist in a
//! source (a file, the owner's disk), held here for other nodes as *global* pages.
//!
//! They share the arena and the offer with owned pages but are a different kind of thing: any
//! of them may be dropped at any time, since its user can read it again from the source. So:
//! - an owned page that finds no free frame takes the oldest clean page's instead of being
//!   refused ([`Store::put`]'s `Full` only when no clean page is left): a full cluster evicts
//!   a copy rather than refuse the only one;
//! - a clean page sent here takes a free frame, or the frame of the oldest clean page if that
//!   page is at least as old as it (GMS's receiving rule: this node's own ages outweigh the
//!   plan that sent it), or is refused ([`CachedStatus::Refused`]);
//! - a shrinking offer drops the clean pages above it instead of moving them;
//! - they outlive the session that sent them (they are the cluster's cache, not a client's
//!   data), and count against their sender's quota of frames (`max_peer_pages`) apart from
//!   its owned pages.
//!
//! A clean page is checked against its checksum (over its uid and contents) when it arrives;
//! a damaged or mislabelled one is refused and counted. Frames holding clean pages are marked
//! with the session slot [`CLEAN`], which no session has, and are not in the owned-page index;
//! the clean pages' own index keeps them in order of last use, oldest first.
//!
//! **Owners' clean pages** (issue 39's second source): a client with `cluster+disk` backing
//! keeps every page it sends on its own disk too, and says so with [`PageFlags::CLEAN`]. Such
//! a page stays its owner's (in its session, read and deleted only by it) but competes with
//! the cached pages for frames: whichever of the two kinds is oldest goes first when a page
//! finds no frame, and both count as room in what a reply tells clients. Its age is the time
//! since it arrived: it came when its owner's LRU let it go, and a GET does not make it
//! younger, since the page is then in its owner's memory again and the copy here is a
//! duplicate (GMS: duplicates go first). Arrivals are kept in a queue, oldest first; an entry
//! whose frame was freed or written again since no longer matches the frame and is skipped.

use crate::{FrameMeta, Peer, SessionHandle, Store, StoreError, FREE, SLOT_BITS, SLOT_MASK};
use netram_proto::gms::{cached_checksum, CachedStatus};
use netram_proto::{PageFlags, PAGE_SIZE};
use std::collections::{BTreeSet, HashMap, VecDeque};

/// How many of the oldest clean pages are looked through for one of a sender's own, when it
/// sends at its quota.
const OWN_SCAN: usize = 256;

/// The session slot that marks a frame holding a clean page.
pub(crate) const CLEAN: u32 = SLOT_MASK;

/// How much faster a held clean page ages than a page in use by its own node (GMS §3.1; the
/// same factor as `netram_policy::gms::GLOBAL_AGE_BOOST`).
const AGE_BOOST: u64 = 2;

#[derive(Debug, Clone, Copy)]
pub(crate) struct CleanMeta {
    frame: u32,
    crc: u32,
    flags: PageFlags,
    /// When its user last touched it, on this store's clock.
    last_ms: u64,
    /// Who sent it (its quota).
    peer: Peer,
}

/// The clean pages' index, and their order by age (a page arrives with the age its sender
/// gives it, so arrival order is not age order).
#[derive(Debug, Default)]
pub(crate) struct CleanPages {
    pages: HashMap<u128, CleanMeta>,
    by_age: BTreeSet<(u64, u128)>,
    /// Which page each clean frame holds (a shrink drops them by frame).
    by_frame: HashMap<u32, u128>,
    per_peer: HashMap<Peer, u64>,
}

impl CleanPages {
    fn len(&self) -> usize {
        self.pages.len()
    }

    fn insert(&mut self, uid: u128, m: CleanMeta) {
        self.by_age.insert((m.last_ms, uid));
        self.by_frame.insert(m.frame, uid);
        *self.per_peer.entry(m.peer).or_default() += 1;
        self.pages.insert(uid, m);
    }

    /// The oldest clean page `peer` sent, among the `scan` oldest held (`None` if none of
    /// those is its): bounded work, and a sender at its quota is nearly always among the
    /// oldest.
    fn oldest_of(&self, peer: &Peer, scan: usize) -> Option<(u64, u128)> {
        self.by_age
            .iter()
            .take(scan)
            .find(|(_, uid)| self.pages.get(uid).is_some_and(|m| m.peer == *peer))
            .copied()
    }

    fn remove(&mut self, uid: u128) -> Option<CleanMeta> {
        let m = self.pages.remove(&uid)?;
        self.by_age.remove(&(m.last_ms, uid));
        self.by_frame.remove(&m.frame);
        self.forget_peer_page(m.peer);
        Some(m)
    }

    fn oldest(&self) -> Option<(u128, CleanMeta)> {
        let &(_, uid) = self.by_age.first()?;
        Some((uid, self.pages[&uid]))
    }

    fn touch(&mut self, uid: u128, now_ms: u64) {
        if let Some(m) = self.pages.get_mut(&uid) {
            self.by_age.remove(&(m.last_ms, uid));
            m.last_ms = m.last_ms.max(now_ms);
            self.by_age.insert((m.last_ms, uid));
        }
    }

    fn forget_peer_page(&mut self, peer: Peer) {
        if let Some(n) = self.per_peer.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&peer);
            }
        }
    }
}

/// An owner's clean page as it arrived: when, and which page (the session must still hold that
/// key at that version, as a clean page, for the entry to count). By session and key, not by
/// frame: compaction (`Store::compact`) moves pages between frames.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    ms: u64,
    key: u64,
    slot: u32,
    version: u32,
}

/// Owners' clean pages, oldest arrival first (see the module's documentation).
#[derive(Debug, Default)]
pub(crate) struct OwnedClean {
    queue: VecDeque<Arrival>,
    /// Frames holding one: exact, kept by `put` and `unindex`.
    count: u64,
}

/// The page a full store drops.
#[derive(Debug, Clone, Copy)]
enum Victim {
    Cached(u128),
    Owned(u32),
}

/// A clean page as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CleanPage {
    /// How long ago its user last touched it, as this store knows (ms).
    pub age_ms: u32,
    pub crc: u32,
    pub flags: PageFlags,
    /// `PAGE_SIZE` bytes, or none for a zero page.
    pub data: Vec<u8>,
}

impl<A: AsRef<[u8]> + AsMut<[u8]>> Store<A> {
    /// Clean pages held.
    pub fn clean_pages(&self) -> u64 {
        self.clean.len() as u64
    }

    /// The ages (ms, boosted as global pages' are) of the clean pages held, owners' clean
    /// pages among them: a node's part of an epoch's summary, with [`Store::room`] as its
    /// free frames.
    pub fn clean_ages(&self, now_ms: u64) -> impl Iterator<Item = u64> + '_ {
        let owned = self
            .owned_clean
            .queue
            .iter()
            .filter(|a| self.arrival_holds(a))
            .map(|a| a.ms);
        self.clean
            .pages
            .values()
            .map(|m| m.last_ms)
            .chain(owned)
            .map(move |ms| now_ms.saturating_sub(ms).saturating_mul(AGE_BOOST))
    }

    /// Owners' clean pages held ([`PageFlags::CLEAN`]).
    pub fn owned_clean_pages(&self) -> u64 {
        self.owned_clean.count
    }

    /// The age queue's memory: 24 bytes an entry, at most twice the pages it holds plus 64.
    pub(crate) fn owned_clean_bytes(&self) -> usize {
        self.owned_clean.queue.capacity() * std::mem::size_of::<Arrival>()
    }

    /// Frames a page may take by dropping a clean one.
    pub(crate) fn droppable_pages(&self) -> u64 {
        self.clean_pages() + self.owned_clean.count
    }

    /// The frame of the page an arrival names, if it is still there at that version and
    /// clean.
    fn arrival_frame(&self, a: &Arrival) -> Option<u32> {
        let f = self.find(a.slot, a.key)?;
        let m = self.meta[f as usize];
        (m.flags().is_clean() && m.version == a.version).then_some(f)
    }

    fn arrival_holds(&self, a: &Arrival) -> bool {
        self.arrival_frame(a).is_some()
    }

    /// Accounts for an owned page written into frame `f` (`put`): `was` and `is` say whether
    /// the frame held, and now holds, an owner's clean page.
    pub(crate) fn owned_clean_put(
        &mut self,
        f: u32,
        key: u64,
        version: u32,
        was: bool,
        is: bool,
        now_ms: u64,
    ) {
        let slot = self.meta[f as usize].slot();
        match (was, is) {
            (false, true) => {
                self.owned_clean.count += 1;
                let peer = self.sessions[slot as usize].peer;
                self.peers.entry(peer).or_default().clean += 1;
            }
            (true, false) => self.owned_clean_gone(slot),
            _ => {}
        }
        if !is {
            return;
        }
        self.counters.clean_owned_stored += 1;
        self.owned_clean.queue.push_back(Arrival {
            ms: now_ms,
            key,
            slot,
            version,
        });
        // Entries of pages gone or written again are skipped when they reach the front;
        // pages that stay keep them from it, so the queue is swept once it is twice what it
        // holds (the sweep's cost is spread over as many PUTs as the queue had entries).
        if self.owned_clean.queue.len() as u64 > 2 * self.owned_clean.count + 64 {
            let queue = std::mem::take(&mut self.owned_clean.queue);
            let mut seen = std::collections::HashSet::new();
            // The newest entry of a frame is the one that counts (an equal rewrite pushes
            // a second one); keep it, oldest first.
            let mut kept: Vec<Arrival> = queue
                .into_iter()
                .rev()
                .filter(|a| self.arrival_holds(a) && seen.insert((a.slot, a.key)))
                .collect();
            kept.reverse();
            self.owned_clean.queue = kept.into();
        }
    }

    /// An owner's clean page of session `slot`'s is gone (freed, or written again as an only
    /// copy).
    pub(crate) fn owned_clean_gone(&mut self, slot: u32) {
        self.owned_clean.count -= 1;
        let peer = self.sessions[slot as usize].peer;
        if let Some(u) = self.peers.get_mut(&peer) {
            u.clean -= 1;
        }
    }

    /// The oldest owner's clean page, dropping the queue's stale entries on the way.
    fn oldest_owned_clean(&mut self) -> Option<Arrival> {
        while let Some(a) = self.owned_clean.queue.front().copied() {
            if self.arrival_holds(&a) {
                return Some(a);
            }
            self.owned_clean.queue.pop_front();
        }
        None
    }

    /// The oldest clean page of either kind, and when its user last touched it.
    fn oldest_droppable(&mut self) -> Option<(u64, Victim)> {
        let cached = self
            .clean
            .oldest()
            .map(|(uid, m)| (m.last_ms, Victim::Cached(uid)));
        let owned = self.oldest_owned_clean().map(|a| {
            let f = self
                .arrival_frame(&a)
                .expect("checked by oldest_owned_clean");
            (a.ms, Victim::Owned(f))
        });
        match (cached, owned) {
            (Some(c), Some(o)) => Some(if o.0 < c.0 { o } else { c }),
            (c, o) => c.or(o),
        }
    }

    /// Drops a clean page to free its frame; the counters say for what.
    fn drop_victim(&mut self, v: Victim, for_owned: bool) {
        match v {
            Victim::Cached(uid) => {
                let m = self.clean.remove(uid).expect("the oldest clean page");
                self.release_clean_frame(m.frame);
                if for_owned {
                    self.counters.clean_dropped_for_owned += 1;
                } else {
                    self.counters.clean_replaced += 1;
                }
            }
            Victim::Owned(f) => {
                let slot = self.meta[f as usize].slot();
                self.release_frame(f);
                self.page_freed(slot);
                self.counters.clean_owned_dropped += 1;
            }
        }
    }

    /// An owner's clean page above a shrinking offer, out of every index: the caller frees
    /// the frame.
    pub(crate) fn drop_owned_clean_frame(&mut self, f: u32) {
        let slot = self.meta[f as usize].slot();
        self.unindex(f);
        self.page_freed(slot);
        self.counters.clean_owned_dropped_for_offer += 1;
    }

    /// A clean page sent by session `h`'s client (GMS's putpage, received).
    #[allow(clippy::too_many_arguments)]
    pub fn put_clean(
        &mut self,
        h: SessionHandle,
        uid: u128,
        age_ms: u32,
        crc: u32,
        flags: PageFlags,
        data: &[u8],
        now_ms: u64,
    ) -> Result<CachedStatus, StoreError> {
        self.session(h, now_ms)?;
        if cached_checksum(uid, flags, data) != crc
            || data.len() != if flags.is_zero() { 0 } else { PAGE_SIZE }
        {
            self.counters.clean_refused_corrupt += 1;
            return Ok(CachedStatus::Corrupt);
        }
        if self.clean.pages.contains_key(&uid) {
            self.counters.clean_present += 1;
            return Ok(CachedStatus::Present);
        }
        let peer = self.sessions[h.slot as usize].peer;
        let held = self.clean.per_peer.get(&peer).copied().unwrap_or(0);
        let last_ms = now_ms.saturating_sub(u64::from(age_ms));
        let incoming = u64::from(age_ms).saturating_mul(AGE_BOOST);
        let (frame, status) = if held >= self.cfg.max_peer_pages {
            // At its quota a sender's page may still take the frame of one of its own that is
            // at least as old (GMS's receiving rule within the sender's share: its oldest page
            // here goes), so a client that holds its share keeps its newest pages, not its
            // first ones.
            match self.clean.oldest_of(&peer, OWN_SCAN) {
                Some((victim_ms, victim))
                    if now_ms.saturating_sub(victim_ms).saturating_mul(AGE_BOOST) >= incoming
                        && self.used_beyond == 0 =>
                {
                    self.drop_victim(Victim::Cached(victim), false);
                    let f = self.take_free_frame().expect("a frame just freed");
                    (f, CachedStatus::Replaced)
                }
                _ => {
                    self.counters.clean_refused_quota += 1;
                    return Ok(CachedStatus::Refused);
                }
            }
        } else if self.room() > 0 {
            let f = self.take_free_frame().expect("room means a free frame");
            self.counters.clean_stored += 1;
            (f, CachedStatus::Taken)
        } else {
            // GMS's receiving rule: only in place of a page at least as old, of either kind.
            match self.oldest_droppable() {
                Some((last_ms, victim))
                    if now_ms.saturating_sub(last_ms).saturating_mul(AGE_BOOST) >= incoming
                        && self.used_beyond == 0 =>
                {
                    self.drop_victim(victim, false);
                    let f = self.take_free_frame().expect("a frame just freed");
                    (f, CachedStatus::Replaced)
                }
                _ => {
                    self.counters.clean_refused_younger += 1;
                    return Ok(CachedStatus::Refused);
                }
            }
        };
        self.meta[frame as usize] = FrameMeta {
            key: [0, 0],
            owner: CLEAN | (u32::from(flags.0 as u8) << SLOT_BITS),
            version: 0,
            crc,
        };
        let at = frame as usize * PAGE_SIZE;
        let dst = &mut self.arena.as_mut()[at..at + PAGE_SIZE];
        if flags.is_zero() {
            dst.fill(0);
        } else {
            dst.copy_from_slice(data);
        }
        self.clean.insert(
            uid,
            CleanMeta {
                frame,
                crc,
                flags,
                last_ms,
                peer,
            },
        );
        Ok(status)
    }

    /// A clean page asked for by uid (GMS's getpage). `take`: the asker will use it, so it
    /// leaves this node (a global page has one copy, §4.5); otherwise it stays, as the
    /// youngest.
    pub fn get_clean(
        &mut self,
        h: SessionHandle,
        uid: u128,
        take: bool,
        now_ms: u64,
    ) -> Result<Option<CleanPage>, StoreError> {
        self.session(h, now_ms)?;
        let Some(m) = self.clean.pages.get(&uid).copied() else {
            self.counters.clean_misses += 1;
            return Ok(None);
        };
        let page = CleanPage {
            age_ms: u32::try_from(now_ms.saturating_sub(m.last_ms)).unwrap_or(u32::MAX),
            crc: m.crc,
            flags: m.flags,
            data: if m.flags.is_zero() {
                Vec::new()
            } else {
                self.frame(m.frame).to_vec()
            },
        };
        self.counters.clean_hits += 1;
        if take {
            self.clean.remove(uid);
            self.release_clean_frame(m.frame);
            self.counters.clean_taken += 1;
        } else {
            self.clean.touch(uid, now_ms);
        }
        Ok(Some(page))
    }

    /// Drops the oldest clean page of either kind to free its frame for an owned page; false
    /// when there is none.
    pub(crate) fn drop_oldest_clean(&mut self) -> bool {
        let Some((_, victim)) = self.oldest_droppable() else {
            return false;
        };
        self.drop_victim(victim, true);
        true
    }

    /// Drops the clean page in frame `f` (above a shrinking offer).
    pub(crate) fn drop_clean_frame(&mut self, f: u32) {
        if let Some(&uid) = self.clean.by_frame.get(&f) {
            self.clean.remove(uid);
        }
        self.counters.clean_dropped_for_offer += 1;
    }

    /// A clean page's frame, freed (it is in no index but the clean pages').
    fn release_clean_frame(&mut self, f: u32) {
        debug_assert_eq!(self.meta[f as usize].slot(), CLEAN);
        self.return_frame(f);
    }

    /// What is wrong with the clean pages' accounting, if anything.
    pub(crate) fn clean_violation(&self) -> Option<String> {
        let marked = self
            .meta
            .iter()
            .filter(|m| m.owner != FREE && m.slot() == CLEAN)
            .count();
        if marked != self.clean.len()
            || self.clean.by_age.len() != self.clean.len()
            || self.clean.by_frame.len() != self.clean.len()
        {
            return Some(format!(
                "{marked} frames marked clean, {} clean pages indexed",
                self.clean.pages.len()
            ));
        }
        if let Some((u, m)) = self.clean.pages.iter().find(|(_, m)| {
            self.meta[m.frame as usize].slot() != CLEAN || self.meta[m.frame as usize].owner == FREE
        }) {
            return Some(format!(
                "clean page {u:#x} indexed at frame {} not marked",
                m.frame
            ));
        }
        let owned = self
            .meta
            .iter()
            .filter(|m| m.owner != FREE && m.slot() != CLEAN && m.flags().is_clean())
            .count() as u64;
        if owned != self.owned_clean.count {
            return Some(format!(
                "{owned} frames hold owners' clean pages, {} counted",
                self.owned_clean.count
            ));
        }
        let queued = self
            .owned_clean
            .queue
            .iter()
            .filter_map(|a| self.arrival_frame(a))
            .collect::<std::collections::HashSet<_>>()
            .len() as u64;
        if queued != owned {
            return Some(format!(
                "{owned} owners' clean pages, {queued} in the age queue"
            ));
        }
        let per_peer: u64 = self.clean.per_peer.values().sum();
        (per_peer != self.clean.pages.len() as u64).then(|| {
            format!(
                "senders count {per_peer} clean pages, {} held",
                self.clean.pages.len()
            )
        })
    }
}

#[cfg(test)]
mod tests;
