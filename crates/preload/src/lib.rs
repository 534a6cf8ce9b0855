//! `netram run`'s preload library (`libnetram_preload.so`): an unmodified, dynamically linked
//! program's heap on one netram region, with the local budget `netram run` gives
//! (Anemone §2.1's goal, transparency to programs, reached without the kernel's swap).
//!
//! Interposed: the `malloc` family (`malloc`, `calloc`, `realloc`, `free`, `posix_memalign`,
//! `aligned_alloc`, `memalign`, `valloc`, `pvalloc`, `malloc_usable_size`) for blocks of at
//! least the threshold (0 as root or with `/dev/userfaultfd`: every block; 128K for another
//! ordinary user, see `start`), and
//! anonymous private read-write `mmap` of at least the threshold, with the `munmap`, `mremap`
//! and `madvise(DONTNEED/FREE/REMOVE)` that give such memory back; anonymous `PROT_NONE`
//! reservations and the `MAP_FIXED` anonymous mappings that commit and uncommit inside them
//! (a JVM's heap); `fork`; `mprotect` (a range of the region made unreadable is reported to
//! it); and, for an ordinary user's region, the calls that copy bulk data
//! to or from the program's memory (`read`, `write`, `fread`..., see [`io`]). glibc's
//! `malloc` reaches its own internal `mmap` without passing through the interposed one, which
//! is why `malloc` itself is interposed. Everything else (blocks under the threshold, file
//! mappings, shared or fixed mappings, stacks, `PROT_NONE` reservations) goes to the C library
//! untouched: blocks through `__libc_malloc` and friends, mappings through the system call.
//!
//! Configuration comes from the environment that `netram run` sets: `NETRAM_LOCAL_MEM` (the
//! budget; without it the library stays out of the way), `NETRAM_SERVERS`, `NETRAM_BACKING`,
//! `NETRAM_MAX_MEM` (the region's size: the most the program can keep on netram),
//! `NETRAM_THRESHOLD`, `NETRAM_REPORT` (a directory where each process writes its counters at
//! exit), `NETRAM_REQUIRED` (exit with status 70 rather than run without netram).
//!
//! A program that brings its own allocator as a shared library (jemalloc, tcmalloc, mimalloc)
//! keeps it: the `malloc` family is passed through to it (see [`Foreign`]), and its memory
//! reaches the region through the interposed `mmap`.
//!
//! Hazards: the library's own allocations come from memory it maps itself (talc, see
//! `Mapped`), never from the C library's allocator, whose locks `fork` holds: its Rust
//! allocations, and every block that a thread of netram's own or a thread already inside the
//! region's heap asks of the `malloc` family (the C library asks for some by itself), so the
//! heap's lock is never taken twice and no netram thread waits for a lock that `fork` holds. `fork` is announced to the region (see the
//! interposed [`fork`]): as root the child inherits the region and is served its memory as it
//! was at the fork; it allocates from the C library, and frees of inherited blocks do nothing.
//! As an ordinary user the child has no region.

use netram_client::disk::FileDisk;
use netram_client::env::{var, EnvError, RunEnv};
use netram_client::TcpTransport;
use netram_proto::PAGE_SIZE;
use netram_uffd::RegionHeap;
use std::alloc::{GlobalAlloc, Layout};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;

mod io;
mod loader;

type Heap = RegionHeap<TcpTransport, FileDisk>;

extern "C" {
    fn __libc_malloc(size: usize) -> *mut c_void;
    fn __libc_free(ptr: *mut c_void);
    fn __libc_calloc(n: usize, size: usize) -> *mut c_void;
    fn __libc_realloc(ptr: *mut c_void, size: usize) -> *mut c_void;
    fn __libc_memalign(align: usize, size: usize) -> *mut c_void;
}

/// The alignment `__libc_malloc` guarantees.
const LIBC_ALIGN: usize = 16;

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
struct Mapped;

/// Memory is given to talc in chunks of at least this much.
const CHUNK: usize = 4 << 20;
/// The range reserved for this library's own memory: address space only (`PROT_NONE`,
/// `MAP_NORESERVE`) until a chunk of it is made read-write. Halved until the reservation
/// succeeds (an address-space limit), down to [`MIN_ARENA`].
const ARENA: usize = 1 << 40;
const MIN_ARENA: usize = 64 << 20;
/// The reserved range (start, length) and how much of it has been handed out (to talc, or as
/// a large block); taken from the front, never given back as address space.
static ARENA_START: AtomicUsize = AtomicUsize::new(0);
static ARENA_LEN: AtomicUsize = AtomicUsize::new(0);
static ARENA_USED: AtomicUsize = AtomicUsize::new(0);
static ARENA_RESERVED: std::sync::Once = std::sync::Once::new();

