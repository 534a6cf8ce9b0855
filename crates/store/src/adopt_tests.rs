//! Server-to-server migration (Nswap §III, Fig. 2) across two stores wired by hand: the owner's
//! EXPECT at the new server, its MIGRATE at the old one, the pages carried as ADOPT the way the
//! daemon and the simulator carry them, and every way a handover is refused.

use crate::serve::{finish_handover, handle_request, store_stats, Outcome};
use crate::{Peer, SessionHandle, Store, StoreConfig, EXPECT_TTL_MS, MAX_EXPECTED_PER_SESSION};
use netram_proto::{
    decode_reply, GetResult, MoveStatus, Page, PageKey, PutStatus, Reply, Request, PAGE_SIZE,
};
use std::net::SocketAddr;

/// The owner's node id, and the two servers' (as their certificates name them).
const C_NODE: u64 = 21;
const B_NODE: u64 = 22;

fn b_addr() -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 2], 7077))
}

fn key(p: u64) -> PageKey {
    PageKey::new(1, p)
}

fn data(b: u8) -> Vec<u8> {
    (0..PAGE_SIZE).map(|i| b.wrapping_add(i as u8)).collect()
}

/// C, the shrinking donor, and B, the new home; the owner has a session on each.
struct Pair {
    c: Store<Vec<u8>>,
    b: Store<Vec<u8>>,
    hc: SessionHandle,
    hb: SessionHandle,
    now: u64,
}

impl Pair {
    fn new(b_pages: usize) -> Self {
        let mut c = Store::new(vec![0u8; 16 * PAGE_SIZE], StoreConfig::default());
        let mut b = Store::new(vec![0u8; b_pages * PAGE_SIZE], StoreConfig::default());
        let hc = c.open_session(7, 1, 1, 0).unwrap();
        let hb = b.open_session(7, 1, 2, 0).unwrap();
        Self {
            c,
            b,
            hc,
            hb,
            now: 0,
        }
    }

    fn run(store: &mut Store<Vec<u8>>, h: SessionHandle, req: Request<'_>) -> Vec<MoveStatus> {
        let mut out = Vec::new();
        match handle_request(store, h, 1, req, 0, 0, &mut out, store_stats) {
            Outcome::Open => {}
            other => panic!("answered at once, not {other:?}"),
        }
        match decode_reply(&out).unwrap().1 {
            Reply::Move { status, .. } => status,
            other => panic!("a MOVE reply, not {other:?}"),
        }
    }

    fn put(store: &mut Store<Vec<u8>>, h: SessionHandle, p: u64, version: u32, b: u8) {
        let d = data(b);
        let page = Page::seal(key(p), version, &d);
        let s = store
            .put(h, page.key, version, page.crc, page.flags, page.data, 0)
            .unwrap();
        assert_eq!(s, PutStatus::Stored);
    }

    fn expect(&mut self, from: u64, pages: &[(u64, u32)]) -> Vec<MoveStatus> {
        let pages = pages.iter().map(|&(p, v)| (key(p), v)).collect();
        Self::run(
            &mut self.b,
            self.hb,
            Request::Expect {
                from_node: from,
                pages,
            },
        )
    }

    /// The owner's MIGRATE at C; C's pages reach B as `by` sends them.
    fn migrate(&mut self, keys: &[u64], by: Peer) -> Vec<MoveStatus> {
        let mut out = Vec::new();
        let req = Request::Migrate {
            to: b_addr(),
            to_node: B_NODE,
            keys: keys.iter().map(|&p| key(p)).collect(),
        };
        let o = handle_request(
            &mut self.c,
            self.hc,
            9,
            req,
            self.now,
            0,
            &mut out,
            store_stats,
        );
        if let Outcome::Handover(ho) = o {
            assert_eq!((ho.to.addr, ho.to.node), (b_addr(), B_NODE));
            let status: Vec<MoveStatus> = ho
                .pages
                .iter()
                .map(|p| self.b.adopt(by, ho.owner, &p.as_page(), self.now))
                .collect();
            finish_handover(&mut self.c, self.hc, ho, &status, 0, &mut out);
        }
        match decode_reply(&out).unwrap() {
            (9, Reply::Move { status, .. }) => status,
            other => panic!("a MOVE reply to the MIGRATE, not {other:?}"),
        }
    }

