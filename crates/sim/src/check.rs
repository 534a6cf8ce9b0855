//! The checkers: properties of the whole cluster, judged from outside the code under test
//! (the model of what was written, and the servers' stores), after every step.

use crate::transport::SimTransport;
use crate::world::{server_addr, World};
use netram_pager::{Backing, MemDisk, Pager, PagerError, Scheme};
use netram_proto::{OwnedRecord, PageKey, Record, PAGE_SIZE};

/// What a client last wrote to each of its pages (`None`: never written, or discarded).
#[derive(Debug, Clone)]
pub struct Model {
    pub client: usize,
    pub pages: Vec<Option<u64>>,
}

/// The contents written to a page under a tag: distinct for every (client, page, tag).
pub fn content(client: usize, page: u64, tag: u64) -> Vec<u8> {
    let mut x = (client as u64 + 1)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(page.wrapping_mul(0xbf58_476d_1ce4_e5b9))
        .wrapping_add(tag.wrapping_mul(0x94d0_49bb_1331_11eb))
        | 1;
    let mut d = vec![0u8; PAGE_SIZE];
    for chunk in d.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    // One page in four ends in zeros, from a point of its own: it travels without its tail
    // (`netram_proto::page::trim`) and a compressing client's LZ4 shrinks it.
    if tag.is_multiple_of(4) {
        d[8 + (x % (PAGE_SIZE as u64 - 8)) as usize..].fill(0);
    }
    d
}

impl Model {
    pub fn expected(&self, page: u64) -> Vec<u8> {
        match self.pages[page as usize] {
            Some(tag) => content(self.client, page, tag),
            None => vec![0u8; PAGE_SIZE],
        }
    }

    /// Says what wrong contents read back for `page` are: an older write's, zeros, or nothing
    /// this client wrote (for the failure report).
    pub fn explain(&self, page: u64, got: &[u8]) -> String {
        let want = self.pages[page as usize];
        let what = if got.iter().all(|&b| b == 0) {
            "zeros".to_string()
        } else {
            let last = self.pages.iter().flatten().max().copied().unwrap_or(0);
            let of = |p: u64| {
                (1..=last)
                    .rev()
                    .find(|&t| content(self.client, p, t) == got)
            };
            match of(page) {
                Some(t) => format!("the contents of write {t}"),
                None => match (0..self.pages.len() as u64).find_map(|p| Some((p, of(p)?))) {
                    Some((p, t)) => format!("page {p}'s contents of write {t}"),
                    None => "contents this client never wrote".to_string(),
                },
            }
        };
        match want {
            Some(t) => format!("{what}, not those of write {t}"),
            None => format!("{what}, not zeros"),
        }
    }
}

/// Servers whose faults may have cost `client` its copies, against what its redundancy
/// tolerates: beyond that, a read may fail (never return wrong data).
pub fn loss_allowed(world: &World, client: usize, tolerated: usize) -> bool {
    world.touched[client].iter().filter(|&&t| t).count() > tolerated
}

/// Whether a read may fail this way: lost or corrupt pages, only from servers whose faults
/// touched this client, and only once more have than its redundancy tolerates.
pub fn failure_allowed(world: &World, client: usize, tolerated: usize, e: &PagerError) -> bool {
    let touched = |name: &str| {
        name.strip_prefix("sim")
            .and_then(|n| n.parse::<usize>().ok())
            .is_some_and(|s| world.touched[client].get(s) == Some(&true))
    };
    loss_allowed(world, client, tolerated)
        && match e {
            // A stripe with too few pieces names no one server.
            PagerError::Lost(lost) => lost
                .iter()
                .all(|l| touched(&l.server) || !l.server.starts_with("sim")),
            PagerError::Corrupt { server, .. } => touched(server),
            _ => false,
        }
}

