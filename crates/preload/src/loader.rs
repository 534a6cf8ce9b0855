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
//! - **The loader's lock.** The loader holds its lock (`dl_load_lock`) while it runs a library's
//!   constructors, and constructors allocate: a program thread in `dlopen` faults on the region
//!   holding it. Anything the handler does that takes the same lock then waits for a thread
//!   that waits for the handler. Rust's thread-locals with a destructor register it, on first
//!   use, through the C library's `__cxa_thread_atexit_impl`, which takes that lock: a handler
//!   thread that had not yet run its first instruction when the program called `dlopen` (a
//!   busy machine) hung the program for good in CI. So this library defines
//!   `__cxa_thread_atexit_impl` ([`thread_atexit`]): on netram's threads it keeps the
//!   destructors itself, in thread-local storage that needs no allocation, and runs them when
//!   the thread ends (from a `pthread` key's destructor); every other thread's go to the C
//!   library as before. Symbol lookups (above) take the lock too; no netram thread makes one
//!   after load.
//!
//! Not covered: memory the C library allocates for the program and later reads on a netram
//! thread — a locale's data (read by `strerror` when formatting an error in a translated
//! locale), name-service state. netram's threads use neither on their paths that serve
//! faults. Nor the C library's resolver: a server named by a host name (not an address) is
//! resolved again when netram reconnects to it, and the resolver may load its modules, which
//! takes the loader's lock; give servers as addresses where programs load libraries while
//! they run.

use std::cell::Cell;
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
    &crate::start::EXIT,
    &crate::start::EXIT_UPPER,
    &crate::PTHREAD_CREATE,
    &THREAD_ATEXIT,
];

/// Looks every interposed function up, and finds the loader's code: called at load, before
/// the region exists.
pub(crate) fn resolve_all() {
    for n in ALL {
        n.addr();
    }
    find_loader();
    own_destructors_key();
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

/// The C library's `__cxa_thread_atexit_impl`.
static THREAD_ATEXIT: Next = Next::new(c"__cxa_thread_atexit_impl");

type Destructor = unsafe extern "C" fn(*mut c_void);

/// More than netram's threads register (Rust's runtime and `tracing`: a handful).
const OWN_DESTRUCTORS: usize = 64;

thread_local! {
    /// Set on netram's own threads from their first instruction ([`mark_own_thread`]).
    static OWN: Cell<bool> = const { Cell::new(false) };
    /// Their thread-locals' destructors, in registration order. Neither needs a destructor
    /// itself, so touching them registers nothing.
    static DESTRUCTORS: [Cell<(Option<Destructor>, usize)>; OWN_DESTRUCTORS] =
        const { [const { Cell::new((None, 0)) }; OWN_DESTRUCTORS] };
    static REGISTERED: Cell<usize> = const { Cell::new(0) };
}

/// The `pthread` key whose destructor runs a netram thread's thread-local destructors when
/// it ends; `usize::MAX` until created at load.
static KEY: AtomicUsize = AtomicUsize::new(usize::MAX);

fn own_destructors_key() {
    if KEY.load(Ordering::Acquire) != usize::MAX {
        return;
    }
    let mut key: libc::pthread_key_t = 0;
    // SAFETY: creates a key with a plain function as its destructor.
    if unsafe { libc::pthread_key_create(&mut key, Some(run_own_destructors)) } == 0 {
        KEY.store(key as usize, Ordering::Release);
    }
}

/// Marks the calling thread as netram's own: its thread-local destructors are kept here.
pub(crate) fn mark_own_thread() {
    let _ = OWN.try_with(|o| o.set(true));
}

/// The C library's entry point for registering a thread-local destructor (`__cxa_thread_atexit`
/// in C++, Rust's `thread_local!`): see the module's "loader's lock". On a netram thread the
/// destructor is kept here (the loader's lock is never taken); elsewhere the C library's is
/// called.
///
/// # Safety
/// The C library's contract for this function.
#[export_name = "__cxa_thread_atexit_impl"]
pub unsafe extern "C" fn thread_atexit(
    func: Destructor,
    obj: *mut c_void,
    dso: *mut c_void,
) -> libc::c_int {
    type Impl = unsafe extern "C" fn(Destructor, *mut c_void, *mut c_void) -> libc::c_int;
    let own = OWN.try_with(Cell::get).unwrap_or(false);
    if !own {
        // SAFETY: the symbol is __cxa_thread_atexit_impl, with this signature.
        if let Some(real) = unsafe { THREAD_ATEXIT.get::<Impl>() } {
            // SAFETY: passed through.
            return unsafe { real(func, obj, dso) };
        }
    }
    let key = KEY.load(Ordering::Acquire);
    let n = REGISTERED.try_with(Cell::get).unwrap_or(OWN_DESTRUCTORS);
    if key == usize::MAX || n >= OWN_DESTRUCTORS {
        // Not kept: the object leaks when the thread ends, which is what Rust's runtime
        // does with a failed registration too.
        return -1;
    }
    let _ = DESTRUCTORS.try_with(|d| d[n].set((Some(func), obj as usize)));
    let _ = REGISTERED.try_with(|r| r.set(n + 1));
    // A non-null value makes the C library call the key's destructor when the thread ends.
    // SAFETY: a key this library created; the value is never dereferenced.
    unsafe {
        libc::pthread_setspecific(key as libc::pthread_key_t, std::ptr::dangling::<c_void>())
    };
    0
}

/// Runs the ending thread's kept destructors, the last registered first (as the C library
/// does); those that register more (Rust's runtime does) are run too.
extern "C" fn run_own_destructors(_: *mut c_void) {
    loop {
        let n = REGISTERED.try_with(Cell::get).unwrap_or(0);
        if n == 0 {
            return;
        }
        let _ = REGISTERED.try_with(|r| r.set(n - 1));
        let Ok((Some(func), obj)) = DESTRUCTORS.try_with(|d| d[n - 1].take()) else {
            continue;
        };
        // SAFETY: a destructor registered for this thread with this object, run once.
        unsafe { func(obj as *mut c_void) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    static DROPPED: AtomicU32 = AtomicU32::new(0);

    struct Counted;
    impl Drop for Counted {
        fn drop(&mut self) {
            DROPPED.fetch_add(1, Ordering::SeqCst);
        }
    }

    thread_local! {
        static FIRST: Counted = const { Counted };
        static SECOND: Counted = const { Counted };
    }

    /// A netram thread's thread-local destructors are kept here and run when it ends; another
    /// thread's go to the C library and run too. (This test binary's own
    /// `__cxa_thread_atexit_impl` is this module's.)
    #[test]
    fn thread_local_destructors_run_on_every_thread() {
        own_destructors_key();
        let before = REGISTERED.with(Cell::get);
        std::thread::spawn(|| {
            mark_own_thread();
            FIRST.with(|_| ());
            SECOND.with(|_| ());
            assert!(REGISTERED.with(Cell::get) >= 2, "kept here");
        })
        .join()
        .unwrap();
        assert_eq!(DROPPED.swap(0, Ordering::SeqCst), 2);
        std::thread::spawn(|| {
            FIRST.with(|_| ());
            assert_eq!(REGISTERED.with(Cell::get), 0, "the C library's");
        })
        .join()
        .unwrap();
        assert_eq!(DROPPED.load(Ordering::SeqCst), 1);
        assert_eq!(REGISTERED.with(Cell::get), before);
    }
}
