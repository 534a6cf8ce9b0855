//! `fork` under paging: a forked child keeps its copy of the region as it was at the fork, its
//! missing pages served by the parent's handler from the pager, and the parent's side installs
//! a page in every child that lacks it before changing it (Linux's fork semantics kept across
//! paging; Anemone §2.2's transparency to unmodified programs). Descriptors come from the
//! kernel's fork events (root) or from the child itself over a socket ([`Forks::ByChild`]).

use super::*;

pub(crate) static CHILDREN_FOLLOW: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Promises that from now on every child this process forks calls [`Region::follow_in_child`]
/// for each region before it touches one (`netram run`'s preload library does, from a
/// `pthread_atfork` child handler). Regions made afterwards are then inherited by children
/// where the kernel cannot follow forks itself (an ordinary user); without the promise they
/// are not (`MADV_DONTFORK`: a child touching one dies of SIGSEGV), since an inherited copy
/// that nobody serves would read its evicted pages as zeros.
pub fn children_follow_regions() {
    CHILDREN_FOLLOW.store(true, Ordering::Relaxed);
}

/// A descriptor for a forked child's copy of the region (see [`Forks::ByChild`]): as the
/// parent got one, without write-protection or moves (the child's pages are only installed).
pub(crate) fn open_for_child() -> Result<Uffd, Errno> {
    Uffd::open(TID, false).or_else(|_| Uffd::open_device(TID))
}

/// The socket over which forked children send their descriptors ([`Forks::ByChild`]).
#[derive(Debug)]
pub(crate) struct ForkChannel {
    /// The handler's end; closed in a child (`AtomicI32`: the child closes its copy).
    pub(crate) receiver: std::sync::atomic::AtomicI32,
    /// Every descendant's end (inherited across forks, closed at `exec`).
    pub(crate) sender: OwnedFd,
}

/// Whether child `pid` has ended (or was reaped, or is not this process's child), without
/// reaping it.
pub(crate) fn child_ended(pid: libc::pid_t) -> bool {
    // SAFETY: an all-zero siginfo_t is valid; waitid writes one and takes no other pointer.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; WNOWAIT leaves the child to whoever waits for it.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    // SAFETY: waitid filled `info` (or left it zeroed: no child has changed state).
    rc != 0 || unsafe { info.si_pid() } != 0
}

impl Drop for ForkChannel {
    fn drop(&mut self) {
        let fd = self.receiver.swap(-1, Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: the handler's end, owned here and no longer polled (the handler has
            // been joined before the region's shared state goes).
            drop(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        }
    }
}

/// What a child sends with its descriptor: its pid, its parent's, and 1 if it registered its
/// copy (0: it could not, and sends no descriptor).
pub(crate) const FORK_MESSAGE: usize = 12;

/// A forked child's copy of the region (Linux's fork semantics, kept across paging: the child
/// sees the memory as it was at the fork; its writes and the parent's later ones are each
/// their own).
///
/// The child's page tables hold what was resident at the fork (shared copy-on-write by the
/// kernel); every other page faults to `uffd`, and is served from the pager, whose copy of a
/// page the child has not got is kept equal to the fork-time contents: before the parent's
/// side changes a page in the pager (a write-back, a delete), the page is first installed in
/// every child that lacks it ([`Shared::settle`]). The child's pages are never evicted (its
/// memory is not bounded by the budget) and never written to the servers; when it exits or
/// execs, its descriptor reports that its memory is gone (ESRCH) and it is forgotten.
pub(crate) struct ForkChild {
    pub(crate) uffd: Uffd,
    /// A bit per page: the child has its own copy (resident at the fork, or installed since).
    pub(crate) settled: Vec<u64>,
    /// Its memory is gone: forgotten at the handler's next turn.
    pub(crate) gone: bool,
}

impl ForkChild {
    pub(crate) fn is_settled(&self, page: usize) -> bool {
        self.settled[page / 64] & (1 << (page % 64)) != 0
    }

