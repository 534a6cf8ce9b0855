//! A stream of frames from a hostile client, decoded and run against a small page store the
//! way the daemon runs them: nothing panics, and the store's invariants hold after every frame.
#![no_main]

use libfuzzer_sys::fuzz_target;
use netram_proto::{decode_request, frame_len, Request, PAGE_SIZE};
use netram_store::{Store, StoreConfig};

fuzz_target!(|data: &[u8]| {
    let mut store = Store::new(vec![0u8; 8 * PAGE_SIZE], StoreConfig { lease_period_ms: 10, max_sessions: 4 });
    let mut sessions = Vec::new();
    for i in 0..3 {
        sessions.push(store.open_session(i, 1, 1, 0).expect("room for three sessions"));
    }
    let mut rest = data;
    let mut now = 0u64;
    while let Ok(Some(len)) = frame_len(rest) {
        if len > rest.len() {
            break;
        }
        let (frame, tail) = rest.split_at(len);
        rest = tail;
        let Ok((id, req)) = decode_request(frame) else { break };
        let h = sessions[(id % 3) as usize];
        now += id % 7;
        match req {
            Request::Put(pages) => {
                for p in pages {
                    let _ = store.put(h, p.key, p.version, p.crc, p.flags, p.data, now);
                }
            }
            Request::Get(keys) => {
                for k in keys {
                    if let Ok(Some(p)) = store.get(h, k, now) {
                        assert!(p.data.len() == PAGE_SIZE || p.flags.is_zero());
                    }
                }
            }
            Request::Delete(keys) => {
                for k in keys {
                    let _ = store.delete(h, k, now);
                }
            }
            Request::Refresh => {
                let _ = store.refresh(h, now);
            }
            Request::Stats => {
                store.expire(now);
            }
            Request::Close => {
                let _ = store.close(h);
            }
        }
        store.check_invariants();
    }
});
