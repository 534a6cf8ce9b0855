//! `netram bench core`: netram's GET and PUT against the raw loopback round trip, in one run.
//!
//! Every netram figure goes through the whole client path (pager, checksums, page table,
//! TCP transport) to real page servers on loopback, in this process like the raw baseline's
//! server, so that both sides pay the same wake-ups. Writes `core.json` and `core.md`.

use crate::machine::Machine;
use crate::process::{rss_of, ChildGuard};
use crate::raw::{self, RawPeer, Wait};
use crate::{page_content, pin_to, restore_affinity, target, Placement, Summary, Target};
use netram_client::latency::PmQos;
use netram_client::{ClientConfig, TcpTransport};
use netram_cluster::LocalCluster;
use netram_pager::{MemDisk, Pager, PagerConfig};
use netram_proto::{PageFlags, PageKey, PAGE_SIZE};
use netram_store::{Store, StoreConfig};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Options {
    pub quick: bool,
    pub out: PathBuf,
    /// The `netram` executable, to measure a real `netram serve` process's memory.
    pub netram_exe: PathBuf,
}

#[derive(Debug, Serialize)]
pub struct CoreResult {
    pub machine: Machine,
    pub quick: bool,
    pub raw_rtt_p50_us: f64,
    pub raw_rtt_p99_us: f64,
    pub raw_rtt_fast_p50_us: f64,
    pub raw_rtt_fast_p99_us: f64,
    pub raw_depth32_ops_per_s: f64,
    /// The same exchange through tokio (multi-thread server runtime, current-thread client):
    /// the cost of an async runtime's hand-offs, beside the plain blocking exchange.
    pub raw_tokio_rtt_p50_us: f64,
    pub raw_tokio_rtt_p99_us: f64,
    /// The tokio exchange with the PM QoS request held (tokio does not poll).
    pub raw_tokio_rtt_fast_p50_us: f64,
    pub raw_tokio_rtt_fast_p99_us: f64,
    pub get_p50_us: f64,
    pub get_p99_us: f64,
    pub put_p50_us: f64,
    pub put_p99_us: f64,
    pub get_fast_p50_us: f64,
    pub get_fast_p99_us: f64,
    pub put_fast_p50_us: f64,
    pub put_fast_p99_us: f64,
    /// Depth-1 GETs spread over three servers, low-latency mode: all of them share this
    /// machine's two CPUs with the client, unlike a real cluster.
    pub get_fast_3servers_p50_us: f64,
    pub get_fast_3servers_p99_us: f64,
    pub get_depth32_ops_per_s: f64,
    pub get_depth32_3servers_ops_per_s: f64,
    pub server_meta_bytes_per_page: f64,
    /// RSS of a `netram serve` process filled to capacity, divided by its pages.
    pub server_resident_bytes_per_page: f64,
    /// CPU time of client and server together per depth-1 GET, plain and low-latency mode.
    pub cpu_us_per_get: f64,
    pub cpu_us_per_get_fast: f64,
    /// Whether the PM QoS request could be held (root); without it the fast mode only polls.
    pub pm_qos_held: bool,
    pub targets: Vec<Target>,
}

fn cpu_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

pub(crate) struct Depth1 {
    pub(crate) get: Summary,
    pub(crate) put: Summary,
    /// The raw exchange measured in the blocks between netram's.
    pub(crate) raw: Summary,
    pub(crate) cpu_us_per_get: f64,
}

/// A client that reaches servers through `security` (an embedded cluster's, or the run's).
fn client(low_latency: bool, security: netram_client::Security) -> ClientConfig {
    ClientConfig {
        low_latency,
        security,
        ..ClientConfig::new()
    }
}

/// Rounds of alternating raw and netram blocks: both sides of a ratio see the same machine
/// state. On these VMs the same code measured 10 to 13.5 µs from one run to the next, as much as
/// the difference being measured, so measuring one side after the other misleads.
const ROUNDS: usize = 10;

