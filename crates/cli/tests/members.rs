//! Membership between real daemons: three `netram serve` processes, each with its own node
//! certificate, find each other through one seed, list each other (`netram members`), and
//! a client given no servers pages to the members its local daemon names, and to a fourth
//! that joins later; a daemon killed
//! with SIGKILL is declared down by the others, and the client, told so by its daemon, probes
//! it at once and finds it dead (its regular probes are off, so only membership can point it
//! there). Hostile membership packets are refused and counted; a flood of them declares no
//! member down and costs the client no page.

mod common;

use common::{eventually, netram, node_dir, tls_dir, ServerProcess, KEYGEN};
use netram_client::maintain::{self, MaintainConfig};
use netram_client::open::{open_pager, OpenOptions};
use netram_pager::{Backing, Scheme};
use netram_proto::PAGE_SIZE;
use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `NETRAM_DAEMON` is the process's: the tests that set it run one at a time.
static DAEMON_VAR: Mutex<()> = Mutex::new(());

struct Daemon {
    proc: ServerProcess,
    metrics: String,
}

fn start(node: u64, seed: Option<&str>) -> Daemon {
    let (listen, metrics) = (
        format!("127.0.0.1:{}", common::reserved_port()),
        format!("127.0.0.1:{}", common::reserved_port()),
    );
    let dir = node_dir(node);
    let mut args = vec![
        "--tls",
        dir.to_str().unwrap(),
        "--capacity",
        "64M",
        "--metrics",
        &metrics,
    ];
    if let Some(s) = seed {
        args.extend(["--seed", s]);
    }
    let proc = ServerProcess::start_at(&listen, &args);
    Daemon { proc, metrics }
}

fn members(metrics: &str) -> netram_member::MemberList {
    netram_client::discover::members(metrics, Duration::from_secs(2)).expect("members")
}

fn states(metrics: &str) -> Vec<(u64, netram_member::Liveness)> {
    let mut v: Vec<_> = members(metrics)
        .members
        .iter()
        .map(|r| (r.node, r.state))
        .collect();
    v.sort_by_key(|x| x.0);
    v
}

