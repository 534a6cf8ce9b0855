//! Frames after the handshake: requests from the client, replies from the server.
//!
//! ```text
//! frame  = len:u32 (bytes after this field) | version:u8 | kind:u8 | flags:u16 (0) | req_id:u64 | body
//! ```
//!
//! Requests are PUT, GET and DELETE of one or many pages (Anemone's page-out, page-in and Nswap's
//! garbage collection), REFRESH of the session lease (Anemone §2.5), STATS and CLOSE. Every reply
//! starts with the server's [`Load`] (Anemone §2.4). A full server answers a PUT with
//! [`crate::message::PutStatus::Full`] for each page it could not take (Anemone's NACK); it never
//! drops a page silently. REFRESH is one-way: a client that is idle does not read, so a reply
//! would pile up in its socket.
//!
//! Nswap's dynamic parity adds four requests (see [`crate::parity`]): PUT_PARITY (pages with what
//! they do to their parity group), PARITY_SHIP (a finished parity page), PARITY_DELTA (a change to
//! a group's parity, from the server of a member or from the owner) and PARITY_SCAN (the owner
//! asks what a dead server leaves behind).
//!
//! Nswap's migration (§III, Fig. 2) adds three: EXPECT (the owner tells the page's new server
//! which pages of its session another server will hand it, and from which node), MIGRATE (the
//! owner asks the page's old server to hand pages to the new one) and ADOPT (the old server
//! hands them over, on its own peer session, naming the owner). The page's bytes go from
//! server to server; the owner sends only keys, learns the outcome from MIGRATE's reply (Nswap's
//! UPDATE) and deletes the old copies (INVALIDATE). All three are answered with a MOVE reply.

use crate::codec::{DecodeError, FrameBuilder, Reader};
use crate::page::{Page, PageKey, ENVELOPE_LEN};
use crate::parity::{
    decode_addr, decode_members, encode_addr, encode_members, Delta, DeltaStatus, GroupRecord,
    Member, Owner, ParityOp, Record,
};
use crate::{FRAME_HEADER_LEN, FRAME_VERSION, MAX_FRAME_LEN};
use std::net::SocketAddr;

/// The kind byte of a frame. Requests have the high bit clear, replies set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Put = 0x01,
    Get = 0x02,
    Delete = 0x03,
    Refresh = 0x04,
    Stats = 0x05,
    Close = 0x06,
    PutParity = 0x07,
    ParityShip = 0x08,
    ParityDelta = 0x09,
    ParityScan = 0x0a,
    Expect = 0x0b,
    Migrate = 0x0c,
    Adopt = 0x0d,
    /// GMS (`crate::gms`): epoch messages between daemons, clean pages to and from daemons.
    GmsEpoch = 0x0e,
    PutCached = 0x0f,
    GetCached = 0x10,
    /// GMS's global-cache directory (`crate::gms`): which nodes hold a shared page.
    GcdUpdate = 0x11,
    /// Distributed shared memory (`crate::dsm`): one-way messages between a segment's sites.
    Dsm = 0x12,
    PutReply = 0x81,
    GetReply = 0x82,
    DeleteReply = 0x83,
    StatsReply = 0x85,
    CloseReply = 0x86,
    ParityDeltaReply = 0x89,
    ParityScanReply = 0x8a,
    MoveReply = 0x8c,
    PutCachedReply = 0x8f,
    GetCachedReply = 0x90,
    GcdUpdateReply = 0x91,
    Error = 0xff,
}

/// What a [`Request::ParityScan`] names instead of a dead server to ask a shrinking holder for
/// the groups whose parity it holds above its offer (Nswap §III: those frames must leave too,
/// and only the holder knows which groups they are). No server listens on port 0.
pub const SCAN_LEAVING: std::net::SocketAddr = std::net::SocketAddr::V4(
    std::net::SocketAddrV4::new(std::net::Ipv4Addr::BROADCAST, 0),
);

/// A client's request. Pages borrow from the received frame: the server copies them once,
/// straight into its arena.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    Put(Vec<Page<'a>>),
    Get(Vec<PageKey>),
    Delete(Vec<PageKey>),
    Refresh,
    Stats,
    /// The session ends: the server frees its pages now instead of at lease expiry.
    Close,
    /// PUT of pages under dynamic parity; answered like a PUT. One key may appear only once.
    PutParity(Vec<(Page<'a>, ParityOp)>),
    /// A parity page for `group`, covering `members`; the server becomes the group's holder.
    /// `max_members` is the owner's N: the holder merges small groups up to it. Answered like a
    /// PUT of one page.
    ParityShip {
        group: u64,
        max_members: u8,
        members: Vec<Member>,
        record: Record<'a>,
    },
    /// Changes to groups this server holds.
    ParityDelta(Vec<Delta<'a>>),
    /// The owner asks, for its session, which groups held here have a member on the dead server
    /// or are damaged (at most `max`, with their parity), and which of its pages stored here had
    /// their parity on it (their tags are dropped as they are reported: they are outside any
    /// group now). `dead` may name no server at all: then only damaged groups are reported —
    /// the owner's audit after a write whose holder may or may not have changed its group.
    /// [`SCAN_LEAVING`] asks instead for the groups whose parity page is held above a shrunk
    /// offer here: the owner moves their members into new groups, and they empty and leave.
    ParityScan {
        dead: SocketAddr,
        max: u32,
    },
    /// The owner tells a server that `from_node` (a server, as its certificate names it; any
    /// server over clear TCP) will hand it these pages of this session, at these versions
    /// ([`Request::Adopt`]). An expectation lasts a few seconds and is used once.
    Expect {
        from_node: u64,
        pages: Vec<(PageKey, u32)>,
    },
    /// The owner asks this server to hand these pages of its session to the server at `to`,
    /// which must prove to be node `to_node`, and keeps its own copies (the owner deletes them
    /// once its table names the new server).
    Migrate {
        to: SocketAddr,
        to_node: u64,
        keys: Vec<PageKey>,
    },
    /// A server hands pages of `owner`'s session to this one, as the owner said it would
    /// ([`Request::Expect`]); sent on the sender's own peer session.
    Adopt {
        owner: Owner,
        pages: Vec<Page<'a>>,
    },
}

/// What the server tells every reply about itself, so that clients place pages without asking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Load {
    /// Frames a new page may take. Zero while pages wait above a shrunk offer: the frames
    /// freed below it are theirs.
    pub free_pages: u64,
    /// Requests served in the last second.
    pub requests_per_s: u32,
    /// Pages of the asking session held above the server's offer (Nswap §III: the donor
    /// shrinks, its pages must move): the owner moves that many of its pages elsewhere.
    pub leaving: u32,
}

impl Load {
    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            free_pages: r.u64()?,
            requests_per_s: r.u32()?,
            leaving: r.u32()?,
        })
    }
    pub fn encode(&self, w: &mut FrameBuilder<'_>) {
        w.u64(self.free_pages)
            .u32(self.requests_per_s)
            .u32(self.leaving);
    }
}

