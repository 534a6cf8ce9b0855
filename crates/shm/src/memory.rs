//! One machine's copy of a segment, and the processes' views of it (MIRAGE+ §3: one physical
//! copy per machine, however many local processes attach).
//!
//! The copy is a memfd: every local process maps it shared, so a store by one is a load of
//! the others at once, with no protocol between them. What the protocol changes — which pages
//! this machine may read or write — is enforced in every process's page tables through the
//! userfaultfd each process registered its mapping with (and handed to the agent):
//!
//! - no copy here: the page is a hole in the memfd, and every mapping's page-table entry for
//!   it is write-protected ("a marker" when nothing is mapped); a load or store finds the page
//!   missing and faults to the agent;
//! - a read copy: the page is in the memfd, write-protected in every mapping; a store faults;
//! - the write copy: the page is in the memfd, writable in every mapping.
//!
//! The order of steps is what keeps this exact: a page being taken away is write-protected in
//! every mapping *before* its contents are read to be sent (no store slips in after the copy
//! was taken) and punched out *after*; a page arriving is written into the memfd before any
//! mapping may see it, and made writable only once its write copy is installed. Found on
//! Linux 6.18 and relied on: write-protection markers of a shmem mapping survive a hole
//! punched under them, so a read copy taken away and brought back is write-protected again
//! without a call per mapping (were it not, a store to it would go unseen, which
//! `tests/sites.rs`'s counting test catches).

use netram_dsm::PageNo;
use netram_proto::PAGE_SIZE;
use netram_uffd::sys::Uffd;
use rustix::fd::{AsFd, OwnedFd};
use rustix::io::Errno;
use std::ffi::c_void;

const PAGE: u64 = PAGE_SIZE as u64;

/// The userfaultfd features a segment's mappings need: write-protection of shared memory, and
/// poisoned pages (a page lost with a crashed machine: its accesses get SIGBUS).
pub const FEATURES: u64 = (linux_raw_sys::general::UFFD_FEATURE_WP_HUGETLBFS_SHMEM
    | linux_raw_sys::general::UFFD_FEATURE_POISON) as u64;

/// A segment's pages on this machine: a memfd of `pages` pages.
#[derive(Debug)]
pub struct Copy {
    fd: OwnedFd,
    pages: u32,
}

impl Copy {
    /// A new copy, every page a hole (reads as zero).
    pub fn new(name: &str, pages: u32) -> Result<Copy, Errno> {
        let fd = rustix::fs::memfd_create(
            format!("netram-shm:{name}"),
            rustix::fs::MemfdFlags::CLOEXEC,
        )?;
        rustix::fs::ftruncate(&fd, u64::from(pages) * PAGE)?;
        Ok(Copy { fd, pages })
    }

    pub fn pages(&self) -> u32 {
        self.pages
    }

    pub fn len(&self) -> usize {
        self.pages as usize * PAGE_SIZE
    }

    pub fn is_empty(&self) -> bool {
        self.pages == 0
    }

    /// The memfd, for a local process to map.
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Reads page `n` (a hole reads as zeros).
    pub fn read(&self, n: PageNo, out: &mut [u8]) -> Result<(), Errno> {
        assert_eq!(out.len(), PAGE_SIZE);
        let mut at = 0;
        while at < PAGE_SIZE {
            let got = rustix::io::pread(&self.fd, &mut out[at..], u64::from(n) * PAGE + at as u64)?;
            if got == 0 {
                return Err(Errno::IO);
            }
            at += got;
        }
        Ok(())
    }

    /// Writes page `n` (allocating it).
    pub fn write(&self, n: PageNo, data: &[u8]) -> Result<(), Errno> {
        assert_eq!(data.len(), PAGE_SIZE);
        let mut at = 0;
        while at < PAGE_SIZE {
            at += rustix::io::pwrite(&self.fd, &data[at..], u64::from(n) * PAGE + at as u64)?;
        }
        Ok(())
    }

    /// Allocates page `n` if it is a hole (a zero page); keeps its contents if not.
    pub fn allocate(&self, n: PageNo) -> Result<(), Errno> {
        rustix::fs::fallocate(
            &self.fd,
            rustix::fs::FallocateFlags::empty(),
            u64::from(n) * PAGE,
            PAGE,
        )
    }

    /// Punches page `n` out: every mapping loses it, and the next access faults.
    pub fn punch(&self, n: PageNo) -> Result<(), Errno> {
        rustix::fs::fallocate(
            &self.fd,
            rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
            u64::from(n) * PAGE,
            PAGE,
        )
    }
}

/// One process's mapping of a segment, registered with the process's userfaultfd (missing
/// and write-protect faults), which the process handed to the agent.
#[derive(Debug)]
pub struct View {
    pub uffd: Uffd,
    /// Where the mapping starts in that process.
    pub base: usize,
    pub pages: u32,
    /// The process, for reports.
    pub pid: u32,
    /// Its number at the agent (set there).
    pub number: u64,
}

impl View {
    fn addr(&self, n: PageNo) -> *mut c_void {
        (self.base + n as usize * PAGE_SIZE) as *mut c_void
    }

    /// The page a fault at `addr` is on, if it is in this view.
    pub fn page_of(&self, addr: usize) -> Option<PageNo> {
        let off = addr.checked_sub(self.base)?;
        let n = off / PAGE_SIZE;
        (n < self.pages as usize).then_some(n as PageNo)
    }

