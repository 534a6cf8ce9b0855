//! The limits that keep one client from taking a server from the others: sessions and frames
//! per client, groups no larger than a frame carries, scans cut to fit a frame, and an address
//! table that refuses rather than overflows and forgets what nothing names.

use super::*;
use netram_proto::parity::MAX_GROUP_MEMBERS;
use netram_proto::{Member, Record};
use std::net::SocketAddr;

fn store(frames: usize, cfg: StoreConfig) -> Store<Vec<u8>> {
    Store::new(vec![0u8; frames * PAGE_SIZE], cfg)
}

fn peer(i: u8) -> Peer {
    Peer::Addr(IpAddr::from([10, 0, 0, i]))
}

fn put(s: &mut Store<Vec<u8>>, h: SessionHandle, p: u64) -> PutStatus {
    let (key, data) = (PageKey::new(1, p), vec![p as u8; PAGE_SIZE]);
    let crc = netram_proto::page_checksum(key, 1, PageFlags::default(), &data);
    s.put(h, key, 1, crc, PageFlags::default(), &data, 0)
        .unwrap()
}

#[test]
fn a_client_holds_at_most_its_quota_of_frames_and_others_are_still_served() {
    let cfg = StoreConfig {
        max_peer_pages: 3,
        ..StoreConfig::default()
    };
    let mut s = store(8, cfg);
    let a1 = s.open_session_from(peer(1), 1, 1, 1, 0).unwrap();
    let a2 = s.open_session_from(peer(1), 2, 1, 1, 0).unwrap();
    let b = s.open_session_from(peer(2), 3, 1, 1, 0).unwrap();
    assert_eq!(put(&mut s, a1, 0), PutStatus::Stored);
    assert_eq!(put(&mut s, a1, 1), PutStatus::Stored);
    assert_eq!(put(&mut s, a2, 0), PutStatus::Stored);
    // A second session of the same client shares the quota.
    assert_eq!(put(&mut s, a2, 1), PutStatus::Full);
    assert_eq!(put(&mut s, a1, 2), PutStatus::Full);
    assert_eq!(s.counters().puts_refused_quota, 2);
    assert_eq!(s.counters().puts_refused_full, 0);
    // An overwrite takes no new frame.
    assert_eq!(put(&mut s, a1, 1), PutStatus::Stored);
    // The other client is served.
    for p in 0..3 {
        assert_eq!(put(&mut s, b, p), PutStatus::Stored);
    }
    // Room comes back with a delete and with the session's end.
    assert!(s.delete(a1, PageKey::new(1, 0), 0).unwrap());
    assert_eq!(put(&mut s, a2, 1), PutStatus::Stored);
    s.close(a1).unwrap();
    assert_eq!(put(&mut s, a2, 2), PutStatus::Stored);
    s.check_invariants();
}

#[test]
fn a_client_holds_at_most_its_quota_of_sessions() {
    let cfg = StoreConfig {
        max_peer_sessions: 2,
        ..StoreConfig::default()
    };
    let mut s = store(4, cfg);
    s.open_session_from(peer(1), 1, 1, 1, 0).unwrap();
    let second = s.open_session_from(peer(1), 2, 1, 1, 0).unwrap();
    assert!(matches!(
        s.open_session_from(peer(1), 3, 1, 1, 0),
        Err(StoreError::TooManyPeerSessions { limit: 2, .. })
    ));
    assert_eq!(s.counters().sessions_refused_peer_limit, 1);
    // Resuming is not a new session; another client is not affected.
    assert_eq!(s.open_session_from(peer(1), 2, 1, 1, 0).unwrap(), second);
    s.open_session_from(peer(2), 3, 1, 1, 0).unwrap();
    // A session that ends gives its place back.
    s.close(second).unwrap();
    s.open_session_from(peer(1), 3, 1, 1, 0).unwrap();
    s.check_invariants();
}

fn server(i: u32) -> SocketAddr {
    SocketAddr::from((std::net::Ipv4Addr::from(0x0a00_0000 + i), 7077))
}

fn ship(
    s: &mut Store<Vec<u8>>,
    h: SessionHandle,
    group: u64,
    max_members: u8,
    members: &[Member],
) -> PutStatus {
    let data = vec![0u8; PAGE_SIZE];
    let record = Record {
        version: 0,
        crc: 0,
        flags: 0,
        data: &data,
    };
    s.ship_group(h, group, max_members, members, &record, 0)
        .unwrap()
}

