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

use common::{eventually, ServerProcess};
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
        "--max-handshakes-per-address",
        "4",
        "--lease-period",
        "200ms",
    ]);
    let (_, threads_before) = rss_and_threads(server.pid());
    // 300 silent connections from one address: four get a handshake slot, the rest are
    // answered Busy at once, with no thread started for them.
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
    assert!(counter(&server.addr, "connections_refused_addr_handshakes") >= 290);
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

/// Issue 36, attack 4: connection slots were counted per source address only, so eight
/// addresses holding 64 silent sockets each filled a daemon's 256 slots and a member was
/// answered Busy 27 times in 28. Now handshakes in progress have a pool of their own, limited
/// per address and per subnet, and a newcomer takes the slot of the oldest handshake of the
/// fullest subnet: 64 addresses, each in a /24 of its own, hold every handshake slot they can
/// get (silent, and TLS ClientHellos cut short) and renew them as they are closed, while a
/// member (over TLS, from 127.0.0.1) connects again and again and is served every time, and a
/// member connected before the attack is never disturbed.
#[test]
fn strangers_holding_every_handshake_slot_cannot_keep_a_member_out() {
    use netram_client::open::{open_pager, OpenOptions};
    use netram_pager::{Backing, Scheme};
    let server = ServerProcess::start(&["--capacity", "64M"]);
    let open = || {
        open_pager(&OpenOptions {
            security: common::security(),
            servers: vec![server.addr.clone()],
            backing: Backing::Cluster,
            pages: 256,
            cache_pages: 0,
            spill_dir: None,
            low_latency: false,
            redundancy: Scheme::None,
        })
    };
    let page = |i: u64, round: u64| page_data(i * 7 + round);
    let mut before = open().expect("a member before the attack");
    for i in 0..64 {
        before.write(i, &page(i, 0)).unwrap();
    }
    before.flush().unwrap();

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let filled = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let attacker = {
        let (stop, filled, addr) = (stop.clone(), filled.clone(), server.addr.clone());
        std::thread::spawn(move || {
            let mut held: Vec<TcpStream> = Vec::new();
            let mut opened = 0u64;
            // A TLS record header announcing a ClientHello that never comes whole.
            let partial = [0x16u8, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc];
            let end = Instant::now() + Duration::from_secs(40);
            while !stop.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < end {
                // Sockets the server closed (taken over, refused, timed out) are renewed.
                held.retain(|s| {
                    let mut b = [0u8; 64];
                    s.set_nonblocking(true).unwrap();
                    matches!((&*s).read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
                });
                for k in 0..64u8 {
                    for _ in 0..8 {
                        if held.len() >= 64 * 8 {
                            break;
                        }
                        let mut s = connect_from(Ipv4Addr::new(127, 1, k, 1), &addr);
                        if opened % 2 == 1 {
                            let _ = s.write_all(&partial);
                        }
                        opened += 1;
                        held.push(s);
                    }
                }
                filled.store(true, std::sync::atomic::Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(50));
            }
            opened
        })
    };
    // The attack has every slot it can get (a first 512 connections, and the renewal of
    // those refused or closed).
    eventually("the strangers' first pass", 30, || {
        filled.load(std::sync::atomic::Ordering::SeqCst)
    });
    std::thread::sleep(Duration::from_millis(200));
    for round in 1..=5u64 {
        let mut p = open().unwrap_or_else(|e| panic!("round {round}: {e}"));
        // A pager whose server answered Busy starts with it dead and keeps its pages on the
        // local disk: the member must have got a session.
        assert!(
            p.servers().all(|(_, alive)| alive),
            "round {round}: the member was kept out"
        );
        for i in 0..64 {
            p.write(i, &page(i, round)).unwrap();
        }
        p.flush().unwrap();
        assert_eq!(
            p.pages_on_disk_only(),
            0,
            "round {round}: pages on the server"
        );
        let mut buf = vec![0u8; PAGE_SIZE];
        for i in 0..64 {
            p.read(i, &mut buf).unwrap();
            assert_eq!(buf, page(i, round), "round {round}, page {i}");
        }
    }
    let mut buf = vec![0u8; PAGE_SIZE];
    for i in 0..64 {
        before.read(i, &mut buf).unwrap();
        assert_eq!(buf, page(i, 0), "the member connected before, page {i}");
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let opened = attacker.join().unwrap();
    let taken = server.stat("handshakes_taken_over");
    println!(
        "{opened} attacking connections from 64 addresses; {taken} handshakes taken over; {} \
         refused per address, {} per subnet",
        server.stat("connections_refused_addr_handshakes"),
        server.stat("connections_refused_subnet_handshakes"),
    );
    assert!(taken >= 5, "the member's connections took slots over");
}

/// GMS's clean pages on a running daemon (issue 39): held and read back byte for byte,
/// taken away by their user; a damaged or mislabelled one refused and counted; a younger one
/// replaces the oldest, an older one is refused; owned pages take clean pages' frames rather
/// than be refused; an epoch message is counted and dropped (daemons do not run epochs yet);
/// a malformed GMS frame closes only its own connection.
#[test]
fn clean_pages_are_held_checked_and_give_way_to_owned_pages() {
    use netram_proto::gms::{
        CachedPage, CachedStatus, Epoch, Reply as GmsReply, Request as GmsRequest,
    };
    let server = ServerProcess::start(&["--insecure", "--capacity", "1M"]);
    let frames = 256u128;
    let mut s = session(HONEST, &server.addr, 0x9e5);
    let gms_call = |s: &mut TcpStream, id: u64, req: &GmsRequest<'_>| {
        let mut buf = Vec::new();
        req.encode(id, &mut buf);
        s.write_all(&buf).unwrap();
        read_frame(s)
    };
    let put_status = |s: &mut TcpStream, id: u64, pages: Vec<CachedPage<'_>>| {
        let frame = gms_call(s, id, &GmsRequest::PutCached(pages));
        match netram_proto::gms::decode_reply(&frame).unwrap().1 {
            GmsReply::PutCached { status, .. } => status,
            other => panic!("{other:?}"),
        }
    };
    let datas: Vec<Vec<u8>> = (0..frames as u64 + 2).map(page_data).collect();
    let chunk_of = |chunk: u128| -> Vec<CachedPage<'_>> {
        (chunk * 64..(chunk + 1) * 64)
            .map(|u| CachedPage::seal(u, 60_000, &datas[u as usize]))
            .collect()
    };
    // One client may hold three quarters of the daemon's frames (its quota), clean pages
    // counted apart from its owned ones: the fourth chunk is refused.
    for chunk in 0..4 {
        let st = put_status(&mut s, chunk as u64, chunk_of(chunk));
        let want = if chunk < 3 {
            CachedStatus::Taken
        } else {
            CachedStatus::Refused
        };
        assert!(st.iter().all(|&st| st == want), "chunk {chunk}: {st:?}");
    }
    // Another client fills the rest.
    let mut other = session(ATTACKER, &server.addr, 0x07e5);
    let st = put_status(&mut other, 1, chunk_of(3));
    assert!(st.iter().all(|&st| st == CachedStatus::Taken), "{st:?}");
    // Damaged, and under another uid.
    let mut bad = CachedPage::seal(900, 10, &datas[0]);
    bad.uid = 901;
    assert_eq!(put_status(&mut s, 10, vec![bad]), [CachedStatus::Corrupt]);
    // Full: a page older than every one held is refused; a younger one replaces the oldest.
    let old = CachedPage::seal(frames, 3_600_000, &datas[frames as usize]);
    // Age 0: the held pages' ages are the daemon's uptime at most (their 60 s is more than
    // it has been up), which can be under the 5 ms this page once had (CI saw it refused).
    let young = CachedPage::seal(frames + 1, 0, &datas[frames as usize + 1]);
    assert_eq!(
        put_status(&mut other, 11, vec![old]),
        [CachedStatus::Refused]
    );
    assert_eq!(
        put_status(&mut other, 12, vec![young]),
        [CachedStatus::Replaced]
    );
    // Read back, verified; taken away by its user.
    let frame = gms_call(
        &mut s,
        13,
        &GmsRequest::GetCached {
            take: true,
            uids: vec![frames + 1, 5],
        },
    );
    let GmsReply::GetCached { pages, .. } = netram_proto::gms::decode_reply(&frame).unwrap().1
    else {
        panic!("not a GET_CACHED reply");
    };
    for (p, want) in pages.iter().zip([frames as usize + 1, 5]) {
        let p = p.expect("held");
        assert!(p.verify() && p.data == datas[want]);
    }
    let frame = gms_call(
        &mut s,
        14,
        &GmsRequest::GetCached {
            take: false,
            uids: vec![5],
        },
    );
    assert!(matches!(
        netram_proto::gms::decode_reply(&frame).unwrap().1,
        GmsReply::GetCached { pages, .. } if pages == [None]
    ));
    // Owned pages are never refused while clean pages can give way.
    for p in 0..16u64 {
        let frame = call(
            &mut s,
            100 + p,
            &Request::Put(vec![Page::seal(PageKey::new(1, p), 1, &datas[0])]),
        );
        assert!(
            matches!(decode_reply(&frame).unwrap().1, Reply::Put { status, .. } if status == [PutStatus::Stored])
        );
    }
    // An epoch message has no reply: the next request's reply is the next frame.
    let mut buf = Vec::new();
    GmsRequest::Epoch(Epoch::Stale { epoch: 3 }).encode(200, &mut buf);
    s.write_all(&buf).unwrap();
    let frame = call(&mut s, 201, &Request::Stats);
    assert_eq!(decode_reply(&frame).unwrap().0, 201);
    assert_eq!(counter(&server.addr, "gms_epoch_messages_ignored"), 1);
    assert_eq!(counter(&server.addr, "clean_refused_corrupt"), 1);
    assert_eq!(counter(&server.addr, "clean_refused_younger"), 1);
    assert_eq!(counter(&server.addr, "clean_refused_quota"), 64);
    assert_eq!(counter(&server.addr, "clean_replaced"), 1);
    assert_eq!(counter(&server.addr, "clean_taken"), 2);
    assert!(counter(&server.addr, "clean_dropped_for_owned") >= 14);
    // A summary whose buckets go up: the connection is closed, nobody else is harmed.
    let mut m = session(ATTACKER, &server.addr, 0xbad);
    let mut body = vec![1u8];
    body.extend_from_slice(&1u64.to_le_bytes());
    body.extend_from_slice(&[0; 12]);
    body.extend_from_slice(&[2, 3, 1, 0, 0, 0, 4, 1, 0, 0, 0]);
    let mut frame = Vec::new();
    let mut w =
        netram_proto::FrameBuilder::begin(&mut frame, netram_proto::Kind::GmsEpoch as u8, 1);
    w.bytes(&body);
    w.finish();
    m.write_all(&frame).unwrap();
    assert!(closed_within(&mut m, Duration::from_secs(10)));
    well_behaved_client_is_served(&server.addr);
}