/// `len` bytes (a multiple of the page size) of the reserved range never used before, aligned
/// to `align`, made read-write: zeros, and not resident until touched.
fn take_fresh(len: usize, align: usize) -> Option<*mut u8> {
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
const LARGE: usize = 256 << 10;

/// This library's global allocator: talc for most blocks, the reserved range directly for
/// [`LARGE`] ones; which one by the layout's size, which `dealloc` is given back.
struct Internal(talc::sync::TalcLock<InternalLock, Mapped, talc::DefaultBinning>);

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
mod child_arena {
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

fn reserve_arena() -> bool {
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
mod internal {
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
struct InternalLock(AtomicBool);

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
static ALLOC: Internal = Internal(talc::sync::TalcLock::new(Mapped));

const UNINIT: u8 = 0;
const INITIALIZING: u8 = 1;
const READY: u8 = 2;
const OFF: u8 = 3;

static STATE: AtomicU8 = AtomicU8::new(UNINIT);
static HEAP: OnceLock<Heap> = OnceLock::new();
/// The region's background thread (see `netram::start_maintenance`).
static MAINTENANCE: OnceLock<netram_client::maintain::Maintenance> = OnceLock::new();
static THRESHOLD: AtomicUsize = AtomicUsize::new(usize::MAX);
/// The threshold where the region cannot serve the kernel's own accesses.
const USER_MODE_THRESHOLD: usize = 128 << 10;
/// Whether a forked child inherits the region (see `netram_uffd::Region::follows_forks`).
static FOLLOWS_FORKS: AtomicBool = AtomicBool::new(false);
/// Set in a child after fork: it has no region.
static IN_CHILD: AtomicBool = AtomicBool::new(false);
static WARNED_FULL: AtomicBool = AtomicBool::new(false);

/// Inside the heap (or starting it), this thread's allocations go to talc (see [`internal`]).
use netram_uffd::alloc::enter;

/// Why the library could not start; the program then runs without netram (or, with
/// `NETRAM_REQUIRED`, not at all).
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error(transparent)]
    Env(#[from] EnvError),
    #[error(transparent)]
    Region(#[from] netram::CapiError),
    #[error("{0}={1}: too large for this machine")]
    TooLarge(&'static str, u64),
}

fn start() -> Result<bool, StartError> {
    let env = RunEnv::from_env()?;
    // Without a budget the library was not asked to do anything.
    let Some(budget) = env.local_mem else {
        return Ok(false);
    };
    let size = env.max_mem.unwrap_or((8 * budget).max(1 << 30));
    // `None`: every allocation (or, where the region cannot serve the kernel's own accesses,
    // the large ones: see below).
    let threshold = env
        .threshold
        .map(|t| usize::try_from(t).map_err(|_| StartError::TooLarge(var::THRESHOLD, t)))
        .transpose()?;
    if std::env::var_os(var::LOG).is_some() {
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(tracing_subscriber::EnvFilter::from_env(var::LOG))
            .try_init();
    } else {
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_max_level(tracing::Level::WARN)
            .try_init();
    }
    let backing = env.backing.map(|b| b.to_string());
    let redundancy = env.redundancy.unwrap_or_default();
    // `after_fork_in_child` serves every child its copy (see `Region::follow_in_child`).
    netram_uffd::children_follow_regions();
    let heap = netram::region_from(None, backing.as_deref(), size, budget, redundancy, &env)?;
    let start = heap.region().as_ptr() as usize;
    REGION_START.store(start, Ordering::Relaxed);
    REGION_END.store(start + heap.region().len(), Ordering::Relaxed);
    let _ = HEAP.set(heap);
    if let Some(h) = HEAP.get() {
        // Probes, reconnections and recovery in the background, for the process's lifetime.
        let _ = MAINTENANCE.set(netram::start_maintenance(h, Default::default()));
    }
    // An ordinary user's userfaultfd does not serve faults raised inside system calls: a
    // `read(2)` into a buffer whose page is not resident fails with EFAULT. Small blocks are
    // what programs hand to system calls (stdio's buffers, lines read), so there only large
    // allocations go on the region, which programs mostly compute in.
    //
    // Nor where a forked child cannot inherit the region (the same ordinary user: following
    // forks needs CAP_SYS_PTRACE): a shell or a `make` touches its heap between `fork` and
    // `exec`.
    let follows_forks = HEAP.get().is_some_and(|h| h.region().follows_forks());
    FOLLOWS_FORKS.store(follows_forks, Ordering::Relaxed);
    let threshold = threshold.unwrap_or_else(|| {
        if HEAP
            .get()
            .is_some_and(|h| h.region().serves_kernel_faults())
            && follows_forks
        {
            0
        } else {
            tracing::info!(
                "userfaultfd for user-mode faults only: allocations under 128 KiB stay local"
            );
            USER_MODE_THRESHOLD
        }
    });
    THRESHOLD.store(threshold, Ordering::Release);
    if HEAP
        .get()
        .is_some_and(|h| !h.region().serves_kernel_faults())
    {
        // What the kernel copies to or from the region is brought in first (see `io`).
        io::arm(usize::try_from(budget).unwrap_or(usize::MAX));
    }
    // SAFETY: registering plain functions with the C library; they only touch atomics and
    // (at exit) write a file.
    unsafe {
        libc::pthread_atfork(None, None, Some(after_fork_in_child));
        libc::atexit(at_exit);
    }
    Ok(true)
}

/// The region's address range, for the SIGSEGV message of a forked child.
static REGION_START: AtomicUsize = AtomicUsize::new(0);
static REGION_END: AtomicUsize = AtomicUsize::new(0);

/// In a forked child that could not be served its copy of the region: the error (errno).
static CHILD_UNSERVED: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The SIGSEGV action the child had before `after_fork_in_child`, restored by `on_segv`.
static mut PREVIOUS_SEGV: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::zeroed();

extern "C" fn after_fork_in_child() {
    // Before anything allocates here: this child's own blocks (see `child_arena`).
    child_arena::reset();
    IN_CHILD.store(true, Ordering::Relaxed);
    if FOLLOWS_FORKS.load(Ordering::Relaxed) {
        // The child has the region, served by its parent's handler (which may need this
        // child to send it a descriptor first).
        let followed = HEAP.get().map_or(Ok(()), |h| h.region().follow_in_child());
        let Err(e) = followed else {
            return;
        };
        // Its pages that were not resident at the fork would read as zeros: the region is
        // made inaccessible instead, and a touch says why (below).
        CHILD_UNSERVED.store(e.raw_os_error(), Ordering::Relaxed);
        let (start, end) = (
            REGION_START.load(Ordering::Relaxed),
            REGION_END.load(Ordering::Relaxed),
        );
        // SAFETY: mprotect changes only the access of this child's copy of the region,
        // which no Rust reference of this library's refers to.
        unsafe { libc::mprotect(start as *mut c_void, end - start, libc::PROT_NONE) };
    }
    // The child has no region (it is not inherited): a touch of netram memory is a SIGSEGV.
    // Say why before it ends the child.
    // SAFETY: sigaction with a handler that only calls async-signal-safe functions; the
    // previous action is written to PREVIOUS_SEGV, which only this child's signal handler
    // reads, after this returns (fork handlers run on the child's only thread).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_segv as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(
            libc::SIGSEGV,
            &sa,
            std::ptr::addr_of_mut!(PREVIOUS_SEGV).cast(),
        );
    }
}

extern "C" fn on_segv(_: c_int, info: *mut libc::siginfo_t, _: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    let ours =
        (REGION_START.load(Ordering::Relaxed)..REGION_END.load(Ordering::Relaxed)).contains(&addr);
    let unserved = CHILD_UNSERVED.load(Ordering::Relaxed);
    if ours && unserved != 0 {
        const MSG: &[u8] = b"netram: this process was forked from one whose memory is on netram, \
and could not open a userfaultfd to be served its copy of that memory (see errno below); \
it touched that memory and dies of SIGSEGV\n";
        // SAFETY: as below.
        unsafe { libc::syscall(libc::SYS_write, 2, MSG.as_ptr(), MSG.len()) };
        let mut digits = *b"netram: errno 000\n";
        digits[14] = b'0' + (unserved / 100 % 10) as u8;
        digits[15] = b'0' + (unserved / 10 % 10) as u8;
        digits[16] = b'0' + (unserved % 10) as u8;
        // SAFETY: as below.
        unsafe { libc::syscall(libc::SYS_write, 2, digits.as_ptr(), digits.len()) };
    } else if ours {
        const MSG: &[u8] = b"netram: this process was forked from one whose memory is on netram, \
and a forked child does not inherit that memory: fork without exec is not supported under \
netram run (the child touched it and dies of SIGSEGV)\n";
        // SAFETY: the write system call is async-signal-safe; MSG is static. (Not the C
        // library's `write`: that name is this library's interposer, see `io`.)
        unsafe { libc::syscall(libc::SYS_write, 2, MSG.as_ptr(), MSG.len()) };
    }
    // Back to the action the child had; returning re-runs the access, which then gets it
    // (by default, death by SIGSEGV).
    // SAFETY: PREVIOUS_SEGV was written by sigaction in after_fork_in_child.
    unsafe {
        libc::sigaction(
            libc::SIGSEGV,
            std::ptr::addr_of!(PREVIOUS_SEGV).cast(),
            std::ptr::null_mut(),
        )
    };
}

/// Writes this process's counters to `$NETRAM_REPORT/<pid>.json`.
extern "C" fn at_exit() {
    if IN_CHILD.load(Ordering::Relaxed) {
        return;
    }
    if let Some(heap) = HEAP.get() {
        // Children still running keep their memory after this process is gone.
        let _ = enter(|| heap.region().hand_over_to_children());
    }
    let (Some(dir), Some(heap)) = (std::env::var_os(var::REPORT), HEAP.get()) else {
        return;
    };
    let _ = enter(|| {
        let c = netram::counters_of(heap.region());
        let (rc, get) = (heap.region().counters(), netram_uffd::RegionCounters::get);
        let pager = heap.region().with_pager(|p| p.counters().clone());
        let stats = heap.stats();
        let report = serde_json::json!({
            "pid": std::process::id(),
            "faults": c.faults,
            "zero_fills": c.zero_fills,
            "fetches": c.fetches,
            "evictions": c.evictions,
            "evicted_clean": c.evicted_clean,
            "samples": c.samples,
            "sample_faults": c.sample_faults,
            "prefetched": c.prefetched,
            "prefetch_hits": c.prefetch_hits,
            "prefetch_installed": c.prefetch_installed,
            "released": c.released,
            "batched_fetches": get(&rc.batched_fetches),
            "unreadable_victims": get(&rc.unreadable_victims),
            "forks": get(&rc.forks),
            "child_faults": get(&rc.child_faults),
            "child_copies": get(&rc.child_copies),
            "child_drops": get(&rc.child_drops),
            "child_private_pages": get(&rc.child_private_pages),
            "child_peak_resident_pages": get(&rc.child_peak_resident),
            "errors": c.errors,
            "resident_bytes": c.resident_bytes,
            "budget_bytes": c.budget_bytes,
            "allocated_bytes": heap.allocated(),
            "heap_small_bytes": stats.small_bytes,
            "heap_spans": stats.spans,
            "heap_large_bytes": stats.large_bytes,
            "heap_free_ranges": stats.free_ranges,
            "heap_largest_free_bytes": stats.largest_free_bytes,
            "gets": pager.gets,
            "puts": pager.puts,
            "spills": pager.spills,
            "disk_writes": pager.disk_writes,
            "io_guarded": io::GUARDED_CALLS.load(Ordering::Relaxed),
            "io_refaults": io::REFAULTS.load(Ordering::Relaxed),
        });
        let path = std::path::Path::new(&dir).join(format!("{}.json", std::process::id()));
        if let Err(e) = std::fs::write(&path, report.to_string()) {
            eprintln!("netram: cannot write {}: {e}", path.display());
        }
    });
}

/// Runs when the library is loaded, before the program's `main`: connects to the servers
/// and maps the region, so that a bad configuration is reported at once.
extern "C" fn on_load() {
    // Look the program's allocator up before the program allocates, so that every block it
    // gets comes from, and goes back to, the allocator that will serve it; and every other
    // function this library passes calls on to, before the region exists (see `loader`).
    let _ = foreign();
    loader::resolve_all();
    let _ = enter(|| {
        if STATE
            .compare_exchange(UNINIT, INITIALIZING, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        match start() {
            Ok(true) => {
                STATE.store(READY, Ordering::Release);
                // `netram run` counts these: a run with none never had netram (the loader
                // ignored this library), whatever the program's exit status says.
                if let Some(dir) = std::env::var_os(var::REPORT) {
                    let mark =
                        std::path::Path::new(&dir).join(format!("attached-{}", std::process::id()));
                    let _ = std::fs::write(mark, b"");
                }
            }
            Ok(false) => STATE.store(OFF, Ordering::Release),
            Err(e) => {
                STATE.store(OFF, Ordering::Release);
                eprintln!("netram: {}", netram::error_chain(&e));
                if std::env::var_os(var::REQUIRED).is_some() {
                    // SAFETY: ends the process before main; nothing to unwind.
                    unsafe { libc::_exit(70) };
                }
                eprintln!("netram: the program runs without netram");
            }
        }
    });
}

#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;

/// The heap, if `size` bytes should go there.
fn heap_for(size: usize) -> Option<&'static Heap> {
    // Inside: netram's own allocations (or an exiting thread's), which go to talc.
    if size < THRESHOLD.load(Ordering::Relaxed)
        || STATE.load(Ordering::Acquire) != READY
        || IN_CHILD.load(Ordering::Relaxed)
        || netram_uffd::alloc::is_inside()
    {
        return None;
    }
    HEAP.get()
}

/// The heap, if `ptr` points into its region.
fn owner(ptr: *const c_void) -> Option<&'static Heap> {
    HEAP.get().filter(|h| h.contains(ptr.cast()))
}

/// Whether `ptr` is on this process's netram region (1) or not (0): for a program, or a test,
/// that wants to know where a block of its own ended up (`dlsym(RTLD_DEFAULT,
/// "netram_run_on_region")`; absent when the program does not run under `netram run`).
#[no_mangle]
pub extern "C" fn netram_run_on_region(ptr: *const c_void) -> c_int {
    c_int::from(owner(ptr).is_some())
}

/// A block of the heap (reading as zeros if `zeroed`), or null (the caller falls back to the C
/// library).
fn heap_alloc(h: &Heap, size: usize, align: usize, zeroed: bool) -> *mut c_void {
    let block = enter(|| {
        if zeroed {
            h.alloc_zeroed(size, align)
        } else {
            h.alloc(size, align)
        }
    });
    match block.flatten() {
        Some(p) => p.as_ptr().cast(),
        None => {
            if !WARNED_FULL.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "netram: the region ({} MiB) has no room for {size} bytes; allocations \
                     that do not fit stay in local memory (raise --max-mem)",
                    h.region().len() >> 20,
                );
            }
            std::ptr::null_mut()
        }
    }
}

