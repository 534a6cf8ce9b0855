//! A global allocator that puts a Rust program's large allocations on a region: the Rust side
//! of the API, next to the C ABI's `netram_alloc`.
//!
//! ```text
//! #[global_allocator]
//! static ALLOC: NetramAlloc<TcpTransport, FileDisk> = NetramAlloc::new(1 << 20);
//! // at the start of main:
//! ALLOC.install(RegionHeap::new(region)).unwrap();
//! ```
//!
//! Allocations of `threshold` bytes or more go to the heap once it is installed; everything
//! else, and anything the region has no room for, goes to the system allocator. The heap's
//! own bookkeeping allocates too (and so does the pager when memory is freed): on the thread
//! doing it, those allocations go to the system allocator, never back into the heap, whose
//! lock that thread holds.

use crate::heap::RegionHeap;
use netram_pager::{Disk, Transport};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::OnceLock;

thread_local! {
    /// Set while this thread is inside the heap.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as netram's own for the rest of its life, as if always inside the heap:
/// its allocations never go to a region, nor (under `netram run`) to the program's allocator.
/// A region's fault handler must never touch region memory, since it alone could serve that
/// fault; the threads serving the pager (keepalive, maintenance) must not wait on a lock that a
/// thread faulting on region memory holds (the program's allocator's).
pub fn mark_internal_thread() {
    let _ = INSIDE.try_with(|i| i.set(true));
}

/// Whether this thread is inside the heap or one of netram's own (`true` while it exits).
pub fn is_inside() -> bool {
    INSIDE.try_with(Cell::get).unwrap_or(true)
}

/// Runs `f` marked as inside the heap; `None` if this thread already is (or is exiting). An
/// allocator that puts blocks on a region calls the heap through this, and sends the thread's
/// other allocations elsewhere while it is inside (here and in `netram run`'s preload library).
pub fn enter<R>(f: impl FnOnce() -> R) -> Option<R> {
    let was = INSIDE.try_with(|i| i.replace(true)).ok()?;
    if was {
        return None;
    }
    let r = f();
    let _ = INSIDE.try_with(|i| i.set(false));
    Some(r)
}

#[derive(Debug)]
pub struct NetramAlloc<T: Transport, D: Disk> {
    heap: OnceLock<RegionHeap<T, D>>,
    threshold: usize,
}

impl<T: Transport, D: Disk> NetramAlloc<T, D> {
    /// Allocations of `threshold` bytes or more will go to the heap, once installed.
    pub const fn new(threshold: usize) -> Self {
        Self {
            heap: OnceLock::new(),
            threshold,
        }
    }

    /// Starts using `heap`; hands it back if one is installed already.
    pub fn install(&self, heap: RegionHeap<T, D>) -> Result<(), RegionHeap<T, D>> {
        self.heap.set(heap)
    }

    pub fn heap(&self) -> Option<&RegionHeap<T, D>> {
        self.heap.get()
    }
}

// SAFETY: every block comes either from `System` or from the heap, and goes back to where it
// came from (the heap owns exactly the addresses of its region). Heap blocks are whole pages
// aligned to at least the layout's alignment; they read as zeros, so `alloc_zeroed` is sound.
unsafe impl<T, D> GlobalAlloc for NetramAlloc<T, D>
where
    T: Transport + Send,
    D: Disk + Send,
{
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= self.threshold {
            if let Some(heap) = self.heap.get() {
                if let Some(Some(p)) = enter(|| heap.alloc(layout.size(), layout.align())) {
                    return p.as_ptr();
                }
            }
        }
        // SAFETY: forwarded with the caller's layout, under the caller's contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= self.threshold {
            if let Some(heap) = self.heap.get() {
                if let Some(Some(p)) = enter(|| heap.alloc(layout.size(), layout.align())) {
                    return p.as_ptr();
                }
            }
        }
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if let Some(heap) = self.heap.get() {
            if heap.contains(ptr) {
                // Marked inside: releasing the pages allocates (the pager's lists), and those
                // allocations must not come back here while the heap is locked. Nothing inside
                // the heap frees heap memory, so the thread is never inside already.
                match enter(|| heap.free(ptr)) {
                    Some(Ok(_)) => {}
                    Some(Err(e)) => tracing::error!("freeing {ptr:p} on a region: {e}"),
                    None => tracing::error!("freeing {ptr:p} from inside the region's heap"),
                }
                return;
            }
        }
        // SAFETY: not a heap block, so System's, under the caller's contract.
        unsafe { System.dealloc(ptr, layout) }
    }
}
