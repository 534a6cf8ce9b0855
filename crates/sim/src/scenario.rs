//! A scenario: the cluster's shape, the faults, the clients' random workload, all from one
//! seed; [`run`] plays it and checks after every step.

use crate::check::{self, content, Model};
use crate::transport::{deliver, Peers, SimPager, SimTransport};
use crate::world::{FaultLog, Faults, World, LEASE_PERIOD_MS};
use netram_pager::{
    Backing, MemDisk, Pager, PagerConfig, PagerError, ScheduleConfig, SealKey, SEAL_KEY_LEN,
};
use netram_policy::redundancy::Scheme;
use netram_proto::PAGE_SIZE;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

#[derive(Debug, Clone)]
pub struct Scenario {
    pub seed: u64,
    pub servers: usize,
    pub clients: usize,
    /// Pages of each client's pager.
    pub pages: u64,
    pub steps: u32,
    pub scheme: Scheme,
    pub faults: Faults,
    /// Whether `faults` are the defaults (so the replay command need not spell them out).
    pub default_faults: bool,
    /// Print every message and fault to stderr.
    pub trace: bool,
}

impl Scenario {
    /// The default scenario: five servers, three clients, every fault enabled.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            servers: 5,
            clients: 3,
            pages: 48,
            steps: 1_500,
            scheme: Scheme::None,
            faults: Faults::all(),
            default_faults: true,
            trace: false,
        }
    }

    /// The one command that replays this run.
    pub fn replay_command(&self) -> String {
        let d = Scenario::new(self.seed);
        let mut cmd = format!("netram sim --seed {}", self.seed);
        if self.scheme != d.scheme {
            cmd += &format!(" --scheme {}", self.scheme);
        }
        if self.servers != d.servers {
            cmd += &format!(" --servers {}", self.servers);
        }
        if self.clients != d.clients {
            cmd += &format!(" --clients {}", self.clients);
        }
        if self.pages != d.pages {
            cmd += &format!(" --pages {}", self.pages);
        }
        if self.steps != d.steps {
            cmd += &format!(" --steps {}", self.steps);
        }
        if !self.default_faults {
            cmd += " --no-faults";
        }
        cmd
    }
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub steps: u32,
    pub virtual_ms: u64,
    pub writes: u64,
    pub reads: u64,
    pub discards: u64,
    pub flushes: u64,
    pub revived: u64,
    /// Pages whose lost copies recovery set out to rebuild.
    pub rebuilds_started: u64,
    /// Pages read back and found right.
    pub pages_verified: u64,
    /// Reads that failed where the faults allowed it (lost or corrupt beyond the redundancy).
    pub reads_failed_allowed: u64,
    /// Writes the clients' local disks failed, and the operations that reported it.
    pub disk_write_failures: u64,
    pub disk_errors_reported: u64,
    /// Replies (and connection failures) pushed to idle clients (`Pager::on_reply`,
    /// `Pager::on_failure`), and of those, the ones pushed while another client's operation
    /// was waiting for its own replies.
    pub replies_pushed: u64,
    pub replies_pushed_mid_operation: u64,
    /// Replies a maintenance tick found waiting (`Pager::on_tick` polls first).
    pub replies_polled: u64,
    /// Ticks of the clients' maintenance schedules (`Pager::on_tick`).
    pub ticks: u64,
    /// Writes made without waiting, with `Pager::try_write` page by page as the userfaultfd
    /// handler evicts or with `Pager::try_write_many` as the NBD device writes (falling back on
    /// `write` for a page they did not take).
    pub writes_without_waiting: u64,
    /// Writes made with `Pager::write_over_budget` (never waiting for a slot), page by page.
    pub writes_over_budget: u64,
    /// Flushes finished by `Pager::try_flush` alone, as the NBD device's FLUSH finishes,
    /// no waiting `flush` after them.
    pub flushes_without_waiting: u64,
    /// Reads by ticket (`Pager::start_read`) started, finished with a version they may see,
    /// and failed where the faults allowed it: several of one client in flight at once,
    /// interleaved with its other operations and its maintenance.
    pub tickets: u64,
    pub tickets_verified: u64,
    pub tickets_failed_allowed: u64,
    /// Operations of a client (writes, reads, discards, flushes, maintenance ticks) begun
    /// while reads by ticket of the same client were in flight.
    pub ops_during_tickets: u64,
    pub faults: FaultLog,
}

