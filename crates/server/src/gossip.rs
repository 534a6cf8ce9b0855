//! Membership on the wire: the daemon's runtime around the I/O-free `netram_member::Membership`
//! (SWIM through foca; Anemone §2.4's resource announcements ride on every packet; Nswap §III:
//! every daemon a peer that finds the others by itself).
//!
//! One thread owns a UDP socket bound to the daemon's own address (same port as its pages'
//! TCP), reads packets until the membership's next timer is due, and sends what the membership
//! asks. In a secure cluster every packet is signed with the node's key and carries its
//! certificate (`netram_member::envelope`); a receiver checks the certificate against the
//! cluster CA and its revocation list and the signature, and requires the SWIM message's
//! sender to be the node the certificate names. Without credentials (`--insecure`, loopback
//! only) packets are clear and only loopback senders are heard.
//!
//! Everything arriving is hostile: a packet that does not decode, is unsigned in a secure
//! cluster, is signed by a node without the server role or by someone else than it claims,
//! is more than [`MAX_SKEW`] old or new, or arrives beyond [`MAX_VERIFY_PER_S`] (signature
//! checks cost ~0.1 ms each) is dropped and counted, one counter per reason; nothing else
//! changes.

use crate::daemon::Shared;
use netram_member::envelope::{self, Announce, MAX_PACKET};
use netram_member::{Event, MemberConfig, Node};
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A packet whose sender's clock is further than this from ours is refused (an old packet
/// replayed). Cluster nodes keep their clocks in sync (NTP).
pub const MAX_SKEW: Duration = Duration::from_secs(60);
/// Signed packets checked per second at most; beyond, dropped unread (a flood cannot take the
/// CPU; SWIM tolerates the loss of a few packets).
pub const MAX_VERIFY_PER_S: u32 = 2000;
/// How often this node's own announcement is brought up to date from its store.
const ANNOUNCE_EVERY: Duration = Duration::from_millis(500);

