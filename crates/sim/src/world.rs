//! The simulated cluster: page servers running the real store and request logic
//! (`netram_store::serve`), connections between clients and servers, and a network that delays,
//! loses, duplicates and reorders messages, partitions, and crashes and restarts servers, all
//! driven by one seeded random generator and one virtual clock.
//!
//! A connection behaves like TCP: requests arrive in the order they were sent; a message lost
//! for good leaves the connection silent (the client times out); a reset is seen at the next
//! send or receive. Replies may arrive in any order (the pager's transport contract allows it).
//! A duplicated reply is a lying peer: the pager must survive it.
//!
//! Servers talk to each other too: an overwrite or delete of a parity member waits while its
//! server sends the delta to the group's holder (`netram_store::serve`'s forward, which the
//! daemon carries over `netram_server::peers`). Those messages are delayed like any other; a lost
//! one costs the sender its reply timeout and a second try (deltas are safe to repeat); a holder
//! that is down answers nothing and the sender reports it unreachable. Frames that reach a
//! connection while it waits for holders wait behind it, as on the daemon's connection thread.

use netram_member::{Announce, MemberConfig, Membership, Node};
use netram_pager::{ServerInfo, TransportError};
use netram_proto::{
    decode_reply, decode_request, DeltaStatus, GetResult, MoveStatus, Reply, PAGE_SIZE,
};
use netram_store::serve::{self, DeltaOutcome, Forward, Outcome};
use netram_store::{DeltaFrom, Peer, SessionHandle, Store, StoreConfig};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::net::SocketAddr;

/// Virtual time, in microseconds.
pub type Micros = u64;

pub const LEASE_PERIOD_MS: u64 = 2_000;
/// Credits each server announces.
pub const WINDOW: u32 = 8;
/// How long a server waits for a parity holder's answer before it tries again: well inside
/// the clients' reply timeout, as the daemon's `peers` timeout is inside its clients'.
pub const PEER_TIMEOUT_US: Micros = 300_000;

/// How often each server's membership is ticked and its announcement brought up to date.
pub const MEMBER_TICK_US: Micros = 50_000;

/// A simulated server's node id, as a certificate would name it (members of parity groups
/// name their servers by it, and holders check the senders of deltas against it).
pub fn server_node(server: usize) -> u64 {
    server as u64 + 1
}

/// The address clients and servers know server `i` by.
pub fn server_addr(i: usize) -> SocketAddr {
    SocketAddr::from(([10, 0, (i >> 8) as u8, i as u8 + 1], 7077))
}

/// Which faults the network and the servers inject, and how often (per message or per step).
#[derive(Debug, Clone)]
pub struct Faults {
    /// One-way delay of a message: uniform in this range.
    pub delay_us: (Micros, Micros),
    /// Probability that a message is lost for good (its connection falls silent).
    pub lose: f64,
    /// Probability that a message's connection is reset.
    pub reset: f64,
    /// Probability that a reply is delivered twice.
    pub duplicate: f64,
    /// Probability that a bit of a page in a GET reply is flipped.
    pub bit_flip: f64,
    /// Server crashes over a run, at most (the scenario keeps within what the scheme tolerates
    /// where it checks that no page is lost).
    pub crashes: u32,
    /// Partitions between one client and one server, per step.
    pub partition: f64,
    /// A server that becomes ten times slower for a while, per step.
    pub slow: f64,
    /// Probability that a holder applies the deltas a server forwards but its answer is lost
    /// on every try (the daemon's peers try twice): the server reports the holder unreachable
    /// and the client cannot tell whether the group changed.
    pub unanswered: f64,
    /// Probability that a reply is replaced by a hostile one: a bit flipped anywhere in the
    /// frame (header, key, version, status), cut short, another request's id, or garbage.
    pub hostile: f64,
    /// Probability that a client's local disk fails a write (never two in a row; a failed
    /// write may tear the page's old contents).
    pub disk_write: f64,
    /// Probability per step that a server's offer moves (`netram serve --adapt`: its machine
    /// wants memory back, or has room again) to a random part of its arena: new pages go
    /// elsewhere, pages above the offer stay readable.
    pub offer: f64,
    /// Probability per step that a server's membership packets are lost, both ways, for
    /// 2–8 s while its clients still reach it: the others declare it down while it is up
    /// (SWIM's false positive); clients probe it and keep it.
    pub gossip_cut: f64,
    /// Probability per step that the daemons' membership lies to the clients: a live server
    /// declared down; and, whenever it is above zero, half the real deaths are not told.
    /// Clients act only on their own evidence.
    pub membership_lie: f64,
}

