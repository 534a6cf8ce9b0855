//! "Trust nobody on the wire", against running `netram serve` processes over TLS: each attack
//! the issue lists, made by a client with a certificate of the cluster (or without one), must
//! fail with a clear, counted refusal while the legitimate client keeps its pages.
//!
//! Every connection here is the real one: TCP, mutual TLS against the tests' cluster CA
//! (`netram cluster init`), HELLO and WELCOME inside TLS, then sealed frames
//! (`netram_net::record`) built by hand, so that an attacker can say anything a peer can.

mod common;

use common::{eventually, ServerProcess, NETRAM};
use netram_net::{HandshakeError, Security};
use netram_proto::{
    decode_reply, Delta, DeltaKind, DeltaStatus, GetResult, Hello, Member, MoveStatus, OwnedRecord,
    Owner, Page, PageKey, ParityOp, PutStatus, Record, Reply, Request, PAGE_SIZE,
};
use netram_testkit::wire::TlsConn;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// Credentials of node `node` of the tests' cluster, issued by `netram keygen`.
fn node_creds(node: u64, server: bool) -> (tempfile::TempDir, Security) {
    let dir = tempfile::tempdir().unwrap();
    let sec = keygen(common::ca_dir(), node, server, dir.path());
    (dir, sec)
}

/// `netram keygen` writes the cluster directory's list of issued certificates (a file put in
/// place by rename): one keygen at a time, and no copy of the directory meanwhile (a copy
/// listed the temporary file, gone when it came to copy it).
static CLUSTER_DIR: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn cluster_dir_lock() -> std::sync::MutexGuard<'static, ()> {
    CLUSTER_DIR.lock().unwrap_or_else(|e| e.into_inner())
}

/// `netram keygen` of node `node` from the cluster directory `cluster` into `out`.
fn keygen(cluster: &Path, node: u64, server: bool, out: &Path) -> Security {
    let _one = cluster_dir_lock();
    let mut cmd = Command::new(NETRAM);
    cmd.args(["keygen", "--cluster"])
        .arg(cluster)
        .args(["--node", &node.to_string(), "--out"])
        .arg(out);
    if server {
        cmd.arg("--server");
    }
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "netram keygen: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    netram_client::security(Some(out), false).unwrap()
}

