//! Which of this machine's pages the global-cache directory knows about (GMS, paper 000,
//! §4.4–4.5; issue 39), without I/O: [`Registry`] turns the pages that came into this
//! machine's memory and those that leave it into GCD_UPDATE messages to their homes, and
//! keeps its books from the answers.
//!
//! A page of a named source (`netram cache --source-name`) has the same uid on every machine
//! that mirrors it, so the directory can tell, when this machine lets a page go, whether
//! another machine still holds it in its own memory. Such a duplicate is dropped instead of
//! taking a frame of the cluster's idle memory (GMS §4.5), which is kept for pages nobody
//! else has.
//!
//! Homes come from membership by rendezvous hashing ([`Pod`]); when the members change, every
//! home is told to start over (`reset`) and given the pages it is now home of. A home whose
//! count of this machine's entries differs from this registry's (it restarted, or this
//! machine's session there ended and took the entries with it), or that could not be reached,
//! is started over at the next flush. The directory is advice: a wrong answer costs a read
//! from the source or a forwarded duplicate, never a wrong page.

use netram_policy::gms::directory::Pod;
use netram_policy::gms::Uid;
use netram_proto::MAX_BATCH;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

/// One GCD_UPDATE to send to `home`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    pub home: u64,
    pub reset: bool,
    pub add: Vec<Uid>,
    pub remove: Vec<Uid>,
}

/// What a home answered to an [`Update`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    pub taken: u32,
    pub held: u32,
}

/// This machine's registrations in the directory.
#[derive(Debug, Default)]
pub struct Registry {
    /// Each page registered, and where.
    at: HashMap<Uid, u64>,
    /// Pages registered per home, as this machine counts them.
    per_home: HashMap<u64, u32>,
    /// The members the homes were computed from.
    members: Vec<u64>,
    /// Homes to start over at.
    reset: BTreeSet<u64>,
    /// Homes started over because they disagreed or could not be reached.
    pub resyncs: u64,
    /// Additions a home refused (beyond this machine's share there).
    pub refused: u64,
}

impl Registry {
    /// Pages registered.
    pub fn len(&self) -> usize {
        self.at.len()
    }

    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    /// Whether a flush has work even with nothing new (homes to start over at).
    pub fn pending(&self) -> bool {
        !self.reset.is_empty()
    }

    /// The messages for one flush: `add` came into this machine's memory, `leaving` leave it
    /// (each gets an answer: whether another node holds it). Messages to one home are in
    /// order; different homes' may go in parallel.
    pub fn plan(&mut self, pod: &Pod, add: &[Uid], leaving: &[Uid]) -> Vec<Update> {
        let mut members: Vec<u64> = pod.members().collect();
        members.sort_unstable();
        if members != self.members {
            // Homes moved: every home starts over with what it is home of now.
            self.reset.extend(members.iter().copied());
            self.members = members;
        }
        let going: HashSet<Uid> = leaving.iter().copied().collect();
        let mut adds: BTreeMap<u64, Vec<Uid>> = BTreeMap::new();
        let mut removes: BTreeMap<u64, Vec<Uid>> = BTreeMap::new();
        // Pages homes starting over must be given again (those staying).
        if !self.reset.is_empty() {
            for (&u, _) in self.at.iter() {
                if going.contains(&u) {
                    continue;
                }
                if let Some(h) = pod.home(u).filter(|h| self.reset.contains(h)) {
                    adds.entry(h).or_default().push(u);
                }
            }
        }
        let mut seen = HashSet::new();
        for &u in add {
            if going.contains(&u) || !seen.insert(u) {
                continue;
            }
            let Some(h) = pod.home(u) else { continue };
            if self.reset.contains(&h) {
                if !self.at.contains_key(&u) {
                    adds.entry(h).or_default().push(u);
                }
            } else if self.at.get(&u) != Some(&h) {
                adds.entry(h).or_default().push(u);
            }
        }
        for &u in leaving {
            // Asked where it is registered, or else where it would be (the answer is what
            // matters: whether someone else holds it).
            let Some(h) = self.at.get(&u).copied().or_else(|| pod.home(u)) else {
                continue;
            };
            removes.entry(h).or_default().push(u);
        }
        let homes: BTreeSet<u64> = adds
            .keys()
            .chain(removes.keys())
            .copied()
            .chain(
                self.reset
                    .iter()
                    .copied()
                    .filter(|h| pod.members().any(|m| m == *h)),
            )
            .collect();
        let mut out = Vec::new();
        for h in homes {
            let a = adds.remove(&h).unwrap_or_default();
            let r = removes.remove(&h).unwrap_or_default();
            let reset = self.reset.contains(&h);
            let n = a
                .len()
                .div_ceil(MAX_BATCH)
                .max(r.len().div_ceil(MAX_BATCH))
                .max(1);
            for i in 0..n {
                let part = |v: &[Uid]| {
                    v.iter()
                        .skip(i * MAX_BATCH)
                        .take(MAX_BATCH)
                        .copied()
                        .collect()
                };
                out.push(Update {
                    home: h,
                    reset: reset && i == 0,
                    add: part(&a),
                    remove: part(&r),
                });
            }
        }
        // Homes no longer members are not asked again; their entries went with them.
        self.reset.clear();
        out
    }

