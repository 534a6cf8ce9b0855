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
    // The quota of two frames: the third page from the same client is refused, another
    // client's is taken.
    assert_eq!(put_clean(&mut s, a, 4, 0, 0), CachedStatus::Taken);
    assert_eq!(put_clean(&mut s, a, 5, 0, 0), CachedStatus::Refused);
    let b = s.open_session_from(Peer::Node(2), 2, 1, 1, 0).unwrap();
    assert_eq!(put_clean(&mut s, b, 5, 0, 0), CachedStatus::Taken);
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
