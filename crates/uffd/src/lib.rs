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
//!
//! By concern: this file has the region, its options, counters and shared state; `handler.rs`
//! the handler's loop; `fetch.rs` fetches in flight (a fault starts one and the loop goes on;
//! it is installed when its reply is in); `fault.rs` serving one fault;
//! `evict.rs` victims and releases; `prefetch.rs` fetching ahead; `fork/` forked children (events and descriptors in `mod.rs`, their faults in `child.rs`, what they still read kept in `settle.rs`, their budget in `budget.rs`, a leaving parent's `handover.rs`);
//! `inbox.rs` every read of the descriptor, and the watcher that reads a fork's event for a
//! handler stuck on a lock the `fork` holds; `sys.rs` the kernel's ABI; `heap/` allocations on
//! a region; `alloc.rs` the Rust allocator.

mod agent;
pub mod alloc;
mod evict;
mod fault;
mod fetch;
mod fork;
mod handler;
pub mod heap;
mod inbox;
mod prefetch;
pub mod sys;
mod upkeep;

pub use alloc::NetramAlloc;
pub use fork::{children_follow, children_follow_regions};
use fork::{ForkChannel, ForkChild, CHILDREN_FOLLOW};
use handler::{Replies, STOP};
pub use heap::RegionHeap;
use netram_pager::{Disk, Pager, PagerError, Transport};
use netram_policy::clock::Clock;
use netram_policy::prefetch::{Mode, Prefetcher, MAX_CLUSTER};
use netram_proto::PAGE_SIZE;
use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};
use rustix::fd::OwnedFd;
use rustix::io::Errno;
use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use sys::{Event, Uffd};
pub use upkeep::Upkeep;

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
    /// ... of which started while other fetches were in flight (`fetch.rs`: their round trips
    /// overlap).
    pub batched_fetches: AtomicU64,
    /// Faults that found their page already installed by an earlier fault (EEXIST).
    pub already_present: AtomicU64,
    /// Faults on stored pages that came while a fork was pending, served once it happened
    /// (no fetch starts while the child's share is being fixed).
    pub faults_deferred: AtomicU64,
    /// Faults held by the handler, not served until acknowledgements returned room: the region
    /// was more than `OVER_BUDGET` pages over its budget (servers behind). The faulting
    /// threads wait; the handler does not, and serves everything else meanwhile.
    pub faults_held: AtomicU64,
    /// Times fetches in flight had no reply for `fetch::STALLED` (a server that hangs, or a
    /// slow one): the pager then looks for requests past its reply timeout.
    pub fetches_stalled: AtomicU64,
    /// Write-protect faults (a write that raced with an eviction).
    pub write_protect_faults: AtomicU64,
    /// Calls that write-protected victims before they were copied out: one per run of
    /// consecutive dirty pages in a batch, each a TLB flush.
    pub write_protect_calls: AtomicU64,
    /// Pages evicted to the pager.
    pub evictions: AtomicU64,
    /// ... of which all zeros, discarded instead of stored.
    pub evicted_zero: AtomicU64,
    /// ... of which clean (fetched and never written since): dropped without any I/O.
    pub evicted_clean: AtomicU64,
    /// Times the region was over its budget and the pager had no room for a dirty victim
    /// without waiting: the eviction was left for when acknowledgements return slots.
    pub evictions_deferred: AtomicU64,
    /// Dirty victims chosen that the pager could not take without waiting after all (their
    /// last write-back still in flight): kept resident for a later batch.
    pub victims_kept: AtomicU64,
    /// Batches of victims that waited for the pager: more than `OVER_BUDGET` pages over the
    /// budget (servers behind), where the program's memory must not grow further.
    pub evictions_waited: AtomicU64,
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
    /// Pages given back (or dropped by the program) while their write-back was still in
    /// flight: deleted once it is in, without waiting (reading as zeros meanwhile).
    pub releases_deferred: AtomicU64,
    /// Pages given back that forked children still read from the pager: their copy read for
    /// the children by ticket, the delete deferred until it is in (rather than waited for).
    pub releases_settling: AtomicU64,
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
    /// Faults woken to be retried, and victims kept resident for a later batch, because the
    /// mapping was changing (a fork copying it, until the handler has read its event).
    pub retried: AtomicU64,
    /// Forked children that inherited the region.
    pub forks: AtomicU64,
    /// Events read by the watcher for a handler that went no further round its loop for a
    /// tick while they waited: one held by a lock that a `fork` holds, whose event the
    /// kernel makes that `fork` wait for (`inbox.rs`). Each such rescue is a hang avoided.
    pub events_read_by_watcher: AtomicU64,
    /// Faults of forked children served (their pages installed in their memory).
    pub child_faults: AtomicU64,
    /// Children's pages read from the pager by ticket (see `fork/mod.rs` `ChildFetch`), and how
    /// many of those reads were not installed because the page changed for the child
    /// meanwhile (its fault served afresh).
    pub child_fetches: AtomicU64,
    pub child_fetches_redone: AtomicU64,
    /// Children's pages fetched ahead of their faults and installed in them.
    pub child_prefetched: AtomicU64,
    /// Batches of victims some of which stayed resident while their pager copies were read
    /// for children (`settle_ahead`).
    pub victims_settling: AtomicU64,
    /// Pages kept for a child before the parent changed them in the pager (its
    /// copy-on-write, done by the handler): installed in it, or stored as its own.
    pub child_copies: AtomicU64,
    /// Pages children dropped to stay within their budget (see `ForkChild`).
    pub child_drops: AtomicU64,
    /// Pages stored in the pager as a child's own (its writes, its fork-time copies).
    pub child_private_pages: AtomicU64,
    /// The most pages a child held to a budget was known to have resident.
    pub child_peak_resident: AtomicU64,
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
/// Pages over its budget a region holds at most while its victims wait for the pager's room
/// without blocking the handler (see `Shared::make_room`): two batches. Past it the handler
/// holds new faults until room returns (`Shared::holds_faults`); other threads that make
/// room (a program's `set_budget`) wait for it.
const OVER_BUDGET: usize = 2 * EVICT_BATCH;
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
    /// The thread that reads events for a stuck handler, where the kernel makes a `fork` wait
    /// for them (`inbox.rs`). Boxed: a region is handed around by value, and only root's
    /// regions have one.
    watcher: Option<Box<JoinHandle<()>>>,
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
    /// Forked children held to the budget at once (each its own, as large as the parent's at
    /// the fork; see `ForkChild`): their own pages go to the pager at page numbers past the
    /// region's, `slot × region pages + page`, so the pager needs `(1 + child_slots) × region
    /// pages`. 0 (the default): children keep every page they touch.
    pub child_slots: usize,
    /// Resident pages at most for such a child, in bytes (`None`: the parent's budget at the
    /// fork).
    pub child_budget: Option<usize>,
    /// The pager's maintenance schedule, run by the handler between faults (`None`, the
    /// default: not run; see [`Region::set_upkeep`]).
    pub upkeep: Option<Upkeep>,
}

