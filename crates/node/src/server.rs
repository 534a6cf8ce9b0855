//! The page server: `netram serve`.
//!
//! One arena of frames is mapped at start from the configured capacity; a `netram-store` indexes
//! it. An accept thread hands each connection to its own thread (at most `max_connections`),
//! which reads the handshake, then reads frames, runs a whole batch of them against the store
//! under one lock acquisition, and writes all their replies with one `write`. A reaper thread
//! expires sessions whose lease ran out (Anemone §2.5).
//!
//! Bad input from the network never panics the daemon and never stalls other clients: a
//! malformed, truncated, oversized or wrong-version frame closes that connection, with the reason
//! logged and counted (one counter per reason, exported by STATS).
//!
//! Under dynamic parity, an overwrite or delete of a member page waits for its group's holder
//! ([`crate::peers`]): the connection thread lets go of the store, makes the round trip to the
//! holder, then takes the store again to finish the request.
//!
//! Lock order: the store's mutex is never held across socket I/O, nor while a peer connection's
//! lock is taken.

use crate::framing::FrameBuffer;
use crate::latency::{PmQos, DEFAULT_SPIN};
use crate::peers::Peers;
use netram_proto::{
    decode_request, DecodeError, Hello, Welcome, WelcomeStatus, HELLO_LEN, MAX_BATCH,
    MAX_FRAME_LEN, PAGE_SIZE, PROTOCOL_VERSION,
};
use netram_store::serve::{self, Outcome};
use netram_store::{SessionHandle, Store, StoreConfig, StoreError};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a new connection has to send its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often blocked threads look at the shutdown flag.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub capacity_bytes: u64,
    pub lease_period: Duration,
    pub max_connections: usize,
    pub max_sessions: usize,
    /// Requests a client may have in flight per connection (Anemone's RMAP window).
    pub window: u32,
    pub low_latency: bool,
    /// Lock the arena into RAM (mlock), so that stored pages are never swapped out.
    pub lock_memory: bool,
    /// This server's node id, announced in the handshake.
    pub node: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7077)),
            capacity_bytes: 256 << 20,
            lease_period: Duration::from_secs(2),
            max_connections: 256,
            max_sessions: 4096,
            window: 64,
            low_latency: false,
            lock_memory: false,
            node: 0,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("capacity {0} bytes is less than one {PAGE_SIZE}-byte page")]
    CapacityTooSmall(u64),
    #[error("cannot map an arena of {bytes} bytes: {source}")]
    Arena { bytes: u64, source: io::Error },
    #[error(
        "cannot lock the arena in memory (try without --lock-memory, or raise RLIMIT_MEMLOCK): {0}"
    )]
    Lock(io::Error),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: io::Error },
}

