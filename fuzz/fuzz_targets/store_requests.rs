//! Hostile clients against one page store, run the way the daemon runs them
//! (`netram_store::serve`): nothing panics, the store's invariants hold after every request,
//! and every reply is a frame a client can read — within the frame limit, decodable, for the
//! request it answers. Requests that wait for parity holders have their deltas delivered to the
//! same store (which holds groups too) or lost, as the request id decides.
//!
//! The input is a list of operations rather than raw frames, so that a short input reaches a
//! large store: thousands of pages, many sessions from several clients, parity groups of every
//! size (up to and past the member limit) and scans whose answers would overflow a frame. Raw
//! frames are one of the operations, so the decoder's paths stay in reach.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use netram_proto::gms;
use netram_proto::{
    decode_reply, decode_request, frame_len, Delta, DeltaKind, DeltaStatus, Member, MoveStatus,
    Owner, Page, PageFlags, PageKey, ParityOp, Record, Reply, Request, MAX_BATCH, MAX_FRAME_LEN,
    PAGE_SIZE,
};
use netram_store::serve::{
    finish_forward, finish_handover, handle_gms, handle_request, store_stats, DeltaOutcome,
    GmsOutcome, Outcome,
};
use netram_store::{DeltaFrom, Peer, SessionHandle, Store, StoreConfig, NO_PEER};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

#[derive(Arbitrary, Debug)]
struct Input {
    /// Frames in the arena: 1 to 4096 (16 MiB, zeroed lazily by the kernel).
    frames: u16,
    max_sessions: u8,
    max_peer_sessions: u8,
    /// Frames one client may hold; `None`: no quota.
    max_peer_pages: Option<u16>,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// A handshake from client `peer` (one of eight addresses).
    Open {
        peer: u8,
        node: u8,
        incarnation: u8,
        id: u8,
    },
    /// `n` pages from `first` on, in frames of at most `MAX_BATCH` pages.
    Put {
        s: u8,
        region: u8,
        first: u16,
        n: u16,
        version: u8,
        zero: bool,
        /// Flagged clean (`cluster+disk`): a full store may drop them for other pages.
        clean: bool,
    },
    /// The same pages under dynamic parity, each joining `group` (or the next ones).
    Join {
        s: u8,
        first: u16,
        n: u16,
        group: u16,
        per_group: u8,
        holder: u8,
        member: u8,
    },
    /// Overwrites in place under parity.
    Keep {
        s: u8,
        first: u16,
        n: u16,
        version: u8,
    },
    /// `count` parity pages shipped here, for groups `group..group + count`, each naming
    /// `members` members spread over `servers` servers.
    Ship {
        s: u8,
        group: u16,
        count: u16,
        max_members: u8,
        members: u8,
        servers: u8,
    },
    Delta {
        s: u8,
        own: bool,
        group: u16,
        member: u8,
        key: u16,
        from: u32,
        to: u32,
        kind: u8,
    },
    /// `dead`: a server's index, or `None` for "no server" (the owner's audit).
    Scan {
        s: u8,
        dead: Option<u8>,
        max: u32,
    },
    Get {
        s: u8,
        first: u16,
        n: u16,
    },
    Delete {
        s: u8,
        first: u16,
        n: u16,
    },
    Stats {
        s: u8,
    },
    Refresh {
        s: u8,
    },
    Close {
        s: u8,
    },
    /// The owner says `from` will hand over pages `first..` at `version` (EXPECT).
    Expect {
        s: u8,
        from: u8,
        first: u16,
        n: u16,
        version: u8,
    },
    /// The owner asks for pages `first..` to go to server `to` (MIGRATE); they are handed to
    /// this same store, as the request id decides, from a sender the fuzzer picks.
    Migrate {
        s: u8,
        to: u8,
        first: u16,
        n: u16,
    },
    /// Session `s` hands over pages naming session `owner`'s owner (ADOPT), as a server or a
    /// client would.
    Adopt {
        s: u8,
        owner: u8,
        first: u16,
        n: u16,
        version: u8,
    },
    /// Time passes; leases may run out.
    Advance {
        ms: u16,
    },
    /// The offer moves (`netram serve --adapt`): frames above it take no new page, their free
    /// ones are given back once, and pages above it stay readable; then up to `compact` of
    /// them move down into frames free below it (what the daemon's donor thread does), and
    /// read back as they were.
    Offer {
        frames: u16,
        compact: u8,
    },
    /// Clean pages `first..` (GMS's PUT_CACHED), some damaged.
    Cached {
        s: u8,
        first: u16,
        n: u8,
        age: u16,
        damaged: u8,
    },
    /// GET_CACHED of pages `first..`, taking them or not.
    Fetch {
        s: u8,
        first: u16,
        n: u8,
        take: bool,
    },
    /// GCD_UPDATE: shared pages `first..` registered, `gone..` given up.
    Shared {
        s: u8,
        reset: bool,
        first: u16,
        n: u8,
        gone: u16,
        m: u8,
    },
    /// Any bytes as a frame: the decoder's errors, and requests no other operation builds.
    Raw {
        s: u8,
        frame: Vec<u8>,
    },
}

