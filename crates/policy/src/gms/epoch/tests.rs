//! The initiator's computation, the eviction rule and a small cluster of [`Epochs`] passing
//! messages among themselves: epochs end on time, on M, on a stale report; a dead initiator is
//! replaced; a plan that lies about its sums or its sender is refused.

use super::*;
use crate::gms::age::{bucket, Histogram};
use proptest::prelude::*;
use std::collections::BTreeMap;

fn summary(node: NodeId, free: u32, ages: &[(u64, u32)]) -> Summary {
    let mut h = Histogram::default();
    for &(age, n) in ages {
        for _ in 0..n {
            h.add(age);
        }
    }
    Summary {
        node,
        free,
        evicted: 0,
        discarded: 0,
        ages: h,
    }
}

fn params() -> Params {
    Params {
        duration_ms: 1_000,
        m_min: 10,
        m_max: 10_000,
        active_age_ms: 100,
        max_weights: 16,
        gather_timeout_ms: 50,
        takeover_ms: 200,
    }
}

#[test]
fn free_frames_then_the_oldest_pages_take_the_weight() {
    // Node 1 busy (young pages), node 2 idle (old pages), node 3 has free frames.
    let s = [
        summary(1, 0, &[(10, 500)]),
        summary(2, 0, &[(60_000, 300), (5_000, 100)]),
        summary(3, 50, &[(20, 10)]),
    ];
    let p = Plan::compute(1, 1, &s, 200, 200, &params());
    assert_eq!(p.m, 200);
    assert_eq!(p.weights, vec![(2, 150), (3, 50)]);
    assert_eq!(p.next_initiator(), 2);
    assert!(
        p.min_age_ms > 5_000 && p.min_age_ms <= 60_000,
        "{}",
        p.min_age_ms
    );

    // Fewer discards expected than evictions: the weights are the same, MinAge is the age of
    // the 100th oldest (after 50 free frames, a page of a minute); 50: a free frame, so
    // nothing is old enough; none expected: the same.
    let d = Plan::compute(1, 1, &s, 200, 100, &params());
    assert_eq!(d.weights, p.weights);
    assert_eq!(d.min_age_ms, bucket_floor_ms(bucket(60_000)));
    let free = Plan::compute(1, 1, &s, 200, 50, &params());
    assert_eq!(free.min_age_ms, u64::MAX);
    let none = Plan::compute(1, 1, &s, 200, 0, &params());
    assert_eq!(none.min_age_ms, u64::MAX);

    // Only free frames needed: nothing cached is among the M oldest.
    let p = Plan::compute(1, 1, &s, 40, 40, &params());
    assert_eq!(p.weights, vec![(3, 40)]);
    assert_eq!(p.min_age_ms, u64::MAX);

    // More wanted than is old: M is what there is; the busy node's pages never count.
    let p = Plan::compute(1, 1, &s, 5_000, 5_000, &params());
    assert_eq!(p.m, 450);
    assert_eq!(p.weight(1), 0);
    assert_eq!(p.weight(3), 50);
}

#[test]
fn a_cluster_without_old_pages_drops_everything() {
    let s = [summary(1, 0, &[(10, 500)]), summary(2, 0, &[(50, 500)])];
    let p = Plan::compute(1, 1, &s, 100, 100, &params());
    assert_eq!((p.m, p.min_age_ms), (0, 0));
    assert!(p.weights.is_empty());
    let mut rng = fastrand::Rng::with_seed(1);
    assert_eq!(
        p.evict(1, 5, false, &mut rng),
        Evict::Drop(DropReason::NoIdleMemory)
    );
}

#[test]
fn the_eviction_rule_drops_old_and_duplicate_pages_and_spreads_the_rest_by_weight() {
    let s = [
        summary(1, 0, &[(10, 500)]),
        summary(2, 300, &[]),
        summary(3, 100, &[]),
        summary(4, 0, &[(1_000_000, 100)]),
    ];
    let p = Plan::compute(1, 1, &s, 450, 450, &params());
    assert_eq!(p.weights, vec![(2, 300), (3, 100), (4, 50)]);
    let mut rng = fastrand::Rng::with_seed(7);
    assert_eq!(
        p.evict(1, 10, true, &mut rng),
        Evict::Drop(DropReason::Duplicate)
    );
    assert_eq!(
        p.evict(1, p.min_age_ms, false, &mut rng),
        Evict::Drop(DropReason::Old)
    );
    let mut got: BTreeMap<NodeId, u32> = BTreeMap::new();
    for _ in 0..9_000 {
        match p.evict(1, 10, false, &mut rng) {
            Evict::Forward(n) => *got.entry(n).or_default() += 1,
            other => panic!("{other:?}"),
        }
    }
    // 2/3, 2/9, 1/9 of 9,000, within a few percent.
    assert!((5_700..6_300).contains(&got[&2]), "{got:?}");
    assert!((1_800..2_200).contains(&got[&3]), "{got:?}");
    assert!((850..1_150).contains(&got[&4]), "{got:?}");
    // A node with weight never forwards to itself.
    for _ in 0..1_000 {
        assert_ne!(p.evict(2, 10, false, &mut rng), Evict::Forward(2));
    }
    let alone = Plan::compute(1, 2, &[summary(2, 10, &[])], 10, 10, &params());
    assert_eq!(
        alone.evict(2, 10, false, &mut rng),
        Evict::Drop(DropReason::NoOtherNode)
    );
}

