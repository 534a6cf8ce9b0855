//! Who is in the cluster, without I/O: every daemon is a peer (Nswap §III, Anemone §2.4–2.5),
//! and this is how each finds the others, learns what they offer, and learns that one died.
//!
//! Liveness is SWIM with suspicion (the `foca` crate: probes, indirect probes, a suspect that
//! does not refute in time is declared down, updates piggybacked on every message). Anemone's
//! resource announcements ride on the same messages: every packet carries its sender's
//! [`Announce`] (offered and free pages, load), so a node's view of the others' capacity is as
//! fresh as its gossip. A node joins through a list of seed addresses and retries them while
//! it knows nobody. Identities are a node id (the one its certificate names), the address it
//! serves pages on (membership uses the same port over UDP) and a boot incarnation, so a
//! restarted daemon supersedes its old self.
//!
//! [`Membership`] is a state machine: packets and the time go in (`on_packet`, `on_tick`),
//! packets to send, events and the member list come out. The daemon's runtime
//! (`netram-server`'s `gossip.rs`) moves the bytes over UDP and signs them ([`envelope`]);
//! tests drive a whole cluster of them with a virtual clock and a lossy network.
//!
//! What the runtime must check, not this crate: that a packet's signature is valid and its
//! signer's node id is the one the packet claims ([`Membership::on_packet`]'s `sender`).
//! Updates about third nodes are relayed by others and cannot be authenticated; what they can
//! do is name an address for a node id, and every page connection checks the node id in the
//! certificate of whoever answers there.

pub mod envelope;
pub mod gate;
#[cfg(test)]
mod tests;

pub use envelope::Announce;
use foca::{
    AccumulatingRuntime, Codec, Foca, Identity, OwnedNotification as Notification, PostcardCodec,
    Timer,
};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;

/// A member: the node id its certificate names, where it serves pages (and gossips, on the
/// same port over UDP), and which boot of it this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Node {
    pub id: u64,
    pub addr: SocketAddr,
    /// Grows with every start of the daemon (wall-clock nanoseconds at start) and when it
    /// rejoins after being declared down.
    pub boot: u64,
}

impl Identity for Node {
    /// One member per node id: a newer boot replaces an older one.
    type Addr = u64;

    fn renew(&self) -> Option<Self> {
        Some(Node {
            boot: self.boot + 1,
            ..*self
        })
    }

    fn addr(&self) -> u64 {
        self.id
    }

    fn win_addr_conflict(&self, adversary: &Self) -> bool {
        self.boot > adversary.boot
    }
}

/// The id of a seed's placeholder identity: a seed is only an address until it answers.
const SEED_ID: u64 = 0;

/// How fast membership notices things.
#[derive(Debug, Clone)]
pub struct MemberConfig {
    /// How often a random member is probed.
    pub probe_period: Duration,
    /// How long a probe may take before indirect probes go out.
    pub probe_rtt: Duration,
    /// How long a suspect has to refute before it is declared down.
    pub suspect_to_down: Duration,
    /// How often the seeds are tried while this node knows nobody.
    pub join_retry: Duration,
    /// How often the seeds are announced to even when this node knows others, so that two
    /// parts of a cluster that lost each other (both seeds restarted at once: they know only
    /// each other) become one again.
    pub rejoin_every: Duration,
    /// How often two members declared down are announced to: a node that restarted at the
    /// same address answers, and the parts that knew it merge.
    pub down_announce_every: Duration,
    /// The cluster size expected, for how many times an update is retransmitted.
    pub cluster_size: u32,
}

impl Default for MemberConfig {
    fn default() -> Self {
        Self {
            probe_period: Duration::from_millis(1000),
            probe_rtt: Duration::from_millis(300),
            suspect_to_down: Duration::from_secs(3),
            join_retry: Duration::from_secs(1),
            rejoin_every: Duration::from_secs(30),
            down_announce_every: Duration::from_secs(5),
            cluster_size: 16,
        }
    }
}

impl MemberConfig {
    fn foca(&self) -> foca::Config {
        let mut c = foca::Config::new_lan(NonZeroU32::new(self.cluster_size.max(2)).expect(">0"));
        c.probe_period = self.probe_period;
        c.probe_rtt = self.probe_rtt.min(self.probe_period / 2);
        c.suspect_to_down_after = self.suspect_to_down;
        c.periodic_announce_to_down_members = Some(foca::PeriodicParams {
            frequency: self.down_announce_every,
            num_members: std::num::NonZeroUsize::new(2).expect(">0"),
        });
        // Room for a certificate and a signature under the envelope's limit.
        c.max_packet_size = std::num::NonZeroUsize::new(1400).expect(">0");
        c
    }
}

