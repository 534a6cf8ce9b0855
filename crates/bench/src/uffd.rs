//! `netram bench uffd`: userfaultfd regions and `netram run` against the limits of this machine
//! and against what users would otherwise pick, in one run (Anemone §4's comparison with disk;
//! GMS §5's fault costs).
//!
//! * latencies, each plainly and in the low-latency mode (PM QoS held; servers and client
//!   polling): a userfaultfd fault served from local memory (a zero fill: the handler round
//!   trip without I/O), the raw loopback TCP round trip with a 4 KiB reply (one peer), and a
//!   netram remote fault (a random page of a region fetched from one `netram serve`, as the raw
//!   round trip has one peer; also, for information, from three on the one CPU the servers
//!   get, where polling servers take that CPU from each other);
//! * the bundled workloads (random read-modify-writes, quicksort) at 25 % local memory in the
//!   low-latency mode, run ways: all local, `netram run` on three `netram serve` processes
//!   (also with victims first in, first out: what access sampling buys), `netram run --backing
//!   disk`, and as root the kernel's swap to a local disk file and to zram in a memory cgroup
//!   (limited to a quarter of the working set plus what the process uses besides its data);
//! * the prefetcher's hit rate on the quicksort;
//! * `threads`: faults per second of 1, 2, 4 and 8 threads faulting together on disjoint random
//!   pages at 25 % local (`faults_per_s_threads`; issue 38's target: 4 threads ≥ 2× one).
//!
//! [`Way`] and [`run_way`] are shared with `netram demo`, which runs the same comparison
//! smaller. Writes `uffd.json`, `uffd.md` and `uffd.svg`.

use crate::machine::Machine;
use crate::nbd::{raw_rtts, run_workload, setup, start_n_servers, start_servers, tempfile_dir};
use crate::process::{have, ChildGuard};
use crate::workload::figure;
use crate::{target, Summary, Target};
use netram_client::latency::PmQos;
use netram_client::{ClientConfig, TcpTransport};
use netram_pager::{Backing, MemDisk, Pager, PagerConfig};
use netram_proto::PAGE_SIZE;
use netram_uffd::{Region, RegionOptions};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Options {
    pub quick: bool,
    pub out: PathBuf,
    /// The `netram` executable: servers, `netram run` and the workloads run as its children.
    pub netram_exe: PathBuf,
    /// The workloads' working set; `None`: 256 MiB (32 MiB with `quick`).
    pub working_set: Option<u64>,
}

/// One way of running a workload with a quarter of its memory local (all of it for `Local`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    Local,
    /// `netram run` on the page servers.
    Netram,
    /// The same with CLOCK over sampled accesses (`NETRAM_SAMPLES=8`; off by default).
    NetramClock,
    /// `netram run --backing disk`.
    NetramDisk,
    /// The kernel's swap to a file on the local disk, in a memory cgroup (root).
    SwapDisk,
    /// The kernel's swap to zram, in a memory cgroup (root).
    Zram,
}

impl Way {
    pub const ALL: [Way; 6] = [
        Way::Local,
        Way::Netram,
        Way::NetramClock,
        Way::NetramDisk,
        Way::SwapDisk,
        Way::Zram,
    ];

    pub fn key(self) -> &'static str {
        match self {
            Way::Local => "local",
            Way::Netram => "netram",
            Way::NetramClock => "netram_clock",
            Way::NetramDisk => "netram_disk",
            Way::SwapDisk => "swap_disk",
            Way::Zram => "zram",
        }
    }

    /// Why this way cannot run here, if it cannot.
    pub fn unavailable(self) -> Option<String> {
        if !matches!(self, Way::SwapDisk | Way::Zram) {
            return None;
        }
        if !rustix::process::geteuid().is_root() {
            return Some("needs root (swapon, cgroups)".into());
        }
        if let Err(why) = crate::cgroup::Hierarchy::find() {
            return Some(why);
        }
        let tools = ["mkswap", "swapon", "swapoff", "fallocate"];
        let missing: Vec<&str> = tools.into_iter().filter(|t| !have(t)).collect();
        (!missing.is_empty()).then(|| format!("{} not installed", missing.join(", ")))
    }
}

/// What every way of a comparison shares.
#[derive(Debug, Clone)]
pub struct Ctx {
    pub exe: PathBuf,
    /// The working set; ways other than `Local` get a quarter of it locally.
    pub working_set: u64,
    /// The page servers (comma-separated addresses).
    pub servers: String,
    pub low_latency: bool,
    /// Scratch space (reports, spill files).
    pub dir: PathBuf,
}

