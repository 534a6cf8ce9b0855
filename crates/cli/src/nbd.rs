//! `netram nbd`: flags checked into a pager and a listener, then the NBD server (or the FUSE
//! file).

use anyhow::{bail, Context};
use netram_client::disk::FileDisk;
use netram_client::open::{open_pager, OpenOptions};
use netram_client::TcpTransport;
use netram_nbd::{Device, Listener};
use netram_pager::{Backing, Scheme};
use netram_proto::PAGE_SIZE;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct NbdArgs {
    #[command(flatten)]
    security: crate::SecurityArgs,
    /// Size of the device, e.g. 8G.
    #[arg(long)]
    size: String,
    /// Page servers to use, comma-separated (`netram serve` addresses) [default: every other
    /// live member the daemon on this machine knows, asked on its control socket,
    /// $NETRAM_DAEMON or /run/netram/7077.sock]. Not needed with `--backing disk`.
    #[arg(long, value_delimiter = ',')]
    servers: Vec<String>,
    /// Serve on this unix socket [default: netram-nbd.sock in the temp dir].
    #[arg(long, conflicts_with_all = ["listen", "fuse"])]
    socket: Option<PathBuf>,
    /// Serve on this TCP address instead of a unix socket. Clients must then speak NBD's TLS
    /// (`nbds://`) and present a certificate of the cluster (see --nbd-tls).
    #[arg(long, conflicts_with = "fuse")]
    listen: Option<SocketAddr>,
    /// NBD's own TLS on --listen: `require` (clients start TLS before anything else and
    /// present a certificate of the cluster, from `netram keygen`; this node's certificate
    /// must name the host they connect to: `netram keygen --dns HOST`, and libnbd reads
    /// ca-cert.pem, client-cert.pem and client-key.pem from its `tls-certificates`
    /// directory) or `off` (clear NBD: loopback only, for NBD clients without TLS). With
    /// --insecure there are no credentials: off.
    #[arg(long, value_enum, default_value = "require")]
    nbd_tls: NbdTls,
    /// Instead of NBD, expose the device as the file MOUNTPOINT/device through FUSE (for a
    /// loop device on a machine whose kernel has no NBD client: one hop fewer than nbdfuse).
    /// MOUNTPOINT must be an existing directory. On SIGINT or SIGTERM the file system is
    /// unmounted, unless a loop device still uses it: then netram keeps serving (the swapped
    /// memory of every process would be lost otherwise) until it is detached.
    #[arg(long, value_name = "MOUNTPOINT")]
    fuse: Option<PathBuf>,
    /// Where the device's pages live: cluster (spills to local disk when the cluster is
    /// full), disk (local disk only), or cluster+disk (a write-through copy on disk, so any
    /// server may die).
    #[arg(long, default_value = "cluster")]
    backing: Backing,
    /// How the device's pages survive the death of servers: none, mirror:N (N copies on
    /// distinct servers), parity:N (Nswap's dynamic parity: one XOR parity page per N pages
    /// written out, held by another server; one server may die; the servers must reach each
    /// other at the addresses given here), or rs:K+M (Reed-Solomon: K pages and M parity
    /// pieces on K+M distinct servers, any M of which may die). Lost copies are rebuilt in
    /// the background.
    #[arg(long, default_value = "none")]
    redundancy: Scheme,
    /// Pages rebuilt per second at most after a server dies (recovery runs while the device
    /// serves, in steps that hold the device for a moment each).
    #[arg(long, default_value_t = 100_000)]
    recovery_rate: u64,
    /// The local write-back cache in front of the cluster (Anemone's client cache).
    #[arg(long, default_value = "16M")]
    cache: String,
    /// Directory of the spill file [default: the temp dir].
    #[arg(long)]
    spill_dir: Option<PathBuf>,
    /// Over TLS (--listen), the nodes whose certificates may use this device, comma-separated
    /// [default: this node's own id, from its certificate]; `any` lets every node of the
    /// cluster in. Others are answered NBD_REP_ERR_POLICY.
    #[arg(long, value_delimiter = ',')]
    allow_nodes: Vec<String>,
    /// NBD connections served at once (their option haggling over).
    #[arg(long, default_value_t = 64)]
    max_connections: usize,
    /// NBD connections at once of one client that is not trusted (a node's certificate over
    /// TLS, an address in clear, a user other than the socket's owner and root on the unix
    /// socket), so that one client cannot hold every place. The unix socket's owner and root
    /// may use all of --max-connections (multi-conn clients open many at once).
    #[arg(long, default_value_t = 8)]
    max_connections_per_client: usize,
    /// Handshakes (option haggling) in progress at once, apart from the connections served;
    /// when all are taken a newcomer takes the slot of the oldest of the fullest subnet.
    #[arg(long, default_value_t = 32)]
    max_handshakes: usize,
    /// Handshakes in progress from one address at once (and from one /24 or /64: twice this).
    #[arg(long, default_value_t = 4)]
    max_handshakes_per_address: usize,
    /// Keep CPUs out of deep idle and poll before sleeping (see `netram serve --help`).
    #[arg(long)]
    low_latency: bool,
    /// Compress pages before they are sealed when that pays over a link of this many Mbit/s
    /// (see `netram run --help`); servers then see how long each compressed page is. 0:
    /// never.
    #[arg(long, value_name = "MBPS", default_value_t = 0)]
    compress_link_mbps: u32,
    /// Do not lock this process's memory or mark it an I/O flusher. Both are done by default
    /// (when allowed: root, or the capability and an unlimited RLIMIT_MEMLOCK) because a swap
    /// device that waits for memory can deadlock the machine it serves.
    #[arg(long)]
    no_lock_memory: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum NbdTls {
    Require,
    Off,
}

pub fn run(args: NbdArgs) -> anyhow::Result<()> {
    if !args.no_lock_memory {
        let h = netram_client::pressure::prepare_for_swap();
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
    let bytes = crate::size("size", &args.size)?;
    if bytes == 0 {
        bail!("the device needs a size above zero");
    }
    let pages = bytes.div_ceil(PAGE_SIZE as u64);
    let cache_pages = (crate::size("cache", &args.cache)? / PAGE_SIZE as u64) as usize;
    let security = if args.backing == Backing::Disk {
        netram_client::Security::Insecure // no servers: nothing to reach
    } else {
        args.security.security()?
    };
    let mut pager = open_pager(&OpenOptions {
        security,
        servers: args.servers.clone(),
        backing: args.backing,
        pages,
        cache_pages,
        spill_dir: args.spill_dir.clone(),
        low_latency: args.low_latency,
        redundancy: args.redundancy,
    })?;
    netram_client::open::compress(&mut pager, args.compress_link_mbps);
    let device = Arc::new(Device::new(pager, bytes));
    let cfg = netram_client::maintain::MaintainConfig {
        pages_per_s: args.recovery_rate,
        ..Default::default()
    };
    let reply_timeout = device.with_pager(|p| p.transport().reply_timeout());
    let upkeep = netram_pager::Upkeep {
        schedule: cfg.schedule(reply_timeout),
        pacing: cfg.pacing(),
    };
    let maintenance = {
        let with_pager = {
            let device = device.clone();
            move |f: &mut dyn FnMut(&mut netram_client::ClientPager)| device.with_pager(|p| f(p))
        };
        if args.fuse.is_some() {
            // FUSE's threads share the pager: a thread of its own runs the schedule.
            let busy = device.clone();
            netram_client::maintain::spawn_beside(with_pager, move || busy.busy(), cfg)
        } else {
            // The transmission loop runs the schedule (`netram_nbd::serve`'s upkeep); this
            // thread only asks the local daemon about membership, a blocking call.
            netram_client::maintain::spawn_membership(with_pager, cfg)
        }
    };
    let shutdown = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, shutdown.clone())
            .context("cannot install signal handlers")?;
    }
    match &args.fuse {
        Some(mountpoint) => serve_fuse(&device, mountpoint, bytes, &shutdown)?,
        None => serve_nbd(&args, &device, bytes, shutdown, upkeep)?,
    }
    drop(maintenance);
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

type NetDevice = Device<TcpTransport, FileDisk>;

/// Serves the device as a FUSE file until a signal asks to stop and nothing uses the file any
/// more, or until someone unmounts it.
fn serve_fuse(
    device: &Arc<NetDevice>,
    mountpoint: &Path,
    bytes: u64,
    shutdown: &AtomicBool,
) -> anyhow::Result<()> {
    if !mountpoint.is_dir() {
        bail!("--fuse {}: not a directory", mountpoint.display());
    }
    let mut mounted = netram_nbd::fuse::mount(device.clone(), mountpoint)
        .with_context(|| format!("cannot mount FUSE on {}", mountpoint.display()))?;
    println!(
        "netram nbd: serving {bytes} bytes on {}",
        mounted.file().display()
    );
    let mut warned = false;
    while mounted.is_serving() {
        std::thread::sleep(Duration::from_millis(100));
        if !shutdown.load(Ordering::SeqCst) {
            continue;
        }
        match mounted.unmount() {
            Ok(()) => break,
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error()) => {
                if !warned {
                    tracing::warn!(
                        "{} is in use (a loop device? swapoff and losetup -d it): \
                         still serving it until it is released",
                        mounted.file().display()
                    );
                    warned = true;
                }
            }
            Err(e) => return Err(e).context("cannot unmount"),
        }
    }
    drop(mounted);
    Ok(())
}