impl Report {
    /// Adds another run's figures to these (totals over many seeds).
    pub fn add(&mut self, r: &Report) {
        self.steps += r.steps;
        self.virtual_ms += r.virtual_ms;
        self.writes += r.writes;
        self.reads += r.reads;
        self.discards += r.discards;
        self.flushes += r.flushes;
        self.revived += r.revived;
        self.rebuilds_started += r.rebuilds_started;
        self.pages_verified += r.pages_verified;
        self.reads_failed_allowed += r.reads_failed_allowed;
        self.disk_write_failures += r.disk_write_failures;
        self.disk_errors_reported += r.disk_errors_reported;
        self.replies_pushed += r.replies_pushed;
        self.replies_pushed_mid_operation += r.replies_pushed_mid_operation;
        self.replies_polled += r.replies_polled;
        self.ticks += r.ticks;
        self.tickets += r.tickets;
        self.tickets_verified += r.tickets_verified;
        self.tickets_failed_allowed += r.tickets_failed_allowed;
        self.ops_during_tickets += r.ops_during_tickets;
        self.writes_without_waiting += r.writes_without_waiting;
        self.writes_over_budget += r.writes_over_budget;
        self.flushes_without_waiting += r.flushes_without_waiting;
        let (a, b) = (&mut self.faults, &r.faults);
        a.crashes += b.crashes;
        a.resets += b.resets;
        a.losses += b.losses;
        a.duplicates += b.duplicates;
        a.bit_flips += b.bit_flips;
        a.partitions += b.partitions;
        a.slowdowns += b.slowdowns;
        a.offer_moves += b.offer_moves;
        a.pages_migrated += b.pages_migrated;
        a.pages_migrated_to_disk += b.pages_migrated_to_disk;
        a.pages_migrated_direct += b.pages_migrated_direct;
        a.unanswered += b.unanswered;
        a.hostile += b.hostile;
        a.members_declared_down += b.members_declared_down;
        a.members_declared_down_alive += b.members_declared_down_alive;
        a.members_failed_by_clients += b.members_failed_by_clients;
        a.membership_lies += b.membership_lies;
        a.gossip_cuts += b.gossip_cuts;
    }
}

/// A checker found a violation.
#[derive(Debug, Clone, thiserror::Error)]
#[error("seed {seed}, step {step}: {what}\n  replay with: {replay}")]
pub struct Failure {
    pub seed: u64,
    pub step: u32,
    pub what: String,
    pub replay: String,
}

struct Client {
    /// Shared with the other clients' transports, which push this pager its replies while
    /// it is idle (see [`deliver`]); borrowed for each of its own operations.
    pager: Rc<RefCell<SimPager>>,
    model: Model,
    backing: Backing,
    /// The pager's count of failed disk writes when it last reported one.
    disk_failures_reported: u64,
    /// Reads by ticket in flight, by tag: the page and what it may read (see [`Ticket`]).
    tickets: HashMap<u64, Ticket>,
    next_ticket: u64,
}

/// A read by ticket in flight: it may return the page as it was when it started, or anything
/// written over it (or the zeros of a discard) before it finished; it may fail only where a
/// plain read may, or if the page was discarded meanwhile.
struct Ticket {
    page: u64,
    may_read: Vec<Option<u64>>,
    discarded: bool,
}

impl Client {
    /// The page was written (`Some(tag)`) or discarded (`None`): reads by ticket in flight on
    /// it may see that.
    fn changed(&mut self, page: u64, to: Option<u64>) {
        for t in self.tickets.values_mut().filter(|t| t.page == page) {
            t.may_read.push(to);
            t.discarded |= to.is_none();
        }
    }

    /// Takes the finished reads by ticket and checks each against what it may read.
    fn take_tickets(
        &mut self,
        may_fail: impl Fn(&PagerError) -> bool,
        report: &mut Report,
    ) -> Result<(), String> {
        let mut bad = None;
        let (tickets, model) = (&mut self.tickets, &self.model);
        let taken = self.pager.borrow_mut().take_finished(|tag, page, data| {
            let Some(t) = tickets.remove(&tag) else {
                bad.get_or_insert(format!("ticket {tag} (page {page}) finished twice"));
                return;
            };
            let ok = match &data {
                _ if t.page != page => false,
                Ok(got) => {
                    let fits = t.may_read.iter().any(|&v| match v {
                        Some(tag) => content(model.client, page, tag)[..] == got[..],
                        None => got.iter().all(|&b| b == 0),
                    });
                    if fits {
                        report.tickets_verified += 1;
                    }
                    fits
                }
                Err(e) if t.discarded || may_fail(e) => {
                    report.tickets_failed_allowed += 1;
                    true
                }
                Err(_) => false,
            };
            if !ok {
                let what = match &data {
                    Ok(got) => model.explain(page, got),
                    Err(e) => e.to_string(),
                };
                bad.get_or_insert(format!(
                    "ticket {tag} of page {} (may read {:?}) got page {page}: {what}",
                    t.page, t.may_read
                ));
            }
        });
        // What the front ends do: send what taking queued (evictions' PUTs) right after.
        self.pager.borrow_mut().send_queued();
        if let Some(bad) = bad {
            return Err(bad);
        }
        match taken {
            Ok(()) => Ok(()),
            Err(e) if self.disk_failure_explains(&e) => {
                report.disk_errors_reported += 1;
                Ok(())
            }
            Err(e) => Err(format!("taking reads by ticket: {e}")),
        }
    }
}

