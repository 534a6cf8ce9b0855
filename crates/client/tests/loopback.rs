//! The daemon, the TCP transport and the pager together, in one process, over loopback.

use netram_client::{query_stats, ClientConfig, Credentials, Security, TcpTransport};
use netram_net::pki::{ClusterCa, NodeSpec};
use netram_pager::{MemDisk, Pager, PagerConfig};
use netram_proto::{decode_reply, Hello, PutStatus, Reply, Request, PAGE_SIZE};
use netram_server::{Server, ServerConfig};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The tests' cluster, made in memory: a server's credentials and a client's.
fn tls() -> &'static (Security, Security) {
    static TLS: OnceLock<(Security, Security)> = OnceLock::new();
    TLS.get_or_init(|| {
        let ca = ClusterCa::generate().unwrap();
        let creds = |node, server| {
            let pem = ca
                .issue(&NodeSpec {
                    node,
                    server,
                    ..NodeSpec::default()
                })
                .unwrap();
            Security::Tls(Arc::new(Credentials::from_pem(&pem).unwrap()))
        };
        (creds(1, true), creds(50, false))
    })
}

/// A server over TLS, as every server runs.
fn server(capacity_pages: u64, lease: Duration) -> Server {
    server_with(capacity_pages, lease, tls().0.clone())
}

/// A server in clear TCP (`--insecure`), for the tests that speak the protocol byte by byte.
fn server_insecure(capacity_pages: u64, lease: Duration) -> Server {
    server_with(capacity_pages, lease, Security::Insecure)
}

fn server_with(capacity_pages: u64, lease: Duration, security: Security) -> Server {
    let cfg = ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        capacity_bytes: capacity_pages * PAGE_SIZE as u64,
        lease_period: lease,
        security,
        ..Default::default()
    };
    Server::start(cfg, Arc::new(AtomicBool::new(false))).unwrap()
}

/// A client of the TLS servers.
fn client() -> ClientConfig {
    ClientConfig {
        security: tls().1.clone(),
        ..ClientConfig::new()
    }
}

fn stat(s: &Server, name: &str) -> u64 {
    s.stats().into_iter().find(|(k, _)| *k == name).unwrap().1
}

fn page(n: u64) -> Vec<u8> {
    (0..PAGE_SIZE).map(|i| (n as usize * 7 + i) as u8).collect()
}

#[test]
fn pages_round_trip_through_real_sockets() {
    let servers = [
        server(1000, Duration::from_secs(2)),
        server(1000, Duration::from_secs(2)),
    ];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr().to_string()).collect();
    let t = TcpTransport::connect(&addrs, &client());
    let cfg = PagerConfig {
        pages: 500,
        cache_pages: 16,
        ..Default::default()
    };
    let mut p = Pager::new(cfg, t, MemDisk::default());
    for n in 0..500 {
        p.write(n, &page(n)).unwrap();
    }
    p.flush().unwrap();
    let mut out = vec![0u8; PAGE_SIZE];
    for n in (0..500).rev() {
        p.read(n, &mut out).unwrap();
        assert_eq!(out, page(n), "page {n}");
    }
    assert_eq!(
        stat(&servers[0], "stored_pages") + stat(&servers[1], "stored_pages"),
        500
    );
    let remote = query_stats(&addrs[0], Duration::from_secs(2), &tls().1).unwrap();
    assert!(
        remote.iter().any(|(k, v)| k == "pages_stored" && *v > 0),
        "{remote:?}"
    );
    assert!(remote.iter().any(|(k, _)| k == "frames_rejected_malformed"));
    p.into_transport().close();
    assert_eq!(
        stat(&servers[0], "stored_pages") + stat(&servers[1], "stored_pages"),
        0,
        "close frees"
    );
}