/// The fate of one page of a PUT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PutStatus {
    Stored = 0,
    /// No free frame: Anemone's NACK. The client places the page elsewhere.
    Full = 1,
    /// The key is outside what this server can index (see `netram-store`'s key limits).
    BadKey = 2,
    /// Stored, but outside any parity group (a Keep of a page the server did not have, or
    /// whose group is gone): the client protects it again.
    Unprotected = 3,
    /// Not stored, nothing changed: the page's parity holder could not be told. The client
    /// tries again, or declares the holder dead and scans.
    HolderUnreachable = 4,
    /// Not stored, nothing changed: the page's checksum does not match its contents (it was
    /// damaged on the way). The client places it again, from its own intact copy.
    Corrupt = 5,
}

/// The fate of one page of a DELETE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DeleteStatus {
    Deleted = 0,
    Missing = 1,
    /// Not deleted: the page's parity holder could not be told (see [`PutStatus`]).
    HolderUnreachable = 2,
}

/// The fate of one page of an EXPECT, MIGRATE or ADOPT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum MoveStatus {
    /// EXPECT: expected. ADOPT: stored. MIGRATE: the new server stored it.
    Done = 0,
    /// MIGRATE: the page is not here.
    Missing = 1,
    /// ADOPT: no expectation matches (another sender, another version, expired, or no such
    /// session of the owner). Nothing is stored.
    Unexpected = 2,
    /// No room for it (EXPECT: for as many expectations).
    Full = 3,
    /// ADOPT: the owner's session already holds the key (a newer write got there first).
    Exists = 4,
    /// MIGRATE: the new server could not be reached, or is not the node named.
    Unreachable = 5,
    /// ADOPT: the page's checksum does not match its contents.
    Corrupt = 6,
}

impl MoveStatus {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::Done,
            1 => Self::Missing,
            2 => Self::Unexpected,
            3 => Self::Full,
            4 => Self::Exists,
            5 => Self::Unreachable,
            6 => Self::Corrupt,
            _ => return None,
        })
    }
}

/// One page of a GET reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GetResult<'a> {
    Found(Page<'a>),
    Missing(PageKey),
}

/// A named counter in a STATS reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counter<'a> {
    pub name: &'a str,
    pub value: u64,
}

/// Why a well-formed request was refused. A malformed one closes the connection instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    /// The session's lease ran out and its pages were freed; the client must treat every page it
    /// had on this server as lost and open a new session.
    SessionExpired = 1,
    /// The server is shutting down.
    ShuttingDown = 2,
    /// A well-formed request the server does not accept (one key twice in a PUT_PARITY).
    BadRequest = 3,
}

/// A server's reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply<'a> {
    Put {
        load: Load,
        status: Vec<PutStatus>,
    },
    Get {
        load: Load,
        pages: Vec<GetResult<'a>>,
    },
    Delete {
        load: Load,
        status: Vec<DeleteStatus>,
    },
    Stats {
        load: Load,
        counters: Vec<Counter<'a>>,
    },
    Close {
        load: Load,
    },
    ParityDelta {
        load: Load,
        status: Vec<DeltaStatus>,
    },
    ParityScan {
        load: Load,
        groups: Vec<GroupRecord<'a>>,
        orphans: Vec<PageKey>,
    },
    /// The answer to EXPECT, MIGRATE and ADOPT: one status per page, in order.
    Move {
        load: Load,
        status: Vec<MoveStatus>,
    },
    Error {
        load: Load,
        code: ErrorCode,
        message: &'a str,
    },
}

impl Reply<'_> {
    pub fn load(&self) -> Load {
        match self {
            Reply::Put { load, .. }
            | Reply::Get { load, .. }
            | Reply::Delete { load, .. }
            | Reply::Stats { load, .. }
            | Reply::Close { load }
            | Reply::ParityDelta { load, .. }
            | Reply::ParityScan { load, .. }
            | Reply::Move { load, .. }
            | Reply::Error { load, .. } => *load,
        }
    }
}

