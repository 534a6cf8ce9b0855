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
use netram_client::open::{open_pager, ClientPager, OpenOptions};
use netram_pager::{Backing, Scheme};
use netram_proto::PAGE_SIZE;
use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `NETRAM_DAEMON` is the process's: the tests that set it run one at a time.
static DAEMON_VAR: Mutex<()> = Mutex::new(());

struct Daemon {
    proc: ServerProcess,
    /// Its control socket, where clients on its machine ask for the members.
    control: String,
    _dir: tempfile::TempDir,
}

fn start(node: u64, seed: Option<&str>) -> Daemon {
    let listen = format!("127.0.0.1:{}", common::reserved_port());
    let ctl = tempfile::tempdir().unwrap();
    // As /run/netram is: every user may reach the socket, only its owner writes there.
    std::fs::set_permissions(
        ctl.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let control = ctl.path().join("control.sock").display().to_string();
    let dir = node_dir(node);
    let mut args = vec![
        "--tls",
        dir.to_str().unwrap(),
        "--capacity",
        "64M",
        "--metrics",
        "off",
        "--control",
        &control,
    ];
    if let Some(s) = seed {
        args.extend(["--seed", s]);
    }
    let proc = ServerProcess::start_at(&listen, &args);
    Daemon {
        proc,
        control,
        _dir: ctl,
    }
}

fn members(control: &str) -> netram_member::MemberList {
    netram_client::discover::members(control, Duration::from_secs(2)).expect("members")
}

fn states(control: &str) -> Vec<(u64, netram_member::Liveness)> {
    let mut v: Vec<_> = members(control)
        .members
        .iter()
        .map(|r| (r.node, r.state))
        .collect();
    v.sort_by_key(|x| x.0);
    v
}

/// A client's pager shared with its maintenance thread, which follows the local daemon's
/// membership every `every` and never probes on its own: only membership can point it at a
/// server.
fn following_membership_only(
    pager: ClientPager,
    every: Duration,
) -> (Arc<Mutex<ClientPager>>, maintain::Maintenance) {
    let pager = Arc::new(Mutex::new(pager));
    let shared = pager.clone();
    let m = maintain::spawn(
        move |f| f(&mut shared.lock().unwrap_or_else(|e| e.into_inner())),
        MaintainConfig {
            probe_every: Duration::from_secs(3600),
            membership_every: Some(every),
            ..Default::default()
        },
    );
    (pager, m)
}

/// Page `i`'s contents in a test that uses `salt`.
fn content(i: u64, salt: usize) -> Vec<u8> {
    (0..PAGE_SIZE)
        .map(|j| (i as usize * salt + j * 7) as u8)
        .collect()
}

/// Writes pages `0..n` (their [`content`]) and flushes.
fn write_pages(pager: &Mutex<ClientPager>, n: u64, salt: usize) {
    let mut p = pager.lock().unwrap();
    for i in 0..n {
        p.write(i, &content(i, salt)).unwrap();
    }
    p.flush().unwrap();
}

/// Reads pages `0..n` back and checks them, the client having failed no server.
fn read_back(pager: &Mutex<ClientPager>, n: u64, salt: usize) {
    let mut p = pager.lock().unwrap();
    assert!(p.servers().all(|(_, alive)| alive), "a server was failed");
    let mut buf = vec![0u8; PAGE_SIZE];
    for i in 0..n {
        p.read(i, &mut buf).unwrap();
        assert_eq!(buf, content(i, salt), "page {i}");
    }
}

#[test]
fn daemons_find_each_other_clients_need_no_server_list_and_death_is_followed() {
    use netram_member::Liveness::{Alive, Down};
    let a = start(11, None);
    let b = start(12, Some(&a.proc.addr));
    let c = start(13, Some(&a.proc.addr));
    for d in [&a, &b, &c] {
        eventually("every daemon sees the three", 20, || {
            states(&d.control) == [(11, Alive), (12, Alive), (13, Alive)]
        });
    }
    // Each announces what it offers: 64 MiB.
    eventually("announcements heard", 20, || {
        members(&c.control)
            .members
            .iter()
            .all(|r| r.offered_pages == (64 << 20) / PAGE_SIZE as u64)
    });
    // `netram members` prints the same.
    let out = netram()
        .args(["members", "--daemon", &c.control])
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
    std::env::set_var("NETRAM_DAEMON", &c.control);
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
    // Only membership may tell the client that b died.
    let (pager, _maintenance) = following_membership_only(pager, Duration::from_millis(200));
    let page = |i: u64| content(i, 31);
    write_pages(&pager, 1000, 31);
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
            states(&m.control) == [(11, Alive), (12, Down), (13, Alive), (14, Alive)]
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
                .arg(common::ca_dir())
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
        states(&a.control)
            .iter()
            .any(|&(n, s)| n == 22 && s == netram_member::Liveness::Alive)
    });
    drop(b);
}