#[test]
fn an_idle_client_keeps_its_lease_and_a_dead_one_loses_it() {
    let s = server(100, Duration::from_millis(200));
    let addr = s.addr().to_string();
    // A client whose connection's end goes unseen (a crash of its machine): only the lease
    // frees its pages.
    let silent = ClientConfig {
        end_on_close: false,
        ..client()
    };
    let t = TcpTransport::connect(&[&addr], &silent);
    let mut p = Pager::new(
        PagerConfig {
            pages: 10,
            cache_pages: 0,
            ..Default::default()
        },
        t,
        MemDisk::default(),
    );
    p.write(3, &page(3)).unwrap();
    std::thread::sleep(Duration::from_millis(1500)); // 7 periods idle: the keepalive refreshes
    let mut out = vec![0u8; PAGE_SIZE];
    p.read(3, &mut out).unwrap();
    assert_eq!(out, page(3));
    assert_eq!(stat(&s, "sessions_expired"), 0);
    drop(p); // no CLOSE: like a crashed client
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while stat(&s, "sessions_expired") == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(stat(&s, "sessions_expired"), 1);
    assert_eq!(stat(&s, "stored_pages"), 0);
}

#[test]
fn bad_frames_close_one_connection_and_the_server_serves_on() {
    // Byte by byte in clear: the frame checks behind TLS's records are the same.
    let s = server_insecure(100, Duration::from_secs(2));
    let addr = s.addr();
    let t = TcpTransport::connect(&[addr.to_string()], &ClientConfig::new());
    let mut good = Pager::new(
        PagerConfig {
            pages: 10,
            cache_pages: 0,
            ..Default::default()
        },
        t,
        MemDisk::default(),
    );
    good.write(1, &page(1)).unwrap();

    let attack = |bytes: &[u8]| {
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.write_all(&Hello::new(99, 1, fastrand::u64(..)).encode())
            .unwrap();
        let mut w = [0u8; netram_proto::WELCOME_LEN];
        c.read_exact(&mut w).unwrap();
        c.write_all(bytes).unwrap();
        // The server must close: read until EOF (or reset).
        let mut sink = Vec::new();
        let _ = c.read_to_end(&mut sink);
    };
    attack(&u32::MAX.to_le_bytes()); // oversized
    let mut f = Vec::new();
    Request::Stats.encode(1, &mut f);
    f[4] = 200; // wrong frame version
    attack(&f);
    let mut f = Vec::new();
    Request::Stats.encode(1, &mut f);
    f[5] = 0x42; // unknown kind
    attack(&f);
    let mut f = Vec::new();
    Request::Get(vec![netram_proto::PageKey::new(0, 1)]).encode(1, &mut f);
    f[16..20].copy_from_slice(&1000u32.to_le_bytes()); // lying batch count
    attack(&f);
    // Not a netram peer at all.
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nHost: example\r\nUser-Agent: probe/1.0\r\n\r\n")
        .unwrap();
    let _ = c.read_to_end(&mut Vec::new());

    assert_eq!(stat(&s, "frames_rejected_bad_length"), 1);
    assert_eq!(stat(&s, "frames_rejected_bad_version"), 1);
    assert_eq!(stat(&s, "frames_rejected_unknown_kind"), 1);
    assert_eq!(stat(&s, "frames_rejected_malformed"), 1);
    assert_eq!(stat(&s, "handshakes_bad_magic"), 1);
    let mut out = vec![0u8; PAGE_SIZE];
    good.read(1, &mut out).unwrap();
    assert_eq!(out, page(1), "the good client is still served");
}

/// A raw client connection over TLS (the real handshake, then frames sealed by hand): one
/// request, one reply.
struct Raw(netram_testkit::wire::TlsConn);

impl Raw {
    fn open(addr: std::net::SocketAddr, node: u64, session: u64) -> Self {
        Self(
            netram_testkit::wire::TlsConn::open(addr, &tls().1, &Hello::new(node, 1, session))
                .unwrap(),
        )
    }

    fn call(&mut self, req: &Request<'_>) -> Vec<u8> {
        self.0.call(req)
    }

    fn put(&mut self, page: netram_proto::Page<'_>, op: netram_proto::ParityOp) -> PutStatus {
        let f = self.call(&Request::PutParity(vec![(page, op)]));
        match decode_reply(&f).unwrap().1 {
            Reply::Put { status, .. } => status[0],
            r => panic!("{r:?}"),
        }
    }
}