#[test]
fn merged_groups_never_outgrow_a_frame_and_scans_fit_one() {
    let mut s = store(256, StoreConfig::default());
    let h = s.open_session(1, 1, 1, 0).unwrap();
    // Groups of one member each, every member on its own server: all small, all mergeable,
    // and the owner asks for groups of 255.
    for g in 0..100u32 {
        let m = Member {
            server: server(g),
            node: 0,
            key: PageKey::new(1, u64::from(g)),
            version: 1,
        };
        assert_eq!(ship(&mut s, h, u64::from(g), 255, &[m]), PutStatus::Stored);
    }
    let groups = s.session_groups(h);
    assert!(s.counters().parity_groups_merged > 0);
    for (id, members, _) in &groups {
        assert!(
            members.len() <= MAX_GROUP_MEMBERS,
            "group {id} has {} members",
            members.len()
        );
    }
    let dead = server(0);
    let all = s.groups_with_member_on(h, dead, usize::MAX, usize::MAX);
    assert_eq!(all.len(), 1);
    // A byte budget smaller than one group's record gives none: the owner asks again.
    assert!(s
        .groups_with_member_on(h, dead, usize::MAX, all[0].wire_len() - 1)
        .is_empty());
    s.check_invariants();
}

#[test]
fn the_address_table_refuses_when_full_and_forgets_what_nothing_names() {
    let frames = parity::MAX_ADDRS / MAX_GROUP_MEMBERS + 8;
    let mut s = store(frames, StoreConfig::default());
    let h = s.open_session(1, 1, 1, 0).unwrap();
    let mut next = 0u32;
    let mut group = 0u64;
    // Full groups (no merging) of new addresses until the table is full.
    loop {
        let members: Vec<Member> = (0..MAX_GROUP_MEMBERS as u32)
            .map(|i| Member {
                server: server(next + i),
                node: 0,
                key: PageKey::new(1, u64::from(next + i)),
                version: 1,
            })
            .collect();
        let st = ship(&mut s, h, group, MAX_GROUP_MEMBERS as u8, &members);
        if st != PutStatus::Stored {
            assert_eq!(st, PutStatus::Full);
            break;
        }
        next += MAX_GROUP_MEMBERS as u32;
        group += 1;
        assert!(group < frames as u64, "the table never filled");
    }
    // The last few free ids, one group of one member each.
    loop {
        let m = Member {
            server: server(next),
            node: 0,
            key: PageKey::new(1, u64::from(next)),
            version: 1,
        };
        if ship(&mut s, h, group, MAX_GROUP_MEMBERS as u8, &[m]) != PutStatus::Stored {
            break;
        }
        next += 1;
        group += 1;
    }
    assert_eq!(s.counters().parity_addresses_refused, 2);
    assert_eq!(next as usize, parity::MAX_ADDRS);
    // A tag naming new addresses is refused too, and says so.
    assert!(!s.can_intern(server(1 << 20), server((1 << 20) + 1)));
    // The session ends: every address is forgotten, and another client can use the table.
    s.close(h).unwrap();
    let h2 = s.open_session(2, 1, 1, 0).unwrap();
    let m = Member {
        server: server(1 << 20),
        node: 0,
        key: PageKey::new(1, 0),
        version: 1,
    };
    assert_eq!(ship(&mut s, h2, 0, 4, &[m]), PutStatus::Stored);
    s.check_invariants();
}

#[test]
fn a_client_over_its_rate_waits_and_others_do_not() {
    let cfg = StoreConfig {
        max_peer_ops_per_s: 1000,
        ..StoreConfig::default()
    };
    let mut s = store(4, cfg);
    let a1 = s.open_session_from(peer(1), 1, 1, 1, 0).unwrap();
    let a2 = s.open_session_from(peer(1), 2, 1, 1, 0).unwrap();
    let b = s.open_session_from(peer(2), 3, 1, 1, 0).unwrap();
    let now = 10_000;
    // A burst of a tenth of a second's worth (100 ops, at least 64) passes.
    assert_eq!(s.charge(a1, 60, now), 0);
    assert_eq!(s.charge(a2, 40, now), 0, "both sessions share the bucket");
    assert_eq!(s.counters().requests_throttled, 0);
    // Beyond it, the client waits what it overdrew: 32 ops at 1000/s, 32 ms.
    assert_eq!(s.charge(a1, 32, now), 32);
    assert_eq!(s.charge(a2, 1, now), 33);
    assert_eq!(s.counters().requests_throttled, 2);
    // Another client is not touched.
    assert_eq!(s.charge(b, 64, now), 0);
    // Time pays the debt back: after 33 ms the client is even, after 100 ms more full again.
    assert_eq!(s.charge(a1, 0, now + 34), 0);
    assert_eq!(s.charge(a1, 99, now + 134), 0);
    assert_eq!(s.charge(a1, 2, now + 134), 1);
    // A sustained excess is held at the rate: 10 s of 2000 ops/s waits about 10 s more.
    let mut t = now + 1000;
    let mut waited = 0;
    for _ in 0..1000 {
        let w = s.charge(b, 20, t);
        waited += w;
        t += 10 + w;
    }
    assert!((9_000..=11_000).contains(&waited), "waited {waited} ms");
    // No limit configured: nothing waits.
    let mut free = store(4, StoreConfig::default());
    let h = free.open_session_from(peer(1), 1, 1, 1, 0).unwrap();
    assert_eq!(free.charge(h, u32::MAX, 1), 0);
    s.check_invariants();
}