/// Errors that pushed replies returned (see [`deliver`]): a disk failure the pager reports is
/// expected of it (once per failure), anything else fails the run.
fn judge_pushed(
    peers: &Rc<RefCell<Peers>>,
    clients: &mut [Client],
    report: &mut Report,
) -> Result<(), String> {
    if let Some((c, why)) = peers.borrow_mut().broken.first() {
        return Err(format!("client {c}: pager after a pushed reply: {why}"));
    }
    let errors = std::mem::take(&mut peers.borrow_mut().errors);
    for (c, e) in errors {
        if !clients[c].disk_failure_explains(&e) {
            return Err(format!("client {c}: a pushed reply: {e}"));
        }
        report.disk_errors_reported += 1;
    }
    Ok(())
}

impl Client {
    /// Whether an error is the pager reporting its disk's failed writes, and a failure it had
    /// not reported yet explains it (each report needs a failure of its own).
    fn disk_failure_explains(&mut self, e: &PagerError) -> bool {
        let failures = self.pager.borrow_mut().counters().disk_write_errors;
        let explained = matches!(e, PagerError::Disk(_)) && failures > self.disk_failures_reported;
        if explained {
            self.disk_failures_reported = failures;
        }
        explained
    }

    /// After an operation that failed midway (its disk could not make room), each page it
    /// touched holds one of `candidates` (its contents before or one of the operation's): the
    /// model learns which by reading it, and anything else is a failure.
    fn pin(&mut self, candidates: &[(u64, Option<u64>)]) -> Result<(), String> {
        let mut out = vec![0u8; PAGE_SIZE];
        let pages: std::collections::BTreeSet<u64> = candidates.iter().map(|c| c.0).collect();
        for page in pages {
            // A page flipped on the wire reads corrupt once: it is read again.
            let mut tries = 0;
            let read = loop {
                tries += 1;
                let result = self.pager.borrow_mut().read(page, &mut out);

                match result {
                    Err(PagerError::Corrupt { .. }) if tries < 5 => continue,
                    r => break r,
                }
            };
            match read {
                Ok(()) => {}
                // Lost meanwhile (where the faults allow it): what it held no longer matters.
                Err(PagerError::Lost(_)) if self.backing == Backing::Cluster => continue,
                Err(e) => return Err(format!("reading back page {page} after a disk error: {e}")),
            }
            let tags = candidates.iter().filter(|c| c.0 == page).map(|c| c.1);
            let mut found = None;
            for tag in tags {
                self.model.pages[page as usize] = tag;
                if out == self.model.expected(page) {
                    found = Some(tag);
                }
            }
            match found {
                Some(tag) => self.model.pages[page as usize] = tag,
                None => {
                    return Err(format!(
                        "page {page} read back {} after a disk error",
                        self.model.explain(page, &out)
                    ))
                }
            }
        }
        Ok(())
    }
}

/// Plays a scenario, checking after every step. A panic in the code under test is a failure
/// of its seed like any other, so that a sweep names the seed and goes on.
pub fn run(sc: &Scenario) -> Result<Report, Failure> {
    let step = std::cell::Cell::new(0);
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| play(sc, &step))).unwrap_or_else(
        |panic| {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("a panic");
            Err(Failure {
                seed: sc.seed,
                step: step.get(),
                what: format!("panicked: {what}"),
                replay: sc.replay_command(),
            })
        },
    )
}

