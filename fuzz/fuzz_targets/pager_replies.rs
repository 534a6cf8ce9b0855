//! A pager whose first server lies: the pager's handling of replies (`netram_pager`'s
//! `receive`, `Inbox::accept`, `after_reply`, recovery, and replies pushed through
//! `Pager::on_reply` as a runtime that owns the sockets would) against a server that flips
//! bits, cuts frames short, answers with another request's id, replays old answers as new
//! ones, answers twice, late, or not at all. The other servers are honest `netram-store`
//! stores spoken to through real frames, and carry parity deltas to each other as daemons do.
//!
//! What must hold: nothing panics (debug assertions included), every read that succeeds returns
//! exactly what was last written (zeros for pages never written or discarded), a read by
//! ticket returns the page as it was when it started or anything written over it before it
//! finished, and under a redundancy scheme one liar never costs a page: reads still succeed. A lie is seen as a
//! checksum, version or protocol error, counted, and the liar is declared dead.
//!
//! Half the runs compress pages before they are sealed (`PagerConfig::compress`).
//!
//! The lies keep the honest server's bytes under the page checksum: one bit flipped, never a
//! value chosen, so they never forge a page with a matching checksum. That forgery is what
//! authentication (MACs on pages) is for, not the reply handler.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use netram_pager::{MemDisk, Pager, PagerConfig, Scheme, ServerInfo, Transport, TransportError};
use netram_proto::{decode_reply, decode_request, DeltaStatus, Reply, Request, PAGE_SIZE};
use netram_store::serve::{self, DeltaOutcome};
use netram_store::{SessionHandle, Store, StoreConfig};
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;

const SERVERS: usize = 4;
const PAGES: u64 = 64;

#[derive(Arbitrary, Debug)]
struct Input {
    scheme: u8,
    cache: u8,
    /// Frames per server (few: servers fill, the pager places pages again and spills).
    capacity: u8,
    lies: Vec<Lie>,
    acts: Vec<Act>,
}

/// What the liar does to its next reply.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Lie {
    Honest,
    /// One bit flipped, anywhere in the frame.
    FlipBit(u32),
    /// The frame cut short.
    Truncate(u16),
    /// The reply carries another request's id: `n` requests later.
    ShiftId(u8),
    /// An earlier reply of this server of the same kind (the `n`th last), answering this
    /// request: an old page for a GET, an old "stored" for a PUT.
    ReplayAs(u8),
    /// No reply.
    Drop,
    /// The reply twice.
    Twice,
    /// Held back and delivered after the next one.
    Late,
}

#[derive(Arbitrary, Debug)]
enum Act {
    Write {
        page: u8,
        round: u8,
    },
    WriteMany {
        first: u8,
        n: u8,
        round: u8,
    },
    Read {
        page: u8,
    },
    ReadMany {
        first: u8,
        n: u8,
    },
    Discard {
        page: u8,
    },
    Flush,
    Recover,
    /// Server `server` offers `frames` (its machine wants memory back: pages above the offer
    /// must leave), and the pager takes a migration step: server to server (EXPECT, MIGRATE,
    /// ADOPT) under `none` and `mirror:2`, through the pager otherwise.
    Shrink {
        server: u8,
        frames: u8,
    },
    Migrate,
    // Every reply waiting, pushed to the pager one at a time (`on_reply`; `on_failure` for a
    // frame that does not decode), as a runtime delivers them while the program is idle.
    Push,
    /// A read by ticket started (`Pager::start_read`), left in flight across what follows, as
    /// the userfaultfd handler's fetches are.
    Start {
        page: u8,
    },
    /// The finished reads by ticket taken and checked.
    Take,
    /// A step of a flush that never waits (`Pager::try_flush`, the NBD device's FLUSH), the
    /// flush left in progress across what follows until it says it is done.
    TryFlush,
    /// The same for some pages only (`Pager::start_flush_of`, a write with FUA), if no flush
    /// is in progress; else a step of that one.
    TryFlushOf {
        first: u8,
        n: u8,
    },
}

struct Server {
    store: Store<Vec<u8>>,
    session: SessionHandle,
    replies: VecDeque<Vec<u8>>,
}

struct Cluster {
    servers: Vec<Server>,
    lies: Vec<Lie>,
    told: usize,
    /// The liar's earlier replies, newest last.
    history: VecDeque<Vec<u8>>,
    late: Option<Vec<u8>>,
    last: Vec<u8>,
}

fn addr(i: usize) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, i as u8 + 1], 7077))
}

