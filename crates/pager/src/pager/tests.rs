//! The pager against an in-memory cluster of real `netram-store` stores, spoken to through real
//! encoded frames, with servers that can be killed, filled, or made to corrupt pages, and
//! replies delivered out of order.

use super::*;
use crate::scheme::stripe;
use crate::*;
use netram_proto::{decode_reply, decode_request, Reply};
use netram_store::{serve, SessionHandle, Store, StoreConfig};
use proptest::prelude::*;
use std::collections::VecDeque;

struct MemServer {
    store: Store<Vec<u8>>,
    session: SessionHandle,
    replies: VecDeque<Vec<u8>>,
    dead: bool,
    /// Flip a bit in the next GET reply's data.
    corrupt_next: bool,
    /// Flip a bit in every GET reply's data.
    corrupt_always: bool,
    /// Flip a bit in the last page of every PUT on its way here.
    corrupt_puts: bool,
    /// Replies wait here (as on a slow network): `try_recv` finds none, and `recv` times out.
    held: bool,
}

impl MemServer {
    /// A store of `capacity` pages with the client's session open.
    fn new(capacity: usize) -> Self {
        let mut store = Store::new(vec![0u8; capacity * PAGE_SIZE], StoreConfig::default());
        let session = store.open_session(1, 1, 1, 0).unwrap();
        MemServer {
            store,
            session,
            replies: VecDeque::new(),
            dead: false,
            corrupt_next: false,
            corrupt_always: false,
            corrupt_puts: false,
            held: false,
        }
    }
}

struct MemCluster {
    servers: Vec<MemServer>,
    window: u32,
    /// Deliver each server's replies in a shuffled order.
    rng: Option<fastrand::Rng>,
    last: Vec<u8>,
    /// Servers hand nothing over (as to a target they do not count a member).
    no_handover: bool,
}

impl MemCluster {
    fn new(capacities: &[usize]) -> Self {
        let servers = capacities.iter().map(|&c| MemServer::new(c)).collect();
        Self {
            servers,
            window: 8,
            rng: None,
            last: Vec::new(),
            no_handover: false,
        }
    }

    /// Runs a frame through server `i`'s own request logic (`netram_store::serve`), carrying
    /// parity deltas to their holders at once (a dead holder is unreachable).
    fn serve(&mut self, i: usize, frame: &[u8]) -> Option<Vec<u8>> {
        let (id, req) = decode_request(frame).expect("the pager sends valid frames");
        let is_get = matches!(req, Request::Get(_));
        let mut out = Vec::new();
        let s = &mut self.servers[i];
        let o = serve::handle_request(&mut s.store, s.session, id, req, 0, 0, &mut out, |_| vec![]);
        if let serve::Outcome::Forward(fwd) = o {
            let outcomes: Vec<serve::DeltaOutcome> = fwd
                .deltas
                .iter()
                .map(|(holder, d)| {
                    let Some(h) = (0..self.servers.len()).find(|&h| mem_addr(h) == holder.addr)
                    else {
                        return serve::DeltaOutcome::Unreachable;
                    };
                    // A real server forwards only to the node the owner named.
                    assert_eq!(
                        holder.node,
                        h as u64 + 1,
                        "the pager named the holder's node"
                    );
                    if self.servers[h].dead {
                        return serve::DeltaOutcome::Unreachable;
                    }
                    // The holder checks the sender as over TLS: server `i`, a server.
                    let by =
                        netram_store::DeltaFrom::Peer(netram_store::Peer::Server(i as u64 + 1));
                    match self.servers[h].store.apply_delta(&d.as_delta(), by) {
                        netram_proto::DeltaStatus::Applied => serve::DeltaOutcome::Applied,
                        _ => serve::DeltaOutcome::UnknownGroup,
                    }
                })
                .collect();
            let s = &mut self.servers[i];
            serve::finish_forward(&mut s.store, s.session, fwd, &outcomes, 0, 0, &mut out);
        } else if let serve::Outcome::Handover(ho) = o {
            // Handed over at once; the new server takes them as from server `i` over TLS.
            let to = (0..self.servers.len()).find(|&t| mem_addr(t) == ho.to.addr);
            let status: Vec<netram_proto::MoveStatus> = match to {
                Some(t) if !self.servers[t].dead && !self.no_handover => {
                    assert_eq!(
                        ho.to.node,
                        t as u64 + 1,
                        "the pager named the target's node"
                    );
                    let by = netram_store::Peer::Server(i as u64 + 1);
                    let store = &mut self.servers[t].store;
                    ho.pages
                        .iter()
                        .map(|p| store.adopt(by, ho.owner, &p.as_page(), 0))
                        .collect()
                }
                _ => Vec::new(),
            };
            let s = &mut self.servers[i];
            serve::finish_handover(&mut s.store, s.session, ho, &status, 0, &mut out);
        }
        let s = &mut self.servers[i];
        if out.is_empty() {
            return None;
        }
        if is_get && (std::mem::take(&mut s.corrupt_next) || s.corrupt_always) {
            let n = out.len();
            out[n - 1] ^= 1;
        }
        Some(out)
    }
}

impl Transport for MemCluster {
    fn servers(&self) -> Vec<ServerInfo> {
        self.servers
            .iter()
            .enumerate()
            .map(|(i, s)| ServerInfo {
                name: format!("mem{i}"),
                addr: Some(mem_addr(i)),
                node: i as u64 + 1,
                window: self.window,
                capacity_pages: s.store.capacity_pages(),
                free_pages: s.store.free_pages(),
                connected: Ok(()),
            })
            .collect()
    }

    fn send(
        &mut self,
        server: usize,
        req_id: u64,
        req: &Request<'_>,
    ) -> Result<(), TransportError> {
        if self.servers[server].dead {
            return Err(TransportError::Disconnected("killed".into()));
        }
        let mut frame = Vec::new();
        req.encode(req_id, &mut frame);
        if self.servers[server].corrupt_puts && matches!(req, Request::Put(_)) {
            let n = frame.len();
            frame[n - 1] ^= 1;
        }
        if let Some(r) = self.serve(server, &frame) {
            self.servers[server].replies.push_back(r);
        }
        Ok(())
    }

    fn recv(&mut self, server: usize) -> Result<(u64, Reply<'_>), TransportError> {
        let s = &mut self.servers[server];
        if s.dead {
            return Err(TransportError::Disconnected("killed".into()));
        }
        if s.held {
            return Err(TransportError::Timeout(0));
        }
        let i = match &mut self.rng {
            Some(rng) if !s.replies.is_empty() => rng.usize(0..s.replies.len()),
            _ => 0,
        };
        self.last = s.replies.remove(i).ok_or(TransportError::Timeout(0))?;
        decode_reply(&self.last).map_err(|e| TransportError::Protocol(e.to_string()))
    }

    /// A killed server that is running again, empty (a restarted daemon).
    fn reconnect(&mut self, server: usize) -> Result<ServerInfo, TransportError> {
        if self.servers[server].dead {
            return Err(TransportError::Disconnected("still killed".into()));
        }
        let capacity = self.servers[server].store.capacity_pages() as usize;
        self.servers[server] = MemServer::new(capacity);
        Ok(self.servers().swap_remove(server))
    }

    /// A server that joined later: `memN`'s capacity is 100 pages.
    fn add_server(&mut self, _name: &str) -> Result<ServerInfo, TransportError> {
        self.servers.push(MemServer::new(100));
        Ok(self.servers().pop().expect("just pushed"))
    }

    fn try_recv(&mut self, server: usize) -> Option<Result<(u64, Reply<'_>), TransportError>> {
        let s = &self.servers[server];
        if (s.replies.is_empty() || s.held) && !s.dead {
            return None;
        }
        Some(self.recv(server))
    }
}

fn mem_addr(i: usize) -> std::net::SocketAddr {
    std::net::SocketAddr::from(([10, 0, 0, i as u8 + 1], 7077))
}

/// The configuration the tests start from: pages sealed end to end, as every front end runs.
fn sealed() -> PagerConfig {
    PagerConfig {
        seal: Some(SealKey([0x5e; SEAL_KEY_LEN])),
        ..Default::default()
    }
}

fn content(page: u64, round: u8) -> Vec<u8> {
    let mut d = vec![0u8; PAGE_SIZE];
    for (i, b) in d.iter_mut().enumerate() {
        *b = (page as u8) ^ (i as u8).wrapping_mul(31) ^ round;
    }
    d
}

fn pager(
    cluster: MemCluster,
    pages: u64,
    cache: usize,
    backing: Backing,
) -> Pager<MemCluster, MemDisk> {
    Pager::new(
        PagerConfig {
            pages,
            cache_pages: cache,
            backing,
            writeback_batch: 4,
            ..sealed()
        },
        cluster,
        MemDisk::default(),
    )
}

