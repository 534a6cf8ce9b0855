//! Distributed shared memory's messages (MIRAGE+, paper 002, §2.2; issue 40): between the
//! sites of a segment and its library site, one-way, one frame each (the request id is 0: a
//! message is answered, if at all, by another message naming the same ticket).
//!
//! ```text
//! DSM = segment:u64 tag:u8 page:u32 ticket:u64 body
//!   0 REQUEST      want:u8                      site → library
//!   1 SEND         to:u64 grant:u8 wait         library → the clock site
//!   2 INVALIDATE   ack:u8 to:u64                library → a site with a copy
//!   3 INVALIDATED                               site → library
//!   4 PAGE         grant:u8 flags:u16 len:u16 crc:u32 wait data  the clock site → the requester
//!   5 GRANT        wait                         library → an upgrading site
//!   6 DONE                                      requester → library
//!   7 LOOKUP       len:u8 name                  a machine → every member (ticket: a nonce)
//!   8 FOUND        pages:u32 delta_ms:u32 uid:u32 mode:u16   the library → the asker
//!   9 ABSENT                                    any member → the asker
//!  10 UNLINK                                    a machine → every member
//!  11 LOST                                      library → a requester (the page went with a crash)
//!  12 PROBE                                     library → a requester (its page's source crashed)
//!  13 MISSING                                   requester → library (that page did not come)
//!  14 FORGET                                    library → the sender of a write copy
//!  15 RESTORE                                   library → the sender of a write copy
//!  16 REPORT       flags:u8 count:u16 held[count]   a site → every member (its library crashed)
//!       held = page:u32 access:u8 lost:u8 ghost:u64 installed:u64   (22 bytes)
//!  17 ACK                                       a site that dropped its copy → the requester
//!  18 EXCUSE       site:u64                     library → a requester (`site` crashed)
//! want, grant: 0 read, 1 write; REPORT's access: 0 none, 1 read, 2 write
//! wait = count:u8 site[count]:u64   the sites whose ACK the requester waits for
//! ```
//!
//! A write's invalidations are acknowledged to its requester (INVALIDATE's ack 1, `to` the
//! requester: ACK), which installs the page or grant once every site in its `wait` has
//! acknowledged — three one-way hops rather than four through the library. With ack 0 (`to`
//! 0) they are acknowledged to the library (INVALIDATED): a write with more copies to drop
//! than a `wait` names, and the copies invalidated again after a requester crashed.
//!
//! REPORT says what a site holds of a segment whose library crashed, for the next library to
//! be rebuilt from (`netram_dsm::Library::rebuild`): in the ticket field its era, in the page
//! field the part's number (0, 1, …: at most [`MAX_REPORT_HELD`] pages a frame), flag 1: it is
//! the last part, flag 2: the sender has the segment at all (a member that has not reports
//! nothing, so that the others know they heard from everyone). `ghost` 0: none.
//!
//! ```text
//! ```
//!
//! LOOKUP, FOUND and ABSENT name segments: a machine attaching a segment by name asks every
//! member; the segment's library answers FOUND (the segment's id in `segment`, its size,
//! window, owner and permission bits), every other member ABSENT. UNLINK takes a segment's
//! name away (System V's IPC_RMID): no machine attaches it by name any more, the processes
//! attached keep it. `page` is 0 in them.
//!
//! A page's data is `PAGE_SIZE` bytes; or none with [`PageFlags::ZERO`] (MIRAGE+ §3.4: a zero
//! page travels as a flag); or, with [`PageFlags::LZ4`], `len` bytes (1 to `PAGE_SIZE - 1`) of
//! the page compressed in LZ4's block format, when the sender's rule says that pays
//! ([`crate::compress`]; `len` is 0 otherwise). Its crc32c covers the segment, the page
//! number, the flags and the data as sent, computed by the sender and checked by the receiver
//! (which then refuses anything that does not decompress to exactly a page), so a page damaged or sent under
//! another page's number is refused. Who sent a message is the authenticated connection's
//! node, never a field (the library refuses requests from sites the creator did not admit).
//! Every field has one encoding, so a decoded message re-encodes to the same bytes (the
//! fuzzer checks it: `fuzz/fuzz_targets/decode.rs`).