impl Cluster {
    /// Server `i` runs the frame through its own request logic, parity deltas going to their
    /// holders at once.
    fn serve(&mut self, i: usize, frame: &[u8]) -> Vec<u8> {
        let (id, req) = decode_request(frame).expect("the pager sends valid frames");
        let mut out = Vec::new();
        let s = &mut self.servers[i];
        let o = serve::handle_request(&mut s.store, s.session, id, req, 0, 0, &mut out, |_| vec![]);
        if let serve::Outcome::Forward(fwd) = o {
            let outcomes: Vec<DeltaOutcome> = fwd
                .deltas
                .iter()
                .map(|(to, d)| match (0..SERVERS).find(|&h| addr(h) == to.addr) {
                    Some(h) => match self.servers[h].store.apply_delta(
                        &d.as_delta(),
                        netram_store::DeltaFrom::Peer(netram_store::Peer::Server(i as u64 + 1)),
                    ) {
                        DeltaStatus::Applied => DeltaOutcome::Applied,
                        _ => DeltaOutcome::UnknownGroup,
                    },
                    None => DeltaOutcome::Unreachable,
                })
                .collect();
            let s = &mut self.servers[i];
            serve::finish_forward(&mut s.store, s.session, fwd, &outcomes, 0, 0, &mut out);
        } else if let serve::Outcome::Handover(ho) = o {
            // Handed over at once, as from server `i` over TLS.
            let by = netram_store::Peer::Server(i as u64 + 1);
            let status: Vec<netram_proto::MoveStatus> =
                match (0..SERVERS).find(|&t| addr(t) == ho.to.addr) {
                    Some(t) => {
                        let store = &mut self.servers[t].store;
                        ho.pages
                            .iter()
                            .map(|p| store.adopt(by, ho.owner, &p.as_page(), 0))
                            .collect()
                    }
                    None => Vec::new(),
                };
            let s = &mut self.servers[i];
            serve::finish_handover(&mut s.store, s.session, ho, &status, 0, &mut out);
        }
        out
    }

    /// The liar's reply to request `id`, as it reaches the pager.
    fn lie(&mut self, id: u64, honest: Vec<u8>) {
        let lie = self.lies.get(self.told).copied().unwrap_or(Lie::Honest);
        self.told += 1;
        let q = &mut self.servers[0].replies;
        match lie {
            Lie::Honest => q.push_back(honest.clone()),
            Lie::FlipBit(at) => {
                let mut r = honest.clone();
                let bit = at as usize % (r.len() * 8);
                r[bit / 8] ^= 1 << (bit % 8);
                q.push_back(r);
            }
            Lie::Truncate(n) => {
                let mut r = honest.clone();
                r.truncate(usize::from(n) % r.len());
                q.push_back(r);
            }
            Lie::ShiftId(n) => {
                let mut r = honest.clone();
                r[8..16].copy_from_slice(&(id + 1 + u64::from(n)).to_le_bytes());
                q.push_back(r);
            }
            Lie::ReplayAs(n) => match self
                .history
                .iter()
                .rev()
                .filter(|old| old[5] == honest[5])
                .nth(usize::from(n) % 16)
            {
                Some(old) => {
                    let mut r = old.clone();
                    r[8..16].copy_from_slice(&id.to_le_bytes());
                    q.push_back(r);
                }
                None => q.push_back(honest.clone()),
            },
            Lie::Drop => {}
            Lie::Twice => {
                q.push_back(honest.clone());
                q.push_back(honest.clone());
            }
            Lie::Late => {
                if let Some(held) = self.late.replace(honest.clone()) {
                    q.push_back(held);
                }
            }
        }
        if !matches!(lie, Lie::Late) {
            if let Some(held) = self.late.take() {
                q.push_back(held);
            }
        }
        self.history.push_back(honest);
        if self.history.len() > 64 {
            self.history.pop_front();
        }
    }
}

impl Transport for Cluster {
    fn servers(&self) -> Vec<ServerInfo> {
        (0..SERVERS)
            .map(|i| ServerInfo {
                name: format!("mem{i}"),
                addr: Some(addr(i)),
                node: i as u64 + 1,
                window: 8,
                capacity_pages: self.servers[i].store.capacity_pages(),
                free_pages: self.servers[i].store.free_pages(),
                connected: Ok(()),
            })
            .collect()
    }

    fn send(&mut self, server: usize, id: u64, req: &Request<'_>) -> Result<(), TransportError> {
        let mut frame = Vec::new();
        req.encode(id, &mut frame);
        let reply = self.serve(server, &frame);
        if reply.is_empty() {
            return Ok(());
        }
        if server == 0 {
            self.lie(id, reply);
        } else {
            self.servers[server].replies.push_back(reply);
        }
        Ok(())
    }

