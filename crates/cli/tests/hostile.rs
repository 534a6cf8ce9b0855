//! Attacks on a running `netram serve` over loopback, each of which took a daemon down or
//! starved its other clients before the limits of issue "No peer can take a daemon down": the
//! daemon must refuse each one (a counted refusal or a closed connection) and keep serving a
//! well-behaved client, which every test checks at its end (`well_behaved_client_is_served`).
//!
//! The attacker connects from 127.0.0.2 and the well-behaved client from 127.0.0.1: two
//! addresses, as two hosts would be, so that limits per client address can tell them apart.
//! The daemons here run `--insecure` (clear TCP): these attacks are on what follows the
//! handshake, the same behind TLS, and speak it byte by byte.

mod common;

use common::ServerProcess;
use netram_proto::{
    decode_reply, frame_len, GetResult, Hello, Member, Page, PageKey, PutStatus, Record, Reply,
    Request, Welcome, WelcomeStatus, HELLO_LEN, PAGE_SIZE, WELCOME_LEN,
};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::time::{Duration, Instant};

const ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const HONEST: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);

/// A TCP connection to `server` from the local address `from`.
fn connect_from(from: Ipv4Addr, server: &str) -> TcpStream {
    use rustix::net::{AddressFamily, SocketType};
    let server: SocketAddr = server.parse().unwrap();
    let fd = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    rustix::net::bind(&fd, &SocketAddr::V4(SocketAddrV4::new(from, 0))).unwrap();
    rustix::net::connect(&fd, &server).unwrap();
    let s = TcpStream::from(fd);
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// Sends a handshake and returns the welcome's status.
fn handshake(s: &mut TcpStream, node: u64) -> WelcomeStatus {
    s.write_all(&Hello::new(node, 1, 1).encode()).unwrap();
    let mut w = [0u8; WELCOME_LEN];
    s.read_exact(&mut w).unwrap();
    Welcome::decode(&w).unwrap().status
}

/// A connection with an open session.
fn session(from: Ipv4Addr, server: &str, node: u64) -> TcpStream {
    let mut s = connect_from(from, server);
    assert_eq!(handshake(&mut s, node), WelcomeStatus::Ok);
    s
}

/// Sends one request and reads its reply (whole frame).
fn call(s: &mut TcpStream, id: u64, req: &Request<'_>) -> Vec<u8> {
    let mut buf = Vec::new();
    req.encode(id, &mut buf);
    s.write_all(&buf).unwrap();
    read_frame(s)
}

fn read_frame(s: &mut TcpStream) -> Vec<u8> {
    let mut frame = vec![0u8; 4];
    s.read_exact(&mut frame).unwrap();
    let len = frame_len(&frame).unwrap().unwrap();
    frame.resize(len, 0);
    s.read_exact(&mut frame[4..]).unwrap();
    frame
}

fn page_data(seed: u64) -> Vec<u8> {
    (0..PAGE_SIZE)
        .map(|i| (seed as usize * 31 + i) as u8)
        .collect()
}

/// A fresh client from 127.0.0.1 stores pages and reads them back intact.
fn well_behaved_client_is_served(server: &str) {
    let mut s = session(HONEST, server, 0xc1ea_0000 + fastrand::u64(..1 << 16));
    for p in 0..16u64 {
        let data = page_data(p);
        let frame = call(
            &mut s,
            p,
            &Request::Put(vec![Page::seal(PageKey::new(1, p), 1, &data)]),
        );
        let (_, reply) = decode_reply(&frame).unwrap();
        assert!(
            matches!(&reply, Reply::Put { status, .. } if status == &[PutStatus::Stored]),
            "the well-behaved client's PUT: {reply:?}"
        );
    }
    let keys: Vec<PageKey> = (0..16).map(|p| PageKey::new(1, p)).collect();
    let frame = call(&mut s, 99, &Request::Get(keys));
    let (_, reply) = decode_reply(&frame).unwrap();
    let Reply::Get { pages, .. } = reply else {
        panic!("GET answered {reply:?}");
    };
    for (p, got) in pages.iter().enumerate() {
        let GetResult::Found(page) = got else {
            panic!("page {p} missing");
        };
        assert!(page.verify() && page.data == page_data(p as u64));
    }
}

/// A server's counter, read with STATS over a connection of its own.
fn counter(server: &str, name: &str) -> u64 {
    let mut s = session(HONEST, server, 0x5_7a75);
    let frame = call(&mut s, 1, &Request::Stats);
    let (_, reply) = decode_reply(&frame).unwrap();
    let Reply::Stats { counters, .. } = reply else {
        panic!("STATS answered {reply:?}");
    };
    counters
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no counter {name}"))
        .value
}

/// Resident memory and threads of a process, from /proc.
fn rss_and_threads(pid: i32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap()
    };
    (field("VmRSS:") * 1024, field("Threads:"))
}

