//! This library's own memory: talc over one address range it reserves, never the C
//! library's allocator (whose locks `fork` holds, and which the region's handler must not wait
//! for), and a forked child's own bump arena. Why: see [`Mapped`].

use super::*;

/// Where this library's own allocations come from: memory it maps itself, managed by talc,
/// under a lock of its own — never the C library's allocator.
///
/// The C library's `fork` holds every lock of its allocator across the system call, and with
/// forks followed (see `netram_uffd::Region::prepare_fork`) the kernel makes `fork` wait until
/// the region's handler thread has read the fork's event. A handler that allocated through
/// the C library then would wait for `fork`, which waits for it — and the C library allocates
/// on netram's threads by itself (registering a thread-local's destructor, `__cxa_thread_atexit_impl`,
/// calls `calloc`; so does the resolver), which is why those calls come here too (see
/// [`internal`]). talc is a well-kept allocator that manages memory it is given: [`Mapped`]
/// gives it chunks of one reserved address range, so that a block's owner is known from its
/// address alone ([`internal::owns`]), mapped with the system call (not the interposed `mmap`,
/// which would put them on the region).
#[derive(Debug)]
pub(crate) struct Mapped;

/// Memory is given to talc in chunks of at least this much.
pub(crate) const CHUNK: usize = 4 << 20;
/// The range reserved for this library's own memory: address space only (`PROT_NONE`,
/// `MAP_NORESERVE`) until a chunk of it is made read-write. Halved until the reservation
/// succeeds (an address-space limit), down to [`MIN_ARENA`].
pub(crate) const ARENA: usize = 1 << 40;
pub(crate) const MIN_ARENA: usize = 64 << 20;
/// The reserved range (start, length) and how much of it has been handed out (to talc, or as
/// a large block); taken from the front, never given back as address space.
pub(crate) static ARENA_START: AtomicUsize = AtomicUsize::new(0);
pub(crate) static ARENA_LEN: AtomicUsize = AtomicUsize::new(0);
pub(crate) static ARENA_USED: AtomicUsize = AtomicUsize::new(0);
pub(crate) static ARENA_RESERVED: std::sync::Once = std::sync::Once::new();

/// `len` bytes (a multiple of the page size) of the reserved range never used before, aligned
/// to `align`, made read-write: zeros, and not resident until touched.
pub(crate) fn take_fresh(len: usize, align: usize) -> Option<*mut u8> {
    ARENA_RESERVED.call_once(|| {
        reserve_arena();
    });
    let start = ARENA_START.load(Ordering::Acquire);
    if start == 0 {
        return None;
    }
    let room = len + align.saturating_sub(PAGE_SIZE);
    let used = ARENA_USED.fetch_add(room, Ordering::Relaxed);
    if used + room > ARENA_LEN.load(Ordering::Relaxed) {
        return None;
    }
    let p = (start + used).next_multiple_of(align) as *mut u8;
    // SAFETY: `len` bytes of the reserved range that nobody else was given (the counter moved
    // past them atomically).
    let rw = unsafe { libc::mprotect(p.cast(), len, libc::PROT_READ | libc::PROT_WRITE) };
    (rw == 0).then_some(p)
}

/// Allocations from this size up bypass talc: each is a fresh part of the reserved range,
/// whose pages stay untouched until used — a zeroed table (the pager's, the clock's, one entry
/// per page of a region eight times the local memory) costs resident memory only for the part
/// in use, where talc's `alloc_zeroed` would write every byte. Freed, their memory goes back
/// to the kernel at once (their address space is not reused: such blocks are few, and made
/// once per region).
pub(crate) const LARGE: usize = 256 << 10;

/// This library's global allocator: talc for most blocks, the reserved range directly for
/// [`LARGE`] ones; which one by the layout's size, which `dealloc` is given back.
pub(crate) struct Internal(talc::sync::TalcLock<InternalLock, Mapped, talc::DefaultBinning>);

