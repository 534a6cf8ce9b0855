//! GMS's messages (paper 000, §3.2 and §4.5): the epochs between daemons, and clean pages
//! between the nodes that use them and the daemons that hold them for others.
//!
//! ```text
//! GMS_EPOCH   = tag:u8 | body                (one-way, between daemons, in membership packets)
//!   0 REQUEST_SUMMARY epoch:u64
//!   1 SUMMARY         epoch:u64 free:u32 evicted:u32 discarded:u32 n:u8 (bucket:u8 count:u32)*n
//!   2 PLAN            epoch:u64 initiator:u64 m:u32 min_age_ms:u64 duration_ms:u64
//!                     n:u16 (node:u64 weight:u32)*n
//!   3 STALE           epoch:u64
//! PUT_CACHED  = n:u32 (uid:u128 age_ms:u32 crc:u32 flags:u16 0:u16 data)*n
//! GET_CACHED  = take:u8 n:u32 uid:u128*n
//! GCD_UPDATE  = reset:u8 n:u32 add:u128*n m:u32 remove:u128*m
//! replies     = load | PUT_CACHED: n:u32 status:u8*n
//!                    | GET_CACHED: n:u32 (found:u8 [page])*n
//!                    | GCD_UPDATE: taken:u32 held:u32 m:u32 elsewhere:u8*m
//! ```
//!
//! GCD_UPDATE tells the node that keeps a page's entry in the global-cache directory (its
//! home, `netram_policy::gms::directory::Pod`) which shared pages the sender now holds in its
//! own memory and which it gave up (§4.4); the reply says, for each page given up, whether
//! another node still holds it (a duplicate: the sender drops it instead of forwarding it,
//! §4.5). `reset` first forgets everything the sender registered there (it re-registers after
//! a membership change or a lost count). The home takes the additions in order until the
//! sender's bound (`taken` of them) and says how many entries it now holds for the sender
//! (`held`), so that a sender whose count differs knows its entries there were lost.
//!
//! The sender of an epoch message is the node its packet's signature names, never a field of
//! the message: a plan names its initiator only so that the receiver can check it against the
//! sender. A
//! summary's buckets are strictly from the oldest down with no empty ones, and every field has
//! one encoding, so a decoded message re-encodes to the same bytes (the fuzzer checks it).
//!
//! A clean page's checksum is crc32c over its uid, flags and data, computed by the node that
//! read it from its source and checked by every node that takes it or reads it back: a page
//! under another uid, or damaged, is refused and counted. (A member that lies can still
//! forge a matching checksum: pages that must be trusted against members are verified against
//! their source by the front end, see `netram cache`.)
//!
//! These decoders are fuzzed (`fuzz/fuzz_targets/decode.rs`). The owned-page protocol's
//! `decode_request` refuses these kinds as unknown; the daemon then decodes them here: clean
//! pages are served by `netram_store::serve::handle_gms`. Epoch messages travel between
//! daemons in membership packets (`netram_member::envelope`, whose signature names the
//! sender); one arriving on a pages connection is counted and dropped.

use crate::codec::{DecodeError, FrameBuilder, Reader};
use crate::message::{byte_enum, split_frame, status_bytes, Kind, Load};
use crate::page::PageFlags;
use crate::PAGE_SIZE;

/// The most age buckets a summary may carry (the policy has 96).
pub const MAX_SUMMARY_BUCKETS: usize = 128;
/// The most weights a plan may carry on the wire (the policy caps it lower, by default 32).
pub const MAX_PLAN_WEIGHTS: usize = 1024;
/// Bytes of a clean page's header before its data.
pub const CACHED_HEADER_LEN: usize = 28;

/// A node's age summary, as it travels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub free: u32,
    pub evicted: u32,
    pub discarded: u32,
    /// (bucket, count), oldest bucket first, every count non-zero.
    pub buckets: Vec<(u8, u32)>,
}

/// An epoch's plan, as it travels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub epoch: u64,
    pub initiator: u64,
    pub m: u32,
    pub min_age_ms: u64,
    pub duration_ms: u64,
    pub weights: Vec<(u64, u32)>,
}

/// One epoch message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Epoch {
    RequestSummary { epoch: u64 },
    Summary { epoch: u64, summary: Summary },
    Plan(Plan),
    Stale { epoch: u64 },
}

/// A clean page: a copy of a page that also exists in its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachedPage<'a> {
    pub uid: u128,
    /// How long ago its user last touched it (ms), at sending.
    pub age_ms: u32,
    pub crc: u32,
    pub flags: PageFlags,
    /// `PAGE_SIZE` bytes, or none for a zero page.
    pub data: &'a [u8],
}

