//! System calls that copy to or from the program's memory, made safe for a region whose
//! userfaultfd serves user-mode faults only (an ordinary user's: `UFFD_USER_MODE_ONLY`).
//!
//! There, the kernel cannot wait for a page of the region that is not resident: a `read(2)`
//! into such a page, or a `write(2)` from one, fails with EFAULT, where a page swapped out by
//! the kernel would simply be read back in. GNU sort, for one, `fread`s its input straight
//! into its large buffer, which is on the region (Anemone §2.1's transparency, which root's
//! userfaultfd gives for free, has to be earned here).
//!
//! So the calls that programs move bulk data with are interposed: `read`, `pread64`, `readv`,
//! `recv`, `recvfrom`, `write`, `pwrite64`, `writev`, `send`, `sendto`, and stdio's `fread`,
//! `fwrite` and their `_unlocked` forms (glibc's stdio calls its own `read` internally, out
//! of reach of interposition: `fread` itself has to be). Where the buffer lies in the region,
//! its pages are touched first from user mode — a write for a destination, a read for a source:
//! the fault handler then brings them in — and the call is made in chunks no larger than a
//! quarter of the local budget, so that the touched pages are still resident when the kernel
//! copies (victims go oldest first; a chunk's pages are the newest). Should one have gone all
//! the same (another thread faulting heavily), the call fails with EFAULT having moved no data
//! (a pipe, a socket and a file alike copy what they can and report EFAULT only when nothing
//! was moved) and is touched and made again; `fread` takes the stream's error back and reads
//! the rest. (`fwrite` is not made again: what stdio has buffered by then is its own.)
//!
//! Chunking keeps each call's meaning: a file is read or written chunk after chunk until one
//! comes up short; from a pipe, a socket or a terminal only one chunk is read (a short read is
//! always allowed there, and a second read could block where the program's one would not);
//! writes continue until all is written or a chunk is short, as a blocking write would.
//!
//! Everything else goes straight to the C library: root's regions (whose userfaultfd serves
//! the kernel's faults), buffers outside the region, netram's own threads, a forked child
//! that has no region. Not covered: other calls that copy user memory (`recvmsg`/`sendmsg`,
//! `getrandom`, `preadv2`, ioctls...) — which is why an ordinary user's region takes only
//! blocks of 128K and more (see `start`), where programs keep bulk data.

use super::{c_int, c_void, Ordering, HEAP, IN_CHILD, REGION_END, REGION_START};
use crate::loader::Next;
use netram_proto::PAGE_SIZE;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};

/// Set once the region is up, if its userfaultfd serves user-mode faults only.
pub(crate) static GUARDED: AtomicBool = AtomicBool::new(false);
/// The most bytes touched and copied at once: a quarter of the local budget.
pub(crate) static CHUNK: AtomicUsize = AtomicUsize::new(256 << 10);
/// How often a call that failed with EFAULT is touched and made again.
const RETRIES: u32 = 8;
/// Calls guarded, and how often one had to be made again (both in `netram run`'s report).
pub(crate) static GUARDED_CALLS: AtomicU64 = AtomicU64::new(0);
pub(crate) static REFAULTS: AtomicU64 = AtomicU64::new(0);

/// Arms the guard for a region that does not serve the kernel's faults, budget `budget` bytes.
pub(crate) fn arm(budget: usize) {
    let chunk = (budget / 4).clamp(PAGE_SIZE, 1 << 20) / PAGE_SIZE * PAGE_SIZE;
    CHUNK.store(chunk, Ordering::Relaxed);
    GUARDED.store(true, Ordering::Release);
}

/// Whether `len` bytes at `p` touch the region, and this thread must guard its call.
fn guarded(p: *const c_void, len: usize) -> bool {
    if len == 0 || !GUARDED.load(Ordering::Acquire) || IN_CHILD.load(Ordering::Relaxed) {
        return false;
    }
    let (start, end) = (
        REGION_START.load(Ordering::Relaxed),
        REGION_END.load(Ordering::Relaxed),
    );
    let a = p as usize;
    let ours = a < end && a.saturating_add(len) > start && !netram_uffd::alloc::is_inside();
    if ours {
        GUARDED_CALLS.fetch_add(1, Ordering::Relaxed);
    }
    ours
}

