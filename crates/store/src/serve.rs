//! One request against the store, one reply appended: the server's whole protocol logic, with
//! no socket, so that `netram serve`, the pager's tests and the simulator run the same code
//! (Anemone §2.1's server module; Nswap §III's swap-out, swap-in and garbage collection).
//!
//! Under dynamic parity (Nswap §IV-B, Fig. 4) an overwrite or a delete of a member page must
//! reach its group's holder before it happens here. Such a request comes back as
//! [`Outcome::Forward`]: the caller (the daemon, the simulator) sends the deltas, with no lock
//! held, then hands the holders' answers to [`finish_forward`], which changes the store and
//! writes the reply. Nothing changes before the holders have answered, so a holder that cannot
//! be reached leaves the page as it was, and the client is told.

use crate::{DeltaFrom, ParityTag, SessionHandle, Store};
use netram_proto::{
    begin_get_reply, get_reply_data, get_reply_found, get_reply_missing, Counter, DeleteStatus,
    Delta, DeltaKind, ErrorCode, Load, MoveStatus, OwnedRecord, Owner, PageFlags, PageKey,
    ParityOp, PutStatus, Record, Reply, Request, MAX_BATCH,
};
use std::net::SocketAddr;

/// Bytes of groups a PARITY_SCAN reply carries at most: a frame less its header, the load and
/// the two counts (with room to spare).
const SCAN_REPLY_MAX: usize = netram_proto::MAX_FRAME_LEN - 256;

/// What became of the session after a request.
#[derive(Debug)]
pub enum Outcome {
    /// The connection carries on.
    Open,
    /// The client closed its session: reply, then close the connection.
    Closed,
    /// No reply yet: the deltas must reach their holders first.
    Forward(Forward),
    /// No reply yet: the pages must be handed to their new server first (MIGRATE).
    Handover(Handover),
}

/// A MIGRATE waiting for the new server: `pages` go to `to`, named as `owner`'s (ADOPT); the
/// statuses that come back, in the same order, go to [`finish_handover`].
#[derive(Debug)]
pub struct Handover {
    id: u64,
    pub to: Holder,
    pub owner: Owner,
    pub pages: Vec<OwnedPage>,
    /// Every key asked for, with its page's index in `pages`, or why it is not there.
    keys: Vec<Result<usize, MoveStatus>>,
}

/// A stored page copied out of the store, to send while no lock is held.
#[derive(Debug, Clone)]
pub struct OwnedPage {
    pub key: PageKey,
    pub version: u32,
    pub crc: u32,
    pub flags: PageFlags,
    pub data: Vec<u8>,
}

impl OwnedPage {
    pub fn as_page(&self) -> netram_proto::Page<'_> {
        netram_proto::Page {
            key: self.key,
            version: self.version,
            crc: self.crc,
            flags: self.flags,
            tag: [0; netram_proto::TAG_LEN],
            data: &self.data,
        }
    }
}

/// Where a delta goes: the holder's address, and the node id the server there must prove to
/// be (as the page's owner named it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Holder {
    pub addr: SocketAddr,
    pub node: u64,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (node {})", self.addr, self.node)
    }
}

/// A request waiting for parity holders. `deltas` go out, each to its holder; their outcomes,
/// in the same order, go to [`finish_forward`].
#[derive(Debug)]
pub struct Forward {
    id: u64,
    pub deltas: Vec<(Holder, OwnedDelta)>,
    pending: Pending,
}

/// A delta that outlives the request it came from.
#[derive(Debug, Clone)]
pub struct OwnedDelta {
    pub owner: Owner,
    pub group: u64,
    pub member: SocketAddr,
    pub key: PageKey,
    pub from: u32,
    pub to: u32,
    pub kind: DeltaKind,
    pub record: OwnedRecord,
}

impl OwnedDelta {
    pub fn as_delta(&self) -> Delta<'_> {
        Delta {
            owner: self.owner,
            group: self.group,
            member: self.member,
            key: self.key,
            from: self.from,
            to: self.to,
            kind: self.kind,
            record: self.record.as_record(),
        }
    }
}