/// crc32c over a clean page's uid, flags and data, little-endian.
pub fn cached_checksum(uid: u128, flags: PageFlags, data: &[u8]) -> u32 {
    let mut head = [0u8; 18];
    head[0..16].copy_from_slice(&uid.to_le_bytes());
    head[16..18].copy_from_slice(&flags.0.to_le_bytes());
    crc32c::crc32c_append(crc32c::crc32c(&head), data)
}

impl<'a> CachedPage<'a> {
    /// A page read from its source, to send: a zero page travels as a flag.
    pub fn seal(uid: u128, age_ms: u32, data: &'a [u8]) -> Self {
        assert_eq!(data.len(), PAGE_SIZE, "a page is {PAGE_SIZE} bytes");
        let (flags, data) = PageFlags::zero_or(data);
        Self {
            uid,
            age_ms,
            crc: cached_checksum(uid, flags, data),
            flags,
            data,
        }
    }

    /// The receiver's check: the checksum matches this uid and these contents.
    pub fn verify(&self) -> bool {
        self.crc == cached_checksum(self.uid, self.flags, self.data)
    }

    fn decode(r: &mut Reader<'a>) -> Result<Self, DecodeError> {
        let uid = u128(r)?;
        let age_ms = r.u32()?;
        let crc = r.u32()?;
        let flags = r.u16()?;
        if flags & !PageFlags::KNOWN != 0 {
            return Err(DecodeError::Reserved {
                field: "cached page flags",
                value: flags.into(),
            });
        }
        r.reserved_u16("cached page reserved")?;
        let flags = PageFlags(flags);
        let len = if flags.is_zero() { 0 } else { PAGE_SIZE };
        Ok(Self {
            uid,
            age_ms,
            crc,
            flags,
            data: r.bytes(len)?,
        })
    }

    fn encode(&self, w: &mut FrameBuilder<'_>) {
        debug_assert_eq!(
            self.data.len(),
            if self.flags.is_zero() { 0 } else { PAGE_SIZE }
        );
        w.u64(self.uid as u64)
            .u64((self.uid >> 64) as u64)
            .u32(self.age_ms)
            .u32(self.crc)
            .u16(self.flags.0)
            .u16(0)
            .bytes(self.data);
    }
}

/// What a daemon did with one clean page it was sent (GMS's receiving rule, counted per
/// reason by the sender).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum CachedStatus {
    /// Taken into a free frame.
    Taken = 0,
    /// Taken in place of an older page, which it dropped.
    Replaced = 1,
    /// Refused: every page it holds is younger (the plan was wrong), or it has no room.
    Refused = 2,
    /// It already holds the page.
    Present = 3,
    /// The checksum does not match the uid and contents.
    Corrupt = 4,
}

impl CachedStatus {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::Taken,
            1 => Self::Replaced,
            2 => Self::Refused,
            3 => Self::Present,
            4 => Self::Corrupt,
            _ => return None,
        })
    }
}

/// A GMS request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    Epoch(Epoch),
    /// Clean pages for the receiver to hold as global pages.
    PutCached(Vec<CachedPage<'a>>),
    /// Clean pages by uid; `take`: the asker will use them (a global page moves, §4.5),
    /// otherwise the holder keeps its copy.
    GetCached {
        take: bool,
        uids: Vec<u128>,
    },
    /// The sender's shared pages: `add` now in its memory, `remove` no longer; `reset` first
    /// forgets all it registered here. Additions are applied before removals.
    GcdUpdate {
        reset: bool,
        add: Vec<u128>,
        remove: Vec<u128>,
    },
}

/// A GMS reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply<'a> {
    PutCached {
        load: Load,
        status: Vec<CachedStatus>,
    },
    /// In the order asked; `None` where the page is not held.
    GetCached {
        load: Load,
        pages: Vec<Option<CachedPage<'a>>>,
    },
    /// `taken`: the first so many additions were recorded (the rest were beyond the sender's
    /// bound); `held`: the entries now held for the sender; `elsewhere`: per removal, whether
    /// another node still holds that page.
    GcdUpdate {
        load: Load,
        taken: u32,
        held: u32,
        elsewhere: Vec<bool>,
    },
}

fn u128(r: &mut Reader<'_>) -> Result<u128, DecodeError> {
    let lo = r.u64()?;
    let hi = r.u64()?;
    Ok(u128::from(lo) | (u128::from(hi) << 64))
}