/// Brings the pages of `len` bytes at `p` in, from user mode: one byte of each page, written
/// (`for_write`: the kernel will write there, so the page must be writable, not the zero page
/// or a write-protected fetch) or read.
fn touch(p: *const c_void, len: usize, for_write: bool) {
    if len == 0 || HEAP.get().is_none() {
        return;
    }
    let (start, end) = (
        REGION_START.load(Ordering::Relaxed),
        REGION_END.load(Ordering::Relaxed),
    );
    let (a, b) = (p as usize, p as usize + len);
    // Only the region's pages: elsewhere the kernel faults as usual.
    let mut at = a.max(start);
    let stop = b.min(end);
    while at < stop {
        if for_write {
            // SAFETY: a byte of the caller's buffer, which the call is about to overwrite:
            // written back as it was. (Not an atomic OR of zero, which the compiler removes
            // as a no-op; another thread writing the buffer meanwhile would race with the
            // call itself.)
            unsafe {
                let p = at as *mut u8;
                std::ptr::write_volatile(p, std::ptr::read_volatile(p));
            }
        } else {
            // SAFETY: a byte of the caller's buffer, which the call is about to read.
            unsafe { std::ptr::read_volatile(at as *const u8) };
        }
        at = (at / PAGE_SIZE + 1) * PAGE_SIZE;
    }
}

fn errno() -> c_int {
    // SAFETY: this thread's errno.
    unsafe { *libc::__errno_location() }
}

/// What a descriptor reads from, which decides how a read may be cut into chunks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A regular file or a block device: read on after a full chunk, as one call would.
    File,
    /// A pipe, a terminal, a stream socket: one chunk only (a short read is always allowed,
    /// and a second read could block where the program's one would not).
    Stream,
    /// A datagram socket: never cut (a datagram longer than the buffer given is truncated);
    /// the whole buffer is touched and read in one call.
    Datagram,
}

fn kind(fd: c_int) -> Kind {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes the struct it is given.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return Kind::Stream;
    }
    // SAFETY: written by a successful fstat.
    match unsafe { st.assume_init() }.st_mode & libc::S_IFMT {
        libc::S_IFREG | libc::S_IFBLK => Kind::File,
        libc::S_IFSOCK => {
            let mut ty: c_int = 0;
            let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
            // SAFETY: getsockopt writes an int into `ty`, its size in `len`.
            let r = unsafe {
                libc::getsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_TYPE,
                    (&mut ty as *mut c_int).cast(),
                    &mut len,
                )
            };
            if r == 0 && ty == libc::SOCK_STREAM {
                Kind::Stream
            } else {
                Kind::Datagram
            }
        }
        _ => Kind::Stream,
    }
}

/// `call` over `len` bytes at `p` in guarded chunks (see the module's text): `call(at, n,
/// done)` moves up to `n` bytes at `at` (`done` bytes in) and returns how many, or -1 with
/// errno. `reading`: into the buffer. Longer than a chunk, the call goes as the descriptor's
/// kind (asked only then) allows: a read from a file and any write to a file or a stream go
/// on until done or short; a read from a stream stops after one chunk; a datagram is one
/// call over the whole buffer.
fn chunked(
    p: *mut c_void,
    len: usize,
    reading: bool,
    fd_kind: impl FnOnce() -> Kind,
    mut call: impl FnMut(*mut c_void, usize, usize) -> isize,
) -> isize {
    let mut chunk = CHUNK.load(Ordering::Relaxed);
    let kind = if len <= chunk { Kind::File } else { fd_kind() };
    if kind == Kind::Datagram {
        chunk = len;
    }
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(chunk);
        let at = p.wrapping_byte_add(done);
        let mut tries = 0;
        let r = loop {
            touch(at, n, reading);
            let r = call(at, n, done);
            if r >= 0 || errno() != libc::EFAULT || tries == RETRIES {
                break r;
            }
            REFAULTS.fetch_add(1, Ordering::Relaxed);
            tries += 1;
        };
        if r < 0 {
            // Already moved data counts: the error shows at the next call, as with a short
            // transfer of the C library's own.
            return if done > 0 { done as isize } else { -1 };
        }
        done += r as usize;
        if (r as usize) < n || (reading && kind == Kind::Stream) {
            break;
        }
    }
    done as isize
}

