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
//! cluster, is more than [`MAX_SKEW`] old or new, comes from an address over its budget
//! (`netram_member::gate`: every member's address has its own, everybody else shares a small
//! one, so that a flood from anywhere but a member's address never costs a member's packet),
//! is signed by a node without the server role or by someone else than it claims, is dropped
//! and counted, one counter per reason; nothing else changes. The cheap checks come before
//! the signature's (~0.1 ms: the certificate's chain, kept for a minute once checked, and the
//! packet's own).

use crate::daemon::Shared;
use netram_member::envelope::{self, Announce, MAX_PACKET};
use netram_member::gate::{Admit, Gate, GateConfig};
use netram_member::{Event, MemberConfig, Node};
use netram_net::tls::{Credentials, PeerIdentity, TlsError};
use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A packet whose sender's clock is further than this from ours is refused (an old packet
/// replayed). Cluster nodes keep their clocks in sync (NTP).
pub const MAX_SKEW: Duration = Duration::from_secs(60);
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
///
/// Under a flood it reads as fast as packets come (a packet left in the socket's buffer is a
/// member's packet the kernel drops once it is full) and spends on each only the cheap checks
/// until the [`Gate`] admits it: decoding, the signature's presence, the clock. Membership's
/// timers are run when due, not per packet.
pub(crate) fn gossip_loop(shared: Arc<Shared>, socket: UdpSocket) {
    // A larger buffer rides out bursts: what the kernel drops, it drops without looking.
    let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&socket, RECV_BUFFER);
    let mut buf = vec![0u8; MAX_PACKET + 1];
    let mut last_announce = Instant::now() - ANNOUNCE_EVERY;
    let mut gate = Gate::new(GateConfig::default(), shared.now_ms());
    let mut certs = CertCache::default();
    let mut next_tick = 0u64;
    let mut gms = crate::gms::Runtime::new(&shared, Default::default());
    while !shared.shutdown.load(Ordering::SeqCst) {
        gms.tick(&shared, &socket);
        if last_announce.elapsed() >= ANNOUNCE_EVERY {
            last_announce = Instant::now();
            refresh_announce(&shared);
            let known = shared.membership().known_addrs();
            gate.set_members(known, shared.now_ms());
        }
        let now = shared.now_ms();
        if now >= next_tick {
            let deadline = {
                let mut m = shared.membership();
                m.on_tick(now);
                m.next_deadline()
            };
            flush(&shared, &socket);
            next_tick = deadline.clamp(now + 1, now + 100);
        }
        let wait = Duration::from_millis(next_tick.saturating_sub(shared.now_ms()).clamp(1, 100));
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
        if receive(
            &shared,
            &socket,
            &mut gms,
            &mut gate,
            &mut certs,
            &buf[..n],
            from,
        ) {
            flush(&shared, &socket);
        }
    }
    shared.membership().leave();
    flush(&shared, &socket);
}

/// The gossip socket's receive buffer (bytes; the kernel caps it at `rmem_max`).
const RECV_BUFFER: usize = 4 << 20;

/// Certificates checked lately: a member signs every packet with the same certificate, so
/// after the first only the packet's own signature is checked. Valid for the credentials (and
/// so the revocation list) it was checked against, and for [`CERT_TTL`] at most.
#[derive(Default)]
struct CertCache {
    creds: Option<Arc<Credentials>>,
    checked: HashMap<Vec<u8>, (PeerIdentity, Instant)>,
}

/// How long a checked certificate is trusted without being checked again (its validity
/// period may end meanwhile).
const CERT_TTL: Duration = Duration::from_secs(60);
/// Certificates remembered at most (one per member); beyond, all are forgotten.
const MAX_CERTS: usize = 1024;

impl CertCache {
    fn verify(
        &mut self,
        creds: &Arc<Credentials>,
        s: &envelope::Signature<'_>,
    ) -> Result<PeerIdentity, TlsError> {
        if !self.creds.as_ref().is_some_and(|c| Arc::ptr_eq(c, creds)) {
            self.creds = Some(creds.clone());
            self.checked.clear();
        }
        if let Some((id, at)) = self.checked.get(s.cert) {
            if at.elapsed() < CERT_TTL {
                let id = id.clone();
                creds.verify_signature(s.cert, s.signed, s.scheme, s.sig)?;
                return Ok(id);
            }
        }
        let id = creds.verify_cert(s.cert)?;
        creds.verify_signature(s.cert, s.signed, s.scheme, s.sig)?;
        // Remembered only once a signature by it checked: a certificate's bytes copied into
        // garbage are no reason to keep it.
        if self.checked.len() >= MAX_CERTS {
            self.checked.clear();
        }
        self.checked
            .insert(s.cert.to_vec(), (id.clone(), Instant::now()));
        Ok(id)
    }
}