/// How many bytes the frame at the start of `buf` occupies, once its length prefix has arrived;
/// `Ok(None)` while fewer than four bytes are there. A length outside the limits is an error at
/// once, before the body is waited for or buffered.
pub fn frame_len(buf: &[u8]) -> Result<Option<usize>, DecodeError> {
    let Some(prefix) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize + 4;
    if !(FRAME_HEADER_LEN..=MAX_FRAME_LEN).contains(&len) {
        return Err(DecodeError::BadLength {
            len,
            min: FRAME_HEADER_LEN,
            max: MAX_FRAME_LEN,
        });
    }
    Ok(Some(len))
}

/// Checks the header of one whole frame and returns its kind, request id and body.
pub(crate) fn split_frame(frame: &[u8]) -> Result<(u8, u64, Reader<'_>), DecodeError> {
    let len = frame_len(frame)?.ok_or_else(|| DecodeError::Truncated {
        needed: 4 - frame.len(),
    })?;
    if frame.len() != len {
        return Err(if frame.len() < len {
            DecodeError::Truncated {
                needed: len - frame.len(),
            }
        } else {
            DecodeError::TrailingBytes(frame.len() - len)
        });
    }
    let mut r = Reader::new(&frame[4..]);
    let version = r.u8()?;
    if version != FRAME_VERSION {
        return Err(DecodeError::UnsupportedVersion {
            got: version.into(),
        });
    }
    let kind = r.u8()?;
    r.reserved_u16("frame flags")?;
    let req_id = r.u64()?;
    Ok((kind, req_id, r))
}

fn keys(r: &mut Reader<'_>) -> Result<Vec<PageKey>, DecodeError> {
    let n = r.count(PageKey::WIRE_LEN)?;
    (0..n).map(|_| PageKey::decode(r)).collect()
}

/// Decodes one whole frame (length prefix included) sent by a client.
pub fn decode_request(frame: &[u8]) -> Result<(u64, Request<'_>), DecodeError> {
    let (kind, req_id, mut r) = split_frame(frame)?;
    let req = match kind {
        k if k == Kind::Put as u8 => {
            let n = r.count(ENVELOPE_LEN)?;
            Request::Put(
                (0..n)
                    .map(|_| Page::decode(&mut r))
                    .collect::<Result<_, _>>()?,
            )
        }
        k if k == Kind::Get as u8 => Request::Get(keys(&mut r)?),
        k if k == Kind::Delete as u8 => Request::Delete(keys(&mut r)?),
        k if k == Kind::Refresh as u8 => Request::Refresh,
        k if k == Kind::Stats as u8 => Request::Stats,
        k if k == Kind::Close as u8 => Request::Close,
        k if k == Kind::PutParity as u8 => {
            let n = r.count(ENVELOPE_LEN + 1)?;
            Request::PutParity(
                (0..n)
                    .map(|_| Ok((Page::decode(&mut r)?, ParityOp::decode(&mut r)?)))
                    .collect::<Result<_, DecodeError>>()?,
            )
        }
        k if k == Kind::ParityShip as u8 => Request::ParityShip {
            group: r.u64()?,
            max_members: r.u8()?,
            members: decode_members(&mut r)?,
            record: Record::decode(&mut r)?,
        },
        k if k == Kind::ParityDelta as u8 => {
            let n = r.count(Delta::MIN_WIRE_LEN)?;
            Request::ParityDelta(
                (0..n)
                    .map(|_| Delta::decode(&mut r))
                    .collect::<Result<_, _>>()?,
            )
        }
        k if k == Kind::ParityScan as u8 => Request::ParityScan {
            dead: decode_addr(&mut r)?,
            max: r.u32()?,
        },
        k if k == Kind::Expect as u8 => {
            let from_node = r.u64()?;
            let n = r.count(PageKey::WIRE_LEN + 4)?;
            Request::Expect {
                from_node,
                pages: (0..n)
                    .map(|_| Ok((PageKey::decode(&mut r)?, r.u32()?)))
                    .collect::<Result<_, DecodeError>>()?,
            }
        }
        k if k == Kind::Migrate as u8 => Request::Migrate {
            to: decode_addr(&mut r)?,
            to_node: r.u64()?,
            keys: keys(&mut r)?,
        },
        k if k == Kind::Adopt as u8 => {
            let owner = Owner {
                principal: r.u64()?,
                node: r.u64()?,
                incarnation: r.u64()?,
            };
            let n = r.count(ENVELOPE_LEN)?;
            Request::Adopt {
                owner,
                pages: (0..n)
                    .map(|_| Page::decode(&mut r))
                    .collect::<Result<_, _>>()?,
            }
        }
        k => return Err(DecodeError::UnknownKind(k)),
    };
    r.finish()?;
    Ok((req_id, req))
}

