//! `netram bench adapt`: donors that give their memory back (Nswap §III) and what that costs
//! the programs paging to them, measured in one run against real `netram serve --adapt`
//! processes on loopback.
//!
//! Each daemon reads its machine from a stand-in /proc directory the bench writes (the
//! daemon's hidden `--proc-dir`), so that the bench decides when a machine needs its memory;
//! the daemons' controller, migration and memory given back are the real ones.
//!
//! * **Migration**: a client's pages (1 GiB; 64 MiB with `--quick`) all on donor D, another
//!   donor B with room; D's machine needs its memory, its offer falls to nothing, and the
//!   client's maintenance thread moves every page to B. Measured: pages migrated per second
//!   (from the first move to the last), how long until D's resident memory fell by what it
//!   held, and the same client's depth-1 read latency while the pages move against before
//!   (the client reads its own pages throughout, every page checked).
//! * **GMS §5.4's role swap**: every X seconds the donor holding the pages needs its memory
//!   and the other has room again, X from 1 s to 30 s; the paging program's (depth-1 random
//!   reads and writes) rate against a static cluster, side by side.
//!
//! Writes `adapt.json` and `adapt.md`.

use crate::machine::Machine;
use crate::process::ChildGuard;
use crate::{page_content, target, Summary, Target};
use netram_client::disk::FileDisk;
use netram_client::maintain::{self, MaintainConfig};
use netram_client::open::{open_pager, ClientPager, OpenOptions};
use netram_client::query_stats;
use netram_client::{SharedPager, TcpTransport};
use netram_pager::{Backing, PagerCounters, Scheme};
use netram_proto::PAGE_SIZE;
use netram_uffd::{Region, RegionOptions, Upkeep};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Options {
    pub quick: bool,
    /// Not the role swaps.
    pub migration_only: bool,
    pub out: PathBuf,
    pub netram_exe: PathBuf,
}

const MIB: u64 = 1 << 20;
/// What the stand-in machines report: 24 GiB, of which this much is available when the
/// machine has room, and this much when its programs need their memory (below the reserve).
const TOTAL: u64 = 24 << 30;
const ROOMY: u64 = 20 << 30;
const SHORT: u64 = 512 * MIB;

/// Pages written with this seed: every read checks its page against it.
const SEED: u64 = 20;

/// One `netram serve --adapt` and the stand-in /proc it reads.
struct Donor {
    child: ChildGuard,
    addr: String,
    proc_dir: PathBuf,
}