fn server(i: u8) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, i % 8 + 1], 7077))
}

const NO_SERVER: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);

/// A page's contents: the key's bytes repeated, so that a wrong page is a wrong page.
fn contents(key: PageKey) -> Vec<u8> {
    let seed = key.page.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(key.region);
    seed.to_le_bytes()
        .iter()
        .copied()
        .cycle()
        .take(PAGE_SIZE)
        .collect()
}

/// Pages `first..first + n` as the keys of frames of at most `MAX_BATCH`, `n` capped so one
/// operation stays cheap.
fn batches(region: u32, first: u16, n: u16) -> impl Iterator<Item = Vec<PageKey>> {
    let n = u64::from(n % 2048) + 1;
    let keys: Vec<PageKey> = (0..n)
        .map(|i| PageKey::new(region, u64::from(first) + i))
        .collect();
    keys.chunks(MAX_BATCH)
        .map(<[PageKey]>::to_vec)
        .collect::<Vec<_>>()
        .into_iter()
}

struct Harness {
    store: Store<Vec<u8>>,
    sessions: Vec<SessionHandle>,
    now: u64,
    next_id: u64,
    frame: Vec<u8>,
    out: Vec<u8>,
}

impl Harness {
    fn session(&self, s: u8) -> Option<SessionHandle> {
        (!self.sessions.is_empty()).then(|| self.sessions[s as usize % self.sessions.len()])
    }

    /// One request, encoded and decoded as on the wire, run, its reply checked.
    fn request(&mut self, s: u8, req: &Request<'_>) {
        let id = self.next_id;
        self.next_id += 1;
        self.frame.clear();
        req.encode(id, &mut self.frame);
        let frame = std::mem::take(&mut self.frame);
        // What the decoder refuses (a group with more members than a frame may name) never
        // reaches the store; the connection would be closed.
        if let Ok((got, decoded)) = decode_request(&frame) {
            assert_eq!(got, id);
            self.run(s, id, decoded, req_limit(req));
        }
        self.frame = frame;
    }