    fn recv(&mut self, server: usize) -> Result<(u64, Reply<'_>), TransportError> {
        self.last = self.servers[server]
            .replies
            .pop_front()
            .ok_or(TransportError::Timeout(0))?;
        decode_reply(&self.last).map_err(|e| TransportError::Protocol(e.to_string()))
    }
}

fn content(page: u64, round: u8) -> Vec<u8> {
    (0..PAGE_SIZE)
        .map(|i| (page as u8) ^ (i as u8).wrapping_mul(31) ^ round)
        .collect()
}

fuzz_target!(|input: Input| {
    let scheme: Scheme = match input.scheme % 5 {
        0 => "none",
        1 => "mirror:2",
        2 => "parity:2",
        3 => "parity:3",
        _ => "rs:2+1",
    }
    .parse()
    .expect("a valid scheme");
    let capacity = usize::from(input.capacity % 96) + 16;
    let servers = (0..SERVERS)
        .map(|_| {
            let mut store = Store::new(vec![0u8; capacity * PAGE_SIZE], StoreConfig::default());
            let session = store
                .open_session(1, 1, 1, 0)
                .expect("a fresh store has room");
            Server {
                store,
                session,
                replies: VecDeque::new(),
            }
        })
        .collect();
    let cluster = Cluster {
        servers,
        lies: input.lies,
        told: 0,
        history: VecDeque::new(),
        late: None,
        last: Vec::new(),
    };
    let cfg = PagerConfig {
        pages: PAGES,
        cache_pages: usize::from(input.cache % 8),
        writeback_batch: 4,
        window: 8,
        batch_max: 4,
        redundancy: scheme,
        recovery_slots: 64,
        // Half the runs compress before sealing (the pages here shrink to a few hundred
        // bytes), so the liar's bytes also reach pages that travel as sealed LZ4 blocks.
        compress: (input.cache & 0x80 != 0).then_some(netram_proto::compress::Rule {
            link_bytes_per_us: 12.5,
            codec_us: 3.0,
        }),
        ..Default::default()
    };
    let mut pager = Pager::new(cfg, cluster, MemDisk::default());
    // What each page holds, by what the program wrote; absent: zeros. A page whose write or
    // discard failed holds either its old or its new contents: it is not checked again.
    let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
    let mut unknown: HashSet<u64> = HashSet::new();
    let zeros = vec![0u8; PAGE_SIZE];
    let redundant = scheme != Scheme::None;
    let check = |pager: &mut Pager<Cluster, MemDisk>,
                 model: &HashMap<u64, Vec<u8>>,
                 unknown: &HashSet<u64>,
                 pages: &[u64]| {
        let pages: Vec<u64> = pages
            .iter()
            .copied()
            .filter(|p| !unknown.contains(p))
            .collect();
        let pages = pages.as_slice();
        let mut out = vec![0u8; pages.len() * PAGE_SIZE];
        match pager.read_many(pages, &mut out) {
            Ok(()) => {
                for (p, got) in pages.iter().zip(out.chunks(PAGE_SIZE)) {
                    let want = model.get(p).unwrap_or(&zeros);
                    assert!(got == want.as_slice(), "page {p} read back wrong");
                }
            }
            Err(e) => assert!(
                !redundant,
                "{scheme}: one lying server cost pages {pages:?}: {e}"
            ),
        }
    };
    // Reads by ticket in flight: page, what it may return, whether its page was discarded
    // (or its write failed) meanwhile, which excuses a failure.
    let mut tickets: HashMap<u64, (u64, Vec<Vec<u8>>, bool)> = HashMap::new();
    let mut next_ticket = 0u64;
    let mut flushing = None;
    let changed = |tickets: &mut HashMap<u64, (u64, Vec<Vec<u8>>, bool)>,
                   page: u64,
                   to: Option<Vec<u8>>| {
        for (p, may, excused) in tickets.values_mut() {
            if *p == page {
                match &to {
                    Some(d) => may.push(d.clone()),
                    None => {
                        may.push(vec![0u8; PAGE_SIZE]);
                        *excused = true;
                    }
                }
            }
        }
    };
    let take = |pager: &mut Pager<Cluster, MemDisk>,
                tickets: &mut HashMap<u64, (u64, Vec<Vec<u8>>, bool)>,
                unknown: &HashSet<u64>| {
        let _ = pager.take_finished(|tag, page, data| {
            let (want_page, may, excused) = tickets.remove(&tag).expect("a ticket finishes once");
            assert_eq!(page, want_page, "ticket {tag} finished for another page");
            if unknown.contains(&page) {
                return;
            }
            match data {
                Ok(d) => assert!(
                    may.iter().any(|m| m.as_slice() == d),
                    "ticket {tag}: page {page} read back what it never held"
                ),
                Err(e) => assert!(
                    !redundant || excused,
                    "{scheme}: one lying server cost a read by ticket of page {page}: {e}"
                ),
            }
        });
    };
    for act in input.acts.iter().take(64) {
        match *act {
            Act::Write { page, round } => {
                let page = u64::from(page) % PAGES;
                let data = content(page, round);
                changed(&mut tickets, page, Some(data.clone()));
                if pager.write(page, &data).is_ok() {
                    model.insert(page, data);
                } else {
                    unknown.insert(page);
                }
            }
            Act::Start { page } => {
                let page = u64::from(page) % PAGES;
                let now = model.get(&page).cloned().unwrap_or_else(|| zeros.clone());
                if pager.start_read(page, next_ticket).is_ok() {
                    tickets.insert(next_ticket, (page, vec![now], false));
                }
                next_ticket += 1;
                pager.send_queued();
            }
            Act::Take => take(&mut pager, &mut tickets, &unknown),
            Act::WriteMany { first, n, round } => {
                let mut pages: Vec<u64> = (0..u64::from(n % 16) + 1)
                    .map(|i| (u64::from(first) + i) % PAGES)
                    .collect();
                pages.sort_unstable();
                pages.dedup();
                let data: Vec<u8> = pages.iter().flat_map(|&p| content(p, round)).collect();
                for &p in &pages {
                    changed(&mut tickets, p, Some(content(p, round)));
                }
                if pager.write_many(&pages, &data).is_ok() {
                    for &p in &pages {
                        model.insert(p, content(p, round));
                    }
                } else {
                    unknown.extend(&pages);
                }
            }
            Act::Read { page } => check(&mut pager, &model, &unknown, &[u64::from(page) % PAGES]),
            Act::ReadMany { first, n } => {
                let mut pages: Vec<u64> = (0..u64::from(n % 16) + 1)
                    .map(|i| (u64::from(first) + i) % PAGES)
                    .collect();
                pages.sort_unstable();
                pages.dedup();
                check(&mut pager, &model, &unknown, &pages);
            }
            Act::Discard { page } => {
                let page = u64::from(page) % PAGES;
                changed(&mut tickets, page, None);
                if pager.discard(page).is_ok() {
                    model.remove(&page);
                } else {
                    unknown.insert(page);
                }
            }
            Act::Flush => {
                let _ = pager.flush();
            }
            Act::TryFlush | Act::TryFlushOf { .. } => {
                let flush = flushing.get_or_insert_with(|| match *act {
                    Act::TryFlushOf { first, n } => {
                        let first = u64::from(first) % PAGES;
                        let pages: Vec<u64> =
                            (first..(first + u64::from(n) % 16).min(PAGES)).collect();
                        pager.start_flush_of(&pages)
                    }
                    _ => pager.start_flush(),
                });
                if !matches!(pager.try_flush(flush), Ok(false)) {
                    flushing = None;
                }
                pager
                    .check_invariants()
                    .expect("invariants after a step of a flush");
            }
            Act::Recover => {
                let _ = pager.recover(16);
            }
            Act::Shrink { server, frames } => {
                let store = &mut pager.transport_mut().servers[usize::from(server) % SERVERS].store;
                store.set_offer(u64::from(frames) % (capacity as u64 + 1));
                store.compact(usize::MAX);
                store.take_given_back();
            }
            Act::Migrate => {
                let _ = pager.migrate(16);
            }
            Act::Push => {
                for s in 0..SERVERS {
                    while pager.in_flight(s) > 0 {
                        let Some(frame) = pager.transport_mut().servers[s].replies.pop_front()
                        else {
                            break;
                        };
                        match decode_reply(&frame) {
                            // An error it returns is the pager's to report (as for Flush).
                            Ok((id, reply)) => {
                                let _ = pager.on_reply(s, id, &reply);
                            }
                            Err(e) => pager.on_failure(s, TransportError::Protocol(e.to_string())),
                        }
                        pager
                            .check_invariants()
                            .expect("invariants after a pushed reply");
                    }
                }
            }
        }
    }
    // Every read by ticket finishes (a server that never answers times out).
    for _ in 0..64 {
        if tickets.is_empty() {
            break;
        }
        let _ = pager.wait_finished();
        take(&mut pager, &mut tickets, &unknown);
    }
    assert!(tickets.is_empty(), "{} reads by ticket never finished", tickets.len());
    pager
        .check_invariants()
        .expect("invariants once every ticket is taken");
    let all: Vec<u64> = (0..PAGES).collect();
    check(&mut pager, &model, &unknown, &all);
});
