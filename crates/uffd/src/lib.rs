//! netram's userfaultfd front end: a region of this process's memory whose pages live in the
//! cluster, paged in on first touch and out when the region holds more than its local budget.
//!
//! This is how netram reaches programs without root or the kernel's swap (the Anemone paper's
//! remark, §2.2, that remote memory can be mapped by programs that know of it; Dodo and AIFM
//! which it cites). A [`Region`] maps anonymous memory and registers it with userfaultfd; a
//! handler thread serves its faults through the core's pager:
//!
//! * a page never written is installed as the zero page (or, for a write, a page of zeros),
//!   without a network round trip;
//! * a page that was evicted is fetched from its server and installed with `UFFDIO_COPY`;
//! * when more than `budget` pages are resident, victims are evicted, after the faulting
//!   thread is woken and in batches whose pages leave together (one `process_madvise`, one
//!   TLB shootdown). Victims are chosen by CLOCK over sampled accesses
//!   (`netram_policy::clock`; GMS §4.2 sampled by flushing TLB entries): the hand *samples* a
//!   used page by moving it aside with `UFFDIO_MOVE` (page-table entries only, no copy) into
//!   a shadow mapping; if the program touches it again, the fault puts it back and it was
//!   referenced; if it is still aside when the hand comes round, it is the victim, and since
//!   no thread can reach it there it is copied out and stored without further ado. A victim
//!   still mapped (the hand samples at most 8 pages per victim) is write-protected first
//!   (`UFFDIO_WRITEPROTECT`), so that a write racing with the copy-out blocks instead of being
//!   lost, then copied to the pager (an all-zero page is discarded: stored as nothing), then
//!   dropped; the writer, woken afterwards, faults again and gets the page back. The price of
//!   sampling is one extra fault per sampled page still in use (`sample_faults`), measured by
//!   `netram bench uffd`; `victims_approximate_lru` in the tests compares the misses with
//!   exact LRU and FIFO on one trace;
//! * a page fetched by a read is installed write-protected while that pays: its first write
//!   is then a write-protect fault that marks it dirty and lifts the protection, and a page
//!   never written since its fetch is evicted by dropping it, without copying or sending
//!   anything (its remote copy is current). When most fetched pages get written anyway, the
//!   second fault costs more than the write-backs it saves, and fetched pages are installed
//!   writable (one in 16 still protected, to notice a change);
//! * after each fault, the pages a trend detector (`netram_policy::prefetch`, after Leap)
//!   expects next are fetched with one pipelined read; three in four are mapped at once, so
//!   that a sequential or strided scan does not fault on them at all, and one in four waits
//!   in the pager's cache to be faulted on: whether those are used is the hit rate, counted.
//!
//! Hazards handled here: `EEXIST` from `UFFDIO_COPY`/`ZEROPAGE` (two threads faulted the same
//! page; the first fault installed it: the second is only woken); `EAGAIN` (the region is
//! changing under the handler: the fault is woken and retried by the kernel); faults from any
//! number of threads (one handler serves them in order); a write-protect fault on a page being
//! evicted (woken after the eviction, it becomes a missing fault). Root's userfaultfd serves
//! faults raised inside system calls too; an ordinary user's is created with
//! `UFFD_USER_MODE_ONLY` (allowed where `vm.unprivileged_userfaultfd` is 0), so there a system
//! call reading or writing a page that is not resident fails with EFAULT.
//!
//! `fork`: as root the region follows forks (`UFFD_FEATURE_EVENT_FORK`). The child's page
//! tables hold what was resident; its other pages fault to a descriptor of its own, which this
//! handler serves from the pager; before the parent's side changes a page in the pager, the
//! page is installed in every child that lacks it, so the child keeps its memory as it was at
//! the fork (see `ForkChild`). [`Region::prepare_fork`] (what `netram run`'s `fork` calls
//! first) makes the fork exact: nothing is evicted until its event arrives, and sampled pages
//! come back first. An ordinary user's region is not inherited at all (`MADV_DONTFORK`).
//!
//! The program gives memory back with [`Region::release`] (what `free` and `munmap` become
//! under `netram run`): its pages are dropped locally and deleted on their servers. The
//! kernel's remove and unmap events are not used for that: they make the thread calling
//! `madvise` or `munmap` wait until the handler has read the event, and the handler itself
//! drops pages with `MADV_DONTNEED`, so it would wait for itself.
//!
//! A page that cannot be read at all (lost with more servers than its redundancy tolerates,
//! bad on every copy, the local disk failing) makes the faulting thread die of SIGBUS, with the
//! page and the reason on stderr, as the kernel answers a swap-in it cannot read: the handler
//! knows the thread (`UFFD_FEATURE_THREAD_ID`) and signals it before waking it.
//!
//! A handler that dies (an error reading the userfaultfd, a panic) does not leave the program
//! hanging: the region is made inaccessible and the waiting threads are woken, so they die of
//! SIGSEGV, loudly, rather than wait forever or read zeros.

pub mod alloc;
pub mod heap;
mod sys;

pub use alloc::NetramAlloc;
pub use heap::RegionHeap;
use netram_pager::{Disk, Pager, Transport};
use netram_policy::clock::Clock;
use netram_policy::prefetch::{Mode, Prefetcher, MAX_CLUSTER};
use netram_proto::PAGE_SIZE;
use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};
use rustix::fd::OwnedFd;
use rustix::io::Errno;
use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use sys::{Event, Uffd};

#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("a region needs a size above zero and a budget of at least one page")]
    BadSize,
    #[error("the region ({pages} pages) is larger than its pager ({pager_pages} pages)")]
    LargerThanPager { pages: u64, pager_pages: u64 },
    #[error("cannot map the region: {0}")]
    Map(rustix::io::Errno),
    #[error(
        "cannot open userfaultfd: {0} (as an ordinary user this needs UFFD_USER_MODE_ONLY, \
         Linux 5.11 or later)"
    )]
    UserfaultfdSyscall(rustix::io::Errno),
    #[error("cannot register the region with userfaultfd: {0}")]
    Register(rustix::io::Errno),
    #[error("cannot start the fault handler: {0}")]
    Handler(std::io::Error),
    #[error("{offset}+{len} is not a range of whole pages within the region")]
    BadRange { offset: usize, len: usize },
    #[error("releasing pages: {0}")]
    Release(#[source] PageError),
}

/// Why the handler could not evict or release a page; the page stays as it was.
#[derive(Debug, thiserror::Error)]
pub enum PageError {
    #[error("write-protecting page {page}: {errno}")]
    WriteProtect {
        page: usize,
        errno: rustix::io::Errno,
    },
    #[error("copying page {page}: {errno}")]
    Copy {
        page: usize,
        errno: rustix::io::Errno,
    },
    #[error("storing page {page}: {source}")]
    Store {
        page: usize,
        #[source]
        source: netram_pager::PagerError,
    },
    #[error("dropping pages: {0}")]
    Drop(rustix::io::Errno),
    #[error("deleting released pages: {0}")]
    Delete(#[source] netram_pager::PagerError),
}

/// What the handler has done, for tests, benchmarks and `netram run`'s report.
#[derive(Debug, Default)]
pub struct RegionCounters {
    /// Missing-page faults served.
    pub faults: AtomicU64,
    /// ... of which by installing the zero page (never written: no I/O).
    pub zero_fills: AtomicU64,
    /// ... of which by fetching the page from the pager.
    pub fetches: AtomicU64,
    /// ... of which fetched together with other threads' faults waiting at the same time (one
    /// pipelined read for all of them: see `Shared::drain_events`).
    pub batched_fetches: AtomicU64,
    /// Faults that found their page already installed by an earlier fault (EEXIST).
    pub already_present: AtomicU64,
    /// Write-protect faults (a write that raced with an eviction).
    pub write_protect_faults: AtomicU64,
    /// Pages evicted to the pager.
    pub evictions: AtomicU64,
    /// ... of which all zeros, discarded instead of stored.
    pub evicted_zero: AtomicU64,
    /// ... of which clean (fetched and never written since): dropped without any I/O.
    pub evicted_clean: AtomicU64,
    /// First writes to fetched pages (write-protect faults that mark a page dirty).
    pub first_writes: AtomicU64,
    /// Pages fetched ahead by the prefetcher and left in the pager's cache to be faulted on.
    pub prefetched: AtomicU64,
    /// ... of which faulted on later (served from the pager's cache): the hit rate.
    pub prefetch_hits: AtomicU64,
    /// Pages fetched ahead and installed at once (three in four), so that a scan does not
    /// fault on them.
    pub prefetch_installed: AtomicU64,
    /// Pages taken out of the page tables to see whether they are used (`UFFDIO_MOVE`).
    pub samples: AtomicU64,
    /// ... that were touched again (a missing fault, counted in `faults` too): the price of
    /// the LRU approximation.
    pub sample_faults: AtomicU64,
    /// Samples the kernel refused (the page stays mapped, counted as used).
    pub sample_failures: AtomicU64,
    /// Pages given back by the program (`release`).
    pub released: AtomicU64,
    /// Resident pages the program dropped behind the region's back (`madvise(MADV_DONTNEED)`
    /// by system call): found on their next fault, they read as zeros, as anonymous memory
    /// does.
    pub dropped_by_program: AtomicU64,
    /// Victims passed over because the program made them unreadable (`mprotect(PROT_NONE)`):
    /// they stay resident until it makes them readable again.
    pub unreadable_victims: AtomicU64,
    /// Faults the handler could not serve: the pager failed, or the kernel refused to install
    /// the page (the mapping was changing: the thread is woken and faults again). Logged.
    pub errors: AtomicU64,
    /// Faults on pages that could not be read at all (lost with their servers, bad on every
    /// copy, the local disk failing): the faulting thread got SIGBUS, as the kernel answers a
    /// swap-in it cannot read.
    pub sigbus: AtomicU64,
    /// Faults woken to be retried because the mapping was changing (a fork copying it).
    pub retried: AtomicU64,
    /// Forked children that inherited the region.
    pub forks: AtomicU64,
    /// Faults of forked children served (their pages installed in their memory).
    pub child_faults: AtomicU64,
    /// Pages installed in a child before the parent changed them in the pager (its
    /// copy-on-write, done by the handler).
    pub child_copies: AtomicU64,
}

impl RegionCounters {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    /// The share of prefetched pages that were used; `None` before any prefetch.
    pub fn prefetch_hit_rate(&self) -> Option<f64> {
        let n = Self::get(&self.prefetched);
        (n > 0).then(|| Self::get(&self.prefetch_hits) as f64 / n as f64)
    }
}

/// A page of zeros to install for a write to a page never written.
static ZEROS: [u8; PAGE_SIZE] = [0; PAGE_SIZE];

/// The most victims dropped together (see `Shared::make_room`).
const EVICT_BATCH: usize = 32;
/// At most this many faults wait to be fetched together (see `Shared::drain_events`): the
/// pager's window per server, so that one `read_many` sends them all at once.
const FETCH_BATCH: usize = 32;

/// One prefetched page in this many is left to be faulted on, to measure the hit rate; the
/// others are installed at once.
const PREFETCH_CHECK: usize = 4;

/// The most pages fetched ahead at one fault.
const MAX_PREFETCH: usize = 16;

/// How a forked child's copy of the region is served (see [`ForkChild`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Forks {
    /// The kernel hands the handler the child's descriptor (`UFFD_FEATURE_EVENT_FORK`, which
    /// needs `CAP_SYS_PTRACE`).
    Event,
    /// The child opens a descriptor of its own right after the fork, registers its copy of the
    /// region and sends the descriptor to the handler over a socket (see
    /// [`Region::follow_in_child`]): an ordinary user allowed `/dev/userfaultfd`.
    ByChild,
    /// Not inherited at all (`MADV_DONTFORK`): an ordinary user with a user-mode-only
    /// descriptor, whose child could not be served its pages inside system calls.
    No,
}