impl Faults {
    /// Nothing goes wrong: only delays and reordering.
    pub fn none() -> Self {
        Self {
            delay_us: (20, 200),
            lose: 0.0,
            reset: 0.0,
            duplicate: 0.0,
            bit_flip: 0.0,
            crashes: 0,
            partition: 0.0,
            slow: 0.0,
            unanswered: 0.0,
            hostile: 0.0,
            disk_write: 0.0,
            offer: 0.0,
            gossip_cut: 0.0,
            membership_lie: 0.0,
        }
    }

    /// Every kind of fault, at rates that make several of each likely in a default run.
    pub fn all() -> Self {
        Self {
            delay_us: (20, 2_000),
            lose: 0.000_5,
            reset: 0.000_5,
            duplicate: 0.000_3,
            bit_flip: 0.002,
            crashes: 2,
            partition: 0.002,
            slow: 0.005,
            unanswered: 0.01,
            hostile: 0.000_5,
            disk_write: 0.02,
            offer: 0.003,
            gossip_cut: 0.000_5,
            membership_lie: 0.001,
        }
    }
}

#[derive(Debug)]
pub struct SimServer {
    pub store: Store<Vec<u8>>,
    /// Incremented at every restart: a restarted server is a new machine with empty RAM.
    pub incarnation: u64,
    pub up: bool,
    /// Service time multiplier (a slow node).
    pub slow: u64,
    slow_until: Micros,
    capacity_pages: usize,
}

impl SimServer {
    fn new(capacity_pages: usize) -> Self {
        Self {
            store: new_store(capacity_pages),
            incarnation: 1,
            up: true,
            slow: 1,
            slow_until: 0,
            capacity_pages,
        }
    }
}

fn new_store(pages: usize) -> Store<Vec<u8>> {
    Store::new(
        vec![0u8; pages * PAGE_SIZE],
        StoreConfig {
            lease_period_ms: LEASE_PERIOD_MS,
            max_sessions: 64,
            ..StoreConfig::default()
        },
    )
}

/// One client's connection (and session) to one server.
#[derive(Debug)]
pub struct Conn {
    pub client: usize,
    pub server: usize,
    pub session: SessionHandle,
    /// The server's incarnation when the connection opened.
    pub incarnation: u64,
    /// Reset: the client sees an error at its next send or receive.
    pub reset: bool,
    /// A message was lost for good: nothing more arrives either way.
    pub silent: bool,
    pub closed: bool,
    /// A hostile reply that still decodes went out on it (a flipped status, another request's
    /// id): the client may believe a PUT stored that was not, or not stored that was, until it
    /// drops the connection. Garbage and truncated frames it refuses are not lies it believes.
    pub lied: bool,
    /// Replies waiting for the client, each with whether it is faulty (counted when taken).
    inbox: Vec<(Vec<u8>, bool)>,
    /// When the last request reaches the server: later ones arrive after it (TCP's order).
    last_arrival: Micros,
    /// A request waiting for parity holders, and the frames that arrived behind it.
    forward: Option<Box<Waiting>>,
    queued: VecDeque<Vec<u8>>,
}

/// A request of a connection whose deltas are on their way to holders.
#[derive(Debug)]
struct Waiting {
    fwd: Forward,
    outcomes: Vec<Option<DeltaOutcome>>,
}

impl Conn {
    /// Whether messages still flow on this connection to the server that opened it.
    pub fn working(&self) -> bool {
        !self.reset && !self.silent && !self.closed
    }
}

#[derive(Debug)]
enum Event {
    Request {
        conn: usize,
        frame: Vec<u8>,
    },
    /// `faulty`: a duplicate or a flipped bit, which counts against the client once delivered.
    Reply {
        conn: usize,
        frame: Vec<u8>,
        faulty: bool,
    },
    Restart {
        server: usize,
    },
    /// Deltas `idx` of the request waiting on `conn` reach `holder`.
    Delta {
        conn: usize,
        holder: usize,
        idx: Vec<usize>,
    },
    /// The holder's answers reach the connection's server.
    DeltaAnswer {
        conn: usize,
        answers: Vec<(usize, DeltaOutcome)>,
    },
    Heal {
        client: usize,
        server: usize,
    },
    /// The clients' keepalive (every half lease period) and the servers' lease reaper.
    Tick,
    /// A membership packet (SWIM and its sender's announcement) reaches server `to`.
    Gossip {
        to: usize,
        from: usize,
        announce: Announce,
        bytes: Vec<u8>,
    },
    /// Every server's membership timers.
    MemberTick,
}

