//! Why the region's heap keeps its bookkeeping outside the region (`crates/uffd/src/heap/slabs.rs`):
//! the same small-object workload on three heaps over the same kind of region — netram's
//! `RegionHeap`, talc and rlsf (TLSF), the two crates that manage memory they are given —
//! first with every page resident (the cost of an allocation), then with a local budget a
//! fifth of the heap (the faults that `free` and `malloc` themselves cause, and what is left on
//! the servers once everything is freed).
//!
//! `cargo run --release -p netram-bench --example heaps` (prints a table; nothing is written).

use netram_client::TcpTransport;
use netram_cluster::LocalCluster;
use netram_pager::{MemDisk, Pager, PagerConfig};
use netram_proto::PAGE_SIZE;
use netram_uffd::{Region, RegionCounters, RegionHeap};
use std::alloc::Layout;
use std::ptr::NonNull;
use std::time::Instant;

const REGION: usize = 256 << 20;
const OBJECTS: usize = 400_000;

type R = Region<TcpTransport, MemDisk>;

trait Heap {
    fn name(&self) -> &'static str;
    fn region(&self) -> &R;
    fn alloc(&mut self, size: usize) -> *mut u8;
    fn free(&mut self, p: *mut u8, size: usize);
}

struct Netram(RegionHeap<TcpTransport, MemDisk>);
impl Heap for Netram {
    fn name(&self) -> &'static str {
        "netram RegionHeap"
    }
    fn region(&self) -> &R {
        self.0.region()
    }
    fn alloc(&mut self, size: usize) -> *mut u8 {
        self.0.alloc(size, 16).expect("room").as_ptr()
    }
    fn free(&mut self, p: *mut u8, _: usize) {
        self.0.free(p).expect("a block");
    }
}

struct Talc(R, talc::TalcCell<talc::source::Manual>);
impl Heap for Talc {
    fn name(&self) -> &'static str {
        "talc 5"
    }
    fn region(&self) -> &R {
        &self.0
    }
    fn alloc(&mut self, size: usize) -> *mut u8 {
        use std::alloc::GlobalAlloc;
        // SAFETY: a non-zero layout.
        unsafe { self.1.alloc(Layout::from_size_align(size, 16).unwrap()) }
    }
    fn free(&mut self, p: *mut u8, size: usize) {
        use std::alloc::GlobalAlloc;
        // SAFETY: a block of this layout from this allocator.
        unsafe {
            self.1
                .dealloc(p, Layout::from_size_align(size, 16).unwrap())
        }
    }
}

struct Tlsf(R, rlsf::Tlsf<'static, u32, u32, 28, 32>);
impl Heap for Tlsf {
    fn name(&self) -> &'static str {
        "rlsf 0.2 (TLSF)"
    }
    fn region(&self) -> &R {
        &self.0
    }
    fn alloc(&mut self, size: usize) -> *mut u8 {
        self.1
            .allocate(Layout::from_size_align(size, 16).unwrap())
            .expect("room")
            .as_ptr()
    }
    fn free(&mut self, p: *mut u8, _: usize) {
        // SAFETY: a block from this allocator, aligned to 16.
        unsafe { self.1.deallocate(NonNull::new(p).unwrap(), 16) }
    }
}

fn region(cluster: &LocalCluster) -> R {
    let t = TcpTransport::connect(&cluster.addrs(), &cluster.client());
    let cfg = PagerConfig {
        pages: (REGION / PAGE_SIZE) as u64,
        cache_pages: 64,
        ..Default::default()
    };
    Region::new(Pager::new(cfg, t, MemDisk::default()), REGION, REGION).expect("a region")
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Sizes of small objects: 16 to 512 bytes.
    fn size(&mut self) -> usize {
        16 + (self.next() % 497) as usize
    }
}

fn faults(r: &R) -> u64 {
    RegionCounters::get(&r.counters().faults)
}