#[test]
fn the_invariants_catch_a_lost_slot_a_slot_held_twice_and_stray_credits() {
    let mut p = pager(MemCluster::new(&[8, 8]), 8, 2, Backing::Cluster);
    for pg in 0..6 {
        p.write(pg, &content(pg, 1)).unwrap();
    }
    p.flush().unwrap();
    p.check_invariants().unwrap();

    let lost = p.free_slots.pop().unwrap();
    let e = p.check_invariants().unwrap_err();
    assert!(e.contains(&format!("slot {lost} is lost")), "{e}");
    p.free_slots.push(lost);

    let cached = *p.cache.iter().next().unwrap().1;
    p.free_slots.push(cached);
    let e = p.check_invariants().unwrap_err();
    assert!(e.contains(&format!("slot {cached} is both")), "{e}");
    p.free_slots.pop();

    p.inflight.per_server[1] += 1;
    let e = p.check_invariants().unwrap_err();
    assert!(e.contains("server 1: 1 credits taken"), "{e}");
    p.inflight.per_server[1] -= 1;

    let free = *p.free_slots.last().unwrap();
    p.dirty[free as usize] = true;
    let e = p.check_invariants().unwrap_err();
    assert!(e.contains(&format!("slot {free} is dirty but free")), "{e}");
    p.dirty[free as usize] = false;
    p.check_invariants().unwrap();
}

#[test]
fn a_disk_that_fails_its_writes_loses_nothing_and_flush_reports_it() {
    for backing in [Backing::Disk, Backing::ClusterDisk, Backing::Cluster] {
        // One small server: under `cluster` backing the disk takes the spill.
        let mut p = Pager::new(
            PagerConfig {
                pages: 12,
                cache_pages: 4,
                backing,
                writeback_batch: 2,
                ..sealed()
            },
            MemCluster::new(&[2]),
            MemDisk::failing_from(3),
        );
        for pg in 0..8 {
            p.write(pg, &content(pg, 1))
                .unwrap_or_else(|e| panic!("{backing} page {pg}: {e} {:?}", p.counters()));
            p.check_invariants().unwrap();
        }
        let e = p.flush().unwrap_err();
        assert!(matches!(e, PagerError::Disk(_)), "{backing}: {e}");
        assert!(e.to_string().contains("injected failure"), "{e}");
        p.check_invariants().unwrap();
        // The pages the disk failed stayed in memory (dirty, cached, on top of the budget: the
        // invariants check it).
        assert!(p.counters().disk_write_errors > 0, "{backing}");
        assert!(!p.rehomed.is_empty(), "{backing}");
        for pg in 0..8 {
            assert_eq!(
                read(&mut p, pg).unwrap(),
                content(pg, 1),
                "{backing} page {pg}"
            );
        }
        // A disk that fails every write: a write that needs room and finds none says so,
        // rather than evicting forever; one that succeeds is kept.
        let mut written = Vec::new();
        for pg in 8..12 {
            match p.write(pg, &content(pg, 1)) {
                Ok(()) => written.push(pg),
                Err(PagerError::Disk(_)) => {}
                Err(e) => panic!("{backing}: {e}"),
            }
            p.check_invariants().unwrap();
        }
        p.disk_mut().heal();
        // The first flush after the disk heals writes everything, and reports a failure not
        // reported yet (once); the next has nothing to report.
        match p.flush() {
            Ok(()) | Err(PagerError::Disk(_)) => {}
            Err(e) => panic!("{backing}: {e}"),
        }
        assert!(p.rehomed.is_empty(), "{backing}");
        p.flush().unwrap();
        p.check_invariants().unwrap();
        for &pg in &written {
            assert_eq!(
                read(&mut p, pg).unwrap(),
                content(pg, 1),
                "{backing} page {pg}"
            );
        }
        assert!(p.rehomed.is_empty(), "{backing}");
        assert!(p.cache.len() <= 4, "{backing}");
        for pg in 0..8 {
            assert_eq!(
                read(&mut p, pg).unwrap(),
                content(pg, 1),
                "{backing} page {pg}"
            );
        }
    }
}

#[test]
fn a_write_through_pager_reports_a_failed_disk_write_and_keeps_the_page() {
    let mut p = pager(MemCluster::new(&[4]), 4, 0, Backing::Disk);
    p.disk = MemDisk::failing_from(2);
    p.write(0, &content(0, 1)).unwrap();
    let e = p.write(1, &content(1, 1)).unwrap_err();
    assert!(matches!(e, PagerError::Disk(_)), "{e}");
    assert_eq!(read(&mut p, 1).unwrap(), content(1, 1), "kept in memory");
    p.check_invariants().unwrap();
    p.disk_mut().heal();
    // The next write of the page goes through in its place.
    p.write(1, &content(1, 2)).unwrap();
    assert!(p.cache.is_empty());
    p.flush().unwrap();
    assert_eq!(read(&mut p, 1).unwrap(), content(1, 2));
    assert_eq!(read(&mut p, 0).unwrap(), content(0, 1));
}

#[test]
fn a_read_that_fails_midway_leaves_nothing_for_the_next_read() {
    // Pages 0 and 2 on the server, page 1 spilled to the disk (the server is full). Under
    // `cluster` backing: under `cluster+disk` page 1 would take page 0's frame, a clean page.
    let mut p = pager(MemCluster::new(&[2]), 4, 0, Backing::Cluster);
    for pg in [0, 2, 1] {
        p.write(pg, &content(pg, 1)).unwrap();
    }
    assert_eq!(p.holders(1), Vec::<usize>::new());
    // The disk loses page 1: a read of [0, 1] fails on it with page 0's GET under way.
    p.disk = MemDisk::default();
    let mut out = vec![0u8; 2 * PAGE_SIZE];
    assert!(matches!(
        p.read_many(&[0, 1], &mut out),
        Err(PagerError::Disk(_))
    ));
    p.check_invariants().unwrap();
    // Page 0's late answer is not taken for the next read's first page.
    assert!(
        read(&mut p, 2).unwrap() == content(2, 1),
        "page 2 read back other data"
    );
    assert!(
        read(&mut p, 0).unwrap() == content(0, 1),
        "page 0 read back other data"
    );
    p.check_invariants().unwrap();
}

fn read(p: &mut Pager<MemCluster, MemDisk>, page: u64) -> Result<Vec<u8>, PagerError> {
    let mut out = vec![0u8; PAGE_SIZE];
    p.read(page, &mut out).map(|()| out)
}

#[test]
fn poll_finishes_write_backs_between_operations_without_waiting() {
    let mut p = pager(MemCluster::new(&[64, 64]), 32, 4, Backing::Cluster);
    let pages: Vec<u64> = (0..12).collect();
    let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 1)).collect();
    p.write_many(&pages, &data).unwrap();
    // Evicted pages went out; their acknowledgements wait for the pager to look.
    assert!(!p.writeback.is_empty());
    let handled = p.poll().unwrap();
    assert!(handled > 0);
    assert!(p.writeback.is_empty(), "every write-back finished");
    assert!(p.inflight.ops.is_empty());
    p.check_invariants().unwrap();
    // Nothing arrived since: nothing to handle, and no wait.
    assert_eq!(p.poll().unwrap(), 0);
    for pg in 0..12 {
        assert_eq!(read(&mut p, pg).unwrap(), content(pg, 1), "page {pg}");
    }
}

/// Takes every reply the servers have queued, as a runtime that owns the sockets would read
/// them: (server, frame).
fn take_replies(p: &mut Pager<MemCluster, MemDisk>) -> Vec<(usize, Vec<u8>)> {
    let mut out = Vec::new();
    for (s, srv) in p.transport_mut().servers.iter_mut().enumerate() {
        out.extend(srv.replies.drain(..).map(|f| (s, f)));
    }
    out
}

#[test]
fn replies_pushed_one_at_a_time_in_any_order_finish_the_write_backs() {
    let mut p = pager(MemCluster::new(&[64, 64, 64]), 64, 4, Backing::Cluster);
    let pages: Vec<u64> = (0..40).collect();
    let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 1)).collect();
    p.write_many(&pages, &data).unwrap();
    assert!(!p.writeback.is_empty());
    let mut rng = fastrand::Rng::with_seed(7);
    let mut delivered = 0;
    // Pushing a reply may send more requests (credits came back): deliver until none is left.
    loop {
        let mut replies = take_replies(&mut p);
        if replies.is_empty() {
            break;
        }
        rng.shuffle(&mut replies);
        for (s, frame) in replies {
            let (id, reply) = decode_reply(&frame).unwrap();
            p.on_reply(s, id, &reply).unwrap();
            p.check_invariants().unwrap();
            delivered += 1;
        }
    }
    assert!(delivered > 0);
    assert!(p.writeback.is_empty() && p.inflight.ops.is_empty());
    assert_eq!(p.counters().servers_dead, 0);
    for pg in 0..40 {
        assert_eq!(read(&mut p, pg).unwrap(), content(pg, 1), "page {pg}");
    }
}

