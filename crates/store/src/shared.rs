//! This daemon's part of the global-cache directory (GMS, paper 000, §4.4–4.5; issue 39): for
//! the shared pages whose home it is (rendezvous hashing over the members,
//! `netram_policy::gms::directory::Pod`), which nodes hold them in their own memory.
//!
//! Shared pages are file pages that several machines read through `netram cache` (the same
//! file at the same source gives the same uid everywhere). A node that lets such a page go
//! asks its home whether another node still holds it: if one does, the page is a duplicate and
//! is dropped instead of taking a global frame somewhere (§4.5: "if the evicted page is a
//! shared global page for which a duplicate exists elsewhere in the cluster, then it is simply
//! discarded"), so idle memory goes to pages nobody else has.
//!
//! **What a liar can do.** The directory holds presence, never contents: nobody reads a page
//! because of it. A node that registers pages it does not hold can only make others drop, as
//! duplicates, pages they would have forwarded, which they then read from the source again;
//! one that hides its pages only makes others forward duplicates. Both cost speed, never data,
//! and the damage is bounded by what the liar may register here: [`MAX_PER_PEER`] entries (a
//! generous share of any one machine's memory), and [`MAX_ENTRIES`] in all, beyond which
//! additions are refused and counted. A peer's entries go when its last session ends (it
//! re-registers after reconnecting, told by the count it gets back).

use crate::{Peer, SessionHandle, Store, StoreError};
use netram_policy::gms::directory::Gcd;
use netram_policy::gms::frames::Kind;
use netram_policy::gms::Uid;
use std::collections::{HashMap, HashSet};

/// Entries one peer may hold here: 2^17 pages registered = 512 MiB of its memory homed on
/// this daemon (with n members, a machine with n × 512 MiB of shared pages).
pub const MAX_PER_PEER: u32 = 1 << 17;
/// Entries held here in all (~100 bytes each: ~50 MiB).
pub const MAX_ENTRIES: usize = 1 << 19;

/// What one update did, for the reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GcdOutcome {
    /// The first so many additions were recorded (the rest were beyond the bounds).
    pub taken: u32,
    /// Entries now held for the sender.
    pub held: u32,
    /// Per removal: another node still holds the page.
    pub elsewhere: Vec<bool>,
}

/// One registering peer: its id in the directory and the uids it registered (so that its
/// entries can be forgotten in time proportional to them, not to the whole directory).
#[derive(Debug, Default)]
struct Registrant {
    id: u64,
    uids: HashSet<u128, foldhash::fast::FixedState>,
}

#[derive(Debug, Default)]
pub(crate) struct SharedDir {
    gcd: Gcd,
    peers: HashMap<Peer, Registrant>,
    next_id: u64,
    entries: usize,
}

impl SharedDir {
    /// Everything `peer` registered goes (its last session ended, or it asked to start over).
    fn forget(&mut self, peer: &Peer) -> usize {
        let Some(r) = self.peers.remove(peer) else {
            return 0;
        };
        for u in &r.uids {
            self.gcd.remove(&Uid(*u), r.id);
        }
        self.entries -= r.uids.len();
        r.uids.len()
    }

    /// What is wrong with the directory's accounting, if anything: every registrant's pages
    /// name it in the directory, and the count is theirs.
    pub(crate) fn violation(&self) -> Option<String> {
        let mut n = 0;
        for (peer, r) in &self.peers {
            if r.uids.is_empty() || r.uids.len() > MAX_PER_PEER as usize {
                return Some(format!("{peer:?} registered {} pages", r.uids.len()));
            }
            n += r.uids.len();
            for u in &r.uids {
                if !self.gcd.holders(&Uid(*u)).iter().any(|h| h.0 == r.id) {
                    return Some(format!("{peer:?}'s page {u:#x} is not in the directory"));
                }
            }
        }
        let listed: usize = self.gcd.iter().map(|(_, h)| h.len()).sum();
        (n != self.entries || listed != n || n > MAX_ENTRIES).then(|| {
            format!(
                "{n} pages registered, {listed} in the directory, {} counted",
                self.entries
            )
        })
    }

    pub(crate) fn bytes(&self) -> usize {
        // A directory entry (uid, a holders vector and its allocation) and the registrant's
        // copy of the uid, with the tables' slack: an estimate, for `meta_bytes`.
        self.entries * 100
    }
}

