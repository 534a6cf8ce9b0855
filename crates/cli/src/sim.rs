//! `netram sim`: the deterministic simulator from the command line, to replay a failing seed or
//! to run many.

use netram_policy::redundancy::Scheme;
use netram_sim::world::Faults;
use netram_sim::{run, Report, Scenario};

#[derive(Debug, clap::Args)]
pub struct SimArgs {
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

pub fn run_sim(args: SimArgs) -> anyhow::Result<()> {
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