/// `netram revoke` of node `node` in the cluster directory `cluster`.
fn revoke(cluster: &Path, node: u64) {
    let o = Command::new(NETRAM)
        .args(["revoke", "--cluster"])
        .arg(cluster)
        .args(["--node", &node.to_string()])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "netram revoke: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A connection that speaks the protocol by hand over TLS: one request, one reply.
struct Conn(TlsConn);

impl Conn {
    fn open(addr: &str, sec: &Security, hello: &Hello) -> Result<Self, HandshakeError> {
        TlsConn::open(addr.parse().unwrap(), sec, hello).map(Conn)
    }

    fn seal(&mut self, req: &Request<'_>) -> Vec<u8> {
        self.0.seal(req)
    }

    fn call(&mut self, req: &Request<'_>) -> Vec<u8> {
        self.0.call(req)
    }

    fn closed_within(&mut self, wait: Duration) -> bool {
        self.0.closed_within(wait)
    }

    fn put(&mut self, key: PageKey, version: u32, data: &[u8]) -> PutStatus {
        let f = self.call(&Request::Put(vec![Page::seal(key, version, data)]));
        match decode_reply(&f).unwrap().1 {
            Reply::Put { status, .. } => status[0],
            r => panic!("PUT answered {r:?}"),
        }
    }

    /// The page's data, or `None` when the server says it has no such page.
    fn get(&mut self, key: PageKey) -> Option<Vec<u8>> {
        let f = self.call(&Request::Get(vec![key]));
        match decode_reply(&f).unwrap().1 {
            Reply::Get { pages, .. } => match pages[0] {
                GetResult::Found(p) => Some(p.data.to_vec()),
                GetResult::Missing(_) => None,
            },
            r => panic!("GET answered {r:?}"),
        }
    }
}

fn page(seed: u8) -> Vec<u8> {
    (0..PAGE_SIZE)
        .map(|i| (i as u8).wrapping_mul(seed))
        .collect()
}

/// Copying another client's handshake — its node id, incarnation and session id — gets the
/// copier a session of its own: it cannot read, overwrite or delete the other's pages, its
/// higher incarnations (u64::MAX included) free nothing of the other's and lock it out of
/// nothing, and only the owner resumes its session.
#[test]
fn another_node_cannot_resume_supersede_or_touch_a_clients_session() {
    let server = ServerProcess::start(&["--capacity", "16M"]);
    let (_a_dir, alice) = node_creds(11, false);
    let (_b_dir, mallory) = node_creds(12, false);
    let hello = Hello::new(0xa11ce, 5, 0x5e55_1011);
    let key = PageKey::new(1, 7);
    let data = page(3);
    let mut a = Conn::open(&server.addr, &alice, &hello).unwrap();
    assert_eq!(a.put(key, 1, &data), PutStatus::Stored);

    // Mallory copies Alice's handshake byte for byte: a session of Mallory's own.
    let mut m = Conn::open(&server.addr, &mallory, &hello).unwrap();
    assert_eq!(m.get(key), None, "another node reads nothing of Alice's");
    let f = m.call(&Request::Delete(vec![key]));
    assert!(matches!(
        decode_reply(&f).unwrap().1,
        Reply::Delete { status, .. } if status == [netram_proto::DeleteStatus::Missing]
    ));
    assert_eq!(
        m.put(key, 9, &page(9)),
        PutStatus::Stored,
        "into its own session"
    );
    // Newer incarnations under Alice's node id, up to the last one there is.
    for inc in [6, u64::MAX] {
        Conn::open(&server.addr, &mallory, &Hello::new(0xa11ce, inc, 1)).unwrap();
    }
    assert_eq!(a.get(key), Some(data.clone()), "Alice's page is untouched");
    // Alice resumes her own session from a new connection, and opens new ones at her
    // incarnation: nobody locked her out.
    drop(a);
    let mut a = Conn::open(&server.addr, &alice, &hello).unwrap();
    assert_eq!(a.get(key), Some(data.clone()), "resumed by its owner");
    Conn::open(&server.addr, &alice, &Hello::new(0xa11ce, 5, 2)).unwrap();
    assert!(server.stat("sessions_resumed") >= 1);
    // Mallory's incarnations superseded Mallory's sessions only.
    assert_eq!(server.stat("sessions_superseded"), 2);
    assert_eq!(server.stat("handshakes_refused_stale_incarnation"), 0);
    assert_eq!(a.get(key), Some(data));
}

/// A parity delta naming another client as its owner is refused unless it comes from the
/// server that client placed the member on: from a client, from a server of the cluster that
/// does not store the member, and from the right server for a page that is not the member.
#[test]
fn forged_parity_deltas_are_refused_and_the_group_is_unharmed() {
    let member = ServerProcess::start(&["--capacity", "16M"]);
    let holder = ServerProcess::start(&["--capacity", "16M"]);
    let (_a_dir, alice) = node_creds(21, false);
    let (_c_dir, carol) = node_creds(22, false);
    let (_r_dir, rogue) = node_creds(23, true);
    let hello = Hello::new(0xbee, 3, 44);
    let key = PageKey::new(1, 1);
    let data = page(5);
    let (maddr, haddr): (SocketAddr, SocketAddr) =
        (member.addr.parse().unwrap(), holder.addr.parse().unwrap());
    let mut m = Conn::open(&member.addr, &alice, &hello).unwrap();
    let mut h = Conn::open(&holder.addr, &alice, &hello).unwrap();
    let join = ParityOp::Join {
        holder: haddr,
        holder_node: 1,
        group: 1,
        member: maddr,
    };
    let f = m.call(&Request::PutParity(vec![(Page::seal(key, 1, &data), join)]));
    assert!(
        matches!(decode_reply(&f).unwrap().1, Reply::Put { status, .. } if status == [PutStatus::Stored])
    );
    let mut parity = OwnedRecord::default();
    parity.xor(&Record::of(&Page::seal(key, 1, &data)));
    // Alice names the member's server by the node id its certificate carries (the tests'
    // servers are all node 1).
    let ship = Request::ParityShip {
        group: 1,
        max_members: 4,
        members: vec![Member {
            server: maddr,
            node: 1,
            key,
            version: 1,
        }],
        record: parity.as_record(),
    };
    assert!(matches!(
        decode_reply(&h.call(&ship)).unwrap().1,
        Reply::Put { status, .. } if status == [PutStatus::Stored]
    ));
    let garbage = vec![0x5a; PAGE_SIZE];
    let forged = |k: PageKey| Delta {
        owner: Owner {
            principal: 21,
            node: 0xbee,
            incarnation: 3,
        },
        group: 1,
        member: maddr,
        key: k,
        from: 1,
        to: 2,
        kind: DeltaKind::Update,
        record: Record {
            version: 3,
            crc: 7,
            flags: 0,
            data: &garbage,
        },
    };
    let other = PageKey::new(1, 2);
    for (who, sec, k) in [
        ("a client", &carol, key),
        ("a server that does not store the member", &rogue, key),
        (
            "a server, naming a page that is not the member",
            &rogue,
            other,
        ),
    ] {
        let mut x = Conn::open(&holder.addr, sec, &Hello::new(99, 1, 1)).unwrap();
        let f = x.call(&Request::ParityDelta(vec![forged(k)]));
        let Reply::ParityDelta { status, .. } = decode_reply(&f).unwrap().1 else {
            panic!("{who}: not a delta reply")
        };
        assert_eq!(status, [DeltaStatus::UnknownGroup], "{who}");
        // A Drop is the owner's alone, whoever sends it.
        let drop = Delta {
            kind: DeltaKind::Drop,
            ..forged(key)
        };
        let f = x.call(&Request::ParityDelta(vec![drop]));
        assert!(
            matches!(decode_reply(&f).unwrap().1, Reply::ParityDelta { status, .. } if status == [DeltaStatus::UnknownGroup]),
            "{who}: drop"
        );
    }
    assert_eq!(holder.stat("parity_deltas_applied"), 0);
    assert!(holder.stat("parity_deltas_refused") >= 3, "counted");
    // The group is whole: not damaged, and its parity still rebuilds Alice's page.
    let f = h.call(&Request::ParityScan {
        dead: maddr,
        max: 8,
    });
    let Reply::ParityScan { groups, .. } = decode_reply(&f).unwrap().1 else {
        panic!("scan")
    };
    assert_eq!(groups.len(), 1);
    assert!(!groups[0].damaged);
    let rebuilt = groups[0].record.page(key);
    assert!(rebuilt.verify() && rebuilt.data == &data[..]);
    // And the member's own server still reaches the holder: Alice's overwrite is applied.
    let f = m.call(&Request::PutParity(vec![(
        Page::seal(key, 2, &page(6)),
        ParityOp::Keep,
    )]));
    assert!(
        matches!(decode_reply(&f).unwrap().1, Reply::Put { status, .. } if status == [PutStatus::Stored])
    );
    assert_eq!(holder.stat("parity_deltas_applied"), 1);
}

/// A client names the holder of its page's parity group by address and node id; the member's
/// server forwards the page's deltas only to a server that proves to be that node, so a
/// client cannot point it at another server (nor at an address of its choosing: the TLS
/// handshake fails there first). The overwrite is answered "holder unreachable", counted.
#[test]
fn deltas_go_only_to_the_holder_node_the_owner_named() {
    let member = ServerProcess::start(&["--capacity", "16M"]);
    let (hdir, _) = node_creds(40, true);
    let holder =
        ServerProcess::start(&["--capacity", "16M", "--tls", hdir.path().to_str().unwrap()]);
    let (_a_dir, alice) = node_creds(41, false);
    let (maddr, haddr): (SocketAddr, SocketAddr) =
        (member.addr.parse().unwrap(), holder.addr.parse().unwrap());
    let mut m = Conn::open(&member.addr, &alice, &Hello::new(0xcafe, 1, 1)).unwrap();
    let put = |m: &mut Conn, key: PageKey, version: u32, op: ParityOp| {
        let f = m.call(&Request::PutParity(vec![(
            Page::seal(key, version, &page(3)),
            op,
        )]));
        match decode_reply(&f).unwrap().1 {
            Reply::Put { status, .. } => status[0],
            other => panic!("not a PUT reply: {other:?}"),
        }
    };
    for (key, named, wrong) in [(PageKey::new(1, 1), 40, 0), (PageKey::new(1, 2), 39, 1)] {
        let join = ParityOp::Join {
            holder: haddr,
            holder_node: named,
            group: key.page,
            member: maddr,
        };
        assert_eq!(put(&mut m, key, 1, join), PutStatus::Stored);
        // An overwrite in place sends a delta to the named holder (who has no such group: the
        // owner never shipped it, so a delta that arrives is answered "unknown group" and the
        // page is stored outside any group, `Unprotected`).
        let status = put(&mut m, key, 2, ParityOp::Keep);
        assert_eq!(
            member.stat("parity_holders_wrong_node"),
            wrong,
            "node {named}"
        );
        if wrong == 1 {
            assert_eq!(status, PutStatus::HolderUnreachable, "not sent to node 40");
        } else {
            assert_eq!(status, PutStatus::Unprotected, "sent, and out of its group");
        }
    }
    assert_eq!(holder.stat("parity_deltas_applied"), 0);
}

/// Nothing but a node of the cluster gets past the handshake, at any step of it, and nothing
/// but its own sealed records after it; the client that is one keeps being served.
#[test]
fn an_unauthenticated_peer_is_refused_at_every_step() {
    let server = ServerProcess::start(&["--capacity", "16M"]);
    let (_dir, client) = node_creds(31, false);
    let mut good = Conn::open(&server.addr, &client, &Hello::new(1, 1, 1)).unwrap();
    let key = PageKey::new(1, 1);
    assert_eq!(good.put(key, 1, &page(7)), PutStatus::Stored);
    let mut refused = 0;

    // A HELLO in clear: the server wants TLS.
    let e = Conn::open(&server.addr, &Security::Insecure, &Hello::new(2, 1, 1)).err();
    assert!(matches!(e, Some(HandshakeError::ClosedInClear)), "{e:?}");
    refused += 1;
    // A certificate of another cluster.
    let other = tempfile::tempdir().unwrap();
    let out = Command::new(NETRAM)
        .args(["cluster", "init"])
        .arg(other.path())
        .output()
        .unwrap();
    assert!(out.status.success());
    let stranger = netram_client::security(Some(&other.path().join("node-1")), false).unwrap();
    let e = Conn::open(&server.addr, &stranger, &Hello::new(3, 1, 1)).err();
    assert!(matches!(e, Some(HandshakeError::Tls(_))), "{e:?}");
    refused += 1;
    // Bytes that are no TLS at all, and a TLS record header that stops half way.
    for junk in [
        &b"GET / HTTP/1.1\r\n\r\n"[..],
        &[0x16, 0x03, 0x01, 0x02][..],
    ] {
        let mut s = TcpStream::connect(&server.addr).unwrap();
        s.write_all(junk).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let _ = s.read_to_end(&mut Vec::new());
        refused += 1;
    }
    eventually("every refusal counted", 10, || {
        server.stat("handshakes_tls_failed") >= refused
    });

    // After the handshake: a record changed on the way, and a record replayed.
    let mut x = Conn::open(&server.addr, &client, &Hello::new(4, 1, 1)).unwrap();
    let mut f = x.seal(&Request::Stats);
    let n = f.len();
    f[n - 20] ^= 1;
    x.0.stream.write_all(&f).unwrap();
    assert!(
        x.closed_within(Duration::from_secs(10)),
        "a changed record closes"
    );
    let mut y = Conn::open(&server.addr, &client, &Hello::new(5, 1, 1)).unwrap();
    let f = y.seal(&Request::Get(vec![key]));
    y.0.stream.write_all(&f).unwrap();
    y.0.stream.write_all(&f).unwrap();
    let mut len = [0u8; 4];
    y.0.stream.read_exact(&mut len).unwrap(); // the first is answered
    let mut rest = vec![0u8; u32::from_le_bytes(len) as usize];
    y.0.stream.read_exact(&mut rest).unwrap();
    assert!(
        y.closed_within(Duration::from_secs(10)),
        "a replayed record closes"
    );
    eventually("both counted", 10, || {
        server.stat("frames_rejected_unauthenticated") == 2
    });
    assert_eq!(
        good.get(key),
        Some(page(7)),
        "the good client is still served"
    );
}

/// A revoked node: refused at its next handshake, and its connections closed within seconds
/// of the new revocation list reaching the daemon.
#[test]
fn a_revoked_node_is_refused_and_its_connections_closed() {
    // The daemon reads the revocation list of its own directory: a copy of the tests'
    // cluster's CA with node 1's credentials beside it (a throwaway cluster may keep them
    // together), so that revoking here reaches the daemon at once and touches no other test.
    let cluster = tempfile::tempdir().unwrap();
    let one = cluster_dir_lock();
    for dir in [common::ca_dir(), common::tls_dir()] {
        for f in std::fs::read_dir(dir).unwrap() {
            let f = f.unwrap().path();
            if f.is_file() {
                std::fs::copy(&f, cluster.path().join(f.file_name().unwrap())).unwrap();
            }
        }
    }
    drop(one);
    let server = ServerProcess::start(&[
        "--capacity",
        "16M",
        "--tls",
        cluster.path().to_str().unwrap(),
    ]);
    let (dd, gd) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let doomed = keygen(cluster.path(), 41, false, dd.path());
    let good = keygen(cluster.path(), 42, false, gd.path());
    let mut d = Conn::open(&server.addr, &doomed, &Hello::new(1, 1, 1)).unwrap();
    let mut g = Conn::open(&server.addr, &good, &Hello::new(2, 1, 1)).unwrap();
    let key = PageKey::new(1, 1);
    assert_eq!(d.put(key, 1, &page(1)), PutStatus::Stored);
    assert_eq!(g.put(key, 1, &page(2)), PutStatus::Stored);
    revoke(cluster.path(), 41);
    assert!(
        d.closed_within(Duration::from_secs(10)),
        "its connection is closed"
    );
    assert_eq!(server.stat("connections_closed_revoked"), 1);
    let e = Conn::open(&server.addr, &doomed, &Hello::new(1, 1, 1)).err();
    assert!(matches!(e, Some(HandshakeError::Tls(_))), "{e:?}");
    assert_eq!(g.get(key), Some(page(2)), "the other node is still served");

    // A client running since before a server was revoked stops trusting it: its next
    // connection refuses the server's certificate once its own revocation list has it.
    let sd = tempfile::tempdir().unwrap();
    keygen(cluster.path(), 43, true, sd.path());
    let rogue = ServerProcess::start(&["--capacity", "16M", "--tls", sd.path().to_str().unwrap()]);
    Conn::open(&rogue.addr, &good, &Hello::new(2, 1, 2)).unwrap();
    revoke(cluster.path(), 43);
    std::fs::copy(cluster.path().join("crl.pem"), gd.path().join("crl.pem")).unwrap();
    eventually("the client reloads its revocation list", 10, || {
        matches!(
            Conn::open(&rogue.addr, &good, &Hello::new(2, 1, 3)),
            Err(HandshakeError::Tls(_))
        )
    });
    // Its other server is still trusted.
    Conn::open(&server.addr, &good, &Hello::new(2, 1, 4)).unwrap();
}

/// The per-client limits go by certificate over TLS: a node over its rate is slowed (its
/// requests wait, counted) while another node on the same address is served at once; a node
/// at its session limit is refused a third session, another node is not, and a node that
/// presents a fresh node id per connection is another client (its own certificate each).
#[test]
fn per_client_limits_go_by_certificate() {
    let server = ServerProcess::start(&[
        "--capacity",
        "16M",
        "--max-client-ops",
        "500",
        "--max-sessions-per-client",
        "2",
    ]);
    let (_d1, greedy) = node_creds(51, false);
    let (_d2, modest) = node_creds(52, false);
    let key = PageKey::new(1, 1);

    // 1,000 one-page requests at 500 per second (after a burst of 64): about two seconds.
    let addr = server.addr.clone();
    let flood = std::thread::spawn(move || {
        let mut c = Conn::open(&addr, &greedy, &Hello::new(1, 1, 1)).unwrap();
        assert_eq!(c.put(key, 1, &page(1)), PutStatus::Stored);
        let t = Instant::now();
        for _ in 0..1000 {
            assert!(c.get(key).is_some());
        }
        t.elapsed()
    });
    std::thread::sleep(Duration::from_millis(300));
    let mut m = Conn::open(&server.addr, &modest, &Hello::new(2, 1, 1)).unwrap();
    assert_eq!(m.put(key, 1, &page(2)), PutStatus::Stored);
    let t = Instant::now();
    for _ in 0..50 {
        assert_eq!(m.get(key), Some(page(2)));
    }
    let modest_took = t.elapsed();
    let greedy_took = flood.join().unwrap();
    assert!(
        greedy_took >= Duration::from_millis(1500),
        "1,000 requests at 500/s took {greedy_took:?}"
    );
    assert!(
        modest_took < Duration::from_millis(1000),
        "another node was held back with the flooding one: {modest_took:?}"
    );
    assert!(server.stat("requests_throttled") > 100);

    // Sessions: two per node, whatever the node id in its HELLO; another node has its own.
    let (_d3, a) = node_creds(53, false);
    let _s1 = Conn::open(&server.addr, &a, &Hello::new(53, 1, 1)).unwrap();
    let _s2 = Conn::open(&server.addr, &a, &Hello::new(54, 1, 1)).unwrap();
    assert!(Conn::open(&server.addr, &a, &Hello::new(55, 1, 1)).is_err());
    assert_eq!(server.stat("handshakes_refused_peer_sessions"), 1);
    let (_d4, b) = node_creds(54, false);
    Conn::open(&server.addr, &b, &Hello::new(53, 1, 1)).unwrap();
}

/// A server at its connection limit says so over TLS too (in clear, before TLS: the client
/// believes nothing else said that way), and serves the next connection once one closes.
#[test]
fn a_server_at_its_limit_says_busy_over_tls() {
    let server = ServerProcess::start(&["--capacity", "16M", "--max-connections", "1"]);
    let (_d, node) = node_creds(61, false);
    for round in 0..20 {
        let mut first = None;
        // The previous round's connection may still hold the place for a moment.
        eventually("the place is given back", 10, || {
            first = Conn::open(&server.addr, &node, &Hello::new(61, 1, 1)).ok();
            first.is_some()
        });
        match Conn::open(&server.addr, &node, &Hello::new(62, 1, 1)) {
            Err(HandshakeError::Busy) => {}
            Err(e) => panic!("round {round}: {e}"),
            Ok(_) => panic!("round {round}: a second connection over the limit of one"),
        }
        drop(first);
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(server.stat("connections_refused_busy") >= 20);
}

/// Relays one TCP connection at a time from a listener to `to`, changing one byte of the page
/// data of every GET reply on its way back: the data that travels outside the records' seal to
/// a client that seals its pages (`netram_net::record`). Before the records, the relay passes
/// the TLS handshake untouched (TLS records are told apart by their header). Stops with the
/// test (its listener is non-blocking and polled until `stop`).
struct Tamperer {
    addr: String,
    changed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Tamperer {
    fn start(to: &str) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let changed = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let to = to.to_string();
        let (c, s) = (changed.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let Ok((client, _)) = l.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                client.set_nonblocking(false).unwrap();
                let server = TcpStream::connect(&to).unwrap();
                let (mut cr, mut sw) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut cr, &mut sw);
                    let _ = sw.shutdown(std::net::Shutdown::Write);
                });
                let c = c.clone();
                std::thread::spawn(move || Self::relay_back(server, client, &c));
            }
        });
        Self {
            addr,
            changed,
            stop,
        }
    }

    fn relay_back(mut from: TcpStream, mut to: TcpStream, changed: &std::sync::atomic::AtomicU64) {
        let mut tls = true;
        let read = |from: &mut TcpStream, n: usize| -> Option<Vec<u8>> {
            let mut b = vec![0u8; n];
            from.read_exact(&mut b).ok().map(|_| b)
        };
        loop {
            let Some(head) = read(&mut from, 5) else {
                return;
            };
            let whole = if tls && (0x14..=0x17).contains(&head[0]) && head[1] == 3 {
                let len = u16::from_be_bytes([head[3], head[4]]) as usize;
                let Some(body) = read(&mut from, len) else {
                    return;
                };
                [head, body].concat()
            } else {
                // A netram record: its length prefix counts the rest (trailer included).
                tls = false;
                let len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
                let Some(rest) = read(&mut from, len - 1) else {
                    return;
                };
                let mut r = [head, rest].concat();
                if r.len() > PAGE_SIZE {
                    // Inside the last page's data, just before the 20-byte trailer.
                    let at = r.len() - 20 - 100;
                    r[at] ^= 0x40;
                    changed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                r
            };
            if to.write_all(&whole).is_err() {
                return;
            }
        }
    }
}