impl Donor {
    /// `node`: its node id (two daemons under one identity would be one member); `seed`: a
    /// daemon whose cluster it joins (a server hands pages over only to a member of its own).
    fn start(
        exe: &Path,
        capacity: u64,
        proc_dir: PathBuf,
        available: u64,
        node: u64,
        seed: Option<&str>,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(proc_dir.join("pressure"))?;
        set_machine(&proc_dir, available)?;
        let capacity = format!("{}M", capacity / MIB);
        let mut extra: Vec<String> = Vec::new();
        if let Some(cluster) = std::env::var_os("NETRAM_TLS").map(PathBuf::from) {
            // The run's cluster (`crate::install_credentials`, or the user's own with its CA
            // key): this daemon's own credentials beside its stand-in /proc.
            let dir = proc_dir.join("tls");
            let spec = netram_net::pki::NodeSpec {
                node,
                server: true,
                ..Default::default()
            };
            netram_net::pki::issue_node(&cluster, &spec, &dir).map_err(|e| {
                anyhow::anyhow!(
                    "bench adapt issues its daemons' credentials from {}: {e}",
                    cluster.display()
                )
            })?;
            extra.extend(["--tls".into(), dir.to_string_lossy().into_owned()]);
        }
        if let Some(seed) = seed {
            extra.extend(["--seed".into(), seed.to_string()]);
        }
        // Both of the bench's clients connect from 127.0.0.1, which the per-client quota
        // (3/4 of the capacity by default) takes for one client: the bystander's pages on B
        // would leave no room there for the last of the owner's, which would go to the
        // owner's disk through the owner. On a real cluster they are two machines.
        let (child, addr) = ChildGuard::netram(
            exe,
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--capacity",
                &capacity,
                "--max-client-memory",
                &capacity,
                "--adapt",
                "--reserve",
                "1G",
                "--chunk",
                "256M",
                "--grow-after",
                "100ms",
                "--proc-dir",
                proc_dir.to_str().unwrap_or_default(),
            ]
            .into_iter()
            .chain(extra.iter().map(String::as_str))
            .collect::<Vec<_>>(),
            "netram serve: listening on ",
        )?;
        Ok(Self {
            child,
            addr,
            proc_dir,
        })
    }

    fn set_available(&self, bytes: u64) -> anyhow::Result<()> {
        set_machine(&self.proc_dir, bytes)
    }

    fn stat(&self, name: &str) -> anyhow::Result<u64> {
        let stats = query_stats(&self.addr, Duration::from_secs(5), &crate::security()?)?;
        Ok(stats.iter().find(|(k, _)| k == name).map_or(0, |(_, v)| *v))
    }

    /// The daemon's resident memory, bytes (`/proc/PID/statm`: cheaper than `status`, which formats every
    /// field of the process for the one wanted).
    fn rss(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/statm", self.child.pid()))
            .ok()
            .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map_or(0, |pages| pages * rustix::param::page_size() as u64)
    }

    /// Waits until the daemon offers at least `pages` frames (or exactly none, for 0).
    fn wait_offer(&self, pages: u64, within: Duration) -> anyhow::Result<()> {
        let t = Instant::now();
        loop {
            let offered = self.stat("capacity_pages")?;
            if (pages == 0 && offered == 0) || (pages > 0 && offered >= pages) {
                return Ok(());
            }
            anyhow::ensure!(
                t.elapsed() < within,
                "{}: offers {offered} frames, not {pages}, after {within:?}",
                self.addr
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Writes a stand-in /proc: `meminfo` (written whole, then renamed: the daemon never reads
/// half a file) and no memory pressure.
fn set_machine(dir: &Path, available: u64) -> anyhow::Result<()> {
    let kb = |b: u64| b / 1024;
    let tmp = dir.join("meminfo.tmp");
    std::fs::write(
        &tmp,
        format!(
            "MemTotal:       {} kB\nMemFree:        {} kB\nMemAvailable:   {} kB\n",
            kb(TOTAL),
            kb(available),
            kb(available)
        ),
    )?;
    std::fs::rename(&tmp, dir.join("meminfo"))?;
    std::fs::write(
        dir.join("pressure/memory"),
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n\
         full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    )?;
    Ok(())
}

/// The paging client's pager: shared with its maintenance thread, as `netram nbd`'s is.
type Shared = SharedPager<TcpTransport, FileDisk>;

/// Whoever owns the pages that move and reads them meanwhile: a pager shared by threads (as
/// `netram nbd` shares it: a read lets the lock go while its replies travel), its schedule
/// ticked by the maintenance thread; or a region, whose faults fetch them (`netram run`, the
/// C ABI).
trait Owner {
    /// One depth-1 read of a random page, checked: its latency in ns, and the pager's moves
    /// started and landed and its pages leaving, read right after.
    fn read_one(
        &self,
        pages: u64,
        rng: &mut fastrand::Rng,
        buf: &mut Vec<u8>,
        want: &mut [u8],
    ) -> anyhow::Result<(u64, u64, u64, u64)>;

    fn counters(&self) -> PagerCounters;
}

/// A move ends landed or refused (the page stays and is moved again).
fn moves(p: &ClientPager) -> (u64, u64, u64) {
    let c = p.counters();
    (
        c.migrations_started,
        c.pages_migrated + c.migrations_refused,
        p.pages_leaving(),
    )
}

impl Owner for Shared {
    fn read_one(
        &self,
        pages: u64,
        rng: &mut fastrand::Rng,
        buf: &mut Vec<u8>,
        want: &mut [u8],
    ) -> anyhow::Result<(u64, u64, u64, u64)> {
        let pg = rng.u64(0..pages);
        let t = Instant::now();
        self.read_pages(&[pg], buf)?;
        let ns = t.elapsed().as_nanos() as u64;
        let (started, landed, leaving) = moves(&self.lock());
        page_content(SEED, pg, want);
        anyhow::ensure!(buf[..] == want[..], "page {pg} read back wrong");
        Ok((ns, started, landed, leaving))
    }

    fn counters(&self) -> PagerCounters {
        self.lock().counters().clone()
    }
}

impl Owner for Region<TcpTransport, FileDisk> {
    fn read_one(
        &self,
        pages: u64,
        rng: &mut fastrand::Rng,
        _buf: &mut Vec<u8>,
        want: &mut [u8],
    ) -> anyhow::Result<(u64, u64, u64, u64)> {
        let pg = rng.u64(0..pages);
        let at = self.as_ptr().wrapping_add(pg as usize * PAGE_SIZE);
        let t = Instant::now();
        // SAFETY: the first byte of a page of the region, which lives as long as `self`: the
        // access that faults the page in if it is not resident.
        let first = unsafe { std::ptr::read_volatile(at) };
        let ns = t.elapsed().as_nanos() as u64;
        let (started, landed, leaving) = self.with_pager(|p| moves(p));
        page_content(SEED, pg, want);
        let page = &self.as_slice()[pg as usize * PAGE_SIZE..][..PAGE_SIZE];
        anyhow::ensure!(
            first == want[0] && page == want,
            "page {pg} of the region read back wrong"
        );
        Ok((ns, started, landed, leaving))
    }

    fn counters(&self) -> PagerCounters {
        self.with_pager(|p| p.counters().clone())
    }
}

#[derive(Debug, Default, Serialize)]
pub struct Migration {
    /// Pages the client held on the donor when it shrank.
    pub pages: u64,
    pub pages_migrated: u64,
    pub pages_migrated_to_disk: u64,
    /// Of those, pages that went server to server (Nswap's MIGRATE), not through the client.
    pub pages_migrated_direct: u64,
    /// Moves that ended without moving their page (refused: the page was moved again).
    pub migrations_refused: u64,
    /// Pages moved per second, from the first move started to the last landed.
    pub migration_pages_per_s: f64,
    /// From the donor's machine needing its memory to the client's first move (the daemon's
    /// tick, then the next reply or probe telling the client).
    pub until_first_move_s: f64,
    /// From the donor's machine needing its memory to its resident memory having fallen by
    /// nine tenths of what its pages took.
    pub give_back_s: f64,
    pub donor_rss_before_mib: f64,
    pub donor_rss_after_mib: f64,
    /// The client's own depth-1 reads of its pages, before the shrink and while they moved.
    /// Its reads wait for whatever its pager has in flight, migration's included.
    pub client_p50_without_migration_us: f64,
    pub client_p99_without_migration_us: f64,
    pub client_p50_during_migration_us: f64,
    pub client_p99_during_migration_us: f64,
    pub reads_without: usize,
    pub reads_during: usize,
    /// Another client, paging to the server the pages move to (its own pages, none of them
    /// moving), reading at depth 1 in another thread: the same two periods.
    pub bystander_p50_without_migration_us: f64,
    pub bystander_p99_without_migration_us: f64,
    pub bystander_p50_during_migration_us: f64,
    pub bystander_p99_during_migration_us: f64,
}

#[derive(Debug, Default, Serialize)]
pub struct Swap {
    pub every_s: f64,
    /// The paging program's operations per second, roles swapping, and on the same two
    /// donors left alone, in the same run.
    pub ops_per_s_swapping: f64,
    pub ops_per_s_static: f64,
    /// 1 − swapping / static.
    pub slowdown: f64,
    pub swaps: u32,
    pub pages_migrated: u64,
    pub pages_migrated_to_disk: u64,
}

#[derive(Debug, Serialize)]
pub struct AdaptResult {
    pub machine: Machine,
    pub quick: bool,
    pub migration_pages_per_s: f64,
    pub client_p99_during_migration_us: f64,
    pub client_p99_without_migration_us: f64,
    /// Server to server (Nswap's MIGRATE): D → B.
    pub migration: Migration,
    /// The same pages back, B → D, moved by their owner itself (C → A → B), side by side.
    pub migration_through_client: Migration,
    /// A region's pages moved (`netram run`'s front end), its pager's schedule run by its
    /// handler between faults or by a maintenance thread, alternately, in the same run.
    pub region_migrations: Vec<RegionMigration>,
    /// Handler over thread, means of their two runs each.
    pub region_handler_over_thread_pages_per_s: f64,
    pub region_handler_over_thread_p99_during: f64,
    pub swaps: Vec<Swap>,
    pub targets: Vec<Target>,
}

/// How often the donor's resident memory is looked at while its pages move.
const RSS_EVERY: Duration = Duration::from_millis(5);

/// How often the donor is asked whether it holds pages still, once the owner has nothing left
/// to move (a query over a connection of its own: not after every read).
const DONE_EVERY: Duration = Duration::from_millis(20);

/// The bystander's pages.
const BYSTANDER_PAGES: u64 = 8192;

type Seen = Vec<(Instant, u64)>;

/// Another client's depth-1 reads of its own pages on `server` until `stop`: (when, ns).
fn bystander(
    server: &str,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> anyhow::Result<std::thread::JoinHandle<anyhow::Result<Seen>>> {
    let mut p = open_pager(&OpenOptions {
        security: crate::security()?,
        servers: vec![server.to_string()],
        backing: Backing::Cluster,
        pages: BYSTANDER_PAGES,
        cache_pages: 0,
        spill_dir: None,
        low_latency: false,
        redundancy: Scheme::None,
    })?;
    let mut buf = vec![0u8; 64 * PAGE_SIZE];
    for start in (0..BYSTANDER_PAGES).step_by(64) {
        let batch: Vec<u64> = (start..start + 64).collect();
        for (i, &pg) in batch.iter().enumerate() {
            page_content(
                SEED + 1000,
                pg,
                &mut buf[i * PAGE_SIZE..(i + 1) * PAGE_SIZE],
            );
        }
        p.write_many(&batch, &buf)?;
    }
    p.flush()?;
    Ok(std::thread::spawn(move || {
        let mut rng = fastrand::Rng::with_seed(2);
        let (mut one, mut want) = (vec![0u8; PAGE_SIZE], vec![0u8; PAGE_SIZE]);
        let mut out = Vec::new();
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let pg = rng.u64(0..BYSTANDER_PAGES);
            let t = Instant::now();
            p.read(pg, &mut one)?;
            out.push((t, t.elapsed().as_nanos() as u64));
            page_content(SEED + 1000, pg, &mut want);
            anyhow::ensure!(one == want, "the bystander's page {pg} read back wrong");
        }
        p.into_transport().close();
        Ok(out)
    }))
}

/// The migration experiment. Returns the donors with the pages on `b` now.
fn migration(
    pager: &dyn Owner,
    pages: u64,
    d: &Donor,
    b: &Donor,
    phase: Duration,
) -> anyhow::Result<Migration> {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let other = bystander(&b.addr, stop.clone())?;
    let mut r = Migration {
        pages: d.stat("stored_pages")?,
        ..Migration::default()
    };
    anyhow::ensure!(r.pages > 0, "no page on the donor to move off it");
    let mut rng = fastrand::Rng::with_seed(1);
    let (mut buf, mut want) = (vec![0u8; PAGE_SIZE], vec![0u8; PAGE_SIZE]);
    // Before: the client reads its pages, nothing to move.
    let mut without = Vec::new();
    let t = Instant::now();
    let before_start = t;
    while t.elapsed() < phase {
        without.push(pager.read_one(pages, &mut rng, &mut buf, &mut want)?.0);
    }
    let c0 = pager.counters();
    let started0 = c0.migrations_started;
    r.donor_rss_before_mib = d.rss() as f64 / MIB as f64;
    let held_bytes = r.pages * PAGE_SIZE as u64;
    // D's machine needs its memory; the client keeps reading while its pages move.
    let shrink = Instant::now();
    d.set_available(SHORT)?;
    let (mut during, mut first, mut last, mut gave_back) = (Vec::new(), None, None, None);
    let mut rss_checked = Instant::now();
    let mut done_checked: Option<Instant> = None;
    let mut seen_moves = (0, 0, 0);
    while last.is_none() || gave_back.is_none() {
        if shrink.elapsed() >= Duration::from_secs(300) {
            let (started, landed, leaving) = seen_moves;
            anyhow::bail!(
                "the migration did not end within 300 s: the pager's moves since it started: \
                 {started} started, {landed} landed or refused (before the shrink: {started0} \
                 started), {leaving} pages leaving; the donor holds {} pages, its resident \
                 memory {:.1} MiB (it had {:.1} MiB); first move {}, all moved {}, memory \
                 given back {}",
                d.stat("stored_pages")?,
                d.rss() as f64 / MIB as f64,
                r.donor_rss_before_mib,
                if first.is_some() {
                    "seen"
                } else {
                    "never seen"
                },
                if last.is_some() { "yes" } else { "no" },
                if gave_back.is_some() { "yes" } else { "no" },
            );
        }
        let (ns, started, landed, leaving) =
            pager.read_one(pages, &mut rng, &mut buf, &mut want)?;
        seen_moves = (started, landed, leaving);
        if first.is_none() && started > started0 {
            first = Some(Instant::now());
        }
        if first.is_some() && last.is_none() {
            during.push(ns);
            // Nothing the pager knows of is left to move; the donor, asked (at most every
            // `DONE_EVERY`), says whether it holds nothing indeed: its offer falls in steps,
            // and between two steps nothing may be above it with pages still below.
            if leaving == 0
                && landed == started
                && done_checked.is_none_or(|t| t.elapsed() >= DONE_EVERY)
            {
                done_checked = Some(Instant::now());
                if d.stat("stored_pages")? == 0 {
                    last = Some(Instant::now());
                }
            }
        }
        // Looked at every few milliseconds, not after every read: the bench's reads share
        // the CPUs with what they measure.
        if gave_back.is_none() && rss_checked.elapsed() >= RSS_EVERY {
            rss_checked = Instant::now();
            if d.rss() as f64 <= r.donor_rss_before_mib * MIB as f64 - 0.9 * held_bytes as f64 {
                gave_back = Some(shrink.elapsed());
            }
        }
    }
    let (first, last) = (first.expect("set"), last.expect("set"));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = other
        .join()
        .map_err(|_| anyhow::anyhow!("the bystander panicked"))??;
    let window = |from: Instant, to: Instant| -> Vec<u64> {
        seen.iter()
            .filter(|(t, _)| *t >= from && *t <= to)
            .map(|&(_, ns)| ns)
            .collect()
    };
    let bw = Summary::of_ns(&mut window(before_start, shrink));
    let bd = Summary::of_ns(&mut window(first, last));
    r.bystander_p50_without_migration_us = bw.p50_us;
    r.bystander_p99_without_migration_us = bw.p99_us;
    r.bystander_p50_during_migration_us = bd.p50_us;
    r.bystander_p99_during_migration_us = bd.p99_us;
    {
        let c = pager.counters();
        r.pages_migrated = c.pages_migrated - c0.pages_migrated;
        r.pages_migrated_to_disk = c.pages_migrated_to_disk - c0.pages_migrated_to_disk;
        r.pages_migrated_direct = c.pages_migrated_direct - c0.pages_migrated_direct;
        r.migrations_refused = c.migrations_refused - c0.migrations_refused;
    }
    r.migration_pages_per_s = r.pages_migrated as f64 / (last - first).as_secs_f64().max(1e-9);
    r.until_first_move_s = (first - shrink).as_secs_f64();
    r.give_back_s = gave_back.expect("set").as_secs_f64();
    r.donor_rss_after_mib = d.rss() as f64 / MIB as f64;
    let left = d.stat("stored_pages")?;
    anyhow::ensure!(
        left == 0,
        "the donor still holds {left} pages after the migration (the owner's pager: {} moves \
         started, {} landed, {} refused, {} moved to its disk)",
        pager.counters().migrations_started - c0.migrations_started,
        pager.counters().pages_migrated - c0.pages_migrated,
        pager.counters().migrations_refused - c0.migrations_refused,
        pager.counters().pages_migrated_to_disk - c0.pages_migrated_to_disk,
    );
    let w = Summary::of_ns(&mut without);
    let dur = Summary::of_ns(&mut during);
    r.client_p50_without_migration_us = w.p50_us;
    r.client_p99_without_migration_us = w.p99_us;
    r.client_p50_during_migration_us = dur.p50_us;
    r.client_p99_during_migration_us = dur.p99_us;
    r.reads_without = w.samples;
    r.reads_during = dur.samples;
    Ok(r)
}

/// One move of a region's pages off a donor, and who ran the pager's schedule.
#[derive(Debug, Serialize)]
pub struct RegionMigration {
    /// `handler`: the region's handler, between faults (what `netram run` does); `thread`: a
    /// maintenance thread taking the region's lock for each step (what it did before);
    /// `warm-up`: the first move, by a thread, not counted.
    pub schedule_by: &'static str,
    pub from: &'static str,
    pub to: &'static str,
    #[serde(flatten)]
    pub m: Migration,
}

/// The region's pages and its local memory: one in eight pages resident, so that most reads
/// fault and fetch.
fn region_size(quick: bool) -> (u64, u64) {
    let bytes = if quick { 64 * MIB } else { 256 * MIB };
    (bytes / PAGE_SIZE as u64, bytes / PAGE_SIZE as u64 / 8)
}

/// A region's pages moved off a donor five times: once to warm up, then its schedule run
/// alternately by its handler and by a maintenance thread (handler, thread, thread, handler:
/// each direction and each place in the run for both), its faults timed meanwhile. Starts with both donors roomy and
/// no other client's pages on them.
fn region_migrations(
    d: &Donor,
    b: &Donor,
    quick: bool,
    tmp: &Path,
    phase: Duration,
) -> anyhow::Result<Vec<RegionMigration>> {
    let (pages, budget) = region_size(quick);
    // Every page on D: B has no room while they are written, D room for all of them. D may
    // come out of the role swaps short: its offer grows again only after `--grow-after`, and
    // pages written before that went to the owner's disk, leaving nothing on D to move.
    b.set_available(SHORT)?;
    b.wait_offer(0, Duration::from_secs(60))?;
    d.set_available(ROOMY)?;
    d.wait_offer(pages, Duration::from_secs(60))?;
    let p = open_pager(&OpenOptions {
        security: crate::security()?,
        servers: vec![d.addr.clone(), b.addr.clone()],
        backing: Backing::Cluster,
        pages,
        cache_pages: 64,
        spill_dir: Some(tmp.to_path_buf()),
        low_latency: false,
        redundancy: Scheme::None,
    })?;
    let cfg = MaintainConfig {
        probe_every: Duration::from_millis(100),
        ..Default::default()
    };
    let upkeep = Upkeep {
        schedule: cfg.schedule(p.transport().reply_timeout()),
        pacing: cfg.pacing(),
    };
    let mut region = Region::with_options(
        p,
        pages as usize * PAGE_SIZE,
        budget as usize * PAGE_SIZE,
        RegionOptions::default(),
    )?;
    eprintln!(
        "a region of {} MiB ({} MiB local) written to one donor ...",
        pages * PAGE_SIZE as u64 / MIB,
        budget * PAGE_SIZE as u64 / MIB
    );
    for (pg, page) in region
        .as_mut_slice()
        .chunks_exact_mut(PAGE_SIZE)
        .enumerate()
    {
        page_content(SEED, pg as u64, page);
    }
    region.with_pager(|p| p.flush())?;
    // Every page read once, checked: the pages written last, resident and dirty, leave now, so
    // that every run starts alike (resident pages clean, every page on a server).
    let mut want = vec![0u8; PAGE_SIZE];
    for pg in 0..pages {
        page_content(SEED, pg, &mut want);
        anyhow::ensure!(
            region.as_slice()[pg as usize * PAGE_SIZE..][..PAGE_SIZE] == want[..],
            "page {pg} of the region read back wrong before its migrations"
        );
    }
    region.with_pager(|p| p.flush())?;
    let on_d = d.stat("stored_pages")?;
    anyhow::ensure!(
        on_d == pages,
        "{on_d} of the region's {pages} pages are on the donor after they were written, not all"
    );
    let mut out = Vec::new();
    let (mut from, mut to) = (d, b);
    // First a move not counted: the first pages a server adopts fault its arena in, which
    // made whichever came first look slower (p99 2.2x the others' on its first run here).
    let order = [
        (false, true),
        (true, false),
        (false, false),
        (false, false),
        (true, false),
    ];
    for (i, (by_handler, warm_up)) in order.into_iter().enumerate() {
        to.set_available(ROOMY)?;
        to.wait_offer(pages, Duration::from_secs(60))?;
        let thread = if by_handler {
            region.set_upkeep(Some(upkeep));
            None
        } else {
            region.set_upkeep(None);
            let handle = region.pager_handle();
            Some(maintain::spawn(move |f| handle.with(|p| f(p)), cfg))
        };
        let by = match (warm_up, by_handler) {
            (true, _) => "warm-up",
            (false, true) => "handler",
            (false, false) => "thread",
        };
        eprintln!(
            "region migration {} of {}, schedule run by its {} ...",
            i + 1,
            order.len(),
            if by_handler { "handler" } else { "thread" },
        );
        let m = migration(&region, pages, from, to, phase)?;
        drop(thread);
        out.push(RegionMigration {
            schedule_by: by,
            from: if i % 2 == 0 { "D" } else { "B" },
            to: if i % 2 == 0 { "B" } else { "D" },
            m,
        });
        std::mem::swap(&mut from, &mut to);
    }
    region.set_upkeep(None);
    // Every page, checked after the moves (each read faults it in if it is not resident).
    for pg in 0..pages {
        page_content(SEED, pg, &mut want);
        anyhow::ensure!(
            region.as_slice()[pg as usize * PAGE_SIZE..][..PAGE_SIZE] == want[..],
            "page {pg} of the region wrong after its migrations"
        );
    }
    Ok(out)
}

/// The handler's runs over the thread's, each summed over its two runs: (pages per second,
/// the owner's read p99 during the moves).
fn handler_over_thread(runs: &[RegionMigration]) -> Option<(f64, f64)> {
    let mean = |by: &str, f: &dyn Fn(&Migration) -> f64| {
        let v: Vec<f64> = runs
            .iter()
            .filter(|r| r.schedule_by == by)
            .map(|r| f(&r.m))
            .collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    let rate = |m: &Migration| m.migration_pages_per_s;
    let p99 = |m: &Migration| m.client_p99_during_migration_us;
    Some((
        mean("handler", &rate)? / mean("thread", &rate)?.max(1e-9),
        mean("handler", &p99)? / mean("thread", &p99)?.max(1e-9),
    ))
}

/// The paging program for `dur`: depth-1 random reads and writes (one in four), every read
/// checked against what was last written. Every `every` (if any) the donor holding the
/// pages needs its memory and the other has room again. Returns (operations, swaps).
fn paging(
    pager: &Shared,
    pages: u64,
    version: &mut [u8],
    donors: [&Donor; 2],
    holder: &mut usize,
    every: Option<Duration>,
    dur: Duration,
) -> anyhow::Result<(u64, u32)> {
    let mut rng = fastrand::Rng::with_seed(dur.as_nanos() as u64);
    let (mut buf, mut want) = (vec![0u8; PAGE_SIZE], vec![0u8; PAGE_SIZE]);
    let (t, mut ops, mut swaps) = (Instant::now(), 0u64, 0u32);
    let mut next = every.map(|e| t + e);
    while t.elapsed() < dur {
        if next.is_some_and(|n| Instant::now() >= n) {
            // The roles swap: the holder's machine needs its memory, the other has room.
            donors[1 - *holder].set_available(ROOMY)?;
            donors[*holder].set_available(SHORT)?;
            *holder = 1 - *holder;
            swaps += 1;
            next = every.map(|e| Instant::now() + e);
        }
        let pg = rng.u64(0..pages);
        let seed = SEED + u64::from(version[pg as usize]);
        if rng.u8(0..4) == 0 {
            version[pg as usize] = version[pg as usize].wrapping_add(1);
            page_content(SEED + u64::from(version[pg as usize]), pg, &mut buf);
            pager.write_pages(&[pg], &buf)?;
        } else {
            pager.read_pages(&[pg], &mut buf)?;
            page_content(seed, pg, &mut want);
            anyhow::ensure!(buf == want, "page {pg} read back wrong");
        }
        ops += 1;
    }
    Ok((ops, swaps))
}

pub fn run(opts: &Options) -> anyhow::Result<String> {
    let (bytes, phase, swap_every, swap_min): (u64, _, &[u64], u64) = if opts.quick {
        (64 * MIB, Duration::from_millis(1500), &[1, 2], 4)
    } else {
        (1 << 30, Duration::from_secs(5), &[1, 5, 30], 10)
    };
    let pages = bytes / PAGE_SIZE as u64;
    let machine = Machine::describe();
    eprintln!("bench adapt on {}", machine.one_line());
    // The stand-in /proc files and the spill file, removed when done.
    let scratch = crate::nbd::tempfile_dir("netram-bench-adapt")?;
    let tmp = scratch.path().to_path_buf();
    // D has room, B not: every page goes to D.
    let capacity = bytes + 256 * MIB;
    let d = Donor::start(&opts.netram_exe, capacity, tmp.join("d"), ROOMY, 0xd0, None)?;
    let b = Donor::start(
        &opts.netram_exe,
        capacity,
        tmp.join("b"),
        SHORT,
        0xb0,
        Some(&d.addr),
    )?;
    d.wait_offer(pages, Duration::from_secs(60))?;
    for x in [&d, &b] {
        let deadline = Instant::now() + Duration::from_secs(30);
        while x.stat("other_members_alive")? == 0 {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the bench's two daemons did not find each other within 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let mut p = open_pager(&OpenOptions {
        security: crate::security()?,
        servers: vec![d.addr.clone(), b.addr.clone()],
        backing: Backing::Cluster,
        pages,
        cache_pages: 0,
        spill_dir: Some(tmp.clone()),
        low_latency: false,
        redundancy: Scheme::None,
    })?;
    eprintln!("writing {} MiB to one donor ...", bytes / MIB);
    let mut buf = vec![0u8; 64 * PAGE_SIZE];
    for start in (0..pages).step_by(64) {
        let batch: Vec<u64> = (start..(start + 64).min(pages)).collect();
        for (i, &pg) in batch.iter().enumerate() {
            page_content(SEED, pg, &mut buf[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
        }
        p.write_many(&batch, &buf[..batch.len() * PAGE_SIZE])?;
    }
    p.flush()?;
    // B gets room; the client's maintenance runs as every front end's does.
    b.set_available(ROOMY)?;
    b.wait_offer(pages, Duration::from_secs(60))?;
    let pager = Arc::new(Shared::new(p));
    let maintenance = {
        let pager = pager.clone();
        let busy = pager.clone();
        maintain::spawn_beside(
            move |f| f(&mut pager.lock()),
            move || busy.busy(),
            MaintainConfig {
                probe_every: Duration::from_millis(100),
                ..Default::default()
            },
        )
    };
    eprintln!("migration: the donor's machine needs its memory ...");
    let m = migration(&*pager, pages, &d, &b, phase)?;
    // Every page, checked after the move.
    let mut want = vec![0u8; PAGE_SIZE];
    for start in (0..pages).step_by(64) {
        let batch: Vec<u64> = (start..(start + 64).min(pages)).collect();
        pager.read_pages(&batch, &mut buf)?;
        for (i, &pg) in batch.iter().enumerate() {
            page_content(SEED, pg, &mut want);
            anyhow::ensure!(
                buf[i * PAGE_SIZE..(i + 1) * PAGE_SIZE] == want[..],
                "page {pg} wrong after the migration"
            );
        }
    }
    // The same move back, through the owner (C → A → B), side by side with server to server.
    eprintln!("migration back, through the client ...");
    d.set_available(ROOMY)?;
    d.wait_offer(pages, Duration::from_secs(60))?;
    pager.lock().set_direct_migration(false);
    let through = migration(&*pager, pages, &b, &d, phase)?;
    pager.lock().set_direct_migration(true);
    anyhow::ensure!(
        through.pages_migrated_direct == 0,
        "pages went server to server with direct migration off"
    );
    // GMS §5.4: roles swapping every X seconds against a static cluster, side by side.
    let mut version = vec![0u8; pages as usize];
    let mut holder = 0; // the pages are on D again
    let donors = [&d, &b];
    let mut swaps = Vec::new();
    let swap_every = if opts.migration_only { &[] } else { swap_every };
    for &x in swap_every {
        let dur = Duration::from_secs(swap_min.max(3 * x));
        eprintln!("roles swapping every {x} s, {} s ...", dur.as_secs());
        let (before_m, before_d) = {
            let p = pager.lock();
            (
                p.counters().pages_migrated,
                p.counters().pages_migrated_to_disk,
            )
        };
        let (ops_swap, n) = paging(
            &pager,
            pages,
            &mut version,
            donors,
            &mut holder,
            Some(Duration::from_secs(x)),
            dur,
        )?;
        let (after_m, after_d) = {
            let p = pager.lock();
            (
                p.counters().pages_migrated,
                p.counters().pages_migrated_to_disk,
            )
        };
        // Both donors with room again, the pages settled where they are: the static run.
        donors[1 - holder].set_available(ROOMY)?;
        let settle = Instant::now();
        while pager.lock().pages_leaving() > 0 && settle.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let (ops_static, _) = paging(&pager, pages, &mut version, donors, &mut holder, None, dur)?;
        let rate = |ops: u64| ops as f64 / dur.as_secs_f64();
        swaps.push(Swap {
            every_s: x as f64,
            ops_per_s_swapping: rate(ops_swap),
            ops_per_s_static: rate(ops_static),
            slowdown: 1.0 - rate(ops_swap) / rate(ops_static).max(1e-9),
            swaps: n,
            pages_migrated: after_m - before_m,
            pages_migrated_to_disk: after_d - before_d,
        });
        // The next X starts from one holder with room, the other short.
        donors[1 - holder].set_available(SHORT)?;
    }
    drop(maintenance);
    let p = Arc::try_unwrap(pager).map_err(|_| anyhow::anyhow!("pager still shared"))?;
    p.into_pager().into_transport().close();
    // The same moves under a region, its schedule run by its handler and by a thread.
    let region = region_migrations(&d, &b, opts.quick, &tmp, phase)?;
    let (rate_ratio, p99_ratio) =
        handler_over_thread(&region).expect("both kinds of run, by construction");
    let targets = vec![
        target(
            "migration_pages_per_s / 50000",
            m.migration_pages_per_s / 50_000.0,
            1.0,
            "ge",
        ),
        target(
            "client_p99_during_migration_us / client_p99_without_migration_us",
            m.client_p99_during_migration_us / m.client_p99_without_migration_us.max(1e-9),
            2.0,
            "le",
        ),
    ];
    let r = AdaptResult {
        machine,
        quick: opts.quick,
        migration_pages_per_s: m.migration_pages_per_s,
        client_p99_during_migration_us: m.client_p99_during_migration_us,
        client_p99_without_migration_us: m.client_p99_without_migration_us,
        migration: m,
        migration_through_client: through,
        region_migrations: region,
        region_handler_over_thread_pages_per_s: rate_ratio,
        region_handler_over_thread_p99_during: p99_ratio,
        swaps,
        targets,
    };
    crate::write_json(&opts.out, "adapt.json", &r)?;
    let md = markdown(&r);
    std::fs::write(opts.out.join("adapt.md"), &md)?;
    Ok(md)
}

fn markdown(r: &AdaptResult) -> String {
    let m = &r.migration;
    let mut s = String::new();
    let _ = writeln!(s, "# netram bench adapt\n");
    let _ = writeln!(
        s,
        "Machine: {}{} · two `netram serve --adapt` on loopback, their machines stood in by \
         /proc files the bench writes\n",
        r.machine.one_line(),
        if r.quick { " · --quick" } else { "" }
    );
    let _ = writeln!(s, "## A donor gives its memory back\n");
    let _ = writeln!(
        s,
        "| measure | value |\n|---|---|\n\
         | pages on the donor | {} ({} MiB) |\n\
         | pages migrated (to the local disk) | {} ({}) |\n\
         | ... server to server (not through the client) | {} |\n\
         | moves refused (the page moved again later) | {} |\n\
         | **pages migrated per second** | **{:.0}** |\n\
         | machine short → first move | {:.2} s |\n\
         | machine short → donor's RSS down by 9/10 of its pages | {:.2} s |\n\
         | donor RSS before → after | {:.0} → {:.0} MiB |\n\
         | client read p50 / p99 without migration | {:.1} / {:.1} µs ({} reads) |\n\
         | client read p50 / p99 during migration | {:.1} / {:.1} µs ({} reads) |\n\
         | another client, paging to where the pages go: p50 / p99 without | {:.1} / {:.1} µs |\n\
         | ... during | {:.1} / {:.1} µs |\n",
        m.pages,
        m.pages * PAGE_SIZE as u64 / MIB,
        m.pages_migrated,
        m.pages_migrated_to_disk,
        m.pages_migrated_direct,
        m.migrations_refused,
        m.migration_pages_per_s,
        m.until_first_move_s,
        m.give_back_s,
        m.donor_rss_before_mib,
        m.donor_rss_after_mib,
        m.client_p50_without_migration_us,
        m.client_p99_without_migration_us,
        m.reads_without,
        m.client_p50_during_migration_us,
        m.client_p99_during_migration_us,
        m.reads_during,
        m.bystander_p50_without_migration_us,
        m.bystander_p99_without_migration_us,
        m.bystander_p50_during_migration_us,
        m.bystander_p99_during_migration_us,
    );
    let _ = writeln!(
        s,
        "The client is the owner of the pages that move. Under `none` and `mirror:N` they go \
         server to server (Nswap's MIGRATE): the client sends keys only (EXPECT to the new \
         server, MIGRATE to the donor, which hands {} pages over at a time on its own thread), \
         then deletes the donor's copies; its reads of pages still on the donor share that \
         server, and every process here shares this machine's CPUs. The other client has no \
         page on the donor; it sees the servers' load only.\n",
        16
    );
    let t = &r.migration_through_client;
    let _ = writeln!(
        s,
        "## Server to server against through the client, side by side\n\n\
         The same pages moved back (B → D), this time by the client itself (read from the \
         donor, written to the other server, deleted), in the same run:\n\n\
         | measure | server to server (D → B) | through the client (B → D) | ratio |\n\
         |---|---|---|---|\n\
         | pages migrated per second | {:.0} | {:.0} | {:.2} |\n\
         | client read p99 without / during migration | {:.1} / {:.1} µs | {:.1} / {:.1} µs | {:.2} (during) |\n\
         | client reads served during migration | {} | {} | |\n\
         | another client's read p99 during | {:.1} µs | {:.1} µs | {:.2} |\n",
        m.migration_pages_per_s,
        t.migration_pages_per_s,
        m.migration_pages_per_s / t.migration_pages_per_s.max(1e-9),
        m.client_p99_without_migration_us,
        m.client_p99_during_migration_us,
        t.client_p99_without_migration_us,
        t.client_p99_during_migration_us,
        m.client_p99_during_migration_us / t.client_p99_during_migration_us.max(1e-9),
        m.reads_during,
        t.reads_during,
        m.bystander_p99_during_migration_us,
        t.bystander_p99_during_migration_us,
        m.bystander_p99_during_migration_us / t.bystander_p99_during_migration_us.max(1e-9),
    );
    let _ = writeln!(
        s,
        "## A region's pages: its schedule run by its handler or by a thread, side by side\n\n\
         A region (`netram run`'s front end) of {} MiB, one page in eight resident, its pages \
         moved off a donor five times (the first to warm up, not counted), its pager's \
         maintenance schedule run alternately by the handler between faults (as `netram run` does) and by a maintenance thread taking the \
         region's lock for each step (as it did before); the owner's reads fault meanwhile.\n\n\
         | run | schedule by | move | pages/s | direct | owner p50 / p99 without | owner p50 / p99 during | reads during |\n\
         |---|---|---|---|---|---|---|---|",
        region_size(r.quick).0 * PAGE_SIZE as u64 / MIB
    );
    for (i, x) in r.region_migrations.iter().enumerate() {
        let m = &x.m;
        let _ = writeln!(
            s,
            "| {} | {} | {} → {} | {:.0} | {} of {} | {:.1} / {:.1} µs | {:.1} / {:.1} µs | {} |",
            i + 1,
            x.schedule_by,
            x.from,
            x.to,
            m.migration_pages_per_s,
            m.pages_migrated_direct,
            m.pages_migrated,
            m.client_p50_without_migration_us,
            m.client_p99_without_migration_us,
            m.client_p50_during_migration_us,
            m.client_p99_during_migration_us,
            m.reads_during,
        );
    }
    let _ = writeln!(
        s,
        "\nHandler over thread (means of two runs each): pages per second {:.2}, the owner's \
         read p99 during the moves {:.2}.\n",
        r.region_handler_over_thread_pages_per_s, r.region_handler_over_thread_p99_during
    );
    let _ = writeln!(
        s,
        "## GMS §5.4: an idle and a busy node swap roles every X s\n"
    );
    let _ = writeln!(
        s,
        "| X | ops/s swapping | ops/s static | slowdown | swaps | pages migrated (to disk) |\n|---|---|---|---|---|---|"
    );
    for w in &r.swaps {
        let _ = writeln!(
            s,
            "| {} s | {:.0} | {:.0} | {:.1} % | {} | {} ({}) |",
            w.every_s,
            w.ops_per_s_swapping,
            w.ops_per_s_static,
            100.0 * w.slowdown,
            w.swaps,
            w.pages_migrated,
            w.pages_migrated_to_disk
        );
    }
    let _ = writeln!(
        s,
        "\n## Targets\n\n| ratio | measured | limit | met |\n|---|---|---|---|"
    );
    s += &crate::target_rows(&r.targets);
    s
}