use crate::codec::{DecodeError, FrameBuilder, Reader};
use crate::message::{split_frame, Kind};
use crate::page::PageFlags;
use crate::PAGE_SIZE;

/// Read or write access, as it travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    Read = 0,
    Write = 1,
}

/// One DSM message's body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body<'a> {
    Request {
        want: Access,
    },
    Send {
        to: u64,
        grant: Access,
        /// [`WAIT_SITE_LEN`] bytes a site ([`wait_sites`]).
        wait: &'a [u8],
    },
    /// Drop your copy; acknowledge to this site (`None`: to the library).
    Invalidate {
        ack_to: Option<u64>,
    },
    Invalidated,
    Page {
        grant: Access,
        flags: PageFlags,
        crc: u32,
        wait: &'a [u8],
        /// `PAGE_SIZE` bytes, or none for a zero page.
        data: &'a [u8],
    },
    Grant {
        wait: &'a [u8],
    },
    Done,
    /// Which segment is called `name` (1 to [`MAX_NAME`] bytes)?
    Lookup {
        name: &'a [u8],
    },
    /// This one: `pages` pages, its window, its owner's uid and permission bits.
    Found {
        pages: u32,
        delta_ms: u32,
        uid: u32,
        mode: u16,
    },
    /// Not one of mine.
    Absent,
    /// Segment `segment`'s name is taken away.
    Unlink,
    Lost,
    Probe,
    Missing,
    Forget,
    Restore,
    /// What a site holds (`held`: [`REPORT_HELD_LEN`] bytes a page; [`Body::report_held`]).
    Report {
        last: bool,
        attached: bool,
        held: &'a [u8],
    },
    Ack,
    Excuse {
        site: u64,
    },
}

/// The bytes of one site in a `wait` list.
pub const WAIT_SITE_LEN: usize = 8;
/// Sites in a `wait` list at most.
pub const MAX_WAIT: usize = 255;

/// The sites of a `wait` list (checked when it was decoded).
pub fn wait_sites(wait: &[u8]) -> impl Iterator<Item = u64> + '_ {
    wait.chunks_exact(WAIT_SITE_LEN)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
}

/// `sites` as a `wait` list's bytes (at most [`MAX_WAIT`]).
pub fn wait_bytes(sites: impl IntoIterator<Item = u64>) -> Vec<u8> {
    let out: Vec<u8> = sites.into_iter().flat_map(u64::to_le_bytes).collect();
    assert!(
        out.len() <= MAX_WAIT * WAIT_SITE_LEN,
        "a wait list names at most {MAX_WAIT} sites"
    );
    out
}

fn read_wait<'a>(r: &mut Reader<'a>) -> Result<&'a [u8], DecodeError> {
    let n = r.u8()? as usize;
    r.bytes(n * WAIT_SITE_LEN)
}

/// One page in a REPORT: its number, the access held (0 none, 1 read, 2 write), whether it
/// was lost, the ticket of the write copy kept after sending it (0: none), the newest ticket
/// installed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportHeld {
    pub page: u32,
    pub access: u8,
    pub lost: bool,
    pub ghost: u64,
    pub installed: u64,
}

/// The bytes of one page in a REPORT.
pub const REPORT_HELD_LEN: usize = 22;
/// Pages in one REPORT frame at most.
pub const MAX_REPORT_HELD: usize = 2048;

impl ReportHeld {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.page.to_le_bytes());
        out.push(self.access);
        out.push(u8::from(self.lost));
        out.extend_from_slice(&self.ghost.to_le_bytes());
        out.extend_from_slice(&self.installed.to_le_bytes());
    }

    fn decode(b: &[u8]) -> Self {
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        Self {
            page: u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")),
            access: b[4],
            lost: b[5] != 0,
            ghost: u64_at(6),
            installed: u64_at(14),
        }
    }
}