    fn version_at_b(&mut self, p: u64) -> Option<(u32, Vec<u8>)> {
        let mut out = Vec::new();
        handle_request(
            &mut self.b,
            self.hb,
            3,
            Request::Get(vec![key(p)]),
            self.now,
            0,
            &mut out,
            store_stats,
        );
        match decode_reply(&out).unwrap().1 {
            Reply::Get { pages, .. } => match pages[0] {
                GetResult::Found(p) => Some((p.version, p.data.to_vec())),
                GetResult::Missing(_) => None,
            },
            other => panic!("{other:?}"),
        }
    }
}

const FROM_C: Peer = Peer::Server(C_NODE);

#[test]
fn pages_go_from_server_to_server_as_their_owner_said() {
    let mut x = Pair::new(16);
    Pair::put(&mut x.c, x.hc, 1, 3, 10);
    Pair::put(&mut x.c, x.hc, 2, 5, 20);
    assert_eq!(x.expect(C_NODE, &[(1, 3), (2, 5)]), [MoveStatus::Done; 2]);
    assert_eq!(x.b.expected_pages(), 2);
    let st = x.migrate(&[1, 2, 3], FROM_C);
    assert_eq!(
        st,
        [MoveStatus::Done, MoveStatus::Done, MoveStatus::Missing]
    );
    assert_eq!(x.version_at_b(1), Some((3, data(10))));
    assert_eq!(x.version_at_b(2), Some((5, data(20))));
    // The old server keeps its copies until the owner deletes them (INVALIDATE).
    assert_eq!(x.c.stored_pages(), 2);
    assert_eq!(x.b.expected_pages(), 0, "each expectation is used once");
    assert_eq!(x.b.counters().pages_adopted, 2);
    assert_eq!(x.c.counters().pages_handed_over, 2);
    // Used once: the same handover again is refused, and changes nothing.
    assert_eq!(x.migrate(&[1], FROM_C), [MoveStatus::Unexpected]);
    assert_eq!(x.b.counters().adopts_refused_unexpected, 1);
}

#[test]
fn a_handover_nobody_expected_is_refused_and_stores_nothing() {
    let mut x = Pair::new(16);
    for p in 1..=6 {
        Pair::put(&mut x.c, x.hc, p, 1, p as u8);
    }
    // Nothing expected; another sender; another version; a client's certificate.
    assert_eq!(x.migrate(&[1], FROM_C), [MoveStatus::Unexpected]);
    x.expect(C_NODE, &[(2, 1), (3, 9), (4, 1)]);
    assert_eq!(x.migrate(&[2], Peer::Server(99)), [MoveStatus::Unexpected]);
    // ... which does not use up the expectation of the sender the owner named.
    assert_eq!(x.migrate(&[2], FROM_C), [MoveStatus::Done]);
    assert_eq!(x.migrate(&[3], FROM_C), [MoveStatus::Unexpected]);
    assert_eq!(
        x.migrate(&[4], Peer::Node(C_NODE)),
        [MoveStatus::Unexpected]
    );
    // Expectations run out.
    x.expect(C_NODE, &[(5, 1)]);
    x.now += EXPECT_TTL_MS + 1;
    // (the sessions are refreshed by the owner meanwhile)
    x.b.refresh(x.hb, x.now).unwrap();
    x.c.refresh(x.hc, x.now).unwrap();
    assert_eq!(x.migrate(&[5], FROM_C), [MoveStatus::Unexpected]);
    assert_eq!(x.b.stored_pages(), 1, "page 2 alone");
    assert_eq!(x.b.counters().adopts_refused_unexpected, 5);
    // A session that ended takes its expectations with it.
    x.expect(C_NODE, &[(6, 1)]);
    x.b.close(x.hb).unwrap();
    let owner = x.c.owner(x.hc);
    let d = data(6);
    let page = Page::seal(key(6), 1, &d);
    assert_eq!(
        x.b.adopt(FROM_C, owner, &page, x.now),
        MoveStatus::Unexpected
    );
}

