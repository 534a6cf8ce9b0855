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
//! **Limits, each enforced by the side that pays for it** (TigerBeetle's "a limit on
//! everything"). Nothing a peer sends can make the daemon hold more than these:
//!
//! * connections, in two pools (`netram_policy::admission`), checked in the accept thread
//!   *before* a thread is started and again when the handshake is over: handshakes in progress
//!   at most `max_handshakes` in all, `max_handshakes_per_addr` per address and
//!   `max_handshakes_per_subnet` per /24 (IPv6: /64), and when they are all taken a newcomer
//!   takes the slot of the oldest handshake of the subnets that hold the most (that socket is
//!   shut down at once); established connections (over TLS, a certificate of the cluster
//!   proven) at most `max_connections` in all and `max_connections_per_peer` per client (the
//!   certificate's node id; without TLS, the address), so that strangers holding every
//!   handshake slot they can never take a member's place. A connection over a limit is
//!   answered Busy (at accept: without a thread) and closed;
//! * the handshake: one deadline for all of it (`handshake_timeout`), not one per read, so a
//!   byte at a time does not keep a slot;
//! * an established connection with no whole frame for `idle_timeout` (three lease periods by
//!   default: a live client refreshes every half period, and a silent one's session is dead by
//!   then) is closed, and so is one whose replies cannot be written for `write_timeout`;
//! * buffered work per connection: frames are served at most `window` at a time (the credit
//!   window the handshake announces) and the replies written before more requests are read, and
//!   never more than [`REPLY_BUFFER_MAX`] bytes of replies wait: a client that sends and never
//!   reads is held back by TCP, not buffered for;
//! * sessions and frames per client (the store's `max_peer_sessions`, `max_peer_pages`);
//! * a panic in one connection's code (a bug) ends that connection only: its slot is given back
//!   by a guard, and the store, whose lock it poisoned, has its invariants checked before it is
//!   used again (if they do not hold, the daemon stops rather than serve from a broken store).
//!
//! Under dynamic parity, an overwrite or delete of a member page waits for its group's holder
//! ([`crate::peers`]): the connection thread lets go of the store, makes the round trip to the
//! holder, then takes the store again to finish the request.
//!
//! Lock order: the store's mutex is never held across socket I/O, nor while a peer connection's
//! lock is taken.

use crate::peers::Peers;
use netram_net::latency::{PmQos, DEFAULT_SPIN};
use netram_net::record::{set_clear_tail, TRAILER_LEN};
use netram_net::{reserve_tags, tls, Credentials, FrameBuffer, FrameKeys, Security};
use netram_policy::admission::{Admission, AdmissionConfig, ConnId, Refused, Source};
use netram_proto::{
    decode_request, get_reply_tail, DecodeError, Hello, Welcome, WelcomeStatus, HELLO_END_ON_CLOSE,
    HELLO_LEN, HELLO_SEALED_PAGES, MAX_BATCH, MAX_FRAME_LEN, PAGE_SIZE, PROTOCOL_VERSION,
};
use netram_store::serve::{self, Outcome};
use netram_store::{Peer, SessionHandle, Store, StoreConfig, StoreError};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often blocked threads look at the shutdown flag.
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// Reply bytes a connection buffers before it stops serving requests and writes them.
pub const REPLY_BUFFER_MAX: usize = 2 * MAX_FRAME_LEN;

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
    /// Established connections of one client (the certificate's node id; without TLS, the
    /// address) at most.
    pub max_connections_per_peer: usize,
    /// Handshakes in progress at once: in all, from one address, from one /24 (IPv6: /64).
    pub max_handshakes: usize,
    pub max_handshakes_per_addr: usize,
    pub max_handshakes_per_subnet: usize,
    /// Live sessions one client (address) may hold.
    pub max_peer_sessions: u32,
    /// Operations per second one client may make, each page of a batch one (0: no limit).
    /// Over it, its connections are read no further until its rate allows (the store's
    /// `charge`).
    pub max_client_ops_per_s: u32,
    /// Bytes of frames one client (address) may hold; `None`: three quarters of the capacity,
    /// so that one client can never fill the arena and starve the others.
    pub max_client_bytes: Option<u64>,
    /// The whole handshake must arrive within this.
    pub handshake_timeout: Duration,
    /// A connection with no whole frame for this long is closed; `None`: three lease periods.
    pub idle_timeout: Option<Duration>,
    /// A connection whose replies cannot be written for this long is closed.
    pub write_timeout: Duration,
    /// Test-only fault point: a STATS request panics while the store's lock is held (to test
    /// that a panic is contained to its connection). Never set it in production.
    pub fault_panic_on_stats: bool,
    /// Who may connect: mutual TLS against the cluster's CA (the default of `netram serve`),
    /// or clear TCP on loopback for development, said explicitly.
    pub security: Security,
    /// The offer follows the machine's memory ([`crate::donor`]); `capacity_bytes` is then the
    /// most it may reach (the arena), and the offer starts at the floor.
    pub adapt: Option<crate::donor::AdaptConfig>,
    /// Membership: seeds to join through, the address to be reached at ([`crate::gossip`]).
    pub gossip: crate::gossip::GossipConfig,
    /// Where `/metrics` is answered over TCP (`http.rs`); `None`: nowhere.
    pub metrics: Option<SocketAddr>,
    /// The token a `/metrics` request must bear (`Authorization: Bearer`); required when
    /// `metrics` is beyond loopback.
    pub metrics_token: Option<String>,
    /// The control socket, where local clients ask for `/members` (`http.rs`); `None`:
    /// none.
    pub control: Option<std::path::PathBuf>,
    /// The shared-memory socket, where local processes create and attach segments
    /// (`shm.rs`); `None`: none (the daemon still serves other machines' segments' messages).
    pub shm_socket: Option<std::path::PathBuf>,
    /// The speed of this machine's links, megabits a second, by which shared-memory pages
    /// are compressed when that pays (`netram_proto::compress`); 0: never (zero pages still
    /// travel as a flag).
    pub shm_link_mbps: u32,
    /// The metrics address was chosen by the operator: failing to bind it stops the start.
    /// Otherwise (a default) the daemon warns and serves without it.
    pub metrics_required: bool,
}

impl ServerConfig {
    /// The frames one client may hold, with the default applied.
    pub fn max_peer_pages(&self) -> u64 {
        let bytes = self.max_client_bytes.unwrap_or(self.capacity_bytes / 4 * 3);
        (bytes / PAGE_SIZE as u64).max(1)
    }