/// The stores keep their own accounting straight and within capacity.
pub fn stores(world: &World) -> Result<(), String> {
    if let Some(bad) = world.bad_frames.first() {
        return Err(bad.clone());
    }
    for (i, s) in world.servers.iter().enumerate().filter(|(_, s)| s.up) {
        if let Some(why) = s.store.invariant_violation() {
            return Err(format!("server {i}: {why}"));
        }
        if s.store.counters().parity_deltas_refused > 0 {
            return Err(format!(
                "server {i} refused a delta from the very server its owner placed the member \
                 on: the holder's check of who may send deltas is wrong"
            ));
        }
        if s.store.counters().parity_groups_inconsistent > 0 {
            return Err(format!(
                "server {i} freed a parity group whose parity was not zero: a delta was lost \
                 or applied twice"
            ));
        }
        for (owner, id, members, _) in s.store.held_groups() {
            let mut servers: Vec<_> = members.iter().map(|m| m.server).collect();
            servers.sort_unstable();
            servers.dedup();
            if servers.len() < members.len() || servers.contains(&server_addr(i)) {
                return Err(format!(
                    "server {i} holds group {id} of {owner:?} with two pieces on one server: \
                     {members:?}"
                ));
            }
            let mut keys: Vec<_> = members.iter().map(|m| m.key).collect();
            keys.sort_unstable();
            keys.dedup();
            if keys.len() < members.len() {
                return Err(format!(
                    "server {i} holds group {id} of {owner:?} with one page twice: {members:?}"
                ));
            }
        }
        // Pages above a shrunk offer stay until they leave; none is ever taken beyond it.
        if s.store.stored_pages() > s.store.capacity_pages() + s.store.pages_beyond_offer()
            || s.store.stored_pages() > s.store.arena_pages()
        {
            return Err(format!(
                "server {i} stores {} pages, over its offer of {} and {} above it",
                s.store.stored_pages(),
                s.store.capacity_pages(),
                s.store.pages_beyond_offer()
            ));
        }
    }
    Ok(())
}

/// Every written page has a holder (a server or the local disk), and every holder the checker
/// can inspect really has the page's current version.
pub fn holders(
    world: &World,
    pager: &Pager<SimTransport, MemDisk>,
    model: &Model,
    tolerated: usize,
) -> Result<(), String> {
    for (page, tag) in model.pages.iter().enumerate() {
        let page = page as u64;
        if tag.is_none() {
            continue;
        }
        if !pager.is_written(page) {
            return Err(format!(
                "page {page} was written but the pager has no record of it"
            ));
        }
        let Some(loc) = pager.location(page) else {
            continue; // cached, or its write-back is in flight
        };
        let Some((pieces, needed)) = pager.pieces(page) else {
            continue;
        };
        // Pieces it cannot do without: one copy, or K pieces of a stripe.
        let least = needed.saturating_sub(tolerated).max(1);
        if loc.lost {
            if loc.on_disk || loss_allowed(world, model.client, tolerated) {
                continue;
            }
            return Err(format!(
                "page {page} is lost though its client saw too few failures to lose it"
            ));
        }
        let parity = matches!(pager.config().redundancy, Scheme::Parity { .. });
        if parity && pieces.is_empty() && !loc.on_disk {
            // Its server is gone: a live holder's group must still cover it, to rebuild it.
            if group_of(world, pager, page, loc.version, None).is_none()
                && !loss_allowed(world, model.client, tolerated)
            {
                return Err(format!(
                    "page {page} (version {}) has no copy and no group that covers it",
                    loc.version
                ));
            }
            continue;
        }
        if pieces.len() < least && !loc.on_disk && !loss_allowed(world, model.client, tolerated) {
            return Err(format!(
                "page {page} (version {}) has {} of the {least} pieces it needs at least",
                loc.version,
                pieces.len()
            ));
        }
        let mut servers: Vec<usize> = pieces.iter().map(|p| p.0).collect();
        servers.sort_unstable();
        servers.dedup();
        if servers.len() < pieces.len() {
            return Err(format!(
                "page {page}: two pieces of its group on one server: {pieces:?}"
            ));
        }
        // A whole copy whose version is on the disk too was sent as a clean page, which its
        // server may have dropped for another page (GMS; `netram_store`'s `clean.rs`).
        let clean = loc.on_disk && clean_copies(pager);
        for &(h, key, version) in &pieces {
            if let Some(why) = missing_piece(world, pager, h, key, version) {
                let c = world.servers[h].store.counters();
                let dropped = c.clean_owned_dropped + c.clean_owned_dropped_for_offer > 0;
                if clean && dropped && why.ends_with("which it does not") {
                    continue;
                }
                return Err(format!("page {page}: {why}"));
            }
        }
    }
    Ok(())
}

/// Whether the pager sends its pages as clean copies (`cluster+disk` backing, whole copies),
/// which servers may drop.
fn clean_copies(pager: &Pager<SimTransport, MemDisk>) -> bool {
    pager.config().backing == Backing::ClusterDisk
        && matches!(
            pager.config().redundancy,
            Scheme::None | Scheme::Mirror { .. }
        )
}

