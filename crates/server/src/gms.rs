//! GMS's epochs in a daemon (paper 000, §3.2; issue 39): the daemon's part of the cluster-wide
//! algorithm, `netram_policy::gms::epoch::Epochs`, run by the membership thread, with its
//! messages carried in membership packets (`netram_member::envelope`: signed by the sending
//! node, to every member's address, under the same rate gate).
//!
//! A daemon's pages in GMS's sense are the clean pages it holds for others
//! (`netram_store::clean`; owned pages may not be dropped, so they are nobody's to replace):
//! its summary is their ages and its free frames. The evicting nodes are the clients
//! (`netram cache`), which take no part in epochs: they read the plan their daemon adopted
//! (`GET /gms` on its control socket, [`PlanView`]) and send each evicted page by it. So the
//! evictions a summary reports are the pages forwarded *to* this daemon (GMS counts them where
//! they leave; the sum over the cluster is the same, less the pages clients drop as too old),
//! and its discards the clean pages it gave up or refused; it learns both from its store's
//! counters.
//!
//! The sender of every message is the node its connection authenticated, never a field, so a
//! summary is taken as the sender's whatever node it would name, and a plan's initiator is
//! the sender's claim that `Plan::check` holds against the sender. A summary whose buckets
//! fall outside the policy's range is refused here (`None`), counted by the caller.

use crate::daemon::Shared;
use netram_member::{Liveness, PlanView};
use netram_policy::gms::age::{Histogram, Summary};
use netram_policy::gms::epoch::{EpochStats, Epochs, Out, Params, Plan};
use netram_policy::gms::NodeId;
use netram_proto::gms as wire;
use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};

/// How often the epoch machine is given the time (ms): an epoch's end, a gather's timeout and
/// a takeover are seen within this.
const TICK_MS: u64 = 50;

/// Why an epoch message was refused (each has its counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Not an epoch message, or one that does not decode, or a summary outside the policy's
    /// range.
    Malformed,
    /// From a node this daemon does not believe a live member (or from itself).
    NotMember,
}

/// The store's clean-page counters, as last seen.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    arrived: u64,
    taken: u64,
    discarded: u64,
    refused_younger: u64,
}

impl Seen {
    fn of(c: &netram_store::Counters) -> Self {
        Self {
            arrived: c.clean_stored
                + c.clean_replaced
                + c.clean_refused_younger
                + c.clean_refused_quota
                + c.clean_present,
            taken: c.clean_stored + c.clean_replaced,
            discarded: c.clean_replaced
                + c.clean_refused_younger
                + c.clean_refused_quota
                + c.clean_dropped_for_owned
                + c.clean_dropped_for_offer,
            refused_younger: c.clean_refused_younger,
        }
    }
}

/// What clients and `/metrics` read of a daemon's epochs: a copy, so that nobody but the
/// membership thread ever waits on the epoch machine.
#[derive(Debug, Clone, Default)]
pub(crate) struct View {
    pub plan: PlanView,
    pub stats: EpochStats,
}

/// The epoch machine and what it needs between calls; owned by the membership thread.
pub(crate) struct Runtime {
    epochs: Epochs,
    seen: Seen,
    next_tick_ms: u64,
}

/// The live members (not declared down) sorted by id, this node among them, and their
/// addresses.
fn live_members(shared: &Shared) -> (NodeId, Vec<NodeId>, HashMap<NodeId, SocketAddr>) {
    let m = shared.membership();
    let me = m.me().id;
    let mut ids = Vec::new();
    let mut addrs = HashMap::new();
    for v in m.members() {
        if v.liveness != Liveness::Down {
            ids.push(v.node.id);
            addrs.insert(v.node.id, v.node.addr);
        }
    }
    ids.sort_unstable();
    ids.dedup();
    (me, ids, addrs)
}

/// This node's summary now: its clean pages' ages and its free frames (GMS §3.2).
fn summary(shared: &Shared, me: NodeId, now_ms: u64, evicted: u32, discarded: u32) -> Summary {
    let store = shared.store();
    let mut ages = Histogram::default();
    for a in store.clean_ages(now_ms) {
        ages.add(a);
    }
    Summary {
        node: me,
        free: u32::try_from(store.room()).unwrap_or(u32::MAX),
        evicted,
        discarded,
        ages,
    }
}

