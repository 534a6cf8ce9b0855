//! The pager's [`Transport`] over the simulated network: what `TcpTransport` is in the daemon.
//! A receive runs the world (other clients' messages, servers, crashes) until this
//! connection's reply arrives or the virtual timeout passes; while it runs, the replies that
//! reach the other clients are pushed to their pagers ([`deliver`]), one message at a time, as
//! a runtime that owns every socket would: one client's operation and the others' replies
//! interleave message by message (TigerBeetle's packet simulator delivers the same way).

use crate::world::{Micros, World};
use netram_pager::{MemDisk, Pager, PagerError, ServerInfo, Transport, TransportError};
use netram_proto::{decode_reply, Reply, Request};
use std::cell::RefCell;
use std::rc::{Rc, Weak};

/// A simulated client's pager.
pub type SimPager = Pager<SimTransport, MemDisk>;

/// Every client's pager, for pushing replies to the ones not busy, and what pushing found.
#[derive(Debug, Default)]
pub struct Peers {
    /// By client. A pager in the middle of its own operation is borrowed, and skipped: it
    /// reads its replies itself.
    pub pagers: Vec<Weak<RefCell<SimPager>>>,
    /// Errors a pushed reply returned (a disk failure reported), by client, for the scenario
    /// to judge after the step.
    pub errors: Vec<(usize, PagerError)>,
    /// Invariants a pushed reply broke (`Pager::check_invariants` right after it), by client:
    /// the scenario fails the run on the first.
    pub broken: Vec<(usize, String)>,
    /// Replies (and failures) pushed, and how many of them while another client's operation
    /// was waiting for its own.
    pub pushed: u64,
    pub pushed_mid_operation: u64,
}

/// Pushes the replies (and connection failures) waiting for idle clients to their pagers, one
/// message at a time, to whichever client and from whichever server the world's dice pick;
/// about half the clients take theirs now, the others later (or in their own next wait).
/// `mid_operation`: called from inside a client's wait (counted apart in [`Peers`]).
pub fn deliver(peers: &Rc<RefCell<Peers>>, world: &Rc<RefCell<World>>, mid_operation: bool) {
    let pagers: Vec<Weak<RefCell<SimPager>>> = peers.borrow().pagers.clone();
    let mut ready: Vec<(usize, usize)> = Vec::new();
    for (c, weak) in pagers.iter().enumerate() {
        let Some(rc) = weak.upgrade() else { continue };
        let Ok(p) = rc.try_borrow() else { continue };
        if world.borrow_mut().rng.bool() {
            ready.extend((0..p.servers().count()).map(|s| (c, s)));
        }
    }
    let mut pushed = 0;
    while !ready.is_empty() {
        let at = world.borrow_mut().rng.usize(0..ready.len());
        let (c, s) = ready[at];
        let Some(rc) = pagers[c].upgrade() else {
            ready.swap_remove(at);
            continue;
        };
        // Busy since (a reply pushed to another pager never waits, so only its own
        // operation can hold it).
        let Ok(mut p) = rc.try_borrow_mut() else {
            ready.swap_remove(at);
            continue;
        };
        if p.in_flight(s) == 0 {
            // Nothing asked of it: anything there waits for the pager's own look (a stray
            // frame is then as unexpected as it should be).
            ready.swap_remove(at);
            continue;
        }
        let result = match p.transport_mut().take_frame(s) {
            None => {
                ready.swap_remove(at);
                continue;
            }
            Some(Err(e)) => {
                p.on_failure(s, e);
                Ok(())
            }
            Some(Ok(frame)) => match decode_reply(&frame) {
                Ok((id, reply)) => p.on_reply(s, id, &reply),
                Err(e) => {
                    p.on_failure(s, TransportError::Protocol(e.to_string()));
                    Ok(())
                }
            },
        };
        // The pager is at rest between any two events: its invariants hold after each one
        // pushed, not only after a step.
        let broken = p.check_invariants().err();
        drop(p);
        pushed += 1;
        if let Some(why) = broken {
            peers.borrow_mut().broken.push((c, why));
        }
        if let Err(e) = result {
            peers.borrow_mut().errors.push((c, e));
        }
    }
    let mut peers = peers.borrow_mut();
    peers.pushed += pushed;
    if mid_operation {
        peers.pushed_mid_operation += pushed;
    }
}

/// How long a client waits for a reply before it declares the server dead.
pub const REPLY_TIMEOUT_US: Micros = 1_000_000;

#[derive(Debug)]
pub struct SimTransport {
    world: Rc<RefCell<World>>,
    client: usize,
    /// This client's current connection to each server (`None`: never connected).
    pub conns: Vec<Option<usize>>,
    infos: Vec<ServerInfo>,
    last: Vec<u8>,
    /// The other clients, to push their replies to while this one waits (none: they wait).
    pub peers: Option<Rc<RefCell<Peers>>>,
}

