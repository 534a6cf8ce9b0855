//! Epochs (GMS §3.2): the initiator's computation of weights and MinAge, the eviction rule a
//! node applies during an epoch, and [`Epochs`], a node's part in starting, ending and taking
//! over epochs.
//!
//! An epoch lasts at most T (`Params::duration_ms`) and M replacements. At its start the
//! initiator asks every member for a [`Summary`]; from them it finds the cluster's M oldest
//! pages (free frames count as the oldest of all) and gives each node its weight wᵢ, how many of
//! those it holds, and MinAge, the youngest age among them. It sends the [`Plan`] to every
//! member and names the next initiator: the node with the largest weight, which will receive
//! the most pages and so is the first to see the epoch used up. An epoch also ends early when a
//! node finds the plan wrong (it was sent a page but had nothing as old to give up:
//! [`Epochs::report_stale`]).
//!
//! A failed initiator is replaced by the same rule: the plan's weights, in order, are the line
//! of succession, followed by the other members by id; the first live one starts the next epoch
//! when the epoch's time is up, the next one a little later if still nothing has happened
//! (`Params::takeover_ms`), and so on.
//!
//! What a lying node can do: a summary claiming old pages draws pages to itself (harming only
//! its own memory, and bounded by what it offers); a plan can only send pages to nodes, and
//! every node decides by its own ages whether to take one ([`super::frames::Frames::accept_global`]):
//! it never gives up a page younger than the one it is sent. A plan is checked before it is
//! used ([`Plan::check`]): its weights add up to its M, M is within the limit, no node twice.

use super::age::{bucket_floor_ms, Summary, BUCKETS};
use super::NodeId;
use std::collections::{BTreeMap, BTreeSet};

/// The epoch algorithm's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    /// T: the longest an epoch lasts (GMS: 5–10 s).
    pub duration_ms: u64,
    /// M's bounds: the fewest and most replacements an epoch plans for.
    pub m_min: u32,
    pub m_max: u32,
    /// Pages used more recently than this are in use, never counted among the old ones: when
    /// the cluster has no older pages or free frames, MinAge is 0 and evicted pages are dropped.
    pub active_age_ms: u64,
    /// The most weights a plan carries (the largest ones). Every node receives the plan, so
    /// this bounds the plan's traffic at n·max_weights instead of GMS's n² (Table 5's
    /// "distribute weights" row). 32 by default, measured in the simulator at 10,000 nodes
    /// (`bench-results/gms.md`): against 256, 7× fewer bytes out of the initiator per epoch
    /// and 27 % less traffic in all, for a speed-up of 2.28 instead of 2.37; epochs end sooner
    /// (the 32 heaviest nodes hold fewer of the M oldest pages), so there are 2.5× as many.
    pub max_weights: usize,
    /// How long an initiator waits for the summaries before it plans without the missing ones.
    pub gather_timeout_ms: u64,
    /// How long each successor in line waits after the one before it before it starts an epoch
    /// nobody started.
    pub takeover_ms: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            duration_ms: 5_000,
            m_min: 64,
            m_max: 1 << 20,
            active_age_ms: 1_000,
            max_weights: 32,
            gather_timeout_ms: 500,
            takeover_ms: 1_000,
        }
    }
}

/// An epoch's plan, as the initiator sends it to every member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub epoch: u64,
    pub initiator: NodeId,
    /// M: the replacements planned for, the sum of the weights.
    pub m: u32,
    /// An evicted page at least this old (effective age) is dropped. 0: the cluster has no idle
    /// memory, drop everything; `u64::MAX`: the M oldest are all free frames, keep everything.
    pub min_age_ms: u64,
    /// (node, wᵢ), largest first (ties by id): the first is the next initiator, the rest its
    /// successors in order.
    pub weights: Vec<(NodeId, u32)>,
    /// T for this epoch.
    pub duration_ms: u64,
}