fn heap_free(h: &Heap, ptr: *mut c_void) {
    if IN_CHILD.load(Ordering::Relaxed) {
        // Not mapped in this process: nothing to give back.
        return;
    }
    // A thread that is exiting counts as inside (its thread-locals are gone): its blocks are
    // freed all the same, and whatever that allocates goes to talc already. No code
    // of netram's frees a block of the region, so no thread inside holds the heap's locks.
    let r = enter(|| h.free(ptr.cast())).unwrap_or_else(|| h.free(ptr.cast()));
    if let Err(e) = r {
        eprintln!("netram: free({ptr:p}): {e}");
    }
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno.
    unsafe { *libc::__errno_location() = e };
}

/// The allocator of a program that brings its own (jemalloc, tcmalloc or mimalloc as a shared
/// library after this one: `LD_PRELOAD` puts this library first, so its `malloc` is the one
/// everybody calls). Mixing the two would hand one allocator's pointers to the other — the
/// program calls `sdallocx`, `mallocx` or `tc_free` on what came from here, or frees here what
/// its allocator's own entry points returned — so with a foreign allocator present every call
/// of the `malloc` family is passed through to it, and its memory reaches the region through
/// `mmap`, which such allocators call for all of their memory.
type MallocFn = unsafe extern "C" fn(usize) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void);
type CallocFn = unsafe extern "C" fn(usize, usize) -> *mut c_void;
type ReallocFn = unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void;
type PosixMemalignFn = unsafe extern "C" fn(*mut *mut c_void, usize, usize) -> c_int;
type AlignedFn = unsafe extern "C" fn(usize, usize) -> *mut c_void;
type UsableSizeFn = unsafe extern "C" fn(*mut c_void) -> usize;