/// Waits until `s` is closed by the server (EOF or reset), at most `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut buf = [0u8; 65536];
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return true,
        }
    }
    false
}

fn server_addr(i: u32) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::from(0x0a00_0000 + i), 7077))
}

fn ship_req<'a>(group: u64, max_members: u8, members: Vec<Member>, zero: &'a [u8]) -> Request<'a> {
    Request::ParityShip {
        group,
        max_members,
        members,
        record: Record {
            version: 0,
            crc: 0,
            flags: 0,
            data: zero,
        },
    }
}

/// Groups merged beyond what a frame carries made a PARITY_SCAN reply over the frame limit
/// trip an assertion in the daemon. Groups now stop at 16 members and a scan's reply fits.
#[test]
fn merged_parity_groups_and_their_scan_fit_a_frame() {
    let server = ServerProcess::start(&["--insecure", "--capacity", "256M"]);
    let mut s = session(ATTACKER, &server.addr, 0xbad);
    let zero = vec![0u8; PAGE_SIZE];
    // 128 x 255 one-member groups, every member on its own server, the owner asking for
    // groups of 255: each is small and mergeable with the others.
    let groups = 128 * 255u64;
    let mut buf = Vec::new();
    for first in (0..groups).step_by(64) {
        let batch = first..(first + 64).min(groups);
        for g in batch.clone() {
            let m = Member {
                server: server_addr(g as u32),
                node: 0,
                key: PageKey::new(1, g),
                version: 1,
            };
            ship_req(g, 255, vec![m], &zero).encode(g, &mut buf);
        }
        s.write_all(&buf).unwrap();
        buf.clear();
        for _ in batch {
            let frame = read_frame(&mut s);
            let (_, reply) = decode_reply(&frame).unwrap();
            assert!(matches!(&reply, Reply::Put { status, .. } if status == &[PutStatus::Stored]));
        }
    }
    let frame = call(
        &mut s,
        1 << 40,
        &Request::ParityScan {
            dead: server_addr(0),
            max: 128,
        },
    );
    let (_, reply) = decode_reply(&frame).expect("the scan reply decodes (and so fits a frame)");
    let Reply::ParityScan { groups, .. } = reply else {
        panic!("the scan answered {reply:?}");
    };
    assert!(!groups.is_empty());
    assert!(groups.iter().all(|g| g.members.len() <= 16));
    drop(s);
    well_behaved_client_is_served(&server.addr);
}