const WP: u64 = linux_raw_sys::general::UFFD_FEATURE_PAGEFAULT_FLAG_WP as u64;
const MOVE: u64 = linux_raw_sys::general::UFFD_FEATURE_MOVE as u64;
/// The faulting thread's id, for the SIGBUS of a page that cannot be read (Linux 4.14).
const TID: u64 = linux_raw_sys::general::UFFD_FEATURE_THREAD_ID as u64;
const FORK: u64 = linux_raw_sys::general::UFFD_FEATURE_EVENT_FORK as u64;

/// A non-blocking userfaultfd with write-protect faults and, where the kernel has it (6.8 on),
/// `UFFDIO_MOVE`: the second value says whether it does; the third how forks are followed.
///
/// Faults raised by the kernel itself (a `read(2)` into region memory, a `write(2)` from it)
/// are served too when the process may ask for that: by the system call for root,
/// `CAP_SYS_PTRACE` or where `vm.unprivileged_userfaultfd` is 1; else through
/// `/dev/userfaultfd` for whoever may open it (Linux 6.1; root's only by default,
/// administrators grant it by group). Otherwise the userfaultfd is for user-mode faults only
/// (`UFFD_USER_MODE_ONLY`, allowed to everyone): the program still works, but a system call
/// that touches a page of the region which is not resident fails with EFAULT.
fn open_userfaultfd() -> Result<(Uffd, bool, Forks), RegionError> {
    /// With `UFFDIO_MOVE` if the kernel has it: a kernel without refuses the handshake
    /// (EINVAL), and the region works without access sampling (first in, first out).
    fn with_move(open: impl Fn(u64) -> Result<Uffd, Errno>) -> Result<(Uffd, bool), Errno> {
        match open(WP | MOVE | TID) {
            Ok(u) => Ok((u, true)),
            Err(Errno::INVAL) => {
                tracing::debug!("no UFFDIO_MOVE: regions evict first in, first out");
                open(WP | TID).map(|u| (u, false))
            }
            Err(e) => Err(e),
        }
    }
    // Fork events with or without moves (a kernel before 6.8 has no UFFDIO_MOVE).
    match with_move(|f| Uffd::open(f | FORK, false)) {
        Ok((u, m)) => return Ok((u, m, Forks::Event)),
        Err(e) => tracing::debug!("userfaultfd without fork events: {e}"),
    }
    // Children serve themselves only where the process's forks call `follow_in_child`.
    let by_child = if CHILDREN_FOLLOW.load(Ordering::Relaxed) {
        Forks::ByChild
    } else {
        Forks::No
    };
    match with_move(|f| Uffd::open(f, false)) {
        Ok((u, m)) => return Ok((u, m, by_child)),
        Err(e) => tracing::debug!("userfaultfd(2) for every fault: {e}"),
    }
    match with_move(Uffd::open_device) {
        Ok((u, m)) => return Ok((u, m, by_child)),
        Err(e) => tracing::debug!("/dev/userfaultfd: {e}"),
    }
    let (u, m) = with_move(|f| Uffd::open(f, true)).map_err(RegionError::UserfaultfdSyscall)?;
    Ok((u, m, Forks::No))
}

static CHILDREN_FOLLOW: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Promises that from now on every child this process forks calls [`Region::follow_in_child`]
/// for each region before it touches one (`netram run`'s preload library does, from a
/// `pthread_atfork` child handler). Regions made afterwards are then inherited by children
/// where the kernel cannot follow forks itself (an ordinary user); without the promise they
/// are not (`MADV_DONTFORK`: a child touching one dies of SIGSEGV), since an inherited copy
/// that nobody serves would read its evicted pages as zeros.
pub fn children_follow_regions() {
    CHILDREN_FOLLOW.store(true, Ordering::Relaxed);
}

/// A descriptor for a forked child's copy of the region (see [`Forks::ByChild`]): as the
/// parent got one, without write-protection or moves (the child's pages are only installed).
fn open_for_child() -> Result<Uffd, Errno> {
    Uffd::open(TID, false).or_else(|_| Uffd::open_device(TID))
}

/// The socket over which forked children send their descriptors ([`Forks::ByChild`]).
#[derive(Debug)]
struct ForkChannel {
    /// The handler's end; closed in a child (`AtomicI32`: the child closes its copy).
    receiver: std::sync::atomic::AtomicI32,
    /// Every descendant's end (inherited across forks, closed at `exec`).
    sender: OwnedFd,
}

/// Whether child `pid` has ended (or was reaped, or is not this process's child), without
/// reaping it.
fn child_ended(pid: libc::pid_t) -> bool {
    // SAFETY: an all-zero siginfo_t is valid; waitid writes one and takes no other pointer.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; WNOWAIT leaves the child to whoever waits for it.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    // SAFETY: waitid filled `info` (or left it zeroed: no child has changed state).
    rc != 0 || unsafe { info.si_pid() } != 0
}

impl Drop for ForkChannel {
    fn drop(&mut self) {
        let fd = self.receiver.swap(-1, Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: the handler's end, owned here and no longer polled (the handler has
            // been joined before the region's shared state goes).
            drop(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        }
    }
}

/// What a child sends with its descriptor: its pid, its parent's, and 1 if it registered its
/// copy (0: it could not, and sends no descriptor).
const FORK_MESSAGE: usize = 12;

/// A mapping's base address, shared with the handler thread. A plain address: the handler
/// only passes it to the kernel and copies pages through it while nothing else can change them.
#[derive(Debug, Clone, Copy)]
struct Base(NonNull<u8>);
// SAFETY: the address is only dereferenced for pages of a mapping the Region keeps alive until
// the handler has been joined, under the rules stated where it is dereferenced.
unsafe impl Send for Base {}
// SAFETY: as above; the address itself is immutable.
unsafe impl Sync for Base {}

impl Base {
    fn page(self, page: usize) -> *mut c_void {
        self.0.as_ptr().wrapping_add(page * PAGE_SIZE).cast()
    }
}

/// Maps `len` bytes of private anonymous memory, without huge pages (the region moves single
/// pages in and out); with `dontfork`, not inherited by a child process.
///
/// `fork`: where the handler follows forks (`UFFD_FEATURE_EVENT_FORK`), the child inherits the
/// region and its faults come to the handler (see [`Shared::fork_event`]). Where it cannot
/// (an ordinary user), `MADV_DONTFORK`: without it the child would get the region
/// unregistered, its resident pages copied and every evicted page silently reading as zeros.
/// With it, the child has no mapping there, and touching it is a SIGSEGV: refused loudly
/// rather than wrong quietly.
fn map_anonymous(len: usize, dontfork: bool) -> Result<Base, RegionError> {
    // SAFETY: a fresh anonymous private mapping at an address the kernel chooses; it aliases
    // nothing, and it is unmapped only in Region's Drop after the handler has stopped.
    let ptr = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::NORESERVE,
        )
    }
    .map_err(RegionError::Map)?;
    // SAFETY: our fresh mapping; advice changes no contents.
    let _ = unsafe { rustix::mm::madvise(ptr, len, rustix::mm::Advice::LinuxNoHugepage) };
    if dontfork {
        // SAFETY: as above.
        if let Err(e) = unsafe { rustix::mm::madvise(ptr, len, rustix::mm::Advice::LinuxDontFork) }
        {
            unmap(Base(NonNull::new(ptr.cast()).expect("not null")), len);
            return Err(RegionError::Map(e));
        }
    }
    Ok(Base(
        NonNull::new(ptr.cast()).expect("mmap does not return null"),
    ))
}

fn unmap(base: Base, len: usize) {
    // SAFETY: a mapping made by `map_anonymous` whose users are gone (see callers).
    let _ = unsafe { rustix::mm::munmap(base.0.as_ptr().cast(), len) };
}

/// Drops pages of our own mappings (their contents are stored or garbage: see callers).
fn drop_pages(addr: *mut c_void, len: usize) -> Result<(), rustix::io::Errno> {
    // SAFETY: callers pass pages of the region or its shadow whose contents are no longer
    // needed; the region's next access faults them back in through the handler. No event is
    // registered for MADV_DONTNEED, so this does not wait for the handler (which calls it).
    unsafe { rustix::mm::madvise(addr, len, rustix::mm::Advice::LinuxDontNeed) }
}

/// A region of memory paged from the cluster.
pub struct Region<T: Transport, D: Disk> {
    shared: Arc<Shared<T, D>>,
    stop: Arc<OwnedFd>,
    handler: Option<JoinHandle<()>>,
}

impl<T: Transport, D: Disk> std::fmt::Debug for Region<T, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("base", &self.shared.base.0)
            .field("pages", &self.shared.pages)
            .field("counters", &self.shared.counters)
            .finish()
    }
}

/// How a region chooses its victims.
#[derive(Debug, Clone)]
pub struct RegionOptions {
    /// The most pages sampled to find one victim (see `netram_policy::clock`); 0 (the
    /// default: it did not pay on any real program measured) turns sampling off: victims are
    /// then chosen first in, first out.
    pub max_samples: usize,
    /// How long the handler polls for the next fault before sleeping, while faults come that
    /// close together (the low-latency mode; zero: never).
    pub spin: std::time::Duration,
}

impl Default for RegionOptions {
    fn default() -> Self {
        Self {
            max_samples: 0,
            spin: std::time::Duration::ZERO,
        }
    }
}