    /// The idle timeout, with the default applied.
    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
            .unwrap_or(self.lease_period * netram_store::LEASE_PERIODS as u32)
    }
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
            max_connections_per_peer: 64,
            max_handshakes: 128,
            max_handshakes_per_addr: 8,
            max_handshakes_per_subnet: 32,
            max_peer_sessions: 64,
            max_client_ops_per_s: 0,
            max_client_bytes: None,
            adapt: None,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: None,
            write_timeout: Duration::from_secs(10),
            fault_panic_on_stats: false,
            security: Security::Insecure,
            gossip: crate::gossip::GossipConfig::default(),
            metrics: None,
            metrics_token: None,
            control: None,
            shm_socket: None,
            shm_link_mbps: 1000,
            metrics_required: false,
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
    #[error(
        "refusing to serve {addr} without TLS: clear TCP is for loopback development only \
         (give the node's credentials, `netram cluster init`)"
    )]
    InsecureBeyondLoopback { addr: SocketAddr },
    #[error(
        "a server's certificate must name the server role (issue it with `netram keygen --server`)"
    )]
    NotAServerCertificate,
    #[error("{0}")]
    Adapt(#[from] netram_policy::donor::DonorConfigError),
    #[error("--adapt gives memory back to the kernel, which --lock-memory forbids: choose one")]
    AdaptLocked,
    #[error(
        "listening on {0}, a wildcard address, with seeds to join: give the address other \
         nodes reach this one at (--advertise)"
    )]
    NoAdvertise(SocketAddr),
    #[error("cannot open the membership socket (UDP) on {addr}: {source}")]
    Gossip { addr: SocketAddr, source: io::Error },
    #[error(
        "cannot answer metrics on {addr} (another daemon there? give --metrics ADDR, or \
         --metrics off): {source}"
    )]
    Metrics { addr: SocketAddr, source: io::Error },
    #[error(
        "metrics on {0}, beyond loopback, without a token: give --metrics-token-file (what \
         this node counts, its members' ids and addresses are nobody else's business)"
    )]
    MetricsWithoutToken(SocketAddr),
    #[error("cannot open the control socket {path}: {why}")]
    Control {
        path: std::path::PathBuf,
        why: String,
    },
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
    /// Refused (answered Busy): `max_connections` reached when the handshake ended, or every
    /// handshake slot held by connections that may not be taken over.
    connections_refused_busy,
    /// Refused (answered Busy): `max_connections_per_peer` reached for its client when the
    /// handshake ended.
    connections_refused_peer_limit,
    /// Refused at accept: handshakes in progress from its address, or from its subnet, at
    /// their limit.
    connections_refused_addr_handshakes,
    connections_refused_subnet_handshakes,
    /// Handshakes in progress shut down to give their slot to a newcomer (all were taken).
    handshakes_taken_over,
    /// Closed: no whole frame for `idle_timeout`.
    connections_closed_idle,
    /// Closed: replies could not be written for `write_timeout` (a client that does not read).
    connections_closed_write_timeout,
    /// Connections ended by a panic in their code (a bug), contained to them.
    connection_panics,
    /// Times a connection stopped serving requests to write replies first (a full window or
    /// `REPLY_BUFFER_MAX` bytes of replies).
    replies_flushed_early,
    /// GMS epoch messages that came over TCP, dropped: they travel in membership packets
    /// (`crate::gms`).
    gms_epoch_messages_ignored,
    /// Distributed shared memory's messages handed to the agent, and refused (from a
    /// connection that is not a daemon's).
    dsm_frames_refused,
    /// GMS epoch messages (in membership packets) sent, received and refused, by reason: not
    /// an epoch message that decodes; from a node that is not a live member; signed by another
    /// node than the one it names.
    gms_messages_sent,
    gms_messages_received,
    gms_refused_malformed,
    gms_refused_not_member,
    gms_refused_wrong_sender,
    /// The peer sent no complete handshake in time, or hung up during it.
    handshakes_incomplete,
    /// Not a netram peer (wrong magic).
    handshakes_bad_magic,
    handshakes_bad_version,
    handshakes_refused_sessions_full,
    /// Refused: the client's address holds `max_peer_sessions` sessions.
    handshakes_refused_peer_sessions,
    handshakes_refused_stale_incarnation,
    /// TLS failed: no certificate of the cluster, a revoked one, a protocol error, or a peer
    /// that hung up or ran out of time during it.
    handshakes_tls_failed,
    /// Frames refused because their record did not authenticate (forged, damaged, replayed).
    frames_rejected_unauthenticated,
    /// Established connections closed because their certificate was revoked since.
    connections_closed_revoked,
    /// Parity deltas not sent: the server at the holder's address was not the node the
    /// page's owner named (a client pointing this server at an address of its choosing).
    parity_holders_wrong_node,
    /// Pages not handed over: the server at the migration target's address was not the node
    /// the page's owner named.
    migration_targets_wrong_node,
    /// MIGRATEs refused without a connection: their target is not a live member of this
    /// server's cluster (checked once membership knows another member).
    migration_targets_not_member,
    /// Parity deltas and handovers not sent: this server already keeps connections to as
    /// many peer servers as it may (`peers::MAX_PEERS`), and the holder named is new.
    peer_servers_refused,
    /// Frames refused, by reason; each closed its connection.
    frames_rejected_bad_length,
    frames_rejected_bad_version,
    frames_rejected_unknown_kind,
    frames_rejected_malformed,
    /// The peer closed its connection in the middle of a frame.
    frames_truncated_at_close,
    requests_served,
    /// Membership packets (UDP) received and sent.
    gossip_packets_received,
    gossip_packets_sent,
    /// Membership packets refused, by reason: not a packet; unsigned in a secure cluster (or
    /// clear from beyond loopback); a certificate or signature that does not check; sent more
    /// than a minute from now; signed by another node than the one it claims; refused by SWIM
    /// itself.
    gossip_refused_malformed,
    gossip_refused_unsigned,
    gossip_refused_bad_signature,
    /// Signed by a node whose certificate has no server role (a client is not a member).
    gossip_refused_not_server,
    gossip_refused_stale,
    gossip_refused_wrong_sender,
    gossip_refused_swim,
    /// From an address that is not a member's, over the strangers' budget
    /// (`netram_member::gate`), and from a member's address over its own.
    gossip_refused_rate,
    gossip_refused_member_rate,
    /// Members this node saw declared down.
    members_declared_down,
    /// Requests answered at the metrics endpoint, and refused there (incomplete, too big, too
    /// slow).
    http_requests_served,
    http_requests_refused,
}

pub(crate) struct Shared {
    store: Mutex<Store<Arena>>,
    /// Who is in the cluster ([`crate::gossip`]).
    membership: Mutex<netram_member::Membership>,
    /// This server's credentials (over TLS): swapped when the revocation list changes.
    creds: Mutex<Option<Arc<Credentials>>>,
    /// Bumped at every change of the revocation list: connections look at their certificate
    /// again.
    crl_generation: AtomicU64,
    peers: Peers,
    pub(crate) counters: NodeCounters,
    pub(crate) shutdown: Arc<AtomicBool>,
    cfg: ServerConfig,
    start: Instant,
    /// Wall-clock nanoseconds at start: grows across restarts of this server.
    incarnation: u64,
    /// Who holds a connection slot, and the sockets of the handshakes in progress (to shut
    /// one down when a newcomer takes its slot).
    admission: Mutex<Admission>,
    handshaking: Mutex<HashMap<ConnId, TcpStream>>,
    /// What clients and `/metrics` read of this node's GMS epochs (`crate::gms`).
    gms_view: Mutex<crate::gms::View>,
    /// Distributed shared memory's agent and links (`crate::shm`), once started.
    pub(crate) shm: std::sync::OnceLock<crate::shm::Shm>,
}

/// A connection's place in the limits, given back when it is dropped — also when the
/// connection's thread panics, or cannot be started.
struct ConnSlot {
    shared: Arc<Shared>,
    id: ConnId,
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        lock(&self.shared.handshaking).remove(&self.id);
        lock(&self.shared.admission).end(self.id);
    }
}

