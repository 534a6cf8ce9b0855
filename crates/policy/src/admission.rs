//! Who gets a connection slot, without I/O: the page daemon's and `netram nbd`'s accept loops
//! ask this before they start a thread for a connection, and again when its handshake is over.
//! (Anemone §2.5 bounds what a server gives each client; here the bound holds against clients
//! that never finish saying who they are.)
//!
//! Two pools, so that a connection that has proven who it is never competes with handshakes in
//! progress:
//!
//! * **handshakes in progress** are few, each bounded by the runtime's deadline, and limited
//!   per source address and per subnet (/24 for IPv4, /64 for IPv6: one machine or one
//!   network's worth of addresses). When they are all taken, a newcomer takes the slot of the
//!   oldest handshake of the subnets that hold the most, so that however many addresses an
//!   attacker holds slots from, a connection from anywhere else gets a slot and, its handshake
//!   taking milliseconds, finishes it. (An attacker that opens a whole pool's worth of new
//!   connections from as many subnets within one client's handshake can still push it out:
//!   at the daemon's defaults, 128 connections within a few milliseconds from 128 /24s.);
//! * **established connections** (the handshake done: over TLS, a certificate of the cluster
//!   proven) are counted in all and per client (the certificate's node id, or the address, or
//!   the local user), and a handshake that ends over those limits is refused.
//!
//! A trusted source (the local socket's owner or root on a unix socket) is limited only by the
//! totals: it may open as many connections at once as a multi-connection client uses (its
//! handshakes in progress are counted apart, up to `max_established` of them, so that
//! strangers holding the handshake pool never keep it out), and its handshakes are never
//! taken away.

use std::collections::HashMap;
use std::net::IpAddr;

/// The limits. Each pool's total bounds the threads and memory its connections cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionConfig {
    pub max_handshakes: usize,
    pub max_handshakes_per_addr: usize,
    pub max_handshakes_per_subnet: usize,
    pub max_established: usize,
    /// Per client that is not trusted.
    pub max_established_per_client: usize,
}

/// Where a connection comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    Ip(IpAddr),
    /// A unix socket's peer, by user id.
    Local {
        uid: u32,
        trusted: bool,
    },
}

impl Source {
    fn trusted(self) -> bool {
        matches!(self, Source::Local { trusted: true, .. })
    }

    /// The group a source's handshakes are limited by together.
    fn subnet(self) -> Subnet {
        match self {
            Source::Ip(IpAddr::V4(a)) => Subnet::V4(u32::from(a) >> 8),
            Source::Ip(IpAddr::V6(a)) => Subnet::V6((u128::from(a) >> 64) as u64),
            Source::Local { uid, .. } => Subnet::Local(uid),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Subnet {
    V4(u32),
    V6(u64),
    Local(u32),
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("handshakes in progress from this address are at their limit")]
    PerAddress,
    #[error("handshakes in progress from this subnet are at their limit")]
    PerSubnet,
    #[error("handshakes in progress are at their limit, none of them can be taken over")]
    Handshakes,
    #[error("established connections are at their limit")]
    Full,
    #[error("this client's established connections are at their limit")]
    PerClient,
}

/// A connection the runtime knows by this number.
pub type ConnId = u64;

/// A slot given: the connection's number, and the handshake whose slot it took (the runtime
/// closes that connection at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    pub id: ConnId,
    pub evict: Option<ConnId>,
}

#[derive(Debug, Clone, Copy)]
struct Handshake {
    source: Source,
}

#[derive(Debug)]
pub struct Admission {
    cfg: AdmissionConfig,
    next: ConnId,
    /// In progress, by id (ids grow: the smallest is the oldest).
    handshakes: std::collections::BTreeMap<ConnId, Handshake>,
    per_source: HashMap<Source, usize>,
    per_subnet: HashMap<Subnet, usize>,
    /// Trusted sources' handshakes in progress (not in `handshakes`).
    trusted: std::collections::BTreeSet<ConnId>,
    /// Established: by id, its client.
    established: HashMap<ConnId, String>,
    per_client: HashMap<String, usize>,
}

fn dec<K: std::hash::Hash + Eq>(m: &mut HashMap<K, usize>, k: &K) {
    if let Some(n) = m.get_mut(k) {
        *n -= 1;
        if *n == 0 {
            m.remove(k);
        }
    }
}

impl Admission {
    pub fn new(cfg: AdmissionConfig) -> Self {
        Self {
            cfg,
            next: 0,
            handshakes: Default::default(),
            trusted: Default::default(),
            per_source: HashMap::new(),
            per_subnet: HashMap::new(),
            established: HashMap::new(),
            per_client: HashMap::new(),
        }
    }

    pub fn config(&self) -> AdmissionConfig {
        self.cfg
    }

    /// Handshakes in progress and connections established.
    pub fn counts(&self) -> (usize, usize) {
        (
            self.handshakes.len() + self.trusted.len(),
            self.established.len(),
        )
    }