impl<T, D> Region<T, D>
where
    T: Transport + Send + 'static,
    D: Disk + Send + 'static,
{
    /// Maps `size` bytes (rounded up to whole pages) backed by `pager`'s pages 0.., of which at
    /// most `budget` bytes (at least one page) are resident at a time.
    pub fn new(pager: Pager<T, D>, size: usize, budget: usize) -> Result<Self, RegionError> {
        Self::with_options(pager, size, budget, RegionOptions::default())
    }

    /// As [`Region::new`], with options.
    pub fn with_options(
        pager: Pager<T, D>,
        size: usize,
        budget: usize,
        options: RegionOptions,
    ) -> Result<Self, RegionError> {
        let pages = size.div_ceil(PAGE_SIZE);
        let budget_pages = budget / PAGE_SIZE;
        if pages == 0 || budget_pages == 0 {
            return Err(RegionError::BadSize);
        }
        if pages as u64 > pager.config().pages {
            return Err(RegionError::LargerThanPager {
                pages: pages as u64,
                pager_pages: pager.config().pages,
            });
        }
        let len = pages * PAGE_SIZE;
        let (uffd, can_move, forks) = open_userfaultfd()?;
        let follows_forks = forks != Forks::No;
        let fork_channel = if forks == Forks::ByChild {
            let (receiver, sender) = rustix::net::socketpair(
                rustix::net::AddressFamily::UNIX,
                rustix::net::SocketType::SEQPACKET,
                rustix::net::SocketFlags::CLOEXEC,
                None,
            )
            .map_err(|e| RegionError::Handler(e.into()))?;
            use std::os::fd::IntoRawFd;
            Some(ForkChannel {
                receiver: std::sync::atomic::AtomicI32::new(receiver.into_raw_fd()),
                sender,
            })
        } else {
            None
        };
        let base = map_anonymous(len, !follows_forks)?;
        if let Err(e) = uffd.register(base.page(0), len, true) {
            unmap(base, len);
            return Err(RegionError::Register(e));
        }
        // Sampled pages wait in the shadow, at the same offsets. UFFDIO_MOVE wants its
        // destination registered, and both mappings alike; nothing ever faults there.
        let sampling = can_move && options.max_samples > 0;
        let shadow = if sampling {
            // Never inherited: a child gets every page from the region (see `prepare_fork`).
            let shadow = map_anonymous(len, true).inspect_err(|_| unmap(base, len))?;
            if let Err(e) = uffd.register(shadow.page(0), len, true) {
                unmap(base, len);
                unmap(shadow, len);
                return Err(RegionError::Register(e));
            }
            Some(shadow)
        } else {
            None
        };
        let unmap_both = |e| {
            unmap(base, len);
            if let Some(s) = shadow {
                unmap(s, len);
            }
            e
        };
        let stop = Arc::new(
            eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
                .map_err(|e| unmap_both(RegionError::Handler(e.into())))?,
        );
        // Prefetched pages wait in the pager's cache: no cache, no prefetching.
        let prefetch_window = pager.config().cache_pages;
        let shared = Arc::new(Shared {
            base,
            shadow,
            pages,
            uffd,
            counters: RegionCounters::default(),
            state: Mutex::new(State {
                pager,
                clock: Clock::new(pages, if sampling { options.max_samples } else { 0 }),
                max_samples: if sampling { options.max_samples } else { 0 },
                dirty: vec![false; pages],
                budget: budget_pages,
                buf: vec![0u8; PAGE_SIZE],
                prefetcher: Prefetcher::new(
                    MAX_PREFETCH.min(prefetch_window / 2),
                    MAX_CLUSTER.min(prefetch_window / 2),
                ),
                prefetched: HashMap::new(),
                prefetch_order: VecDeque::new(),
                prefetch_window,
                pbuf: Vec::new(),
                drops: Vec::new(),
                waiting: Vec::new(),
                wbuf: Vec::new(),
                protected_fetches: 0,
                written_after_fetch: 0,
                skipped_protection: 0,
                prefetch_seq: 0,
                child_buf: vec![0u8; PAGE_SIZE],
                children: Vec::new(),
                forking: 0,
                fork_resident: None,
                forking_since: None,
                last_probe: std::time::Instant::now(),
            }),
            follows_forks,
            fork_channel,
            child_count: AtomicUsize::new(0),
            forked: Condvar::new(),
            pidfd: rustix::process::pidfd_open(
                rustix::process::getpid(),
                rustix::process::PidfdFlags::empty(),
            )
            .ok(),
            pid: rustix::process::getpid().as_raw_nonzero().get(),
            unreadable_possible: std::sync::atomic::AtomicBool::new(false),
            spin: options.spin,
        });
        let (s, stop_fd) = (shared.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("netram-uffd".into())
            .spawn(move || {
                // Its allocations must never land on the region it serves.
                alloc::mark_internal_thread();
                s.run(&stop_fd)
            })
            .map_err(|e| unmap_both(RegionError::Handler(e)))?;
        Ok(Self {
            shared,
            stop,
            handler: Some(thread),
        })
    }
}

impl<T: Transport, D: Disk> Region<T, D> {
    pub fn as_ptr(&self) -> *mut u8 {
        self.shared.base.0.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.shared.pages * PAGE_SIZE
    }

    pub fn is_empty(&self) -> bool {
        self.shared.pages == 0
    }

    /// The region as bytes. Reading faults pages in as needed.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes, readable, and lives as long as `self`. Its
        // contents change behind the slice only by the handler reinstalling exactly the bytes
        // that were there (a page in or out is invisible to the program).
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }

    /// The region as mutable bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only slice.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len()) }
    }

    pub fn counters(&self) -> &RegionCounters {
        &self.shared.counters
    }

    /// Pages held in local memory now (mapped or sampled).
    pub fn resident_pages(&self) -> usize {
        self.shared.lock().clock.len()
    }

    /// The local budget in bytes.
    pub fn budget(&self) -> usize {
        self.shared.lock().budget * PAGE_SIZE
    }

    /// Changes the local budget (at least one page); lowering it evicts at once.
    pub fn set_budget(&self, bytes: usize) {
        let mut st = self.shared.lock();
        st.budget = (bytes / PAGE_SIZE).max(1);
        let keep = st.budget;
        self.shared.make_room(&mut st, keep);
    }

    /// Gives back the whole pages of `offset..offset + len` (both multiples of the page size
    /// within the region): their local memory is freed, their remote copies are deleted, and
    /// they read as zeros afterwards. What `free` and `munmap` of memory in a region mean.
    pub fn release(&self, offset: usize, len: usize) -> Result<(), RegionError> {
        if !offset.is_multiple_of(PAGE_SIZE)
            || !len.is_multiple_of(PAGE_SIZE)
            || offset.checked_add(len).is_none_or(|end| end > self.len())
        {
            return Err(RegionError::BadRange { offset, len });
        }
        let mut st = self.shared.lock();
        while st.forking > 0 {
            // The pages must not change in the pager before the child knows them.
            st = self
                .shared
                .forked
                .wait_timeout(st, std::time::Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        self.shared
            .release(&mut st, offset / PAGE_SIZE, len / PAGE_SIZE)
            .map_err(RegionError::Release)
    }

    /// Fault point: the handler thread ends as if it had failed.
    #[cfg(test)]
    fn kill_handler(&self) {
        let _ = rustix::io::write(&*self.stop, &DIE.to_ne_bytes());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }

    /// The program may make pages of the region unreadable (`mprotect` without
    /// `PROT_READ`; what `netram run`'s `mprotect` reports): from now on the handler copies
    /// victims out through the kernel, and passes over those it cannot read (kept resident,
    /// counted in `unreadable_victims`), instead of dying of SIGSEGV on them.
    /// Returns once no victim is being copied the old way (it waits for the handler's
    /// current event): call it before protecting the pages.
    pub fn pages_may_become_unreadable(&self) {
        if !self
            .shared
            .unreadable_possible
            .swap(true, Ordering::Relaxed)
        {
            // Evictions run under the state's lock and read the flag there.
            drop(self.shared.lock());
        }
    }

    /// Whether a forked child inherits the region (root: `UFFD_FEATURE_EVENT_FORK` needs
    /// `CAP_SYS_PTRACE`). Where it does not, the region is not mapped in the child at all.
    pub fn follows_forks(&self) -> bool {
        self.shared.follows_forks
    }

    /// Called by a thread about to `fork` (`netram run`'s `fork`): until the child's event
    /// arrives, nothing is evicted and no page changes in the pager, and the pages sampled
    /// aside come back, so that the child gets every resident page with the fork and can be
    /// served the others from the pager. Then [`Region::fork_failed`] if `fork` failed.
    pub fn prepare_fork(&self) {
        let mut st = self.shared.lock();
        self.shared.prepare_fork(&mut st);
    }

    /// In the parent, after an announced `fork` made child `pid`: where children open their
    /// own descriptors ([`Region::follow_in_child`]), waits until the handler has the child's
    /// (or the child has ended, or 30 s have passed), so that the parent's side changes no
    /// page the child may still need before the handler knows of it. As the kernel holds a
    /// `fork` until the handler has read its event where it sends one.
    pub fn await_child(&self, pid: libc::pid_t) {
        if self.shared.fork_channel.is_none() {
            return;
        }
        let since = std::time::Instant::now();
        let mut st = self.shared.lock();
        while st.forking > 0 {
            let waited = since.elapsed();
            if child_ended(pid) || waited > std::time::Duration::from_secs(30) {
                if waited > std::time::Duration::from_secs(30) {
                    tracing::warn!("forked child {pid} sent no userfaultfd in 30 s");
                }
                self.shared.fork_done(&mut st);
                break;
            }
            st = self
                .shared
                .forked
                .wait_timeout(st, std::time::Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// In a child just forked (from a `pthread_atfork` child handler, before the program goes
    /// on), where the region's faults cannot follow forks by themselves ([`Forks::ByChild`]):
    /// opens a userfaultfd of the child's own, registers the child's copy of the region and
    /// sends the descriptor to the parent's handler, which serves it from then on as it would
    /// a descriptor from a fork event. Until the handler has it, the parent waits
    /// ([`Region::await_child`]). Allocates nothing and takes no lock (another thread of the
    /// parent may have held any at the fork).
    ///
    /// An error means the child's copy is not served: its pages that were not resident at the
    /// fork would read as zeros. The caller must make the region inaccessible.
    /// Nothing to do (`Ok`) where forks are followed otherwise or not at all.
    pub fn follow_in_child(&self) -> Result<(), Errno> {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let Some(channel) = &self.shared.fork_channel else {
            return Ok(());
        };
        // The handler's end is the parent's: closed here, so that once every process that
        // could read it is gone, a descendant's send fails instead of going unread.
        let receiver = channel.receiver.swap(-1, Ordering::Relaxed);
        if receiver >= 0 {
            // SAFETY: this process's copy of the handler's end, not used here again.
            drop(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(receiver) });
        }
        let len = self.shared.pages * PAGE_SIZE;
        let opened = open_for_child()
            .and_then(|u| u.register(self.shared.base.page(0), len, false).map(|()| u));
        let mut msg = [0u8; FORK_MESSAGE];
        msg[0..4].copy_from_slice(
            &rustix::process::getpid()
                .as_raw_nonzero()
                .get()
                .to_ne_bytes(),
        );
        let parent = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
        msg[4..8].copy_from_slice(&parent.to_ne_bytes());
        msg[8..12].copy_from_slice(&u32::from(opened.is_ok()).to_ne_bytes());
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut ancillary = SendAncillaryBuffer::new(&mut space);
        let fds;
        if let Ok(u) = &opened {
            fds = [std::os::fd::AsFd::as_fd(u)];
            ancillary.push(SendAncillaryMessage::ScmRights(&fds));
        }
        let sent = rustix::net::sendmsg(
            &channel.sender,
            &[std::io::IoSlice::new(&msg)],
            &mut ancillary,
            SendFlags::NOSIGNAL,
        );
        match (opened, sent) {
            (Err(e), _) => Err(e),
            // The handler has its own copy now.
            (Ok(_), Ok(_)) => Ok(()),
            // Nobody reads the channel any more: the region's owner has ended, and gave its
            // children every page first (`hand_over_to_children`), so this process's memory
            // is whole. Dropping the descriptor unregisters the copy.
            (Ok(_), Err(Errno::PIPE | Errno::CONNREFUSED | Errno::CONNRESET)) => Ok(()),
            (Ok(_), Err(e)) => Err(e),
        }
    }

    /// The `fork` announced by [`Region::prepare_fork`] failed.
    pub fn fork_failed(&self) {
        if self.shared.follows_forks {
            let mut st = self.shared.lock();
            self.shared.fork_done(&mut st);
        }
    }

    /// Gives every live forked child the pages it still lacks and forgets the children:
    /// called before the process exits, which takes the region (and the pager they are served
    /// from) away.
    pub fn hand_over_to_children(&self) {
        let mut st = self.shared.lock();
        self.shared.hand_over(&mut st);
    }

    /// Whether the kernel's own accesses to the region (a `read(2)` into it, a `write(2)` from
    /// it) are served when they fault. Not for an ordinary user where
    /// `vm.unprivileged_userfaultfd` is 0: there such a call fails with EFAULT on a page that
    /// is not resident (see [`open_userfaultfd`]).
    pub fn serves_kernel_faults(&self) -> bool {
        !self.shared.uffd.user_mode_only()
    }

    /// Runs `f` on the region's pager (its counters, its servers).
    pub fn with_pager<R>(&self, f: impl FnOnce(&mut Pager<T, D>) -> R) -> R {
        f(&mut self.shared.lock().pager)
    }

    /// A handle on the region's pager for another thread (the background recovery): it takes
    /// the lock the fault handler takes, one call at a time.
    pub fn pager_handle(&self) -> PagerHandle<T, D> {
        PagerHandle(self.shared.clone())
    }
}

/// See [`Region::pager_handle`]. It keeps the pager (not the mapping) alive: drop it before
/// the region's servers go away.
pub struct PagerHandle<T: Transport, D: Disk>(Arc<Shared<T, D>>);

impl<T: Transport, D: Disk> Clone for PagerHandle<T, D> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T: Transport, D: Disk> std::fmt::Debug for PagerHandle<T, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PagerHandle")
    }
}

impl<T: Transport, D: Disk> PagerHandle<T, D> {
    /// Runs `f` on the pager, under the region's lock.
    pub fn with<R>(&self, f: impl FnOnce(&mut Pager<T, D>) -> R) -> R {
        f(&mut self.0.lock().pager)
    }
}

impl<T: Transport, D: Disk> Drop for Region<T, D> {
    fn drop(&mut self) {
        let _ = rustix::io::write(&*self.stop, &STOP.to_ne_bytes());
        if let Some(h) = self.handler.take() {
            let _ = h.join();
        }
        let sh = &self.shared;
        let len = self.len();
        let _ = sh.uffd.unregister(sh.base.page(0), len);
        unmap(sh.base, len);
        if let Some(shadow) = sh.shadow {
            let _ = sh.uffd.unregister(shadow.page(0), len);
            unmap(shadow, len);
        }
        // The region's pages are garbage now: free them on their servers at once rather than
        // when the pager's session ends (forked children given theirs first).
        let mut st = sh.lock();
        sh.hand_over(&mut st);
        let pager = &mut st.pager;
        let written: Vec<u64> = (0..sh.pages as u64)
            .filter(|&p| pager.is_written(p))
            .collect();
        // Flushing waits for the DELETEs' acknowledgements.
        if let Err(e) = pager.discard_many(&written).and_then(|()| pager.flush()) {
            tracing::warn!("freeing a dropped region's pages: {e}");
        }
    }
}

/// Written to the stop eventfd: stop (the region is dropped), or die as if the handler had
/// failed (tests only).
const STOP: u64 = 1;
const DIE: u64 = 2;

/// See `Shared::run`.
struct DeadHandler<'a> {
    base: Base,
    len: usize,
    uffd: &'a Uffd,
    armed: bool,
}