/// 65,535 distinct server addresses made the interning table hand out an id it never stored,
/// and the next lookup indexed out of bounds. The table now refuses when full.
#[test]
fn the_address_table_refuses_rather_than_overflows() {
    let server = ServerProcess::start(&["--insecure", "--capacity", "64M"]);
    let mut s = session(ATTACKER, &server.addr, 0xbad);
    let zero = vec![0u8; PAGE_SIZE];
    let mut refused = 0;
    let mut next = 0u32;
    for g in 0..(65_536 / 16 + 4) as u64 {
        let members: Vec<Member> = (0..16)
            .map(|i| Member {
                server: server_addr(next + i),
                node: 0,
                key: PageKey::new(1, u64::from(next + i)),
                version: 1,
            })
            .collect();
        next += 16;
        let frame = call(&mut s, g, &ship_req(g, 16, members, &zero));
        let (_, reply) = decode_reply(&frame).unwrap();
        match reply {
            Reply::Put { status, .. } if status == [PutStatus::Stored] => {}
            Reply::Put { status, .. } if status == [PutStatus::Full] => refused += 1,
            other => panic!("PARITY_SHIP answered {other:?}"),
        }
    }
    assert!(refused >= 4, "the full table refused {refused} groups");
    // A scan naming an address the table never took works too.
    let frame = call(
        &mut s,
        1 << 40,
        &Request::ParityScan {
            dead: server_addr(1 << 24),
            max: 128,
        },
    );
    decode_reply(&frame).unwrap();
    drop(s);
    assert!(counter(&server.addr, "parity_addresses_refused") >= 4);
    well_behaved_client_is_served(&server.addr);
}

/// A panic in a connection's code (here a test-only fault point) used to leak its slot for
/// good and poison the store: 256 of them and every client was answered Busy.
#[test]
fn a_panic_ends_only_its_connection() {
    let server = ServerProcess::start(&[
        "--insecure",
        "--max-connections",
        "8",
        "--fault-panic-on-stats",
    ]);
    for _ in 0..300 {
        // The same session each time (resumed), as a client reconnecting after each crash.
        let mut s = session(ATTACKER, &server.addr, 0xbad);
        let mut buf = Vec::new();
        Request::Stats.encode(1, &mut buf);
        s.write_all(&buf).unwrap();
        assert!(
            closed_within(&mut s, Duration::from_secs(10)),
            "the panicking connection was closed"
        );
    }
    well_behaved_client_is_served(&server.addr);
}

/// Silent connections each used to get a thread before the limit was checked, and kept their
/// slot forever; a handshake sent a byte at a time was never timed out.
#[test]
fn silent_and_slow_connections_hold_no_slot() {
    let server = ServerProcess::start(&[
        "--insecure",
        "--max-connections",
        "16",
        "--max-connections-per-client",
        "4",
        "--lease-period",
        "200ms",
    ]);
    let (_, threads_before) = rss_and_threads(server.pid());
    // 300 silent connections from one address: four get a slot, the rest are answered Busy
    // at once, with no thread started for them.
    let mut silent: Vec<TcpStream> = (0..300)
        .map(|_| connect_from(ATTACKER, &server.addr))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let (_, threads) = rss_and_threads(server.pid());
    assert!(
        threads <= threads_before + 4,
        "{threads} threads with 300 silent connections ({threads_before} before)"
    );
    let mut busy = 0;
    for s in silent.iter_mut().skip(4) {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut w = [0u8; WELCOME_LEN];
        if s.read_exact(&mut w).is_ok()
            && Welcome::decode(&w).unwrap().status == WelcomeStatus::Busy
        {
            busy += 1;
        }
    }
    assert!(busy >= 290, "{busy} of 296 answered Busy");
    well_behaved_client_is_served(&server.addr);
    // The four silent ones are closed by the handshake deadline (5 s).
    for s in silent.iter_mut().take(4) {
        assert!(closed_within(s, Duration::from_secs(8)));
    }
    drop(silent);
    // A handshake a byte per 500 ms would take 20 s: the deadline closes it after 5 s.
    let mut slow = connect_from(ATTACKER, &server.addr);
    let hello = Hello::new(0xbad, 1, 1).encode();
    let started = Instant::now();
    let mut closed = false;
    for b in hello.iter().take(HELLO_LEN - 1) {
        if slow.write_all(&[*b]).is_err() || closed_within(&mut slow, Duration::from_millis(500)) {
            closed = true;
            break;
        }
    }
    assert!(closed, "a byte-at-a-time handshake was not cut off");
    assert!(started.elapsed() < Duration::from_secs(8));
    // An established connection that sends nothing is closed after three lease periods.
    let mut idle = session(ATTACKER, &server.addr, 0xbad);
    assert!(closed_within(&mut idle, Duration::from_secs(3)));
    assert!(counter(&server.addr, "connections_closed_idle") >= 1);
    assert!(counter(&server.addr, "connections_refused_peer_limit") >= 290);
    well_behaved_client_is_served(&server.addr);
}

