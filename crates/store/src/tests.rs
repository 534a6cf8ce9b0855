//! The store against a model (a map per session, a capacity, leases), plus the edge cases one
//! by one: full stores, expiry, supersession, bounded session tables, key limits, zero pages.

use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

fn store(frames: usize) -> Store<Vec<u8>> {
    Store::new(
        vec![0u8; frames * PAGE_SIZE],
        StoreConfig {
            lease_period_ms: 100,
            max_sessions: 8,
            ..StoreConfig::default()
        },
    )
}

fn page(b: u8) -> Vec<u8> {
    vec![b; PAGE_SIZE]
}

/// The checksum a client seals a page with: the store refuses a page that does not match it.
fn crc(key: PageKey, version: u32, data: &[u8]) -> u32 {
    netram_proto::page_checksum(key, version, PageFlags::default(), data)
}

fn put(s: &mut Store<Vec<u8>>, h: SessionHandle, p: u64, b: u8) -> PutStatus {
    let (key, version) = (PageKey::new(1, p), u32::from(b));
    let c = crc(key, version, &page(b));
    s.put(h, key, version, c, PageFlags::default(), &page(b), 0)
        .unwrap()
}

#[test]
fn full_store_refuses_and_overwrite_still_works() {
    let mut s = store(2);
    let h = s.open_session(1, 1, 1, 0).unwrap();
    assert_eq!(put(&mut s, h, 0, 1), PutStatus::Stored);
    assert_eq!(put(&mut s, h, 1, 2), PutStatus::Stored);
    assert_eq!(put(&mut s, h, 2, 3), PutStatus::Full);
    assert_eq!(s.counters().puts_refused_full, 1);
    // An overwrite needs no new frame.
    assert_eq!(put(&mut s, h, 1, 9), PutStatus::Stored);
    assert_eq!(
        s.get(h, PageKey::new(1, 1), 0).unwrap().unwrap().data,
        &page(9)[..]
    );
    assert!(s.delete(h, PageKey::new(1, 0), 0).unwrap());
    assert_eq!(put(&mut s, h, 2, 3), PutStatus::Stored);
    s.check_invariants();
}

#[test]
fn sessions_do_not_see_each_others_pages() {
    let mut s = store(4);
    let a = s.open_session(1, 1, 1, 0).unwrap();
    let b = s.open_session(2, 1, 1, 0).unwrap();
    put(&mut s, a, 0, 1);
    assert!(s.get(b, PageKey::new(1, 0), 0).unwrap().is_none());
    put(&mut s, b, 0, 2);
    assert_eq!(s.get(a, PageKey::new(1, 0), 0).unwrap().unwrap().data[0], 1);
    assert_eq!(s.get(b, PageKey::new(1, 0), 0).unwrap().unwrap().data[0], 2);
    s.check_invariants();
}

#[test]
fn lease_expires_after_three_silent_periods() {
    let mut s = store(4);
    let a = s.open_session(1, 1, 1, 0).unwrap();
    let b = s.open_session(2, 1, 1, 0).unwrap();
    put(&mut s, a, 0, 1);
    put(&mut s, b, 0, 1);
    s.refresh(b, 250).unwrap();
    assert_eq!(s.expire(300), 0, "exactly three periods is not yet expired");
    assert_eq!(s.expire(301), 1);
    assert_eq!(s.stored_pages(), 1);
    assert_eq!(
        s.get(a, PageKey::new(1, 0), 301).err(),
        Some(StoreError::SessionExpired)
    );
    assert_eq!(s.counters().sessions_expired, 1);
    assert_eq!(s.counters().pages_freed_with_session, 1);
    // The slot is reused; the stale handle still does not reach the new session.
    let c = s.open_session(3, 1, 1, 301).unwrap();
    put(&mut s, c, 5, 5);
    assert!(s.get(a, PageKey::new(1, 5), 301).is_err());
    s.check_invariants();
}

#[test]
fn newer_incarnation_frees_the_old_and_refuses_zombies() {
    let mut s = store(4);
    let old = s.open_session(7, 1, 1, 0).unwrap();
    put(&mut s, old, 0, 1);
    put(&mut s, old, 1, 1);
    let new = s.open_session(7, 2, 1, 0).unwrap();
    assert_eq!(s.stored_pages(), 0);
    assert_eq!(s.counters().sessions_superseded, 1);
    assert!(s.get(old, PageKey::new(1, 0), 0).is_err());
    assert!(matches!(
        s.open_session(7, 1, 1, 0),
        Err(StoreError::StaleIncarnation { newest: 2, .. })
    ));
    put(&mut s, new, 0, 3);
    s.check_invariants();
}

