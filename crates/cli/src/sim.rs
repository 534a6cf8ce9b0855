//! `netram sim`: the deterministic simulator from the command line, to replay a failing seed or
//! to run many.

use netram_policy::redundancy::Scheme;
use netram_sim::world::Faults;
use netram_sim::{run, Report, Scenario};

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct SimArgs {
    #[command(subcommand)]
    command: Option<SimCommand>,
    /// The seed: everything in a run (the cluster, the workload, the faults) comes from it.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Run this many seeds, from --seed on, and report how many failed.
    #[arg(long, default_value_t = 1)]
    seeds: u64,
    /// Each client's redundancy: none, mirror:N, parity:N, rs:K+M.
    #[arg(long, default_value = "none")]
    scheme: Scheme,
    /// Page servers [default: 5].
    #[arg(long)]
    servers: Option<usize>,
    /// Clients, each with its own pager [default: 3].
    #[arg(long)]
    clients: Option<usize>,
    /// Pages of each client's pager [default: 48].
    #[arg(long)]
    pages: Option<u64>,
    /// Client operations per run [default: 1500].
    #[arg(long)]
    steps: Option<u32>,
    /// Only delays and reordering: no loss, reset, duplicate, bit flip, crash, partition or
    /// slow node.
    #[arg(long)]
    no_faults: bool,
    /// Print every message, fault and step to stderr (for a replay).
    #[arg(long)]
    trace: bool,
}

#[derive(Debug, clap::Subcommand)]
enum SimCommand {
    /// Global memory management at scale: GMS, N-chance forwarding, a hashed data cache or no
    /// cluster on a simulated cluster (the production state machines, the GMS paper's costs),
    /// checked at the end; prints the active nodes' figures and the epochs' cost. `--skew`
    /// runs GMS §5.5's nine-node cluster instead (`netram bench gms` runs them all).
    Gms(GmsArgs),
}

