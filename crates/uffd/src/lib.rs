//! netram's userfaultfd front end: a region of this process's memory whose pages live in the
//! cluster, paged in on first touch and out when the region holds more than its local budget.
//!
//! This is how netram reaches programs without root or the kernel's swap (the Anemone paper's
//! remark, §2.2, that remote memory can be mapped by programs that know of it; Dodo and AIFM
//! which it cites). A [`Region`] maps anonymous memory and registers it with userfaultfd; a
//! handler thread serves its faults through the core's pager:
//!
//! * a page never written is installed as the zero page, without a network round trip;
//! * a page that was evicted is fetched from its server and installed with `UFFDIO_COPY`;
//! * when more than `budget` pages are resident, the oldest resident page is evicted: it is
//!   write-protected first (`UFFDIO_WRITEPROTECT`), so that a write racing with the copy-out
//!   blocks instead of being lost, then copied to the pager (an all-zero page is discarded:
//!   stored as nothing), then dropped with `MADV_DONTNEED`; the writer, woken afterwards,
//!   faults again and gets the page back;
//! * a fetched page is installed write-protected: its first write is a write-protect fault that
//!   marks it dirty and lifts the protection, and a page never written since its fetch is
//!   evicted by dropping it, without copying or sending anything (its remote copy is current);
//! * after each fault, the pages a trend detector (`netram_policy::prefetch`, after Leap)
//!   expects next are fetched into the pager's cache with one pipelined read, so that
//!   sequential and strided scans fault without waiting for the network; hits are counted.
//!
//! Hazards handled here: `EEXIST` from `UFFDIO_COPY`/`ZEROPAGE` (two threads faulted the same
//! page; the first fault installed it: the second is only woken); `EAGAIN` (the region is
//! changing under the handler: the fault is woken and retried by the kernel); faults from any
//! number of threads (one handler serves them in order); a write-protect fault on a page being
//! evicted (woken after the eviction, it becomes a missing fault). The userfaultfd is created
//! with `UFFD_USER_MODE_ONLY`, so it works for ordinary users where
//! `vm.unprivileged_userfaultfd` is 0, as for root.
//!
//! Not done yet (issue 5 goes on): victims are chosen first in, first out, not by an
//! approximation of LRU; the
//! program's `munmap`, `madvise(DONTNEED)`, `mremap` and `fork` are not tracked; no allocator,
//! C ABI or `netram run`.
//!
//! A handler that dies (an error reading the userfaultfd, a panic) does not leave the program
//! hanging: the region is made inaccessible and the waiting threads are woken, so they die of
//! SIGSEGV, loudly, rather than wait forever or read zeros.

use netram_pager::{Disk, Pager, Transport};
use netram_policy::prefetch::Prefetcher;
use netram_proto::PAGE_SIZE;
use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};
use rustix::fd::OwnedFd;
use std::collections::{HashSet, VecDeque};
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use userfaultfd::{Event, FaultKind, RegisterMode, Uffd, UffdBuilder};

#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("a region needs a size above zero and a budget of at least one page")]
    BadSize,
    #[error("the region ({pages} pages) is larger than its pager ({pager_pages} pages)")]
    LargerThanPager { pages: u64, pager_pages: u64 },
    #[error("cannot map the region: {0}")]
    Map(rustix::io::Errno),
    #[error("cannot open userfaultfd: {0}")]
    Userfaultfd(userfaultfd::Error),
    #[error(
        "cannot open userfaultfd: {0} (as an ordinary user this needs UFFD_USER_MODE_ONLY, \
         Linux 5.11 or later)"
    )]
    UserfaultfdSyscall(rustix::io::Errno),
    #[error("cannot register the region with userfaultfd: {0}")]
    Register(userfaultfd::Error),
    #[error("cannot start the fault handler: {0}")]
    Handler(std::io::Error),
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
    /// Pages fetched ahead of their fault by the prefetcher.
    pub prefetched: AtomicU64,
    /// ... of which faulted on later (served from the pager's cache).
    pub prefetch_hits: AtomicU64,
    /// Faults the handler could not serve (the pager failed): the faulting thread is woken and
    /// faults again; the error is logged.
    pub errors: AtomicU64,
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