/// A lock whose data stays consistent whatever a panicking holder did (counters, maps of
/// counts updated in one step).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// This server's node id: its certificate's over TLS.
    fn node(&self) -> u64 {
        lock(&self.creds)
            .as_ref()
            .map_or(self.cfg.node, |c| c.identity.node)
    }

    pub(crate) fn creds(&self) -> Option<Arc<Credentials>> {
        lock(&self.creds).clone()
    }

    pub(crate) fn membership(&self) -> MutexGuard<'_, netram_member::Membership> {
        lock(&self.membership)
    }

    /// Whether a MIGRATE may hand pages to `to`: only to a member this node does not believe
    /// down, under the node id and address the owner named (a client may not make this server
    /// connect wherever it likes: a blind probe of any port). A server that knows no other
    /// member (started without `--seed`, its clients listing the servers themselves) refuses
    /// every MIGRATE; its clients move those pages through themselves. The target must still
    /// prove to be the node named (`peers`).
    pub(crate) fn may_hand_over_to(&self, to: netram_store::serve::Holder) -> bool {
        let m = self.membership();
        let me = m.me();
        m.members().iter().any(|v| {
            v.node.id != me.id
                && v.node.id == to.node
                && v.node.addr == to.addr
                && v.liveness != netram_member::Liveness::Down
        })
    }

    pub(crate) fn gms_view(&self) -> MutexGuard<'_, crate::gms::View> {
        lock(&self.gms_view)
    }

    pub(crate) fn members(&self) -> netram_member::MemberList {
        let now = self.now_ms();
        self.membership().rows(now)
    }

    /// Pages offered, pages free for new pages and requests served in the last second: what
    /// this node announces to the cluster.
    pub(crate) fn offer_and_load(&self) -> (u64, u64, u32) {
        let now = self.now_ms();
        let mut s = self.store();
        let rps = s.note_requests(0, now);
        (s.capacity_pages(), s.room(), rps)
    }

    /// Every statistic, as `netram stats` lists them.
    pub(crate) fn stats(&self) -> Vec<(&'static str, u64)> {
        stats_list(&self.store(), self)
    }

    pub(crate) fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// The store. If a connection panicked while holding it (a bug), the store may be half
    /// way through a change: its invariants are checked before anyone uses it again, and if
    /// they do not hold the daemon stops rather than serve wrong pages.
    pub(crate) fn store(&self) -> MutexGuard<'_, Store<Arena>> {
        match self.store.lock() {
            Ok(g) => g,
            Err(poisoned) => {
                let g = poisoned.into_inner();
                match g.invariant_violation() {
                    None => {
                        tracing::warn!(
                            "a connection panicked holding the store; its invariants hold, \
                             serving on"
                        );
                        self.store.clear_poison();
                    }
                    Some(why) => {
                        tracing::error!(
                            "a connection panicked holding the store and left it inconsistent \
                             ({why}): stopping"
                        );
                        self.shutdown.store(true, Ordering::SeqCst);
                    }
                }
                g
            }
        }
    }

    /// Takes a connection slot for a peer at `ip`, or says which limit refuses it.
    /// A handshake slot for a connection from `ip` (its socket kept to shut it down, should a
    /// newcomer take its slot), or why not.
    fn take_slot(self: &Arc<Self>, stream: &TcpStream, ip: IpAddr) -> Result<ConnSlot, Refused> {
        let handle = stream.try_clone().map_err(|_| Refused::Handshakes)?;
        let admitted = lock(&self.admission).begin(Source::Ip(ip))?;
        let mut handshaking = lock(&self.handshaking);
        if let Some(old) = admitted.evict.and_then(|id| handshaking.remove(&id)) {
            Shared::bump(&self.counters.handshakes_taken_over);
            let _ = old.shutdown(std::net::Shutdown::Both);
        }
        handshaking.insert(admitted.id, handle);
        Ok(ConnSlot {
            shared: self.clone(),
            id: admitted.id,
        })
    }

    /// The handshake of the connection in `slot` is over, and it is `client`: it moves to the
    /// established pool, or is refused there.
    fn establish(&self, slot: ConnId, client: &Peer) -> Result<(), Refused> {
        let key = match client {
            Peer::Server(n) | Peer::Node(n) => format!("node {n}"),
            Peer::Addr(ip) => ip.to_string(),
        };
        lock(&self.handshaking).remove(&slot);
        lock(&self.admission).establish(slot, &key)
    }
    pub(crate) fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// The frame arena: one anonymous mapping, never a heap allocation per page.
pub(crate) struct Arena(memmap2::MmapMut);