// SAFETY: small blocks go to and from talc with their layouts unchanged; large ones are fresh
// read-write ranges of at least the layout's size at its alignment, returned to `PROT_NONE`
// (and their memory to the kernel) when freed with the same layout.
unsafe impl GlobalAlloc for Internal {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= LARGE {
            let len = layout.size().next_multiple_of(PAGE_SIZE);
            return take_fresh(len, layout.align().max(PAGE_SIZE)).unwrap_or(std::ptr::null_mut());
        }
        if IN_CHILD.load(Ordering::Relaxed) {
            return child_arena::alloc(layout);
        }
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.0.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= LARGE {
            // SAFETY: as `alloc`; fresh memory reads as zeros.
            return unsafe { self.alloc(layout) };
        }
        if IN_CHILD.load(Ordering::Relaxed) {
            // Fresh memory of the reserved range, never handed out before: zeros.
            return child_arena::alloc(layout);
        }
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.0.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() >= LARGE {
            let len = layout.size().next_multiple_of(PAGE_SIZE);
            // SAFETY: a large block of `len` bytes from `alloc`, no longer used: its memory
            // goes back to the kernel, its range to PROT_NONE (system calls, not the
            // interposed `madvise`).
            unsafe {
                libc::syscall(libc::SYS_madvise, ptr, len, libc::MADV_DONTNEED);
                libc::mprotect(ptr.cast(), len, libc::PROT_NONE);
            }
            return;
        }
        if IN_CHILD.load(Ordering::Relaxed) {
            // A forked child frees nothing small: see `child_arena`.
            return;
        }
        // SAFETY: a small block, talc's, under the caller's contract.
        unsafe { self.0.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.size() < LARGE && new_size < LARGE && !IN_CHILD.load(Ordering::Relaxed) {
            // SAFETY: both small: talc's, which may grow it in place.
            return unsafe { self.0.realloc(ptr, layout, new_size) };
        }
        // SAFETY: the caller's contract; the new layout has the old alignment.
        unsafe {
            let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
            let new = self.alloc(new_layout);
            if !new.is_null() {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            new
        }
    }
}

/// Where a forked child's own small blocks come from (the agent's thread, the loader's blocks):
/// not talc, whose lock another thread of the parent may have held at the fork (the child
/// would spin on it for good; seen with bash forking subshells). Bump allocation from fresh
/// chunks of the reserved range, under a flag that each child resets before anything else
/// runs in it (it has one thread then); small blocks are never freed in a child (those from
/// before the fork belong to an allocator the child must not touch, and a child's own are
/// few: an agent's start, the loader's link maps).
pub(crate) mod child_arena {
    use super::{take_fresh, Layout, Ordering, CHUNK, PAGE_SIZE};
    use std::sync::atomic::{AtomicBool, AtomicUsize};

    static BUSY: AtomicBool = AtomicBool::new(false);
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    static END: AtomicUsize = AtomicUsize::new(0);

    /// In a child just forked, on its only thread: forgets the parent's state.
    pub fn reset() {
        BUSY.store(false, Ordering::Relaxed);
        NEXT.store(0, Ordering::Relaxed);
        END.store(0, Ordering::Relaxed);
    }

