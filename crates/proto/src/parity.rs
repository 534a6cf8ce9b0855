//! Nswap's dynamic parity on the wire (paper 004, §IV-B and IV-C, decentralized).
//!
//! A client XORs the pages it writes out into an in-progress parity page and ships it, once per N
//! page-outs, to any server ([`crate::Request::ParityShip`]); from then on only that server, the
//! group's *holder*, knows the group. Each member page carries a tag naming its holder and group
//! ([`ParityOp::Join`]), kept by the server that stores the page. When that page is overwritten or
//! deleted, its server sends the XOR of the old and new contents to the holder
//! ([`crate::Request::ParityDelta`]) and only then acknowledges the client, so that the parity
//! always covers what is stored. A holder that loses members merges small groups by itself.
//!
//! What a parity page covers is a [`Record`]: the envelope fields the page checksum covers
//! (version, checksum, flags) and the data, a zero page counting as zeros. XORing the records of
//! the surviving members into the parity gives the lost member's record back, checksum included,
//! so that a reconstruction is verified like any page read.

use crate::codec::{DecodeError, FrameBuilder, Reader};
use crate::page::{Page, PageFlags, PageKey};
use crate::{NodeId, PAGE_SIZE};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The most members one parity group may have (the scheme's `parity:N` allows up to this N).
pub const MAX_GROUP_MEMBERS: usize = 16;

/// Bytes of a [`Record`] on the wire.
pub const RECORD_LEN: usize = 10 + PAGE_SIZE;

/// Bytes of a server address on the wire: family, 16 address bytes, port.
pub const ADDR_LEN: usize = 19;

/// A server as clients reach it: its listening address. Members and holders are named by it so
/// that any server can forward a delta to any other.
pub(crate) fn encode_addr(a: &SocketAddr, w: &mut FrameBuilder<'_>) {
    let mut ip = [0u8; 16];
    let family = match a.ip() {
        IpAddr::V4(v4) => {
            ip[..4].copy_from_slice(&v4.octets());
            4
        }
        IpAddr::V6(v6) => {
            ip = v6.octets();
            6
        }
    };
    w.u8(family).bytes(&ip).u16(a.port());
}

pub(crate) fn decode_addr(r: &mut Reader<'_>) -> Result<SocketAddr, DecodeError> {
    let family = r.u8()?;
    let ip: [u8; 16] = r.array()?;
    let port = r.u16()?;
    let ip = match family {
        4 => {
            if ip[4..].iter().any(|&b| b != 0) {
                return Err(DecodeError::Reserved {
                    field: "IPv4 address padding",
                    value: 1,
                });
            }
            IpAddr::V4(Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3]))
        }
        6 => IpAddr::V6(Ipv6Addr::from(ip)),
        v => {
            return Err(DecodeError::BadValue {
                field: "address family",
                value: v.into(),
            })
        }
    };
    Ok(SocketAddr::new(ip, port))
}

/// One page of a group: the server that stores it (its address, and its node id as its
/// certificate names it), its key in the owner's session and the version the parity covers
/// (which makes deltas safe to repeat, and lets the owner check that a survivor it reads is the
/// one the parity was made with). The node id is the owner's word to the holder: only that
/// server may send deltas about this member (GMS §6; the "authenticated server list" of
/// "Trust nobody on the wire").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Member {
    pub server: SocketAddr,
    /// The member's server, as its certificate names it (0 over clear TCP).
    pub node: NodeId,
    pub key: PageKey,
    pub version: u32,
}

impl Member {
    pub const WIRE_LEN: usize = ADDR_LEN + 8 + PageKey::WIRE_LEN + 4;

    pub(crate) fn encode(&self, w: &mut FrameBuilder<'_>) {
        encode_addr(&self.server, w);
        w.u64(self.node);
        self.key.encode(w);
        w.u32(self.version);
    }
    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            server: decode_addr(r)?,
            node: r.u64()?,
            key: PageKey::decode(r)?,
            version: r.u32()?,
        })
    }
}

/// Whose group a delta is for: the owning client as the member's server knows it — the node
/// its certificate names (its principal; 0 over clear TCP), and the node id and incarnation
/// of its handshake. Holders look groups up by all three (a client's sessions at different
/// servers have different ids; its group ids are unique across them). No session id travels:
/// what names a session is bound to its principal, not a secret to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Owner {
    pub principal: NodeId,
    pub node: NodeId,
    pub incarnation: u64,
}

impl Owner {
    /// How an owner names itself in a delta it sends (taking a rebuilt page out of its group):
    /// the holder reads it as the session the delta came on.
    pub const SELF: Owner = Owner {
        principal: 0,
        node: 0,
        incarnation: 0,
    };
}

