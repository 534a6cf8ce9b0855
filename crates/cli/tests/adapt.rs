//! `netram serve --adapt` (issue "Every node a peer"): the offer follows the machine's memory,
//! read here from a directory of files standing in for /proc so that the test decides what the
//! machine looks like; the daemon is a real process, its pages come from a real pager over TLS,
//! and the memory it stops offering must leave its resident set.

mod common;

use common::{eventually, vm_rss, ServerProcess};
use netram_pager::{MemDisk, Pager, PagerConfig};
use netram_proto::PAGE_SIZE;
use std::path::Path;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// A /proc stand-in: `meminfo` with a 24 GiB machine and `available` bytes available, and no
/// memory pressure.
fn machine(dir: &Path, available: u64) {
    std::fs::create_dir_all(dir.join("pressure")).unwrap();
    let meminfo = format!(
        "MemTotal:       25165824 kB\nMemFree:        {0} kB\nMemAvailable:   {0} kB\n",
        available / 1024
    );
    // Written whole and renamed, so that the daemon never reads half a file.
    let tmp = dir.join("meminfo.tmp");
    std::fs::write(&tmp, meminfo).unwrap();
    std::fs::rename(&tmp, dir.join("meminfo")).unwrap();
    std::fs::write(
        dir.join("pressure/memory"),
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    )
    .unwrap();
}

/// The offer grows a chunk at a time while the machine has room, takes pages, and when the
/// machine needs its memory the offer shrinks and the daemon's resident memory falls by what
/// it held in the frames given back; then it grows again.
#[test]
fn the_offer_follows_the_machine_and_memory_given_back_leaves_the_process() {
    let proc_dir = tempfile::tempdir().unwrap();
    machine(proc_dir.path(), 20 << 30);
    let server = ServerProcess::start(&[
        "--capacity",
        "512M",
        "--adapt",
        "--reserve",
        "1G",
        "--chunk",
        "64M",
        "--grow-after",
        "100ms",
        "--proc-dir",
        proc_dir.path().to_str().unwrap(),
    ]);
    let pages = |bytes: u64| bytes / PAGE_SIZE as u64;
    assert!(
        server.stat("capacity_pages") < pages(512 * MIB),
        "it starts at the floor"
    );
    eventually("the offer grows to --capacity", 30, || {
        server.stat("capacity_pages") == pages(512 * MIB)
    });
    assert!(server.stat("offer_grows") >= 8, "a chunk at a time");

    // 256 MiB of pages from a real pager.
    let base = vm_rss(server.child.id());
    let n = pages(256 * MIB);
    let transport = netram_client::TcpTransport::connect(
        &[server.addr.as_str()],
        &netram_client::ClientConfig {
            sealed_pages: true,
            ..common::client()
        },
    );
    let mut pager = Pager::new(
        PagerConfig {
            pages: n,
            cache_pages: 64,
            ..Default::default()
        },
        transport,
        MemDisk::default(),
    );
    let batch: Vec<u64> = (0..1024).collect();
    let data = vec![0x5au8; 1024 * PAGE_SIZE];
    for first in (0..n).step_by(1024) {
        let ids: Vec<u64> = batch.iter().map(|i| first + i).collect();
        pager.write_many(&ids, &data).unwrap();
    }
    pager.flush().unwrap();
    assert!(server.stat("stored_pages") >= n - 64);
    let full = vm_rss(server.child.id());
    assert!(
        full >= base + 200 * MIB,
        "the pages are resident ({} MiB, {} MiB before)",
        full >> 20,
        base >> 20
    );
    // The client goes away: its frames are free but still resident.
    drop(pager);
    eventually("the client's pages are freed", 20, || {
        server.stat("stored_pages") == 0
    });

    // The machine needs its memory: 1 GiB available, a 1 GiB reserve. With the whole offer
    // promised the machine would be 512 MiB short: the offer shrinks to nothing, and the
    // frames given back (the 256 MiB that held pages among them) leave the process.
    machine(proc_dir.path(), 1 << 30);
    eventually("the offer shrinks", 20, || {
        server.stat("capacity_pages") == 0
    });
    eventually("the memory given back leaves the process", 20, || {
        vm_rss(server.child.id()) + 200 * MIB <= full
    });
    assert!(server.stat("offer_shrinks") >= 1);

    // Room again: it grows back.
    machine(proc_dir.path(), 20 << 30);
    eventually("the offer grows back", 30, || {
        server.stat("capacity_pages") == pages(512 * MIB)
    });
}