struct Foreign {
    malloc: MallocFn,
    free: FreeFn,
    calloc: CallocFn,
    realloc: ReallocFn,
    posix_memalign: PosixMemalignFn,
    /// Optional in the allocator: built from `posix_memalign` when it lacks them.
    aligned_alloc: Option<AlignedFn>,
    memalign: Option<AlignedFn>,
    valloc: Option<MallocFn>,
    pvalloc: Option<MallocFn>,
    malloc_usable_size: Option<UsableSizeFn>,
}

/// The foreign allocator, if there is one and this thread may use it: looked up at the first
/// call of the `malloc` family. netram's own threads (and a thread inside netram) use talc
/// instead (see [`internal`]): the foreign allocator keeps its own bookkeeping in memory it
/// maps, which is on the region, and the fault handler touching it would wait for itself.
fn foreign() -> Option<&'static Foreign> {
    static FOREIGN: OnceLock<Option<Foreign>> = OnceLock::new();
    if let Some(f) = FOREIGN.get() {
        return f.as_ref().filter(|_| !netram_uffd::alloc::is_inside());
    }
    // dlsym may allocate (through this library's malloc): inside `enter`, those calls go to
    // talc and do not come back here. None if this thread is already inside.
    enter(|| FOREIGN.get_or_init(find_foreign).as_ref()).flatten()
}

fn find_foreign() -> Option<Foreign> {
    fn next(name: &std::ffi::CStr) -> *mut c_void {
        // SAFETY: a lookup of a symbol in the libraries loaded after this one.
        unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) }
    }
    let malloc = next(c"malloc");
    // glibc's `malloc` is an alias of `__libc_malloc`: the same address.
    if malloc.is_null() || malloc == __libc_malloc as *mut c_void {
        return None;
    }
    let (free, calloc, realloc, posix_memalign) = (
        next(c"free"),
        next(c"calloc"),
        next(c"realloc"),
        next(c"posix_memalign"),
    );
    if [free, calloc, realloc, posix_memalign]
        .iter()
        .any(|p| p.is_null())
    {
        return None;
    }
    let opt = |name: &std::ffi::CStr| Some(next(name)).filter(|p| !p.is_null());
    // SAFETY: each symbol is the C function of that name, with the C library's signature
    // (the ABI every malloc replacement keeps).
    unsafe {
        Some(Foreign {
            malloc: std::mem::transmute::<*mut c_void, MallocFn>(malloc),
            free: std::mem::transmute::<*mut c_void, FreeFn>(free),
            calloc: std::mem::transmute::<*mut c_void, CallocFn>(calloc),
            realloc: std::mem::transmute::<*mut c_void, ReallocFn>(realloc),
            posix_memalign: std::mem::transmute::<*mut c_void, PosixMemalignFn>(posix_memalign),
            aligned_alloc: opt(c"aligned_alloc")
                .map(|p| std::mem::transmute::<*mut c_void, AlignedFn>(p)),
            memalign: opt(c"memalign").map(|p| std::mem::transmute::<*mut c_void, AlignedFn>(p)),
            valloc: opt(c"valloc").map(|p| std::mem::transmute::<*mut c_void, MallocFn>(p)),
            pvalloc: opt(c"pvalloc").map(|p| std::mem::transmute::<*mut c_void, MallocFn>(p)),
            malloc_usable_size: opt(c"malloc_usable_size")
                .map(|p| std::mem::transmute::<*mut c_void, UsableSizeFn>(p)),
        })
    }
}

impl Foreign {
    /// An aligned block from the foreign allocator, for the entry points it may lack.
    fn aligned(&self, align: usize, size: usize) -> *mut c_void {
        let mut p = std::ptr::null_mut();
        let align = align.max(std::mem::size_of::<usize>());
        // SAFETY: the allocator's posix_memalign, writing to a local.
        match unsafe { (self.posix_memalign)(&mut p, align, size) } {
            0 => p,
            e => {
                set_errno(e);
                std::ptr::null_mut()
            }
        }
    }
}

loader::entry!(
    /// `malloc`, called from `caller`.
    fn malloc(size: usize) -> *mut c_void => malloc_from, "rsi", "x1"
);

/// Whether a block asked for from `caller` should come from this library's own memory: a
/// thread of netram's (or one inside the heap), or the dynamic loader (see [`loader`]; in a
/// forked child the loader is served as before the fork, from the allocator the child uses).
fn for_internal(caller: usize) -> bool {
    netram_uffd::alloc::is_inside()
        || (loader::from_loader(caller) && !IN_CHILD.load(Ordering::Relaxed))
}

extern "C" fn malloc_from(size: usize, caller: usize) -> *mut c_void {
    if for_internal(caller) {
        return internal::alloc(size, LIBC_ALIGN, false);
    }
    if let Some(f) = foreign() {
        // SAFETY: passed through.
        return unsafe { (f.malloc)(size) };
    }
    if let Some(h) = heap_for(size) {
        let p = heap_alloc(h, size, LIBC_ALIGN, false);
        if !p.is_null() {
            return p;
        }
    }
    // SAFETY: forwarded.
    unsafe { __libc_malloc(size) }
}

/// # Safety
/// The C library's contract for `free`.
#[no_mangle]
pub unsafe extern "C" fn free(ptr: *mut c_void) {
    if internal::owns(ptr) {
        return internal::free(ptr);
    }
    if let Some(f) = foreign() {
        // SAFETY: passed through: the block is the foreign allocator's.
        return unsafe { (f.free)(ptr) };
    }
    if ptr.is_null() {
        return;
    }
    if let Some(h) = owner(ptr) {
        return heap_free(h, ptr);
    }
    // SAFETY: not ours, so the C library's.
    unsafe { __libc_free(ptr) }
}