/// What protects a benchmark's traffic: `bench core` measures the default (`Secure`); `bench
/// security` compares it with the others side by side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wire {
    /// Clear TCP (`--insecure`), pages in clear with their crc32c.
    Plain,
    /// Clear TCP, pages sealed end to end.
    SealedPages,
    /// Mutual TLS and sealed frames, pages sealed end to end: what every front end runs.
    Secure,
}

impl Wire {
    fn cluster(self, n: usize, capacity: u64, low_latency: bool) -> anyhow::Result<LocalCluster> {
        Ok(match self {
            Wire::Secure => LocalCluster::start(n, capacity, low_latency)?,
            _ => LocalCluster::start_insecure(n, capacity, low_latency)?,
        })
    }

    fn seal(self) -> Option<netram_pager::SealKey> {
        (self != Wire::Plain).then(netram_pager::SealKey::random)
    }
}

/// Depth-1 GETs through the pager with no cache, in blocks alternating with the raw exchange
/// (`raw_wait`): PUT every page first, then GET random pages one at a time, verifying each.
pub(crate) fn netram_depth1(
    servers: usize,
    low_latency: bool,
    raw_wait: Wait,
    pages: u64,
    iters: usize,
    wire: Wire,
) -> anyhow::Result<Depth1> {
    // Servers (netram's and the raw one) start pinned to one CPU, the client to another. Only
    // with one server: several server threads pinned to one vCPU would queue behind each other,
    // which models no real cluster either, so they are left to the scheduler.
    let placement = Placement::choose().filter(|_| servers == 1);
    let prev = placement.and_then(|p| pin_to(p.server_cpu));
    let cluster = wire.cluster(servers, (pages + 16) * PAGE_SIZE as u64, low_latency)?;
    let mut raw = RawPeer::start(raw_wait)?;
    if let Some(p) = placement {
        pin_to(p.client_cpu);
    }
    let t = TcpTransport::connect(
        &cluster.addrs(),
        &ClientConfig {
            sealed_pages: wire != Wire::Plain,
            ..client(low_latency, cluster.security())
        },
    );
    let cfg = PagerConfig {
        pages,
        cache_pages: 0,
        seal: wire.seal(),
        ..Default::default()
    };
    let mut pager = Pager::new(cfg, t, MemDisk::default());
    let mut buf = vec![0u8; PAGE_SIZE];
    let mut put_ns = Vec::with_capacity(pages as usize);
    for p in 0..pages {
        page_content(1, p, &mut buf);
        let t = Instant::now();
        pager.write(p, &buf)?;
        put_ns.push(t.elapsed().as_nanos() as u64);
    }
    let mut raw_ns = Vec::with_capacity(iters);
    raw.exchange(200, &mut Vec::new())?; // warm-up
    let mut rng = fastrand::Rng::with_seed(7);
    let mut want = vec![0u8; PAGE_SIZE];
    let mut get_ns = Vec::with_capacity(iters);
    for _ in 0..ROUNDS {
        raw.exchange(iters / ROUNDS, &mut raw_ns)?;
        for _ in 0..iters / ROUNDS {
            let p = rng.u64(0..pages);
            let t = Instant::now();
            pager.read(p, &mut buf)?;
            get_ns.push(t.elapsed().as_nanos() as u64);
            page_content(1, p, &mut want);
            anyhow::ensure!(buf == want, "page {p} read back wrong");
        }
    }
    drop(raw);
    // CPU time in a loop of its own: the process CPU clock is a system call, too slow to read
    // inside the timed window, and verification would be counted too.
    let c = cpu_ns();
    for _ in 0..iters {
        pager.read(rng.u64(0..pages), &mut buf)?;
    }
    let cpu = cpu_ns() - c;
    pager.into_transport().close();
    cluster.stop();
    restore_affinity(prev);
    Ok(Depth1 {
        get: Summary::of_ns(&mut get_ns),
        put: Summary::of_ns(&mut put_ns[16.min(pages as usize)..].to_vec()),
        raw: Summary::of_ns(&mut raw_ns),
        cpu_us_per_get: cpu as f64 / iters as f64 / 1000.0,
    })
}