#[derive(Debug, clap::Args)]
struct GmsArgs {
    /// gms, nchance, hashed or none.
    #[arg(long, default_value = "gms")]
    algorithm: netram_sim::gms::Algorithm,
    /// Nodes: 1 % need twice their 256 pages, 40 % are idle, the rest loop over their own.
    #[arg(long, default_value_t = 1_000)]
    nodes: usize,
    /// Accesses each active node makes.
    #[arg(long, default_value_t = 1_000)]
    accesses: u64,
    /// The most weights a plan carries [default: 32].
    #[arg(long)]
    max_weights: Option<usize>,
    /// Instead: GMS §5.5's cluster, where this percentage of eight nodes hold the rest of the
    /// idle memory (25, 37.5, 50 in the paper).
    #[arg(long)]
    skew: Option<f64>,
    /// With --skew: the idle memory, in multiples of what the busy node needs.
    #[arg(long, default_value_t = 1, requires = "skew")]
    idle_factor: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn run_gms(g: GmsArgs) -> anyhow::Result<()> {
    use netram_sim::gms::experiments::{scale_config, skew_point, SkewSize};
    use netram_sim::gms::{run, Algorithm};
    if let Some(skew) = g.skew {
        if !(1.0..=99.0).contains(&skew) || g.idle_factor == 0 {
            anyhow::bail!("--skew is a percentage (1 to 99), --idle-factor at least 1");
        }
        let p = skew_point(g.seed, g.algorithm, SkewSize::QUICK, skew, g.idle_factor)
            .map_err(|e| anyhow::anyhow!("the simulation broke an invariant: {e}"))?;
        println!(
            "{} at skew {skew} %, idle memory {}x needed: speed-up {:.2}, the others' slowdown \
             {:.3}, {:.1} MB on the network; the busy node's accesses {:.2} from its memory, \
             {:.2} from the cluster, {} reads of the source; {} pages forwarded, {} epochs",
            g.algorithm.name(),
            g.idle_factor,
            p.speedup,
            p.slowdown,
            p.traffic_bytes as f64 / 1e6,
            p.hit_local,
            p.hit_remote,
            p.source_reads,
            p.outcome.forwards,
            p.outcome.epochs.epochs
        );
        return Ok(());
    }
    if g.nodes < 10 {
        anyhow::bail!("--nodes: at least 10");
    }
    let mut cfg = scale_config(g.seed, g.algorithm, g.nodes, g.accesses);
    if let Some(k) = g.max_weights {
        if k == 0 {
            anyhow::bail!("--max-weights: at least 1");
        }
        cfg.params.max_weights = k;
    }
    let broke = |e: String| anyhow::anyhow!("the simulation broke an invariant: {e}");
    let o = run(&cfg).map_err(broke)?;
    let none = run(&scale_config(g.seed, Algorithm::None, g.nodes, g.accesses)).map_err(broke)?;
    let mean_s = |o: &netram_sim::gms::Outcome| {
        let t: Vec<u64> = o.nodes.iter().filter_map(|s| s.finished_us).collect();
        t.iter().sum::<u64>() as f64 / t.len().max(1) as f64 / 1e6
    };
    let active: Vec<_> = o.nodes.iter().filter(|s| s.finished_us.is_some()).collect();
    let accesses: u64 = active.iter().map(|s| s.accesses).sum::<u64>().max(1);
    let e = &o.epochs;
    println!(
        "{} on {} nodes: {} active nodes, {:.2} s each ({:.2}x as fast as without a cluster); \
         {:.3} of their accesses from the source, {:.3} from the cluster; {:.1} MB on the \
         network ({:.1} MB of it epochs); {} epochs ({} ended early), the initiator's CPU \
         {:.0} µs and {:.0} KB out an epoch",
        g.algorithm.name(),
        g.nodes,
        active.len(),
        mean_s(&o),
        mean_s(&none) / mean_s(&o),
        active.iter().map(|s| s.source_reads).sum::<u64>() as f64 / accesses as f64,
        active.iter().map(|s| s.remote_hits).sum::<u64>() as f64 / accesses as f64,
        o.traffic.bytes() as f64 / 1e6,
        o.traffic.epoch_bytes as f64 / 1e6,
        e.epochs,
        e.early,
        e.initiator_ns as f64 / 1e3 / e.epochs.max(1) as f64,
        e.initiator_bytes_out_max as f64 / 1e3
    );
    Ok(())
}

pub fn run_sim(args: SimArgs) -> anyhow::Result<()> {
    if let Some(SimCommand::Gms(g)) = args.command {
        return run_gms(g);
    }
    if args.seeds == 0 {
        anyhow::bail!("--seeds 0: nothing to run");
    }
    let scenario = |seed: u64| {
        let d = Scenario::new(seed);
        Scenario {
            scheme: args.scheme,
            servers: args.servers.unwrap_or(d.servers),
            clients: args.clients.unwrap_or(d.clients),
            pages: args.pages.unwrap_or(d.pages),
            steps: args.steps.unwrap_or(d.steps),
            faults: if args.no_faults {
                Faults::none()
            } else {
                Faults::all()
            },
            default_faults: !args.no_faults,
            trace: args.trace,
            ..d
        }
    };
    let first = scenario(args.seed);
    if first.servers == 0 || first.clients == 0 || first.pages == 0 {
        anyhow::bail!("--servers, --clients and --pages must be at least 1");
    }
    let mut failed = 0u64;
    let mut total = Report::default();
    for seed in args.seed..args.seed.saturating_add(args.seeds) {
        match run(&scenario(seed)) {
            Ok(r) => {
                if args.seeds == 1 {
                    print_report(&format!("seed {seed}"), &r);
                }
                total.add(&r);
            }
            Err(f) => {
                failed += 1;
                eprintln!("FAILED {f}");
            }
        }
    }
    if args.seeds > 1 {
        println!(
            "{} seeds from {}: {} passed, {failed} failed",
            args.seeds,
            args.seed,
            args.seeds - failed
        );
        print_report("all seeds", &total);
    }
    if failed > 0 {
        anyhow::bail!("{failed} of {} seeds failed", args.seeds);
    }
    Ok(())
}

fn print_report(label: &str, r: &Report) {
    let f = &r.faults;
    println!(
        "{label}: {} steps, {:.1} s virtual: {} writes ({} without waiting), {} reads, {} discards, {} flushes; \
         {} reads by ticket left in flight ({} verified, {} failed where allowed; {} operations \
         of the same client begun meanwhile); {} pages verified, {} reads failed where the faults allowed it, {} servers reconnected; \
         {} disk writes failed, {} reported; {} replies pushed to idle clients ({} while another \
         client's operation waited), {} found by maintenance ticks ({} ticks)",
        r.steps,
        r.virtual_ms as f64 / 1000.0,
        r.writes,
        r.writes_without_waiting,
        r.reads,
        r.discards,
        r.flushes,
        r.tickets,
        r.tickets_verified,
        r.tickets_failed_allowed,
        r.ops_during_tickets,
        r.pages_verified,
        r.reads_failed_allowed,
        r.revived,
        r.disk_write_failures,
        r.disk_errors_reported,
        r.replies_pushed,
        r.replies_pushed_mid_operation,
        r.replies_polled,
        r.ticks
    );
    println!(
        "faults: {} crashes, {} partitions, {} lost messages, {} resets, {} duplicated replies, \
         {} bit flips, {} hostile replies, {} slow periods, {} offers moved ({} pages migrated, \
         {} of them to a disk, {} server to server), {} parity deltas applied but unanswered; membership declared \
         {} members down ({} of them still up; {} membership cuts; {} lies to clients), clients' \
         probes on its word found {} servers dead",
        f.crashes,
        f.partitions,
        f.losses,
        f.resets,
        f.duplicates,
        f.bit_flips,
        f.hostile,
        f.slowdowns,
        f.offer_moves,
        f.pages_migrated,
        f.pages_migrated_to_disk,
        f.pages_migrated_direct,
        f.unanswered,
        f.members_declared_down,
        f.members_declared_down_alive,
        f.gossip_cuts,
        f.membership_lies,
        f.members_failed_by_clients
    );
}
