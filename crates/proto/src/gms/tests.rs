//! GMS messages: every one round-trips, decoded messages re-encode to the same bytes, a
//! checksum catches a page under another uid, and lying counts or orders are refused.

use super::*;
use proptest::prelude::*;

fn arb_summary() -> impl Strategy<Value = Summary> {
    (
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        proptest::collection::btree_map(any::<u8>(), 1u32.., 0..20),
    )
        .prop_map(|(free, evicted, discarded, m)| Summary {
            free,
            evicted,
            discarded,
            buckets: m.into_iter().rev().collect(),
        })
}

fn arb_epoch() -> impl Strategy<Value = Epoch> {
    prop_oneof![
        any::<u64>().prop_map(|epoch| Epoch::RequestSummary { epoch }),
        (any::<u64>(), arb_summary())
            .prop_map(|(epoch, summary)| Epoch::Summary { epoch, summary }),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec((any::<u64>(), any::<u32>()), 0..40)
        )
            .prop_map(|(epoch, initiator, m, min_age_ms, duration_ms, weights)| {
                Epoch::Plan(Plan {
                    epoch,
                    initiator,
                    m,
                    min_age_ms,
                    duration_ms,
                    weights,
                })
            }),
        any::<u64>().prop_map(|epoch| Epoch::Stale { epoch }),
    ]
}

proptest! {
    #[test]
    fn epoch_messages_round_trip(e in arb_epoch(), id in any::<u64>()) {
        let req = Request::Epoch(e);
        let mut buf = Vec::new();
        req.encode(id, &mut buf);
        let (got_id, got) = decode_request(&buf).unwrap();
        prop_assert_eq!(got_id, id);
        prop_assert_eq!(got, req);
    }

    #[test]
    fn clean_pages_round_trip(
        pages in proptest::collection::vec((any::<u128>(), any::<u32>(), any::<u8>(), any::<bool>()), 0..6),
        take in any::<bool>(),
    ) {
        let datas: Vec<Vec<u8>> = pages
            .iter()
            .map(|&(_, _, fill, zero)| vec![if zero { 0 } else { fill | 1 }; PAGE_SIZE])
            .collect();
        let sealed: Vec<CachedPage> = pages
            .iter()
            .zip(&datas)
            .map(|(&(uid, age, _, _), d)| CachedPage::seal(uid, age, d))
            .collect();
        prop_assert!(sealed.iter().all(CachedPage::verify));
        let req = Request::PutCached(sealed.clone());
        let mut buf = Vec::new();
        req.encode(7, &mut buf);
        prop_assert_eq!(decode_request(&buf).unwrap(), (7, req));

        let uids: Vec<u128> = pages.iter().map(|p| p.0).collect();
        let get = Request::GetCached { take, uids };
        let mut buf = Vec::new();
        get.encode(8, &mut buf);
        prop_assert_eq!(decode_request(&buf).unwrap(), (8, get));

        let load = Load { free_pages: 3, requests_per_s: 4, leaving: 0 };
        let reply = Reply::GetCached {
            load,
            pages: sealed.iter().enumerate().map(|(i, p)| (i % 2 == 0).then_some(*p)).collect(),
        };
        let mut buf = Vec::new();
        reply.encode(9, &mut buf);
        prop_assert_eq!(decode_reply(&buf).unwrap(), (9, reply));
        let status = Reply::PutCached {
            load,
            status: (0..pages.len()).map(|i| CachedStatus::from_u8((i % 5) as u8).unwrap()).collect(),
        };
        let mut buf = Vec::new();
        status.encode(10, &mut buf);
        prop_assert_eq!(decode_reply(&buf).unwrap(), (10, status));
    }

    #[test]
    fn directory_updates_round_trip(
        reset in any::<bool>(),
        add in proptest::collection::vec(any::<u128>(), 0..=crate::MAX_BATCH),
        remove in proptest::collection::vec(any::<u128>(), 0..=crate::MAX_BATCH),
        taken in any::<u32>(),
        held in any::<u32>(),
    ) {
        let elsewhere: Vec<bool> = remove.iter().map(|u| u % 3 == 0).collect();
        let req = Request::GcdUpdate { reset, add, remove };
        let mut buf = Vec::new();
        req.encode(11, &mut buf);
        prop_assert_eq!(decode_request(&buf).unwrap(), (11, req));
        let load = Load { free_pages: 1, requests_per_s: 2, leaving: 0 };
        let reply = Reply::GcdUpdate { load, taken, held, elsewhere };
        let mut buf = Vec::new();
        reply.encode(12, &mut buf);
        prop_assert_eq!(decode_reply(&buf).unwrap(), (12, reply));
    }

    /// Whatever bytes arrive: a value or an error, never a panic; a request accepted
    /// re-encodes to exactly the bytes received.
    #[test]
    fn any_bytes_decode_or_are_refused(body in proptest::collection::vec(any::<u8>(), 0..300), kind in 0x0eu8..0x12) {
        let mut buf = Vec::new();
        let mut w = FrameBuilder::begin(&mut buf, kind, 1);
        w.bytes(&body);
        w.finish();
        if let Ok((id, req)) = decode_request(&buf) {
            let mut again = Vec::new();
            req.encode(id, &mut again);
            prop_assert_eq!(again, buf.clone());
        }
        let _ = decode_reply(&buf);
    }
}

