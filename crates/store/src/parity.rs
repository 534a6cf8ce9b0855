//! The store's part of Nswap's decentralized dynamic parity (paper 004, §IV-B and IV-C): every
//! server is both a page server and a parity server.
//!
//! * As a **page server** it keeps, beside a member page, the page's *tag*: which holder has its
//!   group's parity, the group's id, and the address the group names this server by (a delta
//!   names its member by server and key: another copy of the page elsewhere is not the member). The request logic ([`crate::serve`]) turns an overwrite or
//!   a delete of a tagged page into a delta for that holder before anything changes here.
//! * As a **holder** it keeps groups: a parity frame (owned by the owner's session, so that it
//!   counts against the same capacity and dies with the session), the XOR of the members'
//!   envelope fields, and the member list. Deltas XOR into the parity; a removed member leaves
//!   the list; an emptied group is freed, and its parity must then be all zeros — anything else
//!   means a delta was lost or applied twice, and is counted (`parity_groups_inconsistent`), which
//!   the simulator checks stays at zero. Groups left small by removals are merged with another
//!   small group of the same owner whose members are on other servers and are other pages
//!   (§IV-B2's merging); the
//!   absorbed group's id stays valid as an alias, so that the tags on its members need no update.
//!
//! Server addresses are interned (a tag names two, a group its members' servers) with a count
//! of references, and an address no tag or group names any more is forgotten: the table holds
//! at most [`MAX_ADDRS`] addresses, and when it is full a new one is refused, never given an id
//! it shares with another (a page that cannot be tagged is stored outside any group, a group
//! that cannot be held is refused; both counted in `parity_addresses_refused`). Groups hold at
//! most [`MAX_GROUP_MEMBERS`] members, merged or not, so that every group fits the frames that
//! carry it, and a scan's reply is cut to fit one frame (the owner asks again for the rest).
//!
//! Only the owner knows which servers are dead: it asks with a scan ([`Store::orphans`],
//! [`Store::groups_with_member_on`]) and repairs what the scan reports.

use crate::{pack, DeltaFrom, Peer, SessionHandle, Store, StoreError, PAGE_NUMBER_MAX};
use netram_proto::parity::MAX_GROUP_MEMBERS;
use netram_proto::{
    Delta, DeltaKind, DeltaStatus, GroupRecord, Member, Owner, PageKey, PutStatus, Record,
    PAGE_SIZE,
};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;

/// The region under which a holder files parity frames in the owner's session: the last of the
/// index's 24 bits, outside what a client may PUT or GET (one above [`crate::REGION_MAX`]).
pub const PARITY_REGION: u32 = crate::REGION_MAX + 1;
const _: () = assert!(PARITY_REGION == (1 << 24) - 1);

/// A member page's parity: holder and group, and the address its group names this server by
/// (addresses interned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tag {
    holder: u16,
    /// The holder's node id, as the owner named it: deltas go only to a server proving it.
    holder_node: u64,
    group: u64,
    member: u16,
}

/// A stored page's group, as its deltas name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParityTag {
    pub holder: SocketAddr,
    pub holder_node: u64,
    pub group: u64,
    /// This server, as the group's member list names it.
    pub member: SocketAddr,
}

/// A group this server holds the parity of.
#[derive(Debug, Clone)]
pub(crate) struct Group {
    frame: u32,
    version: u32,
    crc: u32,
    flags: u16,
    max_members: u8,
    /// Server, key, the version the parity covers, and the server's node id as the owner
    /// named it (the only peer whose deltas about this member are taken).
    members: Vec<(u16, PageKey, u32, u64)>,
    /// A delta did not match the member it was for: the parity cannot be trusted to rebuild.
    damaged: bool,
    /// Ids of groups merged into this one, which still name it.
    aliases: Vec<u64>,
}

