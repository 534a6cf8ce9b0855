//! A simulated cluster running one of four algorithms over the same workload: the production
//! state machines of `netram_policy::gms` (frames, epochs, the directories, N-chance) on one
//! thread with a virtual clock.
//!
//! Time: every node is a process that thinks for `think_us` between accesses and stalls for a
//! page it lacks (a fetch from another node's memory, or a read of the source). The costs are
//! parameters ([`Costs`]): the paper's (1995's Alphas on a 155 Mb/s ATM network and their
//! disks) or this VM's. Epoch messages travel with a latency; page moves are charged to the
//! node that waits for them. The traffic of every kind of message is counted in bytes.
//!
//! The algorithms (GMS §3, §5.5):
//! - `none`: every node alone; a page it drops is read from the source next time.
//! - `gms`: the four fault cases, epochs, weights and MinAge, the receiving rule.
//! - `nchance`: N-chance forwarding (random targets, duplicates first, N = 2).
//! - `hashed`: what today's data caches do (Alluxio, JuiceFS's distributed cache): every page
//!   has a home node by consistent hashing, whose cache (its idle memory) keeps it by its own
//!   LRU; a node's own evictions are dropped, nothing is forwarded.

use super::workload::{idle_page, NodeSpec, Trace};
use netram_policy::gms::directory::{Gcd, Pod};
use netram_policy::gms::epoch::{DropReason, Epochs, Evict, Out, Params};
use netram_policy::gms::frames::{Accept, Frames, Kind, Meta};
use netram_policy::gms::{nchance, NodeId, Uid};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::time::Instant;

/// The cluster-wide algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Algorithm {
    None,
    Gms,
    NChance,
    Hashed,
}

impl Algorithm {
    pub const ALL: [Algorithm; 4] = [Self::None, Self::Gms, Self::NChance, Self::Hashed];

    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Gms => "gms",
            Self::NChance => "nchance",
            Self::Hashed => "hashed",
        }
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| format!("unknown algorithm {s:?}: none, gms, nchance or hashed"))
    }
}

/// What things cost, in µs of virtual time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Costs {
    /// A page fetched from another node's memory.
    pub remote_us: u64,
    /// A page read from its source (a disk, a network file system).
    pub source_us: u64,
    /// A small message's round trip (a directory look-up on another node).
    pub msg_us: u64,
    /// What sending a page away costs the sender (GMS's putpage "sender latency").
    pub put_us: u64,
}

impl Costs {
    /// GMS Tables 1–3: a getpage hit 1,440 µs (1,558 shared), a shared miss's directory
    /// round trip 340 µs, putpage's sender latency 65 µs, a random disk read 14.3 ms.
    pub fn paper() -> Self {
        Self {
            remote_us: 1_440,
            source_us: 14_300,
            msg_us: 340,
            put_us: 65,
        }
    }
}

/// One run's settings.
#[derive(Debug, Clone)]
pub struct Config {
    pub seed: u64,
    pub algorithm: Algorithm,
    pub nodes: Vec<NodeSpec>,
    pub costs: Costs,
    pub params: Params,
    /// How often every node's epoch state is ticked.
    pub tick_ms: u64,
    /// N-chance: a singlet at least this old may be displaced by a forwarded page.
    pub very_old_ms: u64,
    /// Stop at this virtual time even if nodes have accesses left.
    pub stop_us: Option<u64>,
}

/// One node's figures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeStats {
    pub accesses: u64,
    pub local_hits: u64,
    pub remote_hits: u64,
    pub source_reads: u64,
    /// Time spent waiting for pages.
    pub stall_us: u64,
    /// Time spent thinking plus waiting.
    pub busy_us: u64,
    /// When it made its last access, if it had a number to make.
    pub finished_us: Option<u64>,
    /// Its local pages dropped to take in another node's page.
    pub displaced_local: u64,
    /// Global pages it took in.
    pub received: u64,
}

/// Bytes and messages by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Traffic {
    pub page_msgs: u64,
    pub page_bytes: u64,
    pub directory_msgs: u64,
    pub directory_bytes: u64,
    pub epoch_msgs: u64,
    pub epoch_bytes: u64,
}

impl Traffic {
    pub fn bytes(&self) -> u64 {
        self.page_bytes + self.directory_bytes + self.epoch_bytes
    }
}