#[test]
fn a_pushed_reply_that_answers_nothing_declares_its_server_dead() {
    let cfg = PagerConfig {
        pages: 32,
        cache_pages: 4,
        writeback_batch: 4,
        redundancy: Scheme::Mirror { copies: 2 },
        ..sealed()
    };
    let mut p = Pager::new(cfg, MemCluster::new(&[64, 64, 64]), MemDisk::default());
    let pages: Vec<u64> = (0..16).collect();
    let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 1)).collect();
    p.write_many(&pages, &data).unwrap();
    let replies = take_replies(&mut p);
    let (s, frame) = replies[0].clone();
    let (id, reply) = decode_reply(&frame).unwrap();
    // Claimed by another server: a confused (or lying) peer.
    let claimant = (s + 1) % 3;
    p.on_reply(claimant, id, &reply).unwrap();
    assert_eq!(p.counters().servers_dead, 1);
    assert!(
        !p.servers().nth(claimant).unwrap().1,
        "the claimant is dead"
    );
    assert!(
        p.inflight.ops.contains_key(&id),
        "the real request still waits"
    );
    p.on_reply(s, id, &reply).unwrap();
    assert!(!p.inflight.ops.contains_key(&id));
    // The rest of the replies, as they come.
    for (s, frame) in replies.into_iter().skip(1) {
        let (id, reply) = decode_reply(&frame).unwrap();
        if p.inflight.ops.contains_key(&id) {
            p.on_reply(s, id, &reply).unwrap();
        }
    }
    p.flush().unwrap();
    p.check_invariants().unwrap();
    for pg in 0..16 {
        assert_eq!(read(&mut p, pg).unwrap(), content(pg, 1), "page {pg}");
    }
    // The same answer again answers nothing any more: not believed either.
    p.on_reply(s, id, &reply).unwrap();
    assert_eq!(p.counters().servers_dead, 2);
    p.check_invariants().unwrap();
}

#[test]
fn a_pushed_failure_fails_over_what_was_in_flight() {
    let mut p = pager(MemCluster::new(&[64, 64]), 32, 4, Backing::Cluster);
    let pages: Vec<u64> = (0..16).collect();
    let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 1)).collect();
    p.write_many(&pages, &data).unwrap();
    let in_flight_to_0 = p.inflight.per_server[0];
    assert!(in_flight_to_0 > 0);
    // Its answers never come: the runtime's timer says so.
    p.transport_mut().servers[0].replies.clear();
    p.transport_mut().servers[0].dead = true;
    p.on_failure(0, TransportError::Timeout(1000));
    assert_eq!(p.inflight.per_server[0], 0);
    p.flush().unwrap();
    p.check_invariants().unwrap();
    for pg in 0..16 {
        assert_eq!(read(&mut p, pg).unwrap(), content(pg, 1), "page {pg}");
    }
    assert!(p.holders(3).iter().all(|&s| s == 1));
}

#[test]
fn a_page_damaged_on_its_way_to_a_server_is_placed_again_from_its_slot() {
    let mut cluster = MemCluster::new(&[64, 64]);
    cluster.servers[0].corrupt_puts = true;
    let mut p = pager(cluster, 32, 4, Backing::Cluster);
    let pages: Vec<u64> = (0..16).collect();
    let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 1)).collect();
    p.write_many(&pages, &data).unwrap();
    p.flush().unwrap();
    p.check_invariants().unwrap();
    assert!(p.counters().puts_refused_corrupt > 0);
    assert_eq!(
        p.counters().servers_dead,
        0,
        "a damaged page is not the server's fault"
    );
    // Only the last page of each PUT was damaged: the others are where the table says.
    let on_0 = (0..16).filter(|&pg| p.holders(pg) == vec![0]).count() as u64;
    assert_eq!(p.transport().servers[0].store.stored_pages(), on_0);
    assert_eq!(
        p.transport().servers[0]
            .store
            .counters()
            .puts_refused_corrupt,
        p.counters().puts_refused_corrupt
    );
    for pg in 0..16 {
        assert_eq!(read(&mut p, pg).unwrap(), content(pg, 1), "page {pg}");
    }
}

#[test]
fn unwritten_pages_read_as_zero_without_a_request() {
    let mut p = pager(MemCluster::new(&[8]), 4, 2, Backing::Cluster);
    assert_eq!(read(&mut p, 3).unwrap(), vec![0u8; PAGE_SIZE]);
    assert_eq!(p.counters().gets, 0);
    assert_eq!(p.counters().zero_reads, 1);
}

#[test]
fn write_back_cache_holds_dirty_pages_until_evicted_or_flushed() {
    let mut p = pager(MemCluster::new(&[64]), 32, 8, Backing::Cluster);
    for page in 0..8 {
        p.write(page, &content(page, 1)).unwrap();
    }
    assert_eq!(p.counters().puts, 0, "eight pages fit the cache");
    p.write(8, &content(8, 1)).unwrap();
    assert_eq!(
        p.counters().evictions_dirty,
        4,
        "one batch of LRU pages went out"
    );
    p.flush().unwrap();
    assert_eq!(p.transport().servers[0].store.stored_pages(), 9);
    for page in 0..9 {
        assert_eq!(read(&mut p, page).unwrap(), content(page, 1));
    }
}

#[test]
fn a_full_server_refuses_and_pages_go_elsewhere_then_to_disk() {
    let mut p = pager(MemCluster::new(&[3, 3]), 10, 0, Backing::Cluster);
    // Pipelined: PUTs are placed before the replies that report the servers full arrive, so
    // only refusals can stop them.
    let pages: Vec<u64> = (0..10).collect();
    let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 2)).collect();
    p.write_many(&pages, &data).unwrap();
    let c = p.counters().clone();
    assert_eq!(p.pages_per_server(), vec![3, 3]);
    assert_eq!(c.spills, 4);
    assert!(
        c.puts_refused_full >= 1,
        "the second server was found full by a refusal"
    );
    assert_eq!(p.pages_on_disk_only(), 4);
    for page in 0..10 {
        assert_eq!(read(&mut p, page).unwrap(), content(page, 2), "page {page}");
    }
}

#[test]
fn overwrites_stay_on_their_server_and_versions_are_checked() {
    let mut p = pager(MemCluster::new(&[4, 4]), 4, 0, Backing::Cluster);
    for round in 0..5 {
        for page in 0..4 {
            p.write(page, &content(page, round)).unwrap();
        }
    }
    assert_eq!(p.pages_per_server().iter().sum::<u64>(), 4);
    assert_eq!(p.counters().deletes, 0, "no page moved");
    for page in 0..4 {
        assert_eq!(read(&mut p, page).unwrap(), content(page, 4));
    }
}

