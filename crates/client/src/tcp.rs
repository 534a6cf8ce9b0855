//! The TCP [`Transport`]: one connection per server, driven by the pager's own thread.
//!
//! `send` encodes a request into the connection's write buffer; `recv` first writes every
//! buffered request (to all servers, one `write` each), then reads replies. So a depth-1 request
//! costs one `write` and one `read` on the caller's thread, and a pipelined batch costs one
//! `write` per server for all of it: no hand-off to another thread on the way.
//!
//! A keepalive thread refreshes the session of every connection that has sent nothing for half a
//! lease period (Anemone §2.5: soft state that the server drops after three silent periods), so
//! an idle pager keeps its pages. REFRESH is one-way, so the keepalive never leaves replies for
//! an idle pager to read; it writes under the connection's write lock, between whole frames.

use netram_net::handshake::Connected;
use netram_net::latency::{PmQos, DEFAULT_SPIN};
use netram_net::{handshake, reserve_tags, FrameBuffer, HandshakeError, RecordKey, Security};
use netram_pager::{ServerInfo, Transport, TransportError};
use netram_proto::{
    decode_reply, GetResult, Hello, Kind, Reply, Request, HELLO_END_ON_CLOSE, HELLO_SEALED_PAGES,
};
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Who the client is and how patient it is.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub node: u64,
    /// Must grow across restarts of the client: the boot time in nanoseconds by default.
    pub incarnation: u64,
    pub session: u64,
    pub connect_timeout: Duration,
    /// A server that sends nothing for this long while a reply is owed is declared dead.
    pub reply_timeout: Duration,
    /// Hold the PM QoS request and poll before sleeping (see [`crate::latency`]).
    pub low_latency: bool,
    /// Log a server that cannot be reached (off for reconnection attempts).
    pub warn_unreachable: bool,
    /// Ask the server to end the session when its connection closes (`HELLO_END_ON_CLOSE`):
    /// this client never resumes a session (a reconnection opens a new one), so a session
    /// whose connection is gone holds only dead pages. On by default; off, the session's
    /// pages wait for its lease to run out (as for a client whose machine died).
    pub end_on_close: bool,
    /// Mutual TLS with this node's credentials (frames sealed), or clear TCP for loopback
    /// development. `ClientConfig::new` starts in clear: front ends set it from the node's
    /// credentials (`NETRAM_TLS`) and run in clear only when told (`--insecure`).
    pub security: Security,
    /// The pager over this transport seals every page end to end (`PagerConfig::seal`): over
    /// TLS a GET reply's page data may then come outside the record's seal, checked by the
    /// pager against its own tags instead. Off by default; the pager refuses to start over a
    /// transport with it on unless it seals.
    pub sealed_pages: bool,
}

impl ClientConfig {
    /// A fresh identity: a random node id, this moment as the incarnation, a random session.
    pub fn new() -> Self {
        Self::with_node(fastrand::u64(..))
    }