impl Drop for Tamperer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Someone on the path changing the page data that travels outside the records' seal (a GET
/// reply's pages, to a client that seals its own) is caught by the pager's seal, counted, and
/// the page read from its other copy: the client gets every page right.
#[test]
fn a_page_changed_on_the_wire_is_caught_and_read_elsewhere() {
    use netram_pager::{MemDisk, Pager, PagerConfig};
    let s1 = ServerProcess::start(&["--capacity", "16M"]);
    let s2 = ServerProcess::start(&["--capacity", "16M"]);
    let mitm = Tamperer::start(&s1.addr);
    let transport = netram_client::TcpTransport::connect(
        &[mitm.addr.as_str(), s2.addr.as_str()],
        &netram_client::ClientConfig {
            sealed_pages: true,
            ..common::client()
        },
    );
    let cfg = PagerConfig {
        pages: 64,
        cache_pages: 4,
        redundancy: "mirror:2".parse().unwrap(),
        ..Default::default()
    };
    let mut pager = Pager::new(cfg, transport, MemDisk::default());
    let pages: Vec<u64> = (0..64).collect();
    let data: Vec<u8> = (0..64).flat_map(|p| page(p as u8 + 1)).collect();
    pager.write_many(&pages, &data).unwrap();
    pager.flush().unwrap();
    let mut got = vec![0u8; data.len()];
    pager.read_many(&pages, &mut got).unwrap();
    assert!(got == data, "every page read back right");
    let changed = mitm.changed.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        changed > 0,
        "the relay changed no reply: the test tested nothing"
    );
    assert!(
        pager.counters().page_auth_failures >= changed,
        "{} authentication failures for {changed} pages changed",
        pager.counters().page_auth_failures
    );
}

