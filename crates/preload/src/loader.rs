//! Keeping the region's fault handler away from the region it serves (Anemone §2.1's
//! transparency has one condition here: the thread that serves a fault must never fault on
//! the region itself, or it waits for itself, and with it every thread of the program).
//!
//! netram's threads allocate from memory of their own (`internal`), but two things they use
//! belong to the dynamic loader, which is the program's:
//!
//! - **Symbol lookups.** An interposed function reaches the C library's definition through
//!   `dlsym(RTLD_NEXT, …)`, which walks the loader's list of loaded objects. Done lazily, the
//!   first call on the handler thread (its first `send`, say) walked a list whose later
//!   entries the loader had allocated on the region — and which had been evicted: a JVM hung
//!   for good that way, every thread in `handle_userfault`. So every such function is looked
//!   up once, at load, before the region exists ([`resolve_all`], from `on_load`); a [`Next`]
//!   used before that (another library's constructor calling `read`) looks itself up then.
//!   The library is linked with `-z now` (Rust's default: full RELRO), so its own calls into
//!   the C library are bound at load too.
//! - **The loader's own memory.** Libraries loaded after start (`dlopen`: a JVM's `libjvm`,
//!   Python's extensions, plugins), their thread-local storage and every thread's table of
//!   it are allocated by the loader through the program's `malloc` — this library's. The
//!   loader's later work (a lookup, a thread-local access after a `dlopen`, unwinding) reads
//!   them, on any thread, the handler's included. So blocks the loader asks for are kept in
//!   this library's own memory, off the region: the entry points `malloc`, `calloc` and
//!   `realloc` are a two-instruction trampoline that passes on their return address
//!   ([`entry!`]), and a caller inside the loader's code ([`from_loader`]) is served by
//!   `internal` (freed there too, since `free` knows those blocks by their address). The
//!   loader's blocks are few and small (its lists, names, thread-local tables).
//!
//! Not covered: memory the C library allocates for the program and later reads on a netram
//! thread — a locale's data (read by `strerror` when formatting an error in a translated
//! locale), name-service state. netram's threads use neither on their paths that serve
//! faults.

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

/// A function of the C library (or whatever follows this library) that this library
/// interposes, looked up once.
pub(crate) struct Next {
    name: &'static CStr,
    f: AtomicPtr<c_void>,
}

impl Next {
    pub(crate) const fn new(name: &'static CStr) -> Self {
        Self {
            name,
            f: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// The definition's address, or null if no library after this one defines it.
    pub(crate) fn addr(&self) -> *mut c_void {
        let f = self.f.load(Ordering::Acquire);
        if !f.is_null() {
            return f;
        }
        // SAFETY: a lookup of a symbol in the objects loaded after this library.
        let f = unsafe { libc::dlsym(libc::RTLD_NEXT, self.name.as_ptr()) };
        self.f.store(f, Ordering::Release);
        f
    }

    /// The definition as a function of type `F`.
    ///
    /// # Safety
    /// `F` is an `extern "C" fn` type with the definition's signature.
    pub(crate) unsafe fn get<F: Copy>(&self) -> Option<F> {
        const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>()) };
        let f = self.addr();
        // SAFETY: a function pointer of the caller's type, which has the pointer's size.
        (!f.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, F>(&f) })
    }
}

/// Every function this library finds with [`Next`]: resolved at load by [`resolve_all`].
static ALL: &[&Next] = &[
    &crate::io::READ,
    &crate::io::WRITE,
    &crate::io::PREAD64,
    &crate::io::PWRITE64,
    &crate::io::READV,
    &crate::io::WRITEV,
    &crate::io::RECV,
    &crate::io::RECVFROM,
    &crate::io::SEND,
    &crate::io::SENDTO,
    &crate::io::FREAD,
    &crate::io::FREAD_UNLOCKED,
    &crate::io::FWRITE,
    &crate::io::FWRITE_UNLOCKED,
    &crate::FORK,
    &crate::PTHREAD_CREATE,
];

/// Looks every interposed function up, and finds the loader's code: called at load, before
/// the region exists.
pub(crate) fn resolve_all() {
    for n in ALL {
        n.addr();
    }
    find_loader();
}

/// The dynamic loader's executable segment: [start, end), or empty until found.
static LOADER_START: AtomicUsize = AtomicUsize::new(0);
static LOADER_END: AtomicUsize = AtomicUsize::new(0);

/// Whether `caller` (a return address) is in the dynamic loader's code.
#[inline]
pub(crate) fn from_loader(caller: usize) -> bool {
    caller >= LOADER_START.load(Ordering::Relaxed) && caller < LOADER_END.load(Ordering::Relaxed)
}

/// Finds the loader (the program's interpreter, at the kernel's `AT_BASE`) among the loaded
/// objects and records its executable segment. A program started as `ld.so PROGRAM` has no
/// `AT_BASE`: then nothing is recorded and the loader's blocks are served like the program's.
fn find_loader() {
    // SAFETY: reads the auxiliary vector the kernel gave the process.
    let base = unsafe { libc::getauxval(libc::AT_BASE) } as usize;
    if base == 0 {
        return;
    }
    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> libc::c_int {
        // SAFETY: the loader passes a valid description of one object; `data` is the base
        // address below.
        let (info, base) = unsafe { (&*info, *data.cast::<usize>()) };
        if info.dlpi_addr as usize != base || info.dlpi_phdr.is_null() {
            return 0;
        }
        // SAFETY: `dlpi_phnum` program headers at `dlpi_phdr`, as the loader describes them.
        let headers =
            unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
        let (mut lo, mut hi) = (usize::MAX, 0);
        for h in headers {
            if h.p_type == libc::PT_LOAD && h.p_flags & libc::PF_X != 0 {
                let start = base + h.p_vaddr as usize;
                lo = lo.min(start);
                hi = hi.max(start + h.p_memsz as usize);
            }
        }
        if lo < hi {
            LOADER_START.store(lo, Ordering::Relaxed);
            LOADER_END.store(hi, Ordering::Relaxed);
        }
        1
    }
    let mut base = base;
    // SAFETY: the callback reads only what it is given; `base` outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), (&mut base as *mut usize).cast()) };
}

/// Defines the C entry point `$name` as a trampoline to `$imp`, which takes the same
/// arguments followed by the caller's return address (in the next argument register): the
/// stack and the other registers are left as the caller set them, so `$imp` returns to the
/// caller directly. Elsewhere than x86-64 and AArch64, `$imp` is given 0 (nothing is from
/// the loader).
macro_rules! entry {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty => $imp:path, $reg_x86:literal, $reg_arm:literal) => {
        $(#[$doc])*
        /// # Safety
        /// The C library's contract for this function.
        #[cfg(target_arch = "x86_64")]
        #[unsafe(naked)]
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            std::arch::naked_asm!(concat!("mov ", $reg_x86, ", [rsp]"), "jmp {imp}", imp = sym $imp)
        }
        $(#[$doc])*
        /// # Safety
        /// The C library's contract for this function.
        #[cfg(target_arch = "aarch64")]
        #[unsafe(naked)]
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            std::arch::naked_asm!(concat!("mov ", $reg_arm, ", x30"), "b {imp}", imp = sym $imp)
        }
        $(#[$doc])*
        /// # Safety
        /// The C library's contract for this function.
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            // SAFETY: forwarded.
            unsafe { $imp($($arg,)* 0) }
        }
    };
}
pub(crate) use entry;
