//! A stream of frames from a hostile client, decoded and run against a small page store the
//! way the daemon runs them (`netram_store::serve`): nothing panics, and the store's invariants
//! hold after every frame. Requests that wait for parity holders have their deltas delivered to
//! the same store (which holds groups too) or lost, as the request id decides.
#![no_main]

use libfuzzer_sys::fuzz_target;
use netram_proto::{decode_request, frame_len, DeltaStatus, PAGE_SIZE};
use netram_store::serve::{finish_forward, handle_request, store_stats, DeltaOutcome, Outcome};
use netram_store::{Store, StoreConfig};

fuzz_target!(|data: &[u8]| {
    let mut store = Store::new(vec![0u8; 8 * PAGE_SIZE], StoreConfig { lease_period_ms: 10, max_sessions: 4 });
    let mut sessions = Vec::new();
    for i in 0..3 {
        sessions.push(store.open_session(i, 1, 1, 0).expect("room for three sessions"));
    }
    let mut rest = data;
    let mut now = 0u64;
    let mut out = Vec::new();
    while let Ok(Some(len)) = frame_len(rest) {
        if len > rest.len() {
            break;
        }
        let (frame, tail) = rest.split_at(len);
        rest = tail;
        let Ok((id, req)) = decode_request(frame) else { break };
        let h = sessions[(id % 3) as usize];
        now += id % 7;
        out.clear();
        if let Outcome::Forward(fwd) = handle_request(&mut store, h, id, req, now, 0, &mut out, store_stats) {
            let outcomes: Vec<DeltaOutcome> = fwd
                .deltas
                .iter()
                .enumerate()
                .map(|(i, (_, d))| {
                    if (id >> (i % 64)) & 1 == 1 {
                        return DeltaOutcome::Unreachable;
                    }
                    match store.apply_delta(&d.as_delta()) {
                        DeltaStatus::Applied => DeltaOutcome::Applied,
                        _ => DeltaOutcome::UnknownGroup,
                    }
                })
                .collect();
            finish_forward(&mut store, h, fwd, &outcomes, now, 0, &mut out);
        }
        if id % 11 == 0 {
            store.expire(now);
        }
        store.check_invariants();
    }
});