/// The workload's arguments after `netram workload`.
pub fn workload_args(workload: &str, working_set: u64, seed: u64) -> Vec<String> {
    let w = working_set.to_string();
    match workload {
        // Four read-modify-writes per page on average, bounded at ten minutes.
        "random" => vec![
            "random".into(),
            w,
            seed.to_string(),
            "600".into(),
            (working_set / PAGE_SIZE as u64 * 4).to_string(),
        ],
        _ => vec!["qsort".into(), w, seed.to_string()],
    }
}

/// Runs `netram workload ARGS` one way; the workload's figures (`seconds`: its whole run,
/// fill and verification included) and, for netram, the counters `netram run` reports.
pub fn run_way(ctx: &Ctx, way: Way, args: &[String]) -> anyhow::Result<Value> {
    let timeout = Duration::from_secs(1800);
    match way {
        Way::Local => {
            let out = bounded(Command::new(&ctx.exe).arg("workload").args(args), timeout)?;
            figures(&out, json!({}))
        }
        Way::Netram | Way::NetramClock | Way::NetramDisk => {
            let report = ctx.dir.join(format!("run-{}.json", fastrand::u32(..)));
            let mut cmd = Command::new(&ctx.exe);
            cmd.arg("run")
                .args(["--local-mem", &(ctx.working_set / 4).to_string(), "-q"])
                .arg("--report")
                .arg(&report)
                .arg("--spill-dir")
                .arg(&ctx.dir);
            if way == Way::NetramDisk {
                cmd.args(["--backing", "disk"]);
            } else {
                cmd.args(["--servers", &ctx.servers]);
            }
            if way == Way::NetramClock {
                cmd.env("NETRAM_SAMPLES", "8");
            }
            if ctx.low_latency {
                cmd.arg("--low-latency");
            }
            cmd.arg("--").arg(&ctx.exe).arg("workload").args(args);
            let out = bounded(&mut cmd, timeout)?;
            let counters: Value = serde_json::from_str(&std::fs::read_to_string(&report)?)?;
            let _ = std::fs::remove_file(&report);
            figures(&out, counters)
        }
        Way::SwapDisk | Way::Zram => {
            let config = if way == Way::SwapDisk { "disk" } else { "zram" };
            // The memory cgroup's OOM killer sometimes ends a program whose swap-ins it
            // cannot charge while reclaim waits on writeback (bench nbd saw it with every
            // device): that is the kernel's result in this much memory, recorded, and the run
            // is tried again with more (as `bench programs` does). The kill is a matter of
            // chance near the edge (the 32 MiB quicksort on zram here: killed in 2 of 3 runs
            // in 18 MiB, 1 of 6 in 27 MiB, 0 of 6 in 36 MiB), so each size is tried twice.
            let limit = ctx.working_set / 4 + workload_baseline(&ctx.exe, &ctx.dir)?;
            let mut killed_at = Vec::new();
            for eighths in SWAP_LIMITS_EIGHTHS {
                let size = limit / 8 * eighths;
                for _ in 0..2 {
                    let dev = setup(config, ctx.working_set, &ctx.exe, &ctx.dir)?;
                    let run = run_workload(
                        &ctx.exe,
                        ctx.working_set,
                        Some(size),
                        config,
                        &dev,
                        args,
                        timeout,
                    );
                    match run {
                        Ok(mut v) => {
                            v["oom_killed_at_bytes"] = json!(killed_at);
                            v["cgroup_limit_bytes"] = json!(size);
                            if let Some(t) = v.get("total_seconds").cloned() {
                                v["seconds"] = t;
                            }
                            return Ok(v);
                        }
                        Err(e) if format!("{e:#}").contains("SIGKILL") => killed_at.push(size),
                        Err(e) => return Err(e),
                    }
                }
            }
            Err(OomKilled { sizes: killed_at }.into())
        }
    }
}

/// How much more memory the kernel's run is given each time its OOM killer ends it (of the
/// first limit, in eighths): ×1, ×1.5, ×2, ×3. Shared with `bench programs`.
pub(crate) const SWAP_LIMITS_EIGHTHS: [u64; 4] = [8, 12, 16, 24];

/// The kernel's swap (a baseline, not netram) was OOM-killed by the memory cgroup at every
/// size [`run_way`] tried: the kernel's result in that much memory, which callers report as
/// such (no figure), not as a failure of the run.
#[derive(Debug)]
pub struct OomKilled {
    /// The cgroup limits it was killed at, in bytes, in the order tried.
    pub sizes: Vec<u64>,
}

impl std::fmt::Display for OomKilled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib: Vec<String> = self.sizes.iter().map(|b| (b >> 20).to_string()).collect();
        write!(
            f,
            "OOM-killed (SIGKILL) by the memory cgroup at every size tried: {} MiB",
            mib.join(", ")
        )
    }
}

