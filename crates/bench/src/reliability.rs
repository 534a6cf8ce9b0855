//! `netram bench reliability`: what each redundancy scheme costs and how fast a cluster heals
//! (Nswap §V, Tables III and IV; Markatos §3), measured side by side in one run against the
//! same `netram serve` processes on loopback.
//!
//! For each scheme: GET and PUT latency at depth 1 (no cache: every PUT is stored before it
//! returns, which under Reed-Solomon seals a one-page stripe), GET throughput at depth 32, the
//! cluster memory per stored page (the servers' own count after a batched fill), the recovery
//! rate after a SIGKILL (flat out), and the slowdown of the program's own reads while the
//! background recovery runs at its default pace. Writes `reliability.json` and
//! `reliability.md`.

use crate::machine::Machine;
use crate::process::ChildGuard;
use crate::{page_content, target, Summary, Target};
use netram_client::maintain::{self, MaintainConfig};
use netram_client::open::{open_pager, ClientPager, OpenOptions};
use netram_client::query_stats;
use netram_pager::{Backing, Scheme};
use netram_proto::PAGE_SIZE;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Options {
    pub quick: bool,
    pub out: PathBuf,
    pub netram_exe: PathBuf,
}

/// Seven servers: `rs:4+2` spans six, and one more lets it become whole again after a death.
const SERVERS: usize = 7;
const SCHEMES: [(&str, &str); 4] = [
    ("none", "none"),
    ("mirror2", "mirror:2"),
    ("parity4", "parity:4"),
    ("rs4_2", "rs:4+2"),
];

#[derive(Debug, Default, Serialize)]
pub struct SchemeResult {
    pub scheme: String,
    pub get_p50_us: Option<f64>,
    pub get_p99_us: Option<f64>,
    pub put_p50_us: Option<f64>,
    pub put_p99_us: Option<f64>,
    pub get_depth32_ops_per_s: Option<f64>,
    /// Server memory (frames) per stored 4 KiB page, after a batched fill.
    pub bytes_per_page: Option<f64>,
    /// Pages (Reed-Solomon: pieces) rebuilt per second after a SIGKILL, recovery flat out.
    pub recovery_pages_per_s: Option<f64>,
    /// 1 − (reads per second while the background recovery runs at its default pace) /
    /// (reads per second while it is held), in alternating phases after a kill, for a program
    /// reading pages whose data survived (Nswap Table III: recovery's own cost).
    pub recovery_slowdown: Option<f64>,
    /// 1 − (reads per second while the recovery runs) / (reads per second before the kill),
    /// for a program reading any page: lost ones are read degraded until rebuilt. Phases
    /// apart in time, so machine noise (about ±0.1 here) is in it.
    pub recovery_slowdown_any_page: Option<f64>,
    /// How long the background recovery ran at its default pace, while the program read
    /// (the phases it was held are not counted).
    pub background_recovery_s: Option<f64>,
    /// What the flat-out recovery did: pages (pieces) it started to write out again (under
    /// parity also pages whose group was lost with its holder, protected again), those rebuilt
    /// onto live servers, pages it had to put on the local disk instead, and servers the pager
    /// counted dead by its end (1: only the one killed). Where these disagree beyond what the
    /// scheme explains, the rate above needs a second look.
    pub recovery_started: Option<u64>,
    pub pages_rebuilt: Option<u64>,
    pub recovery_spills: Option<u64>,
    pub recovery_servers_dead: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct ReliabilityResult {
    pub machine: Machine,
    pub quick: bool,
    pub servers: usize,
    pub pages: u64,
    pub schemes: BTreeMap<&'static str, SchemeResult>,
    /// `rs:4+2`'s, the scheme the targets name.
    pub recovery_pages_per_s: Option<f64>,
    pub recovery_slowdown: Option<f64>,
    pub recovery_slowdown_any_page: Option<f64>,
    pub targets: Vec<Target>,
}

struct Cluster {
    exe: PathBuf,
    servers: Vec<ChildGuard>,
    addrs: Vec<String>,
    capacity: String,
}

impl Cluster {
    fn start(exe: &Path, capacity: &str) -> anyhow::Result<Self> {
        let mut c = Cluster {
            exe: exe.to_path_buf(),
            servers: Vec::new(),
            addrs: Vec::new(),
            capacity: capacity.to_string(),
        };
        for _ in 0..SERVERS {
            let (s, addr) = c.spawn("127.0.0.1:0")?;
            c.servers.push(s);
            c.addrs.push(addr);
        }
        Ok(c)
    }