fn serve_nbd(
    args: &NbdArgs,
    device: &Arc<NetDevice>,
    bytes: u64,
    shutdown: Arc<AtomicBool>,
    upkeep: netram_pager::Upkeep,
) -> anyhow::Result<()> {
    let mut tls = None;
    let (listener, uri) = match args.listen {
        Some(addr) => {
            let credentials = match (args.nbd_tls, args.security.security()?) {
                (NbdTls::Require, netram_client::Security::Tls(c)) => Some(c),
                _ => None,
            };
            if credentials.is_none() && !addr.ip().is_loopback() {
                bail!(
                    "--listen {addr} without TLS: clear NBD is served on loopback only \
                     (drop --nbd-tls off and --insecure, and give the node's credentials)"
                );
            }
            let l = std::net::TcpListener::bind(addr)
                .with_context(|| format!("cannot listen on {addr}"))?;
            let addr = l.local_addr()?;
            let scheme = match credentials {
                Some(c) => {
                    tls = Some(reload_tls(c, shutdown.clone()));
                    "nbds"
                }
                None => {
                    tracing::warn!(
                        "serving NBD in clear on {addr}: anyone on this machine can use the device"
                    );
                    "nbd"
                }
            };
            (Listener::Tcp(l), format!("{scheme}://{addr}"))
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
    // One line on stdout that scripts and tests can read the address from.
    println!("netram nbd: serving {bytes} bytes on {uri}");
    let allowed_nodes = allowed_nodes(args)?;
    if let Some(nodes) = &allowed_nodes {
        tracing::info!(?nodes, "over TLS, the device serves these nodes only");
    }
    let limits = netram_nbd::Limits {
        max_connections: args.max_connections.max(1),
        max_connections_per_client: args.max_connections_per_client.max(1),
        max_handshakes: args.max_handshakes.max(1),
        max_handshakes_per_addr: args.max_handshakes_per_address.max(1),
        max_handshakes_per_subnet: args.max_handshakes_per_address.max(1) * 2,
        allowed_nodes,
        ..netram_nbd::Limits::default()
    };
    netram_nbd::serve(
        listener,
        device.clone(),
        shutdown,
        limits,
        tls,
        Some(upkeep),
    )?;
    Ok(())
}

/// The nodes `--allow-nodes` names: `None` for `any`; by default this node's own (a device
/// belongs to its node: another node's certificate of the same cluster does not reach it).
fn allowed_nodes(args: &NbdArgs) -> anyhow::Result<Option<Vec<u64>>> {
    if args.allow_nodes.iter().any(|n| n == "any") {
        if args.allow_nodes.len() > 1 {
            bail!("--allow-nodes any: no other node with it");
        }
        return Ok(None);
    }
    if !args.allow_nodes.is_empty() {
        return args
            .allow_nodes
            .iter()
            .map(|n| {
                n.parse::<u64>()
                    .with_context(|| format!("--allow-nodes {n}: not a node id"))
            })
            .collect::<anyhow::Result<Vec<u64>>>()
            .map(Some);
    }
    match args.security.security()? {
        netram_client::Security::Tls(c) => {
            let me = c
                .identity()
                .context("this node's certificate names no node id")?;
            Ok(Some(vec![me.node]))
        }
        // No TLS: no identities (clear NBD is served on loopback only).
        netram_client::Security::Insecure => Ok(None),
    }
}

/// The TLS configuration of the NBD listener, replaced whenever the node's revocation list
/// changes (checked every second, as the daemon does) until `shutdown`: a revoked node's
/// next connection is refused.
fn reload_tls(
    credentials: Arc<netram_net::Credentials>,
    shutdown: Arc<AtomicBool>,
) -> netram_nbd::tls::TlsConfig {
    let config = Arc::new(std::sync::RwLock::new(credentials.server_config()));
    let shared = config.clone();
    let mut current = credentials;
    let spawned = std::thread::Builder::new()
        .name("netram-nbd-crl".into())
        .spawn(move || {
            while !shutdown.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_secs(1));
                match current.reloaded() {
                    None => {}
                    Some(Ok(c)) => {
                        tracing::info!("revocation list reloaded");
                        *shared.write().unwrap_or_else(|p| p.into_inner()) = c.server_config();
                        current = Arc::new(c);
                    }
                    Some(Err(e)) => tracing::error!("revocation list not reloaded: {e}"),
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!("revocation list will not be reloaded: {e}");
    }
    config
}