impl<A: AsRef<[u8]> + AsMut<[u8]>> Store<A> {
    /// GCD_UPDATE from session `h`: its peer now holds the pages `add` (in order, until its
    /// bound) and no longer `remove`; `reset` forgets all it registered first.
    pub fn gcd_update(
        &mut self,
        h: SessionHandle,
        reset: bool,
        add: &[u128],
        remove: &[u128],
        now_ms: u64,
    ) -> Result<GcdOutcome, StoreError> {
        self.session(h, now_ms)?;
        let peer = self.peer(h);
        let d = &mut self.shared;
        if reset {
            let n = d.forget(&peer);
            self.counters.gcd_resets += 1;
            self.counters.gcd_forgotten += n as u64;
        }
        let next = d.next_id;
        let r = d.peers.entry(peer).or_insert_with(|| Registrant {
            id: next,
            uids: Default::default(),
        });
        if r.id == next {
            d.next_id += 1;
        }
        let mut taken = 0u32;
        for &u in add {
            if !r.uids.contains(&u) {
                if r.uids.len() >= MAX_PER_PEER as usize || d.entries >= MAX_ENTRIES {
                    self.counters.gcd_adds_refused += (add.len() - taken as usize) as u64;
                    break;
                }
                r.uids.insert(u);
                d.gcd.add(Uid(u), r.id, Kind::Local);
                d.entries += 1;
                self.counters.gcd_adds += 1;
            }
            taken += 1;
        }
        let mut elsewhere = Vec::with_capacity(remove.len());
        for &u in remove {
            if r.uids.remove(&u) {
                d.gcd.remove(&Uid(u), r.id);
                d.entries -= 1;
                self.counters.gcd_removes += 1;
            }
            let dup = !d.gcd.holders(&Uid(u)).is_empty();
            self.counters.gcd_duplicates += u64::from(dup);
            elsewhere.push(dup);
        }
        let held = r.uids.len() as u32;
        if held == 0 {
            d.peers.remove(&peer);
        }
        Ok(GcdOutcome {
            taken,
            held,
            elsewhere,
        })
    }

    /// Shared pages registered here, by all peers.
    pub fn gcd_entries(&self) -> usize {
        self.shared.entries
    }

    /// The peer's last session ended: its entries go with it.
    pub(crate) fn gcd_forget_peer(&mut self, peer: &Peer) {
        let n = self.shared.forget(peer);
        self.counters.gcd_forgotten += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{StoreConfig, PAGE_SIZE};

    fn store() -> Store<Vec<u8>> {
        Store::new(
            vec![0u8; 4 * PAGE_SIZE],
            StoreConfig {
                lease_period_ms: 100_000,
                max_sessions: 8,
                ..StoreConfig::default()
            },
        )
    }

    fn open(s: &mut Store<Vec<u8>>, node: u64) -> SessionHandle {
        s.open_session_from(Peer::Node(node), node, 1, 1, 0)
            .unwrap()
    }

    #[test]
    fn a_page_given_up_is_a_duplicate_while_another_node_holds_it() {
        let mut s = store();
        let (a, b) = (open(&mut s, 1), open(&mut s, 2));
        assert_eq!(
            s.gcd_update(a, false, &[10, 11, 12], &[], 0).unwrap().taken,
            3
        );
        let o = s.gcd_update(b, false, &[11], &[], 0).unwrap();
        assert_eq!((o.taken, o.held), (1, 1));
        // Adding again changes nothing; additions come before removals.
        let o = s
            .gcd_update(a, false, &[10, 13], &[10, 11, 12, 99], 0)
            .unwrap();
        assert_eq!((o.taken, o.held), (2, 1));
        assert_eq!(o.elsewhere, [false, true, false, false]);
        assert_eq!(s.gcd_entries(), 2);
        // B gives 11 up: nobody else holds it now.
        assert_eq!(
            s.gcd_update(b, false, &[], &[11], 0).unwrap().elsewhere,
            [false]
        );
        assert_eq!(s.counters().gcd_duplicates, 1);
        assert_eq!(s.gcd_entries(), 1);
    }

    #[test]
    fn a_reset_or_the_last_session_ending_forgets_the_peers_entries() {
        let mut s = store();
        let (a, b) = (open(&mut s, 1), open(&mut s, 2));
        s.gcd_update(a, false, &[1, 2, 3], &[], 0).unwrap();
        s.gcd_update(b, false, &[3, 4], &[], 0).unwrap();
        let o = s.gcd_update(a, true, &[5], &[3], 0).unwrap();
        assert_eq!((o.taken, o.held, o.elsewhere.clone()), (1, 1, vec![true]));
        assert_eq!(s.gcd_entries(), 3);
        s.close(b).unwrap();
        assert_eq!(s.gcd_entries(), 1);
        // B's pages are no longer anyone's: A giving 5 up and asking about 3 finds nobody.
        assert_eq!(
            s.gcd_update(a, false, &[], &[5, 3], 0).unwrap().elsewhere,
            [false, false]
        );
        assert_eq!(s.gcd_entries(), 0);
        assert_eq!(s.counters().gcd_forgotten, 3 + 2);
    }

    /// A node that registers pages it does not hold (to make others drop theirs as
    /// duplicates) is bounded by its share: additions beyond it are refused, counted, and the
    /// reply says how many were taken.
    #[test]
    fn a_peer_registers_at_most_its_share() {
        let mut s = store();
        let liar = open(&mut s, 66);
        let mut at = 0u128;
        let mut taken = 0u64;
        loop {
            let batch: Vec<u128> = (at..at + 128).collect();
            let o = s.gcd_update(liar, false, &batch, &[], 0).unwrap();
            taken += u64::from(o.taken);
            at += 128;
            if (o.taken as usize) < batch.len() {
                assert_eq!(o.held, MAX_PER_PEER);
                break;
            }
        }
        assert_eq!(taken, u64::from(MAX_PER_PEER));
        assert_eq!(s.gcd_entries(), MAX_PER_PEER as usize);
        assert!(s.counters().gcd_adds_refused > 0);
        // Another node is not harmed by it: its pages are still taken.
        let honest = open(&mut s, 7);
        assert_eq!(
            s.gcd_update(honest, false, &[1 << 100], &[], 0)
                .unwrap()
                .taken,
            1
        );
    }
}