/// The owner gave up on a move (its old server stopped answering) and deleted the key at the
/// new server before the handover arrived: the handover is refused.
#[test]
fn a_delete_withdraws_what_was_expected() {
    let mut x = Pair::new(16);
    Pair::put(&mut x.c, x.hc, 1, 3, 10);
    x.expect(C_NODE, &[(1, 3)]);
    assert!(!x.b.delete(x.hb, key(1), 0).unwrap(), "nothing there yet");
    assert_eq!(x.b.expected_pages(), 0);
    assert_eq!(x.migrate(&[1], FROM_C), [MoveStatus::Unexpected]);
    assert_eq!(x.version_at_b(1), None);
}

#[test]
fn a_newer_write_that_got_there_first_is_never_replaced() {
    let mut x = Pair::new(16);
    Pair::put(&mut x.c, x.hc, 1, 3, 10);
    x.expect(C_NODE, &[(1, 3)]);
    // The owner wrote version 4 to B while version 3 was on its way from C.
    Pair::put(&mut x.b, x.hb, 1, 4, 40);
    assert_eq!(x.migrate(&[1], FROM_C), [MoveStatus::Exists]);
    assert_eq!(x.version_at_b(1), Some((4, data(40))));
    assert_eq!(x.b.counters().adopts_refused_exists, 1);
}

#[test]
fn the_new_server_bounds_what_it_expects_and_what_it_takes() {
    // Room for two pages.
    let mut x = Pair::new(2);
    for p in 1..=3 {
        Pair::put(&mut x.c, x.hc, p, 1, p as u8);
    }
    assert_eq!(
        x.expect(C_NODE, &[(1, 1), (2, 1), (3, 1)]),
        [MoveStatus::Done; 3]
    );
    let st = x.migrate(&[1, 2, 3], FROM_C);
    assert_eq!(st, [MoveStatus::Done, MoveStatus::Done, MoveStatus::Full]);
    assert_eq!(x.b.counters().adopts_refused_full, 1);
    // Full: no more expectations.
    assert_eq!(x.expect(C_NODE, &[(4, 1)]), [MoveStatus::Full]);
    // At most MAX_EXPECTED_PER_SESSION per session, however much room there is.
    let mut y = Pair::new(16);
    let many: Vec<(u64, u32)> = (0..MAX_EXPECTED_PER_SESSION as u64 + 1)
        .map(|p| (p, 1))
        .collect();
    let mut st = Vec::new();
    for chunk in many.chunks(netram_proto::MAX_BATCH) {
        st.extend(y.expect(C_NODE, chunk));
    }
    assert!(st[..MAX_EXPECTED_PER_SESSION]
        .iter()
        .all(|&s| s == MoveStatus::Done));
    assert_eq!(st[MAX_EXPECTED_PER_SESSION], MoveStatus::Full);
    assert_eq!(y.b.expected_pages(), MAX_EXPECTED_PER_SESSION);
    // Expecting a key again replaces its expectation, it does not take another.
    assert_eq!(y.expect(C_NODE, &[(0, 2)]), [MoveStatus::Done]);
    assert_eq!(y.b.expected_pages(), MAX_EXPECTED_PER_SESSION);
}

/// A client at its quota on the new server is told it has no room there (every reply says
/// so), and its expectations are refused: it places its pages elsewhere rather than handing
/// the server pages it would refuse one by one.
#[test]
fn a_client_at_its_quota_is_told_so_and_expects_nothing() {
    let mut x = Pair::new(16);
    x.b = Store::new(
        vec![0u8; 16 * PAGE_SIZE],
        StoreConfig {
            max_peer_pages: 2,
            ..StoreConfig::default()
        },
    );
    x.hb = x.b.open_session(7, 1, 2, 0).unwrap();
    Pair::put(&mut x.b, x.hb, 10, 1, 1);
    assert_eq!(
        x.b.load(x.hb, 0).free_pages,
        1,
        "room for one more of this client's"
    );
    Pair::put(&mut x.b, x.hb, 11, 1, 2);
    assert_eq!(
        x.b.load(x.hb, 0).free_pages,
        0,
        "its quota, though frames are free"
    );
    assert!(x.b.room() > 0);
    assert_eq!(x.expect(C_NODE, &[(1, 1)]), [MoveStatus::Full]);
}

