//! GMS's epoch messages between the policy's types and the wire's (GMS §3.2; issue 39): the
//! daemon hands `netram_policy::gms::epoch::Epochs` what arrives and sends what it asks for.
//!
//! The sender of every message is the node its connection authenticated, never a field, so a
//! summary is taken as the sender's whatever node it would name, and a plan's initiator is
//! the sender's claim that `Plan::check` holds against the sender. A summary whose buckets
//! fall outside the policy's range is refused here (`None`), counted by the caller.

use netram_policy::gms::age::{Histogram, Summary};
use netram_policy::gms::epoch::{Out, Plan};
use netram_policy::gms::NodeId;
use netram_proto::gms as wire;

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
