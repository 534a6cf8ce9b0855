//! The GMS paper's experiments as simulated runs (§5.5–5.6 and Table 5), and the same
//! algorithms at 100 to 10,000 nodes.
//!
//! **Skew** (Fig. 9–11): nine nodes. Node 0 runs the 007-like workload: random accesses over
//! twice its memory. The other eight hold the idle memory, X % of them (100 − X) % of it, and
//! each runs Fig. 10's synthetic program over the rest of its memory (half of its pages a data
//! set the eight share). The paper ran Fig. 9 (007's speed-up) and Fig. 10–11 (the others'
//! slowdown, the traffic) as separate experiments; here one run gives all three, with the
//! idle memory equal to, or twice, what 007 needs.
//!
//! **Scale**: n nodes with 256 frames each: 1 % run the 007-like workload, 40 % are idle, the
//! rest run the synthetic program. Gives each algorithm's hit ratio, and the epochs' cost per
//! node (Table 5's rows) as n grows.

use super::cluster::{run, Algorithm, Config, Costs, Outcome};
use super::workload::{NodeSpec, Pattern};
use netram_policy::gms::epoch::Params;

/// How big the skew runs are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SkewSize {
    /// Frames of every node.
    pub capacity: usize,
    /// 007's accesses.
    pub accesses: u64,
}

impl SkewSize {
    pub const FULL: Self = Self {
        capacity: 2048,
        accesses: 60_000,
    };
    pub const QUICK: Self = Self {
        capacity: 512,
        accesses: 12_000,
    };
}

/// The runs' settings: the paper's costs; the default epochs (the paper's T of 5 s, pages
/// used within the last second in use, at most 32 weights a plan: `Params`); every node's
/// epoch state ticked every 50 ms; N-chance displacing singlets a minute old.
fn config(seed: u64, algorithm: Algorithm, nodes: Vec<NodeSpec>) -> Config {
    Config {
        seed,
        algorithm,
        nodes,
        costs: Costs::paper(),
        params: Params::default(),
        tick_ms: 50,
        very_old_ms: 60_000,
        stop_us: None,
    }
}

/// 007's computation between accesses: with the paper's costs, all its misses served from
/// the cluster's memory would make it 3.3× as fast as with all of them from disk.
const THINK_007_US: u64 = 2_000;
/// The synthetic program's computation between accesses: it goes round its memory in well
/// under a second, so its pages stay in use.
const THINK_LOOP_US: u64 = 200;

/// Fig. 9–11's cluster: `skew_pct` % of the eight other nodes hold (100 − skew_pct) % of
/// `idle_factor` times the idle memory 007 needs. `with_007: false` gives the same cluster
/// with node 0 idle, for the synthetic programs' own speed.
pub fn skew_config(
    seed: u64,
    algorithm: Algorithm,
    size: SkewSize,
    skew_pct: f64,
    idle_factor: usize,
    with_007: bool,
) -> Config {
    let c = size.capacity;
    let others = 8usize;
    let needed = c; // 007 touches 2c pages with c frames
    let idle_total = needed * idle_factor;
    let rich = ((others as f64 * skew_pct / 100.0).round() as usize).clamp(1, others - 1);
    let rich_idle = (idle_total as f64 * (100.0 - skew_pct) / 100.0) as usize;
    let poor_idle = idle_total - rich_idle;
    let mut nodes = Vec::with_capacity(others + 1);
    nodes.push(if with_007 {
        NodeSpec {
            capacity: c,
            idle_pages: 0,
            pattern: Pattern::Uniform {
                pages: 2 * c as u64,
            },
            think_us: THINK_007_US,
            accesses: Some(size.accesses),
        }
    } else {
        NodeSpec::idle(c)
    });
    for k in 0..others {
        let idle = if k < rich {
            rich_idle / rich
        } else {
            poor_idle / (others - rich)
        }
        .min(c - 16);
        let pages = (c - idle) as u64;
        nodes.push(NodeSpec {
            capacity: c,
            idle_pages: idle,
            pattern: Pattern::Loop {
                pages,
                shared: pages / 2,
                group: 0,
            },
            think_us: THINK_LOOP_US,
            accesses: None,
        });
    }
    config(seed, algorithm, nodes)
}