impl Request<'_> {
    pub fn kind(&self) -> Kind {
        match self {
            Request::Put(_) => Kind::Put,
            Request::Get(_) => Kind::Get,
            Request::Delete(_) => Kind::Delete,
            Request::Refresh => Kind::Refresh,
            Request::Stats => Kind::Stats,
            Request::Close => Kind::Close,
            Request::PutParity(_) => Kind::PutParity,
            Request::ParityShip { .. } => Kind::ParityShip,
            Request::ParityDelta(_) => Kind::ParityDelta,
            Request::ParityScan { .. } => Kind::ParityScan,
            Request::Expect { .. } => Kind::Expect,
            Request::Migrate { .. } => Kind::Migrate,
            Request::Adopt { .. } => Kind::Adopt,
        }
    }

    /// Appends this request as one frame to `out`.
    pub fn encode(&self, req_id: u64, out: &mut Vec<u8>) {
        let mut w = FrameBuilder::begin(out, self.kind() as u8, req_id);
        match self {
            Request::Put(pages) => {
                w.u32(pages.len() as u32);
                pages.iter().for_each(|p| p.encode(&mut w));
            }
            Request::Get(k) | Request::Delete(k) => {
                w.u32(k.len() as u32);
                k.iter().for_each(|k| k.encode(&mut w));
            }
            Request::Refresh | Request::Stats | Request::Close => {}
            Request::PutParity(pages) => {
                w.u32(pages.len() as u32);
                for (p, op) in pages {
                    p.encode(&mut w);
                    op.encode(&mut w);
                }
            }
            Request::ParityShip {
                group,
                max_members,
                members,
                record,
            } => {
                w.u64(*group).u8(*max_members);
                encode_members(members, &mut w);
                record.encode(&mut w);
            }
            Request::ParityDelta(deltas) => {
                w.u32(deltas.len() as u32);
                deltas.iter().for_each(|d| d.encode(&mut w));
            }
            Request::ParityScan { dead, max } => {
                encode_addr(dead, &mut w);
                w.u32(*max);
            }
            Request::Expect { from_node, pages } => {
                w.u64(*from_node).u32(pages.len() as u32);
                for (k, v) in pages {
                    k.encode(&mut w);
                    w.u32(*v);
                }
            }
            Request::Migrate { to, to_node, keys } => {
                encode_addr(to, &mut w);
                w.u64(*to_node).u32(keys.len() as u32);
                keys.iter().for_each(|k| k.encode(&mut w));
            }
            Request::Adopt { owner, pages } => {
                w.u64(owner.principal)
                    .u64(owner.node)
                    .u64(owner.incarnation)
                    .u32(pages.len() as u32);
                pages.iter().for_each(|p| p.encode(&mut w));
            }
        }
        w.finish();
    }
}

pub(crate) fn byte_enum<T>(
    r: &mut Reader<'_>,
    field: &'static str,
    f: fn(u8) -> Option<T>,
) -> Result<T, DecodeError> {
    let v = r.u8()?;
    f(v).ok_or(DecodeError::BadValue {
        field,
        value: v.into(),
    })
}

/// A count, then one byte per page: the statuses of PUT, DELETE and PARITY_DELTA replies.
pub(crate) fn status_bytes(w: &mut FrameBuilder<'_>, s: impl ExactSizeIterator<Item = u8>) {
    w.u32(s.len() as u32);
    s.for_each(|s| {
        w.u8(s);
    });
}

/// Decodes one whole frame (length prefix included) sent by a server.
pub fn decode_reply(frame: &[u8]) -> Result<(u64, Reply<'_>), DecodeError> {
    let (kind, req_id, mut r) = split_frame(frame)?;
    let load = Load::decode(&mut r)?;
    let reply = match kind {
        k if k == Kind::PutReply as u8 => {
            let n = r.count(1)?;
            let status = (0..n)
                .map(|_| {
                    byte_enum(&mut r, "put status", |v| match v {
                        0 => Some(PutStatus::Stored),
                        1 => Some(PutStatus::Full),
                        2 => Some(PutStatus::BadKey),
                        3 => Some(PutStatus::Unprotected),
                        4 => Some(PutStatus::HolderUnreachable),
                        5 => Some(PutStatus::Corrupt),
                        _ => None,
                    })
                })
                .collect::<Result<_, _>>()?;
            Reply::Put { load, status }
        }
        k if k == Kind::GetReply as u8 => {
            // The entries, then the data of the pages found, in the same order.
            let (mut pages, lens) = get_reply_entries(&mut r)?;
            for (p, len) in pages.iter_mut().zip(lens) {
                if let GetResult::Found(p) = p {
                    p.data = r.bytes(len)?;
                }
            }
            Reply::Get { load, pages }
        }
        k if k == Kind::DeleteReply as u8 => {
            let n = r.count(1)?;
            let status = (0..n)
                .map(|_| {
                    byte_enum(&mut r, "delete status", |v| match v {
                        0 => Some(DeleteStatus::Deleted),
                        1 => Some(DeleteStatus::Missing),
                        2 => Some(DeleteStatus::HolderUnreachable),
                        _ => None,
                    })
                })
                .collect::<Result<_, _>>()?;
            Reply::Delete { load, status }
        }
        k if k == Kind::StatsReply as u8 => {
            // The counter list is bounded by the frame length, not by MAX_BATCH.
            let n = r.u32()? as usize;
            if n * 9 > r.remaining() {
                return Err(DecodeError::BatchTooLarge { count: n });
            }
            let counters = (0..n)
                .map(|_| {
                    let len = r.u8()? as usize;
                    let name = std::str::from_utf8(r.bytes(len)?)
                        .map_err(|_| DecodeError::BadUtf8("counter name"))?;
                    Ok(Counter {
                        name,
                        value: r.u64()?,
                    })
                })
                .collect::<Result<_, DecodeError>>()?;
            Reply::Stats { load, counters }
        }
        k if k == Kind::CloseReply as u8 => Reply::Close { load },
        k if k == Kind::ParityDeltaReply as u8 => {
            let n = r.count(1)?;
            let status = (0..n)
                .map(|_| {
                    byte_enum(&mut r, "delta status", |v| match v {
                        0 => Some(DeltaStatus::Applied),
                        1 => Some(DeltaStatus::UnknownGroup),
                        2 => Some(DeltaStatus::Stale),
                        _ => None,
                    })
                })
                .collect::<Result<_, _>>()?;
            Reply::ParityDelta { load, status }
        }
        k if k == Kind::ParityScanReply as u8 => {
            let n = r.count(GroupRecord::MIN_WIRE_LEN)?;
            let groups = (0..n)
                .map(|_| GroupRecord::decode(&mut r))
                .collect::<Result<_, _>>()?;
            Reply::ParityScan {
                load,
                groups,
                orphans: keys(&mut r)?,
            }
        }
        k if k == Kind::MoveReply as u8 => {
            let n = r.count(1)?;
            let status = (0..n)
                .map(|_| byte_enum(&mut r, "move status", MoveStatus::from_u8))
                .collect::<Result<_, _>>()?;
            Reply::Move { load, status }
        }
        k if k == Kind::Error as u8 => {
            let code = match r.u16()? {
                1 => ErrorCode::SessionExpired,
                2 => ErrorCode::ShuttingDown,
                3 => ErrorCode::BadRequest,
                v => {
                    return Err(DecodeError::BadValue {
                        field: "error code",
                        value: v.into(),
                    })
                }
            };
            let len = r.u16()? as usize;
            let message = std::str::from_utf8(r.bytes(len)?)
                .map_err(|_| DecodeError::BadUtf8("error message"))?;
            Reply::Error {
                load,
                code,
                message,
            }
        }
        k => return Err(DecodeError::UnknownKind(k)),
    };
    r.finish()?;
    Ok((req_id, reply))
}

