//! A forked child's agent: the one thread netram starts in a child, so that the child's memory
//! is held to the budget as its parent's is (issue 38; Nswap's and GMS's bound on what a node
//! keeps locally applied to each process), and so that the child is ended rather than left to
//! read zeros when its parent dies holding its pages. A child with no budget (no slot free,
//! `--child-mem unlimited`) has an agent for the second only.
//!
//! The parent's handler serves the child's faults through the child's userfaultfd, but the
//! kernel offers no way to take a page out of another process's memory (`process_madvise`
//! allows `MADV_DONTNEED` on the caller only), and reading another process's page that is not
//! resident would fault to the very handler that reads it. So the child does both itself, on
//! request: the handler write-protects the victims (a write to one then waits for the
//! handler), asks the agent to copy out those whose only copy is the child's and to drop them
//! all; the agent sends the copies (`COPIED`), drops the pages with `MADV_DONTNEED`, and says
//! so (`DROPPED`). A touch afterwards faults to the handler, which serves the page from the
//! pager. The copies travel before the drop, so a fault on a dropped page always finds its
//! copy already sent.
//!
//! The messages go over a private `SOCK_SEQPACKET` pair made before the fork; everything the
//! agent receives comes from its own parent, and everything it does is bounded by the region.
//!
//! The parent's handler is also where the child's pages on the cluster are: a parent that
//! leaves by `exit` (or `_exit`, `daemon`, the region dropped) first installs every page the
//! child lacks and says so (`HANDED`). A parent that ends without that (SIGKILL, a crash, the
//! OOM killer) closes the socket with the child's pages out of reach, and the kernel would
//! serve the child's next touch of them as zeros: the agent then ends the child, with a line
//! on its stderr saying why, rather than let it compute on zeros (a Redis child writing its
//! dump, a worker its results).
//!
//! That end must come before the child's next fault, and a busy child faults within
//! microseconds: once the last descriptor of the child's userfaultfd closes, the kernel serves
//! its faults as zeros at once (a Redis BGSAVE child was seen to die of SIGSEGV on a zeroed
//! pointer before its agent woke). So the handler gives the agent a descriptor of that very
//! userfaultfd to hold (`HOLD`): while the agent holds it the parent's death leaves the child's
//! faults waiting, not zero-filled, until the agent ends the child. On `HANDED` the handler has
//! unregistered the child's region first, so the agent's letting go changes nothing.

use netram_proto::PAGE_SIZE;
use rustix::fd::{BorrowedFd, OwnedFd};
use rustix::io::Errno;

/// Tests only: how long an agent waits, in milliseconds, between sending a request's copies
/// and dropping its pages: a child's agent slow under load, which a hand-over must wait for
/// (`fork/handover.rs`). Set before the fork; the child inherits it.
#[cfg(test)]
pub(crate) static DROP_DELAY_MS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// Victims per request at most (and so page copies per `COPIED`).
pub(crate) const BATCH: usize = 32;

/// Handler → agent: `EVICT`, sequence number, count, then per page its index in the region,
/// with [`COPY`] set when the agent must send its contents first.
pub(crate) const EVICT: u32 = 1;
pub(crate) const COPY: u32 = 1 << 31;
/// Agent → handler: `HELLO`, the child's pid and the agent's thread id, once, when the agent
/// starts (the handler looks for that thread when a request is long unanswered).
pub(crate) const HELLO: u32 = 2;
/// Agent → handler: `COPIED`, sequence number, count, then the pages' contents in order.
pub(crate) const COPIED: u32 = 3;
/// Agent → handler: `DROPPED`, sequence number: every page of that request is gone.
pub(crate) const DROPPED: u32 = 4;

/// Handler → agent: `HANDED`: the handler lets go of the child, which needs nothing more of
/// it: every page of the child is in its own memory now (its parent is leaving), or the child
/// was never held to a budget (no slot was free at its fork). The agent ends, and the child
/// goes on.
pub(crate) const HANDED: u32 = 5;

/// Handler → agent: `HOLD`, with the child's own userfaultfd as `SCM_RIGHTS`, for the agent to
/// keep open until `HANDED` (see the module's text).
pub(crate) const HOLD: u32 = 6;

/// Header of every message: kind, sequence number (or pid), count.
pub(crate) const HEADER: usize = 12;
/// The largest message either way: a `COPIED` of a whole batch.
pub(crate) const MAX_MESSAGE: usize = HEADER + BATCH * PAGE_SIZE;

pub(crate) fn header(kind: u32, seq: u32, count: u32) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0..4].copy_from_slice(&kind.to_ne_bytes());
    h[4..8].copy_from_slice(&seq.to_ne_bytes());
    h[8..12].copy_from_slice(&count.to_ne_bytes());
    h
}