/// GETs per second with the pager's window of 32 requests in flight per server.
pub(crate) fn netram_depth32(
    servers: usize,
    pages: u64,
    duration: Duration,
    wire: Wire,
) -> anyhow::Result<f64> {
    let cluster = wire.cluster(servers, (pages + 16) * PAGE_SIZE as u64, false)?;
    let t = TcpTransport::connect(
        &cluster.addrs(),
        &ClientConfig {
            sealed_pages: wire != Wire::Plain,
            ..client(false, cluster.security())
        },
    );
    let cfg = PagerConfig {
        pages,
        cache_pages: 0,
        window: 32,
        seal: wire.seal(),
        ..Default::default()
    };
    let mut pager = Pager::new(cfg, t, MemDisk::default());
    let batch = 1024usize;
    let mut data = vec![0u8; batch * PAGE_SIZE];
    let all: Vec<u64> = (0..pages).collect();
    for chunk in all.chunks(batch) {
        for (i, &p) in chunk.iter().enumerate() {
            page_content(2, p, &mut data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
        }
        pager.write_many(chunk, &data[..chunk.len() * PAGE_SIZE])?;
    }
    let mut rng = fastrand::Rng::with_seed(9);
    let mut order: Vec<u64> = (0..pages).collect();
    let start = Instant::now();
    let mut done = 0u64;
    while start.elapsed() < duration {
        rng.shuffle(&mut order);
        for chunk in order.chunks(batch) {
            pager.read_many(chunk, &mut data[..chunk.len() * PAGE_SIZE])?;
            done += chunk.len() as u64;
        }
    }
    let rate = done as f64 / start.elapsed().as_secs_f64();
    // Spot-check the last batch: the checksums already cover every page.
    let last = &order[order.len() - batch.min(order.len())..];
    let mut want = vec![0u8; PAGE_SIZE];
    for (i, &p) in last.iter().enumerate() {
        page_content(2, p, &mut want);
        anyhow::ensure!(
            data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE] == want[..],
            "page {p} read back wrong"
        );
    }
    pager.into_transport().close();
    cluster.stop();
    Ok(rate)
}

/// Index and metadata bytes per page of a full store (exact, from the allocations).
fn server_meta_per_page(frames: usize) -> f64 {
    let mut store = Store::new(vec![0u8; frames * PAGE_SIZE], StoreConfig::default());
    let h = store.open_session(1, 1, 1, 0).expect("a session");
    let data = vec![0xa5u8; PAGE_SIZE];
    for p in 0..frames as u64 {
        let key = PageKey::new(0, p);
        let crc = netram_proto::page_checksum(key, 1, PageFlags::default(), &data);
        store
            .put(h, key, 1, crc, PageFlags::default(), &data, 0)
            .expect("session is live");
    }
    assert_eq!(store.stored_pages(), frames as u64);
    store.meta_bytes() as f64 / frames as f64
}

/// The resident memory of a real `netram serve` process filled to capacity, per stored page:
/// frames, metadata, index, code and stacks, everything the daemon costs.
fn daemon_resident_per_page(exe: &std::path::Path, frames: u64) -> anyhow::Result<f64> {
    let capacity = (frames * PAGE_SIZE as u64).to_string();
    let (daemon, addr) = ChildGuard::netram(
        exe,
        // One client fills the whole daemon here, past the default per-client quota.
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--capacity",
            &capacity,
            "--max-client-memory",
            &capacity,
        ],
        "netram serve: listening on ",
    )?;
    let t = TcpTransport::connect(&[addr], &client(false, crate::security()?));
    let mut pager = Pager::new(
        PagerConfig {
            pages: frames,
            cache_pages: 0,
            ..Default::default()
        },
        t,
        MemDisk::default(),
    );
    let batch = 256u64;
    let data = vec![0x3cu8; batch as usize * PAGE_SIZE];
    for start in (0..frames).step_by(batch as usize) {
        let pages: Vec<u64> = (start..(start + batch).min(frames)).collect();
        pager.write_many(&pages, &data[..pages.len() * PAGE_SIZE])?;
    }
    anyhow::ensure!(
        pager.pages_on_disk_only() == 0,
        "the daemon refused pages it should have room for"
    );
    let rss = rss_of(daemon.pid());
    drop(pager);
    Ok(rss as f64 / frames as f64)
}