#[test]
fn the_offer_grows_and_shrinks_and_pages_above_it_wait_to_leave() {
    let mut s = store(16, StoreConfig::default());
    let h = s.open_session_from(peer(1), 1, 1, 1, 0).unwrap();
    // Shrink an empty store to 4 frames: the 12 above come back as one run.
    assert_eq!(s.set_offer(4), vec![(4, 12)]);
    assert_eq!(
        (s.capacity_pages(), s.free_pages(), s.arena_pages()),
        (4, 4, 16)
    );
    for p in 0..4 {
        assert_eq!(put(&mut s, h, p), PutStatus::Stored);
    }
    assert_eq!(
        put(&mut s, h, 4),
        PutStatus::Full,
        "nothing above the offer is taken"
    );
    s.check_invariants();
    // Grow to 10: six more frames, filled bottom first.
    assert!(s.set_offer(10).is_empty());
    for p in 4..10 {
        assert_eq!(put(&mut s, h, p), PutStatus::Stored);
    }
    assert_eq!(put(&mut s, h, 10), PutStatus::Full);
    // Free two low frames, then shrink to 6: the two free frames below 6 stay offered; the
    // four pages in frames 6..10 stay readable, above the offer, until they leave.
    assert!(s.delete(h, PageKey::new(1, 0), 0).unwrap());
    assert!(s.delete(h, PageKey::new(1, 1), 0).unwrap());
    assert!(s.set_offer(6).is_empty(), "no free frame above 6");
    assert_eq!(s.pages_beyond_offer(), 4);
    assert_eq!(s.stored_pages(), 8);
    assert_eq!(s.free_pages(), 2);
    assert_eq!(s.session_leaving(h), 4);
    s.check_invariants();
    // The frames free below the offer are for the pages above it: no new page takes them.
    assert_eq!(s.room(), 0);
    assert_eq!(s.load(h, 0).free_pages, 0);
    assert_eq!(put(&mut s, h, 20), PutStatus::Full);
    assert!(s.get(h, PageKey::new(1, 9), 0).unwrap().is_some());
    // An overwrite of a page above the offer stays in place.
    assert_eq!(put(&mut s, h, 9), PutStatus::Stored);
    assert_eq!(s.pages_beyond_offer(), 4);
    // Compaction moves one down (the highest), its frame given back.
    assert_eq!(s.compact(1), 1);
    assert_eq!((s.pages_beyond_offer(), s.free_pages()), (3, 1));
    assert_eq!(s.take_given_back(), vec![9]);
    // Deleting a page above the offer gives its frame back and pulls another one down into
    // the frame still free below.
    assert!(s.delete(h, PageKey::new(1, 8), 0).unwrap());
    let mut back = s.take_given_back();
    back.sort();
    assert_eq!(back, vec![7, 8]);
    assert!(s.take_given_back().is_empty());
    assert_eq!((s.pages_beyond_offer(), s.free_pages()), (1, 0));
    assert_eq!(s.session_leaving(h), 1);
    // Moved pages read back as they were written.
    for p in [7u64, 9] {
        let got = s.get(h, PageKey::new(1, p), 0).unwrap().unwrap();
        assert!(
            got.data.iter().all(|&b| b == p as u8),
            "page {p} moved intact"
        );
    }
    assert_eq!(s.counters().pages_compacted, 2);
    s.check_invariants();
    // Nothing free below: compaction waits.
    assert_eq!(s.compact(10), 0);
    assert_eq!(s.pages_beyond_offer(), 1);
    // Growing past them takes them back into the offer.
    assert!(s.set_offer(64).is_empty(), "at most the arena");
    assert_eq!((s.capacity_pages(), s.pages_beyond_offer()), (16, 0));
    assert_eq!(s.session_leaving(h), 0);
    assert_eq!(s.stored_pages(), 7);
    assert_eq!(s.free_pages(), 9);
    assert_eq!(s.room(), 9);
    s.check_invariants();
    // A session's end frees pages above the offer too.
    s.set_offer(2);
    s.close(h).unwrap();
    assert_eq!(s.stored_pages(), 0);
    s.check_invariants();
    assert_eq!(
        (s.counters().offer_grows, s.counters().offer_shrinks),
        (2, 3)
    );
}

#[test]
fn a_frame_offered_again_is_never_given_back_under_a_page() {
    let mut s = store(8, StoreConfig::default());
    let h = s.open_session_from(peer(1), 1, 1, 1, 0).unwrap();
    for p in 0..8 {
        assert_eq!(put(&mut s, h, p), PutStatus::Stored);
    }
    s.set_offer(4);
    assert!(s.delete(h, PageKey::new(1, 7), 0).unwrap());
    // Frame 7 waits to be given back; the offer grows over it before the caller does.
    s.set_offer(8);
    assert!(
        s.take_given_back().is_empty(),
        "frame 7 may hold a page now"
    );
    assert_eq!(put(&mut s, h, 7), PutStatus::Stored);
    s.check_invariants();
}