impl Arena {
    /// Gives the memory of `n` frames from `first` back to the kernel: they read as zeros
    /// afterwards, and the daemon's resident memory falls by as much.
    fn give_back(&self, first: u32, n: u32) {
        let (off, len) = (first as usize * PAGE_SIZE, n as usize * PAGE_SIZE);
        if off + len > self.0.len() {
            return;
        }
        // SAFETY: the frames are free and no longer offered, and the caller holds the store's
        // lock, through which alone the arena's bytes are reached: no reference into them
        // exists, and nothing reads them again before a PUT writes them whole. MADV_DONTNEED
        // on a private anonymous mapping only drops the pages (they read as zeros after).
        let r = unsafe {
            self.0
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, off, len)
        };
        if let Err(e) = r {
            tracing::warn!("cannot give {len} bytes of the arena back: {e}");
        }
    }
}

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
    /// The control socket's file, removed when the server stops.
    control: Option<std::path::PathBuf>,
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
            if cfg.adapt.is_some() {
                return Err(ServerError::AdaptLocked);
            }
            map.lock().map_err(ServerError::Lock)?;
        }
        let adapter = cfg
            .adapt
            .as_ref()
            .map(crate::donor::Adapter::new)
            .transpose()?;
        let mut store = Store::new(
            Arena(map),
            StoreConfig {
                lease_period_ms: cfg.lease_period.as_millis() as u64,
                max_sessions: cfg.max_sessions,
                max_peer_sessions: cfg.max_peer_sessions,
                max_peer_pages: cfg.max_peer_pages(),
                max_peer_ops_per_s: cfg.max_client_ops_per_s,
            },
        );
        if let Some(a) = &adapter {
            // Nothing of the arena is resident yet: nothing to give back.
            store.set_offer(a.offered_frames());
        }
        let (listener, udp, addr) = bind_listen(cfg.listen)?;
        let creds = match &cfg.security {
            Security::Tls(c) if !c.identity.server => {
                return Err(ServerError::NotAServerCertificate)
            }
            Security::Tls(c) => Some(c.clone()),
            Security::Insecure if !addr.ip().is_loopback() => {
                return Err(ServerError::InsecureBeyondLoopback { addr })
            }
            Security::Insecure => {
                tracing::warn!(
                    "serving {addr} over clear TCP, without TLS (--insecure): any process of \
                     this machine can open sessions here and see page keys and versions; for \
                     development only"
                );
                None
            }
        };
        tracing::info!(%addr, capacity_pages = frames, lease_ms = cfg.lease_period.as_millis() as u64, "serving");
        let incarnation = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        let node = creds.as_ref().map_or(cfg.node, |c| c.identity.node);
        let advertised = match cfg.gossip.advertise {
            Some(a) => a,
            None if addr.ip().is_unspecified() && !cfg.gossip.seeds.is_empty() => {
                return Err(ServerError::NoAdvertise(addr))
            }
            None => addr,
        };
        if let Some(a) = cfg.metrics {
            if !a.ip().is_loopback() && cfg.metrics_token.is_none() {
                return Err(ServerError::MetricsWithoutToken(a));
            }
        }
        let metrics = cfg
            .metrics
            .map(|a| {
                TcpListener::bind(a).map_err(|source| ServerError::Metrics { addr: a, source })
            })
            .transpose()?;
        let control = cfg.control.as_deref().map(bind_control).transpose()?;
        let me = crate::gossip::identity(node, advertised, incarnation);
        let member_id = me.id;
        let mut membership =
            netram_member::Membership::new(me, incarnation ^ me.id, cfg.gossip.member.clone(), 0);
        membership.join(&cfg.gossip.seeds);
        let admission = Admission::new(AdmissionConfig {
            max_handshakes: cfg.max_handshakes.max(1),
            max_handshakes_per_addr: cfg.max_handshakes_per_addr.max(1),
            max_handshakes_per_subnet: cfg.max_handshakes_per_subnet.max(1),
            max_established: cfg.max_connections.max(1),
            max_established_per_client: cfg.max_connections_per_peer.max(1),
        });
        let shared = Arc::new(Shared {
            store: Mutex::new(store),
            membership: Mutex::new(membership),
            creds: Mutex::new(creds),
            crl_generation: AtomicU64::new(0),
            peers: Peers::new(node, incarnation, addr, cfg.security.clone()),
            counters: NodeCounters::default(),
            shutdown,
            cfg,
            start: Instant::now(),
            incarnation,
            admission: Mutex::new(admission),
            handshaking: Mutex::new(HashMap::new()),
            gms_view: Mutex::new(Default::default()),
            shm: std::sync::OnceLock::new(),
        });
        // The agent's site id is this node's id in the membership (its certificate's over
        // TLS), which is how other daemons name it.
        let shm = crate::shm::Shm::start(
            &shared,
            member_id,
            incarnation,
            shared.cfg.security.clone(),
            shared.cfg.shm_socket.as_deref(),
            shared.cfg.shm_link_mbps,
        )
        .map_err(|e| ServerError::Control {
            path: shared.cfg.shm_socket.clone().unwrap_or_default(),
            why: format!("shared memory: {e}"),
        })?;
        let _ = shared.shm.set(shm);
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
        let gossip = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("netram-gossip".into())
                .spawn(move || crate::gossip::gossip_loop(shared, udp))
                .expect("spawn membership thread")
        };
        let mut threads = vec![accept, reaper, gossip];
        if let Some(a) = metrics.as_ref().and_then(|l| l.local_addr().ok()) {
            tracing::info!(addr = %a, "metrics at /metrics");
        }
        if let Some(p) = &shared.cfg.control {
            tracing::info!(path = %p.display(), "control socket: /members, /metrics");
        }
        if metrics.is_some() || control.is_some() {
            let listeners = crate::http::Listeners {
                metrics: metrics.map(|l| (l, shared.cfg.metrics_token.clone())),
                control,
            };
            let shared = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("netram-http".into())
                    .spawn(move || crate::http::http_loop(listeners, shared))
                    .expect("spawn metrics thread"),
            );
        }
        if let Some(adapter) = adapter {
            let shared = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("netram-donor".into())
                    .spawn(move || donor_loop(shared, adapter))
                    .expect("spawn donor thread"),
            );
        }
        let control = shared.cfg.control.clone();
        Ok(Server {
            shared,
            addr,
            threads,
            control,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The page store's counters followed by the connection counters and gauges.
    pub fn stats(&self) -> Vec<(&'static str, u64)> {
        self.shared.stats()
    }

    /// What this node believes of the cluster.
    pub fn members(&self) -> netram_member::MemberList {
        self.shared.members()
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
        let open = || {
            let (handshakes, established) = lock(&self.shared.admission).counts();
            handshakes + established
        };
        while open() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_threads();
        if let Some(p) = self.control.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Binds the control socket at `path`: its directory made if need be (0755, this user's), a
/// socket left there by a daemon that died removed, one in use refused. Anyone on this machine
/// may connect (mode 0666: clients of every user follow membership); what makes it
/// trustworthy to them is that no other user can put a socket there (`netram_client::discover`
/// checks the directory and the process that answers).
fn bind_control(path: &std::path::Path) -> Result<std::os::unix::net::UnixListener, ServerError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let err = |why: String| ServerError::Control {
        path: path.to_path_buf(),
        why,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .map_err(|e| err(format!("cannot make its directory: {e}")))?;
        }
        if let Ok(m) = std::fs::metadata(dir) {
            if m.permissions().mode() & 0o022 != 0 {
                tracing::warn!(
                    dir = %dir.display(),
                    "the control socket's directory is writable by other users: clients will \
                     not trust the socket (give --control a path in a directory only its owner \
                     writes)"
                );
            }
        }
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(err(
            "another daemon answers there (give --control PATH)".into()
        ));
    }
    let _ = std::fs::remove_file(path); // a socket left by a daemon that died
    let l = std::os::unix::net::UnixListener::bind(path).map_err(|e| err(e.to_string()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
        .map_err(|e| err(e.to_string()))?;
    Ok(l)
}

/// Gauges, the store's counters and the connection counters, in that order. The caller holds
/// the store's lock (so a STATS request answers from inside its batch).
fn stats_list(store: &Store<Arena>, shared: &Shared) -> Vec<(&'static str, u64)> {
    let mut out = serve::store_stats(store);
    out.insert(
        5,
        ("connections", {
            let (handshakes, established) = lock(&shared.admission).counts();
            (handshakes + established) as u64
        }),
    );
    // Other members this node believes alive (or suspects): a server with none hands no
    // page over (`Shared::may_hand_over_to`).
    let other_members_alive = {
        let m = shared.membership();
        let me = m.me().id;
        m.members()
            .iter()
            .filter(|v| v.node.id != me && v.liveness != netram_member::Liveness::Down)
            .count() as u64
    };
    out.push(("other_members_alive", other_members_alive));
    out.extend(shared.counters.snapshot());
    let g = shared.gms_view().clone();
    out.extend([
        ("gms_epoch", g.plan.epoch),
        ("gms_epochs_started", g.stats.epochs_started),
        ("gms_epochs_started_early", g.stats.epochs_started_early),
        ("gms_takeovers", g.stats.takeovers),
        ("gms_plans_adopted", g.stats.plans_adopted),
        ("gms_plans_refused", g.stats.plans_refused),
        ("gms_summaries_sent", g.stats.summaries_sent),
        ("gms_summaries_missing", g.stats.summaries_missing),
        ("gms_summaries_refused", g.stats.summaries_refused),
        ("gms_stale_reports", g.stats.stale_reports),
    ]);
    if let Some(shm) = shared.shm.get() {
        out.extend([
            (
                "dsm_frames_sent",
                shm.counters.frames_sent.load(Ordering::Relaxed),
            ),
            (
                "dsm_frames_lost",
                shm.counters.frames_lost.load(Ordering::Relaxed),
            ),
            (
                "dsm_frames_overflowed",
                shm.counters.frames_overflowed.load(Ordering::Relaxed),
            ),
            (
                "dsm_frames_received",
                shm.counters.frames_received.load(Ordering::Relaxed),
            ),
            (
                "dsm_links_adopted",
                shm.counters.links_adopted.load(Ordering::Relaxed),
            ),
            (
                "dsm_links_refused",
                shm.counters.links_refused.load(Ordering::Relaxed),
            ),
        ]);
        out.extend(shm.agent_counters());
    }
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
        let slot = match shared.take_slot(&stream, peer.ip()) {
            Ok(slot) => slot,
            Err(why) => {
                refuse(stream, &shared, peer, why);
                continue;
            }
        };
        let spawned = std::thread::Builder::new()
            .name(format!("netram-conn-{peer}"))
            .spawn(move || {
                let shared = &slot.shared;
                // A panic is a bug; it ends this connection only. The slot goes back when
                // `slot` is dropped, whichever way this ends.
                let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    serve_connection(stream, shared, slot.id)
                }));
                match served {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::debug!(%peer, "connection ended: {e}"),
                    Err(panic) => {
                        Shared::bump(&shared.counters.connection_panics);
                        let what = panic
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_default();
                        tracing::error!(%peer, "connection closed by a panic in its code: {what}");
                    }
                }
                drop(slot);
            });
        if let Err(e) = spawned {
            // The closure, and the slot in it, are dropped: the slot is given back.
            tracing::error!("cannot start a connection thread: {e}");
        }
    }
}