pub fn run(opts: &Options) -> anyhow::Result<String> {
    let (iters, pages, dur) = if opts.quick {
        (3_000, 2_048, Duration::from_millis(1500))
    } else {
        (20_000, 8_192, Duration::from_secs(4))
    };
    let machine = Machine::describe();
    eprintln!("bench core on {}", machine.one_line());

    eprintln!("raw loopback round trip through tokio, depth 1 ...");
    let raw_tokio = Summary::of_ns(&mut raw::rtt_tokio(iters, 500, false)?);
    let raw_tokio_fast = Summary::of_ns(&mut raw::rtt_tokio(iters, 500, true)?);
    eprintln!("raw loopback round trip, depth 32 ...");
    let raw_d32 = raw::pipelined(32, dur)?;

    eprintln!("netram GET/PUT and raw round trips, depth 1, default mode ...");
    let plain = netram_depth1(1, false, Wait::Block, pages, iters, Wire::Secure)?;
    let raw_plain = plain.raw;
    eprintln!("netram GET/PUT and raw round trips, depth 1, low-latency mode ...");
    // The raw side holds the same PM QoS request as netram's low-latency mode.
    let qos = PmQos::hold();
    let pm_qos_held = qos.is_some();
    let fast = netram_depth1(1, true, Wait::Poll, pages, iters, Wire::Secure)?;
    let raw_fast = fast.raw;
    let fast3 = netram_depth1(3, true, Wait::Poll, pages, iters, Wire::Secure)?;
    drop(qos);
    eprintln!("netram GET, depth 32, one server and three ...");
    let d32 = netram_depth32(1, pages, dur, Wire::Secure)?;
    let d32x3 = netram_depth32(3, pages, dur, Wire::Secure)?;
    eprintln!("server memory per page ...");
    let frames = if opts.quick { 65_536 } else { 262_144 };
    let meta = server_meta_per_page(frames);
    let resident = daemon_resident_per_page(&opts.netram_exe, frames as u64)?;

    let targets = vec![
        target(
            "get_p50_us / raw_rtt_p50_us",
            plain.get.p50_us / raw_plain.p50_us,
            1.3,
            "le",
        ),
        target(
            "get_fast_p50_us / raw_rtt_fast_p50_us",
            fast.get.p50_us / raw_fast.p50_us,
            1.3,
            "le",
        ),
        target(
            "get_depth32_ops_per_s / raw_depth32_ops_per_s",
            d32 / raw_d32,
            0.7,
            "ge",
        ),
        target(
            "get_depth32_3servers_ops_per_s / raw_depth32_ops_per_s",
            d32x3 / raw_d32,
            1.0,
            "ge",
        ),
        target("server_meta_bytes_per_page / 32", meta / 32.0, 1.0, "le"),
    ];
    let r = CoreResult {
        machine,
        quick: opts.quick,
        raw_rtt_p50_us: raw_plain.p50_us,
        raw_rtt_p99_us: raw_plain.p99_us,
        raw_rtt_fast_p50_us: raw_fast.p50_us,
        raw_rtt_fast_p99_us: raw_fast.p99_us,
        raw_depth32_ops_per_s: raw_d32,
        raw_tokio_rtt_p50_us: raw_tokio.p50_us,
        raw_tokio_rtt_p99_us: raw_tokio.p99_us,
        raw_tokio_rtt_fast_p50_us: raw_tokio_fast.p50_us,
        raw_tokio_rtt_fast_p99_us: raw_tokio_fast.p99_us,
        get_p50_us: plain.get.p50_us,
        get_p99_us: plain.get.p99_us,
        put_p50_us: plain.put.p50_us,
        put_p99_us: plain.put.p99_us,
        get_fast_p50_us: fast.get.p50_us,
        get_fast_p99_us: fast.get.p99_us,
        put_fast_p50_us: fast.put.p50_us,
        put_fast_p99_us: fast.put.p99_us,
        get_fast_3servers_p50_us: fast3.get.p50_us,
        get_fast_3servers_p99_us: fast3.get.p99_us,
        get_depth32_ops_per_s: d32,
        get_depth32_3servers_ops_per_s: d32x3,
        server_meta_bytes_per_page: meta,
        server_resident_bytes_per_page: resident,
        cpu_us_per_get: plain.cpu_us_per_get,
        cpu_us_per_get_fast: fast.cpu_us_per_get,
        pm_qos_held,
        targets,
    };
    crate::write_json(&opts.out, "core.json", &r)?;
    let md = markdown(&r);
    std::fs::write(opts.out.join("core.md"), &md)?;
    Ok(md)
}

