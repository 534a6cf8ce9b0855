//! The cluster behind `netram cache` (GMS, paper 000, §3.2 and §4.5; issue 39): where the pages
//! this machine drops go, and where a miss looks before the source.
//!
//! - **putpage**: a page leaving this machine's budget goes into an outbox; a sender thread
//!   takes it from there in batches, asks the epoch's plan (`netram_policy::gms::epoch::Plan`,
//!   as this machine's daemon adopted it: `GET /gms` on its control socket) where it goes —
//!   dropped if at least MinAge old or if the cluster has no idle memory, otherwise to member
//!   i with probability wᵢ/M — and sends it there (PUT_CACHED). A page still in the outbox
//!   when it is read again is taken back from there.
//! - **getpage**: this machine remembers where each page it sent was taken (its own page-frame
//!   directory, [`Directory`]); a miss asks that member for it (GET_CACHED, take: a global
//!   page has one copy, §4.5) and falls back to the source when it is gone.
//!
//! **A page from the cluster is believed only if it is the page this machine sent.** The
//! wire's crc32c catches damage, not a member that lies (anyone can compute one), so this
//! machine keeps, for every page it sends, a SipHash-1-3 of the uid and the contents under a
//! key drawn at start that never leaves the process: a member cannot make another page match
//! it. A page that does not match is counted and read from the source.
//!
//! - **shared pages** (a source named the same on several machines, `--source-name`): the
//!   pages that come into this machine's memory are registered at their homes in the
//!   global-cache directory, and a page leaving is first asked about there
//!   ([`crate::shared::Registry`], one GCD_UPDATE per home and batch): if another machine
//!   holds it in its own memory it is a duplicate, and goes first (see [`Cluster::evicted`]),
//!   so the cluster's idle memory goes to pages nobody else has when it is short.
//!
//! Advice never outweighs the data: the plan only says where pages go, so a wrong or lying
//! plan costs speed (pages dropped, or sent where they are refused), never correctness; so
//! does the directory (it says who holds a page, and nobody reads a page because of it).

use crate::shared::{Answer, Registry, Update};
use netram_member::PlanView;
use netram_net::{Call, CallError, Patience, Security};
use netram_policy::gms::directory::Pod;
use netram_policy::gms::epoch::{DropReason, Evict, Plan};
use netram_policy::gms::Uid;
use netram_proto::gms::{self as wire, CachedPage, CachedStatus};
use netram_proto::{Hello, HELLO_END_ON_CLOSE, MAX_BATCH};
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::pages::PAGE;

/// How often the plan and the members' addresses are read again from the daemon.
const REFRESH: Duration = Duration::from_secs(1);
/// Pages waiting to leave at most; a reader that would add more waits (4 MiB).
const OUTBOX_MAX: usize = 1024;
/// Pages sent in one PUT_CACHED.
const BATCH: usize = 64;
/// Pages come into memory remembered for the next directory update at most (beyond, they go
/// unregistered: other machines then forward their copies instead of dropping them).
const FRESH_MAX: usize = 1 << 16;
/// Pages come into memory that make a directory update on their own (a full GCD_UPDATE to
/// each of a few homes).
const FRESH_TELL: usize = 512;
const PATIENCE: Patience = Patience {
    connect: Duration::from_millis(500),
    reply: Duration::from_secs(2),
};

/// Where a dropped page goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// GMS: by the epoch's plan (weights and MinAge from every node's page ages).
    #[default]
    Gms,
    /// The baseline GMS §5.5 measures against, N-chance forwarding as far as a client can do
    /// it: every dropped page goes to a member drawn at random, nothing is dropped for its
    /// age, and the member's own receiving rule (give up only an older page) decides; a page
    /// is forwarded once (no recirculation between daemons).
    Random,
}

/// How this machine reaches its cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub placement: Placement,
    /// The local daemon's control socket (`/gms`, `/members`).
    pub daemon: String,
    pub security: Security,
    /// This client's node id in its sessions (its certificate's over TLS).
    pub node: u64,
    /// Pages sent whose whereabouts are remembered at most (the directory's bound).
    pub max_remembered: usize,
    /// The source is named (`--source-name`): its pages' uids are the same on the other
    /// machines that mirror it, and the global-cache directory tracks who holds them.
    pub shared: bool,
}