#[test]
fn a_plan_carries_at_most_max_weights() {
    let s: Vec<Summary> = (0..100).map(|n| summary(n, 10 + n as u32, &[])).collect();
    let p = Plan::compute(1, 0, &s, 100_000, 100_000, &params());
    assert_eq!(p.weights.len(), 16);
    assert_eq!(p.weights[0], (99, 109));
    assert_eq!(p.m, p.weights.iter().map(|w| w.1).sum::<u32>());
    assert_eq!(p.check(0, &params()), Ok(()));
}

#[test]
fn plans_that_lie_are_refused() {
    let good = Plan::compute(1, 1, &[summary(2, 100, &[])], 50, 50, &params());
    assert_eq!(good.check(1, &params()), Ok(()));
    assert_eq!(good.check(2, &params()), Err(PlanError::NotFromInitiator));
    let mut p = good.clone();
    p.m += 1;
    assert_eq!(p.check(1, &params()), Err(PlanError::WeightsSum));
    let mut p = good.clone();
    p.weights.push((2, 1));
    p.m += 1;
    assert_eq!(p.check(1, &params()), Err(PlanError::BadWeights));
    let mut p = good.clone();
    p.weights = vec![(2, 20_000)];
    p.m = 20_000;
    assert_eq!(p.check(1, &params()), Err(PlanError::TooLarge));
}

fn arb_summaries() -> impl Strategy<Value = Vec<Summary>> {
    proptest::collection::vec(
        (
            0u32..200,
            proptest::collection::vec((0u64..10_000_000, 1u32..50), 0..6),
        ),
        1..12,
    )
    .prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (free, ages))| summary(i as NodeId, free, &ages))
            .collect()
    })
}

proptest! {
    #[test]
    fn weights_are_the_m_oldest(s in arb_summaries(), m in 1u32..2_000) {
        let mut params = params();
        params.max_weights = 64;
        let p = Plan::compute(3, 0, &s, m, m, &params);
        prop_assert_eq!(p.check(0, &params), Ok(()));
        // M is what was wanted, or every old page there is.
        let first_old = (0..BUCKETS).find(|&b| bucket_floor_ms(b) >= params.active_age_ms).unwrap();
        let old = |x: &Summary| u64::from(x.free)
            + (first_old..BUCKETS).map(|b| u64::from(x.ages.count(b))).sum::<u64>();
        let total_old: u64 = s.iter().map(old).sum();
        prop_assert_eq!(u64::from(p.m), u64::from(m).min(total_old));
        for x in &s {
            let w = u64::from(p.weight(x.node));
            prop_assert!(w <= old(x), "node {} weight {} of {} old", x.node, w, old(x));
            // Every page at least MinAge... more than MinAge's bucket is wholly counted.
            if p.min_age_ms != 0 && p.min_age_ms != u64::MAX {
                let above: u64 = u64::from(x.free)
                    + (bucket(p.min_age_ms) + 1..BUCKETS).map(|b| u64::from(x.ages.count(b))).sum::<u64>();
                prop_assert!(w >= above, "node {}: weight {} < {} older than MinAge", x.node, w, above);
            }
        }
        for pair in p.weights.windows(2) {
            prop_assert!(pair[0].1 > pair[1].1 || (pair[0].1 == pair[1].1 && pair[0].0 < pair[1].0));
        }
    }
}

/// A cluster of `Epochs` on one thread: messages delivered at the next step unless the
/// receiver is down.
struct Cluster {
    nodes: BTreeMap<NodeId, Epochs>,
    down: Vec<NodeId>,
    /// Listed by membership but neither ticking nor answering.
    hung: Vec<NodeId>,
    now_ms: u64,
    queue: Vec<(NodeId, Out)>,
    free: BTreeMap<NodeId, u32>,
}

impl Cluster {
    fn new(n: u64) -> Self {
        // M at least 1,000, so that the weights follow the free frames closely.
        let params = Params {
            m_min: 1_000,
            ..params()
        };
        let nodes = (1..=n)
            .map(|i| (i, Epochs::new(i, params.clone(), 0)))
            .collect();
        // Node i has 100·i free frames: node n is always the largest.
        let free = (1..=n).map(|i| (i, 100 * i as u32)).collect();
        Self {
            nodes,
            down: Vec::new(),
            hung: Vec::new(),
            now_ms: 0,
            queue: Vec::new(),
            free,
        }
    }

