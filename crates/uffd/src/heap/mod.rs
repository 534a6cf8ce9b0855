//! Allocations of every size carved out of one region: what `netram_alloc`, the global
//! allocator adapter and `netram run`'s `malloc` hand out (Anemone §2.1: the program's memory,
//! all of it, on network memory).
//!
//! Two parts, both with their bookkeeping outside the region, so that neither `malloc` nor
//! `free` ever faults on a page of it (a remote page fetched only to be freed would be a
//! network round trip for nothing):
//!
//! * blocks of up to 32 KiB (`slabs`): size classes in 256 KiB spans, a bitmap a span; the
//!   spans are split among shards, each with its own lock, and a thread allocates from the
//!   shard it was given at its first allocation (any thread frees into the span's shard);
//! * larger blocks, and the spans themselves (`extents`): whole pages, first fit. Freeing
//!   one gives its pages back with [`Region::release`] (local memory dropped, remote copies
//!   deleted) without touching its neighbours; so does a span whose last block is freed.
//!
//! Measured against the crates that manage memory they are given (`cargo run --release -p
//! netram-bench --example heaps`, 2-vCPU development VM, 2 servers on loopback): 400,000 blocks
//! of 16-512 B with a fifth of them resident, then half freed and as many allocated again —
//!
//! | heap | ns per free + malloc (resident) | faults in the frees | in the mallocs | pages left on the servers once all is freed |
//! |---|---|---|---|---|
//! | this one | 94 | 0 | 0 | 665 (the last span of each class, kept) |
//! | talc 5 | 50 | 343,796 | 95,584 | 28,095 |
//! | rlsf 0.2 (TLSF) | 62 | 356,472 | 93,205 | 28,919 |
//!
//! Twice the CPU of an allocation is ~50 ns; one fault is ~80 µs. See `slabs` for why.

mod extents;
pub(crate) mod slabs;

use crate::Region;
use extents::Extents;
use netram_pager::{Disk, Transport};
use netram_proto::PAGE_SIZE;
pub use slabs::SlabError;
use slabs::{Slabs, SPAN};
use std::cell::Cell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A region handing out allocations of every size.
#[derive(Debug)]
pub struct RegionHeap<T: Transport, D: Disk> {
    region: Region<T, D>,
    extents: Mutex<Extents>,
    small: Box<Small>,
}

/// The small blocks' side of a heap.
#[derive(Debug)]
struct Small {
    /// By shard.
    shards: Box<[Mutex<Slabs>]>,
    /// Per SPAN-sized chunk of the region: 0, or 1 + the shard whose span it is.
    owner: Box<[AtomicU8]>,
    /// Bytes in small blocks handed out and not freed.
    bytes: AtomicUsize,
}

#[derive(Debug, thiserror::Error)]
pub enum FreeError {
    #[error("{0:#x} was not allocated from this heap")]
    NotAllocated(usize),
    #[error("{0:#x}: {1}")]
    Small(usize, SlabError),
    #[error(transparent)]
    Release(#[from] crate::RegionError),
}

thread_local! {
    /// The shard this thread allocates small blocks from: 1 + its index, 0 until its first.
    static SHARD: Cell<usize> = const { Cell::new(0) };
}

/// Threads are given shards in turn.
static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

fn lock<X>(m: &Mutex<X>) -> MutexGuard<'_, X> {
    // The bookkeeping is changed only by code that does not panic midway (no allocation into
    // this heap, no user code): a poisoned lock still guards consistent data.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T: Transport, D: Disk> RegionHeap<T, D> {
    pub fn new(region: Region<T, D>) -> Self {
        let pages = region.len() / PAGE_SIZE;
        // One shard per CPU thread (at most 16): threads on different CPUs rarely wait for
        // each other's lock, and few shards keep live blocks on few pages.
        let shards = std::thread::available_parallelism().map_or(1, |n| n.get().min(16));
        Self {
            small: Box::new(Small {
                owner: (0..region.len().div_ceil(SPAN))
                    .map(|_| AtomicU8::new(0))
                    .collect(),
                shards: (0..shards).map(|_| Mutex::new(Slabs::default())).collect(),
                bytes: AtomicUsize::new(0),
            }),
            region,
            extents: Mutex::new(Extents::new(pages)),
        }
    }

    pub fn region(&self) -> &Region<T, D> {
        &self.region
    }

    fn my_shard(&self) -> usize {
        let n = self.small.shards.len();
        SHARD
            .try_with(|s| {
                if s.get() == 0 {
                    s.set(1 + NEXT_SHARD.fetch_add(1, Ordering::Relaxed));
                }
                (s.get() - 1) % n
            })
            .unwrap_or(0)
    }

    /// `size` bytes aligned to `align` (a power of two), or `None` when the region has no room.
    /// Small blocks may hold what a freed block held; see [`RegionHeap::alloc_zeroed`].
    pub fn alloc(&self, size: usize, align: usize) -> Option<NonNull<u8>> {
        self.alloc_block(size, align).map(|(p, _)| p)
    }

    /// As [`RegionHeap::alloc`], reading as zeros.
    pub fn alloc_zeroed(&self, size: usize, align: usize) -> Option<NonNull<u8>> {
        let (p, zeroed) = self.alloc_block(size, align)?;
        if !zeroed {
            // SAFETY: a block of at least `size` bytes just handed out, not shared yet.
            unsafe { std::ptr::write_bytes(p.as_ptr(), 0, size) };
        }
        Some(p)
    }

