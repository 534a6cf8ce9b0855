//! The `decode` fuzz target's committed starting input (`fuzz/seeds/decode/`): a stream of
//! well-formed parity frames, and one DSM message of each kind, which random bytes rarely
//! reach. (`store_requests` and
//! `pager_replies` build their frames from structured inputs and need no such seed.) The seeds are generated here, so that they follow
//! the wire format: the test fails when a committed seed no longer matches, and
//! `NETRAM_WRITE_FUZZ_SEEDS=1 cargo test -p netram-proto --test fuzz_seeds` writes them anew.

use netram_proto::{
    decode_request, frame_len, Delta, DeltaKind, Member, OwnedRecord, Owner, Page, PageKey,
    ParityOp, Record, Request, PAGE_SIZE,
};
use std::net::SocketAddr;
use std::path::PathBuf;

fn addr(i: u8) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, i], 7077))
}

/// Pages joining a group, its parity shipped, an overwrite in place, a delta, a delete and a
/// scan: one request of each kind the parity code has, in the order a client sends them.
fn seed() -> Vec<u8> {
    let datas: Vec<Vec<u8>> = (1..=3u8).map(|b| vec![b; PAGE_SIZE]).collect();
    let key = |p: u64| PageKey::new(0, p);
    let pages: Vec<Page<'_>> = datas
        .iter()
        .enumerate()
        .map(|(i, d)| Page::seal(key(i as u64), 1, d))
        .collect();
    let mut parity = OwnedRecord::default();
    for p in &pages {
        parity.xor(&Record::of(p));
    }
    let join = ParityOp::Join {
        holder: addr(4),
        holder_node: 5,
        group: 1,
        member: addr(1),
    };
    let newer = vec![9u8; PAGE_SIZE];
    let requests = [
        Request::PutParity(pages.iter().map(|&p| (p, join)).collect()),
        Request::ParityShip {
            group: 1,
            max_members: 4,
            members: (0..3)
                .map(|p| Member {
                    server: addr(1),
                    node: 0,
                    key: key(p),
                    version: 1,
                })
                .collect(),
            record: parity.as_record(),
        },
        Request::PutParity(vec![(Page::seal(key(0), 2, &newer), ParityOp::Keep)]),
        Request::ParityDelta(vec![Delta {
            owner: Owner::SELF,
            group: 1,
            member: addr(1),
            key: key(1),
            from: 1,
            to: 1,
            kind: DeltaKind::Remove,
            record: Record::of(&pages[1]),
        }]),
        Request::Delete(vec![key(2)]),
        Request::ParityScan {
            dead: addr(1),
            max: 8,
        },
    ];
    let mut out = Vec::new();
    for (id, r) in requests.iter().enumerate() {
        r.encode(id as u64 + 1, &mut out);
    }
    out
}

#[test]
fn committed_fuzz_seeds_follow_the_wire_format() {
    let seed = seed();
    // Every frame of the seed decodes.
    let mut rest = &seed[..];
    while !rest.is_empty() {
        let len = frame_len(rest).unwrap().expect("a whole frame");
        decode_request(&rest[..len]).expect("a well-formed request");
        rest = &rest[len..];
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds");
    let path = root.join("decode").join("parity-seed");
    if std::env::var_os("NETRAM_WRITE_FUZZ_SEEDS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &seed).unwrap();
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == seed,
        "{} is not the current seed: run NETRAM_WRITE_FUZZ_SEEDS=1 cargo test -p \
         netram-proto --test fuzz_seeds",
        path.display()
    );
}

/// One DSM message of each kind, a file each (`fuzz/seeds/decode/dsm-*`): the decode target
/// reads its input as one frame, and random bytes rarely make a DSM frame.
fn dsm_seeds() -> Vec<(String, Vec<u8>)> {
    use netram_proto::dsm::{Access, Body, Message};
    let data: Vec<u8> = (0..PAGE_SIZE).map(|i| (i % 251) as u8).collect();
    // A page compressed as a slow link's rule has it (MIRAGE+'s UptoN: its first 200 bytes
    // written).
    let upto: Vec<u8> = (0..PAGE_SIZE)
        .map(|i| if i < 200 { (i * 13) as u8 } else { 0 })
        .collect();
    let mut scratch = [0u8; netram_proto::compress::PACKED_ROOM];
    let slow = netram_proto::compress::Rule {
        link_bytes_per_us: 12.5,
        codec_us: 3.0,
    };
    let (lz4, _) = Message::packed_page(7, 2, 5, Access::Read, &[], &upto, &slow, &mut scratch);
    let wait = netram_proto::dsm::wait_bytes([3, 4]);
    let mut report = Vec::new();
    for (page, access, ghost) in [(0, 2, 0), (1, 1, 0), (2, 0, 9)] {
        netram_proto::dsm::ReportHeld {
            page,
            access,
            lost: false,
            ghost,
            installed: 4,
        }
        .encode(&mut report);
    }
    let bodies = [
        (
            "request",
            Body::Request {
                want: Access::Write,
            },
        ),
        (
            "send",
            Body::Send {
                to: 3,
                grant: Access::Read,
                wait: &[],
            },
        ),
        (
            "send-wait",
            Body::Send {
                to: 3,
                grant: Access::Write,
                wait: &wait,
            },
        ),
        ("invalidate", Body::Invalidate { ack_to: None }),
        ("invalidate-ack-to", Body::Invalidate { ack_to: Some(2) }),
        ("invalidated", Body::Invalidated),
        ("ack", Body::Ack),
        ("excuse", Body::Excuse { site: 4 }),
        (
            "page",
            Message::page(7, 2, 5, Access::Write, &[], &data).body,
        ),
        (
            "page-wait",
            Message::page(7, 2, 5, Access::Write, &wait, &data).body,
        ),
        ("page-lz4", lz4.body),
        ("grant", Body::Grant { wait: &wait }),
        ("done", Body::Done),
        ("lookup", Body::Lookup { name: b"matrix" }),
        (
            "found",
            Body::Found {
                pages: 256,
                delta_ms: 0,
                uid: 1000,
                mode: 0o600,
            },
        ),
        ("absent", Body::Absent),
        ("unlink", Body::Unlink),
        ("lost", Body::Lost),
        ("probe", Body::Probe),
        ("missing", Body::Missing),
        ("forget", Body::Forget),
        ("restore", Body::Restore),
        (
            "report",
            Body::Report {
                last: true,
                attached: true,
                held: &report,
            },
        ),
    ];
    bodies
        .into_iter()
        .map(|(name, body)| {
            let ticket = if name == "request" { 0 } else { 5 };
            let mut out = Vec::new();
            Message {
                segment: 7,
                page: 2,
                ticket,
                body,
            }
            .encode(&mut out);
            (format!("dsm-{name}"), out)
        })
        .collect()
}

#[test]
fn committed_dsm_fuzz_seeds_follow_the_wire_format() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/decode");
    for (name, seed) in dsm_seeds() {
        netram_proto::dsm::decode(&seed).expect("a well-formed DSM message");
        let path = root.join(&name);
        if std::env::var_os("NETRAM_WRITE_FUZZ_SEEDS").is_some() {
            std::fs::write(&path, &seed).unwrap();
        }
        let committed = std::fs::read(&path).unwrap_or_default();
        assert!(
            committed == seed,
            "{} is not the current seed: run NETRAM_WRITE_FUZZ_SEEDS=1 cargo test -p \
             netram-proto --test fuzz_seeds",
            path.display()
        );
    }
}