#[derive(Debug)]
struct Scheduled {
    at: Micros,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

/// Faults that touched a client's view of a server, so that checkers know what may be lost.
#[derive(Debug, Default, Clone, Copy)]
pub struct FaultLog {
    pub crashes: u32,
    pub resets: u32,
    pub losses: u32,
    pub duplicates: u32,
    pub bit_flips: u32,
    pub partitions: u32,
    pub slowdowns: u32,
    /// Times a server's offer moved.
    pub offer_moves: u32,
    /// Pages the clients moved off servers whose offer shrank, and of those, to their disk.
    pub pages_migrated: u64,
    pub pages_migrated_to_disk: u64,
    /// ... and of them, server to server (Nswap's MIGRATE).
    pub pages_migrated_direct: u64,
    pub unanswered: u32,
    pub hostile: u32,
    /// Members some server's membership declared down, and of those, the ones that were up
    /// (that boot of the server still running: SWIM's false positives).
    pub members_declared_down: u32,
    pub members_declared_down_alive: u32,
    /// Servers a client found dead by the probe it made when membership declared them down.
    pub members_failed_by_clients: u32,
    /// Lies membership told the clients (a live server declared down, a death withheld).
    pub membership_lies: u32,
    /// Times a server's membership packets were lost for a while.
    pub gossip_cuts: u32,
}

/// The whole simulated cluster.
#[derive(Debug)]
pub struct World {
    pub now: Micros,
    pub rng: fastrand::Rng,
    pub faults: Faults,
    pub servers: Vec<SimServer>,
    pub conns: Vec<Conn>,
    /// `partitioned[client][server]`.
    partitioned: Vec<Vec<bool>>,
    /// When each partition heals: TCP delivers what was sent across it then (retransmission),
    /// unless the client gave up first.
    heals_at: Vec<Vec<Micros>>,
    /// `touched[client][server]`: faults that may have cost this client its copies there.
    pub touched: Vec<Vec<bool>>,
    pub log: FaultLog,
    events: BinaryHeap<Reverse<Scheduled>>,
    seq: u64,
    next_session: u64,
    /// A frame the code under test sent that does not decode: a bug, reported by the checker.
    pub bad_frames: Vec<String>,
    /// Print every fault and message (`netram sim --trace`).
    pub trace: bool,
    /// Each server's membership (SWIM, `netram_member`), `None` while it is down.
    members: Vec<Option<Membership>>,
    /// Members declared down, (server, boot), not yet taken by the scenario.
    declared_down: Vec<(usize, u64)>,
    /// Until when each server's membership packets are lost (`Faults::gossip_cut`).
    gossip_cut_until: Vec<Micros>,
}

impl World {
    pub fn new(seed: u64, servers: &[usize], clients: usize, faults: Faults) -> Self {
        let mut w = Self {
            now: 0,
            rng: fastrand::Rng::with_seed(seed),
            faults,
            servers: servers.iter().map(|&c| SimServer::new(c)).collect(),
            conns: Vec::new(),
            partitioned: vec![vec![false; servers.len()]; clients],
            heals_at: vec![vec![0; servers.len()]; clients],
            touched: vec![vec![false; servers.len()]; clients],
            log: FaultLog::default(),
            events: BinaryHeap::new(),
            seq: 0,
            next_session: 1,
            bad_frames: Vec::new(),
            trace: false,
            members: Vec::new(),
            declared_down: Vec::new(),
            gossip_cut_until: vec![0; servers.len()],
        };
        w.schedule(LEASE_PERIOD_MS * 500, Event::Tick);
        w.members = (0..servers.len()).map(|_| None).collect();
        for i in 0..servers.len() {
            w.start_member(i);
        }
        w.schedule(MEMBER_TICK_US, Event::MemberTick);
        w
    }

    /// The boot incarnation server `i`'s membership identity carries: a restart is a new
    /// boot, far above what renewals after a false death (+1 each) reach.
    pub fn boot(&self, i: usize) -> u64 {
        (self.servers[i].incarnation + 1) << 20
    }

    /// Server `i`'s membership, new (at start and after a restart): it joins through servers
    /// 0 and 1, as a daemon through its seed list.
    fn start_member(&mut self, i: usize) {
        let me = Node {
            id: server_node(i),
            addr: server_addr(i),
            boot: self.boot(i),
        };
        let mut m = Membership::new(
            me,
            self.rng.u64(..),
            MemberConfig::default(),
            self.now / 1000,
        );
        let seeds: Vec<SocketAddr> = (0..self.servers.len().min(2)).map(server_addr).collect();
        m.join(&seeds);
        self.members[i] = Some(m);
        self.member_flush(i);
    }