    /// A client that keeps its node id across restarts (so that a restart supersedes the old
    /// incarnation's pages at once) and takes a new incarnation from the clock.
    pub fn with_node(node: u64) -> Self {
        let incarnation = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        Self {
            node,
            incarnation,
            session: fastrand::u64(..),
            connect_timeout: Duration::from_secs(3),
            reply_timeout: Duration::from_secs(5),
            low_latency: false,
            warn_unreachable: true,
            end_on_close: true,
            security: Security::Insecure,
            sealed_pages: false,
        }
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// The writing end of a connection: the socket and, over TLS, the key its frames are sealed
/// with (shared with the keepalive thread, so records are sealed in the order they are sent).
#[derive(Debug)]
struct Writer {
    stream: TcpStream,
    seal: Option<RecordKey>,
}

impl Writer {
    /// Seals (over TLS) and writes `buf`: whole frames, each followed by its tag's room.
    fn send(&mut self, buf: &mut [u8]) -> io::Result<()> {
        if let Some(k) = &mut self.seal {
            k.seal_all(buf);
        }
        self.stream.write_all(buf)
    }
}

/// The part of a connection the keepalive thread shares.
#[derive(Debug)]
struct Shared {
    writer: Mutex<Writer>,
    last_send_ms: AtomicU64,
    lease_period_ms: u64,
}

#[derive(Debug)]
struct Conn {
    info: ServerInfo,
    reader: Option<TcpStream>,
    shared: Option<Arc<Shared>>,
    wbuf: Vec<u8>,
    rbuf: FrameBuffer,
    /// Frames go out sealed (TLS).
    sealed: bool,
    broken: Option<TransportError>,
    /// Reconnection attempts back off: not before this, and the wait doubles each failure.
    retry_at: Option<Instant>,
    retry_wait: Duration,
    /// A reconnection under way on a thread of its own (see [`Dial`]).
    dialing: Option<Dial>,
}

/// A connection being opened (TCP, TLS, HELLO) on a thread of its own. The caller of
/// `reconnect` or `add_server` holds the pager, and its owner's lock, which the program's
/// faults need: a server that accepts and never answers would hold them for the whole
/// handshake timeout at every attempt. The caller waits [`DIAL_WAIT`] at most, long enough for
/// a server that answers on a local network; a later call takes up what came after.
#[derive(Debug)]
struct Dial(std::sync::mpsc::Receiver<Conn>);

/// How long `reconnect` and `add_server` wait for a connection being opened before they
/// return, leaving it to a later call. A loopback TLS handshake takes about 1 ms here.
const DIAL_WAIT: Duration = Duration::from_millis(10);

impl Dial {
    fn start(name: String, cfg: ClientConfig) -> Result<Self, TransportError> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("netram-dial".into())
            .spawn(move || {
                // Ends by itself, within the connect timeout: the connection is dropped if
                // nobody takes it any more.
                let _ = tx.send(open_conn(name, &cfg));
            })
            .map_err(|e| TransportError::Disconnected(format!("cannot start connecting: {e}")))?;
        Ok(Self(rx))
    }

    /// The connection, once opened (or failed); `None` while still under way.
    fn take(&self, wait: Duration) -> Option<Conn> {
        use std::sync::mpsc::RecvTimeoutError;
        match self.0.recv_timeout(wait) {
            Ok(conn) => Some(conn),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some(Conn::dead(
                String::new(),
                "the connecting thread ended without a connection".into(),
            )),
        }
    }
}

/// A reconnection attempt waits at most this long for the server (on its own thread, see
/// [`Dial`]): a host that is gone must not keep a thread for the whole connect timeout.
const RECONNECT_TIMEOUT: Duration = Duration::from_millis(250);
/// The longest wait between two reconnection attempts to one server.
const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Connections to every server of a pager.
#[derive(Debug)]
pub struct TcpTransport {
    conns: Vec<Conn>,
    epoch: Instant,
    spin: Duration,
    reply_timeout: Duration,
    stop: Arc<AtomicBool>,
    keepalive: Option<JoinHandle<()>>,
    /// The connections the keepalive thread refreshes.
    refreshed: Arc<Mutex<Vec<Arc<Shared>>>>,
    /// For reconnections: the same node and incarnation, a new session each time.
    cfg: ClientConfig,
    /// The servers came from this machine's daemon (`crate::discover`): members that join
    /// later are added too (`crate::maintain`).
    discovered: bool,
    /// Connections to servers being added, by name (see [`Dial`]).
    joining: std::collections::HashMap<String, Dial>,
    _qos: Option<PmQos>,
}

/// Writes beyond this many buffered bytes go out at once rather than at the next `recv`.
const WBUF_FLUSH: usize = 256 * 1024;

/// Why a server could not be connected to; the server starts out dead.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot resolve {addr}: {source}")]
    Resolve {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("{0} resolves to no address")]
    NoAddress(String),
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    #[error("socket: {0}")]
    Socket(#[from] io::Error),
}

/// Why `netram stats` got no counters.
#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    #[error("cannot reach {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    #[error("{addr}: {source}")]
    Transport {
        addr: String,
        #[source]
        source: TransportError,
    },
    #[error("{addr} answered STATS with {kind:?}")]
    Unexpected { addr: String, kind: Kind },
}

/// Opens a connection and performs the handshake.
fn connect_to(addr: SocketAddr, cfg: &ClientConfig) -> Result<Connected, HandshakeError> {
    let flags = if cfg.end_on_close {
        HELLO_END_ON_CLOSE
    } else {
        0
    } | if cfg.sealed_pages {
        HELLO_SEALED_PAGES
    } else {
        0
    };
    let hello = Hello::new(cfg.node, cfg.incarnation, cfg.session).with_flags(flags);
    handshake(addr, &hello, cfg.connect_timeout, &cfg.security)
}

fn resolve(addr: &str) -> Result<SocketAddr, ConnectError> {
    addr.to_socket_addrs()
        .map_err(|source| ConnectError::Resolve {
            addr: addr.to_owned(),
            source,
        })?
        .next()
        .ok_or_else(|| ConnectError::NoAddress(addr.to_owned()))
}