loader::entry!(
    /// `calloc`, called from `caller`.
    fn calloc(n: usize, size: usize) -> *mut c_void => calloc_from, "rdx", "x2"
);

extern "C" fn calloc_from(n: usize, size: usize, caller: usize) -> *mut c_void {
    let inside = for_internal(caller);
    if !inside {
        if let Some(f) = foreign() {
            // SAFETY: passed through.
            return unsafe { (f.calloc)(n, size) };
        }
    }
    let Some(total) = n.checked_mul(size) else {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    if inside {
        return internal::alloc(total, LIBC_ALIGN, true);
    }
    if let Some(h) = heap_for(total) {
        let p = heap_alloc(h, total, LIBC_ALIGN, true);
        if !p.is_null() {
            return p;
        }
    }
    // SAFETY: forwarded.
    unsafe { __libc_calloc(n, size) }
}

/// `malloc_usable_size` of the allocator behind `__libc_malloc`, found once: glibc's, or that of
/// an allocator that replaces glibc's own entry points too (tcmalloc and mimalloc define
/// `__libc_malloc`, so this library's small blocks are theirs). It is looked up in the object
/// that defines `__libc_malloc`, not as the next `malloc_usable_size`, which may be a foreign
/// allocator's (jemalloc's) that knows nothing of these blocks.
fn libc_usable_size(ptr: *mut c_void) -> usize {
    static REAL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
    let mut f = REAL.load(Ordering::Acquire);
    if f.is_null() {
        // SAFETY: dladdr fills `info` for an address of a loaded object; dlopen with
        // RTLD_NOLOAD only returns a handle of that already loaded object; dlsym looks up in it.
        f = unsafe {
            let mut info: libc::Dl_info = std::mem::zeroed();
            let owner = if libc::dladdr(__libc_malloc as *const c_void, &mut info) != 0
                && !info.dli_fname.is_null()
            {
                libc::dlopen(info.dli_fname, libc::RTLD_LAZY | libc::RTLD_NOLOAD)
            } else {
                std::ptr::null_mut()
            };
            if owner.is_null() {
                libc::dlsym(libc::RTLD_NEXT, c"malloc_usable_size".as_ptr())
            } else {
                libc::dlsym(owner, c"malloc_usable_size".as_ptr())
            }
        };
        REAL.store(f, Ordering::Release);
    }
    if f.is_null() {
        return 0;
    }
    // SAFETY: a malloc_usable_size has this signature; `ptr` is a block of its allocator.
    let f = unsafe { std::mem::transmute::<*mut c_void, UsableSizeFn>(f) };
    // SAFETY: as above.
    unsafe { f(ptr) }
}

loader::entry!(
    /// `realloc`, called from `caller`.
    fn realloc(ptr: *mut c_void, size: usize) -> *mut c_void => realloc_from, "rdx", "x2"
);

extern "C" fn realloc_from(ptr: *mut c_void, size: usize, caller: usize) -> *mut c_void {
    if internal::owns(ptr) {
        if size == 0 {
            internal::free(ptr);
            return std::ptr::null_mut();
        }
        return internal::realloc(ptr, size);
    }
    if ptr.is_null() && for_internal(caller) {
        return internal::alloc(size, LIBC_ALIGN, false);
    }
    if let Some(f) = foreign() {
        // SAFETY: passed through: the block (or null) is the foreign allocator's.
        return unsafe { (f.realloc)(ptr, size) };
    }
    if ptr.is_null() {
        // SAFETY: the contract of malloc.
        return unsafe { malloc(size) };
    }
    if size == 0 {
        // glibc's behaviour: free, and return NULL.
        // SAFETY: the contract of free.
        unsafe { free(ptr) };
        return std::ptr::null_mut();
    }
    if let Some(h) = owner(ptr) {
        if IN_CHILD.load(Ordering::Relaxed) {
            // A forked child reallocating a block it inherited: the new block is the C
            // library's (the child allocates nothing on the region), the old one stays. Its
            // size is not asked (that takes the heap's locks, which the fork may have copied
            // held): `size` bytes are copied, bounded by the region, and what lies past the
            // old block fills only the part of the new one that realloc leaves unspecified.
            // SAFETY: forwarded; the region is mapped (and served) in the child up to its end.
            unsafe {
                let new = __libc_malloc(size);
                if !new.is_null() {
                    let end = REGION_END.load(Ordering::Relaxed);
                    let n = size.min(end.saturating_sub(ptr as usize));
                    std::ptr::copy_nonoverlapping(ptr.cast::<u8>(), new.cast::<u8>(), n);
                }
                return new;
            }
        }
        let old = h.size_of(ptr.cast()).unwrap_or(0);
        if size <= old {
            return ptr;
        }
        // SAFETY: the contract of malloc.
        let new = unsafe { malloc(size) };
        if !new.is_null() {
            // SAFETY: `old` bytes of the old block into a new one of `size` > `old` bytes.
            unsafe { std::ptr::copy_nonoverlapping(ptr.cast::<u8>(), new.cast::<u8>(), old) };
            heap_free(h, ptr);
        }
        return new;
    }
    if let Some(h) = heap_for(size) {
        // A C library block grown past the threshold moves to the region.
        let new = heap_alloc(h, size, LIBC_ALIGN, false);
        if !new.is_null() {
            let old = libc_usable_size(ptr).min(size);
            // SAFETY: `old` bytes of the C library's block, which holds at least that many.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr.cast::<u8>(), new.cast::<u8>(), old);
                __libc_free(ptr);
            }
            return new;
        }
    }
    // SAFETY: forwarded.
    unsafe { __libc_realloc(ptr, size) }
}

/// An aligned block: from the heap when large, else from the C library.
fn aligned(align: usize, size: usize) -> *mut c_void {
    if netram_uffd::alloc::is_inside() {
        return internal::alloc(size, align, false);
    }
    if let Some(h) = heap_for(size) {
        let p = heap_alloc(h, size, align, false);
        if !p.is_null() {
            return p;
        }
    }
    // SAFETY: forwarded.
    unsafe { __libc_memalign(align, size) }
}

/// # Safety
/// The C library's contract for `posix_memalign`.
#[no_mangle]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> c_int {
    if let Some(f) = foreign() {
        // SAFETY: passed through.
        return unsafe { (f.posix_memalign)(out, align, size) };
    }
    if !align.is_power_of_two() || !align.is_multiple_of(std::mem::size_of::<usize>()) {
        return libc::EINVAL;
    }
    let p = aligned(align, size);
    if p.is_null() {
        return libc::ENOMEM;
    }
    // SAFETY: the caller's pointer to write to.
    unsafe { *out = p };
    0
}

