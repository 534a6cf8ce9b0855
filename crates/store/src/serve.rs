//! One request against the store, one reply appended: the server's whole protocol logic, with
//! no socket, so that `netram serve`, the pager's tests and the simulator run the same code
//! (Anemone §2.1's server module; Nswap §III's swap-out, swap-in and garbage collection).

use crate::{SessionHandle, Store};
use netram_proto::{
    begin_get_reply, get_reply_found, get_reply_missing, Counter, DeleteStatus, ErrorCode, Load,
    PutStatus, Reply, Request,
};

/// What became of the session after a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The connection carries on.
    Open,
    /// The client closed its session: reply, then close the connection.
    Closed,
}

/// Runs one request from the session `h` and appends its reply (if it has one) to `out`.
/// `rps` is the request rate piggy-backed on the reply; `stats` lists the counters a STATS
/// request returns (the daemon adds its own to the store's).
#[allow(clippy::too_many_arguments)]
pub fn handle_request<A: AsRef<[u8]> + AsMut<[u8]>>(
    store: &mut Store<A>,
    h: SessionHandle,
    id: u64,
    req: Request<'_>,
    now_ms: u64,
    rps: u32,
    out: &mut Vec<u8>,
    stats: impl FnOnce(&Store<A>) -> Vec<(&'static str, u64)>,
) -> Outcome {
    let load = |s: &Store<A>| Load {
        free_pages: s.free_pages(),
        requests_per_s: rps,
    };
    let expired = |s: &Store<A>, out: &mut Vec<u8>| {
        Reply::Error {
            load: load(s),
            code: ErrorCode::SessionExpired,
            message: "the session's lease ran out; its pages were freed",
        }
        .encode(id, out);
    };
    match req {
        Request::Put(pages) => {
            let mut status = Vec::with_capacity(pages.len());
            for p in &pages {
                match store.put(h, p.key, p.version, p.crc, p.flags, p.data, now_ms) {
                    Ok(s) => status.push(s),
                    Err(_) => {
                        expired(store, out);
                        return Outcome::Open;
                    }
                }
            }
            debug_assert!(status
                .iter()
                .all(|s| matches!(s, PutStatus::Stored | PutStatus::Full | PutStatus::BadKey)));
            Reply::Put {
                load: load(store),
                status,
            }
            .encode(id, out);
        }
        Request::Get(keys) => {
            if store.refresh(h, now_ms).is_err() {
                expired(store, out);
                return Outcome::Open;
            }
            let l = load(store);
            let mut w = begin_get_reply(out, id, l, keys.len());
            for k in keys {
                match store.get(h, k, now_ms) {
                    Ok(Some(p)) => get_reply_found(&mut w, &p.envelope(k)),
                    _ => get_reply_missing(&mut w, k),
                }
            }
            w.finish();
        }
        Request::Delete(keys) => {
            let mut status = Vec::with_capacity(keys.len());
            for k in keys {
                match store.delete(h, k, now_ms) {
                    Ok(true) => status.push(DeleteStatus::Deleted),
                    Ok(false) => status.push(DeleteStatus::Missing),
                    Err(_) => {
                        expired(store, out);
                        return Outcome::Open;
                    }
                }
            }
            Reply::Delete {
                load: load(store),
                status,
            }
            .encode(id, out);
        }
        // One-way: an idle client does not read, so a reply would pile up in its socket.
        Request::Refresh => {
            let _ = store.refresh(h, now_ms);
        }
        Request::Stats => {
            let counters = stats(store)
                .into_iter()
                .map(|(name, value)| Counter { name, value })
                .collect();
            Reply::Stats {
                load: load(store),
                counters,
            }
            .encode(id, out);
        }
        Request::Close => {
            let _ = store.close(h);
            Reply::Close { load: load(store) }.encode(id, out);
            return Outcome::Closed;
        }
    }
    Outcome::Open
}

/// The gauges every STATS reply opens with, then the store's counters.
pub fn store_stats<A: AsRef<[u8]> + AsMut<[u8]>>(store: &Store<A>) -> Vec<(&'static str, u64)> {
    let mut out = vec![
        ("capacity_pages", store.capacity_pages()),
        ("free_pages", store.free_pages()),
        ("stored_pages", store.stored_pages()),
        ("live_sessions", store.live_sessions() as u64),
        ("meta_bytes", store.meta_bytes() as u64),
    ];
    out.extend(store.counters().iter());
    out
}
