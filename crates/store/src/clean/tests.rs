//! Clean pages in the store: the receiving rule, owned pages taking clean pages' frames, a
//! shrinking offer dropping them, quotas, damage, and the accounting after each.

use super::*;
use crate::{StoreConfig, PAGE_SIZE};
use netram_proto::{PageKey, PutStatus};

fn store(frames: usize, max_peer_pages: u64) -> Store<Vec<u8>> {
    Store::new(
        vec![0u8; frames * PAGE_SIZE],
        StoreConfig {
            lease_period_ms: 100_000,
            max_sessions: 8,
            max_peer_pages,
            ..StoreConfig::default()
        },
    )
}

fn page(b: u8) -> Vec<u8> {
    vec![b; PAGE_SIZE]
}

fn put_clean(
    s: &mut Store<Vec<u8>>,
    h: SessionHandle,
    uid: u128,
    age_ms: u32,
    now: u64,
) -> CachedStatus {
    let data = page(uid as u8 | 1);
    let crc = cached_checksum(uid, PageFlags::default(), &data);
    s.put_clean(h, uid, age_ms, crc, PageFlags::default(), &data, now)
        .unwrap()
}

fn put_owned(s: &mut Store<Vec<u8>>, h: SessionHandle, p: u64) -> PutStatus {
    let (key, data) = (PageKey::new(1, p), page(7));
    let crc = netram_proto::page_checksum(key, 1, PageFlags::default(), &data);
    s.put(h, key, 1, crc, PageFlags::default(), &data, 0)
        .unwrap()
}

#[test]
fn a_clean_page_takes_a_free_frame_or_an_older_pages_and_is_read_back_or_taken() {
    let mut s = store(2, u64::MAX);
    let h = s.open_session(1, 1, 1, 0).unwrap();
    assert_eq!(put_clean(&mut s, h, 10, 5_000, 10_000), CachedStatus::Taken);
    assert_eq!(put_clean(&mut s, h, 11, 100, 10_000), CachedStatus::Taken);
    assert_eq!(put_clean(&mut s, h, 11, 100, 10_000), CachedStatus::Present);
    // Full: page 10 (age 5 s) is the oldest. A page of 6 s is refused, one of 1 s replaces it.
    assert_eq!(
        put_clean(&mut s, h, 12, 6_000, 10_000),
        CachedStatus::Refused
    );
    assert_eq!(
        put_clean(&mut s, h, 12, 1_000, 10_000),
        CachedStatus::Replaced
    );
    assert_eq!(s.get_clean(h, 10, false, 10_000).unwrap(), None);
    let got = s.get_clean(h, 12, false, 10_000).unwrap().unwrap();
    assert_eq!(got.data, page(13));
    assert_eq!(
        got.crc,
        cached_checksum(12, PageFlags::default(), &page(13))
    );
    // Taken by its user, it leaves: a global page has one copy.
    assert!(s.get_clean(h, 11, true, 10_000).unwrap().is_some());
    assert_eq!(s.get_clean(h, 11, true, 10_000).unwrap(), None);
    assert_eq!(s.clean_pages(), 1);
    assert_eq!(s.free_pages(), 1);
    let c = s.counters();
    assert_eq!(
        (
            c.clean_stored,
            c.clean_replaced,
            c.clean_refused_younger,
            c.clean_present
        ),
        (2, 1, 1, 1)
    );
    assert_eq!((c.clean_hits, c.clean_taken, c.clean_misses), (2, 1, 2));
    s.check_invariants();
}