    /// A block and whether it reads as zeros.
    fn alloc_block(&self, size: usize, align: usize) -> Option<(NonNull<u8>, bool)> {
        let Some(class) = slabs::class_of(size, align).filter(|_| align < PAGE_SIZE) else {
            let pages = size.max(1).div_ceil(PAGE_SIZE);
            let align = align.max(PAGE_SIZE) / PAGE_SIZE;
            let start = lock(&self.extents).alloc(pages, align)?;
            // Released pages read as zeros and never-touched ones are zero-filled.
            return Some((self.at(start * PAGE_SIZE), true));
        };
        let shard = self.my_shard();
        let mut slabs = lock(&self.small.shards[shard]);
        let block = match slabs.alloc(class) {
            Some(b) => b,
            None => {
                let start = lock(&self.extents).alloc(SPAN / PAGE_SIZE, SPAN / PAGE_SIZE)?;
                let id = start * PAGE_SIZE / SPAN;
                self.small.owner[id].store(1 + shard as u8, Ordering::Release);
                slabs.add_span(id as u32, class);
                slabs.alloc(class).expect("a fresh span has room")
            }
        };
        drop(slabs);
        self.small.bytes.fetch_add(block.size, Ordering::Relaxed);
        Some((
            self.at(block.span as usize * SPAN + block.offset),
            block.zeroed,
        ))
    }

    fn at(&self, offset: usize) -> NonNull<u8> {
        NonNull::new(self.region.as_ptr().wrapping_add(offset)).expect("inside the region")
    }

    /// Whether `ptr` points into this heap's region.
    pub fn contains(&self, ptr: *const u8) -> bool {
        let base = self.region.as_ptr() as usize;
        (base..base + self.region.len()).contains(&(ptr as usize))
    }

    /// The offset of `ptr` in the region, and the shard of its span if it is a small block's.
    fn locate(&self, ptr: *const u8) -> Option<(usize, Option<usize>)> {
        let off = (ptr as usize).checked_sub(self.region.as_ptr() as usize)?;
        if off >= self.region.len() {
            return None;
        }
        let owner = self.small.owner[off / SPAN].load(Ordering::Acquire);
        Some((off, (owner != 0).then(|| usize::from(owner) - 1)))
    }

    /// The usable size of the allocation at `ptr`.
    pub fn size_of(&self, ptr: *const u8) -> Option<usize> {
        match self.locate(ptr)? {
            (off, Some(shard)) => {
                lock(&self.small.shards[shard]).size_of((off / SPAN) as u32, off % SPAN)
            }
            (off, None) => {
                if !off.is_multiple_of(PAGE_SIZE) {
                    return None;
                }
                lock(&self.extents)
                    .len_of(off / PAGE_SIZE)
                    .map(|p| p * PAGE_SIZE)
            }
        }
    }

    /// Frees the allocation at `ptr`; returns its size. Whole pages freed (a large block, a
    /// span emptied) are released (see [`Region::release`]) before they can be handed out
    /// again.
    pub fn free(&self, ptr: *const u8) -> Result<usize, FreeError> {
        let (off, shard) = self
            .locate(ptr)
            .ok_or(FreeError::NotAllocated(ptr as usize))?;
        if let Some(shard) = shard {
            let id = off / SPAN;
            let freed = {
                let mut slabs = lock(&self.small.shards[shard]);
                let freed = slabs
                    .free(id as u32, off % SPAN)
                    .map_err(|e| FreeError::Small(ptr as usize, e))?;
                if freed.retired {
                    self.small.owner[id].store(0, Ordering::Release);
                }
                freed
            };
            self.small.bytes.fetch_sub(freed.size, Ordering::Relaxed);
            if freed.retired {
                self.free_pages(id * SPAN / PAGE_SIZE, ptr)?;
            }
            return Ok(freed.size);
        }
        if !off.is_multiple_of(PAGE_SIZE) {
            return Err(FreeError::NotAllocated(ptr as usize));
        }
        self.free_pages(off / PAGE_SIZE, ptr)
    }

    /// Releases and frees the page range starting at page `start`.
    fn free_pages(&self, start: usize, ptr: *const u8) -> Result<usize, FreeError> {
        let mut ext = lock(&self.extents);
        let pages = ext
            .len_of(start)
            .ok_or(FreeError::NotAllocated(ptr as usize))?;
        // Released under the lock: the range cannot be handed out again meanwhile.
        self.region.release(start * PAGE_SIZE, pages * PAGE_SIZE)?;
        ext.free(start);
        Ok(pages * PAGE_SIZE)
    }

    /// What the heap holds now.
    pub fn stats(&self) -> HeapStats {
        let spans = self
            .small
            .owner
            .iter()
            .filter(|o| o.load(Ordering::Relaxed) != 0)
            .count();
        let ext = lock(&self.extents);
        HeapStats {
            small_bytes: self.small.bytes.load(Ordering::Relaxed),
            spans,
            large_bytes: (ext.used_pages() * PAGE_SIZE).saturating_sub(spans * SPAN),
            free_ranges: ext.free_ranges(),
            largest_free_bytes: ext.largest_free() * PAGE_SIZE,
        }
    }

    /// Bytes allocated now (small blocks at their class's size; spans not counted).
    pub fn allocated(&self) -> usize {
        let s = self.stats();
        s.small_bytes + s.large_bytes
    }
}

/// See [`RegionHeap::stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeapStats {
    /// Small blocks handed out, at their class's size.
    pub small_bytes: usize,
    /// Spans holding small blocks (256 KiB each).
    pub spans: usize,
    /// Large blocks handed out (whole pages).
    pub large_bytes: usize,
    /// Free page ranges, and the largest.
    pub free_ranges: usize,
    pub largest_free_bytes: usize,
}
