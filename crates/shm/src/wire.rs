//! The protocol's messages ([`netram_dsm::Msg`]) to and from their frames
//! ([`netram_proto::dsm`]): a page's contents travel beside the message, as the protocol's
//! state machines keep none (the memfd is the copy).

use netram_dsm::{Held, Msg, Want};
use netram_proto::compress::{Packed, Rule, PACKED_ROOM};
use netram_proto::dsm::{self, Access, Body, Message, ReportHeld};
use netram_proto::{DecodeError, PAGE_SIZE};

/// A page's contents in flight: `None` is a zero page.
pub type Data = Option<Box<[u8]>>;

fn access(w: Want) -> Access {
    match w {
        Want::Read => Access::Read,
        Want::Write => Access::Write,
    }
}

fn want(a: Access) -> Want {
    match a {
        Access::Read => Want::Read,
        Access::Write => Want::Write,
    }
}

/// Encodes `msg` of `segment` (with `data` for a PAGE) as one frame appended to `out`; a
/// PAGE's contents packed by `rule` if given ([`netram_proto::compress`]: a zero page is a
/// flag either way), with what became of them.
pub fn encode(
    segment: u64,
    msg: &Msg<()>,
    data: Option<&[u8]>,
    rule: Option<&Rule>,
    out: &mut Vec<u8>,
) -> Option<Packed> {
    let page = msg.page();
    let m = |ticket, body| Message {
        segment,
        page,
        ticket,
        body,
    };
    let zero = [0u8; netram_proto::PAGE_SIZE];
    let wait = match msg {
        Msg::Send { wait, .. } | Msg::Grant { wait, .. } | Msg::Page { wait, .. } => {
            dsm::wait_bytes(wait.iter().copied())
        }
        _ => Vec::new(),
    };
    let message = match *msg {
        Msg::Request { want, .. } => m(0, Body::Request { want: access(want) }),
        Msg::Send {
            to, grant, ticket, ..
        } => m(
            ticket,
            Body::Send {
                to,
                grant: access(grant),
                wait: &wait,
            },
        ),
        Msg::Invalidate { ticket, ack_to, .. } => m(ticket, Body::Invalidate { ack_to }),
        Msg::Invalidated { ticket, .. } => m(ticket, Body::Invalidated),
        Msg::Ack { ticket, .. } => m(ticket, Body::Ack),
        Msg::Excuse { ticket, site, .. } => m(ticket, Body::Excuse { site }),
        Msg::Grant { ticket, .. } => m(ticket, Body::Grant { wait: &wait }),
        Msg::Done { ticket, .. } => m(ticket, Body::Done),
        Msg::Lost { ticket, .. } => m(ticket, Body::Lost),
        Msg::Probe { ticket, .. } => m(ticket, Body::Probe),
        Msg::Missing { ticket, .. } => m(ticket, Body::Missing),
        Msg::Forget { ticket, .. } => m(ticket, Body::Forget),
        Msg::Restore { ticket, .. } => m(ticket, Body::Restore),
        Msg::Page { grant, ticket, .. } => {
            let data = data.unwrap_or(&zero);
            let Some(rule) = rule else {
                Message::page(segment, page, ticket, access(grant), &wait, data).encode(out);
                return None;
            };
            let mut scratch = [0u8; PACKED_ROOM];
            let (m, packed) = Message::packed_page(
                segment,
                page,
                ticket,
                access(grant),
                &wait,
                data,
                rule,
                &mut scratch,
            );
            m.encode(out);
            return Some(packed);
        }
    };
    message.encode(out);
    None
}

/// Why a frame was refused.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("page {page} of segment {segment:#x} fails its checksum")]
    Checksum { segment: u64, page: u32 },
    #[error("a segment name that is not UTF-8")]
    Name,
    #[error("a naming message where a protocol message belongs")]
    NotProtocol,
}

/// What a segment is, as its library tells a machine looking it up by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    pub pages: u32,
    pub delta_ms: u32,
    /// Its owner's uid and permission bits (as System V's `shm_perm`).
    pub uid: u32,
    pub mode: u16,
}