impl Body<'_> {
    /// A REPORT's pages (checked when it was decoded); nothing for any other body.
    pub fn report_held(&self) -> impl Iterator<Item = ReportHeld> + '_ {
        let held: &[u8] = match self {
            Body::Report { held, .. } => held,
            _ => &[],
        };
        held.chunks_exact(REPORT_HELD_LEN).map(ReportHeld::decode)
    }
}

/// The longest segment name.
pub const MAX_NAME: usize = 255;

/// One DSM message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    pub segment: u64,
    pub page: u32,
    /// 0 in a REQUEST (the library numbers requests as it takes them).
    pub ticket: u64,
    pub body: Body<'a>,
}

/// crc32c over a transferred page's segment, number, flags and data, little-endian.
pub fn page_checksum(segment: u64, page: u32, flags: PageFlags, data: &[u8]) -> u32 {
    let mut head = [0u8; 14];
    head[0..8].copy_from_slice(&segment.to_le_bytes());
    head[8..12].copy_from_slice(&page.to_le_bytes());
    head[12..14].copy_from_slice(&flags.0.to_le_bytes());
    crc32c::crc32c_append(crc32c::crc32c(&head), data)
}

impl<'a> Message<'a> {
    /// A PAGE message carrying `data` (a zero page travels as a flag), sealed with its
    /// checksum.
    pub fn page(
        segment: u64,
        page: u32,
        ticket: u64,
        grant: Access,
        wait: &'a [u8],
        data: &'a [u8],
    ) -> Self {
        assert_eq!(data.len(), PAGE_SIZE, "a page is {PAGE_SIZE} bytes");
        let (flags, data) = PageFlags::zero_or(data);
        Self::sealed(segment, page, ticket, grant, flags, wait, data)
    }

    fn sealed(
        segment: u64,
        page: u32,
        ticket: u64,
        grant: Access,
        flags: PageFlags,
        wait: &'a [u8],
        data: &'a [u8],
    ) -> Self {
        Self {
            segment,
            page,
            ticket,
            body: Body::Page {
                grant,
                flags,
                crc: page_checksum(segment, page, flags, data),
                wait,
                data,
            },
        }
    }

    /// A PAGE message carrying `data` packed by `rule` ([`crate::compress::Rule::pack`]): a
    /// zero page as a flag, a page the rule compresses in LZ4's block format (in `scratch`,
    /// at least [`crate::compress::PACKED_ROOM`] bytes), any other as it is; with what became
    /// of it.
    #[allow(clippy::too_many_arguments)]
    pub fn packed_page(
        segment: u64,
        page: u32,
        ticket: u64,
        grant: Access,
        wait: &'a [u8],
        data: &'a [u8],
        rule: &crate::compress::Rule,
        scratch: &'a mut [u8],
    ) -> (Self, crate::compress::Packed) {
        use crate::compress::Packed;
        let packed = rule.pack(data, scratch);
        let (flags, data) = match packed {
            Packed::Zero => (PageFlags(PageFlags::ZERO), &data[..0]),
            Packed::Compressed(n) => (PageFlags(PageFlags::LZ4), &scratch[..n]),
            Packed::Raw(_) => (PageFlags::default(), data),
        };
        (
            Self::sealed(segment, page, ticket, grant, flags, wait, data),
            packed,
        )
    }

    /// The receiver's check of a PAGE: its checksum matches this segment, page and contents
    /// (other messages carry no data and pass).
    pub fn verify(&self) -> bool {
        match self.body {
            Body::Page {
                flags, crc, data, ..
            } => crc == page_checksum(self.segment, self.page, flags, data),
            _ => true,
        }
    }

