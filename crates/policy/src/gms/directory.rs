//! Where a page is known (GMS §4.1, §4.4): the page-ownership directory (POD) names, for every
//! page, the node that keeps its entry in the global-cache directory (GCD); that node knows
//! which nodes hold the page.
//!
//! GMS's POD was a table a master node handed out on every join and leave. Here it is
//! rendezvous hashing over the live members ([`Pod`]): every node computes the same home for
//! a page from the member list membership gives it, a join or leave moves only the entries of
//! the pages whose home changed, and there is no master to lose. Two nodes with different
//! views for a while may disagree about a home; the cost is a miss (the page is read from its
//! source), never a wrong page, because the pages are clean and every one is checked against
//! its checksum when it arrives.

use super::frames::Kind;
use super::{NodeId, Uid};
use std::collections::HashMap;

/// A 64-bit mixer (splitmix64's finaliser): the scores must be the same on every node, so no
/// per-process random hasher.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn uid_hash(uid: Uid) -> u64 {
    mix((uid.0 as u64) ^ mix((uid.0 >> 64) as u64 ^ 0x9e37_79b9_7f4a_7c15))
}

/// The page-ownership directory: rendezvous (highest random weight) hashing over the members.
#[derive(Debug, Clone, Default)]
pub struct Pod {
    members: Vec<(NodeId, u64)>,
}

impl Pod {
    pub fn new(members: impl IntoIterator<Item = NodeId>) -> Self {
        let mut members: Vec<(NodeId, u64)> = members.into_iter().map(|n| (n, mix(n))).collect();
        members.sort_unstable();
        members.dedup();
        Self { members }
    }

    pub fn members(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.members.iter().map(|&(n, _)| n)
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The node that keeps `uid`'s directory entry; `None` with no members.
    pub fn home(&self, uid: Uid) -> Option<NodeId> {
        self.home_hashed(uid_hash(uid))
    }

    fn home_hashed(&self, h: u64) -> Option<NodeId> {
        self.members
            .iter()
            .max_by_key(|&&(n, nh)| (mix(h ^ nh), n))
            .map(|&(n, _)| n)
    }
}

/// Who holds a page, and as what.
pub type Holders = Vec<(NodeId, Kind)>;

/// One node's part of the global-cache directory: for the pages whose home it is, who holds
/// them and how.
#[derive(Debug, Default)]
pub struct Gcd {
    entries: HashMap<Uid, Holders, foldhash::fast::FixedState>,
}

impl Gcd {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn holders(&self, uid: &Uid) -> &[(NodeId, Kind)] {
        self.entries.get(uid).map_or(&[], Vec::as_slice)
    }

    /// `node` now holds `uid` as `kind` (replacing what it held it as).
    pub fn add(&mut self, uid: Uid, node: NodeId, kind: Kind) {
        let e = self.entries.entry(uid).or_default();
        match e.iter_mut().find(|(n, _)| *n == node) {
            Some(slot) => slot.1 = kind,
            None => e.push((node, kind)),
        }
    }

    /// `node` no longer holds `uid`.
    pub fn remove(&mut self, uid: &Uid, node: NodeId) {
        if let Some(e) = self.entries.get_mut(uid) {
            e.retain(|&(n, _)| n != node);
            if e.is_empty() {
                self.entries.remove(uid);
            }
        }
    }

    /// Forgets a node that left: its pages are gone with it (they were clean).
    pub fn forget_node(&mut self, node: NodeId) {
        self.entries.retain(|_, e| {
            e.retain(|&(n, _)| n != node);
            !e.is_empty()
        });
    }

    /// Takes out the entries whose home under `pod` is no longer `me`, to send to their new
    /// homes (a join moved them), sorted by page so that every run is the same.
    pub fn rehome(&mut self, pod: &Pod, me: NodeId) -> Vec<(NodeId, Uid, Holders)> {
        let moving: Vec<Uid> = self
            .entries
            .keys()
            .filter(|&&u| pod.home(u) != Some(me))
            .copied()
            .collect();
        let mut out: Vec<_> = moving
            .into_iter()
            .filter_map(|u| {
                let to = pod.home(u)?;
                self.entries.remove(&u).map(|h| (to, u, h))
            })
            .collect();
        out.sort_unstable_by_key(|&(_, u, _)| u);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_member_computes_the_same_home_and_a_join_moves_few() {
        let a = Pod::new([5, 1, 9, 3]);
        let b = Pod::new([9, 3, 1, 5, 5]);
        let uids: Vec<Uid> = (0..4000u128).map(|i| Uid(i * 7919 + (i << 70))).collect();
        for &u in &uids {
            assert_eq!(a.home(u), b.home(u));
        }
        // Spread: each of 4 members is home to about a quarter.
        for n in a.members() {
            let share = uids.iter().filter(|&&u| a.home(u) == Some(n)).count();
            assert!((800..1200).contains(&share), "member {n}: {share} of 4000");
        }
        // A fifth member takes about a fifth, and only pages that move to it move.
        let c = Pod::new([5, 1, 9, 3, 7]);
        let moved: Vec<&Uid> = uids.iter().filter(|&&u| a.home(u) != c.home(u)).collect();
        assert!((600..1000).contains(&moved.len()), "{} moved", moved.len());
        assert!(moved.iter().all(|&&u| c.home(u) == Some(7)));
        assert_eq!(Pod::new([]).home(Uid(1)), None);
    }

    #[test]
    fn the_gcd_tracks_holders_and_hands_over_on_a_join() {
        let mut g = Gcd::default();
        let pod = Pod::new([1]);
        for i in 0..100u128 {
            g.add(Uid(i), 1, Kind::Local);
            g.add(Uid(i), 2, Kind::Global);
        }
        g.add(Uid(0), 2, Kind::Local);
        assert_eq!(g.holders(&Uid(0)), &[(1, Kind::Local), (2, Kind::Local)]);
        g.remove(&Uid(1), 1);
        assert_eq!(g.holders(&Uid(1)), &[(2, Kind::Global)]);
        g.forget_node(2);
        assert!(g.holders(&Uid(1)).is_empty());
        assert_eq!(g.len(), 99);
        assert!(g.rehome(&pod, 1).is_empty());
        let bigger = Pod::new([1, 2]);
        let moved = g.rehome(&bigger, 1);
        assert!(!moved.is_empty() && moved.iter().all(|(to, _, _)| *to == 2));
        assert_eq!(g.len() + moved.len(), 99);
    }
}