    fn spawn(&self, listen: &str) -> anyhow::Result<(ChildGuard, String)> {
        ChildGuard::netram(
            &self.exe,
            // No control socket: these daemons are killed, and would leave theirs behind.
            &[
                "serve",
                "--listen",
                listen,
                "--capacity",
                &self.capacity,
                "--control",
                "off",
            ],
            "netram serve: listening on ",
        )
    }

    fn kill(&mut self, i: usize) {
        let _ = self.servers[i].0.kill();
        let _ = self.servers[i].0.wait();
    }

    fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        let (s, _) = self.spawn(&self.addrs[i].clone())?;
        self.servers[i] = s;
        Ok(())
    }

    fn stored_pages(&self) -> anyhow::Result<u64> {
        let mut n = 0;
        for a in &self.addrs {
            let stats = query_stats(a, Duration::from_secs(5), &crate::security()?)?;
            n += stats
                .iter()
                .find(|(k, _)| k == "stored_pages")
                .map_or(0, |(_, v)| *v);
        }
        Ok(n)
    }
}

fn lock(p: &Mutex<ClientPager>) -> std::sync::MutexGuard<'_, ClientPager> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// `n` depth-1 GETs of pages drawn from `from`, verified; returns the latencies.
fn gets(
    p: &mut ClientPager,
    from: &[u64],
    n: usize,
    rng: &mut fastrand::Rng,
) -> anyhow::Result<Vec<u64>> {
    let (mut buf, mut want) = (vec![0u8; PAGE_SIZE], vec![0u8; PAGE_SIZE]);
    let mut ns = Vec::with_capacity(n);
    for _ in 0..n {
        let pg = from[rng.usize(0..from.len())];
        let t = Instant::now();
        p.read(pg, &mut buf)?;
        ns.push(t.elapsed().as_nanos() as u64);
        page_content(3, pg, &mut want);
        anyhow::ensure!(buf == want, "page {pg} read back wrong");
    }
    Ok(ns)
}

/// A program's reads over one period, for two workloads run in alternating blocks of 16 (so
/// that both see the same moments of recovery): `survivors`, pages whose data is not on the
/// server about to die (Nswap Table III: recovery's own cost to a program that does not
/// touch what was lost), and `any`, every page (lost ones read degraded until rebuilt).
/// Returns (time, reads) of each. The time includes waiting for the pager's lock, which
/// recovery takes in steps.
fn read_blocks(
    pager: &Mutex<ClientPager>,
    survivors: &[u64],
    any: &[u64],
    until: &dyn Fn() -> bool,
) -> anyhow::Result<[(Duration, u64); 2]> {
    let mut rng = fastrand::Rng::new();
    let mut out = [(Duration::ZERO, 0u64); 2];
    while !until() {
        for (i, from) in [survivors, any].into_iter().enumerate() {
            let t = Instant::now();
            gets(&mut lock(pager), from, 16, &mut rng)?;
            out[i].0 += t.elapsed();
            out[i].1 += 16;
        }
    }
    Ok(out)
}

fn rate((time, n): (Duration, u64)) -> f64 {
    n as f64 / time.as_secs_f64().max(1e-9)
}

/// Phases of the background recovery running and held, alternating while a program reads.
const PHASE: Duration = Duration::from_millis(250);

/// Rounds of alternating blocks, one per scheme: every scheme's figures see the same machine
/// state (on these VMs, depth-1 latency moves by half from one minute to the next).
const ROUNDS: usize = 10;

