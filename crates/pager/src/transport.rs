//! The two seams through which the pager reaches the world: a [`Transport`] to page servers and
//! a [`Disk`] for the local spill file. The daemon plugs in TCP sockets and a file; tests and the
//! simulator plug in memory.

use netram_proto::{Reply, Request};
use std::collections::HashMap;

/// What the pager knows of a server before its first request: its handshake.
#[derive(Debug, Clone)]
pub struct ServerInfo {
    /// How the server is named in errors and logs (its address).
    pub name: String,
    /// The address other servers reach it at: dynamic parity names holders and members by it.
    /// `None` when the name did not resolve.
    pub addr: Option<std::net::SocketAddr>,
    /// The server's node id, as its certificate names it (what parity groups name a member's
    /// server by, for its holder to check); 0 when unknown.
    pub node: u64,
    /// Requests the server lets this client have outstanding.
    pub window: u32,
    pub capacity_pages: u64,
    pub free_pages: u64,
    /// Whether the handshake succeeded; the reason if not (the server starts out dead).
    pub connected: Result<(), String>,
}

/// Why a server gave no usable reply. Any of these marks the server dead.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransportError {
    #[error("connection lost: {0}")]
    Disconnected(String),
    #[error("no reply within {0} ms")]
    Timeout(u64),
    #[error("protocol error: {0}")]
    Protocol(String),
}

/// Requests out, replies in, one connection per server.
///
/// `send` may queue the request; `recv` must first make sure every queued request (to any
/// server) is on its way, then wait for the next reply from `server`. Replies of one server may
/// come in any order; the pager matches them by request id. It owns its connections
/// (`'static`: it borrows nothing), as the pager owns it.
pub trait Transport: 'static {
    fn servers(&self) -> Vec<ServerInfo>;
    fn send(&mut self, server: usize, req_id: u64, req: &Request<'_>)
        -> Result<(), TransportError>;
    /// Sends a request encoded earlier (`Request::encode`, its id inside): one the pager
    /// queued while its server had no credits. Transports that write frames to a byte stream
    /// append it as it is.
    fn send_frame(&mut self, server: usize, frame: &[u8]) -> Result<(), TransportError> {
        let (id, req) = netram_proto::decode_request(frame)
            .map_err(|e| TransportError::Protocol(format!("a queued request: {e}")))?;
        self.send(server, id, &req)
    }
    /// The reply borrows the transport's receive buffer until it is dropped.
    fn recv(&mut self, server: usize) -> Result<(u64, Reply<'_>), TransportError>;
    /// The next reply from `server` if one has arrived, without waiting; `None` when none has
    /// (or when the transport cannot tell without waiting, the default: its replies are then
    /// read when the pager next waits).
    fn try_recv(&mut self, server: usize) -> Option<Result<(u64, Reply<'_>), TransportError>> {
        let _ = server;
        None
    }
    /// The descriptor that becomes readable when a reply from `server` may have arrived, for a
    /// loop that waits on many at once (`ticket.rs`); `None` when there is none (a transport
    /// in memory: its replies are read by the pager's next wait or `poll`). A reply may be
    /// buffered already although the descriptor is not readable: such a loop calls
    /// [`Pager::poll`](crate::Pager::poll) before it sleeps.
    fn reply_fd(&self, server: usize) -> Option<std::os::fd::RawFd> {
        let _ = server;
        None
    }
    /// How long `recv` waits for a reply before it fails with [`TransportError::Timeout`]
    /// (µs), if it does: the pager applies the same to what nobody waits for on the
    /// transport ([`Pager::expire`](crate::Pager::expire)) unless its schedule says
    /// otherwise.
    fn reply_timeout_us(&self) -> Option<u64> {
        None
    }
    /// Puts on the wire whatever `send` has only queued (without waiting for anything).
    fn flush(&mut self) {}
    /// Opens a new connection (and session) to a server the pager had declared dead, dropping
    /// the old one. The server is treated as empty afterwards: whatever the old session held is
    /// freed by its lease. A transport that cannot reconnect says so.
    fn reconnect(&mut self, server: usize) -> Result<ServerInfo, TransportError> {
        let _ = server;
        Err(TransportError::Disconnected(
            "this transport does not reconnect".into(),
        ))
    }
    /// Connects to a server that joined the cluster after the pager started; it becomes the
    /// next index. A transport that cannot add servers says so.
    fn add_server(&mut self, name: &str) -> Result<ServerInfo, TransportError> {
        let _ = name;
        Err(TransportError::Disconnected(
            "this transport does not add servers".into(),
        ))
    }
    /// Whether the transport leaves the authenticity of pages it receives to the pager (a GET
    /// reply's page data outside its record's seal, `netram-net`'s `record.rs`): then the
    /// pager must seal its pages, and refuses to start if it does not.
    fn leaves_pages_to_pager(&self) -> bool {
        false
    }
}

/// The local disk: one page-sized slot per page number. Owned, as the transport is.
pub trait Disk: 'static {
    fn write(&mut self, page: u64, data: &[u8]) -> std::io::Result<()>;
    fn read(&mut self, page: u64, out: &mut [u8]) -> std::io::Result<()>;
    /// The page is dead: its space may be given back.
    fn discard(&mut self, page: u64) -> std::io::Result<()>;
}