/// A membership packet carrying GMS epoch message `frame` that names `from` as its sender,
/// signed with `creds` (which may be another node's).
fn gms_packet(creds: &netram_client::Credentials, from: u64, frame: &[u8]) -> Vec<u8> {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut p = Vec::new();
    netram_member::envelope::encode_gms_body(
        &mut p,
        now_ms,
        &netram_member::Announce::default(),
        from,
        frame,
        true,
    );
    netram_member::envelope::encode_cert(&mut p, creds.cert_der());
    let (scheme, sig) = creds.sign(&p).unwrap();
    netram_member::envelope::encode_signature(&mut p, scheme, &sig);
    p
}

/// GMS's epoch messages ride in membership packets: one in another node's name, one from a
/// node that is no member, one that does not decode, and a plan that does not add up are
/// refused and counted, one counter each, and the epochs go on.
#[test]
fn hostile_gms_messages_are_refused_and_counted() {
    use netram_proto::gms::{Epoch, Plan, Request};
    let a = start(26, None);
    let b = start(27, Some(&a.proc.addr));
    eventually("b alive at a", 20, || {
        states(&a.control)
            .iter()
            .any(|&(n, s)| n == 27 && s == netram_member::Liveness::Alive)
    });
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let to: SocketAddr = a.proc.addr.parse().unwrap();
    let frame = |e: Epoch| {
        let mut f = Vec::new();
        Request::Epoch(e).encode(0, &mut f);
        f
    };
    let outsider = netram_client::Credentials::load(&node_dir(28)).unwrap();
    let member_b = netram_client::Credentials::load(&node_dir(27)).unwrap();
    let ask = frame(Epoch::RequestSummary { epoch: 1 << 40 });
    // Signed by node 28 in b's name.
    sock.send_to(&gms_packet(&outsider, 27, &ask), to).unwrap();
    // From node 28, which is no member.
    sock.send_to(&gms_packet(&outsider, 28, &ask), to).unwrap();
    // From b, but not an epoch message.
    sock.send_to(&gms_packet(&member_b, 27, b"not a frame"), to)
        .unwrap();
    // From b, a plan whose weights do not add up to its M.
    let lie = frame(Epoch::Plan(Plan {
        epoch: 1 << 40,
        initiator: 27,
        m: 10,
        min_age_ms: 1,
        duration_ms: 1_000,
        weights: vec![(26, 1_000_000)],
    }));
    sock.send_to(&gms_packet(&member_b, 27, &lie), to).unwrap();
    eventually("the GMS refusals counted", 10, || {
        a.proc.stat("gms_refused_wrong_sender") >= 1
            && a.proc.stat("gms_refused_not_member") >= 1
            && a.proc.stat("gms_refused_malformed") >= 1
            && a.proc.stat("gms_plans_refused") >= 1
    });
    // The lie was not adopted, and the epochs go on past where they were.
    let epoch = a.proc.stat("gms_epoch");
    assert!(epoch < 1 << 40, "a lying plan was adopted: epoch {epoch}");
    eventually("a later epoch", 30, || a.proc.stat("gms_epoch") > epoch);
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
            states(&d.control) == [(41, Alive), (42, Alive), (43, Alive)]
        });
    }
    // A client on c's machine, no redundancy: a server failed is its pages lost.
    let _var = DAEMON_VAR.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("NETRAM_DAEMON", &c.control);
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
    let (pager, _maintenance) = following_membership_only(pager, Duration::from_millis(200));
    write_pages(&pager, 2048, 13);

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
        assert_eq!(states(&d.control), [(41, Alive), (42, Alive), (43, Alive)]);
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
    read_back(&pager, 2048, 13);
    std::env::remove_var("NETRAM_DAEMON");
}