/// The epochs' cost (GMS Table 5), summed over the run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EpochCost {
    pub epochs: u64,
    /// CPU time of the initiators' planning (gathering done, weights computed, plans made).
    pub initiator_ns: u64,
    /// CPU time of making summaries (scanning a node's pages), and how many were made.
    pub summary_ns: u64,
    pub summaries: u64,
    /// Bytes into and out of the busiest initiator in one epoch.
    pub initiator_bytes_in_max: u64,
    pub initiator_bytes_out_max: u64,
    /// Plans refused, takeovers, epochs ended early.
    pub plans_refused: u64,
    pub takeovers: u64,
    pub early: u64,
    pub summaries_missing: u64,
}

/// A run's result.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub nodes: Vec<NodeStats>,
    pub traffic: Traffic,
    pub drops: BTreeMap<&'static str, u64>,
    pub forwards: u64,
    pub refused: u64,
    pub epochs: EpochCost,
    pub end_us: u64,
}

impl Outcome {
    pub fn source_reads(&self) -> u64 {
        self.nodes.iter().map(|n| n.source_reads).sum()
    }
}

/// Header of every message (length, kind, request id), bytes.
const HEADER: u64 = 16;
const PAGE: u64 = 4096;
/// A directory request or update: a page id and a node.
const DIRECTORY_MSG: u64 = HEADER + 24;
/// The virtual clock starts an hour in, so idle pages (last used at 0) are an hour old.
const START_US: u64 = 3_600_000_000;

fn out_bytes(o: &Out) -> u64 {
    HEADER
        + match o {
            Out::RequestSummary { .. } | Out::Stale { .. } => 8,
            Out::Summary { summary, .. } => 16 + 5 * summary.ages.nonempty().count() as u64,
            Out::Plan { plan, .. } => 40 + 12 * plan.weights.len() as u64,
        }
}

fn out_to(o: &Out) -> NodeId {
    match o {
        Out::RequestSummary { to, .. }
        | Out::Summary { to, .. }
        | Out::Plan { to, .. }
        | Out::Stale { to, .. } => *to,
    }
}

struct Node {
    spec: NodeSpec,
    frames: Frames,
    epochs: Option<Epochs>,
    trace: Trace,
    rng: fastrand::Rng,
    stats: NodeStats,
    /// Hashed: frames its cache may use (its idle memory).
    cache_cap: usize,
}

struct World<'a> {
    cfg: &'a Config,
    now_us: u64,
    nodes: Vec<Node>,
    members: Vec<NodeId>,
    pod: Pod,
    gcd: Gcd,
    accesses: BinaryHeap<Reverse<(u64, usize)>>,
    msgs: VecDeque<(u64, NodeId, Out)>,
    next_tick_us: u64,
    rng: fastrand::Rng,
    out: Outcome,
    /// Per epoch number: bytes into and out of its initiator.
    initiator_bytes: BTreeMap<u64, (NodeId, u64, u64)>,
    events: u64,
}

fn id(i: usize) -> NodeId {
    i as NodeId + 1
}

fn ix(n: NodeId) -> usize {
    (n - 1) as usize
}

/// Runs one simulation; `Err` names the invariant the run broke.
pub fn run(cfg: &Config) -> Result<Outcome, String> {
    let mut w = World::new(cfg);
    w.play()?;
    w.check()?;
    Ok(w.finish())
}