/// Why a plan was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("the plan's weights do not add up to its M")]
    WeightsSum,
    #[error("the plan's M or number of weights is over this node's limit")]
    TooLarge,
    #[error("the plan names a node twice or gives one a weight of 0")]
    BadWeights,
    #[error("the plan does not come from the node it names as initiator")]
    NotFromInitiator,
}

/// What happens to a page a node evicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evict {
    Drop(DropReason),
    /// Send it to this node, where it becomes a global page.
    Forward(NodeId),
}

/// Why an evicted page was dropped rather than forwarded; one counter each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Another node holds the same page in its local memory (a shared page, §4.5).
    Duplicate,
    /// The cluster has no idle memory this epoch (MinAge 0), or no plan yet.
    NoIdleMemory,
    /// The page is among the cluster's M oldest: it would be the next to go anyway.
    Old,
    /// Only this node has weight.
    NoOtherNode,
}

impl Plan {
    /// The plan a cluster with no idle memory has: drop everything.
    pub fn empty(epoch: u64, initiator: NodeId, duration_ms: u64) -> Self {
        Self {
            epoch,
            initiator,
            m: 0,
            min_age_ms: 0,
            weights: Vec::new(),
            duration_ms,
        }
    }

    /// The initiator's computation (§3.2): the M oldest pages of the cluster from the
    /// summaries, each node's weight, MinAge, the next initiator. `m_wanted` is the number of
    /// pages expected to be evicted this epoch (forwarded or dropped): M is that, or the
    /// number of old pages if fewer, and the epoch ends when the next initiator has been sent
    /// its share. `d_wanted` is the number expected to leave the cluster (discarded): MinAge
    /// is the age of the D-th oldest page.
    ///
    /// Why two numbers where the paper names one: here a fetch from another node's memory
    /// moves the page (§4.5), so in a steady state most forwarded pages land in frames that
    /// fetches emptied and replace nothing. Sizing MinAge by every eviction would make it
    /// reach down into pages in use and drop them; sizing M by discards alone would end every
    /// epoch after a handful of forwards.
    pub fn compute(
        epoch: u64,
        initiator: NodeId,
        summaries: &[Summary],
        m_wanted: u32,
        d_wanted: u32,
        params: &Params,
    ) -> Self {
        let mut plan = Self::empty(epoch, initiator, params.duration_ms);
        // Only buckets wholly past the active age count as old.
        let first_old = (0..BUCKETS)
            .find(|&b| bucket_floor_ms(b) >= params.active_age_ms)
            .unwrap_or(BUCKETS);
        // Oldest first: the free frames (index BUCKETS), then the buckets from the oldest.
        let count = |s: &Summary, b: usize| -> u64 {
            if b == BUCKETS {
                u64::from(s.free)
            } else {
                u64::from(s.ages.count(b))
            }
        };
        let order = std::iter::once(BUCKETS).chain((first_old..BUCKETS).rev());
        let total_old: u64 = order
            .clone()
            .map(|b| summaries.iter().map(|s| count(s, b)).sum::<u64>())
            .sum();
        let m = u64::from(m_wanted).min(total_old);
        if m == 0 {
            return plan;
        }
        // Walk from the oldest until M pages are covered; the bucket where that happens is
        // shared out pro rata (largest remainders), everything older is wholly counted.
        let mut weights: BTreeMap<NodeId, u64> = BTreeMap::new();
        let mut covered = 0u64;
        for b in order {
            let in_bucket: u64 = summaries.iter().map(|s| count(s, b)).sum();
            if in_bucket == 0 {
                continue;
            }
            if covered + in_bucket <= m {
                for s in summaries {
                    let c = count(s, b);
                    if c > 0 {
                        *weights.entry(s.node).or_default() += c;
                    }
                }
                covered += in_bucket;
                if covered == m {
                    plan.min_age_ms = if b == BUCKETS {
                        u64::MAX
                    } else {
                        bucket_floor_ms(b)
                    };
                    break;
                }
                continue;
            }
            let want = m - covered;
            let mut shares: Vec<(u64, NodeId, u64)> = summaries
                .iter()
                .filter(|s| count(s, b) > 0)
                .map(|s| {
                    let exact = u128::from(count(s, b)) * u128::from(want);
                    let whole = (exact / u128::from(in_bucket)) as u64;
                    let rest = (exact % u128::from(in_bucket)) as u64;
                    (rest, s.node, whole)
                })
                .collect();
            let given: u64 = shares.iter().map(|&(_, _, w)| w).sum();
            // Largest remainder first, ties by id, each one more page until `want` is met.
            shares.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut left = want - given;
            for (_, node, whole) in &mut shares {
                if left > 0 {
                    *whole += 1;
                    left -= 1;
                }
                if *whole > 0 {
                    *weights.entry(*node).or_default() += *whole;
                }
            }
            covered = m;
            plan.min_age_ms = if b == BUCKETS {
                u64::MAX
            } else {
                bucket_floor_ms(b)
            };
            break;
        }
        debug_assert_eq!(covered, m);
        // MinAge: the youngest bucket reached once D of the oldest are counted.
        let d = u64::from(d_wanted).min(m);
        plan.min_age_ms = u64::MAX;
        if d > 0 {
            let mut seen = 0u64;
            for b in std::iter::once(BUCKETS).chain((first_old..BUCKETS).rev()) {
                seen += summaries.iter().map(|s| count(s, b)).sum::<u64>();
                if seen >= d {
                    if b != BUCKETS {
                        plan.min_age_ms = bucket_floor_ms(b);
                    }
                    break;
                }
            }
        }
        let mut list: Vec<(NodeId, u32)> = weights
            .into_iter()
            .map(|(n, w)| (n, u32::try_from(w).unwrap_or(u32::MAX)))
            .collect();
        list.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        list.truncate(params.max_weights.max(1));
        plan.m = list.iter().fold(0u32, |acc, &(_, w)| acc.saturating_add(w));
        plan.weights = list;
        plan
    }