#[test]
fn a_dead_server_loses_exactly_its_pages_with_cluster_backing() {
    let mut p = pager(MemCluster::new(&[100, 100, 100]), 60, 0, Backing::Cluster);
    for page in 0..60 {
        p.write(page, &content(page, 3)).unwrap();
    }
    let holders: Vec<Option<usize>> = (0..60).map(|pg| p.table.holders(pg).first()).collect();
    p.transport.servers[1].dead = true;
    let mut lost = Vec::new();
    for page in 0..60 {
        match read(&mut p, page) {
            Ok(d) => assert_eq!(d, content(page, 3)),
            Err(PagerError::Lost(l)) => {
                assert_eq!(l.len(), 1);
                assert_eq!(l[0].server, "mem1");
                assert!(PagerError::Lost(l.clone()).to_string().contains("mem1"));
                lost.extend(l[0].pages.iter().copied());
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    let expected: Vec<u64> = (0..60)
        .filter(|&pg| holders[pg as usize] == Some(1))
        .collect();
    assert!(!expected.is_empty());
    assert_eq!(lost, expected);
    // Rewriting a lost page places it on a live server again.
    p.write(expected[0], &content(0, 9)).unwrap();
    assert_eq!(read(&mut p, expected[0]).unwrap(), content(0, 9));
}

#[test]
fn a_server_added_later_takes_new_pages_and_survives_as_any_other() {
    for scheme in ["none", "mirror:2", "rs:2+1"] {
        let mut p = Pager::new(
            PagerConfig {
                pages: 120,
                cache_pages: 4,
                writeback_batch: 4,
                redundancy: scheme.parse().unwrap(),
                ..sealed()
            },
            MemCluster::new(&[100, 100, 100]),
            MemDisk::default(),
        );
        for page in 0..60 {
            p.write(page, &content(page, 1)).unwrap();
        }
        p.flush().unwrap();
        assert_eq!(p.add_server("mem3").unwrap(), 3, "{scheme}");
        p.check_invariants().unwrap();
        for page in 60..120 {
            p.write(page, &content(page, 2)).unwrap();
        }
        p.flush().unwrap();
        p.check_invariants().unwrap();
        assert!(
            p.transport.servers[3].store.stored_pages() > 0,
            "{scheme}: the new server took pages"
        );
        // It is a server like the others: under redundancy its death loses nothing.
        if scheme != "none" {
            p.transport.servers[3].dead = true;
        }
        for page in 0..120 {
            let round = if page < 60 { 1 } else { 2 };
            assert_eq!(
                read(&mut p, page).unwrap(),
                content(page, round),
                "{scheme}"
            );
        }
        p.check_invariants().unwrap();
    }
    // Parity groups name their servers by addresses fixed at start.
    let mut p = Pager::new(
        PagerConfig {
            pages: 8,
            redundancy: "parity:2".parse().unwrap(),
            ..sealed()
        },
        MemCluster::new(&[100, 100, 100]),
        MemDisk::default(),
    );
    assert!(matches!(
        p.add_server("mem3"),
        Err(PagerError::AddServer(_))
    ));
}

#[test]
fn a_dead_server_is_survived_with_cluster_disk_backing() {
    let mut p = pager(
        MemCluster::new(&[100, 100, 100]),
        60,
        4,
        Backing::ClusterDisk,
    );
    for page in 0..60 {
        p.write(page, &content(page, 4)).unwrap();
    }
    p.flush().unwrap();
    p.transport.servers[2].dead = true;
    for page in 0..60 {
        assert_eq!(read(&mut p, page).unwrap(), content(page, 4));
    }
    assert!(p.counters().disk_fallbacks > 0);
}

#[test]
fn the_maintenance_schedule_probes_finds_the_dead_and_rebuilds_on_the_clock_it_is_given() {
    let mut p = Pager::new(
        PagerConfig {
            pages: 40,
            cache_pages: 0,
            redundancy: "mirror:2".parse().unwrap(),
            ..sealed()
        },
        MemCluster::new(&[100, 100, 100]),
        MemDisk::default(),
    );
    p.set_schedule(ScheduleConfig {
        probe_every_us: 1_000,
        reconnect_every_us: 5_000,
        recover_batch: 8,
        migrate_batch: 8,
        ..ScheduleConfig::default()
    });
    for page in 0..40 {
        p.write(page, &content(page, 1)).unwrap();
    }
    p.transport.servers[1].dead = true;
    // The first tick starts the clocks; nothing is due before a period has passed (the
    // writes were acknowledged already: no reply waits).
    assert_eq!(p.on_tick(10_000).unwrap(), Tick::default());
    assert_eq!(p.on_tick(10_999).unwrap(), Tick::default());
    assert_eq!(
        p.counters().servers_dead,
        0,
        "nobody asked the dead server anything"
    );
    // The probe is due: it finds the dead server, and recovery starts in the same tick.
    let t = p.on_tick(11_000).unwrap();
    assert_eq!(t.found_dead, 1);
    assert_eq!(t.rebuilt, 8, "one bounded step");
    // Recovery goes on at every tick until every page has two copies again.
    let mut now = 11_000;
    while p.degraded_pages() > 0 {
        now += 100;
        p.on_tick(now).unwrap();
        assert!(now < 1_000_000, "recovery does not end");
    }
    p.flush().unwrap();
    for page in 0..40 {
        let holders = p.holders(page);
        assert_eq!(holders.len(), 2, "page {page}");
        assert!(!holders.contains(&1), "page {page}");
        assert_eq!(read(&mut p, page).unwrap(), content(page, 1));
    }
    p.check_invariants().unwrap();
}

#[test]
fn writes_in_flight_to_a_dying_server_go_elsewhere() {
    let mut p = pager(MemCluster::new(&[100, 100]), 40, 0, Backing::Cluster);
    p.transport.servers[0].dead = true;
    for page in 0..40 {
        p.write(page, &content(page, 5)).unwrap();
    }
    assert_eq!(p.pages_per_server(), vec![0, 40]);
    for page in 0..40 {
        assert_eq!(read(&mut p, page).unwrap(), content(page, 5));
    }
}

/// A pager whose pages travel in clear, checked by their crc32c only.
/// The same pager, compressing its pages before it seals them (`seal.rs`) as over a
/// 100 Mbit/s link: `content` pages shrink to a few hundred bytes.
fn compressing(mut p: Pager<MemCluster, MemDisk>) -> Pager<MemCluster, MemDisk> {
    let cfg = PagerConfig {
        compress: Some(netram_proto::compress::Rule {
            link_bytes_per_us: 12.5,
            codec_us: 3.0,
        }),
        ..p.cfg.clone()
    };
    let t = std::mem::replace(&mut p.transport, MemCluster::new(&[]));
    Pager::new(cfg, t, MemDisk::default())
}

fn unsealed(mut p: Pager<MemCluster, MemDisk>) -> Pager<MemCluster, MemDisk> {
    let cfg = PagerConfig {
        seal: None,
        ..p.cfg.clone()
    };
    let t = std::mem::replace(&mut p.transport, MemCluster::new(&[]));
    Pager::new(cfg, t, MemDisk::default())
}

/// Bad pages counted, sealed or not: (crc32c failures, authentication failures).
fn bad_pages(p: &Pager<MemCluster, MemDisk>) -> (u64, u64) {
    (
        p.counters().checksum_failures,
        p.counters().page_auth_failures,
    )
}

#[test]
fn a_corrupt_page_is_reported_never_returned() {
    for seal in [true, false] {
        let p = pager(MemCluster::new(&[8]), 2, 0, Backing::Cluster);
        let mut p = if seal { p } else { unsealed(p) };
        p.write(0, &content(0, 6)).unwrap();
        p.transport.servers[0].corrupt_next = true;
        assert!(matches!(
            read(&mut p, 0),
            Err(PagerError::Corrupt { page: 0, .. })
        ));
        assert_eq!(bad_pages(&p), if seal { (0, 1) } else { (1, 0) });
        assert_eq!(
            read(&mut p, 0).unwrap(),
            content(0, 6),
            "the next read is clean"
        );
    }
}

#[test]
fn a_corrupt_page_is_read_from_disk_with_cluster_disk_backing() {
    for seal in [true, false] {
        let p = pager(MemCluster::new(&[8]), 2, 0, Backing::ClusterDisk);
        let mut p = if seal { p } else { unsealed(p) };
        p.write(0, &content(0, 7)).unwrap();
        p.transport.servers[0].corrupt_next = true;
        assert_eq!(read(&mut p, 0).unwrap(), content(0, 7));
        assert_eq!(bad_pages(&p), if seal { (0, 1) } else { (1, 0) });
    }
}

#[test]
fn a_full_server_drops_the_oldest_cluster_disk_pages_and_they_are_read_from_disk() {
    for seal in [true, false] {
        let p = pager(MemCluster::new(&[8]), 16, 0, Backing::ClusterDisk);
        let mut p = if seal { p } else { unsealed(p) };
        for page in 0..16 {
            p.write(page, &content(page, 3)).unwrap();
        }
        p.flush().unwrap();
        // Every page went to the server (none spilled): the newest eight are there, the
        // eight oldest gave their frames up.
        let store = &p.transport().servers[0].store;
        assert_eq!(store.counters().clean_owned_dropped, 8);
        assert_eq!(store.owned_clean_pages(), 8);
        assert_eq!(p.counters().spills, 0);
        for page in 0..16 {
            assert_eq!(read(&mut p, page).unwrap(), content(page, 3), "page {page}");
        }
        let c = p.counters();
        assert_eq!((c.missing_pages, c.disk_fallbacks), (8, 8));
        assert_eq!(c.clean_copies_dropped, 8);
        assert_eq!(bad_pages(&p), (0, 0));
        // Forgotten where they were dropped: read again, straight from the disk.
        for page in 0..16 {
            assert_eq!(read(&mut p, page).unwrap(), content(page, 3), "page {page}");
        }
        assert_eq!(p.counters().missing_pages, 8);
        assert_eq!(p.pages_on_disk_only(), 8);
        // Under `cluster` backing the same server refuses the ninth page (it is the only
        // copy) and the pager spills.
        let mut q = pager(MemCluster::new(&[8]), 16, 0, Backing::Cluster);
        for page in 0..16 {
            q.write(page, &content(page, 3)).unwrap();
        }
        q.flush().unwrap();
        assert_eq!(q.counters().spills, 8);
        assert_eq!(q.transport().servers[0].store.owned_clean_pages(), 0);
        p.check_invariants().unwrap();
    }
}

#[test]
fn disk_backing_never_touches_the_cluster() {
    let mut p = pager(MemCluster::new(&[8]), 16, 2, Backing::Disk);
    for page in 0..16 {
        p.write(page, &content(page, 8)).unwrap();
    }
    p.flush().unwrap();
    for page in 0..16 {
        assert_eq!(read(&mut p, page).unwrap(), content(page, 8));
    }
    assert_eq!(p.counters().puts + p.counters().gets, 0);
    assert_eq!(p.transport().servers[0].store.stored_pages(), 0);
}

#[test]
fn discard_deletes_remote_copies() {
    let mut p = pager(MemCluster::new(&[8]), 4, 0, Backing::Cluster);
    p.write(1, &content(1, 1)).unwrap();
    p.discard(1).unwrap();
    assert_eq!(p.transport().servers[0].store.stored_pages(), 0);
    assert_eq!(read(&mut p, 1).unwrap(), vec![0u8; PAGE_SIZE]);
}

#[test]
fn bad_arguments_are_errors() {
    let mut p = pager(MemCluster::new(&[8]), 4, 0, Backing::Cluster);
    assert!(matches!(
        read(&mut p, 4),
        Err(PagerError::OutOfRange { page: 4, pages: 4 })
    ));
    assert!(matches!(
        p.write(0, &[0u8; 10]),
        Err(PagerError::BadBuffer { .. })
    ));
}

#[test]
fn batched_reads_pipeline_across_servers() {
    let mut p = pager(MemCluster::new(&[200, 200, 200]), 300, 0, Backing::Cluster);
    let pages: Vec<u64> = (0..300).collect();
    let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 1)).collect();
    p.write_many(&pages, &data).unwrap();
    let mut out = vec![0u8; data.len()];
    p.read_many(&pages, &mut out).unwrap();
    assert!(out == data);
    assert!(
        p.pages_per_server().iter().all(|&n| n > 50),
        "{:?}",
        p.pages_per_server()
    );
}

#[derive(Debug, Clone)]
enum Action {
    Write(u64, u8),
    Read(u64),
    Flush,
    Discard(u64),
    Kill(usize),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (0u64..48, any::<u8>()).prop_map(|(p, r)| Action::Write(p, r)),
        6 => (0u64..48).prop_map(Action::Read),
        1 => Just(Action::Flush),
        1 => (0u64..48).prop_map(Action::Discard),
        1 => (0usize..3).prop_map(Action::Kill),
    ]
}