/// Server B (node `b_node`) and server C (node `c_node`), C joined to B's cluster and
/// listing it alive; the directories they use go with the pair.
struct Pair {
    b: ServerProcess,
    c: ServerProcess,
    _dirs: [tempfile::TempDir; 3],
}

fn joined_pair(b_node: u64, c_node: u64) -> Pair {
    let (bdir, _) = node_creds(b_node, true);
    let (cdir, _) = node_creds(c_node, true);
    let b = ServerProcess::start_restartable(&[
        "--capacity",
        "16M",
        "--tls",
        bdir.path().to_str().unwrap(),
    ]);
    let ctl = tempfile::tempdir().unwrap();
    let control = ctl.path().join("c.sock").display().to_string();
    let c = ServerProcess::start_restartable(&[
        "--capacity",
        "16M",
        "--tls",
        cdir.path().to_str().unwrap(),
        "--seed",
        &b.addr,
        "--control",
        &control,
    ]);
    eventually("C's membership lists B alive", 30, || {
        netram_client::discover::members(&control, Duration::from_secs(2)).is_ok_and(|l| {
            l.members
                .iter()
                .any(|r| r.node == b_node && r.state == netram_member::Liveness::Alive)
        })
    });
    Pair {
        b,
        c,
        _dirs: [bdir, cdir, ctl],
    }
}