    /// The next initiator: the node with the largest weight, or this plan's initiator when
    /// nobody has any.
    pub fn next_initiator(&self) -> NodeId {
        self.weights.first().map_or(self.initiator, |&(n, _)| n)
    }

    /// This node's weight.
    pub fn weight(&self, node: NodeId) -> u32 {
        self.weights
            .iter()
            .find(|&&(n, _)| n == node)
            .map_or(0, |&(_, w)| w)
    }

    /// Checks a plan received from `from` before it is used.
    pub fn check(&self, from: NodeId, params: &Params) -> Result<(), PlanError> {
        if self.initiator != from {
            return Err(PlanError::NotFromInitiator);
        }
        if self.m > params.m_max || self.weights.len() > params.max_weights.max(1) {
            return Err(PlanError::TooLarge);
        }
        let mut seen = BTreeSet::new();
        let mut sum = 0u64;
        for &(n, w) in &self.weights {
            if w == 0 || !seen.insert(n) {
                return Err(PlanError::BadWeights);
            }
            sum += u64::from(w);
        }
        if sum != u64::from(self.m) {
            return Err(PlanError::WeightsSum);
        }
        Ok(())
    }

    /// The rule for a page `me` evicts (§3.2): a duplicate is dropped, so is a page at least
    /// MinAge old; any other goes to node i with probability wᵢ/M (`me` left out).
    pub fn evict(
        &self,
        me: NodeId,
        effective_age_ms: u64,
        duplicate: bool,
        rng: &mut fastrand::Rng,
    ) -> Evict {
        if duplicate {
            return Evict::Drop(DropReason::Duplicate);
        }
        if self.m == 0 || self.min_age_ms == 0 {
            return Evict::Drop(DropReason::NoIdleMemory);
        }
        if effective_age_ms >= self.min_age_ms {
            return Evict::Drop(DropReason::Old);
        }
        let total: u64 = self
            .weights
            .iter()
            .filter(|&&(n, _)| n != me)
            .map(|&(_, w)| u64::from(w))
            .sum();
        if total == 0 {
            return Evict::Drop(DropReason::NoOtherNode);
        }
        let mut x = rng.u64(0..total);
        for &(n, w) in &self.weights {
            if n == me {
                continue;
            }
            if x < u64::from(w) {
                return Evict::Forward(n);
            }
            x -= u64::from(w);
        }
        unreachable!("the draw is below the total weight")
    }

