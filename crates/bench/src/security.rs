//! `netram bench security`: what authentication and encryption cost, measured side by side in
//! one run. Three ways, alternating round by round so that all see the same machine state:
//!
//! * **plain**: clear TCP (`--insecure`), pages in clear with their crc32c — netram before
//!   "Trust nobody on the wire";
//! * **sealed pages**: clear TCP, pages sealed end to end (AES-128-GCM on the client) — what
//!   the page seal alone costs;
//! * **secure**: mutual TLS, every frame sealed (`netram_net::record`), pages sealed — the
//!   default of every front end.
//!
//! For each: depth-1 GET and PUT p50/p99 in both wake-up modes, depth-32 GET throughput (one
//! server, the pager's window), and CPU per GET (client and server together: the cluster runs
//! in this process). Writes `security.json` and `security.md`.

use crate::core::{netram_depth1, netram_depth32, Wire};
use crate::machine::Machine;
use crate::raw::Wait;
use crate::{target, Summary, Target};
use netram_client::latency::PmQos;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Options {
    pub quick: bool,
    pub out: PathBuf,
}

/// One way's figures: the median of its rounds.
#[derive(Debug, Serialize, Clone, Copy, Default)]
pub struct Way {
    pub get_p50_us: f64,
    pub get_p99_us: f64,
    pub put_p50_us: f64,
    pub put_p99_us: f64,
    pub get_fast_p50_us: f64,
    pub get_fast_p99_us: f64,
    pub put_fast_p50_us: f64,
    pub put_fast_p99_us: f64,
    pub get_depth32_ops_per_s: f64,
    pub cpu_us_per_get: f64,
    pub cpu_us_per_get_fast: f64,
}

