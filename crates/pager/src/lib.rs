//! The client pager: where a client's pages are, and the machinery that moves them.
//!
//! It implements the client module of Distributed Anemone (paper 001, §2.1: page table, LRU
//! write-back cache, mapping of pages to servers; §2.6 load balancing), the flexible backing
//! store of Markatos' pager (paper 003: remote memory, local disk, or both), and Nswap's client
//! side (paper 004, §III: versions on every page-out, garbage collection of dead pages).
//!
//! The pager owns no socket and no file. It drives a [`Transport`] (TCP in the daemon, a
//! simulated network in tests and in the simulator) and a [`Disk`] (a spill file in the daemon,
//! memory in tests), so everything it decides can be tested deterministically.
//!
//! # Components
//!
//! * the page table ([`table`]): per page, its version, the servers that hold it and whether the
//!   local disk holds its current version;
//! * the slot pool: `cache_pages + staging` page buffers allocated once at start. The LRU
//!   write-back cache holds up to `cache_pages` of them; the rest carry pages while their
//!   requests are in flight. Every byte a page moves through lives in a slot, so completing a
//!   request never needs a caller's buffer and nothing is allocated per page;
//! * requests in flight ([`Inflight`]), bounded per server by the credit window the server
//!   announced (Anemone's RMAP window). Replies may come back in any order;
//! * placement ([`netram_policy::placement`]): two weighted random choices by free capacity
//!   and load; a FULL refusal (Anemone's NACK) sends the page to another server, and when no
//!   server is left it spills to the local disk (Markatos).
//!
//! # Failures it guards against
//!
//! A server that disconnects, errs or times out is marked dead; requests in flight to it are
//! failed over: writes go to another server (the data is still in its slot), reads come from the
//! disk copy with `cluster+disk` backing or fail with [`PagerError::Lost`] naming the server and
//! the pages. A page whose checksum or version does not match is never returned as data.

mod config;
mod counters;
mod error;
mod invariants;
mod maintenance;
mod requests;
mod scheme;
mod table;
mod transport;

pub use config::{Backing, PagerConfig, ParseBackingError};
pub use counters::PagerCounters;
pub use error::{LostPages, PagerError};
use lru::LruCache;
pub use maintenance::{ScheduleConfig, Tick};
use netram_policy::placement::Candidate;
pub use netram_policy::redundancy::{ParseSchemeError, Scheme};
use netram_proto::{
    DeleteStatus, ErrorCode, GetResult, PageKey, PutStatus, Reply, Request, PAGE_SIZE,
};
use requests::{GetItem, Inflight, Op, Part, PutItem, PutKind, Queued, ReadDone, INTERNAL};
use scheme::parity;
pub use scheme::RecoveryStep;
use scheme::Redundancy;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fmt;
use table::{Servers, Table};
pub use transport::{Disk, MemDisk, ServerInfo, Transport, TransportError};

/// What keeps a page safe, as [`Pager::pieces`] lists it: (server, key, version) of each copy
/// or stripe piece.
pub type Pieces = Vec<(usize, PageKey, u32)>;

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

/// A page being written out: its data stays in `slot` until every copy is settled.
#[derive(Debug, Clone, Copy)]
struct Writeback {
    slot: u32,
    version: u32,
    /// Copies acknowledged.
    done: Servers,
    /// PUTs in flight.
    pending: Servers,
    /// Servers that refused the page or failed while storing it.
    refused: Servers,
    /// Holders whose copy of this very version stays valid (recovery adds copies to them).
    keep: Servers,
    /// A recovery's write: counted as a rebuilt page when whole.
    rebuild: bool,
    /// Under parity: the page joins a new group even where it is (its old one is gone).
    join: bool,
}

/// The "server" a lost Reed-Solomon page names when no piece of it has a server left.
const STRIPE_LOST: usize = usize::MAX;