    /// Sends what server `i`'s membership asked for, over the faulty network, and takes note of
    /// members it declared down.
    fn member_flush(&mut self, i: usize) {
        let Some(m) = self.members[i].as_mut() else {
            return;
        };
        let (sends, events, announce) = (m.take_sends(), m.take_events(), m.announce());
        for (addr, bytes) in sends {
            let Some(to) = (0..self.servers.len()).find(|&j| server_addr(j) == addr) else {
                continue;
            };
            let cut = self.gossip_cut_until[i].max(self.gossip_cut_until[to]) > self.now;
            if cut || self.chance(self.faults.lose) {
                continue;
            }
            let d = self.delay();
            self.schedule(
                d,
                Event::Gossip {
                    to,
                    from: i,
                    announce,
                    bytes,
                },
            );
        }
        for e in events {
            if let netram_member::Event::Down(n) = e {
                let s = (n.id - 1) as usize;
                if s >= self.servers.len() {
                    continue;
                }
                self.log.members_declared_down += 1;
                if self.servers[s].up && self.boot(s) == n.boot {
                    self.log.members_declared_down_alive += 1;
                }
                self.note(format_args!(
                    "server {i}'s membership declares server {s} down"
                ));
                self.declared_down.push((s, n.boot));
            }
        }
    }

    /// Loses server `i`'s membership packets, both ways, for `d`.
    pub fn cut_gossip(&mut self, i: usize, d: Micros) {
        self.gossip_cut_until[i] = self.now + d;
        self.log.gossip_cuts += 1;
        self.note(format_args!(
            "server {i}'s membership packets are lost for {d} us"
        ));
    }

    /// Members declared down since the last call: (server, boot).
    pub fn take_declared_down(&mut self) -> Vec<(usize, u64)> {
        std::mem::take(&mut self.declared_down)
    }

    /// Every server that is up lists exactly the servers that are up as alive (or suspect),
    /// each at its current boot: membership has converged.
    pub fn membership_agrees(&self) -> Result<(), String> {
        let up: Vec<(u64, u64)> = (0..self.servers.len())
            .filter(|&j| self.servers[j].up)
            .map(|j| (server_node(j), self.boot(j)))
            .collect();
        for (i, m) in self.members.iter().enumerate() {
            let Some(m) = m else { continue };
            let mut seen: Vec<(u64, u64)> = m
                .members()
                .iter()
                .filter(|v| v.liveness != netram_member::Liveness::Down)
                .map(|v| (v.node.id, v.node.boot - v.node.boot % (1 << 20)))
                .collect();
            seen.sort_unstable();
            if seen != up {
                return Err(format!(
                    "membership: server {i} believes {seen:?} alive, but {up:?} are up"
                ));
            }
        }
        Ok(())
    }

    fn schedule(&mut self, after: Micros, event: Event) {
        self.seq += 1;
        self.events.push(Reverse(Scheduled {
            at: self.now + after,
            seq: self.seq,
            event,
        }));
    }

    fn delay(&mut self) -> Micros {
        let (lo, hi) = self.faults.delay_us;
        self.rng.u64(lo..=hi)
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.f64() < p
    }

    pub(crate) fn note(&self, what: std::fmt::Arguments<'_>) {
        if self.trace {
            eprintln!("[{:>10.3} ms] {what}", self.now as f64 / 1000.0);
        }
    }

    fn touch(&mut self, client: usize, server: usize) {
        self.note(format_args!(
            "fault touches client {client} / server {server}"
        ));
        self.touched[client][server] = true;
    }

    /// The client's failures are behind it (its pages are whole again, by the checker): only
    /// servers it still cannot reach count against its redundancy from now on.
    /// `conns` are the client's current connections, by server; `alive`, whether the client
    /// still counts on each server.
    pub fn forgive(&mut self, client: usize, conns: &[Option<usize>], alive: &[bool]) {
        for server in 0..self.servers.len() {
            let reachable = alive[server]
                && !self.partitioned[client][server]
                && conns[server].is_some_and(|c| self.inspectable(c));
            if reachable {
                self.touched[client][server] = false;
            }
        }
    }

    /// Opens a connection: the handshake, which takes a round trip. Fails like a real connect
    /// when the server is down or unreachable.
    pub fn connect(&mut self, client: usize, server: usize) -> Result<(usize, ServerInfo), String> {
        let rtt = self.delay() + self.delay();
        self.run_for(rtt);
        if !self.servers[server].up {
            return Err("connection refused: the server is down".into());
        }
        if self.partitioned[client][server] {
            return Err("connect timed out: partitioned".into());
        }
        let session_id = self.next_session;
        self.next_session += 1;
        let now_ms = self.now / 1000;
        let s = &mut self.servers[server];
        let session = s
            .store
            .open_session(client as u64 + 1, 1, session_id, now_ms)
            .map_err(|e| format!("handshake refused: {e}"))?;
        let info = ServerInfo {
            name: format!("sim{server}"),
            addr: Some(server_addr(server)),
            node: server_node(server),
            window: WINDOW,
            capacity_pages: s.store.capacity_pages(),
            free_pages: s.store.free_pages(),
            connected: Ok(()),
        };
        self.conns.push(Conn {
            client,
            server,
            session,
            incarnation: s.incarnation,
            reset: false,
            silent: false,
            closed: false,
            lied: false,
            inbox: Vec::new(),
            last_arrival: self.now,
            forward: None,
            queued: VecDeque::new(),
        });
        Ok((self.conns.len() - 1, info))
    }

