//! The simulator's main test: many seeds of the default scenario (every fault enabled), and
//! fault-free runs whose checkers must then allow no loss at all. A failure prints the one
//! command that replays it.

use netram_sim::world::Faults;
use netram_sim::{run, Scenario};

/// Seeds the test suite runs; `NETRAM_SIM_SEEDS` overrides (the 10,000-seed run).
fn seeds() -> u64 {
    std::env::var("NETRAM_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000)
}

#[test]
fn default_scenario_holds_for_every_seed() {
    let n = seeds();
    let mut failures = Vec::new();
    let mut totals = netram_sim::Report::default();
    for seed in 0..n {
        match run(&Scenario::new(seed)) {
            Ok(r) => {
                totals.pages_verified += r.pages_verified;
                totals.reads_failed_allowed += r.reads_failed_allowed;
                totals.faults.crashes += r.faults.crashes;
                totals.faults.partitions += r.faults.partitions;
                totals.faults.bit_flips += r.faults.bit_flips;
                totals.faults.losses += r.faults.losses;
                totals.faults.resets += r.faults.resets;
                totals.faults.duplicates += r.faults.duplicates;
            }
            Err(f) => failures.push(f.to_string()),
        }
    }
    eprintln!("{n} seeds: {} failed; {totals:?}", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The faults really happened: a simulator that injects nothing proves nothing.
    assert!(
        totals.faults.crashes > 0 && totals.faults.partitions > 0 && totals.faults.bit_flips > 0
    );
    assert!(totals.pages_verified > 0);
}

#[test]
fn without_faults_nothing_is_lost() {
    for seed in 0..50 {
        let sc = Scenario {
            faults: Faults::none(),
            default_faults: false,
            ..Scenario::new(seed)
        };
        let r = run(&sc).unwrap_or_else(|f| panic!("{f}"));
        assert_eq!(r.reads_failed_allowed, 0, "seed {seed}");
    }
}