/// Nswap's migration between real daemons over TLS: the owner's EXPECT at the new server,
/// its MIGRATE at the old one, the page carried server to server (ADOPT, on the old server's
/// own peer session). Nobody else gets a page into the owner's session: not another client,
/// not a server of the cluster the owner did not name, not a second copy of the handover;
/// and a target that is not the node the owner named gets nothing.
#[test]
fn a_page_moves_server_to_server_only_as_its_owner_said() {
    // C and B are members of one cluster: a server hands pages over only to a member.
    let pair = joined_pair(51, 50);
    let (b, c) = (&pair.b, &pair.c);
    let (_a_dir, alice) = node_creds(52, false);
    let (_m_dir, mallory) = node_creds(53, false);
    let (_r_dir, rogue) = node_creds(54, true);
    let hello = Hello::new(0xa11ce, 1, 1);
    let mut at_c = Conn::open(&c.addr, &alice, &hello).unwrap();
    let mut at_b = Conn::open(&b.addr, &alice, &hello).unwrap();
    let moves = |conn: &mut Conn, req: &Request<'_>| match decode_reply(&conn.call(req)).unwrap().1
    {
        Reply::Move { status, .. } => status,
        other => panic!("not a MOVE reply: {other:?}"),
    };
    let (k1, k2, k3) = (PageKey::new(1, 1), PageKey::new(1, 2), PageKey::new(1, 3));
    for (k, seed) in [(k1, 1), (k2, 2), (k3, 3)] {
        assert_eq!(at_c.put(k, 7, &page(seed)), PutStatus::Stored);
    }
    let expect = |pages: Vec<(PageKey, u32)>| Request::Expect {
        from_node: 50,
        pages,
    };
    assert_eq!(
        moves(&mut at_b, &expect(vec![(k1, 7), (k2, 7)])),
        [MoveStatus::Done; 2]
    );
    let migrate = |keys: Vec<PageKey>, to_node: u64| Request::Migrate {
        to: b.addr.parse().unwrap(),
        to_node,
        keys,
    };
    // Named wrongly: B is node 51, not 49. Nothing goes there: C's membership knows no node
    // 49 at B's address, so C does not even connect (the certificate check at the target,
    // `migration_targets_wrong_node`, stays as the second line).
    assert_eq!(
        moves(&mut at_c, &migrate(vec![k1], 49)),
        [MoveStatus::Unreachable]
    );
    assert_eq!(c.stat("migration_targets_not_member"), 1);
    // Named rightly: k1 moves; k3 was not expected; k4 is not at C.
    let st = moves(&mut at_c, &migrate(vec![k1, k3, PageKey::new(1, 4)], 51));
    assert_eq!(
        st,
        [
            MoveStatus::Done,
            MoveStatus::Unexpected,
            MoveStatus::Missing
        ]
    );
    assert_eq!(
        at_b.get(k1),
        Some(page(1)),
        "B holds the page, byte for byte"
    );
    assert_eq!(
        at_c.get(k1),
        Some(page(1)),
        "C keeps its copy until the owner deletes it"
    );
    assert_eq!(b.stat("pages_adopted"), 1);
    assert_eq!(c.stat("pages_handed_over"), 1);
    // The same handover again: the expectation was used once.
    assert_eq!(
        moves(&mut at_c, &migrate(vec![k1], 51)),
        [MoveStatus::Unexpected]
    );
    // Another client naming Alice as the owner of k2 (expected from C): refused.
    let alice_owner = Owner {
        principal: 52,
        node: 0xa11ce,
        incarnation: 1,
    };
    let bytes = page(66);
    let forged = [Page::seal(k2, 7, &bytes)];
    let adopt = Request::Adopt {
        owner: alice_owner,
        pages: forged.to_vec(),
    };
    let mut m = Conn::open(&b.addr, &mallory, &Hello::new(0xbad, 1, 1)).unwrap();
    assert_eq!(moves(&mut m, &adopt), [MoveStatus::Unexpected], "a client");
    // A server of the cluster that Alice did not name: refused too.
    let mut r = Conn::open(&b.addr, &rogue, &Hello::new(0xbad, 1, 1)).unwrap();
    assert_eq!(
        moves(&mut r, &adopt),
        [MoveStatus::Unexpected],
        "another server"
    );
    assert!(b.stat("adopts_refused_unexpected") >= 3);
    // k2 is still expected from C, and still moves: the refusals took nothing from Alice.
    assert_eq!(moves(&mut at_c, &migrate(vec![k2], 51)), [MoveStatus::Done]);
    assert_eq!(at_b.get(k2), Some(page(2)));
    assert_eq!(b.stat("pages_adopted"), 2);
}