    /// A client sends a frame on a connection.
    pub fn send(&mut self, conn: usize, frame: Vec<u8>) -> Result<(), TransportError> {
        let (client, server) = (self.conns[conn].client, self.conns[conn].server);
        if self.conns[conn].reset {
            return Err(TransportError::Disconnected(
                "connection reset by peer".into(),
            ));
        }
        if self.conns[conn].closed {
            return Err(TransportError::Disconnected("connection closed".into()));
        }
        if self.chance(self.faults.reset) {
            self.conns[conn].reset = true;
            self.log.resets += 1;
            self.touch(client, server);
            return Err(TransportError::Disconnected(
                "connection reset by peer".into(),
            ));
        }
        if self.chance(self.faults.lose) {
            self.conns[conn].silent = true;
            self.log.losses += 1;
            self.touch(client, server);
        }
        if self.conns[conn].silent {
            // Lost for good: the client times out.
            self.note(format_args!("client {client} -> server {server}: lost"));
            return Ok(());
        }
        self.note(format_args!(
            "client {client} -> server {server} (conn {conn}): {} bytes",
            frame.len()
        ));
        let mut at = (self.now + self.delay()).max(self.conns[conn].last_arrival);
        if self.partitioned[client][server] {
            // Retransmitted once the partition heals.
            at = at.max(self.heals_at[client][server] + self.delay());
        }
        self.conns[conn].last_arrival = at;
        self.schedule(at - self.now, Event::Request { conn, frame });
        Ok(())
    }

    /// The next reply waiting on a connection (any of them, when replies are reordered).
    pub fn take_reply(&mut self, conn: usize) -> Option<Vec<u8>> {
        let inbox = &mut self.conns[conn].inbox;
        if inbox.is_empty() {
            return None;
        }
        let i = self.rng.usize(0..inbox.len());
        let (frame, faulty) = inbox.swap_remove(i);
        if faulty {
            let (client, server) = (self.conns[conn].client, self.conns[conn].server);
            self.touch(client, server);
        }
        Some(frame)
    }

    /// Runs the next event, or lets time pass to `deadline` if none comes before it.
    pub fn step_until(&mut self, deadline: Micros) {
        match self.events.peek() {
            Some(Reverse(s)) if s.at <= deadline => {
                let Reverse(s) = self.events.pop().expect("peeked");
                self.now = self.now.max(s.at);
                self.handle(s.event);
            }
            _ => self.now = self.now.max(deadline),
        }
    }

    /// Lets `d` of virtual time pass, running every event due.
    pub fn run_for(&mut self, d: Micros) {
        let deadline = self.now + d;
        while self.now < deadline {
            self.step_until(deadline);
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Request { conn, frame } => self.serve(conn, frame),
            Event::Reply {
                conn,
                frame,
                faulty,
            } => {
                let (client, server) = (self.conns[conn].client, self.conns[conn].server);
                if self.partitioned[client][server] {
                    let at = self.heals_at[client][server] + self.delay();
                    let event = Event::Reply {
                        conn,
                        frame,
                        faulty,
                    };
                    return self.schedule(at - self.now, event);
                }
                self.note(format_args!("reply on conn {conn}: {} bytes", frame.len()));
                let c = &mut self.conns[conn];
                if !c.silent && !c.reset {
                    c.inbox.push((frame, faulty));
                }
            }
            Event::Restart { server } => {
                let s = &mut self.servers[server];
                s.up = true;
                s.incarnation += 1;
                s.store = new_store(s.capacity_pages);
                self.start_member(server);
            }
            Event::Gossip {
                to,
                from,
                announce,
                bytes,
            } => {
                if !self.servers[to].up {
                    return;
                }
                let now_ms = self.now / 1000;
                if let Some(m) = self.members[to].as_mut() {
                    // The runtime has checked the signature: the sender is server `from`.
                    let _ = m.on_packet(now_ms, Some(server_node(from)), announce, &bytes);
                }
                self.member_flush(to);
            }
            Event::MemberTick => {
                let now_ms = self.now / 1000;
                for i in 0..self.servers.len() {
                    let s = &mut self.servers[i];
                    let Some(m) = self.members[i].as_mut().filter(|_| s.up) else {
                        continue;
                    };
                    let old = m.announce();
                    let (offered, free) = (s.store.capacity_pages(), s.store.room());
                    if (old.offered_pages, old.free_pages) != (offered, free) {
                        m.set_announce(Announce {
                            seq: old.seq + 1,
                            offered_pages: offered,
                            free_pages: free,
                            requests_per_s: 0,
                        });
                    }
                    m.on_tick(now_ms);
                    self.member_flush(i);
                }
                self.schedule(MEMBER_TICK_US, Event::MemberTick);
            }
            Event::Heal { client, server } => self.partitioned[client][server] = false,
            Event::Delta { conn, holder, idx } => self.delta_arrives(conn, holder, idx),
            Event::DeltaAnswer { conn, answers } => self.delta_answered(conn, answers),
            Event::Tick => {
                let now_ms = self.now / 1000;
                for c in &self.conns {
                    let s = &mut self.servers[c.server];
                    if c.working()
                        && s.up
                        && s.incarnation == c.incarnation
                        && !self.partitioned[c.client][c.server]
                    {
                        let _ = s.store.refresh(c.session, now_ms);
                    }
                }
                for s in self.servers.iter_mut().filter(|s| s.up) {
                    s.store.expire(now_ms);
                    if s.slow_until <= self.now {
                        s.slow = 1;
                    }
                }
                self.schedule(LEASE_PERIOD_MS * 500, Event::Tick);
            }
        }
    }

