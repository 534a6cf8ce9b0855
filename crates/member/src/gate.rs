//! Who may spend this node's CPU on a membership packet, without I/O (SWIM's premise, and
//! Anemone §2.4's, is that a member's packets get through: a flood must not drown them).
//!
//! Checking a signed packet costs two signature verifications (~0.1 ms together here: the
//! certificate's by the cluster CA, the packet's by the certificate's key), so a runtime asks
//! the gate before it checks one, and checks nothing the gate refuses. What the gate knows is
//! only the packet's source address, so it gives each address this node has reason to hear
//! from — a member's, at any liveness (one declared down must still be heard to refute), or a
//! seed's — a budget of its own, and every other address shares one small budget for
//! strangers (a node joining), in which no single address takes more than its share. A flood
//! from any number of addresses that are not members' therefore costs at most
//! [`GateConfig::strangers_per_s`] checks a second and never a member's budget.
//!
//! What this does not stop: a sender that forges a member's source address (UDP source
//! addresses are not authenticated) can spend that member's budget; a shared cluster key
//! (a MAC checked before the signature) would, at the price of one more secret to
//! distribute. Members' pages do not depend on it: a client fails a server only on its own
//! evidence, never on membership's word.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

/// The budgets, in packets checked per second (each bucket holds a second's worth).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateConfig {
    /// Per member (or seed) address. A member's SWIM traffic to one node is a few packets a
    /// second (a probe, its answer, indirect probes, joins); 200 leaves a wide margin.
    pub member_per_s: u32,
    /// All addresses that are not members', together.
    pub strangers_per_s: u32,
    /// One stranger address at most (so that one flooding address leaves the others some).
    pub stranger_per_s: u32,
}

impl Default for GateConfig {
    fn default() -> Self {
        Self {
            member_per_s: 200,
            strangers_per_s: 100,
            stranger_per_s: 10,
        }
    }
}

/// What the gate said of a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// From a member's (or seed's) address, within its budget.
    Member,
    /// From another address, within the strangers' budget.
    Stranger,
    /// A member's address over its budget.
    MemberOverBudget,
    /// Another address, over its own or the strangers' shared budget.
    StrangerOverBudget,
}

impl Admit {
    pub fn admitted(self) -> bool {
        matches!(self, Admit::Member | Admit::Stranger)
    }
}

/// A token bucket of `rate` tokens a second, holding at most one second's worth.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at_ms: u64,
}

impl Bucket {
    fn full(rate: u32, now_ms: u64) -> Self {
        Self {
            tokens: rate as f64,
            at_ms: now_ms,
        }
    }

    fn refill(&mut self, rate: u32, now_ms: u64) {
        let dt = now_ms.saturating_sub(self.at_ms) as f64 / 1000.0;
        self.tokens = (self.tokens + dt * rate as f64).min(rate as f64);
        self.at_ms = self.at_ms.max(now_ms);
    }

    fn has(&self) -> bool {
        self.tokens >= 1.0
    }

    fn take(&mut self) {
        self.tokens -= 1.0;
    }
}

/// Stranger addresses tracked at most; beyond, the oldest are forgotten (a forgotten address
/// starts again with a full bucket of [`GateConfig::stranger_per_s`], still inside the shared
/// budget, so forgetting costs nothing but that share).
const MAX_STRANGERS: usize = 4096;

/// The gate: budgets per known address and one for everybody else.
#[derive(Debug)]
pub struct Gate {
    cfg: GateConfig,
    members: HashMap<SocketAddr, Bucket>,
    strangers: HashMap<IpAddr, Bucket>,
    shared: Bucket,
}

impl Gate {
    pub fn new(cfg: GateConfig, now_ms: u64) -> Self {
        Self {
            cfg,
            members: HashMap::new(),
            strangers: HashMap::new(),
            shared: Bucket::full(cfg.strangers_per_s, now_ms),
        }
    }

    /// The addresses that get budgets of their own: every member this node knows (any
    /// liveness) and its seeds. Addresses that stay keep their buckets.
    pub fn set_members(&mut self, addrs: impl IntoIterator<Item = SocketAddr>, now_ms: u64) {
        let rate = self.cfg.member_per_s;
        let mut next = HashMap::new();
        for a in addrs {
            let b = self
                .members
                .get(&a)
                .copied()
                .unwrap_or_else(|| Bucket::full(rate, now_ms));
            next.insert(a, b);
        }
        self.members = next;
    }

