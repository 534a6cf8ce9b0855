//! netram's NBD front end: a network block device whose blocks are pages in the cluster.
//!
//! This is how Distributed Anemone (paper 001, §2.1–2.2), Nswap and Markatos' pager reach
//! unmodified programs: the client machine gets a block device whose blocks live in other
//! machines' RAM, and the kernel swaps to it. Here the device is an NBD export served by
//! `netram nbd`, for the kernel's NBD client, nbdfuse, qemu or any NBD tool.
//!
//! * [`wire`]: the NBD protocol's bytes, I/O-free;
//! * [`device`]: byte ranges over the pager (read-modify-write, discards, block status), the
//!   reads and writes of several connections in flight together through
//!   `netram_client::SharedPager`, none holding the pager across a round trip;
//! * [`server`]: the handshake of one connection, and the serving of a batch of its requests;
//! * [`transmit`]: the transmission phase of every connection in one event loop, which also
//!   watches the pager's connections to the page servers;
//! * [`serve`]: the accept loop; each handshake on a thread of its own, then the connection
//!   handed to the transmission loop;
//! * [`tls`]: NBD_OPT_STARTTLS, mutual TLS with the cluster's certificates on TCP;
//! * [`fuse`]: the same device as one file through FUSE, for a loop device where the kernel
//!   has no NBD client.
//!
//! # Why the protocol is written here
//!
//! Evaluated (2026-11): `tokio-nbd` is GPL-2.0+ (netram is MIT/Apache), does not do structured
//! replies (so no BLOCK_STATUS), and runs on tokio, whose hand-offs `netram bench core` measured
//! costing more than blocking threads in the low-latency mode. `nbd` (0.2) calls itself "a first
//! sketch" and speaks simple replies only. The NBD server is the product here, small and fully
//! specified, so it is written by hand, with its parsers I/O-free so they can be fuzzed.

pub mod device;
pub mod fuse;
pub mod server;
pub mod tls;
pub mod transmit;
pub mod wire;

pub use device::Device;
use netram_pager::{Disk, Transport};
use netram_policy::admission::{Admission, AdmissionConfig};
use server::Socket;
use std::io;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where `netram nbd` listens.
#[derive(Debug)]
pub enum Listener {
    /// A unix socket, removed again when the server stops.
    Unix(UnixListener, PathBuf),
    Tcp(std::net::TcpListener),
}

impl std::os::fd::AsFd for Listener {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Listener::Unix(l, _) => l.as_fd(),
            Listener::Tcp(l) => l.as_fd(),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The limits of `netram nbd`'s connections, each enforced here, where the memory and threads
/// they cost are paid (`netram_policy::admission`: handshakes in progress and established
/// connections are two pools, so that strangers holding every handshake slot they can never
/// keep a client that proved who it is out).
#[derive(Debug, Clone)]
pub struct Limits {
    /// Established connections at once (option haggling over).
    pub max_connections: usize,
    /// Established connections at once of one client that is not trusted (a node's
    /// certificate over TLS, an address in clear, a user on the unix socket other than its
    /// owner and root), so that one client's idle connections cannot lock the others out.
    /// The unix socket's owner and root are limited by `max_connections` only: multi-conn
    /// clients open many at once.
    pub max_connections_per_client: usize,
    /// Handshakes in progress at once: in all, per address, per /24 (IPv6: /64). When all are
    /// taken, a newcomer takes the slot of the oldest handshake of the fullest subnet.
    pub max_handshakes: usize,
    pub max_handshakes_per_addr: usize,
    pub max_handshakes_per_subnet: usize,
    /// Over TLS, the nodes whose certificates may use the device (`None`: any node of the
    /// cluster). Others are answered NBD_REP_ERR_POLICY to every option.
    pub allowed_nodes: Option<Vec<u64>>,
    /// The whole handshake (option haggling) must be over within this.
    pub handshake_timeout: Duration,
    /// A connection whose replies cannot be written for this long (a client that does not
    /// read them) is closed.
    pub write_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 64,
            max_connections_per_client: 8,
            max_handshakes: 32,
            max_handshakes_per_addr: 4,
            max_handshakes_per_subnet: 8,
            allowed_nodes: None,
            handshake_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(30),
        }
    }
}