    /// Appends this message as one frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut w = FrameBuilder::begin(out, Kind::Dsm as u8, 0);
        let tag = match self.body {
            Body::Request { .. } => 0,
            Body::Send { .. } => 1,
            Body::Invalidate { .. } => 2,
            Body::Invalidated => 3,
            Body::Page { .. } => 4,
            Body::Grant { .. } => 5,
            Body::Done => 6,
            Body::Lookup { .. } => 7,
            Body::Found { .. } => 8,
            Body::Absent => 9,
            Body::Unlink => 10,
            Body::Lost => 11,
            Body::Probe => 12,
            Body::Missing => 13,
            Body::Forget => 14,
            Body::Restore => 15,
            Body::Report { .. } => 16,
            Body::Ack => 17,
            Body::Excuse { .. } => 18,
        };
        w.u64(self.segment).u8(tag).u32(self.page).u64(self.ticket);
        match self.body {
            Body::Request { want } => {
                w.u8(want as u8);
            }
            Body::Send { to, grant, wait } => {
                w.u64(to).u8(grant as u8);
                put_wait(&mut w, wait);
            }
            Body::Invalidate { ack_to } => {
                w.u8(u8::from(ack_to.is_some())).u64(ack_to.unwrap_or(0));
            }
            Body::Grant { wait } => put_wait(&mut w, wait),
            Body::Excuse { site } => {
                w.u64(site);
            }
            Body::Page {
                grant,
                flags,
                crc,
                wait,
                data,
            } => {
                let len = if flags.is_lz4() {
                    assert!(
                        (1..PAGE_SIZE).contains(&data.len()),
                        "a compressed page is 1 to {} bytes",
                        PAGE_SIZE - 1
                    );
                    data.len() as u16
                } else {
                    debug_assert_eq!(data.len(), if flags.is_zero() { 0 } else { PAGE_SIZE });
                    0
                };
                w.u8(grant as u8).u16(flags.0).u16(len).u32(crc);
                put_wait(&mut w, wait);
                w.bytes(data);
            }
            Body::Lookup { name } => {
                assert!(
                    (1..=MAX_NAME).contains(&name.len()),
                    "a segment's name is 1 to {MAX_NAME} bytes"
                );
                w.u8(name.len() as u8).bytes(name);
            }
            Body::Found {
                pages,
                delta_ms,
                uid,
                mode,
            } => {
                w.u32(pages).u32(delta_ms).u32(uid).u16(mode);
            }
            Body::Report {
                last,
                attached,
                held,
            } => {
                let n = held.len() / REPORT_HELD_LEN;
                assert!(
                    held.len() % REPORT_HELD_LEN == 0 && n <= MAX_REPORT_HELD,
                    "a report holds whole pages, at most {MAX_REPORT_HELD}"
                );
                w.u8(u8::from(last) | u8::from(attached) << 1)
                    .u16(n as u16)
                    .bytes(held);
            }
            Body::Invalidated
            | Body::Ack
            | Body::Done
            | Body::Absent
            | Body::Unlink
            | Body::Lost
            | Body::Probe
            | Body::Missing
            | Body::Forget
            | Body::Restore => {}
        }
        w.finish();
    }
}

fn put_wait(w: &mut FrameBuilder<'_>, wait: &[u8]) {
    let n = wait.len() / WAIT_SITE_LEN;
    assert!(
        wait.len().is_multiple_of(WAIT_SITE_LEN) && n <= MAX_WAIT,
        "a wait list names whole sites, at most {MAX_WAIT}"
    );
    w.u8(n as u8).bytes(wait);
}

fn access(r: &mut Reader<'_>, field: &'static str) -> Result<Access, DecodeError> {
    match r.u8()? {
        0 => Ok(Access::Read),
        1 => Ok(Access::Write),
        v => Err(DecodeError::BadValue {
            field,
            value: v.into(),
        }),
    }
}

/// Whether `frame` (whole) is a DSM message, by its kind: how a daemon tells them from the
/// requests it answers.
pub fn is_dsm(frame: &[u8]) -> bool {
    split_frame(frame).is_ok_and(|(kind, _, _)| kind == Kind::Dsm as u8)
}

