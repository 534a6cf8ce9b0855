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
//! (a JVM's heap); `fork`, `_exit` and `daemon`; `mprotect` (a range of the region made
//! unreadable is reported to it); and, for an ordinary user's region, the calls that copy bulk
//! data to or from the program's memory (`read`, `write`, `fread`..., see `io.rs`). glibc's
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
//! keeps it: the `malloc` family is passed through to it (see `Foreign`), and its memory
//! reaches the region through the interposed `mmap`.
//!
//! By concern: `arena.rs` (this library's own memory), `start.rs` (start, exit, `fork`, `daemon`,
//! `pthread_create`), `foreign.rs` (an allocator the program brings), `malloc.rs` (the `malloc`
//! family), `mmap.rs` (the `mmap` family), `loader.rs` (the dynamic loader), `io.rs` (bulk
//! copies for an ordinary user); this file, the state they share and the heap's entry points.
//!
//! Hazards: the library's own allocations come from memory it maps itself (talc, see
//! `Mapped`), never from the C library's allocator, whose locks `fork` holds: its Rust
//! allocations, and every block that a thread of netram's own or a thread already inside the
//! region's heap asks of the `malloc` family (the C library asks for some by itself), so the
//! heap's lock is never taken twice and no netram thread waits for a lock that `fork` holds. `fork` is announced to the region (see the
//! interposed `fork`): as root the child inherits the region and is served its memory as it
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

mod arena;
mod foreign;
mod io;
mod loader;
mod malloc;
mod mmap;
mod start;

use arena::*;
use foreign::*;
use start::*;

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

const UNINIT: u8 = 0;
const INITIALIZING: u8 = 1;
const READY: u8 = 2;
const OFF: u8 = 3;

static STATE: AtomicU8 = AtomicU8::new(UNINIT);
static HEAP: OnceLock<Heap> = OnceLock::new();
/// The thread that follows membership for the region (see `netram_capi::start_maintenance`; the
/// region's handler runs probes, reconnections and recovery itself).
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
/// The region's address range, for the SIGSEGV message of a forked child.
static REGION_START: AtomicUsize = AtomicUsize::new(0);
static REGION_END: AtomicUsize = AtomicUsize::new(0);

/// In a forked child that could not be served its copy of the region: the error (errno).
static CHILD_UNSERVED: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The SIGSEGV action the child had before `after_fork_in_child`, restored by `on_segv`.
static mut PREVIOUS_SEGV: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::zeroed();

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::malloc::*;
    use crate::mmap::*;

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