/// Serves NBD on `listener` until `shutdown` is set, within `limits`; the transmission loop
/// runs the pager's maintenance schedule between batches if `upkeep` is given. Returns once every
/// connection has ended. With `tls`, a TCP client must start TLS and present a certificate
/// the configuration accepts before anything else is served (a unix socket's clients are
/// this machine's users, let in by the socket's file mode).
pub fn serve<T, D>(
    listener: Listener,
    device: Arc<Device<T, D>>,
    shutdown: Arc<AtomicBool>,
    limits: Limits,
    tls: Option<tls::TlsConfig>,
    upkeep: Option<netram_pager::Upkeep>,
) -> io::Result<()>
where
    T: Transport + Send + 'static,
    D: Disk + Send + 'static,
{
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let open: Arc<Open> = Arc::new(Open {
        conns: Mutex::default(),
        admission: Mutex::new(Admission::new(AdmissionConfig {
            max_handshakes: limits.max_handshakes.max(1),
            max_handshakes_per_addr: limits.max_handshakes_per_addr.max(1),
            max_handshakes_per_subnet: limits.max_handshakes_per_subnet.max(1),
            max_established: limits.max_connections.max(1),
            max_established_per_client: limits.max_connections_per_client.max(1),
        })),
        counters: Counters::default(),
        allowed_nodes: limits.allowed_nodes.clone(),
    });
    let (handoff, transmission) = transmit::spawn(
        device.clone(),
        shutdown.clone(),
        limits.write_timeout,
        upkeep,
    )?;
    let mut threads = Vec::new();
    let timeout = Timespec {
        tv_sec: 0,
        tv_nsec: 100_000_000,
    };
    let mut failed = None;
    while !shutdown.load(Ordering::SeqCst) {
        if transmission.is_finished() {
            // It ends only when told to, or by a bug: then nothing would serve the
            // connections, so the server stops rather than take more.
            failed = Some(io::Error::other(
                "the NBD transmission loop ended unexpectedly",
            ));
            break;
        }
        // Connections still haggling past the deadline are closed: a client sending its
        // options a byte at a time does not keep a place.
        for c in lock(&open.conns).values() {
            if !c.negotiated.load(Ordering::SeqCst)
                && c.started.elapsed() > limits.handshake_timeout
                && !c.cut.swap(true, Ordering::SeqCst)
            {
                tracing::warn!(peer = %c.peer, "closing an NBD connection: no handshake within {:?}", limits.handshake_timeout);
                (c.shut)();
            }
        }
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(e.into()),
        }
        let spawned = match &listener {
            Listener::Unix(l, _) => l
                .accept()
                .map(|(s, _)| start(s, &device, &handoff, &open, &limits, None)),
            Listener::Tcp(l) => l.accept().map(|(s, _)| {
                let _ = s.set_nodelay(true);
                let config = tls
                    .as_ref()
                    .map(|t| t.read().unwrap_or_else(|p| p.into_inner()).clone());
                start(s, &device, &handoff, &open, &limits, config)
            }),
        };
        match spawned {
            Ok(Some(t)) => threads.push(t),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!("accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        threads.retain(|t: &std::thread::JoinHandle<()>| !t.is_finished());
    }
    shutdown.store(true, Ordering::SeqCst);
    // Unblock connections waiting in `read`, then wait for them.
    for c in lock(&open.conns).values() {
        (c.shut)();
    }
    for t in threads {
        let _ = t.join();
    }
    if transmission.join().is_err() {
        tracing::error!("the NBD transmission loop panicked");
    }
    let c = &open.counters;
    let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    tracing::info!(
        refused_handshakes = n(&c.refused_handshakes),
        handshakes_taken_over = n(&c.handshakes_taken_over),
        refused_established = n(&c.refused_established),
        refused_nodes = n(&c.refused_nodes),
        hung_up_freed = n(&c.hung_up_freed),
        "NBD connections refused and freed while serving"
    );
    failed.map_or(Ok(()), Err)
}

/// An open connection, as the accept loop sees it.
struct OpenConn {
    /// Shuts the socket down (holds a handle to it).
    shut: Box<dyn Fn() + Send>,
    /// Whether the client hung up (it may take its thread a moment to notice).
    hung_up: Box<dyn Fn() -> bool + Send>,
    peer: String,
    started: Instant,
    negotiated: Arc<AtomicBool>,
    /// Already shut down for its handshake's deadline.
    cut: AtomicBool,
}

/// What the accept loop and the connections share: the open connections by number (an entry
/// goes away with its connection), their slots, and what was refused.
struct Open {
    conns: Mutex<std::collections::HashMap<u64, OpenConn>>,
    admission: Mutex<Admission>,
    counters: Counters,
    allowed_nodes: Option<Vec<u64>>,
}

/// Connections refused, by reason (logged with each refusal and when the server stops).
#[derive(Debug, Default)]
pub struct Counters {
    /// At accept: handshakes from the address or subnet at their limit, or all held by
    /// connections that may not be taken over.
    pub refused_handshakes: std::sync::atomic::AtomicU64,
    /// Handshakes shut down to give their slot to a newcomer.
    pub handshakes_taken_over: std::sync::atomic::AtomicU64,
    /// At the end of the haggling: established connections (all, or the client's) at their
    /// limit.
    pub refused_established: std::sync::atomic::AtomicU64,
    /// Over TLS: a node that may not use this device.
    pub refused_nodes: std::sync::atomic::AtomicU64,
    /// Connections whose client had hung up, freed before their threads noticed so that a
    /// new one is not refused for them.
    pub hung_up_freed: std::sync::atomic::AtomicU64,
}

impl Open {
    /// Frees the slots of connections whose client hung up (their threads end by
    /// themselves); whether any was freed.
    fn free_hung_up(&self) -> bool {
        let conns = lock(&self.conns);
        let mut admission = lock(&self.admission);
        let mut freed = false;
        for (&id, c) in conns.iter() {
            if admission.holds(id) && (c.hung_up)() {
                admission.end(id);
                (c.shut)();
                self.counters.hung_up_freed.fetch_add(1, Ordering::Relaxed);
                freed = true;
            }
        }
        freed
    }
}

/// What a connection's haggling asks of the accept loop's state (`server::Gate`).
struct ConnGate {
    open: Arc<Open>,
    id: u64,
    peer: String,
}

impl server::Gate for ConnGate {
    fn admit_node(&self, node: u64) -> Result<(), String> {
        match &self.open.allowed_nodes {
            Some(nodes) if !nodes.contains(&node) => {
                let n = self
                    .open
                    .counters
                    .refused_nodes
                    .fetch_add(1, Ordering::Relaxed)
                    + 1;
                tracing::warn!(peer = %self.peer, node, refused = n, "refusing an NBD client: its node may not use this device");
                Err(format!(
                    "node {node} may not use this device (it serves node{} {})",
                    if nodes.len() == 1 { "" } else { "s" },
                    nodes
                        .iter()
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            }
            _ => Ok(()),
        }
    }

    fn establish(&self, client: &str) -> Result<(), String> {
        let mut r = lock(&self.open.admission).establish(self.id, client);
        if r.is_err() && self.open.free_hung_up() {
            r = lock(&self.open.admission).establish(self.id, client);
        }
        r.map_err(|why| {
            let n = self
                .open
                .counters
                .refused_established
                .fetch_add(1, Ordering::Relaxed)
                + 1;
            tracing::warn!(peer = %self.peer, %client, refused = n, "refusing an NBD connection: {why}");
            format!("{why} (this server's limits: see netram nbd --help)")
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Removes a connection's entry when dropped: when its thread ends, whichever way, or when the
/// thread cannot be started.
struct Registered {
    open: Arc<Open>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        lock(&self.open.conns).remove(&self.id);
        lock(&self.open.admission).end(self.id);
    }
}

fn start<S: Socket, T, D>(
    socket: S,
    device: &Arc<Device<T, D>>,
    handoff: &Arc<transmit::Handoff>,
    open: &Arc<Open>,
    limits: &Limits,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> Option<std::thread::JoinHandle<()>>
where
    T: Transport + Send + 'static,
    D: Disk + Send + 'static,
{
    let peer = socket.peer();
    let source = socket.source();
    let (handle, watch) = match (socket.try_clone(), socket.try_clone()) {
        (Ok(h), Ok(w)) => (h, w),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!("refusing an NBD connection: {e}");
            return None;
        }
    };
    let negotiated = Arc::new(AtomicBool::new(false));
    let id = {
        let mut admitted = lock(&open.admission).begin(source);
        if admitted.is_err() && open.free_hung_up() {
            admitted = lock(&open.admission).begin(source);
        }
        let admitted = match admitted {
            Ok(a) => a,
            Err(why) => {
                let n = open
                    .counters
                    .refused_handshakes
                    .fetch_add(1, Ordering::Relaxed)
                    + 1;
                tracing::warn!(%peer, refused = n, "refusing an NBD connection: {why}");
                return None; // dropping the socket closes it
            }
        };
        let mut conns = lock(&open.conns);
        if let Some(old) = admitted.evict.and_then(|id| conns.get(&id)) {
            open.counters
                .handshakes_taken_over
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = %old.peer, "closing an NBD handshake: its slot goes to a newcomer");
            (old.shut)();
        }
        conns.insert(
            admitted.id,
            OpenConn {
                shut: Box::new(move || handle.shut()),
                hung_up: Box::new(move || watch.hung_up()),
                peer: peer.clone(),
                started: Instant::now(),
                negotiated: negotiated.clone(),
                cut: AtomicBool::new(false),
            },
        );
        admitted.id
    };
    let registered = Registered {
        open: open.clone(),
        id,
    };
    if let Err(e) = socket.set_write_timeout(Some(limits.write_timeout)) {
        tracing::warn!("refusing an NBD connection: {e}");
        return None;
    }
    let (device, handoff) = (device.clone(), handoff.clone());
    let handshake_timeout = limits.handshake_timeout;
    let gate = ConnGate {
        open: open.clone(),
        id,
        peer,
    };
    let spawned = std::thread::Builder::new()
        .name("netram-nbd-conn".into())
        .spawn(move || {
            let peer = gate.peer.clone();
            match server::handshake(socket, &device, &negotiated, &gate, tls, handshake_timeout) {
                Ok(Some(n)) => {
                    // Its place among the established connections goes with it.
                    let handed = handoff.hand(transmit::Established {
                        stream: n.stream,
                        buffered: n.buffered,
                        session: n.session,
                        peer,
                        held: Box::new(registered),
                    });
                    if handed.is_err() {
                        tracing::info!("NBD connection closed: the server is stopping");
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::info!("NBD connection ended: {e}"),
            }
        });
    match spawned {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::error!("cannot start an NBD connection thread: {e}");
            None
        }
    }
}