/// The C library's definitions of the interposed functions: looked up at load (see
/// [`crate::loader`]), before the region exists.
pub(crate) static READ: Next = Next::new(c"read");
pub(crate) static WRITE: Next = Next::new(c"write");
pub(crate) static PREAD64: Next = Next::new(c"pread64");
pub(crate) static PWRITE64: Next = Next::new(c"pwrite64");
pub(crate) static READV: Next = Next::new(c"readv");
pub(crate) static WRITEV: Next = Next::new(c"writev");
pub(crate) static RECV: Next = Next::new(c"recv");
pub(crate) static RECVFROM: Next = Next::new(c"recvfrom");
pub(crate) static SEND: Next = Next::new(c"send");
pub(crate) static SENDTO: Next = Next::new(c"sendto");
pub(crate) static FREAD: Next = Next::new(c"fread");
pub(crate) static FREAD_UNLOCKED: Next = Next::new(c"fread_unlocked");
pub(crate) static FWRITE: Next = Next::new(c"fwrite");
pub(crate) static FWRITE_UNLOCKED: Next = Next::new(c"fwrite_unlocked");

/// The C library's definition of an interposed function.
macro_rules! next {
    ($next:ident: $ty:ty) => {
        // SAFETY: the symbol is the C library's function of that name, with this signature.
        unsafe { $next.get::<$ty>() }
            .expect("netram: an interposed function is not in the C library")
    };
}

type ReadFn = unsafe extern "C" fn(c_int, *mut c_void, usize) -> isize;
type WriteFn = unsafe extern "C" fn(c_int, *const c_void, usize) -> isize;
type PreadFn = unsafe extern "C" fn(c_int, *mut c_void, usize, libc::off64_t) -> isize;
type PwriteFn = unsafe extern "C" fn(c_int, *const c_void, usize, libc::off64_t) -> isize;
type RecvFn = unsafe extern "C" fn(c_int, *mut c_void, usize, c_int) -> isize;
type SendFn = unsafe extern "C" fn(c_int, *const c_void, usize, c_int) -> isize;
type RecvfromFn = unsafe extern "C" fn(
    c_int,
    *mut c_void,
    usize,
    c_int,
    *mut libc::sockaddr,
    *mut libc::socklen_t,
) -> isize;
type SendtoFn = unsafe extern "C" fn(
    c_int,
    *const c_void,
    usize,
    c_int,
    *const libc::sockaddr,
    libc::socklen_t,
) -> isize;
type IovFn = unsafe extern "C" fn(c_int, *const libc::iovec, c_int) -> isize;
type FreadFn = unsafe extern "C" fn(*mut c_void, usize, usize, *mut libc::FILE) -> usize;
type FwriteFn = unsafe extern "C" fn(*const c_void, usize, usize, *mut libc::FILE) -> usize;

/// # Safety
/// The C library's contract for `read`.
#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: usize) -> isize {
    let real = next!(READ: ReadFn);
    if !guarded(buf, n) {
        // SAFETY: passed through.
        return unsafe { real(fd, buf, n) };
    }
    // SAFETY: each call reads into a part of the caller's buffer.
    chunked(
        buf,
        n,
        true,
        || kind(fd),
        |at, len, _| unsafe { real(fd, at, len) },
    )
}