/// The XOR-able image of a stored page (or of a parity page: the XOR of its members' images).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    pub version: u32,
    pub crc: u32,
    pub flags: u16,
    /// `PAGE_SIZE` bytes; fewer for the record of a page that travelled without its zero
    /// tail ([`crate::page::trim`]): the rest is zeros.
    pub data: &'a [u8],
}

/// `PAGE_SIZE` zero bytes: the data of a zero page's record.
pub static ZERO_PAGE: [u8; PAGE_SIZE] = [0; PAGE_SIZE];

impl<'a> Record<'a> {
    /// The record of a page as it is stored.
    pub fn of(page: &Page<'a>) -> Self {
        Self {
            version: page.version,
            crc: page.crc,
            flags: page.flags.0,
            data: if page.flags.is_zero() {
                &ZERO_PAGE
            } else {
                page.data
            },
        }
    }

    /// The page this record is, under `key`: what a reconstruction yields. Its checksum tells
    /// whether the reconstruction was right.
    pub fn page(&self, key: PageKey) -> Page<'a> {
        let flags = PageFlags(self.flags);
        Page {
            key,
            version: self.version,
            crc: self.crc,
            flags,
            tag: [0; crate::TAG_LEN],
            data: if flags.is_zero() { &[] } else { self.data },
        }
    }

    pub(crate) fn encode(&self, w: &mut FrameBuilder<'_>) {
        debug_assert!(self.data.len() <= PAGE_SIZE);
        w.u32(self.version)
            .u32(self.crc)
            .u16(self.flags)
            .bytes(self.data)
            .bytes(&ZERO_PAGE[self.data.len()..]);
    }
    pub(crate) fn decode(r: &mut Reader<'a>) -> Result<Self, DecodeError> {
        Ok(Self {
            version: r.u32()?,
            crc: r.u32()?,
            flags: r.u16()?,
            data: r.bytes(PAGE_SIZE)?,
        })
    }
}

/// An owned record: what holders keep and clients accumulate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedRecord {
    pub version: u32,
    pub crc: u32,
    pub flags: u16,
    pub data: Box<[u8]>,
}

impl Default for OwnedRecord {
    fn default() -> Self {
        Self {
            version: 0,
            crc: 0,
            flags: 0,
            data: vec![0; PAGE_SIZE].into_boxed_slice(),
        }
    }
}

impl OwnedRecord {
    /// XORs `r` into this record.
    pub fn xor(&mut self, r: &Record<'_>) {
        self.version ^= r.version;
        self.crc ^= r.crc;
        self.flags ^= r.flags;
        // A shorter record's rest is zeros, which XOR leaves alone.
        xor_into(&mut self.data[..r.data.len()], r.data);
    }
    pub fn as_record(&self) -> Record<'_> {
        Record {
            version: self.version,
            crc: self.crc,
            flags: self.flags,
            data: &self.data,
        }
    }
    pub fn is_zero(&self) -> bool {
        self.version == 0 && self.crc == 0 && self.flags == 0 && self.data.iter().all(|&b| b == 0)
    }
}

/// `dst ^= src`, a word at a time (the compiler vectorises the chunks).
pub fn xor_into(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len());
    let mut d = dst.chunks_exact_mut(8);
    let mut s = src.chunks_exact(8);
    for (d, s) in (&mut d).zip(&mut s) {
        let x =
            u64::from_ne_bytes(d.try_into().unwrap()) ^ u64::from_ne_bytes(s.try_into().unwrap());
        d.copy_from_slice(&x.to_ne_bytes());
    }
    for (d, s) in d.into_remainder().iter_mut().zip(s.remainder()) {
        *d ^= s;
    }
}

/// `out` = the XOR of `srcs` (each as long as `out`), in blocks that stay in registers: one
/// pass over each source and one write of `out`, where repeated [`xor_into`] would read and
/// write `out` once per source (a third faster on pages out of cache).
pub fn xor_of(out: &mut [u8], srcs: &[&[u8]]) {
    const BLOCK: usize = 256;
    assert!(srcs.iter().all(|s| s.len() == out.len()));
    let mut at = 0;
    for o in out.chunks_mut(BLOCK) {
        let mut acc = [0u64; BLOCK / 8];
        for s in srcs {
            let s = &s[at..at + o.len()];
            for (x, w) in acc.iter_mut().zip(s.chunks_exact(8)) {
                *x ^= u64::from_ne_bytes(w.try_into().unwrap());
            }
        }
        for (w, x) in o.chunks_exact_mut(8).zip(acc) {
            w.copy_from_slice(&x.to_ne_bytes());
        }
        // A block shorter than a word at the end: byte by byte.
        for i in o.len() / 8 * 8..o.len() {
            o[i] = srcs.iter().fold(0, |b, s| b ^ s[at + i]);
        }
        at += o.len();
    }
}