impl std::error::Error for OomKilled {}

/// The memory the workload process needs apart from its data (its peak in a cgroup when it
/// sorts one page): added to the kernel swap's cgroup limit, so that the kernel has a quarter
/// of the working set for data as `netram run` does (whose budget counts region pages only).
fn workload_baseline(exe: &Path, dir: &Path) -> anyhow::Result<u64> {
    static BASELINE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    if let Some(&b) = BASELINE.get() {
        return Ok(b);
    }
    let dev = setup("local", 0, exe, dir)?;
    let args: Vec<String> = ["qsort", "4096", "1"].map(String::from).to_vec();
    let v = run_workload(
        exe,
        4096,
        None,
        "local",
        &dev,
        &args,
        Duration::from_secs(60),
    )?;
    let b = v["cgroup_peak_bytes"].as_u64().unwrap_or(0);
    Ok(*BASELINE.get_or_init(|| b))
}

/// Runs `cmd` with its output captured, killed by PID after `timeout`; its stdout, if it
/// succeeded.
fn bounded(cmd: &mut Command, timeout: Duration) -> anyhow::Result<String> {
    let mut child = ChildGuard::spawn(cmd.stdout(Stdio::piped()).stderr(Stdio::piped()))?;
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.0.try_wait()? {
            break s;
        }
        anyhow::ensure!(started.elapsed() < timeout, "{cmd:?} ran over {timeout:?}");
        anyhow::ensure!(!crate::process::interrupted(), "interrupted");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut o) = child.0.stdout.take() {
        std::io::Read::read_to_string(&mut o, &mut out)?;
    }
    if let Some(mut e) = child.0.stderr.take() {
        std::io::Read::read_to_string(&mut e, &mut err)?;
    }
    anyhow::ensure!(
        status.success() && out.contains("verified=yes"),
        "{cmd:?}: {status}: {out}{err}"
    );
    Ok(out)
}

/// The workload line's figures merged into `base`; `seconds` is the whole run.
fn figures(line: &str, mut base: Value) -> anyhow::Result<Value> {
    for key in ["total_seconds", "us_per_op", "ops", "fill_seconds"] {
        if let Some(x) = figure(line, key) {
            base[key] = json!(x);
        }
    }
    base["seconds"] = base["total_seconds"].clone();
    anyhow::ensure!(base["seconds"].is_number(), "no total_seconds in {line:?}");
    Ok(base)
}

/// Runs `f` with the servers it starts on one CPU and, once it calls `to_client`, itself and
/// the threads it starts (the region's handler) on another: client and servers apart as `bench
/// core` places them, the handler beside the faulting thread as the kernel's own fault
/// handling would be. Left to the scheduler, threads sometimes share a vCPU (a cheap local
/// switch) and sometimes not (an idle exit), and whole runs differ by that.
fn placed<R>(f: impl FnOnce(&dyn Fn()) -> R) -> R {
    let placement = crate::Placement::choose();
    let prev = placement.and_then(|p| crate::pin_to(p.server_cpu));
    let to_client = move || {
        if let Some(p) = placement {
            crate::pin_to(p.client_cpu);
        }
    };
    let r = f(&to_client);
    crate::restore_affinity(prev);
    r
}

/// p50 of zero-fill faults on a fresh region: the handler round trip with no I/O.
fn local_fault_latency(n: usize) -> anyhow::Result<Summary> {
    placed(|to_client| local_fault_latency_placed(n, to_client))
}

fn local_fault_latency_placed(n: usize, to_client: &dyn Fn()) -> anyhow::Result<Summary> {
    let t = TcpTransport::connect::<&str>(&[], &ClientConfig::new());
    let cfg = PagerConfig {
        pages: n as u64,
        backing: Backing::Disk,
        cache_pages: 0,
        ..Default::default()
    };
    to_client();
    let r = Region::new(
        Pager::new(cfg, t, MemDisk::default()),
        n * PAGE_SIZE,
        n * PAGE_SIZE,
    )?;
    let mut samples = Vec::with_capacity(n);
    for p in 0..n {
        let at = r.as_ptr().wrapping_add(p * PAGE_SIZE);
        let t0 = Instant::now();
        // SAFETY: a page of the region, which lives until the end of this function.
        std::hint::black_box(unsafe { std::ptr::read_volatile(at) });
        samples.push(t0.elapsed().as_nanos() as u64);
    }
    Ok(Summary::of_ns(&mut samples[n / 10..]))
}

