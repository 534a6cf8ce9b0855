//! The daemon's part in distributed shared memory (MIRAGE+, paper 002; issue 40): it runs
//! the machine's agent (`netram_shm::agent`, one thread), carries the agent's messages to
//! other daemons and delivers theirs, and answers this machine's processes on the
//! shared-memory socket (`netram_shm::local`).
//!
//! - **Between daemons** the messages ride the cluster's authenticated connections: a link
//!   per peer (a thread, a queue bounded in bytes, [`netram_net::Call::post`]: one-way frames), and on
//!   the receiving side `daemon.rs` hands every DSM frame to the agent with the node the
//!   connection's certificate names (never a field of the message). Over clear TCP
//!   (`--insecure`, loopback only) the sender's HELLO names it.
//! - **Local processes** create and attach segments on a `SOCK_SEQPACKET` socket next to the
//!   control socket: the daemon checks the name, the caller's uid (from the socket) against
//!   the segment's owner and mode, finds the segment by name in the cluster, and hands back
//!   its memfd; the process hands over its userfaultfd and the agent serves its faults.

use crate::daemon::Shared;
use netram_net::{Call, FrameBuffer, Patience, Security};
use netram_proto::{Hello, HELLO_END_ON_CLOSE};
use netram_shm::agent::{Door, Feed, Role, Running, MAX_FEEDS};
use netram_shm::local::{self, Request};
use netram_shm::{Agent, Meta, View};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// Mixed into a daemon's node id in the HELLO of its DSM links ("DSM"), so that the session
/// never supersedes one of a client of the same node; over clear TCP the receiver takes it
/// back out to know the sender.
pub const DSM_NODE: u64 = 0x4453_4d00_0000_0000;

/// Bytes queued for one peer at most (16,384 pages' frames). The agent never waits for a
/// link: it also reads the peers' messages, and two agents each waiting for the other's
/// queue to drain would never go on (nor serve anyone else meanwhile). A peer that takes
/// nothing until this much waits for it loses what is sent to it beyond that, counted
/// (`dsm_frames_lost`, `dsm_frames_overflowed`), as a peer that cannot be reached does; the
/// membership's verdict on it is what the libraries act on.
const LINK_QUEUE_BYTES: usize = 64 << 20;
/// Peers a daemon keeps links to.
const MAX_LINKS: usize = 1024;
/// How long a lookup by name waits for every member's answer.
const LOOKUP_WAIT: Duration = Duration::from_secs(2);
const PATIENCE: Patience = Patience {
    connect: Duration::from_millis(500),
    reply: Duration::from_secs(2),
};

/// What the daemon counts of its links.
#[derive(Debug, Default)]
pub(crate) struct LinkCounters {
    pub frames_sent: AtomicU64,
    /// Frames given up: the peer could not be reached, or took nothing for too long
    /// (a request whose message is lost waits for the membership's verdict on the peer).
    pub frames_lost: AtomicU64,
    /// Of those, frames dropped because the peer's queue held [`LINK_QUEUE_BYTES`] already.
    pub frames_overflowed: AtomicU64,
    /// Frames from other daemons handed to the agent (by a connection's thread, or read by
    /// the agent itself).
    pub frames_received: AtomicU64,
    /// Connections from other daemons handed to the agent to read ([`LinkFeed`]).
    pub links_adopted: AtomicU64,
    /// Connections the agent dropped for breaking the rules (a frame that is not DSM, or
    /// malformed).
    pub links_refused: AtomicU64,
    /// Connections the agent reads now.
    feeds_live: std::sync::atomic::AtomicUsize,
}

/// The links to other daemons.
struct Links {
    node: u64,
    incarnation: u64,
    security: Security,
    shared: Weak<Shared>,
    queues: Mutex<HashMap<u64, Link>>,
    shutdown: Arc<AtomicBool>,
    counters: Arc<LinkCounters>,
    /// The agent, told when a peer cannot be reached (set once it runs).
    agent: std::sync::OnceLock<Door>,
}

/// One peer's link: its queue, its connection, and how many items (and bytes) are queued or
/// being sent.
#[derive(Clone)]
struct Link {
    tx: Sender<Out>,
    call: Arc<Mutex<Call>>,
    pending: Arc<std::sync::atomic::AtomicUsize>,
    queued_bytes: Arc<std::sync::atomic::AtomicUsize>,
}