pub(crate) fn word(msg: &[u8], i: usize) -> u32 {
    u32::from_ne_bytes(msg[i * 4..i * 4 + 4].try_into().expect("4 bytes"))
}

/// Tells a child's agent that the handler lets go of it (`HANDED`). A failure is not an error:
/// an agent that is gone has nothing to be told.
pub(crate) fn let_go(agent: &OwnedFd) {
    let _ = rustix::net::send(
        agent,
        &header(HANDED, 0, 0),
        rustix::net::SendFlags::NOSIGNAL,
    );
}

/// Gives a child's agent the child's own userfaultfd to hold (`HOLD`).
pub(crate) fn hold(agent: &OwnedFd, uffd: BorrowedFd<'_>) -> Result<(), Errno> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut ancillary = SendAncillaryBuffer::new(&mut space);
    let fds = [uffd];
    ancillary.push(SendAncillaryMessage::ScmRights(&fds));
    rustix::net::sendmsg(
        agent,
        &[std::io::IoSlice::new(&header(HOLD, 0, 0))],
        &mut ancillary,
        SendFlags::NOSIGNAL,
    )
    .map(drop)
}

/// Starts the agent in this (just forked) child, for the region at `base` of `pages` pages.
pub(crate) fn start(socket: OwnedFd, base: usize, pages: usize) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("netram-child".into())
        .spawn(move || {
            let parent = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
            let mut held = None;
            match serve(&socket, base, pages, &mut held) {
                Ok(End::HandedOver) => {}
                // Still holding the userfaultfd: the child's faults wait until it is ended.
                Ok(End::ParentGone) => parent_gone(parent),
                Err(e) => {
                    tracing::debug!("a forked child's agent ends: {e}");
                    if e == Errno::BADF {
                        // The program closed it, and the number may be another file's now:
                        // not closed again here.
                        std::mem::forget(socket);
                    }
                }
            }
            // Ending without ending the child: its faults must not wait on a userfaultfd
            // nobody reads, should its parent die later.
            if let Some(held) = held {
                held.release();
            }
        })
        .map(drop)
}

/// The child's own userfaultfd, as the agent holds it (`HOLD`).
struct Held {
    fd: OwnedFd,
    inode: u64,
}

impl Held {
    /// Closes it, unless the program closed it first and its number is another file's now.
    fn release(self) {
        if !rustix::fs::fstat(&self.fd).is_ok_and(|s| s.st_ino == self.inode) {
            std::mem::forget(self.fd);
        }
    }
}

/// How the agent's work ended, when its parent ended it.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// `HANDED`: the child has every page.
    HandedOver,
    /// The socket closed (or was reset) without `HANDED`: the parent is gone, the child's
    /// pages with it.
    ParentGone,
}

/// The parent ended without handing this child its pages: ends the child (SIGKILL, which it
/// cannot catch and go on from), saying why on its stderr.
fn parent_gone(parent: i32) -> ! {
    let pid = rustix::process::getpid().as_raw_nonzero().get();
    let msg = format!(
        "netram: process {parent}, which held the memory of its child {pid} on the cluster, \
         ended without handing it over (killed?): ending {pid}, whose pages are out of reach, \
         rather than let it read zeros in their place\n"
    );
    // Straight to the descriptor: the program's own stderr buffering is not ours to use.
    // SAFETY: write(2) of a buffer that lives across the call to descriptor 2, whatever it is.
    let _ = unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    // SAFETY: kill(2) takes no pointers; it ends this very process.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    // SIGKILL is delivered before kill returns to a process sending it to itself; should the
    // kernel say otherwise, the process still must not go on.
    std::process::abort()
}

