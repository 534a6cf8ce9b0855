//! A foreign allocator (jemalloc, tcmalloc, mimalloc) a program brings along: found after
//! this library, and then given every call of the `malloc` family.

use super::*;

/// The allocator of a program that brings its own (jemalloc, tcmalloc or mimalloc as a shared
/// library after this one: `LD_PRELOAD` puts this library first, so its `malloc` is the one
/// everybody calls). Mixing the two would hand one allocator's pointers to the other — the
/// program calls `sdallocx`, `mallocx` or `tc_free` on what came from here, or frees here what
/// its allocator's own entry points returned — so with a foreign allocator present every call
/// of the `malloc` family is passed through to it, and its memory reaches the region through
/// `mmap`, which such allocators call for all of their memory.
pub(crate) type MallocFn = unsafe extern "C" fn(usize) -> *mut c_void;
pub(crate) type FreeFn = unsafe extern "C" fn(*mut c_void);
pub(crate) type CallocFn = unsafe extern "C" fn(usize, usize) -> *mut c_void;
pub(crate) type ReallocFn = unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void;
pub(crate) type PosixMemalignFn = unsafe extern "C" fn(*mut *mut c_void, usize, usize) -> c_int;
pub(crate) type AlignedFn = unsafe extern "C" fn(usize, usize) -> *mut c_void;
pub(crate) type UsableSizeFn = unsafe extern "C" fn(*mut c_void) -> usize;

pub(crate) struct Foreign {
    pub(crate) malloc: MallocFn,
    pub(crate) free: FreeFn,
    pub(crate) calloc: CallocFn,
    pub(crate) realloc: ReallocFn,
    pub(crate) posix_memalign: PosixMemalignFn,
    /// Optional in the allocator: built from `posix_memalign` when it lacks them.
    pub(crate) aligned_alloc: Option<AlignedFn>,
    pub(crate) memalign: Option<AlignedFn>,
    pub(crate) valloc: Option<MallocFn>,
    pub(crate) pvalloc: Option<MallocFn>,
    pub(crate) malloc_usable_size: Option<UsableSizeFn>,
}

/// The foreign allocator, if there is one and this thread may use it: looked up at the first
/// call of the `malloc` family. netram's own threads (and a thread inside netram) use talc
/// instead (see [`internal`]): the foreign allocator keeps its own bookkeeping in memory it
/// maps, which is on the region, and the fault handler touching it would wait for itself.
pub(crate) fn foreign() -> Option<&'static Foreign> {
    static FOREIGN: OnceLock<Option<Foreign>> = OnceLock::new();
    if let Some(f) = FOREIGN.get() {
        return f.as_ref().filter(|_| !netram_uffd::alloc::is_inside());
    }
    // dlsym may allocate (through this library's malloc): inside `enter`, those calls go to
    // talc and do not come back here. None if this thread is already inside.
    enter(|| FOREIGN.get_or_init(find_foreign).as_ref()).flatten()
}

pub(crate) fn find_foreign() -> Option<Foreign> {
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
    pub(crate) fn aligned(&self, align: usize, size: usize) -> *mut c_void {
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
