//! Pages handed from server to server (Nswap §III, Fig. 2, paper 004): when a donor shrinks,
//! a page leaves it (C) for another server (B) without passing through its owner (A).
//!
//! Sessions are bound to their owner's certificate ("Trust nobody on the wire"), so B may not
//! take a page into A's session on C's word alone: A first tells B, on its own session, which
//! pages C will hand over and at which versions (EXPECT); C then hands them over on its peer
//! session, naming A (ADOPT). An expectation is used once, lasts [`EXPECT_TTL_MS`], and B holds
//! at most [`MAX_EXPECTED_PER_SESSION`] per session, [`MAX_EXPECTED_PER_PEER`] per client (all
//! its sessions) and [`MAX_EXPECTED`] in all: B pays for the pages, so B bounds them, and no
//! client's expectations leave none for the others. A page is adopted only into a key the
//! session does not hold: a write of a newer version that got there first is never replaced by
//! the older one migrating. The owner's DELETE of a key withdraws its expectation: an owner that gave up on a move (C
//! stopped answering) deletes B's copy, and a handover still on its way is refused after.

use crate::{pack, Peer, SessionHandle, Store, StoreError};
use netram_proto::{MoveStatus, Owner, Page, PutStatus};
use std::collections::HashMap;

/// How long an expectation waits for its page.
pub const EXPECT_TTL_MS: u64 = 10_000;
/// Expectations one session may have outstanding.
pub const MAX_EXPECTED_PER_SESSION: usize = 4096;
/// Expectations one client (a peer: its certificate's node, or its address) may have
/// outstanding over all of its sessions: a quarter of the store's.
pub const MAX_EXPECTED_PER_PEER: usize = MAX_EXPECTED / 4;
/// Expectations the store holds in all.
pub const MAX_EXPECTED: usize = 65_536;

/// A page a session's owner said another server would hand over.
#[derive(Debug, Clone, Copy)]
struct Expected {
    version: u32,
    /// The sender's node id, as its certificate names it.
    from: u64,
    until_ms: u64,
    /// The session's generation: an expectation outlives neither its session nor the slot's
    /// reuse.
    generation: u32,
    /// The client whose session expects it, counted against its bound.
    peer: Peer,
}

/// The expectations of every session, by (session slot, packed key).
#[derive(Debug, Default)]
pub(crate) struct Expectations {
    by_key: HashMap<(u32, u64), Expected>,
    per_slot: HashMap<u32, usize>,
    per_peer: HashMap<Peer, usize>,
}

impl Expectations {
    fn remove(&mut self, at: (u32, u64)) -> Option<Expected> {
        let e = self.by_key.remove(&at)?;
        fn less<K: std::hash::Hash + Eq>(m: &mut HashMap<K, usize>, k: K) {
            if let Some(n) = m.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&k);
                }
            }
        }
        less(&mut self.per_slot, at.0);
        less(&mut self.per_peer, e.peer);
        Some(e)
    }

    fn insert(&mut self, at: (u32, u64), e: Expected) {
        *self.per_slot.entry(at.0).or_default() += 1;
        *self.per_peer.entry(e.peer).or_default() += 1;
        self.by_key.insert(at, e);
    }

    /// Drops the expectations that ran out or whose session is gone.
    fn purge(&mut self, now_ms: u64, live: impl Fn(u32, u32) -> bool) {
        let stale: Vec<(u32, u64)> = self
            .by_key
            .iter()
            .filter(|(&(slot, _), e)| e.until_ms < now_ms || !live(slot, e.generation))
            .map(|(&k, _)| k)
            .collect();
        for k in stale {
            self.remove(k);
        }
    }
}

impl<A: AsRef<[u8]> + AsMut<[u8]>> Store<A> {
    /// The owner deleted the key: what it expected under it is withdrawn.
    pub(crate) fn withdraw_expected(&mut self, slot: u32, packed: u64) {
        if !self.expected.by_key.is_empty() {
            self.expected.remove((slot, packed));
        }
    }

    /// Expectations held (some may have run out and wait to be purged).
    pub fn expected_pages(&self) -> usize {
        self.expected.by_key.len()
    }