/// What the cluster did for this machine, one counter per outcome.
#[derive(Debug, Default)]
pub struct ClusterCounters {
    /// Pages sent to a member, taken there (or already there).
    pub forwarded: AtomicU64,
    /// Evicted pages dropped, by reason: at least MinAge old; the cluster has no idle memory
    /// (or no plan yet, or no other member has weight).
    pub dropped_old: AtomicU64,
    pub dropped_no_idle: AtomicU64,
    /// Pages a member refused (its pages were all younger, or this client's quota there is
    /// used up), or that could not be sent (the member unreachable).
    pub forward_refused: AtomicU64,
    pub forward_failed: AtomicU64,
    /// Pages read back from the cluster, verified.
    pub remote_hits: AtomicU64,
    /// Pages the member no longer had (it gave them up for older ones), read from the source.
    pub remote_gone: AtomicU64,
    /// Pages that came back different from what was sent (refused, read from the source).
    pub remote_mismatch: AtomicU64,
    /// Members that could not be asked (read from the source).
    pub remote_failed: AtomicU64,
    /// Pages read back from the outbox before they left.
    pub outbox_hits: AtomicU64,
    /// Directory entries forgotten to stay within `max_remembered`.
    pub forgotten: AtomicU64,
    /// Times the plan or the members could not be read from the daemon.
    pub plan_errors: AtomicU64,
    /// Evicted pages another machine held in its memory (shared pages, §4.5); sent as the
    /// oldest, of those: dropped by the plan (no room to spare), and taken by a member
    /// (counted in `forwarded` too; the others a member refused, in `forward_refused`).
    pub duplicates: AtomicU64,
    pub dropped_duplicate: AtomicU64,
    pub forwarded_duplicate: AtomicU64,
    /// GCD_UPDATEs sent to the pages' homes, and those that failed (unanswered).
    pub gcd_updates: AtomicU64,
    pub gcd_failed: AtomicU64,
    /// This machine's pages registered in the directory now; registrations a home refused
    /// (this machine's share there used up); homes started over (they lost the entries, could
    /// not be reached, or the members changed).
    pub gcd_registered: AtomicU64,
    pub gcd_refused: AtomicU64,
    pub gcd_resyncs: AtomicU64,
    /// The epoch of the plan in use.
    pub epoch: AtomicU64,
}

impl ClusterCounters {
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("forwarded", g(&self.forwarded)),
            ("dropped_old", g(&self.dropped_old)),
            ("dropped_no_idle", g(&self.dropped_no_idle)),
            ("forward_refused", g(&self.forward_refused)),
            ("forward_failed", g(&self.forward_failed)),
            ("remote_hits", g(&self.remote_hits)),
            ("remote_gone", g(&self.remote_gone)),
            ("remote_mismatch", g(&self.remote_mismatch)),
            ("remote_failed", g(&self.remote_failed)),
            ("outbox_hits", g(&self.outbox_hits)),
            ("forgotten", g(&self.forgotten)),
            ("plan_errors", g(&self.plan_errors)),
            ("duplicates", g(&self.duplicates)),
            ("dropped_duplicate", g(&self.dropped_duplicate)),
            ("forwarded_duplicate", g(&self.forwarded_duplicate)),
            ("gcd_updates", g(&self.gcd_updates)),
            ("gcd_failed", g(&self.gcd_failed)),
            ("gcd_registered", g(&self.gcd_registered)),
            ("gcd_refused", g(&self.gcd_refused)),
            ("gcd_resyncs", g(&self.gcd_resyncs)),
            ("epoch", g(&self.epoch)),
        ]
    }
}

/// A home's answer to a directory update, and per page leaving whether another machine
/// holds it.
type Answered = (Answer, Vec<bool>);

/// The age a page leaving is sent with when another machine holds it in its own memory (a
/// duplicate): older than any page can be, so that it is the first to go everywhere (see
/// [`Cluster::evicted`]).
const DUPLICATE_AGE_MS: u64 = u32::MAX as u64;

/// A page leaving: its uid, its age (ms since last read), its contents.
type Leaving = (Uid, u64, Box<[u8]>);

/// Where a page sent was taken, and what it was.
#[derive(Debug, Clone, Copy)]
struct Sent {
    node: u64,
    mac: u64,
}

/// This machine's page-frame directory for the pages it sent: uid → member, the oldest
/// forgotten first beyond its bound (a forgotten page is read from the source).
type Directory = lru::LruCache<Uid, Sent>;