#[derive(Debug)]
struct ServerState {
    info: ServerInfo,
    alive: bool,
    dead_reason: String,
    load: Candidate,
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
    free_slots: Vec<u32>,
    dirty: Vec<bool>,
    cache: LruCache<u64, u32>,
    /// Pages whose write-back is in flight, with the slot holding their data.
    writeback: HashMap<u64, Writeback>,
    /// What keeps pages safe when a server dies, and its state ([`scheme`]).
    scheme: Redundancy,
    /// Pages with fewer copies than `copies` (a server died, a copy was bad): recovery's list.
    degraded: BTreeSet<u64>,
    /// Pages recovery could not give every copy (no server with room) and that the local disk
    /// backs meanwhile: tried again when a server comes back.
    short: BTreeSet<u64>,
    /// Pages kept in the cache, dirty, because the local disk failed to write them and no
    /// server holds their current version: the cache may exceed its budget by these.
    rehomed: BTreeSet<u64>,
    /// The local disk's last failed write, reported by the next `flush` (as fsync does).
    disk_failed: Option<std::io::Error>,
    /// GETs that failed on one copy, to be tried on another.
    retry: Vec<GetItem>,
    /// The pager's own finished reads (recovery): page and slot.
    fetched: Vec<(u64, u32)>,
    /// Reads whose piece is out of reach, to be decoded from the rest of their stripe.
    reconstruct: Vec<GetItem>,
    inflight: Inflight,
    /// Per server: requests not sent yet, oldest first.
    queues: Vec<VecDeque<Queued>>,
    followups: Vec<Followup>,
    reads_done: Vec<ReadDone>,
    lost: Vec<(usize, u64)>,
    corrupt: Option<(usize, u64, &'static str)>,
    next_req: u64,
    /// Replies being handled (nested when handling one waits for another), and the waits
    /// that happened while handling one: reply handling is to become an event that never
    /// waits, and `check_invariants` counts what still does.
    in_reply: u32,
    waits_in_reply: u64,
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
        let batch_max = cfg
            .batch_max
            .min(cfg.window as usize)
            .min(netram_proto::MAX_BATCH);
        let servers: Vec<ServerState> = transport
            .servers()
            .into_iter()
            .map(|info| ServerState {
                alive: info.connected.is_ok(),
                dead_reason: info.connected.clone().err().unwrap_or_default(),
                load: Candidate {
                    alive: info.connected.is_ok(),
                    free_pages: info.free_pages,
                    requests_per_s: 0,
                },
                info,
            })
            .collect();
        // Per server: a full window in flight plus a batch being filled.
        let staging: usize = servers
            .iter()
            .map(|s| s.info.window.min(cfg.window) as usize + batch_max)
            .sum::<usize>()
            .max(cfg.writeback_batch)
            .max(1);
        let scheme = Redundancy::new(&cfg, &servers);
        let rebuilding = scheme.recovery_slots(&cfg);
        let nslots = cfg.cache_pages + staging + rebuilding;
        Self {
            transport,
            disk,
            table: Table::new(cfg.pages, scheme.copies()),
            scheme,
            degraded: BTreeSet::new(),
            short: BTreeSet::new(),
            rehomed: BTreeSet::new(),
            disk_failed: None,
            retry: Vec::new(),
            fetched: Vec::new(),
            reconstruct: Vec::new(),
            inflight: Inflight {
                ops: HashMap::default(),
                per_server: vec![0; servers.len()],
                order: VecDeque::new(),
            },
            queues: (0..servers.len()).map(|_| VecDeque::new()).collect(),
            followups: Vec::new(),
            servers,
            slots: vec![0u8; nslots * PAGE_SIZE],
            free_slots: (0..nslots as u32).rev().collect(),
            dirty: vec![false; nslots],
            cache: LruCache::unbounded(),
            writeback: HashMap::new(),
            reads_done: Vec::new(),
            lost: Vec::new(),
            corrupt: None,
            next_req: 1,
            in_reply: 0,
            waits_in_reply: 0,
            schedule: maintenance::Schedule::default(),
            rng: fastrand::Rng::with_seed(cfg.seed),
            counters: PagerCounters::default(),
            cfg: PagerConfig { batch_max, ..cfg },
        }
    }