fn play(sc: &Scenario, at: &std::cell::Cell<u32>) -> Result<Report, Failure> {
    let fail = |step: u32, what: String| Failure {
        seed: sc.seed,
        step,
        what,
        replay: sc.replay_command(),
    };
    let mut rng = fastrand::Rng::with_seed(sc.seed);
    // Room for all pages, give or take half: some servers fill up and refuse (Anemone's NACK).
    let copies = sc.scheme.pages_per_page().ceil() as usize;
    let fair = (sc.pages as usize * sc.clients * copies).div_ceil(sc.servers);
    let capacities: Vec<usize> = (0..sc.servers)
        .map(|_| (fair * rng.usize(50..=150) / 100).max(4))
        .collect();
    let world = Rc::new(RefCell::new(World::new(
        rng.u64(..),
        &capacities,
        sc.clients,
        sc.faults.clone(),
    )));
    world.borrow_mut().trace = sc.trace;
    let tolerated = sc.scheme.failures_tolerated();
    let mut clients: Vec<Client> = (0..sc.clients)
        .map(|c| {
            let backing = match rng.u32(0..10) {
                0 => Backing::Disk,
                1..=3 => Backing::ClusterDisk,
                _ => Backing::Cluster,
            };
            let cfg = PagerConfig {
                pages: sc.pages,
                region: 0,
                backing,
                cache_pages: [0, 1, 4, 16][rng.usize(0..4)],
                writeback_batch: rng.usize(1..=4),
                window: 8,
                batch_max: rng.usize(1..=8),
                seed: rng.u64(..),
                redundancy: sc.scheme,
                recovery_slots: [0, 8, 64][rng.usize(0..3)],
                // Sealed, as every front end runs; one client in eight in clear, so that the
                // crc32c path is exercised too. The key comes from the seed (replays agree).
                seal: (rng.u32(0..8) != 0).then(|| {
                    let mut k = [0u8; SEAL_KEY_LEN];
                    k.iter_mut().for_each(|b| *b = rng.u8(..));
                    SealKey(k)
                }),
                // Pages leave a shrinking server straight for another (Nswap's MIGRATE) in
                // three clients of four; through their owner in the rest.
                direct_migration: rng.u32(0..4) != 0,
                // One client in two compresses before it seals, as over a 100 Mbit/s link
                // with a codec of 3 µs a page (fixed: a replay must not depend on the host).
                // Drawn apart, so that the scenario's other draws stay those of the seeds
                // that found bugs before compression existed.
                compress: (fastrand::Rng::with_seed(sc.seed ^ 0xc0de ^ c as u64).bool()).then_some(
                    netram_proto::compress::Rule {
                        link_bytes_per_us: 12.5,
                        codec_us: 3.0,
                    },
                ),
            };
            let disk = match sc.faults.disk_write {
                p if p > 0.0 => MemDisk::failing_randomly(rng.u64(..), p),
                _ => MemDisk::default(),
            };
            let mut pager = Pager::new(cfg, SimTransport::connect(world.clone(), c), disk);
            pager.set_schedule(ScheduleConfig {
                probe_every_us: rng.u64(200_000..3_000_000),
                reconnect_every_us: rng.u64(200_000..2_000_000),
                recover_batch: rng.usize(1..=16),
                migrate_batch: rng.usize(1..=64),
                // As a real client's: the transport's reply timeout.
                reply_timeout_us: crate::transport::REPLY_TIMEOUT_US,
            });
            Client {
                disk_failures_reported: 0,
                tickets: HashMap::new(),
                next_ticket: 0,
                pager: Rc::new(RefCell::new(pager)),
                model: Model {
                    client: c,
                    pages: vec![None; sc.pages as usize],
                },
                backing,
            }
        })
        .collect();
    // Every transport can push replies to the other clients while its own client waits.
    let peers = Rc::new(RefCell::new(Peers {
        pagers: clients.iter().map(|cl| Rc::downgrade(&cl.pager)).collect(),
        ..Peers::default()
    }));
    for cl in &clients {
        cl.pager.borrow_mut().transport_mut().peers = Some(peers.clone());
    }
    let mut report = Report::default();
    let mut tag = 0u64;
    let crash_chance = 2.0 * f64::from(sc.faults.crashes) / f64::from(sc.steps.max(1));

    for step in 0..sc.steps {
        at.set(step);
        report.steps = step + 1;
        inject_faults(&mut world.borrow_mut(), sc, crash_chance);
        let ci = rng.usize(0..clients.len());
        if sc.trace {
            eprintln!("--- step {step}: client {ci}");
        }
        let cl = &mut clients[ci];
        // Judged after the operation: faults strike while it runs.
        let may_lose = |cl: &Client, e: &PagerError| {
            cl.backing == Backing::Cluster
                && check::failure_allowed(&world.borrow(), ci, tolerated, e)
        };
        let pages: Vec<u64> = (0..rng.usize(1..=4))
            .map(|_| rng.u64(0..sc.pages))
            .collect();
        let op = rng.u32(0..100);
        if !(65..=79).contains(&op) && op < 96 && cl.pager.borrow().tickets() > 0 {
            report.ops_during_tickets += 1;
        }
        match op {
            0..=39 => {
                let mut data = Vec::with_capacity(pages.len() * PAGE_SIZE);
                let mut candidates: Vec<(u64, Option<u64>)> = pages
                    .iter()
                    .map(|&p| (p, cl.model.pages[p as usize]))
                    .collect();
                for &p in &pages {
                    tag += 1;
                    data.extend(content(ci, p, tag));
                    cl.model.pages[p as usize] = Some(tag);
                    cl.changed(p, Some(tag));
                    candidates.push((p, Some(tag)));
                }
                report.writes += 1;
                let how = rng.u32(0..8);
                let result = if how == 0 {
                    // As the userfaultfd handler stores a forked child's pages its agent
                    // copied: never waiting, the pager's pool growing if no slot is free.
                    report.writes_over_budget += 1;
                    let mut pager = cl.pager.borrow_mut();
                    pages.iter().enumerate().try_for_each(|(i, &p)| {
                        pager.write_over_budget(p, &data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE])
                    })
                } else if how < 3 {
                    // As the userfaultfd handler evicts (each page written if the pager takes
                    // it without waiting, else the waiting way; sent together), or as the NBD
                    // device writes (as many pages as the pager takes without waiting, the
                    // cache over its budget meanwhile, then one the waiting way).
                    report.writes_without_waiting += 1;
                    try_write_many(
                        &mut cl.pager.borrow_mut(),
                        &pages,
                        &data,
                        tag.is_multiple_of(2),
                    )
                } else {
                    cl.pager.borrow_mut().write_many(&pages, &data)
                };

                match result {
                    Ok(()) => {}
                    Err(e) if cl.disk_failure_explains(&e) => {
                        report.disk_errors_reported += 1;
                        cl.pin(&candidates)
                            .map_err(|why| fail(step, format!("client {ci}: {why}")))?;
                    }
                    Err(e) => return Err(fail(step, format!("client {ci}: write {pages:?}: {e}"))),
                }
            }
            // Reads by ticket: started and left in flight; they finish as replies come in
            // (pushed between steps, or read while this client's own operations wait)
            // and are checked between steps.
            65..=79 => {
                for &p in &pages {
                    let t = cl.next_ticket;
                    cl.next_ticket += 1;
                    report.tickets += 1;
                    let now = cl.model.pages[p as usize];
                    let result = cl.pager.borrow_mut().start_read(p, t);
                    match result {
                        Ok(()) => {
                            cl.tickets.insert(
                                t,
                                Ticket {
                                    page: p,
                                    may_read: vec![now],
                                    discarded: false,
                                },
                            );
                        }
                        Err(e) if cl.disk_failure_explains(&e) => {
                            report.disk_errors_reported += 1;
                        }
                        Err(e) => {
                            return Err(fail(step, format!("client {ci}: start_read {p}: {e}")))
                        }
                    }
                }
            }
            40..=64 => {
                report.reads += 1;
                let mut out = vec![0u8; pages.len() * PAGE_SIZE];
                let result = cl.pager.borrow_mut().read_many(&pages, &mut out);

                match result {
                    Ok(()) => {
                        for (i, &p) in pages.iter().enumerate() {
                            let got = &out[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
                            if got != &cl.model.expected(p)[..] {
                                return Err(fail(
                                    step,
                                    format!(
                                        "client {ci}: page {p} read back {}",
                                        cl.model.explain(p, got)
                                    ),
                                ));
                            }
                            report.pages_verified += 1;
                        }
                    }
                    Err(e) if may_lose(cl, &e) => {
                        report.reads_failed_allowed += 1;
                    }
                    Err(e) if cl.disk_failure_explains(&e) => {
                        report.disk_errors_reported += 1;
                    }
                    Err(e) => {
                        return Err(fail(step, format!("client {ci}: read {pages:?}: {e}")));
                    }
                }
            }
            80..=87 => {
                report.discards += 1;
                let mut candidates: Vec<(u64, Option<u64>)> = pages
                    .iter()
                    .map(|&p| (p, cl.model.pages[p as usize]))
                    .collect();
                for &p in &pages {
                    cl.model.pages[p as usize] = None;
                    cl.changed(p, None);
                    candidates.push((p, None));
                }
                let result = cl.pager.borrow_mut().discard_many(&pages);

                match result {
                    Ok(()) => {}
                    Err(e) if cl.disk_failure_explains(&e) => {
                        report.disk_errors_reported += 1;
                        cl.pin(&candidates)
                            .map_err(|why| fail(step, format!("client {ci}: {why}")))?;
                    }
                    Err(e) => {
                        return Err(fail(step, format!("client {ci}: discard {pages:?}: {e}")))
                    }
                }
            }
            88..=91 => {
                report.flushes += 1;
                // Half of them as the NBD device flushes: `try_flush` between spells of
                // virtual time while replies come in; `flush` only if it has not finished
                // by then (the device's fallback), so that what follows relies on
                // `try_flush`'s word alone when it has.
                let result = if rng.bool() {
                    (|| {
                        let mut flush = cl.pager.borrow().start_flush();
                        for _ in 0..8 {
                            if cl.pager.borrow_mut().try_flush(&mut flush)? {
                                report.flushes_without_waiting += 1;
                                return Ok(());
                            }
                            let d = rng.u64(0..2_000);
                            world.borrow_mut().run_for(d);
                            cl.pager.borrow_mut().poll()?;
                        }
                        cl.pager.borrow_mut().flush()
                    })()
                } else {
                    cl.pager.borrow_mut().flush()
                };

                match result {
                    Ok(()) => {}
                    Err(e) if cl.disk_failure_explains(&e) => report.disk_errors_reported += 1,
                    Err(e) => return Err(fail(step, format!("client {ci}: flush: {e}"))),
                }
            }
            // The maintenance schedule the daemon's thread runs (probes, reconnections,
            // recovery steps), on the virtual clock.
            92..=95 => {
                let now = world.borrow().now;
                tick(cl, now, &mut report).map_err(|e| fail(step, format!("client {ci}: {e}")))?;
            }
            _ => {
                let d = rng.u64(0..50_000);
                world.borrow_mut().run_for(d);
            }
        }
        let d = rng.u64(0..2_000);
        world.borrow_mut().run_for(d);
        // Replies that reached the other clients meanwhile are pushed to them now, between any
        // two steps, not only when their own next operation waits: one message at a time, to
        // whichever client and from whichever server the dice pick, as a runtime that owns the
        // sockets delivers them. Their write-backs finish (or fail over) interleaved with this
        // client's work and with each other's.
        deliver(&peers, &world, false);
        judge_pushed(&peers, &mut clients, &mut report).map_err(|e| fail(step, e))?;
        for (cj, other) in clients.iter_mut().enumerate() {
            // Taken after every step, before the checkers below forgive a client its faults:
            // a read that failed is judged by the faults that had touched the client then.
            let backing = other.backing;
            let may_fail = |e: &PagerError| {
                backing == Backing::Cluster
                    && check::failure_allowed(&world.borrow(), cj, tolerated, e)
            };
            other
                .take_tickets(may_fail, &mut report)
                .map_err(|e| fail(step, format!("client {cj}: {e}")))?;
        }
        follow_membership(&world, &mut clients, &mut report).map_err(|e| fail(step, e))?;
        for (cj, other) in clients.iter_mut().enumerate() {
            // An idle client's maintenance runs too, as its thread would.
            if cj != ci && rng.u32(0..16) == 0 {
                let now = world.borrow().now;
                tick(other, now, &mut report)
                    .map_err(|e| fail(step, format!("client {cj}: {e}")))?;
            }
        }
        let mut w = world.borrow_mut();
        check::stores(&w).map_err(|e| fail(step, e))?;
        for cl in &clients {
            cl.pager
                .borrow_mut()
                .check_invariants()
                .map_err(|e| fail(step, format!("client {}: pager: {e}", cl.model.client)))?;
            check::holders(&w, &cl.pager.borrow(), &cl.model, tolerated)
                .map_err(|e| fail(step, format!("client {}: {e}", cl.model.client)))?;
            check::groups(&w, &cl.pager.borrow())
                .map_err(|e| fail(step, format!("client {}: {e}", cl.model.client)))?;
            // A client whose every page is whole again on reachable servers has put its
            // failures behind it: from now on, only new ones count against its redundancy.
            // Not while reads by ticket or probes are in flight, nor any request to a server
            // whose fault touched it: a reply damaged (or lost) on its way may still reach one
            // of them, a probe that goes unanswered fails its server later, and a damaged
            // frame leaves its connection to fail at the next read.
            let busy = {
                let p = cl.pager.borrow();
                let touched = &w.touched[cl.model.client];
                p.tickets() + p.probes_in_flight() > 0
                    || (0..touched.len()).any(|s| touched[s] && p.in_flight(s) > 0)
            };
            if !busy && check::whole(&w, &cl.pager.borrow(), &cl.model) {
                let alive: Vec<bool> = cl.pager.borrow_mut().servers().map(|(_, a)| a).collect();
                w.forgive(
                    cl.model.client,
                    &cl.pager.borrow_mut().transport().conns,
                    &alive,
                );
            }
        }
    }

    // The end: every server back and reachable, every page read back, every session ended.
    let end = sc.steps;
    // The end runs one client at a time, as a program's last flush would: no more pushing.
    for cl in &clients {
        cl.pager.borrow_mut().transport_mut().peers = None;
    }
    {
        let p = peers.borrow();
        report.replies_pushed = p.pushed;
        report.replies_pushed_mid_operation = p.pushed_mid_operation;
    }
    world.borrow_mut().run_for(5_000_000);
    for (ci, cl) in clients.iter_mut().enumerate() {
        // Every read by ticket finishes (a server that never answers is timed out).
        let waited = cl.pager.borrow_mut().wait_finished();
        if let Err(e) = waited {
            if !cl.disk_failure_explains(&e) {
                return Err(fail(
                    end,
                    format!("client {ci}: finishing reads by ticket: {e}"),
                ));
            }
            report.disk_errors_reported += 1;
        }
        let backing = cl.backing;
        let may_fail = |e: &PagerError| {
            backing == Backing::Cluster && check::failure_allowed(&world.borrow(), ci, tolerated, e)
        };
        cl.take_tickets(may_fail, &mut report)
            .map_err(|e| fail(end, format!("client {ci}: {e}")))?;
        if !cl.tickets.is_empty() || cl.pager.borrow().tickets() > 0 {
            return Err(fail(
                end,
                format!(
                    "client {ci}: {} reads by ticket never finished",
                    cl.tickets.len()
                ),
            ));
        }
        cl.pager.borrow_mut().revive_dead_servers();
        // The disk is mended too; the first flush reports a failure not reported yet.
        cl.pager.borrow_mut().disk_mut().heal();
        report.disk_write_failures += cl.pager.borrow_mut().counters().disk_write_errors;
        let result = cl.pager.borrow_mut().flush();

        match result {
            Ok(()) => {}
            Err(e) if cl.disk_failure_explains(&e) => report.disk_errors_reported += 1,
            Err(e) => return Err(fail(end, format!("client {ci}: final flush: {e}"))),
        }
        // Recovery runs to the end: the redundancy is whole again.
        for _ in 0..1_000 {
            cl.pager
                .borrow_mut()
                .probe_servers()
                .map_err(|e| fail(end, format!("client {ci}: probe: {e}")))?;
            cl.pager.borrow_mut().revive_dead_servers();
            let r = cl
                .pager
                .borrow_mut()
                .recover(16)
                .map_err(|e| fail(end, format!("client {ci}: recover: {e}")))?;
            report.rebuilds_started += r.started as u64;
            // Migration runs to the end too: every page a server asked its owner to move away
            // is moved (Nswap §III), to another server or to the local disk.
            if cl.pager.borrow().migration_due() {
                cl.pager
                    .borrow_mut()
                    .migrate(64)
                    .map_err(|e| fail(end, format!("client {ci}: migrate: {e}")))?;
            }
            cl.pager
                .borrow_mut()
                .flush()
                .map_err(|e| fail(end, format!("client {ci}: flush: {e}")))?;
            // A connection that fell silent is only found out now: reconnect it.
            cl.pager.borrow_mut().revive_dead_servers();
            let p = cl.pager.borrow_mut();
            if r.remaining == 0 && p.degraded_pages() == 0 && !p.migration_due() {
                break;
            }
        }
        if cl.pager.borrow().migration_due() {
            return Err(fail(
                end,
                format!(
                    "client {ci}: migration did not finish: {} pages leaving",
                    cl.pager.borrow().pages_leaving()
                ),
            ));
        }
        if cl.pager.borrow_mut().degraded_pages() > 0 {
            return Err(fail(
                end,
                format!(
                    "client {ci}: recovery did not finish: {} pages degraded",
                    cl.pager.borrow_mut().degraded_pages()
                ),
            ));
        }
        let missing = check::not_whole(&world.borrow(), &cl.pager.borrow(), &cl.model);
        if let Some(why) = missing.filter(|_| !check::loss_allowed(&world.borrow(), ci, tolerated))
        {
            return Err(fail(end, format!("client {ci}: after recovery: {why}")));
        }
        let may_lose = |e: &PagerError| {
            cl.backing == Backing::Cluster
                && check::failure_allowed(&world.borrow(), ci, tolerated, e)
        };
        let mut out = vec![0u8; PAGE_SIZE];
        for p in 0..sc.pages {
            let result = cl.pager.borrow_mut().read(p, &mut out);

            match result {
                Ok(()) if out == cl.model.expected(p) => report.pages_verified += 1,
                Ok(()) => {
                    return Err(fail(
                        end,
                        format!(
                            "client {ci}: page {p} read back {} at the end",
                            cl.model.explain(p, &out)
                        ),
                    ))
                }
                Err(e) if may_lose(&e) => {
                    report.reads_failed_allowed += 1;
                }
                Err(e) => return Err(fail(end, format!("client {ci}: final read of {p}: {e}"))),
            }
        }
        // A read that found its server gone rebuilt the page and is writing it out again; the
        // copies that write supersedes are deleted, those whose delete could not reach their
        // group's holder again by recovery rounds (as after the recovery above).
        for _ in 0..100 {
            cl.pager
                .borrow_mut()
                .flush()
                .map_err(|e| fail(end, format!("client {ci}: flush after reading: {e}")))?;
            if cl.pager.borrow_mut().degraded_pages() == 0 {
                break;
            }
            cl.pager
                .borrow_mut()
                .recover(16)
                .map_err(|e| fail(end, format!("client {ci}: recover after reading: {e}")))?;
        }
    }
    let w = world.borrow();
    for (ci, cl) in clients.iter().enumerate() {
        check::no_garbage(&w, &cl.pager.borrow())
            .map_err(|e| fail(end, format!("client {ci}: {e}")))?;
    }
    drop(w);
    check::within_offers(&mut world.borrow_mut()).map_err(|e| fail(end, e))?;
    {
        let mut w = world.borrow_mut();
        for cl in &clients {
            let c = cl.pager.borrow();
            w.log.pages_migrated += c.counters().pages_migrated;
            w.log.pages_migrated_to_disk += c.counters().pages_migrated_to_disk;
            w.log.pages_migrated_direct += c.counters().pages_migrated_direct;
        }
    }
    for cl in clients {
        cl.pager.borrow_mut().transport_mut().close();
    }
    world
        .borrow_mut()
        .run_for(LEASE_PERIOD_MS * 1000 * (netram_store::LEASE_PERIODS + 2));
    let w = world.borrow();
    check::stores(&w).map_err(|e| fail(end, e))?;
    check::nothing_left(&w).map_err(|e| fail(end, e))?;
    drop(w);
    // Every server back for a while (long enough for SWIM to declare what died and to merge
    // parts that lost each other): every membership lists exactly them, at their boots.
    world.borrow_mut().run_for(20_000_000);
    let w = world.borrow();
    w.membership_agrees().map_err(|e| fail(end, e))?;
    report.virtual_ms = w.now / 1000;
    report.faults = w.log;
    Ok(report)
}