impl TcpTransport {
    /// Connects to every server. A server that cannot be reached is not an error here: it
    /// starts out dead (the pager reports it), so that one missing server does not stop a client.
    pub fn connect<S: AsRef<str>>(servers: &[S], cfg: &ClientConfig) -> Self {
        if cfg.low_latency {
            netram_net::latency::prepare_polling();
        }
        let epoch = Instant::now();
        let conns: Vec<Conn> = servers
            .iter()
            .map(|name| open_conn(name.as_ref().to_string(), cfg))
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let refreshed = Arc::new(Mutex::new(
            conns
                .iter()
                .filter_map(|c| c.shared.clone())
                .collect::<Vec<_>>(),
        ));
        let keepalive = {
            let (stop, refreshed) = (stop.clone(), refreshed.clone());
            std::thread::Builder::new()
                .name("netram-keepalive".into())
                .spawn(move || keepalive_loop(refreshed, epoch, stop))
                .expect("spawn keepalive thread")
        };
        Self {
            conns,
            epoch,
            spin: if cfg.low_latency {
                DEFAULT_SPIN
            } else {
                Duration::ZERO
            },
            reply_timeout: cfg.reply_timeout,
            stop,
            keepalive: Some(keepalive),
            refreshed,
            cfg: cfg.clone(),
            discovered: false,
            joining: std::collections::HashMap::new(),
            _qos: if cfg.low_latency { PmQos::hold() } else { None },
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Writes the buffered requests of one connection.
    fn flush(&mut self, server: usize) {
        let c = &self.conns[server];
        if c.wbuf.is_empty() || c.broken.is_some() {
            self.conns[server].wbuf.clear();
            return;
        }
        // The clock only for a write: every `try_recv` flushes every connection, and the
        // loop of `netram nbd` calls it for each reply (reading it for nothing was 1.2 µs of a
        // depth-1 NBD read's 30 µs of CPU, `perf`, 2026-11-30).
        let now = self.now_ms();
        let c = &mut self.conns[server];
        let shared = c
            .shared
            .as_ref()
            .expect("a connection that is not broken has a writer");
        let mut w = shared.writer.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = w.send(&mut c.wbuf) {
            c.broken = Some(TransportError::Disconnected(format!("write: {e}")));
        }
        shared.last_send_ms.store(now, Ordering::Relaxed);
        c.wbuf.clear();
    }

    /// The servers whose handshake failed, with the reason.
    /// Whether the servers came from this machine's daemon (members that join later are
    /// added as they come).
    pub fn discovered(&self) -> bool {
        self.discovered
    }

    /// Marks the servers as this machine's daemon's members.
    /// How long a reply is waited for before its server is taken for dead.
    pub fn reply_timeout(&self) -> Duration {
        self.reply_timeout
    }

    pub fn set_discovered(&mut self) {
        self.discovered = true;
    }

    /// How a connection is opened again (to a server that died, or that joined): the same
    /// node and incarnation, a new session, within [`RECONNECT_TIMEOUT`], and without a
    /// warning at every failed attempt.
    fn redial_config(&self) -> ClientConfig {
        ClientConfig {
            session: fastrand::u64(..),
            warn_unreachable: false,
            connect_timeout: self.cfg.connect_timeout.min(RECONNECT_TIMEOUT),
            ..self.cfg.clone()
        }
    }

    pub fn servers_unreachable(&self) -> Vec<(String, String)> {
        self.conns
            .iter()
            .filter_map(|c| {
                c.info
                    .connected
                    .clone()
                    .err()
                    .map(|e| (c.info.name.clone(), e))
            })
            .collect()
    }

    /// Ends every session cleanly: the servers free this client's pages now, rather than when
    /// the lease runs out.
    pub fn close(&mut self) {
        for i in 0..self.conns.len() {
            if self.conns[i].broken.is_some() {
                continue;
            }
            self.conns[i].push(|b| Request::Close.encode(0, b));
            self.flush(i);
            if let Err(e) = self.recv(i) {
                tracing::debug!("close: {e}");
            }
            if let Some(r) = &self.conns[i].reader {
                let _ = r.shutdown(Shutdown::Both);
            }
            self.conns[i].broken = Some(TransportError::Disconnected("closed".into()));
        }
    }
}

/// Connects to one server; a failure gives a connection that starts out broken.
impl Conn {
    /// Appends frames to the write buffer, with room for their tags when they are sealed.
    fn push(&mut self, encode: impl FnOnce(&mut Vec<u8>)) {
        let mark = self.wbuf.len();
        encode(&mut self.wbuf);
        if self.sealed {
            reserve_tags(&mut self.wbuf, mark);
        }
    }

    /// The whole frame at the head of the read buffer, decoded. A record that does not open,
    /// or a clear tail that is not exactly a GET reply's page data, is the server's (or the
    /// network's) lie: the connection is broken.
    fn take_reply(&mut self) -> Result<(u64, Reply<'_>), TransportError> {
        let (frame, tail) = match self.rbuf.next_frame_tail() {
            Ok(Some(f)) => f,
            Ok(None) => {
                let err = TransportError::Protocol("no whole reply".into());
                self.broken = Some(err.clone());
                return Err(err);
            }
            Err(e) => {
                tracing::warn!(server = %self.info.name, "bad reply: {e}");
                let err = TransportError::Protocol(e.to_string());
                self.broken = Some(err.clone());
                return Err(err);
            }
        };
        let reply = decode_reply(frame).map_err(|e| {
            let err = TransportError::Protocol(e.to_string());
            tracing::warn!(server = %self.info.name, "bad reply: {e}");
            err
        })?;
        // A clear tail must be exactly the data of the reply's pages, as its sealed entries
        // describe them (the data follows the entries, to the end of the frame): read from the
        // decoded reply, not from a second walk.
        let tail_is_page_data = || match &reply.1 {
            Reply::Get { pages, .. } => {
                let mut found = pages.iter().filter_map(|p| match p {
                    GetResult::Found(p) if !p.data.is_empty() => Some(p),
                    _ => None,
                });
                let data: usize = found.clone().map(|p| p.data.len()).sum();
                let ends_frame = found
                    .next_back()
                    .is_some_and(|p| p.data.as_ptr_range().end == frame.as_ptr_range().end);
                data == tail && ends_frame
            }
            _ => false,
        };
        if tail > 0 && !tail_is_page_data() {
            tracing::warn!(server = %self.info.name, tail, "a reply left in clear what is not its pages' data");
            let err = TransportError::Protocol(format!(
                "{tail} bytes in clear that are not a GET reply's page data"
            ));
            self.broken = Some(err.clone());
            return Err(err);
        }
        Ok(reply)
    }
}

fn open_conn(name: String, cfg: &ClientConfig) -> Conn {
    let addr = resolve(&name).ok();
    let result = resolve(&name).and_then(|a| Ok(connect_to(a, cfg)?));
    let mut recv_key = None;
    let (reader, shared, mut info) = match result {
        Ok(Connected {
            stream,
            welcome: w,
            keys,
            ..
        }) => {
            let (send, recv) = match keys {
                Some(k) => (Some(k.send), Some(k.recv)),
                None => (None, None),
            };
            recv_key = recv;
            let setup = stream
                .set_read_timeout(Some(cfg.reply_timeout))
                .and_then(|()| stream.try_clone());
            match setup {
                Ok(writer) => (
                    Some(stream),
                    Some(Arc::new(Shared {
                        writer: Mutex::new(Writer {
                            stream: writer,
                            seal: send,
                        }),
                        last_send_ms: AtomicU64::new(0),
                        lease_period_ms: u64::from(w.lease_period_ms).max(1),
                    })),
                    ServerInfo {
                        name,
                        addr: None,
                        node: w.server_node,
                        window: w.window,
                        capacity_pages: w.capacity_pages,
                        free_pages: w.free_pages,
                        connected: Ok(()),
                    },
                ),
                Err(e) => (None, None, dead_info(name, e.to_string())),
            }
        }
        Err(reason) => {
            // Reconnection attempts repeat every second or so: only the first connect warns.
            if cfg.warn_unreachable {
                tracing::warn!(server = %name, "server unreachable: {reason}");
            }
            (None, None, dead_info(name, reason.to_string()))
        }
    };
    info.addr = addr;
    Conn {
        broken: info
            .connected
            .clone()
            .err()
            .map(TransportError::Disconnected),
        info,
        reader,
        shared,
        wbuf: Vec::new(),
        sealed: recv_key.is_some(),
        rbuf: if cfg.sealed_pages {
            FrameBuffer::sealed(recv_key).allow_clear_tail()
        } else {
            FrameBuffer::sealed(recv_key)
        },
        retry_at: None,
        retry_wait: Duration::from_millis(500),
        dialing: None,
    }
}

impl Conn {
    /// A connection that failed before it was made.
    fn dead(name: String, reason: String) -> Self {
        Self {
            broken: Some(TransportError::Disconnected(reason.clone())),
            info: dead_info(name, reason),
            reader: None,
            shared: None,
            wbuf: Vec::new(),
            rbuf: FrameBuffer::sealed(None),
            sealed: false,
            retry_at: None,
            retry_wait: Duration::from_millis(500),
            dialing: None,
        }
    }
}

fn dead_info(name: String, reason: String) -> ServerInfo {
    ServerInfo {
        name,
        addr: None,
        node: 0,
        window: 1,
        capacity_pages: 0,
        free_pages: 0,
        connected: Err(reason),
    }
}

/// Refreshes the session of every connection in `refreshed` (the list changes when a server is
/// reconnected) that has sent nothing for half a lease period.
fn keepalive_loop(refreshed: Arc<Mutex<Vec<Arc<Shared>>>>, epoch: Instant, stop: Arc<AtomicBool>) {
    let mut frame = Vec::new();
    Request::Refresh.encode(0, &mut frame);
    while !stop.load(Ordering::SeqCst) {
        let conns = refreshed.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let tick = conns
            .iter()
            .map(|c| c.lease_period_ms / 4)
            .min()
            .unwrap_or(250)
            .clamp(5, 250);
        std::thread::park_timeout(Duration::from_millis(tick));
        let now = epoch.elapsed().as_millis() as u64;
        for c in &conns {
            if now.saturating_sub(c.last_send_ms.load(Ordering::Relaxed)) >= c.lease_period_ms / 2 {
                let mut w = c.writer.lock().unwrap_or_else(|p| p.into_inner());
                let mut f = frame.clone();
                if w.seal.is_some() {
                    reserve_tags(&mut f, 0);
                }
                // A failure here shows up on the pager's next request.
                let _ = w.send(&mut f);
                c.last_send_ms.store(now, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.keepalive.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Transport for TcpTransport {
    fn servers(&self) -> Vec<ServerInfo> {
        self.conns.iter().map(|c| c.info.clone()).collect()
    }
    fn reply_timeout_us(&self) -> Option<u64> {
        Some(self.reply_timeout.as_micros() as u64)
    }

    fn reply_fd(&self, server: usize) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        let c = self.conns.get(server)?;
        c.reader.as_ref().map(|r| r.as_raw_fd())
    }

    fn flush(&mut self) {
        for i in 0..self.conns.len() {
            TcpTransport::flush(self, i);
        }
    }

    fn leaves_pages_to_pager(&self) -> bool {
        self.cfg.sealed_pages
    }

    fn send(
        &mut self,
        server: usize,
        req_id: u64,
        req: &Request<'_>,
    ) -> Result<(), TransportError> {
        let c = &mut self.conns[server];
        if let Some(e) = &c.broken {
            return Err(e.clone());
        }
        c.push(|b| req.encode(req_id, b));
        if c.wbuf.len() >= WBUF_FLUSH {
            self.flush(server);
        }
        Ok(())
    }

    fn send_frame(&mut self, server: usize, frame: &[u8]) -> Result<(), TransportError> {
        let c = &mut self.conns[server];
        if let Some(e) = &c.broken {
            return Err(e.clone());
        }
        c.push(|b| b.extend_from_slice(frame));
        if c.wbuf.len() >= WBUF_FLUSH {
            self.flush(server);
        }
        Ok(())
    }

    fn recv(&mut self, server: usize) -> Result<(u64, Reply<'_>), TransportError> {
        for i in 0..self.conns.len() {
            self.flush(i);
        }
        let spin = self.spin;
        let timeout_ms = self.reply_timeout.as_millis() as u64;
        let c = &mut self.conns[server];
        if let Some(e) = &c.broken {
            return Err(e.clone());
        }
        loop {
            match c.rbuf.has_frame() {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    let err = TransportError::Protocol(e.to_string());
                    c.broken = Some(err.clone());
                    return Err(err);
                }
            }
            let reader = c
                .reader
                .as_mut()
                .expect("a connection that is not broken has a reader");
            let err = match c.rbuf.fill(reader, spin) {
                Ok(0) => TransportError::Disconnected("the server closed the connection".into()),
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    TransportError::Timeout(timeout_ms)
                }
                Err(e) => TransportError::Disconnected(e.to_string()),
            };
            c.broken = Some(err.clone());
            return Err(err);
        }
        c.take_reply()
    }

    fn try_recv(&mut self, server: usize) -> Option<Result<(u64, Reply<'_>), TransportError>> {
        for i in 0..self.conns.len() {
            self.flush(i);
        }
        let c = &mut self.conns[server];
        if let Some(e) = &c.broken {
            return Some(Err(e.clone()));
        }
        loop {
            match c.rbuf.has_frame() {
                Ok(true) => return Some(c.take_reply()),
                Ok(false) => {}
                Err(e) => {
                    let err = TransportError::Protocol(e.to_string());
                    c.broken = Some(err.clone());
                    return Some(Err(err));
                }
            }
            let reader = c.reader.as_ref()?;
            let err = match c.rbuf.fill_now(reader) {
                Ok(None) => return None,
                Ok(Some(0)) => {
                    TransportError::Disconnected("the server closed the connection".into())
                }
                Ok(Some(_)) => continue,
                Err(e) => TransportError::Disconnected(e.to_string()),
            };
            c.broken = Some(err.clone());
            return Some(Err(err));
        }
    }

    /// A new connection and session to a server the pager gave up on; the old connection is
    /// shut down, and the old session's pages are freed by its lease.
    fn reconnect(&mut self, server: usize) -> Result<ServerInfo, TransportError> {
        let now = Instant::now();
        let cfg = self.redial_config();
        let c = &mut self.conns[server];
        if c.dialing.is_none() {
            if c.retry_at.is_some_and(|t| now < t) {
                return Err(TransportError::Disconnected(
                    "not yet: reconnection attempts back off".into(),
                ));
            }
            c.dialing = Some(Dial::start(c.info.name.clone(), cfg)?);
        }
        let Some(conn) = c.dialing.as_ref().and_then(|d| d.take(DIAL_WAIT)) else {
            return Err(TransportError::Disconnected("connecting".into()));
        };
        c.dialing = None;
        if let Some(e) = &conn.broken {
            c.retry_at = Some(now + c.retry_wait);
            c.retry_wait = (c.retry_wait * 2).min(RECONNECT_BACKOFF_MAX);
            return Err(e.clone());
        }
        let old = std::mem::replace(&mut self.conns[server], conn);
        let mut refreshed = self.refreshed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = &old.shared {
            refreshed.retain(|s| !Arc::ptr_eq(s, old));
        }
        refreshed.extend(self.conns[server].shared.clone());
        if let Some(r) = &old.reader {
            let _ = r.shutdown(Shutdown::Both);
        }
        tracing::info!(server = %self.conns[server].info.name, "reconnected");
        Ok(self.conns[server].info.clone())
    }

    fn add_server(&mut self, name: &str) -> Result<ServerInfo, TransportError> {
        if !self.joining.contains_key(name) {
            let dial = Dial::start(name.to_string(), self.redial_config())?;
            self.joining.insert(name.to_string(), dial);
        }
        let Some(conn) = self.joining[name].take(DIAL_WAIT) else {
            return Err(TransportError::Disconnected("connecting".into()));
        };
        self.joining.remove(name);
        if let Some(e) = &conn.broken {
            return Err(e.clone());
        }
        self.refreshed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(conn.shared.clone());
        tracing::info!(server = %name, "a server that joined the cluster is used");
        let info = conn.info.clone();
        self.conns.push(conn);
        Ok(info)
    }
}

/// Asks a server for its counters: `netram stats ADDR`.
pub fn query_stats(
    addr: &str,
    timeout: Duration,
    security: &Security,
) -> Result<Vec<(String, u64)>, StatsError> {
    let cfg = ClientConfig {
        connect_timeout: timeout,
        reply_timeout: timeout,
        security: security.clone(),
        ..ClientConfig::new()
    };
    let mut t = TcpTransport::connect(&[addr], &cfg);
    if let Err(e) = &t.conns[0].info.connected {
        return Err(StatsError::Unreachable {
            addr: addr.to_owned(),
            reason: e.clone(),
        });
    }
    let failed = |source| StatsError::Transport {
        addr: addr.to_owned(),
        source,
    };
    t.send(0, 1, &Request::Stats).map_err(failed)?;
    let counters = match t.recv(0).map_err(failed)? {
        (_, Reply::Stats { counters, .. }) => counters
            .iter()
            .map(|c| (c.name.to_string(), c.value))
            .collect(),
        (_, other) => {
            return Err(StatsError::Unexpected {
                addr: addr.to_owned(),
                kind: other.kind(),
            })
        }
    };
    t.close();
    Ok(counters)
}