    /// A request reaches its server: the server's own request logic runs against its store.
    fn serve(&mut self, conn: usize, frame: Vec<u8>) {
        let (client, server) = (self.conns[conn].client, self.conns[conn].server);
        let s = &self.servers[server];
        if !s.up || s.incarnation != self.conns[conn].incarnation {
            // The machine is gone or rebooted: the connection is reset.
            self.conns[conn].reset = true;
            return;
        }
        if self.conns[conn].forward.is_some() {
            self.conns[conn].queued.push_back(frame);
            return;
        }
        let (id, req) = match decode_request(&frame) {
            Ok(r) => r,
            Err(e) => {
                self.bad_frames
                    .push(format!("client {client} sent a bad frame: {e}"));
                self.conns[conn].reset = true;
                return;
            }
        };
        let mut out = Vec::new();
        let now_ms = self.now / 1000;
        let session = self.conns[conn].session;
        let s = &mut self.servers[server];
        let outcome = serve::handle_request(
            &mut s.store,
            session,
            id,
            req,
            now_ms,
            0,
            &mut out,
            serve::store_stats,
        );
        let service = 5 * s.slow;
        match outcome {
            Outcome::Open => {}
            Outcome::Closed => self.conns[conn].closed = true,
            Outcome::Forward(fwd) => return self.forward(conn, fwd),
            Outcome::Handover(ho) => {
                // Carried at once, as one step: the target's store takes the pages as a real
                // one would from this server's peer session, if it is up and the node named.
                let from = Peer::Server(server_node(server));
                let target = (0..self.servers.len())
                    .find(|&t| server_addr(t) == ho.to.addr && server_node(t) == ho.to.node)
                    .filter(|&t| self.servers[t].up);
                let status: Vec<MoveStatus> = match target {
                    Some(t) => ho
                        .pages
                        .iter()
                        .map(|p| {
                            self.servers[t]
                                .store
                                .adopt(from, ho.owner, &p.as_page(), now_ms)
                        })
                        .collect(),
                    None => Vec::new(),
                };
                let keys: Vec<(u64, u32)> =
                    ho.pages.iter().map(|p| (p.key.page, p.version)).collect();
                self.note(format_args!(
                    "server {server} hands pages {keys:?} to {:?} for conn {conn}: {status:?}",
                    target
                ));
                let s = &mut self.servers[server];
                serve::finish_handover(&mut s.store, session, ho, &status, 0, &mut out);
            }
        }
        self.reply(conn, out, service);
    }