/// What a link's thread is handed.
enum Out {
    /// A frame to send (sealed by the thread).
    Frame(Vec<u8>),
    /// The tail of a record the agent sealed and began to write itself: written before
    /// anything else.
    Rest(Vec<u8>),
}

impl Out {
    fn len(&self) -> usize {
        match self {
            Out::Frame(b) | Out::Rest(b) => b.len(),
        }
    }
}

impl Links {
    fn send(self: &Arc<Self>, to: u64, frame: Vec<u8>) {
        let link = {
            let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
            if !queues.contains_key(&to) && queues.len() >= MAX_LINKS {
                tracing::warn!(to, "too many shared-memory peers: {MAX_LINKS}");
                self.counters.frames_lost.fetch_add(1, Ordering::Relaxed);
                return;
            }
            queues
                .entry(to)
                .or_insert_with(|| {
                    let (tx, rx) = mpsc::channel();
                    let link = Link {
                        tx,
                        call: Arc::default(),
                        pending: Arc::default(),
                        queued_bytes: Arc::default(),
                    };
                    let (me, mine) = (self.clone(), link.clone());
                    let _ = std::thread::Builder::new()
                        .name(format!("netram-dsm-{to:x}"))
                        .spawn(move || me.run(to, rx, mine));
                    link
                })
                .clone()
        };
        // Straight onto the open connection when nothing is queued before it (the agent is
        // the only sender, so the order holds): a hand-off to the link's thread costs a
        // wake-up, ~60 µs on these machines, on every message's path. Never blocking: what
        // the socket does not take now goes to the thread, which may wait; the agent must not
        // (it also reads this peer's messages, and the peer's agent may be writing to it).
        let mut rest = None;
        if link.pending.load(Ordering::SeqCst) == 0 {
            if let Ok(mut call) = link.call.try_lock() {
                if call.is_open() {
                    let mut sealed = frame.clone();
                    match call.try_post_open(&mut sealed) {
                        Ok(n) if n == sealed.len() => {
                            self.counters.frames_sent.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                        // Sealed (the key's sequence moved on): these bytes, not the frame
                        // sealed again, are what must follow.
                        Ok(n) => {
                            sealed.drain(..n);
                            rest = Some(sealed);
                        }
                        // The connection broke: the thread opens another, with new keys, and
                        // sends the frame afresh.
                        Err(e) => tracing::debug!(to, "shared-memory link: {e}"),
                    }
                }
            }
        }
        let out = match rest {
            Some(r) => Out::Rest(r),
            None => Out::Frame(frame),
        };
        let len = out.len();
        // Never waits (`LINK_QUEUE_BYTES`). A record's rest is always taken: its first bytes
        // are on the wire already, and the connection is lost without the rest.
        let queued = link.queued_bytes.fetch_add(len, Ordering::SeqCst);
        if queued + len > LINK_QUEUE_BYTES && matches!(out, Out::Frame(_)) {
            link.queued_bytes.fetch_sub(len, Ordering::SeqCst);
            self.counters.frames_lost.fetch_add(1, Ordering::Relaxed);
            let over = self
                .counters
                .frames_overflowed
                .fetch_add(1, Ordering::Relaxed);
            // Once an episode would do; a power of two keeps a flood to a few lines.
            if (over + 1).is_power_of_two() {
                tracing::warn!(
                    to,
                    queued,
                    "shared-memory message dropped: the peer takes nothing and its queue is full"
                );
            }
            return;
        }
        link.pending.fetch_add(1, Ordering::SeqCst);
        if link.tx.send(out).is_err() {
            link.pending.fetch_sub(1, Ordering::SeqCst);
            link.queued_bytes.fetch_sub(len, Ordering::SeqCst);
            self.counters.frames_lost.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn addr_of(&self, node: u64) -> Option<SocketAddr> {
        let shared = self.shared.upgrade()?;
        let members = shared.members();
        members
            .members
            .iter()
            .find(|m| m.node == node && !m.is_self)
            .map(|m| m.addr)
    }

    /// One peer's link: sends what is queued, in order, a batch per write (opening the
    /// connection when need be, which the agent's direct path never waits for).
    fn run(&self, to: u64, rx: mpsc::Receiver<Out>, link: Link) {
        let mut batch = Vec::new();
        loop {
            if self.shutdown.load(Ordering::SeqCst) {
                return;
            }
            let first = match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(Out::Frame(f)) => f,
                Ok(Out::Rest(rest)) => {
                    // Only ever first in the queue (the agent begins a record itself only
                    // when nothing is queued); lost with the connection if it broke.
                    let mut call = link.call.lock().unwrap_or_else(|p| p.into_inner());
                    let c = match call.write_rest(&rest) {
                        Ok(()) => &self.counters.frames_sent,
                        Err(e) => {
                            tracing::warn!(to, "shared-memory message lost: {e}");
                            &self.counters.frames_lost
                        }
                    };
                    c.fetch_add(1, Ordering::Relaxed);
                    drop(call);
                    link.pending.fetch_sub(1, Ordering::SeqCst);
                    link.queued_bytes.fetch_sub(rest.len(), Ordering::SeqCst);
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            };
            batch.clear();
            batch.extend_from_slice(&first);
            let mut n = 1u64;
            // Frames only: a `Rest` is never queued behind a frame.
            while batch.len() < 1 << 20 {
                match rx.try_recv() {
                    Ok(Out::Frame(f)) => {
                        batch.extend_from_slice(&f);
                        n += 1;
                    }
                    Ok(Out::Rest(_)) => unreachable!("a record's rest is queued first only"),
                    Err(_) => break,
                }
            }
            let mut sent = false;
            let mut call = link.call.lock().unwrap_or_else(|p| p.into_inner());
            for attempt in 0..5 {
                if attempt > 0 {
                    std::thread::sleep(Duration::from_millis(100 << attempt.min(3)));
                    call.reset();
                }
                let Some(addr) = self.addr_of(to) else {
                    continue;
                };
                let mut frames = batch.clone();
                let hello = || {
                    let mut h =
                        Hello::new(self.node ^ DSM_NODE, self.incarnation, fastrand::u64(..));
                    h.flags |= HELLO_END_ON_CLOSE;
                    h
                };
                match call.post(to, addr, hello, &self.security, PATIENCE, &mut frames) {
                    Ok(()) => {
                        sent = true;
                        break;
                    }
                    Err(e) => tracing::debug!(to, %addr, "shared-memory link: {e}"),
                }
            }
            let c = if sent {
                &self.counters.frames_sent
            } else {
                // Not taken as a crash by itself: a cut link with a live peer behind it would
                // have its copies dropped while it still uses them. The membership's verdict
                // (`watch_members`) is what the libraries act on.
                tracing::warn!(
                    to,
                    frames = n,
                    "shared-memory messages lost: the peer cannot be reached"
                );
                &self.counters.frames_lost
            };
            c.fetch_add(n, Ordering::Relaxed);
            drop(call);
            link.pending.fetch_sub(n as usize, Ordering::SeqCst);
            link.queued_bytes.fetch_sub(batch.len(), Ordering::SeqCst);
        }
    }
}

/// The running shared-memory service of a daemon.
pub(crate) struct Shm {
    running: Option<Running>,
    door: Door,
    socket: Option<PathBuf>,
    pub counters: Arc<LinkCounters>,
}

impl std::fmt::Debug for Shm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shm").field("socket", &self.socket).finish()
    }
}

impl Shm {
    /// Starts the agent of node `node` and, if `socket` is given, the local socket there;
    /// pages compressed by a link speed of `mbps` (0: never).
    pub(crate) fn start(
        shared: &Arc<Shared>,
        node: u64,
        incarnation: u64,
        security: Security,
        socket: Option<&Path>,
        mbps: u32,
    ) -> std::io::Result<Shm> {
        let counters = Arc::new(LinkCounters::default());
        let links = Arc::new(Links {
            node,
            incarnation,
            security,
            shared: Arc::downgrade(shared),
            queues: Mutex::new(HashMap::new()),
            shutdown: shared.shutdown.clone(),
            counters: counters.clone(),
            agent: std::sync::OnceLock::new(),
        });
        let to_links = links.clone();
        let net = Box::new(move |to: u64, frame: Vec<u8>| to_links.send(to, frame));
        let mut agent = Agent::new(node, net);
        if mbps > 0 {
            // The codec's cost measured on this machine, the link's declared: a page is
            // compressed when the wire time it saves exceeds the codec's.
            let rule = netram_proto::compress::Rule {
                link_bytes_per_us: f64::from(mbps) / 8.0,
                codec_us: netram_proto::compress::calibrate(),
            };
            tracing::info!(
                link_mbps = mbps,
                codec_us = format!("{:.2}", rule.codec_us),
                "shared-memory pages compressed when they shrink by {} bytes or more",
                rule.min_saving()
            );
            agent.set_compression(Some(rule));
        }
        let running = Running::start(agent).map_err(std::io::Error::from)?;
        let door = running.door();
        let _ = links.agent.set(door.clone());
        {
            let (door, shared) = (door.clone(), Arc::downgrade(shared));
            std::thread::Builder::new()
                .name("netram-shm-members".into())
                .spawn(move || watch_members(&door, &shared))?;
        }
        if let Some(path) = socket {
            let listener = bind_socket(path)?;
            let door = door.clone();
            let shared = Arc::downgrade(shared);
            std::thread::Builder::new()
                .name("netram-shm-accept".into())
                .spawn(move || accept_loop(listener, door, shared, node))?;
            tracing::info!(path = %path.display(), "shared-memory socket");
        }
        Ok(Shm {
            running: Some(running),
            door,
            socket: socket.map(Path::to_path_buf),
            counters,
        })
    }