/// What page `i` holds in [`pages_leave_a_donor_that_shrinks_for_another_server`].
fn content(i: u64) -> Vec<u8> {
    let mut d = vec![(i % 251) as u8; PAGE_SIZE];
    d[..8].copy_from_slice(&i.to_le_bytes());
    d
}

/// A `netram serve --adapt` offering `capacity` on a roomy stand-in machine, once it offers
/// all of it.
fn start_donor(proc_dir: &Path, capacity: u64) -> ServerProcess {
    start_donor_seeded(proc_dir, capacity, None)
}

/// [`start_donor`], a member of `seed`'s cluster once it knows it (a server hands pages over
/// only to a member of its cluster).
fn start_donor_seeded(proc_dir: &Path, capacity: u64, seed: Option<&str>) -> ServerProcess {
    machine(proc_dir, 20 << 30);
    let cap = format!("{}M", capacity / MIB);
    let mut args = vec![
        "--capacity",
        &cap,
        "--adapt",
        "--reserve",
        "1G",
        "--chunk",
        "64M",
        "--grow-after",
        "100ms",
        "--proc-dir",
        proc_dir.to_str().unwrap(),
    ];
    // Its own node id: two daemons under one identity are one member.
    let dir = common::node_dir(7_001);
    if let Some(seed) = seed {
        args.extend(["--seed", seed, "--tls", dir.to_str().unwrap()]);
    }
    let donor = ServerProcess::start(&args);
    eventually("the donor offers all it may", 30, || {
        donor.stat("capacity_pages") == capacity / PAGE_SIZE as u64
    });
    if seed.is_some() {
        eventually("the donor knows its cluster", 30, || {
            donor.stat("other_members_alive") >= 1
        });
    }
    donor
}

/// A real pager over TLS to `servers`, probing every 50 ms, its `n` pages written (each with
/// its [`content`]) and flushed.
fn filled_pager(
    servers: &[&str],
    n: u64,
    scheme: &str,
) -> Pager<netram_client::TcpTransport, MemDisk> {
    let transport = netram_client::TcpTransport::connect(
        servers,
        &netram_client::ClientConfig {
            sealed_pages: true,
            ..common::client()
        },
    );
    let mut pager = Pager::new(
        PagerConfig {
            pages: n,
            cache_pages: 64,
            redundancy: scheme.parse().unwrap(),
            ..Default::default()
        },
        transport,
        MemDisk::default(),
    );
    pager.set_schedule(netram_pager::ScheduleConfig {
        probe_every_us: 50_000,
        ..Default::default()
    });
    for first in (0..n).step_by(256) {
        let ids: Vec<u64> = (first..first + 256).collect();
        let data: Vec<u8> = ids.iter().flat_map(|&i| content(i)).collect();
        pager.write_many(&ids, &data).unwrap();
    }
    pager.flush().unwrap();
    pager
}

/// Every one of the pager's `n` pages reads back as [`filled_pager`] wrote it.
fn verify(pager: &mut Pager<netram_client::TcpTransport, MemDisk>, n: u64, when: &str) {
    let mut out = vec![0u8; 256 * PAGE_SIZE];
    for first in (0..n).step_by(256) {
        let ids: Vec<u64> = (first..first + 256).collect();
        pager.read_many(&ids, &mut out).unwrap();
        for (k, &i) in ids.iter().enumerate() {
            assert!(
                out[k * PAGE_SIZE..(k + 1) * PAGE_SIZE] == content(i)[..],
                "page {i} {when}"
            );
        }
    }
}

