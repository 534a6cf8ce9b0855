//! The donor controller on synthetic traces, on a trace recorded on a real machine, and on
//! random ones (its invariants).

use super::*;
use proptest::prelude::*;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn cfg() -> DonorConfig {
    DonorConfig {
        floor: 0,
        ceiling: 8 * GIB,
        chunk: 256 * MIB,
        reserve: 2 * GIB,
        shrink_pressure: 10.0,
        grow_pressure: 1.0,
        grow_after_ms: 5_000,
    }
}

fn at(now_ms: u64, mem_available: u64, used: u64) -> Sample {
    Sample {
        now_ms,
        mem_available,
        pressure: 0.0,
        used,
    }
}

#[test]
fn an_idle_machine_offers_up_to_the_ceiling_one_chunk_at_a_time() {
    let mut d = Donor::new(cfg()).unwrap();
    let mut changes = Vec::new();
    // 20 GiB free for four minutes, sampled every 100 ms; nobody stores anything.
    for t in (0..240_000).step_by(100) {
        if let Some(c) = d.sample(at(t, 20 * GIB, 0)) {
            changes.push((t, c));
        }
    }
    assert_eq!(d.offered(), 8 * GIB, "the ceiling");
    assert_eq!(changes.len(), 32, "one chunk at a time");
    for w in changes.windows(2) {
        assert_eq!(w[1].1.to - w[0].1.to, 256 * MIB);
        assert!(w[1].0 - w[0].0 >= 5_000, "a chunk per hold period");
    }
    assert!(changes.iter().all(|(_, c)| c.reason == Reason::Room));
}

#[test]
fn the_offer_counts_its_unused_part_as_promised() {
    // 4 GiB free, a 2 GiB reserve: the offer grows while two chunks remain beyond the reserve
    // with the whole offer filled (so one remains after the growth): to 1.75 GiB, however
    // long it waits.
    let mut d = Donor::new(cfg()).unwrap();
    for t in (0..300_000).step_by(1000) {
        d.sample(at(t, 4 * GIB, 0));
    }
    assert_eq!(d.offered(), 1792 * MIB);
}

#[test]
fn a_program_that_needs_the_memory_gets_it_at_once() {
    let mut d = Donor::new(cfg()).unwrap();
    for t in (0..200_000).step_by(1000) {
        d.sample(at(t, 20 * GIB, 4 * GIB));
    }
    assert_eq!(d.offered(), 8 * GIB);
    // A program takes 15 GiB in one second: MemAvailable 20 -> 5 GiB. With the offer full
    // the machine would have 5 - 4 = 1 GiB: 1 GiB short of the reserve, four chunks back.
    let c = d.sample(at(200_500, 5 * GIB, 4 * GIB)).expect("a shrink");
    assert_eq!(c.reason, Reason::Reserve);
    assert_eq!(c.to, 7 * GIB);
    // The next samples see what the shrink left: nothing more to give.
    assert_eq!(d.sample(at(200_600, 5 * GIB, 4 * GIB)), None);
    assert_eq!(d.sample(at(200_700, 6 * GIB, 3 * GIB)), None);
    // The program keeps growing: the offer follows, down to the floor and no further.
    let mut t = 201_000;
    for avail in (0..5).rev() {
        d.sample(at(t, avail * GIB, 0));
        t += 100;
    }
    assert_eq!(d.offered(), 0);
    assert_eq!(d.sample(at(t, 0, 0)), None, "nothing left to give");
}

#[test]
fn use_hovering_around_the_line_does_not_flap_the_offer() {
    let mut d = Donor::new(cfg()).unwrap();
    for t in (0..60_000).step_by(1000) {
        d.sample(at(t, 20 * GIB, 0));
    }
    let start = d.offered();
    // A program's use swings by 600 MiB every half second, with the machine just above its
    // reserve once the offer is full: at most one shrink, then nothing for ten minutes.
    let base = start + 2 * GIB + 200 * MIB;
    let mut changes = 0;
    for (i, t) in (60_000..660_000).step_by(500).enumerate() {
        let avail = if i % 2 == 0 { base } else { base - 600 * MIB };
        changes += usize::from(d.sample(at(t, avail, 0)).is_some());
    }
    assert!(changes <= 1, "{changes} changes of the offer");
}

#[test]
fn memory_pressure_shrinks_even_with_memory_available() {
    let mut d = Donor::new(cfg()).unwrap();
    for t in (0..60_000).step_by(1000) {
        d.sample(at(t, 20 * GIB, 0));
    }
    let before = d.offered();
    let c = d
        .sample(Sample {
            pressure: 25.0,
            ..at(60_000, 20 * GIB, 0)
        })
        .expect("a shrink");
    assert_eq!((c.to, c.reason), (before - 256 * MIB, Reason::Pressure));
    // Once the stall is over it grows back, but not before the hold period.
    assert_eq!(d.sample(at(61_000, 20 * GIB, 0)), None);
    assert_eq!(d.sample(at(64_000, 20 * GIB, 0)), None);
    assert_eq!(
        d.sample(at(66_000, 20 * GIB, 0)).map(|c| c.to),
        Some(before)
    );
}