/// # Safety
/// The C library's contract for `pread64`.
#[no_mangle]
pub unsafe extern "C" fn pread64(
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    off: libc::off64_t,
) -> isize {
    let real = next!(PREAD64: PreadFn);
    if !guarded(buf, n) {
        // SAFETY: passed through.
        return unsafe { real(fd, buf, n, off) };
    }
    // SAFETY: each call reads into a part of the caller's buffer, at the matching offset.
    chunked(
        buf,
        n,
        true,
        || kind(fd),
        |at, len, done| unsafe { real(fd, at, len, off + done as libc::off64_t) },
    )
}

/// # Safety
/// The C library's contract for `pread` (the same as `pread64` on 64-bit Linux).
#[no_mangle]
pub unsafe extern "C" fn pread(fd: c_int, buf: *mut c_void, n: usize, off: libc::off_t) -> isize {
    // SAFETY: the same contract.
    unsafe { pread64(fd, buf, n, off) }
}

/// # Safety
/// The C library's contract for `recv`.
#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: usize, flags: c_int) -> isize {
    let real = next!(RECV: RecvFn);
    if !guarded(buf, n) {
        // SAFETY: passed through.
        return unsafe { real(fd, buf, n, flags) };
    }
    // SAFETY: one call, into the first chunk of the caller's buffer (its whole buffer for a
    // datagram).
    chunked(
        buf,
        n,
        true,
        || kind(fd),
        |at, len, _| unsafe { real(fd, at, len, flags) },
    )
}

/// # Safety
/// The C library's contract for `recvfrom`.
#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: usize,
    flags: c_int,
    from: *mut libc::sockaddr,
    from_len: *mut libc::socklen_t,
) -> isize {
    let real = next!(RECVFROM: RecvfromFn);
    if !guarded(buf, n) {
        // SAFETY: passed through.
        return unsafe { real(fd, buf, n, flags, from, from_len) };
    }
    // SAFETY: one call, into the first chunk of the caller's buffer (its whole buffer for a
    // datagram).
    chunked(
        buf,
        n,
        true,
        || kind(fd),
        |at, len, _| unsafe { real(fd, at, len, flags, from, from_len) },
    )
}

/// # Safety
/// The C library's contract for `write`.
#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: usize) -> isize {
    let real = next!(WRITE: WriteFn);
    if !guarded(buf, n) {
        // SAFETY: passed through.
        return unsafe { real(fd, buf, n) };
    }
    // SAFETY: each call writes a part of the caller's buffer.
    chunked(
        buf.cast_mut(),
        n,
        false,
        || kind(fd),
        |at, len, _| unsafe { real(fd, at, len) },
    )
}

/// # Safety
/// The C library's contract for `pwrite64`.
#[no_mangle]
pub unsafe extern "C" fn pwrite64(
    fd: c_int,
    buf: *const c_void,
    n: usize,
    off: libc::off64_t,
) -> isize {
    let real = next!(PWRITE64: PwriteFn);
    if !guarded(buf, n) {
        // SAFETY: passed through.
        return unsafe { real(fd, buf, n, off) };
    }
    // SAFETY: each call writes a part of the caller's buffer, at the matching offset.
    chunked(
        buf.cast_mut(),
        n,
        false,
        || kind(fd),
        |at, len, done| unsafe { real(fd, at, len, off + done as libc::off64_t) },
    )
}

/// # Safety
/// The C library's contract for `pwrite` (the same as `pwrite64` on 64-bit Linux).
#[no_mangle]
pub unsafe extern "C" fn pwrite(
    fd: c_int,
    buf: *const c_void,
    n: usize,
    off: libc::off_t,
) -> isize {
    // SAFETY: the same contract.
    unsafe { pwrite64(fd, buf, n, off) }
}