/// An owner that reconnected holds two sessions here until the old one's lease runs out: a
/// page handed over goes into the session that expects it, the one the owner asks.
#[test]
fn a_handed_over_page_goes_to_the_session_that_expects_it() {
    let mut x = Pair::new(16);
    Pair::put(&mut x.c, x.hc, 1, 3, 10);
    let old = x.hb;
    x.hb = x.b.open_session(7, 1, 3, 0).unwrap();
    assert_ne!(old.slot, x.hb.slot);
    assert_eq!(x.expect(C_NODE, &[(1, 3)]), [MoveStatus::Done]);
    assert_eq!(x.migrate(&[1], FROM_C), [MoveStatus::Done]);
    assert_eq!(x.version_at_b(1), Some((3, data(10))));
    x.hb = old;
    assert_eq!(x.version_at_b(1), None, "not in the old session");
}

/// Both of an owner's sessions expect the page (the old one took an EXPECT before the owner
/// gave its connection up and sent the EXPECT again on a new one): the page goes into the
/// session that expected it last, the one the owner reads (`netram sim --seed 350 --scheme
/// mirror:3` found it stored in the old one: the owner's table named a copy it could not
/// read).
#[test]
fn a_page_both_sessions_expect_goes_to_the_one_that_expected_it_last() {
    let mut x = Pair::new(16);
    Pair::put(&mut x.c, x.hc, 1, 3, 10);
    assert_eq!(x.expect(C_NODE, &[(1, 3)]), [MoveStatus::Done]);
    let old = x.hb;
    x.now = 100;
    x.hb = x.b.open_session(7, 1, 3, 100).unwrap();
    assert!(old.slot < x.hb.slot, "the old session is looked at first");
    let pages = vec![(key(1), 3)];
    let s = Pair::run(
        &mut x.b,
        x.hb,
        Request::Expect {
            from_node: C_NODE,
            pages,
        },
    );
    assert_eq!(s, [MoveStatus::Done]);
    assert_eq!(x.migrate(&[1], FROM_C), [MoveStatus::Done]);
    assert_eq!(x.version_at_b(1), Some((3, data(10))));
    x.hb = old;
    assert_eq!(x.version_at_b(1), None, "not in the old session");
}

/// One client's sessions together hold at most MAX_EXPECTED_PER_PEER expectations: a client
/// opening many sessions does not take the store's whole table, and another client still
/// gets its own.
#[test]
fn expectations_are_bounded_per_client_over_its_sessions() {
    let pages = crate::MAX_EXPECTED_PER_PEER + 64;
    let mut b = Store::new(vec![0u8; pages * PAGE_SIZE], StoreConfig::default());
    let greedy = Peer::Node(7);
    let per = MAX_EXPECTED_PER_SESSION;
    let sessions = crate::MAX_EXPECTED_PER_PEER / per + 1;
    let mut done = 0;
    let mut refused = 0;
    for s in 0..sessions as u64 {
        let h = b.open_session_from(greedy, 7, 1, 10 + s, 0).unwrap();
        for p in 0..per as u64 {
            match b.expect(h, C_NODE, key(p), 1, 0).unwrap() {
                MoveStatus::Done => done += 1,
                MoveStatus::Full => refused += 1,
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(done, crate::MAX_EXPECTED_PER_PEER);
    assert_eq!(refused, sessions * per - crate::MAX_EXPECTED_PER_PEER);
    assert_eq!(b.expected_pages(), crate::MAX_EXPECTED_PER_PEER);
    // Another client is not held back by the first one's.
    let h = b.open_session_from(Peer::Node(8), 8, 1, 1, 0).unwrap();
    assert_eq!(b.expect(h, C_NODE, key(1), 1, 0).unwrap(), MoveStatus::Done);
    // Once the greedy client's run out, it may expect again.
    let h = b
        .open_session_from(greedy, 7, 1, 99, EXPECT_TTL_MS + 1)
        .unwrap();
    assert_eq!(
        b.expect(h, C_NODE, key(1), 1, EXPECT_TTL_MS + 1).unwrap(),
        MoveStatus::Done
    );
}