#[test]
fn reconnect_resumes_the_session() {
    let mut s = store(4);
    let a = s.open_session(1, 1, 1, 0).unwrap();
    put(&mut s, a, 0, 4);
    let again = s.open_session(1, 1, 1, 10).unwrap();
    assert_eq!(a, again);
    assert_eq!(
        s.get(again, PageKey::new(1, 0), 10).unwrap().unwrap().data[0],
        4
    );
}

#[test]
fn session_table_is_bounded() {
    let mut s = store(1);
    for n in 0..8 {
        s.open_session(n, 1, 1, 0).unwrap();
    }
    assert_eq!(
        s.open_session(99, 1, 1, 0),
        Err(StoreError::TooManySessions(8))
    );
}

#[test]
fn keys_beyond_the_index_are_refused() {
    let mut s = store(1);
    let h = s.open_session(1, 1, 1, 0).unwrap();
    let d = page(1);
    let f = PageFlags::default();
    let bad = PageKey::new(REGION_MAX + 1, 0);
    assert_eq!(s.put(h, bad, 1, 0, f, &d, 0).unwrap(), PutStatus::BadKey);
    let bad = PageKey::new(0, PAGE_NUMBER_MAX + 1);
    assert_eq!(s.put(h, bad, 1, 0, f, &d, 0).unwrap(), PutStatus::BadKey);
    let edge = PageKey::new(REGION_MAX, PAGE_NUMBER_MAX);
    let c = crc(edge, 1, &d);
    assert_eq!(s.put(h, edge, 1, c, f, &d, 0).unwrap(), PutStatus::Stored);
    assert!(s.get(h, edge, 0).unwrap().is_some());
}

#[test]
fn a_page_damaged_on_the_way_is_refused_and_nothing_changes() {
    let mut s = store(4);
    let h = s.open_session(1, 1, 1, 0).unwrap();
    assert_eq!(put(&mut s, h, 0, 1), PutStatus::Stored);
    let key = PageKey::new(1, 0);
    let mut damaged = page(2);
    let c = crc(key, 2, &damaged);
    damaged[100] ^= 0x10;
    let st = s.put(h, key, 2, c, PageFlags::default(), &damaged, 0);
    assert_eq!(st.unwrap(), PutStatus::Corrupt);
    assert_eq!(s.counters().puts_refused_corrupt, 1);
    // The old version stays, whole; a new page is not stored at all.
    let p = s.get(h, key, 0).unwrap().unwrap();
    assert_eq!((p.version, p.data), (1, &page(1)[..]));
    let st = s.put(
        h,
        PageKey::new(1, 1),
        1,
        c,
        PageFlags::default(),
        &damaged,
        0,
    );
    assert_eq!(st.unwrap(), PutStatus::Corrupt);
    assert_eq!(s.stored_pages(), 1);
    s.check_invariants();
}

#[test]
fn zero_pages_come_back_without_data() {
    let mut s = store(1);
    let h = s.open_session(1, 1, 1, 0).unwrap();
    let z = PageFlags(PageFlags::ZERO);
    let c = netram_proto::page_checksum(PageKey::new(0, 0), 1, z, &[]);
    s.put(h, PageKey::new(0, 0), 1, c, z, &[], 0).unwrap();
    let p = s.get(h, PageKey::new(0, 0), 0).unwrap().unwrap();
    assert!(p.flags.is_zero() && p.data.is_empty() && p.crc == c);
}

#[test]
fn metadata_stays_under_32_bytes_per_page_when_full() {
    assert_eq!(std::mem::size_of::<FrameMeta>(), 20);
    for frames in [1000, 4096, 100_000, 262_144] {
        let mut s = Store::new(vec![0u8; frames * PAGE_SIZE], StoreConfig::default());
        let h = s.open_session(1, 1, 1, 0).unwrap();
        let d = page(1);
        for p in 0..frames as u64 {
            let key = PageKey::new(0, p);
            let st = s
                .put(h, key, 1, crc(key, 1, &d), PageFlags::default(), &d, 0)
                .unwrap();
            assert_eq!(st, PutStatus::Stored);
        }
        let per_page = s.meta_bytes() as f64 / frames as f64;
        assert!(
            per_page <= 32.0,
            "{frames} frames: {per_page} bytes of metadata per page"
        );
    }
}