    /// Write-protects page `n` (stores fault from now on, mapped or not).
    pub fn protect(&self, n: PageNo) -> Result<(), Errno> {
        self.uffd.set_write_protect(self.addr(n), true, false)
    }

    /// Write-protects the whole view.
    pub fn protect_all(&self) -> Result<(), Errno> {
        self.uffd
            .set_write_protect_range(self.addr(0), self.pages as usize, true, false)
    }

    /// Lets stores to page `n` through and wakes the writers waiting on it.
    pub fn unprotect(&self, n: PageNo) -> Result<(), Errno> {
        self.uffd.set_write_protect(self.addr(n), false, true)
    }

    /// Marks page `n` lost: its accesses get SIGBUS (a page already mapped here stays; a lost
    /// page is a hole, so it is not).
    pub fn poison(&self, n: PageNo) -> Result<(), Errno> {
        // The write-protect marker first: UFFDIO_POISON fills only an empty entry, and a
        // marker is not one (poisoning over it failed with EEXIST and the access faulted for
        // ever). Not woken: the poison wakes the threads.
        self.uffd.set_write_protect(self.addr(n), false, false)?;
        match self.uffd.poison(self.addr(n)) {
            Err(Errno::EXIST) => Ok(()),
            r => r,
        }
    }

    /// Wakes the threads waiting on page `n` (they retry their access).
    pub fn wake(&self, n: PageNo) -> Result<(), Errno> {
        self.uffd.wake(self.addr(n), PAGE_SIZE)
    }

    /// Wakes every thread waiting on the view (they retry their accesses).
    pub fn wake_all(&self) -> Result<(), Errno> {
        self.uffd
            .wake(self.addr(0), self.pages as usize * PAGE_SIZE)
    }
}

/// A local mapping of a segment made by this process: the memfd mapped shared, registered
/// with a new userfaultfd, and wholly write-protected until the agent says which pages this
/// machine may write. Hand [`Mapped::take_uffd`] to the agent; unmap with
/// [`Mapped::unmap`].
#[derive(Debug)]
pub struct Mapped {
    pub ptr: *mut u8,
    pub len: usize,
    uffd: Option<Uffd>,
}

// SAFETY: the mapping is plain shared memory, reached only through the raw pointer; moving
// the handle between threads moves no access.
unsafe impl Send for Mapped {}
// SAFETY: as for Send: the handle gives out only the raw pointer; what is done through it is
// the caller's (shared memory, like any other shared mapping).
unsafe impl Sync for Mapped {}

impl Mapped {
    /// Maps `fd` (a segment's memfd, `pages` pages) and registers it.
    pub fn new(fd: impl AsFd, pages: u32) -> Result<Mapped, Errno> {
        Self::new_at(fd, pages, None, false)
    }

    /// [`Mapped::new`] at `addr` if given: only where nothing is mapped (EEXIST otherwise),
    /// or replacing what is if `replace` (System V's `shmat` with an address, and with
    /// `SHM_REMAP`).
    pub fn new_at(
        fd: impl AsFd,
        pages: u32,
        addr: Option<*mut u8>,
        replace: bool,
    ) -> Result<Mapped, Errno> {
        use rustix::mm::{mmap, MapFlags, ProtFlags};
        let len = pages as usize * PAGE_SIZE;
        let (at, flags) = match addr {
            Some(a) if replace => (a.cast(), MapFlags::SHARED | MapFlags::FIXED),
            Some(a) => (a.cast(), MapFlags::SHARED | MapFlags::FIXED_NOREPLACE),
            None => (std::ptr::null_mut(), MapFlags::SHARED),
        };
        // SAFETY: a new shared mapping of the memfd, where the kernel picks or where the
        // caller asked (its own address space, as `shmat(2)` lets it).
        let ptr = unsafe { mmap(at, len, ProtFlags::READ | ProtFlags::WRITE, flags, fd, 0) }?;
        // Owned from here, so that a failure below unmaps it.
        let mut mapped = Mapped {
            ptr: ptr.cast(),
            len,
            uffd: None,
        };
        let uffd = open_uffd()?;
        uffd.register(ptr, len, true)?;
        uffd.set_write_protect_range(ptr, pages as usize, true, false)?;
        mapped.uffd = Some(uffd);
        Ok(mapped)
    }

    /// Registers the mapping with a new userfaultfd (a forked child's: the parent's
    /// registration is not inherited), wholly write-protected.
    pub fn register_again(&mut self) -> Result<(), Errno> {
        let uffd = open_uffd()?;
        let pages = self.len / PAGE_SIZE;
        uffd.register(self.ptr.cast(), self.len, true)?;
        uffd.set_write_protect_range(self.ptr.cast(), pages, true, false)?;
        self.uffd = Some(uffd);
        Ok(())
    }

    /// The userfaultfd serving this mapping (once).
    pub fn take_uffd(&mut self) -> Option<Uffd> {
        self.uffd.take()
    }

    /// Unmaps it.
    pub fn unmap(self) {
        drop(self)
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the range is the one mapped in `new`; no reference into it outlives the
        // handle (callers use the raw pointer).
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

/// A userfaultfd for a segment's mapping: one that serves faults raised inside system calls
/// too if this process may have one (root, or `/dev/userfaultfd`), else user-mode faults only
/// (a `read(2)` into a page not here then fails with EFAULT: said in docs/limits.md).
fn open_uffd() -> Result<Uffd, Errno> {
    Uffd::open(FEATURES, false)
        .or_else(|_| Uffd::open_device(FEATURES))
        .or_else(|_| Uffd::open(FEATURES, true))
}