impl<'a> World<'a> {
    fn new(cfg: &'a Config) -> Self {
        let n = cfg.nodes.len();
        let members: Vec<NodeId> = (0..n).map(id).collect();
        let mut w = World {
            cfg,
            now_us: START_US,
            nodes: Vec::with_capacity(n),
            pod: Pod::new(members.iter().copied()),
            members,
            gcd: Gcd::default(),
            accesses: BinaryHeap::new(),
            msgs: VecDeque::new(),
            next_tick_us: START_US,
            rng: fastrand::Rng::with_seed(cfg.seed),
            out: Outcome::default(),
            initiator_bytes: BTreeMap::new(),
            events: 0,
        };
        for (i, spec) in cfg.nodes.iter().enumerate() {
            let epochs = (cfg.algorithm == Algorithm::Gms)
                .then(|| Epochs::new(id(i), cfg.params.clone(), START_US / 1000));
            w.nodes.push(Node {
                spec: spec.clone(),
                frames: Frames::new(spec.capacity),
                epochs,
                trace: Trace::new(i, spec.pattern),
                rng: fastrand::Rng::with_seed(cfg.seed ^ (i as u64).wrapping_mul(0x9e37_79b9)),
                stats: NodeStats::default(),
                cache_cap: if cfg.algorithm == Algorithm::Hashed {
                    spec.idle_pages.min(spec.capacity)
                } else {
                    0
                },
            });
        }
        for i in 0..n {
            w.fill(i);
            if w.nodes[i].spec.accesses != Some(0)
                && w.nodes[i].spec.pattern != super::workload::Pattern::Idle
            {
                let start = START_US + w.nodes[i].rng.u64(0..1_000);
                w.accesses.push(Reverse((start, i)));
            }
        }
        w
    }

    /// The memory a node starts with: its idle pages (an hour old), then as much of its
    /// working set as fits (just used).
    fn fill(&mut self, i: usize) {
        let algorithm = self.cfg.algorithm;
        let me = id(i);
        let node = &mut self.nodes[i];
        let idle = node.spec.idle_pages.min(node.spec.capacity);
        if algorithm != Algorithm::Hashed {
            // A data cache is given the idle memory empty; the others find it full of old
            // pages, as an operating system's memory always is.
            for p in 0..idle as u64 {
                node.frames.insert_local(idle_page(i, p), 0, false);
                if algorithm != Algorithm::None {
                    self.gcd.add(idle_page(i, p), me, Kind::Local);
                }
            }
        }
        let room = node.spec.capacity - idle;
        let set = node.trace.working_set();
        for (k, &uid) in set.iter().take(room).enumerate() {
            let last_ms = START_US / 1000 - (room - k) as u64 / 16;
            self.nodes[i].frames.insert_local(uid, last_ms, false);
            if matches!(algorithm, Algorithm::Gms | Algorithm::NChance) {
                let others: Vec<NodeId> = self.gcd.holders(&uid).iter().map(|h| h.0).collect();
                if !others.is_empty() {
                    self.nodes[i].frames.set_duplicate(&uid, true);
                    for o in others {
                        self.nodes[ix(o)].frames.set_duplicate(&uid, true);
                    }
                }
                self.gcd.add(uid, me, Kind::Local);
            }
        }
    }

    /// The checks, outside the code under test: no node holds more than its memory; a page
    /// is global on at most one node; for the algorithms with a directory, the directory and
    /// the nodes' frames agree exactly.
    fn check(&self) -> Result<(), String> {
        let mut global_at: std::collections::HashMap<Uid, NodeId> = Default::default();
        let mut held = 0usize;
        for (i, node) in self.nodes.iter().enumerate() {
            let f = &node.frames;
            if f.len() > f.capacity() {
                return Err(format!(
                    "node {} holds {} pages in {} frames",
                    id(i),
                    f.len(),
                    f.capacity()
                ));
            }
            for (uid, kind) in f.pages() {
                held += 1;
                if kind == Kind::Global {
                    if let Some(other) = global_at.insert(uid, id(i)) {
                        return Err(format!(
                            "page {uid:?} is global on nodes {other} and {}",
                            id(i)
                        ));
                    }
                }
                if matches!(self.cfg.algorithm, Algorithm::Gms | Algorithm::NChance)
                    && !self.gcd.holders(&uid).contains(&(id(i), kind))
                {
                    return Err(format!(
                        "node {} holds {uid:?} as {kind:?}; the directory says {:?}",
                        id(i),
                        self.gcd.holders(&uid)
                    ));
                }
            }
        }
        if matches!(self.cfg.algorithm, Algorithm::Gms | Algorithm::NChance) {
            let entries: usize = self.gcd.iter().map(|(_, h)| h.len()).sum();
            if entries != held {
                return Err(format!(
                    "the directory has {entries} entries for {held} pages held"
                ));
            }
        }
        Ok(())
    }