    /// A GMS request, encoded and decoded as on the wire, run as the daemon runs it; its reply
    /// must decode, answer it, and carry one item per item asked.
    fn gms(&mut self, s: u8, req: &gms::Request<'_>) {
        let Some(h) = self.session(s) else { return };
        let id = self.next_id;
        self.next_id += 1;
        self.frame.clear();
        req.encode(id, &mut self.frame);
        let frame = std::mem::take(&mut self.frame);
        let (got, decoded) = gms::decode_request(&frame).expect("what we encode decodes");
        assert_eq!(got, id);
        let asked = match &decoded {
            gms::Request::PutCached(p) => p.len(),
            gms::Request::GetCached { uids, .. } => uids.len(),
            gms::Request::GcdUpdate { remove, .. } => remove.len(),
            gms::Request::Epoch(_) => 0,
        };
        self.out.clear();
        let outcome = handle_gms(&mut self.store, h, id, decoded, self.now, 0, &mut self.out);
        if matches!(outcome, GmsOutcome::Replied) {
            let len = frame_len(&self.out).expect("a frame within the limits");
            assert_eq!(len, Some(self.out.len()));
            match gms::decode_reply(&self.out) {
                Ok((rid, reply)) => {
                    assert_eq!(rid, id);
                    let items = match reply {
                        gms::Reply::PutCached { status, .. } => status.len(),
                        gms::Reply::GetCached { pages, .. } => {
                            assert!(pages.iter().flatten().all(|p| p.verify()));
                            pages.len()
                        }
                        gms::Reply::GcdUpdate { elsewhere, .. } => elsewhere.len(),
                    };
                    assert_eq!(items, asked);
                }
                // An expired session is answered with the owned-page protocol's error.
                Err(_) => assert!(decode_reply(&self.out).is_ok()),
            }
        }
        self.frame = frame;
        self.store.check_invariants();
    }

    fn raw(&mut self, s: u8, frame: &[u8]) {
        if let Ok((id, req)) = decode_request(frame) {
            let limit = req_limit(&req);
            self.run(s, id, req, limit);
        }
    }

    fn run(&mut self, s: u8, id: u64, req: Request<'_>, limit: Limit) {
        let Some(h) = self.session(s) else { return };
        self.out.clear();
        let cost = netram_store::serve::cost(&req);
        let outcome = handle_request(
            &mut self.store,
            h,
            id,
            req,
            self.now,
            0,
            &mut self.out,
            store_stats,
        );
        match outcome {
            Outcome::Forward(fwd) => {
                let outcomes: Vec<DeltaOutcome> = fwd
                    .deltas
                    .iter()
                    .enumerate()
                    .map(|(i, (_, d))| {
                        if (id >> (i % 64)) & 1 == 1 {
                            return DeltaOutcome::Unreachable;
                        }
                        // The sender as a holder sees it: a server the fuzzer picks (checked
                        // against the member's node id), or a clear-TCP address.
                        let by = match (id >> 8) % 4 {
                            0 => DeltaFrom::Peer(NO_PEER),
                            n => DeltaFrom::Peer(Peer::Server(n - 1)),
                        };
                        match self.store.apply_delta(&d.as_delta(), by) {
                            DeltaStatus::Applied => DeltaOutcome::Applied,
                            _ => DeltaOutcome::UnknownGroup,
                        }
                    })
                    .collect();
                finish_forward(
                    &mut self.store,
                    h,
                    fwd,
                    &outcomes,
                    self.now,
                    0,
                    &mut self.out,
                );
            }
            Outcome::Handover(ho) => {
                // The new server is this store; some answers are lost on the way (unreachable).
                let by = match (id >> 8) % 4 {
                    0 => NO_PEER,
                    1 => Peer::Node(1),
                    n => Peer::Server(n - 2),
                };
                let answered = ho.pages.len() >> (id % 3);
                let status: Vec<MoveStatus> = ho.pages[..answered]
                    .iter()
                    .map(|p| self.store.adopt(by, ho.owner, &p.as_page(), self.now))
                    .collect();
                finish_handover(&mut self.store, h, ho, &status, 0, &mut self.out);
            }
            Outcome::Open | Outcome::Closed => {}
        }
        check_replies(&self.out, id, limit);
        // The rate's charge never panics, and every wait is counted.
        let throttled = self.store.counters().requests_throttled;
        let wait = self.store.charge(h, cost, self.now);
        assert_eq!(
            self.store.counters().requests_throttled,
            throttled + u64::from(wait > 0)
        );
        self.store.check_invariants();
    }
}

/// What a reply may hold at most, from its request.
#[derive(Clone, Copy)]
enum Limit {
    /// One status or one page per key of the request.
    Items(usize),
    Groups(u32),
    Any,
}