/// A byte that is 0 or 1 (one encoding per value).
fn flag(r: &mut Reader<'_>, field: &'static str) -> Result<bool, DecodeError> {
    match r.u8()? {
        0 => Ok(false),
        1 => Ok(true),
        v => Err(bad(field, v.into())),
    }
}

fn uid_list(w: &mut FrameBuilder<'_>, uids: &[u128]) {
    assert!(uids.len() <= crate::MAX_BATCH, "at most MAX_BATCH uids");
    w.u32(uids.len() as u32);
    for &u in uids {
        w.u64(u as u64).u64((u >> 64) as u64);
    }
}

fn bad(field: &'static str, value: u64) -> DecodeError {
    DecodeError::BadValue { field, value }
}

impl Summary {
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let free = r.u32()?;
        let evicted = r.u32()?;
        let discarded = r.u32()?;
        let n = r.u8()? as usize;
        if n > MAX_SUMMARY_BUCKETS || n * 5 > r.remaining() {
            return Err(DecodeError::BatchTooLarge { count: n });
        }
        let mut buckets = Vec::with_capacity(n);
        for _ in 0..n {
            let b = r.u8()?;
            let c = r.u32()?;
            if c == 0 {
                return Err(bad("summary bucket count", 0));
            }
            if buckets.last().is_some_and(|&(prev, _)| b >= prev) {
                return Err(bad("summary bucket order", b.into()));
            }
            buckets.push((b, c));
        }
        Ok(Self {
            free,
            evicted,
            discarded,
            buckets,
        })
    }

    fn encode(&self, w: &mut FrameBuilder<'_>) {
        assert!(self.buckets.len() <= MAX_SUMMARY_BUCKETS);
        w.u32(self.free)
            .u32(self.evicted)
            .u32(self.discarded)
            .u8(self.buckets.len() as u8);
        for &(b, c) in &self.buckets {
            w.u8(b).u32(c);
        }
    }
}

impl Plan {
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let epoch = r.u64()?;
        let initiator = r.u64()?;
        let m = r.u32()?;
        let min_age_ms = r.u64()?;
        let duration_ms = r.u64()?;
        let n = r.u16()? as usize;
        if n > MAX_PLAN_WEIGHTS || n * 12 > r.remaining() {
            return Err(DecodeError::BatchTooLarge { count: n });
        }
        let weights = (0..n)
            .map(|_| Ok((r.u64()?, r.u32()?)))
            .collect::<Result<_, DecodeError>>()?;
        Ok(Self {
            epoch,
            initiator,
            m,
            min_age_ms,
            duration_ms,
            weights,
        })
    }

    fn encode(&self, w: &mut FrameBuilder<'_>) {
        assert!(self.weights.len() <= MAX_PLAN_WEIGHTS);
        w.u64(self.epoch)
            .u64(self.initiator)
            .u32(self.m)
            .u64(self.min_age_ms)
            .u64(self.duration_ms)
            .u16(self.weights.len() as u16);
        for &(n, wt) in &self.weights {
            w.u64(n).u32(wt);
        }
    }
}

/// Decodes one whole GMS request frame (length prefix included).
pub fn decode_request(frame: &[u8]) -> Result<(u64, Request<'_>), DecodeError> {
    let (kind, req_id, mut r) = split_frame(frame)?;
    let req = match kind {
        k if k == Kind::GmsEpoch as u8 => Request::Epoch(match r.u8()? {
            0 => Epoch::RequestSummary { epoch: r.u64()? },
            1 => Epoch::Summary {
                epoch: r.u64()?,
                summary: Summary::decode(&mut r)?,
            },
            2 => Epoch::Plan(Plan::decode(&mut r)?),
            3 => Epoch::Stale { epoch: r.u64()? },
            t => return Err(bad("epoch message", t.into())),
        }),
        k if k == Kind::PutCached as u8 => {
            let n = r.count(CACHED_HEADER_LEN)?;
            Request::PutCached(
                (0..n)
                    .map(|_| CachedPage::decode(&mut r))
                    .collect::<Result<_, _>>()?,
            )
        }
        k if k == Kind::GetCached as u8 => {
            let take = flag(&mut r, "take")?;
            let n = r.count(16)?;
            Request::GetCached {
                take,
                uids: (0..n).map(|_| u128(&mut r)).collect::<Result<_, _>>()?,
            }
        }
        k if k == Kind::GcdUpdate as u8 => {
            let reset = flag(&mut r, "reset")?;
            let n = r.count(16)?;
            let add = (0..n).map(|_| u128(&mut r)).collect::<Result<_, _>>()?;
            let m = r.count(16)?;
            let remove = (0..m).map(|_| u128(&mut r)).collect::<Result<_, _>>()?;
            Request::GcdUpdate { reset, add, remove }
        }
        k => return Err(DecodeError::UnknownKind(k)),
    };
    r.finish()?;
    Ok((req_id, req))
}