impl Runtime {
    pub(crate) fn new(shared: &Shared, params: Params) -> Self {
        let me = shared.membership().me().id;
        Self {
            epochs: Epochs::new(me, params, shared.now_ms()),
            seen: Seen::of(shared.store().counters()),
            next_tick_ms: 0,
        }
    }

    /// Gives the epoch machine the time, when due, and sends what it asks.
    pub(crate) fn tick(&mut self, shared: &Shared, socket: &UdpSocket) {
        let now = shared.now_ms();
        if now < self.next_tick_ms {
            return;
        }
        self.next_tick_ms = now + TICK_MS;
        let (me, members, addrs) = live_members(shared);
        self.observe(shared);
        let mut out = Vec::new();
        self.epochs.on_tick(
            now,
            &members,
            |ev, dis| summary(shared, me, now, ev, dis),
            &mut out,
        );
        self.send(shared, socket, &addrs, out);
        self.publish(shared, now);
    }

    /// What the store did since the last look, told to the epoch machine: pages forwarded
    /// here, taken, given up or refused; a page refused for want of an older one says the
    /// plan is wrong (§3.2's early end).
    fn observe(&mut self, shared: &Shared) -> Vec<Out> {
        let seen = Seen::of(shared.store().counters());
        let d = |a: u64, b: u64| u32::try_from(a.saturating_sub(b)).unwrap_or(u32::MAX);
        self.epochs.count(
            d(seen.arrived, self.seen.arrived),
            d(seen.discarded, self.seen.discarded),
            d(seen.taken, self.seen.taken),
        );
        let mut out = Vec::new();
        if seen.refused_younger > self.seen.refused_younger {
            self.epochs.report_stale(&mut out);
        }
        self.seen = seen;
        out
    }

    /// An epoch message from member `from` (the node the packet's signature names, or in a
    /// cluster without credentials the node it claims, on loopback only).
    pub(crate) fn receive(
        &mut self,
        shared: &Shared,
        socket: &UdpSocket,
        from: NodeId,
        frame: &[u8],
    ) -> Result<(), Refused> {
        let Ok((_, wire::Request::Epoch(msg))) = wire::decode_request(frame) else {
            return Err(Refused::Malformed);
        };
        let (me, members, addrs) = live_members(shared);
        if from == me || members.binary_search(&from).is_err() {
            return Err(Refused::NotMember);
        }
        let now = shared.now_ms();
        let mut out = self.observe(shared);
        match msg {
            wire::Epoch::RequestSummary { epoch } => self.epochs.on_request(
                from,
                epoch,
                |ev, dis| summary(shared, me, now, ev, dis),
                &mut out,
            ),
            wire::Epoch::Summary { epoch, summary } => {
                let s = summary_from_wire(from, &summary).ok_or(Refused::Malformed)?;
                self.epochs.on_summary(from, epoch, s);
            }
            wire::Epoch::Plan(p) => {
                if let Err(e) = self.epochs.on_plan(from, plan_from_wire(&p), now) {
                    tracing::debug!(node = from, "GMS plan refused: {e}");
                }
            }
            wire::Epoch::Stale { epoch } => self.epochs.on_stale(epoch),
        }
        self.send(shared, socket, &addrs, out);
        self.publish(shared, now);
        Ok(())
    }

    fn send(
        &self,
        shared: &Shared,
        socket: &UdpSocket,
        addrs: &HashMap<NodeId, SocketAddr>,
        out: Vec<Out>,
    ) {
        let from = shared.membership().me().id;
        for o in out {
            let (to, msg) = out_to_wire(&o);
            let Some(&addr) = addrs.get(&to) else {
                tracing::debug!(node = to, "GMS: no address for an epoch message's node");
                continue;
            };
            let mut frame = Vec::new();
            wire::Request::Epoch(msg).encode(0, &mut frame);
            if crate::gossip::send_gms(shared, socket, addr, from, &frame) {
                crate::daemon::Shared::bump(&shared.counters.gms_messages_sent);
            }
        }
    }