impl Default for RegionOptions {
    fn default() -> Self {
        Self {
            max_samples: 0,
            spin: std::time::Duration::ZERO,
            child_slots: 0,
            child_budget: None,
            upkeep: None,
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

    /// The watcher of `inbox.rs`, for a region whose forks the kernel holds until the handler
    /// has read their events.
    ///
    /// When the region goes, it goes on reading the descriptor (a copy of its own) until no
    /// event has come for a while (see `inbox.rs`), and holds nothing else of the region.
    fn start_watcher(&self) -> std::io::Result<JoinHandle<()>> {
        let (s, wake) = (self.shared.clone(), self.stop.clone());
        let grave = s.uffd.try_clone()?;
        std::thread::Builder::new()
            .name("netram-uffd-watch".into())
            .spawn(move || {
                alloc::mark_internal_thread();
                // Allocated now: nothing is, once the region has gone.
                let mut events = Vec::with_capacity(sys::MOST_EVENTS);
                let rescued = &s.counters.events_read_by_watcher;
                s.inbox.watch_until_stopped(&s.uffd, &*wake, rescued);
                drop((s, wake));
                inbox::keep_reading_until_quiet(&grave, &mut events);
            })
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
        let needed = pages as u64 * (1 + options.child_slots as u64);
        if needed > pager.config().pages {
            return Err(RegionError::LargerThanPager {
                pages: needed,
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
            inbox: inbox::Inbox::new(),
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
                drops: Vec::new(),
                victims: Vec::new(),
                fetching: HashMap::new(),
                fetch_progress: std::time::Instant::now(),
                stalled: false,
                fetch_buf: Vec::new(),
                fetch_done: Vec::new(),
                child_fetches: HashMap::new(),
                child_fetching: HashMap::new(),
                next_child_fetch: 0,
                next_child_id: 0,
                protection: Protection::default(),
                prefetch_seq: 0,
                child_buf: vec![0u8; PAGE_SIZE],
                settle_buf: Vec::new(),
                settling: HashSet::new(),
                undeleted: Vec::new(),
                released: HashSet::new(),
                release_settling: HashSet::new(),
                agent_buf: Vec::new(),
                children: Vec::new(),
                forking: 0,
                fork_resident: None,
                forking_since: None,
                deferred: Vec::new(),
                forking_tid: None,
                last_probe: std::time::Instant::now(),
                upkeep: options.upkeep,
            }),
            upkeep_on: std::sync::atomic::AtomicBool::new(options.upkeep.is_some()),
            follows_forks,
            fork_channel,
            child_count: AtomicUsize::new(0),
            forks_pending: AtomicU32::new(0),
            child_slots: if follows_forks {
                options.child_slots
            } else {
                0
            },
            child_budget: options.child_budget.map(|b| (b / PAGE_SIZE).max(1)),
            agent_fds: [
                std::sync::atomic::AtomicI32::new(-1),
                std::sync::atomic::AtomicI32::new(-1),
            ],
            forked: Condvar::new(),
            wake: stop.clone(),
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
        let mut region = Self {
            shared,
            stop,
            handler: Some(thread),
            watcher: None,
        };
        if forks == Forks::Event {
            // Dropping `region` on an error stops the handler and unmaps.
            region.watcher = Some(Box::new(
                region.start_watcher().map_err(RegionError::Handler)?,
            ));
        }
        Ok(region)
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

    /// Changes the local budget (at least one page); lowering it evicts at once what the
    /// pager has room to write without waiting, and waits only for what stays more than
    /// `OVER_BUDGET` pages over (see `make_room`); the rest follows as replies return room.
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
        // The pages must not change in the pager before the child knows them: every pending
        // fork is waited for (ended within 5 s by `serve_children` if its event never comes).
        let mut st = self
            .shared
            .await_forks(self.shared.lock(), std::time::Duration::MAX);
        self.shared
            .release(&mut st, offset / PAGE_SIZE, len / PAGE_SIZE)
            .map_err(RegionError::Release)
    }

    /// Fault point: the handler thread ends as if it had failed.
    #[cfg(test)]
    fn kill_handler(&self) {
        let _ = rustix::io::write(&*self.stop, &handler::DIE.to_ne_bytes());
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

    /// Whether the kernel's own accesses to the region (a `read(2)` into it, a `write(2)` from
    /// it) are served when they fault. Not for an ordinary user where
    /// `vm.unprivileged_userfaultfd` is 0: there such a call fails with EFAULT on a page that
    /// is not resident (see `open_userfaultfd`).
    pub fn serves_kernel_faults(&self) -> bool {
        !self.shared.uffd.user_mode_only()
    }

    /// Runs `f` on the region's pager (its counters, its servers).
    pub fn with_pager<R>(&self, f: impl FnOnce(&mut Pager<T, D>) -> R) -> R {
        let mut st = self.shared.lock();
        let r = f(&mut st.pager);
        // Fetches whose replies `f` read are installed now (the handler may be asleep).
        self.shared.finish_fetches(&mut st);
        r
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
    /// Runs `f` on the pager, under the region's lock; then installs the fetches whose replies
    /// `f` read (the handler may be asleep waiting for them).
    pub fn with<R>(&self, f: impl FnOnce(&mut Pager<T, D>) -> R) -> R {
        let mut st = self.0.lock();
        let r = f(&mut st.pager);
        self.0.finish_fetches(&mut st);
        r
    }
}

impl<T: Transport, D: Disk> Drop for Region<T, D> {
    fn drop(&mut self) {
        let _ = rustix::io::write(&*self.stop, &STOP.to_ne_bytes());
        if let Some(h) = self.handler.take() {
            let _ = h.join();
        }
        // From here the watcher reads every event, until after the range is gone: a `fork`
        // going on now may have copied it (see `inbox.rs`). Not joined: it ends by itself.
        if let Some(w) = self.watcher.take() {
            self.shared.inbox.stop_watching();
            w.thread().unpark();
        }
        #[cfg(test)]
        std::thread::sleep(tests::DROP_PAUSE.get());
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
        let State {
            pager, undeleted, ..
        } = &mut *st;
        // (And what ended children left: see `forget_child`.)
        let mut written: Vec<u64> = (0..sh.pages as u64)
            .filter(|&p| pager.is_written(p))
            .collect();
        written.append(undeleted);
        // Flushing waits for the DELETEs' acknowledgements.
        if let Err(e) = pager.discard_many(&written).and_then(|()| pager.flush()) {
            tracing::warn!("freeing a dropped region's pages: {e}");
        }
    }
}

/// What the handler thread and the region's owner share.
struct Shared<T: Transport, D: Disk> {
    base: Base,
    /// Where sampled pages wait, page for page; `None` without `UFFDIO_MOVE` (no sampling).
    shadow: Option<Base>,
    pages: usize,
    uffd: Uffd,
    /// Every read of `uffd` goes through it (see `inbox.rs`).
    inbox: inbox::Inbox,
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
    /// `state.forking`, read without the lock at `_exit` (`Region::has_children`).
    forks_pending: AtomicU32,
    /// See [`RegionOptions::child_slots`] and [`RegionOptions::child_budget`] (in pages).
    child_slots: usize,
    child_budget: Option<usize>,
    /// The handler's and the child's ends of the agent's socket made for the fork in progress
    /// (-1: none); see `agent.rs`.
    agent_fds: [std::sync::atomic::AtomicI32; 2],
    /// Signalled when no fork is pending any more (`release` waits for it).
    forked: Condvar,
    /// The handler loop's eventfd (the region's `stop`), written [`handler::WAKE`] to have it
    /// look again from another thread: faults deferred over a fork that no longer pends.
    wake: Arc<OwnedFd>,
    /// `state.upkeep.is_some()`, read without the lock by the handler's loop.
    upkeep_on: std::sync::atomic::AtomicBool,
}

/// Whether installing fetched pages write-protected pays: a protected page that is never
/// written is dropped without I/O, but each one written costs a second fault (its first
/// write). Kept for the region's fetches and for each forked child's.
#[derive(Debug, Default)]
pub(crate) struct Protection {
    /// Pages installed protected, and how many of them were written later (both halved now
    /// and then, so that they follow the program's phases); installs since the last check.
    protected: u32,
    written: u32,
    skipped: u32,
}

impl Protection {
    /// Whether to install the next fetched page write-protected: while fewer than half of
    /// the protected ones were written afterwards, and one in 16 otherwise, to notice when
    /// that changes.
    pub(crate) fn decide(&mut self) -> bool {
        if self.protected >= 512 {
            self.protected /= 2;
            self.written /= 2;
        }
        self.skipped = self.skipped.wrapping_add(1);
        let pays = self.protected < 16 || self.written * 2 < self.protected;
        let protect = pays || self.skipped.is_multiple_of(16);
        if protect {
            self.protected += 1;
        }
        protect
    }

    /// A page installed protected was written.
    pub(crate) fn written(&mut self) {
        self.written += 1;
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
    /// Victims chosen and not dropped yet (see `make_room`), kept to reuse its allocation.
    drops: Vec<(usize, usize, bool)>,
    /// The batch of victims being evicted, `(page, sampled)` (see `make_room`).
    victims: Vec<(usize, bool)>,
    /// Pages being fetched by ticket (`fetch.rs`), when one last finished, and buffers for
    /// the finished ones.
    fetching: HashMap<u64, fetch::Fetch>,
    fetch_progress: std::time::Instant,
    /// Fetches have had no reply for `fetch::STALLED` (counted once a stall).
    stalled: bool,
    fetch_buf: Vec<u8>,
    fetch_done: Vec<(u64, u64, Result<usize, PagerError>)>,
    /// Forked children's pages being read by ticket (`fork/mod.rs`, `ChildFetch`), by the tag
    /// their reads carry, and which one reads each (child, page); the next tag's number and
    /// the next child's id.
    child_fetches: HashMap<u64, fork::ChildFetch>,
    child_fetching: HashMap<(u64, usize), u64>,
    next_child_fetch: u64,
    next_child_id: u64,
    /// Whether protecting the region's fetched pages pays.
    protection: Protection,
    /// Pages prefetched so far: every PREFETCH_CHECK-th is left to be faulted on.
    prefetch_seq: u64,
    /// Forked children whose memory is still there, a page buffer for them, and one for
    /// their agents' messages.
    children: Vec<ForkChild>,
    child_buf: Vec<u8>,
    /// Pages read for `settle_many`.
    settle_buf: Vec<u8>,
    /// Victims whose pager copy is being read for children (`settle_ahead`).
    settling: HashSet<usize>,
    /// Pages of ended children still to delete: their last write-back was out when the child
    /// ended (`forget_child`); deleted once it is in, without waiting.
    undeleted: Vec<u64>,
    /// Pages the program gave back (or dropped) whose last write-back was still out: their
    /// pager copy is deleted once it is in (`delete_leftovers`), without waiting; meanwhile
    /// they count as never written ([`State::holds`]): a fault fills zeros.
    released: HashSet<u64>,
    /// Pages given back (so also in `released`) whose pager copy some child still reads: it
    /// is being read by ticket for those children (`settling`, `Shared::settle_released`);
    /// until it is in, the children read that copy ([`State::child_holds`]), the region reads
    /// zeros, and its delete waits.
    release_settling: HashSet<u64>,
    agent_buf: Vec<u8>,
    /// Forks announced by `prepare_fork` whose event has not arrived: meanwhile nothing is
    /// evicted (so every page resident at the announcement is in the child) and no page
    /// changes in the pager (so the child can be served the pages it lacks from there).
    forking: u32,
    /// Resident pages (a bit each) when the first pending fork was announced: the pages the
    /// child will have.
    fork_resident: Option<Vec<u64>>,
    forking_since: Option<std::time::Instant>,
    /// Missing faults on stored pages that came while a fork was pending (page, write, thread):
    /// served once none is (`Shared::serve_deferred`), so that nothing is fetched, and nothing
    /// waits for the network, while the child's share is being fixed.
    deferred: Vec<(usize, bool, u32)>,
    /// The thread that announced the pending fork: its own faults until the fork (the C
    /// library's and the program's `atfork` handlers run between) are served, not deferred.
    forking_tid: Option<u32>,
    /// When the children were last asked whether their memory is still there.
    last_probe: std::time::Instant,
    /// The maintenance schedule the handler runs (`upkeep.rs`).
    upkeep: Option<Upkeep>,
}

impl<T: Transport, D: Disk> State<T, D> {
    /// Whether the pager holds contents for region page (or child page number) `p`: written,
    /// and not given back since.
    fn holds(&self, p: u64) -> bool {
        self.pager.is_written(p) && !self.released.contains(&p)
    }

    /// [`State::holds`] as a forked child sees it: a page given back whose copy is still
    /// being read for the children (`release_settling`) holds their contents until then.
    fn child_holds(&self, p: u64) -> bool {
        self.pager.is_written(p)
            && (!self.released.contains(&p) || self.release_settling.contains(&p))
    }

    /// Whether reads by ticket of the region's or its children's faults are in flight.
    fn fetches_out(&self) -> bool {
        !self.fetching.is_empty() || !self.child_fetches.is_empty() || !self.settling.is_empty()
    }

    /// Sets how many pages the hand samples per victim: none while a fork is pending or a
    /// child lives (see `prepare_fork`).
    fn apply_sampling(&mut self) {
        let on = self.children.is_empty() && self.forking == 0;
        self.clock
            .set_max_samples(if on { self.max_samples } else { 0 });
    }
}

impl<T: Transport, D: Disk> Shared<T, D> {
    fn lock(&self) -> MutexGuard<'_, State<T, D>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests;
