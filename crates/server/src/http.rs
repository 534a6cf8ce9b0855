//! The daemon's windows for operators and local clients (Anemone §2.4: clients learn the
//! cluster from their local daemon):
//!
//! * the **control socket** (`netram serve --control`, a unix socket, `/run/netram/PORT.sock`
//!   as root): `GET /members` (what this node believes of the cluster, JSON: `netram members`,
//!   and what clients on this machine follow), `GET /gms` (the GMS epoch's plan this node
//!   adopted, which `netram cache` evicts by: `crate::gms`) and `GET /metrics`. Clients trust it because of
//!   where it is and who serves it, not because of a port number: they connect only to a
//!   socket whose directory no other user may write, and only if the process at the other end
//!   runs as root or as themselves (`netram_client::discover` checks both);
//! * **`/metrics` on TCP** (`--metrics`, 127.0.0.1:PORT+2000 by default) for Prometheus: every
//!   counter the daemon keeps, one per reason, as `netram stats` shows them. Beyond loopback it
//!   answers only a request bearing the token of `--metrics-token-file` (`Authorization: Bearer
//!   …`): node ids, addresses and counters are nobody else's business. `/members` and `/gms`
//!   are never served on TCP.
//!
//! Served by hyper on one thread's tokio runtime: connections are handled concurrently (at most
//! [`MAX_CONNECTIONS`] at once and [`MAX_PER_PEER`] of one peer, more are closed at once), each
//! must send its request within
//! [`HEADER_DEADLINE`] and be done within [`DEADLINE`], so that idle or slow sockets cannot
//! delay anyone's `/members`. prometheus-client does the encoding.

use crate::daemon::Shared;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// A request's headers must arrive within this.
const HEADER_DEADLINE: Duration = Duration::from_secs(2);
/// A connection is closed this long after it was accepted, whatever it is doing.
const DEADLINE: Duration = Duration::from_secs(5);
/// Connections served at once; more are closed as they come.
pub const MAX_CONNECTIONS: usize = 256;
/// Connections of one peer (an address on TCP, a user on the control socket) at once; root and
/// the daemon's own user on the control socket are bounded by [`MAX_CONNECTIONS`] only.
pub const MAX_PER_PEER: usize = 8;

/// The daemon's statistics that are levels, not counts.
const GAUGES: &[&str] = &[
    "capacity_pages",
    "arena_pages",
    "free_pages",
    "stored_pages",
    "pages_beyond_offer",
    "live_sessions",
    "meta_bytes",
    "connections",
    "other_members_alive",
    "clean_pages",
    "owned_clean_pages",
    "gcd_entries",
    "gms_epoch",
];

/// Reads the daemon's statistics at each scrape.
struct Stats(Weak<Shared>);

impl std::fmt::Debug for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Stats")
    }
}

impl Collector for Stats {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(shared) = self.0.upgrade() else {
            return Ok(());
        };
        for (name, value) in shared.stats() {
            if GAUGES.contains(&name) {
                let g = ConstGauge::new(value as i64);
                g.encode(encoder.encode_descriptor(name, name, None, g.metric_type())?)?;
            } else {
                let c = ConstCounter::new(value);
                c.encode(encoder.encode_descriptor(name, name, None, c.metric_type())?)?;
            }
        }
        let rows = shared.members();
        for (state, name) in [
            (netram_member::Liveness::Alive, "members_alive"),
            (netram_member::Liveness::Suspect, "members_suspect"),
            (netram_member::Liveness::Down, "members_down"),
        ] {
            let n = rows.members.iter().filter(|r| r.state == state).count();
            let g = ConstGauge::new(n as i64);
            let help = "members this node believes in that state, itself included";
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}

/// Where the endpoints listen, bound by the daemon before it starts serving.
#[derive(Debug)]
pub(crate) struct Listeners {
    /// `/metrics` over TCP, and the token a request must bear there (beyond loopback).
    pub metrics: Option<(std::net::TcpListener, Option<String>)>,
    /// The control socket.
    pub control: Option<std::os::unix::net::UnixListener>,
}

/// Which window a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Window {
    Tcp,
    Control,
}

struct Endpoint {
    shared: Arc<Shared>,
    registry: Registry,
    token: Option<String>,
    /// Open connections per peer (only peers with a limit).
    per_peer: std::sync::Mutex<std::collections::HashMap<String, usize>>,
}

/// A connection's place among its peer's, given back when dropped.
struct PeerSlot {
    endpoint: Arc<Endpoint>,
    peer: Option<String>,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        if let Some(p) = &self.peer {
            let mut m = self
                .endpoint
                .per_peer
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if let Some(n) = m.get_mut(p) {
                *n -= 1;
                if *n == 0 {
                    m.remove(p);
                }
            }
        }
    }
}

impl Endpoint {
    /// A place for a connection of `peer` (`None`: a peer without a limit of its own).
    fn take(self: &Arc<Self>, peer: Option<String>) -> Option<PeerSlot> {
        if let Some(p) = &peer {
            let mut m = self.per_peer.lock().unwrap_or_else(|e| e.into_inner());
            let n = m.entry(p.clone()).or_insert(0);
            if *n >= MAX_PER_PEER {
                return None;
            }
            *n += 1;
        }
        Some(PeerSlot {
            endpoint: self.clone(),
            peer,
        })
    }
}

