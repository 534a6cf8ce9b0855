//! The pager's machinery under its redundancy scheme: its state ([`Pager`]), its public
//! operations, and everything that moves a page — the slot pool and cache, reads and reads by
//! ticket, write-back, requests and replies, migration, maintenance (see the crate's docs for
//! the map). The schemes (`crate::scheme`) sit beside it, not inside, so the pager's fields
//! are private to them: a scheme uses the pager's operations (take a slot, queue a PUT, finish
//! a write-back, …) and what `hooks.rs` gives it (the page table, counters, servers, the
//! write-backs in flight, its own state).

mod cache;
pub(crate) mod handover;
mod hooks;
mod invariants;
pub(crate) mod maintenance;
pub(crate) mod migrate;
pub(crate) mod read;
pub(crate) mod reply;
pub(crate) mod requests;
pub(crate) mod seal;
pub(crate) mod ticket;
pub(crate) mod writeback;

use crate::scheme::{self, Redundancy, SchemeState, Sealed, Shape};
use crate::table::Table;
use crate::{Disk, PagerConfig, PagerCounters, PagerError, Scheme, ServerInfo, Transport};
use lru::LruCache;
use netram_policy::placement::Candidate;
use netram_proto::{PageKey, Request, PAGE_SIZE};
use reply::Followup;
pub(crate) use requests::Op;
use requests::{GetItem, Inflight, Queued, ReadDone};
use seal::Sealer;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fmt;
use writeback::Writeback;

/// What keeps a page safe, as [`Pager::pieces`] lists it: (server, key, version) of each copy
/// or stripe piece.
pub type Pieces = Vec<(usize, PageKey, u32)>;

/// A flush in progress that never waits ([`Pager::start_flush`], [`Pager::try_flush`]).
#[derive(Debug)]
pub struct Flush {
    /// Pages dirty when it started and not written back yet.
    pages: Vec<u64>,
    /// Once they all are: the point everything sent before must be answered by.
    barrier: Option<requests::Barrier>,
    /// Rounds of sealing what the scheme kept open.
    rounds: u32,
}

impl Flush {
    /// Pages it has still to write back (0 once it waits for their acknowledgements).
    pub fn pages_left(&self) -> usize {
        self.pages.len()
    }
}

/// Where a page's current version lives, by the page table ([`Pager::location`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageLocation {
    pub version: u32,
    /// Servers (by index) whose copy is the current version.
    pub holders: Vec<usize>,
    pub on_disk: bool,
    /// The holders' copies are gone (their server came back empty).
    pub lost: bool,
}

/// The "server" a lost Reed-Solomon page names when no piece of it has a server left.
pub(crate) const STRIPE_LOST: usize = usize::MAX;

#[derive(Debug)]
pub(crate) struct ServerState {
    pub(crate) info: ServerInfo,
    pub(crate) alive: bool,
    pub(crate) dead_reason: String,
    pub(crate) load: Candidate,
    /// Pages of ours it wants moved away, as its last reply said (its offer shrank; it takes
    /// no new page meanwhile: the free pages it reports are none).
    pub(crate) leaving: u32,
    /// The `leaving` at which a migration step last found nothing of ours to move there
    /// (parity pages, which only their holder knows; pages in write-back): not looked for
    /// again until it changes or the next probe.
    pub(crate) leaving_stuck: u32,
    /// How many of its replies have brought a `leaving` other than the one before: what a
    /// leaving holder's scan answer is dated by (`Pager::par_release_holder`).
    pub(crate) leaving_changes: u64,
}

impl ServerState {
    /// A server as its handshake left it: alive if it connected, with the free pages it
    /// announced.
    fn new(info: ServerInfo) -> Self {
        Self {
            alive: info.connected.is_ok(),
            dead_reason: info.connected.clone().err().unwrap_or_default(),
            load: Candidate {
                alive: info.connected.is_ok(),
                free_pages: info.free_pages,
                requests_per_s: 0,
            },
            leaving: 0,
            leaving_stuck: 0,
            leaving_changes: 0,
            info,
        }
    }
}

