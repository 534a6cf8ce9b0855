//! Multi-process tests: real `netram serve` processes on loopback ports, a pager in this
//! process, and the failures the core must survive. Every server process is killed by its PID
//! when its guard drops, also when a test fails.

use netram_client::disk::FileDisk;
use netram_client::{ClientConfig, TcpTransport};
use netram_pager::{Backing, Pager, PagerConfig, PagerError};
use netram_proto::{Hello, Request, PAGE_SIZE, WELCOME_LEN};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::ServerProcess;

mod common;

fn servers(n: usize, args: &[&str]) -> Vec<ServerProcess> {
    (0..n).map(|_| ServerProcess::start(args)).collect()
}

fn content(page: u64, out: &mut [u8]) {
    let mut rng = fastrand::Rng::with_seed(page.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xfeed);
    for c in out.chunks_exact_mut(8) {
        c.copy_from_slice(&rng.u64(..).to_le_bytes());
    }
}

fn pager(
    addrs: &[String],
    pages: u64,
    cache: usize,
    backing: Backing,
    client: &ClientConfig,
) -> (Pager<TcpTransport, FileDisk>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let disk = FileDisk::create_in(dir.path()).unwrap();
    let cfg = PagerConfig {
        pages,
        cache_pages: cache,
        backing,
        ..Default::default()
    };
    (
        Pager::new(cfg, TcpTransport::connect(addrs, client), disk),
        dir,
    )
}

fn addrs(s: &[ServerProcess]) -> Vec<String> {
    s.iter().map(|s| s.addr.clone()).collect()
}