    /// Where `me` stands in the line of succession: the plan's weighted nodes in order, then
    /// the other members by id, counting only live `members` (sorted by id). `None` if `me`
    /// is not among them.
    fn place_in_line(&self, me: NodeId, members: &[NodeId]) -> Option<u64> {
        let live = |n: NodeId| members.binary_search(&n).is_ok();
        members.binary_search(&me).ok()?;
        let mut named_live = 0u64;
        let mut named_below = 0u64;
        for &(n, _) in &self.weights {
            if n == me {
                return Some(named_live);
            }
            if live(n) {
                named_live += 1;
                if n < me {
                    named_below += 1;
                }
            }
        }
        let below = members.partition_point(|&n| n < me) as u64;
        Some(named_live + below - named_below)
    }
}

/// Messages an [`Epochs`] asks its runtime to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Out {
    /// Ask `to` for its summary for `epoch`.
    RequestSummary { to: NodeId, epoch: u64 },
    /// Answer an initiator.
    Summary {
        to: NodeId,
        epoch: u64,
        summary: Box<Summary>,
    },
    /// Give `to` the new plan.
    Plan { to: NodeId, plan: Plan },
    /// Tell the next initiator this epoch's plan has proved wrong.
    Stale { to: NodeId, epoch: u64 },
}

/// Counters of one node's epoch work; the runtime exports them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EpochStats {
    pub epochs_started: u64,
    pub epochs_started_early: u64,
    pub takeovers: u64,
    pub plans_adopted: u64,
    pub plans_refused: u64,
    pub summaries_sent: u64,
    pub summaries_missing: u64,
    pub summaries_refused: u64,
    pub stale_reports: u64,
}

#[derive(Debug)]
struct Gather {
    epoch: u64,
    started_ms: u64,
    waiting: BTreeSet<NodeId>,
    got: Vec<Summary>,
}

/// One node's part in the epochs: answering initiators, adopting plans, and starting an epoch
/// when it is this node's turn. Time and the member list come in with every call; messages
/// come out in `out`.
#[derive(Debug)]
pub struct Epochs {
    me: NodeId,
    params: Params,
    plan: Plan,
    started_ms: u64,
    /// Global pages this node was given during the current epoch.
    received: u32,
    /// Pages this node evicted, and those of them (or of its pages given up for forwarded
    /// ones) that left the cluster, since its last summary.
    evicted: u32,
    discarded: u32,
    stale: bool,
    gather: Option<Gather>,
    /// Evictions and discards per second in the cluster, from the summaries (smoothed): M's
    /// and D's estimates.
    evict_rate_per_s: f64,
    discard_rate_per_s: f64,
    pub stats: EpochStats,
}

