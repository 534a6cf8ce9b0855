//! A Rust program whose large allocations live on a region, through the global allocator
//! adapter: a vector four times the local budget is filled, sorted and checked.

use netram_client::TcpTransport;
use netram_cluster::LocalCluster;
use netram_pager::{MemDisk, Pager, PagerConfig};
use netram_uffd::{NetramAlloc, Region, RegionHeap};

#[global_allocator]
static ALLOC: NetramAlloc<TcpTransport, MemDisk> = NetramAlloc::new(1 << 20);

#[test]
fn large_allocations_live_on_the_region() {
    let cluster = LocalCluster::start(2, 64 << 20, false).unwrap();
    let t = TcpTransport::connect(&cluster.addrs(), &cluster.client());
    let size = 64 << 20;
    let cfg = PagerConfig {
        pages: (size / 4096) as u64,
        cache_pages: 64,
        ..Default::default()
    };
    let region = Region::new(Pager::new(cfg, t, MemDisk::default()), size, 4 << 20).unwrap();
    assert!(ALLOC.install(RegionHeap::new(region)).is_ok());
    let heap = ALLOC.heap().unwrap();

    let n = (16 << 20) / 8;
    let mut v: Vec<u64> = (0..n as u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    assert!(
        heap.contains(v.as_ptr().cast()),
        "the vector is on the region"
    );
    let small = vec![1u8; 1000];
    assert!(
        !heap.contains(small.as_ptr()),
        "small allocations stay with the system"
    );
    v.sort_unstable();
    assert!(v.windows(2).all(|w| w[0] <= w[1]));
    let c = heap.region().counters();
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert!(get(&c.evictions) > 2000, "{c:?}");
    assert!(get(&c.fetches) > 1000, "{c:?}");
    assert!(heap.region().resident_pages() <= 1024);
    drop(v);
    assert_eq!(heap.allocated(), 0);
    // Freed pages leave their servers: at once, or those whose write-back was still out
    // within a turn or two of the handler's loop after it is in (a free never waits).
    let since = std::time::Instant::now();
    loop {
        heap.region().with_pager(|p| p.flush()).unwrap();
        let stored: u64 = (0..2).map(|s| cluster.stat(s, "stored_pages")).sum();
        if stored == 0 {
            break;
        }
        assert!(
            since.elapsed() < std::time::Duration::from_secs(10),
            "{stored} freed pages still on the servers: {:?}",
            heap.region().counters()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