#[test]
fn daemons_find_each_other_clients_need_no_server_list_and_death_is_followed() {
    use netram_member::Liveness::{Alive, Down};
    let a = start(11, None);
    let b = start(12, Some(&a.proc.addr));
    let c = start(13, Some(&a.proc.addr));
    for d in [&a, &b, &c] {
        eventually("every daemon sees the three", 20, || {
            states(&d.metrics) == [(11, Alive), (12, Alive), (13, Alive)]
        });
    }
    // Each announces what it offers: 64 MiB.
    eventually("announcements heard", 20, || {
        members(&c.metrics)
            .members
            .iter()
            .all(|r| r.offered_pages == (64 << 20) / PAGE_SIZE as u64)
    });
    // `netram members` prints the same.
    let out = netram()
        .args(["members", "--daemon", &c.metrics])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("*13") && text.contains(&a.proc.addr),
        "{text}"
    );

    // A client on c's machine, given no servers: it pages to a and b, never to c.
    let _var = DAEMON_VAR.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("NETRAM_DAEMON", &c.metrics);
    let spill = tempfile::tempdir().unwrap();
    let pager = open_pager(&OpenOptions {
        security: common::security(),
        servers: Vec::new(),
        backing: Backing::Cluster,
        pages: 4096,
        cache_pages: 0,
        spill_dir: Some(spill.path().to_path_buf()),
        low_latency: false,
        redundancy: Scheme::Mirror { copies: 2 },
    })
    .expect("a pager from the local daemon's members");
    let names: Vec<String> = pager.servers().map(|(n, _)| n.to_string()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(names.contains(&a.proc.addr) && names.contains(&b.proc.addr));
    let pager = Arc::new(Mutex::new(pager));
    let _maintenance = {
        let pager = pager.clone();
        maintain::spawn(
            move |f| f(&mut pager.lock().unwrap_or_else(|e| e.into_inner())),
            MaintainConfig {
                // Only membership may tell the client that b died.
                probe_every: Duration::from_secs(3600),
                membership_every: Some(Duration::from_millis(200)),
                ..Default::default()
            },
        )
    };
    let page = |i: u64| -> Vec<u8> {
        (0..PAGE_SIZE)
            .map(|j| (i as usize * 31 + j * 7) as u8)
            .collect()
    };
    {
        let mut p = pager.lock().unwrap();
        for i in 0..1000 {
            p.write(i, &page(i)).unwrap();
        }
        p.flush().unwrap();
    }
    assert!(a.proc.stat("stored_pages") >= 1000);
    assert!(b.proc.stat("stored_pages") >= 1000);
    assert_eq!(
        c.proc.stat("stored_pages"),
        0,
        "the local daemon is not its own store"
    );

    // A fourth daemon joins: the client, whose servers are its daemon's members, takes it up
    // and places new pages on it too.
    let d = start(14, Some(&a.proc.addr));
    eventually("the client uses the new member", 30, || {
        pager.lock().unwrap().servers().count() == 3
    });
    {
        let mut p = pager.lock().unwrap();
        for i in 1000..2000 {
            p.write(i, &page(i)).unwrap();
        }
        p.flush().unwrap();
        // Its slots and queues grew with it.
        p.check_invariants().unwrap();
    }
    assert!(
        d.proc.stat("stored_pages") > 100,
        "the new member took pages"
    );

    b.proc.signal(libc::SIGKILL);
    for m in [&a, &c] {
        eventually("b declared down", 30, || {
            states(&m.metrics) == [(11, Alive), (12, Down), (13, Alive), (14, Alive)]
        });
    }
    eventually(
        "the client probes b on membership's word and finds it dead",
        10,
        || {
            let p = pager.lock().unwrap();
            let alive: Vec<bool> = p.servers().map(|(_, alive)| alive).collect();
            alive.iter().filter(|&&x| !x).count() == 1
        },
    );
    let mut p = pager.lock().unwrap();
    let mut buf = vec![0u8; PAGE_SIZE];
    for i in 0..2000 {
        p.read(i, &mut buf).unwrap();
        assert_eq!(buf, page(i), "page {i}");
    }
    std::env::remove_var("NETRAM_DAEMON");
    let stats = netram()
        .args(["stats", &a.proc.addr, "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert!(v["members_declared_down"].as_u64().unwrap() >= 1, "{v}");
}

#[test]
fn hostile_membership_packets_are_refused_and_counted() {
    let a = start(21, None);
    let b = start(22, Some(&a.proc.addr));
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let to: SocketAddr = a.proc.addr.parse().unwrap();
    // Garbage.
    sock.send_to(b"not a membership packet at all", to).unwrap();
    // A well-formed packet without a signature, in a cluster that signs.
    let mut p = Vec::new();
    netram_member::envelope::encode_body(
        &mut p,
        0,
        &netram_member::Announce::default(),
        b"x",
        false,
    );
    sock.send_to(&p, to).unwrap();
    // Signed, with a certificate of ours, but the signature is not over these bytes. (Sent
    // now: a stale packet is refused before its signature is looked at.)
    let creds = netram_client::Credentials::load(&node_dir(23)).unwrap();
    let mut p = Vec::new();
    netram_member::envelope::encode_body(
        &mut p,
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64,
        &netram_member::Announce::default(),
        b"x",
        true,
    );
    netram_member::envelope::encode_cert(&mut p, creds.cert_der());
    let (scheme, sig) = creds.sign(b"something else").unwrap();
    netram_member::envelope::encode_signature(&mut p, scheme, &sig);
    sock.send_to(&p, to).unwrap();
    // Signed properly, but by a client's certificate: not a member.
    let client_dir = tls_dir().with_file_name(format!("client-31-{}", std::process::id()));
    {
        let _one = KEYGEN.lock().unwrap_or_else(|e| e.into_inner());
        if !client_dir.join("node.pem").exists() {
            let st = netram()
                .args(["keygen", "--cluster"])
                .arg(tls_dir())
                .args(["--node", "31", "--out"])
                .arg(&client_dir)
                .status()
                .unwrap();
            assert!(st.success());
        }
    }
    let client = netram_client::Credentials::load(&client_dir).unwrap();
    let mut p = Vec::new();
    netram_member::envelope::encode_body(
        &mut p,
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64,
        &netram_member::Announce::default(),
        b"x",
        true,
    );
    netram_member::envelope::encode_cert(&mut p, client.cert_der());
    let (scheme, sig) = client.sign(&p).unwrap();
    netram_member::envelope::encode_signature(&mut p, scheme, &sig);
    sock.send_to(&p, to).unwrap();
    eventually("refusals counted", 10, || {
        a.proc.stat("gossip_refused_malformed") >= 1
            && a.proc.stat("gossip_refused_unsigned") >= 1
            && a.proc.stat("gossip_refused_bad_signature") >= 1
            && a.proc.stat("gossip_refused_not_server") >= 1
    });
    // And the cluster goes on: b is still a member of a's.
    eventually("b still alive at a", 10, || {
        states(&a.metrics)
            .iter()
            .any(|&(n, s)| n == 22 && s == netram_member::Liveness::Alive)
    });
    drop(b);
}

/// CPU time (user + system) of process `pid` so far, in clock ticks.
fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = stat.rsplit_once(')').unwrap().1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the state: fields 14 and 15 of stat(5), utime and stime.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Sends `packets` round robin from `sockets` to `to` for `secs` seconds at most, as fast as
/// one thread can; returns how many were sent.
fn flood(sockets: &[UdpSocket], to: SocketAddr, packets: &[Vec<u8>], secs: u64) -> u64 {
    let end = std::time::Instant::now() + Duration::from_secs(secs);
    let mut sent = 0u64;
    'out: loop {
        for _ in 0..64 {
            for (i, s) in sockets.iter().enumerate() {
                let p = &packets[(sent as usize + i) % packets.len()];
                if s.send_to(p, to).is_ok() {
                    sent += 1;
                }
            }
        }
        if std::time::Instant::now() >= end || sent >= 50_000_000 {
            break 'out;
        }
    }
    sent
}

/// Issue "Nothing anyone sends can make a client lose a page", attack 1: a UDP flood on a
/// daemon's port, from one source address and then from 32, of garbage, of well-formed but
/// unsigned packets and of packets carrying a member's real certificate under a signature
/// that does not check. Before, every datagram spent the daemon's signature budget, members'
/// packets went unread, members were declared down both ways and a client that followed the
/// flooded daemon's membership failed healthy servers: 1,792 of 2,048 pages lost. Now no
/// member is declared down, the client (which follows the flooded daemon and has its own
/// probes off, so membership is all it hears) reads every page back, and the daemon's CPU over
/// the flood is printed.
#[test]
fn a_udp_flood_declares_no_member_down_and_costs_no_page() {
    use netram_member::Liveness::Alive;
    let a = start(41, None);
    let b = start(42, Some(&a.proc.addr));
    let c = start(43, Some(&a.proc.addr));
    for d in [&a, &b, &c] {
        eventually("every daemon sees the three", 20, || {
            states(&d.metrics) == [(41, Alive), (42, Alive), (43, Alive)]
        });
    }
    // A client on c's machine, no redundancy: a server failed is its pages lost.
    let _var = DAEMON_VAR.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("NETRAM_DAEMON", &c.metrics);
    let spill = tempfile::tempdir().unwrap();
    let pager = open_pager(&OpenOptions {
        security: common::security(),
        servers: Vec::new(),
        backing: Backing::Cluster,
        pages: 4096,
        cache_pages: 0,
        spill_dir: Some(spill.path().to_path_buf()),
        low_latency: false,
        redundancy: Scheme::None,
    })
    .expect("a pager from the local daemon's members");
    let pager = Arc::new(Mutex::new(pager));
    let _maintenance = {
        let pager = pager.clone();
        maintain::spawn(
            move |f| f(&mut pager.lock().unwrap_or_else(|e| e.into_inner())),
            MaintainConfig {
                probe_every: Duration::from_secs(3600),
                membership_every: Some(Duration::from_millis(200)),
                ..Default::default()
            },
        )
    };
    let page = |i: u64| -> Vec<u8> {
        (0..PAGE_SIZE)
            .map(|j| (i as usize * 13 + j * 5) as u8)
            .collect()
    };
    {
        let mut p = pager.lock().unwrap();
        for i in 0..2048 {
            p.write(i, &page(i)).unwrap();
        }
        p.flush().unwrap();
    }

    // What the attacker sends: garbage; a well-formed packet, unsigned; and one signed "by"
    // member b (its real certificate, a signature over other bytes).
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut unsigned = Vec::new();
    let ann = netram_member::Announce::default();
    netram_member::envelope::encode_body(&mut unsigned, now_ms, &ann, b"swim", false);
    let creds_b = netram_client::Credentials::load(&node_dir(42)).unwrap();
    let mut forged = Vec::new();
    netram_member::envelope::encode_body(&mut forged, now_ms, &ann, b"swim", true);
    netram_member::envelope::encode_cert(&mut forged, creds_b.cert_der());
    let (scheme, sig) = creds_b.sign(b"other bytes").unwrap();
    netram_member::envelope::encode_signature(&mut forged, scheme, &sig);
    let packets = vec![b"garbage!".to_vec(), unsigned, forged];

    let to: SocketAddr = c.proc.addr.parse().unwrap();
    let one = vec![UdpSocket::bind("127.0.0.2:0").unwrap()];
    let many: Vec<UdpSocket> = (0..32)
        .map(|i| UdpSocket::bind(format!("127.0.1.{}:0", i + 1)).unwrap())
        .collect();
    let hz = 100.0; // USER_HZ on Linux
    for (what, sockets) in [("one address", &one), ("32 addresses", &many)] {
        let cpu0 = cpu_ticks(c.proc.pid());
        let t0 = std::time::Instant::now();
        let sent = flood(sockets, to, &packets, 8);
        let secs = t0.elapsed().as_secs_f64();
        let cpu = (cpu_ticks(c.proc.pid()) - cpu0) as f64 / hz / secs;
        println!(
            "flood from {what}: {sent} packets in {secs:.1} s ({:.0}/s); the flooded daemon's CPU \
             {:.0} % of one core",
            sent as f64 / secs,
            cpu * 100.0
        );
    }
    // Membership had time to declare anything down (3 s of suspicion) during the 16 s.
    for d in [&a, &b, &c] {
        assert_eq!(
            d.proc.stat("members_declared_down"),
            0,
            "a member was declared down at {}",
            d.proc.addr
        );
        assert_eq!(states(&d.metrics), [(41, Alive), (42, Alive), (43, Alive)]);
    }
    let refused = c.proc.stat("gossip_refused_malformed")
        + c.proc.stat("gossip_refused_unsigned")
        + c.proc.stat("gossip_refused_rate")
        + c.proc.stat("gossip_refused_bad_signature");
    println!(
        "refused at the flooded daemon: {} malformed, {} unsigned, {} over the strangers' budget, \
         {} bad signatures; {} members' packets over their budget",
        c.proc.stat("gossip_refused_malformed"),
        c.proc.stat("gossip_refused_unsigned"),
        c.proc.stat("gossip_refused_rate"),
        c.proc.stat("gossip_refused_bad_signature"),
        c.proc.stat("gossip_refused_member_rate"),
    );
    assert!(refused > 10_000, "the flood was refused: {refused}");
    assert_eq!(c.proc.stat("gossip_refused_member_rate"), 0);
    let mut p = pager.lock().unwrap();
    assert!(p.servers().all(|(_, alive)| alive), "a server was failed");
    let mut buf = vec![0u8; PAGE_SIZE];
    for i in 0..2048 {
        p.read(i, &mut buf).unwrap();
        assert_eq!(buf, page(i), "page {i}");
    }
    std::env::remove_var("NETRAM_DAEMON");
}