/// A server hands pages over only to a live member, under the node id and address the owner
/// named: Alice's MIGRATE naming a server of the cluster's CA that is not a member (it joined
/// nobody) is refused without a connection and counted, and the same MIGRATE naming a member
/// still moves the page. A server that is itself no member of a cluster refuses every
/// MIGRATE, without a connection (issue 36, attack 6: a client made a stand-alone server open
/// TCP to any address it named).
#[test]
fn a_migration_goes_only_to_a_member_of_the_cluster() {
    let (odir, _) = node_creds(62, true);
    let pair = joined_pair(61, 60);
    let (b, c) = (&pair.b, &pair.c);
    let outsider =
        ServerProcess::start(&["--capacity", "16M", "--tls", odir.path().to_str().unwrap()]);
    let (_a_dir, alice) = node_creds(63, false);
    let hello = Hello::new(0xa11ce, 1, 1);
    let mut at_c = Conn::open(&c.addr, &alice, &hello).unwrap();
    let mut at_b = Conn::open(&b.addr, &alice, &hello).unwrap();
    let mut at_o = Conn::open(&outsider.addr, &alice, &hello).unwrap();
    let moves = |conn: &mut Conn, req: &Request<'_>| match decode_reply(&conn.call(req)).unwrap().1
    {
        Reply::Move { status, .. } => status,
        other => panic!("not a MOVE reply: {other:?}"),
    };
    let (k1, k2) = (PageKey::new(1, 1), PageKey::new(1, 2));
    for (k, seed) in [(k1, 1), (k2, 2)] {
        assert_eq!(at_c.put(k, 7, &page(seed)), PutStatus::Stored);
    }
    let expect = |k: PageKey| Request::Expect {
        from_node: 60,
        pages: vec![(k, 7)],
    };
    let migrate = |k: PageKey, to: &str, to_node: u64| Request::Migrate {
        to: to.parse().unwrap(),
        to_node,
        keys: vec![k],
    };
    // The outsider would take it (it expects k1 from C), but it is no member of C's cluster.
    assert_eq!(moves(&mut at_o, &expect(k1)), [MoveStatus::Done]);
    assert_eq!(
        moves(&mut at_c, &migrate(k1, &outsider.addr, 62)),
        [MoveStatus::Unreachable]
    );
    assert_eq!(c.stat("migration_targets_not_member"), 1);
    assert_eq!(outsider.stat("pages_adopted"), 0);
    assert_eq!(c.stat("pages_handed_over"), 0);
    // A member under another node id is no member either.
    assert_eq!(
        moves(&mut at_c, &migrate(k1, &b.addr, 62)),
        [MoveStatus::Unreachable]
    );
    assert_eq!(c.stat("migration_targets_not_member"), 2);
    // B, named rightly, takes k2.
    assert_eq!(moves(&mut at_b, &expect(k2)), [MoveStatus::Done]);
    assert_eq!(
        moves(&mut at_c, &migrate(k2, &b.addr, 61)),
        [MoveStatus::Done]
    );
    assert_eq!(at_b.get(k2), Some(page(2)));
    assert_eq!(b.stat("pages_adopted"), 1);

    // A server that is no member of any cluster (the outsider, started without --seed)
    // refuses every MIGRATE without connecting anywhere: neither to B, expecting the page,
    // nor to a port that merely listens (a client could otherwise probe any port from it).
    let k3 = PageKey::new(1, 3);
    assert_eq!(at_o.put(k3, 7, &page(3)), PutStatus::Stored);
    assert_eq!(moves(&mut at_b, &expect(k3)), [MoveStatus::Done]);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let probe = listener.local_addr().unwrap().to_string();
    assert_eq!(
        moves(&mut at_o, &migrate(k3, &b.addr, 61)),
        [MoveStatus::Unreachable]
    );
    assert_eq!(
        moves(&mut at_o, &migrate(k3, &probe, 61)),
        [MoveStatus::Unreachable]
    );
    assert_eq!(outsider.stat("migration_targets_not_member"), 2);
    assert_eq!(outsider.stat("pages_handed_over"), 0);
    assert_eq!(b.stat("pages_adopted"), 1);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        matches!(listener.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the stand-alone server connected to the port a client named"
    );
    assert_eq!(at_o.get(k3), Some(page(3)), "the outsider keeps the page");
}