    /// The agent's counters, named.
    pub(crate) fn agent_counters(&self) -> Vec<(&'static str, u64)> {
        self.running
            .as_ref()
            .map(|r| r.counters().named().to_vec())
            .unwrap_or_default()
    }

    /// A DSM frame from node `from` (as its connection authenticated it).
    pub(crate) fn deliver(&self, from: u64, frame: &[u8]) {
        self.counters
            .frames_received
            .fetch_add(1, Ordering::Relaxed);
        self.door.deliver(from, frame.to_vec());
    }

    /// Hands a connection that carries only node `from`'s DSM frames to the agent, to read
    /// in its own loop (with what `rbuf` holds of it already); given back when the agent
    /// reads [`MAX_FEEDS`] already (its thread goes on serving it).
    pub(crate) fn adopt(
        &self,
        stream: TcpStream,
        rbuf: FrameBuffer,
        from: u64,
    ) -> Result<(), Box<(TcpStream, FrameBuffer)>> {
        let live = &self.counters.feeds_live;
        if live.fetch_add(1, Ordering::SeqCst) >= MAX_FEEDS || stream.set_nonblocking(true).is_err()
        {
            live.fetch_sub(1, Ordering::SeqCst);
            return Err(Box::new((stream, rbuf)));
        }
        self.counters.links_adopted.fetch_add(1, Ordering::Relaxed);
        let feed = LinkFeed {
            stream,
            rbuf,
            from,
            counters: self.counters.clone(),
        };
        // If the agent has stopped, the feed is dropped (the connection closes): the daemon
        // is stopping.
        self.door.adopt(Box::new(feed));
        Ok(())
    }
}

/// A connection from another daemon that the agent reads itself (`netram_shm::agent::Feed`):
/// a DSM link's frames reach the agent without a hand-off between threads.
struct LinkFeed {
    stream: TcpStream,
    rbuf: FrameBuffer,
    from: u64,
    counters: Arc<LinkCounters>,
}

impl Feed for LinkFeed {
    fn from(&self) -> u64 {
        self.from
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }

    fn read(&mut self, budget: usize, frame: &mut dyn FnMut(&[u8])) -> std::io::Result<bool> {
        let mut read = 0;
        loop {
            loop {
                match self.rbuf.next_frame() {
                    Ok(Some(f)) if netram_proto::dsm::is_dsm(f) => {
                        self.counters
                            .frames_received
                            .fetch_add(1, Ordering::Relaxed);
                        frame(f);
                    }
                    Ok(Some(_)) => {
                        self.counters.links_refused.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            from = self.from,
                            "closing a shared-memory link: a frame that is not DSM"
                        );
                        return Ok(false);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        self.counters.links_refused.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            from = self.from,
                            "closing a shared-memory link: rejected frame: {e}"
                        );
                        return Ok(false);
                    }
                }
            }
            // The socket had no more at the last read: the agent's poll (level-triggered)
            // says when it has, so a second `recv` only to hear EAGAIN is saved.
            if read >= budget || (read > 0 && self.rbuf.drained()) {
                return Ok(true);
            }
            match self.rbuf.fill_now(&self.stream)? {
                None => return Ok(true),
                Some(0) => {
                    if self.rbuf.pending() > 0 {
                        tracing::warn!(
                            from = self.from,
                            "a shared-memory link closed in the middle of a frame"
                        );
                    }
                    return Ok(false);
                }
                Some(n) => read += n,
            }
        }
    }
}