    /// Books the answer to `u` (`None`: the home could not be asked, or answered something
    /// else).
    pub fn answered(&mut self, u: &Update, answer: Option<Answer>) {
        let h = u.home;
        if u.reset {
            self.at.retain(|_, home| *home != h);
            self.per_home.remove(&h);
        }
        for r in &u.remove {
            if self.at.get(r) == Some(&h) {
                self.at.remove(r);
                self.dec(h);
            }
        }
        let Some(a) = answer else {
            self.reset.insert(h);
            self.resyncs += 1;
            return;
        };
        let taken = (a.taken as usize).min(u.add.len());
        self.refused += (u.add.len() - taken) as u64;
        // Additions come first at the home; a page both added and removed in one message is
        // not registered, and this machine counts it the same way.
        let removed: HashSet<&Uid> = u.remove.iter().collect();
        for &p in &u.add[..taken] {
            if removed.contains(&p) {
                continue;
            }
            match self.at.insert(p, h) {
                Some(prev) if prev == h => {}
                Some(prev) => {
                    self.dec(prev);
                    *self.per_home.entry(h).or_default() += 1;
                }
                None => *self.per_home.entry(h).or_default() += 1,
            }
        }
        let mine = self.per_home.get(&h).copied().unwrap_or(0);
        if a.held != mine {
            tracing::debug!(
                home = h,
                held = a.held,
                mine,
                "directory entries lost: resync"
            );
            self.reset.insert(h);
            self.resyncs += 1;
        }
    }