fn run(h: &mut dyn Heap, cluster: &LocalCluster) -> Vec<String> {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    // 1. All resident: churn on a live set of 100,000 blocks.
    let mut live: Vec<(*mut u8, usize)> = (0..100_000)
        .map(|_| {
            let s = rng.size();
            (h.alloc(s), s)
        })
        .collect();
    let ops = 2_000_000;
    let t = Instant::now();
    for _ in 0..ops {
        let i = (rng.next() % live.len() as u64) as usize;
        let (p, s) = live[i];
        h.free(p, s);
        let s = rng.size();
        live[i] = (h.alloc(s), s);
    }
    let ns = t.elapsed().as_nanos() as f64 / ops as f64;
    for (p, s) in live.drain(..) {
        h.free(p, s);
    }
    // 2. A budget of a fifth of the heap: objects written, then half freed, then as many
    //    allocated again (not written): the faults of the allocator alone.
    let mut heap_bytes = 0;
    let mut live: Vec<(*mut u8, usize)> = (0..OBJECTS)
        .map(|_| {
            let s = rng.size();
            heap_bytes += s;
            (h.alloc(s), s)
        })
        .collect();
    for &(p, s) in &live {
        // SAFETY: a block of `s` bytes.
        unsafe { std::ptr::write_bytes(p, 0xa5, s) };
    }
    h.region().set_budget(heap_bytes / 5);
    // Push the early objects out: write the last fifth again.
    for &(p, s) in &live[OBJECTS * 4 / 5..] {
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(p, 0x5a, s) };
    }
    let before = faults(h.region());
    for i in 0..OBJECTS / 2 {
        let j = (rng.next() % (live.len() - i) as u64) as usize + i;
        live.swap(i, j);
        let (p, s) = live[i];
        h.free(p, s);
    }
    let free_faults = faults(h.region()) - before;
    let before = faults(h.region());
    for slot in live.iter_mut().take(OBJECTS / 2) {
        let s = rng.size();
        *slot = (h.alloc(s), s);
    }
    let alloc_faults = faults(h.region()) - before;
    for (p, s) in live.drain(..) {
        h.free(p, s);
    }
    h.region().with_pager(|p| p.flush()).expect("flushed");
    let stored: u64 = (0..2).map(|s| cluster.stat(s, "stored_pages")).sum();
    vec![
        h.name().to_string(),
        format!("{ns:.0}"),
        format!("{free_faults}"),
        format!("{alloc_faults}"),
        format!("{stored}"),
    ]
}

fn main() {
    let cluster = LocalCluster::start(2, 512 << 20, false).expect("a local cluster");
    let mut rows = Vec::new();
    rows.push(run(
        &mut Netram(RegionHeap::new(region(&cluster))),
        &cluster,
    ));
    {
        let r = region(&cluster);
        let t = talc::TalcCell::new(talc::source::Manual);
        // SAFETY: the region's memory, given to talc alone for the region's lifetime.
        unsafe { t.claim(r.as_ptr(), r.len()).expect("claimed") };
        rows.push(run(&mut Talc(r, t), &cluster));
    }
    {
        let r = region(&cluster);
        let mut t = rlsf::Tlsf::new();
        // SAFETY: as above.
        unsafe {
            t.insert_free_block_ptr(
                NonNull::new(std::ptr::slice_from_raw_parts_mut(r.as_ptr(), r.len())).unwrap(),
            )
        };
        rows.push(run(&mut Tlsf(r, t), &cluster));
    }
    println!(
        "{OBJECTS} objects of 16-512 B on a {} MiB region, budget a fifth of them; 2 servers on \
         loopback; {}",
        REGION >> 20,
        netram_bench::machine::Machine::describe().one_line()
    );
    println!(
        "{:<20} {:>14} {:>18} {:>18} {:>22}",
        "heap", "ns/(free+malloc)", "faults in free", "faults in malloc", "pages left on servers"
    );
    for r in rows {
        println!(
            "{:<20} {:>14} {:>18} {:>18} {:>22}",
            r[0], r[1], r[2], r[3], r[4]
        );
    }
}
