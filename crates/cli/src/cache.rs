//! `netram cache`: mount a read-only mirror of a directory whose file pages are held in
//! memory (`netram_cache`), until a signal asks to stop.

use anyhow::{bail, Context};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct CacheArgs {
    /// The directory to mirror: a local one, or a network file system's mount.
    #[arg(long)]
    source: PathBuf,
    /// A name for the source that every machine mirroring the same files gives it (say, the
    /// data set's or the export's name). A file page then has the same id on all of them
    /// (from its path below the source, its size and its modification time), so the cluster
    /// knows when several machines hold it in their own memory, and one that lets such a page
    /// go drops it instead of filling other machines' idle memory with it (GMS's shared
    /// pages). Without a name, this machine's pages are its own (named by device and inode).
    /// Give the same name only to the same files: two different trees under one name would be
    /// taken for each other's duplicates (which costs reads from the source, never a wrong
    /// page: no page is read from another machine's memory because of it).
    #[arg(long, value_name = "NAME", value_parser = source_name)]
    source_name: Option<String>,
    /// Where to mount the mirror (an existing, empty directory).
    #[arg(long)]
    mount: PathBuf,
    /// How much of the files' contents this machine holds in memory (K, M, G: 1024-based).
    #[arg(long, default_value = "256M")]
    local_mem: String,
    /// Let every user read the mirror (with the source's permissions), not only this one.
    #[arg(long)]
    allow_other: bool,
    /// Keep the pages this machine drops in the cluster's memory: they go to other machines'
    /// daemons by the GMS epoch's plan (the globally oldest pages leave the cluster first),
    /// and a miss asks there before the source. Every page that comes back is checked against
    /// what was sent. Needs the daemon on this machine (`netram serve`).
    #[arg(long)]
    cluster: bool,
    /// The local daemon's control socket, for --cluster [default: $NETRAM_DAEMON, else
    /// /run/netram/7077.sock]
    #[arg(long, value_name = "PATH", requires = "cluster")]
    daemon: Option<String>,
    /// Where the pages this machine drops go, for --cluster: `gms` (by the epoch's plan) or
    /// `random` (a member drawn at random, none dropped for its age: N-chance forwarding as
    /// a client can do it, the baseline GMS measures itself against).
    #[arg(long, value_enum, default_value = "gms", requires = "cluster")]
    placement: PlacementArg,
    /// Write the counters to this file every second and at exit, in Prometheus' text format,
    /// for node_exporter's textfile collector to serve on its /metrics (a directory given to
    /// its --collector.textfile.directory, a name ending in .prom).
    #[arg(long, value_name = "PATH")]
    metrics_file: Option<PathBuf>,
    #[command(flatten)]
    security: crate::SecurityArgs,
}

/// Every counter: the pages' and, with a cluster, the cluster's (`cluster_` before each).
fn counters(
    pages: &netram_cache::Pages,
    cluster: Option<&netram_cache::Cluster>,
) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = pages
        .counters
        .snapshot()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    if let Some(c) = cluster {
        out.extend(
            c.counters
                .snapshot()
                .into_iter()
                .map(|(k, v)| (format!("cluster_{k}"), v)),
        );
    }
    out
}

type Sender = std::thread::JoinHandle<()>;