#[derive(Debug, Clone)]
enum Op {
    Put(u8, u64, u8),
    Get(u8, u64),
    Delete(u8, u64),
    Close(u8),
    Tick(u64),
    /// A clean page (GMS): session, uid, age in ms, contents.
    PutClean(u8, u128, u64, u8),
    /// Session, uid, take.
    GetClean(u8, u128, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 0u64..12, any::<u8>()).prop_map(|(s, p, b)| Op::Put(s, p, b)),
        3 => (0u8..3, 0u64..12).prop_map(|(s, p)| Op::Get(s, p)),
        2 => (0u8..3, 0u64..12).prop_map(|(s, p)| Op::Delete(s, p)),
        1 => (0u8..3).prop_map(Op::Close),
        1 => (0u64..200).prop_map(Op::Tick),
        3 => (0u8..3, 0u128..10, 0u64..3_000, any::<u8>()).prop_map(|(s, u, a, b)| Op::PutClean(s, u, a, b)),
        2 => (0u8..3, 0u128..10, any::<bool>()).prop_map(|(s, u, t)| Op::GetClean(s, u, t)),
    ]
}

proptest! {
    /// The store against a model: a map per session, a capacity, leases.
    #[test]
    fn store_matches_model(ops in prop::collection::vec(op(), 1..200)) {
        let cap = 8usize;
        let mut s = store(cap);
        let mut now = 0u64;
        let mut handles: Vec<Option<SessionHandle>> = vec![None; 3];
        let mut model: Vec<HashMap<u64, u8>> = vec![HashMap::new(); 3];
        let mut last: Vec<u64> = vec![0; 3];
        // Clean pages: uid -> (contents, last use). They outlive sessions.
        let mut clean: HashMap<u128, (u8, u64)> = HashMap::new();
        let oldest_clean = |clean: &HashMap<u128, (u8, u64)>| {
            clean.iter().map(|(&u, &(_, t))| (t, u)).min()
        };
        for op in ops {
            match op {
                // The first operation of a session opens it.
                Op::Put(i, ..) | Op::Get(i, _) | Op::Delete(i, _) | Op::PutClean(i, ..) | Op::GetClean(i, ..)
                    if handles[i as usize].is_none() => {
                    handles[i as usize] = Some(s.open_session(u64::from(i), 1, 1, now).unwrap());
                    last[i as usize] = now;
                }
                Op::Put(i, p, b) => {
                    let h = handles[i as usize].unwrap();
                    let total: usize = model.iter().map(|m| m.len()).sum();
                    let st = put_at(&mut s, h, p, b, now);
                    let m = &mut model[i as usize];
                    if m.contains_key(&p) || total + clean.len() < cap {
                        prop_assert_eq!(st, PutStatus::Stored);
                        m.insert(p, b);
                    } else if let Some((_, victim)) = oldest_clean(&clean) {
                        // An owned page takes the oldest clean page's frame.
                        prop_assert_eq!(st, PutStatus::Stored);
                        clean.remove(&victim);
                        m.insert(p, b);
                    } else {
                        prop_assert_eq!(st, PutStatus::Full);
                    }
                    last[i as usize] = now;
                }
                Op::Get(i, p) => {
                    let h = handles[i as usize].unwrap();
                    let got = s.get(h, PageKey::new(1, p), now).unwrap().map(|g| g.data.first().copied().unwrap_or(0));
                    prop_assert_eq!(got, model[i as usize].get(&p).copied());
                    last[i as usize] = now;
                }
                Op::Delete(i, p) => {
                    let h = handles[i as usize].unwrap();
                    let d = s.delete(h, PageKey::new(1, p), now).unwrap();
                    prop_assert_eq!(d, model[i as usize].remove(&p).is_some());
                    last[i as usize] = now;
                }
                Op::PutClean(i, uid, age, b) => {
                    let h = handles[i as usize].unwrap();
                    let data = page(b);
                    let c = netram_proto::gms::cached_checksum(uid, PageFlags::default(), &data);
                    let st = s.put_clean(h, uid, age as u32, c, PageFlags::default(), &data, now).unwrap();
                    let owned: usize = model.iter().map(|m| m.len()).sum();
                    let t = now.saturating_sub(age);
                    use netram_proto::gms::CachedStatus;
                    if clean.contains_key(&uid) {
                        prop_assert_eq!(st, CachedStatus::Present);
                    } else if owned + clean.len() < cap {
                        prop_assert_eq!(st, CachedStatus::Taken);
                        clean.insert(uid, (b, t));
                    } else {
                        match oldest_clean(&clean) {
                            Some((vt, victim)) if (now - vt) * 2 >= age * 2 => {
                                prop_assert_eq!(st, CachedStatus::Replaced);
                                clean.remove(&victim);
                                clean.insert(uid, (b, t));
                            }
                            _ => prop_assert_eq!(st, CachedStatus::Refused),
                        }
                    }
                    last[i as usize] = now;
                }
                Op::GetClean(i, uid, take) => {
                    let h = handles[i as usize].unwrap();
                    let got = s.get_clean(h, uid, take, now).unwrap().map(|g| g.data[0]);
                    prop_assert_eq!(got, clean.get(&uid).map(|&(b, _)| b));
                    if take {
                        clean.remove(&uid);
                    } else if let Some(e) = clean.get_mut(&uid) {
                        e.1 = e.1.max(now);
                    }
                    last[i as usize] = now;
                }
                Op::Close(i) => {
                    if let Some(h) = handles[i as usize].take() {
                        s.close(h).unwrap();
                        model[i as usize].clear();
                    }
                }
                Op::Tick(dt) => {
                    now += dt;
                    s.expire(now);
                    for i in 0..3 {
                        if handles[i].is_some() && now - last[i] > 300 {
                            handles[i] = None;
                            model[i].clear();
                        }
                    }
                }
            }
            s.check_invariants();
            prop_assert_eq!(
                s.stored_pages() as usize,
                model.iter().map(|m| m.len()).sum::<usize>() + clean.len()
            );
        }
    }
}