impl Drop for DeadHandler<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        tracing::error!("userfaultfd handler gone: the region is made inaccessible");
        // SAFETY: the region's own mapping, alive until the Region is dropped (which joins
        // this thread first); no memory is freed, only access is removed.
        let _ = unsafe {
            rustix::mm::mprotect(
                self.base.0.as_ptr().cast(),
                self.len,
                rustix::mm::MprotectFlags::empty(),
            )
        };
        let _ = self.uffd.wake(self.base.page(0), self.len);
    }
}

/// What the handler thread and the region's owner share.
struct Shared<T: Transport, D: Disk> {
    base: Base,
    /// Where sampled pages wait, page for page; `None` without `UFFDIO_MOVE` (no sampling).
    shadow: Option<Base>,
    pages: usize,
    uffd: Uffd,
    /// This process, for `process_madvise` (`None` where pidfds are not available).
    pidfd: Option<OwnedFd>,
    /// This process's id, for `process_vm_readv` (see `Shared::copy_out`).
    pid: libc::pid_t,
    /// Set once the program may have made pages of the region unreadable (see
    /// [`Region::pages_may_become_unreadable`]): victims are copied out through the kernel.
    unreadable_possible: std::sync::atomic::AtomicBool,
    spin: std::time::Duration,
    counters: RegionCounters,
    /// Everything that changes. The handler takes it for one event; `set_budget` and
    /// `release` take it from the program's threads.
    state: Mutex<State<T, D>>,
    /// Whether forked children inherit the region (see [`Shared::fork_event`]).
    follows_forks: bool,
    /// Where they send their descriptors, if they open their own ([`Forks::ByChild`]).
    fork_channel: Option<ForkChannel>,
    /// `state.children.len()`, read without the lock by the handler's loop.
    child_count: AtomicUsize,
    /// Signalled when no fork is pending any more (`release` waits for it).
    forked: Condvar,
}

/// A forked child's copy of the region (Linux's fork semantics, kept across paging: the child
/// sees the memory as it was at the fork; its writes and the parent's later ones are each
/// their own).
///
/// The child's page tables hold what was resident at the fork (shared copy-on-write by the
/// kernel); every other page faults to `uffd`, and is served from the pager, whose copy of a
/// page the child has not got is kept equal to the fork-time contents: before the parent's
/// side changes a page in the pager (a write-back, a delete), the page is first installed in
/// every child that lacks it ([`Shared::settle`]). The child's pages are never evicted (its
/// memory is not bounded by the budget) and never written to the servers; when it exits or
/// execs, its descriptor reports that its memory is gone (ESRCH) and it is forgotten.
struct ForkChild {
    uffd: Uffd,
    /// A bit per page: the child has its own copy (resident at the fork, or installed since).
    settled: Vec<u64>,
    /// Its memory is gone: forgotten at the handler's next turn.
    gone: bool,
}

impl ForkChild {
    fn is_settled(&self, page: usize) -> bool {
        self.settled[page / 64] & (1 << (page % 64)) != 0
    }

    fn settle(&mut self, page: usize) {
        self.settled[page / 64] |= 1 << (page % 64);
    }
}

struct State<T: Transport, D: Disk> {
    pager: Pager<T, D>,
    /// Resident pages and which of them are sampled: the LRU approximation.
    clock: Clock,
    /// Pages sampled per victim when sampling is on (0: it never is).
    max_samples: usize,
    /// Whether a resident page may differ from its remote copy.
    dirty: Vec<bool>,
    /// Resident pages at most.
    budget: usize,
    buf: Vec<u8>,
    prefetcher: Prefetcher,
    /// Pages fetched ahead into the pager's cache and not faulted on yet (and the rule that
    /// proposed them), oldest first.
    prefetched: HashMap<u64, Mode>,
    prefetch_order: VecDeque<u64>,
    /// How many guesses the pager's cache is taken to hold.
    prefetch_window: usize,
    pbuf: Vec<u8>,
    /// Victims chosen and not dropped yet (see `make_room`), kept to reuse its allocation.
    drops: Vec<(usize, usize, bool)>,
    /// Missing faults waiting to be fetched together: (page, write, thread); and their pages'
    /// buffer (see `Shared::drain_events`).
    waiting: Vec<(usize, bool, u32)>,
    wbuf: Vec<u8>,
    /// Fetched pages installed write-protected, and how many of them were written later:
    /// whether protecting fetched pages pays (see `protect_fetched`). Halved now and then.
    protected_fetches: u32,
    written_after_fetch: u32,
    skipped_protection: u32,
    /// Pages prefetched so far: every PREFETCH_CHECK-th is left to be faulted on.
    prefetch_seq: u64,
    /// Forked children whose memory is still there, and a page buffer for them.
    children: Vec<ForkChild>,
    child_buf: Vec<u8>,
    /// Forks announced by `prepare_fork` whose event has not arrived: meanwhile nothing is
    /// evicted (so every page resident at the announcement is in the child) and no page
    /// changes in the pager (so the child can be served the pages it lacks from there).
    forking: u32,
    /// Resident pages (a bit each) when the first pending fork was announced: the pages the
    /// child will have.
    fork_resident: Option<Vec<u64>>,
    forking_since: Option<std::time::Instant>,
    /// When the children were last asked whether their memory is still there.
    last_probe: std::time::Instant,
}

impl<T: Transport, D: Disk> State<T, D> {
    /// Sets how many pages the hand samples per victim: none while a fork is pending or a
    /// child lives (see `prepare_fork`).
    fn apply_sampling(&mut self) {
        let on = self.children.is_empty() && self.forking == 0;
        self.clock
            .set_max_samples(if on { self.max_samples } else { 0 });
    }

    /// Whether to install the next fetched page write-protected: while fewer than half of
    /// the protected ones were written afterwards, and one in 16 otherwise, to notice when
    /// that changes.
    fn protect_fetched(&mut self) -> bool {
        if self.protected_fetches >= 512 {
            self.protected_fetches /= 2;
            self.written_after_fetch /= 2;
        }
        self.skipped_protection = self.skipped_protection.wrapping_add(1);
        let pays =
            self.protected_fetches < 16 || self.written_after_fetch * 2 < self.protected_fetches;
        let protect = pays || self.skipped_protection.is_multiple_of(16);
        if protect {
            self.protected_fetches += 1;
        }
        protect
    }
}