    pub fn config(&self) -> &PagerConfig {
        &self.cfg
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
        let before = self.counters.servers_dead;
        for s in 0..self.servers.len() {
            if self.servers[s].alive {
                self.submit(s, Op::Get(Vec::new()), &Request::Get(Vec::new()));
            }
        }
        self.drain()?;
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
            // Room again, perhaps: what lacked copies for want of servers tries again.
            let short = std::mem::take(&mut self.short);
            self.degraded.extend(short);
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

    fn slot(&self, slot: u32) -> &[u8] {
        let at = slot as usize * PAGE_SIZE;
        &self.slots[at..at + PAGE_SIZE]
    }
    fn slot_mut(&mut self, slot: u32) -> &mut [u8] {
        let at = slot as usize * PAGE_SIZE;
        &mut self.slots[at..at + PAGE_SIZE]
    }

    // ------------------------------------------------------------------------------------------
    // Public operations
    // ------------------------------------------------------------------------------------------

    /// Reads one page into `out` (PAGE_SIZE bytes).
    pub fn read(&mut self, page: u64, out: &mut [u8]) -> Result<(), PagerError> {
        self.read_many(&[page], out)
    }

    /// Writes one page from `data` (PAGE_SIZE bytes).
    pub fn write(&mut self, page: u64, data: &[u8]) -> Result<(), PagerError> {
        self.write_many(&[page], data)
    }

    /// Reads many pages into `out`, one PAGE_SIZE chunk per page, with the misses' GETs
    /// pipelined up to each server's window.
    pub fn read_many(&mut self, pages: &[u64], out: &mut [u8]) -> Result<(), PagerError> {
        if out.len() != pages.len() * PAGE_SIZE {
            return Err(PagerError::BadBuffer {
                got: out.len(),
                pages: pages.len(),
            });
        }
        pages.iter().try_for_each(|&p| self.check(p))?;
        self.lost.clear();
        self.corrupt = None;
        let read = self.read_into(pages, out);
        if read.is_err() {
            self.abandon_reads();
        }
        read
    }

    /// A read that ends early (the disk failed, no slot to be had) leaves GETs in flight whose
    /// data was for its caller's buffer: they are completed and dropped here, so that a later
    /// read never receives them at its own positions.
    fn abandon_reads(&mut self) {
        // Each round completes a reply or fails a server: this ends.
        while !self.idle() {
            if let Err(e) = self.complete_one() {
                tracing::debug!("while abandoning a read: {e}");
            }
        }
        // The caller's reads hold slots; the pager's own (recovery's) stay.
        let mut callers: Vec<u32> = Vec::new();
        let mut ours = |pos: usize, slot: u32| {
            if pos != INTERNAL {
                callers.push(slot);
            }
            pos == INTERNAL
        };
        self.retry.retain(|it| ours(it.pos, it.slot));
        self.reconstruct.retain(|it| ours(it.pos, it.slot));
        self.reads_done.retain(|d| ours(d.pos, d.slot));
        for slot in callers {
            self.release_slot(slot);
        }
        self.lost.clear();
        self.corrupt = None;
    }

    fn read_into(&mut self, pages: &[u64], out: &mut [u8]) -> Result<(), PagerError> {
        for (pos, &page) in pages.iter().enumerate() {
            self.counters.reads += 1;
            let dst = &mut out[pos * PAGE_SIZE..(pos + 1) * PAGE_SIZE];
            let cached = self
                .cache
                .get(&page)
                .copied()
                .or_else(|| self.writeback.get(&page).map(|w| w.slot));
            if let Some(slot) = cached {
                self.counters.cache_hits += 1;
                dst.copy_from_slice(self.slot(slot));
                continue;
            }
            let e = *self.table.get(page);
            if !e.present {
                self.counters.zero_reads += 1;
                dst.fill(0);
                continue;
            }
            match self.alive_holder(page, None) {
                Some(server) => {
                    let slot = self.take_slot_for_read(out)?;
                    self.submit_get(server, page, slot, pos);
                }
                None if !e.on_disk && self.reconstructible(page) => {
                    let slot = self.take_slot_for_read(out)?;
                    let it = self.page_get_item(page, slot, pos);
                    self.reconstruct.push(it);
                }
                None if e.on_disk => {
                    if !self.table.holders(page).is_empty() {
                        self.counters.disk_fallbacks += 1;
                    }
                    self.counters.disk_reads += 1;
                    self.disk.read(page, dst)?;
                    if self.cfg.cache_pages > 0 {
                        let slot = self.take_slot_for_read(out)?;
                        let at = slot as usize * PAGE_SIZE;
                        self.slots[at..at + PAGE_SIZE]
                            .copy_from_slice(&out[pos * PAGE_SIZE..(pos + 1) * PAGE_SIZE]);
                        self.insert_clean(page, slot)?;
                    }
                }
                None => {
                    // A Reed-Solomon page whose stripe lost too many pieces has no holder.
                    let s = self.table.holders(page).first().unwrap_or(STRIPE_LOST);
                    self.lost.push((s, page));
                }
            }
            self.copy_out_reads(out)?;
        }
        // Copying out may insert into the cache and evict dirty pages, and a failed copy is
        // retried on another: drain until all are done.
        while !self.idle()
            || !self.reads_done.is_empty()
            || !self.retry.is_empty()
            || !self.reconstruct.is_empty()
        {
            self.drain()?;
            self.resubmit_retries();
            self.copy_out_reads(out)?;
            if self.idle() && self.reads_done.is_empty() {
                self.run_reconstructions()?;
            }
        }
        self.read_outcome()
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

    /// The local disk's failed write since the last report, if any (the pages it was writing
    /// are still in memory and are written again later).
    fn disk_outcome(&mut self) -> Result<(), PagerError> {
        match self.disk_failed.take() {
            Some(e) => Err(PagerError::Disk(e)),
            None => Ok(()),
        }
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
        let mut deletes: Vec<Vec<PageKey>> = vec![Vec::new(); self.servers.len()];
        for &page in pages {
            self.wait_writeback(page)?;
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
            self.degraded.remove(&page);
            self.short.remove(&page);
        }
        for (s, keys) in deletes.into_iter().enumerate() {
            for chunk in keys.chunks(netram_proto::MAX_BATCH) {
                self.counters.deletes += chunk.len() as u64;
                self.delete(s, chunk.to_vec());
            }
        }
        if self.cfg.cache_pages > 0 {
            // As with write-back, not waited for: a connection applies its requests in order,
            // so a later PUT of the same page to the same server lands after the DELETE.
            self.send_everything()
        } else {
            self.drain()
        }
    }

    /// Whether a page holds data: written (perhaps only into the cache so far) and not
    /// discarded since. A page that does not reads as zeros without any I/O.
    pub fn is_written(&self, page: u64) -> bool {
        self.cache.contains(&page)
            || self.writeback.contains_key(&page)
            || self.table.get(page).present
    }

    // ------------------------------------------------------------------------------------------
    // Reading
    // ------------------------------------------------------------------------------------------

    /// A GET that got no good data from `server`, once its scheme has had its say: tried on
    /// another copy, else read from the disk copy, else reported (lost or corrupt) to its
    /// caller.
    pub(crate) fn read_elsewhere(
        &mut self,
        server: usize,
        it: GetItem,
        what: Option<&'static str>,
    ) {
        let e = *self.table.get(it.page);
        if self.alive_holder(it.page, Some(server)).is_some() {
            self.counters.reads_from_other_copy += 1;
            self.retry.push(it);
            return;
        }
        if e.on_disk {
            self.counters.disk_fallbacks += 1;
            self.counters.disk_reads += 1;
            let at = it.slot as usize * PAGE_SIZE;
            match self.disk.read(it.page, &mut self.slots[at..at + PAGE_SIZE]) {
                Ok(()) => {
                    return self.reads_done.push(ReadDone {
                        pos: it.pos,
                        page: it.page,
                        slot: it.slot,
                        part: Part::Page,
                    })
                }
                Err(e) => tracing::error!(page = it.page, "disk read failed: {e}"),
            }
        }
        if it.pos == INTERNAL {
            // Recovery's own read: it finds the page unrecoverable by its absence.
        } else if let Some(what) = what {
            self.corrupt = Some((server, it.page, what));
        } else {
            self.lost.push((server, it.page));
        }
        self.release_slot(it.slot);
    }

    /// Decodes the reads whose piece was out of reach (degraded reads).
    fn run_reconstructions(&mut self) -> Result<(), PagerError> {
        for it in std::mem::take(&mut self.reconstruct) {
            if let Some(s) = self.alive_holder(it.page, None) {
                // Its data piece was rebuilt meanwhile: read it.
                let it = self.page_get_item(it.page, it.slot, it.pos);
                self.submit_get_item(s, it);
                continue;
            }
            if self.reconstruct(it.page, it.slot)? {
                self.reads_done.push(ReadDone {
                    pos: it.pos,
                    page: it.page,
                    slot: it.slot,
                    part: Part::Page,
                });
            } else {
                let s = self.table.holders(it.page).first().unwrap_or(STRIPE_LOST);
                self.lost.push((s, it.page));
                self.release_slot(it.slot);
            }
        }
        Ok(())
    }

    /// Sends the GETs that failed on one copy to another.
    fn resubmit_retries(&mut self) {
        for it in std::mem::take(&mut self.retry) {
            match self.alive_holder(it.page, None) {
                Some(s) => self.submit_get_item(s, it),
                None => {
                    let s = self.table.holders(it.page).first().unwrap_or(0);
                    self.get_failed(s, it, None)
                }
            }
        }
    }

    /// Queues a GET; it goes out with its server's batch.
    fn submit_get(&mut self, server: usize, page: u64, slot: u32, pos: usize) {
        let it = self.page_get_item(page, slot, pos);
        self.submit_get_item(server, it);
    }

    /// A GET of a page's current version (its stripe's data piece under Reed-Solomon).
    fn page_get_item(&self, page: u64, slot: u32, pos: usize) -> GetItem {
        GetItem {
            page,
            slot,
            pos,
            key: self.stored_key(page),
            version: self.table.get(page).version,
            part: Part::Page,
        }
    }

    /// Copies finished reads to the caller and hands their slots to the cache.
    fn copy_out_reads(&mut self, out: &mut [u8]) -> Result<(), PagerError> {
        while let Some(d) = self.reads_done.pop() {
            if d.pos == INTERNAL {
                self.fetched.push((d.page, d.slot));
                continue;
            }
            out[d.pos * PAGE_SIZE..(d.pos + 1) * PAGE_SIZE].copy_from_slice(self.slot(d.slot));
            if self.cfg.cache_pages > 0 && !self.cache.contains(&d.page) {
                self.insert_clean(d.page, d.slot)?;
            } else {
                self.release_slot(d.slot);
            }
        }
        Ok(())
    }

    fn read_outcome(&mut self) -> Result<(), PagerError> {
        if let Some((s, page, what)) = self.corrupt.take() {
            return Err(PagerError::Corrupt {
                server: self.servers[s].info.name.clone(),
                page,
                what,
            });
        }
        if self.lost.is_empty() {
            return Ok(());
        }
        let mut by_server: Vec<LostPages> = Vec::new();
        for &(s, page) in &self.lost {
            let (name, reason) = match self.servers.get(s) {
                Some(st) => (st.info.name.clone(), st.dead_reason.clone()),
                None => (
                    "(its stripe's servers)".to_string(),
                    "fewer pieces of its stripe survive than it needs".to_string(),
                ),
            };
            match by_server.iter_mut().find(|l| l.server == name) {
                Some(l) => l.pages.push(page),
                None => by_server.push(LostPages {
                    server: name,
                    reason,
                    pages: vec![page],
                }),
            }
        }
        self.lost.clear();
        Err(PagerError::Lost(by_server))
    }

    // ------------------------------------------------------------------------------------------
    // Writing
    // ------------------------------------------------------------------------------------------

    /// Sends a page to its backing. The slot is released when the write is acknowledged.
    fn write_back(&mut self, page: u64, slot: u32) -> Result<(), PagerError> {
        // One write-back per page at a time, so that versions land in order.
        let cached_before = self.cache.contains(&page);
        self.wait_writeback(page)?;
        if self.rehomed.remove(&page) && !cached_before {
            // The write-back waited for failed and came back to the cache: this write is newer.
            if let Some(stale) = self.cache.pop(&page) {
                self.release_slot(stale);
            }
        }
        if self.cfg.backing != Backing::Cluster && !self.write_to_disk(page, slot) {
            // A failed write may have torn the disk's copy: the page lives in memory until a
            // write succeeds, and the version stays, so remote copies of it remain valid.
            self.table.get_mut(page).on_disk = false;
            self.rehome(page, slot);
            return Ok(());
        }
        let version = self.table.get_mut(page).next_version();
        let e = self.table.get_mut(page);
        e.present = true;
        e.on_disk = self.cfg.backing != Backing::Cluster;
        if self.cfg.backing == Backing::Disk {
            self.release_slot(slot);
            return Ok(());
        }
        self.writeback.insert(
            page,
            Writeback {
                slot,
                version,
                done: Servers::default(),
                pending: Servers::default(),
                refused: Servers::default(),
                keep: Servers::default(),
                rebuild: false,
                join: false,
            },
        );
        self.written_back(page)
    }

    /// Writes a slot to the local disk. A failure is counted, logged and kept for the next
    /// `flush` to report; the caller keeps the page in memory ([`Pager::rehome`]).
    fn write_to_disk(&mut self, page: u64, slot: u32) -> bool {
        self.counters.disk_writes += 1;
        let at = slot as usize * PAGE_SIZE;
        match self.disk.write(page, &self.slots[at..at + PAGE_SIZE]) {
            Ok(()) => true,
            Err(e) => {
                self.counters.disk_write_errors += 1;
                tracing::error!(page, "local disk write failed, page kept in memory: {e}");
                self.disk_failed = Some(e);
                false
            }
        }
    }

    /// A page whose write-back found no home (the local disk failed it) goes back to the
    /// cache, dirty, so that nothing is lost: it is written again at its next eviction or
    /// flush. A newer version cached meanwhile wins.
    fn rehome(&mut self, page: u64, slot: u32) {
        self.rehomed.insert(page);
        match self.cache.peek(&page) {
            Some(&cached) => {
                self.dirty[cached as usize] = true;
                self.release_slot(slot);
            }
            None => {
                self.cache.put(page, slot);
                self.dirty[slot as usize] = true;
            }
        }
    }

    /// A page that `server` refused or will never acknowledge: placed elsewhere if possible.
    pub(crate) fn copy_failed(&mut self, page: u64, server: usize) -> Result<(), PagerError> {
        let Some(wb) = self.writeback.get_mut(&page) else {
            return Ok(());
        };
        wb.pending.remove(server);
        wb.refused.insert(server);
        self.place(page)
    }

    /// Every copy of a write-back is acknowledged or failed: the page table learns where the
    /// page is now, superseded copies are deleted and the slot is freed. No copy at all: the
    /// page goes to the local disk (Markatos: the disk when the cluster is full).
    fn finish_writeback(&mut self, page: u64) -> Result<(), PagerError> {
        let wb = self.writeback.remove(&page).expect("page in write-back");
        // A copy acknowledged by a server that has died since does not count.
        let holders: Servers = wb
            .keep
            .iter()
            .chain(wb.done.iter())
            .filter(|&s| self.servers[s].alive)
            .collect();
        if holders.len() < self.scheme.copies() {
            // Too few servers alive or with room for every copy: the local disk makes up
            // for the missing ones (Markatos: the disk when the cluster is full). Recovery
            // adds the missing copies when servers come back.
            if !self.table.get(page).on_disk {
                self.counters.spills += 1;
                if !self.write_to_disk(page, wb.slot) {
                    // Fewer copies than promised and no disk to make up for them: the copies
                    // made count, and the page stays in memory until it is written again.
                    self.degraded.remove(&page);
                    self.short.remove(&page);
                    self.set_location(page, holders);
                    self.table.get_mut(page).on_disk = false;
                    self.rehome(page, wb.slot);
                    return Ok(());
                }
                self.table.get_mut(page).on_disk = true;
            }
            self.degraded.remove(&page);
            if holders.is_empty() {
                self.short.remove(&page);
            } else if wb.rebuild {
                self.short.insert(page);
            } else {
                self.counters.writes_degraded += 1;
                self.degraded.insert(page);
            }
        } else {
            if wb.rebuild {
                self.counters.pages_rebuilt += 1;
            }
            self.degraded.remove(&page);
            self.short.remove(&page);
        }
        self.set_location(page, holders);
        self.release_slot(wb.slot);
        Ok(())
    }

    /// Records where the current version of a page lives; deletes superseded remote copies.
    fn set_location(&mut self, page: u64, holders: Servers) {
        for s in self.table.holders(page).iter() {
            if !holders.contains(s) && self.servers[s].alive {
                self.counters.deletes += 1;
                self.delete(s, vec![self.key(page)]);
            }
        }
        self.table.set_holders(page, holders);
        if holders.is_empty() {
            self.table.get_mut(page).on_disk = true;
        }
    }

    fn wait_writeback(&mut self, page: u64) -> Result<(), PagerError> {
        while self.writeback.contains_key(&page) {
            // Its stripe or group may not be sealed, and so nothing be in flight for it yet: it
            // goes now, full or not (checked each time: a page may join a group while it
            // waits).
            self.seal_open(Some(page))?;
            // Nothing under way can finish it: a bookkeeping slip, which must not spin forever.
            assert!(
                !(self.idle() && self.writeback.contains_key(&page)),
                "page {page} waits in write-back with nothing in flight to finish it"
            );
            self.complete_one()?;
        }
        Ok(())
    }

    // ------------------------------------------------------------------------------------------
    // Cache and slots
    // ------------------------------------------------------------------------------------------

    fn insert_clean(&mut self, page: u64, slot: u32) -> Result<(), PagerError> {
        self.dirty[slot as usize] = false;
        self.cache.put(page, slot);
        self.evict_over_budget()
    }

    /// Evicts least recently used pages while the cache is over budget, a batch at a time, so
    /// that dirty pages go out as pipelined PUTs.
    fn evict_over_budget(&mut self) -> Result<(), PagerError> {
        // Pages the disk failed to write stay in memory on top of the budget: evicting others
        // for them would only push more pages at the failing disk.
        let budget = |p: &Self| p.cfg.cache_pages + p.rehomed.len();
        if self.cache.len() <= budget(self) {
            return Ok(());
        }
        let n = (self.cache.len() - budget(self))
            .max(self.cfg.writeback_batch.min(self.cfg.cache_pages));
        // A batch at least, and until within the budget: writing a failed page back shrinks
        // the budget by one. Bounded, as a page the disk fails again comes back at the top.
        for evicted in 0..n + self.cache.len() {
            if evicted >= n && self.cache.len() <= budget(self) {
                break;
            }
            let Some((page, slot)) = self.cache.pop_lru() else {
                break;
            };
            if self.dirty[slot as usize] {
                self.counters.evictions_dirty += 1;
                self.dirty[slot as usize] = false;
                self.write_back(page, slot)?;
            } else {
                self.counters.evictions_clean += 1;
                self.release_slot(slot);
            }
        }
        Ok(())
    }

    /// A free slot, completing requests in flight until one is released. There is always one to
    /// wait for: slots not free are cached (at most `cache_pages`) or carry a request.
    fn take_slot(&mut self) -> Result<u32, PagerError> {
        // Evictions go back to the cache when the disk fails them: once more have failed than
        // pages are cached, there is no room to be had.
        let failed_before = self.counters.disk_write_errors;
        loop {
            if self.counters.disk_write_errors - failed_before > self.cache.len() as u64 {
                return Err(self.disk_outcome().err().unwrap_or_else(|| {
                    PagerError::Disk(std::io::Error::other(
                        "every page in memory waits for a disk that fails its writes",
                    ))
                }));
            }
            if let Some(s) = self.free_slots.pop() {
                return Ok(s);
            }
            if self.idle() && self.cache.is_empty() {
                // Every slot waits in an open parity group: ship them.
                self.seal_open(None)?;
                if self.idle() {
                    panic!("no slot free, cached or in flight");
                }
                continue;
            }
            if self.idle() {
                // Only cached slots remain: make room.
                let (page, slot) = self.cache.pop_lru().expect("slots are cached or in flight");
                if self.dirty[slot as usize] {
                    self.dirty[slot as usize] = false;
                    self.counters.evictions_dirty += 1;
                    self.write_back(page, slot)?;
                } else {
                    self.counters.evictions_clean += 1;
                    self.release_slot(slot);
                }
                continue;
            }
            self.complete_one()?;
        }
    }

    /// A free slot for a read: like [`Pager::take_slot`], but finished reads hold slots until
    /// they are copied out, so they are copied out while waiting.
    fn take_slot_for_read(&mut self, out: &mut [u8]) -> Result<u32, PagerError> {
        loop {
            self.copy_out_reads(out)?;
            if let Some(s) = self.free_slots.pop() {
                return Ok(s);
            }
            if self.idle() {
                return self.take_slot();
            }
            self.complete_one()?;
        }
    }

    fn release_slot(&mut self, slot: u32) {
        debug_assert!(
            !self.free_slots.contains(&slot),
            "slot {slot} released twice"
        );
        self.dirty[slot as usize] = false;
        self.free_slots.push(slot);
    }

    // ------------------------------------------------------------------------------------------
    // Requests in flight
    // ------------------------------------------------------------------------------------------

    /// Deletes copies on a server.
    fn delete(&mut self, server: usize, keys: Vec<PageKey>) {
        let op = self.delete_op(&keys);
        self.submit(server, op, &Request::Delete(keys));
    }

    fn key(&self, page: u64) -> PageKey {
        PageKey::new(self.cfg.region, page)
    }

    fn recv_from(&mut self, server: usize) -> Result<(), PagerError> {
        self.receive(server, true).map(|_| ())
    }

    /// Handles the replies that have already arrived, from every server, without waiting for
    /// any, and sends what the credits they return allow: a program busy elsewhere (or a
    /// maintenance thread) lets write-backs finish and their slots come back between its
    /// operations. Returns how many replies it handled. A transport that cannot tell whether
    /// a reply is there handles none.
    pub fn poll(&mut self) -> Result<usize, PagerError> {
        let mut handled = 0;
        let mut result = Ok(());
        for server in 0..self.servers.len() {
            while self.inflight.per_server[server] > 0 {
                match self.receive(server, false) {
                    Ok(true) => handled += 1,
                    Ok(false) => break,
                    Err(e) => {
                        handled += 1;
                        result = Err(e);
                    }
                }
            }
        }
        self.pump_all();
        result.map(|()| handled)
    }

    /// Reads one reply from `server` and handles it: waiting for it, or only if it is there
    /// already (false when it is not).
    fn receive(&mut self, server: usize, wait: bool) -> Result<bool, PagerError> {
        let got = if wait {
            Some(self.transport.recv(server))
        } else {
            self.transport.try_recv(server)
        };
        let Some(got) = got else {
            return Ok(false);
        };
        match got {
            Ok((id, reply)) => {
                let load = reply.load();
                self.servers[server].load.free_pages = load.free_pages;
                self.servers[server].load.requests_per_s = load.requests_per_s;
                let Some((s, op)) = self.inflight.ops.remove(&id) else {
                    drop(reply);
                    let err = TransportError::Protocol(format!("reply to unknown request {id}"));
                    self.mark_dead(server, err);
                    return Ok(true);
                };
                if s != server {
                    // Not ours to complete: put it back and drop this connection as confused.
                    self.inflight.ops.insert(id, (s, op));
                    drop(reply);
                    let err =
                        TransportError::Protocol(format!("reply to another server's request {id}"));
                    self.mark_dead(server, err);
                    return Ok(true);
                }
                self.inflight.per_server[s] -= op.credits();
                Self::complete(
                    &mut self.counters,
                    &mut self.slots,
                    &mut self.reads_done,
                    &mut self.followups,
                    server,
                    op,
                    &reply,
                );
            }
            Err(e) => {
                self.mark_dead(server, e);
                return Ok(true);
            }
        }
        // Taken out to be handled with `&mut self` (handling one never reads another reply:
        // `check_invariants` counts any wait); the buffer is put back to keep its capacity.
        let mut followups = std::mem::take(&mut self.followups);
        let mut result = Ok(());
        self.in_reply += 1;
        for f in followups.drain(..) {
            if let Err(e) = self.after_reply(server, f) {
                result = Err(e);
            }
        }
        self.in_reply -= 1;
        if self.followups.is_empty() {
            self.followups = followups;
        }
        result.map(|()| true)
    }

    /// Handles one reply while the transport's receive buffer is still borrowed: only fields
    /// disjoint from the transport are touched here; anything that sends or reads the disk is
    /// queued as a [`Followup`] for [`Pager::after_reply`].
    #[allow(clippy::too_many_arguments)]
    fn complete(
        counters: &mut PagerCounters,
        slots: &mut [u8],
        reads_done: &mut Vec<ReadDone>,
        followups: &mut Vec<Followup>,
        server: usize,
        op: Op,
        reply: &Reply<'_>,
    ) {
        match (op, reply) {
            (Op::Get(items), Reply::Get { pages, .. }) if pages.len() == items.len() => {
                for (it, got) in items.into_iter().zip(pages) {
                    let (page, slot) = (it.page, it.slot);
                    let dst =
                        &mut slots[slot as usize * PAGE_SIZE..(slot as usize + 1) * PAGE_SIZE];
                    let what = match got {
                        GetResult::Found(p) if p.key != it.key => Some("wrong key"),
                        GetResult::Found(p) if !p.verify() => {
                            counters.checksum_failures += 1;
                            Some("checksum mismatch")
                        }
                        GetResult::Found(p) if p.version != it.version => {
                            counters.version_mismatches += 1;
                            Some("stale version")
                        }
                        GetResult::Found(p) => {
                            if p.flags.is_zero() {
                                dst.fill(0);
                            } else {
                                dst.copy_from_slice(p.data);
                            }
                            reads_done.push(ReadDone {
                                pos: it.pos,
                                page,
                                slot,
                                part: it.part,
                            });
                            None
                        }
                        GetResult::Missing(_) => {
                            counters.missing_pages += 1;
                            Some("missing on server")
                        }
                    };
                    if let Some(what) = what {
                        tracing::warn!(server, page, what, "bad page from server");
                        followups.push(Followup::GetFailed(it, what));
                    }
                }
            }
            (Op::Put(items), Reply::Put { status, .. }) if status.len() == items.len() => {
                for (it, st) in items.into_iter().zip(status) {
                    followups.push(match st {
                        PutStatus::Stored => Followup::Stored(it),
                        // Stored outside any group: it joins a new one.
                        PutStatus::Unprotected if matches!(it.kind, PutKind::Parity(_)) => {
                            Followup::Unprotected(it)
                        }
                        PutStatus::Unprotected => Followup::Stored(it),
                        PutStatus::HolderUnreachable if matches!(it.kind, PutKind::Parity(_)) => {
                            Followup::Refused(it)
                        }
                        // Only a parity PUT involves a holder: said of any other, it is a lie
                        // (found by the simulator: a flipped status left a stripe's piece
                        // waiting forever).
                        PutStatus::HolderUnreachable => Followup::Dead(
                            "the server said a plain PUT's parity holder was unreachable".into(),
                            Some(Op::Put(vec![it])),
                        ),
                        PutStatus::Full => {
                            counters.puts_refused_full += 1;
                            Followup::Replace(it)
                        }
                        PutStatus::BadKey => Followup::Dead(
                            "the server refused a page key".into(),
                            Some(Op::Put(vec![it])),
                        ),
                    });
                }
            }
            (Op::Ship(id), Reply::Put { status, .. }) => {
                followups.push(if status.first() == Some(&PutStatus::Stored) {
                    Followup::Shipped(id)
                } else {
                    Followup::ShipFailed(id)
                });
            }
            (Op::Delta, Reply::ParityDelta { .. }) => {}
            (
                Op::Scan,
                Reply::ParityScan {
                    groups, orphans, ..
                },
            ) => {
                let groups = groups
                    .iter()
                    .map(|g| {
                        let mut parity = netram_proto::OwnedRecord::default();
                        parity.xor(&g.record);
                        parity::ScannedGroup {
                            group: g.group,
                            damaged: g.damaged,
                            members: g.members.clone(),
                            parity,
                        }
                    })
                    .collect();
                followups.push(Followup::Scanned(groups, orphans.clone()));
            }
            (Op::Gc(keys), Reply::Delete { status, .. }) if status.len() == keys.len() => {
                let stale: Vec<PageKey> = keys
                    .iter()
                    .zip(status)
                    .filter(|(_, s)| **s == DeleteStatus::HolderUnreachable)
                    .map(|(k, _)| *k)
                    .collect();
                if !stale.is_empty() {
                    followups.push(Followup::Stale(stale));
                }
            }
            (Op::Delete, Reply::Delete { status, .. }) => {
                debug_assert!(status.iter().all(|s| matches!(
                    s,
                    DeleteStatus::Deleted | DeleteStatus::Missing | DeleteStatus::HolderUnreachable
                )));
            }
            (op, Reply::Error { code, message, .. }) => {
                let why = match code {
                    ErrorCode::SessionExpired => format!("session expired: {message}"),
                    ErrorCode::ShuttingDown => format!("shutting down: {message}"),
                    ErrorCode::BadRequest => format!("request refused: {message}"),
                };
                followups.push(Followup::Dead(why, Some(op)));
            }
            (op, other) => {
                followups.push(Followup::Dead(
                    format!("reply {:?} does not match its request", other.kind()),
                    Some(op),
                ));
            }
        }
    }

    fn after_reply(&mut self, server: usize, f: Followup) -> Result<(), PagerError> {
        match f {
            Followup::GetFailed(it, what) => self.get_failed(server, it, Some(what)),
            Followup::Stored(it) => self.stored(it, server)?,
            Followup::Replace(it) => {
                self.servers[server].load.free_pages = 0;
                self.put_failed(it, server)?;
            }
            // Answers that only a parity pager's requests get (see `complete`).
            Followup::Refused(it) => self.par_holder_unreachable(it, server)?,
            Followup::Unprotected(it) => self.par_unprotected(it, server)?,
            Followup::Shipped(id) => self.par_shipped(id)?,
            Followup::ShipFailed(id) => self.par_ship_failed(id)?,
            Followup::Scanned(groups, orphans) => self.par_scanned(server, groups, orphans),
            Followup::Stale(keys) => self.par_stale(server, keys),
            Followup::Dead(why, op) => {
                self.mark_dead(server, TransportError::Protocol(why));
                if let Some(op) = op {
                    self.fail_op(server, op);
                }
            }
        }
        Ok(())
    }

    /// Marks a server dead and fails over everything queued for it and in flight to it.
    fn mark_dead(&mut self, server: usize, err: TransportError) {
        if self.servers[server].alive {
            tracing::warn!(server = %self.servers[server].info.name, "server marked dead: {err}");
            tracing::debug!(
                in_flight = self.inflight.per_server[server],
                ops = ?self.inflight.ops.iter().filter(|(_, (s, _))| *s == server).collect::<Vec<_>>(),
                "failing over"
            );
            self.counters.servers_dead += 1;
            self.servers[server].alive = false;
            self.servers[server].load.alive = false;
            self.servers[server].dead_reason = err.to_string();
            // Before its requests fail over (a parity pager rebuilds a read that failed there).
            self.server_lost(server);
        }
        let ids: Vec<u64> = self
            .inflight
            .ops
            .iter()
            .filter(|(_, (s, _))| *s == server)
            .map(|(&id, _)| id)
            .collect();
        let mut ops: Vec<Op> = Vec::new();
        for id in ids {
            let (_, op) = self.inflight.ops.remove(&id).expect("listed above");
            self.inflight.per_server[server] -= op.credits();
            ops.push(op);
        }
        ops.extend(
            std::mem::take(&mut self.queues[server])
                .into_iter()
                .map(|q| match q {
                    Queued::Batch(op) | Queued::Frame { op, .. } => op,
                }),
        );
        for op in ops {
            self.fail_op(server, op);
        }
        self.server_failed_over(server);
    }

    /// An operation that will get no reply from `server`.
    fn fail_op(&mut self, server: usize, op: Op) {
        match op {
            Op::Get(items) => {
                for it in items {
                    self.get_failed(server, it, None);
                }
            }
            Op::Put(items) => {
                // The data is still in its slot: place the copy elsewhere.
                for it in items {
                    let placed = self.put_failed(it, server);
                    if let Err(e) = placed {
                        tracing::error!(
                            page = it.page,
                            "could not place page after server failure: {e}"
                        );
                    }
                }
            }
            Op::Delete | Op::Gc(_) | Op::Delta | Op::Scan => {}
            Op::Ship(id) => {
                if let Err(e) = self.par_ship_failed(id) {
                    tracing::error!("could not place pages after a holder failed: {e}");
                }
            }
        }
    }
}

/// What to do after a reply, once the transport's buffer is no longer borrowed.
#[derive(Debug)]
enum Followup {
    GetFailed(GetItem, &'static str),
    Stored(PutItem),
    Replace(PutItem),
    /// Not stored: the server could not tell the page's parity holder (which may have changed
    /// its group all the same). Sent again, or placed elsewhere.
    Refused(PutItem),
    /// Stored outside any parity group.
    Unprotected(PutItem),
    Shipped(u64),
    ShipFailed(u64),
    Scanned(Vec<parity::ScannedGroup>, Vec<PageKey>),
    /// Copies a parity pager could not delete yet.
    Stale(Vec<PageKey>),
    Dead(String, Option<Op>),
}

#[cfg(test)]
mod tests;