/// Why a piece (a copy, or a piece of a stripe) the pager counts on is not where it says,
/// if it is not; `None` also when the checker cannot look (the connection or server failed).
fn missing_piece(
    world: &World,
    pager: &Pager<SimTransport, MemDisk>,
    h: usize,
    key: PageKey,
    version: u32,
) -> Option<String> {
    let conn = pager.transport().conns[h]?;
    if !world.inspectable(conn) || world.conns[conn].lied {
        // A hostile reply may have told the pager "stored" for a PUT that was not (another
        // request's id on a PUT reply): a lie it cannot see until replies are authenticated.
        // It costs a copy, which the redundancy covers; the final checks read every page.
        return None;
    }
    let stored = world.servers[h].store.peek(world.conns[conn].session, key);
    match stored {
        Some(p) if p.version == version => None,
        Some(p) => Some(format!(
            "the pager expects version {version} of {key:?} on server {h}, which has {}",
            p.version
        )),
        None => Some(format!(
            "the pager says server {h} holds version {version} of {key:?}, which it does not"
        )),
    }
}

/// Whether every written page has all the copies the scheme keeps, each on a server the
/// checker can inspect and holding the current version (judged from the stores, not from the
/// pager's word), and which the pager has not given up on; and recovery has nothing left.
pub fn whole(world: &World, pager: &Pager<SimTransport, MemDisk>, model: &Model) -> bool {
    not_whole(world, pager, model).is_none()
}

/// The first page that is not whole (see [`whole`]), and why.
pub fn not_whole(
    world: &World,
    pager: &Pager<SimTransport, MemDisk>,
    model: &Model,
) -> Option<String> {
    let alive: Vec<bool> = pager.servers().map(|(_, alive)| alive).collect();
    if pager.degraded_pages() > 0 {
        // Recovery is not done: a parity group may still list a superseded member on a dead
        // server, which leaves its other members exposed to one more failure.
        return Some(format!(
            "recovery still has {} pages or servers to look at",
            pager.degraded_pages()
        ));
    }
    for (page, tag) in model.pages.iter().enumerate() {
        let page = page as u64;
        if tag.is_none() {
            continue;
        }
        let (Some(loc), Some((pieces, needed))) = (pager.location(page), pager.pieces(page)) else {
            return Some(format!("page {page} is in flight"));
        };
        if loc.on_disk {
            continue; // the local disk holds it too (spilled, or disk backing)
        }
        if loc.lost || pieces.len() < needed {
            return Some(format!(
                "page {page} has {} of {needed} pieces (lost: {})",
                pieces.len(),
                loc.lost
            ));
        }
        for &(h, key, version) in &pieces {
            let inspectable = pager.transport().conns[h].is_some_and(|c| world.inspectable(c));
            if !alive[h] || !inspectable {
                return Some(format!(
                    "page {page}: server {h} of its piece {key:?} is out of reach"
                ));
            }
            if let Some(why) = missing_piece(world, pager, h, key, version) {
                return Some(format!("page {page}: {why}"));
            }
            let parity = matches!(pager.config().redundancy, Scheme::Parity { .. });
            if parity && group_of(world, pager, page, version, Some(h)).is_none() {
                return Some(format!(
                    "page {page}: no live holder's parity group covers version {version} on \
                     server {h}"
                ));
            }
        }
    }
    None
}

/// Every parity group of the pager's current sessions is the XOR of its members, as far as
/// the checker can see them all (each on a server it can inspect, at the version the group
/// names): a group that does not would rebuild garbage, which a CRC cannot always catch (it is
/// linear, so the XOR of three sealed pages verifies).
pub fn groups(world: &World, pager: &Pager<SimTransport, MemDisk>) -> Result<(), String> {
    let session = |i: usize| {
        pager.transport().conns[i]
            .filter(|&c| world.inspectable(c))
            .map(|c| world.conns[c].session)
    };
    let n = world.servers.len();
    for holder in 0..n {
        let Some(h) = session(holder) else {
            continue;
        };
        'group: for (id, members, parity) in world.servers[holder].store.session_groups(h) {
            let mut x = OwnedRecord::default();
            for m in &members {
                let Some(s) = (0..n).find(|&s| server_addr(s) == m.server) else {
                    continue 'group;
                };
                let page = session(s).and_then(|h| world.servers[s].store.peek(h, m.key));
                match page {
                    Some(p) if p.version == m.version => x.xor(&Record::of(&p.envelope(m.key))),
                    _ => continue 'group,
                }
            }
            let r = x.as_record();
            if (r.version, r.crc, r.flags, r.data)
                != (parity.version, parity.crc, parity.flags, parity.data)
            {
                return Err(format!(
                    "server {holder} holds group {id} whose parity is not the XOR of its members \
                     {members:?}"
                ));
            }
        }
    }
    Ok(())
}