#[test]
fn a_member_overwrite_reaches_its_holder_over_tcp_before_it_is_acknowledged() {
    use netram_proto::{Member, OwnedRecord, Page, PageKey, ParityOp, Record};
    let data = page(1);
    let key = PageKey::new(1, 1);
    let (member, holder) = (
        server(100, Duration::from_secs(2)),
        server(100, Duration::from_secs(2)),
    );
    let mut m = Raw::open(member.addr(), 42, 7);
    let mut h = Raw::open(holder.addr(), 42, 7);
    let join = ParityOp::Join {
        holder: holder.addr(),
        holder_node: 1, // the holder's certificate
        group: 1,
        member: member.addr(),
    };
    assert_eq!(m.put(Page::seal(key, 1, &data), join), PutStatus::Stored);
    let mut parity = OwnedRecord::default();
    parity.xor(&Record::of(&Page::seal(key, 1, &data)));
    let ship = Request::ParityShip {
        group: 1,
        max_members: 4,
        members: vec![Member {
            server: member.addr(),
            node: 1, // both servers hold node 1's server certificate
            key,
            version: 1,
        }],
        record: parity.as_record(),
    };
    assert!(matches!(
        decode_reply(&h.call(&ship)).unwrap().1,
        Reply::Put { .. }
    ));
    let newer = page(2);
    assert_eq!(
        m.put(Page::seal(key, 2, &newer), ParityOp::Keep),
        PutStatus::Stored
    );
    assert_eq!(stat(&holder, "parity_deltas_applied"), 1);
    assert_eq!(stat(&member, "parity_forwards"), 1);
    // The holder's parity now covers the new version: it alone rebuilds the page.
    let scan = Request::ParityScan {
        dead: member.addr(),
        max: 8,
    };
    let f = h.call(&scan);
    let Reply::ParityScan { groups, .. } = decode_reply(&f).unwrap().1 else {
        panic!()
    };
    let rebuilt = groups[0].record.page(key);
    assert!(rebuilt.verify());
    assert_eq!((rebuilt.version, rebuilt.data), (2, &newer[..]));
    // With the holder gone, the overwrite changes nothing and the client hears why.
    let gone = holder.addr();
    drop(h);
    holder.stop();
    assert_eq!(
        m.put(Page::seal(key, 3, &data), ParityOp::Keep),
        PutStatus::HolderUnreachable
    );
    let f = m.call(&Request::Get(vec![key]));
    let Reply::Get { pages, .. } = decode_reply(&f).unwrap().1 else {
        panic!()
    };
    assert!(matches!(pages[0], netram_proto::GetResult::Found(p) if p.version == 2));
    let f = m.call(&Request::ParityScan { dead: gone, max: 8 });
    let Reply::ParityScan { orphans, .. } = decode_reply(&f).unwrap().1 else {
        panic!()
    };
    assert_eq!(orphans, vec![key]);
    assert_eq!(
        m.put(Page::seal(key, 3, &data), ParityOp::Keep),
        PutStatus::Unprotected
    );
}