    /// Whether a packet from `from` may be checked now; takes a token if so.
    pub fn admit(&mut self, from: SocketAddr, now_ms: u64) -> Admit {
        if let Some(b) = self.members.get_mut(&from) {
            b.refill(self.cfg.member_per_s, now_ms);
            if !b.has() {
                return Admit::MemberOverBudget;
            }
            b.take();
            return Admit::Member;
        }
        self.shared.refill(self.cfg.strangers_per_s, now_ms);
        if !self.shared.has() {
            return Admit::StrangerOverBudget;
        }
        if self.strangers.len() >= MAX_STRANGERS && !self.strangers.contains_key(&from.ip()) {
            let oldest = self
                .strangers
                .iter()
                .min_by_key(|(_, b)| b.at_ms)
                .map(|(ip, _)| *ip);
            if let Some(ip) = oldest {
                self.strangers.remove(&ip);
            }
        }
        let rate = self.cfg.stranger_per_s;
        let b = self
            .strangers
            .entry(from.ip())
            .or_insert_with(|| Bucket::full(rate, now_ms));
        b.refill(rate, now_ms);
        if !b.has() {
            return Admit::StrangerOverBudget;
        }
        b.take();
        self.shared.take();
        Admit::Stranger
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn strangers_from_any_number_of_addresses_never_take_a_members_budget() {
        let cfg = GateConfig::default();
        let mut g = Gate::new(cfg, 0);
        let member = addr("10.0.0.1:7077");
        g.set_members([member], 0);
        let mut strangers_admitted = 0;
        // 32 addresses flood for ten seconds at 100,000 packets a second in all; the member
        // sends 20 a second meanwhile.
        for ms in 0..10_000u64 {
            for k in 0..100u64 {
                let from = addr(&format!("10.1.0.{}:{}", k % 32 + 2, 40000 + k));
                if g.admit(from, ms).admitted() {
                    strangers_admitted += 1;
                }
            }
            if ms % 50 == 0 {
                assert_eq!(g.admit(member, ms), Admit::Member, "at {ms} ms");
            }
        }
        // At most the strangers' budget per second, plus the first second's full bucket.
        assert!(
            strangers_admitted <= 11 * cfg.strangers_per_s as u64,
            "{strangers_admitted}"
        );
        assert!(strangers_admitted >= 9 * cfg.strangers_per_s as u64 / 2);
    }

    #[test]
    fn one_flooding_stranger_leaves_the_shared_budget_to_others() {
        let cfg = GateConfig::default();
        let mut g = Gate::new(cfg, 0);
        let flood = addr("10.1.0.9:5000");
        let joiner = addr("10.2.0.1:7077");
        for ms in 0..2_000u64 {
            for _ in 0..100 {
                g.admit(flood, ms);
            }
            if ms % 500 == 0 {
                assert_eq!(g.admit(joiner, ms), Admit::Stranger, "at {ms} ms");
            }
        }
    }

    #[test]
    fn a_member_over_its_budget_is_refused_and_recovers() {
        let cfg = GateConfig::default();
        let mut g = Gate::new(cfg, 0);
        let m = addr("10.0.0.1:7077");
        g.set_members([m], 0);
        let admitted = (0..1000).filter(|_| g.admit(m, 0).admitted()).count();
        assert_eq!(admitted, cfg.member_per_s as usize);
        assert_eq!(g.admit(m, 0), Admit::MemberOverBudget);
        assert_eq!(g.admit(m, 100), Admit::Member);
        // Forgotten as a member, it is a stranger.
        g.set_members([], 200);
        assert_eq!(g.admit(m, 200), Admit::Stranger);
    }

    #[test]
    fn the_strangers_table_is_bounded() {
        let mut g = Gate::new(GateConfig::default(), 0);
        for i in 0..(MAX_STRANGERS as u32 + 100) {
            let ip = std::net::Ipv4Addr::from(0x0b00_0000 + i);
            g.admit(SocketAddr::new(ip.into(), 1), i as u64 * 20);
        }
        assert!(g.strangers.len() <= MAX_STRANGERS);
    }
}