    pub fn alloc(layout: Layout) -> *mut u8 {
        while BUSY
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
        let mut start = NEXT
            .load(Ordering::Relaxed)
            .next_multiple_of(layout.align());
        if NEXT.load(Ordering::Relaxed) == 0 || start + layout.size() > END.load(Ordering::Relaxed)
        {
            let len = (layout.size() + layout.align())
                .max(CHUNK)
                .next_multiple_of(PAGE_SIZE);
            match take_fresh(len, PAGE_SIZE) {
                Some(p) => {
                    END.store(p as usize + len, Ordering::Relaxed);
                    start = (p as usize).next_multiple_of(layout.align());
                }
                None => {
                    BUSY.store(false, Ordering::Release);
                    return std::ptr::null_mut();
                }
            }
        }
        NEXT.store(start + layout.size().max(1), Ordering::Relaxed);
        BUSY.store(false, Ordering::Release);
        start as *mut u8
    }
}

pub(crate) fn reserve_arena() -> bool {
    let mut len = ARENA;
    while len >= MIN_ARENA {
        // SAFETY: a fresh reservation of address space; the system call itself, so that it
        // does not come back through this library's `mmap`.
        let p = unsafe {
            libc::syscall(
                libc::SYS_mmap,
                std::ptr::null_mut::<c_void>(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        } as *mut c_void;
        if p != libc::MAP_FAILED {
            ARENA_LEN.store(len, Ordering::Relaxed);
            ARENA_START.store(p as usize, Ordering::Release);
            return true;
        }
        len /= 2;
    }
    false
}

// SAFETY: `acquire` only makes fresh memory of the reserved range usable and gives it to talc;
// it allocates nothing.
unsafe impl talc::source::Source for Mapped {
    fn acquire<B: talc::base::binning::Binning>(
        talc: &mut talc::base::Talc<Self, B>,
        layout: Layout,
    ) -> Result<(), ()> {
        let len = (layout.size() + layout.align() + PAGE_SIZE)
            .max(CHUNK)
            .next_multiple_of(PAGE_SIZE);
        let p = take_fresh(len, PAGE_SIZE).ok_or(())?;
        // SAFETY: the chunk is ours, `len` bytes, and given to talc for good.
        unsafe { talc.claim(p, len) }.map(|_| ()).ok_or(())
    }
}

/// Blocks of the `malloc` family for netram's own threads (and a thread inside the heap):
/// from talc (see [`Mapped`]), each with a header that gives `free` its layout back.
pub(crate) mod internal {
    use super::{c_void, Layout, Ordering, ARENA_LEN, ARENA_START};

    /// The header: the block's offset from the start of its allocation, and the allocation's
    /// size. `malloc`'s alignment, so that the block after it keeps it.
    const HEADER: usize = 16;

    /// Whether `p` is a block from here (talc hands out nothing outside the reserved range).
    pub fn owns(p: *mut c_void) -> bool {
        let start = ARENA_START.load(Ordering::Acquire);
        let a = p as usize;
        start != 0 && a >= start && a < start + ARENA_LEN.load(Ordering::Relaxed)
    }

    pub fn alloc(size: usize, align: usize, zeroed: bool) -> *mut c_void {
        let align = align.max(HEADER);
        let Some(layout) = size
            .checked_add(align)
            .and_then(|total| Layout::from_size_align(total, align).ok())
        else {
            super::set_errno(libc::ENOMEM);
            return std::ptr::null_mut();
        };
        // SAFETY: a layout of non-zero size, from the global allocator (talc).
        let base = unsafe {
            if zeroed {
                std::alloc::alloc_zeroed(layout)
            } else {
                std::alloc::alloc(layout)
            }
        };
        if base.is_null() {
            super::set_errno(libc::ENOMEM);
            return std::ptr::null_mut();
        }
        // SAFETY: `align` ≥ HEADER bytes precede the block, inside the allocation.
        unsafe {
            let block = base.add(align);
            block.cast::<usize>().sub(2).write(align);
            block.cast::<usize>().sub(1).write(layout.size());
            block.cast()
        }
    }

    /// (offset, allocation size) of a block from here.
    fn header(p: *mut c_void) -> (usize, usize) {
        // SAFETY: `p` is a block from `alloc`, whose header precedes it.
        unsafe {
            (
                p.cast::<usize>().sub(2).read(),
                p.cast::<usize>().sub(1).read(),
            )
        }
    }

    pub fn usable_size(p: *mut c_void) -> usize {
        let (offset, size) = header(p);
        size - offset
    }

    pub fn free(p: *mut c_void) {
        let (offset, size) = header(p);
        // SAFETY: the allocation `alloc` made, with its layout (validated when it was made).
        unsafe {
            std::alloc::dealloc(
                p.cast::<u8>().sub(offset),
                Layout::from_size_align_unchecked(size, offset),
            )
        }
    }

    pub fn realloc(p: *mut c_void, size: usize) -> *mut c_void {
        let old = usable_size(p);
        if size <= old {
            return p;
        }
        let new = alloc(size, HEADER, false);
        if !new.is_null() {
            // SAFETY: `old` bytes of the old block into a new one of more.
            unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), new.cast::<u8>(), old) };
            free(p);
        }
        new
    }
}

/// talc's lock: a flag, spun on briefly and then yielded on (its critical sections are short;
/// written here because talc 5 ships no lock of its own for a global allocator, and a lock that
/// allocates, or the C library's, would bring the deadlock back).
pub(crate) struct InternalLock(AtomicBool);

// SAFETY: a mutual-exclusion flag: `lock` returns only once this thread set it from false,
// `unlock` clears it; Acquire/Release order the protected data.
unsafe impl talc::lock_api::RawMutex for InternalLock {
    #[allow(clippy::declare_interior_mutable_const)]
    const INIT: Self = Self(AtomicBool::new(false));
    type GuardMarker = talc::lock_api::GuardSend;

    fn lock(&self) {
        let mut spins = 0u32;
        while !self.try_lock() {
            spins += 1;
            if spins < 100 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    fn try_lock(&self) -> bool {
        self.0
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    unsafe fn unlock(&self) {
        self.0.store(false, Ordering::Release);
    }
}

#[global_allocator]
pub(crate) static ALLOC: Internal = Internal(talc::sync::TalcLock::new(Mapped));