/// Runs `actions` against a pager and a model of what every page should read, checking every
/// read and, after each action, that nothing is left in flight and no slot leaked.
fn run_actions(
    p: &mut Pager<MemCluster, MemDisk>,
    actions: Vec<Action>,
    kills: bool,
) -> Result<(), TestCaseError> {
    let mut model: HashMap<u64, u8> = HashMap::new();
    for a in actions {
        match a.clone() {
            Action::Write(pg, r) => {
                p.write(pg, &content(pg, r)).unwrap();
                model.insert(pg, r);
            }
            Action::Read(pg) => {
                let want = model
                    .get(&pg)
                    .map(|&r| content(pg, r))
                    .unwrap_or(vec![0u8; PAGE_SIZE]);
                prop_assert!(read(p, pg).unwrap() == want, "page {}", pg);
            }
            Action::Flush => p.flush().unwrap(),
            Action::Discard(pg) => {
                p.discard(pg).unwrap();
                model.remove(&pg);
            }
            Action::Kill(s) if kills => p.transport.servers[s].dead = true,
            Action::Kill(_) => {}
        }
        check_settled(
            p,
            kills,
            matches!(
                a,
                Action::Write(..) | Action::Read(_) | Action::Kill(_) | Action::Discard(_)
            ),
        )?;
    }
    // Whatever writes left in flight, a flush settles.
    p.flush().unwrap();
    check_settled(p, kills, false)
}

/// After an action: nothing in flight but the write-back a write, a read (which waits for its own
/// GETs only) or a kill may leave behind (with a cache, evictions are sent and not waited for), no slot leaked, and, once idle and without
/// kills, the servers hold exactly the table's pages.
fn check_settled(
    p: &Pager<MemCluster, MemDisk>,
    kills: bool,
    may_be_busy: bool,
) -> Result<(), TestCaseError> {
    if !may_be_busy || p.config().cache_pages == 0 {
        prop_assert!(p.idle());
        prop_assert!(p.writeback.is_empty());
    }
    prop_assert_eq!(
        p.free_slots.len() + p.cache.len() + p.writeback.len(),
        p.dirty.len(),
        "no slot leaks"
    );
    if let Err(e) = p.check_invariants() {
        prop_assert!(false, "invariant broken: {}", e);
    }
    if !kills && p.idle() {
        // Superseded remote copies are deleted: servers hold exactly the table's pages.
        let stored: u64 = p
            .transport()
            .servers
            .iter()
            .map(|s| s.store.stored_pages())
            .sum();
        prop_assert_eq!(stored, p.pages_per_server().iter().sum::<u64>());
    }
    Ok(())
}

proptest! {
    // 128 cases by default; PROPTEST_CASES=N runs more.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(128),
        ..ProptestConfig::default()
    })]

    /// With `cluster+disk` backing, whatever fails, every read returns the last write: small
    /// servers force FULL refusals and spills, replies come out of order, servers die.
    #[test]
    fn cluster_disk_never_loses_a_write(
        actions in prop::collection::vec(action(), 1..150),
        cache in 0usize..6,
        seed: u64,
        compress: bool,
    ) {
        let mut cluster = MemCluster::new(&[10, 12, 14]);
        cluster.rng = Some(fastrand::Rng::with_seed(seed));
        cluster.window = 3;
        let mut p = pager(cluster, 48, cache, Backing::ClusterDisk);
        if compress {
            p = compressing(p);
        }
        run_actions(&mut p, actions, true)?;
    }

    /// With `cluster` backing and no failures, the same holds, and remote copies never outnumber
    /// the pages that have one.
    #[test]
    fn cluster_keeps_every_write_and_no_garbage(
        actions in prop::collection::vec(action(), 1..150),
        cache in 0usize..6,
        seed: u64,
        compress: bool,
    ) {
        let mut cluster = MemCluster::new(&[10, 12, 14]);
        cluster.rng = Some(fastrand::Rng::with_seed(seed));
        let mut p = pager(cluster, 48, cache, Backing::Cluster);
        if compress {
            p = compressing(p);
        }
        run_actions(&mut p, actions, false)?;
    }
}

fn parity_pager(servers: usize, pages: u64, cache: usize) -> Pager<MemCluster, MemDisk> {
    Pager::new(
        PagerConfig {
            pages,
            cache_pages: cache,
            writeback_batch: 4,
            redundancy: Scheme::Parity { group: 4 },
            ..sealed()
        },
        MemCluster::new(&vec![256; servers]),
        MemDisk::default(),
    )
}

/// Every store's parity accounting: no group was ever found inconsistent.
fn parity_consistent(p: &Pager<MemCluster, MemDisk>) {
    for s in &p.transport().servers {
        s.store.check_invariants();
        assert_eq!(s.store.counters().parity_groups_inconsistent, 0);
    }
}

/// A recovery step never waits for the network (issue 38): it sends its reads and returns,
/// its replies held back; a page written while its recovery read is out keeps its new
/// version's copies (the read's old version is not written back over them), and recovery
/// ends once the replies are in. (A step that waited would time out on the held replies and
/// declare both live servers dead.)
#[test]
fn a_recovery_step_sends_its_reads_and_does_not_wait_for_them() {
    let mut p = rs_pager(3, 24, "mirror:2");
    for page in 0..24 {
        p.write(page, &content(page, 1)).unwrap();
    }
    p.flush().unwrap();
    let on_dead: Vec<u64> = (0..24).filter(|&pg| p.holders(pg).contains(&2)).collect();
    assert!(on_dead.len() > 1, "{on_dead:?}");
    p.transport_mut().servers[2].dead = true;
    p.on_failure(2, TransportError::Disconnected("killed".into()));
    assert_eq!(p.degraded_pages(), on_dead.len());
    for s in 0..2 {
        p.transport_mut().servers[s].held = true;
    }
    let step = p.recover(64).unwrap();
    assert_eq!(step.started, 0, "no read is in yet");
    assert_eq!(
        step.remaining,
        on_dead.len(),
        "every degraded page is being read"
    );
    assert_eq!(
        p.counters().servers_dead,
        1,
        "nothing waited for the held replies"
    );
    // A page being rebuilt is written again before its read is in.
    let written = on_dead[0];
    for s in 0..2 {
        p.transport_mut().servers[s].held = false;
    }
    p.write(written, &content(written, 2)).unwrap();
    recover_all(&mut p);
    p.flush().unwrap();
    p.check_invariants().unwrap();
    assert_eq!(p.counters().servers_dead, 1);
    for page in 0..24 {
        let holders = p.holders(page);
        assert_eq!(holders.len(), 2, "page {page}: {holders:?}");
        assert!(!holders.contains(&2), "page {page}");
        let round = if page == written { 2 } else { 1 };
        assert_eq!(
            read(&mut p, page).unwrap(),
            content(page, round),
            "page {page}"
        );
    }
    // Every holder the table names has the page's current version.
    for page in 0..24 {
        let loc = p.location(page).expect("written, settled");
        for s in loc.holders {
            let server = &p.transport().servers[s];
            let stored = server.store.peek(server.session, p.stored_key(page));
            assert_eq!(
                stored.map(|st| st.version),
                Some(loc.version),
                "page {page} on server {s}"
            );
        }
    }
}

/// A leaving parity holder's scan does not wait (issue 38): once server 0 holds nothing of
/// ours but groups' parity, a migration step asks it which groups those are and returns, its
/// reply held back; a later step takes the answer and writes the members again into new
/// groups, and the holder ends with nothing of ours. (The scan waited for its answer until
/// 2026-11-29: with the replies held, it timed out and declared every server dead.)
#[test]
fn a_leaving_parity_holders_scan_is_answered_at_a_later_step() {
    let mut p = parity_pager(5, 24, 0);
    p.set_direct_migration(false);
    for page in 0..24 {
        p.write(page, &content(page, 1)).unwrap();
    }
    p.flush().unwrap();
    p.transport_mut().servers[0].store.set_offer(0);
    p.probe_servers().unwrap();
    let mut held_scan = false;
    for _ in 0..100 {
        if !p.migration_due() {
            break;
        }
        let only_parity = (0..24).all(|pg| !p.holders(pg).contains(&0))
            && p.transport().servers[0].store.stored_pages() > 0;
        if only_parity && !held_scan {
            held_scan = true;
            for s in 0..5 {
                p.transport_mut().servers[s].held = true;
            }
            let before = p.counters().parity_groups_leaving;
            p.migrate(64).unwrap();
            assert_eq!(p.counters().servers_dead, 0, "nothing waited for the scan");
            assert_eq!(p.counters().parity_groups_leaving, before, "no answer yet");
            assert!(p.migration_due(), "the answer is still to be taken");
            for s in 0..5 {
                p.transport_mut().servers[s].held = false;
            }
            continue;
        }
        p.migrate(64).unwrap();
        p.flush().unwrap();
        p.probe_servers().unwrap();
    }
    assert!(held_scan, "server 0 came to hold only groups' parity");
    assert!(!p.migration_due(), "the migration ends");
    p.check_invariants().unwrap();
    assert_eq!(p.counters().servers_dead, 0);
    assert!(p.counters().parity_groups_leaving > 0);
    assert_eq!(
        p.transport().servers[0].store.stored_pages(),
        0,
        "no group's parity is left on server 0"
    );
    for page in 0..24 {
        assert_eq!(read(&mut p, page).unwrap(), content(page, 1), "page {page}");
    }
    parity_consistent(&p);
}