/// One point of Fig. 9–11.
#[derive(Debug, Clone)]
pub struct SkewPoint {
    pub algorithm: Algorithm,
    pub skew_pct: f64,
    pub idle_factor: usize,
    /// Fig. 9: 007's time alone (no global memory) over its time with the algorithm.
    pub speedup: f64,
    /// Fig. 10: the synthetic programs' mean time per access with 007 running over without.
    pub slowdown: f64,
    /// Fig. 11: bytes on the network while 007 ran.
    pub traffic_bytes: u64,
    /// 007's accesses served from its memory, another node's, and the source.
    pub hit_local: f64,
    pub hit_remote: f64,
    pub source_reads: u64,
    pub outcome: Outcome,
}

fn per_access_us(o: &Outcome) -> f64 {
    let (busy, n) = o.nodes[1..]
        .iter()
        .fold((0u64, 0u64), |(b, n), s| (b + s.busy_us, n + s.accesses));
    busy as f64 / n.max(1) as f64
}

/// Runs one point: the algorithm with 007, 007 without global memory (for the speed-up),
/// and the cluster without 007 for as long (for the slowdown).
pub fn skew_point(
    seed: u64,
    algorithm: Algorithm,
    size: SkewSize,
    skew_pct: f64,
    idle_factor: usize,
) -> Result<SkewPoint, String> {
    let with = run(&skew_config(
        seed,
        algorithm,
        size,
        skew_pct,
        idle_factor,
        true,
    ))?;
    let alone = run(&skew_config(
        seed,
        Algorithm::None,
        size,
        skew_pct,
        idle_factor,
        true,
    ))?;
    let mut quiet_cfg = skew_config(seed, algorithm, size, skew_pct, idle_factor, false);
    quiet_cfg.stop_us = Some(with.end_us);
    let quiet = run(&quiet_cfg)?;
    let t = |o: &Outcome| o.nodes[0].finished_us.expect("007 finishes") as f64;
    let n0 = &with.nodes[0];
    let a = n0.accesses.max(1) as f64;
    Ok(SkewPoint {
        algorithm,
        skew_pct,
        idle_factor,
        speedup: t(&alone) / t(&with),
        slowdown: per_access_us(&with) / per_access_us(&quiet),
        traffic_bytes: with.traffic.bytes(),
        hit_local: n0.local_hits as f64 / a,
        hit_remote: n0.remote_hits as f64 / a,
        source_reads: n0.source_reads,
        outcome: with,
    })
}

/// The scale runs' cluster.
pub fn scale_config(seed: u64, algorithm: Algorithm, n: usize, accesses: u64) -> Config {
    let c = 256usize;
    let active = (n / 100).max(1);
    let idle = n * 2 / 5;
    let nodes = (0..n)
        .map(|i| {
            if i < active {
                NodeSpec {
                    capacity: c,
                    idle_pages: 0,
                    pattern: Pattern::Uniform {
                        pages: 2 * c as u64,
                    },
                    think_us: THINK_007_US,
                    accesses: Some(accesses),
                }
            } else if i < active + idle {
                NodeSpec::idle(c)
            } else {
                NodeSpec {
                    capacity: c,
                    idle_pages: c / 4,
                    pattern: Pattern::Loop {
                        pages: (c - c / 4) as u64,
                        shared: (c - c / 4) as u64 / 2,
                        // Eight nodes to a shared data set, as in Fig. 10.
                        group: i as u64 / 8,
                    },
                    // Slow enough that tens of thousands of them simulate in seconds, fast
                    // enough that their pages stay younger than the active age (192 pages in
                    // 0.96 s).
                    think_us: 5_000,
                    accesses: None,
                }
            }
        })
        .collect();
    config(seed, algorithm, nodes)
}