impl Drop for LinkFeed {
    fn drop(&mut self) {
        self.counters.feeds_live.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            r.stop();
        }
        if let Some(p) = self.socket.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Tells the agent of every member the membership declares down (SWIM: no answer to direct
/// and indirect probes, no refutation): a write to a dead peer's socket succeeds until its
/// reset comes back, so a link alone does not notice a crash while it has nothing more to
/// send. Once per node and boot.
fn watch_members(door: &Door, shared: &Weak<Shared>) {
    let mut told: std::collections::HashSet<(u64, u64)> = Default::default();
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let Some(s) = shared.upgrade() else { return };
        if s.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let members = s.members().members;
        for m in &members {
            if m.is_self
                || m.state != netram_member::Liveness::Down
                || told.contains(&(m.node, m.boot))
            {
                continue;
            }
            // The membership is advice; this daemon's own evidence decides (as a pager's
            // does): a daemon that still accepts a connection is not taken for crashed — its
            // copies dropped while it still uses them would split a page in two. Asked again
            // next round.
            if std::net::TcpStream::connect_timeout(&m.addr, Duration::from_millis(500)).is_ok() {
                continue;
            }
            told.insert((m.node, m.boot));
            tracing::warn!(
                node = m.node,
                "a member is down: its shared-memory copies are gone"
            );
            // Every member this daemon has not found crashed: the ones a takeover of a
            // library that crashed waits to hear from.
            let live: Vec<u64> = members
                .iter()
                .filter(|x| !x.is_self && !told.contains(&(x.node, x.boot)))
                .map(|x| x.node)
                .collect();
            let node = m.node;
            door.post(move |a| a.site_down(node, &live));
        }
    }
}

fn bind_socket(path: &Path) -> std::io::Result<OwnedFd> {
    use rustix::net::{
        bind, listen, socket_with, AddressFamily, SocketAddrUnix, SocketFlags, SocketType,
    };
    let _ = std::fs::remove_file(path); // left by a daemon that died (the control socket's bind checked none answers)
    let sock = socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    bind(&sock, &SocketAddrUnix::new(path)?)?;
    listen(&sock, 64)?;
    use std::os::unix::fs::PermissionsExt;
    // Any local user may ask: what each may do is checked per request (its uid from the
    // socket, against the segment's owner and mode).
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(sock)
}

fn accept_loop(listener: OwnedFd, door: Door, shared: Weak<Shared>, node: u64) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let live = Arc::new(AtomicU64::new(0));
    loop {
        let Some(s) = shared.upgrade() else { return };
        if s.shutdown.load(Ordering::SeqCst) {
            return;
        }
        drop(s);
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        let t = Timespec {
            tv_sec: 0,
            tv_nsec: 200_000_000,
        };
        if !matches!(poll(&mut fds, Some(&t)), Ok(n) if n > 0) {
            continue;
        }
        let Ok(conn) = rustix::net::accept_with(&listener, rustix::net::SocketFlags::CLOEXEC)
        else {
            continue;
        };
        // A bound on local connections: each is a thread.
        if live.load(Ordering::SeqCst) >= 4096 {
            let _ = local::send(&conn, b"err too many connections", None);
            continue;
        }
        live.fetch_add(1, Ordering::SeqCst);
        let (door, shared, live) = (door.clone(), shared.clone(), live.clone());
        let _ = std::thread::Builder::new()
            .name("netram-shm-local".into())
            .spawn(move || {
                serve_local(&conn, &door, &shared, node);
                live.fetch_sub(1, Ordering::SeqCst);
            });
    }
}