    fn live(&self) -> Vec<NodeId> {
        self.nodes
            .keys()
            .copied()
            .filter(|n| !self.down.contains(n))
            .collect()
    }

    fn step(&mut self, ms: u64) {
        self.now_ms += ms;
        let live = self.live();
        let mut out = Vec::new();
        for (from, msg) in std::mem::take(&mut self.queue) {
            let to = match &msg {
                Out::RequestSummary { to, .. }
                | Out::Summary { to, .. }
                | Out::Plan { to, .. }
                | Out::Stale { to, .. } => *to,
            };
            if self.down.contains(&to) || self.hung.contains(&to) {
                continue;
            }
            let free = self.free[&to];
            let now = self.now_ms;
            let node = self.nodes.get_mut(&to).unwrap();
            let mut o = Vec::new();
            match msg {
                Out::RequestSummary { epoch, .. } => {
                    node.on_request(from, epoch, |ev, d| summary_of(to, free, ev, d), &mut o)
                }
                Out::Summary { epoch, summary, .. } => node.on_summary(from, epoch, *summary),
                Out::Plan { plan, .. } => {
                    node.on_plan(from, plan, now).unwrap();
                }
                Out::Stale { epoch, .. } => node.on_stale(epoch),
            }
            out.extend(o.into_iter().map(|m| (to, m)));
        }
        for &n in live.iter().filter(|n| !self.hung.contains(n)) {
            let free = self.free[&n];
            let mut o = Vec::new();
            let now = self.now_ms;
            self.nodes.get_mut(&n).unwrap().on_tick(
                now,
                &live,
                |ev, d| summary_of(n, free, ev, d),
                &mut o,
            );
            out.extend(o.into_iter().map(|m| (n, m)));
        }
        self.queue = out;
    }

    fn epochs(&self) -> Vec<(NodeId, u64, NodeId)> {
        self.live()
            .iter()
            .map(|n| {
                let p = self.nodes[n].plan();
                (*n, p.epoch, p.initiator)
            })
            .collect()
    }

    fn agreed(&self) -> Option<(u64, NodeId)> {
        let e = self.epochs();
        let first = (e[0].1, e[0].2);
        e.iter().all(|x| (x.1, x.2) == first).then_some(first)
    }
}

fn summary_of(node: NodeId, free: u32, evicted: u32, discarded: u32) -> Summary {
    Summary {
        node,
        free,
        evicted,
        discarded,
        ages: Histogram::default(),
    }
}

#[test]
fn epochs_start_on_time_and_the_largest_weight_initiates_the_next() {
    let mut c = Cluster::new(5);
    // Node 1 (the lowest id, no plan yet) starts at once.
    for _ in 0..5 {
        c.step(10);
    }
    assert_eq!(c.agreed(), Some((1, 1)), "{:?}", c.epochs());
    // Node 5 has the most free frames: it is named and starts epoch 2 after T.
    assert_eq!(c.nodes[&1].plan().next_initiator(), 5);
    for _ in 0..110 {
        c.step(10);
    }
    assert_eq!(c.agreed(), Some((2, 5)), "{:?}", c.epochs());
    assert_eq!(c.nodes[&5].stats.takeovers, 0);
}

#[test]
fn a_dead_initiator_is_replaced_by_the_next_in_line() {
    let mut c = Cluster::new(5);
    for _ in 0..5 {
        c.step(10);
    }
    assert_eq!(c.agreed(), Some((1, 1)));
    // Node 5, named next, dies: membership no longer lists it, so node 4 (next largest
    // weight) is first in line.
    c.down.push(5);
    for _ in 0..110 {
        c.step(10);
    }
    assert_eq!(c.agreed(), Some((2, 4)), "{:?}", c.epochs());
    assert_eq!(c.nodes[&4].stats.takeovers, 1);

    // Node 4, named again, hangs while membership still lists it: node 3, next in line,
    // starts the epoch a takeover period after its end.
    c.hung.push(4);
    let end = c.nodes[&3].started_ms() + 1_000;
    for _ in 0..150 {
        c.step(10);
        if c.nodes[&3].plan().epoch == 3 {
            break;
        }
    }
    assert!(c.now_ms >= end + 200, "{} < {}", c.now_ms, end + 200);
    c.step(10); // the plan reaches the others
    let e = c.epochs();
    assert!(
        e.iter().filter(|x| x.0 != 4).all(|x| x.1 == 3 && x.2 == 3),
        "{e:?}"
    );
    assert_eq!(c.nodes[&3].stats.takeovers, 1);
}