/// A region of `pages` pages with `budget` of them local, paged to the servers at `addrs`,
/// every page written (its first byte: its number plus one, as the readers check) and flushed
/// out: from here on a page not resident is fetched.
fn region_on_servers(
    addrs: &[String],
    low_latency: bool,
    pages: usize,
    budget: usize,
    options: RegionOptions,
) -> anyhow::Result<Region<TcpTransport, MemDisk>> {
    let client = ClientConfig {
        security: crate::security()?,
        low_latency,
        ..ClientConfig::new()
    };
    let t = TcpTransport::connect(addrs, &client);
    let cfg = PagerConfig {
        pages: pages as u64,
        cache_pages: 32,
        ..Default::default()
    };
    let mut r = Region::with_options(
        Pager::new(cfg, t, MemDisk::default()),
        pages * PAGE_SIZE,
        budget * PAGE_SIZE,
        options,
    )?;
    for (p, page) in r.as_mut_slice().chunks_exact_mut(PAGE_SIZE).enumerate() {
        page[..8].copy_from_slice(&(p as u64 + 1).to_le_bytes());
    }
    r.with_pager(|p| p.flush())?;
    Ok(r)
}

/// Faults on random pages of a region whose pages all live on `servers` page servers: each is
/// a fetch (no prefetching: no trend; no sampling: every fault is a miss).
///
/// The servers are `netram serve` processes, as in a cluster: in-process servers would share
/// the region's address space, and every page leaving the region's page tables would then
/// interrupt their CPU for a TLB shootdown. They all run on one CPU (see [`placed`]), where a
/// cluster gives each its own machine: the figure against the raw round trip is taken with one,
/// as the raw round trip has one peer. With three that poll in the low-latency mode, each spins
/// for a while after its request on the CPU the next request's server needs (measured on the
/// 2-vCPU VM, 2026-11-30: p50 35 µs against 23 µs with one; without polling, no difference).
fn remote_fault_latency(
    exe: &Path,
    low_latency: bool,
    n: usize,
    servers: usize,
) -> anyhow::Result<Summary> {
    placed(|to_client| {
        let (servers, list) = start_n_servers(exe, "64M", low_latency, servers)?;
        let addrs: Vec<String> = list.split(',').map(str::to_owned).collect();
        let r = remote_fault_latency_placed(&addrs, low_latency, n, to_client);
        drop(servers);
        r
    })
}

fn remote_fault_latency_placed(
    addrs: &[String],
    low_latency: bool,
    n: usize,
    to_client: &dyn Fn(),
) -> anyhow::Result<Summary> {
    let pages = 8192usize;
    to_client();
    let r = region_on_servers(
        addrs,
        low_latency,
        pages,
        64,
        RegionOptions {
            max_samples: 0,
            // As `netram run --low-latency` sets it.
            spin: if low_latency {
                Duration::from_micros(50)
            } else {
                Duration::ZERO
            },
            ..Default::default()
        },
    )?;
    let mut rng = fastrand::Rng::with_seed(11);
    let mut samples = Vec::with_capacity(n);
    for i in 0..n + 200 {
        let p = rng.usize(..pages);
        let at = r.as_ptr().wrapping_add(p * PAGE_SIZE);
        let t0 = Instant::now();
        // SAFETY: a page of the region, alive for this function.
        let v = unsafe { std::ptr::read_volatile(at) };
        let dt = t0.elapsed().as_nanos() as u64;
        anyhow::ensure!(v == (p as u64 + 1) as u8, "page {p} read back wrong");
        if i >= 200 {
            samples.push(dt);
        }
    }
    Ok(Summary::of_ns(&mut samples))
}

/// Faults per second of 1, 2, 4 and 8 threads faulting together on disjoint random pages of
/// one region with a quarter of it local, every page on the servers first and every read
/// checked (issue 38's `threads` workload: what one handler serving one fault at a time
/// allows; the target is 4 threads at twice one thread's rate). Not pinned: the threads, the
/// handler and the servers share the machine's CPUs as a program's would.
fn threaded_faults(exe: &Path, quick: bool) -> anyhow::Result<BTreeMap<String, f64>> {
    let pages: usize = if quick { 8192 } else { 32768 };
    let secs = if quick { 2.0 } else { 5.0 };
    let (servers, list) = start_servers(exe, if quick { "64M" } else { "256M" }, false)?;
    let addrs: Vec<String> = list.split(',').map(str::to_owned).collect();
    let r = region_on_servers(&addrs, false, pages, pages / 4, RegionOptions::default())?;
    let base = r.as_ptr() as usize;
    let mut rates = BTreeMap::new();
    for threads in [1usize, 2, 4, 8] {
        let faults_before = r.counters().faults.load(Ordering::Relaxed);
        let started = Instant::now();
        let deadline = started + Duration::from_secs_f64(secs);
        let wrong = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|i| {
                    s.spawn(move || {
                        let mut rng = fastrand::Rng::with_seed(7 + i as u64);
                        let mut wrong = 0u64;
                        while Instant::now() < deadline {
                            // Thread i's pages: i, i + threads, i + 2 threads, ...
                            let p = rng.usize(..pages / threads) * threads + i;
                            let at = (base + p * PAGE_SIZE) as *const u8;
                            // SAFETY: a page of the region, which outlives this scope.
                            let v = unsafe { std::ptr::read_volatile(at) };
                            if v != (p as u64 + 1) as u8 {
                                wrong += 1;
                            }
                        }
                        wrong
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(1))
                .sum::<u64>()
        });
        let elapsed = started.elapsed().as_secs_f64();
        anyhow::ensure!(
            wrong == 0,
            "{threads} threads: {wrong} pages read back wrong"
        );
        let faults = r.counters().faults.load(Ordering::Relaxed) - faults_before;
        rates.insert(threads.to_string(), faults as f64 / elapsed);
    }
    drop(r);
    drop(servers);
    Ok(rates)
}