/// What this node believes of another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Liveness {
    Alive,
    /// Someone suspects it; treated as alive until it is declared down or refutes.
    Suspect,
    Down,
}

/// One line of [`Membership::members`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberView {
    pub node: Node,
    pub liveness: Liveness,
    /// The newest announcement heard from it directly, and when.
    pub announce: Option<(Announce, u64)>,
}

/// One member as a daemon lists it (`/members`, `netram members`) and a client reads it to
/// find the servers of its cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRow {
    pub node: u64,
    /// Where it serves pages.
    pub addr: SocketAddr,
    pub boot: u64,
    pub state: Liveness,
    /// The daemon that lists it.
    #[serde(rename = "self")]
    pub is_self: bool,
    pub offered_pages: u64,
    pub free_pages: u64,
    pub requests_per_s: u32,
    /// How long since its announcement was last heard; `None`: never heard directly.
    pub heard_ms_ago: Option<u64>,
}

/// What `/members` answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberList {
    pub members: Vec<MemberRow>,
}

/// What `/gms` answers on a daemon's control socket: the GMS epoch's plan this daemon has
/// adopted (GMS §3.2), for the clients of its machine that evict clean pages (`netram cache`).
/// Node ids are members' ids, found in `/members`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PlanView {
    /// The daemon that answers.
    pub node: u64,
    pub epoch: u64,
    pub initiator: u64,
    /// Replacements the epoch is planned for.
    pub m: u32,
    /// An evicted page at least this old (ms, boosted as global pages' ages are) is dropped.
    pub min_age_ms: u64,
    pub duration_ms: u64,
    /// Since the daemon adopted it (ms).
    pub adopted_ms_ago: u64,
    /// (node, weight): the share of the M replacements each node takes.
    pub weights: Vec<(u64, u32)>,
}

/// What changed, for the runtime to act on (log it, tell clients).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Up(Node),
    Down(Node),
    /// A node restarted or rejoined: `new` supersedes `old`.
    Renamed {
        old: Node,
        new: Node,
    },
    /// This node is known by the cluster.
    Joined,
    /// This node knows no live member any more; it retries its seeds.
    Alone,
}

/// Why a packet was refused (counted by the runtime, one counter per reason).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemberError {
    #[error("the SWIM message does not decode: {0}")]
    Undecodable(String),
    #[error("signed by node {signer} but claims to come from node {claimed}")]
    WrongSender { signer: u64, claimed: u64 },
    #[error("claims to come from the seed placeholder id 0")]
    PlaceholderSender,
    #[error("refused by SWIM: {0}")]
    Refused(String),
}

/// The membership of one node. See the module's documentation.
pub struct Membership {
    foca: Foca<Node, PostcardCodec, SmallRng, foca::NoCustomBroadcast>,
    rt: AccumulatingRuntime<Node>,
    cfg: MemberConfig,
    seeds: Vec<SocketAddr>,
    now_ms: u64,
    /// Timers foca asked for, by (deadline, order asked).
    timers: BTreeMap<(u64, u64), Timer<Node>>,
    timer_seq: u64,
    next_join_ms: u64,
    next_rejoin_ms: u64,
    /// Newest announcement heard from each node id, and when.
    announces: HashMap<u64, (Announce, u64)>,
    sends: Vec<(SocketAddr, Vec<u8>)>,
    events: Vec<Event>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("me", self.foca.identity())
            .field("members", &self.foca.num_members())
            .finish_non_exhaustive()
    }
}

impl Membership {
    /// A node that knows nobody yet; `seed` drives SWIM's random choices.
    pub fn new(me: Node, seed: u64, cfg: MemberConfig, now_ms: u64) -> Self {
        let foca = Foca::new(me, cfg.foca(), SmallRng::seed_from_u64(seed), PostcardCodec);
        let rejoin_ms = cfg.rejoin_every.as_millis() as u64;
        Self {
            foca,
            rt: AccumulatingRuntime::new(),
            cfg,
            seeds: Vec::new(),
            now_ms,
            timers: BTreeMap::new(),
            timer_seq: 0,
            next_join_ms: now_ms,
            next_rejoin_ms: now_ms + rejoin_ms,
            announces: HashMap::new(),
            sends: Vec::new(),
            events: Vec::new(),
        }
    }