/// A move through the owner never waits either, under any scheme (issue 38): a migration step
/// sends its reads and returns, its replies held back; once they are in, later steps move the
/// pages, a page written while its read was out keeps its new version, and nothing of ours is
/// left on the leaving server (groups' parity included). (A step that waited would time out
/// on the held replies and declare the servers dead.)
#[test]
fn a_migration_step_through_the_owner_does_not_wait_for_its_reads() {
    for scheme in ["mirror:2", "rs:2+2", "parity:2"] {
        a_migration_step_does_not_wait(scheme);
    }
}

fn a_migration_step_does_not_wait(scheme: &str) {
    let mut p = Pager::new(
        PagerConfig {
            pages: 24,
            cache_pages: 0,
            redundancy: scheme.parse().unwrap(),
            ..sealed()
        },
        MemCluster::new(&[100, 100, 100, 100, 100]),
        MemDisk::default(),
    );
    p.set_direct_migration(false);
    for page in 0..24 {
        p.write(page, &content(page, 1)).unwrap();
    }
    p.flush().unwrap();
    let on_0: Vec<u64> = (0..24).filter(|&pg| p.holders(pg).contains(&0)).collect();
    assert!(on_0.len() > 1, "{scheme}: {on_0:?}");
    // Server 0's machine wants its memory back: its next replies say how many of ours leave.
    p.transport_mut().servers[0].store.set_offer(0);
    p.probe_servers().unwrap();
    assert!(p.migration_due());
    for s in 0..5 {
        p.transport_mut().servers[s].held = true;
    }
    let step = p.migrate(64).unwrap();
    assert_eq!(step.started, 0, "{scheme}: no read is in yet");
    assert_eq!(
        p.counters().servers_dead,
        0,
        "{scheme}: nothing waited for the held replies"
    );
    for s in 0..5 {
        p.transport_mut().servers[s].held = false;
    }
    let written = on_0[0];
    p.write(written, &content(written, 2)).unwrap();
    for _ in 0..100 {
        if !p.migration_due() {
            break;
        }
        p.migrate(64).unwrap();
        p.flush().unwrap();
        p.probe_servers().unwrap();
    }
    assert!(!p.migration_due(), "{scheme}: the migration ends");
    p.check_invariants().unwrap();
    assert_eq!(p.counters().servers_dead, 0);
    assert_eq!(
        p.transport().servers[0].store.stored_pages(),
        0,
        "{scheme}: nothing of ours is left on server 0"
    );
    for page in 0..24 {
        assert!(
            !p.holders(page).contains(&0),
            "{scheme}: page {page} left server 0"
        );
        if scheme.starts_with("mirror") {
            assert_eq!(p.holders(page).len(), 2, "page {page}");
        }
        let round = if page == written { 2 } else { 1 };
        assert_eq!(
            read(&mut p, page).unwrap(),
            content(page, round),
            "{scheme}: page {page}"
        );
    }
}

/// Reed-Solomon recovery does not wait either: a step sends its piece reads and returns, the
/// stripes stay under way until a later step takes the replies in; a degraded read of one of
/// those stripes meanwhile decodes from its own reads (never recovery's), and after recovery
/// every page reads back.
#[test]
fn a_reed_solomon_recovery_step_does_not_wait_for_its_reads() {
    let mut p = rs_pager(5, 24, "rs:2+2");
    for page in 0..24 {
        p.write(page, &content(page, 1)).unwrap();
    }
    p.flush().unwrap();
    let on_dead: Vec<u64> = (0..24).filter(|&pg| p.holders(pg).contains(&4)).collect();
    assert!(!on_dead.is_empty(), "some data piece is on server 4");
    p.transport_mut().servers[4].dead = true;
    p.on_failure(4, TransportError::Disconnected("killed".into()));
    let degraded = p.degraded_pages();
    assert!(degraded > 0);
    for s in 0..4 {
        p.transport_mut().servers[s].held = true;
    }
    let step = p.recover(64).unwrap();
    assert_eq!(step.started, 0, "no read is in yet");
    assert_eq!(step.remaining, degraded, "every stripe is under way");
    assert_eq!(
        p.counters().servers_dead,
        1,
        "nothing waited for the held replies"
    );
    for s in 0..4 {
        p.transport_mut().servers[s].held = false;
    }
    // A degraded read while recovery's reads of its stripe are out.
    let page = on_dead[0];
    assert_eq!(read(&mut p, page).unwrap(), content(page, 1), "page {page}");
    p.check_invariants().unwrap();
    recover_all(&mut p);
    p.flush().unwrap();
    p.check_invariants().unwrap();
    assert_eq!(p.counters().servers_dead, 1);
    assert_eq!(p.degraded_pages(), 0);
    for page in 0..24 {
        assert!(!p.holders(page).contains(&4), "page {page}");
        assert_eq!(read(&mut p, page).unwrap(), content(page, 1), "page {page}");
    }
}

/// Parity recovery never waits either (issue 38): a step sends its scans and returns, its
/// replies held back; the program writes while recovery's phases are out, and recovery
/// still ends with every page protected and read back at its last version, every group
/// consistent.
#[test]
fn a_parity_recovery_step_sends_its_scans_and_does_not_wait_for_them() {
    let mut p = parity_pager(6, 24, 0);
    for page in 0..24 {
        p.write(page, &content(page, 1)).unwrap();
    }
    p.flush().unwrap();
    let on_dead: Vec<u64> = (0..24).filter(|&pg| p.holders(pg).contains(&5)).collect();
    assert!(!on_dead.is_empty());
    p.transport_mut().servers[5].dead = true;
    p.on_failure(5, TransportError::Disconnected("killed".into()));
    for s in 0..5 {
        p.transport_mut().servers[s].held = true;
    }
    for _ in 0..3 {
        let step = p.recover(64).unwrap();
        assert_eq!(step.started, 0, "no answer is in yet");
        assert!(step.remaining > 0);
    }
    assert_eq!(
        p.counters().servers_dead,
        1,
        "nothing waited for the held replies"
    );
    p.check_invariants().unwrap();
    for s in 0..5 {
        p.transport_mut().servers[s].held = false;
    }
    // Written while recovery is under way: a page on the dead server and one elsewhere.
    let elsewhere = (0..24).find(|pg| !on_dead.contains(pg)).unwrap();
    let written = [on_dead[0], elsewhere];
    for (i, &page) in written.iter().enumerate() {
        p.write(page, &content(page, 2)).unwrap();
        p.recover(64).unwrap();
        p.check_invariants().unwrap();
        if i == 0 {
            p.flush().unwrap();
        }
    }
    recover_all(&mut p);
    p.flush().unwrap();
    p.check_invariants().unwrap();
    assert_eq!(p.counters().servers_dead, 1);
    assert_eq!(p.degraded_pages(), 0);
    for page in 0..24 {
        assert!(!p.holders(page).contains(&5), "page {page}");
        let round = if written.contains(&page) { 2 } else { 1 };
        assert_eq!(
            read(&mut p, page).unwrap(),
            content(page, round),
            "page {page}"
        );
    }
    parity_consistent(&p);
}

fn recover_all(p: &mut Pager<MemCluster, MemDisk>) {
    for _ in 0..100 {
        if p.recover(64).unwrap().remaining == 0 && p.degraded_pages() == 0 {
            return;
        }
    }
    panic!("recovery did not finish");
}

#[test]
fn parity_groups_ship_to_holders_and_pages_read_back() {
    let mut p = parity_pager(5, 40, 0);
    let pages: Vec<u64> = (0..12).collect();
    let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 1)).collect();
    p.write_many(&pages, &data).unwrap();
    let stores = &p.transport().servers;
    let groups: usize = stores.iter().map(|s| s.store.held_groups().len()).sum();
    let stored: u64 = stores.iter().map(|s| s.store.stored_pages()).sum();
    assert_eq!(p.counters().parity_groups_shipped, groups as u64);
    assert!(groups >= 3, "{groups} groups for 12 pages of parity:4");
    assert_eq!(stored, 12 + groups as u64, "one parity page per group");
    for (_, _, members, _) in stores.iter().flat_map(|s| s.store.held_groups()) {
        let servers: std::collections::HashSet<_> = members.iter().map(|m| m.server).collect();
        assert_eq!(servers.len(), members.len(), "no two members on one server");
    }
    for page in 0..12 {
        assert_eq!(read(&mut p, page).unwrap(), content(page, 1));
    }
    parity_consistent(&p);
}

/// Found by the `pager_replies` fuzz target: a server that sends every page back with a bad
/// checksum made a page under parity "corrupt, no other copy" while its group could rebuild it.
#[test]
fn a_server_that_corrupts_every_page_is_declared_dead_and_its_pages_rebuilt_from_parity() {
    let mut p = parity_pager(5, 40, 0);
    for page in 0..30 {
        p.write(page, &content(page, 3)).unwrap();
    }
    let victim = (0..30).find(|&pg| p.holders(pg) == vec![1]).unwrap();
    p.transport_mut().servers[1].corrupt_always = true;
    assert_eq!(read(&mut p, victim).unwrap(), content(victim, 3));
    assert!(p.counters().page_auth_failures >= 1);
    assert_eq!(
        p.counters().servers_dead,
        1,
        "the lying server is declared dead"
    );
    recover_all(&mut p);
    for page in 0..30 {
        assert_eq!(read(&mut p, page).unwrap(), content(page, 3), "page {page}");
    }
    assert_eq!(p.counters().pages_unrecoverable, 0);
    parity_consistent(&p);
}