/// Answers a connection over a limit with a Busy welcome from the accept thread itself (no
/// thread, no blocking: the welcome fits any socket buffer) and closes it.
fn refuse(stream: TcpStream, shared: &Shared, peer: SocketAddr, why: Refused) {
    count_refusal(shared, why);
    tracing::warn!(%peer, "refusing connection: {why}");
    let welcome = busy_welcome(shared);
    // Over TLS too, in clear before any TLS: no handshake is spent on a connection that will
    // not be served, and a client takes an unauthenticated reply only as "busy" (which
    // anyone on the path could make it believe by cutting the connection anyway).
    if stream.set_nonblocking(true).is_ok() {
        let _ = (&stream).write(&welcome.encode());
        // Whatever of the hello has arrived is read, so that closing sends FIN, not a reset
        // that could overtake the welcome.
        let mut sink = [0u8; HELLO_LEN];
        let _ = (&stream).read(&mut sink);
    }
}

fn count_refusal(shared: &Shared, why: Refused) {
    let c = &shared.counters;
    Shared::bump(match why {
        Refused::Full | Refused::Handshakes => &c.connections_refused_busy,
        Refused::PerClient => &c.connections_refused_peer_limit,
        Refused::PerAddress => &c.connections_refused_addr_handshakes,
        Refused::PerSubnet => &c.connections_refused_subnet_handshakes,
    });
}

fn busy_welcome(shared: &Shared) -> Welcome {
    Welcome {
        version: PROTOCOL_VERSION,
        status: WelcomeStatus::Busy,
        window: 0,
        server_node: shared.node(),
        server_incarnation: shared.incarnation,
        capacity_pages: 0,
        free_pages: 0,
        lease_period_ms: 0,
        max_frame_len: MAX_FRAME_LEN as u32,
        max_batch: MAX_BATCH as u32,
    }
}

/// Reads exactly `buf.len()` bytes by `deadline`, however the peer spreads them out.
fn read_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "handshake deadline"))?;
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Pages moved down below a shrunk offer per hold of the store's lock (256 KiB of copying,
/// tens of µs): clients wait for the lock no longer than that (1024, 4 MiB, held a shrinking
/// donor's clients for a millisecond each time).
const COMPACT_STEP: usize = 64;

/// Moves the offer with the machine's memory, moves the pages above a shrunk offer into the
/// frames free below it, and gives back to the kernel the memory of the frames no longer
/// offered ([`crate::donor`]; what does not fit below waits for its owners to move it,
/// `netram_pager`'s `migrate.rs`).
fn donor_loop(shared: Arc<Shared>, mut adapter: crate::donor::Adapter) {
    while !shared.shutdown.load(Ordering::SeqCst) {
        std::thread::sleep(crate::donor::TICK);
        let used = shared.store().stored_pages() * PAGE_SIZE as u64;
        let change = adapter.tick(shared.now_ms(), used);
        let mut runs = match change {
            Some(frames) => shared.store().set_offer(frames),
            None => Vec::new(),
        };
        loop {
            let mut store = shared.store();
            let moved = store.compact(COMPACT_STEP);
            runs.extend(store.take_given_back().into_iter().map(|f| (f, 1)));
            drop(store);
            give_back(&shared, &mut runs);
            if moved < COMPACT_STEP || shared.shutdown.load(Ordering::SeqCst) {
                break;
            }
        }
    }
}

/// Frames given back to the kernel per hold of the store's lock: MADV_DONTNEED takes time in
/// proportion (and TLB shootdowns), and the connections wait for the lock meanwhile (a
/// shrinking donor once held it for milliseconds, its clients' reads with it).
const GIVE_BACK_STEP: u32 = 64;

/// Gives the frames of `runs` back to the kernel, neighbours joined, at most
/// [`GIVE_BACK_STEP`] frames per hold of the store's lock. The frames stay free and above the
/// offer in between: only this thread raises the offer, and no page is placed above it.
fn give_back(shared: &Shared, runs: &mut Vec<(u32, u32)>) {
    runs.sort_unstable();
    let mut joined: Vec<(u32, u32)> = Vec::with_capacity(runs.len());
    for &(first, n) in runs.iter() {
        match joined.last_mut() {
            Some((f, m)) if *f + *m == first => *m += n,
            _ => joined.push((first, n)),
        }
    }
    // Pieces of at most GIVE_BACK_STEP frames, as many per hold of the lock as add up to it.
    let mut pieces = joined.into_iter().flat_map(|(first, n)| {
        (first..first + n)
            .step_by(GIVE_BACK_STEP as usize)
            .map(move |at| (at, GIVE_BACK_STEP.min(first + n - at)))
    });
    let mut next = pieces.next();
    while let Some(piece) = next {
        let store = shared.store();
        let mut held = 0;
        next = Some(piece);
        while let Some((at, n)) = next.filter(|&(_, n)| held == 0 || held + n <= GIVE_BACK_STEP) {
            store.arena().give_back(at, n);
            held += n;
            next = pieces.next();
        }
    }
    runs.clear();
}