impl<T: Transport, D: Disk> Shared<T, D> {
    fn lock(&self) -> MutexGuard<'_, State<T, D>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn run(&self, stop: &OwnedFd) {
        // However this thread ends other than by the region's drop (an error, a panic), the
        // guard makes the region inaccessible and wakes every waiting thread: they die of
        // SIGSEGV instead of waiting forever for a handler that is gone.
        let mut guard = DeadHandler {
            base: self.base,
            len: self.pages * PAGE_SIZE,
            uffd: &self.uffd,
            armed: true,
        };
        // Whether to spin before sleeping: only while faults come closer together than the
        // spin (a scan), not when the program computes between faults.
        let mut spin_next = !self.spin.is_zero();
        loop {
            let wait_started = std::time::Instant::now();
            if spin_next && self.spin_for_event(wait_started) {
                self.drain_events();
                continue;
            }
            // The children's descriptors too, if there are any; then the wait is bounded, to
            // notice children whose memory is gone (no event says so).
            let children = if self.child_count.load(Ordering::Acquire) > 0 {
                use std::os::fd::{AsFd, AsRawFd};
                self.lock()
                    .children
                    .iter()
                    .map(|c| c.uffd.as_fd().as_raw_fd())
                    .collect()
            } else {
                Vec::new()
            };
            let mut fds = vec![
                PollFd::new(&self.uffd, PollFlags::IN),
                PollFd::new(stop, PollFlags::IN),
            ];
            // Descriptors of children that open their own (see `Region::follow_in_child`).
            let channel = self
                .fork_channel
                .as_ref()
                .map(|c| c.receiver.load(Ordering::Relaxed))
                .filter(|&fd| fd >= 0);
            if let Some(fd) = channel {
                // SAFETY: the handler's end of the channel, closed only in a forked child
                // (where this thread does not exist).
                fds.push(PollFd::from_borrowed_fd(
                    unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
                    PollFlags::IN,
                ));
            }
            let first_child = fds.len();
            for &fd in &children {
                // SAFETY: a child's descriptor is closed only by this thread (`serve_children`,
                // after the poll) or after it has been joined.
                fds.push(PollFd::from_borrowed_fd(
                    unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
                    PollFlags::IN,
                ));
            }
            let timeout = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: 100_000_000,
            };
            let polled = poll(&mut fds, (!children.is_empty()).then_some(&timeout));
            spin_next = !self.spin.is_zero() && wait_started.elapsed() <= self.spin * 2;
            match polled {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::error!("userfaultfd handler: poll: {e}");
                    return;
                }
            }
            if !fds[1].revents().is_empty() {
                let mut word = [0u8; 8];
                let _ = rustix::io::read(stop, &mut word);
                if u64::from_ne_bytes(word) == DIE {
                    // The fault point of the test for a handler that dies.
                    tracing::error!("userfaultfd handler: told to die");
                    return;
                }
                guard.armed = false;
                return;
            }
            let children_ready = fds[first_child..].iter().any(|f| !f.revents().is_empty());
            let sent = channel.is_some() && !fds[2].revents().is_empty();
            drop(fds);
            if !self.drain_events() {
                return;
            }
            if let (true, Some(fd)) = (sent, channel) {
                self.receive_children(fd);
            }
            if !children.is_empty() || self.child_count.load(Ordering::Acquire) > 0 {
                self.serve_children(children_ready);
            }
        }
    }

    /// Handles every event that has arrived (the descriptor is non-blocking); false if the
    /// userfaultfd failed.
    ///
    /// Faults of several threads that wait at once are served together: a fault on a page
    /// that must be fetched waits (in `waiting`) while the events behind it are read, and all
    /// such pages are fetched with one pipelined `read_many` — one round trip for all of them
    /// rather than one each, in turn. A second fault on a page already waiting is served by
    /// the same install, which wakes every thread waiting on that page.
    fn drain_events(&self) -> bool {
        loop {
            match self.uffd.read_event() {
                Ok(Some(event)) => {
                    let mut st = self.lock();
                    if !self.wait_for_fetch(&mut st, &event) {
                        self.fetch_waiting(&mut st);
                        self.handle(&mut st, event);
                    } else if st.waiting.len() >= FETCH_BATCH {
                        self.fetch_waiting(&mut st);
                    }
                }
                Ok(None) => {
                    self.fetch_waiting(&mut self.lock());
                    return true;
                }
                Err(e) => {
                    tracing::error!("userfaultfd handler: read: {e}");
                    self.fetch_waiting(&mut self.lock());
                    return false;
                }
            }
        }
    }

    /// Puts a missing fault on a page to be fetched from the pager into `waiting`; false for
    /// any other event (handled at once, after the waiting ones). Not while forks are pending
    /// or children live: their bookkeeping goes fault by fault.
    fn wait_for_fetch(&self, st: &mut State<T, D>, event: &Event) -> bool {
        let Event::Pagefault {
            addr,
            write,
            wp: false,
            tid,
        } = *event
        else {
            return false;
        };
        let page = (addr - self.base.0.as_ptr() as usize) / PAGE_SIZE;
        if !self.fetchable(st, page) {
            return false;
        }
        if st.waiting.iter().any(|w| w.0 == page) {
            // Another thread's fault on the same page: its install wakes this one too.
            self.counters.faults.fetch_add(1, Ordering::Relaxed);
            self.counters
                .already_present
                .fetch_add(1, Ordering::Relaxed);
            return true;
        }
        st.waiting.push((page, write, tid));
        true
    }

    /// Whether a missing fault on `page` is served by fetching it from the pager, and may wait
    /// for others to be fetched with it.
    fn fetchable(&self, st: &State<T, D>, page: usize) -> bool {
        let p = page as u64;
        st.forking == 0
            && st.children.is_empty()
            && !st.clock.is_sampled(p)
            && !st.clock.is_resident(p)
            && !st.prefetched.contains_key(&p)
            && st.pager.is_written(p)
    }

    /// Fetches and installs every page in `waiting`: one alone the usual way (`missing`,
    /// with its prefetching), several with one `read_many`.
    fn fetch_waiting(&self, st: &mut State<T, D>) {
        match st.waiting.len() {
            0 => {}
            1 => {
                let (page, write, tid) = st.waiting.pop().expect("one");
                self.missing(st, page, write, tid);
            }
            _ => {
                let mut waiting = std::mem::take(&mut st.waiting);
                // The lock was let go between events: a page the program has released (or
                // that a fork froze) meanwhile is served the usual way.
                let mut i = 0;
                while i < waiting.len() {
                    let (page, write, tid) = waiting[i];
                    if self.fetchable(st, page) {
                        i += 1;
                    } else {
                        waiting.swap_remove(i);
                        self.missing(st, page, write, tid);
                    }
                }
                let n = waiting.len();
                if n == 0 {
                    st.waiting = waiting;
                    return;
                }
                let pages: Vec<u64> = waiting.iter().map(|w| w.0 as u64).collect();
                let mut buf = std::mem::take(&mut st.wbuf);
                buf.resize(n * PAGE_SIZE, 0);
                if st.pager.read_many(&pages, &mut buf).is_err() {
                    // One by one, so that each page that cannot be read is named (SIGBUS).
                    for &(page, write, tid) in &waiting {
                        self.missing(st, page, write, tid);
                    }
                } else {
                    self.counters.faults.fetch_add(n as u64, Ordering::Relaxed);
                    self.counters
                        .batched_fetches
                        .fetch_add(n as u64, Ordering::Relaxed);
                    for (i, &(page, write, _)) in waiting.iter().enumerate() {
                        let data = &buf[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
                        self.install_fetched(st, page, write, data);
                    }
                    let keep = st.budget;
                    self.make_room(st, keep);
                }
                st.wbuf = buf;
                st.waiting = waiting;
                st.waiting.clear();
            }
        }
    }

    /// Polls the userfaultfd without sleeping for up to the spin; true once an event is
    /// waiting. Sleeping and being woken costs about as much as a fault here.
    fn spin_for_event(&self, started: std::time::Instant) -> bool {
        let mut fds = [PollFd::new(&self.uffd, PollFlags::IN)];
        while started.elapsed() < self.spin {
            let zero = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            if let Ok(n) = poll(&mut fds, Some(&zero)) {
                if n > 0 {
                    return true;
                }
            }
            std::hint::spin_loop();
        }
        false
    }

    fn handle(&self, st: &mut State<T, D>, event: Event) {
        let (addr, write, wp, tid) = match event {
            Event::Pagefault {
                addr,
                write,
                wp,
                tid,
            } => (addr, write, wp, tid),
            Event::Fork(child) => return self.fork_event(st, child, true),
            // Not asked for (no remap, remove or unmap events).
            Event::Other(e) => return tracing::debug!("userfaultfd event {e} ignored"),
        };
        let page = (addr - self.base.0.as_ptr() as usize) / PAGE_SIZE;
        debug_assert!(page < self.pages);
        let addr = self.base.page(page);
        match wp {
            false => self.missing(st, page, write, tid),
            true if st.clock.is_sampled(page as u64) => {
                // A write to a clean page that was sampled after the fault was raised: the
                // page is aside now. Dirty from now on; the woken writer faults again and gets
                // it back writable.
                self.counters.first_writes.fetch_add(1, Ordering::Relaxed);
                st.dirty[page] = true;
                let _ = self.uffd.wake(addr, PAGE_SIZE);
            }
            true if st.clock.is_resident(page as u64) => {
                // The first write to a fetched page, which was installed write-protected: from
                // now on it differs from its remote copy.
                match self.uffd.set_write_protect(addr, false, true) {
                    Ok(()) => {
                        self.counters.first_writes.fetch_add(1, Ordering::Relaxed);
                        st.dirty[page] = true;
                        st.written_after_fetch += 1;
                    }
                    // The mapping is changing (a fork copying it): the writer, woken, faults
                    // again and is served then. (Left asleep, it would never be.)
                    Err(rustix::io::Errno::AGAIN) => {
                        self.counters.retried.fetch_add(1, Ordering::Relaxed);
                        let _ = self.uffd.wake(addr, PAGE_SIZE);
                    }
                    Err(e) => {
                        tracing::error!("unprotecting page {page}: {e}");
                        self.counters.errors.fetch_add(1, Ordering::Relaxed);
                        let _ = self.uffd.wake(addr, PAGE_SIZE);
                    }
                }
            }
            true => {
                // A write that raced with the page's eviction: an eviction completes before the
                // next event is read, so the page is gone now, and the woken writer faults
                // again as a missing page.
                self.counters
                    .write_protect_faults
                    .fetch_add(1, Ordering::Relaxed);
                let _ = self.uffd.wake(addr, PAGE_SIZE);
            }
        }
    }

    /// The process forked (`announced`: this process, not one of its children): the child's
    /// copy of the region faults to `uffd` from now on.
    fn fork_event(&self, st: &mut State<T, D>, uffd: Uffd, announced: bool) {
        let words = self.pages.div_ceil(64);
        let settled = if announced && st.forking > 0 {
            let resident = st.fork_resident.clone();
            self.fork_done(st);
            resident.unwrap_or_else(|| vec![0; words])
        } else {
            // A fork nobody announced (a child forking in turn, a raw clone): nothing is known
            // of the pages the child has, so any page the parent's side changes is installed
            // in it first. A change between that fork and this event is not (see README).
            tracing::debug!("a fork that was not announced");
            vec![0; words]
        };
        self.counters.forks.fetch_add(1, Ordering::Relaxed);
        st.children.push(ForkChild {
            uffd,
            settled,
            gone: false,
        });
        st.apply_sampling();
        self.child_count.store(st.children.len(), Ordering::Release);
    }

    /// Takes the descriptors children sent over the fork channel (see
    /// [`Region::follow_in_child`]); `fd` is its handler's end.
    fn receive_children(&self, fd: i32) {
        use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
        // SAFETY: the handler's end of the channel, open while the handler runs.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        loop {
            let mut msg = [0u8; FORK_MESSAGE];
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut ancillary = RecvAncillaryBuffer::new(&mut space);
            let got = rustix::net::recvmsg(
                fd,
                &mut [std::io::IoSliceMut::new(&mut msg)],
                &mut ancillary,
                RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC,
            );
            let n = match got {
                Ok(r) => r.bytes,
                Err(Errno::AGAIN | Errno::INTR) => return,
                Err(e) => {
                    tracing::error!("the fork channel: {e}");
                    return;
                }
            };
            let mut uffd = None;
            for m in ancillary.drain() {
                if let RecvAncillaryMessage::ScmRights(fds) = m {
                    for f in fds {
                        uffd.get_or_insert(f);
                    }
                }
            }
            let word = |i: usize| i32::from_ne_bytes(msg[i..i + 4].try_into().expect("4 bytes"));
            if n != FORK_MESSAGE {
                continue;
            }
            let (child, parent, registered) = (word(0), word(4), word(8) == 1);
            let announced = parent == self.pid;
            let mut st = self.lock();
            match (registered, uffd) {
                (true, Some(u)) => self.fork_event(&mut st, Uffd::from_child(u), announced),
                _ => {
                    tracing::warn!("forked child {child} could not follow the region");
                    if announced && st.forking > 0 {
                        self.fork_done(&mut st);
                    }
                }
            }
        }
    }

    /// See [`Region::prepare_fork`].
    fn prepare_fork(&self, st: &mut State<T, D>) {
        if !self.follows_forks {
            return;
        }
        // No sampling while a child lives: moving a page aside (`UFFDIO_MOVE`) after a fork
        // was seen to leave the shadow's page missing (the handler then faulted on it and
        // waited for itself). Resumed once the children are gone (`serve_children`).
        st.clock.set_max_samples(0);
        // Sampled pages wait in the shadow, which a child does not inherit: back into the
        // region, where the child gets them with everything else resident.
        for page in 0..self.pages {
            if st.clock.is_sampled(page as u64) {
                self.put_back(st, page);
            }
        }
        if st.forking == 0 {
            let mut resident = vec![0u64; self.pages.div_ceil(64)];
            for page in 0..self.pages {
                if st.clock.is_resident(page as u64) {
                    resident[page / 64] |= 1 << (page % 64);
                }
            }
            st.fork_resident = Some(resident);
            st.forking_since = Some(std::time::Instant::now());
        }
        st.forking += 1;
    }

    /// An announced fork happened (its event came), did not happen, or its event will never
    /// come: once none is pending, evictions resume and `release` goes on.
    fn fork_done(&self, st: &mut State<T, D>) {
        st.forking = st.forking.saturating_sub(1);
        if st.forking == 0 {
            st.fork_resident = None;
            st.forking_since = None;
            self.forked.notify_all();
        }
    }

    /// Moves a sampled page back into the region, untouched (not counted as a use).
    fn put_back(&self, st: &mut State<T, D>, page: usize) {
        let shadow = self.shadow.expect("sampled pages live in the shadow");
        let (aside, addr) = (shadow.page(page), self.base.page(page));
        let moved = st.dirty[page] && self.uffd.move_page(aside, addr).is_ok();
        if !moved {
            // SAFETY: a sampled page is present in the shadow, touched only by this handler,
            // which holds the state.
            let contents = unsafe { std::slice::from_raw_parts(aside.cast::<u8>(), PAGE_SIZE) };
            // Clean pages go back write-protected, as fetched pages are.
            let protect = !st.dirty[page];
            if let Err(e) = self.uffd.copy(contents, addr, protect) {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!("putting back sampled page {page} before a fork: {e}");
                return;
            }
            let _ = drop_pages(aside, PAGE_SIZE);
        }
        st.clock.unsample(page as u64);
    }

    /// Before the parent's side changes `page` in the pager: installs its current contents in
    /// every child that lacks it, since it is the child's too (see `ForkChild`).
    fn settle(&self, st: &mut State<T, D>, page: usize) {
        for i in 0..st.children.len() {
            if !st.children[i].gone && !st.children[i].is_settled(page) {
                self.counters.child_copies.fetch_add(1, Ordering::Relaxed);
                self.install_in_child(st, i, page, 0);
            }
        }
    }

    /// Installs `page` as the pager has it in child `i` (for its thread `tid` if it faulted).
    fn install_in_child(&self, st: &mut State<T, D>, i: usize, page: usize, tid: u32) {
        let addr = self.base.page(page);
        let State {
            pager,
            children,
            child_buf,
            ..
        } = st;
        let child = &mut children[i];
        let installed = if pager.is_written(page as u64) {
            if let Err(e) = pager.read(page as u64, child_buf) {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "netram: page {page} of a region (address {:#x}) cannot be read for a \
                     forked child: {e}; SIGBUS to its thread {tid}",
                    addr as usize
                );
                if tid != 0 {
                    // SAFETY: kill(2) takes no pointers; the child's faulting thread is the
                    // child itself (a forked child starts with one thread).
                    unsafe { libc::kill(tid as libc::pid_t, libc::SIGBUS) };
                }
                let _ = child.uffd.wake(addr, PAGE_SIZE);
                return;
            }
            child.uffd.copy(child_buf, addr, false)
        } else {
            child.uffd.zeropage(addr)
        };
        match installed {
            Ok(()) | Err(rustix::io::Errno::EXIST) => child.settle(page),
            // Its memory is gone (exited, or exec'd).
            Err(rustix::io::Errno::SRCH) => child.gone = true,
            Err(e) => {
                // The mapping is changing in the child: it faults again.
                tracing::debug!("installing page {page} in a child: {e}");
                let _ = child.uffd.wake(addr, PAGE_SIZE);
            }
        }
    }

    /// Serves the children's faults (if `ready`), notices children whose memory is gone, and
    /// forgets them.
    fn serve_children(&self, ready: bool) {
        let mut st = self.lock();
        let now = std::time::Instant::now();
        let probe = now.duration_since(st.last_probe) >= std::time::Duration::from_millis(100);
        if probe {
            st.last_probe = now;
            if st
                .forking_since
                .is_some_and(|t| now.duration_since(t) > std::time::Duration::from_secs(5))
            {
                // Announced, and no event in 5 s: that fork failed unseen.
                tracing::warn!("a fork announced 5 s ago never happened");
                st.forking = 1;
                self.fork_done(&mut st);
            }
        }
        let mut i = 0;
        while i < st.children.len() {
            while ready && !st.children[i].gone {
                match st.children[i].uffd.read_event() {
                    Ok(Some(Event::Pagefault { addr, wp, tid, .. })) => {
                        self.child_fault(&mut st, i, addr, wp, tid)
                    }
                    Ok(Some(Event::Fork(grandchild))) => {
                        self.fork_event(&mut st, grandchild, false)
                    }
                    Ok(Some(Event::Other(_))) => {}
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!("a child's userfaultfd: {e}");
                        st.children[i].gone = true;
                    }
                }
            }
            if probe && !st.children[i].gone {
                // No event says that a child's memory is gone; an ioctl on it does (ESRCH).
                // Lifting write-protection from its first page changes nothing it can see.
                let first = self.base.page(0);
                if let Err(rustix::io::Errno::SRCH) =
                    st.children[i].uffd.set_write_protect(first, false, false)
                {
                    st.children[i].gone = true;
                }
            }
            i += 1;
        }
        st.children.retain(|c| !c.gone);
        self.child_count.store(st.children.len(), Ordering::Release);
        st.apply_sampling();
    }

    /// A fault of child `i` at `addr`.
    fn child_fault(&self, st: &mut State<T, D>, i: usize, addr: usize, wp: bool, tid: u32) {
        let page = (addr - self.base.0.as_ptr() as usize) / PAGE_SIZE;
        let at = self.base.page(page);
        if wp {
            // A page the parent had write-protected: the child's own now, writable. (If that
            // fails, the writer is woken all the same, to fault again rather than sleep.)
            if st.children[i]
                .uffd
                .set_write_protect(at, false, true)
                .is_err()
            {
                let _ = st.children[i].uffd.wake(at, PAGE_SIZE);
            }
            return;
        }
        self.counters.child_faults.fetch_add(1, Ordering::Relaxed);
        if st.children[i].is_settled(page) {
            // Its own copy, which it dropped (madvise): zeros, as anonymous memory reads.
            if st.children[i].uffd.zeropage(at).is_err() {
                let _ = st.children[i].uffd.wake(at, PAGE_SIZE);
            }
            return;
        }
        self.install_in_child(st, i, page, tid);
    }

    /// Installs every page the children lack and forgets them: the region is going away (the
    /// process exits), and their memory must not depend on it. Pages never written need
    /// nothing: once forgotten, the child's region is plain memory, which reads as zeros.
    fn hand_over(&self, st: &mut State<T, D>) {
        for i in 0..st.children.len() {
            for page in 0..self.pages {
                if st.children[i].gone {
                    break;
                }
                if !st.children[i].is_settled(page) && st.pager.is_written(page as u64) {
                    self.install_in_child(st, i, page, 0);
                }
            }
        }
        st.children.clear();
        self.child_count.store(0, Ordering::Release);
    }

    /// A page the pager cannot read: the pager has already tried every copy (other servers,
    /// parity, the disk), so waking the thread would only make it fault again, forever. It
    /// gets SIGBUS, as the kernel answers a swap-in it cannot read: a program that does not
    /// handle it dies at once, with the reason on stderr.
    fn unreadable(&self, page: usize, tid: u32, e: &netram_pager::PagerError) {
        let addr = self.base.page(page);
        let n = self.counters.sigbus.fetch_add(1, Ordering::Relaxed);
        // The message below is the user's; the log has it at debug level, not twice.
        tracing::debug!("page {page} cannot be read: {e}");
        if n < 8 {
            // stderr even without a tracing subscriber (the preload library has none): the
            // program's user must learn why it died.
            eprintln!(
                "netram: page {page} of a region (address {:#x}) cannot be read: {e}; \
                 SIGBUS to thread {tid}",
                addr as usize
            );
        }
        // SAFETY: getpid and tgkill take no pointers; tgkill signals one thread of this
        // process, the one blocked on the fault.
        let sent = tid != 0
            && unsafe {
                libc::syscall(
                    libc::SYS_tgkill,
                    libc::getpid(),
                    tid as libc::pid_t,
                    libc::SIGBUS,
                ) == 0
            };
        if !sent {
            // No thread id from this kernel: the process, whichever thread takes it.
            // SAFETY: kill(2) on this process's own PID, no pointers.
            unsafe { libc::kill(libc::getpid(), libc::SIGBUS) };
        }
        // Woken with the signal pending, the thread takes it before it retries the access.
        let _ = self.uffd.wake(addr, PAGE_SIZE);
    }

    /// A missing-page fault on `page` by thread `tid`; `write`: the access was a write.
    fn missing(&self, st: &mut State<T, D>, page: usize, write: bool, tid: u32) {
        self.counters.faults.fetch_add(1, Ordering::Relaxed);
        let addr = self.base.page(page);
        if st.clock.is_sampled(page as u64) {
            return self.sampled_fault(st, page, write);
        }
        if st.clock.is_resident(page as u64) {
            return self.resident_fault(st, page);
        }
        if let Some(mode) = st.prefetched.remove(&(page as u64)) {
            // Fetched ahead: the pager serves it from its cache, without a round trip.
            self.counters.prefetch_hits.fetch_add(1, Ordering::Relaxed);
            st.prefetcher.hit(mode);
        }
        if st.pager.is_written(page as u64) {
            // The pages the prefetcher proposes travel in the same request as the faulting
            // one: a page used soon costs no round trip of its own.
            let (ahead, mode) = self.proposals(st, page);
            // (Not `st.buf`: evictions below copy victims through it.)
            let mut buf = std::mem::take(&mut st.pbuf);
            buf.resize((1 + ahead.len()) * PAGE_SIZE, 0);
            let mut pages = Vec::with_capacity(1 + ahead.len());
            pages.push(page as u64);
            pages.extend_from_slice(&ahead);
            let mut read = st.pager.read_many(&pages, &mut buf);
            if read.is_err() && !ahead.is_empty() {
                // Only a guess may have failed: the faulting page alone says.
                read = st.pager.read(page as u64, &mut buf[..PAGE_SIZE]);
                pages.truncate(1);
            }
            let installed =
                read.is_ok() && self.install_fetched(st, page, write, &buf[..PAGE_SIZE]);
            if let Err(e) = read {
                st.pbuf = buf;
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                return self.unreadable(page, tid, &e);
            }
            if installed {
                // The faulting thread runs again: installing the others and evicting are off
                // its path (the region holds pages over its budget meanwhile).
                self.install_ahead(st, &pages[1..], mode, &buf[PAGE_SIZE..]);
                let keep = st.budget;
                self.make_room(st, keep);
            }
            st.pbuf = buf;
            return;
        }
        self.counters.zero_fills.fetch_add(1, Ordering::Relaxed);
        let result = if write {
            // Written at once: a page of zeros, writable, rather than the shared zero page and
            // a copy-on-write fault right after.
            self.uffd.copy(&ZEROS, addr, false)
        } else {
            self.uffd.zeropage(addr)
        };
        match result {
            // A zero fill needs no tracking: the kernel maps the shared zero page, a write
            // replaces it, and eviction finds out by looking whether it is still all zeros.
            Ok(()) => {
                st.dirty[page] = true;
                st.clock.insert(page as u64);
            }
            Err(e) => {
                if !self.install_failed(st, page, e) {
                    return;
                }
            }
        }
        let keep = st.budget;
        self.make_room(st, keep);
        self.prefetch(st, page);
    }

    /// Installs a fetched page's `data` (waking the threads waiting on it) and makes it
    /// resident; false if it was not installed (already there, or the kernel refused: the
    /// woken thread faults again).
    fn install_fetched(&self, st: &mut State<T, D>, page: usize, write: bool, data: &[u8]) -> bool {
        let addr = self.base.page(page);
        // A fetched page equals its remote copy until written: installed write-protected, its
        // first write is seen, and if there is none it is evicted without I/O. That costs a
        // second fault for every page that is written after all, so it is done only while it
        // pays: not for a write fault, and not while most fetched pages get written.
        let protect = !write && st.protect_fetched();
        self.counters.fetches.fetch_add(1, Ordering::Relaxed);
        match self.uffd.copy(data, addr, protect) {
            Ok(()) => {
                // Only a protected page is known clean.
                st.dirty[page] = !protect;
                st.clock.insert(page as u64);
                true
            }
            Err(e) => self.install_failed(st, page, e),
        }
    }

    /// An install the kernel refused: the threads waiting on the page are woken; true if the
    /// page is resident all the same (installed meanwhile), false if they will fault again.
    fn install_failed(&self, st: &mut State<T, D>, page: usize, e: rustix::io::Errno) -> bool {
        let addr = self.base.page(page);
        match e {
            // Installed meanwhile (by a fault this handler has not read yet, or the program
            // wrote through a kernel path): present now, so resident.
            rustix::io::Errno::EXIST => {
                self.counters
                    .already_present
                    .fetch_add(1, Ordering::Relaxed);
                let _ = self.uffd.wake(addr, PAGE_SIZE);
                st.dirty[page] = true;
                st.clock.insert(page as u64);
                true
            }
            // The mapping is changing (a fork copying it): the woken thread faults again.
            rustix::io::Errno::AGAIN => {
                self.counters.retried.fetch_add(1, Ordering::Relaxed);
                let _ = self.uffd.wake(addr, PAGE_SIZE);
                false
            }
            e => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("installing page {page}: errno {e}");
                let _ = self.uffd.wake(addr, PAGE_SIZE);
                false
            }
        }
    }

    /// A missing fault on a page believed resident. Usually a second thread's fault on a page
    /// the first one's brought in (the event was queued before the install): only wake it.
    /// But the program may have dropped the page itself (`madvise(MADV_DONTNEED)` through a
    /// raw system call, unseen by `release`): the page then reads as zeros, as anonymous
    /// memory does, and its remote copy is stale. Installing zeros tells the two apart: the
    /// kernel refuses (EEXIST) if the page is there. Without this, the thread would fault
    /// forever on a page the handler believes present.
    fn resident_fault(&self, st: &mut State<T, D>, page: usize) {
        let addr = self.base.page(page);
        match self.uffd.zeropage(addr) {
            Ok(_) => {
                self.counters
                    .dropped_by_program
                    .fetch_add(1, Ordering::Relaxed);
                st.dirty[page] = true;
                if st.pager.is_written(page as u64) {
                    self.settle(st, page);
                    if let Err(e) = st.pager.discard(page as u64) {
                        tracing::warn!("deleting page {page} the program dropped: {e}");
                    }
                }
            }
            Err(_) => {
                self.counters
                    .already_present
                    .fetch_add(1, Ordering::Relaxed);
                let _ = self.uffd.wake(addr, PAGE_SIZE);
            }
        }
    }

    /// A sampled page was touched: it was in use after all. Put it back where it was.
    fn sampled_fault(&self, st: &mut State<T, D>, page: usize, write: bool) {
        self.counters.sample_faults.fetch_add(1, Ordering::Relaxed);
        if write {
            // About to be written: back writable, dirty, without a write-protect fault.
            st.dirty[page] = true;
        }
        let shadow = self.shadow.expect("sampled pages live in the shadow");
        let (aside, addr) = (shadow.page(page), self.base.page(page));
        // SAFETY: a sampled page is present in the shadow, which nothing but this handler
        // touches, and this handler holds the state: the page does not change while read.
        let contents = unsafe { std::slice::from_raw_parts(aside.cast::<u8>(), PAGE_SIZE) };
        // Ok(true): copied back, and the copy aside is to be dropped.
        let back = if st.dirty[page] {
            // Moving it back maps it writable, as a dirty page should be.
            match self.uffd.move_page(aside, addr) {
                Ok(()) => {
                    let _ = self.uffd.wake(addr, PAGE_SIZE);
                    Ok(false)
                }
                Err(_) => self.uffd.copy(contents, addr, true).map(|()| true),
            }
        } else {
            // Moved back it would be writable, and a write by another thread before it was
            // protected again would go unseen: copy it back write-protected in one ioctl.
            self.uffd.copy(contents, addr, true).map(|()| true)
        };
        match back {
            Ok(copied) => {
                if copied {
                    let _ = drop_pages(aside, PAGE_SIZE);
                }
                st.clock.touched(page as u64);
            }
            Err(e) => {
                // The page stays aside, sampled; the woken thread faults again.
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!("putting back sampled page {page}: {e}");
                let _ = self.uffd.wake(addr, PAGE_SIZE);
            }
        }
    }

    /// Evicts until at most `keep` pages are resident, sampling on the way; stops at the first
    /// failure (logged and counted).
    ///
    /// Victims go in batches: every page that leaves the program's page tables costs a TLB
    /// shootdown (an interrupt to each CPU running the program), and the pages of one batch
    /// leave with one `process_madvise` call, which the kernel (6.16 on) flushes once. A
    /// victim chosen but not dropped yet stays mapped write-protected (or aside, if sampled):
    /// a write to it blocks until the batch is gone and then faults it back in.
    fn make_room(&self, st: &mut State<T, D>, keep: usize) {
        if st.clock.len() <= keep || st.forking > 0 {
            // While a fork is pending nothing leaves: the child gets every page resident at
            // its announcement (see `prepare_fork`). The budget is caught up with afterwards.
            return;
        }
        // A batch small next to the budget, so that residency stays close to it.
        let batch = (st.budget / 16).clamp(1, EVICT_BATCH);
        let target = keep.saturating_sub(batch - 1);
        let mut drops = std::mem::take(&mut st.drops);
        let mut skipped = 0;
        while st.clock.len() > target {
            let Some(victim) = st.clock.victim() else {
                break;
            };
            for &p in &victim.sample {
                match self.sample(p as usize) {
                    Ok(()) => {
                        self.counters.samples.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        self.counters
                            .sample_failures
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::debug!("sampling page {p}: {e}");
                        st.clock.unsample(p);
                    }
                }
            }
            let page = victim.page as usize;
            let evicted = if victim.sampled {
                self.evict_sampled(st, page)
                    .map(|a| Some((page, a as usize, false)))
            } else {
                self.evict_mapped(st, page)
                    .map(|a| a.map(|a| (page, a as usize, true)))
            };
            match evicted {
                Ok(Some(d)) => drops.push(d),
                Ok(None) => {
                    // Unreadable, kept (at the back of the ring): the next one, unless every
                    // resident page has been passed over this time.
                    skipped += 1;
                    if skipped > st.clock.len() {
                        break;
                    }
                }
                Err(e) => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::error!("evicting a page: {e}");
                    break;
                }
            }
        }
        self.drop_batch(st, &drops);
        drops.clear();
        st.drops = drops;
    }

    /// Drops the chosen victims' memory: `(page, address, whether in the region)`.
    fn drop_batch(&self, st: &mut State<T, D>, drops: &[(usize, usize, bool)]) {
        if drops.is_empty() {
            return;
        }
        if let Some(pidfd) = &self.pidfd {
            let iov: Vec<libc::iovec> = drops
                .iter()
                .map(|&(_, addr, _)| libc::iovec {
                    iov_base: addr as *mut c_void,
                    iov_len: PAGE_SIZE,
                })
                .collect();
            use std::os::fd::AsRawFd;
            // SAFETY: process_madvise(2) on this process's own pages, which are either stored
            // or unchanged since fetched (see `drop_pages`); the iovecs are valid for the call.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_process_madvise,
                    pidfd.as_raw_fd(),
                    iov.as_ptr(),
                    iov.len(),
                    libc::MADV_DONTNEED,
                    0,
                )
            };
            if r == (drops.len() * PAGE_SIZE) as libc::c_long {
                return;
            }
            // Refused (an older kernel) or cut short: the rest page by page; dropping a page
            // twice is harmless.
        }
        for &(page, addr, in_region) in drops {
            let addr = addr as *mut c_void;
            if let Err(e) = drop_pages(addr, PAGE_SIZE) {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!("dropping page {page}: {e}");
                if in_region {
                    // Still mapped and write-protected: resident again, and taken as dirty
                    // (its copy may have gone to the pager, or not).
                    st.dirty[page] = true;
                    st.clock.insert(page as u64);
                    let _ = self.uffd.set_write_protect(addr, false, true);
                }
            }
        }
    }

    /// Takes `page` out of the program's page tables, keeping it aside: its next access
    /// faults, which tells the clock that it is in use.
    fn sample(&self, page: usize) -> Result<(), rustix::io::Errno> {
        let shadow = self.shadow.expect("sampling only with a shadow");
        self.uffd.move_page(self.base.page(page), shadow.page(page))
    }

    /// Evicts a sampled page: it is aside, out of reach of the program, so it is copied and
    /// stored without any write-protection; the caller drops it. On failure it goes back into
    /// the region.
    fn evict_sampled(&self, st: &mut State<T, D>, page: usize) -> Result<*mut c_void, PageError> {
        let aside = self
            .shadow
            .expect("sampled pages live in the shadow")
            .page(page);
        if st.dirty[page] {
            // SAFETY: a sampled page is present in the shadow, touched only by this handler.
            unsafe {
                std::ptr::copy_nonoverlapping(aside.cast::<u8>(), st.buf.as_mut_ptr(), PAGE_SIZE)
            };
            if let Err(source) = self.store(st, page) {
                if let Err(e) = self.uffd.move_page(aside, self.base.page(page)) {
                    tracing::error!("page {page} could not be put back after a failed store: {e}");
                }
                st.clock.insert(page as u64);
                return Err(PageError::Store { page, source });
            }
        } else {
            self.counters.evicted_clean.fetch_add(1, Ordering::Relaxed);
        }
        st.dirty[page] = false;
        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        Ok(aside)
    }

    /// Stores the page in `st.buf` as page `page` (an all-zero page is discarded instead).
    fn store(&self, st: &mut State<T, D>, page: usize) -> Result<(), netram_pager::PagerError> {
        self.settle(st, page);
        if st.buf.iter().all(|&b| b == 0) {
            self.counters.evicted_zero.fetch_add(1, Ordering::Relaxed);
            st.pager.discard(page as u64)
        } else {
            st.pager.write(page as u64, &st.buf)
        }
    }

    /// Evicts a page still mapped: write-protect, copy out, store; the caller drops it. On
    /// failure the page stays resident and writable; `None` (kept, resident, nothing
    /// counted as an error) if the program has made it unreadable.
    fn evict_mapped(
        &self,
        st: &mut State<T, D>,
        page: usize,
    ) -> Result<Option<*mut c_void>, PageError> {
        let addr = self.base.page(page);
        if !st.dirty[page] {
            // Fetched and never written since: its remote copy is current, and it is still
            // write-protected, so no write can slip in before it is dropped.
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
            self.counters.evicted_clean.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(addr));
        }
        // A write after this blocks in a write-protect fault until the page is gone.
        if let Err(errno) = self.uffd.set_write_protect(addr, true, true) {
            st.clock.insert(page as u64);
            return Err(PageError::WriteProtect { page, errno });
        }
        let copied = if self.unreadable_possible.load(Ordering::Relaxed) {
            let mut buf = std::mem::take(&mut st.buf);
            let copied = self.copy_out(addr, &mut buf);
            st.buf = buf;
            copied
        } else {
            // SAFETY: the page is mapped (resident), readable (the program has not said
            // otherwise) and write-protected: no thread changes it while it is copied.
            unsafe {
                std::ptr::copy_nonoverlapping(addr.cast::<u8>(), st.buf.as_mut_ptr(), PAGE_SIZE)
            };
            Ok(())
        };
        match copied {
            Ok(()) => {}
            Err(rustix::io::Errno::FAULT) => {
                // `mprotect(PROT_NONE)` by the program: kept as it is, dirty, writable
                // again (for when the program lifts the protection).
                let _ = self.uffd.set_write_protect(addr, false, true);
                st.clock.insert(page as u64);
                self.counters
                    .unreadable_victims
                    .fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            Err(errno) => {
                let _ = self.uffd.set_write_protect(addr, false, true);
                st.clock.insert(page as u64);
                return Err(PageError::Copy { page, errno });
            }
        }
        if let Err(source) = self.store(st, page) {
            // Keep the page: writable again, and the writers blocked on it woken.
            let _ = self.uffd.set_write_protect(addr, false, true);
            st.clock.insert(page as u64);
            return Err(PageError::Store { page, source });
        }
        st.dirty[page] = false;
        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        Ok(Some(addr))
    }

    /// Copies the resident page at `addr` into `buf` through the kernel (`process_vm_readv`
    /// on this process), not with a plain load: the program may have made the page
    /// unreadable (`mprotect(PROT_NONE)` on its own memory: guard pages, a runtime's
    /// protected heap), and a plain load would kill the process with SIGSEGV in this thread.
    /// The kernel reports EFAULT instead. It costs a system call per page (GNU sort at 12M
    /// local took 5 % longer with every victim copied this way), so only once the program
    /// may have protected pages.
    fn copy_out(&self, addr: *mut c_void, buf: &mut [u8]) -> Result<(), rustix::io::Errno> {
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: PAGE_SIZE,
        };
        let remote = libc::iovec {
            iov_base: addr,
            iov_len: PAGE_SIZE,
        };
        // SAFETY: reads one page of this process into `buf`, which is PAGE_SIZE bytes; the
        // kernel checks the source's mapping and protection and fails rather than fault.
        let n = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
        match n {
            n if n == PAGE_SIZE as isize => Ok(()),
            n if n >= 0 => Err(rustix::io::Errno::FAULT),
            _ => Err(rustix::io::Errno::from_raw_os_error(
                std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
            )),
        }
    }

    /// Pages `first..first + count` are given back by the program (see `Region::release`).
    fn release(&self, st: &mut State<T, D>, first: usize, count: usize) -> Result<(), PageError> {
        // One call drops every mapped page of the range (and the zero page's mappings).
        drop_pages(self.base.page(first), count * PAGE_SIZE).map_err(PageError::Drop)?;
        let mut written = Vec::new();
        for page in first..first + count {
            let p = page as u64;
            if st.clock.is_sampled(p) {
                let aside = self.shadow.expect("sampled pages live in the shadow");
                let _ = drop_pages(aside.page(page), PAGE_SIZE);
            }
            st.clock.remove(p);
            st.dirty[page] = false;
            st.prefetched.remove(&p);
            if st.pager.is_written(p) {
                self.settle(st, page);
                written.push(p);
            }
        }
        self.counters
            .released
            .fetch_add(count as u64, Ordering::Relaxed);
        st.pager.discard_many(&written).map_err(PageError::Delete)
    }

    /// The pages to fetch with `page`, which faults: what the prefetcher proposes that is
    /// neither here nor on its way, and is stored somewhere (never-written pages are zero
    /// fills, not fetches).
    fn proposals(&self, st: &mut State<T, D>, page: usize) -> (Vec<u64>, Mode) {
        let (mut proposed, mode) = st.prefetcher.on_fault(page as u64, self.pages as u64);
        proposed.retain(|&p| {
            !st.clock.is_resident(p) && !st.prefetched.contains_key(&p) && st.pager.is_written(p)
        });
        (proposed, mode)
    }

    /// After a zero fill of `page`: fetches the pages the prefetcher proposes (a trend that
    /// runs on into written pages) with one pipelined read.
    fn prefetch(&self, st: &mut State<T, D>, page: usize) {
        let (wanted, mode) = self.proposals(st, page);
        if wanted.is_empty() {
            return;
        }
        let mut buf = std::mem::take(&mut st.pbuf);
        buf.resize(wanted.len() * PAGE_SIZE, 0);
        match st.pager.read_many(&wanted, &mut buf) {
            Ok(()) => {
                self.install_ahead(st, &wanted, mode, &buf);
                let keep = st.budget;
                self.make_room(st, keep);
            }
            // Only a guess failed: the page's own fault will report a real error.
            Err(e) => tracing::debug!("prefetching {wanted:?}: {e}"),
        }
        st.pbuf = buf;
    }

    /// Installs `pages` fetched ahead (proposed by `mode`; their contents in `data`).
    ///
    /// Most are installed at once, so that a scan along them does not fault at all (the
    /// kernel's swap readahead still takes a minor fault per page; a fault here is a round
    /// trip to this thread). One in PREFETCH_CHECK is left in the pager's cache to be faulted
    /// on: whether those are used is the prefetcher's hit rate, and its depths follow it.
    fn install_ahead(&self, st: &mut State<T, D>, pages: &[u64], mode: Mode, data: &[u8]) {
        let mut installed = 0;
        for (i, &p) in pages.iter().enumerate() {
            st.prefetch_seq = st.prefetch_seq.wrapping_add(1);
            if !st.prefetch_seq.is_multiple_of(PREFETCH_CHECK as u64) {
                let protect = st.protect_fetched();
                let page = &data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
                match self.uffd.copy(page, self.base.page(p as usize), protect) {
                    Ok(()) => {
                        st.dirty[p as usize] = !protect;
                        st.clock.insert(p);
                        installed += 1;
                        continue;
                    }
                    // Faulted in meanwhile, or the mapping is changing: leave it to faults.
                    Err(e) => tracing::debug!("installing prefetched page {p}: {e}"),
                }
            }
            st.prefetched.insert(p, mode);
            st.prefetch_order.push_back(p);
        }
        self.counters
            .prefetch_installed
            .fetch_add(installed, Ordering::Relaxed);
        self.counters
            .prefetched
            .fetch_add(pages.len() as u64 - installed, Ordering::Relaxed);
        // The pager's cache holds only so many: older guesses not used by now are taken as
        // wasted (the cache has probably evicted them).
        while st.prefetch_order.len() > st.prefetch_window {
            let old = st.prefetch_order.pop_front().expect("not empty");
            if let Some(mode) = st.prefetched.remove(&old) {
                st.prefetcher.wasted(mode);
            }
        }
    }
}

#[cfg(test)]
mod tests;