/// A decoded frame.
#[derive(Debug)]
pub enum Frame {
    /// A message of the coherence protocol, with a PAGE's contents.
    Protocol {
        segment: u64,
        msg: Msg<()>,
        data: Data,
    },
    Lookup {
        nonce: u64,
        name: String,
    },
    Found {
        nonce: u64,
        segment: u64,
        meta: Meta,
    },
    Absent {
        nonce: u64,
    },
    Unlink {
        segment: u64,
    },
    /// One part of what a site holds of a segment whose library crashed (`era`: its era;
    /// `attached`: false from a machine that does not have the segment).
    Report {
        segment: u64,
        era: u64,
        part: u32,
        last: bool,
        attached: bool,
        held: Vec<Held>,
    },
}

/// Encodes a naming message (LOOKUP, FOUND, ABSENT) appended to `out`.
pub fn encode_naming(frame: &Frame, out: &mut Vec<u8>) {
    let (segment, ticket, body) = match *frame {
        Frame::Lookup { nonce, ref name } => (
            0,
            nonce,
            Body::Lookup {
                name: name.as_bytes(),
            },
        ),
        Frame::Found {
            nonce,
            segment,
            meta,
        } => (
            segment,
            nonce,
            Body::Found {
                pages: meta.pages,
                delta_ms: meta.delta_ms,
                uid: meta.uid,
                mode: meta.mode,
            },
        ),
        Frame::Absent { nonce } => (0, nonce, Body::Absent),
        Frame::Unlink { segment } => (segment, 0, Body::Unlink),
        Frame::Report {
            segment,
            era,
            part,
            last,
            attached,
            ref held,
        } => {
            let mut bytes = Vec::with_capacity(held.len() * dsm::REPORT_HELD_LEN);
            for h in held {
                ReportHeld {
                    page: h.page,
                    access: match h.access {
                        netram_dsm::Access::None => 0,
                        netram_dsm::Access::Read => 1,
                        netram_dsm::Access::Write => 2,
                    },
                    lost: h.lost,
                    ghost: h.ghost.unwrap_or(0),
                    installed: h.installed,
                }
                .encode(&mut bytes);
            }
            Message {
                segment,
                page: part,
                ticket: era,
                body: Body::Report {
                    last,
                    attached,
                    held: &bytes,
                },
            }
            .encode(out);
            return;
        }
        Frame::Protocol { .. } => panic!("encode_naming is for naming messages"),
    };
    Message {
        segment,
        page: 0,
        ticket,
        body,
    }
    .encode(out);
}

/// Decodes one frame.
pub fn decode_frame(frame: &[u8]) -> Result<Frame, WireError> {
    let m = dsm::decode(frame)?;
    match m.body {
        Body::Lookup { name } => {
            let name = std::str::from_utf8(name)
                .map_err(|_| WireError::Name)?
                .to_owned();
            return Ok(Frame::Lookup {
                nonce: m.ticket,
                name,
            });
        }
        Body::Found {
            pages,
            delta_ms,
            uid,
            mode,
        } => {
            return Ok(Frame::Found {
                nonce: m.ticket,
                segment: m.segment,
                meta: Meta {
                    pages,
                    delta_ms,
                    uid,
                    mode,
                },
            })
        }
        Body::Absent => return Ok(Frame::Absent { nonce: m.ticket }),
        Body::Unlink => return Ok(Frame::Unlink { segment: m.segment }),
        Body::Report { last, attached, .. } => {
            let held = m
                .body
                .report_held()
                .map(|h| Held {
                    page: h.page,
                    access: match h.access {
                        0 => netram_dsm::Access::None,
                        1 => netram_dsm::Access::Read,
                        _ => netram_dsm::Access::Write,
                    },
                    ghost: (h.ghost != 0).then_some(h.ghost),
                    installed: h.installed,
                    lost: h.lost,
                })
                .collect();
            return Ok(Frame::Report {
                segment: m.segment,
                era: m.ticket,
                part: m.page,
                last,
                attached,
                held,
            });
        }
        _ => {}
    }
    let (segment, msg, data) = protocol(m)?;
    Ok(Frame::Protocol { segment, msg, data })
}