/// What each client's maintenance thread does with the local daemon's membership
/// (`netram_client::maintain`): a server declared down, at the boot that is running (an older
/// boot's connections fail by themselves), is probed at once; the client fails it only on its
/// own evidence (the probe's connection broke or timed out). The daemon may lie
/// (`Faults::membership_lie`), both ways: it declares a live server down, or keeps a real
/// death to itself; neither may cost a page.
fn follow_membership(
    world: &Rc<RefCell<World>>,
    clients: &mut [Client],
    report: &mut Report,
) -> Result<(), String> {
    let mut downs = world.borrow_mut().take_declared_down();
    {
        let mut w = world.borrow_mut();
        let lie = w.faults.membership_lie;
        if lie > 0.0 {
            // A real death withheld: the clients find it by their own probes.
            let before = downs.len();
            downs.retain(|_| w.rng.bool());
            w.log.membership_lies += (before - downs.len()) as u32;
            if w.rng.f64() < lie {
                // A live server declared down.
                let up: Vec<usize> = (0..w.servers.len()).filter(|&s| w.servers[s].up).collect();
                if !up.is_empty() {
                    let s = up[w.rng.usize(0..up.len())];
                    let boot = w.boot(s);
                    w.log.membership_lies += 1;
                    w.note(format_args!("membership lies: server {s} declared down"));
                    downs.push((s, boot));
                }
            }
        }
    }
    for (server, boot) in downs {
        // A renewed identity (declared down, it rejoined) keeps its boot's high bits.
        if world.borrow().boot(server) != boot & !((1 << 20) - 1) {
            continue;
        }
        for cl in clients.iter_mut() {
            let alive = cl
                .pager
                .borrow_mut()
                .servers()
                .nth(server)
                .is_some_and(|(_, alive)| alive);
            if !alive {
                continue;
            }
            let probed = cl.pager.borrow_mut().probe_server(server);
            match probed {
                Ok(dead) => {
                    if dead {
                        world.borrow_mut().log.members_failed_by_clients += 1;
                    }
                }
                Err(e) if cl.disk_failure_explains(&e) => report.disk_errors_reported += 1,
                Err(e) => return Err(format!("client {}: probe: {e}", cl.model.client)),
            }
        }
    }
    Ok(())
}