#[test]
fn a_page_under_another_uid_or_damaged_fails_its_checksum() {
    let data = vec![5u8; PAGE_SIZE];
    let p = CachedPage::seal(42, 10, &data);
    assert!(p.verify());
    assert!(!CachedPage { uid: 43, ..p }.verify());
    let mut bad = data.clone();
    bad[9] ^= 0x10;
    assert!(!CachedPage { data: &bad, ..p }.verify());
    // The age is advice, not covered: a holder reports its own.
    assert!(CachedPage { age_ms: 99, ..p }.verify());
    let zero = vec![0u8; PAGE_SIZE];
    let z = CachedPage::seal(1, 0, &zero);
    assert!(z.flags.is_zero() && z.data.is_empty() && z.verify());
}

fn frame(kind: Kind, body: &[u8]) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut w = FrameBuilder::begin(&mut buf, kind as u8, 1);
    w.bytes(body);
    w.finish();
    buf
}

#[test]
fn lying_counts_orders_and_values_are_refused() {
    // A summary whose buckets go up, or carry a zero count, or announce more than it holds.
    let mut body = vec![1u8];
    body.extend_from_slice(&1u64.to_le_bytes());
    body.extend_from_slice(&[0; 12]);
    let mut up = body.clone();
    up.push(2);
    up.extend_from_slice(&[3, 1, 0, 0, 0, 4, 1, 0, 0, 0]);
    assert_eq!(
        decode_request(&frame(Kind::GmsEpoch, &up)),
        Err(DecodeError::BadValue {
            field: "summary bucket order",
            value: 4
        })
    );
    let mut zero = body.clone();
    zero.push(1);
    zero.extend_from_slice(&[3, 0, 0, 0, 0]);
    assert!(matches!(
        decode_request(&frame(Kind::GmsEpoch, &zero)),
        Err(DecodeError::BadValue { .. })
    ));
    let mut many = body.clone();
    many.push(200);
    assert!(matches!(
        decode_request(&frame(Kind::GmsEpoch, &many)),
        Err(DecodeError::BatchTooLarge { .. })
    ));
    // A plan announcing more weights than the limit.
    let mut plan = vec![2u8];
    plan.extend_from_slice(&[0; 36]);
    plan.extend_from_slice(&2000u16.to_le_bytes());
    assert!(matches!(
        decode_request(&frame(Kind::GmsEpoch, &plan)),
        Err(DecodeError::BatchTooLarge { .. })
    ));
    // An unknown epoch tag, a `take` that is not 0 or 1, unknown page flags.
    assert!(decode_request(&frame(Kind::GmsEpoch, &[9])).is_err());
    assert!(decode_request(&frame(Kind::GetCached, &[2, 0, 0, 0, 0])).is_err());
    // A directory update whose reset is not 0 or 1, or that announces more uids than the
    // limit or than it carries.
    assert!(decode_request(&frame(Kind::GcdUpdate, &[2, 0, 0, 0, 0, 0, 0, 0, 0])).is_err());
    let mut many = vec![0u8];
    many.extend_from_slice(&(crate::MAX_BATCH as u32 + 1).to_le_bytes());
    many.extend(std::iter::repeat_n(0u8, 16 * (crate::MAX_BATCH + 1) + 4));
    assert!(matches!(
        decode_request(&frame(Kind::GcdUpdate, &many)),
        Err(DecodeError::BatchTooLarge { .. })
    ));
    let mut short = vec![0u8];
    short.extend_from_slice(&3u32.to_le_bytes());
    short.extend_from_slice(&[0; 32]);
    assert!(decode_request(&frame(Kind::GcdUpdate, &short)).is_err());
    let mut flags = 1u32.to_le_bytes().to_vec();
    flags.extend_from_slice(&[0; 24]);
    flags.extend_from_slice(&0x8000u16.to_le_bytes());
    flags.extend_from_slice(&[0, 0]);
    assert!(matches!(
        decode_request(&frame(Kind::PutCached, &flags)),
        Err(DecodeError::Reserved { .. })
    ));
    // The owned-page decoder refuses them (the daemon falls back to this module's).
    assert_eq!(
        crate::decode_request(&frame(Kind::GmsEpoch, &[3, 0, 0, 0, 0, 0, 0, 0, 0])),
        Err(DecodeError::UnknownKind(Kind::GmsEpoch as u8))
    );
}
