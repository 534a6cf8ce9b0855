//! netram's NBD front end: a network block device whose blocks are pages in the cluster.
//!
//! This is how Distributed Anemone (paper 001, §2.1–2.2), Nswap and Markatos' pager reach
//! unmodified programs: the client machine gets a block device whose blocks live in other
//! machines' RAM, and the kernel swaps to it. Here the device is an NBD export served by
//! `netram nbd`, for the kernel's NBD client, nbdfuse, qemu or any NBD tool.
//!
//! * [`wire`]: the NBD protocol's bytes, I/O-free;
//! * [`device`]: byte ranges over the pager (read-modify-write, discards, block status);
//! * [`server`]: the handshake and the transmission phase of one connection;
//! * [`serve`]: the accept loop, one thread per connection, all sharing one device;
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
pub mod wire;

pub use device::Device;
use netram_pager::{Disk, Transport};
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
/// they cost are paid.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections at once.
    pub max_connections: usize,
    /// Connections at once from one client (a TCP address, or a user on the unix socket), so
    /// that one client's idle connections cannot lock the others out.
    pub max_connections_per_client: usize,
    /// The whole handshake (option haggling) must be over within this.
    pub handshake_timeout: Duration,
    /// A connection whose replies cannot be written for this long (a client that does not
    /// read them) is closed.
    pub write_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 16,
            max_connections_per_client: 8,
            handshake_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(30),
        }
    }
}

/// Serves NBD on `listener` until `shutdown` is set, within `limits`. Returns once every
/// connection has ended. With `tls`, a TCP client must start TLS and present a certificate
/// the configuration accepts before anything else is served (a unix socket's clients are
/// this machine's users, let in by the socket's file mode).
pub fn serve<T, D>(
    listener: Listener,
    device: Arc<Device<T, D>>,
    shutdown: Arc<AtomicBool>,
    limits: Limits,
    tls: Option<tls::TlsConfig>,
) -> io::Result<()>
where
    T: Transport + Send + 'static,
    D: Disk + Send + 'static,
{
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let open: Arc<Open> = Arc::default();
    let mut threads = Vec::new();
    let timeout = Timespec {
        tv_sec: 0,
        tv_nsec: 100_000_000,
    };
    while !shutdown.load(Ordering::SeqCst) {
        // Connections still haggling past the deadline are closed: a client sending its
        // options a byte at a time does not keep a place.
        for c in lock(&open).values() {
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
                .map(|(s, _)| start(s, &device, &shutdown, &open, &limits, None)),
            Listener::Tcp(l) => l.accept().map(|(s, _)| {
                let _ = s.set_nodelay(true);
                let config = tls
                    .as_ref()
                    .map(|t| t.read().unwrap_or_else(|p| p.into_inner()).clone());
                start(s, &device, &shutdown, &open, &limits, config)
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
    // Unblock connections waiting in `read`, then wait for them.
    for c in lock(&open).values() {
        (c.shut)();
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

/// An open connection, as the accept loop sees it.
struct OpenConn {
    /// Shuts the socket down (holds a handle to it).
    shut: Box<dyn Fn() + Send>,
    peer: String,
    started: Instant,
    negotiated: Arc<AtomicBool>,
    /// Already shut down for its handshake's deadline.
    cut: AtomicBool,
}

/// The open connections by number; an entry goes away with its connection.
type Open = Mutex<std::collections::HashMap<u64, OpenConn>>;

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
        lock(&self.open).remove(&self.id);
    }
}

fn start<S: Socket, T, D>(
    socket: S,
    device: &Arc<Device<T, D>>,
    shutdown: &Arc<AtomicBool>,
    open: &Arc<Open>,
    limits: &Limits,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> Option<std::thread::JoinHandle<()>>
where
    T: Transport + Send + 'static,
    D: Disk + Send + 'static,
{
    let peer = socket.peer();
    let handle = match socket.try_clone() {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!("refusing an NBD connection: {e}");
            return None;
        }
    };
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let negotiated = Arc::new(AtomicBool::new(false));
    {
        let mut conns = lock(open);
        if conns.len() >= limits.max_connections {
            tracing::warn!(%peer, "refusing an NBD connection: {} is the limit", limits.max_connections);
            return None; // dropping the socket closes it
        }
        let from_peer = conns.values().filter(|c| c.peer == peer).count();
        if from_peer >= limits.max_connections_per_client {
            tracing::warn!(%peer, "refusing an NBD connection: {} from one client is the limit", limits.max_connections_per_client);
            return None;
        }
        conns.insert(
            id,
            OpenConn {
                shut: Box::new(move || handle.shut()),
                peer,
                started: Instant::now(),
                negotiated: negotiated.clone(),
                cut: AtomicBool::new(false),
            },
        );
    }
    let registered = Registered {
        open: open.clone(),
        id,
    };
    if let Err(e) = socket.set_write_timeout(Some(limits.write_timeout)) {
        tracing::warn!("refusing an NBD connection: {e}");
        return None;
    }
    let (device, shutdown) = (device.clone(), shutdown.clone());
    let handshake_timeout = limits.handshake_timeout;
    let spawned = std::thread::Builder::new()
        .name("netram-nbd-conn".into())
        .spawn(move || {
            let _registered = registered;
            if let Err(e) = server::serve_connection(
                socket,
                &device,
                &shutdown,
                &negotiated,
                tls,
                handshake_timeout,
            ) {
                tracing::info!("NBD connection ended: {e}");
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