/// One tick of a client's maintenance schedule at virtual time `now`.
fn tick(cl: &mut Client, now: u64, report: &mut Report) -> Result<(), String> {
    let result = cl.pager.borrow_mut().on_tick(now);

    match result {
        Ok(t) => {
            report.replies_polled += t.replies as u64;
            report.revived += t.revived as u64;
            report.rebuilds_started += t.rebuilt as u64;
            report.ticks += 1;
            Ok(())
        }
        Err(e) if cl.disk_failure_explains(&e) => {
            report.disk_errors_reported += 1;
            Ok(())
        }
        Err(e) => Err(format!("maintenance: {e}")),
    }
}

/// Crashes, partitions, slowdowns and offers moving, drawn from the world's generator.
fn inject_faults(w: &mut World, sc: &Scenario, crash_chance: f64) {
    let f = sc.faults.clone();
    if w.log.crashes < f.crashes && w.rng.f64() < crash_chance {
        let up: Vec<usize> = (0..w.servers.len()).filter(|&s| w.servers[s].up).collect();
        if !up.is_empty() {
            let s = up[w.rng.usize(0..up.len())];
            let downtime = w.rng.u64(200_000..3_000_000);
            w.crash(s, downtime);
        }
    }
    if f.partition > 0.0 && w.rng.f64() < f.partition {
        let (c, s) = (w.rng.usize(0..sc.clients), w.rng.usize(0..sc.servers));
        let d = w.rng.u64(50_000..2_000_000);
        w.partition(c, s, d);
    }
    if f.slow > 0.0 && w.rng.f64() < f.slow {
        let s = w.rng.usize(0..sc.servers);
        let d = w.rng.u64(100_000..2_000_000);
        w.slow_down(s, d);
    }
    if f.gossip_cut > 0.0 && w.rng.f64() < f.gossip_cut {
        let s = w.rng.usize(0..sc.servers);
        let d = w.rng.u64(2_000_000..8_000_000);
        w.cut_gossip(s, d);
    }
    if f.offer > 0.0 && w.rng.f64() < f.offer {
        let s = w.rng.usize(0..sc.servers);
        let arena = w.servers[s].store.arena_pages();
        let frames = w.rng.u64(0..=arena);
        w.move_offer(s, frames);
    }
}

/// Writes `pages` one by one with [`Pager::try_write`], the pages it refuses with
/// [`Pager::write`], then sends what was queued; or, `batched`, with
/// [`Pager::try_write_many`], a page it stops at with [`Pager::write`].
fn try_write_many<T: netram_pager::Transport, D: netram_pager::Disk>(
    pager: &mut Pager<T, D>,
    pages: &[u64],
    data: &[u8],
    batched: bool,
) -> Result<(), PagerError> {
    if batched {
        let mut done = 0;
        while done < pages.len() {
            done += pager.try_write_many(&pages[done..], &data[done * PAGE_SIZE..])?;
            if done < pages.len() {
                pager.write(pages[done], &data[done * PAGE_SIZE..(done + 1) * PAGE_SIZE])?;
                done += 1;
            }
        }
        return Ok(());
    }
    for (i, &p) in pages.iter().enumerate() {
        let page = &data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
        if !pager.try_write(p, page)? {
            pager.write(p, page)?;
        }
    }
    pager.send_queued();
    Ok(())
}