/// Parity state: tags of member pages stored here, groups held here.
#[derive(Debug, Default)]
pub(crate) struct ParityState {
    /// Interned addresses and how many tag and member entries name each.
    addrs: Vec<(SocketAddr, u32)>,
    addr_ids: HashMap<SocketAddr, u16>,
    /// Ids whose address nothing names any more, for reuse.
    free_ids: Vec<u16>,
    /// By frame number of the member page. Ordered maps where scans walk them, so that what
    /// a scan reports (and so the simulator's runs) does not depend on a hasher's seed.
    tags: BTreeMap<u32, Tag>,
    /// By (session slot, group id).
    groups: BTreeMap<(u32, u64), Group>,
    alias: HashMap<(u32, u64), u64>,
    /// Per session slot, groups at most half full: merge candidates.
    small: HashMap<u32, Vec<u64>>,
}

/// How many small groups a merge looks at: bounded, so that a removal stays cheap.
const MERGE_CANDIDATES: usize = 8;

/// Addresses interned at most (ids are 16 bits). A cluster has far fewer servers.
pub const MAX_ADDRS: usize = u16::MAX as usize;

impl ParityState {
    /// The id of `a`, with one more reference; `None` if the table is full.
    fn intern(&mut self, a: SocketAddr) -> Option<u16> {
        if let Some(&i) = self.addr_ids.get(&a) {
            self.addrs[usize::from(i)].1 += 1;
            return Some(i);
        }
        let i = match self.free_ids.pop() {
            Some(i) => {
                self.addrs[usize::from(i)] = (a, 1);
                i
            }
            None if self.addrs.len() < MAX_ADDRS => {
                self.addrs.push((a, 1));
                (self.addrs.len() - 1) as u16
            }
            None => return None,
        };
        self.addr_ids.insert(a, i);
        Some(i)
    }

    /// Interns both addresses of a tag, or neither.
    fn intern_pair(&mut self, a: SocketAddr, b: SocketAddr) -> Option<(u16, u16)> {
        let i = self.intern(a)?;
        match self.intern(b) {
            Some(j) => Some((i, j)),
            None => {
                self.unref(i);
                None
            }
        }
    }

    /// Drops one reference to id `i`; the address is forgotten with its last one.
    fn unref(&mut self, i: u16) {
        let (addr, refs) = &mut self.addrs[usize::from(i)];
        debug_assert!(*refs > 0, "address id {i} released once too often");
        *refs -= 1;
        if *refs == 0 {
            self.addr_ids.remove(addr);
            self.free_ids.push(i);
        }
    }

    fn addr(&self, i: u16) -> SocketAddr {
        self.addrs[usize::from(i)].0
    }

    fn remove_tag(&mut self, f: u32) -> Option<Tag> {
        let t = self.tags.remove(&f)?;
        self.unref(t.holder);
        self.unref(t.member);
        Some(t)
    }

    fn unref_members(&mut self, g: &Group) {
        for m in &g.members {
            self.unref(m.0);
        }
    }

    fn resolve(&self, slot: u32, group: u64) -> u64 {
        self.alias.get(&(slot, group)).copied().unwrap_or(group)
    }

    /// Forgets a session's groups and tags (its frames are being freed).
    pub(crate) fn end_sessions(&mut self, slots: &[u32]) {
        let gone: Vec<(u32, u64)> = self
            .groups
            .keys()
            .filter(|(s, _)| slots.contains(s))
            .copied()
            .collect();
        for k in gone {
            let g = self.groups.remove(&k).expect("listed above");
            self.unref_members(&g);
        }
        self.alias.retain(|(s, _), _| !slots.contains(s));
        self.small.retain(|s, _| !slots.contains(s));
    }

    pub(crate) fn frame_released(&mut self, f: u32) {
        self.remove_tag(f);
    }

