//! The simulator's main test: many seeds of the default scenario (every fault enabled) for
//! each redundancy scheme, and runs whose faults stay within what the scheme tolerates, where
//! the checkers then allow no loss at all. A failure prints the one command that replays it.

use netram_policy::redundancy::Scheme;
use netram_sim::world::Faults;
use netram_sim::{run, Report, Scenario};

/// Seeds the test suite runs, the schemes taking turns; `NETRAM_SIM_SEEDS` overrides (the
/// issue's 10,000-seed run).
fn seeds() -> u64 {
    std::env::var("NETRAM_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000)
}

/// Seeds `first, first + step, ...` below `n`, with `scheme`.
fn many(scheme: &str, first: u64, step: u64) {
    let scheme: Scheme = scheme.parse().unwrap();
    let n = seeds();
    let mut failures = Vec::new();
    let mut t = Report::default();
    let mut runs = 0;
    for seed in (first..n).step_by(step as usize) {
        runs += 1;
        match run(&Scenario {
            scheme,
            ..Scenario::new(seed)
        }) {
            Ok(r) => t.add(&r),
            Err(f) => failures.push(f.to_string()),
        }
    }
    eprintln!("{scheme}: {runs} seeds, {} failed; {t:?}", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The faults really happened: a simulator that injects nothing proves nothing.
    let f = &t.faults;
    assert!(f.crashes > 0 && f.partitions > 0 && f.bit_flips > 0 && f.losses > 0);
    assert!(f.resets > 0 && f.duplicates > 0 && f.hostile > 0 && t.pages_verified > 0);
    assert!(
        t.disk_write_failures > 0 && t.disk_errors_reported > 0,
        "no local disk ever failed a write, or no failure was reported"
    );
    if scheme != Scheme::None && runs >= 100 {
        assert!(t.rebuilds_started > 0, "recovery never ran");
    }
    // Replies reached idle clients while another client's operation waited: the interleaving
    // the pushes are there for really happened.
    assert!(
        t.replies_pushed_mid_operation > 0 && t.replies_pushed > t.replies_pushed_mid_operation,
        "no reply was pushed while another client waited, or none between steps"
    );
    if matches!(scheme, Scheme::Parity { .. }) {
        assert!(f.unanswered > 0, "no holder ever applied a delta unheard");
    }
    // One client's reads by ticket were in flight while its other operations ran, and
    // finished checked.
    assert!(
        t.tickets_verified > 0 && t.ops_during_tickets > 0,
        "no read by ticket finished, or none was in flight across another operation"
    );
    assert!(
        t.writes_without_waiting > 0,
        "no write went the way the userfaultfd handler's evictions go"
    );
    assert!(
        t.writes_over_budget > 0,
        "no write went the way a forked child's pages are stored"
    );
    assert!(
        t.flushes_without_waiting > 0,
        "no flush finished the way the NBD device's FLUSH finishes"
    );
}

/// The default scenario's seeds, six schemes taking turns (1,000 seeds in all by default).
const SCHEMES: [&str; 6] = [
    "none", "mirror:2", "mirror:3", "rs:3+2", "rs:4+2", "parity:4",
];

#[test]
fn every_seed_holds_without_redundancy() {
    many(SCHEMES[0], 0, 6);
}

#[test]
fn every_seed_holds_with_two_copies() {
    many(SCHEMES[1], 1, 6);
}

#[test]
fn every_seed_holds_with_three_copies() {
    many(SCHEMES[2], 2, 6);
}

#[test]
fn every_seed_holds_with_reed_solomon_3_2() {
    many(SCHEMES[3], 3, 6);
}

#[test]
fn every_seed_holds_with_reed_solomon_4_2() {
    many(SCHEMES[4], 4, 6);
}

#[test]
fn every_seed_holds_with_dynamic_parity() {
    many(SCHEMES[5], 5, 6);
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

/// Crashes up to what the scheme tolerates, and nothing else: the checker allows no read to
/// fail, and the runs must really have crashed servers and rebuilt copies.
#[test]
fn redundancy_loses_nothing_to_crashes_it_tolerates() {
    for (scheme, crashes) in [
        ("mirror:2", 1),
        ("mirror:3", 2),
        ("rs:3+2", 2),
        ("rs:4+2", 2),
        ("parity:4", 1),
    ] {
        let mut rebuilt = 0;
        let mut crashed = 0;
        for seed in 0..100 {
            let sc = Scenario {
                scheme: scheme.parse().unwrap(),
                faults: Faults {
                    crashes,
                    ..Faults::none()
                },
                default_faults: false,
                ..Scenario::new(seed)
            };
            let r = run(&sc).unwrap_or_else(|f| panic!("{scheme}: {f}"));
            assert_eq!(r.reads_failed_allowed, 0, "{scheme} seed {seed}");
            rebuilt += r.rebuilds_started;
            crashed += r.faults.crashes;
        }
        assert!(
            crashed > 50 && rebuilt > 0,
            "{scheme}: {crashed} crashes, {rebuilt} rebuilt"
        );
    }
}

/// Seeds that found bugs, each run every time (the schedules move as the code changes, so
/// they may stop reaching the same interleaving; they are cheap, and they did once).
#[test]
fn seeds_that_found_bugs_hold() {
    for (scheme, seed) in [
        // A handed-over page adopted into the owner's old session (Store::adopt).
        ("mirror:3", 350),
        // A stripe whose members could not move hid the others on a shrinking server.
        ("rs:3+2", 3225),
        // A stripe left off recovery's list with its only live member unreadable kept a
        // piece above a shrunk offer for good.
        ("rs:2+1", 3457),
        // A read by ticket whose only copy went bad after its page was written into the
        // cache: reported lost, though the page's current contents were at hand.
        ("mirror:3", 3464),
        // Parity recovery protected again a page a scan had called an orphan just before
        // its write-back joined a new group, deleting the survivor that group counted on.
        ("parity:4", 4277),
        // The checker forgave a client its faults while a damaged reply had left one of its
        // connections to fail at the next read (found once probes stopped reading every
        // connection at each tick); and answered requests were not dropped from the sending
        // order when a dead server's requests failed over.
        ("mirror:3", 4064),
        ("rs:3+2", 2601),
        // Once evictions stopped waiting (`Pager::try_write`): a caller's read failed over
        // while its reads were copied out, left with nothing in flight; a move's read of a
        // page written meanwhile blamed the piece of the page's new version.
        ("mirror:3", 8570),
        ("rs:3+2", 2409),
        // Once parity recovery stopped waiting: survivors rewritten between the scan and
        // their reads; an overwrite kept in place by a holder this pager had given up
        // hiding a scan's orphan report; a new group's shipping hiding the orphan report of
        // a scan its server answered after; a round ending with nothing in flight leaving a
        // degraded read by ticket waiting.
        ("parity:4", 5981),
        ("parity:4", 4967),
        ("parity:4", 4733),
        ("parity:4", 3449),
        // A Join the server had no room to tag, answered Unprotected: the page stayed a
        // member of the group it could not join, which then waited for it forever.
        ("parity:4", 28841),
        // A leaving parity holder's scan answered without waiting: an earlier try took an
        // answer many steps old as proof that the holder kept nothing of ours above its
        // offer, which had shrunk meanwhile (a group's parity stayed above it); another
        // left the answer untaken when the count came back to its stuck value.
        ("parity:4", 3371),
        ("parity:4", 5087),
        ("parity:4", 1823),
        // Once the client sent what taking finished reads queued (as the front ends do): a
        // move's read, into the slot a failed survivor read of the same page had given
        // back, was taken for that survivor's by recovery; the move waited forever.
        ("parity:4", 395),
        // An earlier try at a Reed-Solomon rebuild that does not wait for the pieces it asks
        // after a read failed left a stripe short of pieces (`rs_top_up` now).
        ("rs:4+2", 2110),
    ] {
        let sc = Scenario {
            scheme: scheme.parse().unwrap(),
            ..Scenario::new(seed)
        };
        run(&sc).unwrap_or_else(|f| panic!("{scheme} seed {seed}: {f}"));
    }
}