#[test]
fn an_epoch_ends_early_when_its_weight_is_used_up_or_its_plan_is_stale() {
    let mut c = Cluster::new(3);
    for _ in 0..5 {
        c.step(10);
    }
    assert_eq!(c.agreed(), Some((1, 1)));
    let w = c.nodes[&3].plan().weight(3);
    assert!(w > 0);
    for _ in 0..w {
        c.nodes.get_mut(&3).unwrap().on_received();
    }
    // Start, requests, summaries, plans: four steps.
    for _ in 0..4 {
        c.step(10);
    }
    assert_eq!(c.agreed(), Some((2, 3)), "{:?}", c.epochs());
    assert_eq!(c.nodes[&3].stats.epochs_started_early, 1);

    // Node 1 finds the plan wrong and tells node 3 (named next again).
    let mut out = Vec::new();
    c.nodes.get_mut(&1).unwrap().report_stale(&mut out);
    assert_eq!(out, vec![Out::Stale { to: 3, epoch: 2 }]);
    c.queue.extend(out.into_iter().map(|m| (1, m)));
    for _ in 0..4 {
        c.step(10);
    }
    assert_eq!(c.agreed(), Some((3, 3)), "{:?}", c.epochs());
    assert_eq!(c.nodes[&3].stats.epochs_started_early, 2);
}

#[test]
fn forged_summaries_and_replayed_requests_are_ignored() {
    let mut e = Epochs::new(1, params(), 0);
    let mut out = Vec::new();
    e.on_tick(1_000, &[1, 2, 3], |ev, d| summary_of(1, 5, ev, d), &mut out);
    assert_eq!(out.len(), 2);
    // Node 3 sends a summary claiming to be node 2; then node 2 its own twice.
    e.on_summary(3, 1, summary_of(2, 1_000, 0, 0));
    e.on_summary(2, 1, summary_of(2, 7, 0, 0));
    e.on_summary(2, 1, summary_of(2, 7, 0, 0));
    assert_eq!(e.stats.summaries_refused, 2);
    out.clear();
    e.on_tick(1_100, &[1, 2, 3], |ev, d| summary_of(1, 5, ev, d), &mut out);
    assert_eq!(e.plan().epoch, 1);
    // M is m_min (10: no evictions seen yet), shared 7:5 with the largest remainder to node 2.
    assert_eq!(e.plan().weights, vec![(2, 6), (1, 4)]);
    assert_eq!(e.stats.summaries_missing, 1);
    // A request for an epoch already planned is not answered.
    out.clear();
    e.on_request(2, 1, |ev, d| summary_of(1, 5, ev, d), &mut out);
    assert!(out.is_empty());
    // A plan from someone else claiming to be epoch 2 by node 2 but sent by 3: refused.
    let forged = Plan::compute(2, 2, &[summary_of(3, 50, 0, 0)], 50, 50, &params());
    assert_eq!(
        e.on_plan(3, forged, 1_200),
        Err(PlanError::NotFromInitiator)
    );
    assert_eq!(e.plan().epoch, 1);
}

proptest! {
    /// Whatever another node sends, a node neither panics nor adopts a plan that does not
    /// check out, and its eviction rule only ever names a node the plan weighs.
    #[test]
    fn hostile_plans_and_summaries_are_refused_or_harmless(
        msgs in proptest::collection::vec(
            (0u64..6, 0u64..5, 0u32..3_000, any::<u64>(),
             proptest::collection::vec((0u64..6, 0u32..2_000), 0..40)),
            1..30),
        ages in proptest::collection::vec(0u64..100_000, 1..20),
    ) {
        let mut e = Epochs::new(1, params(), 0);
        let mut out = Vec::new();
        e.on_tick(10, &[1, 2, 3, 4, 5], |ev, d| summary_of(1, 3, ev, d), &mut out);
        let mut rng = fastrand::Rng::with_seed(9);
        for (i, (from, epoch, m, min_age, weights)) in msgs.into_iter().enumerate() {
            let plan = Plan {
                epoch,
                initiator: from,
                m,
                min_age_ms: min_age,
                weights: weights.clone(),
                duration_ms: 1_000,
            };
            e.on_summary(from, epoch, summary_of(from, m, 0, 0));
            let valid = plan.check(from, e.params()).is_ok();
            if let Ok(true) = e.on_plan(from, plan, 100 + i as u64) {
                prop_assert!(valid);
            }
            prop_assert!(e.plan().check(e.plan().initiator, e.params()).is_ok());
            for &a in &ages {
                if let Evict::Forward(n) = e.plan().evict(1, a, false, &mut rng) {
                    prop_assert!(n != 1 && e.plan().weight(n) > 0);
                }
            }
            out.clear();
            e.on_tick(200 + i as u64 * 300, &[1, 2, 3, 4, 5], |ev, d| summary_of(1, 3, ev, d), &mut out);
        }
    }
}