#[test]
fn a_floor_and_a_ceiling_are_kept() {
    let c = DonorConfig {
        floor: GIB + 100 * MIB,
        ceiling: 2 * GIB + 100 * MIB,
        ..cfg()
    };
    let mut d = Donor::new(c).unwrap();
    assert_eq!(d.offered(), GIB, "the floor, in whole chunks");
    for t in (0..100_000).step_by(1000) {
        d.sample(at(t, 30 * GIB, 0));
    }
    assert_eq!(d.offered(), 2 * GIB);
    d.sample(at(100_000, 0, 0));
    assert_eq!(
        d.offered(),
        GIB,
        "never under the floor, whatever the machine needs"
    );
    assert!(Donor::new(DonorConfig {
        floor: 3 * GIB,
        ..c
    })
    .is_err());
    assert!(Donor::new(DonorConfig { chunk: 0, ..c }).is_err());
}

#[test]
fn proc_files_are_read() {
    let meminfo = "MemTotal:       24684084 kB\nMemFree:        23000000 kB\nMemAvailable:   24230332 kB\nBuffers: 1 kB\n";
    assert_eq!(
        parse_meminfo(meminfo),
        Some((24684084 * 1024, 24230332 * 1024))
    );
    assert_eq!(parse_meminfo("MemTotal: 5 kB\n"), None);
    assert_eq!(parse_meminfo("garbage"), None);
    let psi = "some avg10=12.50 avg60=0.00 avg300=0.87 total=1268865031\nfull avg10=3.00 avg60=0.00 avg300=0.77 total=1127032443\n";
    assert_eq!(parse_psi(psi), Some(12.5));
    assert_eq!(parse_psi("full avg10=1.00\n"), None);
}

/// A trace recorded on this project's test VM (2 vCPU, 24 GiB): MemAvailable and PSI every
/// 100 ms while a program allocated and touched 18 GiB in steps, held it, and exited
/// (`donor_trace.csv`: milliseconds, MemAvailable in kB, PSI some avg10). The daemon's own
/// store is empty, so the offer must follow the machine: it shrinks before the program has
/// taken what would leave the machine under its reserve, and grows back once it exits.
#[test]
fn a_recorded_trace_is_followed() {
    let trace: Vec<(u64, u64, f32)> = include_str!("donor_trace.csv")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (
                f[0].parse().unwrap(),
                f[1].parse::<u64>().unwrap() * 1024,
                f[2].parse().unwrap(),
            )
        })
        .collect();
    assert!(trace.len() > 100, "the trace is there");
    let total = 24 * GIB;
    let c = DonorConfig {
        chunk: 64 * MIB,
        grow_after_ms: 1_000,
        ..DonorConfig::for_machine(total)
    };
    let mut d = Donor::new(c).unwrap();
    // The program's exit: MemAvailable 8 GiB above its lowest, after it.
    let lowest = trace.iter().map(|s| s.1).min().unwrap();
    let low_at = trace.iter().position(|s| s.1 == lowest).unwrap();
    let exit = trace[low_at..]
        .iter()
        .find(|s| s.1 > lowest + 8 * GIB)
        .map(|s| s.0)
        .expect("the program's exit is in the trace");
    let mut shrank_for_the_program = false;
    let mut at_exit = 0;
    for &(t, avail, psi) in &trace {
        if std::env::var_os("NETRAM_TRACE").is_some() {
            eprintln!("{t} {} {}", avail >> 20, d.offered() >> 20);
        }
        if t == exit {
            at_exit = d.offered();
        }
        let change = d.sample(Sample {
            now_ms: t,
            mem_available: avail,
            pressure: psi,
            used: 0,
        });
        shrank_for_the_program |= change.is_some_and(|c| c.reason == Reason::Reserve);
        // With nothing stored, the offer never promises what would leave the machine under
        // its reserve (after this sample's change).
        assert!(
            avail.saturating_sub(d.offered()) >= c.reserve || d.offered() == 0,
            "at {t} ms: {} offered with {avail} available",
            d.offered()
        );
    }
    assert!(
        at_exit > 0,
        "it offered memory before and during the program"
    );
    assert!(
        shrank_for_the_program,
        "it gave memory back as the program took it"
    );
    assert!(
        d.offered() >= at_exit + 16 * c.chunk,
        "it grew back after the program exited ({} MiB, {} MiB at the exit)",
        d.offered() >> 20,
        at_exit >> 20
    );
}

proptest! {
    /// Whatever the machine does: the offer stays within floor and ceiling in whole chunks,
    /// grows by one chunk at most per hold period, and never grows while the machine is short.
    #[test]
    fn the_offer_keeps_its_bounds(
        steps in prop::collection::vec((0u64..2000, 0u64..40, 0u8..30, 0u64..20), 1..400),
        floor in 0u64..8, ceiling in 8u64..32,
    ) {
        let c = DonorConfig {
            floor: floor * 256 * MIB,
            ceiling: ceiling * 256 * MIB,
            ..cfg()
        };
        let mut d = Donor::new(c).unwrap();
        let mut t = 0;
        let mut last_growth: Option<u64> = None;
        for (dt, avail, psi, used) in steps {
            t += dt;
            let before = d.offered();
            let used = (used * 256 * MIB).min(before + 512 * MIB);
            let s = Sample { now_ms: t, mem_available: avail * 512 * MIB, pressure: f32::from(psi), used };
            let change = d.sample(s);
            let now = d.offered();
            prop_assert_eq!(now % c.chunk, 0);
            prop_assert!(now >= c.round(c.floor) && now <= c.round(c.ceiling));
            prop_assert_eq!(change.map(|c| c.to), (now != before).then_some(now));
            if now > before {
                prop_assert_eq!(now - before, c.chunk);
                prop_assert!(s.pressure <= c.grow_pressure);
                if let Some(g) = last_growth {
                    prop_assert!(t - g >= c.grow_after_ms);
                }
                last_growth = Some(t);
            }
        }
    }
}