fn reaper_loop(shared: Arc<Shared>) {
    let period = (shared.cfg.lease_period / 4).max(Duration::from_millis(10));
    let mut next = Instant::now() + period;
    let mut crl_checked = Instant::now();
    while !shared.shutdown.load(Ordering::SeqCst) {
        std::thread::sleep(POLL_INTERVAL.min(period));
        if crl_checked.elapsed() >= CRL_CHECK {
            crl_checked = Instant::now();
            reload_crl(&shared);
        }
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

/// How often the revocation list's file is looked at.
const CRL_CHECK: Duration = Duration::from_secs(1);

/// Reads the revocation list again if its file changed: new connections are checked against
/// it, and established ones look at their certificate at their next request or idle wake-up.
fn reload_crl(shared: &Shared) {
    let Some(creds) = shared.creds() else { return };
    match creds.reloaded() {
        None => {}
        Some(Ok(new)) => {
            tracing::info!("revocation list changed: reloaded");
            *lock(&shared.creds) = Some(Arc::new(new));
            shared.crl_generation.fetch_add(1, Ordering::SeqCst);
        }
        Some(Err(e)) => tracing::error!("revocation list changed but cannot be read: {e}"),
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
    #[error("TLS: {0}")]
    Tls(#[from] netram_net::TlsError),
    #[error("its certificate was revoked")]
    Revoked,
}

fn serve_connection(mut stream: TcpStream, shared: &Shared, slot: ConnId) -> Result<(), ConnError> {
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(shared.cfg.write_timeout))?;
    let peer = stream.peer_addr()?;
    let mut hello = [0u8; HELLO_LEN];
    let deadline = Instant::now() + shared.cfg.handshake_timeout;
    // Over TLS, the peer is whom its certificate names, verified (and not revoked) before a
    // byte of the HELLO is read; over clear TCP, its address.
    let creds = shared.creds();
    let (accepted, principal) = match &creds {
        Some(creds) => match tls::accept(&mut stream, creds, &mut hello, deadline) {
            Ok(a) => {
                let p = if a.peer.server {
                    Peer::Server(a.peer.node)
                } else {
                    Peer::Node(a.peer.node)
                };
                (Some(a), p)
            }
            Err(e) => {
                Shared::bump(&shared.counters.handshakes_tls_failed);
                tracing::warn!(%peer, "closing connection: TLS handshake: {e}");
                return Err(e.into());
            }
        },
        None => {
            if let Err(e) = read_by(&mut stream, &mut hello, deadline) {
                Shared::bump(&shared.counters.handshakes_incomplete);
                return Err(e.into());
            }
            (None, Peer::Addr(peer.ip()))
        }
    };
    let hello = match Hello::decode(&hello) {
        Ok(h) => h,
        Err(e) => {
            Shared::bump(&shared.counters.handshakes_bad_magic);
            tracing::warn!(%peer, "closing connection: bad handshake: {e}");
            return Err(ConnError::Handshake(e));
        }
    };
    let established = shared.establish(slot, &principal);
    let (status, session) = if let Err(why) = established {
        // Over the established connections' limits (in all, or this client's): answered
        // Busy inside the handshake, as a client expects it.
        count_refusal(shared, why);
        tracing::warn!(%peer, %principal, "refusing connection: {why}");
        (WelcomeStatus::Busy, None)
    } else if hello.version != PROTOCOL_VERSION {
        Shared::bump(&shared.counters.handshakes_bad_version);
        tracing::warn!(%peer, "closing connection: protocol version {} (this server speaks {PROTOCOL_VERSION})", hello.version);
        (WelcomeStatus::VersionUnsupported, None)
    } else {
        match shared.store().open_session_from(
            principal,
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
            Err(e @ StoreError::TooManyPeerSessions { .. }) => {
                Shared::bump(&shared.counters.handshakes_refused_peer_sessions);
                tracing::warn!(%peer, "refusing session: {e}");
                (WelcomeStatus::TooManySessions, None)
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
            server_node: shared.node(),
            server_incarnation: shared.incarnation,
            capacity_pages: store.capacity_pages(),
            free_pages: store.owned_room(),
            lease_period_ms: shared.cfg.lease_period.as_millis() as u32,
            max_frame_len: MAX_FRAME_LEN as u32,
            max_batch: MAX_BATCH as u32,
        }
    };
    let (keys, serial) = match accepted {
        Some(a) => {
            let serial = a.peer.serial.clone();
            match a.welcome(&mut stream, &welcome.encode(), deadline) {
                Ok(keys) => (Some(keys), Some(serial)),
                Err(e) => {
                    if let Some(session) = session {
                        // Opened for a peer that is gone before it knew: nothing to keep.
                        let _ = shared.store().close(session);
                    }
                    return Err(e.into());
                }
            }
        }
        None => {
            stream.write_all(&welcome.encode())?;
            (None, None)
        }
    };
    let Some(session) = session else {
        return Err(ConnError::Refused(status));
    };
    tracing::debug!(%peer, %principal, node = hello.node, incarnation = hello.incarnation, "session open");
    // A client that seals its pages may have a GET reply's page data outside the record's
    // seal (`netram_net::record`): it checks those pages against its own tags.
    let clear_tails = keys.is_some() && hello.flags & HELLO_SEALED_PAGES != 0;
    // Who sends DSM messages on this connection: a daemon, as its certificate names it; over
    // clear TCP (loopback, development) as its HELLO does.
    let dsm_from = match principal {
        Peer::Server(node) => Some(node),
        Peer::Node(_) => None,
        Peer::Addr(_) => Some(hello.node ^ crate::shm::DSM_NODE),
    };
    let served = serve_session(
        stream,
        shared,
        peer,
        session,
        keys,
        serial,
        clear_tails,
        dsm_from,
    );
    if hello.flags & HELLO_END_ON_CLOSE != 0 {
        // However the connection ended (a CLOSE already ended the session: nothing to do).
        if shared.store().close(session).is_ok() {
            tracing::debug!(%peer, session = hello.session, "session ended with its connection");
        }
    }
    served
}

/// Serves the requests of one session's connection until it closes.
#[allow(clippy::too_many_arguments)]
fn serve_session(
    stream: TcpStream,
    shared: &Shared,
    peer: SocketAddr,
    session: SessionHandle,
    keys: Option<FrameKeys>,
    serial: Option<Vec<u8>>,
    clear_tails: bool,
    dsm_from: Option<u64>,
) -> Result<(), ConnError> {
    let (seal, open) = match keys {
        Some(k) => (Some(k.send), Some(k.recv)),
        None => (None, None),
    };
    let sealed = seal.is_some();
    let writer = Mutex::new(ConnWriter {
        stream: stream.try_clone()?,
        seal,
    });
    // A MIGRATE's handover (a round trip to another server) is made by this connection's
    // mover thread, started on the first one, so that the client's other requests are not
    // held behind it; its answer is written when it is done (replies carry their request's
    // id: the client takes them in any order).
    std::thread::scope(|scope| {
        let mut mover: Option<std::sync::mpsc::Sender<(serve::Handover, u32)>> = None;
        let result = session_loop(
            stream,
            shared,
            peer,
            session,
            open,
            serial,
            clear_tails,
            dsm_from,
            &writer,
            &mut |ho| {
                let tx = mover.get_or_insert_with(|| {
                    let (tx, rx) = std::sync::mpsc::channel();
                    let writer = &writer;
                    scope.spawn(move || hand_over_loop(rx, shared, session, sealed, writer));
                    tx
                });
                // The mover ends only when this loop does.
                let _ = tx.send(ho);
            },
        );
        // The mover finishes what it was given (each handover is bounded by the peers'
        // timeouts), then ends.
        drop(mover);
        result
    })
}

/// The write half of a connection: replies are sealed and written under its lock, by the
/// connection's thread and its mover alike, so that records go out whole and in order.
struct ConnWriter {
    stream: TcpStream,
    seal: Option<netram_net::RecordKey>,
}

impl ConnWriter {
    /// Seals (over TLS) and writes `buf`, then empties it.
    fn write(&mut self, buf: &mut Vec<u8>) -> io::Result<()> {
        if let Some(k) = &mut self.seal {
            k.seal_all(buf);
        }
        let r = self.stream.write_all(buf);
        buf.clear();
        r
    }
}

/// A connection's mover: hands pages over to other servers (MIGRATE), one request after
/// another, and writes each answer.
fn hand_over_loop(
    rx: std::sync::mpsc::Receiver<(serve::Handover, u32)>,
    shared: &Shared,
    session: SessionHandle,
    sealed: bool,
    writer: &Mutex<ConnWriter>,
) {
    let mut out = Vec::new();
    for (ho, rps) in rx {
        let status = if shared.may_hand_over_to(ho.to) {
            shared.peers.hand_over(
                ho.to,
                ho.owner,
                &ho.pages,
                &shared.counters.migration_targets_wrong_node,
                &shared.counters.peer_servers_refused,
            )
        } else {
            Shared::bump(&shared.counters.migration_targets_not_member);
            tracing::warn!(
                target = %ho.to,
                "MIGRATE refused: the target is not a live member of this server's cluster"
            );
            vec![netram_proto::MoveStatus::Unreachable; ho.pages.len()]
        };
        serve::finish_handover(&mut shared.store(), session, ho, &status, rps, &mut out);
        if sealed {
            reserve_tags(&mut out, 0);
        }
        if lock(writer).write(&mut out).is_err() {
            // The connection is gone: the client fails what it waited for.
            return;
        }
    }
}

/// [`serve_session`]'s loop: reads requests, serves them, writes their replies.
#[allow(clippy::too_many_arguments)]
fn session_loop(
    mut stream: TcpStream,
    shared: &Shared,
    peer: SocketAddr,
    session: SessionHandle,
    open: Option<netram_net::RecordKey>,
    serial: Option<Vec<u8>>,
    clear_tails: bool,
    dsm_from: Option<u64>,
    writer: &Mutex<ConnWriter>,
    hand_over: &mut dyn FnMut((serve::Handover, u32)),
) -> Result<(), ConnError> {
    let sealed = lock(writer).seal.is_some();
    let mut crl_seen = shared.crl_generation.load(Ordering::SeqCst);
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
    let mut rbuf = FrameBuffer::sealed(open);
    let mut wbuf: Vec<u8> = Vec::with_capacity(64 * 1024);
    let idle_timeout = shared.cfg.idle_timeout();
    let mut last_frame = Instant::now();
    // Whether this connection has carried a DSM frame (a daemon's shared-memory link), and
    // any other.
    let mut dsm_seen = false;
    let mut other_seen = false;
    loop {
        // Checked at every round, not only when a read times out: a client that sends more
        // often than POLL_INTERVAL (a maintenance thread probing every 100 ms) kept its
        // connection, and a stopping server waiting for it, open past the stop.
        if shared.shutdown.load(Ordering::SeqCst) {
            return Ok(());
        }
        if let Some(serial) = &serial {
            let g = shared.crl_generation.load(Ordering::SeqCst);
            if g != crl_seen {
                crl_seen = g;
                if shared.creds().is_some_and(|c| c.is_revoked(serial)) {
                    Shared::bump(&shared.counters.connections_closed_revoked);
                    tracing::warn!(%peer, "closing connection: its certificate was revoked");
                    return Err(ConnError::Revoked);
                }
            }
        }
        // Requests already received are served (a window's worth at a time, their replies
        // written in between) before anything more is read.
        if matches!(rbuf.has_frame(), Ok(false)) {
            // A daemon's shared-memory link is quiet between bursts, and a frame written into
            // a connection this side has just closed would be lost with nothing to resend it:
            // such links are not closed for idleness (they are a certificate's daemons, one
            // connection each).
            if last_frame.elapsed() > idle_timeout && !(dsm_from.is_some() && dsm_seen) {
                Shared::bump(&shared.counters.connections_closed_idle);
                tracing::info!(%peer, "closing connection: no whole request for {idle_timeout:?}");
                return Ok(());
            }
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
        }
        let mut handovers = Vec::new();
        let served = handle_frames(
            &mut rbuf,
            &mut wbuf,
            shared,
            session,
            sealed,
            clear_tails,
            dsm_from,
            &mut handovers,
        )
        .map_err(|e| {
            let c = &shared.counters;
            Shared::bump(match e {
                DecodeError::Unauthenticated => &c.frames_rejected_unauthenticated,
                DecodeError::BadLength { .. } => &c.frames_rejected_bad_length,
                DecodeError::UnsupportedVersion { .. } => &c.frames_rejected_bad_version,
                DecodeError::UnknownKind(_) => &c.frames_rejected_unknown_kind,
                _ => &c.frames_rejected_malformed,
            });
            tracing::warn!(%peer, "closing connection: rejected frame: {e}");
            e
        });
        if matches!(served, Ok(Served { frames, .. }) if frames > 0) {
            last_frame = Instant::now();
            other_seen = true;
        }
        if matches!(served, Ok(Served { dsm, .. }) if dsm > 0) {
            dsm_seen = true;
            last_frame = Instant::now();
        }
        // Replies to the frames before a bad one are still owed.
        if !wbuf.is_empty() {
            if let Err(e) = lock(writer).write(&mut wbuf) {
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) {
                    Shared::bump(&shared.counters.connections_closed_write_timeout);
                    tracing::warn!(%peer, "closing connection: its replies could not be written for {:?} (it does not read)", shared.cfg.write_timeout);
                }
                return Err(e.into());
            }
        }
        handovers.into_iter().for_each(&mut *hand_over);
        match served {
            Ok(Served { closed: true, .. }) => return Ok(()),
            // Over its rate: its replies are written, and nothing more of it is read (its
            // requests wait in the socket, then in the client) until the rate allows.
            Ok(Served { throttle_ms, .. }) if throttle_ms > 0 => {
                std::thread::sleep(Duration::from_millis(throttle_ms.min(1000)));
                if shared.shutdown.load(Ordering::SeqCst) {
                    return Ok(());
                }
            }
            Ok(_) => {}
            Err(e) => return Err(ConnError::Frame(e)),
        }
        // A daemon's shared-memory link (DSM frames only, nothing owed on it): the agent
        // reads it from now on, in its own loop — a hand-off between threads less on every
        // message's path (`crate::shm`).
        if let (Some(from), Some(shm), true, false) =
            (dsm_from, shared.shm.get(), dsm_seen, other_seen)
        {
            // (A connection that carried only DSM frames has no mover: MIGRATEs start it.)
            if wbuf.is_empty() {
                match shm.adopt(stream, rbuf, from) {
                    Ok(()) => {
                        tracing::debug!(%peer, from, "shared-memory link handed to the agent");
                        return Ok(());
                    }
                    Err(back) => (stream, rbuf) = *back,
                }
            }
        }
    }
}

/// Lets the page data of each GET reply from `from` on go outside its record's seal: the
/// frames there, each followed by its trailer room (`netram_net::record`).
fn clear_page_data(out: &mut [u8], from: usize) {
    let mut at = from;
    while at + 4 <= out.len() {
        let body = u32::from_le_bytes(out[at..at + 4].try_into().expect("4 bytes")) as usize;
        let tail = get_reply_tail(&out[at..at + 4 + body]);
        if tail > 0 {
            set_clear_tail(out, at, tail);
        }
        at += 4 + body + TRAILER_LEN;
    }
}

/// What one call of [`handle_frames`] did.
#[derive(Debug, Clone, Copy)]
struct Served {
    frames: u32,
    /// DSM frames handed to the shared-memory agent.
    dsm: u32,
    /// The client closed its session.
    closed: bool,
    /// Milliseconds the client must wait before more of its requests are read: it overdrew
    /// its rate (`ServerConfig::max_client_ops_per_s`).
    throttle_ms: u64,
}

/// Runs the whole frames in the buffer against the store, under one lock acquisition (let go
/// only while a request waits for parity holders), and appends the replies to `out`: at most
/// a window's worth of frames, and no more once `out` holds [`REPLY_BUFFER_MAX`] bytes, so
/// that the replies are written before more requests are served.
#[allow(clippy::too_many_arguments)]
fn handle_frames(
    rbuf: &mut FrameBuffer,
    out: &mut Vec<u8>,
    shared: &Shared,
    h: SessionHandle,
    sealed: bool,
    clear_tails: bool,
    dsm_from: Option<u64>,
    handovers: &mut Vec<(serve::Handover, u32)>,
) -> Result<Served, DecodeError> {
    let mut now = shared.now_ms();
    let mut store = shared.store();
    let mut served = 0u32;
    let mut dsm = 0u32;
    let mut throttle_ms = 0;
    let result = loop {
        if served >= shared.cfg.window || out.len() >= REPLY_BUFFER_MAX {
            if rbuf.has_frame().unwrap_or(true) {
                Shared::bump(&shared.counters.replies_flushed_early);
            }
            break Ok(false);
        }
        let frame = match rbuf.next_frame() {
            Ok(Some(f)) => f,
            Ok(None) => break Ok(false),
            Err(e) => break Err(e),
        };
        if netram_proto::dsm::is_dsm(frame) {
            // Distributed shared memory's messages go to the agent, one-way (`crate::shm`).
            match (dsm_from, shared.shm.get()) {
                (Some(from), Some(shm)) => {
                    shm.deliver(from, frame);
                    dsm += 1;
                }
                _ => Shared::bump(&shared.counters.dsm_frames_refused),
            }
            continue;
        }
        let (id, req) = match decode_request(frame) {
            Ok(r) => r,
            Err(DecodeError::UnknownKind(_)) => {
                // GMS's clean pages and epoch messages (`netram_proto::gms`).
                let (id, req) = match netram_proto::gms::decode_request(frame) {
                    Ok(r) => r,
                    Err(e) => break Err(e),
                };
                served += 1;
                let mark = out.len();
                let rps = store.note_requests(1, now);
                let cost = match &req {
                    netram_proto::gms::Request::PutCached(p) => p.len().max(1) as u32,
                    netram_proto::gms::Request::GetCached { uids, .. } => uids.len().max(1) as u32,
                    netram_proto::gms::Request::GcdUpdate { add, remove, .. } => {
                        (add.len() + remove.len()).max(1) as u32
                    }
                    netram_proto::gms::Request::Epoch(_) => 1,
                };
                match serve::handle_gms(&mut store, h, id, req, now, rps, out) {
                    serve::GmsOutcome::Replied => {
                        if sealed {
                            reserve_tags(out, mark);
                        }
                    }
                    // Daemons do not run GMS's epochs yet (issue 39): counted and dropped.
                    serve::GmsOutcome::Epoch(_) => {
                        Shared::bump(&shared.counters.gms_epoch_messages_ignored);
                    }
                }
                throttle_ms = store.charge(h, cost, now);
                if throttle_ms > 0 {
                    break Ok(false);
                }
                continue;
            }
            Err(e) => break Err(e),
        };
        served += 1;
        // Sealed replies each need room for their tag after them (`record.rs`).
        let mark = out.len();
        let tags = |out: &mut Vec<u8>| {
            if sealed {
                reserve_tags(out, mark);
                if clear_tails {
                    clear_page_data(out, mark);
                }
            }
        };
        let rps = store.note_requests(1, now);
        let cost = serve::cost(&req);
        let fault = shared.cfg.fault_panic_on_stats && matches!(req, netram_proto::Request::Stats);
        let stats = |st: &Store<Arena>| {
            // Test-only fault point (see `ServerConfig::fault_panic_on_stats`).
            assert!(
                !fault,
                "fault point: a STATS request panics (fault_panic_on_stats)"
            );
            stats_list(st, shared)
        };
        let closed = match serve::handle_request(&mut store, h, id, req, now, rps, out, stats) {
            Outcome::Open => {
                tags(out);
                false
            }
            Outcome::Closed => {
                tags(out);
                true
            }
            Outcome::Forward(fwd) => {
                drop(store);
                let outcomes = shared.peers.forward(
                    &fwd.deltas,
                    &shared.counters.parity_holders_wrong_node,
                    &shared.counters.peer_servers_refused,
                );
                store = shared.store();
                now = shared.now_ms();
                serve::finish_forward(&mut store, h, fwd, &outcomes, now, rps, out);
                tags(out);
                false
            }
            // Handed over by the connection's mover (`serve_session`), answered when done:
            // the requests after it are served meanwhile.
            Outcome::Handover(ho) => {
                handovers.push((ho, rps));
                false
            }
        };
        if closed {
            break Ok(true);
        }
        throttle_ms = store.charge(h, cost, now);
        if throttle_ms > 0 {
            break Ok(false);
        }
    };
    shared
        .counters
        .requests_served
        .fetch_add(u64::from(served), Ordering::Relaxed);
    result.map(|closed| Served {
        dsm,
        frames: served,
        closed,
        throttle_ms,
    })
}

/// Binds the TCP listener and the membership socket, which gossips on UDP at the same address
/// (one address to give and to open in a firewall). With port 0 the kernel picks a free TCP
/// port whose UDP twin may still be in use by another process: then another port is picked
/// (a handful of tries; a fixed port that is taken is the operator's to change).
fn bind_listen(
    listen: SocketAddr,
) -> Result<(TcpListener, std::net::UdpSocket, SocketAddr), ServerError> {
    let listen_err = |source| ServerError::Listen {
        addr: listen,
        source,
    };
    let mut tries = 0;
    loop {
        let listener = TcpListener::bind(listen).map_err(listen_err)?;
        let addr = listener.local_addr().map_err(listen_err)?;
        match std::net::UdpSocket::bind(addr) {
            Ok(udp) => return Ok((listener, udp, addr)),
            Err(e) if listen.port() == 0 && e.kind() == io::ErrorKind::AddrInUse && tries < 16 => {
                tracing::debug!(%addr, "the membership port is taken; picking another port");
                tries += 1;
            }
            Err(source) => return Err(ServerError::Gossip { addr, source }),
        }
    }
}