/// # Safety
/// The C library's contract for `aligned_alloc`.
#[no_mangle]
pub unsafe extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    if let Some(f) = foreign() {
        return match f.aligned_alloc {
            // SAFETY: passed through.
            Some(a) => unsafe { a(align, size) },
            None => f.aligned(align, size),
        };
    }
    if !align.is_power_of_two() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    aligned(align, size)
}

/// # Safety
/// The C library's contract for `memalign`.
#[no_mangle]
pub unsafe extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    if let Some(f) = foreign() {
        return match f.memalign {
            // SAFETY: passed through.
            Some(m) => unsafe { m(align, size) },
            None => f.aligned(align, size),
        };
    }
    if !align.is_power_of_two() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    aligned(align, size)
}

/// # Safety
/// The C library's contract for `valloc`.
#[no_mangle]
pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
    if let Some(f) = foreign() {
        return match f.valloc {
            // SAFETY: passed through.
            Some(v) => unsafe { v(size) },
            None => f.aligned(PAGE_SIZE, size),
        };
    }
    aligned(PAGE_SIZE, size)
}

/// # Safety
/// The C library's contract for `pvalloc`.
#[no_mangle]
pub unsafe extern "C" fn pvalloc(size: usize) -> *mut c_void {
    if let Some(f) = foreign() {
        return match f.pvalloc {
            // SAFETY: passed through.
            Some(v) => unsafe { v(size) },
            None => f.aligned(PAGE_SIZE, size.max(1).next_multiple_of(PAGE_SIZE)),
        };
    }
    aligned(PAGE_SIZE, size.max(1).next_multiple_of(PAGE_SIZE))
}

/// # Safety
/// The C library's contract for `malloc_usable_size`.
#[no_mangle]
pub unsafe extern "C" fn malloc_usable_size(ptr: *mut c_void) -> usize {
    if internal::owns(ptr) {
        return internal::usable_size(ptr);
    }
    if let Some(f) = foreign() {
        // SAFETY: passed through: the block is the foreign allocator's.
        return f.malloc_usable_size.map_or(0, |u| unsafe { u(ptr) });
    }
    if ptr.is_null() {
        return 0;
    }
    match owner(ptr) {
        Some(h) => h.size_of(ptr.cast()).unwrap_or(0),
        None => libc_usable_size(ptr),
    }
}

/// Whether an `mmap` call reserves address space for anonymous memory to be committed later
/// (`PROT_NONE`, then `MAP_FIXED` read-write mappings inside it): how a JVM takes its heap. A
/// hint (`addr` without `MAP_FIXED`) is not kept, as the kernel need not keep it: a JVM that
/// wanted its heap at a low address for compressed pointers tries others, then takes any.
fn is_anonymous_reservation(_addr: *mut c_void, prot: c_int, flags: c_int) -> bool {
    is_private_anonymous(flags) && prot == libc::PROT_NONE
}

/// A reservation on the region: pages of the heap, none of them resident, `PROT_NONE` until
/// committed ([`commit_in_region`]); null if the region has no room (then the kernel's).
fn reserve(h: &Heap, len: usize) -> *mut c_void {
    let len = len.max(1).next_multiple_of(PAGE_SIZE);
    let Some(Some(p)) = enter(|| h.alloc(len, PAGE_SIZE)) else {
        return std::ptr::null_mut();
    };
    let p = p.as_ptr().cast::<c_void>();
    // Nothing of it resident (the handler must never copy a page the program cannot read),
    // and nothing on the servers: it reads as zeros once committed.
    // SAFETY: pages of the block just allocated, which nobody else uses.
    if release_within(h, p, len) != 0 || unsafe { libc::mprotect(p, len, libc::PROT_NONE) } != 0 {
        heap_free(h, p);
        return std::ptr::null_mut();
    }
    p
}

/// The heap, if an `mmap` call maps private anonymous memory at a fixed address inside the
/// region: a reservation's commit (read-write, or executable for a JIT's code) or uncommit
/// (`PROT_NONE`).
fn fixed_anonymous_in_region(addr: *mut c_void, len: usize, flags: c_int) -> Option<&'static Heap> {
    const MAP_TYPE: c_int = 0x0f;
    let fixed = flags & libc::MAP_FIXED != 0 && flags & libc::MAP_FIXED_NOREPLACE == 0;
    let end = (addr as usize).checked_add(len)?;
    let h = owner(addr)?;
    (fixed
        && flags & MAP_TYPE == libc::MAP_PRIVATE
        && flags & libc::MAP_ANONYMOUS != 0
        && flags & (libc::MAP_GROWSDOWN | libc::MAP_STACK | libc::MAP_HUGETLB) == 0
        && (addr as usize).is_multiple_of(PAGE_SIZE)
        && len > 0
        && end <= h.region().as_ptr() as usize + h.region().len())
    .then_some(h)
}

/// Whether `addr..addr + len` meets the region.
fn overlaps_region(addr: *mut c_void, len: usize) -> bool {
    let (start, end) = (
        REGION_START.load(Ordering::Relaxed),
        REGION_END.load(Ordering::Relaxed),
    );
    let a = addr as usize;
    start < end && a < end && a.saturating_add(len) > start
}

/// A fresh anonymous mapping over part of the region, as the kernel would make it: the pages
/// read as zeros (dropped here and on the servers), with `prot`. Replacing the mapping instead
/// would take those pages off the region's userfaultfd.
fn commit_in_region(h: &Heap, addr: *mut c_void, len: usize, prot: c_int) -> *mut c_void {
    let len = len.next_multiple_of(PAGE_SIZE);
    if release_within(h, addr, len) != 0 {
        return libc::MAP_FAILED;
    }
    // SAFETY: pages of the region, which the caller owns (it maps over them).
    if unsafe { libc::mprotect(addr, len, prot) } != 0 {
        return libc::MAP_FAILED;
    }
    addr
}

/// Whether an `mmap` call asks for plain private anonymous memory of `len` bytes that the
/// region can stand in for.
fn is_plain_anonymous(addr: *mut c_void, prot: c_int, flags: c_int) -> bool {
    addr.is_null() && is_private_anonymous(flags) && prot == libc::PROT_READ | libc::PROT_WRITE
}

/// Whether `mmap` flags ask for private anonymous memory wherever the kernel puts it, and
/// nothing the region cannot stand in for (a stack, huge pages).
fn is_private_anonymous(flags: c_int) -> bool {
    // The mapping type is a field of the low bits, not a flag: MAP_SHARED_VALIDATE (3) shares
    // a bit with MAP_PRIVATE (2). (Tested as flags, every private mapping was refused.)
    const MAP_TYPE: c_int = 0x0f;
    let refused = libc::MAP_FIXED
        | libc::MAP_FIXED_NOREPLACE
        | libc::MAP_GROWSDOWN
        | libc::MAP_STACK
        | libc::MAP_HUGETLB;
    flags & MAP_TYPE == libc::MAP_PRIVATE
        && flags & libc::MAP_ANONYMOUS != 0
        && flags & refused == 0
}