#[derive(Debug, Default)]
struct Outbox {
    pages: HashMap<Uid, (u64, Box<[u8]>)>,
    order: VecDeque<Uid>,
    /// Pages that came into memory since the last directory update (shared sources only):
    /// taken with the pages leaving, so that the two are told in the order they happened.
    fresh: Vec<Uid>,
}

/// The plan in use and the members' addresses.
#[derive(Debug)]
struct View {
    plan: Plan,
    me: u64,
    addrs: HashMap<u64, SocketAddr>,
    read_at: Option<Instant>,
}

/// The cluster as `Pages` uses it.
pub struct Cluster {
    cfg: ClusterConfig,
    /// SipHash-1-3 under a key drawn at start (std's `RandomState`).
    mac_key: std::collections::hash_map::RandomState,
    directory: Mutex<Directory>,
    outbox: Mutex<Outbox>,
    /// What the global-cache directory knows of this machine's pages (shared sources only).
    registry: Mutex<Registry>,
    /// Signalled when the outbox gains a page (the sender) or loses some (waiting readers).
    outbox_changed: Condvar,
    view: Mutex<View>,
    conns: Mutex<HashMap<u64, Arc<Mutex<Call>>>>,
    stop: AtomicBool,
    pub counters: ClusterCounters,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("daemon", &self.cfg.daemon)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why a round trip to a member failed.
#[derive(Debug, thiserror::Error)]
enum TripError {
    #[error("no address known")]
    NoAddress,
    #[error("{0} is beyond loopback: clear TCP (--insecure) goes no further")]
    Insecure(SocketAddr),
    #[error(transparent)]
    Call(#[from] CallError),
    #[error("bad reply: {0}")]
    Decode(#[from] netram_proto::DecodeError),
    #[error("reply does not answer the request")]
    Mismatch,
}

impl Cluster {
    /// Reads the plan once (a daemon that cannot be asked is an error at start) and starts
    /// the sender thread.
    pub fn start(cfg: ClusterConfig) -> io::Result<(Arc<Self>, std::thread::JoinHandle<()>)> {
        let max = std::num::NonZeroUsize::new(cfg.max_remembered.max(1)).expect("at least one");
        let c = Arc::new(Self {
            cfg,
            mac_key: Default::default(),
            directory: Mutex::new(lru::LruCache::new(max)),
            outbox: Mutex::new(Outbox::default()),
            registry: Mutex::new(Registry::default()),
            outbox_changed: Condvar::new(),
            view: Mutex::new(View {
                plan: Plan::empty(0, 0, 0),
                me: 0,
                addrs: HashMap::new(),
                read_at: None,
            }),
            conns: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            counters: ClusterCounters::default(),
        });
        c.refresh().map_err(io::Error::other)?;
        let sender = {
            let c = c.clone();
            std::thread::Builder::new()
                .name("netram-cache-put".into())
                .spawn(move || c.sender_loop())?
        };
        Ok((c, sender))
    }

    /// Ends the sender thread once the outbox is empty.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.outbox_changed.notify_all();
    }

    fn mac(&self, uid: Uid, data: &[u8]) -> u64 {
        let mut h = self.mac_key.build_hasher();
        h.write_u128(uid.0);
        h.write(data);
        h.finish()
    }

    /// Reads the plan and the members from the daemon.
    fn refresh(&self) -> Result<(), String> {
        let t = Duration::from_secs(2);
        let plan =
            netram_client::discover::gms_plan(&self.cfg.daemon, t).map_err(|e| e.to_string())?;
        let members =
            netram_client::discover::members(&self.cfg.daemon, t).map_err(|e| e.to_string())?;
        let mut v = lock(&self.view);
        v.plan = plan_of(&plan);
        v.me = plan.node;
        v.addrs = members
            .members
            .iter()
            .filter(|m| m.state != netram_member::Liveness::Down)
            .map(|m| (m.node, m.addr))
            .collect();
        v.read_at = Some(Instant::now());
        self.counters.epoch.store(plan.epoch, Ordering::Relaxed);
        Ok(())
    }

    /// A page leaves this machine's budget, `age_ms` after its last read.
    ///
    /// **Duplicates go first.** A page of a shared source that another machine holds in its
    /// own memory (the directory says so when it leaves) is sent as older than any other
    /// page: the plan drops it whenever the cluster has no room to spare (its age is above
    /// any MinAge), and a daemon gives it a free frame only, and gives that frame up before
    /// any other page's. GMS drops such a page outright (§4.5) because any node can copy it
    /// from the holder's memory (fault case 4); this machine cannot (it has no way to tell
    /// another machine's copy from a forgery, see ARCHITECTURE.md), so a duplicate is as
    /// useful to it as any page while there is room, and is the first to go when there is not.
    pub fn evicted(&self, uid: Uid, age_ms: u64, page: Box<[u8]>) {
        let age_ms = age_ms.min(DUPLICATE_AGE_MS - 1);
        let mut o = lock(&self.outbox);
        while o.pages.len() >= OUTBOX_MAX && !self.stop.load(Ordering::Relaxed) {
            o = self
                .outbox_changed
                .wait(o)
                .unwrap_or_else(|p| p.into_inner());
        }
        if o.pages.insert(uid, (age_ms, page)).is_none() {
            o.order.push_back(uid);
        }
        drop(o);
        self.outbox_changed.notify_all();
    }

    /// Pages that came into this machine's memory (read from the source or the cluster), to
    /// register at their homes with the next directory update.
    pub fn resident(&self, uids: &[Uid]) {
        if !self.cfg.shared || uids.is_empty() {
            return;
        }
        let mut o = lock(&self.outbox);
        let room = FRESH_MAX.saturating_sub(o.fresh.len());
        o.fresh.extend(uids.iter().take(room).copied());
    }

    /// The pages `uids`, from the outbox or from the members they were sent to (one request
    /// per member), each verified; `None` where it must be read from the source.
    pub fn fetch_many(&self, uids: &[Uid]) -> Vec<Option<Box<[u8]>>> {
        let mut out: Vec<Option<Box<[u8]>>> = vec![None; uids.len()];
        {
            let mut o = lock(&self.outbox);
            for (i, uid) in uids.iter().enumerate() {
                // Its place in `order` is skipped when the sender comes to it.
                if let Some((_, page)) = o.pages.remove(uid) {
                    out[i] = Some(page);
                    self.counters.outbox_hits.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.outbox_changed.notify_all();
        let mut by_node: HashMap<u64, Vec<(usize, Sent)>> = HashMap::new();
        {
            let mut dir = lock(&self.directory);
            for (i, uid) in uids.iter().enumerate() {
                if out[i].is_none() {
                    if let Some(sent) = dir.pop(uid) {
                        by_node.entry(sent.node).or_default().push((i, sent));
                    }
                }
            }
        }
        // One request per member, all members at once: a read's pages are spread over them.
        let got: Vec<(usize, Box<[u8]>)> = if by_node.len() <= 1 {
            by_node
                .iter()
                .flat_map(|(&node, asked)| self.fetch_from(node, asked, uids))
                .collect()
        } else {
            std::thread::scope(|s| {
                let asks: Vec<_> = by_node
                    .iter()
                    .map(|(&node, asked)| s.spawn(move || self.fetch_from(node, asked, uids)))
                    .collect();
                asks.into_iter()
                    .flat_map(|h| h.join().unwrap_or_default())
                    .collect()
            })
        };
        for (i, page) in got {
            out[i] = Some(page);
        }
        out
    }

    /// Takes pages `asked` (their index in `uids`, and what was sent) from member `node`;
    /// those that came back as they were sent.
    fn fetch_from(
        &self,
        node: u64,
        asked: &[(usize, Sent)],
        uids: &[Uid],
    ) -> Vec<(usize, Box<[u8]>)> {
        let bump = |c: &AtomicU64, n: u64| {
            c.fetch_add(n, Ordering::Relaxed);
        };
        let mut found = Vec::new();
        for chunk in asked.chunks(MAX_BATCH) {
            let req = wire::Request::GetCached {
                take: true,
                uids: chunk.iter().map(|&(i, _)| uids[i].0).collect(),
            };
            let got = self.round_trip(node, &req, |reply| match reply {
                wire::Reply::GetCached { pages, .. } if pages.len() == chunk.len() => Some(
                    pages
                        .iter()
                        .zip(chunk)
                        .map(|(p, &(i, _))| {
                            p.map(|p| {
                                let mut page = vec![0u8; PAGE].into_boxed_slice();
                                let len = if p.flags.is_zero() { 0 } else { PAGE };
                                // Another page than the one asked for is a mismatch too.
                                let ok = p.uid == uids[i].0 && p.verify() && p.data.len() == len;
                                if ok && !p.flags.is_zero() {
                                    page.copy_from_slice(p.data);
                                }
                                (ok, page)
                            })
                        })
                        .collect::<Vec<_>>(),
                ),
                _ => None,
            });
            match got {
                Ok(pages) => {
                    for (p, &(i, sent)) in pages.into_iter().zip(chunk) {
                        match p {
                            Some((true, page)) if self.mac(uids[i], &page) == sent.mac => {
                                bump(&self.counters.remote_hits, 1);
                                found.push((i, page));
                            }
                            Some(_) => {
                                tracing::warn!(
                                    node,
                                    "a page came back different from what was sent"
                                );
                                bump(&self.counters.remote_mismatch, 1);
                            }
                            None => bump(&self.counters.remote_gone, 1),
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(node, "cannot fetch pages: {e}");
                    bump(&self.counters.remote_failed, chunk.len() as u64);
                }
            }
        }
        found
    }

    fn sender_loop(&self) {
        let mut rng = fastrand::Rng::new();
        let mut told = Instant::now();
        loop {
            let (mut batch, fresh, tell) = {
                let mut o = lock(&self.outbox);
                while o.order.is_empty() && !self.stop.load(Ordering::SeqCst) {
                    o = self
                        .outbox_changed
                        .wait_timeout(o, REFRESH)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    if o.order.is_empty() {
                        break;
                    }
                }
                if o.order.is_empty() && self.stop.load(Ordering::SeqCst) {
                    return;
                }
                let mut batch = Vec::new();
                while batch.len() < BATCH * 4 {
                    let Some(uid) = o.order.pop_front() else {
                        break;
                    };
                    if let Some((age, page)) = o.pages.remove(&uid) {
                        batch.push((uid, age, page));
                    }
                }
                // Pages that came are told with pages leaving, or once enough of them are
                // waiting, or a second after the last update: not one message per read.
                let tell =
                    !batch.is_empty() || o.fresh.len() >= FRESH_TELL || told.elapsed() >= REFRESH;
                let fresh = if tell {
                    told = Instant::now();
                    std::mem::take(&mut o.fresh)
                } else {
                    Vec::new()
                };
                (batch, fresh, tell)
            };
            self.outbox_changed.notify_all();
            let stale = lock(&self.view)
                .read_at
                .is_none_or(|t| t.elapsed() >= REFRESH);
            if stale {
                if let Err(e) = self.refresh() {
                    tracing::warn!("cannot read the GMS plan from the daemon: {e}");
                    self.counters.plan_errors.fetch_add(1, Ordering::Relaxed);
                    lock(&self.view).read_at = Some(Instant::now());
                }
            }
            if self.cfg.shared && tell {
                let duplicates = self.ask_directory(&fresh, &batch);
                for (uid, age, _) in &mut batch {
                    if duplicates.contains(uid) {
                        *age = DUPLICATE_AGE_MS;
                    }
                }
                self.counters
                    .duplicates
                    .fetch_add(duplicates.len() as u64, Ordering::Relaxed);
            }
            if !batch.is_empty() {
                self.send(batch, &mut rng);
            }
        }
    }

    /// Tells the pages' homes which pages came (`fresh`) and which leave (`batch`), one
    /// GCD_UPDATE per home at a time and the homes in parallel; returns the leaving pages
    /// another machine holds (duplicates).
    fn ask_directory(&self, fresh: &[Uid], batch: &[Leaving]) -> std::collections::HashSet<Uid> {
        let pod = Pod::new(lock(&self.view).addrs.keys().copied());
        let leaving: Vec<Uid> = batch.iter().map(|(u, _, _)| *u).collect();
        let plan = lock(&self.registry).plan(&pod, fresh, &leaving);
        let mut by_home: HashMap<u64, Vec<Update>> = HashMap::new();
        for u in plan {
            by_home.entry(u.home).or_default().push(u);
        }
        let ask = |updates: &[Update]| -> Vec<Answered> {
            let mut out = Vec::new();
            for u in updates {
                let req = wire::Request::GcdUpdate {
                    reset: u.reset,
                    add: u.add.iter().map(|x| x.0).collect(),
                    remove: u.remove.iter().map(|x| x.0).collect(),
                };
                let n = u.remove.len();
                self.counters.gcd_updates.fetch_add(1, Ordering::Relaxed);
                let r = self.round_trip(u.home, &req, |reply| match reply {
                    wire::Reply::GcdUpdate {
                        taken,
                        held,
                        elsewhere,
                        ..
                    } if elsewhere.len() == n => Some((Answer { taken, held }, elsewhere)),
                    _ => None,
                });
                match r {
                    Ok(a) => out.push(a),
                    Err(e) => {
                        tracing::debug!(home = u.home, "cannot update the directory: {e}");
                        self.counters.gcd_failed.fetch_add(1, Ordering::Relaxed);
                        // The rest to this home would fail alike; they are booked as unasked.
                        break;
                    }
                }
            }
            out
        };
        let answers: Vec<(&Vec<Update>, Vec<Answered>)> = if by_home.len() <= 1 {
            by_home.values().map(|u| (u, ask(u))).collect()
        } else {
            std::thread::scope(|s| {
                let asks: Vec<_> = by_home
                    .values()
                    .map(|u| (u, s.spawn(move || ask(u))))
                    .collect();
                asks.into_iter()
                    .map(|(u, h)| (u, h.join().unwrap_or_default()))
                    .collect()
            })
        };
        let mut duplicates = std::collections::HashSet::new();
        let mut reg = lock(&self.registry);
        for (updates, got) in answers {
            for (i, u) in updates.iter().enumerate() {
                let answer = got.get(i);
                reg.answered(u, answer.map(|a| a.0));
                if let Some((_, elsewhere)) = answer {
                    duplicates.extend(
                        u.remove
                            .iter()
                            .zip(elsewhere)
                            .filter(|(_, &e)| e)
                            .map(|(x, _)| *x),
                    );
                }
            }
        }
        let c = &self.counters;
        c.gcd_registered.store(reg.len() as u64, Ordering::Relaxed);
        c.gcd_refused.store(reg.refused, Ordering::Relaxed);
        c.gcd_resyncs.store(reg.resyncs, Ordering::Relaxed);
        duplicates
    }

    /// Sends each page where the plan says, or drops it. Pages whose member cannot be reached
    /// are drawn again once among the others (the plan still weighs a member that died until
    /// the next epoch).
    fn send(&self, batch: Vec<Leaving>, rng: &mut fastrand::Rng) {
        let mut failed = std::collections::HashSet::new();
        let mut retry = Vec::new();
        for (node, pages) in self.place(batch, &failed, rng) {
            for chunk in pages.chunks(BATCH.min(MAX_BATCH)) {
                if !self.put_to(node, chunk) {
                    failed.insert(node);
                    retry.extend(chunk.iter().cloned());
                }
            }
        }
        if retry.is_empty() {
            return;
        }
        for (node, pages) in self.place(retry, &failed, rng) {
            for chunk in pages.chunks(BATCH.min(MAX_BATCH)) {
                if !self.put_to(node, chunk) {
                    self.counters
                        .forward_failed
                        .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                }
            }
        }
    }

    /// Where each page goes (members in `avoid` left out), or why it is dropped (counted).
    fn place(
        &self,
        batch: Vec<Leaving>,
        avoid: &std::collections::HashSet<u64>,
        rng: &mut fastrand::Rng,
    ) -> HashMap<u64, Vec<Leaving>> {
        let mut to: HashMap<u64, Vec<Leaving>> = HashMap::new();
        let v = lock(&self.view);
        let others: Vec<u64> = v
            .addrs
            .keys()
            .copied()
            .filter(|n| *n != v.me && !avoid.contains(n))
            .collect();
        let plan;
        let plan = if avoid.is_empty() {
            &v.plan
        } else {
            // The plan without the members to avoid: their share goes to the others.
            plan = Plan {
                weights: v
                    .plan
                    .weights
                    .iter()
                    .copied()
                    .filter(|(n, _)| !avoid.contains(n))
                    .collect(),
                ..v.plan.clone()
            };
            &plan
        };
        for (uid, age, page) in batch {
            let rule = match self.cfg.placement {
                Placement::Gms => plan.evict(v.me, age, false, rng),
                Placement::Random if others.is_empty() => Evict::Drop(DropReason::NoOtherNode),
                Placement::Random => Evict::Forward(others[rng.usize(..others.len())]),
            };
            match rule {
                Evict::Forward(n) => to.entry(n).or_default().push((uid, age, page)),
                Evict::Drop(_) if age == DUPLICATE_AGE_MS => {
                    self.counters
                        .dropped_duplicate
                        .fetch_add(1, Ordering::Relaxed);
                }
                Evict::Drop(DropReason::Old) => {
                    self.counters.dropped_old.fetch_add(1, Ordering::Relaxed);
                }
                Evict::Drop(_) => {
                    self.counters
                        .dropped_no_idle
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        to
    }

    /// PUT_CACHED of `chunk` to member `node`, each page taken remembered (counted); false if
    /// the member could not be reached.
    fn put_to(&self, node: u64, chunk: &[Leaving]) -> bool {
        let req = wire::Request::PutCached(
            chunk
                .iter()
                .map(|(uid, age, page)| {
                    CachedPage::seal(uid.0, u32::try_from(*age).unwrap_or(u32::MAX), page)
                })
                .collect(),
        );
        let n = chunk.len();
        let r = self.round_trip(node, &req, |reply| match reply {
            wire::Reply::PutCached { status, .. } if status.len() == n => Some(status),
            _ => None,
        });
        let status = match r {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(node, "cannot send pages: {e}");
                return false;
            }
        };
        let mut dir = lock(&self.directory);
        for ((uid, age, page), s) in chunk.iter().zip(status) {
            match s {
                CachedStatus::Taken | CachedStatus::Replaced | CachedStatus::Present => {
                    if *age == DUPLICATE_AGE_MS {
                        self.counters
                            .forwarded_duplicate
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    let mac = self.mac(*uid, page);
                    if dir
                        .push(*uid, Sent { node, mac })
                        .is_some_and(|(u, _)| u != *uid)
                    {
                        self.counters.forgotten.fetch_add(1, Ordering::Relaxed);
                    }
                    self.counters.forwarded.fetch_add(1, Ordering::Relaxed);
                }
                CachedStatus::Refused | CachedStatus::Corrupt => {
                    self.counters
                        .forward_refused
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        true
    }

    /// One request to member `node` and its reply, read by `answer` (`None`: not an answer
    /// to it). Tried twice on a connection that broke (both requests may be repeated: a page
    /// put twice is `Present`, a page taken twice is gone the second time, read from the
    /// source).
    fn round_trip<T>(
        &self,
        node: u64,
        req: &wire::Request<'_>,
        answer: impl Fn(wire::Reply<'_>) -> Option<T>,
    ) -> Result<T, TripError> {
        let addr = lock(&self.view)
            .addrs
            .get(&node)
            .copied()
            .ok_or(TripError::NoAddress)?;
        if matches!(self.cfg.security, Security::Insecure) && !addr.ip().is_loopback() {
            return Err(TripError::Insecure(addr));
        }
        let conn = lock(&self.conns).entry(node).or_default().clone();
        let mut conn = lock(&conn);
        let mut last = None;
        for _ in 0..2 {
            let hello = || {
                Hello::new(self.cfg.node, incarnation(), fastrand::u64(..))
                    .with_flags(HELLO_END_ON_CLOSE)
            };
            let r = conn
                .call(
                    node,
                    addr,
                    hello,
                    &self.cfg.security,
                    PATIENCE,
                    |id, buf| req.encode(id, buf),
                )
                .map_err(TripError::from)
                .and_then(|(id, frame)| {
                    let (got, reply) = wire::decode_reply(&frame)?;
                    if got != id {
                        return Err(TripError::Mismatch);
                    }
                    answer(reply).ok_or(TripError::Mismatch)
                });
            match r {
                Ok(t) => return Ok(t),
                Err(TripError::Call(CallError::FailedRecently)) => {
                    return Err(CallError::FailedRecently.into())
                }
                Err(e) => {
                    conn.reset();
                    last = Some(e);
                }
            }
        }
        conn.fail();
        Err(last.expect("two tries failed"))
    }
}

/// The plan as the daemon gave it, in the policy's terms.
fn plan_of(v: &PlanView) -> Plan {
    Plan {
        epoch: v.epoch,
        initiator: v.initiator,
        m: v.m,
        min_age_ms: v.min_age_ms,
        duration_ms: v.duration_ms,
        weights: v.weights.clone(),
    }
}

/// This process's incarnation: its start, in nanoseconds of wall-clock time.
fn incarnation() -> u64 {
    static AT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *AT.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    })
}
