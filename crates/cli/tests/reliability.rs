//! Pages survive server crashes, with real processes: five `netram serve` processes, a client
//! writing and reading continuously with a redundancy scheme, servers SIGKILLed in the middle
//! (as many as the scheme tolerates) and restarted empty on the same address; every
//! acknowledged page verifies throughout and afterwards, and the redundancy is whole again once
//! the background recovery has run. Each scheme is run with two timings of the kills. Every
//! server process is killed by its PID when its guard drops, also when a test fails.

use netram_client::maintain::{self, MaintainConfig};
use netram_client::open::{open_pager, ClientPager, OpenOptions};
use netram_pager::{Backing, Scheme};
use netram_proto::PAGE_SIZE;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::ServerProcess;

mod common;

const SERVERS: usize = 5;
const PAGES: u64 = 3_000;
const ROUNDS: u32 = 600;

fn content(page: u64, tag: u64, out: &mut [u8]) {
    let mut rng = fastrand::Rng::with_seed(page.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ tag);
    for c in out.chunks_exact_mut(8) {
        c.copy_from_slice(&rng.u64(..).to_le_bytes());
    }
}

fn lock(p: &Mutex<ClientPager>) -> std::sync::MutexGuard<'_, ClientPager> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// Writes and reads random pages for `ROUNDS` rounds, SIGKILLing the servers in `kills` at
/// their rounds (and restarting each, empty, on its address a few rounds later); then waits
/// for recovery and checks every page and the redundancy.
fn survive(scheme: &str, kills: &[(u32, usize)]) {
    let scheme: Scheme = scheme.parse().unwrap();
    let mut servers: Vec<ServerProcess> = (0..SERVERS)
        .map(|_| ServerProcess::start_restartable(&["--capacity", "64M"]))
        .collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let spill = tempfile::tempdir().unwrap();
    let pager = open_pager(&OpenOptions {
        security: common::security(),
        servers: addrs.clone(),
        backing: Backing::Cluster,
        pages: PAGES,
        cache_pages: 0,
        spill_dir: Some(spill.path().to_path_buf()),
        low_latency: false,
        redundancy: scheme,
    })
    .unwrap();
    let pager = Arc::new(Mutex::new(pager));
    let _maintenance = {
        let pager = pager.clone();
        maintain::spawn(
            move |f| f(&mut lock(&pager)),
            MaintainConfig {
                probe_every: Duration::from_millis(200),
                reconnect_every: Duration::from_millis(100),
                ..Default::default()
            },
        )
    };
    // What was last acknowledged for each page: its tag (0: never written).
    let mut model = vec![0u64; PAGES as usize];
    let mut rng = fastrand::Rng::with_seed(0x5eed ^ kills.len() as u64);
    let mut buf = vec![0u8; 8 * PAGE_SIZE];
    let mut want = vec![0u8; PAGE_SIZE];
    let mut tag = 0;
    let mut restarts: Vec<(u32, usize)> = Vec::new();
    for round in 0..ROUNDS {
        for &(at, victim) in kills {
            if at == round {
                servers[victim].signal(libc::SIGKILL);
                restarts.push((round + 40, victim));
            }
        }
        for &(at, victim) in &restarts {
            if at == round {
                let _ = servers[victim].child.wait();
                servers[victim] = ServerProcess::start_at(&addrs[victim], &["--capacity", "64M"]);
            }
        }
        // Write a few pages (acknowledged when write_many returns: no cache)...
        let n = rng.usize(1..=8);
        let pages: Vec<u64> = (0..n).map(|_| rng.u64(0..PAGES)).collect();
        tag += 1;
        for (i, &p) in pages.iter().enumerate() {
            content(p, tag, &mut buf[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
        }
        lock(&pager)
            .write_many(&pages, &buf[..n * PAGE_SIZE])
            .unwrap_or_else(|e| panic!("{scheme}, round {round}: write: {e}"));
        for &p in &pages {
            model[p as usize] = tag;
        }
        // ... and read a few back: none may fail, whatever died.
        let pages: Vec<u64> = (0..rng.usize(1..=8)).map(|_| rng.u64(0..PAGES)).collect();
        let n = pages.len();
        lock(&pager)
            .read_many(&pages, &mut buf[..n * PAGE_SIZE])
            .unwrap_or_else(|e| panic!("{scheme}, round {round}: read: {e}"));
        for (i, &p) in pages.iter().enumerate() {
            let got = &buf[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
            match model[p as usize] {
                0 => assert!(got.iter().all(|&b| b == 0), "{scheme}: page {p} not zero"),
                t => {
                    content(p, t, &mut want);
                    assert!(got == want, "{scheme}, round {round}: page {p} is wrong");
                }
            }
        }
    }
    // Recovery runs in the background until the redundancy is whole again.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (degraded, short, broken) = {
            let p = lock(&pager);
            let alive: Vec<bool> = p.servers().map(|(_, a)| a).collect();
            // Pages whose redundancy is not whole, with where the pager thinks they are.
            let broken: Vec<String> = (0..PAGES)
                .filter(|&pg| model[pg as usize] != 0)
                .filter(|&pg| {
                    !p.pieces(pg).is_some_and(|(pieces, needed)| {
                        pieces.len() == needed && pieces.iter().all(|&(s, _, _)| alive[s])
                    })
                })
                .map(|pg| format!("page {pg}: {:?}, {:?}", p.location(pg), p.pieces(pg)))
                .collect();
            (p.degraded_pages(), p.pages_short_of_copies(), broken)
        };
        if degraded == 0 && short == 0 && broken.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{scheme}: recovery did not finish: {degraded} degraded, {short} short, {} pages \
             not whole, first: {:?}",
            broken.len(),
            &broken[..broken.len().min(5)]
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut p = lock(&pager);
    let c = p.counters().clone();
    assert!(c.servers_dead >= kills.len() as u64, "{scheme}: {c:?}");
    assert!(c.pages_rebuilt > 0, "{scheme}: nothing was rebuilt: {c:?}");
    let mut got = vec![0u8; PAGE_SIZE];
    for pg in 0..PAGES {
        p.read(pg, &mut got)
            .unwrap_or_else(|e| panic!("{scheme}: final read of {pg}: {e}"));
        match model[pg as usize] {
            0 => assert!(got.iter().all(|&b| b == 0)),
            t => {
                content(pg, t, &mut want);
                assert!(got == want, "{scheme}: page {pg} is wrong at the end");
            }
        }
    }
    eprintln!(
        "{scheme}: kills {kills:?}: {} rebuilt, {} degraded reads, {} reads from another copy",
        c.pages_rebuilt, c.degraded_reads, c.reads_from_other_copy
    );
}

#[test]
fn two_copies_survive_a_killed_server() {
    survive("mirror:2", &[(150, 1)]);
    survive("mirror:2", &[(400, 3)]);
}

#[test]
fn three_copies_survive_two_killed_servers() {
    survive("mirror:3", &[(150, 0), (160, 2)]);
    survive("mirror:3", &[(300, 4), (420, 1)]);
}

#[test]
fn reed_solomon_3_2_survives_two_killed_servers() {
    survive("rs:3+2", &[(150, 1), (155, 4)]);
    survive("rs:3+2", &[(250, 2), (420, 0)]);
}

#[test]
fn dynamic_parity_survives_a_killed_server() {
    survive("parity:4", &[(150, 2)]);
    survive("parity:4", &[(400, 0)]);
}