    /// Sends the deltas of a waiting request to their holders.
    fn forward(&mut self, conn: usize, fwd: Forward) {
        let mut by_holder: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut unknown = Vec::new();
        for (i, (holder, _)) in fwd.deltas.iter().enumerate() {
            match (0..self.servers.len()).find(|&s| server_addr(s) == holder.addr) {
                // A real server refuses to forward to a server that is not the named node;
                // legitimate owners always name the right one.
                Some(h) if server_node(h) != holder.node => {
                    self.bad_frames.push(format!(
                        "a delta for {holder} went to server {h}, node {}: the owner named \
                         the wrong holder node",
                        server_node(h)
                    ));
                    unknown.push(i);
                }
                Some(h) => match by_holder.iter_mut().find(|(x, _)| *x == h) {
                    Some((_, idx)) => idx.push(i),
                    None => by_holder.push((h, vec![i])),
                },
                None => unknown.push(i),
            }
        }
        let n = fwd.deltas.len();
        self.note(format_args!(
            "server {} forwards {n} deltas for conn {conn}",
            self.conns[conn].server
        ));
        self.conns[conn].forward = Some(Box::new(Waiting {
            fwd,
            outcomes: vec![None; n],
        }));
        if !unknown.is_empty() {
            let answers = unknown
                .into_iter()
                .map(|i| (i, DeltaOutcome::Unreachable))
                .collect();
            self.schedule(0, Event::DeltaAnswer { conn, answers });
        }
        for (holder, idx) in by_holder {
            let mut d = self.delay();
            if self.chance(self.faults.lose) {
                // Lost: the sender times out and sends again on a new connection. Meanwhile
                // the client waits for this server, and may give up on it: the fault touches
                // that pair.
                self.log.losses += 1;
                d += PEER_TIMEOUT_US + self.delay();
                let (client, server) = (self.conns[conn].client, self.conns[conn].server);
                self.touch(client, server);
            }
            self.schedule(d, Event::Delta { conn, holder, idx });
        }
    }

    fn delta_arrives(&mut self, conn: usize, holder: usize, idx: Vec<usize>) {
        let Some(w) = self.conns[conn].forward.as_ref() else {
            return;
        };
        // The holder checks the sender as a real one checks its certificate: a server, the one
        // the owner placed the member on.
        let by = DeltaFrom::Peer(Peer::Server(server_node(self.conns[conn].server)));
        let answers: Vec<(usize, DeltaOutcome)> = if !self.servers[holder].up {
            idx.into_iter()
                .map(|i| (i, DeltaOutcome::Unreachable))
                .collect()
        } else {
            let store = &mut self.servers[holder].store;
            idx.into_iter()
                .map(|i| {
                    let o = match store.apply_delta(&w.fwd.deltas[i].1.as_delta(), by) {
                        DeltaStatus::Applied => DeltaOutcome::Applied,
                        DeltaStatus::UnknownGroup | DeltaStatus::Stale => {
                            DeltaOutcome::UnknownGroup
                        }
                    };
                    (i, o)
                })
                .collect()
        };
        let answers = if self.servers[holder].up && self.chance(self.faults.unanswered) {
            self.log.unanswered += 1;
            answers
                .into_iter()
                .map(|(i, _)| (i, DeltaOutcome::Unreachable))
                .collect()
        } else {
            answers
        };
        let d = self.delay() * self.servers[holder].slow;
        self.schedule(d, Event::DeltaAnswer { conn, answers });
    }

    fn delta_answered(&mut self, conn: usize, answers: Vec<(usize, DeltaOutcome)>) {
        let Some(w) = self.conns[conn].forward.as_mut() else {
            return;
        };
        for (i, o) in answers {
            w.outcomes[i] = Some(o);
        }
        if w.outcomes.iter().any(Option::is_none) {
            return;
        }
        let w = self.conns[conn].forward.take().expect("checked");
        let server = self.conns[conn].server;
        let s = &self.servers[server];
        if !s.up || s.incarnation != self.conns[conn].incarnation {
            self.conns[conn].queued.clear();
            return;
        }
        let outcomes: Vec<DeltaOutcome> = w.outcomes.iter().map(|o| o.expect("all")).collect();
        let mut out = Vec::new();
        let now_ms = self.now / 1000;
        let session = self.conns[conn].session;
        let s = &mut self.servers[server];
        serve::finish_forward(&mut s.store, session, w.fwd, &outcomes, now_ms, 0, &mut out);
        let service = 5 * s.slow;
        self.reply(conn, out, service);
        // The frames that waited behind it, until one waits again.
        while self.conns[conn].forward.is_none() {
            let Some(frame) = self.conns[conn].queued.pop_front() else {
                break;
            };
            self.serve(conn, frame);
        }
    }

    /// Sends a reply back to the client, with the network's faults.
    fn reply(&mut self, conn: usize, mut out: Vec<u8>, service: Micros) {
        if out.is_empty() {
            return;
        }
        let mut faulty = false;
        if self.chance(self.faults.bit_flip) && self.flip_a_page_bit(&mut out) {
            self.log.bit_flips += 1;
            faulty = true;
        }
        if self.chance(self.faults.hostile) {
            let believable = self.make_hostile(&mut out);
            self.log.hostile += 1;
            self.conns[conn].lied |= believable;
            faulty = true;
        }
        if self.chance(self.faults.duplicate) {
            // Both copies count: whichever the client takes second is the one it chokes on.
            faulty = true;
            self.log.duplicates += 1;
            let d = service + self.delay();
            self.schedule(
                d,
                Event::Reply {
                    conn,
                    frame: out.clone(),
                    faulty: true,
                },
            );
        }
        let d = service + self.delay();
        self.schedule(
            d,
            Event::Reply {
                conn,
                frame: out,
                faulty,
            },
        );
    }