impl Reply<'_> {
    pub fn kind(&self) -> Kind {
        match self {
            Reply::Put { .. } => Kind::PutReply,
            Reply::Get { .. } => Kind::GetReply,
            Reply::Delete { .. } => Kind::DeleteReply,
            Reply::Stats { .. } => Kind::StatsReply,
            Reply::Close { .. } => Kind::CloseReply,
            Reply::ParityDelta { .. } => Kind::ParityDeltaReply,
            Reply::ParityScan { .. } => Kind::ParityScanReply,
            Reply::Move { .. } => Kind::MoveReply,
            Reply::Error { .. } => Kind::Error,
        }
    }

    /// Appends this reply as one frame to `out`. The server's hot path builds GET replies with
    /// [`begin_get_reply`] instead, copying page data straight from its arena.
    pub fn encode(&self, req_id: u64, out: &mut Vec<u8>) {
        let mut w = FrameBuilder::begin(out, self.kind() as u8, req_id);
        self.load().encode(&mut w);
        match self {
            Reply::Put { status, .. } => status_bytes(&mut w, status.iter().map(|s| *s as u8)),
            Reply::Get { pages, .. } => {
                w.u32(pages.len() as u32);
                for p in pages {
                    match p {
                        GetResult::Found(p) => get_reply_found(&mut w, p),
                        GetResult::Missing(k) => get_reply_missing(&mut w, *k),
                    }
                }
                for p in pages {
                    if let GetResult::Found(p) = p {
                        w.bytes(p.data);
                    }
                }
            }
            Reply::Delete { status, .. } => status_bytes(&mut w, status.iter().map(|s| *s as u8)),
            Reply::ParityDelta { status, .. } => {
                status_bytes(&mut w, status.iter().map(|s| *s as u8))
            }
            Reply::Move { status, .. } => status_bytes(&mut w, status.iter().map(|s| *s as u8)),
            Reply::ParityScan {
                groups, orphans, ..
            } => {
                w.u32(groups.len() as u32);
                groups.iter().for_each(|g| g.encode(&mut w));
                w.u32(orphans.len() as u32);
                orphans.iter().for_each(|k| k.encode(&mut w));
            }
            Reply::Stats { counters, .. } => {
                w.u32(counters.len() as u32);
                for c in counters {
                    let name = &c.name.as_bytes()[..c.name.len().min(255)];
                    w.u8(name.len() as u8).bytes(name).u64(c.value);
                }
            }
            Reply::Close { .. } => {}
            Reply::Error { code, message, .. } => {
                let m = &message.as_bytes()[..message.len().min(1024)];
                w.u16(*code as u16).u16(m.len() as u16).bytes(m);
            }
        }
        w.finish();
    }
}

/// Starts a GET reply of `count` entries; the caller appends each with [`get_reply_found`] or
/// [`get_reply_missing`], then the data of every page found with [`get_reply_data`] (in the
/// entries' order), and calls [`FrameBuilder::finish`]. The data comes last so that it is one
/// run at the end of the frame: the run that may travel outside the record's seal to a
/// client that seals its pages itself (`netram-net`'s `record.rs`).
pub fn begin_get_reply<'v>(
    out: &'v mut Vec<u8>,
    req_id: u64,
    load: Load,
    count: usize,
) -> FrameBuilder<'v> {
    let mut w = FrameBuilder::begin(out, Kind::GetReply as u8, req_id);
    load.encode(&mut w);
    w.u32(count as u32);
    w
}

/// Appends a found page's entry: its envelope, not its data (see [`get_reply_data`]).
pub fn get_reply_found(w: &mut FrameBuilder<'_>, page: &Page<'_>) {
    w.u8(0);
    page.encode_header(w);
}

pub fn get_reply_missing(w: &mut FrameBuilder<'_>, key: PageKey) {
    w.u8(1);
    key.encode(w);
}

/// Appends a found page's data, after every entry, in the entries' order.
pub fn get_reply_data(w: &mut FrameBuilder<'_>, data: &[u8]) {
    w.bytes(data);
}

/// A GET reply's entries, each found page with the length of its data (which follows all of
/// the entries).
fn get_reply_entries<'a>(
    r: &mut Reader<'a>,
) -> Result<(Vec<GetResult<'a>>, Vec<usize>), DecodeError> {
    let n = r.count(1 + PageKey::WIRE_LEN)?;
    let mut pages = Vec::with_capacity(n);
    let mut lens = Vec::with_capacity(n);
    for _ in 0..n {
        match r.u8()? {
            0 => {
                let (p, len) = Page::decode_header(r)?;
                pages.push(GetResult::Found(p));
                lens.push(len);
            }
            1 => {
                pages.push(GetResult::Missing(PageKey::decode(r)?));
                lens.push(0);
            }
            v => {
                return Err(DecodeError::BadValue {
                    field: "get status",
                    value: v.into(),
                })
            }
        }
    }
    Ok((pages, lens))
}