/// Whether a process of `uid` may attach a segment of `meta` (read and write: System V's
/// owner and other bits; the group's are not checked, as gids are not known across
/// machines).
fn permitted(uid: u32, meta: &Meta) -> bool {
    uid == 0 || (uid == meta.uid && meta.mode & 0o600 == 0o600) || meta.mode & 0o006 == 0o006
}

/// Serves one local process's requests until it closes; then its views go.
fn serve_local(conn: &OwnedFd, door: &Door, shared: &Weak<Shared>, node: u64) {
    let Ok(cred) = rustix::net::sockopt::socket_peercred(conn) else {
        return;
    };
    let (uid, pid) = (cred.uid.as_raw(), cred.pid.as_raw_nonzero().get() as u32);
    // The segments this connection was given: only those may it map.
    let mut opened: Vec<u64> = Vec::new();
    // The views this connection added: they go when it closes (and only they).
    let mut views: Vec<(u64, u64)> = Vec::new();
    // At most a request a millisecond's worth: a local process flooding requests only waits.
    let mut served = 0u32;
    while let Ok(Some((packet, fd))) = local::recv(conn) {
        served += 1;
        if served > 100_000 {
            break;
        }
        let answer = match Request::parse(&packet) {
            Err(why) => Err(why),
            Ok(req) => handle(
                req,
                fd,
                door,
                shared,
                node,
                uid,
                pid,
                &mut opened,
                &mut views,
            ),
        };
        let sent = match answer {
            Ok((text, fd)) => local::send(conn, text.as_bytes(), fd.as_ref().map(|f| f.as_fd())),
            Err(why) => local::send(conn, format!("err {why}").as_bytes(), None),
        };
        if sent.is_err() {
            break;
        }
    }
    for (id, number) in views {
        door.call(move |a| a.drop_view_by_number(id, number));
    }
}