#[test]
fn a_dead_servers_pages_come_back_from_parity_on_read_and_by_recovery() {
    let mut p = parity_pager(5, 40, 0);
    for page in 0..30 {
        p.write(page, &content(page, 1)).unwrap();
    }
    // Overwrites in place send deltas to the holders.
    for page in 0..10 {
        p.write(page, &content(page, 2)).unwrap();
    }
    let deltas: u64 = p
        .transport()
        .servers
        .iter()
        .map(|s| s.store.counters().parity_deltas_applied)
        .sum();
    assert!(deltas >= 10, "{deltas} deltas");
    let on_2 = p.pages_per_server()[2];
    assert!(on_2 > 0);
    p.transport_mut().servers[2].dead = true;
    // A degraded read rebuilds its page at once.
    let victim = (0..30).find(|&pg| p.holders(pg) == vec![2]).unwrap();
    let want = if victim < 10 { 2 } else { 1 };
    assert_eq!(read(&mut p, victim).unwrap(), content(victim, want));
    recover_all(&mut p);
    assert_eq!(p.pages_per_server()[2], 0);
    assert!(p.counters().parity_members_rebuilt >= on_2);
    assert_eq!(p.counters().pages_unrecoverable, 0);
    for page in 0..30 {
        let want = if page < 10 { 2 } else { 1 };
        assert_eq!(
            read(&mut p, page).unwrap(),
            content(page, want),
            "page {page}"
        );
    }
    // Protected again: a second failure loses nothing either.
    let next = (0..5)
        .find(|&s| s != 2 && p.pages_per_server()[s] > 0)
        .unwrap();
    p.transport_mut().servers[next].dead = true;
    recover_all(&mut p);
    for page in 0..30 {
        let want = if page < 10 { 2 } else { 1 };
        assert_eq!(
            read(&mut p, page).unwrap(),
            content(page, want),
            "page {page}"
        );
    }
    assert_eq!(p.counters().pages_unrecoverable, 0);
    parity_consistent(&p);
}

fn rs_pager(servers: usize, pages: u64, scheme: &str) -> Pager<MemCluster, MemDisk> {
    Pager::new(
        PagerConfig {
            pages,
            cache_pages: 0,
            writeback_batch: 4,
            redundancy: scheme.parse().unwrap(),
            ..sealed()
        },
        MemCluster::new(&vec![256; servers]),
        MemDisk::default(),
    )
}

fn reads_back(p: &mut Pager<MemCluster, MemDisk>, pages: u64, round: u8) {
    for page in 0..pages {
        assert_eq!(read(p, page).unwrap(), content(page, round), "page {page}");
    }
}

#[test]
fn the_codes_in_use_have_the_xor_check_and_others_are_told_apart() {
    // `rs:3+2`, `rs:4+2` and `rs:8+4` take the XOR path for one lost piece ...
    assert!(stripe::xor_code(3, 2) && stripe::xor_code(4, 2) && stripe::xor_code(8, 4));
    // ... a one-page stripe of M = 2, or M = 3, go through the decoder.
    assert!(!stripe::xor_code(1, 2));
    assert!(!stripe::xor_code(4, 3));
}

#[test]
fn one_lost_piece_comes_back_by_xor_and_two_by_the_decoder() {
    let mut p = rs_pager(7, 64, "rs:4+2");
    let pages: Vec<u64> = (0..64).collect();
    let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 1)).collect();
    p.write_many(&pages, &data).unwrap();
    p.flush().unwrap();
    p.transport_mut().servers[0].dead = true;
    reads_back(&mut p, 64, 1);
    let c = p.counters().clone();
    assert!(c.degraded_reads > 0, "server 0 held data pieces");
    assert_eq!(c.pieces_restored_by_xor, c.degraded_reads);
    assert_eq!(c.decoder_runs, 0);
    recover_all(&mut p);
    assert!(p.counters().pieces_restored_by_xor > c.pieces_restored_by_xor);
    assert_eq!(p.counters().decoder_runs, 0);
    assert_eq!(p.pages_per_server()[0], 0);
    reads_back(&mut p, 64, 1);
    // Two more die: within the scheme's tolerance, but one lost piece is no longer the rule.
    p.transport_mut().servers[1].dead = true;
    p.transport_mut().servers[2].dead = true;
    reads_back(&mut p, 64, 1);
    assert!(p.counters().decoder_runs > 0);
    recover_all(&mut p);
    reads_back(&mut p, 64, 1);
    assert_eq!(p.counters().pages_unrecoverable, 0);
}

/// Two servers die; the first comes back and recovery sends it the pieces (or copies) it
/// can, with none yet for the second; the second comes back while those are out. The rebuild
/// ends short after the revival that would have retried it, and must still finish (it once
/// waited for a revival that never came: a Reed-Solomon test's flake).
#[test]
fn a_server_revived_while_a_rebuild_is_out_gets_its_copies() {
    for (scheme, servers) in [("rs:2+2", 4), ("mirror:3", 3)] {
        let mut p = rs_pager(servers, 32, scheme);
        let pages: Vec<u64> = (0..32).collect();
        let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 1)).collect();
        p.write_many(&pages, &data).unwrap();
        p.flush().unwrap();
        let (a, b) = (servers - 2, servers - 1);
        for s in [a, b] {
            p.transport_mut().servers[s].dead = true;
            p.on_failure(s, TransportError::Disconnected("killed".into()));
        }
        recover_all(&mut p);
        assert!(p.pages_short_of_copies() > 0, "{scheme}: short of servers");
        p.transport_mut().servers[a].dead = false;
        assert_eq!(p.revive_dead_servers(), 1);
        // A step sends its reads; the one after them (they are answered) writes.
        let mut started = 0;
        for _ in 0..2 {
            started = p.recover(64).unwrap().started;
            if started > 0 {
                break;
            }
        }
        assert!(started > 0, "{scheme}: a rebuild is out");
        assert!(
            !p.transport().servers[a].replies.is_empty(),
            "{scheme}: its writes await their answers"
        );
        p.transport_mut().servers[b].dead = false;
        assert_eq!(p.revive_dead_servers(), 1);
        // The answers to the rebuild's writes arrive; recovery then goes on.
        while p.poll().unwrap() > 0 {}
        recover_all(&mut p);
        p.flush().unwrap();
        p.check_invariants().unwrap();
        assert_eq!(p.pages_short_of_copies(), 0, "{scheme}");
        let held = |p: &Pager<MemCluster, MemDisk>, s: usize| {
            let store = &p.transport().servers[s].store;
            store.capacity_pages() - store.free_pages()
        };
        assert!(
            held(&p, b) > 0,
            "{scheme}: the second revived server holds again"
        );
        reads_back(&mut p, 32, 1);
    }
}

mod migrate;
mod seal;
mod ticket;

/// `try_write_many` (the NBD device's write) never waits: with every reply held back, it takes
/// pages into the cache while it has slots, deferring the evictions that would wait (the
/// cache over its budget, which `check_invariants` allows for), and stops, having written a
/// prefix; rewriting pages in the cache or in write-back takes no slot; once replies come in,
/// the rest goes, and every page reads back at its last write. Under every scheme.
#[test]
fn try_write_many_takes_what_it_has_room_for_and_never_waits() {
    for scheme in ["none", "mirror:2", "rs:2+2", "parity:2"] {
        let mut p = Pager::new(
            PagerConfig {
                pages: 800,
                cache_pages: 16,
                redundancy: scheme.parse().unwrap(),
                ..sealed()
            },
            MemCluster::new(&[2000, 2000, 2000, 2000, 2000]),
            MemDisk::default(),
        );
        for s in 0..5 {
            p.transport_mut().servers[s].held = true;
        }
        let pages: Vec<u64> = (0..800).collect();
        let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 1)).collect();
        let mut done = p.try_write_many(&pages, &data).unwrap();
        p.check_invariants().unwrap();
        assert_eq!(p.counters().servers_dead, 0, "{scheme}: nothing waited");
        assert!(
            done > 16,
            "{scheme}: more than the cache was taken ({done})"
        );
        assert!(
            done < 800,
            "{scheme}: the pager ran out of slots {:?}",
            p.counters()
        );
        // Again at once: nothing has come back, so nothing more is taken.
        let again = p.try_write_many(&pages[done..], &data[done * PAGE_SIZE..]);
        assert_eq!(again.unwrap(), 0, "{scheme}: no slot came back");
        // A page written already is rewritten in place (or next to its write-back).
        let first = [pages[done - 1]];
        let rewritten = p.try_write_many(&first, &content(first[0], 1)).unwrap();
        assert_eq!(rewritten, 1, "{scheme}: a cached page needs no slot");
        for s in 0..5 {
            p.transport_mut().servers[s].held = false;
        }
        let mut rounds = 0;
        while done < pages.len() {
            rounds += 1;
            assert!(rounds < 1000, "{scheme}: the rest never went");
            p.poll().unwrap();
            done += p
                .try_write_many(&pages[done..], &data[done * PAGE_SIZE..])
                .unwrap();
            p.check_invariants().unwrap();
        }
        p.flush().unwrap();
        p.check_invariants().unwrap();
        assert_eq!(p.counters().servers_dead, 0, "{scheme}");
        for page in 0..800u64 {
            assert_eq!(
                read(&mut p, page).unwrap(),
                content(page, 1),
                "{scheme}: page {page}"
            );
        }
    }
}