    pub(crate) fn settle(&mut self, page: usize) {
        self.settled[page / 64] |= 1 << (page % 64);
    }
}

impl<T: Transport, D: Disk> Region<T, D> {
    /// Whether a forked child inherits the region (root: `UFFD_FEATURE_EVENT_FORK` needs
    /// `CAP_SYS_PTRACE`). Where it does not, the region is not mapped in the child at all.
    pub fn follows_forks(&self) -> bool {
        self.shared.follows_forks
    }

    /// Called by a thread about to `fork` (`netram run`'s `fork`): until the child's event
    /// arrives, nothing is evicted and no page changes in the pager, and the pages sampled
    /// aside come back, so that the child gets every resident page with the fork and can be
    /// served the others from the pager. Then [`Region::fork_failed`] if `fork` failed.
    pub fn prepare_fork(&self) {
        let mut st = self.shared.lock();
        self.shared.prepare_fork(&mut st);
    }

    /// In the parent, after an announced `fork` made child `pid`: where children open their
    /// own descriptors ([`Region::follow_in_child`]), waits until the handler has the child's
    /// (or the child has ended, or 30 s have passed), so that the parent's side changes no
    /// page the child may still need before the handler knows of it. As the kernel holds a
    /// `fork` until the handler has read its event where it sends one.
    pub fn await_child(&self, pid: libc::pid_t) {
        if self.shared.fork_channel.is_none() {
            return;
        }
        let since = std::time::Instant::now();
        let mut st = self.shared.lock();
        while st.forking > 0 {
            let waited = since.elapsed();
            if child_ended(pid) || waited > std::time::Duration::from_secs(30) {
                if waited > std::time::Duration::from_secs(30) {
                    tracing::warn!("forked child {pid} sent no userfaultfd in 30 s");
                }
                self.shared.fork_done(&mut st);
                break;
            }
            st = self
                .shared
                .forked
                .wait_timeout(st, std::time::Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// In a child just forked (from a `pthread_atfork` child handler, before the program goes
    /// on), where the region's faults cannot follow forks by themselves ([`Forks::ByChild`]):
    /// opens a userfaultfd of the child's own, registers the child's copy of the region and
    /// sends the descriptor to the parent's handler, which serves it from then on as it would
    /// a descriptor from a fork event. Until the handler has it, the parent waits
    /// ([`Region::await_child`]). Allocates nothing and takes no lock (another thread of the
    /// parent may have held any at the fork).
    ///
    /// An error means the child's copy is not served: its pages that were not resident at the
    /// fork would read as zeros. The caller must make the region inaccessible.
    /// Nothing to do (`Ok`) where forks are followed otherwise or not at all.
    pub fn follow_in_child(&self) -> Result<(), Errno> {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let Some(channel) = &self.shared.fork_channel else {
            return Ok(());
        };
        // The handler's end is the parent's: closed here, so that once every process that
        // could read it is gone, a descendant's send fails instead of going unread.
        let receiver = channel.receiver.swap(-1, Ordering::Relaxed);
        if receiver >= 0 {
            // SAFETY: this process's copy of the handler's end, not used here again.
            drop(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(receiver) });
        }
        let len = self.shared.pages * PAGE_SIZE;
        let opened = open_for_child()
            .and_then(|u| u.register(self.shared.base.page(0), len, false).map(|()| u));
        let mut msg = [0u8; FORK_MESSAGE];
        msg[0..4].copy_from_slice(
            &rustix::process::getpid()
                .as_raw_nonzero()
                .get()
                .to_ne_bytes(),
        );
        let parent = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
        msg[4..8].copy_from_slice(&parent.to_ne_bytes());
        msg[8..12].copy_from_slice(&u32::from(opened.is_ok()).to_ne_bytes());
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut ancillary = SendAncillaryBuffer::new(&mut space);
        let fds;
        if let Ok(u) = &opened {
            fds = [std::os::fd::AsFd::as_fd(u)];
            ancillary.push(SendAncillaryMessage::ScmRights(&fds));
        }
        let sent = rustix::net::sendmsg(
            &channel.sender,
            &[std::io::IoSlice::new(&msg)],
            &mut ancillary,
            SendFlags::NOSIGNAL,
        );
        match (opened, sent) {
            (Err(e), _) => Err(e),
            // The handler has its own copy now.
            (Ok(_), Ok(_)) => Ok(()),
            // Nobody reads the channel any more: the region's owner has ended, and gave its
            // children every page first (`hand_over_to_children`), so this process's memory
            // is whole. Dropping the descriptor unregisters the copy.
            (Ok(_), Err(Errno::PIPE | Errno::CONNREFUSED | Errno::CONNRESET)) => Ok(()),
            (Ok(_), Err(e)) => Err(e),
        }
    }

    /// The `fork` announced by [`Region::prepare_fork`] failed.
    pub fn fork_failed(&self) {
        if self.shared.follows_forks {
            let mut st = self.shared.lock();
            self.shared.fork_done(&mut st);
        }
    }

    /// Gives every live forked child the pages it still lacks and forgets the children:
    /// called before the process exits, which takes the region (and the pager they are served
    /// from) away.
    pub fn hand_over_to_children(&self) {
        let mut st = self.shared.lock();
        self.shared.hand_over(&mut st);
    }
}

impl<T: Transport, D: Disk> Shared<T, D> {
    /// The process forked (`announced`: this process, not one of its children): the child's
    /// copy of the region faults to `uffd` from now on.
    pub(crate) fn fork_event(&self, st: &mut State<T, D>, uffd: Uffd, announced: bool) {
        let words = self.pages.div_ceil(64);
        let settled = if announced && st.forking > 0 {
            let resident = st.fork_resident.clone();
            self.fork_done(st);
            resident.unwrap_or_else(|| vec![0; words])
        } else {
            // A fork nobody announced (a child forking in turn, a raw clone): nothing is known
            // of the pages the child has, so any page the parent's side changes is installed
            // in it first. A change between that fork and this event is not (see README).
            tracing::debug!("a fork that was not announced");
            vec![0; words]
        };
        self.counters.forks.fetch_add(1, Ordering::Relaxed);
        st.children.push(ForkChild {
            uffd,
            settled,
            gone: false,
        });
        st.apply_sampling();
        self.child_count.store(st.children.len(), Ordering::Release);
    }

    /// Takes the descriptors children sent over the fork channel (see
    /// [`Region::follow_in_child`]); `fd` is its handler's end.
    pub(crate) fn receive_children(&self, fd: i32) {
        use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
        // SAFETY: the handler's end of the channel, open while the handler runs.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        loop {
            let mut msg = [0u8; FORK_MESSAGE];
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut ancillary = RecvAncillaryBuffer::new(&mut space);
            let got = rustix::net::recvmsg(
                fd,
                &mut [std::io::IoSliceMut::new(&mut msg)],
                &mut ancillary,
                RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC,
            );
            let n = match got {
                Ok(r) => r.bytes,
                Err(Errno::AGAIN | Errno::INTR) => return,
                Err(e) => {
                    tracing::error!("the fork channel: {e}");
                    return;
                }
            };
            let mut uffd = None;
            for m in ancillary.drain() {
                if let RecvAncillaryMessage::ScmRights(fds) = m {
                    for f in fds {
                        uffd.get_or_insert(f);
                    }
                }
            }
            let word = |i: usize| i32::from_ne_bytes(msg[i..i + 4].try_into().expect("4 bytes"));
            if n != FORK_MESSAGE {
                continue;
            }
            let (child, parent, registered) = (word(0), word(4), word(8) == 1);
            let announced = parent == self.pid;
            let mut st = self.lock();
            match (registered, uffd) {
                (true, Some(u)) => self.fork_event(&mut st, Uffd::from_child(u), announced),
                _ => {
                    tracing::warn!("forked child {child} could not follow the region");
                    if announced && st.forking > 0 {
                        self.fork_done(&mut st);
                    }
                }
            }
        }
    }

    /// See [`Region::prepare_fork`].
    pub(crate) fn prepare_fork(&self, st: &mut State<T, D>) {
        if !self.follows_forks {
            return;
        }
        // No sampling while a child lives: moving a page aside (`UFFDIO_MOVE`) after a fork
        // was seen to leave the shadow's page missing (the handler then faulted on it and
        // waited for itself). Resumed once the children are gone (`serve_children`).
        st.clock.set_max_samples(0);
        // Sampled pages wait in the shadow, which a child does not inherit: back into the
        // region, where the child gets them with everything else resident.
        for page in 0..self.pages {
            if st.clock.is_sampled(page as u64) {
                self.put_back(st, page);
            }
        }
        if st.forking == 0 {
            let mut resident = vec![0u64; self.pages.div_ceil(64)];
            for page in 0..self.pages {
                if st.clock.is_resident(page as u64) {
                    resident[page / 64] |= 1 << (page % 64);
                }
            }
            st.fork_resident = Some(resident);
            st.forking_since = Some(std::time::Instant::now());
        }
        st.forking += 1;
    }

    /// An announced fork happened (its event came), did not happen, or its event will never
    /// come: once none is pending, evictions resume and `release` goes on.
    pub(crate) fn fork_done(&self, st: &mut State<T, D>) {
        st.forking = st.forking.saturating_sub(1);
        if st.forking == 0 {
            st.fork_resident = None;
            st.forking_since = None;
            self.forked.notify_all();
        }
    }

    /// Moves a sampled page back into the region, untouched (not counted as a use).
    pub(crate) fn put_back(&self, st: &mut State<T, D>, page: usize) {
        let shadow = self.shadow.expect("sampled pages live in the shadow");
        let (aside, addr) = (shadow.page(page), self.base.page(page));
        let moved = st.dirty[page] && self.uffd.move_page(aside, addr).is_ok();
        if !moved {
            // SAFETY: a sampled page is present in the shadow, touched only by this handler,
            // which holds the state.
            let contents = unsafe { std::slice::from_raw_parts(aside.cast::<u8>(), PAGE_SIZE) };
            // Clean pages go back write-protected, as fetched pages are.
            let protect = !st.dirty[page];
            if let Err(e) = self.uffd.copy(contents, addr, protect) {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!("putting back sampled page {page} before a fork: {e}");
                return;
            }
            let _ = drop_pages(aside, PAGE_SIZE);
        }
        st.clock.unsample(page as u64);
    }

    /// Before the parent's side changes `page` in the pager: installs its current contents in
    /// every child that lacks it, since it is the child's too (see `ForkChild`).
    pub(crate) fn settle(&self, st: &mut State<T, D>, page: usize) {
        for i in 0..st.children.len() {
            if !st.children[i].gone && !st.children[i].is_settled(page) {
                self.counters.child_copies.fetch_add(1, Ordering::Relaxed);
                self.install_in_child(st, i, page, 0);
            }
        }
    }

    /// Installs `page` as the pager has it in child `i` (for its thread `tid` if it faulted).
    pub(crate) fn install_in_child(&self, st: &mut State<T, D>, i: usize, page: usize, tid: u32) {
        let addr = self.base.page(page);
        let State {
            pager,
            children,
            child_buf,
            ..
        } = st;
        let child = &mut children[i];
        let installed = if pager.is_written(page as u64) {
            if let Err(e) = pager.read(page as u64, child_buf) {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "netram: page {page} of a region (address {:#x}) cannot be read for a \
                     forked child: {e}; SIGBUS to its thread {tid}",
                    addr as usize
                );
                if tid != 0 {
                    // SAFETY: kill(2) takes no pointers; the child's faulting thread is the
                    // child itself (a forked child starts with one thread).
                    unsafe { libc::kill(tid as libc::pid_t, libc::SIGBUS) };
                }
                let _ = child.uffd.wake(addr, PAGE_SIZE);
                return;
            }
            child.uffd.copy(child_buf, addr, false)
        } else {
            child.uffd.zeropage(addr)
        };
        match installed {
            Ok(()) | Err(rustix::io::Errno::EXIST) => child.settle(page),
            // Its memory is gone (exited, or exec'd).
            Err(rustix::io::Errno::SRCH) => child.gone = true,
            Err(e) => {
                // The mapping is changing in the child: it faults again.
                tracing::debug!("installing page {page} in a child: {e}");
                let _ = child.uffd.wake(addr, PAGE_SIZE);
            }
        }
    }