/// A fake daemon, as user `nobody`: serves `body` as the answer to every request on a unix
/// socket at `path` (`bind_as_root`: the socket is bound by root in root's directory and only
/// listened on as nobody, so that only the process check can tell). Killed on drop.
struct FakeDaemon(std::process::Child);

impl FakeDaemon {
    fn start(path: &std::path::Path, body: &str, bind_as_root: bool) -> Self {
        let script = r#"
import os, socket, sys
path, body, as_root = sys.argv[1], sys.argv[2].encode(), sys.argv[3] == "1"
s = socket.socket(socket.AF_UNIX)
if as_root:
    s.bind(path); os.chmod(path, 0o666)
    os.setgid(65534); os.setuid(65534)
else:
    s.bind(path); os.chmod(path, 0o666)
s.listen(16)
s.settimeout(60)
while True:
    c, _ = s.accept()
    c.settimeout(5)
    try:
        c.recv(4096)
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    except OSError:
        pass
    c.close()
"#;
        let mut cmd = if bind_as_root {
            std::process::Command::new("/usr/bin/python3")
        } else {
            let mut c = std::process::Command::new("setpriv");
            c.args([
                "--reuid",
                "65534",
                "--regid",
                "65534",
                "--clear-groups",
                "/usr/bin/python3",
            ]);
            c
        };
        let child = cmd
            .args(["-c", script])
            .arg(path)
            .arg(body)
            .arg(if bind_as_root { "1" } else { "0" })
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !path.exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "the fake daemon did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(100));
        Self(child)
    }
}