fn req_limit(req: &Request<'_>) -> Limit {
    match req {
        Request::Put(p) => Limit::Items(p.len()),
        Request::PutParity(p) => Limit::Items(p.len()),
        Request::Get(k) | Request::Delete(k) => Limit::Items(k.len()),
        Request::ParityDelta(d) => Limit::Items(d.len()),
        Request::Expect { pages, .. } => Limit::Items(pages.len()),
        Request::Migrate { keys, .. } => Limit::Items(keys.len()),
        Request::Adopt { pages, .. } => Limit::Items(pages.len()),
        Request::ParityShip { .. } => Limit::Items(1),
        Request::ParityScan { max, .. } => Limit::Groups(*max),
        _ => Limit::Any,
    }
}

/// Every reply the server wrote must reach the client whole: a frame within the limit that a
/// client decodes, answering this request, no bigger than the request allows.
fn check_replies(out: &[u8], id: u64, limit: Limit) {
    let mut rest = out;
    while !rest.is_empty() {
        let len = frame_len(rest)
            .expect("a reply's length is within the frame limit")
            .expect("a whole length prefix");
        assert!(
            len <= MAX_FRAME_LEN && len <= rest.len(),
            "reply of {len} bytes"
        );
        let (frame, tail) = rest.split_at(len);
        rest = tail;
        let (got, reply) = decode_reply(frame).expect("a client decodes every reply");
        assert_eq!(got, id, "a reply answers its request");
        match (limit, &reply) {
            (Limit::Items(n), Reply::Put { status, .. }) => assert_eq!(status.len(), n),
            (Limit::Items(n), Reply::Get { pages, .. }) => assert_eq!(pages.len(), n),
            (Limit::Items(n), Reply::Delete { status, .. }) => assert_eq!(status.len(), n),
            (Limit::Items(n), Reply::ParityDelta { status, .. }) => assert_eq!(status.len(), n),
            (Limit::Items(n), Reply::Move { status, .. }) => assert_eq!(status.len(), n),
            (Limit::Groups(max), Reply::ParityScan { groups, .. }) => {
                assert!(
                    groups.len() <= max as usize,
                    "{} groups for a max of {max}",
                    groups.len()
                )
            }
            _ => {}
        }
    }
}