#[allow(clippy::too_many_arguments)]
fn handle(
    req: Request,
    fd: Option<OwnedFd>,
    door: &Door,
    shared: &Weak<Shared>,
    node: u64,
    uid: u32,
    pid: u32,
    opened: &mut Vec<u64>,
    views: &mut Vec<(u64, u64)>,
) -> Result<(String, Option<OwnedFd>), String> {
    let members = || -> Vec<u64> {
        shared.upgrade().map_or_else(Vec::new, |s| {
            s.members()
                .members
                .iter()
                .filter(|m| !m.is_self && m.state != netram_member::Liveness::Down)
                .map(|m| m.node)
                .collect()
        })
    };
    let lookup = |name: String| -> netram_shm::LookupResult {
        let (tx, rx) = mpsc::channel();
        let members = members();
        door.call(move |a| a.lookup(&name, &members, LOOKUP_WAIT, tx))
            .ok_or_else(Vec::new)?;
        rx.recv_timeout(LOOKUP_WAIT + Duration::from_secs(1))
            .unwrap_or_else(|_| Err(Vec::new()))
    };
    let dup = |fd: &OwnedFd| fd.try_clone().map_err(|e| e.to_string());
    match req {
        Request::Create {
            name,
            bytes,
            delta_ms,
            mode,
            members,
        } => {
            match lookup(name.clone()) {
                Ok(_) => return Err(format!("a segment called {name} exists")),
                Err(unanswered) if !unanswered.is_empty() => {
                    tracing::warn!(%name, ?unanswered, "creating a segment some members did not say they lack");
                }
                Err(_) => {}
            }
            let pages = bytes.div_ceil(netram_proto::PAGE_SIZE as u64) as u32;
            let meta = Meta {
                pages,
                delta_ms,
                uid,
                mode,
            };
            let id = fastrand::u64(1..);
            let fd = door
                .call(move |a| {
                    a.add(id, &name, meta, Role::Library(members.as_deref()))
                        .map_err(|e| e.to_string())
                        .and_then(dup)
                })
                .ok_or("the agent stopped")??;
            opened.push(id);
            Ok((format!("ok {id:x} {pages}"), Some(fd)))
        }
        Request::Attach { name } => {
            let found = lookup(name.clone()).map_err(|unanswered| {
                if unanswered.is_empty() {
                    format!("no segment called {name}")
                } else {
                    format!("no segment called {name} found; nodes {unanswered:?} did not answer")
                }
            })?;
            if !permitted(uid, &found.meta) {
                return Err(format!(
                    "permission denied: segment {name} is uid {}'s, mode {:o}",
                    found.meta.uid, found.meta.mode
                ));
            }
            let id = found.segment;
            let fd = door
                .call(move |a| {
                    if a.copy(id).is_none() {
                        if let Err(e) = a.add(id, &name, found.meta, Role::Site(found.library)) {
                            return Err(e.to_string());
                        }
                    }
                    dup(a.copy(id).expect("added").fd())
                })
                .ok_or("the agent stopped")??;
            let _ = node;
            opened.push(id);
            Ok((format!("ok {id:x} {}", found.meta.pages), Some(fd)))
        }
        Request::Lookup { name } => {
            let found = lookup(name.clone()).map_err(|_| format!("no segment called {name}"))?;
            let m = found.meta;
            Ok((
                format!("ok {:x} {} {} {:o}", found.segment, m.pages, m.uid, m.mode),
                None,
            ))
        }
        Request::Unlink { name } => {
            let found = lookup(name.clone()).map_err(|_| format!("no segment called {name}"))?;
            if uid != 0 && uid != found.meta.uid {
                return Err(format!(
                    "permission denied: segment {name} is uid {}'s",
                    found.meta.uid
                ));
            }
            let members = members();
            door.call(move |a| a.unlink(found.segment, &members))
                .ok_or("the agent stopped")?;
            Ok(("ok".into(), None))
        }
        Request::Join { segment } => {
            let meta = door
                .call(move |a| a.meta(segment))
                .ok_or("the agent stopped")?
                .ok_or_else(|| format!("segment {segment:x} is not attached here"))?;
            if !permitted(uid, &meta) {
                return Err("permission denied".into());
            }
            opened.push(segment);
            Ok(("ok".into(), None))
        }
        Request::View {
            segment,
            base,
            pages,
        } => {
            if !opened.contains(&segment) {
                return Err("map only a segment created or attached on this connection".into());
            }
            let uffd = fd.ok_or("a view needs its userfaultfd")?;
            let view = View {
                uffd: netram_uffd::sys::Uffd::from_child(uffd),
                base,
                pages,
                pid,
                number: 0,
            };
            let number = door
                .call(move |a| a.add_view(segment, view).map_err(|e| e.to_string()))
                .ok_or("the agent stopped")??;
            views.push((segment, number));
            Ok(("ok".into(), None))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that takes nothing (here: one that cannot even be found) never makes the agent
    /// wait: what is sent to it beyond `LINK_QUEUE_BYTES` is dropped at once and counted.
    #[test]
    fn a_peer_that_takes_nothing_never_blocks_the_sender() {
        let counters = Arc::new(LinkCounters::default());
        let shutdown = Arc::new(AtomicBool::new(false));
        let links = Arc::new(Links {
            node: 1,
            incarnation: 1,
            security: Security::Insecure,
            shared: Weak::new(),
            queues: Mutex::new(HashMap::new()),
            shutdown: shutdown.clone(),
            counters: counters.clone(),
            agent: std::sync::OnceLock::new(),
        });
        const FRAME: usize = 64 << 10;
        let frames = LINK_QUEUE_BYTES / FRAME + 64;
        let started = std::time::Instant::now();
        for _ in 0..frames {
            links.send(7, vec![0u8; FRAME]);
        }
        // The link's thread holds its first batch (up to 1 MiB) while it looks for the peer
        // (~2 s): everything else stays queued up to the limit, the rest is dropped.
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "sending waited: {:?}",
            started.elapsed()
        );
        let over = counters.frames_overflowed.load(Ordering::Relaxed);
        assert!(
            (64..=64 + (1 << 20) / FRAME as u64).contains(&over),
            "{over} frames dropped"
        );
        assert_eq!(counters.frames_lost.load(Ordering::Relaxed), over);
        let queued = links.queues.lock().unwrap()[&7]
            .queued_bytes
            .load(Ordering::SeqCst);
        assert!(queued <= LINK_QUEUE_BYTES, "{queued} bytes queued");
        shutdown.store(true, Ordering::SeqCst);
    }
}
