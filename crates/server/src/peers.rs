//! Server-to-server connections: how a page server tells a parity holder about an overwrite or a
//! delete of a member page before it answers the client (Nswap §IV-B2, Fig. 4, decentralized as
//! in §IV-C: any server may be any group's holder), and how a shrinking donor hands pages to
//! their new server at their owner's request (Nswap §III, Fig. 2's MIGRATE).
//!
//! One connection per holder, opened on first use and kept; a request on it is a blocking round
//! trip made by the connection thread that serves the client, with no lock of the store held
//! (so two servers forwarding to each other cannot deadlock). A holder that cannot be reached is
//! remembered for a short while, so that a dead host costs one connect timeout, not one per
//! request; its deltas come back [`DeltaOutcome::Unreachable`] and the client is told.
//!
//! Peers open sessions at holders under their own node id with [`PEER_NODE`] and their listening
//! address mixed in, so that a server whose machine also runs a client never supersedes that
//! client's sessions, and two servers of one machine never supersede each other's.

use netram_net::{Call, CallError, Patience, Security};
use netram_proto::{
    decode_reply, DecodeError, DeltaStatus, ErrorCode, Hello, Kind, MoveStatus, Owner, Reply,
    Request, HELLO_END_ON_CLOSE, MAX_BATCH,
};
use netram_store::serve::{DeltaOutcome, Holder, OwnedDelta, OwnedPage};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Mixed into a server's node id for its sessions at other servers ("PEER").
pub const PEER_NODE: u64 = 0x5045_4552_0000_0000;

/// How long a holder has to accept a connection, and to answer a delta.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(250);
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);
const PATIENCE: Patience = Patience {
    connect: CONNECT_TIMEOUT,
    reply: REPLY_TIMEOUT,
};

/// Why a delta did not reach its holder; the deltas come back unreachable.
#[derive(Debug, thiserror::Error)]
enum PeerError {
    #[error(transparent)]
    Call(#[from] CallError),
    #[error("bad reply: {0}")]
    Decode(#[from] DecodeError),
    #[error("reply to request {got}, expected {expected}")]
    WrongId { got: u64, expected: u64 },
    #[error("unexpected reply {0:?}")]
    Unexpected(Kind),
    #[error("session expired twice")]
    Expired,
}

impl PeerError {
    fn wrong_node(&self) -> bool {
        matches!(self, PeerError::Call(CallError::WrongNode { .. }))
    }
}

/// What a peer answered, one status per delta or page sent.
enum Statuses {
    Delta(Vec<DeltaStatus>),
    Move(Vec<MoveStatus>),
}

/// The connections of one server to the holders it forwards to.
#[derive(Debug)]
pub struct Peers {
    node: u64,
    incarnation: u64,
    /// Over TLS, a holder is accepted only with a server certificate of the cluster.
    security: Security,
    peers: Mutex<HashMap<Holder, Arc<Mutex<Call>>>>,
}

/// Peer servers (parity holders, migration targets) a server keeps connection state for.
/// A cluster has far fewer; the bound is against clients naming addresses of their choosing.
pub const MAX_PEERS: usize = 1024;

impl Peers {
    pub fn new(node: u64, incarnation: u64, listen: SocketAddr, security: Security) -> Self {
        let addr = match listen.ip() {
            std::net::IpAddr::V4(ip) => u64::from(u32::from(ip)),
            std::net::IpAddr::V6(ip) => {
                let b = u128::from(ip);
                (b as u64) ^ ((b >> 64) as u64)
            }
        };
        Self {
            node: node ^ PEER_NODE ^ (addr << 16) ^ u64::from(listen.port()),
            incarnation,
            security,
            peers: Mutex::new(HashMap::new()),
        }
    }

    /// The connection state kept for `holder`, made on first use; `None` once
    /// [`MAX_PEERS`] holders are known (clients name holders: a client naming a new address
    /// in every request would otherwise grow this table without end), and `refused` counts.
    fn peer(&self, holder: Holder, refused: &AtomicU64) -> Option<Arc<Mutex<Call>>> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if peers.len() >= MAX_PEERS && !peers.contains_key(&holder) {
            // Forget the holders that failed and are not in use, then look again.
            peers.retain(|_, p| {
                Arc::strong_count(p) > 1 || p.try_lock().map_or(true, |p| !p.has_failed())
            });
            if peers.len() >= MAX_PEERS {
                refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%holder, "too many peer servers known: {MAX_PEERS}");
                return None;
            }
        }
        Some(peers.entry(holder).or_default().clone())
    }