/// The most pages fetched ahead at one fault.
const MAX_PREFETCH: usize = 16;

/// A userfaultfd for faults from user mode (`UFFD_USER_MODE_ONLY`, allowed to ordinary users
/// where `vm.unprivileged_userfaultfd` is 0), non-blocking, with write-protect faults.
fn open_userfaultfd() -> Result<Uffd, RegionError> {
    let created = UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(true)
        .require_features(userfaultfd::FeatureFlags::PAGEFAULT_FLAG_WP)
        .create();
    match created {
        // The crate tries /dev/userfaultfd first and does not fall back to the system call
        // when the device exists but is root's only (as here): do the system call and the
        // API handshake ourselves, then hand the descriptor to the crate.
        Err(userfaultfd::Error::OpenDevUserfaultfd(e))
            if e.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            userfaultfd_by_syscall()
        }
        other => other.map_err(RegionError::Userfaultfd),
    }
}

fn userfaultfd_by_syscall() -> Result<Uffd, RegionError> {
    use rustix::fd::IntoRawFd;
    use std::os::fd::FromRawFd;
    const UFFD_USER_MODE_ONLY: u32 = 1;
    const UFFD_API: u64 = 0xaa;
    const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
    /// `struct uffdio_api` of linux/userfaultfd.h.
    #[repr(C)]
    struct UffdioApi {
        api: u64,
        features: u64,
        ioctls: u64,
    }
    let flags = rustix::mm::UserfaultfdFlags::CLOEXEC
        | rustix::mm::UserfaultfdFlags::NONBLOCK
        | rustix::mm::UserfaultfdFlags::from_bits_retain(UFFD_USER_MODE_ONLY);
    let io = RegionError::UserfaultfdSyscall;
    // SAFETY: userfaultfd(2) only creates a descriptor; the flags are the kernel's.
    let fd = unsafe { rustix::mm::userfaultfd(flags) }.map_err(io)?;
    let mut api = UffdioApi {
        api: UFFD_API,
        features: UFFD_FEATURE_PAGEFAULT_FLAG_WP,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API (_IOWR(0xAA, 0x3F, struct uffdio_api)) reads and writes exactly one
    // struct uffdio_api, which `UffdioApi` lays out.
    unsafe {
        const OP: rustix::ioctl::Opcode =
            rustix::ioctl::opcode::read_write::<UffdioApi>(0xaa, 0x3f);
        rustix::ioctl::ioctl(&fd, rustix::ioctl::Updater::<OP, UffdioApi>::new(&mut api))
    }
    .map_err(io)?;
    // SAFETY: a userfaultfd descriptor that we own and give up here.
    Ok(unsafe { Uffd::from_raw_fd(fd.into_raw_fd()) })
}

/// Installs `page` at `dst` write-protected and wakes the faulting threads, in one
/// `UFFDIO_COPY` with `UFFDIO_COPY_MODE_WP`. Protecting it afterwards would leave a window in
/// which any thread's write lands unseen and the page, believed clean, is later dropped with
/// it (a test caught exactly that). The `userfaultfd` crate's `copy` has no WP mode, hence the
/// ioctl here.
fn copy_write_protected(
    uffd: &Uffd,
    page: &[u8],
    dst: *mut c_void,
) -> Result<(), rustix::io::Errno> {
    use std::os::fd::AsRawFd;
    const UFFDIO_COPY_MODE_WP: u64 = 1 << 1;
    /// `struct uffdio_copy` of linux/userfaultfd.h.
    #[repr(C)]
    struct UffdioCopy {
        dst: u64,
        src: u64,
        len: u64,
        mode: u64,
        copy: i64,
    }
    assert_eq!(page.len(), PAGE_SIZE);
    let mut copy = UffdioCopy {
        dst: dst as u64,
        src: page.as_ptr() as u64,
        len: PAGE_SIZE as u64,
        mode: UFFDIO_COPY_MODE_WP,
        copy: 0,
    };
    // SAFETY: the descriptor is the Uffd's, open for the call.
    let fd = unsafe { rustix::fd::BorrowedFd::borrow_raw(uffd.as_raw_fd()) };
    // SAFETY: UFFDIO_COPY (_IOWR(0xAA, 0x03, struct uffdio_copy)) reads and writes one struct
    // uffdio_copy, laid out by `UffdioCopy`; `src` is one readable page, `dst` a page of a
    // range registered with this userfaultfd.
    let r = unsafe {
        const OP: rustix::ioctl::Opcode =
            rustix::ioctl::opcode::read_write::<UffdioCopy>(0xaa, 0x03);
        rustix::ioctl::ioctl(fd, rustix::ioctl::Updater::<OP, UffdioCopy>::new(&mut copy))
    };
    r
}

/// The mapping's base address, sent to the handler thread. A plain address: the handler only
/// passes it to the kernel and copies pages through it while they are write-protected.
#[derive(Debug, Clone, Copy)]
struct Base(NonNull<u8>);
// SAFETY: the address is only dereferenced by the handler, for pages of a mapping the Region
// keeps alive until the handler has been joined.
unsafe impl Send for Base {}

/// A region of memory paged from the cluster.
pub struct Region<T: Transport, D: Disk> {
    base: Base,
    len: usize,
    uffd: Arc<Uffd>,
    pager: Arc<Mutex<Pager<T, D>>>,
    counters: Arc<RegionCounters>,
    stop: Arc<OwnedFd>,
    handler: Option<JoinHandle<()>>,
}

impl<T: Transport, D: Disk> std::fmt::Debug for Region<T, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("base", &self.base.0)
            .field("len", &self.len)
            .field("counters", &self.counters)
            .finish()
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
        // SAFETY: a fresh anonymous private mapping at an address the kernel chooses; it
        // aliases nothing, and it is unmapped only in Drop after the handler has stopped.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::NORESERVE,
            )
        }
        .map_err(RegionError::Map)?;
        let base = Base(NonNull::new(ptr.cast()).expect("mmap does not return null"));
        let unmap = |e| {
            // SAFETY: the mapping made above, not yet handed to anyone.
            let _ = unsafe { rustix::mm::munmap(ptr, len) };
            e
        };
        let uffd = open_userfaultfd().map_err(unmap)?;
        uffd.register_with_mode(
            ptr,
            len,
            RegisterMode::MISSING | RegisterMode::WRITE_PROTECT,
        )
        .map_err(|e| unmap(RegionError::Register(e)))?;
        let uffd = Arc::new(uffd);
        let stop = Arc::new(
            eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
                .map_err(|e| unmap(RegionError::Handler(e.into())))?,
        );
        // Prefetched pages wait in the pager's cache: no cache, no prefetching.
        let prefetch_window = pager.config().cache_pages;
        let pager = Arc::new(Mutex::new(pager));
        let counters = Arc::new(RegionCounters::default());
        let handler = Handler {
            base,
            pages,
            budget: budget_pages,
            uffd: uffd.clone(),
            pager: pager.clone(),
            counters: counters.clone(),
            resident: VecDeque::with_capacity(budget_pages),
            is_resident: vec![false; pages],
            dirty: vec![false; pages],
            buf: vec![0u8; PAGE_SIZE],
            prefetcher: Prefetcher::new(MAX_PREFETCH.min(prefetch_window / 2)),
            prefetched: HashSet::new(),
            prefetch_order: VecDeque::new(),
            prefetch_window,
            pbuf: Vec::new(),
        };
        let stop_fd = stop.clone();
        let thread = std::thread::Builder::new()
            .name("netram-uffd".into())
            .spawn(move || handler.run(&stop_fd))
            .map_err(|e| unmap(RegionError::Handler(e)))?;
        Ok(Self {
            base,
            len,
            uffd,
            pager,
            counters,
            stop,
            handler: Some(thread),
        })
    }
}

