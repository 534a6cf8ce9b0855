//! The `mmap` family: private anonymous read-write mappings at or above the threshold on the
//! region; reservations and the fixed mappings that commit inside them (a JVM's heap);
//! `munmap`, `mremap`, `madvise` giving such memory back; `mprotect` reported to the region.

use super::*;

/// Whether an `mmap` call reserves address space for anonymous memory to be committed later
/// (`PROT_NONE`, then `MAP_FIXED` read-write mappings inside it): how a JVM takes its heap. A
/// hint (`addr` without `MAP_FIXED`) is not kept, as the kernel need not keep it: a JVM that
/// wanted its heap at a low address for compressed pointers tries others, then takes any.
pub(crate) fn is_anonymous_reservation(_addr: *mut c_void, prot: c_int, flags: c_int) -> bool {
    is_private_anonymous(flags) && prot == libc::PROT_NONE
}

/// A reservation on the region: pages of the heap, none of them resident, `PROT_NONE` until
/// committed ([`commit_in_region`]); null if the region has no room (then the kernel's).
pub(crate) fn reserve(h: &Heap, len: usize) -> *mut c_void {
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
pub(crate) fn fixed_anonymous_in_region(
    addr: *mut c_void,
    len: usize,
    flags: c_int,
) -> Option<&'static Heap> {
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
pub(crate) fn overlaps_region(addr: *mut c_void, len: usize) -> bool {
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
pub(crate) fn commit_in_region(
    h: &Heap,
    addr: *mut c_void,
    len: usize,
    prot: c_int,
) -> *mut c_void {
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
pub(crate) fn is_plain_anonymous(addr: *mut c_void, prot: c_int, flags: c_int) -> bool {
    addr.is_null() && is_private_anonymous(flags) && prot == libc::PROT_READ | libc::PROT_WRITE
}

/// Whether `mmap` flags ask for private anonymous memory wherever the kernel puts it, and
/// nothing the region cannot stand in for (a stack, huge pages).
pub(crate) fn is_private_anonymous(flags: c_int) -> bool {
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
pub(crate) fn release_within(h: &Heap, addr: *mut c_void, len: usize) -> c_int {
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