    /// Session `h`'s owner says node `from` will hand it `key` at `version`. Refused (`Full`)
    /// when the store has no room for a new page or holds as many expectations as it may;
    /// an expectation for a key already expected replaces it.
    pub fn expect(
        &mut self,
        h: SessionHandle,
        from: u64,
        key: netram_proto::PageKey,
        version: u32,
        now_ms: u64,
    ) -> Result<MoveStatus, StoreError> {
        self.session(h, now_ms)?;
        let Some(packed) = pack(key) else {
            self.counters.expects_refused += 1;
            return Ok(MoveStatus::Unexpected);
        };
        let at = (h.slot, packed);
        let peer = self.sessions[h.slot as usize].peer;
        if self.room_for(h.slot) == 0 {
            self.counters.expects_refused += 1;
            return Ok(MoveStatus::Full);
        }
        // Expecting a key again replaces its expectation: it takes no other.
        let again = self.expected.remove(at).is_some();
        let full = |x: &Expectations| {
            x.by_key.len() >= MAX_EXPECTED
                || x.per_slot.get(&h.slot).copied().unwrap_or(0) >= MAX_EXPECTED_PER_SESSION
                || x.per_peer.get(&peer).copied().unwrap_or(0) >= MAX_EXPECTED_PER_PEER
        };
        if !again && full(&self.expected) {
            let sessions = &self.sessions;
            self.expected.purge(now_ms, |slot, generation| {
                sessions
                    .get(slot as usize)
                    .is_some_and(|s| s.live && s.generation == generation)
            });
        }
        if !again && full(&self.expected) {
            self.counters.expects_refused += 1;
            return Ok(MoveStatus::Full);
        }
        self.expected.insert(
            at,
            Expected {
                version,
                from,
                until_ms: now_ms + EXPECT_TTL_MS,
                generation: h.generation,
                peer,
            },
        );
        Ok(MoveStatus::Done)
    }

    /// A server (`by`) hands over a page of `owner`'s session. Stored only as its owner said
    /// ([`Store::expect`]): by that node (any server over clear TCP; never a client), at that
    /// version, before the expectation ran out, into a key the session does not hold.
    pub fn adopt(&mut self, by: Peer, owner: Owner, page: &Page<'_>, now_ms: u64) -> MoveStatus {
        let refuse = |s: &mut Self, status: MoveStatus| {
            match status {
                MoveStatus::Exists => s.counters.adopts_refused_exists += 1,
                MoveStatus::Full | MoveStatus::Corrupt => s.counters.adopts_refused_full += 1,
                _ => s.counters.adopts_refused_unexpected += 1,
            }
            status
        };
        let sender = match by {
            Peer::Server(n) => Some(n),
            Peer::Addr(_) => None,
            Peer::Node(_) => return refuse(self, MoveStatus::Unexpected),
        };
        let Some(packed) = pack(page.key) else {
            return refuse(self, MoveStatus::Unexpected);
        };
        // The owner's session that expects the page (an owner may hold more than one session
        // here for a while, its old one not yet expired): the one that expected it last, which
        // is the session the owner uses now (an expectation its old session took before the
        // owner gave that connection up must not catch the page: the owner looks for it in
        // the new one).
        let slot = (0..self.sessions.len() as u32)
            .filter(|&i| self.is_owner(i, owner))
            .filter_map(|i| {
                self.expected
                    .by_key
                    .get(&(i, packed))
                    .map(|e| (i, e.until_ms))
            })
            .max_by_key(|&(i, until)| (until, i))
            .map(|(i, _)| i);
        let Some(slot) = slot else {
            return refuse(self, MoveStatus::Unexpected);
        };
        let generation = self.sessions[slot as usize].generation;
        let at = (slot, packed);
        let Some(&e) = self.expected.by_key.get(&at) else {
            return refuse(self, MoveStatus::Unexpected);
        };
        if e.generation != generation || e.until_ms < now_ms {
            self.expected.remove(at);
            return refuse(self, MoveStatus::Unexpected);
        }
        // Another sender's try leaves the expectation to the sender the owner named: one
        // who is not cannot use it up.
        if sender.is_some_and(|n| n != e.from) {
            return refuse(self, MoveStatus::Unexpected);
        }
        self.expected.remove(at);
        if e.version != page.version {
            return refuse(self, MoveStatus::Unexpected);
        }
        if self.find(slot, packed).is_some() {
            return refuse(self, MoveStatus::Exists);
        }
        let h = SessionHandle { slot, generation };
        match self.put(
            h,
            page.key,
            page.version,
            page.crc,
            page.flags,
            page.data,
            now_ms,
        ) {
            Ok(PutStatus::Stored) => {
                self.counters.pages_adopted += 1;
                MoveStatus::Done
            }
            Ok(PutStatus::Corrupt) => refuse(self, MoveStatus::Corrupt),
            Ok(PutStatus::Full) => refuse(self, MoveStatus::Full),
            Ok(_) | Err(_) => refuse(self, MoveStatus::Unexpected),
        }
    }
}