#[test]
fn an_owned_page_takes_the_oldest_clean_pages_frame_instead_of_being_refused() {
    let mut s = store(3, u64::MAX);
    let h = s.open_session(1, 1, 1, 0).unwrap();
    assert_eq!(put_owned(&mut s, h, 0), PutStatus::Stored);
    assert_eq!(put_clean(&mut s, h, 20, 9_000, 10_000), CachedStatus::Taken);
    assert_eq!(put_clean(&mut s, h, 21, 1_000, 10_000), CachedStatus::Taken);
    assert_eq!(put_owned(&mut s, h, 1), PutStatus::Stored);
    assert_eq!(
        s.get_clean(h, 20, false, 10_000).unwrap(),
        None,
        "the oldest went"
    );
    assert!(s.get_clean(h, 21, false, 10_000).unwrap().is_some());
    assert_eq!(put_owned(&mut s, h, 2), PutStatus::Stored);
    // No clean page left: an owned page is refused as before.
    assert_eq!(put_owned(&mut s, h, 3), PutStatus::Full);
    assert_eq!(s.counters().clean_dropped_for_owned, 2);
    // Owned pages are never given up for clean ones.
    assert_eq!(put_clean(&mut s, h, 22, 0, 10_000), CachedStatus::Refused);
    s.check_invariants();
}

#[test]
fn a_shrinking_offer_drops_clean_pages_and_gives_their_frames_back() {
    let mut s = store(4, u64::MAX);
    let h = s.open_session(1, 1, 1, 0).unwrap();
    for uid in 0..4 {
        assert_eq!(put_clean(&mut s, h, uid, 10, 100), CachedStatus::Taken);
    }
    let runs = s.set_offer(2);
    assert!(runs.is_empty(), "no free frame above the offer");
    assert_eq!(s.clean_pages(), 2);
    assert_eq!(s.pages_beyond_offer(), 0, "copies are dropped, not moved");
    let mut back = s.take_given_back();
    back.sort_unstable();
    assert_eq!(back, vec![2, 3]);
    assert_eq!(s.counters().clean_dropped_for_offer, 2);
    s.check_invariants();
    s.set_offer(4);
    assert_eq!(put_clean(&mut s, h, 9, 10, 100), CachedStatus::Taken);
    s.check_invariants();
}

#[test]
fn damaged_mislabelled_and_over_quota_pages_are_refused_and_counted() {
    let mut s = store(8, 2);
    let a = s.open_session_from(Peer::Node(1), 1, 1, 1, 0).unwrap();
    let data = page(5);
    let crc = cached_checksum(1, PageFlags::default(), &data);
    // Under another uid, or a bit flipped.
    assert_eq!(
        s.put_clean(a, 2, 0, crc, PageFlags::default(), &data, 0)
            .unwrap(),
        CachedStatus::Corrupt
    );
    let mut bad = data.clone();
    bad[0] ^= 1;
    assert_eq!(
        s.put_clean(a, 1, 0, crc, PageFlags::default(), &bad, 0)
            .unwrap(),
        CachedStatus::Corrupt
    );
    // A zero page travels as a flag; one that claims the flag with data is refused.
    let zero = PageFlags(PageFlags::ZERO);
    let zcrc = cached_checksum(3, zero, &[]);
    assert_eq!(
        s.put_clean(a, 3, 0, zcrc, zero, &[], 0).unwrap(),
        CachedStatus::Taken
    );
    assert_eq!(
        s.get_clean(a, 3, false, 0).unwrap().unwrap().data,
        Vec::<u8>::new()
    );
    // The quota of two frames: a third page from the same client takes the frame of its own
    // oldest page if that one is at least as old (its newest pages stay), and is refused
    // otherwise; another client's is taken.
    assert_eq!(put_clean(&mut s, a, 4, 0, 10), CachedStatus::Taken);
    assert_eq!(put_clean(&mut s, a, 5, 1_000, 10), CachedStatus::Refused);
    assert_eq!(put_clean(&mut s, a, 6, 0, 10), CachedStatus::Replaced);
    assert!(s.get_clean(a, 3, false, 10).unwrap().is_none());
    assert!(s.get_clean(a, 4, false, 10).unwrap().is_some());
    let b = s.open_session_from(Peer::Node(2), 2, 1, 1, 0).unwrap();
    assert_eq!(put_clean(&mut s, b, 5, 0, 10), CachedStatus::Taken);
    let c = s.counters();
    assert_eq!((c.clean_refused_corrupt, c.clean_refused_quota), (2, 1));
    s.check_invariants();
}