/// What a page of a [`crate::Request::PutParity`] does to its parity group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParityOp {
    /// An overwrite in place: the page stays in the group it is in, and the server sends the
    /// XOR of old and new to that group's holder before it acknowledges (Nswap Fig. 4). A page
    /// the server does not have, or whose group is gone, is stored outside any group and
    /// answered [`crate::PutStatus::Unprotected`].
    Keep,
    /// The page becomes a member of `group`, whose parity page the client will ship to
    /// `holder` (Nswap Fig. 3). An older version under the key leaves its old group first.
    /// `member` is the address the client reaches this server at, as the group's member list
    /// names it: the server's deltas carry it, so that the holder tells this copy from another
    /// copy of the same page elsewhere. `holder_node` is the holder's node id as its
    /// certificate names it: the server forwards deltas to `holder` only if the server there
    /// proves to be that node (a client cannot make it talk to anyone else).
    Join {
        holder: SocketAddr,
        holder_node: u64,
        group: u64,
        member: SocketAddr,
    },
}

impl ParityOp {
    pub(crate) fn encode(&self, w: &mut FrameBuilder<'_>) {
        match self {
            ParityOp::Keep => {
                w.u8(0);
            }
            ParityOp::Join {
                holder,
                holder_node,
                group,
                member,
            } => {
                w.u8(1);
                encode_addr(holder, w);
                w.u64(*holder_node);
                w.u64(*group);
                encode_addr(member, w);
            }
        }
    }
    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match r.u8()? {
            0 => Ok(ParityOp::Keep),
            1 => Ok(ParityOp::Join {
                holder: decode_addr(r)?,
                holder_node: r.u64()?,
                group: r.u64()?,
                member: decode_addr(r)?,
            }),
            v => Err(DecodeError::BadValue {
                field: "parity op",
                value: v.into(),
            }),
        }
    }
}

/// One change to a group's parity, sent to its holder. The member is named by its server (as
/// the group's member list names it) and key, and by the version the parity must cover now
/// (`from`); an update leaves it covering `to`. A copy of the page on another server (one its
/// owner gave up on, whose late request arrives now) is not the member, and its delta leaves
/// the group alone. A holder that already covers `to` answers a repeated update
/// as applied without applying it again, and a repeated removal of a member no longer there
/// likewise, so a sender that lost the answer can safely send again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delta<'a> {
    pub owner: Owner,
    pub group: u64,
    pub member: SocketAddr,
    pub key: PageKey,
    pub from: u32,
    pub to: u32,
    pub kind: DeltaKind,
    pub record: Record<'a>,
}

/// What a delta does to its member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DeltaKind {
    /// An overwrite: `record` is old ⊕ new.
    Update = 0,
    /// The member leaves the group: `record` is its last image (garbage collection, a page
    /// moving to another group, a reconstructed page).
    Remove = 1,
    /// The member leaves a group that could not rebuild it (more of the group was lost than the
    /// parity covers): nothing is XORed, and the group is damaged from now on.
    Drop = 2,
}

impl<'a> Delta<'a> {
    pub const MIN_WIRE_LEN: usize = 24 + 8 + ADDR_LEN + PageKey::WIRE_LEN + 8 + 1 + RECORD_LEN;

    pub(crate) fn encode(&self, w: &mut FrameBuilder<'_>) {
        w.u64(self.owner.principal)
            .u64(self.owner.node)
            .u64(self.owner.incarnation)
            .u64(self.group);
        encode_addr(&self.member, w);
        self.key.encode(w);
        w.u32(self.from).u32(self.to).u8(self.kind as u8);
        self.record.encode(w);
    }
    pub(crate) fn decode(r: &mut Reader<'a>) -> Result<Self, DecodeError> {
        let owner = Owner {
            principal: r.u64()?,
            node: r.u64()?,
            incarnation: r.u64()?,
        };
        let group = r.u64()?;
        let member = decode_addr(r)?;
        let key = PageKey::decode(r)?;
        let (from, to) = (r.u32()?, r.u32()?);
        let kind = match r.u8()? {
            0 => DeltaKind::Update,
            1 => DeltaKind::Remove,
            2 => DeltaKind::Drop,
            v => {
                return Err(DecodeError::BadValue {
                    field: "delta kind",
                    value: v.into(),
                })
            }
        };
        Ok(Self {
            owner,
            group,
            member,
            key,
            from,
            to,
            kind,
            record: Record::decode(r)?,
        })
    }
}