    /// A page moved from frame `from` to `to` (the store compacting below a shrunk offer):
    /// its tag follows it, and so does a group whose parity it is (session `slot`'s group
    /// under the parity region's key `packed`).
    pub(crate) fn frame_moved(&mut self, from: u32, to: u32, slot: u32, packed: u64) {
        if let Some(t) = self.tags.remove(&from) {
            self.tags.insert(to, t);
        }
        if packed >> 40 == u64::from(PARITY_REGION) {
            if let Some(g) = self
                .groups
                .get_mut(&(slot, packed & crate::PAGE_NUMBER_MAX))
            {
                debug_assert_eq!(g.frame, from);
                g.frame = to;
            }
        }
    }
}

fn packed_parity_key(group: u64) -> u64 {
    (u64::from(PARITY_REGION) << 40) | group
}

impl<A: AsRef<[u8]> + AsMut<[u8]>> Store<A> {
    /// Who owns a session, as deltas name it to holders.
    /// Whether session `slot` is live and `owner`'s: its principal, node and incarnation.
    pub(crate) fn is_owner(&self, slot: u32, owner: Owner) -> bool {
        let s = &self.sessions[slot as usize];
        s.live
            && s.peer.principal() == owner.principal
            && s.node == owner.node
            && s.incarnation == owner.incarnation
    }

    pub fn owner(&self, h: SessionHandle) -> Owner {
        let s = &self.sessions[h.slot as usize];
        Owner {
            principal: s.peer.principal(),
            node: s.node,
            incarnation: s.incarnation,
        }
    }

    /// The tag of a stored page: its group's holder and id.
    pub fn tag(&self, h: SessionHandle, key: PageKey) -> Option<ParityTag> {
        let f = self.live_frame(h, key)?;
        let t = self.parity.tags.get(&f)?;
        Some(ParityTag {
            holder: self.parity.addr(t.holder),
            holder_node: t.holder_node,
            group: t.group,
            member: self.parity.addr(t.member),
        })
    }

    /// Whether a stored page is in a group (cheap when the server holds no member pages).
    pub fn tagged(&self, h: SessionHandle, key: PageKey) -> bool {
        !self.parity.tags.is_empty() && self.tag(h, key).is_some()
    }

    /// Whether a tag naming `a` and `b` would find room in the table of addresses now.
    pub fn can_intern(&self, a: SocketAddr, b: SocketAddr) -> bool {
        let new = [a, b]
            .iter()
            .filter(|x| !self.parity.addr_ids.contains_key(x))
            .count();
        new <= self.parity.free_ids.len() + (MAX_ADDRS - self.parity.addrs.len())
    }

    /// Tags a stored page (or, with `None`, takes it out of any group). False if the page
    /// could not be tagged (the address table is full): it is then outside any group.
    pub fn set_tag(&mut self, h: SessionHandle, key: PageKey, tag: Option<ParityTag>) -> bool {
        let Some(f) = self.live_frame(h, key) else {
            return tag.is_none();
        };
        self.parity.remove_tag(f);
        let Some(t) = tag else {
            return true;
        };
        let Some((holder, member)) = self.parity.intern_pair(t.holder, t.member) else {
            self.counters.parity_addresses_refused += 1;
            return false;
        };
        let tag = Tag {
            holder,
            holder_node: t.holder_node,
            group: t.group,
            member,
        };
        self.parity.tags.insert(f, tag);
        true
    }

