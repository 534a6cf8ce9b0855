//! Hostile peers against a machine's shared-memory agent (`netram_shm::Agent`): the library of
//! one segment and a site of another, fed frames from sites 1–4 — raw bytes, and well-formed
//! protocol and naming messages with any fields (pages past the end, tickets nobody issued,
//! orders from non-libraries, pages nobody asked for, crash handling's messages, reports of
//! a takeover in any parts and order) — sites declared down (the library of the segment it is
//! a site of among them: a takeover), and time passing. It must never panic,
//! and a local process's request (`netram_shm::local::Request::parse`) is parsed or refused.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use netram_dsm::{Msg, Want};
use netram_shm::agent::Role;
use netram_shm::wire::{self, Frame, Meta};
use netram_shm::Agent;

#[derive(Debug, Arbitrary)]
enum Op {
    Raw {
        from: u8,
        bytes: Vec<u8>,
    },
    Protocol {
        from: u8,
        segment: bool,
        tag: u8,
        page: u8,
        ticket: u8,
        to: u8,
        write: bool,
        fill: u8,
    },
    Lookup {
        from: u8,
        nonce: u8,
        name: bool,
    },
    Found {
        from: u8,
        nonce: u8,
        pages: u16,
    },
    Absent {
        from: u8,
        nonce: u8,
    },
    Unlink {
        from: u8,
        segment: bool,
    },
    Report {
        from: u8,
        segment: u8,
        era: u8,
        part: u8,
        last: bool,
        attached: bool,
        /// page, access (0–2), lost, ghost, installed.
        held: Vec<(u8, u8, bool, u8, u8)>,
    },
    Tick,
    /// A site declared down.
    Down(u8),
    Local(Vec<u8>),
}

const MINE: u64 = 0x11;
const THEIRS: u64 = 0x22;

fuzz_target!(|ops: Vec<Op>| {
    let mut agent = Agent::new(1, Box::new(|_, _| {}));
    // What it sends is compressed when a slow link's rule says so.
    agent.set_compression(Some(netram_proto::compress::Rule {
        link_bytes_per_us: 12.5,
        codec_us: 3.0,
    }));
    let meta = Meta {
        pages: 4,
        delta_ms: 0,
        uid: 0,
        mode: 0o600,
    };
    agent
        .add(MINE, "mine", meta, Role::Library(Some(&[2, 3])))
        .unwrap();
    agent.add(THEIRS, "theirs", meta, Role::Site(2)).unwrap();
    let (tx, _rx) = std::sync::mpsc::channel();
    agent.lookup(
        "elsewhere",
        &[2, 3, 4],
        std::time::Duration::from_millis(1),
        tx,
    );
    let site = |f: u8| u64::from(f % 4) + 1;
    for op in ops.into_iter().take(256) {
        let mut frame = Vec::new();
        let from = match op {
            Op::Raw { from, bytes } => {
                frame = bytes;
                site(from)
            }
            Op::Protocol {
                from,
                segment,
                tag,
                page,
                ticket,
                to,
                write,
                fill,
            } => {
                let (page, ticket) = (u32::from(page % 8), u64::from(ticket % 8));
                let want = if write { Want::Write } else { Want::Read };
                // Wait lists of up to three of the fuzzer's sites (from `fill`'s bits).
                let wait: Vec<u64> = (0..3u8)
                    .filter(|b| fill & (1 << b) != 0)
                    .map(|b| site(to.wrapping_add(b)))
                    .collect();
                let msg = match tag % 14 {
                    0 => Msg::Request { page, want },
                    1 => Msg::Send {
                        page,
                        to: site(to),
                        grant: want,
                        ticket,
                        wait,
                    },
                    2 => Msg::Invalidate {
                        page,
                        ticket,
                        ack_to: (fill & 8 != 0).then(|| site(to)),
                    },
                    3 => Msg::Invalidated { page, ticket },
                    4 => Msg::Page {
                        page,
                        grant: want,
                        ticket,
                        data: (),
                        wait,
                    },
                    5 => Msg::Grant { page, ticket, wait },
                    12 => Msg::Ack { page, ticket },
                    13 => Msg::Excuse {
                        page,
                        ticket,
                        site: site(to),
                    },
                    6 => Msg::Done { page, ticket },
                    7 => Msg::Lost { page, ticket },
                    8 => Msg::Probe { page, ticket },
                    9 => Msg::Missing { page, ticket },
                    10 => Msg::Forget { page, ticket },
                    _ => Msg::Restore { page, ticket },
                };
                let data = vec![fill; netram_proto::PAGE_SIZE];
                let seg = if segment { MINE } else { THEIRS };
                // Odd fills travel compressed (a slow link's rule), even ones as they are.
                let slow = netram_proto::compress::Rule {
                    link_bytes_per_us: 12.5,
                    codec_us: 3.0,
                };
                let rule = (fill % 2 == 1).then_some(&slow);
                wire::encode(
                    seg,
                    &msg,
                    (fill != 0).then_some(&data[..]),
                    rule,
                    &mut frame,
                );
                site(from)
            }
            Op::Lookup { from, nonce, name } => {
                let name = if name { "mine" } else { "theirs" }.to_string();
                wire::encode_naming(
                    &Frame::Lookup {
                        nonce: nonce.into(),
                        name,
                    },
                    &mut frame,
                );
                site(from)
            }
            Op::Found { from, nonce, pages } => {
                let meta = Meta {
                    pages: pages.into(),
                    ..meta
                };
                let f = Frame::Found {
                    nonce: nonce.into(),
                    segment: 0x33,
                    meta,
                };
                wire::encode_naming(&f, &mut frame);
                site(from)
            }
            Op::Absent { from, nonce } => {
                wire::encode_naming(
                    &Frame::Absent {
                        nonce: nonce.into(),
                    },
                    &mut frame,
                );
                site(from)
            }
            Op::Unlink { from, segment } => {
                let segment = if segment { MINE } else { THEIRS };
                wire::encode_naming(&Frame::Unlink { segment }, &mut frame);
                site(from)
            }
            Op::Report {
                from,
                segment,
                era,
                part,
                last,
                attached,
                held,
            } => {
                let segment = match segment % 3 {
                    0 => MINE,
                    1 => THEIRS,
                    _ => 0x33,
                };
                let held = held
                    .into_iter()
                    .take(64)
                    .map(|(page, access, lost, ghost, installed)| netram_dsm::Held {
                        page: u32::from(page % 8),
                        access: match access % 3 {
                            0 => netram_dsm::Access::None,
                            1 => netram_dsm::Access::Read,
                            _ => netram_dsm::Access::Write,
                        },
                        lost,
                        ghost: (ghost != 0).then_some(u64::from(ghost)),
                        installed: installed.into(),
                    })
                    .collect();
                wire::encode_naming(
                    &Frame::Report {
                        segment,
                        era: era.into(),
                        part: u32::from(part % 3),
                        last,
                        attached,
                        held,
                    },
                    &mut frame,
                );
                site(from)
            }
            Op::Tick => {
                agent.tick();
                continue;
            }
            Op::Down(s) => {
                agent.site_down(site(s), &[1, 2, 3, 4]);
                continue;
            }
            Op::Local(bytes) => {
                let _ = netram_shm::local::Request::parse(&bytes);
                continue;
            }
        };
        agent.on_frame(from, &frame);
    }
});