    pub fn me(&self) -> Node {
        *self.foca.identity()
    }

    /// The addresses this node has reason to hear from: every member it knows of, at any
    /// liveness, and its seeds (for [`gate::Gate::set_members`]).
    pub fn known_addrs(&self) -> Vec<SocketAddr> {
        let mut v: Vec<SocketAddr> = self
            .foca
            .iter_membership_state()
            .map(|m| m.id().addr)
            .chain(self.seeds.iter().copied())
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Joins through these addresses (other daemons'), now and again whenever this node
    /// knows no live member.
    pub fn join(&mut self, seeds: &[SocketAddr]) {
        let own = self.me().addr;
        self.seeds = seeds.iter().copied().filter(|s| *s != own).collect();
        self.next_join_ms = self.now_ms;
        self.on_tick(self.now_ms);
    }

    /// A packet's SWIM message and its sender's announcement. `sender` is the node id the
    /// packet's signature proves (`None` in a cluster without credentials, loopback only).
    pub fn on_packet(
        &mut self,
        now_ms: u64,
        sender: Option<u64>,
        announce: Announce,
        swim: &[u8],
    ) -> Result<(), MemberError> {
        self.now_ms = self.now_ms.max(now_ms);
        let header: foca::Header<Node> = PostcardCodec
            .decode_header(swim)
            .map_err(|e| MemberError::Undecodable(e.to_string()))?;
        let claimed = header.src.id;
        if claimed == SEED_ID {
            return Err(MemberError::PlaceholderSender);
        }
        if let Some(signer) = sender {
            if signer != claimed {
                return Err(MemberError::WrongSender { signer, claimed });
            }
        }
        // A seed is announced to before its id is known (`join`): foca takes an announcement
        // only if it names this node's id, so the placeholder is replaced by this node. An
        // announcement carries nothing after its header.
        let mut readdressed = Vec::new();
        let swim = if header.message == foca::Message::Announce && header.dst.id == SEED_ID {
            let header = foca::Header {
                dst: self.me(),
                ..header
            };
            PostcardCodec
                .encode_header(&header, &mut readdressed)
                .map_err(|e| MemberError::Undecodable(e.to_string()))?;
            &readdressed[..]
        } else {
            swim
        };
        let r = self
            .foca
            .handle_data(swim, &mut self.rt)
            .map_err(|e| MemberError::Refused(e.to_string()));
        if r.is_ok() {
            let e = self.announces.entry(claimed).or_insert((announce, now_ms));
            if announce.seq >= e.0.seq {
                *e = (announce, now_ms);
            }
        }
        self.pump();
        r
    }

    /// Fires the timers due by `now_ms` and retries the seeds while alone.
    pub fn on_tick(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        while let Some(entry) = self.timers.first_entry() {
            if entry.key().0 > self.now_ms {
                break;
            }
            let timer = entry.remove();
            if self.refuted(&timer) {
                continue;
            }
            if let Err(e) = self.foca.handle_timer(timer, &mut self.rt) {
                // foca refuses only timers of an identity it no longer has: harmless.
                let _ = e;
            }
            self.pump();
        }
        let alone = self.foca.num_members() == 0 && self.now_ms >= self.next_join_ms;
        if alone || self.now_ms >= self.next_rejoin_ms {
            self.next_join_ms = self.now_ms + self.cfg.join_retry.as_millis() as u64;
            self.next_rejoin_ms = self.now_ms + self.cfg.rejoin_every.as_millis() as u64;
            for &addr in &self.seeds {
                let placeholder = Node {
                    id: SEED_ID,
                    addr,
                    boot: 0,
                };
                let _ = self.foca.announce(placeholder, &mut self.rt);
            }
            self.pump();
        }
    }

    /// A suspicion's deadline whose suspect has since refuted it (a higher incarnation) or
    /// is already down. foca (2.0) declines to mark such a member down but still sends it
    /// "you are down" (`notify_down_members`), and the member, believing it, rejoins under a
    /// new boot: its clients would take a live server for a restarted one. So the timer stops
    /// here.
    fn refuted(&self, timer: &Timer<Node>) -> bool {
        let Timer::ChangeSuspectToDown {
            member_id,
            incarnation,
            ..
        } = timer
        else {
            return false;
        };
        !self.foca.iter_membership_state().any(|m| {
            m.id() == member_id
                && m.incarnation() == *incarnation
                && m.state() == foca::State::Suspect
        })
    }

    /// When [`Membership::on_tick`] next has something to do.
    pub fn next_deadline(&self) -> u64 {
        let timer = self.timers.keys().next().map_or(u64::MAX, |k| k.0);
        let timer = if self.seeds.is_empty() {
            timer
        } else {
            timer.min(self.next_rejoin_ms)
        };
        if self.foca.num_members() == 0 && !self.seeds.is_empty() {
            timer.min(self.next_join_ms)
        } else {
            timer
        }
    }

    /// This node's own announcement changed: it goes with every packet from now on (the
    /// runtime puts it in the envelope), and is listed for this node.
    pub fn set_announce(&mut self, a: Announce) {
        let me = self.me().id;
        self.announces.insert(me, (a, self.now_ms));
    }

    /// This node's own announcement.
    pub fn announce(&self) -> Announce {
        self.announces
            .get(&self.me().id)
            .map(|a| a.0)
            .unwrap_or_default()
    }

    /// Leaves the cluster politely: the others learn it at once instead of by suspicion.
    pub fn leave(&mut self) {
        let _ = self.foca.leave_cluster(&mut self.rt);
        self.pump();
    }

    /// SWIM messages to send: (address, bytes for the envelope's `swim`).
    pub fn take_sends(&mut self) -> Vec<(SocketAddr, Vec<u8>)> {
        std::mem::take(&mut self.sends)
    }

    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// Every node this one knows of, itself first, alive ones then suspects then the down
    /// ones it still remembers, each by node id.
    pub fn members(&self) -> Vec<MemberView> {
        let me = self.me();
        let mut out = vec![MemberView {
            node: me,
            liveness: Liveness::Alive,
            announce: self.announces.get(&me.id).copied(),
        }];
        let mut others: Vec<MemberView> = self
            .foca
            .iter_membership_state()
            .map(|m| MemberView {
                node: *m.id(),
                liveness: match m.state() {
                    foca::State::Alive => Liveness::Alive,
                    foca::State::Suspect => Liveness::Suspect,
                    foca::State::Down => Liveness::Down,
                },
                announce: self.announces.get(&m.id().id).copied(),
            })
            .filter(|v| v.node.id != me.id)
            .collect();
        others.sort_by_key(|v| (v.liveness as u8, v.node.id));
        out.extend(others);
        out
    }

    /// [`Membership::members`] as rows to list.
    pub fn rows(&self, now_ms: u64) -> MemberList {
        let me = self.me().id;
        let members = self
            .members()
            .into_iter()
            .map(|v| {
                let (a, heard) = v.announce.unwrap_or_default();
                MemberRow {
                    node: v.node.id,
                    addr: v.node.addr,
                    boot: v.node.boot,
                    state: v.liveness,
                    is_self: v.node.id == me,
                    offered_pages: a.offered_pages,
                    free_pages: a.free_pages,
                    requests_per_s: a.requests_per_s,
                    // This node's own announcement is always current.
                    heard_ms_ago: match v.announce {
                        _ if v.node.id == me => Some(0),
                        Some(_) => Some(now_ms.saturating_sub(heard)),
                        None => None,
                    },
                }
            })
            .collect();
        MemberList { members }
    }

    fn pump(&mut self) {
        while let Some((after, timer)) = self.rt.to_schedule() {
            self.timer_seq += 1;
            let at = self.now_ms + after.as_millis() as u64;
            self.timers.insert((at, self.timer_seq), timer);
        }
        while let Some(n) = self.rt.to_notify() {
            self.events.push(match n {
                Notification::MemberUp(n) => Event::Up(n),
                Notification::MemberDown(n) => Event::Down(n),
                Notification::Rename(old, new) => Event::Renamed { old, new },
                Notification::Active => Event::Joined,
                Notification::Idle | Notification::Defunct => Event::Alone,
                Notification::Rejoin(_) => Event::Joined,
            });
        }
        while let Some((to, bytes)) = self.rt.to_send() {
            self.sends.push((to.addr, bytes.to_vec()));
        }
    }
}