/// Checks one packet and hands it to the membership (or a GMS epoch message to `gms`);
/// whether it got that far (so that what the membership wants sent may be due).
fn receive(
    shared: &Shared,
    socket: &UdpSocket,
    gms: &mut crate::gms::Runtime,
    gate: &mut Gate,
    certs: &mut CertCache,
    bytes: &[u8],
    from: SocketAddr,
) -> bool {
    let c = &shared.counters;
    let refuse = |counter: &AtomicU64| {
        Shared::bump(counter);
        false
    };
    let p = match envelope::decode(bytes) {
        Ok(p) => p,
        Err(e) => {
            tracing::trace!(%from, "membership packet refused: {e}");
            return refuse(&c.gossip_refused_malformed);
        }
    };
    let creds = shared.creds();
    // The cheap checks first: nothing that can be refused without a signature check costs one.
    match (&creds, &p.signature) {
        (Some(_), None) => return refuse(&c.gossip_refused_unsigned),
        (None, _) if !from.ip().is_loopback() => return refuse(&c.gossip_refused_unsigned),
        _ => {}
    }
    if wall_ms().abs_diff(p.sent_ms) > MAX_SKEW.as_millis() as u64 {
        return refuse(&c.gossip_refused_stale);
    }
    match gate.admit(from, shared.now_ms()) {
        Admit::Member | Admit::Stranger => {}
        Admit::MemberOverBudget => return refuse(&c.gossip_refused_member_rate),
        Admit::StrangerOverBudget => return refuse(&c.gossip_refused_rate),
    }
    let sender = match (&creds, &p.signature) {
        (Some(creds), Some(s)) => match certs.verify(creds, s) {
            // Members serve pages: a client's certificate does not make one.
            Ok(id) if !id.server => return refuse(&c.gossip_refused_not_server),
            Ok(id) => Some(id.node),
            Err(e) => {
                tracing::debug!(%from, "membership packet refused: {e}");
                return refuse(&c.gossip_refused_bad_signature);
            }
        },
        _ => None,
    };
    if let Some(claimed) = p.gms_from {
        // Over TLS the node is the certificate's; without credentials (loopback only) the
        // packet's word is all there is, as for SWIM.
        if sender.is_some_and(|s| s != claimed) {
            tracing::warn!(%from, "node {sender:?} sent a GMS message in node {claimed}'s name");
            return refuse(&c.gms_refused_wrong_sender);
        }
        Shared::bump(&c.gms_messages_received);
        match gms.receive(shared, socket, claimed, p.swim) {
            Ok(()) => {}
            Err(crate::gms::Refused::Malformed) => Shared::bump(&c.gms_refused_malformed),
            Err(crate::gms::Refused::NotMember) => Shared::bump(&c.gms_refused_not_member),
        }
        return false;
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
    true
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
        if sign(creds.as_deref(), &mut out) && send(socket, &out, to) {
            Shared::bump(&shared.counters.gossip_packets_sent);
        }
    }
}

/// Appends the certificate and the signature to a body (nothing without credentials);
/// false if it cannot be signed.
fn sign(creds: Option<&Credentials>, out: &mut Vec<u8>) -> bool {
    let Some(creds) = creds else {
        return true;
    };
    envelope::encode_cert(out, creds.cert_der());
    match creds.sign(out) {
        Ok((scheme, sig)) => {
            envelope::encode_signature(out, scheme, &sig);
            true
        }
        Err(e) => {
            tracing::error!("cannot sign a membership packet: {e}");
            false
        }
    }
}

fn send(socket: &UdpSocket, packet: &[u8], to: SocketAddr) -> bool {
    match socket.send_to(packet, to) {
        Ok(_) => true,
        Err(e) => {
            tracing::debug!(%to, "membership packet not sent: {e}");
            false
        }
    }
}

/// Sends GMS epoch message `frame` from this node (`from`) to the member at `to`, in a
/// membership packet; whether it left.
pub(crate) fn send_gms(
    shared: &Shared,
    socket: &UdpSocket,
    to: SocketAddr,
    from: u64,
    frame: &[u8],
) -> bool {
    let creds = shared.creds();
    let announce = shared.membership().announce();
    let mut out = Vec::with_capacity(frame.len() + 800);
    envelope::encode_gms_body(&mut out, wall_ms(), &announce, from, frame, creds.is_some());
    sign(creds.as_deref(), &mut out) && send(socket, &out, to)
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