fn put_at(s: &mut Store<Vec<u8>>, h: SessionHandle, p: u64, b: u8, now: u64) -> PutStatus {
    let key = PageKey::new(1, p);
    let c = crc(key, 1, &page(b));
    s.put(h, key, 1, c, PageFlags::default(), &page(b), now)
        .unwrap()
}

/// A page that comes without its zero tail is stored whole (a frame a page, overwriting what
/// the frame held) and goes back without it; the checksum its owner computed holds either way.
/// A page longer than a page, or a zero page with data, is refused as corrupt.
#[test]
fn a_page_without_its_zero_tail_is_stored_whole_and_returned_trimmed() {
    let mut s = store(2);
    let h = s.open_session(1, 1, 1, 0).unwrap();
    let key = PageKey::new(1, 0);
    // The frame first holds a full page, so that its old tail would show if not cleared.
    assert_eq!(put(&mut s, h, 0, 7), PutStatus::Stored);
    let mut data = vec![0u8; PAGE_SIZE];
    data[..300].fill(5);
    let p = Page::seal(key, 8, &data);
    assert_eq!(p.data.len(), 300);
    assert_eq!(
        s.put(h, key, 8, p.crc, p.flags, p.data, 0).unwrap(),
        PutStatus::Stored
    );
    let got = s.get(h, key, 0).unwrap().unwrap();
    assert_eq!(got.data, &data[..300]);
    assert!(got.envelope(key).verify());
    // The same page sent whole is the same page.
    assert_eq!(
        s.put(
            h,
            key,
            9,
            crc(key, 9, &data),
            PageFlags::default(),
            &data,
            0
        )
        .unwrap(),
        PutStatus::Stored
    );
    assert_eq!(s.get(h, key, 0).unwrap().unwrap().data, &data[..300]);
    let long = vec![5u8; PAGE_SIZE + 1];
    let c = crc(key, 10, &long);
    assert_eq!(
        s.put(h, key, 10, c, PageFlags::default(), &long, 0)
            .unwrap(),
        PutStatus::Corrupt
    );
    let z = PageFlags(PageFlags::ZERO);
    let c = netram_proto::page_checksum(key, 10, z, &data[..300]);
    assert_eq!(
        s.put(h, key, 10, c, z, &data[..300], 0).unwrap(),
        PutStatus::Corrupt
    );
    assert_eq!(s.counters().puts_refused_corrupt, 2);
    s.check_invariants();
}