/// Decodes one frame of the coherence protocol: its segment, the message, and a PAGE's
/// contents.
pub fn decode(frame: &[u8]) -> Result<(u64, Msg<()>, Data), WireError> {
    match decode_frame(frame)? {
        Frame::Protocol { segment, msg, data } => Ok((segment, msg, data)),
        _ => Err(WireError::NotProtocol),
    }
}

fn protocol(m: Message<'_>) -> Result<(u64, Msg<()>, Data), WireError> {
    if !m.verify() {
        return Err(WireError::Checksum {
            segment: m.segment,
            page: m.page,
        });
    }
    let (page, ticket) = (m.page, m.ticket);
    let mut data = None;
    let msg = match m.body {
        Body::Request { want: w } => Msg::Request {
            page,
            want: want(w),
        },
        Body::Send { to, grant, wait } => Msg::Send {
            page,
            to,
            grant: want(grant),
            ticket,
            wait: dsm::wait_sites(wait).collect(),
        },
        Body::Invalidate { ack_to } => Msg::Invalidate {
            page,
            ticket,
            ack_to,
        },
        Body::Invalidated => Msg::Invalidated { page, ticket },
        Body::Ack => Msg::Ack { page, ticket },
        Body::Excuse { site } => Msg::Excuse { page, ticket, site },
        Body::Grant { wait } => Msg::Grant {
            page,
            ticket,
            wait: dsm::wait_sites(wait).collect(),
        },
        Body::Done => Msg::Done { page, ticket },
        Body::Lost => Msg::Lost { page, ticket },
        Body::Probe => Msg::Probe { page, ticket },
        Body::Missing => Msg::Missing { page, ticket },
        Body::Forget => Msg::Forget { page, ticket },
        Body::Restore => Msg::Restore { page, ticket },
        Body::Lookup { .. }
        | Body::Found { .. }
        | Body::Absent
        | Body::Unlink
        | Body::Report { .. } => return Err(WireError::NotProtocol),
        Body::Page {
            grant,
            flags,
            wait,
            data: d,
            ..
        } => {
            if flags.is_lz4() {
                // Refused unless it decompresses to exactly a page.
                let mut page = vec![0u8; PAGE_SIZE].into_boxed_slice();
                netram_proto::compress::unpack(d, &mut page)?;
                data = Some(page);
            } else if !flags.is_zero() {
                data = Some(d.into());
            }
            Msg::Page {
                page,
                grant: want(grant),
                ticket,
                data: (),
                wait: dsm::wait_sites(wait).collect(),
            }
        }
    };
    Ok((m.segment, msg, data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use netram_proto::compress::Skip;

    #[test]
    fn every_message_comes_back_as_it_went() {
        let mut page = vec![0u8; netram_proto::PAGE_SIZE];
        page[7] = 9;
        let msgs: [(Msg<()>, Option<&[u8]>); 13] = [
            (
                Msg::Request {
                    page: 1,
                    want: Want::Write,
                },
                None,
            ),
            (
                Msg::Send {
                    page: 2,
                    to: 5,
                    grant: Want::Read,
                    ticket: 3,
                    wait: vec![],
                },
                None,
            ),
            (
                Msg::Invalidate {
                    page: 3,
                    ticket: 4,
                    ack_to: Some(9),
                },
                None,
            ),
            (
                Msg::Invalidate {
                    page: 3,
                    ticket: 4,
                    ack_to: None,
                },
                None,
            ),
            (Msg::Invalidated { page: 3, ticket: 4 }, None),
            (Msg::Ack { page: 3, ticket: 4 }, None),
            (
                Msg::Excuse {
                    page: 3,
                    ticket: 4,
                    site: 12,
                },
                None,
            ),
            (
                Msg::Grant {
                    page: 4,
                    ticket: 5,
                    wait: vec![2, u64::MAX, 0],
                },
                None,
            ),
            (Msg::Done { page: 4, ticket: 5 }, None),
            (Msg::Lost { page: 4, ticket: 6 }, None),
            (Msg::Restore { page: 4, ticket: 7 }, None),
            (
                Msg::Page {
                    page: 6,
                    grant: Want::Write,
                    ticket: 7,
                    data: (),
                    wait: vec![],
                },
                Some(&page),
            ),
            (
                Msg::Page {
                    page: 6,
                    grant: Want::Read,
                    ticket: 8,
                    data: (),
                    wait: vec![],
                },
                None,
            ),
        ];
        for (msg, data) in msgs {
            let mut frame = Vec::new();
            encode(77, &msg, data, None, &mut frame);
            let (seg, back, d) = decode(&frame).unwrap();
            assert_eq!((seg, &back), (77, &msg));
            assert_eq!(d.as_deref(), data);
        }
        // A page's byte changed on the way.
        let mut frame = Vec::new();
        encode(
            77,
            &Msg::Page {
                page: 6,
                grant: Want::Write,
                ticket: 7,
                data: (),
                wait: vec![],
            },
            Some(&page),
            None,
            &mut frame,
        );
        let n = frame.len();
        frame[n - 1] ^= 1;
        assert!(matches!(decode(&frame), Err(WireError::Checksum { .. })));
    }

    /// MIRAGE+'s UptoN over a 100 Mbit/s link: a page written in its first 512 bytes travels
    /// compressed and comes back whole; a random page travels as it is (the codec gave up);
    /// over a link too fast to repay the codec nothing is compressed.
    #[test]
    fn pages_travel_compressed_when_the_rule_says_so_and_come_back_whole() {
        let slow = Rule {
            link_bytes_per_us: 12.5,
            codec_us: 3.0,
        };
        let fast = Rule {
            link_bytes_per_us: 10_000.0,
            codec_us: 3.0,
        };
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        };
        let mut upto = vec![0u8; PAGE_SIZE];
        upto[..512].iter_mut().for_each(|b| *b = rand());
        let random: Vec<u8> = (0..PAGE_SIZE).map(|_| rand()).collect();
        let msg = Msg::Page {
            page: 6,
            grant: Want::Read,
            ticket: 8,
            data: (),
            wait: vec![],
        };
        for (page, rule, expect) in [
            (&upto, slow, Packed::Compressed(0)),
            (&random, slow, Packed::Raw(Skip::Aborted)),
            (&upto, fast, Packed::Raw(Skip::LinkFast)),
        ] {
            let mut frame = Vec::new();
            let packed = encode(77, &msg, Some(page), Some(&rule), &mut frame).unwrap();
            match (packed, expect) {
                (Packed::Compressed(n), Packed::Compressed(_)) => {
                    assert!(n < 600, "{n} bytes");
                    assert!(frame.len() < 700, "a frame of {} bytes", frame.len());
                }
                (got, want) => assert_eq!(got, want),
            }
            let (_, back, d) = decode(&frame).unwrap();
            assert_eq!(back, msg);
            assert_eq!(d.as_deref(), Some(&page[..]));
        }
    }

    /// A compressed page that does not decompress to exactly a page is refused, though its
    /// checksum (over the bytes sent) is right.
    #[test]
    fn a_compressed_page_that_is_not_a_page_is_refused() {
        let short = lz4_flex::block::compress(&[7u8; 100]);
        let flags = netram_proto::PageFlags(netram_proto::PageFlags::LZ4);
        for data in [&short[..], &[0xffu8; 40][..]] {
            let m = Message {
                segment: 77,
                page: 1,
                ticket: 2,
                body: Body::Page {
                    grant: Access::Read,
                    flags,
                    crc: dsm::page_checksum(77, 1, flags, data),
                    wait: &[],
                    data,
                },
            };
            let mut frame = Vec::new();
            m.encode(&mut frame);
            assert!(
                matches!(decode(&frame), Err(WireError::Decode(_))),
                "{:?}",
                decode(&frame)
            );
        }
    }

    #[test]
    fn naming_messages_come_back_as_they_went() {
        let meta = Meta {
            pages: 9,
            delta_ms: 2,
            uid: 1000,
            mode: 0o640,
        };
        for f in [
            Frame::Lookup {
                nonce: 3,
                name: "matrix".into(),
            },
            Frame::Found {
                nonce: 3,
                segment: 0xabc,
                meta,
            },
            Frame::Absent { nonce: 3 },
            Frame::Unlink { segment: 0xabc },
        ] {
            let mut out = Vec::new();
            encode_naming(&f, &mut out);
            assert_eq!(
                format!("{:?}", decode_frame(&out).unwrap()),
                format!("{f:?}")
            );
        }
    }
}