#[test]
fn clean_pages_outlive_their_senders_session_and_owned_pages_do_not_see_them() {
    let mut s = store(4, u64::MAX);
    let a = s.open_session(1, 1, 1, 0).unwrap();
    put_clean(&mut s, a, 7, 0, 0);
    put_owned(&mut s, a, 7);
    s.close(a).unwrap();
    assert_eq!(s.clean_pages(), 1);
    let b = s.open_session(2, 1, 1, 0).unwrap();
    assert!(s.get_clean(b, 7, false, 0).unwrap().is_some());
    assert!(s.get(b, PageKey::new(1, 7), 0).unwrap().is_none());
    let ages: Vec<u64> = s.clean_ages(1_000).collect();
    assert_eq!(ages, vec![2_000], "a held page ages twice as fast");
    s.check_invariants();
}

/// An owner's page at `version`, flagged clean or not, written at `now`.
fn put_owned_at(
    s: &mut Store<Vec<u8>>,
    h: SessionHandle,
    p: u64,
    version: u32,
    clean: bool,
    now: u64,
) -> PutStatus {
    let (key, data) = (PageKey::new(1, p), page(p as u8 ^ version as u8));
    let flags = PageFlags(if clean { PageFlags::CLEAN } else { 0 });
    let crc = netram_proto::page_checksum(key, version, flags, &data);
    s.put(h, key, version, crc, flags, &data, now).unwrap()
}

fn owned_here(s: &mut Store<Vec<u8>>, h: SessionHandle, p: u64) -> Option<u32> {
    s.get(h, PageKey::new(1, p), 0)
        .unwrap()
        .map(|got| got.version)
}

#[test]
fn owners_clean_pages_give_way_oldest_first_and_other_pages_never() {
    let mut s = store(4, u64::MAX);
    let a = s.open_session(1, 1, 1, 0).unwrap();
    let b = s.open_session(2, 1, 1, 0).unwrap();
    // Client a: pages 0 and 1 clean (on its disk too), page 2 its only copy.
    assert_eq!(
        put_owned_at(&mut s, a, 0, 1, true, 1_000),
        PutStatus::Stored
    );
    assert_eq!(
        put_owned_at(&mut s, a, 1, 1, true, 2_000),
        PutStatus::Stored
    );
    assert_eq!(
        put_owned_at(&mut s, a, 2, 1, false, 3_000),
        PutStatus::Stored
    );
    assert_eq!(
        put_owned_at(&mut s, b, 9, 1, false, 3_500),
        PutStatus::Stored
    );
    assert_eq!(s.owned_clean_pages(), 2);
    // Full, but the two clean pages count as room in what a reply tells the clients.
    assert_eq!(s.free_pages(), 0);
    assert_eq!(s.load(b, 0).free_pages, 2);
    // Page 0 is written again: its new version arrives later than page 1.
    assert_eq!(
        put_owned_at(&mut s, a, 0, 2, true, 4_000),
        PutStatus::Stored
    );
    s.check_invariants();
    // Client b's pages take the oldest clean frames: page 1's, then page 0's.
    assert_eq!(
        put_owned_at(&mut s, b, 10, 1, false, 5_000),
        PutStatus::Stored
    );
    assert_eq!(owned_here(&mut s, a, 1), None);
    assert_eq!(owned_here(&mut s, a, 0), Some(2));
    assert_eq!(
        put_owned_at(&mut s, b, 11, 1, false, 6_000),
        PutStatus::Stored
    );
    assert_eq!(owned_here(&mut s, a, 0), None);
    // What is left is nobody's copy: refused, and a's only copy is still there.
    assert_eq!(
        put_owned_at(&mut s, b, 12, 1, false, 7_000),
        PutStatus::Full
    );
    assert_eq!(owned_here(&mut s, a, 2), Some(1));
    assert_eq!(s.load(b, 0).free_pages, 0);
    assert_eq!(s.counters().clean_owned_dropped, 2);
    assert_eq!(s.counters().clean_owned_stored, 3);
    assert_eq!(s.owned_clean_pages(), 0);
    s.check_invariants();
}