#[derive(Debug, Serialize)]
pub struct SecurityResult {
    pub machine: Machine,
    pub quick: bool,
    pub rounds: usize,
    pub pm_qos_held: bool,
    pub get_fast_p50_plain_us: f64,
    pub get_fast_p50_secure_us: f64,
    pub get_depth32_plain_ops_per_s: f64,
    pub get_depth32_secure_ops_per_s: f64,
    pub plain: Way,
    pub sealed_pages: Way,
    pub secure: Way,
    pub targets: Vec<Target>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The per-field median of several rounds of one way.
fn median_way(rounds: &[Way]) -> Way {
    let m = |f: fn(&Way) -> f64| median(rounds.iter().map(f).collect());
    Way {
        get_p50_us: m(|w| w.get_p50_us),
        get_p99_us: m(|w| w.get_p99_us),
        put_p50_us: m(|w| w.put_p50_us),
        put_p99_us: m(|w| w.put_p99_us),
        get_fast_p50_us: m(|w| w.get_fast_p50_us),
        get_fast_p99_us: m(|w| w.get_fast_p99_us),
        put_fast_p50_us: m(|w| w.put_fast_p50_us),
        put_fast_p99_us: m(|w| w.put_fast_p99_us),
        get_depth32_ops_per_s: m(|w| w.get_depth32_ops_per_s),
        cpu_us_per_get: m(|w| w.cpu_us_per_get),
        cpu_us_per_get_fast: m(|w| w.cpu_us_per_get_fast),
    }
}

fn one_round(wire: Wire, pages: u64, iters: usize, dur: Duration) -> anyhow::Result<Way> {
    let plain = netram_depth1(1, false, Wait::Block, pages, iters, wire)?;
    let qos = PmQos::hold();
    let fast = netram_depth1(1, true, Wait::Poll, pages, iters, wire)?;
    drop(qos);
    let d32 = netram_depth32(1, pages, dur, wire)?;
    let s = |x: &Summary| (x.p50_us, x.p99_us);
    let ((g50, g99), (p50, p99)) = (s(&plain.get), s(&plain.put));
    let ((fg50, fg99), (fp50, fp99)) = (s(&fast.get), s(&fast.put));
    Ok(Way {
        get_p50_us: g50,
        get_p99_us: g99,
        put_p50_us: p50,
        put_p99_us: p99,
        get_fast_p50_us: fg50,
        get_fast_p99_us: fg99,
        put_fast_p50_us: fp50,
        put_fast_p99_us: fp99,
        get_depth32_ops_per_s: d32,
        cpu_us_per_get: plain.cpu_us_per_get,
        cpu_us_per_get_fast: fast.cpu_us_per_get,
    })
}

pub fn run(opts: &Options) -> anyhow::Result<String> {
    let (rounds, iters, pages, dur) = if opts.quick {
        (3, 3_000, 2_048, Duration::from_millis(1500))
    } else {
        (5, 20_000, 8_192, Duration::from_secs(4))
    };
    let machine = Machine::describe();
    eprintln!("bench security on {}", machine.one_line());
    let pm_qos_held = PmQos::hold().is_some();
    let ways = [Wire::Plain, Wire::SealedPages, Wire::Secure];
    let mut got: [Vec<Way>; 3] = Default::default();
    for r in 0..rounds {
        // The order turns each round, so that no way always runs first (or last).
        for k in 0..ways.len() {
            let i = (k + r) % ways.len();
            eprintln!("round {}/{rounds}: {:?} ...", r + 1, ways[i]);
            got[i].push(one_round(ways[i], pages, iters, dur)?);
        }
    }
    let [plain, sealed_pages, secure] = got.map(|w| median_way(&w));
    let targets = vec![
        target(
            "get_fast_p50_secure_us / get_fast_p50_plain_us",
            secure.get_fast_p50_us / plain.get_fast_p50_us,
            1.10,
            "le",
        ),
        target(
            "get_depth32_secure_ops_per_s / get_depth32_plain_ops_per_s",
            secure.get_depth32_ops_per_s / plain.get_depth32_ops_per_s,
            0.85,
            "ge",
        ),
    ];
    let r = SecurityResult {
        machine,
        quick: opts.quick,
        rounds,
        pm_qos_held,
        get_fast_p50_plain_us: plain.get_fast_p50_us,
        get_fast_p50_secure_us: secure.get_fast_p50_us,
        get_depth32_plain_ops_per_s: plain.get_depth32_ops_per_s,
        get_depth32_secure_ops_per_s: secure.get_depth32_ops_per_s,
        plain,
        sealed_pages,
        secure,
        targets,
    };
    crate::write_json(&opts.out, "security.json", &r)?;
    let md = markdown(&r);
    std::fs::write(opts.out.join("security.md"), &md)?;
    Ok(md)
}

/// A row of the report: its name and the field it shows.
type Row = (&'static str, fn(&Way) -> f64);

fn markdown(r: &SecurityResult) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# netram bench security\n");
    let _ = writeln!(
        s,
        "Machine: {}{} · median of {} rounds, the three ways alternating{}\n",
        r.machine.one_line(),
        if r.quick { " · --quick" } else { "" },
        r.rounds,
        if r.pm_qos_held {
            ""
        } else {
            " · no PM QoS (not root): the low-latency mode only polls"
        }
    );
    let _ = writeln!(
        s,
        "| measure | plain | sealed pages | secure (TLS + sealed frames + sealed pages) | secure / plain |\n|---|---|---|---|---|"
    );
    let rows: [Row; 11] = [
        ("GET p50 µs, low-latency mode", |w| w.get_fast_p50_us),
        ("GET p99 µs, low-latency mode", |w| w.get_fast_p99_us),
        ("PUT p50 µs, low-latency mode", |w| w.put_fast_p50_us),
        ("PUT p99 µs, low-latency mode", |w| w.put_fast_p99_us),
        ("GET p50 µs, default mode", |w| w.get_p50_us),
        ("GET p99 µs, default mode", |w| w.get_p99_us),
        ("PUT p50 µs, default mode", |w| w.put_p50_us),
        ("PUT p99 µs, default mode", |w| w.put_p99_us),
        ("GET depth 32, one server, ops/s", |w| {
            w.get_depth32_ops_per_s
        }),
        ("CPU µs per GET, default mode", |w| w.cpu_us_per_get),
        ("CPU µs per GET, low-latency mode", |w| {
            w.cpu_us_per_get_fast
        }),
    ];
    for (name, f) in rows {
        let _ = writeln!(
            s,
            "| {name} | {:.1} | {:.1} | {:.1} | {:.2} |",
            f(&r.plain),
            f(&r.sealed_pages),
            f(&r.secure),
            f(&r.secure) / f(&r.plain)
        );
    }
    let _ = writeln!(s, "\n| target | ratio | limit | met |\n|---|---|---|---|");
    s + &crate::target_rows(&r.targets)
}