/// Nswap's migration, between real daemons: a donor holding pages of a client shrinks its
/// offer to nothing when its machine needs the memory; the client (a real pager over TLS,
/// ticked as its maintenance thread would) moves them to the other server; the donor ends up
/// holding nothing, its resident memory falls, and every page reads back as written.
///
/// The moves pause halfway for longer than the other server's idle timeout (the owner busy
/// elsewhere), which closes the donor's idle connection to it: the next handover opens
/// another, and every page still goes server to server. (A stale connection failed the next
/// handover, after which the owner moved the rest itself: `netram bench adapt` found it.)
#[test]
fn pages_leave_a_donor_that_shrinks_for_another_server() {
    let proc_dir = tempfile::tempdir().unwrap();
    let other = ServerProcess::start(&["--capacity", "512M", "--idle-timeout", "2s"]);
    let donor = start_donor_seeded(proc_dir.path(), 256 * MIB, Some(&other.addr));
    eventually("the other server knows the donor", 30, || {
        other.stat("other_members_alive") >= 1
    });
    let frames = |bytes: u64| bytes / PAGE_SIZE as u64;
    let n = frames(192 * MIB);
    let mut pager = filled_pager(&[donor.addr.as_str(), other.addr.as_str()], n, "none");
    let held = donor.stat("stored_pages");
    assert!(
        held > frames(32 * MIB),
        "the donor took its share ({held} pages)"
    );
    let full = vm_rss(donor.child.id());

    // The machine needs its memory: 512 MiB available, half its reserve. The offer falls to
    // nothing, and the pages it holds have to go. The pager learns it from its next probe
    // and moves them, step by step.
    machine(proc_dir.path(), 512 * MIB);
    eventually("the offer shrinks", 20, || {
        donor.stat("capacity_pages") == 0
    });
    let started = std::time::Instant::now();
    let mut now_us = 0;
    eventually("some pages moved server to server", 60, || {
        now_us += 10_000;
        pager.on_tick(now_us).unwrap();
        pager.counters().pages_migrated_direct > 0
    });
    // The pause: the pager's own connections kept alive (a live client refreshes its
    // sessions), the donor's to the other server left idle.
    let paused = std::time::Instant::now();
    while paused.elapsed() < Duration::from_millis(3000) {
        pager.probe_servers().unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        pager.pages_leaving() > 0,
        "pages are left to move after the pause"
    );
    eventually("the donor holds nothing", 60, || {
        // A tick as the maintenance thread runs them; the server is asked again only after
        // the pager thinks it is done.
        now_us += 10_000;
        pager.on_tick(now_us).unwrap();
        pager.pages_leaving() == 0 && donor.stat("stored_pages") == 0
    });
    eprintln!(
        "{held} pages moved off the donor in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        pager.counters().pages_migrated,
        held,
        "each page moved once"
    );
    assert_eq!(pager.counters().pages_migrated_to_disk, 0);
    assert_eq!(
        pager.counters().pages_migrated_direct,
        held,
        "server to server, the two being members of one cluster"
    );
    assert_eq!(
        other.stat("stored_pages"),
        n,
        "the other server holds every page"
    );
    eventually("the memory given back leaves the donor", 20, || {
        vm_rss(donor.child.id()) + held * PAGE_SIZE as u64 * 9 / 10 <= full
    });
    verify(&mut pager, n, "after the move");
}