    /// Serves the children's faults (if `ready`), notices children whose memory is gone, and
    /// forgets them.
    pub(crate) fn serve_children(&self, ready: bool) {
        let mut st = self.lock();
        let now = std::time::Instant::now();
        let probe = now.duration_since(st.last_probe) >= std::time::Duration::from_millis(100);
        if probe {
            st.last_probe = now;
            if st
                .forking_since
                .is_some_and(|t| now.duration_since(t) > std::time::Duration::from_secs(5))
            {
                // Announced, and no event in 5 s: that fork failed unseen.
                tracing::warn!("a fork announced 5 s ago never happened");
                st.forking = 1;
                self.fork_done(&mut st);
            }
        }
        let mut i = 0;
        while i < st.children.len() {
            while ready && !st.children[i].gone {
                match st.children[i].uffd.read_event() {
                    Ok(Some(Event::Pagefault { addr, wp, tid, .. })) => {
                        self.child_fault(&mut st, i, addr, wp, tid)
                    }
                    Ok(Some(Event::Fork(grandchild))) => {
                        self.fork_event(&mut st, grandchild, false)
                    }
                    Ok(Some(Event::Other(_))) => {}
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!("a child's userfaultfd: {e}");
                        st.children[i].gone = true;
                    }
                }
            }
            if probe && !st.children[i].gone {
                // No event says that a child's memory is gone; an ioctl on it does (ESRCH).
                // Lifting write-protection from its first page changes nothing it can see.
                let first = self.base.page(0);
                if let Err(rustix::io::Errno::SRCH) =
                    st.children[i].uffd.set_write_protect(first, false, false)
                {
                    st.children[i].gone = true;
                }
            }
            i += 1;
        }
        st.children.retain(|c| !c.gone);
        self.child_count.store(st.children.len(), Ordering::Release);
        st.apply_sampling();
    }