/// The pager. Single-threaded: every call runs to completion on the caller's thread, which
/// writes requests and reads replies itself (no hand-off to another thread on the critical path).
pub struct Pager<T: Transport, D: Disk> {
    transport: T,
    disk: D,
    cfg: PagerConfig,
    table: Table,
    servers: Vec<ServerState>,
    /// Page buffers: `cache_pages + staging` slots of PAGE_SIZE bytes.
    slots: Vec<u8>,
    /// Slots meant for write-backs in flight: a full window and a batch per server at start.
    /// What [`Pager::try_write`] leaves in write-back at most, so that writes that do not wait
    /// do not take the slots of recovery (nor grow the process by them).
    staging: usize,
    free_slots: Vec<u32>,
    dirty: Vec<bool>,
    /// Slots holding ciphertext (`seal.rs`): those of write-backs, and what a scheme rebuilds
    /// before it is opened.
    sealed: Vec<bool>,
    /// The pages' seal, when they travel sealed.
    sealer: Option<Sealer>,
    cache: LruCache<u64, u32>,
    /// Pages whose write-back is in flight, with the slot holding their data.
    writeback: HashMap<u64, Writeback>,
    /// What keeps pages safe when a server dies ([`scheme`]), what it keeps, and its numbers.
    scheme: &'static dyn Redundancy<T, D>,
    scheme_state: SchemeState,
    shape: Shape,
    /// Pages whose read for a move through this pager is out (`migrate.rs`), with the
    /// version read, the server they leave and the slot read into (a page's move and a
    /// parity survivor read of it can be out together).
    moving: std::collections::BTreeMap<u64, (u32, usize, u32)>,
    /// Pages of `rebuilding` or `moving` whose read failed on every copy, for the next step.
    own_failed: Vec<u64>,
    /// Pages on their way off a leaving server (`migrate.rs`), counted when they land.
    migrating: BTreeSet<u64>,
    /// Pages moving straight from server to server (`handover.rs`).
    handing: std::collections::BTreeMap<u64, usize>,
    /// (old, new) server pairs whose old server would not hand over to the new one (it does
    /// not count it a member of its cluster): their pages move through this pager instead,
    /// until one of the two restarts (`handover.rs`).
    no_direct: BTreeSet<(usize, usize)>,
    /// Where the next search for pages to move starts in the page table.
    migrate_cursor: u64,
    /// Pages kept in the cache, dirty, because the local disk failed to write them and no
    /// server holds their current version: the cache may exceed its budget by these.
    rehomed: BTreeSet<u64>,
    /// Pages the cache may hold over its budget because an eviction that would have waited
    /// was left for a later call (`evict_without_waiting`); zero once it is within budget.
    evictions_deferred: usize,
    /// Slots [`Pager::write_over_budget`] added to the pool (never taken back).
    spare_slots: usize,
    /// The local disk's last failed write, reported by the next `flush` (as fsync does).
    disk_failed: Option<std::io::Error>,
    /// GETs that failed on one copy, to be tried on another.
    retry: Vec<GetItem>,
    /// The pager's own finished reads (recovery, migration through the owner): page and slot.
    fetched: Vec<(u64, u32)>,
    /// Reads whose piece is out of reach, to be decoded from the rest of their stripe.
    reconstruct: Vec<GetItem>,
    inflight: Inflight,
    /// Per server: requests not sent yet, oldest first.
    queues: Vec<VecDeque<Queued>>,
    /// Per server: how many requests have ever left its queue (sent, or failed over with a
    /// dead server): what a [`requests::Barrier`] counts.
    dequeued: Vec<u64>,
    followups: Vec<Followup>,
    reads_done: Vec<ReadDone>,
    /// Reads by ticket (`ticket.rs`) finished and not yet taken, and how many were started
    /// and not yet taken.
    finished: Vec<ticket::Finished>,
    tickets: usize,
    /// Reads by ticket started when no slot could be had without waiting (page, tag), in
    /// the order started: each starts once a slot is at hand (`ticket.rs`).
    slot_waiters: VecDeque<(u64, u64)>,
    /// The waiting caller's reads (`read.rs`) not yet copied out or reported: it waits for
    /// these, not for everything in flight.
    caller_reads: usize,
    lost: Vec<(usize, u64)>,
    corrupt: Option<(usize, u64, &'static str)>,
    next_req: u64,
    /// Replies being handled (nested when handling one waits for another) and non-waiting
    /// writes (`try_write`, `try_discard`) under way, and the waits that happened meanwhile:
    /// neither may wait (requests without credits stay queued), and `check_invariants`
    /// counts any wait.
    must_not_wait: u32,
    forbidden_waits: u64,
    /// When the maintenance tasks last ran ([`Pager::on_tick`]).
    schedule: maintenance::Schedule,
    rng: fastrand::Rng,
    counters: PagerCounters,
}

impl<T: Transport, D: Disk> fmt::Debug for Pager<T, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pager")
            .field("cfg", &self.cfg)
            .field("servers", &self.servers)
            .field("counters", &self.counters)
            .finish()
    }
}

