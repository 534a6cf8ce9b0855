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

/// Rendezvous hashing's members are split into this many fixed groups by their id's hash, so
/// that a look-up scores the groups and then one group's members: ~GROUPS + n/GROUPS scores
/// instead of n (10,000 members: ~220). Groups are scored in proportion to their size, so every
/// member is home to about 1/n of the pages; the price is that a join or leave, which changes
/// one group's size, also moves a few pages between that group's other members and the rest
/// (at most about as many again as flat rendezvous hashing moves).
const GROUPS: usize = 64;

/// The page-ownership directory: rendezvous (highest random weight) hashing over the members,
/// two levels deep (the skeleton form of HRW).
#[derive(Debug, Clone, Default)]
pub struct Pod {
    /// Per group, its members and their hashes, sorted.
    groups: Vec<Vec<(NodeId, u64)>>,
    len: usize,
}

impl Pod {
    pub fn new(members: impl IntoIterator<Item = NodeId>) -> Self {
        let mut groups = vec![Vec::new(); GROUPS];
        for n in members {
            let h = mix(n);
            groups[(h % GROUPS as u64) as usize].push((n, mix(h)));
        }
        let mut len = 0;
        for g in &mut groups {
            g.sort_unstable();
            g.dedup();
            len += g.len();
        }
        Self { groups, len }
    }

    pub fn members(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.groups.iter().flatten().map(|&(n, _)| n)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The node that keeps `uid`'s directory entry; `None` with no members.
    pub fn home(&self, uid: Uid) -> Option<NodeId> {
        let h = uid_hash(uid);
        // Weighted rendezvous over the groups (score = size / -ln u), so that each group gets
        // a share of the pages in proportion to its members. Two nodes whose libm rounds a
        // logarithm differently could disagree on a page's home: the cost is a miss.
        let score = |g: usize| {
            let u = ((mix(h ^ mix(g as u64 + 1)) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            self.groups[g].len() as f64 / -u.ln()
        };
        let group = (0..self.groups.len())
            .filter(|&g| !self.groups[g].is_empty())
            .max_by(|&a, &b| score(a).total_cmp(&score(b)).then(a.cmp(&b)))?;
        self.groups[group]
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

    /// Every entry (in no particular order).
    pub fn iter(&self) -> impl Iterator<Item = (&Uid, &Holders)> {
        self.entries.iter()
    }

    /// `node` now holds `uid` as `kind` (replacing what it held it as); `true` if it did not
    /// hold it before.
    pub fn add(&mut self, uid: Uid, node: NodeId, kind: Kind) -> bool {
        let e = self.entries.entry(uid).or_default();
        match e.iter_mut().find(|(n, _)| *n == node) {
            Some(slot) => {
                slot.1 = kind;
                false
            }
            None => {
                e.push((node, kind));
                true
            }
        }
    }

    /// `node` no longer holds `uid`; `true` if it held it.
    pub fn remove(&mut self, uid: &Uid, node: NodeId) -> bool {
        let Some(e) = self.entries.get_mut(uid) else {
            return false;
        };
        let before = e.len();
        e.retain(|&(n, _)| n != node);
        let held = e.len() < before;
        if e.is_empty() {
            self.entries.remove(uid);
        }
        held
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

#[cfg(test)]
mod scale_tests {
    use super::*;

    #[test]
    fn ten_thousand_members_share_the_pages_evenly_and_a_join_moves_about_one_nth() {
        let members: Vec<NodeId> = (0..10_000u64).map(|i| i * 31 + 7).collect();
        let pod = Pod::new(members.iter().copied());
        let uids: Vec<Uid> = (0..200_000u128)
            .map(|i| Uid(i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c)))
            .collect();
        let mut per: HashMap<NodeId, u32> = HashMap::new();
        for &u in &uids {
            *per.entry(pod.home(u).unwrap()).or_default() += 1;
        }
        // 20 pages a member on average; by group, the share is within a few percent.
        assert!(per.len() > 9_900, "{} members hold pages", per.len());
        let joined = Pod::new(members.iter().copied().chain([1]));
        let moved = uids
            .iter()
            .filter(|&&u| pod.home(u) != joined.home(u))
            .count();
        let to_new = uids.iter().filter(|&&u| joined.home(u) == Some(1)).count();
        assert!(
            to_new > 0 && moved <= 3 * to_new + 20,
            "moved {moved}, to the new member {to_new}"
        );
    }
}