    /// Sends every delta to its holder and returns what became of each, in order. A holder
    /// whose server is not the node the owner named (a client naming an address of its
    /// choosing) gets nothing: its deltas come back unreachable, and `wrong_node` counts it.
    pub fn forward(
        &self,
        deltas: &[(Holder, OwnedDelta)],
        wrong_node: &AtomicU64,
        too_many: &AtomicU64,
    ) -> Vec<DeltaOutcome> {
        let mut out = vec![DeltaOutcome::Unreachable; deltas.len()];
        let mut by_holder: HashMap<Holder, Vec<usize>> = HashMap::new();
        for (i, (holder, _)) in deltas.iter().enumerate() {
            by_holder.entry(*holder).or_default().push(i);
        }
        for (holder, idx) in by_holder {
            let Some(peer) = self.peer(holder, too_many) else {
                continue;
            };
            let mut peer = peer.lock().unwrap_or_else(|p| p.into_inner());
            for chunk in idx.chunks(MAX_BATCH) {
                let batch: Vec<_> = chunk.iter().map(|&i| deltas[i].1.as_delta()).collect();
                let req = Request::ParityDelta(batch);
                // Deltas are safe to repeat: a connection that broke gets one more try.
                let sent = self.send(&mut peer, holder, &req).or_else(|e| {
                    tracing::debug!(%holder, "parity holder: {e}; trying once more");
                    self.send(&mut peer, holder, &req)
                });
                match sent {
                    Ok(Statuses::Move(_)) => unreachable!("a delta's answer is checked"),
                    Ok(Statuses::Delta(status)) => {
                        for (&i, s) in chunk.iter().zip(status) {
                            out[i] = match s {
                                DeltaStatus::Applied => DeltaOutcome::Applied,
                                DeltaStatus::UnknownGroup | DeltaStatus::Stale => {
                                    DeltaOutcome::UnknownGroup
                                }
                            };
                        }
                    }
                    Err(e) => {
                        if e.wrong_node() {
                            wrong_node.fetch_add(1, Ordering::Relaxed);
                        }
                        tracing::warn!(%holder, "parity holder unreachable: {e}");
                        peer.fail();
                        break;
                    }
                }
            }
        }
        out
    }

    /// Hands `owner`'s pages to the server `to` (ADOPT), which must prove to be the node the
    /// owner named; returns what became of each, in order. Not repeated on a broken
    /// connection: the first try may have stored some, and the owner cleans up what it is not
    /// told of. A server that is not the node named gets nothing (`wrong_node` counts it).
    pub fn hand_over(
        &self,
        to: Holder,
        owner: Owner,
        pages: &[OwnedPage],
        wrong_node: &AtomicU64,
        too_many: &AtomicU64,
    ) -> Vec<MoveStatus> {
        let mut out = Vec::with_capacity(pages.len());
        let Some(peer) = self.peer(to, too_many) else {
            return vec![MoveStatus::Unreachable; pages.len()];
        };
        let mut peer = peer.lock().unwrap_or_else(|p| p.into_inner());
        for chunk in pages.chunks(MAX_BATCH) {
            let req = Request::Adopt {
                owner,
                pages: chunk.iter().map(OwnedPage::as_page).collect(),
            };
            match self.send(&mut peer, to, &req) {
                Ok(Statuses::Move(status)) => out.extend(status),
                Ok(Statuses::Delta(_)) => unreachable!("an adopt's answer is checked"),
                Err(e) => {
                    if e.wrong_node() {
                        wrong_node.fetch_add(1, Ordering::Relaxed);
                    }
                    tracing::warn!(server = %to, "migration target unreachable: {e}");
                    peer.fail();
                    break;
                }
            }
        }
        out.resize(pages.len(), MoveStatus::Unreachable);
        out
    }

    /// One round trip; reconnects once if the holder expired this server's session.
    fn send(
        &self,
        peer: &mut Call,
        holder: Holder,
        req: &Request<'_>,
    ) -> Result<Statuses, PeerError> {
        let n = match req {
            Request::ParityDelta(d) => d.len(),
            Request::Adopt { pages, .. } => pages.len(),
            _ => unreachable!("peers only send deltas and adopted pages"),
        };
        for attempt in 0..2 {
            let hello = || {
                Hello::new(self.node, self.incarnation, fastrand::u64(..))
                    .with_flags(HELLO_END_ON_CLOSE)
            };
            let (id, frame) = peer.call(
                holder.node,
                holder.addr,
                hello,
                &self.security,
                PATIENCE,
                |id, buf| req.encode(id, buf),
            )?;
            let (got, reply) = decode_reply(&frame)?;
            if got != id {
                return Err(PeerError::WrongId { got, expected: id });
            }
            match reply {
                Reply::ParityDelta { status, .. }
                    if status.len() == n && matches!(req, Request::ParityDelta(_)) =>
                {
                    return Ok(Statuses::Delta(status))
                }
                Reply::Move { status, .. }
                    if status.len() == n && matches!(req, Request::Adopt { .. }) =>
                {
                    return Ok(Statuses::Move(status))
                }
                Reply::Error {
                    code: ErrorCode::SessionExpired,
                    ..
                } if attempt == 0 => {
                    peer.reset();
                }
                other => return Err(PeerError::Unexpected(other.kind())),
            }
        }
        Err(PeerError::Expired)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Clients name the holders: past [`MAX_PEERS`] a new one is refused and counted, unless
    /// a holder that failed and is not in use can be forgotten to make room.
    #[test]
    fn the_table_of_peer_servers_is_bounded() {
        let peers = Peers::new(1, 1, "127.0.0.1:7077".parse().unwrap(), Security::Insecure);
        let refused = AtomicU64::new(0);
        let holder = |i: usize| Holder {
            addr: SocketAddr::from(([10, 0, (i >> 8) as u8, i as u8], 7077)),
            node: i as u64,
        };
        for i in 0..MAX_PEERS {
            assert!(peers.peer(holder(i), &refused).is_some());
        }
        // Known holders are still served; a new one is not.
        assert!(peers.peer(holder(7), &refused).is_some());
        assert!(peers.peer(holder(MAX_PEERS), &refused).is_none());
        assert_eq!(refused.load(Ordering::Relaxed), 1);
        // One that failed makes room.
        peers
            .peer(holder(3), &refused)
            .unwrap()
            .lock()
            .unwrap()
            .fail();
        assert!(peers.peer(holder(MAX_PEERS), &refused).is_some());
        assert_eq!(refused.load(Ordering::Relaxed), 1);
        assert_eq!(peers.peers.lock().unwrap().len(), MAX_PEERS);
    }
}