/// The endpoints' thread: serves until the daemon shuts down.
pub(crate) fn http_loop(listeners: Listeners, shared: Arc<Shared>) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("the metrics and control endpoints cannot start: {e}");
            return;
        }
    };
    let mut registry = Registry::with_prefix("netram");
    registry.register_collector(Box::new(Stats(Arc::downgrade(&shared))));
    let token = listeners.metrics.as_ref().and_then(|(_, t)| t.clone());
    let endpoint = Arc::new(Endpoint {
        shared: shared.clone(),
        registry,
        token,
        per_peer: Default::default(),
    });
    let me = rustix::process::geteuid().as_raw();
    rt.block_on(async move {
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        let tcp = listeners.metrics.map(|(l, _)| into_tokio_tcp(l));
        let unix = listeners.control.map(into_tokio_unix);
        let tcp = tcp.and_then(|r| r.map_err(|e| tracing::error!("metrics: {e}")).ok());
        let unix = unix.and_then(|r| r.map_err(|e| tracing::error!("control: {e}")).ok());
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if shared.shutdown.load(Ordering::SeqCst) {
                        break;
                    }
                }
                Some(Ok((s, from))) = accept_tcp(&tcp) => {
                    let peer = Some(from.ip().to_string());
                    serve(s, Window::Tcp, peer, &endpoint, &slots);
                }
                Some(Ok((s, _))) = accept_unix(&unix) => {
                    // Root and this daemon's user are not limited per peer: they are who the
                    // socket is for (and could stop the daemon anyway).
                    let peer = match s.peer_cred() {
                        Ok(c) if c.uid() == 0 || c.uid() == me => None,
                        Ok(c) => Some(format!("uid {}", c.uid())),
                        Err(_) => Some("uid ?".into()),
                    };
                    serve(s, Window::Control, peer, &endpoint, &slots);
                }
            }
        }
    });
}

fn into_tokio_tcp(l: std::net::TcpListener) -> std::io::Result<tokio::net::TcpListener> {
    l.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(l)
}

fn into_tokio_unix(
    l: std::os::unix::net::UnixListener,
) -> std::io::Result<tokio::net::UnixListener> {
    l.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(l)
}

async fn accept_tcp(
    l: &Option<tokio::net::TcpListener>,
) -> Option<std::io::Result<(tokio::net::TcpStream, std::net::SocketAddr)>> {
    match l {
        Some(l) => Some(l.accept().await),
        None => std::future::pending().await,
    }
}

async fn accept_unix(
    l: &Option<tokio::net::UnixListener>,
) -> Option<std::io::Result<(tokio::net::UnixStream, tokio::net::unix::SocketAddr)>> {
    match l {
        Some(l) => Some(l.accept().await),
        None => std::future::pending().await,
    }
}

/// Serves one connection on its own task, within the connection limit and the deadlines.
fn serve<S>(
    stream: S,
    window: Window,
    peer: Option<String>,
    endpoint: &Arc<Endpoint>,
    slots: &Arc<tokio::sync::Semaphore>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (Some(place), Ok(permit)) = (endpoint.take(peer), slots.clone().try_acquire_owned()) else {
        Shared::bump(&endpoint.shared.counters.http_requests_refused);
        return; // dropped: closed
    };
    let endpoint = endpoint.clone();
    tokio::task::spawn(async move {
        let _held = (permit, place);
        let service = hyper::service::service_fn(|req: Request<Incoming>| {
            let endpoint = endpoint.clone();
            async move { Ok::<_, std::convert::Infallible>(answer(&endpoint, window, &req)) }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_DEADLINE)
            .keep_alive(false)
            .serve_connection(TokioIo::new(stream), service);
        match tokio::time::timeout(DEADLINE, conn).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                Shared::bump(&endpoint.shared.counters.http_requests_refused);
                tracing::debug!("metrics endpoint: {e}");
            }
            Err(_) => {
                Shared::bump(&endpoint.shared.counters.http_requests_refused);
                tracing::debug!("metrics endpoint: a connection outlived its deadline");
            }
        }
    });
}

/// Whether two strings are equal, in time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn answer(endpoint: &Endpoint, window: Window, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let shared = &endpoint.shared;
    let reply = |status: StatusCode, ctype: &str, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        if let Ok(v) = ctype.parse() {
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
        }
        r
    };
    if window == Window::Tcp {
        if let Some(token) = &endpoint.token {
            let given = req
                .headers()
                .get(hyper::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or("");
            if !same(given.trim().as_bytes(), token.as_bytes()) {
                Shared::bump(&shared.counters.http_requests_refused);
                return reply(
                    StatusCode::UNAUTHORIZED,
                    "text/plain",
                    "a bearer token is required\n".into(),
                );
            }
        }
    }
    if req.method() != hyper::Method::GET {
        Shared::bump(&shared.counters.http_requests_refused);
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only\n".into(),
        );
    }
    Shared::bump(&shared.counters.http_requests_served);
    match (window, req.uri().path()) {
        (_, "/metrics") => {
            let mut text = String::new();
            match prometheus_client::encoding::text::encode(&mut text, &endpoint.registry) {
                Ok(()) => reply(
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    text,
                ),
                Err(_) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    "encoding the metrics failed\n".into(),
                ),
            }
        }
        (Window::Control, "/members") => match serde_json::to_string(&shared.members()) {
            Ok(json) => reply(StatusCode::OK, "application/json", json + "\n"),
            Err(e) => reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain",
                format!("{e}\n"),
            ),
        },
        (Window::Control, "/gms") => match serde_json::to_string(&shared.gms_view().plan) {
            Ok(json) => reply(StatusCode::OK, "application/json", json + "\n"),
            Err(e) => reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain",
                format!("{e}\n"),
            ),
        },
        (Window::Tcp, "/members" | "/gms") => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "members are listed on the daemon's control socket (netram members)\n".into(),
        ),
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "try /metrics, /members or /gms\n".into(),
        ),
    }
}