macro_rules! node_counters {
    ($($(#[doc = $doc:literal])* $name:ident),* $(,)?) => {
        /// Connection-level counters, one per reason, beside the store's page counters.
        #[derive(Debug, Default)]
        pub struct NodeCounters { $($(#[doc = $doc])* pub $name: AtomicU64,)* }
        impl NodeCounters {
            pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name.load(Ordering::Relaxed))),*]
            }
        }
    };
}

node_counters! {
    connections_accepted,
    /// Refused at the handshake: `max_connections` reached.
    connections_refused_busy,
    /// The peer sent no complete handshake in time, or hung up during it.
    handshakes_incomplete,
    /// Not a netram peer (wrong magic).
    handshakes_bad_magic,
    handshakes_bad_version,
    handshakes_refused_sessions_full,
    handshakes_refused_stale_incarnation,
    /// Frames refused, by reason; each closed its connection.
    frames_rejected_bad_length,
    frames_rejected_bad_version,
    frames_rejected_unknown_kind,
    frames_rejected_malformed,
    /// The peer closed its connection in the middle of a frame.
    frames_truncated_at_close,
    requests_served,
}

struct Shared {
    store: Mutex<Store<Arena>>,
    peers: Peers,
    counters: NodeCounters,
    shutdown: Arc<AtomicBool>,
    cfg: ServerConfig,
    start: Instant,
    /// Wall-clock nanoseconds at start: grows across restarts of this server.
    incarnation: u64,
    connections: AtomicUsize,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }
    fn store(&self) -> MutexGuard<'_, Store<Arena>> {
        // A panic while holding the lock would be a bug in the store; the data it guards is
        // plain memory, so carrying on with it is no worse than the bug itself.
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// The frame arena: one anonymous mapping, never a heap allocation per page.
struct Arena(memmap2::MmapMut);

impl AsRef<[u8]> for Arena {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}
impl AsMut<[u8]> for Arena {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// A running server; stopping it (or dropping it) stops every thread it started.
pub struct Server {
    shared: Arc<Shared>,
    addr: SocketAddr,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("addr", &self.addr).finish()
    }
}

impl Server {
    /// Maps the arena, binds the socket and starts serving. `shutdown` stops it when set (the
    /// CLI wires it to SIGINT and SIGTERM).
    pub fn start(cfg: ServerConfig, shutdown: Arc<AtomicBool>) -> Result<Server, ServerError> {
        let frames = cfg.capacity_bytes / PAGE_SIZE as u64;
        if frames == 0 {
            return Err(ServerError::CapacityTooSmall(cfg.capacity_bytes));
        }
        let bytes = frames * PAGE_SIZE as u64;
        let map = memmap2::MmapOptions::new()
            .len(bytes as usize)
            .map_anon()
            .map_err(|source| ServerError::Arena { bytes, source })?;
        // Huge pages for the arena: random GETs over gigabytes of frames would otherwise take a
        // TLB miss each. Advice only; without transparent huge pages it changes nothing.
        if let Err(e) = map.advise(memmap2::Advice::HugePage) {
            tracing::debug!("no huge pages for the arena: {e}");
        }
        if cfg.lock_memory {
            map.lock().map_err(ServerError::Lock)?;
        }
        let store = Store::new(
            Arena(map),
            StoreConfig {
                lease_period_ms: cfg.lease_period.as_millis() as u64,
                max_sessions: cfg.max_sessions,
            },
        );
        let listener = TcpListener::bind(cfg.listen).map_err(|source| ServerError::Listen {
            addr: cfg.listen,
            source,
        })?;
        let addr = listener
            .local_addr()
            .map_err(|source| ServerError::Listen {
                addr: cfg.listen,
                source,
            })?;
        if !addr.ip().is_loopback() {
            tracing::warn!(
                "listening on {addr}, beyond loopback: netram has no authentication yet, so any \
                 host that can reach this port can read and overwrite the pages stored here"
            );
        }
        tracing::info!(%addr, capacity_pages = frames, lease_ms = cfg.lease_period.as_millis() as u64, "serving");
        let incarnation = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        let shared = Arc::new(Shared {
            store: Mutex::new(store),
            peers: Peers::new(cfg.node, incarnation, addr),
            counters: NodeCounters::default(),
            shutdown,
            cfg,
            start: Instant::now(),
            incarnation,
            connections: AtomicUsize::new(0),
        });
        let accept = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("netram-accept".into())
                .spawn(move || accept_loop(listener, shared))
                .expect("spawn accept thread")
        };
        let reaper = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("netram-reaper".into())
                .spawn(move || reaper_loop(shared))
                .expect("spawn reaper thread")
        };
        Ok(Server {
            shared,
            addr,
            threads: vec![accept, reaper],
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The page store's counters followed by the connection counters and gauges.
    pub fn stats(&self) -> Vec<(&'static str, u64)> {
        stats_list(&self.shared.store(), &self.shared)
    }

    /// Signals every thread to stop and waits for them.
    pub fn stop(mut self) {
        self.stop_threads();
    }

    fn stop_threads(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // Connection threads see the flag within POLL_INTERVAL.
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.shared.connections.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

/// Gauges, the store's counters and the connection counters, in that order. The caller holds
/// the store's lock (so a STATS request answers from inside its batch).
fn stats_list(store: &Store<Arena>, shared: &Shared) -> Vec<(&'static str, u64)> {
    let mut out = serve::store_stats(store);
    out.insert(
        5,
        (
            "connections",
            shared.connections.load(Ordering::Relaxed) as u64,
        ),
    );
    out.extend(shared.counters.snapshot());
    out
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let timeout = Timespec {
        tv_sec: 0,
        tv_nsec: POLL_INTERVAL.as_nanos() as _,
    };
    while !shared.shutdown.load(Ordering::SeqCst) {
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(e) => {
                tracing::error!("poll on the listening socket: {e}");
                std::thread::sleep(POLL_INTERVAL);
                continue;
            }
        }
        let (stream, peer) = match listener.accept() {
            Ok(s) => s,
            Err(e) => {
                // EMFILE and friends: wait rather than spin.
                tracing::warn!("accept: {e}");
                std::thread::sleep(POLL_INTERVAL);
                continue;
            }
        };
        Shared::bump(&shared.counters.connections_accepted);
        let n = shared.connections.fetch_add(1, Ordering::SeqCst);
        let conn_shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("netram-conn-{peer}"))
            .spawn(move || {
                let busy = n >= conn_shared.cfg.max_connections;
                if let Err(e) = serve_connection(stream, &conn_shared, busy) {
                    tracing::debug!(%peer, "connection ended: {e}");
                }
                conn_shared.connections.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start a connection thread: {e}");
            shared.connections.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn reaper_loop(shared: Arc<Shared>) {
    let period = (shared.cfg.lease_period / 4).max(Duration::from_millis(10));
    let mut next = Instant::now() + period;
    while !shared.shutdown.load(Ordering::SeqCst) {
        std::thread::sleep(POLL_INTERVAL.min(period));
        if Instant::now() >= next {
            let now = shared.now_ms();
            let n = shared.store().expire(now);
            if n > 0 {
                tracing::info!("expired {n} session(s) whose lease ran out; their pages are free");
            }
            next = Instant::now() + period;
        }
    }
}

/// Why a connection ended early, for the debug log.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("handshake refused: {0:?}")]
    Refused(WelcomeStatus),
    #[error("rejected frame: {0}")]
    Frame(DecodeError),
    #[error("bad handshake: {0}")]
    Handshake(DecodeError),
}

fn serve_connection(mut stream: TcpStream, shared: &Shared, busy: bool) -> Result<(), ConnError> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let peer = stream.peer_addr()?;
    let mut hello = [0u8; HELLO_LEN];
    if let Err(e) = stream.read_exact(&mut hello) {
        Shared::bump(&shared.counters.handshakes_incomplete);
        return Err(e.into());
    }
    let hello = match Hello::decode(&hello) {
        Ok(h) => h,
        Err(e) => {
            Shared::bump(&shared.counters.handshakes_bad_magic);
            tracing::warn!(%peer, "closing connection: bad handshake: {e}");
            return Err(ConnError::Handshake(e));
        }
    };
    let (status, session) = if hello.version != PROTOCOL_VERSION {
        Shared::bump(&shared.counters.handshakes_bad_version);
        tracing::warn!(%peer, "closing connection: protocol version {} (this server speaks {PROTOCOL_VERSION})", hello.version);
        (WelcomeStatus::VersionUnsupported, None)
    } else if busy {
        Shared::bump(&shared.counters.connections_refused_busy);
        tracing::warn!(%peer, "refusing connection: {} connections is the limit", shared.cfg.max_connections);
        (WelcomeStatus::Busy, None)
    } else {
        match shared.store().open_session(
            hello.node,
            hello.incarnation,
            hello.session,
            shared.now_ms(),
        ) {
            Ok(h) => (WelcomeStatus::Ok, Some(h)),
            Err(StoreError::StaleIncarnation { .. }) => {
                Shared::bump(&shared.counters.handshakes_refused_stale_incarnation);
                (WelcomeStatus::StaleIncarnation, None)
            }
            Err(_) => {
                Shared::bump(&shared.counters.handshakes_refused_sessions_full);
                (WelcomeStatus::TooManySessions, None)
            }
        }
    };
    let welcome = {
        let store = shared.store();
        Welcome {
            version: PROTOCOL_VERSION,
            status,
            window: shared.cfg.window,
            server_node: shared.cfg.node,
            server_incarnation: shared.incarnation,
            capacity_pages: store.capacity_pages(),
            free_pages: store.free_pages(),
            lease_period_ms: shared.cfg.lease_period.as_millis() as u32,
            max_frame_len: MAX_FRAME_LEN as u32,
            max_batch: MAX_BATCH as u32,
        }
    };
    stream.write_all(&welcome.encode())?;
    let Some(session) = session else {
        return Err(ConnError::Refused(status));
    };
    tracing::debug!(%peer, node = hello.node, incarnation = hello.incarnation, session = hello.session, "session open");

    let _qos = if shared.cfg.low_latency {
        PmQos::hold()
    } else {
        None
    };
    let spin = if shared.cfg.low_latency {
        DEFAULT_SPIN
    } else {
        Duration::ZERO
    };
    stream.set_read_timeout(Some(POLL_INTERVAL))?;
    let mut rbuf = FrameBuffer::new();
    let mut wbuf: Vec<u8> = Vec::with_capacity(64 * 1024);
    loop {
        match rbuf.fill(&mut stream, spin) {
            Ok(0) => {
                if rbuf.pending() > 0 {
                    Shared::bump(&shared.counters.frames_truncated_at_close);
                    tracing::warn!(%peer, "connection closed in the middle of a frame ({} bytes pending)", rbuf.pending());
                }
                return Ok(());
            }
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                if shared.shutdown.load(Ordering::SeqCst) {
                    return Ok(());
                }
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        }
        let closed = handle_frames(&mut rbuf, &mut wbuf, shared, session).map_err(|e| {
            let c = &shared.counters;
            Shared::bump(match e {
                DecodeError::BadLength { .. } => &c.frames_rejected_bad_length,
                DecodeError::UnsupportedVersion { .. } => &c.frames_rejected_bad_version,
                DecodeError::UnknownKind(_) => &c.frames_rejected_unknown_kind,
                _ => &c.frames_rejected_malformed,
            });
            tracing::warn!(%peer, "closing connection: rejected frame: {e}");
            e
        });
        // Replies to the frames before a bad one are still owed.
        if !wbuf.is_empty() {
            stream.write_all(&wbuf)?;
            wbuf.clear();
        }
        match closed {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => return Err(ConnError::Frame(e)),
        }
    }
}

/// Runs every whole frame in the buffer against the store, under one lock acquisition (let go
/// only while a request waits for parity holders), and appends the replies to `out`. Returns
/// true when the client closed its session.
fn handle_frames(
    rbuf: &mut FrameBuffer,
    out: &mut Vec<u8>,
    shared: &Shared,
    h: SessionHandle,
) -> Result<bool, DecodeError> {
    let mut now = shared.now_ms();
    let mut store = shared.store();
    let mut served = 0u32;
    let result = loop {
        let frame = match rbuf.next_frame() {
            Ok(Some(f)) => f,
            Ok(None) => break Ok(false),
            Err(e) => break Err(e),
        };
        let (id, req) = match decode_request(frame) {
            Ok(r) => r,
            Err(e) => break Err(e),
        };
        served += 1;
        let rps = store.note_requests(1, now);
        let stats = |st: &Store<Arena>| stats_list(st, shared);
        match serve::handle_request(&mut store, h, id, req, now, rps, out, stats) {
            Outcome::Open => {}
            Outcome::Closed => break Ok(true),
            Outcome::Forward(fwd) => {
                drop(store);
                let outcomes = shared.peers.forward(&fwd.deltas);
                store = shared.store();
                now = shared.now_ms();
                serve::finish_forward(&mut store, h, fwd, &outcomes, now, rps, out);
            }
        }
    };
    shared
        .counters
        .requests_served
        .fetch_add(u64::from(served), Ordering::Relaxed);
    result
}