/// A pager of `scheme` on the cluster, with pages `0..pages` written in batches (whole
/// stripes) and flushed; depth-1 PUTs go above them. Returns it with the servers' frames it
/// took.
fn filled(
    cluster: &Cluster,
    scheme: Scheme,
    pages: u64,
    extra: u64,
    spill: &Path,
) -> anyhow::Result<(ClientPager, u64)> {
    let before = cluster.stored_pages()?;
    let mut p = open_pager(&OpenOptions {
        security: crate::security()?,
        servers: cluster.addrs.clone(),
        backing: Backing::Cluster,
        pages: pages + extra,
        cache_pages: 0,
        spill_dir: Some(spill.to_path_buf()),
        low_latency: false,
        redundancy: scheme,
    })?;
    let mut buf = vec![0u8; 64 * PAGE_SIZE];
    for start in (0..pages).step_by(64) {
        let batch: Vec<u64> = (start..(start + 64).min(pages)).collect();
        for (i, &pg) in batch.iter().enumerate() {
            page_content(3, pg, &mut buf[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
        }
        p.write_many(&batch, &buf[..batch.len() * PAGE_SIZE])?;
    }
    p.flush()?;
    let frames = cluster.stored_pages()?.saturating_sub(before);
    Ok((p, frames))
}

/// Latency, throughput and memory of every scheme, side by side: all pagers open on the same
/// servers, blocks of each measurement alternating between them.
fn side_by_side(
    cluster: &Cluster,
    schemes: &[Scheme],
    pages: u64,
    iters: usize,
    dur: Duration,
    spill: &Path,
) -> anyhow::Result<Vec<SchemeResult>> {
    let mut pagers = Vec::new();
    let mut results = Vec::new();
    for &scheme in schemes {
        eprintln!("{scheme}: filling {pages} pages ...");
        let (p, frames) = filled(cluster, scheme, pages, iters as u64, spill)?;
        pagers.push(p);
        results.push(SchemeResult {
            scheme: scheme.to_string(),
            bytes_per_page: Some(frames as f64 * PAGE_SIZE as f64 / pages as f64),
            ..Default::default()
        });
    }
    eprintln!("GET and PUT at depth 1, GET at depth 32, schemes alternating ...");
    let n = schemes.len();
    let (mut get_ns, mut put_ns) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    let (mut d32_pages, mut d32_time) = (vec![0u64; n], vec![Duration::ZERO; n]);
    let mut rng = fastrand::Rng::with_seed(11);
    let all: Vec<u64> = (0..pages).collect();
    let mut buf = vec![0u8; 32 * PAGE_SIZE];
    let mut page = vec![0u8; PAGE_SIZE];
    for round in 0..ROUNDS {
        for (i, p) in pagers.iter_mut().enumerate() {
            get_ns[i].extend(gets(p, &all, iters / ROUNDS, &mut rng)?);
            let t = Instant::now();
            while t.elapsed() < dur / ROUNDS as u32 {
                let batch: Vec<u64> = (0..32).map(|_| rng.u64(0..pages)).collect();
                p.read_many(&batch, &mut buf)?;
                d32_pages[i] += 32;
            }
            d32_time[i] += t.elapsed();
            for j in 0..(iters / ROUNDS) as u64 {
                let pg = pages + round as u64 * (iters / ROUNDS) as u64 + j;
                page_content(4, pg, &mut page);
                let t = Instant::now();
                p.write(pg, &page)?;
                put_ns[i].push(t.elapsed().as_nanos() as u64);
            }
        }
    }
    for (i, r) in results.iter_mut().enumerate() {
        let get = Summary::of_ns(&mut get_ns[i]);
        let put = Summary::of_ns(&mut put_ns[i]);
        r.get_p50_us = Some(get.p50_us);
        r.get_p99_us = Some(get.p99_us);
        r.put_p50_us = Some(put.p50_us);
        r.put_p99_us = Some(put.p99_us);
        r.get_depth32_ops_per_s = Some(d32_pages[i] as f64 / d32_time[i].as_secs_f64());
    }
    for p in pagers {
        p.into_transport().close();
    }
    Ok(results)
}

/// The recovery rate after a SIGKILL (flat out), and the slowdown of the program's reads
/// while the background recovery runs at its default pace after a second one; on a pager of
/// its own, so that no other scheme's losses mix in.
fn recovery(
    cluster: &mut Cluster,
    scheme: Scheme,
    pages: u64,
    // How long the program reads after each kill, and at most while recovery runs in the
    // background (see `run`).
    (dur, background_for): (Duration, Duration),
    victim: usize,
    spill: &Path,
    r: &mut SchemeResult,
) -> anyhow::Result<()> {
    let (p, _) = filled(cluster, scheme, pages, 0, spill)?;
    let pager = Arc::new(Mutex::new(p));

    // A SIGKILL: recovery flat out, timed from the death's discovery to the end.
    cluster.kill(victim);
    let c0 = lock(&pager).counters().clone();
    lock(&pager).probe_servers()?;
    let t = Instant::now();
    let mut started = 0;
    loop {
        let mut p = lock(&pager);
        let step = p.recover(256)?;
        started += step.started as u64;
        if step.remaining == 0 {
            p.flush()?;
            if p.degraded_pages() == 0 {
                break;
            }
        }
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(120),
            "recovery did not finish"
        );
    }
    let secs = t.elapsed().as_secs_f64();
    let c = lock(&pager).counters().clone();
    let rebuilt = c.pages_rebuilt - c0.pages_rebuilt;
    r.recovery_pages_per_s = Some(rebuilt as f64 / secs);
    r.recovery_started = Some(started);
    r.pages_rebuilt = Some(rebuilt);
    r.recovery_spills = Some(c.spills - c0.spills);
    r.recovery_servers_dead = Some(c.servers_dead - c0.servers_dead);

    // Again, with the background recovery at its default pace while the program reads: the
    // server comes back empty, the pager reconnects it, the program reads for `dur` ... and
    // a second server dies.
    cluster.restart(victim)?;
    let second = (victim + 1) % SERVERS;
    let maintenance = {
        let pager = pager.clone();
        maintain::spawn(
            move |f| f(&mut lock(&pager)),
            MaintainConfig {
                probe_every: Duration::from_millis(100),
                reconnect_every: Duration::from_millis(100),
                ..Default::default()
            },
        )
    };
    let revived = Instant::now();
    while lock(&pager).servers().any(|(_, alive)| !alive) {
        anyhow::ensure!(
            revived.elapsed() < Duration::from_secs(10),
            "no reconnection"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let all: Vec<u64> = (0..pages).collect();
    let survivors: Vec<u64> = {
        let p = lock(&pager);
        all.iter()
            .copied()
            .filter(|&pg| !p.holders(pg).contains(&second))
            .collect()
    };
    let t0 = Instant::now();
    let before = read_blocks(&pager, &survivors, &all, &|| t0.elapsed() >= dur)?;
    // Held from before the death: the first phase is one without recovery.
    maintenance.pause(true);
    cluster.kill(second);
    lock(&pager).probe_servers()?;
    let busy = Arc::new(AtomicBool::new(true));
    let done_at = Arc::new(AtomicU64::new(0));
    let watch = {
        let (pager, busy, done_at) = (pager.clone(), busy.clone(), done_at.clone());
        let t = Instant::now();
        std::thread::spawn(move || {
            while busy.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
                if lock(&pager).degraded_pages() == 0 {
                    done_at.store(t.elapsed().as_nanos() as u64, Ordering::SeqCst);
                    busy.store(false, Ordering::SeqCst);
                }
            }
        })
    };
    // Recovery running and held in alternating phases, so that the program's reads with and
    // without it are side by side under the same machine load (on these VMs, read rates move
    // by a tenth from one minute to the next) and the same failure. Held first: a recovery
    // that ends within its first phase still has a phase without it to compare with.
    let t1 = Instant::now();
    let mut phases = [[(Duration::ZERO, 0u64); 2]; 2];
    let (mut running, mut running_for) = (false, Duration::ZERO);
    while busy.load(Ordering::SeqCst) && t1.elapsed() < background_for {
        maintenance.pause(!running);
        let t = Instant::now();
        let got = read_blocks(&pager, &survivors, &all, &|| {
            t.elapsed() >= PHASE || !busy.load(Ordering::SeqCst)
        })?;
        if running {
            running_for += t.elapsed();
        }
        let ph = &mut phases[usize::from(running)];
        for (acc, (time, n)) in ph.iter_mut().zip(got) {
            acc.0 += time;
            acc.1 += n;
        }
        running = !running;
    }
    maintenance.pause(false);
    busy.store(false, Ordering::SeqCst);
    let _ = watch.join();
    drop(maintenance);
    let done = done_at.load(Ordering::SeqCst) > 0;
    r.background_recovery_s = done.then_some(running_for.as_secs_f64());
    let [held, run] = phases;
    // Both phases must have read something for a ratio (a phase cut short at its start
    // reads nothing): otherwise there is no figure, not an infinite one.
    let measured = |a: (Duration, u64), b: (Duration, u64)| a.1 > 0 && b.1 > 0;
    r.recovery_slowdown = measured(run[0], held[0]).then(|| 1.0 - rate(run[0]) / rate(held[0]));
    r.recovery_slowdown_any_page = Some(1.0 - rate(run[1]) / rate(before[1]));
    cluster.restart(second)?;
    let p = Arc::try_unwrap(pager).map_err(|_| anyhow::anyhow!("pager still shared"))?;
    let mut p = p.into_inner().unwrap_or_else(|e| e.into_inner());
    p.revive_dead_servers();
    p.into_transport().close();
    Ok(())
}

pub fn run(opts: &Options) -> anyhow::Result<String> {
    // `background_for`: how long the program reads while the background recovery runs and
    // is held in turn; a recovery not over by then has no duration in the report ("—"). The
    // quick run's bound keeps CI's smoke run short: at its default pace the background
    // recovery of 8,192 pages took 4–58 s of running time here (2026-11-30), and two schemes
    // not done within 120 s made the smoke run 4.3 minutes.
    let (pages, iters, dur, background_for, capacity) = if opts.quick {
        (
            8_192u64,
            2_000,
            Duration::from_millis(1000),
            Duration::from_secs(30),
            "128M",
        )
    } else {
        (
            65_536,
            10_000,
            Duration::from_secs(3),
            Duration::from_secs(120),
            "512M",
        )
    };
    let machine = Machine::describe();
    eprintln!("bench reliability on {}", machine.one_line());
    let mut cluster = Cluster::start(&opts.netram_exe, capacity)?;
    // The pagers' spill directory, removed when done.
    let spill = crate::nbd::tempfile_dir("netram-bench-reliability")?;
    let mut all = Vec::new();
    for (key, name) in SCHEMES {
        let scheme: Scheme = name.parse()?;
        all.push((key, scheme));
    }
    let list: Vec<Scheme> = all.iter().map(|&(_, s)| s).collect();
    let results = side_by_side(&cluster, &list, pages, iters, dur, spill.path())?;
    let mut schemes = BTreeMap::new();
    for (&(key, scheme), mut r) in all.iter().zip(results) {
        if scheme != Scheme::None {
            eprintln!("{scheme}: recovery after a SIGKILL ...");
            let victim = schemes.len() % SERVERS;
            recovery(
                &mut cluster,
                scheme,
                pages,
                (dur, background_for),
                victim,
                spill.path(),
                &mut r,
            )?;
        }
        schemes.insert(key, r);
    }
    drop(cluster);
    let none = &schemes["none"];
    let rs = &schemes["rs4_2"];
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => a / b,
        _ => f64::NAN,
    };
    let targets = vec![
        target(
            "rs4_2.get_p50_us / none.get_p50_us",
            ratio(rs.get_p50_us, none.get_p50_us),
            1.15,
            "le",
        ),
        target(
            "rs4_2.bytes_per_page / none.bytes_per_page",
            ratio(rs.bytes_per_page, none.bytes_per_page),
            1.6,
            "le",
        ),
        target(
            "recovery_pages_per_s / 50000",
            rs.recovery_pages_per_s.unwrap_or(0.0) / 50_000.0,
            1.0,
            "ge",
        ),
        target(
            "recovery_slowdown / 0.10",
            rs.recovery_slowdown.unwrap_or(f64::INFINITY) / 0.10,
            1.0,
            "le",
        ),
    ];
    let r = ReliabilityResult {
        machine,
        quick: opts.quick,
        servers: SERVERS,
        pages,
        recovery_pages_per_s: rs.recovery_pages_per_s,
        recovery_slowdown: rs.recovery_slowdown,
        recovery_slowdown_any_page: rs.recovery_slowdown_any_page,
        schemes,
        targets,
    };
    crate::write_json(&opts.out, "reliability.json", &r)?;
    let md = markdown(&r);
    std::fs::write(opts.out.join("reliability.md"), &md)?;
    Ok(md)
}

fn fmt(v: Option<f64>, digits: usize) -> String {
    v.map_or("—".into(), |v| format!("{v:.digits$}"))
}

fn markdown(r: &ReliabilityResult) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# netram bench reliability\n");
    let _ = writeln!(
        s,
        "{} · {} `netram serve` processes on loopback · {} pages per scheme{}\n",
        r.machine.one_line(),
        r.servers,
        r.pages,
        if r.quick { " · quick run" } else { "" }
    );
    let _ = writeln!(
        s,
        "| scheme | GET p50 µs | GET p99 µs | PUT p50 µs | PUT p99 µs | GET depth 32 /s | \
         bytes/page | recovery pages/s | slowdown during recovery | slowdown, any page | \
         background recovery s |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
    for v in r.schemes.values() {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            v.scheme,
            fmt(v.get_p50_us, 1),
            fmt(v.get_p99_us, 1),
            fmt(v.put_p50_us, 1),
            fmt(v.put_p99_us, 1),
            fmt(v.get_depth32_ops_per_s, 0),
            fmt(v.bytes_per_page, 0),
            fmt(v.recovery_pages_per_s, 0),
            fmt(v.recovery_slowdown, 3),
            fmt(v.recovery_slowdown_any_page, 3),
            fmt(v.background_recovery_s, 2),
        );
    }
    for v in r.schemes.values() {
        let n = |x: Option<u64>| x.map_or("—".to_string(), |x| x.to_string());
        if v.recovery_pages_per_s.is_some() {
            let _ = writeln!(
                s,
                "\n{}: the flat-out recovery started {} write-outs (under parity also pages \
                 protected again after their holder died), rebuilt {} onto live servers, put {} \
                 on the local disk; servers dead at its end: {}.",
                v.scheme,
                n(v.recovery_started),
                n(v.pages_rebuilt),
                n(v.recovery_spills),
                n(v.recovery_servers_dead),
            );
        }
    }
    let _ = writeln!(s, "\n| target | ratio | limit | met |\n|---|---|---|---|");
    s += &crate::target_rows(&r.targets);
    let _ = writeln!(
        s,
        "\nPUT at depth 1 has no cache, so it returns once stored: every copy (mirror) or a \
         one-page stripe with its parity pieces (Reed-Solomon), or the page and then its group's \
         parity page, shipped at once since the write waits for it (dynamic parity; the holder \
         merges such small groups). Memory per page is the servers' frames after a batched fill \
         (whole stripes and groups). Recovery: one server SIGKILLed, rebuilt \
         flat out (Reed-Solomon counts pieces). Slowdown: a second server SIGKILLed, the \
         background recovery (`netram_client::maintain`, default pace) running and held in \
         alternating phases of 250 ms; as in Nswap Table III, the program reads pages whose \
         data survived, and the slowdown is 1 − its reads per second with recovery running / \
         held. Alongside, in alternating blocks, a program reading any page (lost ones are \
         read degraded until rebuilt), against its reads before the kill: minutes apart, so \
         the machine's drift (about ±0.1 on these VMs) is in that figure."
    );
    s
}