impl<T: Transport, D: Disk> Pager<T, D> {
    pub fn new(cfg: PagerConfig, transport: T, disk: D) -> Self {
        assert!(cfg.window > 0 && cfg.writeback_batch > 0 && cfg.batch_max > 0);
        assert!(
            cfg.seal.is_some() || !transport.leaves_pages_to_pager(),
            "a transport that leaves pages' authenticity to the pager needs a pager that seals"
        );
        let reply_timeout_us = transport.reply_timeout_us();
        let batch_max = cfg
            .batch_max
            .min(cfg.window as usize)
            .min(netram_proto::MAX_BATCH);
        let servers: Vec<ServerState> = transport
            .servers()
            .into_iter()
            .map(ServerState::new)
            .collect();
        // Per server: a full window in flight plus a batch being filled.
        let staging: usize = servers
            .iter()
            .map(|s| s.info.window.min(cfg.window) as usize + batch_max)
            .sum::<usize>()
            .max(cfg.writeback_batch)
            .max(1);
        let scheme::Built {
            scheme,
            state: scheme_state,
            shape,
        } = scheme::build(&cfg, &servers);
        let rebuilding = shape.recovery_slots;
        let nslots = cfg.cache_pages + staging + rebuilding;
        Self {
            transport,
            disk,
            table: Table::new(cfg.pages, shape.copies),
            scheme,
            scheme_state,
            shape,
            moving: std::collections::BTreeMap::new(),
            own_failed: Vec::new(),
            migrating: BTreeSet::new(),
            handing: std::collections::BTreeMap::new(),
            no_direct: BTreeSet::new(),
            migrate_cursor: 0,
            rehomed: BTreeSet::new(),
            evictions_deferred: 0,
            spare_slots: 0,
            disk_failed: None,
            retry: Vec::new(),
            fetched: Vec::new(),
            reconstruct: Vec::new(),
            inflight: Inflight {
                ops: HashMap::default(),
                per_server: vec![0; servers.len()],
                order: VecDeque::new(),
                sends: 0,
                marks: VecDeque::new(),
            },
            queues: (0..servers.len()).map(|_| VecDeque::new()).collect(),
            dequeued: vec![0; servers.len()],
            followups: Vec::new(),
            servers,
            slots: vec![0u8; nslots * PAGE_SIZE],
            staging,
            free_slots: (0..nslots as u32).rev().collect(),
            dirty: vec![false; nslots],
            sealed: vec![false; nslots],
            sealer: cfg
                .seal
                .as_ref()
                .map(|k| Sealer::new(k, cfg.region, cfg.pages, cfg.compress)),
            cache: LruCache::unbounded(),
            writeback: HashMap::new(),
            reads_done: Vec::new(),
            finished: Vec::new(),
            tickets: 0,
            slot_waiters: VecDeque::new(),
            caller_reads: 0,
            lost: Vec::new(),
            corrupt: None,
            next_req: 1,
            must_not_wait: 0,
            forbidden_waits: 0,
            schedule: maintenance::Schedule::with_reply_timeout(reply_timeout_us),
            rng: fastrand::Rng::with_seed(cfg.seed),
            counters: PagerCounters::default(),
            cfg: PagerConfig { batch_max, ..cfg },
        }
    }

    /// Starts using a server that joined the cluster after the pager was opened (the client
    /// runtime learns of it from its machine's daemon): the transport connects to it, and it
    /// takes new pages from then on, with the staging slots of its window. Not under
    /// `parity:N`, whose groups name every server by an address fixed at start. Returns its
    /// index.
    pub fn add_server(&mut self, name: &str) -> Result<usize, PagerError> {
        if matches!(self.cfg.redundancy, Scheme::Parity { .. }) {
            return Err(PagerError::AddServer(
                "parity:N uses the servers it started with".into(),
            ));
        }
        let info = self
            .transport
            .add_server(name)
            .map_err(|e| PagerError::AddServer(format!("{name}: {e}")))?;
        let window = info.window.min(self.cfg.window) as usize;
        self.servers.push(ServerState::new(info));
        self.inflight.per_server.push(0);
        self.queues.push(VecDeque::new());
        self.dequeued.push(0);
        // Its staging: a full window in flight and a batch being filled, as at start.
        let more = window + self.cfg.batch_max;
        let first = self.dirty.len() as u32;
        self.slots.resize(self.slots.len() + more * PAGE_SIZE, 0);
        self.dirty.resize(self.dirty.len() + more, false);
        self.sealed.resize(self.sealed.len() + more, false);
        self.free_slots.extend(first..first + more as u32);
        self.staging += more;
        Ok(self.servers.len() - 1)
    }

    pub fn config(&self) -> &PagerConfig {
        &self.cfg
    }