/// # Safety
/// The C library's contract for `send`.
#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: usize, flags: c_int) -> isize {
    let real = next!(SEND: SendFn);
    if !guarded(buf, n) {
        // SAFETY: passed through.
        return unsafe { real(fd, buf, n, flags) };
    }
    // SAFETY: each call sends a part of the caller's buffer.
    chunked(
        buf.cast_mut(),
        n,
        false,
        || kind(fd),
        |at, len, _| unsafe { real(fd, at, len, flags) },
    )
}

/// # Safety
/// The C library's contract for `sendto`.
#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: usize,
    flags: c_int,
    to: *const libc::sockaddr,
    to_len: libc::socklen_t,
) -> isize {
    let real = next!(SENDTO: SendtoFn);
    if !guarded(buf, n) {
        // SAFETY: passed through.
        return unsafe { real(fd, buf, n, flags, to, to_len) };
    }
    // SAFETY: passed through, its pages brought in: a datagram leaves whole, in one call.
    chunked(
        buf.cast_mut(),
        n,
        false,
        || Kind::Datagram,
        |at, len, _| unsafe { real(fd, at, len, flags, to, to_len) },
    )
}

/// `readv` or `writev` over `iov`: passed through unless a buffer is in the region; then, up
/// to a chunk in all (or for a datagram), one call with every buffer touched; longer, buffer
/// by buffer through the guarded `read` or `write` (a file's reads, and writes, go on while
/// buffers fill; a stream's read stops after the first).
unsafe fn vectored(fd: c_int, iov: *const libc::iovec, count: c_int, reading: bool) -> isize {
    let real = if reading {
        next!(READV: IovFn)
    } else {
        next!(WRITEV: IovFn)
    };
    let bufs = match usize::try_from(count) {
        // SAFETY: the caller's array of `count` iovecs.
        Ok(n) if n > 0 && !iov.is_null() => unsafe { std::slice::from_raw_parts(iov, n) },
        // SAFETY: passed through (an empty or bad vector: the C library says so).
        _ => return unsafe { real(fd, iov, count) },
    };
    if !bufs.iter().any(|b| guarded(b.iov_base, b.iov_len)) {
        // SAFETY: passed through.
        return unsafe { real(fd, iov, count) };
    }
    let len = bufs.iter().fold(0usize, |t, b| t.saturating_add(b.iov_len));
    let kind = if len <= CHUNK.load(Ordering::Relaxed) {
        None
    } else {
        Some(kind(fd))
    };
    if matches!(kind, None | Some(Kind::Datagram)) {
        // One call, as the program made it: every buffer touched first.
        let mut tries = 0;
        loop {
            for b in bufs {
                touch(b.iov_base, b.iov_len, reading);
            }
            // SAFETY: passed through, its pages brought in.
            let r = unsafe { real(fd, iov, count) };
            if r >= 0 || errno() != libc::EFAULT || tries == RETRIES {
                return r;
            }
            REFAULTS.fetch_add(1, Ordering::Relaxed);
            tries += 1;
        }
    }
    let whole = !(reading && kind == Some(Kind::Stream));
    let mut total = 0isize;
    for b in bufs {
        if b.iov_len == 0 {
            continue;
        }
        // SAFETY: the caller's buffers, through the guarded calls.
        let r = unsafe {
            if reading {
                read(fd, b.iov_base, b.iov_len)
            } else {
                write(fd, b.iov_base, b.iov_len)
            }
        };
        if r < 0 {
            return if total > 0 { total } else { r };
        }
        total += r;
        if (r as usize) < b.iov_len || !whole {
            break;
        }
    }
    total
}

/// # Safety
/// The C library's contract for `readv`.
#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const libc::iovec, count: c_int) -> isize {
    // SAFETY: the same contract.
    unsafe { vectored(fd, iov, count, true) }
}

/// # Safety
/// The C library's contract for `writev`.
#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const libc::iovec, count: c_int) -> isize {
    // SAFETY: the same contract.
    unsafe { vectored(fd, iov, count, false) }
}