    fn dec(&mut self, h: u64) {
        if let Some(n) = self.per_home.get_mut(&h) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_home.remove(&h);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A home as the daemon keeps it (`netram_store`'s directory, for one registrant).
    #[derive(Default)]
    struct Home(HashSet<Uid>);

    impl Home {
        fn take(&mut self, u: &Update) -> Answer {
            if u.reset {
                self.0.clear();
            }
            for a in &u.add {
                self.0.insert(*a);
            }
            for r in &u.remove {
                self.0.remove(r);
            }
            Answer {
                taken: u.add.len() as u32,
                held: self.0.len() as u32,
            }
        }
    }

    fn uids(r: std::ops::Range<u128>) -> Vec<Uid> {
        r.map(|i| Uid(i * 0x9e37_79b9_7f4a_7c15)).collect()
    }

    fn flush(
        reg: &mut Registry,
        homes: &mut HashMap<u64, Home>,
        pod: &Pod,
        add: &[Uid],
        leaving: &[Uid],
    ) -> Vec<Update> {
        let plan = reg.plan(pod, add, leaving);
        for u in &plan {
            let a = homes.get_mut(&u.home).map(|h| h.take(u));
            reg.answered(u, a);
        }
        plan
    }

    /// What the homes hold is what this machine holds, by the pod's homes.
    fn agree(reg: &Registry, homes: &HashMap<u64, Home>, pod: &Pod, want: &[Uid]) {
        let mut got: Vec<Uid> = homes.values().flat_map(|h| h.0.iter().copied()).collect();
        got.sort_unstable();
        let mut want = want.to_vec();
        want.sort_unstable();
        assert_eq!(got, want);
        for (id, h) in homes {
            assert!(h.0.iter().all(|&u| pod.home(u) == Some(*id)));
        }
        assert_eq!(reg.len(), want.len());
    }

    #[test]
    fn pages_are_registered_at_their_homes_and_leave_with_one_question_each() {
        let pod = Pod::new([1, 2, 3]);
        let mut homes: HashMap<u64, Home> = (1..=3).map(|i| (i, Home::default())).collect();
        let mut reg = Registry::default();
        let all = uids(0..400);
        // The first flush starts every home over (a new membership), then registers.
        let plan = flush(&mut reg, &mut homes, &pod, &all, &[]);
        assert!(plan.iter().all(|u| u.add.len() <= MAX_BATCH));
        assert_eq!(plan.iter().filter(|u| u.reset).count(), 3);
        agree(&reg, &homes, &pod, &all);
        // Nothing new: no message. Pages already registered: none either.
        assert!(reg.plan(&pod, &all[..10], &[]).is_empty());
        // 100 leave (one question each, at their home), 50 come.
        let more = uids(400..450);
        let plan = flush(&mut reg, &mut homes, &pod, &more, &all[..100]);
        let asked: usize = plan.iter().map(|u| u.remove.len()).sum();
        assert_eq!(asked, 100);
        assert!(plan.iter().all(|u| !u.reset));
        let held: Vec<Uid> = all[100..].iter().chain(&more).copied().collect();
        agree(&reg, &homes, &pod, &held);
        assert_eq!(reg.resyncs, 0);
        // A page that came and left before a flush is not registered.
        let brief = uids(1000..1001);
        flush(&mut reg, &mut homes, &pod, &brief, &brief);
        agree(&reg, &homes, &pod, &held);
    }

    #[test]
    fn a_home_that_lost_its_entries_or_a_new_member_gets_everything_again() {
        let pod = Pod::new([1, 2]);
        let mut homes: HashMap<u64, Home> = (1..=3).map(|i| (i, Home::default())).collect();
        let mut reg = Registry::default();
        let mut all = uids(0..300);
        flush(&mut reg, &mut homes, &pod, &all, &[]);
        // Home 2 restarts: its next answer disagrees, and the flush after starts it over.
        homes.insert(2, Home::default());
        let i = all.iter().position(|&u| pod.home(u) == Some(2)).unwrap();
        let gone = all.remove(i);
        flush(&mut reg, &mut homes, &pod, &[], &[gone]);
        assert_eq!(reg.resyncs, 1);
        assert!(reg.pending());
        let plan = flush(&mut reg, &mut homes, &pod, &[], &[]);
        assert!(plan.iter().any(|u| u.home == 2 && u.reset));
        agree(&reg, &homes, &pod, &all);
        // Member 3 joins: every home starts over, and 3 gets its share.
        let bigger = Pod::new([1, 2, 3]);
        flush(&mut reg, &mut homes, &bigger, &[], &[]);
        agree(&reg, &homes, &bigger, &all);
        assert!(!homes[&3].0.is_empty());
        // A home that cannot be asked is started over once it can.
        let down = homes.remove(&1).unwrap();
        let i = all.iter().position(|&u| bigger.home(u) == Some(1)).unwrap();
        let gone = all.remove(i);
        flush(&mut reg, &mut homes, &bigger, &[], &[gone]);
        homes.insert(1, down);
        flush(&mut reg, &mut homes, &bigger, &[], &[]);
        agree(&reg, &homes, &bigger, &all);
    }

    /// A home that takes only part of the additions (this machine's share there is used up):
    /// the rest are counted, not registered, and not asked again and again.
    #[test]
    fn additions_a_home_refuses_are_counted_once() {
        let pod = Pod::new([1]);
        let mut reg = Registry::default();
        let all = uids(0..10);
        for u in reg.plan(&pod, &all, &[]) {
            reg.answered(&u, Some(Answer { taken: 4, held: 4 }));
        }
        assert_eq!((reg.len(), reg.refused, reg.resyncs), (4, 6, 0));
        assert!(!reg.pending());
    }
}