impl Request<'_> {
    pub fn kind(&self) -> Kind {
        match self {
            Request::Epoch(_) => Kind::GmsEpoch,
            Request::PutCached(_) => Kind::PutCached,
            Request::GetCached { .. } => Kind::GetCached,
            Request::GcdUpdate { .. } => Kind::GcdUpdate,
        }
    }

    /// Appends this request as one frame to `out`.
    pub fn encode(&self, req_id: u64, out: &mut Vec<u8>) {
        let mut w = FrameBuilder::begin(out, self.kind() as u8, req_id);
        match self {
            Request::Epoch(e) => match e {
                Epoch::RequestSummary { epoch } => {
                    w.u8(0).u64(*epoch);
                }
                Epoch::Summary { epoch, summary } => {
                    w.u8(1).u64(*epoch);
                    summary.encode(&mut w);
                }
                Epoch::Plan(p) => {
                    w.u8(2);
                    p.encode(&mut w);
                }
                Epoch::Stale { epoch } => {
                    w.u8(3).u64(*epoch);
                }
            },
            Request::PutCached(pages) => {
                w.u32(pages.len() as u32);
                pages.iter().for_each(|p| p.encode(&mut w));
            }
            Request::GetCached { take, uids } => {
                w.u8(u8::from(*take));
                uid_list(&mut w, uids);
            }
            Request::GcdUpdate { reset, add, remove } => {
                w.u8(u8::from(*reset));
                uid_list(&mut w, add);
                uid_list(&mut w, remove);
            }
        }
        w.finish();
    }
}

/// Decodes one whole GMS reply frame (length prefix included).
pub fn decode_reply(frame: &[u8]) -> Result<(u64, Reply<'_>), DecodeError> {
    let (kind, req_id, mut r) = split_frame(frame)?;
    let load = Load::decode(&mut r)?;
    let reply = match kind {
        k if k == Kind::PutCachedReply as u8 => {
            let n = r.count(1)?;
            let status = (0..n)
                .map(|_| byte_enum(&mut r, "cached status", CachedStatus::from_u8))
                .collect::<Result<_, _>>()?;
            Reply::PutCached { load, status }
        }
        k if k == Kind::GetCachedReply as u8 => {
            let n = r.count(1)?;
            let pages = (0..n)
                .map(|_| match r.u8()? {
                    0 => Ok(None),
                    1 => CachedPage::decode(&mut r).map(Some),
                    v => Err(bad("found", v.into())),
                })
                .collect::<Result<_, _>>()?;
            Reply::GetCached { load, pages }
        }
        k if k == Kind::GcdUpdateReply as u8 => {
            let taken = r.u32()?;
            let held = r.u32()?;
            let n = r.count(1)?;
            let elsewhere = (0..n)
                .map(|_| flag(&mut r, "elsewhere"))
                .collect::<Result<_, _>>()?;
            Reply::GcdUpdate {
                load,
                taken,
                held,
                elsewhere,
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
            Reply::PutCached { .. } => Kind::PutCachedReply,
            Reply::GetCached { .. } => Kind::GetCachedReply,
            Reply::GcdUpdate { .. } => Kind::GcdUpdateReply,
        }
    }

    /// Appends this reply as one frame to `out`.
    pub fn encode(&self, req_id: u64, out: &mut Vec<u8>) {
        let mut w = FrameBuilder::begin(out, self.kind() as u8, req_id);
        match self {
            Reply::PutCached { load, status } => {
                load.encode(&mut w);
                status_bytes(&mut w, status.iter().map(|&s| s as u8));
            }
            Reply::GetCached { load, pages } => {
                load.encode(&mut w);
                w.u32(pages.len() as u32);
                for p in pages {
                    match p {
                        None => {
                            w.u8(0);
                        }
                        Some(p) => {
                            w.u8(1);
                            p.encode(&mut w);
                        }
                    }
                }
            }
            Reply::GcdUpdate {
                load,
                taken,
                held,
                elsewhere,
            } => {
                load.encode(&mut w);
                w.u32(*taken).u32(*held);
                status_bytes(&mut w, elsewhere.iter().map(|&e| u8::from(e)));
            }
        }
        w.finish();
    }
}

#[cfg(test)]
mod tests;