/// What a holder made of a delta.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaOutcome {
    Applied,
    /// The holder has no such group, or its parity covers another version of the page (it is
    /// damaged): there is nothing to keep consistent, the page leaves the group.
    UnknownGroup,
    /// No answer (connection refused, timed out, a malformed reply).
    Unreachable,
}

#[derive(Debug)]
enum Pending {
    Put(Vec<PendingPut>),
    Delete(Vec<(PageKey, Option<usize>)>),
}

#[derive(Debug)]
struct PendingPut {
    key: PageKey,
    version: u32,
    crc: u32,
    flags: PageFlags,
    data: Vec<u8>,
    /// `None` for a plain PUT.
    op: Option<ParityOp>,
    delta: Option<usize>,
}

/// What became of a GMS request ([`handle_gms`]).
#[derive(Debug)]
pub enum GmsOutcome {
    /// Answered (clean pages put or got).
    Replied,
    /// An epoch message: the daemon's, not the store's (it has no reply).
    Epoch(netram_proto::gms::Epoch),
}

/// Runs one GMS request (`netram_proto::gms`) from session `h`: clean pages put and got
/// against the store (`clean.rs`), epoch messages handed back to the caller.
pub fn handle_gms<A: AsRef<[u8]> + AsMut<[u8]>>(
    store: &mut Store<A>,
    h: SessionHandle,
    id: u64,
    req: netram_proto::gms::Request<'_>,
    now_ms: u64,
    rps: u32,
    out: &mut Vec<u8>,
) -> GmsOutcome {
    use netram_proto::gms::{CachedPage, Reply as GmsReply, Request as GmsRequest};
    match req {
        GmsRequest::Epoch(e) => GmsOutcome::Epoch(e),
        GmsRequest::PutCached(pages) => {
            let mut status = Vec::with_capacity(pages.len());
            for p in &pages {
                match store.put_clean(h, p.uid, p.age_ms, p.crc, p.flags, p.data, now_ms) {
                    Ok(s) => status.push(s),
                    Err(_) => {
                        expired_reply(store, id, rps, out);
                        return GmsOutcome::Replied;
                    }
                }
            }
            GmsReply::PutCached {
                load: store.load(h, rps),
                status,
            }
            .encode(id, out);
            GmsOutcome::Replied
        }
        GmsRequest::GetCached { take, uids } => {
            let mut found = Vec::with_capacity(uids.len());
            for &uid in &uids {
                match store.get_clean(h, uid, take, now_ms) {
                    Ok(p) => found.push(p.map(|p| (uid, p))),
                    Err(_) => {
                        expired_reply(store, id, rps, out);
                        return GmsOutcome::Replied;
                    }
                }
            }
            GmsReply::GetCached {
                load: store.load(h, rps),
                pages: found
                    .iter()
                    .map(|p| {
                        p.as_ref().map(|(uid, p)| CachedPage {
                            uid: *uid,
                            age_ms: p.age_ms,
                            crc: p.crc,
                            flags: p.flags,
                            data: &p.data,
                        })
                    })
                    .collect(),
            }
            .encode(id, out);
            GmsOutcome::Replied
        }
        GmsRequest::GcdUpdate { reset, add, remove } => {
            let o = match store.gcd_update(h, reset, &add, &remove, now_ms) {
                Ok(o) => o,
                Err(_) => {
                    expired_reply(store, id, rps, out);
                    return GmsOutcome::Replied;
                }
            };
            GmsReply::GcdUpdate {
                load: store.load(h, rps),
                taken: o.taken,
                held: o.held,
                elsewhere: o.elsewhere,
            }
            .encode(id, out);
            GmsOutcome::Replied
        }
    }
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
    let load = |s: &Store<A>| s.load(h, rps);
    let expired = |s: &Store<A>, out: &mut Vec<u8>| expired_reply(s, id, rps, out);
    match req {
        Request::Put(pages) if pages.iter().any(|p| store.tagged(h, p.key)) => {
            return plan_put(
                store,
                h,
                id,
                pages.iter().map(|p| (*p, None)),
                now_ms,
                rps,
                out,
            );
        }
        Request::PutParity(pages) => {
            return plan_put(
                store,
                h,
                id,
                pages.iter().map(|(p, op)| (*p, Some(*op))),
                now_ms,
                rps,
                out,
            );
        }
        Request::Delete(keys) if keys.iter().any(|k| store.tagged(h, *k)) => {
            if store.refresh(h, now_ms).is_err() {
                expired(store, out);
                return Outcome::Open;
            }
            let owner = store.owner(h);
            let mut deltas = Vec::new();
            let mut seen = std::collections::HashSet::new();
            let pending = keys
                .iter()
                .map(|&k| {
                    // A key deleted twice in one request is deleted once.
                    let delta = seen
                        .insert(k)
                        .then(|| removal(store, h, k, owner, &mut deltas));
                    (k, delta.flatten())
                })
                .collect();
            return forward(
                store,
                h,
                id,
                deltas,
                Pending::Delete(pending),
                now_ms,
                rps,
                out,
            );
        }
        Request::ParityShip {
            group,
            max_members,
            members,
            record,
        } => match store.ship_group(h, group, max_members, &members, &record, now_ms) {
            Ok(s) => Reply::Put {
                load: load(store),
                status: vec![s],
            }
            .encode(id, out),
            Err(_) => expired(store, out),
        },
        Request::ParityDelta(deltas) => {
            if store.refresh(h, now_ms).is_err() {
                expired(store, out);
                return Outcome::Open;
            }
            let me = store.owner(h);
            let peer = store.peer(h);
            let status = deltas
                .iter()
                .map(|d| {
                    let (owner, from) = if d.owner == Owner::SELF {
                        (me, DeltaFrom::Owner)
                    } else {
                        (d.owner, DeltaFrom::Peer(peer))
                    };
                    store.apply_delta(&Delta { owner, ..*d }, from)
                })
                .collect();
            Reply::ParityDelta {
                load: load(store),
                status,
            }
            .encode(id, out);
        }
        Request::ParityScan { dead, max } => {
            let max = (max as usize).min(MAX_BATCH);
            let orphans = if dead == netram_proto::SCAN_LEAVING {
                store.session(h, 0).map(|_| Vec::new())
            } else {
                store.orphans(h, dead, max)
            };
            let Ok(orphans) = orphans else {
                expired(store, out);
                return Outcome::Open;
            };
            let l = load(store);
            // Whatever the groups held here, the reply fits one frame: what does not fit is
            // reported to the next scan.
            let budget = SCAN_REPLY_MAX - orphans.len() * PageKey::WIRE_LEN;
            Reply::ParityScan {
                load: l,
                groups: store.groups_with_member_on(h, dead, max, budget),
                orphans,
            }
            .encode(id, out);
        }
        Request::Expect { from_node, pages } => {
            let mut status = Vec::with_capacity(pages.len());
            for (k, v) in pages {
                match store.expect(h, from_node, k, v, now_ms) {
                    Ok(s) => status.push(s),
                    Err(_) => {
                        expired(store, out);
                        return Outcome::Open;
                    }
                }
            }
            Reply::Move {
                load: load(store),
                status,
            }
            .encode(id, out);
        }
        Request::Adopt { owner, pages } => {
            if store.refresh(h, now_ms).is_err() {
                expired(store, out);
                return Outcome::Open;
            }
            let by = store.peer(h);
            let status = pages
                .iter()
                .map(|p| store.adopt(by, owner, p, now_ms))
                .collect();
            Reply::Move {
                load: load(store),
                status,
            }
            .encode(id, out);
        }
        Request::Migrate { to, to_node, keys } => {
            if store.refresh(h, now_ms).is_err() {
                expired(store, out);
                return Outcome::Open;
            }
            let mut pages = Vec::new();
            let keys = keys
                .iter()
                .map(|&k| {
                    // A member of a parity group moves with its group's help (its owner
                    // writes it again), not this way: its holder names this server.
                    if store.tagged(h, k) {
                        return Err(MoveStatus::Unexpected);
                    }
                    let f = store.get_frame(h, k, now_ms).ok().flatten();
                    let f = f.ok_or(MoveStatus::Missing)?;
                    let p = store.stored(f);
                    pages.push(OwnedPage {
                        key: k,
                        version: p.version,
                        crc: p.crc,
                        flags: p.flags,
                        data: p.data.to_vec(),
                    });
                    Ok(pages.len() - 1)
                })
                .collect();
            let ho = Handover {
                id,
                to: Holder {
                    addr: to,
                    node: to_node,
                },
                owner: store.owner(h),
                pages,
                keys,
            };
            if ho.pages.is_empty() {
                finish_handover(store, h, ho, &[], rps, out);
                return Outcome::Open;
            }
            return Outcome::Handover(ho);
        }
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
            debug_assert!(status.iter().all(|s| matches!(
                s,
                PutStatus::Stored | PutStatus::Full | PutStatus::BadKey | PutStatus::Corrupt
            )));
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
            let found: Vec<Option<u32>> = keys
                .iter()
                .map(|&k| store.get_frame(h, k, now_ms).ok().flatten())
                .collect();
            // Each page looked at once: its header and its data share the trim of its zero
            // tail (`netram_proto::trim`).
            let pages: Vec<_> = found.iter().map(|f| f.map(|f| store.stored(f))).collect();
            let mut w = begin_get_reply(out, id, l, keys.len());
            for (&k, p) in keys.iter().zip(&pages) {
                match p {
                    Some(p) => get_reply_found(&mut w, &p.envelope(k)),
                    None => get_reply_missing(&mut w, k),
                }
            }
            for p in pages.iter().flatten() {
                get_reply_data(&mut w, p.data);
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

/// What a request costs against its client's rate ([`Store::charge`]): each page of a batch
/// one operation, any other request one.
pub fn cost(req: &Request<'_>) -> u32 {
    let n = match req {
        Request::Put(p) => p.len(),
        Request::Get(k) | Request::Delete(k) => k.len(),
        Request::PutParity(p) => p.len(),
        Request::ParityDelta(d) => d.len(),
        Request::Expect { pages, .. } => pages.len(),
        Request::Migrate { keys, .. } => keys.len(),
        Request::Adopt { pages, .. } => pages.len(),
        Request::ParityShip { .. }
        | Request::ParityScan { .. }
        | Request::Refresh
        | Request::Stats
        | Request::Close => 1,
    };
    u32::try_from(n).unwrap_or(u32::MAX).max(1)
}

fn expired_reply<A: AsRef<[u8]> + AsMut<[u8]>>(
    store: &Store<A>,
    id: u64,
    rps: u32,
    out: &mut Vec<u8>,
) {
    error_reply(
        store,
        id,
        rps,
        ErrorCode::SessionExpired,
        "the session's lease ran out; its pages were freed",
        out,
    );
}

fn error_reply<A: AsRef<[u8]> + AsMut<[u8]>>(
    store: &Store<A>,
    id: u64,
    rps: u32,
    code: ErrorCode,
    message: &str,
    out: &mut Vec<u8>,
) {
    Reply::Error {
        load: Load {
            free_pages: store.owned_room(),
            requests_per_s: rps,
            leaving: 0,
        },
        code,
        message,
    }
    .encode(id, out);
}

/// The delta that takes the stored `key` out of its group, if it is in one.
fn removal<A: AsRef<[u8]> + AsMut<[u8]>>(
    store: &Store<A>,
    h: SessionHandle,
    key: PageKey,
    owner: Owner,
    deltas: &mut Vec<(Holder, OwnedDelta)>,
) -> Option<usize> {
    let tag = store.tag(h, key)?;
    let mut record = OwnedRecord::default();
    let old = store.record(h, key)?;
    record.xor(&old);
    deltas.push((
        Holder {
            addr: tag.holder,
            node: tag.holder_node,
        },
        OwnedDelta {
            owner,
            group: tag.group,
            member: tag.member,
            key,
            from: old.version,
            to: old.version,
            kind: DeltaKind::Remove,
            record,
        },
    ));
    Some(deltas.len() - 1)
}

/// Phase one of a PUT that touches parity: works out the deltas, changes nothing.
fn plan_put<'a, A: AsRef<[u8]> + AsMut<[u8]>>(
    store: &mut Store<A>,
    h: SessionHandle,
    id: u64,
    pages: impl ExactSizeIterator<Item = (netram_proto::Page<'a>, Option<ParityOp>)>,
    now_ms: u64,
    rps: u32,
    out: &mut Vec<u8>,
) -> Outcome {
    if store.refresh(h, now_ms).is_err() {
        expired_reply(store, id, rps, out);
        return Outcome::Open;
    }
    let owner = store.owner(h);
    let mut deltas = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut pending = Vec::with_capacity(pages.len());
    for (p, op) in pages {
        if !seen.insert(p.key) {
            // Both deltas would be worked out against the same old page.
            let why = "a key appears twice in one PUT of parity pages";
            error_reply(store, id, rps, ErrorCode::BadRequest, why, out);
            return Outcome::Open;
        }
        if let Some(ParityOp::Join { holder, member, .. }) = op {
            if !store.can_intern(holder, member) {
                // Refused before anything changes: a page stored but not tagged would leave
                // its group's parity covering a page whose overwrites never reach it.
                let why = "this server's table of server addresses is full";
                error_reply(store, id, rps, ErrorCode::BadRequest, why, out);
                return Outcome::Open;
            }
        }
        let delta = match op {
            // Damaged on the way: `Store::put` refuses it, and no group may change for it.
            _ if !p.verify() => None,
            Some(ParityOp::Join { .. }) => removal(store, h, p.key, owner, &mut deltas),
            None | Some(ParityOp::Keep) => store.tag(h, p.key).and_then(|tag| {
                let mut record = OwnedRecord::default();
                let old = store.record(h, p.key)?;
                record.xor(&old);
                record.xor(&Record::of(&p));
                deltas.push((
                    Holder {
                        addr: tag.holder,
                        node: tag.holder_node,
                    },
                    OwnedDelta {
                        owner,
                        group: tag.group,
                        member: tag.member,
                        key: p.key,
                        from: old.version,
                        to: p.version,
                        kind: DeltaKind::Update,
                        record,
                    },
                ));
                Some(deltas.len() - 1)
            }),
        };
        pending.push(PendingPut {
            key: p.key,
            version: p.version,
            crc: p.crc,
            flags: p.flags,
            data: p.data.to_vec(),
            op,
            delta,
        });
    }
    forward(
        store,
        h,
        id,
        deltas,
        Pending::Put(pending),
        now_ms,
        rps,
        out,
    )
}

/// Hands the deltas to the caller, or finishes at once when there are none.
#[allow(clippy::too_many_arguments)]
fn forward<A: AsRef<[u8]> + AsMut<[u8]>>(
    store: &mut Store<A>,
    h: SessionHandle,
    id: u64,
    deltas: Vec<(Holder, OwnedDelta)>,
    pending: Pending,
    now_ms: u64,
    rps: u32,
    out: &mut Vec<u8>,
) -> Outcome {
    let fwd = Forward {
        id,
        deltas,
        pending,
    };
    if fwd.deltas.is_empty() {
        finish_forward(store, h, fwd, &[], now_ms, rps, out);
        return Outcome::Open;
    }
    store.counters.parity_forwards += 1;
    Outcome::Forward(fwd)
}

/// Phase two: the holders have answered (`outcomes[i]` for `fwd.deltas[i]`); changes the store
/// and appends the reply.
pub fn finish_forward<A: AsRef<[u8]> + AsMut<[u8]>>(
    store: &mut Store<A>,
    h: SessionHandle,
    fwd: Forward,
    outcomes: &[DeltaOutcome],
    now_ms: u64,
    rps: u32,
    out: &mut Vec<u8>,
) {
    let outcome = |d: Option<usize>| {
        d.map(|i| {
            outcomes
                .get(i)
                .copied()
                .unwrap_or(DeltaOutcome::Unreachable)
        })
    };
    let unreachable = outcomes
        .iter()
        .filter(|o| **o == DeltaOutcome::Unreachable)
        .count();
    store.counters.parity_holder_unreachable += unreachable as u64;
    let load = |s: &Store<A>| s.load(h, rps);
    match fwd.pending {
        Pending::Put(pages) => {
            let mut status = Vec::with_capacity(pages.len());
            for p in pages {
                let o = outcome(p.delta);
                if o == Some(DeltaOutcome::Unreachable) {
                    status.push(PutStatus::HolderUnreachable);
                    continue;
                }
                let s = match store.put(h, p.key, p.version, p.crc, p.flags, &p.data, now_ms) {
                    Ok(s) => s,
                    Err(_) => return expired_reply(store, fwd.id, rps, out),
                };
                if s != PutStatus::Stored {
                    // An overwrite in place cannot fail; a page that left its group for
                    // another one and then found no room stays as it was, outside any group.
                    if o == Some(DeltaOutcome::Applied) {
                        store.set_tag(h, p.key, None);
                    }
                    status.push(s);
                    continue;
                }
                status.push(match (p.op, o) {
                    (
                        Some(ParityOp::Join {
                            holder,
                            holder_node,
                            group,
                            member,
                        }),
                        _,
                    ) => {
                        let tag = ParityTag {
                            holder,
                            holder_node,
                            group,
                            member,
                        };
                        if store.set_tag(h, p.key, Some(tag)) {
                            PutStatus::Stored
                        } else {
                            // No room to remember its group: stored, but outside any group.
                            PutStatus::Unprotected
                        }
                    }
                    (_, Some(DeltaOutcome::UnknownGroup)) => {
                        store.set_tag(h, p.key, None);
                        if p.op.is_some() {
                            PutStatus::Unprotected
                        } else {
                            PutStatus::Stored
                        }
                    }
                    (Some(ParityOp::Keep), None) => PutStatus::Unprotected,
                    _ => PutStatus::Stored,
                });
            }
            Reply::Put {
                load: load(store),
                status,
            }
            .encode(fwd.id, out);
        }
        Pending::Delete(keys) => {
            let mut status = Vec::with_capacity(keys.len());
            for (k, d) in keys {
                if outcome(d) == Some(DeltaOutcome::Unreachable) {
                    status.push(DeleteStatus::HolderUnreachable);
                    continue;
                }
                match store.delete(h, k, now_ms) {
                    Ok(true) => status.push(DeleteStatus::Deleted),
                    Ok(false) => status.push(DeleteStatus::Missing),
                    Err(_) => return expired_reply(store, fwd.id, rps, out),
                }
            }
            Reply::Delete {
                load: load(store),
                status,
            }
            .encode(fwd.id, out);
        }
    }
}

/// Phase two of a MIGRATE: the new server answered (`status[i]` for `ho.pages[i]`; missing
/// answers count as unreachable). This server keeps its copies: the owner deletes them once
/// its table names the new server (Nswap's INVALIDATE).
pub fn finish_handover<A: AsRef<[u8]> + AsMut<[u8]>>(
    store: &mut Store<A>,
    h: SessionHandle,
    ho: Handover,
    status: &[MoveStatus],
    rps: u32,
    out: &mut Vec<u8>,
) {
    let status: Vec<MoveStatus> = ho
        .keys
        .iter()
        .map(|k| match *k {
            Ok(i) => status.get(i).copied().unwrap_or(MoveStatus::Unreachable),
            Err(s) => s,
        })
        .collect();
    store.counters.pages_handed_over +=
        status.iter().filter(|&&s| s == MoveStatus::Done).count() as u64;
    Reply::Move {
        load: store.load(h, rps),
        status,
    }
    .encode(ho.id, out);
}

/// The gauges every STATS reply opens with, then the store's counters.
pub fn store_stats<A: AsRef<[u8]> + AsMut<[u8]>>(store: &Store<A>) -> Vec<(&'static str, u64)> {
    let mut out = vec![
        ("capacity_pages", store.capacity_pages()),
        ("arena_pages", store.arena_pages()),
        ("free_pages", store.free_pages()),
        ("stored_pages", store.stored_pages()),
        ("pages_beyond_offer", store.pages_beyond_offer()),
        ("live_sessions", store.live_sessions() as u64),
        ("meta_bytes", store.meta_bytes() as u64),
        ("expected_pages", store.expected_pages() as u64),
        ("clean_pages", store.clean_pages()),
        ("owned_clean_pages", store.owned_clean_pages()),
        ("gcd_entries", store.gcd_entries() as u64),
    ];
    out.extend(store.counters().iter());
    out
}