    /// Turns a reply into a lie the pager must survive (found out, counted, the server dropped;
    /// never a wrong page returned, never a panic).
    /// Returns whether the result may still decode as a plausible reply (a lie the client
    /// cannot see through), rather than as a frame it refuses.
    fn make_hostile(&mut self, frame: &mut Vec<u8>) -> bool {
        match self.rng.u32(0..4) {
            0 => {
                let at = self.rng.usize(0..frame.len());
                frame[at] ^= 1 << self.rng.u32(0..8);
                true
            }
            1 => {
                frame.truncate(self.rng.usize(0..frame.len()));
                false
            }
            2 => {
                // The request id follows the frame's length and kind (`netram_proto::codec`).
                if let Ok((id, _)) = decode_reply(frame) {
                    let other = id.wrapping_add(self.rng.u64(1..4));
                    if let Some(at) = frame.windows(8).position(|w| w == id.to_le_bytes()) {
                        frame[at..at + 8].copy_from_slice(&other.to_le_bytes());
                    }
                }
                true
            }
            _ => {
                let n = self.rng.usize(0..64);
                let garbage: Vec<u8> = (0..n).map(|_| self.rng.u8(..)).collect();
                *frame = garbage;
                false
            }
        }
    }

    /// Flips one bit of one page's data in a GET reply (a bit flip in a server's RAM or on
    /// the wire); false if the reply carries no page data.
    fn flip_a_page_bit(&mut self, frame: &mut [u8]) -> bool {
        let base = frame.as_ptr() as usize;
        // Each page's data and its length: a page travels without its zero tail.
        let spans: Vec<(usize, usize)> = match decode_reply(frame) {
            Ok((_, Reply::Get { pages, .. })) => pages
                .iter()
                .filter_map(|p| match p {
                    GetResult::Found(p) if !p.data.is_empty() => {
                        Some((p.data.as_ptr() as usize - base, p.data.len()))
                    }
                    _ => None,
                })
                .collect(),
            _ => return false,
        };
        if spans.is_empty() {
            return false;
        }
        let (start, len) = spans[self.rng.usize(0..spans.len())];
        let at = start + self.rng.usize(0..len);
        frame[at] ^= 1 << self.rng.u32(0..8);
        true
    }

    /// Crashes a server now: its RAM is lost; it restarts empty, with a new incarnation,
    /// after `downtime`. Clients see a reset, or silence until they time out.
    pub fn crash(&mut self, server: usize, downtime: Micros) {
        self.note(format_args!("server {server} crashes"));
        self.servers[server].up = false;
        self.members[server] = None;
        self.log.crashes += 1;
        for i in 0..self.conns.len() {
            if self.conns[i].server == server {
                let client = self.conns[i].client;
                self.touch(client, server);
                if self.rng.bool() {
                    self.conns[i].reset = true;
                } else {
                    self.conns[i].silent = true;
                }
                self.conns[i].inbox.clear();
            }
        }
        self.schedule(downtime, Event::Restart { server });
    }

    /// Cuts a client off from a server for `d`.
    pub fn partition(&mut self, client: usize, server: usize, d: Micros) {
        if !self.partitioned[client][server] {
            self.partitioned[client][server] = true;
            self.heals_at[client][server] = self.now + d;
            self.log.partitions += 1;
            self.touch(client, server);
            self.schedule(d, Event::Heal { client, server });
        }
    }

    /// Makes a server ten times slower for `d`.
    pub fn slow_down(&mut self, server: usize, d: Micros) {
        let s = &mut self.servers[server];
        s.slow = 10;
        s.slow_until = self.now + d;
        self.log.slowdowns += 1;
    }

    /// Moves a server's offer to `frames` of its arena, as its donor would; the frames no
    /// longer offered are given back (nothing to do with a `Vec` arena).
    pub fn move_offer(&mut self, server: usize, frames: u64) {
        let s = &mut self.servers[server];
        if !s.up {
            return;
        }
        s.store.set_offer(frames);
        // As the daemon's donor thread does at once: pages above the offer move down into
        // what is free below it.
        s.store.compact(usize::MAX);
        s.store.take_given_back();
        self.log.offer_moves += 1;
        self.note(format_args!("server {server} offers {frames} frames"));
    }

    /// Whether the checker can look at what a connection's session holds: the connection works
    /// and its server has not rebooted since it opened.
    pub fn inspectable(&self, conn: usize) -> bool {
        let c = &self.conns[conn];
        let s = &self.servers[c.server];
        c.working() && s.up && s.incarnation == c.incarnation
    }
}