fuzz_target!(|input: Input| {
    let frames = usize::from(input.frames % 4096) + 1;
    let cfg = StoreConfig {
        lease_period_ms: 10,
        max_sessions: usize::from(input.max_sessions % 64) + 1,
        max_peer_sessions: u32::from(input.max_peer_sessions % 16) + 1,
        max_peer_pages: input.max_peer_pages.map_or(u64::MAX, u64::from),
        max_peer_ops_per_s: u32::from(input.max_sessions % 4) * 100,
    };
    let mut h = Harness {
        store: Store::new(vec![0u8; frames * PAGE_SIZE], cfg),
        sessions: Vec::new(),
        now: 0,
        next_id: 1,
        frame: Vec::new(),
        out: Vec::new(),
    };
    let zeros = vec![0u8; PAGE_SIZE];
    for op in input.ops.iter().take(256) {
        match *op {
            Op::Open {
                peer,
                node,
                incarnation,
                id,
            } => {
                // Clear-TCP addresses, authenticated clients and servers.
                let peer = match peer % 8 {
                    p @ 0..=2 => Peer::Addr(IpAddr::V4(Ipv4Addr::new(127, 0, 0, p + 1))),
                    p @ 3..=5 => Peer::Node(u64::from(p % 3)),
                    p => Peer::Server(u64::from(p % 3)),
                };
                let r = h.store.open_session_from(
                    peer,
                    u64::from(node % 4),
                    u64::from(incarnation % 3),
                    u64::from(id),
                    h.now,
                );
                if let Ok(s) = r {
                    h.sessions.push(s);
                }
                h.store.check_invariants();
            }
            Op::Put {
                s,
                region,
                first,
                n,
                version,
                zero,
                clean,
            } => {
                let flags = PageFlags(if clean { PageFlags::CLEAN } else { 0 });
                for keys in batches(u32::from(region % 3), first, n) {
                    let data: Vec<Vec<u8>> = keys.iter().map(|&k| contents(k)).collect();
                    let pages: Vec<Page<'_>> = keys
                        .iter()
                        .zip(&data)
                        .map(|(&k, d)| {
                            let d = if zero { &zeros } else { d };
                            Page::seal_with(k, u32::from(version), flags, d)
                        })
                        .collect();
                    h.request(s, &Request::Put(pages));
                }
            }
            Op::Join {
                s,
                first,
                n,
                group,
                per_group,
                holder,
                member,
            } => {
                let per_group = u64::from(per_group % 20) + 1;
                for keys in batches(0, first, n) {
                    let data: Vec<Vec<u8>> = keys.iter().map(|&k| contents(k)).collect();
                    let pages: Vec<(Page<'_>, ParityOp)> = keys
                        .iter()
                        .zip(&data)
                        .map(|(&k, d)| {
                            let op = ParityOp::Join {
                                holder: server(holder),
                                holder_node: u64::from(holder % 3),
                                group: u64::from(group) + k.page / per_group,
                                member: server(member),
                            };
                            (Page::seal(k, 1, d), op)
                        })
                        .collect();
                    h.request(s, &Request::PutParity(pages));
                }
            }
            Op::Keep {
                s,
                first,
                n,
                version,
            } => {
                for keys in batches(0, first, n) {
                    let data: Vec<Vec<u8>> = keys.iter().map(|&k| contents(k)).collect();
                    let pages: Vec<(Page<'_>, ParityOp)> = keys
                        .iter()
                        .zip(&data)
                        .map(|(&k, d)| (Page::seal(k, u32::from(version), d), ParityOp::Keep))
                        .collect();
                    h.request(s, &Request::PutParity(pages));
                }
            }
            Op::Ship {
                s,
                group,
                count,
                max_members,
                members,
                servers,
            } => {
                let servers = servers % 8 + 1;
                for g in 0..u64::from(count % 1024) + 1 {
                    let group = u64::from(group) + g;
                    let members: Vec<Member> = (0..u64::from(members % 40) + 1)
                        .map(|m| Member {
                            server: server((g + m) as u8 % servers),
                            node: 0,
                            key: PageKey::new(0, group * 64 + m),
                            version: 1,
                        })
                        .collect();
                    let parity = contents(PageKey::new(7, group));
                    let record = Record {
                        version: 0,
                        crc: 0,
                        flags: 0,
                        data: &parity,
                    };
                    h.request(
                        s,
                        &Request::ParityShip {
                            group,
                            max_members,
                            members,
                            record,
                        },
                    );
                }
            }
            Op::Delta {
                s,
                own,
                group,
                member,
                key,
                from,
                to,
                kind,
            } => {
                let data = contents(PageKey::new(0, u64::from(key)));
                let kind = match kind % 3 {
                    0 => DeltaKind::Update,
                    1 => DeltaKind::Remove,
                    _ => DeltaKind::Drop,
                };
                let owner = if own {
                    Owner::SELF
                } else {
                    Owner {
                        principal: u64::from(key % 4),
                        node: u64::from(member % 4),
                        incarnation: 1,
                    }
                };
                let delta = Delta {
                    owner,
                    group: u64::from(group),
                    member: server(member),
                    key: PageKey::new(0, u64::from(key)),
                    from,
                    to,
                    kind,
                    record: Record {
                        version: from ^ to,
                        crc: 0,
                        flags: 0,
                        data: &data,
                    },
                };
                h.request(s, &Request::ParityDelta(vec![delta]));
            }
            Op::Scan { s, dead, max } => {
                let dead = dead.map_or(NO_SERVER, server);
                h.request(s, &Request::ParityScan { dead, max });
            }
            Op::Get { s, first, n } => {
                for keys in batches(0, first, n) {
                    h.request(s, &Request::Get(keys));
                }
            }
            Op::Delete { s, first, n } => {
                for keys in batches(0, first, n) {
                    h.request(s, &Request::Delete(keys));
                }
            }
            Op::Expect {
                s,
                from,
                first,
                n,
                version,
            } => {
                for keys in batches(0, first, n) {
                    let pages = keys.iter().map(|&k| (k, u32::from(version))).collect();
                    let from_node = u64::from(from % 4);
                    h.request(s, &Request::Expect { from_node, pages });
                }
            }
            Op::Migrate { s, to, first, n } => {
                for keys in batches(0, first, n) {
                    let req = Request::Migrate {
                        to: server(to),
                        to_node: u64::from(to % 4),
                        keys,
                    };
                    h.request(s, &req);
                }
            }
            Op::Adopt {
                s,
                owner,
                first,
                n,
                version,
            } => {
                let Some(o) = h.session(owner) else { continue };
                let owner = h.store.owner(o);
                for keys in batches(0, first, n) {
                    let datas: Vec<Vec<u8>> = keys.iter().map(|&k| contents(k)).collect();
                    let pages = keys
                        .iter()
                        .zip(&datas)
                        .map(|(&k, d)| Page::seal(k, u32::from(version), d))
                        .collect();
                    h.request(s, &Request::Adopt { owner, pages });
                }
            }
            Op::Stats { s } => h.request(s, &Request::Stats),
            Op::Refresh { s } => h.request(s, &Request::Refresh),
            Op::Close { s } => h.request(s, &Request::Close),
            Op::Advance { ms } => {
                h.now += u64::from(ms);
                h.store.expire(h.now);
                h.store.check_invariants();
            }
            Op::Offer { frames, compact } => {
                let before = h.store.stored_pages();
                let runs = h.store.set_offer(u64::from(frames));
                let above = h.store.pages_beyond_offer();
                let moved = h.store.compact(usize::from(compact));
                assert_eq!(h.store.pages_beyond_offer(), above - moved as u64);
                let back = h.store.take_given_back();
                assert!(
                    back.len() >= moved,
                    "each page moved down gives its frame back"
                );
                assert_eq!(
                    h.store.stored_pages(),
                    before,
                    "moving the offer frees no page"
                );
                let offered = h.store.capacity_pages();
                for &(first, n) in &runs {
                    assert!(u64::from(first) >= offered && n > 0);
                }
                assert!(back.iter().all(|&f| u64::from(f) >= offered));
                h.store.check_invariants();
            }
            Op::Cached {
                s,
                first,
                n,
                age,
                damaged,
            } => {
                let n = usize::from(n % MAX_BATCH as u8) + 1;
                let datas: Vec<Vec<u8>> = (0..n)
                    .map(|i| contents(PageKey::new(9, u64::from(first) + i as u64)))
                    .collect();
                let pages = (0..n)
                    .map(|i| {
                        let p = gms::CachedPage::seal(
                            u128::from(first) + i as u128,
                            u32::from(age) * 10,
                            &datas[i],
                        );
                        if (damaged >> (i % 8)) & 1 == 1 {
                            gms::CachedPage { crc: !p.crc, ..p }
                        } else {
                            p
                        }
                    })
                    .collect();
                h.gms(s, &gms::Request::PutCached(pages));
            }
            Op::Fetch { s, first, n, take } => {
                let n = u128::from(n % MAX_BATCH as u8) + 1;
                let uids = (0..n).map(|i| u128::from(first) + i).collect();
                h.gms(s, &gms::Request::GetCached { take, uids });
            }
            Op::Shared {
                s,
                reset,
                first,
                n,
                gone,
                m,
            } => {
                let list = |from: u16, n: u8| -> Vec<u128> {
                    (0..u128::from(n % (MAX_BATCH as u8 + 1)))
                        .map(|i| u128::from(from % 512) + i)
                        .collect()
                };
                let req = gms::Request::GcdUpdate {
                    reset,
                    add: list(first, n),
                    remove: list(gone, m),
                };
                h.gms(s, &req);
            }
            Op::Raw { s, ref frame } => h.raw(s, frame),
        }
    }
});
