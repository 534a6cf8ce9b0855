//! `netram nbd`: flags checked into a pager and a listener, then the NBD server.

use anyhow::{bail, Context};
use netram_nbd::{Device, Listener};
use netram_node::client::{ClientConfig, TcpTransport};
use netram_node::disk::FileDisk;
use netram_pager::{Backing, Pager, PagerConfig};
use netram_proto::PAGE_SIZE;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

#[derive(Debug, clap::Args)]
pub struct NbdArgs {
    /// Size of the device, e.g. 8G.
    #[arg(long)]
    size: String,
    /// Page servers to use, comma-separated (`netram serve` addresses). Not needed with
    /// `--backing disk`.
    #[arg(long, value_delimiter = ',')]
    servers: Vec<String>,
    /// Serve on this unix socket [default: netram-nbd.sock in the temp dir].
    #[arg(long, conflicts_with = "listen")]
    socket: Option<PathBuf>,
    /// Serve on this TCP address instead of a unix socket (there is no authentication yet:
    /// keep it on loopback or a trusted network).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Where the device's pages live: cluster (spills to local disk when the cluster is
    /// full), disk (local disk only), or cluster+disk (a write-through copy on disk, so any
    /// server may die).
    #[arg(long, default_value = "cluster")]
    backing: Backing,
    /// The local write-back cache in front of the cluster (Anemone's client cache).
    #[arg(long, default_value = "16M")]
    cache: String,
    /// Directory of the spill file [default: the temp dir].
    #[arg(long)]
    spill_dir: Option<PathBuf>,
    /// NBD connections served at once.
    #[arg(long, default_value_t = 16)]
    max_connections: usize,
    /// Keep CPUs out of deep idle and poll before sleeping (see `netram serve --help`).
    #[arg(long)]
    low_latency: bool,
    /// Do not lock this process's memory or mark it an I/O flusher. Both are done by default
    /// (when allowed: root, or the capability and an unlimited RLIMIT_MEMLOCK) because a swap
    /// device that waits for memory can deadlock the machine it serves.
    #[arg(long)]
    no_lock_memory: bool,
}

fn size(what: &str, s: &str) -> anyhow::Result<u64> {
    parse_size::Config::new()
        .with_binary()
        .parse_size(s)
        .with_context(|| format!("{what} {s:?} is not a size (try 8G or 512M)"))
}

pub fn run(args: NbdArgs) -> anyhow::Result<()> {
    if !args.no_lock_memory {
        let h = netram_node::pressure::prepare_for_swap();
        match (&h.memory_locked, &h.io_flusher) {
            (Ok(()), Ok(())) => tracing::info!("memory locked; marked as an I/O flusher"),
            _ => {
                for why in [h.memory_locked.err(), h.io_flusher.err()]
                    .into_iter()
                    .flatten()
                {
                    tracing::warn!("not safe as swap under memory pressure: {why}");
                }
            }
        }
    }
    let bytes = size("size", &args.size)?;
    if bytes == 0 {
        bail!("the device needs a size above zero");
    }
    let pages = bytes.div_ceil(PAGE_SIZE as u64);
    let cache_pages = (size("cache", &args.cache)? / PAGE_SIZE as u64) as usize;
    if args.servers.is_empty() && args.backing != Backing::Disk {
        bail!(
            "--servers is needed with --backing {} (or use --backing disk)",
            args.backing
        );
    }
    let client = ClientConfig {
        low_latency: args.low_latency,
        ..ClientConfig::new()
    };
    let transport = TcpTransport::connect(&args.servers, &client);
    let dead: Vec<String> = transport
        .servers_unreachable()
        .into_iter()
        .map(|(name, why)| format!("{name} ({why})"))
        .collect();
    if !args.servers.is_empty() && dead.len() == args.servers.len() {
        bail!("no page server could be reached: {}", dead.join(", "));
    }
    for d in &dead {
        tracing::warn!("page server unreachable, going on without it: {d}");
    }
    let dir = args.spill_dir.clone().unwrap_or_else(std::env::temp_dir);
    let disk = FileDisk::create_in(&dir)?;
    let cfg = PagerConfig {
        pages,
        cache_pages,
        backing: args.backing,
        ..Default::default()
    };
    let device = Arc::new(Device::new(Pager::new(cfg, transport, disk), bytes));

    let (listener, uri) = match args.listen {
        Some(addr) => {
            let l = std::net::TcpListener::bind(addr)
                .with_context(|| format!("cannot listen on {addr}"))?;
            let addr = l.local_addr()?;
            if !addr.ip().is_loopback() {
                tracing::warn!(
                    "serving NBD on {addr}, beyond loopback: there is no authentication yet"
                );
            }
            (Listener::Tcp(l), format!("nbd://{addr}"))
        }
        None => {
            let path = args
                .socket
                .clone()
                .unwrap_or_else(|| std::env::temp_dir().join("netram-nbd.sock"));
            if std::os::unix::net::UnixStream::connect(&path).is_ok() {
                bail!("{} is in use by another server", path.display());
            }
            let _ = std::fs::remove_file(&path); // a stale socket of a server that died
            let l = std::os::unix::net::UnixListener::bind(&path)
                .with_context(|| format!("cannot listen on {}", path.display()))?;
            let uri = format!("nbd+unix:///?socket={}", path.display());
            (Listener::Unix(l, path), uri)
        }
    };
    let shutdown = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, shutdown.clone())
            .context("cannot install signal handlers")?;
    }
    // One line on stdout that scripts and tests can read the address from.
    println!("netram nbd: serving {} bytes on {uri}", bytes);
    netram_nbd::serve(listener, device.clone(), shutdown, args.max_connections)?;
    device.with_pager(|p| {
        if let Err(e) = p.flush() {
            tracing::error!("final flush: {e}");
        }
        tracing::info!(counters = ?p.counters(), "stopped");
    });
    match Arc::try_unwrap(device) {
        Ok(device) => device.into_pager().into_transport().close(),
        Err(_) => tracing::warn!(
            "connections still hold the device; their sessions end with their leases"
        ),
    }
    Ok(())
}