/// A connection that carries DSM messages is read by the shared-memory agent itself once it
/// has carried only those (`netram-server`'s `shm.rs`): garbage DSM frames on it are refused
/// one by one (the agent's checks), a frame of any other kind ends the connection (counted),
/// and the daemon goes on serving.
#[test]
fn a_shared_memory_link_that_breaks_the_rules_is_closed() {
    use netram_proto::dsm::{Body, Message};
    let server = ServerProcess::start(&["--insecure"]);
    let mut s = session(ATTACKER, &server.addr, 0xd5_0001);
    // Messages about a segment that does not exist, and one malformed (a wrong checksum).
    let mut buf = Vec::new();
    for page in 0..64 {
        Message {
            segment: 0xdead,
            page,
            ticket: 1,
            body: Body::Invalidate { ack_to: None },
        }
        .encode(&mut buf);
    }
    let data = page_data(1);
    let mut bad = Message::page(0xdead, 0, 1, netram_proto::dsm::Access::Read, &[], &data);
    if let Body::Page { crc, .. } = &mut bad.body {
        *crc ^= 1;
    }
    bad.encode(&mut buf);
    s.write_all(&buf).unwrap();
    eventually("the link handed to the agent", 10, || {
        counter(&server.addr, "dsm_links_adopted") == 1
    });
    // Read by the agent now: more of the same are refused there, not by the connection.
    s.write_all(&buf).unwrap();
    // Then a request that is not DSM: the agent closes the connection.
    let mut stats = Vec::new();
    Request::Stats.encode(1, &mut stats);
    s.write_all(&stats).unwrap();
    assert!(
        closed_within(&mut s, Duration::from_secs(10)),
        "the link was closed"
    );
    assert_eq!(counter(&server.addr, "dsm_links_refused"), 1);
    assert_eq!(counter(&server.addr, "dsm_frames_received"), 130);
    eventually("the agent refused every one", 10, || {
        counter(&server.addr, "dsm_agent_frames_refused") == 130
    });
    well_behaved_client_is_served(&server.addr);
}