    /// A new connection from `source`: a handshake slot, or why not.
    pub fn begin(&mut self, source: Source) -> Result<Admitted, Refused> {
        let subnet = source.subnet();
        let trusted = source.trusted();
        if trusted {
            if self.trusted.len() >= self.cfg.max_established {
                return Err(Refused::Handshakes);
            }
            let id = self.next;
            self.next += 1;
            self.trusted.insert(id);
            return Ok(Admitted { id, evict: None });
        }
        {
            if self.per_source.get(&source).copied().unwrap_or(0)
                >= self.cfg.max_handshakes_per_addr
            {
                return Err(Refused::PerAddress);
            }
            if self.per_subnet.get(&subnet).copied().unwrap_or(0)
                >= self.cfg.max_handshakes_per_subnet
            {
                return Err(Refused::PerSubnet);
            }
        }
        let mut evict = None;
        if self.handshakes.len() >= self.cfg.max_handshakes {
            let mine = self.per_subnet.get(&subnet).copied().unwrap_or(0) + 1;
            // The subnet holding the most handshakes that may be taken over, if it holds at
            // least as many as the newcomer's will.
            let mut counts: HashMap<Subnet, usize> = HashMap::new();
            for h in self.handshakes.values() {
                *counts.entry(h.source.subnet()).or_insert(0) += 1;
            }
            let most = counts.values().copied().max().unwrap_or(0);
            if most == 0 || most < mine {
                return Err(Refused::Handshakes);
            }
            // Of the subnets that hold the most, the oldest handshake goes: a newcomer's own
            // is the newest, so it is the last one taken over.
            let victim = self
                .handshakes
                .iter()
                .find(|(_, h)| counts[&h.source.subnet()] == most)
                .map(|(&id, _)| id)
                .expect("the subnet was counted from these");
            self.end(victim);
            evict = Some(victim);
        }
        let id = self.next;
        self.next += 1;
        self.handshakes.insert(id, Handshake { source });
        *self.per_source.entry(source).or_insert(0) += 1;
        *self.per_subnet.entry(subnet).or_insert(0) += 1;
        Ok(Admitted { id, evict })
    }

    /// Connection `id`'s handshake is over: it is `client` now (a trusted source's limits are
    /// the totals only). Refused over the limits: it keeps its handshake slot until it is
    /// ended (the caller may free others and ask again, or close it).
    pub fn establish(&mut self, id: ConnId, client: &str) -> Result<(), Refused> {
        let trusted = self.trusted.contains(&id);
        if !trusted && !self.handshakes.contains_key(&id) {
            // Taken over meanwhile (or never known): it has no slot.
            return Err(Refused::Handshakes);
        }
        if self.established.len() >= self.cfg.max_established {
            return Err(Refused::Full);
        }
        if !trusted
            && self.per_client.get(client).copied().unwrap_or(0)
                >= self.cfg.max_established_per_client
        {
            return Err(Refused::PerClient);
        }
        self.end(id);
        self.established.insert(id, client.to_string());
        *self.per_client.entry(client.to_string()).or_insert(0) += 1;
        Ok(())
    }

    /// Whether connection `id` still holds a slot (one taken over has none).
    pub fn holds(&self, id: ConnId) -> bool {
        self.handshakes.contains_key(&id)
            || self.trusted.contains(&id)
            || self.established.contains_key(&id)
    }