/// `try_flush` (the NBD device's FLUSH, which lets the device go while it waits) never
/// waits: with every reply held back (a wait would time out on them and fail the servers) it
/// writes back what it has room for and says it is not done; once replies come in it
/// finishes. Every page dirty at its start then has its copies or pieces on the servers (its
/// stripe sealed, its group shipped), a `flush` after it sends nothing, and every page reads
/// back. Under every scheme.
#[test]
fn try_flush_writes_back_without_waiting() {
    for scheme in ["none", "mirror:2", "rs:2+2", "parity:2"] {
        let mut p = Pager::new(
            PagerConfig {
                pages: 800,
                cache_pages: 64,
                redundancy: scheme.parse().unwrap(),
                ..sealed()
            },
            MemCluster::new(&[2000, 2000, 2000, 2000, 2000]),
            MemDisk::default(),
        );
        // Odd: one stripe of rs:2+2 is left open for the flush to seal.
        let pages: Vec<u64> = (0..47).collect();
        let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 1)).collect();
        p.write_many(&pages, &data).unwrap();
        for s in 0..5 {
            p.transport_mut().servers[s].held = true;
        }
        let mut flush = p.start_flush();
        assert_eq!(flush.pages_left(), 47, "{scheme}: every page is dirty");
        for _ in 0..3 {
            assert!(
                !p.try_flush(&mut flush).unwrap(),
                "{scheme}: nothing came back"
            );
        }
        p.check_invariants().unwrap();
        assert_eq!(p.counters().servers_dead, 0, "{scheme}: nothing waited");
        assert!(
            flush.pages_left() < 47,
            "{scheme}: nothing was written back"
        );
        for s in 0..5 {
            p.transport_mut().servers[s].held = false;
        }
        let mut rounds = 0;
        while !p.try_flush(&mut flush).unwrap() {
            rounds += 1;
            assert!(rounds < 1000, "{scheme}: the flush never finished");
            p.poll().unwrap();
            p.check_invariants().unwrap();
        }
        assert_eq!(flush.pages_left(), 0, "{scheme}");
        assert_eq!(
            p.start_flush().pages_left(),
            0,
            "{scheme}: nothing is dirty"
        );
        // Done means stored: every page's copies or pieces are on the servers (its stripe
        // sealed, its group shipped), nothing left for `flush` to do.
        for &page in &pages {
            let (pieces, wanted) = p.pieces(page).expect("not in write-back");
            assert!(
                !pieces.is_empty() && pieces.len() >= wanted,
                "{scheme}: page {page} has {pieces:?}, wants {wanted}"
            );
        }
        let sent = p.counters().puts;
        p.flush().unwrap();
        p.check_invariants().unwrap();
        assert_eq!(p.counters().puts, sent, "{scheme}: flush found more to do");
        for &page in &pages {
            assert_eq!(
                read(&mut p, page).unwrap(),
                content(page, 1),
                "{scheme}: page {page}"
            );
        }
    }
}

/// `start_flush_of` (a write with FUA) writes back the pages it names that are dirty, seals
/// what holds them, and leaves the rest of the cache dirty. Under every scheme.
#[test]
fn a_flush_of_some_pages_leaves_the_others_dirty() {
    for scheme in ["none", "mirror:2", "rs:2+2", "parity:2"] {
        let mut p = Pager::new(
            PagerConfig {
                pages: 800,
                cache_pages: 64,
                redundancy: scheme.parse().unwrap(),
                ..sealed()
            },
            MemCluster::new(&[2000, 2000, 2000, 2000, 2000]),
            MemDisk::default(),
        );
        let pages: Vec<u64> = (0..20).collect();
        let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 1)).collect();
        p.write_many(&pages, &data).unwrap();
        // Page 3 twice, page 99 never written: neither counts twice or at all.
        let mut flush = p.start_flush_of(&[3, 5, 3, 99]);
        assert_eq!(flush.pages_left(), 2, "{scheme}");
        let mut rounds = 0;
        while !p.try_flush(&mut flush).unwrap() {
            rounds += 1;
            assert!(rounds < 1000, "{scheme}: the flush never finished");
            p.poll().unwrap();
        }
        p.check_invariants().unwrap();
        for page in [3, 5] {
            let (pieces, wanted) = p.pieces(page).expect("not in write-back");
            assert!(
                !pieces.is_empty() && pieces.len() >= wanted,
                "{scheme}: page {page} has {pieces:?}, wants {wanted}"
            );
        }
        assert_eq!(
            p.start_flush().pages_left(),
            18,
            "{scheme}: the others are dirty"
        );
        p.flush().unwrap();
        for &page in &pages {
            assert_eq!(
                read(&mut p, page).unwrap(),
                content(page, 1),
                "{scheme}: {page}"
            );
        }
    }
}

/// A flush is not a use: it leaves the cache's recency order as it was, so the pages it
/// wrote back are evicted next in the order they were used, not in the order it met them
/// (it met them newest first, and once made the newest page the next to go: a CI failure
/// of the NBD test of a stalled read, whose cached page had been evicted).
#[test]
fn a_flush_leaves_the_order_of_eviction_alone() {
    for waiting in [false, true] {
        let mut p = Pager::new(
            PagerConfig {
                pages: 800,
                cache_pages: 64,
                ..sealed()
            },
            MemCluster::new(&[2000, 2000]),
            MemDisk::default(),
        );
        let pages: Vec<u64> = (0..40).collect();
        let data: Vec<u8> = pages.iter().flat_map(|&pg| content(pg, 1)).collect();
        p.write_many(&pages, &data).unwrap();
        let order = |p: &Pager<MemCluster, MemDisk>| -> Vec<u64> {
            p.cache.iter().map(|(&page, _)| page).collect()
        };
        let before = order(&p);
        if waiting {
            p.flush().unwrap();
        } else {
            let mut flush = p.start_flush();
            let mut rounds = 0;
            while !p.try_flush(&mut flush).unwrap() {
                rounds += 1;
                assert!(rounds < 1000, "the flush never finished");
                p.poll().unwrap();
            }
        }
        assert_eq!(p.start_flush().pages_left(), 0, "nothing is dirty");
        assert_eq!(order(&p), before, "waiting: {waiting}");
    }
}

/// `try_write` (the userfaultfd handler's eviction) never waits: with every reply held back
/// (a wait would time out on them and fail the servers), it takes pages while it has room,
/// then refuses without changing anything, as it does for a page whose last write-back is
/// still out; once replies are in, the refused pages go too, and every page reads back at its
/// last write. Under every scheme.
#[test]
fn try_write_takes_what_it_has_room_for_and_never_waits() {
    for scheme in ["none", "mirror:2", "rs:2+2", "parity:2"] {
        let mut p = Pager::new(
            PagerConfig {
                pages: 800,
                cache_pages: 8,
                redundancy: scheme.parse().unwrap(),
                ..sealed()
            },
            MemCluster::new(&[2000, 2000, 2000, 2000, 2000]),
            MemDisk::default(),
        );
        for s in 0..5 {
            p.transport_mut().servers[s].held = true;
        }
        let mut taken = Vec::new();
        let mut refused = Vec::new();
        for page in 0..800u64 {
            let room = p.write_room();
            if p.try_write(page, &content(page, 1)).unwrap() {
                assert!(room > 0, "{scheme}: page {page} taken without room");
                taken.push(page);
                p.send_queued();
            } else {
                refused.push(page);
            }
            if page % 64 == 0 {
                p.check_invariants().unwrap();
            }
        }
        p.check_invariants().unwrap();
        assert_eq!(p.counters().servers_dead, 0, "{scheme}: nothing waited");
        assert!(!taken.is_empty(), "{scheme}: pages were taken");
        assert!(!refused.is_empty(), "{scheme}: the pager ran out of room");
        assert_eq!(p.write_room(), 0, "{scheme}: refused for want of room");
        for s in 0..5 {
            p.transport_mut().servers[s].held = false;
        }
        // A page still in write-back is refused whatever the room (none of its replies has
        // been read yet).
        assert!(
            !p.try_write(taken[0], &content(taken[0], 2)).unwrap(),
            "{scheme}: a page in write-back is refused"
        );
        let mut rounds = 0;
        while !refused.is_empty() {
            rounds += 1;
            assert!(rounds < 1000, "{scheme}: the refused pages never went");
            p.poll().unwrap();
            refused.retain(|&page| !p.try_write(page, &content(page, 1)).unwrap());
            p.send_queued();
            p.check_invariants().unwrap();
        }
        p.flush().unwrap();
        assert_eq!(p.counters().servers_dead, 0, "{scheme}");
        for page in 0..800u64 {
            assert_eq!(
                read(&mut p, page).unwrap(),
                content(page, 1),
                "{scheme}: page {page}"
            );
        }
    }
}