    /// A fault of child `i` at `addr`.
    pub(crate) fn child_fault(
        &self,
        st: &mut State<T, D>,
        i: usize,
        addr: usize,
        wp: bool,
        tid: u32,
    ) {
        let page = (addr - self.base.0.as_ptr() as usize) / PAGE_SIZE;
        let at = self.base.page(page);
        if wp {
            // A page the parent had write-protected: the child's own now, writable. (If that
            // fails, the writer is woken all the same, to fault again rather than sleep.)
            if st.children[i]
                .uffd
                .set_write_protect(at, false, true)
                .is_err()
            {
                let _ = st.children[i].uffd.wake(at, PAGE_SIZE);
            }
            return;
        }
        self.counters.child_faults.fetch_add(1, Ordering::Relaxed);
        if st.children[i].is_settled(page) {
            // Its own copy, which it dropped (madvise): zeros, as anonymous memory reads.
            if st.children[i].uffd.zeropage(at).is_err() {
                let _ = st.children[i].uffd.wake(at, PAGE_SIZE);
            }
            return;
        }
        self.install_in_child(st, i, page, tid);
    }

    /// Installs every page the children lack and forgets them: the region is going away (the
    /// process exits), and their memory must not depend on it. Pages never written need
    /// nothing: once forgotten, the child's region is plain memory, which reads as zeros.
    pub(crate) fn hand_over(&self, st: &mut State<T, D>) {
        for i in 0..st.children.len() {
            for page in 0..self.pages {
                if st.children[i].gone {
                    break;
                }
                if !st.children[i].is_settled(page) && st.pager.is_written(page as u64) {
                    self.install_in_child(st, i, page, 0);
                }
            }
        }
        st.children.clear();
        self.child_count.store(0, Ordering::Release);
    }
}