impl Epochs {
    /// A node that has not seen an epoch yet: until a plan comes, evicted pages are dropped.
    /// Epoch 0 has no length, so the first member in line (the lowest id) starts epoch 1 at
    /// its first tick.
    pub fn new(me: NodeId, params: Params, now_ms: u64) -> Self {
        let plan = Plan::empty(0, me, 0);
        Self {
            me,
            params,
            plan,
            started_ms: now_ms,
            received: 0,
            evicted: 0,
            discarded: 0,
            stale: false,
            gather: None,
            evict_rate_per_s: 0.0,
            discard_rate_per_s: 0.0,
            stats: EpochStats::default(),
        }
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// When this node adopted the current plan (its own clock).
    pub fn started_ms(&self) -> u64 {
        self.started_ms
    }

    pub fn params(&self) -> &Params {
        &self.params
    }

    /// This node evicted a page (forwarded or dropped).
    pub fn on_evicted(&mut self) {
        self.evicted = self.evicted.saturating_add(1);
    }

    /// A page left the cluster from this node: one it dropped, or one it gave up for a page
    /// forwarded to it. The initiator sizes M from these; a forwarded page that took a free
    /// frame (one a fetch emptied) replaced nothing and is not counted.
    pub fn on_discarded(&mut self) {
        self.discarded = self.discarded.saturating_add(1);
    }

    /// A global page this node took. The next initiator ends the epoch once it has had its
    /// weight's worth: by then the cluster has had about M replacements (§3.2).
    pub fn on_received(&mut self) {
        self.received = self.received.saturating_add(1);
    }

    /// [`Epochs::on_evicted`], [`Epochs::on_discarded`] and [`Epochs::on_received`] at once,
    /// for a runtime that learns them as counts (a daemon reads its store's counters).
    pub fn count(&mut self, evicted: u32, discarded: u32, received: u32) {
        self.evicted = self.evicted.saturating_add(evicted);
        self.discarded = self.discarded.saturating_add(discarded);
        self.received = self.received.saturating_add(received);
    }

    /// This node was sent a page but had nothing as old to give up: the plan is wrong.
    pub fn report_stale(&mut self, out: &mut Vec<Out>) {
        self.stats.stale_reports += 1;
        let to = self.plan.next_initiator();
        if to == self.me {
            self.stale = true;
        } else {
            out.push(Out::Stale {
                to,
                epoch: self.plan.epoch,
            });
        }
    }

    /// Another node says the current plan is wrong.
    pub fn on_stale(&mut self, epoch: u64) {
        if epoch == self.plan.epoch && self.plan.next_initiator() == self.me {
            self.stale = true;
        }
    }

    /// An initiator asks for this node's summary; `summary` makes it (only when needed: it
    /// scans the node's pages).
    pub fn on_request(
        &mut self,
        from: NodeId,
        epoch: u64,
        summary: impl FnOnce(u32, u32) -> Summary,
        out: &mut Vec<Out>,
    ) {
        if epoch <= self.plan.epoch {
            return; // an old or replayed request
        }
        let s = summary(self.evicted, self.discarded);
        self.evicted = 0;
        self.discarded = 0;
        self.stats.summaries_sent += 1;
        out.push(Out::Summary {
            to: from,
            epoch,
            summary: Box::new(s),
        });
    }

    /// A summary for the epoch this node is gathering.
    pub fn on_summary(&mut self, from: NodeId, epoch: u64, summary: Summary) {
        let Some(g) = self.gather.as_mut() else {
            return;
        };
        if g.epoch != epoch || summary.node != from || !g.waiting.remove(&from) {
            self.stats.summaries_refused += 1;
            return;
        }
        g.got.push(summary);
    }

    /// A plan from `from`. Adopted when it checks out and is newer than this node's (of the
    /// same epoch, the one whose initiator has the lower id wins, so two initiators that raced
    /// end with one plan everywhere).
    pub fn on_plan(&mut self, from: NodeId, plan: Plan, now_ms: u64) -> Result<bool, PlanError> {
        if let Err(e) = plan.check(from, &self.params) {
            self.stats.plans_refused += 1;
            return Err(e);
        }
        let newer = plan.epoch > self.plan.epoch
            || (plan.epoch == self.plan.epoch && plan.initiator < self.plan.initiator);
        if !newer {
            return Ok(false);
        }
        if self.gather.as_ref().is_some_and(|g| g.epoch <= plan.epoch) {
            self.gather = None;
        }
        self.adopt(plan, now_ms);
        Ok(true)
    }

    fn adopt(&mut self, plan: Plan, now_ms: u64) {
        self.plan = plan;
        self.started_ms = now_ms;
        self.received = 0;
        self.stale = false;
        self.stats.plans_adopted += 1;
    }

    /// Time passed: finish gathering, or start an epoch if it is this node's turn. `members`
    /// are the live members membership knows, sorted by id (this node among them or not);
    /// `summary` makes this node's own summary. Cheap unless it is this node's turn.
    pub fn on_tick(
        &mut self,
        now_ms: u64,
        members: &[NodeId],
        summary: impl FnOnce(u32, u32) -> Summary,
        out: &mut Vec<Out>,
    ) {
        debug_assert!(members.is_sorted(), "members must be sorted by id");
        if let Some(g) = &self.gather {
            let timed_out = now_ms >= g.started_ms + self.params.gather_timeout_ms;
            if g.waiting.is_empty() || timed_out {
                self.finish(now_ms, members, out);
            }
            return;
        }
        let end = self.started_ms + self.plan.duration_ms;
        let designate = self.plan.next_initiator();
        let early = designate == self.me && {
            let w = self.plan.weight(self.me);
            self.stale || (w > 0 && self.received >= w)
        };
        let turn = if now_ms < end {
            early
        } else {
            // The k-th live in line starts k·takeover after the end.
            match self.plan.place_in_line(self.me, members) {
                Some(k) => now_ms - end >= k.saturating_mul(self.params.takeover_ms),
                // Not a member by membership's account (yet): only a lone node starts.
                None => members.is_empty(),
            }
        };
        if !turn {
            return;
        }
        if designate != self.me {
            self.stats.takeovers += 1;
        }
        if early && now_ms < end {
            self.stats.epochs_started_early += 1;
        }
        self.stats.epochs_started += 1;
        let epoch = self.plan.epoch + 1;
        let mut waiting: BTreeSet<NodeId> = members.iter().copied().collect();
        waiting.remove(&self.me);
        for &to in &waiting {
            out.push(Out::RequestSummary { to, epoch });
        }
        let own = summary(self.evicted, self.discarded);
        self.evicted = 0;
        self.discarded = 0;
        self.gather = Some(Gather {
            epoch,
            started_ms: now_ms,
            waiting,
            got: vec![own],
        });
        if self.gather.as_ref().is_some_and(|g| g.waiting.is_empty()) {
            self.finish(now_ms, members, out);
        }
    }

    fn finish(&mut self, now_ms: u64, members: &[NodeId], out: &mut Vec<Out>) {
        let Some(g) = self.gather.take() else {
            return;
        };
        self.stats.summaries_missing += g.waiting.len() as u64;
        // M and D: the evictions and discards the last epoch saw, per second, over T, with
        // room to spare; between the bounds.
        let elapsed_ms = now_ms.saturating_sub(self.started_ms).max(1);
        let per_s = |n: u64| n as f64 * 1000.0 / elapsed_ms as f64;
        let evictions: u64 = g.got.iter().map(|s| u64::from(s.evicted)).sum();
        let discards: u64 = g.got.iter().map(|s| u64::from(s.discarded)).sum();
        let first = self.plan.epoch == 0;
        let smooth = |old: f64, new: f64| if first { new } else { 0.5 * old + 0.5 * new };
        self.evict_rate_per_s = smooth(self.evict_rate_per_s, per_s(evictions));
        self.discard_rate_per_s = smooth(self.discard_rate_per_s, per_s(discards));
        let over_t = |rate: f64| {
            (2.0 * rate * self.params.duration_ms as f64 / 1000.0)
                .clamp(f64::from(self.params.m_min), f64::from(self.params.m_max))
                as u32
        };
        let m_wanted = over_t(self.evict_rate_per_s);
        let d_wanted = over_t(self.discard_rate_per_s).min(m_wanted);
        let plan = Plan::compute(g.epoch, self.me, &g.got, m_wanted, d_wanted, &self.params);
        for &to in members {
            if to != self.me {
                out.push(Out::Plan {
                    to,
                    plan: plan.clone(),
                });
            }
        }
        self.adopt(plan, now_ms);
    }
}

#[cfg(test)]
mod tests;