/// `mprotect`: a range of the region made unreadable (guard pages in the heap) is reported
/// to the region first, whose handler would otherwise die of SIGSEGV copying such a page out
/// (see `netram_uffd::Region::pages_may_become_unreadable`).
///
/// # Safety
/// The C library's contract for `mprotect`.
#[no_mangle]
pub unsafe extern "C" fn mprotect(addr: *mut c_void, len: usize, prot: c_int) -> c_int {
    if prot & libc::PROT_READ == 0
        && overlaps_region(addr, len)
        && !IN_CHILD.load(Ordering::Relaxed)
    {
        if let Some(h) = HEAP.get() {
            let _ = enter(|| h.region().pages_may_become_unreadable());
        }
    }
    // SAFETY: the system call itself, with the caller's arguments (not the C library's
    // wrapper, which is the symbol this function replaces).
    let r = unsafe { libc::syscall(libc::SYS_mprotect, addr, len, prot) };
    r as c_int
}

/// The C library's `fork` and `pthread_create`, looked up at load (see [`loader`]).
static FORK: loader::Next = loader::Next::new(c"fork");
static PTHREAD_CREATE: loader::Next = loader::Next::new(c"pthread_create");

/// `fork`, announced to the region first (see `netram_uffd::Region::prepare_fork`): the
/// child then gets its memory as it was at the fork, whether resident or on the servers.
///
/// # Safety
/// The C library's contract for `fork`.
#[no_mangle]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    type Fork = unsafe extern "C" fn() -> libc::pid_t;
    // SAFETY: the symbol is fork, with this signature.
    let Some(real) = (unsafe { FORK.get::<Fork>() }) else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    let heap = HEAP.get().filter(|_| {
        STATE.load(Ordering::Acquire) == READY
            && !IN_CHILD.load(Ordering::Relaxed)
            && FOLLOWS_FORKS.load(Ordering::Relaxed)
    });
    let announced = heap.and_then(|h| enter(|| h.region().prepare_fork()));
    // SAFETY: passed through.
    let pid = unsafe { real() };
    if pid > 0 {
        if let (Some(h), Some(())) = (heap, announced) {
            // SAFETY: this thread's errno, kept across the wait.
            let errno = unsafe { *libc::__errno_location() };
            let _ = enter(|| h.region().await_child(pid));
            set_errno(errno);
        }
    }
    if pid < 0 {
        if let (Some(h), Some(())) = (heap, announced) {
            // SAFETY: this thread's errno, kept across the call.
            let errno = unsafe { *libc::__errno_location() };
            let _ = enter(|| h.region().fork_failed());
            set_errno(errno);
        }
    }
    pid
}

type StartRoutine = extern "C" fn(*mut c_void) -> *mut c_void;

/// A thread netram's code starts (inside `enter`: the fault handler, keepalive, maintenance):
/// it is netram's own from its first instruction, so that nothing it allocates lands on the
/// region or in a foreign allocator (see [`foreign`]).
extern "C" fn internal_thread(arg: *mut c_void) -> *mut c_void {
    // SAFETY: `arg` is the box `pthread_create` below made for this thread, taken once.
    let start = unsafe { Box::from_raw(arg.cast::<(StartRoutine, usize)>()) };
    netram_uffd::alloc::mark_internal_thread();
    loader::mark_own_thread();
    (start.0)(start.1 as *mut c_void)
}

/// # Safety
/// The C library's contract for `pthread_create`.
#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    thread: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    start: StartRoutine,
    arg: *mut c_void,
) -> c_int {
    type Create = unsafe extern "C" fn(
        *mut libc::pthread_t,
        *const libc::pthread_attr_t,
        StartRoutine,
        *mut c_void,
    ) -> c_int;
    // SAFETY: the symbol is pthread_create, with this signature.
    let Some(real) = (unsafe { PTHREAD_CREATE.get::<Create>() }) else {
        return libc::EAGAIN;
    };
    if !netram_uffd::alloc::is_inside() {
        // SAFETY: passed through.
        return unsafe { real(thread, attr, start, arg) };
    }
    let boxed = Box::into_raw(Box::new((start, arg as usize)));
    // SAFETY: passed through with the trampoline, which takes the box back.
    let rc = unsafe { real(thread, attr, internal_thread, boxed.cast()) };
    if rc != 0 {
        // SAFETY: the thread was not created: the box is still ours.
        drop(unsafe { Box::from_raw(boxed) });
    }
    rc
}

/// # Safety
/// The C library's contract for `mmap`.
#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut c_void {
    if is_plain_anonymous(addr, prot, flags) {
        if let Some(h) = heap_for(len) {
            // Whole pages, reading as zeros, as a mapping does.
            let p = heap_alloc(h, len.max(PAGE_SIZE), PAGE_SIZE, true);
            if !p.is_null() {
                return p;
            }
        }
    } else if is_anonymous_reservation(addr, prot, flags) {
        // Only where the region serves the kernel's own accesses: what is committed in a
        // reservation (a coroutine's stack, a JIT's buffers) is handed to system calls.
        if let Some(h) = heap_for(len).filter(|h| h.region().serves_kernel_faults()) {
            let p = reserve(h, len);
            if !p.is_null() {
                return p;
            }
        }
    } else if let Some(h) = fixed_anonymous_in_region(addr, len, flags) {
        return commit_in_region(h, addr, len, prot);
    } else if flags & (libc::MAP_FIXED | libc::MAP_FIXED_NOREPLACE) != 0
        && overlaps_region(addr, len)
    {
        // Any other mapping there (a file's, shared memory) would replace part of the region
        // under the heap, which would later hand those addresses out again: refused. (A JVM
        // then maps its class-data archive elsewhere, or without it.)
        set_errno(libc::EINVAL);
        return libc::MAP_FAILED;
    }
    // SAFETY: the system call itself, with the caller's arguments (not the C library's
    // wrapper, which is the symbol this function replaces).
    unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, off) as *mut c_void }
}

/// # Safety
/// The C library's contract for `mmap64` (the same call on 64-bit Linux).
#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: libc::off_t,
) -> *mut c_void {
    // SAFETY: the same contract.
    unsafe { mmap(addr, len, prot, flags, fd, off) }
}