#[test]
fn cached_and_owners_clean_pages_compete_by_age() {
    let mut s = store(3, u64::MAX);
    let h = s.open_session(1, 1, 1, 0).unwrap();
    // A cached page 8 s old, an owner's clean page that arrived 5 s ago, one 1 s ago.
    assert_eq!(put_clean(&mut s, h, 40, 8_000, 10_000), CachedStatus::Taken);
    assert_eq!(
        put_owned_at(&mut s, h, 0, 1, true, 5_000),
        PutStatus::Stored
    );
    assert_eq!(
        put_owned_at(&mut s, h, 1, 1, true, 9_000),
        PutStatus::Stored
    );
    // An owned page takes the cached page's frame (the oldest) ...
    assert_eq!(
        put_owned_at(&mut s, h, 2, 1, false, 10_000),
        PutStatus::Stored
    );
    assert_eq!(s.get_clean(h, 40, false, 10_000).unwrap(), None);
    // ... a cached page 3 s old takes the owner's page that came 5 s ago, not one 1 s ago.
    assert_eq!(
        put_clean(&mut s, h, 41, 3_000, 10_000),
        CachedStatus::Replaced
    );
    assert_eq!(owned_here(&mut s, h, 0), None);
    assert_eq!(owned_here(&mut s, h, 1), Some(1));
    // ... and one 4 s old is refused: every clean page here is younger.
    assert_eq!(
        put_clean(&mut s, h, 42, 4_000, 10_000),
        CachedStatus::Refused
    );
    // An epoch's summary sees both kinds (boosted as global pages').
    let mut ages: Vec<u64> = s.clean_ages(10_000).collect();
    ages.sort_unstable();
    assert_eq!(ages, vec![2_000, 6_000]);
    let c = s.counters();
    assert_eq!((c.clean_dropped_for_owned, c.clean_owned_dropped), (1, 1));
    s.check_invariants();
}

#[test]
fn a_shrinking_offer_drops_owners_clean_pages_and_moves_the_others() {
    let mut s = store(4, u64::MAX);
    let h = s.open_session(1, 1, 1, 0).unwrap();
    for p in 0..4 {
        assert_eq!(
            put_owned_at(&mut s, h, p, 1, p % 2 == 1, 0),
            PutStatus::Stored
        );
    }
    // Frames 2 and 3 leave the offer: page 3 (clean) is dropped, page 2 must move.
    s.set_offer(2);
    assert_eq!(s.counters().clean_owned_dropped_for_offer, 1);
    assert_eq!(s.pages_beyond_offer(), 1);
    assert_eq!(s.load(h, 0).leaving, 1);
    assert_eq!(owned_here(&mut s, h, 3), None);
    assert_eq!(owned_here(&mut s, h, 2), Some(1));
    s.check_invariants();
    // The page above moves into the frame that page 1 (clean) gives up when it is deleted.
    assert!(s.delete(h, PageKey::new(1, 1), 0).unwrap());
    assert_eq!(s.pages_beyond_offer(), 0);
    assert_eq!(owned_here(&mut s, h, 2), Some(1));
    s.check_invariants();
}

#[test]
fn the_age_queue_stays_bounded_by_what_it_holds() {
    let mut s = store(8, u64::MAX);
    let h = s.open_session(1, 1, 1, 0).unwrap();
    // One page written 10,000 times: one clean page, and a queue swept as it grows.
    for v in 1..=10_000u32 {
        assert_eq!(
            put_owned_at(&mut s, h, 0, v, true, u64::from(v)),
            PutStatus::Stored
        );
    }
    assert!(s.owned_clean.queue.len() <= 2 + 64 + 1);
    // Written again unflagged, it is no longer anyone's to drop.
    assert_eq!(
        put_owned_at(&mut s, h, 0, 10_001, false, 10_001),
        PutStatus::Stored
    );
    assert_eq!(s.owned_clean_pages(), 0);
    assert_eq!(s.load(h, 0).free_pages, 7);
    s.check_invariants();
}

