//! The `malloc` family: blocks at or above the threshold on the region's heap, the rest (and
//! the loader's and netram's own) elsewhere, each freed where it came from.

use super::*;

loader::entry!(
    /// `malloc`, called from `caller`.
    fn malloc(size: usize) -> *mut c_void => malloc_from, "rsi", "x1"
);

/// Whether a block asked for from `caller` should come from this library's own memory: a
/// thread of netram's (or one inside the heap), or the dynamic loader (see [`loader`]; in a
/// forked child the loader is served as before the fork, from the allocator the child uses).
pub(crate) fn for_internal(caller: usize) -> bool {
    netram_uffd::alloc::is_inside()
        || (loader::from_loader(caller) && !IN_CHILD.load(Ordering::Relaxed))
}

pub(crate) extern "C" fn malloc_from(size: usize, caller: usize) -> *mut c_void {
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

pub(crate) extern "C" fn calloc_from(n: usize, size: usize, caller: usize) -> *mut c_void {
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
pub(crate) fn libc_usable_size(ptr: *mut c_void) -> usize {
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

pub(crate) extern "C" fn realloc_from(ptr: *mut c_void, size: usize, caller: usize) -> *mut c_void {
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
pub(crate) fn aligned(align: usize, size: usize) -> *mut c_void {
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