    fn publish(&self, shared: &Shared, now_ms: u64) {
        let p = self.epochs.plan();
        let view = View {
            plan: PlanView {
                node: shared.membership().me().id,
                epoch: p.epoch,
                initiator: p.initiator,
                m: p.m,
                min_age_ms: p.min_age_ms,
                duration_ms: p.duration_ms,
                adopted_ms_ago: now_ms.saturating_sub(self.epochs.started_ms()),
                weights: p.weights.clone(),
            },
            stats: self.epochs.stats.clone(),
        };
        *shared.gms_view() = view;
    }
}

/// A policy summary as it travels (the node is the connection's).
pub fn summary_to_wire(s: &Summary) -> wire::Summary {
    wire::Summary {
        free: s.free,
        evicted: s.evicted,
        discarded: s.discarded,
        buckets: s
            .ages
            .nonempty()
            .map(|(b, c)| (u8::try_from(b).expect("fewer than 256 buckets"), c))
            .collect(),
    }
}

/// A summary received from `from`; `None` if a bucket is outside the policy's range.
pub fn summary_from_wire(from: NodeId, s: &wire::Summary) -> Option<Summary> {
    Some(Summary {
        node: from,
        free: s.free,
        evicted: s.evicted,
        discarded: s.discarded,
        ages: Histogram::from_pairs(s.buckets.iter().map(|&(b, c)| (usize::from(b), c)))?,
    })
}

pub fn plan_to_wire(p: &Plan) -> wire::Plan {
    wire::Plan {
        epoch: p.epoch,
        initiator: p.initiator,
        m: p.m,
        min_age_ms: p.min_age_ms,
        duration_ms: p.duration_ms,
        weights: p.weights.clone(),
    }
}

pub fn plan_from_wire(p: &wire::Plan) -> Plan {
    Plan {
        epoch: p.epoch,
        initiator: p.initiator,
        m: p.m,
        min_age_ms: p.min_age_ms,
        duration_ms: p.duration_ms,
        weights: p.weights.clone(),
    }
}

/// What `Epochs` asks to send: its destination and the wire message.
pub fn out_to_wire(o: &Out) -> (NodeId, wire::Epoch) {
    match o {
        Out::RequestSummary { to, epoch } => (*to, wire::Epoch::RequestSummary { epoch: *epoch }),
        Out::Summary { to, epoch, summary } => (
            *to,
            wire::Epoch::Summary {
                epoch: *epoch,
                summary: summary_to_wire(summary),
            },
        ),
        Out::Plan { to, plan } => (*to, wire::Epoch::Plan(plan_to_wire(plan))),
        Out::Stale { to, epoch } => (*to, wire::Epoch::Stale { epoch: *epoch }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use netram_policy::gms::epoch::Params;

    #[test]
    fn summaries_and_plans_cross_the_wire_unchanged() {
        let mut ages = Histogram::default();
        for a in [0, 5, 5, 1_000, 86_400_000, u64::MAX] {
            ages.add(a);
        }
        let s = Summary {
            node: 7,
            free: 3,
            evicted: 9,
            discarded: 2,
            ages,
        };
        let w = summary_to_wire(&s);
        // The wire's encoding takes it whole (buckets from the oldest, none empty).
        let mut buf = Vec::new();
        wire::Request::Epoch(wire::Epoch::Summary {
            epoch: 1,
            summary: w.clone(),
        })
        .encode(1, &mut buf);
        assert!(wire::decode_request(&buf).is_ok());
        assert_eq!(summary_from_wire(7, &w), Some(s.clone()));
        // The node is the sender's, whatever the summary was made for.
        assert_eq!(summary_from_wire(8, &w).unwrap().node, 8);
        // A bucket the policy does not have is refused.
        let mut bad = w;
        bad.buckets.insert(0, (200, 1));
        assert_eq!(summary_from_wire(7, &bad), None);

        let plan = Plan::compute(4, 7, &[s], 100, 10, &Params::default());
        assert_eq!(plan_from_wire(&plan_to_wire(&plan)), plan);
        let (to, msg) = out_to_wire(&Out::Plan {
            to: 9,
            plan: plan.clone(),
        });
        assert_eq!((to, msg), (9, wire::Epoch::Plan(plan_to_wire(&plan))));
    }
}
