//! A region's background recovery (Nswap §IV-B3): a region on three in-process page servers
//! with two copies of every page; one server stops, and the region's handler (running the
//! schedule `netram_region_create` and `netram run` start) finds it dead and rebuilds the lost
//! copies while the region stays in use. A second server stopping afterwards loses nothing,
//! which it would without the rebuild.

use netram_capi::{region_from, start_maintenance};
use netram_client::env::RunEnv;
use netram_client::maintain::MaintainConfig;
use netram_server::{Server, ServerConfig};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

const PAGE: usize = 4096;
const PAGES: usize = 2048;

fn pattern(page: usize) -> u8 {
    (page as u8).wrapping_mul(31) ^ 0x5a
}

#[test]
fn a_regions_lost_copies_are_rebuilt_in_the_background() {
    // A cluster of its own (`netram cluster init`'s work): the servers and the region
    // authenticate with it.
    let tls = tempfile::tempdir().unwrap();
    netram_net::pki::init_cluster(tls.path(), tls.path()).unwrap();
    let creds = Arc::new(netram_net::Credentials::load(tls.path()).unwrap());
    let mut servers: Vec<Option<Server>> = (0..3)
        .map(|i| {
            let cfg = ServerConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                capacity_bytes: 64 << 20,
                node: i + 1,
                security: netram_net::Security::Tls(creds.clone()),
                ..Default::default()
            };
            Some(Server::start(cfg, Arc::new(AtomicBool::new(false))).unwrap())
        })
        .collect();
    let addrs: Vec<String> = servers
        .iter()
        .map(|s| s.as_ref().unwrap().addr().to_string())
        .collect();
    let heap = region_from(
        Some(&addrs.join(",")),
        Some("cluster"),
        (PAGES * PAGE) as u64,
        (128 * PAGE) as u64,
        "mirror:2".parse().unwrap(),
        &RunEnv {
            tls: Some(tls.path().to_path_buf()),
            ..RunEnv::default()
        },
    )
    .unwrap();
    let base = heap.region().as_ptr().cast::<u8>();
    let page = |i: usize| {
        // SAFETY: page `i` of the region, which is `PAGES` pages long and lives as long as
        // `heap`; this thread is the only one touching it.
        unsafe { std::slice::from_raw_parts_mut(base.add(i * PAGE), PAGE) }
    };
    // Sixteen times the budget: most pages go out to the servers, two copies each.
    for i in 0..PAGES {
        page(i).fill(pattern(i));
    }
    let on = heap.region().with_pager(|p| p.pages_per_server());
    assert!(on.iter().sum::<u64>() > PAGES as u64, "{on:?}");
    let maintenance = start_maintenance(
        &heap,
        MaintainConfig {
            probe_every: Duration::from_millis(100),
            reconnect_every: Duration::from_millis(100),
            ..Default::default()
        },
    );
    servers[0].take().unwrap().stop();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (dead, degraded, rebuilt) = heap.region().with_pager(|p| {
            (
                p.counters().servers_dead,
                p.degraded_pages(),
                p.counters().pages_rebuilt,
            )
        });
        if dead > 0 && degraded == 0 {
            assert!(rebuilt > 0, "nothing rebuilt");
            break;
        }
        assert!(Instant::now() < deadline, "recovery did not finish");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Every page out on the servers has two copies again, on the two left: one more may go.
    servers[1].take().unwrap().stop();
    for i in 0..PAGES {
        assert!(
            page(i).iter().all(|&b| b == pattern(i)),
            "page {i} is wrong after the second server stopped"
        );
    }
    drop(maintenance);
    drop(heap);
    for s in servers.into_iter().flatten() {
        s.stop();
    }
}