pub fn run(opts: &Options) -> anyhow::Result<crate::Outcome> {
    crate::process::catch_interrupts()?;
    let machine = Machine::describe();
    eprintln!("bench uffd on {}", machine.one_line());
    let w = opts
        .working_set
        .unwrap_or(if opts.quick { 32 << 20 } else { 256 << 20 });
    let n = if opts.quick { 2_000 } else { 10_000 };
    let (mut skipped, mut failed) = (Vec::new(), Vec::new());

    eprintln!("latencies: raw loopback round trip ...");
    let (raw, raw_fast) = raw_rtts(n)?;
    eprintln!("latencies: userfaultfd fault served locally ...");
    let local = local_fault_latency(n)?;
    let qos = PmQos::hold();
    let pm_qos_held = qos.is_some();
    let local_fast = local_fault_latency(n)?;
    drop(qos);
    eprintln!("threads: 1, 2, 4, 8 threads faulting at 25 % local ...");
    let threads = match threaded_faults(&opts.netram_exe, opts.quick) {
        Ok(t) => Some(t),
        Err(e) => {
            failed.push(format!("threads: {e:#}"));
            None
        }
    };
    eprintln!("latencies: remote faults ...");
    let remote = remote_fault_latency(&opts.netram_exe, false, n, 1)?;
    let qos = PmQos::hold();
    let remote_fast = remote_fault_latency(&opts.netram_exe, true, n, 1)?;
    let remote_fast_3 = remote_fault_latency(&opts.netram_exe, true, n, 3)?;

    // The workloads, all in the low-latency mode (the PM QoS request is still held).
    let scratch = tempfile_dir("netram-bench-uffd")?;
    let dir = scratch.path().to_path_buf();
    let capacity = (w + (64 << 20)).to_string();
    let (servers, list) = start_servers(&opts.netram_exe, &capacity, true)?;
    let ctx = Ctx {
        exe: opts.netram_exe.clone(),
        working_set: w,
        servers: list,
        low_latency: true,
        dir: dir.clone(),
    };
    let mut workloads: BTreeMap<&str, BTreeMap<&str, Value>> = BTreeMap::new();
    for workload in ["random", "qsort"] {
        let args = workload_args(workload, w, 42);
        for way in Way::ALL {
            if let Some(why) = way.unavailable() {
                skipped.push(format!("{workload}.{}: {why}", way.key()));
                continue;
            }
            eprintln!("workloads: {workload} {} ...", way.key());
            match run_way(&ctx, way, &args) {
                Ok(v) => {
                    workloads.entry(workload).or_default().insert(way.key(), v);
                }
                // Stop at once, the guards undoing what was set up.
                Err(_) if crate::process::interrupted() => anyhow::bail!("interrupted"),
                // The kernel's swap could not run it in any size tried: its result, said in
                // the report; netram's ratios against it are not given.
                Err(e) if e.downcast_ref::<OomKilled>().is_some() => {
                    workloads
                        .entry(workload)
                        .or_default()
                        .insert(way.key(), json!({ "oom_killed": format!("{e:#}") }));
                }
                Err(e) => failed.push(format!("{workload}.{}: {e:#}", way.key())),
            }
        }
    }
    drop(servers);
    drop(qos);

    let g = |wl: &str, way: &str, k: &str| workloads.get(wl)?.get(way)?.get(k)?.as_f64();
    let prefetch_hit_rate = match (
        g("qsort", "netram", "prefetch_hits"),
        g("qsort", "netram", "prefetched"),
    ) {
        (Some(h), Some(p)) if p > 0.0 => Some(h / p),
        _ => None,
    };
    let mut targets: Vec<Target> = vec![target(
        "remote_fault_fast_p50 / (raw_rtt_fast_p50 + uffd_local_fault_fast_p50)",
        remote_fast.p50_us / (raw_fast.p50_us + local_fast.p50_us),
        1.2,
        "le",
    )];
    for wl in ["random", "qsort"] {
        if let (Some(n), Some(d)) = (g(wl, "netram", "seconds"), g(wl, "swap_disk", "seconds")) {
            let name = if wl == "random" {
                "workloads.random: netram / swap_disk"
            } else {
                "workloads.qsort: netram / swap_disk"
            };
            targets.push(target(name, n / d, 0.5, "le"));
        }
    }
    if let (Some(n), Some(l)) = (
        g("qsort", "netram", "seconds"),
        g("qsort", "local", "seconds"),
    ) {
        targets.push(target("workloads.qsort: netram / local", n / l, 3.0, "le"));
    }
    if let Some(rate) = prefetch_hit_rate {
        targets.push(target("prefetch_hit_rate (qsort)", rate, 0.8, "ge"));
    }
    if let Some((four, one)) = threads
        .as_ref()
        .and_then(|t| Some((t.get("4")?, t.get("1")?)))
    {
        targets.push(target(
            "threads: faults/s with 4 threads / with 1",
            four / one,
            2.0,
            "ge",
        ));
    }
    let result = json!({
        "machine": machine,
        "quick": opts.quick,
        "working_set_bytes": w,
        "local_memory_bytes": w / 4,
        "pm_qos_held": pm_qos_held,
        "uffd_local_fault_p50_us": local.p50_us,
        "uffd_local_fault_fast_p50_us": local_fast.p50_us,
        "raw_rtt_p50_us": raw.p50_us,
        "raw_rtt_fast_p50_us": raw_fast.p50_us,
        "remote_fault_p50_us": remote.p50_us,
        "remote_fault_p99_us": remote.p99_us,
        "remote_fault_fast_p50_us": remote_fast.p50_us,
        "remote_fault_fast_p99_us": remote_fast.p99_us,
        "remote_fault_fast_3_servers_p50_us": remote_fast_3.p50_us,
        "workloads": workloads,
        "faults_per_s_threads": threads,
        "prefetch_hit_rate": prefetch_hit_rate,
        "targets": targets,
        "skipped": skipped,
        "failed": failed,
    });
    crate::write_json(&opts.out, "uffd.json", &result)?;
    let plotted = plot_ways(&result["workloads"], &opts.out.join("uffd.svg"));
    if let Err(e) = &plotted {
        skipped.push(format!("plot: {e}"));
    }
    let md = markdown(&result, &targets, &skipped, &failed);
    std::fs::write(opts.out.join("uffd.md"), &md)?;
    Ok(crate::Outcome { report: md, failed })
}