/// Writes pages `0..n` in batches, then reads them back in a shuffled order and checks each.
fn write_all_then_verify(p: &mut Pager<TcpTransport, FileDisk>, n: u64) {
    let batch = 256u64;
    let mut buf = vec![0u8; batch as usize * PAGE_SIZE];
    for start in (0..n).step_by(batch as usize) {
        let pages: Vec<u64> = (start..(start + batch).min(n)).collect();
        for (i, &pg) in pages.iter().enumerate() {
            content(pg, &mut buf[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
        }
        p.write_many(&pages, &buf[..pages.len() * PAGE_SIZE])
            .unwrap();
    }
    p.flush().unwrap();
    let mut order: Vec<u64> = (0..n).collect();
    fastrand::Rng::with_seed(3).shuffle(&mut order);
    let mut want = vec![0u8; PAGE_SIZE];
    for chunk in order.chunks(batch as usize) {
        p.read_many(chunk, &mut buf[..chunk.len() * PAGE_SIZE])
            .unwrap();
        for (i, &pg) in chunk.iter().enumerate() {
            content(pg, &mut want);
            assert!(
                buf[i * PAGE_SIZE..(i + 1) * PAGE_SIZE] == want[..],
                "page {pg} read back wrong"
            );
        }
    }
}

#[test]
fn hundred_thousand_pages_round_trip_through_three_servers() {
    let s = servers(3, &["--capacity", "200M"]);
    let (mut p, _dir) = pager(
        &addrs(&s),
        100_000,
        4096,
        Backing::Cluster,
        &common::client(),
    );
    write_all_then_verify(&mut p, 100_000);
    let stored: Vec<u64> = s.iter().map(|s| s.stat("stored_pages")).collect();
    assert_eq!(stored.iter().sum::<u64>(), 100_000, "{stored:?}");
    assert!(
        stored.iter().all(|&n| n > 20_000),
        "placement spreads pages: {stored:?}"
    );
    assert_eq!(p.counters().checksum_failures, 0);
    assert_eq!(p.counters().spills, 0);
}

#[test]
fn full_servers_refuse_and_pages_go_to_the_others_then_to_disk() {
    // One client may fill each server here (by default it may fill three quarters).
    let small = ServerProcess::start(&["--capacity", "200K", "--max-client-memory", "200K"]); // 50 pages
    let mut others = servers(2, &["--capacity", "400K", "--max-client-memory", "400K"]); // 100 pages each
    others.insert(0, small);
    let s = others;
    let (mut p, _dir) = pager(&addrs(&s), 400, 0, Backing::Cluster, &common::client());
    write_all_then_verify(&mut p, 400);
    assert_eq!(s[0].stat("free_pages"), 0, "the small server is full");
    assert_eq!(s.iter().map(|s| s.stat("stored_pages")).sum::<u64>(), 250);
    assert!(
        s.iter().map(|s| s.stat("puts_refused_full")).sum::<u64>() > 0,
        "FULL refusals happened"
    );
    assert_eq!(p.pages_on_disk_only(), 150);
    assert_eq!(p.counters().spills, 150);
}

#[test]
fn a_killed_server_loses_exactly_its_pages_with_cluster_backing() {
    let s = servers(3, &["--capacity", "16M"]);
    let client = ClientConfig {
        reply_timeout: Duration::from_secs(3),
        ..common::client()
    };
    let (mut p, _dir) = pager(&addrs(&s), 600, 0, Backing::Cluster, &client);
    write_all_then_verify(&mut p, 600);
    let on_victim: Vec<u64> = (0..600).filter(|&pg| p.holders(pg) == vec![1]).collect();
    assert!(
        on_victim.len() > 100,
        "{} pages on the victim",
        on_victim.len()
    );
    s[1].signal(libc::SIGKILL);

    let started = Instant::now();
    let mut lost = Vec::new();
    let mut buf = vec![0u8; PAGE_SIZE];
    let mut want = vec![0u8; PAGE_SIZE];
    for pg in 0..600 {
        match p.read(pg, &mut buf) {
            Ok(()) => {
                content(pg, &mut want);
                assert!(buf == want, "page {pg} read back wrong");
            }
            Err(PagerError::Lost(l)) => {
                assert_eq!(l.len(), 1);
                assert_eq!(l[0].server, s[1].addr, "the error names the dead server");
                let msg = PagerError::Lost(l.clone()).to_string();
                assert!(
                    msg.contains(&s[1].addr) && msg.contains(&pg.to_string()),
                    "{msg}"
                );
                lost.extend(l[0].pages.iter().copied());
            }
            Err(e) => panic!("page {pg}: unexpected error {e}"),
        }
    }
    assert_eq!(
        lost, on_victim,
        "errors for exactly the dead server's pages"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "no hang: {:?}",
        started.elapsed()
    );
    assert_eq!(p.counters().servers_dead, 1);
}

#[test]
fn a_killed_server_costs_nothing_with_cluster_disk_backing() {
    let s = servers(3, &["--capacity", "16M"]);
    let (mut p, _dir) = pager(&addrs(&s), 600, 64, Backing::ClusterDisk, &common::client());
    write_all_then_verify(&mut p, 600);
    s[2].signal(libc::SIGKILL);
    let mut buf = vec![0u8; PAGE_SIZE];
    let mut want = vec![0u8; PAGE_SIZE];
    for pg in (0..600).rev() {
        p.read(pg, &mut buf).unwrap();
        content(pg, &mut want);
        assert!(buf == want, "page {pg} read back wrong");
    }
    assert!(p.counters().disk_fallbacks > 0);
    // Writes after the death go to the survivors.
    write_all_then_verify(&mut p, 600);
    assert!(p.pages_per_server()[2] == 0);
}

/// GMS's clean pages (issue 39): a full daemon gives the frames of `cluster+disk` pages (also
/// on their owner's disk), oldest first, to another client's pages instead of refusing them,
/// and their owner reads them back from its disk.
#[test]
fn a_full_server_gives_cluster_disk_pages_frames_to_other_clients() {
    let s = [ServerProcess::start(&[
        "--capacity",
        "1600K",
        "--max-client-memory",
        "1600K",
    ])]; // 400 pages
    let (mut a, _da) = pager(&addrs(&s), 400, 0, Backing::ClusterDisk, &common::client());
    write_all_then_verify(&mut a, 400);
    assert_eq!(s[0].stat("owned_clean_pages"), 400);
    assert_eq!(s[0].stat("free_pages"), 0);
    // Client B (another node; cluster backing, its pages' only copy) finds room for all of
    // its pages.
    let other = ClientConfig {
        security: netram_client::security(Some(&common::node_dir(601)), false).unwrap(),
        ..ClientConfig::new()
    };
    let (mut b, _db) = pager(&addrs(&s), 300, 0, Backing::Cluster, &other);
    write_all_then_verify(&mut b, 300);
    assert_eq!(b.counters().spills, 0, "B's pages went to the server");
    assert_eq!(s[0].stat("clean_owned_dropped"), 300);
    assert_eq!(s[0].stat("puts_refused_full"), 0);
    // A's pages all read back right: the 300 dropped from its disk.
    let fallbacks = a.counters().disk_fallbacks;
    let mut buf = vec![0u8; PAGE_SIZE];
    let mut want = vec![0u8; PAGE_SIZE];
    for pg in 0..400 {
        a.read(pg, &mut buf).unwrap();
        content(pg, &mut want);
        assert!(buf == want, "page {pg} of A read back wrong");
    }
    assert_eq!(a.counters().disk_fallbacks - fallbacks, 300);
    assert_eq!(a.counters().clean_copies_dropped, 300);
    assert_eq!(s[0].stat("owned_clean_pages"), 100);
}

#[test]
fn a_hung_server_times_out_instead_of_hanging_the_client() {
    let s = servers(2, &["--capacity", "4M"]);
    let client = ClientConfig {
        reply_timeout: Duration::from_millis(800),
        ..common::client()
    };
    let (mut p, _dir) = pager(&addrs(&s), 100, 0, Backing::Cluster, &client);
    write_all_then_verify(&mut p, 100);
    let victim = (0..100)
        .find(|&pg| p.holders(pg) == vec![0])
        .expect("a page on server 0");
    s[0].signal(libc::SIGSTOP);
    s[0].wait_stopped();
    let started = Instant::now();
    let mut buf = vec![0u8; PAGE_SIZE];
    let err = p.read(victim, &mut buf).unwrap_err();
    s[0].signal(libc::SIGCONT);
    assert!(err.to_string().contains("no reply within 800 ms"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_crashed_clients_pages_are_freed_when_its_lease_runs_out() {
    let s = ServerProcess::start(&["--capacity", "4M", "--lease-period", "300ms"]);
    // A client whose connection's end says nothing (its machine died, the network was cut):
    // only the lease frees its pages.
    let silent = ClientConfig {
        end_on_close: false,
        ..common::client()
    };
    let (mut p, _dir) = pager(
        std::slice::from_ref(&s.addr),
        50,
        0,
        Backing::Cluster,
        &silent,
    );
    write_all_then_verify(&mut p, 50);
    std::thread::sleep(Duration::from_millis(1500)); // idle for five periods: the keepalive holds it
    assert_eq!(s.stat("stored_pages"), 50, "an idle client keeps its pages");
    drop(p); // a crash: no CLOSE, the keepalive stops
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.stat("stored_pages") > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(s.stat("stored_pages"), 0);
    assert_eq!(s.stat("sessions_expired"), 1);
    assert_eq!(s.stat("pages_freed_with_session"), 50);
}

#[test]
fn an_exited_clients_pages_are_freed_when_its_connection_closes() {
    // A lease far longer than the test: only the connection's end can free the pages.
    let s = ServerProcess::start(&["--capacity", "4M", "--lease-period", "60s"]);
    let (mut p, _dir) = pager(
        std::slice::from_ref(&s.addr),
        50,
        0,
        Backing::Cluster,
        &common::client(),
    );
    write_all_then_verify(&mut p, 50);
    assert_eq!(s.stat("stored_pages"), 50);
    drop(p); // the process is gone: its sockets close, no CLOSE is sent
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.stat("stored_pages") > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.stat("stored_pages"), 0);
    assert_eq!(s.stat("pages_freed_with_session"), 50);
    assert_eq!(s.stat("sessions_expired"), 0);
    // The one left is the session of the query asking.
    assert_eq!(s.stat("live_sessions"), 1);
}

#[test]
fn a_restarted_client_supersedes_its_old_incarnation() {
    let s = ServerProcess::start(&["--capacity", "4M", "--lease-period", "10s"]);
    // Its end went unseen (a crash), so only the new incarnation can free its pages early.
    let first = ClientConfig {
        end_on_close: false,
        ..common::client_node(77)
    };
    let (mut p, _dir) = pager(
        std::slice::from_ref(&s.addr),
        50,
        0,
        Backing::Cluster,
        &first,
    );
    write_all_then_verify(&mut p, 50);
    drop(p);
    std::thread::sleep(Duration::from_millis(5));
    // The same machine, booted again: a new incarnation. Its old pages are dead at once, long
    // before their lease (30 s) would have run out.
    let second = common::client_node(77);
    assert!(second.incarnation > first.incarnation);
    let (mut p, _dir2) = pager(
        std::slice::from_ref(&s.addr),
        50,
        0,
        Backing::Cluster,
        &second,
    );
    assert_eq!(s.stat("sessions_superseded"), 1);
    assert_eq!(s.stat("stored_pages"), 0);
    write_all_then_verify(&mut p, 50);
    // The old incarnation, back from the dead, is refused.
    let (zombie, _dir3) = pager(
        std::slice::from_ref(&s.addr),
        1,
        0,
        Backing::Cluster,
        &first,
    );
    assert!(zombie.servers().all(|(_, alive)| !alive));
    assert_eq!(s.stat("handshakes_refused_stale_incarnation"), 1);
}

#[test]
fn malformed_frames_close_one_connection_and_the_daemon_serves_on() {
    // In clear TCP: the frames behind TLS's records are checked the same way, and here they
    // are written byte by byte.
    let s = ServerProcess::start(&["--insecure", "--capacity", "4M"]);
    let (mut good, _dir) = pager(
        std::slice::from_ref(&s.addr),
        10,
        0,
        Backing::Cluster,
        &netram_client::ClientConfig::new(),
    );
    write_all_then_verify(&mut good, 10);
    let evil = |bytes: &[u8]| {
        let mut c = TcpStream::connect(&s.addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(&Hello::new(fastrand::u64(..), 1, 1).encode())
            .unwrap();
        let mut w = [0u8; WELCOME_LEN];
        c.read_exact(&mut w).unwrap();
        c.write_all(bytes).unwrap();
        let _ = c.read_to_end(&mut Vec::new()); // returns when the server closes
    };
    evil(&(64u32 << 20).to_le_bytes()); // oversized
    let mut f = Vec::new();
    Request::Stats.encode(1, &mut f);
    f[4] = 9; // wrong frame version
    evil(&f);
    f[4] = netram_proto::FRAME_VERSION;
    f[5] = 0x77; // unknown kind
    evil(&f);
    let mut f = Vec::new();
    Request::Get(vec![netram_proto::PageKey::new(0, 1)]).encode(1, &mut f);
    f.truncate(f.len() - 3);
    let len = (f.len() - 4) as u32;
    f[..4].copy_from_slice(&len.to_le_bytes()); // a batch cut short
    evil(&f);
    // Half a frame, then the peer vanishes.
    let mut c = TcpStream::connect(&s.addr).unwrap();
    c.write_all(&Hello::new(fastrand::u64(..), 1, 1).encode())
        .unwrap();
    c.read_exact(&mut [0u8; WELCOME_LEN]).unwrap();
    c.write_all(&[200, 0, 0, 0, 1, 2]).unwrap();
    drop(c);
    // A wrong protocol version in the handshake.
    let mut c = TcpStream::connect(&s.addr).unwrap();
    let mut hello = Hello::new(1, 1, 1);
    hello.version = 99;
    c.write_all(&hello.encode()).unwrap();
    let mut w = [0u8; WELCOME_LEN];
    c.read_exact(&mut w).unwrap();
    let w = netram_proto::Welcome::decode(&w).unwrap();
    assert_eq!(w.status, netram_proto::WelcomeStatus::VersionUnsupported);

    let deadline = Instant::now() + Duration::from_secs(5);
    while s.stat("frames_truncated_at_close") == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(s.stat("frames_rejected_bad_length"), 1);
    assert_eq!(s.stat("frames_rejected_bad_version"), 1);
    assert_eq!(s.stat("frames_rejected_unknown_kind"), 1);
    assert_eq!(s.stat("frames_rejected_malformed"), 1);
    assert_eq!(s.stat("frames_truncated_at_close"), 1);
    assert_eq!(s.stat("handshakes_bad_version"), 1);
    // The well-behaved client never noticed.
    write_all_then_verify(&mut good, 10);
}

#[test]
fn sigterm_stops_the_daemon_cleanly() {
    let mut s = ServerProcess::start(&["--capacity", "1M"]);
    s.signal(libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            assert!(status.success(), "exit status {status}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "netram serve did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn config_file_and_flags() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("netram.toml");
    std::fs::write(
        &path,
        "capacity = \"1M\"\nlease_period = \"500ms\"\nwindow = 8\n",
    )
    .unwrap();
    let s = ServerProcess::start(&["--config", path.to_str().unwrap()]);
    assert_eq!(s.stat("capacity_pages"), 256);
    // A flag overrides the file.
    let s = ServerProcess::start(&["--config", path.to_str().unwrap(), "--capacity", "2M"]);
    assert_eq!(s.stat("capacity_pages"), 512);

    let run = |args: &[&str]| common::netram().args(args).output().unwrap();
    let bad = run(&["serve", "--capacity", "lots"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("capacity \"lots\" is not a size"));
    std::fs::write(&path, "capacity = \"1M\"\nbogus = 1\n").unwrap();
    let bad = run(&["serve", "--config", path.to_str().unwrap()]);
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("bogus"),
        "unknown keys are named"
    );
    let bad = run(&["stats", "127.0.0.1:1", "--timeout", "1s"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("cannot reach 127.0.0.1:1"));
    let help = run(&["serve", "--help"]);
    assert!(String::from_utf8_lossy(&help.stdout).contains("three lease periods"));
}

/// The documented configuration (`dist/netram.toml`, which the systemd unit and the README
/// use) holds every option the daemon takes and passes `--check-config` as shipped.
#[test]
fn the_shipped_config_file_checks_and_names_every_option() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../dist/netram.toml");
    let out = common::netram()
        .args(["serve", "--config", path, "--check-config"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("seeds = [10.0.0.2:7077, 10.0.0.3:7077]"),
        "{text}"
    );
    assert!(text.contains("advertise = 10.0.0.1:7077"), "{text}");
    // Every key the daemon reads is in the shipped file (set or commented out).
    let help = common::netram().args(["serve", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    let keys = help
        .split("A TOML file with any of:")
        .nth(1)
        .and_then(|s| s.split("\n\n").next())
        .expect("the --config help lists the keys");
    let file = std::fs::read_to_string(path).unwrap();
    for key in keys.split(',').map(|k| k.trim()).filter(|k| !k.is_empty()) {
        let key = key.split_whitespace().last().unwrap();
        assert!(
            file.lines()
                .any(|l| l.trim_start_matches("# ").starts_with(&format!("{key} ="))),
            "{key} is not in dist/netram.toml"
        );
    }
}