    fn play(&mut self) -> Result<(), String> {
        let gms = self.cfg.algorithm == Algorithm::Gms;
        let limited: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.nodes[i].spec.accesses.is_some())
            .collect();
        assert!(
            !limited.is_empty() || self.cfg.stop_us.is_some(),
            "a run needs a node with a number of accesses or a stop time"
        );
        loop {
            if !limited.is_empty()
                && limited
                    .iter()
                    .all(|&i| self.nodes[i].stats.finished_us.is_some())
            {
                break;
            }
            let next_access = self.accesses.peek().map(|r| r.0 .0);
            let next_msg = self.msgs.front().map(|m| m.0);
            let next_tick = gms.then_some(self.next_tick_us);
            let Some(t) = [next_msg, next_tick, next_access]
                .into_iter()
                .flatten()
                .min()
            else {
                break;
            };
            if self.cfg.stop_us.is_some_and(|s| t >= START_US + s) {
                break;
            }
            self.now_us = t;
            self.events += 1;
            if self.events.is_multiple_of(1_000_000) {
                self.check()?;
            }
            if next_msg == Some(t) {
                let (_, from, msg) = self.msgs.pop_front().expect("peeked");
                self.deliver(from, msg);
            } else if next_tick == Some(t) {
                self.tick();
                self.next_tick_us += self.cfg.tick_ms * 1000;
            } else {
                let Reverse((_, i)) = self.accesses.pop().expect("peeked");
                self.access(i);
            }
        }
        self.out.end_us = self.now_us - START_US;
        Ok(())
    }

    fn send(&mut self, from: NodeId, msgs: Vec<Out>) {
        for m in msgs {
            let bytes = out_bytes(&m);
            self.out.traffic.epoch_msgs += 1;
            self.out.traffic.epoch_bytes += bytes;
            // Table 5's traffic at the initiator: it sends the requests and the plans, and
            // the summaries come to it.
            let (epoch, initiator) = match &m {
                Out::RequestSummary { epoch, .. }
                | Out::Plan {
                    plan: netram_policy::gms::epoch::Plan { epoch, .. },
                    ..
                } => (*epoch, from),
                Out::Summary { epoch, to, .. } => (*epoch, *to),
                Out::Stale { .. } => (0, 0),
            };
            if initiator != 0 {
                let e = self
                    .initiator_bytes
                    .entry(epoch)
                    .or_insert((initiator, 0, 0));
                if e.0 == initiator {
                    if from == initiator {
                        e.2 += bytes;
                    } else {
                        e.1 += bytes;
                    }
                }
            }
            self.msgs
                .push_back((self.now_us + self.cfg.costs.msg_us / 2, from, m));
        }
    }

    fn deliver(&mut self, from: NodeId, msg: Out) {
        let to = out_to(&msg);
        let now_ms = self.now_us / 1000;
        let mut out = Vec::new();
        let node = &mut self.nodes[ix(to)];
        let Some(epochs) = node.epochs.as_mut() else {
            return;
        };
        match msg {
            Out::RequestSummary { epoch, .. } => {
                let frames = &node.frames;
                let cost = &mut self.out.epochs;
                epochs.on_request(
                    from,
                    epoch,
                    |ev, d| {
                        let t = Instant::now();
                        let s = frames.summary(to, now_ms, ev, d);
                        cost.summary_ns += t.elapsed().as_nanos() as u64;
                        cost.summaries += 1;
                        s
                    },
                    &mut out,
                );
            }
            Out::Summary { epoch, summary, .. } => epochs.on_summary(from, epoch, *summary),
            Out::Plan { plan, .. } => {
                if epochs.on_plan(from, plan, now_ms).is_err() {
                    self.out.epochs.plans_refused += 1;
                }
            }
            Out::Stale { epoch, .. } => epochs.on_stale(epoch),
        }
        self.send(to, out);
    }

    fn tick(&mut self) {
        let now_ms = self.now_us / 1000;
        for i in 0..self.nodes.len() {
            let me = id(i);
            let node = &mut self.nodes[i];
            let Some(epochs) = node.epochs.as_mut() else {
                continue;
            };
            let frames = &node.frames;
            let cost = &mut self.out.epochs;
            let mut out = Vec::new();
            let t = Instant::now();
            let mut scan_ns = 0u64;
            epochs.on_tick(
                now_ms,
                &self.members,
                |ev, d| {
                    let t = Instant::now();
                    let s = frames.summary(me, now_ms, ev, d);
                    scan_ns = t.elapsed().as_nanos() as u64;
                    s
                },
                &mut out,
            );
            if scan_ns > 0 {
                cost.summary_ns += scan_ns;
                cost.summaries += 1;
            }
            if out.iter().any(|o| matches!(o, Out::Plan { .. })) {
                // The tick that finished gathering: merging the summaries, the weights and
                // MinAge, and a copy of the plan for every member (the messages it sends).
                cost.initiator_ns += t.elapsed().as_nanos() as u64;
            }
            if !out.is_empty() {
                self.send(me, out);
            }
        }
    }

    fn access(&mut self, i: usize) {
        let now_ms = self.now_us / 1000;
        let Some(uid) = ({
            let node = &mut self.nodes[i];
            node.trace.next(&mut node.rng)
        }) else {
            return;
        };
        self.nodes[i].stats.accesses += 1;
        let hashed = self.cfg.algorithm == Algorithm::Hashed;
        let hit = {
            let f = &mut self.nodes[i].frames;
            if hashed && f.kind(&uid) == Some(Kind::Global) {
                f.touch_global(uid, now_ms)
            } else {
                f.touch(uid, now_ms)
            }
        };
        let stall = if hit {
            self.nodes[i].stats.local_hits += 1;
            0
        } else {
            self.fault(i, uid)
        };
        let node = &mut self.nodes[i];
        node.stats.stall_us += stall;
        node.stats.busy_us += stall + node.spec.think_us;
        let next = self.now_us + stall + node.spec.think_us.max(1);
        if node.spec.accesses == Some(node.stats.accesses) {
            node.stats.finished_us = Some(next - START_US);
        } else {
            self.accesses.push(Reverse((next, i)));
        }
    }

    /// Where a page's directory entry lives: an own (private) page's with its owner, as GMS
    /// keeps non-shared pages' entries on the node using them (§4.1); a shared page's where
    /// the POD says.
    fn dir_home(&self, uid: Uid) -> NodeId {
        match (uid.0 >> 64) as u64 {
            0 => self.pod.home(uid).expect("members"),
            owner => owner,
        }
    }

    fn dir_msg(&mut self, actor: NodeId, uid: Uid) {
        if self.dir_home(uid) != actor {
            self.out.traffic.directory_msgs += 1;
            self.out.traffic.directory_bytes += DIRECTORY_MSG;
        }
    }

    fn page_msg(&mut self) {
        self.out.traffic.page_msgs += 1;
        self.out.traffic.page_bytes += HEADER + 24 + PAGE;
    }

    /// A page node `i` lacks: fetched from the cluster or read from its source, after room is
    /// made. Returns the time the node waits.
    fn fault(&mut self, i: usize, uid: Uid) -> u64 {
        let me = id(i);
        let now_ms = self.now_us / 1000;
        let c = self.cfg.costs.clone();
        let mut cost = 0;
        match self.cfg.algorithm {
            Algorithm::None => {
                self.nodes[i].stats.source_reads += 1;
                cost += c.source_us;
                while self.nodes[i].frames.free() == 0 {
                    self.nodes[i].frames.pop_oldest(now_ms);
                    self.drop_counted("no cluster");
                }
                self.nodes[i].frames.insert_local(uid, now_ms, false);
            }
            Algorithm::Gms | Algorithm::NChance => {
                let remote_dir = self.dir_home(uid) != me;
                if remote_dir {
                    // The request goes to the directory's node (and on to the holder).
                    self.out.traffic.directory_msgs += 1;
                    self.out.traffic.directory_bytes += DIRECTORY_MSG;
                }
                let holders: Vec<(NodeId, Kind)> = self
                    .gcd
                    .holders(&uid)
                    .iter()
                    .copied()
                    .filter(|h| h.0 != me)
                    .collect();
                let mut duplicate = false;
                if let Some(&(q, _)) = holders.iter().find(|h| h.1 == Kind::Global) {
                    // Cases 1 and 2: the page moves out of q's global memory.
                    self.nodes[ix(q)].frames.remove(&uid);
                    self.gcd.remove(&uid, q);
                    self.nodes[i].stats.remote_hits += 1;
                    self.page_msg();
                    cost += c.remote_us + if remote_dir { c.msg_us / 2 } else { 0 };
                } else if let Some(&(q, _)) = holders.first() {
                    // Case 4: a copy of a page in q's local memory; both are duplicates now.
                    self.nodes[ix(q)].frames.set_duplicate(&uid, true);
                    duplicate = true;
                    self.nodes[i].stats.remote_hits += 1;
                    self.page_msg();
                    cost += c.remote_us + if remote_dir { c.msg_us / 2 } else { 0 };
                } else {
                    // Case 3: from the source (after the directory said nobody has it).
                    if remote_dir {
                        self.out.traffic.directory_msgs += 1;
                        self.out.traffic.directory_bytes += DIRECTORY_MSG;
                        cost += c.msg_us;
                    }
                    self.nodes[i].stats.source_reads += 1;
                    cost += c.source_us;
                }
                while self.nodes[i].frames.free() == 0 {
                    cost += self.evict(i);
                }
                self.nodes[i].frames.insert_local(uid, now_ms, duplicate);
                self.gcd.add(uid, me, Kind::Local);
            }
            Algorithm::Hashed => {
                let home = self.pod.home(uid).expect("members");
                let h = ix(home);
                let cached = home != me
                    && self.nodes[h].frames.kind(&uid) == Some(Kind::Global)
                    && self.nodes[h].frames.touch_global(uid, now_ms);
                if cached {
                    self.nodes[i].stats.remote_hits += 1;
                    self.page_msg();
                    cost += c.remote_us;
                } else {
                    self.nodes[i].stats.source_reads += 1;
                    cost += c.source_us;
                    if home != me && self.nodes[h].cache_cap > 0 {
                        // The reader fills the home's cache (a write-through of the page).
                        self.page_msg();
                        let cap = self.nodes[h].cache_cap;
                        let f = &mut self.nodes[h].frames;
                        while (f.global_len() >= cap || f.free() == 0)
                            && f.pop_oldest_of(Kind::Global).is_some()
                        {}
                        let f = &mut self.nodes[h].frames;
                        if f.free() > 0 && f.kind(&uid).is_none() {
                            f.insert_global(
                                uid,
                                Meta {
                                    last_ms: now_ms,
                                    duplicate: false,
                                    chances: 0,
                                },
                            );
                        }
                    }
                }
                // The reader's own memory: its local share only; what leaves it is dropped.
                let local_cap = (self.nodes[i].spec.capacity - self.nodes[i].cache_cap).max(1);
                let f = &mut self.nodes[i].frames;
                let mut dropped = 0;
                while f.local_len() >= local_cap && f.pop_oldest_of(Kind::Local).is_some() {
                    dropped += 1;
                }
                while f.free() == 0 && f.pop_oldest_of(Kind::Global).is_some() {
                    dropped += 1;
                }
                if f.kind(&uid).is_none() {
                    f.insert_local(uid, now_ms, false);
                }
                for _ in 0..dropped {
                    self.drop_counted("hashed: local eviction");
                }
            }
        }
        cost
    }

    fn drop_counted(&mut self, why: &'static str) {
        *self.out.drops.entry(why).or_default() += 1;
    }

    /// Node `i` frees a frame by its algorithm's rule; returns what that costs it.
    fn evict(&mut self, i: usize) -> u64 {
        let me = id(i);
        let now_ms = self.now_us / 1000;
        let Some((v, kind, meta, age)) = self.nodes[i].frames.pop_oldest(now_ms) else {
            return 0;
        };
        self.gcd.remove(&v, me);
        self.dir_msg(me, v);
        let duplicate = self.gcd.holders(&v).iter().any(|h| h.1 == Kind::Local);
        match self.cfg.algorithm {
            Algorithm::Gms => {
                let node = &mut self.nodes[i];
                let epochs = node.epochs.as_mut().expect("gms nodes have epochs");
                epochs.on_evicted();
                let decision = epochs.plan().evict(me, age, duplicate, &mut node.rng);
                match decision {
                    Evict::Drop(r) => {
                        epochs.on_discarded();
                        self.drop_counted(match r {
                            DropReason::Duplicate => "duplicate",
                            DropReason::NoIdleMemory => "no idle memory",
                            DropReason::Old => "older than MinAge",
                            DropReason::NoOtherNode => "no other node",
                        });
                        0
                    }
                    Evict::Forward(to) => {
                        self.forward_gms(me, to, v, meta);
                        self.cfg.costs.put_us
                    }
                }
            }
            Algorithm::NChance => match nchance::on_evict(kind, &meta, duplicate) {
                None => {
                    self.drop_counted("nchance: duplicate or out of chances");
                    0
                }
                Some(chances) => {
                    self.forward_nchance(me, v, meta, chances);
                    self.cfg.costs.put_us
                }
            },
            Algorithm::None | Algorithm::Hashed => 0,
        }
    }

    fn forward_gms(&mut self, from: NodeId, to: NodeId, v: Uid, meta: Meta) {
        let now_ms = self.now_us / 1000;
        self.out.forwards += 1;
        self.page_msg();
        let t = ix(to);
        let incoming = Meta {
            duplicate: false,
            chances: 0,
            ..meta
        };
        match self.nodes[t].frames.accept_global(v, incoming, now_ms) {
            Accept::Present => {}
            Accept::Refused => {
                // The sender drops it: it leaves the cluster.
                self.out.refused += 1;
                self.drop_counted("refused by its target");
                if let Some(e) = self.nodes[ix(from)].epochs.as_mut() {
                    e.on_discarded();
                }
                let mut out = Vec::new();
                if let Some(e) = self.nodes[t].epochs.as_mut() {
                    e.report_stale(&mut out);
                }
                self.send(to, out);
            }
            taken => {
                self.gcd.add(v, to, Kind::Global);
                self.dir_msg(from, v);
                self.nodes[t].stats.received += 1;
                if let Some(e) = self.nodes[t].epochs.as_mut() {
                    e.on_received();
                }
                if let Accept::Replaced(x, kind) = taken {
                    // The target's oldest page left for it: dropped (it is clean).
                    if let Some(e) = self.nodes[t].epochs.as_mut() {
                        e.on_discarded();
                    }
                    self.gcd.remove(&x, to);
                    self.dir_msg(to, x);
                    if kind == Kind::Local {
                        self.nodes[t].stats.displaced_local += 1;
                    }
                }
            }
        }
    }

    fn forward_nchance(&mut self, from: NodeId, v: Uid, meta: Meta, chances: u8) {
        let now_ms = self.now_us / 1000;
        let mut sender = from;
        let mut chances = chances;
        loop {
            let Some(to) = ({
                let rng = &mut self.rng;
                nchance::target(sender, &self.members, rng)
            }) else {
                self.drop_counted("nchance: no other node");
                return;
            };
            self.out.forwards += 1;
            self.page_msg();
            let incoming = Meta {
                duplicate: false,
                chances,
                ..meta
            };
            let t = ix(to);
            match nchance::arrive(
                &mut self.nodes[t].frames,
                v,
                incoming,
                now_ms,
                self.cfg.very_old_ms,
            ) {
                nchance::Arrive::Taken(victim) => {
                    self.gcd.add(v, to, Kind::Global);
                    self.dir_msg(sender, v);
                    self.nodes[t].stats.received += 1;
                    if let Some((x, kind)) = victim {
                        self.gcd.remove(&x, to);
                        self.dir_msg(to, x);
                        if kind == Kind::Local {
                            self.nodes[t].stats.displaced_local += 1;
                        }
                    }
                    return;
                }
                nchance::Arrive::Pass(c) => {
                    chances = c;
                    sender = to;
                }
                nchance::Arrive::Drop => {
                    self.drop_counted("nchance: duplicate or out of chances");
                    return;
                }
            }
        }
    }

    fn finish(mut self) -> Outcome {
        for n in &self.nodes {
            self.out.nodes.push(n.stats.clone());
            if let Some(e) = &n.epochs {
                self.out.epochs.epochs = self.out.epochs.epochs.max(e.plan().epoch);
                self.out.epochs.takeovers += e.stats.takeovers;
                self.out.epochs.early += e.stats.epochs_started_early;
                self.out.epochs.summaries_missing += e.stats.summaries_missing;
            }
        }
        for &(_, inb, outb) in self.initiator_bytes.values() {
            self.out.epochs.initiator_bytes_in_max =
                self.out.epochs.initiator_bytes_in_max.max(inb);
            self.out.epochs.initiator_bytes_out_max =
                self.out.epochs.initiator_bytes_out_max.max(outb);
        }
        self.out
    }
}