/// Gives back the whole pages of `addr..addr + len` inside a heap block without freeing the
/// block (a partial `munmap`, `madvise(DONTNEED)`): they read as zeros afterwards.
fn release_within(h: &Heap, addr: *mut c_void, len: usize) -> c_int {
    let base = h.region().as_ptr() as usize;
    let (start, end) = (addr as usize, (addr as usize).saturating_add(len));
    if !start.is_multiple_of(PAGE_SIZE) {
        set_errno(libc::EINVAL);
        return -1;
    }
    let end = end.next_multiple_of(PAGE_SIZE).min(base + h.region().len());
    if IN_CHILD.load(Ordering::Relaxed) || end <= start {
        return 0;
    }
    match enter(|| h.region().release(start - base, end - start)) {
        Some(Ok(())) => 0,
        Some(Err(e)) => {
            eprintln!("netram: releasing {addr:p}+{len}: {e}");
            set_errno(libc::EINVAL);
            -1
        }
        None => 0,
    }
}

/// # Safety
/// The C library's contract for `munmap`.
#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: usize) -> c_int {
    if let Some(h) = owner(addr) {
        let whole = h.size_of(addr.cast());
        if whole.is_some_and(|w| len.next_multiple_of(PAGE_SIZE) >= w) {
            heap_free(h, addr);
            return 0;
        }
        // Part of a block: its pages are given back, its addresses stay reserved.
        return release_within(h, addr, len);
    }
    // SAFETY: the system call with the caller's arguments.
    unsafe { libc::syscall(libc::SYS_munmap, addr, len) as c_int }
}

/// `mremap` is variadic in C (a fifth argument with `MREMAP_FIXED`); Rust cannot define
/// variadic functions, so the fifth argument is always taken: on x86-64 and aarch64 variadic
/// integer arguments travel in the same registers as fixed ones, and it is read only when
/// `MREMAP_FIXED` says the caller passed it.
///
/// # Safety
/// The C library's contract for `mremap`.
#[no_mangle]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: usize,
    new_len: usize,
    flags: c_int,
    new_addr: *mut c_void,
) -> *mut c_void {
    if let Some(h) = owner(old) {
        let Some(size) = h.size_of(old.cast()) else {
            set_errno(libc::EINVAL);
            return libc::MAP_FAILED;
        };
        if new_len <= size {
            // Shrinking (or growing within the block's pages): give back the tail.
            let keep = new_len.next_multiple_of(PAGE_SIZE);
            if keep < size {
                release_within(h, old.cast::<u8>().wrapping_add(keep).cast(), size - keep);
            }
            return old;
        }
        if flags & libc::MREMAP_FIXED != 0 || flags & libc::MREMAP_MAYMOVE == 0 {
            set_errno(libc::ENOMEM);
            return libc::MAP_FAILED;
        }
        // SAFETY: an anonymous mapping request, served by the region if it has room.
        let new = unsafe {
            mmap(
                std::ptr::null_mut(),
                new_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if new == libc::MAP_FAILED {
            return new;
        }
        // SAFETY: the old block's bytes (at most `size`) into the new, larger one.
        unsafe {
            std::ptr::copy_nonoverlapping(old.cast::<u8>(), new.cast::<u8>(), old_len.min(size))
        };
        heap_free(h, old);
        return new;
    }
    // SAFETY: the system call with the caller's arguments.
    unsafe {
        libc::syscall(libc::SYS_mremap, old, old_len, new_len, flags, new_addr) as *mut c_void
    }
}

/// # Safety
/// The C library's contract for `madvise`.
#[no_mangle]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: usize, advice: c_int) -> c_int {
    if let Some(h) = owner(addr) {
        return match advice {
            libc::MADV_DONTNEED | libc::MADV_FREE | libc::MADV_REMOVE => {
                release_within(h, addr, len)
            }
            // Other advice does not change what the region's memory holds.
            _ => 0,
        };
    }
    // SAFETY: the system call with the caller's arguments.
    unsafe { libc::syscall(libc::SYS_madvise, addr, len, advice) as c_int }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_private_anonymous_mappings_are_taken_and_no_others() {
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        let null = std::ptr::null_mut();
        assert!(is_plain_anonymous(null, rw, anon));
        // What jemalloc asks for.
        assert!(is_plain_anonymous(null, rw, anon | libc::MAP_NORESERVE));
        assert!(is_plain_anonymous(null, rw, anon | libc::MAP_POPULATE));
        let shared = libc::MAP_SHARED | libc::MAP_ANONYMOUS;
        assert!(!is_plain_anonymous(null, rw, shared));
        let validate = libc::MAP_SHARED_VALIDATE | libc::MAP_ANONYMOUS;
        assert!(!is_plain_anonymous(null, rw, validate));
        assert!(!is_plain_anonymous(null, rw, libc::MAP_PRIVATE));
        assert!(!is_plain_anonymous(null, libc::PROT_NONE, anon));
        assert!(!is_plain_anonymous(null, rw, anon | libc::MAP_STACK));
        assert!(!is_plain_anonymous(null, rw, anon | libc::MAP_FIXED));
        let hint = 0x7000_0000_0000usize as *mut c_void;
        assert!(!is_plain_anonymous(hint, rw, anon));
        // A JVM's heap reservation, with its hint for compressed pointers.
        let none = libc::PROT_NONE;
        assert!(is_anonymous_reservation(
            hint,
            none,
            anon | libc::MAP_NORESERVE
        ));
        assert!(!is_anonymous_reservation(null, rw, anon));
        assert!(!is_anonymous_reservation(
            hint,
            none,
            anon | libc::MAP_FIXED
        ));
        assert!(!is_anonymous_reservation(null, none, shared));
    }

    /// What the C library allocates on netram's own threads comes from talc, never from the C
    /// library's allocator (whose locks `fork` holds), and goes back there whoever frees it.
    #[test]
    fn netram_threads_never_allocate_from_the_c_library() {
        let p = std::thread::spawn(|| {
            netram_uffd::alloc::mark_internal_thread();
            // SAFETY: the contracts of the malloc family, on blocks this test owns.
            unsafe {
                let p = malloc(100);
                assert!(internal::owns(p));
                assert!(malloc_usable_size(p) >= 100);
                assert_eq!(p as usize % LIBC_ALIGN, 0);
                p.cast::<u8>().write_bytes(7, 100);
                let z = calloc(10, 30);
                assert!(internal::owns(z));
                assert!(std::slice::from_raw_parts(z.cast::<u8>(), 300)
                    .iter()
                    .all(|&b| b == 0));
                free(z);
                let a = aligned_alloc(4096, 4096);
                assert!(internal::owns(a));
                assert_eq!(a as usize % 4096, 0);
                free(a);
                let p = realloc(p, 10_000);
                assert!(internal::owns(p));
                assert!(std::slice::from_raw_parts(p.cast::<u8>(), 100)
                    .iter()
                    .all(|&b| b == 7));
                p as usize
            }
        })
        .join()
        .unwrap();
        // Freed by a thread of the program, as the C library does at a thread's exit.
        // SAFETY: the block from above, freed once.
        unsafe {
            let q = malloc(100);
            assert!(
                !internal::owns(q),
                "a program thread's block is the C library's"
            );
            free(q);
            free(p as *mut c_void);
        }
    }
}