/// Seconds per way, one panel per workload, on a log scale (netram's ways in blue).
pub fn plot_ways(workloads: &Value, path: &Path) -> anyhow::Result<()> {
    let panels: Vec<Panel> = ["random", "qsort"]
        .into_iter()
        .map(|wl| {
            let bars = Way::ALL
                .iter()
                .filter_map(|w| {
                    let v = workloads[wl][w.key()]["seconds"].as_f64()?;
                    Some((w.key().to_string(), v))
                })
                .collect();
            (
                format!("workload {wl}"),
                "seconds (log scale)".to_string(),
                bars,
            )
        })
        .collect();
    plot_panels(
        "bench uffd: seconds per way (lower is better; netram's ways in blue)",
        &panels,
        path,
    )
}

/// A panel's caption, its y axis's description, and its bars: a name (netram's start with
/// "netram", drawn in blue) and a value.
pub type Panel = (String, String, Vec<(String, f64)>);

/// Bar charts in a grid (three to a row) under `title`, on a log scale, each bar labelled with
/// its value and its name beneath it; bars without a positive value are left out, and so are
/// panels without bars.
pub fn plot_panels(title: &str, panels: &[Panel], path: &Path) -> anyhow::Result<()> {
    use plotters::prelude::*;
    /// Bars of one panel: position, name, value.
    type Bars<'a> = Vec<(usize, &'a str, f64)>;
    let panels: Vec<(&str, &str, Bars)> = panels
        .iter()
        .map(|(caption, unit, bars)| {
            let bars = bars
                .iter()
                .filter(|(_, v)| *v > 0.0)
                .enumerate()
                .map(|(i, (k, v))| (i, k.as_str(), *v))
                .collect();
            (caption.as_str(), unit.as_str(), bars)
        })
        .filter(|(_, _, bars): &(_, _, Vec<_>)| !bars.is_empty())
        .collect();
    anyhow::ensure!(!panels.is_empty(), "no figures to plot");
    // Room for every bar's name written across, under it.
    let most_bars = panels.iter().map(|p| p.2.len()).max().unwrap_or(1) as u32;
    let (panel_w, panel_h) = ((most_bars * 100 + 90).max(380), 340u32);
    let cols = panels.len().min(3);
    let rows = panels.len().div_ceil(cols);
    let root = SVGBackend::new(path, (panel_w * cols as u32, panel_h * rows as u32 + 60))
        .into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 18))?;
    let areas = root.split_evenly((rows, cols));
    for (area, (caption, unit, bars)) in areas.iter().zip(&panels) {
        let lo = bars.iter().map(|b| b.2).fold(f64::INFINITY, f64::min) / 3.0;
        let hi = bars.iter().map(|b| b.2).fold(0.0, f64::max) * 3.0;
        let names: Vec<&str> = bars.iter().map(|b| b.1).collect();
        let mut chart = ChartBuilder::on(area)
            .caption(*caption, ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(-0.5f64..bars.len() as f64 - 0.5, (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_desc(*unit)
            .axis_desc_style(("sans-serif", 12))
            .y_label_formatter(&|y| {
                // 0.7 rather than 0.7000000000000001: at most three decimals, no trailing zeros.
                let t = format!("{y:.3}");
                t.trim_end_matches('0').trim_end_matches('.').to_string()
            })
            .x_labels(bars.len())
            .x_label_formatter(&|x| {
                let i = x.round();
                if (x - i).abs() < 0.01 && i >= 0.0 {
                    names.get(i as usize).copied().unwrap_or("").to_string()
                } else {
                    String::new()
                }
            })
            .x_label_style(("sans-serif", 12))
            .draw()?;
        chart.draw_series(bars.iter().map(|&(i, k, v)| {
            let color = if k.starts_with("netram") {
                BLUE
            } else {
                RGBColor(150, 150, 150)
            };
            Rectangle::new(
                [(i as f64 - 0.35, lo), (i as f64 + 0.35, v)],
                color.filled(),
            )
        }))?;
        // Each bar's value above it: a log axis alone is hard to read off.
        let suffix = if unit.starts_with("seconds") {
            " s"
        } else {
            ""
        };
        chart.draw_series(bars.iter().map(|&(i, _, v)| {
            let text = if v >= 10.0 {
                format!("{v:.0}{suffix}")
            } else if v >= 1.0 {
                format!("{v:.1}{suffix}")
            } else {
                format!("{v:.2}{suffix}")
            };
            Text::new(
                text,
                (i as f64 - 0.3, v * 1.25),
                ("sans-serif", 12).into_font(),
            )
        }))?;
    }
    root.present()?;
    Ok(())
}

/// The workloads' table in markdown: seconds per way, and the ratio to all-local.
pub fn workloads_table(workloads: &Value) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| workload | way | seconds | × local | µs per op | faults | fetched on a fault | mapped ahead | sampled back | prefetch hits |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    let mut killed = Vec::new();
    for wl in ["random", "qsort"] {
        let local = workloads[wl]["local"]["seconds"].as_f64();
        for way in Way::ALL {
            let v = &workloads[wl][way.key()];
            if let Some(why) = v["oom_killed"].as_str() {
                killed.push(format!("{wl} {}: {why}", way.key()));
            }
            let Some(secs) = v["seconds"].as_f64() else {
                continue;
            };
            let n = |k: &str| v[k].as_u64().map_or("–".to_string(), |x| x.to_string());
            let _ = writeln!(
                s,
                "| {wl} | {} | {secs:.2} | {} | {} | {} | {} | {} | {} | {} |",
                way.key(),
                local.map_or("–".into(), |l| format!("{:.1}", secs / l)),
                v["us_per_op"]
                    .as_f64()
                    .map_or("–".into(), |x| format!("{x:.1}")),
                n("faults"),
                n("fetches"),
                n("prefetch_installed"),
                n("sample_faults"),
                match (v["prefetch_hits"].as_u64(), v["prefetched"].as_u64()) {
                    (Some(h), Some(p)) => format!("{h}/{p}"),
                    _ => "–".into(),
                },
            );
        }
    }
    if !killed.is_empty() {
        let _ = writeln!(
            s,
            "\nThe kernel's swap could not run (no figure, no ratio against it):\n"
        );
        for k in killed {
            let _ = writeln!(s, "- {k}");
        }
    }
    s
}

fn markdown(r: &Value, targets: &[Target], skipped: &[String], failed: &[String]) -> String {
    let mut s = String::new();
    let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let _ = writeln!(s, "# netram bench uffd\n");
    let _ = writeln!(
        s,
        "Machine: {} · {} · {} CPUs · {} MiB · kernel {}{}\n",
        r["machine"]["hostname"].as_str().unwrap_or("?"),
        r["machine"]["date_utc"].as_str().unwrap_or("?"),
        r["machine"]["cpus"],
        r["machine"]["mem_total_kib"].as_u64().unwrap_or(0) / 1024,
        r["machine"]["kernel"].as_str().unwrap_or("?"),
        if r["quick"].as_bool() == Some(true) {
            " · quick run"
        } else {
            ""
        },
    );
    let _ = writeln!(s, "## Latencies (p50, µs; fast: PM QoS held, polling)\n");
    let _ = writeln!(s, "| | plain | fast |\n|---|---|---|");
    let _ = writeln!(
        s,
        "| userfaultfd fault served locally (zero fill) | {:.1} | {:.1} |",
        f("uffd_local_fault_p50_us"),
        f("uffd_local_fault_fast_p50_us")
    );
    let _ = writeln!(
        s,
        "| raw loopback round trip, 4 KiB reply | {:.1} | {:.1} |",
        f("raw_rtt_p50_us"),
        f("raw_rtt_fast_p50_us")
    );
    let _ = writeln!(
        s,
        "| netram remote fault (p99) | {:.1} ({:.1}) | {:.1} ({:.1}) |\n",
        f("remote_fault_p50_us"),
        f("remote_fault_p99_us"),
        f("remote_fault_fast_p50_us"),
        f("remote_fault_fast_p99_us")
    );
    let _ = writeln!(
        s,
        "The remote fault is served by one `netram serve`, as the raw round trip has one peer. \
         With three polling servers on the one CPU they get, the fast p50 is {:.1} µs: each \
         spins after its request on the CPU the next request's server needs (in a cluster each \
         has its own machine).\n",
        f("remote_fault_fast_3_servers_p50_us")
    );
    let _ = writeln!(
        s,
        "## Workloads, working set {} MiB, {} MiB local, low-latency mode\n",
        r["working_set_bytes"].as_u64().unwrap_or(0) >> 20,
        r["local_memory_bytes"].as_u64().unwrap_or(0) >> 20
    );
    s.push_str(&workloads_table(&r["workloads"]));
    if let Some(t) = r["faults_per_s_threads"].as_object() {
        let _ = writeln!(
            s,
            "\n## Threads faulting together (disjoint random pages, 25 % local, every read \
             checked)\n\n| threads | faults/s | × one thread |\n|---|---|---|"
        );
        let one = t.get("1").and_then(Value::as_f64).unwrap_or(f64::NAN);
        let mut rows: Vec<(u64, f64)> = t
            .iter()
            .filter_map(|(k, v)| Some((k.parse().ok()?, v.as_f64()?)))
            .collect();
        rows.sort_by_key(|r| r.0);
        for (n, rate) in rows {
            let _ = writeln!(s, "| {n} | {rate:.0} | {:.2} |", rate / one);
        }
    }
    let _ = writeln!(
        s,
        "\n`seconds` is the workload's whole run: filling its memory, the work, verifying. \
         `netram_clock` is `netram run` with CLOCK over sampled accesses (`NETRAM_SAMPLES=8`; \
         by default victims go first in, first out). \
         Of the pages fetched ahead, three in four are mapped at once (`mapped ahead`: no \
         fault) and one in four is left to be faulted on; the prefetcher's hit rate is measured \
         on those. Prefetcher hit rate on the quicksort: {}.\n",
        r["prefetch_hit_rate"]
            .as_f64()
            .map_or("–".into(), |x| format!("{x:.3}"))
    );
    let _ = writeln!(
        s,
        "## Targets\n\n| target | ratio | limit | met |\n|---|---|---|---|"
    );
    s += &crate::target_rows(targets);
    s += &crate::failed_section(failed);
    if !skipped.is_empty() {
        let _ = writeln!(s, "\nSkipped:\n");
        for k in skipped {
            let _ = writeln!(s, "- {k}");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_baseline_killed_at_every_size_is_reported_without_a_figure() {
        let e: anyhow::Error = OomKilled {
            sizes: vec![9 << 20, 13 << 20],
        }
        .into();
        assert!(e.downcast_ref::<OomKilled>().is_some());
        let workloads = json!({
            "qsort": {
                "local": { "seconds": 0.15 },
                "zram": { "oom_killed": format!("{e:#}") },
            }
        });
        let table = workloads_table(&workloads);
        assert!(table.contains("| qsort | local | 0.15 |"), "{table}");
        assert!(!table.contains("| qsort | zram |"), "{table}");
        assert!(
            table.contains("- qsort zram: OOM-killed (SIGKILL) by the memory cgroup at every size tried: 9, 13 MiB"),
            "{table}"
        );
    }
}