impl SimTransport {
    /// Connects to every server, as `TcpTransport::connect` does; one that cannot be reached
    /// starts out dead.
    pub fn connect(world: Rc<RefCell<World>>, client: usize) -> Self {
        let n = world.borrow().servers.len();
        let mut conns = Vec::with_capacity(n);
        let mut infos = Vec::with_capacity(n);
        for s in 0..n {
            let r = world.borrow_mut().connect(client, s);
            match r {
                Ok((c, info)) => {
                    conns.push(Some(c));
                    infos.push(info);
                }
                Err(e) => {
                    conns.push(None);
                    infos.push(ServerInfo {
                        name: format!("sim{s}"),
                        addr: Some(crate::world::server_addr(s)),
                        node: crate::world::server_node(s),
                        window: 1,
                        capacity_pages: 0,
                        free_pages: 0,
                        connected: Err(e),
                    });
                }
            }
        }
        Self {
            world,
            client,
            conns,
            infos,
            last: Vec::new(),
            peers: None,
        }
    }

    /// The next reply that reached this client from `server`, as a runtime that owns the
    /// sockets reads it to push it to the pager ([`netram_pager::Pager::on_reply`]), or the
    /// connection's failure; `None` when nothing is there.
    pub fn take_frame(&mut self, server: usize) -> Option<Result<Vec<u8>, TransportError>> {
        let c = self.conns[server]?;
        let mut w = self.world.borrow_mut();
        if let Some(frame) = w.take_reply(c) {
            return Some(Ok(frame));
        }
        w.conns[c].reset.then(|| {
            Err(TransportError::Disconnected(
                "connection reset by peer".into(),
            ))
        })
    }

    /// Ends every session, as a client does when it exits cleanly.
    pub fn close(&mut self) {
        for s in 0..self.conns.len() {
            let Some(c) = self.conns[s] else { continue };
            let mut frame = Vec::new();
            Request::Close.encode(u64::MAX, &mut frame);
            let sent = self.world.borrow_mut().send(c, frame);
            if sent.is_ok() {
                let _ = self.recv(s);
            }
        }
    }
}

impl Transport for SimTransport {
    fn servers(&self) -> Vec<ServerInfo> {
        self.infos.clone()
    }

    fn send(
        &mut self,
        server: usize,
        req_id: u64,
        req: &Request<'_>,
    ) -> Result<(), TransportError> {
        let Some(c) = self.conns[server] else {
            return Err(TransportError::Disconnected("never connected".into()));
        };
        let mut frame = Vec::new();
        req.encode(req_id, &mut frame);
        self.world.borrow_mut().send(c, frame)
    }

    fn send_frame(&mut self, server: usize, frame: &[u8]) -> Result<(), TransportError> {
        let Some(c) = self.conns[server] else {
            return Err(TransportError::Disconnected("never connected".into()));
        };
        self.world.borrow_mut().send(c, frame.to_vec())
    }

    fn recv(&mut self, server: usize) -> Result<(u64, Reply<'_>), TransportError> {
        let Some(c) = self.conns[server] else {
            return Err(TransportError::Disconnected("never connected".into()));
        };
        let deadline = self.world.borrow().now + REPLY_TIMEOUT_US;
        if self.world.borrow().trace {
            eprintln!(
                "    client {} waits for server {server} (conn {c})",
                self.client
            );
        }
        loop {
            let mut w = self.world.borrow_mut();
            if let Some(frame) = w.take_reply(c) {
                self.last = frame;
                break;
            }
            if w.conns[c].reset {
                return Err(TransportError::Disconnected(
                    "connection reset by peer".into(),
                ));
            }
            if w.now >= deadline {
                return Err(TransportError::Timeout(REPLY_TIMEOUT_US / 1000));
            }
            w.step_until(deadline);
            drop(w);
            if let Some(peers) = &self.peers {
                deliver(peers, &self.world, true);
            }
        }
        decode_reply(&self.last).map_err(|e| TransportError::Protocol(e.to_string()))
    }

    fn try_recv(&mut self, server: usize) -> Option<Result<(u64, Reply<'_>), TransportError>> {
        match self.take_frame(server)? {
            Ok(frame) => {
                self.last = frame;
                Some(decode_reply(&self.last).map_err(|e| TransportError::Protocol(e.to_string())))
            }
            Err(e) => Some(Err(e)),
        }
    }

    fn reconnect(&mut self, server: usize) -> Result<ServerInfo, TransportError> {
        let r = self.world.borrow_mut().connect(self.client, server);
        match r {
            Ok((c, info)) => {
                if let Some(old) = self.conns[server] {
                    // Abandoned: its session, if the server still has it, ends with its lease.
                    self.world.borrow_mut().conns[old].closed = true;
                }
                self.conns[server] = Some(c);
                self.infos[server] = info.clone();
                Ok(info)
            }
            Err(e) => Err(TransportError::Disconnected(e)),
        }
    }
}
