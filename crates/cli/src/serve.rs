//! `netram serve`: flags and the TOML file, checked into a [`ServerConfig`].

use anyhow::{bail, Context};
use netram_server::{Server, ServerConfig};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on [default: 127.0.0.1:7077]. Beyond loopback only with TLS
    /// credentials (--tls): other hosts connect only with a certificate of the cluster.
    #[arg(long)]
    listen: Option<SocketAddr>,
    #[command(flatten)]
    security: crate::SecurityArgs,
    /// Memory to offer, e.g. 512M, 4GiB [default: 256M]. Mapped at start.
    #[arg(long)]
    capacity: Option<String>,
    /// Another daemon to join the cluster through (repeat for several; `seeds` in the file).
    /// Nodes find each other and the cluster's free memory by membership gossip (SWIM over
    /// UDP on the listen port, signed with the node's certificate); clients on this machine
    /// then need no server list.
    #[arg(long = "seed", value_name = "ADDR")]
    seeds: Vec<SocketAddr>,
    /// The address other nodes reach this one at [default: the listen address; needed when
    /// listening on a wildcard address such as 0.0.0.0 with seeds].
    #[arg(long)]
    advertise: Option<SocketAddr>,
    /// Where to answer GET /metrics over TCP (Prometheus), or `off` [default: 127.0.0.1, the
    /// listen port + 2000: 9077 for 7077]. Beyond loopback it needs --metrics-token-file.
    #[arg(long)]
    metrics: Option<String>,
    /// A file holding the token a /metrics request over TCP must bear (`Authorization: Bearer
    /// TOKEN`, Prometheus' `authorization.credentials_file`); required when --metrics is
    /// beyond loopback.
    #[arg(long)]
    metrics_token_file: Option<PathBuf>,
    /// The control socket, where this machine's clients ask which members are alive (GET
    /// /members; `netram members`), or `off` [default: /run/netram/PORT.sock as root, else
    /// $XDG_RUNTIME_DIR/netram/PORT.sock or /tmp/netram-UID/PORT.sock; off when the listen
    /// port is 0]. Clients believe it only in a directory no other user may write, served by
    /// root or by themselves.
    #[arg(long)]
    control: Option<String>,
    /// A TOML file with any of: listen, seeds, advertise, metrics, metrics_token_file, control,
    /// capacity, lease_period, max_connections,
    /// max_connections_per_client, max_handshakes, max_handshakes_per_address,
    /// max_handshakes_per_subnet, max_sessions_per_client, max_client_memory,
    /// max_client_ops, idle_timeout, write_timeout, window, low_latency, lock_memory,
    /// shm_link_mbps, node_id, adapt, offer_floor, reserve, chunk, grow_after.
    #[arg(long)]
    config: Option<PathBuf>,
    /// How often clients must refresh their session, e.g. 2s [default: 2s]. A session silent
    /// for three periods is expired and its pages freed.
    #[arg(long)]
    lease_period: Option<String>,
    /// Established connections (handshake done; over TLS, a certificate of the cluster proven)
    /// served at once; more are answered Busy and closed [default: 256].
    #[arg(long)]
    max_connections: Option<usize>,
    /// Established connections of one client at once: the node id its certificate names
    /// (without TLS, its address) [default: 64].
    #[arg(long)]
    max_connections_per_client: Option<usize>,
    /// Handshakes in progress at once, apart from the established connections; when all are
    /// taken, a newcomer takes the slot of the oldest handshake of the subnet that holds the
    /// most [default: 128].
    #[arg(long)]
    max_handshakes: Option<usize>,
    /// Handshakes in progress from one address at once [default: 8].
    #[arg(long)]
    max_handshakes_per_address: Option<usize>,
    /// Handshakes in progress from one /24 (IPv6: /64) at once [default: 32].
    #[arg(long)]
    max_handshakes_per_subnet: Option<usize>,
    /// Live sessions one client address may hold [default: 64].
    #[arg(long)]
    max_sessions_per_client: Option<u32>,
    /// Memory one client address may fill, e.g. 1G; a PUT over it is refused as if the server
    /// were full, so that no client can starve the others [default: 3/4 of the capacity].
    #[arg(long)]
    max_client_memory: Option<String>,
    /// Operations per second one client may make, each page of a batched GET, PUT or DELETE
    /// counting one, e.g. 200000. Beyond it (after a burst of a tenth of a second's worth),
    /// the client's connections are read no further until its rate allows: it is slowed,
    /// never refused, and other clients are not. Counted as requests_throttled [default: no
    /// limit].
    #[arg(long)]
    max_client_ops: Option<u32>,
    /// Close a connection that sends no whole request for this long, e.g. 30s [default: three
    /// lease periods; live clients refresh every half period].
    #[arg(long)]
    idle_timeout: Option<String>,
    /// Close a connection whose replies cannot be written for this long (a client that does
    /// not read them), e.g. 10s [default: 10s].
    #[arg(long)]
    write_timeout: Option<String>,
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
    /// The speed of this machine's network links in Mbit/s, by which shared-memory pages
    /// (`netram shm`) are sent compressed when the time the smaller page saves on the wire
    /// exceeds the time to compress and decompress it (measured at start); 0: never (all-zero
    /// pages travel as a flag either way) [default: 1000].
    #[arg(long, value_name = "MBPS")]
    shm_link_mbps: Option<u32>,
    /// Offer memory as this machine can spare it (Nswap's growing and shrinking cache): the
    /// offer starts at --offer-floor and follows MemAvailable and memory pressure (PSI), at
    /// most --capacity; what it stops offering is given back to the kernel. It grows a chunk
    /// at a time once the machine has had two chunks to spare beyond --reserve for
    /// --grow-after, and shrinks at once when filling it would leave the machine less than
    /// --reserve, or when programs stall on memory. Pages held above a shrunk offer move to
    /// other nodes (their owners move them, or to their local disk when the cluster is full);
    /// they stay readable meanwhile.
    #[arg(long)]
    adapt: bool,
    /// With --adapt: the least the offer goes down to [default: 0].
    #[arg(long)]
    offer_floor: Option<String>,
    /// With --adapt: memory kept for this machine's own programs, with the whole offer in
    /// use [default: a tenth of the machine, at least 512M].
    #[arg(long)]
    reserve: Option<String>,
    /// With --adapt: the unit the offer grows and shrinks by [default: 64M].
    #[arg(long)]
    chunk: Option<String>,
    /// With --adapt: how long the machine must have had room before the offer grows by a
    /// chunk, and how long after a shrink nothing grows [default: 5s].
    #[arg(long)]
    grow_after: Option<String>,
    /// Check the flags, the config file and the credentials, print the configuration that
    /// would run, and exit without serving (0 when it would start).
    #[arg(long)]
    check_config: bool,
    /// Test-only: read meminfo and pressure/memory from this directory instead of /proc.
    #[arg(long, hide = true, default_value = "/proc")]
    proc_dir: PathBuf,
    /// Test-only fault point: a STATS request panics inside the daemon, to check that a panic
    /// ends only its connection. Never use it in production.
    #[arg(long, hide = true)]
    fault_panic_on_stats: bool,
}