/// A disk in memory, for tests and the simulator. It can be told to fail writes, as a disk
/// that is full or broken does.
#[derive(Debug, Default)]
pub struct MemDisk {
    pages: HashMap<u64, Box<[u8]>>,
    failures: Option<Failures>,
    writes: u64,
    failed: u64,
}

/// Which writes a [`MemDisk`] fails.
#[derive(Debug)]
enum Failures {
    /// Each write with this probability, never two in a row (a disk that fails every write is
    /// [`Failures::From`]).
    Random {
        rng: fastrand::Rng,
        p: f64,
        last: bool,
    },
    /// Every write from the Nth on (1-based).
    From(u64),
}

impl MemDisk {
    /// Fails each write with probability `p` (but never two writes in a row), drawn from
    /// `seed`. A failed write leaves the page's old contents in place or torn: the pager
    /// must not trust either.
    pub fn failing_randomly(seed: u64, p: f64) -> Self {
        Self {
            failures: Some(Failures::Random {
                rng: fastrand::Rng::with_seed(seed),
                p,
                last: false,
            }),
            ..Self::default()
        }
    }
    /// Fails the Nth write (1-based) and every write after it.
    pub fn failing_from(n: u64) -> Self {
        Self {
            failures: Some(Failures::From(n)),
            ..Self::default()
        }
    }
    /// Stops failing writes.
    pub fn heal(&mut self) {
        self.failures = None;
    }
    pub fn len(&self) -> usize {
        self.pages.len()
    }
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }
    /// Writes tried, and how many of them failed.
    pub fn writes(&self) -> (u64, u64) {
        (self.writes, self.failed)
    }
}

impl Disk for MemDisk {
    fn write(&mut self, page: u64, data: &[u8]) -> std::io::Result<()> {
        self.writes += 1;
        let fail = match &mut self.failures {
            None => false,
            Some(Failures::From(n)) => self.writes >= *n,
            Some(Failures::Random { rng, p, last }) => {
                *last = !*last && rng.f64() < *p;
                *last
            }
        };
        if fail {
            self.failed += 1;
            // Torn: half the page written, as a write cut off midway leaves it.
            if let Some(old) = self.pages.get_mut(&page) {
                old[..data.len() / 2].copy_from_slice(&data[..data.len() / 2]);
            }
            return Err(std::io::Error::other(format!(
                "injected failure of disk write {}",
                self.writes
            )));
        }
        self.pages.insert(page, data.into());
        Ok(())
    }
    fn read(&mut self, page: u64, out: &mut [u8]) -> std::io::Result<()> {
        match self.pages.get(&page) {
            Some(d) => {
                out.copy_from_slice(d);
                Ok(())
            }
            None => Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("page {page} was never written to disk"),
            )),
        }
    }
    fn discard(&mut self, page: u64) -> std::io::Result<()> {
        self.pages.remove(&page);
        Ok(())
    }
}