#[test]
fn owners_clean_pages_are_outside_the_quota_and_cannot_be_turned_into_a_way_around_it() {
    let mut s = store(6, 2);
    let a = s.open_session_from(Peer::Node(1), 1, 1, 1, 0).unwrap();
    let b = s.open_session_from(Peer::Node(2), 2, 1, 1, 0).unwrap();
    // Two only copies fill a's quota; its clean pages still come, beyond it.
    assert_eq!(put_owned_at(&mut s, a, 0, 1, false, 0), PutStatus::Stored);
    assert_eq!(put_owned_at(&mut s, a, 1, 1, false, 0), PutStatus::Stored);
    assert_eq!(put_owned_at(&mut s, a, 2, 1, false, 0), PutStatus::Full);
    for p in 3..7 {
        assert_eq!(put_owned_at(&mut s, a, p, 1, true, p), PutStatus::Stored);
    }
    assert_eq!(s.free_pages(), 0);
    // The arena is full: a's next clean page takes its own oldest clean page's frame, and
    // b's only copies take the next ones.
    assert_eq!(put_owned_at(&mut s, a, 7, 1, true, 7), PutStatus::Stored);
    assert_eq!(owned_here(&mut s, a, 3), None);
    assert_eq!(s.load(b, 0).free_pages, 2);
    assert_eq!(put_owned_at(&mut s, b, 0, 1, false, 8), PutStatus::Stored);
    assert_eq!(owned_here(&mut s, a, 4), None);
    // A clean page written again as an only copy would take a's quota past its limit.
    assert_eq!(put_owned_at(&mut s, a, 5, 2, false, 9), PutStatus::Full);
    assert_eq!(owned_here(&mut s, a, 5), Some(1));
    assert_eq!(s.counters().puts_refused_quota, 2);
    s.check_invariants();
    // Ending a's session frees its clean pages and their accounting with them.
    s.close(a).unwrap();
    assert_eq!(s.owned_clean_pages(), 0);
    s.check_invariants();
}

/// An owner's page above a shrunk offer, written again as a clean page (in place), then moved
/// below the offer by compaction: it is still an owner's clean page in the age queue, and the
/// first to give way. (Found by the simulator, seed 554 under `mirror:3`: the queue named
/// pages by frame, and compaction moves pages between frames.)
#[test]
fn an_owners_clean_page_moved_by_compaction_keeps_its_place_in_the_age_queue() {
    let mut s = store(4, u64::MAX);
    let a = s.open_session(1, 1, 1, 0).unwrap();
    for p in 0..4 {
        assert_eq!(put_owned_at(&mut s, a, p, 1, false, 0), PutStatus::Stored);
    }
    s.set_offer(2);
    assert_eq!(s.pages_beyond_offer(), 2);
    assert_eq!(
        put_owned_at(&mut s, a, 3, 2, true, 1_000),
        PutStatus::Stored
    );
    assert_eq!(s.owned_clean_pages(), 1);
    assert!(s.delete(a, PageKey::new(1, 0), 0).unwrap());
    assert!(s.delete(a, PageKey::new(1, 1), 0).unwrap());
    s.compact(10);
    assert_eq!(s.pages_beyond_offer(), 0);
    s.check_invariants();
    // The offer is full (two frames, pages 2 and 3); another client's page takes the clean
    // page's frame, not page 2's, the only copy.
    let b = s.open_session(2, 1, 1, 0).unwrap();
    assert_eq!(
        put_owned_at(&mut s, b, 9, 1, false, 2_000),
        PutStatus::Stored
    );
    assert_eq!(owned_here(&mut s, a, 3), None);
    assert_eq!(owned_here(&mut s, a, 2), Some(1));
    assert_eq!(s.counters().clean_owned_dropped, 1);
    s.check_invariants();
}