/// A real program under `netram run` whose pages a donor gives back while the program is
/// idle (waiting on its stdin): no fault happens, the region's handler moves them by its own
/// schedule (server to server), and the program finds every object intact afterwards.
#[test]
fn a_program_under_netram_run_keeps_its_memory_while_a_donor_gives_it_back() {
    if !netram_testkit::have_tools(&[("python3", "python3")]) {
        return;
    }
    let proc_dir = tempfile::tempdir().unwrap();
    let other = ServerProcess::start(&["--capacity", "256M"]);
    let donor = start_donor_seeded(proc_dir.path(), 256 * MIB, Some(&other.addr));
    eventually("the other server knows the donor", 30, || {
        other.stat("other_members_alive") >= 1
    });
    let rep = proc_dir.path().join("report.json");
    // 48 MiB of 4 KiB objects, each with its own contents, checked after the move.
    let script = "import sys\n\
                  data = [bytes([i % 251]) * 4096 for i in range(12288)]\n\
                  print('filled', flush=True)\n\
                  sys.stdin.readline()\n\
                  ok = all(d == bytes([i % 251]) * 4096 for i, d in enumerate(data))\n\
                  print('checked' if ok else 'wrong', flush=True)\n";
    let mut run = common::netram_env(std::process::Command::new("timeout"))
        .args(["120", common::NETRAM, "run", "--local-mem", "8M"])
        .args(["--servers", &format!("{},{}", donor.addr, other.addr)])
        .args([
            "--report",
            rep.to_str().unwrap(),
            "--",
            "python3",
            "-c",
            script,
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(run.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line, "filled\n", "the program filled its memory");
    let held = donor.stat("stored_pages");
    assert!(held > 1000, "the donor took its share ({held} pages)");
    machine(proc_dir.path(), 512 * MIB);
    eventually("the donor holds nothing", 60, || {
        donor.stat("stored_pages") == 0
    });
    std::io::Write::write_all(&mut run.stdin.take().unwrap(), b"go\n").unwrap();
    let out = run.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    line.clear();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line, "checked\n", "every object read back right: {err}");
    assert!(out.status.success(), "{err}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&rep).unwrap()).unwrap();
    let n = |k: &str| report[k].as_u64().unwrap_or(0);
    assert!(n("pages_migrated") >= held, "{held} pages moved: {report}");
    assert_eq!(n("servers_dead"), 0, "{report}");
}

/// The same under `parity:2`, where the donor holds groups' parity besides pages: three real
/// daemons forwarding deltas to each other. The pages leave through their owner (written
/// again, joining groups away from the donor), and the parity the donor holds leaves as the
/// owner, asking the donor which groups those are, writes their members again where they are:
/// the donor ends up holding nothing at all, and every page reads back, also after another
/// server dies.
#[test]
fn parity_held_by_a_donor_that_shrinks_leaves_with_its_pages() {
    redundancy_leaves_a_donor_that_shrinks("parity:2", 2);
}

/// The same under `rs:2+1`: the donor's pieces leave as their stripes' members are written
/// again into stripes away from it.
#[test]
fn stripe_pieces_on_a_donor_that_shrinks_leave_with_their_stripes() {
    redundancy_leaves_a_donor_that_shrinks("rs:2+1", 3);
}

/// A donor and `others` servers; the pager, under `scheme`, fills them, the donor's machine
/// needs its memory, and the pager's ticks alone must empty the donor.
fn redundancy_leaves_a_donor_that_shrinks(scheme: &str, others: usize) {
    let proc_dir = tempfile::tempdir().unwrap();
    let donor = start_donor(proc_dir.path(), 64 * MIB);
    let others: Vec<ServerProcess> = (0..others)
        .map(|_| ServerProcess::start(&["--capacity", "128M"]))
        .collect();
    let n = 48 * MIB / PAGE_SIZE as u64;
    let servers: Vec<&str> = std::iter::once(donor.addr.as_str())
        .chain(others.iter().map(|o| o.addr.as_str()))
        .collect();
    let mut pager = filled_pager(&servers, n, scheme);
    let held = donor.stat("stored_pages");
    assert!(held > 0, "{scheme}: the donor took its share");

    machine(proc_dir.path(), 512 * MIB);
    eventually("the offer shrinks", 20, || {
        donor.stat("capacity_pages") == 0
    });
    let mut now_us = 0;
    eventually("the donor holds nothing, parity included", 90, || {
        now_us += 10_000;
        pager.on_tick(now_us).unwrap();
        pager.pages_leaving() == 0 && donor.stat("stored_pages") == 0
    });
    pager.flush().unwrap();
    let c = pager.counters();
    if scheme.starts_with("parity") {
        assert!(c.parity_groups_leaving > 0, "{c:?}");
    }
    assert_eq!(c.pages_migrated_to_disk, 0, "{scheme}");
    assert_eq!(pager.pages_per_server()[0], 0, "{scheme}");
    verify(&mut pager, n, &format!("after the move ({scheme})"));
    // Still protected by their new groups: one of the other servers dies (SIGKILL), and every
    // page is rebuilt from its group's parity and the survivors.
    others[0].signal(libc::SIGKILL);
    verify(&mut pager, n, &format!("after a server died ({scheme})"));
}

/// Contradictory settings are refused before anything starts.
#[test]
fn adapt_settings_are_checked() {
    let proc_dir = tempfile::tempdir().unwrap();
    machine(proc_dir.path(), 20 << 30);
    let dir = proc_dir.path().to_str().unwrap();
    for (args, says) in [
        (
            vec!["--adapt", "--offer-floor", "1G", "--capacity", "512M"],
            "above the ceiling",
        ),
        (vec!["--reserve", "1G"], "--reserve is for --adapt"),
        (vec!["--adapt", "--chunk", "1000"], "4 KiB"),
        (vec!["--adapt", "--lock-memory"], "choose one"),
    ] {
        let out = common::netram()
            .args(["serve", "--listen", "127.0.0.1:0", "--proc-dir", dir])
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// `netram serve --check-config` prints what would run, from flags and file, after checking
/// the credentials, and refuses what the daemon would refuse, without serving.
#[test]
fn check_config_prints_what_would_run() {
    let proc_dir = tempfile::tempdir().unwrap();
    machine(proc_dir.path(), 20 << 30);
    let conf = proc_dir.path().join("netram.toml");
    std::fs::write(&conf, "capacity = \"1G\"\nadapt = true\nreserve = \"2G\"\n").unwrap();
    let out = common::netram()
        .args([
            "serve",
            "--check-config",
            "--max-client-ops",
            "5000",
            "--config",
        ])
        .arg(&conf)
        .arg("--proc-dir")
        .arg(proc_dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "security = mutual TLS, node 1",
        "capacity = 1073741824 bytes",
        "max_client_ops = 5000/s",
        "adapt = from 0 to 1073741824 bytes in 67108864-byte chunks, keeping 2147483648 bytes",
    ] {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }
    let out = std::process::Command::new(common::NETRAM)
        .args([
            "serve",
            "--check-config",
            "--insecure",
            "--listen",
            "0.0.0.0:7077",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("loopback only"));
}
