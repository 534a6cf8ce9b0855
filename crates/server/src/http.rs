//! The daemon's local window for operators and clients, on its own address (`netram serve
//! --metrics`, loopback by default): `GET /metrics` (Prometheus text, every counter the daemon
//! keeps, one per reason, as `netram stats` shows them) and `GET /members` (what this node
//! believes of the cluster, JSON: `netram members`, and what clients on this machine ask for
//! the servers to use when given none).
//!
//! Hand-written rather than an HTTP crate: two read-only GETs answered by one thread, one
//! connection at a time, each with a deadline and a size limit on the request, so that nothing
//! a peer does costs the daemon more than that thread. prometheus-client does the encoding.

use crate::daemon::Shared;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// A request must arrive whole within this, and its answer be taken within it.
const DEADLINE: Duration = Duration::from_secs(2);
/// Bytes of a request read at most (a GET line and headers).
const MAX_REQUEST: usize = 8192;

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

/// The endpoint's thread: answers until the daemon shuts down.
pub(crate) fn http_loop(listener: TcpListener, shared: Arc<Shared>) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut registry = Registry::with_prefix("netram");
    registry.register_collector(Box::new(Stats(Arc::downgrade(&shared))));
    let timeout = Timespec {
        tv_sec: 0,
        tv_nsec: 100_000_000,
    };
    while !shared.shutdown.load(Ordering::SeqCst) {
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        if !matches!(poll(&mut fds, Some(&timeout)), Ok(n) if n > 0) {
            continue;
        }
        let Ok((stream, peer)) = listener.accept() else {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        if let Err(e) = answer(stream, &shared, &registry) {
            Shared::bump(&shared.counters.http_requests_refused);
            tracing::debug!(%peer, "metrics endpoint: {e}");
        }
    }
}

fn answer(mut stream: TcpStream, shared: &Shared, registry: &Registry) -> std::io::Result<()> {
    let start = Instant::now();
    stream.set_write_timeout(Some(DEADLINE))?;
    let mut req = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && !req.windows(2).any(|w| w == b"\n\n") {
        let left = DEADLINE.saturating_sub(start.elapsed());
        if left.is_zero() || req.len() > MAX_REQUEST {
            return Err(std::io::Error::other("no whole request in time or in size"));
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Err(std::io::Error::other("closed before a whole request"));
        }
        req.extend_from_slice(&buf[..n]);
    }
    let line = req.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, ctype, body) = match (method, path) {
        ("GET", "/metrics") => {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, registry)
                .map_err(|_| std::io::Error::other("encoding the metrics"))?;
            (
                "200 OK",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                text,
            )
        }
        ("GET", "/members") => (
            "200 OK",
            "application/json",
            serde_json::to_string(&shared.members()).map_err(std::io::Error::other)? + "\n",
        ),
        ("GET", _) => (
            "404 Not Found",
            "text/plain",
            "try /metrics or /members\n".into(),
        ),
        _ => ("405 Method Not Allowed", "text/plain", "GET only\n".into()),
    };
    Shared::bump(&shared.counters.http_requests_served);
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}
