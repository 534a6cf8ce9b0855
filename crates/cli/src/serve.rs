//! `netram serve`: flags and the TOML file, checked into a [`ServerConfig`].

use anyhow::{bail, Context};
use netram_node::server::{Server, ServerConfig};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on [default: 127.0.0.1:7077]. Anything beyond loopback is reachable by
    /// other hosts, and netram has no authentication yet.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Memory to offer, e.g. 512M, 4GiB [default: 256M]. Mapped at start.
    #[arg(long)]
    capacity: Option<String>,
    /// A TOML file with any of: listen, capacity, lease_period, max_connections, window,
    /// low_latency, lock_memory, node_id.
    #[arg(long)]
    config: Option<PathBuf>,
    /// How often clients must refresh their session, e.g. 2s [default: 2s]. A session silent
    /// for three periods is expired and its pages freed.
    #[arg(long)]
    lease_period: Option<String>,
    /// Connections served at once; more are refused at the handshake [default: 256].
    #[arg(long)]
    max_connections: Option<usize>,
    /// Requests a client may have in flight per connection [default: 64].
    #[arg(long)]
    window: Option<u32>,
    /// Keep CPUs out of deep idle (PM QoS, needs root) and poll sockets briefly before
    /// sleeping: lower latency for some CPU time.
    #[arg(long)]
    low_latency: bool,
    /// Lock the arena in RAM so stored pages are never swapped out.
    #[arg(long)]
    lock_memory: bool,
}

/// The TOML file's fields; each is optional and a flag overrides it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    capacity: Option<String>,
    lease_period: Option<String>,
    max_connections: Option<usize>,
    window: Option<u32>,
    low_latency: Option<bool>,
    lock_memory: Option<bool>,
    node_id: Option<u64>,
}

fn parse_size(what: &str, s: &str) -> anyhow::Result<u64> {
    parse_size::Config::new()
        .with_binary()
        .parse_size(s)
        .with_context(|| format!("{what} {s:?} is not a size (try 512M or 4GiB)"))
}

fn parse_duration(what: &str, s: &str) -> anyhow::Result<Duration> {
    humantime::parse_duration(s)
        .with_context(|| format!("{what} {s:?} is not a duration (try 2s or 500ms)"))
}

/// Raw flags and file, checked into a configuration.
fn check(args: ServeArgs) -> anyhow::Result<ServerConfig> {
    let file = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            toml::from_str::<FileConfig>(&text)
                .with_context(|| format!("bad config file {}", path.display()))?
        }
        None => FileConfig::default(),
    };
    let d = ServerConfig::default();
    let capacity_bytes = match args.capacity.as_deref().or(file.capacity.as_deref()) {
        Some(s) => parse_size("capacity", s)?,
        None => d.capacity_bytes,
    };
    if capacity_bytes < netram_proto::PAGE_SIZE as u64 {
        bail!("capacity {capacity_bytes} bytes is less than one 4 KiB page");
    }
    let lease_period = match args
        .lease_period
        .as_deref()
        .or(file.lease_period.as_deref())
    {
        Some(s) => parse_duration("lease period", s)?,
        None => d.lease_period,
    };
    if lease_period < Duration::from_millis(10) || lease_period > Duration::from_secs(3600) {
        bail!("lease period {lease_period:?} is outside 10ms..1h");
    }
    let max_connections = args
        .max_connections
        .or(file.max_connections)
        .unwrap_or(d.max_connections);
    if max_connections == 0 {
        bail!("max-connections must be at least 1");
    }
    let window = args.window.or(file.window).unwrap_or(d.window);
    if !(1..=4096).contains(&window) {
        bail!("window {window} is outside 1..=4096");
    }
    Ok(ServerConfig {
        listen: args.listen.or(file.listen).unwrap_or(d.listen),
        capacity_bytes,
        lease_period,
        max_connections,
        window,
        low_latency: args.low_latency || file.low_latency.unwrap_or(false),
        lock_memory: args.lock_memory || file.lock_memory.unwrap_or(false),
        node: file.node_id.unwrap_or_else(|| fastrand::u64(..)),
        ..d
    })
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let cfg = check(args)?;
    let shutdown = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, shutdown.clone())
            .context("cannot install signal handlers")?;
    }
    let server = Server::start(cfg.clone(), shutdown.clone())?;
    // One line on stdout that scripts and tests can read the bound address from.
    println!("netram serve: listening on {}", server.addr());
    while !shutdown.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(50));
    }
    tracing::info!("stopping");
    let stats = server.stats();
    server.stop();
    let summary: Vec<String> = stats
        .iter()
        .filter(|(k, v)| *v > 0 && !k.ends_with("_pages") && *k != "meta_bytes")
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    tracing::info!("stopped: {}", summary.join(" "));
    Ok(())
}