/// How many bytes at the end of `frame` are the data of a GET reply's pages (0 for any other
/// frame, a reply without page data, or bytes that are no GET reply). Read from the entries
/// only, never from the data: a client that lets the pages' data travel outside the record's
/// seal checks with it that exactly that data did (`netram-net`'s `record.rs`). Never panics,
/// whatever the bytes.
pub fn get_reply_tail(frame: &[u8]) -> usize {
    let walk = || -> Result<usize, DecodeError> {
        let (kind, _, mut r) = split_frame(frame)?;
        if kind != Kind::GetReply as u8 {
            return Ok(0);
        }
        Load::decode(&mut r)?;
        let (_, lens) = get_reply_entries(&mut r)?;
        let data: usize = lens.iter().sum();
        if data != r.remaining() {
            return Err(DecodeError::BadLength {
                len: r.remaining(),
                min: data,
                max: data,
            });
        }
        Ok(data)
    };
    walk().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page::{PageFlags, TAG_LEN};
    use crate::parity::Owner;
    use crate::PAGE_SIZE;
    use proptest::prelude::*;

    fn key() -> impl Strategy<Value = PageKey> {
        (any::<u32>(), any::<u64>()).prop_map(|(r, p)| PageKey::new(r, p))
    }

    /// Owned page parts; a borrowed `Page` is built from them inside the test.
    fn page_parts() -> impl Strategy<Value = (PageKey, u32, u32, bool, [u8; TAG_LEN], u8)> {
        (
            key(),
            any::<u32>(),
            any::<u32>(),
            any::<bool>(),
            any::<[u8; TAG_LEN]>(),
            any::<u8>(),
        )
    }

    fn page<'a>(p: &(PageKey, u32, u32, bool, [u8; TAG_LEN], u8), data: &'a [u8]) -> Page<'a> {
        Page {
            key: p.0,
            version: p.1,
            crc: p.2,
            flags: PageFlags(if p.3 { PageFlags::ZERO } else { 0 }),
            tag: p.4,
            data: if p.3 { &[] } else { data },
        }
    }

    #[test]
    fn a_get_replys_tail_is_its_pages_data() {
        let data = vec![3u8; PAGE_SIZE];
        let page = Page::seal(PageKey::new(0, 1), 1, &data);
        let zero = Page {
            flags: crate::PageFlags(crate::PageFlags::ZERO),
            data: &[],
            ..page
        };
        // Entries: found, then `second`; the data of the pages found after all of them.
        let reply = |second: Option<&Page<'_>>| {
            let mut b = Vec::new();
            let mut w = begin_get_reply(&mut b, 1, Load::default(), 2);
            get_reply_found(&mut w, &page);
            match second {
                Some(p) => get_reply_found(&mut w, p),
                None => get_reply_missing(&mut w, PageKey::new(0, 2)),
            }
            get_reply_data(&mut w, page.data);
            if let Some(p) = second {
                get_reply_data(&mut w, p.data);
            }
            w.finish();
            b
        };
        assert_eq!(get_reply_tail(&reply(Some(&page))), 2 * PAGE_SIZE);
        assert_eq!(get_reply_tail(&reply(None)), PAGE_SIZE, "a missing entry");
        assert_eq!(
            get_reply_tail(&reply(Some(&zero))),
            PAGE_SIZE,
            "a zero page"
        );
        let both = reply(Some(&page));
        let decoded = decode_reply(&both).unwrap().1;
        assert_eq!(
            decoded,
            Reply::Get {
                load: Load::default(),
                pages: vec![GetResult::Found(page), GetResult::Found(page)]
            }
        );
        let mut other = Vec::new();
        Request::Get(vec![PageKey::new(0, 1)]).encode(1, &mut other);
        assert_eq!(get_reply_tail(&other), 0, "not a GET reply");
        let r = reply(Some(&page));
        assert_eq!(get_reply_tail(&r[..r.len() - 1]), 0, "cut short");
        assert_eq!(get_reply_tail(&[0xff; 40]), 0, "garbage");
    }

    fn roundtrip_request(req: &Request<'_>, id: u64) {
        let mut buf = Vec::new();
        req.encode(id, &mut buf);
        assert_eq!(frame_len(&buf).unwrap(), Some(buf.len()));
        let (got_id, got) = decode_request(&buf).unwrap();
        assert_eq!(got_id, id);
        assert_eq!(&got, req);
    }

    fn roundtrip_reply(rep: &Reply<'_>, id: u64) {
        let mut buf = Vec::new();
        rep.encode(id, &mut buf);
        let (got_id, got) = decode_reply(&buf).unwrap();
        assert_eq!(got_id, id);
        assert_eq!(&got, rep);
    }

    fn addr() -> impl Strategy<Value = SocketAddr> {
        prop_oneof![
            (any::<[u8; 4]>(), any::<u16>()).prop_map(|(ip, port)| SocketAddr::from((ip, port))),
            (any::<[u8; 16]>(), any::<u16>()).prop_map(|(ip, port)| SocketAddr::from((ip, port))),
        ]
    }

    fn member() -> impl Strategy<Value = Member> {
        (addr(), any::<u64>(), key(), any::<u32>()).prop_map(|(server, node, key, version)| {
            Member {
                server,
                node,
                key,
                version,
            }
        })
    }

    fn load() -> impl Strategy<Value = Load> {
        (any::<u64>(), any::<u32>(), any::<u32>()).prop_map(
            |(free_pages, requests_per_s, leaving)| Load {
                free_pages,
                leaving,
                requests_per_s,
            },
        )
    }

    proptest! {
        #[test]
        fn put_roundtrips(parts in prop::collection::vec(page_parts(), 0..8), id: u64) {
            let datas: Vec<Vec<u8>> = parts.iter().map(|p| vec![p.5; PAGE_SIZE]).collect();
            let pages = parts.iter().zip(&datas).map(|(p, d)| page(p, d)).collect();
            roundtrip_request(&Request::Put(pages), id);
        }

        #[test]
        fn get_and_delete_roundtrip(keys in prop::collection::vec(key(), 0..crate::MAX_BATCH), id: u64) {
            roundtrip_request(&Request::Get(keys.clone()), id);
            roundtrip_request(&Request::Delete(keys), id);
        }

        #[test]
        fn bodiless_requests_roundtrip(id: u64) {
            for r in [Request::Refresh, Request::Stats, Request::Close] {
                roundtrip_request(&r, id);
            }
        }

        #[test]
        fn put_reply_roundtrips(load in load(), s in prop::collection::vec(0u8..6, 0..crate::MAX_BATCH), id: u64) {
            let all = [PutStatus::Stored, PutStatus::Full, PutStatus::BadKey, PutStatus::Unprotected, PutStatus::HolderUnreachable, PutStatus::Corrupt];
            let status = s.iter().map(|v| all[*v as usize]).collect();
            roundtrip_reply(&Reply::Put { load, status }, id);
        }

        #[test]
        fn get_reply_roundtrips(load in load(), parts in prop::collection::vec((page_parts(), any::<bool>()), 0..8), id: u64) {
            let datas: Vec<Vec<u8>> = parts.iter().map(|p| vec![p.0.5; PAGE_SIZE]).collect();
            let pages: Vec<GetResult<'_>> = parts.iter().zip(&datas).map(|((p, found), d)| {
                if *found { GetResult::Found(page(p, d)) } else { GetResult::Missing(p.0) }
            }).collect();
            // The streaming builder the server uses produces the same bytes as Reply::encode.
            let mut a = Vec::new();
            Reply::Get { load, pages: pages.clone() }.encode(id, &mut a);
            let mut b = Vec::new();
            let mut w = begin_get_reply(&mut b, id, load, pages.len());
            for p in &pages {
                match p { GetResult::Found(p) => get_reply_found(&mut w, p), GetResult::Missing(k) => get_reply_missing(&mut w, *k) }
            }
            for p in &pages {
                if let GetResult::Found(p) = p { get_reply_data(&mut w, p.data) }
            }
            w.finish();
            prop_assert_eq!(&a, &b);
            roundtrip_reply(&Reply::Get { load, pages }, id);
        }

        #[test]
        fn migration_requests_and_replies_roundtrip(
            parts in prop::collection::vec(page_parts(), 0..6),
            versions in prop::collection::vec((key(), any::<u32>()), 0..crate::MAX_BATCH),
            owner in (any::<u64>(), any::<u64>(), any::<u64>()),
            node: u64, to in addr(), load in load(),
            s in prop::collection::vec(0u8..7, 0..crate::MAX_BATCH), id: u64,
        ) {
            let keys: Vec<PageKey> = versions.iter().map(|(k, _)| *k).collect();
            roundtrip_request(&Request::Expect { from_node: node, pages: versions }, id);
            roundtrip_request(&Request::Migrate { to, to_node: node, keys }, id);
            let datas: Vec<Vec<u8>> = parts.iter().map(|p| vec![p.5; PAGE_SIZE]).collect();
            let pages = parts.iter().zip(&datas).map(|(p, d)| page(p, d)).collect();
            let owner = Owner { principal: owner.0, node: owner.1, incarnation: owner.2 };
            roundtrip_request(&Request::Adopt { owner, pages }, id);
            let status = s.iter().map(|v| MoveStatus::from_u8(*v).unwrap()).collect();
            roundtrip_reply(&Reply::Move { load, status }, id);
        }

        #[test]
        fn delete_reply_roundtrips(load in load(), s in prop::collection::vec(0u8..3, 0..crate::MAX_BATCH), id: u64) {
            let all = [DeleteStatus::Deleted, DeleteStatus::Missing, DeleteStatus::HolderUnreachable];
            let status = s.iter().map(|d| all[*d as usize]).collect();
            roundtrip_reply(&Reply::Delete { load, status }, id);
        }

        #[test]
        fn parity_requests_roundtrip(
            parts in prop::collection::vec((page_parts(), prop::option::of((addr(), any::<u64>(), addr()))), 0..6),
            members in prop::collection::vec(member(), 0..=crate::MAX_GROUP_MEMBERS),
            owner in (any::<u64>(), any::<u64>(), any::<u64>()),
            group: u64, n: u8, byte: u8, kind in 0u8..3, dead in addr(), max: u32, id: u64,
        ) {
            let datas: Vec<Vec<u8>> = parts.iter().map(|p| vec![p.0.5; PAGE_SIZE]).collect();
            let pages = parts.iter().zip(&datas).map(|((p, join), d)| {
                let op = match join {
                    Some((holder, group, member)) => ParityOp::Join { holder: *holder, holder_node: *group ^ 7, group: *group, member: *member },
                    None => ParityOp::Keep,
                };
                (page(p, d), op)
            }).collect();
            roundtrip_request(&Request::PutParity(pages), id);
            let data = vec![byte; PAGE_SIZE];
            let record = Record { version: group as u32, crc: max, flags: n.into(), data: &data };
            roundtrip_request(&Request::ParityShip { group, max_members: n, members: members.clone(), record }, id);
            let owner = Owner { principal: owner.2, node: owner.0, incarnation: owner.1 };
            let kind = [crate::DeltaKind::Update, crate::DeltaKind::Remove, crate::DeltaKind::Drop][kind as usize];
            let deltas = members.iter().map(|m| Delta { owner, group, member: m.server, key: m.key, from: m.version, to: max, kind, record }).collect();
            roundtrip_request(&Request::ParityDelta(deltas), id);
            roundtrip_request(&Request::ParityScan { dead, max }, id);
        }

        #[test]
        fn parity_replies_roundtrip(
            load in load(),
            s in prop::collection::vec(0u8..3, 0..crate::MAX_BATCH),
            groups in prop::collection::vec((any::<u64>(), any::<bool>(), prop::collection::vec(member(), 0..4)), 0..4),
            orphans in prop::collection::vec(key(), 0..20),
            id: u64,
        ) {
            let all = [DeltaStatus::Applied, DeltaStatus::UnknownGroup, DeltaStatus::Stale];
            let status = s.iter().map(|a| all[*a as usize]).collect();
            roundtrip_reply(&Reply::ParityDelta { load, status }, id);
            let data = vec![7u8; PAGE_SIZE];
            let groups = groups.into_iter().map(|(group, damaged, members)| GroupRecord {
                group, damaged, members, record: Record { version: 1, crc: 2, flags: 3, data: &data },
            }).collect();
            roundtrip_reply(&Reply::ParityScan { load, groups, orphans }, id);
        }

        #[test]
        fn stats_reply_roundtrips(load in load(), c in prop::collection::vec(("[a-z_]{0,40}", any::<u64>()), 0..50), id: u64) {
            let counters = c.iter().map(|(n, v)| Counter { name: n, value: *v }).collect();
            roundtrip_reply(&Reply::Stats { load, counters }, id);
        }

        #[test]
        fn close_and_error_roundtrip(load in load(), m in "\\PC{0,100}", id: u64, expired: bool) {
            roundtrip_reply(&Reply::Close { load }, id);
            let code = if expired { ErrorCode::SessionExpired } else { ErrorCode::ShuttingDown };
            roundtrip_reply(&Reply::Error { load, code, message: &m }, id);
        }

        #[test]
        fn handshake_roundtrips(node: u64, inc: u64, session: u64, end: bool, window: u32, cap: u64, free: u64, lease: u32) {
            let h = crate::Hello::new(node, inc, session)
                .with_flags(if end { crate::HELLO_END_ON_CLOSE } else { 0 });
            prop_assert_eq!(crate::Hello::decode(&h.encode()).unwrap(), h);
            let w = crate::Welcome { version: 1, status: crate::WelcomeStatus::Busy, window, server_node: node,
                server_incarnation: inc, capacity_pages: cap, free_pages: free, lease_period_ms: lease,
                max_frame_len: 1 << 20, max_batch: 128 };
            prop_assert_eq!(crate::Welcome::decode(&w.encode()).unwrap(), w);
        }

        /// Whatever the bytes, decoding returns a value or an error: it never panics.
        #[test]
        fn decoders_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_request(&bytes);
            let _ = decode_reply(&bytes);
            let _ = crate::Hello::decode(&bytes);
            let _ = crate::Welcome::decode(&bytes);
        }

        /// Every proper prefix of a valid frame is reported as truncated, never misread.
        #[test]
        fn prefixes_are_truncated(keys in prop::collection::vec(key(), 1..4), cut in 0usize..100) {
            let mut buf = Vec::new();
            Request::Get(keys).encode(7, &mut buf);
            let cut = cut % buf.len();
            prop_assert!(decode_request(&buf[..cut]).is_err());
        }
    }

    #[test]
    fn oversized_length_is_refused_before_the_body() {
        let mut buf = ((MAX_FRAME_LEN as u32) + 1).to_le_bytes().to_vec();
        buf.extend_from_slice(&[1, 1, 0, 0]);
        assert!(matches!(
            frame_len(&buf),
            Err(DecodeError::BadLength { .. })
        ));
    }

    #[test]
    fn wrong_frame_version_is_refused() {
        let mut buf = Vec::new();
        Request::Stats.encode(1, &mut buf);
        buf[4] = 9;
        assert_eq!(
            decode_request(&buf),
            Err(DecodeError::UnsupportedVersion { got: 9 })
        );
    }

    #[test]
    fn lying_batch_count_is_refused_without_allocating() {
        let mut buf = Vec::new();
        let mut w = FrameBuilder::begin(&mut buf, Kind::Get as u8, 1);
        w.u32(u32::MAX);
        w.finish();
        assert!(matches!(
            decode_request(&buf),
            Err(DecodeError::BatchTooLarge { .. })
        ));
    }

    #[test]
    fn reply_kinds_are_not_requests() {
        let mut buf = Vec::new();
        Reply::Close {
            load: Load::default(),
        }
        .encode(1, &mut buf);
        assert_eq!(
            decode_request(&buf),
            Err(DecodeError::UnknownKind(Kind::CloseReply as u8))
        );
    }

    #[test]
    fn page_with_wrong_length_is_refused() {
        let data = vec![1u8; PAGE_SIZE];
        let mut buf = Vec::new();
        Request::Put(vec![Page::seal(PageKey::new(0, 0), 1, &data)]).encode(1, &mut buf);
        // Claim the zero flag while data follows.
        buf[FRAME_HEADER_LEN + 4 + 20] = PageFlags::ZERO as u8;
        assert!(matches!(
            decode_request(&buf),
            Err(DecodeError::BadPageLength { .. })
        ));
    }
}