fn source_name(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 255 || s.chars().any(char::is_control) {
        return Err("a name of 1 to 255 printable characters".into());
    }
    Ok(s.to_string())
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum PlacementArg {
    Gms,
    Random,
}

/// Connects to the local daemon for `--cluster`.
fn start_cluster(
    args: &CacheArgs,
    shared: bool,
) -> anyhow::Result<(Arc<netram_cache::Cluster>, Sender)> {
    let security = args.security.security()?;
    let node = match &security {
        netram_net::Security::Tls(c) => c.identity.node,
        netram_net::Security::Insecure => fastrand::u64(1..),
    };
    let daemon = args
        .daemon
        .clone()
        .unwrap_or_else(netram_client::discover::daemon_addr);
    // Remember where as many pages went as the other members offer (within bounds).
    let offered: u64 = netram_client::discover::members(&daemon, Duration::from_secs(2))
        .with_context(|| format!("--cluster: cannot ask the daemon at {daemon}"))?
        .members
        .iter()
        .filter(|m| !m.is_self)
        .map(|m| m.offered_pages)
        .sum();
    let cfg = netram_cache::ClusterConfig {
        placement: match args.placement {
            PlacementArg::Gms => netram_cache::Placement::Gms,
            PlacementArg::Random => netram_cache::Placement::Random,
        },
        daemon: daemon.clone(),
        security,
        node,
        max_remembered: offered.clamp(1 << 16, 1 << 24) as usize,
        shared,
    };
    netram_cache::Cluster::start(cfg)
        .with_context(|| format!("--cluster: cannot read the GMS plan from the daemon at {daemon}"))
}

pub fn run(args: CacheArgs) -> anyhow::Result<()> {
    let bytes = crate::size("--local-mem", &args.local_mem)?;
    if bytes < netram_cache::pages::PAGE as u64 {
        bail!("--local-mem {}: at least one page (4K)", args.local_mem);
    }
    if !args.mount.is_dir() {
        bail!("--mount {}: not a directory", args.mount.display());
    }
    let tree = match &args.source_name {
        Some(name) => netram_cache::Tree::named(&args.source, name),
        None => netram_cache::Tree::new(&args.source),
    };
    let tree = Arc::new(tree.with_context(|| format!("--source {}", args.source.display()))?);
    if args.mount.canonicalize()?.starts_with(tree.root()) {
        bail!(
            "--mount {} is inside --source: the mirror would contain itself",
            args.mount.display()
        );
    }
    let cluster = args
        .cluster
        .then(|| start_cluster(&args, tree.is_named()))
        .transpose()?;
    let pages = Arc::new(netram_cache::Pages::with_cluster(
        (bytes / netram_cache::pages::PAGE as u64) as usize,
        cluster.as_ref().map(|(c, _)| c.clone()),
    ));
    let shutdown = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, shutdown.clone())?;
    }
    let mut mounted =
        netram_cache::mount(tree.clone(), pages.clone(), &args.mount, args.allow_other)
            .with_context(|| format!("cannot mount FUSE on {}", args.mount.display()))?;
    println!(
        "netram cache: {} mirrored on {}, {} pages in memory at most",
        tree.root().display(),
        args.mount.display(),
        pages.budget()
    );
    let write_metrics = |final_: bool| {
        if let Some(f) = &args.metrics_file {
            let c = counters(&pages, cluster.as_ref().map(|(c, _)| &**c));
            if let Err(e) = netram_cache::metrics::write(f, &c) {
                tracing::warn!("--metrics-file {}: {e}", f.display());
            } else if final_ {
                tracing::debug!("counters written to {}", f.display());
            }
        }
    };
    let mut warned = false;
    let mut written = std::time::Instant::now();
    write_metrics(false);
    while mounted.is_serving() {
        std::thread::sleep(Duration::from_millis(100));
        if written.elapsed() >= Duration::from_secs(1) {
            write_metrics(false);
            written = std::time::Instant::now();
        }
        if !shutdown.load(Ordering::SeqCst) {
            continue;
        }
        match mounted.unmount() {
            Ok(()) => break,
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error()) => {
                if !warned {
                    tracing::warn!("{} is in use: still serving it", args.mount.display());
                    warned = true;
                }
            }
            Err(e) => return Err(e).context("cannot unmount"),
        }
    }
    drop(mounted);
    if let Some((c, sender)) = &cluster {
        // Pages still in the outbox are sent (or dropped) before the numbers are read.
        c.stop();
        while !sender.is_finished() {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    write_metrics(true);
    let counters: Vec<String> = counters(&pages, cluster.as_ref().map(|(c, _)| &**c))
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    // Whoever started it may have stopped reading: a closed stdout is no error here.
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stdout(),
        "netram cache: stopped; {}",
        counters.join(", ")
    );
    Ok(())
}