/// What a holder did with one delta.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DeltaStatus {
    Applied = 0,
    /// The holder has no such group for that owner (its session ended, or the holder restarted),
    /// or the group no longer lists the page (its owner took it out, for example after giving
    /// up on the member's server, whose late write then arrives): the parity does not cover the
    /// page, so the member's server takes it out of the group and the owner protects it again.
    UnknownGroup = 1,
    /// The group's parity covers another version of the member than the delta starts from: an
    /// earlier answer was lost after all. The holder marks the group damaged; the member's
    /// server takes the page out of the group, and the owner protects it again.
    Stale = 2,
}

/// A group as its holder reports it to the owner during recovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRecord<'a> {
    pub group: u64,
    /// A delta did not match the member it was for ([`DeltaStatus::Stale`]), or the owner
    /// dropped a member: the parity rebuilds nothing, and the owner must protect the members
    /// again elsewhere.
    pub damaged: bool,
    pub members: Vec<Member>,
    pub record: Record<'a>,
}

impl<'a> GroupRecord<'a> {
    pub const MIN_WIRE_LEN: usize = 8 + 1 + 4 + RECORD_LEN;

    /// Its length on the wire.
    pub fn wire_len(&self) -> usize {
        Self::MIN_WIRE_LEN + self.members.len() * Member::WIRE_LEN
    }

    pub(crate) fn encode(&self, w: &mut FrameBuilder<'_>) {
        w.u64(self.group).u8(u8::from(self.damaged));
        encode_members(&self.members, w);
        self.record.encode(w);
    }
    pub(crate) fn decode(r: &mut Reader<'a>) -> Result<Self, DecodeError> {
        let group = r.u64()?;
        let damaged = match r.u8()? {
            0 => false,
            1 => true,
            v => {
                return Err(DecodeError::Reserved {
                    field: "group flags",
                    value: v.into(),
                })
            }
        };
        Ok(Self {
            group,
            damaged,
            members: decode_members(r)?,
            record: Record::decode(r)?,
        })
    }
}

pub(crate) fn encode_members(m: &[Member], w: &mut FrameBuilder<'_>) {
    w.u32(m.len() as u32);
    m.iter().for_each(|m| m.encode(w));
}

pub(crate) fn decode_members(r: &mut Reader<'_>) -> Result<Vec<Member>, DecodeError> {
    let n = r.u32()? as usize;
    if n > MAX_GROUP_MEMBERS || n * Member::WIRE_LEN > r.remaining() {
        return Err(DecodeError::BatchTooLarge { count: n });
    }
    (0..n).map(|_| Member::decode(r)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xor_of_many_is_xor_into_one_by_one_at_any_length() {
        for len in [0, 1, 7, 8, 255, 256, 257, 1000, PAGE_SIZE] {
            let srcs: Vec<Vec<u8>> = (0..5u8)
                .map(|i| {
                    (0..len)
                        .map(|b| (b as u8).wrapping_mul(i + 3) ^ i)
                        .collect()
                })
                .collect();
            let mut want = vec![0u8; len];
            for s in &srcs {
                xor_into(&mut want, s);
            }
            let refs: Vec<&[u8]> = srcs.iter().map(Vec::as_slice).collect();
            let mut got = vec![0xAAu8; len];
            xor_of(&mut got, &refs);
            assert_eq!(got, want, "length {len}");
        }
    }

    #[test]
    fn a_lost_member_comes_back_from_the_parity_and_the_others_with_its_checksum() {
        let datas: Vec<Vec<u8>> = (0..4u8)
            .map(|i| {
                (0..PAGE_SIZE)
                    .map(|b| (b as u8).wrapping_mul(i + 3))
                    .collect()
            })
            .collect();
        let mut pages: Vec<Page<'_>> = datas
            .iter()
            .enumerate()
            .map(|(i, d)| Page::seal(PageKey::new(1, i as u64), 7 + i as u32, d))
            .collect();
        // A zero page is a member like any other.
        pages.push(Page {
            key: PageKey::new(1, 9),
            version: 2,
            crc: crate::page_checksum(PageKey::new(1, 9), 2, PageFlags(PageFlags::ZERO), &[]),
            flags: PageFlags(PageFlags::ZERO),
            tag: [0; crate::TAG_LEN],
            data: &[],
        });
        let mut parity = OwnedRecord::default();
        pages.iter().for_each(|p| parity.xor(&Record::of(p)));
        for lost in 0..pages.len() {
            let mut r = parity.clone();
            for (i, p) in pages.iter().enumerate() {
                if i != lost {
                    r.xor(&Record::of(p));
                }
            }
            let back = r.as_record().page(pages[lost].key);
            assert!(back.verify(), "member {lost}");
            assert_eq!(back, pages[lost]);
        }
        // Removing every member leaves nothing.
        pages.iter().for_each(|p| parity.xor(&Record::of(p)));
        assert!(parity.is_zero());
    }
}