fn markdown(r: &CoreResult) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# netram bench core\n");
    let _ = writeln!(
        s,
        "Machine: {}{}\n",
        r.machine.one_line(),
        if r.quick { " · --quick" } else { "" }
    );
    let _ = writeln!(s, "| measure | plain | low-latency mode |\n|---|---|---|");
    let _ = writeln!(
        s,
        "| raw loopback RTT (32 B → 4 KiB) p50 / p99 µs | {:.1} / {:.1} | {:.1} / {:.1} |",
        r.raw_rtt_p50_us, r.raw_rtt_p99_us, r.raw_rtt_fast_p50_us, r.raw_rtt_fast_p99_us
    );
    let _ = writeln!(
        s,
        "| netram GET p50 / p99 µs | {:.1} / {:.1} | {:.1} / {:.1} |",
        r.get_p50_us, r.get_p99_us, r.get_fast_p50_us, r.get_fast_p99_us
    );
    let _ = writeln!(
        s,
        "| netram PUT p50 / p99 µs | {:.1} / {:.1} | {:.1} / {:.1} |",
        r.put_p50_us, r.put_p99_us, r.put_fast_p50_us, r.put_fast_p99_us
    );
    let _ = writeln!(
        s,
        "| CPU µs per GET (client + server) | {:.1} | {:.1} |",
        r.cpu_us_per_get, r.cpu_us_per_get_fast
    );
    let _ = writeln!(
        s,
        "| the same exchange through tokio p50 / p99 µs | {:.1} / {:.1} | {:.1} / {:.1} (PM QoS only) |",
        r.raw_tokio_rtt_p50_us, r.raw_tokio_rtt_p99_us, r.raw_tokio_rtt_fast_p50_us, r.raw_tokio_rtt_fast_p99_us
    );
    let _ = writeln!(
        s,
        "| netram GET over three servers (same 2 CPUs) p50 / p99 µs | | {:.1} / {:.1} |",
        r.get_fast_3servers_p50_us, r.get_fast_3servers_p99_us
    );
    let _ = writeln!(s, "\n| throughput | ops/s |\n|---|---|");
    let _ = writeln!(
        s,
        "| raw, depth 32, one connection | {:.0} |",
        r.raw_depth32_ops_per_s
    );
    let _ = writeln!(
        s,
        "| netram GET, window 32, one server | {:.0} |",
        r.get_depth32_ops_per_s
    );
    let _ = writeln!(
        s,
        "| netram GET, window 32 per server, three servers | {:.0} |",
        r.get_depth32_3servers_ops_per_s
    );
    let _ = writeln!(s, "\nServer memory: {:.1} bytes of index and metadata per stored page; a full `netram serve` process is {:.0} bytes resident per stored page (frame, metadata, index, code, stacks).", r.server_meta_bytes_per_page, r.server_resident_bytes_per_page);
    let _ = writeln!(
        s,
        "Low-latency mode: PM QoS request {}; sockets polled for up to 50 µs before sleeping, on both sides of the raw exchange too. Depth-1 raw and netram figures come from {ROUNDS} alternating blocks each, so both sides of a ratio see the same machine state.\n",
        if r.pm_qos_held {
            "held"
        } else {
            "not available (not root): polling only"
        }
    );
    let _ = writeln!(s, "| target | ratio | limit | met |\n|---|---|---|---|");
    for t in &r.targets {
        let op = if t.sense == "le" { "≤" } else { "≥" };
        let _ = writeln!(
            s,
            "| {} | {:.3} | {op} {:.2} | {} |",
            t.name,
            t.ratio,
            t.limit,
            if t.met { "yes" } else { "**no**" }
        );
    }
    s
}