/// `netram cluster init` keeps the key that signs apart from node 1's credentials, so that
/// copying node 1's directory to the node does not hand it the power to issue identities.
#[test]
fn cluster_init_keeps_the_ca_key_apart_from_node_1() {
    let d = tempfile::tempdir().unwrap();
    let ca = d.path().join("ca");
    let out = Command::new(NETRAM)
        .args(["cluster", "init"])
        .arg(&ca)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let node = ca.join("node-1");
    for f in ["ca.key", "ca.pem", "crl.pem"] {
        assert!(ca.join(f).is_file(), "{f} in the CA directory");
    }
    assert!(!ca.join("node.key").exists(), "no node key beside ca.key");
    for f in ["ca.pem", "crl.pem", "node.pem", "node.key"] {
        assert!(node.join(f).is_file(), "{f} in node 1's directory");
    }
    assert!(
        !node.join("ca.key").exists(),
        "no ca.key among node 1's credentials"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("--tls"));
    // Node 1 serves with its directory alone, and a client of the cluster reaches it.
    let server = ServerProcess::start(&["--capacity", "16M", "--tls", node.to_str().unwrap()]);
    let client = tempfile::tempdir().unwrap();
    let sec = keygen(&ca, 2, false, client.path());
    Conn::open(&server.addr, &sec, &Hello::new(2, 1, 1)).expect("a client of the cluster");
    // Node 1's credentials in the CA directory are refused.
    let again = d.path().join("again");
    let out = Command::new(NETRAM)
        .args(["cluster", "init"])
        .arg(&again)
        .arg("--node-dir")
        .arg(&again)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("must not be the cluster directory"));
    assert!(!again.join("ca.key").exists(), "nothing made when refused");
}