impl Drop for FakeDaemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Issue 36, attacks 2 and 3: clients asked the daemon on a TCP port that any local user could
/// take while no daemon held it, and believed what was there: a fake `/members` listing
/// healthy servers as down cost a client its pages; and one HTTP thread, two seconds per
/// connection, let twelve idle sockets delay `/members` by 24 s. Now clients ask the control
/// socket only, and believe it only in a directory no other user writes and when served by
/// root or themselves: a fake daemon of another user is refused, in its own directory and in
/// root's; a client with its own server list keeps to it and keeps every page. And the real
/// daemon answers `/members` at once while 64 sockets sit idle on it.
#[test]
fn only_a_daemon_of_root_or_this_user_is_believed_and_idle_sockets_do_not_delay_it() {
    use std::os::unix::fs::PermissionsExt;
    if !netram_testkit::have_root("another user for a fake daemon (setpriv)") {
        return;
    }
    if !netram_testkit::have_tools(&[("setpriv", "util-linux"), ("/usr/bin/python3", "python3")]) {
        return;
    }
    let a = start(51, None);
    let b = start(52, Some(&a.proc.addr));
    eventually("the two see each other", 20, || {
        states(&a.control).len() == 2 && states(&b.control).len() == 2
    });
    // What the fake daemon says: both servers down.
    let mut lie = members(&a.control);
    for r in &mut lie.members {
        r.state = netram_member::Liveness::Down;
        r.boot += 1;
    }
    let lie = serde_json::to_string(&lie).unwrap();

    // 1. In nobody's own directory.
    let theirs = tempfile::tempdir().unwrap();
    let st = std::process::Command::new("chown")
        .args(["65534:65534", theirs.path().to_str().unwrap()])
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::set_permissions(theirs.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let fake1 = theirs.path().join("7077.sock");
    let _f1 = FakeDaemon::start(&fake1, &lie, false);
    let e = netram_client::discover::members(fake1.to_str().unwrap(), Duration::from_secs(2))
        .unwrap_err();
    assert!(e.to_string().contains("belongs to user 65534"), "{e}");
    // 2. Bound in root's directory, but listened on (served) by nobody.
    let roots = tempfile::tempdir().unwrap();
    std::fs::set_permissions(roots.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let fake2 = roots.path().join("7077.sock");
    let _f2 = FakeDaemon::start(&fake2, &lie, true);
    let e = netram_client::discover::members(fake2.to_str().unwrap(), Duration::from_secs(2))
        .unwrap_err();
    assert!(e.to_string().contains("served by user 65534"), "{e}");

    // A client with its own servers, following the fake daemon: told nothing it believes, it
    // keeps both servers and every page.
    let _var = DAEMON_VAR.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("NETRAM_DAEMON", &fake2);
    let spill = tempfile::tempdir().unwrap();
    let pager = open_pager(&OpenOptions {
        security: common::security(),
        servers: vec![a.proc.addr.clone(), b.proc.addr.clone()],
        backing: Backing::Cluster,
        pages: 1024,
        cache_pages: 0,
        spill_dir: Some(spill.path().to_path_buf()),
        low_latency: false,
        redundancy: Scheme::None,
    })
    .unwrap();
    let (pager, maintenance) = following_membership_only(pager, Duration::from_millis(100));
    write_pages(&pager, 512, 3);
    std::thread::sleep(Duration::from_secs(2));
    drop(maintenance);
    std::env::remove_var("NETRAM_DAEMON");
    read_back(&pager, 512, 3);
    assert_eq!(pager.lock().unwrap().pages_on_disk_only(), 0);

    // 3. Idle sockets on the real daemon's control socket, 64 of another user's (8 of them
    // are kept, the rest closed at once) and 64 of this user's, do not delay /members.
    let mut nobody = std::process::Command::new("setpriv")
        .args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            "import socket, sys, time\n\
             h = []\n\
             for _ in range(64):\n\
             \ts = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); h.append(s)\n\
             print('idle', flush=True); time.sleep(20)",
            &a.control,
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(nobody.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "idle");
    let idle: Vec<std::os::unix::net::UnixStream> = (0..64)
        .map(|_| std::os::unix::net::UnixStream::connect(&a.control).unwrap())
        .collect();
    let t = std::time::Instant::now();
    for _ in 0..5 {
        members(&a.control);
    }
    let took = t.elapsed();
    drop(idle);
    let _ = nobody.kill();
    let _ = nobody.wait();
    println!("5 GET /members with 128 idle sockets opened on the daemon: {took:?}");
    assert!(
        took < Duration::from_secs(2),
        "/members waited behind idle sockets: {took:?}"
    );
}

/// `/metrics` over TCP tells nothing to whoever reaches it without the token when one is set,
/// and a daemon refuses to serve metrics beyond loopback without one (checked with
/// `--check-config`, which binds nothing); `/members` is never on TCP.
#[test]
fn metrics_on_tcp_need_the_token_and_list_no_members() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "a-token-of-some-length\n").unwrap();
    let out = netram()
        .args([
            "serve",
            "--listen",
            "127.0.0.1:7177",
            "--metrics",
            "0.0.0.0:9177",
        ])
        .arg("--check-config")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("need --metrics-token-file"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = netram()
        .args([
            "serve",
            "--listen",
            "127.0.0.1:7177",
            "--metrics",
            "0.0.0.0:9177",
        ])
        .arg("--metrics-token-file")
        .arg(&token)
        .arg("--check-config")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let metrics = format!("127.0.0.1:{}", common::reserved_port());
    let d = ServerProcess::start_restartable(&[
        "--metrics",
        &metrics,
        "--metrics-token-file",
        token.to_str().unwrap(),
    ]);
    let get = |path: &str, auth: Option<&str>| common::http_get(&metrics, path, auth);
    let no = get("/metrics", None);
    assert!(no.starts_with("HTTP/1.1 401"), "{no}");
    assert!(!no.contains("netram_"), "nothing told without the token");
    let wrong = get("/metrics", Some("a-token-of-some-lengtX"));
    assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
    let yes = get("/metrics", Some("a-token-of-some-length"));
    assert!(yes.starts_with("HTTP/1.1 200"), "{yes}");
    assert!(yes.contains("netram_members_alive"), "{yes}");
    let members = get("/members", Some("a-token-of-some-length"));
    assert!(members.starts_with("HTTP/1.1 404"), "{members}");
    drop(d);
}

/// A tmux server of the test's own (its own socket name), killed when dropped.
struct Tmux(String);

impl Tmux {
    fn cmd(&self) -> std::process::Command {
        let mut c = std::process::Command::new("tmux");
        c.args(["-L", &self.0]);
        c
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd().arg("kill-server").output();
    }
}

/// Issue "A newcomer's first hour": `netram top`, the operator's live view. Two daemons, pages
/// stored on one of them by a client: `--once` prints the cluster's totals and each member's
/// row with what the daemon's `/members` says it uses; in a terminal (tmux, 140×30) the live
/// view shows the same, refreshes, and `q` ends it with status 0.
#[test]
fn netram_top_shows_the_cluster_live_and_quits_on_q() {
    use netram_member::Liveness::Alive;
    let a = start(61, None);
    let b = start(62, Some(&a.proc.addr));
    for d in [&a, &b] {
        eventually("both daemons see both", 20, || {
            states(&d.control) == [(61, Alive), (62, Alive)]
        });
    }
    // 12 MiB of pages on b.
    let spill = tempfile::tempdir().unwrap();
    let pager = open_pager(&OpenOptions {
        security: common::security(),
        servers: vec![b.proc.addr.clone()],
        backing: Backing::Cluster,
        pages: 4096,
        cache_pages: 0,
        spill_dir: Some(spill.path().to_path_buf()),
        low_latency: false,
        redundancy: Scheme::Mirror { copies: 1 },
    })
    .expect("a pager on b");
    let pager = Mutex::new(pager);
    write_pages(&pager, 3072, 7);
    let used_mib = |list: &netram_member::MemberList, node: u64| {
        let r = list.members.iter().find(|r| r.node == node).unwrap();
        ((r.offered_pages - r.free_pages) * PAGE_SIZE as u64) >> 20
    };
    eventually("a hears that b holds the pages", 20, || {
        used_mib(&members(&a.control), 62) >= 12
    });
    let out = netram()
        .args(["top", "--once", "--width", "140", "--daemon", &a.control])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("2 alive, 0 suspect, 0 down"), "{text}");
    let expected = format!("{} MiB", used_mib(&members(&a.control), 62));
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("62 "))
        .unwrap_or_else(|| panic!("no row for node 62:\n{text}"));
    assert!(row.contains(&b.proc.addr) && row.contains("alive"), "{row}");
    assert!(row.contains(&expected), "{row} should show {expected} used");
    assert!(
        text.lines().any(|l| l.trim_start().starts_with("*61 ")),
        "{text}"
    );

    // The live view, in a terminal.
    if !netram_testkit::have_tools(&[("tmux", "tmux")]) {
        return;
    }
    let tmux = Tmux(format!("netram-top-{}", std::process::id()));
    // Its exit status, written by the pane's shell when it ends (tmux's own record of it,
    // `pane_dead_status`, was sometimes empty here).
    let status = spill.path().join("top-status");
    let started = tmux
        .cmd()
        .args(["new-session", "-d", "-s", "top", "-x", "140", "-y", "30"])
        .arg(format!(
            "timeout --foreground 60 {} top --daemon {}; echo $? > {}",
            common::NETRAM,
            a.control,
            status.display()
        ))
        .output()
        .unwrap();
    assert!(started.status.success(), "{started:?}");
    let screen = || {
        let out = tmux
            .cmd()
            .args(["capture-pane", "-p", "-t", "top"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    eventually("the live view shows both members", 10, || {
        let s = screen();
        s.contains("netram top") && s.contains("2 alive") && s.contains(&b.proc.addr)
    });
    let shown = screen();
    assert!(shown.contains(&expected), "{shown}");
    let sent = tmux
        .cmd()
        .args(["send-keys", "-t", "top", "q"])
        .output()
        .unwrap();
    assert!(sent.status.success());
    eventually("q ends netram top", 10, || {
        std::fs::read_to_string(&status).is_ok_and(|s| s.ends_with('\n'))
    });
    let code = std::fs::read_to_string(&status).unwrap();
    assert_eq!(code.trim(), "0", "netram top's exit status");
}