/// The server whose parity group covers version `version` of a pager's page (stored on `on`,
/// if given), as the stores themselves say: only groups of the pager's current session there
/// count (an abandoned session's groups are out of its reach, though they live until their
/// lease runs out).
fn group_of(
    world: &World,
    pager: &Pager<SimTransport, MemDisk>,
    page: u64,
    version: u32,
    on: Option<usize>,
) -> Option<usize> {
    let key = PageKey::new(pager.config().region, page);
    (0..world.servers.len()).find(|&i| {
        let Some(conn) = pager.transport().conns[i].filter(|&c| world.inspectable(c)) else {
            return false;
        };
        world.servers[i]
            .store
            .session_groups(world.conns[conn].session)
            .iter()
            .any(|(_, members, _)| {
                members.iter().any(|m| {
                    m.key == key
                        && m.version == version
                        && on.is_none_or(|h| m.server == server_addr(h))
                })
            })
    })
}

/// Once everything is written back, each session holds exactly the pages the pager thinks it
/// holds there: superseded and discarded copies were deleted (Nswap's garbage collection).
pub fn no_garbage(world: &World, pager: &Pager<SimTransport, MemDisk>) -> Result<(), String> {
    let expected = pager.pages_per_server();
    let alive: Vec<bool> = pager.servers().map(|(_, alive)| alive).collect();
    for (s, &want) in expected.iter().enumerate() {
        if !alive[s] {
            // Given up on: what it still holds is the abandoned session's, freed by its lease
            // once the client reconnects, or when the client ends.
            continue;
        }
        let Some(conn) = pager.transport().conns[s] else {
            continue;
        };
        if !world.inspectable(conn) || world.conns[conn].lied {
            // A lie about a PUT's fate (stored, said full) leaves a copy the client cannot
            // know of: `nothing_left` sees it freed when the session ends.
            continue;
        }
        // Data pages only: a holder's parity frames are not in the page table.
        let have = world.servers[s]
            .store
            .session_keys(world.conns[conn].session)
            .len() as u64;
        // Fewer can be right: a server may drop clean copies (`cluster+disk`), each of which
        // `holders` checks is on the disk.
        let c = world.servers[s].store.counters();
        let dropped = clean_copies(pager)
            && c.clean_owned_dropped + c.clean_owned_dropped_for_offer > 0
            && have < want;
        if have != want && !dropped {
            let extra: Vec<u64> = world.servers[s]
                .store
                .session_keys(world.conns[conn].session)
                .into_iter()
                .map(|k| k.page)
                .filter(|&p| {
                    !pager.holders(p).contains(&s) || pager.location(p).is_none_or(|l| l.lost)
                })
                .collect();
            let locs: Vec<_> = extra.iter().map(|&p| (p, pager.location(p))).collect();
            return Err(format!(
                "server {s} holds {have} pages of this client, whose page table counts {want} \
                 there (pages not in the table: {locs:?})"
            ));
        }
    }
    Ok(())
}

/// Once every client has moved what the servers asked it to (and each server has moved down
/// what fits below its offer, as its donor thread does), no server holds a page above its
/// offer (Nswap §III: a donor that shrank holds no more than it offers), groups' parity
/// included: the owner asks a shrinking holder which groups it holds above its offer and
/// moves their members into new groups, and the emptied groups leave.
///
/// Only the clients' current sessions count: a session its client gave up on (the server
/// looked dead, the client reconnected with a new one) holds pages nobody will ask for, and
/// they go when its lease runs out ([`nothing_left`]).
pub fn within_offers(world: &mut World) -> Result<(), String> {
    for s in world.servers.iter_mut().filter(|s| s.up) {
        s.store.compact(usize::MAX);
        s.store.take_given_back();
    }
    for (ci, c) in world.conns.iter().enumerate() {
        if !world.inspectable(ci) {
            continue;
        }
        let s = &world.servers[c.server];
        let above: Vec<PageKey> = s.store.keys_beyond_offer(c.session);
        if !above.is_empty() {
            return Err(format!(
                "server {} still holds {} pages of client {} above its offer of {} frames \
                 after the client moved what it was asked to: {above:?}",
                c.server,
                above.len(),
                c.client,
                s.store.capacity_pages()
            ));
        }
    }
    Ok(())
}

/// After every session has ended and its leases have run out, no server holds anything.
pub fn nothing_left(world: &World) -> Result<(), String> {
    for (i, s) in world.servers.iter().enumerate() {
        if s.store.stored_pages() > 0 || s.store.live_sessions() > 0 {
            return Err(format!(
                "server {i} still holds {} pages in {} sessions after every client ended",
                s.store.stored_pages(),
                s.store.live_sessions()
            ));
        }
    }
    Ok(())
}