    /// The record of a stored page, for the delta its overwrite or deletion sends.
    pub fn record(&self, h: SessionHandle, key: PageKey) -> Option<Record<'_>> {
        let f = self.live_frame(h, key)?;
        let m = self.meta[f as usize];
        Some(Record {
            version: m.version,
            crc: m.crc,
            flags: m.flags().0,
            data: self.frame(f),
        })
    }

    fn live_frame(&self, h: SessionHandle, key: PageKey) -> Option<u32> {
        match self.sessions.get(h.slot as usize) {
            Some(s) if s.live && s.generation == h.generation => {}
            _ => return None,
        }
        pack(key).and_then(|p| self.find(h.slot, p))
    }

    /// A parity page arrives: this server becomes the holder of `group` (Nswap Fig. 3). A group
    /// shipped again (a retry whose reply was lost) replaces the earlier one.
    pub fn ship_group(
        &mut self,
        h: SessionHandle,
        group: u64,
        max_members: u8,
        members: &[Member],
        record: &Record<'_>,
        now_ms: u64,
    ) -> Result<PutStatus, StoreError> {
        self.session(h, now_ms)?;
        if group > PAGE_NUMBER_MAX
            || record.data.len() != PAGE_SIZE
            || members.len() > MAX_GROUP_MEMBERS
        {
            self.counters.puts_refused_bad_key += 1;
            return Ok(PutStatus::BadKey);
        }
        let mut ids = Vec::with_capacity(members.len());
        for m in members {
            match self.parity.intern(m.server) {
                Some(i) => ids.push(i),
                None => {
                    ids.into_iter().for_each(|i| self.parity.unref(i));
                    self.counters.parity_addresses_refused += 1;
                    return Ok(PutStatus::Full);
                }
            }
        }
        let packed = packed_parity_key(group);
        let f = match self.find(h.slot, packed) {
            Some(f) => f,
            None => match self.insert_frame(h.slot, packed, false) {
                Ok(f) => f,
                Err(refused) => {
                    ids.into_iter().for_each(|i| self.parity.unref(i));
                    return Ok(refused);
                }
            },
        };
        self.meta[f as usize].owner = h.slot; // flags 0: the frame always holds PAGE_SIZE bytes
        let at = f as usize * PAGE_SIZE;
        self.arena.as_mut()[at..at + PAGE_SIZE].copy_from_slice(record.data);
        let members = ids
            .into_iter()
            .zip(members)
            .map(|(i, m)| (i, m.key, m.version, m.node))
            .collect();
        let old = self.parity.groups.insert(
            (h.slot, group),
            Group {
                frame: f,
                version: record.version,
                crc: record.crc,
                flags: record.flags,
                // Never more than a frame carries, whatever the owner asks for: merging stops there.
                max_members: max_members.clamp(1, MAX_GROUP_MEMBERS as u8),
                members,
                damaged: false,
                aliases: Vec::new(),
            },
        );
        if let Some(old) = old {
            self.parity.unref_members(&old);
            self.parity
                .groups
                .get_mut(&(h.slot, group))
                .unwrap()
                .aliases = old.aliases;
        }
        self.counters.parity_groups_shipped += 1;
        self.maybe_merge(h.slot, group);
        Ok(PutStatus::Stored)
    }

    /// Applies one change to a group held here (Nswap Fig. 4, garbage collection, recovery);
    /// a repeated one is answered without being applied twice (see [`Delta`]).
    ///
    /// Who may (GMS §6, "Trust nobody on the wire"): the owner itself, on its own session
    /// ([`DeltaFrom::Owner`]), anything; another peer only if its certificate names the server
    /// role and the node id the owner named for the member's server when it shipped the group
    /// ([`Member::node`]), and only an update or removal of that member. Over clear TCP
    /// ([`Peer::Addr`]) there are no identities to check. Anything else is refused as an
    /// unknown group (nothing about the group is told) and counted.
    pub fn apply_delta(&mut self, d: &Delta<'_>, by: DeltaFrom) -> DeltaStatus {
        let Delta {
            owner,
            group,
            member: server,
            key,
            from,
            to,
            kind,
            ref record,
        } = *d;
        let remove = kind != DeltaKind::Update;
        let refuse = |st: &mut Self| {
            st.counters.parity_deltas_refused += 1;
            DeltaStatus::UnknownGroup
        };
        // A member's server: it must be certified as a server (over TLS), and may not drop
        // members (only the owner knows what cannot be rebuilt).
        let sender = match by {
            DeltaFrom::Owner => None,
            DeltaFrom::Peer(Peer::Addr(_)) if kind != DeltaKind::Drop => None,
            DeltaFrom::Peer(Peer::Server(n)) if kind != DeltaKind::Drop => Some(n),
            DeltaFrom::Peer(_) => return refuse(self),
        };
        // The owner's session here, found by its principal, node and incarnation: a client's
        // sessions with different servers (or after a reconnection) have different ids, and
        // group ids are unique per node incarnation; no other principal's session is looked at.
        let slot = (0..self.sessions.len() as u32).find(|&i| {
            self.is_owner(i, owner)
                && self
                    .parity
                    .groups
                    .contains_key(&(i, self.parity.resolve(i, group)))
        });
        let Some(slot) = slot else {
            self.counters.parity_deltas_unknown += 1;
            return DeltaStatus::UnknownGroup;
        };
        let id = self.parity.resolve(slot, group);
        let g = self
            .parity
            .groups
            .get_mut(&(slot, id))
            .expect("found above");
        if record.data.len() > PAGE_SIZE {
            self.counters.parity_deltas_unknown += 1;
            return DeltaStatus::UnknownGroup;
        }
        // The member is this copy of the page: another copy elsewhere (one its owner gave up
        // on) is not what the parity covers.
        let server = self.parity.addr_ids.get(&server).copied();
        let member = g
            .members
            .iter()
            .position(|m| Some(m.0) == server && m.1 == key);
        if let (Some(n), Some(i)) = (sender, member) {
            if g.members[i].3 != n {
                // Another server than the one the owner placed this member on.
                self.counters.parity_deltas_refused += 1;
                return DeltaStatus::UnknownGroup;
            }
        }
        if kind == DeltaKind::Drop {
            if let Some(i) = member {
                let (gone, _, _, _) = g.members.swap_remove(i);
                g.damaged = true;
                let empty = g.members.is_empty();
                self.parity.unref(gone);
                self.counters.parity_members_dropped += 1;
                if empty {
                    self.free_group(slot, id);
                }
            }
            return DeltaStatus::Applied;
        }
        match member.map(|i| g.members[i].2) {
            // Already gone: a repeated removal.
            None if remove => {
                self.counters.parity_deltas_repeated += 1;
                return DeltaStatus::Applied;
            }
            Some(v) if v == from => {}
            Some(v) if !remove && v == to => {
                self.counters.parity_deltas_repeated += 1;
                return DeltaStatus::Applied;
            }
            // Not a member (any more): the parity does not cover the page, so the group is
            // not hurt; the page leaves it (see `DeltaStatus::UnknownGroup`).
            None => {
                self.counters.parity_deltas_unknown += 1;
                return DeltaStatus::UnknownGroup;
            }
            Some(_) => {
                g.damaged = true;
                self.counters.parity_deltas_stale += 1;
                return DeltaStatus::Stale;
            }
        }
        let i = member.expect("matched above");
        g.version ^= record.version;
        g.crc ^= record.crc;
        g.flags ^= record.flags;
        let at = g.frame as usize * PAGE_SIZE;
        // A shorter record's rest is zeros (`netram_proto::page::trim`), which XOR leaves.
        let n = record.data.len();
        netram_proto::parity::xor_into(&mut self.arena.as_mut()[at..at + n], record.data);
        self.counters.parity_deltas_applied += 1;
        if !remove {
            g.members[i].2 = to;
        } else {
            let (gone, _, _, _) = g.members.swap_remove(i);
            let empty = g.members.is_empty();
            self.parity.unref(gone);
            self.counters.parity_members_removed += 1;
            if empty {
                self.free_group(slot, id);
            } else {
                self.maybe_merge(slot, id);
            }
        }
        DeltaStatus::Applied
    }

    fn free_group(&mut self, slot: u32, id: u64) {
        let Some(g) = self.parity.groups.remove(&(slot, id)) else {
            return;
        };
        let zero = g.version == 0
            && g.crc == 0
            && g.flags == 0
            && self.frame(g.frame).iter().all(|&b| b == 0);
        self.parity.unref_members(&g);
        if g.damaged {
            self.counters.parity_groups_damaged += 1;
        } else if !zero {
            self.counters.parity_groups_inconsistent += 1;
        }
        for a in &g.aliases {
            self.parity.alias.remove(&(slot, *a));
        }
        if let Some(small) = self.parity.small.get_mut(&slot) {
            small.retain(|&s| s != id);
        }
        self.release_frame(g.frame);
        self.page_freed(slot);
        self.counters.parity_groups_freed += 1;
    }

    /// Merges `id`, if it is at most half full, with another small group of the session whose
    /// members are all on other servers (so that no server holds two pieces of the result).
    fn maybe_merge(&mut self, slot: u32, id: u64) {
        let Some(g) = self.parity.groups.get(&(slot, id)) else {
            return;
        };
        let (n, max) = (g.members.len(), usize::from(g.max_members));
        let small = self.parity.small.entry(slot).or_default();
        small.retain(|&s| s != id);
        if n * 2 > max || g.damaged {
            // A damaged group's parity would damage its partner.
            return;
        }
        let partner = small
            .iter()
            .rev()
            .take(MERGE_CANDIDATES)
            .copied()
            .find(|&o| {
                self.parity.groups.get(&(slot, o)).is_some_and(|og| {
                    !og.damaged
                        && og.members.len() + n <= max
                        && og.members.iter().all(|(s, k, _, _)| {
                            // Deltas name a member by key: one page twice in a group (a copy
                            // its owner gave up on and the copy that replaced it) would make
                            // them ambiguous.
                            g.members.iter().all(|(t, l, _, _)| s != t && k != l)
                        })
                })
            });
        let Some(keep) = partner else {
            small.push(id);
            return;
        };
        small.retain(|&s| s != keep);
        // Fold `id` into `keep`.
        let gone = self.parity.groups.remove(&(slot, id)).unwrap();
        let src = gone.frame as usize * PAGE_SIZE;
        let kept = self.parity.groups.get_mut(&(slot, keep)).unwrap();
        let dst = kept.frame as usize * PAGE_SIZE;
        let arena = self.arena.as_mut();
        let (lo, hi) = arena.split_at_mut(src.max(dst));
        let (a, b) = if dst < src {
            (&mut lo[dst..dst + PAGE_SIZE], &hi[..PAGE_SIZE])
        } else {
            (&mut hi[..PAGE_SIZE], &lo[src..src + PAGE_SIZE])
        };
        netram_proto::parity::xor_into(a, b);
        kept.version ^= gone.version;
        kept.crc ^= gone.crc;
        kept.flags ^= gone.flags;
        kept.members.extend_from_slice(&gone.members);
        kept.damaged |= gone.damaged;
        kept.aliases.push(id);
        kept.aliases.extend_from_slice(&gone.aliases);
        for a in std::iter::once(id).chain(gone.aliases.iter().copied()) {
            self.parity.alias.insert((slot, a), keep);
        }
        let still_small = kept.members.len() * 2 <= usize::from(kept.max_members);
        self.release_frame(gone.frame);
        self.page_freed(slot);
        self.counters.parity_groups_merged += 1;
        if still_small {
            self.parity.small.entry(slot).or_default().push(keep);
        }
    }

    /// Pages of the session stored here whose parity was on `dead`: their tags are dropped (they
    /// are outside any group from now on) and at most `max` of their keys returned. The owner
    /// protects them again and asks until none are left.
    pub fn orphans(
        &mut self,
        h: SessionHandle,
        dead: SocketAddr,
        max: usize,
    ) -> Result<Vec<PageKey>, StoreError> {
        self.session(h, 0)?;
        let Some(&dead) = self.parity.addr_ids.get(&dead) else {
            return Ok(Vec::new());
        };
        let frames: Vec<u32> = self
            .parity
            .tags
            .iter()
            .filter(|(&f, t)| t.holder == dead && self.meta[f as usize].slot() == h.slot)
            .map(|(&f, _)| f)
            .take(max)
            .collect();
        let keys = frames
            .iter()
            .map(|&f| {
                self.parity.remove_tag(f);
                let k = self.meta[f as usize].packed_key();
                PageKey::new((k >> 40) as u32, k & PAGE_NUMBER_MAX)
            })
            .collect::<Vec<_>>();
        self.counters.parity_orphans_reported += keys.len() as u64;
        Ok(keys)
    }

    /// Groups of the session held here with a member on `dead`, or damaged, at most `max` and
    /// at most `max_bytes` of them on the wire, with their parity: what the owner reconstructs
    /// the dead server's pages from, or dissolves (a damaged group rebuilds nothing). `dead`
    /// may be no server at all. The owner asks again until a scan reports nothing, so a reply
    /// cut short by the byte limit loses nothing. With [`netram_proto::SCAN_LEAVING`]: the
    /// groups whose parity frame is above a shrunk offer, damaged or not (their members move
    /// into new groups and they empty).
    pub fn groups_with_member_on(
        &self,
        h: SessionHandle,
        dead: SocketAddr,
        max: usize,
        max_bytes: usize,
    ) -> Vec<GroupRecord<'_>> {
        match self.sessions.get(h.slot as usize) {
            Some(s) if s.live && s.generation == h.generation => {}
            _ => return Vec::new(),
        }
        let leaving =
            (dead == netram_proto::SCAN_LEAVING).then(|| &self.sessions[h.slot as usize].beyond);
        let dead = self.parity.addr_ids.get(&dead).copied();
        self.parity
            .groups
            .range((h.slot, 0)..=(h.slot, u64::MAX))
            .filter(|(_, g)| match leaving {
                Some(beyond) => beyond.contains(&g.frame),
                None => g.damaged || g.members.iter().any(|m| Some(m.0) == dead),
            })
            .take(max)
            .map(|((_, id), g)| GroupRecord {
                group: *id,
                damaged: g.damaged,
                members: self.members(g),
                record: self.parity_record(g),
            })
            .scan(0usize, |bytes, g| {
                *bytes += g.wire_len();
                (*bytes <= max_bytes).then_some(g)
            })
            .collect()
    }

    /// A group's members as the wire names them.
    fn members(&self, g: &Group) -> Vec<Member> {
        g.members
            .iter()
            .map(|&(s, key, version, node)| Member {
                server: self.parity.addr(s),
                node,
                key,
                version,
            })
            .collect()
    }

    /// A group's parity: its envelope fields' XOR and its frame.
    fn parity_record(&self, g: &Group) -> Record<'_> {
        Record {
            version: g.version,
            crc: g.crc,
            flags: g.flags,
            data: self.frame(g.frame),
        }
    }

    /// The members of every group a live session owns here that can still rebuild one of them,
    /// for checkers: a damaged group (a stale delta, or a member its owner dropped) covers
    /// nothing.
    pub fn session_groups(&self, h: SessionHandle) -> Vec<(u64, Vec<Member>, Record<'_>)> {
        match self.sessions.get(h.slot as usize) {
            Some(s) if s.live && s.generation == h.generation => {}
            _ => return Vec::new(),
        }
        self.parity
            .groups
            .range((h.slot, 0)..=(h.slot, u64::MAX))
            .filter(|(_, g)| !g.damaged)
            .map(|(&(_, id), g)| (id, self.members(g), self.parity_record(g)))
            .collect()
    }

    /// Every group held here, for checkers: owner, group id, members and parity.
    pub fn held_groups(&self) -> Vec<(Owner, u64, Vec<Member>, Record<'_>)> {
        self.parity
            .groups
            .iter()
            .map(|(&(slot, id), g)| {
                let s = &self.sessions[slot as usize];
                (
                    Owner {
                        principal: s.peer.principal(),
                        node: s.node,
                        incarnation: s.incarnation,
                    },
                    id,
                    self.members(g),
                    self.parity_record(g),
                )
            })
            .collect()
    }
}