impl<T: Transport, D: Disk> Region<T, D> {
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.0.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region as bytes. Reading faults pages in as needed.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes, readable, and lives as long as `self`. Its
        // contents change behind the slice only by the handler reinstalling exactly the bytes
        // that were there (a page in or out is invisible to the program).
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }

    /// The region as mutable bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only slice.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len) }
    }

    pub fn counters(&self) -> &RegionCounters {
        &self.counters
    }

    /// Fault point: the handler thread ends as if it had failed.
    #[cfg(test)]
    fn kill_handler(&self) {
        let _ = rustix::io::write(&*self.stop, &DIE.to_ne_bytes());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }

    /// Runs `f` on the region's pager (its counters, its servers).
    pub fn with_pager<R>(&self, f: impl FnOnce(&mut Pager<T, D>) -> R) -> R {
        f(&mut self.pager.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl<T: Transport, D: Disk> Drop for Region<T, D> {
    fn drop(&mut self) {
        let _ = rustix::io::write(&*self.stop, &STOP.to_ne_bytes());
        if let Some(h) = self.handler.take() {
            let _ = h.join();
        }
        let _ = self.uffd.unregister(self.base.0.as_ptr().cast(), self.len);
        // SAFETY: our mapping; the handler has stopped and no slice of it outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.base.0.as_ptr().cast(), self.len) };
        // The region's pages are garbage now: free them on their servers at once rather than
        // when the pager's session ends.
        let mut pager = self.pager.lock().unwrap_or_else(|p| p.into_inner());
        let written: Vec<u64> = (0..(self.len / PAGE_SIZE) as u64)
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

/// See `Handler::run`.
struct DeadHandler {
    base: Base,
    len: usize,
    uffd: Arc<Uffd>,
    armed: bool,
}

impl Drop for DeadHandler {
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
        let _ = self.uffd.wake(self.base.0.as_ptr().cast(), self.len);
    }
}

/// The fault handler's state; lives on its thread.
struct Handler<T: Transport, D: Disk> {
    base: Base,
    pages: usize,
    budget: usize,
    uffd: Arc<Uffd>,
    pager: Arc<Mutex<Pager<T, D>>>,
    counters: Arc<RegionCounters>,
    /// Resident pages, oldest first.
    resident: VecDeque<usize>,
    is_resident: Vec<bool>,
    /// Whether a resident page may differ from its remote copy.
    dirty: Vec<bool>,
    buf: Vec<u8>,
    prefetcher: Prefetcher,
    /// Pages fetched ahead into the pager's cache and not faulted on yet, oldest first.
    prefetched: HashSet<u64>,
    prefetch_order: VecDeque<u64>,
    /// How many guesses the pager's cache is taken to hold.
    prefetch_window: usize,
    pbuf: Vec<u8>,
}

impl<T: Transport, D: Disk> Handler<T, D> {
    fn run(mut self, stop: &OwnedFd) {
        // However this thread ends other than by the region's drop (an error, a panic), the
        // guard makes the region inaccessible and wakes every waiting thread: they die of
        // SIGSEGV instead of waiting forever for a handler that is gone.
        let mut guard = DeadHandler {
            base: self.base,
            len: self.pages * PAGE_SIZE,
            uffd: self.uffd.clone(),
            armed: true,
        };
        loop {
            let mut fds = [
                PollFd::new(&*self.uffd, PollFlags::IN),
                PollFd::new(stop, PollFlags::IN),
            ];
            match poll(&mut fds, None) {
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
            // Non-blocking: drain every event that has arrived.
            loop {
                match self.uffd.read_event() {
                    Ok(Some(event)) => self.handle(event),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::error!("userfaultfd handler: read: {e}");
                        return;
                    }
                }
            }
        }
    }

    fn page_addr(&self, page: usize) -> *mut c_void {
        // SAFETY: `page` < pages, so the address lies within the mapping.
        unsafe { self.base.0.as_ptr().add(page * PAGE_SIZE).cast() }
    }

    fn handle(&mut self, event: Event) {
        let Event::Pagefault { kind, addr, .. } = event else {
            // Only page faults were asked for (no fork, remap, remove or unmap events).
            return;
        };
        let page = (addr as usize - self.base.0.as_ptr() as usize) / PAGE_SIZE;
        debug_assert!(page < self.pages);
        match kind {
            FaultKind::Missing => self.missing(page),
            FaultKind::WriteProtected if self.is_resident[page] => {
                // The first write to a fetched page, which was installed write-protected: from
                // now on it differs from its remote copy.
                self.counters.first_writes.fetch_add(1, Ordering::Relaxed);
                self.dirty[page] = true;
                if let Err(e) =
                    self.uffd
                        .remove_write_protection(self.page_addr(page), PAGE_SIZE, true)
                {
                    tracing::error!("unprotecting page {page}: {e}");
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            FaultKind::WriteProtected => {
                // A write that raced with the page's eviction: an eviction completes before the
                // next event is read, so the page is gone now, and the woken writer faults
                // again as a missing page.
                self.counters
                    .write_protect_faults
                    .fetch_add(1, Ordering::Relaxed);
                let _ = self.uffd.wake(self.page_addr(page), PAGE_SIZE);
            }
        }
    }

    fn missing(&mut self, page: usize) {
        self.counters.faults.fetch_add(1, Ordering::Relaxed);
        if self.is_resident[page] {
            // Installed by an earlier fault of another thread: only wake this one.
            self.counters
                .already_present
                .fetch_add(1, Ordering::Relaxed);
            let _ = self.uffd.wake(self.page_addr(page), PAGE_SIZE);
            return;
        }
        while self.resident.len() >= self.budget {
            if let Err(e) = self.evict_oldest() {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!("evicting a page: {e}");
                break;
            }
        }
        let addr = self.page_addr(page);
        if self.prefetched.remove(&(page as u64)) {
            // Fetched ahead: the pager serves it from its cache, without a round trip.
            self.counters.prefetch_hits.fetch_add(1, Ordering::Relaxed);
            self.prefetcher.hit();
        }
        let written = {
            let mut pager = self.pager.lock().unwrap_or_else(|p| p.into_inner());
            let written = pager.is_written(page as u64);
            if written {
                if let Err(e) = pager.read(page as u64, &mut self.buf) {
                    drop(pager);
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::error!("fetching page {page}: {e}");
                    // Woken without a page, the thread faults again and is retried.
                    let _ = self.uffd.wake(addr, PAGE_SIZE);
                    return;
                }
            }
            written
        };
        // The errno of a failed install.
        let result: Result<(), i32> = if written {
            self.counters.fetches.fetch_add(1, Ordering::Relaxed);
            copy_write_protected(&self.uffd, &self.buf, addr).map_err(|e| e.raw_os_error())
        } else {
            self.counters.zero_fills.fetch_add(1, Ordering::Relaxed);
            // SAFETY: `addr` is a page of the registered range.
            unsafe { self.uffd.zeropage(addr, PAGE_SIZE, true) }
                .map(|_| ())
                .map_err(|e| match e {
                    userfaultfd::Error::ZeropageFailed(errno) => errno as i32,
                    _ => rustix::io::Errno::IO.raw_os_error(),
                })
        };
        match result {
            Ok(()) => {}
            // Installed meanwhile (by a fault this handler has not read yet, or the program
            // wrote through a kernel path): present now, so resident.
            Err(e) if e == rustix::io::Errno::EXIST.raw_os_error() => {
                self.counters
                    .already_present
                    .fetch_add(1, Ordering::Relaxed);
                let _ = self.uffd.wake(addr, PAGE_SIZE);
            }
            Err(e) => {
                // EAGAIN: the mapping is changing; the woken thread faults again.
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("installing page {page}: errno {e}");
                let _ = self.uffd.wake(addr, PAGE_SIZE);
                return;
            }
        }
        // A fetched page equals its remote copy until written: it was installed
        // write-protected, so that the first write is seen and an unwritten page is evicted
        // without I/O. (A zero fill needs no tracking: the kernel maps the shared zero page, a
        // write replaces it, and eviction finds out by looking whether it is still all zeros.)
        self.dirty[page] = !written;
        self.is_resident[page] = true;
        self.resident.push_back(page);
        // The faulting thread runs again; meanwhile fetch what the trend says comes next.
        self.prefetch(page);
    }

    /// Fetches the pages the prefetcher proposes after a fault on `page` into the pager's
    /// cache, with one pipelined read: a later fault on one of them costs no round trip.
    fn prefetch(&mut self, page: usize) {
        let proposed = self.prefetcher.on_fault(page as u64, self.pages as u64);
        if proposed.is_empty() {
            return;
        }
        let mut pager = self.pager.lock().unwrap_or_else(|p| p.into_inner());
        let wanted: Vec<u64> = proposed
            .into_iter()
            .filter(|&p| {
                !self.is_resident[p as usize]
                    && !self.prefetched.contains(&p)
                    && pager.is_written(p)
            })
            .collect();
        if wanted.is_empty() {
            return;
        }
        self.pbuf.resize(wanted.len() * PAGE_SIZE, 0);
        if let Err(e) = pager.read_many(&wanted, &mut self.pbuf) {
            // Only a guess failed: the page's own fault will report a real error.
            tracing::debug!("prefetching {wanted:?}: {e}");
            return;
        }
        drop(pager);
        self.counters
            .prefetched
            .fetch_add(wanted.len() as u64, Ordering::Relaxed);
        for p in wanted {
            self.prefetched.insert(p);
            self.prefetch_order.push_back(p);
        }
        // The pager's cache holds only so many: older guesses not used by now are taken as
        // wasted (the cache has probably evicted them).
        while self.prefetch_order.len() > self.prefetch_window {
            let old = self.prefetch_order.pop_front().expect("not empty");
            if self.prefetched.remove(&old) {
                self.prefetcher.wasted();
            }
        }
    }

    /// Evicts the oldest resident page: write-protect, copy out, store, drop. On failure the
    /// page stays resident and writable.
    fn evict_oldest(&mut self) -> Result<(), String> {
        let Some(page) = self.resident.pop_front() else {
            return Ok(());
        };
        let addr = self.page_addr(page);
        if !self.dirty[page] {
            // Fetched and never written since: its remote copy is current, and it is still
            // write-protected, so no write can slip in before it is dropped.
            // SAFETY: as below.
            unsafe { rustix::mm::madvise(addr, PAGE_SIZE, rustix::mm::Advice::LinuxDontNeed) }
                .map_err(|e| {
                    self.resident.push_front(page);
                    format!("dropping page {page}: {e}")
                })?;
            self.is_resident[page] = false;
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
            self.counters.evicted_clean.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        // A write after this blocks in a write-protect fault until the page is gone.
        self.uffd.write_protect(addr, PAGE_SIZE).map_err(|e| {
            self.resident.push_front(page);
            format!("write-protecting page {page}: {e}")
        })?;
        // SAFETY: the page is mapped (resident) and write-protected: no thread changes it
        // while it is copied.
        unsafe {
            std::ptr::copy_nonoverlapping(addr.cast::<u8>(), self.buf.as_mut_ptr(), PAGE_SIZE)
        };
        let stored = {
            let mut pager = self.pager.lock().unwrap_or_else(|p| p.into_inner());
            if self.buf.iter().all(|&b| b == 0) {
                self.counters.evicted_zero.fetch_add(1, Ordering::Relaxed);
                pager.discard(page as u64)
            } else {
                pager.write(page as u64, &self.buf)
            }
        };
        let dropped = stored
            .map_err(|e| format!("storing page {page}: {e}"))
            .and_then(|()| {
                // SAFETY: `addr` is a page of our mapping; dropping it is what eviction means,
                // and the next access faults it back in through this handler.
                unsafe { rustix::mm::madvise(addr, PAGE_SIZE, rustix::mm::Advice::LinuxDontNeed) }
                    .map_err(|e| format!("dropping page {page}: {e}"))
            });
        if let Err(e) = dropped {
            // Keep the page: writable again, and the writers blocked on it woken.
            let _ = self.uffd.remove_write_protection(addr, PAGE_SIZE, true);
            self.resident.push_front(page);
            return Err(e);
        }
        self.is_resident[page] = false;
        self.dirty[page] = false;
        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