#[test]
fn poll_takes_the_replies_that_have_arrived_without_waiting_for_more() {
    let s = server(100, Duration::from_secs(2));
    let t = TcpTransport::connect(&[s.addr().to_string()], &client());
    let cfg = PagerConfig {
        pages: 64,
        cache_pages: 4,
        writeback_batch: 4,
        ..Default::default()
    };
    let mut p = Pager::new(cfg, t, MemDisk::default());
    // Twelve pages through a cache of four: two PUTs of four evicted pages go out, and the
    // writes return without waiting for their answers.
    for n in 0..12 {
        p.write(n, &page(n)).unwrap();
    }
    assert_eq!(p.counters().evictions_dirty, 8);
    let started = std::time::Instant::now();
    let mut handled = 0;
    while handled < 2 && started.elapsed() < Duration::from_secs(10) {
        handled += p.poll().unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(handled, 2, "both PUTs' answers, once arrived");
    assert_eq!(stat(&s, "stored_pages"), 8);
    // Nothing is in flight any more: nothing to take, and no waiting for it.
    let t0 = std::time::Instant::now();
    assert_eq!(p.poll().unwrap(), 0);
    assert!(t0.elapsed() < Duration::from_secs(1));
    let mut out = vec![0u8; PAGE_SIZE];
    for n in 0..12 {
        p.read(n, &mut out).unwrap();
        assert!(out == page(n), "page {n}");
    }
    p.into_transport().close();
}

#[test]
fn reconnecting_to_a_server_that_does_not_answer_never_holds_the_pager() {
    // A server stops, and something takes its port that accepts connections and never
    // answers (a hung host, a half-dead machine): each reconnection attempt of the maintenance
    // schedule then waits for its handshake's timeout. It must not wait holding the pager,
    // whose lock the program's reads (or a region's faults) need.
    let a = server(256, Duration::from_secs(30));
    let b = server(256, Duration::from_secs(30));
    let b_addr = b.addr();
    let t = TcpTransport::connect(&[a.addr().to_string(), b_addr.to_string()], &client());
    let cfg = PagerConfig {
        pages: 64,
        cache_pages: 0,
        ..Default::default()
    };
    let mut p = Pager::new(cfg, t, MemDisk::default());
    p.set_schedule(netram_pager::ScheduleConfig {
        reconnect_every_us: 50_000,
        ..Default::default()
    });
    for n in 0..64 {
        p.write(n, &page(n)).unwrap();
    }
    p.flush().unwrap();
    b.stop();
    // The port again, listening, never accepting: the kernel completes the TCP handshake
    // from its backlog, and the TLS handshake waits.
    let hung = std::net::TcpListener::bind(b_addr).unwrap();
    // The pages on b are lost with it (no redundancy): the reads below are of a's.
    let (p, worst, ticks) = reads_beside_ticks(p, 0, Duration::from_secs(3));
    assert!(ticks > 10);
    drop(hung);
    assert!(p.counters().servers_dead >= 1, "b was found dead");
    assert!(
        worst < Duration::from_millis(100),
        "a read waited {worst:?} behind a reconnection attempt"
    );
    a.stop();
}

#[test]
fn a_probe_of_a_server_that_hangs_never_holds_the_pager() {
    // The maintenance schedule probes every server; one has hung (its connection open,
    // nothing coming back). The probe must not be waited for holding the pager: reads of the
    // other server's pages go on, and a later tick fails the server whose probe went
    // unanswered for the probe timeout.
    let a = server(256, Duration::from_secs(30));
    let b = server(256, Duration::from_secs(30));
    let relay = netram_testkit::Relay::start(b.addr().to_string());
    let cfg = ClientConfig {
        reply_timeout: Duration::from_secs(1),
        ..client()
    };
    let t = TcpTransport::connect(&[a.addr().to_string(), relay.addr.clone()], &cfg);
    let mut p = Pager::new(
        PagerConfig {
            pages: 64,
            cache_pages: 0,
            ..Default::default()
        },
        t,
        MemDisk::default(),
    );
    p.set_schedule(netram_pager::ScheduleConfig {
        probe_every_us: 50_000,
        reply_timeout_us: 1_000_000,
        ..Default::default()
    });
    for n in 0..64 {
        p.write(n, &page(n)).unwrap();
    }
    p.flush().unwrap();
    relay
        .frozen
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let (p, worst, _) = reads_beside_ticks(p, 0, Duration::from_millis(2500));
    assert_eq!(p.counters().probes_unanswered, 1, "{:?}", p.counters());
    assert_eq!(p.servers().filter(|&(_, alive)| !alive).count(), 1);
    assert!(
        worst < Duration::from_millis(100),
        "a read waited {worst:?} behind a probe"
    );
    relay
        .frozen
        .store(false, std::sync::atomic::Ordering::Relaxed);
    a.stop();
    b.stop();
}

/// Reads the pages `server` holds, one a millisecond, each checked, for `dur`, while a thread
/// ticks the pager's maintenance schedule every 5 ms (as `netram_client::maintain` does, under
/// the same lock); returns the pager, the longest read (lock included) and the ticks.
fn reads_beside_ticks(
    p: Pager<TcpTransport, MemDisk>,
    server: usize,
    dur: Duration,
) -> (Pager<TcpTransport, MemDisk>, Duration, u64) {
    let held: Vec<u64> = (0..p.config().pages)
        .filter(|&n| p.holders(n).contains(&server))
        .collect();
    assert!(!held.is_empty());
    let pager = Arc::new(std::sync::Mutex::new(p));
    let stop = Arc::new(AtomicBool::new(false));
    let maintenance = {
        let (pager, stop) = (pager.clone(), stop.clone());
        std::thread::spawn(move || {
            let start = std::time::Instant::now();
            let mut ticks = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let now = start.elapsed().as_micros() as u64;
                let _ = pager.lock().unwrap().on_tick(now);
                ticks += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            ticks
        })
    };
    let started = std::time::Instant::now();
    let mut worst = Duration::ZERO;
    let mut out = vec![0u8; PAGE_SIZE];
    for &n in held.iter().cycle() {
        if started.elapsed() >= dur {
            break;
        }
        let t0 = std::time::Instant::now();
        pager.lock().unwrap().read(n, &mut out).unwrap();
        worst = worst.max(t0.elapsed());
        assert_eq!(out, page(n));
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let ticks = maintenance.join().unwrap();
    let pager = Arc::try_unwrap(pager)
        .expect("the maintenance thread is gone")
        .into_inner()
        .unwrap();
    (pager, worst, ticks)
}

/// Threads reading and writing through one `SharedPager` while another holder of its lock
/// keeps taking replies in (as the maintenance thread's ticks do): a reply taken by the wrong
/// thread still reaches the read it belongs to, and every page reads back as last written.
#[test]
fn threads_share_a_pager_while_another_holder_takes_their_replies() {
    use netram_client::SharedPager;
    let servers = [
        server(4000, Duration::from_secs(5)),
        server(4000, Duration::from_secs(5)),
    ];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr().to_string()).collect();
    let t = TcpTransport::connect(&addrs, &client());
    let cfg = PagerConfig {
        pages: 1200,
        // Far fewer than the threads use: most reads go to a server.
        cache_pages: 32,
        ..Default::default()
    };
    let shared = Arc::new(SharedPager::new(Pager::new(cfg, t, MemDisk::default())));
    let version = |n: u64, v: u64| page(n * 1000 + v);
    let done = Arc::new(AtomicBool::new(false));
    let taker = {
        let (shared, done) = (shared.clone(), done.clone());
        std::thread::spawn(move || {
            let mut taken = 0;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                taken += shared.lock().poll().unwrap_or(0);
                std::thread::yield_now();
            }
            taken
        })
    };
    let workers: Vec<_> = (0..3u64)
        .map(|w| {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let pages: Vec<u64> = (w * 400..(w + 1) * 400).collect();
                let mut v = vec![0u64; pages.len()];
                for (i, &n) in pages.iter().enumerate() {
                    shared.write_pages(&[n], &version(n, 0)).unwrap();
                    v[i] = 0;
                }
                let mut rng = fastrand::Rng::with_seed(w);
                let mut out = Vec::new();
                for _ in 0..3000 {
                    let i = rng.usize(0..pages.len());
                    let n = pages[i];
                    if rng.u8(0..4) == 0 {
                        v[i] += 1;
                        shared.write_pages(&[n], &version(n, v[i])).unwrap();
                    } else {
                        shared.read_pages(&[n], &mut out).unwrap();
                        assert!(out == version(n, v[i]), "page {n} read back wrong");
                    }
                }
                // A batch too, its pages read through the pipeline together.
                shared.read_pages(&pages, &mut out).unwrap();
                for (i, &n) in pages.iter().enumerate() {
                    assert!(
                        out[i * PAGE_SIZE..(i + 1) * PAGE_SIZE] == version(n, v[i])[..],
                        "page {n} read back wrong in a batch"
                    );
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let taken = taker.join().unwrap();
    assert!(
        taken > 0,
        "the other holder took no reply in: the case this test is for did not happen"
    );
    assert!(!shared.busy());
    let p = Arc::try_unwrap(shared).unwrap().into_pager();
    let c = p.counters();
    assert!(c.gets > 0, "every read was a cache hit: nothing travelled");
    assert_eq!(
        (c.missing_pages, c.checksum_failures, c.servers_dead),
        (0, 0, 0)
    );
    p.into_transport().close();
}