/// Decodes one whole DSM frame (length prefix included).
pub fn decode(frame: &[u8]) -> Result<Message<'_>, DecodeError> {
    let (kind, req_id, mut r) = split_frame(frame)?;
    if kind != Kind::Dsm as u8 {
        return Err(DecodeError::UnknownKind(kind));
    }
    if req_id != 0 {
        return Err(DecodeError::BadValue {
            field: "dsm request id",
            value: req_id,
        });
    }
    let segment = r.u64()?;
    let tag = r.u8()?;
    let page = r.u32()?;
    let ticket = r.u64()?;
    let body = match tag {
        0 => Body::Request {
            want: access(&mut r, "want")?,
        },
        1 => Body::Send {
            to: r.u64()?,
            grant: access(&mut r, "grant")?,
            wait: read_wait(&mut r)?,
        },
        2 => {
            let ack = r.u8()?;
            let to = r.u64()?;
            // One encoding: to the library (0, and no site), or to a site.
            let ack_to = match (ack, to) {
                (0, 0) => None,
                (1, to) => Some(to),
                _ => {
                    return Err(DecodeError::BadValue {
                        field: "dsm invalidate acknowledgement",
                        value: ack.into(),
                    })
                }
            };
            Body::Invalidate { ack_to }
        }
        3 => Body::Invalidated,
        4 => {
            let grant = access(&mut r, "grant")?;
            let flags = r.u16()?;
            // One of: zero, compressed, neither.
            if flags & !(PageFlags::ZERO | PageFlags::LZ4) != 0
                || flags == PageFlags::ZERO | PageFlags::LZ4
            {
                return Err(DecodeError::Reserved {
                    field: "dsm page flags",
                    value: flags.into(),
                });
            }
            let flags = PageFlags(flags);
            let len = if flags.is_lz4() {
                let len = r.u16()? as usize;
                if !(1..PAGE_SIZE).contains(&len) {
                    return Err(DecodeError::BadValue {
                        field: "dsm compressed page length",
                        value: len as u64,
                    });
                }
                len
            } else {
                r.reserved_u16("dsm page length")?;
                if flags.is_zero() {
                    0
                } else {
                    PAGE_SIZE
                }
            };
            let crc = r.u32()?;
            let wait = read_wait(&mut r)?;
            Body::Page {
                grant,
                flags,
                crc,
                wait,
                data: r.bytes(len)?,
            }
        }
        5 => Body::Grant {
            wait: read_wait(&mut r)?,
        },
        6 => Body::Done,
        7 => {
            let len = r.u8()? as usize;
            if len == 0 {
                return Err(DecodeError::BadValue {
                    field: "dsm segment name length",
                    value: 0,
                });
            }
            Body::Lookup {
                name: r.bytes(len)?,
            }
        }
        8 => Body::Found {
            pages: r.u32()?,
            delta_ms: r.u32()?,
            uid: r.u32()?,
            mode: r.u16()?,
        },
        9 => Body::Absent,
        10 => Body::Unlink,
        11 => Body::Lost,
        12 => Body::Probe,
        13 => Body::Missing,
        14 => Body::Forget,
        15 => Body::Restore,
        16 => {
            let flags = r.u8()?;
            if flags & !3 != 0 {
                return Err(DecodeError::Reserved {
                    field: "dsm report flags",
                    value: flags.into(),
                });
            }
            let n = r.u16()? as usize;
            if n > MAX_REPORT_HELD {
                return Err(DecodeError::BadValue {
                    field: "dsm report pages",
                    value: n as u64,
                });
            }
            let held = r.bytes(n * REPORT_HELD_LEN)?;
            // One encoding each: access 0 to 2, lost 0 or 1.
            for h in held.chunks_exact(REPORT_HELD_LEN) {
                if h[4] > 2 || h[5] > 1 {
                    return Err(DecodeError::BadValue {
                        field: "dsm report access or lost",
                        value: u64::from(h[4]) << 8 | u64::from(h[5]),
                    });
                }
            }
            Body::Report {
                last: flags & 1 != 0,
                attached: flags & 2 != 0,
                held,
            }
        }
        17 => Body::Ack,
        18 => Body::Excuse { site: r.u64()? },
        t => {
            return Err(DecodeError::BadValue {
                field: "dsm message",
                value: t.into(),
            })
        }
    };
    if matches!(body, Body::Request { .. }) && ticket != 0 {
        return Err(DecodeError::BadValue {
            field: "dsm request ticket",
            value: ticket,
        });
    }
    r.finish()?;
    Ok(Message {
        segment,
        page,
        ticket,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_access() -> impl Strategy<Value = Access> {
        prop_oneof![Just(Access::Read), Just(Access::Write)]
    }

    proptest! {
        #[test]
        fn messages_round_trip(
            segment in any::<u64>(),
            page in any::<u32>(),
            ticket in 1u64..,
            to in any::<u64>(),
            want in arb_access(),
            tag in 0u8..19,
            fill in any::<u8>(),
            name in proptest::collection::vec(any::<u8>(), 1..=MAX_NAME),
        ) {
            let data = vec![fill; PAGE_SIZE];
            let mut held = Vec::new();
            for i in 0..u32::from(fill % 5) {
                ReportHeld {
                    page: page.wrapping_add(i),
                    access: (fill % 3),
                    lost: fill % 2 == 0,
                    ghost: ticket,
                    installed: to,
                }
                .encode(&mut held);
            }
            let wait = wait_bytes((0..u64::from(fill % 4)).map(|i| to ^ i));
            let body = match tag {
                0 => Body::Request { want },
                1 => Body::Send { to, grant: want, wait: &wait },
                2 => Body::Invalidate { ack_to: (fill % 2 == 0).then_some(to) },
                3 => Body::Invalidated,
                4 => Message::page(segment, page, ticket, want, &wait, &data).body,
                5 => Body::Grant { wait: &wait },
                6 => Body::Done,
                7 => Body::Lookup { name: &name },
                8 => Body::Found { pages: page, delta_ms: fill.into(), uid: to as u32, mode: 0o640 },
                9 => Body::Absent,
                10 => Body::Unlink,
                11 => Body::Lost,
                12 => Body::Probe,
                13 => Body::Missing,
                14 => Body::Forget,
                15 => Body::Restore,
                17 => Body::Ack,
                18 => Body::Excuse { site: to },
                _ => Body::Report { last: fill % 2 == 0, attached: fill % 3 != 0, held: &held },
            };
            let ticket = if tag == 0 { 0 } else { ticket };
            let m = Message { segment, page, ticket, body };
            prop_assert!(m.verify());
            let mut buf = Vec::new();
            m.encode(&mut buf);
            prop_assert_eq!(decode(&buf).unwrap(), m);
        }

        /// Whatever bytes arrive: a message or an error, never a panic; a message accepted
        /// re-encodes to exactly the bytes received.
        #[test]
        fn any_bytes_decode_or_are_refused(body in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut buf = Vec::new();
            let mut w = FrameBuilder::begin(&mut buf, Kind::Dsm as u8, 0);
            w.bytes(&body);
            w.finish();
            if let Ok(m) = decode(&buf) {
                let mut again = Vec::new();
                m.encode(&mut again);
                prop_assert_eq!(again, buf.clone());
            }
        }
    }

    /// A compressed page round-trips with its length; the flags and lengths that cannot be
    /// are refused.
    #[test]
    fn compressed_pages_carry_their_length_and_nothing_else_passes() {
        use crate::compress::{Packed, Rule, PACKED_ROOM};
        let rule = Rule {
            link_bytes_per_us: 12.5,
            codec_us: 3.0,
        };
        let mut data = vec![0u8; PAGE_SIZE];
        data[..300]
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i * 7) as u8);
        let mut scratch = [0u8; PACKED_ROOM];
        let (m, packed) =
            Message::packed_page(9, 4, 2, Access::Read, &[], &data, &rule, &mut scratch);
        let Packed::Compressed(n) = packed else {
            panic!("{packed:?}")
        };
        assert!(m.verify());
        let mut buf = Vec::new();
        m.encode(&mut buf);
        assert_eq!(decode(&buf).unwrap(), m);
        // flags at: header, segment, tag, page, ticket, grant.
        let at = crate::FRAME_HEADER_LEN + 8 + 1 + 4 + 8 + 1;
        assert_eq!(u16::from_le_bytes([buf[at + 2], buf[at + 3]]) as usize, n);
        let with = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = buf.clone();
            f(&mut b);
            decode(&b).is_ok()
        };
        // Zero and compressed at once; an unknown flag; lengths 0 and a whole page.
        let both = (PageFlags::ZERO | PageFlags::LZ4).to_le_bytes();
        assert!(!with(&|b| b[at..at + 2].copy_from_slice(&both)));
        assert!(!with(&|b| b[at] |= 1 << 3));
        assert!(!with(
            &|b| b[at + 2..at + 4].copy_from_slice(&0u16.to_le_bytes())
        ));
        let whole = (PAGE_SIZE as u16).to_le_bytes();
        assert!(!with(&|b| b[at + 2..at + 4].copy_from_slice(&whole)));
        // A length on a page that is not compressed.
        let plain = Message::page(9, 4, 2, Access::Read, &[], &data);
        let mut b = Vec::new();
        plain.encode(&mut b);
        b[at + 2] = 1;
        assert!(decode(&b).is_err());
    }

    /// An invalidation is acknowledged to the library (0, and no site named) or to a site (1):
    /// anything else is refused, and so is a wait list longer than its frame.
    #[test]
    fn acknowledgements_and_wait_lists_have_one_encoding() {
        let frame = |ack_to| {
            let mut buf = Vec::new();
            Message {
                segment: 1,
                page: 2,
                ticket: 3,
                body: Body::Invalidate { ack_to },
            }
            .encode(&mut buf);
            buf
        };
        let at = crate::FRAME_HEADER_LEN + 8 + 1 + 4 + 8;
        let to_library = frame(None);
        assert_eq!(to_library[at], 0);
        assert!(decode(&to_library).is_ok());
        let mut named = to_library.clone();
        named[at + 1] = 7;
        assert!(decode(&named).is_err(), "to the library, yet a site named");
        let mut bad = to_library.clone();
        bad[at] = 2;
        assert!(decode(&bad).is_err());
        let to_site = frame(Some(0));
        assert_eq!(
            decode(&to_site).unwrap().body,
            Body::Invalidate { ack_to: Some(0) }
        );
        let wait = wait_bytes([5, 6]);
        let mut grant = Vec::new();
        Message {
            segment: 1,
            page: 2,
            ticket: 3,
            body: Body::Grant { wait: &wait },
        }
        .encode(&mut grant);
        let m = decode(&grant).unwrap();
        let Body::Grant { wait } = m.body else {
            panic!("{m:?}")
        };
        assert_eq!(wait_sites(wait).collect::<Vec<_>>(), [5, 6]);
        // A count of three sites with two in the frame.
        grant[at] = 3;
        assert!(decode(&grant).is_err());
    }

    #[test]
    fn a_page_under_another_number_or_damaged_fails_its_checksum() {
        let data = vec![3u8; PAGE_SIZE];
        let m = Message::page(9, 4, 2, Access::Write, &[], &data);
        assert!(m.verify());
        assert!(!Message { page: 5, ..m }.verify());
        assert!(!Message { segment: 8, ..m }.verify());
        let mut bad = data.clone();
        bad[100] ^= 1;
        let Body::Page {
            grant, flags, crc, ..
        } = m.body
        else {
            unreachable!()
        };
        let damaged = Message {
            body: Body::Page {
                grant,
                flags,
                crc,
                wait: &[],
                data: &bad,
            },
            ..m
        };
        assert!(!damaged.verify());
        let zero = vec![0u8; PAGE_SIZE];
        let z = Message::page(9, 4, 2, Access::Read, &[], &zero);
        assert!(
            matches!(z.body, Body::Page { flags, data, .. } if flags.is_zero() && data.is_empty())
        );
        let mut buf = Vec::new();
        z.encode(&mut buf);
        assert_eq!(
            buf.len(),
            crate::FRAME_HEADER_LEN + 8 + 1 + 4 + 8 + 1 + 2 + 2 + 4 + 1
        );
        // A request with a ticket, and another request id, are refused.
        let mut buf = Vec::new();
        Message {
            segment: 1,
            page: 1,
            ticket: 0,
            body: Body::Request { want: Access::Read },
        }
        .encode(&mut buf);
        let ticket_at = crate::FRAME_HEADER_LEN + 8 + 1 + 4;
        buf[ticket_at] = 1;
        assert!(decode(&buf).is_err());
    }
}