/// The TOML file's fields; each is optional and a flag overrides it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    seeds: Option<Vec<SocketAddr>>,
    advertise: Option<SocketAddr>,
    metrics: Option<String>,
    metrics_token_file: Option<PathBuf>,
    control: Option<String>,
    capacity: Option<String>,
    lease_period: Option<String>,
    max_connections: Option<usize>,
    max_connections_per_client: Option<usize>,
    max_handshakes: Option<usize>,
    max_handshakes_per_address: Option<usize>,
    max_handshakes_per_subnet: Option<usize>,
    max_sessions_per_client: Option<u32>,
    max_client_memory: Option<String>,
    max_client_ops: Option<u32>,
    idle_timeout: Option<String>,
    write_timeout: Option<String>,
    window: Option<u32>,
    low_latency: Option<bool>,
    lock_memory: Option<bool>,
    shm_link_mbps: Option<u32>,
    node_id: Option<u64>,
    adapt: Option<bool>,
    offer_floor: Option<String>,
    reserve: Option<String>,
    chunk: Option<String>,
    grow_after: Option<String>,
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

/// `--check-config`: what would run, one setting a line; the errors `Server::start` would
/// give before binding are given here too.
fn print_config(cfg: &ServerConfig) -> anyhow::Result<()> {
    let security = match &cfg.security {
        netram_client::Security::Tls(c) if !c.identity.server => bail!(
            "the certificate is node {}'s without the server role (issue it with `netram \
             keygen --server`)",
            c.identity.node
        ),
        netram_client::Security::Tls(c) => format!("mutual TLS, node {}", c.identity.node),
        netram_client::Security::Insecure if !cfg.listen.ip().is_loopback() => bail!(
            "--insecure serves clear TCP on loopback only, not on {}",
            cfg.listen
        ),
        netram_client::Security::Insecure => "clear TCP (--insecure), loopback only".into(),
    };
    if let Some(a) = cfg.metrics.filter(|a| !a.ip().is_loopback()) {
        if cfg.metrics_token.is_none() {
            bail!("metrics on {a}, beyond loopback, need --metrics-token-file");
        }
    }
    if cfg.listen.ip().is_unspecified()
        && cfg.gossip.advertise.is_none()
        && !cfg.gossip.seeds.is_empty()
    {
        bail!(
            "listening on {}, a wildcard address, with seeds: give --advertise, the address \
             other nodes reach this one at",
            cfg.listen
        );
    }
    if cfg.adapt.is_some() && cfg.lock_memory {
        bail!("--adapt gives memory back to the kernel, which --lock-memory forbids");
    }
    let mut lines = vec![
        format!("listen = {}", cfg.listen),
        format!(
            "seeds = [{}]",
            cfg.gossip
                .seeds
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        format!(
            "advertise = {}",
            cfg.gossip.advertise.map_or_else(
                || format!("{} (the listen address)", cfg.listen),
                |a| a.to_string()
            )
        ),
        format!(
            "metrics = {}{}",
            cfg.metrics.map_or_else(|| "off".into(), |a| a.to_string()),
            if cfg.metrics_token.is_some() {
                " (a bearer token required)"
            } else {
                ""
            }
        ),
        format!(
            "control = {}",
            cfg.control
                .as_ref()
                .map_or_else(|| "off".into(), |p| p.display().to_string())
        ),
        format!("security = {security}"),
        format!("capacity = {} bytes", cfg.capacity_bytes),
        format!("lease_period = {:?}", cfg.lease_period),
        format!("max_connections = {}", cfg.max_connections),
        format!(
            "max_connections_per_client = {}",
            cfg.max_connections_per_peer
        ),
        format!("max_handshakes = {}", cfg.max_handshakes),
        format!(
            "max_handshakes_per_address = {}",
            cfg.max_handshakes_per_addr
        ),
        format!(
            "max_handshakes_per_subnet = {}",
            cfg.max_handshakes_per_subnet
        ),
        format!("max_sessions_per_client = {}", cfg.max_peer_sessions),
        format!("max_client_memory = {} pages", cfg.max_peer_pages()),
        format!(
            "max_client_ops = {}",
            match cfg.max_client_ops_per_s {
                0 => "no limit".to_string(),
                n => format!("{n}/s"),
            }
        ),
        format!("idle_timeout = {:?}", cfg.idle_timeout()),
        format!("write_timeout = {:?}", cfg.write_timeout),
        format!("window = {}", cfg.window),
        format!("low_latency = {}", cfg.low_latency),
        format!("lock_memory = {}", cfg.lock_memory),
        format!(
            "shm_link_mbps = {}",
            match cfg.shm_link_mbps {
                0 => "0 (shared-memory pages never compressed)".to_string(),
                n => n.to_string(),
            }
        ),
    ];
    match &cfg.adapt {
        Some(a) => {
            let d = &a.donor;
            lines.push(format!(
                "adapt = from {} to {} bytes in {}-byte chunks, keeping {} bytes for the \
                 machine, growing after {} ms, reading {}",
                d.floor,
                d.ceiling,
                d.chunk,
                d.reserve,
                d.grow_after_ms,
                a.proc_dir.display()
            ));
        }
        None => lines.push("adapt = off".into()),
    }
    println!("{}", lines.join("\n"));
    Ok(())
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
    let max_connections = at_least_one(
        "max-connections",
        args.max_connections
            .or(file.max_connections)
            .unwrap_or(d.max_connections),
    )?;
    let max_connections_per_peer = at_least_one(
        "max-connections-per-client",
        args.max_connections_per_client
            .or(file.max_connections_per_client)
            .unwrap_or(d.max_connections_per_peer),
    )?;
    let max_handshakes = at_least_one(
        "max-handshakes",
        args.max_handshakes
            .or(file.max_handshakes)
            .unwrap_or(d.max_handshakes),
    )?;
    let max_handshakes_per_addr = at_least_one(
        "max-handshakes-per-address",
        args.max_handshakes_per_address
            .or(file.max_handshakes_per_address)
            .unwrap_or(d.max_handshakes_per_addr),
    )?;
    let max_handshakes_per_subnet = at_least_one(
        "max-handshakes-per-subnet",
        args.max_handshakes_per_subnet
            .or(file.max_handshakes_per_subnet)
            .unwrap_or(d.max_handshakes_per_subnet),
    )?;
    let max_peer_sessions = at_least_one(
        "max-sessions-per-client",
        args.max_sessions_per_client
            .or(file.max_sessions_per_client)
            .unwrap_or(d.max_peer_sessions),
    )?;
    let max_client_bytes = args
        .max_client_memory
        .as_deref()
        .or(file.max_client_memory.as_deref())
        .map(|s| parse_size("max client memory", s))
        .transpose()?;
    if max_client_bytes.is_some_and(|b| b < netram_proto::PAGE_SIZE as u64) {
        bail!("max-client-memory must be at least one 4 KiB page");
    }
    let idle_timeout = args
        .idle_timeout
        .as_deref()
        .or(file.idle_timeout.as_deref())
        .map(|s| parse_duration("idle timeout", s))
        .transpose()?;
    if let Some(t) = idle_timeout {
        // A client refreshes every half lease period: a shorter timeout would cut live ones.
        if t < lease_period {
            bail!("idle timeout {t:?} is shorter than the lease period {lease_period:?}");
        }
    }
    let write_timeout = match args
        .write_timeout
        .as_deref()
        .or(file.write_timeout.as_deref())
    {
        Some(s) => parse_duration("write timeout", s)?,
        None => d.write_timeout,
    };
    if write_timeout.is_zero() {
        bail!("write timeout must be above zero");
    }
    let window = args.window.or(file.window).unwrap_or(d.window);
    if !(1..=4096).contains(&window) {
        bail!("window {window} is outside 1..=4096");
    }
    let adapt = if args.adapt || file.adapt.unwrap_or(false) {
        let (total, _, _) =
            netram_server::donor::read_machine(&args.proc_dir).with_context(|| {
                format!(
                    "--adapt reads the machine's memory from {}",
                    args.proc_dir.join("meminfo").display()
                )
            })?;
        let mut donor = netram_policy::donor::DonorConfig::for_machine(total);
        donor.ceiling = capacity_bytes;
        let size = |flag: &Option<String>, conf: &Option<String>, what: &str| {
            flag.as_deref()
                .or(conf.as_deref())
                .map(|s| parse_size(what, s))
                .transpose()
        };
        if let Some(b) = size(&args.offer_floor, &file.offer_floor, "offer floor")? {
            donor.floor = b;
        }
        if let Some(b) = size(&args.reserve, &file.reserve, "reserve")? {
            donor.reserve = b;
        }
        if let Some(b) = size(&args.chunk, &file.chunk, "chunk")? {
            if b % netram_proto::PAGE_SIZE as u64 != 0 || b == 0 {
                bail!("chunk {b} bytes is not a whole number of 4 KiB pages");
            }
            donor.chunk = b;
        }
        if let Some(s) = args.grow_after.as_deref().or(file.grow_after.as_deref()) {
            donor.grow_after_ms = parse_duration("grow-after", s)?.as_millis() as u64;
        }
        donor.check()?;
        Some(netram_server::donor::AdaptConfig {
            donor,
            proc_dir: args.proc_dir.clone(),
        })
    } else {
        for (set, flag) in [
            (args.offer_floor.is_some(), "--offer-floor"),
            (args.reserve.is_some(), "--reserve"),
            (args.chunk.is_some(), "--chunk"),
            (args.grow_after.is_some(), "--grow-after"),
        ] {
            if set {
                bail!("{flag} is for --adapt");
            }
        }
        None
    };
    let listen = args.listen.or(file.listen).unwrap_or(d.listen);
    let metrics_given = args.metrics.as_deref().or(file.metrics.as_deref());
    let metrics = match metrics_given {
        Some("off") => None,
        Some(a) => Some(
            a.parse::<SocketAddr>()
                .with_context(|| format!("metrics {a:?} is not an address (or off)"))?,
        ),
        None => Some(SocketAddr::from((
            [127, 0, 0, 1],
            match listen.port() {
                0 => 0,
                p => p.checked_add(2000).context(
                    "the listen port + 2000 is beyond 65535: give --metrics ADDR or off",
                )?,
            },
        ))),
    };
    let metrics_token = match args
        .metrics_token_file
        .as_ref()
        .or(file.metrics_token_file.as_ref())
    {
        Some(f) => {
            let t = std::fs::read_to_string(f)
                .with_context(|| format!("cannot read the metrics token {}", f.display()))?;
            let t = t.trim().to_string();
            if t.len() < 16 {
                bail!(
                    "the metrics token in {} is shorter than 16 characters",
                    f.display()
                );
            }
            Some(t)
        }
        None => None,
    };
    let control = match args.control.as_deref().or(file.control.as_deref()) {
        Some("off") => None,
        Some(p) => Some(PathBuf::from(p)),
        None if listen.port() == 0 => None,
        None => Some(netram_client::discover::default_control(listen.port())),
    };
    let seeds = if args.seeds.is_empty() {
        file.seeds.unwrap_or_default()
    } else {
        args.seeds.clone()
    };
    Ok(ServerConfig {
        adapt,
        listen,
        metrics,
        metrics_token,
        shm_socket: control.as_deref().map(netram_shm::local::socket_of),
        control,
        metrics_required: metrics_given.is_some(),
        gossip: netram_server::gossip::GossipConfig {
            seeds,
            advertise: args.advertise.or(file.advertise),
            ..Default::default()
        },
        capacity_bytes,
        lease_period,
        max_connections,
        max_connections_per_peer,
        max_handshakes,
        max_handshakes_per_addr,
        max_handshakes_per_subnet,
        max_peer_sessions,
        max_client_ops_per_s: args
            .max_client_ops
            .or(file.max_client_ops)
            .unwrap_or(d.max_client_ops_per_s),
        max_client_bytes,
        idle_timeout,
        write_timeout,
        fault_panic_on_stats: args.fault_panic_on_stats,
        window,
        low_latency: args.low_latency || file.low_latency.unwrap_or(false),
        lock_memory: args.lock_memory || file.lock_memory.unwrap_or(false),
        shm_link_mbps: args
            .shm_link_mbps
            .or(file.shm_link_mbps)
            .unwrap_or(d.shm_link_mbps),
        node: file.node_id.unwrap_or_else(|| fastrand::u64(..)),
        security: args.security.security()?,
        ..d
    })
}

/// A count that must be at least one.
fn at_least_one<T: Copy + Default + PartialEq>(flag: &str, v: T) -> anyhow::Result<T> {
    if v == T::default() {
        bail!("{flag} must be at least 1");
    }
    Ok(v)
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let check_only = args.check_config;
    let cfg = check(args)?;
    if check_only {
        print_config(&cfg)?;
        return Ok(());
    }
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