/// Membership settings of a daemon.
#[derive(Debug, Clone, Default)]
pub struct GossipConfig {
    /// Other daemons' addresses to join through.
    pub seeds: Vec<SocketAddr>,
    /// The address other nodes reach this one at, when it listens on a wildcard address.
    pub advertise: Option<SocketAddr>,
    pub member: MemberConfig,
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The membership thread. Ends when the daemon shuts down, after telling the others it leaves.
pub(crate) fn gossip_loop(shared: Arc<Shared>, socket: UdpSocket) {
    let mut buf = vec![0u8; MAX_PACKET + 1];
    let mut last_announce = Instant::now() - ANNOUNCE_EVERY;
    let mut budget = (Instant::now(), MAX_VERIFY_PER_S);
    while !shared.shutdown.load(Ordering::SeqCst) {
        if last_announce.elapsed() >= ANNOUNCE_EVERY {
            last_announce = Instant::now();
            refresh_announce(&shared);
        }
        let now = shared.now_ms();
        let wait = {
            let mut m = shared.membership();
            m.on_tick(now);
            m.next_deadline().saturating_sub(now)
        };
        flush(&shared, &socket);
        let wait = Duration::from_millis(wait.clamp(1, 100));
        let _ = socket.set_read_timeout(Some(wait));
        let (n, from) = match socket.recv_from(&mut buf) {
            Ok(x) => x,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) => {
                tracing::warn!("membership socket: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        Shared::bump(&shared.counters.gossip_packets_received);
        if budget.0.elapsed() >= Duration::from_secs(1) {
            budget = (Instant::now(), MAX_VERIFY_PER_S);
        }
        if budget.1 == 0 {
            Shared::bump(&shared.counters.gossip_refused_rate);
            continue;
        }
        budget.1 -= 1;
        receive(&shared, &buf[..n], from);
        flush(&shared, &socket);
    }
    shared.membership().leave();
    flush(&shared, &socket);
}

/// Checks one packet and hands it to the membership.
fn receive(shared: &Shared, bytes: &[u8], from: SocketAddr) {
    let c = &shared.counters;
    let p = match envelope::decode(bytes) {
        Ok(p) => p,
        Err(e) => {
            tracing::debug!(%from, "membership packet refused: {e}");
            return Shared::bump(&c.gossip_refused_malformed);
        }
    };
    let sender = match (shared.creds(), &p.signature) {
        (Some(creds), Some(s)) => match creds.verify_signed(s.cert, s.signed, s.scheme, s.sig) {
            // Members serve pages: a client's certificate does not make one.
            Ok(id) if !id.server => return Shared::bump(&c.gossip_refused_not_server),
            Ok(id) => Some(id.node),
            Err(e) => {
                tracing::debug!(%from, "membership packet refused: {e}");
                return Shared::bump(&c.gossip_refused_bad_signature);
            }
        },
        (Some(_), None) => return Shared::bump(&c.gossip_refused_unsigned),
        (None, _) if !from.ip().is_loopback() => return Shared::bump(&c.gossip_refused_unsigned),
        (None, _) => None,
    };
    if wall_ms().abs_diff(p.sent_ms) > MAX_SKEW.as_millis() as u64 {
        return Shared::bump(&c.gossip_refused_stale);
    }
    let now = shared.now_ms();
    let r = shared
        .membership()
        .on_packet(now, sender, p.announce, p.swim);
    match r {
        Ok(()) => {}
        Err(netram_member::MemberError::WrongSender { signer, claimed }) => {
            tracing::warn!(%from, "node {signer} sent a membership packet in node {claimed}'s name");
            Shared::bump(&c.gossip_refused_wrong_sender);
        }
        Err(e) => {
            tracing::debug!(%from, "membership packet refused: {e}");
            Shared::bump(&c.gossip_refused_swim);
        }
    }
}

/// Sends what the membership asked for, each packet in its envelope, and logs its events.
fn flush(shared: &Shared, socket: &UdpSocket) {
    let (sends, events, announce) = {
        let mut m = shared.membership();
        (m.take_sends(), m.take_events(), m.announce())
    };
    for e in events {
        match e {
            Event::Up(n) => tracing::info!(node = n.id, addr = %n.addr, "member up"),
            Event::Down(n) => {
                Shared::bump(&shared.counters.members_declared_down);
                tracing::warn!(node = n.id, addr = %n.addr, "member down")
            }
            Event::Renamed { old, new } => {
                tracing::info!(node = new.id, addr = %new.addr, old_addr = %old.addr, "member restarted")
            }
            Event::Joined => tracing::info!("joined the cluster"),
            Event::Alone => tracing::warn!("no live member known; trying the seeds"),
        }
    }
    let creds = shared.creds();
    for (to, swim) in sends {
        let mut out = Vec::with_capacity(swim.len() + 800);
        envelope::encode_body(&mut out, wall_ms(), &announce, &swim, creds.is_some());
        if let Some(creds) = &creds {
            envelope::encode_cert(&mut out, creds.cert_der());
            match creds.sign(&out) {
                Ok((scheme, sig)) => envelope::encode_signature(&mut out, scheme, &sig),
                Err(e) => {
                    tracing::error!("cannot sign a membership packet: {e}");
                    continue;
                }
            }
        }
        match socket.send_to(&out, to) {
            Ok(_) => Shared::bump(&shared.counters.gossip_packets_sent),
            Err(e) => tracing::debug!(%to, "membership packet not sent: {e}"),
        }
    }
}

/// This node's announcement from its store: what it offers, what is free, its load.
fn refresh_announce(shared: &Shared) {
    let (offered, free, rps) = shared.offer_and_load();
    let mut m = shared.membership();
    let old = m.announce();
    if (old.offered_pages, old.free_pages, old.requests_per_s) != (offered, free, rps) {
        m.set_announce(Announce {
            seq: old.seq + 1,
            offered_pages: offered,
            free_pages: free,
            requests_per_s: rps,
        });
    }
}

/// This node's membership identity: its certificate's node id (or, without credentials, the
/// configured id or a random one), the address it is reached at, and this boot.
pub(crate) fn identity(node: u64, addr: SocketAddr, boot: u64) -> Node {
    Node {
        id: if node == 0 { fastrand::u64(1..) } else { node },
        addr,
        boot,
    }
}