/// A client that sends GETs and never reads its replies made the server buffer them all
/// (~150 MiB per connection). Now it is served a window at a time, held back by TCP, and
/// closed when its replies cannot be written.
#[test]
fn a_client_that_never_reads_cannot_grow_the_server() {
    let server =
        ServerProcess::start(&["--insecure", "--capacity", "64M", "--write-timeout", "2s"]);
    let mut s = session(ATTACKER, &server.addr, 0xbad);
    let data = page_data(7);
    let frame = call(
        &mut s,
        0,
        &Request::Put(vec![Page::seal(PageKey::new(1, 0), 1, &data)]),
    );
    decode_reply(&frame).unwrap();
    let (rss_before, _) = rss_and_threads(server.pid());
    // GETs of 128 pages each (512 KiB of reply per 1.5 KiB of request), never read.
    let keys: Vec<PageKey> = (0..128).map(|_| PageKey::new(1, 0)).collect();
    let mut buf = Vec::new();
    for id in 1..=4096u64 {
        Request::Get(keys.clone()).encode(id, &mut buf);
    }
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    // The server stops reading once its replies back up: the write blocks and times out.
    let _ = s.write_all(&buf);
    std::thread::sleep(Duration::from_millis(500));
    let (rss, _) = rss_and_threads(server.pid());
    assert!(
        rss < rss_before + (32 << 20),
        "the server grew by {} MiB for a client that does not read",
        (rss - rss_before) >> 20
    );
    well_behaved_client_is_served(&server.addr);
    std::thread::sleep(Duration::from_secs(3));
    assert!(counter(&server.addr, "connections_closed_write_timeout") >= 1);
    drop(s);
}

/// Short handshakes filled the session table (4,096 slots), since sessions outlive their
/// connection for three lease periods. One client now holds at most its share.
#[test]
fn handshakes_from_one_client_cannot_fill_the_session_table() {
    let server = ServerProcess::start(&["--insecure", "--max-sessions-per-client", "16"]);
    let mut refused = 0;
    for node in 0..64u64 {
        let mut s = connect_from(ATTACKER, &server.addr);
        if handshake(&mut s, 0xbad_0000 + node) == WelcomeStatus::TooManySessions {
            refused += 1;
        }
    }
    assert_eq!(refused, 64 - 16);
    assert_eq!(
        counter(&server.addr, "handshakes_refused_peer_sessions"),
        48
    );
    well_behaved_client_is_served(&server.addr);
}

/// One session could fill the whole arena. A client now fills at most its quota (three
/// quarters of the capacity by default), and another is served.
#[test]
fn one_client_cannot_fill_the_arena() {
    let server = ServerProcess::start(&["--insecure", "--capacity", "4M"]);
    let mut s = session(ATTACKER, &server.addr, 0xbad);
    let data = page_data(1);
    let mut stored = 0;
    for p in 0..1024u64 {
        let frame = call(
            &mut s,
            p,
            &Request::Put(vec![Page::seal(PageKey::new(1, p), 1, &data)]),
        );
        match decode_reply(&frame).unwrap().1 {
            Reply::Put { status, .. } if status == [PutStatus::Stored] => stored += 1,
            Reply::Put { status, .. } if status == [PutStatus::Full] => {}
            other => panic!("PUT answered {other:?}"),
        }
    }
    assert_eq!(stored, 768, "three quarters of 1,024 frames");
    assert_eq!(counter(&server.addr, "puts_refused_quota"), 1024 - 768);
    well_behaved_client_is_served(&server.addr);
}