    /// Connection `id` ended (any number of times; an unknown id is nothing).
    pub fn end(&mut self, id: ConnId) {
        self.trusted.remove(&id);
        if let Some(h) = self.handshakes.remove(&id) {
            dec(&mut self.per_source, &h.source);
            dec(&mut self.per_subnet, &h.source.subnet());
        }
        if let Some(client) = self.established.remove(&id) {
            dec(&mut self.per_client, &client);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    const CFG: AdmissionConfig = AdmissionConfig {
        max_handshakes: 32,
        max_handshakes_per_addr: 4,
        max_handshakes_per_subnet: 8,
        max_established: 16,
        max_established_per_client: 4,
    };

    fn ip(a: u8, b: u8, c: u8, d: u8) -> Source {
        Source::Ip(IpAddr::V4(Ipv4Addr::new(a, b, c, d)))
    }

    #[test]
    fn handshakes_are_limited_per_address_and_per_subnet() {
        let mut a = Admission::new(CFG);
        for _ in 0..4 {
            a.begin(ip(10, 0, 0, 1)).unwrap();
        }
        assert_eq!(a.begin(ip(10, 0, 0, 1)), Err(Refused::PerAddress));
        for _ in 0..4 {
            a.begin(ip(10, 0, 0, 2)).unwrap();
        }
        assert_eq!(a.begin(ip(10, 0, 0, 3)), Err(Refused::PerSubnet));
        assert!(a.begin(ip(10, 0, 1, 3)).is_ok(), "another subnet");
    }

    /// 64 addresses, each in a subnet of its own (the hardest case for per-subnet limits),
    /// keep every handshake slot taken and renew them as fast as they like: a client from
    /// elsewhere still gets a slot, keeps it while its handshake runs, and is established.
    #[test]
    fn attackers_from_many_subnets_cannot_keep_a_client_out() {
        let mut a = Admission::new(CFG);
        let mut held = std::collections::VecDeque::new();
        for round in 0..10u8 {
            for k in 0..64u8 {
                for _ in 0..CFG.max_handshakes_per_addr {
                    match a.begin(ip(10, k, round % 2, 1)) {
                        Ok(x) => held.push_back(x.id),
                        Err(_) => break,
                    }
                }
            }
        }
        assert_eq!(a.counts().0, CFG.max_handshakes);
        let me = a.begin(ip(192, 168, 1, 1)).expect("a slot for the client");
        assert!(me.evict.is_some(), "one of the attackers' was taken over");
        // The attackers go on opening connections while the client's handshake runs: the
        // oldest handshakes go first, so the client's survives all but a pool's worth of them
        // within its handshake's time (milliseconds).
        for k in 0..(CFG.max_handshakes as u8 - 1) {
            let _ = a.begin(ip(10, k, 7, 1));
        }
        assert!(a.holds(me.id), "the client's handshake was taken over");
        a.establish(me.id, "node 7").unwrap();
        assert_eq!(a.counts().1, 1);
    }

    #[test]
    fn established_connections_do_not_compete_with_handshakes() {
        let mut a = Admission::new(CFG);
        let mut ids = Vec::new();
        for k in 0..16u8 {
            let x = a.begin(ip(10, k, 0, 1)).unwrap();
            a.establish(x.id, &format!("node {k}")).unwrap();
            ids.push(x.id);
        }
        // Every handshake slot taken by strangers: the established stay.
        for k in 0..64u8 {
            let _ = a.begin(ip(10, 100 + k, 0, 1));
        }
        assert!(ids.iter().all(|&id| a.holds(id)));
        // Established full: a handshake that ends is refused, and its slot freed.
        let x = a.begin(ip(192, 168, 0, 1)).unwrap();
        assert_eq!(a.establish(x.id, "node 99"), Err(Refused::Full));
        // It keeps its handshake slot until it is ended (or established once there is room).
        a.end(ids[0]);
        assert_eq!(a.establish(x.id, "node 99"), Ok(()));
    }

    #[test]
    fn per_client_limit_counts_established_only_and_trusted_users_have_none() {
        let mut a = Admission::new(CFG);
        for _ in 0..4 {
            let x = a.begin(ip(10, 0, 0, 1)).unwrap();
            a.establish(x.id, "node 5").unwrap();
        }
        let x = a.begin(ip(10, 0, 0, 1)).unwrap();
        assert_eq!(a.establish(x.id, "node 5"), Err(Refused::PerClient));
        // The same node from another address is the same client.
        let x = a.begin(ip(10, 9, 0, 1)).unwrap();
        assert_eq!(a.establish(x.id, "node 5"), Err(Refused::PerClient));
        // Root on the local socket: up to the total, handshakes all at once.
        let root = Source::Local {
            uid: 0,
            trusted: true,
        };
        let ids: Vec<_> = (0..12).map(|_| a.begin(root).unwrap().id).collect();
        for id in ids {
            a.establish(id, "uid 0").unwrap();
        }
        assert_eq!(a.counts().1, 16);
        let x = a.begin(root).unwrap();
        assert_eq!(a.establish(x.id, "uid 0"), Err(Refused::Full));
        // A stranger on the local socket is bounded like any client.
        let stranger = Source::Local {
            uid: 1000,
            trusted: false,
        };
        for _ in 0..4 {
            a.begin(stranger).unwrap();
        }
        assert_eq!(a.begin(stranger), Err(Refused::PerAddress));
    }

    #[test]
    fn trusted_handshakes_neither_take_nor_lose_the_strangers_slots() {
        let mut a = Admission::new(AdmissionConfig {
            max_handshakes: 4,
            ..CFG
        });
        let root = Source::Local {
            uid: 0,
            trusted: true,
        };
        // Strangers hold the whole pool; root's handshakes are counted apart, up to the
        // established total, and take nobody's slot.
        let strangers: Vec<_> = (0..4u8)
            .map(|k| a.begin(ip(10, k, 0, 1)).unwrap().id)
            .collect();
        let ids: Vec<_> = (0..CFG.max_established)
            .map(|_| a.begin(root).unwrap())
            .collect();
        assert!(ids.iter().all(|x| x.evict.is_none()));
        assert_eq!(a.begin(root), Err(Refused::Handshakes));
        assert!(strangers.iter().all(|&id| a.holds(id)));
        // A stranger newcomer takes a stranger's slot, never root's.
        let s = a.begin(ip(10, 9, 0, 1)).unwrap();
        assert!(strangers.contains(&s.evict.unwrap()));
        assert!(ids.iter().all(|x| a.holds(x.id)));
        for x in &ids {
            a.establish(x.id, "uid 0").unwrap();
        }
        assert_eq!(a.counts(), (4, CFG.max_established));
    }

    #[test]
    fn ending_twice_or_after_a_takeover_changes_nothing() {
        let mut a = Admission::new(CFG);
        let x = a.begin(ip(10, 0, 0, 1)).unwrap();
        a.end(x.id);
        a.end(x.id);
        assert_eq!(a.counts(), (0, 0));
        assert_eq!(a.establish(x.id, "node 1"), Err(Refused::Handshakes));
    }
}