fn serve(
    socket: &OwnedFd,
    base: usize,
    pages: usize,
    held: &mut Option<Held>,
) -> Result<End, Errno> {
    use rustix::net::{recvmsg, send, RecvAncillaryBuffer, RecvAncillaryMessage};
    use rustix::net::{RecvFlags, SendFlags};
    // The program may close this descriptor (a child closing every descriptor it inherited)
    // and its number be reused for another file or socket: every use checks that it is still
    // this socket, before and after, so that nothing read from anything else is acted on and
    // no page goes anywhere else.
    let inode = rustix::fs::fstat(socket)?.st_ino;
    let ours = || rustix::fs::fstat(socket).is_ok_and(|s| s.st_ino == inode);
    let pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
    let tid = rustix::thread::gettid().as_raw_nonzero().get() as u32;
    // The parent's end closed. At its death the kernel says so by an end of file once every
    // message it sent is read; when it dies with messages of ours unread (a busy child's
    // copies often are), the socket is reset first: ECONNRESET to the next receive, even
    // ahead of messages still queued for us, EPIPE to a send. A queued message may be the
    // parent's `HANDED` (a parent that handed its pages over and exited): so a reset only
    // sends the agent back to receive what is left, and the end of file, which comes after
    // it, says the parent is gone (its handler never closes a live child's socket).
    let reset = |e: Errno| matches!(e, Errno::CONNRESET | Errno::PIPE);
    let mut resets = 0;
    // Whether a send found the parent's end closed (then what is queued is read first).
    let sent = |r: Result<usize, Errno>| match r {
        Ok(_) => Ok(false),
        Err(e) if reset(e) => Ok(true),
        Err(e) => Err(e),
    };
    if sent(send(socket, &header(HELLO, pid, tid), SendFlags::NOSIGNAL))? {
        resets += 1;
    }
    let mut request = vec![0u8; HEADER + BATCH * 4];
    let mut out = vec![0u8; MAX_MESSAGE];
    loop {
        if !ours() {
            return Err(Errno::BADF);
        }
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut ancillary = RecvAncillaryBuffer::new(&mut space);
        let n = match recvmsg(
            socket,
            &mut [std::io::IoSliceMut::new(&mut request)],
            &mut ancillary,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(r) if r.bytes == 0 => return Ok(End::ParentGone),
            Ok(r) => r.bytes,
            Err(Errno::INTR) => continue,
            // (A reset is reported once; a few in a row mean nothing else will come.)
            Err(e) if reset(e) && resets < 3 => {
                resets += 1;
                continue;
            }
            Err(e) if reset(e) => return Ok(End::ParentGone),
            Err(e) => return Err(e),
        };
        // Descriptors come only with `HOLD`; any other is closed here (it is new, and ours).
        let mut fds: Vec<OwnedFd> = Vec::new();
        for m in ancillary.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = m {
                fds.extend(rights);
            }
        }
        if !ours() {
            return Err(Errno::BADF);
        }
        if n == HEADER && word(&request, 0) == HANDED {
            return Ok(End::HandedOver);
        }
        if n == HEADER && word(&request, 0) == HOLD {
            if let (None, Some(fd)) = (&held, fds.pop()) {
                let inode = rustix::fs::fstat(&fd)?.st_ino;
                *held = Some(Held { fd, inode });
            }
            continue;
        }
        // Only the parent's handler holds the other end; a message that is not a whole
        // request is a bug there, answered by ending (the handler then stops asking).
        let count = if n >= HEADER { word(&request, 2) } else { 0 } as usize;
        if n < HEADER || word(&request, 0) != EVICT || count > BATCH || n != HEADER + count * 4 {
            return Err(Errno::PROTO);
        }
        if resets > 0 {
            // The parent is gone: nobody takes the copies, and a page to copy that is not
            // resident would fault to nobody. Skipped (the pages stay): what matters now is
            // whether a `HANDED` follows.
            continue;
        }
        let seq = word(&request, 1);
        let victims: Vec<(usize, bool)> = (0..count)
            .map(|i| {
                let w = word(&request, 3 + i);
                ((w & !COPY) as usize, w & COPY != 0)
            })
            .filter(|&(page, _)| page < pages)
            .collect();
        let mut copied = 0;
        for &(page, copy) in &victims {
            if copy {
                let at = HEADER + copied * PAGE_SIZE;
                // SAFETY: a page of this process's copy of the region, which stays mapped for
                // the child's life; if it is not resident the read faults to the parent's
                // handler, which serves it (this thread is not the handler). The handler
                // write-protected it first, so no thread changes it during the copy.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (base + page * PAGE_SIZE) as *const u8,
                        out[at..at + PAGE_SIZE].as_mut_ptr(),
                        PAGE_SIZE,
                    );
                }
                copied += 1;
            }
        }
        out[..HEADER].copy_from_slice(&header(COPIED, seq, copied as u32));
        if !ours() {
            return Err(Errno::BADF);
        }
        if sent(send(
            socket,
            &out[..HEADER + copied * PAGE_SIZE],
            SendFlags::NOSIGNAL,
        ))? {
            resets += 1;
            continue;
        }
        #[cfg(test)]
        std::thread::sleep(std::time::Duration::from_millis(
            DROP_DELAY_MS.load(std::sync::atomic::Ordering::Relaxed),
        ));
        for &(page, _) in &victims {
            // The system call itself: `madvise` may be interposed (`netram run`'s library
            // takes a program's `madvise` on the region for a release, which a child skips).
            // SAFETY: drops one page of this process's copy of the region (its next touch
            // faults to the parent's handler, which serves it from the pager); no Rust
            // reference of this library's refers to region memory.
            unsafe {
                libc::syscall(
                    libc::SYS_madvise,
                    base + page * PAGE_SIZE,
                    PAGE_SIZE,
                    libc::MADV_DONTNEED,
                )
            };
        }
        if sent(send(socket, &header(DROPPED, seq, 0), SendFlags::NOSIGNAL))? {
            resets += 1;
        }
    }
}