    /// Compresses the pages written back before they are sealed when `rule` says it pays, or
    /// never (`None`), as `PagerConfig::compress` would have (`seal.rs`): for a pager just
    /// opened. False, and nothing changed, for a pager that does not seal or has sealed a
    /// page already (the rule must not change under a page's nonce: `Sealer::set_rule`).
    pub fn set_compression(&mut self, rule: Option<netram_proto::compress::Rule>) -> bool {
        let Some(s) = &mut self.sealer else {
            return false;
        };
        if !s.set_rule(rule) {
            return false;
        }
        self.cfg.compress = rule;
        true
    }
    pub fn counters(&self) -> &PagerCounters {
        &self.counters
    }
    pub fn transport(&self) -> &T {
        &self.transport
    }
    /// Flushes nothing: gives back the transport, e.g. to close its sessions. Call
    /// [`Pager::flush`] first to keep dirty pages.
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }
    /// The local disk, e.g. to tell a test disk to fail or heal.
    pub fn disk_mut(&mut self) -> &mut D {
        &mut self.disk
    }
    pub fn into_transport(self) -> T {
        self.transport
    }
    /// Credits (pages, or one per other request) in flight to a server: a runtime expects
    /// replies from it, and times it out, only while this is above zero.
    pub fn in_flight(&self, server: usize) -> u32 {
        self.inflight.per_server[server]
    }
    /// Names of the servers, with whether each is alive.
    pub fn servers(&self) -> impl Iterator<Item = (&str, bool)> {
        self.servers.iter().map(|s| (s.info.name.as_str(), s.alive))
    }
    /// The servers (by index, in the transport's order) that hold a page's current version.
    pub fn holders(&self, page: u64) -> Vec<usize> {
        self.table.holders(page).to_vec()
    }
    /// Pages whose current version is only on the local disk (spilled or `disk` backing).
    pub fn pages_on_disk_only(&self) -> u64 {
        self.table.pages_on_disk_only()
    }

    /// Where the page table says a page's current version is, for checkers: `None` for a page
    /// never written (or discarded), or whose write-back is in flight or waits to be tried
    /// again after the disk failed it (its holders are changing).
    pub fn location(&self, page: u64) -> Option<PageLocation> {
        let e = self.table.get(page);
        let settled = !self.writeback.contains_key(&page) && !self.rehomed.contains(&page);
        (e.present && settled).then(|| PageLocation {
            version: e.version,
            holders: self.table.holders(page).to_vec(),
            on_disk: e.on_disk,
            lost: e.lost,
        })
    }

    /// Asks every server it counts on for an empty GET and waits for the answers, so that a
    /// server that died while nobody was asking it anything is found out now (Nswap §IV-B3:
    /// recovery starts when a node discovers another is unreachable). Returns how many were
    /// found dead.
    pub fn probe_servers(&mut self) -> Result<usize, PagerError> {
        // What a migration step found unmovable (in write-back, being rebuilt) may have
        // become movable since without the server's count changing: look again.
        self.servers.iter_mut().for_each(|s| s.leaving_stuck = 0);
        self.probe((0..self.servers.len()).collect())
    }

    /// Asks one server for an empty GET and waits for the answer: whether it is dead is
    /// decided by this pager's own evidence (the connection broke, or the reply did not come
    /// in time), never by what others say of it. What a runtime does when the cluster's
    /// membership declares a server down: membership is a hint of where to look, and a
    /// server this pager still reaches keeps its pages (a flooded or lying membership must
    /// not cost a page). Returns whether the server was found dead.
    pub fn probe_server(&mut self, server: usize) -> Result<bool, PagerError> {
        self.probe(vec![server])?;
        Ok(self.servers.get(server).is_some_and(|st| !st.alive))
    }

    fn probe(&mut self, servers: Vec<usize>) -> Result<usize, PagerError> {
        let before = self.counters.servers_dead;
        let mut sent = Vec::new();
        for s in servers {
            if self.servers.get(s).is_some_and(|st| st.alive) {
                let id = self.submit(s, Op::Get(Vec::new()), &Request::Get(Vec::new()));
                sent.extend(id.map(|id| (s, id)));
            }
        }
        // Until each is answered or its server failed (the transport's reply timeout); not
        // waiting for direct migrations: a server answers them once their pages are handed
        // over, and a dead server fails them with the rest.
        self.settle()?;
        while sent
            .iter()
            .any(|&(s, id)| self.servers[s].alive && self.pending(s, id))
        {
            self.complete_one()?;
        }
        Ok((self.counters.servers_dead - before) as usize)
    }

    /// Tries to reconnect every server declared dead; returns how many came back. A server
    /// that comes back is treated as empty (Nswap §IV-B3: a rebooted node has a new identity):
    /// the copies it held count as lost, and it takes new pages from now on.
    pub fn revive_dead_servers(&mut self) -> usize {
        let mut revived = 0;
        for s in 0..self.servers.len() {
            if self.servers[s].alive {
                continue;
            }
            let info = match self.transport.reconnect(s) {
                Ok(info) => info,
                Err(e) => {
                    tracing::debug!(server = %self.servers[s].info.name, "still dead: {e}");
                    continue;
                }
            };
            self.server_revived(s);
            self.no_direct.retain(|&(a, b)| a != s && b != s);
            let st = &mut self.servers[s];
            st.dead_reason = format!("restarted empty after: {}", st.dead_reason);
            st.alive = true;
            st.load = Candidate {
                alive: true,
                free_pages: info.free_pages,
                requests_per_s: 0,
            };
            st.info = info;
            self.counters.servers_revived += 1;
            revived += 1;
            // Copies it acknowledged on the old connection went with the old session.
            for wb in self.writeback.values_mut() {
                wb.done.remove(s);
                wb.keep.remove(s);
            }
        }
        revived
    }

    fn check(&self, page: u64) -> Result<(), PagerError> {
        if page >= self.cfg.pages {
            return Err(PagerError::OutOfRange {
                page,
                pages: self.cfg.pages,
            });
        }
        Ok(())
    }

    // ------------------------------------------------------------------------------------------
    // Public operations
    // ------------------------------------------------------------------------------------------

    /// Writes one page from `data` (PAGE_SIZE bytes).
    pub fn write(&mut self, page: u64, data: &[u8]) -> Result<(), PagerError> {
        self.write_many(&[page], data)
    }

    /// Writes many pages from `data`, one PAGE_SIZE chunk per page. With a cache the pages stay
    /// local until evicted or flushed, and the write-back of evicted pages is sent but not waited
    /// for: their acknowledgements are collected by later calls (at the latest by `flush`),
    /// while their data stays in staging slots, readable and ready to be placed elsewhere should
    /// their server fail. Without a cache the pages are written out before this returns.
    pub fn write_many(&mut self, pages: &[u64], data: &[u8]) -> Result<(), PagerError> {
        if data.len() != pages.len() * PAGE_SIZE {
            return Err(PagerError::BadBuffer {
                got: data.len(),
                pages: pages.len(),
            });
        }
        pages.iter().try_for_each(|&p| self.check(p))?;
        for (pos, &page) in pages.iter().enumerate() {
            self.counters.writes += 1;
            let src = &data[pos * PAGE_SIZE..(pos + 1) * PAGE_SIZE];
            let cached = self.cache.get(&page).copied();
            if let Some(slot) = cached.filter(|_| self.cfg.cache_pages > 0) {
                self.slot_mut(slot).copy_from_slice(src);
                self.dirty[slot as usize] = true;
                continue;
            }
            // Without a cache, a page is cached only while its last write found no home: this
            // write goes through in its place.
            let slot = match cached {
                Some(slot) => {
                    self.cache.pop(&page);
                    slot
                }
                None => self.take_slot()?,
            };
            self.slot_mut(slot).copy_from_slice(src);
            if self.cfg.cache_pages > 0 {
                self.dirty[slot as usize] = true;
                self.cache.put(page, slot);
                self.evict_over_budget()?;
            } else {
                self.write_back(page, slot)?;
            }
        }
        if self.cfg.cache_pages > 0 {
            // A swap device's writes are evictions of evictions: waiting here for the servers
            // would put a network round trip into every write, and, behind the device's lock,
            // into the reads queued after it. The staging slots bound what is in flight.
            self.send_everything()
        } else {
            // Written means stored: a stripe still open is sealed, full or not, and an open
            // parity group shipped.
            self.settle_writes()?;
            self.disk_outcome()
        }
    }

    /// Writes pages as [`Pager::write_many`] does, in order, as far as that needs no waiting,
    /// and says how many it wrote (a prefix of `pages`): the event-driven form for a front end
    /// that serves several callers and must not hold the pager across a round trip (the NBD
    /// device). It stops before a page that needs a slot when none is free (counting those
    /// that sealing a Reed-Solomon stripe may take), or when the staging slots' worth of
    /// pages is in write-back already; the caller waits for replies
    /// ([`Pager::reply_fds`], [`Pager::poll_from`]) and goes on with the rest. Evictions that
    /// would wait (a victim whose last write-back is in flight) are left for a later call,
    /// the cache over its budget meanwhile. Write-backs are queued and sent as the credits
    /// allow ([`Pager::send_queued`] at the end), never waited for. Without a cache, pages
    /// go to write-back one by one as [`Pager::try_write`] takes them.
    pub fn try_write_many(&mut self, pages: &[u64], data: &[u8]) -> Result<usize, PagerError> {
        if data.len() != pages.len() * PAGE_SIZE {
            return Err(PagerError::BadBuffer {
                got: data.len(),
                pages: pages.len(),
            });
        }
        pages.iter().try_for_each(|&p| self.check(p))?;
        if self.cfg.cache_pages == 0 {
            let mut written = 0;
            for (pos, &page) in pages.iter().enumerate() {
                if !self.try_write(page, &data[pos * PAGE_SIZE..(pos + 1) * PAGE_SIZE])? {
                    break;
                }
                written += 1;
            }
            self.send_queued();
            return Ok(written);
        }
        self.must_not_wait += 1;
        let mut written = 0;
        let mut result = Ok(());
        for (pos, &page) in pages.iter().enumerate() {
            let src = &data[pos * PAGE_SIZE..(pos + 1) * PAGE_SIZE];
            // A new page in the cache evicts another: as `try_write`, the staging slots' worth
            // of pages in write-back at most (under Reed-Solomon a sealed stripe's pages free
            // their slots before they are acknowledged, so the free slots alone would not bound
            // what is in flight).
            let room = self.free_slots.len() > self.shape.seal_slots
                && self.writeback.len() < self.staging;
            let slot = match self.cache.get(&page).copied() {
                Some(slot) => slot,
                None if room => {
                    let slot = self.free_slots.pop().expect("counted above");
                    self.cache.put(page, slot);
                    slot
                }
                None => break,
            };
            self.counters.writes += 1;
            self.slot_mut(slot).copy_from_slice(src);
            self.dirty[slot as usize] = true;
            written += 1;
            if let Err(e) = self.evict_without_waiting() {
                result = Err(e);
                break;
            }
        }
        self.must_not_wait -= 1;
        self.send_queued();
        result.map(|()| written)
    }

    /// Writes `page` without waiting for a slot: into the cache, where [`Pager::write`] would
    /// wait for a write-back's acknowledgement to free one. With no slot free the pool grows
    /// by one page (kept for later use: local memory beyond the budget, up to
    /// [`Pager::spare_slots_max`] pages, after which this waits as `write` does); the cache is
    /// over its budget until later calls evict without waiting. For a caller that cannot keep
    /// the data itself (the userfaultfd handler storing a forked child's page its agent copied
    /// and is dropping): it bounds how many it writes before replies come in.
    pub fn write_over_budget(&mut self, page: u64, data: &[u8]) -> Result<(), PagerError> {
        self.check(page)?;
        if data.len() != PAGE_SIZE {
            return Err(PagerError::BadBuffer {
                got: data.len(),
                pages: 1,
            });
        }
        let cached = self.cache.get(&page).copied();
        let free = self.free_slots.len() > self.shape.seal_slots;
        if cached.is_none() && !free && self.spare_slots >= self.spare_slots_max() {
            self.counters.writes_over_budget_waited += 1;
            return self.write(page, data);
        }
        self.counters.writes += 1;
        let slot = match cached {
            Some(slot) => slot,
            None => {
                let slot = if free {
                    self.free_slots.pop().expect("counted above")
                } else {
                    self.grow_slot()
                };
                self.cache.put(page, slot);
                slot
            }
        };
        self.slot_mut(slot).copy_from_slice(data);
        self.dirty[slot as usize] = true;
        self.must_not_wait += 1;
        let evicted = self.evict_without_waiting();
        self.must_not_wait -= 1;
        self.send_queued();
        evicted
    }

    /// One more slot in the pool, for good (see [`Pager::spare_slots_max`]).
    pub(crate) fn grow_slot(&mut self) -> u32 {
        self.counters.slots_grown += 1;
        self.spare_slots += 1;
        let slot = self.dirty.len() as u32;
        self.slots.resize(self.slots.len() + PAGE_SIZE, 0);
        self.dirty.push(false);
        self.sealed.push(false);
        slot
    }

    /// Pages [`Pager::write_over_budget`] and reads by ticket may add to the slot pool at most: the cache's
    /// and the staging slots' worth again.
    pub fn spare_slots_max(&self) -> usize {
        self.cfg.cache_pages + self.staging
    }

    /// Writes `page` straight to write-back if that needs no waiting, and says whether it did:
    /// the event-driven writer's form of [`Pager::write`] (the userfaultfd handler evicting a
    /// victim). It does not when the page's last write-back is still in flight (versions land
    /// in order), when no slot is free, counting those that sealing a Reed-Solomon stripe
    /// may take besides, or when the staging slots' worth of pages is in write-back already
    /// (the recovery's slots are not for this): then nothing has changed, and the caller keeps the page and tries
    /// again once replies have come in ([`Pager::poll`], [`Pager::on_reply`]). A copy of the
    /// page in the cache is superseded (its slot carries the write). Nothing is sent until
    /// [`Pager::send_queued`], so that a batch of victims leaves in full frames; nothing is
    /// waited for either, not even credits (`write` sends everything it queued first).
    pub fn try_write(&mut self, page: u64, data: &[u8]) -> Result<bool, PagerError> {
        self.check(page)?;
        if data.len() != PAGE_SIZE {
            return Err(PagerError::BadBuffer {
                got: data.len(),
                pages: 1,
            });
        }
        if self.writeback.contains_key(&page) {
            return Ok(false);
        }
        let cached = usize::from(self.cache.contains(&page));
        let needed = 1 + self.shape.seal_slots;
        if self.free_slots.len() + cached < needed || self.writeback.len() >= self.staging {
            return Ok(false);
        }
        self.counters.writes += 1;
        if let Some(stale) = self.cache.pop(&page) {
            // Superseded: given back clean (and marked plaintext) before a slot is taken.
            self.release_slot(stale);
        }
        let slot = self.free_slots.pop().expect("counted above");
        self.slot_mut(slot).copy_from_slice(data);
        self.dirty[slot as usize] = false;
        self.counters.evictions_dirty += 1;
        self.must_not_wait += 1;
        let written = self.write_back(page, slot);
        self.must_not_wait -= 1;
        written.map(|()| true)
    }

    /// Pages [`Pager::try_write`] takes now at most (fewer if some are still in write-back):
    /// what is left of the staging slots.
    pub fn write_room(&self) -> usize {
        self.free_slots
            .len()
            .saturating_sub(self.shape.seal_slots)
            .min(self.staging.saturating_sub(self.writeback.len()))
    }

    /// Forgets `page` as [`Pager::discard`] does if that needs no waiting, and says whether
    /// it did: not while its last write-back is in flight. Its DELETEs go with the next
    /// [`Pager::send_queued`].
    pub fn try_discard(&mut self, page: u64) -> Result<bool, PagerError> {
        self.check(page)?;
        if self.writeback.contains_key(&page) {
            return Ok(false);
        }
        self.must_not_wait += 1;
        let discarded = self.discard_queued(&[page]);
        self.must_not_wait -= 1;
        discarded.map(|()| true)
    }

    /// The local disk's failed write since the last report, if any (the pages it was writing
    /// are still in memory and are written again later).
    fn disk_outcome(&mut self) -> Result<(), PagerError> {
        match self.disk_failed.take() {
            Some(e) => Err(PagerError::Disk(e)),
            None => Ok(()),
        }
    }

    /// The start of a flush that never waits ([`Pager::try_flush`]): the pages dirty in the
    /// cache now. What is written after this is not its concern.
    pub fn start_flush(&self) -> Flush {
        Flush {
            pages: self
                .cache
                .iter()
                .filter(|(_, &s)| self.dirty[s as usize])
                .map(|(&p, _)| p)
                .collect(),
            barrier: None,
            rounds: 0,
        }
    }

    /// [`Pager::start_flush`] for some pages only: those of `pages` dirty in the cache now.
    /// What a write with FUA needs (its own data stored before it is answered): the rest of
    /// the cache stays dirty. Finished as any flush is, so what the scheme keeps open is sealed
    /// and everything sent before it answered too.
    pub fn start_flush_of(&self, pages: &[u64]) -> Flush {
        let mut pages: Vec<u64> = pages
            .iter()
            .copied()
            .filter(|p| self.cache.peek(p).is_some_and(|&s| self.dirty[s as usize]))
            .collect();
        pages.sort_unstable();
        pages.dedup();
        Flush {
            pages,
            barrier: None,
            rounds: 0,
        }
    }

    /// Moves `flush` on without waiting, and says whether it is done: its pages written back,
    /// what the scheme kept open sealed (a stripe, a parity group), and everything sent
    /// before that answered; a disk's failed write is reported then, as [`Pager::flush`]
    /// reports it. What other callers send meanwhile is not waited for (a `Barrier` on the
    /// request stream), nor are pages dirtied after [`Pager::start_flush`] written back. A
    /// page is written back when its last write-back is no longer
    /// in flight (versions land in order) and a staging slot is free beyond those a seal may
    /// take, as [`Pager::try_write`] decides; the rest waits for a later call, once replies
    /// have come in ([`Pager::poll_from`]). Its write-backs go with [`Pager::send_queued`] at
    /// the end. The caller waits between calls without holding the pager, so a FLUSH on one
    /// NBD connection does not stop the others for the round trips of a whole cache.
    pub fn try_flush(&mut self, flush: &mut Flush) -> Result<bool, PagerError> {
        if let Some(barrier) = &mut flush.barrier {
            if !self.passed(barrier) {
                return Ok(false);
            }
            // Its pages are acknowledged; what the scheme keeps open (a stripe, a parity
            // group) is sealed now, and its requests waited for the same way. Parity may open
            // groups again while settling (a failed ship re-places pages): as `par_settle`,
            // a bounded number of rounds.
            self.must_not_wait += 1;
            let sealed = self.seal_without_waiting();
            self.must_not_wait -= 1;
            match sealed? {
                Sealed::Nothing => {}
                Sealed::NoRoom => return Ok(false),
                Sealed::Sent if flush.rounds >= 64 => {}
                Sealed::Sent => {
                    flush.rounds += 1;
                    self.send_queued();
                    let mut barrier = self.barrier();
                    let passed = self.passed(&mut barrier);
                    flush.barrier = Some(barrier);
                    if !passed {
                        return Ok(false);
                    }
                    return self.try_flush(flush);
                }
            }
            // As fsync does: a write the disk failed since the last flush is reported once.
            return self.disk_outcome().map(|()| true);
        }
        self.must_not_wait += 1;
        let mut result = Ok(());
        let mut left = Vec::new();
        for &page in &flush.pages {
            // `peek`: a flush is not a use, and must not reorder what is evicted next.
            let Some(slot) = self.cache.peek(&page).copied() else {
                // Evicted since: its write-back carries it.
                continue;
            };
            if !self.dirty[slot as usize] {
                continue;
            }
            let room = self.free_slots.len() > self.shape.seal_slots
                && self.writeback.len() < self.staging;
            if result.is_err() || !room || self.writeback.contains_key(&page) {
                left.push(page);
                continue;
            }
            // The page stays cached: write-back works from a copy, as in `flush`.
            let copy = self.free_slots.pop().expect("counted above");
            let at = slot as usize * PAGE_SIZE;
            self.slots
                .copy_within(at..at + PAGE_SIZE, copy as usize * PAGE_SIZE);
            self.dirty[slot as usize] = false;
            if let Err(e) = self.write_back(page, copy) {
                result = Err(e);
            }
        }
        let allowed = self.cfg.cache_pages + self.rehomed.len() + self.evictions_deferred;
        if result.is_ok() && self.cache.len() > allowed {
            // A page the disk had failed, written now, no longer counts above the budget: the
            // cache goes back to it (as `flush` evicts after its writes, but without waiting).
            // Only then: an eviction takes a whole batch, and a flush is no reason to empty
            // the cache of pages about to be read.
            result = self.evict_without_waiting();
        }
        self.must_not_wait -= 1;
        flush.pages = left;
        self.send_queued();
        result?;
        if !flush.pages.is_empty() {
            return Ok(false);
        }
        let mut barrier = self.barrier();
        let passed = self.passed(&mut barrier);
        flush.barrier = Some(barrier);
        Ok(passed)
    }

    /// Writes every dirty cached page to its backing and waits until all are acknowledged.
    pub fn flush(&mut self) -> Result<(), PagerError> {
        let dirty: Vec<(u64, u32)> = self
            .cache
            .iter()
            .filter(|(_, &s)| self.dirty[s as usize])
            .map(|(&p, &s)| (p, s))
            .collect();
        for (page, slot) in dirty {
            // The page stays cached: write-back works from a copy in a staging slot.
            let copy = self.take_slot()?;
            let at = slot as usize * PAGE_SIZE;
            self.slots
                .copy_within(at..at + PAGE_SIZE, copy as usize * PAGE_SIZE);
            self.dirty[slot as usize] = false;
            self.write_back(page, copy)?;
        }
        self.settle_writes()?;
        // Pages the disk had failed are written now: the cache returns to its budget.
        self.evict_over_budget()?;
        // As fsync does: a write the disk failed since the last flush is reported once, even
        // if it succeeded when tried again.
        self.disk_outcome()
    }

    /// Forgets a page: drops it from the cache and deletes its copies (Nswap's garbage
    /// collection of dead pages; TRIM on a block device). It reads as zeros afterwards.
    pub fn discard(&mut self, page: u64) -> Result<(), PagerError> {
        self.discard_many(&[page])
    }

    /// Forgets many pages, with their remote copies deleted in batched DELETEs, one per server
    /// and up to `MAX_BATCH` keys each. With a cache, the DELETEs' acknowledgements are not
    /// waited for (see `write_many`).
    pub fn discard_many(&mut self, pages: &[u64]) -> Result<(), PagerError> {
        pages.iter().try_for_each(|&p| self.check(p))?;
        if !pages.iter().any(|&p| self.is_written(p)) {
            // Nothing to forget: no request, and so nothing to wait for (an all-zero victim
            // evicted the waiting way waited here for everything in flight).
            return Ok(());
        }
        for &page in pages {
            self.wait_writeback(page)?;
        }
        self.discard_queued(pages)?;
        if self.cfg.cache_pages > 0 {
            // As with write-back, not waited for: a connection applies its requests in order,
            // so a later PUT of the same page to the same server lands after the DELETE.
            self.send_everything()
        } else {
            self.drain()
        }
    }

    /// Forgets pages none of which is in write-back, their DELETEs queued, not sent.
    fn discard_queued(&mut self, pages: &[u64]) -> Result<(), PagerError> {
        let mut deletes: Vec<Vec<PageKey>> = vec![Vec::new(); self.servers.len()];
        for &page in pages {
            debug_assert!(!self.writeback.contains_key(&page));
            if let Some(slot) = self.cache.pop(&page) {
                self.release_slot(slot);
            }
            self.rehomed.remove(&page);
            let e = *self.table.get(page);
            self.discarded(page, &mut deletes);
            if e.on_disk {
                self.disk.discard(page)?;
            }
            self.table.forget(page);
        }
        for (s, keys) in deletes.into_iter().enumerate() {
            for chunk in keys.chunks(netram_proto::MAX_BATCH) {
                self.counters.deletes += chunk.len() as u64;
                self.delete(s, chunk.to_vec());
            }
        }
        Ok(())
    }

    /// Whether a page holds data: written (perhaps only into the cache so far) and not
    /// discarded since. A page that does not reads as zeros without any I/O.
    pub fn is_written(&self, page: u64) -> bool {
        self.cache.contains(&page)
            || self.writeback.contains_key(&page)
            || self.table.get(page).present
    }

    /// Deletes copies on a server.
    pub(crate) fn delete(&mut self, server: usize, keys: Vec<PageKey>) {
        let op = self.delete_op(&keys);
        self.submit(server, op, &Request::Delete(keys));
    }

    pub(crate) fn key(&self, page: u64) -> PageKey {
        PageKey::new(self.cfg.region, page)
    }
}

#[cfg(test)]
mod tests;