/// `fread` or `fread_unlocked` (`real`) in guarded chunks: stdio reads on until a chunk comes
/// up short (end of file or an error, which it records in the stream), as one call would.
fn fread_with(
    real: FreadFn,
    ptr: *mut c_void,
    size: usize,
    n: usize,
    fp: *mut libc::FILE,
) -> usize {
    let Some(len) = size.checked_mul(n).filter(|&l| guarded(ptr, l)) else {
        // SAFETY: passed through.
        return unsafe { real(ptr, size, n, fp) };
    };
    let chunk = CHUNK.load(Ordering::Relaxed);
    // SAFETY: the caller's stream.
    let had_error = unsafe { libc::ferror(fp) } != 0;
    let mut done = 0usize;
    let mut tries = 0;
    while done < len {
        let want = (len - done).min(chunk);
        let at = ptr.wrapping_byte_add(done);
        touch(at, want, true);
        // SAFETY: a part of the caller's buffer.
        let got = unsafe { real(at, 1, want, fp) };
        done += got;
        if got < want {
            // A page of the chunk went before the kernel wrote it (stdio reads on after a
            // short read, into pages touched a while ago): the read moved nothing there, so
            // the error is taken back and the rest read again, touched anew.
            let failed = errno() == libc::EFAULT
                // SAFETY: the caller's stream.
                && unsafe { libc::ferror(fp) } != 0;
            if !had_error && failed && tries < RETRIES {
                tries += 1;
                REFAULTS.fetch_add(1, Ordering::Relaxed);
                // SAFETY: the caller's stream.
                unsafe { libc::clearerr(fp) };
                continue;
            }
            break;
        }
    }
    done / size
}

/// `fwrite` or `fwrite_unlocked` in guarded chunks, on until one comes up short.
fn fwrite_with(
    real: FwriteFn,
    ptr: *const c_void,
    size: usize,
    n: usize,
    fp: *mut libc::FILE,
) -> usize {
    let Some(len) = size.checked_mul(n).filter(|&l| guarded(ptr, l)) else {
        // SAFETY: passed through.
        return unsafe { real(ptr, size, n, fp) };
    };
    // Never made again on EFAULT (`fwrite` returns a count, not -1): what stdio buffered by
    // then is its own.
    // SAFETY: each call writes a part of the caller's buffer.
    let done = chunked(
        ptr.cast_mut(),
        len,
        false,
        || Kind::File,
        |at, want, _| unsafe { real(at, 1, want, fp) as isize },
    );
    done as usize / size
}

/// # Safety
/// The C library's contract for `fread`.
#[no_mangle]
pub unsafe extern "C" fn fread(
    ptr: *mut c_void,
    size: usize,
    n: usize,
    fp: *mut libc::FILE,
) -> usize {
    fread_with(next!(FREAD: FreadFn), ptr, size, n, fp)
}

/// # Safety
/// The C library's contract for `fread_unlocked`.
#[no_mangle]
pub unsafe extern "C" fn fread_unlocked(
    ptr: *mut c_void,
    size: usize,
    n: usize,
    fp: *mut libc::FILE,
) -> usize {
    fread_with(next!(FREAD_UNLOCKED: FreadFn), ptr, size, n, fp)
}

/// # Safety
/// The C library's contract for `fwrite`.
#[no_mangle]
pub unsafe extern "C" fn fwrite(
    ptr: *const c_void,
    size: usize,
    n: usize,
    fp: *mut libc::FILE,
) -> usize {
    fwrite_with(next!(FWRITE: FwriteFn), ptr, size, n, fp)
}

/// # Safety
/// The C library's contract for `fwrite_unlocked`.
#[no_mangle]
pub unsafe extern "C" fn fwrite_unlocked(
    ptr: *const c_void,
    size: usize,
    n: usize,
    fp: *mut libc::FILE,
) -> usize {
    fwrite_with(next!(FWRITE_UNLOCKED: FwriteFn), ptr, size, n, fp)
}
